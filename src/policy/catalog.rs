//! The tool catalog: OpenWOP `ToolDescriptor`s plus turnguard's keys, looked up by the
//! provider-facing tool name (DESIGN.md §5; OpenWOP tool-catalog.md).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use serde_json::Value;

use super::bundle::{ContentTrust, Mode, SafetyTier, Source, ToolDescriptor, ToolEntry, ToolsFile};
use super::rules::UNKNOWN_TOOL_ID;
use super::PolicyError;

/// One compiled catalog tool.
#[derive(Debug, Clone)]
pub struct CatalogTool {
    /// The descriptor, as served by `GET /tools/{toolId}`.
    pub descriptor: ToolDescriptor,
    /// Provider-facing names.
    pub names: Vec<String>,
    /// Trust of this tool's output.
    pub content_trust: ContentTrust,
    /// Business-key JSON pointers (empty: activity-recipe keying).
    pub business_key: Vec<String>,
    /// Asks the person a question (§E).
    pub clarification: bool,
    /// The person may edit the arguments before approving (`approval_edit`).
    pub approval_edit: bool,
    /// Per-tool mode override.
    pub mode: Option<Mode>,
    /// The `_meta` key the tool's MCP server reads an idempotency key from ([`ToolEntry`]).
    pub idempotency_meta_key: Option<String>,
    /// The bundle file it came from.
    pub file: String,
    /// `false` for the unknown-tool stand-in.
    pub catalogued: bool,
    /// The `inputSchema` compiled on first use and kept with this policy snapshot (a reload
    /// builds a new catalog), so a call does not rebuild, hash and look the schema up.
    compiled_input: OnceLock<CompiledSchema>,
}

/// A compiled JSON Schema, or why it does not compile (the admission stage's
/// `arguments::Compiled`).
pub type CompiledSchema = Arc<Result<jsonschema::Validator, String>>;

impl CatalogTool {
    /// The descriptor's `inputSchema`.
    pub fn input_schema(&self) -> Option<&BTreeMap<String, Value>> {
        self.descriptor.input_schema.as_ref()
    }

    /// The `inputSchema` compiled by `compile` on the first call of this snapshot, the same
    /// validator after; `None` when the descriptor has none.
    pub fn input_validator(
        &self,
        compile: impl FnOnce(&Value) -> CompiledSchema,
    ) -> Option<CompiledSchema> {
        let schema = self.descriptor.input_schema.as_ref()?;
        let compiled = self
            .compiled_input
            .get_or_init(|| compile(&Value::Object(schema.clone().into_iter().collect())));
        Some(Arc::clone(compiled))
    }

    /// Needs the trust gate when the turn is untrusted (tool-turn contract §C; DESIGN.md §4):
    /// `write`/`exec`, any egress other than `none` (absent counts as egress), or
    /// `approval = "always"`.
    pub fn gated(&self) -> bool {
        use super::bundle::{Approval, Egress};
        matches!(
            self.descriptor.safety_tier,
            SafetyTier::Write | SafetyTier::Exec
        ) || self.descriptor.egress != Some(Egress::None)
            || self.descriptor.approval == Some(Approval::Always)
    }

    /// Re-runnable without harm: `safetyTier` pure/read or `replayPolicy`
    /// deterministic/idempotent (tool-turn contract §D).
    pub fn rerunnable(&self) -> bool {
        use super::bundle::ReplayPolicy;
        matches!(
            self.descriptor.safety_tier,
            SafetyTier::Pure | SafetyTier::Read
        ) || matches!(
            self.descriptor.replay_policy,
            Some(ReplayPolicy::Deterministic | ReplayPolicy::Idempotent)
        )
    }
}

/// The compiled catalog.
#[derive(Debug, Clone)]
pub struct Catalog {
    tools: Vec<CatalogTool>,
    /// foldhash: the keys are the catalog's own names (a model-chosen name is only looked
    /// up, never inserted).
    by_name: foldhash::HashMap<String, usize>,
    by_id: BTreeMap<String, usize>,
    unknown: CatalogTool,
}

