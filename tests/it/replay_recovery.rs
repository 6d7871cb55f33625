//! Record, replay and same-attempt recovery of run nodes, effect claims and provider-executed
//! tools (issue 4; tool-turn contract §D and §F; OpenWOP idempotency.md and replay.md), over
//! real sockets: the mock provider plays the model, this test plays the agent (a plain HTTP
//! client speaking Chat Completions, Messages or Responses), and admission is never called
//! directly. Each case is checked on the wire (what the agent receives, whether the mock was
//! called: `GET /_mock/requests`), and where it matters in the journal and on the admin plane.
//!
//! Conformance scenarios: `v2_tool_turn_replay`, `v2_tool_turn_recovery`,
//! `v2_provider_tool_suppressed`. Bundle: `tests/fixtures/policy-run/` (a re-runnable
//! `lookup_order`, a `charge` with business key `/chargeId`, a `send_receipt` write without
//! one; every withheld outcome ends the turn, so a suppressed repeat is visible to the agent).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};
use support::runs::*;
use support::{fixtures, own_fixtures, post_raw};
use turnguard::mock_provider::Script;

const BUNDLE: &str = "policy-run";

// ---------------------------------------------------------------------------------------------
// v2-tool-turn-replay

/// Conformance scenario **v2-tool-turn-replay**: a run recorded live (a read, a charge with a
/// business key, the agent's results, a final answer) is replayed end to end with
/// `Turnguard-Mode: replay`: the model is never called, no side-effecting call reaches the
/// agent, and the agent ends with the recorded final answer. A replay that reaches a
/// side-effecting position with no record fails with `replay_source_missing`.
#[tokio::test(flavor = "multi_thread")]
async fn v2_tool_turn_replay() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    let ask = "Charge order o-7 and tell me when it is done.";

    // --- Record the run live.
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-r0",
                vec![call(
                    "call_lookup_1",
                    "lookup_order",
                    json!({"orderId": "o-7"}),
                )],
            ),
            answer_calls(
                "chatcmpl-r1",
                vec![call(
                    "call_charge_1",
                    "charge",
                    json!({"chargeId": "ch-replay-1", "amount": 42}),
                )],
            ),
            answer_text("chatcmpl-r2", "Charged 42 for order o-7."),
        ],
    )
    .await;
    let mut live = Agent::new(&h, "run-replay-1", ask);
    let r0 = live.send().await;
    assert_eq!(r0.status, 200, "{}", r0.text_body());
    assert!(!r0.served_from_record());
    assert_eq!(r0.call_names(), ["lookup_order"]);
    live.accept(&r0);
    live.result("call_lookup_1", r#"{"orderId":"o-7","total":42}"#);
    let r1 = live.send().await;
    assert_eq!(r1.status, 200, "{}", r1.text_body());
    assert_eq!(r1.call_names(), ["charge"]);
    live.accept(&r1);
    live.result("call_charge_1", r#"{"charged":true,"receipt":"rc-1"}"#);
    let r2 = live.send().await;
    assert_eq!(r2.status, 200, "{}", r2.text_body());
    assert_eq!(r2.text().as_deref(), Some("Charged 42 for order o-7."));
    assert!(r2.calls().is_empty());
    assert_eq!(upstream_calls(&h).await, 3);
    let rows = served_rows(&h, "run-replay-1");
    assert_eq!(
        rows.iter().map(|r| r.2).collect::<Vec<_>>(),
        [0, 1, 2],
        "one served record per round: {rows:?}"
    );
    let effects_before = effect_rows(&h, "run-replay-1");
    assert_eq!(effects_before.len(), 1, "{effects_before:?}");
    assert_eq!(effects_before[0].3, "completed");

    // --- Replay it end to end: the agent starts the node again from its first request.
    let mut replay = Agent::new(&h, "run-replay-1", ask).replaying();
    let a = replay.send().await;
    assert_eq!(a.status, 200, "{}", a.text_body());
    assert!(
        a.served_from_record(),
        "a replayed answer is marked as served from the record"
    );
    assert!(
        a.calls().is_empty(),
        "no recorded call is released again on replay: {:?}",
        a.call_names()
    );
    assert_eq!(
        a.body, r2.body,
        "the agent ends with the recorded final answer, byte for byte"
    );
    assert_eq!(
        upstream_calls(&h).await,
        3,
        "the model is not called on replay"
    );

    // Replay is repeatable: the same first request lands on the same final answer.
    let again = replay.send().await;
    assert_eq!(again.status, 200, "{}", again.text_body());
    assert_eq!(again.body, r2.body);
    assert_eq!(upstream_calls(&h).await, 3);

    // Nothing was claimed or recorded as served again.
    assert_eq!(effect_rows(&h, "run-replay-1"), effects_before);
    assert_eq!(served_rows(&h, "run-replay-1").len(), 3);

    // Past the end of the record (the agent goes on after the final answer): no record, no
    // model call, no synthesized answer.
    replay.accept(&a);
    replay.user("Now refund it.");
    let past = replay.send().await;
    assert_openwop_error(&past, 404, "replay_source_missing");
    assert_eq!(upstream_calls(&h).await, 3);

    // --- A run whose charge was released but whose result never came back (the agent died):
    // a replay reaches that side-effecting position without a record and fails closed.
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-s0",
                vec![call(
                    "call_lookup_2",
                    "lookup_order",
                    json!({"orderId": "o-8"}),
                )],
            ),
            answer_calls(
                "chatcmpl-s1",
                vec![call(
                    "call_charge_2",
                    "charge",
                    json!({"chargeId": "ch-replay-2", "amount": 8}),
                )],
            ),
        ],
    )
    .await;
    let mut cut = Agent::new(&h, "run-replay-2", "Charge order o-8.");
    let s0 = cut.send().await;
    assert_eq!(s0.call_names(), ["lookup_order"], "{}", s0.text_body());
    cut.accept(&s0);
    cut.result("call_lookup_2", r#"{"orderId":"o-8","total":8}"#);
    let s1 = cut.send().await;
    assert_eq!(s1.call_names(), ["charge"], "{}", s1.text_body());
    let before = upstream_calls(&h).await;
    let miss = Agent::new(&h, "run-replay-2", "Charge order o-8.")
        .replaying()
        .send()
        .await;
    assert_openwop_error(&miss, 404, "replay_source_missing");
    assert!(
        miss.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("charge"),
        "the error names the side-effecting position: {}",
        miss.text_body()
    );
    assert_eq!(upstream_calls(&h).await, before, "never a model call");

    // --- A run with no record at all.
    let none = Agent::new(&h, "run-never-recorded", ask)
        .replaying()
        .send()
        .await;
    assert_openwop_error(&none, 404, "replay_source_missing");
    assert_eq!(upstream_calls(&h).await, before);
    h.stop().await;
}

