//! Anthropic Messages (`POST /v1/messages`): requests, JSON responses and the SSE stream, into
//! and out of the neutral model. Wire facts are from `shared/reference/wire-formats.md` §3.
//!
//! Stream rule: events before the first client `tool_use` block pass through as received.
//! From that block on, every indexed event is held (the SDK indexes content by `index`, so
//! blocks must stay in order) until `message_delta` gives the `stop_reason`; then the calls
//! are admitted and the held events are released, or re-indexed without the withheld blocks
//! plus a host-authored text block. `ping` and unchanged events keep their exact bytes
//! (including the padding spaces newer captures carry).

use crate::strict_json::Lookup as _;
use crate::strict_json::{RequestBody, ToolsMember};
use std::collections::BTreeMap;

use bytes::Bytes;
use serde_json::{json, Map, Value};

use super::{CallNames, Provider, ProviderStream, Splice, SpliceState};
use crate::model::{
    AnswerContext, Api, ChoiceEmissions, ChoiceVerdict, Completion, CompletionState,
    DeclaredSchemas, DeclaredTool, RepairItem, ResponseLink, ToolCall, ToolResultSeen, Turn,
    UntrustedKind,
};
use crate::sse::{self, Event, Payload};

/// The Messages adapter ([`crate::provider::adapter`] of [`Api::AnthropicMessages`]).
#[derive(Debug, Clone, Copy)]
pub struct AnthropicMessages;

impl Provider for AnthropicMessages {
    fn parse_request_with(
        &self,
        body: &RequestBody,
        schemas: &dyn DeclaredSchemas,
    ) -> Result<Turn, String> {
        parse_request(body.tree(), body.tools(), schemas)
    }

    fn parse_response(
        &self,
        body: &Value,
        ctx: &AnswerContext,
    ) -> Result<Vec<ChoiceEmissions>, String> {
        parse_response(body, ctx)
    }

    /// One: Messages has no choices.
    fn choices_requested(&self, _body: &Value) -> u64 {
        1
    }

    /// Nothing to prepare: the stream always carries `message_delta.usage`.
    fn prepare_upstream(&self, _body: &mut RequestBody, _turn: &mut Turn) -> bool {
        false
    }

    /// Messages stores no responses.
    fn response_link(&self, _body: &Value, _ctx: &AnswerContext) -> Option<ResponseLink> {
        None
    }

    fn rewrite_response(&self, body: &mut Value, verdicts: &[ChoiceVerdict]) -> bool {
        rewrite_response(body, verdicts)
    }

    fn append_repair(&self, body: &mut Value, choice: &ChoiceEmissions, items: &[RepairItem]) {
        append_repair(body, choice, items);
    }

    /// See [`structured_schema`].
    fn structured_schema(&self, body: &Value) -> Option<(String, Value)> {
        structured_schema(body)
    }

    /// Two `messages`: the assistant's `answer`, then the user's `feedback` (nothing when
    /// `messages` is not an array; [`parse_request`] refused such a request).
    fn append_text_repair(&self, body: &mut Value, answer: &str, feedback: &str) {
        if let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) {
            messages.push(json!({"role": "assistant", "content": answer}));
            messages.push(json!({"role": "user", "content": feedback}));
        }
    }

    /// A [`MessagesStream`], numbering its blocks after a [`MessagesSplice`]'s offset; the
    /// splice itself is applied before it, by the relay.
    fn stream(&self, turn: &Turn, splice: Option<&Splice>) -> Box<dyn ProviderStream> {
        Box::new(match splice.and_then(Splice::state::<MessagesSplice>) {
            Some(s) => MessagesStream::continuing(turn, s.offset),
            None => MessagesStream::new(turn),
        })
    }
}

/// How a Messages repair round continues the agent's stream: no second `message_start`;
/// content block indices continue after `offset` (the blocks the agent already has).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessagesSplice {
    offset: u64,
}

