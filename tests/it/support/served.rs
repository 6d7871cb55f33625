//! `turnguard serve` as a child process, for the tests that read its log lines (what it logs
//! is checked for secrets).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_turnguard");

/// A `turnguard serve` child process (JSON logs at debug level) with its stderr collected.
pub struct Served {
    child: std::process::Child,
    /// The data plane's address (`host:port`).
    pub data: String,
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Served {
    /// Starts `turnguard serve` on `journal` and `policy`, both upstreams at `mock`, with
    /// `extra` arguments; returns once it logged that it listens.
    pub fn start(journal: &Path, policy: &Path, mock: &str, extra: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--log-format",
                "json",
            ])
            .arg("--journal")
            .arg(super::journal_arg(journal))
            .arg("--policy")
            .arg(policy)
            .arg("--upstream")
            .arg(format!("openai={mock}"))
            .arg("--upstream")
            .arg(format!("anthropic={mock}"))
            .args(extra)
            .env("TURNGUARD_LOG", "debug")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("turnguard serve starts");
        let stderr = child.stderr.take().unwrap();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let sink = std::sync::Arc::clone(&log);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let data = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).unwrap_or_else(|_| {
                panic!(
                    "turnguard did not report listening: {:?}",
                    log.lock().unwrap()
                )
            });
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if v["message"] == "turnguard listening" {
                    break v["data"].as_str().unwrap().to_owned();
                }
            }
        };
        Self {
            child,
            data,
            log,
            reader: Some(reader),
        }
    }

    /// The data plane's Chat Completions URL.
    pub fn chat_url(&self) -> String {
        format!("http://{}/v1/chat/completions", self.data)
    }

    /// SIGTERM, wait, and return every log line.
    pub fn stop(mut self) -> Vec<String> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("turnguard did not stop on SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let lines = self.log.lock().unwrap().clone();
        lines
    }
}
