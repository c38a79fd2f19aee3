"""Cost of model-routing policies, and the evaluation entry points behind ``kvscope route``.

The routing itself (policies, one prefix-cache pool per model, escalations) is
:mod:`kvscope.harness.cachemodel.model_routing`; this module adds what it cannot know: each model's price sheet.
It lives in the pricing layer because it needs both (the cache model sits below pricing).  Billing follows
:func:`~.cost.run_cost`: a model's predicted hits are cache reads, the rest of the prompt is written
(``cache_write_multiplier``, 1.0 for automatic-caching providers) — the serving cache standing in for the
provider's — and a cascade's discarded small attempt is billed on the small model, prompt and answer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from kvscope.harness.cachemodel.model_routing import (
    INPUT_KINDS,
    STICKINESS,
    ModelRoutingSpec,
    RoutedRequest,
    RoutingInputs,
    evaluate,
    load_spec,
    route_requests,
    totals,
)
from kvscope.harness.cachemodel.model_routing_scheduler import run_routed_scheduler
from kvscope.harness.cachemodel.scheduler import SchedulerConfig, SessionTiming
from kvscope.harness.cachemodel.step_cost import StepCost
from kvscope.harness.pricing.cost import Pricing, TokenSplit, summarize_splits
from kvscope.harness.pricing.provider_cache import load_preset

#: Price sheets of models a spec leaves unpriced: the cheapest model a flash-class sheet, the others Sonnet-class.
DEFAULT_SMALL_PRESET = "gemini-2.5-flash-implicit"
DEFAULT_LARGE_PRESET = "anthropic-sonnet-5m"


def model_prices(spec: ModelRoutingSpec) -> dict[str, tuple[str, Pricing]]:
    """Model name → (preset name, prices); a preset name or a YAML path per model, else the defaults."""
    out = {}
    for i, m in enumerate(spec.models):
        preset = m.pricing or (DEFAULT_SMALL_PRESET if i == 0 else DEFAULT_LARGE_PRESET)
        out[m.name] = (preset, load_preset(preset).pricing)
    return out


def routed_cost(routed: Sequence[RoutedRequest], prices: dict[str, tuple[str, Pricing]]) -> dict:
    """USD per model and in total, and per 1,000 sessions."""
    splits: dict[str, list[TokenSplit]] = {m: [] for m in prices}
    for r in routed:
        splits[r.model].append(TokenSplit(0, r.prompt_tokens - r.cached_tokens, r.cached_tokens, r.output_tokens))
        if r.small_attempt_model is not None:
            splits[r.small_attempt_model].append(TokenSplit(0, r.wasted_prefill_tokens, r.small_attempt_cached_tokens,
                                                            r.wasted_output_tokens))
    per = {m: {"preset": prices[m][0], **summarize_splits(s, prices[m][1])} for m, s in splits.items()}
    total = sum(d["total_usd"] for d in per.values())
    wasted = sum(summarize_splits([TokenSplit(0, r.wasted_prefill_tokens, r.small_attempt_cached_tokens,
                                              r.wasted_output_tokens)], prices[r.small_attempt_model][1])["total_usd"]
                 for r in routed if r.small_attempt_model is not None)
    sessions = len({r.session_id for r in routed}) or 1
    return {"total_usd": total, "usd_per_1k_sessions": total * 1000 / sessions,
            "wasted_attempts_usd": wasted, "per_model": per}


def session_costs(routed: Sequence[RoutedRequest], prices: dict[str, tuple[str, Pricing]]) -> dict[str, float]:
    """USD per session, billed as :func:`routed_cost` bills the whole (so they add up to its total): the unit a
    verdict between two policies resamples, since a session's requests share their history."""
    by: dict[str, list[RoutedRequest]] = {}
    for r in routed:
        by.setdefault(str(r.session_id), []).append(r)
    return {sid: routed_cost(rs, prices)["total_usd"] for sid, rs in by.items()}


def self_hosted_routed_cost(busy_s_by_model: dict[str, float], gpu_hourly_usd_by_model: dict[str, float],
                            sessions: int) -> dict:
    """Self-hosted cost of a routed policy: each model's GPU-seconds (the time its server spent on the policy's
    attempts, wasted ones included) at that model's $ per GPU-hour; in total and per 1,000 sessions."""
    per = {m: busy_s_by_model.get(m, 0.0) / 3600.0 * gpu_hourly_usd_by_model[m] for m in gpu_hourly_usd_by_model}
    total = sum(per.values())
    return {"total_usd": total, "usd_per_1k_sessions": total * 1000 / max(sessions, 1),
            "gpu_hours": {m: busy_s_by_model.get(m, 0.0) / 3600.0 for m in gpu_hourly_usd_by_model},
            "per_model_usd": per}


