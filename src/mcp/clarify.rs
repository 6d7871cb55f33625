//! Tool-turn contract §E over MCP: a catalog tool with `clarification = true` reached through
//! the MCP front asks the person through MCP `input_required` (Multi Round-Trip Requests,
//! revision 2026-07-28), under `limits.clarification_rounds`.
//!
//! The ask is the host's: turnguard answers the call itself and the MCP server is not called.
//! The first `tools/call` (admitted like any other, with its ticket inside a run) gets an
//! `InputRequiredResult` holding one form `elicitation/create` (the question is the call's
//! `question` / `message` / `prompt` / `text` argument) and an opaque `requestState`: a random
//! token of a pending ask kept here, bound to the server, tool, `argsHash`, run and person,
//! with an expiry (MRTR: `requestState` is attacker-controlled input, so nothing is read from
//! it but the token). The retry with `inputResponses` completes the call: the person's answer
//! is the result (`structuredContent` is the form content), claimed, recorded and answered
//! like an executed call. A retry without an answer asks again, up to
//! `limits.clarification_rounds` rounds; then `mcp_mrtr_rounds_exceeded` (OpenWOP, 422).
//!
//! A handshake-era session (2025-06-18, 2025-11-25) has no `input_required`: there the ask is
//! the server-initiated `elicitation/create` of those revisions, sent on the `tools/call`'s own
//! SSE response stream; the client's answer arrives as a JSON-RPC response POSTed in the same
//! session (taken here by its turnguard-minted id, never relayed to the server), within
//! `approval_timeout_ms` (keep-alive comments meanwhile), and completes the call the same way.
//!
//! A client that did not declare the `elicitation` capability gets
//! `MissingRequiredClientCapabilityError` (`-32021`, HTTP 400, MCP `basic/index`; the code is
//! the one MCP defines for it, used for both eras).

use crate::strict_json::Lookup as _;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use serde_json::{json, Value};
use tokio::sync::oneshot;

use super::call::McpCall;
use super::session::Era;
use super::{code, json_response, openwop_error, rpc_error};
use crate::journal::{RoundState, TicketRow};
use crate::model::{Decision, Outcome, Stage};

/// The `inputRequests` key of turnguard's ask.
pub const INPUT_KEY: &str = "turnguard_clarification";
/// How long a pending ask waits for its retry.
const ASK_TTL: Duration = Duration::from_secs(900);
/// Pending asks kept at most.
const MAX_ASKS: usize = 10_000;
/// Longest question shown, characters.
const MAX_QUESTION_CHARS: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Binding {
    server: String,
    tool: String,
    args_hash: Option<String>,
    run: Option<String>,
    person: Option<String>,
}

#[derive(Debug, Clone)]
struct Ask {
    binding: Binding,
    rounds: u32,
    expires: Instant,
}

/// Pending asks by their `requestState` token, and handshake-era asks waiting for the
/// client's answer by (session, request id).
#[derive(Default)]
pub struct Asks {
    map: Mutex<HashMap<String, Ask>>,
    waiters: Mutex<HashMap<(String, String), oneshot::Sender<Value>>>,
}

/// The JSON-RPC id prefix of turnguard's own `elicitation/create` requests.
pub const ELICIT_ID_PREFIX: &str = "turnguard-elicit-";

impl Asks {
    /// Hands `message` (a JSON-RPC response from the client) to the ask of `session` waiting
    /// for it; `false` when no ask of this session sent that id (the response is then the
    /// server's business and is relayed).
    pub fn answer(&self, session: &str, message: &Value) -> bool {
        let Some(id) = message.get("id").and_then(Value::as_str) else {
            return false;
        };
        if !id.starts_with(ELICIT_ID_PREFIX) {
            return false;
        }
        let waiter = self
            .waiters
            .lock()
            .ok()
            .and_then(|mut w| w.remove(&(session.to_owned(), id.to_owned())));
        match waiter {
            Some(tx) => tx.send(message.clone()).is_ok(),
            None => false,
        }
    }

    fn wait(&self, session: &str, id: &str) -> Option<oneshot::Receiver<Value>> {
        let (tx, rx) = oneshot::channel();
        let mut w = self.waiters.lock().ok()?;
        w.retain(|_, tx| !tx.is_closed());
        if w.len() >= MAX_ASKS {
            return None;
        }
        w.insert((session.to_owned(), id.to_owned()), tx);
        Some(rx)
    }

    fn take(&self, token: &str) -> Option<Ask> {
        let mut map = self.map.lock().ok()?;
        map.remove(token).filter(|a| a.expires > Instant::now())
    }

    fn put(&self, ask: Ask) -> String {
        let token = format!("tgask_{}", uuid::Uuid::new_v4().simple());
        if let Ok(mut map) = self.map.lock() {
            let now = Instant::now();
            map.retain(|_, a| a.expires > now);
            if map.len() < MAX_ASKS {
                map.insert(token.clone(), ask);
            }
        }
        token
    }
}

