//! The request path, as a plain function per stage that reads like DESIGN.md §3:
//!
//! ```text
//! request ─▶ parse (capped) ─▶ adapter → Turn ─▶ trust of inputs ─▶ record tool results seen
//!   ─▶ forward upstream
//! response/stream ─▶ adapter → emissions ─▶ admission (§B), per call, in order
//!   ─▶ dispatch: effect claims ─▶ surface (release · end-turn · repair round · error)
//!   ─▶ record round + events ─▶ agent
//! ```
//!
//! This file is the path itself (`handle` → `turn` → `model_rounds`) and the request-side
//! checks; the stages live beside it: [`round`] (admission, the approval wait, dispatch:
//! effect claims, metrics and events), [`record`] (what the journal keeps of a round),
//! [`surface`] (a JSON answer surfaced), [`stream`] (an SSE answer relayed), [`recovery`]
//! (recorded rounds served again), [`trust`] (the response chain and the run's sticky bit),
//! [`upstream`] (the upstream leg). Everything provider-specific is behind
//! [`crate::provider`]. Each request takes one policy snapshot and uses it throughout.

pub mod engine;
pub mod pipeline;
pub mod record;
pub mod recovery;
pub mod round;
pub mod stream;
pub mod surface;
pub mod trust;
pub mod upstream;

pub use record::{
    call_records, claims_of, has_secrets, join, record_round, record_round_with, round_record,
    CallIds, RoundBase,
};
use record::{record_before_upstream, record_upstream_error};
pub use surface::surfaced_error;
use surface::{answer_json, JsonRound};

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request};
use serde_json::Value;

use crate::admission::channel::{Channel, ChannelSpec};
use crate::admission::{self};
use crate::body::{read_capped_within, BodyError};
use crate::error::{Surface, WireError};
use crate::journal::RunKey;
use crate::metrics::TrustLabels;
use crate::model::{Api, Turn};
use crate::policy::bundle::ContentTrust;
use crate::policy::CompiledPolicy;
use crate::provider;
use crate::state::AppState;

/// The agent identity in events and rules when no verified person acts.
pub use crate::clock::AGENT_ID;

/// Milliseconds since the Unix epoch.
pub use crate::clock::now_ms;

pub use crate::approvals::Approval;
pub(crate) use crate::request::run_mode;
pub use crate::request::{RequestCtx, RunMode, Session};

impl Session {
    /// Sends the current body upstream.
    pub async fn send(&mut self) -> Result<http::Response<hyper::body::Incoming>, WireError> {
        self.rounds += 1;
        let raw = match self.agent_bytes.take() {
            Some(raw) => raw,
            None => Bytes::from(self.body.to_text()),
        };
        upstream::send(
            &self.state,
            self.turn.api.upstream(),
            self.turn.api.into(),
            Method::POST,
            &self.path,
            upstream::request_headers(&self.headers, true),
            raw,
        )
        .await
    }
}

/// Serves one model request of `api` (`POST /v1/chat/completions`, `POST /v1/messages`,
/// `POST /v1/responses`).
pub async fn handle(state: Arc<AppState>, api: Api, req: Request<Body>) -> Response {
    let ctx = RequestCtx::of(req.headers(), req.extensions());
    // A guard, not inc/dec: a client that disconnects drops this future half-way.
    let inflight = crate::metrics::GaugeGuard::new(&state.metrics.inflight_requests);
    let (mut resp, stream) = match turn(&state, api, &ctx, req).await {
        Ok(ok) => ok,
        Err(e) => {
            let (_, code, reason) = e.parts();
            // The message may quote what the agent sent (a header value, a key, a tool
            // name): the agent gets it as it is, the log only redacted.
            let error = state.policy.snapshot().redactor.redact_text(&e.to_string());
            tracing::warn!(request_id = %ctx.request_id(), api = api.as_str(), code, reason, error = %error, "request refused");
            (e.response(Surface::of_api(api)), false)
        }
    };
    drop(inflight);
    state
        .metrics
        .request(api.into(), resp.status().as_u16(), stream);
    if let Ok(v) = HeaderValue::from_str(ctx.request_id()) {
        resp.headers_mut().insert(crate::edge::X_REQUEST_ID, v);
    }
    resp
}

