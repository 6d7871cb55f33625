//! `turnguard mock-provider`: a scripted OpenAI/Anthropic-compatible model for tests and the
//! offline demo. It is a seam for scripting the model, never a way around admission: it only
//! plays the upstream.
//!
//! A script is JSON: `{"responses": [STEP, …], "repeat": false, "base_dir": "…"}`. Each
//! request to any path other than `/_mock/*` takes the first STEP whose `path` matches (or
//! that has none). A STEP is one of
//! - `{"file": "x.json"}` / `{"file": "x.sse"}`: a fixture served byte for byte
//!   (`.sse` as `text/event-stream`, one event at a time);
//! - `{"json": {…}}`: an inline JSON body;
//! - `{"sse": ["event: a\ndata: {…}", …]}`: inline events (a blank line is added to each);
//! - `{"reply": {"text": …, "tool_calls": [{"name", "arguments" | "input", "namespace"}],
//!   "reasoning": …, "truncated": bool, "model": …}}`: a model answer rendered in the shape the
//!   request asks for — the API from the path (`…/chat/completions`, `…/messages`,
//!   `…/responses`), a stream when the body says `"stream": true` (see [`reply`]).
//!
//! A STEP may also say `when` it applies, by the request's shape: `{"model": "claude-*haiku*"}`
//! (a `*` glob on the body's `model`), `"tools": true|false` (the request declares tools:
//! a non-empty `tools`, or a Responses `additional_tools` input item), `"stream": bool`,
//! `"method": "GET"`, `"contains": "text"` (a substring of the raw body). A `sticky` step is
//! never used up: it answers every request it matches (a CLI's side requests — titles, token
//! counts — whenever they come). `name` labels a step; the request log records which step
//! answered each request (`"step"`, `null` when unnamed) or that none did (`"unanswered": true`).
//!
//! Each STEP takes the optional `status` (default 200), `headers`, `path`, `delay_ms` (before the headers),
//! `event_delay_ms` (between events), `gate` (each event waits for one `POST /_mock/step`),
//! and `cut_after_events` (the connection is broken after that many events).
//! Relative `file` paths resolve against `base_dir`, else the script file's directory.
//!
//! Script keys besides `responses`: `repeat` (start again once only sticky steps are left),
//! `base_dir`, and `strict_thinking` (refuse, as the Anthropic API does, a Messages request with
//! thinking on whose last assistant `tool_use` message does not start with its thinking block).
//!
//! Control endpoints: `GET /_mock/requests` (every request received, in order, with headers,
//! JSON body and raw body text), `POST /_mock/script` (replace the script), `POST /_mock/step`,
//! `POST /_mock/reset` (forget the request log).

use crate::strict_json::Lookup as _;
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::body::read_capped;
use crate::sse::SseFramer;

pub mod reply;
pub use reply::{ApiShape, Reply, ReplyCall};

/// A mock script (see the module docs).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    /// Responses in the order they are served.
    pub responses: Vec<Step>,
    /// Start again from the first response when the list is used up.
    #[serde(default)]
    pub repeat: bool,
    /// Directory relative `file` paths resolve against.
    #[serde(default)]
    pub base_dir: Option<PathBuf>,
    /// Check what the real Anthropic API checks with extended thinking on: a Messages request
    /// with `thinking.type` `enabled` or `adaptive` whose last assistant message has a
    /// `tool_use` block but does not start with a `thinking` / `redacted_thinking` block is
    /// answered 400 `invalid_request_error` (no step is used up).
    #[serde(default)]
    pub strict_thinking: bool,
}

/// One scripted response.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// A label for the request log (`"step"`).
    #[serde(default)]
    pub name: Option<String>,
    pub path: Option<String>,
    /// Applies only to requests of this shape.
    #[serde(default)]
    pub when: Option<When>,
    /// Never used up: answers every request it matches.
    #[serde(default)]
    pub sticky: bool,
    pub file: Option<PathBuf>,
    pub json: Option<Value>,
    pub sse: Option<Vec<String>>,
    /// A model answer rendered for the request's API and streaming mode.
    #[serde(default)]
    pub reply: Option<Reply>,
    #[serde(default)]
    pub status: Option<u16>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub delay_ms: u64,
    #[serde(default)]
    pub event_delay_ms: u64,
    #[serde(default)]
    pub gate: bool,
    #[serde(default)]
    pub cut_after_events: Option<usize>,
}

