//! One model round's decision and dispatch, as `impl Session` stages: `admit` (the pure
//! admission, the approval wait, then `decide_round` once), `claim_effects` (effect claims,
//! insert-if-absent), `account` (metrics, per-run counters, `agent.tool-called` /
//! `agent.tool-returned` events), and the repair bookkeeping (`repaired`, `count_repair`).

use crate::strict_json::Lookup as _;
use serde_json::{json, Value};
use std::borrow::Cow;

use super::hex_sha256;
use crate::admission::{self, AdmitCtx};
use crate::approvals::Approval;
use crate::clock::{now_ms, AGENT_ID};
use crate::journal::{CallRecord, Claim, EffectClaim, EventRecord};
use crate::metrics::RepairLabels;
use crate::model::{ChoiceEmissions, ChoiceVerdict, Outcome, Stage, Surfacing};
use crate::provider;
use crate::request::Session;

impl Session {
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

    /// Admits one round: stages 1–8, effect claims at dispatch, surfacing — waiting for the
    /// acting person's approval when held calls surface as `wait` ([`crate::approvals`];
    /// an approval is used only while `agent` is there to receive its calls) — then metrics.
    /// Returns the verdicts and the round's `agent.tool-called` / `agent.tool-returned`
    /// events, for the caller to journal with the round ([`crate::journal::RoundCommit`]).
    pub async fn admit(
        &self,
        round: &[ChoiceEmissions],
        agent: &impl crate::approvals::AgentEnd,
    ) -> (Vec<ChoiceVerdict>, Vec<EventRecord>) {
        let mut verdicts = self.decide_round(round, Approval::Pending).await;
        if verdicts.iter().any(ChoiceVerdict::waiting) {
            // Nothing of a waiting round was dispatched (no token, no claim): it is decided
            // again, once, with the approval's outcome, and dispatched then.
            // An `edit-accept` decides the person's arguments in place of the model's.
            // Boxed: the wait for a person is the cold path, and its state (~3 KB) would
            // otherwise be part of every round's future, moved at each level that awaits it.
            let settled = Box::pin(crate::approvals::settle(self, round, &verdicts, agent)).await;
            let decided = settled.round(round);
            verdicts = self.decide_round(&decided, settled.approval()).await;
        }
        let events = self.account(round, &verdicts);
        (verdicts, events)
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
        let approved = |choice: u32, index: usize, h: &str| {
            matches!(approval, Approval::Accepted(bound, _)
                if bound.iter().any(|b| b.choice == choice && b.index == index && b.args_hash == h))
        };
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
            repairs_left: if crate::provider::adapter(self.turn.api)
                .choices_requested(self.body.tree())
                > 1
            {
                0
            } else {
                self.repairs_left
            },
            explain: false,
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
    pub(super) async fn claim_effects(
        &self,
        choice: &ChoiceEmissions,
        decisions: &mut [crate::model::Decision],
    ) -> Vec<(usize, String)> {
        let mut taken = Vec::new();
        let ids = self.call_ids();
        let tenant = &self.state.config.tenant;
        // Who may read a claimed effect's recorded result (with the run).
        let reader = self.reader();
        let mut wanted: Vec<(usize, EffectClaim)> = Vec::new();
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
                    .map(|p| args.at(p).cloned().unwrap_or(Value::Null))
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
            wanted.push((
                i,
                EffectClaim {
                    effect_id,
                    tool_id: tool.descriptor.tool_id.clone(),
                    call_id: call.id.clone(),
                    run: self.ctx.run.clone(),
                    keying,
                    at_ms: now_ms(),
                    instance: crate::journal::instance_id().to_owned(),
                    reader: reader.clone(),
                },
            ));
        }
        if wanted.is_empty() {
            return taken;
        }
        // The round's claims in one commit, in call order.
        let (index, claims): (Vec<usize>, Vec<EffectClaim>) = wanted.into_iter().unzip();
        let effect_ids: Vec<String> = claims.iter().map(|c| c.effect_id.clone()).collect();
        let answers = match self.state.journal.claim_effects(claims).await {
            Ok(answers) if answers.len() == index.len() => answers.into_iter().map(Ok).collect(),
            Ok(_) => vec![
                Err("the journal answered a different number of claims".to_owned());
                index.len()
            ],
            Err(e) => vec![Err(e.to_string()); index.len()],
        };
        for ((i, effect_id), answer) in index.into_iter().zip(effect_ids).zip(answers) {
            let d = &mut decisions[i];
            match answer {
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

    /// Metrics, per-run counters, and the `agent.tool-called` / `agent.tool-returned` events
    /// of the round's decisions (returned, journaled by the caller with the round).
    pub(super) fn account(
        &self,
        round: &[ChoiceEmissions],
        verdicts: &[ChoiceVerdict],
    ) -> Vec<EventRecord> {
        let mut events = Vec::new();
        for (choice, verdict) in round.iter().zip(verdicts) {
            for (call, d) in choice.calls.iter().zip(&verdict.decisions) {
                self.state.metrics.count_call(
                    d,
                    self.policy.catalog.by_id(&d.tool_id).is_some(),
                    crate::metrics::CallSurface::Llm,
                );
                // The decision carries the label already (never empty once set).
                let tool_name = if d.tool_name.is_empty() {
                    admission::sanitize_label(&call.name)
                } else {
                    d.tool_name.clone()
                };
                if d.outcome != Outcome::Executed || !d.enforced {
                    // One line per decision that is not a plain release (never arguments,
                    // never the validator's message, which may quote them).
                    tracing::info!(
                        request_id = %self.ctx.request_id(),
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
                events.push(self.tool_called(&tool_name, &call_id, d.args_hash.as_deref()));
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
        events
    }

    /// An event of this request; its payload redacted (model-chosen names and ids included).
    pub(super) fn event(&self, kind: &'static str, mut payload: Value) -> EventRecord {
        self.policy.redactor.redact_in_place("", &mut payload);
        self.event_text(kind, crate::strict_json::to_text(&payload))
    }

    /// An event of this request whose payload is already redacted JSON text.
    fn event_text(&self, kind: &'static str, payload: String) -> EventRecord {
        EventRecord {
            request_id: self.ctx.journal_id.clone(),
            run: self.ctx.run.clone(),
            at_ms: now_ms(),
            kind,
            payload,
        }
    }

    /// `agent.tool-called` of a call of this request: the payload serialized from its fields
    /// (no tree), each string redacted as [`Session::event`] redacts a tree's.
    fn tool_called(&self, tool_name: &str, call_id: &str, args_hash: Option<&str>) -> EventRecord {
        let r = |s| self.policy.redactor.redact_str(s);
        let payload = ToolCalled {
            agent_id: r(AGENT_ID),
            tool_name: r(tool_name),
            call_id: r(call_id),
            principal: r(self.person.as_deref().unwrap_or(AGENT_ID)),
            transport: r("native"),
            args_hash: args_hash.map(r),
        };
        self.event_text("agent.tool-called", payload.to_text())
    }

    /// The request body for a repair round: the choice's withheld calls as an assistant turn,
    /// then one host-authored tool result per call (tool-turn contract §B, §G).
    pub fn repaired(
        &self,
        choice: &ChoiceEmissions,
        items: &[crate::model::RepairItem],
    ) -> crate::strict_json::RequestBody {
        let mut body = self.body.clone();
        provider::adapter(self.turn.api).append_repair(body.tree_mut(), choice, items);
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
pub(super) fn surfacing_label(s: &Surfacing) -> &'static str {
    match s {
        Surfacing::Release => "release",
        Surfacing::Drop => "drop",
        Surfacing::EndTurn(_) => "end-turn",
        Surfacing::Repair(_) => "repair",
        Surfacing::Error(_) => "error",
        Surfacing::Wait => "wait",
    }
}

/// `agent.tool-called`'s payload (OpenWOP `run-event-payloads`), its fields in the order the
/// journal has always stored them.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolCalled<'a> {
    agent_id: Cow<'a, str>,
    tool_name: Cow<'a, str>,
    call_id: Cow<'a, str>,
    principal: Cow<'a, str>,
    transport: Cow<'a, str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    args_hash: Option<Cow<'a, str>>,
}

impl ToolCalled<'_> {
    /// The payload as JSON text: the bytes `serde_json::to_string` writes for it (the names
    /// written as they are, each value by `jcs::write_str`, serde_json's escapes; the test
    /// below holds the two equal). Through serde_json each of the twelve names and values
    /// went through its byte-at-a-time escaper: 2.6k instructions a call under callgrind
    /// (issue 13, profile-led).
    fn to_text(&self) -> String {
        // Sized once: the member names and braces are 60 bytes, `,"argsHash":` 12 more, each
        // value's quotes 2; the buffer grows only when a value needs escapes (128 bytes
        // regrew it for every call with an `argsHash`).
        let values = [
            &self.agent_id,
            &self.tool_name,
            &self.call_id,
            &self.principal,
            &self.transport,
        ];
        let len = values.iter().map(|v| v.len() + 2).sum::<usize>()
            + self.args_hash.as_ref().map_or(0, |h| h.len() + 14);
        let mut out = Vec::with_capacity(60 + len);
        let member = |out: &mut Vec<u8>, name: &[u8], value: &str| {
            out.extend_from_slice(name);
            crate::jcs::write_str(out, value);
        };
        member(&mut out, b"{\"agentId\":", &self.agent_id);
        member(&mut out, b",\"toolName\":", &self.tool_name);
        member(&mut out, b",\"callId\":", &self.call_id);
        member(&mut out, b",\"principal\":", &self.principal);
        member(&mut out, b",\"transport\":", &self.transport);
        if let Some(hash) = &self.args_hash {
            member(&mut out, b",\"argsHash\":", hash);
        }
        out.push(b'}');
        // The text is UTF-8 (the names are ASCII, every value was a `str`); serde_json is the
        // fallback all the same.
        String::from_utf8(out)
            .unwrap_or_else(|_| serde_json::to_string(self).unwrap_or_else(|_| "{}".to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ToolCalled::to_text` is serde_json's text of the same payload, whatever the strings
    /// hold, with and without `argsHash`.
    #[test]
    fn the_tool_called_text_is_serde_jsons() {
        let odd = [
            "",
            "agent",
            "get_weather",
            "call_\"quoted\"\\back",
            "new\nline\ttab\u{7}\u{1f}\u{7f}",
            "\u{e9}\u{2028}\u{1f600}",
            "a much longer value that spans more than eight bytes twice over",
        ];
        for (i, s) in odd.iter().enumerate() {
            let other = odd[(i + 3) % odd.len()];
            for hash in [None, Some(Cow::Borrowed(other))] {
                let payload = ToolCalled {
                    agent_id: Cow::Borrowed(s),
                    tool_name: Cow::Borrowed(other),
                    call_id: Cow::Owned(format!("{s}{other}")),
                    principal: Cow::Borrowed(s),
                    transport: Cow::Borrowed("native"),
                    args_hash: hash,
                };
                assert_eq!(payload.to_text(), serde_json::to_string(&payload).unwrap());
            }
        }
    }
}
