//! `tools/call` through the MCP front: the same decision function as a model-emitted call,
//! then exactly-once execution at the execution point (DESIGN.md §10).
//!
//! In order, stopping at the first step that decides:
//!
//! 1. **visibility** — a tool the caller may not call, or that the server does not list, gets
//!    MCP's "Unknown tool" error, the same for both ([`super::list::visible`]).
//! 2. **replay** (`Turnguard-Mode: replay`) — the recorded result is served, the server is
//!    never called; no record is `replay_source_missing`.
//! 3. **ticket** — inside a run (ticket `required`, the default), the call must match a model
//!    emission of that run with the same tool and `argsHash` that admission released
//!    ([`crate::journal::McpReader::tickets`]); without one it is refused (`forbidden`,
//!    reason `no_admitted_emission`) and never forwarded. An emission is executed at most
//!    once: its execution is an effect claim keyed by the emission.
//! 4. **admission** — [`crate::admission::decide_choice`], stages 1–8 of the model path, over a
//!    one-call turn whose declared tool is the server's listing (`inputSchema`); with a ticket
//!    the turn's trust and approval are the emission's (it was released, after an approval if
//!    it needed one); without one the run's sticky trust applies, and outside a run the call
//!    is judged as untrusted (the front cannot see what the agent read). `invalid` answers
//!    with a host-authored `isError` result (a tool execution error the model can correct,
//!    MCP tools "Error Handling"); any other withheld outcome with a JSON-RPC error carrying
//!    the OpenWOP code. A `held` call is refused: an approval belongs to the model emission,
//!    and an MCP call does not wait for one.
//! 5. **§E** — a clarification tool is answered by turnguard through `input_required`
//!    ([`super::clarify`]); the server is not called.
//! 6. **dispatch** — a side-effecting call (not re-runnable) takes its effect claim
//!    (`Journal::claim_effect`, insert-if-absent, confirmed before forwarding): a repeat of a
//!    completed effect gets the recorded result without calling the server; a repeat of one in
//!    flight or in doubt gets `turnguard.tool_outcome_unknown`. The effect id goes into
//!    `_meta` when the catalog names the server's idempotency key. The decision is journaled
//!    (table `rounds` with `api = 'mcp'`, `tool_calls`), `agent.tool-called` (transport `mcp`)
//!    appended.
//! 7. **record** — the result (or JSON-RPC error) is checked against the catalog
//!    `outputSchema` (§G: a violation becomes a host-authored `isError` result and is
//!    journaled), recorded durably (`tool_results`, which completes the effect and appends
//!    `agent.tool-returned`), the run's trust bit set from the tool's `contentTrust` (MCP
//!    results are untrusted unless the catalog says otherwise), and only then answered. A
//!    record failure fails the call (`turnguard.journal_unavailable`).

use crate::strict_json::Lookup as _;
use std::sync::Arc;

use axum::response::Response;
use bytes::Bytes;
use http::StatusCode;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::list::{self, ServerTool};
use super::relay::{self, Answer};
use super::{json_response, openwop_error, unknown_tool, wire_error, Inbound, McpFront};
use crate::admission::{self, AdmitCtx};
use crate::clock::{now_ms, AGENT_ID};
use crate::config::Ticket;
use crate::error::WireError;
use crate::journal::{
    Claim, EffectClaim, EventRecord, Recorded, RoundRecord, RoundState, TicketRow, ToolResultRecord,
};
use crate::metrics::{ReplayLabels, ReplayMode, ReplayResult};
use crate::model::{
    Api, ChoiceEmissions, Completion, CompletionState, Decision, DeclaredTool, Outcome, Stage,
    ToolCall, Turn,
};
use crate::policy::bundle::ContentTrust;
use crate::policy::{CatalogTool, CompiledPolicy};
use crate::request::RunMode;

/// One `tools/call` as the front sees it.
pub struct McpCall {
    pub front: Arc<McpFront>,
    pub inbound: Inbound,
    pub policy: Arc<CompiledPolicy>,
    /// The JSON-RPC id.
    pub id: Value,
    /// The MCP tool name.
    pub name: String,
    /// The name the catalog knows it by (the MCP name when the catalog knows neither).
    pub catalog_name: String,
    pub tool: CatalogTool,
    /// `params.arguments` as sent (`{}` when absent).
    pub arguments: Value,
    /// `argsHash` of the redacted arguments, when they are an object.
    pub args_hash: Option<String>,
    /// The redacted arguments.
    pub redacted: Option<Value>,
    /// The `outputSchema` the server announced for the tool (`tools/list`): its results are
    /// held to it as to the catalog's ([`output_violation`]).
    pub server_output_schema: Option<Value>,
    /// The arguments held a secret, so `args_hash` (taken over the redacted form) does not
    /// tell two values of it apart: the call is never matched to a model emission by it
    /// ([`McpCall::ticket`]).
    pub secrets: bool,
    /// The turn trust admission judged the call with.
    pub trust: ContentTrust,
}

