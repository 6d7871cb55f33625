//! OpenAI Chat Completions (`POST /v1/chat/completions`) and compatible servers (vLLM,
//! Ollama, llama.cpp …): requests, JSON responses and the SSE stream, into and out of the
//! neutral model. Wire facts are from `shared/reference/wire-formats.md` §2.
//!
//! Stream rule: text, refusal and role deltas are forwarded as they arrive; every chunk that
//! carries `tool_calls` deltas is held, with the finish chunk of its choice, until the
//! completion state is known (the finish chunk, plus the usage chunk when the request set a
//! token limit and `include_usage`), then admitted and released or replaced. Chunks that no
//! decision changes are re-emitted byte for byte.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde_json::{json, Map, Value};

use crate::model::{
    Api, ChoiceEmissions, ChoiceVerdict, Completion, CompletionState, DeclaredTool, RepairItem,
    ToolCall, ToolResultSeen, Turn,
};
use crate::sse::{self, SseBlock};

/// Reads a Chat Completions request body.
///
/// Errors: a human-readable reason naming the offending field.
pub fn parse_request(body: &Value) -> Result<Turn, String> {
    let obj = body.as_object().ok_or("the body must be a JSON object")?;
    let messages = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("`messages` must be an array")?;
    let mut tools = Vec::new();
    if let Some(list) = obj.get("tools") {
        let list = list.as_array().ok_or("`tools` must be an array")?;
        for (i, t) in list.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                continue;
            }
            let f = t
                .get("function")
                .ok_or_else(|| format!("`tools[{i}].function` is missing"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("`tools[{i}].function.name` must be a string"))?;
            tools.push(DeclaredTool {
                name: name.to_owned(),
                schema: f.get("parameters").cloned(),
            });
        }
    }
    if let Some(list) = obj.get("functions").and_then(Value::as_array) {
        for f in list {
            if let Some(name) = f.get("name").and_then(Value::as_str) {
                tools.push(DeclaredTool {
                    name: name.to_owned(),
                    schema: f.get("parameters").cloned(),
                });
            }
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
        match role {
            "assistant" => {
                round_index = round_index.saturating_add(1);
                for c in m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    if let (Some(id), Some(name)) = (
                        c.get("id").and_then(Value::as_str),
                        c.pointer("/function/name").and_then(Value::as_str),
                    ) {
                        names.insert(id.to_owned(), name.to_owned());
                    }
                    if let Some(name) = c.pointer("/function/name").and_then(Value::as_str) {
                        prior_calls.push(name.to_owned());
                    }
                }
            }
            "function" => {
                // The legacy functions API: a result without a call id, named by `name`.
                let name = m.get("name").and_then(Value::as_str).unwrap_or_default();
                tool_results.push(ToolResultSeen {
                    tool_call_id: format!("function:{name}"),
                    tool_name: (!name.is_empty()).then(|| name.to_owned()),
                    content: m.get("content").cloned().unwrap_or(Value::Null).to_string(),
                    is_error: false,
                });
            }
            "tool" => {
                let id = m
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("`messages[{i}].tool_call_id` must be a string"))?;
                let content = m.get("content").cloned().unwrap_or(Value::Null);
                tool_results.push(ToolResultSeen {
                    tool_call_id: id.to_owned(),
                    tool_name: names.get(id).cloned(),
                    content: content.to_string(),
                    is_error: false,
                });
            }
            _ => {}
        }
    }
    let max_output_tokens = obj
        .get("max_completion_tokens")
        .and_then(Value::as_u64)
        .or_else(|| obj.get("max_tokens").and_then(Value::as_u64));
    let stream = obj.get("stream").and_then(Value::as_bool) == Some(true);
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true);
    Ok(Turn {
        api: Api::OpenAiChat,
        model: obj.get("model").and_then(Value::as_str).map(str::to_owned),
        stream,
        tools,
        tool_results,
        max_output_tokens,
        include_usage,
        round_index,
        prior_calls,
        // `web_search_options`: the provider searches the web in this very turn (§C, §F).
        provider_output_seen: obj.contains_key("web_search_options"),
        previous_response_id: None,
        provider_delegations: Vec::new(),
    })
}

/// Classifies how a choice ended. `used` is `usage.completion_tokens`.
///
/// Truncation reported as `tool_calls`/`stop` while the usage reached the request's limit is
/// still truncation (vLLM streaming did this; wire-formats.md §15).
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
        Some("length") => completion(CompletionState::Truncated, "length"),
        Some("content_filter") => completion(CompletionState::Refused, "content_filter"),
        Some(r) => match (used, max) {
            (Some(u), Some(m)) if u >= m => {
                completion(CompletionState::Truncated, "max_tokens_reached")
            }
            _ => completion(CompletionState::Clean, r),
        },
    }
}