@dataclass
class PolicyEvaluation:
    """One policy on one trace: per-request predictions, totals and cost."""

    spec: ModelRoutingSpec
    routed: list[RoutedRequest]
    totals: dict
    cost: dict
    #: under concurrency (:func:`evaluate_policy_timed`): TTFT / e2e percentiles, escalation round trips
    #: included, and each model's server statistics; None for the sequential model
    latency: dict | None = None
    #: self-hosted cost from each server's busy GPU-seconds (:func:`self_hosted_routed_cost`), where priced
    self_hosted: dict | None = None

    def summary(self) -> dict:
        t = dict(self.totals)
        for m, d in t["per_model"].items():
            c = self.cost["per_model"][m]
            d.update(preset=c["preset"], total_usd=c["total_usd"])
        out = {"policy": self.spec.policy.model_dump(), "stickiness": self.spec.stickiness, **t,
               "total_usd": self.cost["total_usd"], "usd_per_1k_sessions": self.cost["usd_per_1k_sessions"],
               "wasted_attempts_usd": self.cost["wasted_attempts_usd"]}
        if self.latency is not None:
            out["latency"] = self.latency
        if self.self_hosted is not None:
            out["self_hosted"] = self.self_hosted
        return out


def evaluate_policy(spec: ModelRoutingSpec, inputs: RoutingInputs, *, fast: bool | None = None,
                    prices: dict[str, tuple[str, Pricing]] | None = None,
                    progress: Callable[[int], None] | None = None) -> PolicyEvaluation:
    routed = evaluate(spec, inputs, fast=fast, progress=progress)
    prices = prices or model_prices(spec)
    return PolicyEvaluation(spec, routed, totals(routed, spec.model_names), routed_cost(routed, prices))


def evaluate_policy_timed(spec: ModelRoutingSpec, inputs: RoutingInputs, cost: StepCost, config: SchedulerConfig,
                          concurrency: int, *, large_time_factor: float = 1.0,
                          gpu_hourly_usd: dict[str, float] | None = None,
                          prices: dict[str, tuple[str, Pricing]] | None = None) -> PolicyEvaluation:
    """The policy under concurrency (closed loop, ``concurrency`` sessions at once, no think time as the replay's
    ``time_scale 0``): each model a scheduler model with ``config``'s settings at the spec's block size and pool
    (None: unbounded), the first model at ``cost`` (a calibration of its server) and every other at ``cost`` times
    ``large_time_factor``.  Cached tokens come from each model's scheduler; latency per request runs from the
    first attempt's send to the served attempt's first token (TTFT) and last token (e2e), so an escalation's
    round trip on the small model is in it."""
    if large_time_factor <= 0:
        raise ValueError(f"large_time_factor {large_time_factor}: must be > 0")
    configs = {m.name: dataclasses.replace(config, block_size=m.block_size, num_gpu_blocks=m.num_gpu_blocks)
               for m in spec.models}
    costs = {m.name: cost if i == 0 else cost.scaled(large_time_factor) for i, m in enumerate(spec.models)}
    attempts = route_requests(inputs.facts, spec)
    run = run_routed_scheduler(attempts, inputs.facts, inputs.requests_by_block, spec, configs, costs,
                               SessionTiming(concurrency=concurrency, time_scale=0.0))
    ttft = np.array([a[-1].first_token_s - a[0].arrival_s for a in run.attempts])
    e2e = np.array([a[-1].done_s - a[0].arrival_s for a in run.attempts])
    esc = np.array([len(a) > 1 for a in run.attempts])

    def pct(x: np.ndarray, q: float) -> float | None:
        return float(np.percentile(x, q)) if len(x) else None

    latency = {"concurrency": concurrency, "large_time_factor": large_time_factor,
               "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "e2e_p50_s": pct(e2e, 50),
               "e2e_p90_s": pct(e2e, 90), "escalated_ttft_p50_s": pct(ttft[esc], 50) if esc.any() else None,
               "makespan_s": run.makespan_s,
               "servers": {m: dataclasses.asdict(s) for m, s in run.servers.items()}}
    prices = prices or model_prices(spec)
    ev = PolicyEvaluation(spec, run.routed, totals(run.routed, spec.model_names), routed_cost(run.routed, prices),
                          latency)
    if gpu_hourly_usd is not None:
        ev.self_hosted = self_hosted_routed_cost({m: s.busy_s for m, s in run.servers.items()}, gpu_hourly_usd,
                                                 ev.totals["sessions"])
    return ev


def stickiness_counterfactual(spec: ModelRoutingSpec, inputs: RoutingInputs, base: PolicyEvaluation,
                              *, fast: bool | None = None, progress: Callable[[int], None] | None = None,
                              timed: Callable[[ModelRoutingSpec], PolicyEvaluation] | None = None
                              ) -> tuple[dict, PolicyEvaluation]:
    """The same policy with the other stickiness: what sticky routing would have saved (or cost); the totals
    and the other evaluation itself (its per-request predictions, request for request). ``timed``: evaluate the
    other spec with it (:func:`evaluate_policy_timed`) instead of the sequential model."""
    other = "sticky-after-escalation" if spec.stickiness == "per-step" else "per-step"
    alt_spec = spec.model_copy(update={"stickiness": other})
    alt = timed(alt_spec) if timed is not None else evaluate_policy(alt_spec, inputs, fast=fast, progress=progress)
    return {"stickiness": other,
            "token_hit_ratio": alt.totals["token_hit_ratio"],
            "escalation_rate": alt.totals["escalation_rate"],
            "model_switch_tokens": alt.totals["model_switch_tokens"],
            "usd_per_1k_sessions": alt.cost["usd_per_1k_sessions"],
            "saves_usd_per_1k_sessions": base.cost["usd_per_1k_sessions"] - alt.cost["usd_per_1k_sessions"],
            "saves_model_switch_tokens": base.totals["model_switch_tokens"] - alt.totals["model_switch_tokens"],
            **({"ttft_p50_s": alt.latency["ttft_p50_s"]} if alt.latency is not None else {})}, alt


