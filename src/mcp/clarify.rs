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
//! A client that did not declare the `elicitation` capability gets
//! `MissingRequiredClientCapabilityError` (`-32021`, HTTP 400, MCP `basic/index`). A
//! handshake-era session (2025-06-18 …) has no `input_required`: the call gets
//! `capability_not_provided` (asking through a server-initiated `elicitation/create` on such
//! a session is not implemented).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::response::Response;
use http::StatusCode;
use serde_json::{json, Value};

use super::call::McpCall;
use super::session::Era;
use super::{code, json_response, openwop_error, rpc_error};
use crate::journal::TicketRow;
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

/// Pending asks by their `requestState` token.
#[derive(Default)]
pub struct Asks {
    map: Mutex<HashMap<String, Ask>>,
}

impl Asks {
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
        .find_map(|p| args.pointer(p).and_then(Value::as_str))
        .map(str::to_owned)
        .unwrap_or_else(|| args.to_string());
    text.chars().take(MAX_QUESTION_CHARS).collect()
}

/// The admitted clarification call `call` (decision `d`).
pub async fn handle(call: McpCall, mut d: Decision, ticket: Option<TicketRow>) -> Response {
    let id = call.id.clone();
    if call.inbound.era != Era::Modern {
        let version = call
            .inbound
            .session
            .as_ref()
            .map_or("", |s| s.version.as_str())
            .to_owned();
        return json_response(
            StatusCode::OK,
            &openwop_error(
                &id,
                422,
                "capability_not_provided",
                &format!("`{}` asks the person a question, which turnguard maps to MCP `input_required` (revision 2026-07-28); this session speaks {version}", crate::admission::sanitize_label(&call.name)),
                json!({"reason": "clarification_needs_input_required", "source": "turnguard"}),
            ),
        );
    }
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
        .pointer(&format!("/inputResponses/{INPUT_KEY}"))
        .filter(|a| a.get("action").and_then(Value::as_str).is_some());
    if let (Some(_), Some(answer)) = (&prior, answer) {
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
        let exec = call.exec(ticket.as_ref());
        match call.claim(&mut d, &exec).await {
            Ok(Some(repeat)) => return repeat,
            Ok(None) => {}
            Err(e) => return json_response(StatusCode::OK, &super::wire_error(&id, &e)),
        }
        tokio::join!(
            call.journal(&d, &exec, "ok", None),
            call.account(&d, &exec, false)
        );
        let message = json!({"jsonrpc": "2.0", "id": id, "result": result});
        if let Err(e) = call.record(&exec, &message).await {
            return json_response(StatusCode::OK, &super::wire_error(&id, &e));
        }
        return json_response(StatusCode::OK, &message);
    }
    let rounds = prior.map_or(0, |a| a.rounds);
    let limit = call.policy.settings.limits.clarification_rounds;
    if rounds >= limit {
        d.outcome = Outcome::Refused;
        d.stage = Stage::Limits;
        d.reason = "clarification_rounds_exceeded";
        d.message = format!("the person was asked {rounds} time(s) for this call; the limit is {limit} (`limits.clarification_rounds`)");
        let exec = super::call::Exec::random();
        call.journal(&d, &exec, "ok", None).await;
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
    tracing::info!(request_id = %call.inbound.ctx.request_id, tool = %crate::admission::sanitize_label(&call.name), round = rounds + 1, "clarification asked through MCP input_required");
    let result = json!({
        "resultType": "input_required",
        "inputRequests": {
            INPUT_KEY: {
                "method": "elicitation/create",
                "params": {
                    "mode": "form",
                    "message": question(&call.arguments),
                    "requestedSchema": {
                        "type": "object",
                        "properties": {"answer": {"type": "string", "title": "Answer"}},
                        "required": ["answer"],
                    },
                },
            },
        },
        "requestState": token,
    });
    json_response(
        StatusCode::OK,
        &json!({"jsonrpc": "2.0", "id": id, "result": result}),
    )
}
