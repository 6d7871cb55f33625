//! Issue 16, the person in the loop, over real sockets: the approval page signed in through
//! a scripted OpenID Connect provider (discovery, authorize with a trivial form, a token
//! endpoint that checks the PKCE verifier, Ed25519-signed ID tokens), driven in headless
//! Chromium by Playwright (`tests/ui/approval_page.py`) with the official openai SDK as the
//! waiting agent; the webhook (signature, retry, never on the agent's path); the SSE stream;
//! edit before approve; held calls refused at once when no approval could release them; and
//! the `turnguard approvals` CLI.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Form, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine;
use bytes::Bytes;
use http_body_util::BodyExt;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use turnguard::mock_provider::Script;

use crate::support::approvals::{
    agent, agent_token, bearer, json_of, metric, pending, resolve_body, token, wait_pending, AUD,
    SECRET,
};
use crate::support::{self, own_fixtures, Harness};

const CLIENT_ID: &str = "turnguard-approvals";
const CLIENT_SECRET: &str = "test-only client secret of the approval page";
const WEBHOOK_KEY: &str = "test-only webhook key, thirty-two bytes or more";

// ---- a scripted OpenID Connect provider -----------------------------------------------------

/// What the scripted provider saw.
#[derive(Default)]
struct IdpLog {
    /// Codes issued → (sub, nonce, PKCE challenge, redirect_uri).
    codes: HashMap<String, (String, String, String, String)>,
    /// Token requests whose PKCE verifier matched the challenge / did not.
    pkce_ok: u32,
    pkce_bad: u32,
    /// Token requests without the client's secret.
    unauthenticated: u32,
}

struct Idp {
    addr: std::net::SocketAddr,
    log: Arc<Mutex<IdpLog>>,
    task: tokio::task::JoinHandle<()>,
}

