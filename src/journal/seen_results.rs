//! The tool results this process has recorded, as the request path remembers them, so a result
//! the agent sends again is not prepared and written again.
//!
//! A multi-step agent sends its whole transcript every turn: at turn 30, the results of turns
//! 1–29 come again with the new one. The journal keeps a result once (`tool_results`, unique on
//! scope, call id and content digest; a repeat is `ON CONFLICT DO NOTHING`), but each repeat
//! still cost the request path its JSON text, its SHA-256, a redaction scan and a copy, and
//! the writer one index probe. With 30 results of 4 KB in a transcript, that was two thirds of
//! turnguard's CPU for the request (790–1,010 against 250–270 µs a request for the same bytes
//! without results; 330–350 µs with this memory; `bench/RESULTS.md`, issue 13, twenty-fifth
//! session).
//!
//! So the request path keeps a keyed hash of each result the journal confirmed (its commit
//! returned), and skips a result whose hash it holds: the journal already has that row. The
//! hash covers the result's scope (the run, or chat turns), who sent it (the verified person,
//! or the agent: `request::reader_of`), its call id and its content value (every string,
//! number and key, with type tags and lengths, so two different values never feed the hasher
//! the same bytes). What is skipped is only what this process recorded, so:
//! - after a restart, or for a result another replica recorded (PostgreSQL), the result is
//!   written once more and the journal's unique key keeps the first row, as before;
//! - a result whose batch did not commit is not remembered, and the next turn that carries it
//!   writes it again;
//! - a prune (`journal_retention`) forgets everything remembered ([`SeenResults::forget_all`]),
//!   so a result whose row it deleted is written again when it comes again, as before.
//!
//! Who sent it is in the key because a skip is observable: a turn whose results are all
//! recorded waits for no durable commit before it goes upstream. Without the sender, one
//! principal could time whether another sent a given result for a guessable call id (a
//! legacy `function:<name>` id). With it, a principal learns only about its own results.
//!
//! The window is the last [`GENERATION`] to 2 × [`GENERATION`] results recorded (two
//! generations of hash sets, at most ~600 KB; none until a result is recorded). A result
//! older than that is written again, and the journal's unique key drops the repeat.
//!
//! The hashes are 64-bit SipHash under this process's random key: a caller cannot pick a
//! content that collides with a recorded one without the key, which is never shown; by
//! chance, two results collide with a probability of about 2^-64 a lookup. A collision would
//! leave the later result unrecorded, and nothing else: trust, approvals and admission read
//! the request, never this memory.

use std::collections::HashSet;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;

use serde_json::Value;

/// Results a generation holds before it becomes the older one (the window is one to two
/// generations): 7/8 of 32,768, the most a hash table of 32,768 slots holds, so a full
/// generation is one allocation of ~300 KB.
pub const GENERATION: usize = 28_672;

/// The key of one tool result: see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ResultKey(u64);

/// Tool results this process recorded; see the module docs. Shared by every request (one
/// lock, held for a lookup or an insert).
pub struct SeenResults {
    hasher: std::hash::RandomState,
    sets: Mutex<Generations>,
}

#[derive(Default)]
struct Generations {
    current: HashSet<ResultKey>,
    older: HashSet<ResultKey>,
}

impl Default for SeenResults {
    fn default() -> Self {
        SeenResults {
            hasher: std::hash::RandomState::new(),
            sets: Mutex::new(Generations::default()),
        }
    }
}

impl SeenResults {
    /// The key of the result answering `call_id` with `content`, sent by `reader` (see
    /// `request::reader_of`), in the scope of `run_id` (a run) or of chat turns (`None`), the
    /// journal's `tool_results` scopes.
    pub fn key(
        &self,
        run_id: Option<&str>,
        reader: &str,
        call_id: &str,
        content: &Value,
    ) -> ResultKey {
        let mut h = self.hasher.build_hasher();
        match run_id {
            Some(run) => {
                h.write_u8(1);
                bytes(&mut h, run.as_bytes());
            }
            None => h.write_u8(0),
        }
        bytes(&mut h, reader.as_bytes());
        bytes(&mut h, call_id.as_bytes());
        value(&mut h, content);
        ResultKey(h.finish())
    }

    /// Whether the journal confirmed a result with this key (within the window).
    pub fn recorded(&self, key: ResultKey) -> bool {
        let sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        sets.current.contains(&key) || sets.older.contains(&key)
    }

    /// Forgets every result: after a prune, which may have deleted their rows.
    pub fn forget_all(&self) {
        let mut sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        *sets = Generations::default();
    }

