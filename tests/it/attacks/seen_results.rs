//! Attacks on this leg: see [`super`] for the attacker and the rule.
//!
//! `journal::seen_results`: the request path skips a tool result this process already
//! recorded. Attackers: the agent (its transcript: which results it sends again, changed how,
//! in which scope, as whom, how often, how many), tool content. The rule: a result the
//! journal's own unique key (scope, call id, SHA-256 of the content's JSON text) holds apart is
//! recorded as its own row; a repeat is never recorded twice, never emits a second
//! `agent.tool-returned` and never completes an effect twice; a result the journal did not
//! confirm is recorded when it comes again; one principal's results never make another's skip;
//! and the memory is capped at two generations.
//! Black-box over real sockets; each test names the defect it pins, and each sending of a
//! result is checked to have been skipped or submitted (durable commits, one request at a
//! time), so the memory is really exercised.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use turnguard::journal::seen_results::GENERATION;
use turnguard::mock_provider::Script;

use super::journal_views::{start_probe, tools_for};
use crate::support;
use support::approvals::metric;
use support::runs::*;
use support::{own_fixtures, post_raw, Harness};

const DURABLE: &str = "turnguard_journal_commits_total{durability=\"durable\"}";
const CHAT: &str = "/v1/chat/completions";

/// The mock answers every request, on any API, with the text `done`.
async fn answer_done(h: &Harness) {
    h.script(&json!({"responses": [{"reply": {"text": "done"}}], "repeat": true}))
        .await;
}

/// Posts `body` (raw JSON text, exactly as the agent sends it) to `path` with `headers`;
/// asserts a 200 and returns how many durable journal commits the request made (one request
/// at a time: in a chat turn that is its before-upstream commit, or none when every result it
/// carries was skipped).
async fn commits_of(h: &Harness, path: &str, headers: &[(&str, &str)], body: &str) -> f64 {
    let before = metric(h, DURABLE).await;
    let (status, _, resp) = post_raw(
        &format!("{}{path}", h.url()),
        Bytes::from(body.to_owned()),
        headers,
    )
    .await;
    assert_eq!(
        status,
        200,
        "{path} {body}: {}",
        String::from_utf8_lossy(&resp)
    );
    metric(h, DURABLE).await - before
}

/// A Chat transcript answering `lookup` calls: `(call id, content)`, the content given as raw
/// JSON text exactly as it goes on the wire; the assistant message shows each id once.
fn chat_results(results: &[(&str, &str)]) -> String {
    let mut ids: Vec<&str> = Vec::new();
    for (id, _) in results {
        if !ids.contains(id) {
            ids.push(id);
        }
    }
    let calls: Vec<Value> = ids.iter().map(|id| call(id, "lookup", json!({}))).collect();
    let mut messages = vec![
        json!({"role": "user", "content": "go"}).to_string(),
        json!({"role": "assistant", "content": null, "tool_calls": calls}).to_string(),
    ];
    for (id, content) in results {
        messages.push(format!(
            r#"{{"role":"tool","tool_call_id":{},"content":{content}}}"#,
            Value::from(*id)
        ));
    }
    format!(
        r#"{{"model":"gpt-test","messages":[{}],"tools":{}}}"#,
        messages.join(","),
        tools_for(&["lookup"])
    )
}

fn chat_result(call_id: &str, content: &str) -> String {
    chat_results(&[(call_id, content)])
}

/// A Chat transcript `body` continued by one more exchange (the model's `done`, then user
/// message `n`): a later turn carrying the same results.
fn later(body: &str, n: usize) -> String {
    let mut v: Value = serde_json::from_str(body).unwrap();
    let messages = v["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": "done"}));
    messages.push(json!({"role": "user", "content": format!("and then {n}?")}));
    v.to_string()
}

/// The JSON text the journal keeps of a content sent as `raw` (parsed, then serialized).
fn journal_text(raw: &str) -> String {
    serde_json::to_string(&serde_json::from_str::<Value>(raw).unwrap()).unwrap()
}

