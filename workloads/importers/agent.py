"""Shared step of the agent-transcript importers: model calls (messages as the agent sent them) → a text-mode trace.

Every transcript format (Claude Code, Codex, OpenAI chat, SWE-agent, OpenHands) is first parsed into
:class:`ModelCall` rows: the request as the agent sent it (system prompt and tool definitions where the log
has them, the message history), the model's response, timestamps and the provider's usage. This module then
does what all formats share, once:

* **Tokens.** Each request is rendered through the named model's chat template and tokenised (what vLLM's
  ``/v1/chat/completions`` does). Where the per-message pieces (template text, then each message's content
  parts) tokenise independently, i.e. their concatenation equals the ids of the whole rendering, the prompt is
  stored as one segment per piece, and equal pieces share one segment trace-wide: message-level structure
  (system, tools, user, assistant, tool results) survives for cache-break attribution. Otherwise the
  rendering's ids are stored whole, split only where they stop matching the session's previous prompt, so
  the prompt is still token-exact and the shared prefix is still shared.
* **Sessions and timing.** Calls of a session are chained parent → child in call order. The gap between
  a call's response end and the next call's request is ``tool_latency_s`` when the new input is a tool
  result, else ``think_time_s``.
* **Observed usage.** Provider counts go to the nullable ``observed_*`` columns; they are never used to
  size anything, so the trace stays token-exact for the named tokenizer while keeping what the provider saw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from kvscope.workloads.prefix import Transition, classify_transition, common_prefix_len as _lcp
from kvscope.workloads.trace import CREATED_BY, Trace, TraceBuilder
from kvscope.workloads.trace_schema import SegmentKind
from kvscope.workloads.errors import WorkloadError
from kvscope.workloads.importers.sniff import refuse_empty
from kvscope.workloads.tokens import file_sha256

# Segment kind of each message role's content (template text between messages is kind "template").
ROLE_KIND = {"system": SegmentKind.SYSTEM, "user": SegmentKind.USER, "assistant": SegmentKind.ASSISTANT,
            "tool": SegmentKind.TOOL_OUTPUT}


@dataclass
class ObservedUsage:
    """Provider usage of one call, as recorded (None = not recorded). Anthropic: ``input_tokens`` is the
    uncached input after the last cache breakpoint; OpenAI: ``prompt_tokens`` includes ``cached_tokens``."""

    prompt_tokens: int | None = None
    input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None

    @classmethod
    def anthropic(cls, u: dict | None) -> "ObservedUsage":
        if not u:
            return cls()
        parts = [u.get("input_tokens"), u.get("cache_read_input_tokens"), u.get("cache_creation_input_tokens")]
        total = sum(int(x) for x in parts if x is not None) if any(x is not None for x in parts) else None
        return cls(prompt_tokens=total, input_tokens=_int(u.get("input_tokens")),
                   cache_read_input_tokens=_int(u.get("cache_read_input_tokens")),
                   cache_creation_input_tokens=_int(u.get("cache_creation_input_tokens")),
                   output_tokens=_int(u.get("output_tokens")))

    @classmethod
    def openai(cls, u: dict | None) -> "ObservedUsage":
        """OpenAI chat usage (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``, ``completion_tokens``);
        litellm's Anthropic pass-through fields (``cache_read_input_tokens`` …) are kept where present."""
        if not u:
            return cls()
        details = u.get("prompt_tokens_details") or {}
        return cls(prompt_tokens=_int(u.get("prompt_tokens", u.get("input_tokens"))),
                   cache_read_input_tokens=_int(u.get("cache_read_input_tokens")),
                   cache_creation_input_tokens=_int(u.get("cache_creation_input_tokens")),
                   cached_tokens=_int(details.get("cached_tokens", u.get("cached_input_tokens"))),
                   output_tokens=_int(u.get("completion_tokens", u.get("output_tokens"))))

    def columns(self) -> dict[str, int | None]:
        return {f"observed_{k}": v for k, v in self.__dict__.items()}


@dataclass
class Message:
    """One chat message; ``parts`` are (segment kind, text) pieces of its content, concatenated in order
    (a system message may carry the system prompt and the tool definitions as two parts)."""

    role: str
    parts: list[tuple[str, str]]

    @classmethod
    def text(cls, role: str, content: str, kind: str | None = None) -> "Message":
        return cls(role, [(kind or ROLE_KIND.get(role, SegmentKind.USER), content)])

    @property
    def content(self) -> str:
        return "".join(t for _, t in self.parts)


