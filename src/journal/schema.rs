//! Journal schema and migrations (`PRAGMA user_version`).

use rusqlite::Connection;

/// The schema version this build writes. Each version's step runs once and keeps what the
/// journal recorded: step 10 drops an index, step 12 folds `declared_tools`' per-request rows
/// into per-(tool, schema, API) counts and makes `rounds_run` partial, step 16 renames
/// `tool_calls` and `events` (views of those names read them and the chat turns' folded
/// records), step 17 drops the index `chat_released` (what it indexed stays in `rounds.calls`),
/// step 18 replaces the view `events`, step 19 both views, step 20 narrows `rounds_client`;
/// no other step removes anything.
pub const VERSION: i64 = 20;

/// Sets the pragmas and brings the schema to [`VERSION`].
pub fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    if version >= VERSION {
        return Ok(());
    }
    if version < 1 {
        v1(conn)?;
    }
    if version < 2 {
        v2(conn)?;
    }
    if version < 3 {
        v3(conn)?;
    }
    if version < 4 {
        v4(conn)?;
    }
    if version < 5 {
        v5(conn)?;
    }
    if version < 6 {
        v6(conn)?;
    }
    if version < 7 {
        // The MCP front's ticket lookup (`super::mcp`).
        super::mcp::migrate(conn, 7)?;
    }
    if version < 8 {
        v8(conn)?;
    }
    if version < 9 {
        v9(conn)?;
    }
    if version < 10 {
        v10(conn)?;
    }
    if version < 11 {
        v11(conn)?;
    }
    if version < 12 {
        v12(conn)?;
    }
    if version < 13 {
        v13(conn)?;
    }
    if version < 14 {
        v14(conn)?;
    }
    if version < 15 {
        v15(conn)?;
    }
    if version < 16 {
        v16(conn)?;
    }
    if version < 17 {
        v17(conn)?;
    }
    if version < 18 {
        v18(conn)?;
    }
    if version < 19 {
        v19(conn)?;
    }
    if version < 20 {
        v20(conn)?;
    }
    Ok(())
}

/// Rebuilds `rounds_client` over chat rounds that carry the agent's `x-request-id` only
/// (`run_id IS NULL AND client_request_id IS NOT NULL`). A round whose agent sent no id has
/// `client_request_id` NULL ([`crate::request::RequestCtx::client_request_id`]), and its entry was a NULL key no
/// lookup reads: one B-tree insert, and index pages in the WAL, on every such chat turn
/// (bench/RESULTS.md, issue 13 run 30). Its one reader, `turnguard journal show chat:<id>`
/// ([`super::reader::CHAT_TURN_ROUNDS`]), asks `client_request_id = ?1`, which implies
/// `IS NOT NULL`, so SQLite still searches the index.
fn v20(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         DROP INDEX IF EXISTS rounds_client;
         CREATE INDEX rounds_client ON rounds (client_request_id)
            WHERE run_id IS NULL AND client_request_id IS NOT NULL;
         PRAGMA user_version = 20;
         COMMIT;",
    )
}

/// A chat round's calls are folded as arrays of the `tool_calls` view's columns
/// (`[choice, ordinal, call_id, …]`, [`super::CallField`]) instead of objects keyed by those
/// names: the keys were ~120 of a released call's ~300 bytes, written into each chat turn's
/// row (bench/RESULTS.md, issue 13 run 27). The views `tool_calls` and `events` are rebuilt to
/// read a call in either form ([`super::call_field`]); rows recorded before this step keep
/// objects.
fn v19(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(&format!(
        "BEGIN;
         DROP VIEW IF EXISTS tool_calls;
         {};
         DROP VIEW IF EXISTS events;
         {};
         PRAGMA user_version = 19;
         COMMIT;",
        tool_calls_view(),
        events_view()
    ))
}

/// A chat round's `agent.tool-called` event whose payload its call's folded fields rebuild
/// byte for byte is folded as `[sequence, at_ms, call]` (`call`: the call's position in
/// `rounds.calls`) instead of `{sequence, type, at_ms, payload}`: the payload repeated the
/// call's id, name and `argsHash`, and was a third of a chat turn's row (bench/RESULTS.md,
/// issue 13 run 27). The view `events` rebuilds it with `json_object`
/// ([`super::called_payload_sql`]); rows recorded before this step keep the object form, and
/// the writer still folds any other event, or one whose payload differs, as an object.
fn v18(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(&format!(
        "BEGIN;
         DROP VIEW IF EXISTS events;
         {};
         PRAGMA user_version = 18;
         COMMIT;",
        events_view()
    ))
}

/// Drops `chat_released`, step 16's index of the calls chat turns released (by `call_id`,
/// for a later tool result's `durationMs`): providers' call ids are random, so each entry was
/// a write to a random leaf page, the largest part of a chat turn's journal writes. The
/// writer remembers recent chat releases instead ([`super::released`]); the calls stay in
/// `rounds.calls`.
fn v17(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         DROP TABLE IF EXISTS chat_released;
         PRAGMA user_version = 17;
         COMMIT;",
    )
}

