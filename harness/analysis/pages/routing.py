"""The routing page (notebooks/routing.ipynb): a small and a large model, and what routing between them costs
after the caches it breaks — as an offline what-if on the experiment's own traces.

Why offline. Each workload's trace is routed by a handful of policies (all-small, all-large, a rule on the
step's input kind, a rule on prompt length, a cascade on answer length; each rule and cascade per-step and
sticky-after-escalation) through one exact prefix-cache pool per model
(:mod:`kvscope.harness.cachemodel.model_routing`, the fast path): milliseconds per policy on a quickstart
trace, where a live two-model cell set costs minutes of a 15-minute budget. What it cannot measure it states:
latency comes from a linear fit of this experiment's measured TTFT on uncached prompt tokens (the large model's
per-token time a parameter, ``large_model_time_factor``), and quality is not modelled at all.

Why verdicts. A policy's cost is decided against all-large (the "bigger is better" default) on the per-session
cost differences (a session's requests share their history, so the session is the unit, as in the A/B engine),
with the A/B engine's 5 % margin and words; the recommendation is drawn only from policies decidedly cheaper,
never from a point estimate. The interval is the paired Student t interval of the mean difference, not a
percentile bootstrap: with the 4 sessions a quickstart workload has, the bootstrap's interval is too narrow and
an A/A pair (two policies of equal true cost) was decided 13 % of the time, against 2 % with the t interval
(`tests/offline/test_routing_verdicts.py`, known-truth traffic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from kvscope.harness.analysis.ab import ALPHA, MARGIN_RELATIVE
from kvscope.harness.analysis.registry import PageContext, report_page
from kvscope.harness.cachemodel.model_routing import (
    RoutedRequest,
    RoutingInputs,
    load_routing_inputs,
    load_spec,
)
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.pricing.model_routing import (
    evaluate_policy,
    model_prices,
    self_hosted_routed_cost,
    session_costs,
)
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import ExperimentSpecCore
from kvscope.workloads.errors import WorkloadError

NOTEBOOK = "routing"
REFERENCE = "all-large"
#: Fewer sessions than this give no verdict (two sessions give a t interval with one degree of freedom).
MIN_SESSIONS = 3


@dataclass(frozen=True)
class LatencyFit:
    """TTFT ≈ ``overhead_s + s_per_uncached_token × uncached prompt tokens`` and the median TPOT, fitted on this
    experiment's measured requests (servers with prefix caching, no speculation): the small model's times; the
    large model's are its per-token times times ``large_model_time_factor``."""

    overhead_s: float
    s_per_uncached_token: float
    tpot_s: float
    requests: int
    source: str


def latency_fit(res: ExperimentResults) -> LatencyFit | None:
    """Least squares over the measured requests; None where fewer than 3 have a TTFT."""
    ok = res.ok_requests() if len(res.requests) else pd.DataFrame()
    if not len(ok) or "ttft_s" not in ok or "cached_tokens" not in ok:
        return None
    cells = res.cells
    if len(cells) and {"prefix_caching", "speculative"} <= set(cells.columns):
        keep = cells[(cells["prefix_caching"] == True) & (cells["speculative"] != True)]["cell"]
        if len(keep):
            ok = ok[ok["cell"].isin(set(keep))]
    d = ok[["ttft_s", "prompt_tokens", "cached_tokens"]].apply(pd.to_numeric, errors="coerce").dropna()
    if len(d) < 3:
        return None
    x = (d["prompt_tokens"] - d["cached_tokens"]).to_numpy(float)
    y = d["ttft_s"].to_numpy(float)
    if np.ptp(x) > 0:
        slope, intercept = np.polyfit(x, y, 1)
    else:
        slope, intercept = 0.0, float(np.mean(y))
    tpot = pd.to_numeric(ok.get("tpot_s"), errors="coerce").dropna() if "tpot_s" in ok else pd.Series(dtype=float)
    servers = sorted(set(ok["server"])) if "server" in ok else []
    return LatencyFit(max(float(intercept), 0.0), max(float(slope), 0.0),
                      float(tpot.median()) if len(tpot) else 0.0, len(d), ", ".join(map(str, servers)) or "the runs")


