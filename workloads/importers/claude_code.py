"""Claude Code session JSONL (``~/.claude/projects/<project>/<session>.jsonl``) → model calls.

One record per line. ``assistant`` records carry the model's output; one API call's message is split over
several records with the same ``message.id`` (a ``thinking`` block, a ``text`` block, one record per
``tool_use``), each repeating the call's ``message.usage``, so a call is the run of records with one id and its
usage is read once. ``user`` records are either the user's prompt (string content) or tool results
(``tool_result`` blocks); ``attachment`` records with text (skill listings, reminders) are sent to the model as
user content. Other record types (``mode``, ``file-history-snapshot``, ``system``, ``ai-title`` …) are local
bookkeeping and never reach the model.

What the log does not hold: Claude Code's system prompt and tool definitions (the first call's
``cache_read_input_tokens`` is mostly them) and the thinking text (stored empty, only a signature). The
request time of a call is the timestamp of the last record before it (the input that triggered it); its
response end is the timestamp of its last record. Sidechain records (subagents) form their own session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from kvscope.workloads.importers.agent import Message, ModelCall, ObservedUsage, content_text, parse_time, tool_call_text
from kvscope.workloads.trace import Trace


def _assistant_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    out = []
    for block in content or []:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text":
            out.append(block.get("text", ""))
        elif block.get("type") == "tool_use":
            out.append(tool_call_text(block.get("name", ""), block.get("input", {})))
        elif block.get("type") == "thinking" and block.get("thinking"):
            out.append(block["thinking"])
    return "\n".join(t for t in out if t)


def _user_messages(content: Any) -> tuple[list[Message], str]:
    """Messages of a user record and the input kind they are (``user`` or ``tool_output``)."""
    if isinstance(content, str):
        return [Message.text("user", content)], "user"
    msgs, kind = [], "user"
    for block in content or []:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            msgs.append(Message.text("tool", content_text(block.get("content"))))
            kind = "tool_output"
        else:
            msgs.append(Message.text("user", content_text([block])))
    return msgs, kind


class _Session:
    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.history: list[Message] = []
        self.last_input_s: float | None = None
        self.input_kind = "user"  # what arrived since the last call: "tool_output" unless a user message did
        self.open: ModelCall | None = None
        self.open_id: str | None = None
        self.open_parts: list[str] = []

    def close(self) -> ModelCall | None:
        call = self.open
        if call is not None:
            call.response = "\n".join(p for p in self.open_parts if p)
            self.history.append(Message.text("assistant", call.response))
            self.open, self.open_id, self.open_parts = None, None, []
        return call


def _records(path: Path) -> Iterator[tuple[int, dict]]:
    from kvscope.workloads.errors import TraceFileError, iter_json_lines

    for line_no, rec in iter_json_lines(path):
        if rec.get("type") in ("user", "assistant") and not isinstance(rec.get("message"), dict):
            raise TraceFileError(f"{path}: line {line_no}: {rec.get('type')} record without a `message` object")
        yield line_no, rec


def read_claude_code(path: str | Path) -> list[ModelCall]:
    p = Path(path)
    sessions: dict[str, _Session] = {}
    calls: list[ModelCall] = []
    for _, rec in _records(p):
        kind = rec.get("type")
        if kind not in ("user", "assistant", "attachment"):
            continue
        sid = str(rec.get("sessionId", p.stem)) + ("/sidechain" if rec.get("isSidechain") else "")
        s = sessions.setdefault(sid, _Session(sid))
        ts = parse_time(rec.get("timestamp"))
        if kind == "assistant":
            msg = rec["message"]
            mid = msg.get("id") or rec.get("uuid")
            if s.open is None or mid != s.open_id:
                done = s.close()
                if done is not None:
                    calls.append(done)
                s.open = ModelCall(sid, list(s.history), "", ObservedUsage.anthropic(msg.get("usage")),
                                   request_s=s.last_input_s, input_kind=s.input_kind)
                s.open_id = mid
                s.input_kind = "tool_output"  # until a user message arrives
            if msg.get("usage"):  # repeated on every split record; the last one has the final counts
                s.open.usage = ObservedUsage.anthropic(msg["usage"])
            s.open_parts.append(_assistant_text(msg.get("content")))
            s.open.response_end_s = ts
            continue
        done = s.close()
        if done is not None:
            calls.append(done)
        if kind == "user":
            msgs, added = _user_messages(rec["message"].get("content"))
            if added == "user":
                s.input_kind = "user"
        else:
            att = rec.get("attachment") or {}
            text = att.get("content") if isinstance(att.get("content"), str) else ""
            msgs = [Message.text("user", text)] if text else []
        s.history += msgs
        if ts is not None:
            s.last_input_s = ts
    for s in sessions.values():
        done = s.close()
        if done is not None:
            calls.append(done)
    return calls


def import_claude_code(path: str | Path, tokenizer: str | Path) -> Trace:
    from kvscope.workloads.importers.agent import calls_to_trace

    calls = read_claude_code(path)
    return calls_to_trace(calls, tokenizer, name=Path(path).stem, importer="claude-code", source=path,
                          extra_meta={"observed_usage": "anthropic",
                                      "not_recorded": ["system prompt", "tool definitions", "thinking text"]})


__all__ = ["read_claude_code", "import_claude_code"]