/// Seeds a run's released-call counter from the journal when it is not in memory (first
/// turn after a start, or evicted from the LRU), so `tool_calls_per_run` survives both.
/// An unreadable journal fails the request (503): the budget cannot be known.
async fn seed_run_counter(state: &Arc<AppState>, ctx: &RequestCtx) -> Result<(), WireError> {
    let Some(run) = ctx.run.run_id.clone() else {
        return Ok(());
    };
    if !state.limits.needs_seed(&run) {
        return Ok(());
    }
    match state.reader.released_calls(&run).await {
        Ok(n) => {
            state.limits.seed(&run, n);
            Ok(())
        }
        Err(e) => Err(WireError::JournalUnavailable {
            reason: format!("the run's released calls could not be read ({e})"),
        }),
    }
}

/// The life of a turn. Returns the response and whether it is a stream.
async fn turn(
    state: &Arc<AppState>,
    api: Api,
    ctx: &RequestCtx,
    req: Request<Body>,
) -> Result<(Response, bool), WireError> {
    let (parts, body) = req.into_parts();
    let person = acting_person(state, &parts.headers).await?;
    let raw = read_request(state, &parts, body).await?;
    let json = parse_json(state, &raw)?;
    let mut turn = provider::adapter(api)
        .parse_request_with(&json, &*state.schemas)
        .map_err(|reason| WireError::InvalidRequest { reason })?;
    check_schema_sizes(state, &mut turn)?;
    refuse_provider_delegation(ctx, &turn)?;
    check_run_ids(&ctx.run)?;
    let policy = state.policy.snapshot();
    let (trust, untrusted_inputs) = trust_of(state, ctx, &mut turn, &policy).await;
    seed_run_counter(state, ctx).await?;
    state
        .metrics
        .turns
        .get_or_create(&TrustLabels { trust })
        .inc();
    if let Some(reason) = admission::clarification_unsupported(&turn, &policy) {
        return Err(WireError::CapabilityNotProvided { reason });
    }
    let channel = channel_of(&parts.headers, api, json.tree(), &turn, &policy)?;
    check_channel_schema_size(state, channel.as_ref())?;
    refuse_run_while_journal_fails(state, ctx)?;
    record_before_upstream(state, ctx, &turn, &policy, trust, person.as_deref()).await?;

    let agent_digest = crate::recipes::semantic_request_digest(api, &json);
    let mode = run_mode(&parts.headers)?;
    let mut json = json;
    // Unless turnguard added to it (a Chat stream's usage request), the first round sends
    // the agent's own bytes: no serialization, nothing the agent did not send.
    let changed = provider::adapter(api).prepare_upstream(&mut json, &mut turn);
    let agent_bytes = (!changed).then_some(raw);
    let session = Session {
        agent_bytes,
        agent_digest,
        channel,
        state: Arc::clone(state),
        ctx: ctx.clone(),
        repairs_left: policy.settings.limits.repair_rounds,
        policy,
        trust,
        path: parts
            .uri
            .path_and_query()
            .map_or(parts.uri.path(), |p| p.as_str())
            .to_owned(),
        headers: parts.headers,
        body: json,
        turn,
        rounds: 0,
        person,
        untrusted_inputs,
    };
    if let Some(answer) = crate::proxy::recovery::serve_recorded(&session, mode).await? {
        return Ok((answer, false));
    }
    model_rounds(session).await
}

