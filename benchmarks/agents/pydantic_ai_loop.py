"""Pydantic AI: an Agent with two tools on an OpenAI-compatible provider; tool_choice="required" through
extra_body (the SDK merges it over the body), ended by a request limit."""

from __future__ import annotations

from typing import Literal

from common_tools import API_KEY, BASE_URL, INSTRUCTIONS, MAX_TOKENS, MODEL, TASK, TURNS, sights, weather
from pydantic_ai import Agent
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=BASE_URL, api_key=API_KEY))
agent = Agent(model, instructions=INSTRUCTIONS,
              model_settings={"max_tokens": MAX_TOKENS, "temperature": 0.0, "extra_body": {"tool_choice": "required"}})


@agent.tool_plain
def get_weather(city: Literal["paris", "rome", "oslo"]) -> str:
    """The weather report for a city."""
    return weather(city)


@agent.tool_plain
def get_sights(city: Literal["paris", "rome", "oslo"]) -> str:
    """The main sights of a city."""
    return sights(city)


try:
    agent.run_sync(TASK, usage_limits=UsageLimits(request_limit=TURNS))
except UsageLimitExceeded:
    pass
print("pydantic-ai: done")
