//! One data-plane request as the request path and the approval wait share it: who and what
//! it is ([`RequestCtx`], [`RunMode`]) and what it carries through its model rounds
//! ([`Session`]; its stages are `impl Session` blocks in [`crate::proxy`]). Below the request
//! path and `approvals`, above [`crate::state`] (issue 13 item 1: `approvals` reads a
//! session without importing `proxy`).

use std::sync::Arc;
use std::time::Instant;

use http::header::HeaderMap;

use crate::admission;
use crate::admission::channel::ChannelSpec;
use crate::clock::now_ms;
use crate::error::WireError;
use crate::journal::RunKey;
use crate::model::Turn;
use crate::policy::bundle::ContentTrust;
use crate::policy::CompiledPolicy;
use crate::state::AppState;

/// Who and what one data-plane request is: its ids and its run identity headers.
#[derive(Debug, Clone)]
pub struct RequestCtx {
    /// The agent's own sane `x-request-id`, for the journal's `client_request_id` column —
    /// never a journal key (a client may send one id twice); `None` when the agent sent none
    /// turnguard kept, and [`Self::request_id`] is the one turnguard made.
    pub client_request_id: Option<String>,
    /// turnguard's own id of this request (time-ordered, UUIDv7): the `x-request-id` turnguard
    /// made when the agent sent none (one id for the request, echoed, logged and journaled),
    /// else a fresh one. Every journal key the request writes (round ids, interrupt keys of
    /// chat turns, who used an approval) derives from it.
    pub journal_id: String,
    /// Run identity from `Turnguard-Run` / `-Node` / `-Attempt` (DESIGN.md §2).
    pub run: RunKey,
    /// When the request arrived.
    pub started: Instant,
    /// Wall-clock arrival, milliseconds since the Unix epoch.
    pub at_ms: i64,
}

/// What a run header given more than once reads as: a value no run id matches
/// (`proxy::check_run_ids` refuses it).
const SEVERAL_VALUES: &str = "(several values)";

impl RequestCtx {
    /// The request's `x-request-id`, as echoed and logged: the agent's when it sent a sane
    /// one, else the id turnguard made (then also the journal id).
    pub fn request_id(&self) -> &str {
        self.client_request_id
            .as_deref()
            .unwrap_or(&self.journal_id)
    }

    /// The request id and run identity of a request's headers. A request that passed the
    /// edge ([`crate::edge::layer`]) keeps the request id the edge already checked or made (it
    /// set the same in `x-request-id`), not checked a second time; any other request's
    /// `x-request-id` is kept when sane, else a fresh UUIDv7 is made.
    pub(crate) fn of(headers: &HeaderMap, extensions: &http::Extensions) -> Self {
        let header = |name: &http::HeaderName| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty() && v.len() <= 200)
                .map(str::to_owned)
        };
        // A run header is never dropped because turnguard cannot read it: it would run the
        // request as a chat turn, outside its run's sticky trust (§C) and durable records
        // (§D). A value that is not text, is longer than allowed or comes twice is kept as a
        // value `proxy::check_run_ids` refuses (400).
        let run_header = |name: &http::HeaderName| {
            let mut values = headers.get_all(name).iter();
            let first = values.next()?;
            if values.next().is_some() {
                return Some(SEVERAL_VALUES.to_owned());
            }
            let text = String::from_utf8_lossy(first.as_bytes());
            let text = text.trim();
            (!text.is_empty()).then(|| text.to_owned())
        };
        let id = match crate::edge::edge_request_id(extensions) {
            Some(id) => id.clone(),
            None => crate::edge::RequestId::of(headers),
        };
        let (client_request_id, journal_id) = match id {
            crate::edge::RequestId::Agent(agent) => (Some(agent), uuid::Uuid::now_v7().to_string()),
            crate::edge::RequestId::Made(made) => (None, made),
        };
        let run_id = run_header(&TURNGUARD_RUN);
        let run = RunKey {
            node_id: run_id
                .as_ref()
                .map(|_| run_header(&TURNGUARD_NODE).unwrap_or_else(|| "default".into())),
            attempt: run_id.as_ref().map(|_| {
                header(&TURNGUARD_ATTEMPT)
                    .and_then(|a| a.parse().ok())
                    .filter(|a| *a >= 1)
                    .unwrap_or(1)
            }),
            run_id,
        };
        Self {
            client_request_id,
            // Time-ordered (UUIDv7, RFC 9562): the journal's indexes keyed by it grow at
            // their right edge, so a commit touches a few pages, not one random page per
            // index per record (and the checkpoint copies as few).
            journal_id,
            run,
            started: Instant::now(),
            at_ms: now_ms(),
        }
    }
}

