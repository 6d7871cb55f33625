//! The journal (DESIGN.md §8) behind one store interface ([`Journal`], [`JournalReader`],
//! [`McpReader`]) with two backends: a SQLite file (the embedded default; below) or a
//! PostgreSQL database shared by every replica ([`postgres`], issue 15; ARCHITECTURE.md "The
//! journal: two backends"). The SQLite journal: one file in WAL mode, one writer thread fed
//! by a bounded channel, group commit. A batch holding a record the contract needs durable is
//! committed with `synchronous=FULL` and its callers wait for the commit; other records (a chat
//! turn's round, audit events) are queued and committed with `synchronous=NORMAL`.
//!
//! Writes are insert-if-absent (`ON CONFLICT DO NOTHING`), never a replacing insert (the
//! `OR REPLACE` conflict clause): a record, once written, is never silently overwritten (the
//! counters of declared tools, which only grow, are summed in place: `declared`). When
//! the journal cannot record what the contract requires, the caller fails the request. Every
//! key is turnguard's own (a round's `request_id` is [`crate::proxy::RequestCtx::journal_id`],
//! then `#repair-N`): an id the client chose (`x-request-id`) is only a column
//! (`rounds.client_request_id`), so a client repeating one never makes a record "already
//! there". Every body is redacted before it is written ([`Recorded`], [`redact`]).
//!
//! # The response chain (`responses` table)
//!
//! With the Responses API a request may carry `previous_response_id`: the provider then holds
//! the earlier turns and the proxy sees none of them in the request. So every response the
//! provider stores is recorded here, keyed by its id, with the `previous_response_id` of the
//! request that produced it, its final `status` (`NULL`: the stream was cut), whether its
//! output holds provider-executed items (`provider_executed`, `provider_items`:
//! `web_search_call`, `mcp_call` …, untrusted output per tool-turn contract §C, §F), and its
//! `content_trust`: the effective trust of the turn that produced it, or `untrusted` when its
//! output held provider-executed items
//! ([`crate::admission::trust::of_response`]). (v4) It also keeps the position a request
//! continuing it takes in its node — `next_round_index` and `calls_so_far`, the names of the
//! transcript's calls through it — because that request carries none of the earlier turns
//! while round indices and per-node ordinals are derived from the transcript (DESIGN.md §2;
//! [`crate::model::Turn::continue_chain`]).
//!
//! The trust rule (judged by [`crate::admission::trust::chain_fault`] over the rows
//! [`JournalReader::response_chain`] reads, looked up by
//! [`crate::proxy::trust::response_chain`]): a turn whose request names
//! `previous_response_id = P` is `trusted` only if the journal's row for `P` has `status`
//! `completed` or `incomplete` (a `NULL` status means the stream was cut and the provider may
//! have gone on), `provider_executed = 0`, and `content_trust = 'trusted'`. The rule is
//! inductive: a row is recorded `trusted` only when the turn that produced it was trusted,
//! and that turn was judged by this rule on the row it continued — so one row stands for the
//! whole chain back to a response that continued nothing, and only that row is read
//! ([`crate::proxy::trust::MAX_CHAIN`] = 1). Anything else — a response id turnguard never
//! saw, a row with provider-executed output, a row from an untrusted or unjudged turn —
//! makes the turn `untrusted`
//! (fail closed). Inside a run the bit is then sticky as usual. A `function_call_output` in
//! such a request answers a call the request does not show: its tool name comes from the
//! calls of the response it continues (the `tool_calls` view, same `request_id` as that
//! response's row); no call, no name, and the result is untrusted.
//!
//! Calls turnguard withheld from a stored response are in `tool_calls` (same `request_id`,
//! `outcome` other than `executed`): the provider still holds them, so a later request that
//! continues the chain is expected to answer them (see the Responses adapter's notes).

mod declared;
mod interrupts;
mod location;
mod mcp;
mod postgres;
mod prune;
mod reader;
pub mod redact;
mod released;
mod schema;
mod scopes;
pub mod seen_results;
mod states;

pub use interrupts::{InterruptRecord, InterruptRow, Resolution, Resolved, Selector};
pub use location::JournalLocation;
pub use mcp::{McpReader, TicketRow};
pub use reader::{
    DeclaredToolRow, EffectRow, EventRow, JournalReader, LearnRows, RunSummary, SqliteReader,
};
pub use states::{InterruptState, RoundState, UnknownValue};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rusqlite::{params, Connection, OptionalExtension};
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;
pub use crate::model::ResponseLink;

/// Records waiting in the channel before senders wait.
const QUEUE_CAPACITY: usize = 4096;
/// Records committed in one transaction at most.
const MAX_BATCH: usize = 512;
/// How long a batch that nobody waits for (relaxed records: a chat turn's round, audit
/// events) stays open for more records before it commits. SQLite's cost is per commit (the
/// WAL frames of every page the transaction touched, and the checkpoints they bring), not
/// per row, so a chat turn's records share commits with their neighbours'; a record someone
/// waits for closes the batch at once ([`next_batch`]). Longer is not better: the writer shares the
/// proxy's CPU, and a longer linger makes each commit longer, which the request that arrives
/// while it runs waits out. 5 ms made 137 records a commit at c=64 instead of 60 and raised
/// the p99 at c=1 from 1.2 to 1.4–1.85 ms and the open-loop p99 with it, for a CPU gain
/// inside the noise (bench/RESULTS.md, issue 13 run 11); 10 ms in the seventh session made
/// no difference in CPU either.
const RELAXED_LINGER: Duration = Duration::from_millis(2);
/// The writer connection's page cache, KiB (`PRAGMA cache_size`; SQLite's default is 2,000
/// KiB). The writer appends at the right edge of each B-tree, so what it reads again is
/// those edges' root-to-leaf paths (about fifty 4 KiB pages over the tables and indexes a
/// round writes); the default cache filled with pages it never read again, ~1.5 MiB of
/// resident memory (bench/RESULTS.md, issue 13 run 5).
const WRITER_CACHE_KIB: i64 = 512;
/// Schema digests the writer remembers having stored in `tool_schemas` (so the same declared
/// schema is not serialized and re-inserted for every request); forgotten all at once when
/// full, and after a prune.
const KNOWN_SCHEMAS: usize = 4096;

/// Why the journal could not record.
#[derive(Debug, Clone, thiserror::Error)]
pub enum JournalError {
    /// The database could not be opened or migrated.
    #[error("cannot open journal {path}: {reason}")]
    Open { path: PathBuf, reason: String },
    /// A claim this process took was taken over by another owner (its lease ran out or this
    /// process was thought dead): the stale owner's confirm or release matches no row, and it
    /// must not release the call (fail closed).
    #[error("effect claim {0} is no longer this process's (taken over): the call is withheld")]
    Fenced(String),
    /// A batch failed to commit.
    #[error("journal write failed: {0}")]
    Write(String),
    /// The writer thread is gone (shutdown or a crash).
    #[error("the journal writer has stopped")]
    Closed,
    /// Durable writes are failing (a full disk, a lock another process holds …): a record
    /// the contract needs durable is refused at once instead of waiting for the same failure
    /// ([`JournalHealth`]).
    #[error("the journal is failing durable writes ({0}); turnguard retries in the background")]
    Failing(String),
    /// A stored row holds a value outside its column's vocabulary (an interrupt state, a
    /// `contentTrust`): the row is refused, never read as a default (fail closed).
    #[error("journal row unreadable: {0}")]
    Unreadable(UnknownValue),
}

/// Whether the journal's writes currently succeed (issue 11: readiness tells the truth about
/// the journal). Every committed or failed batch updates it; a probe (a small durable write,
/// [`Journal::probe`]) keeps it fresh when there is no traffic and notices recovery.
#[derive(Debug, Default)]
pub struct JournalHealth {
    state: std::sync::Mutex<HealthState>,
}

#[derive(Debug, Default)]
struct HealthState {
    /// Why the last batch failed; `None` while writes succeed.
    failing: Option<String>,
    failed_at: Option<Instant>,
}

impl JournalHealth {
    /// `Some(reason)` while writes fail.
    pub fn failing(&self) -> Option<String> {
        self.state
            .lock()
            .map(|s| s.failing.clone())
            .unwrap_or_else(|_| Some("journal health state poisoned".into()))
    }

    /// A write failed less than `d` ago.
    pub fn failed_within(&self, d: std::time::Duration) -> bool {
        self.state
            .lock()
            .map(|s| s.failed_at.is_some_and(|t| t.elapsed() < d))
            .unwrap_or(true)
    }

    /// Takes a SQLite batch's commit result. Only a failure of the store itself (full disk,
    /// I/O error, a lock held elsewhere, a read-only or unusable file) marks the journal
    /// failing; an error of one record's own (a constraint) fails that batch's callers only.
    fn record(&self, result: &rusqlite::Result<()>) {
        use rusqlite::ErrorCode as C;
        match result {
            Ok(()) => self.set(None),
            Err(e)
                if !matches!(
                    e.sqlite_error_code(),
                    Some(
                        C::DiskFull
                            | C::SystemIoFailure
                            | C::DatabaseBusy
                            | C::DatabaseLocked
                            | C::ReadOnly
                            | C::CannotOpen
                            | C::DatabaseCorrupt
                            | C::NotADatabase
                            | C::OutOfMemory
                            | C::PermissionDenied
                    )
                ) => {}
            Err(e) => self.set(Some(e.to_string())),
        }
    }

    /// `None`: a write reached the store; `Some(reason)`: the store itself failed.
    fn set(&self, failure: Option<String>) {
        let Ok(mut s) = self.state.lock() else { return };
        match failure {
            None => {
                if s.failing.take().is_some() {
                    tracing::info!("journal writes succeed again");
                }
            }
            Some(reason) => {
                if s.failing.is_none() {
                    tracing::error!(error = %reason, "journal writes fail: requests that need durability are refused until a write succeeds");
                }
                s.failing = Some(reason);
                s.failed_at = Some(Instant::now());
            }
        }
    }
}

/// A small durable write that touches nothing the journal keeps: `user_version` rewritten
/// with its own value, committed. Fails like a record would (read-only file, full disk, a
/// lock held elsewhere past the busy timeout).
fn probe_write(conn: &Connection) -> rusqlite::Result<()> {
    let v: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    conn.pragma_update(None, "user_version", v)
}

/// How long the writer waits for a lock another process holds, by default.
pub const DEFAULT_BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// A body kept in the journal: the bytes up to the record cap, redacted, with the full size
/// and SHA-256 of what was received.
///
/// Made only by [`Recorded::redacted`] / [`Recorded::redacted_parts`] (the fields can be read
/// but a `Recorded` cannot be built elsewhere), so no body reaches the journal without
/// passing redaction ([`redact`]).
// `_sealed` keeps this module's constructors the only way to make one inside the crate too
// (`#[non_exhaustive]` only binds other crates).
#[allow(clippy::manual_non_exhaustive)]
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The bytes kept: the whole body, or its redacted form; empty when `truncated` or when
    /// a secret could not be removed piecewise.
    pub bytes: Vec<u8>,
    /// Size of the whole body as received, bytes.
    pub total_bytes: u64,
    /// SHA-256 (hex) of the whole body as received.
    pub digest: String,
    /// The body was larger than `journal_max_record_bytes` (or carried a secret in a call's
    /// arguments): only the digest is usable (tool-turn contract §D: on replay or recovery
    /// this is a miss).
    pub truncated: bool,
    /// Redaction removed secrets from it: `bytes` are not what was received, so replay and
    /// recovery treat it as a miss too.
    pub redacted: bool,
    _sealed: (),
}

impl Recorded {
    /// Keeps only the digest and size: the body carried a secret turnguard redacted from
    /// the call records, so the raw body is not kept (a miss for replay and recovery).
    pub fn withheld(self) -> Self {
        Self {
            bytes: Vec::new(),
            truncated: true,
            ..self
        }
    }

    /// Keeps only the digest and size because the body is not needed (a chat turn's round
    /// under `journal_bodies = "runs"`: §D scopes chat turns out of replay and recovery).
    pub fn digest_only(self) -> Self {
        self.withheld()
    }

    /// [`Recorded::digest_only`] in place.
    pub fn keep_digest_only(&mut self) {
        self.bytes = Vec::new();
        self.truncated = true;
    }

    /// `body` redacted with the request's `redactor` ([`redact::redact_body`]), kept whole if
    /// it fits in `cap` bytes, else its digest with a truncation marker.
    pub fn redacted(body: &[u8], redactor: &crate::policy::Redactor, cap: usize) -> Self {
        use sha2::{Digest, Sha256};
        let kept = if body.len() > cap {
            None
        } else {
            Some(body.to_vec())
        };
        Self::redacted_parts(
            kept,
            body.len() as u64,
            hex::encode(Sha256::digest(body)),
            redactor,
        )
    }

    /// Only the digest (SHA-256, hex) and size of `body`, never its bytes: a body the journal
    /// does not keep (a chat turn's round under `journal_bodies = "runs"`, tool-turn contract
    /// §D), so nothing of it is redacted or copied.
    pub fn digest_of(body: &[u8]) -> Self {
        use sha2::{Digest, Sha256};
        Self {
            bytes: Vec::new(),
            total_bytes: body.len() as u64,
            digest: hex::encode(Sha256::digest(body)),
            truncated: true,
            redacted: false,
            _sealed: (),
        }
    }

