//! `turnguard serve` with no arguments at all: starts on the embedded defaults, answers
//! `/healthz`, refuses an unknown path with 404 and the OpenWOP error body, and shuts down
//! cleanly on SIGTERM.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}

#[test]
fn serve_starts_with_no_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_turnguard"))
        .arg("serve")
        .current_dir(dir.path())
        .env_remove("TURNGUARD_LISTEN")
        .env_remove("TURNGUARD_ADMIN_LISTEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    // Wait until *this* process says it listens (another turnguard on the default ports must
    // not answer in its place): its log line names both bound addresses.
    let stderr = child.stderr.take().expect("stderr is piped");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let mut log = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(line) if line.contains("turnguard listening") => {
                assert!(
                    line.contains("127.0.0.1:8787") && line.contains("127.0.0.1:8788"),
                    "{line}"
                );
                break;
            }
            Ok(line) => log.push(line),
            Err(_) => {
                let status = child.try_wait().ok().flatten();
                panic!("turnguard did not report listening on the default ports (exit: {status:?}); its log:\n{}", log.join("\n"));
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let health = loop {
        if let Some(r) = http_get("127.0.0.1:8788", "/healthz") {
            break r;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("turnguard exited early with {status}");
        }
        assert!(
            Instant::now() < deadline,
            "no /healthz on 127.0.0.1:8788 within 20 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(health.0, 200);
    assert!(health.1.contains("\"ok\""));

    let (status, body) =
        http_get("127.0.0.1:8787", "/not/a/provider/path").expect("data plane answers");
    assert_eq!(status, 404);
    let err: Value = serde_json::from_str(&body).expect("OpenWOP error body is JSON");
    assert_eq!(err["error"], "not_found");
    assert!(err["message"]
        .as_str()
        .unwrap()
        .contains("/not/a/provider/path"));
    assert!(
        dir.path().join("turnguard.db").exists(),
        "the journal defaults to ./turnguard.db"
    );

    let term = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(term.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "SIGTERM did not stop turnguard within 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "graceful shutdown exits 0, got {status}");
}
