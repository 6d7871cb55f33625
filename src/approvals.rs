//! Approvals: held calls wait for the acting person (tool-turn contract §C; DESIGN.md §4 and
//! §6; OpenWOP interrupt.md, kind `approval`).
//!
//! When a round's withheld calls are all `held` and the bundle surfaces `held` as `wait`
//! (the default), [`settle`] raises one approval interrupt for the round and the agent's
//! response waits:
//!
//! - the interrupt has a deterministic key (run, node, attempt, round, and a digest of the
//!   person and the held calls' `argsHash`es) and is raised at most once per key
//!   (insert-if-absent in the journal, with an `interrupt.requested` event);
//! - it is bound to the acting person, the run/node, each held call's `argsHash`, the policy
//!   revision and an expiry (`timeoutMs` = `approval_timeout_ms`);
//! - it is resolved only through the admin plane ([`routes`]) by a verified bearer token whose
//!   `sub` is the bound person and which carries no `act` claim; nothing in model output or
//!   tool content can resolve it, and there is no link or query-string token;
//! - of concurrent resolutions exactly one wins (compare-and-set in the journal writer); the
//!   other gets 409 `interrupt_already_resolved`;
//! - accept: the round is admitted again with `approved` true for exactly the bound
//!   `argsHash`es (Cedar `context.approved`), once — an approval is single-use, and it is
//!   used only by a request whose agent is still there to receive the calls ([`AgentEnd`]):
//!   a held stream whose agent left stops waiting and leaves the approval to the agent's
//!   re-send, which meets the same interrupt;
//!   reject, timeout, or no person to ask: the held calls are refused (`approval_rejected`);
//!   a timeout never approves.
//! - the resolver names the interrupt it reviewed: `POST /approvals/{interruptId}`, or the
//!   OpenWOP node form `POST /runs/{runId}/interrupts/{nodeId}` with `interruptId` beside
//!   `resumeValue` in the body (without it: 400 `validation_error`). A node can hold more
//!   than one interrupt (another round, a re-sent request with changed arguments), and one
//!   raised after the person looked must never be approved in place of the one they saw —
//!   so the node form never picks "the newest" or "the only pending" one (an interrupt can
//!   expire and another be raised between the person's look and their answer);
//! - the agent's own token never resolves: a token presented as `Turnguard-Principal-Token`
//!   is journaled by what it says ([`crate::identity::TokenId`]) before its request goes on,
//!   and the resolution's compare-and-set refuses it (403), after a restart too.
//!
//! - edit before approve (OpenWOP `edit-accept`, tools with `approval_edit`): the person's
//!   arguments are redacted, journaled beside the model's (`interrupts.edits`, with who
//!   edited) and bound by their own `argsHash`; the waiting request admits the round again
//!   with them from the arguments stage on, and releases the call with them
//!   (`release_args`) or refuses it (`edit_refused`) — see [`edited_outcomes`];
//! - every interrupt raised or resolved is handed to the
//!   [`crate::approval_ui::Notifier`] (SSE and webhook), which never waits.
//!
//! With no verified person (no `Turnguard-Principal-Token`) the agent acts and nobody can
//! approve: the interrupt is journaled and resolved rejected at once (`no_approver`) rather
//! than holding the agent for the whole timeout.

use crate::strict_json::Lookup as _;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http::{header, HeaderValue, Request, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::admission::sanitize_label;
use crate::body::read_capped;
use crate::clock::now_ms;
use crate::identity::{Person, TokenError};
use crate::journal::{
    InterruptRecord, InterruptRow, InterruptState, Resolution, Resolved, Selector,
};
use crate::metrics::{ApprovalLabels, ApprovalResult};
use crate::model::{ChoiceEmissions, ChoiceVerdict, Outcome};
pub use crate::notify::served;
use crate::request::Session;
use crate::state::AppState;
pub use crate::state::Approvals;

/// The agent's end of a held round: whether the agent is still there to receive the calls an
/// approval releases. An approval is used (single-use) only while it is.
pub trait AgentEnd: Sync {
    /// Resolves once the agent has gone.
    fn gone(&self) -> impl std::future::Future<Output = ()> + Send;
    /// The agent has gone.
    fn is_gone(&self) -> bool;
}

/// A non-stream request: its answer leaves with its handler, and when the agent goes the
/// handler — this wait with it — is dropped, so it is never seen gone while it runs.
pub struct InRequest;

impl AgentEnd for InRequest {
    fn gone(&self) -> impl std::future::Future<Output = ()> + Send {
        std::future::pending()
    }
    fn is_gone(&self) -> bool {
        false
    }
}

/// A stream relay's channel to the agent's response body: closed once the agent's
/// connection is gone (the body, and its receiver, are dropped).
impl<T: Send> AgentEnd for tokio::sync::mpsc::Sender<T> {
    fn gone(&self) -> impl std::future::Future<Output = ()> + Send {
        self.closed()
    }
    fn is_gone(&self) -> bool {
        self.is_closed()
    }
}

/// How held calls stand when a round is decided (tool-turn contract §C).
#[derive(Debug, Clone, Copy)]
pub enum Approval<'a> {
    /// No approval in hand: held calls are held.
    Pending,
    /// The acting person approved exactly these calls (once); the calls they edited
    /// (`edit-accept`) carry the edited arguments in the round being decided and are released
    /// with them, or refused when the edit is not admitted.
    Accepted(&'a BTreeSet<BoundCall>, &'a [Edited]),
    /// No approval was given: held calls are refused with this reason and explanation.
    Refused(crate::reason::Reason, &'a str),
}

/// Largest resolution body accepted, bytes.
const MAX_RESOLVE_BODY: usize = 64 << 10;
/// Longest `feedback` kept, characters.
const MAX_FEEDBACK_CHARS: usize = 4000;

/// A call an accepted approval covers: its choice, its position in the choice, and the
/// `argsHash` the person approved (the edited arguments' for an `edit-accept`). A call is
/// approved only at its place with its hash: the same arguments elsewhere in a round, or a
/// second call with them, are not ([`Approval::Accepted`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct BoundCall {
    pub choice: u32,
    pub index: usize,
    pub args_hash: String,
}