impl Catalog {
    /// Builds the catalog from every `tools/*.toml` (parsed), checking what the schema cannot:
    /// unique ids and names, `exec` only on host extensions, compilable `inputSchema`s and
    /// well-formed business keys.
    pub fn compile(files: &[(String, String, ToolsFile)]) -> Result<Self, Vec<PolicyError>> {
        let mut errors = Vec::new();
        let mut tools: Vec<CatalogTool> = Vec::new();
        let mut by_name = foldhash::HashMap::default();
        let mut by_id = BTreeMap::new();
        for (file, text, parsed) in files {
            for entry in &parsed.tool {
                let ToolEntry {
                    names,
                    descriptor,
                    content_trust,
                    business_key,
                    clarification,
                    approval_edit,
                    mode,
                    idempotency_meta_key,
                } = entry.clone();
                let id = descriptor.tool_id.clone();
                let line = line_of_value(text, &id);
                let err = |m: String| PolicyError::at(file, line, format!("tool `{id}`: {m}"));
                if id.is_empty() {
                    errors.push(err("`toolId` must not be empty".into()));
                }
                if descriptor.safety_tier == SafetyTier::Exec
                    && descriptor.source != Source::HostExtension
                {
                    errors.push(err(
                        "`safetyTier = \"exec\"` requires `source = \"host-extension\"` (OpenWOP tool-catalog.md; RFC 0069)".into(),
                    ));
                }
                if names.is_empty() {
                    errors.push(err("`names` lists no provider-facing tool name".into()));
                }
                if let Some(schema) = &descriptor.input_schema {
                    let v = Value::Object(schema.clone().into_iter().collect());
                    if let Err(e) = jsonschema::options()
                        .with_draft(jsonschema::Draft::Draft202012)
                        .build(&v)
                    {
                        errors.push(err(format!("`inputSchema` does not compile: {e}")));
                    }
                }
                if idempotency_meta_key
                    .as_deref()
                    .is_some_and(|k| k.is_empty() || k.len() > 256)
                {
                    errors.push(err("`idempotency_meta_key` must be 1-256 characters".into()));
                }
                for p in &business_key {
                    if !p.starts_with('/') {
                        errors.push(err(format!(
                            "business key `{p}` is not a JSON pointer (RFC 6901)"
                        )));
                    }
                }
                let index = tools.len();
                if by_id.insert(id.clone(), index).is_some() {
                    errors.push(err("the `toolId` is declared twice".into()));
                }
                for n in &names {
                    if by_name.insert(n.clone(), index).is_some() {
                        errors.push(err(format!(
                            "the name `{n}` already belongs to another tool"
                        )));
                    }
                }
                tools.push(CatalogTool {
                    descriptor,
                    names,
                    content_trust,
                    business_key,
                    clarification,
                    approval_edit,
                    mode,
                    idempotency_meta_key,
                    file: file.clone(),
                    catalogued: true,
                    compiled_input: OnceLock::new(),
                });
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(Self {
            tools,
            by_name,
            by_id,
            unknown: unknown_tool(),
        })
    }

    /// The tool a provider-facing name refers to.
    pub fn by_name(&self, name: &str) -> Option<&CatalogTool> {
        self.by_name.get(name).map(|&i| &self.tools[i])
    }

    /// The tool with this `toolId`.
    pub fn by_id(&self, id: &str) -> Option<&CatalogTool> {
        self.by_id.get(id).map(|&i| &self.tools[i])
    }

    /// Every catalogued tool, sorted by `toolId`.
    pub fn tools(&self) -> impl Iterator<Item = &CatalogTool> {
        self.by_id.values().map(|&i| &self.tools[i])
    }

    /// The stand-in for tools the catalog does not list: `write`, untrusted output.
    pub fn unknown(&self) -> &CatalogTool {
        &self.unknown
    }

    /// Number of catalogued tools.
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    /// No tool is catalogued.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }
}

fn unknown_tool() -> CatalogTool {
    CatalogTool {
        descriptor: ToolDescriptor {
            tool_id: UNKNOWN_TOOL_ID.into(),
            source: Source::HostExtension,
            title: Some("A tool the catalog does not list".into()),
            description: None,
            input_schema: None,
            output_schema: None,
            auth: None,
            egress: None,
            approval: None,
            replay_policy: None,
            safety_tier: SafetyTier::Write,
            cost_hint: None,
            latency_hint: None,
        },
        names: Vec::new(),
        content_trust: ContentTrust::Untrusted,
        business_key: Vec::new(),
        clarification: false,
        approval_edit: false,
        mode: None,
        idempotency_meta_key: None,
        file: String::new(),
        catalogued: false,
        compiled_input: OnceLock::new(),
    }
}

/// The 1-based line where `value` first appears quoted in `text`.
pub(crate) fn line_of_value(text: &str, value: &str) -> Option<usize> {
    let needle = format!("\"{value}\"");
    text.find(&needle)
        .map(|at| text[..at].bytes().filter(|b| *b == b'\n').count() + 1)
}
