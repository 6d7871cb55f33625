//! Relaying an SSE response: upstream bytes → framer → provider stream adapter → agent.
//!
//! Text is forwarded the moment its event is complete; tool-call events are held by the
//! adapter until the completion state is known, then admitted and released, replaced, or —
//! for a repair — dropped while turnguard asks the model again and splices the new round's
//! stream into the agent's (one message for the SDK). A stream that ends before its terminal
//! event is a cut: nothing held is released and the agent's stream ends with a
//! provider-shaped error event. Each round is journaled with the upstream bytes as received.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{call_records, join, round_record, upstream, RoundBase, Session};
use crate::admission::channel::{ChannelSpec, ChannelVerdict};
use crate::admission::SchemaCache;
use crate::journal::{RoundCommit, RoundState};
use crate::metrics::{ApiLabels, ReasonLabels, UpstreamError};
use crate::model::{ChoiceEmissions, ChoiceVerdict, Surfacing, Turn};
use crate::provider::{ProviderStream, Splice};
use crate::sse::{Event, SseBlock, SseFramer};

/// Chunks buffered toward a slow agent before the relay waits (back-pressure).
const OUT_QUEUE: usize = 64;

/// Starts relaying `resp` (whose body is coded as `coding`) to the agent and returns the
/// agent's response at once.
pub fn relay(
    session: Session,
    base: RoundBase,
    resp: http::Response<Incoming>,
    coding: upstream::ContentCoding,
) -> Response {
    let (parts, body) = resp.into_parts();
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(OUT_QUEUE);
    // The edge's timing lives in this (the handler's) task; the relay runs in its own.
    let timing = crate::edge::current();
    tokio::spawn(run(session, base, body, coding, tx, timing));
    let mut out = Response::new(Body::from_stream(ReceiverStream::new(rx)));
    *out.status_mut() = parts.status;
    *out.headers_mut() = upstream::response_headers(&parts.headers, false);
    out
}

/// The pure part of a relay: decoding, framing, classification, the adapter's
/// hold-and-release, and the decision points. Fed upstream bytes, it appends what the agent
/// receives to `out` and stops at each decision point so the caller can admit the held calls.
///
/// The rule it keeps (DESIGN.md §9, "upstream"): after the first byte, what reaches `out` is
/// an event that [`Event::classify`] read and the adapter admitted, a known sentinel
/// (`[DONE]`, a comment), or — last — the provider-shaped error. An unreadable event, a
/// structure that does not identify each call uniquely, or anything after the terminal event
/// breaks the stream ([`Pipeline::broken`]): nothing more is forwarded and
/// [`Pipeline::finish`] ends it with the error.
pub struct Pipeline {
    decoder: upstream::Decoder,
    framer: SseFramer,
    adapter: Box<dyn ProviderStream>,
    queue: VecDeque<SseBlock>,
    splice: Option<Splice>,
    framer_drained: bool,
    /// Bytes received while calls were held, and the most that may be (bounded memory).
    held_bytes: usize,
    hold_cap: usize,
    /// The structured / prompted channel check of a text answer (§A), if the request has one.
    channel: Option<ChannelCheck>,
    /// Why the stream broke, once it did.
    broken: Option<String>,
    /// Each decision point's emissions and verdicts, in order.
    pub decided: Vec<(Vec<ChoiceEmissions>, Vec<ChoiceVerdict>)>,
}

/// What [`Pipeline::finish`] found.
pub enum Finish {
    /// Calls are held and the stream is complete: admit them, release, and finish again.
    Decide(Vec<ChoiceEmissions>),
    /// The round is over: its journal state and error.
    Ended(RoundState, Option<String>),
}

impl Pipeline {
    /// A pipeline for one streamed response to `turn`; `splice` for a repair round.
    pub fn new(turn: &Turn, max_event_bytes: usize, splice: Option<Splice>) -> Self {
        Self {
            decoder: upstream::Decoder::new(upstream::ContentCoding::Identity),
            framer: SseFramer::new(max_event_bytes),
            adapter: crate::provider::adapter(turn.api).stream(turn, splice.as_ref()),
            queue: VecDeque::new(),
            splice,
            framer_drained: false,
            held_bytes: 0,
            hold_cap: usize::MAX,
            channel: None,
            broken: None,
            decided: Vec::new(),
        }
    }

