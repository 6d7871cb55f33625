//! The calls recent chat turns released, as the SQLite writer remembers them: what a later
//! tool result's `agent.tool-returned` takes its `durationMs` from (OpenWOP: the time from the
//! call's release to its result, recorded once).
//!
//! A run's calls are rows of `tool_call_rows`, found by their `call_id` index
//! ([`super::RELEASED_AT_RUN_SQL`]): a run's records are durable, and replay re-emits the
//! event. A chat turn's calls are JSON in its `rounds` row (schema step 16), and chat turns are
//! out of replay's scope (tool-turn contract §D), so their duration is telemetry. Schema step
//! 16 kept a `chat_released (call_id, round_id)` index for it, and that index cost more
//! than the rest of a chat turn's record: providers' call ids are random, so each released call
//! landed on a random leaf page, which the commit wrote to the WAL and the checkpoint copied
//! again (bench/RESULTS.md, issue 13 run 25: with a fresh call id per answer, as providers send,
//! the journal writer's CPU per chat turn rose from ~8 to ~18 µs and its file writes from
//! ~3.4 to ~11 KB). Step 17 drops it.
//!
//! Instead the writer keeps the last [`GENERATION`] to 2 × [`GENERATION`] released chat calls in
//! memory (two generations of a keyed hash of the call id → the releasing round's rowid, two
//! hash tables of ~70 KB), loaded at start from the `rounds.calls` of the chat rounds among the last rounds. A result whose
//! call is found there is timed from its round, read back by rowid and checked to hold that
//! call as released (so a hash collision, a round pruned since, or a batch that rolled back
//! never times a result from another call). A result for a call released longer ago than the
//! window — at 100 released calls a second, 36 to 72 seconds — has no `durationMs`, as a
//! result for a call turnguard never released has none.

use std::collections::HashMap;
use std::hash::BuildHasher;

use rusqlite::{params, Connection, OptionalExtension};

/// Released chat calls a generation holds before it becomes the older one (the window is one
/// to two generations): 7/8 of 4,096, the most a hash table of 4,096 slots holds, so each
/// generation is one allocation of ~70 KB.
pub(super) const GENERATION: usize = 3584;

/// The released chat calls the writer remembers; see the module docs.
pub(super) struct ChatReleases {
    /// The keyed hash of a call id (SipHash with this process's random key: a caller cannot
    /// pick ids that collide).
    hasher: std::hash::RandomState,
    current: HashMap<u64, i64>,
    older: HashMap<u64, i64>,
}

impl Default for ChatReleases {
    fn default() -> Self {
        ChatReleases {
            hasher: std::hash::RandomState::new(),
            current: HashMap::with_capacity(GENERATION),
            older: HashMap::new(),
        }
    }
}

/// The released calls of the chat rounds among the last `?1` rounds, oldest first: (round
/// rowid, call id). A rowid range, and `run_id` (stored before the response body) tested before
/// `calls` (after it) is read: a run's round, whose body may be megabytes, is never read past
/// its first columns, and a journal of runs only is not scanned to its start.
const LAST_RELEASES_SQL: &str = "SELECT r.id, c.value ->> 'call_id'
       FROM rounds r, json_each(r.calls) c
      WHERE r.id > (SELECT coalesce(max(id), 0) FROM rounds) - ?1 AND r.run_id IS NULL
        AND c.value ->> 'outcome' = 'executed'
      ORDER BY r.id, c.key";

/// When the chat round `?1` released call `?2`: its `at_ms`, if that round is a chat round
/// holding the call as released.
const RELEASED_IN_ROUND_SQL: &str = "SELECT r.at_ms FROM rounds r
      WHERE r.id = ?1 AND r.run_id IS NULL
        AND EXISTS (SELECT 1 FROM json_each(r.calls) c
                     WHERE c.value ->> 'call_id' = ?2 AND c.value ->> 'outcome' = 'executed')";

