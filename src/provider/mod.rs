//! Provider adapters: each provider API's requests, JSON responses and SSE events into the
//! neutral [`crate::model`] and back. Provider specifics live in the API's module and nowhere
//! else (STYLE.md "Provider specifics live in `src/provider/<api>.rs`"; issue 13 item 1).
//!
//! One adapter design: [`adapter`] picks the API's [`Provider`] (a unit struct in its module:
//! [`openai_chat::OpenAiChat`], [`anthropic_messages::AnthropicMessages`],
//! [`openai_responses::OpenAiResponses`]) — the only `match` on [`Api`] here. The provider
//! builds its stream state machine, a [`ProviderStream`]; a stream abandoned for a repair
//! round says how the next round continues the agent's stream, a [`Splice`] whose state and
//! rewrite ([`SpliceState`]) the same module owns. This file holds the traits, the selector
//! and `CallNames`; no provider event name, field or error shape.

pub mod anthropic_messages;
pub mod block;
mod chat_chunk;
pub mod openai_chat;
pub mod openai_responses;
pub mod view;

use bytes::Bytes;
use serde_json::Value;

use crate::model::{
    AnswerContext, Api, ChoiceEmissions, ChoiceVerdict, Completion, RepairItem, ResponseLink, Turn,
    UntrustedKind,
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

/// The adapter of `api`: the one place a provider API is chosen.
pub fn adapter(api: Api) -> &'static dyn Provider {
    match api {
        Api::OpenAiChat => &openai_chat::OpenAiChat,
        Api::AnthropicMessages => &anthropic_messages::AnthropicMessages,
        Api::OpenAiResponses => &openai_responses::OpenAiResponses,
    }
}

/// The one-event machine of a non-stream answer to `turn` ([`block::Block`]): a JSON answer
/// goes through the same round engine as a stream.
pub fn block(turn: &Turn) -> Box<dyn ProviderStream> {
    Box::new(block::Block::new(adapter(turn.api), turn.answer_context()))
}

/// The request/response side of one provider API: its request and non-stream response
/// bodies into the neutral model and back, and its stream state machine. Wire facts are from
/// `shared/reference/wire-formats.md` (each module names its section).
pub trait Provider: Sync {
    /// Reads a request body into a [`Turn`], each declared schema copied out of `body`.
    ///
    /// Errors: a reason naming the field that is not what the API expects.
    fn parse_request(&self, body: &Value) -> Result<Turn, String> {
        self.parse_request_with(
            &crate::strict_json::RequestBody::from(body.clone()),
            &crate::model::CopiedSchemas,
        )
    }

    /// [`Provider::parse_request`] of a body as the proxy holds it (its declared tools
    /// possibly shared, [`crate::strict_json::RequestBody`]), each declared schema taken
    /// through `schemas` (the proxy passes its schema cache, which shares the tree it keeps
    /// for an equal schema).
    ///
    /// Errors: as [`Provider::parse_request`].
    fn parse_request_with(
        &self,
        body: &crate::strict_json::RequestBody,
        schemas: &dyn crate::model::DeclaredSchemas,
    ) -> Result<Turn, String>;

    /// Reads a non-stream response body into one [`ChoiceEmissions`] per choice.
    ///
    /// Errors: the response does not identify each choice and call uniquely
    /// ([`crate::model::check_identities`]; DESIGN.md §9): the round fails closed.
    fn parse_response(
        &self,
        body: &Value,
        ctx: &AnswerContext,
    ) -> Result<Vec<ChoiceEmissions>, String>;

    /// How many choices the request body asks for (Chat's `n`, default 1; one for the APIs
    /// without choices). A repair round is asked only of a one-choice request.
    fn choices_requested(&self, body: &Value) -> u64;

    /// Prepares the request body sent upstream for what the completion stage must know (a
    /// Chat stream with a token limit asks for its usage chunk). The agent's own request (its
    /// digest, its record) is not changed; `turn` notes what was asked. Returns whether `body`
    /// changed: when it did not, the agent's own bytes are what goes upstream.
    fn prepare_upstream(&self, body: &mut crate::strict_json::RequestBody, turn: &mut Turn)
        -> bool;

    /// What the journal keeps of a non-stream response the provider stores for later turns
    /// (`previous_response_id`); `None` for an API without stored responses.
    fn response_link(&self, body: &Value, ctx: &AnswerContext) -> Option<ResponseLink>;

    /// Applies `verdicts` (one per choice with calls, in order) to a non-stream response body;
    /// `true` when the body changed (else the upstream bytes are served as received).
    fn rewrite_response(&self, body: &mut Value, verdicts: &[ChoiceVerdict]) -> bool;

    /// Whether [`Provider::rewrite_response`] could change a body under `verdicts`. `false`
    /// promises it would change none, so the upstream bytes are served without reading the
    /// body's tree. Default: `true` (the tree is read and the rewrite decides).
    fn rewrites(&self, _verdicts: &[ChoiceVerdict]) -> bool {
        true
    }

