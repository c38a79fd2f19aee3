"""OpenAI-format chat JSONL → model calls: one request per line, as logged by proxies and gateways.

Each line holds the request's ``messages`` (OpenAI chat format: ``role``, ``content`` as a string or a list of
parts, assistant ``tool_calls``) and optionally ``tools``, the response (``response`` as a string or a
message, or ``choices[0].message`` of a chat completion), ``usage`` (``prompt_tokens``,
``prompt_tokens_details.cached_tokens``, ``completion_tokens``), a time (``timestamp``: ISO-8601 or epoch s,
or ``arrival_s``) and a session (``session_id``, else the OpenAI ``user`` field). The fields may also sit under
``request`` (``{"request": {...}, "response": {...}}`` as recorded by a proxy).

Lines without a session join the session whose last request's messages are a prefix of theirs (the
longest such history; a new session if none), which is how an append-only agent loop looks from outside.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvscope.workloads.importers.agent import (
    Message,
    ModelCall,
    ObservedUsage,
    content_text,
    parse_time,
    tool_call_text,
    tools_text,
)
from kvscope.workloads.trace import Trace
from kvscope.workloads.trace_schema import SegmentKind
from kvscope.workloads.errors import TraceFileError, iter_json_lines
from kvscope.workloads.importers.agent import calls_to_trace
from kvscope.workloads.importers.sniff import check_kind


def chat_message(m: dict) -> Message:
    """An OpenAI chat message (assistant ``tool_calls`` become JSON lines after the text)."""
    role = str(m.get("role", "user"))
    role = "system" if role == "developer" else role
    text = content_text(m.get("content"))
    calls = [tool_call_text((c.get("function") or {}).get("name", ""), (c.get("function") or {}).get("arguments"))
             for c in m.get("tool_calls") or [] if isinstance(c, dict)]
    return Message.text(role, "\n".join(t for t in [text, *calls] if t))


def _response_text(line: dict) -> str:
    resp: Any = line.get("response")
    if isinstance(resp, dict) and "choices" in resp:
        resp = resp["choices"][0].get("message", {}) if resp["choices"] else {}
    if resp is None and line.get("choices"):
        resp = line["choices"][0].get("message", {})
    if isinstance(resp, dict):
        return chat_message({**resp, "role": "assistant"}).content
    return resp if isinstance(resp, str) else ""


def _with_tools(messages: list[Message], tools: list[dict] | None) -> list[Message]:
    """Tool definitions as a ``tools`` part of the system message (a system message first if there is none)."""
    text = tools_text(tools)
    if not text:
        return messages
    if messages and messages[0].role == "system":
        return [Message("system", [*messages[0].parts, (SegmentKind.TOOLS, text)]), *messages[1:]]
    return [Message("system", [(SegmentKind.TOOLS, text.lstrip())]), *messages]


def _session_of(explicit: str | None, msgs: list[tuple[str, str]], last: dict[str, list[tuple[str, str]]],
                line_no: int) -> str:
    """The explicit session, else the session whose last request + response (as (role, text) pairs) is the
    longest prefix of ``msgs``, else a new one."""
    if explicit:
        return explicit
    best, best_len = None, -1
    for sid, prev in last.items():
        if len(prev) <= len(msgs) and msgs[:len(prev)] == prev and len(prev) > best_len:
            best, best_len = sid, len(prev)
    return best if best is not None else f"line{line_no:06d}"


def read_openai_chat(path: str | Path) -> list[ModelCall]:
    p = Path(path)
    check_kind(p, "openai-chat")
    calls: list[ModelCall] = []
    last: dict[str, list[dict]] = {}
    for line_no, rec in iter_json_lines(p):
        req = rec.get("request") if isinstance(rec.get("request"), dict) else rec
        msgs = req.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise TraceFileError(f"{p}: line {line_no}: `messages` must be a list of message objects")
        explicit = rec.get("session_id", req.get("session_id", req.get("user")))
        history = [chat_message(m) for m in msgs]
        pairs = [(m.role, m.content) for m in history]
        sid = _session_of(None if explicit is None else str(explicit), pairs, last, line_no)
        response = _response_text(rec)
        last[sid] = pairs + [("assistant", response)]
        resp = rec.get("response")
        usage = rec.get("usage") or (resp.get("usage") if isinstance(resp, dict) else None)
        when = parse_time(rec.get("timestamp", rec.get("arrival_s")))
        tool_input = bool(msgs) and msgs[-1].get("role") == "tool"
        calls.append(ModelCall(sid, _with_tools(history, req.get("tools")), response, ObservedUsage.openai(usage),
                               request_s=when,
                               response_end_s=parse_time(rec.get("end_timestamp")),
                               input_kind=SegmentKind.TOOL_OUTPUT if tool_input else SegmentKind.USER))
    return calls


def import_openai_chat(path: str | Path, tokenizer: str | Path) -> Trace:
    return calls_to_trace(read_openai_chat(path), tokenizer, name=Path(path).stem, importer="openai-chat",
                          source=path, extra_meta={"observed_usage": "openai"})
