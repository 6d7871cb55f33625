#!/usr/bin/env python3
"""SDK equivalence on the Responses surface: the official `openai` SDK's `client.responses`
gets the same parsed result through turnguard as from the provider directly, and a stream
whose call turnguard withholds still parses.

    python responses_equivalence.py --turnguard http://HOST:PORT --mock http://HOST:PORT \
        --fixtures DIR --own-fixtures DIR

DIR is the providers fixture directory (`shared/fixtures/providers`); the own fixtures are
turnguard's `tests/fixtures`. Cases, one output line each (`ok NAME` or `FAIL NAME: ...`):

- `openai-responses/<file>` for every response fixture (`nonstream-*.json`, `stream-*.sse`):
  the mock serves it to the SDK directly and through turnguard. Non-stream:
  `client.responses.create()`. Stream: `client.responses.stream()` (the helper's events without
  their snapshots, and `get_final_response()`), then `client.responses.create(stream=True)` (the
  raw events). The `model_dump()`s must be identical, and so must the request bodies the mock
  received. The request declares the function tools the fixture calls (schema
  `{"type": "object"}`) and the built-in tools its provider-executed items need (`web_search`,
  `mcp`); no `Turnguard-Run` header, so the `mcp` tool is allowed (a chat turn).
- `withheld:<case>`: a call turnguard withholds (an undeclared tool, arguments that fail the
  declared schema, a stream cut by `max_output_tokens`, a non-stream undeclared call). Through
  turnguard only: the SDK parses the stream (helper and raw), the final response has no client
  call and ends with a `[turnguard]` message, status `completed`; the raw events have
  consecutive `sequence_number`s from 0, every item is added at the next `output_index` before
  its events, and `response.completed.output` lists exactly the items streamed.

- `repair:stream` (only with `--repair`, against a turnguard whose bundle repairs invalid
  calls): the first round's call fails its schema, turnguard asks the model again and splices
  the second round into the agent's stream; the SDK must parse one response (helper and raw),
  with round 1's id and reasoning item, round 2's items after it, and no call.

Each proxied request carries `x-request-id: sdk-eq:<case>[#raw]`, which turnguard keeps as the
round's `client_request_id`. Exits 1 on any failure, 2 on bad arguments or missing fixtures.
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
from typing import Any, Callable

os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
os.environ["no_proxy"] = os.environ["NO_PROXY"]

import openai  # noqa: E402
from pydantic import BaseModel  # noqa: E402

# `ParsedResponse.output` is a union the SDK builds without validation, so pydantic warns while
# dumping it (the dump is still complete). SDK noise, not a finding.
warnings.filterwarnings("ignore", message="Pydantic serializer warnings")

API = "openai-responses"
PATH = "/v1/responses"
MARK = "[turnguard]"
MAX_OUTPUT_TOKENS = 4096
PERMISSIVE = {"type": "object"}
REQUEST_ID_HEADER = "x-request-id"
CLIENT_CALLS = {"function_call", "custom_tool_call", "computer_call", "local_shell_call", "shell_call", "apply_patch_call"}


class Failure(Exception):
    """A case failed; the message names the differing path."""


# ---------------------------------------------------------------------------------------------
# Fixtures


def response_fixtures(root: Path) -> list[Path]:
    d = root / API
    found = sorted(
        p
        for p in d.glob("*")
        if p.is_file()
        and ((p.name.startswith("nonstream-") and p.suffix == ".json") or (p.name.startswith("stream-") and p.suffix == ".sse"))
    )
    if not found:
        raise SystemExit(f"no response fixtures (nonstream-*.json, stream-*.sse) in {d}")
    return found


def sse_payloads(path: Path) -> list[Any]:
    out = []
    for event in path.read_text(encoding="utf-8").split("\n\n"):
        data = "\n".join(line[5:].removeprefix(" ") for line in event.split("\n") if line.startswith("data:"))
        if data:
            out.append(json.loads(data))
    return out


def fixture_shape(path: Path) -> dict[str, Any]:
    """Model, function tools called, built-in tools needed, and whether it streams."""
    stream = path.suffix == ".sse"
    shape: dict[str, Any] = {"stream": stream, "model": None, "tools": []}
    if stream:
        events = sse_payloads(path)
        responses = [e["response"] for e in events if isinstance(e.get("response"), dict)]
        items = [e["item"] for e in events if isinstance(e.get("item"), dict)]
        for r in responses:
            items.extend(r.get("output") or [])
        shape["model"] = responses[0].get("model") if responses else None
    else:
        body = json.loads(path.read_text(encoding="utf-8"))
        shape["model"] = body.get("model")
        items = body.get("output") or []
    tools: list[dict[str, Any]] = []

    def add(tool: dict[str, Any]) -> None:
        if tool not in tools:
            tools.append(tool)

    for item in items:
        kind = item.get("type")
        if kind == "function_call":
            add({"type": "function", "name": item["name"], "parameters": PERMISSIVE, "strict": False})
        elif kind == "web_search_call":
            add({"type": "web_search"})
        elif kind in ("mcp_call", "mcp_list_tools", "mcp_approval_request"):
            label = item.get("server_label")
            add({"type": "mcp", "server_label": label, "server_url": f"https://{label}.example/mcp", "require_approval": "never"})
        elif kind in CLIENT_CALLS:
            raise Failure(f"the fixture calls a `{kind}` item, which this script cannot declare")
    shape["tools"] = tools
    if not shape["model"]:
        raise Failure(f"cannot tell the model from the fixture {path.name}")
    return shape


# ---------------------------------------------------------------------------------------------
# Mock control and SDK calls


def http_json(method: str, url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def script_mock(mock: str, path: Path, times: int) -> None:
    step = {"file": path.name, "path": PATH}
    http_json("POST", f"{mock}/_mock/script", {"responses": [step] * times, "base_dir": str(path.parent.resolve())})


def mock_requests(mock: str) -> list[dict[str, Any]]:
    return http_json("GET", f"{mock}/_mock/requests")


def dump(obj: Any) -> Any:
    return obj.model_dump() if isinstance(obj, BaseModel) else obj


def event_dump(event: Any) -> Any:
    return event.model_dump(exclude={"snapshot"}) if isinstance(event, BaseModel) else event


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="sk-turnguard-test", max_retries=0, timeout=30)


def request_kwargs(shape: dict[str, Any], request_id: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": shape["model"],
        "input": "Answer, and use the tools if you need them.",
        "max_output_tokens": MAX_OUTPUT_TOKENS,
        "extra_headers": {REQUEST_ID_HEADER: request_id},
    }
    if shape["tools"]:
        kwargs["tools"] = shape["tools"]
    return kwargs


def call_create(base_url: str, shape: dict[str, Any], request_id: str) -> Any:
    return dump(client(base_url).responses.create(**request_kwargs(shape, request_id)))


def call_helper(base_url: str, shape: dict[str, Any], request_id: str) -> tuple[Any, list[Any], str | None]:
    """`responses.stream()`: its events, and its final response (or why there is none)."""
    with client(base_url).responses.stream(**request_kwargs(shape, request_id)) as stream:
        events = [event_dump(e) for e in stream]
        try:
            final, missing = dump(stream.get_final_response()), None
        except RuntimeError as e:  # no `response.completed` (an incomplete response)
            final, missing = None, str(e)
    return final, events, missing


def call_raw(base_url: str, shape: dict[str, Any], request_id: str) -> list[Any]:
    """`responses.create(stream=True)`: the raw events, as the SDK parsed them."""
    with client(base_url).responses.create(stream=True, **request_kwargs(shape, request_id)) as stream:
        return [dump(e) for e in stream]


# ---------------------------------------------------------------------------------------------
# Comparison


def short(v: Any, limit: int = 160) -> str:
    s = json.dumps(v, default=repr, ensure_ascii=False)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def diff(direct: Any, proxied: Any, path: str = "$") -> list[str]:
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


def same_upstream_requests(mock: str, before: int, expected: int) -> None:
    """The mock got `expected` requests, alternating direct and proxied, pairwise identical."""
    reqs = mock_requests(mock)[before:]
    check(len(reqs) == expected, f"mock: expected {expected} requests, got {len(reqs)}")
    for i in range(0, expected, 2):
        require(diff(reqs[i]["path"], reqs[i + 1]["path"], "request.path"), "the upstream request differs")
        require(diff(reqs[i]["body"], reqs[i + 1]["body"], "request.body"), "the upstream request differs")


def run_fixture(args: argparse.Namespace, path: Path) -> None:
    name = f"{API}/{path.name}"
    shape = fixture_shape(path)
    before = len(mock_requests(args.mock))
    if not shape["stream"]:
        script_mock(args.mock, path, 2)
        direct = call_create(args.mock, shape, f"sdk-eq-direct:{name}")
        proxied = call_create(args.turnguard, shape, f"sdk-eq:{name}")
        same_upstream_requests(args.mock, before, 2)
        require(diff(direct, proxied), "parsed response differs")
        return
    script_mock(args.mock, path, 4)
    d_final, d_events, d_missing = call_helper(args.mock, shape, f"sdk-eq-direct:{name}")
    p_final, p_events, p_missing = call_helper(args.turnguard, shape, f"sdk-eq:{name}")
    d_raw = call_raw(args.mock, shape, f"sdk-eq-direct:{name}#raw")
    p_raw = call_raw(args.turnguard, shape, f"sdk-eq:{name}#raw")
    same_upstream_requests(args.mock, before, 4)
    check(d_missing is None, f"the direct stream has no final response ({d_missing}): fixture not what this test expects")
    check(p_missing is None, f"get_final_response() through turnguard: {p_missing}")
    require(diff(d_final, p_final), "responses.stream(): final response differs")
    require(diff(d_events, p_events, "events"), "responses.stream(): helper events differ")
    require(diff(d_raw, p_raw, "raw"), "responses.create(stream=True): events differ")


# ---------------------------------------------------------------------------------------------
# Withheld calls


def check_raw_stream(events: list[dict[str, Any]]) -> None:
    """What the SDK's accumulator relies on, checked on the raw events."""
    seqs = [e.get("sequence_number") for e in events]
    check(seqs == list(range(len(events))), f"sequence_number not consecutive from 0: {seqs}")
    added: list[dict[str, Any]] = []
    terminal = None
    for i, e in enumerate(events):
        kind = e["type"]
        ix = e.get("output_index")
        if kind == "response.output_item.added":
            check(ix == len(added), f"events[{i}]: item added at output_index {ix}, expected {len(added)}")
            added.append(e["item"])
        elif ix is not None:
            check(ix < len(added), f"events[{i}] ({kind}): output_index {ix} before its item was added")
        item = e.get("item") or {}
        check(item.get("type") not in CLIENT_CALLS, f"events[{i}] ({kind}): a {item.get('type')} item reached the agent")
        check(not kind.startswith("response.function_call_arguments"), f"events[{i}]: {kind} reached the agent")
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            terminal = e
    check(terminal is not None, "no terminal event")
    check(terminal["type"] == "response.completed", f"terminal event is {terminal['type']}, expected response.completed")
    out_ids = [o.get("id") for o in terminal["response"]["output"]]
    check(out_ids == [a.get("id") for a in added], f"response.completed output {out_ids} is not the items streamed {[a.get('id') for a in added]}")


