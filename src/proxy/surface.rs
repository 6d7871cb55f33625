//! The non-stream answer: read capped (`read_upstream_json`), parsed by the adapter, admitted,
//! checked against the text channel (`check_channel`) and surfaced (`surface_json`: release,
//! rewrite, repair round, or error; `surfaced_error`).

use std::time::Duration;

use axum::response::Response;
use bytes::Bytes;
use http::StatusCode;
use serde_json::{json, Value};

use super::record::{
    call_records, claims_of, commit_round, has_secrets, join, record_round, round_record, RoundBase,
};
use crate::admission::channel::ChannelVerdict;
use crate::admission::{self};
use crate::body::{read_capped_within, BodyError};
use crate::error::{Surface, WireError};
use crate::journal::{RoundCommit, RoundRecord, RoundState, ServedCall};
use crate::metrics::EmissionLabels;
use crate::model::{ChoiceEmissions, SurfacedError, Surfacing};
use crate::provider;
use crate::request::Session;
use crate::state::AppState;

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

/// Reads a non-stream upstream body: capped at `max_response_bytes`, at most
/// `upstream_idle_timeout_ms` between chunks, and done within `upstream_response_timeout_ms`
/// of sending the request (the response timeout bounds the whole exchange). The error names
/// the limit and its flag.
pub(super) async fn read_upstream_json(
    state: &AppState,
    body: hyper::body::Incoming,
    sent: tokio::time::Instant,
) -> Result<Bytes, String> {
    let c = &state.config;
    let idle = Duration::from_millis(c.upstream_idle_timeout_ms);
    let whole = Duration::from_millis(c.upstream_response_timeout_ms);
    let left = whole.saturating_sub(sent.elapsed());
    let count = |reason: crate::metrics::UpstreamError| {
        state
            .metrics
            .upstream_errors
            .get_or_create(&crate::metrics::ReasonLabels { reason })
            .inc();
    };
    read_capped_within(body, c.max_response_bytes, Some(idle), left)
        .await
        .map_err(|e| match e {
            BodyError::TooLarge(limit) => format!(
                "the response body exceeds the {limit}-byte cap (max_response_bytes; raise it with --max-response-bytes)"
            ),
            BodyError::TimedOut(crate::body::TimedOut::Idle(d)) => {
                count(crate::metrics::UpstreamError::IdleTimeout);
                format!(
                    "the upstream sent no response body data for {} ms (upstream_idle_timeout_ms; raise it with --upstream-idle-timeout-ms)",
                    d.as_millis()
                )
            }
            BodyError::TimedOut(crate::body::TimedOut::Deadline(_)) => {
                count(crate::metrics::UpstreamError::ResponseTimeout);
                format!(
                    "the upstream's response did not complete within {} ms (upstream_response_timeout_ms; raise it with --upstream-response-timeout-ms)",
                    whole.as_millis()
                )
            }
            BodyError::Read(e) => format!("response body: {e}"),
        })
}

/// How a non-stream round ends.
pub(super) enum JsonRound {
    /// Send this body to the agent, once the round's unit of work is committed.
    Respond(Box<Answer>),
    /// Ask the model again with this body.
    Repair(Value),
    /// Fail the request.
    Error(SurfacedError),
}

/// A non-stream answer that goes to the agent, with what is journaled for it in one commit
/// before it leaves ([`Session::commit_answer`]).
pub(super) struct Answer {
    pub body: Bytes,
    /// The calls that go with it.
    pub calls: Vec<ServedCall>,
    /// A call's arguments carried a secret: the body is kept as a digest only.
    pub secrets: bool,
    /// The effect claims (effect id, call id) of the released calls, confirmed in the unit.
    pub claims: Vec<(String, String)>,
    /// The decided round and its events.
    pub unit: RoundCommit,
}

