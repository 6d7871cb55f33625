//! The admin plane (DESIGN.md §6), on its own listener (default `127.0.0.1:8788`, never the
//! data-plane port): `/metrics`, `/healthz`, `/readyz`, `/config`, the tool catalog
//! (`/tools`, `/tools/{toolId}`), `/capabilities`, and approvals ([`crate::approvals::routes`]).
//!
//! Who may read what (DESIGN.md §9, "admin client: run data and approvals need a verified
//! bearer; nothing secret is shown"):
//! - run data (`/runs/{runId}/events`, `/runs/{runId}/effects`) needs `Authorization: Bearer`
//!   with either the admin token (`admin_token_file`) or a token the identity provider signed
//!   (verified like an approver's: issuer, audience, keys; not delegated; never a token the
//!   agent presented on the data plane). Without either configured, run data is 401 for
//!   everyone (fail closed);
//! - approvals authenticate in [`crate::approvals`];
//! - `/metrics`, `/healthz`, `/readyz`, `/config`, `/tools`, `/capabilities` and
//!   `/host/effect-seams` are open: they show no run data and no secret (credentials in
//!   an upstream URL are redacted, the admin token and key files are shown by path only).
//!   Bind the admin plane to loopback (the default) or a private interface.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use http::{header, StatusCode};
use serde_json::{json, Value};

use crate::policy::CatalogTool;

use crate::error::envelope;
use crate::state::AppState;

/// The admin router.
pub fn router(state: Arc<AppState>, ui: Arc<crate::approval_ui::ApprovalUi>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/config", get(config))
        .route("/tools", get(tools))
        .route("/tools/{tool_id}", get(tool))
        .route("/capabilities", get(capabilities))
        .merge(crate::approvals::routes())
        .merge(crate::approval_ui::routes(ui))
        .route("/runs/{run_id}/effects", get(effects))
        .route("/runs/{run_id}/events", get(events))
        .route("/host/effect-seams", get(effect_seams))
        .fallback(not_found)
        .with_state(state)
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

async fn healthz() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

/// Ready: both planes listen, no shutdown started, and the journal's durable writes succeed
/// (a failing journal fails every request that needs durability, so it must not get traffic
/// routed to it; readiness returns when a write succeeds again).
async fn readyz(State(s): State<Arc<AppState>>) -> Response {
    if !s.ready.load(Ordering::SeqCst) {
        return envelope(
            StatusCode::SERVICE_UNAVAILABLE,
            "runner_unavailable",
            "turnguard is not ready (starting or shutting down)",
        );
    }
    if let Some(reason) = s.journal.health().failing() {
        return envelope(
            StatusCode::SERVICE_UNAVAILABLE,
            "runner_unavailable",
            &format!("turnguard is not ready: the journal is failing durable writes ({reason})"),
        );
    }
    Json(json!({ "status": "ready" })).into_response()
}

/// Run data needs the admin token or a verified, non-delegated bearer (module docs): the
/// refusal when the caller has neither, `None` when it may read.
fn refuse_run_reader(s: &AppState, headers: &http::HeaderMap) -> Option<Response> {
    let unauthenticated = |message: &str| {
        let mut resp = envelope(StatusCode::UNAUTHORIZED, "unauthenticated", message);
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            http::HeaderValue::from_static("Bearer"),
        );
        resp
    };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    if let (Some(token), Some(admin)) = (bearer, &s.admin_token) {
        if admin.matches(token) {
            return None;
        }
    }
    if s.admin_token.is_none() && !s.identity.configured() && !s.identity.dev_header() {
        return Some(unauthenticated(
            "run data needs a bearer token: configure admin_token_file (--admin-token-file) or an identity provider (--identity-issuer and keys)",
        ));
    }
    match s.identity.approver_of(headers) {
        Ok(p) if !p.delegated => None,
        Ok(_) => Some(envelope(
            StatusCode::FORBIDDEN,
            "forbidden",
            "a delegated token (with an `act` claim) cannot read run data",
        )),
        Err(crate::identity::TokenError::HeldByAgent) => Some(envelope(
            StatusCode::FORBIDDEN,
            "forbidden",
            "a token the agent presented on the data plane cannot read run data",
        )),
        Err(e) => Some(unauthenticated(&format!(
            "run data needs the admin token or a verified bearer token: {e}"
        ))),
    }
}

async fn config(State(s): State<Arc<AppState>>) -> Response {
    let policy = s.policy.snapshot();
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "policy": {
            "revision": policy.revision,
            "origin": policy.origin,
            "mode": policy.settings.mode,
            "tools": policy.catalog.len(),
            "rules": policy.rules.len(),
        },
        "config": s.config,
    }))
    .into_response()
}

