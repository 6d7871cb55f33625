//! Provider adapters: each provider API's requests, JSON responses and SSE events into the
//! neutral [`crate::model`] and back. Provider specifics live here and nowhere else.

pub mod anthropic_messages;
pub mod openai_chat;
pub mod openai_responses;

use bytes::Bytes;
use serde_json::Value;

use crate::model::{
    Api, ChoiceEmissions, ChoiceVerdict, Completion, RepairItem, ResponseLink, Turn, UntrustedKind,
};
use crate::sse::Event;

/// The call ids of a transcript and the tool each names. An id used for two calls names no
/// tool (which call a result answers is ambiguous) and makes the turn untrusted
/// ([`UntrustedKind::DuplicateCallId`]; tool-call ids are unique per transcript).
#[derive(Debug, Default)]
pub(crate) struct CallNames {
    names: std::collections::HashMap<String, Option<String>>,
}

impl CallNames {
    /// Notes call `id` (named `name`); `at` names it for the record when it is a duplicate.
    pub(crate) fn add(
        &mut self,
        turn: &mut Turn,
        id: &str,
        name: Option<&str>,
        at: impl FnOnce() -> String,
    ) {
        match self.names.get_mut(id) {
            Some(seen) => {
                *seen = None;
                turn.untrusted(UntrustedKind::DuplicateCallId, at());
            }
            None => {
                self.names.insert(id.to_owned(), name.map(str::to_owned));
            }
        }
    }

    /// The tool the call `id` names, when exactly one call has that id.
    pub(crate) fn name_of(&self, id: &str) -> Option<String> {
        self.names.get(id).cloned().flatten()
    }
}

/// Reads a request body of `api` into a [`Turn`].
///
/// Errors: a reason naming the field that is not what the API expects.
pub fn parse_request(api: Api, body: &Value) -> Result<Turn, String> {
    match api {
        Api::OpenAiChat => openai_chat::parse_request(body),
        Api::AnthropicMessages => anthropic_messages::parse_request(body),
        Api::OpenAiResponses => openai_responses::parse_request(body),
    }
}

/// Reads a non-stream response body into one [`ChoiceEmissions`] per choice.
///
/// Errors: the response does not identify each choice and call uniquely
/// ([`crate::model::check_identities`]; DESIGN.md §9): the round fails closed.
pub fn parse_response(api: Api, body: &Value, turn: &Turn) -> Result<Vec<ChoiceEmissions>, String> {
    match api {
        Api::OpenAiChat => openai_chat::parse_response(body, turn),
        Api::AnthropicMessages => anthropic_messages::parse_response(body, turn),
        Api::OpenAiResponses => openai_responses::parse_response(body, turn),
    }
}

/// How many choices the request body asks for: Chat's `n` (default 1); one for the other
/// APIs. A repair round is asked only of a one-choice request.
pub fn choices_requested(api: Api, body: &Value) -> u64 {
    match api {
        Api::OpenAiChat => body.get("n").and_then(Value::as_u64).unwrap_or(1),
        Api::AnthropicMessages | Api::OpenAiResponses => 1,
    }
}

/// Prepares the request body sent upstream for what the completion stage must know: a Chat
/// stream with a token limit asks for its usage chunk (see
/// [`openai_chat::prepare_upstream`]). The agent's own request (its digest, its record) is
/// not changed.
pub fn prepare_upstream(body: &mut Value, turn: &mut Turn) {
    match turn.api {
        Api::OpenAiChat => openai_chat::prepare_upstream(body, turn),
        Api::AnthropicMessages | Api::OpenAiResponses => {}
    }
}

/// What the journal keeps of a non-stream response the provider stores for later turns
/// (`previous_response_id`); `None` for APIs without stored responses.
pub fn response_link(body: &Value, turn: &Turn) -> Option<ResponseLink> {
    match turn.api {
        Api::OpenAiChat | Api::AnthropicMessages => None,
        Api::OpenAiResponses => openai_responses::response_link(body, turn),
    }
}

/// Applies verdicts to a non-stream response body; `true` when the body changed.
pub fn rewrite_response(api: Api, body: &mut Value, verdicts: &[ChoiceVerdict]) -> bool {
    match api {
        Api::OpenAiChat => openai_chat::rewrite_response(body, verdicts),
        Api::AnthropicMessages => anthropic_messages::rewrite_response(body, verdicts),
        Api::OpenAiResponses => openai_responses::rewrite_response(body, verdicts),
    }
}

/// Appends a repair turn to a request body: the withheld calls as the assistant's turn and
/// one host-authored result per call (tool-turn contract §B "repair"; MCP `isError`, §G).
pub fn append_repair(api: Api, body: &mut Value, choice: &ChoiceEmissions, items: &[RepairItem]) {
    match api {
        Api::OpenAiChat => openai_chat::append_repair(body, choice, items),
        Api::AnthropicMessages => anthropic_messages::append_repair(body, choice, items),
        Api::OpenAiResponses => openai_responses::append_repair(body, choice, items),
    }
}

