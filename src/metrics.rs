//! Every Prometheus metric turnguard exports, in one owned registry handle (no globals).
//! Names follow `turnguard_<name>_<unit>[_total]`; label values come from enums' `as_str()`,
//! never from raw user input.

use std::fmt::Write as _;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, RwLock};

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};

use crate::model::Api;

/// Implements `EncodeLabelValue` for closed enums by their `as_str()` spelling, so a label
/// set is built from `Copy` values and an increment allocates nothing.
macro_rules! label_value {
    ($($t:ty),* $(,)?) => {$(
        impl EncodeLabelValue for $t {
            fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
                encoder.write_str(self.as_str())
            }
        }
    )*};
}

label_value!(
    crate::model::Outcome,
    crate::model::Stage,
    crate::policy::bundle::ContentTrust,
    crate::admission::channel::Channel,
    ApiLabel,
    ShedReason,
    UpstreamError,
    CommitDurability,
    ReloadResult,
    ReplayMode,
    ReplayResult,
    ApprovalResult,
    CallMode,
    CallSurface,
    NotificationChannel,
    NotificationResult,
);

/// Which surface a data-plane request spoke, as a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiLabel {
    /// A model API ([`Api::as_str`]).
    Api(Api),
    /// An emission-free endpoint passed through (`GET /v1/models` …).
    Passthrough,
    /// The MCP front (`/mcp/{server}`).
    Mcp,
    /// Any other path (refused with 404).
    None,
}

impl ApiLabel {
    /// Label value: `openai_chat`, `anthropic_messages`, `openai_responses`, `passthrough`,
    /// `mcp`, `none`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Api(api) => api.as_str(),
            Self::Passthrough => "passthrough",
            Self::Mcp => "mcp",
            Self::None => "none",
        }
    }
}

impl From<Api> for ApiLabel {
    fn from(api: Api) -> Self {
        Self::Api(api)
    }
}

/// Labels of `turnguard_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Provider API or `passthrough` / `none`.
    pub api: ApiLabel,
    /// HTTP status sent to the agent.
    pub status: u16,
    /// `true` for an SSE response.
    pub stream: bool,
}

/// Labels of per-API histograms.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    pub api: ApiLabel,
}

/// `enforce`, or `shadow` when a call was released although its outcome withholds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallMode {
    Enforce,
    Shadow,
}

impl CallMode {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enforce => "enforce",
            Self::Shadow => "shadow",
        }
    }

    /// The mode a decision was applied in.
    pub fn of(enforced: bool) -> Self {
        if enforced {
            Self::Enforce
        } else {
            Self::Shadow
        }
    }
}

/// Where a tool call was decided (`turnguard_tool_calls_total{surface}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallSurface {
    /// Emitted by the model on a provider API.
    Llm,
    /// A `tools/call` through the MCP front.
    Mcp,
}

impl CallSurface {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Llm => "llm",
            Self::Mcp => "mcp",
        }
    }
}

/// Labels of `turnguard_tool_calls_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    /// Outcome (tool-turn contract §B).
    pub outcome: crate::model::Outcome,
    /// The stage that decided it.
    pub stage: crate::model::Stage,
    /// Emission channel (§A): always `tool` (provider-native calls).
    pub channel: &'static str,
    /// `enforce`, or `shadow` when the call was released although the outcome withholds it.
    pub mode: CallMode,
    /// The catalog `toolId`; every tool the catalog does not declare is
    /// `turnguard:unknown` (the label never carries a model-chosen name). Interned
    /// ([`Metrics::tool_label`]): cloning it allocates nothing.
    pub tool: Arc<str>,
    /// Where the call was decided: `llm` (emitted by the model, on the provider APIs) or
    /// `mcp` (a `tools/call` through the MCP front).
    pub surface: CallSurface,
}

