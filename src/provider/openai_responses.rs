//! OpenAI Responses (`POST /v1/responses`): requests, JSON responses and the SSE stream, into
//! and out of the neutral model. Wire facts are from `shared/reference/wire-formats.md` §1, §4.
//!
//! Output items fall in three kinds:
//! - **client calls**, which the agent executes and admission decides: `function_call` (the
//!   `tool` channel of contract §A), `custom_tool_call` (a free-form tool's raw-text input,
//!   checked against its declared `format`), a `tool_search_call` the client runs
//!   (`execution: "client"`), and, fail closed, the other client-executed call items
//!   (`computer_call`, `local_shell_call`, `shell_call`, `apply_patch_call`). Admission has no
//!   declared tool for those last ones, so they are withheld at the name stage rather than
//!   released unadmitted. A call's identity is its name qualified by its `namespace`
//!   (`functions.exec`), as its tool was declared ([`declare_tools`]);
//! - **model output**: `message`, `reasoning` (passed through; text is never a call);
//! - **provider-executed** items (`web_search_call`, `file_search_call`,
//!   `code_interpreter_call`, `image_generation_call`, `mcp_call`, `mcp_list_tools`,
//!   `mcp_approval_request`, and any type this module does not know): passed through
//!   unchanged, never admitted as calls (the provider already ran them), and recorded as
//!   untrusted output for the response chain ([`ResponseLink`], contract §C, §F).
//!
//! A call has two ids: the item `id` (`fc_…`), which keys the stream's argument deltas, and
//! the `call_id` (`call_…`), which the agent's `function_call_output` refers to. The neutral
//! [`ToolCall::id`] is the `call_id`; the stream state keys items by `output_index` and `id`.
//!
//! Stream rule: events pass through as received until the first client-call item starts
//! (`response.output_item.added`). From then on every event is held, in order (the SDK
//! requires each item's `output_index` to be added before its events and the
//! `sequence_number`s to rise), until the terminal event (`response.completed`,
//! `.incomplete`, `.failed`) gives the completion state. Then the calls are admitted and the
//! held events released byte for byte, or rewritten: a withheld call item loses all of its
//! events and its entry in the terminal `response.output`, later items' `output_index` close
//! the gap, a host-authored `message` item explaining why is streamed before the terminal
//! event (and added to its `output`), `response.incomplete` becomes `response.completed`, and
//! from the first change on every event is renumbered (`sequence_number` = the previous one
//! sent + 1) so the numbers stay consecutive. Events turnguard did not change keep their exact bytes; keep-alive comments
//! and unknown events pass through.
//!
//! Provider-held state, which this adapter can only record, not see:
//! - `previous_response_id` means the provider holds earlier turns;
//!   [`Turn::previous_response_id`] carries it and the journal records every response id
//!   ([`response_link`]) so the trust stage judges the chain from turnguard's own journal
//!   (rule in [`crate::admission::trust`]; unknown chain: untrusted). The Conversations API's
//!   `conversation` also means provider-held turns, which turnguard never journals: such a
//!   turn is untrusted (fail closed).
//! - A call turnguard withholds is still in the provider's stored response (`store: true`).
//!   A later request that continues from it without a `function_call_output` for that
//!   `call_id` is expected to be refused by the provider (an output is owed for every call);
//!   that error passes through unchanged. Supplying a host-authored output for the withheld
//!   call (its `call_id` is in the journal's `tool_calls`) is left to the replay/repair work.
//! - A streamed repair round is spliced into the agent's response ([`ResponsesSplice`]): the
//!   agent keeps the first round's response id, while the provider's state of the
//!   conversation is the repair round's response (journaled under its own id). Continuing
//!   from the id the agent saw would reach the first round's stored calls; mapping it to the
//!   repair round's id is left with the item above.
//! - `background: true` responses are fetched later with `GET /v1/responses/{id}`, which
//!   turnguard does not serve (it would release calls unadmitted): background polling fails
//!   closed with 404; background *streaming* goes through this adapter like any stream.

use crate::strict_json::Lookup as _;
use crate::strict_json::{RequestBody, ToolsMember};
use std::collections::{BTreeMap, BTreeSet, HashMap};

use bytes::Bytes;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::{CallNames, Provider, ProviderStream, Splice, SpliceState};
use crate::model::{
    qualified_name, AnswerContext, Api, CallInput, ChoiceEmissions, ChoiceVerdict, Completion,
    CompletionState, DeclaredSchemas, DeclaredTool, FreeformFormat, RepairItem, ResponseLink,
    ToolCall, ToolResultSeen, Turn, UntrustedKind,
};
use crate::sse::{self, Event, Payload};

/// The Responses adapter ([`crate::provider::adapter`] of [`Api::OpenAiResponses`]).
#[derive(Debug, Clone, Copy)]
pub struct OpenAiResponses;

impl Provider for OpenAiResponses {
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

    /// One: a response has one output list.
    fn choices_requested(&self, _body: &Value) -> u64 {
        1
    }

    /// Nothing to prepare: the terminal event always carries `usage`.
    fn prepare_upstream(&self, _body: &mut RequestBody, _turn: &mut Turn) -> bool {
        false
    }

    /// See [`response_link`].
    fn response_link(&self, body: &Value, ctx: &AnswerContext) -> Option<ResponseLink> {
        response_link(body, ctx)
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

    /// See [`append_text_repair`]: the transcript is `input`.
    fn append_text_repair(&self, body: &mut Value, answer: &str, feedback: &str) {
        append_text_repair(body, answer, feedback);
    }

    /// A [`ResponsesStream`], continuing the agent's response as a [`ResponsesSplice`] says
    /// (this adapter splices itself).
    fn stream(&self, turn: &Turn, splice: Option<&Splice>) -> Box<dyn ProviderStream> {
        Box::new(match splice.and_then(Splice::state::<ResponsesSplice>) {
            Some(s) => ResponsesStream::continuing(turn, s),
            None => ResponsesStream::new(turn),
        })
    }
}

/// Output item types the agent (client) executes: each is a call admission decides.
const CLIENT_CALLS: [&str; 6] = [
    "function_call",
    "custom_tool_call",
    "computer_call",
    "local_shell_call",
    "shell_call",
    "apply_patch_call",
];

/// Output item types that are the model's own output (neither a call nor provider-executed).
const MODEL_ITEMS: [&str; 2] = ["message", "reasoning"];

/// Terminal events of a Responses stream (`error` is handled apart: it fails the stream).
const TERMINAL: [&str; 3] = [
    "response.completed",
    "response.incomplete",
    "response.failed",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Model,
    Call,
    Provider,
}

fn kind_of(ty: &str) -> Kind {
    if CLIENT_CALLS.contains(&ty) {
        Kind::Call
    } else if MODEL_ITEMS.contains(&ty) {
        Kind::Model
    } else {
        // Built-in tools the provider ran, and anything unknown: untrusted (fail closed).
        Kind::Provider
    }
}

/// The kind of an output (or echoed input) item: [`kind_of`] its type, except that a
/// `tool_search_call` is a client call only when the client runs it (`execution: "client"`,
/// Codex's deferred tools); a provider-run search is provider output.
fn item_kind(item: &Value) -> Kind {
    match item_type(item) {
        "tool_search_call" if str_of(item, "execution") == Some("client") => Kind::Call,
        "tool_search_call" => Kind::Provider,
        ty => kind_of(ty),
    }
}

fn item_type(item: &Value) -> &str {
    item.get("type")
        .and_then(Value::as_str)
        .unwrap_or("message")
}

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// Sets `key` of `v` when `v` is an object (indexing a `Value` that is not one panics).
fn set(v: &mut Value, key: &str, value: Value) {
    if let Some(obj) = v.as_object_mut() {
        obj.insert(key.to_owned(), value);
    }
}

/// Tool types the agent (client) runs: `function`, free-form `custom` tools and the
/// client-executed built-ins. Every other tool type is one the provider runs itself
/// (`web_search*`, `file_search`, `code_interpreter`, `image_generation`, `mcp` …, and any
/// type turnguard does not know): its output reaches the model in this very turn.
const CLIENT_TOOLS: [&str; 6] = [
    "function",
    "custom",
    "local_shell",
    "shell",
    "apply_patch",
    "computer_use_preview",
];

/// Output item types the provider executed or holds that an agent may echo back in `input`.
const PROVIDER_ITEMS: [&str; 7] = [
    "web_search_call",
    "file_search_call",
    "code_interpreter_call",
    "image_generation_call",
    "mcp_call",
    "mcp_list_tools",
    "mcp_approval_request",
];

/// Longest stored item id the journal keeps for `item_reference` lookups (characters).
const MAX_ITEM_ID: usize = 256;

/// Reads a Responses request body: `body`'s tree and its top-level `tools` member, which
/// `tools` gives ([`RequestBody::tools`]: the tree lacks it while the body shares its tools).
///
/// Errors: a human-readable reason naming the offending field.
fn parse_request(
    body: &Value,
    tools: Option<ToolsMember<'_>>,
    schemas: &dyn DeclaredSchemas,
) -> Result<Turn, String> {
    let obj = body.as_object().ok_or("the body must be a JSON object")?;
    let items: &[Value] = match obj.get("input") {
        None | Some(Value::Null) | Some(Value::String(_)) => &[],
        Some(Value::Array(items)) => items,
        Some(_) => return Err("`input` must be a string or an array of items".into()),
    };
    let previous_response_id = match obj.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err("`previous_response_id` must be a string".into()),
    };
    let stream = obj.get("stream").and_then(Value::as_bool) == Some(true);
    let mut turn = Turn {
        item_references: Vec::new(),
        api: Api::OpenAiResponses,
        model: str_of(body, "model").map(str::to_owned),
        stream,
        tools: Vec::new(),
        tool_results: Vec::new(),
        max_output_tokens: obj.get("max_output_tokens").and_then(Value::as_u64),
        include_usage: true,
        round_index: 0,
        prior_calls: Vec::new(),
        untrusted_inputs: Vec::new(),
        usage_for_turnguard: false,
        previous_response_id,
        provider_delegations: Vec::new(),
        // Streamed argument deltas are forwarded as they arrive: this adapter cannot
        // rewrite them.
        arguments_fixed: stream,
    };
    match tools {
        None | Some(ToolsMember::Other(Value::Null)) => {}
        Some(ToolsMember::Other(_)) => return Err("`tools` must be an array".into()),
        Some(ToolsMember::Array(list)) => declare_tools(&mut turn, list, None, "tools", schemas)?,
    }
    // The provider holds the turns before `previous_response_id`, which this request does not
    // show: the trust stage judges them from turnguard's journal of that response chain
    // (`crate::admission::trust::chain_fault`). A Conversations API `conversation` also holds
    // earlier turns on the provider, but turnguard journals no conversation, so that history
    // is always unknown: untrusted (fail closed). So is a stored `prompt`, which turnguard
    // never sees.
    for held in ["conversation", "prompt"] {
        if obj.get(held).is_some_and(|c| !c.is_null()) {
            turn.untrusted(UntrustedKind::ProviderFetched, held);
        }
    }
    let mut calls = CallNames::default();
    let mut in_model_turn = false;
    for (i, item) in items.iter().enumerate() {
        if !item.is_object() {
            return Err(format!("`input[{i}]` must be an object"));
        }
        let ty = item_type(item);
        // A model turn is a run of assistant messages, reasoning, calls and provider items.
        let from_model = match ty {
            "message" => str_of(item, "role") == Some("assistant"),
            "reasoning" => true,
            "item_reference" | "mcp_approval_response" | "additional_tools" => false,
            t => !t.ends_with("_output") && item_kind(item) != Kind::Model,
        };
        if from_model && !in_model_turn {
            turn.round_index = turn.round_index.saturating_add(1);
        }
        in_model_turn = from_model;
        read_item(&mut turn, &mut calls, i, item, ty, schemas)?;
    }
    Ok(turn)
}

