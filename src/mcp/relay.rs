//! The MCP front's upstream leg: sending a message to the configured MCP server (the agent's
//! headers as a proxy forwards them, turnguard's session id swapped for the server's), and
//! relaying the answer.
//!
//! - Messages turnguard does not decide on (notifications, responses to server-initiated
//!   requests, `ping`, resources, prompts, unknown methods, `subscriptions/listen`, the GET
//!   stream) are relayed byte for byte, streams included ([`pass`], [`passthrough`]).
//! - A request turnguard decides on (`tools/list`, `tools/call`) is relayed through a *hook*
//!   on its final response ([`respond`]): a JSON answer is read (capped) and handed to the
//!   hook; an SSE answer is framed ([`crate::sse::SseFramer`]), every event before the final
//!   response (progress, log messages, server-initiated requests of the handshake era) is
//!   relayed as it arrives, and the final response goes through the hook before it is sent.
//!   When the server fails before answering (connection, timeout, a cut stream, bytes that are
//!   not JSON), the hook is told so and decides what the client gets.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;

use super::{json_response, Inbound, McpFront};
use crate::error::WireError;
use crate::proxy::upstream;

/// What a hook gets: the final JSON-RPC response for the request, or why none came.
pub type Answer = Result<Value, WireError>;
/// A hook on the final response: returns the message to send, or `None` to relay the
/// server's answer unchanged.
pub type Hook =
    Box<dyn FnOnce(Answer) -> Pin<Box<dyn Future<Output = Option<Value>> + Send>> + Send>;

fn unavailable(server: &str, reason: impl Into<String>) -> WireError {
    WireError::UpstreamUnavailable {
        upstream: format!("mcp:{server}"),
        reason: reason.into(),
    }
}

/// Sends `body` with `method` to MCP server `name`: the agent's headers as a proxy forwards
/// them (hop-by-hop and `turnguard-*` removed, [`upstream::request_headers`]), the client's
/// `Mcp-Session-Id` replaced by the server's own (`upstream_session`).
pub async fn send_raw(
    front: &McpFront,
    name: &str,
    method: Method,
    headers: &HeaderMap,
    upstream_session: Option<&str>,
    body: Bytes,
) -> Result<http::Response<Incoming>, WireError> {
    let Some(server) = front.state.config.mcp.get(name) else {
        return Err(WireError::UpstreamNotConfigured {
            upstream: format!("mcp:{name}"),
        });
    };
    let mut out = upstream::request_headers(headers, false);
    out.remove("mcp-session-id");
    if let Some(s) = upstream_session.and_then(|s| HeaderValue::from_str(s).ok()) {
        out.insert("mcp-session-id", s);
    }
    if method == Method::POST {
        out.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if !out.contains_key(http::header::ACCEPT) {
            out.insert(
                http::header::ACCEPT,
                HeaderValue::from_static("application/json, text/event-stream"),
            );
        }
    }
    let path = if server.url.prefix.is_empty() {
        "/"
    } else {
        ""
    };
    upstream::send_to(
        &front.state,
        &server.url,
        &format!("mcp:{name}"),
        crate::metrics::ApiLabel::Mcp,
        method,
        path,
        out,
        body,
    )
    .await
}

/// [`send_raw`] of a POST for `inbound`'s session (or `upstream_session` when given).
pub async fn send(
    front: &McpFront,
    inbound: &Inbound,
    upstream_session: Option<&str>,
    body: Bytes,
) -> Result<http::Response<Incoming>, WireError> {
    let session =
        upstream_session.or_else(|| inbound.session.as_ref().and_then(|s| s.upstream.as_deref()));
    send_raw(
        front,
        &inbound.server_name,
        Method::POST,
        &inbound.headers,
        session,
        body,
    )
    .await
}

/// The server's response relayed unchanged (status, headers with hop-by-hop removed, body)
/// once read whole within the upstream bounds ([`upstream::relayed`]); a 1xx or 3xx status
/// (a redirect an MCP client would follow around turnguard), or a body that stalls or
/// outgrows `max_response_bytes`, is the JSON-RPC error for `id` with 502 instead.
pub async fn passthrough(
    front: &McpFront,
    server: &str,
    id: &Value,
    resp: http::Response<Incoming>,
) -> Response {
    let deadline = tokio::time::Instant::now()
        + Duration::from_millis(front.state.config.upstream_response_timeout_ms);
    match upstream::relayed(&front.state, &format!("mcp:{server}"), resp, deadline).await {
        Ok(out) => out,
        Err(e) => json_response(StatusCode::BAD_GATEWAY, &super::wire_error(id, &e)),
    }
}