/// Labels of the edge histograms (`turnguard_request_duration_seconds`,
/// `turnguard_proxy_added_seconds`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EdgeLabels {
    /// Provider API (`openai_chat`, `anthropic_messages`, `openai_responses`, `passthrough`,
    /// `none`).
    pub api: ApiLabel,
    /// `true` for an SSE response.
    pub stream: bool,
}

/// Labels of `turnguard_shed_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShedLabels {
    /// Why the request was shed ([`ShedReason::as_str`]).
    pub reason: ShedReason,
}

/// Why a request was turned away before any work was done on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShedReason {
    /// The concurrency limit (`max_concurrent_requests`) was reached.
    Overloaded,
    /// turnguard is draining after SIGTERM.
    ShuttingDown,
}

impl ShedReason {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Overloaded => "overloaded",
            Self::ShuttingDown => "shutting_down",
        }
    }
}

/// Labels of `turnguard_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    /// The crate version.
    pub version: &'static str,
}

/// An upstream failure turnguard saw (`turnguard_upstream_errors_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpstreamError {
    /// The connection (or the request) failed.
    Connect,
    /// No response within `upstream_response_timeout_ms`.
    ResponseTimeout,
    /// No body data for `upstream_idle_timeout_ms`.
    IdleTimeout,
    /// A stream ended before its terminal event.
    StreamCut,
    /// A repair round could not be sent or answered.
    RepairRoundFailed,
    /// The upstream answered with a status that is neither an answer nor an error: an
    /// informational (1xx, `101 Switching Protocols` included) or a redirect (3xx, `304`
    /// included). turnguard relays neither ([`crate::proxy::upstream::relayed`]).
    UnexpectedStatus,
}

impl UpstreamError {
    /// Every reason, in label order (started at 0).
    pub const ALL: [Self; 6] = [
        Self::Connect,
        Self::ResponseTimeout,
        Self::IdleTimeout,
        Self::StreamCut,
        Self::RepairRoundFailed,
        Self::UnexpectedStatus,
    ];

    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::ResponseTimeout => "response_timeout",
            Self::IdleTimeout => "idle_timeout",
            Self::StreamCut => "stream_cut",
            Self::RepairRoundFailed => "repair_round_failed",
            Self::UnexpectedStatus => "unexpected_status",
        }
    }
}

/// Labels of `turnguard_upstream_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: UpstreamError,
}

/// How a journal commit was made durable (`turnguard_journal_commits_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommitDurability {
    /// A batch with a record the contract needs durable before its caller goes on: SQLite
    /// `synchronous=FULL` (one fsync of the WAL), PostgreSQL `synchronous_commit = on`.
    Durable,
    /// A batch of records nobody waits on (audit events, a chat turn's round): SQLite
    /// `synchronous=NORMAL` (no fsync), PostgreSQL `synchronous_commit = off`.
    Relaxed,
    /// A batch made durable only by a health probe (every 5 s; 1 s while writes fail).
    Probe,
}

impl CommitDurability {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Durable => "durable",
            Self::Relaxed => "relaxed",
            Self::Probe => "probe",
        }
    }
}

/// Labels of `turnguard_journal_commits_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CommitLabels {
    pub durability: CommitDurability,
}

/// A policy reload's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReloadResult {
    Ok,
    Error,
}

impl ReloadResult {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Error => "error",
        }
    }
}

/// Labels of `turnguard_policy_reloads_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `ok` or `error`.
    pub result: ReloadResult,
}

/// Labels of `turnguard_policy_revision_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RevisionLabels {
    /// The active bundle's revision (set on reload only, never per request).
    pub revision: String,
}

/// Labels of `turnguard_turns_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrustLabels {
    /// The turn's `contentTrust`.
    pub trust: crate::policy::bundle::ContentTrust,
}

/// Labels of `turnguard_repairs_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RepairLabels {
    /// Provider API.
    pub api: ApiLabel,
}

/// Labels of `turnguard_emissions_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EmissionLabels {
    /// `structured` or `prompted`.
    pub channel: crate::admission::channel::Channel,
    /// `valid`, `refused`, or the invalid reason code (a closed set of static codes).
    pub result: &'static str,
}

