//! What a repair round looks like to the agent and to the provider, over real sockets with
//! the mock provider playing the model (issue 12, compat findings F2 and F4): a repaired Chat
//! stream still carries `delta.role` once per choice; an Anthropic repair turn replays the
//! assistant message the model sent — thinking, text and `tool_use` blocks in order, with the
//! call's real input.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)] // test code

use crate::support;

use serde_json::{json, Value};
use support::{post_raw, sse_data};

const BUNDLE: &str = "policy-compat";

fn weather_tool_chat() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
}

#[tokio::test]
async fn a_repaired_chat_stream_carries_the_role_once_on_its_first_chunk() {
    let h = support::start_with_policy(turnguard::mock_provider::Script::default(), BUNDLE).await;
    h.script(&json!({"responses": [
        {"reply": {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}], "truncated": true}},
        {"reply": {"text": "I could not finish that call."}}
    ]}))
    .await;
    let body = json!({"model": "m", "stream": true, "tools": weather_tool_chat(),
        "messages": [{"role": "user", "content": "weather in Paris?"}]});
    let (status, _, bytes) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        body.to_string().into(),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let chunks: Vec<Value> = sse_data(&bytes)
        .into_iter()
        .filter(|c| {
            c.get("choices")
                .is_some_and(|c| !c.as_array().unwrap().is_empty())
        })
        .collect();
    let roles: Vec<(usize, &Value)> = chunks
        .iter()
        .enumerate()
        .filter_map(|(k, c)| c.pointer("/choices/0/delta/role").map(|r| (k, r)))
        .collect();
    assert_eq!(
        roles,
        vec![(0, &json!("assistant"))],
        "one role, on the first chunk: {chunks:?}"
    );
    let text: String = chunks
        .iter()
        .filter_map(|c| {
            c.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(text, "I could not finish that call.");
    assert_eq!(
        h.mock_requests()
            .await
            .iter()
            .filter(|r| r["path"] == "/v1/chat/completions")
            .count(),
        2,
        "one repair round"
    );
    h.stop().await;
}

fn weather_tool_anthropic() -> Value {
    json!([{"name": "get_weather", "input_schema": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}])
}

fn messages_request(stream: bool) -> Value {
    json!({"model": "claude-x", "max_tokens": 4096, "stream": stream,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": weather_tool_anthropic(),
        "messages": [{"role": "user", "content": "weather in Paris?"}]})
}

/// The assistant message of the mock's second (repair) request.
async fn repair_assistant(h: &support::Harness) -> Value {
    let requests = h.mock_requests().await;
    let bodies: Vec<&Value> = requests
        .iter()
        .filter(|r| r["path"] == "/v1/messages")
        .map(|r| &r["body"])
        .collect();
    assert_eq!(bodies.len(), 2, "one repair round: {requests:?}");
    let messages = bodies[1]["messages"].as_array().unwrap();
    messages[messages.len() - 2].clone()
}

#[tokio::test]
async fn an_anthropic_repair_turn_replays_thinking_text_and_the_real_input_in_order() {
    for stream in [false, true] {
        let h =
            support::start_with_policy(turnguard::mock_provider::Script::default(), BUNDLE).await;
        // `town` instead of the required `city`: invalid at the arguments stage, repaired.
        h.script(&json!({"strict_thinking": true, "responses": [
            {"reply": {"reasoning": "Look it up.", "text": "Checking.",
                "tool_calls": [{"name": "get_weather", "arguments": {"town": "Paris"}}]}},
            {"reply": {"reasoning": "Give up.", "text": "I could not look it up."}}
        ]}))
        .await;
        let (status, _, body) = post_raw(
            &format!("{}/v1/messages", h.url()),
            messages_request(stream).to_string().into(),
            &[],
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let assistant = repair_assistant(&h).await;
        assert_eq!(assistant["role"], "assistant");
        let content = assistant["content"].as_array().unwrap();
        let types: Vec<&str> = content.iter().filter_map(|b| b["type"].as_str()).collect();
        assert_eq!(
            types,
            vec!["thinking", "text", "tool_use"],
            "stream {stream}: {content:?}"
        );
        assert_eq!(content[0]["thinking"], "Look it up.");
        assert!(
            content[0]["signature"]
                .as_str()
                .is_some_and(|s| s.starts_with("mock-signature-")),
            "{content:?}"
        );
        assert_eq!(content[1]["text"], "Checking.");
        assert_eq!(
            content[2]["input"],
            json!({"town": "Paris"}),
            "stream {stream}"
        );
        h.stop().await;
    }
}

#[tokio::test]
async fn anthropic_structured_output_is_a_structured_channel() {
    let h = support::start_with_policy(turnguard::mock_provider::Script::default(), BUNDLE).await;
    h.script(&json!({"responses": [
        {"reply": {"text": "{\"answer\": 42}"}},
        {"reply": {"text": "{\"answer\": \"forty-two\"}"}}
    ]}))
    .await;
    let body = json!({"model": "claude-x", "max_tokens": 1024,
        "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"answer": {"type": "string"}},
            "required": ["answer"], "additionalProperties": false}}},
        "messages": [{"role": "user", "content": "the answer?"}]});
    let (status, bytes) = support::post_json(&format!("{}/v1/messages", h.url()), &body, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let resp: Value = serde_json::from_slice(&bytes).unwrap();
    let text: String = resp["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["text"].as_str())
        .collect();
    assert_eq!(text, "{\"answer\": \"forty-two\"}", "{resp}");
    let n = h
        .mock_requests()
        .await
        .iter()
        .filter(|r| r["path"] == "/v1/messages")
        .count();
    assert_eq!(n, 2, "the answer outside the schema was repaired");
    h.stop().await;
}
