"""The official SDKs show turnguard's own errors: for each status turnguard authors (422, 403,
429, 413, 404) on the OpenAI and the Anthropic surface, the SDK's exception message carries
turnguard's message and its OpenWOP code (DESIGN.md §7). Driven by tests/it/dropin.rs, which
scripts the mock model so that each call below meets the case it names.

Usage: errors.py BASE_URL  (turnguard's data plane, http://127.0.0.1:PORT)
Prints one JSON line per case; exits non-zero on the first case that does not hold.
"""

import json
import sys

import anthropic
import openai

base = sys.argv[1]
oa = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
an = anthropic.Anthropic(base_url=base, api_key="sk-ant-test", max_retries=0)

OA_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
AN_TOOLS = [{"name": "lookup", "input_schema": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}]


def openai_call(model="gpt-4o-mini", content="hi"):
    return oa.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], tools=OA_TOOLS)


def anthropic_call(model="claude-sonnet-4-5", content="hi"):
    return an.messages.create(
        model=model, max_tokens=256, messages=[{"role": "user", "content": content}],
        tools=AN_TOOLS)


def expect(case, fn, status, code, words):
    try:
        fn()
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        text = str(e)
        got = {"case": case, "status": e.status_code, "message": text,
               "retry_after": e.response.headers.get("retry-after")}
        print(json.dumps(got), flush=True)
        assert e.status_code == status, f"{case}: status {e.status_code}, wanted {status}: {text}"
        assert code in text, f"{case}: the exception message lacks the code `{code}`: {text}"
        for w in words:
            assert w in text, f"{case}: the exception message lacks turnguard's `{w}`: {text}"
        if isinstance(e, openai.APIStatusError):
            assert e.code == code, f"{case}: openai error.code is {e.code!r}, wanted {code}"
        else:
            assert e.body["error"]["code"] == code, f"{case}: {e.body}"
        if status == 429:
            assert got["retry_after"], f"{case}: no Retry-After on a 429"
        return
    raise AssertionError(f"{case}: no error raised")


big = "x" * 4096
# Mock steps 1-2: a call to a tool the request did not declare → invalid → 422.
expect("openai 422", openai_call, 422, "envelope_invalid", ["not declared", "drop_table"])
expect("anthropic 422", anthropic_call, 422, "envelope_invalid", ["not declared", "drop_table"])
# Mock steps 3-4: a call a rule forbids (by model) → refused → 403.
expect("openai 403", lambda: openai_call(model="gpt-forbidden"), 403, "forbidden",
       ["no-drop-table"])
expect("anthropic 403", lambda: anthropic_call(model="claude-forbidden"), 403, "forbidden",
       ["no-drop-table"])
# Mock steps 5-6: two calls of one tool, its token bucket holds one → 429 with Retry-After.
expect("openai 429", openai_call, 429, "rate_limited", ["rate"])
expect("anthropic 429", anthropic_call, 429, "rate_limited", ["rate"])
# No mock step: the body is over max_body_bytes → 413.
expect("openai 413", lambda: openai_call(content=big), 413, "payload_too_large", ["byte cap", "--max-body-bytes"])
expect("anthropic 413", lambda: anthropic_call(content=big), 413, "payload_too_large",
       ["byte cap", "--max-body-bytes"])
# No mock step: paths off the allowlist → 404 in each surface's shape.
expect("openai 404", lambda: oa.files.list(), 404, "not_found", ["no route for GET /v1/files"])
expect("anthropic 404", lambda: an.messages.batches.list(), 404, "not_found",
       ["no route for GET /v1/messages/batches"])
print(json.dumps({"ok": True}), flush=True)