/// A held call as the interrupt key binds it.
struct KeyedCall<'r> {
    choice: u32,
    index: usize,
    /// The tool name as the model sent it (the interrupt shows a sanitized label).
    name: &'r str,
    args_hash: &'r str,
    /// The arguments held a secret, so `argsHash` (taken over the redacted form) does not
    /// tell two values of it apart.
    secrets: bool,
}

/// The deterministic interrupt key: `<run>:<node>:<attempt>:<round>:<digest>` (chat turns:
/// `chat:<journal-id>:<round>:<digest>`, turnguard's own id of the request), where the digest
/// covers the person and the held calls in order — each call's choice, position, exact tool
/// name and `argsHash` — so a re-sent request that holds the same calls meets the same
/// interrupt, and another tool, another argument or one more call makes a new one. When a
/// held call's arguments held a secret, its `argsHash` (taken over the redacted form) cannot
/// tell a changed secret apart, so the digest covers the request too (turnguard's journal
/// id): the approval is good for the request that showed the call, and a re-send asks again.
/// Over 256 characters, `sha256:<hex>` of it.
fn interrupt_key(
    session: &Session,
    round: u32,
    person: Option<&str>,
    calls: &[KeyedCall<'_>],
) -> String {
    // Each field length-prefixed: no field's bytes can stand for another's.
    fn field(h: &mut Sha256, bytes: &[u8]) {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    let mut h = Sha256::new();
    field(&mut h, person.unwrap_or("").as_bytes());
    for c in calls {
        field(&mut h, &c.choice.to_le_bytes());
        field(&mut h, &(c.index as u64).to_le_bytes());
        field(&mut h, c.name.as_bytes());
        field(&mut h, c.args_hash.as_bytes());
    }
    if calls.iter().any(|c| c.secrets) {
        field(&mut h, session.ctx.journal_id.as_bytes());
    }
    let digest = hex::encode(h.finalize());
    let run = &session.ctx.run;
    let key = match &run.run_id {
        Some(run_id) => format!(
            "{run_id}:{}:{}:{round}:{}",
            run.node_id.as_deref().unwrap_or("default"),
            run.attempt.unwrap_or(1),
            &digest[..16]
        ),
        None => format!("chat:{}:{round}:{}", session.ctx.journal_id, &digest[..16]),
    };
    if key.len() > 256 {
        format!("sha256:{}", hex::encode(Sha256::digest(key.as_bytes())))
    } else {
        key
    }
}

/// `int_` + 32 hex digits of SHA-256 of the key.
pub fn interrupt_id(key: &str) -> String {
    format!("int_{}", &hex::encode(Sha256::digest(key.as_bytes()))[..32])
}

/// The held calls of the waiting choices, as the interrupt binds them: per call its choice
/// and position, id, tool name, `toolId` and title, `argsHash`, redacted arguments, why it
/// was held, and whether the person may edit it (`approval_edit`; never when the adapter
/// cannot rewrite the answer's arguments, [`crate::model::Turn::arguments_fixed`]: a
/// Responses stream).
fn held_calls<'r>(
    session: &Session,
    round: &'r [ChoiceEmissions],
    verdicts: &'r [ChoiceVerdict],
) -> Vec<(Value, KeyedCall<'r>)> {
    let rewritable = !session.turn.arguments_fixed;
    let mut calls = Vec::new();
    for (choice, verdict) in round.iter().zip(verdicts) {
        if !verdict.waiting() {
            continue;
        }
        for (index, (call, d)) in choice.calls.iter().zip(&verdict.decisions).enumerate() {
            if d.outcome != Outcome::Held || !d.enforced {
                continue;
            }
            let tool = session.policy.tool(&call.name);
            let mut held = json!({
                "choice": choice.choice,
                "index": index,
                "callId": sanitize_label(&call.id),
                "toolName": d.tool_name,
                "toolId": d.tool_id,
                "argsHash": d.args_hash,
                "arguments": d.redacted_args,
                "heldBecause": {"stage": d.stage.as_str(), "reason": d.reason, "message": d.message},
                "editable": tool.approval_edit && tool.catalogued && rewritable,
            });
            if let Some(t) = &tool.descriptor.title {
                if let Some(o) = held.as_object_mut() {
                    o.insert("toolTitle".into(), json!(t));
                }
            }
            if choice.provider_output {
                if let Some(o) = held.as_object_mut() {
                    o.insert("providerOutput".into(), json!(true));
                }
            }
            let keyed = KeyedCall {
                choice: choice.choice,
                index,
                name: &call.name,
                args_hash: d.args_hash.as_deref().unwrap_or_default(),
                secrets: d.secrets > 0,
            };
            calls.push((held, keyed));
        }
    }
    calls
}

/// A call the person edited before approving (OpenWOP `edit-accept`), as the waiting request
/// applies it: the round is admitted again with these arguments in place of the model's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edited {
    /// The choice of the call.
    pub choice: u32,
    /// Its position in the choice's calls.
    pub index: usize,
    /// The person's arguments, redacted, as JSON text: what the agent receives when they are
    /// admitted.
    pub arguments: String,
    /// `argsHash` of the edited arguments: the hash the approval binds.
    pub args_hash: String,
}

/// The edited calls an accepted interrupt carries (`interrupts.edits`).
fn edits_of(row: &InterruptRow) -> Vec<Edited> {
    row.edits
        .as_ref()
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            Some(Edited {
                choice: u32::try_from(e.get("choice")?.as_u64()?).ok()?,
                index: usize::try_from(e.get("index")?.as_u64()?).ok()?,
                arguments: e.get("arguments").filter(|a| a.is_object())?.to_string(),
                args_hash: e.get("argsHash")?.as_str()?.to_owned(),
            })
        })
        .collect()
}