impl ChatReleases {
    /// The releases of the chat rounds among the last 2 × [`GENERATION`] rounds in `conn`
    /// (as many calls as the window holds when every round is a chat turn that released one).
    ///
    /// Errors: SQLite's, reading `rounds`.
    pub(super) fn load(conn: &Connection) -> rusqlite::Result<Self> {
        let mut releases = ChatReleases::default();
        let mut st = conn.prepare(LAST_RELEASES_SQL)?;
        let mut rows = st.query(params![(2 * GENERATION) as i64])?;
        while let Some(row) = rows.next()? {
            let round: i64 = row.get(0)?;
            if let Some(call_id) = row.get::<_, Option<String>>(1)? {
                releases.remember(&call_id, round);
            }
        }
        Ok(releases)
    }

    /// Remembers that chat round `round` (its rowid) released `call_id`; a later release of
    /// the same id wins.
    pub(super) fn remember(&mut self, call_id: &str, round: i64) {
        if self.current.len() >= GENERATION {
            self.older = std::mem::replace(&mut self.current, HashMap::with_capacity(GENERATION));
        }
        self.current.insert(self.hasher.hash_one(call_id), round);
    }

    /// When the chat round that last released `call_id` did (its `at_ms`), if that round is
    /// within the window and still holds the call as released.
    ///
    /// Errors: SQLite's, reading the round.
    pub(super) fn released_at(
        &self,
        tx: &Connection,
        call_id: &str,
    ) -> rusqlite::Result<Option<i64>> {
        let key = self.hasher.hash_one(call_id);
        let Some(&round) = self.current.get(&key).or_else(|| self.older.get(&key)) else {
            return Ok(None);
        };
        tx.prepare_cached(RELEASED_IN_ROUND_SQL)?
            .query_row(params![round, call_id], |r| r.get(0))
            .optional()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn journal() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        super::super::schema::migrate(&conn).unwrap();
        conn
    }

