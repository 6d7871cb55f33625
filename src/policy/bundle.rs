//! The policy bundle's file formats (DESIGN.md §5). Every type is strict
//! (`deny_unknown_fields`): a misspelt key is an error naming the file and the path, never a
//! silent default. The JSON Schema of these formats is generated from the types
//! ([`bundle_json_schema`]) and committed as `policy/turnguard.schema.json`.
//!
//! Layout of a bundle directory:
//! - `turnguard.toml`: [`Settings`] (mode, unknown tools, limits, outcomes, redaction,
//!   prompted-output routes);
//! - `tools/*.toml`: [`ToolsFile`], the tool catalog;
//! - `rules/*.cedar`: authorization rules (Cedar);
//! - `schemas/*.json`: prompted-output schemas, named by file stem;
//! - `tests/*.toml`: [`TestsFile`], cases `turnguard policy test` runs.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `turnguard.toml`: bundle-wide settings.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// `enforce` (default) or `shadow`: decide, journal and count, but release unchanged.
    #[serde(default)]
    pub mode: Mode,
    /// What a tool the catalog does not know is: `treat-as-write` (default: `safetyTier`
    /// write, untrusted output) or `refuse`.
    #[serde(default)]
    pub unknown_tools: UnknownTools,
    /// Limits stage (tool-turn contract §B stage 6).
    #[serde(default)]
    pub limits: Limits,
    /// How each outcome reaches the agent (DESIGN.md §4).
    #[serde(default)]
    pub outcomes: Outcomes,
    /// Redaction stage (§B stage 7).
    #[serde(default)]
    pub redaction: Redaction,
    /// Routes that map a model to a prompted-output schema (§A), besides the
    /// `Turnguard-Prompted-Schema` header.
    #[serde(default)]
    pub prompted: Vec<PromptedRoute>,
    /// Models without tool support (`*` at the end matches a prefix). A request to one of
    /// them that declares a clarification tool fails with `capability_not_provided` (§E):
    /// the question cannot be asked through a tool, and turnguard does not guess one from
    /// text.
    #[serde(default)]
    pub models_without_tools: Vec<String>,
    /// Shipped catalogs this bundle includes, by name (`claude-code`, `codex`,
    /// `openai-agents`; `crate::policy::catalogs`). A bundle file `catalogs/<name>.toml` is
    /// used instead of the shipped one of that name. The serve setting `catalog` replaces
    /// this list. Default: none.
    #[serde(default)]
    pub catalogs: Vec<String>,
}

/// Enforcement mode, bundle-wide or per tool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Decisions are enforced.
    #[default]
    Enforce,
    /// Decisions are computed, journaled and counted; calls are released unchanged, except
    /// what the contract makes absolute (a truncated call).
    Shadow,
}

/// Treatment of tools the catalog does not list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum UnknownTools {
    /// `safetyTier = "write"`, untrusted output (OpenWOP tool-catalog.md: unclassified is write).
    #[default]
    TreatAsWrite,
    /// The call is refused at the name stage.
    Refuse,
}

/// Limits (tool-turn contract §B stage 6).
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Tool calls one model turn may carry; later calls are refused (`rate_limited`).
    #[serde(default = "default_per_turn")]
    pub tool_calls_per_turn: u32,
    /// Tool calls one run may release in this process; later calls are refused.
    #[serde(default = "default_per_run")]
    pub tool_calls_per_run: u32,
    /// Token bucket per (principal, tool).
    #[serde(default)]
    pub rate: Rate,
    /// Repair rounds turnguard may spend on one agent request.
    #[serde(default = "default_repair_rounds")]
    pub repair_rounds: u32,
    /// Clarification asks per run (§E).
    #[serde(default = "default_clarification_rounds")]
    pub clarification_rounds: u32,
}

fn default_per_turn() -> u32 {
    16
}
fn default_per_run() -> u32 {
    256
}
fn default_repair_rounds() -> u32 {
    2
}
fn default_clarification_rounds() -> u32 {
    3
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            tool_calls_per_turn: default_per_turn(),
            tool_calls_per_run: default_per_run(),
            rate: Rate::default(),
            repair_rounds: default_repair_rounds(),
            clarification_rounds: default_clarification_rounds(),
        }
    }
}

/// A token bucket: `burst` calls at once, refilled at `per_minute`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Rate {
    /// Bucket size, calls.
    pub burst: u32,
    /// Refill rate, calls per minute.
    pub per_minute: u32,
}

impl Default for Rate {
    fn default() -> Self {
        Self {
            burst: 30,
            per_minute: 60,
        }
    }
}

