#!/usr/bin/env python3
"""Streams one Anthropic Messages request through turnguard with the official SDK while a tool
call is held for approval (tests/it/trust_approvals.rs accepts it meanwhile).

    python held_stream.py --turnguard http://HOST:PORT --token JWT --run RUN --request JSON

Prints the SDK's final message as JSON: `{"text", "tool_uses": [{"name", "input"}],
"stop_reason"}`. The SDK must parse the stream, keep-alive comments included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
os.environ["no_proxy"] = os.environ["NO_PROXY"]

import anthropic  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turnguard", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--request", required=True)
    args = ap.parse_args()
    req = json.loads(args.request)
    req.pop("stream", None)
    client = anthropic.Anthropic(
        base_url=args.turnguard,
        api_key="sk-ant-test",
        max_retries=0,
        timeout=60,
        default_headers={"Turnguard-Principal-Token": args.token, "Turnguard-Run": args.run},
    )
    with client.messages.stream(**req) as stream:
        for _ in stream:
            pass
        final = stream.get_final_message()
    out = {
        "text": "".join(b.text for b in final.content if b.type == "text"),
        "tool_uses": [{"name": b.name, "input": b.input} for b in final.content if b.type == "tool_use"],
        "stop_reason": final.stop_reason,
    }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
