//! Which chat turns' event scopes (`request:<round id>`) the SQLite writer has written rows
//! to, so a chat round's folded events (`rounds.events`, schema step 16) are numbered without
//! reading `event_rows` when nothing can be there.
//!
//! Why it holds: a round id is made by this process for one request (its UUIDv7 journal id,
//! `#repair-N` after it; `mcp:` and a UUIDv4 for an MCP call), so a row in its scope can only
//! have been written by this process's writer, through [`super::insert_event`], after the
//! request arrived. The writer notes every such scope here; past [`EventScopes::CAPACITY`]
//! scopes it forgets them all and, from then on, reads the journal for any round whose
//! request arrived before it forgot ([`EventScopes::may_hold`]): `Instant` is monotonic
//! across threads, so a request that arrived later had every row of its scope written after
//! that, and noted. A scope noted in a batch that rolled back stays noted: one more read, never
//! a missed row.

use std::collections::HashSet;
use std::time::Instant;

/// The chat scopes with rows in `event_rows`, as far as this writer knows.
pub(super) struct EventScopes {
    /// Round ids whose `request:` scope got a row since `since`.
    written: HashSet<String>,
    /// When the writer last forgot (or started): a round whose request arrived before this
    /// may have rows it no longer knows of.
    since: Instant,
}

impl Default for EventScopes {
    fn default() -> Self {
        Self {
            written: HashSet::new(),
            since: Instant::now(),
        }
    }
}

impl EventScopes {
    /// Scopes remembered before all are forgotten (~60 bytes each: a chat turn writes rows to
    /// its scope when it carries tool results, is held for approval, or is refused in a way
    /// that records an event outside its round).
    const CAPACITY: usize = 4096;

    /// Notes that round `round_id`'s chat scope holds a row.
    pub(super) fn note(&mut self, round_id: &str) {
        if self.written.contains(round_id) {
            return;
        }
        if self.written.len() >= Self::CAPACITY {
            self.written.clear();
            self.since = Instant::now();
        }
        self.written.insert(round_id.to_owned());
    }

    /// Whether round `round_id`'s chat scope may hold a row, for a request that arrived at
    /// `arrived`: `false` only when none can.
    pub(super) fn may_hold(&self, round_id: &str, arrived: Instant) -> bool {
        arrived <= self.since || self.written.contains(round_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_is_known_once_noted_and_a_request_from_before_a_forget_is_always_read() {
        let tick = || std::thread::sleep(std::time::Duration::from_millis(1));
        let before = Instant::now();
        tick();
        let mut scopes = EventScopes::default();
        tick();
        let arrived = Instant::now();
        assert!(!scopes.may_hold("r1", arrived));
        assert!(
            scopes.may_hold("r1", before),
            "arrived before the writer started"
        );
        scopes.note("r1");
        assert!(scopes.may_hold("r1", arrived));
        assert!(!scopes.may_hold("r2", arrived));
        for i in 0..EventScopes::CAPACITY {
            scopes.note(&format!("s{i}"));
        }
        // The set filled up and was forgotten: r1 is no longer listed, but its request
        // arrived before the forget, so it is read.
        assert!(scopes.written.len() < EventScopes::CAPACITY);
        assert!(scopes.may_hold("r1", arrived));
        assert!(scopes.may_hold("r2", arrived));
        tick();
        let later = Instant::now();
        assert!(!scopes.may_hold("r2", later));
    }
}
