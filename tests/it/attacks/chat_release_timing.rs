//! A chat result's `durationMs` (journal schema v17: the SQLite writer's memory of recent chat
//! releases, `journal::released`). Attackers: the agent (which results it sends, how many,
//! for which ids), the model (its call ids and how much it pads a round). Black-box over real
//! sockets; each test names the defect it pins.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use turnguard::mock_provider::Script;

use super::journal_views::{chat, probe_bundle_with, response, start_probe, tools_for, wait_round};
use crate::support;
use support::runs::*;
use support::{post_raw, Harness};

async fn post(h: &Harness, path: &str, label: &str, body: &Value) -> (u16, Bytes) {
    let (status, _, bytes) = post_raw(
        &format!("{}{path}", h.url()),
        Bytes::from(body.to_string()),
        &[("x-request-id", label)],
    )
    .await;
    (status, bytes)
}

/// `(callId, durationMs)` of every `agent.tool-returned` in the journal, in id order.
fn returned(db: &support::Db) -> Vec<(String, Option<i64>)> {
    let mut st = db
        .prepare("SELECT payload FROM events WHERE type = 'agent.tool-returned' ORDER BY at_ms, id")
        .unwrap();
    st.query_map([], |r| {
        let p: String = r.get(0)?;
        let v: Value = serde_json::from_str(&p).unwrap();
        Ok((
            v["callId"].as_str().unwrap_or("").to_owned(),
            v.get("durationMs").and_then(Value::as_i64),
        ))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

fn duration_of(db: &support::Db, id: &str) -> Vec<Option<i64>> {
    returned(db)
        .into_iter()
        .filter(|(c, _)| c == id)
        .map(|(_, d)| d)
        .collect()
}

/// A chat follow-up carrying results for `ids` (the assistant message names them).
fn follow_up(ids: &[&str], content: &str) -> Value {
    let mut messages = vec![
        json!({"role": "user", "content": "go"}),
        json!({"role": "assistant", "content": null, "tool_calls": ids
            .iter()
            .map(|id| call(id, "lookup", json!({})))
            .collect::<Vec<_>>()}),
    ];
    for id in ids {
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
    }
    json!({"model": "gpt-test", "messages": messages, "tools": tools_for(&["lookup"])})
}

/// Defect it would pin: a call released only in a run (`Turnguard-Run`) times a later
/// *chat* result for the same id (the chat memory must hold chat releases only), or a call
/// released in a chat turn times a *run*'s result for the same id.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_release_never_times_a_chat_result_nor_the_reverse() {
    if support::sqlite_only("a_run_release_never_times_a_chat_result_nor_the_reverse") {
        return;
    }
    let (h, _b) = start_probe().await;
    model_says(
        &h,
        &[
            answer_calls("c-r1", vec![call("call_runonly", "lookup", json!({}))]),
            answer_calls("c-r2", vec![call("call_chatonly", "lookup", json!({}))]),
            answer_text("c-r3", "done"),
            answer_text("c-r4", "done"),
        ],
    )
    .await;
    let mut agent = Agent::new(&h, "run-v17", "go");
    agent.messages = vec![json!({"role": "user", "content": "go"})];
    let r = agent
        .send_body(&json!({"model": "gpt-test", "messages": agent.messages, "tools": tools_for(&["lookup"])}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text_body());
    assert_eq!(r.calls().len(), 1, "{}", r.text_body());
    let (s, b) = chat(
        &h,
        "rc-1",
        &json!({"model": "gpt-test", "messages": [{"role": "user", "content": "go"}], "tools": tools_for(&["lookup"])}),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    wait_round(&h, "rc-1");
    // Chat result for the run's call.
    let (s, b) = chat(&h, "rc-2", &follow_up(&["call_runonly"], "ok")).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    // Run result for the chat's call.
    agent.accept(&r);
    agent.messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call("call_chatonly", "lookup", json!({}))]}));
    agent.result("call_chatonly", "ok");
    let r2 = agent
        .send_body(&json!({"model": "gpt-test", "messages": agent.messages, "tools": tools_for(&["lookup"])}))
        .await;
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    assert_eq!(
        duration_of(&db, "call_runonly"),
        [None],
        "a chat result timed from a run's release; run reply {}",
        r2.text_body()
    );
    let chat_only = duration_of(&db, "call_chatonly");
    assert!(
        chat_only.iter().all(Option::is_none),
        "a run result timed from a chat release: {chat_only:?}"
    );
}

