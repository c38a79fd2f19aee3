"""A scripted multi-turn, tool-using coding agent on the official ``openai`` SDK, with planted cache breaks.

It is the "real client" that ``kvscope record`` and ``kvscope explain`` are checked against: it streams every
answer, sends its tool list with every request, and feeds tool results the size of source files back as
``tool`` messages. The agent decides its tool calls itself (the model's answer is read but not trusted), so the
conversation is the same on every run and the model need not be able to call tools; ``tool_choice="none"``
keeps servers without a tool-call parser happy. Four turns plant one cache break each:

* a timestamp in the system prompt changes (``volatile_field``),
* the tool list is reordered (``tools_changed``),
* the task message (message 1) is edited (``message_edited``),
* the history is compacted into a summary, keeping the last tool exchange (``compaction``).

``TOOLS_TEMPLATE`` is a Llama-3-style chat template that renders the tool list (as a block before the first
message) and tool calls; serve the model with it (vLLM ``--chat-template``) so tool changes reach the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TOOLS_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|start_header_id|>tools<|end_header_id|>\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] %}{%- for c in message['tool_calls'] %}"
    "{{- '\\n<call>' + c['function']['name'] + ' ' + (c['function']['arguments'] | tojson) + '</call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

SYSTEM = ("You are a careful coding agent working in a Python repository.\nCurrent time: {now}\n"
          "Read files before editing them, run the tests after every change, and keep answers short. "
          "Use the tools to inspect the repository; never guess file contents. When the task is done, say so "
          "and summarise what changed in one paragraph.\n")
TASK = "Fix the failing test in the parser module."
TASK_EDITED = "Fix the failing test in the parser module and keep the public interface unchanged."


def _tool(name: str, description: str, params: dict[str, str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                        for k, v in params.items()},
                       "required": list(params)}}}


TOOLS = [
    _tool("read_file", "Read a file of the repository and return its text.", {"path": "file path"}),
    _tool("search", "Search the repository for a pattern and list the matching lines.", {"pattern": "regex"}),
    _tool("run_tests", "Run the test suite, or one test file, and return the report.", {"target": "test path"}),
]


def source_file(name: str, lines: int) -> str:
    """A deterministic Python-looking file of about ``8 * lines`` tokens (no digit:digit pairs, no dates)."""
    body = [f"# module {name}\n", "import re\n\n"]
    words = ["token", "parser", "value", "buffer", "node", "scope", "result", "stream"]
    for i in range(lines):
        a, b = words[i % len(words)], words[(i * 3 + 1) % len(words)]
        body.append(f"def {a}_{name}_{b}(text):\n    return text.strip() + \"{b}\"\n" if i % 2 == 0
                    else f"    {a} = {b}.split(\",\")  # handles the {a} case\n")
    return "".join(body)


@dataclass
class AgentRun:
    """What the agent sent and saw, request by request."""

    planted: list[str | None] = field(default_factory=list)  # the cache break each request was built to cause
    answers: list[str] = field(default_factory=list)
    usages: list[dict[str, Any] | None] = field(default_factory=list)


class ScriptedAgent:
    """Run the scripted session against ``base_url`` (an OpenAI-compatible ``/v1`` root)."""

    def __init__(self, base_url: str, model: str, session_id: str = "agent-1", api_key: str = "sk-scripted",
                 max_tokens: int = 8, file_lines: int = 7) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key=api_key, default_headers={"X-Session-ID": session_id},
                             max_retries=0, timeout=300)
        self.model, self.max_tokens, self.file_lines = model, max_tokens, file_lines
        self.tools = list(TOOLS)
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM.format(now="2026-12-01T09:00:00Z")},
                                               {"role": "user", "content": TASK}]
        self.run_info = AgentRun()
        self._calls = 0

    def _ask(self, planted: str | None) -> None:
        stream = self.client.chat.completions.create(
            model=self.model, messages=self.messages, tools=self.tools, tool_choice="none",
            max_tokens=self.max_tokens, temperature=0.0, stream=True, stream_options={"include_usage": True})
        text, usage = [], None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    text.append(choice.delta.content)
        self.run_info.planted.append(planted)
        self.run_info.answers.append("".join(text))
        self.run_info.usages.append(usage)

    def _tool_turn(self, tool: str, argument: dict[str, str], result: str) -> None:
        self._calls += 1
        call_id = f"call_{self._calls}"
        self.messages.append({"role": "assistant", "content": f"Calling {tool}.", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(argument)}}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})

    def run(self) -> AgentRun:
        n = self.file_lines
        self._ask(None)
        self._tool_turn("read_file", {"path": "src/parser.py"}, source_file("parser", n))
        self._ask(None)
        self._tool_turn("search", {"pattern": "def token"}, source_file("search", n // 2))
        self._ask(None)
        self.messages[0] = {"role": "system", "content": SYSTEM.format(now="2026-12-01T09:41:07Z")}
        self._ask("volatile_field")
        self._tool_turn("read_file", {"path": "tests/test_parser.py"}, source_file("tests", n))
        self._ask(None)
        self.tools = [self.tools[2], self.tools[0], self.tools[1]]
        self._ask("tools_changed")
        self._tool_turn("run_tests", {"target": "tests/test_parser.py"}, source_file("report", n // 2))
        self._ask(None)
        self.messages[1] = {"role": "user", "content": TASK_EDITED}
        self._ask("message_edited")
        self._tool_turn("read_file", {"path": "src/lexer.py"}, source_file("lexer", n))
        self._ask(None)
        kept = self.messages[-2:]
        summary = ("Summary of the work so far: the parser module and its tests were read, the search found the "
                   "token helpers, and the test run showed the failing case in the split helper.\n")
        self.messages = self.messages[:2] + [{"role": "user", "content": summary}] + kept
        self._ask("compaction")
        self._tool_turn("run_tests", {"target": "tests"}, source_file("final", n // 2))
        self._ask(None)
        return self.run_info