/// Recovery or replay (`turnguard_replay_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplayMode {
    Recovery,
    Replay,
    /// A replayed MCP `tools/call` (the recorded result, never the server).
    McpReplay,
}

impl ReplayMode {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Recovery => "recovery",
            Self::Replay => "replay",
            Self::McpReplay => "mcp_replay",
        }
    }
}

/// What a recovery or replay lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplayResult {
    Hit,
    Miss,
    OutcomeUnknown,
}

impl ReplayResult {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hit => "hit",
            Self::Miss => "miss",
            Self::OutcomeUnknown => "outcome_unknown",
        }
    }
}

/// Labels of `turnguard_replay_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplayLabels {
    /// `recovery`, `replay` or `mcp_replay`.
    pub mode: ReplayMode,
    /// `hit`, `miss`, `outcome_unknown`.
    pub result: ReplayResult,
}

/// An approval interrupt raised or resolved (`turnguard_approvals_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApprovalResult {
    /// An approval interrupt was raised.
    Held,
    Approved,
    Rejected,
    Expired,
}

impl ApprovalResult {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Held => "held",
            Self::Approved => "approved",
            Self::Rejected => "rejected",
            Self::Expired => "expired",
        }
    }
}

/// Labels of `turnguard_approvals_total` and `turnguard_approval_wait_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApprovalLabels {
    /// `held` (an approval interrupt was raised), `approved`, `rejected`, `expired`.
    pub result: ApprovalResult,
}

/// How an approval notification went (`turnguard_approval_notifications_total`); each
/// belongs to one [`NotificationChannel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NotificationResult {
    /// Webhook: delivered (a 2xx answer).
    Delivered,
    /// Webhook: an attempt failed and is retried.
    Retried,
    /// Webhook: every attempt failed.
    Failed,
    /// Webhook: the delivery queue was full.
    Dropped,
    /// SSE: sent to a subscriber.
    Sent,
    /// SSE: a slow subscriber missed events.
    Lagged,
}

impl NotificationResult {
    /// Every result, for pre-registering the series.
    pub const ALL: [Self; 6] = [
        Self::Delivered,
        Self::Retried,
        Self::Failed,
        Self::Dropped,
        Self::Sent,
        Self::Lagged,
    ];

    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Delivered => "delivered",
            Self::Retried => "retried",
            Self::Failed => "failed",
            Self::Dropped => "dropped",
            Self::Sent => "sent",
            Self::Lagged => "lagged",
        }
    }

    /// The channel this result is reported on.
    pub fn channel(self) -> NotificationChannel {
        match self {
            Self::Delivered | Self::Retried | Self::Failed | Self::Dropped => {
                NotificationChannel::Webhook
            }
            Self::Sent | Self::Lagged => NotificationChannel::Sse,
        }
    }
}

/// Which channel an approval notification went out on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NotificationChannel {
    Webhook,
    Sse,
}

impl NotificationChannel {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Webhook => "webhook",
            Self::Sse => "sse",
        }
    }
}

/// Labels of `turnguard_approval_notifications_total` (built by
/// [`NotificationLabels::of`], so a result is never counted on the wrong channel).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NotificationLabels {
    /// `webhook` or `sse`.
    pub channel: NotificationChannel,
    /// webhook: `delivered`, `retried`, `failed` (every attempt failed), `dropped` (queue
    /// full); sse: `sent`, `lagged` (a slow subscriber missed events).
    pub result: NotificationResult,
}

impl NotificationLabels {
    /// The labels of `result`, on its channel.
    pub fn of(result: NotificationResult) -> Self {
        Self {
            channel: result.channel(),
            result,
        }
    }
}

