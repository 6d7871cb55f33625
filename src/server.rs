//! Binds the data plane and the admin plane, opens the journal, and wires the shared state.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use futures_util::future::Either;
use http::Request;
use hyper::body::Incoming;
use hyper_util::service::{TowerToHyperService, TowerToHyperServiceFuture};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use crate::admission::{LimitState, SchemaCache};
use crate::config::Config;
use crate::error::{Surface, WireError};
use crate::identity::{Identity, IdentityConfigError};
use crate::journal::{Journal, JournalError, WriterThread};
use crate::metrics::{GaugeGuard, Metrics};
use crate::model::Api;
use crate::notify::{Notifier, Webhook};
use crate::proxy::{self, upstream};
use crate::reload::{self, LoadError, PolicyHandle};
use crate::state::{AdminToken, AppState, Approvals, Lifecycle};

/// Why `serve` could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A listener could not bind.
    #[error("cannot listen on {addr}: {reason}")]
    Bind { addr: SocketAddr, reason: String },
    /// The journal could not be opened.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// The identity configuration cannot be used.
    #[error(transparent)]
    Identity(#[from] IdentityConfigError),
    /// The admin token file cannot be used.
    #[error("admin_token_file {file}: {reason}")]
    AdminToken { file: String, reason: String },
    /// The approval page or webhook settings cannot be used.
    #[error("approval page or webhook settings")]
    ApprovalUi(#[from] crate::notify::UiConfigError),
    /// The policy bundle does not load.
    #[error("policy bundle {dir} does not load")]
    Policy { dir: String, source: LoadError },
}

/// A running turnguard: its bound addresses and the handle to stop it.
pub struct Running {
    /// The data-plane address actually bound.
    pub addr: SocketAddr,
    /// The admin-plane address actually bound.
    pub admin_addr: SocketAddr,
    /// The shared state (for in-process tests and shutdown).
    pub state: Arc<AppState>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    watcher: JoinHandle<()>,
    pruner: JoinHandle<()>,
    health: JoinHandle<()>,
    writer: WriterThread,
}

impl Running {
    /// Graceful shutdown: readiness goes false, listeners stop accepting, in-flight requests
    /// and streams finish within `shutdown_grace_ms` (then are cut), then the journal queue
    /// is flushed and closed. See [`crate::shutdown`].
    pub async fn shutdown(self) -> crate::shutdown::ShutdownReport {
        self.watcher.abort();
        self.pruner.abort();
        self.health.abort();
        crate::shutdown::sequence(self.state, self.stop, self.tasks, self.writer).await
    }
}

/// Binds both planes and starts serving.
///
/// Errors: [`StartError`] naming the address or journal path that failed.
pub async fn start(config: Config) -> Result<Running, StartError> {
    let metrics = Arc::new(Metrics::new());
    let identity = Identity::load(&config)?;
    log_identity(&identity);
    let policy = load_policy(&config, &metrics)?;
    let (journal, writer) = Journal::open(
        &config.journal,
        Arc::clone(&metrics),
        Duration::from_millis(config.journal_busy_timeout_ms),
    )
    .await?;
    let reader = Arc::new(journal.reader()?);
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr).await.map_err(|e| StartError::Bind {
            addr,
            reason: e.to_string(),
        })
    };
    let ui = Arc::new(crate::approval_ui::ApprovalUi::load(&config, &identity)?);
    let notifier = Notifier::new(Webhook::load(&config)?, Arc::clone(&metrics));
    if ui.enabled() {
        tracing::info!("approval page on at /ui/approvals (OpenID Connect sign-in)");
    }
    let data_listener = bind(config.listen).await?;
    let admin_listener = bind(config.admin_listen).await?;
    let addr = data_listener.local_addr().map_err(|e| StartError::Bind {
        addr: config.listen,
        reason: e.to_string(),
    })?;
    let admin_addr = admin_listener.local_addr().map_err(|e| StartError::Bind {
        addr: config.admin_listen,
        reason: e.to_string(),
    })?;
    let schemas = Arc::new(SchemaCache::new(
        crate::admission::arguments::SchemaLimits {
            max_schema_bytes: config.max_schema_bytes,
            budget_bytes: config.max_schema_cache_bytes,
        },
        metrics.schema_cache_bytes.clone(),
        metrics.schema_cache_evictions.clone(),
    ));
    let admin_token = AdminToken::load(config.admin_token_file.as_deref()).map_err(|e| {
        StartError::AdminToken {
            file: e.file,
            reason: e.reason,
        }
    })?;
    let metrics_evictions = metrics.run_counter_evictions.clone();
    let state = Arc::new(AppState {
        admin_token,
        client: upstream::client(&config),
        config,
        journal,
        reader,
        metrics,
        schemas,
        // 2 MiB of estimated memory a generation (4 MiB at most in all): ~150 KB of tool
        // declarations' text each (a coding agent's 16 tools, 5.2 KB, are charged 70 KB).
        declared_tools: crate::strict_json::ValueCache::new(2 << 20),
        policy: Arc::clone(&policy),
        limits: LimitState::new(metrics_evictions),
        ready: AtomicBool::new(false),
        identity,
        approvals: Approvals::default(),
        notifier,
        lifecycle: Lifecycle::default(),
    });
    let watcher = reload::watch(
        policy,
        Arc::clone(&state.metrics),
        std::time::Duration::from_millis(250),
    );
    let pruner = prune_task(Arc::clone(&state));
    let (stop, stopped) = watch::channel(false);
    let header_read_timeout = Duration::from_millis(state.config.header_read_timeout_ms);
    let data = Listener {
        header_read_timeout,
        send_timeout: Some(Duration::from_millis(state.config.send_timeout_ms)),
        max_connections: state.config.max_connections,
        counted: Some(Arc::clone(&state.metrics)),
    };
    // The admin plane gets the same deadlines and its own, fixed connection cap.
    let admin = Listener {
        header_read_timeout,
        send_timeout: None,
        max_connections: ADMIN_MAX_CONNECTIONS,
        counted: None,
    };
    let mcp = crate::mcp::McpFront::new(Arc::clone(&state))?;
    let tasks = vec![
        tokio::spawn(serve(
            data_listener,
            DataPlane::new(Arc::clone(&state), &mcp),
            stopped.clone(),
            data,
        )),
        tokio::spawn(serve(
            admin_listener,
            TowerToHyperService::new(crate::admin::router(Arc::clone(&state), ui)),
            stopped,
            admin,
        )),
    ];
    let health = journal_health_task(Arc::clone(&state));
    state.ready.store(true, Ordering::SeqCst);
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    tracing::info!(data = %addr, admin = %admin_addr, journal = %state.journal.location(), upstreams = %upstream_summary(&state.config), workers, "turnguard listening");
    Ok(Running {
        addr,
        admin_addr,
        state,
        stop,
        tasks,
        watcher,
        pruner,
        health,
        writer,
    })
}

