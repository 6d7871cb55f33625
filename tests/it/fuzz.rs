//! Property fuzzing of every parser that sees hostile bytes (issue 11): SSE framing and
//! classification, each adapter's request parser, response parser, rewrite and repair
//! builders and stream adapter (through the relay [`Pipeline`]), the policy loader, and JCS.
//! Each property asserts no panic and termination; the stream property asserts the rule of
//! DESIGN.md §9 on generated streams of each provider (valid and mutated events, random line
//! endings, random splits): every block that reaches the agent is an event that parsed as a
//! JSON object and whose calls were admitted, a known sentinel (`[DONE]`, a comment), or —
//! last — turnguard's provider-shaped error.
//!
//! Cases per property: `PROPTEST_CASES` (the CI run uses the small defaults below; the long
//! run, `bench/fuzz.sh`, scales it and varies `PROPTEST_RNG_SEED`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use std::collections::BTreeSet;
use std::sync::OnceLock;

use bytes::Bytes;
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use serde_json::{json, Map, Value};
use turnguard::admission::{admit_choice, AdmitCtx, LimitState, SchemaCache};
use turnguard::model::{
    AnswerContext, Api, ChoiceEmissions, ChoiceVerdict, Decision, Outcome, RepairItem, Stage,
    Surfacing,
};
use turnguard::policy::bundle::ContentTrust;
use turnguard::policy::{BundleSource, CompiledPolicy};
use turnguard::proxy::pipeline::{Finish, Pipeline};
use turnguard::sse::{Event, SseFramer};
use turnguard::strict_json::RequestBody;

use crate::support;

const EVIL: &str = "exfiltrate";
const APIS: [Api; 3] = [
    Api::OpenAiChat,
    Api::AnthropicMessages,
    Api::OpenAiResponses,
];

/// `default` cases, unless `PROPTEST_CASES` says otherwise; no regression files.
fn config(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        failure_persistence: None,
        max_shrink_iters: 512,
        ..ProptestConfig::default()
    }
}

// ---- generators ----------------------------------------------------------------------------

/// Keys and strings the adapters look at, so generated JSON reaches their branches.
const WORDS: [&str; 48] = [
    "type",
    "index",
    "choices",
    "delta",
    "tool_calls",
    "function",
    "name",
    "arguments",
    "id",
    "content",
    "role",
    "messages",
    "input",
    "output",
    "tools",
    "finish_reason",
    "stop_reason",
    "usage",
    "content_block",
    "partial_json",
    "output_index",
    "item",
    "response",
    "status",
    "sequence_number",
    "item_id",
    "call_id",
    "source",
    "url",
    "image_url",
    "file_id",
    "error",
    "tool_use",
    "function_call",
    "message",
    "assistant",
    "user",
    "tool",
    "get_weather",
    EVIL,
    "tool_result",
    "tool_use_id",
    "max_tokens",
    "completed",
    "incomplete",
    "[DONE]",
    "data:",
    "mcp_servers",
];

fn word() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(&WORDS[..]).prop_map(str::to_owned),
        1 => "\\PC{0,12}",
    ]
}

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (0u64..8).prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        word().prop_map(Value::String),
    ]
}

