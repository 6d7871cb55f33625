//! `redaction.strip_from_egress`: a secret in the arguments of a call to an egress tool is
//! replaced by its redaction marker in what the agent receives (JSON and streams); a tool
//! without egress gets its arguments unchanged.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)] // test code

use crate::support;

use serde_json::{json, Value};
use support::{post_raw, sse_data};
use turnguard::mock_provider::Script;

const KEY: &str = "sk-proj-0123456789abcdefghijklmnopqrstuv";

fn chat_response(name: &str, args: &Value) -> Value {
    json!({"id": "chatcmpl-strip", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_s1", "type": "function", "function": {"name": name, "arguments": args.to_string()}}]},
            "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
}

fn chat_request(stream: bool) -> Value {
    json!({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "go"}],
    "tools": [
        {"type": "function", "function": {"name": "post_webhook", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "save_note", "parameters": {"type": "object"}}}
    ]})
}

#[tokio::test]
async fn secrets_are_stripped_from_calls_to_egress_tools_only() {
    let h = support::start_with_policy(Script::default(), "policy-strip").await;
    let egress_args = json!({"url": "https://hooks.example/x", "token": KEY});
    let note_args = json!({"text": format!("remember {KEY}")});
    // Stream: the arguments arrive in fragments that split the key.
    let raw = egress_args.to_string();
    let (a, b) = raw.split_at(raw.find("sk-proj").unwrap() + 10);
    let chunk = |delta: Value, finish: Value| {
        format!(
            "data: {}",
            json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        )
    };
    let stream = vec![
        chunk(
            json!({"role": "assistant", "content": null, "tool_calls": [{"index": 0, "id": "call_s2", "type": "function", "function": {"name": "post_webhook", "arguments": ""}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": a}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": b}}]}),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
        "data: [DONE]".to_owned(),
    ];
    let anthropic = vec![
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_s\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"c\",\"content\":[],\"stop_reason\":null,\"usage\":{\"input_tokens\":1,\"output_tokens\":1}}}".to_owned(),
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_s\",\"name\":\"post_webhook\",\"input\":{}}}".to_owned(),
        format!("event: content_block_delta\ndata: {}", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": a}})),
        format!("event: content_block_delta\ndata: {}", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": b}})),
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}".to_owned(),
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\"},\"usage\":{\"output_tokens\":9}}".to_owned(),
        "event: message_stop\ndata: {\"type\":\"message_stop\"}".to_owned(),
    ];
    h.script(&json!({"responses": [
        {"json": chat_response("post_webhook", &egress_args)},
        {"json": chat_response("save_note", &note_args)},
        {"sse": stream},
        {"sse": anthropic}
    ]}))
    .await;
    let url = format!("{}/v1/chat/completions", h.url());

    let (_, _, body) = post_raw(&url, chat_request(false).to_string().into(), &[]).await;
    let resp: Value = serde_json::from_slice(&body).unwrap();
    let args: Value = serde_json::from_str(
        resp["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        args,
        json!({"url": "https://hooks.example/x", "token": "[REDACTED:api-key]"})
    );

    let (_, _, body) = post_raw(&url, chat_request(false).to_string().into(), &[]).await;
    assert!(
        String::from_utf8_lossy(&body).contains(KEY),
        "a tool without egress gets its arguments unchanged"
    );

    let (_, _, body) = post_raw(&url, chat_request(true).to_string().into(), &[]).await;
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains("0123456789abcdef"),
        "no fragment of the key is released: {text}"
    );
    let streamed: String = sse_data(&body)
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&streamed).unwrap()["token"],
        "[REDACTED:api-key]"
    );
    assert_eq!(sse_data(&body).last().unwrap(), "[DONE]");

    let req = json!({"model": "c", "max_tokens": 100, "stream": true, "messages": [{"role": "user", "content": "go"}],
        "tools": [{"name": "post_webhook", "input_schema": {"type": "object"}}]});
    let (_, _, body) = post_raw(
        &format!("{}/v1/messages", h.url()),
        req.to_string().into(),
        &[],
    )
    .await;
    let text = String::from_utf8_lossy(&body);
    assert!(!text.contains("0123456789abcdef"), "{text}");
    let partial: String = sse_data(&body)
        .iter()
        .filter_map(|e| e["delta"]["partial_json"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&partial).unwrap()["token"],
        "[REDACTED:api-key]"
    );
    assert!(
        text.contains("\"stop_reason\":\"tool_use\""),
        "the call is released: {text}"
    );
}