impl SpliceState for MessagesSplice {
    /// Drops `message_start`; adds the offset to an event's `index`. An event without JSON, or
    /// that changes nothing, passes byte for byte.
    fn apply(&mut self, event: Event) -> Option<Event> {
        let Some(v) = event.json() else {
            return Some(event);
        };
        if event.kind() == Some("message_start") {
            return None;
        }
        match v.get("index").and_then(Value::as_u64) {
            Some(ix) if self.offset > 0 => {
                let mut v = v.clone();
                if let Some(obj) = v.as_object_mut() {
                    obj.insert("index".into(), Value::from(ix.saturating_add(self.offset)));
                }
                Some(event.with_json(v))
            }
            _ => Some(event),
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Anthropic-defined tools the client runs (`bash_*`, `text_editor_*`, `computer_*`,
/// `memory_*`): client tools like untyped ones.
const CLIENT_TOOL_PREFIXES: [&str; 4] = ["bash_", "text_editor_", "computer_", "memory_"];

/// Reads a Messages request body: `body`'s tree and its top-level `tools` member, which
/// `tools` gives ([`RequestBody::tools`]: the tree lacks it while the body shares its tools).
///
/// Errors: a human-readable reason naming the offending field.
fn parse_request(
    body: &Value,
    tools: Option<ToolsMember<'_>>,
    schemas: &dyn DeclaredSchemas,
) -> Result<Turn, String> {
    let obj = body.as_object().ok_or("the body must be a JSON object")?;
    let messages = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("`messages` must be an array")?;
    let mut turn = Turn {
        item_references: Vec::new(),
        api: Api::AnthropicMessages,
        model: obj.get("model").and_then(Value::as_str).map(str::to_owned),
        stream: obj.get("stream").and_then(Value::as_bool) == Some(true),
        tools: Vec::new(),
        tool_results: Vec::new(),
        max_output_tokens: obj.get("max_tokens").and_then(Value::as_u64),
        include_usage: true,
        round_index: 0,
        prior_calls: Vec::new(),
        untrusted_inputs: Vec::new(),
        usage_for_turnguard: false,
        previous_response_id: None,
        arguments_fixed: false,
        provider_delegations: Vec::new(),
    };
    if let Some(member) = tools {
        let list = member.into_array().ok_or("`tools` must be an array")?;
        for (i, t) in list.into_iter().enumerate() {
            // Client tools have no `type` (or `custom`); Anthropic-defined tools the client
            // runs are client tools too; every other typed tool is a server tool the provider
            // runs in this very turn: the model may read its output before it calls a tool,
            // so the turn is untrusted (§C, §F).
            match t.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(ty) if CLIENT_TOOL_PREFIXES.iter().any(|p| ty.starts_with(p)) => {}
                Some(_) => {
                    turn.untrusted(UntrustedKind::ProviderOutput, format!("tools[{i}]"));
                    continue;
                }
            }
            let name = t
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("`tools[{i}].name` must be a string"))?;
            turn.tools
                .push(DeclaredTool::declared(name, t.get("input_schema"), schemas));
        }
    }
    // §F: MCP servers the provider calls itself, in this very turn: their output is untrusted
    // input, and inside a run the request is refused (`provider_delegations`).
    // Anything but an empty list (or none) counts: an `mcp_servers` turnguard cannot read as
    // a list may still be servers to the provider.
    let no_servers = match obj.get("mcp_servers") {
        None | Some(Value::Null) => true,
        Some(Value::Array(a)) => a.is_empty(),
        Some(_) => false,
    };
    if !no_servers {
        turn.provider_delegations.push("`mcp_servers`".to_owned());
        turn.untrusted(UntrustedKind::ProviderOutput, "mcp_servers");
    }
    match obj.get("system") {
        None | Some(Value::Null | Value::String(_)) => {}
        Some(Value::Array(system)) => judge_blocks(
            &mut turn,
            system,
            "system",
            &mut CallNames::default(),
            Within::Message,
        )?,
        Some(_) => turn.untrusted(UntrustedKind::Unrecognised, "system"),
    }
    let mut calls = CallNames::default();
    for (i, m) in messages.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("`messages[{i}].role` must be a string"))?;
        let assistant = match role {
            "assistant" => true,
            // A mid-conversation system turn (Claude Code sends them: "system-controlled,
            // unlike function results") is the host's own, like the top-level `system`.
            "user" | "system" => false,
            other => {
                // A role turnguard does not know is untrusted, never skipped (DESIGN.md §9).
                turn.untrusted(
                    UntrustedKind::Unrecognised,
                    format!(
                        "messages[{i}].role `{}`",
                        crate::admission::sanitize_label(other)
                    ),
                );
                false
            }
        };
        if assistant {
            turn.round_index = turn.round_index.saturating_add(1);
        }
        match m.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(blocks)) => {
                let at = format!("messages[{i}].content");
                let within = match role {
                    "assistant" => Within::Assistant,
                    "user" => Within::User,
                    _ => Within::Message,
                };
                judge_blocks(&mut turn, blocks, &at, &mut calls, within)?;
            }
            Some(_) => turn.untrusted(
                UntrustedKind::Unrecognised,
                format!("messages[{i}].content"),
            ),
        }
    }
    Ok(turn)
}