/// The round with the person's edited arguments in place of the model's.
fn with_edits(round: &[ChoiceEmissions], edits: &[Edited]) -> Vec<ChoiceEmissions> {
    let mut round = round.to_vec();
    for e in edits {
        if let Some(call) = round
            .iter_mut()
            .find(|c| c.choice == e.choice)
            .and_then(|c| c.calls.get_mut(e.index))
        {
            call.arguments.clone_from(&e.arguments);
        }
    }
    round
}

/// After an `edit-accept`: an edited call that admission released again goes to the agent
/// with the person's arguments (`release_args`, which every adapter applies); one that did
/// not pass — schema, authorization, limits, redaction — is refused (`edit_refused`), never
/// sent back to the model for repair (the model did not write it). On a Responses stream the
/// arguments cannot be rewritten: refused (`edit_unsupported`).
pub fn edited_outcomes(
    turn: &crate::model::Turn,
    choice: &ChoiceEmissions,
    decisions: &mut [crate::model::Decision],
    edits: &[Edited],
) {
    for e in edits.iter().filter(|e| e.choice == choice.choice) {
        let Some(d) = decisions.get_mut(e.index) else {
            continue;
        };
        if d.outcome == Outcome::Executed && d.enforced {
            if turn.arguments_fixed {
                d.outcome = Outcome::Refused;
                d.reason = crate::reason::Reason::EditUnsupported;
                d.message = "the person edited the arguments, and this answer cannot carry edited arguments (a Responses stream; fail closed)".into();
                d.trace.push((d.stage, format!("refused: {}", d.reason)));
            } else {
                d.release_args = Some(e.arguments.clone());
                d.trace.push((
                    d.stage,
                    "released with the person's edited arguments".into(),
                ));
            }
        } else if d.enforced && !matches!(d.outcome, Outcome::EndedTurn | Outcome::SuppressedRepeat)
        {
            let why = format!(
                "the person's edited arguments were not admitted: {} at the {} stage ({}): {}",
                d.outcome.as_str(),
                d.stage.as_str(),
                d.reason,
                d.message
            );
            d.outcome = Outcome::Refused;
            d.reason = crate::reason::Reason::EditRefused;
            d.trace
                .push((d.stage, format!("refused: edit_refused — {why}")));
            d.message = why;
        }
    }
}

/// How a held round's approval interrupt ended. The request path admits the round again with
/// it (`Session::admit`, in the request path); this module never decides a round itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Accepted and used by this request: exactly these calls are approved (once), with the
    /// calls the person edited (`edit-accept`) carrying the edited arguments.
    Accepted(BTreeSet<BoundCall>, Vec<Edited>),
    /// Not approved: held calls are refused with this reason (one that
    /// [`crate::reason::Reason::is_approval_refusal`]) and explanation.
    Refused(crate::reason::Reason, String),
}

impl Settled {
    /// The round to decide again: the model's, with the person's edited arguments in place
    /// of the model's for the calls they edited.
    pub fn round<'r>(
        &self,
        round: &'r [ChoiceEmissions],
    ) -> std::borrow::Cow<'r, [ChoiceEmissions]> {
        match self {
            Self::Accepted(_, edits) if !edits.is_empty() => {
                std::borrow::Cow::Owned(with_edits(round, edits))
            }
            _ => std::borrow::Cow::Borrowed(round),
        }
    }

    /// As the [`Approval`] the round is decided again with.
    pub fn approval(&self) -> Approval<'_> {
        match self {
            Self::Accepted(hashes, edits) => Approval::Accepted(hashes, edits),
            Self::Refused(reason, why) => Approval::Refused(*reason, why),
        }
    }
}

