//! A scripted model answer (`{"reply": …}` in a mock script) rendered in the shape the request
//! asks for: the API follows from the request path (`…/chat/completions`, `…/messages`,
//! `…/responses`), streaming from the request's `"stream": true`. One script then serves any
//! client — the SDKs' stream and non-stream calls, Claude Code, Codex — without a fixture per
//! shape.
//!
//! The shapes follow `shared/reference/wire-formats.md` (Chat: role chunk, `tool_calls` deltas
//! keyed by index, a `finish_reason` chunk with `delta: {}`, the usage chunk when
//! `stream_options.include_usage`, `[DONE]`; Anthropic: `message_start` … `message_stop` with
//! `event:` lines, `input_json_delta` from `""`; Responses: `response.created` …
//! `response.completed` with `sequence_number` and `output_index`). A `truncated` reply is cut by
//! the token limit in the middle of its last tool call, the way each API reports it
//! (`finish_reason: "length"`; `stop_reason: "max_tokens"` with the block left open;
//! `status: "incomplete"` with `incomplete_details.reason = "max_output_tokens"`).

use crate::strict_json::Lookup as _;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// What the scripted model says: optional reasoning, optional text, then tool calls.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reply {
    /// Reasoning before the answer: an Anthropic `thinking` block (with a placeholder
    /// `signature`), a Responses `reasoning` item; Chat has none and drops it.
    #[serde(default)]
    pub reasoning: Option<String>,
    /// Text before the calls (or the whole answer when there are none).
    #[serde(default)]
    pub text: Option<String>,
    /// Tool calls, in order.
    #[serde(default)]
    pub tool_calls: Vec<ReplyCall>,
    /// Cut by the token limit halfway through the last tool call (or the text when there is
    /// no call).
    #[serde(default)]
    pub truncated: bool,
    /// The `model` reported; default: the request's `model`.
    #[serde(default)]
    pub model: Option<String>,
}

/// One tool call of a [`Reply`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplyCall {
    /// The tool's name.
    pub name: String,
    /// A function tool's arguments (a JSON object; serialized compactly on the wire).
    #[serde(default)]
    pub arguments: Option<Value>,
    /// A custom (freeform) tool's raw input: a Responses `custom_tool_call` / Chat
    /// `type: "custom"` call instead of a function call.
    #[serde(default)]
    pub input: Option<String>,
    /// The Responses `namespace` the tool was declared in (`additional_tools` namespaces).
    #[serde(default)]
    pub namespace: Option<String>,
}

impl ReplyCall {
    /// The raw text the model streams for this call: the compact JSON arguments, or the
    /// custom tool's input.
    fn raw(&self) -> String {
        match (&self.input, &self.arguments) {
            (Some(input), _) => input.clone(),
            (None, Some(args)) => args.to_string(),
            (None, None) => "{}".to_owned(),
        }
    }
    fn is_custom(&self) -> bool {
        self.input.is_some()
    }
}

/// The provider API a request path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiShape {
    /// `…/chat/completions`
    Chat,
    /// `…/messages`
    Messages,
    /// `…/responses`
    Responses,
}

impl ApiShape {
    /// The API of a request path, if it names one.
    pub fn of_path(path: &str) -> Option<Self> {
        let path = path.trim_end_matches('/');
        if path.ends_with("/chat/completions") {
            Some(Self::Chat)
        } else if path.ends_with("/messages") {
            Some(Self::Messages)
        } else if path.ends_with("/responses") {
            Some(Self::Responses)
        } else {
            None
        }
    }
}

/// A rendered answer: its content type and its body (one piece per SSE event for a stream).
pub struct Rendered {
    /// `application/json` or `text/event-stream`.
    pub content_type: &'static str,
    /// The body; for a stream each piece is one complete event.
    pub events: Vec<Bytes>,
}

