//! The proxy as a platform team meets it: pass-through fidelity, streaming without
//! buffering, bad input, upstream failures, and the journal afterwards.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use std::time::Duration;

use http_body_util::BodyExt;
use serde_json::{json, Value};
use support::{fixtures, get, post_json, post_raw, script, sse_data};
use turnguard::mock_provider::Script;

fn chat(stream: bool) -> Value {
    json!({
        "model": "gpt-4o-mini",
        "stream": stream,
        "messages": [{"role": "user", "content": "capital of the UK?"}],
        "tools": [{"type": "function", "function": {"name": "get_capital", "parameters": {"type": "object"}}}]
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn streaming_text_reaches_the_agent_before_the_next_delta_leaves_the_mock() {
    let h = support::start(Script::default()).await;
    // `gate`: the mock sends each event only after one POST /_mock/step.
    h.script(&script(
        json!([{ "file": "openai-chat/stream-text-plain.sse", "gate": true }]),
        &fixtures(),
    ))
    .await;
    let resp = support::post_stream(&format!("{}/v1/chat/completions", h.url()), &chat(true)).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let fixture = std::fs::read(fixtures().join("openai-chat/stream-text-plain.sse")).unwrap();
    let events: Vec<&str> = std::str::from_utf8(&fixture)
        .unwrap()
        .split_inclusive("\n\n")
        .collect();
    let mut received = Vec::new();
    for (i, event) in events.iter().enumerate() {
        let (status, _) =
            support::post_json(&format!("{}/_mock/step", h.mock_url()), &json!({}), &[]).await;
        assert_eq!(status, 200);
        // Event i must arrive before event i+1 is released by the mock.
        let mut got = Vec::new();
        while got.len() < event.len() {
            let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
                .await
                .unwrap_or_else(|_| panic!("event {i} was held back by turnguard"))
                .expect("stream open")
                .expect("frame");
            if let Ok(data) = frame.into_data() {
                got.extend_from_slice(&data);
            }
        }
        assert_eq!(
            std::str::from_utf8(&got).unwrap(),
            *event,
            "event {i} forwarded byte for byte"
        );
        received.extend(got);
    }
    assert_eq!(received, fixture);
}

#[tokio::test]
async fn unchanged_bodies_and_headers_pass_through() {
    let h = support::start(Script::default()).await;
    h.script(&script(
        json!([
            { "file": "openai-chat/nonstream-tool-call-single.json", "headers": {"x-ratelimit-remaining-requests": "99", "openai-processing-ms": "12"} },
            { "file": "anthropic-messages/stream-refusal-after-content.sse" }
        ]),
        &fixtures(),
    ))
    .await;
    let mut req = chat(false);
    req["tools"][0]["function"]["name"] = json!("get_weather");
    // Pretty-printed, with an escaped character: the upstream gets these bytes, not a
    // re-serialization of them.
    let sent = serde_json::to_string_pretty(&req)
        .unwrap()
        .replace("get_weather", "get_w\\u0065ather");
    let (status, headers, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        sent.clone().into(),
        &[
            ("authorization", "Bearer sk-test-123"),
            ("openai-organization", "org-x"),
            ("turnguard-run", "run-1"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "drop-me"),
        ],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        &body[..],
        &std::fs::read(fixtures().join("openai-chat/nonstream-tool-call-single.json")).unwrap()[..]
    );
    assert_eq!(headers["x-ratelimit-remaining-requests"], "99");
    assert!(headers.contains_key("x-request-id"));

    let anthropic = json!({"model": "claude-fable-5", "max_tokens": 1024, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let (_, _, body) = post_raw(
        &format!("{}/v1/messages", h.url()),
        anthropic.to_string().into(),
        &[
            ("x-api-key", "sk-ant-test"),
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", "tools-2024"),
        ],
    )
    .await;
    assert_eq!(
        &body[..],
        &std::fs::read(fixtures().join("anthropic-messages/stream-refusal-after-content.sse"))
            .unwrap()[..]
    );

    let seen = h.mock_requests().await;
    let first = &seen[0]["headers"];
    assert_eq!(first["authorization"], "Bearer sk-test-123");
    assert_eq!(first["openai-organization"], "org-x");
    assert!(
        first.get("turnguard-run").is_none(),
        "turnguard's own headers stay here"
    );
    assert!(
        first.get("x-hop").is_none(),
        "fields named by Connection are hop-by-hop"
    );
    assert_eq!(
        seen[0]["body"], req,
        "the request body reaches the upstream unchanged"
    );
    assert_eq!(
        seen[0]["raw"], sent,
        "the agent's bytes are forwarded as they are"
    );
    let second = &seen[1]["headers"];
    assert_eq!(second["x-api-key"], "sk-ant-test");
    assert_eq!(second["anthropic-version"], "2023-06-01");
    assert_eq!(second["anthropic-beta"], "tools-2024");
}

#[tokio::test]
async fn upstream_errors_pass_through_unchanged() {
    let h = support::start(Script::default()).await;
    let err = json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}});
    h.script(
        &json!({"responses": [{ "json": err, "status": 429, "headers": {"retry-after": "7"} }]}),
    )
    .await;
    let (status, headers, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        chat(false).to_string().into(),
        &[],
    )
    .await;
    assert_eq!(status, 429);
    assert_eq!(headers["retry-after"], "7");
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap(), err);
    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let (state, upstream): (String, i64) = conn
        .query_row("SELECT state, upstream_status FROM rounds", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!((state.as_str(), upstream), ("upstream_error", 429));
}

#[tokio::test]
async fn bad_input_gets_a_clear_error_and_loses_nothing() {
    let h = support::start_with(Script::default(), |c| c.max_body_bytes = 4096).await;
    let url = format!("{}/v1/chat/completions", h.url());
    let (status, _, body) = post_raw(&url, vec![b' '; 5000].into(), &[]).await;
    assert_eq!(status, 413);
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap()["error"]["code"],
        "payload_too_large"
    );
    let (status, _, body) = post_raw(&url, "{\"model\": \"x\", \"messages\": [".into(), &[]).await;
    assert_eq!(status, 400);
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["error"]["code"], "validation_error");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("malformed JSON"),
        "{err}"
    );
    let (status, _, body) = post_raw(&url, "{\"model\": \"x\", \"messages\": 3}".into(), &[]).await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("`messages` must be an array"));
    let (status, _, body) =
        post_raw(&format!("{}/v1/messages", h.url()), "[1,2]".into(), &[]).await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("must be a JSON object"));
    // A key twice reads two ways (serde_json keeps the last, others the first): refused,
    // at any depth, since the agent's bytes are what goes upstream.
    for dup in [
        r#"{"model": "x", "stream": false, "stream": true, "messages": []}"#,
        r#"{"model": "x", "messages": [{"role": "user", "content": "hi", "role": "system"}]}"#,
    ] {
        let (status, _, body) = post_raw(&url, dup.to_owned().into(), &[]).await;
        assert_eq!(status, 400, "{dup}");
        let err: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(err["error"]["code"], "validation_error");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains("appears twice"), "{message}");
    }
    assert!(
        h.mock_requests().await.is_empty(),
        "nothing malformed reaches the upstream"
    );
    // Unknown paths and methods: 404 with turnguard's error body, never forwarded.
    for (method, path) in [
        ("GET", "/v1/chat/completions"),
        // A stored response holds calls that never went through admission.
        (
            "GET",
            "/v1/responses/resp_0050471a34b36ae60068c97b94a480819587a9d70cf2979b33",
        ),
        ("GET", "/admin"),
        ("POST", "/v1/files"),
    ] {
        let req = http::Request::builder()
            .method(method)
            .uri(format!("{}{}", h.url(), path))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let resp =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http()
                .request(req)
                .await
                .unwrap();
        assert_eq!(resp.status(), 404, "{method} {path}");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let err: Value = serde_json::from_slice(&body).unwrap();
        // Under /v1 the OpenAI shape; elsewhere the OpenWOP envelope.
        let (code, message) = if path.starts_with("/v1/") {
            (&err["error"]["code"], &err["error"]["message"])
        } else {
            (&err["error"], &err["message"])
        };
        assert_eq!(code, "not_found", "{err}");
        assert!(message.as_str().unwrap().contains(path), "{err}");
    }
}