@dataclass
class ModelCall:
    """One model call reconstructed from a transcript. Times are absolute seconds (epoch) or None."""

    session_id: str
    messages: list[Message]
    response: str
    usage: ObservedUsage = field(default_factory=ObservedUsage)
    request_s: float | None = None
    response_end_s: float | None = None
    input_kind: SegmentKind = SegmentKind.USER  # what the request added since the previous call: USER or TOOL_OUTPUT
    tool_latency_s: float | None = None  # where the log records the tool's own time and no timestamps


def _int(v: Any) -> int | None:
    return None if v is None else int(v)


def parse_time(v: Any) -> float | None:
    """ISO-8601 (``2026-06-01T05:40:20.151Z``, with or without zone) or epoch seconds → epoch seconds."""
    if v is None or v == "":
        return None
    if isinstance(v, (int, float)):
        return float(v)
    text = str(v).replace("Z", "+00:00")
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def tool_call_text(name: str, arguments: Any) -> str:
    """A tool call as the assistant's text: one JSON object, arguments parsed where they are a JSON string."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def tools_text(tools: Sequence[dict] | None) -> str:
    """Tool definitions as system-prompt text (one JSON object a line), the way chat templates without tool
    support are given them."""
    if not tools:
        return ""
    return "\n\n# Tools\n" + "\n".join(json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools)


def content_text(content: Any) -> str:
    """Text of an OpenAI / Anthropic message content: a string, or a list of parts (``text``,
    ``input_text``, ``output_text``, ``tool_result`` …); images and other binary parts are skipped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, dict):
                if isinstance(p.get("text"), str):
                    out.append(p["text"])
                elif "content" in p:
                    out.append(content_text(p["content"]))
        return "\n".join(out)
    return json.dumps(content, ensure_ascii=False)


# ------------------------------------------------------------------------------------------ tokens


class _Tokens:
    """The named model's tokenizer and chat template, and a trace-wide table of segments by content."""

    def __init__(self, model_dir: str | Path, builder: TraceBuilder) -> None:
        from tokenizers import Tokenizer  # deferred: tokenizers is heavy, only tokenizing needs it

        from kvscope.workloads.text import ChatTemplate  # deferred: keeps `kvscope --help` fast

        p = Path(model_dir)
        if not (p / "tokenizer.json").is_file():
            raise WorkloadError(f"--tokenizer {model_dir}: no tokenizer.json there (give a model directory such "
                                "as models/tiny)")
        self.model_dir = p
        self.tok = Tokenizer.from_file(str(p / "tokenizer.json"))
        self.template = ChatTemplate.from_model_dir(p)
        self.b = builder
        self._piece_ids: dict[str, np.ndarray] = {}  # messages repeat in every later request of a session
        self.split_prompts = 0  # prompts stored by LCP split because the pieces did not tokenise independently

    def info(self) -> dict[str, Any]:
        """trace.json's `tokenizer` block: path, file hash and vocabulary size."""
        return {"path": str(self.model_dir), "sha256": file_sha256(self.model_dir / "tokenizer.json"),
                "vocab_size": self.tok.get_vocab_size()}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def piece(self, text: str) -> np.ndarray:
        """``encode`` of a message part or template piece, once per distinct text."""
        got = self._piece_ids.get(text)
        if got is None:
            got = self._piece_ids[text] = self.encode(text)
        return got

    def segment(self, ids: np.ndarray, kind: str) -> int:
        return self.b.shared_segment(ids, kind)

    def prompt(self, messages: Sequence[Message], previous: tuple[list[int], np.ndarray] | None
               ) -> tuple[list[int], np.ndarray, int]:
        """(segment ids, token ids, static prefix tokens) of the rendered request; see the module doc for the
        two layouts. The static prefix is the leading template plus the system message (-1 if unknown)."""
        rendered = [{"role": m.role, "content": m.content} for m in messages]
        full = self.encode(self.template.render(rendered))
        pieces = self.template.pieces([m.role for m in messages])
        parts: list[tuple[str, np.ndarray]] = []
        static = -1
        for i, (m, piece) in enumerate(zip(messages, pieces)):
            parts.append((SegmentKind.TEMPLATE, self.piece(piece)))
            parts += [(kind, self.piece(t)) for kind, t in m.parts if t]
            if i == 0 and m.role == "system":
                static = sum(len(ids) for _, ids in parts)
        parts.append((SegmentKind.TEMPLATE, self.piece(pieces[-1])))
        parts = [(k, ids) for k, ids in parts if len(ids)]
        joined = np.concatenate([ids for _, ids in parts]) if parts else np.zeros(0, np.int32)
        if np.array_equal(joined, full):
            return [self.segment(ids, kind) for kind, ids in parts], full, static
        self.split_prompts += 1
        return self._split_on_previous(full, previous), full, -1

    def _split_on_previous(self, full: np.ndarray, previous: tuple[list[int], np.ndarray] | None) -> list[int]:
        segs: list[int] = []
        pos = 0
        if previous is not None:
            k = _lcp(previous[1], full)
            for s in previous[0]:
                n = self.b.segment_len(s)
                if pos + n > k:
                    break
                segs.append(s)
                pos += n
        if pos < len(full):
            segs.append(self.segment(full[pos:], SegmentKind.IMPORTED))
        return segs