/// The provider-enforced output schema of a request (`structured` channel, tool-turn
/// contract §A): Chat `response_format: {type: "json_schema", json_schema: {name, schema}}`;
/// Messages `output_config.format` ([`anthropic_messages::structured_schema`]); Responses
/// `text.format` ([`openai_responses::structured_schema`]).
pub fn structured_schema(api: Api, body: &Value) -> Option<(String, Value)> {
    match api {
        Api::OpenAiChat => {
            let rf = body.get("response_format")?;
            if rf.get("type").and_then(Value::as_str) != Some("json_schema") {
                return None;
            }
            let js = rf.get("json_schema")?;
            let name = js
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("response_format")
                .to_owned();
            Some((name, js.get("schema")?.clone()))
        }
        Api::AnthropicMessages => anthropic_messages::structured_schema(body),
        Api::OpenAiResponses => openai_responses::structured_schema(body),
    }
}

/// Appends a repair turn for a text answer: the answer as the assistant's turn, then a
/// host-authored user message with the validator's findings.
pub fn append_text_repair(body: &mut Value, answer: &str, feedback: &str) {
    if let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) {
        messages.push(serde_json::json!({"role": "assistant", "content": answer}));
        messages.push(serde_json::json!({"role": "user", "content": feedback}));
    } else if body.get("messages").is_none() {
        // Responses: the transcript is `input`.
        openai_responses::append_text_repair(body, answer, feedback);
    }
}

/// The per-API stream state machine: forwards what it may at once, holds tool-call events
/// until the completion state is known, then releases or rewrites them.
#[derive(Debug)]
pub enum StreamAdapter {
    OpenAiChat(openai_chat::ChatStream),
    AnthropicMessages(anthropic_messages::MessagesStream),
    OpenAiResponses(Box<openai_responses::ResponsesStream>),
}

impl StreamAdapter {
    /// A fresh state machine for one streamed response to `turn`; `splice` when it is a
    /// repair round continuing the agent's stream (the Responses adapter splices itself).
    pub fn new(turn: &Turn, splice: Option<&Splice>) -> Self {
        match turn.api {
            Api::OpenAiChat => Self::OpenAiChat(openai_chat::ChatStream::new(turn)),
            Api::AnthropicMessages => Self::AnthropicMessages(match splice {
                Some(Splice::AnthropicMessages { offset }) => {
                    anthropic_messages::MessagesStream::continuing(turn, *offset)
                }
                _ => anthropic_messages::MessagesStream::new(turn),
            }),
            Api::OpenAiResponses => Self::OpenAiResponses(Box::new(match splice {
                Some(Splice::OpenAiResponses(s)) => {
                    openai_responses::ResponsesStream::continuing(turn, s)
                }
                _ => openai_responses::ResponsesStream::new(turn),
            })),
        }
    }

    /// Takes one classified event; what may be forwarded now is appended to `out`.
    pub fn push(&mut self, event: Event, out: &mut Vec<Bytes>) {
        match self {
            Self::OpenAiChat(s) => s.push(event, out),
            Self::AnthropicMessages(s) => s.push(event, out),
            Self::OpenAiResponses(s) => s.push(event, out),
        }
    }

    /// The stream broke its structure in a way that does not identify each call uniquely or
    /// contradicts what was decided (each adapter's `push` lists its rules): nothing more is
    /// forwarded and the stream ends with the provider-shaped error.
    pub fn violation(&self) -> Option<&str> {
        match self {
            Self::OpenAiChat(s) => s.violation(),
            Self::AnthropicMessages(s) => s.violation(),
            Self::OpenAiResponses(s) => s.violation(),
        }
    }

    /// Held calls can now be admitted: their completion state is known.
    pub fn ready(&self) -> bool {
        match self {
            Self::OpenAiChat(s) => s.ready(),
            Self::AnthropicMessages(s) => s.ready(),
            Self::OpenAiResponses(s) => s.ready(),
        }
    }

    /// The response reached its terminal event; ending now is not a cut.
    pub fn finished(&self) -> bool {
        match self {
            Self::OpenAiChat(s) => s.finished(),
            Self::AnthropicMessages(s) => s.finished(),
            Self::OpenAiResponses(s) => s.finished(),
        }
    }

    /// The provider reported an error in the stream (its error event was forwarded).
    pub fn failed(&self) -> bool {
        match self {
            Self::OpenAiChat(s) => s.failed(),
            Self::AnthropicMessages(s) => s.failed(),
            Self::OpenAiResponses(s) => s.failed(),
        }
    }

    /// Calls are held and not yet decided.
    pub fn pending(&self) -> bool {
        match self {
            Self::OpenAiChat(s) => s.pending(),
            Self::AnthropicMessages(s) => s.pending(),
            Self::OpenAiResponses(s) => s.pending(),
        }
    }

    /// The held emissions to admit.
    pub fn round(&self) -> Vec<ChoiceEmissions> {
        match self {
            Self::OpenAiChat(s) => s.round(),
            Self::AnthropicMessages(s) => s.round(),
            Self::OpenAiResponses(s) => s.round(),
        }
    }

