//! Reading the journal: a small pool of read-only connections ([`ReadPool`]; WAL lets them
//! read while the writer commits), used by recovery and replay lookups, chain trust, the
//! admin plane and `turnguard journal` — never through the writer's queue.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, TryLockError};

use rusqlite::{params, Connection, OpenFlags, OptionalExtension};

use super::postgres::reader as pg;
use super::{JournalError, Recorded, ServedCall, ServedRecord};
use crate::model::{ChainLink, StoredItemRow};

/// One effect row, as `GET /runs/{runId}/effects` projects it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectRow {
    pub effect_id: String,
    pub tool_id: String,
    pub node_id: Option<String>,
    pub attempt: Option<u32>,
    pub keying: String,
    pub state: String,
    pub at_ms: i64,
}

/// One journaled run event.
#[derive(Debug, Clone)]
pub struct EventRow {
    /// Strictly increasing per run.
    pub sequence: i64,
    /// The v2 event type.
    pub kind: String,
    /// Payload JSON text.
    pub payload: String,
    pub at_ms: i64,
    pub node_id: Option<String>,
}

/// A run in `turnguard journal runs`.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub run_id: String,
    pub rounds: i64,
    pub calls: i64,
    pub first_ms: i64,
    pub last_ms: i64,
    /// Chat turns: the agent's `x-request-id` (a column, not a key: two turns may share it).
    pub client_request_id: Option<String>,
}

/// What `turnguard policy learn` reads from the journal: the tools requests declared, the
/// calls the model made, and what the model called right after each tool result.
#[derive(Debug, Clone, Default)]
pub struct LearnRows {
    /// Every declared tool name.
    pub declared: Vec<DeclaredToolRow>,
    /// (tool name, outcome, enforced, count) over `tool_calls`.
    pub calls: Vec<(String, String, bool, i64)>,
    /// One per tool result (table `tool_results`, the request that first carried it): the
    /// result's tool name and the names of the calls the model made in the round that
    /// answered that request.
    pub followups: Vec<(String, Vec<String>)>,
}

/// One declared tool name (SQLite `declared_tool_counts`, PostgreSQL `declared_tools`).
#[derive(Debug, Clone)]
pub struct DeclaredToolRow {
    pub name: String,
    /// Requests that declared it.
    pub requests: i64,
    /// Distinct parameter schemas it was declared with.
    pub schemas: i64,
    /// The schema it was declared with most often (JSON text), when kept.
    pub schema: Option<String>,
    /// The API it was declared on most recently.
    pub api: String,
}

/// Read-only connections a reader keeps open. WAL readers block neither each other nor the
/// writer, so this many reads (recovery lookups, chain trust, the admin plane) run at once;
/// none goes through the writer's queue.
pub const READ_CONNECTIONS: usize = 4;

/// A small pool of read-only connections to one journal file: a read takes a free
/// connection, or waits for the next one in turn when all are busy.
pub struct ReadPool {
    conns: Vec<Mutex<Connection>>,
    next: AtomicUsize,
    /// One permit per connection, taken before a read goes to tokio's blocking pool
    /// ([`ReadPool::slot`]).
    slots: tokio::sync::Semaphore,
}

