//! The request path, as a plain function per stage that reads like DESIGN.md §3:
//!
//! ```text
//! request ─▶ parse (capped) ─▶ adapter → Turn ─▶ record tool results seen ─▶ forward upstream
//! response/stream ─▶ adapter → emissions ─▶ admission, per call, in order
//!   ─▶ surface (release · end-turn) ─▶ record round ─▶ agent
//! ```
//!
//! Streams are relayed by [`stream`]; everything provider-specific is behind
//! [`crate::provider`].

pub mod stream;
pub mod upstream;

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request};
use serde_json::Value;

use crate::admission;
use crate::body::{read_capped, BodyError};
use crate::error::WireError;
use crate::journal::{CallRecord, Recorded, RoundRecord, RunKey, ToolResultRecord};
use crate::metrics::CallLabels;
use crate::model::{Api, ChoiceEmissions, ChoiceVerdict, Turn};
use crate::provider;
use crate::server::AppState;

/// Who and what one data-plane request is: its id and its run identity headers.
#[derive(Debug, Clone)]
pub struct RequestCtx {
    /// `x-request-id` of the agent when it is sane, else a fresh UUID.
    pub request_id: String,
    /// Run identity from `Turnguard-Run` / `-Node` / `-Attempt` (DESIGN.md §2).
    pub run: RunKey,
    /// When the request arrived.
    pub started: Instant,
    /// Wall-clock arrival, milliseconds since the Unix epoch.
    pub at_ms: i64,
}

impl RequestCtx {
    fn new(headers: &HeaderMap) -> Self {
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty() && v.len() <= 200)
                .map(str::to_owned)
        };
        let request_id = header("x-request-id")
            .filter(|v| v.chars().all(|c| c.is_ascii_graphic()))
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let run_id = header("turnguard-run");
        let run = RunKey {
            node_id: run_id
                .as_ref()
                .map(|_| header("turnguard-node").unwrap_or_else(|| "default".into())),
            attempt: run_id.as_ref().map(|_| {
                header("turnguard-attempt")
                    .and_then(|a| a.parse().ok())
                    .filter(|a| *a >= 1)
                    .unwrap_or(1)
            }),
            run_id,
        };
        Self {
            request_id,
            run,
            started: Instant::now(),
            at_ms: now_ms(),
        }
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Serves one model request of `api` (`POST /v1/chat/completions`, `POST /v1/messages`,
/// `POST /v1/responses`).
pub async fn handle(state: Arc<AppState>, api: Api, req: Request<Body>) -> Response {
    let ctx = RequestCtx::new(req.headers());
    state.metrics.inflight_requests.inc();
    let (mut resp, stream) = match turn(&state, api, &ctx, req).await {
        Ok(ok) => ok,
        Err(e) => {
            let (_, code, reason) = e.parts();
            tracing::warn!(request_id = %ctx.request_id, api = api.as_str(), code, reason, error = %e, "request refused");
            (e.into_response(), false)
        }
    };
    state.metrics.inflight_requests.dec();
    state
        .metrics
        .request(api.as_str(), resp.status().as_u16(), stream);
    if let Ok(v) = HeaderValue::from_str(&ctx.request_id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// The life of a turn. Returns the response and whether it is a stream.
async fn turn(
    state: &Arc<AppState>,
    api: Api,
    ctx: &RequestCtx,
    req: Request<Body>,
) -> Result<(Response, bool), WireError> {
    let (parts, body) = req.into_parts();
    let raw = read_request(state, body).await?;
    let json = parse_json(&raw)?;
    let turn = provider::parse_request(api, &json)
        .map_err(|reason| WireError::InvalidRequest { reason })?;
    refuse_provider_delegation(ctx, &turn)?;
    record_tool_results(state, ctx, &turn).await?;

    let path = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |p| p.as_str())
        .to_owned();
    let headers = upstream::request_headers(&parts.headers, true);
    let resp = upstream::send(
        state,
        api.upstream(),
        api.as_str(),
        Method::POST,
        &path,
        headers,
        raw,
    )
    .await?;
    let round = RoundBase {
        request_digest: hex_sha256(&admission::arguments::canonical(&json)),
        upstream_status: resp.status().as_u16(),
    };

    if !resp.status().is_success() {
        // Upstream errors pass through unchanged (status, headers, body).
        record_upstream_error(state, ctx, &turn, &round);
        let (p, b) = resp.into_parts();
        let mut out = Response::new(Body::new(b));
        *out.status_mut() = p.status;
        *out.headers_mut() = upstream::response_headers(&p.headers, true);
        return Ok((out, false));
    }
    if is_event_stream(resp.headers()) {
        return Ok((
            stream::relay(Arc::clone(state), ctx.clone(), turn, round, resp),
            true,
        ));
    }
    let (p, b) = resp.into_parts();
    let body = read_capped(b, state.config.max_response_bytes)
        .await
        .map_err(|e| WireError::UpstreamUnavailable {
            upstream: api.upstream().to_owned(),
            reason: format!("response body: {e}"),
        })?;
    let body = surface_json(state, ctx, &turn, &round, body).await?;
    let mut out = Response::new(Body::from(body));
    *out.status_mut() = p.status;
    *out.headers_mut() = upstream::response_headers(&p.headers, false);
    Ok((out, false))
}

/// What every round record shares, known once the upstream answered.
#[derive(Debug, Clone)]
pub struct RoundBase {
    /// SHA-256 (hex) of the RFC 8785 form of the request body.
    pub request_digest: String,
    /// The upstream's HTTP status.
    pub upstream_status: u16,
}

async fn read_request(state: &AppState, body: Body) -> Result<Bytes, WireError> {
    read_capped(body, state.config.max_body_bytes)
        .await
        .map_err(|e| match e {
            BodyError::TooLarge(limit_bytes) => WireError::PayloadTooLarge { limit_bytes },
            BodyError::Read(reason) => WireError::InvalidRequest { reason },
        })
}

fn parse_json(raw: &[u8]) -> Result<Value, WireError> {
    serde_json::from_slice(raw).map_err(|e| WireError::InvalidRequest {
        reason: format!(
            "malformed JSON at line {} column {}: {}",
            e.line(),
            e.column(),
            classify_json_error(&e)
        ),
    })
}

fn classify_json_error(e: &serde_json::Error) -> &'static str {
    match e.classify() {
        serde_json::error::Category::Eof => "unexpected end of input",
        serde_json::error::Category::Syntax => "syntax error",
        serde_json::error::Category::Data => "unexpected data",
        serde_json::error::Category::Io => "read error",
    }
}

fn hex_sha256(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        })
}

