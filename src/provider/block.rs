//! A non-stream answer as a stream of one event: the whole JSON body is the one event a
//! [`ProviderStream`] reads, so a JSON answer goes through the same round engine as a stream
//! (issue 13 item 1: one round engine). The API's own [`Provider`] reads and rewrites the
//! body; this module knows no provider field.
//!
//! The one event is held when it carries calls (released with the verdicts applied, through
//! [`Provider::rewrite_response`]) and forwarded as received when it does not; it is the
//! answer's terminal event only then (a tool turn's text is not a channel's answer). The body
//! is read through the API's typed view of its bytes when it has one
//! ([`Provider::parse_response_bytes`]), and its JSON tree is then built only to rewrite it.
//! Nothing of a block reaches the agent before its round is decided and committed: the
//! engine sends a block's answer once its unit of work is in the journal.

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
    /// The answer read on first look (a block has one event, so the first read is the read).
    read: OnceLock<Read>,
    /// The body's bytes, once pushed.
    raw: Option<Bytes>,
    held: bool,
    done: bool,
    violation: Option<String>,
}

/// What a block's body said.
struct Read {
    /// Every choice, or why the body does not identify each choice and call uniquely, or
    /// why it is not a body turnguard reads.
    choices: Result<Vec<ChoiceEmissions>, Unread>,
    /// The body's JSON tree, when reading needed it (the API has no typed view, or the view
    /// refused the body) or a rewrite did since.
    tree: Option<Value>,
}

/// Why a block's body gave no choices.
enum Unread {
    /// Not one JSON object serde_json reads.
    NotAnObject,
    /// JSON with an object key twice ([`crate::strict_json`]).
    DuplicateKey,
    /// [`Provider::parse_response`]'s refusal.
    Ambiguous(String),
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
            raw: None,
            held: false,
            done: false,
            violation: None,
        }
    }

    /// Reads `event`'s body once: through the API's typed view when it has one and the view
    /// reads the body, else through the tree. `None` for an event that is not a body.
    fn read(&self, event: &Event) -> Option<&Read> {
        if !matches!(event.payload, Payload::Body) {
            return None;
        }
        let raw = &event.block.raw;
        Some(self.read.get_or_init(|| {
            if let Some(choices) = self.provider.parse_response_bytes(raw, &self.ctx) {
                return Read {
                    choices: choices.map_err(Unread::Ambiguous),
                    tree: None,
                };
            }
            // Strict: the agent gets these bytes as they are when nothing in them is
            // withheld, so a key twice (read here as the last, elsewhere as the first) is
            // refused like any body turnguard cannot read one way.
            match crate::strict_json::from_slice(raw) {
                Ok(tree) if tree.is_object() => Read {
                    choices: self
                        .provider
                        .parse_response(&tree, &self.ctx)
                        .map_err(Unread::Ambiguous),
                    tree: Some(tree),
                },
                Err(crate::strict_json::StrictJsonError::DuplicateKey { .. }) => Read {
                    choices: Err(Unread::DuplicateKey),
                    tree: None,
                },
                _ => Read {
                    choices: Err(Unread::NotAnObject),
                    tree: None,
                },
            }
        }))
    }

    fn choices(&self) -> &[ChoiceEmissions] {
        match self.read.get() {
            Some(Read { choices: Ok(c), .. }) => c,
            _ => &[],
        }
    }

    fn has_calls(&self, event: &Event) -> Option<bool> {
        match &self.read(event)?.choices {
            Ok(choices) => Some(choices.iter().any(|c| !c.calls.is_empty())),
            Err(_) => None,
        }
    }

    /// The body's tree, read from the bytes now if reading did not need it. `None` only if
    /// the bytes do not parse, which a view's reading ruled out (it checks every member it
    /// skips: [`crate::provider::view::members`]).
    fn tree(&mut self) -> Option<&mut Value> {
        let read = self.read.get_mut()?;
        if read.tree.is_none() {
            read.tree = crate::strict_json::from_slice(self.raw.as_ref()?).ok();
        }
        read.tree.as_mut()
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
        if self.raw.is_some() {
            self.violation = Some("a non-stream answer is one body".into());
            return;
        }
        let Some(read) = self.read(&event) else {
            self.violation = Some("the upstream answered 2xx with a body that is not JSON".into());
            return;
        };
        match &read.choices {
            Err(Unread::NotAnObject) => {
                self.violation =
                    Some("the upstream answered 2xx with a body that is not a JSON object".into());
                return;
            }
            Err(Unread::DuplicateKey) => {
                self.violation = Some(
                    "the upstream answered 2xx with a body that names an object key twice (duplicate keys are refused: parsers disagree on which one counts)".into(),
                );
                return;
            }
            Err(Unread::Ambiguous(why)) => {
                self.violation = Some(format!("the upstream response is ambiguous: {why}"));
                return;
            }
            Ok(choices) => self.held = choices.iter().any(|c| !c.calls.is_empty()),
        }
        if !self.held {
            out.push(event.block.raw.clone());
            self.done = true;
        }
        self.raw = Some(event.block.raw);
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

    /// The body as received when no verdict changes it ([`Provider::rewrites`]), without
    /// reading its tree; else the rewritten body. A body whose tree cannot be read (ruled out
    /// when it was read) is a violation: nothing is forwarded.
    fn release(&mut self, verdicts: &[ChoiceVerdict], out: &mut Vec<Bytes>) {
        if !self.held {
            return;
        }
        self.held = false;
        self.done = true;
        let Some(raw) = self.raw.clone() else {
            return;
        };
        let provider = self.provider;
        if !provider.rewrites(verdicts) {
            out.push(raw);
            return;
        }
        let Some(tree) = self.tree() else {
            self.violation = Some("the upstream response could not be read again".into());
            return;
        };
        if provider.rewrite_response(tree, verdicts) {
            out.push(Bytes::from(crate::strict_json::to_text(tree)));
        } else {
            out.push(raw);
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

    /// From the tree; an API read through its typed view has no stored responses
    /// ([`Provider::parse_response_bytes`]).
    fn response_link(&self) -> Option<ResponseLink> {
        let tree = self.read.get()?.tree.as_ref()?;
        self.provider.response_link(tree, &self.ctx)
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
