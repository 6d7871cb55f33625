//! Anthropic Messages (`POST /v1/messages`): requests, JSON responses and the SSE stream, into
//! and out of the neutral model. Wire facts are from `shared/reference/wire-formats.md` §3.
//!
//! Stream rule: events before the first client `tool_use` block pass through as received.
//! From that block on, every indexed event is held (the SDK indexes content by `index`, so
//! blocks must stay in order) until `message_delta` gives the `stop_reason`; then the calls
//! are admitted and the held events are released, or re-indexed without the withheld blocks
//! plus a host-authored text block. `ping` and unchanged events keep their exact bytes
//! (including the padding spaces newer captures carry).

use std::collections::BTreeMap;

use bytes::Bytes;
use serde_json::{json, Value};

use crate::model::{
    Api, ChoiceEmissions, ChoiceVerdict, Completion, CompletionState, DeclaredTool, RepairItem,
    ToolCall, ToolResultSeen, Turn,
};
use crate::sse::{self, SseBlock};

/// Reads a Messages request body.
///
/// Errors: a human-readable reason naming the offending field.
pub fn parse_request(body: &Value) -> Result<Turn, String> {
    let obj = body.as_object().ok_or("the body must be a JSON object")?;
    let messages = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("`messages` must be an array")?;
    let mut tools = Vec::new();
    let mut provider_output_seen = false;
    if let Some(list) = obj.get("tools") {
        let list = list.as_array().ok_or("`tools` must be an array")?;
        for (i, t) in list.iter().enumerate() {
            // Client tools have no `type` (or `custom`), and Anthropic-defined tools the client
            // runs (`bash_*`, `text_editor_*`, `computer_*`, `memory_*`) are client tools too;
            // other typed ones are server tools the provider runs.
            match t.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(ty)
                    if ["bash_", "text_editor_", "computer_", "memory_"]
                        .iter()
                        .any(|p| ty.starts_with(p)) => {}
                Some(ty) => {
                    // A server tool the provider runs in this very turn: the model may read
                    // its output before it calls a tool, so the turn is untrusted (§C, §F).
                    provider_output_seen |= ["web_search", "web_fetch", "code_execution"]
                        .iter()
                        .any(|p| ty.starts_with(p));
                    continue;
                }
            }
            let name = t
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("`tools[{i}].name` must be a string"))?;
            tools.push(DeclaredTool {
                name: name.to_owned(),
                schema: t.get("input_schema").cloned(),
            });
        }
    }
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    let mut prior_calls = Vec::new();
    let mut tool_results = Vec::new();
    let mut round_index = 0u32;
    for (i, m) in messages.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("`messages[{i}].role` must be a string"))?;
        let blocks = m.get("content").and_then(Value::as_array);
        if role == "assistant" {
            round_index = round_index.saturating_add(1);
        }
        for b in blocks.into_iter().flatten() {
            match b.get("type").and_then(Value::as_str) {
                Some("tool_use") if role == "assistant" => {
                    if let (Some(id), Some(name)) = (
                        b.get("id").and_then(Value::as_str),
                        b.get("name").and_then(Value::as_str),
                    ) {
                        names.insert(id.to_owned(), name.to_owned());
                    }
                    if let Some(name) = b.get("name").and_then(Value::as_str) {
                        prior_calls.push(name.to_owned());
                    }
                }
                Some("tool_result") => {
                    let id = b
                        .get("tool_use_id")
                        .and_then(Value::as_str)
                        .ok_or_else(|| {
                            format!(
                                "`messages[{i}]` has a tool_result without a string `tool_use_id`"
                            )
                        })?;
                    tool_results.push(ToolResultSeen {
                        tool_call_id: id.to_owned(),
                        tool_name: names.get(id).cloned(),
                        content: b.get("content").cloned().unwrap_or(Value::Null).to_string(),
                        is_error: b.get("is_error").and_then(Value::as_bool) == Some(true),
                    });
                }
                // Provider-executed tool output (`web_search_tool_result`, `web_fetch_tool_result`,
                // `code_execution_tool_result` …): always untrusted (tool-turn contract §F).
                Some(t) if t.ends_with("_tool_result") => provider_output_seen = true,
                _ => {}
            }
        }
    }
    Ok(Turn {
        api: Api::AnthropicMessages,
        model: obj.get("model").and_then(Value::as_str).map(str::to_owned),
        stream: obj.get("stream").and_then(Value::as_bool) == Some(true),
        tools,
        tool_results,
        max_output_tokens: obj.get("max_tokens").and_then(Value::as_u64),
        include_usage: true,
        round_index,
        prior_calls,
        provider_output_seen,
        previous_response_id: None,
        // §F: MCP servers the provider would call itself (`mcp_servers`).
        provider_delegations: obj
            .get("mcp_servers")
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
            .map(|_| vec!["`mcp_servers`".to_owned()])
            .unwrap_or_default(),
    })
}

