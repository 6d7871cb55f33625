//! SDK equivalence over real sockets: for every response fixture in
//! `../shared/fixtures/providers/{openai-chat,anthropic-messages}/`, the official `openai` /
//! `anthropic` Python SDK gets the same parsed result through turnguard as it gets from the mock
//! provider directly, except for the truncated fixtures, where the agent gets no tool call
//! (`tests/sdk/equivalence.py` does the calls and the comparison). Then the journal must hold one
//! round per proxied request and the admission decision of every call.

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

const APIS: [&str; 2] = ["openai-chat", "anthropic-messages"];
/// Cut by the token limit while a tool call was open: the call is withheld at stage 1.
const TRUNCATED: [&str; 2] = [
    "openai-chat/stream-tool-call-cut-by-length.sse",
    "anthropic-messages/stream-max-tokens-mid-tool-use.sse",
];

/// `api/file` and path of every response fixture (`nonstream-*.json`, `stream-*.sse`).
fn response_fixtures(root: &Path) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    for api in APIS {
        let dir = root.join(api);
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
        for p in found {
            let name = format!(
                "{api}/{}",
                p.file_name().and_then(|n| n.to_str()).expect("utf-8 name")
            );
            out.push((name, p));
        }
    }
    out
}

/// The JSON `data:` payloads of an SSE fixture.
fn sse_payloads(path: &Path) -> Vec<Value> {
    support::sse_data(&std::fs::read(path).expect("fixture readable"))
        .into_iter()
        .filter(Value::is_object)
        .collect()
}

/// The client tool calls a fixture emits, `(call id, tool name)` in order (server tools such
/// as Anthropic's `server_tool_use` are the provider's and are not admitted).
fn expected_calls(name: &str, path: &Path) -> Vec<(String, String)> {
    let s = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_owned();
    let mut calls = Vec::new();
    let stream = name.ends_with(".sse");
    if name.starts_with("openai-chat/") {
        if stream {
            for chunk in sse_payloads(path) {
                for c in chunk["choices"].as_array().into_iter().flatten() {
                    for tc in c
                        .pointer("/delta/tool_calls")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                    {
                        if tc.get("id").is_some_and(|id| id.is_string()) {
                            calls.push((s(tc.get("id")), s(tc.pointer("/function/name"))));
                        }
                    }
                }
            }
        } else {
            let body: Value = serde_json::from_slice(&std::fs::read(path).expect("fixture"))
                .expect("fixture JSON");
            for c in body["choices"].as_array().into_iter().flatten() {
                for tc in c
                    .pointer("/message/tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    calls.push((s(tc.get("id")), s(tc.pointer("/function/name"))));
                }
            }
        }
    } else {
        let blocks: Vec<Value> = if stream {
            sse_payloads(path)
                .into_iter()
                .filter(|e| e["type"] == "content_block_start")
                .map(|e| e["content_block"].clone())
                .collect()
        } else {
            let body: Value = serde_json::from_slice(&std::fs::read(path).expect("fixture"))
                .expect("fixture JSON");
            body["content"].as_array().cloned().unwrap_or_default()
        };
        for b in blocks.iter().filter(|b| b["type"] == "tool_use") {
            calls.push((s(b.get("id")), s(b.get("name"))));
        }
    }
    calls
}

#[derive(Debug)]
struct Round {
    api: String,
    stream: bool,
    state: String,
    completion: Option<String>,
    upstream_status: Option<i64>,
}

#[derive(Debug)]
struct CallRow {
    call_id: String,
    name: String,
    outcome: String,
    stage: String,
    reason: String,
}

