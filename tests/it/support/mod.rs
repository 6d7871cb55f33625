//! Test support: a scripted mock provider and turnguard, both in-process on `127.0.0.1:0`,
//! driven over real sockets; fixture loaders for `../shared/fixtures`; a small HTTP client.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods
)] // test code

pub mod approvals;
pub mod db;
pub mod faulty;
pub mod runs;
pub mod served;

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use turnguard::config::{Config, ServeArgs};
use turnguard::mock_provider::{self, MockHandle, Script};
use turnguard::server::{self, Running};

pub use db::{journal_arg, sqlite_only, Backend, Db, OptionalExtension};

/// The admin token every harness is started with (`admin_token_file`): run data on the admin
/// plane needs it (or a verified person's bearer token).
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789abcdef";

/// A running pair: the mock provider and turnguard in front of it.
pub struct Harness {
    pub tg: Running,
    pub mock: MockHandle,
    pub dir: tempfile::TempDir,
}

impl Harness {
    /// `http://ADDR` of turnguard's data plane.
    pub fn url(&self) -> String {
        format!("http://{}", self.tg.addr)
    }
    /// `http://ADDR` of turnguard's admin plane.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.tg.admin_addr)
    }
    /// `http://ADDR` of the mock provider.
    pub fn mock_url(&self) -> String {
        format!("http://{}", self.mock.addr)
    }
    /// The journal file.
    pub fn journal(&self) -> PathBuf {
        self.dir.path().join("journal.db")
    }
    /// `GET` an admin-plane path with the admin token; returns status and body.
    pub async fn admin_get(&self, path: &str) -> (u16, Bytes) {
        let (status, _, body) = call(
            "GET",
            &format!("{}{path}", self.admin_url()),
            &[("authorization", format!("Bearer {ADMIN_TOKEN}"))],
            None,
        )
        .await;
        (status, body)
    }
    /// Replaces the mock's script.
    pub async fn script(&self, script: &Value) {
        let (status, body) =
            post_json(&format!("{}/_mock/script", self.mock_url()), script, &[]).await;
        assert_eq!(
            status,
            200,
            "mock refused script: {}",
            String::from_utf8_lossy(&body)
        );
    }
    /// Requests the mock received.
    pub async fn mock_requests(&self) -> Vec<Value> {
        let (_, body) = get(&format!("{}/_mock/requests", self.mock_url())).await;
        serde_json::from_slice(&body).expect("mock requests are JSON")
    }
    /// Stops turnguard (flushing the journal) and the mock.
    pub async fn stop(self) -> tempfile::TempDir {
        self.tg.shutdown().await;
        self.mock.abort();
        self.dir
    }
}

/// Starts the mock with `script` and turnguard with both upstreams pointing at it, with the
/// `tests/fixtures/policy-open` bundle (no catalog, every call permitted, end-turn).
pub async fn start(script: Script) -> Harness {
    start_with_policy(script, "policy-open").await
}

/// Starts with a policy bundle from `tests/fixtures/<bundle>`.
pub async fn start_with_policy(script: Script, bundle: &str) -> Harness {
    let dir = own_fixtures().join(bundle);
    start_with(script, move |c| c.policy = dir).await
}

/// Like [`start`], with a chance to adjust the config.
pub async fn start_with(script: Script, tweak: impl FnOnce(&mut Config)) -> Harness {
    start_in(tempfile::tempdir().expect("tempdir"), script, tweak).await
}

