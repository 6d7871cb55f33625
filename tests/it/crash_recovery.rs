//! Crash test (issue 4, must-show 4): the real `turnguard` binary is killed with SIGKILL at
//! random points of a scripted 10-round run with a `charge` tool (business key `/chargeId`),
//! restarted on the same journal, and the agent re-sends. Over [`TRIALS`] trials every charge
//! must reach the agent exactly once. And two concurrent executors of the same effect (same
//! `chargeId`, different call ids) produce exactly one claim: one released, one suppressed.
//!
//! Everything runs as separate processes over real sockets: `turnguard mock-provider` plays the
//! model, `turnguard serve` is the proxy under test, and this test is the agent (a minimal
//! blocking HTTP/1.1 client, so a kill is seen exactly as an agent sees it: a refused or cut
//! connection).
//!
//! On the PostgreSQL backend (`TURNGUARD_TEST_BACKEND=postgres`) this is the multi-replica
//! test of issue 15: three `turnguard serve` processes share one database and the agent's
//! requests rotate across them, one replica per request, so every run moves between
//! processes every round; a kill point kills the replica the round is sent to (the one that
//! takes the round's claim and records its served answer), and the re-send lands on another
//! replica, which must recover from the shared journal: replay the recorded answer, or say
//! `tool_outcome_unknown` when the answer is in doubt — never a second execution. The two
//! concurrent executors of one business key go to two different replicas and must still
//! produce one claim. On SQLite (a file belongs to one process) there is one replica.
//!
//! The simulated model is a function of the transcript: with `r` assistant turns so far it
//! asks for charge `r` (`chargeId` `t<trial>-c<r>`, call id `call_t<trial>_c<r>`, or with a
//! fresh suffix, see [`Variant`]) for `r < 9` and answers finally at `r = 9`. Before each agent request the test posts that answer to the mock as a one-step
//! `repeat: true` script, so every model call for the same transcript gets the same answer,
//! however often turnguard asks after a restart.
//!
//! The agent is a durable runtime: it keeps its transcript, executes every `charge` call it
//! receives once (counted per `chargeId`), and on a connection error waits for turnguard to
//! come back and re-sends the same request (same attempt). On `turnguard.tool_outcome_unknown`
//! (its answer was lost after turnguard recorded it) the node has failed and is retried as a
//! new attempt (`Turnguard-Attempt` + 1). Trials cycle through three [`Variant`]s of model and
//! runtime:
//! - deterministic call ids, the failed node resumed from the same transcript;
//! - deterministic call ids, the failed node re-run from its start by an orphan sweeper (the
//!   failure issue 4 was filed for);
//! - fresh call ids on every model call (as OpenAI and Anthropic mint them), the failed node
//!   resumed. In every variant, a charge whose round failed with `tool_outcome_unknown` is
//!   genuinely in doubt (turnguard recorded the answer, the agent may or may not have got it):
//!   it may reach the agent at most once, and turnguard never releases it again. Every other
//!   charge must reach it exactly once.
//!
//! Kill points (seeded LCG, [`SEED`]): 1–2 kills per trial, each at a random round and one
//! of: before the request; a random 0–15 ms into it (the model answers after a random
//! 0–8 ms); the instant the previous call's result is committed; the instant the round's
//! effect claim is committed; the instant the round's served record is committed (these three
//! by polling the journal read-only); or after the agent received the answer, before it runs
//! the charge.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::support;
use serde_json::{json, Value};

/// Trials of the 10-round run.
const TRIALS: u64 = 50;
/// Charges per run (rounds 0..CHARGES release one charge each; round CHARGES answers finally).
const CHARGES: u64 = 9;
/// The kill schedule's seed.
const SEED: u64 = 0x7475_726e_6775_6172; // "turnguar"
/// Pairs of concurrent executors.
const PAIRS: u64 = 12;

// ---------------------------------------------------------------------------------------------
// Processes

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_turnguard")
}

fn bundle() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/policy-run")
}

