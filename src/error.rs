//! Errors turnguard authors on the wire, mapped in one place to (HTTP status, OpenWOP code,
//! reason label).
//!
//! Every error carries the OpenWOP code, message and details (OpenWOP `spec/v2/core/errors.md`;
//! codes from `shared/spec/openwop/errors.json`; codes the registry lacks use the vendor form
//! `turnguard.<name>`) inside the error shape of the surface it answers on ([`Surface`],
//! DESIGN.md §7): the OpenAI shape on OpenAI's paths, the Anthropic shape on Anthropic's, the
//! OpenWOP envelope `{error, message, details?}` on the admin plane. Upstream errors are never
//! wrapped: they are passed through unchanged by the proxy and never reach this type.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use serde_json::{json, Map, Value};

use crate::model::Api;

/// An error turnguard itself answers with. Each variant has exactly one status, code and
/// reason label; the same reason feeds the metric label, the journal and the JSON body.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// No route serves this method and path (DESIGN.md §1: everything off the allowlist is 404).
    #[error("no route for {method} {path}: turnguard serves only the provider APIs it admits")]
    RouteNotFound { method: String, path: String },
    /// A WebSocket handshake on a provider path (`GET /v1/responses` with `Upgrade:
    /// websocket`, the Responses WebSocket transport): turnguard admits that API over HTTP
    /// only, and answers 426 so a client falls back to HTTP at once (Codex does on 426 only;
    /// any other status it retries as a failed connection).
    #[error("turnguard serves {path} over HTTP only, not as a WebSocket: send the request as an HTTP POST")]
    WebSocketNotServed { path: String },
    /// The request body exceeded the configured cap (`max_body_bytes`).
    #[error("request body exceeds the {limit_bytes}-byte cap (max_body_bytes; raise it with --max-body-bytes)")]
    PayloadTooLarge { limit_bytes: usize },
    /// The client did not send its whole request body within `body_read_timeout_ms` (a slow
    /// or stalled client; issue 11).
    #[error("the request body did not arrive within {limit_ms} ms (body_read_timeout_ms; raise it with --body-read-timeout-ms)")]
    RequestTimeout { limit_ms: u64 },
    /// A schema the request declares (a tool's parameters, a `response_format` schema) is
    /// larger than turnguard compiles (`max_schema_bytes`; issue 11: compiled schemas are
    /// bounded in memory).
    #[error("the {what} is {bytes} bytes; turnguard compiles schemas of at most {limit_bytes} bytes (max_schema_bytes; raise it with --max-schema-bytes)")]
    SchemaTooLarge {
        what: String,
        bytes: usize,
        limit_bytes: usize,
    },
    /// The request body is not the JSON the API expects.
    #[error("request body is not valid: {reason}")]
    InvalidRequest { reason: String },
    /// The upstream could not be reached or did not answer in time.
    #[error("upstream `{upstream}` is unavailable: {reason}")]
    UpstreamUnavailable { upstream: String, reason: String },
    /// The configured upstream for this API is missing.
    #[error("no upstream named `{upstream}` is configured")]
    UpstreamNotConfigured { upstream: String },
    /// A required record could not be written (tool-turn contract §D: a record failure fails
    /// the request).
    #[error("the journal could not record this request: {reason}")]
    JournalUnavailable { reason: String },
    /// The data plane is at its concurrency limit (`max_concurrent_requests`); the request
    /// was shed before any work (issue 6: load shedding, 503 with `Retry-After`).
    #[error(
        "turnguard is at its limit of {limit} concurrent requests; retry after {retry_after_s} s"
    )]
    Overloaded { limit: usize, retry_after_s: u64 },
    /// turnguard is draining after SIGTERM and takes no new requests.
    #[error("turnguard is shutting down; retry after {retry_after_s} s")]
    ShuttingDown { retry_after_s: u64 },
    /// `Turnguard-Principal-Token` was sent but does not verify (tool-turn contract §C: a
    /// bad token never reads as "no person").
    #[error("the principal token is not accepted: {reason}")]
    Unauthenticated { reason: String },
    /// The request needs a capability its model or provider lacks (§E: a clarification
    /// through a tool, for a model without tool support).
    #[error("{reason}")]
    CapabilityNotProvided { reason: String },
    /// Same-attempt recovery found a released, non-re-runnable call with no recorded result
    /// (tool-turn contract §D).
    #[error("the outcome of released call(s) is unknown and they are not re-runnable: {calls}")]
    ToolOutcomeUnknown { calls: String },
    /// Replay reached a position with no usable record (tool-turn contract §D; OpenWOP
    /// replay.md).
    #[error("replay has no record to serve: {reason}")]
    ReplaySourceMissing { reason: String },
    /// Inside a run, the request asks the provider to make MCP (or A2A) calls on the agent's
    /// behalf, e.g. a Responses `tools[].type = "mcp"` (tool-turn contract §F: a host MUST NOT
    /// delegate an MCP or A2A call to provider execution inside a run).
    #[error("inside a run, turnguard does not let the provider make MCP or A2A calls: remove {what} (or send the request without `Turnguard-Run`)")]
    ProviderDelegationInRun { what: String },
    /// An invariant turnguard relies on did not hold.
    #[error("internal error: {reason}")]
    Internal { reason: String },
}

