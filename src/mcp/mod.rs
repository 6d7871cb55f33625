//! The MCP front (DESIGN.md §10): the agent's MCP servers (Streamable HTTP) behind
//! `/mcp/NAME` on the data plane, under the same decision function as model-emitted calls.
//!
//! ```text
//! POST /mcp/NAME ─▶ read (capped) ─▶ one JSON-RPC message ─▶ era + session ─▶ run, person
//!   ├─ initialize            ─▶ upstream; a turnguard session (Mcp-Session-Id) bound to the
//!   │                           run, the person, the client's capabilities, the revision
//!   ├─ tools/list            ─▶ upstream ─▶ only tools the person may call, host annotations
//!   ├─ tools/call            ─▶ [`call`]: visibility ─▶ ticket ─▶ admission (§B, the model
//!   │                           path's `decide_choice`) ─▶ §E ask ─▶ effect claim ─▶ upstream
//!   │                           ─▶ §G checks ─▶ record result + sticky trust ─▶ agent
//!   └─ anything else         ─▶ relayed byte for byte (notifications, responses to
//!                               server-initiated requests, unknown methods, streams)
//! GET /mcp/NAME ─▶ the session's server-to-client stream, relayed   DELETE ─▶ session ends
//! ```
//!
//! Protocol revisions: the `initialize` handshake of 2025-03-26, 2025-06-18 and 2025-11-25
//! (sessions, `Mcp-Session-Id`, the GET stream, server-initiated requests relayed), and the
//! stateless 2026-07-28 (`server/discover`, per-request `_meta` version and capabilities,
//! `input_required`). A request names its revision: `initialize` negotiates one for its
//! session; a modern request carries `io.modelcontextprotocol/protocolVersion` in `_meta`.
//!
//! Errors turnguard authors here are JSON-RPC errors: MCP's own codes where the MCP spec names
//! one (`-32602` unknown tool, `-32021` missing client capability, `-32022` unsupported
//! revision, `-32020` header mismatch, `-32600` bad request), else turnguard's application
//! code `-(31000 + HTTP status of the OpenWOP code)` (e.g. `-31403` for `forbidden`), with the
//! OpenWOP envelope `{error, message, details}` as `data` and `message` starting with
//! `turnguard <code>:` (DESIGN.md §7).

pub mod call;
pub mod clarify;
pub mod list;
pub mod relay;
pub mod session;

use crate::strict_json::Lookup as _;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use serde_json::{json, Value};

use crate::config::McpServer;
use crate::error::WireError;
use crate::journal::McpReader;
use crate::request::{RequestCtx, RunMode};
use crate::state::AppState;
use session::{Era, Session};

/// `_meta` key of the request's protocol revision (2026-07-28).
pub const VERSION_META: &str = "io.modelcontextprotocol/protocolVersion";
/// `_meta` key of the client's capabilities (2026-07-28).
pub const CAPABILITIES_META: &str = "io.modelcontextprotocol/clientCapabilities";

/// MCP's JSON-RPC error codes turnguard uses (MCP `basic/index` "Error Codes").
pub mod code {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
    pub const HEADER_MISMATCH: i64 = -32020;
    pub const MISSING_CLIENT_CAPABILITY: i64 = -32021;
    pub const UNSUPPORTED_PROTOCOL_VERSION: i64 = -32022;
}

/// The MCP front's state: sessions, the tools each server listed, pending §E asks and a
/// read-only journal connection for tickets.
pub struct McpFront {
    pub state: Arc<AppState>,
    pub sessions: session::Sessions,
    pub tools: list::ServerTools,
    pub asks: clarify::Asks,
    pub reader: McpReader,
}

impl McpFront {
    /// The front over `state`'s configured MCP servers.
    ///
    /// Errors: the journal cannot be opened for reading.
    pub fn new(state: Arc<AppState>) -> Result<Arc<Self>, crate::journal::JournalError> {
        let reader = state.journal.mcp_reader()?;
        Ok(Arc::new(Self {
            state,
            sessions: session::Sessions::default(),
            tools: list::ServerTools::default(),
            asks: clarify::Asks::default(),
            reader,
        }))
    }

    /// `POST / GET / DELETE /mcp/{name}`, to merge into the data-plane router.
    pub fn routes<S: Clone + Send + Sync + 'static>(self: &Arc<Self>) -> Router<S> {
        Router::new()
            .route(
                "/mcp/{name}",
                post(handle_post).get(handle_get).delete(handle_delete),
            )
            .with_state(Arc::clone(self))
    }
}