/// The metrics handle shared by the data plane, the journal and the admin plane.
pub struct Metrics {
    registry: Registry,
    names: Vec<String>,
    /// Requests answered on the data plane.
    pub requests: Family<RequestLabels, Counter>,
    /// Time from sending upstream to the response headers, seconds.
    pub upstream_latency: Family<ApiLabels, Histogram>,
    /// Time a held tool call waited between its last delta and its release decision, seconds.
    pub hold_latency: Family<ApiLabels, Histogram>,
    /// Tool calls decided, by outcome, stage and channel.
    pub tool_calls: Family<CallLabels, Counter>,
    /// Upstream failures turnguard saw (connect, timeout, stream cut).
    pub upstream_errors: Family<ReasonLabels, Counter>,
    /// Journal batches that failed to commit, counted per record.
    pub journal_write_failures: Counter,
    /// Journal commit latency per batch, seconds.
    pub journal_commit_latency: Histogram,
    /// Records per committed journal batch.
    pub journal_batch_size: Histogram,
    /// Journal transactions committed, by durability: with one request at a time, the
    /// durable commits per round are what the tool-turn contract costs in fsyncs.
    pub journal_commits: Family<CommitLabels, Counter>,
    /// Records waiting for the journal writer.
    pub journal_queue_depth: Gauge<i64, AtomicI64>,
    /// Data-plane requests in flight.
    pub inflight_requests: Gauge<i64, AtomicI64>,
    /// Policy reloads by result.
    pub policy_reloads: Family<ResultLabels, Counter>,
    /// 1 for the active policy revision.
    pub policy_revision_info: Family<RevisionLabels, Gauge<i64, AtomicI64>>,
    /// Model turns admitted, by `contentTrust`.
    pub turns: Family<TrustLabels, Counter>,
    /// Repair rounds turnguard sent upstream.
    pub repairs: Family<RepairLabels, Counter>,
    /// Text answers checked in the structured and prompted channels.
    pub emissions: Family<EmissionLabels, Counter>,
    /// Recovery and replay lookups by result.
    pub replay: Family<ReplayLabels, Counter>,
    /// Approval interrupts raised (`held`) and resolved (`approved`, `rejected`, `expired`).
    pub approvals: Family<ApprovalLabels, Counter>,
    /// Time from an approval interrupt being raised to its resolution, seconds.
    pub approval_wait: Family<ApprovalLabels, Histogram>,
    /// Approval notifications (webhook deliveries, SSE events) by channel and result.
    pub approval_notifications: Family<NotificationLabels, Counter>,
    /// Whole time of a data-plane request at the edge (arrival to the last body byte sent),
    /// seconds.
    pub request_duration: Family<EdgeLabels, Histogram>,
    /// Time spent in turnguard for one request, excluding waits on the upstream, seconds.
    pub proxy_added: Family<EdgeLabels, Histogram>,
    /// Time from sending a streamed request upstream to the first body bytes, seconds.
    pub upstream_ttfb: Family<ApiLabels, Histogram>,
    /// SSE relays in flight.
    pub inflight_streams: Gauge<i64, AtomicI64>,
    /// Requests shed (503 + `Retry-After`) before any work, by reason.
    pub shed_requests: Family<ShedLabels, Counter>,
    /// Constant 1, labelled with the build's version.
    pub build_info: Family<BuildLabels, Gauge<i64, AtomicI64>>,
    /// Data-plane connections open (issue 11: capped by `max_connections`).
    pub open_connections: Gauge<i64, AtomicI64>,
    /// Data-plane connections closed at accept because `max_connections` were open.
    pub connections_rejected: Counter,
    /// Estimated memory held by compiled schemas, bytes (bounded by
    /// `max_schema_cache_bytes`).
    pub schema_cache_bytes: Gauge<i64, AtomicI64>,
    /// Compiled schemas evicted (least recently used first) to stay within the budget.
    pub schema_cache_evictions: Counter,
    /// Per-run released-call counters evicted (least recently used run first) to stay within
    /// their bound ([`crate::admission::LimitState`]).
    pub run_counter_evictions: Counter,
    /// Interned `tool` label values (catalog `toolId`s): bounded by the catalogs loaded.
    tool_labels: RwLock<foldhash::HashSet<Arc<str>>>,
    /// Handles to the metrics every request or call updates ([`Handles`]).
    request_handles: Handles<RequestLabels, Counter>,
    call_handles: Handles<CallLabels, Counter>,
    duration_handles: Handles<EdgeLabels, Histogram>,
    added_handles: Handles<EdgeLabels, Histogram>,
}

