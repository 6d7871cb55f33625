#!/usr/bin/env python3
"""LiteLLM's SDK as the client: `litellm.completion` with `openai/<model>` (`--api openai`,
Chat Completions) or `anthropic/<model>` (`--api anthropic`, Messages) and `api_base` set to
turnguard, a manual tool loop; streams are assembled with `litellm.stream_chunk_builder`.
LiteLLM's model-cost map is read from the package (`LITELLM_LOCAL_MODEL_COST_MAP`), never
fetched. See common.py."""

from __future__ import annotations

import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")

import common  # noqa: E402

import litellm  # noqa: E402

litellm.telemetry = False
litellm.suppress_debug_info = True


def run_case(base: str, case: str, agent: common.Agent, api: str) -> str:
    provider = "anthropic" if api == "anthropic" else "openai"
    api_base = base if provider == "anthropic" else base + "/v1"
    key = "sk-ant-compat" if provider == "anthropic" else "sk-compat"
    messages: list[dict] = [{"role": "user", "content": common.PROMPT}]
    tools = [{"type": "function", "function": t} for t in common.TOOLS_SPEC]
    for _ in range(common.MAX_STEPS):
        req = dict(
            model=f"{provider}/{common.model_of(case)}", api_base=api_base, api_key=key, messages=messages,
            tools=tools, max_tokens=1024, num_retries=0, timeout=60,
        )
        if common.is_stream(case):
            chunks = list(litellm.completion(**req, stream=True))
            resp = litellm.stream_chunk_builder(chunks, messages=messages)
        else:
            resp = litellm.completion(**req)
        msg = resp.choices[0].message
        if not msg.tool_calls:
            return msg.content or ""
        messages.append(
            {
                "role": "assistant",
                "content": msg.content,
                "tool_calls": [
                    {"id": tc.id, "type": "function",
                     "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                    for tc in msg.tool_calls
                ],
            }
        )
        for tc in msg.tool_calls:
            out = agent.run_tool(tc.function.name, tc.function.arguments)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
    raise RuntimeError("no final answer within MAX_STEPS")


if __name__ == "__main__":
    raise SystemExit(common.main(run_case, common.CASES))