/// Replay continues by itself only through answers whose calls all have recorded results: a
/// re-runnable call without a recorded result is handed to the agent (the read runs again),
/// never a side-effecting one.
#[tokio::test(flavor = "multi_thread")]
async fn replay_stops_at_a_rerunnable_call_without_a_recorded_result() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-p0",
                vec![call(
                    "call_charge_p",
                    "charge",
                    json!({"chargeId": "ch-p-1", "amount": 3}),
                )],
            ),
            answer_calls(
                "chatcmpl-p1",
                vec![call(
                    "call_lookup_p",
                    "lookup_order",
                    json!({"orderId": "o-p"}),
                )],
            ),
        ],
    )
    .await;
    let mut live = Agent::new(&h, "run-replay-partial", "Charge, then look it up.");
    let p0 = live.send().await;
    assert_eq!(p0.call_names(), ["charge"], "{}", p0.text_body());
    live.accept(&p0);
    live.result("call_charge_p", r#"{"charged":true}"#);
    let p1 = live.send().await;
    assert_eq!(p1.call_names(), ["lookup_order"], "{}", p1.text_body());
    // The agent stops here: the lookup's result is never sent.
    let upstream = upstream_calls(&h).await;

    let replay = Agent::new(&h, "run-replay-partial", "Charge, then look it up.").replaying();
    let a = replay.send().await;
    assert_eq!(a.status, 200, "{}", a.text_body());
    assert!(a.served_from_record());
    assert_eq!(
        a.body, p1.body,
        "the charge round (its result recorded) is skipped; the read without a result is \
         handed to the agent"
    );
    assert_eq!(a.call_names(), ["lookup_order"]);
    assert_eq!(upstream_calls(&h).await, upstream);
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// v2-tool-turn-recovery

/// Conformance scenario **v2-tool-turn-recovery**: a re-sent recorded round serves the record
/// (no model call); an in-doubt `write` call (released, no recorded result) fails with
/// `turnguard.tool_outcome_unknown`; an in-doubt `read` call is released again; attempt 2 goes
/// upstream live.
#[tokio::test(flavor = "multi_thread")]
async fn v2_tool_turn_recovery() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    let ask = "Charge order o-9.";
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-q0",
                vec![call(
                    "call_lookup_q",
                    "lookup_order",
                    json!({"orderId": "o-9"}),
                )],
            ),
            answer_calls(
                "chatcmpl-q1",
                vec![call(
                    "call_charge_q",
                    "charge",
                    json!({"chargeId": "ch-rec-1", "amount": 19.5}),
                )],
            ),
            answer_text("chatcmpl-q2", "Charged 19.5 for order o-9."),
        ],
    )
    .await;
    let mut agent = Agent::new(&h, "run-recovery-1", ask);
    let q0 = agent.send().await;
    assert_eq!(q0.status, 200, "{}", q0.text_body());
    assert!(!q0.served_from_record());
    assert_eq!(q0.call_names(), ["lookup_order"]);
    assert_eq!(upstream_calls(&h).await, 1);

    // In-doubt read: the agent lost the answer and re-sends round 0 (same attempt). The
    // read was released and has no recorded result: it is re-runnable, so it is released
    // again — from the record, the model is not asked.
    let q0_again = agent.send().await;
    assert_eq!(q0_again.status, 200, "{}", q0_again.text_body());
    assert!(q0_again.served_from_record(), "served from the record");
    assert_eq!(q0_again.body, q0.body, "the recorded answer, byte for byte");
    assert_eq!(upstream_calls(&h).await, 1, "no model call");

    agent.accept(&q0);
    agent.result("call_lookup_q", r#"{"orderId":"o-9","total":19.5}"#);
    let round1 = agent.clone();
    let q1 = agent.send().await;
    assert_eq!(q1.status, 200, "{}", q1.text_body());
    assert_eq!(q1.call_names(), ["charge"]);
    assert_eq!(upstream_calls(&h).await, 2);

    // In-doubt write: round 1 re-sent before the charge's result was recorded.
    let q1_again = round1.send().await;
    assert_openwop_error(&q1_again, 409, "turnguard.tool_outcome_unknown");
    assert!(
        q1_again.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("charge"),
        "the error names the call in doubt: {}",
        q1_again.text_body()
    );
    assert_eq!(upstream_calls(&h).await, 2, "no model call");
    let effects = effect_rows(&h, "run-recovery-1");
    assert_eq!(effects.len(), 1, "one claim: {effects:?}");
    assert_eq!(
        (effects[0].1.as_str(), effects[0].3.as_str()),
        ("call_charge_q", "claimed")
    );

    // The charge's result arrives; the run finishes live.
    agent.accept(&q1);
    agent.result("call_charge_q", r#"{"charged":true}"#);
    let q2 = agent.send().await;
    assert_eq!(q2.status, 200, "{}", q2.text_body());
    assert!(!q2.served_from_record());
    assert_eq!(q2.text().as_deref(), Some("Charged 19.5 for order o-9."));
    assert_eq!(upstream_calls(&h).await, 3);

    // A re-sent recorded round serves the record: round 1 again — now that every call of its
    // answer has a recorded result, its recorded continuation (never the charge again,
    // issue 10 item 14); and the last round.
    let q1_served = round1.send().await;
    assert_eq!(q1_served.status, 200, "{}", q1_served.text_body());
    assert!(q1_served.served_from_record());
    assert_eq!(q1_served.body, q2.body);
    let q2_served = agent.send().await;
    assert_eq!(q2_served.status, 200, "{}", q2_served.text_body());
    assert!(q2_served.served_from_record());
    assert_eq!(q2_served.body, q2.body);
    assert_eq!(
        upstream_calls(&h).await,
        3,
        "recovery never calls the model"
    );
    let effects = effect_rows(&h, "run-recovery-1");
    assert_eq!(effects.len(), 1, "{effects:?}");
    assert_eq!(effects[0].3, "completed");

    // Attempt 2 is new execution: it goes upstream live, records are not served to it.
    model_says(
        &h,
        &[answer_calls(
            "chatcmpl-q3",
            vec![call(
                "call_lookup_q2",
                "lookup_order",
                json!({"orderId": "o-9"}),
            )],
        )],
    )
    .await;
    let second = Agent::new(&h, "run-recovery-1", ask).attempt(2);
    let a2 = second.send().await;
    assert_eq!(a2.status, 200, "{}", a2.text_body());
    assert!(
        !a2.served_from_record(),
        "a new attempt is never served a record"
    );
    assert_eq!(upstream_calls(&h).await, 4, "attempt 2 went upstream");
    assert_eq!(
        a2.calls()[0].0,
        "call_lookup_q2",
        "the live answer, not the recorded one"
    );
    let rows = served_rows(&h, "run-recovery-1");
    assert!(
        rows.iter().any(|r| r.1 == 2 && r.2 == 0),
        "attempt 2's answer is recorded under attempt 2: {rows:?}"
    );
    h.stop().await;
}

/// A recorded failure is never served: an upstream error is not a served record, so the same
/// attempt re-sending goes upstream again, and so does a new attempt.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_is_not_handed_a_recorded_failure() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    h.script(&json!({"responses": [
        {"status": 503, "json": {"error": {"type": "overloaded_error", "message": "try later"}}},
        {"json": answer_text("chatcmpl-f1", "Done.")},
        {"json": answer_text("chatcmpl-f2", "Done again.")}
    ]}))
    .await;
    let agent = Agent::new(&h, "run-failure-1", "Say done.");
    let first = agent.send().await;
    assert_eq!(first.status, 503, "the upstream error passes through");
    let retry = agent.send().await;
    assert_eq!(retry.status, 200, "{}", retry.text_body());
    assert!(!retry.served_from_record());
    assert_eq!(retry.text().as_deref(), Some("Done."));
    let a2 = agent.clone().attempt(2).send().await;
    assert_eq!(a2.text().as_deref(), Some("Done again."));
    assert!(!a2.served_from_record());
    assert_eq!(upstream_calls(&h).await, 3);
    h.stop().await;
}

