//! Conformance scenario **v2-tool-admission-order** and repair rounds (issue 7, must-show 1
//! and 2), over real sockets: the mock provider plays the model, this test plays the agent,
//! and admission is never called directly. Each case is checked three ways: what the agent
//! receives, the journal's `tool_calls` rows, and the `agent.tool-called` /
//! `agent.tool-returned` events (validated against the OpenWOP payload schemas).
//!
//! Bundles: `tests/fixtures/policy-order/` (every withheld outcome ends the turn; one call per
//! turn may reach the limits stage) and `tests/fixtures/policy-repair/` (invalid arguments are
//! repaired, two rounds at most, then an error).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use support::{post_raw, sse_data};
use turnguard::mock_provider::Script;

// ---------------------------------------------------------------------------------------------
// Helpers (test-local)

/// The OpenWOP `agentToolCalled` / `agentToolReturned` payload schemas, compiled with the real
/// `ids.schema.json` registered under its `$id`, so `agentId`'s `$ref` resolves to the spec's
/// grammar.
///
/// Honesty note: the excerpt's `error` property refers to `#/$defs/_errorObject`, which is not
/// in the copied excerpt (it lives in the full `run-event-payloads.schema.json`; see
/// `shared/spec/openwop/README.md`). It is supplied here as the README describes the v2 error
/// object: an object with string `code` (non-empty) and string `message`, both required.
/// Everything else is validated verbatim.
struct EventSchemas {
    called: jsonschema::Validator,
    returned: jsonschema::Validator,
}

fn spec_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/spec/openwop")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

impl EventSchemas {
    fn load() -> Self {
        let excerpt = read_json(&spec_dir().join("run-event-payloads.agentTool.excerpt.json"));
        let ids = read_json(&spec_dir().join("ids.schema.json"));
        let base = "https://openwop.dev/spec/v2/run-event-payloads.schema.json";
        let wrapper = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": base,
            "$defs": {
                "agentToolCalled": excerpt["agentToolCalled"],
                "agentToolReturned": excerpt["agentToolReturned"],
                "_errorObject": {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {
                        "code": {"type": "string", "minLength": 1},
                        "message": {"type": "string"}
                    }
                }
            }
        });
        let ids_id = ids["$id"]
            .as_str()
            .expect("ids.schema.json has an $id")
            .to_owned();
        let registry = jsonschema::Registry::new()
            .add(ids_id, ids)
            .expect("ids schema registers")
            .add(base, wrapper)
            .expect("payload schema registers")
            .prepare()
            .expect("registry");
        let build = |def: &str| {
            jsonschema::options()
                .with_draft(jsonschema::Draft::Draft202012)
                .with_registry(&registry)
                .build(&json!({ "$ref": format!("{base}#/$defs/{def}") }))
                .unwrap_or_else(|e| panic!("{def} does not compile: {e}"))
        };
        let s = Self {
            called: build("agentToolCalled"),
            returned: build("agentToolReturned"),
        };
        // The validators must be able to fail: a payload without `callId` and one with an
        // unknown status are rejected, and a malformed agentId is rejected through the $ref.
        assert!(!s
            .called
            .is_valid(&json!({"agentId": "agent", "toolName": "x"})));
        assert!(!s
            .called
            .is_valid(&json!({"agentId": "has space", "toolName": "x", "callId": "c"})));
        assert!(!s.returned.is_valid(
            &json!({"agentId": "agent", "toolName": "x", "callId": "c", "status": "denied"})
        ));
        assert!(!s.returned.is_valid(
            &json!({"agentId": "agent", "toolName": "x", "callId": "c", "status": "error", "error": {"message": "m"}})
        ));
        s
    }

    fn check(&self, kind: &str, payload: &Value) {
        let v = match kind {
            "agent.tool-called" => &self.called,
            "agent.tool-returned" => &self.returned,
            other => panic!("unexpected event type {other}"),
        };
        let errors: Vec<String> = v.iter_errors(payload).map(|e| e.to_string()).collect();
        assert!(
            errors.is_empty(),
            "{kind} payload {payload} is invalid: {errors:?}"
        );
    }
}

/// A Chat Completions function tool.
fn chat_tool(name: &str, parameters: Value) -> Value {
    json!({"type": "function", "function": {"name": name, "parameters": parameters}})
}

/// A non-stream Chat response with these `(id, name, arguments)` calls.
fn chat_response(id: &str, finish: &str, calls: &[(&str, &str, &str)]) -> Value {
    let calls: Vec<Value> = calls
        .iter()
        .map(|(id, name, args)| {
            json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
        })
        .collect();
    json!({
        "id": id,
        "object": "chat.completion",
        "created": 1_782_955_817,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": null, "refusal": null, "tool_calls": calls},
            "logprobs": null,
            "finish_reason": finish
        }],
        "usage": {"prompt_tokens": 80, "completion_tokens": 24, "total_tokens": 104}
    })
}

/// The events of a Chat stream: role, optional text, each call (name, then its arguments in
/// two deltas), the finish chunk and `[DONE]`.
fn chat_sse(
    id: &str,
    text: Option<&str>,
    calls: &[(&str, &str, &str)],
    finish: &str,
) -> Vec<String> {
    let chunk = |delta: Value, finish: Value| {
        let v = json!({
            "id": id, "object": "chat.completion.chunk", "created": 1_782_955_817,
            "model": "gpt-4o-mini-2024-07-18",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]
        });
        format!("data: {v}")
    };
    let mut out = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    if let Some(t) = text {
        out.push(chunk(json!({"content": t}), Value::Null));
    }
    for (i, (cid, name, args)) in calls.iter().enumerate() {
        out.push(chunk(
            json!({"tool_calls": [{"index": i, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}]}),
            Value::Null,
        ));
        let cut = args.len() / 2;
        for part in [&args[..cut], &args[cut..]] {
            out.push(chunk(
                json!({"tool_calls": [{"index": i, "function": {"arguments": part}}]}),
                Value::Null,
            ));
        }
    }
    out.push(chunk(json!({}), json!(finish)));
    out.push("data: [DONE]".to_owned());
    out
}

