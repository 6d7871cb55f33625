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

use super::{
    admit, call_records, join, record_round, round_record, upstream, RequestCtx, RoundBase,
};
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
        Self {
            bytes: Vec::new(),
            total: 0,
            cap,
            hasher: sha2::Sha256::new(),
        }
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

/// The pure part of a relay: framing, the adapter's hold-and-release, and admission at the
/// decision point. Fed upstream bytes, it appends what the agent receives to `out`.
pub struct Pipeline {
    framer: SseFramer,
    adapter: StreamAdapter,
    /// Each decision point's emissions and verdicts, in order.
    pub decided: Vec<(Vec<ChoiceEmissions>, Vec<ChoiceVerdict>)>,
}

impl Pipeline {
    /// A pipeline for one streamed response to `turn`.
    pub fn new(turn: &Turn, max_event_bytes: usize) -> Self {
        Self {
            framer: SseFramer::new(max_event_bytes),
            adapter: StreamAdapter::new(turn),
            decided: Vec::new(),
        }
    }

    /// Takes the next upstream bytes. `admit` decides a round of held calls.
    ///
    /// Errors: the event-size cap was passed (the caller cuts the stream).
    pub fn feed(
        &mut self,
        data: &[u8],
        admit: &mut dyn FnMut(&[ChoiceEmissions]) -> Vec<ChoiceVerdict>,
        out: &mut Vec<Bytes>,
    ) -> Result<(), String> {
        let blocks = self.framer.push(data).map_err(|e| e.to_string())?;
        for block in blocks {
            self.adapter.push(block, out);
            if self.adapter.ready() {
                self.decide(admit, out);
            }
        }
        Ok(())
    }

    fn decide(
        &mut self,
        admit: &mut dyn FnMut(&[ChoiceEmissions]) -> Vec<ChoiceVerdict>,
        out: &mut Vec<Bytes>,
    ) {
        let round = self.adapter.round();
        let verdicts = admit(&round);
        self.adapter.release(&verdicts, out);
        self.decided.push((round, verdicts));
    }

    /// The upstream body ended (`cut = None`) or failed (`cut = Some(reason)`). Returns the
    /// round state for the journal and its error, if any.
    pub fn end(
        &mut self,
        cut: Option<String>,
        admit: &mut dyn FnMut(&[ChoiceEmissions]) -> Vec<ChoiceVerdict>,
        out: &mut Vec<Bytes>,
    ) -> (&'static str, Option<String>) {
        match cut {
            None if self.adapter.finished() => {
                if self.adapter.pending() {
                    self.decide(admit, out);
                }
                let rest = self.framer.finish();
                if !rest.is_empty() {
                    out.push(rest);
                }
                ("ok", None)
            }
            None => {
                self.adapter
                    .cut("the stream ended before its terminal event", out);
                (
                    "failed",
                    Some("upstream stream ended before its terminal event".to_owned()),
                )
            }
            Some(reason) => {
                self.adapter.cut(&reason, out);
                ("failed", Some(reason))
            }
        }
    }

    /// Completion state of each choice, for the journal.
    pub fn completions(&self) -> Vec<crate::model::Completion> {
        self.adapter.completions()
    }

    /// The provider-stored response this stream produced (Responses only), for the journal.
    pub fn response_link(&self) -> Option<crate::model::ResponseLink> {
        self.adapter.response_link()
    }

    /// Journal rows for every call: decided ones with their verdicts, calls still held when
    /// the stream failed as withheld at the completion stage.
    pub fn call_records(&self) -> Vec<crate::journal::CallRecord> {
        let mut rows = Vec::new();
        for (round, verdicts) in &self.decided {
            rows.extend(call_records(round, verdicts));
        }
        if self.decided.is_empty() {
            let round = self.adapter.round();
            let verdicts: Vec<ChoiceVerdict> = round
                .iter()
                .map(crate::admission::withheld_by_cut)
                .collect();
            rows.extend(call_records(&round, &verdicts));
        }
        rows
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
    let mut pipeline = Pipeline::new(&turn, state.config.max_event_bytes);
    let mut capture = Capture::new(state.config.journal_max_record_bytes);
    let idle = Duration::from_millis(state.config.upstream_idle_timeout_ms);
    let mut admit_round = |round: &[ChoiceEmissions]| {
        let started = Instant::now();
        let verdicts = admit(&state, &turn, round);
        state
            .metrics
            .hold_latency
            .get_or_create(&ApiLabels {
                api: turn.api.as_str().to_owned(),
            })
            .observe(started.elapsed().as_secs_f64());
        verdicts
    };
    let mut out: Vec<Bytes> = Vec::new();

    let end = 'relay: loop {
        let frame = match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => break End::Cut(format!("no upstream data for {} ms", idle.as_millis())),
            Ok(None) => break End::Eof,
            Ok(Some(Err(e))) => break End::Cut(format!("upstream body failed: {e}")),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        capture.push(&data);
        if let Err(reason) = pipeline.feed(&data, &mut admit_round, &mut out) {
            break End::Cut(reason);
        }
        for chunk in out.drain(..) {
            if tx.send(Ok(chunk)).await.is_err() {
                break 'relay End::ClientGone;
            }
        }
    };

    let (round_state, error) = match end {
        End::Eof => pipeline.end(None, &mut admit_round, &mut out),
        End::Cut(reason) => pipeline.end(Some(reason), &mut admit_round, &mut out),
        End::ClientGone => (
            "client_gone",
            Some("the agent closed the stream".to_owned()),
        ),
    };
    if round_state == "failed" {
        count_cut(&state, "stream_cut");
    }
    for chunk in out.drain(..) {
        if tx.send(Ok(chunk)).await.is_err() {
            break;
        }
    }
    drop(tx);

    let mut rec = round_record(&state, &ctx, &turn, &base, round_state, &[]);
    rec.response = capture.finish();
    rec.error = error;
    let completions = pipeline.completions();
    if !completions.is_empty() {
        rec.completion = Some(join(completions.iter().map(|c| c.state.as_str())));
        rec.finish_reason = Some(join(completions.iter().map(|c| c.reason.as_str())));
    }
    rec.calls = pipeline.call_records();
    rec.response_link = pipeline.response_link();
    record_round(&state, rec).await;
}

fn count_cut(state: &AppState, reason: &str) {
    state
        .metrics
        .upstream_errors
        .get_or_create(&ReasonLabels {
            reason: reason.to_owned(),
        })
        .inc();
}