/// Reads one input item of type `ty` at `input[i]` into the turn: a message's role and
/// parts, declared tools (`additional_tools`, a client tool search's output), a call, a
/// client tool's result, an `item_reference` (untrusted until the journal says otherwise),
/// provider-executed items (untrusted), anything else (untrusted, never skipped).
///
/// Errors: a malformed `tools` list, or a tool result without a string `call_id`.
/// A client tool's output item (`function_call_output`, `custom_tool_call_output` …): the
/// result of the call it names, judged part by part when it is a list of parts; an output of
/// any other shape than text or parts is untrusted.
fn read_output(
    turn: &mut Turn,
    calls: &CallNames,
    i: usize,
    item: &Value,
    ty: &str,
) -> Result<(), String> {
    let call_id = str_of(item, "call_id")
        .ok_or_else(|| format!("`input[{i}]` ({ty}) needs a string `call_id`"))?;
    turn.tool_results.push(ToolResultSeen {
        tool_call_id: call_id.to_owned(),
        tool_name: calls.name_of(call_id),
        content: item.get("output").cloned().unwrap_or(Value::Null),
        is_error: false,
    });
    match item.get("output") {
        None | Some(Value::String(_)) => {}
        Some(Value::Array(_)) => {
            judge_parts(turn, item.get("output"), &format!("input[{i}].output"));
        }
        // An object (a `computer_call_output` screenshot) or anything else: content
        // turnguard does not read part by part.
        Some(_) => turn.untrusted(UntrustedKind::Unrecognised, format!("input[{i}].output")),
    }
    Ok(())
}

fn read_item(
    turn: &mut Turn,
    calls: &mut CallNames,
    i: usize,
    item: &Value,
    ty: &str,
    schemas: &dyn DeclaredSchemas,
) -> Result<(), String> {
    let at = || format!("input[{i}]");
    match ty {
        "message" => {
            match str_of(item, "role") {
                Some("user" | "system" | "developer" | "assistant") => {}
                other => turn.untrusted(
                    UntrustedKind::Unrecognised,
                    format!(
                        "input[{i}].role `{}`",
                        crate::admission::sanitize_label(other.unwrap_or_default())
                    ),
                ),
            }
            judge_parts(turn, item.get("content"), &format!("input[{i}].content"));
        }
        "reasoning" => {}
        // Tools the host supplies in the conversation (Codex's lite shape): host input,
        // declared like `tools`, never model output.
        "additional_tools" => {
            declare_item_tools(turn, item, i, schemas)?;
        }
        // The result of a tool search the agent ran: the tools it loaded, which the
        // agent (host) supplies; declared like `tools`.
        "tool_search_output" if str_of(item, "execution") == Some("client") => {
            if let Some(call_id) = str_of(item, "call_id") {
                turn.tool_results.push(ToolResultSeen {
                    tool_call_id: call_id.to_owned(),
                    tool_name: calls.name_of(call_id),
                    content: item.get("tools").cloned().unwrap_or(Value::Null),
                    is_error: false,
                });
            }
            declare_item_tools(turn, item, i, schemas)?;
        }
        _ if item_kind(item) == Kind::Call => {
            let name = call_name(item);
            turn.prior_calls.push(name.clone());
            if let Some(call_id) = str_of(item, "call_id") {
                calls.add(turn, call_id, Some(&name), || format!("input[{i}].call_id"));
            }
        }
        t if t
            .strip_suffix("_output")
            .is_some_and(|call| CLIENT_CALLS.contains(&call)) =>
        {
            read_output(turn, calls, i, item, t)?;
        }
        // A reference to a stored item the provider fills in, which the proxy cannot read:
        // untrusted until the trust stage finds it in turnguard's journal as trusted
        // output (`Turn::resolve_references`).
        "item_reference" => {
            match str_of(item, "id").filter(|id| id.chars().count() <= MAX_ITEM_ID) {
                Some(id) => {
                    turn.item_references.push(crate::model::ItemReference {
                        id: id.to_owned(),
                        at: at(),
                    });
                    turn.untrusted(UntrustedKind::StoredItem, at());
                }
                None => turn.untrusted(UntrustedKind::ProviderOutput, at()),
            }
        }
        // Provider-executed items echoed back (`web_search_call`, `mcp_call` …) and an
        // approval that lets the provider run an MCP call: untrusted (contract §F).
        t if PROVIDER_ITEMS.contains(&t)
            || matches!(
                t,
                "mcp_approval_response" | "tool_search_call" | "tool_search_output"
            ) =>
        {
            turn.untrusted(UntrustedKind::ProviderOutput, at());
        }
        // Anything else is an item turnguard does not know: untrusted, never skipped.
        t => turn.untrusted(
            UntrustedKind::Unrecognised,
            format!("input[{i}].type `{}`", crate::admission::sanitize_label(t)),
        ),
    }
    Ok(())
}

/// Declares the tools an `input[i]` item supplies (`additional_tools`, a client
/// `tool_search_output`) like the request's own `tools`.
///
/// Errors: the item's `tools` is not an array, or [`declare_tools`]'s.
fn declare_item_tools(
    turn: &mut Turn,
    item: &Value,
    i: usize,
    schemas: &dyn DeclaredSchemas,
) -> Result<(), String> {
    let list = item
        .get("tools")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("`input[{i}].tools` must be an array"))?;
    declare_tools(turn, list, None, &format!("input[{i}].tools"), schemas)
}

/// Declares the tools of a tool list (`tools`, an `additional_tools` input item's `tools`, a
/// client `tool_search_output`'s `tools`); `at` is the list's request path.
///
/// - `function`: JSON arguments, its `parameters` the schema;
/// - `custom`: free-form input in its `format` ([`freeform_format`]);
/// - `namespace`: each of its `tools` declared under the qualified name `namespace.name`
///   ([`crate::model::qualified_name`]); a namespace inside a namespace is refused (400);
/// - `tool_search` with `execution: "client"`: the agent runs the search, a call named
///   `tool_search` with JSON arguments; any other `tool_search` the provider runs;
/// - `mcp`: a provider delegation (refused inside runs, contract §F), and provider-run;
/// - every other type the provider runs (or turnguard does not know): its output reaches the
///   model in this very turn, so the turn is untrusted (§C, §F).
///
/// Errors: a function, custom or namespace tool without a string `name`, a `namespace`
/// without a `tools` array.
fn declare_tools<'a>(
    turn: &mut Turn,
    list: impl IntoIterator<Item = &'a Value>,
    namespace: Option<&str>,
    at: &str,
    schemas: &dyn DeclaredSchemas,
) -> Result<(), String> {
    for (i, t) in list.into_iter().enumerate() {
        let ty = str_of(t, "type").unwrap_or_default();
        let name = || str_of(t, "name").ok_or_else(|| format!("`{at}[{i}].name` must be a string"));
        match ty {
            "function" => turn.declare(DeclaredTool::declared(
                qualified_name(namespace, name()?),
                t.get("parameters").filter(|p| !p.is_null()),
                schemas,
            )),
            "custom" => turn.declare(DeclaredTool {
                name: qualified_name(namespace, name()?),
                schema: None,
                freeform: Some(freeform_format(t.get("format"))),
                fingerprint: None,
            }),
            "namespace" if namespace.is_none() => {
                let ns = name()?;
                let nested = t
                    .get("tools")
                    .and_then(Value::as_array)
                    .ok_or_else(|| format!("`{at}[{i}].tools` must be an array"))?;
                declare_tools(
                    turn,
                    nested.iter(),
                    Some(ns),
                    &format!("{at}[{i}].tools"),
                    schemas,
                )?;
            }
            "namespace" => {
                return Err(format!(
                    "`{at}[{i}]`: a namespace inside a namespace is not a Responses tool"
                ))
            }
            "tool_search" if str_of(t, "execution") == Some("client") => {
                turn.declare(DeclaredTool::declared(
                    qualified_name(namespace, "tool_search"),
                    t.get("parameters").filter(|p| !p.is_null()),
                    schemas,
                ))
            }
            _ => {
                if ty == "mcp" {
                    // The provider would call an MCP server (or a connector) itself, on the
                    // agent's behalf (contract §F).
                    let label = str_of(t, "server_label")
                        .or_else(|| str_of(t, "connector_id"))
                        .map(crate::admission::sanitize_label)
                        .unwrap_or_else(|| "(unlabelled)".into());
                    turn.provider_delegations
                        .push(format!("{at}[{i}] (mcp, server_label {label})"));
                }
                if !CLIENT_TOOLS.contains(&ty) && !ty.starts_with("computer") {
                    // A tool the provider runs in this very turn: the model may read its
                    // output before it calls a tool (§C, §F).
                    turn.untrusted(UntrustedKind::ProviderOutput, format!("{at}[{i}]"));
                }
            }
        }
    }
    Ok(())
}

