//! Relaying an SSE response: upstream bytes → framer → provider stream adapter → agent.
//!
//! Text is forwarded the moment its event is complete; tool-call events are held by the
//! adapter until the completion state is known, then admitted and released or replaced.
//! A stream that ends before its terminal event is a cut: nothing held is released and the
//! agent's stream ends with a provider-shaped error event. The round is journaled when the
//! stream ends, with the upstream bytes as received.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{admit, call_records, join, record_round, round_record, upstream, RequestCtx, RoundBase};
use crate::metrics::{ApiLabels, ReasonLabels};
use crate::model::{ChoiceEmissions, ChoiceVerdict, Turn};
use crate::provider::StreamAdapter;
use crate::server::AppState;
use crate::sse::SseFramer;

/// Chunks buffered toward a slow agent before the relay waits (back-pressure).
const OUT_QUEUE: usize = 64;

/// Starts relaying `resp` to the agent and returns the agent's response at once.
pub fn relay(
    state: Arc<AppState>,
    ctx: RequestCtx,
    turn: Turn,
    base: RoundBase,
    resp: http::Response<Incoming>,
) -> Response {
    let (parts, body) = resp.into_parts();
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(OUT_QUEUE);
    tokio::spawn(run(state, ctx, turn, base, body, tx));
    let mut out = Response::new(Body::from_stream(ReceiverStream::new(rx)));
    *out.status_mut() = parts.status;
    *out.headers_mut() = upstream::response_headers(&parts.headers, false);
    out
}

/// How the upstream stream ended.
enum End {
    /// The body ended (complete or not: the adapter tells).
    Eof,
    /// The transport failed, went idle or sent an oversized event.
    Cut(String),
    /// The agent went away.
    ClientGone,
}

/// Keeps what the journal stores of the upstream bytes (bounded by the record cap).
struct Capture {
    bytes: Vec<u8>,
    total: usize,
    cap: usize,
    hasher: sha2::Sha256,
}

impl Capture {
    fn new(cap: usize) -> Self {
        use sha2::Digest;
        Self { bytes: Vec::new(), total: 0, cap, hasher: sha2::Sha256::new() }
    }

    fn push(&mut self, data: &[u8]) {
        use sha2::Digest;
        self.total += data.len();
        self.hasher.update(data);
        if self.bytes.len() + data.len() <= self.cap {
            self.bytes.extend_from_slice(data);
        }
    }

    fn finish(self) -> crate::journal::Recorded {
        use sha2::Digest;
        let truncated = self.total > self.cap;
        crate::journal::Recorded {
            bytes: if truncated { Vec::new() } else { self.bytes },
            total_bytes: self.total as u64,
            digest: hex::encode(self.hasher.finalize()),
            truncated,
        }
    }
}

async fn run(
    state: Arc<AppState>,
    ctx: RequestCtx,
    turn: Turn,
    base: RoundBase,
    mut body: Incoming,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
) {
    let mut framer = SseFramer::new(state.config.max_event_bytes);
    let mut adapter = StreamAdapter::new(&turn);
    let mut capture = Capture::new(state.config.journal_max_record_bytes);
    let mut decided: Vec<(Vec<ChoiceEmissions>, Vec<ChoiceVerdict>)> = Vec::new();
    let idle = Duration::from_millis(state.config.upstream_idle_timeout_ms);
    let mut out: Vec<Bytes> = Vec::new();

    let end = 'relay: loop {
        let frame = match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => break End::Cut(format!("no upstream data for {} ms", idle.as_millis())),
            Ok(None) => break End::Eof,
            Ok(Some(Err(e))) => break End::Cut(format!("upstream body failed: {e}")),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else { continue };
        capture.push(&data);
        let blocks = match framer.push(&data) {
            Ok(b) => b,
            Err(e) => break End::Cut(e.to_string()),
        };
        for block in blocks {
            adapter.push(block, &mut out);
            if adapter.ready() {
                decide(&state, &turn, &mut adapter, &mut decided, &mut out);
            }
        }
        for chunk in out.drain(..) {
            if tx.send(Ok(chunk)).await.is_err() {
                break 'relay End::ClientGone;
            }
        }
    };

    let (round_state, error) = match end {
        End::Eof if adapter.finished() => {
            if adapter.pending() {
                decide(&state, &turn, &mut adapter, &mut decided, &mut out);
            }
            let rest = framer.finish();
            if !rest.is_empty() {
                out.push(rest);
            }
            ("ok", None)
        }
        End::Eof => {
            adapter.cut("the stream ended before its terminal event", &mut out);
            count_cut(&state, "stream_incomplete");
            ("failed", Some("upstream stream ended before its terminal event".to_owned()))
        }
        End::Cut(reason) => {
            adapter.cut(&reason, &mut out);
            count_cut(&state, "stream_cut");
            ("failed", Some(reason))
        }
        End::ClientGone => ("client_gone", Some("the agent closed the stream".to_owned())),
    };
    for chunk in out.drain(..) {
        if tx.send(Ok(chunk)).await.is_err() {
            break;
        }
    }
    drop(tx);

    let mut rec = round_record(&state, &ctx, &turn, &base, round_state, &[]);
    rec.response = capture.finish();
    rec.error = error;
    let completions = adapter.completions();
    if !completions.is_empty() {
        rec.completion = Some(join(completions.iter().map(|c| c.state.as_str())));
        rec.finish_reason = Some(join(completions.iter().map(|c| c.reason.as_str())));
    }
    for (round, verdicts) in &decided {
        rec.calls.extend(call_records(round, verdicts));
    }
    if decided.is_empty() {
        // Calls that were held when the stream failed: journaled as withheld by completion.
        let round = adapter.round();
        let verdicts: Vec<ChoiceVerdict> = round
            .iter()
            .map(|c| crate::admission::withheld_by_cut(c))
            .collect();
        rec.calls.extend(call_records(&round, &verdicts));
    }
    record_round(&state, rec).await;
}

fn decide(
    state: &AppState,
    turn: &Turn,
    adapter: &mut StreamAdapter,
    decided: &mut Vec<(Vec<ChoiceEmissions>, Vec<ChoiceVerdict>)>,
    out: &mut Vec<Bytes>,
) {
    let started = Instant::now();
    let round = adapter.round();
    let verdicts = admit(state, turn, &round);
    adapter.release(&verdicts, out);
    state
        .metrics
        .hold_latency
        .get_or_create(&ApiLabels { api: turn.api.as_str().to_owned() })
        .observe(started.elapsed().as_secs_f64());
    decided.push((round, verdicts));
}

fn count_cut(state: &AppState, reason: &str) {
    state
        .metrics
        .upstream_errors
        .get_or_create(&ReasonLabels { reason: reason.to_owned() })
        .inc();
}
