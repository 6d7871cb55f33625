//! RFC 0150 identity recipes (OpenWOP idempotency.md; `shared/reference/openwop-spec.md` §2).
//!
//! - [`semantic_request_digest`]: the semantic request digest v2, the key of a model round
//!   (`recipe: "openwop-semantic-request-v2"`, RFC 8785 JCS, SHA-256).
//! - [`logical_invocation_id`]: the activity recipe, `logicalInvocationId` of a tool call:
//!   `base64url(sha256("openwop:activity:v2\0" ‖ tenant ‖ \0 ‖ run ‖ \0 ‖ node ‖ \0 ‖ ordinal
//!   ‖ \0 ‖ providerKey))`. The attempt is never part of it.

use crate::strict_json::Lookup as _;
use crate::strict_json::RequestBody;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::model::Api;

/// Request fields that are transport or identity, not semantics (RFC 0150 §C excludes
/// timeouts, trace ids, retry counts, credential handles).
const EXCLUDED: &[&str] = &[
    "user",
    "metadata",
    "service_tier",
    "store",
    "prompt_cache_key",
    "safety_identifier",
];

/// Fields that carry the semantics of a round; everything else goes to `providerOptions`
/// (dropping unknown options would be non-conformant).
const SEMANTIC: &[&str] = &[
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "response_format",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stop_sequences",
    "seed",
    "parallel_tool_calls",
    "stream",
];

/// SHA-256 (hex) of the RFC 8785 form of the semantic request: provider, model, messages,
/// tools (sorted by name: tool order is irrelevant), tool choice, response format, sampling,
/// output bound, stop, seed, and every other option under `providerOptions`. Message order
/// is significant.
pub fn semantic_request_digest(api: Api, body: &RequestBody) -> String {
    use crate::jcs::View;
    use crate::strict_json::Member;
    // A borrowed view of the request: nothing is cloned (a long transcript is hashed where
    // it lies, the declared tools where the cache keeps them).
    let members = body.members();
    // Sized once: every member goes to one list or the other (growing them by pushes was
    // ~1k instructions a request under callgrind, issue 13).
    let mut semantic: Vec<(&str, View<'_>)> = Vec::with_capacity(members.len() + 3);
    semantic.push(("recipe", View::Str("openwop-semantic-request-v2")));
    semantic.push(("provider", View::Str(api.as_str())));
    let mut options: Vec<(&str, View<'_>)> = Vec::with_capacity(members.len());
    for (k, v) in members {
        if EXCLUDED.contains(&k) {
            continue;
        }
        if k == "tools" {
            // Shared tools (the request path's) are canonicalized once and kept with their
            // tree: an agent's unchanged tools are not written again every turn.
            let mut tools: Vec<(&Value, View<'_>)> = match v {
                Member::Tools(list) => list
                    .iter()
                    .map(|t| (t.tree(), View::Canonical(t.canonical(crate::jcs::to_vec))))
                    .collect(),
                Member::Value(v) => v
                    .as_array()
                    .map(|a| a.iter().map(|t| (t, View::Value(t))).collect())
                    .unwrap_or_default(),
            };
            tools.sort_by_cached_key(|(t, _)| tool_name(t));
            semantic.push((
                "tools",
                View::Array(tools.into_iter().map(|(_, view)| view).collect()),
            ));
        } else if let Member::Value(v) = v {
            if SEMANTIC.contains(&k) {
                semantic.push((k, View::Value(v)));
            } else {
                options.push((k, View::Value(v)));
            }
        }
    }
    semantic.push(("providerOptions", View::Object(options)));
    hex::encode(Sha256::digest(crate::jcs::view_to_vec(&View::Object(
        semantic,
    ))))
}

fn tool_name(t: &Value) -> &str {
    t.at("/function/name")
        .or_else(|| t.get("name"))
        .and_then(Value::as_str)
        .unwrap_or_default()
}

/// `logicalInvocationId` by the RFC 0150 §B activity recipe (unpadded base64url).
pub fn logical_invocation_id(
    tenant: &str,
    run: &str,
    node: &str,
    ordinal: u64,
    provider_key: &str,
) -> String {
    let mut h = Sha256::new();
    h.update(b"openwop:activity:v2\0");
    for part in [tenant, run, node] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.update(ordinal.to_string().as_bytes());
    h.update([0]);
    h.update(provider_key.as_bytes());
    base64url(&h.finalize())
}

/// The OpenWOP `runId` (tenant-bound, `<tenantId>/<opaque 16–128>`, ids.schema.json) of a
/// `Turnguard-Run` value: the value itself when it already has that form, else
/// `<tenant>/<base64url(SHA-256(value))>`.
pub fn openwop_run_id(tenant: &str, run: &str) -> String {
    let ok = |s: &str, min: usize| {
        (min..=128).contains(&s.len())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '~' | '-'))
    };
    if let Some((t, opaque)) = run.split_once('/') {
        if ok(t.strip_prefix("anon:").unwrap_or(t), 1) && ok(opaque, 16) {
            return run.to_owned();
        }
    }
    format!("{tenant}/{}", base64url(&Sha256::digest(run.as_bytes())))
}