/// A custom tool's declared `format`: absent or `{"type": "text"}` is text; a `grammar` with
/// `syntax` `regex` or `lark` its definition; anything else [`FreeformFormat::Unknown`]
/// (no input passes).
fn freeform_format(format: Option<&Value>) -> FreeformFormat {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return FreeformFormat::Text;
    };
    let definition = || str_of(format, "definition").unwrap_or_default().to_owned();
    match (str_of(format, "type"), str_of(format, "syntax")) {
        (Some("text"), _) => FreeformFormat::Text,
        (Some("grammar"), Some("regex")) => FreeformFormat::Regex(definition()),
        (Some("grammar"), Some("lark")) => FreeformFormat::Lark(definition()),
        (Some("grammar"), other) => {
            FreeformFormat::Unknown(format!("grammar/{}", other.unwrap_or("(no syntax)")))
        }
        (other, _) => FreeformFormat::Unknown(other.unwrap_or("(no type)").to_owned()),
    }
}

/// Judges a message's `content` (or a call output's `output`): a string or text parts are the
/// item's own; an `input_image` or `input_file` is the item's own only inline (`data:` URL,
/// `file_data`); by URL or file id the provider fetches or holds it
/// ([`UntrustedKind::ProviderFetched`]); a part type turnguard does not know is
/// [`UntrustedKind::Unrecognised`].
fn judge_parts(turn: &mut Turn, content: Option<&Value>, at: &str) {
    let parts = match content {
        None | Some(Value::Null) | Some(Value::String(_)) => return,
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            turn.untrusted(UntrustedKind::Unrecognised, at.to_owned());
            return;
        }
    };
    for (k, p) in parts.iter().enumerate() {
        let at = || format!("{at}[{k}]");
        match str_of(p, "type") {
            Some("input_text" | "output_text" | "refusal" | "text" | "summary_text") => {}
            Some("input_audio") => {}
            Some("input_image") => {
                let inline = str_of(p, "image_url").is_some_and(|u| u.starts_with("data:"));
                if !inline || p.get("file_id").is_some_and(|f| !f.is_null()) {
                    turn.untrusted(UntrustedKind::ProviderFetched, at());
                }
            }
            Some("input_file") => {
                let inline = str_of(p, "file_data").is_some();
                let fetched = ["file_url", "file_id"]
                    .iter()
                    .any(|k| p.get(*k).is_some_and(|v| !v.is_null()));
                if !inline || fetched {
                    turn.untrusted(UntrustedKind::ProviderFetched, at());
                }
            }
            _ => turn.untrusted(UntrustedKind::Unrecognised, at()),
        }
    }
}

/// Classifies how a response ended (wire-formats.md §30, §5): `completed` is clean unless
/// `used` (`usage.output_tokens`) reached the request's limit; `incomplete` is truncation
/// (`max_output_tokens`) or refusal (`content_filter`); a `refusal` content part is a
/// refusal; any other status (`failed`, `cancelled`, `in_progress` …) did not complete, and a
/// call in it is treated as cut.
pub fn classify(
    status: Option<&str>,
    incomplete_reason: Option<&str>,
    refused: bool,
    used: Option<u64>,
    max: Option<u64>,
) -> Completion {
    let completion = Completion::new;
    if refused {
        return completion(CompletionState::Refused, "refusal");
    }
    match (status, incomplete_reason) {
        (Some("completed"), _) => match (used, max) {
            (Some(u), Some(m)) if u >= m => {
                completion(CompletionState::Truncated, "max_output_tokens_reached")
            }
            _ => completion(CompletionState::Clean, "completed"),
        },
        (Some("incomplete"), Some("content_filter")) => {
            completion(CompletionState::Refused, "content_filter")
        }
        (Some("incomplete"), Some(r)) => completion(CompletionState::Truncated, r),
        (Some(s), _) => completion(CompletionState::Truncated, s),
        (None, _) => completion(CompletionState::Truncated, "missing_status"),
    }
}

/// The input of a client-call item as admission sees it: JSON text, or a custom call's raw
/// `input` text ([`call_input`]).
fn call_arguments(item: &Value) -> String {
    match item_type(item) {
        "function_call" | "tool_search_call" => match item.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(other) => other.to_string(),
        },
        // Free-form input is raw text, exactly as the model wrote it (not JSON-quoted).
        "custom_tool_call" => match item.get("input") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(other) => other.to_string(),
        },
        _ => ["action", "operation", "input"]
            .iter()
            .find_map(|k| item.get(*k))
            .map(Value::to_string)
            .unwrap_or_default(),
    }
}

/// A call's identity: its `name` (a client tool search is `tool_search`, a built-in its item
/// type), qualified by its `namespace` ([`qualified_name`]).
fn call_name(item: &Value) -> String {
    let name = match item_type(item) {
        "tool_search_call" => "tool_search",
        ty => str_of(item, "name").unwrap_or(ty),
    };
    qualified_name(str_of(item, "namespace"), name)
}

/// A custom tool call's input is raw text; every other call's is JSON.
fn call_input(item: &Value) -> CallInput {
    if item_type(item) == "custom_tool_call" {
        CallInput::Text
    } else {
        CallInput::Json
    }
}

fn call_from_item(item: &Value) -> ToolCall {
    ToolCall {
        input: call_input(item),
        id: str_of(item, "call_id")
            .or_else(|| str_of(item, "id"))
            .unwrap_or_default()
            .to_owned(),
        name: call_name(item),
        arguments: call_arguments(item),
    }
}

fn has_refusal_part(item: &Value) -> bool {
    item_type(item) == "message"
        && item
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .any(|p| str_of(p, "type") == Some("refusal"))
}