/// Relays `inbound` unchanged and its answer unchanged. Inside a run, `resources/read` and
/// `prompts/get` bring content into the agent that the model will read: the run is marked
/// untrusted before they go (tool-turn contract §C: content turnguard cannot judge is
/// untrusted).
pub async fn pass(front: &Arc<McpFront>, inbound: Inbound) -> Response {
    let method = inbound
        .message
        .get("method")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if matches!(method, "resources/read" | "prompts/get") {
        if let Some(run) = inbound.run_id() {
            if let Err(e) = front
                .state
                .journal
                .run_untrusted(run, true, inbound.ctx.request_id(), inbound.ctx.at_ms)
                .await
            {
                let e = WireError::JournalUnavailable {
                    reason: e.to_string(),
                };
                return json_response(StatusCode::OK, &super::wire_error(&inbound.id(), &e));
            }
        }
    }
    match send(front, &inbound, None, inbound.raw.clone()).await {
        Ok(resp) => passthrough(front, &inbound.server_name, &inbound.id(), resp).await,
        Err(e) => json_response(
            StatusCode::BAD_GATEWAY,
            &super::wire_error(&inbound.id(), &e),
        ),
    }
}

/// Reads the whole answer to request `id` (JSON, or the SSE stream up to the response with
/// that id): for turnguard's own use (`initialize`, a `tools/list` it needs), not relayed.
pub async fn read_answer(
    front: &McpFront,
    resp: http::Response<Incoming>,
    id: &Value,
) -> Result<Value, WireError> {
    let sse = is_event_stream(resp.headers());
    let cap = front.state.config.max_response_bytes;
    let body = crate::body::read_capped(resp.into_body(), cap)
        .await
        .map_err(|e| unavailable("", format!("response body: {e}")))?;
    if !sse {
        return crate::strict_json::from_slice(&body).map_err(|_| {
            unavailable(
                "",
                "the MCP server answered with bytes that are not JSON turnguard reads one way",
            )
        });
    }
    let mut framer = crate::sse::SseFramer::new(front.state.config.max_event_bytes);
    let mut blocks = framer
        .push(&body)
        .map_err(|_| unavailable("", "an SSE event over the size limit"))?;
    blocks.extend(framer.finish().0);
    blocks
        .iter()
        .filter_map(|b| b.data.as_deref())
        .filter_map(|d| crate::strict_json::from_str(d).ok())
        .find(|v| is_response_to(v, id))
        .ok_or_else(|| unavailable("", "the SSE stream ended without the response"))
}

/// `v` is the JSON-RPC response (result or error) to request `id`.
pub fn is_response_to(v: &Value, id: &Value) -> bool {
    v.get("id") == Some(id) && is_response(v)
}

/// The answer is an event stream (`text/event-stream`).
pub(super) fn is_event_stream(h: &HeaderMap) -> bool {
    h.get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        })
}

