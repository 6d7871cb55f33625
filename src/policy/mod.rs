//! The policy engine, pure: [`compile`] turns a bundle's files into a [`CompiledPolicy`] (all
//! validation, schema compilation and rule parsing happen here) or a list of
//! [`PolicyError`]s naming file, line and path. Evaluation never fails. This module does no
//! IO: the files arrive as text ([`BundleSource`]); reading and watching the directory is
//! `crate::reload`'s job.

pub mod bundle;
pub mod catalog;
pub mod catalogs;
pub mod redact;
pub mod rules;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest, Sha256};

pub use bundle::{Mode, Settings, Surface};
pub use catalog::{Catalog, CatalogTool};
pub use redact::Redactor;
pub use rules::{Authz, AuthzRequest, Rules};

/// A bundle's files: bundle-relative path (with `/`) → text.
#[derive(Debug, Clone, Default)]
pub struct BundleSource {
    /// Where the files came from (a directory, or `embedded`).
    pub origin: String,
    /// The files, by bundle-relative path.
    pub files: BTreeMap<String, String>,
    /// The serve setting `catalog`: when set, the shipped catalogs to include instead of the
    /// bundle's own `catalogs` list (`none` for none). See [`catalogs`].
    pub catalogs: Option<Vec<String>>,
}

/// One problem in a bundle, with where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    /// Bundle-relative file.
    pub file: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// Key path inside the file (`tool[0].descriptor.safetyTier`), when known.
    pub path: Option<String>,
    /// The Cedar rule (`@id` or `file:line`), when the problem is in a rule.
    pub rule: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl PolicyError {
    pub(crate) fn at(file: &str, line: Option<usize>, message: String) -> Self {
        Self {
            file: file.to_owned(),
            line,
            path: None,
            rule: None,
            message,
        }
    }
    pub(crate) fn rule(file: &str, line: usize, rule: &str, message: String) -> Self {
        Self {
            file: file.to_owned(),
            line: Some(line),
            path: None,
            rule: Some(rule.to_owned()),
            message,
        }
    }
    pub(crate) fn bundle(message: String) -> Self {
        Self {
            file: "(bundle)".into(),
            line: None,
            path: None,
            rule: None,
            message,
        }
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if let Some(l) = self.line {
            write!(f, ":{l}")?;
        }
        write!(f, ":")?;
        if let Some(p) = &self.path {
            write!(f, " at `{p}`:")?;
        }
        if let Some(r) = &self.rule {
            write!(f, " rule `{r}`:")?;
        }
        write!(f, " {}", self.message)
    }
}

impl std::error::Error for PolicyError {}

/// A compiled, immutable policy snapshot. Each request takes one and uses it throughout.
pub struct CompiledPolicy {
    /// Content hash of the bundle (first 16 hex digits of SHA-256 over paths and texts).
    pub revision: String,
    /// Where the bundle came from.
    pub origin: String,
    /// `turnguard.toml`.
    pub settings: Settings,
    /// The tool catalog.
    pub catalog: Catalog,
    /// Cedar rules.
    pub rules: Rules,
    /// Redaction (shared with the journal records that redact in the writer thread).
    pub redactor: Arc<Redactor>,
    /// Prompted-output schemas by name (`schemas/<name>.json`).
    pub prompted: BTreeMap<String, Arc<Value>>,
    /// Test cases (file, case).
    pub tests: Vec<(String, bundle::TestCase)>,
    /// The catalogs included ([`catalogs`]): name, where it came from (`shipped` or the
    /// bundle file), and how many tools it added.
    pub catalogs: Vec<IncludedCatalog>,
    /// The bundle's files, for test cases that name request/response files.
    pub files: BTreeMap<String, String>,
}

impl CompiledPolicy {
    /// The catalog tool for a provider-facing name, or the unknown-tool stand-in.
    pub fn tool(&self, name: &str) -> &CatalogTool {
        self.catalog
            .by_name(name)
            .unwrap_or_else(|| self.catalog.unknown())
    }

    /// Effective mode for a tool (per-tool override, else the bundle's).
    pub fn mode_for(&self, tool: &CatalogTool) -> Mode {
        tool.mode.unwrap_or(self.settings.mode)
    }

    /// The prompted-output schema routed to `model`, if any.
    pub fn prompted_route(&self, model: &str) -> Option<&str> {
        self.settings.prompted.iter().find_map(|r| {
            r.models
                .iter()
                .any(|m| match m.strip_suffix('*') {
                    Some(prefix) => model.starts_with(prefix),
                    None => m == model,
                })
                .then_some(r.schema.as_str())
        })
    }

    /// The bundle lists `model` as having no tool support (`models_without_tools`).
    pub fn model_without_tools(&self, model: &str) -> bool {
        self.settings
            .models_without_tools
            .iter()
            .any(|m| match m.strip_suffix('*') {
                Some(prefix) => model.starts_with(prefix),
                None => m == model,
            })
    }
}