    /// Decodes the upstream bytes as `coding` (its `Content-Encoding`) before framing them;
    /// every cap applies to the decoded bytes.
    pub fn with_coding(mut self, coding: upstream::ContentCoding) -> Self {
        self.decoder = upstream::Decoder::new(coding);
        self
    }

    /// Why the stream broke (an unreadable event, an ambiguous or contradicting structure),
    /// once it did: stop feeding and [`Pipeline::finish`] it.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Validates the text answer against `spec` before the stream's terminal event is
    /// released (tool-turn contract §A): the text streams as it arrives, the terminal event
    /// waits, and an answer that does not meet the schema ends the stream with a
    /// provider-shaped `envelope_invalid` error instead.
    pub fn with_channel(
        mut self,
        spec: Option<ChannelSpec>,
        schemas: std::sync::Arc<SchemaCache>,
    ) -> Self {
        self.channel = spec.map(|spec| ChannelCheck {
            spec,
            schemas,
            text: String::new(),
            terminal: None,
            result: None,
        });
        self
    }

    /// The channel verdict of this stream's text answer, once checked.
    pub fn channel_result(&self) -> Option<(&'static str, String)> {
        self.channel
            .as_ref()
            .and_then(|c| c.result.clone().map(|r| (c.spec.channel.as_str(), r)))
    }

    /// Caps what may arrive while tool-call events are held (decoded bytes).
    pub fn with_hold_cap(mut self, cap: usize) -> Self {
        self.hold_cap = cap;
        self
    }

    /// Takes the next upstream bytes. Errors: the body does not decode, or the event-size
    /// cap or the hold cap was passed (decoded bytes).
    pub fn feed(&mut self, data: &[u8]) -> Result<(), String> {
        if self.broken.is_some() {
            return Ok(());
        }
        let pending = self.adapter.pending();
        let (framer, queue, held_bytes, hold_cap) = (
            &mut self.framer,
            &mut self.queue,
            &mut self.held_bytes,
            self.hold_cap,
        );
        if !pending {
            *held_bytes = 0;
        }
        let mut sink = |piece: &[u8]| -> Result<(), String> {
            if pending {
                *held_bytes = held_bytes.saturating_add(piece.len());
                if *held_bytes > hold_cap {
                    return Err(format!(
                        "more than {hold_cap} bytes arrived while tool calls were held (max_response_bytes; raise it with --max-response-bytes)"
                    ));
                }
            }
            queue.extend(framer.push(piece).map_err(|e| e.to_string())?);
            Ok(())
        };
        self.decoder.push(data, &mut sink)
    }

    /// Processes queued events until a decision point (`Some(round)`: admit it, then
    /// [`Pipeline::release`]) or until the queue is empty or the stream broke.
    pub fn advance(&mut self, out: &mut Vec<Bytes>) -> Option<Vec<ChoiceEmissions>> {
        while self.broken.is_none() {
            let block = self.queue.pop_front()?;
            let event = match Event::classify(block) {
                Ok(e) => e,
                Err(e) => {
                    self.broken = Some(e.to_string());
                    return None;
                }
            };
            let event = match &mut self.splice {
                Some(s) => match s.apply(event) {
                    Some(e) => e,
                    None => continue,
                },
                None => event,
            };
            if let Some(check) = self.channel.as_mut() {
                check.observe(self.adapter.answer_text(&event));
                if self.adapter.is_terminal(&event) {
                    check.terminal = Some(event);
                    continue;
                }
            }
            self.adapter.push(event, out);
            if let Some(why) = self.adapter.violation() {
                self.broken = Some(format!("the upstream stream broke its structure: {why}"));
                return None;
            }
            if self.adapter.ready() {
                let round = self.adapter.round();
                if let Err(why) = crate::model::check_identities(&round) {
                    self.broken = Some(why);
                    return None;
                }
                return Some(round);
            }
        }
        None
    }

