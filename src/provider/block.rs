//! A non-stream answer as a stream of one event: the whole JSON body is the one event a
//! [`ProviderStream`] reads, so a JSON answer goes through the same round engine as a stream
//! (issue 13 item 1: one round engine). The API's own [`Provider`] reads and rewrites the
//! body; this module knows no provider field.
//!
//! The one event is held when it carries calls (released with the verdicts applied, through
//! [`Provider::rewrite_response`]) and forwarded as received when it does not; it is the
//! answer's terminal event only then (a tool turn's text is not a channel's answer). Nothing
//! of a block reaches the agent before its round is decided and committed: the engine sends
//! a block's answer once its unit of work is in the journal.

use std::sync::OnceLock;

use bytes::Bytes;
use serde_json::Value;

use super::{Provider, ProviderStream, Splice, SpliceState};
use crate::model::{AnswerContext, ChoiceEmissions, ChoiceVerdict, Completion, ResponseLink};
use crate::sse::{Event, Payload};

/// The one-event machine of a non-stream answer (see the module docs).
pub struct Block {
    provider: &'static dyn Provider,
    ctx: AnswerContext,
    /// The answer read on first look: every choice, or why it does not identify each choice
    /// and call uniquely. A block has one event, so the first read is the read.
    read: OnceLock<Result<Vec<ChoiceEmissions>, String>>,
    /// The body, once pushed.
    body: Option<(Value, Bytes)>,
    held: bool,
    done: bool,
    violation: Option<String>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("held", &self.held)
            .field("done", &self.done)
            .field("violation", &self.violation)
            .finish_non_exhaustive()
    }
}

impl Block {
    /// A machine for one non-stream answer of `provider`'s API, read against `ctx`.
    pub fn new(provider: &'static dyn Provider, ctx: AnswerContext) -> Self {
        Self {
            provider,
            ctx,
            read: OnceLock::new(),
            body: None,
            held: false,
            done: false,
            violation: None,
        }
    }

    fn read(&self, json: &Value) -> &Result<Vec<ChoiceEmissions>, String> {
        self.read
            .get_or_init(|| self.provider.parse_response(json, &self.ctx))
    }

    fn choices(&self) -> &[ChoiceEmissions] {
        match self.read.get() {
            Some(Ok(c)) => c,
            _ => &[],
        }
    }

    fn has_calls(&self, event: &Event) -> Option<bool> {
        match &event.payload {
            Payload::Json(json) => match self.read(json) {
                Ok(choices) => Some(choices.iter().any(|c| !c.calls.is_empty())),
                Err(_) => None,
            },
            _ => None,
        }
    }
}

/// A block is never spliced: nothing of it reached the agent when its round is repaired, so
/// the repair round's answer is the agent's answer as it comes.
#[derive(Debug)]
struct Unspliced;

impl SpliceState for Unspliced {
    fn apply(&mut self, event: Event) -> Option<Event> {
        Some(event)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl ProviderStream for Block {
    /// Rules: exactly one event, a JSON body whose choices and calls are each identified
    /// uniquely ([`Provider::parse_response`]); anything else is a violation.
    fn push(&mut self, event: Event, out: &mut Vec<Bytes>) {
        if self.body.is_some() {
            self.violation = Some("a non-stream answer is one body".into());
            return;
        }
        let Payload::Json(json) = event.payload else {
            self.violation = Some("the upstream answered 2xx with a body that is not JSON".into());
            return;
        };
        match self.read(&json) {
            Err(why) => {
                self.violation = Some(format!("the upstream response is ambiguous: {why}"));
                return;
            }
            Ok(choices) => self.held = choices.iter().any(|c| !c.calls.is_empty()),
        }
        if !self.held {
            out.push(event.block.raw.clone());
            self.done = true;
        }
        self.body = Some((json, event.block.raw));
    }

    fn violation(&self) -> Option<&str> {
        self.violation.as_deref()
    }

    fn ready(&self) -> bool {
        self.held
    }

    fn finished(&self) -> bool {
        self.done
    }

    fn failed(&self) -> bool {
        false
    }

    fn pending(&self) -> bool {
        self.held
    }

    fn round(&self) -> Vec<ChoiceEmissions> {
        self.choices()
            .iter()
            .filter(|c| !c.calls.is_empty())
            .cloned()
            .collect()
    }

    fn completions(&self) -> Vec<Completion> {
        self.choices()
            .iter()
            .map(|c| c.completion.clone())
            .collect()
    }

    fn release(&mut self, verdicts: &[ChoiceVerdict], out: &mut Vec<Bytes>) {
        if !self.held {
            return;
        }
        self.held = false;
        self.done = true;
        if let Some((json, raw)) = &mut self.body {
            if self.provider.rewrite_response(json, verdicts) {
                out.push(Bytes::from(crate::strict_json::to_text(json)));
            } else {
                out.push(raw.clone());
            }
        }
    }

    /// Nothing is forwarded: the engine answers a failed block with an HTTP error in the
    /// API's shape (nothing of the body went out).
    fn cut(&mut self, _reason: &str, _out: &mut Vec<Bytes>) {
        self.held = false;
    }

    /// As [`Self::cut`]: the engine answers with the surfaced error's status and shape.
    fn fail(&mut self, _code: &str, _message: &str, _out: &mut Vec<Bytes>) {
        self.held = false;
    }

    fn abandon(&mut self) -> Splice {
        self.held = false;
        Splice::new(Unspliced)
    }

    fn response_link(&self) -> Option<ResponseLink> {
        let (json, _) = self.body.as_ref()?;
        self.provider.response_link(json, &self.ctx)
    }

    fn answer_text<'a>(&'a self, event: &'a Event) -> Option<&'a str> {
        if self.has_calls(event)? {
            return None;
        }
        self.choices().first()?.text.as_deref()
    }

    fn is_terminal(&self, event: &Event) -> bool {
        self.has_calls(event) == Some(false)
    }
}
