"""Model routing and cascades, offline: which *model* serves each request of a trace, and what that does to
each model's prefix cache.

This is not :mod:`.routing`.  That module balances load across identical *replicas* of one model (any replica
can serve any request; the question is where its prefix is cached).  Here the models differ (a small cheap one,
a large one, or N of them): the choice changes the answer's cost and quality, a request may be *escalated*
(sent twice: the small model's attempt, then the same prompt to the large one), and each model keeps its own
KV cache, so a session that moves between models recomputes its history on the other one (``model_switch``).
The two compose (each model could itself have replicas) but share no state or policy, so they are two modules.

Pieces, bottom up:

* **policies**: pydantic specs in one registry (``@model_routing_policy("name")``, as the history policies in
  :mod:`kvscope.workloads.policies`): ``all-small``, ``all-large``, ``rule`` (first matching rule by
  ``input_kind``, prompt length, step, or a trace/labels column), ``cascade`` (small first; escalate when the
  small answer fails a check: a label, a length limit, a mean-logprob threshold read from a signal column that a
  recorded run supplies).  Each decision carries its reason.  Stickiness (``per-step`` or
  ``sticky-after-escalation``) is applied by :func:`route_requests`, the same for every policy.
* **the offline model**: :func:`simulate_routes` runs every *attempt* (a cascade's small attempt is a real
  request on the small pool, its answer discarded; then the large attempt) through one exact simulator
  :class:`~.simulator.Replica` per model, each with its own block size and pool size; so ``all-small`` is the
  single-pool simulator, block for block.  A discarded small answer's output blocks get unique hashes (the
  next prompt carries the large model's answer, not the small one's).
* **the fast path**: :class:`RoutingIndex` answers the same question for unbounded pools from a matrix of
  pairwise common-prefix lengths (chained hashes: block ``i`` of a request is cached on a model iff an earlier
  attempt on that model shares its first ``i+1`` blocks, so the hit is the largest common prefix with an earlier
  attempt there), built once per block size; each policy variant is then two numpy reductions, which is what
  lets a sweep evaluate hundreds of rules in seconds.  It holds N² int32, so it is used up to
  :data:`FAST_PATH_MAX_REQUESTS` requests; larger traces and bounded pools take the simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.cachemodel.simulator import Replica, SimConfig
from kvscope.harness.cachemodel.trace_io import detect_kind, read_kvscope_trace
from kvscope.harness.common.errors import ConfigError, format_validation_error, load_yaml_mapping
from kvscope.harness.common.numbers import nan_to_none
from kvscope.workloads.errors import TraceFileError
from kvscope.workloads.tagged_registry import TaggedRegistry
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

_BASE = ConfigDict(extra="forbid", frozen=True)
STICKINESS = ("per-step", "sticky-after-escalation")
INPUT_KINDS = ("task", "user", "tool_output")
#: Largest trace the pairwise-prefix fast path takes (N² int32 per block size: 64 MiB at 4,096).
FAST_PATH_MAX_REQUESTS = 4096


# --------------------------------------------------------------------------------------------- requests

@dataclass(frozen=True)
class RequestFacts:
    """What a policy may look at for one request: the trace's fields plus per-request signal columns (labels,
    a recorded run's mean logprob, ...)."""

    request_id: int
    session_id: str | None
    step: int
    input_kind: str | None
    prompt_tokens: int
    output_tokens: int
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Route:
    """A policy's decision for one request: the model that answers first, why, and (cascade) the model the
    request is escalated to after the first answer failed its check."""

    model: str
    reason: str
    escalate_to: str | None = None
    escalate_reason: str | None = None


# --------------------------------------------------------------------------------------------- policies

class ModelRoutingPolicy(BaseModel):
    """Base of every model-routing policy; ``kind`` is set by :func:`model_routing_policy`."""

    model_config = _BASE
    kind: str

    def models_named(self) -> list[str]:
        """Model names the policy refers to (checked against the spec's models)."""
        return []

    def columns_needed(self) -> list[str]:
        """Signal columns the policy reads (checked against the trace and the labels)."""
        return []

    def decide(self, req: RequestFacts, models: Sequence[str]) -> Route:
        raise NotImplementedError


