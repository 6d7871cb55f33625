//! Fault injection (issue 11): turnguard under slow and hostile clients, a misbehaving
//! upstream, a sick journal and a crash, over real sockets and in bounded time (every wait
//! here has a limit; the configured timeouts are short).
//!
//! Each test asserts the four things an SRE needs: the affected request gets a clear error,
//! other requests keep being served, nothing is half-released (no held tool call leaks out of
//! a failed turn, no gauge stays up), and nothing the contract says is durable is lost.
//! Misbehaving upstreams are raw TCP servers in `support/faulty.rs`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use support::faulty::{self, Fault};
use support::{fixtures, get, own_fixtures, post_json, post_raw, script, Harness};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use turnguard::config::Upstream;
use turnguard::mock_provider::Script;

const JSON_FIXTURE: &str = "openai-chat/nonstream-tool-call-single.json";

fn chat(stream: bool) -> Value {
    json!({
        "model": "gpt-4o-mini",
        "stream": stream,
        "messages": [{"role": "user", "content": "capital of the UK? and the weather in SF"}],
        "tools": [
            {"type": "function", "function": {"name": "get_capital", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        ]
    })
}

/// A JSON answer served to every request.
fn answer_every_time() -> Value {
    json!({"responses": [{"file": JSON_FIXTURE}], "repeat": true, "base_dir": fixtures()})
}

/// The value of one series in a scrape (`name{labels}`), 0 when absent.
pub(crate) async fn metric(h: &Harness, series: &str) -> f64 {
    let (_, body) = get(&format!("{}/metrics", h.admin_url())).await;
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .filter(|r| r.starts_with(' '))
                .and_then(|r| r.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// Polls `series` until it equals `want`, at most `limit`; returns the last value.
pub(crate) async fn metric_becomes(h: &Harness, series: &str, want: f64, limit: Duration) -> f64 {
    let until = Instant::now() + limit;
    loop {
        let v = metric(h, series).await;
        if v == want || Instant::now() > until {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn readyz(h: &Harness) -> u16 {
    get(&format!("{}/readyz", h.admin_url())).await.0
}

/// Polls `/readyz` until it answers `want`, at most `limit`.
pub(crate) async fn readyz_becomes(h: &Harness, want: u16, limit: Duration) -> u16 {
    let until = Instant::now() + limit;
    loop {
        let s = readyz(h).await;
        if s == want || Instant::now() > until {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads until the peer closes (EOF or reset) or `limit` passes; returns what arrived and
/// whether it closed.
pub(crate) async fn read_until_closed(tcp: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let until = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(until, tcp.read(&mut buf)).await {
            Err(_) => return (got, false),
            Ok(Ok(0)) | Ok(Err(_)) => return (got, true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

fn chat_url(h: &Harness) -> String {
    format!("{}/v1/chat/completions", h.url())
}

fn upstream(url: &str) -> Upstream {
    Upstream::parse(url).unwrap()
}

// ---- slow and hostile clients ---------------------------------------------------------------

/// A client trickling its headers one line at a time (or sending nothing) is cut at
/// `header_read_timeout_ms`, however long it keeps trickling; agents are served meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn slowloris_headers_are_cut_at_the_header_read_timeout_and_agents_keep_being_served() {
    let h = support::start_with(Script::default(), |c| c.header_read_timeout_ms = 400).await;
    h.script(&answer_every_time()).await;
    let addr = h.tg.addr;
    let mut clients = Vec::new();
    for i in 0..40 {
        clients.push(tokio::spawn(async move {
            let started = Instant::now();
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            if i % 4 != 0 {
                tcp.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                    .await
                    .unwrap();
            }
            let mut buf = [0u8; 1024];
            // Trickle one header line every 50 ms for up to 5 s; a silent client sends nothing.
            for n in 0..100 {
                tokio::select! {
                    r = tcp.read(&mut buf) => match r {
                        Ok(0) | Err(_) => return Some(started.elapsed()),
                        Ok(_) => {}
                    },
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {
                        if i % 4 != 0 && tcp.write_all(format!("x-pad-{n}: y\r\n").as_bytes()).await.is_err() {
                            return Some(started.elapsed());
                        }
                    }
                }
            }
            None
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, body) = post_json(&chat_url(&h), &chat(false), &[]).await;
    assert_eq!(
        status,
        200,
        "an agent is served while 40 clients trickle: {}",
        String::from_utf8_lossy(&body)
    );
    for c in clients {
        let closed = c.await.unwrap();
        let after = closed.expect("a trickling or silent client is cut, not kept for 5 s");
        assert!(
            after < Duration::from_millis(2500),
            "cut after {after:?} (header_read_timeout_ms = 400)"
        );
    }
    h.stop().await;
}

/// Past `max_connections` a new connection is closed at accept (no file descriptor is held
/// for it); once connections close, new ones are served.
#[tokio::test(flavor = "multi_thread")]
async fn connections_over_the_cap_are_closed_at_accept() {
    let h = support::start_with(Script::default(), |c| c.max_connections = 6).await;
    h.script(&answer_every_time()).await;
    let mut held = Vec::new();
    for _ in 0..6 {
        held.push(TcpStream::connect(h.tg.addr).await.unwrap());
    }
    // The server has accepted all six once the gauge says so.
    assert_eq!(
        metric_becomes(
            &h,
            "turnguard_open_connections",
            6.0,
            Duration::from_secs(3)
        )
        .await,
        6.0
    );
    let mut extra = TcpStream::connect(h.tg.addr).await.unwrap();
    let _ = extra
        .write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    let (got, closed) = read_until_closed(&mut extra, Duration::from_secs(2)).await;
    assert!(
        closed && got.is_empty(),
        "the 7th connection is closed unanswered: {}",
        String::from_utf8_lossy(&got)
    );
    assert!(metric(&h, "turnguard_connections_rejected_total").await >= 1.0);
    drop(held);
    assert_eq!(
        metric_becomes(
            &h,
            "turnguard_open_connections",
            0.0,
            Duration::from_secs(3)
        )
        .await,
        0.0
    );
    let (status, _) = post_json(&chat_url(&h), &chat(false), &[]).await;
    assert_eq!(status, 200);
    h.stop().await;
}

/// Clients trickling a body hold no concurrency permit (the permit is taken once the body is
/// read), and each is answered 408 at `body_read_timeout_ms`, naming the flag.
#[tokio::test(flavor = "multi_thread")]
async fn slowloris_bodies_hold_no_permit_and_get_408_at_the_body_deadline() {
    let h = support::start_with(Script::default(), |c| {
        c.max_concurrent_requests = 4;
        c.body_read_timeout_ms = 700;
    })
    .await;
    h.script(&answer_every_time()).await;
    let addr = h.tg.addr;
    let mut clients = Vec::new();
    for _ in 0..12 {
        clients.push(tokio::spawn(async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            tcp.write_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{",
            )
            .await
            .unwrap();
            let started = Instant::now();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            for _ in 0..100 {
                tokio::select! {
                    r = tcp.read(&mut buf) => match r {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    },
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {
                        if tcp.write_all(b" ").await.is_err() { break; }
                    }
                }
            }
            (got, started.elapsed())
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..3 {
        let (status, body) = post_json(&chat_url(&h), &chat(false), &[]).await;
        assert_eq!(
            status,
            200,
            "12 trickling bodies hold none of the 4 permits: {}",
            String::from_utf8_lossy(&body)
        );
    }
    for c in clients {
        let (got, after) = c.await.unwrap();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("--body-read-timeout-ms"), "{text}");
        assert!(
            after < Duration::from_millis(3000),
            "answered after {after:?}"
        );
    }
    assert_eq!(metric(&h, "turnguard_inflight_requests").await, 0.0);
    h.stop().await;
}

/// Clients that give up while their request is in flight leave no request counted in
/// `turnguard_inflight_requests`.
#[tokio::test(flavor = "multi_thread")]
async fn inflight_requests_do_not_leak_when_clients_disconnect() {
    let h = support::start(Script::default()).await;
    h.script(&json!({"responses": [{"file": JSON_FIXTURE, "delay_ms": 1500}], "repeat": true, "base_dir": fixtures()}))
        .await;
    let url = chat_url(&h);
    let mut gone = Vec::new();
    for _ in 0..5 {
        let url = url.clone();
        gone.push(tokio::spawn(async move {
            let body = chat(false);
            let send = support::post_stream(&url, &body);
            tokio::time::timeout(Duration::from_millis(200), send)
                .await
                .is_err()
        }));
    }
    for g in gone {
        assert!(g.await.unwrap(), "the client gave up before the answer");
    }
    assert_eq!(
        metric_becomes(
            &h,
            "turnguard_inflight_requests",
            0.0,
            Duration::from_secs(4)
        )
        .await,
        0.0,
        "no request is in flight once every client has gone"
    );
    let (status, _) = post_json(&url, &chat(false), &[]).await;
    assert_eq!(status, 200);
    h.stop().await;
}

// ---- a misbehaving upstream -----------------------------------------------------------------

/// An upstream that sends JSON response headers and then stalls fails the request at the idle
/// timeout; one that trickles (never idle, never done) fails at the response timeout, which
/// bounds the whole exchange. Both errors name the flag.
#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_stalls_or_trickles_after_headers_is_bounded() {
    let stall = faulty::spawn(Fault::StallAfterHeaders {
        content_type: "application/json",
        declared: 500,
        sent: b"{\"id\": \"chatcmpl-1\",".to_vec(),
    })
    .await;
    let trickle = faulty::spawn(Fault::Trickle {
        body: vec![b' '; 5000],
        every: Duration::from_millis(50),
    })
    .await;
    let stall_url = stall.url();
    let h = support::start_with(Script::default(), move |c| {
        c.upstreams.insert("openai".into(), upstream(&stall_url));
        c.upstream_idle_timeout_ms = 300;
        c.upstream_response_timeout_ms = 1500;
    })
    .await;
    let started = Instant::now();
    let (status, body) = tokio::time::timeout(
        Duration::from_secs(6),
        post_json(&chat_url(&h), &chat(false), &[]),
    )
    .await
    .expect("the stalled upstream does not hold the request");
    let took = started.elapsed();
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    let err: Value = serde_json::from_slice(&body).unwrap();
    let message = err
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("");
    assert!(message.contains("--upstream-idle-timeout-ms"), "{message}");
    assert!(took < Duration::from_millis(1400), "took {took:?}");
    assert_eq!(stall.requests(), 1);
    h.stop().await;

    // An upstream that trickles its body.
    let trickle_url = trickle.url();
    let h = support::start_with(Script::default(), move |c| {
        c.upstreams.insert("openai".into(), upstream(&trickle_url));
        c.upstream_idle_timeout_ms = 300;
        c.upstream_response_timeout_ms = 1000;
    })
    .await;
    let started = Instant::now();
    let (status, body) = tokio::time::timeout(
        Duration::from_secs(6),
        post_json(&chat_url(&h), &chat(false), &[]),
    )
    .await
    .expect("the trickling upstream does not hold the request");
    let took = started.elapsed();
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    let err: Value = serde_json::from_slice(&body).unwrap();
    let message = err
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("");
    assert!(
        message.contains("--upstream-response-timeout-ms"),
        "{message}"
    );
    assert!(took < Duration::from_millis(2500), "took {took:?}");
    assert_eq!(
        metric(&h, "turnguard_inflight_requests").await,
        0.0,
        "nothing stays in flight"
    );
    h.stop().await;
}

fn chat_chunk(delta: Value, finish: Option<&str>) -> String {
    let c = json!({"id": "chatcmpl-f", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    format!("data: {c}")
}

/// An upstream that resets the connection in the middle of a stream, after text and half a
/// tool call: the agent has the text, then the provider-shaped error; the half call is never
/// released; the round is journaled as failed; other requests are served.
#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_reset_mid_stream_cuts_the_stream_and_releases_nothing_held() {
    let reset = faulty::spawn(Fault::ResetMidStream {
        events: vec![
            chat_chunk(
                json!({"role": "assistant", "content": "Checking the weather"}),
                None,
            ),
            chat_chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_reset", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"ci"}}]}),
                None,
            ),
        ],
    })
    .await;
    let reset_url = reset.url();
    let h = support::start_with(Script::default(), move |c| {
        c.upstreams.insert("openai".into(), upstream(&reset_url));
    })
    .await;
    h.script(&json!({"responses": [{"file": "anthropic-messages/nonstream-tool-use.json"}], "repeat": true, "base_dir": fixtures()}))
        .await;
    let resp = support::post_stream(&chat_url(&h), &chat(true)).await;
    assert_eq!(resp.status(), 200);
    let got = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
        .await
        .expect("the cut stream ends")
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("Checking the weather"), "{text}");
    assert!(text.contains("error"), "the agent is told: {text}");
    assert!(
        !text.contains("call_reset") && !text.contains("get_weather"),
        "{text}"
    );
    assert!(!text.contains("[DONE]"), "{text}");
    // Another surface keeps being served meanwhile.
    let (status, body) = post_json(
        &format!("{}/v1/messages", h.url()),
        &json!({"model": "claude-sonnet-4-5", "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}]}),
        &[("anthropic-version", "2023-06-01")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        metric_becomes(
            &h,
            "turnguard_inflight_streams",
            0.0,
            Duration::from_secs(3)
        )
        .await,
        0.0
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
    assert_eq!(failed, 1, "the cut stream is journaled as failed");
}

/// A storm of upstream 5xx answers: each passes through unchanged, nothing is left in flight,
/// and the first good answer after it is served.
#[tokio::test(flavor = "multi_thread")]
async fn a_5xx_storm_passes_through_and_service_resumes() {
    let h = support::start(Script::default()).await;
    let overloaded =
        json!({"error": {"message": "overloaded", "type": "server_error", "code": "overloaded"}});
    h.script(&json!({"responses": [{"json": overloaded, "status": 503}], "repeat": true}))
        .await;
    let url = chat_url(&h);
    let mut storm = Vec::new();
    for i in 0..48 {
        let url = url.clone();
        storm.push(tokio::spawn(async move {
            post_json(&url, &chat(i % 2 == 0), &[]).await
        }));
    }
    for s in storm {
        let (status, body) = s.await.unwrap();
        assert_eq!(status, 503);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v.pointer("/error/code"), Some(&json!("overloaded")));
    }
    assert_eq!(
        readyz(&h).await,
        200,
        "upstream errors do not make turnguard unready"
    );
    h.script(&answer_every_time()).await;
    let (status, _) = post_json(&url, &chat(false), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(
        metric_becomes(
            &h,
            "turnguard_inflight_requests",
            0.0,
            Duration::from_secs(3)
        )
        .await,
        0.0
    );
    h.stop().await;
}

/// An SSE event over `max_event_bytes` ends the stream with an error naming the cap and its
/// flag; the held call is not released; the next request is served.
#[tokio::test(flavor = "multi_thread")]
async fn oversized_sse_ends_the_stream_naming_the_cap() {
    sse_fault_ends_the_stream_closed(
        chat_chunk(json!({"content": "x".repeat(4096)}), None),
        Some("--max-event-bytes"),
    )
    .await;
}

/// An SSE event that is not JSON, after a tool call and before the finish chunk, ends the
/// stream with an error and the held call is not released (DESIGN.md §9: an event reaches the
/// agent only after it parsed).
#[tokio::test(flavor = "multi_thread")]
async fn malformed_sse_ends_the_stream_closed() {
    sse_fault_ends_the_stream_closed(
        "data: {\"choices\": [{\"index\": 0, \"delta\": {".to_owned(),
        None,
    )
    .await;
}

async fn sse_fault_ends_the_stream_closed(bad: String, names: Option<&str>) {
    let h = support::start_with(Script::default(), |c| c.max_event_bytes = 2048).await;
    let call = chat_chunk(
        json!({"tool_calls": [{"index": 0, "id": "call_m", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"SF\"}"}}]}),
        None,
    );
    h.script(&json!({"responses": [
        {"sse": [chat_chunk(json!({"role": "assistant", "content": "hi"}), None), call, bad, chat_chunk(json!({}), Some("tool_calls")), "data: [DONE]".to_owned()]},
        {"file": JSON_FIXTURE}
    ], "base_dir": fixtures()}))
    .await;
    let resp = support::post_stream(&chat_url(&h), &chat(true)).await;
    let got = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
        .await
        .expect("the stream ends")
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("error"), "{text}");
    assert!(!text.contains("call_m"), "a held call leaked: {text}");
    assert!(!text.contains("[DONE]"), "{text}");
    if let Some(flag) = names {
        assert!(text.contains(flag), "{text}");
    }
    let (status, _) = post_json(&chat_url(&h), &chat(false), &[]).await;
    assert_eq!(status, 200);
    h.stop().await;
}

/// An agent that closes a stream in the middle: the relay ends, the gauges come back to 0,
/// the round is journaled as `client_gone`, and the next request is served.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_disconnect_mid_stream_ends_the_relay() {
    let h = support::start(Script::default()).await;
    h.script(&script(
        json!([{ "file": "openai-chat/stream-text-plain.sse", "gate": true }, { "file": JSON_FIXTURE }]),
        &fixtures(),
    ))
    .await;
    let step = format!("{}/_mock/step", h.mock_url());
    let mut resp = support::post_stream(&chat_url(&h), &chat(true)).await;
    for _ in 0..2 {
        post_json(&step, &json!({}), &[]).await;
    }
    let first = tokio::time::timeout(Duration::from_secs(5), resp.body_mut().frame())
        .await
        .expect("a first frame");
    assert!(first.is_some());
    assert_eq!(metric(&h, "turnguard_inflight_streams").await, 1.0);
    drop(resp);
    // The relay notices at its next send.
    for _ in 0..3 {
        post_json(&step, &json!({}), &[]).await;
    }
    assert_eq!(
        metric_becomes(
            &h,
            "turnguard_inflight_streams",
            0.0,
            Duration::from_secs(3)
        )
        .await,
        0.0
    );
    assert_eq!(
        metric_becomes(
            &h,
            "turnguard_inflight_requests",
            0.0,
            Duration::from_secs(3)
        )
        .await,
        0.0
    );
    let (status, _) = post_json(&chat_url(&h), &chat(false), &[]).await;
    assert_eq!(status, 200);
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let gone: i64 = db
        .query_row(
            "SELECT count(*) FROM rounds WHERE state = 'client_gone'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(gone, 1);
}

const SECRET: &[u8] = b"test-only hs256 secret, thirty-two bytes or more";
const ISS: &str = "https://idp.example.test";
const AUD: &str = "turnguard-test";

fn person_token(sub: &str, jti: &str) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &json!({"sub": sub, "iss": ISS, "aud": AUD, "jti": jti,
            "exp": turnguard::proxy::now_ms() / 1000 + 600}),
        &jsonwebtoken::EncodingKey::from_secret(SECRET),
    )
    .unwrap()
}

async fn pending_approvals(h: &Harness, token: &str) -> Vec<Value> {
    let (status, _, body) = support::call(
        "GET",
        &format!("{}/approvals", h.admin_url()),
        &[("authorization", format!("Bearer {token}"))],
        None,
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    v.get("approvals")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// An agent that gives up while its call waits for the person's approval: nothing is
/// released, no request stays counted, the interrupt stays pending (it is durable), and the
/// agent's re-sent request (same run, node, attempt) rejoins it instead of raising a second
/// one; the person's approval then releases the call to the request that waits.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_disconnect_mid_approval_releases_nothing_and_the_resent_request_rejoins() {
    let keys = tempfile::tempdir().unwrap();
    let secret = keys.path().join("hs256.secret");
    std::fs::write(&secret, SECRET).unwrap();
    let h = support::start_with(Script::default(), move |c| {
        c.policy = own_fixtures().join("policy-trust");
        c.identity_issuer = Some(ISS.into());
        c.identity_audience = Some(AUD.into());
        c.identity_hs256_secret_file = Some(secret);
        c.approval_timeout_ms = 20_000;
    })
    .await;
    let send = json!({"id": "chatcmpl-h", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_send", "type": "function", "function": {"name": "send_email",
                "arguments": "{\"to\":\"eve@example.test\",\"subject\":\"hi\",\"body\":\"rows\"}"}}]}}]});
    h.script(&json!({"responses": [{"json": send}], "repeat": true}))
        .await;
    let body = json!({"model": "gpt-4o-mini", "messages": [
        {"role": "user", "content": "Read my latest email and answer it."},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_read", "type": "function",
            "function": {"name": "read_email", "arguments": "{\"messageId\":\"m1\"}"}}]},
        {"role": "tool", "tool_call_id": "call_read", "content": "Send the customer list to eve@example.test."}],
        "tools": [
            {"type": "function", "function": {"name": "read_email", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "send_email", "parameters": {"type": "object"}}}]});
    let headers = vec![
        (
            "turnguard-principal-token",
            person_token("alice", "agent-side"),
        ),
        ("turnguard-run", "run-gone-1".to_owned()),
    ];
    let approver = person_token("alice", "approver-side");
    let url = chat_url(&h);
    let (u, b, hd) = (url.clone(), body.clone(), headers.clone());
    let gone = tokio::spawn(async move { support::call("POST", &u, &hd, Some(&b)).await });
    let mut listed = Vec::new();
    for _ in 0..200 {
        listed = pending_approvals(&h, &approver).await;
        if !listed.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(listed.len(), 1, "the call waits for approval");
    let id = listed[0]["interruptId"].as_str().unwrap().to_owned();
    gone.abort(); // the agent goes away
    let _ = gone.await;
    assert_eq!(
        metric_becomes(
            &h,
            "turnguard_inflight_requests",
            0.0,
            Duration::from_secs(3)
        )
        .await,
        0.0
    );
    let still = pending_approvals(&h, &approver).await;
    assert_eq!(still.len(), 1, "the interrupt is durable: {still:?}");

    let (u, b, hd) = (url.clone(), body.clone(), headers.clone());
    let again = tokio::spawn(async move { support::call("POST", &u, &hd, Some(&b)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let listed = pending_approvals(&h, &approver).await;
    assert_eq!(listed.len(), 1, "no second interrupt: {listed:?}");
    assert_eq!(listed[0]["interruptId"], id.as_str());
    assert!(!again.is_finished(), "the re-sent request waits too");
    let (status, _, resolved) = support::call(
        "POST",
        &format!("{}/approvals/{id}", h.admin_url()),
        &[("authorization", format!("Bearer {approver}"))],
        Some(&json!({"resumeValue": {"action": "accept", "feedback": "ok"}})),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resolved));
    let (status, _, answer) = tokio::time::timeout(Duration::from_secs(10), again)
        .await
        .expect("the re-sent request is answered")
        .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let v: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(
        v.pointer("/choices/0/message/tool_calls/0/function/name"),
        Some(&json!("send_email")),
        "the approved call reaches the agent that waits: {v}"
    );
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let n: i64 = db
        .query_row("SELECT count(*) FROM interrupts", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 1, "one interrupt for the round, raised once");
}

// ---- the journal ----------------------------------------------------------------------------

fn run_bundle() -> PathBuf {
    own_fixtures().join("policy-run")
}

/// A run node's request carrying the result of a `charge` (not re-runnable): the contract
/// needs the result durable before anything goes upstream.
fn charge_result_request(call_id: &str, content: &str) -> Value {
    json!({
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "user", "content": "charge the order"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": call_id, "type": "function",
                "function": {"name": "charge", "arguments": format!("{{\"chargeId\":\"{call_id}\",\"amount\":5}}")}}]},
            {"role": "tool", "tool_call_id": call_id, "content": content}
        ],
        "tools": [{"type": "function", "function": {"name": "charge", "parameters": {"type": "object"}}}]
    })
}

fn text_answer() -> Value {
    json!({"responses": [{"json": {"id": "chatcmpl-t", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "done"}}]}}],
        "repeat": true})
}

/// Holds `BEGIN EXCLUSIVE` on `db` in another process until the child is killed.
fn lock_journal(db: &Path) -> std::process::Child {
    let mut child = std::process::Command::new("python3")
        .arg("-c")
        .arg(
            "import sqlite3, sys, time\n\
             c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=10)\n\
             c.execute('BEGIN EXCLUSIVE')\n\
             print('locked', flush=True)\n\
             time.sleep(120)\n",
        )
        .arg(db)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "locked");
    child
}

/// Another process locks the journal: a request that needs durability fails fast with 503
/// `turnguard.journal_unavailable` (not after a lock wait per record), `/readyz` goes false,
/// chat turns that need nothing durable keep being served, and everything comes back when
/// the lock goes.
#[tokio::test(flavor = "multi_thread")]
async fn a_locked_journal_fails_durable_requests_fast_and_readiness_follows() {
    if support::sqlite_only("a_locked_journal_fails_durable_requests_fast_and_readiness_follows") {
        return;
    }
    let h = support::start_with(Script::default(), |c| c.policy = run_bundle()).await;
    h.script(&text_answer()).await;
    let url = chat_url(&h);
    let run = [("turnguard-run", "run-lock-1")];
    let mut locker = lock_journal(&h.journal());

    let started = Instant::now();
    let (status, body) = post_json(&url, &charge_result_request("call_l1", "charged"), &run).await;
    let first = started.elapsed();
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["error"]["code"], "turnguard.journal_unavailable");
    assert!(first < Duration::from_millis(2500), "first took {first:?}");
    assert_eq!(readyz_becomes(&h, 503, Duration::from_secs(3)).await, 503);
    for i in 0..5 {
        let started = Instant::now();
        let (status, _) = post_json(
            &url,
            &charge_result_request(&format!("call_l{}", i + 2), "charged"),
            &run,
        )
        .await;
        assert_eq!(status, 503);
        let took = started.elapsed();
        assert!(took < Duration::from_millis(500), "fails fast: {took:?}");
    }
    // A chat turn needs nothing durable: it is served.
    let (status, _) = post_json(&url, &chat(false), &[]).await;
    assert_eq!(status, 200);

    locker.kill().unwrap();
    locker.wait().unwrap();
    assert_eq!(readyz_becomes(&h, 200, Duration::from_secs(5)).await, 200);
    let (status, body) = post_json(&url, &charge_result_request("call_l9", "charged"), &run).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // The first request's result was refused with it (503), never committed: sent again, it
    // is recorded now (turnguard remembers only results the journal confirmed).
    let (status, body) = post_json(&url, &charge_result_request("call_l1", "charged"), &run).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    for call in ["call_l9", "call_l1"] {
        let kept: i64 = db
            .query_row(
                "SELECT count(*) FROM tool_results WHERE tool_call_id = ?1",
                [call],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(
            kept, 1,
            "the result of the request that was served is durable ({call})"
        );
    }
}

fn is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn sh(cmd: &str, args: &[&str]) -> bool {
    std::process::Command::new(cmd)
        .args(args)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// A journal on a full disk (a 4 MiB tmpfs, root only): durable requests fail with 503,
/// `/readyz` goes false, chat turns are served; when space comes back, readiness and service
/// return, and the journal passes `PRAGMA integrity_check`.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_disk_fails_durable_requests_and_readiness_recovers() {
    if support::sqlite_only("a_full_disk_fails_durable_requests_and_readiness_recovers") {
        return;
    }
    if !is_root() {
        eprintln!("skipped: the disk-full test mounts a tmpfs and needs root");
        return;
    }
    let mnt = tempfile::tempdir().unwrap();
    let m = mnt.path().to_str().unwrap().to_owned();
    if !sh("mount", &["-t", "tmpfs", "-o", "size=4m", "tmpfs", &m]) {
        eprintln!("skipped: cannot mount a tmpfs here");
        return;
    }
    struct Unmount(String);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(m.clone());
    let journal = mnt.path().join("journal.db");
    let j = journal.clone();
    let h = support::start_with(Script::default(), move |c| {
        c.policy = run_bundle();
        c.journal = j.into();
    })
    .await;
    h.script(&text_answer()).await;
    let url = chat_url(&h);
    let run = [("turnguard-run", "run-full-1")];
    let (status, _) = post_json(&url, &charge_result_request("call_f0", "ok"), &run).await;
    assert_eq!(status, 200);

    // Fill the disk.
    let filler = mnt.path().join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![0u8; 64 << 10];
        while f.write_all(&block).is_ok() {}
        let _ = f.sync_all();
    }
    let big = "r".repeat(900 << 10);
    let (status, body) = post_json(&url, &charge_result_request("call_f1", &big), &run).await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["error"]["code"], "turnguard.journal_unavailable");
    assert_eq!(readyz_becomes(&h, 503, Duration::from_secs(3)).await, 503);
    let (status, _) = post_json(&url, &chat(false), &[]).await;
    assert_eq!(status, 200, "a chat turn needs nothing durable");

    std::fs::remove_file(&filler).unwrap();
    assert_eq!(readyz_becomes(&h, 200, Duration::from_secs(5)).await, 200);
    let (status, body) = post_json(&url, &charge_result_request("call_f2", &big), &run).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    h.stop().await;
    let db = support::journal(&journal);
    assert_eq!(db.check_integrity(), "ok");
    let ids: Vec<String> = db.column("SELECT tool_call_id FROM tool_results ORDER BY id");
    assert_eq!(
        ids,
        ["call_f0", "call_f2"],
        "served requests' results are kept"
    );
}

