//! Inputs reported from the field against other agents, SDKs and gateways (issue
//! "Foundation", "Inputs from the field"): each drives turnguard over real sockets with the
//! mock provider serving one of `tests/fixtures`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use support::{own_fixtures, post_json, post_raw, script, sse_data};
use turnguard::mock_provider::Script;

fn chat_request(tools: Value, stream: bool, max_tokens: u64) -> Value {
    let mut r = json!({
        "model": "gpt-4o-mini",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "go"}],
        "tools": tools,
    });
    if stream {
        r["stream"] = json!(true);
        r["stream_options"] = json!({"include_usage": true});
    }
    r
}

fn function(name: &str, schema: Value) -> Value {
    json!({"type": "function", "function": {"name": name, "parameters": schema}})
}

fn country_schema() -> Value {
    json!({"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]})
}

/// Tool calls of a Chat stream as the official SDK accumulates them: by `index`.
fn accumulate_chat_calls(body: &[u8]) -> Vec<(u64, String, String, String)> {
    let mut calls: Vec<(u64, String, String, String)> = Vec::new();
    for chunk in sse_data(body) {
        for c in chunk["choices"].as_array().into_iter().flatten() {
            for tc in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
                let index = tc["index"].as_u64().unwrap();
                let pos = match calls.iter().position(|c| c.0 == index) {
                    Some(p) => p,
                    None => {
                        calls.push((index, String::new(), String::new(), String::new()));
                        calls.len() - 1
                    }
                };
                if let Some(id) = tc["id"].as_str() {
                    calls[pos].1.push_str(id);
                }
                if let Some(n) = tc["function"]["name"].as_str() {
                    calls[pos].2.push_str(n);
                }
                if let Some(a) = tc["function"]["arguments"].as_str() {
                    calls[pos].3.push_str(a);
                }
            }
        }
    }
    calls
}

fn chat_text(body: &[u8]) -> String {
    sse_data(body)
        .iter()
        .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["delta"]["content"].as_str().map(str::to_owned))
        .collect()
}

fn finish_reasons(body: &[u8]) -> Vec<String> {
    sse_data(body)
        .iter()
        .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["finish_reason"].as_str().map(str::to_owned))
        .collect()
}

/// The foundation behaviour: a withheld call ends the turn (`invalid = "end-turn"`).
async fn serve_one(file: &str) -> support::Harness {
    let h = support::start(Script::default()).await;
    h.script(&script(json!([{ "file": file }]), &own_fixtures()))
        .await;
    h
}