/// A seeded linear congruential generator (Knuth's MMIX constants).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The mock provider process.
struct Mock {
    child: Child,
    addr: String,
}

impl Mock {
    fn start(dir: &Path) -> Self {
        let script = dir.join("mock-script.json");
        std::fs::write(
            &script,
            json!({"responses": [{"json": final_answer()}], "repeat": true}).to_string(),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{}", crate::support::free_port());
        let log = std::fs::File::create(dir.join("mock.log")).unwrap();
        let child = Command::new(bin())
            .args(["mock-provider", "--listen", &addr, "--script"])
            .arg(&script)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("mock starts");
        let mock = Self { child, addr };
        let deadline = Instant::now() + Duration::from_secs(10);
        while http(&mock.addr, "GET", "/_mock/requests", &[], None).is_err() {
            assert!(Instant::now() < deadline, "the mock did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
        mock
    }
    /// The model's answer to the next request(s): one step, repeated.
    fn answer(&self, answer: &Value, delay_ms: u64) {
        let script = json!({"responses": [{"json": answer, "delay_ms": delay_ms}], "repeat": true});
        let (status, _, body) = http(
            &self.addr,
            "POST",
            "/_mock/script",
            &[],
            Some(script.to_string().as_bytes()),
        )
        .expect("mock reachable");
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    /// Two different answers, one per request, in order.
    fn answers(&self, answers: &[Value], delay_ms: u64) {
        let steps: Vec<Value> = answers
            .iter()
            .map(|a| json!({"json": a, "delay_ms": delay_ms}))
            .collect();
        let (status, _, _) = http(
            &self.addr,
            "POST",
            "/_mock/script",
            &[],
            Some(json!({ "responses": steps }).to_string().as_bytes()),
        )
        .expect("mock reachable");
        assert_eq!(status, 200);
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Replicas of `turnguard serve` on one journal: 3 on PostgreSQL (the journal they share),
/// 1 on SQLite (a file belongs to one process).
fn replica_count() -> usize {
    match support::db::backend() {
        support::Backend::Postgres => 3,
        support::Backend::Sqlite => 1,
    }
}

/// One `turnguard serve` process on fixed ports, restartable after a kill.
struct Replica {
    child: Arc<Mutex<Option<Child>>>,
    data: String,
    admin: String,
    log: PathBuf,
}

/// The replicas of `turnguard serve` on one journal, restartable after a kill. The agent's
/// requests rotate across them ([`Turnguard::next`]): each request goes to the next replica,
/// so a run moves between processes every round, and a re-send after a kill lands on another
/// replica than the one killed.
struct Turnguard {
    replicas: Vec<Replica>,
    cursor: std::sync::atomic::AtomicUsize,
    journal: PathBuf,
    mock: String,
    starts: u64,
}

impl Turnguard {
    fn new(dir: &Path, mock: &Mock) -> Self {
        let replicas = (0..replica_count())
            .map(|i| Replica {
                child: Arc::new(Mutex::new(None)),
                data: format!("127.0.0.1:{}", crate::support::free_port()),
                admin: format!("127.0.0.1:{}", crate::support::free_port()),
                log: dir.join(format!("turnguard-{i}.log")),
            })
            .collect();
        let mut tg = Self {
            replicas,
            cursor: std::sync::atomic::AtomicUsize::new(0),
            journal: dir.join("journal.db"),
            mock: mock.addr.clone(),
            starts: 0,
        };
        tg.ensure_running();
        tg
    }

    /// The replica the next request goes to (and advances the rotation).
    fn next(&self) -> &Replica {
        let i = self.cursor.fetch_add(1, Ordering::SeqCst);
        &self.replicas[i % self.replicas.len()]
    }

    /// The replica the next request will go to.
    fn upcoming(&self) -> &Replica {
        &self.replicas[self.cursor.load(Ordering::SeqCst) % self.replicas.len()]
    }

    fn spawn(&mut self, i: usize) -> Child {
        self.starts += 1;
        let r = &self.replicas[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&r.log)
            .unwrap();
        Command::new(bin())
            .arg("serve")
            .args(["--listen", &r.data, "--admin-listen", &r.admin])
            .arg("--journal")
            .arg(support::journal_arg(&self.journal))
            .arg("--policy")
            .arg(bundle())
            .args(["--upstream", &format!("openai=http://{}", self.mock)])
            .env("TURNGUARD_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("turnguard starts")
    }

    fn alive(&self, i: usize) -> bool {
        let mut g = self.replicas[i].child.lock().unwrap();
        match g.as_mut() {
            Some(c) => c.try_wait().unwrap().is_none(),
            None => false,
        }
    }

    /// Starts every replica that is not running and waits until each is ready.
    fn ensure_running(&mut self) {
        for i in 0..self.replicas.len() {
            self.ensure_replica(i);
        }
    }

    fn ensure_replica(&mut self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert!(
                Instant::now() < deadline,
                "turnguard replica {i} did not come back:\n{}",
                self.log_tail()
            );
            if !self.alive(i) {
                let child = self.spawn(i);
                *self.replicas[i].child.lock().unwrap() = Some(child);
            }
            let ready_by = Instant::now() + Duration::from_secs(5);
            while self.alive(i) && Instant::now() < ready_by {
                if matches!(
                    http(&self.replicas[i].admin, "GET", "/readyz", &[], None),
                    Ok((200, _, _))
                ) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            // It exited (a port still held, or killed while starting): try again.
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The process of the replica the next request goes to: the one a kill point kills.
    fn kill_handle(&self) -> Arc<Mutex<Option<Child>>> {
        Arc::clone(&self.upcoming().child)
    }

    fn log_tail(&self) -> String {
        let mut out = String::new();
        for r in &self.replicas {
            let text = std::fs::read_to_string(&r.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {}\n", r.log.display()));
            out.push_str(&lines[lines.len().saturating_sub(30)..].join("\n"));
            out.push('\n');
        }
        out
    }
}

impl Drop for Turnguard {
    fn drop(&mut self) {
        for r in &self.replicas {
            if let Some(mut c) = r.child.lock().unwrap().take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// SIGKILL (std's `Child::kill` on Unix) and reap.
fn kill(handle: &Mutex<Option<Child>>) -> bool {
    let mut g = handle.lock().unwrap();
    let Some(c) = g.as_mut() else {
        return false;
    };
    if c.try_wait().unwrap().is_some() {
        return false;
    }
    let _ = c.kill();
    let _ = c.wait();
    true
}

// ---------------------------------------------------------------------------------------------
// A minimal blocking HTTP/1.1 client (one connection per request, `Connection: close`)

fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: Option<&[u8]>,
) -> std::io::Result<(u16, Vec<(String, String)>, Vec<u8>)> {
    use std::io::{Error, ErrorKind};
    let sock: SocketAddr = addr.parse().unwrap();
    let mut s = TcpStream::connect_timeout(&sock, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = body.unwrap_or_default();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| Error::new(ErrorKind::UnexpectedEof, "no complete response head"))?;
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| Error::new(ErrorKind::InvalidData, "bad status line"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let rest = raw[end + 4..].to_vec();
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let body = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        dechunk(&rest)
            .ok_or_else(|| Error::new(ErrorKind::UnexpectedEof, "chunked body cut short"))?
    } else if let Some(n) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        if rest.len() < n {
            return Err(Error::new(ErrorKind::UnexpectedEof, "body cut short"));
        }
        rest[..n].to_vec()
    } else {
        rest
    };
    Ok((status, headers, body))
}

/// Decodes a chunked body; `None` when the terminating chunk never came.
fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&b[..eol]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        b = &b[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        if b.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

// ---------------------------------------------------------------------------------------------
// The model and the agent

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "charge", "parameters": {"type": "object",
            "properties": {"chargeId": {"type": "string"}, "amount": {"type": "number"}},
            "required": ["chargeId", "amount"]}}},
        {"type": "function", "function": {"name": "lookup_order", "parameters": {"type": "object",
            "properties": {"orderId": {"type": "string"}}, "required": ["orderId"]}}}
    ])
}

fn charge_answer(call_id: &str, charge_id: &str, amount: u64) -> Value {
    let args = json!({"chargeId": charge_id, "amount": amount}).to_string();
    json!({
        "id": format!("chatcmpl-{call_id}"), "object": "chat.completion", "created": 1_782_955_817,
        "model": "gpt-test",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "charge", "arguments": args}}]},
            "logprobs": null, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 90, "completion_tokens": 20, "total_tokens": 110}
    })
}

fn final_answer() -> Value {
    json!({
        "id": "chatcmpl-final", "object": "chat.completion", "created": 1_782_955_817,
        "model": "gpt-test",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "All charges are done."},
            "logprobs": null, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 90, "completion_tokens": 6, "total_tokens": 96}
    })
}

