#!/usr/bin/env python3
"""openai-python as the agent: a manual tool loop on Chat Completions (`--api chat`) or the
Responses API (`--api responses`), non-stream (`create`) and stream (the SDK's `stream()`
helpers, which assemble the events themselves). See common.py for the protocol."""

from __future__ import annotations

import json

import common

import openai


def chat_tools() -> list[dict]:
    return [{"type": "function", "function": t} for t in common.TOOLS_SPEC]


def responses_tools() -> list[dict]:
    return [{"type": "function", **t} for t in common.TOOLS_SPEC]


def run_chat(client: openai.OpenAI, case: str, agent: common.Agent) -> str:
    messages: list[dict] = [{"role": "user", "content": common.PROMPT}]
    for _ in range(common.MAX_STEPS):
        req = dict(model=common.model_of(case), messages=messages, tools=chat_tools())
        if common.is_stream(case):
            with client.chat.completions.stream(**req, stream_options={"include_usage": True}) as s:
                for _ev in s:
                    pass
                msg = s.get_final_completion().choices[0].message
        else:
            msg = client.chat.completions.create(**req).choices[0].message
        if not msg.tool_calls:
            return msg.content or ""
        messages.append(msg.model_dump(exclude_none=True))
        for tc in msg.tool_calls:
            out = agent.run_tool(tc.function.name, tc.function.arguments)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
    raise RuntimeError("no final answer within MAX_STEPS")


def run_responses(client: openai.OpenAI, case: str, agent: common.Agent) -> str:
    items: list = [{"role": "user", "content": common.PROMPT}]
    for _ in range(common.MAX_STEPS):
        req = dict(model=common.model_of(case), input=items, tools=responses_tools(), store=False)
        if common.is_stream(case):
            with client.responses.stream(**req) as s:
                for _ev in s:
                    pass
                resp = s.get_final_response()
        else:
            resp = client.responses.create(**req)
        calls = [o for o in resp.output if o.type == "function_call"]
        if not calls:
            return resp.output_text
        for o in resp.output:
            items.append(o.model_dump(exclude_none=True))
        for c in calls:
            out = agent.run_tool(c.name, c.arguments)
            items.append({"type": "function_call_output", "call_id": c.call_id, "output": out})
    raise RuntimeError("no final answer within MAX_STEPS")


def run_case(base: str, case: str, agent: common.Agent, api: str) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="sk-compat", max_retries=0, timeout=60)
    return run_responses(client, case, agent) if api == "responses" else run_chat(client, case, agent)


if __name__ == "__main__":
    raise SystemExit(common.main(run_case, common.CASES))
