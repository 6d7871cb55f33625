//! `turnguard policy check | test | explain | schema`: the policy author's tools. Each
//! returns its report and exit code so the CLI and tests share one implementation.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use crate::admission::{self, AdmitCtx, LimitState, SchemaCache};
use crate::model::{Api, ChoiceVerdict, Turn};
use crate::policy::{bundle, CompiledPolicy};
use crate::provider;
use crate::reload::{self, LoadError};

/// A command's report and exit code.
pub struct Report {
    pub text: String,
    pub code: i32,
}

fn load(dir: &Path) -> Result<CompiledPolicy, Report> {
    let src = reload::read_dir(dir).map_err(|e| Report {
        text: format!("{e}\n"),
        code: 1,
    })?;
    crate::policy::compile(&src).map_err(|errors| {
        let mut text = String::new();
        for e in &errors {
            let _ = writeln!(text, "{}/{e}", dir.display());
        }
        let _ = writeln!(text, "{} problem(s); the bundle is not valid", errors.len());
        Report { text, code: 1 }
    })
}

/// `policy check DIR`: exactly the start-up validation. Exit 1 with `file:line` errors.
pub fn check(dir: &Path) -> Report {
    match load(dir) {
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
) -> Result<(Turn, Vec<(crate::model::ChoiceEmissions, ChoiceVerdict)>), String> {
    let turn = provider::parse_request(api, request).map_err(|e| format!("request: {e}"))?;
    // Offline there is no journal: a turn continuing a stored response is untrusted.
    let trust = admission::trust::of_turn(&turn, policy, &[]);
    let schemas = SchemaCache::default();
    let limits = LimitState::default();
    let never = |_: &str| false;
    let ctx = AdmitCtx {
        policy,
        schemas: &schemas,
        limits: &limits,
        person,
        agent: crate::proxy::AGENT_ID,
        trust,
        run: None,
        provider: api.as_str(),
        approved: &never,
        repairs_left: policy.settings.limits.repair_rounds,
    };
    let out = provider::parse_response(api, response, &turn)
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

/// `policy test DIR`: runs the bundle's test cases. Exit 1 when a case fails or none exist.
pub fn test(dir: &Path) -> Report {
    let policy = match load(dir) {
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

/// `policy explain --request R --response S [--policy DIR] [--api A]`: every stage's
/// decision for every call, and which Cedar rules decided.
pub fn explain(
    policy_dir: &Path,
    api: Option<&str>,
    request: &Path,
    response: &Path,
    person: Option<&str>,
) -> Report {
    let policy = match reload::load(policy_dir) {
        Ok(p) => p,
        Err(LoadError::Invalid(errors)) => {
            return Report {
                text: errors.iter().map(|e| format!("{e}\n")).collect(),
                code: 1,
            };
        }
        Err(e) => {
            return Report {
                text: format!("{e}\n"),
                code: 1,
            }
        }
    };
    let read = |p: &Path| -> Result<Value, String> {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", p.display()))
    };
    let (req, resp) = match (read(request), read(response)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            return Report {
                text: format!("{e}\n"),
                code: 1,
            }
        }
    };
    let api = match api {
        Some(a) => match Api::from_label(a) {
            Some(a) => a,
            None => {
                return Report {
                    text: format!("unknown api `{a}` (openai_chat, anthropic_messages)\n"),
                    code: 1,
                }
            }
        },
        // A Messages request has `max_tokens` and content blocks; Chat has `choices` in the response.
        None if resp.get("choices").is_some() => Api::OpenAiChat,
        None => Api::AnthropicMessages,
    };
    let (turn, choices) = match admit_pair(&policy, api, &req, &resp, person) {
        Ok(x) => x,
        Err(e) => {
            return Report {
                text: format!("{e}\n"),
                code: 1,
            }
        }
    };
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
            if !d.rules.is_empty() {
                for r in &d.rules {
                    let at = policy
                        .rules
                        .meta(r)
                        .map(|m| format!(" ({}:{})", m.file, m.line))
                        .unwrap_or_default();
                    let _ = writeln!(text, "    rule          {r}{at}");
                }
            }
            if let Some(h) = &d.args_hash {
                let _ = writeln!(text, "    argsHash      {h}");
            }
        }
        let surfacing = match &v.surfacing {
            crate::model::Surfacing::Release => "release".to_owned(),
            crate::model::Surfacing::Drop => "drop the withheld calls, release the rest".to_owned(),
            crate::model::Surfacing::EndTurn(_) => "end-turn".to_owned(),
            crate::model::Surfacing::Repair(items) => {
                format!("repair round with {} host-authored result(s)", items.len())
            }
            crate::model::Surfacing::Error(e) => format!("error {} {}", e.status, e.code),
            crate::model::Surfacing::Wait if person.is_none() => {
                "refuse at once: no acting person (`--principal`) could approve it (`no_approver`)"
                    .to_owned()
            }
            crate::model::Surfacing::Wait => {
                "wait for the acting person's approval (then release, or refuse)".to_owned()
            }
        };
        let _ = writeln!(text, "  surfaced as: {surfacing}");
    }
    Report { text, code: 0 }
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