/// One JSON-RPC message from the client, with what the front derived from its request.
pub struct Inbound {
    /// The server's configured name (`/mcp/NAME`).
    pub server_name: String,
    pub server: McpServer,
    /// The request's headers as received.
    pub headers: HeaderMap,
    /// The body as received.
    pub raw: Bytes,
    /// The body, parsed.
    pub message: Value,
    /// Request id, run identity and arrival time (DESIGN.md §2).
    pub ctx: RequestCtx,
    /// `Turnguard-Mode`.
    pub mode: RunMode,
    /// The verified acting person (`sub`).
    pub person: Option<String>,
    /// The session (handshake era) or `None` (2026-07-28, or `initialize` itself).
    pub session: Option<Session>,
    /// The revision era of this request.
    pub era: Era,
    /// The client's declared capabilities (from `initialize`, or this request's `_meta`).
    pub capabilities: Value,
}

impl Inbound {
    /// The JSON-RPC id (`Null` for a notification).
    pub fn id(&self) -> Value {
        self.message.get("id").cloned().unwrap_or(Value::Null)
    }

    /// `params` (an empty object when absent).
    pub fn params(&self) -> Value {
        self.message
            .get("params")
            .cloned()
            .unwrap_or_else(|| json!({}))
    }

    /// The run this message belongs to, if any.
    pub fn run_id(&self) -> Option<&str> {
        self.ctx.run.run_id.as_deref()
    }

    /// Who may read this call's recorded result again ([`crate::request::reader_of`]).
    pub fn reader(&self) -> String {
        crate::request::reader_of(self.person.as_deref())
    }
}

/// A JSON-RPC error response.
pub fn rpc_error(id: &Value, code: i64, message: &str, data: Option<Value>) -> Value {
    let error = match data {
        Some(d) => json!({"code": code, "message": message, "data": d}),
        None => json!({"code": code, "message": message}),
    };
    json!({"jsonrpc": "2.0", "id": id, "error": error})
}

/// A JSON-RPC error turnguard authored for an OpenWOP `code` with HTTP status `status`:
/// application code `-(31000 + status)`, the OpenWOP envelope as `data` (DESIGN.md §7).
pub fn openwop_error(id: &Value, status: u16, code: &str, message: &str, details: Value) -> Value {
    rpc_error(
        id,
        -(31_000 + i64::from(status)),
        &format!("turnguard {code}: {message}"),
        Some(json!({"error": code, "message": message, "details": details})),
    )
}

/// [`openwop_error`] for a [`WireError`].
pub fn wire_error(id: &Value, e: &WireError) -> Value {
    let (status, code, _) = e.parts();
    openwop_error(id, status.as_u16(), code, &e.to_string(), e.details())
}

/// A JSON response with `status`.
pub fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut r = (status, body.to_string()).into_response();
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The MCP "Unknown tool" protocol error (MCP tools.mdx "Error Handling"): the same answer for
/// a tool the server does not have and one the caller may not use (non-disclosing).
pub fn unknown_tool(id: &Value, name: &str) -> Response {
    json_response(
        StatusCode::OK,
        &rpc_error(
            id,
            code::INVALID_PARAMS,
            &format!("Unknown tool: {}", crate::admission::sanitize_label(name)),
            None,
        ),
    )
}

fn not_configured(name: &str) -> Response {
    let e = WireError::RouteNotFound {
        method: "MCP".into(),
        path: format!("/mcp/{}", crate::admission::sanitize_label(name)),
    };
    json_response(StatusCode::NOT_FOUND, &wire_error(&Value::Null, &e))
}

async fn handle_post(
    State(front): State<Arc<McpFront>>,
    Path(name): Path<String>,
    req: Request<Body>,
) -> Response {
    // Boxed: the decision path holds a round record and its unit of work across awaits.
    let resp = Box::pin(post_inner(&front, &name, req)).await;
    front.state.metrics.request(
        crate::metrics::ApiLabel::Mcp,
        resp.status().as_u16(),
        is_sse(&resp),
    );
    resp
}