/// Classifies how the message ended. `used` is the final `usage.output_tokens`.
pub fn classify(stop_reason: Option<&str>, used: Option<u64>, max: Option<u64>) -> Completion {
    let completion = Completion::new;
    match stop_reason {
        None => completion(CompletionState::Truncated, "missing_stop_reason"),
        Some("refusal") => completion(CompletionState::Refused, "refusal"),
        Some(r @ ("max_tokens" | "model_context_window_exceeded")) => {
            completion(CompletionState::Truncated, r)
        }
        Some(r) => match (used, max) {
            (Some(u), Some(m)) if u >= m => {
                completion(CompletionState::Truncated, "max_tokens_reached")
            }
            _ => completion(CompletionState::Clean, r),
        },
    }
}

/// Reads the emissions of a non-stream response (one choice, index 0).
pub fn parse_response(body: &Value, turn: &Turn) -> Vec<ChoiceEmissions> {
    let calls = body
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
        .map(|b| ToolCall {
            id: b
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            name: b
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            arguments: b.get("input").map(Value::to_string).unwrap_or_default(),
        })
        .collect();
    let texts: Vec<&str> = body
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .collect();
    let text = (!texts.is_empty()).then(|| texts.concat());
    let provider_output = body
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|b| b.get("type").and_then(Value::as_str))
        .any(is_provider_block);
    vec![ChoiceEmissions {
        choice: 0,
        text,
        provider_output,
        completion: classify(
            body.get("stop_reason").and_then(Value::as_str),
            body.pointer("/usage/output_tokens").and_then(Value::as_u64),
            turn.max_output_tokens,
        ),
        calls,
    }]
}

/// Applies verdicts to a non-stream response: withheld `tool_use` blocks are removed; an
/// ended turn also gains a host-authored text block and stops with `end_turn`. Returns
/// whether the body changed.
pub fn rewrite_response(body: &mut Value, verdicts: &[ChoiceVerdict]) -> bool {
    let Some(verdict) = verdicts
        .first()
        .filter(|v| v.any_withheld() || v.any_replaced())
    else {
        return false;
    };
    if let Some(content) = body.get_mut("content").and_then(Value::as_array_mut) {
        for (call, b) in content
            .iter_mut()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
            .enumerate()
        {
            if let Some(input) = verdict
                .release_args(call)
                .and_then(|a| serde_json::from_str::<Value>(a).ok())
            {
                b["input"] = input;
            }
        }
        let mut call = 0;
        content.retain(|b| {
            if b.get("type").and_then(Value::as_str) != Some("tool_use") {
                return true;
            }
            call += 1;
            verdict.released(call - 1)
        });
        if let Some(text) = verdict.end_turn() {
            content.push(json!({ "type": "text", "text": text }));
        }
    }
    if verdict.end_turn().is_some() {
        body["stop_reason"] = json!("end_turn");
    }
    true
}

