//! The admission order of tool-turn contract §B. Every tool call goes through, strictly in
//! order, and stops at the first stage that decides it:
//!
//! 1. **completion** ([`completion`]) — truncated or refused output is never released;
//! 2. **name** ([`name`]) — declared in the request, known to (or allowed unknown by) the catalog;
//! 3. **arguments** ([`arguments`]) — a JSON object valid against both schemas;
//! 4. **trust** ([`trust`]) — an untrusted turn may not run a gated tool without approval;
//! 5. **authorization** — the bundle's Cedar rules ([`crate::policy::Rules`]);
//! 6. **limits** ([`limits`]) — per turn, per run, per (principal, tool) bucket, clarifications;
//! 7. **redaction** — secrets removed; `argsHash` taken over the redacted form;
//! 8. **dispatch and record** — released (the proxy claims effects and journals).
//!
//! Admission is pure and cannot fail: anything it cannot evaluate is withheld. [`surface`]
//! then picks how the withheld calls reach the agent (DESIGN.md §4).

pub mod arguments;
pub mod channel;
pub mod completion;
pub mod limits;
pub mod name;
pub mod trust;

use serde_json::Value;

use crate::model::{
    ChoiceEmissions, ChoiceVerdict, Decision, Outcome, RepairItem, Stage, SurfacedError, Surfacing,
    Turn,
};
use crate::policy::bundle::{ContentTrust, Mode, Surface};
use crate::policy::{Authz, AuthzRequest, CompiledPolicy};
pub use arguments::SchemaCache;
pub use limits::LimitState;

/// What admission needs besides the call: the policy snapshot, shared caches and state, and
/// the facts of the turn.
pub struct AdmitCtx<'a> {
    /// The request's policy snapshot.
    pub policy: &'a CompiledPolicy,
    /// Compiled argument schemas.
    pub schemas: &'a SchemaCache,
    /// Limits state.
    pub limits: &'a LimitState,
    /// The verified acting person (`sub`), if any.
    pub person: Option<&'a str>,
    /// The agent's own identity.
    pub agent: &'a str,
    /// The turn's `contentTrust` ([`trust::of_turn`]).
    pub trust: ContentTrust,
    /// Run id, for a run node.
    pub run: Option<&'a str>,
    /// Provider API label.
    pub provider: &'a str,
    /// An approval covers the call at (choice, position in the choice) with this `argsHash`:
    /// an approval binds the calls it showed the person, each at its place (tool-turn
    /// contract §C), so the same arguments elsewhere in the round are not approved.
    pub approved: &'a (dyn Fn(u32, usize, &str) -> bool + Sync),
    /// Repair rounds left for this agent request.
    pub repairs_left: u32,
    /// Whether each decision carries its stage-by-stage notes ([`Decision::trace`], read by
    /// `turnguard policy explain`). The request path and the MCP front decide without them:
    /// nothing there reads the notes, and formatting them was eight strings per call.
    pub explain: bool,
}

/// Decides every call of one choice, in emission order, and how the withheld ones surface,
/// charging the rate buckets of the calls released ([`charge_rate`]) — the proxy's order
/// without the journal (no effect claims, no approval wait).
pub fn admit_choice(ctx: &AdmitCtx<'_>, turn: &Turn, choice: &ChoiceEmissions) -> ChoiceVerdict {
    let mut decisions = decide_choice(ctx, turn, choice);
    let mut surfacing = surface(ctx, &mut decisions);
    if surfacing != Surfacing::Wait && charge_rate(ctx, &choice.calls, &mut decisions) {
        surfacing = surface(ctx, &mut decisions);
    }
    ChoiceVerdict {
        choice: choice.choice,
        decisions,
        surfacing,
        claims: Vec::new(),
    }
}