/// How an outcome reaches the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Surface {
    /// Host-authored tool result (`isError`) and another model round, within `repair_rounds`.
    Repair,
    /// The call is removed, host-authored text says why, the turn ends normally.
    EndTurn,
    /// An HTTP error in the OpenWOP envelope.
    Error,
    /// `held` only: the response waits (bounded by `approval_timeout_ms`) for the acting
    /// person's approval through the admin plane; then the calls are released, or refused
    /// (`approval_rejected`) on a rejection or timeout. Anywhere else it is `end-turn`.
    Wait,
}

/// Outcome surfacing per outcome (DESIGN.md §4).
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Outcomes {
    /// `invalid`: default `repair` (then `error` once `repair_rounds` are spent).
    #[serde(default = "repair")]
    pub invalid: Surface,
    /// When repairs of an invalid call are spent: default `error`.
    #[serde(default = "error")]
    pub invalid_after_repairs: Surface,
    /// `refused`: default `end-turn`.
    #[serde(default = "end_turn")]
    pub refused: Surface,
    /// `held`: default `wait` (for the acting person's approval, bounded; then executed or
    /// refused). `end-turn` or `error` give up at once.
    #[serde(default = "wait")]
    pub held: Surface,
    /// `suppressed-repeat`: default `repair` (the recorded result is supplied).
    #[serde(default = "repair")]
    pub suppressed_repeat: Surface,
}

fn repair() -> Surface {
    Surface::Repair
}
fn error() -> Surface {
    Surface::Error
}
fn end_turn() -> Surface {
    Surface::EndTurn
}
fn wait() -> Surface {
    Surface::Wait
}

impl Default for Outcomes {
    fn default() -> Self {
        Self {
            invalid: Surface::Repair,
            invalid_after_repairs: Surface::Error,
            refused: Surface::EndTurn,
            held: Surface::Wait,
            suppressed_repeat: Surface::Repair,
        }
    }
}

/// Redaction (tool-turn contract §B stage 7).
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Redaction {
    /// Use the built-in recognizers (API keys, bearer tokens, JWTs, private keys, cloud
    /// credentials). Default true.
    #[serde(default = "yes")]
    pub builtin: bool,
    /// Also strip matches from the arguments released to tools with `egress` other than
    /// `none`. Default false.
    #[serde(default)]
    pub strip_from_egress: bool,
    /// Extra patterns.
    #[serde(default)]
    pub patterns: Vec<RedactionPattern>,
    /// Argument locations that are always secret.
    #[serde(default)]
    pub pointers: Vec<RedactionPointer>,
}

fn yes() -> bool {
    true
}

impl Default for Redaction {
    fn default() -> Self {
        Self {
            builtin: true,
            strip_from_egress: false,
            patterns: Vec::new(),
            pointers: Vec::new(),
        }
    }
}

/// A named regular expression whose matches are secrets.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedactionPattern {
    /// Name shown in the marker `[REDACTED:<name>]`.
    pub name: String,
    /// Regular expression (Rust `regex` syntax).
    pub regex: String,
}

/// A JSON pointer into one tool's arguments whose value is always secret.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedactionPointer {
    /// `toolId` of a catalog tool.
    pub tool: String,
    /// RFC 6901 JSON pointer into the arguments.
    pub pointer: String,
}

/// Maps models to a prompted-output schema (§A `prompted`).
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptedRoute {
    /// Schema name: `schemas/<name>.json`.
    pub schema: String,
    /// Model names this applies to; `*` at the end matches a prefix.
    pub models: Vec<String>,
}

/// `tools/*.toml`: catalog entries.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolsFile {
    /// The tools this file declares.
    #[serde(default)]
    pub tool: Vec<ToolEntry>,
}

/// One catalog tool: an OpenWOP `ToolDescriptor` plus turnguard's own keys.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolEntry {
    /// Provider-facing tool names this entry matches in requests (`tools[].function.name`,
    /// `tools[].name`).
    pub names: Vec<String>,
    /// The OpenWOP ToolDescriptor, field for field (`spec/v2/tool-descriptor.schema.json`).
    pub descriptor: ToolDescriptor,
    /// `contentTrust` of this tool's output: `untrusted` (default) or `trusted`.
    #[serde(default)]
    pub content_trust: ContentTrust,
    /// JSON pointers into the arguments that form the effect's business key
    /// (`keying: business-identity`, OpenWOP idempotency.md).
    #[serde(default)]
    pub business_key: Vec<String>,
    /// This tool asks the person a question (§E clarification). No name is reserved.
    #[serde(default)]
    pub clarification: bool,
    /// The acting person may edit this tool's arguments before approving a held call
    /// (OpenWOP approval action `edit-accept`); the edited call is admitted again from the
    /// arguments stage before it is released. Default `false`: accept or reject only.
    #[serde(default)]
    pub approval_edit: bool,
    /// Per-tool mode; overrides the bundle's.
    #[serde(default)]
    pub mode: Option<Mode>,
    /// The `_meta` key under which this tool's MCP server accepts an idempotency key (for
    /// example `io.example/idempotencyKey`). When set, the MCP front puts the call's effect id
    /// there in every `tools/call` it forwards, so a server that sees the same key twice can
    /// refuse the second (OpenWOP idempotency.md). Default: none (nothing is added).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_meta_key: Option<String>,
}