def policies(inputs: RoutingInputs) -> dict[str, tuple[str, dict]]:
    """The what-if policies of one trace, by name: (family, spec fields). The two fixed ones, then each rule and
    cascade per-step and sticky. Thresholds follow the trace (its median prompt, its 75th-percentile answer), so
    the names do too; the family names the policy across traces (a figure's colours)."""
    prompts = np.array([f.prompt_tokens for f in inputs.facts]) if inputs.facts else np.zeros(1)
    outputs = np.array([f.output_tokens for f in inputs.facts]) if inputs.facts else np.ones(1)
    median_prompt = int(np.median(prompts))
    p75_out = max(1, int(np.percentile(outputs, 75)))
    out: dict[str, tuple[str, dict[str, Any]]] = {
        "all-small": ("all-small", {"policy": {"kind": "all-small"}}),
        REFERENCE: (REFERENCE, {"policy": {"kind": "all-large"}})}
    kinds: dict[str, tuple[str, dict[str, Any]]] = {
        "tool output → large": ("tool output → large",
                                {"kind": "rule", "rules": [{"model": "large", "input_kind": ["tool_output"]}]}),
        f"prompt ≥ {median_prompt:,} → large": ("prompt ≥ median → large",
                                                {"kind": "rule", "rules": [{"model": "large",
                                                                            "min_prompt_tokens": median_prompt}]}),
        f"cascade: answer > {p75_out} tokens": ("cascade: answer > p75",
                                                {"kind": "cascade", "max_output_tokens": p75_out}),
    }
    for name, (family, pol) in kinds.items():
        out[name] = (family, {"policy": pol, "stickiness": "per-step"})
        out[f"{name}, sticky"] = (family, {"policy": pol, "stickiness": "sticky-after-escalation"})
    return out


def _predicted_latency(routed: list[RoutedRequest], fit: LatencyFit | None, factor: float,
                       models: tuple[str, str]) -> tuple[np.ndarray, dict[str, float]]:
    """Per request, the predicted TTFT (a discarded small attempt's whole answer comes first, then the large
    model's prefill), and each model's busy seconds (prefill and decode of every attempt)."""
    small, large = models
    ttft = np.full(len(routed), math.nan)
    busy = {small: 0.0, large: 0.0}
    if fit is None:
        return ttft, busy
    scale = {small: 1.0, large: factor}
    for i, r in enumerate(routed):
        t = 0.0
        if r.small_attempt_model is not None:
            m = r.small_attempt_model
            pre = fit.overhead_s + fit.s_per_uncached_token * scale[m] * r.wasted_prefill_tokens
            dec = fit.tpot_s * scale[m] * max(r.wasted_output_tokens - 1, 0)
            t += pre + dec
            busy[m] += pre + dec
        pre = fit.overhead_s + fit.s_per_uncached_token * scale[r.model] * (r.prompt_tokens - r.cached_tokens)
        ttft[i] = t + pre
        busy[r.model] += pre + fit.tpot_s * scale[r.model] * max(r.output_tokens - 1, 0)
    return ttft, busy