/// Stage 6's (principal, tool) token bucket, applied at dispatch: once per call, only for
/// calls about to be released (`executed` after [`surface`], and never for a round that
/// waits), so a round admitted again after its approval is not charged twice. A call whose
/// bucket is spent becomes `refused` at the limits stage (`rate_limited`, with
/// `retry_after_secs`; released anyway in shadow mode). Returns whether any decision changed:
/// the caller then surfaces the choice again. A token already taken for a call that the new
/// surfacing withholds is not given back (a bucket is never credited: the error is toward
/// fewer calls).
pub fn charge_rate(
    ctx: &AdmitCtx<'_>,
    calls: &[crate::model::ToolCall],
    decisions: &mut [Decision],
) -> bool {
    let rate = &ctx.policy.settings.limits.rate;
    let principal = ctx.person.unwrap_or(ctx.agent);
    let mut changed = false;
    for (call, d) in calls.iter().zip(decisions.iter_mut()) {
        if d.outcome != Outcome::Executed {
            continue;
        }
        let tool = ctx.policy.tool(&call.name);
        if let Err(secs) = ctx.limits.take(principal, &tool.descriptor.tool_id, rate) {
            d.outcome = Outcome::Refused;
            d.stage = Stage::Limits;
            d.reason = crate::reason::Reason::RateLimited;
            d.message = format!("the rate limit for this tool is spent; retry in {secs} s");
            d.retry_after_secs = Some(secs);
            d.enforced = ctx.policy.mode_for(tool) != Mode::Shadow;
            if ctx.explain {
                d.trace.push((
                    Stage::Limits,
                    format!("refused: rate_limited — {}", d.message),
                ));
            }
            changed = true;
        }
    }
    changed
}

/// Stages 1–8 for every call of one choice, in emission order. Pure: reads the policy, the
/// schema cache and the run counters, changes nothing (the rate bucket is charged at
/// dispatch, [`charge_rate`]).
pub fn decide_choice(ctx: &AdmitCtx<'_>, turn: &Turn, choice: &ChoiceEmissions) -> Vec<Decision> {
    let mut decisions = Vec::with_capacity(choice.calls.len());
    let mut reached_limits = 0u32;
    let mut released = 0u32;
    let mut asked = false;
    for (index, call) in choice.calls.iter().enumerate() {
        let mut d = decide(ctx, turn, choice, index, &mut reached_limits, released);
        if asked {
            // §E: a clarification ends the turn; every call after it is dropped, whatever
            // admission found (it is still decided and journaled).
            d.outcome = Outcome::EndedTurn;
            d.stage = Stage::Dispatch;
            d.reason = crate::reason::Reason::AfterClarification;
            d.message = "a question to the person ended the turn before this call".into();
        }
        if d.outcome == Outcome::Executed {
            released += 1;
            asked |= ctx.policy.tool(&call.name).clarification;
        }
        // Shadow mode: decide, journal, count — but release, unless the contract makes the
        // refusal absolute (a truncated or refused completion).
        let tool = ctx.policy.tool(&call.name);
        if d.outcome != Outcome::Executed
            && d.stage != Stage::Completion
            && ctx.policy.mode_for(tool) == Mode::Shadow
        {
            d.enforced = false;
        }
        decisions.push(d);
    }
    decisions
}

/// One call through stages 1–8 (tool-turn contract §B): the decision, with the trace of every
/// stage it passed, the redacted arguments and their `argsHash`.
fn decide(
    ctx: &AdmitCtx<'_>,
    turn: &Turn,
    choice: &ChoiceEmissions,
    index: usize,
    reached_limits: &mut u32,
    released_before: u32,
) -> Decision {
    let call = &choice.calls[index];
    let tool = ctx.policy.tool(&call.name);
    let args = arguments::parse_call(call);
    // Redaction runs for every parsed call so that every record carries the redacted form;
    // it never decides an outcome (stage 7). Arguments without a secret are their own
    // redacted form: copied only when there is something to replace.
    let redacted = args.as_ref().ok().and_then(|a| {
        ctx.policy
            .redactor
            .redacted_copy(&tool.descriptor.tool_id, a)
    });
    let hash = match (&redacted, &args) {
        (Some((r, _)), _) | (None, Ok(r)) => Some(arguments::args_hash(r)),
        (None, Err(_)) => None,
    };
    let mut call_ctx = CallCtx {
        ctx,
        turn,
        choice,
        index,
        call,
        tool,
        hash,
        secrets: redacted.as_ref().map_or(0, |(_, n)| *n),
        redacted_args: redacted.map(|(r, _)| r),
        trace: Vec::new(),
    };
    let d = match call_ctx.stages(&args, reached_limits, released_before) {
        Ok(d) => d,
        Err(ended) => *ended,
    };
    call_ctx.finish(d, args.ok())
}

