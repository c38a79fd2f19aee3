"""openai-agents (OpenAI Agents SDK): a streamed tool-calling loop, tool_choice="required" every turn."""

from __future__ import annotations

import asyncio
from typing import Literal

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from common_tools import API_KEY, BASE_URL, INSTRUCTIONS, MAX_TOKENS, MODEL, TASK, TURNS, sights, weather
from openai import AsyncOpenAI

City = Literal["paris", "rome", "oslo"]


@function_tool
def get_weather(city: City) -> str:
    """The weather report for a city."""
    return weather(city)


@function_tool
def get_sights(city: City) -> str:
    """The main sights of a city."""
    return sights(city)


async def main() -> None:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=BASE_URL, api_key=API_KEY)
    agent = Agent(name="travel", instructions=INSTRUCTIONS, tools=[get_weather, get_sights],
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS, temperature=0.0),
                  reset_tool_choice=False)
    try:
        result = Runner.run_streamed(agent, TASK, max_turns=TURNS)
        async for _ in result.stream_events():
            pass
    except MaxTurnsExceeded:
        pass
    print("openai-agents: done")


asyncio.run(main())