_REGISTRY: TaggedRegistry[ModelRoutingPolicy] = TaggedRegistry(ModelRoutingPolicy, "model routing policy")
model_routing_policy = _REGISTRY.register
"""Register a policy model under the spec tag ``kind`` (the class gets ``kind: Literal[kind]``)."""
policy_kinds = _REGISTRY.kinds

Policy = _REGISTRY.annotated


@model_routing_policy("all-small")
class AllSmall(ModelRoutingPolicy):
    """Every request to the first (cheapest) model."""

    def decide(self, req: RequestFacts, models: Sequence[str]) -> Route:
        return Route(models[0], "all-small")


@model_routing_policy("all-large")
class AllLarge(ModelRoutingPolicy):
    """Every request to the last (largest) model."""

    def decide(self, req: RequestFacts, models: Sequence[str]) -> Route:
        return Route(models[-1], "all-large")


class Rule(BaseModel):
    """One rule: every condition given must hold; the request then goes to ``model``."""

    model_config = _BASE
    model: str
    input_kind: list[Literal["task", "user", "tool_output"]] | None = None
    min_prompt_tokens: int | None = Field(default=None, ge=0)
    max_prompt_tokens: int | None = Field(default=None, ge=0)
    min_step: int | None = Field(default=None, ge=0)
    max_step: int | None = Field(default=None, ge=0)
    column: str | None = None
    equals: Any = None

    @model_validator(mode="after")
    def _column_pair(self) -> Rule:
        if (self.column is None) != (self.equals is None):
            raise ValueError("column and equals go together")
        return self

    def matches(self, r: RequestFacts) -> str | None:
        """The reason (conditions that held) or None."""
        why = []
        if self.input_kind is not None:
            if r.input_kind not in self.input_kind:
                return None
            why.append(f"input_kind={r.input_kind}")
        if self.min_prompt_tokens is not None:
            if r.prompt_tokens < self.min_prompt_tokens:
                return None
            why.append(f"prompt_tokens>={self.min_prompt_tokens}")
        if self.max_prompt_tokens is not None:
            if r.prompt_tokens > self.max_prompt_tokens:
                return None
            why.append(f"prompt_tokens<={self.max_prompt_tokens}")
        if self.min_step is not None:
            if r.step < self.min_step:
                return None
            why.append(f"step>={self.min_step}")
        if self.max_step is not None:
            if r.step > self.max_step:
                return None
            why.append(f"step<={self.max_step}")
        if self.column is not None:
            if r.columns.get(self.column) != self.equals:
                return None
            why.append(f"{self.column}={self.equals!r}")
        return ",".join(why) or "always"


@model_routing_policy("rule")
class RulePolicy(ModelRoutingPolicy):
    """The first matching rule picks the model; no match → ``default`` (the first model if unset)."""

    rules: list[Rule] = Field(min_length=1)
    default: str | None = None

    def models_named(self) -> list[str]:
        return [r.model for r in self.rules] + ([self.default] if self.default else [])

    def columns_needed(self) -> list[str]:
        return [r.column for r in self.rules if r.column]

    def decide(self, req: RequestFacts, models: Sequence[str]) -> Route:
        for i, rule in enumerate(self.rules):
            why = rule.matches(req)
            if why is not None:
                return Route(rule.model, f"rule {i}: {why}")
        return Route(self.default or models[0], "no rule matched")


_FAILED = {False, "fail", "failed", "false", "0", "no"}