def rule_grid(models: Sequence[str], thresholds: Iterable[int],
              input_kind_sets: Iterable[Sequence[str]] | None = None,
              stickiness: Iterable[str] = STICKINESS) -> list[dict]:
    """Rule variants: send to the last model when the step adds one of the input kinds and the prompt has at
    least T tokens, else the first model; every (T, kinds, stickiness)."""
    if input_kind_sets is None:
        input_kind_sets = [c for n in range(1, len(INPUT_KINDS) + 1) for c in itertools.combinations(INPUT_KINDS, n)]
    out = []
    for t, kinds, st in itertools.product(list(thresholds), list(input_kind_sets), list(stickiness)):
        out.append({"policy": {"kind": "rule", "rules": [{"model": models[-1], "input_kind": list(kinds),
                                                          "min_prompt_tokens": int(t)}]},
                    "stickiness": st})
    return out


def sweep(base: dict, variants: Sequence[dict], inputs: RoutingInputs,
          progress: Callable[[int], None] | None = None) -> list[dict]:
    """Evaluate every variant (``base`` spec fields updated by each variant), sorted by $ per 1,000 sessions.

    Variants that route every request the same way are one outcome: the first is kept and counts the others
    (``equivalent``), so a grid's many ways of saying "never the large model" fill one row.  ``pareto`` marks
    outcomes that send a larger share of requests to the large model than every cheaper outcome: with quality
    left to the user, those are the candidates worth a live replay.
    """
    rows: list[dict] = []
    seen: dict[tuple, dict] = {}
    prices = None
    for v in variants:
        spec = load_spec({**base, **v}, "sweep variant")
        prices = prices or model_prices(spec)
        ev = evaluate_policy(spec, inputs, prices=prices)
        if progress:
            progress(1)
        outcome = tuple((r.model, r.small_attempt_model) for r in ev.routed)
        if outcome in seen:
            seen[outcome]["equivalent"] += 1
            continue
        t = ev.totals
        last = spec.model_names[-1]
        seen[outcome] = row = {
            "variant": describe(spec), "stickiness": spec.stickiness, "equivalent": 0,
            "usd_per_1k_sessions": ev.cost["usd_per_1k_sessions"], "token_hit_ratio": t["token_hit_ratio"],
            "large_share": t["per_model"][last]["requests"] / t["requests"] if t["requests"] else 0.0,
            "escalation_rate": t["escalation_rate"], "model_switch_tokens": t["model_switch_tokens"],
            "spec": {**base, **v}}
        rows.append(row)
    rows.sort(key=lambda r: (r["usd_per_1k_sessions"], -r["large_share"], r["variant"]))
    best_share = -1.0
    for r in rows:  # cheapest first: on the frontier if it sends more to the large model than every cheaper one
        r["pareto"] = r["large_share"] > best_share
        best_share = max(best_share, r["large_share"])
    return rows


def describe(spec: ModelRoutingSpec) -> str:
    """A short name for a policy (tables)."""
    p = spec.policy
    if p.kind == "rule":
        parts = []
        for r in p.rules:  # type: ignore[attr-defined]
            cond = []
            if r.input_kind:
                cond.append("+".join(r.input_kind))
            if r.min_prompt_tokens is not None:
                cond.append(f">={r.min_prompt_tokens}")
            if r.max_prompt_tokens is not None:
                cond.append(f"<={r.max_prompt_tokens}")
            if r.min_step is not None:
                cond.append(f"step>={r.min_step}")
            if r.max_step is not None:
                cond.append(f"step<={r.max_step}")
            if r.column:
                cond.append(f"{r.column}={r.equals!r}")
            parts.append(f"{' '.join(cond) or 'all'}→{r.model}")
        return "rule " + "; ".join(parts)
    if p.kind == "cascade":
        checks = [f"label {p.label_column}" if p.label_column else "",  # type: ignore[attr-defined]
                  f"out>{p.max_output_tokens}" if p.max_output_tokens else "",  # type: ignore[attr-defined]
                  f"logprob<{p.min_mean_logprob}" if p.min_mean_logprob is not None else ""]  # type: ignore[attr-defined]
        return "cascade " + ",".join(c for c in checks if c)
    return p.kind


__all__ = [
    "DEFAULT_LARGE_PRESET",
    "DEFAULT_SMALL_PRESET",
    "PolicyEvaluation",
    "describe",
    "evaluate_policy",
    "evaluate_policy_timed",
    "model_prices",
    "routed_cost",
    "rule_grid",
    "self_hosted_routed_cost",
    "session_costs",
    "stickiness_counterfactual",
    "sweep",
]
