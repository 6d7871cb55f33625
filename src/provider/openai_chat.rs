//! OpenAI Chat Completions (`POST /v1/chat/completions`) and compatible servers (vLLM,
//! Ollama, llama.cpp …): requests, JSON responses and the SSE stream, into and out of the
//! neutral model. Wire facts are from `shared/reference/wire-formats.md` §2.
//!
//! Stream rule: text, refusal and role deltas are forwarded as they arrive; every chunk that
//! carries `tool_calls` deltas is held, with the finish chunk of its choice, until the
//! completion state is known (the finish chunk, plus the usage chunk when the request set a
//! token limit and `include_usage`), then admitted and released or replaced. Chunks that no
//! decision changes are re-emitted byte for byte.

use crate::strict_json::Lookup as _;
use crate::strict_json::{RequestBody, ToolsMember};
use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use serde_json::{json, Map, Value};

use super::chat_chunk::{Chunk, DeltaChoice, FunctionDelta};
use super::view::{members, object_view, once, Obj, ObjectView, Str};
use super::{CallNames, Provider, ProviderStream, Splice, SpliceState};
use crate::model::{
    AnswerContext, Api, ChoiceEmissions, ChoiceVerdict, Completion, CompletionState,
    DeclaredSchemas, DeclaredTool, RepairItem, ResponseLink, ToolCall, ToolResultSeen, Turn,
    UntrustedKind,
};
use crate::sse::{self, Event, Payload};
use serde::de::MapAccess;

/// The Chat Completions adapter ([`crate::provider::adapter`] of [`Api::OpenAiChat`]).
#[derive(Debug, Clone, Copy)]
pub struct OpenAiChat;

impl Provider for OpenAiChat {
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

    /// The request's `n` (default 1).
    fn choices_requested(&self, body: &Value) -> u64 {
        body.member("n").and_then(Value::as_u64).unwrap_or(1)
    }

    /// See [`prepare_upstream`].
    fn prepare_upstream(&self, body: &mut RequestBody, turn: &mut Turn) -> bool {
        if !needs_usage_request(turn) {
            return false;
        }
        prepare_upstream(body.tree_mut(), turn)
    }

    /// Chat stores no responses.
    fn response_link(&self, _body: &Value, _ctx: &AnswerContext) -> Option<ResponseLink> {
        None
    }

    fn rewrite_response(&self, body: &mut Value, verdicts: &[ChoiceVerdict]) -> bool {
        rewrite_response(body, verdicts)
    }

    /// See [`rewrites`].
    fn rewrites(&self, verdicts: &[ChoiceVerdict]) -> bool {
        rewrites(verdicts)
    }

    /// See [`parse_response_bytes`].
    fn parse_response_bytes(
        &self,
        raw: &[u8],
        ctx: &AnswerContext,
    ) -> Option<Result<Vec<ChoiceEmissions>, String>> {
        parse_response_bytes(raw, ctx)
    }

    fn append_repair(&self, body: &mut Value, choice: &ChoiceEmissions, items: &[RepairItem]) {
        append_repair(body, choice, items);
    }

    /// `response_format: {type: "json_schema", json_schema: {name, schema}}` (the name
    /// defaults to `response_format`).
    fn structured_schema(&self, body: &Value) -> Option<(String, Value)> {
        let rf = body.member("response_format")?;
        if rf.member("type").and_then(Value::as_str) != Some("json_schema") {
            return None;
        }
        let js = rf.member("json_schema")?;
        let name = js
            .member("name")
            .and_then(Value::as_str)
            .unwrap_or("response_format")
            .to_owned();
        Some((name, js.member("schema")?.clone()))
    }

    /// Two `messages`: the assistant's `answer`, then the user's `feedback` (nothing when
    /// `messages` is not an array; [`parse_request`] refused such a request).
    fn append_text_repair(&self, body: &mut Value, answer: &str, feedback: &str) {
        if let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) {
            messages.push(json!({"role": "assistant", "content": answer}));
            messages.push(json!({"role": "user", "content": feedback}));
        }
    }

    /// A [`ChatStream`]; a repair round's [`ChatSplice`] is applied before it, by the relay.
    fn stream(&self, turn: &Turn, _splice: Option<&Splice>) -> Box<dyn ProviderStream> {
        Box::new(ChatStream::new(turn))
    }
}

/// How a Chat repair round continues the agent's stream: the role is not repeated (the SDK
/// concatenates string deltas), except for the choices in `owed_roles`, whose role chunk was
/// held and dropped: the first chunk of such a choice in the repair round carries
/// `role: "assistant"` (openai-node throws `missing role for choice N` on a stream without
/// one), and later ones do not (tests/compat/FINDINGS.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatSplice {
    /// Choice indices the agent has not been sent a `delta.role` for yet.
    owed_roles: BTreeSet<u32>,
}