@model_routing_policy("cascade")
class CascadePolicy(ModelRoutingPolicy):
    """Small model first; escalate to ``large`` when its answer fails any check given:

    * ``label_column``: a per-request pass/fail label (false / 0 / "fail" escalates), e.g. an eval's verdict;
    * ``max_output_tokens``: the small answer is longer than this (its length from ``output_column``, else the
      trace's planned output);
    * ``min_mean_logprob``: the small answer's mean token log-probability (``logprob_column``, from a recorded
      run) is below this threshold (≤ 0).
    """

    small: str | None = None
    large: str | None = None
    label_column: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    output_column: str | None = None
    min_mean_logprob: float | None = Field(default=None, le=0.0)
    logprob_column: str = "mean_logprob"

    @model_validator(mode="after")
    def _one_check(self) -> CascadePolicy:
        if self.label_column is None and self.max_output_tokens is None and self.min_mean_logprob is None:
            raise ValueError("a cascade needs a check: label_column, max_output_tokens or min_mean_logprob")
        return self

    def models_named(self) -> list[str]:
        return [m for m in (self.small, self.large) if m]

    def columns_needed(self) -> list[str]:
        cols = [self.label_column, self.output_column]
        if self.min_mean_logprob is not None:
            cols.append(self.logprob_column)
        return [c for c in cols if c]

    def decide(self, req: RequestFacts, models: Sequence[str]) -> Route:
        small, large = self.small or models[0], self.large or models[-1]
        fails = []
        if self.label_column is not None:
            v = req.columns.get(self.label_column)
            if (v.strip().lower() if isinstance(v, str) else v) in _FAILED:
                fails.append(f"{self.label_column}={v!r}")
        if self.max_output_tokens is not None:
            n = req.columns.get(self.output_column) if self.output_column else req.output_tokens
            if n is not None and int(n) > self.max_output_tokens:
                fails.append(f"output {int(n)}>{self.max_output_tokens} tokens")
        if self.min_mean_logprob is not None:
            lp = req.columns.get(self.logprob_column)
            if lp is not None and float(lp) < self.min_mean_logprob:
                fails.append(f"{self.logprob_column} {float(lp):.3f}<{self.min_mean_logprob}")
        if fails:
            return Route(small, "cascade: small first", large, "failed " + "; ".join(fails))
        return Route(small, "cascade: small answer passed")


@model_routing_policy("recorded")
class RecordedPolicy(ModelRoutingPolicy):
    """Decisions made elsewhere, one per request: the serving model's name in ``model_column`` (a recorded
    run's records, a router's log, a labels file) and, optionally, whether it was an escalation from the first
    model (``escalated_column``, true / 1), so a recorded cascade is replayed attempt for attempt."""

    model_column: str = "model"
    escalated_column: str | None = None

    def columns_needed(self) -> list[str]:
        return [self.model_column] + ([self.escalated_column] if self.escalated_column else [])

    def decide(self, req: RequestFacts, models: Sequence[str]) -> Route:
        model = req.columns.get(self.model_column)
        if model not in models:
            raise ConfigError(f"request {req.request_id}: {self.model_column}={model!r} is not a model of the spec "
                              f"({', '.join(models)})")
        esc = req.columns.get(self.escalated_column) if self.escalated_column else None
        if (esc.strip().lower() in ("true", "1", "yes") if isinstance(esc, str) else bool(esc)) and model != models[0]:
            return Route(models[0], "recorded: small first", model, f"recorded escalation to {model}")
        return Route(str(model), f"recorded: {model}")


# ------------------------------------------------------------------------------------------------ spec

class ModelSpec(BaseModel):
    """One served model: its cache geometry (vLLM terms) and its price sheet (a pricing preset or YAML)."""

    model_config = _BASE
    name: str = Field(min_length=1)
    block_size: int = Field(default=16, ge=1)
    num_gpu_blocks: int | None = Field(default=None, ge=2)
    pricing: str | None = None


class ModelRoutingSpec(BaseModel):
    """A routing experiment: models (cheapest first), a policy, stickiness."""

    model_config = _BASE
    models: list[ModelSpec] = Field(default_factory=lambda: [ModelSpec(name="small"), ModelSpec(name="large")],
                                    min_length=1)
    policy: Policy
    stickiness: Literal["per-step", "sticky-after-escalation"] = "per-step"

    @model_validator(mode="after")
    def _names(self) -> ModelRoutingSpec:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names repeat: {names}")
        for n in self.policy.models_named():
            if n not in names:
                raise ValueError(f"policy names unknown model {n!r}; models: {', '.join(names)}")
        return self

    @property
    def model_names(self) -> list[str]:
        return [m.name for m in self.models]


def load_spec(data: dict | str | Path, source: str = "routing spec") -> ModelRoutingSpec:
    """Validate a spec (a dict, or a YAML/JSON file); errors are one-line :class:`ConfigError` s."""
    if not isinstance(data, dict):
        source = str(data)
        data = load_yaml_mapping(data, "routing spec")
    try:
        return ModelRoutingSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, source)) from None


def _one_line(exc: ValidationError, source: str) -> str:
    return "; ".join(format_validation_error(exc, source, ModelRoutingSpec).splitlines())


