//! The SQLite journal's retention (`journal_retention_days`; the server prunes hourly): what
//! is older than the cut-off is deleted without reading what stays.
//!
//! The append-only tables (`rounds`, `tool_results`, `event_rows`, `served`) key their rows by
//! `id INTEGER PRIMARY KEY` and receive them in commit order, so their old rows are a prefix
//! of rowid order: every row before the first one at or after the cut-off. Finding that row
//! reads the old rows and one more, and the delete is a rowid range. (`DELETE … WHERE at_ms <
//! t` read every row of each table every hour, inside the writer's transaction, while the
//! requests waiting on a commit queued behind it.) A row whose `at_ms` (its request's start)
//! is older than that of a row committed before it (a round that outlived a shorter one) stays
//! until every row committed before it is old too: at most its request's duration late. No row
//! at or after the cut-off is deleted, with one exception: a row dated more than
//! [`FUTURE_SLACK_MS`] after the prune's own clock (a clock that stepped forward, then back)
//! cannot hold the cut, or everything committed after it would outlive the retention by the
//! clock's error; it goes with the rows around it.
//!
//! The small tables (`effects`, keyed by effect id; the declared-tool counts, schemas and
//! principal tokens) are still filtered by time.

use rusqlite::{params, OptionalExtension};

use super::{exec, KnownSchemas};

/// The append-only tables pruned by rowid prefix (their rows' `at_ms` follow commit order).
const APPEND_ONLY: [&str; 4] = ["rounds", "tool_results", "event_rows", "served"];

/// How far after the prune's clock a row's `at_ms` may lie and still hold the cut, ms (a
/// day: far beyond any skew between the clock a record was stamped with and the prune's).
pub(super) const FUTURE_SLACK_MS: i64 = 24 * 60 * 60 * 1000;

/// The first rowid of `table` that is kept at cut-off `?1`: the first row at or after it
/// and not after `?2` (the prune's clock plus [`FUTURE_SLACK_MS`]), or one past the last row
/// when none is (NULL for an empty table, which keeps nothing to delete). Reads the old rows
/// and one more.
fn first_kept_sql(table: &str) -> String {
    format!(
        "SELECT coalesce((SELECT id FROM {table} WHERE at_ms >= ?1 AND at_ms <= ?2 ORDER BY id LIMIT 1),
                         (SELECT max(id) + 1 FROM {table}))"
    )
}