# ------------------------------------------------------------------------------------------ trace


def _messages_json(messages: Sequence[Message], tokens: _Tokens) -> str:
    return json.dumps([{"role": m.role, "content": m.content, "n_tokens": int(len(tokens.piece(m.content)))}
                       for m in messages], ensure_ascii=False)


def _gap(prev: ModelCall | None, call: ModelCall) -> tuple[float, float]:
    """(think_time_s, tool_latency_s) before ``call``."""
    if prev is None:
        return 0.0, 0.0
    if call.request_s is not None and prev.response_end_s is not None:
        gap = max(0.0, call.request_s - prev.response_end_s)
    else:
        gap = call.tool_latency_s or 0.0
    return (0.0, gap) if call.input_kind == SegmentKind.TOOL_OUTPUT else (gap, 0.0)


def calls_to_trace(calls: Iterable[ModelCall], tokenizer: str | Path, *, name: str, importer: str,
                   source: str | Path, extra_meta: dict | None = None) -> Trace:
    """A text-mode trace with one request per model call (sessions in first-appearance order)."""
    calls = list(calls)
    if not calls:
        refuse_empty(source, importer)
    b = TraceBuilder()
    tokens = _Tokens(tokenizer, b)
    times = [c.request_s for c in calls if c.request_s is not None]
    t0 = min(times) if times else 0.0
    last: dict[str, tuple[int, ModelCall, list[int], np.ndarray]] = {}
    steps: dict[str, int] = {}
    starts: dict[str, float] = {}
    for call in calls:
        prev = last.get(call.session_id)
        segs, full, static = tokens.prompt(call.messages, None if prev is None else (prev[2], prev[3]))
        out = tokens.encode(call.response)
        out_seg = tokens.segment(out, SegmentKind.ASSISTANT) if len(out) else -1
        arrival = (call.request_s - t0) if call.request_s is not None else 0.0
        starts.setdefault(call.session_id, arrival)
        think, tool = _gap(None if prev is None else prev[1], call)
        transition = Transition.FIRST if prev is None else classify_transition(_lcp(prev[3], full), len(prev[3]))
        step = steps.get(call.session_id, 0)
        idx = b.add_request(session_id=call.session_id, step=step, parent_request_id=-1 if prev is None else prev[0],
                            arrival_s=arrival, session_start_s=starts[call.session_id],
                            think_time_s=think, tool_latency_s=tool, prompt_segment_ids=segs,
                            output_segment_id=out_seg, output_tokens=max(1, len(out)), max_tokens=max(1, len(out)),
                            transition=transition, input_kind=call.input_kind,
                            static_prefix_tokens=static,
                            messages=_messages_json(call.messages, tokens), **call.usage.columns())
        steps[call.session_id] = step + 1
        last[call.session_id] = (idx, call, segs, full)
    meta = {"name": name, "spec": {"importer": importer, "source": str(source)}, "created_by": CREATED_BY,
            "tokenizer": tokens.info(),
            "text": {"chat_template_sha256": tokens.template.sha256, "template_segments": 0, "resized_segments": 0,
                     "prompts_split_by_prefix": tokens.split_prompts},
            **(extra_meta or {})}
    return b.build(meta)
