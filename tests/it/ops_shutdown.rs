//! Graceful shutdown of the real binary (issue 6, "Must show" 3): SIGTERM during a stream —
//! readiness goes false first, new requests are shed, the stream completes, the journal holds
//! the round, the process exits 0. Past the drain deadline an open stream is cut and journaled
//! as failed, and the process still exits 0. The JSON logs of the run carry one access line
//! per request and no secret, header value or tool argument.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use support::{fixtures, script};
use turnguard::mock_provider::{self, Script};

const STREAM_FIXTURE: &str = "openai-chat/stream-tool-call-single-include-usage.sse";
const SECRET: &str = "sk-live-DO-NOT-LOG-4242";

/// A free loopback port: bind :0, read the port, let it go.
struct Turnguard {
    child: Child,
    data: String,
    admin: String,
    dir: tempfile::TempDir,
}

impl Turnguard {
    fn journal(&self) -> std::path::PathBuf {
        self.dir.path().join("journal.db")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap()
    }

    fn sigterm(&self) {
        let ok = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -TERM");
    }

    /// Waits for the exit, at most `limit`.
    fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("turnguard did not exit within {limit:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Turnguard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn spawn_turnguard(mock: &str, extra: &[&str]) -> Turnguard {
    let dir = tempfile::tempdir().unwrap();
    let data = format!("127.0.0.1:{}", crate::support::free_port());
    let admin = format!("127.0.0.1:{}", crate::support::free_port());
    let stderr = std::fs::File::create(dir.path().join("stderr.log")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_turnguard"))
        .arg("serve")
        .arg(format!("--listen={data}"))
        .arg(format!("--admin-listen={admin}"))
        .arg(format!(
            "--journal={}",
            support::journal_arg(&dir.path().join("journal.db"))
        ))
        .arg(format!(
            "--policy={}",
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("policy")
                .display()
        ))
        .arg(format!("--upstream=openai=http://{mock}"))
        .arg("--log-format=json")
        .args(extra)
        .env_remove("TURNGUARD_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr))
        .spawn()
        .expect("the binary runs");
    let mut tg = Turnguard {
        child,
        data,
        admin,
        dir,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok((200, _)) = try_get(&format!("http://{}/readyz", tg.admin)).await {
            break;
        }
        if let Some(s) = tg.child.try_wait().unwrap() {
            panic!("turnguard exited early with {s}:\n{}", tg.log());
        }
        assert!(Instant::now() < deadline, "not ready within 20 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tg
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn try_get(url: &str) -> Result<(u16, Bytes), String> {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), client().request(req))
        .await
        .map_err(|_| "timeout".to_owned())?
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Ok((status, body))
}

fn chat_request(url: &str, request_id: &str) -> http::Request<Full<Bytes>> {
    let body = json!({
        "model": "gpt-4o-mini",
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "capital of the UK? PRIVATE-PROMPT-TEXT"}],
        "tools": [{"type": "function", "function": {"name": "get_capital", "parameters": {"type": "object"}}}]
    });
    http::Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {SECRET}"))
        .header("x-api-key", SECRET)
        .header("x-request-id", request_id)
        .header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

async fn start_mock(event_delay_ms: u64) -> mock_provider::MockHandle {
    let steps = json!([{ "file": STREAM_FIXTURE, "event_delay_ms": event_delay_ms }]);
    let script: Script = serde_json::from_value(script(steps, &fixtures())).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    mock_provider::spawn(listener, script).unwrap()
}

fn round(journal: &Path, request_id: &str) -> (String, bool, Option<String>, i64) {
    let db = support::journal(journal);
    let key = support::round_key(&db, request_id);
    let (state, stream, error): (String, bool, Option<String>) = db
        .query_row(
            "SELECT state, stream, error FROM rounds WHERE request_id = ?1",
            [&key],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap_or_else(|e| panic!("no round for {request_id} in the journal: {e}"));
    let executed: i64 = db
        .query_row(
            "SELECT count(*) FROM tool_calls WHERE request_id = ?1 AND outcome = 'executed'",
            [&key],
            |r| r.get(0),
        )
        .unwrap();
    (state, stream, error, executed)
}

/// Every stderr line is one JSON object; none carries a secret, a prompt or tool arguments.
fn json_lines(log: &str) -> Vec<Value> {
    for needle in [SECRET, "PRIVATE-PROMPT-TEXT", "country", "Bearer"] {
        assert!(!log.contains(needle), "`{needle}` reached the logs:\n{log}");
    }
    log.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_during_a_stream_lets_it_finish_journals_it_and_exits_0() {
    let mock = start_mock(120).await;
    let mut tg = spawn_turnguard(
        &mock.addr.to_string(),
        // One worker: the current-thread runtime a one-CPU sidecar gets by default (the
        // other test here keeps the default, multi-thread on a machine with more CPUs).
        &[
            "--shutdown-delay-ms=600",
            "--shutdown-grace-ms=15000",
            "--worker-threads=1",
        ],
    )
    .await;
    let url = format!("http://{}/v1/chat/completions", tg.data);
    let resp = client()
        .request(chat_request(&url, "drain-me-1"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // The response headers are through: the stream is in flight (its tool-call events are
    // held until the call is complete, so no body byte arrives yet).
    let mut body = resp.into_body();
    tg.sigterm();
    let signalled = Instant::now();
    // Readiness goes false first; while the listeners are still open (the shutdown delay),
    // a new request is shed with 503 `shutting_down`.
    let mut saw_unready = false;
    while signalled.elapsed() < Duration::from_millis(500) {
        if let Ok((503, b)) = try_get(&format!("http://{}/readyz", tg.admin)).await {
            assert!(String::from_utf8_lossy(&b).contains("runner_unavailable"));
            saw_unready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(saw_unready, "/readyz did not turn 503 after SIGTERM");
    let shed = client()
        .request(chat_request(&url, "too-late-1"))
        .await
        .unwrap();
    assert_eq!(shed.status(), 503);
    assert!(shed.headers().contains_key("retry-after"));
    let err: Value =
        serde_json::from_slice(&shed.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(err["error"]["details"]["reason"], "shutting_down");
    assert_eq!(err["error"]["code"], "runner_unavailable");

    // The stream runs to its end, with the released call and the terminator.
    let mut received = Vec::new();
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("the stream keeps flowing during the drain")
    {
        if let Ok(data) = frame.expect("frame").into_data() {
            received.extend_from_slice(&data);
        }
    }
    let text = String::from_utf8_lossy(&received);
    assert!(text.contains("get_capital"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    let status = tg.wait(Duration::from_secs(15));
    assert!(status.success(), "exit status {status}:\n{}", tg.log());
    mock.abort();

    let (state, stream, error, executed) = round(&tg.journal(), "drain-me-1");
    assert_eq!(
        (state.as_str(), stream, error, executed),
        ("ok", true, None, 1)
    );
    let lines = json_lines(&tg.log());
    let access: Vec<&Value> = lines
        .iter()
        .filter(|l| l["target"] == "turnguard::access" && l["request_id"] == "drain-me-1")
        .collect();
    assert_eq!(access.len(), 1, "one access line per request: {lines:?}");
    let a = access[0];
    assert_eq!(a["message"], "request");
    assert_eq!(a["api"], "openai_chat");
    assert_eq!(a["status"], 200);
    assert_eq!(a["stream"], true);
    assert_eq!(a["complete"], true);
    assert_eq!(a["trace_id"], "0af7651916cd43dd8448eb211c80319c");
    assert!(
        a["duration_ms"].as_f64().unwrap() >= 8.0 * 120.0 * 0.9,
        "a stream's line covers its whole life: {a}"
    );
    assert!(a["added_ms"].as_f64().unwrap() < a["duration_ms"].as_f64().unwrap());
    assert!(lines.iter().any(|l| l["request_id"] == "too-late-1"
        && l["shed"] == "shutting_down"
        && l["status"] == 503));
    assert!(lines
        .iter()
        .any(|l| l["message"] == "journal flushed; shutdown complete" && l["drained"] == true));
}

#[tokio::test(flavor = "multi_thread")]
async fn past_the_drain_deadline_an_open_stream_is_cut_journaled_and_the_exit_is_0() {
    let mock = start_mock(400).await;
    let mut tg = spawn_turnguard(&mock.addr.to_string(), &["--shutdown-grace-ms=300"]).await;
    let url = format!("http://{}/v1/chat/completions", tg.data);
    let resp = client()
        .request(chat_request(&url, "cut-me-1"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    tg.sigterm();
    let signalled = Instant::now();
    let mut received = Vec::new();
    while let Some(Ok(frame)) = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("the stream ends at the deadline")
    {
        if let Ok(data) = frame.into_data() {
            received.extend_from_slice(&data);
        }
    }
    let text = String::from_utf8_lossy(&received);
    assert!(
        !text.contains("get_capital") && !text.contains("country"),
        "held call fragments are never released: {text}"
    );
    assert!(!text.contains("[DONE]"), "{text}");
    assert!(
        text.contains("shutting down"),
        "the agent is told why: {text}"
    );
    let status = tg.wait(Duration::from_secs(15));
    assert!(status.success(), "exit status {status}:\n{}", tg.log());
    assert!(
        signalled.elapsed() < Duration::from_secs(3),
        "the deadline bounds the shutdown: {:?}",
        signalled.elapsed()
    );
    mock.abort();

    let (state, stream, error, executed) = round(&tg.journal(), "cut-me-1");
    assert_eq!((state.as_str(), stream, executed), ("failed", true, 0));
    let db = support::journal(&tg.journal());
    let withheld: i64 = db
        .query_row(
            "SELECT count(*) FROM tool_calls WHERE request_id = ?1
             AND outcome = 'invalid' AND stage = 'completion' AND reason = 'stream_cut'",
            [support::round_key(&db, "cut-me-1")],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(withheld, 1, "the held call is journaled as withheld");
    assert!(error.unwrap().contains("shutting down"));
    let lines = json_lines(&tg.log());
    assert!(lines
        .iter()
        .any(|l| l["message"] == "drain deadline passed: cutting open streams"));
    assert!(lines
        .iter()
        .any(|l| l["message"] == "journal flushed; shutdown complete" && l["drained"] == false));
}