# --------------------------------------------------------------------------------------------- routing

@dataclass(frozen=True)
class Attempt:
    """One request sent to one model.  ``served`` is False for a cascade's discarded small attempt."""

    index: int  # position of the request in the trace (0..N-1)
    model: str
    served: bool
    reason: str


class SessionRouter:
    """The routing decision one request at a time, stickiness included: what :func:`route_requests` applies to a
    whole trace and what a live replay (``harness/replay/model_router.py``) applies as requests are sent, so the
    two decide alike.  Live, the first model is needed before the small model has answered
    (:meth:`first_model`); the decision, escalation included, is taken once its answer's signals are in the
    request's columns (:meth:`attempts`)."""

    def __init__(self, spec: ModelRoutingSpec) -> None:
        self.spec = spec
        self.models = spec.model_names
        self.sticky = spec.stickiness == "sticky-after-escalation"
        self._stuck: dict[Any, tuple[str, int]] = {}

    @staticmethod
    def session_key(r: RequestFacts) -> Any:
        return r.session_id if r.session_id is not None else f"#{r.request_id}"

    def first_model(self, r: RequestFacts) -> str:
        """The model the request is sent to first (the stuck one, or the policy's first choice)."""
        stuck = self._stuck.get(self.session_key(r)) if self.sticky else None
        return stuck[0] if stuck else self.spec.policy.decide(r, self.models).model

    def attempts(self, index: int, r: RequestFacts) -> list[Attempt]:
        """The request's attempts (one, or two for an escalation); records the session's stickiness."""
        key = self.session_key(r)
        if self.sticky and key in self._stuck:
            m, step = self._stuck[key]
            return [Attempt(index, m, True, f"sticky: session on {m} since step {step}")]
        route = self.spec.policy.decide(r, self.models)
        if route.escalate_to is not None:
            atts = [Attempt(index, route.model, False, route.reason),
                    Attempt(index, route.escalate_to, True, f"escalated: {route.escalate_reason}")]
        else:
            atts = [Attempt(index, route.model, True, route.reason)]
        served = atts[-1].model
        if self.sticky and served != self.models[0]:
            self._stuck[key] = (served, r.step)
        return atts


def route_requests(facts: Sequence[RequestFacts], spec: ModelRoutingSpec) -> list[list[Attempt]]:
    """The attempts of every request, in trace order (one, or two for an escalation), stickiness applied:
    with ``sticky-after-escalation`` a session whose request was served by a model other than the first stays
    on that model (no cascade check) for the rest of the session."""
    router = SessionRouter(spec)
    return [router.attempts(i, r) for i, r in enumerate(facts)]


@dataclass
class RoutedRequest:
    """The offline prediction for one request under a policy."""

    request_id: int
    session_id: str | None
    step: int
    model: str
    reason: str
    escalated: bool
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # on the serving model
    #: the discarded small attempt (escalations only): its model, prefill it computed, output it generated
    small_attempt_model: str | None = None
    small_attempt_cached_tokens: int = 0
    wasted_prefill_tokens: int = 0
    wasted_output_tokens: int = 0
    #: tokens cached on the model that served the session's previous request but recomputed here (over both
    #: attempts of an escalation); 0 when the previous request ran on the same model
    model_switch_tokens: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def add_attempt(self, model: str, served: bool, cached_tokens: int, previous_model: str | None,
                    previous_had_tokens: int, output_tokens: int) -> None:
        """Account one attempt on ``model`` that found ``cached_tokens`` there: the history the session's previous
        model held (``previous_had_tokens``) and this one recomputed, and, for the discarded small attempt of an
        escalation, the prefill and the ``output_tokens`` it wasted.  One rule for the sequential pools and the
        scheduler model under concurrency."""
        if previous_model is not None and previous_model != model:
            self.model_switch_tokens += max(0, previous_had_tokens - cached_tokens)
        if served:
            self.cached_tokens = cached_tokens
        else:
            self.small_attempt_model = model
            self.small_attempt_cached_tokens = cached_tokens
            self.wasted_prefill_tokens = self.prompt_tokens - cached_tokens
            self.wasted_output_tokens = output_tokens