impl SpliceState for ChatSplice {
    /// Puts `role: "assistant"` on an owed choice's first delta and strips `role` from every
    /// other; an event without JSON, or that changes nothing, passes byte for byte.
    fn apply(&mut self, event: Event) -> Option<Event> {
        let Some(v) = event.json() else {
            return Some(event);
        };
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
            if index.is_some_and(|i| self.owed_roles.remove(&i)) {
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

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Reads a Chat Completions request body: `body`'s tree and its top-level `tools` member, which
/// `tools` gives ([`RequestBody::tools`]: the tree lacks it while the body shares its tools).
///
/// Errors: a human-readable reason naming the offending field.
fn parse_request(
    body: &Value,
    tools: Option<ToolsMember<'_>>,
    schemas: &dyn DeclaredSchemas,
) -> Result<Turn, String> {
    let obj = body.as_object().ok_or("the body must be a JSON object")?;
    let messages = body
        .member("messages")
        .and_then(Value::as_array)
        .ok_or("`messages` must be an array")?;
    let (tools, unknown_tools) = declared_tools(obj, tools, schemas)?;
    let mut turn = Turn {
        item_references: Vec::new(),
        api: Api::OpenAiChat,
        model: body
            .member("model")
            .and_then(Value::as_str)
            .map(str::to_owned),
        stream: body.member("stream").and_then(Value::as_bool) == Some(true),
        tools,
        tool_results: Vec::new(),
        max_output_tokens: body
            .member("max_completion_tokens")
            .and_then(Value::as_u64)
            .or_else(|| body.member("max_tokens").and_then(Value::as_u64)),
        include_usage: body
            .at("/stream_options/include_usage")
            .and_then(Value::as_bool)
            == Some(true),
        round_index: 0,
        prior_calls: Vec::new(),
        untrusted_inputs: Vec::new(),
        usage_for_turnguard: false,
        previous_response_id: None,
        arguments_fixed: false,
        provider_delegations: Vec::new(),
    };
    for i in unknown_tools {
        turn.untrusted(UntrustedKind::Unrecognised, format!("tools[{i}].type"));
    }
    if obj.contains_key("web_search_options") {
        // The provider searches the web in this very turn (§C, §F).
        turn.untrusted(UntrustedKind::ProviderOutput, "web_search_options");
    }
    let mut calls = CallNames::default();
    for (i, m) in messages.iter().enumerate() {
        let role = m
            .member("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("`messages[{i}].role` must be a string"))?;
        match role {
            "system" | "developer" | "user" => {}
            "assistant" => {
                turn.round_index = turn.round_index.saturating_add(1);
                for (k, c) in m
                    .member("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .enumerate()
                {
                    let name = c.at("/function/name").and_then(Value::as_str);
                    if let Some(name) = name {
                        turn.prior_calls.push(name.to_owned());
                    }
                    if let Some(id) = c.member("id").and_then(Value::as_str) {
                        calls.add(&mut turn, id, name, || {
                            format!("messages[{i}].tool_calls[{k}].id")
                        });
                    }
                }
            }
            "function" => {
                // The legacy functions API: a result without a call id, named by `name`.
                let name = m.member("name").and_then(Value::as_str).unwrap_or_default();
                turn.tool_results.push(ToolResultSeen {
                    tool_call_id: format!("function:{name}"),
                    tool_name: (!name.is_empty()).then(|| name.to_owned()),
                    content: m.member("content").cloned().unwrap_or(Value::Null),
                    is_error: false,
                });
            }
            "tool" => {
                let id = m
                    .member("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("`messages[{i}].tool_call_id` must be a string"))?;
                turn.tool_results.push(ToolResultSeen {
                    tool_call_id: id.to_owned(),
                    tool_name: calls.name_of(id),
                    content: m.member("content").cloned().unwrap_or(Value::Null),
                    is_error: false,
                });
            }
            other => {
                // A role turnguard does not know is untrusted, never skipped (DESIGN.md §9).
                turn.untrusted(
                    UntrustedKind::Unrecognised,
                    format!(
                        "messages[{i}].role `{}`",
                        crate::admission::sanitize_label(other)
                    ),
                );
            }
        }
        judge_content(&mut turn, m.member("content"), || {
            format!("messages[{i}].content")
        });
    }
    Ok(turn)
}

/// The declared tools of a request (`tools` of type `function`, then the legacy
/// `functions`), and the positions of `tools` entries of a type turnguard does not know.
/// Client-executed free-form (`custom`) tools are not declared: calls to them are
/// undeclared for admission (withheld at the name stage).
///
/// Errors: `tools` not an array, or a function tool without `function` or `function.name`.
fn declared_tools(
    obj: &serde_json::Map<String, Value>,
    member: Option<ToolsMember<'_>>,
    schemas: &dyn DeclaredSchemas,
) -> Result<(Vec<DeclaredTool>, Vec<usize>), String> {
    let mut tools = Vec::new();
    let mut unknown_tools = Vec::new();
    if let Some(member) = member {
        let list = member.into_array().ok_or("`tools` must be an array")?;
        for (i, t) in list.into_iter().enumerate() {
            match t.member("type").and_then(Value::as_str) {
                Some("function") => {}
                // Client-executed free-form tools: calls to them are undeclared for admission
                // (withheld at the name stage).
                Some("custom") => continue,
                _ => {
                    unknown_tools.push(i);
                    continue;
                }
            }
            let f = t
                .member("function")
                .ok_or_else(|| format!("`tools[{i}].function` is missing"))?;
            let name = f
                .member("name")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("`tools[{i}].function.name` must be a string"))?;
            tools.push(DeclaredTool::declared(
                name,
                f.member("parameters"),
                schemas,
            ));
        }
    }
    if let Some(list) = crate::strict_json::member(obj, "functions").and_then(Value::as_array) {
        for f in list {
            if let Some(name) = f.member("name").and_then(Value::as_str) {
                tools.push(DeclaredTool::declared(
                    name,
                    f.member("parameters"),
                    schemas,
                ));
            }
        }
    }
    Ok((tools, unknown_tools))
}

/// Judges a message's `content` (string, null, or an array of parts): text, inline images
/// (`data:` URLs), inline audio and inline files are the message's own; an `image_url` with
/// any other URL or a `file` by `file_id` is content the provider fetches or holds
/// ([`UntrustedKind::ProviderFetched`]); a part type turnguard does not know is
/// [`UntrustedKind::Unrecognised`].
fn judge_content(turn: &mut Turn, content: Option<&Value>, at: impl Fn() -> String) {
    let parts = match content {
        None | Some(Value::Null) | Some(Value::String(_)) => return,
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            turn.untrusted(UntrustedKind::Unrecognised, at());
            return;
        }
    };
    for (k, p) in parts.iter().enumerate() {
        let at = || format!("{}[{k}]", at());
        match p.member("type").and_then(Value::as_str) {
            Some("text" | "refusal" | "input_audio") => {}
            Some("image_url") => {
                let url = p
                    .at("/image_url/url")
                    .or_else(|| p.member("image_url"))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                if !url.starts_with("data:") {
                    turn.untrusted(UntrustedKind::ProviderFetched, at());
                }
            }
            Some("file") => {
                let inline = p.at("/file/file_data").and_then(Value::as_str).is_some();
                if !inline || p.at("/file/file_id").is_some() {
                    turn.untrusted(UntrustedKind::ProviderFetched, at());
                }
            }
            _ => turn.untrusted(UntrustedKind::Unrecognised, at()),
        }
    }
}

/// `finish_reason` values that end a choice normally: OpenAI's (`stop`, `tool_calls`, the
/// legacy `function_call`) and those OpenAI-compatible servers send for the same
/// (`eos`, `eos_token`, `stop_sequence`, `end_turn`, `tool_use`).
const CLEAN_FINISHES: [&str; 8] = [
    "stop",
    "tool_calls",
    "function_call",
    "eos",
    "eos_token",
    "stop_sequence",
    "end_turn",
    "tool_use",
];

/// `finish_reason` values that mean a refusal or a filter.
const REFUSED_FINISHES: [&str; 3] = ["content_filter", "refusal", "safety"];

/// `finish_reason` values that mean the context window (prompt plus output) is full.
const CONTEXT_FINISHES: [&str; 3] = [
    "model_context_window_exceeded",
    "context_length_exceeded",
    "context_window_exceeded",
];

/// Classifies how a choice ended (tool-turn contract §B stage 1). `used` is
/// `usage.completion_tokens`, `max` the request's token limit.
///
/// Truncation is truncation under every name, and from every signal:
/// - a `finish_reason` that is not a known normal end is not known to be complete:
///   `length`, `max_tokens`, `max_output_tokens` (compatible servers), `model_length`
///   (Mistral) and any value turnguard does not know are truncated; a context-window
///   reason is [`CompletionState::ContextExhausted`]; `content_filter` / a refusal is refused;
/// - a normal finish whose usage reached the limit is truncated (vLLM streaming reported
///   `tool_calls` for calls cut by `max_tokens`; wire-formats.md §15);
/// - a normal finish while the request set a limit and no usage was reported is truncated
///   (`usage_missing`): whether the limit cut the call cannot be known. turnguard asks a
///   stream for its usage chunk itself ([`prepare_upstream`]), so this is a server that
///   reports no usage at all.
///
/// What cannot be known: with no token limit in the request, a server that reports a normal
/// finish for a call cut by the model's own output limit.
pub fn classify(
    finish_reason: Option<&str>,
    refused: bool,
    used: Option<u64>,
    max: Option<u64>,
) -> Completion {
    let completion = Completion::new;
    if refused {
        return completion(CompletionState::Refused, "refusal");
    }
    match finish_reason {
        None => completion(CompletionState::Truncated, "missing_finish_reason"),
        Some(r) if REFUSED_FINISHES.contains(&r) => completion(CompletionState::Refused, r),
        Some(r) if CONTEXT_FINISHES.contains(&r) => {
            completion(CompletionState::ContextExhausted, r)
        }
        Some(r) if CLEAN_FINISHES.contains(&r) => match (used, max) {
            (Some(u), Some(m)) if u >= m => {
                completion(CompletionState::Truncated, "max_tokens_reached")
            }
            (None, Some(_)) => completion(CompletionState::Truncated, "usage_missing"),
            _ => completion(CompletionState::Clean, r),
        },
        Some(r) => completion(CompletionState::Truncated, r),
    }
}

/// Prepares a Chat request for the upstream: a stream with a token limit whose agent did not
/// ask for usage gets `stream_options.include_usage = true`, so the completion stage can tell
/// a call cut by the limit from a complete one even when the provider says `tool_calls`; the
/// usage chunk is then turnguard's own and is not forwarded ([`Turn::usage_for_turnguard`]).
/// Returns whether the body changed.
pub fn prepare_upstream(body: &mut Value, turn: &mut Turn) -> bool {
    if !needs_usage_request(turn) {
        return false;
    }
    let Some(obj) = body.as_object_mut() else {
        return false;
    };
    let options = obj.entry("stream_options").or_insert_with(|| json!({}));
    if !options.is_object() {
        *options = json!({});
    }
    if let Some(options) = options.as_object_mut() {
        options.insert("include_usage".into(), Value::Bool(true));
        turn.include_usage = true;
        turn.usage_for_turnguard = true;
    }
    true
}

/// Whether [`prepare_upstream`] changes a request of `turn`: a stream with a token limit whose
/// agent did not ask for usage (the body's whole tree is taken only then).
fn needs_usage_request(turn: &Turn) -> bool {
    turn.stream && !turn.include_usage && turn.max_output_tokens.is_some()
}

fn call_from_message(c: &Value) -> ToolCall {
    let arguments = match c.at("/function/arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    };
    ToolCall {
        input: crate::model::CallInput::Json,
        id: c
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        name: c
            .at("/function/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        arguments,
    }
}

/// Reads the emissions of a non-stream response, one entry per choice.
///
/// Errors: the response does not identify each choice uniquely (a choice without a
/// non-negative integer `index`, or two choices with one): a verdict could otherwise reach
/// another choice's calls (DESIGN.md §9).
pub fn parse_response(body: &Value, ctx: &AnswerContext) -> Result<Vec<ChoiceEmissions>, String> {
    let used = body.at("/usage/completion_tokens").and_then(Value::as_u64);
    let mut out = Vec::new();
    for choice in body
        .get("choices")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let index = choice_index(choice)
            .ok_or("a choice of the response has no non-negative integer `index`")?;
        let message = choice.get("message").unwrap_or(&Value::Null);
        let mut calls: Vec<ToolCall> = message
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(call_from_message)
            .collect();
        if let Some(fc) = message.get("function_call").filter(|v| v.is_object()) {
            let mut call = call_from_message(&json!({ "function": fc }));
            call.id = "function_call".into();
            calls.push(call);
        }
        let refused = matches!(message.get("refusal"), Some(Value::String(s)) if !s.is_empty());
        out.push(ChoiceEmissions {
            output: Vec::new(),
            choice: index,
            text: message
                .get("content")
                .and_then(Value::as_str)
                .map(str::to_owned),
            provider_output: false,
            completion: classify(
                choice.get("finish_reason").and_then(Value::as_str),
                refused,
                used,
                ctx.max_output_tokens,
            ),
            calls,
        });
    }
    crate::model::check_identities(&out)?;
    Ok(out)
}

/// What [`parse_response`] reads of a response, as a typed view of its bytes
/// ([`super::view`]): any field of another type, or repeated, and the view refuses the body;
/// every other member is checked as a tree would read it, in the same pass.
struct ResponseView<'a> {
    choices: Option<Vec<Obj<ChoiceView<'a>>>>,
    usage: Option<Obj<UsageView>>,
}

struct ChoiceView<'a> {
    index: Option<u64>,
    message: Option<Obj<MessageView<'a>>>,
    finish_reason: Option<Str<'a>>,
}

struct MessageView<'a> {
    content: Option<Str<'a>>,
    tool_calls: Option<Vec<Obj<CallView<'a>>>>,
    function_call: Option<Obj<FunctionView<'a>>>,
    refusal: Option<Str<'a>>,
}

struct CallView<'a> {
    id: Option<Str<'a>>,
    function: Option<Obj<FunctionView<'a>>>,
}

struct FunctionView<'a> {
    name: Option<Str<'a>>,
    /// `None` when missing (no text), `Some(None)` when `null` (the text `null`,
    /// [`call_from_message`]).
    arguments: Option<Option<Str<'a>>>,
}