    /// [`Provider::parse_response`] read from a body's bytes through a typed view
    /// ([`view`]), without building its JSON tree. `Some` is what `parse_response` answers
    /// for the tree of `raw`, given only when a tree can be read from `raw` (a view checks
    /// every member it does not read as a tree would read it, in the same pass:
    /// [`view::members`]); `None` (the default: the API has no view, or the
    /// view refuses this body) asks the caller to read the tree. An API with a view stores
    /// no responses: its [`Provider::response_link`] is `None` whatever the body.
    fn parse_response_bytes(
        &self,
        _raw: &[u8],
        _ctx: &AnswerContext,
    ) -> Option<Result<Vec<ChoiceEmissions>, String>> {
        None
    }

    /// Appends a repair turn to a request body: the withheld calls of `choice` as the
    /// assistant's turn and one host-authored result per item (tool-turn contract §B
    /// "repair"; MCP `isError`, §G).
    fn append_repair(&self, body: &mut Value, choice: &ChoiceEmissions, items: &[RepairItem]);

    /// The provider-enforced output schema of a request, `(name, JSON Schema)` (`structured`
    /// channel, tool-turn contract §A); `None` when the request asks for none.
    fn structured_schema(&self, body: &Value) -> Option<(String, Value)>;

    /// Appends a repair turn for a text answer: `answer` as the assistant's turn, then a
    /// host-authored user message with the validator's `feedback` (tool-turn contract §A).
    fn append_text_repair(&self, body: &mut Value, answer: &str, feedback: &str);

    /// A fresh stream state machine for one streamed response to `turn`; `splice` when it is
    /// a repair round continuing the agent's stream (a splice of another API is ignored).
    fn stream(&self, turn: &Turn, splice: Option<&Splice>) -> Box<dyn ProviderStream>;
}

/// The per-API stream state machine: forwards what it may at once, holds tool-call events
/// until the completion state is known, then releases or rewrites them (DESIGN.md §9,
/// "upstream"). Fed one classified [`Event`] at a time; what the agent may receive is appended
/// to `out` as SSE blocks, upstream bytes as received unless a verdict changed them.
pub trait ProviderStream: std::fmt::Debug + Send + Sync {
    /// Takes one classified event; what may be forwarded now is appended to `out`.
    fn push(&mut self, event: Event, out: &mut Vec<Bytes>);

    /// The adapter reads an event's JSON from its text itself ([`Event::classify_text`],
    /// [`crate::sse::Payload::Text`]), and refuses a text that is not a JSON object
    /// serde_json reads as [`Event::classify`] would. Only where no one else reads the
    /// event's tree (no splice, no channel check): then the pipeline classifies with
    /// [`Event::classify`].
    fn reads_text(&self) -> bool {
        false
    }

    /// The stream broke its structure in a way that does not identify each call uniquely or
    /// contradicts what was decided (each adapter's `push` lists its rules): nothing more is
    /// forwarded and the stream ends with the provider-shaped error.
    fn violation(&self) -> Option<&str>;

    /// Held calls can now be admitted: their completion state is known.
    fn ready(&self) -> bool;

    /// The response reached its terminal event; ending now is not a cut.
    fn finished(&self) -> bool;

    /// The provider reported an error in the stream (its error event was forwarded).
    fn failed(&self) -> bool;

    /// Calls are held and not yet decided.
    fn pending(&self) -> bool;

    /// The held emissions to admit, one per choice with calls.
    fn round(&self) -> Vec<ChoiceEmissions>;

    /// Completion state of each choice seen so far, for the journal.
    fn completions(&self) -> Vec<Completion>;

    /// Releases the held events with `verdicts` (one per choice of [`Self::round`]) applied.
    fn release(&mut self, verdicts: &[ChoiceVerdict], out: &mut Vec<Bytes>);

    /// The upstream stream was cut (`reason`): drops everything held and appends the
    /// provider-shaped error event, on which the API's official SDK raises.
    fn cut(&mut self, reason: &str, out: &mut Vec<Bytes>);

    /// Drops everything held and ends the stream with the provider-shaped error carrying an
    /// OpenWOP `code` and `message` (an outcome surfaced as `error` after the headers went
    /// out). Each adapter shapes it as its API's SDK reads it.
    fn fail(&mut self, code: &str, message: &str, out: &mut Vec<Bytes>);

    /// Drops everything held because the round is repaired; returns how the next round's
    /// events must be spliced into the agent's stream.
    fn abandon(&mut self) -> Splice;

    /// The journal's record of the provider-stored response, once its id is known; `None`
    /// for an API without stored responses.
    fn response_link(&self) -> Option<ResponseLink>;

    /// The piece of the text answer `event` carries, if any (what a channel check of the
    /// answer accumulates, tool-turn contract §A).
    fn answer_text<'a>(&'a self, event: &'a Event) -> Option<&'a str>;