/// Appends the repair turn: an assistant message with the withheld `tool_use` blocks
/// (input that is not a JSON object becomes `{}`), then a user message with one
/// `tool_result` per call (`is_error` as decided) carrying the host text.
pub fn append_repair(body: &mut Value, choice: &ChoiceEmissions, items: &[RepairItem]) {
    let uses: Vec<Value> = items
        .iter()
        .filter_map(|it| choice.calls.get(it.call))
        .map(|c| {
            let input = serde_json::from_str::<Value>(&c.arguments)
                .ok()
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({}));
            json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input})
        })
        .collect();
    let results: Vec<Value> = items
        .iter()
        .filter_map(|it| {
            choice.calls.get(it.call).map(|c| {
                json!({"type": "tool_result", "tool_use_id": c.id, "content": it.text, "is_error": it.is_error})
            })
        })
        .collect();
    let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) else {
        return;
    };
    messages.push(json!({"role": "assistant", "content": uses}));
    messages.push(json!({"role": "user", "content": results}));
}

/// A content block the provider's own tools produced (`server_tool_use`,
/// `web_search_tool_result`, `web_fetch_tool_result`, `code_execution_tool_result` …).
fn is_provider_block(ty: &str) -> bool {
    ty == "server_tool_use" || (ty.ends_with("_tool_result") && ty != "tool_result")
}

#[derive(Debug)]
struct Block {
    /// A client `tool_use` block (server tools are the provider's and are not admitted here).
    call: Option<ToolCall>,
}

#[derive(Debug)]
struct Held {
    raw: Bytes,
    name: Option<String>,
    json: Option<Value>,
    index: Option<u64>,
}

/// The Messages stream state machine (see the module docs).
#[derive(Debug)]
pub struct MessagesStream {
    max_output_tokens: Option<u64>,
    blocks: BTreeMap<u64, Block>,
    /// Index of the first held block; blocks before it were forwarded.
    first_held: Option<u64>,
    held: Vec<Held>,
    stop_reason: Option<String>,
    output_tokens: Option<u64>,
    delta_seen: bool,
    stop_seen: bool,
    decided: bool,
    failed: bool,
    /// A provider-executed block was seen in this message.
    provider_output: bool,
}

impl MessagesStream {
    /// State for one response to `turn`.
    pub fn new(turn: &Turn) -> Self {
        Self {
            max_output_tokens: turn.max_output_tokens,
            blocks: BTreeMap::new(),
            first_held: None,
            held: Vec::new(),
            stop_reason: None,
            output_tokens: None,
            delta_seen: false,
            stop_seen: false,
            decided: false,
            failed: false,
            provider_output: false,
        }
    }

    fn holding(&self) -> bool {
        self.first_held.is_some() && !self.decided
    }

    /// Calls are held and not yet decided.
    pub fn pending(&self) -> bool {
        self.holding()
    }