/// A `usage` object: what a response and a stream chunk read of it.
pub(super) struct UsageView {
    pub(super) completion_tokens: Option<u64>,
}

object_view!(ResponseView<'a> { choices, usage });
object_view!(ChoiceView<'a> { index, message, finish_reason });
object_view!(MessageView<'a> { content, tool_calls, function_call, refusal });
object_view!(CallView<'a> { id, function });
object_view!(UsageView { completion_tokens });

impl<'de: 'a, 'a> ObjectView<'de> for FunctionView<'a> {
    fn read<A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        let (mut name, mut arguments) = (None, None);
        members(map, |member, map| match member {
            "name" => once(map, &mut name, "name"),
            // Kept as read: `null` is not missing here.
            "arguments" => once(map, &mut arguments, "arguments"),
            _ => Ok(false),
        })?;
        Ok(Self {
            name: name.flatten(),
            arguments,
        })
    }
}

impl FunctionView<'_> {
    /// The call as [`call_from_message`] reads it (`id` set by the caller).
    fn call(this: Option<Obj<Self>>, id: String) -> ToolCall {
        let (name, arguments) = this.map_or((None, None), |Obj(f)| (f.name, f.arguments));
        ToolCall {
            input: crate::model::CallInput::Json,
            id,
            name: name.map(Str::into_owned).unwrap_or_default(),
            arguments: match arguments {
                None => String::new(),
                Some(None) => "null".to_owned(),
                Some(Some(text)) => text.into_owned(),
            },
        }
    }
}

/// [`parse_response`] read from the body's bytes through a typed view, without building the
/// JSON tree, in one pass: `None` when no tree can be read from `raw` (the view checks every
/// member it skips, [`super::view::members`]) or the view refuses the body (a field it reads
/// has another type, or comes twice), and the caller reads the tree instead.
pub fn parse_response_bytes(
    raw: &[u8],
    ctx: &AnswerContext,
) -> Option<Result<Vec<ChoiceEmissions>, String>> {
    let Obj(view) = crate::strict_json::view_from_slice::<Obj<ResponseView<'_>>>(raw)?;
    let used = view.usage.and_then(|Obj(u)| u.completion_tokens);
    let mut out = Vec::new();
    for Obj(choice) in view.choices.into_iter().flatten() {
        let Some(index) = choice.index.and_then(|i| u32::try_from(i).ok()) else {
            return Some(Err(
                "a choice of the response has no non-negative integer `index`".into(),
            ));
        };
        let message = choice.message.map(|Obj(m)| m);
        let (text, refusal, tool_calls, function_call) = match message {
            Some(m) => (m.content, m.refusal, m.tool_calls, m.function_call),
            None => (None, None, None, None),
        };
        let mut calls: Vec<ToolCall> = tool_calls
            .into_iter()
            .flatten()
            .map(|Obj(c)| {
                FunctionView::call(c.function, c.id.map(Str::into_owned).unwrap_or_default())
            })
            .collect();
        if function_call.is_some() {
            calls.push(FunctionView::call(function_call, "function_call".into()));
        }
        let refused = refusal.is_some_and(|r| !r.as_str().is_empty());
        out.push(ChoiceEmissions {
            output: Vec::new(),
            choice: index,
            text: text.map(Str::into_owned),
            provider_output: false,
            completion: classify(
                choice.finish_reason.as_ref().map(Str::as_str),
                refused,
                used,
                ctx.max_output_tokens,
            ),
            calls,
        });
    }
    Some(crate::model::check_identities(&out).map(|()| out))
}

/// Whether [`rewrite_response`] could change a response under `verdicts`: only a choice
/// whose verdict withholds a call or replaces arguments is rewritten.
pub fn rewrites(verdicts: &[ChoiceVerdict]) -> bool {
    verdicts
        .iter()
        .any(|v| v.any_withheld() || v.any_replaced())
}

/// Applies verdicts to a non-stream response: withheld calls are removed; an ended turn also
/// gains the host-authored text and finishes with `stop`. Returns whether anything changed.
pub fn rewrite_response(body: &mut Value, verdicts: &[ChoiceVerdict]) -> bool {
    let mut changed = false;
    let Some(choices) = body.get_mut("choices").and_then(Value::as_array_mut) else {
        return false;
    };
    for choice in choices.iter_mut() {
        // `parse_response` refused a response without unique integer indices.
        let Some(index) = choice_index(choice) else {
            continue;
        };
        let Some(verdict) = verdicts.iter().find(|v| v.choice == index) else {
            continue;
        };
        // The predicate of [`rewrites`]: nothing else is changed.
        if !rewrites(std::slice::from_ref(verdict)) {
            continue;
        }
        if let Some(message) = choice.get_mut("message").and_then(Value::as_object_mut) {
            // Calls are in emission order: tool_calls first, then a legacy function_call.
            let n_calls = message
                .get("tool_calls")
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            if let Some(list) = message.get_mut("tool_calls").and_then(Value::as_array_mut) {
                for (n, call) in list.iter_mut().enumerate() {
                    if let Some(args) = verdict.release_args(n) {
                        set_arguments(call, args);
                    }
                }
                let mut i = 0;
                list.retain(|_| {
                    i += 1;
                    verdict.released(i - 1)
                });
                if list.is_empty() {
                    message.remove("tool_calls");
                }
            }
            if message.contains_key("function_call") && !verdict.released(n_calls) {
                message.remove("function_call");
            }
            if let Some(text) = verdict.end_turn() {
                let content = match message.get("content") {
                    Some(Value::String(s)) if !s.is_empty() => format!("{s}\n\n{text}"),
                    _ => text.to_owned(),
                };
                message.insert("content".into(), Value::String(content));
            }
        }
        if verdict.end_turn().is_some() {
            set(choice, "finish_reason", json!("stop"));
        }
        changed = true;
    }
    changed
}

/// Appends the repair turn: an assistant message with the withheld calls (arguments that
/// are not JSON become `{}`), then a `role: tool` message per call with the host text.
pub fn append_repair(body: &mut Value, choice: &ChoiceEmissions, items: &[RepairItem]) {
    let calls: Vec<Value> = items
        .iter()
        .filter_map(|it| choice.calls.get(it.call))
        .map(|c| {
            let args = if serde_json::from_str::<Value>(&c.arguments).is_ok_and(|v| v.is_object()) {
                c.arguments.clone()
            } else {
                "{}".to_owned()
            };
            json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
        })
        .collect();
    let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) else {
        return;
    };
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": calls}));
    for it in items {
        if let Some(c) = choice.calls.get(it.call) {
            let text = if it.is_error {
                format!("Error: {}", it.text)
            } else {
                it.text.clone()
            };
            messages.push(json!({"role": "tool", "tool_call_id": c.id, "content": text}));
        }
    }
}

