"""History policies: how an agent or chat client rebuilds its prompt from the conversation so far.

Each policy is a small pydantic model (the spec entry) plus an ``apply`` hook that the generator calls with the
session's mutable history just before it builds the next prompt. Policies compose in the listed order. A
policy that changes tokens already sent (an edit, a truncation, a compaction) replaces history items with new
segments, so the effect on reuse is visible in the trace: the prompt's segment list diverges from the parent's
at the changed item, and the request's ``transition`` says why (``edit``, ``reset``, ``compaction``).

Token parameters (``tokens``, ``position``, ``budget_tokens``, …) are multiplied by the spec's ``scale`` so that
a preset keeps its shape when it is shrunk to run on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # pragma: no cover
    from kvscope.workloads.generate import SessionState

_BASE = ConfigDict(extra="forbid", frozen=True)


@dataclass
class Item:
    """One piece of history: a segment reference plus what the policies need to know about it."""

    segment_id: int
    kind: str
    n_tokens: int
    step: int  # the request step that produced it
    reasoning_tokens: int = 0  # for assistant outputs: leading reasoning tokens
    meta: dict = field(default_factory=dict)


class AppendOnly(BaseModel):
    """Keep everything: each prompt is the parent's prompt + the parent's output + the new input."""

    model_config = _BASE
    kind: Literal["append_only"]

    def apply(self, state: "SessionState", rng: np.random.Generator) -> str | None:
        return None


class VolatilePrefix(BaseModel):
    """A value that changes on every request (a timestamp, a request id) of ``tokens`` tokens inserted at
    token ``position`` of the system prompt. Nothing after ``position`` can be reused across requests."""

    model_config = _BASE
    kind: Literal["volatile_prefix"]
    tokens: int = Field(default=8, ge=1)
    position: int = Field(default=0, ge=0)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> str | None:
        state.new_volatile(self)
        return "edit" if state.step > 0 else None


class EditTurn(BaseModel):
    """With probability ``probability`` per request, rewrite ``tokens`` tokens of the history item ``depth``
    items back from the newest (1 = the newest). The rewrite persists, like a client that edits a message."""

    model_config = _BASE
    kind: Literal["edit_turn"]
    depth: int = Field(default=2, ge=1)
    tokens: int = Field(default=16, ge=1)
    probability: float = Field(default=0.1, ge=0, le=1)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> str | None:
        if state.step == 0 or rng.random() >= self.probability or len(state.history) < self.depth:
            return None
        idx = len(state.history) - self.depth
        item = state.history[idx]
        k = min(max(1, round(self.tokens * state.scale)), item.n_tokens)
        state.history[idx] = state.rewrite(item, k, rng)
        return "edit"


class TruncateToolOutputs(BaseModel):
    """Tool outputs older than the last ``keep_last`` steps are cut to ``max_tokens`` tokens (retroactive
    clearing of stale tool results). Each truncation changes history already cached."""

    model_config = _BASE
    kind: Literal["truncate_tool_outputs"]
    keep_last: int = Field(default=3, ge=0)
    max_tokens: int = Field(default=32, ge=0)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> str | None:
        limit = max(0, round(self.max_tokens * state.scale))
        changed = False
        for i, item in enumerate(state.history):
            if item.kind != "tool_output" or item.step > state.step - self.keep_last - 1:
                continue
            if item.n_tokens > limit and not item.meta.get("truncated"):
                state.history[i] = state.truncate(item, limit)
                changed = True
        return "edit" if changed else None


class SlidingWindow(BaseModel):
    """Drop the oldest history items (never the system/tools/document prefix) until the prompt fits
    ``budget_tokens``. Every drop moves all later tokens, so reuse falls back to the static prefix."""

    model_config = _BASE
    kind: Literal["sliding_window"]
    budget_tokens: int = Field(ge=1)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> str | None:
        budget = max(1, round(self.budget_tokens * state.scale))
        dropped = False
        while len(state.history) > 1 and state.prompt_tokens() > budget:
            state.history.pop(0)
            dropped = True
        return "reset" if dropped else None


class Compaction(BaseModel):
    """When the prompt passes ``threshold_tokens``, replace the history (all but the newest
    ``keep_last`` items) by a summary of ``summary_tokens`` tokens, like Claude Code's auto-compact."""

    model_config = _BASE
    kind: Literal["compaction"]
    threshold_tokens: int = Field(ge=1)
    summary_tokens: int = Field(default=2000, ge=1)
    keep_last: int = Field(default=1, ge=0)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> str | None:
        if state.prompt_tokens() <= max(1, round(self.threshold_tokens * state.scale)):
            return None
        keep = state.history[len(state.history) - self.keep_last:] if self.keep_last else []
        summary = state.new_segment("summary", max(1, round(self.summary_tokens * state.scale)))
        state.history = [summary, *keep]
        return "compaction"


class DropHistory(BaseModel):
    """With probability ``probability`` per request, drop the oldest ``fraction`` of the history items (the
    system/tools/document prefix stays): a client that clears or rebuilds its context (``/clear``, a resumed
    session, a context rebuilt from files). Reuse falls back to the static prefix (``reset``)."""

    model_config = _BASE
    kind: Literal["drop_history"]
    probability: float = Field(default=0.01, ge=0, le=1)
    fraction: float = Field(default=0.5, gt=0, le=1)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> str | None:
        if state.step == 0 or rng.random() >= self.probability or len(state.history) < 2:
            return None
        k = min(len(state.history) - 1, max(1, int(round(self.fraction * len(state.history)))))
        state.history = state.history[k:]
        return "reset"


class ReorderTools(BaseModel):
    """With probability ``probability`` per request, shuffle the tool definitions (clients that build the
    tool list from an unordered set). The new order persists until the next shuffle."""

    model_config = _BASE
    kind: Literal["reorder_tools"]
    probability: float = Field(default=0.1, ge=0, le=1)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> str | None:
        if state.step == 0 or len(state.tools) < 2 or rng.random() >= self.probability:
            return None
        order = list(state.tools)
        while order == state.tools:
            rng.shuffle(order)
        state.tools = order
        return "edit"


class StripReasoning(BaseModel):
    """Drop the reasoning part of assistant outputs from history, except in the newest ``keep_last``
    outputs. With keep_last = 0 the parent's output is re-sent without its reasoning (the parent's prompt is
    still a prefix); with keep_last >= 1 each older output is stripped later, which edits cached history."""

    model_config = _BASE
    kind: Literal["strip_reasoning"]
    keep_last: int = Field(default=0, ge=0)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> str | None:
        outputs = [i for i, it in enumerate(state.history) if it.reasoning_tokens > 0]
        for i in outputs[: max(0, len(outputs) - self.keep_last)]:
            state.history[i] = state.strip(state.history[i])
        return None


Policy = Annotated[
    Union[AppendOnly, VolatilePrefix, EditTurn, TruncateToolOutputs, SlidingWindow, Compaction, ReorderTools,
          StripReasoning, DropHistory],
    Field(discriminator="kind"),
]
POLICY_KINDS = ("append_only", "volatile_prefix", "edit_turn", "truncate_tool_outputs", "sliding_window",
                "compaction", "reorder_tools", "strip_reasoning", "drop_history")
