//! `turnguard mock-mcp`: a scripted MCP server (Streamable HTTP) for tests and the offline
//! demo, in the mock provider's spirit: a seam that scripts the agent's MCP server and counts
//! what it executed. It plays the upstream only; it is never a way around admission.
//!
//! It speaks both eras of Streamable HTTP: the `initialize` handshake with an
//! `Mcp-Session-Id` (revisions 2025-03-26, 2025-06-18, 2025-11-25) and the stateless
//! per-request `_meta` of revision 2026-07-28 (`server/discover`). It serves `tools/list` from
//! the script and answers `tools/call` with the tool's scripted `result`, counting one
//! execution per call that reached it (before any gate or delay).
//!
//! A script is JSON: `{"tools": [TOOL, …], "sessions": true}`. A TOOL is
//! `{"name", "description"?, "inputSchema"?, "outputSchema"?, "annotations"?, "result"?,
//! "raw_result"?, "sse"?, "gate"?, "delay_ms"?}`: `result` is the `CallToolResult` to answer
//! with (default: one text block `ok`); `raw_result` is its JSON text, served as written (bytes
//! a `Value` cannot hold: a key twice, malformed JSON) and preferred to `result`; `sse` answers
//! as an SSE stream with a `notifications/progress` before the result, `gate` holds the answer
//! until one `POST /_mock/step`, `delay_ms` waits first.
//! `sessions: false` mints no `Mcp-Session-Id`.
//!
//! Control endpoints: `GET /_mock/calls` (`{"executions": {tool: n}, "requests": [...]}`: every
//! JSON-RPC message received, in order, with its method, params, session and selected
//! headers), `POST /_mock/script` (replace the script), `POST /_mock/step` (release one gated
//! answer), `POST /_mock/reset` (forget executions and requests).

use crate::strict_json::Lookup as _;
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http::{HeaderValue, Method, Request, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::body::read_capped;

/// Revisions the mock's `initialize` accepts (else it answers with the newest of them).
const HANDSHAKE_REVISIONS: [&str; 3] = ["2025-03-26", "2025-06-18", "2025-11-25"];
/// The stateless revision.
const MODERN_REVISION: &str = "2026-07-28";
const VERSION_META: &str = "io.modelcontextprotocol/protocolVersion";

/// A mock MCP script (see the module docs).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpScript {
    /// The tools `tools/list` serves, in order.
    #[serde(default)]
    pub tools: Vec<MockTool>,
    /// Mint an `Mcp-Session-Id` on `initialize` (and require it after). Default true.
    #[serde(default = "yes")]
    pub sessions: bool,
}

fn yes() -> bool {
    true
}

impl Default for McpScript {
    fn default() -> Self {
        Self {
            tools: Vec::new(),
            sessions: true,
        }
    }
}

/// One scripted tool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockTool {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default, rename = "inputSchema")]
    pub input_schema: Option<Value>,
    #[serde(default, rename = "outputSchema")]
    pub output_schema: Option<Value>,
    #[serde(default)]
    pub annotations: Option<Value>,
    /// The `CallToolResult` answered.
    #[serde(default)]
    pub result: Option<Value>,
    /// The `CallToolResult`'s JSON text, served as written (wins over `result`).
    #[serde(default)]
    pub raw_result: Option<String>,
    /// Answer as SSE, with a progress notification first.
    #[serde(default)]
    pub sse: bool,
    /// Hold the answer until one `POST /_mock/step`.
    #[serde(default)]
    pub gate: bool,
    /// Wait before answering, milliseconds.
    #[serde(default)]
    pub delay_ms: u64,
}

impl McpScript {
    /// Loads a script file.
    pub fn load(path: &Path) -> Result<Self, crate::mock_provider::ScriptError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| crate::mock_provider::ScriptError::Read(path.to_owned(), e.to_string()))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses script JSON; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, crate::mock_provider::ScriptError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| {
            crate::mock_provider::ScriptError::Invalid {
                file: origin.to_owned(),
                path: e.path().to_string(),
                reason: e.inner().to_string(),
            }
        })
    }
}

struct Mock {
    script: Mutex<McpScript>,
    executions: Mutex<BTreeMap<String, u64>>,
    requests: Mutex<Vec<Value>>,
    sessions: Mutex<HashSet<String>>,
    gate: Semaphore,
}

