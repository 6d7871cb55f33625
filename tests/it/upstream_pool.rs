//! The outbound connection pool (`src/client.rs`) against a raw HTTP/1.1 upstream that
//! records what it accepts: turns reuse a kept-alive connection, each request names the
//! upstream in `Host` and its path in origin form, an upstream that closes its side after
//! every answer is reconnected to without an error reaching the agent, and one that never
//! finishes a response holds only its own connection.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use support::faulty::read_request;
use support::post_json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use turnguard::config::Upstream;
use turnguard::mock_provider::Script;

/// What the upstream does after answering a request.
#[derive(Clone, Copy, PartialEq)]
enum AfterAnswer {
    /// Keeps the connection open for the next request.
    KeepAlive,
    /// Closes its side (no `connection: close` header: the client learns it from the FIN).
    Close,
}

/// A raw HTTP/1.1 upstream answering every request, 30 ms after it arrives, with a text-only
/// chat completion.
/// `accepted` counts connections; `heads` keeps each request's head (request line and
/// headers, lower-cased), in arrival order, with the number of the connection it came on
/// (1 for the first accepted).
struct Upstream1 {
    url: String,
    accepted: Arc<Mutex<usize>>,
    heads: Arc<Mutex<Vec<(usize, String)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream1 {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream1 {
    fn accepted(&self) -> usize {
        *self.accepted.lock().unwrap()
    }

    fn heads(&self) -> Vec<String> {
        self.heads
            .lock()
            .unwrap()
            .iter()
            .map(|(_, h)| h.clone())
            .collect()
    }

    /// The connection number of each request, in arrival order.
    fn connections(&self) -> Vec<usize> {
        self.heads.lock().unwrap().iter().map(|(c, _)| *c).collect()
    }
}

const ANSWER: &str = r#"{"id":"chatcmpl-pool","object":"chat.completion","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"pooled"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;

async fn upstream(after: AfterAnswer) -> Upstream1 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(Mutex::new(0));
    let heads = Arc::new(Mutex::new(Vec::new()));
    let (a, h) = (Arc::clone(&accepted), Arc::clone(&heads));
    let task = tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let number = {
                let mut n = a.lock().unwrap();
                *n += 1;
                *n
            };
            let h = Arc::clone(&h);
            tokio::spawn(async move {
                while let Ok(request) = read_request(&mut tcp).await {
                    let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
                    let head = text.split("\r\n\r\n").next().unwrap_or("").to_owned();
                    h.lock().unwrap().push((number, head));
                    // Long enough that turns sent together overlap here.
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ANSWER}",
                        ANSWER.len()
                    );
                    if tcp.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    if after == AfterAnswer::Close {
                        let _ = tcp.shutdown().await;
                        return;
                    }
                }
            });
        }
    });
    Upstream1 {
        url,
        accepted,
        heads,
        task,
    }
}

fn chat() -> Value {
    json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "say pooled"}]
    })
}

async fn turnguard_before(up: &Upstream1) -> support::Harness {
    let url = up.url.clone();
    support::start_with(Script::default(), move |c| {
        c.upstreams
            .insert("openai".into(), Upstream::parse(&url).unwrap());
    })
    .await
}

/// One chat turn through turnguard; asserts it ends with the upstream's answer.
async fn turn(h: &support::Harness) {
    let (status, body) = tokio::time::timeout(
        Duration::from_secs(10),
        post_json(&format!("{}/v1/chat/completions", h.url()), &chat(), &[]),
    )
    .await
    .expect("the turn ends");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let got: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(got["choices"][0]["message"]["content"], "pooled", "{got}");
}

/// Sequential turns go over one kept-alive upstream connection, and every request names
/// the upstream's authority in `Host` (not the agent's) and its path in origin form.
#[tokio::test(flavor = "multi_thread")]
async fn sequential_turns_reuse_one_connection_and_name_the_upstream_host() {
    let up = upstream(AfterAnswer::KeepAlive).await;
    let h = turnguard_before(&up).await;
    for _ in 0..4 {
        turn(&h).await;
    }
    assert_eq!(up.accepted(), 1, "one connection for four sequential turns");
    let heads = up.heads();
    assert_eq!(heads.len(), 4);
    let authority = up.url.trim_start_matches("http://");
    for head in heads {
        assert!(
            head.starts_with("post /v1/chat/completions http/1.1\r\n"),
            "{head}"
        );
        let hosts: Vec<&str> = head
            .lines()
            .filter_map(|l| l.strip_prefix("host:"))
            .map(str::trim)
            .collect();
        assert_eq!(hosts, [authority], "{head}");
    }
    h.stop().await;
}

/// An upstream that closes every connection after its answer (as an idle-timeout or a
/// restarted server does) costs a new connection per turn, never an error to the agent: a
/// closed pooled connection is not used again.
#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_closes_after_each_answer_is_reconnected_without_an_error() {
    let up = upstream(AfterAnswer::Close).await;
    let h = turnguard_before(&up).await;
    for i in 0..3 {
        turn(&h).await;
        // The FIN reaches the pooled connection's task before the next turn.
        tokio::time::sleep(Duration::from_millis(50 + 50 * i)).await;
    }
    assert_eq!(up.accepted(), 3);
    assert_eq!(up.heads().len(), 3, "each request sent once");
    h.stop().await;
}

/// Concurrent turns each get a connection of their own (HTTP/1 carries one request at a
/// time), and the pool keeps them: a second wave of the same size opens none, and turns one
/// at a time after it all use the connection used last.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_turns_open_connections_the_next_wave_reuses() {
    let up = upstream(AfterAnswer::KeepAlive).await;
    let h = turnguard_before(&up).await;
    let h = Arc::new(h);
    let wave = |h: Arc<support::Harness>| async move {
        let turns: Vec<_> = (0..4)
            .map(|_| {
                let h = Arc::clone(&h);
                tokio::spawn(async move { turn(&h).await })
            })
            .collect();
        for t in turns {
            t.await.unwrap();
        }
    };
    wave(Arc::clone(&h)).await;
    let first = up.accepted();
    assert_eq!(first, 4, "four overlapping turns, four connections");
    // Let each connection's task see its response read to the end.
    tokio::time::sleep(Duration::from_millis(100)).await;
    wave(Arc::clone(&h)).await;
    assert_eq!(
        up.accepted(),
        first,
        "the second wave reused the first's connections"
    );
    assert_eq!(up.heads().len(), 8);
    // One turn at a time keeps to the connection used last: the others are left to idle out.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..4 {
        turn(&h).await;
    }
    let last = &up.connections()[8..];
    assert!(
        last.iter().all(|c| *c == last[0]),
        "sequential turns spread over {last:?}"
    );
    Arc::into_inner(h).expect("no other owner").stop().await;
}
