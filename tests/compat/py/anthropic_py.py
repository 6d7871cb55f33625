#!/usr/bin/env python3
"""anthropic-python as the agent: a manual tool loop on the Messages API, non-stream
(`messages.create`) and stream (the SDK's `messages.stream()` helper). See common.py."""

from __future__ import annotations

import common

import anthropic


def tools() -> list[dict]:
    return [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in common.TOOLS_SPEC]


def run_case(base: str, case: str, agent: common.Agent, api: str) -> str:
    client = anthropic.Anthropic(base_url=base, api_key="sk-ant-compat", max_retries=0, timeout=60)
    messages: list[dict] = [{"role": "user", "content": common.PROMPT}]
    for _ in range(common.MAX_STEPS):
        req = dict(model=common.model_of(case), max_tokens=1024, messages=messages, tools=tools())
        if common.is_stream(case):
            with client.messages.stream(**req) as s:
                for _ev in s:
                    pass
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**req)
        uses = [b for b in msg.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in msg.content if b.type == "text")
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        results = [
            {"type": "tool_result", "tool_use_id": u.id, "content": agent.run_tool(u.name, u.input)} for u in uses
        ]
        messages.append({"role": "user", "content": results})
    raise RuntimeError("no final answer within MAX_STEPS")


if __name__ == "__main__":
    raise SystemExit(common.main(run_case, common.CASES))
