#!/usr/bin/env python3
"""Streams one Chat Completions request through turnguard with the official `openai` SDK and
prints what the SDK assembled (tests/it/attacks/records.rs: a recorded stream served again
without some of its calls must stay a stream the SDK parses).

    python chat_stream.py --turnguard http://HOST:PORT --run RUN --request JSON

Prints `{"tool_calls": [{"index", "id", "name", "arguments"}], "finish_reason", "text"}`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
os.environ["no_proxy"] = os.environ["NO_PROXY"]

import openai  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turnguard", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--request", required=True)
    args = ap.parse_args()
    req = json.loads(args.request)
    req.pop("stream", None)
    client = openai.OpenAI(
        base_url=args.turnguard + "/v1",
        api_key="sk-test",
        max_retries=0,
        timeout=60,
        default_headers={"Turnguard-Run": args.run},
    )
    calls: dict[int, dict] = {}
    text = ""
    finish = None
    for chunk in client.chat.completions.create(stream=True, **req):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                text += delta.content
            for tc in delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"index": tc.index, "id": None, "name": None, "arguments": ""})
                if tc.id:
                    c["id"] = tc.id
                if tc.function and tc.function.name:
                    c["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    c["arguments"] += tc.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    json.dump({"tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish, "text": text}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
