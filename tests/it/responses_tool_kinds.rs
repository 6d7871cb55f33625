//! Every Responses tool kind as Codex's default ("lite") shape sends them, over real sockets
//! with the mock provider playing the model (issue 12, compat finding F6/F7): tools declared
//! in an `additional_tools` input item inside a `namespace`, a free-form `custom` tool whose
//! call carries raw text, its streamed input held and released as sent, the declared format
//! checked, a repair round that keeps the call's own item type, a failed stream that ends
//! with `response.failed`, and the WebSocket probe declined with 426.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)] // test code

use crate::support;

use serde_json::{json, Value};
use support::{post_json, post_raw, sse_data};

/// The compat bundle: its codex catalog knows `functions.exec` (an exec tool, trusted output),
/// invalid calls are repaired (then an error), held calls wait with nobody to approve.
const BUNDLE: &str = "policy-compat";

const JS: &str = "const r = await tools.exec_command({cmd: \"ls -la\"});\ntext(r.output);";

fn url(h: &support::Harness) -> String {
    format!("{}/v1/responses", h.url())
}

/// The lite shape: no top-level `tools`; the tools come in an `additional_tools` item, the
/// custom `exec` inside the `functions` namespace with the given `format`.
fn lite_request(format: Value, stream: bool) -> Value {
    json!({
        "model": "gpt-6.1-sol",
        "stream": stream,
        "input": [
            {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": [
                {"type": "namespace", "name": "functions", "description": "tools", "tools": [
                    {"type": "custom", "name": "exec", "description": "Run JavaScript", "format": format},
                    {"type": "function", "name": "wait", "parameters": {"type": "object"}}
                ]}
            ]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
        ]
    })
}

fn lark() -> Value {
    json!({"type": "grammar", "syntax": "lark", "definition": "start: /[\\s\\S]+/"})
}

fn exec_call(input: &str) -> Value {
    json!({"name": "exec", "namespace": "functions", "input": input})
}

