"""The cost page (notebooks/cost.ipynb): provider prompt-caching prices against vLLM's hits, TTL sensitivity,
self-hosted cost per token and per 1,000 sessions, and the workload scale every $ figure depends on.

Why the scale is stated with the costs: a CPU experiment runs its workloads at a fraction of their presets'
prompt lengths (the quickstart: 0.02, contexts capped at 2,000 tokens), so "$ per 1,000 sessions" is for
sessions ~50x shorter than the preset's, and "prompts below the provider's minimum" holds for these short
prompts, not for full-size ones; the caveat (:func:`scale_caveat`) says both, on the page and the index.
Self-hosted cost is the serving machine's hourly price (spec ``cost.self_hosted``: what the machine is, and its
price) times each cell's duration, per session it completed, so it sits beside the provider's per 1,000 sessions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import PurePath
from typing import Any

import pandas as pd
from kvscope.harness.analysis.claims import sweep_capacity
from kvscope.harness.analysis.common import _derived, _pct, _simulated, habit_pairs, hit_by_workload, one_selection
from kvscope.harness.analysis.registry import PageContext, caveat, report_page
from kvscope.harness.cachemodel.trace_io import load_trace
from kvscope.harness.pricing.cost import no_cache_cost, self_hosted_cost, self_hosted_usd_per_1000_sessions
from kvscope.harness.pricing.provider_cache import load_preset
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import ExperimentSpecCore
from kvscope.harness.results.selection import Statement
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE


def _trace_for_cost(res: ExperimentResults, workload: str, block_size: int):
    """The workload's trace requests restricted to the sessions every finished cell of the workload replayed,
    so caching and no caching, and every preset, are priced over the same sessions."""
    return _derived(res, ("cost_trace", workload, block_size), lambda: _read_trace_for_cost(res, workload, block_size))


def _read_trace_for_cost(res: ExperimentResults, workload: str, block_size: int):
    tdir = res.trace_dir(workload)
    if tdir is None or not tdir.exists():
        return None
    reqs = load_trace(str(tdir), block_size).requests
    ok = res.ok_requests()
    if len(ok) and "session_id" in ok:
        mine = ok[ok["workload"] == workload]
        per_cell = [set(map(str, g["session_id"])) for _, g in mine.groupby("cell")]
        if per_cell:
            common = set.intersection(*per_cell)
            reqs = [r for r in reqs if str(r.session_id) in common]
    return reqs


def provider_costs(res: ExperimentResults, presets: Iterable[str], block_size: int = DEFAULT_BLOCK_SIZE,
                   workloads: Iterable[str] | None = None) -> pd.DataFrame:
    """Per workload and provider preset: cost with prompt caching (TTL driven by the trace's think times)
    and without, over the same sessions (those every cell of the workload replayed): in total, per 1,000
    sessions, and the input side alone per million input tokens (output tokens are priced apart and are
    the same with and without caching). ``caching_change`` is with caching over without, minus one: negative
    where caching saves, positive where its write premium makes it dearer."""
    rows = []
    names = sorted(set(res.cells["workload"].dropna())) if workloads is None else list(workloads)
    for workload in names:
        reqs = _trace_for_cost(res, workload, block_size)
        if not reqs:
            continue
        total_in = sum(r.prompt_tokens for r in reqs)
        total_out = sum(r.output_tokens for r in reqs)
        sessions = len({r.session_id for r in reqs})
        for name in presets:
            cfg = load_preset(name)
            s = _simulated(res, workload, reqs, cfg, block_size)
            base = no_cache_cost(cfg.pricing, total_in, total_out)
            rows.append({"workload": workload, "preset": name, "sessions": sessions, "input_tokens": total_in,
                         "output_tokens": total_out, "cache_read_ratio": s["cache_read_ratio"],
                         "cost_usd": s["total_usd"], "no_cache_usd": base,
                         "usd_per_1000_sessions": s["total_usd"] / sessions * 1000 if sessions else math.nan,
                         "usd_per_1000_sessions_no_cache": base / sessions * 1000 if sessions else math.nan,
                         "input_usd_per_mtok_input": s["input_usd"] / total_in * 1e6 if total_in else math.nan,
                         "input_usd_per_mtok_input_no_cache": cfg.pricing.input_per_mtok,
                         "caching_change": s["total_usd"] / base - 1 if base else math.nan})
    return pd.DataFrame(rows)


def caching_change_title(costs: pd.DataFrame) -> str:
    """The provider-cost figure's title: the workload and preset where caching does worst against no caching,
    in words whose sign matches the number (a negative saving is "dearer", never "saves")."""
    if not len(costs):
        return "Provider cost with and without prompt caching"
    worst = costs.sort_values("caching_change", ascending=False).iloc[0]
    change = float(worst["caching_change"])
    if change > 0:
        return (f"Caching costs {change * 100:.0f} % more than no caching on {worst['workload']} with {worst['preset']} "
                "(cache writes paid, little read back)")
    return f"Caching saves least on {worst['workload']} with {worst['preset']}: {-change * 100:.0f} % cheaper than no caching"


def habit_cost_change(res: ExperimentResults, reference: str, habit: str, preset: str,
                      block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, float] | None:
    """What a history habit costs on a provider against its append-only reference, both with caching: $ per
    1,000 sessions of each and the habit's change (habit over reference, minus one). The baseline is the
    reference habit with caching, not "no caching": a habit is a choice between two ways of building the same
    sessions' prompts, both cached."""
    pc = provider_costs(res, [preset], block_size, workloads=[reference, habit])
    pc = pc.set_index("workload") if len(pc) else pc
    if not len(pc) or reference not in pc.index or habit not in pc.index:
        return None
    ref, hab = float(pc.loc[reference, "usd_per_1000_sessions"]), float(pc.loc[habit, "usd_per_1000_sessions"])
    return {"reference_usd_per_1000_sessions": ref, "habit_usd_per_1000_sessions": hab,
            "change": hab / ref - 1 if ref else math.nan}


def habit_costs(res: ExperimentResults, presets: Iterable[str], block_size: int = DEFAULT_BLOCK_SIZE) -> pd.DataFrame:
    """Per history habit (a workload `<reference>-<suffix>`, `common.habit_pairs`) and provider preset: $ per
    1,000 sessions of the habit and of its reference, both with caching, and the habit's change against the
    reference (:func:`habit_cost_change`)."""
    rows = []
    for reference, habit in habit_pairs(res):
        for preset in presets:
            change = habit_cost_change(res, reference, habit, preset, block_size)
            if change is not None:
                rows.append({"habit": habit, "reference": reference, "preset": preset, **change})
    return pd.DataFrame(rows, columns=["habit", "reference", "preset", "reference_usd_per_1000_sessions",
                                       "habit_usd_per_1000_sessions", "change"])


def provider_vs_vllm(res: ExperimentResults, presets: Iterable[str], block_size: int = DEFAULT_BLOCK_SIZE) -> pd.DataFrame:
    """Why a provider's cache-read share differs from vLLM's measured hit rate on the same traffic: the share of
    prompts below the provider's minimum cacheable length, its granularity and its breakpoint mode, each named."""
    costs = provider_costs(res, presets, block_size)
    hits = hit_by_workload(res)
    caching = hits[hits["measured"] > 0].groupby("workload")["measured"].max() if len(hits) else pd.Series()
    ok = res.ok_requests()
    rows = []
    for _, r in costs.iterrows():
        cfg = load_preset(r["preset"])
        prompts = ok[ok["workload"] == r["workload"]]["prompt_tokens"] if len(ok) else pd.Series(dtype=float)
        below = float((prompts < cfg.min_prefix_tokens).mean()) if len(prompts) else math.nan
        reasons = []
        if below > 0:
            reasons.append(f"{below:.0%} of prompts are below its minimum of {cfg.min_prefix_tokens:,} tokens")
        if cfg.granularity_tokens > 1:
            reasons.append(f"hits count in {cfg.granularity_tokens}-token steps")
        if cfg.mode == "breakpoints":
            reasons.append("it reads only up to a cache breakpoint (one at the end of each prompt here)")
        if cfg.ttl_s is not None:
            reasons.append(f"entries expire after {cfg.ttl_s:,.0f} s of the trace's think and tool time")
        rows.append({"workload": r["workload"], "preset": r["preset"],
                     "vllm_hit_rate": float(caching.get(r["workload"], math.nan)),
                     "cache_read_ratio": r["cache_read_ratio"], "share_below_minimum": below,
                     "min_prefix_tokens": cfg.min_prefix_tokens, "granularity_tokens": cfg.granularity_tokens,
                     "mode": cfg.mode, "why": "; ".join(reasons) or "same rules as vLLM's prefix cache"})
    return pd.DataFrame(rows)


def ttl_sensitivity(res: ExperimentResults, preset: str, ttls_s: Iterable[float] = (60, 300, 3600),
                    block_size: int = DEFAULT_BLOCK_SIZE) -> pd.DataFrame:
    """How the cache-read share and cost move with the provider's TTL, given the trace's think times. Each TTL is
    priced at that TTL's own write rate where the provider has one (Anthropic: 1.25x for 5 minutes, 2x for an
    hour; `ProviderCacheConfig.for_ttl`)."""
    rows = []
    base = load_preset(preset)
    for workload in sorted(set(res.cells["workload"].dropna())):
        reqs = _trace_for_cost(res, workload, block_size)
        if not reqs:
            continue
        for ttl in ttls_s:
            cfg = base.for_ttl(ttl)
            s = _simulated(res, workload, reqs, cfg, block_size)
            rows.append({"workload": workload, "ttl_s": ttl, "cache_write_multiplier": cfg.pricing.cache_write_multiplier,
                         "cache_read_ratio": s["cache_read_ratio"], "cost_usd": s["total_usd"]})
    return pd.DataFrame(rows)


def self_hosted_costs(res: ExperimentResults, hourly_usd: float, hardware: str = "the serving machine"
                      ) -> pd.DataFrame:
    """$ per million output (and total) tokens at the throughput each cell measured, at ``hourly_usd`` an hour
    of the serving machine (``hardware``: what it is); the machine and its rate are columns of the table, so a
    $/Mtok is never shown without the price it follows from."""
    rows = []
    for _, c in res.cells.iterrows():
        out_tps = c.get("output_tok_per_s")
        all_tps = (c.get("output_tok_per_s") or 0) + (c.get("prompt_tok_per_s") or 0)
        if not out_tps or (isinstance(out_tps, float) and math.isnan(out_tps)):
            continue
        rows.append({"server": c["server"], "workload": c["workload"], "load": c["load"], "repeat": c.get("repeat"),
                     "hardware": hardware, "hourly_usd": hourly_usd, "output_tok_per_s": out_tps,
                     "usd_per_mtok_output": self_hosted_cost(hourly_usd, 1, out_tps)["usd_per_mtok"],
                     "usd_per_mtok_all": self_hosted_cost(hourly_usd, 1, all_tps)["usd_per_mtok"]})
    return pd.DataFrame(rows)


def self_hosted_per_session(res: ExperimentResults, hourly_usd: float, hardware: str = "the serving machine"
                            ) -> pd.DataFrame:
    """Self-hosted $ per 1,000 sessions per configuration, workload and load: the machine's hourly price times
    each cell's duration over the sessions it completed, the median over repeats. The machine served only this
    replay, at the cell's load (think and tool time as the spec's ``time_scale`` left it), so a busier machine
    (a higher load within the SLO) costs less per session; ``usd_per_1000_sessions_provider`` is the cheapest
    provider preset's figure for the same workload with caching (:func:`provider_costs`), set beside it.
    ``within_capacity``: False for a sweep level above its configuration's capacity (it broke the SLO or
    preempted, or was under-driven), whose $ per session no deployment within the SLO would see."""
    cols = ["server", "workload", "load", "hardware", "hourly_usd", "repeats", "sessions", "duration_s",
            "usd_per_1000_sessions", "usd_per_1000_sessions_provider", "provider", "within_capacity"]
    ok = res.ok_requests()
    c = res.cells
    if not len(ok) or not len(c) or "duration_s" not in c:
        return pd.DataFrame(columns=cols)
    sessions = ok.groupby("cell")["session_id"].nunique()
    beyond = _cells_beyond_capacity(res)
    rows = []
    for _, cell in c[c["status"] == "ok"].iterrows() if "status" in c else c.iterrows():
        n, dur = int(sessions.get(cell["cell"], 0)), cell.get("duration_s")
        if not n or dur is None or not math.isfinite(float(dur)) or dur <= 0:
            continue
        rows.append({"server": cell["server"], "workload": cell["workload"], "load": str(cell["load"]),
                     "sessions": n, "duration_s": float(dur), "within_capacity": cell["cell"] not in beyond,
                     "usd_per_1000_sessions": self_hosted_usd_per_1000_sessions(hourly_usd, float(dur), n)})
    if not rows:
        return pd.DataFrame(columns=cols)
    per = pd.DataFrame(rows).groupby(["server", "workload", "load"], sort=False).agg(
        repeats=("sessions", "size"), sessions=("sessions", "median"), duration_s=("duration_s", "median"),
        usd_per_1000_sessions=("usd_per_1000_sessions", "median"),
        within_capacity=("within_capacity", "all")).reset_index()
    per.insert(3, "hardware", hardware)
    per.insert(4, "hourly_usd", hourly_usd)
    names = list(res.spec.cost.pricing) if res.spec is not None else []
    pc = provider_costs(res, names, workloads=list(dict.fromkeys(per["workload"]))) if names else pd.DataFrame()
    cheapest = (pc.sort_values("usd_per_1000_sessions").groupby("workload").head(1).set_index("workload")
                if len(pc) else pd.DataFrame(columns=["usd_per_1000_sessions", "preset"]))
    per["usd_per_1000_sessions_provider"] = per["workload"].map(cheapest["usd_per_1000_sessions"]).astype(float)
    per["provider"] = per["workload"].map(cheapest["preset"])
    return per[cols]


def _cells_beyond_capacity(res: ExperimentResults) -> set[str]:
    """The sweep cells above their configuration's capacity (`claims.sweep_capacity`: met and driven)."""
    out = set()
    for e in getattr(res.experiment, "capacity", None) or []:
        if not hasattr(e, "points"):
            continue
        cap = sweep_capacity(e).capacity
        out |= {PurePath(p.cell).name for p in e.points if p.cell and (cap is None or p.load > cap)}
    return out


def workload_scale(res: ExperimentResults) -> pd.DataFrame:
    """Per workload: the preset it was generated from, its prompt and output scales and its context cap (the
    experiment spec's ``workloads``), and from its trace how many of its sessions reached the cap. Empty for a
    single replay with no spec (its trace's scale alone is not enough to say what was shortened)."""
    cols = ["workload", "preset", "scale", "output_scale", "max_context", "sessions", "sessions_capped"]
    workloads = (res.spec.model_extra or {}).get("workloads") if res.spec is not None else None
    if not isinstance(workloads, dict):
        return pd.DataFrame(columns=cols)
    rows = []
    for name, ref in workloads.items():
        ref = ref if isinstance(ref, dict) else {}
        meta: dict[str, Any] = {}
        tdir = res.trace_dir(name)
        if tdir is not None and (tdir / "trace.json").is_file():
            meta = json.loads((tdir / "trace.json").read_text())
        scale = ref.get("scale", meta.get("scale"))
        if scale is None:
            continue
        rows.append({"workload": name, "preset": ref.get("spec", name), "scale": float(scale),
                     "output_scale": ref.get("output_scale"), "max_context": ref.get("max_context"),
                     "sessions": meta.get("num_sessions", ref.get("sessions")),
                     "sessions_capped": meta.get("truncated_sessions")})
    return pd.DataFrame(rows, columns=cols)


def scale_caveat(res: ExperimentResults) -> tuple[str, dict[str, float | None]] | None:
    """The workload scale and what it does to the cost page's figures, where any workload ran below full scale
    or under a context cap: $ per 1,000 sessions are for the shortened sessions, and the share of prompts
    below a provider's minimum cacheable length is that of the short prompts (beside it: the share the same
    prompts at full scale would have, prompt / scale, ignoring the cap)."""
    sc = workload_scale(res)
    short = sc[(sc["scale"] < 1) | sc["max_context"].notna()] if len(sc) else sc
    if not len(short):
        return None
    groups = []
    for (scale, out, cap), g in short.groupby(["scale", "output_scale", "max_context"], dropna=False, sort=False):
        capped = g["sessions_capped"].dropna()
        words = f"prompt scale {scale:g}" + (f", outputs {out:g}" if out is not None and pd.notna(out) else "")
        if cap is not None and pd.notna(cap):
            words += f", contexts capped at {int(cap):,} tokens"
            if len(capped):
                words += f" ({int(capped.sum())} of {int(g['sessions'].fillna(0).sum())} sessions ended early at the cap)"
        groups.append(f"{', '.join(g['workload'])} ran at {words}")
    scale = float(short["scale"].min())
    text = (f"Scale: {'; '.join(groups)}. Every $ per 1,000 sessions here is for these shortened sessions: a "
            f"session at the presets' full length has ~{1 / scale:,.0f}x the prompt tokens, so its input cost is "
            "that much higher")
    numbers: dict[str, float | None] = {"min_prompt_scale": scale}
    ok = res.ok_requests()
    names = list(res.spec.cost.pricing) if res.spec is not None else []
    if len(ok) and names and scale < 1:
        preset = max(names, key=lambda n: load_preset(n).min_prefix_tokens)
        minimum = load_preset(preset).min_prefix_tokens
        scales = ok["workload"].map(dict(zip(sc["workload"], sc["scale"]))).fillna(1.0)
        below = float((ok["prompt_tokens"] < minimum).mean())
        full = float((ok["prompt_tokens"] / scales < minimum).mean())
        text += (f"; {_pct(below)} of these prompts are below {preset}'s {minimum:,}-token minimum cacheable length, "
                 f"where at full scale {_pct(full)} would be")
        numbers |= {"share_below_minimum": below, "share_below_minimum_full_scale": full}
    return text + ".", numbers


@caveat("workload_scale", "cost")
def _caveat_scale(res: ExperimentResults):
    return scale_caveat(res)


def cost_findings(res: ExperimentResults) -> list[Finding]:
    names = list(res.spec.cost.pricing) if res.spec is not None else []
    if not names:
        return []
    pc = provider_costs(res, names)
    if not len(pc):
        return []
    out = []
    machine = res.spec.cost.self_hosted if res.spec is not None else None
    own = self_hosted_per_session(res, machine.hourly_usd, machine.hardware) if machine is not None else pd.DataFrame()
    for wl, g in pc.groupby("workload", sort=False):
        best = g.sort_values("usd_per_1000_sessions").iloc[0]
        numbers = {"usd_per_1000_sessions": float(best["usd_per_1000_sessions"])}
        mine = own[(own["workload"] == wl) & own["within_capacity"]].sort_values("usd_per_1000_sessions") \
            if len(own) else own
        self_words = ""
        statements: list[Statement] = []
        if len(mine) and machine is not None:
            cheap = mine.iloc[0]
            self_words = (f"; self-hosted on {machine.hardware} at ${machine.hourly_usd:,.2f} an hour: "
                          f"${cheap['usd_per_1000_sessions']:,.2f} per 1,000 sessions ({cheap['server']} at "
                          f"{cheap['load']}, {cheap['duration_s']:.0f} s for {cheap['sessions']:.0f} sessions)")
            numbers["self_hosted_usd_per_1000_sessions"] = float(cheap["usd_per_1000_sessions"])
            statements.append(Statement(metric="self_hosted_usd_per_1000_sessions",
                                        value=float(cheap["usd_per_1000_sessions"]), hourly_usd=machine.hourly_usd,
                                        selection=one_selection(res, str(cheap["server"]), str(wl),
                                                                str(cheap["load"]))))
        out.append(Finding(question="cost", notebook="cost", figure="provider_cost_per_session",
                           statements=statements,
                           sentence=f"{wl}: cheapest provider is {best['preset']} at "
                                    f"${best['usd_per_1000_sessions']:,.2f} per 1,000 sessions with caching "
                                    f"(${best['usd_per_1000_sessions_no_cache']:,.2f} without; same "
                                    f"{int(best['sessions'])} sessions){self_words}.",
                           numbers=numbers))
    habits = habit_costs(res, names[:1])
    for h in habits.itertuples():
        out.append(Finding(question="cost", notebook="cost", figure="habit_cost",
                           sentence=f"{h.habit} costs ${h.habit_usd_per_1000_sessions:,.2f} vs "
                                    f"${h.reference_usd_per_1000_sessions:,.2f} per 1,000 sessions of {h.reference} "
                                    f"on {h.preset}, both with caching ({h.change * 100:+.0f} %).",
                           numbers={"habit_usd_per_1000_sessions": float(h.habit_usd_per_1000_sessions),
                                    "reference_usd_per_1000_sessions": float(h.reference_usd_per_1000_sessions),
                                    "change_vs_reference": float(h.change)}))
    gap = provider_vs_vllm(res, names)
    if len(gap):
        worst = gap.iloc[(gap["vllm_hit_rate"] - gap["cache_read_ratio"]).abs().argmax()]
        out.append(Finding(question="cost", notebook="cost", figure=None,
                           sentence=f"{worst['workload']} on {worst['preset']}: the provider reads "
                                    f"{_pct(worst['cache_read_ratio'])} of input from its cache where vLLM hit "
                                    f"{_pct(worst['vllm_hit_rate'])} — {worst['why']}.",
                           numbers={"cache_read_ratio": float(worst["cache_read_ratio"]),
                                    "vllm_hit_rate": float(worst["vllm_hit_rate"])}))
    return out


@caveat("min_cacheable", "cost")
def _caveat_min_cacheable(res: ExperimentResults):
    ok = res.ok_requests()
    names = list(res.spec.cost.pricing) if res.spec is not None else []
    if not len(ok) or not names:
        return None
    mins = {n: load_preset(n).min_prefix_tokens for n in names}
    shares = {n: float((ok["prompt_tokens"] < m).mean()) for n, m in mins.items() if m > 0}
    below = {n: s for n, s in shares.items() if s > 0}
    if not below:
        return None
    words = ", ".join(f"{_pct(s)} below {mins[n]:,} tokens ({n})" for n, s in below.items())
    return ((f"Prompts are shorter than providers' minimum cacheable length: {words}; those are never cached by "
            "the provider, whatever their reuse."), {f"share_below_{n}": s for n, s in below.items()})


def _cost_from_spec(spec: ExperimentSpecCore) -> dict[str, Any]:
    """The spec's pricing presets and the serving machine: its hourly price and what it is."""
    return {"pricing": list(spec.cost.pricing), "hourly_usd": float(spec.cost.self_hosted.hourly_usd),
            "hardware": spec.cost.self_hosted.hardware}


@report_page("cost", "Cost: provider prompt caching and self-hosting", order=50, questions=("cost",),
             figures=("provider_cost_per_session", "habit_cost", "ttl_sensitivity"),
             parameters=("pricing", "hourly_usd", "hardware"), key_figures=("provider_cost_per_session",),
             from_spec=_cost_from_spec)
def _cost_page(ctx: PageContext) -> list[Finding]:
    return cost_findings(ctx.res)