/// Logs how the acting person is verified (and warns of the development header and HS256).
fn log_identity(identity: &Identity) {
    if identity.dev_header() {
        tracing::warn!("DEVELOPMENT MODE: a plain `Turnguard-Principal` header is trusted as the verified acting person on both planes (identity_dev_principal_header = true). Anyone who can reach turnguard can act and approve as anyone. Never use this in production.");
    }
    if identity.configured() {
        let algs = identity.algorithms();
        if algs.iter().any(|a| a == "HS256") {
            tracing::warn!("identity: an HS256 shared secret is configured; use asymmetric keys (JWKS or PEM) outside development");
        }
        tracing::info!(algorithms = %algs.join(","), "identity provider configured: principal and approver tokens are verified");
    } else {
        tracing::info!("no identity provider configured: requests act as the agent and held calls cannot be approved");
    }
}

/// Loads the policy bundle (a bundle that does not load is a start error) and wraps it in
/// the reloadable handle every request takes its snapshot from.
fn load_policy(config: &Config, metrics: &Metrics) -> Result<Arc<PolicyHandle>, StartError> {
    let policy = reload::load_from(
        &config.policy,
        !config.policy_explicit,
        config.catalog.as_deref(),
    )
    .map_err(|source| StartError::Policy {
        dir: config.policy.display().to_string(),
        source,
    })?;
    tracing::info!(revision = %policy.revision, origin = %policy.origin, tools = policy.catalog.len(), rules = policy.rules.len(), catalog = %policy.catalog_summary(), "policy bundle loaded");
    metrics.policy_revision("", &policy.revision);
    if policy.rules.permits() == 0 {
        tracing::warn!("the policy bundle has no permit rule: every tool call will be refused (Cedar default deny)");
    }
    Ok(Arc::new(
        PolicyHandle::new(policy, config.policy.clone())
            .with_embedded_fallback(!config.policy_explicit)
            .with_catalogs(config.catalog.clone()),
    ))
}