/// A streamed round is recovered from the bytes the agent was sent: the re-sent round gets the
/// same event stream without a model call, and an in-doubt charge in it fails closed.
#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_round_is_recovered_from_the_bytes_sent() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    let events = chat_sse_call("call_lookup_s", "lookup_order", &json!({"orderId": "o-s"}));
    h.script(&json!({"responses": [{"sse": events}]})).await;
    let agent = Agent::new(&h, "run-stream-1", "Look up o-s.");
    let mut body = agent.body();
    body["stream"] = json!(true);
    let first = agent.send_body(&body).await;
    assert_eq!(first.status, 200, "{}", first.text_body());
    assert!(first.text_body().contains("call_lookup_s"));
    // Give the relay task time to journal the served record after the stream ended.
    let deadline = Instant::now() + Duration::from_secs(5);
    while served_rows(&h, "run-stream-1").is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let again = agent.send_body(&body).await;
    assert_eq!(again.status, 200, "{}", again.text_body());
    assert!(again.served_from_record(), "served from the record");
    assert_eq!(again.body, first.body, "the same bytes");
    assert!(again
        .headers
        .get("content-type")
        .is_some_and(|v| v.to_str().unwrap().starts_with("text/event-stream")));
    assert_eq!(upstream_calls(&h).await, 1);
    h.stop().await;
}

/// A new attempt (an orphan sweeper re-running the node) whose model asks for a charge that
/// attempt 1 already executed, under a new call id: the effect is claimed and completed, so the
/// call is a suppressed repeat — not released, the recorded result supplied.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_attempt_does_not_release_a_completed_charge_again() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    let charge = json!({"chargeId": "ch-att-1", "amount": 70});
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-a0",
                vec![call("call_charge_a1", "charge", charge.clone())],
            ),
            answer_text("chatcmpl-a1", "Charged."),
            answer_calls(
                "chatcmpl-b0",
                vec![call("call_charge_a2", "charge", charge.clone())],
            ),
        ],
    )
    .await;
    let mut first = Agent::new(&h, "run-attempts-1", "Charge 70.");
    let r = first.send().await;
    assert_eq!(r.call_names(), ["charge"], "{}", r.text_body());
    first.accept(&r);
    first.result("call_charge_a1", r#"{"charged":true,"receipt":"rc-70"}"#);
    let done = first.send().await;
    assert_eq!(done.text().as_deref(), Some("Charged."));

    let retry = Agent::new(&h, "run-attempts-1", "Charge 70.").attempt(2);
    let r2 = retry.send().await;
    assert_eq!(r2.status, 200, "{}", r2.text_body());
    assert!(
        r2.calls().is_empty(),
        "the charge already ran: not released again: {}",
        r2.text_body()
    );
    assert!(
        r2.text().unwrap_or_default().contains("rc-70"),
        "the recorded result is supplied: {}",
        r2.text_body()
    );
    let effects = effect_rows(&h, "run-attempts-1");
    assert_eq!(effects.len(), 1, "one claim: {effects:?}");
    h.stop().await;
}

