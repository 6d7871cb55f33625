//! Recording a round: the round's ids (`round_id`, `CallIds`), what every round record
//! shares (`RoundBase`, `round_record`, `call_records`), the tool results and declared tools
//! seen before upstream in one commit (`record_before_upstream`), and the decided round as
//! one unit of work (`commit_round`; `Session::commit_answer` adds what the agent receives:
//! the served record of a run node, the claims it confirms).

use std::future::Future;
use std::sync::Arc;

use crate::clock::now_ms;
use crate::error::WireError;
use crate::journal::{
    CallRecord, Recorded, RoundCommit, RoundRecord, RoundState, ServedCall, ServedRecord,
    ToolResultRecord,
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

    /// Commits the decided round `unit` with what the agent receives (`status`,
    /// `content_type`, `body`, the released `calls` and their effect `claims`) as one unit of
    /// work, before the answer leaves (`body` is made only when it is kept): for a run node
    /// the served record (the record recovery
    /// and replay serve again, confirming the claims in the same transaction), for a chat
    /// turn (out of replay, tool-turn contract §D) the claims alone. `Err` only when a claim
    /// was taken over by another owner since (`JournalError::Fenced`, PostgreSQL): nothing of
    /// the unit was committed, a failed round naming why is recorded instead, and the answer
    /// must not leave (fail closed); any other failure is logged.
    #[allow(clippy::too_many_arguments)]
    pub async fn commit_answer(
        &self,
        base: &RoundBase,
        mut unit: Box<RoundCommit>,
        status: u16,
        content_type: &str,
        body: impl FnOnce() -> Recorded,
        calls: Vec<ServedCall>,
        claims: Vec<(String, String)>,
    ) -> Result<(), crate::journal::JournalError> {
        match (
            &self.ctx.run.run_id,
            &self.ctx.run.node_id,
            self.ctx.run.attempt,
        ) {
            (Some(run), Some(node), Some(attempt)) => {
                unit.served = Some(ServedRecord {
                    reader: Some(self.reader()),
                    run_id: run.clone(),
                    node_id: node.clone(),
                    attempt,
                    round_index: self.turn.round_index,
                    request_digest: self.agent_digest.clone(),
                    request_id: self.ctx.journal_id.clone(),
                    status,
                    content_type: content_type.to_owned(),
                    body: body(),
                    calls,
                    at_ms: now_ms(),
                    claims,
                });
            }
            // A chat turn keeps no served record; its claims are still confirmed.
            _ => unit.claims = claims,
        }
        match commit_round(self, unit).await {
            Err(e @ crate::journal::JournalError::Fenced(_)) => {
                let mut rec = round_record(self, base, RoundState::Failed, b"");
                rec.error = Some(format!("not answered: {e}"));
                record_round(self, rec).await;
                Err(e)
            }
            Err(e) => {
                tracing::error!(error = %e, request_id = %self.ctx.request_id(), "round not journaled");
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

/// The journal row of call `call_id` (tool `name`) and its decision `d`: the first call of
/// the first choice, outside a run (the LLM path sets its position, the MCP front keeps it).
pub fn call_record(call_id: &str, name: &str, d: &crate::model::Decision) -> CallRecord {
    CallRecord {
        logical_invocation_id: None,
        node_ordinal: 0,
        choice: 0,
        ordinal: 0,
        call_id: call_id.to_owned(),
        name: name.to_owned(),
        outcome: d.outcome.as_str(),
        stage: d.stage.as_str(),
        reason: d.reason.as_str(),
        args_hash: d.args_hash.clone(),
        tool_id: d.tool_id.clone(),
        enforced: d.enforced,
        rules: (!d.rules.is_empty()).then(|| d.rules.join(",")),
        redacted_args: journaled_args(d),
    }
}

/// The arguments text a call's journal row keeps: the text admission parsed when redaction
/// found nothing in it (`Decision::args_text`: the same document, not serialized again; issue
/// 13, no parse-and-serialize round trip), otherwise the redacted copy serialized. `None`
/// when the arguments did not parse.
fn journaled_args(d: &crate::model::Decision) -> Option<String> {
    d.args_text
        .clone()
        .or_else(|| d.redacted_args.as_ref().map(crate::strict_json::to_text))
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
                ..call_record(&call.id, &call.name, d)
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
        arrived: ctx.started,
        client_request_id: ctx.client_request_id.clone(),
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
        // A chat turn's body is not kept (§D, `journal_bodies`): only its digest is taken.
        response: if keeps_body(&session.state, &ctx.run) {
            Recorded::redacted(
                response,
                &session.policy.redactor,
                session.state.config.journal_max_record_bytes,
            )
        } else {
            Recorded::digest_of(response)
        },
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
///
/// The round is prepared and boxed when this is called, not when the future is first polled:
/// the future holds the box, not the ~700-byte record (a future keeps every by-value argument
/// for its whole life, so each caller's future would carry one more copy).
pub fn record_round<'a>(session: &'a Session, rec: RoundRecord) -> impl Future<Output = ()> + 'a {
    record_round_with(&session.state, &session.policy.redactor, rec)
}

/// A decided round's unit of work ([`RoundCommit`]) committed: its round prepared as
/// [`record_round`] prepares one (text redacted, a chat turn's body kept as a digest unless
/// `journal_bodies = "all"`). Errors are the journal's ([`crate::journal::Journal::commit_round`]).
pub async fn commit_round(
    session: &Session,
    mut unit: Box<RoundCommit>,
) -> Result<(), crate::journal::JournalError> {
    if let Some(rec) = &mut unit.round {
        rec.redact_text(&session.policy.redactor);
        keep_body_as_configured(&session.state, rec);
    }
    session.state.journal.commit_round(unit).await
}

/// A chat turn is out of replay (§D): its round keeps the decisions and digests — the body's
/// digest and size, each call's `argsHash` — not the body, and not its calls' arguments (they
/// are the body's content: a coding agent's write call carries whole files), unless
/// `journal_bodies = "all"`. A run node's round keeps both (replay and approvals read them).
fn keep_body_as_configured(state: &AppState, rec: &mut RoundRecord) {
    if !keeps_body(state, &rec.run) {
        rec.response.keep_digest_only();
        for c in &mut rec.calls {
            c.redacted_args = None;
        }
    }
}

/// Whether a round of `run` keeps its response body (`journal_bodies`; a run node always).
pub fn keeps_body(state: &AppState, run: &crate::journal::RunKey) -> bool {
    run.run_id.is_some() || state.config.journal_bodies == crate::config::JournalBodies::All
}

/// [`record_round`] for a round decided outside a [`Session`] (the MCP front): its text
/// fields redacted with `redactor` first (when this is called, like [`record_round`]).
pub fn record_round_with<'a>(
    state: &'a AppState,
    redactor: &crate::policy::Redactor,
    mut rec: RoundRecord,
) -> impl Future<Output = ()> + 'a {
    rec.redact_text(redactor);
    journal_round(state, rec)
}

/// The round kept as configured and boxed when this is called; the future commits it.
pub(super) fn journal_round(
    state: &AppState,
    mut rec: RoundRecord,
) -> impl Future<Output = ()> + '_ {
    keep_body_as_configured(state, &mut rec);
    let request_id = rec.request_id.clone();
    let unit = Box::new(RoundCommit {
        round: Some(rec),
        ..RoundCommit::default()
    });
    async move {
        // Durable for a run node's round (§D), queued for a chat turn's ([`RoundCommit`]).
        if let Err(e) = state.journal.commit_round(unit).await {
            tracing::error!(request_id = %request_id, error = %e, "round not journaled");
        }
    }
}

