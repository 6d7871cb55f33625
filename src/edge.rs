//! The data-plane edge: one tower-style layer (an axum `from_fn` middleware) around every
//! data-plane route, for the generic concerns only (STYLE.md: "Tower layers only for generic
//! concerns"):
//!
//! - **load shedding**: a global concurrency limit (`max_concurrent_requests`). A request
//!   arriving while turnguard drains after SIGTERM is answered at once with 503,
//!   `Retry-After` and the OpenWOP error body ([`WireError::ShuttingDown`]). The concurrency
//!   permit is taken only once the request body has been read ([`admit`], called by the
//!   request path right after its capped, deadlined body read), so a client trickling its
//!   body holds none (issue 11); past the limit the request is answered 503
//!   ([`WireError::Overloaded`]) before any upstream work. The permit is held until the
//!   response body — a whole stream — has been sent, so streams count against the limit for
//!   their whole life.
//! - **request identity**: `x-request-id` is kept when the agent sent a sane one (ASCII
//!   graphic, ≤ 200 bytes), else replaced by a UUID, before the request path sees it; it is
//!   echoed on every response and forwarded upstream. W3C `traceparent` / `tracestate` are
//!   forwarded untouched by the upstream leg; the trace id is logged.
//! - **the access log**: exactly one structured line per request, when its body has been sent
//!   or abandoned (`request_id`, `api`, `method`, `status`, `stream`, `duration_ms`,
//!   `added_ms`, `upstream_ms`, `bytes`, `complete`, `trace_id`). It never holds a header
//!   value other than the request and trace ids, and no body.
//! - **timing**: `turnguard_request_duration_seconds` and `turnguard_proxy_added_seconds`.
//!   The request path reports its upstream waits through [`upstream_waited`] (a task-local set
//!   here), so "added" is the time spent in turnguard excluding waits on the upstream: for a
//!   JSON response, arrival to response headers minus upstream waits (headers and body); for a
//!   stream, the same up to the response headers plus the relay's framing and adapter time per
//!   upstream chunk ([`Timing::add_work`]; admission at a decision point is measured apart, in
//!   `turnguard_stream_hold_seconds`, because it may wait on policy state). Repair rounds of a
//!   stream are sent from the relay task, outside this scope: their upstream waits are not
//!   subtracted, and their chunks count as relay work.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Surface, WireError};
use crate::metrics::{ApiLabel, EdgeLabels, ShedLabels, ShedReason};
use crate::state::AppState;

/// The edge's own state: the shared app state and the concurrency permits.
pub struct Edge {
    state: Arc<AppState>,
    permits: Arc<Semaphore>,
}

impl Edge {
    /// An edge allowing `config.max_concurrent_requests` requests at once.
    pub fn new(state: Arc<AppState>) -> Arc<Self> {
        let permits = Arc::new(Semaphore::new(state.config.max_concurrent_requests));
        Arc::new(Self { state, permits })
    }

    /// The shared app state the edge serves.
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }
}

tokio::task_local! {
    static TIMING: Arc<Timing>;
}

/// Per-request timing shared between the edge and the request path.
#[derive(Debug, Default)]
pub struct Timing {
    upstream_wait_ns: AtomicU64,
    work_ns: AtomicU64,
    sent: OnceLock<Instant>,
}

impl Timing {
    /// Adds processing time spent after the response headers (the stream relay).
    pub fn add_work(&self, d: Duration) {
        self.work_ns.fetch_add(nanos(d), Ordering::Relaxed);
    }

    /// When the request was sent upstream, if it was.
    pub fn upstream_sent(&self) -> Option<Instant> {
        self.sent.get().copied()
    }

    fn upstream_wait(&self) -> Duration {
        Duration::from_nanos(self.upstream_wait_ns.load(Ordering::Relaxed))
    }