/// Arbitrary JSON whose keys are mostly the ones the adapters read.
fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::vec((word(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A request of `api`: a plausible skeleton whose parts are replaced by generated JSON.
fn request(api: Api) -> impl Strategy<Value = Value> {
    let base = match api {
        Api::OpenAiChat => json!({"model": "m", "stream": true, "max_tokens": 100,
            "messages": [{"role": "user", "content": "go"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}),
        Api::AnthropicMessages => json!({"model": "m", "max_tokens": 100,
            "messages": [{"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}),
        Api::OpenAiResponses => json!({"model": "m", "max_output_tokens": 100,
            "input": [{"role": "user", "content": "go"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}),
    };
    (
        proptest::collection::vec((any::<u16>(), json_value()), 0..4),
        json_value(),
        any::<bool>(),
    )
        .prop_map(move |(edits, whole, replace_all)| {
            if replace_all {
                return whole;
            }
            let mut v = base.clone();
            for (at, value) in edits {
                mutate_at(&mut v, at as usize, value);
            }
            v
        })
}

/// Replaces the `at`-th node (in a walk of `v`) with `value`.
fn mutate_at(v: &mut Value, at: usize, value: Value) {
    fn count(v: &Value) -> usize {
        1 + match v {
            Value::Array(a) => a.iter().map(count).sum(),
            Value::Object(o) => o.values().map(count).sum(),
            _ => 0,
        }
    }
    fn walk(v: &mut Value, mut at: usize, value: &mut Option<Value>) -> usize {
        if at == 0 {
            if let Some(new) = value.take() {
                *v = new;
            }
            return 0;
        }
        at -= 1;
        let children: Vec<&mut Value> = match v {
            Value::Array(a) => a.iter_mut().collect(),
            Value::Object(o) => o.values_mut().collect(),
            _ => Vec::new(),
        };
        for c in children {
            let n = count(c);
            if at < n {
                return walk(c, at, value);
            }
            at -= n;
        }
        at
    }
    let n = count(v);
    let mut value = Some(value);
    walk(v, at % n, &mut value);
}

fn policy() -> &'static CompiledPolicy {
    static POLICY: OnceLock<CompiledPolicy> = OnceLock::new();
    POLICY.get_or_init(|| {
        let src = turnguard::reload::read_dir(&support::own_fixtures().join("policy-open"))
            .expect("policy-open");
        turnguard::policy::compile(&src).expect("policy-open compiles")
    })
}

/// Admits `round` with the `policy-open` bundle (an undeclared tool is always withheld), as
/// the request path does (no stage notes) and checks that explaining (`policy explain`'s
/// mode) decides the same: the notes are all that differs.
fn admit(turn: &turnguard::model::Turn, round: &[ChoiceEmissions]) -> Vec<ChoiceVerdict> {
    let verdicts = admit_explaining(turn, round, false);
    let mut explained = admit_explaining(turn, round, true);
    for d in explained.iter_mut().flat_map(|v| v.decisions.iter_mut()) {
        assert!(
            !d.trace.is_empty(),
            "an explained decision has no notes: {d:?}"
        );
        d.trace.clear();
    }
    assert!(
        verdicts
            .iter()
            .flat_map(|v| &v.decisions)
            .all(|d| d.trace.is_empty()),
        "the request path formatted stage notes"
    );
    assert_eq!(explained, verdicts, "explaining changed a decision");
    verdicts
}

/// [`admit`] with or without the stage notes (`AdmitCtx::explain`).
fn admit_explaining(
    turn: &turnguard::model::Turn,
    round: &[ChoiceEmissions],
    explain: bool,
) -> Vec<ChoiceVerdict> {
    let schemas = SchemaCache::default();
    let limits = LimitState::default();
    let never = |_: u32, _: usize, _: &str| false;
    let ctx = AdmitCtx {
        policy: policy(),
        schemas: &schemas,
        limits: &limits,
        person: None,
        agent: "agent",
        trust: ContentTrust::Trusted,
        run: None,
        provider: "fuzz",
        approved: &never,
        // With a repair left, `policy-open`'s `invalid = "end-turn"` applies.
        repairs_left: 1,
        explain,
    };
    round.iter().map(|c| admit_choice(&ctx, turn, c)).collect()
}

// ---- SSE framing ---------------------------------------------------------------------------

fn sse_bytes() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        Just(b"data: ".to_vec()),
        Just(b"event: message_start".to_vec()),
        Just(b": keep-alive".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(b"\r".to_vec()),
        Just(b"{\"type\":\"ping\"}".to_vec()),
        Just(b"[DONE]".to_vec()),
        Just(vec![0xff, 0xfe]),
        proptest::collection::vec(any::<u8>(), 0..8),
    ];
    proptest::collection::vec(piece, 0..40).prop_map(|p| p.concat())
}

fn split(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.sort_unstable();
    points.dedup();
    let mut out = Vec::new();
    let mut last = 0;
    for p in points {
        out.push(bytes[last..p].to_vec());
        last = p;
    }
    out.push(bytes[last..].to_vec());
    out
}

fn frame(chunks: &[Vec<u8>], cap: usize) -> Result<(Vec<Bytes>, Bytes), ()> {
    let mut f = SseFramer::new(cap);
    let mut raw = Vec::new();
    for c in chunks {
        raw.extend(f.push(c).map_err(|_| ())?.into_iter().map(|b| {
            let _ = Event::classify(b.clone());
            b.raw
        }));
    }
    let (blocks, rest) = f.finish();
    raw.extend(blocks.into_iter().map(|b| b.raw));
    Ok((raw, rest))
}

proptest! {
    #![proptest_config(config(256))]

    /// Framing keeps every byte, and any split of the input yields the same blocks.
    #[test]
    fn sse_framing_is_byte_faithful_under_any_split(bytes in sse_bytes(), cuts in proptest::collection::vec(any::<usize>(), 0..12)) {
        let (whole, rest) = frame(std::slice::from_ref(&bytes), usize::MAX).unwrap();
        let joined: Vec<u8> = whole.iter().flat_map(|b| b.to_vec()).chain(rest.to_vec()).collect();
        prop_assert_eq!(&joined, &bytes);
        let (parts, rest2) = frame(&split(&bytes, &cuts), usize::MAX).unwrap();
        prop_assert_eq!(parts, whole);
        prop_assert_eq!(rest2, rest);
        // A small cap refuses, never panics.
        let _ = frame(&split(&bytes, &cuts), 16);
    }
}

// ---- request and response parsers, rewrites, repairs, digests -------------------------------

fn verdict_for(choice: &ChoiceEmissions, pattern: u32) -> ChoiceVerdict {
    let decisions: Vec<Decision> = (0..choice.calls.len())
        .map(|i| {
            let released = (pattern >> (i % 32)) & 1 == 1;
            let mut d = Decision::new(
                if released {
                    Outcome::Executed
                } else {
                    Outcome::Invalid
                },
                Stage::Name,
                turnguard::reason::Reason::Released,
                String::new(),
            );
            if released && pattern % 3 == 0 {
                d.release_args = Some("{\"redacted\":true}".into());
            }
            d
        })
        .collect();
    let surfacing = match pattern % 4 {
        0 => Surfacing::Release,
        1 => Surfacing::Drop,
        _ => Surfacing::EndTurn("[turnguard] fuzz".into()),
    };
    ChoiceVerdict {
        choice: choice.choice,
        decisions,
        surfacing,
        claims: Vec::new(),
    }
}

proptest! {
    #![proptest_config(config(128))]

    /// Request parsing, the semantic digest and JCS never panic on any JSON; JCS is stable
    /// (its output re-parsed canonicalizes to the same bytes).
    #[test]
    fn request_parsers_digests_and_jcs_never_panic(api in proptest::sample::select(&APIS[..]), body in prop_oneof![request(Api::OpenAiChat), request(Api::AnthropicMessages), request(Api::OpenAiResponses)]) {
        let _ = turnguard::provider::adapter(api).parse_request(&body);
        let _ = turnguard::provider::adapter(api).structured_schema(&body);
        let _ = turnguard::recipes::semantic_request_digest(api, &RequestBody::from(body.clone()));
        let jcs = turnguard::admission::arguments::canonical(&body);
        let back: Value = serde_json::from_slice(&jcs).expect("JCS output is JSON");
        prop_assert_eq!(turnguard::admission::arguments::canonical(&back), jcs);
        let mut up = RequestBody::from(body.clone());
        if let Ok(mut turn) = turnguard::provider::adapter(api).parse_request(&body) {
            turnguard::provider::adapter(api).prepare_upstream(&mut up, &mut turn);
        }
    }

    /// A request body read with its declared tools cached (`request_from_slice`, the request
    /// path's reader) is the tree `from_slice` reads, or the same error: on mutated requests
    /// of every API, with a key repeated, a number no tree reads or deep nesting put into the
    /// first tool, read once with a cache that keeps what it reads and again from it.
    #[test]
    fn a_request_read_with_cached_tools_reads_as_the_strict_tree(
        body in prop_oneof![request(Api::OpenAiChat), request(Api::AnthropicMessages), request(Api::OpenAiResponses)],
        twist in 0u8..5,
        depth in 120usize..132,
    ) {
        let mut text = serde_json::to_string(&body).unwrap();
        if let Some(at) = text.find("\"tools\":[{").map(|at| at + "\"tools\":[{".len()) {
            let inserted = match twist {
                1 => "\"k\":1,\"k\":2,".to_owned(),
                2 => "\"k\":1e400,".to_owned(),
                3 => format!("\"k\":{}1{},", "[".repeat(depth), "]".repeat(depth)),
                4 => "\"\\u0074ype\":0,".to_owned(),
                _ => String::new(),
            };
            text.insert_str(at, &inserted);
        }
        let shown = |r: Result<Value, turnguard::strict_json::StrictJsonError>| match r {
            Ok(v) => format!("ok {v}"),
            Err(e) => format!("err {e}"),
        };
        let tree = turnguard::strict_json::from_slice(text.as_bytes());
        let (want_text, want_digest) = match &tree {
            Ok(t) => (
                turnguard::strict_json::to_text(t),
                turnguard::recipes::semantic_request_digest(Api::OpenAiChat, &RequestBody::from(t.clone())),
            ),
            Err(_) => (String::new(), String::new()),
        };
        let want = shown(tree);
        let cache = turnguard::strict_json::ValueCache::new(1 << 20);
        for round in ["first", "cached"] {
            let read = turnguard::strict_json::request_from_slice(text.as_bytes(), &cache);
            // What goes upstream when turnguard rewrites the body, and its digest: the
            // whole tree's, with the shared tools at their place.
            if let Ok(body) = &read {
                prop_assert_eq!(&body.to_text(), &want_text, "{} read of {}", round, text);
                prop_assert_eq!(
                    &turnguard::recipes::semantic_request_digest(Api::OpenAiChat, body),
                    &want_digest,
                    "{} read of {}", round, text
                );
            }
            let got = shown(read.map(RequestBody::into_tree));
            prop_assert_eq!(&got, &want, "{} read of {}", round, text);
        }
    }

    /// Response parsing, the non-stream rewrite and the repair builders never panic.
    #[test]
    fn response_parsers_and_rewrites_never_panic(api in proptest::sample::select(&APIS[..]), body in json_value(), edits in proptest::collection::vec((any::<u16>(), json_value()), 0..3), pattern in any::<u32>()) {
        let turn = turnguard::provider::adapter(api).parse_request(&base_request(api)).unwrap();
        let mut body = if edits.is_empty() { body } else {
            let mut b = response_template(api);
            for (at, v) in edits { mutate_at(&mut b, at as usize, v); }
            b
        };
        let _ = turnguard::provider::adapter(api).response_link(&body, &turn.answer_context());
        if let Ok(round) = turnguard::provider::adapter(api).parse_response(&body, &turn.answer_context()) {
            let verdicts: Vec<ChoiceVerdict> = round.iter().map(|c| verdict_for(c, pattern)).collect();
            let _ = turnguard::provider::adapter(api).rewrite_response(&mut body, &verdicts);
            for c in &round {
                let items: Vec<RepairItem> = (0..c.calls.len() + 1)
                    .map(|call| RepairItem { call, text: "fix it".into(), is_error: true })
                    .collect();
                let mut req = base_request(api);
                turnguard::provider::adapter(api).append_repair(&mut req, c, &items);
                turnguard::provider::adapter(api).append_text_repair(&mut req, "x", "y");
            }
        }
    }

}

proptest! {
    #![proptest_config(config(32))]

    /// The policy loader refuses, never panics, on mutated bundle files.
    #[test]
    fn the_policy_loader_never_panics(file in 0usize..16, edits in proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 1..8)) {
        let mut src: BundleSource = turnguard::reload::embedded();
        let names: Vec<String> = src.files.keys().cloned().collect();
        let name = &names[file % names.len()];
        let mut bytes = src.files[name].clone().into_bytes();
        for (at, b, op) in edits {
            let at = at % (bytes.len() + 1);
            match op {
                0 => bytes.insert(at, b),
                1 if at < bytes.len() => { bytes.remove(at); }
                _ if at < bytes.len() => bytes[at] = b,
                _ => {}
            }
        }
        src.files.insert(name.clone(), String::from_utf8_lossy(&bytes).into_owned());
        let _ = turnguard::policy::compile(&src);
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// The Chat API's typed view of a response body (`parse_response_bytes`, no JSON tree)
    /// answers as the tree reader (`parse_response`) wherever it answers, on mutated
    /// responses: any field replaced by any JSON, a field repeated, a key escaped, the legacy
    /// `function_call` and `refusal` present or not, a field it skips holding a number no
    /// tree reads (`1e400`, in any of the first eight objects); it answers for the template itself and never for a body no tree
    /// reads (`is_readable_object` agrees with the strict tree, `strict_json::from_slice`:
    /// a key twice anywhere is refused by both). And when `rewrites` says
    /// no verdict changes the body, the rewrite changes nothing.
    #[test]
    fn a_typed_view_reads_what_the_tree_reader_reads(
        edits in proptest::collection::vec((any::<u16>(), json_value()), 0..4),
        extras in 0u8..8,
        repeat in proptest::option::of((0usize..VIEW_KEYS.len(), json_value())),
        escape in any::<bool>(),
        overflow in proptest::option::of(0usize..8),
        max in proptest::option::of(0u64..10),
        pattern in any::<u32>(),
    ) {
        let mut body = response_template(Api::OpenAiChat);
        if let Some(message) = body.pointer_mut("/choices/0/message").and_then(Value::as_object_mut) {
            if extras & 1 != 0 {
                message.insert("function_call".into(), json!({"name": "get_weather", "arguments": "{\"a\":1}"}));
            }
            if extras & 2 != 0 {
                message.insert("refusal".into(), json!(if extras & 4 != 0 { "no" } else { "" }));
            }
        }
        let well_formed = edits.is_empty() && repeat.is_none();
        for (at, v) in edits {
            mutate_at(&mut body, at as usize, v);
        }
        let mut text = serde_json::to_string(&body).unwrap();
        if let Some((k, v)) = &repeat {
            // The key again, earlier in the same object: serde_json keeps the later one.
            let key = format!("\"{}\":", VIEW_KEYS[*k]);
            if let Some(at) = text.find(&key) {
                text.insert_str(at, &format!("{key}{v},"));
            }
        }
        if escape {
            text = text.replacen("\"index\":", "\"\\u0069ndex\":", 1);
        }
        if let Some(nth) = overflow {
            // A member no view reads, holding a number no tree reads, in the nth object.
            if let Some((at, _)) = text.match_indices('{').nth(nth) {
                text.insert_str(at + 1, "\"skipped\":1e400,");
            }
        }
        let adapter = turnguard::provider::adapter(Api::OpenAiChat);
        let ctx = AnswerContext { max_output_tokens: max, previous_response_id: None };
        let readable = turnguard::strict_json::is_readable_object(text.as_bytes());
        let tree = turnguard::strict_json::from_slice(text.as_bytes()).ok().filter(Value::is_object);
        prop_assert_eq!(readable, tree.is_some());
        let fast = adapter.parse_response_bytes(text.as_bytes(), &ctx);
        let Some(mut tree) = tree else {
            prop_assert!(fast.is_none(), "the view read a body no tree reads: {}", text);
            return Ok(());
        };
        let slow = adapter.parse_response(&tree, &ctx);
        match fast {
            Some(fast) => prop_assert_eq!(fast, slow.clone()),
            None => prop_assert!(!well_formed, "the view refused the template: {}", text),
        }
        if let Ok(round) = slow {
            let verdicts: Vec<ChoiceVerdict> = round.iter().map(|c| verdict_for(c, pattern)).collect();
            if !adapter.rewrites(&verdicts) {
                prop_assert!(!adapter.rewrite_response(&mut tree, &verdicts));
            }
        }
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// A Chat stream reads a chunk's text through its typed view (`Event::classify_text`,
    /// what the relay does when nothing else reads the tree) exactly as it reads the chunk's
    /// tree (`Event::classify`): fed the same mutated stream (any field replaced by any JSON,
    /// a field the view reads repeated, a key escaped, a member no tree reads, an `error`, a
    /// `null` where the stream refuses one, a choice twice or a second choice), the two streams forward the same bytes after
    /// every event, break on the same event (an unreadable one with the message the tree
    /// reading gives), hold, decide and report the same, and release the same bytes under
    /// the same verdicts, before and after the decision.
    #[test]
    fn a_chat_stream_reads_text_as_it_reads_trees(
        mutations in proptest::collection::vec(
            (0usize..9, proptest::option::of((any::<u16>(), json_value())), 0u8..10, json_value()),
            0..4,
        ),
        pattern in any::<u32>(),
        max in proptest::option::of(0u64..12),
    ) {
        let mut events: Vec<String> = template(Api::OpenAiChat, pattern % 5 == 0)
            .into_iter()
            .map(|(_, v)| match v {
                Value::String(s) => s,
                v => serde_json::to_string(&v).unwrap(),
            })
            .collect();
        for (at, edit, text_edit, v) in mutations {
            let Some(text) = events.get_mut(at % 9) else { continue };
            if let Some((node, value)) = edit {
                if let Ok(mut tree) = serde_json::from_str::<Value>(text) {
                    mutate_at(&mut tree, node as usize, value);
                    *text = serde_json::to_string(&tree).unwrap();
                }
            }
            let insert_after = |text: &mut String, needle: &str, what: &str| {
                if let Some(i) = text.find(needle) {
                    text.insert_str(i + needle.len(), what);
                }
            };
            match text_edit {
                // A key the view reads, again, earlier in its object (the tree keeps the later).
                0 => {
                    let key = ["\"index\":", "\"arguments\":", "\"finish_reason\":", "\"choices\":"][(pattern % 4) as usize];
                    if let Some(i) = text.find(key) {
                        text.insert_str(i, &format!("{key}{v},"));
                    }
                }
                1 => *text = text.replacen("\"index\":", "\"\\u0069ndex\":", 1),
                2 => insert_after(text, "{", "\"skipped\":1e400,"),
                3 => insert_after(text, "{", &format!("\"error\":{v},")),
                4 => *text = text.replacen("\"delta\":{", "\"delta\":null,\"x\":{", 1),
                5 => insert_after(text, "\"delta\":{", &format!("\"role\":{v},")),
                // The first choice again, on its own index (refused) or the next one.
                6 | 7 => {
                    if let Ok(mut tree) = serde_json::from_str::<Value>(text) {
                        if let Some(list) = tree.get_mut("choices").and_then(Value::as_array_mut) {
                            if let Some(mut again) = list.first().cloned() {
                                if let Some(c) = again.as_object_mut().filter(|_| text_edit == 7) {
                                    c.insert("index".into(), json!(1));
                                }
                                list.push(again);
                            }
                        }
                        *text = serde_json::to_string(&tree).unwrap();
                    }
                }
                _ => {}
            }
        }
        let mut request = base_request(Api::OpenAiChat);
        if let Some(m) = max {
            request["max_tokens"] = json!(m);
        }
        let turn = turnguard::provider::adapter(Api::OpenAiChat).parse_request(&request).unwrap();
        let adapter = turnguard::provider::adapter(Api::OpenAiChat);
        let (mut by_tree, mut by_text) = (adapter.stream(&turn, None), adapter.stream(&turn, None));
        let mut framer = SseFramer::new(usize::MAX);
        for text in &events {
            let block = framer.push(format!("data: {text}\n\n").as_bytes()).unwrap().pop().unwrap();
            let (mut tree_out, mut text_out) = (Vec::new(), Vec::new());
            by_text.push(Event::classify_text(block.clone()).unwrap(), &mut text_out);
            match Event::classify(block) {
                Ok(event) => by_tree.push(event, &mut tree_out),
                Err(e) => {
                    // The relay breaks on an unreadable block; the text reading refuses it.
                    let why = e.to_string();
                    prop_assert_eq!(by_text.violation(), Some(why.as_str()), "{}", text);
                    prop_assert!(text_out.is_empty());
                    return Ok(());
                }
            }
            prop_assert_eq!(&tree_out, &text_out, "forwarded bytes differ after {}", text);
            prop_assert_eq!(by_tree.violation(), by_text.violation(), "{}", text);
            if by_tree.violation().is_some() {
                return Ok(());
            }
            prop_assert_eq!(
                (by_tree.ready(), by_tree.pending(), by_tree.failed(), by_tree.finished()),
                (by_text.ready(), by_text.pending(), by_text.failed(), by_text.finished()),
                "{}", text
            );
            prop_assert_eq!(by_tree.completions(), by_text.completions());
            if by_tree.ready() {
                let round = by_tree.round();
                prop_assert_eq!(&round, &by_text.round());
                let verdicts: Vec<ChoiceVerdict> = round.iter().map(|c| verdict_for(c, pattern)).collect();
                let (mut tree_out, mut text_out) = (Vec::new(), Vec::new());
                by_tree.release(&verdicts, &mut tree_out);
                by_text.release(&verdicts, &mut text_out);
                prop_assert_eq!(&tree_out, &text_out, "released bytes differ");
                prop_assert_eq!(by_tree.violation(), by_text.violation());
            }
        }
    }
}

/// The keys the Chat view reads.
const VIEW_KEYS: [&str; 12] = [
    "choices",
    "usage",
    "completion_tokens",
    "index",
    "message",
    "finish_reason",
    "content",
    "tool_calls",
    "refusal",
    "id",
    "name",
    "arguments",
];

fn base_request(api: Api) -> Value {
    let tools = |api: Api| match api {
        Api::OpenAiChat => {
            json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
        }
        Api::AnthropicMessages => {
            json!([{"name": "get_weather", "input_schema": {"type": "object"}}])
        }
        Api::OpenAiResponses => {
            json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}])
        }
    };
    match api {
        Api::OpenAiChat => {
            json!({"model": "m", "stream": true, "max_tokens": 100, "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "go"}], "tools": tools(api)})
        }
        Api::AnthropicMessages => json!({"model": "m", "stream": true, "max_tokens": 100,
            "messages": [{"role": "user", "content": "go"}], "tools": tools(api)}),
        Api::OpenAiResponses => json!({"model": "m", "stream": true, "max_output_tokens": 100,
            "input": "go", "tools": tools(api)}),
    }
}

fn response_template(api: Api) -> Value {
    match api {
        Api::OpenAiChat => {
            json!({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                {"id": "call_e", "type": "function", "function": {"name": EVIL, "arguments": "{}"}}]}, "finish_reason": "tool_calls"}],
            "usage": {"completion_tokens": 5}})
        }
        Api::AnthropicMessages => {
            json!({"id": "msg", "type": "message", "role": "assistant", "content": [
            {"type": "text", "text": "hi"}, {"type": "tool_use", "id": "toolu_w", "name": "get_weather", "input": {}},
            {"type": "tool_use", "id": "toolu_e", "name": EVIL, "input": {}}], "stop_reason": "tool_use", "usage": {"output_tokens": 5}})
        }
        Api::OpenAiResponses => {
            json!({"id": "resp", "object": "response", "status": "completed", "output": [
            {"type": "function_call", "id": "fc_w", "call_id": "call_w", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "id": "fc_e", "call_id": "call_e", "name": EVIL, "arguments": "{}"}],
            "usage": {"output_tokens": 5}})
        }
    }
}

// ---- streams: the forwarding invariant ------------------------------------------------------

/// The events of one provider's tool-call stream: text, a declared call, an undeclared one.
fn stream_template(api: Api) -> Vec<(Option<&'static str>, Value)> {
    match api {
        Api::OpenAiChat => {
            let chunk = |choices: Value| json!({"id": "chatcmpl-f", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices});
            vec![
                (
                    None,
                    chunk(
                        json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
                    ),
                ),
                (
                    None,
                    chunk(
                        json!([{"index": 0, "delta": {"content": "Let me check."}, "finish_reason": null}]),
                    ),
                ),
                (
                    None,
                    chunk(
                        json!([{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}, "finish_reason": null}]),
                    ),
                ),
                (
                    None,
                    chunk(
                        json!([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":\"Paris\"}"}}]}, "finish_reason": null}]),
                    ),
                ),
                (
                    None,
                    chunk(
                        json!([{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call_e", "type": "function", "function": {"name": EVIL, "arguments": "{}"}}]}, "finish_reason": null}]),
                    ),
                ),
                (
                    None,
                    chunk(json!([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}])),
                ),
                (
                    None,
                    json!({"id": "chatcmpl-f", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}),
                ),
                (None, Value::String("[DONE]".into())),
            ]
        }
        Api::AnthropicMessages => {
            let e = |name: &'static str, v: Value| (Some(name), v);
            vec![
                e(
                    "message_start",
                    json!({"type": "message_start", "message": {"id": "msg_f", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": null, "usage": {"input_tokens": 5, "output_tokens": 1}}}),
                ),
                e(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                ),
                e(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me check."}}),
                ),
                e(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": 0}),
                ),
                e(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_w", "name": "get_weather", "input": {}}}),
                ),
                e("ping", json!({"type": "ping"})),
                e(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"city\":\"Paris\"}"}}),
                ),
                e(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": 1}),
                ),
                e(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_e", "name": EVIL, "input": {}}}),
                ),
                e(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{}"}}),
                ),
                e(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": 2}),
                ),
                e(
                    "message_delta",
                    json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 20}}),
                ),
                e("message_stop", json!({"type": "message_stop"})),
            ]
        }
        Api::OpenAiResponses => {
            let w = json!({"type": "function_call", "id": "fc_w", "call_id": "call_w", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}", "status": "completed"});
            let x = json!({"type": "function_call", "id": "fc_e", "call_id": "call_e", "name": EVIL, "arguments": "{}", "status": "completed"});
            let mut added_w = w.clone();
            added_w["arguments"] = json!("");
            let e = |name: &'static str, v: Value| (Some(name), v);
            vec![
                e(
                    "response.created",
                    json!({"type": "response.created", "response": {"id": "resp_f", "object": "response", "status": "in_progress", "output": []}}),
                ),
                e(
                    "response.output_item.added",
                    json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}}),
                ),
                e(
                    "response.output_text.delta",
                    json!({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "Let me check."}),
                ),
                e(
                    "response.output_item.done",
                    json!({"type": "response.output_item.done", "output_index": 0, "item": {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "Let me check."}]}}),
                ),
                e(
                    "response.output_item.added",
                    json!({"type": "response.output_item.added", "output_index": 1, "item": added_w}),
                ),
                e(
                    "response.function_call_arguments.delta",
                    json!({"type": "response.function_call_arguments.delta", "item_id": "fc_w", "output_index": 1, "delta": "{\"city\":\"Paris\"}"}),
                ),
                e(
                    "response.function_call_arguments.done",
                    json!({"type": "response.function_call_arguments.done", "item_id": "fc_w", "output_index": 1, "arguments": "{\"city\":\"Paris\"}"}),
                ),
                e(
                    "response.output_item.done",
                    json!({"type": "response.output_item.done", "output_index": 1, "item": w.clone()}),
                ),
                e(
                    "response.output_item.added",
                    json!({"type": "response.output_item.added", "output_index": 2, "item": x.clone()}),
                ),
                e(
                    "response.output_item.done",
                    json!({"type": "response.output_item.done", "output_index": 2, "item": x.clone()}),
                ),
                e(
                    "response.completed",
                    json!({"type": "response.completed", "response": {"id": "resp_f", "object": "response", "status": "completed", "output": [w, x], "usage": {"input_tokens": 5, "output_tokens": 20, "total_tokens": 25}}}),
                ),
            ]
        }
    }
}

