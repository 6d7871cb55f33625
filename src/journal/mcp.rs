//! Journal reads of the MCP front ([`crate::mcp`]): tickets and recorded MCP results.
//!
//! The MCP front writes nothing of its own: it uses the journal operations the model path
//! uses (`commit_round` for its decision, `claim_effect` / `confirm_claims` for the execution
//! claim, `record_tool_results` for the result, `record_events`, `run_untrusted`), so an MCP
//! call has the same rows as a model-emitted one. What it needs to read:
//!
//! - **tickets** ([`McpReader::tickets`]): the released model emissions of a run with a given
//!   tool name and `argsHash` — `tool_call_rows` rows with outcome `executed` (or released in
//!   shadow mode, `enforced = 0`) whose round belongs to the run and is a model round (not one
//!   of the MCP front's own decision rounds, `api = 'mcp'`);
//! - **the execution state** of an effect ([`McpReader::effect_state`], table `effects`);
//! - **a recorded result** ([`McpReader::recorded`], table `tool_results`, the MCP result as
//!   recorded: `{"result": …}` or `{"error": …}`, redacted), for a repeat and for replay.
//!
//! It keeps its own read-only connection so that its lookups never wait on the shared reader.

use std::path::Path;
use std::sync::Arc;

use rusqlite::{params, Connection, OptionalExtension};

use super::JournalError;

/// A released model emission that an MCP `tools/call` may execute (DESIGN.md §10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TicketRow {
    /// `tool_call_rows.id`: the emission's row.
    pub row: i64,
    /// The model round that released it (`rounds.request_id`).
    pub request_id: String,
    /// The provider's call id.
    pub call_id: String,
    /// The name the model called it by.
    pub name: String,
    pub node_id: Option<String>,
    pub attempt: Option<u32>,
    /// The `contentTrust` of the turn that emitted it.
    pub content_trust: Option<crate::policy::bundle::ContentTrust>,
}

/// The MCP front's journal reads, whichever backend holds the journal
/// ([`super::Journal::mcp_reader`]); every read is `async`.
#[derive(Clone)]
pub struct McpReader(Backend);

#[derive(Clone)]
enum Backend {
    Sqlite(Arc<SqliteMcpReader>),
    Postgres(deadpool_postgres::Pool),
}

impl McpReader {
    /// Opens a SQLite journal at `path` read-only (the writer must have created it).
    ///
    /// Errors: [`JournalError::Open`] naming the path.
    pub fn open(path: &Path) -> Result<Self, JournalError> {
        Ok(Self(Backend::Sqlite(Arc::new(SqliteMcpReader::open(
            path,
        )?))))
    }

    pub(super) fn postgres(pool: deadpool_postgres::Pool) -> Self {
        Self(Backend::Postgres(pool))
    }

    /// Released model emissions of `run` named one of `names` with `args_hash`, oldest first.
    pub async fn tickets(
        &self,
        run: &str,
        args_hash: &str,
        names: &[String],
    ) -> Result<Vec<TicketRow>, JournalError> {
        let (run, hash, names) = (run.to_owned(), args_hash.to_owned(), names.to_vec());
        match &self.0 {
            Backend::Sqlite(r) => {
                super::reader::read_blocking(r, move |r| r.tickets(&run, &hash, &names)).await
            }
            Backend::Postgres(p) => super::postgres::reader::tickets(p, &run, &hash, &names).await,
        }
    }

    /// The `state` of effect `effect_id` (`claimed`, `completed`), `None` when unclaimed.
    pub async fn effect_state(&self, effect_id: &str) -> Result<Option<String>, JournalError> {
        let id = effect_id.to_owned();
        match &self.0 {
            Backend::Sqlite(r) => {
                super::reader::read_blocking(r, move |r| r.effect_state(&id)).await
            }
            Backend::Postgres(p) => super::postgres::reader::effect_state(p, &id).await,
        }
    }

    /// The first recorded result of call `call_id` in `run` (`None`: a chat call), when it
    /// is recorded whole (a digest-only record is a miss).
    pub async fn recorded(
        &self,
        run: Option<&str>,
        call_id: &str,
        reader: &str,
    ) -> Result<Option<String>, JournalError> {
        let (run, call, who) = (
            run.map(str::to_owned),
            call_id.to_owned(),
            reader.to_owned(),
        );
        match &self.0 {
            Backend::Sqlite(r) => {
                super::reader::read_blocking(r, move |r| r.recorded(run.as_deref(), &call, &who))
                    .await
            }
            Backend::Postgres(p) => {
                super::postgres::reader::recorded(p, run.as_deref(), &call, &who).await
            }
        }
    }
}