fn output_items(response: &Value) -> impl Iterator<Item = &Value> {
    response
        .get("output")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

fn completion_of_response(response: &Value, refused: bool, max: Option<u64>) -> Completion {
    classify(
        str_of(response, "status"),
        response
            .at("/incomplete_details/reason")
            .and_then(Value::as_str),
        refused || output_items(response).any(has_refusal_part),
        response.at("/usage/output_tokens").and_then(Value::as_u64),
        max,
    )
}

/// The assistant text of a response: the `output_text` parts of its `message` items,
/// concatenated; `None` when it has no message.
fn output_text(response: &Value) -> Option<String> {
    let mut text: Option<String> = None;
    for item in output_items(response).filter(|i| item_type(i) == "message") {
        let parts = item.get("content").and_then(Value::as_array);
        for p in parts.into_iter().flatten() {
            if str_of(p, "type") == Some("output_text") {
                text.get_or_insert_with(String::new)
                    .push_str(str_of(p, "text").unwrap_or_default());
            }
        }
    }
    text
}

/// The provider-enforced output schema of a request (`structured` channel, contract §A):
/// `text.format: {type: "json_schema", name, schema, strict}` (flat, unlike Chat's
/// `response_format.json_schema`).
pub fn structured_schema(body: &Value) -> Option<(String, Value)> {
    let format = body.at("/text/format")?;
    if str_of(format, "type") != Some("json_schema") {
        return None;
    }
    let name = str_of(format, "name").unwrap_or("text.format").to_owned();
    Some((name, format.get("schema")?.clone()))
}

/// Takes the request's `input` as a list of items (a string `input` becomes a user message).
fn take_input_items(obj: &mut Map<String, Value>) -> Vec<Value> {
    match obj.remove("input") {
        Some(Value::Array(list)) => list,
        Some(Value::String(text)) => vec![json!({"role": "user", "content": text})],
        _ => Vec::new(),
    }
}

/// Appends a repair turn for a text answer: the answer as an assistant message, then a
/// host-authored user message with the validator's findings (a string `input` becomes a user
/// message first).
pub fn append_text_repair(body: &mut Value, answer: &str, feedback: &str) {
    let Some(obj) = body.as_object_mut() else {
        return;
    };
    let mut input = take_input_items(obj);
    input.push(json!({"role": "assistant", "content": answer}));
    input.push(json!({"role": "user", "content": feedback}));
    obj.insert("input".into(), Value::Array(input));
}

/// Reads the emissions of a non-stream response (one choice, index 0).
///
/// Errors: two client calls share a `call_id`.
pub fn parse_response(body: &Value, ctx: &AnswerContext) -> Result<Vec<ChoiceEmissions>, String> {
    let calls = output_items(body)
        .filter(|i| item_kind(i) == Kind::Call)
        .map(call_from_item)
        .collect();
    let out = vec![ChoiceEmissions {
        output: output_items(body)
            .filter(|i| item_kind(i) == Kind::Call)
            .cloned()
            .collect(),
        choice: 0,
        text: output_text(body),
        provider_output: output_items(body).any(|i| item_kind(i) == Kind::Provider),
        completion: completion_of_response(body, false, ctx.max_output_tokens),
        calls,
    }];
    crate::model::check_identities(&out)?;
    Ok(out)
}

/// The journal's record of a (non-stream) response the provider stores.
pub fn response_link(body: &Value, ctx: &AnswerContext) -> Option<ResponseLink> {
    let response_id = str_of(body, "id")?.to_owned();
    let mut provider_items = Vec::new();
    for item in output_items(body) {
        note_provider_item(&mut provider_items, item);
    }
    Some(ResponseLink {
        items: stored_items(body),
        response_id,
        previous_response_id: ctx.previous_response_id.clone(),
        status: str_of(body, "status").map(str::to_owned),
        provider_items,
        content_trust: None,
        next_round_index: None,
        calls_so_far: None,
    })
}

/// The output items of `response` that carry an id, for the journal's `item_reference`
/// lookups: id, type, and whether the provider executed it (or turnguard does not know it).
fn stored_items(response: &Value) -> Vec<crate::model::StoredOutputItem> {
    output_items(response)
        .filter_map(|item| {
            let id = str_of(item, "id").filter(|id| id.chars().count() <= MAX_ITEM_ID)?;
            Some(crate::model::StoredOutputItem {
                id: id.to_owned(),
                item_type: sanitize_type(item_type(item)),
                provider_executed: item_kind(item) == Kind::Provider,
            })
        })
        .collect()
}

fn note_provider_item(list: &mut Vec<String>, item: &Value) {
    let ty = item_type(item);
    if item_kind(item) == Kind::Provider && !list.iter().any(|t| t == ty) {
        list.push(sanitize_type(ty));
    }
}

/// Item types come from the upstream: keep a short safe alphabet for the journal.
fn sanitize_type(ty: &str) -> String {
    ty.chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        .take(64)
        .collect()
}

/// The id of the host-authored message item of a response: derived from the response id so
/// a re-sent response gets the same id (`msg_turnguard_` + 32 hex digits).
fn host_message_id(response_id: Option<&str>) -> String {
    let digest = Sha256::digest(response_id.unwrap_or_default().as_bytes());
    format!("msg_turnguard_{}", &hex::encode(digest)[..32])
}

fn host_text_part(text: &str) -> Value {
    json!({"type": "output_text", "annotations": [], "logprobs": [], "text": text})
}

/// A completed assistant `message` item carrying host-authored `text`.
fn host_message(id: &str, text: &str) -> Value {
    json!({
        "id": id,
        "type": "message",
        "status": "completed",
        "content": [host_text_part(text)],
        "role": "assistant"
    })
}

/// Removes the withheld client calls from `response.output`; with `text`, appends the
/// host-authored message and turns an `incomplete` status into `completed` (DESIGN.md §4
/// `end-turn`: the finish becomes a normal stop). Returns whether anything changed.
fn rewrite_output(
    response: &mut Value,
    withheld: &dyn Fn(usize, &Value) -> bool,
    text: Option<&str>,
) -> bool {
    let mut changed = false;
    let message_id = host_message_id(str_of(response, "id"));
    if let Some(output) = response.get_mut("output").and_then(Value::as_array_mut) {
        let mut call_no = 0usize;
        let before = output.len();
        output.retain(|item| {
            if item_kind(item) != Kind::Call {
                return true;
            }
            call_no += 1;
            !withheld(call_no - 1, item)
        });
        changed |= output.len() != before;
        if let Some(text) = text {
            output.push(host_message(&message_id, text));
            changed = true;
        }
    }
    if text.is_some() && str_of(response, "status") == Some("incomplete") {
        set(response, "status", json!("completed"));
        set(response, "incomplete_details", Value::Null);
        changed = true;
    }
    changed
}

/// Applies verdicts to a non-stream response: withheld calls are removed, the host-authored
/// message is added and an `incomplete` status becomes `completed`. Returns whether it
/// changed.
pub fn rewrite_response(body: &mut Value, verdicts: &[ChoiceVerdict]) -> bool {
    let Some(verdict) = verdicts.first() else {
        return false;
    };
    let released = |k: usize| verdict.decisions.get(k).is_some_and(|d| d.released());
    // Redacted arguments for egress tools (`redaction.strip_from_egress`).
    let mut replaced = false;
    if let Some(items) = body.get_mut("output").and_then(Value::as_array_mut) {
        let mut k = 0;
        for item in items.iter_mut() {
            if item_kind(item) != Kind::Call {
                continue;
            }
            if let Some(args) = verdict.release_args(k) {
                set(item, "arguments", json!(args));
                replaced = true;
            }
            k += 1;
        }
    }
    let any_withheld = output_items(body)
        .filter(|i| item_kind(i) == Kind::Call)
        .enumerate()
        .any(|(k, _)| !released(k));
    if !any_withheld && verdict.end_turn().is_none() {
        return replaced;
    }
    rewrite_output(body, &|k, _| !released(k), verdict.end_turn()) || replaced
}

/// Appends a repair turn to a request body (tool-turn contract §B "repair", §G): each
/// withheld call as a `function_call` input item, then a host-authored
/// `function_call_output` for it. A string `input` becomes a user message first. The calls go
/// without their item `id`s, so the provider does not look for the reasoning items that
/// produced them. `previous_response_id` is kept: the repair continues from the same stored
/// turns as the round it repairs.
pub fn append_repair(body: &mut Value, choice: &ChoiceEmissions, items: &[RepairItem]) {
    let Some(obj) = body.as_object_mut() else {
        return;
    };
    let mut input = take_input_items(obj);
    let mut output_types = Vec::new();
    for it in items {
        if let Some(c) = choice.calls.get(it.call) {
            let (item, output_type) = repair_call_item(c, choice.output.get(it.call));
            input.push(item);
            output_types.push(output_type);
        }
    }
    let mut output_types = output_types.into_iter();
    for it in items {
        if let Some(c) = choice.calls.get(it.call) {
            let text = if it.is_error {
                format!("Error: {}", it.text)
            } else {
                it.text.clone()
            };
            let ty = output_types.next().unwrap_or("function_call_output");
            input.push(json!({"type": ty, "call_id": c.id, "output": text}));
        }
    }
    obj.insert("input".into(), Value::Array(input));
}

/// A withheld call as a repair round's input item, and the type of the output item that
/// answers it. A custom call stays a `custom_tool_call` (its `name`, `namespace` and raw
/// `input` as the model emitted them, answered by a `custom_tool_call_output`); every other
/// call goes back as a `function_call` with its own name and namespace (arguments that are
/// not a JSON object become `{}`), answered by a `function_call_output`. No item `id`: the
/// provider must not look for the reasoning items that produced it.
fn repair_call_item(call: &ToolCall, item: Option<&Value>) -> (Value, &'static str) {
    let original = item.filter(|i| str_of(i, "call_id") == Some(call.id.as_str()));
    let namespace = original.and_then(|i| str_of(i, "namespace"));
    let name = original
        .and_then(|i| str_of(i, "name"))
        .unwrap_or(call.name.as_str());
    let mut out = if call.input == CallInput::Text {
        json!({"type": "custom_tool_call", "call_id": call.id, "name": name, "input": call.arguments})
    } else {
        let args = if serde_json::from_str::<Value>(&call.arguments).is_ok_and(|v| v.is_object()) {
            call.arguments.clone()
        } else {
            "{}".to_owned()
        };
        json!({"type": "function_call", "call_id": call.id, "name": name, "arguments": args})
    };
    if let Some(ns) = namespace {
        set(&mut out, "namespace", json!(ns));
    }
    let output_type = if call.input == CallInput::Text {
        "custom_tool_call_output"
    } else {
        "function_call_output"
    };
    (out, output_type)
}

/// How a repair round's stream continues the agent's Responses stream, which already carries
/// the first round's `response.created` and the items sent before the calls were held: the
/// official SDK must see one response (same id, `output_index` and `sequence_number`
/// continuing, every item it was sent present in the final `output`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponsesSplice {
    /// The response id the agent saw.
    response_id: Option<String>,
    /// Items the agent already has, complete, in `output_index` order.
    sent: Vec<Value>,
    /// The next `output_index`.
    next_index: u64,
    /// The last `sequence_number` sent; `None` before any (or when the stream has none).
    last_seq: Option<u64>,
    /// The stream carries `sequence_number`s.
    numbered: bool,
}

