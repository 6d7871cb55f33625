//! Property: any split of a fixture stream into arbitrary byte chunks yields the same
//! emissions and the same forwarded bytes (the framer and the adapters keep no state that
//! depends on where the transport cut the bytes).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use std::path::PathBuf;

use bytes::Bytes;
use proptest::prelude::*;
use serde_json::{json, Value};
use turnguard::admission::{admit_choice, AdmitCtx, LimitState, SchemaCache};
use turnguard::model::{Api, ChoiceEmissions, ChoiceVerdict, DeclaredTool, Turn};
use turnguard::policy::bundle::ContentTrust;
use turnguard::proxy::pipeline::{Finish, Pipeline};

fn turn(api: Api) -> Turn {
    let tools = [
        "get_capital",
        "get_weather",
        "make_file",
        "list_files",
        "web_search",
        "final_result",
    ]
    .iter()
    .map(|n| DeclaredTool::json(*n, Some(json!({"type": "object"}))))
    .collect();
    Turn {
        stream: true,
        tools,
        max_output_tokens: Some(4096),
        include_usage: true,
        ..Turn::new(api)
    }
}

fn stream_fixtures() -> Vec<(PathBuf, Api)> {
    let mut out = Vec::new();
    for (dir, api) in [
        (support::fixtures().join("openai-chat"), Api::OpenAiChat),
        (
            support::fixtures().join("anthropic-messages"),
            Api::AnthropicMessages,
        ),
        (
            support::fixtures().join("openai-responses"),
            Api::OpenAiResponses,
        ),
    ] {
        for e in std::fs::read_dir(&dir).expect("fixture dir") {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "sse") {
                out.push((p, api));
            }
        }
    }
    for e in std::fs::read_dir(support::own_fixtures()).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if name.ends_with(".sse") {
            let api = if name.starts_with("anthropic") {
                Api::AnthropicMessages
            } else if name.starts_with("responses") {
                Api::OpenAiResponses
            } else {
                Api::OpenAiChat
            };
            out.push((p, api));
        }
    }
    assert!(
        out.len() >= 10,
        "expected the shared and own stream fixtures, found {}",
        out.len()
    );
    out
}

/// Feeds `chunks` through the relay pipeline; returns the forwarded bytes and the decisions.
fn relay(api: Api, chunks: &[&[u8]]) -> (Vec<u8>, Vec<(Vec<ChoiceEmissions>, Vec<ChoiceVerdict>)>) {
    static POLICY: std::sync::OnceLock<turnguard::policy::CompiledPolicy> =
        std::sync::OnceLock::new();
    let policy = POLICY.get_or_init(|| {
        turnguard::policy::compile(&turnguard::reload::embedded()).expect("default bundle")
    });
    relay_with(&turn(api), policy, 0, chunks)
}

/// [`relay`] for a given turn, policy and repair rounds left.
fn relay_with(
    t: &Turn,
    policy: &turnguard::policy::CompiledPolicy,
    repairs_left: u32,
    chunks: &[&[u8]],
) -> (Vec<u8>, Vec<(Vec<ChoiceEmissions>, Vec<ChoiceVerdict>)>) {
    let schemas = SchemaCache::default();
    // A bucket that never runs dry: the property is about framing, not rate limits.
    let limits = LimitState::default();
    let never = |_: u32, _: usize, _: &str| false;
    let ctx = AdmitCtx {
        policy,
        schemas: &schemas,
        limits: &limits,
        person: None,
        agent: "agent",
        trust: ContentTrust::Trusted,
        run: None,
        provider: "test",
        approved: &never,
        repairs_left,
        // As on the request path: no stage notes.
        explain: false,
    };
    let admit = |round: &[ChoiceEmissions]| -> Vec<ChoiceVerdict> {
        round.iter().map(|c| admit_choice(&ctx, t, c)).collect()
    };
    let mut p = Pipeline::new(t, 1 << 20, None);
    let mut out: Vec<Bytes> = Vec::new();
    for c in chunks {
        p.feed(c).expect("event within cap");
        while let Some(round) = p.advance(&mut out) {
            let v = admit(&round);
            p.release(round, v, &mut out);
        }
    }
    loop {
        match p.finish(None, &mut out) {
            Finish::Decide(round) => {
                let v = admit(&round);
                p.release(round, v, &mut out);
            }
            Finish::Ended(state, _) => {
                assert_eq!(state.as_str(), "ok");
                break;
            }
            Finish::Refused { reason, .. } => panic!("no channel is checked here: {reason}"),
        }
    }
    (out.concat(), p.decided.clone())
}

fn split<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.sort_unstable();
    points.dedup();
    let mut out = Vec::new();
    let mut last = 0;
    for p in points {
        out.push(&bytes[last..p]);
        last = p;
    }
    out.push(&bytes[last..]);
    out
}