    /// A body received in pieces: `kept` is all of it (`None` when it passed the record cap),
    /// `total_bytes` and `digest` (SHA-256, hex) cover the whole; redacted like
    /// [`Recorded::redacted`].
    pub fn redacted_parts(
        kept: Option<Vec<u8>>,
        total_bytes: u64,
        digest: String,
        redactor: &crate::policy::Redactor,
    ) -> Self {
        let Some(body) = kept else {
            return Self {
                bytes: Vec::new(),
                total_bytes,
                digest,
                truncated: true,
                redacted: false,
                _sealed: (),
            };
        };
        let (bytes, redacted) = match redact::redact_body(redactor, &body) {
            redact::Redacted::Clean => (body, false),
            redact::Redacted::Replaced(b) => (b, true),
            redact::Redacted::Withheld => (Vec::new(), true),
        };
        Self {
            bytes,
            total_bytes,
            digest,
            truncated: false,
            redacted,
            _sealed: (),
        }
    }

    /// A row read back from the journal.
    fn stored(
        bytes: Vec<u8>,
        total_bytes: u64,
        digest: String,
        truncated: bool,
        redacted: bool,
    ) -> Self {
        Self {
            bytes,
            total_bytes,
            digest,
            truncated,
            redacted,
            _sealed: (),
        }
    }

    /// The bytes are what was received, whole: replay and recovery may serve them.
    pub fn servable(&self) -> bool {
        !self.truncated && !self.redacted
    }
}

/// Which run a record belongs to (DESIGN.md §2); all `None` for a chat turn.
#[derive(Debug, Clone, Default)]
pub struct RunKey {
    pub run_id: Option<String>,
    pub node_id: Option<String>,
    pub attempt: Option<u32>,
}

/// One tool call of a round with its decision.
#[derive(Debug, Clone)]
pub struct CallRecord {
    pub choice: u32,
    /// Position of the call within its choice.
    pub ordinal: u32,
    pub call_id: String,
    pub name: String,
    pub outcome: &'static str,
    pub stage: &'static str,
    pub reason: &'static str,
    pub args_hash: Option<String>,
    /// Catalog `toolId`.
    pub tool_id: String,
    /// `false`: shadow mode released a call enforcement would have withheld.
    pub enforced: bool,
    /// Cedar rules that decided, comma-separated.
    pub rules: Option<String>,
    /// The arguments after redaction (JSON), never the raw ones.
    pub redacted_args: Option<String>,
    /// RFC 0150 activity-recipe id (run nodes only).
    pub logical_invocation_id: Option<String>,
    /// Per-node ordinal, derived from the transcript.
    pub node_ordinal: u64,
}

/// One model round: the request, what the upstream answered, and every decision.
#[derive(Debug, Clone)]
pub struct RoundRecord {
    /// turnguard's own id of the round (the journal key: the request's
    /// [`crate::proxy::RequestCtx::journal_id`], then `#repair-N`), never the client's.
    pub request_id: String,
    /// When the request that made the round arrived (its `RequestCtx::started`); not
    /// journaled. No event of the round's scope can be older ([`scopes`]).
    pub arrived: Instant,
    /// The agent's `x-request-id` (kept when sane), for correlation only: not a key. `None`
    /// when the agent sent none: the id turnguard made and echoed is then `request_id`'s.
    pub client_request_id: Option<String>,
    pub at_ms: i64,
    pub api: &'static str,
    pub model: Option<String>,
    pub stream: bool,
    pub run: RunKey,
    pub round_index: u32,
    /// SHA-256 (hex) of the RFC 8785 form of the request body.
    pub request_digest: String,
    /// Completion state per choice, comma-separated (`clean`, `truncated`, `refused`).
    pub completion: Option<String>,
    /// The provider's finish/stop reasons per choice, comma-separated.
    pub finish_reason: Option<String>,
    pub upstream_status: Option<u16>,
    pub latency_ms: u64,
    /// How the round ended (`ok`, `upstream_error`, `failed`: stream cut, invalid response,
    /// `client_gone`, `surfaced_error`, `repaired`).
    pub state: RoundState,
    pub error: Option<String>,
    /// The response as received from upstream (SSE bytes for a stream).
    pub response: Recorded,
    pub calls: Vec<CallRecord>,
    /// Responses API: the provider-stored response this round produced, for the response
    /// chain (see the module docs); `None` for other APIs or when no id was seen.
    pub response_link: Option<ResponseLink>,
    /// `structured` or `prompted` when the text answer had a schema (§A).
    pub channel: Option<&'static str>,
    /// `valid`, `refused`, or the invalid reason.
    pub channel_result: Option<String>,
    /// The turn's `contentTrust` after the run's sticky bit (tool-turn contract §C).
    pub content_trust: Option<crate::policy::bundle::ContentTrust>,
}

impl RoundRecord {
    /// Redacts the round's free text with the request's `redactor`: the model-chosen call
    /// names, the error and the channel verdict (the body is redacted when it is made,
    /// [`Recorded::redacted`]; arguments are kept only in their redacted form). Call ids are
    /// keys the provider assigns and the agent echoes, and are kept as they are.
    pub fn redact_text(&mut self, redactor: &crate::policy::Redactor) {
        for c in &mut self.calls {
            c.name = redactor.redact_text(&c.name);
        }
        if let Some(e) = &mut self.error {
            *e = redactor.redact_text(e);
        }
        if let Some(r) = &mut self.channel_result {
            *r = redactor.redact_text(r);
        }
    }
}

/// A tool result the agent sent in a request.
#[derive(Debug, Clone)]
pub struct ToolResultRecord {
    pub request_id: String,
    pub at_ms: i64,
    pub run: RunKey,
    /// The call id as the agent sent it: the key results are looked up by.
    pub tool_call_id: String,
    /// The call id as the `agent.tool-returned` event shows it, redacted by the request path
    /// (an id can hold a secret; the event payload never does).
    pub event_call_id: String,
    /// Who recorded it and may read it again (`person:<sub>`, or the agent's id): the MCP
    /// front serves a recorded result only to its reader. `None` for a row from before the
    /// journal kept it, which is served to nobody.
    pub reader: Option<String>,
    pub tool_name: Option<String>,
    pub is_error: bool,
    pub content: Recorded,
}

impl ToolResultRecord {
    /// The OpenWOP `agent.tool-returned` event of this result, appended the first time the
    /// result is recorded (the result body itself is never in the event): `status` `ok` or
    /// `error` (then `error.code` `turnguard.tool_reported_error`), and `durationMs` from
    /// `released_at_ms`, when the round that released the call was recorded (ms since epoch).
    pub fn returned_event(&self, released_at_ms: Option<i64>) -> EventRecord {
        let mut payload = serde_json::Map::new();
        payload.insert("agentId".into(), crate::clock::AGENT_ID.into());
        payload.insert(
            "toolName".into(),
            self.tool_name.as_deref().unwrap_or("unknown").into(),
        );
        payload.insert("callId".into(), self.event_call_id.clone().into());
        payload.insert(
            "status".into(),
            if self.is_error { "error" } else { "ok" }.into(),
        );
        if self.is_error {
            payload.insert(
                "error".into(),
                serde_json::json!({"code": "turnguard.tool_reported_error", "message": "the agent reported that the tool failed"}),
            );
        }
        if let Some(at) = released_at_ms {
            payload.insert("durationMs".into(), (self.at_ms - at).max(0).into());
        }
        EventRecord {
            request_id: self.request_id.clone(),
            run: self.run.clone(),
            at_ms: self.at_ms,
            kind: "agent.tool-returned",
            payload: crate::strict_json::to_text(&serde_json::Value::Object(payload)),
        }
    }
}

/// The tools one agent request declared, for `turnguard policy learn` (SQLite: counted in
/// `declared_tool_counts`; PostgreSQL: a row each in `declared_tools`; schemas in
/// `tool_schemas`). Never arguments or results: only the
/// request's tool declarations, redacted like every other record (tool-turn contract §B
/// stage 7): names by the request path, schemas by the writer when it stores one
/// ([`stored_schema_text`]).
#[derive(Debug, Clone)]
pub struct DeclaredToolsRecord {
    /// The agent request (the first round's `request_id`).
    pub request_id: String,
    pub at_ms: i64,
    pub run_id: Option<String>,
    pub api: &'static str,
    /// The declared tools, in declaration order.
    pub tools: Vec<DeclaredSchema>,
    /// The request's redactor, for the schemas the writer stores.
    pub redactor: Arc<crate::policy::Redactor>,
}

/// One tool of a [`DeclaredToolsRecord`].
#[derive(Debug, Clone)]
pub struct DeclaredSchema {
    /// The declared name, already redacted.
    pub name: String,
    /// The declared parameter schema as the agent sent it, shared with the request's turn
    /// (not a copy). Its digest is taken of it as sent (one row per distinct schema); what
    /// `tool_schemas` keeps of it is [`stored_schema_text`].
    pub schema: Option<Arc<serde_json::Value>>,
    /// The schema's fingerprint in this process
    /// ([`crate::admission::arguments::SchemaCache::check_size`]): the SQLite writer keeps
    /// each fingerprint's digest, so a schema declared again is not serialized and hashed
    /// again. `None`: the digest is computed.
    pub fingerprint: Option<u64>,
}

/// Largest declared tool schema kept whole, bytes; a larger one keeps its digest only.
pub const MAX_DECLARED_SCHEMA_BYTES: usize = 64 << 10;

/// What `tool_schemas.schema` keeps of a declared schema: its JSON text with every secret
/// the redactor finds replaced ([`redact::redact_body`]: strings after unescaping, and
/// object keys as text), or `None` (digest only) when that text is over
/// [`MAX_DECLARED_SCHEMA_BYTES`] or cannot be redacted. The SQLite writer runs it once per
/// schema it has not stored in this process; the PostgreSQL writer for every declaration (it
/// plans each request's insert on its own).
pub fn stored_schema_text(
    schema: &serde_json::Value,
    redactor: &crate::policy::Redactor,
) -> Option<String> {
    let text = schema.to_string();
    let text = match redact::redact_body(redactor, text.as_bytes()) {
        redact::Redacted::Clean => text,
        redact::Redacted::Replaced(bytes) => String::from_utf8(bytes).ok()?,
        redact::Redacted::Withheld => return None,
    };
    (text.len() <= MAX_DECLARED_SCHEMA_BYTES).then_some(text)
}

/// An OpenWOP run event (`agent.tool-called`, `agent.tool-returned` …) to append.
#[derive(Debug, Clone)]
pub struct EventRecord {
    pub request_id: String,
    pub run: RunKey,
    pub at_ms: i64,
    /// The v2 event type.
    pub kind: &'static str,
    /// The payload as JSON text (closed shape per `run-event-payloads`), never raw write-tool
    /// arguments: serialized where the event is made, so the writer thread only stores it.
    pub payload: String,
}

/// An effect claim (OpenWOP idempotency.md): insert-if-absent on the effect id.
#[derive(Debug, Clone)]
pub struct EffectClaim {
    /// SHA-256 (hex) identity of the effect.
    pub effect_id: String,
    pub tool_id: String,
    pub call_id: String,
    pub run: RunKey,
    /// `business-identity` or `activity-recipe`.
    pub keying: &'static str,
    pub at_ms: i64,
    /// The claiming turnguard process ([`instance_id`]). On PostgreSQL the writer records
    /// its own replica id instead (one per opened journal, the id its liveness lock is held
    /// under).
    pub instance: String,
    /// Who may read the effect's recorded result: `person:<sub>` or `agent`. With the run
    /// it scopes the result (OpenWOP idempotency.md; the claim itself is tenant-wide).
    pub reader: String,
}

/// A claim whose call never reached the agent (not confirmed released) may be taken over by
/// another call once its process is gone, or after this long (ms).
pub const CLAIM_LEASE_MS: i64 = 60_000;

/// This process's id in effect claims: a claim left unconfirmed by a process that died (a
/// crash between the claim and the answer leaving) can be taken over after a restart.
pub fn instance_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| uuid::Uuid::new_v4().to_string())
}

/// The result of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This call now owns the effect.
    Claimed,
    /// The effect was claimed before by `call_id` of the same reader and run; `result` is
    /// its recorded tool result, when one arrived.
    Existing {
        call_id: String,
        result: Option<String>,
    },
    /// The effect was claimed before by another principal or in another run: nothing of it
    /// (not its result, not whether it completed) may be shown to this caller.
    Foreign,
}

/// A call released to the agent in a served response.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ServedCall {
    pub call_id: String,
    pub tool_name: String,
    /// `safetyTier` pure/read or `replayPolicy` deterministic/idempotent (tool-turn contract §D).
    pub rerunnable: bool,
}

/// The response the agent received for one round of a run node (what recovery and replay
/// serve again).
#[derive(Debug, Clone)]
pub struct ServedRecord {
    pub run_id: String,
    pub node_id: String,
    pub attempt: u32,
    pub round_index: u32,
    pub request_digest: String,
    pub request_id: String,
    pub status: u16,
    pub content_type: String,
    pub body: Recorded,
    pub calls: Vec<ServedCall>,
    pub at_ms: i64,
    /// Claims (effect id, call id) of the released calls, confirmed in the same transaction.
    pub claims: Vec<(String, String)>,
    /// Who may read the record again: `person:<sub>` of the verified acting person, or the
    /// agent's id when none acted (as [`EffectClaim::reader`]); `None` for a record written
    /// before the journal kept it, which is served to nobody.
    pub reader: Option<String>,
}