impl WireError {
    /// The HTTP status, the OpenWOP error code and the reason label (metrics, journal).
    pub fn parts(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            Self::RouteNotFound { .. } => (StatusCode::NOT_FOUND, "not_found", "route_not_found"),
            Self::WebSocketNotServed { .. } => (
                StatusCode::UPGRADE_REQUIRED,
                "upgrade_required",
                "websocket_not_served",
            ),
            Self::PayloadTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "payload_too_large",
            ),
            Self::RequestTimeout { .. } => (
                StatusCode::REQUEST_TIMEOUT,
                "turnguard.request_timeout",
                "body_read_timeout",
            ),
            Self::SchemaTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "schema_too_large",
            ),
            Self::InvalidRequest { .. } => (
                StatusCode::BAD_REQUEST,
                "validation_error",
                "invalid_request",
            ),
            // `upstream_unavailable` is registered (502) in the newer OpenWOP errors.md
            // (shared/reference/openwop-spec.md §5).
            Self::UpstreamUnavailable { .. } => (
                StatusCode::BAD_GATEWAY,
                "upstream_unavailable",
                "upstream_unavailable",
            ),
            Self::UpstreamNotConfigured { .. } => (
                StatusCode::BAD_GATEWAY,
                "upstream_unavailable",
                "upstream_not_configured",
            ),
            Self::JournalUnavailable { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "turnguard.journal_unavailable",
                "journal_unavailable",
            ),
            Self::Unauthenticated { .. } => (
                StatusCode::UNAUTHORIZED,
                "unauthenticated",
                "principal_token_invalid",
            ),
            Self::CapabilityNotProvided { .. } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "capability_not_provided",
                "capability_not_provided",
            ),
            // `runner_unavailable` (503, retriable) is the registered code for "cannot take
            // work now"; the reason label tells the two apart.
            Self::Overloaded { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "runner_unavailable",
                "overloaded",
            ),
            Self::ShuttingDown { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "runner_unavailable",
                "shutting_down",
            ),
            Self::ToolOutcomeUnknown { .. } => (
                StatusCode::CONFLICT,
                "turnguard.tool_outcome_unknown",
                "tool_outcome_unknown",
            ),
            Self::ReplaySourceMissing { .. } => (
                StatusCode::NOT_FOUND,
                "replay_source_missing",
                "replay_source_missing",
            ),
            // `forbidden` (403): the body is a valid provider request, so not
            // `validation_error`; turnguard understood it and refuses it by rule, and the same
            // request without the delegated tool would be served. `capability_not_provided`
            // (422) means the host lacks something a run needs, and `sandbox_capability_denied`
            // is about sandboxes; neither is this refusal.
            Self::ProviderDelegationInRun { .. } => (
                StatusCode::FORBIDDEN,
                "forbidden",
                "provider_delegation_in_run",
            ),
            Self::Internal { .. } => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "internal",
            ),
        }
    }

    /// `details` of the OpenWOP envelope: the reason label, `source: turnguard`, and what the
    /// variant knows (limits, the upstream's name, the refused field).
    pub fn details(&self) -> Value {
        let (_, _, reason) = self.parts();
        let mut details = Map::new();
        details.insert("reason".into(), json!(reason));
        details.insert("source".into(), json!("turnguard"));
        match self {
            Self::PayloadTooLarge { limit_bytes } => {
                details.insert("limitBytes".into(), json!(limit_bytes));
                details.insert("flag".into(), json!("--max-body-bytes"));
            }
            Self::RequestTimeout { limit_ms } => {
                details.insert("limitMs".into(), json!(limit_ms));
                details.insert("flag".into(), json!("--body-read-timeout-ms"));
            }
            Self::SchemaTooLarge {
                bytes, limit_bytes, ..
            } => {
                details.insert("bytes".into(), json!(bytes));
                details.insert("limitBytes".into(), json!(limit_bytes));
                details.insert("flag".into(), json!("--max-schema-bytes"));
            }
            Self::UpstreamUnavailable { upstream, .. }
            | Self::UpstreamNotConfigured { upstream } => {
                details.insert("upstream".into(), json!(upstream));
            }
            Self::Overloaded {
                limit,
                retry_after_s,
            } => {
                details.insert("limit".into(), json!(limit));
                details.insert("retryAfterSeconds".into(), json!(retry_after_s));
            }
            Self::ShuttingDown { retry_after_s } => {
                details.insert("retryAfterSeconds".into(), json!(retry_after_s));
            }
            Self::ProviderDelegationInRun { what } => {
                details.insert("field".into(), json!(what));
            }
            _ => {}
        }
        Value::Object(details)
    }

    /// The OpenWOP envelope `{error, message, details}` for this error (the admin plane's
    /// shape; [`WireError::response`] shapes it for the surface it answers on).
    pub fn body(&self) -> Value {
        let (_, code, _) = self.parts();
        json!({ "error": code, "message": self.to_string(), "details": self.details() })
    }

    /// The HTTP response for this error on `surface`: the status, the body in that surface's
    /// error shape ([`Authored::body`]), `Retry-After` when the client should come back, and
    /// `Connection: close` while shutting down.
    pub fn response(&self, surface: Surface) -> Response {
        let (status, code, _) = self.parts();
        let retry_after = match self {
            Self::Overloaded { retry_after_s, .. } | Self::ShuttingDown { retry_after_s } => {
                Some(*retry_after_s)
            }
            _ => None,
        };
        let mut resp = Authored {
            status,
            code,
            message: self.to_string(),
            details: Some(self.details()),
            retry_after,
        }
        .response(surface);
        if matches!(
            self,
            Self::ShuttingDown { .. } | Self::RequestTimeout { .. }
        ) {
            resp.headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// The API surface an error answers on. Each takes the error shape its clients' SDKs read, so
/// the SDK's exception shows turnguard's message (DESIGN.md §7):
///
/// - [`Surface::OpenAi`]: `{"error": {"message", "type", "code", "param", "details"}}` —
///   Chat Completions, Responses and the passthrough endpoints OpenAI serves under `/v1`
///   (openai-python and openai-node read `error.message`, `error.code`, `error.type`);
/// - [`Surface::Anthropic`]: `{"type": "error", "error": {"type", "message", "code",
///   "details"}}` — `/v1/messages`, `/v1/messages/count_tokens` and Anthropic's other paths;
/// - [`Surface::OpenWop`]: the OpenWOP envelope `{error, message, details?}` — the admin plane
///   and anything that is no provider's path.
///
/// `code` is always the OpenWOP code (`shared/spec/openwop/errors.json`, or the vendor form
/// `turnguard.<name>`), and `message` starts with `turnguard <code>:` so the code reaches the
/// developer even through an SDK that prints only the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    OpenAi,
    Anthropic,
    OpenWop,
}

impl Surface {
    /// The surface of a model API.
    pub fn of_api(api: Api) -> Self {
        match api {
            Api::OpenAiChat | Api::OpenAiResponses => Self::OpenAi,
            Api::AnthropicMessages => Self::Anthropic,
        }
    }

    /// The surface of a data-plane request by its path and headers: Anthropic for
    /// `/v1/messages…` and `/v1/complete`, or any `/v1/` path an Anthropic client sends (it
    /// always sends `anthropic-version`); OpenAI for the other `/v1/` paths; OpenWOP outside
    /// `/v1/`.
    pub fn of_request(path: &str, headers: &http::HeaderMap) -> Self {
        let under_v1 = path == "/v1" || path.starts_with("/v1/");
        if !under_v1 {
            return Self::OpenWop;
        }
        let anthropic_path =
            path == "/v1/messages" || path.starts_with("/v1/messages/") || path == "/v1/complete";
        if anthropic_path || headers.contains_key("anthropic-version") {
            Self::Anthropic
        } else {
            Self::OpenAi
        }
    }
}

/// An error turnguard authored, with what every surface's shape needs.
#[derive(Debug, Clone)]
pub struct Authored<'a> {
    /// HTTP status.
    pub status: StatusCode,
    /// The OpenWOP error code.
    pub code: &'a str,
    /// Human-readable, host-authored.
    pub message: String,
    /// OpenWOP `details` (reason label, `source`, limits …).
    pub details: Option<Value>,
    /// `Retry-After`, seconds.
    pub retry_after: Option<u64>,
}