    /// Checks the held-back terminal event's text answer: releases the terminal event, or
    /// ends the stream with an error. `false` when the answer was refused.
    fn settle_channel(&mut self, out: &mut Vec<Bytes>) -> bool {
        let Some(mut check) = self.channel.take() else {
            return true;
        };
        let Some(terminal) = check.terminal.take() else {
            self.channel = Some(check);
            return true;
        };
        let had_calls = !self.decided.is_empty();
        let completion = self.adapter.completions().into_iter().next();
        let verdict = match (&completion, had_calls) {
            (_, true) | (None, _) => ChannelVerdict::Valid,
            (Some(c), false) => {
                crate::admission::channel::check(&check.spec, Some(&check.text), c, &check.schemas)
            }
        };
        let accepted = match verdict {
            ChannelVerdict::Valid => {
                check.result = Some("valid".into());
                true
            }
            ChannelVerdict::Refused => {
                check.result = Some("refused".into());
                true
            }
            ChannelVerdict::Invalid { reason, message } => {
                check.result = Some(reason.to_owned());
                let code = crate::admission::completion::channel_error_code(reason);
                self.adapter.fail(
                    code,
                    &format!(
                        "the {} answer was not accepted: {message}",
                        check.spec.channel.as_str()
                    ),
                    out,
                );
                false
            }
        };
        if accepted {
            self.adapter.push(terminal, out);
        }
        self.channel = Some(check);
        accepted
    }

    /// Releases the held events with the verdicts applied.
    pub fn release(
        &mut self,
        round: Vec<ChoiceEmissions>,
        verdicts: Vec<ChoiceVerdict>,
        out: &mut Vec<Bytes>,
    ) {
        self.adapter.release(&verdicts, out);
        self.decided.push((round, verdicts));
    }

    /// Drops the held events for a repair round; returns how to splice the next round.
    pub fn abandon(&mut self, round: Vec<ChoiceEmissions>, verdicts: Vec<ChoiceVerdict>) -> Splice {
        self.decided.push((round, verdicts));
        self.adapter.abandon()
    }

    /// Drops the held events and ends the stream with an error event carrying `code`.
    pub fn fail(
        &mut self,
        round: Vec<ChoiceEmissions>,
        verdicts: Vec<ChoiceVerdict>,
        code: &str,
        message: &str,
        out: &mut Vec<Bytes>,
    ) {
        self.adapter.fail(code, message, out);
        self.decided.push((round, verdicts));
    }

    /// The upstream body ended (`cut = None`) or failed (`cut = Some(reason)`), or the stream
    /// broke ([`Pipeline::broken`]). Call after [`Pipeline::advance`] returned `None`.
    ///
    /// Blocks that only the end of the input completes go through the adapter like any other
    /// (after the terminal event they break the stream); bytes that never formed a block are
    /// not an event and are not forwarded.
    pub fn finish(&mut self, cut: Option<String>, out: &mut Vec<Bytes>) -> Finish {
        if let Some(reason) = self.broken.clone() {
            self.adapter.cut(&reason, out);
            return Finish::Ended(RoundState::Failed, Some(reason));
        }
        if cut.is_none() && !self.framer_drained {
            self.framer_drained = true;
            let mut queue = std::mem::take(&mut self.queue);
            let (framer, broken) = (&mut self.framer, &mut self.broken);
            let mut sink = |piece: &[u8]| -> Result<(), String> {
                queue.extend(framer.push(piece).map_err(|e| e.to_string())?);
                Ok(())
            };
            if let Err(why) = self.decoder.finish(&mut sink) {
                *broken = Some(why);
            }
            let (blocks, rest) = self.framer.finish();
            queue.extend(blocks);
            self.queue = queue;
            if !rest.iter().all(u8::is_ascii_whitespace) {
                tracing::debug!(
                    bytes = rest.len(),
                    "the upstream stream ended inside an event; its bytes are not forwarded"
                );
            }
        }
        if cut.is_none() {
            // Whatever is still queued (after a decision point, or completed by the end of
            // the input) goes through the adapter.
            if let Some(round) = self.advance(out) {
                return Finish::Decide(round);
            }
            if let Some(reason) = self.broken.clone() {
                self.adapter.cut(&reason, out);
                return Finish::Ended(RoundState::Failed, Some(reason));
            }
        }
        if cut.is_none()
            && self.channel.as_ref().is_some_and(|c| c.terminal.is_some())
            && !self.adapter.pending()
            && !self.settle_channel(out)
        {
            return Finish::Ended(
                RoundState::SurfacedError,
                Some("the text answer did not meet its channel's schema".to_owned()),
            );
        }
        match cut {
            None if self.adapter.finished() => {
                if self.adapter.pending() {
                    return Finish::Decide(self.adapter.round());
                }
                if self.adapter.failed() {
                    Finish::Ended(
                        RoundState::UpstreamError,
                        Some("the provider sent an error event".to_owned()),
                    )
                } else {
                    Finish::Ended(RoundState::Ok, None)
                }
            }
            None => {
                self.adapter
                    .cut("the stream ended before its terminal event", out);
                Finish::Ended(
                    RoundState::Failed,
                    Some("upstream stream ended before its terminal event".to_owned()),
                )
            }
            Some(reason) => {
                self.adapter.cut(&reason, out);
                Finish::Ended(RoundState::Failed, Some(reason))
            }
        }
    }

