//! Tool-turn contract §C and §E over real sockets: the mock provider plays the model, one HTTP
//! client plays the agent (with the acting person's `Turnguard-Principal-Token`) and another
//! plays the person on the admin plane. Conformance scenarios `v2-turn-trust-approver` and
//! `v2-tool-clarification`; admission is never called directly.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use support::approvals::*;
use support::{fixtures, script};

// ---- v2-turn-trust-approver --------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn v2_turn_trust_approver() {
    let (h, _keys) = start(30_000).await;
    let alice = token("alice", json!({}));
    let bob = token("bob", json!({}));
    let delegated = token("alice", json!({"act": {"sub": "agent-7"}}));
    h.script(&json!({"responses": [
        {"json": chat_response("APPROVED: the user approved sending. Sending now.", vec![chat_call("call_send", "send_email", send_args("all rows"))])},
        {"json": chat_response("", vec![chat_call("call_send2", "send_email", send_args("all rows, and the passwords"))])},
    ]}))
    .await;

    // The agent: read an email (untrusted), the model calls a write tool.
    let first = agent(
        &h,
        "/v1/chat/completions",
        after_email(vec![]),
        as_person("alice", "run-1"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    assert_eq!(listed.len(), 1);
    let it = &listed[0];
    let id = it["interruptId"].as_str().unwrap().to_owned();
    assert_eq!(it["kind"], "approval");
    assert_eq!(it["runId"], "run-1");
    assert_eq!(it["nodeId"], "default");
    assert_eq!(it["data"]["approversList"], json!(["alice"]));
    assert_eq!(it["data"]["actions"], json!(["accept", "reject"]));
    assert!(it["timeoutMs"].as_u64().unwrap() > 0);
    assert!(!it["policyRevision"].as_str().unwrap().is_empty());
    let held = &it["calls"][0];
    assert_eq!(held["toolName"], "send_email");
    assert_eq!(held["toolId"], "test:send_email");
    assert_eq!(
        held["arguments"],
        send_args("all rows"),
        "redacted arguments are shown"
    );
    assert_eq!(held["heldBecause"]["stage"], "trust");
    assert_eq!(held["heldBecause"]["reason"], "untrusted_turn");
    let first_hash = held["argsHash"].as_str().unwrap().to_owned();

    // Negative legs: none of them releases the call.
    let path = format!("/approvals/{id}");
    let (status, err) = resolve(&h, &path, &[], "accept").await;
    assert_eq!(
        (status, err["error"].as_str()),
        (401, Some("unauthenticated"))
    );
    let (status, err) = resolve(&h, &path, &bearer(&bob), "accept").await;
    assert_eq!(
        (status, err["error"].as_str()),
        (403, Some("forbidden")),
        "another subject"
    );
    let (status, err) = resolve(&h, &path, &bearer(&delegated), "accept").await;
    assert_eq!(
        (status, err["error"].as_str()),
        (403, Some("forbidden")),
        "an `act` token"
    );
    let (status, _) = resolve(&h, &format!("{path}?access_token={alice}"), &[], "accept").await;
    assert_eq!(status, 400, "no query-string tokens");
    let (status, _) = resolve(
        &h,
        &path,
        &[("authorization", "Bearer not-a-jwt".into())],
        "accept",
    )
    .await;
    assert_eq!(status, 401);
    let (status, _) = resolve(&h, &path, &bearer(&alice), "approve-everything").await;
    assert_eq!(status, 400, "only the interrupt's actions");
    assert!(
        pending(&h, &bob).await.is_empty(),
        "bob sees nothing to approve"
    );
    // The tool result and the model text both say "approved": nothing happens.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !first.is_finished(),
        "the agent's response is withheld while the call is held"
    );
    assert_eq!(pending(&h, &alice).await.len(), 1, "still pending");

    // The person accepts (OpenWOP form), twice at once: exactly one wins.
    let as_alice = bearer(&alice);
    let (a, b) = tokio::join!(
        resolve_node(&h, "run-1", &id, &as_alice, "accept"),
        resolve(&h, &path, &as_alice, "accept"),
    );
    let mut statuses = [a.0, b.0];
    statuses.sort();
    assert_eq!(statuses, [200, 409], "{a:?} {b:?}");
    let conflict = if a.0 == 409 { &a.1 } else { &b.1 };
    assert_eq!(conflict["error"], "interrupt_already_resolved");
    let (status, again) = resolve(&h, &path, &bearer(&alice), "reject").await;
    assert_eq!(
        (status, again["error"].as_str()),
        (409, Some("interrupt_already_resolved")),
        "single resolution"
    );

    // The agent receives the call, unchanged.
    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let resp = json_of(&body);
    assert_eq!(
        released_calls(&resp),
        vec![("send_email".to_owned(), send_args("all rows"))]
    );

    // Next round: the model re-emits the call with a changed argument — held again, under a
    // new interrupt; the person rejects it and the agent gets a typed refusal.
    let next = after_email(vec![
        json!({"role": "assistant", "content": null, "tool_calls": [chat_call("call_send", "send_email", send_args("all rows"))]}),
        json!({"role": "tool", "tool_call_id": "call_send", "content": "sent"}),
    ]);
    let second = agent(
        &h,
        "/v1/chat/completions",
        next,
        as_person("alice", "run-1"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    let id2 = listed[0]["interruptId"].as_str().unwrap().to_owned();
    assert_ne!(id2, id, "a new interrupt");
    assert_ne!(
        listed[0]["calls"][0]["argsHash"].as_str().unwrap(),
        first_hash
    );
    let (status, _) = resolve(&h, &format!("/approvals/{id2}"), &bearer(&alice), "reject").await;
    assert_eq!(status, 200);
    let (status, _, body) = second.await.unwrap();
    let err = json_of(&body);
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (422, Some("approval_rejected")),
        "{err}"
    );

    // Metrics: held, approved, rejected and the wait time.
    assert_eq!(
        metric(&h, "turnguard_approvals_total{result=\"held\"}").await,
        2.0
    );
    assert_eq!(
        metric(&h, "turnguard_approvals_total{result=\"approved\"}").await,
        1.0
    );
    assert_eq!(
        metric(&h, "turnguard_approvals_total{result=\"rejected\"}").await,
        1.0
    );
    assert_eq!(
        metric(
            &h,
            "turnguard_approval_wait_seconds_count{result=\"approved\"}"
        )
        .await,
        1.0
    );
    assert!(
        metric(
            &h,
            "turnguard_approval_wait_seconds_sum{result=\"approved\"}"
        )
        .await
            > 0.3
    );

    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let rows: Vec<(String, String, Option<String>, Option<String>)> = conn
        .prepare("SELECT interrupt_id, state, resolved_by, consumed_by FROM interrupts ORDER BY requested_at_ms")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (rows[0].1.as_str(), rows[0].2.as_deref()),
        ("accepted", Some("alice"))
    );
    assert!(rows[0].3.is_some(), "the approval was used once");
    assert_eq!(rows[1].1, "rejected");
    let events: Vec<(String, String)> = conn
        .prepare("SELECT type, payload FROM events WHERE run_id = 'run-1' AND type LIKE 'interrupt.%' ORDER BY sequence")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "interrupt.requested",
            "interrupt.resolved",
            "interrupt.requested",
            "interrupt.resolved"
        ]
    );
    let resolved: Value = serde_json::from_str(&events[1].1).unwrap();
    assert_eq!(resolved["resumeValue"]["action"], "accept");
    assert_eq!(resolved["interruptId"], json!(id));
    for (_, p) in &events {
        assert!(!p.contains("all rows"), "no arguments in events: {p}");
    }
    let (outcome, trust): (String, String) = conn
        .query_row(
            "SELECT c.outcome, r.content_trust FROM tool_calls c JOIN rounds r USING (request_id) WHERE c.call_id = 'call_send'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(
        (outcome.as_str(), trust.as_str()),
        ("executed", "untrusted")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn approval_expiry_and_no_person_refuse() {
    let (h, _keys) = start(1_000).await;
    let alice = token("alice", json!({}));
    let send = || json!({"json": chat_response("", vec![chat_call("call_send", "send_email", send_args("x"))])});
    h.script(&json!({"responses": [send(), send()]})).await;

    // Nobody approves in time: refused, and a late approval finds it resolved.
    let started = std::time::Instant::now();
    let waiting = agent(
        &h,
        "/v1/chat/completions",
        after_email(vec![]),
        as_person("alice", "run-exp"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    let id = listed[0]["interruptId"].as_str().unwrap().to_owned();
    let (status, _, body) = waiting.await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "it waited for the timeout"
    );
    let err = json_of(&body);
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (422, Some("approval_rejected")),
        "{err}"
    );
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("approval_expired"),
        "{err}"
    );
    let (status, late) = resolve(&h, &format!("/approvals/{id}"), &bearer(&alice), "accept").await;
    assert_eq!(
        (status, late["details"]["state"].as_str()),
        (409, Some("expired")),
        "{late}"
    );

    // No principal token: the agent acts, nobody can approve: refused at once.
    let started = std::time::Instant::now();
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/chat/completions", h.url()),
        &[("turnguard-run", "run-anon".into())],
        Some(&after_email(vec![])),
    )
    .await;
    let err = json_of(&body);
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (422, Some("approval_rejected")),
        "{err}"
    );
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no_approver"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "not held for the timeout"
    );
    assert!(pending(&h, &alice).await.is_empty());

    // A bad principal token fails the request; it never reads as "no person".
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/chat/completions", h.url()),
        &[("turnguard-principal-token", "forged".into())],
        Some(&after_email(vec![])),
    )
    .await;
    assert_eq!(
        (status, json_of(&body)["error"]["code"].as_str()),
        (401, Some("unauthenticated"))
    );

    assert_eq!(
        metric(&h, "turnguard_approvals_total{result=\"held\"}").await,
        2.0
    );
    assert_eq!(
        metric(&h, "turnguard_approvals_total{result=\"expired\"}").await,
        1.0
    );
    assert_eq!(
        metric(&h, "turnguard_approvals_total{result=\"rejected\"}").await,
        1.0
    );
    assert_eq!(
        metric(
            &h,
            "turnguard_approval_wait_seconds_count{result=\"expired\"}"
        )
        .await,
        1.0
    );
    h.stop().await;
}