/// A call being accumulated from stream deltas.
#[derive(Debug, Clone)]
struct CallAcc {
    /// The `index` the provider used on the wire.
    wire_index: u64,
    call: ToolCall,
}

#[derive(Debug, Default)]
struct ChoiceAcc {
    calls: Vec<CallAcc>,
    finish_reason: Option<String>,
    refused: bool,
    /// A held finish chunk exists for this choice.
    finish_held: bool,
    /// Some chunk of this choice carried `delta.role`; it is always sent (held chunks keep
    /// it), so an added chunk must not repeat it (the SDK concatenates string deltas).
    role_seen: bool,
    /// Some chunk of this choice carried `delta.tool_calls` entries.
    tool_calls_seen: bool,
    /// Some chunk of this choice carried a legacy `delta.function_call`.
    function_call_seen: bool,
}

/// A held chunk: its raw bytes, its JSON (`None` for `[DONE]` and the chunks held only to
/// keep their place), for each `tool_calls` entry (choice position, entry position) the call
/// it belongs to, and the choices whose `delta.role` it carries.
#[derive(Debug)]
struct Held {
    raw: Bytes,
    json: Option<Json>,
    entries: Vec<(usize, usize, usize)>,
    roles: Vec<u32>,
}

impl Held {
    /// A chunk held only to keep its place behind held calls: released as it came.
    fn in_place(raw: Bytes) -> Self {
        Self {
            raw,
            json: None,
            entries: Vec::new(),
            roles: Vec::new(),
        }
    }
}

/// A chunk's JSON: its tree, or its text (read by the typed view) until a rewrite needs the
/// tree.
#[derive(Debug)]
enum Json {
    Tree(Value),
    Text(String),
}

impl Json {
    /// The tree, read from the text if need be.
    ///
    /// Errors: the text is not a JSON object serde_json reads ([`sse::read_object`]); never
    /// for a text the typed view read ([`Chunk::of_text`]).
    fn into_tree(self) -> Result<Value, sse::Unreadable> {
        match self {
            Self::Tree(v) => Ok(v),
            Self::Text(t) => sse::read_object(&t),
        }
    }
}

/// What [`ChatStream::push`] does with a chunk it read.
enum Place {
    /// Forward it now, or hold it in place behind a held finish.
    Other,
    /// A call after the decision point: forwarded without its calls.
    Strip,
    /// Hold it with the calls it carries; `split`: text rides along, forwarded now apart.
    Hold {
        entries: Vec<(usize, usize, usize)>,
        roles: Vec<u32>,
        split: bool,
    },
}

/// Per decided choice: the index each of its calls is emitted at (`None`: withheld), and the
/// text its ended turn adds.
type ReleasePlan<'v> = BTreeMap<u32, (Vec<Option<u64>>, Option<&'v str>)>;
/// Replaced arguments per (choice, call slot).
type Replaced<'v> = BTreeMap<(u32, usize), &'v str>;

/// The Chat stream state machine (see the module docs).
#[derive(Debug)]
pub struct ChatStream {
    max_output_tokens: Option<u64>,
    /// A usage chunk follows (`stream_options.include_usage`) and the request set a token
    /// limit: the completion is known only with it (or at `[DONE]`).
    needs_usage: bool,
    /// The usage chunk is turnguard's own request ([`Turn::usage_for_turnguard`]): it is not
    /// forwarded.
    own_usage: bool,
    choices: BTreeMap<u32, ChoiceAcc>,
    held: Vec<Held>,
    /// The largest `usage.completion_tokens` seen (fail closed: more tokens, closer to the
    /// limit).
    usage_tokens: Option<u64>,
    usage_seen: bool,
    /// The usage chunk (`choices: []` with a filled `usage`) arrived: usage is final.
    usage_final: bool,
    done_seen: bool,
    decided: bool,
    /// `usage_tokens` when the held calls were decided.
    decided_tokens: Option<u64>,
    failed: bool,
    violation: Option<String>,
}

