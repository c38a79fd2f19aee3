"""OpenHands event trajectories (a JSON list of events, as saved by the UI or ``tests/runtime/trajs``) → model calls.

Events are actions and observations with ``source`` (``user``, ``agent``, ``environment``) and a microsecond
``timestamp``. What the LLM saw is rebuilt from them: a user ``message`` action is a user message; an agent
action with ``tool_call_metadata`` is the assistant turn of the LLM response ``model_response`` (one response can
carry several tool calls, hence several actions: a call is one ``model_response.id``); the observation caused
by it (``cause``, ``tool_call_metadata``) is the tool result; an agent ``message`` action without metadata is a
text-only answer. ``model_response.usage`` is litellm's: ``prompt_tokens``, ``completion_tokens``,
``prompt_tokens_details.cached_tokens`` and, for Anthropic models, ``cache_read_input_tokens`` /
``cache_creation_input_tokens``. The system prompt and tool definitions are not in the trajectory.
The request time of a call is the timestamp of the last event before it.
"""

from __future__ import annotations

from pathlib import Path

from kvscope.workloads.errors import TraceFileError
from kvscope.workloads.importers.agent import Message, ModelCall, ObservedUsage, calls_to_trace, parse_time
from kvscope.workloads.importers.openai_chat import chat_message
from kvscope.workloads.importers.sniff import read_json_document
from kvscope.workloads.trace import Trace
from kvscope.workloads.trace_schema import SegmentKind


def _load(p: Path) -> list:
    data = read_json_document(p, "openhands")
    if not isinstance(data, list):
        raise TraceFileError(f"{p}: not an OpenHands trajectory (expected a JSON list of events)")
    return data


def read_openhands(path: str | Path) -> list[ModelCall]:
    p = Path(path)
    history: list[Message] = []
    calls: list[ModelCall] = []
    seen: set[str] = set()
    last_s: float | None = None
    kind = SegmentKind.USER
    for i, ev in enumerate(_load(p)):
        if not isinstance(ev, dict) or "source" not in ev:
            raise TraceFileError(f"{p}: event {i}: expected an event object with a `source`")
        ts = parse_time(ev.get("timestamp"))
        meta = ev.get("tool_call_metadata") or {}
        resp = meta.get("model_response") or {}
        if ev["source"] == "user" and ev.get("action") == "message":
            history.append(Message.text("user", str((ev.get("args") or {}).get("content", ev.get("message", "")))))
            kind = SegmentKind.USER
        elif ev["source"] == "agent" and ev.get("action") and resp:
            rid = str(resp.get("id", i))
            if rid not in seen:
                seen.add(rid)
                choice = (resp.get("choices") or [{}])[0].get("message") or {}
                answer = chat_message({**choice, "role": "assistant"})
                usage = ObservedUsage.openai(resp.get("usage"))
                calls.append(ModelCall(p.stem, list(history), answer.content, usage,
                                       request_s=last_s, response_end_s=ts, input_kind=kind))
                history.append(answer)
                kind = SegmentKind.TOOL_OUTPUT
        elif ev["source"] == "agent" and ev.get("action") == "message":
            text = str((ev.get("args") or {}).get("content", ev.get("message", "")))
            calls.append(ModelCall(p.stem, list(history), text, request_s=last_s, response_end_s=ts,
                                   input_kind=kind))
            history.append(Message.text("assistant", text))
        elif ev.get("observation") and meta:
            history.append(Message.text("tool", str(ev.get("content", ""))))
        else:
            continue  # state changes and other bookkeeping never reach the model
        if ts is not None:
            last_s = ts
    return calls


def import_openhands(path: str | Path, tokenizer: str | Path) -> Trace:
    p = Path(path)
    return calls_to_trace(read_openhands(p), tokenizer, name=p.stem, importer="openhands", source=p,
                          extra_meta={"observed_usage": "openai (litellm)",
                                      "not_recorded": ["system prompt", "tool definitions"]})