impl Idp {
    fn issuer(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Idp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct IdpState {
    issuer: String,
    log: Arc<Mutex<IdpLog>>,
}

/// Starts the scripted provider on a loopback port; its URL is its issuer (the harness sets
/// `identity_issuer` to it).
async fn start_idp() -> Idp {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Arc::new(Mutex::new(IdpLog::default()));
    let state = IdpState {
        issuer: format!("http://{addr}"),
        log: Arc::clone(&log),
    };
    let app = Router::new()
        .route("/.well-known/openid-configuration", get(discovery))
        .route("/authorize", get(authorize_form).post(authorize))
        .route("/token", post(token_endpoint))
        .with_state(state);
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Idp { addr, log, task }
}

async fn discovery(State(s): State<IdpState>) -> Response {
    axum::Json(json!({
        "issuer": s.issuer,
        "authorization_endpoint": format!("{}/authorize", s.issuer),
        "token_endpoint": format!("{}/token", s.issuer),
        "jwks_uri": format!("{}/jwks", s.issuer),
        "response_types_supported": ["code"],
        "subject_types_supported": ["public"],
        "id_token_signing_alg_values_supported": ["EdDSA"],
        "code_challenge_methods_supported": ["S256"],
    }))
    .into_response()
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;")
}

/// The trivial sign-in form: a user name, no password.
async fn authorize_form(Query(q): Query<HashMap<String, String>>) -> Response {
    let ok = q.get("response_type").map(String::as_str) == Some("code")
        && q.get("client_id").map(String::as_str) == Some(CLIENT_ID)
        && q.get("code_challenge_method").map(String::as_str) == Some("S256")
        && q.get("scope")
            .is_some_and(|s| s.split(' ').any(|x| x == "openid"))
        && q.contains_key("code_challenge")
        && q.contains_key("nonce")
        && q.contains_key("state");
    if !ok {
        return (
            http::StatusCode::BAD_REQUEST,
            format!("bad authorization request: {q:?}"),
        )
            .into_response();
    }
    let hidden: String = ["state", "nonce", "code_challenge", "redirect_uri"]
        .iter()
        .map(|k| format!("<input type=hidden name={k} value=\"{}\">", esc(&q[*k])))
        .collect();
    axum::response::Html(format!(
        "<!doctype html><title>Test IdP</title><form method=post action=/authorize>{hidden}\
         <label>User <input id=user name=user></label><button id=login>Sign in</button></form>"
    ))
    .into_response()
}

async fn authorize(State(s): State<IdpState>, Form(f): Form<HashMap<String, String>>) -> Response {
    let code = uuid::Uuid::new_v4().to_string();
    s.log.lock().unwrap().codes.insert(
        code.clone(),
        (
            f["user"].clone(),
            f["nonce"].clone(),
            f["code_challenge"].clone(),
            f["redirect_uri"].clone(),
        ),
    );
    let to = format!(
        "{}?code={code}&state={}",
        f["redirect_uri"],
        url_escape(&f["state"])
    );
    (http::StatusCode::SEE_OTHER, [(http::header::LOCATION, to)]).into_response()
}

fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Signs an ID token with the test Ed25519 key (`tests/fixtures/identity`, kid
/// `test-ed25519`, in `jwks.json`).
fn id_token(issuer: &str, sub: &str, nonce: &str) -> String {
    let pem = std::fs::read(own_fixtures().join("identity/ed25519-private.pem")).unwrap();
    let mut header = Header::new(Algorithm::EdDSA);
    header.kid = Some("test-ed25519".into());
    encode(
        &header,
        &json!({"iss": issuer, "sub": sub, "aud": CLIENT_ID, "nonce": nonce,
                "exp": turnguard::proxy::now_ms() / 1000 + 600, "iat": turnguard::proxy::now_ms() / 1000}),
        &EncodingKey::from_ed_pem(&pem).unwrap(),
    )
    .unwrap()
}

async fn token_endpoint(
    State(s): State<IdpState>,
    headers: http::HeaderMap,
    Form(f): Form<HashMap<String, String>>,
) -> Response {
    // RFC 6749 §2.3.1: the id and secret are form-urlencoded, then joined and base64'd.
    let client = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|pair| {
            let (id, secret) = pair.split_once(':')?;
            let dec = |s: &str| -> String {
                form_urlencoded::parse(format!("x={s}").as_bytes())
                    .next()
                    .map(|(_, v)| v.into_owned())
                    .unwrap_or_default()
            };
            Some((dec(id), dec(secret)))
        });
    let mut log = s.log.lock().unwrap();
    if client != Some((CLIENT_ID.to_owned(), CLIENT_SECRET.to_owned())) {
        log.unauthenticated += 1;
        return (
            http::StatusCode::UNAUTHORIZED,
            axum::Json(json!({"error": "invalid_client"})),
        )
            .into_response();
    }
    let Some((sub, nonce, challenge, redirect)) = f.get("code").and_then(|c| log.codes.remove(c))
    else {
        return (
            http::StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": "invalid_grant"})),
        )
            .into_response();
    };
    let verifier = f.get("code_verifier").cloned().unwrap_or_default();
    let computed = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(Sha256::digest(verifier.as_bytes()));
    if computed != challenge
        || f.get("redirect_uri") != Some(&redirect)
        || f.get("grant_type").map(String::as_str) != Some("authorization_code")
    {
        log.pkce_bad += 1;
        return (
            http::StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": "invalid_grant", "error_description": "PKCE verifier or redirect_uri mismatch"})),
        )
            .into_response();
    }
    log.pkce_ok += 1;
    axum::Json(json!({
        "access_token": "opaque-access-token", "token_type": "Bearer", "expires_in": 600,
        "id_token": id_token(&s.issuer, &sub, &nonce),
    }))
    .into_response()
}

// ---- turnguard with the page on ------------------------------------------------------------

/// A free loopback port (the redirect URI names the admin plane's address before it starts).
/// The harness with the `policy-ui` bundle, the approval page signing in at `idp`, approver
/// tokens as in `support::approvals` (HS256) and ID tokens (EdDSA, the test JWKS), and
/// `tweak` on top.
async fn start_ui(
    idp: &Idp,
    timeout_ms: u64,
    tweak: impl FnOnce(&mut turnguard::config::Config),
) -> (Harness, tempfile::TempDir) {
    let keys = tempfile::tempdir().unwrap();
    let hs = keys.path().join("hs256.secret");
    std::fs::write(&hs, SECRET).unwrap();
    let client_secret = keys.path().join("client.secret");
    std::fs::write(&client_secret, CLIENT_SECRET).unwrap();
    let port = crate::support::free_port();
    let issuer = idp.issuer();
    let h = support::start_with(Script::default(), move |c| {
        c.policy = own_fixtures().join("policy-ui");
        c.admin_listen = format!("127.0.0.1:{port}").parse().unwrap();
        c.identity_issuer = Some(issuer);
        c.identity_audience = Some(AUD.into());
        c.identity_hs256_secret_file = Some(hs);
        c.identity_jwks = Some(own_fixtures().join("identity/jwks.json"));
        c.approval_timeout_ms = timeout_ms;
        c.approval_keepalive_ms = 200;
        c.shutdown_grace_ms = 500;
        c.approval_ui = true;
        c.approval_ui_client_id = Some(CLIENT_ID.into());
        c.approval_ui_client_secret_file = Some(client_secret);
        c.approval_ui_redirect_uri = Some(format!("http://127.0.0.1:{port}/ui/callback"));
        tweak(c);
    })
    .await;
    (h, keys)
}

/// The approver and data-plane tokens of the harness name `ISS`; with the page on, the
/// issuer is the scripted provider's URL: tokens for `sub` under that issuer.
fn token_at(idp: &Idp, sub: &str, extra: Value) -> String {
    let mut claims = support::approvals::claims(sub, extra);
    claims["iss"] = json!(idp.issuer());
    encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(SECRET),
    )
    .unwrap()
}

/// The agent's headers: the person's data-plane token (the agent's own copy) and the run.
fn as_person_at(idp: &Idp, sub: &str, run: &str) -> Vec<(&'static str, String)> {
    vec![
        (
            "turnguard-principal-token",
            token_at(idp, sub, json!({"jti": format!("agent-side-{sub}")})),
        ),
        ("turnguard-run", run.to_owned()),
    ]
}

/// A chat request after the agent read an email (untrusted input), declaring the tools.
fn after_email() -> Value {
    let f = |name: &str| json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}});
    json!({"model": "gpt-4o-mini", "messages": [
        {"role": "user", "content": "Read my latest email and answer it."},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_read", "type": "function", "function": {"name": "read_email", "arguments": "{\"id\":\"m1\"}"}}]},
        {"role": "tool", "tool_call_id": "call_read", "content": support::approvals::INJECTION}
    ], "tools": [f("read_email"), f("send_email"), f("post_message")]})
}

fn reply(name: &str, args: Value) -> Value {
    json!({"reply": {"text": "", "tool_calls": [{"name": name, "arguments": args}]}})
}

fn mail(to: &str, body: &str) -> Value {
    json!({"to": to, "subject": "Re: invoice", "body": body})
}

/// `(name, arguments)` of the calls in a Chat Completions response.
fn calls_of(resp: &Value) -> Vec<(String, Value)> {
    support::approvals::released_calls(resp)
}