impl ChatStream {
    /// Releases the held chunks as `verdicts` say: withheld calls dropped, released calls
    /// renumbered to their emitted index, replaced arguments carried by a call's first
    /// fragment, an ended turn's text added before its finish chunk. A chunk nothing changed
    /// in goes out as its own bytes.
    fn rewrite_held(&mut self, verdicts: &[ChoiceVerdict], out: &mut Vec<Bytes>) {
        let (plan, replace) = self.release_plan(verdicts);
        let mut replaced_once: std::collections::BTreeSet<(u32, usize)> = Default::default();
        for held in std::mem::take(&mut self.held) {
            let Some(json) = held.json else {
                out.push(held.raw);
                continue;
            };
            let mut chunk = match json.into_tree() {
                Ok(tree) => tree,
                Err(e) => {
                    // Never for a text the view read; fail closed all the same.
                    self.violation.get_or_insert(e.to_string());
                    continue;
                }
            };
            let mut changed = false;
            // End-turn texts to insert before this chunk: (choice, text, with role).
            let mut texts: Vec<(u32, &str, bool)> = Vec::new();
            if let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut) {
                let mut drop_positions = Vec::new();
                for (cpos, c) in choices.iter_mut().enumerate() {
                    // Every held chunk passed `check_structure`: its choices have indices.
                    let Some(index) = choice_index(c) else {
                        continue;
                    };
                    let (Some((emitted, end_turn)), Some(acc)) =
                        (plan.get(&index), self.choices.get(&index))
                    else {
                        continue;
                    };
                    if let Some(list) = c
                        .pointer_mut("/delta/tool_calls")
                        .and_then(Value::as_array_mut)
                    {
                        let slots = Slots {
                            cpos,
                            entries: &held.entries,
                            emitted,
                            acc,
                            index,
                        };
                        changed |= slots.rewrite(list, &replace, &mut replaced_once);
                    }
                    if c.at("/delta/function_call").is_some()
                        && emitted.first().copied().flatten().is_none()
                    {
                        if let Some(d) = c.get_mut("delta").and_then(Value::as_object_mut) {
                            d.remove("function_call");
                        }
                        changed = true;
                    }
                    if let Some(d) = c.get_mut("delta").and_then(Value::as_object_mut) {
                        if d.get("tool_calls")
                            .and_then(Value::as_array)
                            .is_some_and(|a| a.is_empty())
                        {
                            d.remove("tool_calls");
                        }
                    }
                    let has_finish = c.get("finish_reason").is_some_and(|f| !f.is_null());
                    if has_finish {
                        if let Some(text) = end_turn {
                            texts.push((index, text, !acc.role_seen));
                            set(c, "finish_reason", json!("stop"));
                            changed = true;
                        }
                    } else if c
                        .get("delta")
                        .and_then(Value::as_object)
                        .is_some_and(Map::is_empty)
                        && changed
                    {
                        drop_positions.push(cpos);
                    }
                }
                let had_choices = !choices.is_empty();
                for p in drop_positions.into_iter().rev() {
                    choices.remove(p);
                }
                if had_choices && choices.is_empty() && texts.is_empty() {
                    continue; // nothing of this chunk is left to send
                }
            }
            // The held chunk's envelope (`id`, `model` …) is the template of the added text.
            for (index, text, with_role) in texts {
                out.push(text_chunk(&chunk, index, text, with_role));
            }
            if changed {
                out.push(encode(&chunk));
            } else {
                out.push(held.raw);
            }
        }
    }

    /// How releasing `verdicts` rewrites the held chunks: per decided choice, the index each
    /// of its calls is emitted at (`None`: withheld) and the text of an ended turn; and the
    /// calls whose arguments are replaced (the first fragment carries them all, the rest go).
    fn release_plan<'v>(&self, verdicts: &'v [ChoiceVerdict]) -> (ReleasePlan<'v>, Replaced<'v>) {
        let mut plan = ReleasePlan::new();
        let mut replace = Replaced::new();
        for v in verdicts {
            for i in 0..v.decisions.len() {
                if let Some(args) = v.release_args(i) {
                    replace.insert((v.choice, i), args);
                }
            }
        }
        for v in verdicts {
            let Some(acc) = self.choices.get(&v.choice) else {
                continue;
            };
            let mut next = 0u64;
            let emitted: Vec<Option<u64>> = acc
                .calls
                .iter()
                .enumerate()
                .map(|(i, _)| {
                    if v.decisions.get(i).is_some_and(|d| d.released()) {
                        next += 1;
                        Some(next - 1)
                    } else {
                        None
                    }
                })
                .collect();
            plan.insert(v.choice, (emitted, v.end_turn()));
        }
        (plan, replace)
    }

    /// Releasing `verdicts` rewrites no held chunk: every call of every decided choice is
    /// released with its own arguments at the `index` it came with (no call before it is
    /// withheld, so none is renumbered), no turn is ended with added text, and no call is a
    /// legacy `function_call` (its slot has no wire index). Then [`Self::release`] forwards
    /// the held bytes as they came, without walking their trees
    /// (`tests::an_unchanged_release_is_the_rewrite_of_nothing` holds the two paths equal).
    fn releases_unchanged(&self, verdicts: &[ChoiceVerdict]) -> bool {
        verdicts.iter().all(|v| {
            v.end_turn().is_none()
                && self.choices.get(&v.choice).is_none_or(|acc| {
                    acc.calls.iter().enumerate().all(|(i, a)| {
                        v.released(i) && v.release_args(i).is_none() && a.wire_index == i as u64
                    })
                })
        })
    }

    /// State for one response to `turn`.
    pub fn new(turn: &Turn) -> Self {
        Self {
            max_output_tokens: turn.max_output_tokens,
            needs_usage: turn.include_usage && turn.max_output_tokens.is_some(),
            own_usage: turn.usage_for_turnguard,
            choices: BTreeMap::new(),
            held: Vec::new(),
            usage_tokens: None,
            usage_seen: false,
            usage_final: false,
            done_seen: false,
            decided: false,
            decided_tokens: None,
            failed: false,
            violation: None,
        }
    }

    fn holding(&self) -> bool {
        !self.decided && self.choices.values().any(|c| !c.calls.is_empty())
    }

    fn violate(&mut self, why: String) {
        self.violation.get_or_insert(why);
    }

    /// The structural rules of one chunk's tree (see [`Self::push`]) but the one that needs
    /// the stream's state ([`Self::read`] checks it for both readings).
    fn check_structure(chunk: &Value) -> Result<(), String> {
        let Some(choices) = chunk.get("choices") else {
            return Ok(());
        };
        let Some(choices) = choices.as_array() else {
            return Err("`choices` that is not an array".into());
        };
        let mut seen = std::collections::BTreeSet::new();
        for c in choices {
            let Some(index) = choice_index(c) else {
                return Err("a choice without a non-negative integer `index`".into());
            };
            if !seen.insert(index) {
                return Err(format!("choice {index} twice in one chunk"));
            }
            if c.get("delta").is_some_and(|d| !d.is_object()) {
                return Err(format!("a `delta` of choice {index} that is not an object"));
            }
            if let Some(list) = c.at("/delta/tool_calls").filter(|l| !l.is_null()) {
                let Some(list) = list.as_array() else {
                    return Err(format!(
                        "`tool_calls` of choice {index} that is not an array"
                    ));
                };
                if list
                    .iter()
                    .any(|e| !e.is_object() || e.get("index").and_then(Value::as_u64).is_none())
                {
                    return Err(format!(
                        "a tool call of choice {index} without a non-negative integer `index`"
                    ));
                }
            }
            if c.at("/delta/function_call")
                .is_some_and(|f| !f.is_null() && !f.is_object())
            {
                return Err(format!(
                    "a `function_call` of choice {index} that is not an object"
                ));
            }
            if c.get("finish_reason")
                .is_some_and(|f| !f.is_null() && !f.is_string())
            {
                return Err(format!(
                    "a `finish_reason` of choice {index} that is not a string"
                ));
            }
        }
        Ok(())
    }

    /// A chunk read as a tree ([`Payload::Json`], or a text the typed view did not answer
    /// for): a provider error is forwarded and ends the stream, a chunk that breaks the
    /// structure rules fails it, any other is read like a text ([`Self::read`]).
    fn push_tree(&mut self, raw: Bytes, tree: Value, out: &mut Vec<Bytes>) {
        if self.done_seen {
            return self.violate("an event after `[DONE]`".into());
        }
        if tree.get("error").is_some_and(|e| !e.is_null()) {
            // A provider error mid-stream: nothing held is released.
            self.failed = true;
            self.held.clear();
            out.push(raw);
            return;
        }
        if let Err(why) = Self::check_structure(&tree) {
            return self.violate(why);
        }
        let place = self.read(&Chunk::of_tree(&tree));
        if let Some(place) = place {
            self.place(raw, Json::Tree(tree), place, out);
        }
    }

    /// Reads a chunk into the stream's state (usage, each choice's calls, role, refusal and
    /// finish) and says where it goes; `None` when nothing of it goes anywhere (a violation,
    /// or the usage chunk turnguard asked for itself).
    fn read(&mut self, chunk: &Chunk<'_>) -> Option<Place> {
        if self.done_seen {
            self.violate("an event after `[DONE]`".into());
            return None;
        }
        for c in chunk.choices.iter().flatten() {
            if c.finish_reason.is_some()
                && self
                    .choices
                    .get(&c.index)
                    .is_some_and(|a| a.finish_reason.is_some())
            {
                self.violate(format!("a second `finish_reason` for choice {}", c.index));
                return None;
            }
        }
        if let Some(tokens) = chunk.usage {
            // Usage decides only when the request set a limit; then the decision waited for
            // the usage chunk (or `[DONE]`), so a later, larger count contradicts it.
            if self.decided && self.needs_usage && tokens > self.decided_tokens {
                self.violate(
                    "a usage after the decision point reports more tokens than the decision read"
                        .into(),
                );
                return None;
            }
            self.usage_seen = true;
            self.usage_tokens = self.usage_tokens.max(tokens);
            if chunk.choices.as_ref().is_some_and(Vec::is_empty) {
                self.usage_final = true;
                if self.own_usage {
                    return None; // turnguard asked for it; the agent did not
                }
            }
        }
        let Some(choices) = chunk.choices.as_deref() else {
            return Some(Place::Other);
        };
        let has_calls = choices.iter().any(DeltaChoice::has_calls);
        if self.decided && has_calls {
            // Fail closed: a call after the decision point is never released unadmitted.
            return Some(Place::Strip);
        }
        let mut entries = Vec::new();
        let mut finishes_held_choice = false;
        for (cpos, c) in choices.iter().enumerate() {
            let acc = self.choices.entry(c.index).or_default();
            finishes_held_choice |= accumulate_choice(acc, cpos, c, &mut entries);
            if acc.tool_calls_seen && acc.function_call_seen {
                // The SDKs keep the two apart, each with its own arguments; one call read
                // from both would be judged on arguments no call the agent gets carries.
                self.violate(format!(
                    "choice {} streams both `tool_calls` and a legacy `function_call`",
                    c.index
                ));
                return None;
            }
        }
        if !has_calls && !finishes_held_choice {
            return Some(Place::Other);
        }
        // Text that rides along with call deltas is split off so text is never delayed; the
        // held part then carries no role.
        let split = has_calls && choices.iter().any(DeltaChoice::carries_text);
        let roles = if split {
            Vec::new()
        } else {
            choices.iter().filter(|c| c.role).map(|c| c.index).collect()
        };
        Some(Place::Hold {
            entries,
            roles,
            split,
        })
    }

    /// Forwards, holds or rewrites a chunk where [`Self::read`] placed it.
    fn place(&mut self, raw: Bytes, json: Json, place: Place, out: &mut Vec<Bytes>) {
        let (entries, split) = match place {
            Place::Other => return self.push_other(raw, out),
            Place::Hold {
                entries,
                roles,
                split: false,
            } => {
                return self.held.push(Held {
                    raw,
                    json: Some(json),
                    entries,
                    roles,
                })
            }
            Place::Hold { entries, .. } => (entries, true),
            Place::Strip => (Vec::new(), false),
        };
        let mut chunk = match json.into_tree() {
            Ok(tree) => tree,
            Err(e) => return self.violate(e.to_string()),
        };
        if split {
            let mut text_only = chunk.clone();
            strip_calls(&mut text_only);
            remove_finish(&mut text_only);
            out.push(encode(&text_only));
            keep_only_calls_and_finish(&mut chunk);
            self.held.push(Held {
                raw: encode(&chunk),
                json: Some(Json::Tree(chunk)),
                entries,
                roles: Vec::new(),
            });
        } else {
            strip_calls(&mut chunk);
            out.push(encode(&chunk));
        }
    }

    /// A chunk with nothing to admit: forwarded now, unless it belongs after a held finish
    /// (usage and trailing chunks keep their place behind the held calls).
    fn push_other(&mut self, raw: Bytes, out: &mut Vec<Bytes>) {
        let finish_pending = self.choices.values().any(|c| c.finish_held);
        if self.holding() && finish_pending {
            self.held.push(Held::in_place(raw));
        } else {
            out.push(raw);
        }
    }

    /// Drops what is held and ends the agent's stream with an error event of `kind`/`code`
    /// (`data: {"error": {message, type, code, param}}`, no `event:` line).
    fn error_event(&mut self, kind: &str, code: &str, message: &str, out: &mut Vec<Bytes>) {
        self.held.clear();
        self.decided = true;
        let body =
            json!({ "error": { "message": message, "type": kind, "code": code, "param": null } });
        out.push(sse::encode(None, &crate::strict_json::to_text(&body)));
    }
}

