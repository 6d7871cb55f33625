//! A journal unit of work per round (issue 13 item 2): a run's round costs one durable commit
//! before upstream when the request carries tool results (the results and the declared tools
//! together) and one at the decision (the round, its calls, its `agent.tool-called` events and
//! the served record together), plus one for the effect claims of a round that releases a
//! write call — never one commit per record. Counted on `turnguard_journal_commits_total`
//! with one request at a time, so each durable commit is one batch; on both backends. The
//! run's sticky trust bit is read through the reader, never the writer, and set (for an
//! untrusted turn) in the before-upstream commit.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)] // test code

use serde_json::{json, Value};
use turnguard::mock_provider::Script;

use crate::support::approvals::*;
use crate::support::{self, Harness};

const DURABLE: &str = "turnguard_journal_commits_total{durability=\"durable\"}";

/// turnguard on the trust bundle, with alice's agent-held token already presented once (its
/// first presentation per process is journaled durably before the request goes on — one
/// more commit, paid once, not per round).
async fn start(responses: Value) -> (Harness, tempfile::TempDir) {
    let keys = tempfile::tempdir().unwrap();
    let trust = trust_config(keys.path(), 30_000);
    let h = support::start_with(Script::default(), trust).await;
    let mut all = vec![json!({"json": chat_response("Warm.", vec![])})];
    all.extend(responses.as_array().unwrap().iter().cloned());
    h.script(&json!({ "responses": all })).await;
    let (_, first) = durable_commits_of(&h, None, &transcript(ask())).await;
    // The token's first presentation is journaled durably (on PostgreSQL the replica's
    // first batch may commit apart from it); what follows counts rounds only.
    assert!(
        first >= 1.0,
        "the token's first presentation is journaled durably"
    );
    (h, keys)
}

fn ask() -> Vec<Value> {
    vec![json!({"role": "user", "content": "Look up Bob and write to him."})]
}

fn transcript(messages: Vec<Value>) -> Value {
    json!({"model": "gpt-4o-mini", "messages": messages, "tools": chat_tools()})
}

/// Sends `body` as alice in `run`; asserts a 200 and returns the response and how many
/// durable commits the request made.
/// Alice's agent-side token, minted once: one minted in a later second carries another
/// `exp`, so it is another token, and its first presentation is a durable commit of its own
/// (which counted in whichever request crossed the second: a flaky count).
fn alice() -> String {
    static TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TOKEN.get_or_init(|| agent_token("alice")).clone()
}

