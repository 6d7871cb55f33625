//! Stage 2, **name** (tool-turn contract §B): the called tool must be declared in the
//! request's `tools`.

use crate::model::{Decision, Outcome, Stage, ToolCall, Turn};

/// `Some(invalid)` when the tool is not declared in the request.
pub fn check(turn: &Turn, call: &ToolCall) -> Option<Decision> {
    if turn.declared(&call.name).is_some() {
        return None;
    }
    Some(Decision {
        outcome: Outcome::Invalid,
        stage: Stage::Name,
        reason: "undeclared_tool",
        message: format!(
            "the tool `{}` is not declared in this request's tools",
            super::sanitize_label(&call.name)
        ),
        args_hash: None,
    })
}