/// What a request records before it goes upstream, as one unit of work (one transaction,
/// one commit): the tool results it carries (durable: tool-turn contract §D, a result is
/// journaled before the round that follows it is asked for) and the tools it declared
/// (`turnguard policy learn`). See [`Journal::record_before_upstream`].
#[derive(Debug, Clone, Default)]
pub struct BeforeUpstream {
    pub tool_results: Vec<ToolResultRecord>,
    pub declared_tools: Option<DeclaredToolsRecord>,
    /// The run's sticky trust bit, set (insert-if-absent, table `run_trust`) because this
    /// turn of the run is untrusted (tool-turn contract §C): every later turn of the run is.
    pub run_untrusted: Option<RunUntrusted>,
}

/// A run made untrusted by the turn of request `request_id` at `at_ms` (ms since epoch).
#[derive(Debug, Clone)]
pub struct RunUntrusted {
    pub run_id: String,
    pub request_id: String,
    pub at_ms: i64,
}

/// A model round's decision as one unit of work (one transaction, one commit), built by the
/// request path once the round is decided and before its answer leaves: the round with its
/// calls, the `agent.tool-called` / `agent.tool-returned` events of its decisions, for a run
/// node the served record (which confirms its claims in the same transaction), and for a
/// chat turn the claims to confirm. See [`Journal::commit_round`].
#[derive(Debug, Clone, Default)]
pub struct RoundCommit {
    pub round: Option<RoundRecord>,
    pub events: Vec<EventRecord>,
    pub served: Option<ServedRecord>,
    /// Claims (effect id, call id) to confirm when there is no served record (a chat turn);
    /// a served record carries its own ([`ServedRecord::claims`]).
    pub claims: Vec<(String, String)>,
}

impl RoundCommit {
    /// Whether the contract needs this unit durable before the answer leaves: a run node's
    /// round or served record (replay and recovery read them, §D) or a claim confirmation.
    fn durable(&self) -> bool {
        self.served.is_some()
            || !self.claims.is_empty()
            || self.round.as_ref().is_some_and(|r| r.run.run_id.is_some())
    }

    /// Whether the caller waits for the commit even when it is not durable: a round that
    /// stores a provider-held response (Responses `response_link`) is read by the next
    /// request's chain trust, which must not find it missing.
    fn awaited(&self) -> bool {
        self.durable()
            || self
                .round
                .as_ref()
                .is_some_and(|r| r.response_link.is_some())
    }

    fn is_empty(&self) -> bool {
        self.round.is_none()
            && self.events.is_empty()
            && self.served.is_none()
            && self.claims.is_empty()
    }
}

enum Op {
    ConfirmClaims(Vec<(String, String)>),
    Prune {
        before_ms: i64,
    },
    Cursor {
        run_id: String,
        node_id: String,
        skipped: u32,
    },
    ReleaseClaim {
        effect_id: String,
        call_id: String,
    },
    ToolResults(Vec<ToolResultRecord>),
    Events(Vec<EventRecord>),
    DeclaredTools(Box<DeclaredToolsRecord>),
    BeforeUpstream(Box<BeforeUpstream>),
    RoundCommit(Box<RoundCommit>),
    /// A round's effect claims, in order; answered with one [`Claim`] per claim.
    Claims(Vec<EffectClaim>, oneshot::Sender<Vec<Claim>>),
    Interrupt(Box<interrupts::Op>),
    /// A principal token seen on the data plane (its fingerprint), insert-if-absent.
    Token {
        fingerprint: String,
        expires_at_ms: i64,
        at_ms: i64,
    },
    /// A health probe ([`probe_write`]).
    Probe,
}

struct Job {
    op: Op,
    ack: Option<oneshot::Sender<Result<(), JournalError>>>,
    /// The contract needs this record durable before the caller goes on
    /// (`synchronous=FULL`); other records are committed with `synchronous=NORMAL` (WAL: safe
    /// against corruption, may lose the last commits on power loss) and nobody waits.
    durable: bool,
    /// Counts the job in `turnguard_journal_queue_depth_records` until the writer takes it
    /// off the queue (or the job is dropped unsent).
    queued: Option<crate::metrics::GaugeGuard>,
}

impl Job {
    /// Someone waits for this record's commit: its batch closes at once.
    fn waited_for(&self) -> bool {
        self.ack.is_some() || self.durable
    }
}

/// Handle to the journal writer: the store interface the request path talks to, whichever
/// backend is behind it (a SQLite file or a PostgreSQL database, [`JournalLocation`]). Every
/// write is an [`Op`] queued to one writer per process (a thread for SQLite, a task for
/// PostgreSQL) that commits them in groups. Cheap to clone.
#[derive(Clone)]
pub struct Journal {
    tx: mpsc::Sender<Job>,
    /// Wakes the SQLite writer from its linger when a record someone waits for is queued.
    wake: WriterWake,
    metrics: Arc<Metrics>,
    location: JournalLocation,
    health: Arc<JournalHealth>,
    store: Store,
    /// Tool results this process recorded ([`seen_results`]).
    seen: Arc<seen_results::SeenResults>,
}

/// What a [`Journal`] handle needs of its backend beyond the writer queue.
#[derive(Clone)]
enum Store {
    Sqlite(PathBuf),
    Postgres(postgres::Shared),
}

impl Journal {
    /// Opens the journal at `location` (creating and migrating it) and starts its writer: a
    /// SQLite file with a writer thread whose writes wait `busy_timeout` for a lock another
    /// process holds, or a PostgreSQL database (pool, migrations by `refinery`, a writer task
    /// and the `LISTEN` task of [`Journal::resolved_elsewhere`]). A probe write is committed
    /// before this returns.
    ///
    /// Errors: [`JournalError::Open`] naming the location (never a password).
    pub async fn open(
        location: &JournalLocation,
        metrics: Arc<Metrics>,
        busy_timeout: std::time::Duration,
    ) -> Result<(Self, WriterThread), JournalError> {
        match location {
            JournalLocation::Sqlite(path) => Self::open_sqlite_with(path, metrics, busy_timeout),
            JournalLocation::Postgres(url) => postgres::open(url, location, metrics).await,
        }
    }

    /// Opens (creating and migrating) a SQLite journal and starts the writer thread, with
    /// [`DEFAULT_BUSY_TIMEOUT`].
    ///
    /// Errors: [`JournalError::Open`] naming the path.
    pub fn open_sqlite(
        path: &Path,
        metrics: Arc<Metrics>,
    ) -> Result<(Self, WriterThread), JournalError> {
        Self::open_sqlite_with(path, metrics, DEFAULT_BUSY_TIMEOUT)
    }

