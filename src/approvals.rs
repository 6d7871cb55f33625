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
//!   `argsHash`es (Cedar `context.approved`), once — an approval is single-use;
//!   reject, timeout, or no person to ask: the held calls are refused (`approval_rejected`);
//!   a timeout never approves.
//!
//! With no verified person (no `Turnguard-Principal-Token`) the agent acts and nobody can
//! approve: the interrupt is journaled and resolved rejected at once (`no_approver`) rather
//! than holding the agent for the whole timeout.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
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
use tokio::sync::watch;

use crate::admission::sanitize_label;
use crate::body::read_capped;
use crate::identity::{Person, TokenError};
use crate::journal::{InterruptRecord, InterruptRow, Resolution, Resolved, Selector};
use crate::metrics::ApprovalLabels;
use crate::model::{ChoiceEmissions, ChoiceVerdict, Outcome};
use crate::proxy::{now_ms, Approval, Session};
use crate::server::AppState;

/// Largest resolution body accepted, bytes.
const MAX_RESOLVE_BODY: usize = 64 << 10;
/// Longest `feedback` kept, characters.
const MAX_FEEDBACK_CHARS: usize = 4000;

/// In-process waiters: the agent requests waiting on each interrupt. The journal decides;
/// this only wakes the waiters early.
#[derive(Default)]
pub struct Approvals {
    waiters: Mutex<HashMap<String, watch::Sender<Option<String>>>>,
}

/// One waiting request's subscription; removes the entry when the last waiter leaves.
struct Waiter<'a> {
    approvals: &'a Approvals,
    id: String,
    rx: watch::Receiver<Option<String>>,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if let Ok(mut map) = self.approvals.waiters.lock() {
            if map.get(&self.id).is_some_and(|tx| tx.receiver_count() <= 1) {
                map.remove(&self.id);
            }
        }
    }
}

impl Approvals {
    fn subscribe(&self, id: &str) -> Option<Waiter<'_>> {
        let mut map = self.waiters.lock().ok()?;
        let rx = map
            .entry(id.to_owned())
            .or_insert_with(|| watch::channel(None).0)
            .subscribe();
        Some(Waiter {
            approvals: self,
            id: id.to_owned(),
            rx,
        })
    }

    /// Wakes the requests waiting on `id` with its final state.
    fn notify(&self, id: &str, state: &str) {
        if let Ok(map) = self.waiters.lock() {
            if let Some(tx) = map.get(id) {
                tx.send_replace(Some(state.to_owned()));
            }
        }
    }

    /// Interrupts with a request waiting in this process.
    pub fn waiting(&self) -> usize {
        self.waiters.lock().map(|m| m.len()).unwrap_or(0)
    }
}

