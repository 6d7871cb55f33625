//! Attacks from an admin-plane client (a local process without the admin token): no
//! credential is shown (`/config`, logs, errors); no run data leaves without the admin token
//! or a verified bearer; malformed input does not take the plane down. Found by a probe of
//! this leg: the approval webhook URL's password was shown on `/config` and in the start-up
//! error; both now show `***`. The two tests of it failed before that fix.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use turnguard::mock_provider::Script;

use crate::support;
use support::ADMIN_TOKEN;

/// Sends raw bytes to `addr` and returns what came back (until close or 5 s).
async fn raw(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// `GET /config` (open, no token) serialised `approval_webhook` verbatim: the password in the
/// webhook URL's userinfo was shown in clear, while the upstream URLs' userinfo and the
/// Postgres password were replaced by `***`. Rule: no credential is shown on `/config`.
#[tokio::test(flavor = "multi_thread")]
async fn config_does_not_show_the_webhook_urls_password() {
    const PASSWORD: &str = "hook-password-s3cr3t";
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("webhook.key");
    std::fs::write(&key_file, "0123456789abcdef0123456789abcdef-webhook-key\n").unwrap();
    let h = support::start_with(Script::default(), move |c| {
        c.approval_webhook = Some(format!(
            "https://hookuser:{PASSWORD}@hooks.example.test/hook"
        ));
        c.approval_webhook_secret_file = Some(key_file);
    })
    .await;
    // No Authorization header: /config is open by design.
    let (status, _, body) =
        support::call("GET", &format!("{}/config", h.admin_url()), &[], None).await;
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{text}");
    assert!(
        !text.contains(PASSWORD),
        "GET /config (no token) shows the webhook URL's password: {text}"
    );
}

/// Run data without the admin token: no header, a wrong token, another scheme, the token
/// in a query string, a near-miss prefix of the token — all 401, none shows events.
#[tokio::test(flavor = "multi_thread")]
async fn run_data_needs_the_admin_token_exactly() {
    let h = support::start(Script::default()).await;
    let url = format!("{}/runs/run-x/events", h.admin_url());
    let prefix = &ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1];
    let cases: Vec<(String, Vec<(&str, String)>)> = vec![
        (url.clone(), vec![]),
        (url.clone(), vec![("authorization", "Bearer wrong".into())]),
        (
            url.clone(),
            vec![("authorization", format!("Basic {ADMIN_TOKEN}"))],
        ),
        (
            url.clone(),
            vec![("authorization", format!("Bearer {prefix}"))],
        ),
        (
            url.clone(),
            vec![("authorization", format!("Bearer {ADMIN_TOKEN}x"))],
        ),
        (url.clone(), vec![("authorization", "Bearer ".into())]),
        (format!("{url}?access_token={ADMIN_TOKEN}"), vec![]),
        (
            format!("{}/runs/run-x/effects", h.admin_url()),
            vec![("turnguard-principal", "alice".into())],
        ),
    ];
    for (u, hdrs) in cases {
        let (status, _, body) = support::call("GET", &u, &hdrs, None).await;
        assert_eq!(
            status,
            401,
            "{u} {hdrs:?}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    let (status, body) = h.admin_get("/runs/run-x/events").await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

/// Malformed requests to the admin plane (bad percent-encoding, NUL and huge path segments,
/// a huge header, a garbage request line, a truncated body) leave it answering.
#[tokio::test(flavor = "multi_thread")]
async fn malformed_admin_requests_do_not_take_the_plane_down() {
    let h = support::start(Script::default()).await;
    let addr = h.tg.admin_addr;
    let long = "a".repeat(200_000);
    let auth = format!("Authorization: Bearer {ADMIN_TOKEN}\r\n");
    let reqs: Vec<Vec<u8>> = vec![
        format!("GET /runs/%FF%FE/events HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n").into_bytes(),
        format!("GET /runs/%00/effects HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n").into_bytes(),
        format!("GET /runs/{long}/events HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n").into_bytes(),
        b"GET /tools/%ZZ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
        format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {long}\r\nConnection: close\r\n\r\n").into_bytes(),
        b"\x00\x01\x02 garbage\r\n\r\n".to_vec(),
        b"POST /approvals/abc HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\nConnection: close\r\n\r\n{".to_vec(),
        b"GET /approvals/events?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
    ];
    for r in &reqs {
        let _ = raw(addr, r).await;
    }
    let (status, _, body) =
        support::call("GET", &format!("{}/healthz", h.admin_url()), &[], None).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

/// `turnguard serve` refusing a plain-http, non-loopback `approval_webhook` printed the URL
/// verbatim in its start-up error, the userinfo password with it. Rule: no credential is
/// shown in logs or errors (the upstream and Postgres URLs are redacted in the same place).
#[test]
fn the_webhook_urls_password_is_not_in_the_start_up_error() {
    const PASSWORD: &str = "hook-password-s3cr3t";
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("webhook.key");
    std::fs::write(&key, "0123456789abcdef0123456789abcdef-webhook-key\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_turnguard"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .arg("--journal")
        .arg(dir.path().join("journal.db"))
        .arg("--policy")
        .arg(support::own_fixtures().join("policy-open"))
        .arg("--approval-webhook")
        .arg(format!(
            "http://hookuser:{PASSWORD}@hooks.example.test/hook"
        ))
        .arg("--approval-webhook-secret-file")
        .arg(&key)
        .env("RUST_BACKTRACE", "0")
        .env("RUST_LIB_BACKTRACE", "0")
        .current_dir(dir.path())
        .output()
        .expect("the binary runs");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "it started: {all}");
    assert!(
        all.contains("approval_webhook"),
        "the refusal names the setting: {all}"
    );
    assert!(
        !all.contains(PASSWORD),
        "the start-up error shows the webhook URL's password: {all}"
    );
}