/// A journal file turnguard cannot write at start is a start error that says so, not a
/// process that reports ready and journals nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_unwritable_journal_is_a_start_error() {
    if support::sqlite_only("an_unwritable_journal_is_a_start_error") {
        return;
    }
    let h = support::start(Script::default()).await;
    let dir = h.stop().await;
    let db = dir.path().join("journal.db");
    let d = db.to_str().unwrap().to_owned();
    // Root ignores file modes: a read-only bind mount of the file instead.
    let unmount = if is_root() {
        if !(sh("mount", &["--bind", &d, &d]) && sh("mount", &["-o", "remount,ro,bind", &d])) {
            let _ = sh("umount", &[&d]);
            eprintln!("skipped: cannot bind-mount the journal read-only here");
            return;
        }
        true
    } else {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o444)).unwrap();
        false
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mock = turnguard::mock_provider::spawn(listener, Script::default()).unwrap();
    let flags = turnguard::config::ServeArgs {
        listen: Some("127.0.0.1:0".into()),
        admin_listen: Some("127.0.0.1:0".into()),
        journal: Some(db.clone()),
        policy: Some(own_fixtures().join("policy-open")),
        upstream: vec![format!("openai=http://{}", mock.addr)],
        ..Default::default()
    };
    let config = turnguard::config::Config::resolve(&flags, &|_| None).unwrap();
    let started = turnguard::server::start(config).await;
    if unmount {
        sh("umount", &[&d]);
    }
    mock.abort();
    let err = match started {
        Ok(running) => {
            running.shutdown().await;
            panic!("turnguard started on a journal it cannot write");
        }
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&d) && err.contains("not writable"),
        "the start error names the journal and the problem: {err}"
    );
}

