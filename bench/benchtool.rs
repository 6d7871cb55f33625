//! Benchmark helpers for `bench/run.sh` (not part of CI's measurements; built as a cargo
//! example so it compiles with the crate):
//!
//! - `benchtool mock --listen ADDR [--event-delay-us N]`: a fast OpenAI-compatible upstream.
//!   Its `get_weather` arguments match the acme example bundle's catalog
//!   (`policy/examples/acme`, the bundle `run.sh` uses), so
//!   the whole admission order runs and releases the call.
//!   `POST /v1/chat/completions` answers a ~1 KB tool-call completion, or with `"stream":true`
//!   a tool-call stream: a role chunk with text, the call's header, 8 argument deltas,
//!   the finish chunk, a usage chunk and `[DONE]`, `--event-delay-us` apart (the finish chunk
//!   follows the last argument delta at once). Every chunk carries its send time
//!   (`system_fingerprint: "fp_<kind>_<unix µs>"`), so a client on the same machine can tell
//!   how long after the upstream sent it a chunk arrived.
//! - `benchtool stream --url URL --concurrency N --seconds S`: a streaming load generator;
//!   prints one JSON line: requests, errors, rps, and p50/p99 of the time to first byte, the
//!   whole stream, and the *release delay* — the time from the upstream sending the last
//!   argument delta to the agent receiving it.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)] // a CLI tool

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::Router;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("mock") => {
            let listen: SocketAddr = arg(&args, "--listen").unwrap().parse().unwrap();
            let delay: u64 = arg(&args, "--event-delay-us")
                .map(|v| v.parse().unwrap())
                .unwrap_or(1000);
            mock(listen, Duration::from_micros(delay)).await;
        }
        Some("stream") => {
            let url = arg(&args, "--url").unwrap();
            let c: usize = arg(&args, "--concurrency").unwrap().parse().unwrap();
            let s: u64 = arg(&args, "--seconds").unwrap().parse().unwrap();
            stream_load(&url, c, Duration::from_secs(s)).await;
        }
        _ => {
            eprintln!("usage: benchtool mock --listen ADDR [--event-delay-us N] | stream --url URL --concurrency N --seconds S");
            std::process::exit(2);
        }
    }
}

// ---- the mock upstream ---------------------------------------------------------------------

const ID: &str = "chatcmpl-bench0000000000000000000000";

/// The non-stream completion: one `get_weather` call, about 1 KB.
fn completion() -> Bytes {
    let args = json!({
        "location": "San Francisco, CA", "units": "c",
        "days": 3, "include": ["hourly", "alerts", "wind", "humidity"],
        "note": "x".repeat(300)
    })
    .to_string();
    let body = json!({
        "id": ID, "object": "chat.completion", "created": 1727346167,
        "model": "gpt-4o-2024-08-06",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_CUdUoJpsWWVdxXntucvnol1M", "type": "function",
                "function": {"name": "get_weather", "arguments": args}}],
            "refusal": null}, "logprobs": null, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 48, "completion_tokens": 19, "total_tokens": 67,
            "completion_tokens_details": {"reasoning_tokens": 0}},
        "system_fingerprint": "fp_5050236cbd"
    });
    Bytes::from(body.to_string())
}

fn chunk(kind: &str, choices: serde_json::Value, usage: serde_json::Value) -> Bytes {
    let c = json!({
        "id": ID, "object": "chat.completion.chunk", "created": 1782955817,
        "model": "gpt-4o-mini-2024-07-18",
        "system_fingerprint": format!("fp_{kind}_{}", now_us()),
        "choices": choices, "usage": usage
    });
    Bytes::from(format!("data: {c}\n\n"))
}