fn call_from_message(c: &Value) -> ToolCall {
    let arguments = match c.pointer("/function/arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    };
    ToolCall {
        id: c
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        name: c
            .pointer("/function/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        arguments,
    }
}

/// Reads the emissions of a non-stream response, one entry per choice.
pub fn parse_response(body: &Value, turn: &Turn) -> Vec<ChoiceEmissions> {
    let used = body
        .pointer("/usage/completion_tokens")
        .and_then(Value::as_u64);
    let mut out = Vec::new();
    for (pos, choice) in body
        .get("choices")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let index = choice
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(pos as u64) as u32;
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
                turn.max_output_tokens,
            ),
            calls,
        });
    }
    out
}

/// Applies verdicts to a non-stream response: withheld calls are removed; an ended turn also
/// gains the host-authored text and finishes with `stop`. Returns whether anything changed.
pub fn rewrite_response(body: &mut Value, verdicts: &[ChoiceVerdict]) -> bool {
    let mut changed = false;
    let Some(choices) = body.get_mut("choices").and_then(Value::as_array_mut) else {
        return false;
    };
    for (pos, choice) in choices.iter_mut().enumerate() {
        let index = choice
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(pos as u64) as u32;
        let Some(verdict) = verdicts.iter().find(|v| v.choice == index) else {
            continue;
        };
        if !verdict.any_withheld() && !verdict.any_replaced() {
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
                        call["function"]["arguments"] = json!(args);
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
            choice["finish_reason"] = json!("stop");
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
}

/// A held chunk: its raw bytes, its JSON, and for each `tool_calls` entry (choice position,
/// entry position) the call it belongs to.
#[derive(Debug)]
struct Held {
    raw: Bytes,
    json: Option<Value>,
    entries: Vec<(usize, usize, usize)>,
}

/// The Chat stream state machine (see the module docs).
#[derive(Debug)]
pub struct ChatStream {
    max_output_tokens: Option<u64>,
    needs_usage: bool,
    choices: BTreeMap<u32, ChoiceAcc>,
    held: Vec<Held>,
    usage_tokens: Option<u64>,
    usage_seen: bool,
    done_seen: bool,
    decided: bool,
    failed: bool,
}

impl ChatStream {
    /// State for one response to `turn`.
    pub fn new(turn: &Turn) -> Self {
        Self {
            max_output_tokens: turn.max_output_tokens,
            needs_usage: turn.include_usage && turn.max_output_tokens.is_some(),
            choices: BTreeMap::new(),
            held: Vec::new(),
            usage_tokens: None,
            usage_seen: false,
            done_seen: false,
            decided: false,
            failed: false,
        }
    }

    fn holding(&self) -> bool {
        !self.decided && self.choices.values().any(|c| !c.calls.is_empty())
    }

    /// The provider reported an error in the stream.
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Calls are held and not yet decided.
    pub fn pending(&self) -> bool {
        self.holding()
    }

    /// Takes one SSE block; bytes to forward now are appended to `out`.
    pub fn push(&mut self, block: SseBlock, out: &mut Vec<Bytes>) {
        let Some(data) = block.data.as_deref() else {
            out.push(block.raw); // comment / keep-alive
            return;
        };
        if data.trim() == "[DONE]" {
            self.done_seen = true;
            if self.holding() {
                self.held.push(Held {
                    raw: block.raw,
                    json: None,
                    entries: Vec::new(),
                });
            } else {
                out.push(block.raw);
            }
            return;
        }
        let Ok(mut chunk) = serde_json::from_str::<Value>(data) else {
            // Not JSON: nothing to admit in it; keep order behind anything held.
            self.push_other(block.raw, out);
            return;
        };
        if chunk.get("error").is_some_and(|e| !e.is_null()) {
            // A provider error mid-stream: nothing held is released.
            self.failed = true;
            self.held.clear();
            out.push(block.raw);
            return;
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.usage_seen = true;
            self.usage_tokens = u.get("completion_tokens").and_then(Value::as_u64);
        }
        let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
            self.push_other(block.raw, out);
            return;
        };
        let has_calls = choices.iter().any(|c| {
            c.pointer("/delta/tool_calls")
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty())
                || c.pointer("/delta/function_call")
                    .is_some_and(|v| !v.is_null())
        });
        if self.decided && has_calls {
            // Fail closed: a call after the decision point is never released unadmitted.
            strip_calls(&mut chunk);
            out.push(encode(&chunk));
            return;
        }
        // Accumulate.
        let mut entries = Vec::new();
        let mut finishes_held_choice = false;
        for (cpos, c) in choices.iter().enumerate() {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(0) as u32;
            let acc = self.choices.entry(index).or_default();
            if c.pointer("/delta/role").is_some_and(|r| !r.is_null()) {
                acc.role_seen = true;
            }
            if let Some(Value::String(r)) = c.pointer("/delta/refusal") {
                if !r.is_empty() {
                    acc.refused = true;
                }
            }
            for (epos, e) in c
                .pointer("/delta/tool_calls")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .enumerate()
            {
                let wire_index = e.get("index").and_then(Value::as_u64).unwrap_or(0);
                let id = e
                    .get("id")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty());
                let current = acc.calls.iter().rposition(|a| a.wire_index == wire_index);
                // A new id on an index already in use is a new call (some compatible servers
                // send parallel calls all on index 0): keep them apart, never glue them.
                let slot = match (current, id) {
                    (Some(p), Some(id))
                        if !acc.calls[p].call.id.is_empty() && acc.calls[p].call.id != id =>
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
                                id: String::new(),
                                name: String::new(),
                                arguments: String::new(),
                            },
                        });
                        acc.calls.len() - 1
                    }
                };
                let call = &mut acc.calls[slot].call;
                if let Some(id) = id {
                    if call.id.is_empty() {
                        call.id = id.to_owned();
                    }
                }
                if let Some(n) = e.pointer("/function/name").and_then(Value::as_str) {
                    call.name.push_str(n);
                }
                if let Some(a) = e.pointer("/function/arguments").and_then(Value::as_str) {
                    call.arguments.push_str(a);
                }
                entries.push((cpos, epos, slot));
            }
            if let Some(fc) = c.pointer("/delta/function_call").filter(|v| v.is_object()) {
                // Legacy `function_call` streaming: one call per choice.
                if acc.calls.is_empty() {
                    acc.calls.push(CallAcc {
                        wire_index: u64::MAX,
                        call: ToolCall {
                            id: "function_call".into(),
                            name: String::new(),
                            arguments: String::new(),
                        },
                    });
                }
                let call = &mut acc.calls[0].call;
                if let Some(n) = fc.get("name").and_then(Value::as_str) {
                    call.name.push_str(n);
                }
                if let Some(a) = fc.get("arguments").and_then(Value::as_str) {
                    call.arguments.push_str(a);
                }
            }
            if let Some(r) = c.get("finish_reason").and_then(Value::as_str) {
                acc.finish_reason = Some(r.to_owned());
                if !acc.calls.is_empty() {
                    acc.finish_held = true;
                    finishes_held_choice = true;
                }
            }
        }
        if has_calls || finishes_held_choice {
            // Split off text that rides along with call deltas so text is never delayed.
            if has_calls && carries_text(&chunk) {
                let mut text_only = chunk.clone();
                strip_calls(&mut text_only);
                remove_finish(&mut text_only);
                out.push(encode(&text_only));
                keep_only_calls_and_finish(&mut chunk);
                self.held.push(Held {
                    raw: encode(&chunk),
                    json: Some(chunk),
                    entries,
                });
            } else {
                self.held.push(Held {
                    raw: block.raw,
                    json: Some(chunk),
                    entries,
                });
            }
        } else {
            self.push_other(block.raw, out);
        }
    }

    /// A chunk with nothing to admit: forwarded now, unless it belongs after a held finish
    /// (usage and trailing chunks keep their place behind the held calls).
    fn push_other(&mut self, raw: Bytes, out: &mut Vec<Bytes>) {
        let finish_pending = self.choices.values().any(|c| c.finish_held);
        if self.holding() && finish_pending {
            self.held.push(Held {
                raw,
                json: None,
                entries: Vec::new(),
            });
        } else {
            out.push(raw);
        }
    }

    /// The completion state of every choice with calls is known.
    pub fn ready(&self) -> bool {
        if !self.holding() || self.failed {
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
        all_finished && (!self.needs_usage || self.usage_seen)
    }

    /// Every choice's finish reason is known (a stream that ends now is not cut).
    pub fn finished(&self) -> bool {
        self.failed
            || self.done_seen
            || (!self.choices.is_empty()
                && self.choices.values().all(|c| c.finish_reason.is_some()))
    }

    /// The emissions to admit, one entry per choice with calls.
    pub fn round(&self) -> Vec<ChoiceEmissions> {
        let used = if self.usage_seen {
            self.usage_tokens
        } else {
            None
        };
        self.choices
            .iter()
            .filter(|(_, c)| !c.calls.is_empty())
            .map(|(&index, c)| ChoiceEmissions {
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
    pub fn completions(&self) -> Vec<Completion> {
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
    pub fn release(&mut self, verdicts: &[ChoiceVerdict], out: &mut Vec<Bytes>) {
        self.decided = true;
        // Per choice: released flag per call, and the index each released call is emitted at.
        let mut plan: BTreeMap<u32, (Vec<Option<u64>>, Option<&str>)> = BTreeMap::new();
        // Calls whose arguments are replaced: the first delta carries them all, the rest go.
        let mut replace: BTreeMap<(u32, usize), &str> = BTreeMap::new();
        let mut replaced_once: std::collections::BTreeSet<(u32, usize)> = Default::default();
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
        for held in std::mem::take(&mut self.held) {
            let Some(mut chunk) = held.json else {
                out.push(held.raw);
                continue;
            };
            let mut changed = false;
            // End-turn texts to insert before this chunk: (choice, text, with role).
            let mut texts: Vec<(u32, &str, bool)> = Vec::new();
            if let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut) {
                let mut drop_positions = Vec::new();
                for (cpos, c) in choices.iter_mut().enumerate() {
                    let index = c.get("index").and_then(Value::as_u64).unwrap_or(0) as u32;
                    let Some((emitted, end_turn)) = plan.get(&index) else {
                        continue;
                    };
                    let acc = &self.choices[&index];
                    if let Some(list) = c
                        .pointer_mut("/delta/tool_calls")
                        .and_then(Value::as_array_mut)
                    {
                        let mut keep = Vec::new();
                        for (epos, mut e) in std::mem::take(list).into_iter().enumerate() {
                            let slot = held
                                .entries
                                .iter()
                                .find(|(cp, ep, _)| *cp == cpos && *ep == epos)
                                .map(|(_, _, s)| *s);
                            match slot
                                .and_then(|s| emitted.get(s).copied().flatten().map(|ix| (s, ix)))
                            {
                                Some((s, ix)) => {
                                    if let Some(args) = replace.get(&(index, s)) {
                                        changed = true;
                                        if !replaced_once.insert((index, s)) {
                                            continue; // later fragments of a replaced call
                                        }
                                        e["function"]["arguments"] = json!(args);
                                    }
                                    if acc.calls[s].wire_index != ix {
                                        e["index"] = json!(ix);
                                        changed = true;
                                    }
                                    keep.push(e);
                                }
                                None => changed = true,
                            }
                        }
                        *list = keep;
                    }
                    if c.pointer("/delta/function_call").is_some()
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
                            c["finish_reason"] = json!("stop");
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

    /// The upstream stream was cut: drop what is held and end the agent's stream with a
    /// provider-shaped error (the openai SDK raises on a `data: {"error": …}` event).
    pub fn cut(&mut self, reason: &str, out: &mut Vec<Bytes>) {
        self.fail(
            "upstream_stream_interrupted",
            "turnguard.upstream_stream_cut",
            &format!("turnguard: the upstream stream ended early ({reason}); withheld tool calls were not released"),
            out,
        );
    }

    /// Drops what is held and ends the agent's stream with an error event of `kind`/`code`.
    pub fn fail(&mut self, kind: &str, code: &str, message: &str, out: &mut Vec<Bytes>) {
        self.held.clear();
        self.decided = true;
        let body =
            json!({ "error": { "message": message, "type": kind, "code": code, "param": null } });
        out.push(sse::encode(None, &body.to_string()));
    }

    /// Drops what is held (the round is being repaired); the next round's events follow.
    pub fn abandon(&mut self) {
        self.held.clear();
        self.decided = true;
    }
}

fn carries_text(chunk: &Value) -> bool {
    chunk
        .get("choices")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|c| {
            matches!(c.pointer("/delta/content"), Some(Value::String(s)) if !s.is_empty())
                || matches!(c.pointer("/delta/refusal"), Some(Value::String(s)) if !s.is_empty())
        })
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
            c["finish_reason"] = Value::Null;
        }
    }
}

fn keep_only_calls_and_finish(chunk: &mut Value) {
    for c in choices_mut(chunk) {
        if let Some(d) = c.get_mut("delta").and_then(Value::as_object_mut) {
            d.retain(|k, _| k == "tool_calls" || k == "function_call");
        }
    }
}

fn encode(chunk: &Value) -> Bytes {
    sse::encode(None, &chunk.to_string())
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