/// The same, with a model that repeats the recorded call id (a deterministic model, a cached
/// LLM answer, or a provider with sequential call ids): the call id does not make the repeat
/// a different effect — the charge already ran and must not be released again.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_attempt_repeating_the_recorded_call_id_is_not_released_again() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    let charge = json!({"chargeId": "ch-att-2", "amount": 71});
    let round0 = answer_calls(
        "chatcmpl-c0",
        vec![call("call_charge_same", "charge", charge)],
    );
    model_says(
        &h,
        &[
            round0.clone(),
            answer_text("chatcmpl-c1", "Charged."),
            round0,
        ],
    )
    .await;
    let mut first = Agent::new(&h, "run-attempts-2", "Charge 71.");
    let r = first.send().await;
    assert_eq!(r.call_names(), ["charge"], "{}", r.text_body());
    first.accept(&r);
    first.result("call_charge_same", r#"{"charged":true,"receipt":"rc-71"}"#);
    let done = first.send().await;
    assert_eq!(done.text().as_deref(), Some("Charged."));
    assert_eq!(effect_rows(&h, "run-attempts-2")[0].3, "completed");

    // Attempt 2 re-runs the node; the model answers exactly as before.
    let retry = Agent::new(&h, "run-attempts-2", "Charge 71.").attempt(2);
    let r2 = retry.send().await;
    assert_eq!(r2.status, 200, "{}", r2.text_body());
    assert!(!r2.served_from_record(), "attempt 2 went live");
    assert!(
        r2.calls().is_empty(),
        "the completed charge ch-att-2 was released to the agent a second time (attempt 2, \
         same call id): {}",
        r2.text_body()
    );
    h.stop().await;
}

/// Call ids are only unique within a run (some providers and local servers number them
/// `call_0`, `call_1` …): a tool result in one run must not complete another run's effect,
/// nor be handed to another run as "the recorded result" of a suppressed repeat.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_id_in_another_run_does_not_touch_this_runs_effect() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-x0",
                vec![call(
                    "call_0",
                    "charge",
                    json!({"chargeId": "ch-cross-1", "amount": 11}),
                )],
            ),
            answer_calls(
                "chatcmpl-y0",
                vec![call(
                    "call_0",
                    "lookup_order",
                    json!({"orderId": "o-other"}),
                )],
            ),
            answer_text("chatcmpl-y1", "Looked up."),
            answer_calls(
                "chatcmpl-z0",
                vec![call(
                    "call_7",
                    "charge",
                    json!({"chargeId": "ch-cross-1", "amount": 11}),
                )],
            ),
        ],
    )
    .await;
    // Run A: the charge is released; its result has not come back (yet).
    let a = Agent::new(&h, "run-cross-a", "Charge 11.");
    let ra = a.send().await;
    assert_eq!(ra.call_names(), ["charge"], "{}", ra.text_body());
    // Run B: an unrelated lookup that happens to have the same call id, and its result.
    let mut b = Agent::new(&h, "run-cross-b", "Look up o-other.");
    let rb = b.send().await;
    assert_eq!(rb.call_names(), ["lookup_order"], "{}", rb.text_body());
    b.accept(&rb);
    b.result(
        "call_0",
        r#"{"orderId":"o-other","owner":"B-private-data"}"#,
    );
    let rb1 = b.send().await;
    assert_eq!(rb1.status, 200, "{}", rb1.text_body());

    // A's charge is still only claimed: its result never arrived.
    let effects = effect_rows(&h, "run-cross-a");
    assert_eq!(effects.len(), 1, "{effects:?}");
    assert_eq!(
        effects[0].3, "claimed",
        "run B's result for its own `call_0` completed run A's charge"
    );
    // A repeat of A's charge (another run, new call id) is suppressed; B's data is not
    // presented as the charge's recorded result.
    let c = Agent::new(&h, "run-cross-c", "Charge 11.");
    let rc = c.send().await;
    assert!(rc.calls().is_empty(), "{}", rc.text_body());
    assert!(
        !rc.text_body().contains("B-private-data"),
        "run B's tool result was handed to run C as the charge's result: {}",
        rc.text_body()
    );
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// v2-provider-tool-suppressed