def check_final(final: dict[str, Any], direct: dict[str, Any] | None) -> None:
    calls = [o for o in final["output"] if o["type"] in CLIENT_CALLS]
    check(not calls, f"$.output: the agent got a call: {short(calls)}")
    check(final["status"] == "completed", f"$.status = {final['status']!r}, expected 'completed'")
    last = final["output"][-1] if final["output"] else {}
    text = (last.get("content") or [{}])[0].get("text", "") if last.get("type") == "message" else ""
    check(text.startswith(MARK), f"$.output[-1]: no {MARK} message: {short(last)}")
    if direct is not None:
        kept = [o for o in direct["output"] if o["type"] not in CLIENT_CALLS]
        require(diff(kept, final["output"][:-1], "$.output(without calls / [turnguard])"), "the model's other items changed")
        rest = lambda r: {k: v for k, v in r.items() if k not in ("output", "status", "incomplete_details")}  # noqa: E731
        require(diff(rest(direct), rest(final)), "the rest of the response differs")


WITHHELD: list[tuple[str, str, Callable[[dict[str, Any]], None]]] = []


def withheld_case(name: str, fixture: str) -> Callable[[Callable[[dict[str, Any]], None]], Callable[[dict[str, Any]], None]]:
    def register(tweak: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        WITHHELD.append((name, fixture, tweak))
        return tweak

    return register


@withheld_case("undeclared-tool", "shared:stream-function-call.sse")
def _undeclared(shape: dict[str, Any]) -> None:
    shape["tools"] = [{"type": "function", "name": "some_other_tool", "parameters": PERMISSIVE, "strict": False}]


@withheld_case("schema-invalid-arguments", "shared:stream-function-call.sse")
def _schema_invalid(shape: dict[str, Any]) -> None:
    schema = {"type": "object", "properties": {"result": {"type": "string"}}, "required": ["result"], "additionalProperties": False}
    shape["tools"] = [{"type": "function", "name": "final_result", "parameters": schema, "strict": True}]


@withheld_case("cut-by-max-output-tokens", "own:responses-stream-call-cut-by-max-output-tokens.sse")
def _truncated(shape: dict[str, Any]) -> None:
    pass  # the tool is declared; stage 1 (completion) withholds the call


@withheld_case("call-then-text-undeclared", "own:responses-stream-call-then-text.sse")
def _call_then_text(shape: dict[str, Any]) -> None:
    shape["tools"] = [t for t in shape["tools"] if t.get("name") != "get_weather"] or [
        {"type": "function", "name": "get_capital", "parameters": PERMISSIVE, "strict": False}
    ]


@withheld_case("nonstream-undeclared-tool", "shared:nonstream-function-call.json")
def _nonstream_undeclared(shape: dict[str, Any]) -> None:
    shape["tools"] = [{"type": "function", "name": "some_other_tool", "parameters": PERMISSIVE, "strict": False}]


def run_withheld(args: argparse.Namespace, name: str, fixture: str, tweak: Callable[[dict[str, Any]], None]) -> None:
    where, file = fixture.split(":", 1)
    path = (args.fixtures / API / file) if where == "shared" else (args.own_fixtures / file)
    shape = fixture_shape(path)
    tweak(shape)
    rid = f"sdk-eq:withheld:{name}"
    if not shape["stream"]:
        script_mock(args.mock, path, 2)
        direct = call_create(args.mock, shape, f"sdk-eq-direct:withheld:{name}")
        proxied = call_create(args.turnguard, shape, rid)
        check(any(o["type"] == "function_call" for o in direct["output"]), "the direct response has no call (fixture not what this test expects)")
        check_final(proxied, direct)
        return
    script_mock(args.mock, path, 3)
    direct, _, direct_missing = call_helper(args.mock, shape, f"sdk-eq-direct:withheld:{name}")
    final, events, missing = call_helper(args.turnguard, shape, rid)
    raw = call_raw(args.turnguard, shape, rid + "#raw")
    check(missing is None, f"get_final_response() through turnguard: {missing}")
    check(not any(str(e.get("type", "")).startswith("response.function_call_arguments") for e in events),
          "the stream helper emitted function_call_arguments events")
    check_final(final, direct)
    if direct is None:
        check(direct_missing is not None, "neither a final response nor a reason")
    check_raw_stream(raw)


def run_repair(args: argparse.Namespace) -> None:
    first = args.fixtures / API / "stream-function-call.sse"
    second = args.own_fixtures / "responses-stream-web-search-then-text.sse"
    steps = [{"file": str(p.resolve()), "path": PATH} for p in (first, second, first, second)]
    http_json("POST", f"{args.mock}/_mock/script", {"responses": steps})
    shape = fixture_shape(first)
    _schema_invalid(shape)
    final, events, missing = call_helper(args.turnguard, shape, "sdk-eq:repair:stream")
    raw = call_raw(args.turnguard, shape, "sdk-eq:repair:stream#raw")
    check(missing is None, f"get_final_response() through turnguard: {missing}")
    first_id = sse_payloads(first)[0]["response"]["id"]
    check(final["id"] == first_id, f"$.id = {final['id']!r}, expected round 1's {first_id!r}")
    types = [o["type"] for o in final["output"]]
    check(types == ["reasoning", "web_search_call", "message"], f"$.output types {types}")
    check(not any(str(e.get("type", "")).startswith("response.function_call_arguments") for e in events),
          "the stream helper emitted function_call_arguments events")
    check_raw_stream(raw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turnguard", required=True, help="turnguard data-plane base URL, http://HOST:PORT")
    ap.add_argument("--mock", required=True, help="mock provider base URL, http://HOST:PORT")
    ap.add_argument("--fixtures", required=True, type=Path, help="the providers fixture directory")
    ap.add_argument("--own-fixtures", required=True, type=Path, help="turnguard's tests/fixtures")
    ap.add_argument("--repair", action="store_true", help="run only the repair case (turnguard repairs invalid calls)")
    args = ap.parse_args()
    args.turnguard = args.turnguard.rstrip("/")
    args.mock = args.mock.rstrip("/")
    try:
        fixtures = response_fixtures(args.fixtures)
    except SystemExit as e:
        print(f"FAIL {e}", flush=True)
        return 2
    cases: list[tuple[str, Callable[[], None]]] = [(f"{API}/{p.name}", lambda p=p: run_fixture(args, p)) for p in fixtures]
    cases += [(f"withheld:{n}", lambda n=n, f=f, t=t: run_withheld(args, n, f, t)) for n, f, t in WITHHELD]
    if args.repair:
        cases = [("repair:stream", lambda: run_repair(args))]
    print(f"# openai {openai.__version__}, {len(cases)} cases", flush=True)
    failed = 0
    for name, run in cases:
        try:
            run()
        except Failure as e:
            failed += 1
            print(f"FAIL {name}: {e}", flush=True)
        except Exception as e:  # an SDK or transport error fails this case, not the run
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(file=sys.stderr)
        else:
            print(f"ok {name}", flush=True)
    print(f"# {len(cases) - failed} ok, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
