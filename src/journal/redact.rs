//! Redaction of every body the journal keeps (tool-turn contract §B stage 7: secrets are
//! removed from every record): a round's response as received, what a run node's round was
//! answered with, a tool result. Parsed or not, decided or not, every byte goes through
//! [`redact_body`] before it is written — the only way to make a [`super::Recorded`].
//!
//! Three passes over the body, with the request's [`Redactor`] (the bundle's recognizers):
//!
//! 1. **Structure.** A JSON document is parsed and every string in it is redacted after JSON
//!    unescaping (a key spelt `\u0073k-…` is found), and so is every string inside it that is
//!    itself a JSON document (Chat `arguments`); an SSE stream is read event by event and each
//!    JSON `data:` payload is treated the same way. A changed document is serialized again.
//! 2. **Streams.** A stream carries text in pieces: a key split across two deltas is in no
//!    single event. The pieces of each streamed field (by event `type`, the indices naming the
//!    choice, block or item, and the field's path) are joined in order and searched; when a
//!    secret appears only in the joined text, the stream cannot be redacted piecewise and no
//!    byte of it is kept ([`Redacted::Withheld`]).
//! 3. **Text.** Whatever the structure passes left (non-JSON lines, object keys, a body that is
//!    not UTF-8 or not JSON) is redacted as text.
//!
//! JSON that names a key twice reads two ways, and the structure pass would see only the
//! value serde_json keeps (the last): a secret in the first, spelt with escapes the text pass
//! does not decode, would be kept. So documents are parsed strictly
//! ([`crate::strict_json::from_slice`]): a body or stream event that names a key twice is
//! [`Redacted::Withheld`], and a string holding such a document is replaced whole by
//! [`TWO_WAYS`]. turnguard never forwards such JSON either (it ends the turn); this is about
//! the record of what arrived.
//!
//! A redacted body is an audit record, never an answer: replay and recovery treat it as a
//! miss, like a body kept only as a digest.

use std::collections::HashMap;

use serde_json::Value;

use crate::policy::redact::Redactor;

/// JSON nesting that is searched at most (documents inside strings count as one level).
const MAX_DEPTH: usize = 64;

/// Field names whose values a stream delivers in pieces (Chat `delta.content`,
/// `function.arguments`, Messages `text_delta.text`, `input_json_delta.partial_json`,
/// `thinking`, Responses `delta` …): their pieces are joined before they are searched.
const STREAMED_FIELDS: &[&str] = &[
    "content",
    "text",
    "partial_json",
    "arguments",
    "delta",
    "thinking",
    "refusal",
    "reasoning",
    "reasoning_content",
    "summary",
];

/// Top-level event fields that tell the pieces of one streamed field from another's.
const PIECE_KEYS: &[&str] = &["type", "index", "output_index", "content_index", "item_id"];

/// What a string holding a JSON document that names a key twice is journaled as.
pub const TWO_WAYS: &str = "[REDACTED:duplicate-key]";

/// `text` as one JSON document read one way: `Ok(None)` when it is not JSON, `Err(())` when
/// it names a key twice (see the module docs).
fn parse_one_way(text: &str) -> Result<Option<Value>, ()> {
    match crate::strict_json::from_str(text) {
        Ok(v) => Ok(Some(v)),
        Err(crate::strict_json::StrictJsonError::DuplicateKey { .. }) => Err(()),
        Err(crate::strict_json::StrictJsonError::Malformed { .. }) => Ok(None),
    }
}

/// What redaction made of a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Redacted {
    /// No secret found: the body is kept as it is.
    Clean,
    /// Secrets were replaced by `[REDACTED:<name>]`: these bytes are kept instead.
    Replaced(Vec<u8>),
    /// A secret could not be removed piecewise (split across stream events, or in bytes
    /// that are not UTF-8): nothing of the body is kept but its digest.
    Withheld,
}

/// Redacts `body` (JSON, SSE or text) for the journal; see the module docs.
pub fn redact_body(redactor: &Redactor, body: &[u8]) -> Redacted {
    let Ok(text) = std::str::from_utf8(body) else {
        let lossy = String::from_utf8_lossy(body);
        return if redactor.redact_text(&lossy) == lossy {
            Redacted::Clean
        } else {
            Redacted::Withheld
        };
    };
    let structured = match parse_one_way(text) {
        Err(()) => return Redacted::Withheld,
        Ok(Some(mut doc)) => {
            if redact_value(redactor, &mut doc, 0) {
                Some(doc.to_string())
            } else {
                None
            }
        }
        Ok(None) if looks_like_sse(text) => match redact_sse(redactor, text) {
            Some(Sse::Withheld) => return Redacted::Withheld,
            Some(Sse::Changed(s)) => Some(s),
            None => None,
        },
        Ok(None) => None,
    };
    let after = structured.as_deref().unwrap_or(text);
    let textual = redactor.redact_text(after);
    if textual != after {
        return Redacted::Replaced(textual.into_bytes());
    }
    match structured {
        Some(s) => Redacted::Replaced(s.into_bytes()),
        None => Redacted::Clean,
    }
}