/// `?view=compact` (OpenWOP RFC 0112).
#[derive(serde::Deserialize)]
struct ViewQuery {
    view: Option<String>,
}

/// The descriptor as served: the bundle's `ToolDescriptor` plus the MCP `annotations`
/// projection computed from `safetyTier`, `replayPolicy` and `egress` (OpenWOP
/// tool-catalog.md, RFC 0204). Never credential material: the descriptor type has none.
fn served(tool: &CatalogTool, compact: bool) -> Value {
    use crate::policy::bundle::{Egress, ReplayPolicy, SafetyTier};
    let d = &tool.descriptor;
    if compact {
        let mut v = json!({ "toolId": d.tool_id, "source": d.source, "safetyTier": d.safety_tier });
        if let Some(t) = &d.title {
            v["title"] = json!(t);
        }
        if let Some(t) = &d.description {
            v["description"] = json!(t);
        }
        if let Some(schema) = &d.input_schema {
            let schema = Value::Object(schema.clone().into_iter().collect());
            if compact_schema_ok(&schema, true) {
                // The compact subset keeps exactly `type` and `properties` at the top.
                v["inputSchema"] = json!({ "type": "object", "properties": schema["properties"] });
            }
        }
        return v;
    }
    let mut v = serde_json::to_value(d).unwrap_or_else(|_| json!({ "toolId": d.tool_id }));
    v["annotations"] = json!({
        "readOnlyHint": matches!(d.safety_tier, SafetyTier::Pure | SafetyTier::Read),
        "destructiveHint": matches!(d.safety_tier, SafetyTier::Write | SafetyTier::Exec),
        "idempotentHint": matches!(d.replay_policy, Some(ReplayPolicy::Deterministic | ReplayPolicy::Idempotent)),
        "openWorldHint": d.egress != Some(Egress::None),
    });
    v
}

/// The compact view's `inputSchema` is a top-level object with `properties` and none of
/// `$ref`, `oneOf`, `allOf`, `anyOf`, `not`, `patternProperties`, `dependentSchemas` at any
/// depth (RFC 0112); otherwise it is left out.
fn compact_schema_ok(schema: &Value, top: bool) -> bool {
    const BANNED: [&str; 7] = [
        "$ref",
        "oneOf",
        "allOf",
        "anyOf",
        "not",
        "patternProperties",
        "dependentSchemas",
    ];
    match schema {
        Value::Object(m) => {
            if top && (m.get("type") != Some(&json!("object")) || !m.contains_key("properties")) {
                return false;
            }
            !m.keys().any(|k| BANNED.contains(&k.as_str()))
                && m.values().all(|v| compact_schema_ok(v, false))
        }
        Value::Array(a) => a.iter().all(|v| compact_schema_ok(v, false)),
        _ => true,
    }
}

/// `GET /tools`: the tools the caller may invoke, sorted by `toolId` (OpenWOP
/// tool-catalog.md; body `{tools: [...]}` as RFC 0204 and the compact view use).
async fn tools(State(s): State<Arc<AppState>>, Query(q): Query<ViewQuery>) -> Response {
    let policy = s.policy.snapshot();
    let compact = q.view.as_deref() == Some("compact");
    let list: Vec<Value> = policy
        .catalog
        .tools()
        .filter(|t| policy.rules.may_invoke(None, crate::clock::AGENT_ID, t))
        .map(|t| served(t, compact))
        .collect();
    Json(json!({ "tools": list })).into_response()
}

/// `GET /tools/{toolId}`: one descriptor; an unknown id and a tool the caller may not use
/// get the same 404, so the catalog never confirms a tool exists to someone who may not
/// use it.
async fn tool(
    State(s): State<Arc<AppState>>,
    Path(tool_id): Path<String>,
    Query(q): Query<ViewQuery>,
) -> Response {
    let policy = s.policy.snapshot();
    match policy.catalog.by_id(&tool_id) {
        Some(t) if policy.rules.may_invoke(None, crate::clock::AGENT_ID, t) => {
            Json(served(t, q.view.as_deref() == Some("compact"))).into_response()
        }
        _ => envelope(StatusCode::NOT_FOUND, "not_found", "no such tool"),
    }
}

/// The host's capability record for the tool-hook family (OpenWOP
/// `capabilities.toolHooks`): only what is implemented is advertised.
async fn capabilities() -> Response {
    Json(json!({
        "toolHooks": {
            "status": "experimental",
            "since": "2.0",
            "witness": "witnessable-unaided",
            "prePostEvents": true,
            "perToolAuthorization": true,
            "perToolRateLimit": true,
            "turnReplay": true
        },
        "replay": { "modes": ["replay"], "effectSeamsManifest": "/host/effect-seams" },
        "toolCatalog": { "supported": true, "compactView": true }
    }))
    .into_response()
}

