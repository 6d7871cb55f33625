#!/usr/bin/env python3
"""LangChain as the agent: `ChatOpenAI` (`--api openai`, Chat Completions) or `ChatAnthropic`
(`--api anthropic`) with `bind_tools`, a manual tool loop over `invoke` (non-stream) or
`stream` (chunks added up with `+`). See common.py."""

from __future__ import annotations

import common

from langchain_core.messages import HumanMessage, ToolMessage


def make_model(base: str, case: str, api: str):
    if api == "anthropic":
        from langchain_anthropic import ChatAnthropic

        return ChatAnthropic(
            model=common.model_of(case), anthropic_api_url=base, api_key="sk-ant-compat", max_retries=0,
            max_tokens=1024, timeout=60,
        )
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=common.model_of(case), base_url=base + "/v1", api_key="sk-compat", max_retries=0, timeout=60,
        stream_usage=True,
    )


def run_case(base: str, case: str, agent: common.Agent, api: str) -> str:
    llm = make_model(base, case, api).bind_tools(
        [{"type": "function", "function": t} for t in common.TOOLS_SPEC]
    )
    messages: list = [HumanMessage(common.PROMPT)]
    for _ in range(common.MAX_STEPS):
        if common.is_stream(case):
            msg = None
            for chunk in llm.stream(messages):
                msg = chunk if msg is None else msg + chunk
            if msg is None:
                raise RuntimeError("empty stream")
        else:
            msg = llm.invoke(messages)
        if not msg.tool_calls:
            return msg.text if isinstance(msg.text, str) else msg.text()
        messages.append(msg)
        for tc in msg.tool_calls:
            out = agent.run_tool(tc["name"], tc["args"])
            messages.append(ToolMessage(out, tool_call_id=tc["id"]))
    raise RuntimeError("no final answer within MAX_STEPS")


if __name__ == "__main__":
    raise SystemExit(common.main(run_case, common.CASES))
