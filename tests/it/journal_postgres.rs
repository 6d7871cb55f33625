//! What only the PostgreSQL journal has (issue 15): several turnguard processes sharing one
//! database. Two servers racing one business key make one claim; a claim taken over from an
//! owner whose lease ran out fences that owner (a stalled-but-alive process cannot complete
//! the claim it lost), while a live owner within its lease keeps its claim and a dead one's is
//! taken over at once; an approval given on server A releases the call waiting on server B.
//!
//! Runs whenever `TURNGUARD_TEST_PG` names a cluster (each test makes its own database; the
//! servers are pointed at it whatever `TURNGUARD_TEST_BACKEND` says), and is skipped with a
//! notice otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)] // test code

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use turnguard::config::Config;
use turnguard::journal::{
    Claim, EffectClaim, Journal, JournalError, JournalLocation, RunKey, CLAIM_LEASE_MS,
};
use turnguard::mock_provider::Script;

use crate::support::approvals::{
    after_email, agent, as_person, bearer, chat_call, chat_response, json_of, released_calls,
    resolve, send_args, token, trust_config, wait_pending,
};
use crate::support::runs::{answer_calls, call, Agent};
use crate::support::{self, own_fixtures, Harness};

/// A fresh database on the `TURNGUARD_TEST_PG` cluster, with the directory that names it;
/// `None` (after a notice) when the variable is unset.
fn database(test: &str) -> Option<(tempfile::TempDir, String)> {
    if std::env::var("TURNGUARD_TEST_PG").is_err() {
        eprintln!("journal_postgres::{test}: skipped (TURNGUARD_TEST_PG is not set)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let url = support::db::pg_database_for(dir.path());
    Some((dir, url))
}

/// Two turnguard servers (each with its own mock model) on the database `url`, configured by
/// `tweak_a` and `tweak_b`.
async fn two_servers(
    url: &str,
    tweak_a: impl FnOnce(&mut Config),
    tweak_b: impl FnOnce(&mut Config),
) -> (Harness, Harness) {
    let on = |url: &str| {
        let url = url.to_owned();
        move |c: &mut Config| c.journal = JournalLocation::parse(&url)
    };
    let (ja, jb) = (on(url), on(url));
    let a = support::start_with(Script::default(), move |c| {
        tweak_a(c);
        ja(c);
    })
    .await;
    let b = support::start_with(Script::default(), move |c| {
        tweak_b(c);
        jb(c);
    })
    .await;
    (a, b)
}

async fn client(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

/// Two servers on one database each get a request whose model calls `charge` with the same
/// `chargeId` (under different call ids, in different runs), at the same time: exactly one
/// claim, one call released, the other withheld as already done.
#[tokio::test(flavor = "multi_thread")]
async fn two_servers_racing_one_business_key_make_one_claim() {
    let Some((_db, url)) = database("two_servers_racing_one_business_key_make_one_claim") else {
        return;
    };
    let bundle = own_fixtures().join("policy-run");
    let bundle_b = bundle.clone();
    let (a, b) = two_servers(&url, |c| c.policy = bundle, |c| c.policy = bundle_b).await;
    let pg = client(&url).await;
    for i in 0..6 {
        let charge = json!({"chargeId": format!("race-{i}"), "amount": 5});
        for (h, side) in [(&a, "a"), (&b, "b")] {
            support::runs::model_says(
                h,
                &[answer_calls(
                    &format!("chatcmpl-{side}{i}"),
                    vec![call(&format!("call_{side}_{i}"), "charge", charge.clone())],
                )],
            )
            .await;
        }
        let run_a = Agent::new(&a, &format!("race-{i}-a"), "Charge 5.");
        let run_b = Agent::new(&b, &format!("race-{i}-b"), "Charge 5.");
        let (ra, rb) = tokio::join!(run_a.send(), run_b.send());
        assert_eq!((ra.status, rb.status), (200, 200), "{ra:?} {rb:?}");
        let released = [&ra, &rb]
            .iter()
            .filter(|r| r.call_names().iter().any(|n| n == "charge"))
            .count();
        assert_eq!(
            released,
            1,
            "round {i}: one server released the charge: {} / {}",
            ra.text_body(),
            rb.text_body()
        );
        let claims: i64 = pg
            .query_one(
                "SELECT count(*) FROM effects WHERE run_id LIKE $1",
                &[&format!("race-{i}-%")],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(claims, 1, "round {i}: exactly one claim");
    }
    a.stop().await;
    b.stop().await;
}

fn charge_claim(effect: &str, call_id: &str, at_ms: i64) -> EffectClaim {
    EffectClaim {
        effect_id: effect.to_owned(),
        tool_id: "test.run:charge".into(),
        call_id: call_id.to_owned(),
        run: RunKey {
            run_id: Some("run-fence".into()),
            node_id: Some("default".into()),
            attempt: Some(1),
        },
        keying: "business-identity",
        at_ms,
        instance: turnguard::journal::instance_id().to_owned(),
        reader: "agent".into(),
    }
}

async fn open(url: &str) -> (Journal, turnguard::journal::WriterThread) {
    Journal::open(
        &JournalLocation::parse(url),
        Arc::new(turnguard::metrics::Metrics::new()),
        Duration::from_secs(1),
    )
    .await
    .unwrap()
}

/// Two journal handles on one database play two replicas. A claim whose lease ran out is
/// taken over (a new epoch); the old owner, stalled but alive, then fails to confirm it
/// (`Fenced`: its call is never released) and its release leaves the new owner's claim alone.
/// A live owner within its lease keeps its claim (the other replica gets the existing one);
/// once that owner's process is gone, its unconfirmed claim is taken over at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_taken_over_fences_its_stale_owner() {
    let Some((_db, url)) = database("a_claim_taken_over_fences_its_stale_owner") else {
        return;
    };
    let (a, writer_a) = open(&url).await;
    let (b, writer_b) = open(&url).await;
    let pg = client(&url).await;
    let now = turnguard::clock::now_ms();

    // A claimed long ago (its lease ran out) and stalled; the same call, re-sent to B (a
    // recovery), takes the claim over.
    let stale = charge_claim("fence-1", "call_1", now - 2 * CLAIM_LEASE_MS);
    assert_eq!(a.claim_effect(stale).await.unwrap(), Claim::Claimed);
    let fresh = charge_claim("fence-1", "call_1", now);
    assert_eq!(b.claim_effect(fresh).await.unwrap(), Claim::Claimed);
    let confirmed = a
        .confirm_claims(vec![("fence-1".into(), "call_1".into())])
        .await;
    assert!(
        matches!(&confirmed, Err(JournalError::Fenced(id)) if id == "fence-1"),
        "the stale owner cannot confirm the claim it lost: {confirmed:?}"
    );
    a.release_claim("fence-1", "call_1").await.unwrap();
    let row = pg
        .query_one(
            "SELECT call_id, epoch, released FROM effects WHERE effect_id = 'fence-1'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2)
        ),
        ("call_1".to_owned(), 1, 0),
        "the claim is the new owner's, at the new epoch, not released"
    );
    b.confirm_claims(vec![("fence-1".into(), "call_1".into())])
        .await
        .unwrap();
    let released: i64 = pg
        .query_one(
            "SELECT released FROM effects WHERE effect_id = 'fence-1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(released, 1);

    // A live owner within its lease keeps its claim.
    let now = turnguard::clock::now_ms();
    assert_eq!(
        a.claim_effect(charge_claim("fence-2", "call_a2", now))
            .await
            .unwrap(),
        Claim::Claimed
    );
    assert_eq!(
        b.claim_effect(charge_claim("fence-2", "call_b2", now))
            .await
            .unwrap(),
        Claim::Existing {
            call_id: "call_a2".into(),
            result: None
        },
        "a live owner's claim is not taken over"
    );
    // A's process goes away (its connections close): B takes the claim over at once.
    drop(a);
    tokio::task::spawn_blocking(move || writer_a.join())
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got = b
            .claim_effect(charge_claim(
                "fence-2",
                "call_b2",
                turnguard::clock::now_ms(),
            ))
            .await
            .unwrap();
        if got == Claim::Claimed {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the dead owner's claim was never taken over: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(b);
    tokio::task::spawn_blocking(move || writer_b.join())
        .await
        .unwrap();
}

/// A call held for approval waits on server B; the person approves on server A (another
/// process on the same database): B's waiting request is released at once (the NOTIFY of
/// A's resolution wakes it), long before the interrupt would expire.
#[tokio::test(flavor = "multi_thread")]
async fn an_approval_on_one_server_releases_the_call_waiting_on_another() {
    let Some((_db, url)) =
        database("an_approval_on_one_server_releases_the_call_waiting_on_another")
    else {
        return;
    };
    let keys = tempfile::tempdir().unwrap();
    let (a, b) = two_servers(
        &url,
        trust_config(keys.path(), 120_000),
        trust_config(keys.path(), 120_000),
    )
    .await;
    let alice = token("alice", json!({}));
    let send = json!({"json": chat_response("", vec![chat_call("call_send", "send_email", send_args("x"))])});
    b.script(&json!({"responses": [send]})).await;

    let waiting = agent(
        &b,
        "/v1/chat/completions",
        after_email(vec![]),
        as_person("alice", "run-across"),
    );
    // The interrupt B raised is listed and approved on A.
    let listed = wait_pending(&a, &alice, 1).await;
    let id = listed[0]["interruptId"].as_str().unwrap().to_owned();
    let (status, won) = resolve(&a, &format!("/approvals/{id}"), &bearer(&alice), "accept").await;
    assert_eq!(status, 200, "{won}");
    let (status, _, body) = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("B's waiting request is released by A's approval, not by the expiry")
        .unwrap();
    let resp = json_of(&body);
    assert_eq!(status, 200, "{resp}");
    let calls = released_calls(&resp);
    assert_eq!(
        calls.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        ["send_email"],
        "{resp}"
    );
    a.stop().await;
    b.stop().await;
}

/// The database goes away under a running server (connections refused, the open ones
/// terminated): a run request fails fast with 503 `turnguard.journal_unavailable` (not after
/// a TCP timeout), `/readyz` follows, and both recover when the database is back.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_that_goes_away_fails_requests_fast_and_readiness_follows() {
    let Some((_db, url)) =
        database("a_database_that_goes_away_fails_requests_fast_and_readiness_follows")
    else {
        return;
    };
    let name = url::Url::parse(&url)
        .unwrap()
        .path()
        .trim_start_matches('/')
        .to_owned();
    let bundle = own_fixtures().join("policy-run");
    let journal = url.clone();
    let h = support::start_with(Script::default(), move |c| {
        c.policy = bundle;
        c.journal = JournalLocation::parse(&journal);
    })
    .await;
    let ready = |h: &Harness| {
        let url = format!("{}/readyz", h.admin_url());
        async move { support::get(&url).await.0 }
    };
    assert_eq!(ready(&h).await, 200);
    let admin = client(&std::env::var("TURNGUARD_TEST_PG").unwrap()).await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {name} ALLOW_CONNECTIONS false;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}';"
        ))
        .await
        .unwrap();

    support::runs::model_says(&h, &[support::runs::answer_text("chatcmpl-gone", "unused")]).await;
    let started = std::time::Instant::now();
    let reply = Agent::new(&h, "run-gone", "Hello.").send().await;
    assert_eq!(reply.status, 503, "{}", reply.text_body());
    assert_eq!(
        reply.json.pointer("/error/code").and_then(|v| v.as_str()),
        Some("turnguard.journal_unavailable"),
        "{}",
        reply.text_body()
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "failed fast: {:?}",
        started.elapsed()
    );
    let until = |want: u16| {
        let h = &h;
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            loop {
                let got = ready(h).await;
                if got == want {
                    return;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "/readyz stayed {got}, want {want}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    until(503).await;

    admin
        .batch_execute(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS true"))
        .await
        .unwrap();
    until(200).await;
    h.stop().await;
}

/// The data plane fails closed when its claim is taken over between the claim and the answer
/// leaving: a trigger plays the other replica (every new claim's epoch is bumped right after
/// it is inserted, as a take-over would), so the server's confirm matches no row. The call is
/// not released (503), on both the JSON and the streaming path.
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_taken_over_before_the_answer_leaves_withholds_the_call() {
    let Some((_db, url)) =
        database("a_claim_taken_over_before_the_answer_leaves_withholds_the_call")
    else {
        return;
    };
    let bundle = own_fixtures().join("policy-run");
    let journal = url.clone();
    let h = support::start_with(Script::default(), move |c| {
        c.policy = bundle;
        c.journal = JournalLocation::parse(&journal);
    })
    .await;
    client(&url)
        .await
        .batch_execute(
            "CREATE FUNCTION take_over() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN UPDATE effects SET epoch = epoch + 1 WHERE effect_id = NEW.effect_id; RETURN NULL; END $$;
             CREATE TRIGGER take_over AFTER INSERT ON effects FOR EACH ROW EXECUTE FUNCTION take_over();",
        )
        .await
        .unwrap();
    let charge = json!({"chargeId": "taken-1", "amount": 5});
    support::runs::model_says(
        &h,
        &[answer_calls(
            "chatcmpl-taken",
            vec![call("call_taken", "charge", charge.clone())],
        )],
    )
    .await;
    let reply = Agent::new(&h, "run-taken", "Charge 5.").send().await;
    assert_eq!(reply.status, 503, "{}", reply.text_body());
    assert!(
        reply.call_names().is_empty(),
        "no call released: {}",
        reply.text_body()
    );

    // The stream: the call's block is withheld, the stream ends with the error.
    let events = support::runs::chat_sse_call(
        "call_taken_2",
        "charge",
        &json!({"chargeId": "taken-2", "amount": 5}),
    );
    h.script(&json!({"responses": [{"sse": events}]})).await;
    let mut body = Agent::new(&h, "run-taken-2", "Charge 5.").body();
    body["stream"] = json!(true);
    let resp = support::post_stream(&format!("{}/v1/chat/completions", h.url()), &body).await;
    let bytes = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let text = String::from_utf8_lossy(&bytes);
    assert!(!text.contains("taken-2"), "the call never left: {text}");
    assert!(
        text.contains("turnguard.journal_unavailable"),
        "the stream ends with the error: {text}"
    );
    h.stop().await;
}

/// The writer pipelines jobs that read no reply as one group under one savepoint; a group
/// with a record the database refuses is rolled back and its jobs run again one by one, so
/// the bad record fails alone and every other job of the group is committed. A trigger that
/// refuses one token fingerprint plays the bad record.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_record_in_a_pipelined_group_fails_alone() {
    let Some((_db, url)) = database("a_refused_record_in_a_pipelined_group_fails_alone") else {
        return;
    };
    let (journal, writer) = open(&url).await;
    let pg = client(&url).await;
    pg.batch_execute(
        "CREATE FUNCTION refuse_boom() RETURNS trigger AS $$
         BEGIN
           IF NEW.fingerprint = 'boom' THEN RAISE EXCEPTION 'refused by the test trigger'; END IF;
           RETURN NEW;
         END $$ LANGUAGE plpgsql;
         CREATE TRIGGER refuse_boom BEFORE INSERT ON principal_tokens
           FOR EACH ROW EXECUTE FUNCTION refuse_boom();",
    )
    .await
    .unwrap();
    let later = turnguard::clock::now_ms() + 3_600_000;
    let names: Vec<String> = (0..12)
        .map(|i| {
            if i == 5 {
                "boom".into()
            } else {
                format!("fp-{i}")
            }
        })
        .collect();
    // All submitted at once: they queue together and the writer takes them in one or two
    // batches, each a pipelined group.
    let results =
        futures_util::future::join_all(names.iter().map(|n| journal.remember_token(n, later)))
            .await;
    for (name, result) in names.iter().zip(&results) {
        if name == "boom" {
            let e = result.as_ref().expect_err("the refused record fails");
            assert!(e.to_string().contains("refused by the test trigger"), "{e}");
        } else {
            assert!(result.is_ok(), "{name}: {result:?}");
        }
    }
    let kept: i64 = pg
        .query_one(
            "SELECT count(*) FROM principal_tokens WHERE fingerprint LIKE 'fp-%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, 11, "every other record of the group is committed");
    drop(journal);
    tokio::task::spawn_blocking(move || writer.join())
        .await
        .unwrap();
}
