//! The Responses surface (`POST /v1/responses`) as an agent meets it, over real sockets with
//! the mock provider playing the model: byte-faithful pass-through, truncated calls never
//! released, `mcp` tools refused inside a run, tool results and the response chain journaled,
//! a cut stream ending with an error event.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use crate::support;

use serde_json::{json, Value};
use support::{fixtures, own_fixtures, post_json, post_raw, script, sse_data};
use turnguard::mock_provider::Script;

fn url(h: &support::Harness) -> String {
    format!("{}/v1/responses", h.url())
}

fn function(name: &str) -> Value {
    json!({"type": "function", "name": name, "parameters": {"type": "object"}, "strict": false})
}

fn request(tools: Value, stream: bool) -> Value {
    json!({"model": "gpt-5", "input": "go", "stream": stream, "tools": tools})
}

/// The SSE events of a fixture, each without its trailing blank line.
fn events(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .split_terminator("\n\n")
        .map(str::to_owned)
        .collect()
}

fn data_of(event: &str) -> Value {
    serde_json::from_str(event.split_once("data: ").unwrap().1).unwrap()
}

fn encode(v: &Value) -> String {
    format!("event: {}\ndata: {v}", v["type"].as_str().unwrap())
}

fn assert_consecutive(body: &[u8]) {
    let seqs: Vec<Value> = sse_data(body)
        .iter()
        .map(|e| e["sequence_number"].clone())
        .collect();
    let want: Vec<Value> = (0..seqs.len()).map(|i| json!(i)).collect();
    assert_eq!(seqs, want, "sequence numbers consecutive from 0");
}

#[tokio::test]
async fn released_streams_pass_byte_for_byte() {
    let h = support::start(Script::default()).await;
    let cases = [
        (
            fixtures().join("openai-responses/stream-function-call.sse"),
            json!([function("final_result")]),
        ),
        (
            own_fixtures().join("responses-stream-text-then-calls.sse"),
            json!([function("get_weather"), function("get_capital")]),
        ),
        (
            own_fixtures().join("responses-stream-web-search-then-text.sse"),
            json!([{"type": "web_search"}]),
        ),
    ];
    for (path, tools) in cases {
        h.script(&json!({"responses": [{"file": path}]})).await;
        let (status, _, body) =
            post_raw(&url(&h), request(tools, true).to_string().into(), &[]).await;
        assert_eq!(status, 200);
        assert_eq!(
            String::from_utf8_lossy(&body),
            std::fs::read_to_string(&path).unwrap(),
            "{} forwarded byte for byte",
            path.display()
        );
    }
    let (_, body) = post_json(&url(&h), &request(json!([]), false), &[]).await;
    assert!(
        String::from_utf8_lossy(&body).contains("mock script exhausted"),
        "the last request reached the mock"
    );
}