/// A chat turn (no `Turnguard-Run`) is journaled as one `rounds` row: its calls
/// (`rounds.calls`) and the events of its decision (`rounds.events`) are JSON arrays in it,
/// and each call it released is a `chat_released` row, the index a later tool result found
/// its call by (dropped by step 17: [`super::released`]). A run's calls and events stay one row each,
/// in the tables renamed `tool_call_rows` and `event_rows` (what replay, recovery and the MCP
/// front read by key). The views `tool_calls` and `events` show both, in the columns the
/// tables had. A folded record's `id` is `2^62 + rounds.id × 2^20 +` its position in the
/// array: above every row id (a row table's rowids grow by one from the largest, and stay
/// under 2^62), in round order, and unique while a round holds fewer than 2^20 calls (a
/// response of at least ~60 MiB, roughly twice the default `max_response_bytes` of 32 MiB)
/// and `rounds.id` stays under 2^42. `ORDER BY id` over a view lists the row store first.
///
/// SQLite's cost of a commit is the pages it touches, and each table and index is a B-tree
/// whose right edge every commit rewrites: a chat turn touched eight (three tables, five
/// indexes) and now touches five (bench/RESULTS.md, issue 13 run 23). Rows recorded before
/// this step stay where they are; the released calls of chat turns among them are indexed in
/// `chat_released` here.
fn v16(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(&format!(
        "BEGIN;
         ALTER TABLE tool_calls RENAME TO tool_call_rows;
         ALTER TABLE events RENAME TO event_rows;
         ALTER TABLE rounds ADD COLUMN calls TEXT;
         ALTER TABLE rounds ADD COLUMN events TEXT;
         CREATE TABLE chat_released (
            id INTEGER PRIMARY KEY,
            call_id TEXT NOT NULL,
            round_id INTEGER NOT NULL
         );
         CREATE INDEX chat_released_call ON chat_released (call_id, round_id);
         INSERT INTO chat_released (call_id, round_id)
            SELECT c.call_id, r.id FROM tool_call_rows c JOIN rounds r ON r.request_id = c.request_id
             WHERE r.run_id IS NULL AND c.outcome = 'executed' ORDER BY r.id, c.id;
         {TOOL_CALLS_VIEW};
         {EVENTS_VIEW};
         PRAGMA user_version = 16;
         COMMIT;"
    ))
}

/// The `tool_calls` view's first part: the rows of `tool_call_rows`, in the table's columns.
macro_rules! tool_call_rows {
    () => {
        "
     SELECT id, request_id, choice, ordinal, call_id, name, outcome, stage, reason, args_hash,
            tool_id, logical_invocation_id, node_ordinal, enforced, rules, redacted_args
       FROM tool_call_rows"
    };
}

/// `tool_calls` as step 16 made it (step 19 replaces it: [`tool_calls_view`]): the rows of
/// `tool_call_rows` and each chat round's `rounds.calls`, in the columns of the table before
/// step 16.
const TOOL_CALLS_VIEW: &str = concat!(
    "CREATE VIEW tool_calls AS",
    tool_call_rows!(),
    "
     UNION ALL
     SELECT (1 << 62) + (r.id << 20) + c.key, r.request_id, c.value ->> 'choice', c.value ->> 'ordinal',
            c.value ->> 'call_id', c.value ->> 'name', c.value ->> 'outcome',
            c.value ->> 'stage', c.value ->> 'reason', c.value ->> 'args_hash',
            c.value ->> 'tool_id', c.value ->> 'logical_invocation_id',
            c.value ->> 'node_ordinal', c.value ->> 'enforced', c.value ->> 'rules',
            c.value ->> 'redacted_args'
       FROM rounds r, json_each(r.calls) c
      WHERE r.calls IS NOT NULL"
);

/// `tool_calls` from step 19: [`TOOL_CALLS_VIEW`], each chat round's call read in either
/// folded form ([`super::call_field`]: step 16's object, step 19's array).
fn tool_calls_view() -> String {
    let fields: Vec<String> = super::CallField::ALL
        .iter()
        .map(|f| super::call_field("c.value", *f))
        .collect();
    format!(
        concat!(
            "CREATE VIEW tool_calls AS",
            tool_call_rows!(),
            "
     UNION ALL
     SELECT (1 << 62) + (r.id << 20) + c.key, r.request_id, {}
       FROM rounds r, json_each(r.calls) c
      WHERE r.calls IS NOT NULL"
        ),
        fields.join(", ")
    )
}

/// `events` as step 16 made it (step 18 replaces it: [`events_view`]): the rows of
/// `event_rows` and each chat round's `rounds.events` (scope `request:<rounds.request_id>`),
/// in the columns of the table before step 16.
const EVENTS_VIEW: &str = "CREATE VIEW events AS
     SELECT id, scope, run_id, node_id, request_id, sequence, type, payload, at_ms
       FROM event_rows
     UNION ALL
     SELECT (1 << 62) + (r.id << 20) + e.key, 'request:' || r.request_id, NULL, NULL, r.request_id,
            e.value ->> 'sequence', e.value ->> 'type', e.value ->> 'payload',
            e.value ->> 'at_ms'
       FROM rounds r, json_each(r.events) e
      WHERE r.events IS NOT NULL";