    fn work(&self) -> Duration {
        Duration::from_nanos(self.work_ns.load(Ordering::Relaxed))
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The current request's timing, when called inside the edge (the request path's task).
pub fn current() -> Option<Arc<Timing>> {
    TIMING.try_with(Arc::clone).ok()
}

/// Reports a wait on the upstream of `d` that started at `since` (the upstream leg calls it
/// for the response headers, the request path for a JSON response body). Outside the edge
/// (tests calling the request path directly) it does nothing.
pub fn upstream_waited(since: Instant, d: Duration) {
    let _ = TIMING.try_with(|t| {
        let _ = t.sent.set(since);
        t.upstream_wait_ns.fetch_add(nanos(d), Ordering::Relaxed);
    });
}

/// The provider API label of a data-plane route (the same labels as
/// `turnguard_requests_total`), from the path only.
fn api_of(path: &str) -> ApiLabel {
    if let Some(api) = crate::model::Api::of_path(path) {
        return ApiLabel::Api(api);
    }
    match path {
        "/v1/messages/count_tokens" | "/v1/embeddings" => ApiLabel::Passthrough,
        p if p == "/v1/models" || p.starts_with("/v1/models/") => ApiLabel::Passthrough,
        p if p.starts_with("/mcp/") => ApiLabel::Mcp,
        _ => ApiLabel::None,
    }
}

/// `x-request-id`, made at compile time. A `&str` name is parsed on every lookup, and on an
/// insert checked byte by byte as well (`HdrName::from_static`, ~600 instructions an insert
/// under callgrind: issue 13, profile-led); a `HeaderName` is hashed as it is.
pub(crate) const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// `traceparent` (W3C Trace Context), made at compile time as [`X_REQUEST_ID`] is.
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The agent's `x-request-id` when it is sane: trimmed, 1–200 bytes, ASCII graphic.
pub(crate) fn sane_request_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty() && v.len() <= 200 && v.chars().all(|c| c.is_ascii_graphic()))
        // It is echoed, logged and journaled (`rounds.client_request_id`): an id that holds
        // a secret the built-in recognizers know is replaced, never kept.
        .filter(|v| {
            matches!(
                crate::policy::redact::builtins().redact_str(v),
                std::borrow::Cow::Borrowed(_)
            )
        })
        .map(str::to_owned)
}

/// A request id turnguard makes up: a UUIDv7, time-ordered, because it is also the request's
/// journal id ([`crate::request::RequestCtx::journal_id`]) and a random key would put every
/// record on a random page of the indexes keyed by it.
pub(crate) fn fresh_request_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// A request's id as the edge settled it: the agent's sane `x-request-id`, or one turnguard
/// made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RequestId {
    /// The agent's own `x-request-id` (kept when sane): correlation only, never a journal
    /// key, because an agent may send one id twice.
    Agent(String),
    /// A fresh UUIDv7 turnguard made because the agent sent none, or none it could keep:
    /// unique, so it is also the request's journal id.
    Made(String),
}

impl RequestId {
    /// The agent's sane `x-request-id`, else a fresh one.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        sane_request_id(headers).map_or_else(|| Self::Made(fresh_request_id()), Self::Agent)
    }

    /// The id as echoed in `x-request-id` and logged.
    pub(crate) fn as_str(&self) -> &str {
        match self {
            Self::Agent(id) | Self::Made(id) => id,
        }
    }

    fn into_string(self) -> String {
        match self {
            Self::Agent(id) | Self::Made(id) => id,
        }
    }
}

/// Keeps a sane `x-request-id` (ASCII graphic, 1–200 bytes), else sets a fresh UUIDv7.
/// Returns the id.
fn ensure_request_id(headers: &mut HeaderMap) -> RequestId {
    let id = RequestId::of(headers);
    if let Ok(v) = HeaderValue::from_str(id.as_str()) {
        headers.insert(X_REQUEST_ID, v);
    }
    id
}

/// The trace id of a valid W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`), for the log.
/// The header itself is forwarded upstream unchanged whether or not it is valid.
fn trace_id(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(&TRACEPARENT)?.to_str().ok()?;
    let mut parts = v.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hex(version, 2) && hex(trace, 32) && hex(span, 16) && hex(flags, 2))
        .then(|| trace.to_ascii_lowercase())
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        })
}

/// The concurrency permit of one request, taken by [`admit`] once its body is read and
/// held until its response body ends (the edge's access log and the request path both keep
/// this alive; the permit goes back when the last of them drops it).
pub struct Admission {
    edge: Arc<Edge>,
    request_id: RequestId,
    permit: std::sync::Mutex<Option<OwnedSemaphorePermit>>,
}

/// The request id the edge gave the request whose extensions these are (the sane
/// `x-request-id` it kept, or the fresh one it set in that header); `None` for a request that
/// did not pass the edge.
pub(crate) fn edge_request_id(extensions: &http::Extensions) -> Option<&RequestId> {
    extensions.get::<Arc<Admission>>().map(|a| &a.request_id)
}