#[tokio::test]
async fn a_truncated_function_call_is_never_released_even_when_its_arguments_parse() {
    let h = support::start(Script::default()).await;
    // The shared capture, ended by `response.incomplete` (max_output_tokens) instead of
    // `response.completed`: the arguments `{"result":6666}` are complete JSON.
    let mut evs = events(&fixtures().join("openai-responses/stream-function-call.sse"));
    let mut last = data_of(evs.last().unwrap());
    last["type"] = json!("response.incomplete");
    last["response"]["status"] = json!("incomplete");
    last["response"]["incomplete_details"] = json!({"reason": "max_output_tokens"});
    *evs.last_mut().unwrap() = encode(&last);
    let mut body: Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("openai-responses/nonstream-function-call.json")).unwrap(),
    )
    .unwrap();
    body["status"] = json!("incomplete");
    body["incomplete_details"] = json!({"reason": "max_output_tokens"});
    h.script(&json!({"responses": [{"sse": evs}, {"json": body}]}))
        .await;

    let (status, _, out) = post_raw(
        &url(&h),
        request(json!([function("final_result")]), true)
            .to_string()
            .into(),
        &[("x-request-id", "trunc-stream")],
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&out);
    assert!(
        !text.contains("\"function_call"),
        "a truncated call reached the agent"
    );
    assert_consecutive(&out);
    let data = sse_data(&out);
    let terminal = data.last().unwrap();
    assert_eq!(terminal["type"], "response.completed");
    assert_eq!(terminal["response"]["status"], "completed");
    assert_eq!(terminal["response"]["incomplete_details"], Value::Null);
    let output = terminal["response"]["output"].as_array().unwrap();
    assert_eq!(
        output.iter().map(|o| o["type"].clone()).collect::<Vec<_>>(),
        vec![json!("reasoning"), json!("message")]
    );
    assert!(output[1]["content"][0]["text"]
        .as_str()
        .unwrap()
        .contains("at the completion stage (truncated)"));

    let (status, out) = post_json(
        &url(&h),
        &request(json!([function("get_capital")]), false),
        &[("x-request-id", "trunc-json")],
    )
    .await;
    assert_eq!(status, 200);
    let out: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(out["status"], "completed");
    let output = out["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{out}");
    assert_eq!(output[0]["type"], "message");
    assert!(output[0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with("[turnguard]"));
    assert_eq!(out["usage"], body["usage"], "the rest is kept");

    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    for id in ["trunc-stream", "trunc-json"] {
        let row: (String, String, String, String) = db
            .query_row(
                "SELECT r.completion, c.outcome, c.stage, c.reason FROM rounds r JOIN tool_calls c USING (request_id) WHERE r.client_request_id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap();
        assert_eq!(
            row,
            (
                "truncated".into(),
                "invalid".into(),
                "completion".into(),
                "truncated".into()
            ),
            "{id}"
        );
    }
}

#[tokio::test]
async fn an_mcp_tool_is_refused_inside_a_run_and_passed_in_a_chat_turn() {
    let h = support::start(Script::default()).await;
    h.script(&script(
        json!([{ "file": "openai-responses/nonstream-mcp-call.json" }]),
        &fixtures(),
    ))
    .await;
    let req = json!({
        "model": "o4-mini",
        "input": "What transport protocols does the 2025-03-26 MCP spec support?",
        "tools": [
            function("get_capital"),
            {"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.deepwiki.com/mcp", "require_approval": "never"}
        ]
    });
    let (status, body) = post_json(&url(&h), &req, &[("turnguard-run", "run-mcp")]).await;
    assert_eq!(status, 403);
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["error"]["code"], "forbidden");
    assert_eq!(
        err["error"]["details"]["reason"],
        "provider_delegation_in_run"
    );
    assert_eq!(
        err["error"]["details"]["field"],
        "tools[1] (mcp, server_label deepwiki)"
    );
    assert!(
        err["error"]["message"].as_str().unwrap().contains("MCP"),
        "{err}"
    );
    assert!(
        h.mock_requests().await.is_empty(),
        "a refused request never reaches the provider"
    );

    // A chat turn (no run): the provider may run MCP; its output is passed through.
    let (status, body) = post_json(&url(&h), &req, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(
        &body[..],
        &std::fs::read(fixtures().join("openai-responses/nonstream-mcp-call.json")).unwrap()[..]
    );
}

#[tokio::test]
async fn tool_results_and_the_response_chain_are_journaled() {
    let h = support::start(Script::default()).await;
    h.script(&script(
        json!([
            { "file": "openai-responses/nonstream-web-search-call.json" },
            { "file": "openai-responses/nonstream-function-call.json" }
        ]),
        &fixtures(),
    ))
    .await;
    let first: Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("openai-responses/nonstream-web-search-call.json")).unwrap(),
    )
    .unwrap();
    let (status, _) = post_json(
        &url(&h),
        &json!({"model": "gpt-5-mini", "input": "tech news today?", "tools": [{"type": "web_search"}]}),
        &[("turnguard-run", "run-9"), ("x-request-id", "chain-1")],
    )
    .await;
    assert_eq!(status, 200);
    // The next turn continues from the stored response and sends a tool result back.
    let mut next: Value = serde_json::from_slice(
        &std::fs::read(
            fixtures().join("openai-responses/request-tools-and-function-call-output.json"),
        )
        .unwrap(),
    )
    .unwrap();
    next["previous_response_id"] = first["id"].clone();
    let (status, _) = post_json(
        &url(&h),
        &next,
        &[("turnguard-run", "run-9"), ("x-request-id", "chain-2")],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        h.mock_requests().await[1]["body"],
        next,
        "the request reaches the provider unchanged"
    );

    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let result: (String, String, Option<String>, Vec<u8>) = db
        .query_row(
            "SELECT scope, tool_call_id, tool_name, content FROM tool_results",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert_eq!(
        result,
        (
            "run:run-9".into(),
            "call_YfwRsW8sUxDKipwyhWTzOXCA".into(),
            Some("get_capital".into()),
            b"\"Potato City\"".to_vec()
        )
    );
    let round_index: i64 = db
        .query_row(
            "SELECT round_index FROM rounds WHERE client_request_id = 'chain-2'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(
        round_index, 2,
        "the stored response's round (from the journal), then one model turn (the echoed \
         call) in the input"
    );
    let mut stmt = db
        .prepare("SELECT r.client_request_id, response_id, previous_response_id, p.run_id, status, provider_executed, provider_items FROM responses p JOIN rounds r USING (request_id) ORDER BY p.at_ms, r.id")
        .unwrap();
    let rows: Vec<(
        String,
        String,
        Option<String>,
        Option<String>,
        String,
        bool,
        String,
    )> = stmt
        .query_map([], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
                r.get(6)?,
            ))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let first_id = first["id"].as_str().unwrap().to_owned();
    assert_eq!(
        rows,
        vec![
            (
                "chain-1".into(),
                first_id.clone(),
                None,
                Some("run-9".into()),
                "completed".into(),
                true,
                "web_search_call".into()
            ),
            (
                "chain-2".into(),
                "resp_04907f5d3de791830068fbaa19bb908195a91378279dba0f14".into(),
                Some(first_id),
                Some("run-9".into()),
                "completed".into(),
                false,
                String::new()
            ),
        ]
    );
}