/// Resolves a round whose held calls wait: raises (or meets again) the approval interrupt,
/// waits for its resolution or expiry, and says how it ended — approved for exactly the
/// bound `argsHash`es, or with the held calls refused (the caller decides the round again). While `agent` is gone nothing is used:
/// the wait ends, the interrupt stays as it is (pending, or accepted and unused) for the
/// agent's re-send, and the held calls are refused for this request (`agent_gone`).
pub async fn settle(
    session: &Session,
    round: &[ChoiceEmissions],
    verdicts: &[ChoiceVerdict],
    agent: &impl AgentEnd,
) -> Settled {
    let state = &session.state;
    let redactor = &session.policy.redactor;
    let (calls, keyed): (Vec<Value>, Vec<KeyedCall<'_>>) = held_calls(session, round, verdicts)
        .into_iter()
        .map(|(mut c, k)| {
            redactor.redact_in_place("", &mut c);
            (c, k)
        })
        .unzip();
    let person = session.person.as_deref();
    let round_index = session.turn.round_index + session.rounds.saturating_sub(1);
    let key = interrupt_key(session, round_index, person, &keyed);
    let id = interrupt_id(&key);
    let now = now_ms();
    let timeout_ms = state.config.approval_timeout_ms;
    let names: Vec<String> = calls
        .iter()
        .filter_map(|c| c.get("toolName").and_then(Value::as_str).map(str::to_owned))
        .collect();
    let rec = interrupt_record(session, calls, &names, &key, &id, now, timeout_ms);
    let waiter = state.approvals.subscribe(&id);
    let row = match state.journal.raise_interrupt(rec).await {
        Ok(row) => row,
        Err(e) => {
            tracing::error!(error = %e, interrupt = %id, "approval interrupt not journaled; held calls refused");
            return Settled::Refused(crate::reason::Reason::ApprovalUnavailable, "the approval interrupt could not be journaled, so the call cannot wait for approval (fail closed)".into());
        }
    };
    if row.inserted {
        state.notifier.requested(&row);
        count(state, ApprovalResult::Held);
        tracing::info!(interrupt = %id, request_id = %session.ctx.request_id(), run = ?session.ctx.run.run_id, tools = %names.join(","), person = person.is_some(), "tool calls held for approval");
    }
    let final_state = match (row.state, &row.record.principal) {
        (InterruptState::Pending, None) => {
            resolve_as_host(state, &id, InterruptState::Rejected, "no_approver").await
        }
        (InterruptState::Pending, Some(_)) => match waiter {
            Some(w) => match wait(state, w, &row, agent).await {
                Some(s) => s,
                None => return agent_gone(session, &id),
            },
            None => resolve_as_host(state, &id, InterruptState::Expired, "timeout").await,
        },
        (s, _) => s,
    };
    match final_state {
        // Used only by a request whose agent is there to receive the calls.
        InterruptState::Accepted if agent.is_gone() => agent_gone(session, &id),
        InterruptState::Accepted => {
            // The resolution as committed (the raise saw it pending), read before the
            // approval is used: its edits, if any.
            let resolved = if row.state == InterruptState::Accepted {
                Ok(Some(row.clone()))
            } else {
                state.journal.interrupt(&id).await
            };
            let Ok(Some(resolved)) = resolved else {
                tracing::error!(interrupt = %id, "the accepted interrupt could not be read back; held calls refused");
                return Settled::Refused(
                    crate::reason::Reason::ApprovalUnavailable,
                    "the accepted approval could not be read back from the journal (fail closed)"
                        .into(),
                );
            };
            use_approval(session, &id, &resolved).await
        }
        InterruptState::Rejected if row.record.principal.is_none() => {
            Settled::Refused(crate::reason::Reason::NoApprover, "no verified person acts for this request (no Turnguard-Principal-Token), so nobody can approve the held call".into())
        }
        InterruptState::Rejected => {
            Settled::Refused(crate::reason::Reason::ApprovalRejected, "the acting person rejected the held call".into())
        }
        // Expired, or (cannot happen: the host's resolution never leaves it) still pending:
        // a timeout never approves.
        InterruptState::Expired | InterruptState::Pending => {
            let why = format!(
                "no approval arrived within {timeout_ms} ms; a timeout never approves"
            );
            Settled::Refused(crate::reason::Reason::ApprovalExpired, why)
        }
    }
}

/// The approval interrupt of a held round, as journaled: the OpenWOP `approval` payload
/// (title, actions — `edit-accept` when a call is editable — the calls by name, id and
/// `argsHash`, the policy revision, run and node, why the turn was untrusted, and the bound
/// person as `approversList`), redacted, with its expiry.
fn interrupt_record(
    session: &Session,
    calls: Vec<Value>,
    names: &[String],
    key: &str,
    id: &str,
    now: i64,
    timeout_ms: u64,
) -> InterruptRecord {
    let redactor = &session.policy.redactor;
    let person = session.person.as_deref();
    let mut title = format!("Approve {}", names.join(", "));
    title.truncate(200);
    let mut actions = vec!["accept", "reject"];
    if calls
        .iter()
        .any(|c| c.get("editable") == Some(&Value::Bool(true)))
    {
        actions.push("edit-accept");
    }
    let mut untrusted = session.untrusted_inputs.clone();
    if calls.iter().any(|c| c.get("providerOutput").is_some())
        && !untrusted.contains(&crate::admission::trust::UntrustedInput::ProviderOutput)
    {
        untrusted.push(crate::admission::trust::UntrustedInput::ProviderOutput);
    }
    let mut data = json!({
        "artifactId": id,
        "artifactType": "turnguard.tool-calls",
        "title": title,
        "description": "The model called tools in a turn that read untrusted content, or that policy holds for approval. They run only if you accept.",
        "actions": actions,
        "onTimeout": "reject",
        "artifactData": {
            "calls": calls.iter().map(|c| json!({"toolName": c.get("toolName"), "toolId": c.get("toolId"), "argsHash": c.get("argsHash")})).collect::<Vec<_>>(),
            "policyRevision": session.policy.revision,
            "runId": session.ctx.run.run_id,
            "nodeId": session.ctx.run.node_id,
            "untrustedInputs": untrusted,
        },
    });
    if let Some(p) = person {
        if let Some(o) = data.as_object_mut() {
            o.insert("approversList".into(), json!([p]));
        }
    }
    InterruptRecord {
        interrupt_id: id.to_owned(),
        key: key.to_owned(),
        kind: "approval",
        run: session.ctx.run.clone(),
        request_id: session.ctx.journal_id.clone(),
        principal: person.map(str::to_owned),
        policy_revision: session.policy.revision.clone(),
        payload: {
            let mut payload =
                json!({"kind": "approval", "key": key, "data": data, "timeoutMs": timeout_ms});
            redactor.redact_in_place("", &mut payload);
            payload
        },
        calls: Value::Array(calls),
        requested_at_ms: now,
        expires_at_ms: now.saturating_add(timeout_ms as i64),
    }
}

/// Uses an accepted approval (single use): approved for exactly the bound `argsHash`es, with
/// the person's edited arguments in place of the model's ([`Settled::round`]).
async fn use_approval(session: &Session, id: &str, resolved: &InterruptRow) -> Settled {
    match session
        .state
        .journal
        .consume_approval(id, &session.ctx.journal_id)
        .await
    {
        Ok(true) => Settled::Accepted(bound_calls(resolved), edits_of(resolved)),
        Ok(false) => Settled::Refused(
            crate::reason::Reason::ApprovalAlreadyUsed,
            "this approval was already used by another request; an approval is single-use".into(),
        ),
        Err(e) => {
            tracing::error!(error = %e, interrupt = %id, "approval could not be marked used; held calls refused");
            Settled::Refused(
                crate::reason::Reason::ApprovalUnavailable,
                "the approval could not be recorded as used (fail closed)".into(),
            )
        }
    }
}

/// The agent left while its held round waited: nothing is used, the held calls are refused for
/// this request only (the interrupt is left for the agent's re-send).
fn agent_gone(session: &Session, id: &str) -> Settled {
    tracing::info!(interrupt = %id, request_id = %session.ctx.request_id(), "the agent left while its held calls waited; the approval is left for its re-send");
    Settled::Refused(crate::reason::Reason::AgentGone, "the agent left before the held call(s) could be delivered; an approval is used only by a request that receives its calls".into())
}

/// The calls an interrupt binds, each at its place: each held call's `argsHash`, or for a
/// call the person edited (`edit-accept`), the edited arguments' — the model's arguments are
/// then not approved. A stored call without its place binds nothing.
fn bound_calls(row: &InterruptRow) -> BTreeSet<BoundCall> {
    let edits = edits_of(row);
    row.record
        .calls
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let choice = u32::try_from(c.get("choice").and_then(Value::as_u64)?).ok()?;
            let index = usize::try_from(c.get("index").and_then(Value::as_u64)?).ok()?;
            let edited = edits
                .iter()
                .find(|e| (e.choice, e.index) == (choice, index));
            let args_hash = match edited {
                Some(e) => e.args_hash.clone(),
                None => c.get("argsHash").and_then(Value::as_str)?.to_owned(),
            };
            Some(BoundCall {
                choice,
                index,
                args_hash,
            })
        })
        .collect()
}