async fn post_inner(front: &Arc<McpFront>, name: &str, req: Request<Body>) -> Response {
    let Some(server) = front.state.config.mcp.get(name).cloned() else {
        return not_configured(name);
    };
    let (parts, body) = req.into_parts();
    let (raw, message) = match read_message(front, &parts, body).await {
        Ok(m) => m,
        Err(resp) => return resp,
    };
    let id = message.get("id").cloned().unwrap_or(Value::Null);
    let method = message
        .get("method")
        .and_then(Value::as_str)
        .map(str::to_owned);
    // Verified and journaled as on the model APIs: a token the agent presents here never
    // approves either.
    let person = match crate::proxy::acting_person(&front.state, &parts.headers).await {
        Ok(p) => p,
        Err(e) => return json_response(e.parts().0, &wire_error(&id, &e)),
    };
    let mode = match crate::request::run_mode(&parts.headers) {
        Ok(m) => m,
        Err(e) => return json_response(StatusCode::BAD_REQUEST, &wire_error(&id, &e)),
    };
    let mut ctx = RequestCtx::of(&parts.headers, &parts.extensions);
    let (era, session, capabilities) = match era_of(
        front,
        name,
        &id,
        method.as_deref(),
        &parts.headers,
        &message,
    ) {
        Ok(e) => e,
        Err(resp) => return *resp,
    };
    if let Err(resp) = bind_run(session.as_ref(), person.as_ref(), &mut ctx, &id, mode) {
        return *resp;
    }
    let inbound = Inbound {
        server_name: name.to_owned(),
        server,
        headers: parts.headers,
        raw,
        message,
        ctx,
        mode,
        person,
        session,
        era,
        capabilities,
    };
    // A client's answer to one of turnguard's own asks (§E, handshake era) stays here.
    if method.is_none() {
        if let Some(s) = &inbound.session {
            if front.asks.answer(&s.id, &inbound.message) {
                let mut r = Response::new(Body::empty());
                *r.status_mut() = StatusCode::ACCEPTED;
                return r;
            }
        }
    }
    match method.as_deref() {
        Some("initialize") => session::initialize(front, inbound).await,
        // The methods turnguard decides are requests: one with no id (a notification), a
        // null id or one that is not a string or a number is refused, never relayed past the
        // decision as it came.
        Some(m @ ("tools/list" | "tools/call"))
            if !matches!(inbound.id(), Value::String(_) | Value::Number(_)) =>
        {
            let e = WireError::InvalidRequest {
                reason: format!("`{m}` needs an `id` that is a string or a number"),
            };
            json_response(StatusCode::BAD_REQUEST, &wire_error(&Value::Null, &e))
        }
        Some("tools/list") => list::handle(front, inbound).await,
        Some("tools/call") => call::handle(front, inbound).await,
        _ => relay::pass(front, inbound).await,
    }
}

/// The message of a POST: the same capped, deadlined read as the model APIs, then JSON
/// (a parse error is JSON-RPC `-32700`); a batch is refused (removed in MCP 2025-06-18).
async fn read_message(
    front: &McpFront,
    parts: &http::request::Parts,
    body: Body,
) -> Result<(Bytes, Value), Response> {
    // The same capped, deadlined read as the model APIs, then the concurrency permit.
    let raw = match crate::proxy::read_request(&front.state, parts, body).await {
        Ok(b) => b,
        Err(e) => {
            let (status, _, _) = e.parts();
            return Err(json_response(status, &wire_error(&Value::Null, &e)));
        }
    };
    // Strict: a key twice is refused (`strict_json`), so what turnguard decides on and what
    // the server reads from the same bytes cannot differ.
    let message: Value = match crate::strict_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => {
            return Err(json_response(
                StatusCode::BAD_REQUEST,
                &rpc_error(
                    &Value::Null,
                    code::PARSE_ERROR,
                    &format!("Parse error: {e}"),
                    None,
                ),
            ))
        }
    };
    if message.is_array() {
        return Err(json_response(
            StatusCode::BAD_REQUEST,
            &rpc_error(
                &Value::Null,
                code::INVALID_REQUEST,
                "turnguard: JSON-RPC batches are not accepted (removed in MCP 2025-06-18); send one message per POST",
                None,
            ),
        ));
    }
    Ok((raw, message))
}

