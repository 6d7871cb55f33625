//! `turnguard policy check | test | explain | schema`: the policy author's tools. Each
//! returns its report and exit code so the CLI and tests share one implementation.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use crate::admission::{self, AdmitCtx, LimitState, SchemaCache};
use crate::model::{Api, ChoiceEmissions, ChoiceVerdict, Surfacing, Turn};
use crate::policy::{bundle, CompiledPolicy};
use crate::provider;
use crate::reload::{self, LoadError};

/// A command's report and exit code.
pub struct Report {
    pub text: String,
    pub code: i32,
}

fn load(dir: &Path, catalogs: Option<&[String]>) -> Result<CompiledPolicy, Report> {
    let mut src = reload::read_dir(dir).map_err(|e| Report {
        text: format!("{e}\n"),
        code: 1,
    })?;
    src.catalogs = catalogs.map(<[String]>::to_vec);
    crate::policy::compile(&src).map_err(|errors| {
        let mut text = String::new();
        for e in &errors {
            let _ = writeln!(text, "{}/{e}", dir.display());
        }
        let _ = writeln!(text, "{} problem(s); the bundle is not valid", errors.len());
        Report { text, code: 1 }
    })
}

/// `policy check DIR [--catalog NAMES]`: exactly the start-up validation (with the serve
/// setting `catalog` when given). Exit 1 with `file:line` errors.
pub fn check(dir: &Path, catalogs: Option<&[String]>) -> Report {
    match load(dir, catalogs) {
        Ok(p) => {
            let mut text = format!(
                "ok: {} revision {}: {} tool(s), {} rule(s), {} prompted schema(s), {} test case(s)\n",
                dir.display(),
                p.revision,
                p.catalog.len(),
                p.rules.len(),
                p.prompted.len(),
                p.tests.len()
            );
            let _ = writeln!(text, "catalog: {}", p.catalog_summary());
            if p.rules.permits() == 0 {
                text.push_str(
                    "warning: no rule permits any call: every tool call will be refused (Cedar default deny); add a `permit` in rules/*.cedar\n",
                );
            }
            Report { text, code: 0 }
        }
        Err(r) => r,
    }
}

/// Admits a request/response pair under `policy` the way the data plane does (no journal:
/// effect claims are not made). Returns the turn and one verdict per choice with calls.
pub fn admit_pair(
    policy: &CompiledPolicy,
    api: Api,
    request: &Value,
    response: &Value,
    person: Option<&str>,
) -> Result<(Turn, Vec<(ChoiceEmissions, ChoiceVerdict)>), String> {
    let turn = provider::adapter(api)
        .parse_request(request)
        .map_err(|e| format!("request: {e}"))?;
    // Offline there is no journal: a turn continuing a stored response is untrusted.
    let trust = admission::trust::of_turn(&turn, policy, &[]);
    let schemas = SchemaCache::default();
    let limits = LimitState::default();
    let never = |_: u32, _: usize, _: &str| false;
    let ctx = AdmitCtx {
        policy,
        schemas: &schemas,
        limits: &limits,
        person,
        agent: crate::clock::AGENT_ID,
        trust,
        run: None,
        provider: api.as_str(),
        approved: &never,
        repairs_left: policy.settings.limits.repair_rounds,
        explain: true,
    };
    let out = provider::adapter(api)
        .parse_response(response, &turn.answer_context())
        .map_err(|e| format!("the response does not identify each call uniquely: {e}"))?
        .into_iter()
        .filter(|c| !c.calls.is_empty())
        .map(|c| {
            let v = admission::admit_choice(&ctx, &turn, &c);
            (c, v)
        })
        .collect();
    Ok((turn, out))
}

fn json_file(policy: &CompiledPolicy, path: &str) -> Result<Value, String> {
    let text = policy
        .files
        .get(path)
        .ok_or_else(|| format!("`{path}` is not a file of the bundle"))?;
    serde_json::from_str(text).map_err(|e| format!("`{path}` is not JSON: {e}"))
}

