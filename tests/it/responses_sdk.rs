//! SDK equivalence on the Responses surface over real sockets (issue 5, must-show 1 and 3):
//! the official `openai` Python SDK's `client.responses` gets the same parsed result through
//! turnguard as from the mock provider directly, for every response fixture in
//! `../shared/fixtures/providers/openai-responses/`; and streams whose call turnguard withholds
//! still parse, with consecutive sequence numbers (`tests/sdk/responses_equivalence.py` does
//! the calls and comparisons). Then the journal must hold each proxied round, each call's
//! decision, and each response id with whether its output was provider-executed.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use turnguard::mock_provider::Script;

const API: &str = "openai-responses";

/// The withheld cases of the script: name, whether it streams, and the decision of its call
/// (outcome, stage, reason).
const WITHHELD: [(&str, bool, (&str, &str, &str)); 5] = [
    (
        "undeclared-tool",
        true,
        ("invalid", "name", "undeclared_tool"),
    ),
    (
        "schema-invalid-arguments",
        true,
        ("invalid", "arguments", "schema_violation"),
    ),
    (
        "cut-by-max-output-tokens",
        true,
        ("invalid", "completion", "truncated"),
    ),
    (
        "call-then-text-undeclared",
        true,
        ("invalid", "name", "undeclared_tool"),
    ),
    (
        "nonstream-undeclared-tool",
        false,
        ("invalid", "name", "undeclared_tool"),
    ),
];

fn response_fixtures(root: &Path) -> Vec<(String, PathBuf)> {
    let dir = root.join(API);
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            (name.starts_with("nonstream-") && name.ends_with(".json"))
                || (name.starts_with("stream-") && name.ends_with(".sse"))
        })
        .collect();
    found.sort();
    assert!(
        !found.is_empty(),
        "no response fixtures in {}",
        dir.display()
    );
    found
        .into_iter()
        .map(|p| {
            let name = format!("{API}/{}", p.file_name().unwrap().to_string_lossy());
            (name, p)
        })
        .collect()
}

/// The response object of a fixture (the body, or the terminal event's `response`).
fn final_response(path: &Path) -> Value {
    let bytes = std::fs::read(path).expect("fixture");
    if path.extension().is_some_and(|e| e == "sse") {
        support::sse_data(&bytes)
            .into_iter()
            .filter(|e| e["type"] == "response.completed")
            .map(|e| e["response"].clone())
            .next_back()
            .expect("a response.completed event")
    } else {
        serde_json::from_slice(&bytes).expect("fixture JSON")
    }
}

const PROVIDER_ITEMS: [&str; 7] = [
    "web_search_call",
    "file_search_call",
    "code_interpreter_call",
    "image_generation_call",
    "mcp_call",
    "mcp_list_tools",
    "mcp_approval_request",
];