fn question(args: &Value) -> String {
    let text = ["/question", "/message", "/prompt", "/text"]
        .iter()
        .find_map(|p| args.at(p).and_then(Value::as_str))
        .map(str::to_owned)
        .unwrap_or_else(|| args.to_string());
    text.chars().take(MAX_QUESTION_CHARS).collect()
}

fn form(message: String, form_mode: bool) -> Value {
    let mut params = json!({
        "message": message,
        "requestedSchema": {
            "type": "object",
            "properties": {"answer": {"type": "string", "title": "Answer"}},
            "required": ["answer"],
        },
    });
    if form_mode {
        if let Some(o) = params.as_object_mut() {
            o.insert("mode".into(), json!("form"));
        }
    }
    params
}

/// The call's result for the person's `ElicitResult`.
fn answered(call: &McpCall, answer: &Value) -> Value {
    let action = answer
        .get("action")
        .and_then(Value::as_str)
        .unwrap_or("cancel");
    let mut result = match (action, answer.get("content")) {
        ("accept", Some(content)) => json!({
            "content": [{"type": "text", "text": content.to_string()}],
            "structuredContent": content,
            "isError": false,
        }),
        _ => json!({
            "content": [{"type": "text", "text": format!("the person did not answer ({})", crate::admission::sanitize_label(action))}],
            "structuredContent": {"action": crate::admission::sanitize_label(action)},
            "isError": false,
        }),
    };
    call.complete(&mut result);
    result
}

/// Completes the call with `result`: claim (a repeat gets the recorded answer), journal,
/// events, record; returns the message to send.
async fn complete(
    call: &McpCall,
    d: &mut Decision,
    ticket: Option<&TicketRow>,
    result: Value,
    claimed: bool,
) -> Value {
    let id = call.id.clone();
    let exec = call.exec_with(ticket, true);
    let repeat = if claimed {
        Ok(None)
    } else {
        call.claim(d, &exec).await
    };
    match repeat {
        Ok(Some(_)) => {
            // A repeat: the recorded answer (or the call in doubt).
            let recorded = call
                .front
                .reader
                .recorded(call.inbound.run_id(), &exec.call_id, &call.inbound.reader())
                .await
                .ok()
                .flatten();
            return match recorded {
                Some(r) => call.recorded_message(&r),
                None => super::wire_error(
                    &id,
                    &crate::error::WireError::ToolOutcomeUnknown {
                        calls: crate::admission::sanitize_label(&call.name),
                    },
                ),
            };
        }
        Ok(None) => {}
        Err(e) => return super::wire_error(&id, &e),
    }
    tokio::join!(
        call.journal(d, &exec, RoundState::Ok, None),
        call.account(d, &exec, false)
    );
    let message = json!({"jsonrpc": "2.0", "id": id, "result": result});
    if let Err(e) = call.record(&exec, &message).await {
        return super::wire_error(&id, &e);
    }
    message
}

/// The admitted clarification call `call` (decision `d`).
pub async fn handle(call: McpCall, mut d: Decision, ticket: Option<TicketRow>) -> Response {
    let id = call.id.clone();
    if call.inbound.capabilities.get("elicitation").is_none() {
        let mut resp = json_response(
            StatusCode::BAD_REQUEST,
            &rpc_error(
                &id,
                code::MISSING_CLIENT_CAPABILITY,
                "Server requires the elicitation capability for this request",
                Some(json!({"requiredCapabilities": {"elicitation": {}}})),
            ),
        );
        *resp.status_mut() = StatusCode::BAD_REQUEST;
        return resp;
    }
    // An ask that was answered (or is in doubt) is never asked again: the repeat gets the
    // recorded answer.
    let exec = call.exec_with(ticket.as_ref(), true);
    let mut claimed = false;
    if let Some((effect_id, _)) = &exec.effect {
        let state = call.front.reader.effect_state(effect_id).await;
        match state {
            Ok(None) => {}
            Ok(Some(_)) => match call.claim(&mut d, &exec).await {
                Ok(Some(repeat)) => return repeat,
                // Taken over (its claimer died before anything was asked): ask, holding it.
                Ok(None) => claimed = true,
                Err(e) => return json_response(StatusCode::OK, &super::wire_error(&id, &e)),
            },
            Err(e) => {
                let e = crate::error::WireError::JournalUnavailable {
                    reason: e.to_string(),
                };
                return json_response(StatusCode::OK, &super::wire_error(&id, &e));
            }
        }
    }
    if call.inbound.era != Era::Modern {
        return handshake(call, d, ticket, claimed).await;
    }
    let binding = Binding {
        server: call.inbound.server_name.clone(),
        tool: call.name.clone(),
        args_hash: call.args_hash.clone(),
        run: call.inbound.run_id().map(str::to_owned),
        person: call.inbound.person.clone(),
    };
    let params = call.inbound.params();
    let prior = params
        .get("requestState")
        .and_then(Value::as_str)
        .and_then(|t| call.front.asks.take(t))
        .filter(|a| a.binding == binding);
    let answer = params
        .at(&format!("/inputResponses/{INPUT_KEY}"))
        .filter(|a| a.get("action").and_then(Value::as_str).is_some());
    if let (Some(_), Some(answer)) = (&prior, answer) {
        let result = answered(&call, answer);
        let message = complete(&call, &mut d, ticket.as_ref(), result, claimed).await;
        return json_response(StatusCode::OK, &message);
    }
    let rounds = prior.map_or(0, |a| a.rounds);
    let limit = call.policy.settings.limits.clarification_rounds;
    if rounds >= limit {
        d.outcome = Outcome::Refused;
        d.stage = Stage::Limits;
        d.reason = crate::reason::Reason::ClarificationRoundsExceeded;
        d.message = format!("the person was asked {rounds} time(s) for this call; the limit is {limit} (`limits.clarification_rounds`)");
        let exec = super::call::Exec::random();
        call.journal(&d, &exec, RoundState::Ok, None).await;
        call.account(&d, &exec, true).await;
        return json_response(
            StatusCode::OK,
            &openwop_error(
                &id,
                422,
                "mcp_mrtr_rounds_exceeded",
                &crate::admission::explain(&d),
                json!({"reason": d.reason, "source": "turnguard", "maxRounds": limit}),
            ),
        );
    }
    let token = call.front.asks.put(Ask {
        binding,
        rounds: rounds + 1,
        expires: Instant::now() + ASK_TTL,
    });
    tracing::info!(request_id = %call.inbound.ctx.request_id(), tool = %crate::admission::sanitize_label(&call.name), round = rounds + 1, "clarification asked through MCP input_required");
    let result = json!({
        "resultType": "input_required",
        "inputRequests": {
            INPUT_KEY: {
                "method": "elicitation/create",
                "params": form(question(&call.arguments), true),
            },
        },
        "requestState": token,
    });
    json_response(
        StatusCode::OK,
        &json!({"jsonrpc": "2.0", "id": id, "result": result}),
    )
}