pub(super) fn record_upstream_error(session: &Session, base: &RoundBase) {
    let mut rec = round_record(session, base, RoundState::UpstreamError, b"");
    rec.redact_text(&session.policy.redactor);
    let state = Arc::clone(&session.state);
    tokio::spawn(async move { journal_round(&state, rec).await });
}

/// Records what the request carries before it goes upstream, in one commit
/// ([`crate::journal::BeforeUpstream`]): its tool results, durably (tool-turn contract §D),
/// for an untrusted turn of a run the run's sticky trust bit (§C), and the tools it declared
/// (names and parameter schemas, never arguments; for `turnguard policy learn`). A record
/// failure fails the request (503) when it carries the trust bit or any of the results
/// belongs to a tool that is not re-runnable (or that the catalog does not know); results of
/// re-runnable tools only, or declared tools alone, are logged and counted, and the request
/// goes on.
pub(super) async fn record_before_upstream(
    state: &AppState,
    ctx: &RequestCtx,
    turn: &Turn,
    policy: &CompiledPolicy,
    trust: crate::policy::bundle::ContentTrust,
    person: Option<&str>,
) -> Result<(), WireError> {
    let redactor = &policy.redactor;
    let cap = state.config.journal_max_record_bytes;
    // A result this process already recorded is in the journal: it is not written again
    // (a multi-step agent sends every earlier result each turn; `journal::seen_results`).
    let seen = state.journal.seen_results();
    let reader = crate::request::reader_of(person);
    let mut keys = std::collections::HashSet::new();
    let tool_results: Vec<ToolResultRecord> = turn
        .tool_results
        .iter()
        .filter(|t| {
            let run = ctx.run.run_id.as_deref();
            let key = seen.key(run, &reader, &t.tool_call_id, &t.content);
            !seen.recorded(key) && keys.insert(key)
        })
        .map(|t| ToolResultRecord {
            request_id: ctx.journal_id.clone(),
            at_ms: ctx.at_ms,
            run: ctx.run.clone(),
            tool_call_id: t.tool_call_id.clone(),
            event_call_id: redactor.redact_text(&t.tool_call_id),
            reader: Some(reader.clone()),
            tool_name: t.tool_name.as_deref().map(|n| redactor.redact_text(n)),
            is_error: t.is_error,
            content: Recorded::redacted(
                crate::strict_json::to_text(&t.content).as_bytes(),
                redactor,
                cap,
            ),
        })
        .collect();
    let declared_tools = (!turn.tools.is_empty()).then(|| crate::journal::DeclaredToolsRecord {
        request_id: ctx.journal_id.clone(),
        at_ms: ctx.at_ms,
        run_id: ctx.run.run_id.clone(),
        api: turn.api.as_str(),
        tools: turn
            .tools
            .iter()
            .map(|t| crate::journal::DeclaredSchema {
                name: redactor.redact_text(&t.name),
                schema: t.schema.clone(),
                fingerprint: t.fingerprint,
            })
            .collect(),
        redactor: Arc::clone(&policy.redactor),
    });
    // An untrusted turn of a run makes the run untrusted from now on (§C, sticky).
    let run_untrusted = ctx
        .run
        .run_id
        .as_ref()
        .filter(|_| trust == crate::policy::bundle::ContentTrust::Untrusted)
        .map(|run| crate::journal::RunUntrusted {
            run_id: run.clone(),
            request_id: ctx.journal_id.clone(),
            at_ms: ctx.at_ms,
        });
    let sets_trust_bit = run_untrusted.is_some();
    let unit = crate::journal::BeforeUpstream {
        tool_results,
        declared_tools,
        run_untrusted,
    };
    match state.journal.record_before_upstream(unit).await {
        Ok(()) => {
            // Committed (or already in the journal, its unique key kept the first row).
            seen.remember(keys);
            Ok(())
        }
        Err(e) => {
            let all_rerunnable = turn.tool_results.iter().all(|t| {
                t.tool_name
                    .as_deref()
                    .and_then(|n| policy.catalog.by_name(n))
                    .is_some_and(|tool| tool.rerunnable())
            });
            // The sticky bit unrecorded would let a later turn of the run pass as trusted.
            if all_rerunnable && !sets_trust_bit {
                tracing::error!(error = %e, request_id = %ctx.request_id(), "tool results of re-runnable tools or declared tools not journaled; going on");
                Ok(())
            } else {
                Err(WireError::JournalUnavailable {
                    reason: e.to_string(),
                })
            }
        }
    }
}