/// How a call is identified at the execution point.
#[derive(Debug, Clone)]
pub struct Exec {
    /// The execution's call id (`mcpx_…`): `tool_calls.call_id` of the decision, the
    /// effect's `call_id`, `tool_results.tool_call_id` of the result.
    pub call_id: String,
    /// The effect id and its keying, for a side-effecting call with an identity.
    pub effect: Option<(String, &'static str)>,
}

fn hex_sha256(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0u8]);
    }
    hex::encode(h.finalize())
}

/// `tools/call`.
pub async fn handle(front: &Arc<McpFront>, inbound: Inbound) -> Response {
    let id = inbound.id();
    let policy = front.state.policy.snapshot();
    let params = inbound.params();
    let Some(name) = params
        .get("name")
        .and_then(Value::as_str)
        .map(str::to_owned)
    else {
        return json_response(
            StatusCode::OK,
            &super::rpc_error(
                &id,
                super::code::INVALID_PARAMS,
                "tools/call needs `params.name`",
                None,
            ),
        );
    };
    let arguments = params
        .get("arguments")
        .cloned()
        .unwrap_or_else(|| json!({}));
    let (catalog_name, tool) = list::catalog_tool(&policy, &inbound.server_name, &name);
    let tool = tool.clone();
    // 1. visibility: forbidden and missing answer alike.
    if !list::visible(&policy, inbound.person.as_deref(), &tool) {
        return unknown_tool(&id, &name);
    }
    let Some(declared) = list::declared(front, &inbound, &name).await else {
        return unknown_tool(&id, &name);
    };
    let parsed = admission::arguments::parse(&arguments.to_string()).ok();
    let redacted = parsed
        .as_ref()
        .map(|a| policy.redactor.redact(&tool.descriptor.tool_id, a));
    let secrets = redacted.as_ref().is_some_and(|(_, n)| *n > 0);
    let redacted = redacted.map(|(r, _)| r);
    let args_hash = redacted.as_ref().map(admission::arguments::args_hash);
    let mut call = McpCall {
        front: Arc::clone(front),
        inbound,
        policy,
        id,
        name,
        catalog_name,
        tool,
        arguments,
        args_hash,
        redacted,
        secrets,
        server_output_schema: declared.output_schema.clone(),
        trust: ContentTrust::Untrusted,
    };
    // 2. replay
    if call.inbound.mode == RunMode::Replay {
        return replay(&call).await;
    }
    // 3. ticket
    let ticket = match call.ticket().await {
        Ok(t) => t,
        Err(e) => return call.fail(&e),
    };
    let required =
        call.inbound.run_id().is_some() && call.inbound.server.ticket == Ticket::Required;
    if required && ticket.is_none() {
        let d = call.stamp(Decision::new(
            Outcome::Refused,
            Stage::Dispatch,
            crate::reason::Reason::NoAdmittedEmission,
            "no model emission of this run with this tool and these arguments was admitted and released; the call is not forwarded (turnguard tickets)".into(),
        ));
        return call.withheld(d, &Exec::random()).await;
    }
    // 4. admission
    let d = call.decide(&declared, ticket.as_ref()).await;
    if !d.released() {
        let exec = Exec::random();
        return call.withheld(d, &exec).await;
    }
    // 5. §E
    if call.tool.clarification {
        return super::clarify::handle(call, d, ticket).await;
    }
    // 6. dispatch
    let exec = call.exec(ticket.as_ref());
    dispatch(call, d, exec).await
}

impl Exec {
    /// An execution without identity (a chat call): a fresh id, no claim.
    pub fn random() -> Self {
        Self {
            call_id: format!("mcpx_{}", uuid::Uuid::new_v4().simple()),
            effect: None,
        }
    }
}

impl McpCall {
    /// The names a ticket's emission may carry.
    fn names(&self) -> Vec<String> {
        let mut n = list::names(&self.inbound.server_name, &self.name);
        if !n.contains(&self.catalog_name) {
            n.push(self.catalog_name.clone());
        }
        n
    }

    /// The ticket this call executes: the first released emission of the run with this tool
    /// and `argsHash` whose execution is not claimed yet, else the first one (whose claim then
    /// decides: a repeat, or a call in doubt). `None` outside a run or without one, and for
    /// arguments that held a secret ([`McpCall::secrets`]): the agent could change the secret
    /// part and still meet the emission's ticket, so such a call is decided on its own.
    pub async fn ticket(&self) -> Result<Option<TicketRow>, WireError> {
        let (Some(run), Some(hash)) = (self.inbound.run_id(), self.args_hash.clone()) else {
            return Ok(None);
        };
        if self.secrets {
            return Ok(None);
        }
        let run = run.to_owned();
        let names = self.names();
        let front = &self.front;
        let tenant = self.front.state.config.tenant.clone();
        let rerunnable = self.tool.rerunnable();
        let found = async {
            let rows = front.reader.tickets(&run, &hash, &names).await?;
            if rerunnable {
                return Ok(rows.into_iter().next());
            }
            for row in &rows {
                let exec = Exec::of_ticket(&tenant, &run, row, false);
                let claimed = match &exec.effect {
                    Some((effect_id, _)) => front.reader.effect_state(effect_id).await?.is_some(),
                    None => false,
                };
                if !claimed {
                    return Ok(Some(row.clone()));
                }
            }
            Ok::<_, crate::journal::JournalError>(rows.into_iter().next())
        }
        .await;
        found.map_err(|e| WireError::JournalUnavailable {
            reason: e.to_string(),
        })
    }