/// The deterministic interrupt key: `<run>:<node>:<attempt>:<round>:<digest>` (chat turns:
/// `chat:<request-id>:<round>:<digest>`), where the digest covers the person and the held
/// calls' `argsHash`es — so a re-sent request meets the same interrupt, and a changed
/// argument makes a new one. Over 256 characters, `sha256:<hex>` of it.
pub fn interrupt_key(
    session: &Session,
    round: u32,
    person: Option<&str>,
    hashes: &BTreeSet<String>,
) -> String {
    let mut h = Sha256::new();
    h.update(person.unwrap_or("").as_bytes());
    h.update([0u8]);
    for x in hashes {
        h.update(x.as_bytes());
        h.update(b",");
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
        None => format!("chat:{}:{round}:{}", session.ctx.request_id, &digest[..16]),
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

/// The held calls of the waiting choices, as the interrupt binds them.
fn held_calls(round: &[ChoiceEmissions], verdicts: &[ChoiceVerdict]) -> Vec<Value> {
    let mut calls = Vec::new();
    for (choice, verdict) in round.iter().zip(verdicts) {
        if !verdict.waiting() {
            continue;
        }
        for (call, d) in choice.calls.iter().zip(&verdict.decisions) {
            if d.outcome != Outcome::Held || !d.enforced {
                continue;
            }
            calls.push(json!({
                "choice": choice.choice,
                "callId": sanitize_label(&call.id),
                "toolName": d.tool_name,
                "toolId": d.tool_id,
                "argsHash": d.args_hash,
                "arguments": d.redacted_args,
                "heldBecause": {"stage": d.stage.as_str(), "reason": d.reason, "message": d.message},
            }));
        }
    }
    calls
}

/// Resolves a round whose held calls wait: raises (or meets again) the approval interrupt,
/// waits for its resolution or expiry, and admits the round again — approved for exactly the
/// bound `argsHash`es, or with the held calls refused.
pub async fn settle(
    session: &Session,
    round: &[ChoiceEmissions],
    verdicts: &[ChoiceVerdict],
) -> Vec<ChoiceVerdict> {
    let state = &session.state;
    let calls = held_calls(round, verdicts);
    let hashes: BTreeSet<String> = calls
        .iter()
        .filter_map(|c| c["argsHash"].as_str().map(str::to_owned))
        .collect();
    let person = session.person.as_deref();
    let round_index = session.turn.round_index + session.rounds.saturating_sub(1);
    let key = interrupt_key(session, round_index, person, &hashes);
    let id = interrupt_id(&key);
    let now = now_ms();
    let timeout_ms = state.config.approval_timeout_ms;
    let names: Vec<String> = calls
        .iter()
        .filter_map(|c| c["toolName"].as_str().map(str::to_owned))
        .collect();
    let mut title = format!("Approve {}", names.join(", "));
    title.truncate(200);
    let mut data = json!({
        "artifactId": id,
        "artifactType": "turnguard.tool-calls",
        "title": title,
        "description": "The model called tools in a turn that read untrusted content, or that policy holds for approval. They run only if you accept.",
        "actions": ["accept", "reject"],
        "onTimeout": "reject",
        "artifactData": {
            "calls": calls.iter().map(|c| json!({"toolName": c["toolName"], "toolId": c["toolId"], "argsHash": c["argsHash"]})).collect::<Vec<_>>(),
            "policyRevision": session.policy.revision,
            "runId": session.ctx.run.run_id,
            "nodeId": session.ctx.run.node_id,
        },
    });
    if let Some(p) = person {
        data["approversList"] = json!([p]);
    }
    let rec = InterruptRecord {
        interrupt_id: id.clone(),
        key: key.clone(),
        kind: "approval",
        run: session.ctx.run.clone(),
        request_id: session.ctx.request_id.clone(),
        principal: person.map(str::to_owned),
        policy_revision: session.policy.revision.clone(),
        payload: json!({"kind": "approval", "key": key, "data": data, "timeoutMs": timeout_ms}),
        calls: Value::Array(calls),
        requested_at_ms: now,
        expires_at_ms: now.saturating_add(timeout_ms as i64),
    };
    let waiter = state.approvals.subscribe(&id);
    let row = match state.journal.raise_interrupt(rec).await {
        Ok(row) => row,
        Err(e) => {
            tracing::error!(error = %e, interrupt = %id, "approval interrupt not journaled; held calls refused");
            return session
                .decide_round(
                    round,
                    Approval::Refused(
                        "approval_unavailable",
                        "the approval interrupt could not be journaled, so the call cannot wait for approval (fail closed)",
                    ),
                )
                .await;
        }
    };
    if row.inserted {
        count(state, "held");
        tracing::info!(interrupt = %id, request_id = %session.ctx.request_id, run = ?session.ctx.run.run_id, tools = %names.join(","), person = person.is_some(), "tool calls held for approval");
    }
    let final_state = match (row.state.as_str(), &row.record.principal) {
        ("pending", None) => resolve_as_host(state, &id, "rejected", "no_approver").await,
        ("pending", Some(_)) => match waiter {
            Some(w) => wait(state, w, &row).await,
            None => resolve_as_host(state, &id, "expired", "timeout").await,
        },
        (s, _) => s.to_owned(),
    };
    let approval_hashes = bound_hashes(&row);
    match final_state.as_str() {
        "accepted" => match state
            .journal
            .consume_approval(&id, &session.ctx.request_id)
            .await
        {
            Ok(true) => {
                session
                    .decide_round(round, Approval::Accepted(&approval_hashes))
                    .await
            }
            Ok(false) => {
                session
                    .decide_round(
                        round,
                        Approval::Refused(
                            "approval_already_used",
                            "this approval was already used by another request; an approval is single-use",
                        ),
                    )
                    .await
            }
            Err(e) => {
                tracing::error!(error = %e, interrupt = %id, "approval could not be marked used; held calls refused");
                session
                    .decide_round(
                        round,
                        Approval::Refused(
                            "approval_unavailable",
                            "the approval could not be recorded as used (fail closed)",
                        ),
                    )
                    .await
            }
        },
        "rejected" if row.record.principal.is_none() => {
            session
                .decide_round(
                    round,
                    Approval::Refused(
                        "no_approver",
                        "no verified person acts for this request (no Turnguard-Principal-Token), so nobody can approve the held call",
                    ),
                )
                .await
        }
        "rejected" => {
            session
                .decide_round(
                    round,
                    Approval::Refused(
                        "approval_rejected",
                        "the acting person rejected the held call",
                    ),
                )
                .await
        }
        _ => {
            let why = format!(
                "no approval arrived within {timeout_ms} ms; a timeout never approves"
            );
            session
                .decide_round(round, Approval::Refused("approval_expired", &why))
                .await
        }
    }
}

/// The `argsHash`es an interrupt binds.
fn bound_hashes(row: &InterruptRow) -> BTreeSet<String> {
    row.record
        .calls
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["argsHash"].as_str().map(str::to_owned))
        .collect()
}

/// Waits for a resolution until the interrupt's expiry; then resolves it `expired` unless a
/// resolution won first. Returns the final state.
async fn wait(state: &AppState, mut waiter: Waiter<'_>, row: &InterruptRow) -> String {
    loop {
        if let Some(s) = waiter.rx.borrow_and_update().clone() {
            return s;
        }
        let left = row.record.expires_at_ms.saturating_sub(now_ms());
        if left <= 0 {
            break;
        }
        match tokio::time::timeout(Duration::from_millis(left as u64), waiter.rx.changed()).await {
            Ok(Ok(())) => continue,
            Ok(Err(_)) | Err(_) => break,
        }
    }
    resolve_as_host(state, &row.record.interrupt_id, "expired", "timeout").await
}

/// The host resolves an interrupt (timeout, or nobody can approve). A resolution that won
/// first stands. Returns the final state; `expired` when the journal cannot answer.
async fn resolve_as_host(state: &AppState, id: &str, to: &'static str, reason: &str) -> String {
    let now = now_ms();
    let r = Resolution {
        selector: Selector::Id(id.to_owned()),
        by: None,
        state: to,
        resume_value: json!({"action": "reject", "decision": "rejected", "reason": reason, "decidedAt": now}),
        now_ms: now,
    };
    match state.journal.resolve_interrupt(r).await {
        Ok(Resolved::Won(row)) => {
            observe(
                state,
                &row,
                if to == "expired" {
                    "expired"
                } else {
                    "rejected"
                },
            );
            state.approvals.notify(id, &row.state);
            tracing::info!(interrupt = %id, state = %row.state, reason, "approval interrupt resolved by the host");
            row.state
        }
        Ok(Resolved::AlreadyResolved(row) | Resolved::Expired(row) | Resolved::Forbidden(row)) => {
            row.state
        }
        Ok(Resolved::NotFound) => "expired".to_owned(),
        Err(e) => {
            tracing::error!(error = %e, interrupt = %id, "approval interrupt resolution not journaled; held calls refused");
            "expired".to_owned()
        }
    }
}

fn count(state: &AppState, result: &str) {
    state
        .metrics
        .approvals
        .get_or_create(&ApprovalLabels {
            result: result.to_owned(),
        })
        .inc();
}

/// Counts a resolution and observes how long the interrupt waited.
fn observe(state: &AppState, row: &InterruptRow, result: &str) {
    count(state, result);
    let waited = row
        .resolved_at_ms
        .unwrap_or_else(now_ms)
        .saturating_sub(row.record.requested_at_ms)
        .max(0);
    state
        .metrics
        .approval_wait
        .get_or_create(&ApprovalLabels {
            result: result.to_owned(),
        })
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
        body["details"] = d;
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

/// The verified approver of an admin request: bearer token only (no query string, no link),
/// no delegation.
fn approver(state: &AppState, req: &http::request::Parts) -> Result<Person, Box<Response>> {
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
            tracing::warn!("approval attempt with the agent's own principal token refused");
            return Box::new(error(
                StatusCode::FORBIDDEN,
                "forbidden",
                &e.to_string(),
                None,
            ));
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

fn served(row: &InterruptRow) -> Value {
    json!({
        "interruptId": row.record.interrupt_id,
        "key": row.record.key,
        "kind": row.record.kind,
        "runId": row.record.run.run_id,
        "nodeId": row.record.run.node_id,
        "attempt": row.record.run.attempt,
        "requestedAt": row.record.requested_at_ms,
        "expiresAt": row.record.expires_at_ms,
        "timeoutMs": row.record.payload["timeoutMs"],
        "policyRevision": row.record.policy_revision,
        "state": row.state,
        "calls": row.record.calls,
        "data": row.record.payload["data"],
    })
}

/// `GET /approvals`: the pending, unexpired interrupts bound to the caller, with the held
/// calls' tool names, redacted arguments and why each was held.
async fn list(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    let (parts, _) = req.into_parts();
    let person = match approver(&s, &parts) {
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

/// `{resumeValue: {action: "accept" | "reject", feedback?}}` (OpenWOP `ApprovalResume`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ResolveBody {
    resume_value: ResumeValue,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ResumeValue {
    action: String,
    #[serde(default)]
    feedback: Option<String>,
    /// Accepted and ignored: turnguard stamps its own time.
    #[serde(default)]
    #[allow(dead_code)]
    decided_at: Option<Value>,
    /// Accepted and ignored: the verified `sub` is recorded.
    #[serde(default)]
    #[allow(dead_code)]
    decided_by: Option<Value>,
}

async fn resolve_by_id(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    req: Request<Body>,
) -> Response {
    resolve(s, Selector::Id(id), req).await
}

async fn resolve_by_node(
    State(s): State<Arc<AppState>>,
    Path((run_id, node_id)): Path<(String, String)>,
    req: Request<Body>,
) -> Response {
    resolve(s, Selector::Node { run_id, node_id }, req).await
}

async fn resolve(s: Arc<AppState>, selector: Selector, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let person = match approver(&s, &parts) {
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
                "expected {{\"resumeValue\": {{\"action\": \"accept\" | \"reject\", \"feedback\"?: string}}}}; at `{}`: {}",
                e.path(),
                e.inner()
            ))
        }
    };
    let to = match parsed.resume_value.action.as_str() {
        "accept" => "accepted",
        "reject" => "rejected",
        other => {
            return bad(format!(
                "action `{}` is not one of this interrupt's actions (accept, reject)",
                sanitize_label(other)
            ))
        }
    };
    let now = now_ms();
    let mut value =
        json!({"action": parsed.resume_value.action, "decidedAt": now, "decidedBy": person.sub});
    if let Some(f) = parsed.resume_value.feedback {
        value["feedback"] = json!(f.chars().take(MAX_FEEDBACK_CHARS).collect::<String>());
    }
    let r = Resolution {
        selector,
        by: Some(person.sub.clone()),
        state: to,
        resume_value: value,
        now_ms: now,
    };
    match s.journal.resolve_interrupt(r).await {
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "turnguard.journal_unavailable",
            &format!("the resolution could not be journaled: {e}"),
            None,
        ),
        Ok(Resolved::NotFound) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no such interrupt",
            None,
        ),
        Ok(Resolved::Forbidden(row)) => {
            tracing::warn!(interrupt = %row.record.interrupt_id, sub = %person.sub, "approval attempt by a person the interrupt is not bound to refused");
            error(
                StatusCode::FORBIDDEN,
                "forbidden",
                "this interrupt is bound to another person",
                None,
            )
        }
        Ok(Resolved::AlreadyResolved(row)) => error(
            StatusCode::CONFLICT,
            "interrupt_already_resolved",
            &format!("the interrupt is already {}", row.state),
            Some(json!({"interruptId": row.record.interrupt_id, "state": row.state})),
        ),
        Ok(Resolved::Expired(row)) => {
            observe(&s, &row, "expired");
            s.approvals.notify(&row.record.interrupt_id, &row.state);
            error(
                StatusCode::CONFLICT,
                "interrupt_already_resolved",
                "the interrupt expired before this resolution; its calls are refused (a timeout never approves)",
                Some(json!({"interruptId": row.record.interrupt_id, "state": row.state})),
            )
        }
        Ok(Resolved::Won(row)) => {
            observe(
                &s,
                &row,
                if row.state == "accepted" {
                    "approved"
                } else {
                    "rejected"
                },
            );
            s.approvals.notify(&row.record.interrupt_id, &row.state);
            tracing::info!(interrupt = %row.record.interrupt_id, state = %row.state, sub = %person.sub, "approval interrupt resolved");
            axum::Json(json!({
                "interruptId": row.record.interrupt_id,
                "state": row.state,
                "resolvedAt": row.resolved_at_ms,
                "resolvedBy": row.resolved_by,
            }))
            .into_response()
        }
    }
}
