//! Protocol revisions and sessions of the MCP front.
//!
//! - **Handshake era** (2025-03-26, 2025-06-18, 2025-11-25): `initialize` is forwarded; a
//!   client asking for a revision turnguard does not speak is offered the newest it does (the
//!   server's counter-offer, MCP lifecycle "Version Negotiation"); the server's answer must
//!   name a revision turnguard speaks, else the client gets `-32602` with the supported list.
//!   turnguard mints its own `Mcp-Session-Id` (random, never the client's or the server's),
//!   bound to the server, the run (`Turnguard-Run` on `initialize`), the acting person, the
//!   client's capabilities and the revision; the server's session id stays inside. `GET`
//!   relays the session's server-to-client stream, `DELETE` ends both sessions. Sessions live
//!   in memory: after a restart a client gets 404 and initializes again (MCP transports:
//!   "the client MUST start a new session").
//! - **2026-07-28**: no handshake and no session; each request names its revision and
//!   capabilities in `_meta`, checked here ([`check_modern`]).

use crate::strict_json::Lookup as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use serde_json::{json, Value};

use super::{code, json_response, rpc_error, wire_error, Inbound, McpFront};
use crate::journal::RunKey;

/// Handshake-era revisions turnguard speaks, oldest first.
pub const HANDSHAKE_REVISIONS: [&str; 3] = ["2025-03-26", "2025-06-18", "2025-11-25"];
/// Stateless revisions turnguard speaks.
pub const MODERN_REVISIONS: [&str; 1] = ["2026-07-28"];
/// Sessions kept at most; the least recently used goes first.
const MAX_SESSIONS: usize = 10_000;

/// Which shape of the protocol a request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Era {
    /// `initialize` and sessions (2025-03-26 … 2025-11-25).
    Handshake,
    /// Per-request `_meta` (2026-07-28).
    Modern,
}

/// A handshake-era session as turnguard keeps it.
#[derive(Debug, Clone)]
pub struct Session {
    /// turnguard's session id (what the client sends).
    pub id: String,
    /// The MCP server's configured name.
    pub server: String,
    /// The server's own session id, if it minted one.
    pub upstream: Option<String>,
    /// The negotiated revision.
    pub version: String,
    /// The client's `capabilities` from `initialize`.
    pub capabilities: Value,
    /// The run the session is bound to (all `None`: none).
    pub run: RunKey,
    /// The acting person who initialized it.
    pub person: Option<String>,
    last_used: Instant,
}

/// The session table (in memory, bounded).
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    /// The session `id` of server `server`, touched.
    pub fn get(&self, id: &str, server: &str) -> Option<Session> {
        let mut map = self.map.lock().ok()?;
        let s = map.get_mut(id).filter(|s| s.server == server)?;
        s.last_used = Instant::now();
        Some(s.clone())
    }

    fn insert(&self, s: Session) {
        if let Ok(mut map) = self.map.lock() {
            if map.len() >= MAX_SESSIONS {
                if let Some(oldest) = map
                    .values()
                    .min_by_key(|s| s.last_used)
                    .map(|s| s.id.clone())
                {
                    map.remove(&oldest);
                }
            }
            map.insert(s.id.clone(), s);
        }
    }

    fn remove(&self, id: &str) -> Option<Session> {
        self.map.lock().ok()?.remove(id)
    }
}