/// A catalog a bundle included by name ([`catalogs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncludedCatalog {
    /// Its name (`claude-code`).
    pub name: String,
    /// `shipped` (built into turnguard) or the bundle file that replaced it.
    pub source: String,
    /// Tools it added to the catalog.
    pub tools: usize,
}

impl CompiledPolicy {
    /// One line for logs and `policy check`: catalogued tools by `safetyTier`, and the
    /// included catalogs (`read 12, write 8, exec 9, pure 7; catalogs claude-code (29),
    /// codex (19)`).
    pub fn catalog_summary(&self) -> String {
        let mut tiers: BTreeMap<&str, usize> = BTreeMap::new();
        for t in self.catalog.tools() {
            *tiers.entry(t.descriptor.safety_tier.as_str()).or_default() += 1;
        }
        let tiers = if tiers.is_empty() {
            "no catalogued tools".to_owned()
        } else {
            ["pure", "read", "write", "exec"]
                .iter()
                .filter_map(|k| tiers.get(k).map(|n| format!("{k} {n}")))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let catalogs = if self.catalogs.is_empty() {
            "no shipped catalog".to_owned()
        } else {
            format!(
                "catalogs {}",
                self.catalogs
                    .iter()
                    .map(|c| if c.source == "shipped" {
                        format!("{} ({})", c.name, c.tools)
                    } else {
                        format!("{} ({}, from {})", c.name, c.tools, c.source)
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        format!("{tiers}; {catalogs}")
    }
}

/// Parses a TOML file strictly; errors name the file, line and key path.
fn parse_toml<T: DeserializeOwned>(file: &str, text: &str) -> Result<T, PolicyError> {
    let de = toml::Deserializer::new(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let line = e.inner().span().map(|s| {
            text[..s.start.min(text.len())]
                .bytes()
                .filter(|b| *b == b'\n')
                .count()
                + 1
        });
        PolicyError {
            file: file.to_owned(),
            line,
            path: Some(e.path().to_string()).filter(|p| p != "."),
            rule: None,
            message: e.inner().message().to_owned(),
        }
    })
}

/// Compiles a bundle. Every problem is reported, not only the first.
pub fn compile(src: &BundleSource) -> Result<CompiledPolicy, Vec<PolicyError>> {
    let mut errors = Vec::new();
    let mut hasher = Sha256::new();
    for (path, text) in &src.files {
        hasher.update(path.as_bytes());
        hasher.update([0]);
        hasher.update(text.as_bytes());
        hasher.update([0]);
    }
    let revision = hex::encode(&hasher.finalize()[..8]);

    let settings_text = src
        .files
        .get("turnguard.toml")
        .map(String::as_str)
        .unwrap_or("");
    let settings: Settings = match parse_toml("turnguard.toml", settings_text) {
        Ok(s) => s,
        Err(e) => {
            errors.push(e);
            Settings::default()
        }
    };
    let mut tool_files = Vec::new();
    let mut rule_files = Vec::new();
    let mut prompted = BTreeMap::new();
    let mut tests = Vec::new();
    for (path, text) in &src.files {
        match classify(path) {
            FileKind::Settings | FileKind::Data | FileKind::Catalog => {}
            FileKind::Tools => match parse_toml::<bundle::ToolsFile>(path, text) {
                Ok(t) => tool_files.push((path.clone(), text.clone(), t)),
                Err(e) => errors.push(e),
            },
            FileKind::Rules => rule_files.push((path.clone(), text.clone())),
            FileKind::Schema(name) => match serde_json::from_str::<Value>(text) {
                Ok(v) => match jsonschema::options().with_draft(jsonschema::Draft::Draft202012).build(&v) {
                    Ok(_) => {
                        prompted.insert(name, Arc::new(v));
                    }
                    Err(e) => errors.push(PolicyError::at(path, None, format!("not a valid JSON Schema: {e}"))),
                },
                Err(e) => errors.push(PolicyError::at(path, Some(e.line()), format!("not JSON: {e}"))),
            },
            FileKind::Tests => match parse_toml::<bundle::TestsFile>(path, text) {
                Ok(t) => tests.extend(t.case.into_iter().map(|c| (path.clone(), c))),
                Err(e) => errors.push(e),
            },
            FileKind::Unknown => errors.push(PolicyError::at(
                path,
                None,
                "unexpected file: a bundle holds turnguard.toml, tools/*.toml, catalogs/*.toml, rules/*.cedar, schemas/*.json, tests/*.toml and data files under tests/ (examples/ is ignored)".into(),
            )),
        }
    }
    let included = include_catalogs(src, &settings, settings_text, &mut tool_files, &mut errors);
    for r in &settings.prompted {
        if !prompted.contains_key(&r.schema) {
            errors.push(PolicyError::at(
                "turnguard.toml",
                catalog::line_of_value(settings_text, &r.schema),
                format!(
                    "prompted route names schema `{}`, but there is no schemas/{}.json",
                    r.schema, r.schema
                ),
            ));
        }
    }
    let catalog = match Catalog::compile(&tool_files) {
        Ok(c) => Some(c),
        Err(e) => {
            errors.extend(e);
            None
        }
    };
    for p in &settings.redaction.pointers {
        if catalog.as_ref().is_some_and(|c| c.by_id(&p.tool).is_none()) {
            errors.push(PolicyError::at(
                "turnguard.toml",
                catalog::line_of_value(settings_text, &p.tool),
                format!(
                    "redaction pointer names tool `{}`, which is not in the catalog",
                    p.tool
                ),
            ));
        }
    }
    let redactor = match Redactor::compile(&settings.redaction, "turnguard.toml", settings_text) {
        Ok(r) => Some(Arc::new(r)),
        Err(e) => {
            errors.extend(e);
            None
        }
    };
    let rules = match &catalog {
        Some(c) => match Rules::compile(&rule_files, c) {
            Ok(r) => Some(r),
            Err(e) => {
                errors.extend(e);
                None
            }
        },
        None => None,
    };
    match (catalog, rules, redactor) {
        (Some(catalog), Some(rules), Some(redactor)) if errors.is_empty() => Ok(CompiledPolicy {
            revision,
            origin: src.origin.clone(),
            settings,
            catalog,
            rules,
            redactor,
            prompted,
            tests,
            files: src.files.clone(),
            catalogs: included,
        }),
        _ => Err(errors),
    }
}

/// Adds the selected catalogs' tools files to `tool_files`: the serve setting's list when
/// set, else the bundle's `catalogs`; each name resolves to the bundle's
/// `catalogs/<name>.toml`, else the shipped catalog of that name, else an error.
fn include_catalogs(
    src: &BundleSource,
    settings: &Settings,
    settings_text: &str,
    tool_files: &mut Vec<(String, String, bundle::ToolsFile)>,
    errors: &mut Vec<PolicyError>,
) -> Vec<IncludedCatalog> {
    let (names, from_setting) = match &src.catalogs {
        Some(list) => (list.clone(), true),
        None => (settings.catalogs.clone(), false),
    };
    let mut seen = std::collections::BTreeSet::new();
    let mut included = Vec::new();
    for name in names.iter().map(|n| n.trim()) {
        if name.is_empty() || name == catalogs::NONE || !seen.insert(name.to_owned()) {
            continue;
        }
        let local = format!("catalogs/{name}.toml");
        let (file, text, source) = match (src.files.get(&local), catalogs::shipped(name)) {
            // The repository's policy/ carries the shipped files themselves.
            (Some(text), Some(shipped)) if text == shipped => {
                (local.clone(), text.clone(), "shipped".to_owned())
            }
            (Some(text), _) => (local.clone(), text.clone(), local.clone()),
            (None, Some(text)) => (
                format!("{local} (shipped)"),
                text.to_owned(),
                "shipped".to_owned(),
            ),
            (None, None) => {
                let message = format!(
                    "no catalog `{name}`: turnguard ships {}; a bundle can add its own as catalogs/{name}.toml",
                    catalogs::names()
                );
                errors.push(if from_setting {
                    PolicyError::at("(setting `catalog`)", None, message)
                } else {
                    PolicyError::at(
                        "turnguard.toml",
                        catalog::line_of_value(settings_text, name),
                        message,
                    )
                });
                continue;
            }
        };
        match parse_toml::<bundle::ToolsFile>(&file, &text) {
            Ok(t) => {
                included.push(IncludedCatalog {
                    name: name.to_owned(),
                    source,
                    tools: t.tool.len(),
                });
                tool_files.push((file, text, t));
            }
            Err(e) => errors.push(e),
        }
    }
    included
}

enum FileKind {
    Settings,
    Tools,
    Rules,
    Schema(String),
    Tests,
    Data,
    /// `catalogs/<name>.toml`: read only when the bundle or the setting selects `name`.
    Catalog,
    Unknown,
}

fn classify(path: &str) -> FileKind {
    let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
    match (dir, name.rsplit_once('.')) {
        ("", Some(("turnguard", "toml"))) => FileKind::Settings,
        ("", Some((_, "json"))) if name.ends_with(".schema.json") => FileKind::Data,
        ("", Some((_, "md"))) => FileKind::Data,
        ("tools", Some((_, "toml"))) => FileKind::Tools,
        ("rules", Some((_, "cedar"))) => FileKind::Rules,
        ("schemas", Some((stem, "json"))) => FileKind::Schema(stem.to_owned()),
        ("tests", Some((_, "toml"))) => FileKind::Tests,
        ("catalogs", Some((_, "toml"))) => FileKind::Catalog,
        // Example bundles shipped beside the bundle (policy/examples/acme): not part of it.
        (d, _) if d == "examples" || d.starts_with("examples/") => FileKind::Data,
        (d, _) if d == "tests" || d.starts_with("tests/") => FileKind::Data,
        (d, Some((_, "md"))) if !d.is_empty() => FileKind::Data,
        _ => FileKind::Unknown,
    }
}