/// Like [`start_with`], on the journal in `dir` (`dir/journal.db`): with the directory a
/// stopped harness handed back ([`Harness::stop`]), this is a restart — a new turnguard
/// process state (and a new mock) on the same journal.
pub async fn start_in(
    dir: tempfile::TempDir,
    script: Script,
    tweak: impl FnOnce(&mut Config),
) -> Harness {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind mock");
    let mock = mock_provider::spawn(listener, script).expect("mock");
    let mock_url = format!("http://{}", mock.addr);
    let flags = ServeArgs {
        listen: Some("127.0.0.1:0".into()),
        admin_listen: Some("127.0.0.1:0".into()),
        journal: Some(PathBuf::from(journal_arg(&dir.path().join("journal.db")))),
        policy: Some(own_fixtures().join("policy-open")),
        upstream: vec![
            format!("openai={mock_url}"),
            format!("anthropic={mock_url}"),
        ],
        ..Default::default()
    };
    let token = dir.path().join("admin.token");
    std::fs::write(&token, ADMIN_TOKEN).expect("admin token file");
    let mut config = Config::resolve(&flags, &|_| None).expect("config");
    config.admin_token_file = Some(token);
    tweak(&mut config);
    let tg = server::start(config).await.expect("turnguard starts");
    Harness { tg, mock, dir }
}

/// A TCP port free on 127.0.0.1 now, for a listener a test must name before it binds (a
/// redirect URI that holds the port, a process restarted on the same address).
///
/// A port `bind(0)` handed out and gave back can be taken before the test binds it again:
/// by another test's `bind(0)` or, more often, as the local port of any outgoing connection,
/// both drawn from the kernel's ephemeral range (`ip_local_port_range`, 32768–60999 by
/// default) — CI once failed with `Address already in use` that way. So the port comes from
/// the 12,000 ports just below that range, which neither takes, in turn from a process-wide
/// counter (two tests of this process never get the same one), starting at an offset from
/// the process id (two test processes at once rarely meet), and is checked free by binding it.
///
/// Panics when no port in that span is free.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const SPAN: u32 = 12_000;
    let ephemeral_low: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768);
    let low = ephemeral_low.saturating_sub(SPAN).max(1_024);
    let span = ephemeral_low.saturating_sub(low).max(1);
    let offset = std::process::id() % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = u16::try_from(low + (offset + n) % span).expect("a port below 65536");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {low}..{}", low + span);
}

/// `../shared/fixtures/providers` beside the checkout (or `$TURNGUARD_FIXTURES`).
pub fn fixtures() -> PathBuf {
    if let Some(p) = std::env::var_os("TURNGUARD_FIXTURES") {
        return PathBuf::from(p);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/providers")
}

/// This repository's own fixtures (`tests/fixtures`).
pub fn own_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A script serving `steps` (JSON values) in order, files relative to `base_dir`.
pub fn script(steps: Value, base_dir: &Path) -> Value {
    serde_json::json!({ "responses": steps, "base_dir": base_dir })
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// POSTs JSON; returns status and the whole body.
pub async fn post_json(url: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Bytes) {
    let (status, _, body) = post_raw(url, Bytes::from(body.to_string()), headers).await;
    (status, body)
}

/// POSTs bytes; returns status, headers and the whole body.
pub async fn post_raw(
    url: &str,
    body: Bytes,
    headers: &[(&str, &str)],
) -> (u16, http::HeaderMap, Bytes) {
    let mut req = http::Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    exchange(req, body, Duration::from_secs(30)).await
}

/// One HTTP exchange with any method and headers (a JSON body when given); returns status,
/// headers and the whole body. Times out after 60 s.
pub async fn call(
    method: &str,
    url: &str,
    headers: &[(&str, String)],
    body: Option<&Value>,
) -> (u16, http::HeaderMap, Bytes) {
    let mut req = http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, v.as_str());
    }
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Bytes::from(b.to_string())
        }
        None => Bytes::new(),
    };
    exchange(req, body, Duration::from_secs(60)).await
}

/// Sends one request as built — any header bytes, a name given twice — and collects the whole
/// answer: status, headers, body.
pub async fn exchange(
    req: http::request::Builder,
    body: Bytes,
    limit: Duration,
) -> (u16, http::HeaderMap, Bytes) {
    let resp = tokio::time::timeout(limit, client().request(req.body(Full::new(body)).unwrap()))
        .await
        .expect("answer in time")
        .expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    (status, headers, body)
}