/// Renders `reply` for a request to `api` with body `request`; `n` makes the ids unique per
/// answer (`call_mock{n}_{i}`, `toolu_mock{n}_{i}`, `resp_mock{n}`, …).
pub fn render(reply: &Reply, api: ApiShape, request: &Value, n: u64) -> Rendered {
    let stream = request.get("stream").and_then(Value::as_bool) == Some(true);
    let model = reply
        .model
        .clone()
        .or_else(|| {
            request
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "mock-model".to_owned());
    let plan = Plan::new(reply);
    let r = Ctx {
        reply,
        plan,
        model,
        n,
    };
    match (api, stream) {
        (ApiShape::Chat, false) => json_body(r.chat_json()),
        (ApiShape::Chat, true) => {
            let usage = request
                .at("/stream_options/include_usage")
                .and_then(Value::as_bool)
                == Some(true);
            sse_body(r.chat_chunks(usage))
        }
        (ApiShape::Messages, false) => json_body(r.messages_json()),
        (ApiShape::Messages, true) => sse_body(r.messages_events()),
        (ApiShape::Responses, false) => json_body(r.responses_json(request)),
        (ApiShape::Responses, true) => sse_body(r.responses_events(request)),
    }
}

fn json_body(v: Value) -> Rendered {
    Rendered {
        content_type: "application/json",
        events: vec![Bytes::from(v.to_string())],
    }
}

fn sse_body(events: Vec<(Option<String>, String)>) -> Rendered {
    Rendered {
        content_type: "text/event-stream",
        events: events
            .into_iter()
            .map(|(name, data)| {
                Bytes::from(match name {
                    Some(n) => format!("event: {n}\ndata: {data}\n\n"),
                    None => format!("data: {data}\n\n"),
                })
            })
            .collect(),
    }
}

/// What is said, after the cut: the text, and each call's raw text (the last one halved when
/// truncated).
struct Plan {
    text: Option<String>,
    calls: Vec<String>,
    /// The index of the call left unfinished, if any.
    cut_call: Option<usize>,
}

impl Plan {
    fn new(reply: &Reply) -> Self {
        let mut text = reply.text.clone();
        let mut calls: Vec<String> = reply.tool_calls.iter().map(ReplyCall::raw).collect();
        let mut cut_call = None;
        if reply.truncated {
            if let Some(last) = calls.last_mut() {
                *last = half(last);
                cut_call = Some(calls.len() - 1);
            } else if let Some(t) = text.as_mut() {
                *t = half(t);
            }
        }
        Self {
            text,
            calls,
            cut_call,
        }
    }
}

/// The first half of `s` (at a char boundary), never all of a non-empty string.
fn half(s: &str) -> String {
    let mut cut = s.len() / 2;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s[..cut].to_owned()
}

/// `s` in up to three pieces (at char boundaries), as a model streams it.
fn pieces(s: &str) -> Vec<String> {
    if s.is_empty() {
        return Vec::new();
    }
    let chars: Vec<char> = s.chars().collect();
    let step = chars.len().div_ceil(3).max(1);
    chars
        .chunks(step)
        .map(|c| c.iter().collect::<String>())
        .collect()
}

const CREATED: u64 = 1_767_225_600;

struct Ctx<'a> {
    reply: &'a Reply,
    plan: Plan,
    model: String,
    n: u64,
}