/// A running mock MCP server.
pub struct McpMockHandle {
    /// The address it listens on; the MCP endpoint is any path but `/_mock/*`.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl McpMockHandle {
    /// Stops the mock.
    pub fn abort(&self) {
        self.task.abort();
    }
}

/// Serves `script` on `listener` until the task is aborted.
pub fn spawn(listener: TcpListener, script: McpScript) -> std::io::Result<McpMockHandle> {
    let addr = listener.local_addr()?;
    let mock = Arc::new(Mock {
        script: Mutex::new(script),
        executions: Mutex::new(BTreeMap::new()),
        requests: Mutex::new(Vec::new()),
        sessions: Mutex::new(HashSet::new()),
        gate: Semaphore::new(0),
    });
    let router = Router::new()
        .route("/_mock/calls", get(calls))
        .route("/_mock/script", post(set_script))
        .route("/_mock/step", post(step))
        .route("/_mock/reset", post(reset))
        .fallback(serve)
        .with_state(mock);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "mock MCP server failed");
        }
    });
    Ok(McpMockHandle { addr, task })
}

async fn calls(State(m): State<Arc<Mock>>) -> Response {
    let executions = m.executions.lock().map(|e| e.clone()).unwrap_or_default();
    let requests = m.requests.lock().map(|r| r.clone()).unwrap_or_default();
    Json(json!({"executions": executions, "requests": requests})).into_response()
}

async fn reset(State(m): State<Arc<Mock>>) -> Response {
    if let Ok(mut e) = m.executions.lock() {
        e.clear();
    }
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
        Err(e) => return plain(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    match McpScript::parse(&String::from_utf8_lossy(&body), "POST /_mock/script") {
        Ok(s) => {
            if let Ok(mut cur) = m.script.lock() {
                *cur = s;
            }
            Json(json!({"ok": true})).into_response()
        }
        Err(e) => plain(StatusCode::BAD_REQUEST, &e.to_string()),
    }
}

fn plain(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({"error": message}))).into_response()
}