/// The revision era of a request and its session: `initialize` starts a handshake; a
/// 2026-07-28 request names its version in `_meta` (checked, with its capabilities); else
/// the `Mcp-Session-Id` names a live session of this server (404 when it ended).
fn era_of(
    front: &McpFront,
    name: &str,
    id: &Value,
    method: Option<&str>,
    headers: &HeaderMap,
    message: &Value,
) -> Result<(Era, Option<Session>, Value), Box<Response>> {
    let sid = headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let modern_version = message
        .at("/params/_meta")
        .and_then(|m| m.get(VERSION_META))
        .and_then(Value::as_str)
        .map(str::to_owned);
    if method == Some("initialize") {
        Ok((Era::Handshake, None, Value::Null))
    } else if let Some(version) = &modern_version {
        session::check_modern(id, version, headers, message).map_err(Box::new)?;
        let caps = message
            .at("/params/_meta")
            .and_then(|m| m.get(CAPABILITIES_META))
            .cloned()
            .unwrap_or(Value::Null);
        Ok((Era::Modern, None, caps))
    } else if let Some(sid) = sid {
        match front.sessions.get(&sid, name) {
            Some(s) => {
                let caps = s.capabilities.clone();
                Ok((Era::Handshake, Some(s), caps))
            }
            None => Err(Box::new(json_response(
                    StatusCode::NOT_FOUND,
                    &rpc_error(
                        id,
                        code::INVALID_REQUEST,
                        "turnguard: no such MCP session (it ended, or turnguard restarted); initialize a new one",
                        None,
                    ),
                ))),
        }
    } else {
        Err(Box::new(json_response(
            StatusCode::BAD_REQUEST,
            &rpc_error(
                id,
                code::INVALID_REQUEST,
                "turnguard: a request needs an `Mcp-Session-Id` from `initialize`, or `_meta` `io.modelcontextprotocol/protocolVersion` (2026-07-28)",
                None,
            ),
        )))
    }
}

/// The run of a request: its own headers, or its session's binding (never two different
/// runs, never another person's session); run ids checked; a replay needs a run.
fn bind_run(
    session: Option<&Session>,
    person: Option<&String>,
    ctx: &mut RequestCtx,
    id: &Value,
    mode: RunMode,
) -> Result<(), Box<Response>> {
    if let Some(s) = session {
        if s.person.as_ref() != person {
            let e = WireError::Unauthenticated {
                reason: "this MCP session belongs to another acting person".into(),
            };
            return Err(Box::new(json_response(
                StatusCode::FORBIDDEN,
                &wire_error(id, &e),
            )));
        }
        match (&ctx.run.run_id, &s.run.run_id) {
            (Some(a), Some(b)) if a != b => {
                let e = WireError::InvalidRequest {
                    reason: format!(
                        "this MCP session is bound to another run than `Turnguard-Run: {}`",
                        crate::admission::sanitize_label(a)
                    ),
                };
                return Err(Box::new(json_response(
                    StatusCode::BAD_REQUEST,
                    &wire_error(id, &e),
                )));
            }
            (None, Some(_)) => ctx.run = s.run.clone(),
            _ => {}
        }
    }
    if let Err(e) = crate::proxy::check_run_ids(&ctx.run) {
        return Err(Box::new(json_response(
            StatusCode::BAD_REQUEST,
            &wire_error(id, &e),
        )));
    }
    if mode == RunMode::Replay && ctx.run.run_id.is_none() {
        let e = WireError::InvalidRequest {
            reason: "`Turnguard-Mode: replay` needs `Turnguard-Run`".into(),
        };
        return Err(Box::new(json_response(
            StatusCode::BAD_REQUEST,
            &wire_error(id, &e),
        )));
    }
    Ok(())
}

async fn handle_get(
    State(front): State<Arc<McpFront>>,
    Path(name): Path<String>,
    req: Request<Body>,
) -> Response {
    let resp = session::stream(&front, &name, req.headers()).await;
    front.state.metrics.request(
        crate::metrics::ApiLabel::Mcp,
        resp.status().as_u16(),
        is_sse(&resp),
    );
    resp
}

async fn handle_delete(
    State(front): State<Arc<McpFront>>,
    Path(name): Path<String>,
    req: Request<Body>,
) -> Response {
    let resp = session::end(&front, &name, req.headers()).await;
    front
        .state
        .metrics
        .request(crate::metrics::ApiLabel::Mcp, resp.status().as_u16(), false);
    resp
}

fn is_sse(resp: &Response) -> bool {
    resp.headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}