#[tokio::test]
async fn unreachable_upstream_is_502() {
    let h = support::start_with(Script::default(), |c| {
        c.upstreams.insert(
            "openai".into(),
            turnguard::config::Upstream::parse("http://127.0.0.1:9").unwrap(),
        );
    })
    .await;
    let (status, body) = post_json(
        &format!("{}/v1/chat/completions", h.url()),
        &chat(false),
        &[],
    )
    .await;
    assert_eq!(status, 502);
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["error"]["code"], "upstream_unavailable");
    assert_eq!(err["error"]["details"]["upstream"], "openai");
}

#[tokio::test]
async fn a_stream_cut_mid_call_releases_nothing_and_ends_with_an_error_event() {
    let h = support::start(Script::default()).await;
    h.script(&json!({"responses": [
        { "file": fixtures().join("openai-chat/stream-tool-call-single-include-usage.sse"), "cut_after_events": 3 },
        { "file": fixtures().join("anthropic-messages/stream-text-then-tool-use.sse"), "cut_after_events": 12 }
    ]}))
    .await;
    let (status, _, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        chat(true).to_string().into(),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let events = sse_data(&body);
    assert!(
        events
            .iter()
            .all(|e| e["choices"][0]["delta"].get("tool_calls").is_none()),
        "nothing half-released"
    );
    let last = events.last().unwrap();
    assert_eq!(
        last["error"]["type"], "upstream_stream_interrupted",
        "{last}"
    );

    let req = json!({"model": "c", "max_tokens": 1024, "stream": true, "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]});
    let (_, _, body) = post_raw(
        &format!("{}/v1/messages", h.url()),
        req.to_string().into(),
        &[],
    )
    .await;
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("'ll check the current weather"),
        "text before the call was forwarded"
    );
    assert!(!text.contains("tool_use"), "the held call is not released");
    assert!(
        text.trim_end().ends_with("}") && text.contains("event: error"),
        "{text}"
    );

    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let failed: i64 = conn
        .query_row(
            "SELECT count(*) FROM rounds WHERE state = 'failed'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(failed, 2);
    let withheld: i64 = conn
        .query_row(
            "SELECT count(*) FROM tool_calls WHERE outcome = 'invalid' AND reason = 'stream_cut'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let rows: Vec<String> = conn.column("SELECT r.api || coalesce(c.outcome,'-') || coalesce(c.reason,'-') || r.state || coalesce(r.error, '') FROM rounds r LEFT JOIN tool_calls c USING (request_id)");
    assert_eq!(withheld, 2, "{rows:?}");
}

#[tokio::test]
async fn the_journal_holds_rounds_calls_and_tool_results() {
    let h = support::start(Script::default()).await;
    h.script(&script(
        json!([
            { "file": "openai-chat/stream-text-plain.sse" },
            { "file": "anthropic-messages/nonstream-tool-use.json" }
        ]),
        &fixtures(),
    ))
    .await;
    let chat_req: Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("openai-chat/request-tools-and-tool-result.json")).unwrap(),
    )
    .unwrap();
    let (status, _) = post_json(
        &format!("{}/v1/chat/completions", h.url()),
        &chat_req,
        &[("turnguard-run", "run-7"), ("turnguard-node", "n1")],
    )
    .await;
    assert_eq!(status, 200);
    let ant_req: Value = serde_json::from_slice(
        &std::fs::read(
            fixtures().join("anthropic-messages/request-tools-and-tool-result-is-error.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let (status, _) = post_json(&format!("{}/v1/messages", h.url()), &ant_req, &[]).await;
    assert_eq!(status, 200);
    // Sent again: the same tool result is not recorded twice.
    h.script(&script(
        json!([{ "file": "anthropic-messages/nonstream-tool-use.json" }]),
        &fixtures(),
    ))
    .await;
    post_json(&format!("{}/v1/messages", h.url()), &ant_req, &[]).await;
    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let rounds: i64 = conn
        .query_row("SELECT count(*) FROM rounds WHERE state = 'ok'", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(rounds, 3);
    let (run, node, round_index, completion): (String, String, i64, String) = conn
        .query_row(
            "SELECT run_id, node_id, round_index, completion FROM rounds WHERE api = 'openai_chat'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert_eq!(
        (
            run.as_str(),
            node.as_str(),
            round_index,
            completion.as_str()
        ),
        ("run-7", "n1", 1, "clean")
    );
    let mut stmt = conn.prepare("SELECT scope, tool_call_id, tool_name, is_error, content FROM tool_results ORDER BY id").unwrap();
    let results: Vec<(String, String, Option<String>, bool, Vec<u8>)> = stmt
        .query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(results.len(), 2, "{results:?}");
    assert_eq!(results[0].0, "run:run-7");
    assert_eq!(results[0].1, "call_ZR5UUuTt3pf61kjwAJIYdVMj");
    assert_eq!(results[0].2.as_deref(), Some("get_capital"));
    assert_eq!(results[0].4, b"\"London\"");
    assert_eq!(
        (results[1].1.as_str(), results[1].3),
        ("toolu_01A9HHF5Ezy3oBrKmSgfASm9", true)
    );
    // The request carries a result of a tool the catalog does not classify (untrusted), and
    // the model calls a tool of unknown safety (a `write`): the call is held at the trust stage.
    let calls: i64 = conn
        .query_row(
            "SELECT count(*) FROM tool_calls WHERE name = 'get_weather' AND outcome = 'held' AND stage = 'trust'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(calls, 2);
}

#[tokio::test]
async fn admin_plane_serves_health_and_metrics() {
    let h = support::start(Script::default()).await;
    let (status, body) = get(&format!("{}/healthz", h.admin_url())).await;
    assert_eq!((status, &body[..]), (200, &b"{\"status\":\"ok\"}"[..]));
    let (status, _) = get(&format!("{}/readyz", h.admin_url())).await;
    assert_eq!(status, 200);
    h.script(&script(
        json!([{ "file": "openai-chat/stream-tool-call-cut-by-length.sse" }]),
        &fixtures(),
    ))
    .await;
    post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        chat(true).to_string().into(),
        &[],
    )
    .await;
    let (_, metrics) = get(&format!("{}/metrics", h.admin_url())).await;
    let metrics = String::from_utf8_lossy(&metrics);
    for want in [
        r#"turnguard_requests_total{api="openai_chat",status="200",stream="true"} 1"#,
        r#"turnguard_tool_calls_total{outcome="invalid",stage="completion",channel="tool",mode="enforce",tool="turnguard:unknown",surface="llm"} 1"#,
        "turnguard_upstream_latency_seconds_count{api=\"openai_chat\"} 1",
        "turnguard_journal_write_failures_total 0",
    ] {
        assert!(metrics.contains(want), "missing `{want}` in\n{metrics}");
    }
    let (status, _) = get(&format!("{}/v1/models", h.admin_url())).await;
    assert_eq!(status, 404, "the admin plane serves no data-plane path");
}