/// `events` from step 18: the rows of `event_rows`; each chat round's events folded whole
/// (objects in `rounds.events`); and each of its `agent.tool-called` events folded as
/// `[sequence, at_ms, call]`, the payload rebuilt from call `call` of `rounds.calls` (see
/// [`v18`]). A folded record's `id` is `2^62 + rounds.id × 2^20 +` its position in
/// `rounds.events`, as before.
pub(super) fn events_view() -> String {
    format!(
        "{EVENTS_VIEW} AND e.type = 'object'
     UNION ALL
     SELECT (1 << 62) + (f.round << 20) + f.place, 'request:' || f.request_id, NULL, NULL,
            f.request_id, f.event ->> 0, 'agent.tool-called', {}, f.event ->> 1
       FROM (SELECT r.id AS round, r.request_id, e.key AS place, e.value AS event,
                    r.calls -> (e.value ->> 2) AS c
               FROM rounds r, json_each(r.events) e
              WHERE r.events IS NOT NULL AND e.type = 'array') f",
        super::called_payload_sql()
    )
}

/// `served.reader` and `tool_results.reader`: who may read a served record or a recorded
/// tool result again (`person:<sub>`, or the agent when no verified person acted), as
/// `effects.reader` is for a claimed effect. Recovery and replay serve a record, and the MCP
/// front a recorded result, only to its reader; a row from before this step has none and is
/// served to nobody (fail closed: which principal recorded it is not known).
fn v15(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         ALTER TABLE served ADD COLUMN reader TEXT;
         ALTER TABLE tool_results ADD COLUMN reader TEXT;
         PRAGMA user_version = 15;
         COMMIT;",
    )
}

/// Two fixes:
/// - `rounds_client` is rebuilt over chat rounds only (`run_id IS NULL`): its one reader,
///   `turnguard journal show chat:<id>` ([`super::reader::CHAT_TURN_ROUNDS`]), asks for chat
///   rounds, and a run round no longer writes an entry to it.
/// - Declared schemas stored before they were redacted (`tool_schemas.schema`, kept as the
///   agent sent them until this version) are cleared; the digest stays, and the next
///   declaration of the schema stores its redacted text again (the insert fills a cleared
///   row: [`super::declared`]).
fn v14(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         DROP INDEX IF EXISTS rounds_client;
         CREATE INDEX rounds_client ON rounds (client_request_id) WHERE run_id IS NULL;
         UPDATE tool_schemas SET schema = NULL;
         PRAGMA user_version = 14;
         COMMIT;",
    )
}

/// Rebuilds `rounds_client` partial (`client_request_id IS NOT NULL`). It was meant to drop
/// NULL keys, but every round carries an id (the agent's `x-request-id` or the one the edge
/// gave the request), so it indexes the same rows as before; step 14 narrows it for real.
fn v13(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         DROP INDEX IF EXISTS rounds_client;
         CREATE INDEX rounds_client ON rounds (client_request_id)
            WHERE client_request_id IS NOT NULL;
         PRAGMA user_version = 13;
         COMMIT;",
    )
}

/// Two chat-turn write costs that bought nothing:
/// - `declared_tools` kept one row per (agent request, declared tool), with two index
///   entries, forever growing: an agent declaring 20 tools wrote 60 B-tree entries a request
///   for `turnguard policy learn`, which only ever counts them. `declared_tool_counts` keeps,
///   per (tool name, schema digest, API), the requests that declared it and the first and
///   last time; the writer adds a whole commit's declarations in one upsert per distinct
///   row. Existing rows are folded in (`count(DISTINCT request_id)`, which is what `learn`
///   read); `schema_digest` is `''` for a tool declared without parameters.
/// - `rounds_run` indexed every chat round under a NULL run. It is rebuilt partial (`run_id
///   IS NOT NULL`): every query that uses it names a run (`run_id = ?`).
fn v12(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         CREATE TABLE IF NOT EXISTS declared_tool_counts (
            name TEXT NOT NULL,
            schema_digest TEXT NOT NULL,
            api TEXT NOT NULL,
            requests INTEGER NOT NULL,
            first_at_ms INTEGER NOT NULL,
            last_at_ms INTEGER NOT NULL,
            PRIMARY KEY (name, schema_digest, api)
         ) WITHOUT ROWID;
         INSERT INTO declared_tool_counts (name, schema_digest, api, requests, first_at_ms, last_at_ms)
            SELECT name, coalesce(schema_digest, ''), api, count(DISTINCT request_id), min(at_ms), max(at_ms)
            FROM declared_tools GROUP BY name, coalesce(schema_digest, ''), api;
         DROP TABLE declared_tools;
         DROP INDEX IF EXISTS rounds_run;
         CREATE INDEX rounds_run ON rounds (run_id, node_id, attempt, round_index)
            WHERE run_id IS NOT NULL;
         PRAGMA user_version = 12;
         COMMIT;",
    )
}

