//! `tools/list` through the MCP front: only the tools the caller may call, with the host's
//! annotations.
//!
//! - **Non-disclosing** (OpenWOP tool-catalog.md): a tool the acting person (or the agent) may
//!   not call is left out, so it is indistinguishable from one the server does not have; a
//!   `tools/call` of it gets the same "Unknown tool" error as a missing one ([`visible`]).
//! - **Host annotations**: a server's `annotations` are never trusted (OpenWOP
//!   `ToolDescriptor.annotations`: "never copied from an MCP server's annotations"); each
//!   listed tool gets the projection of its catalog descriptor (an unclassified tool is
//!   `write`, open world), and the server's `title` hint is kept for display.
//! - Each server's tool schemas (`inputSchema`, `outputSchema`) are remembered
//!   ([`ServerTools`]): a `tools/call` validates its arguments against the server's
//!   `inputSchema` as the model path validates against the request's declared schema.
//!
//! A catalog tool matches an MCP tool by its MCP name, or by the name an agent exposes it to
//! the model as, `mcp__<server>__<tool>` (Claude Code's convention).

use crate::strict_json::Lookup as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::response::Response;
use serde_json::{json, Value};

use super::relay::{self, Answer};
use super::{Inbound, McpFront};
use crate::clock::AGENT_ID;
use crate::policy::bundle::{Egress, ReplayPolicy, SafetyTier, UnknownTools};
use crate::policy::{CatalogTool, CompiledPolicy};

/// Pages of `tools/list` turnguard follows when it lists a server itself.
const MAX_PAGES: usize = 20;
/// Tools remembered per server at most.
const MAX_TOOLS: usize = 4096;

/// A tool as its MCP server listed it.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerTool {
    pub input_schema: Option<Value>,
    pub output_schema: Option<Value>,
}

/// The tools each MCP server listed, by server and tool name.
#[derive(Default)]
pub struct ServerTools {
    map: Mutex<HashMap<String, HashMap<String, ServerTool>>>,
}

impl ServerTools {
    /// The tool `tool` of `server`, if it was listed.
    pub fn get(&self, server: &str, tool: &str) -> Option<ServerTool> {
        self.map.lock().ok()?.get(server)?.get(tool).cloned()
    }

    fn remember(&self, server: &str, tools: &[Value]) {
        let Ok(mut map) = self.map.lock() else { return };
        let entry = map.entry(server.to_owned()).or_default();
        for t in tools {
            let Some(name) = t.get("name").and_then(Value::as_str) else {
                continue;
            };
            if entry.len() >= MAX_TOOLS && !entry.contains_key(name) {
                continue;
            }
            entry.insert(
                name.to_owned(),
                ServerTool {
                    input_schema: t.get("inputSchema").cloned(),
                    output_schema: t.get("outputSchema").cloned(),
                },
            );
        }
    }
}

/// The names a catalog entry may know MCP tool `tool` of `server` by, in lookup order.
pub fn names(server: &str, tool: &str) -> Vec<String> {
    vec![tool.to_owned(), format!("mcp__{server}__{tool}")]
}

/// The catalog name of MCP tool `tool` of `server` (its MCP name when the catalog knows
/// neither name) and the catalog tool (or the unknown-tool stand-in).
pub fn catalog_tool<'p>(
    policy: &'p CompiledPolicy,
    server: &str,
    tool: &str,
) -> (String, &'p CatalogTool) {
    for n in names(server, tool) {
        if let Some(t) = policy.catalog.by_name(&n) {
            return (n, t);
        }
    }
    (tool.to_owned(), policy.catalog.unknown())
}

/// Whether the caller may see and call `tool` at all: catalogued (or unknown tools are
/// allowed), and some call of it can be permitted for this principal
/// ([`crate::policy::Rules::may_invoke`]).
pub fn visible(policy: &CompiledPolicy, person: Option<&str>, tool: &CatalogTool) -> bool {
    if !tool.catalogued && policy.settings.unknown_tools == UnknownTools::Refuse {
        return false;
    }
    policy.rules.may_invoke(person, AGENT_ID, tool)
}

