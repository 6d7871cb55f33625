//! Stage 1, **completion** (tool-turn contract §B): a call from a truncated or refused output
//! is never released, even when its arguments happen to parse; the batch is suspect.

use crate::model::{Completion, CompletionState, Decision, Outcome, Stage};

/// `Some(invalid)` unless the choice ended cleanly.
pub fn check(completion: &Completion) -> Option<Decision> {
    let (reason, message) = match completion.state {
        CompletionState::Clean => return None,
        CompletionState::Truncated => (
            "truncated",
            format!(
                "the model output was cut by the token limit ({}) before the call was known to be complete",
                super::sanitize_label(&completion.reason)
            ),
        ),
        CompletionState::Refused => (
            "refused_completion",
            format!(
                "the model output ended in a refusal ({})",
                super::sanitize_label(&completion.reason)
            ),
        ),
    };
    Some(Decision::new(
        Outcome::Invalid,
        Stage::Completion,
        reason,
        message,
    ))
}
