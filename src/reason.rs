//! Why a tool call was decided as it was: the closed set of decision reasons (tool-turn
//! contract §B), each with everything that follows from it — its spelling (journal
//! `tool_calls.reason`, the decision log line, `heldBecause.reason`, error details), the HTTP
//! status and OpenWOP code it surfaces with as an error (`/work/shared/spec/openwop/errors.json`),
//! and the `agent.tool-returned` status of a call that does not run. One table, so the wire
//! code of a withheld call and its event can never disagree.

/// A decision's reason. [`Reason::as_str`] is its stable spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    // ---- released -----------------------------------------------------------------------
    /// Passed every stage.
    Released,
    /// Recovery or replay served the recorded call (its result is not recorded yet).
    ServedFromRecord,
    // ---- 1. completion --------------------------------------------------------------------
    /// The token limit cut the output (or could have: usage missing under a limit).
    Truncated,
    /// The model or provider refused; never retried.
    RefusedCompletion,
    /// The context window is full; asking again cannot fit.
    ContextWindowExceeded,
    /// The upstream stream ended before the call was complete.
    StreamCut,
    // ---- 2. name --------------------------------------------------------------------------
    /// The tool is not declared in the request.
    UndeclaredTool,
    /// The tool is not in the catalog and the bundle refuses unknown tools.
    UnknownTool,
    // ---- 3. arguments ---------------------------------------------------------------------
    ArgumentsNotJson,
    /// The arguments name an object key twice (at any depth): parsers disagree on which value
    /// counts, so what admission validated and what the tool reads could differ.
    ArgumentsDuplicateKey,
    ArgumentsNotObject,
    SchemaUncompilable,
    SchemaViolation,
    // ---- 4. trust -------------------------------------------------------------------------
    /// An untrusted turn calls a gated tool without approval (held).
    UntrustedTurn,
    // ---- 5. authorization -----------------------------------------------------------------
    /// Held by `@outcome("hold")` rules.
    HeldByRule,
    /// A forbid rule.
    Forbidden,
    /// No rule permits (default deny).
    NoPermit,
    /// A rule could not be evaluated (refuses).
    RuleError,
    /// An argument cannot be represented for the rules.
    ArgsUnrepresentable,
    // ---- 6. limits ------------------------------------------------------------------------
    /// Per turn, per run or the (principal, tool) bucket.
    RateLimited,
    ClarificationRoundsExceeded,
    // ---- 7. redaction ---------------------------------------------------------------------
    /// A secret must be stripped before an egress tool, and the stream cannot rewrite it.
    StripUnsupported,
    // ---- 8. dispatch ----------------------------------------------------------------------
    /// Another call of the same turn was withheld, which ended the turn.
    TurnEnded,
    /// A question to the person ended the turn before this call (§E).
    AfterClarification,
    /// The effect ran before and its result is recorded: the recorded result is handed back
    /// (spelled `effect_already_claimed`, like [`Reason::EffectAlreadyClaimed`]).
    EffectRecorded,
    /// The effect was claimed before (result not recorded, or another reader's).
    EffectAlreadyClaimed,
    /// Recovery or replay: the call's result is recorded, it is not handed back.
    ResultRecorded,
    /// The effect was forwarded before and its outcome is not known.
    ToolOutcomeUnknown,
    /// The effect claim could not be journaled (fail closed).
    JournalUnavailable,
    /// MCP: no released model emission of the run matches the call (tickets).
    NoAdmittedEmission,
    /// Admission returned nothing (cannot happen; fail closed).
    Internal,
    // ---- approvals (a held call not approved) ---------------------------------------------
    ApprovalRejected,
    ApprovalExpired,
    NoApprover,
    ApprovalAlreadyUsed,
    ApprovalUnavailable,
    AgentGone,
    /// Still held after the approval (a rule holds it whatever the approval).
    HeldAfterApproval,
    /// A `hold` rule holds the call even when the acting person approves it, so no approval
    /// is asked: refused at once.
    ApprovalCannotRelease,
    // ---- free-form (custom) tool input ------------------------------------------------------
    /// JSON arguments for a free-form tool, or free-form input for a JSON tool.
    InputKindMismatch,
    /// The declared regex grammar does not compile (within the size cap).
    FormatUncompilable,
    /// The input does not match the declared grammar.
    FormatViolation,
    /// A declared input format turnguard cannot check.
    FormatUnsupported,
    /// The person's edited arguments (`edit-accept`) were not admitted.
    EditRefused,
    /// The person edited the arguments of a call whose surface cannot carry edited arguments
    /// (a Responses stream).
    EditUnsupported,
}