/// Relays the answer to request `id` through `hook` (see the module docs).
pub async fn respond(
    front: &Arc<McpFront>,
    server: &str,
    sent: Result<http::Response<Incoming>, WireError>,
    id: Value,
    hook: Hook,
) -> Response {
    let resp = match sent {
        Ok(r) => r,
        Err(e) => {
            let msg = hook(Err(e.clone_for_hook())).await;
            return json_response(
                StatusCode::OK,
                &msg.unwrap_or_else(|| super::wire_error(&id, &e)),
            );
        }
    };
    if is_event_stream(resp.headers()) && resp.status().is_success() {
        return relay_sse(front, server, resp, Some((id, hook)));
    }
    let status = resp.status();
    let headers = upstream::response_headers(resp.headers(), false);
    let cap = front.state.config.max_response_bytes;
    // Bounded in time like every upstream answer turnguard reads whole.
    let idle = Duration::from_millis(front.state.config.upstream_idle_timeout_ms);
    let within = Duration::from_millis(front.state.config.upstream_response_timeout_ms);
    let read = if upstream::neither_answer_nor_error(status) {
        // Neither an answer nor an error: never relayed (a redirect's `Location` would send
        // the client around turnguard), whatever its body says.
        Err(format!(
            "HTTP {}, which is neither an answer nor an error",
            status.as_u16()
        ))
    } else {
        crate::body::read_capped_within(resp.into_body(), cap, Some(idle), within)
            .await
            .map_err(|e| format!("response body: {e}"))
    };
    let body = match read {
        Ok(b) => b,
        Err(why) => {
            let e = unavailable(server, why);
            let msg = hook(Err(e.clone_for_hook())).await;
            return json_response(
                StatusCode::OK,
                &msg.unwrap_or_else(|| super::wire_error(&id, &e)),
            );
        }
    };
    // Strict (`strict_json`): a key twice would read one way here and another in the agent.
    let parsed = crate::strict_json::from_slice(&body)
        .ok()
        .filter(|v| is_response_to(v, &id));
    let answer = match parsed {
        Some(v) => Ok(v),
        None if status.is_success() => Err(unavailable(
            server,
            "the MCP server answered with bytes that are not a JSON-RPC response",
        )),
        None => Err(unavailable(server, format!("HTTP {}", status.as_u16()))),
    };
    // A hook that has nothing to say about a failure leaves the error to send: the bytes
    // the server sent are never relayed when turnguard could not read them as the response.
    let failure = answer
        .as_ref()
        .err()
        .map(|e| super::wire_error(&id, &e.clone_for_hook()));
    let failed = failure.is_some();
    match hook(answer).await {
        // The server's error status stays (a 404 for a session it no longer knows tells the
        // client to start a new one); its body does not.
        None if failed => json_response(
            if status.is_success() {
                StatusCode::OK
            } else if upstream::neither_answer_nor_error(status) {
                StatusCode::BAD_GATEWAY
            } else {
                status
            },
            &failure.unwrap_or_default(),
        ),
        Some(msg) => {
            let mut r = json_response(if failed { StatusCode::OK } else { status }, &msg);
            for (k, v) in &headers {
                if k != http::header::CONTENT_TYPE
                    && k != http::header::CONTENT_LENGTH
                    && k != http::header::LOCATION
                {
                    r.headers_mut().insert(k.clone(), v.clone());
                }
            }
            r
        }
        None => {
            let mut r = Response::new(Body::from(body));
            *r.status_mut() = status;
            *r.headers_mut() = headers;
            r
        }
    }
}

/// Why an event of an MCP server's stream is not relayed: it does not read one way (a field
/// turnguard does not know — some clients drop a byte-order mark before `data:` —, bytes
/// that are not UTF-8, JSON it cannot read or that names a key twice, a batch or anything
/// but one object), or it is a response this stream may not carry.
fn read_event(block: &crate::sse::SseBlock) -> Result<Option<Value>, &'static str> {
    if block.unknown_field {
        return Err("an event with a field other than event, data, id and retry");
    }
    if std::str::from_utf8(&block.raw).is_err() {
        return Err("an event that is not UTF-8");
    }
    let Some(d) = block.data.as_deref() else {
        return Ok(None);
    };
    match crate::strict_json::from_str(d) {
        Ok(v) if v.is_object() => Ok(Some(v)),
        Ok(_) => Err("an event that is not one JSON-RPC message (a batch, or not an object)"),
        Err(crate::strict_json::StrictJsonError::DuplicateKey { .. }) => {
            Err("an event that names an object key twice")
        }
        Err(_) => Err("an event that is not JSON turnguard reads"),
    }
}

/// The next data of a server's stream, waiting at most `idle` when given: `None` at its end,
/// or once `client` (when given) is gone — the session's GET stream is not read for nobody.
///
/// Errors: why the stream is given up (no event in time, a broken stream).
async fn next_data(
    body: &mut Incoming,
    idle: Option<Duration>,
    client: Option<&tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>>,
) -> Result<Option<Bytes>, String> {
    loop {
        let frame = match (idle, client) {
            (Some(idle), _) => tokio::time::timeout(idle, body.frame())
                .await
                .map_err(|_| format!("no event within {} ms", idle.as_millis()))?,
            (None, Some(tx)) => tokio::select! {
                f = body.frame() => f,
                () = tx.closed() => return Ok(None),
            },
            (None, None) => body.frame().await,
        };
        match frame {
            None => return Ok(None),
            Some(Err(e)) => return Err(format!("the stream broke: {e}")),
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    return Ok(Some(d));
                }
            }
        }
    }
}

/// A JSON-RPC response (result or error, no method), to whichever request.
fn is_response(v: &Value) -> bool {
    v.get("method").is_none() && (v.get("result").is_some() || v.get("error").is_some())
}