/// A stage ended the call with this decision (boxed: the early-return path of [`CallCtx`]'s
/// stages).
type Ended = Box<Decision>;

/// What the stages of one call share: the call, its catalog entry, its redacted arguments and
/// their hash, and the trace so far.
struct CallCtx<'a> {
    ctx: &'a AdmitCtx<'a>,
    turn: &'a Turn,
    choice: &'a ChoiceEmissions,
    /// The call's position in the choice.
    index: usize,
    call: &'a crate::model::ToolCall,
    tool: &'a crate::policy::catalog::CatalogTool,
    hash: Option<String>,
    secrets: usize,
    /// The redacted copy of the arguments, when they held a secret (otherwise the
    /// arguments are their own redacted form: [`CallCtx::finish`]).
    redacted_args: Option<Value>,
    trace: Vec<(Stage, String)>,
}

impl CallCtx<'_> {
    /// Stages 1–8 in order: `Err` is the stage that ended the call, `Ok` the dispatch decision.
    fn stages(
        &mut self,
        args: &Result<Value, arguments::ArgsError>,
        reached_limits: &mut u32,
        released_before: u32,
    ) -> Result<Decision, Ended> {
        let (ctx, turn, call, tool) = (self.ctx, self.turn, self.call, self.tool);
        // 1. completion
        if let Some(d) = completion::check(&self.choice.completion) {
            return Err(Box::new(d));
        }
        let completion = &self.choice.completion;
        self.note(Stage::Completion, || format!("pass: {}", completion.reason));
        // 2. name
        if let Some(d) = name::check(turn, call, ctx.policy) {
            return Err(Box::new(d));
        }
        self.note(Stage::Name, || {
            format!(
                "pass: {} → {}",
                sanitize_label(&call.name),
                tool.descriptor.tool_id
            )
        });
        // 3. arguments
        let catalog_schema = tool.input_validator(|s| ctx.schemas.compile(s));
        if let Some(d) = arguments::check(turn, call, args, catalog_schema, ctx.schemas) {
            return Err(Box::new(d));
        }
        self.note(Stage::Arguments, || {
            "pass: valid against the declared and catalog schemas".into()
        });
        let Ok(args) = args else {
            // Unreachable in practice: stage 3 refuses unparsable arguments.
            return Err(Box::new(Decision::new(
                Outcome::Invalid,
                Stage::Arguments,
                crate::reason::Reason::ArgumentsNotJson,
                "the arguments are not valid JSON".into(),
            )));
        };
        // 4. trust, 5. authorization
        self.trust_and_authorization(args)?;
        // 6. limits
        self.limits(reached_limits, released_before)?;
        // 7. redaction
        let strip = self.redaction()?;
        // 8. dispatch
        let mut d = Decision::new(
            Outcome::Executed,
            Stage::Dispatch,
            crate::reason::Reason::Released,
            String::new(),
        );
        if strip {
            // `strip` means secrets were found, so the redacted copy exists.
            d.release_args = self.redacted_args.as_ref().map(crate::strict_json::to_text);
        }
        Ok(d)
    }

    /// Stages 4 (trust) and 5 (authorization): a call the turn's trust holds is refused at
    /// once when an approval could not release it either.
    fn trust_and_authorization(&mut self, args: &Value) -> Result<(), Ended> {
        let (ctx, turn, tool) = (self.ctx, self.turn, self.tool);
        let approved = self
            .hash
            .as_deref()
            .is_some_and(|h| (ctx.approved)(self.choice.choice, self.index, h));
        // Provider-executed output in this very response is untrusted input to its calls.
        let turn_trust = if self.choice.provider_output {
            ContentTrust::Untrusted
        } else {
            ctx.trust
        };
        let authorize = |approved: bool| {
            ctx.policy.rules.authorize(&AuthzRequest {
                person: ctx.person,
                agent: ctx.agent,
                tool,
                trust: turn_trust.as_str(),
                provider: ctx.provider,
                model: turn.model.as_deref().unwrap_or(""),
                run: ctx.run.unwrap_or(""),
                approved,
                args,
            })
        };
        if let Some(d) = trust::check(turn_trust, tool, approved) {
            // Never ask a person to approve what authorization refuses anyway.
            if let Some(refused) = refused_even_if_approved(authorize(true)) {
                self.note(Stage::Trust, || format!("held: {}", d.reason));
                return Err(Box::new(refused));
            }
            return Err(Box::new(d));
        }
        self.note(Stage::Trust, || {
            format!("pass: turn is {}", ctx.trust.as_str())
        });
        match authorize(approved) {
            Authz::Permit(rules) => {
                self.note(Stage::Authorization, || {
                    format!("permit: {}", rules.join(", "))
                });
                Ok(())
            }
            Authz::Hold(rules) => {
                if !approved {
                    // A hold that an approval would not lift (another rule forbids the
                    // approved call) is refused now.
                    if let Some(d) = refused_even_if_approved(authorize(true)) {
                        return Err(Box::new(d));
                    }
                }
                let mut d = Decision::new(
                    Outcome::Held,
                    Stage::Authorization,
                    crate::reason::Reason::HeldByRule,
                    format!(
                        "held for the acting person's approval by {}",
                        rules.join(", ")
                    ),
                );
                d.rules = rules;
                Err(Box::new(d))
            }
            Authz::Refuse {
                rules,
                reason,
                detail,
            } => {
                let mut d = Decision::new(Outcome::Refused, Stage::Authorization, reason, detail);
                d.rules = rules;
                Err(Box::new(d))
            }
        }
    }

    /// Stage 6: calls per turn, clarification rounds, calls per run. The (principal, tool)
    /// token bucket is charged at dispatch, once, for the calls that are released
    /// ([`charge_rate`]): deciding takes nothing.
    fn limits(&mut self, reached_limits: &mut u32, released_before: u32) -> Result<(), Ended> {
        let (ctx, turn, tool) = (self.ctx, self.turn, self.tool);
        let refuse = |reason, message| {
            Err(Box::new(Decision::new(
                Outcome::Refused,
                Stage::Limits,
                reason,
                message,
            )))
        };
        *reached_limits += 1;
        let limits = &ctx.policy.settings.limits;
        if *reached_limits > limits.tool_calls_per_turn {
            return refuse(
                crate::reason::Reason::RateLimited,
                format!(
                    "more than {} tool calls in one turn",
                    limits.tool_calls_per_turn
                ),
            );
        }
        if tool.clarification {
            let asks = turn
                .prior_calls
                .iter()
                .filter(|n| {
                    ctx.policy
                        .catalog
                        .by_name(n)
                        .is_some_and(|t| t.clarification)
                })
                .count() as u32;
            if asks >= limits.clarification_rounds {
                return refuse(
                    crate::reason::Reason::ClarificationRoundsExceeded,
                    format!(
                        "this run already asked the person {asks} time(s); the limit is {}",
                        limits.clarification_rounds
                    ),
                );
            }
        }
        if let Some(run) = ctx.run {
            if ctx.limits.run_count(run).saturating_add(released_before)
                >= limits.tool_calls_per_run
            {
                return refuse(
                    crate::reason::Reason::RateLimited,
                    format!(
                        "the run reached its limit of {} tool calls",
                        limits.tool_calls_per_run
                    ),
                );
            }
        }
        self.note(Stage::Limits, || "pass".into());
        Ok(())
    }

    /// Stage 7: whether the released arguments must have their secrets stripped (an egress
    /// tool under `strip_from_egress`); refused when this surface cannot rewrite them.
    fn redaction(&mut self) -> Result<bool, Ended> {
        let (ctx, turn, call, tool) = (self.ctx, self.turn, self.call, self.tool);
        let found = self.secrets;
        self.note(Stage::Redaction, || {
            format!("{found} secret(s) redacted from every record")
        });
        let strip = found > 0
            && ctx.policy.redactor.strip_from_egress
            && tool.descriptor.egress != Some(crate::policy::bundle::Egress::None);
        if strip && (turn.arguments_fixed || call.input == crate::model::CallInput::Text) {
            // Arguments the adapter cannot rewrite (`Turn::arguments_fixed`), or a free-form
            // call's raw input: fail closed rather than release a secret to an egress tool.
            return Err(Box::new(Decision::new(
                Outcome::Refused,
                Stage::Redaction,
                crate::reason::Reason::StripUnsupported,
                "the arguments carry a secret that must be stripped before an egress tool, which this stream cannot rewrite".into(),
            )));
        }
        Ok(strip)
    }

    /// The decision with what every decision carries: the tool, the hash and redacted
    /// arguments (the redacted copy, or `args` themselves when they held no secret), the
    /// secrets count and the trace ending in the deciding stage's note.
    fn finish(self, mut d: Decision, args: Option<Value>) -> Decision {
        d.secrets = self.secrets;
        d.tool_id = self.tool.descriptor.tool_id.clone();
        d.tool_name = sanitize_label(&self.call.name);
        d.args_hash = self.hash;
        // Blank arguments parse as `{}` (`arguments::parse`); their text is not JSON, so the
        // tree is what the journal keeps for them.
        d.args_text = (self.redacted_args.is_none()
            && args.is_some()
            && self.call.input == crate::model::CallInput::Json
            && !self.call.arguments.trim().is_empty())
        .then(|| self.call.arguments.clone());
        d.redacted_args = self.redacted_args.or(args);
        d.trace = self.trace;
        if self.ctx.explain {
            let note = if d.message.is_empty() {
                format!("{}: {}", d.outcome.as_str(), d.reason)
            } else {
                format!("{}: {} — {}", d.outcome.as_str(), d.reason, d.message)
            };
            d.trace.push((d.stage, note));
        }
        d
    }

    /// Adds the note of a stage the call passed to the trace, when the caller explains
    /// ([`AdmitCtx::explain`]); `note` is not called otherwise.
    fn note(&mut self, stage: Stage, note: impl FnOnce() -> String) {
        if self.ctx.explain {
            self.trace.push((stage, note()));
        }
    }
}