/// `name=scheme://host[:port][/prefix]` for each upstream, comma-separated, with any
/// userinfo (`user:password@`) left out: the start-up line says where turnguard sends
/// requests, never a credential.
pub fn upstream_summary(config: &Config) -> String {
    config
        .upstreams
        .iter()
        .map(|(name, u)| {
            let host = u
                .authority
                .rsplit_once('@')
                .map_or(u.authority.as_str(), |(_, h)| h);
            format!("{name}={}://{host}{}", u.scheme, u.prefix)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Connections the admin plane keeps open at once (metrics scrapers, approval UIs).
const ADMIN_MAX_CONNECTIONS: usize = 256;

/// How one listener serves its connections.
struct Listener {
    /// hyper's HTTP/1 `header_read_timeout`: the time a client has to send a request's
    /// headers, which is also the longest an idle keep-alive connection stays open.
    header_read_timeout: Duration,
    /// How long a write to the client may wait for it to read (`send_timeout_ms`, the data
    /// plane); past it the connection is closed ([`WriteDeadline`]).
    send_timeout: Option<Duration>,
    /// Connections open at once; past it a new connection is closed at accept.
    max_connections: usize,
    /// Count connections in `turnguard_open_connections` / `_connections_rejected_total`.
    counted: Option<Arc<Metrics>>,
}

/// Serves `router` on `listener` until `stopped` turns true, then shuts down gracefully: the
/// listener closes at once, idle keep-alive connections are closed, and in-flight requests and
/// streams finish (the caller bounds how long: [`crate::shutdown`]).
///
/// HTTP/1.1 only (what the providers' SDKs speak): hyper's HTTP/1 server enforces the
/// header-read deadline from the first byte of a connection and between requests, which its
/// HTTP/2 server has no equivalent for, so a slow client cannot hold a connection by trickling
/// its headers (issue 11). Past `max_connections` open connections a new one is closed at
/// accept, so slow clients cannot exhaust file descriptors; the request body's deadline and the
/// concurrency permit are the request path's ([`crate::edge`]).
async fn serve<S>(
    listener: TcpListener,
    service: S,
    mut stopped: watch::Receiver<bool>,
    how: Listener,
) where
    S: hyper::service::Service<Request<Incoming>, Response = Response, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(how.header_read_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let open = Arc::new(Semaphore::new(how.max_connections));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped.wait_for(|s| *s) => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // A connection that failed before accept returned is the client's problem;
                // anything else (EMFILE …) is retried after a pause, never a dead listener.
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionRefused
                ) {
                    tracing::error!(error = %e, "accept failed; retrying in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&open).try_acquire_owned() else {
            if let Some(m) = &how.counted {
                m.connections_rejected.inc();
            }
            tracing::warn!(
                max_connections = how.max_connections,
                "connection closed at accept: max_connections are open"
            );
            drop(tcp);
            continue;
        };
        // Small writes (SSE events) go out at once: without TCP_NODELAY an event written
        // while the previous segment is unacknowledged waits for the peer's delayed ACK (up
        // to 40 ms on Linux).
        let _ = tcp.set_nodelay(true);
        let gauge = how
            .counted
            .as_ref()
            .map(|m| GaugeGuard::new(&m.open_connections));
        let service = service.clone();
        let io = WriteDeadline::new(tcp, how.send_timeout);
        let conn = http.serve_connection(hyper_util::rt::TokioIo::new(io), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // A header-read timeout, a reset or a protocol error ends only this connection.
            let _ = conn.await;
            drop(gauge);
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// A client connection whose writes may wait at most `limit` for the client to read: a write
/// or flush still pending that long fails with `TimedOut`, and hyper closes the connection.
/// So a client that stops reading a response (or a stream) gives back its connection and the
/// request's concurrency permit (held by the response body, [`crate::edge`]), where before it
/// held both for as long as it kept the socket open. Reads are not bounded here (hyper's
/// `header_read_timeout` and the body deadline are).
struct WriteDeadline {
    io: tokio::net::TcpStream,
    limit: Option<Duration>,
    /// Running while a write or flush is pending; reset by any progress.
    waiting: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl WriteDeadline {
    fn new(io: tokio::net::TcpStream, limit: Option<Duration>) -> Self {
        Self {
            io,
            limit,
            waiting: None,
        }
    }

    /// Turns a pending write into `TimedOut` once it has waited `limit`.
    fn bound<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        polled: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::future::Future;
        let std::task::Poll::Pending = polled else {
            self.waiting = None;
            return polled;
        };
        let Some(limit) = self.limit else {
            return std::task::Poll::Pending;
        };
        let timer = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            std::task::Poll::Ready(()) => std::task::Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client did not read for send_timeout_ms",
            ))),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

impl tokio::io::AsyncRead for WriteDeadline {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for WriteDeadline {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_write(cx, buf);
        self.bound(cx, polled)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.bound(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_flush(cx);
        self.bound(cx, polled)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Keeps the journal's health signal fresh: probes with a real durable write every
/// [`HEALTH_PROBE_OK`] while writes succeed, and every [`HEALTH_PROBE_FAILING`] (at least that
/// long after the last failure) while they fail, so `/readyz` turns true again once the
/// journal recovers ([`crate::journal::JournalHealth`]).
fn journal_health_task(state: Arc<AppState>) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let wait = if state.journal.health().failing().is_some() {
                HEALTH_PROBE_FAILING
            } else {
                HEALTH_PROBE_OK
            };
            tokio::time::sleep(wait).await;
            if state.journal.health().failed_within(HEALTH_PROBE_FAILING) {
                continue;
            }
            let _ = state.journal.probe().await;
        }
    })
}

/// Probe interval while the journal's durable writes succeed.
const HEALTH_PROBE_OK: Duration = Duration::from_secs(5);
/// Probe interval while they fail.
const HEALTH_PROBE_FAILING: Duration = Duration::from_secs(1);

/// How often full rate-limit buckets are dropped ([`LimitState::sweep`]).
const LIMITS_SWEEP: Duration = Duration::from_secs(60);

/// Housekeeping: deletes journal records past `journal_retention_days`, hourly (and once at
/// start), and sweeps full rate-limit buckets every [`LIMITS_SWEEP`].
fn prune_task(state: Arc<AppState>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(3600));
        let mut sweep = tokio::time::interval(LIMITS_SWEEP);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = sweep.tick() => {
                    state.limits.sweep();
                    continue;
                }
            }
            let keep_ms = i64::try_from(
                state
                    .config
                    .journal_retention_days
                    .saturating_mul(86_400_000),
            )
            .unwrap_or(i64::MAX);
            let before = crate::clock::now_ms().saturating_sub(keep_ms);
            if let Err(e) = state.journal.prune(before).await {
                tracing::error!(error = %e, "journal pruning failed");
            }
        }
    })
}

