//! Attacks on this leg: see [`super`] for the attacker and the rule.
//!
//! The agent holds the person's data-plane token and plays every trick it has to approve its
//! own held call (a restart that empties turnguard's memory, a second signature of the same
//! claims); the admin-plane client resolves by node instead of by interrupt; the agent leaves a
//! held stream and comes back. Tool-turn contract §C; OpenWOP interrupt.md.

use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support;
use support::approvals::*;
use support::{fixtures, script};

/// The order of the P-256 group, big-endian (SEC 2 §2.4.2).
const P256_N: [u8; 32] = [
    0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xbc, 0xe6, 0xfa, 0xad, 0xa7, 0x17, 0x9e, 0x84, 0xf3, 0xb9, 0xca, 0xc2, 0xfc, 0x63, 0x25, 0x51,
];

/// `n − s` over 32-byte big-endian integers.
fn n_minus(s: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    let mut borrow = 0i16;
    for i in (0..32).rev() {
        let mut d = i16::from(P256_N[i]) - i16::from(s[i]) - borrow;
        borrow = i16::from(d < 0);
        if d < 0 {
            d += 256;
        }
        out[i] = d as u8;
    }
    out
}

/// The ES256 token with its signature's `s` replaced by `n − s`: a second valid signature of
/// the very same header and claims (ECDSA malleability).
fn twin(token: &str) -> String {
    let (input, sig) = token.rsplit_once('.').unwrap();
    let mut sig = URL_SAFE_NO_PAD.decode(sig).unwrap();
    assert_eq!(sig.len(), 64, "an ES256 signature is r || s");
    let s = n_minus(&sig[32..]);
    sig[32..].copy_from_slice(&s);
    format!("{input}.{}", URL_SAFE_NO_PAD.encode(sig))
}

/// Whether the token's `s` is in the upper half of the group order.
fn high_s(token: &str) -> bool {
    let sig = URL_SAFE_NO_PAD
        .decode(token.rsplit_once('.').unwrap().1)
        .unwrap();
    let s = &sig[32..];
    let half = {
        // n / 2, big-endian: shift n right by one bit.
        let mut h = [0u8; 32];
        let mut carry = 0u8;
        for (i, b) in P256_N.iter().enumerate() {
            h[i] = (b >> 1) | (carry << 7);
            carry = b & 1;
        }
        h
    };
    s > &half[..]
}

/// An ES256 token over `claims` whose signature is in low-S form (what an honest signer that
/// normalizes produces; the data plane accepts it).
fn low_s_token(claims: &Value) -> String {
    let t = es256_token(claims);
    if high_s(&t) {
        twin(&t)
    } else {
        t
    }
}

/// The model's held call (the send in an untrusted turn) for each agent request, in order.
async fn model_sends(h: &support::Harness, bodies: &[&str]) {
    let steps: Vec<Value> = bodies
        .iter()
        .enumerate()
        .map(|(i, b)| {
            json!({"json": chat_response("", vec![chat_call(&format!("call_send_{i}"), "send_email", send_args(b))])})
        })
        .collect();
    h.script(&json!({ "responses": steps })).await;
}

fn agent_with(token: &str, run: &str) -> Vec<(&'static str, String)> {
    vec![
        ("turnguard-principal-token", token.to_owned()),
        ("turnguard-run", run.to_owned()),
    ]
}

