"""History policies: how an agent or chat client rebuilds its prompt from the conversation so far.

Each policy is a small pydantic model (the spec entry) plus an ``apply`` hook that the generator calls with the
session's mutable history just before it builds the next prompt. Policies compose in the listed order. A
policy that changes tokens already sent (an edit, a truncation, a compaction) replaces history items with new
segments, so the effect on reuse is visible in the trace: the prompt's segment list diverges from the parent's
at the changed item, and the request's ``transition`` says why (``edit``, ``reset``, ``compaction``).

Token parameters (``tokens``, ``position``, ``budget_tokens``, …) are multiplied by the spec's ``scale`` so that
a preset keeps its shape when it is shrunk to run on a CPU.

Adding a policy is one registration: ``@history_policy("name")`` on a :class:`HistoryPolicy` subclass. The
decorator gives the class its ``kind: Literal["name"]`` tag and records it in one registry, from which the spec's
discriminated union (:data:`Policy`), the allowed kinds (:func:`policy_kinds`) and the tag → model map used by
the spec's error messages (:func:`policy_models`) are all derived (``workloads/tagged_registry.py`` says how,
and why the union is built lazily).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from kvscope.workloads.prefix import Transition
from kvscope.workloads.tagged_registry import TaggedRegistry
from kvscope.workloads.trace_schema import SegmentKind
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


class HistoryPolicy(BaseModel):
    """Base of every history policy. ``kind`` is set by :func:`history_policy`; ``apply`` edits the session's
    history in place and returns the transition it caused (``edit``, ``reset``, ``compaction``) or None."""

    model_config = _BASE
    kind: str

    def apply(self, state: "SessionState", rng: np.random.Generator) -> Transition | None:
        raise NotImplementedError


_REGISTRY: TaggedRegistry[HistoryPolicy] = TaggedRegistry(HistoryPolicy, "history policy")
history_policy = _REGISTRY.register
"""Register a policy model under the spec tag ``kind``; returns the tagged model (a subclass of the decorated
class with ``kind: Literal[kind]``, so ``isinstance`` checks against the module name hold)."""
policy_kinds = _REGISTRY.kinds
policy_models = _REGISTRY.models

Policy = _REGISTRY.annotated
"""One entry of ``sessions.policies``: any registered policy, chosen by its ``kind``."""


@history_policy("append_only")
class AppendOnly(HistoryPolicy):
    """Keep everything: each prompt is the parent's prompt + the parent's output + the new input."""

    def apply(self, state: "SessionState", rng: np.random.Generator) -> Transition | None:
        return None


@history_policy("volatile_prefix")
class VolatilePrefix(HistoryPolicy):
    """A value that changes on every request (a timestamp, a request id) of ``tokens`` tokens inserted at
    token ``position`` of the system prompt. Nothing after ``position`` can be reused across requests."""
    tokens: int = Field(default=8, ge=1)
    position: int = Field(default=0, ge=0)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> Transition | None:
        state.new_volatile(self)
        return Transition.EDIT if state.step > 0 else None


@history_policy("edit_turn")
class EditTurn(HistoryPolicy):
    """With probability ``probability`` per request, rewrite ``tokens`` tokens of the history item ``depth``
    items back from the newest (1 = the newest). The rewrite persists, like a client that edits a message."""
    depth: int = Field(default=2, ge=1)
    tokens: int = Field(default=16, ge=1)
    probability: float = Field(default=0.1, ge=0, le=1)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> Transition | None:
        if state.step == 0 or rng.random() >= self.probability or len(state.history) < self.depth:
            return None
        idx = len(state.history) - self.depth
        item = state.history[idx]
        k = min(max(1, round(self.tokens * state.scale)), item.n_tokens)
        state.history[idx] = state.rewrite(item, k, rng)
        return Transition.EDIT


@history_policy("truncate_tool_outputs")
class TruncateToolOutputs(HistoryPolicy):
    """Tool outputs older than the last ``keep_last`` steps are cut to ``max_tokens`` tokens (retroactive
    clearing of stale tool results). Each truncation changes history already cached."""
    keep_last: int = Field(default=3, ge=0)
    max_tokens: int = Field(default=32, ge=0)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> Transition | None:
        limit = max(0, round(self.max_tokens * state.scale))
        changed = False
        for i, item in enumerate(state.history):
            if item.kind != SegmentKind.TOOL_OUTPUT or item.step > state.step - self.keep_last - 1:
                continue
            if item.n_tokens > limit and not item.meta.get("truncated"):
                state.history[i] = state.truncate(item, limit)
                changed = True
        return Transition.EDIT if changed else None


@history_policy("sliding_window")
class SlidingWindow(HistoryPolicy):
    """Drop the oldest history items (never the system/tools/document prefix) until the prompt fits
    ``budget_tokens``. Every drop moves all later tokens, so reuse falls back to the static prefix."""
    budget_tokens: int = Field(ge=1)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> Transition | None:
        budget = max(1, round(self.budget_tokens * state.scale))
        dropped = False
        while len(state.history) > 1 and state.prompt_tokens() > budget:
            state.history.pop(0)
            dropped = True
        return Transition.RESET if dropped else None


@history_policy("compaction")
class Compaction(HistoryPolicy):
    """When the prompt passes ``threshold_tokens``, replace the history (all but the newest
    ``keep_last`` items) by a summary of ``summary_tokens`` tokens, like Claude Code's auto-compact."""
    threshold_tokens: int = Field(ge=1)
    summary_tokens: int = Field(default=2000, ge=1)
    keep_last: int = Field(default=1, ge=0)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> Transition | None:
        if state.prompt_tokens() <= max(1, round(self.threshold_tokens * state.scale)):
            return None
        keep = state.history[len(state.history) - self.keep_last:] if self.keep_last else []
        summary = state.new_segment(SegmentKind.SUMMARY, max(1, round(self.summary_tokens * state.scale)))
        state.history = [summary, *keep]
        return Transition.COMPACTION