/// Handles to a family's metrics by label set, kept in front of the family: a clone of a
/// prometheus-client metric shares its value, so updating the clone updates the family's.
/// `Family::get_or_create` hashes the labels with SipHash under the family's lock; this map
/// hashes them with foldhash (the label values are turnguard's own: enums, a status code, a
/// catalog `toolId`), which made the four family lookups of a request ~2.4k of its ~193k
/// instructions under callgrind (issue 13, profile-led). At most [`Handles::MAX`] label sets
/// are kept; past that a lookup goes to the family.
struct Handles<S, M> {
    kept: RwLock<foldhash::HashMap<S, M>>,
}

impl<S, M> Default for Handles<S, M> {
    fn default() -> Self {
        Handles {
            kept: RwLock::new(foldhash::HashMap::default()),
        }
    }
}

impl<S, M> Handles<S, M>
where
    S: Clone + std::hash::Hash + Eq,
    M: Clone,
{
    /// Label sets kept at most.
    const MAX: usize = 4096;

    /// The metric of `family` for `labels` (created in the family on first use).
    fn get<C>(&self, family: &Family<S, M, C>, labels: &S) -> M
    where
        C: prometheus_client::metrics::family::MetricConstructor<M>,
    {
        if let Some(m) = self.kept.read().ok().and_then(|k| k.get(labels).cloned()) {
            return m;
        }
        let m = family.get_or_create(labels).clone();
        if let Ok(mut kept) = self.kept.write() {
            if kept.len() < Self::MAX {
                kept.insert(labels.clone(), m.clone());
            }
        }
        m
    }
}

/// Counts one unit in a gauge for as long as it lives: `inc` now, `dec` on drop, so a future
/// dropped half-way (a client that disconnects) never leaves the gauge up.
#[derive(Debug)]
#[must_use = "the gauge goes down again when the guard is dropped"]
pub struct GaugeGuard(Gauge<i64, AtomicI64>);