/// The data plane as hyper serves it: `POST` to a model API (`/v1/chat/completions`,
/// `/v1/messages`, `/v1/responses`; exact paths, as axum routes them) goes straight to the
/// request path ([`proxy::handle`]) inside the edge ([`crate::edge::around`]); every other
/// request goes to the data router ([`data_router`]), whose routes pass through the same
/// edge as a middleware. Both share one [`crate::edge::Edge`] (one set of concurrency
/// permits). The model APIs skip axum's routing and its middleware's boxed inner service:
/// the hot path (issue 13 item 6, profile-led; ~3.6 % of a c=64 request's CPU).
#[derive(Clone)]
struct DataPlane {
    edge: Arc<crate::edge::Edge>,
    rest: TowerToHyperService<Router>,
}

impl DataPlane {
    fn new(state: Arc<AppState>, mcp: &Arc<crate::mcp::McpFront>) -> Self {
        let edge = crate::edge::Edge::new(Arc::clone(&state));
        let rest = TowerToHyperService::new(data_router(state, &edge, mcp));
        DataPlane { edge, rest }
    }
}

/// A model API request's response, from the request path.
type Served = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for DataPlane {
    type Response = Response;
    type Error = Infallible;
    type Future = Either<Served, TowerToHyperServiceFuture<Router, Request<Incoming>>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let api = match Api::of_path(req.uri().path()) {
            Some(api) if req.method() == http::Method::POST => api,
            _ => return Either::Right(self.rest.call(req)),
        };
        let edge = Arc::clone(&self.edge);
        Either::Left(Box::pin(async move {
            let state = Arc::clone(edge.state());
            let req = req.map(Body::new);
            Ok(crate::edge::around(&edge, req, |req| proxy::handle(state, api, req)).await)
        }))
    }
}