fn text_of(resp: &Value) -> String {
    resp["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// One GET/POST on the admin plane with a `Cookie`; returns status, headers, body text.
async fn page_call(
    method: &str,
    url: &str,
    cookie: Option<&str>,
    form: Option<&str>,
    extra: &[(&str, &str)],
) -> (u16, http::HeaderMap, String) {
    let mut req = http::Request::builder().method(method).uri(url);
    if let Some(c) = cookie {
        req = req.header("cookie", c);
    }
    if form.is_some() {
        req = req.header("content-type", "application/x-www-form-urlencoded");
    }
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<Bytes>>();
    let resp = client
        .request(
            req.body(http_body_util::Full::new(Bytes::from(
                form.unwrap_or_default().to_owned(),
            )))
            .unwrap(),
        )
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

fn set_cookie_of<'a>(h: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    h.get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|c| c.starts_with(&format!("{name}=")))
}

fn query_param(url: &str, key: &str) -> Option<String> {
    let q = url.split_once('?')?.1;
    form_urlencoded::parse(q.as_bytes())
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

/// Signs `user` in with a plain HTTP client, checking each leg; returns the session cookie
/// (`name=value`).
async fn sign_in_http(h: &Harness, idp: &Idp, user: &str) -> String {
    let (status, headers, _) = page_call(
        "GET",
        &format!("{}/ui/login", h.admin_url()),
        None,
        None,
        &[],
    )
    .await;
    assert_eq!(status, 303);
    let to = headers["location"].to_str().unwrap().to_owned();
    assert!(
        to.starts_with(&format!("{}/authorize?", idp.issuer())),
        "{to}"
    );
    assert_eq!(
        query_param(&to, "code_challenge_method").as_deref(),
        Some("S256")
    );
    assert_eq!(query_param(&to, "response_type").as_deref(), Some("code"));
    let login = set_cookie_of(&headers, "turnguard_login")
        .expect("login cookie")
        .to_owned();
    assert!(
        login.contains("HttpOnly") && login.contains("SameSite=Lax"),
        "{login}"
    );
    let login = login.split(';').next().unwrap().to_owned();
    // The provider's form, submitted.
    let form: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("user", user)
        .append_pair("state", &query_param(&to, "state").unwrap())
        .append_pair("nonce", &query_param(&to, "nonce").unwrap())
        .append_pair(
            "code_challenge",
            &query_param(&to, "code_challenge").unwrap(),
        )
        .append_pair("redirect_uri", &query_param(&to, "redirect_uri").unwrap())
        .finish();
    let (status, headers, _) = page_call(
        "POST",
        &format!("{}/authorize", idp.issuer()),
        None,
        Some(&form),
        &[],
    )
    .await;
    assert_eq!(status, 303);
    let callback = headers["location"].to_str().unwrap().to_owned();
    // Back at turnguard's callback with this browser's login cookie: signed in.
    let (status, headers, body) = page_call("GET", &callback, Some(&login), None, &[]).await;
    assert_eq!(status, 200, "{body}");
    let session = set_cookie_of(&headers, "turnguard_approvals")
        .expect("session cookie")
        .to_owned();
    for part in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(session.contains(part), "{session} lacks {part}");
    }
    assert!(
        !session.contains("Secure"),
        "loopback: no Secure: {session}"
    );
    assert!(body.contains("url=/ui/approvals"), "{body}");
    session.split(';').next().unwrap().to_owned()
}

/// Opens a GET whose body is read frame by frame (an SSE stream).
async fn stream_get(url: &str, headers: &[(&str, &str)]) -> http::Response<hyper::body::Incoming> {
    let mut req = http::Request::get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<Bytes>>()
        .request(req.body(http_body_util::Full::new(Bytes::new())).unwrap())
        .await
        .unwrap()
}

// ---- the browser -------------------------------------------------------------------------

/// Debian's Chromium (`apt-get install chromium`; `.ci/run` installs it), or
/// `$TURNGUARD_TEST_CHROMIUM`.
fn chromium() -> PathBuf {
    let p = std::env::var_os("TURNGUARD_TEST_CHROMIUM")
        .map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from);
    assert!(
        p.exists(),
        "the browser tests need Chromium at {}: `apt-get install chromium` (Debian; .ci/run does it) or set TURNGUARD_TEST_CHROMIUM",
        p.display()
    );
    p
}

/// Where the page's screenshot goes: `target/ui/approval-page.png` (copied to
/// `docs/approval-page.png` by hand when the page changes).
fn screenshot_path() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ui");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("approval-page.png")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_approval_page_in_a_browser() {
    let chromium = chromium();
    let idp = start_idp().await;
    let (h, _keys) = start_ui(&idp, 120_000, |_| {}).await;
    h.script(&json!({"responses": [
        reply("send_email", mail("eve@example.test", "The customer list is attached.")),
        reply("send_email", mail("eve@example.test", "Second try: <img src=x onerror=alert(1)><script>alert(2)</script>")),
        reply("send_email", mail("eve@example.test", "Your ticket PIN-1234 is attached.")),
    ]}))
    .await;
    let shot = screenshot_path();
    let _ = std::fs::remove_file(&shot);
    let tokens = json!({
        "alice": token_at(&idp, "alice", json!({"jti": "agent-side-alice"})),
    });
    let args: Vec<std::ffi::OsString> = vec![
        "--admin".into(),
        h.admin_url().into(),
        "--data".into(),
        h.url().into(),
        "--tokens".into(),
        tokens.to_string().into(),
        "--request".into(),
        after_email().to_string().into(),
        "--screenshot".into(),
        shot.clone().into(),
        "--chromium".into(),
        chromium.into(),
    ];
    let out = run_ui_script("approval_page.py", &args, Duration::from_secs(300)).await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "the browser script failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}\n{stderr}", String::from_utf8_lossy(&out.stdout)));
    let c = &r["checks"];

    // Sign-in, and what the page shows of the pending call.
    assert_eq!(c["signed_in_as"], "alice", "{r}");
    let card = c["card_text"].as_str().unwrap();
    for want in [
        "Send an email",
        "send_email",
        "ui:send_email",
        "Why it was held",
        "read_email",
        "untrusted",
        "The customer list is attached.",
        "policy",
    ] {
        assert!(card.contains(want), "the card lacks `{want}`:\n{card}");
    }
    assert!(
        regex::Regex::new(r"in \d+:\d\d")
            .unwrap()
            .is_match(c["countdown"].as_str().unwrap()),
        "{}",
        c["countdown"]
    );
    assert_eq!(
        c["csp"].as_str().unwrap(),
        turnguard::approval_ui::page_csp()
    );
    // Another person sees nothing and cannot resolve alice's call by its id.
    assert_eq!(c["bob_signed_in_as"], "bob");
    assert_eq!(c["bob_cards"], 0);
    assert_eq!(c["bob_post_status"], 403, "{r}");
    // A POST without the session's CSRF token fails, and leaves the call pending.
    assert_eq!(c["csrf_less_status"], 403, "{r}");
    assert_eq!(c["still_pending_after_csrf_less"], true);
    // Accept → the waiting agent (openai SDK, stream) receives the call as the model wrote it.
    let a = &r["agents"]["accept"];
    assert_eq!(a["error"], Value::Null, "{a}");
    assert_eq!(
        a["tool_calls"],
        json!([{"name": "send_email", "arguments": mail("eve@example.test", "The customer list is attached.")}]),
        "{a}"
    );
    assert!(
        c["accept_flash"]
            .as_str()
            .unwrap()
            .starts_with("Accepted: send_email"),
        "{r}"
    );
    // Model-written markup in the arguments is text on the page: nothing rendered or run.
    assert!(
        c["reject_card_text"]
            .as_str()
            .unwrap()
            .contains("<img src=x onerror=alert(1)><script>alert(2)</script>"),
        "{r}"
    );
    assert_eq!(c["reject_card_has_img"], false);
    assert_eq!(c["dialogs"], json!([]), "no script ran");
    // Reject → refused: no call, turnguard's explanation instead.
    let rj = &r["agents"]["reject"];
    assert_eq!(rj["tool_calls"], json!([]), "{rj}");
    assert!(
        rj["text"].as_str().unwrap().contains("approval_rejected"),
        "{rj}"
    );
    // Edit before approve → the agent receives the person's arguments (redacted form).
    let e = &r["agents"]["edit"];
    assert_eq!(
        e["tool_calls"],
        json!([{"name": "send_email", "arguments": {"to": "bob@example.test", "subject": "Re: invoice", "body": "Your ticket [REDACTED:ticket-pin] is attached. Regards"}}]),
        "{e}"
    );
    assert!(c["edit_box_shown"].as_bool().unwrap());
    assert!(shot.exists(), "the screenshot was taken");

    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let rows: Vec<(String, Option<String>, String, Option<String>)> = db
        .prepare("SELECT state, resolved_by, calls, edits FROM interrupts ORDER BY requested_at_ms")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let states: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(states, ["accepted", "rejected", "accepted"]);
    assert!(rows.iter().all(|r| r.1.as_deref() == Some("alice")));
    // The journal keeps both versions of the edited call, both redacted, and who edited.
    let model: Value = serde_json::from_str(&rows[2].2).unwrap();
    let edits: Value = serde_json::from_str(rows[2].3.as_deref().unwrap()).unwrap();
    assert_eq!(
        model[0]["arguments"]["body"],
        "Your ticket [REDACTED:ticket-pin] is attached."
    );
    assert_eq!(edits[0]["arguments"]["to"], "bob@example.test");
    assert_eq!(edits[0]["editedBy"], "alice");
    assert!(!rows[2].3.as_deref().unwrap().contains("PIN-"), "redacted");
}