/// GETs a URL; returns status and body.
pub async fn get(url: &str) -> (u16, Bytes) {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.expect("request");
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    (status, body)
}

/// Opens a streaming POST and returns the response for frame-by-frame reading.
pub async fn post_stream(url: &str, body: &Value) -> http::Response<hyper::body::Incoming> {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    client().request(req).await.expect("request")
}

/// The `data:` payloads of an SSE body, parsed as JSON where they are JSON.
pub fn sse_data(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .flat_map(|ev| {
            ev.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .map(|d| serde_json::from_str(&d).unwrap_or(Value::String(d)))
        .collect()
}

/// The Python interpreter that has the official SDKs: `$TURNGUARD_TEST_PYTHON`, else
/// `.venv/bin/python` in the checkout.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("TURNGUARD_TEST_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        venv.exists(),
        "the SDK tests need a Python with the official openai and anthropic packages: run \
         `python3 -m venv .venv && .venv/bin/pip install -r tests/sdk/requirements.txt` \
         (README, 'Tests') or set TURNGUARD_TEST_PYTHON"
    );
    venv
}

/// Runs `tests/sdk/<script>` with the SDK interpreter ([`python`]) and `args`, unbuffered,
/// killed if it runs past `limit`; returns its output.
pub async fn run_sdk_script(
    script: &str,
    args: &[std::ffi::OsString],
    limit: Duration,
) -> std::process::Output {
    let python = python();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/sdk")
        .join(script);
    let run = tokio::process::Command::new(&python)
        .arg(&path)
        .args(args)
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{script} did not finish within {} s", limit.as_secs()))
        .unwrap_or_else(|e| panic!("cannot run {} {}: {e}", python.display(), path.display()))
}

/// Runs `tests/compat/node/<script>` with `node` (the official Node SDKs of the
/// compatibility suite, installed by `npm ci` there) and `args`, killed if it runs past
/// `limit`; returns its output.
pub async fn run_node_script(
    script: &str,
    args: &[std::ffi::OsString],
    limit: Duration,
) -> std::process::Output {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/node");
    assert!(
        dir.join("node_modules/.package-lock.json").exists(),
        "the Node SDK tests need tests/compat/node's packages: run `npm ci` there (README, 'Tests')"
    );
    let run = tokio::process::Command::new("node")
        .arg(dir.join(script))
        .args(args)
        .current_dir(&dir)
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{script} did not finish within {} s", limit.as_secs()))
        .unwrap_or_else(|e| panic!("cannot run node {script}: {e}"))
}

/// Opens the journal of a harness directory (`DIR/journal.db`) for reading, on whichever
/// backend the suite runs ([`db`]).
pub fn journal(path: &Path) -> Db {
    Db::open(path)
}

/// turnguard's own journal id of the round an agent sent with `x-request-id: <client>` (its
/// first round; `<client>#repair-N` names the repair rounds of the same request). The journal
/// keys every record by its own ids and keeps the client's in `rounds.client_request_id`.
pub fn round_key(db: &Db, client: &str) -> String {
    let (base, suffix) = match client.find("#repair-") {
        Some(i) => (&client[..i], &client[i..]),
        None => (client, ""),
    };
    let id: Option<String> = db
        .query_row(
            "SELECT request_id FROM rounds WHERE client_request_id = ?1
             AND instr(request_id, '#repair-') = 0 ORDER BY id LIMIT 1",
            [base],
            |r| r.get(0),
        )
        .optional()
        .unwrap();
    match id {
        Some(id) => format!("{id}{suffix}"),
        None => format!("(no round sent as {client})"),
    }
}

/// SQL for a round's label as the agent named it: `client_request_id`, plus `#repair-N` for a
/// repair round (use in `SELECT … FROM rounds`).
pub const CLIENT_ROUND_LABEL: &str = "client_request_id || CASE WHEN instr(request_id, '#repair-') > 0 THEN substr(request_id, instr(request_id, '#repair-')) ELSE '' END";
