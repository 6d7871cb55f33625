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
//! Streams are relayed by [`stream`]; everything provider-specific is behind
//! [`crate::provider`]. Each request takes one policy snapshot and uses it throughout.

pub mod recovery;
pub mod stream;
pub mod trust;
pub mod upstream;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, StatusCode};
use serde_json::{json, Value};

use crate::admission::channel::{Channel, ChannelSpec, ChannelVerdict};
use crate::admission::{self, AdmitCtx};
use crate::body::{read_capped_within, BodyError};
use crate::error::{Surface, WireError};
use crate::journal::{
    CallRecord, Claim, EffectClaim, EventRecord, Recorded, RoundRecord, RoundState, RunKey,
    ServedCall, ServedRecord, ToolResultRecord,
};
use crate::metrics::{CallLabels, EmissionLabels, RepairLabels, TrustLabels};
use crate::model::{
    Api, ChoiceEmissions, ChoiceVerdict, Outcome, Stage, SurfacedError, Surfacing, Turn,
};
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
    /// The journal id of the current model round (`<journal-id>`, then `#repair-N`).
    pub fn round_id(&self) -> String {
        if self.rounds <= 1 {
            self.ctx.journal_id.clone()
        } else {
            format!("{}#repair-{}", self.ctx.journal_id, self.rounds - 1)
        }
    }

    /// Sends the current body upstream.
    pub async fn send(&mut self) -> Result<http::Response<hyper::body::Incoming>, WireError> {
        self.rounds += 1;
        let raw = Bytes::from(self.body.to_string());
        upstream::send(
            &self.state,
            self.turn.api.upstream(),
            self.turn.api.into(),
            Method::POST,
            &self.path,
            self.headers.clone(),
            raw,
        )
        .await
    }

    /// A provider-stored response of this turn as it is recorded: with its `contentTrust`
    /// (the response chain rule, [`admission::trust::of_response`]) and the position a
    /// request continuing it takes (this turn's round index + 1; its prior calls, then
    /// `calls`, the calls of the round).
    pub fn judged(
        &self,
        link: Option<crate::model::ResponseLink>,
        calls: &[CallRecord],
    ) -> Option<crate::model::ResponseLink> {
        link.map(|mut l| {
            l.content_trust = Some(admission::trust::of_response(self.trust, &l));
            l.next_round_index = Some(self.turn.round_index.saturating_add(1));
            l.calls_so_far = Some(
                self.turn
                    .prior_calls
                    .iter()
                    .cloned()
                    .chain(calls.iter().map(|c| c.name.clone()))
                    .collect(),
            );
            l
        })
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

    /// Admits one round: stages 1–8, effect claims at dispatch, surfacing — waiting for the
    /// acting person's approval when held calls surface as `wait` ([`crate::approvals`];
    /// an approval is used only while `agent` is there to receive its calls) — then metrics
    /// and events.
    pub async fn admit(
        &self,
        round: &[ChoiceEmissions],
        agent: &impl crate::approvals::AgentEnd,
    ) -> Vec<ChoiceVerdict> {
        let mut verdicts = self.decide_round(round, Approval::Pending).await;
        if verdicts.iter().any(ChoiceVerdict::waiting) {
            // Nothing of a waiting round was dispatched (no token, no claim): it is decided
            // again, once, with the approval's outcome, and dispatched then.
            // An `edit-accept` decides the person's arguments in place of the model's.
            let settled = crate::approvals::settle(self, round, &verdicts, agent).await;
            let decided = settled.round(round);
            verdicts = self.decide_round(&decided, settled.approval()).await;
        }
        self.account(round, &verdicts).await;
        verdicts
    }

    /// Stages 1–8 and surfacing for every choice of a round, with held calls as `approval`
    /// says, then the dispatch stage for a choice that does not wait: the rate buckets of the
    /// calls released ([`admission::charge_rate`]), then their effect claims, each once; a
    /// change either makes surfaces the choice again, and a claim of a call that is then
    /// withheld is given back. A round that waits dispatches nothing.
    pub async fn decide_round(
        &self,
        round: &[ChoiceEmissions],
        approval: Approval<'_>,
    ) -> Vec<ChoiceVerdict> {
        let approved = |h: &str| matches!(approval, Approval::Accepted(set, _) if set.contains(h));
        let ctx = AdmitCtx {
            policy: &self.policy,
            schemas: &self.state.schemas,
            limits: &self.state.limits,
            person: self.person.as_deref(),
            agent: AGENT_ID,
            trust: self.trust,
            run: self.ctx.run.run_id.as_deref(),
            provider: self.turn.api.as_str(),
            approved: &approved,
            repairs_left: if n_choices(&self.body) > 1 {
                0
            } else {
                self.repairs_left
            },
        };
        let mut verdicts = Vec::with_capacity(round.len());
        for choice in round {
            let mut decisions = admission::decide_choice(&ctx, &self.turn, choice);
            match approval {
                Approval::Pending => {}
                Approval::Accepted(_, edits) => {
                    admission::refuse_held(
                        &mut decisions,
                        crate::reason::Reason::HeldAfterApproval,
                        "the call is still held after the approval (a rule holds it whatever the approval)",
                    );
                    crate::approvals::edited_outcomes(&self.turn, choice, &mut decisions, edits);
                }
                Approval::Refused(reason, why) => {
                    admission::refuse_held(&mut decisions, reason, why);
                }
            }
            let mut surfacing = admission::surface(&ctx, &mut decisions);
            let mut kept = Vec::new();
            if surfacing == Surfacing::Wait {
                verdicts.push(ChoiceVerdict {
                    choice: choice.choice,
                    decisions,
                    surfacing,
                    claims: kept,
                });
                continue;
            }
            // Dispatch: stage 6's bucket, then the effect claims (stage 8).
            if admission::charge_rate(&ctx, &choice.calls, &mut decisions) {
                surfacing = admission::surface(&ctx, &mut decisions);
            }
            let executed = |ds: &[crate::model::Decision]| {
                ds.iter().filter(|d| d.outcome == Outcome::Executed).count()
            };
            let before = executed(&decisions);
            let claimed = self.claim_effects(choice, &mut decisions).await;
            if executed(&decisions) != before {
                surfacing = admission::surface(&ctx, &mut decisions);
            }
            // A claim taken for a call the surfacing then withheld is given back.
            for (i, effect_id) in claimed {
                if !decisions[i].released() {
                    if let Err(e) = self
                        .state
                        .journal
                        .release_claim(&effect_id, &choice.calls[i].id)
                        .await
                    {
                        tracing::error!(error = %e, "an effect claim could not be given back");
                    }
                } else {
                    kept.push((effect_id, choice.calls[i].id.clone()));
                }
            }
            verdicts.push(ChoiceVerdict {
                choice: choice.choice,
                decisions,
                surfacing,
                claims: kept,
            });
        }
        verdicts
    }

    /// Dispatch: claims the effect of every executed call (OpenWOP idempotency.md Layer 2):
    /// by business identity when the tool declares a business key, else — inside a run, for a
    /// tool that is not re-runnable — by the activity recipe (`logicalInvocationId`). A repeat
    /// of a claimed effect is `suppressed-repeat`, carrying the recorded result. Returns the
    /// claims taken.
    async fn claim_effects(
        &self,
        choice: &ChoiceEmissions,
        decisions: &mut [crate::model::Decision],
    ) -> Vec<(usize, String)> {
        let mut taken = Vec::new();
        let ids = self.call_ids();
        let tenant = &self.state.config.tenant;
        // Who may read a claimed effect's recorded result (with the run).
        let reader = self
            .person
            .as_ref()
            .map_or_else(|| AGENT_ID.to_owned(), |p| format!("person:{p}"));
        for (i, call) in choice.calls.iter().enumerate() {
            if decisions[i].outcome != Outcome::Executed {
                continue;
            }
            let tool = self.policy.tool(&call.name);
            let (effect_id, keying) = if !tool.business_key.is_empty() {
                let Ok(args) = admission::arguments::parse(&call.arguments) else {
                    continue;
                };
                let key: Vec<Value> = tool
                    .business_key
                    .iter()
                    .map(|p| args.pointer(p).cloned().unwrap_or(Value::Null))
                    .collect();
                let digest = hex_sha256(&admission::arguments::canonical(
                    &json!({"toolId": tool.descriptor.tool_id, "businessKey": key}),
                ));
                (format!("{tenant}/{digest}"), "business-identity")
            } else if !tool.rerunnable() {
                match ids.logical(ids.base_ordinal + i as u64, &call.name) {
                    Some(id) => (format!("{tenant}/{id}"), "activity-recipe"),
                    None => continue, // a chat turn: no run, no activity identity
                }
            } else {
                continue;
            };
            let claim = EffectClaim {
                effect_id: effect_id.clone(),
                tool_id: tool.descriptor.tool_id.clone(),
                call_id: call.id.clone(),
                run: self.ctx.run.clone(),
                keying,
                at_ms: now_ms(),
                instance: crate::journal::instance_id().to_owned(),
                reader: reader.clone(),
            };
            let d = &mut decisions[i];
            match self.state.journal.claim_effect(claim).await {
                Ok(Claim::Claimed) => taken.push((i, effect_id)),
                // Claimed and released before (by this call id or another): the effect ran or
                // may have run; it is never released again.
                Ok(Claim::Existing { result, .. }) => {
                    d.outcome = Outcome::SuppressedRepeat;
                    d.stage = Stage::Dispatch;
                    (d.reason, d.message) = match result {
                        Some(r) => (
                            crate::reason::Reason::EffectRecorded,
                            format!("turnguard: this effect already ran; its recorded result: {r}"),
                        ),
                        None => (
                            crate::reason::Reason::EffectAlreadyClaimed,
                            "turnguard: this effect was already dispatched and its result is not recorded yet; it is not run again".into(),
                        ),
                    };
                }
                // Claimed by another principal or run: their result is theirs to read.
                Ok(Claim::Foreign) => {
                    d.outcome = Outcome::SuppressedRepeat;
                    d.stage = Stage::Dispatch;
                    d.reason = crate::reason::Reason::EffectAlreadyClaimed;
                    d.message =
                        "turnguard: this effect is already done; it is not run again".into();
                }
                Err(e) => {
                    d.outcome = Outcome::Refused;
                    d.stage = Stage::Dispatch;
                    d.reason = crate::reason::Reason::JournalUnavailable;
                    d.message = format!("the effect could not be claimed ({e}); fail closed");
                }
            }
        }
        taken
    }

    /// Metrics, per-run counters and the `agent.tool-called` / `agent.tool-returned` events.
    async fn account(&self, round: &[ChoiceEmissions], verdicts: &[ChoiceVerdict]) {
        let mut events = Vec::new();
        let principal = self.person.as_deref().unwrap_or(AGENT_ID);
        for (choice, verdict) in round.iter().zip(verdicts) {
            for (call, d) in choice.calls.iter().zip(&verdict.decisions) {
                self.state
                    .metrics
                    .tool_calls
                    .get_or_create(&CallLabels {
                        outcome: d.outcome,
                        stage: d.stage,
                        channel: "tool",
                        mode: crate::metrics::CallMode::of(d.enforced),
                        tool: self.state.metrics.tool_label(
                            if self.policy.catalog.by_id(&d.tool_id).is_some() {
                                &d.tool_id
                            } else {
                                crate::policy::rules::UNKNOWN_TOOL_ID
                            },
                        ),
                        surface: crate::metrics::CallSurface::Llm,
                    })
                    .inc();
                let tool_name = admission::sanitize_label(&call.name);
                if d.outcome != Outcome::Executed || !d.enforced {
                    // One line per decision that is not a plain release (never arguments,
                    // never the validator's message, which may quote them).
                    tracing::info!(
                        request_id = %self.ctx.request_id,
                        run = self.ctx.run.run_id.as_deref().unwrap_or(""),
                        api = self.turn.api.as_str(),
                        tool = %tool_name,
                        tool_id = %d.tool_id,
                        outcome = d.outcome.as_str(),
                        stage = d.stage.as_str(),
                        reason = d.reason.as_str(),
                        surfaced = if d.enforced { surfacing_label(&verdict.surfacing) } else { "release" },
                        mode = if d.enforced { "enforce" } else { "shadow" },
                        "{}",
                        if d.enforced { "tool call withheld" } else { "tool call released (shadow mode: enforcement would withhold it)" }
                    );
                }
                let call_id = if call.id.is_empty() {
                    "unknown".to_owned()
                } else {
                    call.id.clone()
                };
                let mut called = json!({
                    "agentId": AGENT_ID, "toolName": tool_name, "callId": call_id,
                    "principal": principal, "transport": "native"
                });
                if let (Some(h), Some(o)) = (&d.args_hash, called.as_object_mut()) {
                    o.insert("argsHash".into(), json!(h));
                }
                events.push(self.event("agent.tool-called", called));
                // The reason says how a call that does not run returns (`Reason::event_status`);
                // an executed or held call's result event follows from its run.
                let status = match d.outcome {
                    Outcome::Executed | Outcome::Held => None,
                    _ => d.reason.event_status(),
                };
                if let Some((status, code)) = status {
                    let mut returned = json!({"agentId": AGENT_ID, "toolName": tool_name, "callId": call_id, "status": status});
                    let extra = if let Some(code) = code {
                        Some((
                            "error",
                            json!({"code": code, "message": admission::explain(d)}),
                        ))
                    } else if d.outcome == Outcome::SuppressedRepeat {
                        // Not run again: the recorded result was supplied (content-free here).
                        Some((
                            "outcome",
                            json!({"suppressedRepeat": true, "recordedResultDigest": hex_sha256(d.message.as_bytes())}),
                        ))
                    } else {
                        None
                    };
                    if let (Some((k, v)), Some(o)) = (extra, returned.as_object_mut()) {
                        o.insert(k.into(), v);
                    }
                    events.push(self.event("agent.tool-returned", returned));
                }
            }
            if let Some(run) = &self.ctx.run.run_id {
                let n = verdict
                    .decisions
                    .iter()
                    .filter(|d| d.outcome == Outcome::Executed)
                    .count() as u32;
                self.state.limits.add_run(run, n);
            }
        }
        if let Err(e) = self.state.journal.record_events(events).await {
            tracing::error!(error = %e, request_id = %self.ctx.request_id, "events not journaled");
        }
    }

    /// An event of this request; its payload redacted (model-chosen names and ids included).
    fn event(&self, kind: &'static str, payload: Value) -> EventRecord {
        EventRecord {
            request_id: self.ctx.journal_id.clone(),
            run: self.ctx.run.clone(),
            at_ms: now_ms(),
            kind,
            payload: self.policy.redactor.redact("", &payload).0,
        }
    }

    /// The request body for a repair round: the choice's withheld calls as an assistant turn,
    /// then one host-authored tool result per call (tool-turn contract §B, §G).
    pub fn repaired(&self, choice: &ChoiceEmissions, items: &[crate::model::RepairItem]) -> Value {
        let mut body = self.body.clone();
        provider::append_repair(self.turn.api, &mut body, choice, items);
        body
    }

    /// Counts a repair round.
    pub fn count_repair(&mut self) {
        self.repairs_left = self.repairs_left.saturating_sub(1);
        self.state
            .metrics
            .repairs
            .get_or_create(&RepairLabels {
                api: self.turn.api.into(),
            })
            .inc();
    }
}

