//! The admission order of tool-turn contract §B: every tool call goes through the stages in
//! order and stops at the first that decides it.
//!
//! Built so far: **completion** ([`completion`]), **name** ([`name`]), **arguments**
//! ([`arguments`]), then dispatch. A call that is not released ends the turn for its choice
//! (DESIGN.md §4 `end-turn`): the calls after the stage that withheld it are `ended-turn`.
//! Admission is pure and cannot fail: anything it cannot evaluate is withheld.

pub mod arguments;
pub mod completion;
pub mod name;

use crate::model::{ChoiceEmissions, ChoiceVerdict, Decision, Outcome, Stage, Turn};
pub use arguments::SchemaCache;

/// Decides every call of one choice, in emission order (tool-turn contract §B).
pub fn admit_choice(turn: &Turn, choice: &ChoiceEmissions, schemas: &SchemaCache) -> ChoiceVerdict {
    let mut decisions: Vec<Decision> = choice
        .calls
        .iter()
        .map(|call| {
            let args = arguments::parse(&call.arguments);
            let args_hash = args.as_ref().ok().map(arguments::args_hash);
            let decided = completion::check(&choice.completion)
                .or_else(|| name::check(turn, call))
                .or_else(|| arguments::check(turn, call, &args, schemas));
            match decided {
                Some(mut d) => {
                    d.args_hash = args_hash;
                    d
                }
                None => Decision {
                    outcome: Outcome::Executed,
                    stage: Stage::Dispatch,
                    reason: "released",
                    message: String::new(),
                    args_hash,
                },
            }
        })
        .collect();

    let withheld: Vec<usize> = (0..decisions.len())
        .filter(|&i| !decisions[i].released())
        .collect();
    if withheld.is_empty() {
        return ChoiceVerdict {
            choice: choice.choice,
            decisions,
            end_turn: None,
        };
    }
    // End-turn surfacing: the turn ends, so calls that passed are not released either.
    let mut text = String::from("[turnguard] The tool call(s) in this turn were not released.");
    for &i in &withheld {
        let call = &choice.calls[i];
        let d = &decisions[i];
        text.push_str(&format!(
            "\n- `{}` (id {}): {} stage, {}: {}",
            sanitize_label(&call.name),
            sanitize_label(&call.id),
            d.stage.as_str(),
            d.reason,
            d.message
        ));
    }
    for d in decisions.iter_mut().filter(|d| d.released()) {
        d.outcome = Outcome::EndedTurn;
        d.stage = Stage::Dispatch;
        d.reason = "turn_ended";
        d.message = "another call of the same turn was withheld, which ended the turn".into();
    }
    ChoiceVerdict {
        choice: choice.choice,
        decisions,
        end_turn: Some(text),
    }
}

/// Names and ids come from model output: show at most 64 characters of a safe alphabet so
/// host-authored text never carries model-authored prose.
pub(crate) fn sanitize_label(s: &str) -> String {
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

/// The verdict for calls that were still held when their stream was cut: every call is
/// `invalid` at the completion stage, none is released.
pub fn withheld_by_cut(choice: &ChoiceEmissions) -> ChoiceVerdict {
    let decisions = choice
        .calls
        .iter()
        .map(|call| Decision {
            outcome: Outcome::Invalid,
            stage: Stage::Completion,
            reason: "stream_cut",
            message: "the upstream stream ended before the call was complete".into(),
            args_hash: arguments::parse(&call.arguments)
                .ok()
                .map(|a| arguments::args_hash(&a)),
        })
        .collect();
    ChoiceVerdict {
        choice: choice.choice,
        decisions,
        end_turn: None,
    }
}
