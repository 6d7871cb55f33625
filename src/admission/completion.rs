//! Stage 1, **completion** (tool-turn contract §B): a call from a truncated or refused output
//! is never released, even when its arguments happen to parse; the batch is suspect.
//!
//! What a withheld call becomes depends on why (§B: "a refusal is not retried"):
//! - **truncated** (`truncated`): the token limit cut the output; asking the model again (a
//!   repair round) may succeed;
//! - **refused** (`refused_completion`): the model or provider refused; never retried, it
//!   surfaces at once (OpenWOP `envelope_refusal` when surfaced as an error);
//! - **context exhausted** (`context_window_exceeded`): the transcript and the output filled
//!   the context window; a repair round only makes the transcript longer, so it surfaces at
//!   once (`envelope_truncation_unrecoverable`).
//!
//! How each state is read from the provider's signals is the adapters' `classify`
//! (`crate::provider`): truncation is truncation under every name (`length`, `max_tokens`,
//! `max_output_tokens`, `model_length`, and any finish reason that is not a known normal end),
//! and a normal finish whose usage reached the request's limit is truncated too (a Chat stream
//! that sets a limit is asked for its usage chunk: `crate::provider::Provider::prepare_upstream`).
//!
//! What cannot be known, and what turnguard does then:
//! - the request sets a limit, the finish is normal, and the server reports no usage: whether
//!   the limit cut the call is unknown — withheld as truncated (`usage_missing`);
//! - the request sets no limit and the server reports a normal finish for a call its own
//!   output limit cut: nothing in the response says so — believed (set a limit to be told).

use crate::model::{Completion, CompletionState, Decision, Outcome, Stage};

/// `Some(invalid)` unless the choice ended cleanly.
pub fn check(completion: &Completion) -> Option<Decision> {
    // The message is made only for a choice that did not end cleanly: its label runs the
    // built-in secret patterns, which a released call need not pay for.
    let (reason, message): (_, fn(&str) -> String) = match completion.state {
        CompletionState::Clean => return None,
        CompletionState::Truncated => (crate::reason::Reason::Truncated, |reason| {
            format!(
                "the model output was cut by the token limit ({reason}) before the call was known to be complete"
            )
        }),
        CompletionState::Refused => (crate::reason::Reason::RefusedCompletion, |reason| {
            format!("the model output ended in a refusal ({reason}); a refusal is not retried")
        }),
        CompletionState::ContextExhausted => {
            (crate::reason::Reason::ContextWindowExceeded, |reason| {
                format!(
                    "the model's context window is full ({reason}); the call was cut and asking again cannot fit"
                )
            })
        }
    };
    Some(Decision::new(
        Outcome::Invalid,
        Stage::Completion,
        reason,
        message(&super::sanitize_label(&completion.reason)),
    ))
}

/// Whether a text answer the structured / prompted channel refused with this reason may be
/// repaired: everything but a refusal and context exhaustion (a call's decision:
/// [`crate::reason::Reason::repairable`]).
pub fn repairable(reason: &str) -> bool {
    !matches!(reason, "refused_completion" | "context_window_exceeded")
}

/// The OpenWOP code of a text answer the structured / prompted channel refused, by its
/// reason (`crate::admission::channel`): truncation and context exhaustion are
/// `envelope_truncation_unrecoverable`, anything else `envelope_invalid`.
pub fn channel_error_code(reason: &str) -> &'static str {
    match reason {
        "truncated" | "context_window_exceeded" => "envelope_truncation_unrecoverable",
        _ => "envelope_invalid",
    }
}