#[tokio::test(flavor = "multi_thread")]
async fn official_sdks_get_the_same_result_through_turnguard_for_every_fixture() {
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
    ];
    let output = support::run_sdk_script("equivalence.py", &args, Duration::from_secs(300)).await;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();

    // Every problem is collected, so one run reports both the SDK comparison and the journal.
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
        "equivalence.py exited with {}",
        output.status
    );
    for (name, _) in &fixtures {
        let ok = format!("ok {name}");
        expect!(
            stdout.lines().any(|l| l.trim_end() == ok),
            "equivalence.py printed no `{ok}` line"
        );
    }

    let dir = harness.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));

    // One round per proxied request: the direct calls never reach turnguard.
    let mut rounds: BTreeMap<String, Round> = BTreeMap::new();
    let mut stmt = db
        .prepare(
            "SELECT client_request_id, api, stream, state, completion, upstream_status FROM rounds",
        )
        .expect("rounds query");
    let rows = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                Round {
                    api: r.get(1)?,
                    stream: r.get(2)?,
                    state: r.get(3)?,
                    completion: r.get(4)?,
                    upstream_status: r.get(5)?,
                },
            ))
        })
        .expect("rounds rows");
    let mut round_count = 0usize;
    for row in rows {
        let (id, round) = row.expect("round row");
        round_count += 1;
        expect!(
            rounds.insert(id.clone(), round).is_none(),
            "journal: two rounds sent as x-request-id {id}"
        );
    }
    expect!(
        round_count == fixtures.len(),
        "journal: expected one round per proxied request ({} fixtures), got {round_count}: {:?}",
        fixtures.len(),
        rounds.keys().collect::<Vec<_>>()
    );

    let mut calls: BTreeMap<String, Vec<CallRow>> = BTreeMap::new();
    let mut stmt = db
        .prepare("SELECT r.client_request_id, c.call_id, c.name, c.outcome, c.stage, c.reason FROM tool_calls c JOIN rounds r USING (request_id) ORDER BY r.client_request_id, c.choice, c.ordinal")
        .expect("tool_calls query");
    let rows = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                CallRow {
                    call_id: r.get(1)?,
                    name: r.get(2)?,
                    outcome: r.get(3)?,
                    stage: r.get(4)?,
                    reason: r.get(5)?,
                },
            ))
        })
        .expect("tool_calls rows");
    let mut call_count = 0usize;
    for row in rows {
        let (id, call) = row.expect("tool_calls row");
        call_count += 1;
        calls.entry(id).or_default().push(call);
    }

    let mut expected_call_count = 0usize;
    for (name, path) in &fixtures {
        let want = expected_calls(name, path);
        expected_call_count += want.len();
        let request_id = format!("sdk-eq:{name}");
        let Some(round) = rounds.get(&request_id) else {
            problems.push(format!(
                "journal: no round for {name} (request_id {request_id})"
            ));
            continue;
        };
        let api = if name.starts_with("openai-chat/") {
            "openai_chat"
        } else {
            "anthropic_messages"
        };
        let truncated = TRUNCATED.contains(&name.as_str());
        let completion = if truncated {
            "truncated"
        } else if name.contains("refusal") {
            "refused"
        } else {
            "clean"
        };
        expect!(
            round.api == api,
            "journal: {name}: rounds.api = {:?}, expected {api:?}",
            round.api
        );
        expect!(
            round.stream == name.ends_with(".sse"),
            "journal: {name}: rounds.stream = {}",
            round.stream
        );
        expect!(
            round.state == "ok",
            "journal: {name}: rounds.state = {:?}, expected \"ok\"",
            round.state
        );
        expect!(
            round.upstream_status == Some(200),
            "journal: {name}: rounds.upstream_status = {:?}, expected 200",
            round.upstream_status
        );
        expect!(
            round.completion.as_deref() == Some(completion),
            "journal: {name}: rounds.completion = {:?}, expected {completion:?}",
            round.completion
        );

        let got = calls
            .get(&request_id)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let got_ids: Vec<(String, String)> = got
            .iter()
            .map(|c| (c.call_id.clone(), c.name.clone()))
            .collect();
        expect!(
            got_ids == want,
            "journal: {name}: tool_calls (call_id, name) = {got_ids:?}, expected {want:?}"
        );
        for c in got {
            let decision = (c.outcome.as_str(), c.stage.as_str(), c.reason.as_str());
            if truncated {
                expect!(
                    decision == ("invalid", "completion", "truncated"),
                    "journal: {name}: call {} of a truncated completion: (outcome, stage, reason) = {decision:?}, \
                     expected (\"invalid\", \"completion\", \"truncated\")",
                    c.call_id
                );
            } else {
                expect!(
                    (decision.0, decision.1) == ("executed", "dispatch"),
                    "journal: {name}: call {} of a clean completion: (outcome, stage, reason) = {decision:?}, \
                     expected executed at dispatch",
                    c.call_id
                );
            }
        }
    }
    expect!(
        TRUNCATED
            .iter()
            .all(|t| fixtures.iter().any(|(n, _)| n == t)),
        "a truncated fixture is missing from {}",
        fixtures_dir.display()
    );
    expect!(
        expected_call_count > 0,
        "no fixture has tool calls: the journal check proves nothing"
    );
    expect!(
        call_count == expected_call_count,
        "journal: {call_count} tool_calls rows in total, expected {expected_call_count}"
    );

    assert!(
        problems.is_empty(),
        "{} problem(s):\n- {}\n--- equivalence.py stdout\n{stdout}--- equivalence.py stderr\n{stderr}",
        problems.len(),
        problems.join("\n- ")
    );
}