impl ReadPool {
    /// Opens `n` (at least 1) read-only connections to `path` (the writer must have created
    /// it), each with a 5 s busy timeout.
    pub fn open(path: &Path, n: usize) -> Result<Self, JournalError> {
        let mut conns = Vec::with_capacity(n.max(1));
        for _ in 0..n.max(1) {
            let conn = Connection::open_with_flags(
                path,
                OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )
            .map_err(|e| JournalError::Open {
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
            conn.busy_timeout(std::time::Duration::from_secs(5))
                .map_err(err)?;
            conns.push(Mutex::new(conn));
        }
        let slots = tokio::sync::Semaphore::new(conns.len());
        Ok(Self {
            conns,
            next: AtomicUsize::new(0),
            slots,
        })
    }

    /// A turn to read, for a read about to run on tokio's blocking pool: at most one per
    /// connection is handed out at a time, so a read waits here, as a task, rather than on a
    /// busy connection's lock, as a blocking thread. Without it every read queued behind the
    /// pool's connections held a thread of its own: at c=64 with a `Turnguard-Run` on each
    /// request the blocking pool grew to ~280 threads, their stacks and malloc arenas ~10 MB
    /// of resident memory (issue 13, bench/RESULTS.md run 9).
    ///
    /// Errors: [`JournalError::Closed`] only if the semaphore was closed (never, here).
    pub async fn slot(&self) -> Result<tokio::sync::SemaphorePermit<'_>, JournalError> {
        self.slots.acquire().await.map_err(|_| JournalError::Closed)
    }

    /// Runs `f` on a free connection (a poisoned one is never used: `Closed`).
    pub fn with<T>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, JournalError> {
        for c in &self.conns {
            match c.try_lock() {
                Ok(conn) => return f(&conn).map_err(err),
                Err(TryLockError::WouldBlock) => {}
                Err(TryLockError::Poisoned(_)) => return Err(JournalError::Closed),
            }
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        let conn = self.conns[i].lock().map_err(|_| JournalError::Closed)?;
        f(&conn).map_err(err)
    }
}

/// A reader over a [`ReadPool`]: what [`read_blocking`] needs to take a turn.
pub(super) trait Pooled: Send + Sync + 'static {
    fn pool(&self) -> &ReadPool;
}

/// Runs `read` on tokio's blocking pool once `reader`'s pool gives it a turn
/// ([`ReadPool::slot`]): the one way an async caller reads a SQLite journal, so no read holds
/// a blocking thread while it waits for a connection.
///
/// Errors: `read`'s, or [`JournalError::Closed`] when the blocking task could not run.
pub(super) async fn read_blocking<R: Pooled, T: Send + 'static>(
    reader: &Arc<R>,
    read: impl FnOnce(&R) -> Result<T, JournalError> + Send + 'static,
) -> Result<T, JournalError> {
    let _slot = reader.pool().slot().await?;
    let reader = Arc::clone(reader);
    tokio::task::spawn_blocking(move || read(&reader))
        .await
        .map_err(|_| JournalError::Closed)?
}

/// A read-only view of a SQLite journal (a [`ReadPool`] of [`READ_CONNECTIONS`]), read
/// synchronously: the SQLite side of [`JournalReader`], and what offline tools use directly.
pub struct SqliteReader {
    pool: ReadPool,
}

fn err(e: rusqlite::Error) -> JournalError {
    match super::states::unknown_value(&e) {
        Some(v) => JournalError::Unreadable(v.clone()),
        None => JournalError::Write(e.to_string()),
    }
}

impl Pooled for SqliteReader {
    fn pool(&self) -> &ReadPool {
        &self.pool
    }
}