    /// Fills the decision fields admission would have set.
    fn stamp(&self, mut d: Decision) -> Decision {
        d.tool_id = self.tool.descriptor.tool_id.clone();
        d.tool_name = admission::sanitize_label(&self.name);
        d.args_hash = self.args_hash.clone();
        d.redacted_args = self.redacted.clone();
        d.args_text = None;
        d
    }

    /// Stages 1–8 of the model path over a one-call turn.
    async fn decide(&mut self, declared: &ServerTool, ticket: Option<&TicketRow>) -> Decision {
        let (trust, approved) = match ticket {
            Some(t) => (
                // Not judged (`None`): untrusted.
                t.content_trust.unwrap_or(ContentTrust::Untrusted),
                true,
            ),
            None if self.inbound.run_id().is_some() => (
                crate::proxy::trust::sticky(
                    &self.front.state,
                    &self.inbound.ctx,
                    ContentTrust::Trusted,
                )
                .await,
                false,
            ),
            None => (ContentTrust::Untrusted, false),
        };
        self.trust = trust;
        let turn = mcp_turn(&self.catalog_name, declared);
        let choice = ChoiceEmissions {
            choice: 0,
            completion: Completion::new(CompletionState::Clean, "mcp"),
            calls: vec![ToolCall::json(
                String::new(),
                self.catalog_name.clone(),
                self.arguments.to_string(),
            )],
            text: None,
            provider_output: false,
            output: Vec::new(),
        };
        let ticket_hash = self.args_hash.clone().filter(|_| approved);
        // The one call of the one choice.
        let approve = move |choice: u32, index: usize, h: &str| {
            (choice, index) == (0, 0) && ticket_hash.as_deref() == Some(h)
        };
        let ctx = AdmitCtx {
            policy: &self.policy,
            schemas: &self.front.state.schemas,
            limits: &self.front.state.limits,
            person: self.inbound.person.as_deref(),
            agent: AGENT_ID,
            trust,
            run: self.inbound.run_id(),
            provider: "mcp",
            approved: &approve,
            repairs_left: 0,
            explain: false,
        };
        let mut decisions = admission::decide_choice(&ctx, &turn, &choice);
        // An MCP call goes out right after it is decided (no surfacing, no wait): this is its
        // dispatch, where its rate bucket is charged, once.
        admission::charge_rate(&ctx, &choice.calls, &mut decisions);
        decisions.into_iter().next().unwrap_or_else(|| {
            self.stamp(Decision::new(
                Outcome::Refused,
                Stage::Dispatch,
                crate::reason::Reason::Internal,
                "admission returned no decision".into(),
            ))
        })
    }

    /// The execution identity of this call (see [`Exec`]).
    pub fn exec(&self, ticket: Option<&TicketRow>) -> Exec {
        self.exec_with(ticket, !self.tool.rerunnable())
    }

    /// [`Self::exec`], with an effect claim whenever the call has an identity when
    /// `side_effecting` (a clarification: the person's answer cannot be asked for again).
    pub fn exec_with(&self, ticket: Option<&TicketRow>, side_effecting: bool) -> Exec {
        let tenant = &self.front.state.config.tenant;
        if let (Some(t), Some(run)) = (ticket, self.inbound.run_id()) {
            return Exec::of_ticket(tenant, run, t, !self.tool.business_key.is_empty())
                .keep_effect(side_effecting);
        }
        let hash = self.args_hash.clone().unwrap_or_default();
        let digest = if !self.tool.business_key.is_empty() {
            let key: Vec<Value> = self
                .tool
                .business_key
                .iter()
                .map(|p| self.arguments.at(p).cloned().unwrap_or(Value::Null))
                .collect();
            let canon = admission::arguments::canonical(
                &json!({"toolId": self.tool.descriptor.tool_id, "businessKey": key}),
            );
            Some((
                hex_sha256(&[tenant, "mcp", &String::from_utf8_lossy(&canon)]),
                "business-identity",
            ))
        } else if let Some(run) = self.inbound.run_id() {
            let node = self.inbound.ctx.run.node_id.as_deref().unwrap_or("default");
            Some((
                hex_sha256(&[
                    tenant,
                    "mcp",
                    run,
                    node,
                    &self.inbound.server_name,
                    &self.name,
                    &hash,
                ]),
                "activity-recipe",
            ))
        } else {
            None
        };
        match digest {
            Some((d, keying)) => Exec {
                call_id: format!("mcpx_{}", &d[..32]),
                effect: side_effecting.then(|| (format!("{tenant}/mcp-{d}"), keying)),
            },
            None => Exec::random(),
        }
    }