    /// Completion state of each choice, for the journal.
    pub fn completions(&self) -> Vec<crate::model::Completion> {
        self.adapter.completions()
    }

    /// The provider-stored response this stream produced (Responses only), for the journal.
    /// A broken stream's response is recorded without a final status, so a request that
    /// continues it is untrusted (the chain rule's `not_completed`).
    pub fn response_link(&self) -> Option<crate::model::ResponseLink> {
        self.adapter.response_link().map(|mut link| {
            if self.broken.is_some() {
                link.status = None;
            }
            link
        })
    }

    /// Journal rows for every call: decided ones with their verdicts, calls still held when
    /// the stream failed as withheld at the completion stage.
    pub fn call_records(&self, ids: &super::CallIds) -> Vec<crate::journal::CallRecord> {
        let mut rows = Vec::new();
        for (round, verdicts) in &self.decided {
            rows.extend(call_records(round, verdicts, ids));
        }
        if self.decided.is_empty() {
            let round = self.adapter.round();
            let verdicts: Vec<ChoiceVerdict> = round
                .iter()
                .map(crate::admission::withheld_by_cut)
                .collect();
            rows.extend(call_records(&round, &verdicts, ids));
        }
        rows
    }
}

/// The channel check of a stream's text answer: the text seen so far (bounded) and the
/// terminal event held back until the text is validated.
struct ChannelCheck {
    spec: ChannelSpec,
    schemas: std::sync::Arc<SchemaCache>,
    text: String,
    terminal: Option<Event>,
    result: Option<String>,
}

/// Text kept for a channel check, bytes.
const MAX_CHANNEL_TEXT: usize = 1 << 20;

impl ChannelCheck {
    /// Accumulates a piece of the answer text (the adapter's
    /// [`ProviderStream::answer_text`]), up to [`MAX_CHANNEL_TEXT`] bytes.
    fn observe(&mut self, piece: Option<&str>) {
        if let Some(p) = piece {
            if self.text.len() + p.len() <= MAX_CHANNEL_TEXT {
                self.text.push_str(p);
            }
        }
    }
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

    /// The bytes received, redacted — decided or not, a cut stream too.
    fn finish(self, redactor: &crate::policy::Redactor) -> crate::journal::Recorded {
        use sha2::Digest;
        let truncated = self.total > self.cap;
        crate::journal::Recorded::redacted_parts(
            (!truncated).then_some(self.bytes),
            self.total as u64,
            hex::encode(self.hasher.finalize()),
            redactor,
        )
    }
}

/// How one model round of the relay ended.
enum RoundEnd {
    /// Ask the model again with this body; splice its stream like this.
    Repair(Value, Splice),
    /// The agent's stream is complete (or failed): journal state and error.
    Done(RoundState, Option<String>),
    /// The agent went away.
    ClientGone,
}

/// What the relay does after a decision point.
enum Next {
    Continue,
    Repair(Value, Splice),
    Stop,
    /// The agent went away while the calls were decided: nothing is released.
    Gone,
}