    /// Remembers results the journal confirmed.
    pub fn remember(&self, keys: impl IntoIterator<Item = ResultKey>) {
        let mut sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        for key in keys {
            if sets.current.len() >= GENERATION {
                sets.older = std::mem::take(&mut sets.current);
            }
            sets.current.insert(key);
        }
    }
}

/// A byte string, length first (so no two sequences of them feed the same bytes).
fn bytes(h: &mut impl Hasher, b: &[u8]) {
    h.write_usize(b.len());
    h.write(b);
}

/// A JSON value, type tag first; an array or object also gives its length, an object each
/// key in order (the order its JSON text has).
fn value(h: &mut impl Hasher, v: &Value) {
    match v {
        Value::Null => h.write_u8(0),
        Value::Bool(b) => {
            h.write_u8(1);
            h.write_u8(u8::from(*b));
        }
        Value::Number(n) => {
            h.write_u8(2);
            bytes(h, n.to_string().as_bytes());
        }
        Value::String(s) => {
            h.write_u8(3);
            bytes(h, s.as_bytes());
        }
        Value::Array(list) => {
            h.write_u8(4);
            h.write_usize(list.len());
            for item in list {
                value(h, item);
            }
        }
        Value::Object(map) => {
            h.write_u8(5);
            h.write_usize(map.len());
            for (k, item) in map {
                bytes(h, k.as_bytes());
                value(h, item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_key_tells_apart_scope_call_and_every_part_of_the_content() {
        let seen = SeenResults::default();
        let base = seen.key(None, "agent", "call_1", &json!("ok"));
        assert_eq!(base, seen.key(None, "agent", "call_1", &json!("ok")));
        let others = [
            seen.key(Some("run-1"), "agent", "call_1", &json!("ok")),
            seen.key(None, "agent", "call_2", &json!("ok")),
            seen.key(None, "agent", "call_1", &json!("ok ")),
            seen.key(None, "agent", "call_1", &json!(["ok"])),
            seen.key(None, "agent", "call_1", &json!({"ok": null})),
            seen.key(None, "agent", "call_1", &json!(null)),
            seen.key(None, "person:alice", "call_1", &json!("ok")),
        ];
        assert!(others.iter().all(|k| *k != base));
        // Lengths come first: moving a byte between the call id and the content, or between
        // two strings, is another key.
        assert_ne!(
            seen.key(None, "agent", "call_1a", &json!("b")),
            seen.key(None, "agent", "call_1", &json!("ab"))
        );
        assert_ne!(
            seen.key(None, "agent", "c", &json!(["ab", "c"])),
            seen.key(None, "agent", "c", &json!(["a", "bc"]))
        );
        // Key order is part of the JSON text the journal keeps.
        let ab: Value = serde_json::from_str(r#"{"a":1,"b":2}"#).unwrap();
        let ba: Value = serde_json::from_str(r#"{"b":2,"a":1}"#).unwrap();
        assert_ne!(
            seen.key(None, "agent", "c", &ab),
            seen.key(None, "agent", "c", &ba)
        );
        assert_ne!(
            seen.key(None, "agent", "c", &json!(1)),
            seen.key(None, "agent", "c", &json!(1.0))
        );
        // Another process (another key) hashes the same result differently.
        assert_ne!(
            base,
            SeenResults::default().key(None, "agent", "call_1", &json!("ok"))
        );
    }

    #[test]
    fn the_window_keeps_one_to_two_generations() {
        let seen = SeenResults::default();
        let keys: Vec<ResultKey> = (0..2 * GENERATION + 1)
            .map(|i| seen.key(None, "agent", &format!("call_{i}"), &json!("r")))
            .collect();
        assert!(!seen.recorded(keys[0]));
        seen.remember(keys[..GENERATION].iter().copied());
        assert!(keys[..GENERATION].iter().all(|k| seen.recorded(*k)));
        // The next generation fills while the first is kept.
        seen.remember(keys[GENERATION..2 * GENERATION].iter().copied());
        assert!(keys[..2 * GENERATION].iter().all(|k| seen.recorded(*k)));
        // One more starts a third: the first is forgotten, the second kept.
        seen.remember([keys[2 * GENERATION]]);
        assert!(keys[..GENERATION].iter().all(|k| !seen.recorded(*k)));
        assert!(keys[GENERATION..].iter().all(|k| seen.recorded(*k)));
        seen.forget_all();
        assert!(keys.iter().all(|k| !seen.recorded(*k)));
    }
}
