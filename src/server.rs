//! Binds the data plane and the admin plane, opens the journal, and wires the shared state.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use http::Request;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admission::{LimitState, SchemaCache};
use crate::approvals::Approvals;
use crate::config::Config;
use crate::error::{Surface, WireError};
use crate::identity::{Identity, IdentityConfigError};
use crate::journal::{Journal, JournalError, JournalReader, WriterThread};
use crate::metrics::Metrics;
use crate::model::Api;
use crate::proxy::{self, upstream};
use crate::reload::{self, LoadError, PolicyHandle};

/// State shared by every request of both planes.
pub struct AppState {
    /// The resolved configuration.
    pub config: Config,
    /// The pooled upstream client.
    pub client: upstream::HttpClient,
    /// The journal writer handle.
    pub journal: Journal,
    /// A read-only journal connection (recovery, replay, admin plane).
    pub reader: Arc<JournalReader>,
    /// The metrics registry handle.
    pub metrics: Arc<Metrics>,
    /// Compiled argument schemas, by schema hash.
    pub schemas: Arc<SchemaCache>,
    /// The active policy bundle; each request takes one snapshot.
    pub policy: Arc<PolicyHandle>,
    /// Limits-stage state (token buckets, per-run counters).
    pub limits: LimitState,
    /// Shutdown state: draining (shed new requests) and the stream cut signal.
    pub lifecycle: crate::shutdown::Lifecycle,
    /// Readiness: true once both planes listen, false again when shutdown starts.
    pub ready: AtomicBool,
    /// Verifies the acting person and approvers (tool-turn contract §C).
    pub identity: Identity,
    /// Requests waiting for approvals in this process.
    pub approvals: Approvals,
    /// The approval page and approval notifications (webhook, SSE).
    pub ui: crate::approval_ui::ApprovalUi,
}

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
    /// The approval page or webhook settings cannot be used.
    #[error("approval page or webhook settings")]
    ApprovalUi(#[from] crate::approval_ui::UiConfigError),
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
    writer: WriterThread,
}

impl Running {
    /// Graceful shutdown: readiness goes false, listeners stop accepting, in-flight requests
    /// and streams finish within `shutdown_grace_ms` (then are cut), then the journal queue
    /// is flushed and closed. See [`crate::shutdown`].
    pub async fn shutdown(self) -> crate::shutdown::ShutdownReport {
        self.watcher.abort();
        self.pruner.abort();
        crate::shutdown::sequence(self.state, self.stop, self.tasks, self.writer).await
    }
}

/// Binds both planes and starts serving.
///
/// Errors: [`StartError`] naming the address or journal path that failed.
pub async fn start(config: Config) -> Result<Running, StartError> {
    let metrics = Arc::new(Metrics::new());
    let identity = Identity::load(&config)?;
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
    let policy = Arc::new(
        PolicyHandle::new(policy, config.policy.clone())
            .with_embedded_fallback(!config.policy_explicit)
            .with_catalogs(config.catalog.clone()),
    );
    let (journal, writer) = Journal::open(&config.journal, Arc::clone(&metrics))?;
    let reader = Arc::new(JournalReader::open(&config.journal)?);
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr).await.map_err(|e| StartError::Bind {
            addr,
            reason: e.to_string(),
        })
    };
    let ui = crate::approval_ui::ApprovalUi::load(&config, &identity, Arc::clone(&metrics))?;
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
    let state = Arc::new(AppState {
        client: upstream::client(&config),
        config,
        journal,
        reader,
        metrics,
        schemas: Arc::new(SchemaCache::default()),
        policy: Arc::clone(&policy),
        limits: LimitState::default(),
        ready: AtomicBool::new(false),
        identity,
        approvals: Approvals::default(),
        ui,
        lifecycle: crate::shutdown::Lifecycle::default(),
    });
    let watcher = reload::watch(
        policy,
        Arc::clone(&state.metrics),
        std::time::Duration::from_millis(250),
    );
    let pruner = prune_task(Arc::clone(&state));
    let (stop, stopped) = watch::channel(false);
    let serve = |listener: TcpListener, router: Router, mut stopped: watch::Receiver<bool>| {
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.wait_for(|s| *s).await;
            };
            // Small writes (SSE events) go out at once: without TCP_NODELAY an event written
            // while the previous segment is unacknowledged waits for the peer's delayed ACK
            // (up to 40 ms on Linux).
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            if let Err(e) = axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
            {
                tracing::error!(error = %e, "listener failed");
            }
        })
    };
    let tasks = vec![
        serve(
            data_listener,
            data_router(Arc::clone(&state)),
            stopped.clone(),
        ),
        serve(
            admin_listener,
            crate::admin::router(Arc::clone(&state)),
            stopped,
        ),
    ];
    state.ready.store(true, Ordering::SeqCst);
    tracing::info!(data = %addr, admin = %admin_addr, journal = %state.journal.path().display(), upstreams = %upstream_summary(&state.config), "turnguard listening");
    Ok(Running {
        addr,
        admin_addr,
        state,
        stop,
        tasks,
        watcher,
        pruner,
        writer,
    })
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

/// Deletes journal records past `journal_retention_days`, hourly (and once at start).
fn prune_task(state: Arc<AppState>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(3600));
        loop {
            tick.tick().await;
            let keep_ms = i64::try_from(
                state
                    .config
                    .journal_retention_days
                    .saturating_mul(86_400_000),
            )
            .unwrap_or(i64::MAX);
            let before = crate::proxy::now_ms().saturating_sub(keep_ms);
            if let Err(e) = state.journal.prune(before).await {
                tracing::error!(error = %e, "journal pruning failed");
            }
        }
    })
}

/// The data plane: the provider APIs turnguard admits, the emission-free allowlist, and 404
/// for everything else so no surface bypasses the pipeline (DESIGN.md §1).
fn data_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(responses))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(models))
        .route("/v1/embeddings", post(embeddings))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            crate::edge::Edge::new(Arc::clone(&state)),
            crate::edge::layer,
        ))
        .with_state(state)
}

async fn chat_completions(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    proxy::handle(s, Api::OpenAiChat, req).await
}

async fn messages(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    proxy::handle(s, Api::AnthropicMessages, req).await
}

/// `POST /v1/responses` only: retrieving a stored response (`GET /v1/responses/{id}`) or its
/// input items would hand the agent calls that never went through admission, so those paths
/// stay off the allowlist (404), like everything else not listed.
async fn responses(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    proxy::handle(s, Api::OpenAiResponses, req).await
}

async fn count_tokens(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    proxy::passthrough(s, "anthropic", req).await
}

async fn embeddings(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    proxy::passthrough(s, "openai", req).await
}

/// `GET /v1/models` exists on both providers: an Anthropic client is recognised by its
/// `anthropic-version` or `x-api-key` header.
async fn models(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    let anthropic =
        req.headers().contains_key("anthropic-version") || req.headers().contains_key("x-api-key");
    proxy::passthrough(s, if anthropic { "anthropic" } else { "openai" }, req).await
}

async fn not_found(State(s): State<Arc<AppState>>, req: Request<Body>) -> Response {
    let resp = WireError::RouteNotFound {
        method: req.method().to_string(),
        path: req.uri().path().chars().take(200).collect(),
    }
    .response(Surface::of_request(req.uri().path(), req.headers()));
    s.metrics.request("none", resp.status().as_u16(), false);
    resp
}