def routing_whatifs(res: ExperimentResults, small_pricing: str = "gemini-2.5-flash-implicit",
                    large_pricing: str = "anthropic-sonnet-5m", large_model_time_factor: float = 3.0,
                    small_gpu_hourly_usd: float = 1.0, large_gpu_hourly_usd: float = 4.0,
                    fit: LatencyFit | None = None) -> tuple[pd.DataFrame, dict]:
    """One row per (workload, policy): $ per 1,000 sessions (provider prices and self-hosted GPU-hours), token hit
    ratio in all and per model, share of requests on the large model, escalation rate, tokens recomputed because
    of switches (and as a share of the prompt tokens sent), wasted small attempts, predicted TTFT p50/p90 (ms).
    Also returns each (workload, policy)'s cost per session, for :func:`cost_verdicts`."""
    fit = fit if fit is not None else latency_fit(res)
    models = [{"name": "small", "pricing": small_pricing}, {"name": "large", "pricing": large_pricing}]
    rows, per_session, skipped = [], {}, {}
    for workload in sorted(res.experiment.traces):
        tdir = res.trace_dir(workload)
        if tdir is None or not (tdir / "trace.json").is_file():
            continue
        try:
            inputs = load_routing_inputs(tdir, [16])
        except (KvscopeError, WorkloadError) as exc:  # a trace routing cannot read: the page says so, goes on
            skipped[workload] = str(exc)
            continue
        prices = None
        for name, (family, body) in policies(inputs).items():
            spec = load_spec({"models": models, **body}, f"routing what-if {name}")
            prices = prices or model_prices(spec)
            ev = evaluate_policy(spec, inputs, prices=prices)
            t = ev.totals
            ttft, busy = _predicted_latency(ev.routed, fit, large_model_time_factor, ("small", "large"))
            hosted = self_hosted_routed_cost(busy, {"small": small_gpu_hourly_usd, "large": large_gpu_hourly_usd},
                                             t["sessions"])
            per_session[(workload, name)] = session_costs(ev.routed, prices)
            rows.append({
                "workload": workload, "policy": name, "family": family, "stickiness": spec.stickiness,
                "usd_per_1000_sessions": ev.cost["usd_per_1k_sessions"],
                "self_hosted_usd_per_1000_sessions": hosted["usd_per_1k_sessions"] if fit is not None else math.nan,
                "token_hit_ratio": t["token_hit_ratio"],
                "small_hit_ratio": t["per_model"]["small"]["token_hit_ratio"],
                "large_hit_ratio": t["per_model"]["large"]["token_hit_ratio"],
                "large_share": t["per_model"]["large"]["requests"] / t["requests"] if t["requests"] else math.nan,
                "escalation_rate": t["escalation_rate"],
                "model_switch_tokens": t["model_switch_tokens"],
                "switch_share_pp": 100 * t["model_switch_tokens"] / t["prompt_tokens_sent"]
                if t["prompt_tokens_sent"] else math.nan,
                "wasted_tokens": t["wasted_prefill_tokens"] + t["wasted_output_tokens"],
                "ttft_p50_ms": float(np.nanpercentile(ttft, 50)) * 1000 if fit is not None else math.nan,
                "ttft_p90_ms": float(np.nanpercentile(ttft, 90)) * 1000 if fit is not None else math.nan,
                "sessions": t["sessions"], "requests": t["requests"]})
    table = pd.DataFrame(rows)
    table.attrs["skipped"] = skipped
    return table, per_session


def sticky_recovery(table: pd.DataFrame) -> pd.DataFrame:
    """Per workload and per-step policy that switches models: the hit ratio it loses to switches (percentage
    points of the prompt tokens it sends, recomputed because the session's previous step ran on the other model)
    and what its sticky twin gets back (its hit ratio minus the per-step one, in points)."""
    rows = []
    if not len(table):
        return pd.DataFrame(columns=["workload", "policy", "lost_pp", "recovered_pp", "sticky_usd_change"])
    for _, r in table[table["stickiness"] == "per-step"].iterrows():
        if r["policy"] in ("all-small", REFERENCE) or not r["model_switch_tokens"]:
            continue
        twin = table[(table["workload"] == r["workload"]) & (table["policy"] == f"{r['policy']}, sticky")]
        if not len(twin):
            continue
        s = twin.iloc[0]
        rows.append({"workload": r["workload"], "policy": r["policy"], "lost_pp": r["switch_share_pp"],
                     "recovered_pp": 100 * (s["token_hit_ratio"] - r["token_hit_ratio"]),
                     "sticky_usd_change": s["usd_per_1000_sessions"] / r["usd_per_1000_sessions"] - 1
                     if r["usd_per_1000_sessions"] else math.nan})
    return pd.DataFrame(rows, columns=["workload", "policy", "lost_pp", "recovered_pp", "sticky_usd_change"])


def _verdict(lo: float, hi: float, margin: float) -> str:
    """Words as the A/B engine's (lower cost is better): the 95 % interval beyond ±margin on one side → better
    or worse, inside it → equivalent, else inconclusive."""
    if hi < -margin:
        return "better"
    if lo > margin:
        return "worse"
    if -margin < lo and hi < margin:
        return "equivalent"
    return "inconclusive"


