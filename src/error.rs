//! Errors turnguard authors on the wire, mapped in one place to (HTTP status, OpenWOP code,
//! reason label).
//!
//! The body is the OpenWOP error envelope `{error, message, details?}` (OpenWOP
//! `spec/v2/core/errors.md`; codes from `shared/spec/openwop/errors.json`). Codes the registry
//! lacks use the vendor form `turnguard.<name>`. Upstream errors are never wrapped: they are
//! passed through unchanged by the proxy and never reach this type.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use serde_json::{json, Value};

/// An error turnguard itself answers with. Each variant has exactly one status, code and
/// reason label; the same reason feeds the metric label, the journal and the JSON body.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// No route serves this method and path (DESIGN.md §1: everything off the allowlist is 404).
    #[error("no route for {method} {path}: turnguard serves only the provider APIs it admits")]
    RouteNotFound { method: String, path: String },
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

    /// The OpenWOP envelope `{error, message, details?}` for this error.
    pub fn body(&self) -> Value {
        let (_, code, reason) = self.parts();
        let mut details = json!({ "reason": reason, "source": "turnguard" });
        match self {
            Self::PayloadTooLarge { limit_bytes } => {
                details["limitBytes"] = json!(limit_bytes);
                details["flag"] = json!("--max-body-bytes");
            }
            Self::RequestTimeout { limit_ms } => {
                details["limitMs"] = json!(limit_ms);
                details["flag"] = json!("--body-read-timeout-ms");
            }
            Self::SchemaTooLarge {
                bytes, limit_bytes, ..
            } => {
                details["bytes"] = json!(bytes);
                details["limitBytes"] = json!(limit_bytes);
                details["flag"] = json!("--max-schema-bytes");
            }
            Self::UpstreamUnavailable { upstream, .. }
            | Self::UpstreamNotConfigured { upstream } => {
                details["upstream"] = json!(upstream);
            }
            Self::Overloaded {
                limit,
                retry_after_s,
            } => {
                details["limit"] = json!(limit);
                details["retryAfterSeconds"] = json!(retry_after_s);
            }
            Self::ShuttingDown { retry_after_s } => {
                details["retryAfterSeconds"] = json!(retry_after_s);
            }
            Self::ProviderDelegationInRun { what } => {
                details["field"] = json!(what);
            }
            _ => {}
        }
        json!({ "error": code, "message": self.to_string(), "details": details })
    }
}

impl IntoResponse for WireError {
    fn into_response(self) -> Response {
        let (status, _, _) = self.parts();
        let body = self.body().to_string();
        let mut resp = (status, body).into_response();
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Self::Overloaded { retry_after_s, .. } | Self::ShuttingDown { retry_after_s } = &self
        {
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(*retry_after_s));
        }
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

/// The OpenWOP envelope for a status and code authored outside [`WireError`] (admin plane).
pub fn envelope(status: StatusCode, code: &str, message: &str) -> Response {
    let body = json!({ "error": code, "message": message }).to_string();
    let mut resp = (status, body).into_response();
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}
