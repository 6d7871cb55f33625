//! The structured and prompted channels (tool-turn contract §A): a text answer with a schema
//! is validated (JSON and streams), repaired within `repair_rounds`, refused after, and never
//! dispatched as a tool.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)] // test code

use crate::support;

use serde_json::{json, Value};
use support::{post_raw, sse_data};
use turnguard::mock_provider::Script;

fn answer(text: &str) -> Value {
    json!({"id": "chatcmpl-p", "object": "chat.completion", "created": 1, "model": "llama-3",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}})
}

fn stream_answer(pieces: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = pieces
        .iter()
        .map(|p| format!("data: {}", json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "llama-3", "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": null}]})))
        .collect();
    out.push(format!("data: {}", json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "llama-3", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})));
    out.push("data: [DONE]".into());
    out
}

fn request(model: &str, stream: bool) -> Value {
    json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "2+2? answer as JSON"}]})
}

const VALID: &str = r#"{"answer": "4", "confidence": 0.9}"#;

#[tokio::test]
async fn prompted_answers_are_validated_repaired_and_refused() {
    let h = support::start_with_policy(Script::default(), "policy-prompted").await;
    let url = format!("{}/v1/chat/completions", h.url());
    h.script(&json!({"responses": [
        {"json": answer("four")},
        {"json": answer(&format!("```json\n{VALID}\n```"))},
        {"json": answer(r#"{"answer": 4}"#)},
        {"json": answer("still not JSON")},
        {"json": answer(r#"{"name": "delete_file", "arguments": {"path": "/"}}"#)},
        {"json": answer("{}")}
    ]}))
    .await;

    // Routed by model: the first answer is not JSON, so the model is asked again with
    // host-authored feedback; the agent sees only the valid answer.
    let (status, _, body) = post_raw(&url, request("llama-3", false).to_string().into(), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let resp: Value = serde_json::from_slice(&body).unwrap();
    assert!(resp["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .contains("\"answer\": \"4\""));
    let seen = h.mock_requests().await;
    let repair = seen[1]["body"]["messages"].as_array().unwrap();
    assert_eq!(
        repair[1]["content"], "four",
        "the answer goes back as the assistant turn"
    );
    let feedback = repair[2]["content"].as_str().unwrap();
    assert!(
        feedback.starts_with("turnguard:") && feedback.contains("not a JSON document"),
        "{feedback}"
    );

    // By header, for any model: two invalid answers spend the one repair round → 422.
    let (status, _, body) = post_raw(
        &url,
        request("gpt-4o", false).to_string().into(),
        &[("turnguard-prompted-schema", "answer")],
    )
    .await;
    assert_eq!(status, 422, "{}", String::from_utf8_lossy(&body));
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["error"]["code"], "envelope_invalid");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("prompted"));

    // Text shaped like a tool call is a (schema-invalid) prompted answer, never a call.
    let (status, _, body) = post_raw(&url, request("llama-3", false).to_string().into(), &[]).await;
    assert_eq!(status, 422, "{}", String::from_utf8_lossy(&body));

    // An unknown schema name is the agent's error.
    let (status, _, body) = post_raw(
        &url,
        request("gpt-4o", false).to_string().into(),
        &[("turnguard-prompted-schema", "nope")],
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        String::from_utf8_lossy(&body).contains("answer"),
        "the error lists the bundle's schemas"
    );

    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let mut st = conn
        .prepare("SELECT channel, channel_result, state FROM rounds ORDER BY id")
        .unwrap();
    let rows: Vec<(Option<String>, Option<String>, String)> = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        rows[0],
        (
            Some("prompted".into()),
            Some("not_json".into()),
            "repaired".into()
        )
    );
    assert_eq!(
        rows[1],
        (Some("prompted".into()), Some("valid".into()), "ok".into())
    );
    assert_eq!(rows[3].2, "surfaced_error");
    let calls: i64 = conn
        .query_row("SELECT count(*) FROM tool_calls", [], |r| r.get(0))
        .unwrap();
    assert_eq!(calls, 0, "no prompted text became a tool call");
}

#[tokio::test]
async fn streamed_prompted_answers_hold_only_the_terminal_event() {
    let h = support::start_with_policy(Script::default(), "policy-prompted").await;
    let url = format!("{}/v1/chat/completions", h.url());
    h.script(&json!({"responses": [
        {"sse": stream_answer(&["{\"answer\": ", "\"4\", \"confidence\": 1}"])},
        {"sse": stream_answer(&["four"])}
    ]}))
    .await;
    let (_, _, body) = post_raw(&url, request("llama-3", true).to_string().into(), &[]).await;
    let data = sse_data(&body);
    assert_eq!(
        data.last().unwrap(),
        "[DONE]",
        "a valid answer ends normally"
    );

    let (_, _, body) = post_raw(&url, request("llama-3", true).to_string().into(), &[]).await;
    let data = sse_data(&body);
    assert_eq!(
        data[0]["choices"][0]["delta"]["content"], "four",
        "text streams as it arrives"
    );
    let last = data.last().unwrap();
    assert_eq!(last["error"]["code"], "envelope_invalid", "{last}");
    assert!(!data.iter().any(|d| d == "[DONE]"));
}

#[tokio::test]
async fn structured_output_is_still_checked_against_its_schema() {
    let h = support::start(Script::default()).await;
    let schema = json!({"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}, "additionalProperties": false});
    let req = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "where?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "Location", "schema": schema, "strict": true}}});
    let refusal = json!({"id": "chatcmpl-r", "object": "chat.completion", "created": 1, "model": "gpt-4o",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "refusal": "I can't help with that."}, "finish_reason": "stop"}]});
    h.script(&json!({"responses": [
        {"json": answer(r#"{"city": "Paris"}"#)},
        {"json": answer(r#"{"town": "Paris"}"#)},
        {"json": refusal}
    ]}))
    .await;
    let url = format!("{}/v1/chat/completions", h.url());
    let (status, _, _) = post_raw(&url, req.to_string().into(), &[]).await;
    assert_eq!(status, 200);
    // The policy-open bundle ends turns instead of repairing, and has repair_rounds = 2 by
    // default: an invalid structured answer is repaired; the mock has a refusal next, which is
    // the answer and is not retried.
    let (status, _, body) = post_raw(&url, req.to_string().into(), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let resp: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        resp["choices"][0]["message"]["refusal"],
        "I can't help with that."
    );
    assert_eq!(
        h.mock_requests().await.len(),
        3,
        "one repair, and the refusal was not retried"
    );
}