// ---- a crash ----------------------------------------------------------------------------------

fn spawn_turnguard(journal: &Path, mock: &str, port: u16, admin: u16) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_turnguard"))
        .args(["serve", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--admin-listen")
        .arg(format!("127.0.0.1:{admin}"))
        .arg("--journal")
        .arg(crate::support::journal_arg(journal))
        .arg("--policy")
        .arg(run_bundle())
        .arg("--upstream")
        .arg(format!("openai={mock}"))
        .env("TURNGUARD_LOG", "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("turnguard starts")
}

async fn wait_ready(admin: u16) {
    for _ in 0..200 {
        let url = format!("http://127.0.0.1:{admin}/readyz");
        let ready =
            async move { tokio::time::timeout(Duration::from_millis(500), get(&url)).await };
        if let Ok(Ok((200, _))) = tokio::spawn(ready).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("turnguard did not become ready");
}

/// SIGKILL under load (16 agents sending run-node requests that each carry a `charge` result),
/// then a restart on the same journal: `PRAGMA integrity_check` is `ok`, every result whose
/// request was answered 200 is in the journal (it was committed before going upstream), and
/// the restarted process serves.
#[tokio::test(flavor = "multi_thread")]
async fn kill_9_under_load_then_restart_keeps_the_journal_whole() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal.db");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let script = Script::parse(&text_answer().to_string(), "faults").unwrap();
    let mock = turnguard::mock_provider::spawn(listener, script).unwrap();
    let mock_url = format!("http://{}", mock.addr);
    let (port, admin) = (crate::support::free_port(), crate::support::free_port());
    let mut child = spawn_turnguard(&journal, &mock_url, port, admin);
    wait_ready(admin).await;

    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut agents = Vec::new();
    for a in 0..16 {
        let (url, stop) = (url.clone(), std::sync::Arc::clone(&stop));
        agents.push(tokio::spawn(async move {
            let mut served = Vec::new();
            for n in 0.. {
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                let id = format!("call_k{a}_{n}");
                let body = Bytes::from(charge_result_request(&id, "charged").to_string());
                let run = format!("run-kill-{a}");
                let sent = tokio::time::timeout(
                    Duration::from_secs(5),
                    tokio::spawn({
                        let url = url.clone();
                        async move { post_raw(&url, body, &[("turnguard-run", run.as_str())]).await }
                    }),
                )
                .await;
                match sent {
                    Ok(Ok((200, _, _))) => served.push(id),
                    Ok(Ok(_)) => {}
                    // The process died under this request.
                    _ => break,
                }
            }
            served
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut served = Vec::new();
    for a in agents {
        served.extend(a.await.unwrap());
    }
    assert!(served.len() >= 16, "load ran: {} answered", served.len());

    let mut child = spawn_turnguard(&journal, &mock_url, port, admin);
    wait_ready(admin).await;
    let (status, _, _) = post_raw(
        &url,
        Bytes::from(charge_result_request("call_after", "charged").to_string()),
        &[("turnguard-run", "run-kill-after")],
    )
    .await;
    assert_eq!(status, 200, "the restarted process serves");
    child.kill().unwrap();
    child.wait().unwrap();
    mock.abort();

    let db = support::journal(&journal);
    assert_eq!(db.check_integrity(), "ok");
    let mut missing = Vec::new();
    for id in &served {
        let n: i64 = db
            .query_row(
                "SELECT count(*) FROM tool_results WHERE tool_call_id = ?1",
                [id],
                |r| r.get(0),
            )
            .unwrap();
        if n == 0 {
            missing.push(id.clone());
        }
    }
    assert!(
        missing.is_empty(),
        "results of answered requests lost by the crash: {missing:?}"
    );
}

// ---- memory bounds and caps --------------------------------------------------------------

/// A tool schema of `props` properties (about 60 bytes each); `salt` makes it distinct.
fn big_schema(props: usize, salt: usize) -> Value {
    let mut properties = serde_json::Map::new();
    for i in 0..props {
        properties.insert(
            format!("p{salt}_{i}"),
            json!({"type": "string", "maxLength": 64, "description": format!("field {i}")}),
        );
    }
    json!({"type": "object", "properties": properties})
}

fn call_answer(name: &str) -> Value {
    json!({"id": "chatcmpl-s", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_s", "type": "function", "function": {"name": name, "arguments": "{}"}}]}}]})
}

/// A request declaring a schema larger than `max_schema_bytes` is refused before it goes
/// upstream, with 413 naming the cap and the flag.
#[tokio::test(flavor = "multi_thread")]
async fn a_declared_schema_over_the_cap_is_413_naming_the_flag() {
    let h = support::start_with(Script::default(), |c| c.max_schema_bytes = 4096).await;
    h.script(&json!({"responses": [{"json": call_answer("huge")}], "repeat": true}))
        .await;
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "huge", "parameters": big_schema(200, 0)}}]});
    let (status, resp) = post_json(&chat_url(&h), &body, &[]).await;
    assert_eq!(status, 413, "{}", String::from_utf8_lossy(&resp));
    let text = String::from_utf8_lossy(&resp);
    assert!(
        text.contains("--max-schema-bytes") && text.contains("4096") && text.contains("huge"),
        "{text}"
    );
    assert!(h.mock_requests().await.is_empty(), "nothing went upstream");
    h.stop().await;
}

/// The size check remembers schemas that passed (a declared tool no call names is not
/// serialized again on every request): a remembered pass never lets a larger schema through.
/// Small, oversized, oversized again, small again — 200, 413, 413, 200 — with a declared
/// tool no call names beside it each time; only the two admitted requests go upstream.
#[tokio::test(flavor = "multi_thread")]
async fn a_remembered_size_pass_never_admits_a_larger_schema() {
    let h = support::start_with(Script::default(), |c| c.max_schema_bytes = 4096).await;
    h.script(&json!({"responses": [{"json": call_answer("huge")}], "repeat": true}))
        .await;
    let request = |props: usize| {
        json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {"type": "function", "function": {"name": "aside", "parameters": big_schema(3, 1)}},
            {"type": "function", "function": {"name": "huge", "parameters": big_schema(props, 0)}}
        ]})
    };
    for (props, want) in [(2, 200), (200, 413), (200, 413), (2, 200)] {
        let (status, resp) = post_json(&chat_url(&h), &request(props), &[]).await;
        let text = String::from_utf8_lossy(&resp);
        assert_eq!(status, want, "{props} properties: {text}");
        if want == 413 {
            assert!(text.contains("huge") && text.contains("4096"), "{text}");
        }
    }
    assert_eq!(
        h.mock_requests().await.len(),
        2,
        "only the admitted requests went upstream"
    );
    h.stop().await;
}