/// Waits for a resolution until the interrupt's expiry; then resolves it `expired` unless a
/// resolution won first. Returns the final state; `None` when the agent went away first (the
/// interrupt is left as it stands).
async fn wait(
    state: &AppState,
    mut waiter: crate::state::Waiter<'_>,
    row: &InterruptRow,
    agent: &impl AgentEnd,
) -> Option<InterruptState> {
    let gone = agent.gone();
    tokio::pin!(gone);
    // A resolution on another replica sharing the journal (PostgreSQL: LISTEN/NOTIFY, else
    // polling); never completes on SQLite, where this process is the only one.
    let elsewhere = state.journal.resolved_elsewhere(&row.record.interrupt_id);
    tokio::pin!(elsewhere);
    loop {
        if let Some(s) = *waiter.rx.borrow_and_update() {
            return Some(s);
        }
        let left = row.record.expires_at_ms.saturating_sub(now_ms());
        if left <= 0 {
            break;
        }
        tokio::select! {
            changed = tokio::time::timeout(Duration::from_millis(left as u64), waiter.rx.changed()) => match changed {
                Ok(Ok(())) => continue,
                Ok(Err(_)) | Err(_) => break,
            },
            s = &mut elsewhere => return Some(s),
            () = &mut gone => return None,
        }
    }
    Some(
        resolve_as_host(
            state,
            &row.record.interrupt_id,
            InterruptState::Expired,
            "timeout",
        )
        .await,
    )
}

/// The host resolves an interrupt (timeout, or nobody can approve). A resolution that won
/// first stands. Returns the final state; `expired` when the journal cannot answer.
async fn resolve_as_host(
    state: &AppState,
    id: &str,
    to: InterruptState,
    reason: &str,
) -> InterruptState {
    let now = now_ms();
    let r = Resolution {
        selector: Selector::Id(id.to_owned()),
        by: None,
        by_token: None,
        state: to,
        resume_value: json!({"action": "reject", "decision": "rejected", "reason": reason, "decidedAt": now}),
        edits: None,
        now_ms: now,
    };
    match state.journal.resolve_interrupt(r).await {
        Ok(Resolved::Won(row)) => {
            observe(
                state,
                &row,
                if to == InterruptState::Expired {
                    ApprovalResult::Expired
                } else {
                    ApprovalResult::Rejected
                },
            );
            state.approvals.notify(id, row.state);
            state.notifier.resolved(&row);
            tracing::info!(interrupt = %id, state = %row.state, reason, "approval interrupt resolved by the host");
            row.state
        }
        Ok(Resolved::AlreadyResolved(row) | Resolved::Expired(row) | Resolved::Forbidden(row)) => {
            row.state
        }
        Ok(Resolved::NotFound | Resolved::HeldByAgent) => InterruptState::Expired,
        Err(e) => {
            tracing::error!(error = %e, interrupt = %id, "approval interrupt resolution not journaled; held calls refused");
            InterruptState::Expired
        }
    }
}

fn count(state: &AppState, result: ApprovalResult) {
    state
        .metrics
        .approvals
        .get_or_create(&ApprovalLabels { result })
        .inc();
}

/// Counts a resolution and observes how long the interrupt waited.
fn observe(state: &AppState, row: &InterruptRow, result: ApprovalResult) {
    count(state, result);
    let waited = row
        .resolved_at_ms
        .unwrap_or_else(now_ms)
        .saturating_sub(row.record.requested_at_ms)
        .max(0);
    state
        .metrics
        .approval_wait
        .get_or_create(&ApprovalLabels { result })
        .observe(waited as f64 / 1000.0);
}

// ---- admin plane -------------------------------------------------------------------------

/// The approval routes of the admin plane: `GET /approvals`, `POST /approvals/{interruptId}`,
/// `POST /runs/{runId}/interrupts/{nodeId}` (OpenWOP form).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/approvals", get(list))
        .route("/approvals/{interrupt_id}", post(resolve_by_id))
        .route("/runs/{run_id}/interrupts/{node_id}", post(resolve_by_node))
}

fn error(status: StatusCode, code: &str, message: &str, details: Option<Value>) -> Response {
    let mut body = json!({"error": code, "message": message});
    if let Some(d) = details {
        if let Some(o) = body.as_object_mut() {
            o.insert("details".into(), d);
        }
    }
    let mut resp = (status, body.to_string()).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if status == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    resp
}