/// Redacts every string of `v` in place (and documents inside strings); `true` if any changed.
fn redact_value(redactor: &Redactor, v: &mut Value, depth: usize) -> bool {
    if depth > MAX_DEPTH {
        return false;
    }
    match v {
        Value::String(s) => redact_string(redactor, s, depth),
        Value::Array(a) => a.iter_mut().fold(false, |changed, x| {
            redact_value(redactor, x, depth + 1) | changed
        }),
        Value::Object(m) => m.values_mut().fold(false, |changed, x| {
            redact_value(redactor, x, depth + 1) | changed
        }),
        _ => false,
    }
}

fn redact_string(redactor: &Redactor, s: &mut String, depth: usize) -> bool {
    let mut changed = false;
    let trimmed = s.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        match parse_one_way(s) {
            Ok(Some(mut inner)) => {
                if redact_value(redactor, &mut inner, depth + 1) {
                    *s = inner.to_string();
                    changed = true;
                }
            }
            Ok(None) => {}
            Err(()) => {
                *s = TWO_WAYS.to_owned();
                return true;
            }
        }
    }
    let r = redactor.redact_text(s);
    if r != *s {
        *s = r;
        changed = true;
    }
    changed
}

fn looks_like_sse(text: &str) -> bool {
    text.lines()
        .any(|l| l.starts_with("data:") || l.starts_with("event:"))
}

enum Sse {
    Changed(String),
    Withheld,
}

/// Redacts an SSE stream event by event; `None` when nothing changed.
fn redact_sse(redactor: &Redactor, text: &str) -> Option<Sse> {
    let mut out = String::with_capacity(text.len());
    let mut changed = false;
    let mut pieces: HashMap<String, String> = HashMap::new();
    for event in split_events(text) {
        let data: Vec<&str> = event
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        let parsed = if data.is_empty() {
            None
        } else {
            match parse_one_way(&data.join("\n")) {
                Ok(doc) => doc,
                Err(()) => return Some(Sse::Withheld),
            }
        };
        let Some(mut doc) = parsed else {
            out.push_str(event);
            continue;
        };
        let replaced = redact_value(redactor, &mut doc, 0);
        // The pieces as they are kept: what the joined text still shows was split.
        collect_pieces(&doc, &mut pieces);
        if !replaced {
            out.push_str(event);
            continue;
        }
        changed = true;
        // The event again, with one `data:` line carrying the redacted payload.
        let mut wrote_data = false;
        for line in event.split_inclusive('\n') {
            if line.starts_with("data:") {
                if !wrote_data {
                    out.push_str("data: ");
                    out.push_str(&doc.to_string());
                    out.push('\n');
                    wrote_data = true;
                }
            } else {
                out.push_str(line);
            }
        }
    }
    // A secret that only the joined pieces show cannot be removed from the events.
    if pieces
        .values()
        .any(|joined| redactor.redact_text(joined) != *joined || nested_secret(redactor, joined))
    {
        return Some(Sse::Withheld);
    }
    changed.then_some(Sse::Changed(out))
}

/// A secret inside `joined` read as a JSON document (joined `arguments` pieces).
fn nested_secret(redactor: &Redactor, joined: &str) -> bool {
    let t = joined.trim_start();
    if !(t.starts_with('{') || t.starts_with('[')) {
        return false;
    }
    match parse_one_way(joined) {
        Ok(Some(mut v)) => redact_value(redactor, &mut v, 0),
        Ok(None) => false,
        // Joined pieces that read two ways cannot be shown safe.
        Err(()) => true,
    }
}

/// The events of an SSE text, each with its terminating blank line.
fn split_events(text: &str) -> Vec<&str> {
    let mut events = Vec::new();
    let mut start = 0;
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        // A blank line ends an event: "\n\n", "\r\n\r\n" (and mixed forms).
        if bytes[i] == b'\n' {
            let mut j = i + 1;
            if j < bytes.len() && bytes[j] == b'\r' {
                j += 1;
            }
            if j < bytes.len() && bytes[j] == b'\n' {
                events.push(&text[start..=j]);
                start = j + 1;
                i = j + 1;
                continue;
            }
        }
        i += 1;
    }
    if start < text.len() {
        events.push(&text[start..]);
    }
    events
}

/// Appends the streamed fields of one event to their joined pieces.
fn collect_pieces(doc: &Value, pieces: &mut HashMap<String, String>) {
    let Some(obj) = doc.as_object() else { return };
    let mut prefix = String::new();
    for k in PIECE_KEYS {
        if let Some(v) = obj.get(*k) {
            prefix.push_str(k);
            prefix.push('=');
            prefix.push_str(&v.to_string());
            prefix.push(';');
        }
    }
    walk_pieces(doc, &mut prefix.clone(), pieces, 0);
}

