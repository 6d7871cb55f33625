//! The approval page: server-rendered HTML (maud: every interpolated value is HTML-escaped,
//! and tool names, ids and arguments come from model output), one small script for the
//! expiry countdown and live updates, no inline script or style, a strict CSP.
//!
//! - `GET /ui/approvals`: the signed-in person's pending interrupts — per call the tool's
//!   title, name and `toolId`, why it was held (the untrusted inputs of the turn, named, and
//!   the deciding stage), the redacted arguments as sorted, indented JSON (one key per line:
//!   diff-friendly), the policy revision and the expiry countdown; accept or reject with
//!   optional feedback, and for `approval_edit` tools the arguments to edit before accepting.
//! - `POST /ui/approvals/{interruptId}`: the resolution, form-encoded, with the session's
//!   CSRF token; refused without it (403), from another `Origin` (403), or with a query
//!   string (400). It goes through [`crate::approvals::resolve_as`], the admin API's
//!   compare-and-set.

use crate::strict_json::Lookup as _;
use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Extension, Path, State};
use axum::response::{IntoResponse, Response};
use http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use maud::{html, Markup, DOCTYPE};
use serde_json::Value;

use super::session::{self, UiSession};
use super::ApprovalUi;
use crate::approvals::{self, Action, Answer, EditedCall};
use crate::body::read_capped;
use crate::clock::now_ms;
use crate::journal::{InterruptRow, InterruptState, Selector};
use crate::state::AppState;

const SCRIPT: &str = include_str!("assets/app.js");
const STYLE: &str = include_str!("assets/app.css");
/// Largest form accepted, bytes.
const MAX_FORM: usize = 256 << 10;

/// The page's Content Security Policy: nothing but this origin's script, style and
/// connections; no inline script or style, no framing, forms post only here.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Security headers of every page answer.
pub fn secure_headers(h: &mut HeaderMap) {
    for (k, v) in [
        ("content-security-policy", CSP),
        ("x-content-type-options", "nosniff"),
        ("x-frame-options", "DENY"),
        ("referrer-policy", "same-origin"),
        ("cache-control", "no-store"),
        ("cross-origin-opener-policy", "same-origin"),
    ] {
        h.insert(k, HeaderValue::from_static(v));
    }
}

fn html_response(status: StatusCode, body: Markup) -> Response {
    let mut resp = (status, body.into_string()).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    secure_headers(resp.headers_mut());
    resp
}

fn layout(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="referrer" content="same-origin";
                title { (title) " · turnguard" }
                link rel="stylesheet" href="/ui/assets/app.css";
                script src="/ui/assets/app.js" defer {}
            }
            body {
                header.top { span.brand { "turnguard" } span.sub { "approvals" } }
                main { (body) }
            }
        }
    }
}

/// A page with a heading and one message.
pub fn message(status: StatusCode, title: &str, text: &str) -> Response {
    html_response(
        status,
        layout(
            title,
            html! {
                h1 { (title) }
                p.message { (text) }
                p { a.button href="/ui/approvals" { "Back to approvals" } }
            },
        ),
    )
}

/// 404 for the page's routes while it is off.
pub fn not_found() -> Response {
    message(StatusCode::NOT_FOUND, "Not found", "No such page.")
}