/// Reads content blocks: calls (`tool_use` in an assistant turn; every `*_tool_use` id is a
/// call id, unique per transcript), tool results, and the trust of each block. Provider tool
/// output (`*_tool_result`, `server_tool_use`, `mcp_tool_use`) is
/// [`UntrustedKind::ProviderOutput`]; an image or document the provider fetches (`url`
/// source) or holds (`file` source, `container_upload`) is [`UntrustedKind::ProviderFetched`],
/// inside a tool result too; a block type turnguard does not know is
/// [`UntrustedKind::Unrecognised`].
///
/// A `tool_reference` block (the name of a tool a tool search loaded, Anthropic's tool search)
/// is known only inside a `tool_result`: it names a tool the agent declares, it carries no
/// content, and the result's trust is its tool's. A `tool_result` is a tool result only among
/// a user message's blocks; anywhere else it is [`UntrustedKind::Unrecognised`] and not read
/// as a result (so not journaled: tool content cannot forge another call's record).
///
/// Errors: a `tool_result` in a user message without a string `tool_use_id` (the request is
/// malformed).
fn judge_blocks(
    turn: &mut Turn,
    blocks: &[Value],
    at: &str,
    calls: &mut CallNames,
    within: Within,
) -> Result<(), String> {
    let assistant = within == Within::Assistant;
    for (k, b) in blocks.iter().enumerate() {
        let at = format!("{at}[{k}]");
        let ty = b.get("type").and_then(Value::as_str).unwrap_or_default();
        match ty {
            "text" | "thinking" | "redacted_thinking" | "search_result" => {}
            "tool_reference" if within == Within::ToolResult => {}
            "image" | "document" => judge_source(turn, b, &at),
            "tool_use" if assistant => {
                let name = b.get("name").and_then(Value::as_str);
                if let Some(name) = name {
                    turn.prior_calls.push(name.to_owned());
                }
                if let Some(id) = b.get("id").and_then(Value::as_str) {
                    calls.add(turn, id, name, || format!("{at}.id"));
                }
            }
            // A tool result is one only where the API reads one: a user message's own
            // blocks. Anywhere else (inside another result's content, in a system or
            // assistant turn, in a document) it is text that looks like one — possibly a
            // tool's output forging another call's result — so it is not recorded, and it
            // makes the turn untrusted (the `_` arm below).
            "tool_result" if within == Within::User => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        format!("`{at}` is a tool_result without a string `tool_use_id`")
                    })?;
                turn.tool_results.push(ToolResultSeen {
                    tool_call_id: id.to_owned(),
                    tool_name: calls.name_of(id),
                    content: b.get("content").cloned().unwrap_or(Value::Null),
                    is_error: b.get("is_error").and_then(Value::as_bool) == Some(true),
                });
                if let Some(Value::Array(inner)) = b.get("content") {
                    let at = format!("{at}.content");
                    judge_blocks(turn, inner, &at, calls, Within::ToolResult)?;
                }
            }
            t if is_provider_block(t) => {
                if let Some(id) = b.get("id").and_then(Value::as_str) {
                    calls.add(turn, id, None, || format!("{at}.id"));
                }
                turn.untrusted(UntrustedKind::ProviderOutput, at);
            }
            "container_upload" => turn.untrusted(UntrustedKind::ProviderFetched, at),
            _ => turn.untrusted(UntrustedKind::Unrecognised, at),
        }
    }
    Ok(())
}

/// Where a list of content blocks is (which block types it may hold).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Within {
    /// An assistant message: the model's own blocks, calls among them.
    Assistant,
    /// A user message: the agent's blocks, tool results among them.
    User,
    /// A system message, the top-level `system`, or inline document content.
    Message,
    /// The `content` of a `tool_result`.
    ToolResult,
}

