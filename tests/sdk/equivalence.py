#!/usr/bin/env python3
"""SDK equivalence: the official `openai` / `anthropic` SDKs get the same parsed result through
turnguard as they get from the provider directly.

    python equivalence.py --turnguard http://HOST:PORT --mock http://HOST:PORT --fixtures DIR

DIR is the providers fixture directory (`shared/fixtures/providers`). Every response fixture in
`openai-chat/` and `anthropic-messages/` (`nonstream-*.json`, `stream-*.sse`; `request-*.json`
are requests and are skipped) is served twice by the mock provider: once to the SDK calling the
mock directly, once to the same SDK calling through turnguard. The request is built from the
fixture (model, the tools it calls declared with the permissive schema `{"type": "object"}`,
`stream` and `include_usage` for streams, `max_tokens` high enough not to read a clean fixture
as truncated). The two `model_dump()`s must be identical field by field, and for streams so must
the events the SDK's stream helper emitted. Truncated fixtures are the exception: through
turnguard the agent must get no tool call, a `[turnguard]` text and a normal stop, and otherwise
the same message (id, model, usage, ...).

Each proxied request carries `x-request-id: sdk-eq:<api>/<file>`, which turnguard keeps as the
round's `client_request_id` (the journal's keys are its own), so the caller can find each
fixture's round.

Prints `ok <api>/<file>` or `FAIL <api>/<file>: <path>: <difference>` per fixture and exits 1 on
any failure (2 when no fixture is found or the arguments are wrong).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import urllib.request
import warnings
from pathlib import Path
from typing import Any, Literal

# The mock and turnguard listen on loopback; never send those requests through a proxy.
os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
os.environ["no_proxy"] = os.environ["NO_PROXY"]

import anthropic  # noqa: E402
import openai  # noqa: E402
from pydantic import BaseModel  # noqa: E402

# `chat.completions.parse()` builds an unparametrized `ParsedChatCompletion`, so pydantic warns
# while dumping `message.parsed` (it still dumps it as a dict). SDK noise, not a finding.
warnings.filterwarnings("ignore", message="Pydantic serializer warnings")

APIS = ("openai-chat", "anthropic-messages")
PATHS = {"openai-chat": "/v1/chat/completions", "anthropic-messages": "/v1/messages"}
# Fixtures whose completion was cut by the token limit while a tool call was open: through
# turnguard the call is withheld (admission stage 1, completion).
TRUNCATED = {
    "openai-chat/stream-tool-call-cut-by-length.sse",
    "anthropic-messages/stream-max-tokens-mid-tool-use.sse",
}
MARK = "[turnguard]"
MAX_TOKENS = 4096
PERMISSIVE = {"type": "object"}
# Anthropic server tools, declared by type (turnguard does not admit them: they run at the provider).
SERVER_TOOLS = {
    "web_search": {"type": "web_search_20250305", "name": "web_search"},
    "web_fetch": {"type": "web_fetch_20250910", "name": "web_fetch"},
}
REQUEST_ID_HEADER = "x-request-id"


class Location(BaseModel):
    """The `response_format` of openai-python's `test_parse_pydantic_model` (the structured-output
    and refusal fixtures were recorded with `chat.completions.parse(response_format=Location)`)."""

    city: str
    temperature: float
    units: Literal["c", "f"]


class Failure(Exception):
    """A fixture's comparison failed; the message names the differing path."""


# ---------------------------------------------------------------------------------------------
# Fixtures


def response_fixtures(root: Path) -> list[tuple[str, Path]]:
    """`(api, file)` for every response fixture, sorted; fails when an API directory has none."""
    out: list[tuple[str, Path]] = []
    for api in APIS:
        d = root / api
        found = sorted(
            p
            for p in d.glob("*")
            if p.is_file()
            and ((p.name.startswith("nonstream-") and p.suffix == ".json") or (p.name.startswith("stream-") and p.suffix == ".sse"))
        )
        if not found:
            raise SystemExit(f"no response fixtures (nonstream-*.json, stream-*.sse) in {d}")
        out.extend((api, p) for p in found)
    return out