/// How one event of the template is changed.
#[derive(Debug, Clone)]
enum Mutation {
    Keep,
    Drop,
    Duplicate,
    SwapWithNext,
    /// Replace the `at`-th node of the event's JSON.
    Replace(u16, Value),
    /// Serde refuses it; other parsers accept it.
    Nan,
    /// Another `event:` name.
    Rename,
    /// Raw bytes instead of the event.
    Garbage(Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        12 => Just(Mutation::Keep),
        1 => Just(Mutation::Drop),
        1 => Just(Mutation::Duplicate),
        1 => Just(Mutation::SwapWithNext),
        3 => (any::<u16>(), json_value()).prop_map(|(a, v)| Mutation::Replace(a, v)),
        1 => Just(Mutation::Nan),
        1 => Just(Mutation::Rename),
        1 => proptest::collection::vec(any::<u8>(), 0..12).prop_map(Mutation::Garbage),
    ]
}

/// The template with or without the undeclared call (with it, the turn ends and nothing
/// is released; without it, the declared call is).
fn template(api: Api, evil: bool) -> Vec<(Option<&'static str>, Value)> {
    let mut t = stream_template(api);
    if !evil {
        // The undeclared call's events: its ids, or (Messages) its block index 2.
        t.retain(|(_, v)| {
            let text = v.to_string();
            let its = ["call_e", "toolu_e", "fc_e"]
                .iter()
                .any(|id| text.contains(id))
                || (api == Api::AnthropicMessages && v.get("index") == Some(&json!(2)));
            !its || v.pointer("/response/output").is_some()
        });
        for (_, v) in t.iter_mut() {
            if let Some(output) = v
                .pointer_mut("/response/output")
                .and_then(Value::as_array_mut)
            {
                output.retain(|i| i.get("name").and_then(Value::as_str) != Some(EVIL));
            }
        }
    }
    t
}