async fn run(
    mut session: Session,
    mut base: RoundBase,
    mut body: Incoming,
    mut coding: upstream::ContentCoding,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
    timing: Option<Arc<crate::edge::Timing>>,
) {
    // Counts the relay in `turnguard_inflight_streams` for as long as it lives.
    let _inflight = crate::metrics::GaugeGuard::new(&session.state.metrics.inflight_streams);
    let mut relay = RelayCtx {
        timing,
        cut: session.state.lifecycle.cut_signal(),
        first_byte: true,
    };
    let mut splice = None;
    // A body the journal does not keep (a chat turn's, `journal_bodies`) is not copied:
    // only its digest and size are taken.
    let cap = if super::record::keeps_body(&session.state, &session.ctx.run) {
        session.state.config.journal_max_record_bytes
    } else {
        0
    };
    let mut agent = ToAgent {
        tx,
        sent: Vec::new(),
        total: 0,
        cap,
        hasher: <sha2::Sha256 as sha2::Digest>::new(),
    };
    loop {
        let mut pipeline =
            Pipeline::new(&session.turn, session.state.config.max_event_bytes, splice)
                .with_coding(coding)
                .with_hold_cap(session.state.config.max_response_bytes)
                .with_channel(
                    session.channel.clone(),
                    std::sync::Arc::clone(&session.state.schemas),
                );
        let mut capture = Capture::new(cap);
        let end = read_round(
            &session,
            &mut pipeline,
            &mut capture,
            &mut body,
            &mut agent,
            &mut relay,
        )
        .await;
        finish_round(&session, &base, &pipeline, capture, &end, &agent).await;
        let RoundEnd::Repair(next, how) = end else {
            return;
        };
        session.body = next;
        session.agent_bytes = None;
        session.count_repair();
        let Some((next_base, next_body, next_coding)) =
            repair_round(&mut session, &mut agent).await
        else {
            return;
        };
        base = next_base;
        body = next_body;
        coding = next_coding;
        splice = Some(how);
    }
}

/// Journals a round that ended: the round itself, and for a clean end the served record of
/// what the agent received (over the record cap the body is kept as a digest only, but the
/// released calls are still recorded, so a re-sent round finds them in doubt).
async fn finish_round(
    session: &Session,
    base: &RoundBase,
    pipeline: &Pipeline,
    capture: Capture,
    end: &RoundEnd,
    agent: &ToAgent,
) {
    let (state, error) = match end {
        RoundEnd::Repair(..) => (RoundState::Repaired, None),
        RoundEnd::Done(s, e) => (*s, e.clone()),
        RoundEnd::ClientGone => (
            RoundState::ClientGone,
            Some("the agent closed the stream".to_owned()),
        ),
    };
    let secrets = pipeline.decided.iter().any(|(_, v)| super::has_secrets(v));
    let unit = RoundCommit {
        round: Some(round_of(
            session, base, pipeline, capture, state, error, secrets,
        )),
        ..RoundCommit::default()
    };
    if state == RoundState::Ok {
        let calls: Vec<_> = pipeline
            .decided
            .iter()
            .flat_map(|(r, v)| session.served_calls(r, v))
            .collect();
        let body = || {
            let body = agent.recorded(&session.policy.redactor);
            if secrets {
                body.withheld()
            } else {
                body
            }
        };
        // The round and what the agent received, in one commit. Its claims were confirmed
        // when the calls left: none to fence here.
        let _ = session
            .commit_answer(
                base,
                unit,
                200,
                "text/event-stream",
                body,
                calls,
                Vec::new(),
            )
            .await;
    } else if let Err(e) = super::record::commit_round(session, unit).await {
        tracing::error!(request_id = %session.ctx.request_id, error = %e, "round not journaled");
    }
}

