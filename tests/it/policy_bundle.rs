//! The policy bundle as its authors and operators meet it (issue 7, must-show 3–7 and the
//! committed schemas): `turnguard policy check` / `test` / `schema` run as the real binary,
//! hot reload of a bundle in a temp dir, the admin plane's tool catalog, and redaction of
//! secrets from the journal, the events and the logs of a real `turnguard serve` process.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use support::served::Served;
use support::{get, post_raw};
use turnguard::mock_provider::Script;

// ---------------------------------------------------------------------------------------------
// Helpers (test-local)

const BIN: &str = env!("CARGO_BIN_EXE_turnguard");

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn spec(name: &str) -> Value {
    let path = repo().join("../shared/spec/openwop").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .build(schema)
        .expect("spec schema compiles")
}

fn schema_errors(v: &jsonschema::Validator, instance: &Value) -> Vec<String> {
    v.iter_errors(instance)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Runs `turnguard ARGS…`; returns exit code and stdout+stderr.
fn turnguard(args: &[&str]) -> (i32, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = Command::new(BIN)
        .args(args)
        .output()
        .expect("turnguard runs");
    let mut text = String::from_utf8_lossy(&stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&stderr));
    (status.code().unwrap_or(-1), text)
}

/// Writes `files` (bundle-relative path → text) into `dir`.
fn write_bundle(dir: &Path, files: &[(&str, &str)]) {
    for (rel, text) in files {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
    }
}

/// Replaces a file the way editors and Kubernetes do: write beside it, then rename over it.
fn replace_file(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp-edit~");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// The 1-based line of the first line of `text` containing `needle`.
fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("`{needle}` not in the text"))
        + 1
}

/// The value of one sample (`name{labels}` exactly as rendered) in an exposition text.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        rest.strip_prefix(' ')?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

// A small valid bundle; each rejection below changes exactly one thing in it.
const BASE_SETTINGS: &str = "# a small bundle\n[limits]\ntool_calls_per_turn = 4\n";
const BASE_TOOLS: &str = r#"[[tool]]
names = ["lookup"]
content_trust = "trusted"
[tool.descriptor]
toolId = "test.check:lookup"
source = "connector"
safetyTier = "read"
egress = "none"

[[tool]]
names = ["pay"]
content_trust = "trusted"
[tool.descriptor]
toolId = "test.check:pay"
source = "connector"
safetyTier = "write"
egress = "none"
[tool.descriptor.inputSchema]
type = "object"
required = ["amount", "to"]
properties.amount = { type = "number" }
properties.to = { type = "string" }
"#;
const BASE_RULES: &str = r#"@id("agent-may-call")
permit (principal, action == Action::"call", resource);

@id("big-payments-refused")
forbid (principal, action == Action::"call", resource == Tool::"test.check:pay")
when { context.args.amount.greaterThan(decimal("1000.0")) };
"#;