impl ProviderStream for ChatStream {
    /// The provider reported an error in the stream.
    fn failed(&self) -> bool {
        self.failed
    }

    /// Chunks are read from their text through a typed view (`provider::chat_chunk`).
    fn reads_text(&self) -> bool {
        true
    }

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
    /// that does not identify each call uniquely or that contradicts what was decided: a
    /// choice without an integer `index` or twice in one chunk, a `tool_calls` entry without a
    /// non-negative integer `index`, a `delta` or a `function_call` that is not an object, a
    /// choice that streams both `tool_calls` entries and a legacy `function_call` (the SDKs
    /// keep them apart, so no one call carries what the two would be read as), a second
    /// `finish_reason` for a choice, a usage that reports more tokens after the decision than
    /// the decision read, an event after `[DONE]`, or ([`Payload::Text`]) a text that is not
    /// a JSON object serde_json reads. A text is read through the typed view of
    /// `provider::chat_chunk`, or through its tree where the view does not answer.
    fn push(&mut self, event: Event, out: &mut Vec<Bytes>) {
        if self.violation.is_some() {
            return;
        }
        let Event { block, payload } = event;
        let raw = block.raw;
        match payload {
            Payload::None => out.push(raw), // comment / keep-alive
            Payload::Done => {
                self.done_seen = true;
                if self.holding() {
                    self.held.push(Held::in_place(raw));
                } else {
                    out.push(raw);
                }
            }
            Payload::Json(tree) => self.push_tree(raw, tree, out),
            Payload::Text => {
                let text = block.data.unwrap_or_default();
                let place = match Chunk::of_text(&text) {
                    Some(chunk) => self.read(&chunk),
                    None => {
                        return match sse::read_object(&text) {
                            Ok(tree) => self.push_tree(raw, tree, out),
                            Err(e) => self.violate(e.to_string()),
                        }
                    }
                };
                if let Some(place) = place {
                    self.place(raw, Json::Text(text), place, out);
                }
            }
            Payload::Body => self.violate("a whole body inside a stream".into()),
        }
    }

    /// The completion state of every choice with calls is known: each has its finish reason
    /// and, when the request set a token limit and usage follows, the usage chunk arrived (or
    /// the stream ended with `[DONE]`).
    fn ready(&self) -> bool {
        if !self.holding() || self.failed || self.violation.is_some() {
            return false;
        }
        if self.done_seen {
            return true;
        }
        let all_finished = self
            .choices
            .values()
            .filter(|c| !c.calls.is_empty())
            .all(|c| c.finish_reason.is_some());
        all_finished && (!self.needs_usage || self.usage_final)
    }

    /// Every choice's finish reason is known (a stream that ends now is not cut).
    fn finished(&self) -> bool {
        self.failed
            || self.done_seen
            || (!self.choices.is_empty()
                && self.choices.values().all(|c| c.finish_reason.is_some()))
    }

    /// The emissions to admit, one entry per choice with calls.
    fn round(&self) -> Vec<ChoiceEmissions> {
        let used = if self.usage_seen {
            self.usage_tokens
        } else {
            None
        };
        self.choices
            .iter()
            .filter(|(_, c)| !c.calls.is_empty())
            .map(|(&index, c)| ChoiceEmissions {
                output: Vec::new(),
                choice: index,
                text: None,
                provider_output: false,
                completion: classify(
                    c.finish_reason.as_deref(),
                    c.refused,
                    used,
                    self.max_output_tokens,
                ),
                calls: c.calls.iter().map(|a| a.call.clone()).collect(),
            })
            .collect()
    }

    /// Completion of every choice seen, for the journal.
    fn completions(&self) -> Vec<Completion> {
        let used = if self.usage_seen {
            self.usage_tokens
        } else {
            None
        };
        self.choices
            .values()
            .map(|c| {
                classify(
                    c.finish_reason.as_deref(),
                    c.refused,
                    used,
                    self.max_output_tokens,
                )
            })
            .collect()
    }