/// Defect it would pin: a call the chat turn did NOT release to the agent carries `durationMs`
/// on its result: an invalid call (undeclared tool) next to a valid one, default outcomes
/// (`invalid` = repair): the first round is journaled as `repaired` with the valid call
/// `executed`, and the repair round's answer (text only) is what the agent receives. The valid
/// call's result must be timed only if the agent actually received that call.
#[tokio::test(flavor = "multi_thread")]
async fn only_the_released_call_of_a_chat_round_is_timed() {
    let bundle = probe_bundle_with(false);
    let path = bundle.path().to_owned();
    let h = support::start_with(Script::default(), move |c| c.policy = path).await;
    model_says(
        &h,
        &[
            answer_calls(
                "c-o1",
                vec![
                    call("call_ok", "lookup", json!({})),
                    call("call_bad", "not_declared_tool", json!({})),
                ],
            ),
            answer_text("c-o-repair", "repaired: no call"),
            answer_text("c-o2", "done"),
        ],
    )
    .await;
    let (s, b) = chat(
        &h,
        "o-1",
        &json!({"model": "gpt-test", "messages": [{"role": "user", "content": "go"}], "tools": tools_for(&["lookup"])}),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let to_agent = String::from_utf8_lossy(&b).into_owned();
    let ok_reached_agent = to_agent.contains("call_ok");
    wait_round(&h, "o-1");
    let (s, b) = chat(&h, "o-2", &follow_up(&["call_ok", "call_bad"], "ok")).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let outcomes: Vec<String> =
        db.column("SELECT call_id || '=' || outcome FROM tool_calls ORDER BY id");
    assert!(
        outcomes
            .iter()
            .any(|o| o.starts_with("call_bad=") && o != "call_bad=executed"),
        "{outcomes:?}"
    );
    // `rounds.calls` is SQLite's (PostgreSQL keeps call rows): the state only, on both.
    let rounds: Vec<String> =
        db.column("SELECT client_request_id || ' ' || state FROM rounds ORDER BY id");
    assert_eq!(
        duration_of(&db, "call_ok").iter().any(Option::is_some),
        ok_reached_agent,
        "durationMs on call_ok vs call_ok released to the agent ({ok_reached_agent}); rounds {rounds:?}; events {:?}",
        returned(&db)
    );
    assert!(
        duration_of(&db, "call_bad").iter().all(Option::is_none),
        "{:?}",
        returned(&db)
    );
}

/// Defect it would pin: the same call id released by two chat turns is timed from the first
/// (older) round rather than the later one; durationMs must be exactly
/// `result.at_ms - later_round.at_ms`.
#[tokio::test(flavor = "multi_thread")]
async fn an_id_released_twice_is_timed_from_the_later_round() {
    if support::sqlite_only("an_id_released_twice_is_timed_from_the_later_round") {
        return;
    }
    let (h, _b) = start_probe().await;
    model_says(
        &h,
        &[
            answer_calls("c-t1", vec![call("call_twice", "lookup", json!({}))]),
            answer_calls("c-t2", vec![call("call_twice", "lookup", json!({}))]),
            answer_text("c-t3", "done"),
        ],
    )
    .await;
    for label in ["tw-1", "tw-2"] {
        let (s, b) = chat(
            &h,
            label,
            &json!({"model": "gpt-test", "messages": [{"role": "user", "content": label}], "tools": tools_for(&["lookup"])}),
        )
        .await;
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        wait_round(&h, label);
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let (s, b) = chat(&h, "tw-3", &follow_up(&["call_twice"], "ok")).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let at: Vec<i64> = db.column("SELECT at_ms FROM rounds ORDER BY id");
    let res_at: Vec<i64> =
        db.column("SELECT at_ms FROM tool_results WHERE tool_call_id = 'call_twice'");
    assert_eq!(res_at.len(), 1);
    assert_eq!(
        duration_of(&db, "call_twice"),
        [Some(res_at[0] - at[1])],
        "rounds at {at:?}, result at {res_at:?}"
    );
}

/// Defect it would pin: a Responses `function_call` (keyed by `call_id`, not the item `id`)
/// or an Anthropic `tool_use` released in a chat turn is not timed when its
/// `function_call_output` / `tool_result` comes back; or a result naming the Responses item
/// `id` (`fc_…`) instead of `call_id` is timed.
#[tokio::test(flavor = "multi_thread")]
async fn responses_and_messages_results_are_timed_by_their_call_ids() {
    let (h, _b) = start_probe().await;
    let fc = json!({"type": "function_call", "id": "fc_item1", "call_id": "call_resp1",
        "name": "lookup", "arguments": "{}", "status": "completed"});
    let msg = json!({"id": "msg_01", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "tool_use", "id": "toolu_01", "name": "lookup", "input": {}}],
        "stop_reason": "tool_use", "stop_sequence": null,
        "usage": {"input_tokens": 5, "output_tokens": 5}});
    let msg_done = json!({"id": "msg_02", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "text", "text": "done"}], "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": 5, "output_tokens": 5}});
    h.script(&json!({"responses": [
        {"json": response("resp_v1", vec![fc])},
        {"json": response("resp_v2", vec![json!({"type": "message", "id": "msg_x", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "done", "annotations": []}]})])},
        {"json": msg},
        {"json": msg_done},
    ]}))
    .await;
    let rtools = json!([{"type": "function", "name": "lookup", "parameters": {"type": "object"}, "strict": false}]);
    let (s, b) = post(
        &h,
        "/v1/responses",
        "rv-1",
        &json!({"model": "gpt-5", "input": "go", "tools": rtools}),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("call_resp1"));
    wait_round(&h, "rv-1");
    let (s, b) = post(
        &h,
        "/v1/responses",
        "rv-2",
        &json!({"model": "gpt-5", "previous_response_id": "resp_v1", "tools": rtools,
            "input": [{"type": "function_call_output", "call_id": "call_resp1", "output": "sunny"},
                      {"type": "function_call_output", "call_id": "fc_item1", "output": "sunny"}]}),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let atools =
        json!([{"name": "lookup", "description": "d", "input_schema": {"type": "object"}}]);
    let (s, b) = post(
        &h,
        "/v1/messages",
        "am-1",
        &json!({"model": "claude-test", "max_tokens": 64, "tools": atools,
            "messages": [{"role": "user", "content": "go"}]}),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("toolu_01"));
    wait_round(&h, "am-1");
    let (s, b) = post(
        &h,
        "/v1/messages",
        "am-2",
        &json!({"model": "claude-test", "max_tokens": 64, "tools": atools,
            "messages": [{"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "lookup", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "ok"}]}]}),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let all = returned(&db);
    let d = |id: &str| duration_of(&db, id);
    assert!(
        matches!(d("call_resp1").as_slice(), [Some(_)]),
        "Responses result not timed: {all:?}"
    );
    assert!(
        d("fc_item1").iter().all(Option::is_none),
        "item id timed: {all:?}"
    );
    assert!(
        matches!(d("toolu_01").as_slice(), [Some(_)]),
        "Messages result not timed: {all:?}"
    );
}

/// Defect it would pin: a call released by a *streamed* chat turn is not timed when its result
/// comes back (the existing tests time only results of JSON-released calls); also a U+0000 in
/// the id: the whole id is timed, and the prefix before the NUL (never released) is not.
#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_release_and_a_nul_id_are_timed_exactly() {
    if support::sqlite_only("a_streamed_release_and_a_nul_id_are_timed_exactly") {
        return;
    }
    let (h, _b) = start_probe().await;
    let nul_id = "call_n\u{0}tail";
    h.script(&json!({"responses": [
        {"sse": chat_sse_call("call_stream1", "lookup", &json!({}))},
        {"json": answer_calls("c-n1", vec![call(nul_id, "lookup", json!({}))])},
        {"json": answer_text("c-n2", "done")},
    ]}))
    .await;
    let (s, b) = chat(
        &h,
        "st-1",
        &json!({"model": "gpt-test", "stream": true, "messages": [{"role": "user", "content": "go"}], "tools": tools_for(&["lookup"])}),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("call_stream1"));
    wait_round(&h, "st-1");
    let (s, b) = chat(
        &h,
        "st-2",
        &json!({"model": "gpt-test", "messages": [{"role": "user", "content": "go"}], "tools": tools_for(&["lookup"])}),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    wait_round(&h, "st-2");
    let (s, b) = chat(
        &h,
        "st-3",
        &follow_up(&["call_stream1", nul_id, "call_n"], "ok"),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let all = returned(&db);
    assert!(
        matches!(duration_of(&db, "call_stream1").as_slice(), [Some(_)]),
        "{all:?}"
    );
    assert!(
        matches!(duration_of(&db, nul_id).as_slice(), [Some(_)]),
        "{all:?}"
    );
    assert_eq!(duration_of(&db, "call_n"), [None], "{all:?}");
}

/// Defect it would pin: results for a round of many long-id calls timed wrongly — a result
/// for a released id untimed, or one for an id that differs from a released one only after
/// its first 3,000 bytes timed. Before this session's fix the writer also parsed the whole round's
/// `rounds.calls` (~2.6 MB here) for each of the 800 results; it now reads the round's first
/// columns by rowid (`journal::released`'s plan test pins that).
#[tokio::test(flavor = "multi_thread")]
async fn results_for_a_big_rounds_calls_are_timed_exactly() {
    if support::sqlite_only("results_for_a_big_rounds_calls_are_timed_exactly") {
        return;
    }
    let (h, _b) = start_probe().await;
    let n = 800;
    let ids: Vec<String> = (0..n)
        .map(|i| format!("call_{i:04}_{}", "x".repeat(3_000)))
        .collect();
    let miss: Vec<String> = (0..n)
        .map(|i| format!("call_{i:04}_{}", "y".repeat(3_000)))
        .collect();
    model_says(
        &h,
        &[
            answer_calls(
                "c-big",
                ids.iter().map(|id| call(id, "lookup", json!({}))).collect(),
            ),
            answer_text("c-miss", "done"),
            answer_text("c-hit", "done"),
        ],
    )
    .await;
    let (s, b) = chat(
        &h,
        "big-1",
        &json!({"model": "gpt-test", "messages": [{"role": "user", "content": "go"}], "tools": tools_for(&["lookup"])}),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    wait_round(&h, "big-1");
    let (s, b) = chat(&h, "big-miss", &follow_up(&refs(&miss), "ok")).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    wait_round(&h, "big-miss");
    let (s, b) = chat(&h, "big-hit", &follow_up(&refs(&ids), "ok")).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    wait_round(&h, "big-hit");
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let all = returned(&db);
    let timed: Vec<&str> = all
        .iter()
        .filter(|(_, d)| d.is_some())
        .map(|(id, _)| id.as_str())
        .collect();
    assert_eq!(all.len(), 2 * n, "one agent.tool-returned per result");
    assert_eq!(
        timed,
        refs(&ids),
        "exactly the released calls' results are timed"
    );
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Defect it would pin: one released id sent back many times (distinct contents, so each is a
/// new result) against a round the model padded to ~9 MB of calls: each result must be timed
/// from that round, and a near-identical unknown id never. Before this session's fix each
/// lookup parsed the whole round's `rounds.calls` in the single writer thread — 1,000
/// results stalled every other request's commit for seconds (6.7 s against 0.4 s for unknown
/// ids, debug build); a lookup now reads the round's first columns by rowid
/// (`journal::released`'s plan test).
#[tokio::test(flavor = "multi_thread")]
async fn one_released_id_sent_back_many_times_is_timed_each_time() {
    if support::sqlite_only("one_released_id_sent_back_many_times_is_timed_each_time") {
        return;
    }
    let (h, _b) = start_probe().await;
    let mut calls = vec![call("call_pad_ok", "lookup", json!({}))];
    for i in 0..300 {
        calls.push(call(
            &format!("call_pad_{i}_{}", "n".repeat(30_000)),
            "lookup",
            json!({}),
        ));
    }
    model_says(
        &h,
        &[
            answer_calls("c-pad", calls),
            answer_text("c-pad-miss", "done"),
            answer_text("c-pad-hit", "done"),
        ],
    )
    .await;
    let (s, b) = chat(
        &h,
        "pad-1",
        &json!({"model": "gpt-test", "messages": [{"role": "user", "content": "go"}], "tools": tools_for(&["lookup"])}),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    wait_round(&h, "pad-1");
    let n = 1000;
    let many = |id: &str| {
        let mut messages = vec![
            json!({"role": "user", "content": "go"}),
            json!({"role": "assistant", "content": null, "tool_calls": [call(id, "lookup", json!({}))]}),
        ];
        for i in 0..n {
            messages.push(json!({"role": "tool", "tool_call_id": id, "content": format!("r{i}")}));
        }
        json!({"model": "gpt-test", "messages": messages, "tools": tools_for(&["lookup"])})
    };
    let (s, b) = chat(&h, "pad-miss", &many("call_pad_ok ")).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    wait_round(&h, "pad-miss");
    let (s, b) = chat(&h, "pad-hit", &many("call_pad_ok")).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    wait_round(&h, "pad-hit");
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let hit = duration_of(&db, "call_pad_ok");
    assert_eq!(hit.len(), n, "one agent.tool-returned per distinct result");
    assert!(
        hit.iter().all(Option::is_some),
        "every result of the released call is timed"
    );
    let miss = duration_of(&db, "call_pad_ok ");
    assert_eq!(miss.len(), n);
    assert!(
        miss.iter().all(Option::is_none),
        "a near-identical id is never timed"
    );
}