@history_policy("reorder_tools")
class ReorderTools(HistoryPolicy):
    """With probability ``probability`` per request, shuffle the tool definitions (clients that build the
    tool list from an unordered set). The new order persists until the next shuffle."""
    probability: float = Field(default=0.1, ge=0, le=1)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> Transition | None:
        if state.step == 0 or len(state.tools) < 2 or rng.random() >= self.probability:
            return None
        order = list(state.tools)
        while order == state.tools:
            rng.shuffle(order)
        state.tools = order
        return Transition.EDIT


@history_policy("strip_reasoning")
class StripReasoning(HistoryPolicy):
    """Drop the reasoning part of assistant outputs from history, except in the newest ``keep_last``
    outputs. With keep_last = 0 the parent's output is re-sent without its reasoning (the parent's prompt is
    still a prefix); with keep_last >= 1 each older output is stripped later, which edits cached history."""
    keep_last: int = Field(default=0, ge=0)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> Transition | None:
        outputs = [i for i, it in enumerate(state.history) if it.reasoning_tokens > 0]
        for i in outputs[: max(0, len(outputs) - self.keep_last)]:
            state.history[i] = state.strip(state.history[i])
        return None


@history_policy("drop_history")
class DropHistory(HistoryPolicy):
    """With probability ``probability`` per request, drop the oldest ``fraction`` of the history items (the
    system/tools/document prefix stays): a client that clears or rebuilds its context (``/clear``, a resumed
    session, a context rebuilt from files). Reuse falls back to the static prefix (``reset``)."""
    probability: float = Field(default=0.01, ge=0, le=1)
    fraction: float = Field(default=0.5, gt=0, le=1)

    def apply(self, state: "SessionState", rng: np.random.Generator) -> Transition | None:
        if state.step == 0 or rng.random() >= self.probability or len(state.history) < 2:
            return None
        k = min(len(state.history) - 1, max(1, int(round(self.fraction * len(state.history)))))
        state.history = state.history[k:]
        return Transition.RESET