/// `policy test DIR [--catalog NAMES]`: runs the bundle's test cases. Exit 1 when a case
/// fails or none exist.
pub fn test(dir: &Path, catalogs: Option<&[String]>) -> Report {
    let policy = match load(dir, catalogs) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let mut text = String::new();
    let mut failed = 0;
    for (file, case) in &policy.tests {
        match run_case(&policy, case) {
            Ok(()) => {
                let _ = writeln!(text, "ok    {file}: {}", case.name);
            }
            Err(why) => {
                failed += 1;
                let _ = writeln!(text, "FAIL  {file}: {}: {why}", case.name);
            }
        }
    }
    let total = policy.tests.len();
    let _ = writeln!(text, "{} passed, {failed} failed", total - failed);
    let code = if failed > 0 || total == 0 { 1 } else { 0 };
    if total == 0 {
        let _ = writeln!(text, "no test cases in {}/tests/*.toml", dir.display());
    }
    Report { text, code }
}

fn run_case(policy: &CompiledPolicy, case: &bundle::TestCase) -> Result<(), String> {
    let api = Api::from_label(&case.api).ok_or_else(|| format!("unknown api `{}`", case.api))?;
    let request = json_file(policy, &case.request)?;
    let response = json_file(policy, &case.response)?;
    let (_, choices) = admit_pair(policy, api, &request, &response, case.principal.as_deref())?;
    let got: Vec<(String, &str, &str)> = choices
        .iter()
        .flat_map(|(c, v)| {
            c.calls
                .iter()
                .zip(&v.decisions)
                .map(|(call, d)| (call.name.clone(), d.outcome.as_str(), d.stage.as_str()))
        })
        .collect();
    if got.len() != case.expect.len() {
        return Err(format!(
            "expected {} call(s), the response has {}",
            case.expect.len(),
            got.len()
        ));
    }
    for (i, (want, (name, outcome, stage))) in case.expect.iter().zip(&got).enumerate() {
        if &want.tool != name || want.outcome != *outcome || want.stage != *stage {
            return Err(format!(
                "call {i}: expected `{}` {} at {}, got `{name}` {outcome} at {stage}",
                want.tool, want.outcome, want.stage
            ));
        }
    }
    Ok(())
}

/// `policy explain --request R --response S [--policy DIR] [--api A] [--principal SUB]`:
/// every stage's decision for every call, and which Cedar rules decided. The API is `api`
/// when given, else read from the response's shape; `person` is the acting person (`sub`).
/// Exit 1, with the problem as the text, when the bundle, a file or the pair cannot be read.
pub fn explain(
    policy_dir: &Path,
    api: Option<&str>,
    request: &Path,
    response: &Path,
    person: Option<&str>,
) -> Report {
    match explain_text(policy_dir, api, request, response, person) {
        Ok(text) => Report { text, code: 0 },
        Err(text) => Report { text, code: 1 },
    }
}

/// The `explain` report, or the first problem's text.
fn explain_text(
    policy_dir: &Path,
    api: Option<&str>,
    request: &Path,
    response: &Path,
    person: Option<&str>,
) -> Result<String, String> {
    let policy = reload::load(policy_dir).map_err(|e| match e {
        LoadError::Invalid(errors) => errors.iter().map(|e| format!("{e}\n")).collect(),
        e => format!("{e}\n"),
    })?;
    // Both files are read before either's problem is reported (the request's first).
    let (req, resp) = (read_json(request), read_json(response));
    let (req, resp) = (req?, resp?);
    let api = explain_api(api, &resp)?;
    let (turn, choices) =
        admit_pair(&policy, api, &req, &resp, person).map_err(|e| format!("{e}\n"))?;
    let mut text = String::new();
    let _ = writeln!(
        text,
        "policy {} ({}), api {}, turn contentTrust {}",
        policy.revision,
        policy.origin,
        api.as_str(),
        admission::trust::of_turn(&turn, &policy, &[]).as_str()
    );
    if choices.is_empty() {
        let _ = writeln!(text, "the response has no tool call");
    }
    for (c, v) in &choices {
        explain_choice(&mut text, &policy, c, v, person);
    }
    Ok(text)
}

/// A JSON file's value, or the problem (naming the file) as a report line.
fn read_json(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}\n", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}\n", path.display()))
}

/// The API of the pair: the `--api` label, else `openai_chat` when the response has
/// `choices` and `anthropic_messages` otherwise.
fn explain_api(label: Option<&str>, response: &Value) -> Result<Api, String> {
    match label {
        Some(a) => Api::from_label(a)
            .ok_or_else(|| format!("unknown api `{a}` (openai_chat, anthropic_messages)\n")),
        // A Messages request has `max_tokens` and content blocks; Chat has `choices` in the response.
        None if response.get("choices").is_some() => Ok(Api::OpenAiChat),
        None => Ok(Api::AnthropicMessages),
    }
}

