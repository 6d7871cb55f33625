//! Byte-faithful `text/event-stream` framing (WHATWG HTML §9.2 "Server-sent events").
//!
//! SSE crates parse events and drop the bytes they came from; a transparent proxy must
//! re-emit every event it does not change exactly as received (padding, `event:` lines,
//! comments, line endings — `shared/reference/wire-formats.md` §1, §18). So this module only
//! finds event boundaries and reads the `event` and `data` fields, keeping each block's raw
//! bytes. It accepts `\n`, `\r\n` and `\r` line endings and multi-line `data:`; any split of
//! the input into chunks yields the same blocks.
//!
//! [`Event::classify`] is the one gate between framing and the provider adapters: a block
//! reaches an adapter only as an [`Event`] whose payload turnguard read — no `data` (a
//! comment or keep-alive), the `[DONE]` sentinel, or a JSON object — and whose every line is
//! a comment or a field it knows (`event`, `data`, `id`, `retry`), so nothing is ever
//! forwarded that was not parsed (DESIGN.md §9, "upstream"). An adapter that reads a JSON
//! object from its text in one pass (the Chat stream's typed view) gets it as
//! [`Payload::Text`] from [`Event::classify_text`] instead, and is held to the same gate: it
//! refuses what [`Event::classify`] refuses, and forwards nothing it did not read.

use bytes::{Bytes, BytesMut};
use serde_json::Value;