/// The events of the stream, built at send time (each stamps its own send time).
fn stream_event(i: usize) -> Option<Bytes> {
    const PARTS: [&str; 8] = [
        "{\"location\":",
        "\"San Fran",
        "cisco, ",
        "CA\",",
        "\"units\"",
        ":",
        "\"c\"",
        "}",
    ];
    let delta = |d: serde_json::Value, finish: serde_json::Value| json!([{"index": 0, "delta": d, "logprobs": null, "finish_reason": finish}]);
    Some(match i {
        0 => chunk(
            "text",
            delta(
                json!({"role": "assistant", "content": "Checking the weather."}),
                json!(null),
            ),
            json!(null),
        ),
        1 => chunk(
            "head",
            delta(
                json!({"tool_calls": [{"index": 0, "id": "call_ZR5UUuTt3pf61kjwAJIYdVMj",
                    "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
                json!(null),
            ),
            json!(null),
        ),
        n @ 2..=9 => chunk(
            if n == 9 { "last" } else { "arg" },
            delta(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": PARTS[n - 2]}}]}),
                json!(null),
            ),
            json!(null),
        ),
        10 => chunk("finish", delta(json!({}), json!("tool_calls")), json!(null)),
        11 => chunk(
            "usage",
            json!([]),
            json!({"prompt_tokens": 53, "completion_tokens": 15, "total_tokens": 68}),
        ),
        12 => Bytes::from_static(b"data: [DONE]\n\n"),
        _ => return None,
    })
}

struct MockState {
    completion: Bytes,
    delay: Duration,
}

async fn mock(listen: SocketAddr, delay: Duration) {
    let state = Arc::new(MockState {
        completion: completion(),
        delay,
    });
    let router = Router::new().fallback(serve).with_state(state);
    let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router).await.unwrap();
}

async fn serve(State(m): State<Arc<MockState>>, req: Request<Body>) -> Response {
    let body = turnguard::body::read_capped(req.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    let stream = body
        .windows(13)
        .any(|w| w == b"\"stream\":true" || w == b"\"stream\": tru");
    if !stream {
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from(m.completion.clone()))
            .unwrap();
    }
    let delay = m.delay;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        let mut i = 0;
        loop {
            // The finish chunk follows the last argument delta at once.
            if i > 0 && i != 10 && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            // Built (and stamped) right before it is sent.
            let Some(ev) = stream_event(i) else { return };
            if tx.send(Ok(ev)).await.is_err() {
                return;
            }
            i += 1;
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap()
}

// ---- the streaming load generator ----------------------------------------------------------

#[derive(Default)]
struct Sample {
    ttfb_us: Vec<u64>,
    total_us: Vec<u64>,
    release_us: Vec<u64>,
    errors: u64,
}

fn request_body() -> Bytes {
    Bytes::from(
        json!({
            "model": "gpt-4o-mini",
            "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "What is the weather in San Francisco?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}]
        })
        .to_string(),
    )
}

async fn one_stream(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    url: &str,
    body: Bytes,
    s: &mut Sample,
) {
    let started = Instant::now();
    let req = Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-bench")
        .body(Full::new(body))
        .unwrap();
    let Ok(resp) = client.request(req).await else {
        s.errors += 1;
        return;
    };
    if resp.status() != 200 {
        s.errors += 1;
        let _ = turnguard::body::read_capped(resp.into_body(), 1 << 20).await;
        return;
    }
    let mut body = resp.into_body();
    let mut buf: Vec<u8> = Vec::new();
    let mut first = true;
    let mut release = None;
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            s.errors += 1;
            return;
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let arrived = now_us();
        if first && !data.is_empty() {
            first = false;
            s.ttfb_us.push(started.elapsed().as_micros() as u64);
        }
        buf.extend_from_slice(&data);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            if let Some(i) = text.find("\"fp_last_") {
                let digits: String = text[i + 9..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                if let Ok(sent) = digits.parse::<u128>() {
                    release = Some(arrived.saturating_sub(sent) as u64);
                }
            }
            if text.contains("[DONE]") {
                done = true;
            }
        }
    }
    match (release, done) {
        (Some(r), true) => {
            s.total_us.push(started.elapsed().as_micros() as u64);
            s.release_us.push(r);
        }
        _ => s.errors += 1,
    }
}

fn pct(v: &mut [u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

async fn stream_load(url: &str, concurrency: usize, duration: Duration) {
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency)
        .build(connector);
    let body = request_body();
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let client = client.clone();
        let url = url.to_owned();
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = Sample::default();
            while Instant::now() < deadline {
                one_stream(&client, &url, body.clone(), &mut s).await;
            }
            s
        }));
    }
    let mut all = Sample::default();
    for t in tasks {
        let s = t.await.unwrap();
        all.ttfb_us.extend(s.ttfb_us);
        all.total_us.extend(s.total_us);
        all.release_us.extend(s.release_us);
        all.errors += s.errors;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let n = all.total_us.len();
    println!(
        "{}",
        json!({
            "requests": n,
            "errors": all.errors,
            "rps": n as f64 / elapsed,
            "ttfb_p50_us": pct(&mut all.ttfb_us, 0.5),
            "ttfb_p99_us": pct(&mut all.ttfb_us, 0.99),
            "total_p50_us": pct(&mut all.total_us, 0.5),
            "total_p99_us": pct(&mut all.total_us, 0.99),
            "release_p50_us": pct(&mut all.release_us, 0.5),
            "release_p99_us": pct(&mut all.release_us, 0.99),
        })
    );
}