/// (call_id, outcome, stage, reason, args_hash) rows of the journal.
fn journal_calls(dir: &tempfile::TempDir) -> Vec<(String, String, String, String, Option<String>)> {
    let conn = support::journal(&dir.path().join("journal.db"));
    let mut stmt = conn
        .prepare("SELECT call_id, outcome, stage, reason, args_hash FROM tool_calls ORDER BY choice, ordinal")
        .unwrap();
    stmt.query_map([], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

#[tokio::test]
async fn tool_calls_finish_with_usage_at_the_limit_releases_no_call() {
    let h = serve_one("chat-nonstream-truncated-by-usage.json").await;
    let req = chat_request(
        json!([function("get_capital", country_schema())]),
        false,
        60,
    );
    let (status, body) = post_json(&format!("{}/v1/chat/completions", h.url()), &req, &[]).await;
    assert_eq!(status, 200);
    let resp: Value = serde_json::from_slice(&body).unwrap();
    let message = &resp["choices"][0]["message"];
    assert!(
        message.get("tool_calls").is_none(),
        "no call may be released: {message}"
    );
    assert!(message["content"]
        .as_str()
        .unwrap()
        .starts_with("[turnguard]"));
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        resp["usage"]["completion_tokens"], 60,
        "the rest of the body is kept"
    );
    let dir = h.stop().await;
    let calls = journal_calls(&dir);
    assert_eq!(calls.len(), 2);
    for (id, outcome, stage, reason, _) in &calls {
        assert_eq!(
            (outcome.as_str(), stage.as_str(), reason.as_str()),
            ("invalid", "completion", "truncated"),
            "{id}"
        );
    }
    // The first call parses, so its hash is known; the cut one does not.
    assert!(calls[0].4.is_some() && calls[1].4.is_none());
}

#[tokio::test]
async fn empty_arguments_cut_by_length_are_not_released() {
    let h = serve_one("chat-stream-empty-args-length.sse").await;
    let req = chat_request(
        json!([function("list_files", json!({"type": "object"}))]),
        true,
        16,
    );
    let (status, _, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        req.to_string().into(),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    assert!(accumulate_chat_calls(&body).is_empty());
    assert!(chat_text(&body).contains("invalid at the completion stage (truncated)"));
    assert_eq!(finish_reasons(&body), vec!["stop"]);
    assert_eq!(sse_data(&body).last().unwrap(), "[DONE]");
}

#[tokio::test]
async fn empty_arguments_with_clean_finish_are_read_as_an_empty_object() {
    // Valid against a schema without `required`: released byte for byte.
    let h = serve_one("chat-stream-empty-args-tool-calls.sse").await;
    let schema = json!({"type": "object", "properties": {"dir": {"type": "string"}}});
    let req = chat_request(json!([function("list_files", schema)]), true, 16);
    let (_, _, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        req.to_string().into(),
        &[],
    )
    .await;
    let fixture =
        std::fs::read(own_fixtures().join("chat-stream-empty-args-tool-calls.sse")).unwrap();
    assert_eq!(&body[..], &fixture[..]);
    let dir = h.stop().await;
    let calls = journal_calls(&dir);
    assert_eq!(calls[0].1, "executed");
    assert_eq!(
        calls[0].4.as_deref(),
        Some(hex::encode(Sha256::digest(b"{}")).as_str())
    );

    // Validated like any other arguments: `{}` misses a required property.
    let h = serve_one("chat-stream-empty-args-tool-calls.sse").await;
    let schema =
        json!({"type": "object", "properties": {"dir": {"type": "string"}}, "required": ["dir"]});
    let req = chat_request(json!([function("list_files", schema)]), true, 16);
    let (_, _, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        req.to_string().into(),
        &[],
    )
    .await;
    assert!(accumulate_chat_calls(&body).is_empty());
    assert!(
        chat_text(&body).contains("missing required property \"dir\""),
        "{}",
        chat_text(&body)
    );
    let dir = h.stop().await;
    assert_eq!(journal_calls(&dir)[0].2, "arguments");
}

#[tokio::test]
async fn anthropic_input_is_the_concatenation_of_its_fragments() {
    let h = serve_one("anthropic-stream-split-input-json.sse").await;
    let req = json!({
        "model": "claude-x",
        "max_tokens": 1024,
        "stream": true,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "input_schema": {
            "type": "object",
            "properties": {"location": {"const": "San Francisco"}, "unit": {"enum": ["c", "f"]}},
            "required": ["location", "unit"], "additionalProperties": false
        }}]
    });
    let (status, _, body) = post_raw(
        &format!("{}/v1/messages", h.url()),
        req.to_string().into(),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    // Neither `{}` nor a fragment would pass the schema: released means concatenated.
    let fixture =
        std::fs::read(own_fixtures().join("anthropic-stream-split-input-json.sse")).unwrap();
    assert_eq!(&body[..], &fixture[..]);
    let dir = h.stop().await;
    let calls = journal_calls(&dir);
    assert_eq!(calls[0].1, "executed");
    let expected = hex::encode(Sha256::digest(
        br#"{"location":"San Francisco","unit":"c"}"#,
    ));
    assert_eq!(calls[0].4.as_deref(), Some(expected.as_str()));
}

#[tokio::test]
async fn parallel_calls_on_one_index_stay_two_calls() {
    let h = serve_one("chat-stream-same-index-two-ids.sse").await;
    let req = chat_request(
        json!([function("get_capital", country_schema())]),
        true,
        4096,
    );
    let (_, _, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        req.to_string().into(),
        &[],
    )
    .await;
    let calls = accumulate_chat_calls(&body);
    assert_eq!(
        calls,
        vec![
            (
                0,
                "call_p1".into(),
                "get_capital".into(),
                r#"{"country":"UK"}"#.into()
            ),
            (
                1,
                "call_p2".into(),
                "get_capital".into(),
                r#"{"country":"FR"}"#.into()
            ),
        ]
    );
    let dir = h.stop().await;
    let rows = journal_calls(&dir);
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r.1 == "executed"));
}

#[tokio::test]
async fn missing_required_property_is_invalid() {
    let h = serve_one("chat-nonstream-required-missing.json").await;
    let req = chat_request(
        json!([function("get_capital", country_schema())]),
        false,
        4096,
    );
    let (_, body) = post_json(&format!("{}/v1/chat/completions", h.url()), &req, &[]).await;
    let resp: Value = serde_json::from_slice(&body).unwrap();
    assert!(resp["choices"][0]["message"].get("tool_calls").is_none());
    let text = resp["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        text.contains("invalid at the arguments stage (schema_violation)")
            && text.contains("\"country\""),
        "{text}"
    );
    let dir = h.stop().await;
    let rows = journal_calls(&dir);
    assert_eq!(
        (rows[0].1.as_str(), rows[0].2.as_str()),
        ("invalid", "arguments")
    );
}

#[tokio::test]
async fn text_shaped_like_a_call_stays_text() {
    let delete = function("delete_file", json!({"type": "object"}));
    for (file, stream) in [
        ("chat-nonstream-text-shaped-like-call.json", false),
        ("chat-stream-text-shaped-like-call.sse", true),
    ] {
        let h = serve_one(file).await;
        let req = chat_request(json!([delete.clone()]), stream, 4096);
        let (_, _, body) = post_raw(
            &format!("{}/v1/chat/completions", h.url()),
            req.to_string().into(),
            &[],
        )
        .await;
        let fixture = std::fs::read(own_fixtures().join(file)).unwrap();
        assert_eq!(&body[..], &fixture[..], "{file} passes through unchanged");
        let dir = h.stop().await;
        assert!(
            journal_calls(&dir).is_empty(),
            "{file}: no tool call exists"
        );
    }
}