/// Runs `tests/ui/<script>` with the SDK interpreter (which has Playwright:
/// `tests/sdk/requirements.txt`).
async fn run_ui_script(
    script: &str,
    args: &[std::ffi::OsString],
    limit: Duration,
) -> std::process::Output {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/ui")
        .join(script);
    let run = tokio::process::Command::new(support::python())
        .arg(&path)
        .args(args)
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{script} did not finish within {} s", limit.as_secs()))
        .unwrap()
}

// ---- sign-in and the page's own rules, without a browser ------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn sign_in_is_pkce_bound_to_the_browser_and_the_page_refuses_what_it_must() {
    let idp = start_idp().await;
    let (h, _keys) = start_ui(&idp, 30_000, |_| {}).await;
    let admin = h.admin_url();

    // Signed out: a sign-in link, the strict headers.
    let (status, headers, body) =
        page_call("GET", &format!("{admin}/ui/approvals"), None, None, &[]).await;
    assert_eq!(status, 200);
    assert!(body.contains("/ui/login"), "{body}");
    assert_eq!(
        headers["content-security-policy"],
        turnguard::approval_ui::page_csp()
    );
    assert_eq!(headers["x-frame-options"], "DENY");
    assert!(body.contains("name=\"viewport\""), "usable on a phone");
    // No query string on the page, ever.
    let (status, _, _) = page_call(
        "GET",
        &format!("{admin}/ui/approvals?interrupt=int_x&action=accept"),
        None,
        None,
        &[],
    )
    .await;
    assert_eq!(status, 400);

    let cookie = sign_in_http(&h, &idp, "alice").await;
    {
        let log = idp.log.lock().unwrap();
        assert_eq!((log.pkce_ok, log.pkce_bad, log.unauthenticated), (1, 0, 0));
    }
    let (status, _, body) = page_call(
        "GET",
        &format!("{admin}/ui/approvals"),
        Some(&cookie),
        None,
        &[],
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        body.contains("Signed in as") && body.contains("alice"),
        "{body}"
    );

    // A callback whose state this browser did not start, or a state used twice: refused.
    let (status, _, _) = page_call(
        "GET",
        &format!("{admin}/ui/callback?code=x&state=forged"),
        Some("turnguard_login=whatever"),
        None,
        &[],
    )
    .await;
    assert_eq!(status, 401);
    let (status, headers, _) =
        page_call("GET", &format!("{admin}/ui/login"), None, None, &[]).await;
    assert_eq!(status, 303);
    let to = headers["location"].to_str().unwrap().to_owned();
    let state = query_param(&to, "state").unwrap();
    let (status, _, body) = page_call(
        "GET",
        &format!("{admin}/ui/callback?code=x&state={}", url_escape(&state)),
        Some("turnguard_login=another-browser"),
        None,
        &[],
    )
    .await;
    assert_eq!(status, 401, "another browser's sign-in: {body}");

    // A held call; the page's POST needs the session, its CSRF token, this origin.
    h.script(&json!({"responses": [reply("send_email", mail("eve@example.test", "x"))]}))
        .await;
    let waiting = agent(
        &h,
        "/v1/chat/completions",
        after_email(),
        as_person_at(&idp, "alice", "run-page"),
    );
    let alice = token_at(&idp, "alice", json!({}));
    let id = wait_pending(&h, &alice, 1).await[0]["interruptId"]
        .as_str()
        .unwrap()
        .to_owned();
    let (_, _, page) = page_call(
        "GET",
        &format!("{admin}/ui/approvals"),
        Some(&cookie),
        None,
        &[],
    )
    .await;
    let csrf = regex::Regex::new(r#"name="csrf" value="([^"]+)""#)
        .unwrap()
        .captures(&page)
        .unwrap()[1]
        .to_owned();
    let url = format!("{admin}/ui/approvals/{id}");
    let post = |form: String, cookie: Option<String>, extra: Vec<(&'static str, String)>| {
        let url = url.clone();
        async move {
            let extra: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (*k, v.as_str())).collect();
            page_call("POST", &url, cookie.as_deref(), Some(&form), &extra)
                .await
                .0
        }
    };
    assert_eq!(
        post("action=accept".into(), Some(cookie.clone()), vec![]).await,
        403,
        "no CSRF token"
    );
    assert_eq!(
        post(
            "action=accept&csrf=wrong".into(),
            Some(cookie.clone()),
            vec![]
        )
        .await,
        403,
        "a wrong CSRF token"
    );
    assert_eq!(
        post(format!("action=accept&csrf={csrf}"), None, vec![]).await,
        401,
        "no session"
    );
    assert_eq!(
        post(
            format!("action=accept&csrf={csrf}"),
            Some(cookie.clone()),
            vec![("origin", "http://evil.test".into())]
        )
        .await,
        403,
        "another origin"
    );
    assert_eq!(
        post(
            format!("action=accept&csrf={csrf}"),
            Some(cookie.clone()),
            vec![("sec-fetch-site", "cross-site".into())]
        )
        .await,
        403,
        "a cross-site request"
    );
    let (status, _, _) = page_call(
        "POST",
        &format!("{url}?action=accept"),
        Some(&cookie),
        Some(&format!("action=accept&csrf={csrf}")),
        &[],
    )
    .await;
    assert_eq!(status, 400, "a query string");
    assert!(!waiting.is_finished());
    assert_eq!(
        pending(&h, &alice).await.len(),
        1,
        "nothing above resolved it"
    );

    // The session's SSE stream lists the pending call.
    let resp = stream_get(
        &format!("{admin}/approvals/events"),
        &[("cookie", cookie.as_str())],
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = String::new();
    while !got.contains(&id) {
        let f = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        got.push_str(&String::from_utf8_lossy(&f.into_data().unwrap()));
    }
    assert!(got.contains("event: interrupt.requested"), "{got}");
    drop(body);

    // With everything right (the browser's own Origin): accepted, the agent gets its call.
    assert_eq!(
        post(
            format!("action=accept&csrf={csrf}&feedback=ok"),
            Some(cookie.clone()),
            vec![("origin", admin.clone())]
        )
        .await,
        303
    );
    let (status, _, body) = waiting.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(calls_of(&json_of(&body)).len(), 1);

    // Sign out: the session is gone.
    assert_eq!(
        page_call(
            "POST",
            &format!("{admin}/ui/logout"),
            Some(&cookie),
            Some(&format!("csrf={csrf}")),
            &[]
        )
        .await
        .0,
        303
    );
    let (_, _, body) = page_call(
        "GET",
        &format!("{admin}/ui/approvals"),
        Some(&cookie),
        None,
        &[],
    )
    .await;
    assert!(
        body.contains("/ui/login") && !body.contains("Signed in as"),
        "{body}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_is_off_unless_enabled() {
    let h = support::start_with_policy(Script::default(), "policy-ui").await;
    for path in ["/ui/approvals", "/ui/login", "/ui/callback?code=x&state=y"] {
        let (status, _, _) =
            support::call("GET", &format!("{}{path}", h.admin_url()), &[], None).await;
        assert_eq!(status, 404, "{path}");
    }
    // The SSE stream still answers a bearer, and nothing else.
    let (status, _, _) = support::call(
        "GET",
        &format!("{}/approvals/events", h.admin_url()),
        &[],
        None,
    )
    .await;
    assert_eq!(status, 401);
    h.stop().await;
}

// ---- notifications ------------------------------------------------------------------------

/// A webhook receiver: the first delivery attempt waits `first_delay` and answers 500, the
/// rest 200. Records `(headers, body)` of every attempt.
async fn start_receiver(
    first_delay: Duration,
) -> (
    String,
    Arc<Mutex<Vec<(http::HeaderMap, Bytes)>>>,
    tokio::task::JoinHandle<()>,
) {
    let seen: Arc<Mutex<Vec<(http::HeaderMap, Bytes)>>> = Arc::default();
    let s = Arc::clone(&seen);
    let app = Router::new().route(
        "/hook",
        post(move |headers: http::HeaderMap, body: Bytes| {
            let s = Arc::clone(&s);
            async move {
                let first = {
                    let mut v = s.lock().unwrap();
                    v.push((headers, body));
                    v.len() == 1
                };
                if first {
                    tokio::time::sleep(first_delay).await;
                    http::StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    http::StatusCode::NO_CONTENT
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen, task)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_webhook_is_signed_retried_after_a_500_and_never_delays_the_agent() {
    let (url, seen, task) = start_receiver(Duration::from_secs(3)).await;
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("webhook.key");
    std::fs::write(&key_file, format!("{WEBHOOK_KEY}\n")).unwrap();
    let h = support::start_with(Script::default(), move |c| {
        c.policy = own_fixtures().join("policy-ui");
        c.approval_webhook = Some(url);
        c.approval_webhook_secret_file = Some(key_file);
    })
    .await;
    h.script(
        &json!({"responses": [reply("send_email", mail("eve@example.test", "ticket PIN-1234"))]}),
    )
    .await;
    // No acting person: nobody can approve, the call is refused at once — while the webhook's
    // first delivery hangs for 3 s and then fails.
    let started = Instant::now();
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/chat/completions", h.url()),
        &[("turnguard-run", "run-hook".into())],
        Some(&after_email()),
    )
    .await;
    let took = started.elapsed();
    assert_eq!(status, 200);
    assert!(
        text_of(&json_of(&body)).contains("no_approver"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert!(
        took < Duration::from_millis(2500),
        "the agent waited on the webhook: {took:?}"
    );

    // Deliveries: interrupt.requested (500 after 3 s, then retried: 2xx), interrupt.resolved.
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.lock().unwrap().len() < 3 {
        assert!(
            Instant::now() < deadline,
            "deliveries: {}",
            seen.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = seen.lock().unwrap().clone();
    let bodies: Vec<Value> = seen
        .iter()
        .map(|(_, b)| serde_json::from_slice(b).unwrap())
        .collect();
    for (headers, body) in &seen {
        let sig = headers["turnguard-signature"].to_str().unwrap();
        assert_eq!(
            sig,
            turnguard::approval_ui::notify::signature(WEBHOOK_KEY.as_bytes(), body),
            "HMAC-SHA256 over the body"
        );
        assert_eq!(headers["content-type"], "application/json");
    }
    assert_eq!(bodies[0]["type"], "interrupt.requested");
    assert_eq!(bodies[0], bodies[1], "the retry sends the same delivery");
    assert_eq!(
        seen[0].0["turnguard-delivery"],
        seen[1].0["turnguard-delivery"]
    );
    let interrupt = &bodies[0]["interrupt"];
    assert_eq!(interrupt["calls"][0]["toolName"], "send_email");
    assert_eq!(
        interrupt["calls"][0]["arguments"]["body"],
        "ticket [REDACTED:ticket-pin]"
    );
    assert!(
        !String::from_utf8_lossy(&seen[0].1).contains("PIN-1234"),
        "redacted only"
    );
    assert_eq!(bodies[2]["type"], "interrupt.resolved");
    assert_eq!(bodies[2]["interrupt"]["state"], "rejected");
    assert!(
        bodies[2]["interrupt"].get("calls").is_none(),
        "no arguments in a resolution"
    );
    let verify_fails = turnguard::approval_ui::notify::signature(
        b"another key of thirty-two bytes or more",
        &seen[0].1,
    );
    assert_ne!(
        verify_fails,
        seen[0].0["turnguard-signature"].to_str().unwrap()
    );
    assert_eq!(
        metric(
            &h,
            r#"turnguard_approval_notifications_total{channel="webhook",result="retried"}"#
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &h,
            r#"turnguard_approval_notifications_total{channel="webhook",result="delivered"}"#
        )
        .await,
        2.0
    );
    task.abort();
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sse_stream_carries_only_the_callers_own_interrupts() {
    let idp = start_idp().await;
    let (h, _keys) = start_ui(&idp, 30_000, |_| {}).await;
    let alice = token_at(&idp, "alice", json!({}));
    let bob = token_at(&idp, "bob", json!({}));
    let events = format!("{}/approvals/events", h.admin_url());
    let (status, _, _) = support::call("GET", &events, &[], None).await;
    assert_eq!(status, 401);
    let (status, _, _) =
        support::call("GET", &format!("{events}?access_token={alice}"), &[], None).await;
    assert_eq!(status, 400, "no token in a URL");
    let auth_a = format!("Bearer {alice}");
    let auth_b = format!("Bearer {bob}");
    let mut a = stream_get(&events, &[("authorization", auth_a.as_str())])
        .await
        .into_body();
    let mut b = stream_get(&events, &[("authorization", auth_b.as_str())])
        .await
        .into_body();
    async fn until(body: &mut hyper::body::Incoming, got: &mut String, want: &str) {
        while !got.contains(want) {
            let f = tokio::time::timeout(Duration::from_secs(20), body.frame())
                .await
                .expect("an event in time")
                .unwrap()
                .unwrap();
            if let Ok(d) = f.into_data() {
                got.push_str(&String::from_utf8_lossy(&d));
            }
        }
    }
    let (mut got_a, mut got_b) = (String::new(), String::new());
    until(&mut a, &mut got_a, "turnguard approval events").await;
    until(&mut b, &mut got_b, "turnguard approval events").await;
    h.script(&json!({"responses": [
        reply("send_email", mail("eve@example.test", "for alice")),
        reply("send_email", mail("eve@example.test", "for bob")),
    ]}))
    .await;
    let wa = agent(
        &h,
        "/v1/chat/completions",
        after_email(),
        as_person_at(&idp, "alice", "run-sse-a"),
    );
    until(&mut a, &mut got_a, "event: interrupt.requested").await;
    let id_a = pending(&h, &alice).await[0]["interruptId"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        got_a.contains(&id_a) && got_a.contains("for alice"),
        "{got_a}"
    );
    let wb = agent(
        &h,
        "/v1/chat/completions",
        after_email(),
        as_person_at(&idp, "bob", "run-sse-b"),
    );
    until(&mut b, &mut got_b, "event: interrupt.requested").await;
    assert!(
        !got_b.contains(&id_a) && got_b.contains("for bob"),
        "bob's first interrupt is his own: {got_b}"
    );
    let (status, _) = resolve_body(
        &h,
        &format!("/approvals/{id_a}"),
        &bearer(&alice),
        &json!({"resumeValue": {"action": "reject"}}),
    )
    .await;
    assert_eq!(status, 200);
    until(&mut a, &mut got_a, "event: interrupt.resolved").await;
    assert!(!got_b.contains(&id_a), "{got_b}");
    wa.await.unwrap();
    wb.abort();
    h.stop().await;
}

// ---- edit before approve ------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn edit_before_approve_readmits_the_edited_call() {
    let idp = start_idp().await;
    let (h, _keys) = start_ui(&idp, 30_000, |_| {}).await;
    let alice = token_at(&idp, "alice", json!({}));
    h.script(&json!({"responses": [
        reply("send_email", mail("eve@example.test", "all rows")),
        reply("send_email", mail("eve@example.test", "all rows")),
        reply("send_email", mail("eve@example.test", "PIN-1234 and all rows")),
        reply("post_message", json!({"channel": "general", "text": "hi"})),
    ]}))
    .await;
    let edit = |call_id: &str, arguments: Value| {
        json!({"resumeValue": {"action": "edit-accept", "feedback": "fixed it",
               "editedArtifactData": {"calls": [{"callId": call_id, "arguments": arguments}]}}})
    };
    let held = |run: &'static str| {
        agent(
            &h,
            "/v1/chat/completions",
            after_email(),
            as_person_at(&idp, "alice", run),
        )
    };

    // 1. An edit that fails the catalog schema is refused, never released.
    let w = held("run-edit-1");
    let it = wait_pending(&h, &alice, 1).await.remove(0);
    assert_eq!(
        it["data"]["actions"],
        json!(["accept", "reject", "edit-accept"])
    );
    assert_eq!(it["calls"][0]["editable"], true);
    let id = it["interruptId"].as_str().unwrap();
    let call_id = it["calls"][0]["callId"].as_str().unwrap();
    let (status, r) = resolve_body(
        &h,
        &format!("/approvals/{id}"),
        &bearer(&alice),
        &edit(
            call_id,
            json!({"to": "not an address", "subject": "s", "body": "b"}),
        ),
    )
    .await;
    assert_eq!(
        (status, r["state"].as_str()),
        (200, Some("accepted")),
        "{r}"
    );
    let (_, _, body) = w.await.unwrap();
    let resp = json_of(&body);
    assert!(calls_of(&resp).is_empty(), "{resp}");
    assert!(
        text_of(&resp).contains("edit_refused") && text_of(&resp).contains("arguments"),
        "{resp}"
    );

    // 2. An edit that authorization forbids is refused too.
    let w = held("run-edit-2");
    let it = wait_pending(&h, &alice, 1).await.remove(0);
    let id = it["interruptId"].as_str().unwrap();
    let (status, _) = resolve_body(
        &h,
        &format!("/approvals/{id}"),
        &bearer(&alice),
        &edit("call_0", mail("mallory@blocked.test", "x")),
    )
    .await;
    assert_eq!(status, 400, "not a call id of this interrupt");
    let call_id = it["calls"][0]["callId"].as_str().unwrap();
    let (status, _) = resolve_body(
        &h,
        &format!("/approvals/{id}"),
        &bearer(&alice),
        &edit(call_id, json!(["not", "an", "object"])),
    )
    .await;
    assert_eq!(status, 400);
    let (status, _) = resolve_body(
        &h,
        &format!("/approvals/{id}"),
        &bearer(&alice),
        &edit(call_id, mail("mallory@blocked.test", "x")),
    )
    .await;
    assert_eq!(status, 200);
    let resp = json_of(&w.await.unwrap().2);
    assert!(
        calls_of(&resp).is_empty()
            && text_of(&resp).contains("edit_refused")
            && text_of(&resp).contains("authorization"),
        "{resp}"
    );

    // 3. A valid edit is delivered; the journal keeps both versions (redacted) and who edited;
    //    the approval bound the edited argsHash.
    let w = held("run-edit-3");
    let it = wait_pending(&h, &alice, 1).await.remove(0);
    let id = it["interruptId"].as_str().unwrap().to_owned();
    let model_hash = it["calls"][0]["argsHash"].as_str().unwrap().to_owned();
    assert_eq!(
        it["calls"][0]["arguments"]["body"],
        "[REDACTED:ticket-pin] and all rows"
    );
    let call_id = it["calls"][0]["callId"].as_str().unwrap();
    let edited = mail("bob@example.test", "Only the summary. PIN-9999");
    let (status, r) = resolve_body(
        &h,
        &format!("/approvals/{id}"),
        &bearer(&alice),
        &edit(call_id, edited),
    )
    .await;
    assert_eq!((status, r["edited"].as_u64()), (200, Some(1)), "{r}");
    let resp = json_of(&w.await.unwrap().2);
    let released = mail(
        "bob@example.test",
        "Only the summary. [REDACTED:ticket-pin]",
    );
    assert_eq!(
        calls_of(&resp),
        vec![("send_email".to_owned(), released.clone())],
        "{resp}"
    );

    // 4. A tool without `approval_edit` offers no edit.
    let w = held("run-edit-4");
    let it = wait_pending(&h, &alice, 1).await.remove(0);
    assert_eq!(it["data"]["actions"], json!(["accept", "reject"]));
    let id4 = it["interruptId"].as_str().unwrap();
    let (status, err) = resolve_body(
        &h,
        &format!("/approvals/{id4}"),
        &bearer(&alice),
        &edit(
            it["calls"][0]["callId"].as_str().unwrap(),
            json!({"channel": "x", "text": "y"}),
        ),
    )
    .await;
    assert_eq!(status, 400, "{err}");
    let (status, _) = resolve_body(
        &h,
        &format!("/approvals/{id4}"),
        &bearer(&alice),
        &json!({"resumeValue": {"action": "reject"}}),
    )
    .await;
    assert_eq!(status, 200);
    w.await.unwrap();

    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let (calls, edits, resume): (String, String, String) = db
        .query_row(
            "SELECT calls, edits, resume_value FROM interrupts WHERE interrupt_id = ?1",
            [&id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    let calls: Value = serde_json::from_str(&calls).unwrap();
    let edits: Value = serde_json::from_str(&edits).unwrap();
    let resume: Value = serde_json::from_str(&resume).unwrap();
    assert_eq!(
        calls[0]["arguments"],
        mail("eve@example.test", "[REDACTED:ticket-pin] and all rows"),
        "the model's version"
    );
    assert_eq!(edits[0]["arguments"], released, "the person's version");
    assert_eq!(edits[0]["editedBy"], "alice");
    assert_eq!(edits[0]["modelArgsHash"], json!(model_hash));
    let edited_hash = edits[0]["argsHash"].as_str().unwrap();
    assert_ne!(edited_hash, model_hash);
    assert_eq!(resume["action"], "edit-accept");
    assert_eq!(
        resume["editedArtifactData"]["calls"][0]["argsHash"],
        json!(edited_hash)
    );
    assert!(
        resume["editedArtifactData"]["calls"][0]
            .get("arguments")
            .is_none(),
        "no arguments in the resume value"
    );
    // The released call is journaled with the edited argsHash and arguments.
    let (hash, args, outcome): (String, String, String) = db
        .query_row(
            "SELECT c.args_hash, c.redacted_args, c.outcome FROM tool_calls c JOIN rounds r USING (request_id) WHERE r.run_id = 'run-edit-3' AND c.outcome = 'executed'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!((hash.as_str(), outcome.as_str()), (edited_hash, "executed"));
    assert_eq!(serde_json::from_str::<Value>(&args).unwrap(), released);
    let events: Vec<String> = db.column("SELECT payload FROM events WHERE type LIKE 'interrupt.%'");
    assert!(
        events.iter().all(|e| !e.contains("Only the summary")),
        "no arguments in events"
    );
    let refused: Vec<(String, String)> = db
        .prepare("SELECT c.reason, c.stage FROM tool_calls c JOIN rounds r USING (request_id) WHERE r.run_id IN ('run-edit-1', 'run-edit-2') AND c.outcome = 'refused' ORDER BY r.run_id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        refused,
        [
            ("edit_refused".to_owned(), "arguments".to_owned()),
            ("edit_refused".to_owned(), "authorization".to_owned())
        ]
    );
}

// ---- don't ask what would be refused anyway ------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_held_call_that_approval_could_not_release_is_refused_at_once() {
    let idp = start_idp().await;
    let (h, _keys) = start_ui(&idp, 30_000, |_| {}).await;
    let alice = token_at(&idp, "alice", json!({}));
    h.script(&json!({"responses": [reply("send_email", mail("eve@blocked.test", "the list"))]}))
        .await;
    let started = Instant::now();
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/chat/completions", h.url()),
        &as_person_at(&idp, "alice", "run-blocked"),
        Some(&after_email()),
    )
    .await;
    assert_eq!(status, 200);
    let resp = json_of(&body);
    assert!(calls_of(&resp).is_empty(), "{resp}");
    let text = text_of(&resp);
    assert!(
        text.contains("authorization") && text.contains("refused even if approved"),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "it did not wait for a person"
    );
    assert!(pending(&h, &alice).await.is_empty(), "nobody is asked");
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let n: i64 = db
        .query_row("SELECT count(*) FROM interrupts", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 0, "no interrupt was raised");
    let (outcome, stage, rules): (String, String, Option<String>) = db
        .query_row(
            "SELECT outcome, stage, rules FROM tool_calls WHERE name = 'send_email'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(
        (outcome.as_str(), stage.as_str()),
        ("refused", "authorization")
    );
    assert_eq!(rules.as_deref(), Some("no-mail-to-blocked-domains"));
}

// ---- the CLI ------------------------------------------------------------------------------

async fn cli(h: &Harness, token_file: &Path, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_turnguard"))
        .arg("approvals")
        .args(args)
        .arg("--admin")
        .arg(h.admin_url())
        .arg("--token-file")
        .arg(token_file)
        .env_remove("TURNGUARD_APPROVER_TOKEN")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_approvals_cli_lists_accepts_edits_and_rejects_with_the_persons_token() {
    let keys = tempfile::tempdir().unwrap();
    let h = support::start_with(
        Script::default(),
        support::approvals::trust_config(keys.path(), 60_000),
    )
    .await;
    // The trust bundle: send_email is held in an untrusted turn.
    h.script(&json!({"responses": [
        {"json": support::approvals::chat_response("", vec![support::approvals::chat_call("call_send", "send_email", support::approvals::send_args("all rows"))])},
        {"json": support::approvals::chat_response("", vec![support::approvals::chat_call("call_send2", "send_email", support::approvals::send_args("again"))])},
    ]}))
    .await;
    let alice_file = keys.path().join("alice.jwt");
    std::fs::write(&alice_file, token("alice", json!({}))).unwrap();
    // The very token the agent carries on the data plane (minted once: `exp` is in seconds,
    // so a second minting can differ from it).
    let agent_tok = agent_token("alice");
    let agent_file = keys.path().join("agent.jwt");
    std::fs::write(&agent_file, &agent_tok).unwrap();

    let (code, out, _) = cli(&h, &alice_file, &["list"]).await;
    assert_eq!(
        (code, out.lines().count()),
        (0, 1),
        "only the header: {out}"
    );
    let w = agent(
        &h,
        "/v1/chat/completions",
        support::approvals::after_email(vec![]),
        vec![
            ("turnguard-principal-token", agent_tok.clone()),
            ("turnguard-run", "run-cli".to_owned()),
        ],
    );
    let id = wait_pending(&h, &token("alice", json!({})), 1).await[0]["interruptId"]
        .as_str()
        .unwrap()
        .to_owned();
    let (code, out, err) = cli(&h, &alice_file, &["list"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&id)
            && out.contains("send_email")
            && out.contains("untrusted_turn")
            && out.contains("run-cli"),
        "{out}"
    );
    let (code, out, _) = cli(&h, &alice_file, &["list", "--json"]).await;
    assert_eq!(code, 0);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["approvals"][0]["interruptId"],
        json!(id)
    );
    // The agent's own token: refused by the admin plane.
    let (code, _, err) = cli(&h, &agent_file, &["accept", &id]).await;
    assert_eq!(code, 1);
    assert!(err.contains("403") && err.contains("forbidden"), "{err}");
    let (code, out, err) = cli(&h, &alice_file, &["accept", &id, "--feedback", "go"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("{id} accepted"));
    let (status, _, body) = w.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(calls_of(&json_of(&body)).len(), 1);
    // Resolved already: 409, exit 1.
    let (code, _, err) = cli(&h, &alice_file, &["reject", &id]).await;
    assert_eq!(code, 1);
    assert!(err.contains("409"), "{err}");

    let w = agent(
        &h,
        "/v1/chat/completions",
        support::approvals::after_email(vec![]),
        support::approvals::as_person("alice", "run-cli-2"),
    );
    let id = wait_pending(&h, &token("alice", json!({})), 1).await[0]["interruptId"]
        .as_str()
        .unwrap()
        .to_owned();
    let (code, _, err) = cli(
        &h,
        &alice_file,
        &["accept", &id, "--edit", "call_send2={\"to\":\"x\"}"],
    )
    .await;
    assert_eq!(code, 1, "the trust bundle's send_email allows no edits");
    assert!(err.contains("400"), "{err}");
    let (code, out, err) = cli(&h, &alice_file, &["reject", &id, "--feedback", "no"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("{id} rejected"));
    let (status, _, _) = w.await.unwrap();
    assert_eq!(status, 422, "refused");
    let (code, _, err) = cli(&h, &keys.path().join("missing"), &["list"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("cannot read"), "{err}");
    h.stop().await;
}
