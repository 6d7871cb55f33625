#!/usr/bin/env python3
"""Streams one request through turnguard with the official SDK and reports which tool calls
the SDK assembled (tests/it/attacks/upstream_bytes.rs: what the agent would execute).

    python stream_calls.py --url http://HOST:PORT --api chat|messages --request JSON

Prints one JSON line: `{"calls": [tool names the SDK assembled], "error": "<exception type>:
<message>" or null}`. The SDK parses the stream as an agent would; an exception is what the
agent sees when turnguard ends the stream with the provider-shaped error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
os.environ["no_proxy"] = os.environ["NO_PROXY"]

import anthropic  # noqa: E402
import openai  # noqa: E402


def chat(url: str, req: dict) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=60)
    req["stream"] = True
    names: dict[int, str] = {}
    for chunk in client.chat.completions.create(**req):
        for choice in chunk.choices or []:
            for tc in (choice.delta.tool_calls or []) if choice.delta else []:
                if tc.function and tc.function.name:
                    names[tc.index] = names.get(tc.index, "") + tc.function.name
    return [names[k] for k in sorted(names)]


def messages(url: str, req: dict) -> list[str]:
    client = anthropic.Anthropic(base_url=url, api_key="sk-ant-test", max_retries=0, timeout=60)
    req.pop("stream", None)
    with client.messages.stream(**req) as stream:
        final = stream.get_final_message()
    return [b.name for b in final.content if b.type == "tool_use"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--api", choices=["chat", "messages"], required=True)
    ap.add_argument("--request", required=True)
    args = ap.parse_args()
    req = json.loads(args.request)
    calls: list[str] = []
    error = None
    try:
        calls = chat(args.url, req) if args.api == "chat" else messages(args.url, req)
    except Exception as e:  # noqa: BLE001 - the agent's view of a failed stream
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"calls": calls, "error": error}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