fn held_by_agent() -> Box<Response> {
    tracing::warn!("approval attempt with the agent's own principal token refused");
    Box::new(error(
        StatusCode::FORBIDDEN,
        "forbidden",
        &TokenError::HeldByAgent.to_string(),
        None,
    ))
}

/// The verified approver of an admin-plane request ([`approver`]; for the other admin
/// routes that serve a person, `GET /approvals/events`): the error is the response to send.
pub(crate) async fn verified_approver(
    state: &AppState,
    req: &http::request::Parts,
) -> Result<Person, Response> {
    approver(state, req).await.map_err(|r| *r)
}

/// The verified approver of an admin request: bearer token only (no query string, no link),
/// no delegation, never a token presented on the data plane (this process's memory, then the
/// journal: after a restart too).
async fn approver(state: &AppState, req: &http::request::Parts) -> Result<Person, Box<Response>> {
    if req.uri.query().is_some() {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "validation_error",
            "approval endpoints take no query string: credentials go only in the Authorization header",
            None,
        )));
    }
    let person = state.identity.approver_of(&req.headers).map_err(|e| {
        if matches!(e, TokenError::HeldByAgent) {
            return held_by_agent();
        }
        let message = match e {
            TokenError::Missing => e.to_string(),
            _ => format!("not authenticated: {e}"),
        };
        Box::new(error(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            &message,
            None,
        ))
    })?;
    if let Some(t) = &person.token {
        let seen = state.reader.token_seen(&t.fingerprint).await;
        match seen {
            Ok(false) => {}
            Ok(true) => return Err(held_by_agent()),
            Err(e) => {
                return Err(Box::new(error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "turnguard.journal_unavailable",
                    &format!("the journal could not check the token: {e}"),
                    None,
                )))
            }
        }
    }
    if person.delegated {
        tracing::warn!(sub = %person.sub, "approval attempt with a delegated (act) token refused");
        return Err(Box::new(error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "a delegated token (with an `act` claim) cannot resolve an approval: the acting person must",
            None,
        )));
    }
    Ok(person)
}

/// `GET /approvals`: the pending, unexpired interrupts bound to the caller, with the held
/// calls' tool names, redacted arguments and why each was held.
async fn list(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    let (parts, _) = req.into_parts();
    let person = match approver(&s, &parts).await {
        Ok(p) => p,
        Err(resp) => return *resp,
    };
    match s.journal.pending_interrupts(&person.sub, now_ms()).await {
        Ok(rows) => {
            let list: Vec<Value> = rows.iter().map(served).collect();
            axum::Json(json!({ "approvals": list })).into_response()
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "turnguard.journal_unavailable",
            &format!("the journal could not answer: {e}"),
            None,
        ),
    }
}

/// `{resumeValue: {action: "accept" | "reject" | "edit-accept", feedback?,
/// editedArtifactData?}, interruptId?}` (OpenWOP `ApprovalResume`, plus the interrupt the
/// person reviewed: required by the node form).
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ResolveBody {
    resume_value: ResumeValue,
    #[serde(default)]
    interrupt_id: Option<String>,
}

/// Which interrupt a resolution's path names before the body is read.
enum Target {
    Id(String),
    Node { run_id: String, node_id: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ResumeValue {
    action: String,
    #[serde(default)]
    feedback: Option<String>,
    /// `edit-accept` only: the calls the person changed.
    #[serde(default)]
    edited_artifact_data: Option<EditedArtifactData>,
    /// Accepted and ignored: turnguard stamps its own time.
    #[serde(default)]
    #[allow(dead_code)]
    decided_at: Option<Value>,
    /// Accepted and ignored: the verified `sub` is recorded.
    #[serde(default)]
    #[allow(dead_code)]
    decided_by: Option<Value>,
}

/// OpenWOP `editedArtifactData` of a `turnguard.tool-calls` artifact: `{calls: [{callId,
/// arguments}]}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EditedArtifactData {
    /// The edited calls.
    pub calls: Vec<EditedCall>,
}

/// One call the person edited: the held call's `callId` and the whole new arguments object.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EditedCall {
    /// `callId` of a held call of the interrupt.
    pub call_id: String,
    /// The arguments the call is to run with (a JSON object).
    pub arguments: Value,
}

/// The person's answer to an approval interrupt (OpenWOP approval actions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Accept,
    Reject,
    /// Accept with edited arguments (`approval_edit` tools only).
    EditAccept,
}

impl Action {
    /// Parses an OpenWOP approval action; `None` for any other word.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "accept" => Some(Self::Accept),
            "reject" => Some(Self::Reject),
            "edit-accept" => Some(Self::EditAccept),
            _ => None,
        }
    }
    /// The OpenWOP spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accept => "accept",
            Self::Reject => "reject",
            Self::EditAccept => "edit-accept",
        }
    }
}

/// What a person answers: the action, optional feedback, and for `edit-accept` the edited
/// calls.
#[derive(Debug, Clone)]
pub struct Answer {
    pub action: Action,
    pub feedback: Option<String>,
    pub edits: Vec<EditedCall>,
}

/// Why a resolution was not taken: an OpenWOP error (status, code, message, details).
#[derive(Debug, Clone)]
pub struct Refusal {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub details: Option<Value>,
}

impl Refusal {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            details: None,
        }
    }
    fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "validation_error", message)
    }
    /// The admin-plane error envelope.
    pub fn response(&self) -> Response {
        error(self.status, self.code, &self.message, self.details.clone())
    }
}

/// Largest edited arguments object accepted, bytes (serialized).
const MAX_EDIT_BYTES: usize = 32 << 10;

async fn resolve_by_id(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    req: Request<Body>,
) -> Response {
    resolve(s, Target::Id(id), req).await
}

