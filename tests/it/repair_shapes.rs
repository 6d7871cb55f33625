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
        .filter(|c| c.get("choices").is_some_and(|c| !c.as_array().unwrap().is_empty()))
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
        .filter_map(|c| c.pointer("/choices/0/delta/content").and_then(Value::as_str))
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