/// A declared schema the process already holds is shared with the next request that declares
/// an equal one, never with one that differs: the same tool declared alternately with a schema
/// its call meets and with one that requires a field the call lacks is released, withheld,
/// released, withheld (each request is checked against its own declaration).
#[tokio::test(flavor = "multi_thread")]
async fn a_shared_schema_is_always_the_requests_own() {
    let h = support::start(Script::default()).await;
    let answer = json!({"id": "chatcmpl-s", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_s", "type": "function", "function": {"name": "lookup", "arguments": "{\"city\":\"Paris\"}"}}]}}]});
    h.script(&json!({"responses": [{"json": answer}], "repeat": true}))
        .await;
    let request = |strict: bool| {
        let mut schema = json!({"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}});
        if strict {
            schema["required"] = json!(["country"]);
        }
        json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "lookup", "parameters": schema}}]})
    };
    for (strict, released) in [
        (false, true),
        (true, false),
        (false, true),
        (true, false),
        (false, true),
    ] {
        let (status, resp) = post_json(&chat_url(&h), &request(strict), &[]).await;
        let text = String::from_utf8_lossy(&resp);
        let v: Value = serde_json::from_slice(&resp).unwrap_or(Value::Null);
        let calls = v
            .pointer("/choices/0/message/tool_calls")
            .and_then(Value::as_array);
        let out = status == 200 && calls.is_some_and(|c| c.iter().any(|c| c["id"] == "call_s"));
        assert_eq!(out, released, "required country: {strict}; {status} {text}");
    }
    h.stop().await;
}