/// Indexes released calls by `call_id` (`tool_calls_executed_call`, partial: `outcome =
/// 'executed'`). A tool result seen for the first time looks up the round that released its
/// call (for `agent.tool-returned`'s duration); without it that lookup searched `rounds_run`
/// by `run_id`, which for a chat turn (`run_id` NULL) is every chat round in the journal, on
/// every new tool result. Only released calls are indexed: refused and held ones are never
/// answered by a result. PostgreSQL has had `tool_calls_call` since V1.
fn v11(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         CREATE INDEX IF NOT EXISTS tool_calls_executed_call ON tool_calls (call_id)
            WHERE outcome = 'executed';
         PRAGMA user_version = 11;
         COMMIT;",
    )
}

/// Drops `tool_calls_args_hash` (added by step 7). Its key is a SHA-256, so every record
/// landed on a random leaf page: a commit of ~40 chat turns dirtied ~40 of its pages, each
/// written to the WAL and copied again by the checkpoint. The one query it served (the MCP
/// ticket lookup, `super::mcp`) is scoped to a run and now starts from `rounds_run`.
fn v10(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         DROP INDEX IF EXISTS tool_calls_args_hash;
         PRAGMA user_version = 10;
         COMMIT;",
    )
}

/// The output items of stored responses, for Responses `item_reference` lookups
/// (`crate::admission::trust::reference_fault`).
fn v9(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         CREATE TABLE IF NOT EXISTS response_items (
            item_id TEXT PRIMARY KEY,
            response_id TEXT NOT NULL,
            item_type TEXT NOT NULL,
            provider_executed INTEGER NOT NULL
         );
         PRAGMA user_version = 9;
         COMMIT;",
    )
}

/// Rounds, tool calls and decisions, tool results.
fn v1(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         CREATE TABLE IF NOT EXISTS rounds (
            id INTEGER PRIMARY KEY,
            request_id TEXT NOT NULL UNIQUE,
            at_ms INTEGER NOT NULL,
            api TEXT NOT NULL,
            model TEXT,
            stream INTEGER NOT NULL,
            run_id TEXT,
            node_id TEXT,
            attempt INTEGER,
            round_index INTEGER NOT NULL,
            request_digest TEXT NOT NULL,
            completion TEXT,
            finish_reason TEXT,
            upstream_status INTEGER,
            latency_ms INTEGER NOT NULL,
            state TEXT NOT NULL,
            error TEXT,
            response BLOB,
            response_bytes INTEGER NOT NULL,
            response_digest TEXT NOT NULL,
            response_truncated INTEGER NOT NULL,
            channel TEXT,
            channel_result TEXT
         );
         CREATE INDEX IF NOT EXISTS rounds_run ON rounds (run_id, node_id, attempt, round_index);
         CREATE TABLE IF NOT EXISTS tool_calls (
            id INTEGER PRIMARY KEY,
            request_id TEXT NOT NULL REFERENCES rounds (request_id),
            choice INTEGER NOT NULL,
            ordinal INTEGER NOT NULL,
            call_id TEXT NOT NULL,
            name TEXT NOT NULL,
            outcome TEXT NOT NULL,
            stage TEXT NOT NULL,
            reason TEXT NOT NULL,
            args_hash TEXT,
            tool_id TEXT,
            logical_invocation_id TEXT,
            node_ordinal INTEGER,
            enforced INTEGER NOT NULL DEFAULT 1,
            rules TEXT,
            redacted_args TEXT,
            UNIQUE (request_id, choice, ordinal)
         );
         CREATE TABLE IF NOT EXISTS tool_results (
            id INTEGER PRIMARY KEY,
            scope TEXT NOT NULL,
            run_id TEXT,
            node_id TEXT,
            attempt INTEGER,
            tool_call_id TEXT NOT NULL,
            tool_name TEXT,
            is_error INTEGER NOT NULL,
            content BLOB,
            content_bytes INTEGER NOT NULL,
            content_digest TEXT NOT NULL,
            truncated INTEGER NOT NULL,
            first_request_id TEXT NOT NULL,
            at_ms INTEGER NOT NULL,
            UNIQUE (scope, tool_call_id, content_digest)
         );
         CREATE TABLE IF NOT EXISTS effects (
            effect_id TEXT PRIMARY KEY,
            tool_id TEXT NOT NULL,
            call_id TEXT NOT NULL,
            run_id TEXT,
            node_id TEXT,
            attempt INTEGER,
            keying TEXT NOT NULL,
            state TEXT NOT NULL,
            at_ms INTEGER NOT NULL,
            released INTEGER NOT NULL DEFAULT 0,
            instance TEXT NOT NULL DEFAULT ''
         );
         CREATE INDEX IF NOT EXISTS effects_run ON effects (run_id);
         CREATE INDEX IF NOT EXISTS effects_call ON effects (call_id);
         CREATE TABLE IF NOT EXISTS events (
            id INTEGER PRIMARY KEY,
            scope TEXT NOT NULL,
            run_id TEXT,
            node_id TEXT,
            request_id TEXT NOT NULL,
            sequence INTEGER NOT NULL,
            type TEXT NOT NULL,
            payload TEXT NOT NULL,
            at_ms INTEGER NOT NULL,
            UNIQUE (scope, sequence)
         );
         CREATE TABLE IF NOT EXISTS served (
            id INTEGER PRIMARY KEY,
            run_id TEXT NOT NULL,
            node_id TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            round_index INTEGER NOT NULL,
            request_digest TEXT NOT NULL,
            request_id TEXT NOT NULL,
            status INTEGER NOT NULL,
            content_type TEXT NOT NULL,
            body BLOB,
            body_bytes INTEGER NOT NULL,
            body_digest TEXT NOT NULL,
            truncated INTEGER NOT NULL,
            calls TEXT NOT NULL,
            at_ms INTEGER NOT NULL,
            UNIQUE (run_id, node_id, attempt, round_index)
         );
         CREATE TABLE IF NOT EXISTS replay_cursor (
            run_id TEXT NOT NULL,
            node_id TEXT NOT NULL,
            skipped INTEGER NOT NULL,
            PRIMARY KEY (run_id, node_id)
         );
         PRAGMA user_version = 1;
         COMMIT;",
    )
}