/// Conformance scenario **v2-provider-tool-suppressed**: a round with an Anthropic server-side
/// web search, and one with an OpenAI Responses built-in web search, are served from the
/// record on replay — the provider is not called, so it does not run them again. Also (§F):
/// inside a run, delegating MCP to the provider is refused, and the effect-seam manifest
/// lists the provider-executed tools.
#[tokio::test(flavor = "multi_thread")]
async fn v2_provider_tool_suppressed() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    h.script(&support::script(
        json!([
            {"path": "/v1/messages", "file": "anthropic-messages/nonstream-server-tool-web-search.json"},
            {"path": "/v1/responses", "file": "openai-responses/nonstream-web-search-call.json"}
        ]),
        &fixtures(),
    ))
    .await;
    let messages_url = format!("{}/v1/messages", h.url());
    let responses_url = format!("{}/v1/responses", h.url());
    let anthropic_req = json!({
        "model": "claude-haiku-4-5-20251001", "max_tokens": 1024,
        "messages": [{"role": "user", "content": "What's the weather in San Francisco today?"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 1}]
    });
    let responses_req = json!({
        "model": "gpt-5-mini", "input": "What is in the tech news today?",
        "tools": [{"type": "web_search"}]
    });
    let run = |node: &'static str, replay: bool| {
        let mut h: Vec<(&'static str, &'static str)> = vec![
            ("turnguard-run", "run-provider-1"),
            ("turnguard-node", node),
            ("anthropic-version", "2023-06-01"),
        ];
        if replay {
            h.push(("turnguard-mode", "replay"));
        }
        h
    };
    let send = |url: String, body: Value, headers: Vec<(&'static str, &'static str)>| async move {
        let (status, headers, body) = post_raw(&url, Bytes::from(body.to_string()), &headers).await;
        let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            body,
            json,
        }
    };

    // Live: each provider runs its tool once.
    let live_a = send(
        messages_url.clone(),
        anthropic_req.clone(),
        run("research", false),
    )
    .await;
    assert_eq!(live_a.status, 200, "{}", live_a.text_body());
    assert!(!live_a.served_from_record());
    assert!(live_a.text_body().contains("server_tool_use"));
    let live_o = send(
        responses_url.clone(),
        responses_req.clone(),
        run("news", false),
    )
    .await;
    assert_eq!(live_o.status, 200, "{}", live_o.text_body());
    assert!(live_o.text_body().contains("web_search_call"));
    assert_eq!(upstream_calls(&h).await, 2);

    // Replay: both rounds are served from the record; the provider is not called.
    let rep_a = send(
        messages_url.clone(),
        anthropic_req.clone(),
        run("research", true),
    )
    .await;
    assert_eq!(rep_a.status, 200, "{}", rep_a.text_body());
    assert!(rep_a.served_from_record());
    assert_eq!(rep_a.body, live_a.body, "the recorded round, byte for byte");
    let rep_o = send(
        responses_url.clone(),
        responses_req.clone(),
        run("news", true),
    )
    .await;
    assert_eq!(rep_o.status, 200, "{}", rep_o.text_body());
    assert!(rep_o.served_from_record());
    assert_eq!(rep_o.body, live_o.body);
    assert_eq!(
        upstream_calls(&h).await,
        2,
        "replay never reaches the provider, so its tools do not run again"
    );

    // A replay of such a round with no record fails closed (never a live call).
    let unrecorded = |replay_headers: Vec<(&'static str, &'static str)>| {
        replay_headers
            .into_iter()
            .map(|(k, v)| {
                if k == "turnguard-run" {
                    (k, "run-provider-unrecorded")
                } else {
                    (k, v)
                }
            })
            .collect::<Vec<_>>()
    };
    let miss_a = send(
        messages_url.clone(),
        anthropic_req.clone(),
        unrecorded(run("research", true)),
    )
    .await;
    assert_openwop_error(&miss_a, 404, "replay_source_missing");
    let miss_o = send(
        responses_url.clone(),
        responses_req.clone(),
        unrecorded(run("news", true)),
    )
    .await;
    assert_openwop_error(&miss_o, 404, "replay_source_missing");
    assert_eq!(upstream_calls(&h).await, 2);

    // Inside a run, MCP is never delegated to the provider.
    let mut mcp_a = anthropic_req.clone();
    mcp_a["mcp_servers"] =
        json!([{"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}]);
    let refused_a = send(messages_url.clone(), mcp_a, run("research", false)).await;
    assert_openwop_error(&refused_a, 403, "forbidden");
    assert_eq!(
        refused_a.json["error"]["details"]["reason"],
        "provider_delegation_in_run"
    );
    let mut mcp_o = responses_req.clone();
    mcp_o["tools"] = json!([{"type": "mcp", "server_label": "deepwiki",
        "server_url": "https://mcp.deepwiki.com/mcp", "require_approval": "never"}]);
    let refused_o = send(responses_url.clone(), mcp_o, run("news", false)).await;
    assert_openwop_error(&refused_o, 403, "forbidden");
    assert_eq!(
        upstream_calls(&h).await,
        2,
        "a refused request never reaches the provider"
    );

    // The effect-seam manifest lists the provider-executed tools and is schema-valid.
    let manifest = admin_json(&h, "/host/effect-seams").await;
    let validator = {
        let schema = read_json(&spec_dir().join("effect-seam-manifest.schema.json"));
        jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .build(&schema)
            .unwrap()
    };
    // The validator can fail: a seam without `suppression`, and a bad id, are rejected.
    assert!(
        !validator.is_valid(&json!({"manifestVersion": "1", "host": {"name": "x",
        "build": {"kind": "commit", "id": "1"}}, "seams": [{"id": "a.b", "kind": "provider"}]}))
    );
    assert!(!validator.is_valid(&json!({"manifestVersion": "1", "host": {"name": "x",
        "build": {"kind": "commit", "id": "1"}}, "seams": [{"id": "nodot", "kind": "provider", "suppression": "recorded-outcome"}]})));
    assert_valid(&validator, &manifest, "GET /host/effect-seams");
    let ids: BTreeSet<String> = manifest["seams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect();
    for (provider, tool) in [
        ("openai", "web-search"),
        ("openai", "file-search"),
        ("openai", "code-interpreter"),
        ("anthropic", "web-search"),
        ("anthropic", "web-fetch"),
        ("anthropic", "code-execution"),
    ] {
        assert!(
            ids.iter()
                .any(|id| id.starts_with(provider) && id.contains(tool)),
            "the manifest does not list {provider} {tool}: {ids:?}"
        );
    }
    for seam in manifest["seams"].as_array().unwrap() {
        if seam["kind"] == "other" {
            assert!(
                seam["note"].is_string(),
                "an `other` seam needs a note: {seam}"
            );
        }
    }
    let caps = admin_json(&h, "/capabilities").await;
    assert_eq!(caps["toolHooks"]["turnReplay"], true, "{caps}");
    assert_eq!(caps["replay"]["effectSeamsManifest"], "/host/effect-seams");
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Effects

/// `GET /runs/{runId}/effects` is valid against `effect-ledger-projection.schema.json` (its
/// `ids.schema.json` references resolved by registering the real ids schema under its `$id`),
/// lists the business-identity and activity-recipe claims, `claimed` while the results are
/// outstanding and `completed` once they are recorded, and carries no argument value.
#[tokio::test(flavor = "multi_thread")]
async fn effects_projection_is_valid_and_content_free() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    let validator = openwop_validator("effect-ledger-projection.schema.json");
    // The validator can fail: an effect id without a tenant, an unknown keying, an extra
    // property, a bad timestamp.
    let good = json!({"effectId": "default/abcdefghijklmnop", "nodeId": "n", "attempt": 1,
        "keying": "activity-recipe", "state": "claimed", "at": "2026-01-01T00:00:00.000Z"});
    // (`runId` is tenant-bound in ids.schema.json: `<tenantId>/<opaque 16–128>`.)
    let placeholder_run = "default/placeholder-run-0001";
    assert!(validator.is_valid(&json!({"runId": placeholder_run, "effects": [good.clone()]})));
    assert!(!validator.is_valid(&json!({"runId": "r", "effects": [good.clone()]})));
    for (k, v) in [
        ("effectId", json!("abcdefghijklmnopqrst")),
        ("keying", json!("call-id")),
        ("args", json!({})),
        ("at", json!("yesterday")),
    ] {
        let mut bad = good.clone();
        bad[k] = v;
        assert!(
            !validator.is_valid(&json!({"runId": placeholder_run, "effects": [bad]})),
            "the validator accepted a bad `{k}`"
        );
    }

    let secret_values = [
        "ch-eff-XYZ-77",
        "4242.17",
        "alice@example.com",
        "Receipt for",
    ];
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-e0",
                vec![
                    call(
                        "call_charge_e",
                        "charge",
                        json!({"chargeId": "ch-eff-XYZ-77", "amount": 4242.17}),
                    ),
                    call(
                        "call_receipt_e",
                        "send_receipt",
                        json!({"to": "alice@example.com", "body": "Receipt for ch-eff-XYZ-77"}),
                    ),
                ],
            ),
            answer_text("chatcmpl-e1", "Charged and sent the receipt."),
        ],
    )
    .await;
    let mut agent = Agent::new(&h, "run-effects-1", "Charge and send a receipt.").node("checkout");
    let r0 = agent.send().await;
    assert_eq!(
        r0.call_names(),
        ["charge", "send_receipt"],
        "{}",
        r0.text_body()
    );

    // Whole-document schema errors are collected and asserted last, so the rest of the
    // projection is still checked when only `runId` is off.
    let mut whole_doc_errors: Vec<String> = Vec::new();
    let mut check = |doc: &Value, state: &str| {
        // The effects themselves, with a valid placeholder for `runId`.
        assert_valid(
            &validator,
            &json!({"runId": placeholder_run, "effects": doc["effects"]}),
            "the effects of GET /runs/run-effects-1/effects",
        );
        whole_doc_errors.extend(
            validator
                .iter_errors(doc)
                .map(|e| format!("{state}: {e} at `{}`", e.instance_path())),
        );
        assert_eq!(
            doc["runId"],
            turnguard::recipes::openwop_run_id("default", "run-effects-1"),
            "the tenant-bound OpenWOP id of the run"
        );
        let effects = doc["effects"].as_array().unwrap();
        assert_eq!(effects.len(), 2, "{doc:#}");
        let keyings: BTreeSet<&str> = effects
            .iter()
            .map(|e| e["keying"].as_str().unwrap())
            .collect();
        assert_eq!(
            keyings,
            BTreeSet::from(["activity-recipe", "business-identity"]),
            "{doc:#}"
        );
        for e in effects {
            assert_eq!(e["state"], state, "{doc:#}");
            assert_eq!(e["nodeId"], "checkout");
            assert_eq!(e["attempt"], 1);
            assert!(e["effectId"].as_str().unwrap().starts_with("default/"));
        }
        let text = doc.to_string();
        for v in secret_values {
            assert!(
                !text.contains(v),
                "the effect projection carries the argument value `{v}`: {text}"
            );
        }
    };
    let claimed = admin_json(&h, "/runs/run-effects-1/effects").await;
    check(&claimed, "claimed");

    // The activity-recipe effect is keyed by the call's logicalInvocationId.
    let db = support::journal(&h.journal());
    let lid: String = db
        .query_row(
            "SELECT logical_invocation_id FROM tool_calls WHERE call_id = 'call_receipt_e'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let activity = claimed["effects"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["keying"] == "activity-recipe")
        .unwrap();
    assert_eq!(activity["effectId"], format!("default/{lid}"));

    agent.accept(&r0);
    agent.result("call_charge_e", r#"{"charged":true}"#);
    agent.result("call_receipt_e", r#"{"sent":true}"#);
    let r1 = agent.send().await;
    assert_eq!(r1.status, 200, "{}", r1.text_body());
    let completed = admin_json(&h, "/runs/run-effects-1/effects").await;
    check(&completed, "completed");

    // The run's events are content-free too.
    let events = admin_json(&h, "/runs/run-effects-1/events").await;
    let text = events.to_string();
    assert!(
        events["events"].as_array().is_some_and(|e| !e.is_empty()),
        "{events:#}"
    );
    for v in secret_values {
        assert!(!text.contains(v), "events carry `{v}`: {text}");
    }
    // An unknown run has an empty ledger.
    let empty = admin_json(&h, "/runs/run-nobody/effects").await;
    assert_eq!(empty["effects"], json!([]));
    h.stop().await;
    // The whole document, `runId` included, must be valid: `Turnguard-Run: run-effects-1` is
    // an ordinary run id, and the projection must still be a valid effect-ledger projection.
    assert!(
        whole_doc_errors.is_empty(),
        "GET /runs/run-effects-1/effects is not valid against \
         effect-ledger-projection.schema.json: {whole_doc_errors:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Oversized results

/// A tool result over `journal_max_record_bytes` is kept only as a digest with a truncation
/// marker: on replay a write tool's position is then a miss (`replay_source_missing`) and a
/// read tool's call is handed to the agent again; on same-attempt recovery the write is in
/// doubt (`tool_outcome_unknown`).
#[tokio::test(flavor = "multi_thread")]
async fn an_oversized_result_is_a_miss() {
    let h = support::start_with(Script::default(), |c| {
        c.policy = own_fixtures().join(BUNDLE);
        c.journal_max_record_bytes = 2048;
    })
    .await;
    let big = |tag: &str| format!("{{\"{tag}\":\"{}\"}}", "x".repeat(3000));
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-o0",
                vec![call(
                    "call_lookup_o",
                    "lookup_order",
                    json!({"orderId": "o-big"}),
                )],
            ),
            answer_calls(
                "chatcmpl-o1",
                vec![call(
                    "call_charge_o",
                    "charge",
                    json!({"chargeId": "ch-big-1", "amount": 1}),
                )],
            ),
            answer_text("chatcmpl-o2", "Done."),
        ],
    )
    .await;
    let mut agent = Agent::new(&h, "run-oversized-1", "Charge o-big.");
    let r0 = agent.send().await;
    assert_eq!(r0.call_names(), ["lookup_order"], "{}", r0.text_body());
    agent.accept(&r0);
    agent.result("call_lookup_o", &big("lookup"));
    let round1 = agent.clone();
    let r1 = agent.send().await;
    assert_eq!(r1.call_names(), ["charge"], "{}", r1.text_body());
    agent.accept(&r1);
    agent.result("call_charge_o", &big("charge"));
    let r2 = agent.send().await;
    assert_eq!(r2.text().as_deref(), Some("Done."), "{}", r2.text_body());
    let upstream = upstream_calls(&h).await;

    // The journal keeps only the digest of both results.
    let db = support::journal(&h.journal());
    for id in ["call_lookup_o", "call_charge_o"] {
        let (truncated, kept, total, digest): (bool, Option<Vec<u8>>, i64, String) = db
            .query_row(
                "SELECT truncated, content, content_bytes, content_digest FROM tool_results WHERE tool_call_id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap();
        assert!(truncated, "{id}: truncation marker");
        assert!(
            kept.unwrap_or_default().is_empty(),
            "{id}: the body is not kept"
        );
        assert!(total > 2048, "{id}: the full size is recorded");
        assert_eq!(digest.len(), 64, "{id}: SHA-256 digest");
    }
    drop(db);

    // Same-attempt recovery of round 1: the charge's result is a digest only, so it is in doubt.
    let rec = round1.send().await;
    assert_openwop_error(&rec, 409, "turnguard.tool_outcome_unknown");

    // Replay: round 0's read has only a digest → handed to the agent again (re-runnable).
    let mut replay = Agent::new(&h, "run-oversized-1", "Charge o-big.").replaying();
    let a0 = replay.send().await;
    assert_eq!(a0.status, 200, "{}", a0.text_body());
    assert!(a0.served_from_record());
    assert_eq!(a0.call_names(), ["lookup_order"]);
    // The agent runs the read again; the next recorded round released the charge, whose
    // result is a digest only: the replay cannot go past it.
    replay.accept(&a0);
    replay.result("call_lookup_o", r#"{"lookup":"small"}"#);
    let a1 = replay.send().await;
    assert_openwop_error(&a1, 404, "replay_source_missing");
    assert_eq!(upstream_calls(&h).await, upstream, "never a model call");
    h.stop().await;
}

/// A streamed round larger than the record cap: the charge it released has no recorded
/// result, so when the same attempt re-sends that round the charge is in doubt and the request
/// fails with `turnguard.tool_outcome_unknown` — the model is not asked again.
#[tokio::test(flavor = "multi_thread")]
async fn an_oversized_streamed_round_keeps_its_released_write_in_doubt() {
    let h = support::start_with(Script::default(), |c| {
        c.policy = own_fixtures().join(BUNDLE);
        c.journal_max_record_bytes = 600;
    })
    .await;
    let charge = json!({"chargeId": "ch-stream-big", "amount": 9});
    h.script(&json!({"responses": [{"sse": chat_sse_call("call_charge_sb", "charge", &charge)}]}))
        .await;
    let agent = Agent::new(&h, "run-stream-big", "Charge 9.");
    let mut body = agent.body();
    body["stream"] = json!(true);
    let first = agent.send_body(&body).await;
    assert_eq!(first.status, 200, "{}", first.text_body());
    assert!(
        first.body.len() > 600,
        "the stream is over the cap: {}",
        first.body.len()
    );
    assert!(
        first.text_body().contains("call_charge_sb"),
        "the charge was released"
    );
    // Wait until the round is journaled.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let db = support::journal(&h.journal());
        let n: i64 = db
            .query_row(
                "SELECT count(*) FROM rounds WHERE run_id = 'run-stream-big'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        if n > 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The agent lost the answer and re-sends the round (same attempt, no result for the charge).
    h.script(&json!({"responses": [{"sse": chat_sse_call("call_charge_sb2", "charge", &charge)}]}))
        .await;
    let again = agent.send_body(&body).await;
    assert_openwop_error(&again, 409, "turnguard.tool_outcome_unknown");
    assert_eq!(upstream_calls(&h).await, 1, "the model is not asked again");
    h.stop().await;
}

/// A round whose call arguments carried a secret is kept only as a digest (raw bodies with
/// secrets are not journaled): on replay it is a miss, never a model call.
#[tokio::test(flavor = "multi_thread")]
async fn a_round_with_a_secret_in_its_arguments_is_a_replay_miss() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-k0",
                vec![call(
                    "call_charge_k",
                    "charge",
                    json!({"chargeId": "ch-secret-1", "amount": 3, "card": "4111111111111111"}),
                )],
            ),
            answer_text("chatcmpl-k1", "Charged."),
        ],
    )
    .await;
    let mut agent = Agent::new(&h, "run-secret-1", "Charge 3 to my card.");
    let r0 = agent.send().await;
    assert_eq!(r0.call_names(), ["charge"], "{}", r0.text_body());
    agent.accept(&r0);
    agent.result("call_charge_k", r#"{"charged":true}"#);
    let r1 = agent.send().await;
    assert_eq!(r1.text().as_deref(), Some("Charged."));
    let rows = served_rows(&h, "run-secret-1");
    assert!(rows[0].3, "round 0 is kept only as a digest: {rows:?}");
    let replay = Agent::new(&h, "run-secret-1", "Charge 3 to my card.").replaying();
    let miss = replay.send().await;
    assert_openwop_error(&miss, 404, "replay_source_missing");
    assert_eq!(upstream_calls(&h).await, 2);
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Journal unavailable

/// When the journal cannot record, a request carrying the result of a non-re-runnable tool
/// fails closed (503 `turnguard.journal_unavailable`) and nothing reaches the model.
///
/// How the journal is made unwritable: the tests run as root, so `chmod` does not stop writes
/// and there is no small filesystem to fill. Instead the test opens the journal itself and holds
/// SQLite's write lock (`BEGIN EXCLUSIVE`) for longer than turnguard's 5 s busy timeout — to
/// turnguard's writer this is a database that refuses writes, deterministically.
#[tokio::test(flavor = "multi_thread")]
async fn a_journal_that_cannot_record_fails_closed() {
    if support::sqlite_only("a_journal_that_cannot_record_fails_closed") {
        return;
    }
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    model_says(
        &h,
        &[answer_calls(
            "chatcmpl-j0",
            vec![call(
                "call_charge_j",
                "charge",
                json!({"chargeId": "ch-lock-1", "amount": 5}),
            )],
        )],
    )
    .await;
    let mut agent = Agent::new(&h, "run-journal-lock", "Charge 5.");
    let r0 = agent.send().await;
    assert_eq!(r0.call_names(), ["charge"], "{}", r0.text_body());
    agent.accept(&r0);
    agent.result("call_charge_j", r#"{"charged":true}"#);
    let upstream = upstream_calls(&h).await;

    let lock = rusqlite::Connection::open(h.journal()).unwrap();
    lock.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let started = Instant::now();
    let failed = agent.send().await;
    let waited = started.elapsed();
    assert_openwop_error(&failed, 503, "turnguard.journal_unavailable");
    assert_eq!(
        upstream_calls(&h).await,
        upstream,
        "nothing reaches the model when the result cannot be recorded"
    );
    assert!(
        waited < Duration::from_secs(20),
        "failed in bounded time: {waited:?}"
    );
    lock.execute_batch("ROLLBACK").unwrap();
    drop(lock);
    let db = support::journal(&h.journal());
    let n: i64 = db
        .query_row(
            "SELECT count(*) FROM tool_results WHERE tool_call_id = 'call_charge_j'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(n, 0, "the result was not recorded");
    drop(db);

    // Once the journal records again (readiness says so: a probe write succeeded), the same
    // request goes through.
    for _ in 0..100 {
        if support::get(&format!("{}/readyz", h.admin_url())).await.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    model_says(&h, &[answer_text("chatcmpl-j1", "Charged 5.")]).await;
    let ok = agent.send().await;
    assert_eq!(ok.status, 200, "{}", ok.text_body());
    assert_eq!(ok.text().as_deref(), Some("Charged 5."));
    assert_eq!(upstream_calls(&h).await, upstream + 1);
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Journal CLI

/// `turnguard journal runs` and `turnguard journal show RUN` (the real binary, while serve
/// runs) print the run, its rounds and calls with redacted arguments, its effects and events;
/// no raw secret is printed, nor stored anywhere in the journal files.
#[tokio::test(flavor = "multi_thread")]
async fn journal_cli_shows_the_run_redacted() {
    let h = support::start_with_policy(Script::default(), BUNDLE).await;
    let card = "4111111111111111";
    let api_key = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWx0123";
    model_says(
        &h,
        &[
            answer_calls(
                "chatcmpl-l0",
                vec![
                    call(
                        "call_charge_l",
                        "charge",
                        json!({"chargeId": "ch-cli-1", "amount": 12.5, "card": card}),
                    ),
                    call(
                        "call_receipt_l",
                        "send_receipt",
                        json!({"to": "bob@example.com", "body": format!("your key {api_key}")}),
                    ),
                ],
            ),
            answer_text("chatcmpl-l1", "Done."),
        ],
    )
    .await;
    let mut agent = Agent::new(&h, "run-cli-1", "Charge and send the receipt.");
    let r0 = agent.send().await;
    assert_eq!(
        r0.call_names(),
        ["charge", "send_receipt"],
        "{}",
        r0.text_body()
    );
    agent.accept(&r0);
    agent.result("call_charge_l", r#"{"charged":true}"#);
    agent.result("call_receipt_l", r#"{"sent":true}"#);
    let r1 = agent.send().await;
    assert_eq!(r1.status, 200, "{}", r1.text_body());

    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_turnguard"))
            .args(args)
            .output()
            .expect("turnguard runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "turnguard {args:?} failed: {}{stdout}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let journal = support::journal_arg(&h.journal());
    let runs = cli(&["journal", "runs", "--journal", &journal]);
    let line = runs
        .lines()
        .find(|l| l.starts_with("run-cli-1\t"))
        .unwrap_or_else(|| panic!("run-cli-1 not listed:\n{runs}"));
    let cols: Vec<&str> = line.split('\t').collect();
    assert_eq!(
        (cols[1], cols[2]),
        ("2", "2"),
        "two rounds, two calls: {line}"
    );

    let show_text = cli(&["journal", "show", "run-cli-1", "--journal", &journal]);
    let show: Value = serde_json::from_str(&show_text).expect("show prints JSON");
    assert_eq!(show["runId"], "run-cli-1");
    let rounds = show["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 2, "{show:#}");
    let calls = rounds[0]["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2, "{show:#}");
    let by_name = |n: &str| calls.iter().find(|c| c["name"] == n).unwrap().clone();
    let charge = by_name("charge");
    assert_eq!(charge["outcome"], "executed");
    assert_eq!(charge["arguments"]["card"], "[REDACTED:pointer]");
    assert_eq!(charge["arguments"]["chargeId"], "ch-cli-1");
    let receipt = by_name("send_receipt");
    assert!(
        receipt["arguments"]["body"]
            .as_str()
            .unwrap()
            .contains("[REDACTED:api-key]"),
        "{receipt}"
    );
    assert!(receipt["logicalInvocationId"].is_string());
    let effects = show["effects"].as_array().unwrap();
    assert_eq!(effects.len(), 2, "{show:#}");
    assert!(
        effects.iter().all(|e| e["state"] == "completed"),
        "{show:#}"
    );
    assert!(
        show["events"].as_array().is_some_and(|e| !e.is_empty()),
        "{show:#}"
    );
    for out in [&runs, &show_text] {
        assert!(!out.contains(card), "the raw card number is printed");
        assert!(!out.contains(api_key), "the raw API key is printed");
    }

    // Nothing in the journal files holds the raw secrets.
    let dir = h.stop().await;
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        for secret in [card, api_key] {
            assert!(
                !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                "{} holds the raw secret {secret}",
                path.display()
            );
        }
    }
}