/// Sends the repair round upstream: its base, body and coding when it answers with an event
/// stream turnguard can decode; otherwise the agent's stream ends with the provider-shaped
/// `turnguard.repair_failed` error and `None`.
async fn repair_round(
    session: &mut Session,
    agent: &mut ToAgent,
) -> Option<(RoundBase, Incoming, upstream::ContentCoding)> {
    let sent = session.send().await;
    let next_coding = sent
        .as_ref()
        .ok()
        .map(|r| upstream::content_coding(r.headers()));
    let why = match sent {
        Ok(resp)
            if resp.status().is_success()
                && super::is_event_stream(resp.headers())
                && matches!(next_coding, Some(Ok(_))) =>
        {
            let base = session.base(resp.status().as_u16());
            let coding = match next_coding {
                Some(Ok(c)) => c,
                _ => upstream::ContentCoding::Identity,
            };
            return Some((base, resp.into_body(), coding));
        }
        Ok(resp) => {
            let status = resp.status().as_u16();
            let content_type = resp
                .headers()
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none")
                .chars()
                .take(80)
                .collect::<String>();
            if let Some(Err(e)) = &next_coding {
                e.clone()
            } else if resp.status().is_success() {
                format!("the repair round's answer is not an event stream (HTTP {status}, content-type {content_type})")
            } else {
                format!("the repair round failed upstream with HTTP {status}")
            }
        }
        Err(e) => e.to_string(),
    };
    count(session, UpstreamError::RepairRoundFailed);
    let mut out = Vec::new();
    let mut p = Pipeline::new(&session.turn, session.state.config.max_event_bytes, None);
    p.adapter.fail("turnguard.repair_failed", &why, &mut out);
    agent.send_all(&mut out).await;
    None
}

/// The agent's side of the relay: the channel and a copy of what was sent (for the served
/// record of a run node), bounded by the record cap.
struct ToAgent {
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
    sent: Vec<u8>,
    total: usize,
    cap: usize,
    hasher: sha2::Sha256,
}

impl ToAgent {
    /// What was sent, as a journal record, redacted (a digest only past the cap).
    fn recorded(&self, redactor: &crate::policy::Redactor) -> crate::journal::Recorded {
        use sha2::Digest;
        let truncated = self.total > self.cap;
        crate::journal::Recorded::redacted_parts(
            (!truncated).then(|| self.sent.clone()),
            self.total as u64,
            hex::encode(self.hasher.clone().finalize()),
            redactor,
        )
    }

    async fn send_all(&mut self, out: &mut Vec<Bytes>) -> bool {
        for chunk in out.drain(..) {
            self.total += chunk.len();
            sha2::Digest::update(&mut self.hasher, &chunk);
            if self.sent.len() + chunk.len() <= self.cap {
                self.sent.extend_from_slice(&chunk);
            }
            if self.tx.send(Ok(chunk)).await.is_err() {
                return false;
            }
        }
        true
    }
}

/// What the relay carries across rounds for the edge and for shutdown (issue 6).
struct RelayCtx {
    /// The edge's timing of this request (the relay adds its framing time per chunk).
    timing: Option<Arc<crate::edge::Timing>>,
    /// Turns true when the drain deadline passed: the stream is cut.
    cut: tokio::sync::watch::Receiver<bool>,
    /// No upstream body byte seen yet (`turnguard_upstream_ttfb_seconds`).
    first_byte: bool,
}