    /// A JSON-RPC error for a [`WireError`], counted and logged.
    fn fail(&self, e: &WireError) -> Response {
        let (_, code, reason) = e.parts();
        tracing::warn!(request_id = %self.inbound.ctx.request_id(), server = %self.inbound.server_name, tool = %admission::sanitize_label(&self.name), code, reason, "MCP tools/call failed");
        json_response(StatusCode::OK, &wire_error(&self.id, e))
    }

    /// Answers a call admission withheld (or the ticket refused): journaled, counted, events.
    async fn withheld(&self, d: Decision, exec: &Exec) -> Response {
        self.journal(&d, exec, RoundState::Ok, None).await;
        self.account(&d, exec, true).await;
        if d.outcome == Outcome::Invalid {
            // A tool execution error the model can correct (MCP tools "Error Handling").
            let mut result = json!({
                "content": [{"type": "text", "text": format!("turnguard: {}", admission::explain(&d))}],
                "isError": true,
            });
            self.complete(&mut result);
            return json_response(
                StatusCode::OK,
                &json!({"jsonrpc": "2.0", "id": self.id, "result": result}),
            );
        }
        let e = admission::error_for(&d);
        let mut details = json!({
            "reason": d.reason, "source": "turnguard", "outcome": d.outcome.as_str(),
            "stage": d.stage.as_str(),
        });
        if let Some(s) = d.retry_after_secs {
            if let Some(o) = details.as_object_mut() {
                o.insert("retryAfterSeconds".into(), json!(s));
            }
        }
        json_response(
            StatusCode::OK,
            &openwop_error(&self.id, e.status, e.code, &e.message, details),
        )
    }

    /// Marks `result` complete for a 2026-07-28 client (`resultType`).
    pub fn complete(&self, result: &mut Value) {
        if self.inbound.era == super::session::Era::Modern {
            if let Some(o) = result.as_object_mut() {
                o.entry("resultType").or_insert(json!("complete"));
            }
        }
    }

    /// Journals the decision as an MCP round (`rounds.api = 'mcp'`, one `tool_calls` row):
    /// durably inside a run, queued for a chat call.
    pub async fn journal(
        &self,
        d: &Decision,
        exec: &Exec,
        state: RoundState,
        error: Option<String>,
    ) {
        let ctx = &self.inbound.ctx;
        let rec = RoundRecord {
            request_id: format!("mcp:{}", uuid::Uuid::new_v4()),
            arrived: ctx.started,
            client_request_id: ctx.client_request_id.clone(),
            at_ms: now_ms(),
            api: "mcp",
            model: Some(format!("mcp:{}", self.inbound.server_name)),
            stream: false,
            run: ctx.run.clone(),
            round_index: 0,
            request_digest: hex_sha256(&[
                "mcp",
                &self.inbound.server_name,
                &self.name,
                self.args_hash.as_deref().unwrap_or(""),
            ]),
            completion: Some(CompletionState::Clean.as_str().to_owned()),
            finish_reason: Some("tools/call".into()),
            upstream_status: None,
            latency_ms: ctx.started.elapsed().as_millis() as u64,
            state,
            error,
            response: Recorded::redacted(b"", &self.policy.redactor, 0),
            calls: vec![crate::proxy::record::call_record(
                &exec.call_id,
                &self.name,
                d,
            )],
            response_link: None,
            channel: None,
            channel_result: None,
            content_trust: Some(self.trust),
        };
        crate::proxy::record_round_with(&self.front.state, &self.policy.redactor, rec).await;
    }