/// Checks a 2026-07-28 request: a revision turnguard speaks (`-32022` with the supported
/// list), an `MCP-Protocol-Version` header equal to it and `Mcp-Method` / `Mcp-Name` headers
/// equal to the body's `method` / `params.name` (`-32020` `HeaderMismatch`): turnguard decides
/// on the body, so the headers an intermediary or the server may route by must say the same.
#[allow(clippy::result_large_err)]
pub fn check_modern(
    id: &Value,
    version: &str,
    headers: &HeaderMap,
    message: &Value,
) -> Result<(), Response> {
    if !MODERN_REVISIONS.contains(&version) {
        let mut supported: Vec<&str> = HANDSHAKE_REVISIONS.to_vec();
        supported.extend(MODERN_REVISIONS);
        return Err(json_response(
            StatusCode::BAD_REQUEST,
            &rpc_error(
                id,
                code::UNSUPPORTED_PROTOCOL_VERSION,
                "Unsupported protocol version",
                Some(json!({"supported": supported, "requested": version})),
            ),
        ));
    }
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let mismatch = |what: &str| {
        Err(json_response(
            StatusCode::BAD_REQUEST,
            &rpc_error(
                id,
                code::HEADER_MISMATCH,
                &format!("Header mismatch: {what} does not match the request body"),
                None,
            ),
        ))
    };
    if header("mcp-protocol-version").is_some_and(|h| h != version) {
        return mismatch("MCP-Protocol-Version");
    }
    let method = message.get("method").and_then(Value::as_str);
    if let (Some(h), Some(m)) = (header("mcp-method"), method) {
        if h != m {
            return mismatch("Mcp-Method");
        }
    }
    if method == Some("tools/call") {
        let name = message.at("/params/name").and_then(Value::as_str);
        if let (Some(h), Some(n)) = (header("mcp-name"), name) {
            if decode_header(h) != n {
                return mismatch("Mcp-Name");
            }
        }
    }
    Ok(())
}

/// A mirrored header value, Base64 sentinel (`=?base64?…?=`) decoded (Streamable HTTP "Value
/// Encoding"); an undecodable value stays as it is (and then mismatches).
fn decode_header(v: &str) -> String {
    let Some(inner) = v
        .strip_prefix("=?base64?")
        .and_then(|r| r.strip_suffix("?="))
    else {
        return v.to_owned();
    };
    base64_decode(inner)
        .and_then(|b| String::from_utf8(b).ok())
        .unwrap_or_else(|| v.to_owned())
}

/// Standard Base64 (RFC 4648 §4) decoding, with or without padding.
fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        })
    };
    let bytes: Vec<u8> = s.bytes().filter(|b| *b != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, b) in chunk.iter().enumerate() {
            n |= value(*b)? << (18 - 6 * i);
        }
        let take = match chunk.len() {
            4 => 3,
            3 => 2,
            2 => 1,
            _ => return None,
        };
        for i in 0..take {
            out.push((n >> (16 - 8 * i)) as u8);
        }
    }
    Some(out)
}

/// `initialize`: forwarded (with the revision turnguard offers), answered with turnguard's own
/// session id.
pub async fn initialize(front: &Arc<McpFront>, inbound: Inbound) -> Response {
    let id = inbound.id();
    let mut message = inbound.message.clone();
    let asked = message
        .at("/params/protocolVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    if !HANDSHAKE_REVISIONS.contains(&asked.as_str()) {
        if let Some(p) = message.get_mut("params").and_then(Value::as_object_mut) {
            p.insert(
                "protocolVersion".into(),
                json!(HANDSHAKE_REVISIONS[HANDSHAKE_REVISIONS.len() - 1]),
            );
        }
    }
    let capabilities = message
        .at("/params/capabilities")
        .cloned()
        .unwrap_or_else(|| json!({}));
    let body = bytes::Bytes::from(message.to_string());
    let resp = match super::relay::send(front, &inbound, None, body).await {
        Ok(r) => r,
        Err(e) => return json_response(StatusCode::BAD_GATEWAY, &wire_error(&id, &e)),
    };
    let upstream_session = resp
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let status = resp.status();
    let answer = match super::relay::read_answer(front, resp, &id).await {
        Ok(a) => a,
        Err(e) => return json_response(StatusCode::BAD_GATEWAY, &wire_error(&id, &e)),
    };
    if !status.is_success() || answer.get("result").is_none() {
        return json_response(status, &answer);
    }
    let version = answer
        .at("/result/protocolVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    if !HANDSHAKE_REVISIONS.contains(&version.as_str()) {
        return json_response(
            StatusCode::OK,
            &rpc_error(
                &id,
                code::INVALID_PARAMS,
                "Unsupported protocol version",
                Some(json!({"supported": HANDSHAKE_REVISIONS, "requested": version})),
            ),
        );
    }
    let session = Session {
        id: uuid::Uuid::new_v4().to_string(),
        server: inbound.server_name.clone(),
        upstream: upstream_session,
        version,
        capabilities,
        run: inbound.ctx.run.clone(),
        person: inbound.person.clone(),
        last_used: Instant::now(),
    };
    let mut resp = json_response(StatusCode::OK, &answer);
    if let Ok(v) = HeaderValue::from_str(&session.id) {
        resp.headers_mut().insert("mcp-session-id", v);
    }
    front.sessions.insert(session);
    resp
}