/// The scripted model: a pure function of the transcript. With `nonce`, the call id is fresh
/// (as real providers mint them); without, it is the same for the same transcript.
fn model(trial: u64, messages: &[Value], nonce: Option<u64>) -> Value {
    let r = messages.iter().filter(|m| m["role"] == "assistant").count() as u64;
    if r < CHARGES {
        let call_id = match nonce {
            Some(n) => format!("call_t{trial}_c{r}_n{n}"),
            None => format!("call_t{trial}_c{r}"),
        };
        charge_answer(&call_id, &format!("t{trial}-c{r}"), r + 1)
    } else {
        final_answer()
    }
}

/// How the model mints call ids and what the agent runtime does when its node fails with
/// `turnguard.tool_outcome_unknown`. Trials cycle through the three.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// Same call id for the same transcript; on `tool_outcome_unknown` the runtime retries
    /// the node as a new attempt from the same transcript.
    DeterministicResume,
    /// Same call id for the same transcript; on `tool_outcome_unknown` an orphan sweeper
    /// re-runs the node from its start as a new attempt (the failure issue 4 was filed for).
    DeterministicRerun,
    /// A fresh call id on every model call (as OpenAI and Anthropic mint them); on
    /// `tool_outcome_unknown` the runtime retries the node as a new attempt from the same
    /// transcript. The charge of that round is then genuinely in doubt: it may be released
    /// at most once (0 or 1), every other charge exactly once.
    FreshResume,
}

