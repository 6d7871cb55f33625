//! A run-node agent on the Chat Completions API and the record it leaves: the agent keeps its
//! transcript and sends the run identity headers (`Turnguard-Run`, `-Node`, `-Attempt`,
//! `-Mode`); answers are scripted into the mock; the journal is read back read-only. Shared by
//! `replay_recovery` and `attacks::records`.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use std::path::{Path, PathBuf};

use bytes::Bytes;
use serde_json::{json, Value};

use super::{post_raw, Harness};

pub fn spec_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/spec/openwop")
}

pub fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// The tools the agent declares (Chat Completions form).
pub fn declared_tools() -> Value {
    let f = |name: &str, params: Value| json!({"type": "function", "function": {"name": name, "parameters": params}});
    json!([
        f(
            "lookup_order",
            json!({"type": "object", "properties": {"orderId": {"type": "string"}}, "required": ["orderId"]})
        ),
        f(
            "charge",
            json!({"type": "object", "properties": {"chargeId": {"type": "string"}, "amount": {"type": "number"}, "card": {"type": "string"}}, "required": ["chargeId", "amount"]})
        ),
        f(
            "send_receipt",
            json!({"type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}}, "required": ["to", "body"]})
        ),
    ])
}

/// A Chat Completions tool call.
pub fn call(id: &str, name: &str, args: Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}})
}

/// A non-stream Chat answer carrying `calls`.
pub fn answer_calls(id: &str, calls: Vec<Value>) -> Value {
    json!({
        "id": id, "object": "chat.completion", "created": 1_782_955_817, "model": "gpt-test",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": calls},
                     "logprobs": null, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 80, "completion_tokens": 24, "total_tokens": 104}
    })
}

/// A non-stream Chat final answer.
pub fn answer_text(id: &str, text: &str) -> Value {
    json!({
        "id": id, "object": "chat.completion", "created": 1_782_955_817, "model": "gpt-test",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": null, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 80, "completion_tokens": 12, "total_tokens": 92}
    })
}

/// The events of a Chat Completions stream carrying one call (name, then its arguments).
pub fn chat_sse_call(call_id: &str, name: &str, args: &Value) -> Vec<String> {
    let chunk = |delta: Value, finish: Value| {
        let v = json!({"id": "chatcmpl-st", "object": "chat.completion.chunk", "created": 1_782_955_817,
            "model": "gpt-test", "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]});
        format!("data: {v}")
    };
    vec![
        chunk(json!({"role": "assistant", "content": null}), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": args.to_string()}}]}),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
        "data: [DONE]".to_owned(),
    ]
}

/// Programs the mock with these answers, in order.
pub async fn model_says(h: &Harness, answers: &[Value]) {
    let steps: Vec<Value> = answers.iter().map(|a| json!({"json": a})).collect();
    h.script(&json!({ "responses": steps })).await;
}

pub async fn upstream_calls(h: &Harness) -> usize {
    h.mock_requests().await.len()
}

/// What the agent got back.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
    pub json: Value,
}

impl Reply {
    pub fn text_body(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// Served from the record (recovery or replay), not from the model.
    pub fn served_from_record(&self) -> bool {
        self.headers
            .get("turnguard-served")
            .is_some_and(|v| v == "recorded")
    }
    /// `(call id, tool name, arguments)` of every call released to the agent.
    pub fn calls(&self) -> Vec<(String, String, Value)> {
        self.json
            .pointer("/choices/0/message/tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|c| {
                (
                    c["id"].as_str().unwrap_or_default().to_owned(),
                    c["function"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    serde_json::from_str(c["function"]["arguments"].as_str().unwrap_or("null"))
                        .unwrap_or(Value::Null),
                )
            })
            .collect()
    }
    pub fn call_names(&self) -> Vec<String> {
        self.calls().into_iter().map(|(_, n, _)| n).collect()
    }
    pub fn text(&self) -> Option<String> {
        self.json
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .map(str::to_owned)
    }
}

/// An agent on the Chat Completions API inside a run node: it keeps its transcript and sends
/// the run identity headers with every request.
#[derive(Clone)]
pub struct Agent {
    pub url: String,
    pub run: String,
    pub node: Option<String>,
    pub attempt: u32,
    pub replay: bool,
    pub messages: Vec<Value>,
    /// Further request headers (a principal token, an `x-request-id`).
    pub extra: Vec<(String, String)>,
}

impl Agent {
    pub fn new(h: &Harness, run: &str, ask: &str) -> Self {
        Self {
            url: format!("{}/v1/chat/completions", h.url()),
            run: run.to_owned(),
            node: None,
            attempt: 1,
            replay: false,
            messages: vec![json!({"role": "user", "content": ask})],
            extra: Vec::new(),
        }
    }
    pub fn node(mut self, node: &str) -> Self {
        self.node = Some(node.to_owned());
        self
    }
    pub fn attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt;
        self
    }
    pub fn replaying(mut self) -> Self {
        self.replay = true;
        self
    }
    /// Sends `name: value` with every request.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.extra.push((name.to_owned(), value.to_owned()));
        self
    }
    pub fn body(&self) -> Value {
        json!({"model": "gpt-test", "messages": self.messages, "tools": declared_tools()})
    }
    pub async fn send(&self) -> Reply {
        self.send_body(&self.body()).await
    }
    pub async fn send_body(&self, body: &Value) -> Reply {
        let attempt = self.attempt.to_string();
        let mut headers: Vec<(&str, &str)> = vec![
            ("turnguard-run", &self.run),
            ("turnguard-attempt", &attempt),
        ];
        if let Some(n) = &self.node {
            headers.push(("turnguard-node", n));
        }
        if self.replay {
            headers.push(("turnguard-mode", "replay"));
        }
        for (k, v) in &self.extra {
            headers.push((k, v));
        }
        let (status, headers, body) =
            post_raw(&self.url, Bytes::from(body.to_string()), &headers).await;
        let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            body,
            json,
        }
    }
    /// Appends the assistant message of `reply` to the transcript.
    pub fn accept(&mut self, reply: &Reply) {
        let msg = reply
            .json
            .pointer("/choices/0/message")
            .cloned()
            .unwrap_or_else(|| panic!("no assistant message in {}", reply.text_body()));
        self.messages.push(msg);
    }
    /// Appends a tool result.
    pub fn result(&mut self, call_id: &str, content: &str) {
        self.messages
            .push(json!({"role": "tool", "tool_call_id": call_id, "content": content}));
    }
    pub fn user(&mut self, text: &str) {
        self.messages.push(json!({"role": "user", "content": text}));
    }
}

