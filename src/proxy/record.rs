//! Recording a round: the round's ids (`round_id`, `CallIds`), what every round record
//! shares (`RoundBase`, `round_record`, `call_records`), the tool results and declared tools
//! seen before upstream (`record_tool_results`, `record_declared_tools`), the round
//! (`record_round`), and for a run node what the agent received (`record_served`).

use std::sync::Arc;

use serde_json::Value;

use crate::clock::now_ms;
use crate::error::WireError;
use crate::journal::{
    CallRecord, Recorded, RoundRecord, RoundState, ServedCall, ServedRecord, ToolResultRecord,
};
use crate::model::{ChoiceEmissions, ChoiceVerdict, Turn};
use crate::policy::CompiledPolicy;
use crate::request::RequestCtx;
use crate::request::Session;
use crate::state::AppState;

impl Session {
    /// The journal id of the current model round (`<journal-id>`, then `#repair-N`).
    pub fn round_id(&self) -> String {
        if self.rounds <= 1 {
            self.ctx.journal_id.clone()
        } else {
            format!("{}#repair-{}", self.ctx.journal_id, self.rounds - 1)
        }
    }

    /// What every round record shares.
    pub fn base(&self, upstream_status: u16) -> RoundBase {
        // The first round sends the agent's own request: its digest is already known.
        let request_digest = if self.rounds <= 1 {
            self.agent_digest.clone()
        } else {
            crate::recipes::semantic_request_digest(self.turn.api, &self.body)
        };
        RoundBase {
            request_digest,
            upstream_status,
            round_id: self.round_id(),
        }
    }

    /// Identity inputs of this turn's calls.
    pub fn call_ids(&self) -> CallIds {
        CallIds {
            tenant: self.state.config.tenant.clone(),
            run: self
                .ctx
                .run
                .run_id
                .clone()
                .zip(self.ctx.run.node_id.clone()),
            base_ordinal: self.turn.prior_calls.len() as u64,
        }
    }

    /// The calls of `verdicts` that went to the agent, for the served record.
    pub fn served_calls(
        &self,
        round: &[ChoiceEmissions],
        verdicts: &[ChoiceVerdict],
    ) -> Vec<ServedCall> {
        let mut out = Vec::new();
        for (choice, v) in round.iter().zip(verdicts) {
            for (i, call) in choice.calls.iter().enumerate() {
                if v.released(i) {
                    out.push(ServedCall {
                        call_id: call.id.clone(),
                        tool_name: call.name.clone(),
                        rerunnable: self.policy.tool(&call.name).rerunnable(),
                    });
                }
            }
        }
        out
    }