/// Read-only SQLite connections for the MCP front (a [`super::reader::ReadPool`]).
struct SqliteMcpReader {
    pool: super::reader::ReadPool,
}

impl super::reader::Pooled for SqliteMcpReader {
    fn pool(&self) -> &super::reader::ReadPool {
        &self.pool
    }
}

impl SqliteMcpReader {
    fn open(path: &Path) -> Result<Self, JournalError> {
        Ok(Self {
            pool: super::reader::ReadPool::open(path, super::reader::READ_CONNECTIONS)?,
        })
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, JournalError> {
        self.pool.with(f)
    }

    /// Released model emissions of `run` named one of `names` with `args_hash`, oldest first.
    fn tickets(
        &self,
        run: &str,
        args_hash: &str,
        names: &[String],
    ) -> Result<Vec<TicketRow>, JournalError> {
        self.with(|c| {
            let mut st = c.prepare_cached(
                // The run's rounds first (`rounds_run`), then each round's calls (the
                // `(request_id, choice, ordinal)` key): `CROSS JOIN` fixes that order, as there
                // is no index on `args_hash` (schema step 10 says why).
                "SELECT c.id, c.request_id, c.call_id, c.name, r.node_id, r.attempt, r.content_trust
                 FROM rounds r INDEXED BY rounds_run CROSS JOIN tool_call_rows c ON c.request_id = r.request_id
                 WHERE r.run_id = ?1 AND r.api != 'mcp' AND c.args_hash = ?2
                   AND (c.outcome = 'executed' OR c.enforced = 0)
                 ORDER BY c.id",
            )?;
            let rows = st.query_map(params![run, args_hash], |r| {
                Ok(TicketRow {
                    row: r.get(0)?,
                    request_id: r.get(1)?,
                    call_id: r.get(2)?,
                    name: r.get(3)?,
                    node_id: r.get(4)?,
                    attempt: r.get(5)?,
                    content_trust: r.get(6)?,
                })
            })?;
            let all: Vec<TicketRow> = rows.collect::<rusqlite::Result<_>>()?;
            Ok(all
                .into_iter()
                .filter(|t| names.contains(&t.name))
                .collect())
        })
    }

    /// The `state` of effect `effect_id` (`claimed`, `completed`), `None` when unclaimed.
    fn effect_state(&self, effect_id: &str) -> Result<Option<String>, JournalError> {
        self.with(|c| {
            c.query_row(
                "SELECT state FROM effects WHERE effect_id = ?1",
                params![effect_id],
                |r| r.get(0),
            )
            .optional()
        })
    }

    /// The first recorded result of call `call_id` in `run` (`None`: a chat call) that
    /// `reader` may read (`tool_results.reader`: who recorded it; a run id is a name any
    /// client can send), when it is recorded whole (a digest-only record is a miss).
    fn recorded(
        &self,
        run: Option<&str>,
        call_id: &str,
        reader: &str,
    ) -> Result<Option<String>, JournalError> {
        let scope = run.map_or_else(|| "chat".to_owned(), |r| format!("run:{r}"));
        self.with(|c| {
            c.query_row(
                "SELECT content FROM tool_results WHERE scope = ?1 AND tool_call_id = ?2 AND truncated = 0
                 AND reader = ?3 ORDER BY id LIMIT 1",
                params![scope, call_id, reader],
                |r| r.get::<_, Option<Vec<u8>>>(0),
            )
            .optional()
            .map(|v| v.flatten().map(|b| String::from_utf8_lossy(&b).into_owned()))
        })
    }
}

/// Schema step 7, for the MCP front's ticket lookup: an index of `tool_calls` by `args_hash`
/// (dropped again by step 10, `super::schema`).
pub(super) fn migrate(conn: &Connection, version: i64) -> rusqlite::Result<()> {
    conn.execute_batch(&format!(
        "BEGIN;
         CREATE INDEX IF NOT EXISTS tool_calls_args_hash ON tool_calls (args_hash);
         PRAGMA user_version = {version};
         COMMIT;"
    ))
}