/// The response chain (Responses API `previous_response_id`): one row per response the
/// provider stores, with whether its output holds provider-executed items and the
/// `contentTrust` it was recorded with. The trust rule that reads it is in the [`super`]
/// module docs.
fn v2(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         CREATE TABLE IF NOT EXISTS responses (
            response_id TEXT PRIMARY KEY,
            request_id TEXT NOT NULL,
            previous_response_id TEXT,
            run_id TEXT,
            node_id TEXT,
            attempt INTEGER,
            api TEXT NOT NULL,
            status TEXT,
            provider_executed INTEGER NOT NULL,
            provider_items TEXT NOT NULL,
            content_trust TEXT,
            at_ms INTEGER NOT NULL
         );
         CREATE INDEX IF NOT EXISTS responses_previous ON responses (previous_response_id);
         PRAGMA user_version = 2;
         COMMIT;",
    )
}

/// Tool-turn contract §C: approval interrupts (unique deterministic key, state changed only by
/// compare-and-set from `pending`), the sticky trust bit of each run, and the `contentTrust`
/// of each round.
fn v3(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         CREATE TABLE IF NOT EXISTS interrupts (
            interrupt_id TEXT PRIMARY KEY,
            key TEXT NOT NULL UNIQUE,
            kind TEXT NOT NULL,
            run_id TEXT,
            node_id TEXT,
            attempt INTEGER,
            request_id TEXT NOT NULL,
            principal TEXT,
            policy_revision TEXT NOT NULL,
            payload TEXT NOT NULL,
            calls TEXT NOT NULL,
            requested_at_ms INTEGER NOT NULL,
            expires_at_ms INTEGER NOT NULL,
            state TEXT NOT NULL,
            resolved_by TEXT,
            resolved_at_ms INTEGER,
            resume_value TEXT,
            consumed_by TEXT
         );
         CREATE INDEX IF NOT EXISTS interrupts_pending ON interrupts (state, principal);
         CREATE INDEX IF NOT EXISTS interrupts_node ON interrupts (run_id, node_id);
         CREATE TABLE IF NOT EXISTS run_trust (
            run_id TEXT PRIMARY KEY,
            trust TEXT NOT NULL,
            request_id TEXT NOT NULL,
            at_ms INTEGER NOT NULL
         );
         ALTER TABLE rounds ADD COLUMN content_trust TEXT;
         PRAGMA user_version = 3;
         COMMIT;",
    )
}

/// The position in its node that a request continuing a stored response takes
/// (`previous_response_id`, see the [`super`] module docs): the round index of that request,
/// and the names of every call of the provider-held transcript through the response, in order
/// (the per-node ordinals and the clarification count continue from them).
fn v4(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         ALTER TABLE responses ADD COLUMN next_round_index INTEGER;
         ALTER TABLE responses ADD COLUMN calls_so_far TEXT;
         PRAGMA user_version = 4;
         COMMIT;",
    )
}