/// MCP `ToolAnnotations` projected from the host's descriptor: read-only for `pure`/`read`,
/// destructive for `write`/`exec`, idempotent when re-runnable (`replayPolicy`
/// deterministic/idempotent, or read-only), open-world unless `egress = "none"`.
pub fn annotations(tool: &CatalogTool, server_title: Option<&Value>) -> Value {
    let d = &tool.descriptor;
    let read_only = matches!(d.safety_tier, SafetyTier::Pure | SafetyTier::Read);
    let mut a = json!({
        "readOnlyHint": read_only,
        "destructiveHint": matches!(d.safety_tier, SafetyTier::Write | SafetyTier::Exec),
        "idempotentHint": read_only || matches!(d.replay_policy, Some(ReplayPolicy::Deterministic | ReplayPolicy::Idempotent)),
        "openWorldHint": d.egress != Some(Egress::None),
    });
    if let Some(t) = server_title.filter(|t| t.is_string()) {
        if let Some(o) = a.as_object_mut() {
            o.insert("title".into(), t.clone());
        }
    }
    a
}

/// `tools/list`: relayed, then filtered and annotated on its way back.
pub async fn handle(front: &Arc<McpFront>, inbound: Inbound) -> Response {
    let id = inbound.id();
    let policy = front.state.policy.snapshot();
    let person = inbound.person.clone();
    let server = inbound.server_name.clone();
    let sent = relay::send(front, &inbound, None, inbound.raw.clone()).await;
    let f = Arc::clone(front);
    let hook_id = id.clone();
    let hook: relay::Hook = Box::new(move |answer: Answer| {
        Box::pin(async move {
            let mut msg = answer.ok()?;
            // A JSON-RPC error, read: relayed as it came.
            msg.get("result")?;
            let Some(tools) = msg.at("/result/tools").and_then(Value::as_array).cloned() else {
                let e = crate::error::WireError::UpstreamUnavailable {
                    upstream: format!("mcp:{server}"),
                    reason: "the `tools/list` result has no list of tools".into(),
                };
                return Some(super::wire_error(&hook_id, &e));
            };
            f.tools.remember(&server, &tools);
            let shown: Vec<Value> = tools
                .into_iter()
                .filter_map(|mut t| {
                    let name = t.get("name")?.as_str()?.to_owned();
                    let (_, tool) = catalog_tool(&policy, &server, &name);
                    if !visible(&policy, person.as_deref(), tool) {
                        return None;
                    }
                    let title = t.at("/annotations/title").cloned();
                    if let Some(o) = t.as_object_mut() {
                        o.insert("annotations".into(), annotations(tool, title.as_ref()));
                    }
                    Some(t)
                })
                .collect();
            if let Some(slot) = msg.pointer_mut("/result/tools") {
                *slot = Value::Array(shown);
            }
            Some(msg)
        })
    });
    relay::respond(front, &inbound.server_name, sent, id, hook).await
}

/// The server's listing of `tool` (remembered, else asked for: turnguard sends its own
/// `tools/list`, following `nextCursor`). `None`: the server does not list it.
pub async fn declared(front: &Arc<McpFront>, inbound: &Inbound, tool: &str) -> Option<ServerTool> {
    if let Some(t) = front.tools.get(&inbound.server_name, tool) {
        return Some(t);
    }
    let meta = inbound.message.at("/params/_meta").cloned();
    let mut cursor: Option<Value> = None;
    for _ in 0..MAX_PAGES {
        let id = json!(format!("turnguard-{}", uuid::Uuid::new_v4()));
        let mut params = json!({});
        if let Some(m) = &meta {
            // The request's revision and capabilities (2026-07-28), nothing call-specific.
            let mut keep = serde_json::Map::new();
            for k in [super::VERSION_META, super::CAPABILITIES_META] {
                if let Some(v) = m.get(k) {
                    keep.insert(k.to_owned(), v.clone());
                }
            }
            if let Some(o) = params.as_object_mut() {
                o.insert("_meta".into(), Value::Object(keep));
            }
        }
        if let Some(c) = &cursor {
            if let Some(o) = params.as_object_mut() {
                o.insert("cursor".into(), c.clone());
            }
        }
        let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/list", "params": params});
        let mut headers = inbound.headers.clone();
        headers.remove("mcp-name");
        headers.insert("mcp-method", http::HeaderValue::from_static("tools/list"));
        let session = inbound.session.as_ref().and_then(|s| s.upstream.as_deref());
        let resp = relay::send_raw(
            front,
            &inbound.server_name,
            http::Method::POST,
            &headers,
            session,
            bytes::Bytes::from(body.to_string()),
        )
        .await
        .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let answer = relay::read_answer(front, resp, &id).await.ok()?;
        let tools = answer.at("/result/tools")?.as_array()?.clone();
        front.tools.remember(&inbound.server_name, &tools);
        if let Some(t) = front.tools.get(&inbound.server_name, tool) {
            return Some(t);
        }
        cursor = answer.at("/result/nextCursor").cloned();
        if cursor.as_ref().is_none_or(Value::is_null) {
            break;
        }
    }
    None
}