/// A held call would be refused even if the acting person approved it: authorization with
/// `context.approved = true` forbids it, or a rule still holds it. The refusal is decided at
/// the authorization stage at once, so no approval interrupt asks the person in vain
/// (issue 16). `None` when an approval could release it.
fn refused_even_if_approved(authz: Authz) -> Option<Decision> {
    match authz {
        Authz::Permit(_) => None,
        Authz::Refuse {
            rules,
            reason,
            detail,
        } => {
            let mut d = Decision::new(
                Outcome::Refused,
                Stage::Authorization,
                reason,
                format!("{detail} (refused even if approved, so no approval is asked)"),
            );
            d.rules = rules;
            Some(d)
        }
        Authz::Hold(rules) => {
            let mut d = Decision::new(
                Outcome::Refused,
                Stage::Authorization,
                crate::reason::Reason::ApprovalCannotRelease,
                format!(
                    "{} hold(s) the call even when the acting person approves it, so no approval is asked",
                    rules.join(", ")
                ),
            );
            d.rules = rules;
            Some(d)
        }
    }
}

/// How the withheld calls of a choice reach the agent (DESIGN.md §4), by the bundle's
/// `[outcomes]`. When the turn does not simply continue, calls that passed are `ended-turn`:
/// an ended turn or a repair round does not release them (the model re-emits what it needs).
pub fn surface(ctx: &AdmitCtx<'_>, decisions: &mut [Decision]) -> Surfacing {
    let withheld: Vec<usize> = (0..decisions.len())
        .filter(|&i| !decisions[i].released())
        .collect();
    if withheld.is_empty() {
        return Surfacing::Release;
    }
    // Calls after a clarification are dropped whatever else happens (§E).
    let deciding: Vec<usize> = withheld
        .iter()
        .copied()
        .filter(|&i| decisions[i].outcome != Outcome::EndedTurn)
        .collect();
    if deciding.is_empty() {
        // Only calls after a clarification: they are dropped, the ask goes out.
        return Surfacing::Drop;
    }
    let o = &ctx.policy.settings.outcomes;
    let surface_of = |d: &Decision| match d.outcome {
        // A refusal and context exhaustion are never repaired (§B): they surface at once.
        Outcome::Invalid if !d.reason.repairable() => match o.invalid_after_repairs {
            Surface::Repair => Surface::Error,
            s => s,
        },
        Outcome::Invalid if ctx.repairs_left > 0 => o.invalid,
        Outcome::Invalid => match o.invalid_after_repairs {
            Surface::Repair => Surface::Error,
            s => s,
        },
        Outcome::Refused => o.refused,
        Outcome::Held => o.held,
        Outcome::SuppressedRepeat if ctx.repairs_left > 0 => o.suppressed_repeat,
        Outcome::SuppressedRepeat => Surface::EndTurn,
        _ => Surface::EndTurn,
    };
    let surfaces: Vec<Surface> = deciding
        .iter()
        .map(|&i| surface_of(&decisions[i]))
        .collect();
    if surfaces.iter().all(|s| *s == Surface::Wait) {
        // Every withheld call waits for the acting person: the whole choice waits (a held
        // call before a clarification is resolved before the ask goes out, §E).
        return Surfacing::Wait;
    }
    let chosen = if surfaces.contains(&Surface::Error) {
        Surface::Error
    } else if surfaces.contains(&Surface::Repair) && ctx.repairs_left > 0 {
        Surface::Repair
    } else {
        Surface::EndTurn
    };
    for d in decisions.iter_mut().filter(|d| d.released() && d.enforced) {
        d.outcome = Outcome::EndedTurn;
        d.stage = Stage::Dispatch;
        d.reason = crate::reason::Reason::TurnEnded;
        d.message = "another call of the same turn was withheld, which ended the turn".into();
    }
    match chosen {
        Surface::Error => {
            let i = deciding[surfaces
                .iter()
                .position(|s| *s == Surface::Error)
                .unwrap_or(0)];
            Surfacing::Error(error_for(&decisions[i]))
        }
        Surface::Repair => Surfacing::Repair(
            withheld
                .iter()
                .map(|&i| {
                    let d = &decisions[i];
                    if d.outcome == Outcome::SuppressedRepeat {
                        RepairItem {
                            call: i,
                            text: d.message.clone(),
                            is_error: false,
                        }
                    } else {
                        RepairItem {
                            call: i,
                            text: explain(d),
                            is_error: true,
                        }
                    }
                })
                .collect(),
        ),
        Surface::EndTurn | Surface::Wait => {
            let mut text =
                String::from("[turnguard] The tool call(s) in this turn were not released.");
            for &i in &withheld {
                text.push_str(&format!("\n- {}", explain(&decisions[i])));
            }
            Surfacing::EndTurn(text)
        }
    }
}