impl Authored<'_> {
    /// The body in `surface`'s shape (see [`Surface`]).
    pub fn body(&self, surface: Surface) -> Value {
        let message = format!("turnguard {}: {}", self.code, self.message);
        match surface {
            Surface::OpenWop => {
                let mut body = json!({ "error": self.code, "message": self.message });
                if let Some(d) = &self.details {
                    body["details"] = d.clone();
                }
                body
            }
            Surface::OpenAi => {
                let mut error = json!({
                    "message": message,
                    "type": openai_type(self.status),
                    "code": self.code,
                    "param": Value::Null,
                });
                if let Some(d) = &self.details {
                    error["details"] = d.clone();
                }
                json!({ "error": error })
            }
            Surface::Anthropic => {
                let mut error = json!({
                    "type": anthropic_type(self.status),
                    "message": message,
                    "code": self.code,
                });
                if let Some(d) = &self.details {
                    error["details"] = d.clone();
                }
                json!({ "type": "error", "error": error })
            }
        }
    }

    /// The HTTP response: status, JSON body in `surface`'s shape, `Retry-After` if set.
    pub fn response(&self, surface: Surface) -> Response {
        let mut resp = (self.status, self.body(surface).to_string()).into_response();
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// OpenAI's `error.type` for a status (the types its API and SDKs use).
fn openai_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 => "service_unavailable_error",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    }
}

/// Anthropic's `error.type` for a status (Anthropic API errors).
fn anthropic_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The OpenWOP envelope for a status and code authored outside [`WireError`] (admin plane).
pub fn envelope(status: StatusCode, code: &str, message: &str) -> Response {
    Authored {
        status,
        code,
        message: message.to_owned(),
        details: None,
        retry_after: None,
    }
    .response(Surface::OpenWop)
}
