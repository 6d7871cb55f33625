//! Every Prometheus metric turnguard exports, in one owned registry handle (no globals).
//! Names follow `turnguard_<name>_<unit>[_total]`; label values come from enums' `as_str()`,
//! never from raw user input.

use std::sync::atomic::AtomicI64;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of `turnguard_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Provider API (`openai_chat`, `anthropic_messages`, `passthrough`).
    pub api: String,
    /// HTTP status sent to the agent.
    pub status: String,
    /// `true` for an SSE response.
    pub stream: String,
}

/// Labels of per-API histograms.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    pub api: String,
}

/// Labels of `turnguard_tool_calls_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    /// Outcome (tool-turn contract §B).
    pub outcome: String,
    /// The stage that decided it.
    pub stage: String,
    /// Emission channel (§A); `tool` for provider-native calls.
    pub channel: String,
    /// `enforce`, or `shadow` when the call was released although the outcome withholds it.
    pub mode: String,
}

/// Labels of `turnguard_upstream_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

/// Labels of `turnguard_policy_reloads_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `ok` or `error`.
    pub result: String,
}

/// Labels of `turnguard_policy_revision_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RevisionLabels {
    /// The active bundle's revision.
    pub revision: String,
}

/// Labels of `turnguard_turns_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrustLabels {
    /// The turn's `contentTrust`.
    pub trust: String,
}

/// Labels of `turnguard_repairs_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RepairLabels {
    /// Provider API.
    pub api: String,
}

/// Labels of `turnguard_emissions_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EmissionLabels {
    /// `structured` or `prompted`.
    pub channel: String,
    /// `valid`, `refused`, or the invalid reason.
    pub result: String,
}

/// Labels of `turnguard_replay_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplayLabels {
    /// `recovery` or `replay`.
    pub mode: String,
    /// `hit`, `miss`, `outcome_unknown`.
    pub result: String,
}

/// Labels of `turnguard_approvals_total` and `turnguard_approval_wait_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApprovalLabels {
    /// `held` (an approval interrupt was raised), `approved`, `rejected`, `expired`.
    pub result: String,
}

/// The metrics handle shared by the data plane, the journal and the admin plane.
pub struct Metrics {
    registry: Registry,
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
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("turnguard");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests answered on the data plane",
            requests.clone(),
        );
        let upstream_latency = Family::<ApiLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 14))
        });
        registry.register(
            "upstream_latency_seconds",
            "Time from sending upstream to the response headers",
            upstream_latency.clone(),
        );
        let hold_latency = Family::<ApiLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
        });
        registry.register(
            "stream_hold_seconds",
            "Time from the completion state being known to the held tool calls being released or replaced",
            hold_latency.clone(),
        );
        let tool_calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "tool_calls",
            "Tool calls decided by admission",
            tool_calls.clone(),
        );
        let upstream_errors = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "upstream_errors",
            "Upstream failures",
            upstream_errors.clone(),
        );
        let journal_write_failures = Counter::default();
        registry.register(
            "journal_write_failures",
            "Journal records that failed to commit",
            journal_write_failures.clone(),
        );
        let journal_commit_latency = Histogram::new(exponential_buckets(0.000_1, 2.0, 16));
        registry.register(
            "journal_commit_latency_seconds",
            "Journal commit latency per batch",
            journal_commit_latency.clone(),
        );
        let journal_batch_size = Histogram::new(exponential_buckets(1.0, 2.0, 10));
        registry.register(
            "journal_batch_size",
            "Records per committed journal batch",
            journal_batch_size.clone(),
        );
        let journal_queue_depth = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "journal_queue_depth",
            "Records waiting for the journal writer",
            journal_queue_depth.clone(),
        );
        let inflight_requests = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "inflight_requests",
            "Data-plane requests in flight",
            inflight_requests.clone(),
        );
        let policy_reloads = Family::<ResultLabels, Counter>::default();
        registry.register(
            "policy_reloads",
            "Policy bundle reloads by result",
            policy_reloads.clone(),
        );
        let policy_revision_info = Family::<RevisionLabels, Gauge<i64, AtomicI64>>::default();
        registry.register(
            "policy_revision_info",
            "1 for the revision of the active policy bundle",
            policy_revision_info.clone(),
        );
        let turns = Family::<TrustLabels, Counter>::default();
        registry.register(
            "turns",
            "Model turns admitted, by contentTrust",
            turns.clone(),
        );
        let repairs = Family::<RepairLabels, Counter>::default();
        registry.register("repairs", "Repair rounds sent upstream", repairs.clone());
        let emissions = Family::<EmissionLabels, Counter>::default();
        registry.register(
            "emissions",
            "Text answers checked in the structured and prompted channels, by result",
            emissions.clone(),
        );
        let replay = Family::<ReplayLabels, Counter>::default();
        registry.register(
            "replay",
            "Recovery and replay lookups by result",
            replay.clone(),
        );
        let approvals = Family::<ApprovalLabels, Counter>::default();
        registry.register(
            "approvals",
            "Approval interrupts raised (held) and resolved (approved, rejected, expired)",
            approvals.clone(),
        );
        let approval_wait = Family::<ApprovalLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.05, 2.0, 16))
        });
        registry.register(
            "approval_wait_seconds",
            "Time from an approval interrupt being raised to its resolution",
            approval_wait.clone(),
        );
        Self {
            replay,
            approvals,
            approval_wait,
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
            journal_queue_depth,
            inflight_requests,
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

    /// Counts one answered request.
    pub fn request(&self, api: &str, status: u16, stream: bool) {
        self.requests
            .get_or_create(&RequestLabels {
                api: api.to_owned(),
                status: status.to_string(),
                stream: stream.to_string(),
            })
            .inc();
    }
}

impl Metrics {
    /// Counts one policy reload (`ok` or `error`).
    pub fn policy_reload(&self, result: &str) {
        self.policy_reloads
            .get_or_create(&ResultLabels {
                result: result.to_owned(),
            })
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

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