/// The verified acting person (`sub`) of a data-plane request, if any (a bad token is 401).
/// The token the agent holds is journaled before anything else, so it never approves (503
/// when the journal cannot record it). Every data-plane route that reads a request calls this
/// first — the model APIs, the emission-free passthroughs ([`passthrough`]) and the MCP front
/// — so no token the agent presented anywhere resolves an interrupt.
pub(crate) async fn acting_person(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Option<String>, WireError> {
    let person = state
        .identity
        .person_of(headers)
        .map_err(|e| WireError::Unauthenticated {
            reason: e.to_string(),
        })?;
    if let Some(token) = person.as_ref().and_then(|p| p.token.as_ref()) {
        state
            .identity
            .remember(&state.journal, token)
            .await
            .map_err(|e| WireError::JournalUnavailable {
                reason: e.to_string(),
            })?;
    }
    Ok(person.map(|p| p.sub))
}

/// The turn's `contentTrust` and the inputs that made it untrusted: its own inputs, the
/// Responses chain it continues (read from the journal; the turn is placed after it), and the
/// run's sticky bit (an untrusted earlier turn of the run is named as such).
async fn trust_of(
    state: &Arc<AppState>,
    ctx: &RequestCtx,
    turn: &mut Turn,
    policy: &CompiledPolicy,
) -> (ContentTrust, Vec<admission::trust::UntrustedInput>) {
    let history = trust::response_chain(state, ctx, turn).await;
    trust::item_references(state, ctx, turn).await;
    if let Some(previous) = history.first() {
        turn.continue_chain(previous);
    }
    let trust = admission::trust::of_turn(turn, policy, &history);
    let mut untrusted_inputs = admission::trust::untrusted_inputs(turn, policy, &history);
    let trust = trust::sticky(state, ctx, trust).await;
    if trust == ContentTrust::Untrusted && untrusted_inputs.is_empty() {
        if let Some(run_id) = &ctx.run.run_id {
            untrusted_inputs.push(admission::trust::UntrustedInput::EarlierTurnOfRun {
                run_id: admission::sanitize_label(run_id),
            });
        }
    }
    (trust, untrusted_inputs)
}

/// A structured channel's `response_format` schema over `max_schema_bytes` is 413.
fn check_channel_schema_size(
    state: &AppState,
    channel: Option<&ChannelSpec>,
) -> Result<(), WireError> {
    let Some(spec) = channel.filter(|c| c.channel == Channel::Structured) else {
        return Ok(());
    };
    state
        .schemas
        .check_size(&spec.schema)
        .map_err(|(bytes, limit_bytes)| WireError::SchemaTooLarge {
            what: format!(
                "`response_format` schema `{}`",
                admission::sanitize_label(&spec.name)
            ),
            bytes,
            limit_bytes,
        })
        .map(|_| ())
}

/// A run node needs durable records (tool-turn contract §D): while the journal is failing
/// it is refused at once, before anything goes upstream.
fn refuse_run_while_journal_fails(state: &AppState, ctx: &RequestCtx) -> Result<(), WireError> {
    if ctx.run.run_id.is_some() {
        if let Some(reason) = state.journal.health().failing() {
            return Err(WireError::JournalUnavailable {
                reason: format!("durable writes are failing ({reason})"),
            });
        }
    }
    Ok(())
}

/// The model rounds of one agent request: send upstream; an upstream error passes through
/// unchanged; a stream is relayed ([`stream::relay`]); a JSON answer is surfaced, and a
/// repair round loops back to send.
async fn model_rounds(mut session: Session) -> Result<(Response, bool), WireError> {
    let api = session.turn.api;
    loop {
        let sent = tokio::time::Instant::now();
        let resp = session.send().await?;
        let base = session.base(resp.status().as_u16());
        if !resp.status().is_success() {
            // Upstream errors pass through as they came (status, headers, body), read whole
            // within the answer's time bounds; a redirect or an informational answer is not
            // relayed ([`upstream::relayed`]).
            record_upstream_error(&session, &base);
            let deadline =
                sent + Duration::from_millis(session.state.config.upstream_response_timeout_ms);
            let out = upstream::relayed(&session.state, api.upstream(), resp, deadline).await?;
            return Ok((out, false));
        }
        // A body turnguard cannot decode is refused before any of it reaches the agent.
        let coding = upstream::content_coding(resp.headers()).map_err(|reason| {
            record_upstream_error(&session, &base);
            WireError::UpstreamUnavailable {
                upstream: api.upstream().to_owned(),
                reason,
            }
        })?;
        if is_event_stream(resp.headers()) {
            return Ok((stream::relay(session, base, resp, coding), true));
        }
        // Boxed: the answer phase's state (reading, judging and committing the round) is
        // most of a request's future, and a request spends its wait for the upstream without
        // it (issue 13: the handler future was ~14 KB for every request in flight).
        match Box::pin(answer_json(&session, &base, resp, coding, sent)).await? {
            JsonRound::Respond(out) => return Ok((out, false)),
            JsonRound::Repair(next) => {
                session.body = next;
                session.agent_bytes = None;
                session.count_repair();
            }
            JsonRound::Error(e) => return Ok((surfaced_error(&e, Surface::of_api(api)), false)),
        }
    }
}

/// `Turnguard-Prompted-Schema`, made at compile time ([`crate::edge::X_REQUEST_ID`] says why).
const PROMPTED_SCHEMA: http::HeaderName =
    http::HeaderName::from_static("turnguard-prompted-schema");

/// The text answer's channel (§A): `Turnguard-Prompted-Schema` names a bundle schema
/// (`prompted`); else a provider-enforced `response_format` schema (`structured`); else a
/// bundle route for the model (`prompted`).
fn channel_of(
    headers: &HeaderMap,
    api: Api,
    body: &Value,
    turn: &Turn,
    policy: &CompiledPolicy,
) -> Result<Option<ChannelSpec>, WireError> {
    if let Some(name) = headers.get(&PROMPTED_SCHEMA).and_then(|v| v.to_str().ok()) {
        let name = name.trim();
        let schema = policy.prompted.get(name).ok_or_else(|| WireError::InvalidRequest {
            reason: format!(
                "Turnguard-Prompted-Schema names `{}`, which the policy bundle does not have (it has: {})",
                admission::sanitize_label(name),
                policy.prompted.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
        })?;
        return Ok(Some(ChannelSpec {
            channel: Channel::Prompted,
            name: name.to_owned(),
            schema: Arc::clone(schema),
        }));
    }
    if let Some((name, schema)) = provider::adapter(api).structured_schema(body) {
        return Ok(Some(ChannelSpec {
            channel: Channel::Structured,
            name,
            schema: Arc::new(schema),
        }));
    }
    let routed = turn.model.as_deref().and_then(|m| policy.prompted_route(m));
    Ok(routed.and_then(|name| {
        policy.prompted.get(name).map(|schema| ChannelSpec {
            channel: Channel::Prompted,
            name: name.to_owned(),
            schema: Arc::clone(schema),
        })
    }))
}

/// Reads a data-plane request body: capped at `max_body_bytes`, within
/// `body_read_timeout_ms`, then takes the concurrency permit ([`crate::edge::admit`]): a
/// client still sending its body holds no permit.
///
/// Errors: 413, 408, 503 when shed, and 400 for a body that cannot be read or that declares a
/// `Content-Encoding` other than `identity`: turnguard reads a body as the bytes it is and
/// forwards those bytes with the agent's headers, so a coded label over them is read one way
/// by turnguard and another by the upstream (issue 13's probe of the HTTP layer).
pub(crate) async fn read_request(
    state: &AppState,
    parts: &http::request::Parts,
    body: Body,
) -> Result<Bytes, WireError> {
    if let Some(coding) = declared_coding(&parts.headers) {
        return Err(WireError::InvalidRequest {
            reason: format!(
                "the request declares Content-Encoding `{coding}`; turnguard reads request bodies as sent and accepts none but identity: send the body uncompressed"
            ),
        });
    }
    let deadline = Duration::from_millis(state.config.body_read_timeout_ms);
    let raw = read_capped_within(body, state.config.max_body_bytes, None, deadline)
        .await
        .map_err(|e| match e {
            BodyError::TooLarge(limit_bytes) => WireError::PayloadTooLarge { limit_bytes },
            BodyError::TimedOut(_) => WireError::RequestTimeout {
                limit_ms: state.config.body_read_timeout_ms,
            },
            BodyError::Read(reason) => WireError::InvalidRequest { reason },
        })?;
    crate::edge::admit(&parts.extensions)?;
    Ok(raw)
}

/// The request's `Content-Encoding` codings other than `identity`, joined and shown safely
/// (ASCII letters, digits, `-`, `,`, space; at most 40 characters); `None` when it declares
/// none.
fn declared_coding(headers: &HeaderMap) -> Option<String> {
    let mut codings = Vec::new();
    for v in headers.get_all(header::CONTENT_ENCODING) {
        let text = String::from_utf8_lossy(v.as_bytes()).into_owned();
        codings.extend(
            text.split(',')
                .map(|c| c.trim().to_ascii_lowercase())
                .filter(|c| !c.is_empty() && c != "identity"),
        );
    }
    (!codings.is_empty()).then(|| {
        codings
            .join(", ")
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | ',' | ' '))
            .take(40)
            .collect()
    })
}