/// Takes the concurrency permit of the request whose extensions these are, after its body
/// was read. A request outside the edge (no [`Admission`] in its extensions) takes none.
///
/// Errors: [`WireError::Overloaded`] (503, `Retry-After`) when `max_concurrent_requests`
/// requests already hold one; counted in `turnguard_shed_requests_total{reason="overloaded"}`.
pub fn admit(extensions: &http::Extensions) -> Result<(), WireError> {
    let Some(a) = extensions.get::<Arc<Admission>>() else {
        return Ok(());
    };
    let Ok(mut slot) = a.permit.lock() else {
        return Err(WireError::Internal {
            reason: "the admission slot is poisoned".into(),
        });
    };
    if slot.is_some() {
        return Ok(());
    }
    match Arc::clone(&a.edge.permits).try_acquire_owned() {
        Ok(p) => {
            *slot = Some(p);
            Ok(())
        }
        Err(_) => {
            let config = &a.edge.state.config;
            a.edge
                .state
                .metrics
                .shed_requests
                .get_or_create(&ShedLabels {
                    reason: ShedReason::Overloaded,
                })
                .inc();
            tracing::warn!(
                target: "turnguard::access",
                request_id = a.request_id.as_str(),
                shed = ShedReason::Overloaded.as_str(),
                limit = config.max_concurrent_requests,
                "request shed"
            );
            Err(WireError::Overloaded {
                limit: config.max_concurrent_requests,
                retry_after_s: config.shed_retry_after_s,
            })
        }
    }
}

/// The middleware: shed while draining, identify, time, and log once (see the module docs).
/// The data plane's routes other than the three model APIs pass through it; those three are
/// served by [`crate::server`]'s data-plane service, which calls [`around`] directly.
pub async fn layer(State(edge): State<Arc<Edge>>, req: Request, next: Next) -> Response {
    around(&edge, req, |req| next.run(req)).await
}

/// The edge's work around one data-plane request: shed while draining, identify, time, and
/// log once (see the module docs); `inner` serves the request (a route of the data router,
/// or the request path of a model API without axum's routing: the data plane's hot path,
/// issue 13 item 6, profile-led — the router and the middleware's boxed inner service cost
/// ~3.6 % of a c=64 request's CPU).
pub async fn around<F, Fut>(edge: &Arc<Edge>, mut req: Request, inner: F) -> Response
where
    F: FnOnce(Request) -> Fut,
    Fut: std::future::Future<Output = Response>,
{
    let started = Instant::now();
    let api = api_of(req.uri().path());
    let method = req.method().clone();
    let request_id = ensure_request_id(req.headers_mut());
    let trace = trace_id(req.headers());
    let metrics = &edge.state.metrics;

    if edge.state.lifecycle.draining() {
        let reason = ShedReason::ShuttingDown;
        let retry_after_s = edge.state.config.shed_retry_after_s;
        metrics
            .shed_requests
            .get_or_create(&ShedLabels { reason })
            .inc();
        metrics.request(api, 503, false);
        let mut resp = WireError::ShuttingDown { retry_after_s }
            .response(Surface::of_request(req.uri().path(), req.headers()));
        set_request_id(resp.headers_mut(), request_id.as_str());
        tracing::warn!(
            target: "turnguard::access",
            request_id = request_id.as_str(),
            api = api.as_str(),
            method = method.as_str(),
            status = 503u16,
            stream = false,
            duration_ms = ms(started.elapsed()),
            shed = reason.as_str(),
            trace_id = trace.as_deref().unwrap_or(""),
            "request shed"
        );
        return resp;
    }
    let admission = Arc::new(Admission {
        edge: Arc::clone(edge),
        request_id: request_id.clone(),
        permit: std::sync::Mutex::new(None),
    });
    req.extensions_mut().insert(Arc::clone(&admission));

    let timing = Arc::new(Timing::default());
    let mut resp = TIMING.scope(Arc::clone(&timing), inner(req)).await;
    set_request_id(resp.headers_mut(), request_id.as_str());
    let stream = is_event_stream(resp.headers());
    let at_headers = started.elapsed();
    let labels = EdgeLabels { api, stream };
    let before_body = at_headers.saturating_sub(timing.upstream_wait());
    let log = AccessLog {
        state: Arc::clone(&edge.state),
        labels,
        request_id: request_id.into_string(),
        method,
        status: resp.status().as_u16(),
        trace_id: trace,
        started,
        before_body,
        timing,
        bytes: 0,
        _admission: admission,
    };
    let (parts, body) = resp.into_parts();
    Response::from_parts(
        parts,
        Body::new(EdgeBody {
            inner: body,
            log: Some(log),
        }),
    )
}