async fn durable_commits_of(h: &Harness, run: Option<&str>, body: &Value) -> (Value, f64) {
    let before = metric(h, DURABLE).await;
    let url = format!("{}/v1/chat/completions", h.url());
    let mut headers = vec![("turnguard-principal-token", alice())];
    if let Some(run) = run {
        headers.push(("turnguard-run", run.to_owned()));
    }
    let (status, _, resp) = support::call("POST", &url, &headers, Some(body)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    let after = metric(h, DURABLE).await;
    (json_of(&resp), after - before)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_round_is_one_durable_commit_at_the_decision_and_one_for_its_tool_results() {
    let lookup = chat_call("call_lookup", "lookup_contact", json!({"name": "bob"}));
    let (h, _keys) = start(json!([
        {"json": chat_response("", vec![lookup.clone()])},
        {"json": chat_response("Bob is bob@example.test.", vec![])},
        {"json": chat_response("Hello from a chat turn.", vec![])},
    ]))
    .await;

    // Round 1 of the run: no tool results; the decision is one commit.
    let (resp, commits) = durable_commits_of(&h, Some("run-units"), &transcript(ask())).await;
    assert_eq!(released_calls(&resp).len(), 1, "{resp}");
    assert_eq!(
        commits, 1.0,
        "the round, its call, its events and the served record commit together"
    );

    // Round 2: the tool result is committed before upstream (one commit), then the decision.
    let mut messages = ask();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [lookup]}));
    messages.push(
        json!({"role": "tool", "tool_call_id": "call_lookup", "content": "bob@example.test"}),
    );
    let (_, commits) = durable_commits_of(&h, Some("run-units"), &transcript(messages)).await;
    assert_eq!(
        commits, 2.0,
        "the tool result before upstream, then the decision"
    );

    // A chat turn (no `Turnguard-Run`) needs nothing durable.
    let (_, commits) = durable_commits_of(&h, None, &transcript(ask())).await;
    assert_eq!(commits, 0.0, "a chat turn is out of replay (§D)");

    // Everything the units carried is in the journal.
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let count = |sql: &str| -> i64 { db.query_row(sql, [], |r| r.get(0)).unwrap() };
    assert_eq!(
        count("SELECT count(*) FROM rounds WHERE run_id = 'run-units'"),
        2
    );
    assert_eq!(
        count("SELECT count(*) FROM served WHERE run_id = 'run-units'"),
        2
    );
    assert_eq!(
        count("SELECT count(*) FROM tool_calls WHERE call_id = 'call_lookup'"),
        1
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM events WHERE run_id = 'run-units' AND type = 'agent.tool-called'"
        ),
        1
    );
    assert_eq!(
        count("SELECT count(*) FROM events WHERE run_id = 'run-units' AND type = 'agent.tool-returned'"),
        1
    );
    assert_eq!(
        count("SELECT count(*) FROM tool_results WHERE run_id = 'run-units'"),
        1
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_round_releasing_write_calls_claims_them_in_one_commit_and_confirms_them_in_the_decision()
{
    let (h, _keys) = start(json!([
        {"json": chat_response("", vec![
            chat_call("call_send_1", "send_email", send_args("one")),
            chat_call("call_send_2", "send_email", send_args("two")),
        ])},
    ]))
    .await;
    let (resp, commits) = durable_commits_of(&h, Some("run-claims"), &transcript(ask())).await;
    assert_eq!(released_calls(&resp).len(), 2, "{resp}");
    assert_eq!(
        commits, 2.0,
        "both claims in one commit, then the decision (which confirms them)"
    );
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let released: i64 = db
        .query_row(
            "SELECT count(*) FROM effects WHERE run_id = 'run-claims' AND released = 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(
        released, 2,
        "each claim is confirmed released with the served record"
    );
}

/// A multi-step agent sends every earlier tool result again each turn. A result this process
/// already recorded is not written again (`journal::seen_results`): a turn that only repeats
/// it makes no before-upstream commit. A result that comes back changed, or in another scope
/// (a chat turn after the run), is new, and is recorded.
#[tokio::test(flavor = "multi_thread")]
async fn a_result_sent_again_is_not_written_again_but_a_changed_one_is() {
    let lookup = chat_call("call_lookup", "lookup_contact", json!({"name": "bob"}));
    let (h, _keys) = start(json!([
        {"json": chat_response("", vec![lookup.clone()])},
        {"json": chat_response("Bob is bob@example.test.", vec![])},
        {"json": chat_response("Nothing else.", vec![])},
        {"json": chat_response("Corrected.", vec![])},
        {"json": chat_response("In a chat turn.", vec![])},
        {"json": chat_response("Again in a chat turn.", vec![])},
    ]))
    .await;
    let run = Some("run-seen");
    let with_result = |content: &str, later: bool| {
        let mut messages = ask();
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [lookup]}));
        messages.push(json!({"role": "tool", "tool_call_id": "call_lookup", "content": content}));
        if later {
            messages.push(json!({"role": "assistant", "content": "Bob is bob@example.test."}));
            messages.push(json!({"role": "user", "content": "Anything else?"}));
        }
        transcript(messages)
    };
    durable_commits_of(&h, run, &transcript(ask())).await;
    let (_, commits) = durable_commits_of(&h, run, &with_result("bob@example.test", false)).await;
    assert_eq!(commits, 2.0, "the new result, then the decision");
    let (_, commits) = durable_commits_of(&h, run, &with_result("bob@example.test", true)).await;
    assert_eq!(
        commits, 1.0,
        "the result sent again is in the journal: only the decision commits"
    );
    let (_, commits) = durable_commits_of(&h, run, &with_result("bob@example.org", true)).await;
    assert_eq!(
        commits, 2.0,
        "a changed result is recorded, then the decision"
    );
    let (_, commits) = durable_commits_of(&h, None, &with_result("bob@example.test", true)).await;
    assert_eq!(commits, 1.0, "in a chat turn the result is new: recorded");
    let (_, commits) = durable_commits_of(&h, None, &with_result("bob@example.test", true)).await;
    assert_eq!(commits, 0.0, "and not again");

    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let contents = |scope: &str| -> Vec<String> {
        db.column::<Vec<u8>>(&format!(
            "SELECT content FROM tool_results WHERE scope = '{scope}' ORDER BY id"
        ))
        .into_iter()
        .map(|b| String::from_utf8(b).unwrap())
        .collect()
    };
    assert_eq!(
        contents("run:run-seen"),
        ["\"bob@example.test\"", "\"bob@example.org\""]
    );
    assert_eq!(contents("chat"), ["\"bob@example.test\""]);
}