/// The handshake-era ask: `elicitation/create` on the call's SSE stream, the answer taken from
/// the client's response POST ([`Asks::answer`]), then the call's result on the same stream.
async fn handshake(
    call: McpCall,
    mut d: Decision,
    ticket: Option<TicketRow>,
    claimed: bool,
) -> Response {
    let id = call.id.clone();
    let Some(session) = call.inbound.session.clone() else {
        return json_response(
            StatusCode::BAD_REQUEST,
            &rpc_error(&id, code::INVALID_REQUEST, "turnguard: no session", None),
        );
    };
    if call.policy.settings.limits.clarification_rounds == 0 {
        return json_response(
            StatusCode::OK,
            &openwop_error(
                &id,
                422,
                "mcp_mrtr_rounds_exceeded",
                "`limits.clarification_rounds` is 0: the person is never asked",
                json!({"reason": "clarification_rounds_exceeded", "source": "turnguard"}),
            ),
        );
    }
    let ask_id = format!("{ELICIT_ID_PREFIX}{}", uuid::Uuid::new_v4().simple());
    let Some(rx) = call.front.asks.wait(&session.id, &ask_id) else {
        let e = crate::error::WireError::Overloaded {
            limit: MAX_ASKS,
            retry_after_s: 1,
        };
        return json_response(StatusCode::OK, &super::wire_error(&id, &e));
    };
    // `mode` is a 2025-11-25 field; 2025-06-18 knows only the form.
    let request = json!({"jsonrpc": "2.0", "id": ask_id, "method": "elicitation/create",
        "params": form(question(&call.arguments), session.version.as_str() >= "2025-11-25")});
    let (tx, events) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    let timeout = Duration::from_millis(call.front.state.config.approval_timeout_ms);
    let keepalive = Duration::from_millis(call.front.state.config.approval_keepalive_ms);
    tracing::info!(request_id = %call.inbound.ctx.request_id(), tool = %crate::admission::sanitize_label(&call.name), "clarification asked through MCP elicitation/create");
    tokio::spawn(async move {
        let event = |v: &Value| crate::sse::encode(Some("message"), &v.to_string());
        if tx.send(Ok(event(&request))).await.is_err() {
            return;
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        tokio::pin!(rx);
        let mut tick = tokio::time::interval(keepalive);
        tick.tick().await;
        let answer = loop {
            tokio::select! {
                a = &mut rx => break a.ok(),
                _ = &mut deadline => break None,
                _ = tick.tick() => {
                    let _ = tx.send(Ok(Bytes::from_static(b": keep-alive\n\n"))).await;
                }
            }
        };
        let message = match answer.as_ref().and_then(|a| a.get("result")) {
            Some(r) => {
                let result = answered(&call, r);
                complete(&call, &mut d, ticket.as_ref(), result, claimed).await
            }
            None => {
                let why = if answer.is_some() {
                    "the client answered the question with an error"
                } else {
                    "the question was not answered in time (`approval_timeout_ms`)"
                };
                openwop_error(
                    &id,
                    422,
                    "capability_not_provided",
                    why,
                    json!({"reason": "clarification_unanswered", "source": "turnguard"}),
                )
            }
        };
        let _ = tx.send(Ok(event(&message))).await;
    });
    let mut resp = Response::new(Body::from_stream(
        tokio_stream::wrappers::ReceiverStream::new(events),
    ));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    resp
}