#[allow(clippy::result_large_err)] // the error is the response itself, built once
fn session_of(front: &McpFront, name: &str, headers: &HeaderMap) -> Result<Session, Response> {
    if !front.state.config.mcp.contains_key(name) {
        return Err(super::not_configured(name));
    }
    let sid = headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            json_response(
                StatusCode::METHOD_NOT_ALLOWED,
                &rpc_error(
                    &Value::Null,
                    code::INVALID_REQUEST,
                    "turnguard: GET and DELETE need an `Mcp-Session-Id` (2026-07-28 has neither)",
                    None,
                ),
            )
        })?;
    front.sessions.get(sid, name).ok_or_else(|| {
        json_response(
            StatusCode::NOT_FOUND,
            &rpc_error(
                &Value::Null,
                code::INVALID_REQUEST,
                "turnguard: no such MCP session",
                None,
            ),
        )
    })
}

/// `GET /mcp/NAME`: the session's server-to-client stream (server-initiated requests and
/// notifications), relayed byte for byte.
pub async fn stream(front: &Arc<McpFront>, name: &str, headers: &HeaderMap) -> Response {
    let session = match session_of(front, name, headers) {
        Ok(s) => s,
        Err(r) => return r,
    };
    match super::relay::send_raw(
        front,
        name,
        Method::GET,
        headers,
        session.upstream.as_deref(),
        bytes::Bytes::new(),
    )
    .await
    {
        // The stream is read event by event like a call's ([`super::relay::relay_sse`]); a
        // success that is not an event stream is not relayed (nothing turnguard did not
        // read reaches the client); a failure (the server's 405) is relayed as it came.
        Ok(resp) if resp.status().is_success() => {
            if super::relay::is_event_stream(resp.headers()) {
                super::relay::relay_sse(front, name, resp, None)
            } else {
                let e = crate::error::WireError::UpstreamUnavailable {
                    upstream: format!("mcp:{name}"),
                    reason: "the session stream's answer is not an event stream".into(),
                };
                json_response(StatusCode::BAD_GATEWAY, &wire_error(&Value::Null, &e))
            }
        }
        Ok(resp) => super::relay::passthrough(front, name, &Value::Null, resp).await,
        Err(e) => json_response(StatusCode::BAD_GATEWAY, &wire_error(&Value::Null, &e)),
    }
}

/// `DELETE /mcp/NAME`: ends the session here and at the server.
pub async fn end(front: &Arc<McpFront>, name: &str, headers: &HeaderMap) -> Response {
    let session = match session_of(front, name, headers) {
        Ok(s) => s,
        Err(r) => return r,
    };
    front.sessions.remove(&session.id);
    if session.upstream.is_none() {
        let mut r = Response::new(Body::empty());
        *r.status_mut() = StatusCode::OK;
        return r;
    }
    match super::relay::send_raw(
        front,
        name,
        Method::DELETE,
        headers,
        session.upstream.as_deref(),
        bytes::Bytes::new(),
    )
    .await
    {
        Ok(resp) => super::relay::passthrough(front, name, &Value::Null, resp).await,
        Err(e) => json_response(StatusCode::BAD_GATEWAY, &wire_error(&Value::Null, &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_sentinels_decode() {
        assert_eq!(
            decode_header("=?base64?SGVsbG8sIOS4lueVjA==?="),
            "Hello, 世界"
        );
        assert_eq!(decode_header("=?base64?IHBhZGRlZCA=?="), " padded ");
        assert_eq!(decode_header("plain"), "plain");
        assert_eq!(decode_header("=?base64?!!?="), "=?base64?!!?=");
    }
}