/// The data plane's routes other than the model APIs (served by [`DataPlane`]): the
/// emission-free allowlist, the MCP front (`/mcp/{name}`, [`crate::mcp`]), and 404 for
/// everything else — a model API path asked with another method among them — so no surface
/// bypasses the pipeline (DESIGN.md §1). Retrieving a stored response (`GET
/// /v1/responses/{id}`) or its input items would hand the agent calls that never went
/// through admission, so those paths stay off the allowlist (404).
fn data_router(
    state: Arc<AppState>,
    edge: &Arc<crate::edge::Edge>,
    mcp: &Arc<crate::mcp::McpFront>,
) -> Router {
    Router::new()
        .merge(mcp.routes())
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(models))
        .route("/v1/embeddings", post(embeddings))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(edge),
            crate::edge::layer,
        ))
        .with_state(state)
}

async fn count_tokens(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    proxy::passthrough(s, "anthropic", req).await
}

async fn embeddings(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    proxy::passthrough(s, "openai", req).await
}

/// `GET /v1/models` exists on both providers: an Anthropic client is recognised by its
/// `anthropic-version` or `x-api-key` header. `GET /v1/models/{model}` is forwarded only for a
/// model id of the characters provider ids use (ASCII letters, digits, `. _ : - @ +`), never
/// `.` or `..`: a dot segment or a percent-encoded `/` would name another route to an
/// upstream (or a gateway before it) that normalises the path, such as
/// `/v1/responses/{id}`, which stays off the allowlist.
async fn models(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    if let Some(id) = req.uri().path().strip_prefix("/v1/models/") {
        let plain = id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-_:@+".contains(&b));
        if !plain || id == "." || id == ".." {
            return not_found(State(s), req).await;
        }
    }
    let anthropic =
        req.headers().contains_key("anthropic-version") || req.headers().contains_key("x-api-key");
    proxy::passthrough(s, if anthropic { "anthropic" } else { "openai" }, req).await
}

async fn not_found(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    let websocket = req
        .headers()
        .get(http::header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let error = if websocket && req.uri().path() == "/v1/responses" {
        // The Responses WebSocket transport: declined so the client posts over HTTP.
        WireError::WebSocketNotServed {
            path: "/v1/responses".into(),
        }
    } else {
        WireError::RouteNotFound {
            method: req.method().to_string(),
            path: req.uri().path().chars().take(200).collect(),
        }
    };
    let resp = error.response(Surface::of_request(req.uri().path(), req.headers()));
    s.metrics.request(
        crate::metrics::ApiLabel::None,
        resp.status().as_u16(),
        false,
    );
    resp
}