/// Serializes the (mutated) template as SSE bytes with `crlf` line endings or not.
fn stream_bytes(api: Api, evil: bool, mutations: &[Mutation], crlf: bool) -> Vec<u8> {
    let mut events: Vec<Vec<u8>> = Vec::new();
    let template = template(api, evil);
    let nl = if crlf { "\r\n" } else { "\n" };
    let render = |name: Option<&str>, data: &str| {
        let mut s = String::new();
        if let Some(n) = name {
            s.push_str(&format!("event: {n}{nl}"));
        }
        s.push_str(&format!("data: {data}{nl}{nl}"));
        s.into_bytes()
    };
    let data_of = |v: &Value| match v {
        Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    let mut i = 0;
    let mut swapped: Vec<(Option<&str>, Value)> = template.clone();
    for (k, m) in mutations.iter().enumerate().take(swapped.len()) {
        if matches!(m, Mutation::SwapWithNext) && k + 1 < swapped.len() {
            swapped.swap(k, k + 1);
        }
    }
    for (name, v) in &swapped {
        let m = mutations.get(i).cloned().unwrap_or(Mutation::Keep);
        i += 1;
        match m {
            Mutation::Keep | Mutation::SwapWithNext => events.push(render(*name, &data_of(v))),
            Mutation::Drop => {}
            Mutation::Duplicate => {
                events.push(render(*name, &data_of(v)));
                events.push(render(*name, &data_of(v)));
            }
            Mutation::Replace(at, new) => {
                let mut v = v.clone();
                mutate_at(&mut v, at as usize, new);
                events.push(render(*name, &data_of(&v)));
            }
            Mutation::Nan => {
                let d = data_of(v);
                let d = match d.strip_suffix('}') {
                    Some(head) => format!("{head},\"x\":NaN}}"),
                    None => d,
                };
                events.push(render(*name, &d));
            }
            Mutation::Rename => events.push(render(Some("ping"), &data_of(v))),
            Mutation::Garbage(g) => events.push(g),
        }
    }
    events.concat()
}

/// What the forwarded bytes must be (see the module docs); `released` are the ids of the
/// calls admission released.
fn check_forwarded(out: &[u8], released: &BTreeSet<String>) -> Result<(), String> {
    let mut f = SseFramer::new(usize::MAX);
    let mut blocks = f.push(out).map_err(|e| e.to_string())?;
    let (tail, rest) = f.finish();
    blocks.extend(tail);
    if !rest.iter().all(u8::is_ascii_whitespace) {
        return Err(format!(
            "bytes outside any event: {:?}",
            String::from_utf8_lossy(&rest)
        ));
    }
    let n = blocks.len();
    for (k, b) in blocks.into_iter().enumerate() {
        let raw = String::from_utf8_lossy(&b.raw).into_owned();
        let event =
            Event::classify(b).map_err(|e| format!("forwarded unreadable block {raw:?}: {e}"))?;
        let Some(v) = event.json() else { continue };
        let error = v.get("error").is_some_and(|e| !e.is_null()) || event.kind() == Some("error");
        if error && raw.contains("turnguard") && k + 1 != n {
            return Err(format!("turnguard's error is not the last event: {raw}"));
        }
        let mut calls = Vec::new();
        calls_in(v, &mut calls);
        for (id, name) in calls {
            if name.as_deref() == Some(EVIL) {
                return Err(format!(
                    "a call to the undeclared tool was forwarded: {raw}"
                ));
            }
            if let Some(id) = id {
                if !released.contains(&id) {
                    return Err(format!(
                        "a call that admission did not release was forwarded ({id}): {raw}"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Every tool-call structure in an event: (its id, its name), by each provider's shape.
fn calls_in(v: &Value, out: &mut Vec<(Option<String>, Option<String>)>) {
    let s = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_owned);
    match v {
        Value::Object(o) => {
            let ty = o.get("type").and_then(Value::as_str);
            if matches!(ty, Some("tool_use") | Some("function_call")) {
                out.push((
                    s(o.get("call_id")).or_else(|| s(o.get("id"))),
                    s(o.get("name")),
                ));
            } else if let Some(f) = o.get("function").filter(|f| f.is_object()) {
                out.push((s(o.get("id")), s(f.get("name"))));
            }
            for c in o.values() {
                calls_in(c, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|c| calls_in(c, out)),
        _ => {}
    }
}

/// Relays `chunks` through the pipeline with real admission; the forwarded bytes and the ids
/// of the released calls.
fn relay(api: Api, chunks: &[Vec<u8>]) -> (Vec<u8>, BTreeSet<String>) {
    let turn = turnguard::provider::adapter(api)
        .parse_request(&base_request(api))
        .unwrap();
    let mut p = Pipeline::new(&turn, 1 << 16, None).with_hold_cap(1 << 20);
    let mut out: Vec<Bytes> = Vec::new();
    // As the relay surfaces a decision (`proxy::stream::decide`, without the network).
    let step = |p: &mut Pipeline, round: Vec<ChoiceEmissions>, out: &mut Vec<Bytes>| {
        let v = admit(&turn, &round);
        let error = v.iter().find_map(|v| match &v.surfacing {
            Surfacing::Error(e) => Some(e.clone()),
            _ => None,
        });
        if let Some(e) = error {
            p.fail(round, v, e.code, &e.message, out);
        } else {
            p.release(round, v, out);
        }
    };
    let mut cut = None;
    for c in chunks {
        if let Err(e) = p.feed(c) {
            cut = Some(e);
            break;
        }
        while let Some(round) = p.advance(&mut out) {
            step(&mut p, round, &mut out);
        }
        if p.broken().is_some() {
            break;
        }
    }
    for _ in 0..16 {
        match p.finish(cut.clone(), &mut out) {
            Finish::Decide(round) => step(&mut p, round, &mut out),
            Finish::Ended(..) | Finish::Refused { .. } => break,
        }
    }
    let mut released = BTreeSet::new();
    for (round, verdicts) in &p.decided {
        for (c, v) in round.iter().zip(verdicts) {
            for (i, call) in c.calls.iter().enumerate() {
                if v.released(i) {
                    released.insert(call.id.clone());
                }
            }
        }
    }
    (out.concat(), released)
}

proptest! {
    #![proptest_config(config(96))]

    /// DESIGN.md §9 on generated streams: nothing reaches the agent that did not parse and,
    /// for calls, was not released by admission; turnguard's error, if any, is last.
    #[test]
    fn streams_forward_only_parsed_and_admitted_events(
        api in proptest::sample::select(&APIS[..]),
        evil in any::<bool>(),
        mutations in proptest::collection::vec(mutation(), 0..16),
        crlf in any::<bool>(),
        cuts in proptest::collection::vec(any::<usize>(), 0..24),
    ) {
        let bytes = stream_bytes(api, evil, &mutations, crlf);
        let (whole, released) = relay(api, std::slice::from_ref(&bytes));
        if let Err(e) = check_forwarded(&whole, &released) {
            return Err(TestCaseError::fail(e));
        }
        let (parts, released_parts) = relay(api, &split(&bytes, &cuts));
        if let Err(e) = check_forwarded(&parts, &released_parts) {
            return Err(TestCaseError::fail(e));
        }
        prop_assert_eq!(released, released_parts);
    }
}

/// The unmutated template streams release exactly the declared call: the generator reaches
/// the admitted path (a property that never releases anything would check nothing).
#[test]
fn the_stream_templates_release_the_declared_call() {
    for (api, id) in [
        (Api::OpenAiChat, "call_w"),
        (Api::AnthropicMessages, "toolu_w"),
        (Api::OpenAiResponses, "call_w"),
    ] {
        let (out, released) = relay(api, &[stream_bytes(api, false, &[], false)]);
        assert_eq!(check_forwarded(&out, &released), Ok(()), "{api:?}");
        assert_eq!(released, BTreeSet::from([id.to_owned()]), "{api:?}");
        assert!(String::from_utf8_lossy(&out).contains(id), "{api:?}");
        // With the undeclared call, the turn ends: nothing is released, the text explains.
        let (out, released) = relay(api, &[stream_bytes(api, true, &[], false)]);
        assert_eq!(check_forwarded(&out, &released), Ok(()), "{api:?}");
        assert!(released.is_empty(), "{api:?}");
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("[turnguard]"), "{api:?}: {text}");
    }
}

/// A Responses stream of `events` (each `event:` line, then its `data:`).
fn responses_stream(events: &[(Option<&str>, Value)]) -> Vec<u8> {
    events
        .iter()
        .flat_map(|(name, v)| {
            format!("event: {}\ndata: {v}\n\n", name.unwrap_or_default()).into_bytes()
        })
        .collect()
}

/// Found by `bench/fuzz.sh` (seed 14227395305187386185): a Responses `output_item.done`
/// whose item has `call_id: null` was forwarded while admission had released the call under
/// the id the `output_item.added` announced. Every form of a call must carry the same
/// `call_id`, or the call is withheld.
#[test]
fn a_responses_call_whose_forms_disagree_on_its_id_is_withheld() {
    for call_id in [Value::Null, json!("call_other")] {
        let mut events = template(Api::OpenAiResponses, false);
        for (_, v) in events.iter_mut() {
            if v["type"] == "response.output_item.done" && v["item"]["id"] == "fc_w" {
                v["item"]["call_id"] = call_id.clone();
            }
        }
        let bytes = responses_stream(&events);
        let (out, released) = relay(Api::OpenAiResponses, &[bytes]);
        assert!(released.is_empty(), "{call_id}: {released:?}");
        assert_eq!(check_forwarded(&out, &released), Ok(()), "{call_id}");
    }
}

/// Found by `streams_forward_only_parsed_and_admitted_events` (minimal input: the call's
/// `output_item.added` with `call_id: null`, its `output_item.done` with `output_index: null`,
/// the terminal event twice): the call was withheld, but its `output_item.done` — which
/// names its call only inside its `item` — was forwarded, call and all. A held event that
/// carries a withheld call item is dropped whatever its `output_index` says.
#[test]
fn a_withheld_call_item_without_its_place_is_never_forwarded() {
    for output_index in [Value::Null, json!("1"), json!(-1)] {
        let mut events = template(Api::OpenAiResponses, false);
        for (_, v) in events.iter_mut() {
            if v["type"] == "response.output_item.added" && v["item"]["id"] == "fc_w" {
                v["item"]["call_id"] = Value::Null;
            }
            if v["type"] == "response.output_item.done" && v["item"]["id"] == "fc_w" {
                v["output_index"] = output_index.clone();
            }
        }
        let bytes = responses_stream(&events);
        let (out, released) = relay(Api::OpenAiResponses, &[bytes]);
        assert!(released.is_empty(), "{output_index}: {released:?}");
        assert_eq!(check_forwarded(&out, &released), Ok(()), "{output_index}");
    }
}