fn walk_pieces(v: &Value, path: &mut String, pieces: &mut HashMap<String, String>, depth: usize) {
    if depth > MAX_DEPTH {
        return;
    }
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let len = path.len();
                path.push('/');
                path.push_str(k);
                match x {
                    Value::String(s) if STREAMED_FIELDS.contains(&k.as_str()) => {
                        pieces.entry(path.clone()).or_default().push_str(s);
                    }
                    _ => walk_pieces(x, path, pieces, depth + 1),
                }
                path.truncate(len);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                // An element that carries its own `index` (Chat choices and tool calls) is
                // named by it, so the pieces of one call are joined whatever the array order.
                let name = x
                    .get("index")
                    .and_then(Value::as_u64)
                    .map_or_else(|| format!("[{i}]"), |n| format!("#{n}"));
                let len = path.len();
                path.push('/');
                path.push_str(&name);
                walk_pieces(x, path, pieces, depth + 1);
                path.truncate(len);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::bundle::Redaction;

    fn redactor() -> Redactor {
        Redactor::compile(&Redaction::default(), "t", "").unwrap()
    }

    const KEY: &str = "sk-proj-abcdefghijklmnopqrstuvwxyz012345";

    /// A key twice hides its first value from the structure pass (serde_json keeps the last):
    /// with the secret spelt in escapes the text pass does not decode, only strict reading
    /// keeps it out of the record.
    #[test]
    fn json_that_names_a_key_twice_is_never_kept_as_it_came() {
        let r = redactor();
        let escaped = format!("\\u0073{}", KEY.strip_prefix('s').unwrap());
        let body = format!(r#"{{"text": "key {escaped}", "text": "nothing"}}"#);
        assert_eq!(redact_body(&r, body.as_bytes()), Redacted::Withheld);
        let sse = format!("data: {body}\n\ndata: [DONE]\n\n");
        assert_eq!(redact_body(&r, sse.as_bytes()), Redacted::Withheld);
        let inner = format!(r#"{{"k": "{escaped}", "k": 1}}"#);
        let nested = serde_json::json!({"arguments": inner, "other": "kept"});
        let Redacted::Replaced(out) = redact_body(&r, nested.to_string().as_bytes()) else {
            panic!("a document inside a string that reads two ways is replaced")
        };
        let out = String::from_utf8(out).unwrap();
        assert!(
            out.contains(TWO_WAYS) && !out.contains("abcdefghij") && out.contains("kept"),
            "{out}"
        );
        // The same documents with the key once are read and redacted as before.
        let once = format!(r#"{{"text": "key {escaped}"}}"#);
        assert!(matches!(
            redact_body(&r, once.as_bytes()),
            Redacted::Replaced(_)
        ));
    }

    #[test]
    fn json_bodies_are_redacted_after_unescaping() {
        let r = redactor();
        assert_eq!(redact_body(&r, br#"{"a": "nothing"}"#), Redacted::Clean);
        let escaped = format!(
            r#"{{"text": "key \u0073{}"}}"#,
            KEY.strip_prefix('s').unwrap()
        );
        let Redacted::Replaced(out) = redact_body(&r, escaped.as_bytes()) else {
            panic!("an escaped key is found")
        };
        let out = String::from_utf8(out).unwrap();
        assert!(
            out.contains("[REDACTED:api-key]") && !out.contains("abcdefghij"),
            "{out}"
        );
        let nested = serde_json::json!({"arguments": serde_json::json!({"k": KEY}).to_string()});
        let Redacted::Replaced(out) = redact_body(&r, nested.to_string().as_bytes()) else {
            panic!("a key in a document inside a string is found")
        };
        assert!(!String::from_utf8(out).unwrap().contains("abcdefghij"));
    }

    #[test]
    fn streams_are_redacted_per_event_and_split_keys_withhold_the_body() {
        let r = redactor();
        let ev = |content: &str| {
            format!(
                "data: {}\n\n",
                serde_json::json!({"choices": [{"index": 0, "delta": {"content": content}}]})
            )
        };
        let whole = format!("{}{}data: [DONE]\n\n", ev("hi "), ev(&format!("use {KEY}")));
        let Redacted::Replaced(out) = redact_body(&r, whole.as_bytes()) else {
            panic!("a key in one event is replaced")
        };
        let out = String::from_utf8(out).unwrap();
        assert!(
            out.ends_with("data: [DONE]\n\n") && !out.contains("abcdefghij"),
            "{out}"
        );
        let (a, b) = KEY.split_at(14);
        let split = format!("{}{}data: [DONE]\n\n", ev(a), ev(b));
        assert_eq!(redact_body(&r, split.as_bytes()), Redacted::Withheld);
        let clean = format!("{}{}data: [DONE]\n\n", ev("sk-"), ev("is short"));
        assert_eq!(redact_body(&r, clean.as_bytes()), Redacted::Clean);
    }

    #[test]
    fn text_and_non_utf8_bodies() {
        let r = redactor();
        let Redacted::Replaced(out) = redact_body(&r, format!("oops {KEY}").as_bytes()) else {
            panic!()
        };
        assert_eq!(out, b"oops [REDACTED:api-key]");
        let mut bin = KEY.as_bytes().to_vec();
        bin.push(0xff);
        assert_eq!(redact_body(&r, &bin), Redacted::Withheld);
        assert_eq!(redact_body(&r, &[0xff, 0x00]), Redacted::Clean);
    }
}