def _attempt_request(req: SimRequest, served: bool) -> SimRequest:
    """A discarded attempt's answer is not the one the history carries: only its prompt blocks can be shared."""
    if served:
        return req
    n = req.prompt_tokens // req.block_size
    return SimRequest(req.request_id, req.prompt_tokens, req.output_tokens, req.hashes[:n], req.block_size,
                      session_id=req.session_id, cache_salt=req.cache_salt)


def simulate_routes(attempts: Sequence[Sequence[Attempt]], facts: Sequence[RequestFacts],
                    requests_by_block: dict[int, list[SimRequest]], spec: ModelRoutingSpec,
                    progress: Callable[[int], None] | None = None) -> list[RoutedRequest]:
    """Run every attempt through its model's exact simulator pool, in trace order (sequential mode);
    ``progress(n)`` is told every 256 requests."""
    reps = {m.name: Replica(SimConfig(m.block_size, m.num_gpu_blocks)) for m in spec.models}
    bs = {m.name: m.block_size for m in spec.models}
    last_model: dict[Any, str] = {}
    out = []
    for atts, r in zip(attempts, facts):
        key = r.session_id if r.session_id is not None else f"#{r.request_id}"
        prev = last_model.get(key)
        rr = RoutedRequest(r.request_id, r.session_id, r.step, atts[-1].model, atts[-1].reason, len(atts) > 1,
                           r.prompt_tokens, r.output_tokens, 0)
        # What the previous request's model held for this prompt before any attempt of it ran there.
        had = reps[prev].probe(requests_by_block[bs[prev]][atts[0].index]) * bs[prev] if prev is not None else 0
        for a in atts:
            req = _attempt_request(requests_by_block[bs[a.model]][a.index], a.served)
            cached, _fits = reps[a.model].run_sequential(req)
            n = r.columns.get(getattr(spec.policy, "output_column", None) or "", None)
            rr.add_attempt(a.model, a.served, cached, prev, had, int(n) if n is not None else r.output_tokens)
        last_model[key] = atts[-1].model
        out.append(rr)
        if progress and len(out) % 256 == 0:
            progress(256)
    if progress:
        progress(len(out) % 256)
    return out