fn sha256_hex(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// `(scope, content, content_digest)` of every `tool_results` row answering `call_id`, in
/// insertion order.
fn rows_of(db: &support::Db, call_id: &str) -> Vec<(String, String, String)> {
    let mut st = db
        .prepare(
            "SELECT scope, content, content_digest FROM tool_results WHERE tool_call_id = ?1
             ORDER BY id",
        )
        .unwrap();
    st.query_map([call_id], |r| {
        let content: Vec<u8> = r.get(1)?;
        Ok((r.get(0)?, String::from_utf8(content).unwrap(), r.get(2)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// How many `agent.tool-returned` events name `call_id`.
fn returned_of(db: &support::Db, call_id: &str) -> i64 {
    db.query_row(
        "SELECT count(*) FROM events WHERE type = 'agent.tool-returned'
         AND json_extract(payload, '$.callId') = ?1",
        [call_id],
        |r| r.get(0),
    )
    .unwrap()
}

/// The states of a run's effects, in claim order.
fn effect_states(h: &Harness, run: &str) -> Vec<String> {
    effect_rows(h, run).into_iter().map(|e| e.3).collect()
}

/// Waits (up to 5 s) until the run's upstream-error round is in the journal.
async fn upstream_error_recorded(h: &Harness, run: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let n: i64 = support::journal(&h.journal())
            .query_row(
                "SELECT count(*) FROM rounds WHERE run_id = ?1 AND state = 'upstream_error'",
                [run],
                |r| r.get(0),
            )
            .unwrap();
        if n == 1 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the upstream error round was not recorded"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// turnguard on `tests/fixtures/policy-run` (`lookup_order` re-runnable, `send_receipt` a
/// write: inside a run its effect is claimed), with a short journal busy timeout so a locked
/// journal fails a write quickly.
async fn start_run_bundle() -> Harness {
    support::start_with(Script::default(), |c| {
        c.policy = own_fixtures().join("policy-run");
        c.journal_busy_timeout_ms = 200;
    })
    .await
}

/// Defect it would pin: a result that comes back *changed* under the same call id is skipped
/// (not its own `tool_results` row) because the memory's key of it equals the key of the
/// first — key order, number spelling, nesting, string against content blocks, the length
/// boundaries between strings and keys; or, the other way, two spellings of one JSON value
/// (`"\u0061"` and `"a"`, `1e2` and `100.0`, whitespace) are recorded twice or the journal
/// and the memory disagree about them. For each pair: the first content is recorded (one
/// commit), sent again it is skipped (no commit: the memory is exercised), then the second is
/// recorded if and only if its journal text differs — and the journal holds exactly the
/// distinct texts, each under the SHA-256 of its text.
#[tokio::test(flavor = "multi_thread")]
async fn a_changed_result_is_recorded_however_little_it_changed() {
    let (h, _bundle) = start_probe().await;
    answer_done(&h).await;
    // (first, then): the journal keeps them apart exactly when their JSON texts differ.
    let cases: &[(&str, &str)] = &[
        (r#"{"a":1,"b":2}"#, r#"{"b":2,"a":1}"#),
        ("1", "1.0"),
        ("100", "1e2"),
        ("1e2", "100.0"),
        ("0.1", "0.10000000000000001"),
        ("-0.0", "0.0"),
        ("18446744073709551615", "18446744073709551616"),
        ("18446744073709551616", "18446744073709551617"),
        (r#""\u0061""#, r#""a""#),
        (r#""\ud83d\ude00""#, "\"\u{1F600}\""),
        (r#""a\/b""#, r#""a/b""#),
        (r#"{"a": 1}"#, r#"{"a":1}"#),
        (r#"[["ab","c"]]"#, r#"[["a","bc"]]"#),
        (r#"{"ab":"c"}"#, r#"{"a":"bc"}"#),
        (r#"{"a":"1"}"#, r#"{"a":1}"#),
        (r#"[1,[2,[3]]]"#, r#"[1,[2,[3,null]]]"#),
        (r#"{"a":{"b":[]}}"#, r#"{"a":{"b":{}}}"#),
        (r#""hello""#, r#"[{"type":"text","text":"hello"}]"#),
        (
            r#"[{"type":"text","text":"hello"}]"#,
            r#"[{"text":"hello","type":"text"}]"#,
        ),
        (
            r#"[{"type":"text","text":"a"},{"type":"text","text":"b"}]"#,
            r#"[{"type":"text","text":"b"},{"type":"text","text":"a"}]"#,
        ),
        ("null", r#""null""#),
        ("null", r#""""#),
        ("true", r#""true""#),
        ("{}", "[]"),
    ];
    // A few the journal's text must say are one value, and a few it must keep apart (so the
    // journal side of the comparison is checked too, not only derived).
    let same = |a: &str, b: &str| journal_text(a) == journal_text(b);
    assert!(
        same(r#""\u0061""#, r#""a""#) && same("1e2", "100.0") && same(r#"{"a": 1}"#, r#"{"a":1}"#)
    );
    assert!(
        !same(r#"{"a":1,"b":2}"#, r#"{"b":2,"a":1}"#) && !same("1", "1.0") && !same("100", "1e2")
    );
    // The journal keeps the parsed value's text, not the agent's bytes: past an f64's
    // precision two spellings are one result to it (and must be to the memory as well).
    assert!(
        same("0.1", "0.10000000000000001")
            && same("18446744073709551616", "18446744073709551617")
            && !same("18446744073709551615", "18446744073709551616")
            && !same("-0.0", "0.0")
    );

    let mut wrong = Vec::new();
    for (i, (first, then)) in cases.iter().enumerate() {
        let id = format!("call_case_{i}");
        let c1 = commits_of(&h, CHAT, &[], &chat_result(&id, first)).await;
        let c2 = commits_of(&h, CHAT, &[], &chat_result(&id, first)).await;
        let c3 = commits_of(&h, CHAT, &[], &chat_result(&id, then)).await;
        let want = if same(first, then) { 0.0 } else { 1.0 };
        if (c1, c2, c3) != (1.0, 0.0, want) {
            wrong.push(format!(
                "{first} then {then}: commits {c1}/{c2}/{c3}, want 1/0/{want}"
            ));
        }
    }
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    for (i, (first, then)) in cases.iter().enumerate() {
        let mut want = vec![journal_text(first)];
        if !same(first, then) {
            want.push(journal_text(then));
        }
        let rows = rows_of(&db, &format!("call_case_{i}"));
        let got: Vec<String> = rows.iter().map(|r| r.1.clone()).collect();
        if got != want {
            wrong.push(format!("{first} then {then}: rows {got:?}, want {want:?}"));
        }
        for (scope, text, digest) in &rows {
            if scope != "chat" {
                wrong.push(format!("{first} then {then}: row {text} in scope {scope}"));
            }
            if *digest != sha256_hex(text) {
                wrong.push(format!(
                    "{first} then {then}: row {text}: digest {digest} is not the SHA-256 of its text"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// Defect it would pin: the memory's scope is not the journal's — the same call id and
/// content in another run (another `Turnguard-Run`), in a chat turn after a run, or in a run
/// named like the chat scope (`chat`) is skipped and never recorded in that scope; or the run
/// id and the call id run together so that run `ab` call `c` and run `a` call `bc` share a
/// key. Each scope's first sending makes its before-upstream commit (a run's decision commits
/// durably too: 2 against 1 for a repeat); every scope ends with exactly one row.
#[tokio::test(flavor = "multi_thread")]
async fn the_same_result_in_another_scope_is_recorded_in_that_scope() {
    let (h, _bundle) = start_probe().await;
    answer_done(&h).await;
    let body = chat_result("call_scoped", r#""same""#);
    let x = |id: &str| chat_result(id, r#""x""#);
    // (what, the `Turnguard-Run` header, body, durable commits)
    let steps: Vec<(&str, Option<&str>, String, f64)> = vec![
        ("run-a, new", Some("run-a"), body.clone(), 2.0),
        ("run-a, again", Some("run-a"), body.clone(), 1.0),
        ("run-b, new", Some("run-b"), body.clone(), 2.0),
        ("chat, new", None, body.clone(), 1.0),
        ("chat, again", None, body.clone(), 0.0),
        ("run `chat`, new", Some("chat"), body.clone(), 2.0),
        ("run-b, again", Some("run-b"), body.clone(), 1.0),
        ("run-a, still", Some("run-a"), body.clone(), 1.0),
        ("run ab call c", Some("ab"), x("c"), 2.0),
        ("run a call bc", Some("a"), x("bc"), 2.0),
        ("run a call bc, again", Some("a"), x("bc"), 1.0),
    ];
    let mut got = Vec::new();
    for (i, (what, run, body, _)) in steps.iter().enumerate() {
        let headers: Vec<(&str, &str)> = run.iter().map(|r| ("turnguard-run", *r)).collect();
        // Each request a later turn (one more user message): the same transcript again in
        // the same run would be served from the record, with no decision of its own.
        let body = later(body, i);
        got.push((*what, commits_of(&h, CHAT, &headers, &body).await));
    }
    let want: Vec<(&str, f64)> = steps.iter().map(|s| (s.0, s.3)).collect();
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let scopes = |id: &str| -> Vec<String> { rows_of(&db, id).into_iter().map(|r| r.0).collect() };
    assert_eq!(
        (scopes("call_scoped"), scopes("c"), scopes("bc")),
        (
            vec![
                "run:run-a".to_owned(),
                "run:run-b".to_owned(),
                "chat".to_owned(),
                "run:chat".to_owned()
            ],
            vec!["run:ab".to_owned()],
            vec!["run:a".to_owned()]
        ),
        "one row in each scope"
    );
    assert_eq!(
        returned_of(&db, "call_scoped"),
        4,
        "one `agent.tool-returned` per scope"
    );
    assert_eq!(got, want, "durable commits per request");
}

/// Defect it would pin: the memory's key leaves out who sent a result, so one principal's
/// repeat of a result another principal sent is skipped. A skip is observable: the turn then
/// waits for no durable commit before it goes upstream. So an agent could time whether
/// someone else's tool returned a guessed content for a guessable call id. Each sender's
/// first sending of the result is submitted (one commit; the journal keeps the first row),
/// and only its own repeats are skipped.
#[tokio::test(flavor = "multi_thread")]
async fn a_result_another_principal_sent_is_not_skipped_for_this_one() {
    let (h, _keys) = support::approvals::start(30_000).await;
    answer_done(&h).await;
    let (alice, bob) = (
        support::approvals::agent_token("alice"),
        support::approvals::agent_token("bob"),
    );
    let body = chat_result("function:lookup", r#""balance 1200""#);
    // Each token's first presentation is journaled durably once: present both first.
    for token in [&alice, &bob] {
        let hello = later(&chat_results(&[]), 0);
        commits_of(&h, CHAT, &[("turnguard-principal-token", token)], &hello).await;
    }
    // (what, the token, durable commits)
    let steps: Vec<(&str, Option<&str>, f64)> = vec![
        ("alice, new", Some(&alice), 1.0),
        ("alice, again", Some(&alice), 0.0),
        ("bob, the same result", Some(&bob), 1.0),
        ("bob, again", Some(&bob), 0.0),
        ("no token, the same result", None, 1.0),
        ("alice, still", Some(&alice), 0.0),
    ];
    let mut got = Vec::new();
    for (i, (what, token, _)) in steps.iter().enumerate() {
        let headers: Vec<(&str, &str)> = token
            .iter()
            .map(|t| ("turnguard-principal-token", *t))
            .collect();
        got.push((
            *what,
            commits_of(&h, CHAT, &headers, &later(&body, i)).await,
        ));
    }
    let want: Vec<(&str, f64)> = steps.iter().map(|s| (s.0, s.2)).collect();
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    assert_eq!(
        rows_of(&db, "function:lookup").len(),
        1,
        "the journal keeps the first row"
    );
    assert_eq!(got, want, "durable commits per request");
}

/// Defect it would pin: after a restart the journal records a result a second time, or emits
/// a second `agent.tool-returned`, because the new process does not remember it (the memory
/// is per process; the journal's unique key must keep the first row); or a result changed
/// after the restart is not recorded. As documented, the restarted process writes the repeat
/// once more (one commit) and then remembers it.
#[tokio::test(flavor = "multi_thread")]
async fn after_a_restart_a_repeat_is_written_once_more_and_kept_once() {
    let (h, bundle) = start_probe().await;
    answer_done(&h).await;
    let body = chat_result("call_restart", r#""before""#);
    assert_eq!(commits_of(&h, CHAT, &[], &body).await, 1.0);
    assert_eq!(commits_of(&h, CHAT, &[], &body).await, 0.0);
    let dir = h.stop().await;
    let path = bundle.path().to_owned();
    let h = support::start_in(dir, Script::default(), move |c| c.policy = path).await;
    answer_done(&h).await;
    assert_eq!(
        commits_of(&h, CHAT, &[], &body).await,
        1.0,
        "a new process does not know the result: it is written again"
    );
    assert_eq!(
        commits_of(&h, CHAT, &[], &body).await,
        0.0,
        "then remembered"
    );
    let changed = chat_result("call_restart", r#""after""#);
    assert_eq!(commits_of(&h, CHAT, &[], &changed).await, 1.0);
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let texts: Vec<String> = rows_of(&db, "call_restart")
        .into_iter()
        .map(|r| r.1)
        .collect();
    assert_eq!(texts, [r#""before""#, r#""after""#]);
    assert_eq!(
        returned_of(&db, "call_restart"),
        2,
        "one `agent.tool-returned` per distinct result, none for the rewrite"
    );
}

/// Defect it would pin: a write call's result first sent in a request that failed at the
/// journal (503, a locked journal) is remembered although nothing was committed, so sent
/// again it is skipped: no `tool_results` row, its effect stays `claimed` for ever (and a
/// later attempt reads "dispatched, result not recorded"), no `agent.tool-returned`. Or,
/// recorded, the repeats that follow complete the effect again or emit more events.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_result_refused_with_the_journal_completes_its_effect_when_sent_again() {
    if support::sqlite_only(
        "a_write_result_refused_with_the_journal_completes_its_effect_when_sent_again",
    ) {
        return;
    }
    let h = start_run_bundle().await;
    let receipt = json!({"to": "a@example.test", "body": "paid"});
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-e0",
                vec![call("call_rcpt", "send_receipt", receipt)],
            ),
            answer_text("chatcmpl-e1", "Sent."),
            answer_text("chatcmpl-e2", "Nothing else."),
        ],
    )
    .await;
    let mut agent = Agent::new(&h, "run-seen-effect", "Send the receipt.");
    let r0 = agent.send().await;
    assert_eq!(r0.call_names(), ["send_receipt"], "{}", r0.text_body());
    agent.accept(&r0);
    assert_eq!(effect_states(&h, "run-seen-effect"), ["claimed"]);
    agent.result("call_rcpt", r#"{"sent":true}"#);

    let lock = rusqlite::Connection::open(h.journal()).unwrap();
    lock.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let refused = agent.send().await;
    assert_openwop_error(&refused, 503, "turnguard.journal_unavailable");
    lock.execute_batch("ROLLBACK").unwrap();
    drop(lock);
    assert_eq!(
        crate::faults::readyz_becomes(&h, 200, Duration::from_secs(10)).await,
        200,
        "the journal records again"
    );
    assert_eq!(
        effect_states(&h, "run-seen-effect"),
        ["claimed"],
        "nothing of the refused request was committed"
    );

    let ok = agent.send().await;
    assert_eq!(ok.status, 200, "{}", ok.text_body());
    assert_eq!(ok.text().as_deref(), Some("Sent."));
    assert_eq!(
        effect_states(&h, "run-seen-effect"),
        ["completed"],
        "the result sent again completes the effect"
    );
    agent.accept(&ok);
    agent.user("Anything else?");
    let again = agent.send().await;
    assert_eq!(again.text().as_deref(), Some("Nothing else."));
    assert_eq!(effect_states(&h, "run-seen-effect"), ["completed"]);
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    assert_eq!(rows_of(&db, "call_rcpt").len(), 1, "recorded once");
    assert_eq!(returned_of(&db, "call_rcpt"), 1, "returned once");
}

/// Defect it would pin: a result committed before upstream in a request whose upstream then
/// failed (503 passed through) is lost or counted twice: it must be in the journal with its
/// effect completed, and the agent's retry carrying it again (skipped) adds no row, no event.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_result_sent_with_a_failed_upstream_is_recorded_once() {
    let h = start_run_bundle().await;
    let receipt = json!({"to": "b@example.test", "body": "paid"});
    h.script(&json!({"responses": [
        {"json": answer_calls("chatcmpl-u0", vec![call("call_rcpt_u", "send_receipt", receipt)])},
        {"status": 503, "json": {"error": {"type": "overloaded_error", "message": "try later"}}},
        {"json": answer_text("chatcmpl-u1", "Sent.")}
    ]}))
    .await;
    let mut agent = Agent::new(&h, "run-seen-upstream", "Send the receipt.");
    let r0 = agent.send().await;
    assert_eq!(r0.call_names(), ["send_receipt"], "{}", r0.text_body());
    agent.accept(&r0);
    agent.result("call_rcpt_u", r#"{"sent":true}"#);
    let failed = agent.send().await;
    assert_eq!(failed.status, 503, "{}", failed.text_body());
    assert_eq!(
        effect_states(&h, "run-seen-upstream"),
        ["completed"],
        "the result was committed before upstream"
    );
    // The failed round's own record is journaled after its 503 is answered (a spawned
    // write): the baseline is taken once it has committed, or it would be counted as the
    // retry's.
    upstream_error_recorded(&h, "run-seen-upstream").await;
    let before = metric(&h, DURABLE).await;
    let retry = agent.send().await;
    assert_eq!(retry.status, 200, "{}", retry.text_body());
    assert_eq!(
        metric(&h, DURABLE).await - before,
        1.0,
        "the retry's result is skipped: only its decision commits"
    );
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    assert_eq!(rows_of(&db, "call_rcpt_u").len(), 1);
    assert_eq!(returned_of(&db, "call_rcpt_u"), 1);
}

/// Defect it would pin: a result of a re-runnable tool that the request let through without
/// recording it (a locked journal: "re-runnable results not journaled; going on", 200) is
/// remembered as recorded — the request *succeeded* — so it is never recorded when sent
/// again. Only a result the journal confirmed may be remembered.
#[tokio::test(flavor = "multi_thread")]
async fn a_result_let_through_unrecorded_is_recorded_when_sent_again() {
    if support::sqlite_only("a_result_let_through_unrecorded_is_recorded_when_sent_again") {
        return;
    }
    let h = start_run_bundle().await;
    h.script(
        &json!({"responses": [{"json": answer_text("chatcmpl-l", "Looked.")}], "repeat": true}),
    )
    .await;
    let body = json!({"model": "gpt-test", "tools": declared_tools(), "messages": [
        {"role": "user", "content": "Look up o-1."},
        {"role": "assistant", "content": null, "tool_calls": [call("call_look_l", "lookup_order", json!({"orderId": "o-1"}))]},
        {"role": "tool", "tool_call_id": "call_look_l", "content": "{\"status\":\"shipped\"}"}
    ]})
    .to_string();
    let lock = rusqlite::Connection::open(h.journal()).unwrap();
    lock.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let (status, _, resp) = post_raw(
        &format!("{}{CHAT}", h.url()),
        Bytes::from(body.clone()),
        &[],
    )
    .await;
    lock.execute_batch("ROLLBACK").unwrap();
    drop(lock);
    assert_eq!(
        status,
        200,
        "a re-runnable tool's result goes on unrecorded: {}",
        String::from_utf8_lossy(&resp)
    );
    assert_eq!(
        crate::faults::readyz_becomes(&h, 200, Duration::from_secs(10)).await,
        200,
        "the journal records again"
    );
    assert_eq!(
        commits_of(&h, CHAT, &[], &body).await,
        1.0,
        "sent again, the result is submitted"
    );
    assert_eq!(
        commits_of(&h, CHAT, &[], &body).await,
        0.0,
        "then remembered"
    );
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    assert_eq!(
        rows_of(&db, "call_look_l").len(),
        1,
        "recorded when sent again"
    );
    assert_eq!(returned_of(&db, "call_look_l"), 1);
}

/// Defect it would pin: the same result twice in one transcript (or a call id answered twice
/// with different contents, or the same new result in concurrent requests) panics, fails the
/// request, records a row twice or emits `agent.tool-returned` twice — or the second content
/// under one id is dropped as a duplicate of the first.
#[tokio::test(flavor = "multi_thread")]
async fn duplicates_in_one_request_and_across_concurrent_ones_are_recorded_once() {
    let (h, _bundle) = start_probe().await;
    answer_done(&h).await;
    let body = chat_results(&[
        ("call_dup_1", r#""same""#),
        ("call_dup_1", r#""same""#),
        ("call_dup_1", r#""other""#),
        ("call_dup_2", r#""same""#),
        ("call_dup_2", r#""same""#),
    ]);
    assert_eq!(commits_of(&h, CHAT, &[], &body).await, 1.0);
    assert_eq!(
        commits_of(&h, CHAT, &[], &body).await,
        0.0,
        "every result of the request is remembered"
    );
    let concurrent = chat_result("call_dup_3", r#""raced""#);
    let url = format!("{}{CHAT}", h.url());
    let sends: Vec<_> = (0..8)
        .map(|_| {
            let (url, body) = (url.clone(), Bytes::from(concurrent.clone()));
            tokio::spawn(async move { post_raw(&url, body, &[]).await.0 })
        })
        .collect();
    for s in sends {
        assert_eq!(s.await.unwrap(), 200);
    }
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let texts = |id: &str| -> Vec<String> { rows_of(&db, id).into_iter().map(|r| r.1).collect() };
    assert_eq!(texts("call_dup_1"), [r#""same""#, r#""other""#]);
    assert_eq!(texts("call_dup_2"), [r#""same""#]);
    assert_eq!(texts("call_dup_3"), [r#""raced""#]);
    assert_eq!(
        (
            returned_of(&db, "call_dup_1"),
            returned_of(&db, "call_dup_2"),
            returned_of(&db, "call_dup_3")
        ),
        (2, 1, 1)
    );
}

/// An Anthropic Messages transcript answering `lookup` call `id` with a `tool_result` whose
/// `content` is `raw` (omitted when `None`), plus `extra` fields on the block.
fn messages_result(id: &str, raw: Option<&str>, extra: &str) -> String {
    let content = raw
        .map(|r| format!(r#","content":{r}"#))
        .unwrap_or_default();
    format!(
        r#"{{"model":"claude-test","max_tokens":64,"tools":[{{"name":"lookup","input_schema":{{"type":"object"}}}}],
        "messages":[{{"role":"user","content":"go"}},
        {{"role":"assistant","content":[{{"type":"tool_use","id":"{id}","name":"lookup","input":{{}}}}]}},
        {{"role":"user","content":[{{"type":"tool_result","tool_use_id":"{id}"{content}{extra}}}]}}]}}"#
    )
}

/// A Responses request answering `lookup` call `id` with a `function_call_output` whose
/// `output` is `raw`.
fn responses_result(id: &str, raw: &str) -> String {
    format!(
        r#"{{"model":"gpt-5","tools":[{{"type":"function","name":"lookup","parameters":{{"type":"object"}}}}],
        "input":[{{"type":"message","role":"user","content":"go"}},
        {{"type":"function_call","call_id":"{id}","name":"lookup","arguments":"{{}}"}},
        {{"type":"function_call_output","call_id":"{id}","output":{raw}}}]}}"#
    )
}

/// A Responses request carrying a client tool search's output `tools` (raw JSON text).
fn tool_search_result(id: &str, tools: &str) -> String {
    format!(
        r#"{{"model":"gpt-5","input":[{{"type":"message","role":"user","content":"go"}},
        {{"type":"tool_search_output","execution":"client","call_id":"{id}","tools":{tools}}}]}}"#
    )
}

/// Defect it would pin: the Anthropic and Responses adapters hand the memory another value
/// than the one the journal's text is made of (or none), so there a repeat is written again,
/// or a changed `tool_result` / `function_call_output` / client `tool_search_output` (string
/// against content blocks, reordered block keys, reordered tool fields) is skipped; or two
/// `tool_result` blocks with one id and content in one request are recorded twice.
#[tokio::test(flavor = "multi_thread")]
async fn messages_and_responses_results_are_skipped_and_recorded_like_chat() {
    let (h, _bundle) = start_probe().await;
    answer_done(&h).await;
    const MSG: &str = "/v1/messages";
    const RESP: &str = "/v1/responses";
    let blocks = r#"[{"type":"text","text":"ok"}]"#;
    let dup = messages_result("toolu_dup", Some(r#""d""#), "").replace(
        r#""tool_use_id":"toolu_dup","content":"d"}"#,
        r#""tool_use_id":"toolu_dup","content":"d"},{"type":"tool_result","tool_use_id":"toolu_dup","content":"d"}"#,
    );
    let tools = r#"[{"type":"function","name":"lookup","parameters":{"type":"object"}}]"#;
    let tools_reordered = r#"[{"name":"lookup","type":"function","parameters":{"type":"object"}}]"#;
    let steps: Vec<(&str, &str, String, f64)> = vec![
        (
            "msg string",
            MSG,
            messages_result("toolu_1", Some(r#""ok""#), ""),
            1.0,
        ),
        (
            "msg string again",
            MSG,
            messages_result("toolu_1", Some(r#""ok""#), ""),
            0.0,
        ),
        (
            "msg blocks",
            MSG,
            messages_result("toolu_1", Some(blocks), ""),
            1.0,
        ),
        (
            "msg blocks, keys reordered",
            MSG,
            messages_result("toolu_1", Some(r#"[{"text":"ok","type":"text"}]"#), ""),
            1.0,
        ),
        (
            "msg blocks, escaped",
            MSG,
            messages_result("toolu_1", Some(r#"[{"type":"text","text":"\u006fk"}]"#), ""),
            0.0,
        ),
        (
            // The journal's unique key has no `is_error`: the same content is the same row.
            "msg string, is_error",
            MSG,
            messages_result("toolu_1", Some(r#""ok""#), r#","is_error":true"#),
            0.0,
        ),
        (
            "msg no content",
            MSG,
            messages_result("toolu_2", None, ""),
            1.0,
        ),
        (
            "msg null content",
            MSG,
            messages_result("toolu_2", Some("null"), ""),
            0.0,
        ),
        ("msg duplicate blocks", MSG, dup.clone(), 1.0),
        ("msg duplicate blocks again", MSG, dup, 0.0),
        (
            "resp string",
            RESP,
            responses_result("call_r1", r#""sunny""#),
            1.0,
        ),
        (
            "resp string again",
            RESP,
            responses_result("call_r1", r#""sunny""#),
            0.0,
        ),
        (
            "resp escaped",
            RESP,
            responses_result("call_r1", r#""\u0073unny""#),
            0.0,
        ),
        (
            "resp parts",
            RESP,
            responses_result("call_r1", r#"[{"type":"input_text","text":"sunny"}]"#),
            1.0,
        ),
        ("search", RESP, tool_search_result("ts_1", tools), 1.0),
        ("search again", RESP, tool_search_result("ts_1", tools), 0.0),
        (
            "search reordered",
            RESP,
            tool_search_result("ts_1", tools_reordered),
            1.0,
        ),
    ];
    let mut got = Vec::new();
    for (what, path, body, _) in &steps {
        got.push((*what, commits_of(&h, path, &[], body).await));
    }
    let want: Vec<(&str, f64)> = steps.iter().map(|s| (s.0, s.3)).collect();
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let texts = |id: &str| -> Vec<String> { rows_of(&db, id).into_iter().map(|r| r.1).collect() };
    assert_eq!(
        texts("toolu_1"),
        [
            r#""ok""#.to_owned(),
            blocks.to_owned(),
            r#"[{"text":"ok","type":"text"}]"#.to_owned()
        ]
    );
    assert_eq!(texts("toolu_2"), ["null"]);
    assert_eq!(texts("toolu_dup"), [r#""d""#]);
    assert_eq!(
        texts("call_r1"),
        [r#""sunny""#, r#"[{"type":"input_text","text":"sunny"}]"#]
    );
    assert_eq!(texts("ts_1"), [tools, tools_reordered]);
    assert_eq!(
        (returned_of(&db, "toolu_dup"), returned_of(&db, "ts_1")),
        (1, 2)
    );
    assert_eq!(got, want, "durable commits per request");
}

/// Sends `n` new results (`fill_<first + i>`, content `"r"`) in chat turns of at most 4,096.
async fn fill(h: &Harness, first: usize, n: usize) {
    let url = format!("{}{CHAT}", h.url());
    let mut sent = 0;
    while sent < n {
        let k = (n - sent).min(4096);
        let mut messages = vec![json!({"role": "user", "content": "go"}).to_string()];
        for i in first + sent..first + sent + k {
            messages.push(format!(
                r#"{{"role":"tool","tool_call_id":"fill_{i}","content":"r"}}"#
            ));
        }
        let body = format!(
            r#"{{"model":"gpt-test","messages":[{}]}}"#,
            messages.join(",")
        );
        let (status, _, resp) = post_raw(&url, Bytes::from(body), &[]).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
        sent += k;
    }
}

/// Defect it would pin: the memory of recorded results grows without bound (an agent sending
/// ever new results makes the process hold every key), or forgets too early. Documented
/// window: the last `GENERATION` to `2 × GENERATION` results. After `GENERATION` newer
/// results a result is still skipped; after `2 × GENERATION` it is not (the memory was
/// capped: it is written again), and the journal's unique key still keeps one row and one
/// `agent.tool-returned` for it.
#[tokio::test(flavor = "multi_thread")]
async fn the_memory_of_recorded_results_is_capped_at_two_generations() {
    let (h, _bundle) = start_probe().await;
    answer_done(&h).await;
    let probe = chat_result("call_window", r#""first""#);
    assert_eq!(commits_of(&h, CHAT, &[], &probe).await, 1.0);
    fill(&h, 0, GENERATION).await;
    assert_eq!(
        commits_of(&h, CHAT, &[], &probe).await,
        0.0,
        "still remembered after one generation of newer results"
    );
    fill(&h, GENERATION, GENERATION).await;
    assert_eq!(
        commits_of(&h, CHAT, &[], &probe).await,
        1.0,
        "forgotten after two generations: the memory is capped"
    );
    assert_eq!(
        commits_of(&h, CHAT, &[], &probe).await,
        0.0,
        "then remembered again"
    );
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    assert_eq!(rows_of(&db, "call_window").len(), 1);
    assert_eq!(returned_of(&db, "call_window"), 1);
    let filled: i64 = db
        .query_row(
            "SELECT count(*) FROM tool_results WHERE substr(tool_call_id, 1, 5) = 'fill_'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(filled, 2 * GENERATION as i64, "every filler recorded");
}