/// The `agent.tool-returned` status of a call that does not run, and the OpenWOP error code
/// its event carries (`None`: an `outcome` object instead).
pub type EventStatus = (&'static str, Option<&'static str>);

impl Reason {
    /// The stable spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Released => "released",
            Self::ServedFromRecord => "served_from_record",
            Self::Truncated => "truncated",
            Self::RefusedCompletion => "refused_completion",
            Self::ContextWindowExceeded => "context_window_exceeded",
            Self::StreamCut => "stream_cut",
            Self::UndeclaredTool => "undeclared_tool",
            Self::UnknownTool => "unknown_tool",
            Self::ArgumentsNotJson => "arguments_not_json",
            Self::ArgumentsDuplicateKey => "arguments_duplicate_key",
            Self::ArgumentsNotObject => "arguments_not_object",
            Self::SchemaUncompilable => "schema_uncompilable",
            Self::SchemaViolation => "schema_violation",
            Self::UntrustedTurn => "untrusted_turn",
            Self::HeldByRule => "held_by_rule",
            Self::Forbidden => "forbidden",
            Self::NoPermit => "no_permit",
            Self::RuleError => "rule_error",
            Self::ArgsUnrepresentable => "args_unrepresentable",
            Self::RateLimited => "rate_limited",
            Self::ClarificationRoundsExceeded => "clarification_rounds_exceeded",
            Self::StripUnsupported => "strip_unsupported",
            Self::TurnEnded => "turn_ended",
            Self::AfterClarification => "after_clarification",
            Self::EffectRecorded | Self::EffectAlreadyClaimed => "effect_already_claimed",
            Self::ResultRecorded => "result_recorded",
            Self::ToolOutcomeUnknown => "tool_outcome_unknown",
            Self::JournalUnavailable => "journal_unavailable",
            Self::NoAdmittedEmission => "no_admitted_emission",
            Self::Internal => "internal",
            Self::ApprovalRejected => "approval_rejected",
            Self::ApprovalExpired => "approval_expired",
            Self::NoApprover => "no_approver",
            Self::ApprovalAlreadyUsed => "approval_already_used",
            Self::ApprovalUnavailable => "approval_unavailable",
            Self::AgentGone => "agent_gone",
            Self::HeldAfterApproval => "held_after_approval",
            Self::EditRefused => "edit_refused",
            Self::ApprovalCannotRelease => "approval_cannot_release",
            Self::InputKindMismatch => "input_kind_mismatch",
            Self::FormatUncompilable => "format_uncompilable",
            Self::FormatViolation => "format_violation",
            Self::FormatUnsupported => "format_unsupported",
            Self::EditUnsupported => "edit_unsupported",
        }
    }

    /// A held call that was not approved (surfaced as OpenWOP `approval_rejected`).
    pub fn is_approval_refusal(self) -> bool {
        matches!(
            self,
            Self::ApprovalRejected
                | Self::ApprovalExpired
                | Self::NoApprover
                | Self::ApprovalAlreadyUsed
                | Self::ApprovalUnavailable
                | Self::AgentGone
                | Self::HeldAfterApproval
                | Self::EditRefused
                | Self::EditUnsupported
        )
    }

    /// Whether a withheld call with this reason may be repaired: everything but a refusal
    /// and context exhaustion (§B: a refusal is not retried).
    pub fn repairable(self) -> bool {
        !matches!(self, Self::RefusedCompletion | Self::ContextWindowExceeded)
    }

    /// A reason of the `invalid` outcome (the model can correct it).
    fn invalid(self) -> bool {
        matches!(
            self,
            Self::Truncated
                | Self::RefusedCompletion
                | Self::ContextWindowExceeded
                | Self::StreamCut
                | Self::UndeclaredTool
                | Self::ArgumentsNotJson
                | Self::ArgumentsDuplicateKey
                | Self::ArgumentsNotObject
                | Self::SchemaUncompilable
                | Self::SchemaViolation
                | Self::InputKindMismatch
                | Self::FormatUncompilable
                | Self::FormatViolation
                | Self::FormatUnsupported
        )
    }

    /// A reason of the `suppressed-repeat` outcome.
    fn repeat(self) -> bool {
        matches!(
            self,
            Self::EffectRecorded
                | Self::EffectAlreadyClaimed
                | Self::ResultRecorded
                | Self::ToolOutcomeUnknown
        )
    }

    /// The HTTP status and OpenWOP code a withheld call surfaces with when its outcome is set
    /// to `error` (OpenWOP errors.json: `rate_limited` 429, `envelope_*` / `approval_rejected`
    /// / `loop_limit_exceeded` 422, `forbidden` 403; turnguard's own
    /// `turnguard.effect_already_claimed` 409).
    pub fn wire(self) -> (u16, &'static str) {
        match self {
            Self::RateLimited => (429, "rate_limited"),
            Self::RefusedCompletion => (422, "envelope_refusal"),
            Self::ContextWindowExceeded => (422, "envelope_truncation_unrecoverable"),
            r if r.is_approval_refusal() => (422, "approval_rejected"),
            Self::ClarificationRoundsExceeded => (422, "loop_limit_exceeded"),
            r if r.invalid() => (422, "envelope_invalid"),
            r if r.repeat() => (409, "turnguard.effect_already_claimed"),
            _ => (403, "forbidden"),
        }
    }

    /// The `agent.tool-returned` event of a call that does not run (`None`: it runs, or it
    /// waits for approval, and its own result event follows).
    pub fn event_status(self) -> Option<EventStatus> {
        Some(match self {
            Self::Released | Self::ServedFromRecord | Self::UntrustedTurn | Self::HeldByRule => {
                return None
            }
            Self::EffectRecorded => ("ok", None),
            r if r.repeat() => ("error", Some("turnguard.effect_already_claimed")),
            Self::RateLimited => ("rate_limited", Some("rate_limited")),
            r if r.is_approval_refusal() => ("forbidden", Some("approval_rejected")),
            r if r.invalid() => ("error", Some("validation_error")),
            Self::TurnEnded | Self::AfterClarification => ("error", Some("turnguard.turn_ended")),
            _ => ("forbidden", Some("forbidden")),
        })
    }
}

impl serde::Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code a reason surfaces with is an OpenWOP code or turnguard's own.
    #[test]
    fn wire_codes_are_openwop_codes() {
        let spec = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../shared/spec/openwop/errors.json"
        ))
        .expect("the shared OpenWOP spec beside the checkout");
        for r in [
            Reason::RateLimited,
            Reason::RefusedCompletion,
            Reason::ContextWindowExceeded,
            Reason::ClarificationRoundsExceeded,
            Reason::SchemaViolation,
            Reason::Forbidden,
        ] {
            let code = r.wire().1;
            assert!(spec.contains(&format!("\"{code}\"")), "{code}");
        }
        assert_eq!(Reason::EffectRecorded.as_str(), "effect_already_claimed");
        assert_eq!(Reason::EffectRecorded.event_status(), Some(("ok", None)));
        assert_eq!(
            Reason::EffectAlreadyClaimed.event_status(),
            Some(("error", Some("turnguard.effect_already_claimed")))
        );
    }
}