impl GaugeGuard {
    /// Increments `gauge` until the guard is dropped.
    pub fn new(gauge: &Gauge<i64, AtomicI64>) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let mut r = Registrar {
            registry: Registry::with_prefix("turnguard"),
            names: Vec::new(),
        };
        let requests = r.add(
            "requests",
            "Requests answered on the data plane",
            Family::<RequestLabels, Counter>::default(),
        );
        let upstream_latency = r.add(
            "upstream_latency_seconds",
            "Time from sending upstream to the response headers",
            Family::<ApiLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.005, 2.0, 14))
            }),
        );
        let hold_latency = r.add(
            "stream_hold_seconds",
            "Time from the completion state being known to the held tool calls being released or replaced",
            Family::<ApiLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
        }),
        );
        let tool_calls = r.add(
            "tool_calls",
            "Tool calls decided by admission",
            Family::<CallLabels, Counter>::default(),
        );
        let upstream_errors = r.add(
            "upstream_errors",
            "Upstream failures",
            Family::<ReasonLabels, Counter>::default(),
        );
        let journal_write_failures = r.add(
            "journal_write_failures",
            "Journal records that failed to commit",
            Counter::default(),
        );
        let journal_commit_latency = r.add(
            "journal_commit_latency_seconds",
            "Journal commit latency per batch",
            Histogram::new(exponential_buckets(0.000_1, 2.0, 16)),
        );
        let journal_batch_size = r.add(
            "journal_batch_size_records",
            "Records per committed journal batch",
            Histogram::new(exponential_buckets(1.0, 2.0, 10)),
        );
        let journal_commits = r.add(
            "journal_commits",
            "Journal transactions committed, by durability (durable: fsynced before the caller goes on)",
            Family::<CommitLabels, Counter>::default(),
        );
        let journal_queue_depth = r.add(
            "journal_queue_depth_records",
            "Records waiting for the journal writer",
            Gauge::<i64, AtomicI64>::default(),
        );
        let inflight_requests = r.add(
            "inflight_requests",
            "Data-plane requests in flight",
            Gauge::<i64, AtomicI64>::default(),
        );
        let policy_reloads = r.add(
            "policy_reloads",
            "Policy bundle reloads by result",
            Family::<ResultLabels, Counter>::default(),
        );
        let policy_revision_info = r.add(
            "policy_revision_info",
            "1 for the revision of the active policy bundle",
            Family::<RevisionLabels, Gauge<i64, AtomicI64>>::default(),
        );
        let turns = r.add(
            "turns",
            "Model turns admitted, by contentTrust",
            Family::<TrustLabels, Counter>::default(),
        );
        let repairs = r.add(
            "repairs",
            "Repair rounds sent upstream",
            Family::<RepairLabels, Counter>::default(),
        );
        let emissions = r.add(
            "emissions",
            "Text answers checked in the structured and prompted channels, by result",
            Family::<EmissionLabels, Counter>::default(),
        );
        let replay = r.add(
            "replay",
            "Recovery and replay lookups by result",
            Family::<ReplayLabels, Counter>::default(),
        );
        let approvals = r.add(
            "approvals",
            "Approval interrupts raised (held) and resolved (approved, rejected, expired)",
            Family::<ApprovalLabels, Counter>::default(),
        );
        let approval_wait = r.add(
            "approval_wait_seconds",
            "Time from an approval interrupt being raised to its resolution",
            Family::<ApprovalLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.05, 2.0, 16))
            }),
        );
        let approval_notifications = r.add(
            "approval_notifications",
            "Approval notifications: webhook deliveries and SSE events, by result",
            Family::<NotificationLabels, Counter>::default(),
        );
        // Edge and protection metrics (issue 6).
        let request_duration = r.add(
            "request_duration_seconds",
            "Whole time of a data-plane request, arrival to the last body byte sent",
            Family::<EdgeLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_5, 2.0, 18))
            }),
        );
        let proxy_added = r.add(
            "proxy_added_seconds",
            "Time spent in turnguard for one request, excluding waits on the upstream",
            Family::<EdgeLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_01, 2.0, 18))
            }),
        );
        let upstream_ttfb = r.add(
            "upstream_ttfb_seconds",
            "Time from sending a streamed request upstream to its first body bytes",
            Family::<ApiLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.005, 2.0, 14))
            }),
        );
        let inflight_streams = r.add(
            "inflight_streams",
            "SSE relays in flight",
            Gauge::<i64, AtomicI64>::default(),
        );
        let shed_requests = r.add(
            "shed_requests",
            "Requests shed with 503 and Retry-After before any work",
            Family::<ShedLabels, Counter>::default(),
        );
        let build_info = r.add(
            "build_info",
            "Build information (constant 1)",
            Family::<BuildLabels, Gauge<i64, AtomicI64>>::default(),
        );
        let open_connections = r.add(
            "open_connections",
            "Data-plane connections open",
            Gauge::<i64, AtomicI64>::default(),
        );
        let connections_rejected = r.add(
            "connections_rejected",
            "Data-plane connections closed at accept because max_connections were open",
            Counter::default(),
        );
        let schema_cache_bytes = r.add(
            "schema_cache_bytes",
            "Estimated memory held by compiled schemas",
            Gauge::<i64, AtomicI64>::default(),
        );
        let schema_cache_evictions = r.add(
            "schema_cache_evictions",
            "Compiled schemas evicted to stay within max_schema_cache_bytes",
            Counter::default(),
        );
        let run_counter_evictions = r.add(
            "run_counter_evictions",
            "Per-run released-call counters evicted, least recently used run first, to stay within their bound",
            Counter::default(),
        );
        let Registrar { registry, names } = r;
        let m = Self {
            run_counter_evictions,
            tool_labels: RwLock::new(foldhash::HashSet::default()),
            request_handles: Handles::default(),
            call_handles: Handles::default(),
            duration_handles: Handles::default(),
            added_handles: Handles::default(),
            open_connections,
            connections_rejected,
            schema_cache_bytes,
            schema_cache_evictions,
            names,
            request_duration,
            proxy_added,
            upstream_ttfb,
            inflight_streams,
            shed_requests,
            build_info,
            replay,
            approvals,
            approval_wait,
            approval_notifications,
            emissions,
            policy_reloads,
            policy_revision_info,
            turns,
            repairs,
            registry,
            requests,
            upstream_latency,
            hold_latency,
            tool_calls,
            upstream_errors,
            journal_write_failures,
            journal_commit_latency,
            journal_batch_size,
            journal_commits,
            journal_queue_depth,
            inflight_requests,
        };
        m.start_at_zero();
        m
    }

    /// Sets `build_info` and creates every label set of a closed enum at 0, so `rate()` and
    /// alerts see them before the first event.
    fn start_at_zero(&self) {
        self.build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        // Label sets from closed enums start at 0, so `rate()` and alerts see them before the
        // first event.
        for reason in [ShedReason::Overloaded, ShedReason::ShuttingDown] {
            self.shed_requests
                .get_or_create(&ShedLabels { reason })
                .inc_by(0);
        }
        for reason in UpstreamError::ALL {
            self.upstream_errors
                .get_or_create(&ReasonLabels { reason })
                .inc_by(0);
        }
        for result in [
            ApprovalResult::Held,
            ApprovalResult::Approved,
            ApprovalResult::Rejected,
            ApprovalResult::Expired,
        ] {
            let labels = ApprovalLabels { result };
            self.approvals.get_or_create(&labels).inc_by(0);
            if result != ApprovalResult::Held {
                drop(self.approval_wait.get_or_create(&labels));
            }
        }
        for result in NotificationResult::ALL {
            self.approval_notifications
                .get_or_create(&NotificationLabels::of(result))
                .inc_by(0);
        }
        for result in [ReloadResult::Ok, ReloadResult::Error] {
            self.policy_reloads
                .get_or_create(&ResultLabels { result })
                .inc_by(0);
        }
    }

    /// The exposition text (OpenMetrics text format).
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// The names of every registered metric family as exposed (`turnguard_…`, with `_total`
    /// for counters), in registration order. The catalogue in `deploy/README.md` is checked
    /// against this list.
    pub fn family_names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// Counts one answered request.
    pub fn request(&self, api: ApiLabel, status: u16, stream: bool) {
        let labels = RequestLabels {
            api,
            status,
            stream,
        };
        self.request_handles.get(&self.requests, &labels).inc();
    }

    /// Observes one data-plane request at the edge: its whole time in
    /// `turnguard_request_duration_seconds` and turnguard's part of it in
    /// `turnguard_proxy_added_seconds`, seconds.
    pub fn request_times(&self, labels: &EdgeLabels, duration: f64, added: f64) {
        self.duration_handles
            .get(&self.request_duration, labels)
            .observe(duration);
        self.added_handles
            .get(&self.proxy_added, labels)
            .observe(added);
    }

    /// Counts one decided call in `turnguard_tool_calls_total`. `known`: the catalog lists
    /// `d.tool_id` (else the label is `turnguard:unknown`, keeping the set bounded).
    pub fn count_call(&self, d: &crate::model::Decision, known: bool, surface: CallSurface) {
        let tool = if known {
            d.tool_id.as_str()
        } else {
            crate::policy::rules::UNKNOWN_TOOL_ID
        };
        let labels = CallLabels {
            outcome: d.outcome,
            stage: d.stage,
            channel: "tool",
            mode: CallMode::of(d.enforced),
            tool: self.tool_label(tool),
            surface,
        };
        self.call_handles.get(&self.tool_calls, &labels).inc();
    }

    /// The interned `tool` label for a catalog `toolId`: the first use of an id allocates,
    /// every later one clones an `Arc`. Only catalog ids (and `turnguard:unknown`) are
    /// passed, so the set is bounded by the catalogs loaded.
    pub fn tool_label(&self, tool_id: &str) -> Arc<str> {
        if let Some(found) = self
            .tool_labels
            .read()
            .ok()
            .and_then(|set| set.get(tool_id).cloned())
        {
            return found;
        }
        let label: Arc<str> = Arc::from(tool_id);
        if let Ok(mut set) = self.tool_labels.write() {
            if let Some(found) = set.get(tool_id) {
                return Arc::clone(found);
            }
            set.insert(Arc::clone(&label));
        }
        label
    }

    /// Counts one policy reload.
    pub fn policy_reload(&self, result: ReloadResult) {
        self.policy_reloads
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// Marks `new` as the active revision (and `old`, if different, as gone).
    pub fn policy_revision(&self, old: &str, new: &str) {
        if old != new {
            self.policy_revision_info.remove(&RevisionLabels {
                revision: old.to_owned(),
            });
        }
        self.policy_revision_info
            .get_or_create(&RevisionLabels {
                revision: new.to_owned(),
            })
            .set(1);
    }
}