/// Unpadded base64url (RFC 4648 §5), by the `base64` crate's URL-safe alphabet without
/// padding.
pub fn base64url(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Map};

    /// The digest as first written (a cloned tree through `serde_jcs`): the borrowed view
    /// must give the same bytes, or journaled recovery keys would stop matching.
    fn digest_by_clone(api: Api, body: &Value) -> String {
        let mut semantic = Map::new();
        semantic.insert("recipe".into(), json!("openwop-semantic-request-v2"));
        semantic.insert("provider".into(), json!(api.as_str()));
        let mut options = Map::new();
        for (k, v) in body.as_object().into_iter().flatten() {
            if EXCLUDED.contains(&k.as_str()) {
                continue;
            }
            if k == "tools" {
                let mut tools = v.as_array().cloned().unwrap_or_default();
                tools.sort_by_key(|t| tool_name(t).to_owned());
                semantic.insert("tools".into(), Value::Array(tools));
            } else if SEMANTIC.contains(&k.as_str()) {
                semantic.insert(k.clone(), v.clone());
            } else {
                options.insert(k.clone(), v.clone());
            }
        }
        semantic.insert("providerOptions".into(), Value::Object(options));
        hex::encode(Sha256::digest(
            serde_jcs::to_vec(&Value::Object(semantic)).unwrap(),
        ))
    }

    /// The digest of a body held as one tree.
    fn digest(api: Api, body: &Value) -> String {
        semantic_request_digest(api, &RequestBody::from(body.clone()))
    }

    #[test]
    fn the_borrowed_digest_is_the_cloned_digest() {
        for (api, body) in [
            (
                Api::OpenAiChat,
                json!({"model": "m", "messages": [{"role": "user", "content": "h\u{e9}\n"}],
                "tools": [{"type": "function", "function": {"name": "b"}}, {"type": "function", "function": {"name": "a", "parameters": {"z": 1, "a": 1.5}}}, {"function": {"name": "a"}, "x": 1}],
                "user": "u", "metadata": {"k": 1}, "stream": true, "logprobs": true, "n": 2}),
            ),
            (
                Api::AnthropicMessages,
                json!({"model": "c", "system": "s", "max_tokens": 10, "messages": [], "tools": {"not": "an array"}, "thinking": {"type": "enabled"}}),
            ),
            (
                Api::OpenAiResponses,
                json!({"model": "g", "input": "x", "tools": [{"type": "function", "name": "t"}, {"type": "web_search"}], "store": true, "\u{1f600}": 1, "\u{e000}": 2}),
            ),
            (Api::OpenAiChat, json!([1, 2])),
        ] {
            assert_eq!(digest(api, &body), digest_by_clone(api, &body), "{body}");
            // Read as the proxy reads it, its tools shared from the cache (first read, then
            // taken from the cache): the same digest.
            let cache = crate::strict_json::ValueCache::new(1 << 20);
            let text = body.to_string();
            for round in ["first", "cached"] {
                let read = crate::strict_json::request_from_slice(text.as_bytes(), &cache).unwrap();
                assert_eq!(
                    semantic_request_digest(api, &read),
                    digest_by_clone(api, &body),
                    "{round} read of {body}"
                );
            }
        }
    }
    use super::*;

    #[test]
    fn digest_ignores_tool_order_but_not_message_order_or_seed() {
        let a = json!({"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "tools": [{"type": "function", "function": {"name": "x"}}, {"type": "function", "function": {"name": "y"}}], "seed": 1});
        let mut b = a.clone();
        b["tools"] = json!([{"type": "function", "function": {"name": "y"}}, {"type": "function", "function": {"name": "x"}}]);
        assert_eq!(digest(Api::OpenAiChat, &a), digest(Api::OpenAiChat, &b));
        let mut c = a.clone();
        c["messages"] = json!([{"role": "user", "content": "b"}, {"role": "user", "content": "a"}]);
        assert_ne!(digest(Api::OpenAiChat, &a), digest(Api::OpenAiChat, &c));
        let mut d = a.clone();
        d["seed"] = json!(2);
        assert_ne!(digest(Api::OpenAiChat, &a), digest(Api::OpenAiChat, &d));
        let mut e = a.clone();
        e["vendor_knob"] = json!(true);
        assert_ne!(
            digest(Api::OpenAiChat, &a),
            digest(Api::OpenAiChat, &e),
            "unknown options count"
        );
        let mut f = a.clone();
        f["user"] = json!("someone");
        assert_eq!(digest(Api::OpenAiChat, &a), digest(Api::OpenAiChat, &f));
    }

    #[test]
    fn activity_ids_exclude_the_attempt_and_separate_ordinals() {
        let one = logical_invocation_id("t", "run", "node", 0, "charge");
        assert_eq!(one, logical_invocation_id("t", "run", "node", 0, "charge"));
        assert_ne!(one, logical_invocation_id("t", "run", "node", 1, "charge"));
        assert_eq!(one.len(), 43);
        assert_eq!(base64url(b"\xfb\xff"), "-_8");
        assert_eq!(
            openwop_run_id("t", "acme/0123456789abcdef"),
            "acme/0123456789abcdef"
        );
        assert!(
            openwop_run_id("t", "run-1").starts_with("t/")
                && openwop_run_id("t", "run-1").len() == 45
        );
    }
}