/// `contentTrust` (OpenWOP AI envelope `meta.contentTrust`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ContentTrust {
    Trusted,
    #[default]
    Untrusted,
}

impl ContentTrust {
    /// The OpenWOP spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Trusted => "trusted",
            Self::Untrusted => "untrusted",
        }
    }
}

/// OpenWOP `ToolDescriptor` (RFC 0078; `tool-descriptor.schema.json`). Field names and enums
/// are the spec's.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ToolDescriptor {
    pub tool_id: String,
    pub source: Source,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<BTreeMap<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<BTreeMap<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<Auth>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Egress>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<Approval>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_policy: Option<ReplayPolicy>,
    pub safety_tier: SafetyTier,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_hint: Option<Hint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_hint: Option<Hint>,
}

/// `ToolDescriptor.auth`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Auth {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<String>,
    /// Never carries material: only whether a host-stored credential reference is needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_ref: Option<bool>,
}

macro_rules! spec_enum {
    ($(#[$m:meta])* $name:ident { $($variant:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
        pub enum $name {
            $(#[serde(rename = $s)] $variant),+
        }
        impl $name {
            /// The spec's spelling.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $s),+ }
            }
        }
    };
}

spec_enum!(
    /// `ToolDescriptor.source`.
    Source { NodePack = "node-pack", Workflow = "workflow", Mcp = "mcp", Connector = "connector", HostExtension = "host-extension" }
);
spec_enum!(
    /// `ToolDescriptor.safetyTier`.
    SafetyTier { Pure = "pure", Read = "read", Write = "write", Exec = "exec" }
);
spec_enum!(
    /// `ToolDescriptor.egress`.
    Egress { None = "none", SafeFetch = "safe-fetch", HostMediated = "host-mediated", HostOwned = "host-owned" }
);
spec_enum!(
    /// `ToolDescriptor.approval`.
    Approval { Never = "never", Conditional = "conditional", Always = "always" }
);
spec_enum!(
    /// `ToolDescriptor.replayPolicy`.
    ReplayPolicy { Deterministic = "deterministic", Idempotent = "idempotent", NonDeterministic = "non-deterministic" }
);
spec_enum!(
    /// `costHint` / `latencyHint`.
    Hint { Low = "low", Medium = "medium", High = "high" }
);

/// `tests/*.toml`: cases for `turnguard policy test`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TestsFile {
    #[serde(default)]
    pub case: Vec<TestCase>,
}

/// One case: a request and a model response, and the expected decision per call.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TestCase {
    /// Shown in the report.
    pub name: String,
    /// `openai_chat` or `anthropic_messages`.
    pub api: String,
    /// Request body file, relative to the bundle (JSON).
    pub request: String,
    /// Non-stream response body file, relative to the bundle (JSON).
    pub response: String,
    /// Acting person (`sub`); absent: the agent.
    #[serde(default)]
    pub principal: Option<String>,
    /// Expected decisions, in call order.
    pub expect: Vec<Expectation>,
}

/// The expected outcome and stage of one call.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Expectation {
    /// Tool name of the call (checked).
    pub tool: String,
    /// `executed`, `refused`, `held`, `suppressed-repeat`, `ended-turn`, `invalid`.
    pub outcome: String,
    /// The deciding stage.
    pub stage: String,
}

/// The JSON Schemas of the bundle file formats, generated from these types, with the file
/// names they are committed under in a bundle: `turnguard.schema.json` (for
/// `turnguard.toml`), `tools.schema.json` (`tools/*.toml`), `tests.schema.json`
/// (`tests/*.toml`).
pub fn bundle_json_schemas() -> Vec<(&'static str, Value)> {
    vec![
        (
            "turnguard.schema.json",
            serde_json::to_value(schemars::schema_for!(Settings)).unwrap_or_default(),
        ),
        (
            "tools.schema.json",
            serde_json::to_value(schemars::schema_for!(ToolsFile)).unwrap_or_default(),
        ),
        (
            "tests.schema.json",
            serde_json::to_value(schemars::schema_for!(TestsFile)).unwrap_or_default(),
        ),
    ]
}