    /// Completion state of each choice seen so far, for the journal.
    pub fn completions(&self) -> Vec<Completion> {
        match self {
            Self::OpenAiChat(s) => s.completions(),
            Self::AnthropicMessages(s) => s.completions(),
            Self::OpenAiResponses(s) => s.completions(),
        }
    }

    /// Releases the held events with the verdicts applied.
    pub fn release(&mut self, verdicts: &[ChoiceVerdict], out: &mut Vec<Bytes>) {
        match self {
            Self::OpenAiChat(s) => s.release(verdicts, out),
            Self::AnthropicMessages(s) => s.release(verdicts, out),
            Self::OpenAiResponses(s) => s.release(verdicts, out),
        }
    }

    /// Drops everything held and appends a provider-shaped error event.
    pub fn cut(&mut self, reason: &str, out: &mut Vec<Bytes>) {
        match self {
            Self::OpenAiChat(s) => s.cut(reason, out),
            Self::AnthropicMessages(s) => s.cut(reason, out),
            Self::OpenAiResponses(s) => s.cut(reason, out),
        }
    }

    /// Drops everything held and ends the stream with a provider-shaped error carrying an
    /// OpenWOP `code` (an outcome surfaced as `error` after the headers went out).
    pub fn fail(&mut self, code: &str, message: &str, out: &mut Vec<Bytes>) {
        match self {
            Self::OpenAiChat(s) => s.fail("turnguard_refused", code, message, out),
            Self::AnthropicMessages(s) => {
                s.fail("invalid_request_error", &format!("{code}: {message}"), out)
            }
            Self::OpenAiResponses(s) => s.fail(code, message, out),
        }
    }

    /// Drops everything held because the round is repaired; returns how the next round's
    /// events must be spliced into the agent's stream.
    pub fn abandon(&mut self) -> Splice {
        match self {
            Self::OpenAiChat(s) => Splice::OpenAiChat {
                owed_roles: s.abandon(),
            },
            Self::AnthropicMessages(s) => Splice::AnthropicMessages {
                offset: s.abandon(),
            },
            Self::OpenAiResponses(s) => Splice::OpenAiResponses(Box::new(s.abandon())),
        }
    }

    /// The journal's record of the provider-stored response, once its id is known
    /// (Responses only).
    pub fn response_link(&self) -> Option<ResponseLink> {
        match self {
            Self::OpenAiResponses(s) => s.response_link(),
            Self::OpenAiChat(_) | Self::AnthropicMessages(_) => None,
        }
    }
}

/// How a repair round's stream continues the agent's stream, which already carries the
/// first round's text: the SDKs must see one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Splice {
    /// Chat: the role is not repeated (the SDK concatenates string deltas), except for the
    /// choices in `owed_roles`, whose role chunk was held and dropped: the first chunk of
    /// such a choice in the repair round carries `role: "assistant"` (openai-node throws
    /// `missing role for choice N` on a stream without one), and later ones do not.
    OpenAiChat {
        /// Choice indices the agent has not been sent a `delta.role` for yet.
        owed_roles: std::collections::BTreeSet<u32>,
    },
    /// Messages: no second `message_start`; content block indices continue after `offset`.
    AnthropicMessages { offset: u64 },
    /// Responses: the adapter of the next round continues the agent's response itself
    /// (no second `response.created`, the agent's response id, `output_index` and
    /// `sequence_number` continuing, the items already sent kept in the final `output`).
    OpenAiResponses(Box<openai_responses::ResponsesSplice>),
}

impl Splice {
    /// Rewrites one event of the repair round, or drops it (`None`).
    pub fn apply(&mut self, event: Event) -> Option<Event> {
        let Some(v) = event.json() else {
            return Some(event);
        };
        match self {
            Self::OpenAiResponses(_) => Some(event),
            Self::OpenAiChat { owed_roles } => {
                let mut v = v.clone();
                let mut changed = false;
                for c in v
                    .get_mut("choices")
                    .and_then(Value::as_array_mut)
                    .into_iter()
                    .flatten()
                {
                    let index = c
                        .get("index")
                        .and_then(Value::as_u64)
                        .and_then(|i| u32::try_from(i).ok());
                    let Some(d) = c.get_mut("delta").and_then(Value::as_object_mut) else {
                        continue;
                    };
                    if index.is_some_and(|i| owed_roles.remove(&i)) {
                        if d.get("role") != Some(&Value::from("assistant")) {
                            d.insert("role".into(), Value::from("assistant"));
                            changed = true;
                        }
                    } else {
                        changed |= d.remove("role").is_some();
                    }
                }
                Some(if changed { event.with_json(v) } else { event })
            }
            Self::AnthropicMessages { offset } => {
                let offset = *offset;
                if event.kind() == Some("message_start") {
                    return None;
                }
                match v.get("index").and_then(Value::as_u64) {
                    Some(ix) if offset > 0 => {
                        let mut v = v.clone();
                        if let Some(obj) = v.as_object_mut() {
                            obj.insert("index".into(), Value::from(ix.saturating_add(offset)));
                        }
                        Some(event.with_json(v))
                    }
                    _ => Some(event),
                }
            }
        }
    }
}