async fn resolve_by_node(
    State(s): State<Arc<AppState>>,
    Path((run_id, node_id)): Path<(String, String)>,
    req: Request<Body>,
) -> Response {
    resolve(s, Target::Node { run_id, node_id }, req).await
}

async fn resolve(s: Arc<AppState>, target: Target, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let person = match approver(&s, &parts).await {
        Ok(p) => p,
        Err(resp) => return *resp,
    };
    let bad = |m: String| error(StatusCode::BAD_REQUEST, "validation_error", &m, None);
    let raw = match read_capped(body, MAX_RESOLVE_BODY).await {
        Ok(b) => b,
        Err(e) => return bad(format!("body: {e}")),
    };
    let de = &mut serde_json::Deserializer::from_slice(&raw);
    let parsed: ResolveBody = match serde_path_to_error::deserialize(de) {
        Ok(b) => b,
        Err(e) => {
            return bad(format!(
                "expected {{\"resumeValue\": {{\"action\": \"accept\" | \"reject\" | \"edit-accept\", \"feedback\"?: string, \"editedArtifactData\"?: {{\"calls\": [{{\"callId\", \"arguments\"}}]}}}}}}; at `{}`: {}",
                e.path(),
                e.inner()
            ))
        }
    };
    let selector = match (target, parsed.interrupt_id) {
        (Target::Id(id), None) => Selector::Id(id),
        (Target::Id(id), Some(named)) if named == id => Selector::Id(id),
        (Target::Id(_), Some(_)) => {
            return bad("`interruptId` in the body names another interrupt than the path".into())
        }
        (Target::Node { .. }, None) => {
            return bad("the node form resolves exactly the interrupt the person reviewed: send its `interruptId` (from GET /approvals) beside `resumeValue`; a node can hold more than one interrupt, and one raised after the person looked is never resolved in its place".into())
        }
        (Target::Node { run_id, node_id }, Some(interrupt_id)) => Selector::Node {
            run_id,
            node_id,
            interrupt_id,
        },
    };
    let Some(action) = Action::parse(&parsed.resume_value.action) else {
        return bad(format!(
            "action `{}` is not one of this interrupt's actions (accept, reject, edit-accept where offered)",
            sanitize_label(&parsed.resume_value.action)
        ));
    };
    let edits = parsed
        .resume_value
        .edited_artifact_data
        .map(|d| d.calls)
        .unwrap_or_default();
    if action != Action::EditAccept && !edits.is_empty() {
        return bad("`editedArtifactData` goes only with the action `edit-accept`".into());
    }
    let answer = Answer {
        action,
        feedback: parsed.resume_value.feedback,
        edits,
    };
    match resolve_as(&s, &person, selector, answer).await {
        Ok(row) => axum::Json(json!({
            "interruptId": row.record.interrupt_id,
            "state": row.state,
            "resolvedAt": row.resolved_at_ms,
            "resolvedBy": row.resolved_by,
            "edited": row.edits.as_ref().and_then(Value::as_array).map_or(0, Vec::len),
        }))
        .into_response(),
        Err(r) => r.response(),
    }
}

/// Resolves the interrupt `selector` names as `person` (verified by the caller: a bearer
/// token on the admin plane, or the approval page's session), by compare-and-set in the
/// journal: the bound person only, never a token the agent presented, exactly one winner.
/// For `edit-accept` the edited calls are checked first (a held call of this interrupt,
/// once each, its tool allows edits, a JSON object of at most 32 KiB), redacted, and bound
/// by their new `argsHash`; admission runs on them again in the waiting request.
///
/// Errors: [`Refusal`] — 400 `validation_error`, 403 `forbidden`, 404 `not_found`, 409
/// `interrupt_already_resolved`, 503 `turnguard.journal_unavailable`.
pub async fn resolve_as(
    s: &AppState,
    person: &Person,
    selector: Selector,
    answer: Answer,
) -> Result<Box<InterruptRow>, Refusal> {
    let now = now_ms();
    let mut action = answer.action;
    let edits = if action == Action::EditAccept {
        let edits = edited_calls(s, person, &selector, &answer.edits, now).await?;
        if edits.is_empty() {
            // Nothing changed: a plain accept.
            action = Action::Accept;
            None
        } else {
            Some(edits)
        }
    } else {
        None
    };
    let mut value = json!({"action": action.as_str(), "decidedAt": now, "decidedBy": person.sub});
    if let Some(f) = answer.feedback.filter(|f| !f.trim().is_empty()) {
        if let Some(o) = value.as_object_mut() {
            o.insert(
                "feedback".into(),
                json!(f.chars().take(MAX_FEEDBACK_CHARS).collect::<String>()),
            );
        }
    }
    if let Some(e) = &edits {
        // The event and the resume value name the edited calls, never their arguments.
        let calls: Vec<Value> = e
            .iter()
            .map(|c| json!({"callId": c.get("callId"), "argsHash": c.get("argsHash")}))
            .collect();
        if let Some(o) = value.as_object_mut() {
            o.insert("editedArtifactData".into(), json!({ "calls": calls }));
        }
    }
    let r = Resolution {
        selector,
        by: Some(person.sub.clone()),
        by_token: person.token.as_ref().map(|t| t.fingerprint.clone()),
        state: if action == Action::Reject {
            InterruptState::Rejected
        } else {
            InterruptState::Accepted
        },
        resume_value: value,
        edits: edits.map(Value::Array),
        now_ms: now,
    };
    match s.journal.resolve_interrupt(r).await {
        Err(e) => Err(Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "turnguard.journal_unavailable",
            format!("the resolution could not be journaled: {e}"),
        )),
        Ok(Resolved::NotFound) => Err(not_found()),
        Ok(Resolved::HeldByAgent) => {
            tracing::warn!("approval attempt with the agent's own principal token refused");
            Err(Refusal::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                TokenError::HeldByAgent.to_string(),
            ))
        }
        Ok(Resolved::Forbidden(row)) => {
            tracing::warn!(interrupt = %row.record.interrupt_id, sub = %person.sub, "approval attempt by a person the interrupt is not bound to refused");
            Err(bound_to_another())
        }
        Ok(Resolved::AlreadyResolved(row)) => Err(already(&row)),
        Ok(Resolved::Expired(row)) => {
            observe(s, &row, ApprovalResult::Expired);
            s.approvals.notify(&row.record.interrupt_id, row.state);
            s.notifier.resolved(&row);
            let mut r = Refusal::new(
                StatusCode::CONFLICT,
                "interrupt_already_resolved",
                "the interrupt expired before this resolution; its calls are refused (a timeout never approves)",
            );
            r.details = Some(json!({"interruptId": row.record.interrupt_id, "state": row.state}));
            Err(r)
        }
        Ok(Resolved::Won(row)) => {
            observe(
                s,
                &row,
                if row.state == InterruptState::Accepted {
                    ApprovalResult::Approved
                } else {
                    ApprovalResult::Rejected
                },
            );
            s.approvals.notify(&row.record.interrupt_id, row.state);
            s.notifier.resolved(&row);
            tracing::info!(interrupt = %row.record.interrupt_id, state = %row.state, sub = %person.sub, edited = row.edits.is_some(), "approval interrupt resolved");
            Ok(row)
        }
    }
}