/// Issue 10 item 1: the set of tokens seen on the data plane lived in memory only, so after a
/// restart the agent's own principal token approved its own pending interrupt.
#[tokio::test(flavor = "multi_thread")]
async fn the_agents_token_cannot_approve_after_a_restart() {
    let (h, keys) = start(120_000).await;
    let alice = token("alice", json!({}));
    let held_by_agent = agent_token("alice");
    model_sends(&h, &["the customer list"]).await;
    let waiting = agent(
        &h,
        "/v1/chat/completions",
        after_email(vec![]),
        agent_with(&held_by_agent, "run-restart"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    let id = listed[0]["interruptId"].as_str().unwrap().to_owned();
    let path = format!("/approvals/{id}");
    let (status, err) = resolve(&h, &path, &bearer(&held_by_agent), "accept").await;
    assert_eq!(
        (status, err["error"].as_str()),
        (403, Some("forbidden")),
        "before the restart: {err}"
    );
    waiting.abort();

    let h = restart(h, &keys, 120_000).await;
    assert_eq!(
        pending(&h, &alice).await.len(),
        1,
        "the interrupt is still pending after the restart"
    );
    let (status, err) = resolve(&h, &path, &bearer(&held_by_agent), "accept").await;
    assert_eq!(
        (status, err["error"].as_str()),
        (403, Some("forbidden")),
        "after a restart the agent's own principal token approved its pending interrupt: {err}"
    );
    let (status, _, _) = support::call(
        "GET",
        &format!("{}/approvals", h.admin_url()),
        &bearer(&held_by_agent),
        None,
    )
    .await;
    assert_eq!(status, 403, "nor does it list the person's approvals");
    // The person's own token still resolves it.
    let (status, body) = resolve(&h, &path, &bearer(&alice), "reject").await;
    assert_eq!(status, 200, "{body}");
    h.stop().await;
}

/// Issue 10 item 1: an ES256 token with its signature's `s` replaced by `n − s` verifies (a
/// second valid signature of the same claims) and was not recognised as the agent's token.
/// High-S signatures are refused outright, on both planes.
#[tokio::test(flavor = "multi_thread")]
async fn an_n_minus_s_twin_of_the_agents_token_is_refused_on_both_planes() {
    let (h, _keys) = start(120_000).await;
    let alice = token("alice", json!({}));
    let held_by_agent = low_s_token(&claims("alice", json!({"jti": "agent-es256-1"})));
    let forged = twin(&held_by_agent);
    assert!(high_s(&forged) && !high_s(&held_by_agent));
    model_sends(&h, &["the customer list"]).await;
    let waiting = agent(
        &h,
        "/v1/chat/completions",
        after_email(vec![]),
        agent_with(&held_by_agent, "run-twin"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    let id = listed[0]["interruptId"].as_str().unwrap().to_owned();
    let (status, err) = resolve(&h, &format!("/approvals/{id}"), &bearer(&forged), "accept").await;
    assert_eq!(
        (status, err["error"].as_str()),
        (401, Some("unauthenticated")),
        "the n − s twin of the agent's token resolved its interrupt: {err}"
    );
    assert!(
        err["message"].as_str().unwrap().contains("high-S"),
        "the refusal says why: {err}"
    );
    assert_eq!(pending(&h, &alice).await.len(), 1, "still pending");
    // The data plane refuses a high-S token as well.
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/chat/completions", h.url()),
        &agent_with(&forged, "run-twin-2"),
        Some(&after_email(vec![])),
    )
    .await;
    assert_eq!(
        (status, json_of(&body)["error"]["code"].as_str()),
        (401, Some("unauthenticated")),
        "{}",
        String::from_utf8_lossy(&body)
    );
    resolve(&h, &format!("/approvals/{id}"), &bearer(&alice), "reject").await;
    assert_eq!(waiting.await.unwrap().0, 422);
    h.stop().await;
}

/// Issue 10 item 1: the rule is bound to what the token says, not to its bytes: the identity
/// provider's second signature of the agent's claims (ECDSA signs with a fresh nonce, so the
/// bytes differ) is still the agent's token.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_signature_of_the_agents_claims_cannot_approve() {
    let (h, _keys) = start(120_000).await;
    let alice = token("alice", json!({}));
    let said = claims("alice", json!({"jti": "agent-es256-2"}));
    let held_by_agent = low_s_token(&said);
    let resigned = (0..64)
        .map(|_| low_s_token(&said))
        .find(|t| *t != held_by_agent)
        .expect("ECDSA signatures differ");
    model_sends(&h, &["the customer list"]).await;
    let waiting = agent(
        &h,
        "/v1/chat/completions",
        after_email(vec![]),
        agent_with(&held_by_agent, "run-resigned"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    let id = listed[0]["interruptId"].as_str().unwrap().to_owned();
    let (status, err) = resolve(
        &h,
        &format!("/approvals/{id}"),
        &bearer(&resigned),
        "accept",
    )
    .await;
    assert_eq!(
        (status, err["error"].as_str()),
        (403, Some("forbidden")),
        "another signature of the agent's own claims approved its interrupt: {err}"
    );
    resolve(&h, &format!("/approvals/{id}"), &bearer(&alice), "reject").await;
    assert_eq!(waiting.await.unwrap().0, 422);
    h.stop().await;
}

/// Issue 10 item 2: `POST /runs/{runId}/interrupts/{nodeId}` resolved the node's newest
/// interrupt, so a call raised after the person looked was approved in place of the one they
/// reviewed. The node form now resolves exactly the interrupt its body names (`interruptId`),
/// and without one it is refused (400 `validation_error`).
#[tokio::test(flavor = "multi_thread")]
async fn the_node_form_resolves_only_the_interrupt_the_person_reviewed() {
    let (h, _keys) = start(120_000).await;
    let alice = token("alice", json!({}));
    model_sends(
        &h,
        &["the reviewed reply", "the customer list, raised later"],
    )
    .await;
    let reviewed = agent(
        &h,
        "/v1/chat/completions",
        after_email(vec![]),
        as_person("alice", "run-node"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    let seen = listed[0]["interruptId"].as_str().unwrap().to_owned();
    assert_eq!(
        listed[0]["calls"][0]["arguments"]["body"],
        "the reviewed reply"
    );

    // After the person looked, the agent raises another held call in the same node.
    let later = agent(
        &h,
        "/v1/chat/completions",
        after_email(vec![json!({"role": "user", "content": "And one more."})]),
        as_person("alice", "run-node"),
    );
    let listed = wait_pending(&h, &alice, 2).await;
    let unseen = listed
        .iter()
        .map(|i| i["interruptId"].as_str().unwrap().to_owned())
        .find(|i| *i != seen)
        .unwrap();

    // The person accepts "the node's interrupt", as OpenWOP's body `{resumeValue}` says.
    let (status, err) = resolve(
        &h,
        "/runs/run-node/interrupts/default",
        &bearer(&alice),
        "accept",
    )
    .await;
    assert_eq!(
        (status, err["error"].as_str()),
        (400, Some("validation_error")),
        "the node form resolved an interrupt the body does not name: {err}"
    );
    assert!(
        err["message"].as_str().unwrap().contains("interruptId"),
        "{err}"
    );
    assert_eq!(pending(&h, &alice).await.len(), 2, "nothing was resolved");

    // An id of another node or run is not found there.
    let (status, _) = resolve_node(&h, "run-other", &seen, &bearer(&alice), "accept").await;
    assert_eq!(status, 404);

    // Naming the reviewed interrupt resolves exactly it.
    let (status, body) = resolve_node(&h, "run-node", &seen, &bearer(&alice), "accept").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["interruptId"], json!(seen));
    let (status, _, resp) = reviewed.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        released_calls(&json_of(&resp)),
        vec![("send_email".to_owned(), send_args("the reviewed reply"))]
    );
    let still: Vec<Value> = pending(&h, &alice).await;
    assert_eq!(still.len(), 1);
    assert_eq!(still[0]["interruptId"], json!(unseen));
    resolve(
        &h,
        &format!("/approvals/{unseen}"),
        &bearer(&alice),
        "reject",
    )
    .await;
    assert_eq!(later.await.unwrap().0, 422);
    h.stop().await;
}

/// An agent on a raw socket: writes one streaming request and reads until `until` arrived.
async fn raw_stream_agent(
    h: &support::Harness,
    body: &Value,
    headers: &[(&'static str, String)],
    until: &str,
) -> tokio::net::TcpStream {
    let mut sock = tokio::net::TcpStream::connect(h.tg.addr).await.unwrap();
    let body = body.to_string();
    let mut req = format!(
        "POST /v1/messages HTTP/1.1\r\nhost: turnguard\r\ncontent-type: application/json\r\nanthropic-version: 2023-06-01\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(until) {
        let n = tokio::time::timeout(Duration::from_secs(20), sock.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no `{until}` in time: {}", String::from_utf8_lossy(&got)))
            .unwrap();
        assert!(n > 0, "the stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    sock
}

/// Issue 10 item 3: when the agent disconnected while its held stream waited, the accepted
/// approval was consumed by the dead relay, and the agent's re-send got
/// `approval_already_used`. The approval is consumed only when its calls are delivered.
#[tokio::test(flavor = "multi_thread")]
async fn an_approval_is_not_spent_by_a_stream_whose_agent_left() {
    let (h, _keys) = start(120_000).await;
    let alice = token("alice", json!({}));
    h.script(&script(
        json!([
            {"file": "anthropic-messages/stream-text-then-tool-use.sse"},
            {"file": "anthropic-messages/stream-text-then-tool-use.sse"}
        ]),
        &fixtures(),
    ))
    .await;
    let headers = as_person("alice", "run-gone");
    let request = anthropic_after_email(true);
    let sock = raw_stream_agent(&h, &request, &headers, "current weather in Paris").await;
    let listed = wait_pending(&h, &alice, 1).await;
    let id = listed[0]["interruptId"].as_str().unwrap().to_owned();
    // The agent goes away; turnguard notices at its next keep-alive. The relay of a stream
    // whose agent left ends (`turnguard_inflight_streams` back to 0), or at the latest the
    // person's resolution below meets it.
    drop(sock);
    for _ in 0..100 {
        if metric(&h, "turnguard_inflight_streams").await == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = resolve(&h, &format!("/approvals/{id}"), &bearer(&alice), "accept").await;
    assert_eq!(status, 200, "{body}");

    // The agent re-sends the same request: it meets the accepted interrupt and gets the call.
    let (status, _, resent) = support::call(
        "POST",
        &format!("{}/v1/messages", h.url()),
        &[
            headers.clone(),
            vec![("anthropic-version", "2023-06-01".into())],
        ]
        .concat(),
        Some(&request),
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&resent);
    assert!(
        !text.contains("approval_already_used"),
        "the dead relay spent the approval: {text}"
    );
    let events = support::sse_data(&resent);
    assert!(
        events.iter().any(|e| e["type"] == "content_block_start"
            && e["content_block"]["type"] == "tool_use"
            && e["content_block"]["name"] == "get_weather"),
        "the approved call reaches the agent that is there: {text}"
    );
    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let consumed: Vec<Option<String>> = conn.column("SELECT consumed_by FROM interrupts");
    assert_eq!(consumed.len(), 1);
    assert!(consumed[0].is_some(), "used once, by the delivered stream");
}