#[tokio::test]
async fn a_stream_cut_mid_call_releases_nothing_and_ends_with_an_error_event() {
    let h = support::start(Script::default()).await;
    h.script(&json!({"responses": [
        { "file": fixtures().join("openai-responses/stream-function-call.sse"), "cut_after_events": 8 }
    ]}))
    .await;
    let (status, _, body) = post_raw(
        &url(&h),
        request(json!([function("final_result")]), true)
            .to_string()
            .into(),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(!text.contains("\"function_call"), "nothing half-released");
    assert_consecutive(&body);
    let last = sse_data(&body).pop().unwrap();
    assert_eq!(last["type"], "error");
    assert_eq!(last["code"], "turnguard.upstream_stream_cut");
    assert_eq!(last["error"]["type"], "upstream_stream_interrupted");
    assert!(text.ends_with("\n\n"));

    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let row: (String, String, String) = db
        .query_row(
            "SELECT r.state, c.outcome, c.reason FROM rounds r JOIN tool_calls c USING (request_id)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(
        row,
        ("failed".into(), "invalid".into(), "stream_cut".into())
    );
    let status: Option<String> = db
        .query_row("SELECT status FROM responses", [], |r| r.get(0))
        .unwrap();
    assert_eq!(status, None, "a cut response has no known status");
}

#[tokio::test]
async fn malformed_responses_requests_get_a_clear_error() {
    let h = support::start(Script::default()).await;
    for (body, needle) in [
        (json!({"model": "m", "input": 5}), "`input` must be"),
        (
            json!({"model": "m", "input": "x", "tools": [{"type": "function"}]}),
            "`tools[0].name`",
        ),
        (
            json!({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}),
            "`call_id`",
        ),
        (
            json!({"model": "m", "input": "x", "previous_response_id": 7}),
            "`previous_response_id`",
        ),
    ] {
        let (status, out) = post_json(&url(&h), &body, &[]).await;
        assert_eq!(status, 400, "{body}");
        let err: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(err["error"]["code"], "validation_error");
        assert!(
            err["error"]["message"].as_str().unwrap().contains(needle),
            "{err} should name {needle}"
        );
    }
    assert!(h.mock_requests().await.is_empty());
}

#[tokio::test]
async fn calls_the_stream_never_announced_are_still_admitted() {
    let h = support::start(Script::default()).await;
    let evs = events(&fixtures().join("openai-responses/stream-function-call.sse"));
    // 1. No `output_item.added` for the call: its deltas and `.done` events come unannounced.
    let unannounced: Vec<String> = evs
        .iter()
        .filter(|e| {
            let d = data_of(e);
            !(d["type"] == "response.output_item.added" && d["item"]["type"] == "function_call")
        })
        .cloned()
        .collect();
    // 2. The call appears only in the terminal event's `output`.
    let only_final: Vec<String> = evs
        .iter()
        .filter(|e| {
            let d = data_of(e);
            d["output_index"] != 1
        })
        .cloned()
        .collect();
    h.script(&json!({"responses": [{"sse": unannounced}, {"sse": only_final}]}))
        .await;
    for case in ["unannounced", "only-final"] {
        let (status, _, body) = post_raw(
            &url(&h),
            request(json!([function("another_tool")]), true)
                .to_string()
                .into(),
            &[("x-request-id", case)],
        )
        .await;
        assert_eq!(status, 200);
        let text = String::from_utf8_lossy(&body);
        assert!(
            !text.contains("\"function_call"),
            "{case}: an undeclared call reached the agent"
        );
        assert_consecutive(&body);
        let last = sse_data(&body).pop().unwrap();
        assert_eq!(last["type"], "response.completed", "{case}");
        assert!(
            last["response"]["output"]
                .as_array()
                .unwrap()
                .last()
                .unwrap()["content"][0]["text"]
                .as_str()
                .unwrap()
                .starts_with("[turnguard]"),
            "{case}"
        );
    }
    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let decided: i64 = db
        .query_row(
            "SELECT count(*) FROM tool_calls WHERE outcome = 'invalid' AND stage = 'name' AND call_id = 'call_CWXgs68YprAjp6t0371hiPOI'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(decided, 2);
}

#[tokio::test]
async fn an_upstream_error_event_mid_call_drops_the_held_call() {
    let h = support::start(Script::default()).await;
    let evs = events(&fixtures().join("openai-responses/stream-function-call.sse"));
    let mut upstream: Vec<String> = evs[..7].to_vec(); // through two argument deltas
    upstream.push(encode(&json!({
        "type": "error", "sequence_number": 7, "code": "server_error",
        "message": "The server had an error while processing your request.", "param": null
    })));
    h.script(&json!({"responses": [{"sse": upstream}]})).await;
    let (status, _, body) = post_raw(
        &url(&h),
        request(json!([function("final_result")]), true)
            .to_string()
            .into(),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains("\"function_call"),
        "nothing held is released"
    );
    assert_consecutive(&body);
    let data = sse_data(&body);
    let kinds: Vec<&str> = data.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        vec![
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.output_item.done",
            "error"
        ],
        "the provider's error ends the stream; turnguard adds no second error event"
    );
    assert_eq!(
        data[4]["code"], "server_error",
        "the provider's error, as sent"
    );
    let dir = h.stop().await;
    let conn = support::journal(&dir.path().join("journal.db"));
    let state: String = conn
        .query_row("SELECT state FROM rounds", [], |r| r.get(0))
        .unwrap();
    assert_eq!(state, "upstream_error");
}

/// The SSE invariants the official SDK's accumulator relies on: consecutive sequence numbers,
/// items added at the next `output_index` before their events, one response id, and a
/// terminal `output` listing exactly the items streamed.
fn assert_one_valid_response(body: &[u8]) -> Vec<Value> {
    assert_consecutive(body);
    let data = sse_data(body);
    assert_eq!(data[0]["type"], "response.created");
    let id = data[0]["response"]["id"].clone();
    let mut added: Vec<Value> = Vec::new();
    for (i, e) in data.iter().enumerate() {
        if e["type"] == "response.created" {
            assert_eq!(i, 0, "one response.created");
        }
        if let Some(r) = e.get("response") {
            assert_eq!(r["id"], id, "event {i}: one response id");
        }
        if e["type"] == "response.output_item.added" {
            assert_eq!(
                e["output_index"],
                added.len(),
                "event {i}: items added in order"
            );
            added.push(e["item"].clone());
        } else if let Some(ix) = e["output_index"].as_u64() {
            assert!(
                ix < added.len() as u64,
                "event {i}: output_index {ix} before its item"
            );
        }
    }
    let terminal = data.last().unwrap();
    assert_eq!(terminal["type"], "response.completed");
    let ids = |l: &[Value]| l.iter().map(|i| i["id"].clone()).collect::<Vec<_>>();
    assert_eq!(
        ids(terminal["response"]["output"].as_array().unwrap()),
        ids(&added),
        "terminal output = the items streamed"
    );
    added
}

fn strict_string_result() -> Value {
    json!([{"type": "function", "name": "final_result", "strict": true, "parameters": {
        "type": "object", "properties": {"result": {"type": "string"}},
        "required": ["result"], "additionalProperties": false}}])
}

#[tokio::test]
async fn an_invalid_call_is_repaired_and_the_repair_round_continues_the_agents_stream() {
    let h = support::start_with_policy(Script::default(), "policy-repair").await;
    h.script(&json!({"responses": [
        { "file": fixtures().join("openai-responses/stream-function-call.sse"), "path": "/v1/responses" },
        { "file": own_fixtures().join("responses-stream-web-search-then-text.sse"), "path": "/v1/responses" }
    ]}))
    .await;
    let req = request(strict_string_result(), true);
    let (status, _, body) = post_raw(
        &url(&h),
        req.to_string().into(),
        &[("x-request-id", "repair-stream")],
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains("\"function_call"),
        "the invalid call never reached the agent"
    );
    let items = assert_one_valid_response(&body);
    let types: Vec<&str> = items.iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        vec!["reasoning", "web_search_call", "message"],
        "round 1's reasoning, then round 2's items"
    );
    let data = sse_data(&body);
    assert_eq!(
        data[0]["response"]["id"], "resp_0050471a34b36ae60068c97b94a480819587a9d70cf2979b33",
        "the agent keeps round 1's response id"
    );

    // The repair round asked the model again with the call and a host-authored error result.
    let seen = h.mock_requests().await;
    assert_eq!(seen.len(), 2);
    let input = seen[1]["body"]["input"].as_array().unwrap();
    assert_eq!(input[0], json!({"role": "user", "content": "go"}));
    assert_eq!(input[1]["type"], "function_call");
    assert_eq!(input[1]["call_id"], "call_CWXgs68YprAjp6t0371hiPOI");
    assert_eq!(input[1]["arguments"], "{\"result\":6666}");
    assert!(
        input[1].get("id").is_none(),
        "no item id: no reasoning item is required"
    );
    assert_eq!(input[2]["type"], "function_call_output");
    assert_eq!(input[2]["call_id"], "call_CWXgs68YprAjp6t0371hiPOI");
    assert!(input[2]["output"].as_str().unwrap().starts_with("Error: "));
    assert_eq!(seen[1]["body"]["tools"], req["tools"]);

    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let rounds: Vec<(String, String)> = db
        .prepare(&format!(
            "SELECT {}, state FROM rounds ORDER BY id",
            support::CLIENT_ROUND_LABEL
        ))
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        rounds,
        vec![
            ("repair-stream".into(), "repaired".into()),
            ("repair-stream#repair-1".into(), "ok".into())
        ]
    );
    // The repair round's own response is in the chain under the provider's id.
    let ids: Vec<String> = db.column("SELECT response_id FROM responses ORDER BY response_id");
    assert_eq!(
        ids,
        vec![
            "resp_0050471a34b36ae60068c97b94a480819587a9d70cf2979b33".to_owned(),
            "resp_68fc1c33445566778899aabbccddeeff0011223344556677".to_owned()
        ]
    );
}