/// Appends one choice: its completion, each call with its stages, rules and `argsHash`,
/// and how it surfaces.
fn explain_choice(
    text: &mut String,
    policy: &CompiledPolicy,
    c: &ChoiceEmissions,
    v: &ChoiceVerdict,
    person: Option<&str>,
) {
    let _ = writeln!(
        text,
        "choice {} (completion {}: {})",
        c.choice,
        c.completion.state.as_str(),
        c.completion.reason
    );
    for (i, (call, d)) in c.calls.iter().zip(&v.decisions).enumerate() {
        let _ = writeln!(
            text,
            "  call {i} `{}` id {} → {} at {} ({}){}",
            admission::sanitize_label(&call.name),
            admission::sanitize_label(&call.id),
            d.outcome.as_str(),
            d.stage.as_str(),
            d.reason,
            if d.enforced {
                ""
            } else {
                " [shadow: released anyway]"
            }
        );
        for (stage, note) in &d.trace {
            let _ = writeln!(text, "    {:<13} {note}", stage.as_str());
        }
        for r in &d.rules {
            let at = policy
                .rules
                .meta(r)
                .map(|m| format!(" ({}:{})", m.file, m.line))
                .unwrap_or_default();
            let _ = writeln!(text, "    rule          {r}{at}");
        }
        if let Some(h) = &d.args_hash {
            let _ = writeln!(text, "    argsHash      {h}");
        }
    }
    let _ = writeln!(
        text,
        "  surfaced as: {}",
        surfacing_text(&v.surfacing, person)
    );
}

/// How a choice's withheld calls reach the agent, in words (`Wait` with no acting person
/// is refused at once: nobody could approve).
fn surfacing_text(surfacing: &Surfacing, person: Option<&str>) -> String {
    match surfacing {
        Surfacing::Release => "release".to_owned(),
        Surfacing::Drop => "drop the withheld calls, release the rest".to_owned(),
        Surfacing::EndTurn(_) => "end-turn".to_owned(),
        Surfacing::Repair(items) => {
            format!("repair round with {} host-authored result(s)", items.len())
        }
        Surfacing::Error(e) => format!("error {} {}", e.status, e.code),
        Surfacing::Wait if person.is_none() => {
            "refuse at once: no acting person (`--principal`) could approve it (`no_approver`)"
                .to_owned()
        }
        Surfacing::Wait => {
            "wait for the acting person's approval (then release, or refuse)".to_owned()
        }
    }
}

/// `policy schema [--write DIR]`: the generated JSON Schemas of the bundle formats.
pub fn schema(write: Option<&Path>) -> Report {
    let mut text = String::new();
    for (name, schema) in bundle::bundle_json_schemas() {
        let pretty = serde_json::to_string_pretty(&schema).unwrap_or_default() + "\n";
        match write {
            Some(dir) => {
                let path = dir.join(name);
                if let Err(e) = std::fs::write(&path, pretty) {
                    return Report {
                        text: format!("{}: {e}\n", path.display()),
                        code: 1,
                    };
                }
                let _ = writeln!(text, "wrote {}", path.display());
            }
            None => {
                let _ = writeln!(text, "// {name}\n{pretty}");
            }
        }
    }
    Report { text, code: 0 }
}

