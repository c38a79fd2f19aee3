"""Claude Code session JSONL (``~/.claude/projects/<project>/<session>.jsonl``) → model calls.

One record per line. ``assistant`` records carry the model's output; one API call's message is split over
several records with the same ``message.id`` (a ``thinking`` block, a ``text`` block, one record per
``tool_use``), each repeating the call's ``message.usage``, so a call is the run of records with one id and its
usage is read once. ``user`` records are either the user's prompt (string content) or tool results
(``tool_result`` blocks); ``attachment`` records with text (skill listings, reminders) are sent to the model as
user content. Other record types (``mode``, ``file-history-snapshot``, ``system``, ``ai-title`` …) are local
bookkeeping and never reach the model.

What the log does not hold: Claude Code's system prompt and tool definitions (the first call's
``cache_read_input_tokens`` is mostly them) and the thinking text (stored empty, only a signature).

Records form a tree through ``parentUuid``: a call's request is the chain from the root down to the
record before its first assistant record, so a compaction (a summary that starts a new root) or a rewind
(a fork: a new child of an earlier record) gives the history the agent actually sent, not the file's order.
The request time of a call is the timestamp of the last record of that chain (the input that triggered it);
its response end is the timestamp of its last record. Sidechain records (subagents) form their own session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvscope.workloads.errors import TraceFileError, iter_json_lines
from kvscope.workloads.importers.agent import (
    Message,
    ModelCall,
    ObservedUsage,
    calls_to_trace,
    content_text,
    parse_time,
    tool_call_text,
)
from kvscope.workloads.importers.sniff import check_kind
from kvscope.workloads.trace import Trace
from kvscope.workloads.trace_schema import SegmentKind


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
        return [Message.text("user", content)], SegmentKind.USER
    msgs, kind = [], SegmentKind.USER
    for block in content or []:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            msgs.append(Message.text("tool", content_text(block.get("content"))))
            kind = SegmentKind.TOOL_OUTPUT
        else:
            msgs.append(Message.text("user", content_text([block])))
    return msgs, kind


_CONVERSATION = ("user", "assistant", "attachment")


def _records(path: Path) -> list[dict]:
    """Every record with a place in the conversation tree (conversational ones and ``system`` records such as
    turn summaries, which sit in the ``parentUuid`` chain), each with ``_parent``: its ``parentUuid``, or, in
    logs without uuids, the previous record of its session."""
    out: list[dict] = []
    previous: dict[str, str] = {}
    for line_no, rec in iter_json_lines(path):
        kind = rec.get("type")
        if kind in ("user", "assistant") and not isinstance(rec.get("message"), dict):
            raise TraceFileError(f"{path}: line {line_no}: {kind} record without a `message` object")
        if kind not in _CONVERSATION and "uuid" not in rec:
            continue
        sid = str(rec.get("sessionId", path.stem)) + ("/sidechain" if rec.get("isSidechain") else "")
        uuid = str(rec.get("uuid", f"line{line_no}"))
        parent = rec["parentUuid"] if "parentUuid" in rec else previous.get(sid)
        out.append({**rec, "_sid": sid, "_uuid": uuid, "_parent": parent, "_line": line_no})
        previous[sid] = uuid
    return out


def _msg_id(rec: dict) -> str:
    return str(rec["message"].get("id") or rec["_uuid"])


class _Tree:
    """The records of one file as a tree; ``request(first)`` rebuilds what the call starting at ``first`` sent."""

    def __init__(self, recs: list[dict]) -> None:
        self.by_uuid = {r["_uuid"]: r for r in recs}
        # Parallel tool calls: each tool_result hangs off the assistant record of its own tool_use, so the
        # chain above a later record passes only one of them. Results are gathered per assistant message.
        self.results: dict[str, list[dict]] = {}
        for r in recs:
            parent = self.by_uuid.get(r["_parent"] or "")
            if r.get("type") == "user" and parent is not None and parent.get("type") == "assistant" and \
                    _user_messages(r["message"].get("content"))[1] == SegmentKind.TOOL_OUTPUT:
                self.results.setdefault(_msg_id(parent), []).append(r)

    def chain(self, leaf: str | None) -> list[dict]:
        path: list[dict] = []
        seen: set[str] = set()
        while leaf is not None and leaf in self.by_uuid and leaf not in seen:
            seen.add(leaf)
            path.append(self.by_uuid[leaf])
            leaf = self.by_uuid[leaf]["_parent"]
        return path[::-1]

    def request(self, first: dict) -> tuple[list[Message], str, float | None]:
        """(messages, input kind since the last assistant message, time of the last input record)."""
        msgs: list[Message] = []
        kind, open_id, last_s = SegmentKind.USER, None, None
        for rec in self.chain(first["_parent"]) + [None]:  # None closes a trailing assistant message
            if rec is not None and rec.get("type") == "assistant":
                mid, text = _msg_id(rec), _assistant_text(rec["message"].get("content"))
                if mid == open_id:
                    msgs[-1] = Message.text("assistant", "\n".join(t for t in (msgs[-1].content, text) if t))
                else:
                    msgs.append(Message.text("assistant", text))
                open_id, kind = mid, SegmentKind.TOOL_OUTPUT
                continue
            if open_id is not None:  # the assistant message ended: its tool results follow it, in file order
                for res in self.results.get(open_id, []):
                    if res["_line"] < first["_line"]:
                        msgs += _user_messages(res["message"].get("content"))[0]
                        last_s = parse_time(res.get("timestamp")) or last_s
                open_id = None
            if rec is None:
                break
            if rec.get("type") == "user":
                new, added = _user_messages(rec["message"].get("content"))
                if added == SegmentKind.TOOL_OUTPUT:
                    continue  # emitted with its assistant message above
                kind = SegmentKind.USER
            elif rec.get("type") == "attachment":
                att = rec.get("attachment") or {}
                text = att.get("content")
                new = [Message.text("user", text)] if isinstance(text, str) and text else []
            else:
                new = []
            msgs += new
            last_s = parse_time(rec.get("timestamp")) or last_s
        return msgs, kind, last_s


def read_claude_code(path: str | Path) -> list[ModelCall]:
    """One call per assistant ``message.id``; its request is the record chain above its first record, so a
    compaction (a new chain root) or a rewind (a fork of the chain) is seen as the agent sent it."""
    check_kind(path, "claude-code")
    recs = _records(Path(path))
    tree = _Tree(recs)
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in recs:
        if r.get("type") == "assistant":
            groups.setdefault((r["_sid"], _msg_id(r)), []).append(r)
    calls = []
    for (sid, _), parts in groups.items():
        history, kind, request_s = tree.request(parts[0])
        usage = next((q["message"]["usage"] for q in reversed(parts) if q["message"].get("usage")), None)
        response = "\n".join(t for t in (_assistant_text(q["message"].get("content")) for q in parts) if t)
        calls.append(ModelCall(sid, history, response, ObservedUsage.anthropic(usage), request_s=request_s,
                               response_end_s=parse_time(parts[-1].get("timestamp")), input_kind=kind))
    return calls


def import_claude_code(path: str | Path, tokenizer: str | Path) -> Trace:
    calls = read_claude_code(path)
    return calls_to_trace(calls, tokenizer, name=Path(path).stem, importer="claude-code", source=path,
                          extra_meta={"observed_usage": "anthropic",
                                      "not_recorded": ["system prompt", "tool definitions", "thinking text"]})


__all__ = ["read_claude_code", "import_claude_code"]
