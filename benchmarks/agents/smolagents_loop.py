"""smolagents: a ToolCallingAgent (it asks for tool_choice="required" itself) on an OpenAI-compatible server."""

from __future__ import annotations

from common_tools import API_KEY, BASE_URL, MAX_TOKENS, MODEL, TASK, TURNS, sights, weather
from smolagents import OpenAIServerModel, Tool, ToolCallingAgent


class Weather(Tool):
    name = "get_weather"
    description = "The weather report for a city."
    inputs = {"city": {"type": "string", "description": "paris, rome or oslo", "enum": ["paris", "rome", "oslo"]}}
    output_type = "string"

    def forward(self, city: str) -> str:
        return weather(city)


class Sights(Tool):
    name = "get_sights"
    description = "The main sights of a city."
    inputs = {"city": {"type": "string", "description": "paris, rome or oslo", "enum": ["paris", "rome", "oslo"]}}
    output_type = "string"

    def forward(self, city: str) -> str:
        return sights(city)


model = OpenAIServerModel(model_id=MODEL, api_base=BASE_URL, api_key=API_KEY, max_tokens=MAX_TOKENS, temperature=0.0)
agent = ToolCallingAgent(tools=[Weather(), Sights()], model=model, max_steps=TURNS, verbosity_level=0)
try:
    agent.run(TASK)
except Exception as exc:  # an untrained model's answers may not satisfy smolagents' own checks
    print(f"smolagents: stopped ({exc.__class__.__name__})")
print("smolagents: done")