/// A non-stream response: adapter → admission → surface → record.
pub(super) async fn surface_json(
    session: &Session,
    base: &RoundBase,
    body: Bytes,
) -> Result<JsonRound, WireError> {
    let turn = &session.turn;
    let mut json: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => {
            let mut rec = round_record(session, base, RoundState::Failed, &body);
            rec.error = Some("upstream response is not JSON".into());
            record_round(session, rec).await;
            return Err(WireError::UpstreamUnavailable {
                upstream: turn.api.upstream().to_owned(),
                reason: "the upstream answered 2xx with a body that is not JSON".into(),
            });
        }
    };
    let round = match provider::adapter(turn.api).parse_response(&json, turn) {
        Ok(round) => round,
        Err(why) => {
            // One emission, one decision: a response that does not identify each choice and
            // call uniquely is not decided call by call; it fails closed.
            let mut rec = round_record(session, base, RoundState::Failed, &body);
            rec.error = Some(why.clone());
            record_round(session, rec).await;
            return Err(WireError::UpstreamUnavailable {
                upstream: turn.api.upstream().to_owned(),
                reason: format!("the upstream response is ambiguous: {why}"),
            });
        }
    };
    let with_calls: Vec<ChoiceEmissions> = round
        .iter()
        .filter(|c| !c.calls.is_empty())
        .cloned()
        .collect();
    let (verdicts, events) = session
        .admit(&with_calls, &crate::approvals::InRequest)
        .await;
    let mut rec = round_record(session, base, RoundState::Ok, &body);
    if has_secrets(&verdicts) {
        rec.response = rec.response.withheld();
    }
    rec.completion = Some(join(round.iter().map(|c| c.completion.state.as_str())));
    rec.finish_reason = Some(join(round.iter().map(|c| c.completion.reason.as_str())));
    rec.calls = call_records(&with_calls, &verdicts, &session.call_ids());
    rec.response_link = session.judged(
        provider::adapter(turn.api).response_link(&json, turn),
        &rec.calls,
    );

    let outcome = if let Some(e) = verdicts.iter().find_map(|v| match &v.surfacing {
        Surfacing::Error(e) => Some(e.clone()),
        _ => None,
    }) {
        rec.state = RoundState::SurfacedError;
        JsonRound::Error(e)
    } else if let Some((choice, items)) =
        with_calls
            .iter()
            .zip(&verdicts)
            .find_map(|(c, v)| match &v.surfacing {
                Surfacing::Repair(items) => Some((c, items)),
                _ => None,
            })
    {
        rec.state = RoundState::Repaired;
        JsonRound::Repair(session.repaired(choice, items))
    } else if let Some(next) = session.check_channel(&round, &mut rec) {
        next
    } else {
        let body = if provider::adapter(turn.api).rewrite_response(&mut json, &verdicts) {
            Bytes::from(json.to_string())
        } else {
            body.clone()
        };
        // The round is committed with what the agent receives, in one unit.
        return Ok(JsonRound::Respond(Box::new(Answer {
            body,
            calls: session.served_calls(&with_calls, &verdicts),
            secrets: has_secrets(&verdicts),
            claims: claims_of(&verdicts),
            unit: RoundCommit {
                round: Some(rec),
                events,
                ..RoundCommit::default()
            },
        })));
    };
    let unit = RoundCommit {
        round: Some(rec),
        events,
        ..RoundCommit::default()
    };
    if let Err(e) = commit_round(session, unit).await {
        tracing::error!(request_id = %session.ctx.request_id, error = %e, "round not journaled");
    }
    Ok(outcome)
}

impl Session {
    /// Validates text answers of the structured / prompted channel (§A). `None`: nothing to
    /// enforce (no channel, a tool turn, valid, or a refusal — which is never retried).
    pub(super) fn check_channel(
        &self,
        round: &[ChoiceEmissions],
        rec: &mut RoundRecord,
    ) -> Option<JsonRound> {
        let spec = self.channel.as_ref()?;
        let choice = round.iter().find(|c| c.calls.is_empty())?;
        let verdict = admission::channel::check(
            spec,
            choice.text.as_deref(),
            &choice.completion,
            &self.state.schemas,
        );
        let result = match &verdict {
            ChannelVerdict::Valid => "valid",
            ChannelVerdict::Refused => "refused",
            ChannelVerdict::Invalid { reason, .. } => reason,
        };
        self.state
            .metrics
            .emissions
            .get_or_create(&EmissionLabels {
                channel: spec.channel,
                result,
            })
            .inc();
        rec.channel = Some(spec.channel.as_str());
        rec.channel_result = Some(result.to_owned());
        let ChannelVerdict::Invalid { reason, message } = verdict else {
            return None;
        };
        // Context exhaustion is not repaired: a longer transcript cannot fit either.
        let repairable = admission::completion::repairable(reason);
        if repairable
            && self.repairs_left > 0
            && provider::adapter(self.turn.api).choices_requested(&self.body) == 1
        {
            rec.state = RoundState::Repaired;
            let mut next = self.body.clone();
            let feedback = format!(
                "turnguard: {message}. Answer again with only a JSON document valid against the schema `{}`.",
                admission::sanitize_label(&spec.name)
            );
            provider::adapter(self.turn.api).append_text_repair(
                &mut next,
                choice.text.as_deref().unwrap_or(""),
                &feedback,
            );
            return Some(JsonRound::Repair(next));
        }
        rec.state = RoundState::SurfacedError;
        let code = admission::completion::channel_error_code(reason);
        Some(JsonRound::Error(SurfacedError {
            status: 422,
            code,
            message: format!(
                "the {} answer was not accepted: {message}",
                spec.channel.as_str()
            ),
            retry_after_secs: None,
        }))
    }
}

/// The agent's JSON answer of a surfaced round: the round, its events and (for a run node)
/// what the agent receives are committed first as one unit (redacted; withheld when a
/// call's arguments carried a secret), then the body goes out with the upstream's status
/// and headers.
pub(super) async fn respond_json(
    session: &Session,
    base: &RoundBase,
    parts: &http::response::Parts,
    answer: Box<Answer>,
) -> Result<Response, WireError> {
    let Answer {
        body,
        calls,
        secrets,
        claims,
        unit,
    } = *answer;
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json");
    let kept = || {
        let kept = crate::journal::Recorded::redacted(
            &body,
            &session.policy.redactor,
            session.state.config.journal_max_record_bytes,
        );
        if secrets {
            kept.withheld()
        } else {
            kept
        }
    };
    // A claim another replica took over since (PostgreSQL) is no longer ours: the answer
    // does not leave (fail closed).
    session
        .commit_answer(
            base,
            unit,
            parts.status.as_u16(),
            content_type,
            kept,
            calls,
            claims,
        )
        .await
        .map_err(|e| WireError::JournalUnavailable {
            reason: e.to_string(),
        })?;
    let mut out = Response::new(axum::body::Body::from(body));
    *out.status_mut() = parts.status;
    *out.headers_mut() = super::upstream::response_headers(&parts.headers, false);
    Ok(out)
}