/// Host-authored explanation of one decision (never model text).
pub fn explain(d: &Decision) -> String {
    format!(
        "`{}` ({}): {} at the {} stage ({}): {}",
        d.tool_name,
        d.tool_id,
        d.outcome.as_str(),
        d.stage.as_str(),
        d.reason,
        d.message
    )
}

/// §E: a clarification must go through a tool, so a request that declares a clarification
/// tool to a model the bundle lists in `models_without_tools` cannot ask; it gets a typed
/// failure (`capability_not_provided`) instead of a guess. `Some(reason)` in that case.
pub fn clarification_unsupported(turn: &Turn, policy: &CompiledPolicy) -> Option<String> {
    let model = turn.model.as_deref()?;
    if !policy.model_without_tools(model) {
        return None;
    }
    let ask = turn.tools.iter().find(|t| {
        policy
            .catalog
            .by_name(&t.name)
            .is_some_and(|c| c.clarification)
    })?;
    Some(format!(
        "the model `{}` has no tool support (policy `models_without_tools`), so the clarification tool `{}` cannot ask the person; turnguard does not guess a question from text",
        sanitize_label(model),
        sanitize_label(&ask.name)
    ))
}

/// After an approval interrupt resolved without approving (rejected, expired, nobody could
/// approve, the approval was used already): every held call is refused with `reason` — a
/// timeout never approves (OpenWOP interrupt.md). The deciding stage is kept.
pub fn refuse_held(decisions: &mut [Decision], reason: crate::reason::Reason, why: &str) {
    for d in decisions
        .iter_mut()
        .filter(|d| d.outcome == Outcome::Held && d.enforced)
    {
        d.outcome = Outcome::Refused;
        d.message = format!("{why} (it was held: {})", d.message);
        d.reason = reason;
        d.trace
            .push((d.stage, format!("refused: {reason} — {why}")));
    }
}