impl SqliteReader {
    /// Opens `path` read-only (the writer must have created it).
    pub fn open(path: &Path) -> Result<Self, JournalError> {
        Ok(Self {
            pool: ReadPool::open(path, READ_CONNECTIONS)?,
        })
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, JournalError> {
        self.pool.with(f)
    }

    /// The served record of (run, node, attempt, round), if any.
    pub fn served(
        &self,
        run: &str,
        node: &str,
        attempt: u32,
        round: u32,
    ) -> Result<Option<ServedRecord>, JournalError> {
        self.with(|c| {
            c.query_row(
                "SELECT request_digest, request_id, status, content_type, body, body_bytes, body_digest, truncated, calls, at_ms, redacted, reader
                 FROM served WHERE run_id = ?1 AND node_id = ?2 AND attempt = ?3 AND round_index = ?4",
                params![run, node, attempt, round],
                |r| {
                    let calls: String = r.get(8)?;
                    Ok(ServedRecord {
                        run_id: run.to_owned(),
                        node_id: node.to_owned(),
                        attempt,
                        round_index: round,
                        request_digest: r.get(0)?,
                        request_id: r.get(1)?,
                        status: r.get(2)?,
                        content_type: r.get(3)?,
                        body: Recorded::stored(
                            r.get::<_, Option<Vec<u8>>>(4)?.unwrap_or_default(),
                            r.get::<_, i64>(5)? as u64,
                            r.get(6)?,
                            r.get(7)?,
                            r.get(10)?,
                        ),
                        calls: serde_json::from_str::<Vec<ServedCall>>(&calls).unwrap_or_default(),
                        claims: Vec::new(),
                        at_ms: r.get(9)?,
                        reader: r.get(11)?,
                    })
                },
            )
            .optional()
        })
    }

    /// Whether a principal token with this claims fingerprint was presented on the data
    /// plane (table `principal_tokens`): such a token never resolves an interrupt.
    pub fn token_seen(&self, fingerprint: &str) -> Result<bool, JournalError> {
        self.with(|c| {
            c.query_row(
                "SELECT count(*) FROM principal_tokens WHERE fingerprint = ?1",
                params![fingerprint],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n > 0)
        })
    }

    /// The latest attempt that has a served record at (run, node, round).
    pub fn latest_attempt(
        &self,
        run: &str,
        node: &str,
        round: u32,
    ) -> Result<Option<u32>, JournalError> {
        self.with(|c| {
            c.query_row(
                "SELECT max(attempt) FROM served WHERE run_id = ?1 AND node_id = ?2 AND round_index = ?3",
                params![run, node, round],
                |r| r.get::<_, Option<u32>>(0),
            )
        })
    }

    /// The recorded result of a call in a run: `Some(Some(text))` when recorded whole,
    /// `Some(None)` when recorded only as a digest (oversized: a miss), `None` when absent.
    pub fn tool_result(
        &self,
        run: &str,
        call_id: &str,
    ) -> Result<Option<Option<(String, bool)>>, JournalError> {
        self.with(|c| {
            c.query_row(
                "SELECT content, truncated, is_error FROM tool_results WHERE scope = ?1 AND tool_call_id = ?2 ORDER BY id LIMIT 1",
                params![format!("run:{run}"), call_id],
                |r| {
                    let truncated: bool = r.get(1)?;
                    let content: Option<Vec<u8>> = r.get(0)?;
                    let is_error: bool = r.get(2)?;
                    Ok(if truncated { None } else { Some((String::from_utf8_lossy(&content.unwrap_or_default()).into_owned(), is_error)) })
                },
            )
            .optional()
        })
    }

    /// The journal's rows for the stored output items `ids` names (Responses
    /// `item_reference`), each with its response's status and `contentTrust`; ids the journal
    /// does not hold are absent.
    pub fn stored_items(&self, ids: &[String]) -> Result<Vec<StoredItemRow>, JournalError> {
        self.with(|c| {
            let mut st = c.prepare_cached(
                "SELECT i.response_id, i.provider_executed, r.status, r.content_trust, i.item_type
                 FROM response_items i JOIN responses r ON r.response_id = i.response_id
                 WHERE i.item_id = ?1",
            )?;
            let mut rows = Vec::new();
            for id in ids {
                let row = st
                    .query_row(params![id], |r| {
                        Ok(StoredItemRow {
                            item_id: id.clone(),
                            response_id: r.get(0)?,
                            provider_executed: r.get(1)?,
                            status: r.get(2)?,
                            content_trust: r.get(3)?,
                            item_type: r.get(4)?,
                        })
                    })
                    .optional()?;
                rows.extend(row);
            }
            Ok(rows)
        })
    }

    /// The response chain from `previous` back (table `responses`), following each row's
    /// `previous_response_id`, at most `max` links. The walk stops at a response the journal
    /// does not hold, at the start of the chain, or at a response already visited; judging
    /// the links is [`crate::admission::trust::chain_fault`]'s job.
    pub fn response_chain(
        &self,
        previous: &str,
        max: usize,
    ) -> Result<Vec<ChainLink>, JournalError> {
        self.with(|c| {
            let mut st = c.prepare_cached(
                "SELECT request_id, previous_response_id, status, provider_executed, content_trust,
                        next_round_index, calls_so_far
                 FROM responses WHERE response_id = ?1",
            )?;
            let mut links: Vec<ChainLink> = Vec::new();
            let mut seen = std::collections::HashSet::new();
            let mut next = Some(previous.to_owned());
            while let Some(id) = next.take() {
                if links.len() >= max || !seen.insert(id.clone()) {
                    break;
                }
                let Some(link) = st
                    .query_row(params![id], |r| {
                        Ok(ChainLink {
                            response_id: id.clone(),
                            request_id: r.get(0)?,
                            previous_response_id: r.get(1)?,
                            status: r.get(2)?,
                            provider_executed: r.get(3)?,
                            content_trust: r.get(4)?,
                            next_round_index: r.get(5)?,
                            calls_so_far: r
                                .get::<_, Option<String>>(6)?
                                .and_then(|c| serde_json::from_str(&c).ok()),
                        })
                    })
                    .optional()?
                else {
                    break;
                };
                next = link.previous_response_id.clone();
                links.push(link);
            }
            Ok(links)
        })
    }

    /// The tool name of call `call_id` as the model emitted it in the round `request_id`
    /// (the `tool_calls` view: a chat round's `rounds.calls` or a run's `tool_call_rows`), if
    /// recorded.
    pub fn call_name(
        &self,
        request_id: &str,
        call_id: &str,
    ) -> Result<Option<String>, JournalError> {
        self.with(|c| {
            c.query_row(
                "SELECT name FROM tool_calls WHERE request_id = ?1 AND call_id = ?2 LIMIT 1",
                params![request_id, call_id],
                |r| r.get(0),
            )
            .optional()
        })
    }

    /// Tool calls released (`executed`) in `run` so far, over every node, attempt and round
    /// journaled: seeds the run's in-memory counter ([`crate::admission::LimitState::seed`]).
    pub fn released_calls(&self, run: &str) -> Result<u32, JournalError> {
        self.with(|c| {
            c.query_row(
                "SELECT count(*) FROM rounds r JOIN tool_call_rows t ON t.request_id = r.request_id
                 WHERE r.run_id = ?1 AND t.outcome = 'executed'",
                params![run],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
        })
    }

    /// The run's sticky trust bit (table `run_trust`): whether a turn of `run` was untrusted
    /// before (tool-turn contract §C: once untrusted, always untrusted).
    pub fn run_untrusted(&self, run: &str) -> Result<bool, JournalError> {
        self.with(|c| {
            c.query_row(
                "SELECT count(*) FROM run_trust WHERE run_id = ?1 AND trust = 'untrusted'",
                params![run],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n > 0)
        })
    }

    /// Recorded rounds a replay of (run, node) served without the agent so far.
    pub fn replay_cursor(&self, run: &str, node: &str) -> Result<u32, JournalError> {
        self.with(|c| {
            c.query_row(
                "SELECT skipped FROM replay_cursor WHERE run_id = ?1 AND node_id = ?2",
                params![run, node],
                |r| r.get(0),
            )
            .optional()
            .map(|v| v.unwrap_or(0))
        })
    }

    /// Effect rows of a run, oldest first.
    pub fn effects(&self, run: &str) -> Result<Vec<EffectRow>, JournalError> {
        self.with(|c| {
            let mut st = c.prepare(
                "SELECT effect_id, tool_id, node_id, attempt, keying, state, at_ms FROM effects WHERE run_id = ?1 ORDER BY at_ms, effect_id",
            )?;
            let rows = st.query_map(params![run], |r| {
                Ok(EffectRow {
                    effect_id: r.get(0)?,
                    tool_id: r.get(1)?,
                    node_id: r.get(2)?,
                    attempt: r.get(3)?,
                    keying: r.get(4)?,
                    state: r.get(5)?,
                    at_ms: r.get(6)?,
                })
            })?;
            rows.collect()
        })
    }

    /// Events of a run, in sequence order.
    pub fn events(&self, run: &str) -> Result<Vec<EventRow>, JournalError> {
        self.with(|c| {
            let mut st = c.prepare("SELECT sequence, type, payload, at_ms, node_id FROM event_rows WHERE scope = ?1 ORDER BY sequence")?;
            let rows = st.query_map(params![format!("run:{run}")], |r| {
                Ok(EventRow { sequence: r.get(0)?, kind: r.get(1)?, payload: r.get(2)?, at_ms: r.get(3)?, node_id: r.get(4)? })
            })?;
            rows.collect()
        })
    }

    /// Runs with their round and call counts, most recent first.
    pub fn runs(&self) -> Result<Vec<RunSummary>, JournalError> {
        self.with(|c| {
            let mut st = c.prepare(
                "SELECT r.run_id, count(DISTINCT r.id), count(t.id), min(r.at_ms), max(r.at_ms)
                 FROM rounds r LEFT JOIN tool_call_rows t ON t.request_id = r.request_id
                 WHERE r.run_id IS NOT NULL GROUP BY r.run_id ORDER BY max(r.at_ms) DESC",
            )?;
            let rows = st.query_map([], |r| {
                Ok(RunSummary {
                    run_id: r.get(0)?,
                    rounds: r.get(1)?,
                    calls: r.get(2)?,
                    first_ms: r.get(3)?,
                    last_ms: r.get(4)?,
                    client_request_id: None,
                })
            })?;
            rows.collect()
        })
    }

    /// Chat turns (agent requests without `Turnguard-Run`), most recent first, at most
    /// `limit`: one per agent request, its repair rounds (`<journal id>#repair-N`) counted
    /// with it. `run_id` is `chat:<journal id>` (turnguard's own id), the name
    /// `turnguard journal show` takes; `client_request_id` is the agent's `x-request-id`.
    pub fn chat_turns(&self, limit: usize) -> Result<Vec<RunSummary>, JournalError> {
        self.with(|c| {
            let mut st = c.prepare(
                "SELECT CASE WHEN instr(r.request_id, '#repair-') > 0
                             THEN substr(r.request_id, 1, instr(r.request_id, '#repair-') - 1)
                             ELSE r.request_id END AS turn,
                        -- A chat round holds its calls (`rounds.calls`, schema step 16); one
                        -- recorded before that step has them as rows.
                        count(*), sum(coalesce(json_array_length(r.calls), 0)
                                      + (SELECT count(*) FROM tool_call_rows t WHERE t.request_id = r.request_id)),
                        min(r.at_ms), max(r.at_ms), max(r.client_request_id)
                 FROM rounds r
                 WHERE r.run_id IS NULL GROUP BY turn ORDER BY max(r.at_ms) DESC LIMIT ?1",
            )?;
            let rows = st.query_map(params![limit as i64], |r| {
                Ok(RunSummary {
                    run_id: format!("chat:{}", r.get::<_, String>(0)?),
                    rounds: r.get(1)?,
                    calls: r.get(2)?,
                    first_ms: r.get(3)?,
                    last_ms: r.get(4)?,
                    client_request_id: r.get(5)?,
                })
            })?;
            rows.collect()
        })
    }

    /// Rounds and calls of a run for `turnguard journal show` (never raw arguments: the
    /// redacted form only). `chat:<id>` names a chat turn ([`Self::chat_turns`]) by its journal
    /// id, or every chat turn whose agent sent `x-request-id: <id>`: their rounds and repair
    /// rounds.
    pub fn show(&self, run: &str) -> Result<Vec<serde_json::Value>, JournalError> {
        let (filter, key) = match run.strip_prefix("chat:") {
            Some(request) => (CHAT_TURN_ROUNDS, request),
            None => ("r.run_id = ?1", run),
        };
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT r.request_id, r.node_id, r.attempt, r.round_index, r.api, r.model, r.state, r.completion,
                        r.upstream_status, r.at_ms, r.client_request_id
                 FROM rounds r WHERE {filter} ORDER BY r.at_ms, r.id"
            ))?;
            let rounds = st.query_map(params![key], |r| {
                Ok(serde_json::json!({
                    "requestId": r.get::<_, String>(0)?, "nodeId": r.get::<_, Option<String>>(1)?,
                    "attempt": r.get::<_, Option<i64>>(2)?, "round": r.get::<_, i64>(3)?, "api": r.get::<_, String>(4)?,
                    "model": r.get::<_, Option<String>>(5)?, "state": r.get::<_, String>(6)?,
                    "completion": r.get::<_, Option<String>>(7)?, "upstreamStatus": r.get::<_, Option<i64>>(8)?,
                    "atMs": r.get::<_, i64>(9)?,
                    "clientRequestId": r.get::<_, Option<String>>(10)?,
                }))
            })?;
            let mut out: Vec<serde_json::Value> = rounds.collect::<rusqlite::Result<_>>()?;
            let mut calls = c.prepare(
                "SELECT call_id, name, outcome, stage, reason, args_hash, redacted_args, logical_invocation_id
                 FROM tool_calls WHERE request_id = ?1 ORDER BY choice, ordinal",
            )?;
            for round in &mut out {
                let id = round["requestId"].as_str().unwrap_or_default().to_owned();
                let list = calls.query_map(params![id], |r| {
                    Ok(serde_json::json!({
                        "callId": r.get::<_, String>(0)?, "name": r.get::<_, String>(1)?, "outcome": r.get::<_, String>(2)?,
                        "stage": r.get::<_, String>(3)?, "reason": r.get::<_, String>(4)?,
                        "argsHash": r.get::<_, Option<String>>(5)?,
                        "arguments": r.get::<_, Option<String>>(6)?.and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok()),
                        "logicalInvocationId": r.get::<_, Option<String>>(7)?,
                    }))
                })?;
                round["calls"] = serde_json::Value::Array(list.collect::<rusqlite::Result<_>>()?);
            }
            Ok(out)
        })
    }

    /// The rows `turnguard policy learn` turns into a proposed catalog ([`LearnRows`]).
    pub fn learn_rows(&self) -> Result<LearnRows, JournalError> {
        self.with(|c| {
            let mut out = LearnRows::default();
            let mut st = c.prepare(
                // Per tool: the requests that declared it, its distinct schemas (`''` is no
                // schema), the schema most requests declared, and the API that declared it last.
                "SELECT d.name, sum(d.requests), count(DISTINCT nullif(d.schema_digest, '')),
                        (SELECT s.schema FROM declared_tool_counts d2 JOIN tool_schemas s ON s.schema_digest = d2.schema_digest
                         WHERE d2.name = d.name GROUP BY d2.schema_digest ORDER BY sum(d2.requests) DESC, max(d2.last_at_ms) DESC LIMIT 1),
                        (SELECT d3.api FROM declared_tool_counts d3 WHERE d3.name = d.name ORDER BY d3.last_at_ms DESC LIMIT 1)
                 FROM declared_tool_counts d GROUP BY d.name ORDER BY d.name",
            )?;
            let rows = st.query_map([], |r| {
                Ok(DeclaredToolRow {
                    name: r.get(0)?,
                    requests: r.get(1)?,
                    schemas: r.get(2)?,
                    schema: r.get(3)?,
                    api: r.get::<_, Option<String>>(4)?.unwrap_or_default(),
                })
            })?;
            out.declared = rows.collect::<rusqlite::Result<_>>()?;
            let mut st = c.prepare(
                "SELECT name, outcome, enforced, count(*) FROM tool_calls GROUP BY name, outcome, enforced ORDER BY name, outcome",
            )?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
            out.calls = rows.collect::<rusqlite::Result<_>>()?;
            let mut st = c.prepare(
                "SELECT tool_name, first_request_id FROM tool_results WHERE tool_name IS NOT NULL ORDER BY id",
            )?;
            let results: Vec<(String, String)> = st
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<rusqlite::Result<_>>()?;
            let mut next = c.prepare_cached(
                "SELECT name FROM tool_calls WHERE request_id = ?1 ORDER BY choice, ordinal",
            )?;
            for (tool, request) in results {
                let names: Vec<String> = next
                    .query_map(params![request], |r| r.get(0))?
                    .collect::<rusqlite::Result<_>>()?;
                out.followups.push((tool, names));
            }
            Ok(out)
        })
    }
}

