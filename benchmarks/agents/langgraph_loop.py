"""LangGraph + langchain-openai: an agent node (tools bound with tool_choice="required", streaming) and a
ToolNode in a loop, ended after AGENT_TURNS model calls."""

from __future__ import annotations

from typing import Annotated, Literal

from common_tools import API_KEY, BASE_URL, INSTRUCTIONS, MAX_TOKENS, MODEL, TASK, TURNS, sights, weather
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from typing_extensions import TypedDict


@tool
def get_weather(city: Literal["paris", "rome", "oslo"]) -> str:
    """The weather report for a city."""
    return weather(city)


@tool
def get_sights(city: Literal["paris", "rome", "oslo"]) -> str:
    """The main sights of a city."""
    return sights(city)


class State(TypedDict):
    messages: Annotated[list, add_messages]
    calls: int


llm = ChatOpenAI(model=MODEL, base_url=BASE_URL, api_key=API_KEY, streaming=True, max_tokens=MAX_TOKENS,
                 temperature=0.0).bind_tools([get_weather, get_sights], tool_choice="required")


def agent(state: State) -> dict:
    return {"messages": [llm.invoke(state["messages"])], "calls": state["calls"] + 1}


def route(state: State) -> str:
    last = state["messages"][-1]
    return "tools" if getattr(last, "tool_calls", None) and state["calls"] < TURNS else END


graph = StateGraph(State)
graph.add_node("agent", agent)
graph.add_node("tools", ToolNode([get_weather, get_sights]))
graph.add_edge(START, "agent")
graph.add_conditional_edges("agent", route, {"tools": "tools", END: END})
graph.add_edge("tools", "agent")
app = graph.compile()
app.invoke({"messages": [SystemMessage(INSTRUCTIONS), HumanMessage(TASK)], "calls": 0},
           {"recursion_limit": 4 * TURNS + 4})
print("langgraph: done")