def sse_payloads(path: Path) -> list[Any]:
    """The JSON `data:` payloads of an `.sse` fixture (`[DONE]` and non-JSON data are skipped)."""
    out = []
    for event in path.read_text(encoding="utf-8").split("\n\n"):
        data = "\n".join(line[5:].removeprefix(" ") for line in event.split("\n") if line.startswith("data:"))
        if not data or data.strip() == "[DONE]":
            continue
        try:
            out.append(json.loads(data))
        except json.JSONDecodeError:
            pass
    return out


def fixture_shape(api: str, path: Path) -> dict[str, Any]:
    """What the request must fit: model, tool names called, server tools, stream, structured."""
    stream = path.suffix == ".sse"
    shape: dict[str, Any] = {"stream": stream, "model": None, "tools": [], "server_tools": [], "structured": None}

    def add(key: str, name: str | None) -> None:
        if name and name not in shape[key]:
            shape[key].append(name)

    if api == "openai-chat":
        if stream:
            for chunk in sse_payloads(path):
                shape["model"] = shape["model"] or chunk.get("model")
                for choice in chunk.get("choices") or []:
                    for tc in (choice.get("delta") or {}).get("tool_calls") or []:
                        add("tools", (tc.get("function") or {}).get("name"))
        else:
            body = json.loads(path.read_text(encoding="utf-8"))
            shape["model"] = body.get("model")
            for choice in body.get("choices") or []:
                message = choice.get("message") or {}
                for tc in message.get("tool_calls") or []:
                    add("tools", (tc.get("function") or {}).get("name"))
                if not message.get("tool_calls"):
                    shape["structured"] = structured_format(message)
    else:
        if stream:
            blocks = []
            for ev in sse_payloads(path):
                if ev.get("type") == "message_start":
                    shape["model"] = (ev.get("message") or {}).get("model")
                elif ev.get("type") == "content_block_start":
                    blocks.append(ev.get("content_block") or {})
        else:
            body = json.loads(path.read_text(encoding="utf-8"))
            shape["model"] = body.get("model")
            blocks = body.get("content") or []
        for b in blocks:
            if b.get("type") == "tool_use":
                add("tools", b.get("name"))
            elif b.get("type") == "server_tool_use":
                add("server_tools", b.get("name"))
    if not shape["model"]:
        raise Failure(f"cannot tell the model from the fixture {path.name}")
    return shape


def structured_format(message: dict[str, Any]) -> Any:
    """The `response_format` a non-stream Chat fixture was recorded with, if it was structured
    output: `Location` when the content is a Location object or the message is a refusal (both
    fixtures come from `chat.completions.parse(response_format=Location)`), else a strict
    json_schema derived from the content object."""
    if message.get("refusal"):
        return Location
    content = message.get("content")
    if not isinstance(content, str):
        return None
    try:
        obj = json.loads(content)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    if set(obj) == set(Location.model_fields):
        return Location
    kinds = {str: "string", bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}
    schema = {
        "type": "object",
        "properties": {k: {"type": kinds.get(type(v), "string")} for k, v in obj.items()},
        "required": list(obj),
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "Structured", "schema": schema, "strict": True}}


# ---------------------------------------------------------------------------------------------
# Mock control