/// Registers `metric` as `turnguard_<name>` and remembers its exposed name.
/// Registers metrics under the `turnguard` prefix and remembers their exported names.
struct Registrar {
    registry: Registry,
    names: Vec<String>,
}

impl Registrar {
    /// Registers `metric` as `turnguard_<name>` (counters get `_total`), returns it.
    fn add<M: Metric + Clone>(&mut self, name: &str, help: &str, metric: M) -> M {
        let suffix = match metric.metric_type() {
            MetricType::Counter => "_total",
            _ => "",
        };
        self.names.push(format!("turnguard_{name}{suffix}"));
        self.registry.register(name, help, metric.clone());
        metric
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept handle is the family's own metric: what is counted or observed through it is
    /// what the exposition shows, label set by label set.
    #[test]
    fn handles_update_the_familys_metrics() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.request(ApiLabel::Passthrough, 200, false);
        }
        m.request(ApiLabel::Passthrough, 502, true);
        let edge = EdgeLabels {
            api: ApiLabel::Mcp,
            stream: false,
        };
        m.request_times(&edge, 0.5, 0.25);
        m.request_times(&edge, 0.5, 0.25);
        let text = m.render();
        for line in [
            r#"turnguard_requests_total{api="passthrough",status="200",stream="false"} 3"#,
            r#"turnguard_requests_total{api="passthrough",status="502",stream="true"} 1"#,
            r#"turnguard_request_duration_seconds_count{api="mcp",stream="false"} 2"#,
            r#"turnguard_request_duration_seconds_sum{api="mcp",stream="false"} 1.0"#,
            r#"turnguard_proxy_added_seconds_sum{api="mcp",stream="false"} 0.5"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }

    /// Past `Handles::MAX` label sets nothing more is kept, and every update still reaches
    /// the family.
    #[test]
    fn handles_past_their_bound_still_count() {
        type Kept = Handles<RequestLabels, Counter>;
        let family = Family::<RequestLabels, Counter>::default();
        let handles = Kept::default();
        let labels = |status| RequestLabels {
            api: ApiLabel::None,
            status,
            stream: false,
        };
        let sets = u16::try_from(Kept::MAX + 10).unwrap();
        for _ in 0..2 {
            for status in 0..sets {
                handles.get(&family, &labels(status)).inc();
            }
        }
        assert_eq!(handles.kept.read().unwrap().len(), Kept::MAX);
        for status in 0..sets {
            assert_eq!(family.get_or_create(&labels(status)).get(), 2, "{status}");
        }
    }
}
