"""Codex CLI rollout JSONL (``~/.codex/sessions/…/rollout-*.jsonl``) → model calls.

Each line is ``{"timestamp", "type", "payload"}``. ``session_meta`` names the session and carries
``base_instructions`` (the ``instructions`` Codex sends: the system prompt). ``response_item`` lines are the
Responses-API input and output items in the order the conversation holds them: ``message`` (roles
``developer`` — sent as system messages —, ``user``, ``assistant``), ``reasoning`` (encrypted; its size is only in
the usage), ``function_call`` / ``custom_tool_call`` / ``local_shell_call`` and their ``*_output`` items. An
``event_msg`` of type ``token_count`` follows each model call with that call's usage
(``info.last_token_usage``: ``input_tokens`` including ``cached_input_tokens``, ``output_tokens``).

A call is a run of output items (assistant message, reasoning, tool calls) closed by its ``token_count``
(or, when that is missing, by the next input item); its request is every item before the run. The request
time is the timestamp of the last input item before the run. Tool definitions are not in the rollout.
"""

from __future__ import annotations

from pathlib import Path

from kvscope.workloads.importers.agent import (
    Message,
    ModelCall,
    ObservedUsage,
    content_text,
    parse_time,
    tool_call_text,
)
from kvscope.workloads.trace import Trace
from kvscope.workloads.trace_schema import SegmentKind
from kvscope.workloads.errors import TraceFileError, iter_json_lines
from kvscope.workloads.importers.agent import calls_to_trace
from kvscope.workloads.importers.sniff import check_kind

_ROLE = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}


def _item_message(item: dict) -> tuple[Message | None, bool]:
    """(message for the history or None, whether the item is model output)."""
    kind = item.get("type")
    if kind == "message":
        role = _ROLE.get(str(item.get("role")), "user")
        return Message.text(role, content_text(item.get("content"))), role == "assistant"
    if kind == "reasoning":
        return None, True
    if kind in ("function_call", "custom_tool_call", "local_shell_call"):
        args = item.get("arguments", item.get("input", item.get("action")))
        return Message.text("assistant", tool_call_text(str(item.get("name", kind)), args)), True
    if isinstance(kind, str) and kind.endswith("_call_output"):
        out = item.get("output")
        return Message.text("tool", out if isinstance(out, str) else content_text(out)), False
    return None, False


class _State:
    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.history: list[Message] = []
        self.call: ModelCall | None = None
        self.parts: list[str] = []
        self.last_input_s: float | None = None
        self.input_kind = SegmentKind.USER

    def close(self, out: list[ModelCall]) -> None:
        if self.call is not None:
            self.call.response = "\n".join(self.parts)
            out.append(self.call)
            self.call, self.parts = None, []
            self.input_kind = SegmentKind.TOOL_OUTPUT  # until a user message arrives


def read_codex(path: str | Path) -> list[ModelCall]:
    p = Path(path)
    check_kind(p, "codex")
    st = _State(p.stem)
    calls: list[ModelCall] = []
    for line_no, rec in iter_json_lines(p):
        payload = rec.get("payload")
        if not isinstance(payload, dict):
            raise TraceFileError(f"{p}: line {line_no}: expected a `payload` object")
        ts = parse_time(rec.get("timestamp"))
        kind = rec.get("type")
        if kind == "session_meta":
            st.session_id = str(payload.get("id", st.session_id))
            base = payload.get("base_instructions")
            text = base.get("text") if isinstance(base, dict) else base
            if isinstance(text, str) and text:
                st.history.insert(0, Message.text("system", text))
        elif kind == "event_msg" and payload.get("type") == "token_count" and st.call is not None:
            info = payload.get("info") or {}
            st.call.usage = ObservedUsage.openai(info.get("last_token_usage"))
            st.call.response_end_s = ts
            st.close(calls)
        elif kind == "response_item":
            msg, is_output = _item_message(payload)
            if is_output:
                if st.call is None:
                    st.call = ModelCall(st.session_id, list(st.history), "", request_s=st.last_input_s,
                                        input_kind=st.input_kind)
                st.call.response_end_s = ts
                if msg is not None:
                    st.parts.append(msg.content)
            else:
                st.close(calls)
                if ts is not None:
                    st.last_input_s = ts
                if msg is not None and msg.role == "user":
                    st.input_kind = SegmentKind.USER
            if msg is not None:
                st.history.append(msg)
    st.close(calls)
    for c in calls:
        c.session_id = st.session_id
    return calls


def import_codex(path: str | Path, tokenizer: str | Path) -> Trace:
    return calls_to_trace(read_codex(path), tokenizer, name=Path(path).stem, importer="codex", source=path,
                          extra_meta={"observed_usage": "openai",
                                      "not_recorded": ["tool definitions", "reasoning text (encrypted)"]})