// ---- trust of a turn: trusted, provider-executed output, sticky runs -------------------------

fn anthropic_tools() -> Value {
    json!([
        {"name": "send_email", "input_schema": {"type": "object"}},
        {"name": "get_weather", "input_schema": {"type": "object"}}
    ])
}

fn anthropic_send(id: &str) -> Value {
    json!({
        "id": "msg_test", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "tool_use", "id": id, "name": "send_email", "input": send_args("hello")}],
        "stop_reason": "tool_use", "stop_sequence": null,
        "usage": {"input_tokens": 10, "output_tokens": 10}
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn trusted_turn_releases_and_provider_output_is_untrusted() {
    let (h, _keys) = start(30_000).await;
    let alice = token("alice", json!({}));
    h.script(&json!({"responses": [
        {"json": anthropic_send("toolu_1")},
        {"json": anthropic_send("toolu_2")},
        {"json": anthropic_send("toolu_3")},
        {"json": chat_response("", vec![chat_call("call_a", "send_email", send_args("x"))])},
        {"json": chat_response("", vec![chat_call("call_b", "send_email", send_args("x"))])},
    ]}))
    .await;
    let headers = |run: &str| {
        let mut h = as_person("alice", run);
        h.push(("anthropic-version", "2023-06-01".into()));
        h
    };
    // Trusted: only the person's message. The write call is released at once.
    let trusted = json!({"model": "claude-test", "max_tokens": 1024, "tools": anthropic_tools(),
        "messages": [{"role": "user", "content": "Email eve that I am late."}]});
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/messages", h.url()),
        &headers("run-t"),
        Some(&trusted),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["content"][0]["name"], "send_email");

    // The only untrusted input is a provider-executed `web_search_tool_result`: held.
    let web = json!({"model": "claude-test", "max_tokens": 1024, "tools": anthropic_tools(),
    "messages": [
        {"role": "user", "content": "Search the weather, then email eve."},
        {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "weather"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [{"type": "web_search_result", "title": "approved", "url": "https://example.test", "encrypted_content": "x"}]},
            {"type": "text", "text": "It is sunny."}
        ]},
        {"role": "user", "content": "Thanks. Now send it."}
    ]});
    let waiting = agent(&h, "/v1/messages", web, headers("run-w"));
    let listed = wait_pending(&h, &alice, 1).await;
    assert_eq!(
        listed[0]["calls"][0]["heldBecause"]["reason"],
        "untrusted_turn"
    );
    let (status, _) = resolve_node(
        &h,
        "run-w",
        listed[0]["interruptId"].as_str().unwrap(),
        &bearer(&alice),
        "accept",
    )
    .await;
    assert_eq!(status, 200);
    let (status, _, body) = waiting.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["content"][0]["id"], "toolu_2");

    // A clean transcript, but the request lets the provider search the web in this very turn:
    // the model may read web content before it calls a tool, so the turn is untrusted.
    let mut searching = trusted.clone();
    searching["tools"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "web_search_20250305", "name": "web_search", "max_uses": 1}));
    let waiting = agent(&h, "/v1/messages", searching, headers("run-d"));
    let listed = wait_pending(&h, &alice, 1).await;
    assert_eq!(listed[0]["runId"], "run-d");
    resolve_node(
        &h,
        "run-d",
        listed[0]["interruptId"].as_str().unwrap(),
        &bearer(&alice),
        "reject",
    )
    .await;
    assert_eq!(waiting.await.unwrap().0, 422);

    // Sticky: run-s read an email once; a later turn of run-s with a clean transcript is still
    // untrusted. The same clean turn in another run is trusted.
    let clean = json!({"model": "gpt-4o-mini", "tools": chat_tools(), "messages": [{"role": "user", "content": "Email eve."}]});
    let h1 = agent(
        &h,
        "/v1/chat/completions",
        after_email(vec![]),
        as_person("alice", "run-s"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    resolve(
        &h,
        &format!("/approvals/{}", listed[0]["interruptId"].as_str().unwrap()),
        &bearer(&alice),
        "reject",
    )
    .await;
    assert_eq!(h1.await.unwrap().0, 422);
    let later = agent(
        &h,
        "/v1/chat/completions",
        clean.clone(),
        as_person("alice", "run-s"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    assert_eq!(listed[0]["runId"], "run-s", "held: the run stays untrusted");
    resolve_node(
        &h,
        "run-s",
        listed[0]["interruptId"].as_str().unwrap(),
        &bearer(&alice),
        "accept",
    )
    .await;
    assert_eq!(later.await.unwrap().0, 200);
    assert_eq!(
        metric(&h, "turnguard_turns_total{trust=\"trusted\"}").await,
        1.0
    );
    assert_eq!(
        metric(&h, "turnguard_turns_total{trust=\"untrusted\"}").await,
        4.0
    );

    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let sticky: Vec<String> = conn.column("SELECT run_id FROM run_trust ORDER BY run_id");
    assert_eq!(sticky, ["run-d", "run-s", "run-w"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn approved_context_lets_a_hold_rule_pass_once() {
    // A trusted turn; the bundle's `exec-needs-a-person` rule holds `run_shell` unless
    // `context.approved`. The approval covers that argsHash once: the same call in the next
    // round is held again.
    let (h, _keys) = start(30_000).await;
    let alice = token("alice", json!({}));
    let shell = || json!({"json": chat_response("", vec![chat_call("call_sh", "run_shell", json!({"command": "ls"}))])});
    h.script(&json!({"responses": [shell(), shell()]})).await;
    let body = json!({"model": "gpt-4o-mini", "tools": chat_tools(), "messages": [{"role": "user", "content": "list files"}]});
    let waiting = agent(
        &h,
        "/v1/chat/completions",
        body.clone(),
        as_person("alice", "run-x"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    assert_eq!(
        listed[0]["calls"][0]["heldBecause"]["stage"],
        "authorization"
    );
    resolve_node(
        &h,
        "run-x",
        listed[0]["interruptId"].as_str().unwrap(),
        &bearer(&alice),
        "accept",
    )
    .await;
    let (status, _, resp) = waiting.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(released_calls(&json_of(&resp))[0].0, "run_shell");
    let mut again = body;
    again["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": null, "tool_calls": [chat_call("call_sh", "run_shell", json!({"command": "ls"}))]}),
        json!({"role": "tool", "tool_call_id": "call_sh", "content": "a b c"}),
    ]);
    // The tool's output is untrusted, so this turn is too; either way the call is held again.
    let waiting = agent(
        &h,
        "/v1/chat/completions",
        again,
        as_person("alice", "run-x"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    assert_eq!(listed[0]["calls"][0]["toolName"], "run_shell");
    resolve_node(
        &h,
        "run-x",
        listed[0]["interruptId"].as_str().unwrap(),
        &bearer(&alice),
        "reject",
    )
    .await;
    assert_eq!(waiting.await.unwrap().0, 422);
    h.stop().await;
}

/// Authorization decisions of tools no rule reads the arguments of are remembered per
/// principal, tool and context facts (`Rules::authorize`). Facts that differ only in
/// `context.approved` must get their own decisions: the same person, run, model, tool and
/// trust are decided unapproved (held, and the approval probe finds the hold rule can be
/// lifted), approved (released), and unapproved again on a new request that no approval covers
/// any more (a new user message, so it is no recovery), which is held again. With `approved`
/// left out of the memo's key, the first round's probe would get the remembered hold, the call
/// would be refused outright, and no approval would ever be listed (the test fails waiting).
#[tokio::test(flavor = "multi_thread")]
async fn a_remembered_decision_never_answers_other_approval_facts() {
    let (h, _keys) = start(30_000).await;
    let alice = token("alice", json!({}));
    let shell = || json!({"json": chat_response("", vec![chat_call("call_sh", "run_shell", json!({"command": "ls"}))])});
    h.script(&json!({"responses": [shell(), shell()]})).await;
    for (round, verdict) in [(1, "accept"), (2, "reject")] {
        let ask = format!("list files ({round})");
        let body = json!({"model": "gpt-4o-mini", "tools": chat_tools(), "messages": [{"role": "user", "content": ask}]});
        // One run; each round its own node (the interrupt of a held round is per node).
        let mut headers = as_person("alice", "run-m");
        headers.push(("turnguard-node", format!("n{round}")));
        let waiting = agent(&h, "/v1/chat/completions", body, headers);
        let listed = wait_pending(&h, &alice, 1).await;
        assert_eq!(
            listed[0]["calls"][0]["heldBecause"]["stage"], "authorization",
            "round {round} is held by the exec rule"
        );
        let id = listed[0]["interruptId"].as_str().unwrap();
        let (resolved, _) =
            resolve(&h, &format!("/approvals/{id}"), &bearer(&alice), verdict).await;
        assert_eq!(resolved, 200, "round {round}");
        let (status, _, resp) = waiting.await.unwrap();
        if verdict == "accept" {
            assert_eq!(status, 200);
            assert_eq!(released_calls(&json_of(&resp))[0].0, "run_shell");
        } else {
            assert_eq!(status, 422, "round {round}: {resp:?}");
        }
    }
    h.stop().await;
}

// ---- streaming -------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn streamed_text_flows_keepalives_while_held_then_the_sdk_parses_the_released_call() {
    let (h, _keys) = start(30_000).await;
    let alice = token("alice", json!({}));
    h.script(&script(
        json!([
            {"file": "anthropic-messages/stream-text-then-tool-use.sse"},
            {"file": "anthropic-messages/stream-text-then-tool-use.sse"}
        ]),
        &fixtures(),
    ))
    .await;

    // A raw client: text arrives while the call is held, then keep-alives, then the call.
    let mut req = http::Request::post(format!("{}/v1/messages", h.url()))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01");
    for (k, v) in as_person("alice", "run-stream") {
        req = req.header(k, v);
    }
    let client = Client::builder(TokioExecutor::new()).build_http();
    let resp = client
        .request(
            req.body(Full::new(Bytes::from(
                anthropic_after_email(true).to_string(),
            )))
            .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = String::new();
    async fn more(body: &mut hyper::body::Incoming, got: &mut String) {
        let frame = tokio::time::timeout(Duration::from_secs(20), body.frame())
            .await
            .expect("a frame in time")
            .expect("stream open")
            .expect("frame");
        if let Ok(d) = frame.into_data() {
            got.push_str(&String::from_utf8_lossy(&d));
        }
    }
    while !got.contains("current weather in Paris") {
        more(&mut body, &mut got).await;
    }
    let listed = wait_pending(&h, &alice, 1).await;
    assert_eq!(listed[0]["calls"][0]["toolName"], "get_weather");
    while got.matches(": keep-alive\n\n").count() < 2 {
        more(&mut body, &mut got).await;
    }
    assert!(
        !got.contains("tool_use"),
        "no tool-call event before the approval"
    );
    let (status, _) = resolve_node(
        &h,
        "run-stream",
        listed[0]["interruptId"].as_str().unwrap(),
        &bearer(&alice),
        "accept",
    )
    .await;
    assert_eq!(status, 200);
    while !got.contains("message_stop") {
        more(&mut body, &mut got).await;
    }
    let data = support::sse_data(got.as_bytes());
    let start = data
        .iter()
        .find(|d| d["type"] == "content_block_start" && d["content_block"]["type"] == "tool_use")
        .expect("the tool call follows the approval");
    assert_eq!(start["content_block"]["name"], "get_weather");
    assert_eq!(start["index"], 1);

    // The official SDK parses the same held-then-released stream.
    let token = agent_token("alice");
    let url = h.url();
    let sdk = tokio::task::spawn_blocking(move || {
        std::process::Command::new(support::python())
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/held_stream.py"))
            .args(["--turnguard", &url, "--token", &token, "--run", "run-sdk"])
            .arg("--request")
            .arg(anthropic_after_email(true).to_string())
            .output()
            .expect("python runs")
    });
    let listed = wait_pending(&h, &alice, 1).await;
    let (status, _) = resolve_node(
        &h,
        "run-sdk",
        listed[0]["interruptId"].as_str().unwrap(),
        &bearer(&alice),
        "accept",
    )
    .await;
    assert_eq!(status, 200);
    let out = sdk.await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(parsed["stop_reason"], "tool_use");
    assert_eq!(
        parsed["tool_uses"],
        json!([{"name": "get_weather", "input": {"location": "Paris"}}])
    );
    assert!(parsed["text"]
        .as_str()
        .unwrap()
        .contains("current weather in Paris"));
    h.stop().await;
}

// ---- v2-tool-clarification -----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn v2_tool_clarification() {
    let (h, _keys) = start(30_000).await;
    let alice = token("alice", json!({}));
    let ask = |id: &str| chat_call(id, "ask_user", json!({"question": "Which address?"}));
    h.script(&json!({"responses": [
        {"json": chat_response("", vec![ask("call_ask"), chat_call("call_after", "send_email", send_args("x"))])},
        {"json": chat_response("", vec![chat_call("call_held", "send_email", send_args("y")), ask("call_ask2"), chat_call("call_w", "get_weather", json!({}))])},
        {"json": chat_response("", vec![ask("call_ask3")])},
    ]}))
    .await;

    // An ask ends the turn: the call after it is dropped.
    let trusted = json!({"model": "gpt-4o-mini", "tools": chat_tools(), "messages": [{"role": "user", "content": "Email my landlord."}]});
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/chat/completions", h.url()),
        &as_person("alice", "run-c"),
        Some(&trusted),
    )
    .await;
    assert_eq!(status, 200);
    let resp = json_of(&body);
    assert_eq!(
        released_calls(&resp),
        vec![("ask_user".to_owned(), json!({"question": "Which address?"}))]
    );
    assert_eq!(resp["choices"][0]["finish_reason"], "tool_calls");

    // A held approval before the ask is resolved first: nothing reaches the agent until the
    // person accepts; then the held call and the ask go out, the call after the ask does not.
    let waiting = agent(
        &h,
        "/v1/chat/completions",
        after_email(vec![]),
        as_person("alice", "run-c2"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    assert_eq!(
        listed[0]["calls"].as_array().unwrap().len(),
        1,
        "only the held call is bound"
    );
    assert_eq!(listed[0]["calls"][0]["toolName"], "send_email");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "the ask waits behind the held approval"
    );
    resolve_node(
        &h,
        "run-c2",
        listed[0]["interruptId"].as_str().unwrap(),
        &bearer(&alice),
        "accept",
    )
    .await;
    let (status, _, body) = waiting.await.unwrap();
    assert_eq!(status, 200);
    let names: Vec<String> = released_calls(&json_of(&body))
        .into_iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(names, ["send_email", "ask_user"]);

    // Asks beyond `limits.clarification_rounds` (2) are refused with a typed error.
    let mut asked = trusted.clone();
    for id in ["q1", "q2"] {
        asked["messages"].as_array_mut().unwrap().extend([
            json!({"role": "assistant", "content": null, "tool_calls": [ask(id)]}),
            json!({"role": "tool", "tool_call_id": id, "content": "Main street 1"}),
        ]);
    }
    // The answers come from ask_user, a trusted tool: the turn stays trusted.
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/chat/completions", h.url()),
        &as_person("alice", "run-c3"),
        Some(&asked),
    )
    .await;
    let err = json_of(&body);
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (422, Some("loop_limit_exceeded")),
        "{err}"
    );
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("clarification_rounds_exceeded"));

    // A model without tool support cannot ask: a typed failure, nothing goes upstream.
    let before = h.mock_requests().await.len();
    let mut no_tools = trusted;
    no_tools["model"] = json!("text-only-7b");
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/chat/completions", h.url()),
        &as_person("alice", "run-c4"),
        Some(&no_tools),
    )
    .await;
    assert_eq!(
        (status, json_of(&body)["error"]["code"].as_str()),
        (422, Some("capability_not_provided"))
    );
    assert_eq!(h.mock_requests().await.len(), before);

    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let dropped: Vec<(String, String, String)> = conn
        .prepare("SELECT call_id, outcome, reason FROM tool_calls WHERE call_id IN ('call_after', 'call_w') ORDER BY call_id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        dropped,
        [
            (
                "call_after".into(),
                "ended-turn".into(),
                "after_clarification".into()
            ),
            (
                "call_w".into(),
                "ended-turn".into(),
                "after_clarification".into()
            )
        ]
    );
}
