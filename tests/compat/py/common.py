"""Shared by the Python clients of the compatibility suite (tests/compat/py/*.py).

Every client script is run as

    python CLIENT.py --base-url http://127.0.0.1:PORT --cases loop,loop-stream,truncated,... [--api API]

and plays one agent per case against turnguard (which the mock provider sits behind). A case
`C` uses the model name `compat-C` (the mock answers each case's requests by model name), the
two tools below, and the prompt PROMPT. For each case the script prints one line

    RESULT {"case": C, "ok": true|false, "text": "...", "calls": ["get_weather", ...], "error": "..."}

where `calls` are the tools the agent actually ran, in order, `text` is the agent's final
answer and `error` is the client's exception (type and message) when the case crashed.
tests/it/compat.rs decides pass or fail from these lines and from what the mock received;
the script never decides on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any, Callable

# The mock and turnguard listen on loopback; the suite points every proxy variable at a
# tripwire, so loopback must bypass it.
os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
os.environ["no_proxy"] = os.environ["NO_PROXY"]

PROMPT = "Look up the weather in Paris and save a note about it. Use the tools."
MAX_STEPS = 6

TOOLS_SPEC = [
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    {
        "name": "save_note",
        "description": "Save a note for the user (a write: turnguard gates it in an untrusted turn).",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "description": "The note"}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
]


def get_weather(city: str) -> str:
    return f"sunny, 21 C in {city}"


def save_note(text: str) -> str:
    return f"saved: {text}"


TOOL_FUNCS: dict[str, Callable[..., str]] = {"get_weather": get_weather, "save_note": save_note}


class Agent:
    """Records what one case's agent ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def run_tool(self, name: str, args: Any) -> str:
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        self.calls.append(name)
        fn = TOOL_FUNCS.get(name)
        if fn is None:
            return f"unknown tool {name}"
        return fn(**(args or {}))


def model_of(case: str) -> str:
    return f"compat-{case}"


def is_stream(case: str) -> bool:
    return case.endswith("-stream")


def main(run_case: Callable[[str, str, Agent, str], str], supported: set[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="turnguard's data plane, http://HOST:PORT")
    ap.add_argument("--cases", required=True, help="comma-separated case names")
    ap.add_argument("--api", default="", help="which provider API the client uses, where it has several")
    args = ap.parse_args()
    for case in args.cases.split(","):
        agent = Agent()
        out: dict[str, Any] = {"case": case, "ok": False, "text": "", "calls": agent.calls, "error": None}
        if case not in supported:
            out["error"] = "unsupported case"
        else:
            try:
                out["text"] = run_case(args.base_url.rstrip("/"), case, agent, args.api) or ""
                out["ok"] = True
            except Exception as e:  # the client crashed: that is the finding
                out["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc(file=sys.stderr)
        print("RESULT " + json.dumps(out), flush=True)
    return 0


# Every case a client script knows: a two-step tool loop, a call cut by the token limit (repaired
# by turnguard), and calls cut again and again until turnguard gives up with an error.
CASES = {"loop", "loop-stream", "truncated", "truncated-stream", "error", "error-stream"}