    /// Takes one SSE block; bytes to forward now are appended to `out`.
    pub fn push(&mut self, block: SseBlock, out: &mut Vec<Bytes>) {
        let parsed = block
            .data
            .as_deref()
            .and_then(|d| serde_json::from_str::<Value>(d).ok());
        let kind = parsed
            .as_ref()
            .and_then(|v| v.get("type"))
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| block.event.clone());
        let index = parsed
            .as_ref()
            .and_then(|v| v.get("index"))
            .and_then(Value::as_u64);
        match kind.as_deref() {
            Some("ping") | None => {
                out.push(block.raw);
                return;
            }
            Some("error") => {
                self.failed = true;
                self.held.clear();
                self.decided = true;
                out.push(block.raw);
                return;
            }
            Some("content_block_start") => {
                let cb = parsed.as_ref().and_then(|v| v.get("content_block"));
                let is_call =
                    cb.and_then(|b| b.get("type")).and_then(Value::as_str) == Some("tool_use");
                if let Some(ix) = index {
                    let call = is_call.then(|| ToolCall {
                        id: cb
                            .and_then(|b| b.get("id"))
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_owned(),
                        name: cb
                            .and_then(|b| b.get("name"))
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_owned(),
                        arguments: String::new(),
                    });
                    self.blocks.insert(ix, Block { call });
                    if is_call && self.decided {
                        // Fail closed: a call after the decision point is dropped, not released.
                        return;
                    }
                    if is_call && self.first_held.is_none() {
                        self.first_held = Some(ix);
                    }
                }
            }
            Some("content_block_delta") => {
                if let (Some(ix), Some(p)) = (
                    index,
                    parsed
                        .as_ref()
                        .and_then(|v| v.pointer("/delta/partial_json"))
                        .and_then(Value::as_str),
                ) {
                    if let Some(Block { call: Some(call) }) = self.blocks.get_mut(&ix) {
                        if self.decided {
                            return;
                        }
                        call.arguments.push_str(p);
                    }
                }
            }
            Some("message_delta") => {
                self.delta_seen = true;
                if let Some(r) = parsed
                    .as_ref()
                    .and_then(|v| v.pointer("/delta/stop_reason"))
                    .and_then(Value::as_str)
                {
                    self.stop_reason = Some(r.to_owned());
                }
                if let Some(t) = parsed
                    .as_ref()
                    .and_then(|v| v.pointer("/usage/output_tokens"))
                    .and_then(Value::as_u64)
                {
                    self.output_tokens = Some(t);
                }
            }
            Some("message_stop") => self.stop_seen = true,
            Some(_) => {}
        }
        if self.decided
            && index.is_some_and(|ix| matches!(self.blocks.get(&ix), Some(Block { call: Some(_) })))
        {
            return; // events of a call that arrived after the decision point
        }
        if self.holding() {
            self.held.push(Held {
                raw: block.raw,
                name: block.event,
                json: parsed,
                index,
            });
        } else {
            out.push(block.raw);
        }
    }

    /// The stop reason is known (or the message ended) while calls are held.
    pub fn ready(&self) -> bool {
        self.holding() && !self.failed && (self.delta_seen || self.stop_seen)
    }

    /// `message_stop` was seen: a stream that ends now is complete.
    pub fn finished(&self) -> bool {
        self.stop_seen || self.failed
    }

    /// The provider reported an error in the stream.
    pub fn failed(&self) -> bool {
        self.failed
    }

    fn completion(&self) -> Completion {
        classify(
            self.stop_reason.as_deref(),
            self.output_tokens,
            self.max_output_tokens,
        )
    }

    /// The emissions to admit (one choice, index 0).
    pub fn round(&self) -> Vec<ChoiceEmissions> {
        let calls: Vec<ToolCall> = self
            .blocks
            .values()
            .filter_map(|b| b.call.clone())
            .collect();
        if calls.is_empty() {
            return Vec::new();
        }
        vec![ChoiceEmissions {
            choice: 0,
            text: None,
            provider_output: self.provider_output,
            completion: self.completion(),
            calls,
        }]
    }

    /// Completion of the message, for the journal.
    pub fn completions(&self) -> Vec<Completion> {
        if self.delta_seen || self.stop_seen {
            vec![self.completion()]
        } else {
            Vec::new()
        }
    }

    /// Emits the held events with the verdicts applied; later events flow through.
    pub fn release(&mut self, verdicts: &[ChoiceVerdict], out: &mut Vec<Bytes>) {
        self.decided = true;
        let held = std::mem::take(&mut self.held);
        let Some(verdict) = verdicts
            .first()
            .filter(|v| v.any_withheld() || v.any_replaced())
        else {
            out.extend(held.into_iter().map(|h| h.raw));
            return;
        };
        let text = verdict.end_turn();
        // Released flag per block, in call order; new indices stay contiguous.
        let mut call_no = 0usize;
        let mut renumber: BTreeMap<u64, Option<u64>> = BTreeMap::new();
        // Blocks whose input is replaced: their deltas go, one delta with the new input is sent
        // before the block's stop.
        let mut replace: BTreeMap<u64, String> = BTreeMap::new();
        let first = self.first_held.unwrap_or(0);
        let mut next = first;
        for (&ix, b) in self.blocks.range(first..) {
            let keep = match &b.call {
                Some(_) => {
                    let k = verdict.released(call_no);
                    if let Some(args) = verdict.release_args(call_no) {
                        replace.insert(ix, args.to_owned());
                    }
                    call_no += 1;
                    k
                }
                None => true,
            };
            if keep {
                renumber.insert(ix, Some(next));
                next += 1;
            } else {
                renumber.insert(ix, None);
            }
        }
        let text_index = next;
        let mut text_sent = false;
        for mut h in held {
            if let Some(ix) = h.index {
                if let Some(args) = replace.get(&ix) {
                    let kind = h
                        .json
                        .as_ref()
                        .and_then(|v| v.get("type"))
                        .and_then(Value::as_str);
                    match kind {
                        Some("content_block_delta") => continue,
                        Some("content_block_stop") => {
                            let new_ix = renumber.get(&ix).copied().flatten().unwrap_or(ix);
                            let delta = json!({"type": "content_block_delta", "index": new_ix,
                                "delta": {"type": "input_json_delta", "partial_json": args}});
                            out.push(sse::encode(Some("content_block_delta"), &delta.to_string()));
                        }
                        _ => {}
                    }
                }
                match renumber.get(&ix) {
                    Some(None) => continue,
                    Some(Some(new)) if *new != ix => {
                        if let Some(v) = h.json.as_mut() {
                            v["index"] = json!(new);
                            out.push(sse::encode(h.name.as_deref(), &v.to_string()));
                            continue;
                        }
                    }
                    _ => {}
                }
                out.push(h.raw);
                continue;
            }
            let kind = h
                .json
                .as_ref()
                .and_then(|v| v.get("type"))
                .and_then(Value::as_str);
            if let Some(text) = text {
                if !text_sent && matches!(kind, Some("message_delta" | "message_stop")) {
                    out.extend(text_block(text_index, text));
                    text_sent = true;
                }
                if kind == Some("message_delta") {
                    if let Some(v) = h.json.as_mut() {
                        v["delta"]["stop_reason"] = json!("end_turn");
                        out.push(sse::encode(
                            h.name.as_deref().or(Some("message_delta")),
                            &v.to_string(),
                        ));
                        continue;
                    }
                }
            }
            out.push(h.raw);
        }
    }

    /// The upstream stream was cut: drop what is held and end the agent's stream with an
    /// Anthropic `error` event (the SDK raises on it).
    pub fn cut(&mut self, reason: &str, out: &mut Vec<Bytes>) {
        self.fail(
            "api_error",
            &format!("turnguard: the upstream stream ended early ({reason}); withheld tool calls were not released"),
            out,
        );
    }

    /// Drops what is held and ends the agent's stream with an `error` event of `kind`.
    pub fn fail(&mut self, kind: &str, message: &str, out: &mut Vec<Bytes>) {
        self.held.clear();
        self.decided = true;
        let body = json!({ "type": "error", "error": { "type": kind, "message": message } });
        out.push(sse::encode(Some("error"), &body.to_string()));
    }

    /// Drops what is held (the round is being repaired). Returns how many content blocks the
    /// agent has already received: the next round's blocks are numbered after them.
    pub fn abandon(&mut self) -> u64 {
        self.held.clear();
        self.decided = true;
        self.first_held
            .unwrap_or_else(|| self.blocks.keys().next_back().map_or(0, |k| k + 1))
    }
}

fn text_block(index: u64, text: &str) -> [Bytes; 3] {
    [
        sse::encode(
            Some("content_block_start"),
            &json!({"type":"content_block_start","index":index,"content_block":{"type":"text","text":""}}).to_string(),
        ),
        sse::encode(
            Some("content_block_delta"),
            &json!({"type":"content_block_delta","index":index,"delta":{"type":"text_delta","text":text}}).to_string(),
        ),
        sse::encode(
            Some("content_block_stop"),
            &json!({"type":"content_block_stop","index":index}).to_string(),
        ),
    ]
}
