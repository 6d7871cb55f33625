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

use serde_json::{json, Value};

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

/// `turnguard serve` in `dir` with `args` and only the environment given (nothing inherited,
/// so a `TURNGUARD_*` of the machine running the tests cannot leak in).
fn serve_cmd(dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_turnguard"));
    cmd.arg("serve")
        .args(args)
        .current_dir(dir)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    cmd
}

/// Runs a `serve` that must refuse its configuration; returns its stderr.
fn refused(dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = serve_cmd(dir, args, env)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "turnguard started on a bad configuration: {stderr}"
    );
    stderr
}

/// Each setting comes from the highest layer that sets it: flag over `TURNGUARD_*` over the
/// `--config` file over the default, as `/config` shows it.
#[test]
fn serve_layers_flags_over_env_over_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("turnguard.toml");
    std::fs::write(
        &file,
        r#"
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
log_format = "json"
tenant = "from-file"
max_body_bytes = 111
max_connections = 5
journal_retention_days = 20
[upstream]
openai = "http://127.0.0.1:9/file"
local = "http://127.0.0.1:9/file-local"
[mcp]
files = "http://127.0.0.1:9/mcp"
"#,
    )
    .unwrap();
    let mut child = serve_cmd(
        dir.path(),
        &[
            "--max-body-bytes",
            "333",
            "--upstream",
            "openai=http://127.0.0.1:9/flag",
        ],
        &[
            ("TURNGUARD_CONFIG", file.to_str().unwrap()),
            ("TURNGUARD_TENANT", "from-env"),
            ("TURNGUARD_MAX_BODY_BYTES", "222"),
            ("TURNGUARD_JOURNAL_RETENTION_DAYS", "21"),
            (
                "TURNGUARD_UPSTREAM",
                "openai=http://127.0.0.1:9/env,other=http://127.0.0.1:9/env-other",
            ),
            ("TURNGUARD_MCP_TICKET", "files=optional"),
            ("TURNGUARD_WORKER_THREADS", "3"),
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("the binary runs");
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
    let (admin, workers, listening) = loop {
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(line) => {
                let v: Option<Value> = serde_json::from_str(&line).ok();
                let admin = v.as_ref().and_then(|v| {
                    (v.get("message")?.as_str()? == "turnguard listening")
                        .then(|| v.get("admin")?.as_str().map(str::to_owned))?
                });
                if let Some(admin) = admin {
                    let workers = v.as_ref().and_then(|v| v.get("workers")).cloned();
                    break (admin, workers, line);
                }
                log.push(line);
            }
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "turnguard did not report listening (the file's log_format is json); its log:\n{}",
                    log.join("\n")
                );
            }
        }
    };
    let got = http_get(&admin, "/config");
    let _ = child.kill();
    let _ = child.wait();
    let (status, body) = got.expect("/config answers");
    assert_eq!(status, 200, "{body}");
    // The runtime's own count of its workers: the variable sized the runtime.
    assert_eq!(workers, Some(json!(3)), "{listening}");
    let doc: Value = serde_json::from_str(&body).unwrap();
    let c = doc.get("config").expect("the resolved config");
    let at = |p: &str| c.pointer(p).cloned().unwrap_or(Value::Null);
    assert_eq!(at("/max_body_bytes"), 333, "flag over env over file");
    assert_eq!(at("/tenant"), "from-env", "env over file");
    assert_eq!(at("/journal_retention_days"), 21, "env over file");
    assert_eq!(at("/max_connections"), 5, "file over default");
    assert_eq!(at("/worker_threads"), 3, "env over the default");
    assert_eq!(at("/max_event_bytes"), 4 << 20, "the default");
    assert_eq!(
        at("/upstreams/openai/prefix"),
        "/flag",
        "flag over env over file, by name"
    );
    assert_eq!(
        at("/upstreams/other/prefix"),
        "/env-other",
        "env adds a name"
    );
    assert_eq!(
        at("/upstreams/local/prefix"),
        "/file-local",
        "the file's name stays"
    );
    assert_eq!(
        at("/upstreams/anthropic/authority"),
        "api.anthropic.com",
        "a default name stays"
    );
    assert_eq!(
        at("/mcp/files/ticket"),
        "optional",
        "env ticket on the file's server"
    );
}

/// A bad value is refused at start with the setting, the place it came from (flag,
/// variable, file and key) and what was wrong.
#[test]
fn serve_errors_name_the_setting_and_its_source() {
    let dir = tempfile::tempdir().unwrap();
    let e = refused(dir.path(), &[], &[("TURNGUARD_SHED_RETRY_AFTER_S", "soon")]);
    assert!(
        e.contains("TURNGUARD_SHED_RETRY_AFTER_S: `soon` is not a number of seconds"),
        "{e}"
    );
    let e = refused(dir.path(), &[], &[("TURNGUARD_MAX_CONNECTIONS", "0")]);
    assert!(
        e.contains("TURNGUARD_MAX_CONNECTIONS: must be greater than 0"),
        "{e}"
    );
    let e = refused(dir.path(), &["--max-concurrent-requests", "0"], &[]);
    assert!(
        e.contains("--max-concurrent-requests: must be greater than 0"),
        "{e}"
    );
    let file = dir.path().join("t.toml");
    std::fs::write(&file, "journal_retention_days = 7\n").unwrap();
    let e = refused(dir.path(), &["--config", file.to_str().unwrap()], &[]);
    assert!(
        e.contains("t.toml: at `journal_retention_days`: records are kept at least 14 days"),
        "{e}"
    );
    std::fs::write(&file, "[upstream]\nopenai = \"ftp://u:s3cret@h\"\n").unwrap();
    let e = refused(
        dir.path(),
        &[],
        &[("TURNGUARD_CONFIG", file.to_str().unwrap())],
    );
    assert!(e.contains("t.toml: at `upstream.openai`: "), "{e}");
    assert!(e.contains("http or https") && !e.contains("s3cret"), "{e}");
    std::fs::write(&file, "listne = \"127.0.0.1:1\"\n").unwrap();
    let e = refused(dir.path(), &["--config", file.to_str().unwrap()], &[]);
    assert!(e.contains("t.toml: at `listne`: unknown key"), "{e}");
}

/// `serve --help` names every setting's variable (clap `env`) and never shows a value the
/// environment holds (an upstream URL may carry credentials).
#[test]
fn serve_help_names_each_variable_and_hides_values() {
    let dir = tempfile::tempdir().unwrap();
    let out = serve_cmd(
        dir.path(),
        &["--help"],
        &[(
            "TURNGUARD_UPSTREAM",
            "openai=https://u:s3cret@proxy.example",
        )],
    )
    .output()
    .expect("the binary runs");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for var in [
        "TURNGUARD_CONFIG",
        "TURNGUARD_LISTEN",
        "TURNGUARD_UPSTREAM",
        "TURNGUARD_SHED_RETRY_AFTER_S",
        "TURNGUARD_MCP_TICKET",
        "TURNGUARD_APPROVAL_WEBHOOK_SECRET_FILE",
    ] {
        assert!(
            help.contains(&format!("[env: {var}]")),
            "{var} missing:\n{help}"
        );
    }
    let flags = help.matches("\n      --").count();
    let vars = help.matches("[env: TURNGUARD_").count();
    assert_eq!(flags, vars, "every flag has its variable:\n{help}");
    assert!(!help.contains("s3cret"), "{help}");
}