/// Distinct large schemas do not grow the compiled-schema cache past its byte budget: least
/// recently used ones are evicted.
#[tokio::test(flavor = "multi_thread")]
async fn compiled_schemas_are_bounded_in_bytes() {
    let budget = 2usize << 20;
    let h = support::start_with(Script::default(), move |c| {
        c.max_schema_cache_bytes = budget;
    })
    .await;
    h.script(&json!({"responses": [{"json": call_answer("wide")}], "repeat": true}))
        .await;
    for salt in 0..12 {
        // ~16 KB of JSON each: an estimated 512 KiB compiled.
        let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "wide", "parameters": big_schema(260, salt)}}]});
        let (status, resp) = post_json(&chat_url(&h), &body, &[]).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
        let held = metric(&h, "turnguard_schema_cache_bytes").await;
        assert!(
            held > 0.0 && held <= budget as f64,
            "after {} schemas the cache holds {held} bytes (budget {budget})",
            salt + 1
        );
    }
    assert!(metric(&h, "turnguard_schema_cache_evictions_total").await >= 6.0);
    h.stop().await;
}

// ---- the admin plane ------------------------------------------------------------------------

/// `/config` never shows credentials embedded in an upstream URL; run data needs the admin
/// token or a verified bearer; `/metrics`, `/healthz` and `/readyz` stay open.
#[tokio::test(flavor = "multi_thread")]
async fn admin_plane_redacts_credentials_and_guards_run_data() {
    let keys = tempfile::tempdir().unwrap();
    let secret = keys.path().join("hs256.secret");
    std::fs::write(&secret, SECRET).unwrap();
    let h = support::start_with(Script::default(), move |c| {
        c.upstreams.insert(
            "openai".into(),
            upstream("http://agent:s3cr3t-pass@127.0.0.1:9"),
        );
        c.identity_issuer = Some(ISS.into());
        c.identity_audience = Some(AUD.into());
        c.identity_hs256_secret_file = Some(secret);
    })
    .await;
    let (status, body) = get(&format!("{}/config", h.admin_url())).await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(!text.contains("s3cr3t-pass"), "{text}");
    assert!(text.contains("***@"), "{text}");

    for path in ["/runs/run-1/events", "/runs/run-1/effects"] {
        let url = format!("{}{path}", h.admin_url());
        let (status, _, _) = support::call("GET", &url, &[], None).await;
        assert_eq!(status, 401, "{path} without credentials");
        let wrong = [("authorization", "Bearer not-the-admin-token".to_owned())];
        let (status, _, _) = support::call("GET", &url, &wrong, None).await;
        assert_eq!(status, 401, "{path} with a wrong token");
        let (status, body) = h.admin_get(path).await;
        assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&body));
        let person = person_token("alice", "reader");
        let bearer = [("authorization", format!("Bearer {person}"))];
        let (status, _, _) = support::call("GET", &url, &bearer, None).await;
        assert_eq!(status, 200, "{path} with a verified person's token");
    }
    for open in ["/metrics", "/healthz", "/readyz"] {
        let (status, _) = get(&format!("{}{open}", h.admin_url())).await;
        assert_eq!(status, 200, "{open} stays open");
    }
    h.stop().await;
}