    /// Metrics (`surface = mcp`), the decision log line and the run events: `agent.tool-called`
    /// (transport `mcp`), and `agent.tool-returned` for a call that does not run (the result
    /// of one that runs appends its own when it is recorded).
    pub async fn account(&self, d: &Decision, exec: &Exec, withheld: bool) {
        let state = &self.front.state;
        state.metrics.count_call(
            d,
            self.policy.catalog.by_id(&d.tool_id).is_some(),
            crate::metrics::CallSurface::Mcp,
        );
        let tool_name = admission::sanitize_label(&self.name);
        if d.outcome != Outcome::Executed || !d.enforced {
            tracing::info!(
                request_id = %self.inbound.ctx.request_id(),
                run = self.inbound.run_id().unwrap_or(""),
                surface = "mcp",
                server = %self.inbound.server_name,
                tool = %tool_name,
                tool_id = %d.tool_id,
                outcome = d.outcome.as_str(),
                stage = d.stage.as_str(),
                reason = d.reason.as_str(),
                "MCP tool call withheld"
            );
        }
        let principal = self.inbound.person.as_deref().unwrap_or(AGENT_ID);
        let mut called = json!({
            "agentId": AGENT_ID, "toolName": tool_name, "callId": exec.call_id,
            "principal": principal, "transport": "mcp",
        });
        if let Some(h) = &d.args_hash {
            if let Some(o) = called.as_object_mut() {
                o.insert("argsHash".into(), json!(h));
            }
        }
        let mut events = vec![self.event("agent.tool-called", called)];
        if withheld {
            let (status, code) = match (d.outcome, d.reason) {
                (_, crate::reason::Reason::RateLimited) => ("rate_limited", "rate_limited"),
                (Outcome::Invalid, _) => ("error", "validation_error"),
                (Outcome::SuppressedRepeat, crate::reason::Reason::ToolOutcomeUnknown) => {
                    ("error", "turnguard.tool_outcome_unknown")
                }
                (Outcome::SuppressedRepeat, _) => ("ok", ""),
                _ => ("forbidden", "forbidden"),
            };
            let mut returned = json!({"agentId": AGENT_ID, "toolName": tool_name, "callId": exec.call_id, "status": status, "x-turnguard-transport": "mcp"});
            if let Some(o) = returned.as_object_mut() {
                if code.is_empty() {
                    o.insert("outcome".into(), json!({"suppressedRepeat": true}));
                } else {
                    o.insert(
                        "error".into(),
                        json!({"code": code, "message": admission::explain(d)}),
                    );
                }
            }
            events.push(self.event("agent.tool-returned", returned));
        }
        if let Err(e) = state.journal.record_events(events).await {
            tracing::error!(error = %e, request_id = %self.inbound.ctx.request_id(), "MCP events not journaled");
        }
    }

    pub fn event(&self, kind: &'static str, payload: Value) -> EventRecord {
        EventRecord {
            request_id: self.inbound.ctx.journal_id.clone(),
            run: self.inbound.ctx.run.clone(),
            at_ms: now_ms(),
            kind,
            payload: crate::strict_json::to_text(&payload),
        }
    }

    /// Takes the execution's effect claim, when it has one. `Ok(None)`: this call owns the
    /// execution. `Ok(Some(response))`: a repeat — the recorded result, or
    /// `tool_outcome_unknown` for an execution in flight or in doubt.
    pub async fn claim(
        &self,
        d: &mut Decision,
        exec: &Exec,
    ) -> Result<Option<Response>, WireError> {
        let Some((effect_id, keying)) = &exec.effect else {
            return Ok(None);
        };
        let journal = &self.front.state.journal;
        let claim = EffectClaim {
            effect_id: effect_id.clone(),
            tool_id: self.tool.descriptor.tool_id.clone(),
            call_id: exec.call_id.clone(),
            run: self.inbound.ctx.run.clone(),
            keying,
            at_ms: now_ms(),
            instance: crate::journal::instance_id().to_owned(),
            reader: self.inbound.reader(),
        };
        let unavailable = |e: crate::journal::JournalError| WireError::JournalUnavailable {
            reason: e.to_string(),
        };
        match journal.claim_effect(claim).await.map_err(unavailable)? {
            Claim::Claimed => {
                // Confirmed before the call leaves: from here on the effect may happen, and a
                // claim of a process that dies is never taken over.
                journal
                    .confirm_claims(vec![(effect_id.clone(), exec.call_id.clone())])
                    .await
                    .map_err(unavailable)?;
                Ok(None)
            }
            Claim::Existing {
                result: Some(r), ..
            } => {
                d.outcome = Outcome::SuppressedRepeat;
                d.stage = Stage::Dispatch;
                d.reason = crate::reason::Reason::EffectRecorded;
                d.message = "this effect already ran; its recorded result is served and the server is not called".into();
                self.journal(d, exec, RoundState::Ok, None).await;
                self.account(d, exec, true).await;
                Ok(Some(json_response(
                    StatusCode::OK,
                    &self.recorded_message(&r),
                )))
            }
            Claim::Existing { result: None, .. } => {
                d.outcome = Outcome::SuppressedRepeat;
                d.stage = Stage::Dispatch;
                d.reason = crate::reason::Reason::ToolOutcomeUnknown;
                d.message = "this effect was forwarded before and its result is not recorded (in flight, or in doubt after a failure); it is not run again".into();
                self.journal(d, exec, RoundState::Ok, None).await;
                self.account(d, exec, true).await;
                let e = WireError::ToolOutcomeUnknown {
                    calls: admission::sanitize_label(&self.name),
                };
                Ok(Some(json_response(
                    StatusCode::OK,
                    &wire_error(&self.id, &e),
                )))
            }
            Claim::Foreign => {
                // Another principal's (or run's) effect: nothing of it may be shown, not even
                // whether it completed — only that it is already done (issue 10 item 11).
                d.outcome = Outcome::SuppressedRepeat;
                d.stage = Stage::Dispatch;
                d.reason = crate::reason::Reason::EffectAlreadyClaimed;
                d.message = "turnguard: this effect is already done; it is not run again".into();
                self.journal(d, exec, RoundState::Ok, None).await;
                self.account(d, exec, true).await;
                Ok(Some(json_response(
                    StatusCode::OK,
                    &self.already_done_message(),
                )))
            }
        }
    }