def cost_verdicts(table: pd.DataFrame, per_session: dict) -> pd.DataFrame:
    """Each policy's $ per session against all-large's on the same sessions: the mean difference, its 95 % paired
    t interval over sessions, relative change and the verdict (margin: 5 % of all-large's)."""
    from scipy import stats  # deferred: scipy is heavy

    rows = []
    for (workload, name), costs in per_session.items():
        ref = per_session.get((workload, REFERENCE))
        if name == REFERENCE or ref is None:
            continue
        sessions = sorted(ref)
        a = np.array([ref[s] for s in sessions])
        b = np.array([costs.get(s, 0.0) for s in sessions])
        d = b - a
        point = float(d.mean())
        margin = MARGIN_RELATIVE * float(a.mean())
        lo = hi = math.nan
        if len(d) >= 2:
            half = float(stats.t.ppf(1 - ALPHA / 2, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))
            lo, hi = point - half, point + half
        word = _verdict(lo, hi, margin) if len(d) >= MIN_SESSIONS else "inconclusive"
        rows.append({"workload": workload, "policy": name, "reference": REFERENCE, "usd_per_session_diff": point,
                     "ci_low": lo, "ci_high": hi, "relative": point / a.mean() if a.mean() else math.nan,
                     "margin": margin, "sessions": len(d), "verdict": word})
    return pd.DataFrame(rows, columns=["workload", "policy", "reference", "usd_per_session_diff", "ci_low",
                                       "ci_high", "relative", "margin", "sessions", "verdict"])


def decided_choices(table: pd.DataFrame, verdicts: pd.DataFrame) -> dict[str, pd.Series | None]:
    """Per workload: the cheapest routing policy (all-small aside: it is the floor, not a routing decision) whose
    cost verdict against all-large is decided *better* (its row of ``table``, with ``verdict_*`` columns), or None.
    Never a point estimate: an undecided policy is never chosen, however cheap."""
    out: dict[str, pd.Series | None] = {}
    if not len(table):
        return out
    for workload, g in table.groupby("workload", sort=True):
        v = verdicts[(verdicts["workload"] == workload) & (verdicts["verdict"] == "better")
                     & (verdicts["policy"] != "all-small")]
        if not len(v):
            out[workload] = None
            continue
        best = g[g["policy"].isin(set(v["policy"]))].sort_values(["usd_per_1000_sessions", "policy"]).iloc[0]
        vb = v[v["policy"] == best["policy"]].iloc[0]
        out[workload] = pd.concat([best, vb[["relative", "ci_low", "ci_high", "sessions"]].add_prefix("verdict_")])
    return out


def recommendation(table: pd.DataFrame, verdicts: pd.DataFrame, recovery: pd.DataFrame) -> list[Finding]:
    """The page's sentence per workload (``cost``): its :func:`decided_choices` policy with the saving, its
    interval, the share on the large model, the predicted TTFT change and what sticky routing recovers; where no
    policy is decided, a sentence saying nothing is recommended."""
    out = []
    for workload, best in decided_choices(table, verdicts).items():
        g = table[table["workload"] == workload]
        ref = g[g["policy"] == REFERENCE].iloc[0]
        if best is None:
            undecided = verdicts[(verdicts["workload"] == workload) & (verdicts["policy"] != "all-small")]
            out.append(Finding(question="cost", notebook=NOTEBOOK, figure="routing_cost_latency",
                               sentence=f"{workload}: no routing policy is decidedly cheaper than all-large on these "
                                        f"{int(ref['sessions'])} sessions (verdicts: "
                                        f"{', '.join(sorted(set(undecided['verdict']))) or 'none'}); "
                                        "nothing is recommended.",
                               numbers={"sessions": float(ref["sessions"])}))
            continue
        saving = -float(best["verdict_relative"])
        ttft = best["ttft_p50_ms"] - ref["ttft_p50_ms"]
        words = (f"{workload}: route {best['policy']} — {saving:.0%} cheaper than all-large "
                 f"(${best['usd_per_1000_sessions']:,.2f} vs ${ref['usd_per_1000_sessions']:,.2f} per 1,000 sessions, "
                 f"decided over {int(best['verdict_sessions'])} sessions), {best['large_share']:.0%} of requests on "
                 "the large model")
        if not math.isnan(ttft):
            words += f", predicted TTFT p50 {ttft:+,.0f} ms"
        rec = recovery[(recovery["workload"] == workload)
                       & (recovery["policy"] == best["policy"].removesuffix(", sticky"))]
        numbers = {"saving": saving, "usd_per_1000_sessions": float(best["usd_per_1000_sessions"]),
                   "reference_usd_per_1000_sessions": float(ref["usd_per_1000_sessions"]),
                   "large_share": float(best["large_share"]),
                   "ttft_p50_change_ms": None if math.isnan(ttft) else float(ttft)}
        if len(rec):
            r = rec.iloc[0]
            if r["recovered_pp"] > 0:
                words += (f"; sticky routing recovers {r['recovered_pp']:.1f} of the {r['lost_pp']:.1f} pp of hit "
                          "rate this rule loses to model switches")
            else:
                words += (f"; it loses {r['lost_pp']:.1f} pp of hit rate to model switches, which sticky routing does "
                          f"not recover (hit rate {r['recovered_pp']:+.1f} pp)")
            numbers.update(lost_pp=float(r["lost_pp"]), recovered_pp=float(r["recovered_pp"]))
        out.append(Finding(question="cost", notebook=NOTEBOOK, figure="routing_cost_latency",
                           sentence=words + ". Quality is not modelled: check the answers before routing.",
                           numbers=numbers, interval=(float(best["verdict_ci_low"]), float(best["verdict_ci_high"])),
                           interval_of="usd_per_session_diff"))
    return out