/// Issue 10 (records and audit, who may approve):
/// - `rounds.request_id` is turnguard's own id from now on; the agent's `x-request-id` moves
///   to `rounds.client_request_id` (a column, never a key: a reused id dropped the second
///   round). Rows written before keep their id, copied into the new column without the
///   `#repair-N` suffix.
/// - `rounds.response_redacted`, `served.redacted`: the body kept is the redacted form (a
///   miss for replay and recovery).
/// - `effects.reader`: who may read an effect's recorded result (`person:<sub>` or `agent`;
///   `NULL` for older rows: nobody).
/// - `principal_tokens`: fingerprints of the tokens presented on the data plane, which never
///   resolve an interrupt.
fn v5(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         ALTER TABLE rounds ADD COLUMN client_request_id TEXT;
         UPDATE rounds SET client_request_id = CASE
             WHEN instr(request_id, '#repair-') > 0
             THEN substr(request_id, 1, instr(request_id, '#repair-') - 1)
             ELSE request_id END;
         CREATE INDEX IF NOT EXISTS rounds_client ON rounds (client_request_id);
         ALTER TABLE rounds ADD COLUMN response_redacted INTEGER NOT NULL DEFAULT 0;
         ALTER TABLE served ADD COLUMN redacted INTEGER NOT NULL DEFAULT 0;
         ALTER TABLE effects ADD COLUMN reader TEXT;
         CREATE TABLE IF NOT EXISTS principal_tokens (
            fingerprint TEXT PRIMARY KEY,
            expires_at_ms INTEGER NOT NULL,
            first_seen_ms INTEGER NOT NULL
         );
         PRAGMA user_version = 5;
         COMMIT;",
    )
}

/// The tools each agent request declared (`turnguard policy learn` reads them): one row per
/// (request, tool name) with the digest of its declared parameter schema, and each distinct
/// schema once, by digest (SHA-256 of its RFC 8785 form). A schema over
/// [`super::MAX_DECLARED_SCHEMA_BYTES`] keeps its digest only (`schema` NULL).
fn v6(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         CREATE TABLE IF NOT EXISTS tool_schemas (
            schema_digest TEXT PRIMARY KEY,
            schema TEXT,
            at_ms INTEGER NOT NULL
         );
         CREATE TABLE IF NOT EXISTS declared_tools (
            id INTEGER PRIMARY KEY,
            request_id TEXT NOT NULL,
            run_id TEXT,
            api TEXT NOT NULL,
            name TEXT NOT NULL,
            schema_digest TEXT,
            at_ms INTEGER NOT NULL,
            UNIQUE (request_id, name)
         );
         CREATE INDEX IF NOT EXISTS declared_tools_name ON declared_tools (name);
         PRAGMA user_version = 6;
         COMMIT;",
    )
}