/// The events of a Messages stream: optional text block, then one `tool_use` block per
/// `(id, name, input JSON)`.
fn anthropic_sse(
    id: &str,
    text: Option<&str>,
    calls: &[(&str, &str, &str)],
    stop: &str,
) -> Vec<String> {
    let ev = |kind: &str, data: Value| format!("event: {kind}\ndata: {data}");
    let mut out = vec![ev(
        "message_start",
        json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
            "model": "claude-sonnet-4-20250514", "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 120, "output_tokens": 1}}}),
    )];
    let mut index = 0;
    if let Some(t) = text {
        out.push(ev("content_block_start", json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}})));
        out.push(ev("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}})));
        out.push(ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
        index += 1;
    }
    for (cid, name, input) in calls {
        out.push(ev("content_block_start", json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use", "id": cid, "name": name, "input": {}}})));
        let cut = input.len() / 2;
        for part in ["", &input[..cut], &input[cut..]] {
            out.push(ev("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": part}})));
        }
        out.push(ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
        index += 1;
    }
    out.push(ev("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": 40}})));
    out.push(ev("message_stop", json!({"type": "message_stop"})));
    out
}

/// `(call_id, outcome, stage, reason)` rows of one round, in call order.
fn call_rows(db: &support::Db, round: &str) -> Vec<(String, String, String, String)> {
    let mut st = db
        .prepare("SELECT call_id, outcome, stage, reason FROM tool_calls WHERE request_id = ?1 ORDER BY choice, ordinal")
        .unwrap();
    st.query_map([support::round_key(db, round)], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// `(type, payload)` of one request's events, in sequence order.
fn events_of(db: &support::Db, request_id: &str) -> Vec<(String, Value)> {
    let mut st = db
        .prepare("SELECT type, payload FROM events WHERE request_id = ?1 ORDER BY sequence")
        .unwrap();
    st.query_map([support::round_key(db, request_id)], |r| {
        Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
    })
    .unwrap()
    .map(|r| {
        let (t, p) = r.unwrap();
        (t, serde_json::from_str(&p).expect("event payload is JSON"))
    })
    .collect()
}

fn args_hash_of(db: &support::Db, round: &str, call_id: &str) -> Option<String> {
    db.query_row(
        "SELECT args_hash FROM tool_calls WHERE request_id = ?1 AND call_id = ?2",
        [support::round_key(db, round).as_str(), call_id],
        |r| r.get(0),
    )
    .unwrap()
}

fn round_states(db: &support::Db, prefix: &str) -> Vec<(String, String)> {
    let mut st = db
        .prepare(&format!(
            "SELECT {}, state FROM rounds WHERE client_request_id = ?1 ORDER BY id",
            support::CLIENT_ROUND_LABEL
        ))
        .unwrap();
    st.query_map([prefix], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Must-show 1: v2-tool-admission-order

fn order_tools() -> Value {
    json!([
        chat_tool(
            "get_weather",
            json!({"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]})
        ),
        chat_tool(
            "delete_file",
            json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]})
        ),
        chat_tool(
            "wire_money",
            json!({"type": "object", "properties": {"amount": {"type": "number"}, "to": {"type": "string"}}, "required": ["amount", "to"]})
        ),
        chat_tool(
            "book_flight",
            json!({"type": "object", "properties": {"bookingRef": {"type": "string"}, "flight": {"type": "string"}}, "required": ["bookingRef", "flight"]})
        ),
    ])
}

/// One agent request of the scenario: the model's response and what must come of each call.
struct Case {
    /// `x-request-id` (also the journal's round id and the events' request id).
    rid: &'static str,
    finish: &'static str,
    /// `(call id, tool name, arguments text)`.
    calls: Vec<(&'static str, &'static str, &'static str)>,
    /// Per call: `(outcome, stage, reason)`.
    expect: Vec<(&'static str, &'static str, &'static str)>,
    /// Per call: the `agent.tool-returned` status it must produce (`None`: no such event).
    returned: Vec<Option<&'static str>>,
}

fn order_cases() -> Vec<Case> {
    vec![
        // truncated + undeclared name → completion
        Case {
            rid: "order-1-completion",
            finish: "length",
            calls: vec![("call_trunc", "nuke_everything", r#"{"target": "al"#)],
            expect: vec![("invalid", "completion", "truncated")],
            returned: vec![Some("error")],
        },
        // undeclared name + arguments that are not JSON → name
        Case {
            rid: "order-2-name",
            finish: "tool_calls",
            calls: vec![("call_undeclared", "nuke_everything", "{not json")],
            expect: vec![("invalid", "name", "undeclared_tool")],
            returned: vec![Some("error")],
        },
        // arguments against the schema + a tool every rule forbids → arguments
        Case {
            rid: "order-3-arguments",
            finish: "tool_calls",
            calls: vec![("call_badargs", "delete_file", r#"{"path": 42}"#)],
            expect: vec![("invalid", "arguments", "schema_violation")],
            returned: vec![Some("error")],
        },
        // one permitted call uses the turn's only limits slot; a forbidden call after it is
        // decided by authorization (not limits); a permitted call after that is rate-limited,
        // which shows the limit is live. The withheld calls end the turn, so the first call
        // is `ended-turn`.
        Case {
            rid: "order-4-authorization",
            finish: "tool_calls",
            calls: vec![
                ("call_weather_1", "get_weather", r#"{"location": "Paris"}"#),
                ("call_delete", "delete_file", r#"{"path": "/etc/passwd"}"#),
                ("call_weather_2", "get_weather", r#"{"location": "Rome"}"#),
            ],
            expect: vec![
                ("ended-turn", "dispatch", "turn_ended"),
                ("refused", "authorization", "forbidden"),
                ("refused", "limits", "rate_limited"),
            ],
            returned: vec![Some("error"), Some("forbidden"), Some("rate_limited")],
        },
        // a hold rule → held (waits for a person; no tool-returned is asserted either way)
        Case {
            rid: "order-5-held",
            finish: "tool_calls",
            calls: vec![(
                "call_wire",
                "wire_money",
                r#"{"amount": 250.5, "to": "DE89"}"#,
            )],
            expect: vec![("held", "authorization", "held_by_rule")],
            returned: vec![None],
        },
        // a permitted call with a business key → executed (the effect is claimed)
        Case {
            rid: "order-6-executed",
            finish: "tool_calls",
            calls: vec![(
                "call_book_1",
                "book_flight",
                r#"{"bookingRef": "BK-1", "flight": "LH100"}"#,
            )],
            expect: vec![("executed", "dispatch", "released")],
            returned: vec![None],
        },
        // the same business key under a different call id → suppressed-repeat
        Case {
            rid: "order-7-repeat",
            finish: "tool_calls",
            calls: vec![(
                "call_book_2",
                "book_flight",
                r#"{"bookingRef": "BK-1", "flight": "LH100"}"#,
            )],
            expect: vec![("suppressed-repeat", "dispatch", "effect_already_claimed")],
            // Its tool-returned is checked by
            // `a_suppressed_repeat_without_a_recorded_result_is_not_reported_as_success`.
            returned: vec![None],
        },
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn v2_tool_admission_order() {
    let schemas = EventSchemas::load();
    let cases = order_cases();
    let h = support::start_with_policy(Script::default(), "policy-order").await;
    let responses: Vec<Value> = cases
        .iter()
        .map(|c| json!({"json": chat_response(&format!("chatcmpl-{}", c.rid), c.finish, &c.calls)}))
        .collect();
    h.script(&json!({ "responses": responses })).await;
    let url = format!("{}/v1/chat/completions", h.url());
    let request = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Run my errands."}],
        "tools": order_tools()
    });

    let mut six = std::collections::BTreeSet::new();
    for c in &cases {
        let (status, _, body) =
            post_raw(&url, request.to_string().into(), &[("x-request-id", c.rid)]).await;
        let text = String::from_utf8_lossy(&body).into_owned();
        assert_eq!(status, 200, "{}: {text}", c.rid);
        let got: Value = serde_json::from_slice(&body).expect("agent body is JSON");
        let message = &got["choices"][0]["message"];
        let all_executed = c.expect.iter().all(|e| e.0 == "executed");
        if all_executed {
            let sent = chat_response(&format!("chatcmpl-{}", c.rid), c.finish, &c.calls);
            assert_eq!(
                got, sent,
                "{}: a released turn reaches the agent unchanged",
                c.rid
            );
        } else {
            // Nothing of a withheld turn reaches the agent: no call, no call id, and a
            // host-authored text that names each withheld decision's outcome, stage and reason.
            assert!(
                message.get("tool_calls").is_none(),
                "{}: calls released: {text}",
                c.rid
            );
            assert_eq!(got["choices"][0]["finish_reason"], "stop", "{}", c.rid);
            for (id, _, _) in &c.calls {
                assert!(
                    !text.contains(id),
                    "{}: call id {id} reached the agent: {text}",
                    c.rid
                );
            }
            let content = message["content"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: no text: {text}", c.rid));
            assert!(content.starts_with("[turnguard]"), "{}: {content}", c.rid);
            for (outcome, stage, reason) in c.expect.iter().filter(|e| e.0 != "ended-turn") {
                let needle = format!("{outcome} at the {stage} stage ({reason})");
                assert!(
                    content.contains(&needle),
                    "{}: the agent's text lacks `{needle}`: {content}",
                    c.rid
                );
            }
        }
        for e in &c.expect {
            six.insert(e.0);
        }
    }
    let journal = h.journal();
    let _dir = h.stop().await;
    let db = support::journal(&journal);

    for c in &cases {
        let rows = call_rows(&db, c.rid);
        let want: Vec<(String, String, String, String)> = c
            .calls
            .iter()
            .zip(&c.expect)
            .map(|((id, _, _), (o, s, r))| {
                (
                    (*id).to_owned(),
                    (*o).to_owned(),
                    (*s).to_owned(),
                    (*r).to_owned(),
                )
            })
            .collect();
        assert_eq!(
            rows, want,
            "{}: journal tool_calls (call_id, outcome, stage, reason)",
            c.rid
        );

        let events = events_of(&db, c.rid);
        for (kind, payload) in &events {
            schemas.check(kind, payload);
        }
        for (i, (id, name, _)) in c.calls.iter().enumerate() {
            let called: Vec<&Value> = events
                .iter()
                .filter(|(k, p)| k == "agent.tool-called" && p["callId"] == *id)
                .map(|(_, p)| p)
                .collect();
            assert_eq!(
                called.len(),
                1,
                "{}: one agent.tool-called for {id}: {events:?}",
                c.rid
            );
            let p = called[0];
            assert_eq!(p["toolName"], *name, "{}", c.rid);
            assert_eq!(p["transport"], "native", "{}", c.rid);
            assert_eq!(p["agentId"], "agent", "{}", c.rid);
            assert!(p["principal"].is_string(), "{}: principal: {p}", c.rid);
            // argsHash is the journal's, when the arguments parsed.
            let hash = args_hash_of(&db, c.rid, id);
            assert_eq!(
                p.get("argsHash").and_then(Value::as_str),
                hash.as_deref(),
                "{}: argsHash of {id}",
                c.rid
            );
            let returned: Vec<&Value> = events
                .iter()
                .filter(|(k, p)| k == "agent.tool-returned" && p["callId"] == *id)
                .map(|(_, p)| p)
                .collect();
            match c.returned[i] {
                Some(status) => {
                    assert_eq!(returned.len(), 1, "{}: one agent.tool-returned for {id}: {events:?}", c.rid);
                    assert_eq!(returned[0]["status"], status, "{}: status of {id}", c.rid);
                    if status != "ok" {
                        let code = returned[0].pointer("/error/code").and_then(Value::as_str).unwrap_or("");
                        assert!(!code.is_empty(), "{}: a failed return carries error.code: {}", c.rid, returned[0]);
                    }
                }
                None if c.expect[i].0 == "executed" => assert!(
                    returned.is_empty(),
                    "{}: a released call has not returned yet, yet an event says it did: {returned:?}",
                    c.rid
                ),
                None => {}
            }
        }
    }
    // Stage 1's check: the classic pairs above were decided by the earliest stage, and every
    // outcome of the contract occurred.
    let all: std::collections::BTreeSet<&str> = [
        "executed",
        "refused",
        "held",
        "suppressed-repeat",
        "ended-turn",
        "invalid",
    ]
    .into_iter()
    .collect();
    assert_eq!(six, all, "each of the six outcomes is produced");
    // The executed call's effect is recorded once, owned by the first call id.
    let owner: String = db
        .query_row(
            "SELECT call_id FROM effects WHERE tool_id = 'test.order:book_flight'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(owner, "call_book_1");
}

// ---------------------------------------------------------------------------------------------
// Must-show 2: repair rounds

fn ticket_tool_chat() -> Value {
    chat_tool(
        "create_ticket",
        json!({"type": "object", "properties": {"title": {"type": "string"}, "priority": {"type": "string", "enum": ["low", "high"]}}, "required": ["title", "priority"]}),
    )
}

fn ticket_tool_anthropic() -> Value {
    json!({"name": "create_ticket", "input_schema": {"type": "object", "properties": {"title": {"type": "string"}, "priority": {"type": "string", "enum": ["low", "high"]}}, "required": ["title", "priority"]}})
}

const BAD_ARGS: &str = r#"{"title": "Printer on fire", "priority": "urgent-xyzzy"}"#;
const GOOD_ARGS: &str = r#"{"title": "Printer on fire", "priority": "high"}"#;

/// The repair round the mock received: the agent's messages unchanged, then the assistant's
/// bad call and a host-authored tool result that names the failing path (`/priority`) and
/// carries no model text. Returns the result text.
fn check_repair_request_chat(first: &Value, second: &Value, bad_id: &str) -> String {
    let m1 = first["messages"].as_array().unwrap();
    let m2 = second["messages"].as_array().unwrap();
    assert_eq!(
        m2.len(),
        m1.len() + 2,
        "the repair round adds the call and its result: {second}"
    );
    assert_eq!(
        &m2[..m1.len()],
        &m1[..],
        "the agent's messages are kept as sent"
    );
    assert_eq!(first["tools"], second["tools"]);
    assert_eq!(first["model"], second["model"]);
    let call = &m2[m1.len()];
    assert_eq!(call["role"], "assistant");
    assert_eq!(call["tool_calls"][0]["id"], bad_id);
    assert_eq!(call["tool_calls"][0]["function"]["name"], "create_ticket");
    let result = &m2[m1.len() + 1];
    assert_eq!(result["role"], "tool");
    assert_eq!(result["tool_call_id"], bad_id);
    let text = result["content"]
        .as_str()
        .expect("tool result text")
        .to_owned();
    assert!(
        text.contains("/priority"),
        "the result names the failing JSON path: {text}"
    );
    assert!(
        !text.contains("urgent-xyzzy"),
        "the result never quotes model output: {text}"
    );
    text
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_arguments_are_repaired_non_stream_chat() {
    let h = support::start_with_policy(Script::default(), "policy-repair").await;
    let good = chat_response(
        "chatcmpl-good",
        "tool_calls",
        &[("call_good", "create_ticket", GOOD_ARGS)],
    );
    h.script(&json!({"responses": [
        {"json": chat_response("chatcmpl-bad", "tool_calls", &[("call_bad", "create_ticket", BAD_ARGS)])},
        {"json": good}
    ]}))
    .await;
    let request = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "The printer is on fire, file a ticket."}],
        "tools": [ticket_tool_chat()]
    });
    // turnguard's own headers, fields the agent's `Connection` names and its coding stay
    // here in every round, the repair round too (the upstream headers are filtered per round
    // from the agent's: `Session::send`).
    let (status, _, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        request.to_string().into(),
        &[
            ("x-request-id", "repair-json"),
            ("authorization", "Bearer sk-agent-repair"),
            ("turnguard-mode", "live"),
            ("connection", "x-hop"),
            ("x-hop", "hop-secret"),
            ("accept-encoding", "gzip"),
        ],
    )
    .await;
    let text = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(status, 200, "{text}");
    let got: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        got, good,
        "the agent gets the corrected response, and only it"
    );
    assert!(
        !text.contains("call_bad") && !text.contains("urgent-xyzzy"),
        "{text}"
    );

    let seen = h.mock_requests().await;
    assert_eq!(seen.len(), 2, "one repair round");
    assert_eq!(
        seen[0]["body"], request,
        "the first round is the agent's request"
    );
    check_repair_request_chat(&seen[0]["body"], &seen[1]["body"], "call_bad");
    for (round, sent) in seen.iter().enumerate() {
        let headers = &sent["headers"];
        assert_eq!(
            headers["authorization"], "Bearer sk-agent-repair",
            "round {round}: {headers}"
        );
        assert_eq!(headers["x-request-id"], "repair-json", "round {round}");
        assert_eq!(headers["accept-encoding"], "identity", "round {round}");
        for kept_here in ["turnguard-mode", "x-hop", "connection"] {
            assert!(
                headers.get(kept_here).is_none(),
                "round {round} sent `{kept_here}` upstream: {headers}"
            );
        }
    }

    let journal = h.journal();
    let _dir = h.stop().await;
    let db = support::journal(&journal);
    assert_eq!(
        round_states(&db, "repair-json"),
        vec![
            ("repair-json".into(), "repaired".into()),
            ("repair-json#repair-1".into(), "ok".into())
        ]
    );
    assert_eq!(call_rows(&db, "repair-json")[0].1, "invalid");
    assert_eq!(call_rows(&db, "repair-json")[0].2, "arguments");
    assert_eq!(call_rows(&db, "repair-json#repair-1")[0].1, "executed");
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_arguments_are_repaired_stream_chat() {
    let h = support::start_with_policy(Script::default(), "policy-repair").await;
    let steps = json!([
        {"sse": chat_sse("chatcmpl-bad", Some("Filing it."), &[("call_bad", "create_ticket", BAD_ARGS)], "tool_calls")},
        {"sse": chat_sse("chatcmpl-good", None, &[("call_good", "create_ticket", GOOD_ARGS)], "tool_calls")},
    ]);
    h.script(&json!({"responses": steps})).await;
    let request = json!({
        "model": "gpt-4o-mini",
        "stream": true,
        "messages": [{"role": "user", "content": "The printer is on fire, file a ticket."}],
        "tools": [ticket_tool_chat()]
    });
    let (status, _, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        request.to_string().into(),
        &[("x-request-id", "repair-chat-sse")],
    )
    .await;
    let raw = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(status, 200, "{raw}");
    assert!(
        !raw.contains("call_bad") && !raw.contains("urgent-xyzzy"),
        "the bad call reached the agent: {raw}"
    );
    let data = sse_data(&body);
    let done: Vec<usize> = (0..data.len())
        .filter(|&i| data[i] == json!("[DONE]"))
        .collect();
    assert_eq!(
        done,
        vec![data.len() - 1],
        "exactly one [DONE], last: {raw}"
    );
    let chunks: Vec<&Value> = data.iter().filter(|v| v.is_object()).collect();
    assert_eq!(
        chunks.len(),
        data.len() - 1,
        "every other event is a JSON chunk: {raw}"
    );
    let roles = chunks
        .iter()
        .filter(|c| c.pointer("/choices/0/delta/role").is_some())
        .count();
    assert_eq!(
        roles, 1,
        "the role is sent once (one message for the SDK): {raw}"
    );
    let finishes: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0/finish_reason"))
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, vec![&json!("tool_calls")], "{raw}");
    let mut ids = Vec::new();
    let mut args = String::new();
    let mut content = String::new();
    for c in &chunks {
        if let Some(t) = c
            .pointer("/choices/0/delta/content")
            .and_then(Value::as_str)
        {
            content.push_str(t);
        }
        for tc in c
            .pointer("/choices/0/delta/tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(id) = tc.get("id").and_then(Value::as_str) {
                ids.push(id.to_owned());
            }
            if let Some(a) = tc.pointer("/function/arguments").and_then(Value::as_str) {
                args.push_str(a);
            }
        }
    }
    assert_eq!(ids, vec!["call_good"], "{raw}");
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        serde_json::from_str::<Value>(GOOD_ARGS).unwrap()
    );
    assert_eq!(
        content, "Filing it.",
        "the first round's text was already streamed and is kept"
    );

    let seen = h.mock_requests().await;
    assert_eq!(seen.len(), 2, "one repair round");
    check_repair_request_chat(&seen[0]["body"], &seen[1]["body"], "call_bad");

    // The official SDK reads the spliced stream as one completion with the corrected call.
    h.script(&json!({"responses": steps})).await;
    let sdk = run_sdk("openai", &h.url(), &request);
    let msg = &sdk["choices"][0]["message"];
    assert_eq!(msg["tool_calls"].as_array().map(Vec::len), Some(1), "{sdk}");
    assert_eq!(msg["tool_calls"][0]["id"], "call_good", "{sdk}");
    assert_eq!(
        serde_json::from_str::<Value>(
            msg["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .unwrap()
        )
        .unwrap(),
        serde_json::from_str::<Value>(GOOD_ARGS).unwrap()
    );
    assert_eq!(msg["content"], "Filing it.", "{sdk}");
    assert_eq!(sdk["choices"][0]["finish_reason"], "tool_calls", "{sdk}");

    let journal = h.journal();
    let _dir = h.stop().await;
    let db = support::journal(&journal);
    assert_eq!(call_rows(&db, "repair-chat-sse")[0].1, "invalid");
    assert_eq!(call_rows(&db, "repair-chat-sse#repair-1")[0].1, "executed");
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_arguments_are_repaired_stream_anthropic() {
    let h = support::start_with_policy(Script::default(), "policy-repair").await;
    let bad_input = BAD_ARGS;
    let good_input = GOOD_ARGS;
    let steps = json!([
        {"sse": anthropic_sse("msg_bad", Some("Filing it."), &[("toolu_bad", "create_ticket", bad_input)], "tool_use")},
        {"sse": anthropic_sse("msg_good", None, &[("toolu_good", "create_ticket", good_input)], "tool_use")},
    ]);
    h.script(&json!({"responses": steps})).await;
    let request = json!({
        "model": "claude-sonnet-4-20250514",
        "max_tokens": 1024,
        "stream": true,
        "messages": [{"role": "user", "content": "The printer is on fire, file a ticket."}],
        "tools": [ticket_tool_anthropic()]
    });
    let (status, _, body) = post_raw(
        &format!("{}/v1/messages", h.url()),
        request.to_string().into(),
        &[
            ("x-request-id", "repair-anthropic-sse"),
            ("anthropic-version", "2023-06-01"),
        ],
    )
    .await;
    let raw = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(status, 200, "{raw}");
    assert!(
        !raw.contains("toolu_bad") && !raw.contains("urgent-xyzzy"),
        "the bad call reached the agent: {raw}"
    );
    let events: Vec<Value> = sse_data(&body);
    assert!(events.iter().all(Value::is_object), "{raw}");
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "message_start").count(),
        1,
        "one message_start: {kinds:?}"
    );
    assert_eq!(kinds[0], "message_start");
    assert_eq!(
        kinds.iter().filter(|k| **k == "message_delta").count(),
        1,
        "{kinds:?}"
    );
    assert_eq!(kinds.last(), Some(&"message_stop"));
    assert_eq!(kinds.iter().filter(|k| **k == "message_stop").count(), 1);
    assert!(!kinds.contains(&"error"), "{raw}");
    // Content block indices are contiguous from 0, each block opened once and closed once,
    // and every delta falls inside its open block.
    let mut open: Option<u64> = None;
    let mut next = 0u64;
    let mut blocks: Vec<Value> = Vec::new();
    let mut inputs: Vec<String> = Vec::new();
    for e in &events {
        let ix = e["index"].as_u64();
        match e["type"].as_str() {
            Some("content_block_start") => {
                assert_eq!(open, None, "a block opened inside another: {raw}");
                assert_eq!(ix, Some(next), "block indices are contiguous: {raw}");
                open = ix;
                blocks.push(e["content_block"].clone());
                inputs.push(String::new());
            }
            Some("content_block_delta") => {
                assert_eq!(ix, open, "a delta outside its block: {raw}");
                if let Some(p) = e.pointer("/delta/partial_json").and_then(Value::as_str) {
                    inputs[next as usize].push_str(p);
                }
            }
            Some("content_block_stop") => {
                assert_eq!(ix, open, "{raw}");
                open = None;
                next += 1;
            }
            _ => {}
        }
    }
    assert_eq!(
        blocks.len(),
        2,
        "the first round's text block, then the corrected call: {raw}"
    );
    assert_eq!(blocks[0]["type"], "text");
    assert_eq!(blocks[1]["type"], "tool_use");
    assert_eq!(blocks[1]["id"], "toolu_good");
    assert_eq!(
        serde_json::from_str::<Value>(&inputs[1]).unwrap(),
        serde_json::from_str::<Value>(good_input).unwrap()
    );
    let stop = events
        .iter()
        .find(|e| e["type"] == "message_delta")
        .unwrap();
    assert_eq!(stop["delta"]["stop_reason"], "tool_use");

    let seen = h.mock_requests().await;
    assert_eq!(seen.len(), 2, "one repair round");
    let (m1, m2) = (
        seen[0]["body"]["messages"].as_array().unwrap(),
        seen[1]["body"]["messages"].as_array().unwrap(),
    );
    assert_eq!(m2.len(), m1.len() + 2);
    assert_eq!(&m2[..m1.len()], &m1[..]);
    let call = &m2[m1.len()];
    assert_eq!(call["role"], "assistant");
    // The model's message replayed in order: its text block, then the withheld call.
    let types: Vec<&str> = call["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["type"].as_str())
        .collect();
    assert_eq!(types, vec!["text", "tool_use"], "{call}");
    assert_eq!(call["content"][1]["id"], "toolu_bad");
    let result = &m2[m1.len() + 1];
    assert_eq!(result["role"], "user");
    let block = &result["content"][0];
    assert_eq!(block["type"], "tool_result");
    assert_eq!(block["tool_use_id"], "toolu_bad");
    assert_eq!(
        block["is_error"], true,
        "a host-authored failure is isError (MCP shape)"
    );
    let text = block["content"].as_str().expect("result text");
    assert!(text.contains("/priority"), "{text}");
    assert!(!text.contains("urgent-xyzzy"), "{text}");

    // The official SDK accumulates the spliced stream into one message.
    h.script(&json!({"responses": steps})).await;
    let sdk = run_sdk("anthropic", &h.url(), &request);
    let content = sdk["content"].as_array().unwrap_or_else(|| panic!("{sdk}"));
    assert_eq!(content.len(), 2, "{sdk}");
    assert_eq!(content[0]["type"], "text");
    assert_eq!(content[0]["text"], "Filing it.");
    assert_eq!(content[1]["type"], "tool_use");
    assert_eq!(content[1]["id"], "toolu_good");
    assert_eq!(
        content[1]["input"],
        serde_json::from_str::<Value>(good_input).unwrap()
    );
    assert_eq!(sdk["stop_reason"], "tool_use");

    let journal = h.journal();
    let _dir = h.stop().await;
    let db = support::journal(&journal);
    assert_eq!(call_rows(&db, "repair-anthropic-sse")[0].1, "invalid");
    assert_eq!(
        call_rows(&db, "repair-anthropic-sse#repair-1")[0].1,
        "executed"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn spent_repairs_surface_the_configured_error_and_never_the_bad_call() {
    let h = support::start_with_policy(Script::default(), "policy-repair").await;
    // `repair_rounds = 2`: the first answer and two repair answers are all invalid.
    let bad = |n: u32| {
        json!({"json": chat_response(&format!("chatcmpl-bad-{n}"), "tool_calls",
            &[(["call_bad_0", "call_bad_1", "call_bad_2"][n as usize], "create_ticket", BAD_ARGS)])})
    };
    h.script(&json!({"responses": [bad(0), bad(1), bad(2), bad(0)]}))
        .await;
    let request = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "The printer is on fire, file a ticket."}],
        "tools": [ticket_tool_chat()]
    });
    let (status, headers, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        request.to_string().into(),
        &[("x-request-id", "repair-spent")],
    )
    .await;
    let text = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(status, 422, "{text}");
    assert!(headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    let got: Value = serde_json::from_slice(&body).expect("an error envelope");
    assert_eq!(got["error"]["code"], "envelope_invalid", "{text}");
    assert!(got["error"]["message"].is_string(), "{text}");
    for secret in [
        "call_bad_0",
        "call_bad_1",
        "call_bad_2",
        "urgent-xyzzy",
        "tool_calls",
    ] {
        assert!(
            !text.contains(secret),
            "the bad call reached the agent ({secret}): {text}"
        );
    }
    let seen = h.mock_requests().await;
    assert_eq!(
        seen.len(),
        3,
        "the first round and exactly `repair_rounds` = 2 repair rounds"
    );
    check_repair_request_chat(&seen[0]["body"], &seen[1]["body"], "call_bad_0");
    check_repair_request_chat(&seen[1]["body"], &seen[2]["body"], "call_bad_1");

    let journal = h.journal();
    let _dir = h.stop().await;
    let db = support::journal(&journal);
    assert_eq!(
        round_states(&db, "repair-spent"),
        vec![
            ("repair-spent".into(), "repaired".into()),
            ("repair-spent#repair-1".into(), "repaired".into()),
            ("repair-spent#repair-2".into(), "surfaced_error".into()),
        ]
    );
    for round in [
        "repair-spent",
        "repair-spent#repair-1",
        "repair-spent#repair-2",
    ] {
        let rows = call_rows(&db, round);
        assert_eq!(rows.len(), 1, "{round}");
        assert_eq!(
            (rows[0].1.as_str(), rows[0].2.as_str()),
            ("invalid", "arguments"),
            "{round}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn spent_repairs_in_a_stream_end_it_with_an_error_and_never_the_bad_call() {
    let h = support::start_with_policy(Script::default(), "policy-repair").await;
    let bad = |id: &str| json!({"sse": chat_sse("chatcmpl-bad", None, &[(id, "create_ticket", BAD_ARGS)], "tool_calls")});
    h.script(&json!({"responses": [bad("call_bad_0"), bad("call_bad_1"), bad("call_bad_2")]}))
        .await;
    let request = json!({
        "model": "gpt-4o-mini",
        "stream": true,
        "messages": [{"role": "user", "content": "The printer is on fire, file a ticket."}],
        "tools": [ticket_tool_chat()]
    });
    let (status, _, body) = post_raw(
        &format!("{}/v1/chat/completions", h.url()),
        request.to_string().into(),
        &[("x-request-id", "repair-spent-sse")],
    )
    .await;
    let raw = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(
        status, 200,
        "the headers went out before the decision: {raw}"
    );
    for secret in [
        "call_bad_0",
        "call_bad_1",
        "call_bad_2",
        "urgent-xyzzy",
        "tool_calls",
    ] {
        assert!(
            !raw.contains(secret),
            "the bad call reached the agent ({secret}): {raw}"
        );
    }
    // The stream ends with the configured failure as a provider-shaped error event.
    let data = sse_data(&body);
    let last = data
        .last()
        .unwrap_or_else(|| panic!("an empty stream: {raw}"));
    assert_eq!(
        last.pointer("/error/code"),
        Some(&json!("envelope_invalid")),
        "{raw}"
    );
    assert!(
        !data.contains(&json!("[DONE]")),
        "a failed stream does not end as done: {raw}"
    );
    assert_eq!(h.mock_requests().await.len(), 3);
}

/// Runs the official SDK (`support::python()`) against turnguard with `request` (a stream
/// request) and returns its accumulated final message as JSON.
fn run_sdk(api: &str, base: &str, request: &Value) -> Value {
    const SCRIPT: &str = r#"
import json, os, sys
os.environ["NO_PROXY"] = "127.0.0.1,localhost"
os.environ["no_proxy"] = "127.0.0.1,localhost"
api, base, req = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
req.pop("stream", None)
if api == "openai":
    import openai
    client = openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0, timeout=30)
    with client.chat.completions.stream(**req) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
else:
    import anthropic
    client = anthropic.Anthropic(base_url=base, api_key="sk-ant-test", max_retries=0, timeout=30)
    with client.messages.stream(**req) as s:
        for _ in s:
            pass
        final = s.get_final_message()
print(json.dumps(final.model_dump(mode="json")))
"#;
    let out = std::process::Command::new(support::python())
        .arg("-c")
        .arg(SCRIPT)
        .arg(api)
        .arg(base)
        .arg(request.to_string())
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "the {api} SDK failed on turnguard's stream:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "SDK output is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Suppressed repeat with the default surfacing (repair): the recorded result is supplied.

#[tokio::test(flavor = "multi_thread")]
async fn a_suppressed_repeat_supplies_the_recorded_result_and_is_not_released_again() {
    let schemas = EventSchemas::load();
    let h = support::start_with_policy(Script::default(), "policy-repair").await;
    let book = |id: &str| {
        json!({"json": chat_response(&format!("chatcmpl-{id}"), "tool_calls",
            &[(id, "book_flight", r#"{"bookingRef": "BK-7", "flight": "LH200"}"#)])})
    };
    let text_answer = json!({"json": {
        "id": "chatcmpl-text", "object": "chat.completion", "created": 1_782_955_817, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "It is already booked."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 80, "completion_tokens": 8, "total_tokens": 88}
    }});
    h.script(&json!({"responses": [book("call_first"), book("call_again"), text_answer]}))
        .await;
    let tools = json!([chat_tool(
        "book_flight",
        json!({"type": "object", "properties": {"bookingRef": {"type": "string"}, "flight": {"type": "string"}}, "required": ["bookingRef", "flight"]})
    )]);
    let url = format!("{}/v1/chat/completions", h.url());
    let first = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Book LH200."}], "tools": tools});
    let (status, _, body) =
        post_raw(&url, first.to_string().into(), &[("x-request-id", "dup-1")]).await;
    assert_eq!(status, 200);
    let got: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        got["choices"][0]["message"]["tool_calls"][0]["id"],
        "call_first"
    );

    // The agent ran the tool and reports its result; the model asks for the same booking again.
    let second = json!({"model": "gpt-4o-mini", "tools": tools, "messages": [
        {"role": "user", "content": "Book LH200."},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_first", "type": "function",
            "function": {"name": "book_flight", "arguments": r#"{"bookingRef": "BK-7", "flight": "LH200"}"#}}]},
        {"role": "tool", "tool_call_id": "call_first", "content": "booked: seat 12A, confirmation QX-5521"}
    ]});
    let (status, _, body) = post_raw(
        &url,
        second.to_string().into(),
        &[("x-request-id", "dup-2")],
    )
    .await;
    let text = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(status, 200, "{text}");
    assert!(
        !text.contains("call_again"),
        "the repeat was released: {text}"
    );
    let got: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        got["choices"][0]["message"]["content"],
        "It is already booked."
    );

    let seen = h.mock_requests().await;
    assert_eq!(seen.len(), 3);
    let msgs = seen[2]["body"]["messages"].as_array().unwrap();
    let result = msgs.last().unwrap();
    assert_eq!(result["role"], "tool");
    assert_eq!(result["tool_call_id"], "call_again");
    let content = result["content"].as_str().unwrap();
    assert!(
        content.contains("QX-5521"),
        "the recorded result is supplied: {content}"
    );

    let journal = h.journal();
    let _dir = h.stop().await;
    let db = support::journal(&journal);
    let rows = call_rows(&db, "dup-2");
    assert_eq!(
        rows[0],
        (
            "call_again".into(),
            "suppressed-repeat".into(),
            "dispatch".into(),
            "effect_already_claimed".into()
        )
    );
    let events = events_of(&db, "dup-2");
    for (kind, payload) in &events {
        schemas.check(kind, payload);
    }
    assert!(
        events
            .iter()
            .any(|(k, p)| k == "agent.tool-called" && p["callId"] == "call_again"),
        "{events:?}"
    );
}

/// Issue 7, Events: `agent.tool-returned` carries `error {code, message}` when the call failed,
/// "never an empty success". A repeat of an effect whose result was never recorded, surfaced
/// by ending the turn, gave the agent nothing: its return must not be a bare `status: "ok"`.
#[tokio::test(flavor = "multi_thread")]
async fn a_suppressed_repeat_without_a_recorded_result_is_not_reported_as_success() {
    let schemas = EventSchemas::load();
    let h = support::start_with_policy(Script::default(), "policy-order").await;
    let book = |id: &str| {
        json!({"json": chat_response(&format!("chatcmpl-{id}"), "tool_calls",
            &[(id, "book_flight", r#"{"bookingRef": "BK-42", "flight": "LH300"}"#)])})
    };
    h.script(&json!({"responses": [book("call_one"), book("call_two")]}))
        .await;
    let url = format!("{}/v1/chat/completions", h.url());
    let request = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Book LH300."}],
        "tools": order_tools()
    });
    for rid in ["empty-1", "empty-2"] {
        let (status, _, _) =
            post_raw(&url, request.to_string().into(), &[("x-request-id", rid)]).await;
        assert_eq!(status, 200);
    }
    let journal = h.journal();
    let _dir = h.stop().await;
    let db = support::journal(&journal);
    assert_eq!(call_rows(&db, "empty-2")[0].1, "suppressed-repeat");
    let events = events_of(&db, "empty-2");
    for (kind, payload) in &events {
        schemas.check(kind, payload);
    }
    let returned: Vec<&Value> = events
        .iter()
        .filter(|(k, p)| k == "agent.tool-returned" && p["callId"] == "call_two")
        .map(|(_, p)| p)
        .collect();
    for p in returned {
        let empty_success = p["status"] == "ok" && p.get("outcome").is_none();
        assert!(
            !empty_success,
            "the repeat was neither run nor answered (no result recorded, turn ended), yet its \
             agent.tool-returned is an empty success: {p}"
        );
    }
}

/// The catalog's `inputSchema` is compiled once per policy snapshot and enforced on every
/// call, not only the first: the agent declares `get_weather` with a schema that accepts
/// anything, so only the catalog's `required = ["location"]` can refuse `{}`. Valid, invalid,
/// valid again: executed, invalid at the arguments stage naming the catalog schema, executed.
#[tokio::test(flavor = "multi_thread")]
async fn the_catalog_schema_is_enforced_on_every_call() {
    let h = support::start_with_policy(Script::default(), "policy-order").await;
    let rounds = [
        ("call_w1", r#"{"location": "Paris"}"#),
        ("call_w2", "{}"),
        ("call_w3", r#"{"location": "Oslo"}"#),
    ];
    let responses: Vec<Value> = rounds
        .iter()
        .enumerate()
        .map(|(i, (id, args))| {
            json!({"json": chat_response(&format!("chatcmpl-cat{i}"), "tool_calls", &[(id, "get_weather", args)])})
        })
        .collect();
    h.script(&json!({ "responses": responses })).await;
    let request = json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [chat_tool("get_weather", json!({"type": "object"}))]
    });
    let url = format!("{}/v1/chat/completions", h.url());
    let mut released = Vec::new();
    for _ in rounds {
        let (status, _, body) = post_raw(&url, request.to_string().into(), &[]).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let got: Value = serde_json::from_slice(&body).unwrap();
        let message = &got["choices"][0]["message"];
        match message["tool_calls"][0]["id"].as_str() {
            Some(id) => released.push(id.to_owned()),
            None => {
                let text = message["content"].as_str().unwrap_or_default();
                assert!(
                    text.contains("invalid at the arguments stage (schema_violation)"),
                    "{text}"
                );
                released.push(String::new());
            }
        }
    }
    assert_eq!(released, ["call_w1", "", "call_w3"]);
}
