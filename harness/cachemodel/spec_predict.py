"""Speculative decoding configurations for the scheduler model: which drafts each request schedules and
accepts per decode step.

* ``ngram`` / ``suffix`` / ``oracle``: from the tokens, by the offline model (:mod:`.speculative`, what
  ``kvscope speculate`` runs): exact per request and step for greedy decoding.
* ``draft``: a draft model cannot be run here, so its acceptance is a parameter: each draft token is accepted
  with probability ``acceptance`` given the ones before it were, and a step's accepted count is laid out
  deterministically so that the running mean equals the expectation ``sum_{i=1..k} acceptance^i``.  With a
  named ``draft_model`` on a GPU, each step also pays the draft model's ``k`` decode passes
  (:class:`DraftStepCost`).

Spec strings (``kvscope predict --speculative``): ``ngram[:k=4,min=2,max=4]``, ``suffix[:depth=24,k=24,
min_prob=0.1,factor=1.0]``, ``oracle[:k=4]``, ``draft:k=4,acceptance=0.7[,draft_model=NAME]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.cachemodel.step_cost import StepCost

if TYPE_CHECKING:  # pragma: no cover
    from kvscope.workloads.trace import Trace

METHODS = ("ngram", "suffix", "oracle", "draft")


@dataclass(frozen=True)
class SpeculativeSpec:
    method: str
    params: dict

    @property
    def k(self) -> int:
        if self.method == "suffix":
            return int(self.params.get("k", self.params.get("depth", 24)))
        return int(self.params.get("k", 4))

    @property
    def label(self) -> str:
        return self.method + ("" if not self.params else ":" + ",".join(f"{k}={v}" for k, v in self.params.items()))

    def offline_config(self):
        """The :mod:`.speculative` config (None for ``draft``)."""
        from kvscope.harness.cachemodel.speculative import NgramConfig, OracleConfig, SuffixConfig  # deferred: the offline speculation model loads numba, only speculative configurations need it

        p = self.params
        if self.method == "ngram":
            return NgramConfig(self.k, int(p.get("min", 2)), int(p.get("max", 4)))
        if self.method == "suffix":
            depth = int(p.get("depth", 24))
            return SuffixConfig(num_speculative_tokens=int(p.get("k", depth)), max_tree_depth=depth,
                                min_token_prob=float(p.get("min_prob", 0.1)), max_spec_factor=float(p.get("factor", 1.0)))
        if self.method == "oracle":
            return OracleConfig(self.k)
        return None


_ALLOWED = {"ngram": {"k", "min", "max"}, "suffix": {"k", "depth", "min_prob", "factor"}, "oracle": {"k"},
            "draft": {"k", "acceptance", "draft_model"}}


def parse_speculative(text: str) -> SpeculativeSpec:
    """``METHOD[:key=value,...]``; ValueError naming the problem."""
    method, _, rest = text.strip().partition(":")
    method = method.strip().lower()
    if method not in METHODS:
        raise ValueError(f"--speculative {text!r}: unknown method {method!r}; allowed: {', '.join(METHODS)}")
    params: dict = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in _ALLOWED[method]:
            raise ValueError(f"--speculative {text!r}: {part!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(sorted(_ALLOWED[method]))}")
        if key == "draft_model":
            params[key] = value
            continue
        try:
            params[key] = int(value) if key in ("k", "min", "max", "depth") else float(value)
        except ValueError:
            raise ValueError(f"--speculative {text!r}: {key}={value!r} is not a number") from None
    spec = SpeculativeSpec(method, params)
    if spec.k < 1:
        raise ValueError(f"--speculative {text!r}: k must be 1 or more")
    if method == "draft":
        a = params.get("acceptance")
        if a is None or not 0 <= a <= 1:
            raise ValueError(f"--speculative {text!r}: a draft model needs acceptance=P with 0 <= P <= 1 "
                             "(the per-token acceptance; it cannot be computed without running the draft)")
    try:
        spec.offline_config()
    except ValueError as exc:
        raise ValueError(f"--speculative {text!r}: {exc}") from None
    return spec


def speculative_spec_of_vllm(speculative_config: dict | None) -> SpeculativeSpec | None:
    """A vLLM ``speculative_config`` as the spec the offline model computes (n-gram: ``num_speculative_tokens``,
    ``prompt_lookup_min``/``max`` with vLLM's defaults where one or both are left out); None for none and for
    a method whose drafts cannot be computed from the tokens (a draft model, EAGLE, ...)."""
    sc = speculative_config or {}
    method = sc.get("method") or ("ngram" if sc.get("model") in ("ngram", "[ngram]") else None)
    if method != "ngram":
        return None
    lo, hi = sc.get("prompt_lookup_min"), sc.get("prompt_lookup_max")
    lo, hi = (lo or hi or 5), (hi or lo or 5)
    return SpeculativeSpec("ngram", {"k": int(sc.get("num_speculative_tokens", 1)), "min": int(lo), "max": int(hi)})


def draft_acceptance_pattern(k: int, acceptance: float, steps: int) -> list[int]:
    """Accepted drafts per step whose running mean tracks the expectation ``sum_{i=1..k} a^i`` (deterministic:
    step j gets ``floor((j+1) E) - floor(j E)``, capped at k)."""
    expected = sum(acceptance ** i for i in range(1, k + 1))
    return [min(k, int((j + 1) * expected) - int(j * expected)) for j in range(steps)]


def with_speculation(requests: Sequence[SimRequest], spec: SpeculativeSpec, trace: Trace | None = None,
                     max_model_len: int | None = None) -> tuple[list[SimRequest], dict]:
    """The requests carrying their drafts and accepted counts per decode step, and a summary (tokens per
    step, acceptance).  ``trace`` (a kvscope trace with recorded outputs) is needed for the token-based
    methods."""
    if spec.method == "draft":
        a = float(spec.params["acceptance"])
        out = [replace(r, spec_drafted=[spec.k] * max(r.output_tokens - 1, 0),
                       spec_accepted=draft_acceptance_pattern(spec.k, a, max(r.output_tokens - 1, 0)))
               for r in requests]
        expected = sum(a ** i for i in range(1, spec.k + 1))
        return out, {"method": "draft", "k": spec.k, "mean_acceptance_length": 1 + expected,
                     "requests_with_drafts": len(out)}
    if trace is None:
        raise ValueError(f"--speculative {spec.method} needs the tokens: give a kvscope trace directory with "
                         "recorded output tokens")
    from kvscope.harness.cachemodel.speculative import simulate  # deferred: the offline speculation model loads numba, only speculative configurations need it

    res = simulate(trace, spec.offline_config(), max_model_len)
    by_id = {r.request_id: r for r in res.requests}
    out = []
    for r in requests:
        s = by_id.get(r.request_id)
        out.append(r if s is None else replace(r, spec_drafted=s.drafted.tolist(), spec_accepted=s.accepted.tolist()))
    summary = res.summary()
    return out, {"method": spec.method, "k": spec.k, **{k: summary.get(k) for k in
                 ("acceptance_rate", "mean_acceptance_length", "tokens_per_step") if k in summary},
                 "requests_with_drafts": len(by_id)}


@dataclass(frozen=True)
class DraftStepCost:
    """A target's step cost plus a draft model's ``k`` decode passes in every step that decodes (the draft
    proposes before the target verifies).  Implements :class:`~.step_cost.StepCost`."""

    target: StepCost
    draft: StepCost
    k: int

    @property
    def request_overhead_s(self) -> float:
        return self.target.request_overhead_s

    def step_s(self, tokens: int, seqs: int, context_tokens: float, prefill_pairs: float = 0.0,
               spec_seqs: int = 0, draft_tokens: int = 0) -> float:
        t = self.target.step_s(tokens, seqs, context_tokens, prefill_pairs, spec_seqs, draft_tokens)
        if context_tokens > 0:  # decodes in the step
            t += self.k * self.draft.step_s(seqs, seqs, context_tokens)
        return t

    def decode_run_s(self, seqs: int, context_tokens: float, steps: int) -> float:
        return (self.target.decode_run_s(seqs, context_tokens, steps)
                + self.k * self.draft.decode_run_s(seqs, context_tokens, steps))

    def scaled(self, factor: float) -> DraftStepCost:
        return DraftStepCost(self.target.scaled(factor), self.draft.scaled(factor), self.k)