fn set_request_id(headers: &mut HeaderMap, id: &str) {
    if !headers.contains_key(&X_REQUEST_ID) {
        if let Ok(v) = HeaderValue::from_str(id) {
            headers.insert(X_REQUEST_ID, v);
        }
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// What the access log line and the edge histograms need once the body is done. Holds the
/// request's [`Admission`] (its concurrency permit), so the request counts against the limit
/// until then.
struct AccessLog {
    state: Arc<AppState>,
    labels: EdgeLabels,
    request_id: String,
    method: http::Method,
    status: u16,
    trace_id: Option<String>,
    started: Instant,
    before_body: Duration,
    timing: Arc<Timing>,
    bytes: u64,
    _admission: Arc<Admission>,
}

impl AccessLog {
    fn finish(self, complete: bool) {
        let duration = self.started.elapsed();
        let stream = self.labels.stream;
        // A JSON response's work is all before its headers; a stream adds the relay's work.
        let added = if stream {
            self.before_body + self.timing.work()
        } else {
            self.before_body
        };
        let m = &self.state.metrics;
        m.request_times(&self.labels, duration.as_secs_f64(), added.as_secs_f64());
        tracing::info!(
            target: "turnguard::access",
            request_id = self.request_id.as_str(),
            api = self.labels.api.as_str(),
            method = self.method.as_str(),
            status = self.status,
            stream,
            duration_ms = ms(duration),
            added_ms = ms(added),
            upstream_ms = ms(self.timing.upstream_wait()),
            bytes = self.bytes,
            complete,
            trace_id = self.trace_id.as_deref().unwrap_or(""),
            "request"
        );
    }
}

/// The response body, passed through frame by frame; logs when it ends or is dropped.
struct EdgeBody {
    inner: Body,
    log: Option<AccessLog>,
}

impl HttpBody for EdgeBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(log)) = (frame.data_ref(), this.log.as_mut()) {
                    log.bytes += data.len() as u64;
                }
                if this.inner.is_end_stream() {
                    if let Some(log) = this.log.take() {
                        log.finish(true);
                    }
                }
            }
            Poll::Ready(None) => {
                if let Some(log) = this.log.take() {
                    log.finish(true);
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(log) = this.log.take() {
                    log.finish(false);
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for EdgeBody {
    fn drop(&mut self) {
        if let Some(log) = self.log.take() {
            // An empty body may never be polled; anything else dropped early was abandoned.
            let complete = self.inner.is_end_stream();
            log.finish(complete);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_kept_when_sane_and_replaced_otherwise() {
        let mut h = HeaderMap::new();
        h.insert("x-request-id", HeaderValue::from_static("abc-123"));
        assert_eq!(
            ensure_request_id(&mut h),
            RequestId::Agent("abc-123".into())
        );
        let mut h = HeaderMap::new();
        h.insert("x-request-id", HeaderValue::from_static("has space"));
        let id = ensure_request_id(&mut h);
        assert!(
            matches!(&id, RequestId::Made(made) if made != "has space"),
            "{id:?}"
        );
        assert_eq!(h["x-request-id"], id.as_str());
        let mut h = HeaderMap::new();
        let id = ensure_request_id(&mut h);
        assert!(
            matches!(&id, RequestId::Made(made) if made.len() == 36),
            "a UUID: {id:?}"
        );
    }

    #[test]
    fn only_valid_traceparents_yield_a_trace_id() {
        let mut h = HeaderMap::new();
        h.insert(
            "traceparent",
            HeaderValue::from_static("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"),
        );
        assert_eq!(
            trace_id(&h).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        h.insert(
            "traceparent",
            HeaderValue::from_static("00-xyz-00f067aa0ba902b7-01"),
        );
        assert_eq!(trace_id(&h), None);
    }

    #[test]
    fn routes_map_to_the_request_metric_labels() {
        assert_eq!(api_of("/v1/chat/completions").as_str(), "openai_chat");
        assert_eq!(api_of("/v1/messages").as_str(), "anthropic_messages");
        assert_eq!(api_of("/v1/models/gpt-4o").as_str(), "passthrough");
        assert_eq!(api_of("/v1/responses").as_str(), "openai_responses");
        assert_eq!(api_of("/v1/files").as_str(), "none");
    }
}