impl Ctx<'_> {
    fn call_id(&self, i: usize) -> String {
        format!("call_mock{}_{i}", self.n)
    }
    fn output_tokens(&self) -> u64 {
        let chars = self.plan.text.as_ref().map_or(0, String::len)
            + self.plan.calls.iter().map(String::len).sum::<usize>();
        (chars as u64).div_ceil(4).max(1)
    }

    // ---------------------------------------------------------------- Chat Completions

    fn chat_finish(&self) -> &'static str {
        if self.reply.truncated {
            "length"
        } else if self.plan.calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        }
    }

    fn chat_usage(&self) -> Value {
        let out = self.output_tokens();
        json!({"prompt_tokens": 10, "completion_tokens": out, "total_tokens": 10 + out})
    }

    fn chat_json(&self) -> Value {
        let mut message = Map::new();
        message.insert("role".into(), json!("assistant"));
        message.insert("content".into(), json!(self.plan.text));
        message.insert("refusal".into(), Value::Null);
        if !self.plan.calls.is_empty() {
            let calls: Vec<Value> = self
                .reply
                .tool_calls
                .iter()
                .zip(&self.plan.calls)
                .enumerate()
                .map(|(i, (c, raw))| {
                    if c.is_custom() {
                        json!({"id": self.call_id(i), "type": "custom",
                               "custom": {"name": c.name, "input": raw}})
                    } else {
                        json!({"id": self.call_id(i), "type": "function",
                               "function": {"name": c.name, "arguments": raw}})
                    }
                })
                .collect();
            message.insert("tool_calls".into(), Value::Array(calls));
        }
        json!({
            "id": format!("chatcmpl-mock{}", self.n),
            "object": "chat.completion",
            "created": CREATED,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": null,
                         "finish_reason": self.chat_finish()}],
            "usage": self.chat_usage(),
        })
    }

    fn chat_chunks(&self, include_usage: bool) -> Vec<(Option<String>, String)> {
        let id = format!("chatcmpl-mock{}", self.n);
        let chunk = |delta: Value, finish: Option<&str>| {
            let mut c = json!({
                "id": id, "object": "chat.completion.chunk", "created": CREATED,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            });
            if include_usage {
                if let Some(o) = c.as_object_mut() {
                    o.insert("usage".into(), Value::Null);
                }
            }
            (None, c.to_string())
        };
        let mut out = Vec::new();
        // The role chunk: alone before text (`content: ""`), merged with the first tool call
        // when the answer starts with one (FX stream-tool-call-single-include-usage.sse).
        if let Some(text) = &self.plan.text {
            out.push(chunk(
                json!({"role": "assistant", "content": "", "refusal": null}),
                None,
            ));
            for p in pieces(text) {
                out.push(chunk(json!({"content": p}), None));
            }
        }
        for (i, (c, raw)) in self
            .reply
            .tool_calls
            .iter()
            .zip(&self.plan.calls)
            .enumerate()
        {
            let head = if c.is_custom() {
                json!({"index": i, "id": self.call_id(i), "type": "custom",
                       "custom": {"name": c.name, "input": ""}})
            } else {
                json!({"index": i, "id": self.call_id(i), "type": "function",
                       "function": {"name": c.name, "arguments": ""}})
            };
            let delta = if i == 0 && self.plan.text.is_none() {
                json!({"role": "assistant", "content": null, "tool_calls": [head], "refusal": null})
            } else {
                json!({"tool_calls": [head]})
            };
            out.push(chunk(delta, None));
            for p in pieces(raw) {
                let d = if c.is_custom() {
                    json!({"index": i, "custom": {"input": p}})
                } else {
                    json!({"index": i, "function": {"arguments": p}})
                };
                out.push(chunk(json!({"tool_calls": [d]}), None));
            }
        }
        if self.plan.text.is_none() && self.plan.calls.is_empty() {
            out.push(chunk(
                json!({"role": "assistant", "content": "", "refusal": null}),
                None,
            ));
        }
        out.push(chunk(json!({}), Some(self.chat_finish())));
        if include_usage {
            out.push((
                None,
                json!({
                    "id": id, "object": "chat.completion.chunk", "created": CREATED,
                    "model": self.model, "choices": [], "usage": self.chat_usage(),
                })
                .to_string(),
            ));
        }
        out.push((None, "[DONE]".to_owned()));
        out
    }

    // ---------------------------------------------------------------- Anthropic Messages

    fn tool_use_id(&self, i: usize) -> String {
        format!("toolu_mock{}_{i}", self.n)
    }

    fn messages_stop(&self) -> &'static str {
        if self.reply.truncated {
            "max_tokens"
        } else if self.plan.calls.is_empty() {
            "end_turn"
        } else {
            "tool_use"
        }
    }

    fn signature(&self) -> String {
        format!("mock-signature-{}", self.n)
    }

    fn messages_json(&self) -> Value {
        let mut content = Vec::new();
        if let Some(r) = &self.reply.reasoning {
            content.push(json!({"type": "thinking", "thinking": r, "signature": self.signature()}));
        }
        if let Some(t) = &self.plan.text {
            content.push(json!({"type": "text", "text": t}));
        }
        for (i, (c, raw)) in self
            .reply
            .tool_calls
            .iter()
            .zip(&self.plan.calls)
            .enumerate()
        {
            // A cut call's input cannot be parsed; the API reports what it has as an object.
            let input = serde_json::from_str::<Value>(raw)
                .ok()
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({}));
            content.push(
                json!({"type": "tool_use", "id": self.tool_use_id(i), "name": c.name,
                                "input": input}),
            );
        }
        json!({
            "id": format!("msg_mock{}", self.n),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.messages_stop(),
            "stop_sequence": null,
            "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": self.output_tokens()},
        })
    }

    fn messages_events(&self) -> Vec<(Option<String>, String)> {
        let mut out: Vec<(Option<String>, String)> = Vec::new();
        let mut ev = |v: Value| {
            let name = v
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            out.push((Some(name), v.to_string()));
        };
        ev(json!({"type": "message_start", "message": {
            "id": format!("msg_mock{}", self.n), "type": "message", "role": "assistant",
            "model": self.model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 1}}}));
        let mut index = 0;
        if let Some(r) = &self.reply.reasoning {
            ev(json!({"type": "content_block_start", "index": index,
                      "content_block": {"type": "thinking", "thinking": "", "signature": ""}}));
            for p in pieces(r) {
                ev(json!({"type": "content_block_delta", "index": index,
                          "delta": {"type": "thinking_delta", "thinking": p}}));
            }
            ev(json!({"type": "content_block_delta", "index": index,
                      "delta": {"type": "signature_delta", "signature": self.signature()}}));
            ev(json!({"type": "content_block_stop", "index": index}));
            index += 1;
        }
        if let Some(t) = &self.plan.text {
            ev(json!({"type": "content_block_start", "index": index,
                      "content_block": {"type": "text", "text": ""}}));
            ev(json!({"type": "ping"}));
            for p in pieces(t) {
                ev(json!({"type": "content_block_delta", "index": index,
                          "delta": {"type": "text_delta", "text": p}}));
            }
            if !(self.reply.truncated && self.plan.calls.is_empty()) {
                ev(json!({"type": "content_block_stop", "index": index}));
            }
            index += 1;
        }
        for (i, (c, raw)) in self
            .reply
            .tool_calls
            .iter()
            .zip(&self.plan.calls)
            .enumerate()
        {
            ev(json!({"type": "content_block_start", "index": index,
                      "content_block": {"type": "tool_use", "id": self.tool_use_id(i),
                                        "name": c.name, "input": {}}}));
            ev(json!({"type": "content_block_delta", "index": index,
                      "delta": {"type": "input_json_delta", "partial_json": ""}}));
            for p in pieces(raw) {
                ev(json!({"type": "content_block_delta", "index": index,
                          "delta": {"type": "input_json_delta", "partial_json": p}}));
            }
            // A block cut by max_tokens is left open (FX stream-max-tokens-mid-tool-use.sse).
            if self.plan.cut_call != Some(i) {
                ev(json!({"type": "content_block_stop", "index": index}));
            }
            index += 1;
        }
        ev(json!({"type": "message_delta",
                  "delta": {"stop_reason": self.messages_stop(), "stop_sequence": null},
                  "usage": {"output_tokens": self.output_tokens()}}));
        ev(json!({"type": "message_stop"}));
        out
    }

    // ---------------------------------------------------------------- OpenAI Responses

    fn response_id(&self) -> String {
        format!("resp_mock{}", self.n)
    }

    /// The output items, finished (`done`) or as first announced.
    fn responses_items(&self, done: bool) -> Vec<Value> {
        let mut items = Vec::new();
        if let Some(r) = &self.reply.reasoning {
            let summary = if done {
                json!([{"type": "summary_text", "text": r}])
            } else {
                json!([])
            };
            items.push(
                json!({"id": format!("rs_mock{}", self.n), "type": "reasoning",
                              "summary": summary}),
            );
        }
        if let Some(t) = &self.plan.text {
            let (status, content) = if done {
                (
                    "completed",
                    json!([{"type": "output_text", "text": t, "annotations": [], "logprobs": []}]),
                )
            } else {
                ("in_progress", json!([]))
            };
            items.push(
                json!({"id": format!("msg_mock{}", self.n), "type": "message",
                              "status": status, "role": "assistant", "content": content}),
            );
        }
        for (i, (c, raw)) in self
            .reply
            .tool_calls
            .iter()
            .zip(&self.plan.calls)
            .enumerate()
        {
            let status = match (done, self.plan.cut_call == Some(i)) {
                (false, _) => "in_progress",
                (true, true) => "incomplete",
                (true, false) => "completed",
            };
            let body = if done { raw.as_str() } else { "" };
            let mut item = if c.is_custom() {
                json!({"id": format!("ctc_mock{}_{i}", self.n), "type": "custom_tool_call",
                       "status": status, "call_id": self.call_id(i), "name": c.name,
                       "input": body})
            } else {
                json!({"id": format!("fc_mock{}_{i}", self.n), "type": "function_call",
                       "status": status, "arguments": body, "call_id": self.call_id(i),
                       "name": c.name})
            };
            if let (Some(ns), Some(o)) = (&c.namespace, item.as_object_mut()) {
                o.insert("namespace".into(), json!(ns));
            }
            items.push(item);
        }
        items
    }

    fn response_object(&self, request: &Value, status: &str, output: Vec<Value>) -> Value {
        let finished = status != "in_progress";
        let out = self.output_tokens();
        let incomplete = if finished && self.reply.truncated {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        let usage = if finished {
            json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": 10 + out})
        } else {
            Value::Null
        };
        let field = |k: &str| request.get(k).cloned().unwrap_or(Value::Null);
        json!({
            "id": self.response_id(), "object": "response", "created_at": CREATED,
            "status": status, "background": false, "error": null,
            "incomplete_details": incomplete, "instructions": field("instructions"),
            "max_output_tokens": field("max_output_tokens"), "model": self.model,
            "output": output, "parallel_tool_calls": true,
            "previous_response_id": field("previous_response_id"),
            "reasoning": {"effort": null, "summary": null},
            "store": request.get("store").cloned().unwrap_or(json!(true)),
            "temperature": 1.0, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [], "top_p": 1.0, "truncation": "disabled",
            "usage": usage, "user": null, "metadata": {},
        })
    }

    fn final_status(&self) -> &'static str {
        if self.reply.truncated {
            "incomplete"
        } else {
            "completed"
        }
    }

    fn responses_json(&self, request: &Value) -> Value {
        self.response_object(request, self.final_status(), self.responses_items(true))
    }

    fn responses_events(&self, request: &Value) -> Vec<(Option<String>, String)> {
        let mut out: Vec<(Option<String>, String)> = Vec::new();
        let mut seq = 0u64;
        let mut ev = |mut v: Value| {
            let name = v
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            if let Some(o) = v.as_object_mut() {
                o.insert("sequence_number".into(), json!(seq));
            }
            seq += 1;
            out.push((Some(name), v.to_string()));
        };
        ev(json!({"type": "response.created",
                  "response": self.response_object(request, "in_progress", Vec::new())}));
        ev(json!({"type": "response.in_progress",
                  "response": self.response_object(request, "in_progress", Vec::new())}));
        let added = self.responses_items(false);
        let done = self.responses_items(true);
        let mut calls = self.reply.tool_calls.iter().zip(&self.plan.calls);
        for (index, (first, last)) in added.into_iter().zip(done.iter()).enumerate() {
            let item_id = first.get("id").cloned().unwrap_or(Value::Null);
            let kind = first
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            ev(
                json!({"type": "response.output_item.added", "output_index": index,
                      "item": first}),
            );
            match kind.as_str() {
                "reasoning" => {
                    if let Some(r) = &self.reply.reasoning {
                        let part = json!({"type": "summary_text", "text": ""});
                        ev(json!({"type": "response.reasoning_summary_part.added",
                                  "item_id": item_id, "output_index": index,
                                  "summary_index": 0, "part": part}));
                        for p in pieces(r) {
                            ev(json!({"type": "response.reasoning_summary_text.delta",
                                      "item_id": item_id, "output_index": index,
                                      "summary_index": 0, "delta": p}));
                        }
                        ev(json!({"type": "response.reasoning_summary_text.done",
                                  "item_id": item_id, "output_index": index,
                                  "summary_index": 0, "text": r}));
                        ev(json!({"type": "response.reasoning_summary_part.done",
                                  "item_id": item_id, "output_index": index,
                                  "summary_index": 0,
                                  "part": {"type": "summary_text", "text": r}}));
                    }
                }
                "message" => {
                    let text = self.plan.text.clone().unwrap_or_default();
                    let empty = json!({"type": "output_text", "text": "", "annotations": []});
                    ev(
                        json!({"type": "response.content_part.added", "item_id": item_id,
                              "output_index": index, "content_index": 0, "part": empty}),
                    );
                    for p in pieces(&text) {
                        ev(
                            json!({"type": "response.output_text.delta", "item_id": item_id,
                                  "output_index": index, "content_index": 0, "delta": p,
                                  "logprobs": []}),
                        );
                    }
                    ev(
                        json!({"type": "response.output_text.done", "item_id": item_id,
                              "output_index": index, "content_index": 0, "text": text,
                              "logprobs": []}),
                    );
                    ev(
                        json!({"type": "response.content_part.done", "item_id": item_id,
                              "output_index": index, "content_index": 0,
                              "part": {"type": "output_text", "text": text,
                                       "annotations": []}}),
                    );
                }
                _ => {
                    let Some((c, raw)) = calls.next() else {
                        continue;
                    };
                    let (delta, finished, key) = if c.is_custom() {
                        (
                            "response.custom_tool_call_input.delta",
                            "response.custom_tool_call_input.done",
                            "input",
                        )
                    } else {
                        (
                            "response.function_call_arguments.delta",
                            "response.function_call_arguments.done",
                            "arguments",
                        )
                    };
                    for p in pieces(raw) {
                        ev(
                            json!({"type": delta, "item_id": item_id, "output_index": index,
                                  "delta": p}),
                        );
                    }
                    ev(
                        json!({"type": finished, "item_id": item_id, "output_index": index,
                              key: raw}),
                    );
                }
            }
            ev(
                json!({"type": "response.output_item.done", "output_index": index,
                      "item": last}),
            );
        }
        let terminal = if self.reply.truncated {
            "response.incomplete"
        } else {
            "response.completed"
        };
        ev(json!({"type": terminal,
                  "response": self.response_object(request, self.final_status(), done)}));
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn data(r: &Rendered) -> Vec<Value> {
        r.events
            .iter()
            .filter_map(|e| {
                let s = std::str::from_utf8(e).unwrap();
                s.lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .and_then(|d| serde_json::from_str(d).ok())
            })
            .collect()
    }

    fn call_reply(truncated: bool) -> Reply {
        Reply {
            text: Some("Let me look.".into()),
            tool_calls: vec![ReplyCall {
                name: "get_weather".into(),
                arguments: Some(json!({"city": "Paris"})),
                ..Default::default()
            }],
            truncated,
            ..Default::default()
        }
    }

    #[test]
    fn api_of_path() {
        assert_eq!(
            ApiShape::of_path("/v1/chat/completions"),
            Some(ApiShape::Chat)
        );
        assert_eq!(ApiShape::of_path("/v1/messages"), Some(ApiShape::Messages));
        assert_eq!(
            ApiShape::of_path("/v1/responses"),
            Some(ApiShape::Responses)
        );
        assert_eq!(ApiShape::of_path("/v1/messages/count_tokens"), None);
    }

    #[test]
    fn chat_stream_concatenates_to_the_arguments() {
        let req = json!({"model": "m", "stream": true, "stream_options": {"include_usage": true}});
        let r = render(&call_reply(false), ApiShape::Chat, &req, 1);
        let chunks = data(&r);
        let args: String = chunks
            .iter()
            .filter_map(|c| c.at("/choices/0/delta/tool_calls/0/function/arguments"))
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(args, r#"{"city":"Paris"}"#);
        assert_eq!(
            chunks[0].at("/choices/0/delta/role"),
            Some(&json!("assistant"))
        );
        assert!(chunks
            .iter()
            .any(|c| c.at("/choices/0/finish_reason") == Some(&json!("tool_calls"))));
        assert!(chunks.last().unwrap().get("usage").unwrap().is_object());
        assert_eq!(
            r.events.last().map(|b| b.as_ref()),
            Some(&b"data: [DONE]\n\n"[..])
        );
    }

    #[test]
    fn truncated_replies_report_the_token_limit_and_cut_the_call() {
        let req = json!({"model": "m"});
        let chat = render(&call_reply(true), ApiShape::Chat, &req, 1);
        let body: Value = serde_json::from_slice(&chat.events[0]).unwrap();
        assert_eq!(body.at("/choices/0/finish_reason"), Some(&json!("length")));
        assert_eq!(
            body.at("/choices/0/message/tool_calls/0/function/arguments"),
            Some(&json!(r#"{"city":"#))
        );
        let stream = json!({"model": "m", "stream": true});
        let msgs = data(&render(&call_reply(true), ApiShape::Messages, &stream, 1));
        let stop = msgs.iter().find(|e| e["type"] == "message_delta").unwrap();
        assert_eq!(stop.at("/delta/stop_reason"), Some(&json!("max_tokens")));
        let stops = msgs
            .iter()
            .filter(|e| e["type"] == "content_block_stop")
            .count();
        assert_eq!(stops, 1, "the text block closes, the cut tool_use does not");
        let resp = data(&render(&call_reply(true), ApiShape::Responses, &stream, 1));
        let last = resp.last().unwrap();
        assert_eq!(last["type"], "response.incomplete");
        assert_eq!(
            last.at("/response/incomplete_details/reason"),
            Some(&json!("max_output_tokens"))
        );
    }

    #[test]
    fn responses_stream_numbers_events_and_items() {
        let mut reply = call_reply(false);
        reply.tool_calls.push(ReplyCall {
            name: "exec".into(),
            input: Some("ls -la".into()),
            namespace: Some("functions".into()),
            ..Default::default()
        });
        let events = data(&render(
            &reply,
            ApiShape::Responses,
            &json!({"model": "m", "stream": true}),
            7,
        ));
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e["sequence_number"], json!(i));
        }
        let done = events
            .iter()
            .find(|e| e["type"] == "response.custom_tool_call_input.done")
            .unwrap();
        assert_eq!(done["input"], "ls -la");
        assert_eq!(done["output_index"], 2);
        let completed = events.last().unwrap();
        assert_eq!(completed["type"], "response.completed");
        let output = completed.at("/response/output").unwrap();
        assert_eq!(output[2]["type"], "custom_tool_call");
        assert_eq!(output[2]["namespace"], "functions");
        assert_eq!(output[1]["arguments"], r#"{"city":"Paris"}"#);
    }

    #[test]
    fn anthropic_json_keeps_reasoning_first() {
        let mut reply = call_reply(false);
        reply.reasoning = Some("think".into());
        let r = render(&reply, ApiShape::Messages, &json!({"model": "m"}), 1);
        let body: Value = serde_json::from_slice(&r.events[0]).unwrap();
        assert_eq!(body.at("/content/0/type"), Some(&json!("thinking")));
        assert_eq!(body.at("/content/2/input/city"), Some(&json!("Paris")));
        assert_eq!(body["stop_reason"], "tool_use");
    }
}