/// Deletes what is older than `t` (ms since the epoch) from every table that ages out; see
/// the module docs.
pub(super) fn prune(
    tx: &rusqlite::Connection,
    t: i64,
    known: &mut KnownSchemas,
) -> rusqlite::Result<()> {
    // The prune may delete stored schemas: store them again when next declared.
    known.committed.clear();
    known.pending.clear();
    let latest = crate::clock::now_ms().saturating_add(FUTURE_SLACK_MS);
    for table in APPEND_ONLY {
        let first_kept: Option<i64> = tx
            .prepare_cached(&first_kept_sql(table))?
            .query_row(params![t, latest], |r| r.get(0))
            .optional()?
            .flatten();
        let Some(first_kept) = first_kept else {
            continue;
        };
        if table == "rounds" {
            // A round's calls go with it: a run's rows (`tool_call_rows.request_id`
            // references it; a chat round holds its own, and the writer's memory of its
            // releases finds it gone: [`super::released`]).
            exec(
                tx,
                "DELETE FROM tool_call_rows WHERE request_id IN (SELECT request_id FROM rounds WHERE id < ?1)",
                params![first_kept],
            )?;
        }
        exec(
            tx,
            &format!("DELETE FROM {table} WHERE id < ?1"),
            params![first_kept],
        )?;
    }
    exec(tx, "DELETE FROM effects WHERE at_ms < ?1", params![t])?;
    // A tool's counts age out once no request has declared it since `t`.
    exec(
        tx,
        "DELETE FROM declared_tool_counts WHERE last_at_ms < ?1",
        params![t],
    )?;
    exec(tx, "DELETE FROM tool_schemas WHERE at_ms < ?1 AND schema_digest NOT IN (SELECT schema_digest FROM declared_tool_counts)", params![t])?;
    exec(
        tx,
        "DELETE FROM principal_tokens WHERE expires_at_ms < ?1",
        params![t],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(conn: &rusqlite::Connection, at: &[i64]) {
        for (i, at_ms) in at.iter().enumerate() {
            conn.execute(
                "INSERT INTO event_rows (scope, request_id, sequence, type, payload, at_ms)
                 VALUES ('run:r', 'q', ?1, 'agent.tool-called', '{}', ?2)",
                params![i as i64, at_ms],
            )
            .unwrap();
        }
    }

    fn kept(conn: &rusqlite::Connection) -> Vec<i64> {
        let mut st = conn
            .prepare("SELECT at_ms FROM event_rows ORDER BY id")
            .unwrap();
        st.query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap()
    }

    fn prune_at(conn: &mut rusqlite::Connection, t: i64) {
        let tx = conn.transaction().unwrap();
        prune(&tx, t, &mut KnownSchemas::default()).unwrap();
        tx.commit().unwrap();
    }

    /// Old rows go and no newer one does; a straggler (older than a row committed before it)
    /// goes once the rows before it are old; an all-old table is emptied; an empty one is left
    /// alone.
    #[test]
    fn the_old_prefix_goes_and_nothing_newer() {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        super::super::schema::migrate(&conn).unwrap();
        prune_at(&mut conn, 100);
        events(&conn, &[10, 20, 30, 25, 40]);
        prune_at(&mut conn, 30);
        assert_eq!(kept(&conn), [30, 25, 40], "25 came after 30");
        prune_at(&mut conn, 35);
        assert_eq!(kept(&conn), [40]);
        prune_at(&mut conn, 1_000);
        assert!(kept(&conn).is_empty());
    }

    /// A pruned chat round takes its folded calls and events (schema step 16); a kept round
    /// keeps them.
    #[test]
    fn a_pruned_chat_round_takes_its_folded_calls() {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        super::super::schema::migrate(&conn).unwrap();
        conn.execute_batch(
            "INSERT INTO rounds (request_id, at_ms, api, stream, round_index, request_digest,
                latency_ms, state, response_bytes, response_digest, response_truncated, calls, events)
             VALUES ('r1', 10, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0,
                     '[{\"call_id\":\"call_1\",\"outcome\":\"executed\"}]',
                     '[{\"sequence\":0,\"type\":\"agent.tool-called\",\"at_ms\":10,\"payload\":\"{}\"}]'),
                    ('r2', 50, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0,
                     '[{\"call_id\":\"call_2\",\"outcome\":\"executed\"}]', NULL);",
        )
        .unwrap();
        prune_at(&mut conn, 30);
        let left = |sql: &str| -> Vec<String> {
            conn.prepare(sql)
                .unwrap()
                .query_map([], |r| r.get(0))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        };
        assert_eq!(left("SELECT call_id FROM tool_calls"), ["call_2"]);
        assert!(left("SELECT type FROM events").is_empty());
    }

    /// A row stamped by a clock that had jumped a year ahead does not hold back the prune of
    /// what was committed after it; a row a minute ahead (ordinary skew) still holds the cut.
    #[test]
    fn a_row_from_a_clock_far_ahead_does_not_hold_the_cut() {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        super::super::schema::migrate(&conn).unwrap();
        let now = crate::clock::now_ms();
        let year = 365 * 24 * 60 * 60 * 1000;
        events(
            &conn,
            &[now - 10, now + year, now - 9, now + 60_000, now - 8],
        );
        prune_at(&mut conn, now);
        assert_eq!(kept(&conn), [now + 60_000, now - 8]);
    }

    /// Finding the cut in a table of which nothing is old reads one row, not the table
    /// (SQLite's own count of full-scan steps).
    #[test]
    fn a_prune_with_nothing_old_reads_one_row() {
        let conn = rusqlite::Connection::open_in_memory().unwrap();
        super::super::schema::migrate(&conn).unwrap();
        events(&conn, &vec![500; 5_000]);
        let mut st = conn.prepare(&first_kept_sql("event_rows")).unwrap();
        let first: i64 = st.query_row(params![100, 1_000], |r| r.get(0)).unwrap();
        assert_eq!(first, 1);
        let steps = st.get_status(rusqlite::StatementStatus::FullscanStep);
        assert!(steps <= 1, "{steps} rows read to find the cut");
        let mut old = conn
            .prepare("SELECT count(*) FROM event_rows WHERE at_ms < ?1")
            .unwrap();
        let _: i64 = old.query_row(params![100], |r| r.get(0)).unwrap();
        assert!(
            old.get_status(rusqlite::StatementStatus::FullscanStep) >= 4_999,
            "the filter by time reads every row"
        );
    }
}