fn rfc3339(ms: i64) -> String {
    let t =
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_millis(t).to_string()
}

/// `GET /runs/{runId}/effects`: the effect ledger projection (OpenWOP
/// effect-ledger-projection.schema.json), content-free.
async fn effects(
    State(s): State<Arc<AppState>>,
    Path(run_id): Path<String>,
    headers: http::HeaderMap,
) -> Response {
    if let Some(refused) = refuse_run_reader(&s, &headers) {
        return refused;
    }
    match s.reader.effects(&run_id).await {
        Ok(rows) => {
            let effects: Vec<Value> = rows
                .into_iter()
                .map(|e| {
                    json!({
                        "effectId": e.effect_id,
                        "nodeId": e.node_id.unwrap_or_else(|| "default".into()),
                        "attempt": e.attempt.unwrap_or(1),
                        "keying": e.keying,
                        "state": e.state,
                        "at": rfc3339(e.at_ms),
                    })
                })
                .collect();
            let run_id = crate::recipes::openwop_run_id(&s.config.tenant, &run_id);
            Json(json!({ "runId": run_id, "effects": effects })).into_response()
        }
        _ => envelope(
            StatusCode::SERVICE_UNAVAILABLE,
            "turnguard.journal_unavailable",
            "the journal could not be read",
        ),
    }
}

/// `GET /runs/{runId}/events`: the run's OpenWOP events in sequence order.
async fn events(
    State(s): State<Arc<AppState>>,
    Path(run_id): Path<String>,
    headers: http::HeaderMap,
) -> Response {
    if let Some(refused) = refuse_run_reader(&s, &headers) {
        return refused;
    }
    match s.reader.events(&run_id).await {
        Ok(rows) => {
            let events: Vec<Value> = rows
                .into_iter()
                .map(|crate::journal::EventRow { sequence, kind, payload, at_ms: at, node_id: node }| {
                    let mut e = json!({
                        "runId": run_id, "sequence": sequence, "type": kind,
                        "payload": serde_json::from_str::<Value>(&payload).unwrap_or(Value::Null),
                        "timestamp": rfc3339(at), "schemaVersion": 1,
                    });
                    if let Some(n) = node {
                        e["nodeId"] = json!(n);
                    }
                    e
                })
                .collect();
            Json(json!({ "runId": run_id, "events": events })).into_response()
        }
        _ => envelope(
            StatusCode::SERVICE_UNAVAILABLE,
            "turnguard.journal_unavailable",
            "the journal could not be read",
        ),
    }
}

/// `GET /host/effect-seams` (OpenWOP replay.md, effect-seam-manifest.schema.json): every
/// outbound effect path turnguard guards. Provider-executed tools are effect seams: on
/// replay the recorded round is served, so the provider does not run them again.
async fn effect_seams() -> Response {
    let seam = |id: &str, kind: &str, note: &str| json!({"id": id, "kind": kind, "suppression": "recorded-outcome", "witness": "seam-gated", "note": note});
    Json(json!({
        "manifestVersion": "1",
        "host": { "name": "turnguard", "build": { "kind": "artifact-sha256", "id": env!("CARGO_PKG_VERSION") } },
        "seams": [
            seam("turnguard.client-tool-dispatch", "other", "tool calls released to the agent; on replay recorded calls are answered from recorded results and never released again"),
            seam("turnguard.model-round", "provider", "model rounds (POST /v1/chat/completions, /v1/messages); on replay served from the record, upstream not called"),
            seam("openai.web-search", "provider", "OpenAI provider-executed web_search; output untrusted; suppressed by serving the recorded round"),
            seam("openai.file-search", "provider", "OpenAI provider-executed file_search; output untrusted; suppressed by serving the recorded round"),
            seam("openai.code-interpreter", "provider", "OpenAI provider-executed code_interpreter; output untrusted; suppressed by serving the recorded round"),
            seam("anthropic.web-search", "provider", "Anthropic server tool web_search; output untrusted; suppressed by serving the recorded round"),
            seam("anthropic.web-fetch", "provider", "Anthropic server tool web_fetch; output untrusted; suppressed by serving the recorded round"),
            seam("anthropic.code-execution", "provider", "Anthropic server tool code_execution; output untrusted; suppressed by serving the recorded round")
        ]
    }))
    .into_response()
}

async fn not_found() -> Response {
    envelope(StatusCode::NOT_FOUND, "not_found", "no such admin endpoint")
}
