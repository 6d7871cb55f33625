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
//! the journal writer's CPU per chat turn rose from ~8 to ~20 µs, and the process's writes
//! from 5.5 to 13.1 KB a request). Step 17 drops it.
//!
//! Instead the writer keeps the last [`GENERATION`] to 2 × [`GENERATION`] released chat calls in
//! memory: two generations of a keyed hash of the call id → the releasing round (its rowid and
//! a keyed hash of its `request_id`), two hash tables of ~100 KB, loaded at start from the
//! `rounds.calls` of the chat rounds among the last 2 × [`GENERATION`] rounds (at most
//! [`LOAD_BUDGET_BYTES`] of them). A release is remembered when its
//! batch commits (a batch that rolls back leaves the earlier release of the id in place). A
//! result whose call is found is timed from that round, read back by rowid — its first columns
//! only, never its calls or body, so a result costs one B-tree search whatever the round holds
//! — and only if the row is still that chat round (not pruned, its rowid not reused). A result
//! for a call released longer ago than the window — at 100 released calls a second, 36 to 72
//! seconds — has no `durationMs`, as a result for a call turnguard never released has none.
//!
//! The ids are matched by their 64-bit hashes under this process's random SipHash key: two
//! ids collide with a probability of about 2^-64 a lookup, which no one outside the process
//! can raise (the key is never shown, and the journal is not readable from the data plane);
//! a collision would time a result from the other call's round. Checking the id itself
//! against the round's `rounds.calls` made the writer parse that JSON — up to a response's
//! size — for every result: an agent returning one call's result a thousand times against a
//! model's padded round stalled the writer for seconds (`attacks::chat_release_timing`).

use std::collections::HashMap;
use std::hash::BuildHasher;

use rusqlite::{params, Connection, OptionalExtension};

/// Released chat calls a generation holds before it becomes the older one (the window is one
/// to two generations): 7/8 of 4,096, the most a hash table of 4,096 slots holds, so each
/// generation is one allocation of ~100 KB.
pub(super) const GENERATION: usize = 3584;

/// Bytes of `rounds.calls` read at start, at most (newest rounds first): the load is bounded
/// whatever a model put in the rounds (a round's calls are up to a response's size).
const LOAD_BUDGET_BYTES: i64 = 16 << 20;

/// The round that released a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Release {
    /// `rounds.id`.
    round: i64,
    /// The keyed hash of `rounds.request_id` (unique): the rowid names this round and no
    /// later one that reused it.
    request: u64,
}

/// The released chat calls the writer remembers; see the module docs.
pub(super) struct ChatReleases {
    /// The keyed hash of call and request ids (SipHash with this process's random key: a
    /// caller cannot pick ids that collide).
    hasher: std::hash::RandomState,
    current: HashMap<u64, Release>,
    older: HashMap<u64, Release>,
    /// Releases of the batch being written, remembered when it commits.
    pending: HashMap<u64, Release>,
}

impl Default for ChatReleases {
    fn default() -> Self {
        ChatReleases {
            hasher: std::hash::RandomState::new(),
            current: HashMap::with_capacity(GENERATION),
            older: HashMap::new(),
            pending: HashMap::new(),
        }
    }
}

/// The released calls of the chat rounds among the last `?1` rounds, oldest first: (round
/// rowid, its `request_id`, call id; a call folded in either form, `super::call_field`), from the newest rounds whose `rounds.calls` add up to at
/// most `?2` bytes. A rowid range, and `run_id` (stored before the response body) tested before
/// `calls` (after it) is read: a run's round, whose body may be megabytes, is never read past
/// its first columns, and a journal of runs only is not scanned to its start.
fn last_releases_sql() -> String {
    format!(
        "WITH recent AS (
         SELECT id, sum(octet_length(calls)) OVER (ORDER BY id DESC) AS upto
           FROM rounds
          WHERE id > (SELECT coalesce(max(id), 0) FROM rounds) - ?1 AND run_id IS NULL
            AND calls IS NOT NULL)
     SELECT r.id, r.request_id, {}
       FROM recent k JOIN rounds r ON r.id = k.id, json_each(r.calls) c
      WHERE k.upto <= ?2 AND {} = 'executed'
      ORDER BY r.id, c.key",
        super::call_field("c.value", super::CallField::CallId),
        super::call_field("c.value", super::CallField::Outcome)
    )
}