fn not_found() -> Refusal {
    Refusal::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such interrupt (the node form looks only in its run and node)",
    )
}

fn bound_to_another() -> Refusal {
    Refusal::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        "this interrupt is bound to another person",
    )
}

fn already(row: &InterruptRow) -> Refusal {
    let mut r = Refusal::new(
        StatusCode::CONFLICT,
        "interrupt_already_resolved",
        format!("the interrupt is already {}", row.state),
    );
    r.details = Some(json!({"interruptId": row.record.interrupt_id, "state": row.state}));
    r
}

/// Checks and redacts the person's edited calls of an `edit-accept` against the interrupt as
/// raised (only its bound person learns anything about it). Returns the `interrupts.edits`
/// entries of the calls that changed (their redacted `argsHash` differs from the model's).
async fn edited_calls(
    s: &AppState,
    person: &Person,
    selector: &Selector,
    edits: &[EditedCall],
    now: i64,
) -> Result<Vec<Value>, Refusal> {
    let id = match selector {
        Selector::Id(id)
        | Selector::Node {
            interrupt_id: id, ..
        } => id,
    };
    let row = s.journal.interrupt(id).await.map_err(|e| {
        Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "turnguard.journal_unavailable",
            format!("the journal could not answer: {e}"),
        )
    })?;
    let row = match (row, selector) {
        (None, _) => return Err(not_found()),
        (
            Some(row),
            Selector::Node {
                run_id, node_id, ..
            },
        ) if row.record.run.run_id.as_deref() != Some(run_id.as_str())
            || row.record.run.node_id.as_deref().unwrap_or("default") != node_id =>
        {
            return Err(not_found())
        }
        (Some(row), _) => row,
    };
    if row.record.principal.as_deref() != Some(person.sub.as_str()) {
        return Err(bound_to_another());
    }
    if row.state != InterruptState::Pending {
        return Err(already(&row));
    }
    let offered = row
        .record
        .payload
        .at("/data/actions")
        .and_then(Value::as_array)
        .is_some_and(|a| a.iter().any(|x| x == "edit-accept"));
    if !offered {
        return Err(Refusal::bad(
            "this interrupt does not offer `edit-accept`: none of its tools allows edits (catalog `approval_edit`)",
        ));
    }
    if edits.is_empty() {
        return Err(Refusal::bad(
            "`edit-accept` needs `editedArtifactData.calls`: the calls you changed, each `{callId, arguments}`",
        ));
    }
    let held: Vec<&Value> = row.record.calls.as_array().into_iter().flatten().collect();
    let policy = s.policy.snapshot();
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for e in edits {
        let label = sanitize_label(&e.call_id);
        if !seen.insert(e.call_id.clone()) {
            return Err(Refusal::bad(format!("call `{label}` is edited twice")));
        }
        let matching: Vec<&&Value> = held
            .iter()
            .filter(|c| c.get("callId").and_then(Value::as_str) == Some(e.call_id.as_str()))
            .collect();
        let [call] = matching.as_slice() else {
            return Err(Refusal::bad(format!(
                "`{label}` is not the callId of exactly one held call of this interrupt"
            )));
        };
        let tool = call.get("toolName").and_then(Value::as_str).unwrap_or("");
        if call.get("editable") != Some(&Value::Bool(true)) {
            return Err(Refusal::bad(format!(
                "`{}` does not allow edits before approval (catalog `approval_edit`)",
                sanitize_label(tool)
            )));
        }
        if !e.arguments.is_object() {
            return Err(Refusal::bad(format!(
                "the edited arguments of `{label}` must be a JSON object"
            )));
        }
        if e.arguments.to_string().len() > MAX_EDIT_BYTES {
            return Err(Refusal::bad(format!(
                "the edited arguments of `{label}` are larger than {MAX_EDIT_BYTES} bytes"
            )));
        }
        let tool_id = call.get("toolId").and_then(Value::as_str).unwrap_or("");
        let (redacted, _) = policy.redactor.redact(tool_id, &e.arguments);
        let hash = crate::admission::arguments::args_hash(&redacted);
        let model_hash = call.get("argsHash").and_then(Value::as_str);
        if model_hash == Some(hash.as_str()) {
            continue;
        }
        out.push(json!({
            "callId": e.call_id,
            "choice": call.get("choice"),
            "index": call.get("index"),
            "toolName": tool,
            "toolId": tool_id,
            "arguments": redacted,
            "argsHash": hash,
            "modelArgsHash": model_hash,
            "editedBy": person.sub,
            "editedAt": now,
        }));
    }
    Ok(out)
}