#[tokio::test(flavor = "multi_thread")]
async fn official_sdk_responses_get_the_same_result_through_turnguard() {
    let fixtures_dir = support::fixtures();
    let fixtures = response_fixtures(&fixtures_dir);
    let harness = support::start(Script::default()).await;

    let args = [
        "--turnguard".into(),
        harness.url().into(),
        "--mock".into(),
        harness.mock_url().into(),
        "--fixtures".into(),
        fixtures_dir.clone().into_os_string(),
        "--own-fixtures".into(),
        support::own_fixtures().into_os_string(),
    ];
    let output =
        support::run_sdk_script("responses_equivalence.py", &args, Duration::from_secs(300)).await;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();

    let mut problems: Vec<String> = Vec::new();
    macro_rules! expect {
        ($cond:expr, $($msg:tt)+) => {
            if !$cond {
                problems.push(format!($($msg)+));
            }
        };
    }
    expect!(
        output.status.success(),
        "responses_equivalence.py exited with {}",
        output.status
    );
    let cases = fixtures
        .iter()
        .map(|(n, _)| n.clone())
        .chain(WITHHELD.iter().map(|(n, _, _)| format!("withheld:{n}")));
    for name in cases {
        let ok = format!("ok {name}");
        expect!(
            stdout.lines().any(|l| l.trim_end() == ok),
            "responses_equivalence.py printed no `{ok}` line"
        );
    }

    let dir = harness.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let rounds: BTreeMap<String, (String, bool, String, Option<String>)> = db
        .prepare("SELECT client_request_id, api, stream, state, completion FROM rounds")
        .unwrap()
        .query_map([], |r| {
            Ok((r.get(0)?, (r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let calls_of = |request_id: &str| -> Vec<(String, String, String, String, String)> {
        db.prepare("SELECT call_id, name, outcome, stage, reason FROM tool_calls WHERE request_id = ?1 ORDER BY choice, ordinal")
            .unwrap()
            .query_map([support::round_key(&db, request_id)], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    // One row per response id: the mock serves a fixture (and its id) several times, and the
    // first round that saw an id keeps it (insert-if-absent).
    let link_of = |response_id: &str| -> Option<(String, Option<String>, bool, String)> {
        db.query_row(
            "SELECT r.client_request_id, p.status, p.provider_executed, p.provider_items FROM responses p JOIN rounds r USING (request_id) WHERE p.response_id = ?1",
            [response_id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .ok()
    };

    let mut expected_rounds = 0;
    for (name, path) in &fixtures {
        let stream = name.ends_with(".sse");
        let response = final_response(path);
        let want_calls: Vec<(String, String)> = response["output"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["type"] == "function_call")
            .map(|i| {
                (
                    i["call_id"].as_str().unwrap().to_owned(),
                    i["name"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        let mut want_items: Vec<&str> = Vec::new();
        for item in response["output"].as_array().unwrap() {
            let t = item["type"].as_str().unwrap();
            if PROVIDER_ITEMS.contains(&t) && !want_items.contains(&t) {
                want_items.push(t);
            }
        }
        let ids: Vec<String> = if stream {
            vec![format!("sdk-eq:{name}"), format!("sdk-eq:{name}#raw")]
        } else {
            vec![format!("sdk-eq:{name}")]
        };
        let response_id = response["id"].as_str().unwrap();
        let link = link_of(response_id);
        let want_link = (
            format!("sdk-eq:{name}"),
            Some("completed".to_owned()),
            !want_items.is_empty(),
            want_items.join(","),
        );
        expect!(
            link.as_ref() == Some(&want_link),
            "journal: responses row of {response_id}: {link:?}, expected {want_link:?}"
        );
        for id in ids {
            expected_rounds += 1;
            let Some((api, is_stream, state, completion)) = rounds.get(&id) else {
                problems.push(format!("journal: no round {id}"));
                continue;
            };
            expect!(
                (
                    api.as_str(),
                    *is_stream,
                    state.as_str(),
                    completion.as_deref()
                ) == ("openai_responses", stream, "ok", Some("clean")),
                "journal: {id}: (api, stream, state, completion) = {:?}",
                (api, is_stream, state, completion)
            );
            let calls = calls_of(&id);
            let got: Vec<(String, String)> =
                calls.iter().map(|c| (c.0.clone(), c.1.clone())).collect();
            expect!(
                got == want_calls,
                "journal: {id}: calls {got:?}, expected {want_calls:?}"
            );
            expect!(
                calls
                    .iter()
                    .all(|c| (c.2.as_str(), c.3.as_str()) == ("executed", "dispatch")),
                "journal: {id}: a clean call was not released: {calls:?}"
            );
        }
    }
    for (case, stream, decision) in WITHHELD {
        let ids: Vec<String> = if stream {
            vec![
                format!("sdk-eq:withheld:{case}"),
                format!("sdk-eq:withheld:{case}#raw"),
            ]
        } else {
            vec![format!("sdk-eq:withheld:{case}")]
        };
        for id in ids {
            expected_rounds += 1;
            expect!(
                rounds.get(&id).is_some_and(|r| r.2 == "ok"),
                "journal: {id}: round {:?}",
                rounds.get(&id)
            );
            let calls = calls_of(&id);
            expect!(
                !calls.is_empty()
                    && calls
                        .iter()
                        .all(|c| (c.2.as_str(), c.3.as_str(), c.4.as_str()) == decision),
                "journal: {id}: calls {calls:?}, expected every decision {decision:?}"
            );
        }
    }
    let proxied = rounds.keys().filter(|k| k.starts_with("sdk-eq:")).count();
    expect!(
        proxied == expected_rounds && rounds.len() == expected_rounds,
        "journal: {} rounds ({proxied} sdk-eq), expected {expected_rounds}: {:?}",
        rounds.len(),
        rounds.keys().collect::<Vec<_>>()
    );

    assert!(
        problems.is_empty(),
        "{} problem(s):\n- {}\n--- responses_equivalence.py stdout\n{stdout}--- stderr\n{stderr}",
        problems.len(),
        problems.join("\n- ")
    );
}

/// A repaired stream (the first round's call fails its schema; turnguard asks again and
/// splices the second round into the agent's stream) parses with the official SDK as one
/// response.
#[tokio::test(flavor = "multi_thread")]
async fn official_sdk_parses_a_repaired_responses_stream() {
    let harness = support::start_with_policy(Script::default(), "policy-repair").await;
    let args = [
        "--turnguard".into(),
        harness.url().into(),
        "--mock".into(),
        harness.mock_url().into(),
        "--fixtures".into(),
        support::fixtures().into_os_string(),
        "--own-fixtures".into(),
        support::own_fixtures().into_os_string(),
        "--repair".into(),
    ];
    let output =
        support::run_sdk_script("responses_equivalence.py", &args, Duration::from_secs(120)).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.lines().any(|l| l.trim_end() == "ok repair:stream"),
        "--- stdout\n{stdout}--- stderr\n{stderr}"
    );
    let requests = harness.mock_requests().await;
    assert_eq!(requests.len(), 4, "two agent requests, each repaired once");
    harness.stop().await;
}
