//! Production behaviour at the data-plane edge (issue 6): load shedding with 503 and
//! `Retry-After`, request ids and W3C trace context on the wire, upstream timeouts and caps,
//! and the metrics catalogue — the table in `deploy/README.md` against the registry, and a
//! scrape after real traffic showing every catalogued metric with plausible values.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use support::{fixtures, get, post_json, post_raw, script, sse_data};
use turnguard::metrics::Metrics;
use turnguard::mock_provider::Script;

const STREAM_FIXTURE: &str = "openai-chat/stream-tool-call-single-include-usage.sse";
const JSON_FIXTURE: &str = "openai-chat/nonstream-tool-call-single.json";

fn chat(stream: bool) -> Value {
    let mut body = json!({
        "model": "gpt-4o-mini",
        "stream": stream,
        "messages": [{"role": "user", "content": "capital of the UK? and the weather in SF"}],
        "tools": [
            {"type": "function", "function": {"name": "get_capital", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        ]
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

fn events_in(fixture: &str) -> usize {
    let text = std::fs::read_to_string(fixtures().join(fixture)).unwrap();
    text.split("\n\n").filter(|e| !e.trim().is_empty()).count()
}

async fn read_all(resp: http::Response<hyper::body::Incoming>) -> Bytes {
    tokio::time::timeout(Duration::from_secs(20), resp.into_body().collect())
        .await
        .expect("body in time")
        .expect("body")
        .to_bytes()
}

/// The sample lines of a scrape, by metric family name (`# TYPE` name, `_total` added for
/// counters).
fn samples(scrape: &str) -> BTreeMap<String, Vec<(String, f64)>> {
    let mut families: Vec<String> = Vec::new();
    let mut out: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    for line in scrape.lines() {
        if let Some(t) = line.strip_prefix("# TYPE ") {
            families.push(t.split(' ').next().unwrap().to_owned());
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        let name = series.split('{').next().unwrap();
        let family = families
            .iter()
            .filter(|f| name.starts_with(f.as_str()))
            .max_by_key(|f| f.len())
            .unwrap_or_else(|| panic!("sample `{line}` has no family"));
        let key = if name == format!("{family}_total") {
            name.to_owned()
        } else {
            family.clone()
        };
        out.entry(key)
            .or_default()
            .push((series.to_owned(), value.parse().unwrap()));
    }
    out
}

fn value(s: &BTreeMap<String, Vec<(String, f64)>>, series: &str) -> f64 {
    let family = series.split('{').next().unwrap();
    s.values()
        .flatten()
        .find(|(name, _)| name == series)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no series `{series}` (family {family}) in the scrape"))
}

/// The exported and planned tables of the catalogue in deploy/README.md.
fn catalogue() -> (Vec<String>, Vec<String>) {
    let readme = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/README.md"),
    )
    .unwrap();
    let section = readme
        .split("## Metrics catalogue")
        .nth(1)
        .expect("deploy/README.md has a `## Metrics catalogue` section");
    let (exported, planned) = section
        .split_once("### Planned")
        .expect("the catalogue has a `### Planned` part");
    let names = |text: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix("| `turnguard_"))
            .map(|l| format!("turnguard_{}", l.split('`').next().unwrap()))
            .collect()
    };
    (names(exported), names(planned))
}

#[test]
fn the_catalogue_in_deploy_readme_matches_the_registry() {
    let registered = Metrics::new().family_names();
    let (exported, planned) = catalogue();
    assert!(registered.len() >= 16, "{registered:?}");
    for name in &registered {
        assert!(
            exported.contains(name),
            "`{name}` is registered but not in deploy/README.md's catalogue"
        );
    }
    for name in &exported {
        assert!(
            registered.contains(name),
            "`{name}` is in deploy/README.md's catalogue but not registered in src/metrics.rs"
        );
    }
    for name in &planned {
        assert!(
            !registered.contains(name),
            "`{name}` is registered now: move it from `### Planned` to the catalogue"
        );
    }
    for name in registered.iter().chain(&planned) {
        let rest = name.strip_prefix("turnguard_").unwrap();
        assert!(
            rest.ends_with("_total")
                || rest.ends_with("_seconds")
                || rest.ends_with("_records")
                || rest.ends_with("_requests")
                || rest.ends_with("_streams")
                || rest.ends_with("_info")
                || rest.ends_with("_pending")
                || rest.ends_with("_connections")
                || rest.ends_with("_bytes"),
            "`{name}` does not follow turnguard_<name>_<unit>[_total]"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn over_the_concurrency_limit_requests_are_shed_with_503_and_retry_after() {
    let h = support::start_with(Script::default(), |c| {
        c.max_concurrent_requests = 1;
        c.shed_retry_after_s = 7;
    })
    .await;
    h.script(&script(
        json!([
            { "file": STREAM_FIXTURE, "gate": true },
            { "file": JSON_FIXTURE }
        ]),
        &fixtures(),
    ))
    .await;
    let url = format!("{}/v1/chat/completions", h.url());
    // The stream takes the only permit and keeps it while it is open.
    let stream = support::post_stream(&url, &chat(true)).await;
    assert_eq!(stream.status(), 200);

    let (status, headers, body) = post_raw(
        &url,
        Bytes::from(chat(false).to_string()),
        &[("x-request-id", "shed-me-1")],
    )
    .await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
    assert_eq!(headers["retry-after"], "7");
    assert_eq!(headers["x-request-id"], "shed-me-1");
    let err: Value = serde_json::from_slice(&body).unwrap();
    // The OpenAI shape on a Chat path, the OpenWOP code and details inside.
    assert_eq!(err["error"]["code"], "runner_unavailable");
    assert_eq!(err["error"]["details"]["reason"], "overloaded");
    assert_eq!(err["error"]["details"]["limit"], 1);
    assert_eq!(err["error"]["details"]["retryAfterSeconds"], 7);
    assert!(err["error"]["message"].as_str().unwrap().contains("limit"));
    assert_eq!(
        h.mock_requests().await.len(),
        1,
        "a shed request never reaches the upstream"
    );

    // Let the stream finish: its permit comes back and the next request is served.
    for _ in 0..events_in(STREAM_FIXTURE) {
        post_json(&format!("{}/_mock/step", h.mock_url()), &json!({}), &[]).await;
    }
    let body = read_all(stream).await;
    assert!(String::from_utf8_lossy(&body).contains("get_capital"));
    let (status, _, _) = post_raw(&url, Bytes::from(chat(false).to_string()), &[]).await;
    assert_eq!(status, 200);

    let (_, scrape) = get(&format!("{}/metrics", h.admin_url())).await;
    let s = samples(std::str::from_utf8(&scrape).unwrap());
    assert_eq!(
        value(&s, r#"turnguard_shed_requests_total{reason="overloaded"}"#),
        1.0
    );
    assert_eq!(
        value(
            &s,
            r#"turnguard_requests_total{api="openai_chat",status="503",stream="false"}"#
        ),
        1.0
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn request_id_and_trace_context_reach_the_upstream_and_the_id_comes_back() {
    let h = support::start(Script::default()).await;
    h.script(&script(
        json!([{ "file": JSON_FIXTURE }, { "file": JSON_FIXTURE }]),
        &fixtures(),
    ))
    .await;
    let url = format!("{}/v1/chat/completions", h.url());
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (status, headers, _) = post_raw(
        &url,
        Bytes::from(chat(false).to_string()),
        &[
            ("x-request-id", "agent-req-42"),
            ("traceparent", traceparent),
            ("tracestate", "vendor=opaque"),
            ("authorization", "Bearer sk-test-not-a-secret"),
        ],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-request-id"], "agent-req-42");
    // Without an id (or with an unusable one) turnguard makes one, echoes and forwards it.
    let (status, headers, _) = post_raw(
        &url,
        Bytes::from(chat(false).to_string()),
        &[("x-request-id", "two words")],
    )
    .await;
    assert_eq!(status, 200);
    let generated = headers["x-request-id"].to_str().unwrap().to_owned();
    assert_ne!(generated, "two words");
    assert_eq!(generated.len(), 36, "a UUID: {generated}");

    let seen = h.mock_requests().await;
    assert_eq!(seen.len(), 2);
    let first = &seen[0]["headers"];
    assert_eq!(first["traceparent"], traceparent);
    assert_eq!(first["tracestate"], "vendor=opaque");
    assert_eq!(first["x-request-id"], "agent-req-42");
    assert_eq!(first["authorization"], "Bearer sk-test-not-a-secret");
    assert_eq!(seen[1]["headers"]["x-request-id"], generated.as_str());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_timeouts_and_the_event_cap_fail_cleanly_and_are_counted() {
    let h = support::start_with(Script::default(), |c| {
        c.upstream_response_timeout_ms = 300;
        c.upstream_idle_timeout_ms = 300;
        c.max_event_bytes = 64;
    })
    .await;
    let url = format!("{}/v1/chat/completions", h.url());

    // No response headers within the response timeout: 502 in the OpenWOP envelope.
    h.script(&script(
        json!([{ "file": JSON_FIXTURE, "delay_ms": 3000 }]),
        &fixtures(),
    ))
    .await;
    let (status, body) = post_json(&url, &chat(false), &[]).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["error"]["code"], "upstream_unavailable");
    assert!(err["error"]["message"].as_str().unwrap().contains("300 ms"));

    // Silence inside a stream longer than the idle timeout: the stream is cut with an error
    // event and no tool call is released. The events are small enough for the cap.
    h.script(&script(
        json!([{ "sse": [
            "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[]}",
            "data: [DONE]"
        ], "event_delay_ms": 2000 }]),
        &fixtures(),
    ))
    .await;
    let mut body = chat(true);
    body["stream_options"] = json!({"include_usage": false});
    let resp = support::post_stream(&url, &body).await;
    assert_eq!(resp.status(), 200);
    let got = read_all(resp).await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.contains("error"),
        "the agent is told the stream failed: {text}"
    );
    assert!(!text.contains("[DONE]"), "{text}");

    // An event over the cap cuts the stream the same way.
    h.script(&script(json!([{ "file": STREAM_FIXTURE }]), &fixtures()))
        .await;
    let resp = support::post_stream(&url, &chat(true)).await;
    let got = read_all(resp).await;
    let data = sse_data(&got);
    assert!(
        !String::from_utf8_lossy(&got).contains("get_capital"),
        "nothing held is released from a cut stream"
    );
    assert!(!data.is_empty());

    let (_, scrape) = get(&format!("{}/metrics", h.admin_url())).await;
    let s = samples(std::str::from_utf8(&scrape).unwrap());
    assert_eq!(
        value(
            &s,
            r#"turnguard_upstream_errors_total{reason="response_timeout"}"#
        ),
        1.0
    );
    assert_eq!(
        value(
            &s,
            r#"turnguard_upstream_errors_total{reason="stream_cut"}"#
        ),
        2.0
    );
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let failed: i64 = db
        .query_row(
            "SELECT count(*) FROM rounds WHERE state = 'failed' AND stream = 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(failed, 2, "both cut streams are journaled as failed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_scrape_after_traffic_shows_every_catalogued_metric_with_plausible_values() {
    // A bundle that repairs invalid arguments, so a repair round happens too.
    let bundle = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(bundle.path().join("rules")).unwrap();
    std::fs::copy(
        support::own_fixtures().join("policy-open/rules/permit.cedar"),
        bundle.path().join("rules/permit.cedar"),
    )
    .unwrap();
    std::fs::write(
        bundle.path().join("turnguard.toml"),
        "[outcomes]\ninvalid = \"repair\"\n",
    )
    .unwrap();
    let policy = bundle.path().to_owned();
    let h = support::start_with(Script::default(), move |c| {
        c.upstream_idle_timeout_ms = 500;
        c.policy = policy;
    })
    .await;
    let bad_call = json!({
        "id": "chatcmpl-bad", "object": "chat.completion", "created": 1, "model": "gpt-4o",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant",
            "content": null, "tool_calls": [{"id": "call_bad", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": 5}"}}]}}]
    });
    let structured = json!({
        "id": "chatcmpl-s", "object": "chat.completion", "created": 1, "model": "gpt-4o",
        "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "{\"answer\":\"London\"}"}}]
    });
    h.script(&script(
        json!([
            { "file": JSON_FIXTURE },
            { "file": STREAM_FIXTURE, "event_delay_ms": 5 },
            { "file": STREAM_FIXTURE, "cut_after_events": 3 },
            { "json": bad_call },
            { "file": JSON_FIXTURE },
            { "json": structured },
            { "json": structured }
        ]),
        &fixtures(),
    ))
    .await;
    let url = format!("{}/v1/chat/completions", h.url());
    let (status, _) = post_json(&url, &chat(false), &[]).await;
    assert_eq!(status, 200);
    let got = read_all(support::post_stream(&url, &chat(true)).await).await;
    assert!(String::from_utf8_lossy(&got).contains("get_capital"));
    let _ = read_all(support::post_stream(&url, &chat(true)).await).await;
    let (status, _) = get(&format!("{}/not/a/provider/path", h.url())).await;
    assert_eq!(status, 404);
    // Invalid arguments (`city` must be a string): one repair round, then the good answer.
    let mut strict = chat(false);
    strict["tools"][1]["function"]["parameters"] =
        json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let (status, body) = post_json(&url, &strict, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // A provider-enforced schema: the structured channel checks the answer.
    let schema_request = json!({
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "capital of the UK, as JSON"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "strict": true,
            "schema": {"type": "object", "properties": {"answer": {"type": "string"}},
                "required": ["answer"], "additionalProperties": false}}}
    });
    let (status, body) = post_json(&url, &schema_request, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // A run node answered with text, sent twice: the re-sent request is served from the
    // record (recovery hit; a released call without a result would be in doubt instead).
    for _ in 0..2 {
        let (status, _) =
            post_json(&url, &chat(false), &[("turnguard-run", "run-metrics-1")]).await;
        assert_eq!(status, 200);
    }
    assert_eq!(
        h.mock_requests().await.len(),
        7,
        "the recovered round is not sent upstream"
    );

    // The access log line and histograms are written when the body ends; the scrape waits
    // for the relays to journal their rounds, and for the gauges to settle: a handler's
    // in-flight guard drops just after its response is handed over, and a chat turn's
    // records sit in the journal queue until the writer's linger ends (2 ms).
    let mut s = BTreeMap::new();
    for _ in 0..50 {
        let (_, scrape) = get(&format!("{}/metrics", h.admin_url())).await;
        s = samples(std::str::from_utf8(&scrape).unwrap());
        let streams_done = value(&s, "turnguard_inflight_streams") == 0.0
            && value(&s, "turnguard_inflight_requests") == 0.0
            && value(&s, "turnguard_journal_queue_depth_records") == 0.0;
        let durations: f64 = s["turnguard_request_duration_seconds"]
            .iter()
            .filter(|(n, _)| n.starts_with("turnguard_request_duration_seconds_count"))
            .map(|(_, v)| v)
            .sum();
        if streams_done && durations == 8.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let (exported, _) = catalogue();
    for name in &exported {
        let lines = s
            .get(name)
            .unwrap_or_else(|| panic!("`{name}` is not in the scrape"));
        assert!(!lines.is_empty(), "`{name}` has no samples after traffic");
    }
    let v = |series: &str| value(&s, series);
    assert_eq!(
        v(r#"turnguard_requests_total{api="openai_chat",status="200",stream="true"}"#),
        2.0
    );
    assert_eq!(
        v(r#"turnguard_requests_total{api="none",status="404",stream="false"}"#),
        1.0
    );
    assert_eq!(
        v(
            r#"turnguard_tool_calls_total{outcome="executed",stage="dispatch",channel="tool",mode="enforce",tool="turnguard:unknown",surface="llm"}"#
        ),
        3.0,
        "one released call per admitted tool-call response"
    );
    assert_eq!(v(r#"turnguard_repairs_total{api="openai_chat"}"#), 1.0);
    let turns: f64 = s["turnguard_turns_total"].iter().map(|(_, v)| v).sum();
    assert!(
        turns >= 6.0,
        "every admitted turn is counted by trust: {turns}"
    );
    let emissions: f64 = s["turnguard_emissions_total"].iter().map(|(_, v)| v).sum();
    assert_eq!(emissions, 1.0);
    assert_eq!(
        v(r#"turnguard_replay_total{mode="recovery",result="hit"}"#),
        1.0
    );
    assert_eq!(s["turnguard_policy_revision_info"].len(), 1);
    assert_eq!(v(r#"turnguard_policy_reloads_total{result="error"}"#), 0.0);
    assert_eq!(
        v(r#"turnguard_upstream_errors_total{reason="stream_cut"}"#),
        1.0
    );
    assert_eq!(v("turnguard_inflight_requests"), 0.0);
    assert_eq!(v("turnguard_inflight_streams"), 0.0);
    assert_eq!(v("turnguard_journal_queue_depth_records"), 0.0);
    assert_eq!(v("turnguard_journal_write_failures_total"), 0.0);
    assert_eq!(
        v(&format!(
            r#"turnguard_build_info{{version="{}"}}"#,
            env!("CARGO_PKG_VERSION")
        )),
        1.0
    );
    assert_eq!(
        v(r#"turnguard_upstream_ttfb_seconds_count{api="openai_chat"}"#),
        2.0
    );
    assert!(v(r#"turnguard_stream_hold_seconds_count{api="openai_chat"}"#) >= 1.0);
    assert!(v("turnguard_journal_batch_size_records_count") >= 1.0);
    assert!(v("turnguard_journal_commit_latency_seconds_count") >= 1.0);
    // Time added by turnguard is part of the whole request time, and small on loopback.
    for stream in ["false", "true"] {
        let added = v(&format!(
            r#"turnguard_proxy_added_seconds_sum{{api="openai_chat",stream="{stream}"}}"#
        ));
        let whole = v(&format!(
            r#"turnguard_request_duration_seconds_sum{{api="openai_chat",stream="{stream}"}}"#
        ));
        assert!(
            added > 0.0 && added <= whole,
            "stream={stream}: added {added} s of {whole} s"
        );
    }
    let streamed = v(r#"turnguard_request_duration_seconds_sum{api="openai_chat",stream="true"}"#);
    assert!(
        streamed >= 0.035,
        "a stream's duration covers its whole life (8 × 5 ms delays): {streamed}"
    );
    h.stop().await;
}