    /// [`Journal::open_sqlite`] with the writer's busy timeout (how long a write waits for a
    /// lock another process holds). The file must be writable: a probe write is committed
    /// before this returns.
    ///
    /// Errors: [`JournalError::Open`] naming the path, also when the journal is not writable.
    pub fn open_sqlite_with(
        path: &Path,
        metrics: Arc<Metrics>,
        busy_timeout: std::time::Duration,
    ) -> Result<(Self, WriterThread), JournalError> {
        let open_err = |e: rusqlite::Error| JournalError::Open {
            path: path.to_owned(),
            reason: e.to_string(),
        };
        let conn = Connection::open(path).map_err(open_err)?;
        schema::migrate(&conn).map_err(open_err)?;
        conn.busy_timeout(busy_timeout).map_err(open_err)?;
        conn.pragma_update(None, "cache_size", -WRITER_CACHE_KIB)
            .map_err(open_err)?;
        probe_write(&conn).map_err(|e| JournalError::Open {
            path: path.to_owned(),
            reason: format!("the journal is not writable: {e}"),
        })?;
        let releases = released::ChatReleases::load(&conn).map_err(open_err)?;
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let m = Arc::clone(&metrics);
        let health = Arc::new(JournalHealth::default());
        let h = Arc::clone(&health);
        let wake = WriterWake::default();
        let writer_wake = wake.clone();
        let handle = std::thread::Builder::new()
            .name("turnguard-journal".into())
            .spawn(move || {
                writer_wake.register();
                writer(conn, rx, &m, &h, releases)
            })
            .map_err(|e| JournalError::Open {
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
        Ok((
            Self {
                tx,
                wake,
                metrics,
                location: JournalLocation::Sqlite(path.to_owned()),
                health,
                store: Store::Sqlite(path.to_owned()),
                seen: Arc::default(),
            },
            WriterThread(WriterKind::Thread(handle)),
        ))
    }

    /// The tool results this process recorded, by key ([`seen_results`]): the request path
    /// skips a result the journal already holds, and remembers the ones it commits.
    pub fn seen_results(&self) -> &seen_results::SeenResults {
        &self.seen
    }

    /// Where the journal lives (its `Display` never shows a password).
    pub fn location(&self) -> &JournalLocation {
        &self.location
    }

    /// A reader of this journal ([`JournalReader`]): a pool of read-only SQLite connections,
    /// or the PostgreSQL pool.
    ///
    /// Errors: [`JournalError::Open`] when the SQLite file cannot be opened read-only.
    pub fn reader(&self) -> Result<JournalReader, JournalError> {
        match &self.store {
            Store::Sqlite(path) => Ok(JournalReader::sqlite(SqliteReader::open(path)?)),
            Store::Postgres(shared) => Ok(JournalReader::postgres(shared.pool())),
        }
    }

    /// The MCP front's reader of this journal ([`McpReader`]).
    ///
    /// Errors: [`JournalError::Open`] when the SQLite file cannot be opened read-only.
    pub fn mcp_reader(&self) -> Result<McpReader, JournalError> {
        match &self.store {
            Store::Sqlite(path) => McpReader::open(path),
            Store::Postgres(shared) => Ok(McpReader::postgres(shared.pool())),
        }
    }

    /// Completes once interrupt `interrupt_id` is seen resolved by another replica sharing
    /// this journal, with its state: on PostgreSQL, woken by `NOTIFY turnguard_interrupts`
    /// (payload: the interrupt id) and, while the listener is down, by polling the row every
    /// [`postgres::POLL_WHILE_DEAF`]. On SQLite (one process owns the file) it never
    /// completes: the in-process waiters ([`crate::approvals`]) are woken directly.
    pub async fn resolved_elsewhere(&self, interrupt_id: &str) -> InterruptState {
        match &self.store {
            Store::Sqlite(_) => std::future::pending().await,
            Store::Postgres(shared) => shared.resolved(self, interrupt_id).await,
        }
    }

    /// Queues `op` and waits for its durable commit (`synchronous=FULL`).
    async fn submit(&self, op: Op) -> Result<(), JournalError> {
        self.submit_with(op, true).await
    }

    /// Whether writes currently succeed.
    pub fn health(&self) -> &JournalHealth {
        &self.health
    }

    /// Commits a probe write durably and updates [`JournalHealth`] with the result; bypasses
    /// the fail-fast of a failing journal (it is how recovery is noticed).
    pub async fn probe(&self) -> Result<(), JournalError> {
        self.enqueue(Op::Probe, true).await
    }

    /// Queues `op` and waits for its commit; `durable` chooses `synchronous=FULL`. A durable
    /// record is refused at once while the journal is failing ([`JournalError::Failing`]).
    async fn submit_with(&self, op: Op, durable: bool) -> Result<(), JournalError> {
        if durable {
            if let Some(reason) = self.health.failing() {
                self.metrics.journal_write_failures.inc();
                return Err(JournalError::Failing(reason));
            }
        }
        self.enqueue(op, durable).await
    }

    async fn enqueue(&self, op: Op, durable: bool) -> Result<(), JournalError> {
        let (ack, done) = oneshot::channel();
        // Reserve first: a caller dropped while it waits for room leaves the depth gauge as
        // it was (the gauge moves only together with the send).
        let Ok(slot) = self.tx.reserve().await else {
            self.metrics.journal_write_failures.inc();
            return Err(JournalError::Closed);
        };
        slot.send(Job {
            op,
            ack: Some(ack),
            durable,
            queued: Some(crate::metrics::GaugeGuard::new(
                &self.metrics.journal_queue_depth,
            )),
        });
        // A lingering batch closes now ([`next_batch`]); relaxed records never wake it.
        self.wake.wake();
        done.await.unwrap_or(Err(JournalError::Closed))
    }

    /// Queues a record the contract does not need durable before the caller goes on (audit
    /// events, a chat turn's round): waits only for room in the queue, not for the commit.
    async fn submit_relaxed(&self, op: Op) -> Result<(), JournalError> {
        let Ok(slot) = self.tx.reserve().await else {
            self.metrics.journal_write_failures.inc();
            return Err(JournalError::Closed);
        };
        slot.send(Job {
            op,
            ack: None,
            durable: false,
            queued: Some(crate::metrics::GaugeGuard::new(
                &self.metrics.journal_queue_depth,
            )),
        });
        Ok(())
    }

    /// Records what a request carries before it goes upstream in one commit: its tool
    /// results and the run's sticky trust bit durably (returns once committed), and its
    /// declared tools. With neither results nor the bit, the declared tools are queued only
    /// (nothing in the contract waits for them).
    pub async fn record_before_upstream(&self, unit: BeforeUpstream) -> Result<(), JournalError> {
        if unit.tool_results.is_empty() && unit.run_untrusted.is_none() {
            return match unit.declared_tools {
                Some(d) => self.record_declared_tools(d).await,
                None => Ok(()),
            };
        }
        self.submit(Op::BeforeUpstream(Box::new(unit))).await
    }

    /// Commits a decided round as one unit ([`RoundCommit`]): durably, returning once
    /// committed, when it holds a run node's round, a served record or claims to confirm;
    /// otherwise (a chat turn's round and events) queued, not awaited — except a round that
    /// stores a provider-held response, which is awaited.
    /// Errors: [`JournalError::Fenced`] when a claim it confirms was taken over by another
    /// owner (PostgreSQL): nothing of the unit is committed, and the answer must not leave.
    ///
    /// The unit comes boxed: it is ~860 bytes, and by value every future on the way here
    /// kept its own copy.
    pub async fn commit_round(&self, unit: Box<RoundCommit>) -> Result<(), JournalError> {
        if unit.is_empty() {
            return Ok(());
        }
        let (durable, awaited) = (unit.durable(), unit.awaited());
        let op = Op::RoundCommit(unit);
        if awaited {
            self.submit_with(op, durable).await
        } else {
            self.submit_relaxed(op).await
        }
    }

    /// Records tool results durably; returns once they are committed.
    pub async fn record_tool_results(
        &self,
        recs: Vec<ToolResultRecord>,
    ) -> Result<(), JournalError> {
        if recs.is_empty() {
            return Ok(());
        }
        self.submit(Op::ToolResults(recs)).await
    }

    /// Appends run events; `sequence` is assigned per scope (run, else request) in commit
    /// order, strictly increasing, never renumbered.
    pub async fn record_events(&self, events: Vec<EventRecord>) -> Result<(), JournalError> {
        if events.is_empty() {
            return Ok(());
        }
        self.submit_relaxed(Op::Events(events)).await
    }

    /// Records the tools an agent request declared (queued, not awaited for durability:
    /// nothing in the contract depends on it; `turnguard policy learn` reads it).
    pub async fn record_declared_tools(
        &self,
        rec: DeclaredToolsRecord,
    ) -> Result<(), JournalError> {
        if rec.tools.is_empty() {
            return Ok(());
        }
        self.submit_relaxed(Op::DeclaredTools(Box::new(rec))).await
    }

    /// Marks claims (effect id, call id) as released: their calls are about to reach the
    /// agent. Until then a claim can be taken over if its process died (a crash between the
    /// claim and the answer leaving).
    pub async fn confirm_claims(&self, claims: Vec<(String, String)>) -> Result<(), JournalError> {
        if claims.is_empty() {
            return Ok(());
        }
        self.submit(Op::ConfirmClaims(claims)).await
    }

    /// Deletes records older than `before_ms` (retention; effects are kept ≥ 14 days by
    /// configuration). Returns once committed, relaxed (no fsync of its own): a prune lost to
    /// a crash runs again at the next start or hour, so housekeeping never costs a durable
    /// commit nor lands in the commits a request made (`turnguard_journal_commits_total`).
    pub async fn prune(&self, before_ms: i64) -> Result<(), JournalError> {
        self.submit_with(Op::Prune { before_ms }, false).await?;
        // Rows of results it remembers may be gone: a result that comes again is written
        // again, as before the memory ([`seen_results`]).
        self.seen.forget_all();
        Ok(())
    }

    /// Sets how many recorded rounds a replay of (run, node) has served without the agent.
    pub async fn set_replay_cursor(
        &self,
        run_id: &str,
        node_id: &str,
        skipped: u32,
    ) -> Result<(), JournalError> {
        self.submit(Op::Cursor {
            run_id: run_id.to_owned(),
            node_id: node_id.to_owned(),
            skipped,
        })
        .await
    }

    /// Gives back a claim this call took but did not use (the call was not released).
    /// Only the claim of `call_id` is removed.
    pub async fn release_claim(&self, effect_id: &str, call_id: &str) -> Result<(), JournalError> {
        self.submit(Op::ReleaseClaim {
            effect_id: effect_id.to_owned(),
            call_id: call_id.to_owned(),
        })
        .await
    }

    /// Records that a principal token (by its claims fingerprint,
    /// [`crate::identity::TokenId`]) was presented on the data plane, durably, before the
    /// request goes on: such a token never resolves an interrupt, in this process or after a
    /// restart (tool-turn contract §C). Kept until the token expired (pruned after).
    pub async fn remember_token(
        &self,
        fingerprint: &str,
        expires_at_ms: i64,
    ) -> Result<(), JournalError> {
        self.submit(Op::Token {
            fingerprint: fingerprint.to_owned(),
            expires_at_ms,
            at_ms: crate::clock::now_ms(),
        })
        .await
    }

    /// Claims an effect: an atomic insert-if-absent with a row-count check, committed before
    /// this returns. Never a replacing insert (`OR REPLACE`).
    pub async fn claim_effect(&self, claim: EffectClaim) -> Result<Claim, JournalError> {
        self.claim_effects(vec![claim])
            .await?
            .pop()
            .ok_or(JournalError::Closed)
    }

    /// Claims a round's effects in one commit, each an atomic insert-if-absent as in
    /// [`Journal::claim_effect`], in order (a later claim of the same effect in the list
    /// finds the earlier one); one [`Claim`] per claim, in the same order.
    pub async fn claim_effects(
        &self,
        claims: Vec<EffectClaim>,
    ) -> Result<Vec<Claim>, JournalError> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let (tx, rx) = oneshot::channel();
        self.submit(Op::Claims(claims, tx)).await?;
        rx.await.map_err(|_| JournalError::Closed)
    }
}

/// The journal's writer (a thread for SQLite, a task for PostgreSQL); join it after every
/// [`Journal`] handle is dropped to flush the queue.
pub struct WriterThread(WriterKind);

enum WriterKind {
    Thread(std::thread::JoinHandle<()>),
    /// The PostgreSQL writer task, and the tasks that end with it (the `LISTEN` task).
    Task {
        writer: tokio::task::JoinHandle<()>,
        companions: Vec<tokio::task::AbortHandle>,
        runtime: tokio::runtime::Handle,
    },
}

impl WriterThread {
    /// Waits until the queue is drained and the database closed. Blocking: call it off the
    /// async worker threads (`spawn_blocking`).
    pub fn join(self) {
        match self.0 {
            WriterKind::Thread(handle) => {
                let _ = handle.join();
            }
            WriterKind::Task {
                writer,
                companions,
                runtime,
            } => {
                let _ = runtime.block_on(writer);
                for task in companions {
                    task.abort();
                }
            }
        }
    }
}

/// The SQLite writer thread as its queue's senders see it: a record someone waits for wakes
/// it from a linger ([`next_batch`]). Unset for the PostgreSQL writer (a task, which lingers
/// on its own terms), where waking is a no-op.
#[derive(Clone, Default)]
struct WriterWake(Arc<std::sync::OnceLock<std::thread::Thread>>);

impl WriterWake {
    /// Makes the calling thread the one [`WriterWake::wake`] wakes (the first call wins).
    fn register(&self) {
        let _ = self.0.set(std::thread::current());
    }

    /// Unparks the writer thread, if one registered (a wake before it parks is kept: its
    /// next park returns at once).
    fn wake(&self) {
        if let Some(t) = self.0.get() {
            t.unpark();
        }
    }
}

/// Takes the next batch: the first record, whatever is queued behind it, and, while nobody
/// waits for any record in it, what arrives within `linger` ([`RELAXED_LINGER`]). The writer
/// sleeps through the linger in one park: a record someone waits for unparks it
/// ([`WriterWake`], from [`Journal::enqueue`]) and closes the batch at once, a relaxed record
/// does not wake it (it is taken when the linger ends). Polling instead (every 250 µs) woke
/// the writer eight times a batch on the request path's core. `None` once the queue is
/// closed and empty.
///
/// The same park was tried in issue 13 run 12, when a request cost ~136 µs: it saved no CPU
/// then and the open-loop service p99 rose by ~0.12 ms, so the poll came back. At ~54 µs a
/// request the poll's wake-ups were 0.2 context switches a request and ~4 µs of system time
/// (4 of 4 pairs), and with the park the open-loop service p99 of run 21 (696 / 647 / 400 µs)
/// sits with the polling runs 19–20's (593–1,283 µs) (bench/RESULTS.md, run 21).
fn next_batch(rx: &mut mpsc::Receiver<Job>, linger: Duration) -> Option<Vec<Job>> {
    let first = rx.blocking_recv()?;
    let mut waited_for = first.waited_for();
    let mut batch = vec![first];
    let deadline = Instant::now() + linger;
    while batch.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(job) => {
                waited_for |= job.waited_for();
                batch.push(job);
            }
            Err(mpsc::error::TryRecvError::Disconnected) => break,
            Err(mpsc::error::TryRecvError::Empty) => {
                let now = Instant::now();
                if waited_for || now >= deadline {
                    break;
                }
                // Returns at the deadline, on a wake, or spuriously: the queue is looked at
                // again either way.
                std::thread::park_timeout(deadline - now);
            }
        }
    }
    Some(batch)
}

fn writer(
    mut conn: Connection,
    mut rx: mpsc::Receiver<Job>,
    metrics: &Metrics,
    health: &JournalHealth,
    releases: released::ChatReleases,
) {
    conn.set_prepared_statement_cache_capacity(64);
    let mut memory = WriterMemory {
        schemas: KnownSchemas::default(),
        releases,
        scopes: scopes::EventScopes::default(),
    };
    let mut full = true;
    while let Some(mut batch) = next_batch(&mut rx, RELAXED_LINGER) {
        // Off the queue: each job's guard takes it out of the depth gauge.
        for job in &mut batch {
            job.queued = None;
        }
        // One fsync per batch when any record in it must be durable; none otherwise.
        let durable = batch.iter().any(|j| j.durable);
        if durable != full {
            let mode = if durable { "FULL" } else { "NORMAL" };
            if conn.pragma_update(None, "synchronous", mode).is_ok() {
                full = durable;
            }
        }
        let started = Instant::now();
        let committed = commit(&mut conn, &mut batch, &mut memory);
        health.record(&committed);
        let result = committed.map_err(|e| JournalError::Write(e.to_string()));
        metrics
            .journal_commit_latency
            .observe(started.elapsed().as_secs_f64());
        metrics.journal_batch_size.observe(batch.len() as f64);
        if result.is_ok() {
            count_commit(metrics, &batch);
        }
        if let Err(e) = &result {
            metrics.journal_write_failures.inc_by(batch.len() as u64);
            tracing::error!(error = %e, records = batch.len(), "journal batch failed");
        }
        for job in batch {
            if let Some(ack) = job.ack {
                let _ = ack.send(result.clone());
            }
        }
    }
}

/// What the SQLite writer keeps between batches.
#[derive(Default)]
struct WriterMemory {
    schemas: KnownSchemas,
    releases: released::ChatReleases,
    /// The chat scopes this writer wrote event rows to.
    scopes: scopes::EventScopes,
}

/// The schema digests known to be in `tool_schemas`: those of committed batches only (a
/// batch that rolls back forgets what it added).
#[derive(Default)]
struct KnownSchemas {
    /// foldhash, as `digests`: the keys are SHA-256 digests and keyed fingerprints, which no
    /// client can aim at a bucket.
    committed: foldhash::HashSet<String>,
    pending: Vec<String>,
    /// Each schema fingerprint's digest ([`DeclaredSchema::fingerprint`]; a pure function
    /// of the schema, so a rolled-back batch or a prune leaves it true).
    digests: foldhash::HashMap<u64, String>,
}

impl KnownSchemas {
    /// The digest of a declared schema (SHA-256 of its RFC 8785 form), from its fingerprint
    /// when this writer has digested it before.
    fn digest(&mut self, fingerprint: Option<u64>, schema: &serde_json::Value) -> String {
        let Some(fingerprint) = fingerprint else {
            return crate::admission::arguments::args_hash(schema);
        };
        if let Some(digest) = self.digests.get(&fingerprint) {
            return digest.clone();
        }
        if self.digests.len() >= KNOWN_SCHEMAS {
            self.digests.clear();
        }
        let digest = crate::admission::arguments::args_hash(schema);
        self.digests.insert(fingerprint, digest.clone());
        digest
    }

    fn contains(&self, digest: &str) -> bool {
        self.committed.contains(digest) || self.pending.iter().any(|d| d == digest)
    }

    fn settle(&mut self, committed: bool) {
        if !committed {
            self.pending.clear();
            return;
        }
        if self.committed.len() + self.pending.len() > KNOWN_SCHEMAS {
            self.committed.clear();
        }
        self.committed.extend(self.pending.drain(..));
    }
}

fn commit(
    conn: &mut Connection,
    batch: &mut [Job],
    memory: &mut WriterMemory,
) -> rusqlite::Result<()> {
    let result = commit_batch(conn, batch, memory);
    memory.schemas.settle(result.is_ok());
    memory.releases.settle(result.is_ok());
    result
}