    fn chat_round(conn: &Connection, request: &str, at_ms: i64, calls: &str) -> i64 {
        conn.execute(
            "INSERT INTO rounds (request_id, at_ms, api, stream, round_index, request_digest,
                latency_ms, state, response_bytes, response_digest, response_truncated, calls)
             VALUES (?1, ?2, 'openai_chat', 0, 0, 'd', 0, 'ok', 0, 'd', 0, ?3)",
            params![request, at_ms, calls],
        )
        .unwrap();
        conn.last_insert_rowid()
    }

    fn released(call: &str, outcome: &str) -> String {
        serde_json::json!([{"call_id": call, "outcome": outcome}]).to_string()
    }

    #[test]
    fn a_release_is_timed_from_its_round_and_only_while_the_round_holds_it() {
        let conn = journal();
        let a = chat_round(&conn, "r1", 1_000, &released("call_a", "executed"));
        let held = chat_round(&conn, "r2", 2_000, &released("call_h", "held"));
        let mut releases = ChatReleases::default();
        releases.remember("call_a", a);
        // A held call is never remembered by the writer; were it, the round does not hold it
        // as released.
        releases.remember("call_h", held);
        assert_eq!(releases.released_at(&conn, "call_a").unwrap(), Some(1_000));
        assert_eq!(releases.released_at(&conn, "call_h").unwrap(), None);
        assert_eq!(releases.released_at(&conn, "call_never").unwrap(), None);
        // The round is pruned (or its batch rolled back): nothing to time from.
        conn.execute("DELETE FROM rounds WHERE id = ?1", [a])
            .unwrap();
        assert_eq!(releases.released_at(&conn, "call_a").unwrap(), None);
    }

    #[test]
    fn the_window_keeps_one_to_two_generations_and_a_later_release_wins() {
        let conn = journal();
        let first = chat_round(&conn, "r0", 10, &released("call_0", "executed"));
        let mut releases = ChatReleases::default();
        releases.remember("call_0", first);
        for i in 1..GENERATION {
            releases.remember(&format!("call_{i}"), first);
        }
        // One generation full, the next begins: the first call is in the older one.
        releases.remember("call_next", first);
        assert_eq!(releases.released_at(&conn, "call_0").unwrap(), Some(10));
        for i in 0..GENERATION {
            releases.remember(&format!("later_{i}"), first);
        }
        // Two generations on, it has left the window.
        assert_eq!(releases.released_at(&conn, "call_0").unwrap(), None);
        // The same id released again is timed from the later round.
        let again = chat_round(&conn, "r9", 90, &released("call_0", "executed"));
        releases.remember("call_0", again);
        assert_eq!(releases.released_at(&conn, "call_0").unwrap(), Some(90));
    }

    /// The check reads one row by rowid, whatever the journal's size.
    #[test]
    fn the_check_reads_the_round_by_rowid() {
        let conn = journal();
        let plan: String = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {RELEASED_IN_ROUND_SQL}"))
            .unwrap()
            .query_map(params![1, "call_1"], |r| r.get::<_, String>(3))
            .unwrap()
            .map(Result::unwrap)
            .collect::<Vec<_>>()
            .join("; ");
        assert!(
            plan.starts_with("SEARCH r USING INTEGER PRIMARY KEY (rowid=?)"),
            "{plan}"
        );
    }

    #[test]
    fn loading_remembers_the_last_chat_rounds_released_calls() {
        let conn = journal();
        chat_round(&conn, "r1", 100, &released("call_old", "executed"));
        chat_round(&conn, "r2", 200, &released("call_denied", "denied"));
        let calls = serde_json::json!([{"call_id": "call_x", "outcome": "executed"},
                                        {"call_id": "call_y", "outcome": "executed"}]);
        chat_round(&conn, "r3", 300, &calls.to_string());
        let releases = ChatReleases::load(&conn).unwrap();
        assert_eq!(releases.released_at(&conn, "call_old").unwrap(), Some(100));
        assert_eq!(releases.released_at(&conn, "call_x").unwrap(), Some(300));
        assert_eq!(releases.released_at(&conn, "call_y").unwrap(), Some(300));
        assert_eq!(releases.released_at(&conn, "call_denied").unwrap(), None);
    }

    /// Loading reads the last rounds by rowid, whatever they are: a chat round further back
    /// than 2 × [`GENERATION`] rounds of runs is not looked for.
    #[test]
    fn loading_reads_a_rowid_range_of_the_last_rounds() {
        let conn = journal();
        let plan: String = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {LAST_RELEASES_SQL}"))
            .unwrap()
            .query_map(params![10], |r| r.get::<_, String>(3))
            .unwrap()
            .map(Result::unwrap)
            .collect::<Vec<_>>()
            .join("; ");
        assert!(
            plan.contains("SEARCH r USING INTEGER PRIMARY KEY (rowid>?)"),
            "{plan}"
        );
        chat_round(&conn, "old", 1, &released("call_far", "executed"));
        let mut st = conn
            .prepare(
                "INSERT INTO rounds (request_id, at_ms, api, stream, run_id, round_index,
                    request_digest, latency_ms, state, response_bytes, response_digest,
                    response_truncated)
                 VALUES (?1, 2, 'openai_chat', 0, 'run-1', 0, 'd', 0, 'ok', 0, 'd', 0)",
            )
            .unwrap();
        for i in 0..2 * GENERATION {
            st.execute([format!("run-round-{i}")]).unwrap();
        }
        chat_round(&conn, "new", 3, &released("call_near", "executed"));
        let releases = ChatReleases::load(&conn).unwrap();
        assert_eq!(releases.released_at(&conn, "call_near").unwrap(), Some(3));
        assert_eq!(releases.released_at(&conn, "call_far").unwrap(), None);
    }
}