/// `policy learn --journal DB|URL [--policy DIR] [--catalog NAMES] [--out FILE]`: turns what a
/// journal saw (best: a shadow-mode run in front of an existing agent) into a proposed
/// catalog for the policy author to review and commit: one `[[tool]]` per tool the requests
/// declared or the model called that the bundle does not catalogue yet, with the declared
/// parameter schema as its `inputSchema`, a `safetyTier` guessed from the name (or taken
/// from a shipped catalog that lists the name), `content_trust = "untrusted"` (fail closed),
/// and a comment with how often it was declared and called and whether its results were
/// followed by gated calls (write, exec or egress: the calls that would need approval if
/// its output stays untrusted). The output is checked to compile as a `tools/*.toml` file
/// before it is written. Exit 1 when the journal or bundle cannot be read.
pub async fn learn(
    journal: &crate::journal::JournalLocation,
    policy_dir: &Path,
    catalogs: Option<&[String]>,
    out: Option<&Path>,
) -> Report {
    let fail = |text: String| Report { text, code: 1 };
    let policy = match reload::load_from(policy_dir, true, catalogs) {
        Ok(p) => p,
        Err(e) => return fail(format!("{e}\n")),
    };
    if journal.sqlite_path().is_some_and(|p| !p.exists()) {
        return fail(format!("{journal}: no such journal\n"));
    }
    let rows = match crate::journal::JournalReader::open_at(journal).await {
        Ok(r) => r.learn_rows().await,
        Err(e) => Err(e),
    };
    let rows = match rows {
        Ok(r) => r,
        Err(e) => return fail(format!("{journal}: {e}\n")),
    };
    let text = learned_catalog(&policy, &rows);
    // The proposal must be a valid tools file on its own (the author adds it to a bundle).
    let mut files = std::collections::BTreeMap::new();
    files.insert("tools/learned.toml".to_owned(), text.clone());
    files.insert(
        "rules/permit.cedar".to_owned(),
        "permit (principal, action, resource);\n".to_owned(),
    );
    let src = crate::policy::BundleSource {
        origin: "learned".into(),
        files,
        catalogs: None,
    };
    if let Err(errors) = crate::policy::compile(&src) {
        let why: Vec<String> = errors.iter().map(ToString::to_string).collect();
        return fail(format!(
            "the learned catalog does not compile (please report this):\n{}\n",
            why.join("\n")
        ));
    }
    match out {
        Some(path) => match std::fs::write(path, &text) {
            Ok(()) => Report {
                text: format!(
                    "wrote {}: {} tool(s); review it, then put it in your bundle's tools/ and run `turnguard policy check`\n",
                    path.display(),
                    text.matches("[[tool]]").count()
                ),
                code: 0,
            },
            Err(e) => fail(format!("{}: {e}\n", path.display())),
        },
        None => Report { text, code: 0 },
    }
}

/// What the journal says about one tool name.
#[derive(Default)]
struct Seen {
    declared: Option<crate::journal::DeclaredToolRow>,
    calls: i64,
    outcomes: std::collections::BTreeMap<String, i64>,
    shadow: i64,
    results: i64,
    followed: i64,
    followers: std::collections::BTreeMap<String, i64>,
}