    /// Records what the agent received for this round of a run node (the record recovery and
    /// replay serve again), confirming the round's effect claims in the same transaction.
    /// Chat turns are not recorded for replay (tool-turn contract §D). Call before the answer
    /// leaves. `Err` only when a claim was taken over by another owner since
    /// (`JournalError::Fenced`, PostgreSQL): the answer must not leave (fail closed); any
    /// other failure is logged.
    pub async fn record_served(
        &self,
        status: u16,
        content_type: &str,
        body: Recorded,
        calls: Vec<ServedCall>,
        claims: Vec<(String, String)>,
    ) -> Result<(), crate::journal::JournalError> {
        let (Some(run), Some(node), Some(attempt)) = (
            &self.ctx.run.run_id,
            &self.ctx.run.node_id,
            self.ctx.run.attempt,
        ) else {
            // A chat turn keeps no served record; its claims are still confirmed.
            return match self.state.journal.confirm_claims(claims).await {
                Err(e @ crate::journal::JournalError::Fenced(_)) => Err(e),
                Err(e) => {
                    tracing::error!(error = %e, request_id = %self.ctx.request_id, "effect claims not confirmed");
                    Ok(())
                }
                Ok(()) => Ok(()),
            };
        };
        let rec = ServedRecord {
            run_id: run.clone(),
            node_id: node.clone(),
            attempt,
            round_index: self.turn.round_index,
            request_digest: self.agent_digest.clone(),
            request_id: self.ctx.journal_id.clone(),
            status,
            content_type: content_type.to_owned(),
            body,
            calls,
            at_ms: now_ms(),
            claims,
        };
        match self.state.journal.record_served(rec).await {
            Err(e @ crate::journal::JournalError::Fenced(_)) => Err(e),
            Err(e) => {
                tracing::error!(error = %e, request_id = %self.ctx.request_id, "served response not journaled");
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }
}

/// What every round record shares, known once the upstream answered.
#[derive(Debug, Clone)]
pub struct RoundBase {
    /// SHA-256 (hex) of the RFC 8785 form of the request body sent upstream.
    pub request_digest: String,
    /// The upstream's HTTP status.
    pub upstream_status: u16,
    /// Journal id of the round.
    pub round_id: String,
}

/// What a call's identity derives from (DESIGN.md §2): the per-node ordinal continues the
/// calls already in the transcript, so a re-sent request lands on the same keys.
#[derive(Debug, Clone, Default)]
pub struct CallIds {
    pub tenant: String,
    /// (run, node) for a run node.
    pub run: Option<(String, String)>,
    /// Calls already in the transcript.
    pub base_ordinal: u64,
}

impl CallIds {
    /// `logicalInvocationId` of the call at `ordinal` (run nodes only).
    pub fn logical(&self, ordinal: u64, tool: &str) -> Option<String> {
        self.run.as_ref().map(|(run, node)| {
            crate::recipes::logical_invocation_id(&self.tenant, run, node, ordinal, tool)
        })
    }
}

/// The journal rows of each call and its decision.
pub fn call_records(
    round: &[ChoiceEmissions],
    verdicts: &[ChoiceVerdict],
    ids: &CallIds,
) -> Vec<CallRecord> {
    let mut out = Vec::new();
    for (choice, verdict) in round.iter().zip(verdicts) {
        for (ordinal, (call, d)) in choice.calls.iter().zip(&verdict.decisions).enumerate() {
            let node_ordinal = ids.base_ordinal + ordinal as u64;
            out.push(CallRecord {
                logical_invocation_id: ids.logical(node_ordinal, &call.name),
                node_ordinal,
                choice: choice.choice,
                ordinal: ordinal as u32,
                call_id: call.id.clone(),
                name: call.name.clone(),
                outcome: d.outcome.as_str(),
                stage: d.stage.as_str(),
                reason: d.reason.as_str(),
                args_hash: d.args_hash.clone(),
                tool_id: d.tool_id.clone(),
                enforced: d.enforced,
                rules: (!d.rules.is_empty()).then(|| d.rules.join(",")),
                redacted_args: d.redacted_args.as_ref().map(Value::to_string),
            });
        }
    }
    out
}

/// The effect claims of the calls these verdicts release.
pub fn claims_of(verdicts: &[ChoiceVerdict]) -> Vec<(String, String)> {
    verdicts
        .iter()
        .flat_map(|v| v.claims.iter().cloned())
        .collect()
}

/// A call of these verdicts carried a secret in its arguments: the raw response bodies of
/// the round are not kept (redaction applies to every record, and the stream of a call's
/// arguments cannot be redacted piecewise).
pub fn has_secrets(verdicts: &[ChoiceVerdict]) -> bool {
    verdicts
        .iter()
        .flat_map(|v| &v.decisions)
        .any(|d| d.secrets > 0)
}

/// Comma-joins labels for a journal column.
pub fn join<'a>(items: impl Iterator<Item = &'a str>) -> String {
    items.collect::<Vec<_>>().join(",")
}

/// A round record with the shared fields filled in.
pub fn round_record(
    session: &Session,
    base: &RoundBase,
    round_state: RoundState,
    response: &[u8],
) -> RoundRecord {
    let ctx = &session.ctx;
    RoundRecord {
        request_id: base.round_id.clone(),
        client_request_id: Some(ctx.request_id.clone()),
        at_ms: ctx.at_ms,
        api: session.turn.api.as_str(),
        model: session.turn.model.clone(),
        stream: session.turn.stream,
        run: ctx.run.clone(),
        round_index: session.turn.round_index + session.rounds.saturating_sub(1),
        request_digest: base.request_digest.clone(),
        completion: None,
        finish_reason: None,
        upstream_status: Some(base.upstream_status),
        latency_ms: ctx.started.elapsed().as_millis() as u64,
        state: round_state,
        error: None,
        response: Recorded::redacted(
            response,
            &session.policy.redactor,
            session.state.config.journal_max_record_bytes,
        ),
        calls: Vec::new(),
        response_link: None,
        channel: None,
        channel_result: None,
        content_trust: Some(session.trust),
    }
}

/// Writes a round, its free text (call names, errors) redacted with the request's redactor
/// like its body; a failure is counted and logged (the agent's response is already decided).
/// A run node's round is committed durably before this returns (tool-turn contract §D); a
/// chat turn's round is queued (replay and recovery do not apply to chat turns).
pub async fn record_round(session: &Session, rec: RoundRecord) {
    record_round_with(&session.state, &session.policy.redactor, rec).await;
}

/// [`record_round`] for a round decided outside a [`Session`] (the MCP front): its text
/// fields redacted with `redactor` first.
pub async fn record_round_with(
    state: &AppState,
    redactor: &crate::policy::Redactor,
    mut rec: RoundRecord,
) {
    rec.redact_text(redactor);
    journal_round(state, rec).await;
}

pub(super) async fn journal_round(state: &AppState, mut rec: RoundRecord) {
    // A chat turn is out of replay (§D): its round keeps decisions and the body's digest,
    // not the body, unless `journal_bodies = "all"`.
    if rec.run.run_id.is_none() && state.config.journal_bodies != crate::config::JournalBodies::All
    {
        rec.response = rec.response.digest_only();
    }
    let request_id = rec.request_id.clone();
    let result = if rec.run.run_id.is_some() {
        state.journal.record_round(rec).await
    } else {
        state.journal.record_round_relaxed(rec).await
    };
    if let Err(e) = result {
        tracing::error!(request_id = %request_id, error = %e, "round not journaled");
    }
}

pub(super) fn record_upstream_error(session: &Session, base: &RoundBase) {
    let mut rec = round_record(session, base, RoundState::UpstreamError, b"");
    rec.redact_text(&session.policy.redactor);
    let state = Arc::clone(&session.state);
    tokio::spawn(async move { journal_round(&state, rec).await });
}

/// Records the tool results the request carries, durably, before it goes upstream
/// (tool-turn contract §D). A record failure fails the request (503) when any of the results
/// belongs to a tool that is not re-runnable (or that the catalog does not know); results of
/// re-runnable tools only are logged and counted, and the request goes on.
pub(super) async fn record_tool_results(
    state: &AppState,
    ctx: &RequestCtx,
    turn: &Turn,
    policy: &CompiledPolicy,
) -> Result<(), WireError> {
    let redactor = &policy.redactor;
    let cap = state.config.journal_max_record_bytes;
    let recs: Vec<ToolResultRecord> = turn
        .tool_results
        .iter()
        .map(|t| ToolResultRecord {
            request_id: ctx.journal_id.clone(),
            at_ms: ctx.at_ms,
            run: ctx.run.clone(),
            tool_call_id: t.tool_call_id.clone(),
            tool_name: t.tool_name.as_deref().map(|n| redactor.redact_text(n)),
            is_error: t.is_error,
            content: Recorded::redacted(t.content.as_bytes(), redactor, cap),
        })
        .collect();
    match state.journal.record_tool_results(recs).await {
        Ok(()) => Ok(()),
        Err(e) => {
            let all_rerunnable = turn.tool_results.iter().all(|t| {
                t.tool_name
                    .as_deref()
                    .and_then(|n| policy.catalog.by_name(n))
                    .is_some_and(|tool| tool.rerunnable())
            });
            if all_rerunnable {
                tracing::error!(error = %e, request_id = %ctx.request_id, "tool results of re-runnable tools not journaled; going on");
                Ok(())
            } else {
                Err(WireError::JournalUnavailable {
                    reason: e.to_string(),
                })
            }
        }
    }
}

/// Queues the tools the request declared (names and parameter schemas, never arguments) for
/// `turnguard policy learn`; a failure is logged, the request goes on (nothing in the
/// contract depends on it).
pub(super) async fn record_declared_tools(state: &AppState, ctx: &RequestCtx, turn: &Turn) {
    let rec = crate::journal::DeclaredToolsRecord {
        request_id: ctx.journal_id.clone(),
        at_ms: ctx.at_ms,
        run_id: ctx.run.run_id.clone(),
        api: turn.api.as_str(),
        tools: turn
            .tools
            .iter()
            .map(|t| (t.name.clone(), t.schema.clone()))
            .collect(),
    };
    if let Err(e) = state.journal.record_declared_tools(rec).await {
        tracing::error!(error = %e, request_id = %ctx.request_id, "declared tools not journaled");
    }
}