    /// Emits the held chunks with the verdicts applied; later chunks flow through.
    fn release(&mut self, verdicts: &[ChoiceVerdict], out: &mut Vec<Bytes>) {
        self.decided = true;
        self.decided_tokens = self.usage_tokens;
        if self.releases_unchanged(verdicts) {
            // What the rewrite would produce: every held chunk's own bytes.
            out.extend(std::mem::take(&mut self.held).into_iter().map(|h| h.raw));
        } else {
            self.rewrite_held(verdicts, out);
        }
    }

    /// The upstream stream was cut: drop what is held and end the agent's stream with a
    /// provider-shaped error (the openai SDK raises on a `data: {"error": …}` event).
    fn cut(&mut self, reason: &str, out: &mut Vec<Bytes>) {
        self.error_event(
            "upstream_stream_interrupted",
            "turnguard.upstream_stream_cut",
            &format!("turnguard: the upstream stream ended early ({reason}); withheld tool calls were not released"),
            out,
        );
    }

    /// Drops what is held (the round is being repaired); the next round's events follow,
    /// spliced by a [`ChatSplice`].
    fn abandon(&mut self) -> Splice {
        // The choices whose `delta.role` was only in a held chunk: the agent never got it, so
        // the repair round's stream must carry it (openai-node requires a role per choice).
        let owed = self
            .held
            .iter()
            .flat_map(|h| h.roles.iter().copied())
            .collect();
        self.held.clear();
        self.decided = true;
        Splice::new(ChatSplice { owed_roles: owed })
    }

    /// Drops what is held and ends the agent's stream with a Chat error chunk of type
    /// `turnguard_refused` carrying the OpenWOP `code` (the openai SDKs raise on a
    /// `data: {"error": …}` event).
    fn fail(&mut self, code: &str, message: &str, out: &mut Vec<Bytes>) {
        self.error_event("turnguard_refused", code, message, out);
    }

    /// Chat stores no responses.
    fn response_link(&self) -> Option<ResponseLink> {
        None
    }

    /// The first choice's `delta.content` (wire-formats.md §2).
    fn answer_text<'a>(&'a self, event: &'a Event) -> Option<&'a str> {
        event
            .json()?
            .at("/choices/0/delta/content")
            .and_then(Value::as_str)
    }

    /// `data: [DONE]`, Chat's end sentinel.
    fn is_terminal(&self, event: &Event) -> bool {
        matches!(event.payload, Payload::Done)
    }
}

/// A choice's `index`, when it is a non-negative integer that fits a choice number.
pub(super) fn choice_index(c: &Value) -> Option<u32> {
    c.get("index")
        .and_then(Value::as_u64)
        .and_then(|i| u32::try_from(i).ok())
}

/// Accumulates one choice of a chunk into its accumulator: role, refusal, each `tool_calls`
/// entry (into its call slot, `entries` gets `(choice position, entry position, slot)`), a
/// legacy `function_call`, the finish reason. True when it finishes a choice with calls.
fn accumulate_choice(
    acc: &mut ChoiceAcc,
    cpos: usize,
    c: &DeltaChoice<'_>,
    entries: &mut Vec<(usize, usize, usize)>,
) -> bool {
    let mut finishes_held_choice = false;
    acc.role_seen |= c.role;
    acc.refused |= c.refusal;
    for (epos, e) in c.tool_calls.iter().enumerate() {
        acc.tool_calls_seen = true;
        let wire_index = e.index;
        let id = e.id.as_deref();
        let current = acc.calls.iter().rposition(|a| a.wire_index == wire_index);
        // A new id on an index already in use is a new call (some compatible servers
        // send parallel calls all on index 0): keep them apart, never glue them.
        let slot = match (current, id) {
            (Some(p), Some(id))
                if acc
                    .calls
                    .get(p)
                    .is_some_and(|a| !a.call.id.is_empty() && a.call.id != id) =>
            {
                None
            }
            (p, _) => p,
        };
        let slot = match slot {
            Some(p) => p,
            None => {
                acc.calls.push(CallAcc {
                    wire_index,
                    call: ToolCall {
                        input: crate::model::CallInput::Json,
                        id: String::new(),
                        name: String::new(),
                        arguments: String::new(),
                    },
                });
                acc.calls.len() - 1
            }
        };
        let Some(CallAcc { call, .. }) = acc.calls.get_mut(slot) else {
            continue;
        };
        if let Some(id) = id {
            if call.id.is_empty() {
                call.id = id.to_owned();
            }
        }
        append(call, &e.function);
        entries.push((cpos, epos, slot));
    }
    if let Some(fc) = &c.function_call {
        // Legacy `function_call` streaming: one call per choice.
        acc.function_call_seen = true;
        if acc.calls.is_empty() {
            acc.calls.push(CallAcc {
                wire_index: u64::MAX,
                call: ToolCall {
                    input: crate::model::CallInput::Json,
                    id: "function_call".into(),
                    name: String::new(),
                    arguments: String::new(),
                },
            });
        }
        if let Some(CallAcc { call, .. }) = acc.calls.first_mut() {
            append(call, fc);
        }
    }
    if let Some(r) = &c.finish_reason {
        acc.finish_reason = Some(r.clone().into_owned());
        if !acc.calls.is_empty() {
            acc.finish_held = true;
            finishes_held_choice = true;
        }
    }
    finishes_held_choice
}

/// Appends a fragment's name and arguments to the call they continue.
fn append(call: &mut ToolCall, f: &FunctionDelta<'_>) {
    if let Some(n) = &f.name {
        call.name.push_str(n);
    }
    if let Some(a) = &f.arguments {
        call.arguments.push_str(a);
    }
}

/// Where one held choice's calls go when released: the chunk's choice position, the held
/// chunk's `(choice position, entry position, slot)` entries, each slot's emitted index
/// (`None`: withheld), the choice's accumulator and index.
struct Slots<'a> {
    cpos: usize,
    entries: &'a [(usize, usize, usize)],
    emitted: &'a [Option<u64>],
    acc: &'a ChoiceAcc,
    index: u32,
}

impl Slots<'_> {
    /// Rewrites one held choice's `tool_calls` entries: withheld calls dropped, released
    /// calls renumbered to their emitted index, a replaced call's arguments carried by its
    /// first fragment only. True when anything changed.
    fn rewrite(
        &self,
        list: &mut Vec<Value>,
        replace: &BTreeMap<(u32, usize), &str>,
        replaced_once: &mut std::collections::BTreeSet<(u32, usize)>,
    ) -> bool {
        let mut changed = false;
        let mut keep = Vec::new();
        for (epos, mut e) in std::mem::take(list).into_iter().enumerate() {
            let slot = self
                .entries
                .iter()
                .find(|(cp, ep, _)| *cp == self.cpos && *ep == epos)
                .map(|(_, _, s)| *s);
            match slot.and_then(|s| self.emitted.get(s).copied().flatten().map(|ix| (s, ix))) {
                Some((s, ix)) => {
                    if let Some(args) = replace.get(&(self.index, s)) {
                        changed = true;
                        if !replaced_once.insert((self.index, s)) {
                            continue; // later fragments of a replaced call
                        }
                        set_arguments(&mut e, args);
                    }
                    if self.acc.calls.get(s).is_some_and(|a| a.wire_index != ix) {
                        set(&mut e, "index", json!(ix));
                        changed = true;
                    }
                    keep.push(e);
                }
                None => changed = true,
            }
        }
        *list = keep;
        changed
    }
}

/// The `choices` entries of a chunk (none when it has no `choices` array).
fn choices_mut(chunk: &mut Value) -> impl Iterator<Item = &mut Value> {
    chunk
        .get_mut("choices")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
}

fn strip_calls(chunk: &mut Value) {
    for c in choices_mut(chunk) {
        if let Some(d) = c.get_mut("delta").and_then(Value::as_object_mut) {
            d.remove("tool_calls");
            d.remove("function_call");
        }
    }
}