/// One SSE block: the raw bytes through its terminating blank line, and its fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseBlock {
    /// The bytes exactly as received, including the blank line that ended the block.
    pub raw: Bytes,
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`; `None` for a comment-only block (keep-alive).
    pub data: Option<String>,
    /// A line names a field other than `event`, `data`, `id` and `retry`. The standard has a
    /// client ignore it, but clients differ on what a field name is: the official Node SDKs
    /// decode each line with a `TextDecoder`, which drops a leading byte-order mark, so
    /// `U+FEFF data: …` is a `data` line to them and an unknown field to a reader that keeps
    /// the mark. A block that reads two ways is refused ([`Event::classify`]).
    pub unknown_field: bool,
}

/// The framer met a block larger than its cap.
#[derive(Debug, Clone, thiserror::Error)]
#[error("an SSE event exceeds the {0}-byte cap (max_event_bytes; raise it with --max-event-bytes)")]
pub struct EventTooLarge(pub usize);

/// Incremental framer: push chunks in, take complete blocks out.
#[derive(Debug)]
pub struct SseFramer {
    buf: BytesMut,
    /// Where the line being scanned starts, relative to `buf` (the current block starts at 0).
    line_start: usize,
    /// How far `buf` has been scanned.
    scanned: usize,
    max_event_bytes: usize,
}

impl SseFramer {
    /// A framer that refuses blocks longer than `max_event_bytes`.
    pub fn new(max_event_bytes: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            line_start: 0,
            scanned: 0,
            max_event_bytes,
        }
    }

    /// Appends `chunk` and returns every block it completes, in order.
    ///
    /// Errors: [`EventTooLarge`] when a block, complete or not, is longer than the cap.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<SseBlock>, EventTooLarge> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some(end) = self.next_block_end() {
            // A whole event that arrived in one chunk is held to the same cap.
            if end > self.max_event_bytes {
                return Err(EventTooLarge(self.max_event_bytes));
            }
            let raw = self.buf.split_to(end).freeze();
            self.line_start = 0;
            self.scanned = 0;
            out.push(parse_block(raw));
        }
        if self.buf.len() > self.max_event_bytes {
            return Err(EventTooLarge(self.max_event_bytes));
        }
        Ok(out)
    }

    /// End of input: blocks that only the end completes (a trailing `\r` is then a line
    /// ending, not half of `\r\n`), and the bytes that never formed a complete block.
    pub fn finish(&mut self) -> (Vec<SseBlock>, Bytes) {
        let mut out = Vec::new();
        if self.buf.last() == Some(&b'\r') {
            self.buf.extend_from_slice(b"\n");
            if let Some(end) = self.next_block_end() {
                // The added `\n` is not part of the stream: keep only the real bytes.
                let real = end.min(self.buf.len() - 1);
                let raw = self.buf.split_to(real).freeze();
                out.push(parse_block(raw));
            }
            self.buf.truncate(self.buf.len().saturating_sub(1));
        }
        self.line_start = 0;
        self.scanned = 0;
        (out, self.buf.split().freeze())
    }

    /// Scans for the blank line ending the current block; returns the block's length.
    fn next_block_end(&mut self) -> Option<usize> {
        let buf = &self.buf[..];
        let mut i = self.scanned;
        while i < buf.len() {
            let b = buf[i];
            if b == b'\n' || b == b'\r' {
                let term = if b == b'\r' {
                    if i + 1 >= buf.len() {
                        // A lone `\r` at the end may be the first half of `\r\n`: wait.
                        self.scanned = i;
                        return None;
                    }
                    if buf[i + 1] == b'\n' {
                        2
                    } else {
                        1
                    }
                } else {
                    1
                };
                let empty_line = i == self.line_start;
                i += term;
                self.line_start = i;
                if empty_line {
                    return Some(i);
                }
                continue;
            }
            i += 1;
        }
        self.scanned = i;
        None
    }
}

fn parse_block(raw: Bytes) -> SseBlock {
    let text = String::from_utf8_lossy(&raw);
    let mut event = None;
    let mut data: Option<String> = None;
    let mut unknown_field = false;
    for line in text.split(['\n', '\r']) {
        if line.is_empty() || line.starts_with(':') {
            continue;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "event" => event = Some(value.to_owned()),
            "data" => match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_owned()),
            },
            "id" | "retry" => {}
            _ => unknown_field = true,
        }
    }
    SseBlock {
        raw,
        event,
        data,
        unknown_field,
    }
}

/// What a block carries, as turnguard read it.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// No `data` field: a comment (`: keep-alive`) or only `event` / `id` / `retry` fields.
    /// A client dispatches nothing for it.
    None,
    /// `data: [DONE]`, Chat's end sentinel (the official SDKs stop at data that starts with
    /// `[DONE]`, wire-formats.md §1.4).
    Done,
    /// A JSON object (the event).
    Json(Value),
    /// A JSON object's text, in the block's `data`, not read yet: made only by
    /// [`Event::classify_text`], for an adapter that reads the text itself in one pass
    /// instead of through a tree ([`crate::provider::ProviderStream::reads_text`]). That
    /// adapter refuses, as [`Event::classify`] would ([`read_object`]), a text that is not a
    /// JSON object serde_json reads, and forwards nothing of it.
    Text,
    /// A non-stream response body, whole, in the block's `raw` (no `data` field): what the
    /// one-event machine of a JSON answer reads ([`crate::provider::block::Block`]), from the
    /// bytes or through their tree. Never an event of a stream.
    Body,
}

/// A block whose payload turnguard read: the only form in which an upstream block reaches a
/// provider adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The block, raw bytes kept for byte-faithful forwarding.
    pub block: SseBlock,
    /// Its payload.
    pub payload: Payload,
}

/// A block turnguard cannot read, and so never forwards: the stream ends with the provider's
/// error shape instead (DESIGN.md §9).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the upstream sent an event turnguard cannot read: {0}")]
pub struct Unreadable(pub String);

impl Event {
    /// Reads a block: its bytes must be UTF-8 (what a client decodes is what turnguard read),
    /// each line a comment or one of the fields `event`, `data`, `id` and `retry`
    /// ([`SseBlock::unknown_field`]), and its `data`, when there is one, must be `[DONE]` or a JSON object that serde_json
    /// accepts. JSON that other parsers accept but serde_json refuses (`NaN`, `1e400`, a lone
    /// surrogate, nesting past 128 levels) is unreadable, never passed through as "not JSON".
    ///
    /// Errors: [`Unreadable`], naming what was wrong (never the bytes).
    pub fn classify(block: SseBlock) -> Result<Self, Unreadable> {
        Self::read(block, |data| read_object(data).map(Payload::Json))
    }

    /// [`Self::classify`], but a JSON object's text is left for the adapter to read
    /// ([`Payload::Text`]): the block must be UTF-8 with only known fields, and its `data` is
    /// `[DONE]`, missing, or the text the adapter reads.
    ///
    /// Errors: [`Unreadable`] for bytes that are not UTF-8 or a field turnguard does not know.
    pub fn classify_text(block: SseBlock) -> Result<Self, Unreadable> {
        Self::read(block, |_| Ok(Payload::Text))
    }

    /// A UTF-8 block's payload: none, `[DONE]`, or what `object` makes of any other `data`.
    fn read(
        block: SseBlock,
        object: impl FnOnce(&str) -> Result<Payload, Unreadable>,
    ) -> Result<Self, Unreadable> {
        if std::str::from_utf8(&block.raw).is_err() {
            return Err(Unreadable("an event that is not UTF-8".into()));
        }
        if block.unknown_field {
            return Err(Unreadable(
                "an event with a field other than `event`, `data`, `id` and `retry` (clients disagree on such a line: some drop a byte-order mark before `data:` and read it)".into(),
            ));
        }
        let payload = match block.data.as_deref() {
            None => Payload::None,
            Some(d) if d.starts_with("[DONE]") => Payload::Done,
            Some(d) => object(d)?,
        };
        Ok(Self { block, payload })
    }

    /// The event's JSON, when it has one (never for [`Payload::Text`], which is not read).
    pub fn json(&self) -> Option<&Value> {
        match &self.payload {
            Payload::Json(v) => Some(v),
            Payload::None | Payload::Done | Payload::Body | Payload::Text => None,
        }
    }

    /// The JSON `type` field, when the event has one (Messages, Responses).
    pub fn kind(&self) -> Option<&str> {
        self.json()
            .and_then(|v| v.get("type"))
            .and_then(Value::as_str)
    }

    /// The same event with its JSON replaced and re-encoded (the `event:` line kept).
    pub fn with_json(self, json: Value) -> Self {
        let data = crate::strict_json::to_text(&json);
        let raw = encode(self.block.event.as_deref(), &data);
        Self {
            block: SseBlock {
                raw,
                event: self.block.event,
                data: Some(data),
                unknown_field: false,
            },
            payload: Payload::Json(json),
        }
    }
}

/// Reads an event's `data` as a JSON object's tree, as [`Event::classify`] does.
///
/// Errors: [`Unreadable`], for data that serde_json does not read (`NaN`, `1e400`, a lone
/// surrogate, nesting past 128 levels), that names an object key twice, or that is not an
/// object.
pub fn read_object(data: &str) -> Result<Value, Unreadable> {
    // Strict (`strict_json`): an event the agent may receive as it is must read one way.
    match crate::strict_json::from_str(data) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err(Unreadable("event data that is not a JSON object".into())),
        Err(crate::strict_json::StrictJsonError::DuplicateKey { .. }) => Err(Unreadable(
            "event data that names an object key twice (duplicate keys are refused: parsers disagree on which one counts)".into(),
        )),
        Err(e) => Err(Unreadable(format!(
            "event data that is not JSON turnguard can parse ({})",
            json_error_kind(&e.to_string())
        ))),
    }
}

/// Reads a [`Payload::Text`] block's `data` as [`read_object`] does (a block without `data`
/// has no object to read).
///
/// Errors: [`Unreadable`], as [`read_object`].
pub fn read_text(block: &SseBlock) -> Result<Value, Unreadable> {
    read_object(block.data.as_deref().unwrap_or_default())
}

/// A short, content-free description of a JSON parse error.
fn json_error_kind(text: &str) -> String {
    // The parser's messages name the problem and the position, never the input.
    text.chars().take(120).collect()
}

/// Serializes one event as `event: NAME\n` (when given) + `data: JSON\n\n`.
pub fn encode(event: Option<&str>, data: &str) -> Bytes {
    let mut s = String::with_capacity(data.len() + 32);
    if let Some(name) = event {
        s.push_str("event: ");
        s.push_str(name);
        s.push('\n');
    }
    for line in data.split('\n') {
        s.push_str("data: ");
        s.push_str(line);
        s.push('\n');
    }
    s.push('\n');
    Bytes::from(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame_all(chunks: &[&[u8]]) -> (Vec<SseBlock>, Bytes) {
        let mut f = SseFramer::new(1 << 20);
        let mut out = Vec::new();
        for c in chunks {
            out.extend(f.push(c).unwrap());
        }
        let (blocks, rest) = f.finish();
        out.extend(blocks);
        (out, rest)
    }

    #[test]
    fn frames_lf_crlf_and_cr_blocks_with_raw_bytes() {
        let input = b"event: a\ndata: {\"x\":1}   \n\n: keep-alive\r\n\r\ndata: 1\rdata: 2\r\r";
        let (blocks, rest) = frame_all(&[input]);
        assert_eq!(blocks.len(), 3);
        assert_eq!(blocks[0].event.as_deref(), Some("a"));
        assert_eq!(blocks[0].data.as_deref(), Some("{\"x\":1}   "));
        assert_eq!(&blocks[1].raw[..], b": keep-alive\r\n\r\n");
        assert_eq!(blocks[1].data, None);
        assert_eq!(blocks[2].data.as_deref(), Some("1\n2"));
        assert!(rest.is_empty());
        let joined: Vec<u8> = blocks.iter().flat_map(|b| b.raw.to_vec()).collect();
        assert_eq!(&joined[..], &input[..]);
    }

    #[test]
    fn only_comments_and_the_four_fields_are_readable() {
        let read = |raw: &'static [u8]| {
            let (blocks, _) = frame_all(&[raw]);
            Event::classify(blocks.into_iter().next().unwrap())
        };
        for ok in [
            &b": keep-alive\n\n"[..],
            b"event: ping\nid: 7\nretry: 10\n\n",
            b"data: {}\n\n",
            b"data:{}\n\n",
        ] {
            assert!(read(ok).is_ok(), "{}", String::from_utf8_lossy(ok));
        }
        // A byte-order mark before `data:` (some clients drop it and read the line), a field
        // with a space before its colon, a field nobody defines.
        for two_ways in [
            &b"\xEF\xBB\xBFdata: {}\n\n"[..],
            b"data : {}\n\n",
            b"data: {}\nx-note: 1\n\n",
        ] {
            let (blocks, _) = frame_all(&[two_ways]);
            assert!(blocks[0].unknown_field);
            assert!(
                read(two_ways).is_err(),
                "{}",
                String::from_utf8_lossy(two_ways)
            );
        }
    }

    #[test]
    fn crlf_split_across_chunks_is_one_terminator() {
        let (blocks, _) = frame_all(&[b"data: x\r", b"\n\r", b"\n"]);
        assert_eq!(blocks.len(), 1);
        assert_eq!(&blocks[0].raw[..], b"data: x\r\n\r\n");
    }

    #[test]
    fn unterminated_tail_is_returned_not_framed() {
        let (blocks, rest) = frame_all(&[b"data: a\n\ndata: b\n"]);
        assert_eq!(blocks.len(), 1);
        assert_eq!(&rest[..], b"data: b\n");
    }

    #[test]
    fn oversized_block_is_refused() {
        let mut f = SseFramer::new(16);
        assert!(f.push(b"data: 0123456789abcdef").is_err());
    }

    #[test]
    fn oversized_block_arriving_whole_is_refused_too() {
        let mut f = SseFramer::new(16);
        assert!(f.push(b"data: 0123456789abcdef\n\n").is_err());
        let mut f = SseFramer::new(16);
        assert_eq!(f.push(b"data: 01234567\n\n").unwrap().len(), 1);
    }
}