/// Which requests a [`Step`] applies to; every given field must match.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct When {
    /// A glob (`*` matches any run of characters) on the body's `model`.
    #[serde(default)]
    pub model: Option<String>,
    /// Whether the request declares tools (a non-empty `tools` array, or a Responses
    /// `additional_tools` input item).
    #[serde(default)]
    pub tools: Option<bool>,
    /// Whether the body says `"stream": true`.
    #[serde(default)]
    pub stream: Option<bool>,
    /// The HTTP method (`GET`, `POST`, …), case-insensitive.
    #[serde(default)]
    pub method: Option<String>,
    /// A substring of the raw request body.
    #[serde(default)]
    pub contains: Option<String>,
}

/// What a [`When`] is matched against.
struct Seen<'a> {
    method: &'a str,
    path: &'a str,
    raw: &'a str,
    body: &'a Value,
}

impl When {
    fn matches(&self, seen: &Seen<'_>) -> bool {
        let model = seen.body.get("model").and_then(Value::as_str);
        self.model
            .as_deref()
            .is_none_or(|g| model.is_some_and(|m| glob(g, m)))
            && self.tools.is_none_or(|t| t == declares_tools(seen.body))
            && self.stream.is_none_or(|s| {
                s == (seen.body.get("stream").and_then(Value::as_bool) == Some(true))
            })
            && self
                .method
                .as_deref()
                .is_none_or(|m| m.eq_ignore_ascii_case(seen.method))
            && self
                .contains
                .as_deref()
                .is_none_or(|c| seen.raw.contains(c))
    }
}

/// Whether a request body declares tools: a non-empty `tools` array, or a Responses input item
/// of type `additional_tools`.
fn declares_tools(body: &Value) -> bool {
    let top = body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    let additional = body
        .get("input")
        .and_then(Value::as_array)
        .is_some_and(|items| {
            items
                .iter()
                .any(|i| i.get("type").and_then(Value::as_str) == Some("additional_tools"))
        });
    top || additional
}

/// `*`-glob match of `pattern` against all of `text`.
fn glob(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let tail: Vec<&str> = parts.collect();
    let Some((last, middle)) = tail.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

impl Step {
    fn applies(&self, seen: &Seen<'_>) -> bool {
        self.path.as_deref().is_none_or(|p| p == seen.path)
            && self.when.as_ref().is_none_or(|w| w.matches(seen))
    }
}

/// Why a script could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    #[error("cannot read script {0}: {1}")]
    Read(PathBuf, String),
    #[error("{file}: at `{path}`: {reason}")]
    Invalid {
        file: String,
        path: String,
        reason: String,
    },
}

impl Script {
    /// Loads a script file; relative fixture paths resolve against its directory.
    pub fn load(path: &Path) -> Result<Self, ScriptError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ScriptError::Read(path.to_owned(), e.to_string()))?;
        let mut s = Self::parse(&text, &path.display().to_string())?;
        if s.base_dir.is_none() {
            s.base_dir = path.parent().map(Path::to_owned);
        }
        Ok(s)
    }

    /// Parses script JSON; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ScriptError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| ScriptError::Invalid {
            file: origin.to_owned(),
            path: e.path().to_string(),
            reason: e.inner().to_string(),
        })
    }
}

struct Mock {
    queue: Mutex<VecDeque<Step>>,
    /// Answers rendered so far (makes the ids of each `reply` unique).
    replies: std::sync::atomic::AtomicU64,
    script: Mutex<Script>,
    requests: Mutex<Vec<Value>>,
    gate: Semaphore,
}

/// A running mock provider.
pub struct MockHandle {
    /// The address it listens on.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl MockHandle {
    /// Stops the mock.
    pub fn abort(&self) {
        self.task.abort();
    }
}

/// Serves `script` on `listener` until the task is aborted.
pub fn spawn(listener: TcpListener, script: Script) -> std::io::Result<MockHandle> {
    let addr = listener.local_addr()?;
    let mock = Arc::new(Mock {
        queue: Mutex::new(script.responses.iter().cloned().collect()),
        replies: std::sync::atomic::AtomicU64::new(0),
        script: Mutex::new(script),
        requests: Mutex::new(Vec::new()),
        gate: Semaphore::new(0),
    });
    let router = Router::new()
        .route("/_mock/requests", get(requests))
        .route("/_mock/script", post(set_script))
        .route("/_mock/step", post(step))
        .route("/_mock/reset", post(reset))
        .fallback(serve_step)
        .with_state(mock);
    let task = tokio::spawn(async move {
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "mock provider failed");
        }
    });
    Ok(MockHandle { addr, task })
}

