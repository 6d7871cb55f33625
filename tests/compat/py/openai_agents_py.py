#!/usr/bin/env python3
"""The OpenAI Agents SDK (`openai-agents`) as the agent: `Runner.run` / `Runner.run_streamed`
with two function tools, on its default Responses model (`--api responses`) or the Chat
Completions model (`--api chat`). Tracing is disabled (it would upload to the vendor). See
common.py."""

from __future__ import annotations

import asyncio

import common

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

set_tracing_disabled(True)


def make_tools(agent: common.Agent) -> list:
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return agent.run_tool("get_weather", {"city": city})

    @function_tool
    def save_note(text: str) -> str:
        """Save a note for the user."""
        return agent.run_tool("save_note", {"text": text})

    return [get_weather, save_note]


async def run(base: str, case: str, agent: common.Agent, api: str) -> str:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="sk-compat", max_retries=0, timeout=60)
    model_name = common.model_of(case)
    model = (
        OpenAIChatCompletionsModel(model=model_name, openai_client=client)
        if api == "chat"
        else OpenAIResponsesModel(model=model_name, openai_client=client)
    )
    a = Agent(name="compat", instructions="Answer with the tools.", tools=make_tools(agent), model=model)
    if common.is_stream(case):
        result = Runner.run_streamed(a, common.PROMPT, max_turns=common.MAX_STEPS)
        async for _ev in result.stream_events():
            pass
    else:
        result = await Runner.run(a, common.PROMPT, max_turns=common.MAX_STEPS)
    return str(result.final_output or "")


def run_case(base: str, case: str, agent: common.Agent, api: str) -> str:
    return asyncio.run(run(base, case, agent, api))


if __name__ == "__main__":
    raise SystemExit(common.main(run_case, common.CASES))