    /// A recorded outcome (`{"result": …}` or `{"error": …}`) as the answer to this request,
    /// in this request's revision (`resultType` only for 2026-07-28: the record may come from
    /// a call of the other era).
    pub fn recorded_message(&self, recorded: &str) -> Value {
        let mut v: Value = serde_json::from_str(recorded).unwrap_or_else(
            |_| json!({"result": {"content": [{"type": "text", "text": recorded}]}}),
        );
        if let Some(r) = v.get_mut("result") {
            if self.inbound.era == super::session::Era::Modern {
                self.complete(r);
            } else if let Some(o) = r.as_object_mut() {
                o.remove("resultType");
            }
        }
        if let Some(o) = v.as_object_mut() {
            o.insert("jsonrpc".into(), json!("2.0"));
            o.insert("id".into(), self.id.clone());
        }
        v
    }

    /// The answer to a repeat of another principal's (or run's) effect: a result that says only
    /// "already done" (host-authored, MCP result shape, §G), in this request's revision.
    pub fn already_done_message(&self) -> Value {
        let mut result = json!({
            "content": [{"type": "text", "text": "turnguard: this effect is already done; it is not run again"}],
            "isError": false
        });
        if self.inbound.era == super::session::Era::Modern {
            self.complete(&mut result);
        }
        json!({"jsonrpc": "2.0", "id": self.id.clone(), "result": result})
    }

    /// Records the outcome the client gets (`message`, a JSON-RPC response) durably as the
    /// execution's result, then sets the run's trust bit from the tool's `contentTrust`.
    pub async fn record(&self, exec: &Exec, message: &Value) -> Result<(), WireError> {
        let state = &self.front.state;
        let (kept, is_error) = match (message.get("result"), message.get("error")) {
            (Some(r), _) => (
                json!({"result": r}),
                r.get("isError").and_then(Value::as_bool) == Some(true),
            ),
            (None, Some(e)) => (json!({"error": e}), true),
            (None, None) => (
                json!({"error": {"code": -32603, "message": "no result"}}),
                true,
            ),
        };
        let text = self.policy.redactor.redact_text(&kept.to_string());
        let rec = ToolResultRecord {
            request_id: self.inbound.ctx.journal_id.clone(),
            at_ms: now_ms(),
            run: self.inbound.ctx.run.clone(),
            tool_call_id: exec.call_id.clone(),
            event_call_id: self.policy.redactor.redact_text(&exec.call_id),
            reader: Some(self.inbound.reader()),
            tool_name: Some(self.policy.redactor.redact_text(&self.name)),
            is_error,
            content: Recorded::redacted(
                text.as_bytes(),
                &self.policy.redactor,
                state.config.journal_max_record_bytes,
            ),
        };
        state
            .journal
            .record_tool_results(vec![rec])
            .await
            .map_err(|e| WireError::JournalUnavailable {
                reason: e.to_string(),
            })?;
        if let Some(run) = self.inbound.run_id() {
            if self.tool.content_trust == ContentTrust::Untrusted {
                // The result reaches the model in the agent's next request: the run is
                // untrusted from now on (sticky, tool-turn contract §C). When that cannot be
                // recorded, the result does not go back (fail closed).
                state
                    .journal
                    .run_untrusted(run, true, &self.inbound.ctx.journal_id, now_ms())
                    .await
                    .map_err(|e| WireError::JournalUnavailable {
                        reason: e.to_string(),
                    })?;
            }
        }
        Ok(())
    }
}

impl Exec {
    /// The execution of ticket `t` in `run`: one per released emission.
    pub fn of_ticket(tenant: &str, run: &str, t: &TicketRow, business: bool) -> Self {
        let d = hex_sha256(&[
            tenant,
            "mcp-ticket",
            run,
            &t.request_id,
            &t.call_id,
            &t.row.to_string(),
        ]);
        Self {
            call_id: format!("mcpx_{}", &d[..32]),
            effect: Some((
                format!("{tenant}/mcp-{d}"),
                if business {
                    "business-identity"
                } else {
                    "activity-recipe"
                },
            )),
        }
    }

    fn keep_effect(mut self, side_effecting: bool) -> Self {
        if !side_effecting {
            self.effect = None;
        }
        self
    }
}

/// The one-call turn admission decides an MCP call in: its only declared tool is the call's,
/// with the server's `inputSchema`. (`api` is read by admission only for a streamed Responses
/// rewrite, which an MCP call never is.)
fn mcp_turn(name: &str, declared: &ServerTool) -> Turn {
    Turn {
        tools: vec![DeclaredTool::json(name, declared.input_schema.clone())],
        ..Turn::new(Api::OpenAiChat)
    }
}