/// Commits `batch` in one transaction, begun and committed through the connection's
/// prepared-statement cache (rusqlite's `Transaction` parses `BEGIN` and `COMMIT` again for
/// every batch: 1.2 % of the stream cell's CPU under perf); any failure rolls it back.
fn commit_batch(
    conn: &mut Connection,
    batch: &mut [Job],
    memory: &mut WriterMemory,
) -> rusqlite::Result<()> {
    conn.prepare_cached("BEGIN")?.execute([])?;
    let applied = apply_batch(conn, batch, memory)
        .and_then(|after| conn.prepare_cached("COMMIT")?.execute([]).map(|_| after));
    match applied {
        Ok(after) => {
            after.send();
            Ok(())
        }
        Err(e) => {
            if !conn.is_autocommit() {
                if let Err(rollback) = conn.execute_batch("ROLLBACK") {
                    tracing::error!(error = %rollback, "journal batch not rolled back");
                }
            }
            Err(e)
        }
    }
}

/// What a batch's callers are told once it committed: claims taken, interrupts answered.
struct AfterCommit {
    answers: Vec<(oneshot::Sender<Vec<Claim>>, Vec<Claim>)>,
    replies: interrupts::Replies,
}

impl AfterCommit {
    fn send(self) {
        for (tx, result) in self.answers {
            let _ = tx.send(result);
        }
        for reply in self.replies {
            reply();
        }
    }
}

/// Writes every record of `batch` inside the open transaction.
fn apply_batch(
    tx: &Connection,
    batch: &mut [Job],
    memory: &mut WriterMemory,
) -> rusqlite::Result<AfterCommit> {
    let WriterMemory {
        schemas: known,
        releases,
        scopes,
    } = memory;
    let mut answers: Vec<(oneshot::Sender<Vec<Claim>>, Vec<Claim>)> = Vec::new();
    let mut replies: interrupts::Replies = Vec::new();
    let mut declared = declared::DeclaredCounts::default();
    let mut round_insert = None;
    for job in batch.iter_mut() {
        match &mut job.op {
            Op::ConfirmClaims(list) => confirm(tx, list)?,
            Op::Prune { before_ms } => prune::prune(tx, *before_ms, known)?,
            Op::BeforeUpstream(u) => {
                if let Some(r) = &u.run_untrusted {
                    exec(
                        tx,
                        "INSERT INTO run_trust (run_id, trust, request_id, at_ms)
                         VALUES (?1, 'untrusted', ?2, ?3) ON CONFLICT (run_id) DO NOTHING",
                        params![r.run_id, r.request_id, r.at_ms],
                    )?;
                }
                for t in &u.tool_results {
                    insert_tool_result(tx, t, releases, scopes)?;
                }
                if let Some(d) = &u.declared_tools {
                    declared.add(tx, d, known)?;
                }
            }
            Op::RoundCommit(u) => {
                confirm(tx, &u.claims)?;
                if let Some(r) = &u.served {
                    insert_served(tx, r)?;
                }
                let folded = match &u.round {
                    Some(r) => insert_round(tx, &mut round_insert, r, &u.events, releases, scopes)?
                        .then_some(r),
                    None => None,
                };
                for e in &u.events {
                    if !folded.is_some_and(|r| folds(r, e)) {
                        insert_event(tx, e, scopes)?;
                    }
                }
            }
            Op::Cursor {
                run_id,
                node_id,
                skipped,
            } => {
                exec(
                    tx,
                    "INSERT INTO replay_cursor (run_id, node_id, skipped) VALUES (?1, ?2, ?3)
                     ON CONFLICT (run_id, node_id) DO UPDATE SET skipped = excluded.skipped",
                    params![&*run_id, &*node_id, *skipped],
                )?;
            }
            Op::ReleaseClaim { effect_id, call_id } => {
                exec(
        tx,
                    "DELETE FROM effects WHERE effect_id = ?1 AND call_id = ?2 AND state = 'claimed'",
                    params![&*effect_id, &*call_id],
                )?;
            }
            Op::ToolResults(list) => {
                for t in list {
                    insert_tool_result(tx, t, releases, scopes)?;
                }
            }
            Op::Events(list) => {
                for e in list {
                    insert_event(tx, e, scopes)?;
                }
            }
            Op::DeclaredTools(d) => declared.add(tx, d, known)?,
            Op::Claims(list, answer) => {
                let mut results = Vec::with_capacity(list.len());
                for c in list.iter() {
                    results.push(claim(tx, c)?);
                }
                let (dummy, _) = oneshot::channel();
                answers.push((std::mem::replace(answer, dummy), results));
            }
            Op::Interrupt(op) => interrupts::apply(tx, op, &mut replies, scopes)?,
            Op::Token {
                fingerprint,
                expires_at_ms,
                at_ms,
            } => {
                exec(
                    tx,
                    "INSERT INTO principal_tokens (fingerprint, expires_at_ms, first_seen_ms)
                     VALUES (?1, ?2, ?3) ON CONFLICT (fingerprint) DO NOTHING",
                    params![&*fingerprint, *expires_at_ms, *at_ms],
                )?;
            }
            Op::Probe => probe_write(tx)?,
        }
    }
    declared.flush(tx)?;
    Ok(AfterCommit { answers, replies })
}

/// Counts a committed batch in `turnguard_journal_commits_total` by how it was made durable
/// (a batch made durable only by a health probe is counted apart, so the commits requests
/// need can be read).
fn count_commit(metrics: &Metrics, batch: &[Job]) {
    use crate::metrics::{CommitDurability, CommitLabels};
    let probe = |j: &Job| matches!(j.op, Op::Probe);
    // Durable for a request only when a record other than a probe needed it (a probe makes
    // its batch durable too, but that fsync is the probe's).
    let durability = if batch.iter().any(|j| j.durable && !probe(j)) {
        CommitDurability::Durable
    } else if batch.iter().any(probe) {
        CommitDurability::Probe
    } else {
        CommitDurability::Relaxed
    };
    metrics
        .journal_commits
        .get_or_create(&CommitLabels { durability })
        .inc();
}

/// Executes `sql` through the connection's prepared-statement cache.
fn exec<P: rusqlite::Params>(
    tx: &rusqlite::Connection,
    sql: &str,
    params: P,
) -> rusqlite::Result<usize> {
    tx.prepare_cached(sql)?.execute(params)
}

fn confirm(tx: &rusqlite::Connection, claims: &[(String, String)]) -> rusqlite::Result<()> {
    for (effect_id, call_id) in claims {
        exec(
            tx,
            "UPDATE effects SET released = 1 WHERE effect_id = ?1 AND call_id = ?2",
            params![effect_id, call_id],
        )?;
    }
    Ok(())
}

/// A served record, insert-if-absent on (run, node, attempt, round) (the first answer is the
/// record), confirming its claims in the same transaction.
fn insert_served(tx: &rusqlite::Connection, r: &ServedRecord) -> rusqlite::Result<()> {
    confirm(tx, &r.claims)?;
    exec(
        tx,
"INSERT INTO served (run_id, node_id, attempt, round_index, request_digest, request_id, status,
                        content_type, body, body_bytes, body_digest, truncated, calls, at_ms, redacted, reader)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)
                     ON CONFLICT (run_id, node_id, attempt, round_index) DO NOTHING",
                    params![
                        r.run_id,
                        r.node_id,
                        r.attempt,
                        r.round_index,
                        r.request_digest,
                        r.request_id,
                        r.status,
                        r.content_type,
                        r.body.bytes,
                        r.body.total_bytes as i64,
                        r.body.digest,
                        r.body.truncated,
                        serde_json::to_string(&r.calls).unwrap_or_else(|_| "[]".into()),
                        r.at_ms,
                        r.body.redacted,
                        r.reader
                    ],
    )?;
    Ok(())
}

fn claim(tx: &rusqlite::Connection, c: &EffectClaim) -> rusqlite::Result<Claim> {
    let inserted = exec(
        tx,
        "INSERT INTO effects (effect_id, tool_id, call_id, run_id, node_id, attempt, keying, state, at_ms, instance, reader)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'claimed', ?8, ?9, ?10)
         ON CONFLICT (effect_id) DO NOTHING",
        params![c.effect_id, c.tool_id, c.call_id, c.run.run_id, c.run.node_id, c.run.attempt, c.keying, c.at_ms, c.instance, c.reader],
    )?;
    if inserted == 1 {
        return Ok(Claim::Claimed);
    }
    // Take over a claim whose call never reached the agent: not confirmed released, and its
    // process is gone (or its lease ran out). Compare-and-set on the row.
    let taken = exec(
        tx,
        "UPDATE effects SET call_id = ?2, run_id = ?3, node_id = ?4, attempt = ?5, at_ms = ?6, instance = ?7, reader = ?9
         WHERE effect_id = ?1 AND released = 0 AND state = 'claimed' AND (instance != ?7 OR at_ms < ?8)",
        params![c.effect_id, c.call_id, c.run.run_id, c.run.node_id, c.run.attempt, c.at_ms, c.instance, c.at_ms - CLAIM_LEASE_MS, c.reader],
    )?;
    if taken == 1 {
        return Ok(Claim::Claimed);
    }
    let (call_id, run_id, reader): (String, Option<String>, Option<String>) = tx.query_row(
        "SELECT call_id, run_id, reader FROM effects WHERE effect_id = ?1",
        params![c.effect_id],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    // The effect is the tenant's (one charge per business key whoever asks), but what it
    // returned is only for whoever may read it: the same principal in the same run. Anyone
    // else learns only that it is done (and a row from before v5, with no reader, is no
    // one's to read).
    if reader.as_deref() != Some(c.reader.as_str()) || run_id != c.run.run_id {
        return Ok(Claim::Foreign);
    }
    // The result recorded for the claiming call, in the claiming call's own scope.
    let scope = run_id.map_or_else(|| "chat".to_owned(), |r| format!("run:{r}"));
    let result: Option<Vec<u8>> = tx
        .query_row(
            "SELECT content FROM tool_results WHERE scope = ?1 AND tool_call_id = ?2 AND truncated = 0 ORDER BY id LIMIT 1",
            params![scope, call_id],
            |r| r.get(0),
        )
        .ok();
    Ok(Claim::Existing {
        call_id,
        result: result.map(|b| String::from_utf8_lossy(&b).into_owned()),
    })
}

/// Inserts `e` in `event_rows`, numbered after every event of its scope (folded ones too);
/// a chat scope is noted in `scopes`.
fn insert_event(
    tx: &rusqlite::Connection,
    e: &EventRecord,
    scopes: &mut scopes::EventScopes,
) -> rusqlite::Result<()> {
    let scope = match &e.run.run_id {
        Some(run) => format!("run:{run}"),
        None => format!("request:{}", e.request_id),
    };
    // A chat turn's scope may hold events folded into its round's row (schema step 16): the
    // next sequence follows those too.
    let folded_in = e.run.run_id.is_none().then_some(e.request_id.as_str());
    let next: i64 = tx
        .prepare_cached(
            "SELECT max(coalesce((SELECT max(sequence) FROM event_rows WHERE scope = ?1), -1),
                        coalesce((SELECT max(coalesce(e.value ->> 'sequence', e.value ->> 0))
                                    FROM rounds r, json_each(r.events) e
                                   WHERE r.request_id = ?2), -1)) + 1",
        )?
        .query_row(params![scope, folded_in], |r| r.get(0))?;
    exec(
        tx,
        "INSERT INTO event_rows (scope, run_id, node_id, request_id, sequence, type, payload, at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        params![
            scope,
            e.run.run_id,
            e.run.node_id,
            e.request_id,
            next,
            e.kind,
            e.payload,
            e.at_ms
        ],
    )?;
    if e.run.run_id.is_none() {
        scopes.note(&e.request_id);
    }
    Ok(())
}

/// Whether the chat round `r` holds event `e` in its own row (`rounds.events`, schema step
/// 16): an event of the same chat turn's request, committed with the round.
fn folds(r: &RoundRecord, e: &EventRecord) -> bool {
    r.run.run_id.is_none() && e.run.run_id.is_none() && e.request_id == r.request_id
}

/// A chat round's call as `rounds.calls` holds it from schema step 19: an array of the
/// `tool_calls` view's columns in this order (step 16 wrote an object with these names as
/// keys; the views read both, [`call_field`]). Absent values are `null`.
type FoldedCall<'a> = (
    u32,
    u32,
    &'a str,
    &'a str,
    &'a str,
    &'a str,
    &'a str,
    Option<&'a str>,
    &'a str,
    Option<&'a str>,
    u64,
    u8,
    Option<&'a str>,
    Option<&'a str>,
);

/// The fields of a folded call, in the order of [`FoldedCall`]'s array (its position is the
/// discriminant); [`CallField::name`] is the key each had in step 16's object form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CallField {
    Choice,
    Ordinal,
    CallId,
    Name,
    Outcome,
    Stage,
    Reason,
    ArgsHash,
    ToolId,
    LogicalInvocationId,
    NodeOrdinal,
    Enforced,
    Rules,
    RedactedArgs,
}

impl CallField {
    /// Every field, in array order.
    pub(super) const ALL: [CallField; 14] = [
        CallField::Choice,
        CallField::Ordinal,
        CallField::CallId,
        CallField::Name,
        CallField::Outcome,
        CallField::Stage,
        CallField::Reason,
        CallField::ArgsHash,
        CallField::ToolId,
        CallField::LogicalInvocationId,
        CallField::NodeOrdinal,
        CallField::Enforced,
        CallField::Rules,
        CallField::RedactedArgs,
    ];