/// Inside a run, a request that delegates MCP or A2A calls to the provider is refused before
/// it goes upstream (tool-turn contract §F). A chat turn (no `Turnguard-Run`) may.
fn refuse_provider_delegation(ctx: &RequestCtx, turn: &Turn) -> Result<(), WireError> {
    match (&ctx.run.run_id, turn.provider_delegations.first()) {
        (Some(_), Some(what)) => Err(WireError::ProviderDelegationInRun { what: what.clone() }),
        _ => Ok(()),
    }
}

/// Records the tool results the request carries, durably, before it goes upstream
/// (tool-turn contract §D). A record failure fails the request.
async fn record_tool_results(
    state: &AppState,
    ctx: &RequestCtx,
    turn: &Turn,
) -> Result<(), WireError> {
    let cap = state.config.journal_max_record_bytes;
    let recs: Vec<ToolResultRecord> = turn
        .tool_results
        .iter()
        .map(|t| ToolResultRecord {
            request_id: ctx.request_id.clone(),
            at_ms: ctx.at_ms,
            run: ctx.run.clone(),
            tool_call_id: t.tool_call_id.clone(),
            tool_name: t.tool_name.clone(),
            is_error: t.is_error,
            content: Recorded::of(t.content.as_bytes(), cap),
        })
        .collect();
    state
        .journal
        .record_tool_results(recs)
        .await
        .map_err(|e| WireError::JournalUnavailable {
            reason: e.to_string(),
        })
}

/// Admits every call of every choice (tool-turn contract §B) and counts the outcomes.
pub fn admit(state: &AppState, turn: &Turn, round: &[ChoiceEmissions]) -> Vec<ChoiceVerdict> {
    round
        .iter()
        .map(|choice| {
            let verdict = admission::admit_choice(turn, choice, &state.schemas);
            for d in &verdict.decisions {
                state
                    .metrics
                    .tool_calls
                    .get_or_create(&CallLabels {
                        outcome: d.outcome.as_str().to_owned(),
                        stage: d.stage.as_str().to_owned(),
                        channel: "tool".to_owned(),
                    })
                    .inc();
            }
            verdict
        })
        .collect()
}

/// The journal rows of each call and its decision.
pub fn call_records(round: &[ChoiceEmissions], verdicts: &[ChoiceVerdict]) -> Vec<CallRecord> {
    let mut out = Vec::new();
    for (choice, verdict) in round.iter().zip(verdicts) {
        for (ordinal, (call, d)) in choice.calls.iter().zip(&verdict.decisions).enumerate() {
            out.push(CallRecord {
                choice: choice.choice,
                ordinal: ordinal as u32,
                call_id: call.id.clone(),
                name: call.name.clone(),
                outcome: d.outcome.as_str(),
                stage: d.stage.as_str(),
                reason: d.reason,
                args_hash: d.args_hash.clone(),
            });
        }
    }
    out
}