/// 6–7: claim, journal, forward, check, record, answer.
async fn dispatch(call: McpCall, mut d: Decision, exec: Exec) -> Response {
    match call.claim(&mut d, &exec).await {
        Ok(Some(repeat)) => return repeat,
        Ok(None) => {}
        Err(e) => return call.fail(&e),
    }
    // The arguments to forward: the agent's, or the redacted form (`strip_from_egress`).
    let mut message = call.inbound.message.clone();
    let mut changed = false;
    if let Some(args) = d.release_args.as_deref() {
        if call
            .inbound
            .headers
            .keys()
            .any(|k| k.as_str().starts_with("mcp-param-"))
        {
            let e = WireError::InvalidRequest {
                reason: "the arguments carry a secret that must be stripped before an egress tool, and this request mirrors arguments into `Mcp-Param-*` headers turnguard does not rewrite".into(),
            };
            return call.fail(&e);
        }
        if let (Some(p), Ok(v)) = (
            message.get_mut("params").and_then(Value::as_object_mut),
            serde_json::from_str::<Value>(args),
        ) {
            p.insert("arguments".into(), v);
            changed = true;
        }
    }
    if let (Some(key), Some(p)) = (
        call.tool.idempotency_meta_key.as_deref(),
        message.get_mut("params").and_then(Value::as_object_mut),
    ) {
        let effect = exec
            .effect
            .as_ref()
            .map_or(exec.call_id.clone(), |(e, _)| e.clone());
        let meta = p.entry("_meta").or_insert_with(|| json!({}));
        if let Some(m) = meta.as_object_mut() {
            m.insert(key.to_owned(), json!(effect));
            changed = true;
        }
    }
    let body = if changed {
        Bytes::from(message.to_string())
    } else {
        call.inbound.raw.clone()
    };
    tokio::join!(
        call.journal(&d, &exec, RoundState::Ok, None),
        call.account(&d, &exec, false)
    );
    // From here the call has left: it runs in its own task, so a client that goes away does
    // not cancel the recording of its result (the effect happens either way).
    let task = tokio::spawn(async move {
        let sent = relay::send(&call.front, &call.inbound, None, body).await;
        let front = Arc::clone(&call.front);
        let server = call.inbound.server_name.clone();
        let id = call.id.clone();
        let hook: relay::Hook = Box::new(move |answer: Answer| {
            Box::pin(async move { finish(call, exec, answer).await })
        });
        relay::respond(&front, &server, sent, id, hook).await
    });
    match task.await {
        Ok(resp) => resp,
        Err(e) => json_response(
            StatusCode::OK,
            &wire_error(
                &Value::Null,
                &WireError::Internal {
                    reason: e.to_string(),
                },
            ),
        ),
    }
}

/// The server answered (or failed to): §G checks, record, trust, answer.
async fn finish(call: McpCall, exec: Exec, answer: Answer) -> Option<Value> {
    let msg = match answer {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(request_id = %call.inbound.ctx.request_id(), server = %call.inbound.server_name, tool = %admission::sanitize_label(&call.name), error = %e, "MCP server failed before answering a tools/call");
            if exec.effect.is_some() {
                // The call left: it may have run. It stays claimed without a result, in doubt.
                let e = WireError::ToolOutcomeUnknown {
                    calls: admission::sanitize_label(&call.name),
                };
                return Some(wire_error(&call.id, &e));
            }
            return Some(wire_error(&call.id, &e));
        }
    };
    // The server asks for input first (MRTR, the 2026-07-28 era): nothing ran yet. Only an
    // ask that carries nothing a client reads as the call's result is taken as one: a
    // handshake-era client reads any `result` as the result, and content beside the ask
    // could be read as it too; such an answer is recorded and judged like any result.
    let asks = msg.at("/result/resultType").and_then(Value::as_str) == Some("input_required")
        && call.inbound.era == super::session::Era::Modern
        && msg
            .at("/result/content")
            .is_none_or(|c| c.as_array().is_some_and(Vec::is_empty))
        && msg.at("/result/structuredContent").is_none();
    if asks {
        // The claim is given back so the client's retry is the execution.
        if let Some((effect_id, _)) = &exec.effect {
            if let Err(e) = call
                .front
                .state
                .journal
                .release_claim(effect_id, &exec.call_id)
                .await
            {
                tracing::error!(error = %e, "an MCP effect claim could not be given back");
            }
        }
        return None;
    }
    let mut out: Option<Value> = None;
    if let Some(violation) = output_violation(&call, &msg) {
        tracing::warn!(request_id = %call.inbound.ctx.request_id(), tool = %admission::sanitize_label(&call.name), violation = %violation, "MCP result violates its outputSchema");
        let mut result = json!({
            "content": [{"type": "text", "text": format!(
                "turnguard: the result of `{}` ({}) does not match its outputSchema: {violation}",
                admission::sanitize_label(&call.name), call.tool.descriptor.tool_id)}],
            "isError": true,
        });
        call.complete(&mut result);
        let event = call.event(
            "turnguard.tool-output-invalid",
            json!({"agentId": AGENT_ID, "toolName": admission::sanitize_label(&call.name),
                   "callId": exec.call_id, "reason": "output_schema_violation", "detail": violation}),
        );
        if let Err(e) = call.front.state.journal.record_events(vec![event]).await {
            tracing::error!(error = %e, "output violation event not journaled");
        }
        out = Some(json!({"jsonrpc": "2.0", "id": call.id, "result": result}));
    }
    let sent = out.clone().unwrap_or_else(|| msg.clone());
    if let Err(e) = call.record(&exec, &sent).await {
        return Some(wire_error(&call.id, &e));
    }
    out
}