fn custom_calls(output: &[Value]) -> Vec<(String, String, String)> {
    output
        .iter()
        .filter(|i| i["type"] == "custom_tool_call")
        .map(|i| {
            (
                i["namespace"].as_str().unwrap_or_default().to_owned(),
                i["name"].as_str().unwrap_or_default().to_owned(),
                i["input"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

fn mock_bodies(requests: &[Value]) -> Vec<&Value> {
    requests
        .iter()
        .filter(|r| r["path"] == "/v1/responses")
        .map(|r| &r["body"])
        .collect()
}

#[tokio::test]
async fn a_namespaced_custom_call_in_a_first_lite_turn_is_declared_trusted_and_released() {
    let h = support::start_with_policy(turnguard::mock_provider::Script::default(), BUNDLE).await;
    h.script(&json!({"responses": [{"reply": {"tool_calls": [exec_call(JS)]}}]}))
        .await;
    let (status, body) = post_json(&url(&h), &lite_request(lark(), false), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let resp: Value = serde_json::from_slice(&body).unwrap();
    let output = resp["output"].as_array().unwrap();
    // Released as the model wrote it: no host-authored message, the raw input unchanged.
    assert_eq!(
        custom_calls(output),
        vec![("functions".into(), "exec".into(), JS.into())],
        "{resp}"
    );
    assert!(
        output.iter().all(|i| i["type"] != "message"),
        "no host text: {resp}"
    );
    assert_eq!(mock_bodies(&h.mock_requests().await).len(), 1, "no repair");
    h.stop().await;
}

#[tokio::test]
async fn a_streamed_custom_call_is_held_validated_and_released_as_sent() {
    let h = support::start_with_policy(turnguard::mock_provider::Script::default(), BUNDLE).await;
    h.script(&json!({"responses": [{"reply": {"tool_calls": [exec_call(JS)]}}]}))
        .await;
    let (status, _, body) =
        post_raw(&url(&h), lite_request(lark(), true).to_string().into(), &[]).await;
    assert_eq!(status, 200);
    let events = sse_data(&body);
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.custom_tool_call_input.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    let done: Vec<&str> = events
        .iter()
        .filter(|e| e["type"] == "response.custom_tool_call_input.done")
        .filter_map(|e| e["input"].as_str())
        .collect();
    assert_eq!(deltas, JS, "the deltas as the model sent them: {kinds:?}");
    assert_eq!(done, vec![JS]);
    let completed = events
        .iter()
        .find(|e| e["type"] == "response.completed")
        .unwrap_or_else(|| panic!("a completed response: {kinds:?}"));
    let output = completed["response"]["output"].as_array().unwrap();
    assert_eq!(
        custom_calls(output),
        vec![("functions".into(), "exec".into(), JS.into())]
    );
    assert!(output.iter().all(|i| i["type"] != "message"), "{completed}");
    assert_eq!(mock_bodies(&h.mock_requests().await).len(), 1, "no repair");
    h.stop().await;
}

#[tokio::test]
async fn a_custom_call_outside_its_regex_grammar_is_repaired_as_a_custom_call() {
    let h = support::start_with_policy(turnguard::mock_provider::Script::default(), BUNDLE).await;
    h.script(&json!({"responses": [
        {"reply": {"tool_calls": [exec_call("ls -la")]}},
        {"reply": {"text": "I will stay within the grammar."}}
    ]}))
    .await;
    let words = json!({"type": "grammar", "syntax": "regex", "definition": "[a-z ]+"});
    let (status, body) = post_json(&url(&h), &lite_request(words, false), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let resp: Value = serde_json::from_slice(&body).unwrap();
    assert!(
        custom_calls(resp["output"].as_array().unwrap()).is_empty(),
        "the invalid call is withheld: {resp}"
    );
    let requests = h.mock_requests().await;
    let bodies = mock_bodies(&requests);
    assert_eq!(bodies.len(), 2, "one repair round");
    let input = bodies[1]["input"].as_array().unwrap();
    let call = input
        .iter()
        .find(|i| i["type"] == "custom_tool_call")
        .unwrap_or_else(|| panic!("the call goes back as a custom_tool_call: {input:?}"));
    assert_eq!(
        (&call["namespace"], &call["name"], &call["input"]),
        (&json!("functions"), &json!("exec"), &json!("ls -la"))
    );
    assert!(
        input.iter().all(|i| i["type"] != "function_call"),
        "{input:?}"
    );
    let answer = input
        .iter()
        .find(|i| i["type"] == "custom_tool_call_output")
        .unwrap_or_else(|| panic!("answered by a custom_tool_call_output: {input:?}"));
    assert_eq!(answer["call_id"], call["call_id"]);
    let text = answer["output"].as_str().unwrap();
    assert!(text.contains("regex grammar"), "{text}");
    h.stop().await;
}

#[tokio::test]
async fn a_failed_stream_ends_with_response_failed_and_a_non_retryable_error() {
    let h = support::start_with_policy(turnguard::mock_provider::Script::default(), BUNDLE).await;
    let cut = json!({"reply": {"tool_calls": [exec_call(JS)], "truncated": true}});
    h.script(&json!({"responses": [cut.clone(), cut.clone(), cut]}))
        .await;
    let (status, _, body) =
        post_raw(&url(&h), lite_request(lark(), true).to_string().into(), &[]).await;
    assert_eq!(status, 200);
    let events = sse_data(&body);
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.failed", "{events:?}");
    assert_eq!(last["response"]["status"], "failed");
    assert_eq!(last["response"]["error"]["code"], "invalid_prompt");
    assert_eq!(
        last["response"]["error"]["turnguard_code"],
        "envelope_invalid"
    );
    assert!(
        events.iter().all(|e| e["type"] != "response.completed"),
        "{events:?}"
    );
    h.stop().await;
}

#[tokio::test]
async fn the_responses_websocket_probe_is_declined_with_426() {
    let h = support::start(turnguard::mock_provider::Script::default()).await;
    let headers = [
        ("connection", "Upgrade".to_owned()),
        ("upgrade", "websocket".to_owned()),
        ("sec-websocket-version", "13".to_owned()),
        ("sec-websocket-key", "AakVEf91ewQdT00Uj4r4cw==".to_owned()),
        ("openai-beta", "responses_websockets=2026-02-06".to_owned()),
    ];
    let (status, _, body) = support::call("GET", &url(&h), &headers, None).await;
    assert_eq!(status, 426, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "upgrade_required", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("over HTTP only"),
        "{v}"
    );
    // A plain GET stays off the allowlist.
    let (status, _) = support::get(&url(&h)).await;
    assert_eq!(status, 404);
    assert!(
        mock_bodies(&h.mock_requests().await).is_empty(),
        "nothing reached upstream"
    );
    h.stop().await;
}

/// The Vercel AI SDK's second tool round: the first response's reasoning and message items
/// sent back as `item_reference`s. References to items turnguard journaled from a trusted
/// turn take that trust (the write call is released); an unknown reference stays untrusted
/// (the write call is held, and with nobody to approve it, not released).
#[tokio::test]
async fn item_references_take_the_trust_of_the_journaled_items_they_name() {
    let h = support::start_with_policy(turnguard::mock_provider::Script::default(), BUNDLE).await;
    let note = json!({"name": "save_note", "arguments": {"text": "Paris: sunny"}});
    h.script(&json!({"responses": [
        {"reply": {"reasoning": "The weather first.", "text": "Checking.",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}},
        {"reply": {"tool_calls": [note.clone()]}},
        {"reply": {"tool_calls": [note]}}
    ]}))
    .await;
    let tools = json!([
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
        {"type": "function", "name": "save_note", "parameters": {"type": "object"}}
    ]);
    let user = json!({"role": "user", "content": [{"type": "input_text", "text": "weather, then a note"}]});
    let first = json!({"model": "m", "tools": tools, "input": [user]});
    let (status, body) = post_json(&url(&h), &first, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let resp: Value = serde_json::from_slice(&body).unwrap();
    let output = resp["output"].as_array().unwrap();
    let refs: Vec<Value> = output
        .iter()
        .filter(|i| i["type"] == "reasoning" || i["type"] == "message")
        .map(|i| json!({"type": "item_reference", "id": i["id"]}))
        .collect();
    assert_eq!(refs.len(), 2, "{resp}");
    let call = output
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap();
    let call_id = call["call_id"].clone();
    let second = |refs: Vec<Value>| {
        let mut input = vec![user.clone()];
        input.extend(refs);
        input.push(json!({"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}));
        input.push(
            json!({"type": "function_call_output", "call_id": call_id, "output": "sunny, 21 C"}),
        );
        json!({"model": "m", "tools": tools, "input": input})
    };
    let released = |body: &[u8]| -> bool {
        let v: Value = serde_json::from_slice(body).unwrap();
        v["output"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["type"] == "function_call" && i["name"] == "save_note")
    };
    let (status, body) = post_json(&url(&h), &second(refs), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(
        released(&body),
        "journaled references are trusted: {}",
        String::from_utf8_lossy(&body)
    );
    let unknown = vec![json!({"type": "item_reference", "id": "rs_not_journaled"})];
    let (status, body) = post_json(&url(&h), &second(unknown), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(
        !released(&body),
        "an unknown reference stays untrusted: {}",
        String::from_utf8_lossy(&body)
    );
    h.stop().await;
}

/// An `mcp` tool supplied in an `additional_tools` item (or inside a namespace) is a provider
/// delegation like a top-level one: refused inside a run (contract §F), before anything goes
/// upstream.
#[tokio::test]
async fn an_mcp_tool_in_additional_tools_is_refused_inside_a_run() {
    let h = support::start(turnguard::mock_provider::Script::default()).await;
    let mcp = json!({"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.deepwiki.com/mcp"});
    for (tools, field) in [
        (
            json!([mcp.clone()]),
            "input[0].tools[0] (mcp, server_label deepwiki)",
        ),
        (
            json!([{"type": "namespace", "name": "ext", "tools": [mcp.clone()]}]),
            "input[0].tools[0].tools[0] (mcp, server_label deepwiki)",
        ),
    ] {
        let req = json!({"model": "m", "input": [
            {"type": "additional_tools", "role": "developer", "tools": tools},
            {"role": "user", "content": "hi"}
        ]});
        let (status, body) = post_json(&url(&h), &req, &[("turnguard-run", "run-1")]).await;
        assert_eq!(status, 403, "{}", String::from_utf8_lossy(&body));
        let err: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            err["error"]["details"]["reason"],
            "provider_delegation_in_run"
        );
        assert_eq!(err["error"]["details"]["field"], field);
    }
    assert!(mock_bodies(&h.mock_requests().await).is_empty());
    h.stop().await;
}