    /// `event` is the event that ends a response (what a channel check holds back until the
    /// answer is validated). Decided from the event alone, not from the stream's state.
    fn is_terminal(&self, event: &Event) -> bool;
}

/// How a repair round's stream continues the agent's stream, which already carries the
/// first round's text: the SDKs must see one message. Made by [`ProviderStream::abandon`];
/// the adapter of the same API reads its own state back ([`Splice::state`]).
#[derive(Debug)]
pub struct Splice(Box<dyn SpliceState>);

/// An adapter's splice state and its rewrite of the repair round's events.
pub trait SpliceState: std::fmt::Debug + Send + Sync + 'static {
    /// Rewrites one event of the repair round, or drops it (`None`).
    fn apply(&mut self, event: Event) -> Option<Event>;

    /// The state as [`std::any::Any`], for [`Splice::state`].
    fn as_any(&self) -> &dyn std::any::Any;
}

impl Splice {
    /// Wraps an adapter's splice state.
    pub fn new(state: impl SpliceState) -> Self {
        Self(Box::new(state))
    }

    /// Rewrites one event of the repair round, or drops it (`None`).
    pub fn apply(&mut self, event: Event) -> Option<Event> {
        self.0.apply(event)
    }

    /// The state, when it is a `T` (the adapter that made it reads it back).
    pub fn state<T: SpliceState>(&self) -> Option<&T> {
        self.0.as_any().downcast_ref::<T>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::SseFramer;

    fn event(raw: &str) -> Event {
        let mut framer = SseFramer::new(1 << 16);
        let mut blocks = framer.push(raw.as_bytes()).unwrap();
        Event::classify(blocks.remove(0)).unwrap()
    }

    fn stream(api: Api) -> Box<dyn ProviderStream> {
        let body = serde_json::json!({
            "model": "m", "stream": true, "max_tokens": 100, "messages": [], "input": "x"
        });
        let turn = adapter(api).parse_request(&body).unwrap();
        adapter(api).stream(&turn, None)
    }

    /// Each stream reads the answer text and the terminal event of its own API only (what a
    /// channel check in `proxy::stream` asks of it).
    #[test]
    fn each_stream_reads_its_own_answer_text_and_terminal_event() {
        let chat_text = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let done = "data: [DONE]\n\n";
        let text_delta = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n";
        let json_delta = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\"}}\n\n";
        let stop = "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let output_text = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}\n\n";
        let args = "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{\"}\n\n";
        let completed = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{}}\n\n";
        let incomplete = "event: response.incomplete\ndata: {\"type\":\"response.incomplete\",\"response\":{}}\n\n";
        let failed =
            "event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{}}\n\n";
        // (api, event, answer text, terminal)
        let cases: [(Api, &str, Option<&str>, bool); 15] = [
            (Api::OpenAiChat, chat_text, Some("hi"), false),
            (Api::OpenAiChat, done, None, true),
            (Api::OpenAiChat, text_delta, None, false),
            (Api::OpenAiChat, stop, None, false),
            (Api::OpenAiChat, completed, None, false),
            (Api::AnthropicMessages, text_delta, Some("hi"), false),
            (Api::AnthropicMessages, json_delta, None, false),
            (Api::AnthropicMessages, stop, None, true),
            (Api::AnthropicMessages, done, None, false),
            (Api::AnthropicMessages, chat_text, None, false),
            (Api::OpenAiResponses, output_text, Some("hi"), false),
            (Api::OpenAiResponses, args, None, false),
            (Api::OpenAiResponses, completed, None, true),
            (Api::OpenAiResponses, incomplete, None, true),
            (Api::OpenAiResponses, failed, None, false),
        ];
        for (api, raw, text, terminal) in cases {
            let s = stream(api);
            let e = event(raw);
            assert_eq!(s.answer_text(&e), text, "{api:?}: {raw}");
            assert_eq!(s.is_terminal(&e), terminal, "{api:?}: {raw}");
        }
    }

    /// `fail` ends each API's stream with that API's error shape, carrying the OpenWOP code.
    #[test]
    fn each_stream_fails_in_its_own_shape() {
        let cases = [
            (
                Api::OpenAiChat,
                "\"type\":\"turnguard_refused\"",
                "\"code\":\"envelope_invalid\"",
            ),
            (
                Api::AnthropicMessages,
                "\"type\":\"invalid_request_error\"",
                "\"message\":\"envelope_invalid: no\"",
            ),
            (
                Api::OpenAiResponses,
                "\"type\":\"turnguard_refused\"",
                "\"code\":\"envelope_invalid\"",
            ),
        ];
        for (api, kind, code) in cases {
            let mut out = Vec::new();
            stream(api).fail("envelope_invalid", "no", &mut out);
            let first = out
                .first()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            assert!(
                first.contains(kind) && first.contains(code),
                "{api:?}: {first}"
            );
        }
    }
}