    /// The field's key in step 16's object form (the `tool_calls` view's column).
    pub(super) fn name(self) -> &'static str {
        match self {
            CallField::Choice => "choice",
            CallField::Ordinal => "ordinal",
            CallField::CallId => "call_id",
            CallField::Name => "name",
            CallField::Outcome => "outcome",
            CallField::Stage => "stage",
            CallField::Reason => "reason",
            CallField::ArgsHash => "args_hash",
            CallField::ToolId => "tool_id",
            CallField::LogicalInvocationId => "logical_invocation_id",
            CallField::NodeOrdinal => "node_ordinal",
            CallField::Enforced => "enforced",
            CallField::Rules => "rules",
            CallField::RedactedArgs => "redacted_args",
        }
    }
}

/// SQL reading `field` of a folded call `json` (an expression of a `rounds.calls` element),
/// in either form: the object of schema step 16 or the array of step 19.
pub(super) fn call_field(json: &str, field: CallField) -> String {
    format!(
        "coalesce({json} ->> '{}', {json} ->> {})",
        field.name(),
        field as usize
    )
}

fn folded_call(c: &CallRecord) -> FoldedCall<'_> {
    (
        c.choice,
        c.ordinal,
        &c.call_id,
        &c.name,
        c.outcome,
        c.stage,
        c.reason,
        c.args_hash.as_deref(),
        &c.tool_id,
        c.logical_invocation_id.as_deref(),
        c.node_ordinal,
        u8::from(c.enforced),
        c.rules.as_deref(),
        c.redacted_args.as_deref(),
    )
}

/// A chat round's event as `rounds.events` holds it (the `events` view's columns; the
/// payload as its JSON text, byte for byte).
#[derive(serde::Serialize)]
#[serde(untagged)]
enum FoldedEvent<'a> {
    /// Any event, whole: `{sequence, type, at_ms, payload}`.
    Whole {
        sequence: i64,
        #[serde(rename = "type")]
        kind: &'a str,
        at_ms: i64,
        payload: &'a str,
    },
    /// An `agent.tool-called` whose payload is [`called_pieces`] of the round's call at
    /// `call` (its position in `rounds.calls`): `[sequence, at_ms, call]`, the payload rebuilt
    /// by the `events` view with [`called_payload_sql`] (schema step 18).
    Called(i64, i64, usize),
}

/// `agent.tool-called`'s payload as the `events` view rebuilds it from `c`, a folded call of
/// `rounds.calls` as JSON (schema step 18; either form, [`call_field`]): the text
/// [`called_pieces`] make for the same fields.
pub(super) fn called_payload_sql() -> String {
    format!(
        "json_object('agentId', 'agent', 'toolName', {}, 'callId', {}, 'principal', 'agent', \
         'transport', 'native', 'argsHash', {})",
        call_field("c", CallField::Name),
        call_field("c", CallField::CallId),
        call_field("c", CallField::ArgsHash)
    )
}

/// [`called_pieces`] joined: the payload text itself.
#[cfg(test)]
fn called_payload(c: &CallRecord) -> Option<String> {
    called_pieces(c).map(|pieces| pieces.concat())
}

/// The `agent.tool-called` payload of call `c` released by the agent itself (`principal`
/// and `agentId` both [`crate::clock::AGENT_ID`], `transport` native), as serde_json writes
/// [`crate::proxy`]'s `ToolCalled` and SQLite's `json_object` writes [`called_payload_sql`],
/// in pieces (fixed text around the call's name, id and `argsHash`) — `None` unless the call
/// has an `argsHash` and its id, name and hash are printable ASCII without `"` or `\`: every
/// JSON writer writes such a string as it is, so the text does not hang on how this SQLite
/// build escapes anything (a call with other characters keeps its event whole).
fn called_pieces(c: &CallRecord) -> Option<[&str; 7]> {
    fn plain(s: &str) -> bool {
        s.bytes()
            .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
    }
    let hash = c.args_hash.as_deref()?;
    let plain_fields =
        crate::clock::AGENT_ID == "agent" && plain(&c.name) && plain(&c.call_id) && plain(hash);
    plain_fields.then_some([
        "{\"agentId\":\"agent\",\"toolName\":\"",
        c.name.as_str(),
        "\",\"callId\":\"",
        c.call_id.as_str(),
        "\",\"principal\":\"agent\",\"transport\":\"native\",\"argsHash\":\"",
        hash,
        "\"}",
    ])
}

/// Whether `payload` is [`called_pieces`] of `c`, compared piece by piece (nothing built).
fn is_called_payload(payload: &str, c: &CallRecord) -> bool {
    let Some(pieces) = called_pieces(c) else {
        return false;
    };
    let mut rest = payload;
    for piece in pieces {
        match rest.strip_prefix(piece) {
            Some(after) => rest = after,
            None => return false,
        }
    }
    rest.is_empty()
}

/// `rounds.calls` and `rounds.events` of a chat round `r` (`None` for a run's round, and for
/// an empty list): its calls, and those of `events` it [`folds`], numbered after any event
/// its request's scope already holds (a tool result's `agent.tool-returned`, recorded before
/// upstream; read from `event_rows` only when `scopes` says there may be one).
fn folded_columns(
    tx: &rusqlite::Connection,
    r: &RoundRecord,
    events: &[EventRecord],
    scopes: &scopes::EventScopes,
) -> rusqlite::Result<(Option<String>, Option<String>)> {
    if r.run.run_id.is_some() {
        return Ok((None, None));
    }
    let calls = if r.calls.is_empty() {
        None
    } else {
        Some(folded_text(
            &r.calls.iter().map(folded_call).collect::<Vec<_>>(),
        )?)
    };
    let mine: Vec<&EventRecord> = events.iter().filter(|e| folds(r, e)).collect();
    let events = if mine.is_empty() {
        None
    } else {
        let first: i64 = if scopes.may_hold(&r.request_id, r.arrived) {
            tx.prepare_cached(
                "SELECT coalesce(max(sequence), -1) + 1 FROM event_rows WHERE scope = ?1",
            )?
            .query_row(params![format!("request:{}", r.request_id)], |row| {
                row.get(0)
            })?
        } else {
            0
        };
        // An event whose payload is a call's [`called_pieces`] is folded as that call's
        // (schema step 18). The request path makes one `agent.tool-called` per call, in the
        // calls' order, so the n-th such event is compared with the n-th call only: one
        // comparison an event, however many calls a model answers with. An event that is not
        // its call's text (another principal, characters a JSON writer could escape, an
        // order this does not know) is kept whole, which reads back the same.
        let mut called = 0;
        let list: Vec<FoldedEvent> = mine
            .iter()
            .zip(first..)
            .map(|(e, sequence)| {
                let call = (e.kind == "agent.tool-called")
                    .then(|| {
                        called += 1;
                        let i = called - 1;
                        r.calls
                            .get(i)
                            .is_some_and(|c| is_called_payload(&e.payload, c))
                            .then_some(i)
                    })
                    .flatten();
                match call {
                    Some(call) => FoldedEvent::Called(sequence, e.at_ms, call),
                    None => FoldedEvent::Whole {
                        sequence,
                        kind: e.kind,
                        at_ms: e.at_ms,
                        payload: &e.payload,
                    },
                }
            })
            .collect();
        Some(folded_text(&list)?)
    };
    Ok((calls, events))
}

/// JSON text of a folded list (strings and integers only; an error is SQLite's to report).
fn folded_text<T: serde::Serialize>(list: &[T]) -> rusqlite::Result<String> {
    serde_json::to_string(list).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))
}

/// The provider-stored response a round produced (`responses`, `response_items`): what a
/// later request's `previous_response_id` chain is read from.
fn insert_response_link(
    tx: &rusqlite::Connection,
    r: &RoundRecord,
    link: &ResponseLink,
) -> rusqlite::Result<()> {
    exec(
        tx,
        "INSERT INTO responses (response_id, request_id, previous_response_id, run_id,
            node_id, attempt, api, status, provider_executed, provider_items, content_trust,
            next_round_index, calls_so_far, at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)
         ON CONFLICT (response_id) DO NOTHING",
        params![
            link.response_id,
            r.request_id,
            link.previous_response_id,
            r.run.run_id,
            r.run.node_id,
            r.run.attempt,
            r.api,
            link.status,
            !link.provider_items.is_empty(),
            link.provider_items.join(","),
            link.content_trust,
            link.next_round_index,
            link.calls_so_far
                .as_ref()
                .map(|c| crate::strict_json::to_text(&serde_json::Value::from(c.clone()))),
            r.at_ms,
        ],
    )?;
    for item in &link.items {
        exec(
            tx,
            "INSERT INTO response_items (item_id, response_id, item_type, provider_executed)
             VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (item_id) DO NOTHING",
            params![
                item.id,
                link.response_id,
                item.item_type,
                item.provider_executed
            ],
        )?;
    }
    Ok(())
}

/// The `rounds` insert ([`insert_round`]).
const INSERT_ROUND: &str = "INSERT INTO rounds (request_id, at_ms, api, model, stream, run_id,
        node_id, attempt, round_index, request_digest, completion, finish_reason, upstream_status,
        latency_ms, state, error, response, response_bytes, response_digest, response_truncated,
        channel, channel_result, content_trust, client_request_id, response_redacted, calls, events)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27)
     ON CONFLICT (request_id) DO NOTHING";

/// Inserts round `r` (and its stored response's records); `true` when it is a chat round
/// whose row now holds its calls and the `events` it [`folds`] (schema step 16), `false` when
/// those events are still to be written as rows: a run's round, or a round already recorded
/// (the first record stands).
///
/// `statement` is the batch's prepared [`INSERT_ROUND`]: taken from the connection's cache by
/// the batch's first round and held until the batch ends (up to [`MAX_BATCH`] rounds), since
/// each lookup in rusqlite's statement cache hashes the ~700-byte text, and putting it back
/// hashes it again.
fn insert_round<'c>(
    tx: &'c rusqlite::Connection,
    statement: &mut Option<rusqlite::CachedStatement<'c>>,
    r: &RoundRecord,
    events: &[EventRecord],
    releases: &mut released::ChatReleases,
    scopes: &scopes::EventScopes,
) -> rusqlite::Result<bool> {
    let (calls, folded_events) = folded_columns(tx, r, events, scopes)?;
    let statement = match statement {
        Some(prepared) => prepared,
        None => statement.insert(tx.prepare_cached(INSERT_ROUND)?),
    };
    let inserted = statement.execute(params![
        r.request_id,
        r.at_ms,
        r.api,
        r.model,
        r.stream,
        r.run.run_id,
        r.run.node_id,
        r.run.attempt,
        r.round_index,
        r.request_digest,
        r.completion,
        r.finish_reason,
        r.upstream_status,
        r.latency_ms as i64,
        r.state,
        r.error,
        r.response.bytes,
        r.response.total_bytes as i64,
        r.response.digest,
        r.response.truncated,
        r.channel,
        r.channel_result,
        r.content_trust,
        r.client_request_id,
        r.response.redacted,
        calls,
        folded_events,
    ])? == 1;
    let chat = r.run.run_id.is_none();
    if inserted && chat {
        // What a later tool result's duration is taken from.
        let released = r.calls.iter().filter(|c| c.outcome == "executed");
        releases.remember(
            tx.last_insert_rowid(),
            &r.request_id,
            released.map(|c| c.call_id.as_str()),
        );
    }
    if let Some(link) = &r.response_link {
        insert_response_link(tx, r, link)?;
    }
    if chat {
        return Ok(inserted);
    }
    for c in &r.calls {
        exec(
            tx,
            "INSERT INTO tool_call_rows (request_id, choice, ordinal, call_id, name, outcome, stage,
                reason, args_hash, tool_id, enforced, rules, redacted_args, logical_invocation_id,
                node_ordinal)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)
             ON CONFLICT (request_id, choice, ordinal) DO NOTHING",
            params![
                r.request_id,
                c.choice,
                c.ordinal,
                c.call_id,
                c.name,
                c.outcome,
                c.stage,
                c.reason,
                c.args_hash,
                c.tool_id,
                c.enforced,
                c.rules,
                c.redacted_args,
                c.logical_invocation_id,
                c.node_ordinal as i64
            ],
        )?;
    }
    Ok(false)
}

/// When the call a tool result answers was released, in a run: `rounds.at_ms` of the newest
/// round of run `?2` that released `call_id` (`?1`), found from the call (schema step 11's
/// index), never from `rounds_run`.
pub(super) const RELEASED_AT_RUN_SQL: &str =
    "SELECT r.at_ms FROM tool_call_rows c INDEXED BY tool_calls_executed_call
     CROSS JOIN rounds r ON r.request_id = c.request_id
     WHERE c.call_id = ?1 AND c.outcome = 'executed' AND r.run_id = ?2
     ORDER BY c.id DESC LIMIT 1";