/// The answer is turnguard's error in the provider surface's own shape (DESIGN.md §7) with
/// this status and OpenWOP code inside: OpenAI `{"error": {message, type, code, param,
/// details}}` or Anthropic `{"type": "error", "error": {type, message, code, details}}`; the
/// code is registered in `errors.json` with that status, or has the vendor form.
pub fn assert_openwop_error(reply: &Reply, status: u16, code: &str) {
    assert_eq!(reply.status, status, "body: {}", reply.text_body());
    let v = &reply.json;
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("error body is not a JSON object: {}", reply.text_body()));
    let allowed: &[&str] = if obj.contains_key("type") {
        assert_eq!(v["type"], "error", "the Anthropic shape: {v}");
        &["type", "error"]
    } else {
        &["error"]
    };
    for k in obj.keys() {
        assert!(
            allowed.contains(&k.as_str()),
            "unexpected key `{k}` in the error body {v}"
        );
    }
    let err = v
        .get("error")
        .and_then(Value::as_object)
        .unwrap_or_else(|| panic!("`error` is not an object: {v}"));
    assert_eq!(err.get("code"), Some(&json!(code)), "{v}");
    assert!(
        err.get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty()),
        "error.type: {v}"
    );
    assert!(
        err.get("message")
            .and_then(Value::as_str)
            .is_some_and(|m| m.contains(code)),
        "error.message names the code: {v}"
    );
    let d = err
        .get("details")
        .unwrap_or_else(|| panic!("no details: {v}"));
    assert_eq!(d.get("source"), Some(&json!("turnguard")), "details: {v}");
    let registry = read_json(&spec_dir().join("errors.json"));
    match registry["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["code"] == code)
    {
        Some(row) => assert_eq!(
            row["httpStatus"], status,
            "`{code}` is registered with another status"
        ),
        None => {
            // vendorCodePattern without its leading negative lookahead (the regex crate has
            // no lookaround): `(?!openwop\.)` is checked by hand.
            let pattern = registry["vendorCodePattern"].as_str().unwrap();
            let rest = pattern.replacen("(?!openwop\\.)", "", 1);
            assert_ne!(rest, pattern, "the vendor pattern changed shape: {pattern}");
            let re = regex::Regex::new(&rest).unwrap();
            assert!(
                re.is_match(code) && !code.starts_with("openwop."),
                "`{code}` is neither registered nor a vendor code"
            );
        }
    }
}

/// Served records of a run in the journal: `(node, attempt, round, truncated, calls JSON)`.
pub fn served_rows(h: &Harness, run: &str) -> Vec<(String, i64, i64, bool, String)> {
    let db = super::journal(&h.journal());
    let mut st = db
        .prepare("SELECT node_id, attempt, round_index, truncated, calls FROM served WHERE run_id = ?1 ORDER BY node_id, attempt, round_index")
        .unwrap();
    st.query_map([run], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// Effect rows of a run in the journal: `(tool_id, call_id, keying, state, attempt)`.
pub fn effect_rows(h: &Harness, run: &str) -> Vec<(String, String, String, String, i64)> {
    let db = super::journal(&h.journal());
    let mut st = db
        .prepare("SELECT tool_id, call_id, keying, state, attempt FROM effects WHERE run_id = ?1 ORDER BY at_ms, call_id")
        .unwrap();
    st.query_map([run], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

pub async fn admin_json(h: &Harness, path: &str) -> Value {
    let (status, body) = h.admin_get(path).await;
    assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap()
}

/// A validator for an OpenWOP schema whose `$ref`s point into `ids.schema.json`: the real
/// `ids.schema.json` is registered as a resource under its `$id`
/// (`https://openwop.dev/spec/v2/ids.schema.json`), so the relative `ids.schema.json#/$defs/…`
/// references resolve against the schema's own `$id`. Formats (`date-time`) are validated.
pub fn openwop_validator(schema_file: &str) -> jsonschema::Validator {
    let schema = read_json(&spec_dir().join(schema_file));
    let ids = read_json(&spec_dir().join("ids.schema.json"));
    let ids_id = ids["$id"].as_str().unwrap().to_owned();
    let registry = jsonschema::Registry::new()
        .add(ids_id, ids)
        .expect("ids schema registers")
        .prepare()
        .expect("registry");
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .with_registry(&registry)
        .should_validate_formats(true)
        .build(&schema)
        .unwrap_or_else(|e| panic!("{schema_file} does not compile: {e}"))
}

pub fn assert_valid(v: &jsonschema::Validator, doc: &Value, what: &str) {
    let errors: Vec<String> = v
        .iter_errors(doc)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{what} is invalid: {errors:?}\n{doc:#}");
}
