//! What the journal keeps of a round's response (`journal_bodies`): a chat turn (no
//! `Turnguard-Run`) is out of replay and recovery (tool-turn contract §D), so by default its
//! round keeps the decisions and the body's digest and size, not the body; a run's round keeps
//! its (redacted) body, which recovery and replay serve; `journal_bodies = "all"` keeps both.
//! The same for a call's arguments: a chat turn's calls keep their `argsHash`, a run's calls
//! their (redacted) arguments too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)] // test code

use serde_json::{json, Value};
use turnguard::config::JournalBodies;
use turnguard::mock_provider::Script;

use crate::support;

fn answer(text: &str) -> Value {
    json!({"json": {
        "id": "chatcmpl-bodies", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    }})
}

/// Sends `body` as a chat turn (`x-request-id: chat`) and as a run's turn (`run`, in run
/// `run-id`), then stops turnguard and opens its journal.
async fn chat_then_run(
    h: support::Harness,
    body: &Value,
    [chat, run]: [&str; 2],
    run_id: &str,
) -> (support::Db, tempfile::TempDir) {
    let url = format!("{}/v1/chat/completions", h.url());
    for headers in [
        vec![("x-request-id", chat.to_owned())],
        vec![
            ("x-request-id", run.to_owned()),
            ("turnguard-run", run_id.to_owned()),
        ],
    ] {
        let (status, _, resp) = support::call("POST", &url, &headers, Some(body)).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    }
    let dir = h.stop().await;
    (support::journal(&dir.path().join("journal.db")), dir)
}

/// Sends a chat turn (`x-request-id: chat-1`) and a run's turn (`run-1`), stops turnguard and
/// returns (bytes kept, digest) of each round's response.
async fn rounds(bodies: JournalBodies) -> [(i64, String); 2] {
    let h = support::start_with(Script::default(), move |c| c.journal_bodies = bodies).await;
    h.script(&json!({"responses": [answer("hello from a chat turn"), answer("hello from a run")]}))
        .await;
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]});
    let (db, _dir) = chat_then_run(h, &body, ["chat-1", "run-1"], "run-bodies").await;
    ["chat-1", "run-1"].map(|client| {
        db.query_row(
            "SELECT coalesce(length(response), 0), response_digest FROM rounds WHERE client_request_id = ?1",
            [client],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_chat_turn_keeps_the_digest_not_the_body_by_default() {
    let [chat, run] = rounds(JournalBodies::Runs).await;
    assert_eq!(chat.0, 0, "a chat turn's body is not kept");
    assert_eq!(chat.1.len(), 64, "its digest is: {}", chat.1);
    assert!(
        run.0 > 0,
        "a run's round keeps its body (recovery serves it)"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn journal_bodies_all_keeps_chat_turn_bodies_too() {
    let [chat, run] = rounds(JournalBodies::All).await;
    assert!(
        chat.0 > 0,
        "journal_bodies = all keeps the chat turn's body"
    );
    assert!(run.0 > 0);
}

/// A chat turn (`chat-call`) and a run's turn (`run-call`) that each call `get_weather` with
/// the same arguments; returns (argsHash, arguments kept) of each call.
async fn calls(bodies: JournalBodies) -> [(String, Option<String>); 2] {
    let h = support::start_with(Script::default(), move |c| c.journal_bodies = bodies).await;
    let call = |id: &str| {
        json!({"json": {
            "id": "chatcmpl-call", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
                "tool_calls": [{"id": id, "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        }})
    };
    h.script(&json!({"responses": [call("call_chat"), call("call_run")]}))
        .await;
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]});
    let (db, _dir) = chat_then_run(h, &body, ["chat-call", "run-call"], "run-calls").await;
    ["chat-call", "run-call"].map(|client| {
        db.query_row(
            "SELECT c.args_hash, c.redacted_args FROM tool_calls c JOIN rounds r USING (request_id)
             WHERE r.client_request_id = ?1",
            [client],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
    })
}

const ARGS: &str = r#"{"location": "Paris", "units": "c"}"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_chat_turn_keeps_its_calls_args_hash_not_their_arguments_by_default() {
    let [chat, run] = calls(JournalBodies::Runs).await;
    assert_eq!(chat.0.len(), 64, "the chat turn's call keeps its argsHash");
    assert_eq!(chat.0, run.0, "the same arguments, the same argsHash");
    assert_eq!(chat.1, None, "a chat turn's arguments are not kept");
    assert_eq!(
        run.1.as_deref(),
        Some(ARGS),
        "a run's call keeps its arguments"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn journal_bodies_all_keeps_chat_turn_arguments_too() {
    let [chat, run] = calls(JournalBodies::All).await;
    assert_eq!(chat.1.as_deref(), Some(ARGS));
    assert_eq!(run.1.as_deref(), Some(ARGS));
}
