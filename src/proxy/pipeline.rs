//! The pure part of a round: decoding, framing, classification, the adapter's
//! hold-and-release and the decision points, for a stream (SSE blocks) and for a JSON answer
//! (one block: [`crate::provider::block`]) alike. It does no I/O; the round engine
//! ([`super::engine`]) feeds it and decides at each decision point.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use super::{call_records, upstream};
use crate::admission::channel::{ChannelSpec, ChannelVerdict};
use crate::admission::SchemaCache;
use crate::journal::RoundState;
use crate::model::{ChoiceEmissions, ChoiceVerdict, Turn};
use crate::provider::{ProviderStream, Splice};
use crate::sse::{Event, Payload, SseBlock, SseFramer};

/// The pure part of a round: decoding, framing, classification, the adapter's
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
    /// A JSON answer's body as it arrives (decoded), read as one event at its end.
    block: Option<BlockBody>,
    /// The block's event, once the body is complete.
    block_event: Option<Event>,
    /// What the journal keeps of the decoded upstream bytes.
    capture: Capture,
}

/// A JSON answer's body, decoded, and the most it may be (`max_response_bytes`).
struct BlockBody {
    buf: BytesMut,
    cap: usize,
}

/// What [`Pipeline::finish`] found.
pub enum Finish {
    /// Calls are held and the stream is complete: admit them, release, and finish again.
    Decide(Vec<ChoiceEmissions>),
    /// The text answer did not meet its channel's schema (tool-turn contract §A): the
    /// terminal event is held; repair the round, or [`Pipeline::end_with`].
    Refused {
        /// The validator's reason label (`invalid_json`, `schema`, `truncated`, …).
        reason: &'static str,
        /// What was wrong, for the agent.
        message: String,
    },
    /// The round is over: its journal state and error.
    Ended(RoundState, Option<String>),
}

impl Pipeline {
    /// A pipeline for one streamed response to `turn`; `splice` for a repair round.
    pub fn new(turn: &Turn, max_event_bytes: usize, splice: Option<Splice>) -> Self {
        let adapter = crate::provider::adapter(turn.api).stream(turn, splice.as_ref());
        Self::with_adapter(adapter, max_event_bytes, splice)
    }

    fn with_adapter(
        adapter: Box<dyn ProviderStream>,
        max_event_bytes: usize,
        splice: Option<Splice>,
    ) -> Self {
        Self {
            decoder: upstream::Decoder::new(upstream::ContentCoding::Identity),
            framer: SseFramer::new(max_event_bytes),
            adapter,
            queue: VecDeque::new(),
            splice,
            framer_drained: false,
            held_bytes: 0,
            hold_cap: usize::MAX,
            channel: None,
            broken: None,
            decided: Vec::new(),
            block: None,
            block_event: None,
            capture: Capture::new(0),
        }
    }