/// The proposed catalog text (see [`learn`]).
fn learned_catalog(policy: &CompiledPolicy, rows: &crate::journal::LearnRows) -> String {
    use std::collections::BTreeMap;
    let mut seen: BTreeMap<String, Seen> = BTreeMap::new();
    for d in &rows.declared {
        seen.entry(d.name.clone()).or_default().declared = Some(d.clone());
    }
    for (name, outcome, enforced, n) in &rows.calls {
        let s = seen.entry(name.clone()).or_default();
        s.calls += n;
        *s.outcomes.entry(outcome.clone()).or_default() += n;
        if !enforced {
            s.shadow += n;
        }
    }
    let proposals: BTreeMap<String, bundle::ToolEntry> = seen
        .iter()
        .filter(|(name, _)| policy.catalog.by_name(name).is_none())
        .map(|(name, s)| (name.clone(), propose(name, s.declared.as_ref())))
        .collect();
    // A call is gated by the bundle's classification, or the proposal's for a new name.
    let gated = |name: &str| match (policy.catalog.by_name(name), proposals.get(name)) {
        (Some(t), _) => t.gated(),
        (None, Some(p)) => proposed_gated(p),
        (None, None) => true,
    };
    for (tool, next) in &rows.followups {
        let s = seen.entry(tool.clone()).or_default();
        s.results += 1;
        let writes: Vec<&String> = next.iter().filter(|n| gated(n)).collect();
        if !writes.is_empty() {
            s.followed += 1;
        }
        for w in writes {
            *s.followers.entry(w.clone()).or_default() += 1;
        }
    }
    let mut text = String::from(
        "#:schema ../tools.schema.json\n\
         # Proposed by `turnguard policy learn` from the journal. Review every entry before you\n\
         # commit it to your bundle's tools/: the safetyTier is a guess from the tool's name\n\
         # unless a shipped catalog lists it, egress is left unset (which gates the tool in an\n\
         # untrusted turn) and every output is `untrusted` (fail closed). Mark a tool's output\n\
         # `trusted` only when nobody else can put text into it (not mail, web pages, tickets,\n\
         # or other users' documents); the counts below show what that would let through.\n",
    );
    let known: Vec<&String> = seen
        .keys()
        .filter(|n| policy.catalog.by_name(n).is_some())
        .collect();
    if !known.is_empty() {
        text.push_str(&format!(
            "#\n# Already catalogued by the bundle ({}), not repeated here: {}\n",
            policy.origin,
            known
                .iter()
                .map(|n| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    for (name, entry) in &proposals {
        let s = &seen[name];
        text.push('\n');
        for line in comment_lines(name, s, entry) {
            text.push_str("# ");
            text.push_str(&line);
            text.push('\n');
        }
        let file = bundle::ToolsFile {
            tool: vec![entry.clone()],
        };
        match toml::to_string(&file) {
            Ok(t) => text.push_str(&t),
            Err(e) => text.push_str(&format!("# (not written: {e})\n")),
        }
    }
    if proposals.is_empty() {
        text.push_str("\n# Every tool the journal saw is already catalogued.\n");
    }
    text
}

fn comment_lines(name: &str, s: &Seen, entry: &bundle::ToolEntry) -> Vec<String> {
    let mut lines = Vec::new();
    let label = crate::admission::sanitize_label(name);
    match &s.declared {
        Some(d) => lines.push(format!(
            "`{label}`: declared in {} request(s) ({}) with {} distinct schema(s){}",
            d.requests,
            d.api,
            d.schemas,
            if d.schema.is_none() && d.schemas > 0 {
                "; the schema was too large to keep, so none is proposed"
            } else {
                ""
            }
        )),
        None => lines.push(format!("`{label}`: called, but no request declared it")),
    }
    let outcomes: Vec<String> = s.outcomes.iter().map(|(o, n)| format!("{o} {n}")).collect();
    lines.push(format!(
        "called {} time(s){}{}",
        s.calls,
        if outcomes.is_empty() {
            String::new()
        } else {
            format!(" ({})", outcomes.join(", "))
        },
        if s.shadow > 0 {
            format!(
                "; {} would have been withheld (released by shadow mode)",
                s.shadow
            )
        } else {
            String::new()
        }
    ));
    if s.results > 0 {
        let followers: Vec<String> = s
            .followers
            .iter()
            .map(|(n, c)| format!("{} ×{c}", crate::admission::sanitize_label(n)))
            .collect();
        lines.push(format!(
            "its results were seen {} time(s); followed by a write/exec/egress call {} time(s){}",
            s.results,
            s.followed,
            if followers.is_empty() {
                String::new()
            } else {
                format!(" ({})", followers.join(", "))
            }
        ));
        if s.followed > 0 && entry.content_trust == bundle::ContentTrust::Untrusted {
            lines.push(
                "with content_trust = \"untrusted\" those calls wait for the person's approval"
                    .into(),
            );
        }
    } else {
        lines.push("no result of it was seen".into());
    }
    lines.push(format!(
        "safetyTier `{}`: {}",
        entry.descriptor.safety_tier.as_str(),
        entry.descriptor.description.as_deref().unwrap_or("review")
    ));
    lines
}

/// Whether a proposed entry would be gated in an untrusted turn (as
/// [`crate::policy::CatalogTool::gated`]).
fn proposed_gated(e: &bundle::ToolEntry) -> bool {
    use bundle::{Approval, Egress, SafetyTier};
    matches!(
        e.descriptor.safety_tier,
        SafetyTier::Write | SafetyTier::Exec
    ) || e.descriptor.egress != Some(Egress::None)
        || e.descriptor.approval == Some(Approval::Always)
}

/// The proposal for one name: the shipped catalogs' entry when one lists it, else a guess.
fn propose(name: &str, declared: Option<&crate::journal::DeclaredToolRow>) -> bundle::ToolEntry {
    use bundle::{ContentTrust, Source, ToolDescriptor, ToolEntry};
    for (catalog, text) in crate::policy::catalogs::SHIPPED {
        if let Ok(file) = toml::from_str::<bundle::ToolsFile>(text) {
            if let Some(mut t) = file
                .tool
                .into_iter()
                .find(|t| t.names.iter().any(|n| n == name))
            {
                t.descriptor.description = Some(format!(
                    "as the shipped catalog `{catalog}` classifies it (include that catalog instead of copying)"
                ));
                return t;
            }
        }
    }
    let (tier, why) = guess_tier(name);
    let input_schema = declared
        .and_then(|d| d.schema.as_deref())
        .and_then(|s| serde_json::from_str::<Value>(s).ok())
        .and_then(|v| match without_nulls(v) {
            Some(Value::Object(m)) => Some(m.into_iter().collect()),
            _ => None,
        });
    ToolEntry {
        names: vec![name.to_owned()],
        descriptor: ToolDescriptor {
            tool_id: format!("learned:{name}"),
            source: Source::HostExtension,
            title: None,
            description: Some(format!("guessed from the name ({why}); review")),
            input_schema,
            output_schema: None,
            auth: None,
            egress: None,
            approval: None,
            replay_policy: None,
            safety_tier: tier,
            cost_hint: None,
            latency_hint: None,
        },
        content_trust: ContentTrust::Untrusted,
        business_key: Vec::new(),
        clarification: false,
        approval_edit: false,
        mode: None,
        idempotency_meta_key: None,
    }
}

/// A `safetyTier` from the words of a tool name (`get_weather` → read, `run_query` → exec,
/// `send_email` → write), and which word decided. Anything unrecognised is `write` (OpenWOP:
/// unclassified is write).
fn guess_tier(name: &str) -> (bundle::SafetyTier, String) {
    use bundle::SafetyTier;
    let mut words: Vec<String> = Vec::new();
    let mut cur = String::new();
    let mut prev_lower = false;
    for c in name.chars() {
        if !c.is_alphanumeric() {
            if !cur.is_empty() {
                words.push(std::mem::take(&mut cur));
            }
            prev_lower = false;
            continue;
        }
        if c.is_uppercase() && prev_lower && !cur.is_empty() {
            words.push(std::mem::take(&mut cur));
        }
        prev_lower = c.is_lowercase() || c.is_ascii_digit();
        cur.extend(c.to_lowercase());
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    const EXEC: [&str; 11] = [
        "shell", "bash", "exec", "execute", "run", "eval", "terminal", "command", "cmd", "script",
        "repl",
    ];
    const READ: [&str; 22] = [
        "get", "read", "list", "search", "find", "lookup", "query", "describe", "show", "view",
        "count", "retrieve", "load", "fetch", "check", "inspect", "grep", "glob", "ls", "cat",
        "browse", "stat",
    ];
    if let Some(w) = words.iter().find(|w| EXEC.contains(&w.as_str())) {
        return (SafetyTier::Exec, format!("`{w}`"));
    }
    match words.first() {
        Some(w) if READ.contains(&w.as_str()) => (SafetyTier::Read, format!("`{w}`")),
        Some(w) => (
            SafetyTier::Write,
            format!("`{w}` is not a read verb; unclassified is write"),
        ),
        None => (SafetyTier::Write, "unclassified is write".into()),
    }
}

/// A schema without what TOML cannot hold: a keyword whose value is (or contains) a JSON
/// `null` is left out, which only loosens the catalog schema (the request's declared schema
/// is still validated in full). Subschemas in positions where removing a keyword can only
/// loosen (`properties`, `$defs`, `items`, `allOf` …) are cleaned the same way; any other
/// keyword holding a `null` (`enum`, `const`, `default`, `not`, `oneOf` …) is dropped whole.
/// `None` when `v` is not an object.
fn without_nulls(v: Value) -> Option<Value> {
    fn has_null(v: &Value) -> bool {
        match v {
            Value::Null => true,
            Value::Array(a) => a.iter().any(has_null),
            Value::Object(m) => m.values().any(has_null),
            _ => false,
        }
    }
    let Value::Object(m) = v else { return None };
    let mut out = serde_json::Map::new();
    for (k, x) in m {
        if !has_null(&x) {
            out.insert(k, x);
            continue;
        }
        let cleaned = match (k.as_str(), x) {
            ("properties" | "$defs" | "definitions" | "patternProperties", Value::Object(subs)) => {
                Some(Value::Object(
                    subs.into_iter()
                        .filter_map(|(n, s)| without_nulls(s).map(|s| (n, s)))
                        .collect(),
                ))
            }
            ("items" | "additionalProperties", x @ Value::Object(_)) => without_nulls(x),
            ("allOf", Value::Array(subs)) => Some(Value::Array(
                subs.into_iter().filter_map(without_nulls).collect(),
            )),
            _ => None,
        };
        if let Some(c) = cleaned {
            out.insert(k, c);
        }
    }
    Some(Value::Object(out))
}