/// How a choice's withheld calls reach the agent, as a log label.
fn surfacing_label(s: &Surfacing) -> &'static str {
    match s {
        Surfacing::Release => "release",
        Surfacing::Drop => "drop",
        Surfacing::EndTurn(_) => "end-turn",
        Surfacing::Repair(_) => "repair",
        Surfacing::Error(_) => "error",
        Surfacing::Wait => "wait",
    }
}

fn n_choices(body: &Value) -> u64 {
    body.get("n").and_then(Value::as_u64).unwrap_or(1)
}

/// Serves one model request of `api` (`POST /v1/chat/completions`, `POST /v1/messages`,
/// `POST /v1/responses`).
pub async fn handle(state: Arc<AppState>, api: Api, req: Request<Body>) -> Response {
    let ctx = RequestCtx::new(req.headers());
    // A guard, not inc/dec: a client that disconnects drops this future half-way.
    let inflight = crate::metrics::GaugeGuard::new(&state.metrics.inflight_requests);
    let (mut resp, stream) = match turn(&state, api, &ctx, req).await {
        Ok(ok) => ok,
        Err(e) => {
            let (_, code, reason) = e.parts();
            tracing::warn!(request_id = %ctx.request_id, api = api.as_str(), code, reason, error = %e, "request refused");
            (e.response(Surface::of_api(api)), false)
        }
    };
    drop(inflight);
    state
        .metrics
        .request(api.into(), resp.status().as_u16(), stream);
    if let Ok(v) = HeaderValue::from_str(&ctx.request_id) {
        resp.headers_mut().insert("x-request-id", v);
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
    let person =
        state
            .identity
            .person_of(&parts.headers)
            .map_err(|e| WireError::Unauthenticated {
                reason: e.to_string(),
            })?;
    // The agent holds this token: it is journaled before anything else so it never approves.
    if let Some(token) = person.as_ref().and_then(|p| p.token.as_ref()) {
        state
            .identity
            .remember(&state.journal, token)
            .await
            .map_err(|e| WireError::JournalUnavailable {
                reason: e.to_string(),
            })?;
    }
    let person = person.map(|p| p.sub);
    let raw = read_request(state, &parts, body).await?;
    let json = parse_json(&raw)?;
    let mut turn = provider::parse_request(api, &json)
        .map_err(|reason| WireError::InvalidRequest { reason })?;
    check_schema_sizes(state, &turn)?;
    refuse_provider_delegation(ctx, &turn)?;
    check_run_ids(&ctx.run)?;
    let policy = state.policy.snapshot();
    let history = trust::response_chain(state, ctx, &mut turn).await;
    trust::item_references(state, ctx, &mut turn).await;
    if let Some(previous) = history.first() {
        turn.continue_chain(previous);
    }
    let trust = admission::trust::of_turn(&turn, &policy, &history);
    let mut untrusted_inputs = admission::trust::untrusted_inputs(&turn, &policy, &history);
    let trust = trust::sticky(state, ctx, trust).await;
    if trust == ContentTrust::Untrusted && untrusted_inputs.is_empty() {
        if let Some(run_id) = &ctx.run.run_id {
            untrusted_inputs.push(admission::trust::UntrustedInput::EarlierTurnOfRun {
                run_id: admission::sanitize_label(run_id),
            });
        }
    }
    seed_run_counter(state, ctx).await?;
    state
        .metrics
        .turns
        .get_or_create(&TrustLabels { trust })
        .inc();
    if let Some(reason) = admission::clarification_unsupported(&turn, &policy) {
        return Err(WireError::CapabilityNotProvided { reason });
    }
    let channel = channel_of(&parts.headers, api, &json, &turn, &policy)?;
    if let Some(spec) = channel
        .as_ref()
        .filter(|c| c.channel == Channel::Structured)
    {
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
            })?;
    }
    // A run node needs durable records (tool-turn contract §D): while the journal is failing
    // it is refused at once, before anything goes upstream.
    if ctx.run.run_id.is_some() {
        if let Some(reason) = state.journal.health().failing() {
            return Err(WireError::JournalUnavailable {
                reason: format!("durable writes are failing ({reason})"),
            });
        }
    }
    record_tool_results(state, ctx, &turn, &policy).await?;
    record_declared_tools(state, ctx, &turn).await;

    let agent_digest = crate::recipes::semantic_request_digest(api, &json);
    let mode = run_mode(&parts.headers)?;
    let mut json = json;
    provider::prepare_upstream(&mut json, &mut turn);
    let mut session = Session {
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
        headers: upstream::request_headers(&parts.headers, true),
        body: json,
        turn,
        rounds: 0,
        person,
        untrusted_inputs,
    };
    if let Some(answer) = crate::proxy::recovery::serve_recorded(&session, mode).await? {
        return Ok((answer, false));
    }
    loop {
        let sent = tokio::time::Instant::now();
        let resp = session.send().await?;
        let base = session.base(resp.status().as_u16());
        if !resp.status().is_success() {
            // Upstream errors pass through unchanged (status, headers, body).
            record_upstream_error(&session, &base);
            let (p, b) = resp.into_parts();
            let mut out = Response::new(Body::new(b));
            *out.status_mut() = p.status;
            *out.headers_mut() = upstream::response_headers(&p.headers, true);
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
        let (p, b) = resp.into_parts();
        let body_started = Instant::now();
        let body = read_upstream_json(state, b, sent).await;
        crate::edge::upstream_waited(body_started, body_started.elapsed());
        let body = body
            .and_then(|b| {
                upstream::decode_body(coding, b, state.config.max_response_bytes)
                    .map_err(|e| format!("response body: {e}"))
            })
            .map_err(|reason| WireError::UpstreamUnavailable {
                upstream: api.upstream().to_owned(),
                reason,
            })?;
        match surface_json(&session, &base, body).await? {
            JsonRound::Respond(body, calls, secrets, claims) => {
                let content_type = p
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("application/json");
                let kept = Recorded::redacted(
                    &body,
                    &session.policy.redactor,
                    state.config.journal_max_record_bytes,
                );
                let kept = if secrets { kept.withheld() } else { kept };
                session
                    .record_served(p.status.as_u16(), content_type, kept, calls, claims)
                    .await
                    .map_err(|e| WireError::JournalUnavailable {
                        reason: e.to_string(),
                    })?;
                let mut out = Response::new(Body::from(body));
                *out.status_mut() = p.status;
                *out.headers_mut() = upstream::response_headers(&p.headers, false);
                return Ok((out, false));
            }
            JsonRound::Repair(next) => {
                session.body = next;
                session.count_repair();
            }
            JsonRound::Error(e) => return Ok((surfaced_error(&e, Surface::of_api(api)), false)),
        }
    }
}

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
    if let Some(name) = headers
        .get("turnguard-prompted-schema")
        .and_then(|v| v.to_str().ok())
    {
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
    if let Some((name, schema)) = provider::structured_schema(api, body) {
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

/// Reads the agent's request body (capped, within `body_read_timeout_ms`), then takes the
/// data plane's concurrency permit ([`crate::edge::admit`]): a client still sending its body
/// holds no permit.
/// Reads a data-plane request body: capped at `max_body_bytes`, within
/// `body_read_timeout_ms`, then takes the concurrency permit ([`crate::edge::admit`]).
///
/// Errors: 413, 408, 400, or 503 when shed.
pub(crate) async fn read_request(
    state: &AppState,
    parts: &http::request::Parts,
    body: Body,
) -> Result<Bytes, WireError> {
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

/// Reads a non-stream upstream body: capped at `max_response_bytes`, at most
/// `upstream_idle_timeout_ms` between chunks, and done within `upstream_response_timeout_ms`
/// of sending the request (the response timeout bounds the whole exchange). The error names
/// the limit and its flag.
async fn read_upstream_json(
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

/// A request declaring a tool schema over `max_schema_bytes` is refused before it goes
/// upstream (issue 11: compiled schemas are bounded in memory).
fn check_schema_sizes(state: &AppState, turn: &Turn) -> Result<(), WireError> {
    for tool in &turn.tools {
        let Some(schema) = &tool.schema else { continue };
        state
            .schemas
            .check_size(schema)
            .map_err(|(bytes, limit_bytes)| WireError::SchemaTooLarge {
                what: format!(
                    "declared schema of tool `{}`",
                    admission::sanitize_label(&tool.name)
                ),
                bytes,
                limit_bytes,
            })?;
    }
    Ok(())
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
/// / -` (≤ 200), a node id of `A-Z a-z 0-9 . _ ~ : -` (≤ 128, ids.schema.json `nodeId`).
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
            reason: "`Turnguard-Run` must be 1-200 of A-Z a-z 0-9 . _ ~ : / -".into(),
        });
    }
    if run.node_id.as_deref().is_some_and(|n| !ok(n, 128, false)) {
        return Err(WireError::InvalidRequest {
            reason: "`Turnguard-Node` must be 1-128 of A-Z a-z 0-9 . _ ~ : -".into(),
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

/// Records the tool results the request carries, durably, before it goes upstream
/// (tool-turn contract §D). A record failure fails the request (503) when any of the results
/// belongs to a tool that is not re-runnable (or that the catalog does not know); results of
/// re-runnable tools only are logged and counted, and the request goes on.
async fn record_tool_results(
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
async fn record_declared_tools(state: &AppState, ctx: &RequestCtx, turn: &Turn) {
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

/// How a non-stream round ends.
enum JsonRound {
    /// Send this body to the agent; these calls go with it; whether a call carried a secret.
    Respond(Bytes, Vec<ServedCall>, bool, Vec<(String, String)>),
    /// Ask the model again with this body.
    Repair(Value),
    /// Fail the request.
    Error(SurfacedError),
}

/// A non-stream response: adapter → admission → surface → record.
async fn surface_json(
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
    let round = match provider::parse_response(turn.api, &json, turn) {
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
    let verdicts = session
        .admit(&with_calls, &crate::approvals::InRequest)
        .await;
    let mut rec = round_record(session, base, RoundState::Ok, &body);
    if has_secrets(&verdicts) {
        rec.response = rec.response.withheld();
    }
    rec.completion = Some(join(round.iter().map(|c| c.completion.state.as_str())));
    rec.finish_reason = Some(join(round.iter().map(|c| c.completion.reason.as_str())));
    rec.calls = call_records(&with_calls, &verdicts, &session.call_ids());
    rec.response_link = session.judged(provider::response_link(&json, turn), &rec.calls);

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
    } else if provider::rewrite_response(turn.api, &mut json, &verdicts) {
        JsonRound::Respond(
            Bytes::from(json.to_string()),
            session.served_calls(&with_calls, &verdicts),
            has_secrets(&verdicts),
            claims_of(&verdicts),
        )
    } else {
        JsonRound::Respond(
            body.clone(),
            session.served_calls(&with_calls, &verdicts),
            has_secrets(&verdicts),
            claims_of(&verdicts),
        )
    };
    record_round(session, rec).await;
    Ok(outcome)
}

impl Session {
    /// Validates text answers of the structured / prompted channel (§A). `None`: nothing to
    /// enforce (no channel, a tool turn, valid, or a refusal — which is never retried).
    fn check_channel(&self, round: &[ChoiceEmissions], rec: &mut RoundRecord) -> Option<JsonRound> {
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
        if repairable && self.repairs_left > 0 && n_choices(&self.body) == 1 {
            rec.state = RoundState::Repaired;
            let mut next = self.body.clone();
            let feedback = format!(
                "turnguard: {message}. Answer again with only a JSON document valid against the schema `{}`.",
                admission::sanitize_label(&spec.name)
            );
            provider::append_text_repair(
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

async fn journal_round(state: &AppState, mut rec: RoundRecord) {
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

fn record_upstream_error(session: &Session, base: &RoundBase) {
    let mut rec = round_record(session, base, RoundState::UpstreamError, b"");
    rec.redact_text(&session.policy.redactor);
    let state = Arc::clone(&session.state);
    tokio::spawn(async move { journal_round(&state, rec).await });
}

/// Passes an emission-free endpoint (`GET /v1/models`, `POST /v1/embeddings`,
/// `POST /v1/messages/count_tokens`) to `upstream` unchanged, body capped.
pub async fn passthrough(
    state: Arc<AppState>,
    upstream_name: &'static str,
    req: Request<Body>,
) -> Response {
    let ctx = RequestCtx::new(req.headers());
    let surface = Surface::of_request(req.uri().path(), req.headers());
    let (parts, body) = req.into_parts();
    let result = async {
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
    let mut resp = match result {
        Ok(r) => {
            let (p, b) = r.into_parts();
            let mut out = Response::new(Body::new(b));
            *out.status_mut() = p.status;
            *out.headers_mut() = upstream::response_headers(&p.headers, true);
            out
        }
        Err(e) => e.response(surface),
    };
    state.metrics.request(
        crate::metrics::ApiLabel::Passthrough,
        resp.status().as_u16(),
        false,
    );
    if let Ok(v) = HeaderValue::from_str(&ctx.request_id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}