/// The OpenWOP error a withheld call surfaces as, when its outcome is set to `error`.
pub fn error_for(d: &Decision) -> SurfacedError {
    let (status, code) = d.reason.wire();
    SurfacedError {
        status,
        code,
        message: explain(d),
        retry_after_secs: d.retry_after_secs,
    }
}

/// The verdict for calls still held when their stream was cut: every call is `invalid` at
/// the completion stage, none is released.
pub fn withheld_by_cut(choice: &ChoiceEmissions) -> ChoiceVerdict {
    let decisions = choice
        .calls
        .iter()
        .map(|call| {
            let mut d = Decision::new(
                Outcome::Invalid,
                Stage::Completion,
                crate::reason::Reason::StreamCut,
                "the upstream stream ended before the call was complete".into(),
            );
            d.tool_name = sanitize_label(&call.name);
            d
        })
        .collect();
    ChoiceVerdict {
        choice: choice.choice,
        decisions,
        surfacing: Surfacing::Drop,
        claims: Vec::new(),
    }
}

/// Names and ids come from model output: show at most 64 characters of a safe alphabet so
/// host-authored text never carries model-authored prose, and a name that holds a secret the
/// built-in recognizers know (a model that names a tool after an API key) shows its marker
/// instead (labels reach logs, events and the agent's end-turn text).
pub(crate) fn sanitize_label(s: &str) -> String {
    let redacted = crate::policy::redact::builtins().redact_str(s);
    safe_label(&redacted)
}

fn safe_label(s: &str) -> String {
    let allowed =
        |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'/' | b':');
    if !s.is_empty() && s.len() <= 64 && s.bytes().all(allowed) {
        // The common case (a plain tool name): nothing to drop, one copy.
        return s.to_owned();
    }
    let cleaned: String = s
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | ':'))
        .take(64)
        .collect();
    if cleaned.is_empty() {
        "(unnamed)".into()
    } else {
        cleaned
    }
}

#[cfg(test)]
mod tests {
    use super::sanitize_label;

    /// A plain name comes back as it is; anything else is filtered to the allowed characters
    /// and 64 of them, and nothing left is `(unnamed)`.
    #[test]
    fn labels_keep_plain_names_and_filter_the_rest() {
        assert_eq!(
            sanitize_label("mcp__github/create_issue:v1.2"),
            "mcp__github/create_issue:v1.2"
        );
        assert_eq!(sanitize_label("rm -rf\n<b>é"), "rm-rfb");
        let long = "a".repeat(80);
        assert_eq!(sanitize_label(&long), "a".repeat(64));
        assert_eq!(sanitize_label(""), "(unnamed)");
        assert_eq!(sanitize_label("\u{202e}"), "(unnamed)");
    }
}