#[test]
fn whole_streams_decide_every_call() {
    for (path, api) in stream_fixtures() {
        let bytes = std::fs::read(&path).unwrap();
        let (_, decided) = relay(api, &[&bytes]);
        let text = String::from_utf8_lossy(&bytes);
        let has_client_call = text.contains("\"tool_calls\":[{")
            || text.contains("\"type\":\"tool_use\"")
            || text.contains("\"type\":\"function_call\"");
        assert_eq!(!decided.is_empty(), has_client_call, "{}", path.display());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn any_split_yields_the_same_emissions_and_bytes(cuts in proptest::collection::vec(any::<usize>(), 0..40), one_byte in any::<bool>()) {
        for (path, api) in stream_fixtures() {
            let bytes = std::fs::read(&path).unwrap();
            let (want_bytes, want_decided) = relay(api, &[&bytes]);
            let chunks: Vec<&[u8]> = if one_byte { bytes.chunks(1).collect() } else { split(&bytes, &cuts) };
            let (got_bytes, got_decided) = relay(api, &chunks);
            prop_assert_eq!(&got_bytes, &want_bytes, "bytes differ for {}", path.display());
            prop_assert_eq!(&got_decided, &want_decided, "decisions differ for {}", path.display());
        }
    }
}

/// A Responses stream with every client call withheld (no tool declared) stays what the
/// official SDK accepts: consecutive `sequence_number`s, items added at contiguous
/// `output_index`es before their events, no `function_call` anywhere, a `[turnguard]` message,
/// and a terminal `response.completed` whose `output` lists exactly the items streamed.
#[test]
fn withheld_responses_calls_leave_a_valid_stream() {
    let mut checked = 0;
    // The test bundle whose withheld calls end the turn (a host-authored message).
    let policy =
        turnguard::reload::load(&support::own_fixtures().join("policy-open")).expect("policy-open");
    for (path, api) in stream_fixtures() {
        if api != Api::OpenAiResponses {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let mut t = turn(api);
        t.tools.clear();
        // A repair round left, so `invalid` surfaces as the bundle's `end-turn`.
        let (body, _) = relay_with(&t, &policy, 1, &[&bytes]);
        let name = path.display().to_string();
        let had_call = String::from_utf8_lossy(&bytes).contains("\"type\":\"function_call\"");
        if !had_call {
            assert_eq!(body, bytes, "{name}: nothing to withhold, bytes unchanged");
            continue;
        }
        checked += 1;
        let text = String::from_utf8_lossy(&body).to_string();
        let mut items: Vec<Value> = Vec::new();
        let mut terminal = None;
        for (i, block) in text.split_terminator("\n\n").enumerate() {
            let (event, data) = block
                .strip_prefix("event: ")
                .and_then(|b| b.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("{name}: block {i} is not `event:` + `data:`: {block}"));
            let ev: Value = serde_json::from_str(data).unwrap();
            assert_eq!(ev["type"], event, "{name}: event name = type");
            assert_eq!(
                ev["sequence_number"], i,
                "{name}: sequence_number of event {i}"
            );
            assert!(
                !data.contains("\"function_call"),
                "{name}: a call reached the agent: {data}"
            );
            if let Some(ix) = ev["output_index"].as_u64() {
                assert!(
                    ix < items.len() as u64 + 1,
                    "{name}: output_index {ix} out of order"
                );
            }
            if ev["type"] == "response.output_item.added" {
                assert_eq!(
                    ev["output_index"],
                    items.len(),
                    "{name}: items added in order"
                );
                items.push(ev["item"].clone());
            }
            if ev["type"].as_str().unwrap().starts_with("response.")
                && ev["response"]["status"] != "in_progress"
                && ev.get("response").is_some()
            {
                terminal = Some(ev);
            }
        }
        let terminal = terminal.unwrap_or_else(|| panic!("{name}: no terminal event"));
        assert_eq!(terminal["type"], "response.completed", "{name}");
        assert_eq!(terminal["response"]["status"], "completed", "{name}");
        let output = terminal["response"]["output"].as_array().unwrap();
        let ids = |list: &[Value]| -> Vec<Value> { list.iter().map(|i| i["id"].clone()).collect() };
        assert_eq!(
            ids(output),
            ids(&items),
            "{name}: terminal output = streamed items"
        );
        let last = output.last().unwrap();
        assert!(
            last["content"][0]["text"]
                .as_str()
                .is_some_and(|t| t.starts_with("[turnguard]")),
            "{name}: host-authored message last: {last}"
        );
    }
    assert!(
        checked >= 3,
        "only {checked} Responses streams with calls checked"
    );
}