impl SpliceState for ResponsesSplice {
    /// Passes every event: [`ResponsesStream::continuing`] rewrites them itself.
    fn apply(&mut self, event: Event) -> Option<Event> {
        Some(event)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A client call being assembled from stream events.
#[derive(Debug, Clone, Default)]
struct CallAcc {
    item_id: Option<String>,
    call_id: String,
    name: String,
    /// Concatenated argument / input deltas.
    deltas: String,
    saw_delta: bool,
    /// `(name, arguments)` of each complete form seen, in arrival order:
    /// `….arguments.done`, `output_item.done`, the terminal event's `output`.
    finals: Vec<(Option<String>, String)>,
    /// The `call_id` of each complete item form seen (`output_item.done`, terminal `output`):
    /// the id the agent answers with. A form without it (or with another) is inconsistent.
    final_ids: Vec<Option<String>>,
    /// JSON arguments or a custom call's raw text (from the announced item's type).
    input: CallInput,
    /// The last complete item seen (else the announced one): what a repair round replays.
    item: Option<Value>,
}

impl CallAcc {
    fn from_item(item: &Value) -> Self {
        Self {
            item_id: str_of(item, "id").map(str::to_owned),
            call_id: str_of(item, "call_id")
                .or_else(|| str_of(item, "id"))
                .unwrap_or_default()
                .to_owned(),
            name: call_name(item),
            input: call_input(item),
            item: Some(item.clone()).filter(|i| i.is_object()),
            ..Self::default()
        }
    }

    /// Records a complete form of the call from its item (`output_item.done`, terminal
    /// `output`), filling in the ids when the stream never announced the item.
    fn absorb(&mut self, item: &Value) {
        if self.call_id.is_empty() {
            let announced = Self::from_item(item);
            self.call_id = announced.call_id;
            if self.name.is_empty() {
                self.name = announced.name;
            }
        }
        if self.item_id.is_none() {
            self.item_id = str_of(item, "id").map(str::to_owned);
        }
        self.input = call_input(item);
        self.item = Some(item.clone());
        self.finals
            .push((Some(call_name(item)), call_arguments(item)));
        self.final_ids
            .push(str_of(item, "call_id").map(str::to_owned));
    }

    /// The call as the agent executes it: the last complete form (the terminal event's
    /// `output`, which SDKs return as the final response), else the deltas.
    fn call(&self) -> ToolCall {
        let (name, arguments) = match self.finals.last() {
            Some((name, args)) => (name.clone().unwrap_or_else(|| self.name.clone()), args),
            None => (self.name.clone(), &self.deltas),
        };
        ToolCall {
            input: self.input,
            id: self.call_id.clone(),
            name,
            arguments: arguments.clone(),
        }
    }

    /// Every form of the call the agent may read agrees (deltas, `.done`, `output_item.done`,
    /// terminal `output`). When they differ, admitting one of them could release another.
    fn consistent(&self) -> bool {
        let call = self.call();
        (!self.saw_delta || self.finals.is_empty() || self.deltas == call.arguments)
            && self
                .finals
                .iter()
                .all(|(n, a)| *a == call.arguments && n.as_ref().is_none_or(|n| *n == call.name))
            && self
                .final_ids
                .iter()
                .all(|id| id.as_deref() == Some(call.id.as_str()))
    }
}

#[derive(Debug)]
struct Item {
    call: Option<CallAcc>,
    /// A call that started after the decision point: its events are dropped (fail closed).
    dropped: bool,
}

#[derive(Debug)]
struct Held {
    raw: Bytes,
    event: Option<String>,
    json: Option<Value>,
    /// The JSON was changed before holding (a repair round's splice): never send `raw`.
    dirty: bool,
}

/// The terminal event's facts.
#[derive(Debug, Clone)]
struct Terminal {
    response: Value,
}

/// `sequence_number` bookkeeping. Until turnguard drops or inserts an event, every event keeps
/// its upstream number (and its bytes); from the first change on, each event sent gets the
/// number after the last one sent, so the agent's numbers stay consecutive.
#[derive(Debug, Default)]
struct Sequence {
    renumber: bool,
    last: Option<u64>,
    /// The upstream numbers its events (newer API versions; a 2025-03 capture has none).
    seen: bool,
}

impl Sequence {
    fn dropped(&mut self, json: Option<&Value>) {
        if json.and_then(|j| j.get("sequence_number")).is_some() {
            self.renumber = true;
        }
    }

    /// The number to send for an upstream event numbered `n`.
    fn next(&mut self, n: u64) -> u64 {
        let new = match (self.renumber, self.last) {
            (true, Some(last)) => last + 1,
            (true, None) => 0,
            (false, _) => n,
        };
        self.last = Some(new);
        new
    }

    /// The number of an event turnguard inserts.
    fn inserted(&mut self) -> u64 {
        self.renumber = true;
        let n = self.last.map_or(0, |l| l + 1);
        self.last = Some(n);
        n
    }
}

/// The Responses stream state machine (see the module docs).
#[derive(Debug)]
pub struct ResponsesStream {
    max_output_tokens: Option<u64>,
    previous_response_id: Option<String>,
    response_id: Option<String>,
    /// Items by `output_index`.
    items: BTreeMap<u64, Item>,
    /// Item `id` → `output_index`.
    by_id: HashMap<String, u64>,
    /// Client calls that appear only in the terminal event's `output` (never streamed).
    unstreamed: Vec<CallAcc>,
    holding: bool,
    held: Vec<Held>,
    terminal: Option<Terminal>,
    refused: bool,
    failed: bool,
    decided: bool,
    /// The terminal (or an `error`) event was seen: nothing may follow.
    ended: bool,
    violation: Option<String>,
    /// Upstream blocks carry `event:` lines (they do on OpenAI; kept as received).
    event_lines: bool,
    seq: Sequence,
    provider_items: Vec<String>,
    /// A repair round continuing the agent's stream (see [`ResponsesSplice`]).
    splice: Option<ResponsesSplice>,
    /// A repair round: the provider's id of this round's response (the agent sees the first
    /// round's id).
    provider_response_id: Option<String>,
    /// Complete items sent to the agent by this round, by `output_index` (for a later splice).
    sent: BTreeMap<u64, Value>,
}

impl ResponsesStream {
    /// State for one response to `turn`.
    pub fn new(turn: &Turn) -> Self {
        Self {
            max_output_tokens: turn.max_output_tokens,
            previous_response_id: turn.previous_response_id.clone(),
            response_id: None,
            items: BTreeMap::new(),
            by_id: HashMap::new(),
            unstreamed: Vec::new(),
            holding: false,
            held: Vec::new(),
            terminal: None,
            refused: false,
            failed: false,
            decided: false,
            ended: false,
            violation: None,
            event_lines: true,
            seq: Sequence::default(),
            provider_items: Vec::new(),
            splice: None,
            provider_response_id: None,
            sent: BTreeMap::new(),
        }
    }

    /// State for a repair round whose events continue the agent's stream as `splice` says.
    pub fn continuing(turn: &Turn, splice: &ResponsesSplice) -> Self {
        let mut s = Self::new(turn);
        s.response_id = splice.response_id.clone();
        s.seq = Sequence {
            renumber: true,
            last: splice.last_seq,
            seen: splice.numbered,
        };
        s.splice = Some(splice.clone());
        s
    }

    /// Rewrites one event of a repair round into the agent's response; `false` drops it (the
    /// agent already had the lifecycle events).
    fn splice_event(&self, kind: &str, j: &mut Value) -> bool {
        let Some(sp) = &self.splice else {
            return true;
        };
        if matches!(
            kind,
            "response.created" | "response.queued" | "response.in_progress"
        ) {
            return false;
        }
        if let Some(ix) = j.get("output_index").and_then(Value::as_u64) {
            set(j, "output_index", json!(ix.saturating_add(sp.next_index)));
        }
        if let Some(response) = j.get_mut("response").filter(|r| r.is_object()) {
            if let Some(id) = &sp.response_id {
                set(response, "id", json!(id));
            }
            if let Some(output) = response.get_mut("output").and_then(Value::as_array_mut) {
                let mut all = sp.sent.clone();
                all.append(output);
                *output = all;
            }
        }
        true
    }

    fn item_of(&self, json: &Value) -> Option<u64> {
        json.get("output_index")
            .and_then(Value::as_u64)
            .filter(|ix| self.items.contains_key(ix))
            .or_else(|| {
                str_of(json, "item_id")
                    .and_then(|id| self.by_id.get(id))
                    .copied()
            })
    }

    /// The event's `output_index`, or the next free one when it has none.
    fn index_of(&self, json: &Value) -> u64 {
        json.get("output_index")
            .and_then(Value::as_u64)
            .unwrap_or_else(|| self.items.keys().next_back().map_or(0, |l| l + 1))
    }

    /// The call an event belongs to. An event that carries a call (arguments, input, a done
    /// call item) for an item never announced as a call starts one, so it is held and
    /// admitted like any other (fail closed: a consumer may act on `.done` events alone).
    /// `None` when the call is dropped (it started after the decision point).
    fn call_for(&mut self, json: &Value, item: Option<&Value>) -> Option<&mut CallAcc> {
        let ix = match self.item_of(json) {
            Some(ix) if self.items.get(&ix).is_some_and(|i| i.call.is_some()) => ix,
            _ => {
                let ix = self.index_of(json);
                let mut call = item.map(CallAcc::from_item).unwrap_or_default();
                if let Some(id) = str_of(json, "item_id") {
                    call.item_id.get_or_insert_with(|| id.to_owned());
                    self.by_id.insert(id.to_owned(), ix);
                }
                if let Some(id) = call.item_id.clone() {
                    self.by_id.insert(id, ix);
                }
                let dropped = self.decided;
                self.items.insert(
                    ix,
                    Item {
                        call: Some(call),
                        dropped,
                    },
                );
                if !dropped {
                    self.holding = true;
                }
                ix
            }
        };
        let item = self.items.get_mut(&ix)?;
        if item.dropped {
            return None;
        }
        item.call.as_mut()
    }

    fn violate(&mut self, why: String) {
        self.violation.get_or_insert(why);
    }

    /// Updates the state from one event; `false` when the event must be dropped.
    fn observe(&mut self, kind: &str, j: &Value) -> bool {
        match kind {
            // The API opens a response empty (`output: []`) and streams its items as
            // `response.output_item.*` events, which are what turnguard reads calls from;
            // the SDKs start their snapshot from this response, so an item in it would reach
            // the agent undecided.
            "response.created" | "response.queued" | "response.in_progress"
                if j.at("/response/output")
                    .is_some_and(|o| o.as_array().is_none_or(|a| !a.is_empty())) =>
            {
                self.violate(format!(
                    "a `{kind}` whose response already holds output (its items must come as `response.output_item.*` events)"
                ));
            }
            "response.created" | "response.queued" | "response.in_progress"
                if self.response_id.is_none() =>
            {
                self.response_id = j
                    .at("/response/id")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
            }
            // Kept when added (a call added after the decision point is dropped there).
            "response.output_item.added" => return self.item_added(j),
            "response.function_call_arguments.delta" | "response.custom_tool_call_input.delta" => {
                let delta = str_of(j, "delta").unwrap_or_default().to_owned();
                if let Some(call) = self.call_for(j, None) {
                    call.deltas.push_str(&delta);
                    call.saw_delta = true;
                }
            }
            "response.function_call_arguments.done" => {
                let name = str_of(j, "name").map(str::to_owned);
                let args = str_of(j, "arguments").unwrap_or_default().to_owned();
                if let Some(call) = self.call_for(j, None) {
                    call.finals.push((name, args));
                }
            }
            "response.custom_tool_call_input.done" => {
                // The raw text, as the deltas carry it (not JSON-quoted).
                let input = str_of(j, "input").unwrap_or_default().to_owned();
                if let Some(call) = self.call_for(j, None) {
                    call.input = CallInput::Text;
                    call.finals.push((None, input));
                }
            }
            "response.output_item.done" => {
                let item = j.get("item").unwrap_or(&Value::Null);
                if item_kind(item) == Kind::Provider {
                    note_provider_item(&mut self.provider_items, item);
                }
                if has_refusal_part(item) {
                    self.refused = true;
                }
                if item_kind(item) == Kind::Call {
                    if let Some(call) = self.call_for(j, Some(item)) {
                        call.absorb(item);
                    }
                }
            }
            "response.refusal.delta" | "response.refusal.done" => self.refused = true,
            "response.content_part.added" | "response.content_part.done"
                if j.at("/part/type").and_then(Value::as_str) == Some("refusal") =>
            {
                self.refused = true;
            }
            k if TERMINAL.contains(&k) && !self.decided => self.terminal_seen(j),
            _ => {}
        }
        // Events of a call that arrived after the decision point.
        !self
            .item_of(j)
            .and_then(|ix| self.items.get(&ix))
            .is_some_and(|i| i.dropped)
    }

    /// `response.output_item.added`: the item at its `output_index` (unique index and id, or
    /// a violation), provider items noted, calls start holding; `false` when the event must
    /// be dropped (a violation, or a call after the decision point: fail closed).
    fn item_added(&mut self, j: &Value) -> bool {
        let Some(ix) = j.get("output_index").and_then(Value::as_u64) else {
            self.violate("a `response.output_item.added` without an integer `output_index`".into());
            return false;
        };
        if self.items.contains_key(&ix) {
            self.violate(format!("a second item added at output_index {ix}"));
            return false;
        }
        let item = j.get("item").unwrap_or(&Value::Null);
        if let Some(other) = str_of(item, "id").and_then(|id| self.by_id.get(id).copied()) {
            if other != ix {
                self.violate(format!("one item id at output_index {other} and {ix}"));
                return false;
            }
        }
        let kind = item_kind(item);
        if kind == Kind::Provider {
            note_provider_item(&mut self.provider_items, item);
        }
        let dropped = kind == Kind::Call && self.decided;
        if let Some(id) = str_of(item, "id") {
            self.by_id.insert(id.to_owned(), ix);
        }
        self.items.insert(
            ix,
            Item {
                call: (kind == Kind::Call).then(|| CallAcc::from_item(item)),
                dropped,
            },
        );
        if dropped {
            // Fail closed: a call after the decision point is never released.
            return false;
        }
        if kind == Kind::Call {
            self.holding = true;
        }
        true
    }

    /// A terminal event before the decision: the response id, provider items, and every
    /// call of the final response absorbed into the one the stream showed (a call the
    /// stream never showed is admitted too: fail closed).
    fn terminal_seen(&mut self, j: &Value) {
        let response = j.get("response").cloned().unwrap_or(Value::Null);
        if self.response_id.is_none() {
            self.response_id = str_of(&response, "id").map(str::to_owned);
        }
        for item in output_items(&response) {
            note_provider_item(&mut self.provider_items, item);
            if item_kind(item) != Kind::Call {
                continue;
            }
            let call_id = str_of(item, "call_id");
            let known = self
                .items
                .values_mut()
                .filter_map(|i| i.call.as_mut())
                .find(|c| {
                    (c.item_id.is_some() && c.item_id.as_deref() == str_of(item, "id"))
                        || (call_id.is_some() && Some(c.call_id.as_str()) == call_id)
                });
            match known {
                Some(call) => call.absorb(item),
                None => {
                    // A call the stream never showed: admit it too (fail closed).
                    let mut call = CallAcc::from_item(item);
                    call.absorb(item);
                    self.unstreamed.push(call);
                    self.holding = true;
                }
            }
        }
        self.terminal = Some(Terminal { response });
    }

    /// Sends one event, renumbering its `sequence_number` once any event was dropped or
    /// inserted before it; its raw bytes when nothing changed.
    fn emit(&mut self, h: Held, changed: bool, out: &mut Vec<Bytes>) {
        let Some(mut json) = h.json else {
            out.push(h.raw);
            return;
        };
        let mut changed = changed || h.dirty;
        if let Some(ix) = json.get("output_index").and_then(Value::as_u64) {
            match str_of(&json, "type") {
                Some("response.output_item.done") => {
                    self.sent
                        .insert(ix, json.get("item").cloned().unwrap_or(Value::Null));
                }
                Some("response.output_item.added") => {
                    let item = json.get("item").cloned().unwrap_or(Value::Null);
                    self.sent.entry(ix).or_insert(item);
                }
                _ => {}
            }
        }
        if let Some(n) = json.get("sequence_number").and_then(Value::as_u64) {
            let new = self.seq.next(n);
            if new != n {
                set(&mut json, "sequence_number", json!(new));
                changed = true;
            }
        }
        if changed {
            let name = h
                .event
                .as_ref()
                .map(|_| str_of(&json, "type").unwrap_or_default().to_owned());
            out.push(sse::encode(
                name.as_deref(),
                &crate::strict_json::to_text(&json),
            ));
        } else {
            out.push(h.raw);
        }
    }

    /// Sends an event turnguard authored, numbered after the last one sent.
    fn emit_new(&mut self, json: Value, out: &mut Vec<Bytes>) {
        let mut json = json;
        if self.seq.seen {
            let n = self.seq.inserted();
            // `sequence_number` right after `type`, where the provider puts it.
            if let Value::Object(fields) = json {
                let mut ordered = serde_json::Map::new();
                for (k, v) in fields {
                    let after_type = k == "type";
                    ordered.insert(k, v);
                    if after_type {
                        ordered.insert("sequence_number".into(), json!(n));
                    }
                }
                json = Value::Object(ordered);
            }
        }
        let name = self
            .event_lines
            .then(|| str_of(&json, "type").unwrap_or_default().to_owned());
        out.push(sse::encode(
            name.as_deref(),
            &crate::strict_json::to_text(&json),
        ));
    }

    fn completion(&self) -> Completion {
        let response = self
            .terminal
            .as_ref()
            .map(|t| &t.response)
            .unwrap_or(&Value::Null);
        let completion = completion_of_response(response, self.refused, self.max_output_tokens);
        if completion.state == CompletionState::Clean && !self.calls().all(CallAcc::consistent) {
            // The deltas, `.done` events and final `output` disagree on a call: whichever one
            // admission read, the agent could execute another. Withheld at stage 1.
            return Completion {
                state: CompletionState::Truncated,
                reason: "inconsistent_call_events".into(),
            };
        }
        completion
    }

    /// Every client call, streamed ones by `output_index`, then unstreamed ones.
    fn calls(&self) -> impl Iterator<Item = &CallAcc> {
        self.items
            .values()
            .filter(|i| !i.dropped)
            .filter_map(|i| i.call.as_ref())
            .chain(self.unstreamed.iter())
    }

    /// Streams the host-authored message item at `output_index` `ix`, as the provider
    /// streams a message: added, content part, text delta and done events.
    fn emit_host_message(&mut self, ix: u64, text: &str, out: &mut Vec<Bytes>) {
        let id = host_message_id(self.response_id.as_deref());
        let mut in_progress = host_message(&id, text);
        set(&mut in_progress, "status", json!("in_progress"));
        set(&mut in_progress, "content", json!([]));
        let empty_part = host_text_part("");
        let part = host_text_part(text);
        let events = [
            json!({"type": "response.output_item.added", "output_index": ix, "item": in_progress}),
            json!({"type": "response.content_part.added", "item_id": id, "output_index": ix, "content_index": 0, "part": empty_part}),
            json!({"type": "response.output_text.delta", "item_id": id, "output_index": ix, "content_index": 0, "delta": text, "logprobs": []}),
            json!({"type": "response.output_text.done", "item_id": id, "output_index": ix, "content_index": 0, "text": text, "logprobs": []}),
            json!({"type": "response.content_part.done", "item_id": id, "output_index": ix, "content_index": 0, "part": part}),
            json!({"type": "response.output_item.done", "output_index": ix, "item": host_message(&id, text)}),
        ];
        for e in events {
            self.emit_new(e, out);
        }
    }

    /// Sends `response.failed` for the agent's response (its id, the items it was sent, status
    /// `failed`, `error: {code: api_code, message, turnguard_code}`).
    fn emit_failed(&mut self, api_code: &str, code: &str, message: &str, out: &mut Vec<Bytes>) {
        let mut output: Vec<Value> = self
            .splice
            .as_ref()
            .map(|sp| sp.sent.clone())
            .unwrap_or_default();
        output.extend(self.sent.values().cloned());
        let response = json!({
            "id": self.response_id,
            "object": "response",
            "status": "failed",
            "error": {"code": api_code, "message": format!("{message} (turnguard: {code})"), "turnguard_code": code},
            "incomplete_details": null,
            "output": output,
        });
        self.emit_new(
            json!({"type": "response.failed", "response": response}),
            out,
        );
    }
}

impl ProviderStream for ResponsesStream {
    /// Calls are held and not yet decided.
    fn pending(&self) -> bool {
        self.holding && !self.decided
    }

    /// The terminal event arrived while calls are held: they can be admitted.
    fn ready(&self) -> bool {
        self.pending() && !self.failed && self.terminal.is_some()
    }

    /// The terminal event was seen: a stream that ends now is complete.
    fn finished(&self) -> bool {
        self.terminal.is_some() || self.failed
    }

    /// The provider reported an error in the stream.
    fn failed(&self) -> bool {
        self.failed
    }

    /// The stream broke its structure (see [`Self::push`]); nothing more is forwarded.
    fn violation(&self) -> Option<&str> {
        self.violation.as_deref()
    }

    /// Takes one event; bytes to forward now are appended to `out`.
    ///
    /// Fails closed (sets [`Self::violation`], forwards nothing of the event) on a structure
    /// that does not identify each item uniquely or that follows the end: an event without a
    /// `type` or whose `event:` line names another type, an `output_item.added` without an
    /// integer `output_index` or on an index already used, one item id on two indices, and
    /// any event after the terminal event (a second `response.completed` would replace the
    /// output the agent's SDK returns).
    fn push(&mut self, event: Event, out: &mut Vec<Bytes>) {
        if self.violation.is_some() {
            return;
        }
        let Event { block, payload } = event;
        let mut json = match payload {
            Payload::None | Payload::Done => {
                out.push(block.raw); // comment / keep-alive: no sequence number, nothing to hold
                return;
            }
            Payload::Json(v) => v,
            Payload::Text => match sse::read_text(&block) {
                Ok(v) => v,
                Err(e) => return self.violate(e.to_string()),
            },
            Payload::Body => return self.violate("a whole body inside a stream".into()),
        };
        self.event_lines = block.event.is_some();
        if json.get("sequence_number").is_some() {
            self.seq.seen = true;
        }
        let Some(kind) = str_of(&json, "type").map(str::to_owned) else {
            return self.violate("an event without a string `type`".into());
        };
        if block.event.as_deref().is_some_and(|e| e != kind) {
            return self.violate(format!(
                "an `event:` line that names another type than the data's `{}`",
                crate::admission::sanitize_label(&kind)
            ));
        }
        if self.ended {
            return self.violate(format!(
                "`{}` after the terminal event",
                crate::admission::sanitize_label(&kind)
            ));
        }
        let dirty = self.splice.is_some();
        if self.splice.is_some() {
            // The provider's own id of this round, for the journal.
            if let Some(id) = json.at("/response/id").and_then(Value::as_str) {
                self.provider_response_id
                    .get_or_insert_with(|| id.to_owned());
            }
        }
        if !self.splice_event(&kind, &mut json) {
            return;
        }
        let keep = self.observe(&kind, &json);
        if self.violation.is_some() {
            return;
        }
        if !keep {
            self.seq.dropped(Some(&json));
            return;
        }
        if TERMINAL.contains(&kind.as_str()) {
            self.ended = true;
        }
        if kind == "error" {
            // A provider error mid-stream: nothing held is released.
            self.failed = true;
            self.decided = true;
            self.ended = true;
            for h in std::mem::take(&mut self.held) {
                self.seq.dropped(h.json.as_ref());
            }
        }
        let held = Held {
            raw: block.raw,
            event: block.event,
            json: Some(json),
            dirty,
        };
        if self.pending() {
            self.held.push(held);
        } else {
            self.emit(held, false, out);
        }
    }

    /// The emissions to admit (one choice, index 0).
    fn round(&self) -> Vec<ChoiceEmissions> {
        let calls: Vec<ToolCall> = self.calls().map(CallAcc::call).collect();
        if calls.is_empty() {
            return Vec::new();
        }
        let output = self
            .calls()
            .map(|c| c.item.clone().unwrap_or(Value::Null))
            .collect();
        vec![ChoiceEmissions {
            output,
            choice: 0,
            text: None,
            provider_output: !self.provider_items.is_empty(),
            completion: self.completion(),
            calls,
        }]
    }

    /// Completion of the response, for the journal.
    fn completions(&self) -> Vec<Completion> {
        if self.terminal.is_some() {
            vec![self.completion()]
        } else {
            Vec::new()
        }
    }

    /// The journal's record of this response, once its id is known.
    fn response_link(&self) -> Option<ResponseLink> {
        Some(ResponseLink {
            items: self
                .terminal
                .as_ref()
                .map(|t| stored_items(&t.response))
                .unwrap_or_default(),
            response_id: self
                .provider_response_id
                .clone()
                .or_else(|| self.response_id.clone())?,
            previous_response_id: self.previous_response_id.clone(),
            status: self
                .terminal
                .as_ref()
                .and_then(|t| str_of(&t.response, "status"))
                .map(str::to_owned),
            provider_items: self.provider_items.clone(),
            content_trust: None,
            next_round_index: None,
            calls_so_far: None,
        })
    }

    /// Emits the held events with the verdicts applied; later events flow through.
    fn release(&mut self, verdicts: &[ChoiceVerdict], out: &mut Vec<Bytes>) {
        self.decided = true;
        let held = std::mem::take(&mut self.held);
        let verdict = verdicts.first();
        let text = verdict.and_then(|v| v.end_turn().map(str::to_owned));
        let decisions = verdict.map(|v| v.decisions.as_slice()).unwrap_or_default();

        // Withheld calls: by output_index (streamed) and by item id / call id (any).
        let mut withheld_ix: BTreeSet<u64> = BTreeSet::new();
        let mut withheld_ids: BTreeSet<String> = BTreeSet::new();
        let streamed: Vec<(u64, &CallAcc)> = self
            .items
            .iter()
            .filter(|(_, i)| !i.dropped)
            .filter_map(|(ix, i)| i.call.as_ref().map(|c| (*ix, c)))
            .collect();
        let all: Vec<(Option<u64>, &CallAcc)> = streamed
            .iter()
            .map(|(ix, c)| (Some(*ix), *c))
            .chain(self.unstreamed.iter().map(|c| (None, c)))
            .collect();
        for (k, (ix, call)) in all.iter().enumerate() {
            // Fail closed: a call without a decision is withheld.
            if decisions.get(k).is_some_and(|d| d.released()) {
                continue;
            }
            if let Some(ix) = ix {
                withheld_ix.insert(*ix);
            }
            withheld_ids.extend(
                [call.item_id.as_deref(), Some(call.call_id.as_str())]
                    .into_iter()
                    .flatten()
                    .filter(|id| !id.is_empty())
                    .map(str::to_owned),
            );
        }
        if withheld_ix.is_empty() && withheld_ids.is_empty() && text.is_none() {
            for h in held {
                self.emit(h, false, out);
            }
            return;
        }
        let new_index = |ix: u64| ix - withheld_ix.range(..ix).count() as u64;
        let base = self.splice.as_ref().map_or(0, |sp| sp.next_index);
        let host_index = self
            .items
            .keys()
            .next_back()
            .map_or(base, |last| (last + 1).max(base))
            - withheld_ix.len() as u64;
        let is_withheld = |item: &Value| {
            item_kind(item) == Kind::Call
                && [str_of(item, "id"), str_of(item, "call_id")]
                    .iter()
                    .flatten()
                    .any(|id| withheld_ids.contains(*id))
        };
        let mut text_sent = false;
        for mut h in held {
            let Some(json) = h.json.as_mut() else {
                out.push(h.raw);
                continue;
            };
            let ix = json.get("output_index").and_then(Value::as_u64);
            let item_id = str_of(json, "item_id");
            // By its place, by the item it names, or by the call item it carries (an
            // `output_item.*` event whose `output_index` is missing or not a number names its
            // call only inside its `item`).
            if ix.is_some_and(|ix| withheld_ix.contains(&ix))
                || item_id.is_some_and(|id| withheld_ids.contains(id))
                || json.get("item").is_some_and(is_withheld)
            {
                self.seq.dropped(Some(json));
                continue;
            }
            let mut changed = false;
            if let Some(ix) = ix {
                if new_index(ix) != ix {
                    set(json, "output_index", json!(new_index(ix)));
                    changed = true;
                }
            }
            let kind = str_of(json, "type").unwrap_or_default().to_owned();
            if TERMINAL.contains(&kind.as_str()) {
                if let Some(text) = &text {
                    if !text_sent {
                        self.emit_host_message(host_index, text, out);
                        text_sent = true;
                    }
                }
                if let Some(response) = json.get_mut("response") {
                    changed |=
                        rewrite_output(response, &|_, item| is_withheld(item), text.as_deref());
                }
                if kind == "response.incomplete" && text.is_some() {
                    set(json, "type", json!("response.completed"));
                    changed = true;
                }
            }
            self.emit(h, changed, out);
        }
        if let (Some(text), false) = (&text, text_sent) {
            self.emit_host_message(host_index, text, out);
        }
    }

    /// Drops everything held and ends the stream as the API ends a failed response: an
    /// `error` event carrying `code` (an outcome surfaced as an error after the headers went
    /// out; the official SDKs raise on it), then `response.failed` ([`Self::emit_failed`]).
    /// The failed response's `error.code` is `invalid_prompt`, the API's code for a request
    /// that cannot succeed as sent, so a client that reads it (Codex) stops instead of sending
    /// the turn again; turnguard's own code is in its `message` and `turnguard_code`.
    fn fail(&mut self, code: &str, message: &str, out: &mut Vec<Bytes>) {
        self.held.clear();
        self.decided = true;
        let body = json!({
            "type": "error",
            "code": code,
            "message": message,
            "param": null,
            "error": {"type": "turnguard_refused", "code": code, "message": message, "param": null}
        });
        self.emit_new(body, out);
        self.emit_failed("invalid_prompt", code, message, out);
    }

    /// Drops what is held (the round is being repaired) and says how the next round's stream
    /// continues the agent's.
    fn abandon(&mut self) -> Splice {
        self.held.clear();
        self.decided = true;
        let mut sent = self
            .splice
            .as_ref()
            .map(|sp| sp.sent.clone())
            .unwrap_or_default();
        sent.extend(self.sent.values().cloned());
        let base = self.splice.as_ref().map_or(0, |sp| sp.next_index);
        Splice::new(ResponsesSplice {
            response_id: self.response_id.clone(),
            sent,
            next_index: self
                .sent
                .keys()
                .next_back()
                .map_or(base, |l| (l + 1).max(base)),
            last_seq: self.seq.last,
            numbered: self.seq.seen,
        })
    }

    /// The upstream stream was cut: drop what is held and end the agent's stream with an
    /// `error` event. It has the Responses `error` event's fields (`code`, `message`, `param`)
    /// and an `error` object, on which the official SDK raises.
    fn cut(&mut self, reason: &str, out: &mut Vec<Bytes>) {
        for h in std::mem::take(&mut self.held) {
            self.seq.dropped(h.json.as_ref());
        }
        self.decided = true;
        let message = format!(
            "turnguard: the upstream stream ended early ({reason}); withheld tool calls were not released"
        );
        let body = json!({
            "type": "error",
            "code": "turnguard.upstream_stream_cut",
            "message": message,
            "param": null,
            "error": {
                "type": "upstream_stream_interrupted",
                "code": "turnguard.upstream_stream_cut",
                "message": message,
                "param": null
            }
        });
        // No `response.failed`: a cut is transient, and a client that reads the stream as
        // disconnected (Codex) retries the turn, which is what a cut upstream deserves.
        self.emit_new(body, out);
    }

    /// A `response.output_text.delta`'s `delta` (wire-formats.md §4).
    fn answer_text<'a>(&'a self, event: &'a Event) -> Option<&'a str> {
        if event.kind() != Some("response.output_text.delta") {
            return None;
        }
        event.json()?.get("delta").and_then(Value::as_str)
    }

    /// `response.completed` or `response.incomplete` (by the data's `type`, which
    /// [`Self::push`] requires to agree with the `event:` line). `response.failed` is not a
    /// text answer's end: nothing is held back for it.
    fn is_terminal(&self, event: &Event) -> bool {
        matches!(
            event.kind(),
            Some("response.completed" | "response.incomplete")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_cases() {
        // (status, incomplete reason, refusal part, output tokens) → (state, reason)
        type Case<'a> = (
            Option<&'a str>,
            Option<&'a str>,
            bool,
            Option<u64>,
            CompletionState,
            &'a str,
        );
        let cases: [Case; 9] = [
            (
                Some("completed"),
                None,
                false,
                Some(10),
                CompletionState::Clean,
                "completed",
            ),
            (
                Some("completed"),
                None,
                false,
                Some(100),
                CompletionState::Truncated,
                "max_output_tokens_reached",
            ),
            (
                Some("completed"),
                None,
                true,
                Some(10),
                CompletionState::Refused,
                "refusal",
            ),
            (
                Some("incomplete"),
                Some("max_output_tokens"),
                false,
                None,
                CompletionState::Truncated,
                "max_output_tokens",
            ),
            (
                Some("incomplete"),
                Some("content_filter"),
                false,
                None,
                CompletionState::Refused,
                "content_filter",
            ),
            (
                Some("incomplete"),
                None,
                false,
                None,
                CompletionState::Truncated,
                "incomplete",
            ),
            (
                Some("failed"),
                None,
                false,
                None,
                CompletionState::Truncated,
                "failed",
            ),
            (
                Some("in_progress"),
                None,
                false,
                None,
                CompletionState::Truncated,
                "in_progress",
            ),
            (
                None,
                None,
                false,
                None,
                CompletionState::Truncated,
                "missing_status",
            ),
        ];
        for (status, reason, refused, used, state, label) in cases {
            let c = classify(status, reason, refused, used, Some(100));
            assert_eq!(
                (c.state, c.reason.as_str()),
                (state, label),
                "{status:?} {reason:?}"
            );
        }
    }

    #[test]
    fn requests_are_read_into_a_turn() {
        let body = json!({
            "model": "gpt-5",
            "instructions": "be brief",
            "previous_response_id": "resp_1",
            "max_output_tokens": 64,
            "text": {"format": {"type": "json_schema", "name": "A", "schema": {"type": "object"}, "strict": true}},
            "tools": [
                {"type": "function", "name": "get_capital", "parameters": {"type": "object"}, "strict": true},
                {"type": "web_search"},
                {"type": "mcp", "server_label": "deepwiki", "server_url": "https://x"}
            ],
            "input": [
                {"role": "user", "content": "capital?"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "call_1", "name": "get_capital", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "Paris"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
                {"role": "user", "content": "and Spain?"},
                {"type": "custom_tool_call_output", "call_id": "call_9", "output": [{"type": "input_text", "text": "x"}]}
            ]
        });
        let t = OpenAiResponses.parse_request(&body).unwrap();
        assert_eq!(t.api, Api::OpenAiResponses);
        assert_eq!(t.tools.len(), 1);
        assert_eq!(t.tools[0].name, "get_capital");
        assert_eq!(
            t.provider_delegations,
            vec!["tools[2] (mcp, server_label deepwiki)"]
        );
        assert_eq!(t.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(t.max_output_tokens, Some(64));
        assert_eq!(
            structured_schema(&body),
            Some(("A".to_owned(), json!({"type": "object"})))
        );
        // reasoning + call is one model turn, the assistant message after the output another.
        assert_eq!(t.round_index, 2);
        let results: Vec<(&str, Option<&str>, String)> = t
            .tool_results
            .iter()
            .map(|r| {
                (
                    r.tool_call_id.as_str(),
                    r.tool_name.as_deref(),
                    crate::strict_json::to_text(&r.content),
                )
            })
            .collect();
        assert_eq!(
            results,
            vec![
                ("call_1", Some("get_capital"), "\"Paris\"".to_owned()),
                (
                    "call_9",
                    None,
                    "[{\"type\":\"input_text\",\"text\":\"x\"}]".to_owned()
                )
            ]
        );
        let plain = OpenAiResponses
            .parse_request(&json!({"model": "m", "input": "hi"}))
            .unwrap();
        assert_eq!((plain.round_index, plain.tool_results.len()), (0, 0));
        // A stored chain is judged by the trust stage from the journal, not here; a
        // conversation's history is never journaled, so it is provider-held and untrusted.
        let chained = OpenAiResponses
            .parse_request(&json!({"input": "hi", "previous_response_id": "resp_1"}));
        assert!(chained.unwrap().untrusted_inputs.is_empty());
        for conversation in [json!("conv_1"), json!({"id": "conv_1"})] {
            let t = OpenAiResponses
                .parse_request(&json!({"input": "hi", "conversation": conversation}))
                .unwrap();
            assert!(!t.untrusted_inputs.is_empty());
        }
    }

    #[test]
    fn every_tool_kind_is_declared_under_its_identity() {
        let body = json!({
            "tools": [
                {"type": "custom", "name": "apply_patch"},
                {"type": "tool_search", "execution": "client", "parameters": {"type": "object"}},
                {"type": "tool_search"}
            ],
            "input": [
                {"type": "additional_tools", "role": "developer", "tools": [
                    {"type": "namespace", "name": "functions", "tools": [
                        {"type": "custom", "name": "exec", "format": {"type": "grammar", "syntax": "regex", "definition": "a+"}},
                        {"type": "function", "name": "wait", "parameters": {"type": "object"}}
                    ]}
                ]},
                {"role": "user", "content": "go"}
            ]
        });
        let t = OpenAiResponses.parse_request(&body).unwrap();
        let tools: Vec<(&str, Option<&FreeformFormat>)> = t
            .tools
            .iter()
            .map(|d| (d.name.as_str(), d.freeform.as_ref()))
            .collect();
        assert_eq!(
            tools,
            vec![
                ("apply_patch", Some(&FreeformFormat::Text)),
                ("tool_search", None),
                ("functions.exec", Some(&FreeformFormat::Regex("a+".into()))),
                ("functions.wait", None),
            ]
        );
        // The provider-run search is provider output; the host's tools are not a model turn.
        let at: Vec<&str> = t.untrusted_inputs.iter().map(|u| u.at.as_str()).collect();
        assert_eq!(at.join(","), "tools[2]");
        assert_eq!(t.round_index, 0);
        let nested = json!({"input": [{"type": "additional_tools", "tools": [
            {"type": "namespace", "name": "a", "tools": [{"type": "namespace", "name": "b", "tools": []}]}
        ]}]});
        assert!(OpenAiResponses.parse_request(&nested).is_err());
        assert_eq!(
            freeform_format(Some(&json!({"type": "grammar", "syntax": "ebnf"}))),
            FreeformFormat::Unknown("grammar/ebnf".into())
        );
    }

    #[test]
    fn non_stream_calls_and_rewrite() {
        let mut body = json!({
            "id": "resp_2",
            "status": "completed",
            "output": [
                {"type": "web_search_call", "id": "ws_1", "status": "completed"},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "a", "arguments": "{\"x\":1}"},
                {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_2", "name": "sql", "input": "SELECT 1"}
            ]
        });
        let turn = OpenAiResponses
            .parse_request(&json!({"input": "x"}))
            .unwrap();
        let round = parse_response(&body, &turn.answer_context()).unwrap();
        let calls: Vec<(&str, &str, &str)> = round[0]
            .calls
            .iter()
            .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(
            calls,
            vec![("call_1", "a", "{\"x\":1}"), ("call_2", "sql", "SELECT 1")]
        );
        let link = response_link(&body, &turn.answer_context()).unwrap();
        assert_eq!(link.provider_items, vec!["web_search_call"]);
        let decision = |released: bool| {
            crate::model::Decision::new(
                if released {
                    crate::model::Outcome::Executed
                } else {
                    crate::model::Outcome::Invalid
                },
                crate::model::Stage::Name,
                crate::reason::Reason::Released,
                String::new(),
            )
        };
        let verdict = ChoiceVerdict {
            choice: 0,
            decisions: vec![decision(true), decision(false)],
            surfacing: crate::model::Surfacing::EndTurn("[turnguard] no".into()),
            claims: Vec::new(),
        };
        assert!(rewrite_response(&mut body, &[verdict]));
        let types: Vec<&str> = body["output"]
            .as_array()
            .unwrap()
            .iter()
            .map(item_type)
            .collect();
        assert_eq!(types, vec!["web_search_call", "function_call", "message"]);
        assert_eq!(
            body["output"][2]["id"],
            json!(host_message_id(Some("resp_2")))
        );
    }
}
