//! The journal's chat-turn records (schema v16: a chat turn is one `rounds` row holding its
//! calls and its decision's events; the views `tool_calls` and `events` show both stores; v17:
//! a later result is timed from the writer's memory of recent releases, checked against the
//! round). Attackers: the model's output (call ids and
//! names it chooses, how many calls), the agent (its transcript's tool results, Responses
//! chains), tool content. The rule: the views show exactly what turnguard decided, once each,
//! byte for byte, with no secret in clear and keys that stay keys. Black-box over real
//! sockets; each test names the defect it pins.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};
use turnguard::mock_provider::Script;

use crate::support;
use support::runs::*;
use support::{post_raw, Harness};

/// Sends `body` as a chat turn (no `Turnguard-Run`) with `x-request-id: label`; returns the
/// status and body.
pub(super) async fn chat(h: &Harness, label: &str, body: &Value) -> (u16, Bytes) {
    let (status, _, bytes) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        Bytes::from(body.to_string()),
        &[("x-request-id", label)],
    )
    .await;
    (status, bytes)
}

/// Waits until a round the agent sent as `label` is in the journal (relaxed chat commits).
pub(super) fn wait_round(h: &Harness, label: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let db = support::journal(&h.journal());
        let n: i64 = db
            .query_row(
                "SELECT count(*) FROM rounds WHERE client_request_id = ?1",
                [label],
                |r| r.get(0),
            )
            .unwrap();
        if n > 0 || Instant::now() > deadline {
            return;
        }
        drop(db);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `turnguard_journal_write_failures_total` and `/readyz`'s status.
async fn journal_health(h: &Harness) -> (f64, u16) {
    let failures = support::approvals::metric(h, "turnguard_journal_write_failures_total").await;
    let (ready, _) = h.admin_get("/readyz").await;
    (failures, ready)
}

/// `(call_id, name, outcome)` of a round in the `tool_calls` view, in choice/ordinal order.
fn view_calls(db: &support::Db, key: &str) -> Vec<(String, String, String)> {
    let mut st = db
        .prepare(
            "SELECT call_id, name, outcome FROM tool_calls WHERE request_id = ?1
             ORDER BY choice, ordinal",
        )
        .unwrap();
    st.query_map([key], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// `(sequence, type, payload)` of the `events` view in scope `request:<key>`, by sequence.
fn view_events(db: &support::Db, key: &str) -> Vec<(i64, String, Value)> {
    let mut st = db
        .prepare(
            "SELECT sequence, type, payload FROM events WHERE scope = ?1 ORDER BY sequence, id",
        )
        .unwrap();
    st.query_map([format!("request:{key}")], |r| {
        let p: String = r.get(2)?;
        Ok((r.get(0)?, r.get(1)?, serde_json::from_str(&p).unwrap()))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// Sequences of one scope are 0, 1, 2, … with no repeat and no gap.
fn assert_dense(events: &[(i64, String, Value)], what: &str) {
    let seqs: Vec<i64> = events.iter().map(|e| e.0).collect();
    let want: Vec<i64> = (0..seqs.len() as i64).collect();
    assert_eq!(seqs, want, "{what}: sequences of the scope: {events:?}");
}

/// A bundle: every call permitted, up to 1 000 calls a turn, `lookup` a trusted read (so a
/// turn carrying its results stays trusted and its next calls are released).
fn probe_bundle() -> tempfile::TempDir {
    probe_bundle_with(true)
}

/// [`probe_bundle`]; with `end_turn` false, the default per-call outcomes (an invalid call
/// is repaired) instead of ending the turn.
pub(super) fn probe_bundle_with(end_turn: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("rules")).unwrap();
    std::fs::create_dir_all(dir.path().join("tools")).unwrap();
    std::fs::write(
        dir.path().join("rules/rules.cedar"),
        "@id(\"permit-calls\")\npermit (principal, action == Action::\"call\", resource);\n",
    )
    .unwrap();
    let limits = "[limits]\ntool_calls_per_turn = 1000\n\n[limits.rate]\nburst = 100000\nper_minute = 100000\n";
    let outcomes =
        "\n[outcomes]\ninvalid = \"end-turn\"\nrefused = \"end-turn\"\nheld = \"end-turn\"\n";
    std::fs::write(
        dir.path().join("turnguard.toml"),
        if end_turn {
            format!("{limits}{outcomes}")
        } else {
            limits.to_owned()
        },
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tools/probe.toml"),
        "[[tool]]\nnames = [\"lookup\"]\ncontent_trust = \"trusted\"\n[tool.descriptor]\ntoolId = \"probe:lookup\"\nsource = \"host-extension\"\nsafetyTier = \"read\"\negress = \"none\"\n",
    )
    .unwrap();
    dir
}

/// Starts turnguard on [`probe_bundle`] (the bundle's directory is kept alive by the caller).
pub(super) async fn start_probe() -> (Harness, tempfile::TempDir) {
    let bundle = probe_bundle();
    let path = bundle.path().to_owned();
    let h = support::start_with(Script::default(), move |c| c.policy = path).await;
    (h, bundle)
}

/// Chat tool declarations for `names` (no parameters schema beyond an object).
pub(super) fn tools_for<S: AsRef<str>>(names: &[S]) -> Value {
    Value::Array(
        names
            .iter()
            .map(|n| json!({"type": "function", "function": {"name": n.as_ref(), "parameters": {"type": "object"}}}))
            .collect(),
    )
}

/// Hostile call ids and names the model may emit: JSON-significant characters, unicode,
/// very long strings, and strings that look like the folded array's own JSON.
fn hostile(i: usize) -> (String, String) {
    let id = match i % 6 {
        0 => format!("call_\"q{i}\"\\b"),
        1 => format!("call_ü😀_{i}"),
        2 => format!("call_{i}\"}},{{\"call_id\":\"forged\",\"outcome\":\"executed\""),
        3 => format!("call_{i}_{}", "x".repeat(5_000)),
        4 => format!("call_{i}\n\t\r\u{7f}\u{2028}"),
        _ => format!("call_{i}"),
    };
    let name = match i % 5 {
        0 => format!("tool_\"{i}\"\\"),
        1 => format!("outil_é_{i}"),
        2 => format!("t{i}\"],\"name\":\"lookup"),
        3 => format!("t{i}_{}", "n".repeat(3_000)),
        _ => format!("tool_{i}"),
    };
    (id, name)
}

/// Defect it would pin: a chat turn's calls, folded into `rounds.calls` as one JSON array,
/// read back through the `tool_calls` view differently from what turnguard decided — a call
/// missing or duplicated, an id or name altered by JSON escaping (quotes, backslashes, control
/// characters, U+2028, astral unicode, text that imitates the array's own JSON), a long id cut —
/// or their `agent.tool-called` events (`rounds.events`) not one per call with dense sequences;
/// or a write failure losing the round; or the agent's results for those ids timed wrongly
/// (`durationMs` on a result whose call was never released, or missing on one that was: the
/// writer finds a release by a hash of the id and checks the round's JSON for it). 240 calls in
/// one answer (past any 1 024-style id stride of a smaller shift). Passes: the suite had no
/// chat-turn case with hostile ids/names or hundreds of calls.
#[tokio::test(flavor = "multi_thread")]
async fn a_chat_turns_hostile_calls_read_back_exactly_through_the_views() {
    let (h, _bundle) = start_probe().await;
    let n = 240;
    let sent: Vec<(String, String)> = (0..n).map(hostile).collect();
    let calls: Vec<Value> = sent
        .iter()
        .map(|(id, name)| call(id, name, json!({"k": "v\"}]"})))
        .collect();
    model_says(&h, &[answer_calls("chatcmpl-h", calls)]).await;
    let names: Vec<&str> = sent.iter().map(|(_, n)| n.as_str()).collect();
    let body = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "go"}],
        "tools": tools_for(&names)});
    let (status, bytes) = chat(&h, "hostile-1", &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    let released: Vec<String> = answer
        .pointer("/choices/0/message/tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    assert!(!released.is_empty(), "some calls are released: {answer}");
    wait_round(&h, "hostile-1");
    // The agent returns a result for every call the model emitted, and for calls no model
    // emitted (ids that differ from released ones in a byte, or imitate the folded JSON).
    let forged: Vec<(String, String)> = [
        "call_5 ".to_owned(),
        "call_\"q0\"\\B".to_owned(),
        "call_2\"},{\"call_id\":\"forged\",\"outcome\":\"executed\"}".to_owned(),
        "forged".to_owned(),
    ]
    .into_iter()
    .map(|id| (id, "lookup".to_owned()))
    .collect();
    let results: Vec<&(String, String)> = sent.iter().chain(&forged).collect();
    model_says(&h, &[answer_text("chatcmpl-h2", "done")]).await;
    let mut messages = vec![
        json!({"role": "user", "content": "go"}),
        json!({"role": "assistant", "content": null, "tool_calls": results
            .iter()
            .map(|(id, name)| call(id, name, json!({"k": "v\"}]"})))
            .collect::<Vec<_>>()}),
    ];
    for (id, _) in &results {
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": "ok"}));
    }
    let follow = json!({"model": "gpt-test", "messages": messages, "tools": tools_for(&names)});
    let (status, bytes) = chat(&h, "hostile-2", &follow).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    wait_round(&h, "hostile-2");
    let (failures, ready) = journal_health(&h).await;
    assert_eq!(failures, 0.0, "journal write failures");
    assert_eq!(ready, 200, "/readyz");
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let key = support::round_key(&db, "hostile-1");
    let got = view_calls(&db, &key);
    assert_eq!(got.len(), n, "one view row per call the model emitted");
    for (i, ((id, name, outcome), (want_id, want_name))) in got.iter().zip(&sent).enumerate() {
        assert_eq!(id, want_id, "call {i}: id as sent");
        assert_eq!(name, want_name, "call {i}: name as sent");
        let was_released = released.contains(want_id);
        assert_eq!(
            outcome == "executed",
            was_released,
            "call {i}: journaled outcome {outcome} vs released to the agent: {was_released}"
        );
    }
    // View ids are unique (a folded record: 2^62 + (rounds.id << 20) + place).
    let dup: i64 = db
        .query_row(
            "SELECT count(*) - count(DISTINCT id) FROM tool_calls",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(dup, 0, "tool_calls view ids repeat");
    let events = view_events(&db, &key);
    let called: Vec<&Value> = events
        .iter()
        .filter(|e| e.1 == "agent.tool-called")
        .map(|e| &e.2)
        .collect();
    assert_eq!(called.len(), n, "one agent.tool-called per call");
    // Each names its call, whether folded whole (hostile text) or as the call's position with
    // the view rebuilding the payload (schema step 18: plain ids and names).
    // (`toolName` is the name as a log label: `admission::sanitize_label`.)
    for (i, (payload, (id, _))) in called.iter().zip(&sent).enumerate() {
        assert_eq!(
            payload["callId"].as_str(),
            Some(id.as_str()),
            "event {i}: {payload}"
        );
        assert_eq!(payload["principal"], "agent", "event {i}: {payload}");
        assert!(payload["argsHash"].is_string(), "event {i}: {payload}");
    }
    assert_dense(&events, "hostile chat turn");
    // Each result is timed exactly when turnguard released its call.
    let returned = view_events(&db, &support::round_key(&db, "hostile-2"));
    let timed: Vec<(String, bool)> = returned
        .iter()
        .filter(|e| e.1 == "agent.tool-returned")
        .map(|e| {
            (
                e.2["callId"].as_str().unwrap().to_owned(),
                e.2.get("durationMs").is_some_and(Value::is_u64),
            )
        })
        .collect();
    let want: Vec<(String, bool)> = results
        .iter()
        .map(|(id, _)| (id.clone(), released.contains(id)))
        .collect();
    assert!(
        want.iter().any(|w| !w.1),
        "some results answer no released call"
    );
    assert_eq!(
        timed.len(),
        results.len(),
        "one agent.tool-returned per result"
    );
    for (i, (got, want)) in timed.iter().zip(&want).enumerate() {
        assert_eq!(got, want, "result {i}: (callId, has durationMs)");
    }
}

/// Defect it would pin: a U+0000 in a chat call's id or name (model output) is cut at the NUL
/// when the `tool_calls` view reads it out of `rounds.calls` (SQLite's `->>` on a JSON string
/// holding `\u0000`), so the journal shows a call `lookup` that the model never emitted where
/// it emitted `lookup\0evil`; a run's call (a table row) keeps the NUL
/// (`attacks::records::a_nul_in_a_name_does_not_cost_the_record_of_the_round`).
#[tokio::test(flavor = "multi_thread")]
async fn a_nul_in_a_chat_calls_id_or_name_reads_back_whole() {
    // PostgreSQL text cannot hold U+0000 (it keeps U+FFFD: `attacks::records::
    // a_nul_in_a_name_does_not_cost_the_record_of_the_round`) and keeps no `rounds.calls`.
    if support::sqlite_only("a_nul_in_a_chat_calls_id_or_name_reads_back_whole") {
        return;
    }
    let h = support::start(Script::default()).await;
    model_says(
        &h,
        &[answer_calls(
            "chatcmpl-nul",
            vec![call("call_a\u{0}tail", "lookup\u{0}evil", json!({}))],
        )],
    )
    .await;
    let body = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "go"}],
        "tools": tools_for(&["lookup\u{0}evil"])});
    let (status, bytes) = chat(&h, "nul-1", &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    let released_name = answer
        .pointer("/choices/0/message/tool_calls/0/function/name")
        .and_then(Value::as_str)
        .map(str::to_owned);
    wait_round(&h, "nul-1");
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let key = support::round_key(&db, "nul-1");
    let got = view_calls(&db, &key);
    assert_eq!(got.len(), 1, "{got:?}");
    let raw: String = db
        .query_row(
            "SELECT calls FROM rounds WHERE request_id = ?1",
            [key.as_str()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(
        (got[0].0.as_str(), got[0].1.as_str()),
        ("call_a\u{0}tail", "lookup\u{0}evil"),
        "the view shows another id/name than the model emitted (released to the agent as \
         {released_name:?}); rounds.calls holds {raw:?}"
    );
    // And the lookup a reader does by call id (`call_name`, `WHERE call_id = ?`) finds it.
    let n: i64 = db
        .query_row(
            "SELECT count(*) FROM tool_calls WHERE request_id = ?1 AND call_id = ?2",
            [key.as_str(), "call_a\u{0}tail"],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(n, 1, "a lookup by the emitted id finds the call");
    let n: i64 = db
        .query_row(
            "SELECT count(*) FROM tool_calls WHERE request_id = ?1 AND call_id = 'call_a'",
            [key.as_str()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(
        n, 0,
        "a lookup by an id the model never emitted finds a call"
    );
}

/// The SSE events of a Chat stream carrying `calls` (id, name, args), one chunk per call.
fn chat_sse_calls(calls: &[(&str, &str, Value)]) -> Vec<String> {
    let chunk = |delta: Value, finish: Value| {
        let v = json!({"id": "chatcmpl-st", "object": "chat.completion.chunk", "created": 1_782_955_817,
            "model": "gpt-test", "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]});
        format!("data: {v}")
    };
    let mut out = vec![chunk(
        json!({"role": "assistant", "content": null}),
        Value::Null,
    )];
    for (i, (id, name, args)) in calls.iter().enumerate() {
        out.push(chunk(
            json!({"tool_calls": [{"index": i, "id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}}]}),
            Value::Null,
        ));
    }
    out.push(chunk(json!({}), json!("tool_calls")));
    out.push("data: [DONE]".to_owned());
    out
}

/// Defect it would pin: a chat turn whose request carries tool results (their
/// `agent.tool-returned` events are rows, recorded before upstream) and whose answer has new
/// calls (their `agent.tool-called` events folded into `rounds.events`) numbers its scope's
/// events with a repeat or a gap, or reorders them; a stream (events journaled at its decision
/// point) likewise; and the results of calls an earlier chat turn released carry `durationMs`
/// (from the writer's memory of recent releases). Passes: the suite had no chat-turn case mixing row and
/// folded events in one scope, nor a check of `durationMs` on a chat turn.
#[tokio::test(flavor = "multi_thread")]
async fn chat_event_sequences_stay_dense_across_row_and_folded_events() {
    let (h, _bundle) = start_probe().await;
    let a1 = answer_calls(
        "chatcmpl-s1",
        vec![
            call("call_s1", "lookup", json!({"q": 1})),
            call("call_s2", "lookup", json!({"q": 2})),
        ],
    );
    let a2 = answer_calls(
        "chatcmpl-s2",
        vec![
            call("call_s3", "lookup", json!({"q": 3})),
            call("call_s4", "lookup", json!({"q": 4})),
        ],
    );
    let s3 = chat_sse_calls(&[
        ("call_s5", "lookup", json!({"q": 5})),
        ("call_s6", "lookup", json!({"q": 6})),
    ]);
    h.script(&json!({"responses": [{"json": a1}, {"json": a2}, {"sse": s3}]}))
        .await;
    let mut messages = vec![json!({"role": "user", "content": "go"})];
    let (status, bytes) = chat(
        &h,
        "seq-1",
        &json!({"model": "gpt-test", "messages": messages, "tools": tools_for(&["lookup"])}),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let r1: Value = serde_json::from_slice(&bytes).unwrap();
    messages.push(r1["choices"][0]["message"].clone());
    for id in ["call_s1", "call_s2"] {
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": "ok"}));
    }
    wait_round(&h, "seq-1");
    std::thread::sleep(Duration::from_millis(30));
    let (status, bytes) = chat(
        &h,
        "seq-2",
        &json!({"model": "gpt-test", "messages": messages, "tools": tools_for(&["lookup"])}),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let r2: Value = serde_json::from_slice(&bytes).unwrap();
    messages.push(r2["choices"][0]["message"].clone());
    for id in ["call_s3", "call_s4"] {
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": "ok"}));
    }
    wait_round(&h, "seq-2");
    std::thread::sleep(Duration::from_millis(30));
    let (status, bytes) = chat(
        &h,
        "seq-3",
        &json!({"model": "gpt-test", "messages": messages, "stream": true, "tools": tools_for(&["lookup"])}),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let streamed = support::sse_data(&bytes);
    assert!(
        streamed.iter().any(|d| d.to_string().contains("call_s6")),
        "stream released: {streamed:?}"
    );
    wait_round(&h, "seq-3");
    let (failures, _) = journal_health(&h).await;
    assert_eq!(failures, 0.0);
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    for (label, returned, called) in [
        ("seq-1", vec![], vec!["call_s1", "call_s2"]),
        (
            "seq-2",
            vec!["call_s1", "call_s2"],
            vec!["call_s3", "call_s4"],
        ),
        (
            "seq-3",
            vec!["call_s3", "call_s4"],
            vec!["call_s5", "call_s6"],
        ),
    ] {
        let key = support::round_key(&db, label);
        let events = view_events(&db, &key);
        assert_dense(&events, label);
        let kinds: Vec<(&str, &str)> = events
            .iter()
            .map(|e| (e.1.as_str(), e.2["callId"].as_str().unwrap_or("")))
            .collect();
        let mut want: Vec<(&str, &str)> = returned
            .iter()
            .map(|id| ("agent.tool-returned", *id))
            .collect();
        want.extend(called.iter().map(|id| ("agent.tool-called", *id)));
        assert_eq!(kinds, want, "{label}: events in order");
        for e in events.iter().filter(|e| e.1 == "agent.tool-returned") {
            assert!(
                e.2.get("durationMs").is_some_and(Value::is_u64),
                "{label}: the result of a call an earlier chat turn released has durationMs: {}",
                e.2
            );
        }
        // Event view ids unique too.
        let dup: i64 = db
            .query_row(
                "SELECT count(*) - count(DISTINCT id) FROM events",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(dup, 0, "events view ids repeat");
    }
}

/// Defect it would pin: a key the model puts into a chat turn's call names, arguments or text
/// — or one spelt so that it is whole only after JSON unescaping (`\u0073k-proj-…` in the
/// arguments) — reaches `rounds.calls` / `rounds.events` (or the WAL) in clear now that the
/// calls and events are folded JSON, with `journal_bodies = "all"` (arguments kept, redacted),
/// stream and non-stream. Passes: the suite's secret scans covered a run's rows and a chat
/// turn's ids/names in events, not the folded columns with arguments kept.
#[tokio::test(flavor = "multi_thread")]
async fn no_key_reaches_the_folded_chat_columns_in_clear() {
    let h = support::start_with(Script::default(), |c| {
        c.policy = support::own_fixtures().join("policy-run");
        c.journal_bodies = turnguard::config::JournalBodies::All;
    })
    .await;
    let in_name = "sk-proj-FNAMEaaaaaaaaaaaaaaaaaaaaaaa0041";
    let in_args = "sk-proj-FARGSbbbbbbbbbbbbbbbbbbbbbbb0042";
    let escaped_tail = "FESCcccccccccccccccccccccccc0043";
    let in_text = "AKIAQWERTYUIOPASDFGH";
    let in_stream = "sk-proj-FSTRMdddddddddddddddddddddddd0044";
    let mut a = answer_calls(
        "chatcmpl-f0",
        vec![
            call("call_f1", in_name, json!({})),
            call("call_f2", "lookup_order", json!({"orderId": in_args})),
            json!({"id": "call_f3", "type": "function", "function": {"name": "charge",
                "arguments": format!("{{\"chargeId\":\"ch-1\",\"amount\":1,\"note\":\"\\u0073k-proj-{escaped_tail}\"}}")}}),
        ],
    );
    a["choices"][0]["message"]["content"] = json!(format!("key {in_text}"));
    let s = chat_sse_calls(&[
        ("call_f4", in_stream, json!({})),
        ("call_f5", "lookup_order", json!({"orderId": in_stream})),
    ]);
    h.script(&json!({"responses": [{"json": a}, {"sse": s}]}))
        .await;
    let body = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "go"}],
        "tools": declared_tools()});
    let (status, bytes) = chat(&h, "key-1", &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (status, bytes) = chat(&h, "key-2", &sbody).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    wait_round(&h, "key-1");
    wait_round(&h, "key-2");
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    if db.backend() == support::Backend::Sqlite {
        let folded: i64 = db
            .query_row(
                "SELECT count(*) FROM rounds WHERE calls IS NOT NULL AND client_request_id IN ('key-1','key-2')",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(folded, 2, "both chat rounds hold their calls");
    }
    for needle in [in_name, in_args, escaped_tail, in_text, in_stream] {
        let holders = super::records::journal_holders(dir.path(), needle);
        assert!(holders.is_empty(), "{needle} in clear in {holders:?}");
    }
}

/// Defect it would pin: after a restart whose start-up prune removed aged chat rounds, a result
/// for a call of a pruned round is timed from a round that is gone (the writer's memory of
/// releases, loaded at start before the prune, still names it), or a result for a call of a
/// kept round loses `durationMs` (the memory was not loaded from the journal). Drives the prune
/// turnguard runs at start over a journal whose first two chat rounds were aged past retention
/// while stopped. Passes: the suite had no prune case over a server's chat rounds.
#[tokio::test(flavor = "multi_thread")]
async fn a_restart_and_prune_time_only_the_results_of_kept_releases() {
    // About the SQLite layout of schema v16–17 (PostgreSQL keeps one row per call and event).
    if support::sqlite_only("a_restart_and_prune_time_only_the_results_of_kept_releases") {
        return;
    }
    let h = support::start(Script::default()).await;
    model_says(
        &h,
        &[
            answer_calls("c-p1", vec![call("call_p1", "lookup", json!({}))]),
            answer_calls("c-p2", vec![call("call_p2", "lookup", json!({}))]),
            answer_calls("c-p3", vec![call("call_p3", "lookup", json!({}))]),
        ],
    )
    .await;
    for label in ["prune-1", "prune-2", "prune-3"] {
        let body = json!({"model": "gpt-test", "messages": [{"role": "user", "content": label}],
            "tools": tools_for(&["lookup"])});
        let (status, bytes) = chat(&h, label, &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        wait_round(&h, label);
    }
    let dir = h.stop().await;
    {
        let db = support::Db::open_rw(&dir.path().join("journal.db"));
        let old = 40_i64 * 86_400_000;
        db.execute(
            "UPDATE rounds SET at_ms = at_ms - ?1 WHERE client_request_id IN ('prune-1', 'prune-2')",
            [old],
        )
        .unwrap();
        let n: i64 = db
            .query_row(
                "SELECT count(*) FROM rounds WHERE calls IS NOT NULL",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(n, 3);
    }
    // Restart: the prune runs once at start (retention 30 days by default).
    let h = support::start_in(dir, Script::default(), |_| {}).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let db = support::journal(&h.journal());
        let n: i64 = db
            .query_row("SELECT count(*) FROM rounds", [], |r| r.get(0))
            .unwrap();
        if n == 1 || Instant::now() > deadline {
            break;
        }
        drop(db);
        std::thread::sleep(Duration::from_millis(50));
    }
    // Results for the pruned call and the kept one (a new chat turn).
    model_says(&h, &[answer_text("c-p4", "done")]).await;
    let body = json!({"model": "gpt-test", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": null, "tool_calls": [
            call("call_p1", "lookup", json!({})), call("call_p3", "lookup", json!({}))]},
        {"role": "tool", "tool_call_id": "call_p1", "content": "ok"},
        {"role": "tool", "tool_call_id": "call_p3", "content": "ok"}],
        "tools": tools_for(&["lookup"])});
    let (status, bytes) = chat(&h, "prune-4", &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    wait_round(&h, "prune-4");
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let rounds: Vec<String> = db.column("SELECT client_request_id FROM rounds ORDER BY id");
    assert_eq!(rounds, ["prune-3", "prune-4"], "the aged rounds are pruned");
    let tables: i64 = db
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE name LIKE 'chat_released%'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(tables, 0, "no chat_released (schema step 17)");
    let calls: Vec<String> = db.column("SELECT call_id FROM tool_calls ORDER BY id");
    assert_eq!(calls, ["call_p3"]);
    let key = support::round_key(&db, "prune-4");
    let events = view_events(&db, &key);
    let dur: Vec<(String, bool)> = events
        .iter()
        .filter(|e| e.1 == "agent.tool-returned")
        .map(|e| {
            (
                e.2["callId"].as_str().unwrap().to_owned(),
                e.2.get("durationMs").is_some(),
            )
        })
        .collect();
    assert_eq!(
        dur,
        [("call_p1".to_owned(), false), ("call_p3".to_owned(), true)],
        "durationMs only for the call whose releasing round is kept"
    );
}

/// A Responses `function_call` item.
fn fcall(call_id: &str, name: &str, args: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_{}", call_id.len()), "call_id": call_id,
           "name": name, "arguments": args, "status": "completed"})
}

/// A stored Responses response with `output`.
pub(super) fn response(id: &str, output: Vec<Value>) -> Value {
    json!({
        "id": id, "object": "response", "created_at": 1_761_400_000, "status": "completed",
        "error": null, "incomplete_details": null, "model": "gpt-5-2025-08-07", "output": output,
        "parallel_tool_calls": true, "previous_response_id": null, "store": true,
        "usage": {"input_tokens": 80, "output_tokens": 24, "total_tokens": 104}
    })
}

/// Defect it would pin: a Responses turn that continues a stored response with a
/// `function_call_output` takes the tool name of the answered call from the `tool_calls` view
/// (`call_name`); for a chat turn that name now comes out of `rounds.calls` JSON, and a call id
/// holding JSON-significant characters, unicode or U+0000 would then not be found (the
/// trusted read's result untrusted, the following write held) — or an id the model never
/// emitted (the prefix before a U+0000) would be found. Bundle `policy-order`: `get_weather`
/// a trusted read, `wire_money` a write held in an untrusted turn. Passes: the suite's chain
/// test used plain ids only.
#[tokio::test(flavor = "multi_thread")]
async fn a_responses_result_is_named_from_a_folded_call_with_a_hostile_id() {
    let h = support::start_with_policy(Script::default(), "policy-order").await;
    // U+0000 only on SQLite: PostgreSQL text keeps it as U+FFFD, so an id holding one is
    // not found again there and the result stays unnamed (untrusted, fail closed).
    let nul = if support::db::backend() == support::Backend::Sqlite {
        "\u{0}"
    } else {
        ""
    };
    let weird = format!("call_\"w\"\\ü😀\u{2028}{nul}{}", "z".repeat(2_000));
    let pay = |id: &str| fcall(id, "wire_money", r#"{"amount": 50, "to": "DE89"}"#);
    h.script(&json!({"responses": [
        {"json": response("resp_h1", vec![fcall(&weird, "get_weather", r#"{"location": "Paris"}"#)])},
        {"json": response("resp_h2", vec![pay("call_pay_ok")])},
        {"json": response("resp_h3", vec![fcall(&weird, "get_weather", r#"{"location": "Paris"}"#)])},
        {"json": response("resp_h4", vec![pay("call_pay_prefix")])},
    ]}))
    .await;
    let tools = json!([
        {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}, "strict": false},
        {"type": "function", "name": "wire_money", "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "to": {"type": "string"}}, "required": ["amount", "to"]}, "strict": false},
    ]);
    let send = |body: Value, label: &'static str| {
        let url = format!("{}/v1/responses", h.url());
        async move {
            let (status, _, bytes) = post_raw(
                &url,
                Bytes::from(body.to_string()),
                &[("x-request-id", label)],
            )
            .await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
            serde_json::from_slice::<Value>(&bytes).unwrap()
        }
    };
    let released = |v: &Value| -> Vec<String> {
        v["output"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|o| o["type"] == "function_call")
            .map(|o| o["call_id"].as_str().unwrap().to_owned())
            .collect()
    };
    // 1: the model calls the trusted read with a hostile id.
    let r1 = send(
        json!({"model": "gpt-5", "input": "Weather?", "tools": tools}),
        "resp-h1",
    )
    .await;
    assert_eq!(released(&r1), std::slice::from_ref(&weird));
    wait_round(&h, "resp-h1");
    // 2: its result, by the same id: named get_weather (trusted), so the write is released.
    let r2 = send(
        json!({"model": "gpt-5", "previous_response_id": "resp_h1", "tools": tools,
               "input": [{"type": "function_call_output", "call_id": weird, "output": "sunny"}]}),
        "resp-h2",
    )
    .await;
    assert_eq!(
        released(&r2),
        ["call_pay_ok"],
        "the read's result is named from the folded call: {r2}"
    );
    if nul.is_empty() {
        return;
    }
    // 3, 4 (SQLite): the same call again; the result answers an id the model never emitted
    // (the prefix before the U+0000): no name, untrusted, the write held.
    let r3 = send(
        json!({"model": "gpt-5", "input": "Weather again?", "tools": tools}),
        "resp-h3",
    )
    .await;
    assert_eq!(released(&r3), std::slice::from_ref(&weird));
    wait_round(&h, "resp-h3");
    let prefix = weird.split('\u{0}').next().unwrap().to_owned();
    let r4 = send(
        json!({"model": "gpt-5", "previous_response_id": "resp_h3", "tools": tools,
               "input": [{"type": "function_call_output", "call_id": prefix, "output": "sunny"}]}),
        "resp-h4",
    )
    .await;
    assert!(
        released(&r4).is_empty(),
        "a result for an id the model never emitted took a journaled call's name: {r4}"
    );
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let names: Vec<Option<String>> = db.column("SELECT tool_name FROM tool_results ORDER BY id");
    assert_eq!(names, [Some("get_weather".to_owned()), None]);
}

/// Defect it pins (found on c30dd43): the views' `id` was not unique across the two stores. A
/// folded record's id was `(rounds.id << 20) + place`, but `tool_call_rows.id` / `event_rows.id` are plain
/// rowids that keep growing over the journal's life (`max(id) + 1`, the prune deletes a
/// prefix): once a journal has written 2^20 run calls (or run/row events), a run's new rows take
/// the ids of the first chat round's folded calls and events, so `tool_calls.id` and
/// `events.id` — the tables' former primary keys — name two records. The million earlier rows
/// are stood in for by one row at id 2^20 - 1 written while turnguard is stopped.
#[tokio::test(flavor = "multi_thread")]
async fn view_ids_stay_unique_once_the_row_tables_pass_two_to_the_twenty() {
    // About the SQLite layout of schema v16 (PostgreSQL keeps one row per call and event).
    if support::sqlite_only("view_ids_stay_unique_once_the_row_tables_pass_two_to_the_twenty") {
        return;
    }
    let (h, bundle) = start_probe().await;
    model_says(
        &h,
        &[answer_calls(
            "c-u1",
            vec![
                call("call_u1", "lookup", json!({})),
                call("call_u2", "lookup", json!({})),
            ],
        )],
    )
    .await;
    let body = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "go"}],
        "tools": tools_for(&["lookup"])});
    let (status, bytes) = chat(&h, "ids-1", &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    wait_round(&h, "ids-1");
    let dir = h.stop().await;
    {
        let db = support::Db::open_rw(&dir.path().join("journal.db"));
        let first_round: i64 = db
            .query_row("SELECT min(id) FROM rounds", [], |r| r.get(0))
            .unwrap();
        assert_eq!(first_round, 1);
        let below = (1_i64 << 20) - 1;
        db.execute(
            "INSERT INTO rounds (request_id, at_ms, api, stream, round_index, request_digest,
                latency_ms, state, response_bytes, response_digest, response_truncated, run_id)
             SELECT 'older-run-round', at_ms, 'openai_chat', 0, 0, 'd', 1, 'ok', 0, 'x', 0, 'older'
               FROM rounds WHERE id = 1",
            [],
        )
        .unwrap();
        db.execute(
            "INSERT INTO tool_call_rows (id, request_id, choice, ordinal, call_id, name, outcome, stage, reason)
             VALUES (?1, 'older-run-round', 0, 0, 'call_old', 'lookup', 'executed', 'dispatch', 'released')",
            [below],
        )
        .unwrap();
        db.execute(
            "INSERT INTO event_rows (id, scope, request_id, sequence, type, payload, at_ms)
             SELECT ?1, 'run:older', 'older-run-round', 0, 'agent.tool-called', '{}', at_ms
               FROM rounds WHERE id = 1",
            [below],
        )
        .unwrap();
    }
    let path = bundle.path().to_owned();
    let h = support::start_in(dir, Script::default(), move |c| c.policy = path).await;
    model_says(
        &h,
        &[answer_calls(
            "c-u2",
            vec![
                call("call_r1", "lookup_order", json!({"orderId": "o"})),
                call("call_r2", "lookup_order", json!({"orderId": "p"})),
            ],
        )],
    )
    .await;
    let r = Agent::new(&h, "run-ids", "go").send().await;
    assert_eq!(r.status, 200, "{}", r.text_body());
    assert_eq!(r.calls().len(), 2, "{}", r.text_body());
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let dups: Vec<(&str, Vec<i64>)> = ["tool_calls", "events"]
        .into_iter()
        .map(|view| {
            (
                view,
                db.column(&format!(
                    "SELECT id FROM {view} GROUP BY id HAVING count(*) > 1 ORDER BY id"
                )),
            )
        })
        .collect();
    assert!(
        dups.iter().all(|(_, d)| d.is_empty()),
        "view ids naming two records: {dups:?}; events: {:?}",
        db.column::<String>("SELECT id || ' ' || scope || ' ' || type FROM events ORDER BY id")
    );
}