fn base_bundle(dir: &Path) {
    write_bundle(
        dir,
        &[
            ("turnguard.toml", BASE_SETTINGS),
            ("tools/pay.toml", BASE_TOOLS),
            ("rules/pay.cedar", BASE_RULES),
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// Must-show 3: `policy check`

#[test]
fn policy_check_accepts_the_default_and_base_bundles() {
    let (code, out) = turnguard(&["policy", "check", repo().join("policy").to_str().unwrap()]);
    assert_eq!(code, 0, "the default bundle is valid: {out}");
    assert!(out.starts_with("ok: "), "{out}");
    let tmp = tempfile::tempdir().unwrap();
    base_bundle(tmp.path());
    let (code, out) = turnguard(&["policy", "check", tmp.path().to_str().unwrap()]);
    assert_eq!(
        code, 0,
        "the base bundle of the rejection cases is valid: {out}"
    );
}

/// Runs `policy check` on the base bundle with `file` replaced by `text`; asserts exit 1 and
/// an error naming `file:line` where `line` is the line of `needle`, and containing `words`.
fn rejects(file: &str, text: &str, line: usize, words: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    base_bundle(tmp.path());
    write_bundle(tmp.path(), &[(file, text)]);
    let (code, out) = turnguard(&["policy", "check", tmp.path().to_str().unwrap()]);
    assert_eq!(code, 1, "exit code 1: {out}");
    let at = format!("{file}:{line}:");
    assert!(out.contains(&at), "the error names `{at}`: {out}");
    for w in words {
        assert!(out.contains(w), "the error mentions `{w}`: {out}");
    }
    out
}

#[test]
fn policy_check_rejects_an_unknown_key_with_file_and_line() {
    let text = BASE_SETTINGS.replace("tool_calls_per_turn", "tool_calls_per_trun");
    let line = line_of(&text, "tool_calls_per_trun");
    rejects("turnguard.toml", &text, line, &["tool_calls_per_trun"]);
    // In a tool file too, with the key path.
    let text = BASE_TOOLS.replace(
        "egress = \"none\"\n\n",
        "egress = \"none\"\nsafety_tier = \"read\"\n\n",
    );
    let line = line_of(&text, "safety_tier");
    rejects("tools/pay.toml", &text, line, &["safety_tier"]);
}

#[test]
fn policy_check_rejects_a_rule_naming_an_argument_the_tool_does_not_have() {
    let text = BASE_RULES.replace("context.args.amount", "context.args.amout");
    let line = line_of(&text, "amout");
    rejects(
        "rules/pay.cedar",
        &text,
        line,
        &["amout", "big-payments-refused"],
    );
}

/// A rule not scoped to one tool is validated against an empty `args` record, so it cannot
/// see arguments: a `has` test on them (which that validation types as `false`) or a use of
/// the whole `context` is a load error, not a rule that behaves unlike what was checked.
#[test]
fn policy_check_rejects_an_unscoped_rule_that_tests_or_uses_the_arguments() {
    for cond in [
        "context.args has amount",
        "context has args",
        "context has args.amount",
        "context == {trust: \"trusted\", provider: \"\", model: \"\", run: \"\", approved: true, args: {}}",
    ] {
        let text = format!(
            "{BASE_RULES}\n@id(\"unscoped-args\")\nforbid (principal, action, resource)\nwhen {{ {cond} }};\n"
        );
        let line = line_of(&text, "@id(\"unscoped-args\")");
        rejects(
            "rules/pay.cedar",
            &text,
            line,
            &["unscoped-args", "not scoped to one tool", "context.args"],
        );
    }
    // Attributes of the context other than `args` stay readable by any rule, and a rule
    // scoped to the tool reads its arguments.
    let text = format!(
        "{BASE_RULES}\n@id(\"unscoped-trust\")\nforbid (principal, action, resource)\nwhen {{ context has trust && context.trust == \"untrusted\" && resource.safetyTier == \"exec\" }};\n\n@id(\"scoped-has\")\nforbid (principal, action, resource == Tool::\"test.check:pay\")\nwhen {{ context.args has amount && context.args.to == \"x\" }};\n"
    );
    let tmp = tempfile::tempdir().unwrap();
    base_bundle(tmp.path());
    write_bundle(tmp.path(), &[("rules/pay.cedar", &text)]);
    let (code, out) = turnguard(&["policy", "check", tmp.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
}

#[test]
fn policy_check_rejects_exec_on_a_tool_that_is_not_a_host_extension() {
    // The second tool (`pay`, a connector) becomes `exec`: the error must point into its
    // table, not the first tool's.
    let text = BASE_TOOLS.replacen("safetyTier = \"write\"", "safetyTier = \"exec\"", 1);
    let tmp = tempfile::tempdir().unwrap();
    base_bundle(tmp.path());
    write_bundle(tmp.path(), &[("tools/pay.toml", &text)]);
    let (code, out) = turnguard(&["policy", "check", tmp.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("exec") && out.contains("host-extension"),
        "{out}"
    );
    let start = line_of(&text, "names = [\"pay\"]") - 1; // the `[[tool]]` line
    let end = text.lines().count();
    let line: usize = out
        .split("tools/pay.toml:")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no `tools/pay.toml:LINE` in: {out}"));
    assert!(
        (start..=end).contains(&line),
        "line {line} is not in the `pay` tool ({start}–{end}): {out}"
    );
}

// ---------------------------------------------------------------------------------------------
// Must-show 4: `policy test`

#[test]
fn policy_test_runs_the_acme_example_green_and_fails_on_a_wrong_expectation() {
    // The example bundle (policy/examples/acme) has the richer cases; the default bundle's
    // own cases are run in tests/it/dropin.rs.
    let policy = repo().join("policy/examples/acme");
    let cases_text = std::fs::read_to_string(policy.join("tests/cases.toml")).unwrap();
    let cases: toml::Value = toml::from_str(&cases_text).unwrap();
    let names: Vec<String> = cases["case"]
        .as_array()
        .expect("the example bundle has cases")
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_owned())
        .collect();
    assert!(!names.is_empty());

    let (code, out) = turnguard(&["policy", "test", policy.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    for n in &names {
        assert!(
            out.lines()
                .any(|l| l.starts_with("ok") && l.ends_with(n.as_str())),
            "case `{n}` is ok: {out}"
        );
    }
    assert!(!out.contains("FAIL"), "{out}");
    assert!(
        out.contains(&format!("{} passed, 0 failed", names.len())),
        "{out}"
    );

    // A copy with one deliberately wrong expectation.
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&policy, tmp.path());
    let wrong = cases_text.replacen(
        r#"expect = [{ tool = "get_weather", outcome = "executed", stage = "dispatch" }]"#,
        r#"expect = [{ tool = "get_weather", outcome = "refused", stage = "authorization" }]"#,
        1,
    );
    assert_ne!(
        wrong, cases_text,
        "the weather case's expectation was found and changed"
    );
    std::fs::write(tmp.path().join("tests/cases.toml"), &wrong).unwrap();
    let (code, out) = turnguard(&["policy", "test", tmp.path().to_str().unwrap()]);
    assert_ne!(code, 0, "a wrong expectation fails the run: {out}");
    let failing = "a weather lookup in a trusted turn is released";
    assert!(
        out.lines()
            .any(|l| l.starts_with("FAIL") && l.contains(failing)),
        "the failing case is named: {out}"
    );
    assert!(
        out.contains(&format!("{} passed, 1 failed", names.len() - 1)),
        "{out}"
    );
}

// ---------------------------------------------------------------------------------------------
// Must-show 5: reload

fn pay_request() -> Value {
    json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Pay Bob 50."}],
        "tools": [{"type": "function", "function": {"name": "pay", "parameters": {"type": "object",
            "properties": {"amount": {"type": "number"}, "to": {"type": "string"}}, "required": ["amount", "to"]}}}]
    })
}

fn pay_response() -> Value {
    json!({
        "id": "chatcmpl-pay", "object": "chat.completion", "created": 1_782_955_817, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_pay", "type": "function", "function": {"name": "pay", "arguments": "{\"amount\": 50, \"to\": \"bob\"}"}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
    })
}

/// Whether the agent got the `pay` call (true) or a turn ended by a refusal (false).
async fn pay_released(h: &support::Harness) -> bool {
    let (status, _, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        pay_request().to_string().into(),
        &[],
    )
    .await;
    let text = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_slice(&body).unwrap();
    let released = v.pointer("/choices/0/message/tool_calls/0/id") == Some(&json!("call_pay"));
    if !released {
        assert!(
            text.contains("refused at the authorization stage"),
            "neither released nor refused: {text}"
        );
    }
    released
}

async fn revision(h: &support::Harness) -> String {
    let (status, body) = get(&format!("{}/config", h.admin_url())).await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    v.pointer("/policy/revision")
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("GET /config shows no policy.revision: {v}"))
        .to_owned()
}

async fn metrics(h: &support::Harness) -> String {
    let (status, body) = get(&format!("{}/metrics", h.admin_url())).await;
    assert_eq!(status, 200);
    String::from_utf8(body.to_vec()).unwrap()
}

/// The revision `policy check` reports for `dir`.
fn checked_revision(dir: &Path) -> String {
    let (code, out) = turnguard(&["policy", "check", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    out.split("revision ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .unwrap()
        .trim()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broken_edit_keeps_the_last_good_bundle_and_a_good_edit_applies_without_restart() {
    let bundle = tempfile::tempdir().unwrap();
    base_bundle(bundle.path());
    let dir = bundle.path().to_owned();
    let h = support::start_with(Script::default(), move |c| c.policy = dir).await;
    h.script(&json!({"responses": [{"json": pay_response()}], "repeat": true}))
        .await;

    let r0 = revision(&h).await;
    assert_eq!(
        r0,
        checked_revision(bundle.path()),
        "/config shows the revision `policy check` computes"
    );
    let m = metrics(&h).await;
    assert_eq!(
        sample(
            &m,
            &format!("turnguard_policy_revision_info{{revision=\"{r0}\"}}")
        ),
        Some(1.0),
        "{m}"
    );
    assert!(
        pay_released(&h).await,
        "the base bundle permits a small payment"
    );

    // A broken edit: a Cedar syntax error. Served on: same revision, same decisions.
    let rules = bundle.path().join("rules/pay.cedar");
    replace_file(
        &rules,
        &format!("{BASE_RULES}\nforbid (principal, action, resource) when {{ ;\n"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let m = loop {
        let m = metrics(&h).await;
        if sample(&m, "turnguard_policy_reloads_total{result=\"error\"}").unwrap_or(0.0) >= 1.0 {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "no failed reload counted within 10 s:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        sample(&m, "turnguard_policy_reloads_total{result=\"ok\"}").unwrap_or(0.0),
        0.0,
        "{m}"
    );
    assert_eq!(revision(&h).await, r0, "the last good bundle is kept");
    assert_eq!(
        sample(
            &m,
            &format!("turnguard_policy_revision_info{{revision=\"{r0}\"}}")
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        m.lines()
            .filter(|l| l.starts_with("turnguard_policy_revision_info{"))
            .count(),
        1,
        "one active revision: {m}"
    );
    assert!(
        pay_released(&h).await,
        "requests are still served with the old bundle"
    );

    // A good edit: payments are now refused outright.
    replace_file(
        &rules,
        &format!("{BASE_RULES}\n@id(\"payments-frozen\")\nforbid (principal, action == Action::\"call\", resource == Tool::\"test.check:pay\");\n"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let r1 = loop {
        let r = revision(&h).await;
        if r != r0 {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "the good edit was not applied within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        r1,
        checked_revision(bundle.path()),
        "the new revision is the edited bundle's"
    );
    let m = metrics(&h).await;
    assert!(
        sample(&m, "turnguard_policy_reloads_total{result=\"ok\"}").unwrap_or(0.0) >= 1.0,
        "{m}"
    );
    assert_eq!(
        sample(
            &m,
            &format!("turnguard_policy_revision_info{{revision=\"{r1}\"}}")
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(
            &m,
            &format!("turnguard_policy_revision_info{{revision=\"{r0}\"}}")
        ),
        None,
        "{m}"
    );
    assert!(
        !pay_released(&h).await,
        "the new rule refuses the payment, without a restart"
    );
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Must-show 6: the tool catalog on the admin plane

#[tokio::test(flavor = "multi_thread")]
async fn the_tool_catalog_lists_only_usable_tools_and_hides_the_rest_behind_one_404() {
    let h = support::start_with_policy(Script::default(), "policy-catalog").await;
    let admin = h.admin_url();
    let full = validator(&spec("tool-descriptor.schema.json"));
    let compact = validator(&spec("compact-tool-descriptor.schema.json"));
    let listed = |body: &[u8]| -> Vec<Value> {
        let v: Value = serde_json::from_slice(body).expect("catalog is JSON");
        match v {
            Value::Array(a) => a,
            Value::Object(ref o) if o.get("tools").is_some_and(Value::is_array) => {
                o["tools"].as_array().unwrap().clone()
            }
            other => panic!("a catalog is `{{tools: [...]}}` or a list: {other}"),
        }
    };
    let usable = [
        "test.catalog:alpha_search",
        "test.catalog:mid_write",
        "test.catalog:needs_approval",
        "test.catalog:zeta_lookup",
    ];

    let (s_unknown, b_unknown) = get(&format!("{admin}/tools/test.catalog:no_such_tool")).await;
    let (s_denied, b_denied) = get(&format!("{admin}/tools/test.catalog:secret_admin")).await;
    let (s_denied_c, b_denied_c) = get(&format!(
        "{admin}/tools/test.catalog:secret_admin?view=compact"
    ))
    .await;
    assert_eq!(s_unknown, 404, "{}", String::from_utf8_lossy(&b_unknown));
    assert_eq!(
        s_denied, 404,
        "a tool the caller may not use is 404, never 403"
    );
    assert_eq!(s_denied_c, 404);
    assert_eq!(
        b_denied, b_unknown,
        "the same body: the catalog does not confirm the tool exists"
    );
    assert_eq!(b_denied_c, b_unknown);
    assert!(!String::from_utf8_lossy(&b_denied).contains("secret_admin"));
    let (status, body) = get(&format!("{admin}/tools/test.catalog:alpha_search")).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let one: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(one["toolId"], "test.catalog:alpha_search");
    assert_eq!(one["safetyTier"], "pure");
    assert!(schema_errors(&full, &one).is_empty(), "{one}");

    let (status, body) = get(&format!("{admin}/tools")).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let tools = listed(&body);
    let ids: Vec<&str> = tools
        .iter()
        .map(|t| t["toolId"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids, usable,
        "sorted by toolId; the forbidden tool is not listed"
    );
    for t in &tools {
        let errors = schema_errors(&full, t);
        assert!(
            errors.is_empty(),
            "{} is not a valid ToolDescriptor: {errors:?}",
            t["toolId"]
        );
    }

    let (status, body) = get(&format!("{admin}/tools?view=compact")).await;
    assert_eq!(status, 200);
    let tools = listed(&body);
    let ids: Vec<&str> = tools
        .iter()
        .map(|t| t["toolId"].as_str().unwrap())
        .collect();
    assert_eq!(ids, usable, "the compact view carries the same toolId set");
    let invalid: Vec<String> = tools
        .iter()
        .filter_map(|t| {
            let errors = schema_errors(&compact, t);
            (!errors.is_empty()).then(|| format!("{}: {errors:?}", t["toolId"]))
        })
        .collect();
    assert!(
        invalid.is_empty(),
        "not valid CompactToolDescriptors: {invalid:#?}"
    );

    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Must-show 7: redaction, through a real `turnguard serve` process

const API_KEY: &str = "sk-proj-Q3x9TzL0mWb7VnC2aR8yK5uJ1hD4fG6sPe";
const BEARER: &str = "2YotnFZFEjr1zCsicMWpAA9xQe4Lk7";

fn secret_args() -> Value {
    json!({
        "endpoint": "https://api.example.com/v1/charges",
        "apiKey": API_KEY,
        "headers": {"Authorization": format!("Bearer {BEARER}")}
    })
}

/// The arguments as every record must carry them (`[REDACTED:<recognizer>]`, policy/README).
fn redacted_args() -> Value {
    json!({
        "endpoint": "https://api.example.com/v1/charges",
        "apiKey": "[REDACTED:api-key]",
        "headers": {"Authorization": "[REDACTED:bearer-token]"}
    })
}

fn api_tool() -> Value {
    json!({"type": "function", "function": {"name": "call_api", "parameters": {"type": "object",
        "properties": {"endpoint": {"type": "string"}, "apiKey": {"type": "string"}, "headers": {"type": "object"}},
        "required": ["endpoint", "apiKey", "headers"]}}})
}

#[tokio::test(flavor = "multi_thread")]
async fn secrets_in_arguments_never_reach_the_journal_events_or_logs() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mock = turnguard::mock_provider::spawn(listener, Script::default()).unwrap();
    let mock_url = format!("http://{}", mock.addr);
    let args_text = secret_args().to_string();
    let call = |id: &str| json!({"id": id, "type": "function", "function": {"name": "call_api", "arguments": args_text}});
    let sse_call = |id: &str| {
        let chunk = |delta: Value, finish: Value| {
            format!(
                "data: {}",
                json!({"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
            )
        };
        let half = args_text.len() / 2;
        json!([
            chunk(
                json!({"role": "assistant", "content": null, "tool_calls": [{"index": 0, "id": id, "type": "function", "function": {"name": "call_api", "arguments": ""}}]}),
                Value::Null
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": &args_text[..half]}}]}),
                Value::Null
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": &args_text[half..]}}]}),
                Value::Null
            ),
            chunk(json!({}), json!("tool_calls")),
            "data: [DONE]"
        ])
    };
    let script = json!({"responses": [
        {"json": {"id": "chatcmpl-j", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null, "tool_calls": [call("call_secret_json")]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}}},
        {"sse": sse_call("call_secret_sse")},
        {"json": {"id": "chatcmpl-t", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Charged."}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}}}
    ]});
    let (status, _) = support::post_json(&format!("{mock_url}/_mock/script"), &script, &[]).await;
    assert_eq!(status, 200);

    let tmp = tempfile::tempdir().unwrap();
    let journal = tmp.path().join("journal.db");
    // Chat turns' bodies and arguments kept too: every record a secret could reach.
    let served = Served::start(
        &journal,
        &support::own_fixtures().join("policy-redaction"),
        &mock_url,
        &["--journal-bodies", "all"],
    );
    let url = served.chat_url();
    let request = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Charge it."}], "tools": [api_tool()]});

    let (status, _, body) = post_raw(
        &url,
        request.to_string().into(),
        &[("x-request-id", "secret-json")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let got: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        got.pointer("/choices/0/message/tool_calls/0/function/arguments"),
        Some(&json!(args_text)),
        "the agent itself gets the call as the model wrote it (strip_from_egress is off)"
    );
    let mut stream_req = request.clone();
    stream_req["stream"] = json!(true);
    let (status, _, body) = post_raw(
        &url,
        stream_req.to_string().into(),
        &[("x-request-id", "secret-sse")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // The agent reports the result; its request echoes the call with the secrets in it.
    let mut followup = request.clone();
    followup["messages"] = json!([
        {"role": "user", "content": "Charge it."},
        {"role": "assistant", "content": null, "tool_calls": [call("call_secret_json")]},
        {"role": "tool", "tool_call_id": "call_secret_json", "content": "charge ch_123 created"}
    ]);
    let (status, _, body) = post_raw(
        &url,
        followup.to_string().into(),
        &[("x-request-id", "secret-followup")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));

    let log = served.stop();
    mock.abort();

    let secrets = [API_KEY, BEARER];
    let mut leaks = Vec::new();
    // Logs (debug level, JSON format).
    assert!(
        log.iter().any(|l| l.contains("\"level\":\"DEBUG\"")),
        "debug logging was on: {log:#?}"
    );
    for (i, l) in log.iter().enumerate() {
        for s in secrets {
            if l.contains(s) {
                leaks.push(format!("log line {i}: {l}"));
            }
        }
    }
    // Journal rows and events, per table and column (to say where), then the raw file bytes.
    let db = support::journal(&journal);
    for t in db.tables() {
        for (n, bytes) in db.cells(&t) {
            for s in secrets {
                if bytes.windows(s.len()).any(|w| w == s.as_bytes()) {
                    leaks.push(format!("journal {t}.{n}"));
                }
            }
        }
    }
    // The argsHash of both calls (journal and events) is the JCS SHA-256 of the redacted form.
    let want = sha256_hex(&serde_jcs::to_vec(&redacted_args()).unwrap());
    assert_ne!(
        want,
        sha256_hex(&serde_jcs::to_vec(&secret_args()).unwrap())
    );
    for (round, call_id) in [
        ("secret-json", "call_secret_json"),
        ("secret-sse", "call_secret_sse"),
    ] {
        let key = support::round_key(&db, round);
        let (hash, redacted, outcome): (Option<String>, Option<String>, String) = db
            .query_row(
                "SELECT args_hash, redacted_args, outcome FROM tool_calls WHERE request_id = ?1 AND call_id = ?2",
                [key.as_str(), call_id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap_or_else(|e| panic!("{round}/{call_id} not journaled: {e}"));
        assert_eq!(outcome, "executed", "{round}");
        assert_eq!(
            hash.as_deref(),
            Some(want.as_str()),
            "{round}: argsHash = SHA-256(JCS(redacted arguments))"
        );
        let redacted: Value =
            serde_json::from_str(&redacted.expect("redacted_args recorded")).unwrap();
        assert_eq!(redacted, redacted_args(), "{round}");
        let event_hash: String = db
            .query_row(
                "SELECT json_extract(payload, '$.argsHash') FROM events WHERE request_id = ?1 AND type = 'agent.tool-called'
                 AND json_extract(payload, '$.callId') = ?2",
                [key.as_str(), call_id],
                |r| r.get(0),
            )
            .unwrap_or_else(|e| panic!("{round}: no agent.tool-called event: {e}"));
        assert_eq!(event_hash, want, "{round}: the event's argsHash");
    }
    drop(db);
    for ext in ["", "-wal", "-shm", "-journal"] {
        let path = PathBuf::from(format!("{}{ext}", journal.display()));
        if let Ok(bytes) = std::fs::read(&path) {
            for s in secrets {
                if bytes.windows(s.len()).any(|w| w == s.as_bytes()) {
                    leaks.push(format!("file bytes of {}", path.display()));
                }
            }
        }
    }
    leaks.dedup();
    assert!(
        leaks.is_empty(),
        "a secret from the call's arguments was found in: {leaks:#?}"
    );
}

/// One Chat round on the `policy-redaction` bundle with `journal_bodies = "all"` (a chat
/// turn's arguments kept, redacted): the model calls `call_api` once per `(call id, arguments
/// text)`, the agent's request carries `x-request-id: client`; then turnguard stops and its
/// journal is opened (the directory kept alive beside it).
async fn call_api_round(
    calls: &[(&str, String)],
    client: &str,
) -> (support::Db, tempfile::TempDir) {
    let policy = support::own_fixtures().join("policy-redaction");
    let h = support::start_with(Script::default(), move |c| {
        c.policy = policy;
        c.journal_bodies = turnguard::config::JournalBodies::All;
    })
    .await;
    let calls: Vec<Value> = calls
        .iter()
        .map(|(id, args)| json!({"id": id, "type": "function", "function": {"name": "call_api", "arguments": args}}))
        .collect();
    h.script(&json!({"responses": [{"json": {"id": "c", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": calls}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}}]}))
    .await;
    let request = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Call it."}], "tools": [api_tool()]});
    let (status, _, _) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        request.to_string().into(),
        &[("x-request-id", client)],
    )
    .await;
    assert_eq!(status, 200);
    let journal = h.journal();
    let dir = h.stop().await;
    (support::journal(&journal), dir)
}

/// RFC 6750's own example token (`mF_9.B5f-4.1JqM`, §2.1) uses `_`, which its `b64token`
/// grammar allows; a bearer token in that form must be redacted too.
#[tokio::test(flavor = "multi_thread")]
async fn a_bearer_token_in_rfc6750_form_is_redacted() {
    let token = "mF_9.B5f-4.1JqM_example_token";
    let args = json!({"endpoint": "https://api.example.com", "apiKey": "none", "headers": {"Authorization": format!("Bearer {token}")}});
    let (db, _dir) = call_api_round(&[("call_rfc", args.to_string())], "rfc6750").await;
    let redacted: String = db
        .query_row(
            "SELECT redacted_args FROM tool_calls WHERE request_id = ?1",
            [support::round_key(&db, "rfc6750")],
            |r| r.get(0),
        )
        .unwrap();
    assert!(
        !redacted.contains("mF_9"),
        "the bearer token is kept in the journal's redacted arguments: {redacted}"
    );
}

/// Arguments without a secret are journaled as the model wrote them (its whitespace, key
/// order and escapes: the text admission parsed, not a serialization of its tree), and the
/// same round's secret-bearing call is journaled redacted.
#[tokio::test(flavor = "multi_thread")]
async fn clean_arguments_are_journaled_as_the_model_wrote_them() {
    let clean = "{ \"headers\": {},\n  \"endpoint\": \"https://api.example.com/caf\\u00e9\", \"apiKey\": \"none\" }";
    let secret = json!({"endpoint": "https://api.example.com", "apiKey": "none",
        "headers": {"Authorization": "Bearer mF_9.B5f-4.1JqM_example_token"}});
    let (db, _dir) = call_api_round(
        &[
            ("call_clean", clean.to_owned()),
            ("call_secret", secret.to_string()),
        ],
        "clean-args",
    )
    .await;
    let key = support::round_key(&db, "clean-args");
    let row = |call: &str| -> String {
        db.query_row(
            "SELECT redacted_args FROM tool_calls WHERE request_id = ?1 AND call_id = ?2",
            [key.as_str(), call],
            |r| r.get(0),
        )
        .unwrap()
    };
    assert_eq!(row("call_clean"), clean);
    let redacted = row("call_secret");
    assert!(!redacted.contains("mF_9"), "{redacted}");
    assert!(redacted.contains("REDACTED"), "{redacted}");
}

/// Blank arguments (OpenAI sends `""` for a call without any) are read as `{}`; their text
/// is not JSON, so the journal keeps `{}`, not the blank text (`journal_bodies = "all"`, so
/// a chat turn's arguments are kept).
#[tokio::test(flavor = "multi_thread")]
async fn blank_arguments_are_journaled_as_an_empty_object() {
    let h = support::start_with(Script::default(), |c| {
        c.journal_bodies = turnguard::config::JournalBodies::All;
    })
    .await;
    h.script(&json!({"responses": [{"json": {"id": "c", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_blank", "type": "function", "function": {"name": "get_weather", "arguments": "  "}}]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}}]}))
    .await;
    let request = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]});
    let (status, _, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        request.to_string().into(),
        &[("x-request-id", "blank-args")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let journal = h.journal();
    let _dir = h.stop().await;
    let db = support::journal(&journal);
    let (outcome, args): (String, String) = db
        .query_row(
            "SELECT outcome, redacted_args FROM tool_calls WHERE request_id = ?1",
            [support::round_key(&db, "blank-args")],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((outcome.as_str(), args.as_str()), ("executed", "{}"));
}

// ---------------------------------------------------------------------------------------------
// Committed schemas, and the default catalog against the OpenWOP ToolDescriptor schema

#[test]
fn the_committed_bundle_schemas_are_what_policy_schema_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let (code, out) = turnguard(&["policy", "schema", "--write", tmp.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    for name in [
        "turnguard.schema.json",
        "tools.schema.json",
        "tests.schema.json",
    ] {
        let generated = std::fs::read(tmp.path().join(name))
            .unwrap_or_else(|e| panic!("{name} not generated: {e}"));
        let committed = std::fs::read(repo().join("policy").join(name))
            .unwrap_or_else(|e| panic!("policy/{name}: {e}"));
        assert!(
            generated == committed,
            "policy/{name} is stale: regenerate with `turnguard policy schema --write policy`"
        );
        let v: Value = serde_json::from_slice(&generated).unwrap();
        assert!(
            v.get("properties").is_some() || v.get("$defs").is_some(),
            "{name} is a real schema"
        );
    }
    // The committed schemas describe the committed files: the default bundle's TOML validates.
    let settings = validator(
        &serde_json::from_slice(
            &std::fs::read(repo().join("policy/turnguard.schema.json")).unwrap(),
        )
        .unwrap(),
    );
    let tools = validator(
        &serde_json::from_slice(&std::fs::read(repo().join("policy/tools.schema.json")).unwrap())
            .unwrap(),
    );
    let toml_json =
        |p: &Path| -> Value { toml::from_str(&std::fs::read_to_string(p).unwrap()).unwrap() };
    let s = toml_json(&repo().join("policy/turnguard.toml"));
    assert!(
        schema_errors(&settings, &s).is_empty(),
        "{:?}",
        schema_errors(&settings, &s)
    );
    assert!(
        !settings.is_valid(&json!({"unknown_key": 1})),
        "the settings schema is strict"
    );
    for f in tool_files() {
        let v = toml_json(&f);
        assert!(
            schema_errors(&tools, &v).is_empty(),
            "{:?}",
            schema_errors(&tools, &v)
        );
    }
}

/// The tools files the repository ships: the shipped catalogs (policy/catalogs) and the
/// example bundle's (policy/examples/acme/tools).
fn tool_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in ["policy/catalogs", "policy/examples/acme/tools"] {
        for f in std::fs::read_dir(repo().join(dir)).unwrap() {
            out.push(f.unwrap().path());
        }
    }
    assert!(out.len() >= 4, "{out:?}");
    out
}

#[test]
fn every_default_tool_descriptor_is_a_valid_openwop_tool_descriptor() {
    let schema = validator(&spec("tool-descriptor.schema.json"));
    let mut n = 0;
    for path in tool_files() {
        let text = std::fs::read_to_string(&path).unwrap();
        let file: Value = toml::from_str(&text).unwrap();
        let tools = file["tool"]
            .as_array()
            .unwrap_or_else(|| panic!("{}: no [[tool]]", path.display()));
        assert_eq!(tools.len(), text.matches("[[tool]]").count());
        for t in tools {
            let d = &t["descriptor"];
            let errors = schema_errors(&schema, d);
            assert!(
                errors.is_empty(),
                "{}: {} is not a valid ToolDescriptor: {errors:?}",
                path.display(),
                d["toolId"]
            );
            n += 1;
        }
    }
    assert!(n > 0, "the default bundle has tools");
    // The schema is able to reject: an exec tool that is not a host extension, a bad enum.
    assert!(
        !schema.is_valid(&json!({"toolId": "x:y", "source": "connector", "safetyTier": "exec"}))
    );
    assert!(!schema
        .is_valid(&json!({"toolId": "x:y", "source": "host-extension", "safetyTier": "delete"})));
}

/// An idle server does not reload: reading the bundle (which every reload does) is not a
/// change, so the watcher never feeds itself.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_bundle_is_not_reloaded() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("policy");
    copy_dir(&repo().join("policy"), &bundle);
    let h = support::start_with(Script::default(), {
        let bundle = bundle.clone();
        move |c| c.policy = bundle
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let (_, metrics) = support::get(&format!("{}/metrics", h.admin_url())).await;
    let metrics = String::from_utf8_lossy(&metrics);
    for result in ["ok", "error"] {
        let line = format!("turnguard_policy_reloads_total{{result=\"{result}\"}} 0");
        assert!(metrics.contains(&line), "missing `{line}` in\n{metrics}");
    }
    // A real edit still reloads.
    std::fs::write(
        bundle.join("rules/extra.cedar"),
        "permit (principal, action, resource);\n",
    )
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (_, m) = support::get(&format!("{}/metrics", h.admin_url())).await;
        if String::from_utf8_lossy(&m).contains("turnguard_policy_reloads_total{result=\"ok\"} 1") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the edit was not reloaded"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// `policy explain`, and every rule problem `policy check` names (the CLI's exact bytes)

/// `turnguard ARGS…` as a transcript block: the command, its exit code and its output, with
/// each `(from, to)` of `subst` replaced (temp and repo paths) and the revision of every
/// `policy <revision> (…)` header line shown as `REV` (it is a hash of the bundle's bytes).
fn transcript(args: &[&str], subst: &[(&str, &str)]) -> String {
    let (code, out) = turnguard(args);
    let mut text = format!("$ {}\nexit {code}\n", args.join(" "));
    for line in out.split_inclusive('\n') {
        match line.strip_prefix("policy ").and_then(|r| r.split_once(' ')) {
            Some((_, rest)) => text.push_str(&format!("policy REV {rest}")),
            None => text.push_str(line),
        }
    }
    for (from, to) in subst {
        text = text.replace(from, to);
    }
    rules_sorted(&text)
}

/// `text` with the deciding rules of each call sorted: Cedar reports the determining
/// policies of a decision as a set, in no fixed order from one process to the next, so
/// `forbidden by A, B` and the `rule` lines under a call come in either order.
fn rules_sorted(text: &str) -> String {
    let mut out = String::new();
    let mut rules: Vec<&str> = Vec::new();
    for line in text.split_inclusive('\n') {
        if line.starts_with("    rule ") {
            rules.push(line);
            continue;
        }
        rules.sort_unstable();
        out.extend(rules.drain(..));
        let decided_by = line
            .trim_start()
            .starts_with("authorization ")
            .then(|| line.rsplit_once(" by "))
            .flatten();
        match decided_by {
            Some((head, tail)) => {
                let mut names: Vec<&str> = tail.trim_end_matches('\n').split(", ").collect();
                names.sort_unstable();
                out.push_str(&format!("{head} by {}\n", names.join(", ")));
            }
            None => out.push_str(line),
        }
    }
    rules.sort_unstable();
    out.extend(rules.drain(..));
    out
}

/// A copy of the acme example bundle with `turnguard.toml`'s `from` replaced by `to`.
fn acme_with(dir: &Path, from: &str, to: &str) {
    copy_dir(&repo().join("policy/examples/acme"), dir);
    let path = dir.join("turnguard.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "`{from}` is in the acme settings");
    std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
}

/// `policy explain` on the acme example's pairs and a few more: the header (revision,
/// origin, api, the turn's contentTrust), each choice's completion, each call's outcome,
/// stage, reason, trace, deciding rules with `file:line` and `argsHash`, and how the choice
/// surfaces (release, end-turn, repair, error, wait, and a wait with no `--principal`);
/// the API read from the response's shape; shadow mode marks calls released anyway;
/// call names and ids are printed sanitized. Pinned byte for byte.
#[test]
fn policy_explain_reports_every_stage_rule_and_surfacing_byte_for_byte() {
    let acme = repo().join("policy/examples/acme");
    let acme_s = acme.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let tmp_s = t.to_str().unwrap();
    let case = |name: &str| acme.join("tests").join(name).to_str().unwrap().to_owned();
    let user = case("user-request.json");
    let write = |name: &str, v: Value| {
        let path = t.join(name);
        std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let chat_call = |id: &str, name: &str, args: Value| {
        json!({"id": id, "type": "function",
               "function": {"name": name, "arguments": args.to_string()}})
    };
    let chat = |message: Value, finish: &str| {
        json!({"id": "chatcmpl-explain", "object": "chat.completion", "created": 1,
               "model": "gpt-4o-mini",
               "choices": [{"index": 0, "message": message, "finish_reason": finish}],
               "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
    };
    let two_calls = write(
        "two-calls.json",
        chat(
            json!({"role": "assistant", "content": null, "tool_calls": [
                chat_call("call_a", "get_weather", json!({"location": "Paris"})),
                chat_call("call_\u{1b}[2Jb", "transfer_funds",
                          json!({"transferId": "t-9", "amount": 20000, "currency": "EUR", "to": "DE89"})),
            ]}),
            "tool_calls",
        ),
    );
    let no_call = write(
        "no-call.json",
        chat(json!({"role": "assistant", "content": "Sunny."}), "stop"),
    );
    let anthropic_req = write(
        "anthropic-request.json",
        json!({"model": "claude-haiku-4-5", "max_tokens": 256,
               "messages": [{"role": "user", "content": "Weather in Paris?"}],
               "tools": [{"name": "get_weather", "input_schema": {"type": "object",
                   "properties": {"location": {"type": "string"}}, "required": ["location"]}}]}),
    );
    let anthropic_resp = write(
        "anthropic-response.json",
        json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-haiku-4-5",
               "content": [{"type": "text", "text": "Checking."},
                           {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                            "input": {"location": "Paris"}}],
               "stop_reason": "tool_use", "stop_sequence": null,
               "usage": {"input_tokens": 10, "output_tokens": 5}}),
    );
    let shadow = t.join("shadow");
    acme_with(&shadow, "mode = \"enforce\"", "mode = \"shadow\"");
    let error = t.join("error");
    acme_with(&error, "refused = \"end-turn\"", "refused = \"error\"");
    let paths: Vec<String> = [
        "transfer-large-response.json",
        "transfer-medium-response.json",
        "weather-response.json",
        "shell-response.json",
        "undeclared-response.json",
        "after-email-request.json",
        "send-email-response.json",
    ]
    .iter()
    .map(|n| case(n))
    .collect();
    let [large, medium, weather, shell, undeclared, after_email, send_email]: [&str; 7] =
        std::array::from_fn(|i| paths[i].as_str());
    let (user, two_calls, no_call) = (user.as_str(), two_calls.as_str(), no_call.as_str());
    let (anthropic_req, anthropic_resp) = (anthropic_req.as_str(), anthropic_resp.as_str());
    let alice: &[&str] = &["--principal", "alice"];
    let chat_api: &[&str] = &["--api", "openai_chat"];
    // (request, response, more arguments)
    let runs: [(&str, &str, &[&str]); 10] = [
        (user, weather, &[]),
        (user, large, chat_api),
        (user, medium, &[]),
        (user, medium, alice),
        (user, shell, alice),
        (user, undeclared, &[]),
        (after_email, send_email, alice),
        (user, two_calls, &[]),
        (user, no_call, &[]),
        (anthropic_req, anthropic_resp, &[]),
    ];
    let mut got = String::new();
    for (request, response, more) in runs {
        let mut args = vec![
            "policy",
            "explain",
            "--policy",
            acme_s,
            "--request",
            request,
            "--response",
            response,
        ];
        args.extend(more);
        got.push_str(&transcript(&args, &[(tmp_s, "TMP"), (acme_s, "ACME")]));
    }
    for bundle in [&shadow, &error] {
        let args = [
            "policy",
            "explain",
            "--policy",
            bundle.to_str().unwrap(),
            "--request",
            user,
            "--response",
            large,
        ];
        got.push_str(&transcript(&args, &[(tmp_s, "TMP"), (acme_s, "ACME")]));
    }
    assert_eq!(
        got, EXPLAIN_TRANSCRIPT,
        "the explain reports changed:\n{got}"
    );
}

const EXPLAIN_TRANSCRIPT: &str = r#"$ policy explain --policy ACME --request ACME/tests/user-request.json --response ACME/tests/weather-response.json
exit 0
policy REV (ACME), api openai_chat, turn contentTrust trusted
choice 0 (completion clean: tool_calls)
  call 0 `get_weather` id call_0 → executed at dispatch (released)
    completion    pass: tool_calls
    name          pass: get_weather → acme.assistant:get_weather
    arguments     pass: valid against the declared and catalog schemas
    trust         pass: turn is trusted
    authorization permit: permit-calls
    limits        pass
    redaction     0 secret(s) redacted from every record
    dispatch      executed: released
    argsHash      a3f10aef7acee7cdd19c1cd6e200e4461d28167567106726e462493d98ba90cd
  surfaced as: release
$ policy explain --policy ACME --request ACME/tests/user-request.json --response ACME/tests/transfer-large-response.json --api openai_chat
exit 0
policy REV (ACME), api openai_chat, turn contentTrust trusted
choice 0 (completion clean: tool_calls)
  call 0 `transfer_funds` id call_0 → refused at authorization (forbidden)
    completion    pass: tool_calls
    name          pass: transfer_funds → acme.assistant:transfer_funds
    arguments     pass: valid against the declared and catalog schemas
    trust         pass: turn is trusted
    authorization refused: forbidden — forbidden by large-transfers-refused, transfers-held-for-approval
    rule          large-transfers-refused (rules/default.cedar:14)
    rule          transfers-held-for-approval (rules/default.cedar:22)
    argsHash      4fb0cf9d4c94ce24ae197af3a49d8ae5a16f2f93904fb44fe78111c5e0614c0c
  surfaced as: end-turn
$ policy explain --policy ACME --request ACME/tests/user-request.json --response ACME/tests/transfer-medium-response.json
exit 0
policy REV (ACME), api openai_chat, turn contentTrust trusted
choice 0 (completion clean: tool_calls)
  call 0 `transfer_funds` id call_0 → held at authorization (held_by_rule)
    completion    pass: tool_calls
    name          pass: transfer_funds → acme.assistant:transfer_funds
    arguments     pass: valid against the declared and catalog schemas
    trust         pass: turn is trusted
    authorization held: held_by_rule — held for the acting person's approval by transfers-held-for-approval
    rule          transfers-held-for-approval (rules/default.cedar:22)
    argsHash      177718d51177bee3d09930c783c00f2db0500b3ae4823efa2becfcf5c6c49e59
  surfaced as: refuse at once: no acting person (`--principal`) could approve it (`no_approver`)
$ policy explain --policy ACME --request ACME/tests/user-request.json --response ACME/tests/transfer-medium-response.json --principal alice
exit 0
policy REV (ACME), api openai_chat, turn contentTrust trusted
choice 0 (completion clean: tool_calls)
  call 0 `transfer_funds` id call_0 → held at authorization (held_by_rule)
    completion    pass: tool_calls
    name          pass: transfer_funds → acme.assistant:transfer_funds
    arguments     pass: valid against the declared and catalog schemas
    trust         pass: turn is trusted
    authorization held: held_by_rule — held for the acting person's approval by transfers-held-for-approval
    rule          transfers-held-for-approval (rules/default.cedar:22)
    argsHash      177718d51177bee3d09930c783c00f2db0500b3ae4823efa2becfcf5c6c49e59
  surfaced as: wait for the acting person's approval (then release, or refuse)
$ policy explain --policy ACME --request ACME/tests/user-request.json --response ACME/tests/shell-response.json --principal alice
exit 0
policy REV (ACME), api openai_chat, turn contentTrust trusted
choice 0 (completion clean: tool_calls)
  call 0 `run_shell` id call_0 → held at authorization (held_by_rule)
    completion    pass: tool_calls
    name          pass: run_shell → acme.assistant:run_shell
    arguments     pass: valid against the declared and catalog schemas
    trust         pass: turn is trusted
    authorization held: held_by_rule — held for the acting person's approval by exec-needs-a-person
    rule          exec-needs-a-person (rules/default.cedar:8)
    argsHash      5112e679ae51d6954ce4260da4302c76b6267cb9c7e41fa02d04219a256fd555
  surfaced as: wait for the acting person's approval (then release, or refuse)
$ policy explain --policy ACME --request ACME/tests/user-request.json --response ACME/tests/undeclared-response.json
exit 0
policy REV (ACME), api openai_chat, turn contentTrust trusted
choice 0 (completion clean: tool_calls)
  call 0 `delete_everything` id call_0 → invalid at name (undeclared_tool)
    completion    pass: tool_calls
    name          invalid: undeclared_tool — the tool `delete_everything` is not declared in this request's tools
    argsHash      44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a
  surfaced as: repair round with 1 host-authored result(s)
$ policy explain --policy ACME --request ACME/tests/after-email-request.json --response ACME/tests/send-email-response.json --principal alice
exit 0
policy REV (ACME), api openai_chat, turn contentTrust untrusted
choice 0 (completion clean: tool_calls)
  call 0 `send_email` id call_0 → held at trust (untrusted_turn)
    completion    pass: tool_calls
    name          pass: send_email → acme.assistant:send_email
    arguments     pass: valid against the declared and catalog schemas
    trust         held: untrusted_turn — this turn read untrusted content, and `acme.assistant:send_email` (safetyTier write, egress host-mediated) needs the acting person's approval
    argsHash      a87f462aa8f2d56db66cbaff63a654b5dee31a2d2cf2cce46ec3d4c032256114
  surfaced as: wait for the acting person's approval (then release, or refuse)
$ policy explain --policy ACME --request ACME/tests/user-request.json --response TMP/two-calls.json
exit 0
policy REV (ACME), api openai_chat, turn contentTrust trusted
choice 0 (completion clean: tool_calls)
  call 0 `get_weather` id call_a → ended-turn at dispatch (turn_ended)
    completion    pass: tool_calls
    name          pass: get_weather → acme.assistant:get_weather
    arguments     pass: valid against the declared and catalog schemas
    trust         pass: turn is trusted
    authorization permit: permit-calls
    limits        pass
    redaction     0 secret(s) redacted from every record
    dispatch      executed: released
    argsHash      a3f10aef7acee7cdd19c1cd6e200e4461d28167567106726e462493d98ba90cd
  call 1 `transfer_funds` id call_2Jb → refused at authorization (forbidden)
    completion    pass: tool_calls
    name          pass: transfer_funds → acme.assistant:transfer_funds
    arguments     pass: valid against the declared and catalog schemas
    trust         pass: turn is trusted
    authorization refused: forbidden — forbidden by large-transfers-refused, transfers-held-for-approval
    rule          large-transfers-refused (rules/default.cedar:14)
    rule          transfers-held-for-approval (rules/default.cedar:22)
    argsHash      829abc2cbcfa95e8cb52c29913423b7d81f50c4efc7ff5b9f0f29a81d8a8ae77
  surfaced as: end-turn
$ policy explain --policy ACME --request ACME/tests/user-request.json --response TMP/no-call.json
exit 0
policy REV (ACME), api openai_chat, turn contentTrust trusted
the response has no tool call
$ policy explain --policy ACME --request TMP/anthropic-request.json --response TMP/anthropic-response.json
exit 0
policy REV (ACME), api anthropic_messages, turn contentTrust trusted
choice 0 (completion clean: tool_use)
  call 0 `get_weather` id toolu_1 → executed at dispatch (released)
    completion    pass: tool_use
    name          pass: get_weather → acme.assistant:get_weather
    arguments     pass: valid against the declared and catalog schemas
    trust         pass: turn is trusted
    authorization permit: permit-calls
    limits        pass
    redaction     0 secret(s) redacted from every record
    dispatch      executed: released
    argsHash      a3f10aef7acee7cdd19c1cd6e200e4461d28167567106726e462493d98ba90cd
  surfaced as: release
$ policy explain --policy TMP/shadow --request ACME/tests/user-request.json --response ACME/tests/transfer-large-response.json
exit 0
policy REV (TMP/shadow), api openai_chat, turn contentTrust trusted
choice 0 (completion clean: tool_calls)
  call 0 `transfer_funds` id call_0 → refused at authorization (forbidden) [shadow: released anyway]
    completion    pass: tool_calls
    name          pass: transfer_funds → acme.assistant:transfer_funds
    arguments     pass: valid against the declared and catalog schemas
    trust         pass: turn is trusted
    authorization refused: forbidden — forbidden by large-transfers-refused, transfers-held-for-approval
    rule          large-transfers-refused (rules/default.cedar:14)
    rule          transfers-held-for-approval (rules/default.cedar:22)
    argsHash      4fb0cf9d4c94ce24ae197af3a49d8ae5a16f2f93904fb44fe78111c5e0614c0c
  surfaced as: release
$ policy explain --policy TMP/error --request ACME/tests/user-request.json --response ACME/tests/transfer-large-response.json
exit 0
policy REV (TMP/error), api openai_chat, turn contentTrust trusted
choice 0 (completion clean: tool_calls)
  call 0 `transfer_funds` id call_0 → refused at authorization (forbidden)
    completion    pass: tool_calls
    name          pass: transfer_funds → acme.assistant:transfer_funds
    arguments     pass: valid against the declared and catalog schemas
    trust         pass: turn is trusted
    authorization refused: forbidden — forbidden by large-transfers-refused, transfers-held-for-approval
    rule          large-transfers-refused (rules/default.cedar:14)
    rule          transfers-held-for-approval (rules/default.cedar:22)
    argsHash      4fb0cf9d4c94ce24ae197af3a49d8ae5a16f2f93904fb44fe78111c5e0614c0c
  surfaced as: error 403 forbidden
"#;

/// `policy explain` fails with exit 1 and one line naming the problem: a bundle that does not
/// compile (its errors), a `--policy` that is not a directory, a request or response that
/// cannot be read (the request's problem first when both fail) or is not JSON, an unknown
/// `--api`, a request the adapter cannot parse. A missing `--policy` directory means the
/// embedded default bundle.
#[test]
fn policy_explain_names_what_it_could_not_read_byte_for_byte() {
    let acme = repo().join("policy/examples/acme");
    let acme_s = acme.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let tmp_s = t.to_str().unwrap();
    let user = acme.join("tests/user-request.json");
    let user = user.to_str().unwrap();
    let weather = acme.join("tests/weather-response.json");
    let weather = weather.to_str().unwrap();
    let broken = t.join("broken");
    copy_dir(&acme, &broken);
    let rules = broken.join("rules/default.cedar");
    let mut text = std::fs::read_to_string(&rules).unwrap();
    text.push_str("\n@id(\"odd\")\n@outcome(\"maybe\")\nforbid (principal, action, resource);\n\npermit (principal, action, resource == Tool::\"acme.assistant:nope\");\n");
    std::fs::write(&rules, text).unwrap();
    let not_json = t.join("not-json.json");
    std::fs::write(&not_json, "{\"choices\": [").unwrap();
    let empty = t.join("empty-request.json");
    std::fs::write(&empty, "{}").unwrap();
    let file_policy = t.join("a-file");
    std::fs::write(&file_policy, "").unwrap();
    let missing = t.join("missing.json");
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let (broken, file_policy) = (s(&broken), s(&file_policy));
    let (missing, not_json, empty) = (s(&missing), s(&not_json), s(&empty));
    let (broken, file_policy) = (broken.as_str(), file_policy.as_str());
    let (missing, not_json, empty) = (missing.as_str(), not_json.as_str(), empty.as_str());
    // (policy, request, response, more arguments)
    let runs: [(&str, &str, &str, &[&str]); 7] = [
        (broken, user, weather, &[]),
        (file_policy, user, weather, &[]),
        (acme_s, missing, not_json, &[]),
        (acme_s, user, missing, &[]),
        (acme_s, user, not_json, &[]),
        (acme_s, user, weather, &["--api", "openai_responses_x"]),
        (acme_s, empty, weather, &["--api", "openai_chat"]),
    ];
    let mut got = String::new();
    for (policy, request, response, more) in runs {
        let mut args = vec![
            "policy",
            "explain",
            "--policy",
            policy,
            "--request",
            request,
            "--response",
            response,
        ];
        args.extend(more);
        got.push_str(&transcript(&args, &[(tmp_s, "TMP"), (acme_s, "ACME")]));
    }
    assert_eq!(
        got, EXPLAIN_ERRORS_TRANSCRIPT,
        "the explain errors changed:\n{got}"
    );
    // Its report is the default bundle's, which other work changes: only the header here.
    let missing_dir = t.join("no-such-bundle");
    let (code, out) = turnguard(&[
        "policy",
        "explain",
        "--policy",
        missing_dir.to_str().unwrap(),
        "--request",
        user,
        "--response",
        weather,
    ]);
    assert_eq!(code, 0, "{out}");
    let header = out.lines().next().unwrap_or_default();
    assert!(
        header.starts_with("policy ") && header.contains(" (embedded), api openai_chat, "),
        "{out}"
    );
}

const EXPLAIN_ERRORS_TRANSCRIPT: &str = r#"$ policy explain --policy TMP/broken --request ACME/tests/user-request.json --response ACME/tests/weather-response.json
exit 1
rules/default.cedar:32: rule `odd`: @outcome("maybe") is not `hold` or `refuse`
rules/default.cedar:36: rule `rules/default.cedar:36`: names Tool::"acme.assistant:nope", which is not in the catalog
$ policy explain --policy TMP/a-file --request ACME/tests/user-request.json --response ACME/tests/weather-response.json
exit 1
TMP/a-file: Not a directory (os error 20)
$ policy explain --policy ACME --request TMP/missing.json --response TMP/not-json.json
exit 1
TMP/missing.json: No such file or directory (os error 2)
$ policy explain --policy ACME --request ACME/tests/user-request.json --response TMP/missing.json
exit 1
TMP/missing.json: No such file or directory (os error 2)
$ policy explain --policy ACME --request ACME/tests/user-request.json --response TMP/not-json.json
exit 1
TMP/not-json.json: not JSON: EOF while parsing a list at line 1 column 13
$ policy explain --policy ACME --request ACME/tests/user-request.json --response ACME/tests/weather-response.json --api openai_responses_x
exit 1
unknown api `openai_responses_x` (openai_chat, anthropic_messages)
$ policy explain --policy ACME --request TMP/empty-request.json --response ACME/tests/weather-response.json --api openai_chat
exit 1
request: `messages` must be an array
"#;

/// `policy check` reports every rule problem of a bundle in one run, in file order, each with
/// `file:line`, the rule (`@id`, else `file:line`) and the message: a Cedar syntax error at
/// the line of the bad token, an unknown `@outcome`, `@outcome("hold")` on a permit, a scope
/// naming a tool the catalog does not have, an `@id` used twice, a read of an argument the
/// scoped tool does not have (at its line), and an argument read in a rule not scoped to one
/// tool; a rule scoped to the unknown-tool stand-in is validated like an unscoped one.
#[test]
fn policy_check_reports_every_rule_problem_byte_for_byte() {
    let tmp = tempfile::tempdir().unwrap();
    base_bundle(tmp.path());
    let bad = r#"@id("odd-outcome")
@outcome("maybe")
forbid (principal, action, resource);

@id("held-permit")
@outcome("hold")
permit (principal, action, resource);

@id("ghost")
forbid (principal, action, resource == Tool::"test.check:ghost");

@id("agent-may-call")
forbid (principal, action, resource == Tool::"test.check:lookup");

forbid (principal, action, resource == Tool::"test.check:pay")
when {
  context.args.amout > 1
};

@id("unscoped-reads-args")
forbid (principal, action, resource)
when { context.args.amount > 1 };

@id("unknown-tools-exec")
forbid (principal, action, resource == Tool::"turnguard:unknown")
when { resource.safetyTier == "exec" && context.args.x == 1 };

@id("syntax")
forbid (principal, action, resource)
when {
  context.trust ==
};
"#;
    write_bundle(tmp.path(), &[("rules/zz-bad.cedar", bad)]);
    let dir = tmp.path().to_str().unwrap();
    let got = transcript(&["policy", "check", dir], &[(dir, "DIR")]);
    assert_eq!(got, CHECK_TRANSCRIPT, "the rule problems changed:\n{got}");
}

const CHECK_TRANSCRIPT: &str = r#"$ policy check DIR
exit 1
DIR/rules/zz-bad.cedar:1: rule `odd-outcome`: @outcome("maybe") is not `hold` or `refuse`
DIR/rules/zz-bad.cedar:5: rule `held-permit`: @outcome("hold") only means something on a forbid rule
DIR/rules/zz-bad.cedar:9: rule `ghost`: names Tool::"test.check:ghost", which is not in the catalog
DIR/rules/zz-bad.cedar:12: rule `agent-may-call`: rule id `agent-may-call` is used twice
DIR/rules/zz-bad.cedar:17: rule `rules/zz-bad.cedar:15`: for policy `rules/zz-bad.cedar:15`, attribute `args.amout` in context for Action::"call" not found
DIR/rules/zz-bad.cedar:22: rule `unscoped-reads-args`: for policy `unscoped-reads-args`, attribute `args.amount` in context for Action::"call" not found
DIR/rules/zz-bad.cedar:26: rule `unknown-tools-exec`: for policy `unknown-tools-exec`, attribute `args.x` in context for Action::"call" not found
DIR/rules/zz-bad.cedar:32: Cedar syntax: unexpected token `}`
8 problem(s); the bundle is not valid
"#;