/// The journal's reads, whichever backend holds it ([`super::Journal::reader`]): every read
/// is `async`. On SQLite a read runs on the blocking pool over a [`SqliteReader`]; on
/// PostgreSQL it takes a connection from the shared pool. Cheap to clone.
#[derive(Clone)]
pub struct JournalReader(Backend);

#[derive(Clone)]
enum Backend {
    Sqlite(Arc<SqliteReader>),
    Postgres(deadpool_postgres::Pool),
}

/// Runs a read on the backend: `$sqlite` on the blocking pool with `$r` the
/// [`SqliteReader`], or `$pg` (a future) with `$p` the PostgreSQL pool.
macro_rules! dispatch {
    ($self:ident, |$r:ident| $sqlite:expr, |$p:ident| $pg:expr) => {
        match &$self.0 {
            Backend::Sqlite(r) => read_blocking(r, move |$r| $sqlite).await,
            // Boxed: a PostgreSQL read's state (~2 KB: the pool checkout and the query) would
            // otherwise size every read's future, SQLite's included, and every future that
            // awaits one (the request path's, moved at each level).
            Backend::Postgres($p) => Box::pin($pg).await,
        }
    };
}

impl JournalReader {
    /// Opens the journal at `location` for reading (the journal CLI, `policy learn`): a SQLite
    /// file read-only, or a pool to the PostgreSQL database (nothing is migrated or written).
    ///
    /// Errors: [`JournalError::Open`] naming the location (never a password).
    pub async fn open_at(location: &super::JournalLocation) -> Result<Self, JournalError> {
        match location {
            super::JournalLocation::Sqlite(path) => Ok(Self::sqlite(SqliteReader::open(path)?)),
            super::JournalLocation::Postgres(url) => Ok(Self::postgres(
                super::postgres::read_pool(url, location).await?,
            )),
        }
    }