async fn requests(State(m): State<Arc<Mock>>) -> Response {
    let list = m.requests.lock().map(|r| r.clone()).unwrap_or_default();
    Json(Value::Array(list)).into_response()
}

async fn reset(State(m): State<Arc<Mock>>) -> Response {
    if let Ok(mut r) = m.requests.lock() {
        r.clear();
    }
    Json(json!({"ok": true})).into_response()
}

async fn step(State(m): State<Arc<Mock>>) -> Response {
    m.gate.add_permits(1);
    Json(json!({"ok": true})).into_response()
}

async fn set_script(State(m): State<Arc<Mock>>, req: Request<Body>) -> Response {
    let body = match read_capped(req.into_body(), 16 << 20).await {
        Ok(b) => b,
        Err(e) => return mock_error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let text = String::from_utf8_lossy(&body);
    match Script::parse(&text, "POST /_mock/script") {
        Ok(s) => {
            if let Ok(mut q) = m.queue.lock() {
                *q = s.responses.iter().cloned().collect();
            }
            if let Ok(mut cur) = m.script.lock() {
                *cur = s;
            }
            Json(json!({"ok": true})).into_response()
        }
        Err(e) => mock_error(StatusCode::BAD_REQUEST, &e.to_string()),
    }
}

fn mock_error(status: StatusCode, message: &str) -> Response {
    (
        status,
        Json(json!({"error": {"type": "mock_error", "message": message}})),
    )
        .into_response()
}

/// The first step that applies to the request; a sticky step stays in the queue. With
/// `repeat`, the list starts again once only sticky steps are left.
fn next_step(m: &Mock, seen: &Seen<'_>) -> Option<(Step, Option<PathBuf>)> {
    let mut q = m.queue.lock().ok()?;
    let script = m.script.lock().ok()?;
    if script.repeat && q.iter().all(|s| s.sticky) {
        *q = script.responses.iter().cloned().collect();
    }
    let pos = q.iter().position(|s| s.applies(seen))?;
    let step = if q.get(pos)?.sticky {
        q.get(pos)?.clone()
    } else {
        q.remove(pos)?
    };
    Some((step, script.base_dir.clone()))
}

async fn serve_step(State(m): State<Arc<Mock>>, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let body = read_capped(body, 64 << 20).await.unwrap_or_default();
    let headers: serde_json::Map<String, Value> = parts
        .headers
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v.to_str().unwrap_or_default())))
        .collect();
    let parsed = serde_json::from_slice::<Value>(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    let path = parts.uri.path().to_owned();
    let raw = String::from_utf8_lossy(&body);
    let seen = Seen {
        method: parts.method.as_str(),
        path: &path,
        raw: &raw,
        body: &parsed,
    };
    let strict = m.script.lock().is_ok_and(|s| s.strict_thinking);
    let refusal = if strict && ApiShape::of_path(&path) == Some(ApiShape::Messages) {
        thinking_violation(&parsed)
    } else {
        None
    };
    let chosen = if refusal.is_some() {
        None
    } else {
        next_step(&m, &seen)
    };
    if let Ok(mut r) = m.requests.lock() {
        let mut entry = json!({"method": parts.method.as_str(), "path": path, "headers": headers, "body": parsed, "raw": raw});
        if let Some(o) = entry.as_object_mut() {
            match (&chosen, &refusal) {
                (_, Some(reason)) => o.insert("rejected".into(), json!(reason)),
                (Some((step, _)), None) => o.insert("step".into(), json!(step.name)),
                (None, None) => o.insert("unanswered".into(), json!(true)),
            };
        }
        r.push(entry);
    }
    if let Some(reason) = refusal {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"type": "error", "error": {"type": "invalid_request_error", "message": reason}})),
        )
            .into_response();
    }
    let Some((step, base)) = chosen else {
        return mock_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "mock script exhausted: no response left for this request",
        );
    };
    if step.delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(step.delay_ms)).await;
    }
    let (content_type, events): (&str, Result<Vec<Bytes>, String>) = if let Some(file) = &step.file
    {
        let full = match &base {
            Some(b) if file.is_relative() => b.join(file),
            _ => file.clone(),
        };
        let is_sse = full.extension().is_some_and(|e| e == "sse");
        match std::fs::read(&full) {
            Ok(bytes) if is_sse => ("text/event-stream", Ok(split_events(&bytes))),
            Ok(bytes) => ("application/json", Ok(vec![Bytes::from(bytes)])),
            Err(e) => (
                "application/json",
                Err(format!("cannot read fixture {}: {e}", full.display())),
            ),
        }
    } else if let Some(r) = &step.reply {
        match ApiShape::of_path(&path) {
            Some(api) => {
                let n = m.replies.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                let rendered = reply::render(r, api, &parsed, n);
                (rendered.content_type, Ok(rendered.events))
            }
            None => (
                "application/json",
                Err(format!(
                    "a `reply` step answers /chat/completions, /messages or /responses, not {path}"
                )),
            ),
        }
    } else if let Some(v) = &step.json {
        ("application/json", Ok(vec![Bytes::from(v.to_string())]))
    } else if let Some(list) = &step.sse {
        let events = list
            .iter()
            .map(|e| {
                let mut s = e.trim_end_matches('\n').to_owned();
                s.push_str("\n\n");
                Bytes::from(s)
            })
            .collect();
        ("text/event-stream", Ok(events))
    } else {
        (
            "application/json",
            Err("a step needs `file`, `json`, `sse` or `reply`".to_owned()),
        )
    };
    let events = match events {
        Ok(e) => e,
        Err(reason) => return mock_error(StatusCode::INTERNAL_SERVER_ERROR, &reason),
    };
    let status = StatusCode::from_u16(step.status.unwrap_or(200)).unwrap_or(StatusCode::OK);
    let mut resp = if content_type == "text/event-stream" {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        let mock = Arc::clone(&m);
        tokio::spawn(async move {
            for (i, ev) in events.into_iter().enumerate() {
                if step.cut_after_events.is_some_and(|n| i >= n) {
                    // Let the events already sent reach the peer before the connection breaks
                    // (a reset can discard bytes the peer has not read yet).
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let _ = tx.send(Err(std::io::Error::other("scripted cut"))).await;
                    return;
                }
                if step.gate {
                    match mock.gate.acquire().await {
                        Ok(p) => p.forget(),
                        Err(_) => return,
                    }
                } else if i > 0 && step.event_delay_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(step.event_delay_ms)).await;
                }
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
        });
        Response::new(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    } else {
        Response::new(Body::from(
            events.into_iter().flatten().collect::<Vec<u8>>(),
        ))
    };
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    for (k, v) in &step.headers {
        if let (Ok(k), Ok(v)) = (HeaderName::try_from(k.as_str()), HeaderValue::from_str(v)) {
            resp.headers_mut().insert(k, v);
        }
    }
    resp
}