/// The round `?1` if it is a chat round: its `request_id` and `at_ms` (columns before its
/// body and calls, so neither is read).
const ROUND_SQL: &str = "SELECT request_id, at_ms FROM rounds WHERE id = ?1 AND run_id IS NULL";

impl ChatReleases {
    /// The releases of the chat rounds among the last 2 × [`GENERATION`] rounds in `conn`
    /// (as many calls as the window holds when every round is a chat turn that released one),
    /// newest first until [`LOAD_BUDGET_BYTES`] of their calls.
    ///
    /// Errors: SQLite's, reading `rounds`.
    pub(super) fn load(conn: &Connection) -> rusqlite::Result<Self> {
        let mut releases = ChatReleases::default();
        let mut st = conn.prepare(&last_releases_sql())?;
        let mut rows = st.query(params![(2 * GENERATION) as i64, LOAD_BUDGET_BYTES])?;
        while let Some(row) = rows.next()? {
            let round: i64 = row.get(0)?;
            let request: String = row.get(1)?;
            if let Some(call_id) = row.get::<_, Option<String>>(2)? {
                releases.remember(round, &request, [call_id.as_str()]);
            }
        }
        releases.settle(true);
        Ok(releases)
    }

    /// Notes that chat round `round` (its rowid; `request_id` `request`) released `call_ids`,
    /// remembered once the batch commits ([`ChatReleases::settle`]); a later release of the
    /// same id wins.
    pub(super) fn remember<'a>(
        &mut self,
        round: i64,
        request: &str,
        call_ids: impl IntoIterator<Item = &'a str>,
    ) {
        let release = Release {
            round,
            request: self.hasher.hash_one(request),
        };
        for call_id in call_ids {
            self.pending.insert(self.hasher.hash_one(call_id), release);
        }
    }

    /// The batch's releases are remembered (`committed`) or forgotten (it rolled back).
    pub(super) fn settle(&mut self, committed: bool) {
        if !committed {
            self.pending.clear();
            return;
        }
        for (key, release) in self.pending.drain() {
            if self.current.len() >= GENERATION {
                self.older =
                    std::mem::replace(&mut self.current, HashMap::with_capacity(GENERATION));
            }
            self.current.insert(key, release);
        }
    }

    /// When the chat round that last released `call_id` did (its `at_ms`), if that round is
    /// within the window and still in the journal. The batch being written counts.
    ///
    /// Errors: SQLite's, reading the round.
    pub(super) fn released_at(
        &self,
        tx: &Connection,
        call_id: &str,
    ) -> rusqlite::Result<Option<i64>> {
        let key = self.hasher.hash_one(call_id);
        let found = self
            .pending
            .get(&key)
            .or_else(|| self.current.get(&key))
            .or_else(|| self.older.get(&key));
        let Some(release) = found.copied() else {
            return Ok(None);
        };
        let row: Option<(String, i64)> = tx
            .prepare_cached(ROUND_SQL)?
            .query_row(params![release.round], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        Ok(row
            .filter(|(request, _)| self.hasher.hash_one(request.as_str()) == release.request)
            .map(|(_, at_ms)| at_ms))
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

    /// `remember` and the commit of its batch.
    fn committed(releases: &mut ChatReleases, call: &str, round: i64, request: &str) {
        releases.remember(round, request, [call]);
        releases.settle(true);
    }

    #[test]
    fn a_release_is_timed_from_its_round_while_that_round_is_in_the_journal() {
        let conn = journal();
        let a = chat_round(&conn, "r1", 1_000, &released("call_a", "executed"));
        let mut releases = ChatReleases::default();
        committed(&mut releases, "call_a", a, "r1");
        assert_eq!(releases.released_at(&conn, "call_a").unwrap(), Some(1_000));
        assert_eq!(releases.released_at(&conn, "call_never").unwrap(), None);
        // The round is pruned: nothing to time from.
        conn.execute("DELETE FROM rounds WHERE id = ?1", [a])
            .unwrap();
        assert_eq!(releases.released_at(&conn, "call_a").unwrap(), None);
        // Its rowid is taken by another round (the table emptied, or a batch rolled back):
        // that round did not release the call.
        let other = chat_round(&conn, "r2", 2_000, &released("call_b", "executed"));
        assert_eq!(other, a, "the rowid is reused");
        assert_eq!(releases.released_at(&conn, "call_a").unwrap(), None);
    }

    #[test]
    fn a_run_round_never_times_a_chat_result() {
        let conn = journal();
        conn.execute(
            "INSERT INTO rounds (request_id, at_ms, api, stream, run_id, round_index,
                request_digest, latency_ms, state, response_bytes, response_digest,
                response_truncated)
             VALUES ('q1', 5, 'openai_chat', 0, 'run-1', 0, 'd', 0, 'ok', 0, 'd', 0)",
            [],
        )
        .unwrap();
        let mut releases = ChatReleases::default();
        committed(&mut releases, "call_r", conn.last_insert_rowid(), "q1");
        assert_eq!(releases.released_at(&conn, "call_r").unwrap(), None);
    }

    #[test]
    fn a_batch_counts_its_own_releases_and_a_rolled_back_one_leaves_the_earlier() {
        let conn = journal();
        let first = chat_round(&conn, "r1", 100, &released("call_x", "executed"));
        let mut releases = ChatReleases::default();
        committed(&mut releases, "call_x", first, "r1");
        // A later batch releases the same id again: within the batch, the later round.
        let second = chat_round(&conn, "r2", 200, &released("call_x", "executed"));
        releases.remember(second, "r2", ["call_x"]);
        assert_eq!(releases.released_at(&conn, "call_x").unwrap(), Some(200));
        // The batch rolls back (its round is gone with it): the first release stands.
        conn.execute("DELETE FROM rounds WHERE id = ?1", [second])
            .unwrap();
        releases.settle(false);
        assert_eq!(releases.released_at(&conn, "call_x").unwrap(), Some(100));
    }

    #[test]
    fn the_window_keeps_one_to_two_generations_and_a_later_release_wins() {
        let conn = journal();
        let first = chat_round(&conn, "r0", 10, &released("call_0", "executed"));
        let mut releases = ChatReleases::default();
        committed(&mut releases, "call_0", first, "r0");
        for i in 1..GENERATION {
            committed(&mut releases, &format!("call_{i}"), first, "r0");
        }
        // One generation full, the next begins: the first call is in the older one.
        committed(&mut releases, "call_next", first, "r0");
        assert_eq!(releases.released_at(&conn, "call_0").unwrap(), Some(10));
        for i in 0..GENERATION {
            committed(&mut releases, &format!("later_{i}"), first, "r0");
        }
        // Two generations on, it has left the window.
        assert_eq!(releases.released_at(&conn, "call_0").unwrap(), None);
        // The same id released again is timed from the later round.
        let again = chat_round(&conn, "r9", 90, &released("call_0", "executed"));
        committed(&mut releases, "call_0", again, "r9");
        assert_eq!(releases.released_at(&conn, "call_0").unwrap(), Some(90));
    }

    fn plan(conn: &Connection, sql: &str, args: impl rusqlite::Params) -> String {
        conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .unwrap()
            .query_map(args, |r| r.get::<_, String>(3))
            .unwrap()
            .map(Result::unwrap)
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The check reads one row by rowid, whatever the journal's size.
    #[test]
    fn the_check_reads_the_round_by_rowid() {
        let conn = journal();
        let plan = plan(&conn, ROUND_SQL, params![1]);
        assert!(
            plan.starts_with("SEARCH rounds USING INTEGER PRIMARY KEY (rowid=?)"),
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
    /// than 2 × [`GENERATION`] rounds of runs is not looked for; and it reads at most
    /// [`LOAD_BUDGET_BYTES`] of calls, newest first.
    #[test]
    fn loading_reads_a_rowid_range_of_the_last_rounds_within_a_budget() {
        let conn = journal();
        let plan = plan(&conn, &last_releases_sql(), params![10, 10]);
        assert!(
            plan.contains("SEARCH rounds USING INTEGER PRIMARY KEY (rowid>?)"),
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
        // A round whose calls alone exceed the budget, then a small one after it.
        let padded = serde_json::json!([{"call_id": "call_padded", "outcome": "executed",
            "name": "x".repeat(LOAD_BUDGET_BYTES as usize)}]);
        chat_round(&conn, "padded", 3, &padded.to_string());
        chat_round(&conn, "new", 4, &released("call_near", "executed"));
        let releases = ChatReleases::load(&conn).unwrap();
        assert_eq!(releases.released_at(&conn, "call_near").unwrap(), Some(4));
        assert_eq!(releases.released_at(&conn, "call_padded").unwrap(), None);
        assert_eq!(releases.released_at(&conn, "call_far").unwrap(), None);
    }
}