def http_json(method: str, url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def script_mock(mock: str, api: str, path: Path) -> None:
    step = {"file": path.name, "path": PATHS[api]}
    http_json("POST", f"{mock}/_mock/script", {"responses": [step, step], "base_dir": str(path.parent.resolve())})


def mock_requests(mock: str) -> list[dict[str, Any]]:
    return http_json("GET", f"{mock}/_mock/requests")


# ---------------------------------------------------------------------------------------------
# SDK calls


def dump(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump()
    return obj


def event_dump(event: Any) -> Any:
    """A stream-helper event without its running snapshot (the final result is compared apart)."""
    if isinstance(event, BaseModel):
        return event.model_dump(exclude={"snapshot"})
    return event


def call_openai(base_url: str, shape: dict[str, Any], request_id: str) -> tuple[Any, list[Any] | None]:
    """The SDK's parsed result and, for a stream, the events its helper emitted."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-turnguard-test", max_retries=0, timeout=30)
    kwargs: dict[str, Any] = {
        "model": shape["model"],
        "messages": [{"role": "user", "content": "Answer, and use the tools if you need them."}],
        "max_tokens": MAX_TOKENS,
        "extra_headers": {REQUEST_ID_HEADER: request_id},
    }
    if shape["tools"]:
        kwargs["tools"] = [{"type": "function", "function": {"name": n, "parameters": PERMISSIVE}} for n in shape["tools"]]
    if shape["stream"]:
        if shape["structured"] is not None:
            kwargs["response_format"] = shape["structured"]
        kwargs["stream_options"] = {"include_usage": True}
        with client.chat.completions.stream(**kwargs) as stream:
            events = [event_dump(e) for e in stream]
            try:
                final = stream.get_final_completion()
            except openai.LengthFinishReasonError as e:
                # The SDK refuses to "parse" a completion cut by the token limit; its accumulated
                # completion rides on the exception.
                final = e.completion
        return dump(final), events
    if isinstance(shape["structured"], type):
        return dump(client.chat.completions.parse(response_format=shape["structured"], **kwargs)), None
    if shape["structured"] is not None:
        kwargs["response_format"] = shape["structured"]
    return dump(client.chat.completions.create(**kwargs)), None


def call_anthropic(base_url: str, shape: dict[str, Any], request_id: str) -> tuple[Any, list[Any] | None]:
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-ant-turnguard-test", max_retries=0, timeout=30)
    tools: list[dict[str, Any]] = [{"name": n, "input_schema": PERMISSIVE} for n in shape["tools"]]
    for n in shape["server_tools"]:
        if n not in SERVER_TOOLS:
            raise Failure(f"the fixture calls server tool `{n}`, which this script cannot declare")
        tools.append(SERVER_TOOLS[n])
    kwargs: dict[str, Any] = {
        "model": shape["model"],
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": "Answer, and use the tools if you need them."}],
        "extra_headers": {REQUEST_ID_HEADER: request_id},
    }
    if tools:
        kwargs["tools"] = tools
    if shape["stream"]:
        with client.messages.stream(**kwargs) as stream:
            events = [event_dump(e) for e in stream]
            final = stream.get_final_message()
        return dump(final), events
    return dump(client.messages.create(**kwargs)), None


# ---------------------------------------------------------------------------------------------
# Comparison


def short(v: Any, limit: int = 160) -> str:
    s = json.dumps(v, default=repr, ensure_ascii=False) if not isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def diff(direct: Any, proxied: Any, path: str = "$") -> list[str]:
    """Every differing path, as `path: direct=… proxied=…`."""
    if isinstance(direct, dict) and isinstance(proxied, dict):
        out = []
        for k in list(direct) + [k for k in proxied if k not in direct]:
            p = f"{path}.{k}"
            if k not in proxied:
                out.append(f"{p}: direct={short(direct[k])} proxied=<missing>")
            elif k not in direct:
                out.append(f"{p}: direct=<missing> proxied={short(proxied[k])}")
            else:
                out.extend(diff(direct[k], proxied[k], p))
        return out
    if isinstance(direct, list) and isinstance(proxied, list):
        out = []
        if len(direct) != len(proxied):
            out.append(f"{path}: length direct={len(direct)} proxied={len(proxied)}")
        for i, (a, b) in enumerate(zip(direct, proxied)):
            out.extend(diff(a, b, f"{path}[{i}]"))
        return out
    if type(direct) is not type(proxied) or direct != proxied:
        return [f"{path}: direct={short(direct)} proxied={short(proxied)}"]
    return []


def require(diffs: list[str], what: str) -> None:
    if diffs:
        more = f" (+{len(diffs) - 5} more)" if len(diffs) > 5 else ""
        raise Failure(f"{what}: " + "; ".join(diffs[:5]) + more)


def check(cond: bool, message: str) -> None:
    if not cond:
        raise Failure(message)


def compare_truncated_chat(direct: dict[str, Any], proxied: dict[str, Any]) -> None:
    """Through turnguard: no tool call, a `[turnguard]` text, `finish_reason: stop`; the rest as is."""
    check(len(direct["choices"]) == len(proxied["choices"]),
          f"$.choices: length direct={len(direct['choices'])} proxied={len(proxied['choices'])}")
    check(any(c["message"].get("tool_calls") for c in direct["choices"]),
          "$.choices[*].message.tool_calls: the direct result has no tool call (fixture not what this test expects)")
    check(any(c["finish_reason"] == "length" for c in direct["choices"]),
          "$.choices[*].finish_reason: the direct result is not cut by length (fixture not what this test expects)")
    strip = lambda d: {  # noqa: E731
        **d,
        "choices": [
            {**c, "finish_reason": None, "message": {k: v for k, v in c["message"].items() if k not in ("content", "tool_calls")}}
            for c in d["choices"]
        ],
    }
    for i, (dc, pc) in enumerate(zip(direct["choices"], proxied["choices"])):
        p = f"$.choices[{i}]"
        if not dc["message"].get("tool_calls"):
            require(diff(dc, pc, p), "a choice without calls changed")
            continue
        check(not pc["message"].get("tool_calls"),
              f"{p}.message.tool_calls: the agent got a tool call from a truncated completion: {short(pc['message'].get('tool_calls'))}")
        check(pc["finish_reason"] == "stop", f"{p}.finish_reason: direct={short(dc['finish_reason'])} proxied={short(pc['finish_reason'])}, expected \"stop\"")
        content = pc["message"].get("content") or ""
        check(MARK in content, f"{p}.message.content: no {MARK} text: {short(content)}")
        before = dc["message"].get("content") or ""
        check(content.startswith(before), f"{p}.message.content: the model's text was not kept: direct={short(before)} proxied={short(content)}")
    require(diff(strip(direct), strip(proxied)), "the rest of the completion differs")


def compare_truncated_messages(direct: dict[str, Any], proxied: dict[str, Any]) -> None:
    """Through turnguard: no tool_use block, a `[turnguard]` text block, `stop_reason: end_turn`;
    every other block and field as is."""
    check(any(b["type"] == "tool_use" for b in direct["content"]),
          "$.content: the direct result has no tool_use block (fixture not what this test expects)")
    check(direct["stop_reason"] == "max_tokens",
          f"$.stop_reason: direct={short(direct['stop_reason'])}, expected \"max_tokens\" (fixture not what this test expects)")
    uses = [i for i, b in enumerate(proxied["content"]) if b["type"] == "tool_use"]
    check(not uses, f"$.content[{uses[0] if uses else 0}]: the agent got a tool_use block from a truncated message")
    check(proxied["stop_reason"] == "end_turn",
          f"$.stop_reason: direct={short(direct['stop_reason'])} proxied={short(proxied['stop_reason'])}, expected \"end_turn\"")
    marks = [b for b in proxied["content"] if b["type"] == "text" and b["text"].startswith(MARK)]
    check(len(marks) == 1, f"$.content: expected one text block starting with {MARK}, got {len(marks)}")
    kept_direct = [b for b in direct["content"] if b["type"] != "tool_use"]
    kept_proxied = [b for b in proxied["content"] if not (b["type"] == "text" and b["text"].startswith(MARK))]
    require(diff(kept_direct, kept_proxied, "$.content(without tool_use / [turnguard])"), "the model's other blocks changed")
    rest = lambda m: {k: v for k, v in m.items() if k not in ("content", "stop_reason")}  # noqa: E731
    require(diff(rest(direct), rest(proxied)), "the rest of the message differs")


def compare_truncated_events(api: str, events: list[Any]) -> None:
    """The agent's stream helper must never have seen a tool call."""
    for i, e in enumerate(events):
        kind = e.get("type") if isinstance(e, dict) else None
        if api == "openai-chat":
            check(not str(kind).startswith("tool_calls."), f"events[{i}]: the stream helper emitted {kind}")
            if kind == "chunk":
                for c in e["chunk"]["choices"]:
                    check(not (c.get("delta") or {}).get("tool_calls"), f"events[{i}].chunk: a tool_calls delta reached the agent")
        else:
            check(kind != "input_json", f"events[{i}]: the stream helper emitted input_json")
            if kind == "content_block_start":
                check(e["content_block"]["type"] != "tool_use", f"events[{i}]: a tool_use block reached the agent")


def run_fixture(args: argparse.Namespace, api: str, path: Path) -> None:
    name = f"{api}/{path.name}"
    shape = fixture_shape(api, path)
    call = call_openai if api == "openai-chat" else call_anthropic
    before = len(mock_requests(args.mock))
    script_mock(args.mock, api, path)
    direct, direct_events = call(args.mock, shape, f"sdk-eq-direct:{name}")
    proxied, proxied_events = call(args.turnguard, shape, f"sdk-eq:{name}")

    # Both calls reached the mock, on the API's path, with the same request body.
    reqs = mock_requests(args.mock)[before:]
    check(len(reqs) == 2, f"mock: expected 2 requests (direct, proxied), got {len(reqs)}: {short([r.get('path') for r in reqs])}")
    require(diff(reqs[0]["path"], reqs[1]["path"], "request.path"), "the upstream request differs")
    require(diff(reqs[0]["body"], reqs[1]["body"], "request.body"), "the upstream request differs")

    if name in TRUNCATED:
        (compare_truncated_chat if api == "openai-chat" else compare_truncated_messages)(direct, proxied)
        compare_truncated_events(api, proxied_events or [])
        return
    if shape["structured"] is Location:
        for i, c in enumerate(direct["choices"]):
            if not c["message"].get("refusal"):
                check(c["message"].get("parsed") is not None, f"$.choices[{i}].message.parsed: the SDK did not parse the structured output")
    require(diff(direct, proxied), "parsed result differs")
    if shape["stream"]:
        require(diff(direct_events, proxied_events, "events"), "stream helper events differ")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turnguard", required=True, help="turnguard data-plane base URL, http://HOST:PORT")
    ap.add_argument("--mock", required=True, help="mock provider base URL, http://HOST:PORT")
    ap.add_argument("--fixtures", required=True, type=Path, help="the providers fixture directory")
    args = ap.parse_args()
    args.turnguard = args.turnguard.rstrip("/")
    args.mock = args.mock.rstrip("/")

    try:
        fixtures = response_fixtures(args.fixtures)
    except SystemExit as e:
        print(f"FAIL {e}", flush=True)
        return 2
    print(f"# openai {openai.__version__}, anthropic {anthropic.__version__}, {len(fixtures)} fixtures", flush=True)
    failed = 0
    for api, path in fixtures:
        name = f"{api}/{path.name}"
        try:
            run_fixture(args, api, path)
        except Failure as e:
            failed += 1
            print(f"FAIL {name}: {e}", flush=True)
        except Exception as e:  # an SDK or transport error is a failure of this fixture, not of the run
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(file=sys.stderr)
        else:
            print(f"ok {name}", flush=True)
    print(f"# {len(fixtures) - failed} ok, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