/// Issue 16 (edit before approve): `interrupts.edits`, the person's edited arguments of an
/// interrupt accepted with OpenWOP `edit-accept` — per call `{callId, choice, index,
/// arguments (redacted), argsHash, modelArgsHash, editedBy, editedAt}`; the model's redacted
/// arguments stay in `calls`. `NULL`: accepted (or rejected) as raised.
fn v8(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "BEGIN;
         ALTER TABLE interrupts ADD COLUMN edits TEXT;
         PRAGMA user_version = 8;
         COMMIT;",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::OptionalExtension;

    /// A journal written by the v4 schema opens: its rows are kept, the client's id column
    /// is filled from the old key, and the new tables and columns exist.
    #[test]
    fn a_v4_journal_migrates_to_the_current_version() {
        let conn = Connection::open_in_memory().unwrap();
        for step in [v1, v2, v3, v4] {
            step(&conn).unwrap();
        }
        conn.execute_batch(
            "INSERT INTO rounds (request_id, at_ms, api, stream, round_index, request_digest,
                latency_ms, state, response_bytes, response_digest, response_truncated)
             VALUES ('client-1', 1, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0),
                    ('client-1#repair-1', 1, 'openai_chat', 0, 1, 'd', 1, 'ok', 0, 'x', 0);
             INSERT INTO effects (effect_id, tool_id, call_id, keying, state, at_ms)
             VALUES ('t/e', 'tool', 'c', 'business-identity', 'completed', 1);",
        )
        .unwrap();
        migrate(&conn).unwrap();
        let v: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(v, VERSION);
        let args_hash_index: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE name = 'tool_calls_args_hash'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(args_hash_index, 0, "step 10 drops the random-key index");
        let ids: Vec<(String, String)> = conn
            .prepare("SELECT request_id, client_request_id FROM rounds ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            ids,
            [
                ("client-1".to_owned(), "client-1".to_owned()),
                ("client-1#repair-1".to_owned(), "client-1".to_owned())
            ]
        );
        let reader: Option<String> = conn
            .query_row("SELECT reader FROM effects", [], |r| r.get(0))
            .unwrap();
        assert_eq!(reader, None, "an older effect has no reader");
        for table in ["served", "tool_results"] {
            let readers: i64 = conn
                .query_row(
                    &format!(
                        "SELECT count(*) FROM pragma_table_info('{table}') WHERE name = 'reader'"
                    ),
                    [],
                    |r| r.get(0),
                )
                .unwrap();
            assert_eq!(readers, 1, "step 15 keeps who recorded a {table} row");
        }
        conn.execute("INSERT INTO principal_tokens VALUES ('f', 1, 1)", [])
            .unwrap();
        migrate(&conn).unwrap();
    }

    /// A new tool result of a run finds the round that released its call through the call's
    /// index (`tool_call_rows`), reads the newest such round of its run, and sees no other
    /// run's calls. (A chat turn's are found in memory first: [`super::super::released`].)
    #[test]
    fn the_run_released_at_lookup_starts_from_the_call() {
        let conn = Connection::open_in_memory().unwrap();
        migrate(&conn).unwrap();
        let run: String = conn
            .prepare(&format!(
                "EXPLAIN QUERY PLAN {}",
                super::super::RELEASED_AT_RUN_SQL
            ))
            .unwrap()
            // The plan does not depend on the bound values.
            .query_map(rusqlite::params!["call_1", None::<String>], |r| {
                r.get::<_, String>(3)
            })
            .unwrap()
            .map(Result::unwrap)
            .collect::<Vec<_>>()
            .join("; ");
        assert!(
            run.starts_with("SEARCH c USING INDEX tool_calls_executed_call (call_id=?)"),
            "{run}"
        );
        assert!(
            !run.contains("rounds_run") && !run.contains("SCAN") && !run.contains("TEMP"),
            "{run}"
        );
        conn.execute_batch(
            "INSERT INTO rounds (request_id, at_ms, api, stream, round_index, request_digest,
                latency_ms, state, response_bytes, response_digest, response_truncated, run_id)
             VALUES ('q1', 40, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0, 'run-1'),
                    ('q2', 50, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0, 'run-1');
             INSERT INTO tool_call_rows (request_id, choice, ordinal, call_id, name, outcome, stage, reason)
             VALUES ('q1', 0, 0, 'call_1', 'lookup', 'executed', 'dispatch', 'ok'),
                    ('q2', 0, 0, 'call_1', 'lookup', 'refused', 'authorization', 'no');",
        )
        .unwrap();
        let at = |run: &str| -> Option<i64> {
            conn.query_row(
                super::super::RELEASED_AT_RUN_SQL,
                rusqlite::params!["call_1", run],
                |r| r.get(0),
            )
            .optional()
            .unwrap()
        };
        assert_eq!(at("run-1"), Some(40), "the run's releasing round");
        assert_eq!(at("run-2"), None, "another run sees nothing");
    }

    /// Step 12 folds per-request declarations into counts — the requests that declared each
    /// (name, schema, API), first and last seen — and keeps `rounds_run` for runs only,
    /// still chosen by a query that names a run.
    #[test]
    fn step_12_counts_declared_tools_and_indexes_run_rounds_only() {
        let conn = Connection::open_in_memory().unwrap();
        for step in [v1, v2, v3, v4, v5, v6] {
            step(&conn).unwrap();
        }
        conn.execute_batch(
            "INSERT INTO declared_tools (request_id, run_id, api, name, schema_digest, at_ms)
             VALUES ('r1', NULL, 'openai_chat', 'lookup', 'sa', 10),
                    ('r2', NULL, 'openai_chat', 'lookup', 'sa', 30),
                    ('r3', 'run', 'openai_chat', 'lookup', 'sb', 20),
                    ('r3', 'run', 'openai_chat', 'ping', NULL, 20);",
        )
        .unwrap();
        migrate(&conn).unwrap();
        let rows = super::super::declared::counts(&conn);
        let row = |n: &str, d: &str, c, f, l| (n.to_owned(), d.to_owned(), c, f, l);
        assert_eq!(
            rows,
            [
                row("lookup", "sa", 2, 10, 30),
                row("lookup", "sb", 1, 20, 20),
                row("ping", "", 1, 20, 20)
            ]
        );
        let old: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE name = 'declared_tools'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(old, 0, "the per-request table is gone");
        let index: String = conn
            .query_row(
                "SELECT sql FROM sqlite_master WHERE name = 'rounds_run'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(index.contains("WHERE run_id IS NOT NULL"), "{index}");
        let plan: String = conn
            .query_row(
                "EXPLAIN QUERY PLAN SELECT id FROM rounds WHERE run_id = ?1 AND node_id = ?2",
                ["run", "node"],
                |r| r.get(3),
            )
            .unwrap();
        assert!(plan.contains("INDEX rounds_run (run_id=?"), "{plan}");
    }

    /// Step 14 keeps `rounds_client` for chat rounds only, a chat-turn lookup by the agent's
    /// id still uses it, and declared schemas stored before redaction are cleared (digests
    /// kept).
    /// Step 16 keeps what a journal recorded before it: a chat turn's call and event rows
    /// stay rows, the views show them, and the released chat call was indexed for a later
    /// result's lookup; step 17 drops that index and nothing else.
    #[test]
    fn steps_16_and_17_keep_earlier_rows() {
        let conn = Connection::open_in_memory().unwrap();
        for step in [v1, v2, v3, v4, v5, v6] {
            step(&conn).unwrap();
        }
        super::super::mcp::migrate(&conn, 7).unwrap();
        for step in [v8, v9, v10, v11, v12, v13, v14, v15] {
            step(&conn).unwrap();
        }
        conn.execute_batch(
            "INSERT INTO rounds (request_id, at_ms, api, stream, round_index, request_digest,
                latency_ms, state, response_bytes, response_digest, response_truncated, run_id)
             VALUES ('r1', 10, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0, NULL),
                    ('q1', 20, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0, 'run-1');
             INSERT INTO tool_calls (request_id, choice, ordinal, call_id, name, outcome, stage, reason)
             VALUES ('r1', 0, 0, 'call_1', 'lookup', 'executed', 'dispatch', 'ok'),
                    ('r1', 0, 1, 'call_2', 'lookup', 'refused', 'authorization', 'no'),
                    ('q1', 0, 0, 'call_3', 'lookup', 'executed', 'dispatch', 'ok');
             INSERT INTO events (scope, request_id, sequence, type, payload, at_ms)
             VALUES ('request:r1', 'r1', 0, 'agent.tool-called', '{}', 11);",
        )
        .unwrap();
        v16(&conn).unwrap();
        let released: i64 = conn
            .query_row("SELECT count(*) FROM chat_released", [], |r| r.get(0))
            .unwrap();
        assert_eq!(released, 1, "only the chat turn's released call");
        migrate(&conn).unwrap();
        let ids: Vec<String> = conn
            .prepare("SELECT call_id FROM tool_calls ORDER BY id")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(ids, ["call_1", "call_2", "call_3"]);
        let events: i64 = conn
            .query_row(
                "SELECT count(*) FROM events WHERE scope = 'request:r1'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(events, 1);
        let gone: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE name LIKE 'chat_released%'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(gone, 0, "step 17 drops chat_released and its index");
    }

    /// A chat round without the agent's `x-request-id` writes no `rounds_client` entry; one
    /// with it does, and a run round does not (`sqlite_stat1`'s first number is the index's
    /// entry count, exact for a table this small).
    #[test]
    fn step_20_indexes_only_chat_rounds_that_carry_the_agents_id() {
        let conn = Connection::open_in_memory().unwrap();
        migrate(&conn).unwrap();
        conn.execute_batch(
            "INSERT INTO rounds (request_id, at_ms, api, stream, round_index, request_digest,
                latency_ms, state, response_bytes, response_digest, response_truncated, run_id,
                client_request_id)
             VALUES ('r1', 10, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0, NULL, NULL),
                    ('r2', 20, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0, NULL, NULL),
                    ('r3', 30, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0, NULL, 'agent-7'),
                    ('q1', 40, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0, 'run-1', 'agent-8');
             ANALYZE;",
        )
        .unwrap();
        let stat: String = conn
            .query_row(
                "SELECT stat FROM sqlite_stat1 WHERE idx = 'rounds_client'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(stat.starts_with("1 "), "one entry, for r3: {stat}");
        let found: Vec<String> = conn
            .prepare(&format!(
                "SELECT r.request_id FROM rounds r WHERE {}",
                super::super::reader::CHAT_TURN_ROUNDS
            ))
            .unwrap()
            .query_map(["agent-7"], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(found, ["r3"], "the turn is found by the agent's id");
    }

    #[test]
    fn step_14_indexes_chat_rounds_only_and_clears_unredacted_schemas() {
        let conn = Connection::open_in_memory().unwrap();
        for step in [v1, v2, v3, v4, v5, v6] {
            step(&conn).unwrap();
        }
        conn.execute_batch(
            "INSERT INTO tool_schemas (schema_digest, schema, at_ms)
             VALUES ('d1', '{\"description\":\"sk-proj-old\"}', 10);",
        )
        .unwrap();
        migrate(&conn).unwrap();
        let kept: (String, Option<String>) = conn
            .query_row("SELECT schema_digest, schema FROM tool_schemas", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .unwrap();
        assert_eq!(kept, ("d1".to_owned(), None));
        let index: String = conn
            .query_row(
                "SELECT sql FROM sqlite_master WHERE name = 'rounds_client'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(
            index.contains("WHERE run_id IS NULL AND client_request_id IS NOT NULL"),
            "{index}"
        );
        let plan: String = conn
            .query_row(
                "EXPLAIN QUERY PLAN SELECT id FROM rounds WHERE run_id IS NULL AND client_request_id = ?1",
                ["agent-id"],
                |r| r.get(3),
            )
            .unwrap();
        assert!(
            plan.contains("INDEX rounds_client (client_request_id=?"),
            "{plan}"
        );
        let sql = format!(
            "EXPLAIN QUERY PLAN SELECT r.id FROM rounds r WHERE {}",
            super::super::reader::CHAT_TURN_ROUNDS
        );
        let mut st = conn.prepare(&sql).unwrap();
        let plan: Vec<String> = st
            .query_map(["t1"], |r| r.get(3))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert!(
            plan.iter().all(|step| !step.starts_with("SCAN")),
            "`journal show chat:` searches indexes: {plan:?}"
        );
    }
}