    pub(super) fn sqlite(r: SqliteReader) -> Self {
        Self(Backend::Sqlite(Arc::new(r)))
    }

    pub(super) fn postgres(pool: deadpool_postgres::Pool) -> Self {
        Self(Backend::Postgres(pool))
    }

    /// The served record of (run, node, attempt, round), if any.
    pub async fn served(
        &self,
        run: &str,
        node: &str,
        attempt: u32,
        round: u32,
    ) -> Result<Option<ServedRecord>, JournalError> {
        let (run, node) = (run.to_owned(), node.to_owned());
        dispatch!(self, |r| r.served(&run, &node, attempt, round), |p| {
            pg::served(p, &run, &node, attempt, round)
        })
    }

    /// Whether a principal token with this claims fingerprint was presented on the data
    /// plane (table `principal_tokens`): such a token never resolves an interrupt.
    pub async fn token_seen(&self, fingerprint: &str) -> Result<bool, JournalError> {
        let fp = fingerprint.to_owned();
        dispatch!(self, |r| r.token_seen(&fp), |p| pg::token_seen(p, &fp))
    }

    /// The latest attempt that has a served record at (run, node, round).
    pub async fn latest_attempt(
        &self,
        run: &str,
        node: &str,
        round: u32,
    ) -> Result<Option<u32>, JournalError> {
        let (run, node) = (run.to_owned(), node.to_owned());
        dispatch!(self, |r| r.latest_attempt(&run, &node, round), |p| {
            pg::latest_attempt(p, &run, &node, round)
        })
    }