fn remove_finish(chunk: &mut Value) {
    for c in choices_mut(chunk) {
        if c.get("finish_reason").is_some() {
            set(c, "finish_reason", Value::Null);
        }
    }
}

/// Sets `key` of `v` when `v` is an object (indexing a `Value` that is not one panics).
fn set(v: &mut Value, key: &str, value: Value) {
    if let Some(obj) = v.as_object_mut() {
        obj.insert(key.to_owned(), value);
    }
}

/// Sets `function.arguments` of a tool-call entry, making `function` an object when the
/// upstream sent something else there.
fn set_arguments(call: &mut Value, args: &str) {
    let Some(obj) = call.as_object_mut() else {
        return;
    };
    let function = obj.entry("function").or_insert_with(|| json!({}));
    if !function.is_object() {
        *function = json!({});
    }
    set(function, "arguments", json!(args));
}

fn keep_only_calls_and_finish(chunk: &mut Value) {
    for c in choices_mut(chunk) {
        if let Some(d) = c.get_mut("delta").and_then(Value::as_object_mut) {
            d.retain(|k, _| k == "tool_calls" || k == "function_call");
        }
    }
}

fn encode(chunk: &Value) -> Bytes {
    sse::encode(None, &crate::strict_json::to_text(chunk))
}

/// A chunk carrying host-authored `text` as content for choice `index`; `with_role` when no
/// earlier chunk of the choice carried the role.
fn text_chunk(template: &Value, index: u32, text: &str, with_role: bool) -> Bytes {
    let mut chunk = Map::new();
    if let Some(obj) = template.as_object() {
        for (k, v) in obj {
            match k.as_str() {
                "choices" | "obfuscation" => {}
                "usage" => {
                    chunk.insert(k.clone(), Value::Null);
                }
                _ => {
                    chunk.insert(k.clone(), v.clone());
                }
            }
        }
    }
    let delta = if with_role {
        json!({ "role": "assistant", "content": text })
    } else {
        json!({ "content": text })
    };
    chunk.insert(
        "choices".into(),
        json!([{ "index": index, "delta": delta, "finish_reason": null }]),
    );
    encode(&Value::Object(chunk))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Decision, Outcome, Stage, Surfacing};

    /// A stream that read `chunks` (each one `data:` event) and holds a decided round.
    fn holding(chunks: &[Value]) -> ChatStream {
        let turn = OpenAiChat
            .parse_request(&json!({"model": "m", "stream": true, "messages": []}))
            .unwrap();
        let mut stream = ChatStream::new(&turn);
        let mut framer = crate::sse::SseFramer::new(1 << 20);
        let mut forwarded = Vec::new();
        for c in chunks {
            for block in framer
                .push(&crate::sse::encode(None, &c.to_string()))
                .unwrap()
            {
                stream.push(crate::sse::Event::classify(block).unwrap(), &mut forwarded);
            }
        }
        assert!(stream.violation().is_none(), "{:?}", stream.violation());
        assert!(stream.ready(), "the round is not complete");
        stream
    }

    fn chunk(choices: Value) -> Value {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices})
    }

    fn delta(index: u32, calls: Value) -> Value {
        chunk(json!([{"index": index, "delta": {"tool_calls": calls}, "finish_reason": null}]))
    }

    fn finish(index: u32) -> Value {
        chunk(json!([{"index": index, "delta": {}, "finish_reason": "tool_calls"}]))
    }

    /// Per call of the round: released or not, and the arguments a release replaces.
    type Plan = fn(u32, usize) -> (bool, Option<&'static str>, Surfacing);

    fn verdicts(stream: &ChatStream, plan: Plan) -> Vec<ChoiceVerdict> {
        stream
            .round()
            .iter()
            .map(|c| {
                let mut surfacing = Surfacing::Release;
                let decisions = (0..c.calls.len())
                    .map(|i| {
                        let (released, args, s) = plan(c.choice, i);
                        surfacing = s;
                        let mut d = Decision::new(
                            if released {
                                Outcome::Executed
                            } else {
                                Outcome::Refused
                            },
                            Stage::Name,
                            crate::reason::Reason::Released,
                            String::new(),
                        );
                        d.release_args = args.map(str::to_owned);
                        d
                    })
                    .collect();
                ChoiceVerdict {
                    choice: c.choice,
                    decisions,
                    surfacing,
                    claims: Vec::new(),
                }
            })
            .collect()
    }

    #[test]
    fn an_unchanged_release_is_the_rewrite_of_nothing() {
        let one_call = vec![
            delta(
                0,
                json!([{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]),
            ),
            delta(
                0,
                json!([{"index": 0, "function": {"arguments": "{\"location\":"}}]),
            ),
            delta(
                0,
                json!([{"index": 0, "function": {"arguments": "\"Paris\"}"}}]),
            ),
            finish(0),
        ];
        let two_calls = vec![
            delta(
                0,
                json!([{"index": 0, "id": "call_a", "type": "function", "function": {"name": "a", "arguments": "{}"}}]),
            ),
            delta(
                0,
                json!([{"index": 1, "id": "call_b", "type": "function", "function": {"name": "b", "arguments": "{"}}]),
            ),
            delta(0, json!([{"index": 1, "function": {"arguments": "}"}}])),
            finish(0),
        ];
        let text_alongside = vec![
            chunk(
                json!([{"index": 0, "delta": {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "a", "arguments": "{}"}}
            ]}, "finish_reason": null}]),
            ),
            finish(0),
        ];
        // Some compatible servers send parallel calls all on index 0: the second is renumbered.
        let same_index = vec![
            delta(
                0,
                json!([{"index": 0, "id": "call_a", "type": "function", "function": {"name": "a", "arguments": "{}"}}]),
            ),
            delta(
                0,
                json!([{"index": 0, "id": "call_b", "type": "function", "function": {"name": "b", "arguments": "{}"}}]),
            ),
            finish(0),
        ];
        let legacy = vec![
            chunk(
                json!([{"index": 0, "delta": {"function_call": {"name": "a", "arguments": "{}"}}, "finish_reason": null}]),
            ),
            chunk(json!([{"index": 0, "delta": {}, "finish_reason": "function_call"}])),
        ];
        let all: Plan = |_, _| (true, None, Surfacing::Release);
        let second_withheld: Plan = |_, i| (i == 0, None, Surfacing::Drop);
        let replaced: Plan = |_, _| (true, Some("{\"location\":\"Lyon\"}"), Surfacing::Release);
        let ended: Plan = |_, _| {
            (
                false,
                None,
                Surfacing::EndTurn("[turnguard] withheld".into()),
            )
        };
        let ended_releasing: Plan = |_, _| {
            (
                true,
                None,
                Surfacing::EndTurn("[turnguard] withheld".into()),
            )
        };
        // (script, plan, whether the release takes the held bytes as they are)
        let cases: Vec<(&str, &[Value], Plan, bool)> = vec![
            ("one call", &one_call, all, true),
            ("two calls", &two_calls, all, true),
            ("text alongside", &text_alongside, all, true),
            ("same index", &same_index, all, false),
            ("legacy function_call", &legacy, all, false),
            ("second withheld", &two_calls, second_withheld, false),
            ("replaced arguments", &one_call, replaced, false),
            ("ended turn", &one_call, ended, false),
            (
                "ended turn, calls released",
                &one_call,
                ended_releasing,
                false,
            ),
        ];
        for (name, script, plan, unchanged) in cases {
            let (mut released, mut rewritten) = (holding(script), holding(script));
            let v = verdicts(&released, plan);
            assert_eq!(released.releases_unchanged(&v), unchanged, "{name}");
            let (mut a, mut b) = (Vec::new(), Vec::new());
            released.release(&v, &mut a);
            rewritten.rewrite_held(&v, &mut b);
            assert_eq!(a, b, "{name}: the release is not what the rewrite gives");
            if unchanged {
                let held: Vec<Bytes> = holding(script).held.into_iter().map(|h| h.raw).collect();
                assert_eq!(a, held, "{name}");
            }
        }
    }
}