/// A streamed Responses answer's argument deltas cannot be rewritten (the adapter says so:
/// `Turn::arguments_fixed`), so a call that must have a secret stripped before an egress tool
/// is refused (`strip_unsupported`, fail closed): no fragment of the key reaches the agent.
/// The same call in a JSON Responses answer is released with the secret stripped.
#[tokio::test]
async fn a_streamed_responses_call_that_needs_stripping_is_refused() {
    let h = support::start_with_policy(Script::default(), "policy-strip").await;
    let args = json!({"url": "https://hooks.example/x", "token": KEY}).to_string();
    let (a, b) = args.split_at(args.find("sk-proj").unwrap() + 10);
    let item = json!({"type": "function_call", "id": "fc_1", "call_id": "call_r1", "name": "post_webhook", "arguments": "", "status": "in_progress"});
    let done_item = json!({"type": "function_call", "id": "fc_1", "call_id": "call_r1", "name": "post_webhook", "arguments": args, "status": "completed"});
    let response = |status: &str, output: Value| json!({"id": "resp_s", "object": "response", "created_at": 1, "status": status, "model": "m", "output": output});
    let ev = |seq: u64, mut v: Value| {
        v.as_object_mut()
            .unwrap()
            .insert("sequence_number".into(), json!(seq));
        let ty = v["type"].as_str().unwrap().to_owned();
        format!("event: {ty}\ndata: {v}")
    };
    let stream = vec![
        ev(
            0,
            json!({"type": "response.created", "response": response("in_progress", json!([]))}),
        ),
        ev(
            1,
            json!({"type": "response.output_item.added", "output_index": 0, "item": item}),
        ),
        ev(
            2,
            json!({"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0, "delta": a}),
        ),
        ev(
            3,
            json!({"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0, "delta": b}),
        ),
        ev(
            4,
            json!({"type": "response.function_call_arguments.done", "item_id": "fc_1", "output_index": 0, "arguments": args}),
        ),
        ev(
            5,
            json!({"type": "response.output_item.done", "output_index": 0, "item": done_item}),
        ),
        ev(
            6,
            json!({"type": "response.completed", "response": response("completed", json!([done_item]))}),
        ),
    ];
    h.script(&json!({"responses": [
        {"sse": stream},
        {"json": response("completed", json!([done_item]))}
    ]}))
    .await;
    let url = format!("{}/v1/responses", h.url());
    let request = |stream: bool| {
        json!({"model": "m", "stream": stream, "input": "go",
            "tools": [{"type": "function", "name": "post_webhook", "parameters": {"type": "object"}}]})
    };

    let (_, _, body) = post_raw(&url, request(true).to_string().into(), &[]).await;
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains("0123456789abcdef"),
        "no fragment of the key is released: {text}"
    );
    assert!(
        !text.contains("\"call_r1\""),
        "the call is not released: {text}"
    );
    assert!(
        text.contains("refused at the redaction stage (strip_unsupported)"),
        "the agent is told why: {text}"
    );

    let (_, _, body) = post_raw(&url, request(false).to_string().into(), &[]).await;
    let text = String::from_utf8_lossy(&body);
    assert!(!text.contains(KEY), "{text}");
    assert!(
        text.contains("call_r1"),
        "the JSON answer's call is released, stripped: {text}"
    );
}
