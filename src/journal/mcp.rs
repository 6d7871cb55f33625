//! Journal reads of the MCP front ([`crate::mcp`]): tickets and recorded MCP results.
//!
//! The MCP front writes nothing of its own: it uses the journal operations the model path
//! uses (`record_round` for its decision, `claim_effect` / `confirm_claims` for the execution
//! claim, `record_tool_results` for the result, `record_events`, `run_untrusted`), so an MCP
//! call has the same rows as a model-emitted one. What it needs to read:
//!
//! - **tickets** ([`McpReader::tickets`]): the released model emissions of a run with a given
//!   tool name and `argsHash` — `tool_calls` rows with outcome `executed` (or released in
//!   shadow mode, `enforced = 0`) whose round belongs to the run and is a model round (not one
//!   of the MCP front's own decision rounds, `api = 'mcp'`);
//! - **the execution state** of an effect ([`McpReader::effect_state`], table `effects`);
//! - **a recorded result** ([`McpReader::recorded`], table `tool_results`, the MCP result as
//!   recorded: `{"result": …}` or `{"error": …}`, redacted), for a repeat and for replay.
//!
//! It keeps its own read-only connection so that its lookups never wait on the shared reader.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};

use super::JournalError;

/// A released model emission that an MCP `tools/call` may execute (DESIGN.md §10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TicketRow {
    /// `tool_calls.id`: the emission's row.
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

/// Read-only journal connections for the MCP front (a [`super::reader::ReadPool`]).
pub struct McpReader {
    pool: super::reader::ReadPool,
}

impl McpReader {
    /// Opens `path` read-only (the writer must have created it).
    pub fn open(path: &Path) -> Result<Self, JournalError> {
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
    pub fn tickets(
        &self,
        run: &str,
        args_hash: &str,
        names: &[String],
    ) -> Result<Vec<TicketRow>, JournalError> {
        self.with(|c| {
            let mut st = c.prepare_cached(
                "SELECT c.id, c.request_id, c.call_id, c.name, r.node_id, r.attempt, r.content_trust
                 FROM tool_calls c JOIN rounds r ON r.request_id = c.request_id
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
    pub fn effect_state(&self, effect_id: &str) -> Result<Option<String>, JournalError> {
        self.with(|c| {
            c.query_row(
                "SELECT state FROM effects WHERE effect_id = ?1",
                params![effect_id],
                |r| r.get(0),
            )
            .optional()
        })
    }

    /// The first recorded result of call `call_id` in `run` (`None`: a chat call), when it
    /// is recorded whole (a digest-only record is a miss).
    pub fn recorded(
        &self,
        run: Option<&str>,
        call_id: &str,
    ) -> Result<Option<String>, JournalError> {
        let scope = run.map_or_else(|| "chat".to_owned(), |r| format!("run:{r}"));
        self.with(|c| {
            c.query_row(
                "SELECT content FROM tool_results WHERE scope = ?1 AND tool_call_id = ?2 AND truncated = 0
                 ORDER BY id LIMIT 1",
                params![scope, call_id],
                |r| r.get::<_, Option<Vec<u8>>>(0),
            )
            .optional()
            .map(|v| v.flatten().map(|b| String::from_utf8_lossy(&b).into_owned()))
        })
    }
}

/// Schema step of the MCP front: the ticket lookup reads `tool_calls` by `args_hash`.
pub(super) fn migrate(conn: &Connection, version: i64) -> rusqlite::Result<()> {
    conn.execute_batch(&format!(
        "BEGIN;
         CREATE INDEX IF NOT EXISTS tool_calls_args_hash ON tool_calls (args_hash);
         PRAGMA user_version = {version};
         COMMIT;"
    ))
}