/// Everything one agent request carries through its model rounds (the first and any repair
/// rounds): the parsed turn, the policy snapshot, the request as sent upstream.
pub struct Session {
    pub state: Arc<AppState>,
    pub ctx: RequestCtx,
    pub turn: Turn,
    pub policy: Arc<CompiledPolicy>,
    pub trust: ContentTrust,
    /// Path and query sent upstream.
    pub path: String,
    /// The agent's request headers; each round sends them filtered
    /// ([`crate::proxy::upstream::request_headers`]: hop-by-hop fields, `host`,
    /// `content-length` and `turnguard-*` removed, `accept-encoding: identity`).
    pub headers: HeaderMap,
    /// The request body as sent upstream (the agent's, plus repair turns).
    pub body: crate::strict_json::RequestBody,
    /// The agent's request bytes, sent as they are by the next [`Session::send`] while
    /// `body` is exactly what they parse to (the first round, nothing added); `None` once
    /// the body is rewritten or sent. Parsed by [`crate::strict_json`], so they read one way.
    pub agent_bytes: Option<bytes::Bytes>,
    /// Repair rounds left.
    pub repairs_left: u32,
    /// Model rounds sent so far for this agent request.
    pub rounds: u32,
    /// The schema the text answer must meet (structured / prompted channel, §A).
    pub channel: Option<ChannelSpec>,
    /// Semantic request digest v2 of the agent's own request (the recovery key).
    pub agent_digest: String,
    /// The verified acting person (`sub`); `None`: the agent acts (tool-turn contract §C).
    pub person: Option<String>,
    /// The inputs that made the turn untrusted, named for the approval interrupt (empty for
    /// a trusted turn).
    pub untrusted_inputs: Vec<admission::trust::UntrustedInput>,
}

/// Who may read a recorded result again (a claimed effect's, a served round's, a tool
/// result's): `person:<sub>` of the verified acting `person`, or the agent's id when none
/// acts. A run id is a name the client picks, not a credential: recovery, replay and the MCP
/// front serve a record only to its reader.
pub fn reader_of(person: Option<&str>) -> String {
    person.map_or_else(
        || crate::clock::AGENT_ID.to_owned(),
        |p| format!("person:{p}"),
    )
}

impl Session {
    /// This request's reader ([`reader_of`]).
    pub fn reader(&self) -> String {
        reader_of(self.person.as_deref())
    }
}

/// `Turnguard-Mode` (DESIGN.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunMode {
    Live,
    Replay,
}

/// `Turnguard-Run`, `Turnguard-Node`, `Turnguard-Attempt` and `Turnguard-Mode`, made at
/// compile time ([`crate::edge::X_REQUEST_ID`] says why).
const TURNGUARD_RUN: http::HeaderName = http::HeaderName::from_static("turnguard-run");
const TURNGUARD_NODE: http::HeaderName = http::HeaderName::from_static("turnguard-node");
const TURNGUARD_ATTEMPT: http::HeaderName = http::HeaderName::from_static("turnguard-attempt");
const TURNGUARD_MODE: http::HeaderName = http::HeaderName::from_static("turnguard-mode");

pub(crate) fn run_mode(headers: &HeaderMap) -> Result<RunMode, WireError> {
    match headers
        .get(&TURNGUARD_MODE)
        .map(|v| v.to_str().map(str::trim))
    {
        None => Ok(RunMode::Live),
        Some(Ok("live")) => Ok(RunMode::Live),
        Some(Ok("replay")) => Ok(RunMode::Replay),
        Some(_) => Err(WireError::InvalidRequest {
            reason: "Turnguard-Mode must be `live` or `replay`".into(),
        }),
    }
}