    /// The recorded result of a call in a run: `Some(Some((text, is_error)))` when recorded
    /// whole, `Some(None)` when recorded only as a digest (oversized: a miss), `None` when
    /// absent.
    pub async fn tool_result(
        &self,
        run: &str,
        call_id: &str,
    ) -> Result<Option<Option<(String, bool)>>, JournalError> {
        let (run, call) = (run.to_owned(), call_id.to_owned());
        dispatch!(self, |r| r.tool_result(&run, &call), |p| pg::tool_result(
            p, &run, &call
        ))
    }

    /// The journal's rows for the stored output items `ids` names (Responses
    /// `item_reference`); ids the journal does not hold are absent.
    pub async fn stored_items(&self, ids: &[String]) -> Result<Vec<StoredItemRow>, JournalError> {
        let ids = ids.to_vec();
        dispatch!(self, |r| r.stored_items(&ids), |p| pg::stored_items(
            p, &ids
        ))
    }

    /// The response chain from `previous` back (table `responses`), at most `max` links
    /// ([`SqliteReader::response_chain`]).
    pub async fn response_chain(
        &self,
        previous: &str,
        max: usize,
    ) -> Result<Vec<ChainLink>, JournalError> {
        let previous = previous.to_owned();
        dispatch!(self, |r| r.response_chain(&previous, max), |p| {
            pg::response_chain(p, &previous, max)
        })
    }