/// An `image` / `document` block: inline sources (`base64`, `text`, `content`) are the
/// message's own; a `url` or `file` source is fetched or held by the provider.
fn judge_source(turn: &mut Turn, block: &Value, at: &str) {
    match block.at("/source/type").and_then(Value::as_str) {
        Some("base64" | "text") => {}
        Some("content") => {
            if let Some(Value::Array(inner)) = block.at("/source/content") {
                let at = format!("{at}.source.content");
                // Inline content carries no tool results; one that does is not recognised.
                let mut none = CallNames::default();
                if judge_blocks(turn, inner, &at, &mut none, Within::Message).is_err() {
                    turn.untrusted(UntrustedKind::Unrecognised, at);
                }
            }
        }
        Some("url" | "file") => turn.untrusted(UntrustedKind::ProviderFetched, at.to_owned()),
        _ => turn.untrusted(UntrustedKind::Unrecognised, at.to_owned()),
    }
}

/// Classifies how the message ended (tool-turn contract §B stage 1). `used` is the final
/// `usage.output_tokens` (the `message_delta` values are final, wire-formats.md §21).
///
/// `end_turn`, `tool_use` and `stop_sequence` end normally (unless the usage reached the
/// limit); `refusal` is refused; `max_tokens` is truncated and
/// `model_context_window_exceeded` is [`CompletionState::ContextExhausted`]; `pause_turn`
/// (a server-tool turn the client must continue) and any value turnguard does not know are
/// not known to be complete: truncated.
pub fn classify(stop_reason: Option<&str>, used: Option<u64>, max: Option<u64>) -> Completion {
    let completion = Completion::new;
    match stop_reason {
        None => completion(CompletionState::Truncated, "missing_stop_reason"),
        Some("refusal") => completion(CompletionState::Refused, "refusal"),
        Some(r @ "model_context_window_exceeded") => {
            completion(CompletionState::ContextExhausted, r)
        }
        Some(r @ ("end_turn" | "tool_use" | "stop_sequence")) => match (used, max) {
            (Some(u), Some(m)) if u >= m => {
                completion(CompletionState::Truncated, "max_tokens_reached")
            }
            _ => completion(CompletionState::Clean, r),
        },
        Some(r) => completion(CompletionState::Truncated, r),
    }
}