/// A request declaring a tool schema over `max_schema_bytes` is refused before it goes
/// upstream (issue 11: compiled schemas are bounded in memory). Sets each declared schema's
/// [`crate::model::DeclaredTool::fingerprint`].
fn check_schema_sizes(state: &AppState, turn: &mut Turn) -> Result<(), WireError> {
    for tool in &mut turn.tools {
        let Some(schema) = &tool.schema else { continue };
        let fingerprint = state
            .schemas
            .check_declared(schema, tool.fingerprint)
            .map_err(|(bytes, limit_bytes)| WireError::SchemaTooLarge {
                what: format!(
                    "declared schema of tool `{}`",
                    admission::sanitize_label(&tool.name)
                ),
                bytes,
                limit_bytes,
            })?;
        tool.fingerprint = Some(fingerprint);
    }
    Ok(())
}

/// The agent's body as JSON; a body with a repeated object key is refused (what is
/// forwarded unchanged must read one way: [`crate::strict_json`]). Declared tools read
/// before are taken as read ([`crate::strict_json::request_from_slice`]).
fn parse_json(state: &AppState, raw: &[u8]) -> Result<crate::strict_json::RequestBody, WireError> {
    crate::strict_json::request_from_slice(raw, &state.declared_tools).map_err(|e| {
        WireError::InvalidRequest {
            reason: e.to_string(),
        }
    })
}