async fn read_round(
    session: &Session,
    pipeline: &mut Pipeline,
    capture: &mut Capture,
    body: &mut Incoming,
    agent: &mut ToAgent,
    relay: &mut RelayCtx,
) -> RoundEnd {
    let idle = Duration::from_millis(session.state.config.upstream_idle_timeout_ms);
    let mut out: Vec<Bytes> = Vec::new();
    let cut = loop {
        let next = tokio::select! {
            biased;
            next = tokio::time::timeout(idle, body.frame()) => next,
            _ = relay.cut.wait_for(|c| *c) => {
                break Some("turnguard is shutting down: the drain deadline passed".to_owned())
            }
        };
        let frame = match next {
            Err(_) => break Some(format!("no upstream data for {} ms", idle.as_millis())),
            Ok(None) => break None,
            Ok(Some(Err(e))) => break Some(format!("upstream body failed: {e}")),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let work = Instant::now();
        if relay.first_byte {
            relay.first_byte = false;
            if let Some(sent) = relay.timing.as_ref().and_then(|t| t.upstream_sent()) {
                session
                    .state
                    .metrics
                    .upstream_ttfb
                    .get_or_create(&ApiLabels {
                        api: session.turn.api.into(),
                    })
                    .observe(sent.elapsed().as_secs_f64());
            }
        }
        capture.push(&data);
        let fed = pipeline.feed(&data);
        if let Some(t) = &relay.timing {
            t.add_work(work.elapsed());
        }
        if let Err(reason) = fed {
            break Some(reason);
        }
        while let Some(round) = pipeline.advance(&mut out) {
            match decide(session, pipeline, round, &mut out, agent).await {
                Next::Continue => {}
                Next::Repair(body, splice) => {
                    agent.send_all(&mut out).await;
                    return RoundEnd::Repair(body, splice);
                }
                Next::Stop => {
                    return if agent.send_all(&mut out).await {
                        RoundEnd::Done(RoundState::SurfacedError, None)
                    } else {
                        RoundEnd::ClientGone
                    };
                }
                Next::Gone => return RoundEnd::ClientGone,
            }
        }
        if let Some(why) = pipeline.broken() {
            // Nothing more of this upstream body is read or forwarded: `finish` ends the
            // agent's stream with the provider-shaped error.
            break Some(why.to_owned());
        }
        if !agent.send_all(&mut out).await {
            return RoundEnd::ClientGone;
        }
    };
    if cut.is_some() {
        count(session, UpstreamError::StreamCut);
    }
    loop {
        match pipeline.finish(cut.clone(), &mut out) {
            Finish::Decide(round) => {
                match decide(session, pipeline, round, &mut out, agent).await {
                    Next::Continue => {}
                    Next::Repair(body, splice) => {
                        agent.send_all(&mut out).await;
                        return RoundEnd::Repair(body, splice);
                    }
                    Next::Stop => {
                        agent.send_all(&mut out).await;
                        return RoundEnd::Done(RoundState::SurfacedError, None);
                    }
                    Next::Gone => return RoundEnd::ClientGone,
                }
            }
            Finish::Ended(state, error) => {
                if !agent.send_all(&mut out).await {
                    return RoundEnd::ClientGone;
                }
                return RoundEnd::Done(state, error);
            }
        }
    }
}

/// Admits one decision point and applies how it surfaces. What the agent may already have
/// (text before the held calls) is sent first; while held calls wait for an approval, SSE
/// comment keep-alives go out (`: keep-alive`), which every SSE client ignores.
async fn decide(
    session: &Session,
    pipeline: &mut Pipeline,
    round: Vec<ChoiceEmissions>,
    out: &mut Vec<Bytes>,
    agent: &mut ToAgent,
) -> Next {
    agent.send_all(out).await;
    let started = Instant::now();
    let every = Duration::from_millis(session.state.config.approval_keepalive_ms.max(10));
    let mut keepalive = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    let (verdicts, events) = {
        // The approval of a held round is used only while the agent is there (its channel
        // open): a stream whose agent left stops waiting and uses nothing.
        let admit = session.admit(&round, &agent.tx);
        tokio::pin!(admit);
        loop {
            tokio::select! {
                v = &mut admit => break v,
                _ = keepalive.tick() => {
                    // Never blocks the wait: a full queue already keeps the connection busy,
                    // and an agent that left does not end the wait (a re-sent request meets
                    // the same interrupt).
                    let _ = agent.tx.try_send(Ok(Bytes::from_static(b": keep-alive\n\n")));
                }
            }
        }
    };
    session
        .state
        .metrics
        .hold_latency
        .get_or_create(&ApiLabels {
            api: session.turn.api.into(),
        })
        .observe(started.elapsed().as_secs_f64());
    // A stream's round is recorded when it ends; its decisions' events are queued now (not
    // awaited), so the run's event feed shows them while the stream goes on.
    if let Err(e) = session.state.journal.record_events(events).await {
        tracing::error!(error = %e, request_id = %session.ctx.request_id, "events not journaled");
    }
    if agent.tx.is_closed() {
        // Nothing leaves: the claims of calls that would have been released are given back.
        for (effect_id, call_id) in super::claims_of(&verdicts) {
            if let Err(e) = session
                .state
                .journal
                .release_claim(&effect_id, &call_id)
                .await
            {
                tracing::error!(error = %e, "an effect claim could not be given back");
            }
        }
        pipeline.fail(
            round,
            verdicts,
            "turnguard.agent_gone",
            "the agent left",
            out,
        );
        out.clear();
        return Next::Gone;
    }
    if let Some(e) = verdicts.iter().find_map(|v| match &v.surfacing {
        Surfacing::Error(e) => Some(e.clone()),
        _ => None,
    }) {
        pipeline.fail(round, verdicts, e.code, &e.message, out);
        return Next::Stop;
    }
    let repair = round
        .iter()
        .zip(&verdicts)
        .find_map(|(c, v)| match &v.surfacing {
            Surfacing::Repair(items) => Some(session.repaired(c, items)),
            _ => None,
        });
    if let Some(body) = repair {
        let splice = pipeline.abandon(round, verdicts);
        return Next::Repair(body, splice);
    }
    // The calls are about to leave: their effect claims are confirmed first. A claim taken
    // over by another owner since (PostgreSQL, `JournalError::Fenced`) is no longer ours:
    // nothing of the round leaves (fail closed).
    match session
        .state
        .journal
        .confirm_claims(super::claims_of(&verdicts))
        .await
    {
        Ok(()) => {}
        Err(e @ crate::journal::JournalError::Fenced(_)) => {
            tracing::error!(error = %e, request_id = %session.ctx.request_id, "effect claim taken over; the round is withheld");
            pipeline.fail(
                round,
                verdicts,
                "turnguard.journal_unavailable",
                &e.to_string(),
                out,
            );
            return Next::Stop;
        }
        Err(e) => {
            tracing::error!(error = %e, request_id = %session.ctx.request_id, "effect claims not confirmed");
        }
    }
    pipeline.release(round, verdicts, out);
    Next::Continue
}

/// The round record of a stream's round that ended.
fn round_of(
    session: &Session,
    base: &RoundBase,
    pipeline: &Pipeline,
    capture: Capture,
    state: RoundState,
    error: Option<String>,
    secrets: bool,
) -> crate::journal::RoundRecord {
    let mut rec = round_record(session, base, state, &[]);
    let received = capture.finish(&session.policy.redactor);
    rec.response = if secrets {
        received.withheld()
    } else {
        received
    };
    rec.error = error;
    let completions = pipeline.completions();
    if !completions.is_empty() {
        rec.completion = Some(join(completions.iter().map(|c| c.state.as_str())));
        rec.finish_reason = Some(join(completions.iter().map(|c| c.reason.as_str())));
    }
    rec.calls = pipeline.call_records(&session.call_ids());
    rec.response_link = session.judged(pipeline.response_link(), &rec.calls);
    rec
}

fn count(session: &Session, reason: UpstreamError) {
    session
        .state
        .metrics
        .upstream_errors
        .get_or_create(&ReasonLabels { reason })
        .inc();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_gzip_stream_is_decoded_to_its_end() {
        let turn = crate::provider::adapter(crate::model::Api::OpenAiChat)
            .parse_request(&serde_json::json!({"model": "m", "stream": true, "messages": []}))
            .unwrap();
        let sse = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(sse).unwrap();
        let coded = enc.finish().unwrap();
        let mut p = Pipeline::new(&turn, 1 << 20, None).with_coding(upstream::ContentCoding::Gzip);
        let mut out = Vec::new();
        // Split as the mock provider serves a file: by what looks like SSE blocks.
        let mut f = SseFramer::new(usize::MAX);
        let mut pieces: Vec<Bytes> = f.push(&coded).unwrap().into_iter().map(|b| b.raw).collect();
        let (blocks, rest) = f.finish();
        pieces.extend(blocks.into_iter().map(|b| b.raw));
        pieces.push(rest);
        eprintln!("{} pieces", pieces.len());
        for piece in pieces {
            p.feed(&piece).unwrap();
            assert!(p.advance(&mut out).is_none());
        }
        assert!(matches!(
            p.finish(None, &mut out),
            Finish::Ended(RoundState::Ok, None)
        ));
        let joined: Vec<u8> = out.iter().flat_map(|b| b.to_vec()).collect();
        assert_eq!(
            String::from_utf8_lossy(&joined),
            String::from_utf8_lossy(sse)
        );
    }
}