class RoutingIndex:
    """Pairwise common-prefix lengths (in blocks) of a trace's requests, per block size, for unbounded pools.

    ``cached(r on m) = min(cap_r, max over earlier attempts a on m of min(lcp(r, a), blocks a left cached))``:
    with chained hashes a block is cached iff an earlier attempt computed the same chain up to it, and an
    unbounded pool never forgets one.  Equal to :func:`simulate_routes` with ``num_gpu_blocks=None`` (a test
    checks it on random policies).
    """

    def __init__(self, requests: Sequence[SimRequest]) -> None:
        n = len(requests)
        self.block_size = requests[0].block_size if n else 16
        B = self.block_size
        self.cap = np.array([max(r.prompt_tokens - 1, 0) // B for r in requests], dtype=np.int64)
        computed = [r.prompt_tokens + (r.output_tokens - 1 if r.output_tokens > 0 else 0) for r in requests]
        #: blocks a served / a discarded attempt leaves hashed (unknown outputs never hit)
        self.served_len = np.array([min(len(r.hashes), c // B) for r, c in zip(requests, computed)], dtype=np.int64)
        self.attempt_len = np.minimum(self.served_len, [r.prompt_tokens // B for r in requests])
        # Sorted lexicographically, the common prefix of two hash chains is the minimum of the adjacent common
        # prefixes between them (the LCP-array property), so N-1 comparisons give the whole matrix.
        hs = [r.hashes for r in requests]
        order = sorted(range(n), key=hs.__getitem__)
        adj = np.zeros(max(n - 1, 0), dtype=np.int32)
        for p in range(n - 1):
            a, b = hs[order[p]], hs[order[p + 1]]
            lo, hi = 0, min(len(a), len(b))  # chained hashes: equal at k implies equal before k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if a[mid - 1] == b[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            adj[p] = lo
        lcp_sorted = np.zeros((n, n), dtype=np.int32)
        for p in range(n - 1):
            run = np.minimum.accumulate(adj[p:])
            lcp_sorted[p, p + 1:] = run
            lcp_sorted[p + 1:, p] = run
        inv = np.empty(n, dtype=np.int64)
        inv[np.asarray(order, dtype=np.int64)] = np.arange(n)
        lcp = lcp_sorted[np.ix_(inv, inv)] if n else lcp_sorted
        self.lcp = lcp
        self._lower = np.tril(np.ones((n, n), dtype=bool), k=-1)

    def cached_blocks(self, holds: np.ndarray) -> np.ndarray:
        """Per request, the hit on a pool where request ``j`` left ``holds[j]`` blocks (0: never ran there),
        counting only earlier requests."""
        m = np.minimum(self.lcp, holds[None, :].astype(np.int32))
        m = np.where(self._lower, m, 0)
        return np.minimum(m.max(axis=1) if len(holds) else np.zeros(0, np.int64), self.cap)


def predict_fast(attempts: Sequence[Sequence[Attempt]], facts: Sequence[RequestFacts],
                 index_by_block: dict[int, RoutingIndex], spec: ModelRoutingSpec) -> list[RoutedRequest]:
    """:func:`simulate_routes` for unbounded pools, from :class:`RoutingIndex` (two reductions per model)."""
    n = len(facts)
    bs = {m.name: m.block_size for m in spec.models}
    holds = {m: np.zeros(n, dtype=np.int64) for m in bs}
    for atts in attempts:
        for a in atts:
            idx = index_by_block[bs[a.model]]
            holds[a.model][a.index] = idx.served_len[a.index] if a.served else idx.attempt_len[a.index]
    hits = {m: index_by_block[bs[m]].cached_blocks(holds[m]) * bs[m] for m in bs}
    last_model: dict[Any, str] = {}
    out = []
    for atts, r in zip(attempts, facts):
        i = atts[0].index
        key = r.session_id if r.session_id is not None else f"#{r.request_id}"
        prev = last_model.get(key)
        rr = RoutedRequest(r.request_id, r.session_id, r.step, atts[-1].model, atts[-1].reason, len(atts) > 1,
                           r.prompt_tokens, r.output_tokens, int(hits[atts[-1].model][i]))
        had = _probe_fast(index_by_block[bs[prev]], holds[prev], i) * bs[prev] if prev is not None else 0
        for a in atts:
            col = getattr(spec.policy, "output_column", None)
            v = r.columns.get(col) if col else None
            rr.add_attempt(a.model, a.served, int(hits[a.model][i]), prev, had,
                           int(v) if v is not None else r.output_tokens)
        last_model[key] = atts[-1].model
        out.append(rr)
    return out


def _probe_fast(idx: RoutingIndex, holds: np.ndarray, i: int) -> int:
    if i == 0:
        return 0
    return int(min(np.minimum(idx.lcp[i, :i], holds[:i]).max(), idx.cap[i]))


# ---------------------------------------------------------------------------------------------- totals

def model_switch_tokens(routed: Sequence[RoutedRequest]) -> dict[str, int]:
    """Per request id, history recomputed because the previous step ran on another model: the figure
    ``kvscope explain``'s ``model_switch`` cause reads (only requests where it is > 0)."""
    return {str(r.request_id): r.model_switch_tokens for r in routed if r.model_switch_tokens}


def totals(routed: Sequence[RoutedRequest], model_names: Sequence[str]) -> dict:
    """Per policy: hit rate per model (attempts included), escalation rate, recomputed-by-switch tokens."""
    per: dict[str, dict[str, int]] = {m: {"requests": 0, "attempts": 0, "prompt_tokens": 0, "cached_tokens": 0,
                                          "output_tokens": 0} for m in model_names}
    for r in routed:
        d = per[r.model]
        d["requests"] += 1
        d["attempts"] += 1
        d["prompt_tokens"] += r.prompt_tokens
        d["cached_tokens"] += r.cached_tokens
        d["output_tokens"] += r.output_tokens
        if r.small_attempt_model is not None:
            s = per[r.small_attempt_model]
            s["attempts"] += 1
            s["prompt_tokens"] += r.prompt_tokens
            s["cached_tokens"] += r.small_attempt_cached_tokens
            s["output_tokens"] += r.wasted_output_tokens
    n = len(routed)
    esc = sum(r.escalated for r in routed)
    prompt = sum(d["prompt_tokens"] for d in per.values())
    cached = sum(d["cached_tokens"] for d in per.values())
    return {
        "requests": n,
        "sessions": len({r.session_id for r in routed}),
        "escalations": esc,
        "escalation_rate": esc / n if n else 0.0,
        "prompt_tokens_sent": prompt,
        "cached_tokens": cached,
        "token_hit_ratio": cached / prompt if prompt else 0.0,
        "wasted_prefill_tokens": sum(r.wasted_prefill_tokens for r in routed),
        "wasted_output_tokens": sum(r.wasted_output_tokens for r in routed),
        "model_switch_tokens": sum(r.model_switch_tokens for r in routed),
        "requests_after_switch": sum(1 for r in routed if r.model_switch_tokens),
        "per_model": {m: {**d, "token_hit_ratio": d["cached_tokens"] / d["prompt_tokens"] if d["prompt_tokens"]
                          else 0.0} for m, d in per.items()},
    }




# ---------------------------------------------------------------------------------------------- inputs

@dataclass
class RoutingInputs:
    """A trace read once: the facts policies see, and its requests hashed at each model's block size."""

    path: str
    facts: list[RequestFacts]
    requests_by_block: dict[int, list[SimRequest]]
    columns: tuple[str, ...]
    _index: dict[int, RoutingIndex] = field(default_factory=dict)

    def index(self, block_size: int) -> RoutingIndex:
        """The fast path's pairwise-prefix index at ``block_size`` (built on first use)."""
        if block_size not in self._index:
            self._index[block_size] = RoutingIndex(self.requests_by_block[block_size])
        return self._index[block_size]


_TRACE_COLUMNS = ("request_id", "session_id", "step", "input_kind", "prompt_tokens", "output_tokens")
#: trace columns that are not signals (token lists, JSON text)
_NOT_SIGNALS = {"prompt_segment_ids", "messages"}


def read_labels(path: Any, request_ids: Sequence[int]) -> Any:
    """A per-request signal table (CSV, JSON lines or Parquet; or a data frame already read, e.g. a recorded
    run's decisions, named by its ``source`` attribute) with a ``request_id`` column and one column per signal (a
    pass/fail label, ``mean_logprob`` from a recorded run, ...); its request ids must be exactly the trace's."""
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

    p = Path(path) if isinstance(path, (str, Path)) else Path(str(path.attrs.get("source", "labels")))
    try:
        if not isinstance(path, (str, Path)):
            df = path
        elif p.suffix == ".parquet":
            df = pd.read_parquet(p)
        elif p.suffix in (".jsonl", ".json"):
            df = pd.read_json(p, lines=p.suffix == ".jsonl")
        else:
            df = pd.read_csv(p)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{p}: cannot read labels: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if "request_id" not in df.columns:
        raise ConfigError(f"{p}: labels need a request_id column; got {', '.join(map(str, df.columns))}")
    ids = pd.to_numeric(df["request_id"], errors="coerce")
    if ids.isna().any():
        raise ConfigError(f"{p}: request_id must be integers (row {int(ids.isna().to_numpy().argmax())})")
    df = df.assign(request_id=ids.astype("int64"))
    if df["request_id"].duplicated().any():
        dup = int(df["request_id"][df["request_id"].duplicated()].iloc[0])
        raise ConfigError(f"{p}: request_id {dup} appears more than once")
    have, want = set(df["request_id"].tolist()), {int(i) for i in request_ids}
    if have - want:
        extra = sorted(have - want)
        raise ConfigError(f"{p}: {len(extra)} labelled request ids are not in the trace (first: {extra[0]}); "
                          "labels must match the trace's requests")
    if want - have:
        missing = sorted(want - have)
        raise ConfigError(f"{p}: {len(missing)} of the trace's requests have no label (first: {missing[0]}); "
                          "labels must match the trace's requests")
    return df.set_index("request_id").loc[list(request_ids)]


def routing_facts(trace: Any, labels: Any = None) -> tuple[list[RequestFacts], tuple[str, ...]]:
    """What policies see of a trace (a :class:`~kvscope.workloads.trace.Trace`), one per request in request-id
    order, with its signal columns (the trace's own beyond the standard ones, and the labels' joined on
    ``request_id``); and the names of those columns."""
    frame = trace.requests
    extra = [c for c in frame.columns if c not in _TRACE_COLUMNS and c not in _NOT_SIGNALS]
    cols: dict[str, list] = {c: frame[c].tolist() for c in extra}
    ids = frame["request_id"].astype(int).tolist()
    if labels is not None:
        lab = read_labels(labels, ids)
        for c in lab.columns:
            cols[str(c)] = [nan_to_none(v) for v in lab[c].tolist()]
    facts = [RequestFacts(int(rid), None if sid is None else str(sid), int(st), ik if isinstance(ik, str) else None,
                          int(pt), int(ot), {c: v[i] for c, v in cols.items()})
             for i, (rid, sid, st, ik, pt, ot) in enumerate(zip(ids, frame["session_id"], frame["step"],
                                                                frame["input_kind"], frame["prompt_tokens"],
                                                                frame["output_tokens"]))]
    return facts, tuple(cols)


def load_routing_inputs(path: str | Path, block_sizes: Sequence[int], labels: Any = None,
                        progress: Callable[[str], None] | None = None) -> RoutingInputs:
    """Read a kvscope trace dir once, hash it at every block size, and join the labels."""
    # deferred: it loads pandas, pyarrow, which importing this module must not
    from kvscope.workloads.trace import Trace

    if not Path(path).exists():
        raise TraceFileError(f"{path}: no such trace")
    kind = detect_kind(path)
    if kind != "kvscope":
        raise TraceFileError(f"{path}: model routing reads a kvscope trace directory (it needs step and input_kind); "
                             f"this is a {kind} trace (convert it with `kvscope workload import`)")
    trace = Trace.read(path)
    facts, cols = routing_facts(trace, labels)
    by_block = {}
    for bs in sorted(set(block_sizes)):
        if progress:
            progress(f"hashing at block size {bs}")
        by_block[bs] = read_kvscope_trace(path, bs, trace=trace).requests
    return RoutingInputs(str(path), facts, by_block, cols)


def check_columns(spec: ModelRoutingSpec, inputs: RoutingInputs) -> None:
    """Every signal column the policy reads exists in the trace or the labels."""
    for c in spec.policy.columns_needed():
        if c not in inputs.columns:
            raise ConfigError(f"policy {spec.policy.kind} reads column {c!r}, which neither the trace nor the labels "
                              f"have; columns: {', '.join(inputs.columns) or 'none'}")
    if isinstance(spec.policy, RecordedPolicy):  # every recorded model must be one of the spec's, before any work
        names = set(spec.model_names)
        for f in inputs.facts:
            if f.columns.get(spec.policy.model_column) not in names:
                spec.policy.decide(f, spec.model_names)  # raises the one-line error naming the request


def evaluate(spec: ModelRoutingSpec, inputs: RoutingInputs, *, fast: bool | None = None,
             progress: Callable[[int], None] | None = None) -> list[RoutedRequest]:
    """Route and predict: the fast path where every pool is unbounded and the trace is small enough (``fast``
    None), else the exact simulator."""
    check_columns(spec, inputs)
    attempts = route_requests(inputs.facts, spec)
    unbounded = all(m.num_gpu_blocks is None for m in spec.models)
    if fast is None:
        fast = unbounded and len(inputs.facts) <= FAST_PATH_MAX_REQUESTS
    elif fast and not unbounded:
        raise ValueError("the pairwise-prefix fast path models unbounded pools only; a model has num_gpu_blocks")
    if fast:
        out = predict_fast(attempts, inputs.facts, {m.block_size: inputs.index(m.block_size) for m in spec.models},
                           spec)
        if progress:
            progress(len(out))
        return out
    return simulate_routes(attempts, inputs.facts, inputs.requests_by_block, spec, progress)


__all__ = [
    "FAST_PATH_MAX_REQUESTS",
    "INPUT_KINDS",
    "STICKINESS",
    "Attempt",
    "ModelRoutingPolicy",
    "ModelRoutingSpec",
    "ModelSpec",
    "RequestFacts",
    "Route",
    "RoutedRequest",
    "RoutingIndex",
    "RoutingInputs",
    "Rule",
    "SessionRouter",
    "check_columns",
    "evaluate",
    "load_routing_inputs",
    "load_spec",
    "model_routing_policy",
    "model_switch_tokens",
    "policy_kinds",
    "predict_fast",
    "read_labels",
    "route_requests",
    "routing_facts",
    "simulate_routes",
    "totals",
]