pub(super) fn hex_sha256(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_event_content_type)
}

/// A `content-type` value of `text/event-stream`.
fn is_event_content_type(v: &str) -> bool {
    v.trim_start()
        .to_ascii_lowercase()
        .starts_with("text/event-stream")
}

/// Inside a run, a request that delegates MCP or A2A calls to the provider is refused before
/// it goes upstream (tool-turn contract §F). A chat turn (no `Turnguard-Run`) may.
/// `Turnguard-Run` and `Turnguard-Node` become OpenWOP ids: a run id of `A-Z a-z 0-9 . _ ~ :
/// / -` (≤ 200), a node id of `A-Z a-z 0-9 . _ ~ : -` (≤ 128, ids.schema.json `nodeId`),
/// each header given once ([`RequestCtx::of`] keeps a value it cannot read, or one given
/// twice, for this check to refuse).
///
/// Errors: [`WireError::InvalidRequest`] naming the header (400).
pub(crate) fn check_run_ids(run: &RunKey) -> Result<(), WireError> {
    let ok = |s: &str, max: usize, slash: bool| {
        !s.is_empty()
            && s.len() <= max
            && s.chars().all(|c| {
                c.is_ascii_alphanumeric()
                    || matches!(c, '.' | '_' | '~' | ':' | '-')
                    || (slash && c == '/')
            })
    };
    if run.run_id.as_deref().is_some_and(|r| !ok(r, 200, true)) {
        return Err(WireError::InvalidRequest {
            reason: "`Turnguard-Run` must be one header of 1-200 of A-Z a-z 0-9 . _ ~ : / -".into(),
        });
    }
    if run.node_id.as_deref().is_some_and(|n| !ok(n, 128, false)) {
        return Err(WireError::InvalidRequest {
            reason: "`Turnguard-Node` must be one header of 1-128 of A-Z a-z 0-9 . _ ~ : -".into(),
        });
    }
    Ok(())
}

fn refuse_provider_delegation(ctx: &RequestCtx, turn: &Turn) -> Result<(), WireError> {
    match (&ctx.run.run_id, turn.provider_delegations.first()) {
        (Some(_), Some(what)) => Err(WireError::ProviderDelegationInRun { what: what.clone() }),
        _ => Ok(()),
    }
}

/// Passes an emission-free endpoint (`GET /v1/models`, `POST /v1/embeddings`,
/// `POST /v1/messages/count_tokens`) to `upstream` unchanged, body capped. A principal token
/// on it is verified and journaled first, as on the model APIs ([`acting_person`]).
pub async fn passthrough(
    state: Arc<AppState>,
    upstream_name: &'static str,
    req: Request<Body>,
) -> Response {
    let ctx = RequestCtx::of(req.headers(), req.extensions());
    let surface = Surface::of_request(req.uri().path(), req.headers());
    let (parts, body) = req.into_parts();
    let result = async {
        acting_person(&state, &parts.headers).await?;
        let raw = read_request(&state, &parts, body).await?;
        let path = parts
            .uri
            .path_and_query()
            .map_or(parts.uri.path(), |p| p.as_str())
            .to_owned();
        let headers = upstream::request_headers(&parts.headers, false);
        upstream::send(
            &state,
            upstream_name,
            crate::metrics::ApiLabel::Passthrough,
            parts.method.clone(),
            &path,
            headers,
            raw,
        )
        .await
    }
    .await;
    let result = match result {
        Ok(r) => {
            let deadline = tokio::time::Instant::now()
                + Duration::from_millis(state.config.upstream_response_timeout_ms);
            upstream::relayed(&state, upstream_name, r, deadline).await
        }
        Err(e) => Err(e),
    };
    let mut resp = result.unwrap_or_else(|e| e.response(surface));
    state.metrics.request(
        crate::metrics::ApiLabel::Passthrough,
        resp.status().as_u16(),
        false,
    );
    if let Ok(v) = HeaderValue::from_str(ctx.request_id()) {
        resp.headers_mut().insert(crate::edge::X_REQUEST_ID, v);
    }
    resp
}