    /// The tool name of call `call_id` as the model emitted it in the round `request_id`.
    pub async fn call_name(
        &self,
        request_id: &str,
        call_id: &str,
    ) -> Result<Option<String>, JournalError> {
        let (request, call) = (request_id.to_owned(), call_id.to_owned());
        dispatch!(self, |r| r.call_name(&request, &call), |p| pg::call_name(
            p, &request, &call
        ))
    }

    /// Tool calls released (`executed`) in `run` so far (seeds the run's counter).
    pub async fn released_calls(&self, run: &str) -> Result<u32, JournalError> {
        let run = run.to_owned();
        dispatch!(self, |r| r.released_calls(&run), |p| pg::released_calls(
            p, &run
        ))
    }

    /// The run's sticky trust bit: whether a turn of `run` was untrusted before (§C). A read:
    /// it never goes through the writer's queue.
    pub async fn run_untrusted(&self, run: &str) -> Result<bool, JournalError> {
        let run = run.to_owned();
        dispatch!(self, |r| r.run_untrusted(&run), |p| pg::run_untrusted(
            p, &run
        ))
    }

    /// Recorded rounds a replay of (run, node) served without the agent so far.
    pub async fn replay_cursor(&self, run: &str, node: &str) -> Result<u32, JournalError> {
        let (run, node) = (run.to_owned(), node.to_owned());
        dispatch!(self, |r| r.replay_cursor(&run, &node), |p| {
            pg::replay_cursor(p, &run, &node)
        })
    }

    /// Effect rows of a run, oldest first.
    pub async fn effects(&self, run: &str) -> Result<Vec<EffectRow>, JournalError> {
        let run = run.to_owned();
        dispatch!(self, |r| r.effects(&run), |p| pg::effects(p, &run))
    }

    /// Events of a run, in sequence order.
    pub async fn events(&self, run: &str) -> Result<Vec<EventRow>, JournalError> {
        let run = run.to_owned();
        dispatch!(self, |r| r.events(&run), |p| pg::events(p, &run))
    }