/// A non-stream response: adapter → admission → surface → record. Returns the body to send
/// (the upstream's bytes when nothing changed).
async fn surface_json(
    state: &AppState,
    ctx: &RequestCtx,
    turn: &Turn,
    base: &RoundBase,
    body: Bytes,
) -> Result<Bytes, WireError> {
    let mut json: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => {
            let mut rec = round_record(state, ctx, turn, base, "failed", &body);
            rec.error = Some("upstream response is not JSON".into());
            record_round(state, rec).await;
            return Err(WireError::UpstreamUnavailable {
                upstream: turn.api.upstream().to_owned(),
                reason: "the upstream answered 2xx with a body that is not JSON".into(),
            });
        }
    };
    let round = provider::parse_response(turn.api, &json, turn);
    let with_calls: Vec<ChoiceEmissions> = round
        .iter()
        .filter(|c| !c.calls.is_empty())
        .cloned()
        .collect();
    let verdicts = admit(state, turn, &with_calls);
    let out = if provider::rewrite_response(turn.api, &mut json, &verdicts) {
        Bytes::from(json.to_string())
    } else {
        body.clone()
    };
    let mut rec = round_record(state, ctx, turn, base, "ok", &body);
    rec.completion = Some(join(round.iter().map(|c| c.completion.state.as_str())));
    rec.finish_reason = Some(join(round.iter().map(|c| c.completion.reason.as_str())));
    rec.calls = call_records(&with_calls, &verdicts);
    rec.response_link = provider::response_link(&json, turn);
    record_round(state, rec).await;
    Ok(out)
}

/// Comma-joins labels for a journal column.
pub fn join<'a>(items: impl Iterator<Item = &'a str>) -> String {
    items.collect::<Vec<_>>().join(",")
}

/// A round record with the shared fields filled in.
pub fn round_record(
    state: &AppState,
    ctx: &RequestCtx,
    turn: &Turn,
    base: &RoundBase,
    round_state: &'static str,
    response: &[u8],
) -> RoundRecord {
    RoundRecord {
        request_id: ctx.request_id.clone(),
        at_ms: ctx.at_ms,
        api: turn.api.as_str(),
        model: turn.model.clone(),
        stream: turn.stream,
        run: ctx.run.clone(),
        round_index: turn.round_index,
        request_digest: base.request_digest.clone(),
        completion: None,
        finish_reason: None,
        upstream_status: Some(base.upstream_status),
        latency_ms: ctx.started.elapsed().as_millis() as u64,
        state: round_state,
        error: None,
        response: Recorded::of(response, state.config.journal_max_record_bytes),
        calls: Vec::new(),
        response_link: None,
    }
}

/// Writes a round; a failure is counted and logged (the agent's response is already decided).
pub async fn record_round(state: &AppState, rec: RoundRecord) {
    let request_id = rec.request_id.clone();
    if let Err(e) = state.journal.record_round(rec).await {
        tracing::error!(request_id = %request_id, error = %e, "round not journaled");
    }
}

fn record_upstream_error(state: &Arc<AppState>, ctx: &RequestCtx, turn: &Turn, base: &RoundBase) {
    let rec = round_record(state, ctx, turn, base, "upstream_error", b"");
    let state = Arc::clone(state);
    tokio::spawn(async move { record_round(&state, rec).await });
}

/// Passes an emission-free endpoint (`GET /v1/models`, `POST /v1/embeddings`,
/// `POST /v1/messages/count_tokens`) to `upstream` unchanged, body capped.
pub async fn passthrough(
    state: Arc<AppState>,
    upstream_name: &'static str,
    req: Request<Body>,
) -> Response {
    let ctx = RequestCtx::new(req.headers());
    let (parts, body) = req.into_parts();
    let result = async {
        let raw = read_request(&state, body).await?;
        let path = parts
            .uri
            .path_and_query()
            .map_or(parts.uri.path(), |p| p.as_str())
            .to_owned();
        let headers = upstream::request_headers(&parts.headers, false);
        upstream::send(
            &state,
            upstream_name,
            "passthrough",
            parts.method.clone(),
            &path,
            headers,
            raw,
        )
        .await
    }
    .await;
    let mut resp = match result {
        Ok(r) => {
            let (p, b) = r.into_parts();
            let mut out = Response::new(Body::new(b));
            *out.status_mut() = p.status;
            *out.headers_mut() = upstream::response_headers(&p.headers, true);
            out
        }
        Err(e) => e.into_response(),
    };
    state
        .metrics
        .request("passthrough", resp.status().as_u16(), false);
    if let Ok(v) = HeaderValue::from_str(&ctx.request_id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}
