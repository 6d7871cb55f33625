//! The non-stream answer: the JSON body goes through the round engine as one block
//! ([`super::engine`], [`crate::provider::block`]) and is answered whole once its round is
//! committed (`answer_json`); an outcome surfaced as an error is answered with its own
//! status (`surfaced_error`).

use axum::response::Response;
use http::StatusCode;
use hyper::body::Incoming;
use serde_json::json;

use super::engine::{finish_round, read_round, RelayCtx, RoundEnd, ToAgent};
use super::pipeline::Pipeline;
use super::record::RoundBase;
use crate::error::{Surface, WireError};
use crate::journal::RoundState;
use crate::model::SurfacedError;
use crate::request::Session;

/// An error surfaced for a withheld call, in `surface`'s error shape with the OpenWOP code
/// and details inside ([`crate::error::Surface`]); `Retry-After` for 429.
pub fn surfaced_error(e: &SurfacedError, surface: Surface) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::FORBIDDEN);
    let details = match e.retry_after_secs {
        Some(secs) => json!({ "source": "turnguard", "retryAfterSeconds": secs }),
        None => json!({ "source": "turnguard" }),
    };
    crate::error::Authored {
        status,
        code: e.code,
        message: e.message.clone(),
        details: Some(details),
        retry_after: e.retry_after_secs,
    }
    .response(surface)
}

/// How a non-stream round ends.
pub(super) enum JsonRound {
    /// The agent's answer: committed with its round, ready to leave.
    Respond(Response),
    /// Ask the model again with this body.
    Repair(crate::strict_json::RequestBody),
    /// Answer with this surfaced error.
    Error(SurfacedError),
}

/// A non-stream answer (`resp`, its body coded as `coding`, sent upstream at `sent`): read
/// capped at `max_response_bytes` (decoded), at most `upstream_idle_timeout_ms` between
/// chunks and within `upstream_response_timeout_ms` of sending; decided by the round engine;
/// its round, events, effect claims and (for a run node) the served record of what the agent
/// receives committed as one unit; then answered with the upstream's status and headers.
///
/// Errors: the body could not be read, is not a JSON object, or does not identify each
/// choice and call uniquely (502, the round recorded as failed); a claim was taken over by
/// another owner since (503: the answer does not leave).
pub(super) async fn answer_json(
    session: &Session,
    base: &RoundBase,
    resp: http::Response<Incoming>,
    coding: super::upstream::ContentCoding,
    sent: tokio::time::Instant,
) -> Result<JsonRound, WireError> {
    let config = &session.state.config;
    let (parts, mut body) = resp.into_parts();
    let cap = if super::record::keeps_body(&session.state, &session.ctx.run) {
        config.journal_max_record_bytes
    } else {
        0
    };
    let mut agent = ToAgent::held(cap);
    let mut relay = RelayCtx {
        timing: crate::edge::current(),
        cut: session.state.lifecycle.cut_signal(),
        first_byte: true,
        deadline: Some(
            sent + std::time::Duration::from_millis(config.upstream_response_timeout_ms),
        ),
    };
    let mut pipeline = Pipeline::block(&session.turn, config.max_response_bytes)
        .with_coding(coding)
        .with_capture(cap)
        .with_channel(
            session.channel.clone(),
            std::sync::Arc::clone(&session.state.schemas),
        );
    let end = read_round(session, &mut pipeline, &mut body, &mut agent, &mut relay).await;
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_owned();
    // A claim another replica took over since (PostgreSQL) is no longer ours: the answer
    // does not leave (fail closed).
    finish_round(
        session,
        base,
        &mut pipeline,
        &end,
        &mut agent,
        (parts.status.as_u16(), &content_type),
    )
    .await
    .map_err(|e| WireError::JournalUnavailable {
        reason: e.to_string(),
    })?;
    match end {
        RoundEnd::Repair(next, _) => Ok(JsonRound::Repair(next)),
        RoundEnd::Refused(e, _) => Ok(JsonRound::Error(e)),
        RoundEnd::Done(RoundState::Ok, _) => {
            let mut out = Response::new(axum::body::Body::from(agent.take_body()));
            *out.status_mut() = parts.status;
            *out.headers_mut() = super::upstream::response_headers(&parts.headers, false);
            Ok(JsonRound::Respond(out))
        }
        RoundEnd::Done(_, error) => Err(WireError::UpstreamUnavailable {
            upstream: session.turn.api.upstream().to_owned(),
            reason: error.unwrap_or_else(|| "the upstream answer failed".to_owned()),
        }),
        // A held answer has no channel that can close; kept for completeness.
        RoundEnd::ClientGone => Err(WireError::UpstreamUnavailable {
            upstream: session.turn.api.upstream().to_owned(),
            reason: "the agent left".to_owned(),
        }),
    }
}