/// The Anthropic API's check with extended thinking on (see [`Script::strict_thinking`]): the
/// message it answers with, or `None` when the request passes.
fn thinking_violation(body: &Value) -> Option<String> {
    let mode = body.at("/thinking/type").and_then(Value::as_str);
    if !matches!(mode, Some("enabled" | "adaptive")) {
        return None;
    }
    let messages = body.get("messages").and_then(Value::as_array)?;
    let (index, last) = messages
        .iter()
        .enumerate()
        .rev()
        .find(|(_, m)| m.get("role").and_then(Value::as_str) == Some("assistant"))?;
    let blocks = last.get("content").and_then(Value::as_array)?;
    let kind = |b: &Value| {
        b.get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    if !blocks.iter().any(|b| kind(b) == "tool_use") {
        return None;
    }
    let first = blocks.first().map(kind).unwrap_or_default();
    if first == "thinking" || first == "redacted_thinking" {
        return None;
    }
    Some(format!(
        "messages.{index}.content.0.type: Expected `thinking` or `redacted_thinking`, but found \
         `{first}`. When `thinking` is enabled, a final `assistant` message must start with a \
         thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks). \
         We recommend you include thinking blocks from previous turns."
    ))
}

/// Splits an `.sse` fixture into its events, byte for byte (a trailing partial event is kept
/// as the last piece).
fn split_events(bytes: &[u8]) -> Vec<Bytes> {
    let mut framer = SseFramer::new(usize::MAX);
    let mut out: Vec<Bytes> = framer
        .push(bytes)
        .map(|b| b.into_iter().map(|e| e.raw).collect())
        .unwrap_or_default();
    let (blocks, rest) = framer.finish();
    out.extend(blocks.into_iter().map(|b| b.raw));
    if !rest.is_empty() {
        out.push(rest);
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn glob_matches_whole_names() {
        assert!(glob("claude-*haiku*", "claude-3-5-haiku-20241022"));
        assert!(glob("gpt-5*", "gpt-5"));
        assert!(glob("*", ""));
        assert!(glob("a*b*c", "aXbYc"));
        assert!(!glob("a*b*c", "aXbY"));
        assert!(!glob("gpt-5", "gpt-5-mini"));
        assert!(!glob("*-mini", "gpt-5"));
        assert!(!glob("ab*ba", "aba"));
    }

    fn mock(script: &str) -> Mock {
        let script = Script::parse(script, "test").unwrap();
        Mock {
            queue: Mutex::new(script.responses.iter().cloned().collect()),
            replies: std::sync::atomic::AtomicU64::new(0),
            script: Mutex::new(script),
            requests: Mutex::new(Vec::new()),
            gate: Semaphore::new(0),
        }
    }

    fn pick(m: &Mock, body: &Value) -> Option<String> {
        let raw = body.to_string();
        let seen = Seen {
            method: "POST",
            path: "/v1/messages",
            raw: &raw,
            body,
        };
        next_step(m, &seen).map(|(s, _)| s.name.unwrap_or_default())
    }

    #[test]
    fn sticky_steps_answer_their_shape_and_the_sequence_goes_on() {
        let m = mock(
            r#"{"responses": [
                {"name": "title", "sticky": true, "when": {"model": "*haiku*"}, "json": {}},
                {"name": "one", "when": {"tools": true}, "json": {}},
                {"name": "two", "json": {}}
            ]}"#,
        );
        let main = json!({"model": "claude-sonnet", "tools": [{"name": "Bash"}]});
        let side = json!({"model": "claude-haiku", "tools": []});
        assert_eq!(pick(&m, &side).as_deref(), Some("title"));
        assert_eq!(pick(&m, &main).as_deref(), Some("one"));
        assert_eq!(pick(&m, &side).as_deref(), Some("title"));
        assert_eq!(pick(&m, &main).as_deref(), Some("two"));
        assert_eq!(pick(&m, &main), None, "the sequence is used up");
        assert_eq!(pick(&m, &side).as_deref(), Some("title"));
    }

    #[test]
    fn repeat_restarts_when_only_sticky_steps_are_left() {
        let m = mock(
            r#"{"repeat": true, "responses": [
                {"name": "s", "sticky": true, "when": {"contains": "side"}, "json": {}},
                {"name": "a", "json": {}}
            ]}"#,
        );
        let body = json!({"model": "x"});
        assert_eq!(pick(&m, &body).as_deref(), Some("a"));
        assert_eq!(pick(&m, &body).as_deref(), Some("a"));
        assert_eq!(pick(&m, &json!({"m": "side"})).as_deref(), Some("s"));
    }

    #[test]
    fn strict_thinking_wants_the_thinking_block_back() {
        let ok = json!({"thinking": {"type": "adaptive"}, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                              {"type": "tool_use", "id": "1", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "1", "content": "x"}]}]});
        assert_eq!(thinking_violation(&ok), None);
        let mut dropped = ok.clone();
        if let Some(blocks) = dropped
            .pointer_mut("/messages/1/content")
            .and_then(Value::as_array_mut)
        {
            blocks.remove(0);
        }
        let reason = thinking_violation(&dropped).expect("refused");
        assert!(reason.starts_with("messages.1.content.0.type"), "{reason}");
        let mut off = dropped.clone();
        if let Some(o) = off.as_object_mut() {
            o.remove("thinking");
        }
        assert_eq!(thinking_violation(&off), None, "thinking off: no check");
    }

    #[test]
    fn additional_tools_items_declare_tools() {
        assert!(declares_tools(
            &json!({"input": [{"type": "additional_tools", "tools": []}]})
        ));
        assert!(!declares_tools(&json!({"tools": [], "input": "hi"})));
    }
}
