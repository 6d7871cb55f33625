//! The dispatch stage (issue 13 item 3): rate-limit tokens are taken once, for the calls
//! actually released, after surfacing and approval — never while a round waits — and the
//! per-run call budget survives a restart (its counter is seeded from the journal).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)] // test code

use std::path::Path;

use serde_json::{json, Value};
use turnguard::mock_provider::Script;

use crate::support::approvals::*;
use crate::support::{self, own_fixtures, Harness};

/// The trust bundle with `limits` added (keys of `[limits]`, then any tables after the file's
/// own): written to `dir/policy`, its path returned.
fn trust_bundle_with(dir: &Path, limits: &str) -> std::path::PathBuf {
    let src = own_fixtures().join("policy-trust");
    let dst = dir.join("policy");
    for sub in ["rules", "tools"] {
        std::fs::create_dir_all(dst.join(sub)).unwrap();
        for e in std::fs::read_dir(src.join(sub)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dst.join(sub).join(e.file_name())).unwrap();
        }
    }
    let toml = std::fs::read_to_string(src.join("turnguard.toml")).unwrap();
    assert!(toml.contains("[limits]\n"));
    let (keys, tables) = limits
        .split_once("\n[")
        .map_or((limits, String::new()), |(k, t)| (k, format!("\n[{t}\n")));
    let toml = toml.replace("[limits]\n", &format!("[limits]\n{keys}\n")) + &tables;
    std::fs::write(dst.join("turnguard.toml"), toml).unwrap();
    dst
}

async fn start_in(dir: tempfile::TempDir, keys: &tempfile::TempDir, limits: &str) -> Harness {
    let policy = trust_bundle_with(keys.path(), limits);
    let trust = trust_config(keys.path(), 30_000);
    support::start_in(dir, Script::default(), move |c| {
        trust(c);
        c.policy = policy;
    })
    .await
}

/// A trusted chat transcript asking for a contact.
fn trusted_ask() -> Value {
    json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Look up Bob."}], "tools": chat_tools()})
}

fn lookup(id: &str) -> Value {
    chat_call(id, "lookup_contact", json!({"name": "bob"}))
}

/// With `burst = 2` (never refilled), one approved `[lookup_contact, send_email]` round
/// spends one `lookup_contact` token: the next turn's lookup is released, the one after is
/// rate-limited (the bucket is live). Before the dispatch stage, the round was admitted twice
/// (held, then approved) and took two tokens, so the next lookup was already refused.
#[tokio::test(flavor = "multi_thread")]
async fn an_approved_round_charges_the_rate_bucket_once() {
    let keys = tempfile::tempdir().unwrap();
    let h = start_in(
        tempfile::tempdir().unwrap(),
        &keys,
        "\n[limits.rate]\nburst = 2\nper_minute = 0",
    )
    .await;
    let alice = token("alice", json!({}));
    h.script(&json!({"responses": [
        {"json": chat_response("", vec![lookup("call_lookup"), chat_call("call_send", "send_email", send_args("hi"))])},
        {"json": chat_response("", vec![lookup("call_lookup2")])},
        {"json": chat_response("", vec![lookup("call_lookup3")])},
    ]}))
    .await;

    // Untrusted turn: send_email is held, lookup_contact passes; the round waits.
    let first = agent(
        &h,
        "/v1/chat/completions",
        after_email(vec![]),
        as_person("alice", "run-rate"),
    );
    let listed = wait_pending(&h, &alice, 1).await;
    let id = listed[0]["interruptId"].as_str().unwrap().to_owned();
    let (status, _) = resolve(&h, &format!("/approvals/{id}"), &bearer(&alice), "accept").await;
    assert_eq!(status, 200);
    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let names: Vec<String> = released_calls(&json_of(&body))
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["lookup_contact", "send_email"]);

    // The second token is still there (each turn in a run of its own: the same round of the
    // same run would be served from its record).
    let url = format!("{}/v1/chat/completions", h.url());
    let headers = as_person("alice", "run-rate-2");
    let (status, _, body) = support::call("POST", &url, &headers, Some(&trusted_ask())).await;
    assert_eq!(
        status,
        200,
        "one approved round took one token: {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(released_calls(&json_of(&body)).len(), 1);

    // And then the bucket is empty.
    let headers = as_person("alice", "run-rate-3");
    let (status, _, body) = support::call("POST", &url, &headers, Some(&trusted_ask())).await;
    let err = json_of(&body);
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (429, Some("rate_limited")),
        "{err}"
    );
}

/// `tool_calls_per_run = 1`: a run that used its one call is refused the next, after a
/// restart too — the counter is seeded from the journal, not started again at 0.
#[tokio::test(flavor = "multi_thread")]
async fn the_run_call_budget_survives_a_restart() {
    let keys = tempfile::tempdir().unwrap();
    let limits = "tool_calls_per_run = 1";
    let h = start_in(tempfile::tempdir().unwrap(), &keys, limits).await;
    h.script(&json!({"responses": [{"json": chat_response("", vec![lookup("call_a")])}]}))
        .await;
    let headers = as_person("alice", "run-budget");
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/chat/completions", h.url()),
        &headers,
        Some(&trusted_ask()),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(released_calls(&json_of(&body)).len(), 1);

    let h = start_in(h.stop().await, &keys, limits).await;
    h.script(&json!({"responses": [{"json": chat_response("", vec![lookup("call_b")])}]}))
        .await;
    let next = json!({"model": "gpt-4o-mini", "messages": [
        {"role": "user", "content": "Look up Bob."},
        {"role": "assistant", "content": null, "tool_calls": [lookup("call_a")]},
        {"role": "tool", "tool_call_id": "call_a", "content": "bob@example.test"},
    ], "tools": chat_tools()});
    let (status, _, body) = support::call(
        "POST",
        &format!("{}/v1/chat/completions", h.url()),
        &headers,
        Some(&next),
    )
    .await;
    let err = json_of(&body);
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (429, Some("rate_limited")),
        "{err}"
    );
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the run reached its limit of 1 tool calls"),
        "{err}"
    );
}