/// Relays an MCP server's event stream, every event read ([`read_event`]) before it is
/// relayed. `expect`: the request this stream answers and the hook its final response goes
/// through (a POST's stream); `None` for the session's GET stream, which carries no response
/// at all. A response to any other request (an id of another type or value: `"1"` for `1`,
/// `1.0`, which clients may still match), or one on the GET stream, ends the stream: the
/// POST's hook is told the server failed, the GET stream just ends.
pub fn relay_sse(
    front: &Arc<McpFront>,
    server: &str,
    resp: http::Response<Incoming>,
    expect: Option<(Value, Hook)>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let headers = upstream::response_headers(resp.headers(), false);
    let max_event = front.state.config.max_event_bytes;
    let idle = Duration::from_millis(front.state.config.upstream_idle_timeout_ms);
    let server = server.to_owned();
    // The GET stream waits for server messages as long as the session lives.
    let idle = expect.as_ref().map(|_| idle);
    tokio::spawn(async move {
        let mut body = resp.into_body();
        let mut framer = crate::sse::SseFramer::new(max_event);
        let (id, mut hook) = match expect {
            Some((id, hook)) => (Some(id), Some(hook)),
            None => (None, None),
        };
        let mut failure: Option<String> = None;
        // A client that goes away does not stop the read: the final response still goes
        // through the hook (a decided call's result is recorded either way).
        let mut client_gone = false;
        'read: loop {
            // A call's stream is read to its response even for a client that left (its
            // result is recorded either way); the GET stream only while its client is there.
            let client = hook.is_none().then_some(&tx);
            let data = match next_data(&mut body, idle, client).await {
                Ok(Some(d)) => d,
                Ok(None) => break,
                Err(why) => {
                    failure = Some(why);
                    break;
                }
            };
            let blocks = match framer.push(&data) {
                Ok(b) => b,
                Err(_) => {
                    failure = Some("an SSE event over the size limit".into());
                    break;
                }
            };
            for block in blocks {
                // Every event is read (strictly) before it is relayed: one turnguard cannot
                // read ends the stream with the error, never passes raw (it could be the
                // response itself in a form the agent's parser reads another way).
                let parsed = match read_event(&block) {
                    Ok(v) => v,
                    Err(why) => {
                        failure = Some(why.into());
                        break 'read;
                    }
                };
                if let Some(v) = parsed.filter(is_response) {
                    match &id {
                        Some(id) if is_response_to(&v, id) => {
                            if let Some(h) = hook.take() {
                                let out = match h(Ok(v)).await {
                                    Some(msg) => {
                                        crate::sse::encode(Some("message"), &msg.to_string())
                                    }
                                    None => block.raw.clone(),
                                };
                                let _ = tx.send(Ok(out)).await;
                            }
                            // The final response ends the stream (Streamable HTTP: it SHOULD).
                        }
                        Some(_) => {
                            failure = Some(
                                "a response to another request than the one this stream answers"
                                    .into(),
                            );
                        }
                        None => {
                            failure = Some("a response on the session's stream".into());
                        }
                    }
                    break 'read;
                }
                if !client_gone && tx.send(Ok(block.raw.clone())).await.is_err() {
                    client_gone = true;
                    if hook.is_none() {
                        break 'read;
                    }
                }
            }
        }
        if let (Some(h), Some(id)) = (hook.take(), &id) {
            let reason =
                failure.unwrap_or_else(|| "the SSE stream ended without the response".into());
            let e = unavailable(&server, reason);
            let msg = h(Err(e.clone_for_hook())).await;
            let msg = msg.unwrap_or_else(|| super::wire_error(id, &e));
            let _ = tx
                .send(Ok(crate::sse::encode(Some("message"), &msg.to_string())))
                .await;
        } else if let Some(why) = failure {
            tracing::warn!(server = %server, reason = %why, "MCP session stream ended: turnguard could not relay an event");
        }
    });
    let mut out = Response::new(Body::from_stream(
        tokio_stream::wrappers::ReceiverStream::new(rx),
    ));
    *out.headers_mut() = headers;
    out.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    out
}

trait CloneForHook {
    fn clone_for_hook(&self) -> WireError;
}

impl CloneForHook for WireError {
    /// The variants the leg produces, copied (`WireError` is not `Clone`).
    fn clone_for_hook(&self) -> WireError {
        match self {
            WireError::UpstreamUnavailable { upstream, reason } => WireError::UpstreamUnavailable {
                upstream: upstream.clone(),
                reason: reason.clone(),
            },
            WireError::UpstreamNotConfigured { upstream } => WireError::UpstreamNotConfigured {
                upstream: upstream.clone(),
            },
            other => WireError::Internal {
                reason: other.to_string(),
            },
        }
    }
}