/// §G: `structuredContent` of a result against the catalog `outputSchema`, when one is
/// declared, and against the one the server announced for the tool (the MCP spec has a
/// server that announces one conform to it; a result that does not is not relayed as a
/// success). `Some(what is wrong)` (validator output only, never the value).
fn output_violation(call: &McpCall, msg: &Value) -> Option<String> {
    let catalog = call
        .tool
        .descriptor
        .output_schema
        .as_ref()
        .map(|s| Value::Object(s.clone().into_iter().collect()));
    [catalog, call.server_output_schema.clone()]
        .into_iter()
        .flatten()
        .find_map(|schema| violation_of(call, msg, &schema))
}

/// How the result in `msg` misses `schema` (an `outputSchema`), if it does.
fn violation_of(call: &McpCall, msg: &Value, schema: &Value) -> Option<String> {
    let result = msg.get("result")?;
    let Some(content) = result.get("structuredContent") else {
        if result.get("isError").and_then(Value::as_bool) == Some(true) {
            // A tool execution error need not carry data.
            return None;
        }
        return Some("the result carries no `structuredContent`".into());
    };
    let compiled = call.front.state.schemas.get(schema);
    let validator = match compiled.as_ref() {
        Ok(v) => v,
        Err(reason) => return Some(format!("the outputSchema: {reason}")),
    };
    let errors: Vec<String> = validator
        .iter_errors(content)
        .take(5)
        .map(|e| admission::arguments::describe(&e))
        .collect();
    (!errors.is_empty()).then(|| errors.join("; "))
}

/// Replay: the recorded result of this call's execution in the run; never the server.
async fn replay(call: &McpCall) -> Response {
    let count = |result: ReplayResult| {
        call.front
            .state
            .metrics
            .replay
            .get_or_create(&ReplayLabels {
                mode: ReplayMode::McpReplay,
                result,
            })
            .inc();
    };
    let Some(run) = call.inbound.run_id().map(str::to_owned) else {
        return call.fail(&WireError::InvalidRequest {
            reason: "`Turnguard-Mode: replay` needs `Turnguard-Run`".into(),
        });
    };
    let run_name = run.clone();
    // The executions this call can be: one per released emission (ticket), and the call's
    // own identity (a call without a ticket).
    let fallback = call.exec(None);
    // Arguments that held a secret meet no ticket ([`McpCall::ticket`]).
    let hash = call.args_hash.clone().filter(|_| !call.secrets);
    let (front, names) = (&call.front, call.names());
    let tenant = call.front.state.config.tenant.clone();
    let found = async {
        let mut candidates: Vec<Exec> = Vec::new();
        if let Some(hash) = &hash {
            let rows = front.reader.tickets(&run, hash, &names).await?;
            candidates.extend(
                rows.iter()
                    .map(|t| Exec::of_ticket(&tenant, &run, t, false)),
            );
        }
        candidates.push(fallback);
        for exec in candidates {
            if let Some(r) = front
                .reader
                .recorded(Some(&run), &exec.call_id, &call.inbound.reader())
                .await?
            {
                return Ok(Some(r));
            }
        }
        Ok::<_, crate::journal::JournalError>(None)
    }
    .await;
    match found {
        Ok(Some(r)) => {
            count(ReplayResult::Hit);
            let mut resp = json_response(StatusCode::OK, &call.recorded_message(&r));
            resp.headers_mut().insert(
                "turnguard-served",
                http::HeaderValue::from_static("recorded"),
            );
            return resp;
        }
        Ok(None) => {}
        Err(e) => {
            return call.fail(&WireError::JournalUnavailable {
                reason: e.to_string(),
            })
        }
    }
    count(ReplayResult::Miss);
    call.fail(&WireError::ReplaySourceMissing {
        reason: format!(
            "run `{}` has no recorded result of `{}` with these arguments",
            admission::sanitize_label(&run_name),
            admission::sanitize_label(&call.name)
        ),
    })
}