/// Reads the emissions of a non-stream response (one choice, index 0).
///
/// Errors: two `tool_use` blocks share an id.
pub fn parse_response(body: &Value, ctx: &AnswerContext) -> Result<Vec<ChoiceEmissions>, String> {
    let calls = body
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
        .map(|b| ToolCall {
            input: crate::model::CallInput::Json,
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
    let out = vec![ChoiceEmissions {
        output: body
            .get("content")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default(),
        choice: 0,
        text,
        provider_output,
        completion: classify(
            body.get("stop_reason").and_then(Value::as_str),
            body.at("/usage/output_tokens").and_then(Value::as_u64),
            ctx.max_output_tokens,
        ),
        calls,
    }];
    crate::model::check_identities(&out)?;
    Ok(out)
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
                set(b, "input", input);
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
        set(body, "stop_reason", json!("end_turn"));
    }
    true
}

/// Sets `key` of `v` when `v` is an object (indexing a `Value` that is not one panics).
fn set(v: &mut Value, key: &str, value: Value) {
    if let Some(obj) = v.as_object_mut() {
        obj.insert(key.to_owned(), value);
    }
}

/// The provider-enforced output schema of a Messages request (`structured` channel,
/// tool-turn contract §A): `output_config.format: {type: "json_schema", schema}` (and the
/// earlier beta's top-level `output_format` of the same shape). The schema has no name on
/// this API: the channel is named after the field.
pub fn structured_schema(body: &Value) -> Option<(String, Value)> {
    let (field, format) = match body.at("/output_config/format") {
        Some(f) if !f.is_null() => ("output_config.format", f),
        _ => ("output_format", body.get("output_format")?),
    };
    if format.get("type").and_then(Value::as_str) != Some("json_schema") {
        return None;
    }
    Some((field.to_owned(), format.get("schema")?.clone()))
}

/// Appends the repair turn: the assistant message the model sent, then a user message with
/// one `tool_result` per repaired call (`is_error` as decided) carrying the host text.
///
/// The assistant message replays the model's content blocks in order ([`ChoiceEmissions::
/// output`]): `thinking` (with its `signature`) and `redacted_thinking` blocks (the API
/// requires them before the `tool_use` blocks when extended thinking is on), text, provider
/// tool blocks, and the `tool_use` blocks of the repaired calls with their input (a cut
/// call's input that is not a JSON object becomes `{}`, as the API itself reports one);
/// `tool_use` blocks of calls not being repaired are left out, since no result answers
/// them. Without recorded blocks, the message is the repaired `tool_use` blocks alone.
pub fn append_repair(body: &mut Value, choice: &ChoiceEmissions, items: &[RepairItem]) {
    let object_input = |arguments: &str| {
        serde_json::from_str::<Value>(arguments)
            .ok()
            .filter(Value::is_object)
            .unwrap_or_else(|| json!({}))
    };
    let repaired: Vec<&ToolCall> = items
        .iter()
        .filter_map(|it| choice.calls.get(it.call))
        .collect();
    let uses: Vec<Value> = if choice.output.is_empty() {
        repaired
            .iter()
            .map(|c| json!({"type": "tool_use", "id": c.id, "name": c.name, "input": object_input(&c.arguments)}))
            .collect()
    } else {
        choice
            .output
            .iter()
            .filter_map(|b| {
                if b.get("type").and_then(Value::as_str) != Some("tool_use") {
                    return Some(b.clone());
                }
                let id = b.get("id").and_then(Value::as_str)?;
                let call = repaired.iter().find(|c| c.id == id)?;
                let mut b = b.clone();
                if !b.get("input").is_some_and(Value::is_object) {
                    set(&mut b, "input", object_input(&call.arguments));
                }
                Some(b)
            })
            .collect()
    };
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

/// A content block the provider's own tools produced (`server_tool_use`, `mcp_tool_use`,
/// `web_search_tool_result`, `web_fetch_tool_result`, `code_execution_tool_result`,
/// `mcp_tool_result` …). The one test for provider output: request, response and stream
/// judge a block by it (tool-turn contract §C, §F).
fn is_provider_block(ty: &str) -> bool {
    ty == "server_tool_use"
        || ty == "mcp_tool_use"
        || (ty.ends_with("_tool_result") && ty != "tool_result")
}

#[derive(Debug)]
struct Block {
    /// A client `tool_use` block (server tools are the provider's and are not admitted here).
    call: Option<ToolCall>,
    /// The block as the message will hold it: its `content_block_start` form with the
    /// deltas applied (text, thinking, signature, citations; a `tool_use`'s input is set from
    /// the call's arguments when the round is read). What a repair turn replays.
    content: Value,
    /// `content_block_stop` was seen.
    stopped: bool,
}

/// Applies a `content_block_delta`'s `delta` to the block it extends: `text_delta` and
/// `thinking_delta` append, `signature_delta` sets the signature, `citations_delta` appends
/// a citation; any other delta leaves the block as it started.
fn apply_delta(block: &mut Value, delta: &Value) {
    let Some(obj) = block.as_object_mut() else {
        return;
    };
    let append = |obj: &mut Map<String, Value>, key: &str, piece: &str| {
        let mut s = obj
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        s.push_str(piece);
        obj.insert(key.to_owned(), Value::String(s));
    };
    let text = |key: &str| delta.get(key).and_then(Value::as_str);
    match delta.get("type").and_then(Value::as_str) {
        Some("text_delta") => append(obj, "text", text("text").unwrap_or_default()),
        Some("thinking_delta") => append(obj, "thinking", text("thinking").unwrap_or_default()),
        Some("signature_delta") => {
            obj.insert(
                "signature".into(),
                json!(text("signature").unwrap_or_default()),
            );
        }
        Some("citations_delta") => {
            if let Some(c) = delta.get("citation") {
                let list = obj.entry("citations").or_insert_with(|| json!([]));
                if let Some(list) = list.as_array_mut() {
                    list.push(c.clone());
                }
            }
        }
        _ => {}
    }
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
    /// The index the next `content_block_start` must carry (blocks are numbered 0, 1, 2 …;
    /// a repair round continues after the blocks the agent already has).
    next_index: u64,
    /// Index of the first held block; blocks before it were forwarded.
    first_held: Option<u64>,
    held: Vec<Held>,
    stop_reason: Option<String>,
    output_tokens: Option<u64>,
    delta_seen: bool,
    stop_seen: bool,
    decided: bool,
    /// The completion the held calls were decided with.
    decided_completion: Option<Completion>,
    failed: bool,
    /// A provider-executed block was seen in this message.
    provider_output: bool,
    violation: Option<String>,
}

impl MessagesStream {
    /// State for one response to `turn`.
    pub fn new(turn: &Turn) -> Self {
        Self::continuing(turn, 0)
    }

    /// State for a repair round whose blocks are numbered from `offset` (after the
    /// [`MessagesSplice`] renumbered them).
    pub fn continuing(turn: &Turn, offset: u64) -> Self {
        Self {
            max_output_tokens: turn.max_output_tokens,
            blocks: BTreeMap::new(),
            next_index: offset,
            first_held: None,
            held: Vec::new(),
            stop_reason: None,
            output_tokens: None,
            delta_seen: false,
            stop_seen: false,
            decided: false,
            decided_completion: None,
            failed: false,
            provider_output: false,
            violation: None,
        }
    }

    fn holding(&self) -> bool {
        self.first_held.is_some() && !self.decided
    }

    fn violate(&mut self, why: String) {
        self.violation.get_or_insert(why);
    }

    /// `content_block_start`: the next block in order (index, before the `message_delta`),
    /// a provider-run block marks the message's calls as decided on untrusted output, a
    /// `tool_use` block starts a call (and holding).
    ///
    /// Errors: the violation, named.
    fn block_start(&mut self, index: Option<u64>, parsed: &Value) -> Result<(), String> {
        let Some(ix) = index else {
            return Err("a `content_block_start` without an `index`".into());
        };
        if ix != self.next_index {
            return Err(format!(
                "a `content_block_start` with index {ix} where {} was expected",
                self.next_index
            ));
        }
        if self.delta_seen {
            return Err("a content block after the `message_delta`".into());
        }
        let Some(cb) = parsed.get("content_block").filter(|b| b.is_object()) else {
            return Err("a `content_block_start` without a `content_block`".into());
        };
        let ty = cb.get("type").and_then(Value::as_str).unwrap_or_default();
        if is_provider_block(ty) {
            // Provider-run tool output the model reads in this very message: its calls
            // are decided as untrusted, as `parse_response` decides them.
            self.provider_output = true;
        }
        let call = (ty == "tool_use").then(|| ToolCall {
            input: crate::model::CallInput::Json,
            id: cb
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            name: cb
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            arguments: String::new(),
        });
        let is_call = call.is_some();
        self.next_index = ix.saturating_add(1);
        self.blocks.insert(
            ix,
            Block {
                call,
                content: cb.clone(),
                stopped: false,
            },
        );
        if is_call && self.first_held.is_none() {
            self.first_held = Some(ix);
        }
        Ok(())
    }

    /// `message_delta`: stop reason and output tokens; after the decision point it must not
    /// change the completion.
    ///
    /// Errors: the violation, named.
    fn message_delta(&mut self, parsed: &Value) -> Result<(), String> {
        if parsed.get("delta").is_some_and(|d| !d.is_object()) {
            return Err("a `message_delta` whose `delta` is not an object".into());
        }
        if let Some(r) = parsed.at("/delta/stop_reason").and_then(Value::as_str) {
            self.stop_reason = Some(r.to_owned());
        }
        if let Some(t) = parsed.at("/usage/output_tokens").and_then(Value::as_u64) {
            self.output_tokens = Some(t);
        }
        self.delta_seen = true;
        if self
            .decided_completion
            .as_ref()
            .is_some_and(|c| *c != self.completion())
        {
            return Err(
                "a `message_delta` after the decision point that changes the completion".into(),
            );
        }
        Ok(())
    }

    /// Holds an event while calls are held, else forwards it.
    fn forward(
        &mut self,
        raw: Bytes,
        name: Option<String>,
        json: Option<Value>,
        index: Option<u64>,
        out: &mut Vec<Bytes>,
    ) {
        if self.holding() {
            self.held.push(Held {
                raw,
                name,
                json,
                index,
            });
        } else {
            out.push(raw);
        }
    }

    fn completion(&self) -> Completion {
        classify(
            self.stop_reason.as_deref(),
            self.output_tokens,
            self.max_output_tokens,
        )
    }

    /// Drops what is held and ends the agent's stream with an `error` event of `kind`
    /// (`event: error`, `{"type": "error", "error": {type, message}}`).
    fn error_event(&mut self, kind: &str, message: &str, out: &mut Vec<Bytes>) {
        self.held.clear();
        self.decided = true;
        let body = json!({ "type": "error", "error": { "type": kind, "message": message } });
        out.push(sse::encode(Some("error"), &body.to_string()));
    }
}

impl ProviderStream for MessagesStream {
    /// Calls are held and not yet decided.
    fn pending(&self) -> bool {
        self.holding()
    }

    /// The stream broke its own structure (see [`Self::push`]); nothing more is forwarded.
    fn violation(&self) -> Option<&str> {
        self.violation.as_deref()
    }

    /// Takes one event; bytes to forward now are appended to `out`.
    ///
    /// Fails closed (sets [`Self::violation`], forwards nothing of the event) on a structure
    /// that does not identify each block uniquely, or that contradicts what was decided: an
    /// event without a `type` or whose `event:` line names another type, a
    /// `content_block_*` whose `index` is missing, not an integer or negative, a block start
    /// out of sequence (the SDK appends blocks in arrival order and indexes deltas by
    /// `index`, so a repeated or skipped index would put one call's bytes under another's
    /// verdict), a delta or stop for a block that is not open, a block after the
    /// `message_delta`, a `message_delta` whose `delta` is not an object or that changes the
    /// completion after the decision point, or any event after `message_stop`.
    fn push(&mut self, event: Event, out: &mut Vec<Bytes>) {
        if self.violation.is_some() {
            return;
        }
        let Event { block, payload } = event;
        let parsed = match payload {
            Payload::None | Payload::Done => {
                // A comment or keep-alive: nothing a client dispatches.
                self.forward(block.raw, block.event, None, None, out);
                return;
            }
            Payload::Json(v) => v,
            Payload::Text => match sse::read_text(&block) {
                Ok(v) => v,
                Err(e) => return self.violate(e.to_string()),
            },
            Payload::Body => return self.violate("a whole body inside a stream".into()),
        };
        let Some(kind) = parsed
            .get("type")
            .and_then(Value::as_str)
            .map(str::to_owned)
        else {
            return self.violate("an event without a string `type`".into());
        };
        if block.event.as_deref().is_some_and(|e| e != kind) {
            return self.violate(format!(
                "an `event:` line that names another type than the data's `{}`",
                crate::admission::sanitize_label(&kind)
            ));
        }
        if self.stop_seen && kind != "ping" {
            return self.violate("an event after `message_stop`".into());
        }
        let index = match parsed.get("index") {
            None => None,
            Some(v) => match v.as_u64() {
                Some(ix) => Some(ix),
                None => {
                    return self.violate("an `index` that is not a non-negative integer".into())
                }
            },
        };
        match kind.as_str() {
            "ping" => {
                out.push(block.raw);
                return;
            }
            "error" => {
                self.failed = true;
                self.held.clear();
                self.decided = true;
                out.push(block.raw);
                return;
            }
            "content_block_start" => {
                if let Err(why) = self.block_start(index, &parsed) {
                    return self.violate(why);
                }
            }
            "content_block_delta" | "content_block_stop" => {
                let Some(ix) = index else {
                    return self.violate(format!("a `{kind}` without an `index`"));
                };
                let Some(b) = self.blocks.get_mut(&ix).filter(|b| !b.stopped) else {
                    return self.violate(format!("a `{kind}` for block {ix}, which is not open"));
                };
                if kind == "content_block_stop" {
                    b.stopped = true;
                } else if let (Some(call), Some(p)) = (
                    b.call.as_mut(),
                    parsed.at("/delta/partial_json").and_then(Value::as_str),
                ) {
                    call.arguments.push_str(p);
                } else if let Some(delta) = parsed.get("delta") {
                    apply_delta(&mut b.content, delta);
                }
            }
            "message_delta" => {
                if let Err(why) = self.message_delta(&parsed) {
                    return self.violate(why);
                }
            }
            "message_start" if !self.blocks.is_empty() || self.delta_seen => {
                return self.violate("a second `message_start`".into());
            }
            // The API opens the message empty (`content: []`) and streams its blocks as
            // `content_block_*` events, the only ones turnguard reads calls from; the SDKs
            // start their message from this one, so a block in it would reach the agent
            // undecided.
            "message_start"
                if parsed
                    .at("/message/content")
                    .is_some_and(|c| c.as_array().is_none_or(|a| !a.is_empty())) =>
            {
                return self.violate(
                    "a `message_start` whose message already holds content (its blocks must come as `content_block_*` events)".into(),
                );
            }
            "message_stop" => self.stop_seen = true,
            _ => {}
        }
        self.forward(block.raw, block.event, Some(parsed), index, out);
    }

    /// The stop reason is known (or the message ended) while calls are held.
    fn ready(&self) -> bool {
        self.holding() && !self.failed && (self.delta_seen || self.stop_seen)
    }

    /// `message_stop` was seen: a stream that ends now is complete.
    fn finished(&self) -> bool {
        self.stop_seen || self.failed
    }

    /// The provider reported an error in the stream.
    fn failed(&self) -> bool {
        self.failed
    }

    /// The emissions to admit (one choice, index 0).
    fn round(&self) -> Vec<ChoiceEmissions> {
        let calls: Vec<ToolCall> = self
            .blocks
            .values()
            .filter_map(|b| b.call.clone())
            .collect();
        if calls.is_empty() {
            return Vec::new();
        }
        let output = self
            .blocks
            .values()
            .map(|b| {
                let mut content = b.content.clone();
                if let Some(call) = &b.call {
                    if let Ok(input) = serde_json::from_str::<Value>(&call.arguments) {
                        set(&mut content, "input", input);
                    }
                }
                content
            })
            .collect();
        vec![ChoiceEmissions {
            output,
            choice: 0,
            text: None,
            provider_output: self.provider_output,
            completion: self.completion(),
            calls,
        }]
    }

    /// Completion of the message, for the journal.
    fn completions(&self) -> Vec<Completion> {
        if self.delta_seen || self.stop_seen {
            vec![self.completion()]
        } else {
            Vec::new()
        }
    }

    /// Emits the held events with the verdicts applied; later events flow through.
    fn release(&mut self, verdicts: &[ChoiceVerdict], out: &mut Vec<Bytes>) {
        self.decided = true;
        self.decided_completion = Some(self.completion());
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
                            out.push(sse::encode(
                                Some("content_block_delta"),
                                &crate::strict_json::to_text(&delta),
                            ));
                        }
                        _ => {}
                    }
                }
                match renumber.get(&ix) {
                    Some(None) => continue,
                    Some(Some(new)) if *new != ix => {
                        if let Some(v) = h.json.as_mut() {
                            set(v, "index", json!(new));
                            out.push(sse::encode(
                                h.name.as_deref(),
                                &crate::strict_json::to_text(v),
                            ));
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
                        // `push` refused a `message_delta` whose `delta` is not an object.
                        if let Some(obj) = v.as_object_mut() {
                            let delta = obj.entry("delta").or_insert_with(|| json!({}));
                            set(delta, "stop_reason", json!("end_turn"));
                        }
                        out.push(sse::encode(
                            h.name.as_deref().or(Some("message_delta")),
                            &crate::strict_json::to_text(v),
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
    fn cut(&mut self, reason: &str, out: &mut Vec<Bytes>) {
        self.error_event(
            "api_error",
            &format!("turnguard: the upstream stream ended early ({reason}); withheld tool calls were not released"),
            out,
        );
    }

    /// Drops what is held (the round is being repaired). The [`MessagesSplice`] carries how
    /// many content blocks the agent has already received: the next round's blocks are
    /// numbered after them.
    fn abandon(&mut self) -> Splice {
        self.held.clear();
        self.decided = true;
        let offset = self
            .first_held
            .unwrap_or_else(|| self.blocks.keys().next_back().map_or(0, |k| k + 1));
        Splice::new(MessagesSplice { offset })
    }

    /// Drops what is held and ends the agent's stream with an `error` event of type
    /// `invalid_request_error` whose message starts with the OpenWOP `code` (`code: message`;
    /// the Anthropic SDK raises on an `error` event and shows its message).
    fn fail(&mut self, code: &str, message: &str, out: &mut Vec<Bytes>) {
        self.error_event("invalid_request_error", &format!("{code}: {message}"), out);
    }

    /// Messages stores no responses.
    fn response_link(&self) -> Option<ResponseLink> {
        None
    }

    /// A `content_block_delta`'s `text_delta` text (wire-formats.md §3).
    fn answer_text<'a>(&'a self, event: &'a Event) -> Option<&'a str> {
        let v = event.json()?;
        if v.at("/delta/type").and_then(Value::as_str) != Some("text_delta") {
            return None;
        }
        v.at("/delta/text").and_then(Value::as_str)
    }

    /// `message_stop` (by the data's `type`, which [`Self::push`] requires to agree with the
    /// `event:` line).
    fn is_terminal(&self, event: &Event) -> bool {
        event.kind() == Some("message_stop")
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