def index_recommendation(table: pd.DataFrame, verdicts: pd.DataFrame) -> list[Finding]:
    """One line for the index's recommendations: on how many workloads a routing policy is decidedly cheaper than
    all-large, each with its policy and saving (the page holds the sentences); where none is decided, it says
    nothing is recommended."""
    choices = decided_choices(table, verdicts)
    if not choices:
        return []
    decided = {w: b for w, b in choices.items() if b is not None}
    numbers = {"workloads": float(len(choices)), "decided": float(len(decided))}
    if not decided:
        return [Finding(question="recommendation", notebook=NOTEBOOK, figure="routing_cost_latency",
                        sentence=f"Model routing (offline what-if): no policy is decidedly cheaper than all-large on "
                                 f"any of {len(choices)} workload(s); nothing is recommended.", numbers=numbers)]
    parts = "; ".join(f"{w}: {b['policy']} ({b['verdict_relative']:+.0%})" for w, b in decided.items())
    return [Finding(question="recommendation", notebook=NOTEBOOK, figure="routing_cost_latency",
                    sentence=f"Model routing (offline what-if, quality not modelled): a policy is decidedly cheaper "
                             f"than all-large on {len(decided)} of {len(choices)} workloads — {parts}.",
                    numbers=numbers)]


def switch_findings(recovery: pd.DataFrame) -> list[Finding]:
    """The worst cache penalty of switching, per workload, and what its sticky twin gets back."""
    out = []
    for workload, g in recovery.groupby("workload", sort=True):
        worst = g.sort_values("lost_pp", ascending=False).iloc[0]
        out.append(Finding(question="cost", notebook=NOTEBOOK, figure="routing_switch_penalty",
                           sentence=f"{workload}: {worst['policy']} recomputes {worst['lost_pp']:.1f} pp of its "
                                    "prompt tokens because the session's previous step ran on the other model; "
                                    f"sticky routing changes its hit rate by {worst['recovered_pp']:+.1f} pp "
                                    f"and its cost by {worst['sticky_usd_change']:+.0%}.",
                           numbers={"lost_pp": float(worst["lost_pp"]), "recovered_pp": float(worst["recovered_pp"]),
                                    "sticky_usd_change": float(worst["sticky_usd_change"])}))
    return out


def _from_spec(spec: ExperimentSpecCore) -> dict[str, Any]:
    return {}


@report_page(NOTEBOOK, "Model routing: a small and a large model, after the caches routing breaks", order=55,
             questions=("cost", "recommendation"), figures=("routing_cost_latency", "routing_switch_penalty"),
             parameters=("small_pricing", "large_pricing", "large_model_time_factor", "small_gpu_hourly_usd",
                         "large_gpu_hourly_usd"),
             key_figures=("routing_cost_latency",), from_spec=_from_spec)
def _routing_page(ctx: PageContext) -> list[Finding]:
    table, per_session = ctx.get("whatifs", lambda: routing_whatifs(ctx.res))
    verdicts = ctx.get("verdicts", lambda: cost_verdicts(table, per_session))
    recovery = sticky_recovery(table)
    return index_recommendation(table, verdicts) + recommendation(table, verdicts, recovery) + switch_findings(recovery)
