"""Tools and prompts every framework script uses (runs in the separate agents venv, not kvscope's)."""

from __future__ import annotations

import os

BASE_URL = os.environ["OPENAI_BASE_URL"]
MODEL = os.environ.get("AGENT_MODEL", "tiny")
API_KEY = os.environ.get("OPENAI_API_KEY", "sk-dummy")
TURNS = int(os.environ.get("AGENT_TURNS", "4"))
MAX_TOKENS = int(os.environ.get("AGENT_MAX_TOKENS", "48"))
CITIES = ("paris", "rome", "oslo")
INSTRUCTIONS = ("You are a travel assistant. Use the tools to look up the weather and the sights of a city before "
                "answering; call several tools at once when that helps, and keep answers short.")
TASK = "I have a free weekend. Which of paris, rome or oslo should I visit, given the weather and the sights?"


def weather(city: str) -> str:
    return (f"Weather report for {city}: mostly sunny, a light breeze from the west, highs around the low twenties, "
            f"a small chance of rain in the evening. Air quality good, pollen moderate. " * 3).strip()


def sights(city: str) -> str:
    return (f"Top sights in {city}: the old town walk, the cathedral, the harbour front, the modern art museum, "
            f"the covered market and the park on the hill. Most are within a short walk of each other. " * 3).strip()