    /// A pipeline for one non-stream (JSON) answer to `turn`: the body, at most `cap`
    /// decoded bytes, is one event read at its end ([`crate::provider::block`]).
    pub fn block(turn: &Turn, cap: usize) -> Self {
        let mut p = Self::with_adapter(crate::provider::block(turn), usize::MAX, None);
        p.block = Some(BlockBody {
            buf: BytesMut::new(),
            cap,
        });
        p
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
    pub fn channel_result(&self) -> Option<(crate::admission::channel::Channel, &'static str)> {
        self.channel
            .as_ref()
            .and_then(|c| c.result.map(|r| (c.spec.channel, r)))
    }

    /// Keeps up to `cap` decoded upstream bytes for the journal (0: a digest and size only).
    pub fn with_capture(mut self, cap: usize) -> Self {
        self.capture = Capture::new(cap);
        self
    }

    /// What the journal records of the upstream answer, decoded and redacted — decided or
    /// not, a cut one too (a digest only past the capture's cap). Taken once.
    pub fn received(&mut self, redactor: &crate::policy::Redactor) -> crate::journal::Recorded {
        std::mem::replace(&mut self.capture, Capture::new(0)).finish(redactor)
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
        let capture = &mut self.capture;
        if let Some(block) = &mut self.block {
            return self.decoder.push(data, &mut |piece: &[u8]| {
                capture.push(piece);
                block.push(piece)
            });
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
            capture.push(piece);
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
            let event = match self.block_event.take() {
                Some(e) => e,
                None => match self.classify_next()? {
                    Ok(e) => e,
                    Err(e) => {
                        self.broken = Some(e.to_string());
                        return None;
                    }
                },
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
            if self.break_on_violation() {
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

    /// Reads a block for the adapter: its JSON left as text when the adapter reads the text
    /// itself and nothing else here reads the event's tree (a splice rewrites it, a channel
    /// check reads its answer text).
    fn classify_next(&mut self) -> Option<Result<Event, crate::sse::Unreadable>> {
        let block = self.queue.pop_front()?;
        Some(
            if self.splice.is_none() && self.channel.is_none() && self.adapter.reads_text() {
                Event::classify_text(block)
            } else {
                Event::classify(block)
            },
        )
    }

    /// Checks the held-back terminal event's text answer: releases the terminal event
    /// (`None`), or returns the refusal for the engine to repair or surface.
    fn settle_channel(&mut self, out: &mut Vec<Bytes>) -> Option<Finish> {
        let check = self.channel.as_mut()?;
        let terminal = check.terminal.take()?;
        let had_calls = !self.decided.is_empty();
        let completion = self.adapter.completions().into_iter().next();
        let verdict = match (&completion, had_calls) {
            (_, true) | (None, _) => ChannelVerdict::Valid,
            (Some(c), false) => {
                crate::admission::channel::check(&check.spec, Some(&check.text), c, &check.schemas)
            }
        };
        match verdict {
            ChannelVerdict::Valid | ChannelVerdict::Refused => {
                let refused = matches!(verdict, ChannelVerdict::Refused);
                check.result = Some(if refused { "refused" } else { "valid" });
                self.adapter.push(terminal, out);
                None
            }
            ChannelVerdict::Invalid { reason, message } => {
                check.result = Some(reason);
                Some(Finish::Refused { reason, message })
            }
        }
    }

    /// Ends the agent's stream with the error event carrying `code` and `message` (a refused
    /// text answer, [`Finish::Refused`]; a repair round that failed): whatever is held is
    /// dropped.
    pub fn end_with(&mut self, code: &str, message: &str, out: &mut Vec<Bytes>) {
        self.adapter.fail(code, message, out);
    }

    /// The text answer seen so far, for a channel's repair turn (bounded).
    pub fn answer_text(&self) -> &str {
        self.channel.as_ref().map_or("", |c| c.text.as_str())
    }

    /// Drops a refused text answer for a repair round; how to splice the next round.
    pub fn abandon_answer(&mut self) -> Splice {
        self.adapter.abandon()
    }

    /// Releases the held events with the verdicts applied.
    pub fn release(
        &mut self,
        round: Vec<ChoiceEmissions>,
        verdicts: Vec<ChoiceVerdict>,
        out: &mut Vec<Bytes>,
    ) {
        self.adapter.release(&verdicts, out);
        // A block that could not apply the verdicts forwarded nothing: the round breaks, and
        // finishing it answers with the error.
        self.break_on_violation();
        self.decided.push((round, verdicts));
    }

    /// Breaks the round when the adapter found a violation; whether it did.
    fn break_on_violation(&mut self) -> bool {
        let Some(why) = self.adapter.violation() else {
            return false;
        };
        self.broken = Some(if self.block.is_some() {
            why.to_owned()
        } else {
            format!("the upstream stream broke its structure: {why}")
        });
        true
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
        if cut.is_none() && !self.framer_drained && self.block.is_some() {
            self.framer_drained = true;
            self.read_block();
        } else if cut.is_none() && !self.framer_drained {
            self.framer_drained = true;
            let mut queue = std::mem::take(&mut self.queue);
            let (framer, broken, capture) = (&mut self.framer, &mut self.broken, &mut self.capture);
            let mut sink = |piece: &[u8]| -> Result<(), String> {
                capture.push(piece);
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
        if cut.is_none() && !self.adapter.pending() {
            if let Some(refused) = self.settle_channel(out) {
                return refused;
            }
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

    /// The JSON answer's body is complete: it becomes the block's one event (a body that is
    /// not a JSON object breaks the round).
    fn read_block(&mut self) {
        let Some(block) = self.block.as_mut() else {
            return;
        };
        let capture = &mut self.capture;
        let mut sink = |piece: &[u8]| {
            capture.push(piece);
            block.push(piece)
        };
        if let Err(why) = self.decoder.finish(&mut sink) {
            self.broken = Some(why);
            return;
        }
        // The adapter (a [`crate::provider::block::Block`]) reads the body: a body that is not
        // one JSON object is its violation, and the round breaks at its push.
        self.block_event = Some(Event {
            block: SseBlock {
                raw: std::mem::take(&mut block.buf).freeze(),
                event: None,
                data: None,
                unknown_field: false,
            },
            payload: Payload::Body,
        });
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
    pub fn call_records(&self, ids: &super::record::CallIds) -> Vec<crate::journal::CallRecord> {
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
    result: Option<&'static str>,
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

/// Keeps what the journal stores of the decoded upstream bytes (bounded by the record cap)
/// and their digest.
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

impl BlockBody {
    fn push(&mut self, piece: &[u8]) -> Result<(), String> {
        if self.buf.len().saturating_add(piece.len()) > self.cap {
            return Err(format!(
                "the response body exceeds the {}-byte cap (max_response_bytes; raise it with --max-response-bytes)",
                self.cap
            ));
        }
        self.buf.extend_from_slice(piece);
        Ok(())
    }
}
