//! Provider adapters: each provider API's requests, JSON responses and SSE events into the
//! neutral [`crate::model`] and back. Provider specifics live here and nowhere else.

pub mod anthropic_messages;
pub mod openai_chat;
pub mod openai_responses;

use bytes::Bytes;
use serde_json::Value;

use crate::model::{
    Api, ChoiceEmissions, ChoiceVerdict, Completion, RepairItem, ResponseLink, Turn,
};
use crate::sse::SseBlock;

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
pub fn parse_response(api: Api, body: &Value, turn: &Turn) -> Vec<ChoiceEmissions> {
    match api {
        Api::OpenAiChat => openai_chat::parse_response(body, turn),
        Api::AnthropicMessages => anthropic_messages::parse_response(body, turn),
        Api::OpenAiResponses => openai_responses::parse_response(body, turn),
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
/// contract §A): Chat `response_format: {type: "json_schema", json_schema: {name, schema}}`.
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
        Api::AnthropicMessages => None,
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
            Api::AnthropicMessages => {
                Self::AnthropicMessages(anthropic_messages::MessagesStream::new(turn))
            }
            Api::OpenAiResponses => Self::OpenAiResponses(Box::new(match splice {
                Some(Splice::OpenAiResponses(s)) => {
                    openai_responses::ResponsesStream::continuing(turn, s)
                }
                _ => openai_responses::ResponsesStream::new(turn),
            })),
        }
    }

    /// Takes one SSE block; what may be forwarded now is appended to `out`.
    pub fn push(&mut self, block: SseBlock, out: &mut Vec<Bytes>) {
        match self {
            Self::OpenAiChat(s) => s.push(block, out),
            Self::AnthropicMessages(s) => s.push(block, out),
            Self::OpenAiResponses(s) => s.push(block, out),
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
            Self::OpenAiChat(s) => {
                s.abandon();
                Splice::OpenAiChat
            }
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
    /// Chat: the role is not repeated (the SDK concatenates string deltas).
    OpenAiChat,
    /// Messages: no second `message_start`; content block indices continue after `offset`.
    AnthropicMessages { offset: u64 },
    /// Responses: the adapter of the next round continues the agent's response itself
    /// (no second `response.created`, the agent's response id, `output_index` and
    /// `sequence_number` continuing, the items already sent kept in the final `output`).
    OpenAiResponses(Box<openai_responses::ResponsesSplice>),
}

impl Splice {
    /// Rewrites one block of the repair round, or drops it (`None`).
    pub fn apply(&self, block: SseBlock) -> Option<SseBlock> {
        if matches!(self, Self::OpenAiResponses(_)) {
            return Some(block);
        }
        let Some(data) = block.data.as_deref() else {
            return Some(block);
        };
        let Ok(mut v) = serde_json::from_str::<Value>(data) else {
            return Some(block);
        };
        let changed = match *self {
            Self::OpenAiResponses(_) => false,
            Self::OpenAiChat => {
                let mut changed = false;
                for c in v
                    .get_mut("choices")
                    .and_then(Value::as_array_mut)
                    .into_iter()
                    .flatten()
                {
                    if let Some(d) = c.get_mut("delta").and_then(Value::as_object_mut) {
                        changed |= d.remove("role").is_some();
                    }
                }
                changed
            }
            Self::AnthropicMessages { offset } => {
                if v.get("type").and_then(Value::as_str) == Some("message_start") {
                    return None;
                }
                match v.get("index").and_then(Value::as_u64) {
                    Some(ix) if offset > 0 => {
                        v["index"] = Value::from(ix + offset);
                        true
                    }
                    _ => false,
                }
            }
        };
        if !changed {
            return Some(block);
        }
        let data = v.to_string();
        let raw = crate::sse::encode(block.event.as_deref(), &data);
        Some(SseBlock {
            raw,
            event: block.event,
            data: Some(data),
        })
    }
}