/// After the sign-in: a page of this origin that moves on to the list (a same-site
/// navigation, so the `SameSite=Strict` session cookie is sent).
pub fn signed_in(sub: &str) -> Response {
    let mut resp = html_response(
        StatusCode::OK,
        html! {
            (DOCTYPE)
            html lang="en" {
                head {
                    meta charset="utf-8";
                    meta name="viewport" content="width=device-width, initial-scale=1";
                    meta http-equiv="refresh" content="0;url=/ui/approvals";
                    title { "Signed in · turnguard" }
                    link rel="stylesheet" href="/ui/assets/app.css";
                }
                body { main {
                    h1 { "Signed in" }
                    p { "You are signed in as " strong { (sub) } "." }
                    p { a.button #continue href="/ui/approvals" { "Continue to your approvals" } }
                } }
            }
        },
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// The session of a request (cookie), if any.
pub(super) fn session_of(ui: &ApprovalUi, headers: &HeaderMap) -> Option<(String, UiSession)> {
    let settings = ui.settings.as_ref()?;
    let cookie = session::cookie_value(headers, session::session_cookie(settings.secure))?;
    let got = ui.sessions.get(&cookie)?;
    Some((cookie, got))
}

/// The session of a request with its flash message taken (the list page shows it once).
fn session_with_flash(ui: &ApprovalUi, headers: &HeaderMap) -> Option<UiSession> {
    let settings = ui.settings.as_ref()?;
    let cookie = session::cookie_value(headers, session::session_cookie(settings.secure))?;
    ui.sessions.take(&cookie)
}

/// `GET /ui/assets/app.js`.
pub async fn script() -> Response {
    asset(SCRIPT, "text/javascript; charset=utf-8")
}

/// `GET /ui/assets/app.css`.
pub async fn style() -> Response {
    asset(STYLE, "text/css; charset=utf-8")
}

fn asset(body: &'static str, kind: &'static str) -> Response {
    let mut resp = body.into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// `GET /ui/approvals`.
pub async fn list(
    State(s): State<Arc<AppState>>,
    Extension(ui): Extension<Arc<ApprovalUi>>,
    req: Request<Body>,
) -> Response {
    if req.uri().query().is_some() {
        return message(
            StatusCode::BAD_REQUEST,
            "No query strings",
            "The approval page takes no query string: nothing is ever resolved by a link.",
        );
    }
    let Some(session) = session_with_flash(&ui, req.headers()) else {
        return html_response(
            StatusCode::OK,
            layout(
                "Sign in",
                html! {
                    h1 { "Approvals" }
                    p { "Sign in to see the tool calls that wait for your approval." }
                    p { a.button.primary #sign-in href="/ui/login" { "Sign in" } }
                },
            ),
        );
    };
    let rows = match s
        .journal
        .pending_interrupts(&session.person.sub, now_ms())
        .await
    {
        Ok(r) => r,
        Err(e) => {
            return message(
                StatusCode::SERVICE_UNAVAILABLE,
                "Journal unavailable",
                &format!("The journal could not answer: {e}"),
            )
        }
    };
    let now = now_ms();
    let body = html! {
        div.bar {
            span { "Signed in as " strong #who { (session.person.sub) } }
            form method="post" action="/ui/logout" {
                input type="hidden" name="csrf" value=(session.csrf);
                button.link type="submit" { "Sign out" }
            }
        }
        @if let Some(f) = &session.flash {
            p.flash #flash role="status" { (f) }
        }
        p.live #live hidden role="status" {}
        h1 { "Waiting for you" span.count #count { (rows.len()) } }
        @if rows.is_empty() {
            p.empty #empty { "Nothing waits for your approval." }
        }
        div #approvals data-now=(now) {
            @for row in &rows { (card(row, &session.csrf, now)) }
        }
    };
    html_response(StatusCode::OK, layout("Approvals", body))
}

/// A JSON value with every object's keys sorted, recursively (a stable, diff-friendly view).
fn sorted(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let b: BTreeMap<&String, Value> = m.iter().map(|(k, v)| (k, sorted(v))).collect();
            Value::Object(b.into_iter().map(|(k, v)| (k.clone(), v)).collect())
        }
        Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(&sorted(v)).unwrap_or_else(|_| v.to_string())
}

fn str_at<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

/// One untrusted input, in words.
fn input_line(i: &Value) -> Markup {
    match str_at(i, "kind") {
        "tool-result" => html! {
            "The result of " code { (str_at(i, "toolName")) }
            " (call " code { (str_at(i, "toolCallId")) } ", " code { (str_at(i, "toolId")) } ")"
            @if i.get("catalogued") == Some(&Value::Bool(false)) {
                ": a tool the catalog does not know, so its output is untrusted"
            } @else {
                ": its output is untrusted"
            }
        },
        "request" => html! {
            "The request's " code { (str_at(i, "at")) } " ("
            (match str_at(i, "reason") {
                "provider_output" => "output of a provider-executed tool",
                "provider_fetched" => "content the provider fetches, which turnguard never sees",
                "duplicate_call_id" => "a tool-call id used for two calls",
                _ => "an input turnguard does not recognise",
            })
            ")"
        },
        "provider-output" => {
            html! { "Output of a provider-executed tool (web search, fetch …) in this turn" }
        }
        "response-chain" => html! {
            "The stored response " code { (str_at(i, "responseId")) } " this turn continues ("
            (str_at(i, "reason")) ")"
        },
        "earlier-turn-of-run" => html! {
            "An earlier turn of run " code { (str_at(i, "runId")) } " read untrusted content"
        },
        other => html! { "Input " code { (other) } },
    }
}

fn card(row: &InterruptRow, csrf: &str, now: i64) -> Markup {
    let id = &row.record.interrupt_id;
    let data = row
        .record
        .payload
        .get("data")
        .cloned()
        .unwrap_or(Value::Null);
    let inputs: Vec<Value> = data
        .at("/artifactData/untrustedInputs")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let calls: Vec<Value> = row.record.calls.as_array().cloned().unwrap_or_default();
    let editable = calls
        .iter()
        .any(|c| c.get("editable") == Some(&Value::Bool(true)));
    let left_s = (row.record.expires_at_ms - now).max(0) / 1000;
    html! {
        article.card data-interrupt=(id) {
            header {
                h2 { (str_at(&data, "title")) }
                p.meta {
                    @if let Some(run) = &row.record.run.run_id {
                        "run " code { (run) } " · node " code { (row.record.run.node_id.as_deref().unwrap_or("default")) } " · "
                    }
                    "policy " code.revision { (row.record.policy_revision) }
                }
                p.expiry { "Expires " time data-expires=(row.record.expires_at_ms) { "in " (left_s / 60) " min " (left_s % 60) " s" } }
            }
            section.why {
                h3 { "Why it was held" }
                @if inputs.is_empty() {
                    p { "Policy holds these calls for your approval." }
                } @else {
                    p { "This turn read untrusted content:" }
                    ul.inputs { @for i in &inputs { li { (input_line(i)) } } }
                }
            }
            form.resolve method="post" action={ "/ui/approvals/" (id) } {
                input type="hidden" name="csrf" value=(csrf);
                @for c in &calls { (call_view(c)) }
                label.feedback {
                    "Feedback (optional)"
                    textarea name="feedback" rows="2" maxlength="4000" {}
                }
                div.actions {
                    button.accept type="submit" name="action" value="accept" { "Accept" }
                    @if editable {
                        button.edit type="submit" name="action" value="edit-accept" { "Accept with my edits" }
                    }
                    button.reject type="submit" name="action" value="reject" { "Reject" }
                }
            }
        }
    }
}

fn call_view(c: &Value) -> Markup {
    let name = str_at(c, "toolName");
    let title = c.get("toolTitle").and_then(Value::as_str).unwrap_or(name);
    let args = c.get("arguments").cloned().unwrap_or(Value::Null);
    let held = c.get("heldBecause").cloned().unwrap_or(Value::Null);
    let call_id = str_at(c, "callId");
    html! {
        section.call data-call=(call_id) {
            h3 { (title) }
            p.meta {
                code.tool { (name) } " · " code { (str_at(c, "toolId")) } " · call " code { (call_id) }
            }
            p.held {
                "Held at the " strong { (str_at(&held, "stage")) } " stage ("
                code { (str_at(&held, "reason")) } "): " (str_at(&held, "message"))
            }
            p.label { "Arguments (redacted)" }
            pre.args { code { (pretty(&args)) } }
            p.hash { "argsHash " code { (str_at(c, "argsHash")) } }
            @if c.get("editable") == Some(&Value::Bool(true)) {
                details.edit {
                    summary { "Edit the arguments before accepting" }
                    p.note { "The edited call is checked again (schema, authorization, limits, redaction) before it is released; a redacted value stays redacted." }
                    textarea.args name={ "args:" (call_id) } rows="8" spellcheck="false" { (pretty(&args)) }
                }
            }
        }
    }
}

/// `POST /ui/logout`.
pub async fn logout(Extension(ui): Extension<Arc<ApprovalUi>>, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let form = match checked_form(&ui, &parts, body).await {
        Ok(f) => f,
        Err(r) => return *r,
    };
    ui.sessions.close(&form.cookie);
    let secure = ui.settings.as_ref().is_some_and(|x| x.secure);
    let mut resp = see_other("/ui/approvals");
    let c = session::set_cookie(
        session::session_cookie(secure),
        String::new(),
        cookie::SameSite::Strict,
        secure,
        0,
    );
    if let Ok(v) = HeaderValue::from_str(&c) {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    resp
}

fn see_other(to: &'static str) -> Response {
    let mut resp = StatusCode::SEE_OTHER.into_response();
    resp.headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static(to));
    secure_headers(resp.headers_mut());
    resp
}

/// A form of a signed-in session whose CSRF token matched.
struct CheckedForm {
    cookie: String,
    session: UiSession,
    fields: Vec<(String, String)>,
}

impl CheckedForm {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The checks of every state-changing request of the page: no query string, a live
/// session, same `Origin` (when the browser sends one) and no cross-site fetch, a form
/// body within the cap, and the session's CSRF token in the `csrf` field.
async fn checked_form(
    ui: &ApprovalUi,
    parts: &http::request::Parts,
    body: Body,
) -> Result<CheckedForm, Box<Response>> {
    let deny = |status, title: &str, text: &str| Box::new(message(status, title, text));
    if parts.uri.query().is_some() {
        return Err(deny(
            StatusCode::BAD_REQUEST,
            "No query strings",
            "Nothing is resolved by a link or a query string.",
        ));
    }
    let Some(settings) = ui.settings.as_ref() else {
        return Err(Box::new(not_found()));
    };
    let Some((cookie, session)) = session_of(ui, &parts.headers) else {
        return Err(deny(
            StatusCode::UNAUTHORIZED,
            "Signed out",
            "Your session ended; sign in again.",
        ));
    };
    let origin = parts
        .headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok());
    let cross_site = parts
        .headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == "cross-site");
    if origin.is_some_and(|o| o != settings.origin) || cross_site {
        tracing::warn!(sub = %session.person.sub, "approval page: a request from another origin refused");
        return Err(deny(
            StatusCode::FORBIDDEN,
            "Refused",
            "This request came from another site.",
        ));
    }
    let raw = read_capped(body, MAX_FORM).await.map_err(|e| {
        deny(
            StatusCode::PAYLOAD_TOO_LARGE,
            "Too large",
            &format!("The form is too large: {e}"),
        )
    })?;
    let fields: Vec<(String, String)> = form_urlencoded::parse(&raw).into_owned().collect();
    let csrf = fields
        .iter()
        .find(|(k, _)| k == "csrf")
        .map(|(_, v)| v.as_str());
    if !csrf.is_some_and(|t| session::same_secret(t, &session.csrf)) {
        tracing::warn!(sub = %session.person.sub, "approval page: a request without the session's CSRF token refused");
        return Err(deny(
            StatusCode::FORBIDDEN,
            "Refused",
            "The request did not carry this session's CSRF token. Reload the page and try again.",
        ));
    }
    Ok(CheckedForm {
        cookie,
        session,
        fields,
    })
}

/// `POST /ui/approvals/{interruptId}`: `csrf`, `action` (`accept`, `reject`,
/// `edit-accept`), `feedback`, and for `edit-accept` one `args:<callId>` field of JSON per
/// editable call. Success: 303 to the list with a message; a refusal: its status and why.
pub async fn resolve(
    State(s): State<Arc<AppState>>,
    Extension(ui): Extension<Arc<ApprovalUi>>,
    Path(id): Path<String>,
    req: Request<Body>,
) -> Response {
    let (parts, body) = req.into_parts();
    let form = match checked_form(&ui, &parts, body).await {
        Ok(f) => f,
        Err(r) => return *r,
    };
    let Some(action) = form.field("action").and_then(Action::parse) else {
        return message(
            StatusCode::BAD_REQUEST,
            "Not resolved",
            "The action must be accept, reject or edit-accept.",
        );
    };
    let mut edits = Vec::new();
    if action == Action::EditAccept {
        for (k, v) in &form.fields {
            let Some(call_id) = k.strip_prefix("args:") else {
                continue;
            };
            match serde_json::from_str::<Value>(v) {
                Ok(arguments) => edits.push(EditedCall {
                    call_id: call_id.to_owned(),
                    arguments,
                }),
                Err(e) => {
                    return message(
                        StatusCode::BAD_REQUEST,
                        "Not resolved",
                        &format!(
                        "The edited arguments of call {} are not JSON: {e}. Nothing was resolved.",
                        crate::admission::sanitize_label(call_id)
                    ),
                    )
                }
            }
        }
    }
    let answer = Answer {
        action,
        feedback: form.field("feedback").map(str::to_owned),
        edits,
    };
    match approvals::resolve_as(&s, &form.session.person, Selector::Id(id), answer).await {
        Ok(row) => {
            let tools: Vec<&str> = row
                .record
                .calls
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| str_at(c, "toolName"))
                .collect();
            let what = match (row.state, row.edits.is_some()) {
                (InterruptState::Accepted, true) => {
                    "Accepted with your edits (checked again before release)"
                }
                (InterruptState::Accepted, false) => "Accepted",
                _ => "Rejected",
            };
            ui.sessions
                .flash(&form.cookie, format!("{what}: {}.", tools.join(", ")));
            see_other("/ui/approvals")
        }
        Err(r) => message(r.status, "Not resolved", &r.message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_text_is_escaped_everywhere() {
        let call = serde_json::json!({
            "toolName": "<script>alert(1)</script>", "toolId": "t\"x", "callId": "c1",
            "arguments": {"body": "</pre><img src=x onerror=alert(1)>", "a": 1},
            "heldBecause": {"stage": "trust", "reason": "untrusted_turn", "message": "<b>m</b>"},
            "editable": true
        });
        let out = call_view(&call).into_string();
        assert!(!out.contains("<script>alert"), "{out}");
        assert!(!out.contains("<img"), "{out}");
        assert!(!out.contains("<b>m"), "{out}");
        assert!(out.contains("&lt;script&gt;"), "{out}");
        // Keys sorted, one per line.
        let a = out.find("&quot;a&quot;").unwrap();
        let b = out.find("&quot;body&quot;").unwrap();
        assert!(a < b, "{out}");
    }
}