impl Variant {
    fn of(trial: u64) -> Self {
        match trial % 3 {
            0 => Self::DeterministicResume,
            1 => Self::DeterministicRerun,
            _ => Self::FreshResume,
        }
    }
}

/// One agent request to turnguard.
struct Sent {
    status: u16,
    served: bool,
    json: Value,
    text: String,
}

fn send(tg: &Turnguard, run: &str, attempt: u32, messages: &[Value]) -> std::io::Result<Sent> {
    let body = json!({"model": "gpt-test", "messages": messages, "tools": tools()});
    let (status, headers, bytes) = http(
        &tg.next().data,
        "POST",
        "/v1/chat/completions",
        &[
            ("Turnguard-Run", run.to_owned()),
            ("Turnguard-Attempt", attempt.to_string()),
        ],
        Some(body.to_string().as_bytes()),
    )?;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    Ok(Sent {
        status,
        served: headers
            .iter()
            .any(|(k, v)| k == "turnguard-served" && v == "recorded"),
        json: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        text,
    })
}

fn released_charges(reply: &Value) -> Vec<(String, String)> {
    reply
        .pointer("/choices/0/message/tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|c| c["function"]["name"] == "charge")
        .map(|c| {
            let args: Value =
                serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            (
                c["id"].as_str().unwrap().to_owned(),
                args["chargeId"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Kill points

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum KillAt {
    /// Before the agent sends the round.
    BeforeSend,
    /// A random 0–15 ms after the agent starts sending.
    Timed(u64),
    /// The instant the previous round's call result is committed.
    ResultCommitted,
    /// The instant the round's effect claim is committed.
    ClaimCommitted,
    /// The instant the round's served record is committed.
    ServedCommitted,
    /// After the agent received the answer, before it runs the charge.
    AfterAnswer,
}

impl KillAt {
    fn label(self) -> &'static str {
        match self {
            Self::BeforeSend => "before-send",
            Self::Timed(_) => "timed",
            Self::ResultCommitted => "result-committed",
            Self::ClaimCommitted => "claim-committed",
            Self::ServedCommitted => "served-committed",
            Self::AfterAnswer => "after-answer",
        }
    }
}

/// A watcher that kills turnguard when a journal row appears (or after a delay).
struct Armed {
    stop: Arc<AtomicBool>,
    fired: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Armed {
    fn disarm(self) -> bool {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap();
        self.fired.load(Ordering::SeqCst)
    }
}

fn arm_timer(handle: Arc<Mutex<Option<Child>>>, ms: u64) -> Armed {
    let stop = Arc::new(AtomicBool::new(false));
    let fired = Arc::new(AtomicBool::new(false));
    let (s, f) = (Arc::clone(&stop), Arc::clone(&fired));
    let thread = std::thread::spawn(move || {
        let until = Instant::now() + Duration::from_millis(ms);
        while Instant::now() < until {
            if s.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        if kill(&handle) {
            f.store(true, Ordering::SeqCst);
        }
    });
    Armed {
        stop,
        fired,
        thread,
    }
}

fn arm_watch(
    handle: Arc<Mutex<Option<Child>>>,
    journal: PathBuf,
    sql: &'static str,
    params: Vec<String>,
) -> Armed {
    let stop = Arc::new(AtomicBool::new(false));
    let fired = Arc::new(AtomicBool::new(false));
    let (s, f) = (Arc::clone(&stop), Arc::clone(&fired));
    let thread = std::thread::spawn(move || {
        let db = support::journal(&journal);
        let params: Vec<support::db::DbValue> = params
            .iter()
            .map(|p| support::db::DbValue::Text(p.clone()))
            .collect();
        while !s.load(Ordering::SeqCst) {
            let n: i64 = db.query_row(sql, params.clone(), |r| r.get(0)).unwrap_or(0);
            if n > 0 {
                if kill(&handle) {
                    f.store(true, Ordering::SeqCst);
                }
                return;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    });
    Armed {
        stop,
        fired,
        thread,
    }
}

// ---------------------------------------------------------------------------------------------
// The trial

#[derive(Default, Debug)]
struct Stats {
    kills_fired: BTreeMap<&'static str, u64>,
    kills_armed: BTreeMap<&'static str, u64>,
    resends: u64,
    served_from_record: u64,
    outcome_unknown: u64,
    suppressed: u64,
    requests: u64,
}

/// What one trial ended with.
struct Outcome {
    /// Call ids the agent received (and executed), per `chargeId`.
    released: BTreeMap<String, Vec<String>>,
    /// `chargeId`s whose round failed with `tool_outcome_unknown` (genuinely in doubt).
    in_doubt: Vec<String>,
    finished: bool,
    notes: Vec<String>,
}

/// Runs one trial: the agent drives the run to its final answer through the planned kills.
fn trial(t: u64, rng: &mut Lcg, tg: &mut Turnguard, mock: &Mock, stats: &mut Stats) -> Outcome {
    let variant = Variant::of(t);
    // The kill plan comes first from the shared generator, so every run of the test plans the
    // same kills; the model's answer delays come from a per-trial generator.
    let mut delays = Lcg(SEED ^ t.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut nonce = 0u64;
    let mut in_doubt = Vec::new();
    let run = format!("crash-t{t}");
    let mut plan: BTreeMap<u64, KillAt> = BTreeMap::new();
    for _ in 0..=rng.below(2) {
        let round = rng.below(CHARGES + 1);
        let at = match rng.below(6) {
            0 => KillAt::BeforeSend,
            1 => KillAt::Timed(rng.below(16)),
            2 => KillAt::ResultCommitted,
            3 => KillAt::ClaimCommitted,
            4 => KillAt::ServedCommitted,
            _ => KillAt::AfterAnswer,
        };
        plan.insert(round, at);
    }
    let mut released: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut notes = Vec::new();
    let mut messages = vec![
        json!({"role": "user", "content": format!("Run the {CHARGES} charges of trial {t}.")}),
    ];
    let mut attempt = 1u32;
    let mut finished = false;
    for _ in 0..60 {
        let r = messages.iter().filter(|m| m["role"] == "assistant").count() as u64;
        let delay_ms = delays.below(9);
        let kill_at = plan.remove(&r);
        if let Some(at) = kill_at {
            *stats.kills_armed.entry(at.label()).or_default() += 1;
        }
        let armed = match kill_at {
            Some(KillAt::BeforeSend) => {
                if kill(&tg.kill_handle()) {
                    *stats.kills_fired.entry("before-send").or_default() += 1;
                    notes.push(format!("round {r}: killed before-send"));
                }
                None
            }
            Some(KillAt::Timed(ms)) => Some(arm_timer(tg.kill_handle(), ms)),
            Some(KillAt::ResultCommitted) if r > 0 => Some(arm_watch(
                tg.kill_handle(),
                tg.journal.clone(),
                "SELECT count(*) FROM tool_results WHERE scope = ?1 AND tool_call_id LIKE ?2",
                vec![format!("run:{run}"), format!("call_t{t}_c{}%", r - 1)],
            )),
            Some(KillAt::ClaimCommitted) => Some(arm_watch(
                tg.kill_handle(),
                tg.journal.clone(),
                "SELECT count(*) FROM effects WHERE run_id = ?1 AND call_id LIKE ?2",
                vec![run.clone(), format!("call_t{t}_c{r}%")],
            )),
            Some(KillAt::ServedCommitted) => Some(arm_watch(
                tg.kill_handle(),
                tg.journal.clone(),
                "SELECT count(*) FROM served WHERE run_id = ?1 AND attempt = ?2 AND round_index = ?3",
                vec![run.clone(), attempt.to_string(), r.to_string()],
            )),
            _ => None,
        };
        // Send until turnguard answers (re-sending after a kill).
        let mut reply = None;
        let mut armed = armed;
        for _ in 0..20 {
            stats.requests += 1;
            let fresh = (variant == Variant::FreshResume).then(|| {
                nonce += 1;
                nonce
            });
            mock.answer(&model(t, &messages, fresh), delay_ms);
            let result = send(tg, &run, attempt, &messages);
            if let Some(a) = armed.take() {
                let label = kill_at.unwrap().label();
                if a.disarm() {
                    *stats.kills_fired.entry(label).or_default() += 1;
                    notes.push(format!("round {r}: killed at {label}"));
                }
            }
            match result {
                Err(_) => {
                    stats.resends += 1;
                    tg.ensure_running();
                }
                Ok(s)
                    if s.status == 409
                        && s.json["error"]["code"] == "turnguard.tool_outcome_unknown" =>
                {
                    stats.outcome_unknown += 1;
                    notes.push(format!(
                        "round {r}: tool_outcome_unknown at attempt {attempt}"
                    ));
                    attempt += 1;
                    match variant {
                        Variant::DeterministicRerun => {
                            // The sweeper re-runs the node from its start; the charge of the
                            // round that got the 409 stays in doubt (it is never re-released).
                            in_doubt.push(format!("t{t}-c{r}"));
                            messages.truncate(1);
                            break;
                        }
                        // After a 409 the charge of that round is genuinely in doubt whatever
                        // the call ids: a released call without a recorded result may have run
                        // (the orphan-sweeper case), so turnguard never releases it again.
                        Variant::FreshResume | Variant::DeterministicResume => {
                            in_doubt.push(format!("t{t}-c{r}"))
                        }
                    }
                }
                Ok(s) => {
                    reply = Some(s);
                    break;
                }
            }
        }
        let Some(reply) = reply else {
            assert!(
                variant == Variant::DeterministicRerun && messages.len() == 1,
                "trial {t} round {r}: no answer after 20 sends"
            );
            continue; // the node starts over
        };
        assert_eq!(
            reply.status, 200,
            "trial {t} round {r} attempt {attempt}: {}",
            reply.text
        );
        if reply.served {
            stats.served_from_record += 1;
        }
        if kill_at == Some(KillAt::AfterAnswer) && kill(&tg.kill_handle()) {
            *stats.kills_fired.entry("after-answer").or_default() += 1;
            notes.push(format!("round {r}: killed after-answer"));
        }
        let charges = released_charges(&reply.json);
        let message = reply.json.pointer("/choices/0/message").cloned().unwrap();
        messages.push(message);
        if charges.is_empty() {
            let text = reply
                .json
                .pointer("/choices/0/message/content")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            if r >= CHARGES {
                finished = text == "All charges are done.";
                break;
            }
            stats.suppressed += 1;
            let why = text.lines().last().unwrap_or_default().to_owned();
            notes.push(format!("round {r}: no charge released: {why}"));
            continue;
        }
        for (call_id, charge_id) in charges {
            // The agent executes the charge (this is the count that matters).
            released
                .entry(charge_id.clone())
                .or_default()
                .push(call_id.clone());
            messages.push(json!({"role": "tool", "tool_call_id": call_id,
                "content": json!({"charged": charge_id}).to_string()}));
        }
    }
    Outcome {
        released,
        in_doubt,
        finished,
        notes,
    }
}

#[test]
fn kill_nine_at_random_points_releases_each_charge_exactly_once() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(dir.path());
    let mut tg = Turnguard::new(dir.path(), &mock);
    let mut rng = Lcg(SEED);
    let mut stats = Stats::default();
    let mut violations = Vec::new();
    for t in 0..TRIALS {
        let Outcome {
            released,
            in_doubt,
            finished,
            notes,
        } = trial(t, &mut rng, &mut tg, &mock, &mut stats);
        let variant = Variant::of(t);
        let mut bad = Vec::new();
        let mut unreleased_in_doubt = 0;
        for c in 0..CHARGES {
            let id = format!("t{t}-c{c}");
            let n = released.get(&id).map_or(0, Vec::len);
            let doubtful = in_doubt.contains(&id);
            if doubtful && n == 0 {
                unreleased_in_doubt += 1;
            }
            if n > 1 || (n == 0 && !doubtful) {
                bad.push(format!("{id} released {n}× {:?}", released.get(&id)));
            }
        }
        if !finished {
            bad.push("did not reach the final answer".into());
        }
        // The journal agrees: one effect per charge, each completed.
        tg.ensure_running();
        let db = support::journal(&tg.journal);
        let (effects, completed): (i64, i64) = db
            .query_row(
                "SELECT count(*), coalesce(sum(CASE WHEN state = 'completed' THEN 1 ELSE 0 END), 0) FROM effects WHERE run_id = ?1",
                [format!("crash-t{t}")],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        if effects != CHARGES as i64 || completed != (CHARGES - unreleased_in_doubt) as i64 {
            bad.push(format!(
                "journal: {effects} effects, {completed} completed (want {CHARGES}, {} \
                 completed)",
                CHARGES - unreleased_in_doubt
            ));
        }
        if !bad.is_empty() {
            violations.push(format!("trial {t} ({variant:?}): {bad:?}; {notes:?}"));
        }
    }
    let elapsed = started.elapsed();
    eprintln!(
        "crash test: {TRIALS} trials in {elapsed:?}, {} turnguard starts; {stats:#?}",
        tg.starts
    );
    assert!(
        violations.is_empty(),
        "{} of {TRIALS} trials broke exactly-once:\n{}\nstats: {stats:#?}\nturnguard log tail:\n{}",
        violations.len(),
        violations.join("\n"),
        tg.log_tail()
    );
    // The schedule really exercised kills at the interesting points.
    let fired: u64 = stats.kills_fired.values().sum();
    assert!(fired >= TRIALS / 2, "too few kills landed: {stats:#?}");
    for label in [
        "claim-committed",
        "served-committed",
        "result-committed",
        "timed",
    ] {
        assert!(
            stats.kills_fired.get(label).copied().unwrap_or(0) > 0,
            "no kill landed at {label}: {stats:#?}"
        );
    }
}

/// Two executors of the same effect at once — the original node and an orphan sweeper's
/// re-run (same run, attempts 1 and 2), or two runs — whose model answers carry the same
/// `chargeId` under different call ids: exactly one claim, one call released, the other a
/// suppressed repeat.
#[test]
fn concurrent_executors_of_one_effect_claim_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(dir.path());
    let tg = Turnguard::new(dir.path(), &mock);
    let tg = Arc::new(tg);
    for p in 0..PAIRS {
        let charge_id = format!("dup-{p}");
        mock.answers(
            &[
                charge_answer(&format!("call_dup_{p}_a"), &charge_id, 5),
                charge_answer(&format!("call_dup_{p}_b"), &charge_id, 5),
            ],
            150,
        );
        let barrier = Arc::new(Barrier::new(2));
        let agents: Vec<_> = (0..2u32)
            .map(|i| {
                let (tg, barrier) = (Arc::clone(&tg), Arc::clone(&barrier));
                // Even pairs: one run, attempts 1 and 2. Odd pairs: two runs.
                let (run, attempt) = if p % 2 == 0 {
                    (format!("dup-run-{p}"), i + 1)
                } else {
                    (format!("dup-run-{p}-{i}"), 1)
                };
                std::thread::spawn(move || {
                    let messages = vec![json!({"role": "user", "content": "Charge 5."})];
                    barrier.wait();
                    let s = send(&tg, &run, attempt, &messages).expect("turnguard answers");
                    (run, s)
                })
            })
            .collect();
        let results: Vec<(String, Sent)> = agents.into_iter().map(|a| a.join().unwrap()).collect();
        let mut released = 0;
        let mut suppressed = 0;
        for (run, s) in &results {
            assert_eq!(s.status, 200, "{run}: {}", s.text);
            let charges = released_charges(&s.json);
            if charges.is_empty() {
                let text = s
                    .json
                    .pointer("/choices/0/message/content")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                assert!(
                    text.contains("suppressed-repeat"),
                    "{run}: the withheld call is a suppressed repeat: {text}"
                );
                suppressed += 1;
            } else {
                assert_eq!(charges.len(), 1);
                assert_eq!(charges[0].1, charge_id);
                released += 1;
            }
        }
        assert_eq!(
            (released, suppressed),
            (1, 1),
            "pair {p}: one released, one suppressed: {:?}",
            results
                .iter()
                .map(|(r, s)| (r, &s.text))
                .collect::<Vec<_>>()
        );
        let db = support::journal(&tg.journal);
        let claims: i64 = db
            .query_row(
                "SELECT count(*) FROM effects WHERE run_id LIKE ?1",
                [format!("dup-run-{p}%")],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(claims, 1, "pair {p}: exactly one claim");
        let outcomes: Vec<String> = {
            let mut st = db
                .prepare("SELECT c.outcome FROM tool_calls c JOIN rounds r ON r.request_id = c.request_id WHERE r.run_id LIKE ?1 ORDER BY c.outcome")
                .unwrap();
            st.query_map([format!("dup-run-{p}%")], |r| r.get(0))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        };
        assert_eq!(
            outcomes,
            ["executed", "suppressed-repeat"],
            "pair {p}: the journal records one executed call and one suppressed repeat"
        );
    }
}