fn rpc_error(id: &Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    let mut r = (status, v.to_string()).into_response();
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

async fn serve(State(m): State<Arc<Mock>>, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let session = parts
        .headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    match parts.method {
        Method::GET => return plain(StatusCode::METHOD_NOT_ALLOWED, "no standalone stream"),
        Method::DELETE => {
            if let (Some(s), Ok(mut set)) = (&session, m.sessions.lock()) {
                set.remove(s);
            }
            return StatusCode::OK.into_response();
        }
        Method::POST => {}
        _ => return plain(StatusCode::METHOD_NOT_ALLOWED, "POST, GET or DELETE"),
    }
    let body = read_capped(body, 16 << 20).await.unwrap_or_default();
    let Ok(msg) = serde_json::from_slice::<Value>(&body) else {
        return json_response(
            StatusCode::BAD_REQUEST,
            &rpc_error(&Value::Null, -32700, "Parse error"),
        );
    };
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let method = msg.get("method").and_then(Value::as_str).map(str::to_owned);
    let id = msg.get("id").cloned();
    let params = msg.get("params").cloned().unwrap_or(Value::Null);
    if let Ok(mut r) = m.requests.lock() {
        r.push(json!({
            "method": method, "id": id, "params": params, "session": session,
            "result": msg.get("result"), "error": msg.get("error"),
            "headers": {
                "mcp-protocol-version": header("mcp-protocol-version"),
                "mcp-method": header("mcp-method"),
                "mcp-name": header("mcp-name"),
                "authorization": header("authorization"),
                "turnguard-run": header("turnguard-run"),
            },
        }));
    }
    let (Some(method), Some(id)) = (method, id) else {
        // A notification or a response: accepted, nothing to answer.
        return StatusCode::ACCEPTED.into_response();
    };
    let modern = params
        .at("/_meta")
        .and_then(|m| m.get(VERSION_META))
        .and_then(Value::as_str)
        .is_some();
    let script = m.script.lock().map(|s| s.clone()).unwrap_or_default();
    if script.sessions && !modern && method != "initialize" && method != "server/discover" {
        let known = session
            .as_ref()
            .is_some_and(|s| m.sessions.lock().is_ok_and(|set| set.contains(s)));
        if !known {
            return json_response(
                StatusCode::NOT_FOUND,
                &rpc_error(&id, -32600, "unknown or missing Mcp-Session-Id"),
            );
        }
    }
    let complete = |mut result: Value| {
        if modern {
            if let Some(o) = result.as_object_mut() {
                o.entry("resultType").or_insert(json!("complete"));
            }
        }
        json!({"jsonrpc": "2.0", "id": id, "result": result})
    };
    match method.as_str() {
        "initialize" => {
            let asked = params
                .get("protocolVersion")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let version = if HANDSHAKE_REVISIONS.contains(&asked) {
                asked
            } else {
                HANDSHAKE_REVISIONS[2]
            };
            let result = json!({
                "protocolVersion": version,
                "capabilities": {"tools": {"listChanged": true}},
                "serverInfo": {"name": "turnguard-mock-mcp", "version": env!("CARGO_PKG_VERSION")},
            });
            let mut r = json_response(StatusCode::OK, &complete(result));
            if script.sessions {
                let sid = uuid::Uuid::new_v4().to_string();
                if let Ok(mut set) = m.sessions.lock() {
                    set.insert(sid.clone());
                }
                if let Ok(v) = HeaderValue::from_str(&sid) {
                    r.headers_mut().insert("mcp-session-id", v);
                }
            }
            r
        }
        "server/discover" => {
            let mut versions: Vec<&str> = HANDSHAKE_REVISIONS.to_vec();
            versions.push(MODERN_REVISION);
            json_response(
                StatusCode::OK,
                &complete(json!({
                    "supportedVersions": versions,
                    "capabilities": {"tools": {}},
                    "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "turnguard-mock-mcp", "version": env!("CARGO_PKG_VERSION")}},
                    "ttlMs": 0, "cacheScope": "private",
                })),
            )
        }
        "ping" => json_response(StatusCode::OK, &complete(json!({}))),
        "tools/list" => {
            let tools: Vec<Value> = script
                .tools
                .iter()
                .map(|t| {
                    let mut v = json!({
                        "name": t.name,
                        "inputSchema": t.input_schema.clone().unwrap_or_else(|| json!({"type": "object"})),
                    });
                    if let Some(d) = &t.description {
                        if let Some(o) = v.as_object_mut() {
                            o.insert("description".into(), json!(d));
                        }
                    }
                    if let Some(o) = &t.output_schema {
                        if let Some(m) = v.as_object_mut() {
                            m.insert("outputSchema".into(), o.clone());
                        }
                    }
                    if let Some(a) = &t.annotations {
                        if let Some(o) = v.as_object_mut() {
                            o.insert("annotations".into(), a.clone());
                        }
                    }
                    v
                })
                .collect();
            let result = if modern {
                json!({"tools": tools, "ttlMs": 0, "cacheScope": "private"})
            } else {
                json!({"tools": tools})
            };
            json_response(StatusCode::OK, &complete(result))
        }
        "tools/call" => {
            let name = params
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let Some(tool) = script.tools.iter().find(|t| t.name == name).cloned() else {
                return json_response(
                    StatusCode::OK,
                    &rpc_error(&id, -32602, &format!("Unknown tool: {name}")),
                );
            };
            if let Ok(mut e) = m.executions.lock() {
                *e.entry(tool.name.clone()).or_default() += 1;
            }
            if tool.delay_ms > 0 {
                tokio::time::sleep(Duration::from_millis(tool.delay_ms)).await;
            }
            if tool.gate {
                match m.gate.acquire().await {
                    Ok(p) => p.forget(),
                    Err(_) => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
                }
            }
            let result = tool
                .result
                .clone()
                .unwrap_or_else(|| json!({"content": [{"type": "text", "text": "ok"}]}));
            let answer = match &tool.raw_result {
                Some(raw) => format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{raw}}}"#),
                None => complete(result).to_string(),
            };
            if !tool.sse {
                let mut r = (StatusCode::OK, answer).into_response();
                r.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                return r;
            }
            let token = params
                .at("/_meta/progressToken")
                .cloned()
                .unwrap_or(json!("mock"));
            let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
                "params": {"progressToken": token, "progress": 1, "total": 2}});
            let events: Vec<Result<Bytes, std::io::Error>> = vec![
                Ok(Bytes::from(format!("event: message\ndata: {progress}\n\n"))),
                Ok(Bytes::from(format!("event: message\ndata: {answer}\n\n"))),
            ];
            let mut r = Response::new(Body::from_stream(futures_util::stream::iter(events)));
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            r
        }
        other => json_response(
            StatusCode::OK,
            &rpc_error(&id, -32601, &format!("Method not found: {other}")),
        ),
    }
}