#[tokio::test]
async fn an_invalid_call_is_repaired_in_a_json_response() {
    let h = support::start_with_policy(Script::default(), "policy-repair").await;
    h.script(&script(
        json!([
            { "file": "openai-responses/nonstream-function-call.json" },
            { "file": "openai-responses/nonstream-web-search-call.json" }
        ]),
        &fixtures(),
    ))
    .await;
    let tools = json!([{"type": "function", "name": "get_capital", "parameters": {
        "type": "object", "properties": {"country": {"type": "integer"}}, "required": ["country"]}}]);
    let req = json!({"model": "gpt-4o", "input": [{"role": "user", "content": "capital?"}], "tools": tools});
    let (status, body) = post_json(&url(&h), &req, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(
        &body[..],
        &std::fs::read(fixtures().join("openai-responses/nonstream-web-search-call.json")).unwrap()
            [..],
        "the agent gets the repair round's response"
    );
    let seen = h.mock_requests().await;
    let input = seen[1]["body"]["input"].as_array().unwrap();
    assert_eq!(input.len(), 3);
    assert_eq!(input[1]["name"], "get_capital");
    assert_eq!(input[2]["type"], "function_call_output");
    assert!(
        input[2]["output"].as_str().unwrap().contains("schema"),
        "{}",
        input[2]
    );
}

#[tokio::test]
async fn a_turn_continuing_a_stored_response_is_untrusted() {
    // Issue 5 must-show 4: the provider holds the turns before `previous_response_id`, here
    // one whose output had a `web_search_call` (journaled by turnguard), so the next turn is
    // untrusted and a gated call (an unknown tool is `write`) is held, not released. Longer
    // chains, clean chains and unknown ids: `tests/it/responses_contract.rs`.
    let h = support::start(Script::default()).await;
    h.script(&script(
        json!([
            { "file": "openai-responses/nonstream-web-search-call.json" },
            { "file": "openai-responses/nonstream-function-call.json" },
            { "file": "openai-responses/nonstream-function-call.json" }
        ]),
        &fixtures(),
    ))
    .await;
    let first: Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("openai-responses/nonstream-web-search-call.json")).unwrap(),
    )
    .unwrap();
    let tools = json!([function("get_capital"), {"type": "web_search"}]);
    let ask = |prev: Option<&Value>| {
        let mut r = json!({"model": "gpt-5-mini", "input": "and the capital?", "tools": tools});
        if let Some(p) = prev {
            r["previous_response_id"] = p.clone();
        }
        r
    };
    post_json(&url(&h), &ask(None), &[("x-request-id", "t-1")]).await;
    let (_, next) = post_json(
        &url(&h),
        &ask(Some(&first["id"])),
        &[("x-request-id", "t-2")],
    )
    .await;
    let next: Value = serde_json::from_slice(&next).unwrap();
    assert!(
        next["output"]
            .as_array()
            .unwrap()
            .iter()
            .all(|o| o["type"] != "function_call"),
        "{next}"
    );
    // The same call without a stored chain behind it (and without `web_search`, which lets
    // the provider read the web in this very turn) is released.
    let mut fresh = ask(None);
    fresh["tools"] = json!([function("get_capital")]);
    let (_, fresh) = post_json(&url(&h), &fresh, &[("x-request-id", "t-3")]).await;
    let fresh: Value = serde_json::from_slice(&fresh).unwrap();
    assert_eq!(fresh["output"][0]["type"], "function_call");

    let dir = h.stop().await;
    let db = support::journal(&dir.path().join("journal.db"));
    let decision = |id: &str| -> (String, String, String) {
        db.query_row(
            "SELECT outcome, stage, reason FROM tool_calls WHERE request_id = ?1",
            [support::round_key(&db, id)],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap()
    };
    assert_eq!(
        decision("t-2"),
        ("held".into(), "trust".into(), "untrusted_turn".into())
    );
    assert_eq!(decision("t-3").0, "executed");
    let (prev, provider_executed): (String, bool) = db
        .query_row(
            "SELECT r2.previous_response_id, r1.provider_executed FROM responses r2 JOIN responses r1 ON r1.response_id = r2.previous_response_id WHERE r2.request_id = ?1",
            [support::round_key(&db, "t-2")],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(prev, first["id"].as_str().unwrap());
    assert!(
        provider_executed,
        "the chain's first response ran web_search"
    );
}