fn insert_tool_result(
    tx: &rusqlite::Connection,
    t: &ToolResultRecord,
    releases: &released::ChatReleases,
    scopes: &mut scopes::EventScopes,
) -> rusqlite::Result<()> {
    let scope = match &t.run.run_id {
        Some(run) => format!("run:{run}"),
        None => "chat".to_owned(),
    };
    let inserted = exec(
        tx,
        "INSERT INTO tool_results (scope, run_id, node_id, attempt, tool_call_id, tool_name,
            is_error, content, content_bytes, content_digest, truncated, first_request_id, at_ms, reader)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)
         ON CONFLICT (scope, tool_call_id, content_digest) DO NOTHING",
        params![
            scope,
            t.run.run_id,
            t.run.node_id,
            t.run.attempt,
            t.tool_call_id,
            t.tool_name,
            t.is_error,
            t.content.bytes,
            t.content.total_bytes as i64,
            t.content.digest,
            t.content.truncated,
            t.request_id,
            t.at_ms,
            t.reader,
        ],
    )?;
    if inserted == 1 {
        // The effect this call claimed (if any) is now completed.
        exec(
        tx,
            "UPDATE effects SET state = 'completed' WHERE call_id = ?1 AND run_id IS ?2 AND state = 'claimed'",
            params![t.tool_call_id, t.run.run_id],
        )?;
        // The first time a result is seen, the call it answers returns (OpenWOP
        // `agent.tool-returned`), with its duration from the round that released the call:
        // a run's from the call (schema step 11's index), never from `rounds_run`; a chat
        // turn's from the writer's recent releases ([`released`]).
        let released_at: Option<i64> = match &t.run.run_id {
            Some(run) => tx
                .prepare_cached(RELEASED_AT_RUN_SQL)?
                .query_row(params![t.tool_call_id, run], |r| r.get(0))
                .optional()?,
            None => releases.released_at(tx, &t.tool_call_id)?,
        };
        insert_event(tx, &t.returned_event(released_at), scopes)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prune may delete the rows of results the request path remembers as recorded: it
    /// forgets them all, so a result that comes again is written again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_prune_forgets_the_results_remembered_as_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.db");
        let (journal, writer) = Journal::open_sqlite(&path, Arc::new(Metrics::new())).unwrap();
        let seen = journal.seen_results();
        let key = seen.key(None, "agent", "call_1", &serde_json::json!("ok"));
        seen.remember([key]);
        assert!(seen.recorded(key));
        journal.prune(0).await.unwrap();
        assert!(!journal.seen_results().recorded(key));
        drop(journal);
        writer.join();
    }

    fn job(waited_for: bool) -> Job {
        Job {
            op: Op::Probe,
            ack: waited_for.then(|| oneshot::channel().0),
            durable: false,
            queued: None,
        }
    }

    /// Runs `next_batch` on its own thread (the writer's), returning the batch's size and
    /// how long the call took.
    fn batch_on_thread(
        mut rx: mpsc::Receiver<Job>,
        linger: Duration,
    ) -> (std::sync::mpsc::Receiver<(usize, Duration)>, WriterWake) {
        let (done, seen) = std::sync::mpsc::channel();
        let wake = WriterWake::default();
        let writer_wake = wake.clone();
        std::thread::spawn(move || {
            writer_wake.register();
            let start = Instant::now();
            let batch = next_batch(&mut rx, linger).map_or(0, |b| b.len());
            let _ = done.send((batch, start.elapsed()));
        });
        (seen, wake)
    }

    fn round(request: &str, run: Option<&str>, calls: &[(&str, &'static str)]) -> RoundRecord {
        RoundRecord {
            request_id: request.to_owned(),
            arrived: Instant::now(),
            client_request_id: Some(format!("client-{request}")),
            at_ms: 100,
            api: "openai_chat",
            model: Some("gpt-4o".to_owned()),
            stream: false,
            run: RunKey {
                run_id: run.map(str::to_owned),
                node_id: run.map(|_| "node".to_owned()),
                attempt: run.map(|_| 1),
            },
            round_index: 0,
            request_digest: "d".repeat(64),
            completion: Some("clean".to_owned()),
            finish_reason: Some("tool_calls".to_owned()),
            upstream_status: Some(200),
            latency_ms: 3,
            state: RoundState::Ok,
            error: None,
            response: Recorded::digest_of(b"{}"),
            calls: calls
                .iter()
                .enumerate()
                .map(|(i, (id, outcome))| CallRecord {
                    choice: 0,
                    ordinal: i as u32,
                    call_id: (*id).to_owned(),
                    name: "send_email".to_owned(),
                    outcome,
                    stage: "dispatch",
                    reason: "released",
                    args_hash: Some("a".repeat(64)),
                    tool_id: "acme:send_email".to_owned(),
                    enforced: true,
                    rules: None,
                    redacted_args: Some(
                        r#"{"to":"[REDACTED:email]","body":"hi \"there\""}"#.to_owned(),
                    ),
                    logical_invocation_id: None,
                    node_ordinal: i as u64,
                })
                .collect(),
            response_link: None,
            channel: None,
            channel_result: None,
            content_trust: None,
        }
    }

    fn event(request: &str, run: Option<&str>, kind: &'static str, at_ms: i64) -> EventRecord {
        EventRecord {
            request_id: request.to_owned(),
            run: RunKey {
                run_id: run.map(str::to_owned),
                node_id: run.map(|_| "node".to_owned()),
                attempt: run.map(|_| 1),
            },
            at_ms,
            kind,
            payload: format!(r#"{{"k":"{kind}","s":"a \"quoted\" é"}}"#),
        }
    }

    /// A round's commit with `events`, no served record and no claims.
    fn round_commit(round: RoundRecord, events: Vec<EventRecord>) -> Op {
        Op::RoundCommit(Box::new(RoundCommit {
            round: Some(round),
            events,
            served: None,
            claims: Vec::new(),
        }))
    }

    fn apply(conn: &mut Connection, op: Op) {
        apply_with(conn, op, &mut WriterMemory::default());
    }

    /// [`apply`] with the writer's memory of earlier batches.
    fn apply_with(conn: &mut Connection, op: Op, memory: &mut WriterMemory) {
        let tx = conn.transaction().unwrap();
        let mut batch = [Job {
            op,
            ack: None,
            durable: false,
            queued: None,
        }];
        apply_batch(&tx, &mut batch, memory).unwrap();
        tx.commit().unwrap();
        memory.releases.settle(true);
    }

    fn rows<T: rusqlite::types::FromSql>(conn: &Connection, sql: &str) -> Vec<Vec<T>> {
        let mut st = conn.prepare(sql).unwrap();
        let n = st.column_count();
        st.query_map([], |r| (0..n).map(|i| r.get(i)).collect())
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// Schema step 19: a chat round's calls folded as arrays read back through the views, and
    /// load into the writer's memory of releases, exactly as the same calls folded as step
    /// 16's objects (a round recorded before the step): the round is written, read, rewritten
    /// in the object form, and read again.
    #[test]
    fn a_call_folded_as_an_array_reads_back_as_its_object_form_did() {
        let mut conn = Connection::open_in_memory().unwrap();
        schema::migrate(&conn).unwrap();
        let mut r = round(
            "r19",
            None,
            &[
                ("call_a", "executed"),
                ("call_\"b\"", "refused"),
                ("call_c", "executed"),
            ],
        );
        r.calls[1].args_hash = None;
        r.calls[1].rules = Some("forbid-1,forbid-2".to_owned());
        r.calls[2].logical_invocation_id = Some("lii-1".to_owned());
        r.calls[2].redacted_args = None;
        let events: Vec<EventRecord> = r
            .calls
            .iter()
            .map(|c| EventRecord {
                payload: called_payload(c).unwrap_or_else(|| "{}".to_owned()),
                ..event("r19", None, "agent.tool-called", 150)
            })
            .collect();
        apply(
            &mut conn,
            Op::RoundCommit(Box::new(RoundCommit {
                round: Some(r.clone()),
                events,
                served: None,
                claims: Vec::new(),
            })),
        );
        let read = |conn: &Connection| {
            let calls: Vec<Vec<Option<String>>> = rows(
                conn,
                "SELECT id, request_id, choice, ordinal, call_id, name, outcome, stage, reason,
                        args_hash, tool_id, logical_invocation_id, node_ordinal, enforced, rules,
                        redacted_args
                   FROM (SELECT CAST(id AS TEXT) AS id, request_id, CAST(choice AS TEXT) AS choice,
                                CAST(ordinal AS TEXT) AS ordinal, call_id, name, outcome, stage,
                                reason, args_hash, tool_id, logical_invocation_id,
                                CAST(node_ordinal AS TEXT) AS node_ordinal,
                                CAST(enforced AS TEXT) AS enforced, rules, redacted_args
                           FROM tool_calls) ORDER BY id",
            );
            let events: Vec<Vec<String>> = rows(
                conn,
                "SELECT CAST(id AS TEXT), CAST(sequence AS TEXT), type, payload FROM events ORDER BY id",
            );
            let released: Vec<Option<i64>> = {
                let memory = released::ChatReleases::load(conn).unwrap();
                ["call_a", "call_\"b\"", "call_c"]
                    .iter()
                    .map(|id| memory.released_at(conn, id).unwrap())
                    .collect()
            };
            (calls, events, released)
        };
        let as_arrays = read(&conn);
        let folded: String = conn
            .query_row(
                "SELECT calls FROM rounds WHERE request_id = 'r19'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(
            folded.starts_with("[[0,0,\"call_a\",\"send_email\","),
            "{folded}"
        );
        // Step 16's form of the same calls: objects, an absent value left out.
        let objects: Vec<serde_json::Value> = r
            .calls
            .iter()
            .map(|c| {
                let mut o = serde_json::Map::new();
                let array = serde_json::to_value(folded_call(c)).unwrap();
                for (field, value) in CallField::ALL.iter().zip(array.as_array().unwrap()) {
                    if !value.is_null() {
                        o.insert(field.name().to_owned(), value.clone());
                    }
                }
                serde_json::Value::Object(o)
            })
            .collect();
        conn.execute(
            "UPDATE rounds SET calls = ?1 WHERE request_id = 'r19'",
            [serde_json::to_string(&objects).unwrap()],
        )
        .unwrap();
        let as_objects = read(&conn);
        assert_eq!(as_arrays, as_objects);
        assert_eq!(as_arrays.0.len(), 3, "{:?}", as_arrays.0);
        assert_eq!(as_arrays.1.len(), 3, "{:?}", as_arrays.1);
        assert_eq!(as_arrays.2, vec![Some(100), None, Some(100)]);
        assert_eq!(
            as_arrays.0[2][11].as_deref(),
            Some("lii-1"),
            "{:?}",
            as_arrays.0[2]
        );
    }

    /// Schema step 18: a chat round's `agent.tool-called` events read back through the
    /// `events` view as the payload text turnguard built, byte for byte, whether the writer
    /// folded one as its call's position (plain ids and names) or whole (a principal other
    /// than the agent, an id or name serde_json and SQLite could escape differently, no
    /// `argsHash`); and the folded column keeps only the position of the plain ones. The
    /// sequence of a later event in the scope follows both forms.
    #[test]
    fn a_tool_called_event_folded_as_its_call_reads_back_byte_for_byte() {
        let mut conn = Connection::open_in_memory().unwrap();
        schema::migrate(&conn).unwrap();
        let ids_names: [(&str, &str); 12] = [
            ("call_1", "get_weather"),
            ("call 2 ~/!#$%&'()*+,-.:;<=>?@[]^_`{|}", "tool ~ /x"),
            ("call_\"q\"", "quoted"),
            ("call_back\\slash", "back"),
            ("call_del\u{7f}", "del"),
            ("call_é", "outil_é"),
            ("call_nl\n", "nl"),
            ("call_nul\u{0}", "nul"),
            ("call_ls\u{2028}", "ls"),
            ("call_😀", "astral"),
            ("call_by_person", "person"),
            ("call_no_hash", "no_hash"),
        ];
        let mut r = round("r18", None, &[]);
        let mut events = Vec::new();
        for (i, (id, name)) in ids_names.iter().enumerate() {
            let hash = (*id != "call_no_hash").then(|| format!("{i:064x}"));
            r.calls.push(CallRecord {
                choice: 0,
                ordinal: i as u32,
                call_id: (*id).to_owned(),
                name: (*name).to_owned(),
                outcome: "executed",
                stage: "dispatch",
                reason: "released",
                args_hash: hash.clone(),
                tool_id: format!("acme:{name}"),
                enforced: true,
                rules: None,
                redacted_args: None,
                logical_invocation_id: None,
                node_ordinal: i as u64,
            });
            // What `proxy::round` serializes (its `ToolCalled`, these keys in this order).
            let principal = if *id == "call_by_person" {
                "person:alice"
            } else {
                "agent"
            };
            let mut payload = serde_json::json!({"agentId": "agent", "toolName": name,
                "callId": id, "principal": principal, "transport": "native"});
            if let Some(h) = &hash {
                payload["argsHash"] = serde_json::json!(h);
            }
            events.push(EventRecord {
                payload: serde_json::to_string(&payload).unwrap(),
                ..event("r18", None, "agent.tool-called", 200 + i as i64)
            });
        }
        // A second call with the first one's id and name: its event is folded as its own
        // position (the payload rebuilt from either call is the same text).
        let mut twin = r.calls[0].clone();
        twin.ordinal = 12;
        r.calls.push(twin);
        events.push(EventRecord {
            at_ms: 212,
            ..events[0].clone()
        });
        events.push(event("r18", None, "agent.tool-returned", 213));
        apply(&mut conn, round_commit(r, events.clone()));
        apply(
            &mut conn,
            Op::Events(vec![event("r18", None, "interrupt", 300)]),
        );
        let got: Vec<(i64, String, String, i64)> = {
            let mut st = conn
                .prepare(
                    "SELECT sequence, type, payload, at_ms FROM events
                      WHERE scope = 'request:r18' ORDER BY sequence",
                )
                .unwrap();
            st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        };
        let mut want: Vec<(i64, String, String, i64)> = events
            .iter()
            .enumerate()
            .map(|(i, e)| (i as i64, e.kind.to_owned(), e.payload.clone(), e.at_ms))
            .collect();
        want.push((
            14,
            "interrupt".to_owned(),
            event("r18", None, "interrupt", 300).payload,
            300,
        ));
        assert_eq!(got, want);
        // Plain: calls 0 and 1 and the twin (12); every other one is kept whole.
        let folded: Vec<Vec<String>> = rows(
            &conn,
            "SELECT e.type, CAST(coalesce(e.value ->> 2, e.value ->> 'type') AS TEXT) FROM rounds r, json_each(r.events) e
              WHERE r.request_id = 'r18' ORDER BY e.key",
        );
        let kinds: Vec<(&str, &str)> = folded
            .iter()
            .map(|f| (f[0].as_str(), f[1].as_str()))
            .collect();
        let mut expected = vec![("array", "0"), ("array", "1")];
        expected.extend(std::iter::repeat_n(("object", "agent.tool-called"), 10));
        expected.extend([("array", "12"), ("object", "agent.tool-returned")]);
        assert_eq!(kinds, expected);
    }

    /// A chat round's `agent.tool-called` events are compared with the calls in order (the
    /// n-th event with the n-th call only): events that come in another order are kept whole
    /// and still read back byte for byte, with their sequences.
    #[test]
    fn tool_called_events_out_of_their_calls_order_are_kept_whole() {
        let mut conn = Connection::open_in_memory().unwrap();
        schema::migrate(&conn).unwrap();
        let r = round(
            "r20",
            None,
            &[("call_a", "executed"), ("call_b", "executed")],
        );
        let events: Vec<EventRecord> = [1, 0]
            .iter()
            .map(|&i| EventRecord {
                payload: called_payload(&r.calls[i]).unwrap(),
                ..event("r20", None, "agent.tool-called", 300 + i as i64)
            })
            .collect();
        apply(&mut conn, round_commit(r, events.clone()));
        let folded: Vec<Vec<String>> = rows(
            &conn,
            "SELECT e.type FROM rounds r, json_each(r.events) e
              WHERE r.request_id = 'r20' ORDER BY e.key",
        );
        assert_eq!(folded, [["object"], ["object"]]);
        let read: Vec<Vec<String>> = rows(
            &conn,
            "SELECT CAST(sequence AS TEXT), payload FROM events
              WHERE scope = 'request:r20' ORDER BY sequence",
        );
        let want: Vec<Vec<String>> = events
            .iter()
            .enumerate()
            .map(|(n, e)| vec![n.to_string(), e.payload.clone()])
            .collect();
        assert_eq!(read, want);
    }

    /// Schema step 16: a chat round is one `rounds` row holding its calls and its decision's
    /// events, and the writer remembers each call it released; the `tool_calls` and `events`
    /// views show them as the tables did. The events continue the sequence of the request's
    /// scope before and after (a row recorded before upstream, one recorded later). A run's
    /// round still writes rows.
    #[test]
    fn a_chat_round_is_one_row_that_the_views_show() {
        let mut conn = Connection::open_in_memory().unwrap();
        schema::migrate(&conn).unwrap();
        // One writer's memory throughout, as the writer thread keeps it.
        let mut memory = WriterMemory::default();
        apply_with(
            &mut conn,
            Op::Events(vec![event("r1", None, "agent.tool-returned", 90)]),
            &mut memory,
        );
        let events = vec![
            event("r1", None, "agent.tool-called", 101),
            event("r1", None, "agent.tool-called", 102),
            event("r1", Some("run-9"), "agent.tool-called", 103),
        ];
        apply_with(
            &mut conn,
            Op::RoundCommit(Box::new(RoundCommit {
                round: Some(round(
                    "r1",
                    None,
                    &[("call_a", "executed"), ("call_b", "refused")],
                )),
                events: events.clone(),
                served: None,
                claims: Vec::new(),
            })),
            &mut memory,
        );
        apply_with(
            &mut conn,
            Op::Events(vec![event("r1", None, "interrupt", 104)]),
            &mut memory,
        );
        apply_with(
            &mut conn,
            round_commit(
                round("q1", Some("run-1"), &[("call_c", "executed")]),
                vec![event("q1", Some("run-1"), "agent.tool-called", 105)],
            ),
            &mut memory,
        );
        let n = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).unwrap() };
        assert_eq!(
            n("SELECT count(*) FROM tool_call_rows WHERE request_id = 'r1'"),
            0
        );
        assert_eq!(
            n("SELECT count(*) FROM tool_call_rows WHERE request_id = 'q1'"),
            1
        );
        assert_eq!(n("SELECT count(*) FROM rounds WHERE calls IS NOT NULL"), 1);
        let calls: Vec<Vec<Option<String>>> = rows(
            &conn,
            "SELECT request_id, call_id, name, outcome, stage, reason, args_hash, tool_id,
                    CAST(enforced AS TEXT), CAST(choice AS TEXT) || '/' || CAST(ordinal AS TEXT),
                    rules, redacted_args
               FROM tool_calls ORDER BY request_id, choice, ordinal",
        );
        let hash = "a".repeat(64);
        let want = |req: &str, id: &str, outcome: &str, place: &str| -> Vec<Option<String>> {
            [
                Some(req),
                Some(id),
                Some("send_email"),
                Some(outcome),
                Some("dispatch"),
                Some("released"),
                Some(hash.as_str()),
                Some("acme:send_email"),
                Some("1"),
                Some(place),
                None,
                Some(r#"{"to":"[REDACTED:email]","body":"hi \"there\""}"#),
            ]
            .map(|v| v.map(str::to_owned))
            .to_vec()
        };
        assert_eq!(
            calls,
            [
                want("q1", "call_c", "executed", "0/0"),
                want("r1", "call_a", "executed", "0/0"),
                want("r1", "call_b", "refused", "0/1"),
            ]
        );
        let events_seen: Vec<Vec<Option<String>>> = rows(
            &conn,
            "SELECT scope, CAST(sequence AS TEXT), type, payload, CAST(at_ms AS TEXT), run_id
               FROM events ORDER BY scope, sequence",
        );
        let ev = |scope: &str, seq: &str, e: &EventRecord| -> Vec<Option<String>> {
            vec![
                Some(scope.to_owned()),
                Some(seq.to_owned()),
                Some(e.kind.to_owned()),
                Some(e.payload.clone()),
                Some(e.at_ms.to_string()),
                e.run.run_id.clone(),
            ]
        };
        assert_eq!(
            events_seen,
            [
                ev(
                    "request:r1",
                    "0",
                    &event("r1", None, "agent.tool-returned", 90)
                ),
                ev("request:r1", "1", &events[0]),
                ev("request:r1", "2", &events[1]),
                ev("request:r1", "3", &event("r1", None, "interrupt", 104)),
                ev(
                    "run:run-1",
                    "0",
                    &event("q1", Some("run-1"), "agent.tool-called", 105)
                ),
                ev("run:run-9", "0", &events[2]),
            ]
        );
        // Only the released chat call is remembered for a later result (from its round's
        // `at_ms`); a run's call is found by its row.
        let released_at = |call: &str| memory.releases.released_at(&conn, call).unwrap();
        assert_eq!(released_at("call_a"), Some(100));
        assert_eq!(released_at("call_b"), None);
        assert_eq!(released_at("call_c"), None);
    }

    /// A chat round recorded twice keeps its first record; the second commit's events are
    /// not lost (rows of the request's scope, numbered after the first's).
    #[test]
    fn a_chat_round_recorded_again_keeps_the_first_and_loses_no_event() {
        let mut conn = Connection::open_in_memory().unwrap();
        schema::migrate(&conn).unwrap();
        let mut memory = WriterMemory::default();
        for (calls, at) in [
            (&[("call_a", "executed")][..], 101),
            (&[("call_z", "executed")][..], 201),
        ] {
            apply_with(
                &mut conn,
                round_commit(
                    round("r1", None, calls),
                    vec![event("r1", None, "agent.tool-called", at)],
                ),
                &mut memory,
            );
        }
        let calls: Vec<Vec<String>> = rows(&conn, "SELECT call_id FROM tool_calls");
        assert_eq!(calls, [vec!["call_a".to_owned()]]);
        let seen: Vec<Vec<i64>> = rows(
            &conn,
            "SELECT sequence, at_ms FROM events ORDER BY sequence",
        );
        assert_eq!(seen, [vec![0, 101], vec![1, 201]]);
        // The second record's call was not recorded, nor remembered as released.
        let released_at = |call: &str| memory.releases.released_at(&conn, call).unwrap();
        assert_eq!(released_at("call_a"), Some(100));
        assert_eq!(released_at("call_z"), None);
    }

    #[test]
    fn event_sequences_count_up_per_scope_across_batches() {
        let mut conn = Connection::open_in_memory().unwrap();
        schema::migrate(&conn).unwrap();
        let event = |request: &str, run: Option<&str>, kind: &'static str| EventRecord {
            request_id: request.to_owned(),
            run: RunKey {
                run_id: run.map(str::to_owned),
                node_id: run.map(|_| "node".to_owned()),
                attempt: run.map(|_| 1),
            },
            at_ms: 1,
            kind,
            payload: serde_json::json!({"k": kind}).to_string(),
        };
        for batch in [
            vec![
                event("r1", None, "a"),
                event("r1", None, "b"),
                event("r2", Some("run-1"), "c"),
            ],
            vec![event("r1", None, "d"), event("r3", Some("run-1"), "e")],
        ] {
            let tx = conn.transaction().unwrap();
            for e in &batch {
                insert_event(&tx, e, &mut scopes::EventScopes::default()).unwrap();
            }
            tx.commit().unwrap();
        }
        let rows: Vec<(String, i64, String)> = conn
            .prepare("SELECT scope, sequence, type FROM events ORDER BY scope, sequence")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let want = [
            ("request:r1", 0, "a"),
            ("request:r1", 1, "b"),
            ("request:r1", 2, "d"),
            ("run:run-1", 0, "c"),
            ("run:run-1", 1, "e"),
        ];
        let got: Vec<(&str, i64, &str)> = rows
            .iter()
            .map(|(s, n, t)| (s.as_str(), *n, t.as_str()))
            .collect();
        assert_eq!(got, want);
    }

    /// A batch whose record fails is rolled back whole (its other records are not kept) and
    /// the connection commits the next batch: `commit_batch` begins and commits through cached
    /// statements, so a failure must end the transaction it began.
    #[test]
    fn a_failing_batch_leaves_nothing_and_the_next_commits() {
        let mut conn = Connection::open_in_memory().unwrap();
        schema::migrate(&conn).unwrap();
        conn.execute_batch(
            "CREATE TRIGGER boom BEFORE INSERT ON event_rows WHEN NEW.type = 'boom'
             BEGIN SELECT RAISE(ABORT, 'boom'); END;",
        )
        .unwrap();
        let job = |kind: &'static str| Job {
            op: Op::Events(vec![EventRecord {
                request_id: "r1".to_owned(),
                run: RunKey::default(),
                at_ms: 1,
                kind,
                payload: "{}".to_owned(),
            }]),
            ack: None,
            durable: false,
            queued: None,
        };
        let mut memory = WriterMemory::default();
        let failed = commit(&mut conn, &mut [job("a"), job("boom")], &mut memory);
        assert!(failed.is_err(), "the trigger fails the batch");
        assert!(
            conn.is_autocommit(),
            "the failed batch's transaction is over"
        );
        commit(&mut conn, &mut [job("b")], &mut memory).unwrap();
        let kinds: Vec<(String, i64)> = conn
            .prepare("SELECT type, sequence FROM events ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(kinds, [("b".to_owned(), 0)]);
    }

    #[test]
    fn relaxed_records_wait_out_the_linger_together() {
        let (tx, rx) = mpsc::channel(16);
        tx.try_send(job(false)).ok().unwrap();
        let (seen, wake) = batch_on_thread(rx, Duration::from_millis(300));
        std::thread::sleep(Duration::from_millis(50));
        tx.try_send(job(false)).ok().unwrap();
        // A relaxed record does not end the linger, nor does a wake that finds only relaxed
        // records (a spurious one, or one whose record was taken already).
        wake.wake();
        let (n, took) = seen.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(n, 2, "both relaxed records share the batch");
        assert!(
            took >= Duration::from_millis(280),
            "the batch closed early: {took:?}"
        );
    }

    #[test]
    fn a_record_someone_waits_for_ends_the_linger_at_once() {
        let (tx, rx) = mpsc::channel(16);
        tx.try_send(job(false)).ok().unwrap();
        let (seen, wake) = batch_on_thread(rx, Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(50));
        tx.try_send(job(true)).ok().unwrap();
        wake.wake();
        let (n, took) = seen.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(n, 2);
        assert!(
            took < Duration::from_secs(5),
            "the waited-for record waited out the linger"
        );
    }
}