    /// Runs with their round and call counts, most recent first.
    pub async fn runs(&self) -> Result<Vec<RunSummary>, JournalError> {
        dispatch!(self, |r| r.runs(), |p| pg::runs(p))
    }

    /// Chat turns, most recent first, at most `limit` ([`SqliteReader::chat_turns`]).
    pub async fn chat_turns(&self, limit: usize) -> Result<Vec<RunSummary>, JournalError> {
        dispatch!(self, |r| r.chat_turns(limit), |p| pg::chat_turns(p, limit))
    }

    /// Rounds and calls of a run for `turnguard journal show` ([`SqliteReader::show`]).
    pub async fn show(&self, run: &str) -> Result<Vec<serde_json::Value>, JournalError> {
        let run = run.to_owned();
        dispatch!(self, |r| r.show(&run), |p| pg::show(p, &run))
    }

    /// The rows `turnguard policy learn` turns into a proposed catalog ([`LearnRows`]).
    pub async fn learn_rows(&self) -> Result<LearnRows, JournalError> {
        dispatch!(self, |r| r.learn_rows(), |p| pg::learn_rows(p))
    }
}

/// The rounds of the chat turn `?1` names (`turnguard journal show chat:<id>`): its journal
/// id, the agent's `x-request-id` (or the id the edge gave the request), or its repair rounds
/// (`<id>#repair-N`, found as the key range `[<id>#repair-, <id>#repair.)`, `.` being the
/// byte after `-`). Each arm is an index search (the key's unique index, `rounds_client`
/// over chat rounds), never a scan of every round; written as one `IN` of three searches
/// because an `OR` lets the planner scan the partial `rounds_client` whole instead.
pub(crate) const CHAT_TURN_ROUNDS: &str = "r.run_id IS NULL AND r.id IN (\
     SELECT id FROM rounds WHERE request_id = ?1 \
     UNION ALL SELECT id FROM rounds WHERE run_id IS NULL AND client_request_id = ?1 \
     UNION ALL SELECT id FROM rounds WHERE request_id >= ?1 || '#repair-' AND request_id < ?1 || '#repair.')";

#[cfg(test)]
mod pool_tests {
    use super::*;

    /// A read runs while another holds a connection: reads are not serialized on one
    /// connection (a nested read on a single shared connection would wait forever).
    #[test]
    fn a_read_does_not_wait_for_another_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.db");
        let metrics = std::sync::Arc::new(crate::metrics::Metrics::new());
        let (journal, writer) = crate::journal::Journal::open_sqlite(&path, metrics).unwrap();
        let reader = std::sync::Arc::new(SqliteReader::open(&path).unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let r = std::sync::Arc::clone(&reader);
        std::thread::spawn(move || {
            let nested = r.with(|_held| Ok(r.replay_cursor("run", "node")));
            let _ = tx.send(nested);
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the second read ran while the first held its connection");
        assert_eq!(got.unwrap().unwrap(), 0);
        drop(journal);
        writer.join();
    }
    /// Reads through [`read_blocking`] keep at most one blocking thread per connection busy,
    /// however many are asked for at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_hold_at_most_one_blocking_thread_per_connection() {
        use std::sync::atomic::AtomicUsize;
        use std::sync::Arc;
        struct Two(ReadPool);
        impl Pooled for Two {
            fn pool(&self) -> &ReadPool {
                &self.0
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.db");
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let (journal, writer) = crate::journal::Journal::open_sqlite(&path, metrics).unwrap();
        let reader = Arc::new(Two(ReadPool::open(&path, 2).unwrap()));
        let (busy, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let reads: Vec<_> = (0..16)
            .map(|_| {
                let (reader, busy, peak) =
                    (Arc::clone(&reader), Arc::clone(&busy), Arc::clone(&peak));
                tokio::spawn(async move {
                    read_blocking(&reader, move |r| {
                        let now = busy.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(now, Ordering::SeqCst);
                        let one =
                            r.0.with(|c| c.query_row("SELECT 1", [], |r| r.get::<_, i64>(0)));
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        busy.fetch_sub(1, Ordering::SeqCst);
                        one
                    })
                    .await
                })
            })
            .collect();
        for r in reads {
            assert_eq!(r.await.unwrap().unwrap(), 1);
        }
        let peak = peak.load(Ordering::SeqCst);
        assert!(
            peak <= 2,
            "{peak} reads held blocking threads at once, with 2 connections"
        );
        assert!(peak >= 1);
        drop(journal);
        writer.join();
    }
}
