"""The hit_rates page (notebooks/hit_rates.ipynb): prefix-cache hit rates, predicted vs measured, per workload and step; what each history habit costs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd
from kvscope.harness.analysis.ab import compare
from kvscope.harness.analysis.ab import compare as ab_compare_runs
from kvscope.harness.analysis.common import (
    GPU_BLOCK_SIZE,
    RESAMPLES,
    _caching_server,
    _change_words,
    _derived,
    _load_order,
    _metric_row,
    _ms,
    _ok_cells,
    _pct,
    _ratio,
    _runs,
    habit_pairs,
    hit_by_workload_load,
    one_selection,
    stated,
    throughput_change_statement,
    verdict_words,
    workload_levels,
)
from kvscope.harness.analysis.pages.cost import habit_cost_change
from kvscope.harness.analysis.registry import PageContext, caveat, report_page
from kvscope.harness.pricing.provider_cache import load_preset
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.selection import Statement
from kvscope.workloads.policies import Compaction, HistoryPolicy, VolatilePrefix
from kvscope.workloads.spec import WorkloadSpec
from kvscope.workloads.trace_schema import read_trace_file
from pydantic import ValidationError


def hit_table(res: ExperimentResults) -> pd.DataFrame:
    """Per cell: prompt tokens and hit rate three ways (server per request, /metrics counters, predicted)."""
    cols = ["cell", "server", "workload", "load", "repeat", "status", "prefix_caching", "speculative", "requests",
            "hit_server", "hit_metrics", "hit_predicted", "would_hit", "requests_predicted_exactly",
            "requests_compared", "predictor", "requests_predicted_exactly_sequential"]
    df = res.cells.reindex(columns=cols).copy()
    df["predicted_minus_server_pp"] = (df["hit_predicted"] - df["hit_server"]) * 100
    df["server_minus_metrics_pp"] = (df["hit_server"] - df["hit_metrics"]) * 100
    return df




def hit_by_step(res: ExperimentResults, max_step: int | None = None) -> pd.DataFrame:
    """Hit rate by turn/step index: how reuse builds up (or collapses) along a session."""
    ok = res.ok_requests()
    if not len(ok):
        return pd.DataFrame(columns=["server", "workload", "step", "hit_rate", "requests"])
    if max_step is not None:
        ok = ok[ok["step"] <= max_step]
    g = ok.groupby(["server", "workload", "step"]).agg(
        prompt=("prompt_tokens", "sum"), cached=("cached_tokens", "sum"), predicted=("predicted_cached_tokens", "sum"),
        requests=("request_id", "count")).reset_index()
    g["hit_rate"] = _ratio(g["cached"], g["prompt"])
    g["predicted_hit_rate"] = _ratio(g["predicted"], g["prompt"])
    return g


def session_hit_rates(res: ExperimentResults) -> pd.DataFrame:
    """One row per (server, workload, cell, session): the session's token-weighted hit rate. Sessions, not
    requests, are the unit of independence (a session's requests share its context), so the spread across
    sessions is what a pooled hit rate hides: one long session can carry it."""
    cols = ["server", "workload", "cell", "session_id", "requests", "prompt_tokens", "cached_tokens", "hit_rate"]
    ok = res.ok_requests()
    if not len(ok):
        return pd.DataFrame(columns=cols)
    g = ok.groupby(["server", "workload", "cell", "session_id"], sort=False).agg(
        requests=("request_id", "count"), prompt_tokens=("prompt_tokens", "sum"),
        cached_tokens=("cached_tokens", "sum")).reset_index()
    g["hit_rate"] = _ratio(g["cached_tokens"], g["prompt_tokens"])
    return g[cols]


def session_hit_rate_spread(res: ExperimentResults) -> pd.DataFrame:
    """Per (server, workload): the distribution of :func:`session_hit_rates` across sessions (all cells
    pooled: each replay of a session is one observation): count, min, 10th / 50th / 90th percentile, max, and
    the pooled token-weighted rate beside them."""
    s = session_hit_rates(res)
    cols = ["server", "workload", "sessions", "min", "p10", "median", "p90", "max", "pooled"]
    if not len(s):
        return pd.DataFrame(columns=cols)
    g = s.groupby(["server", "workload"], sort=False)
    out = g["hit_rate"].agg(sessions="count", min="min", p10=lambda x: x.quantile(0.1), median="median",
                            p90=lambda x: x.quantile(0.9), max="max").reset_index()
    pooled = g.agg(c=("cached_tokens", "sum"), p=("prompt_tokens", "sum")).reset_index()
    out["pooled"] = _ratio(pooled["c"], pooled["p"]).to_numpy()
    return out[cols]


def invalidation_cost(res: ExperimentResults) -> pd.DataFrame:
    """Uncached tokens per request by the kind of history transition (append, edit, compaction, …).

    An edit at depth d or a volatile prefix at position p invalidates every block after it: the gap between
    the `append` row and the others is what that habit costs in prefill. The column is *uncached* (new +
    recomputed, `analysis.glossary`), not "recomputed": a compaction's summary is new, and the explain page's
    recomputed tokens leave new tokens out.
    """
    ok = res.ok_requests()
    if not len(ok) or "transition" not in ok:
        return pd.DataFrame()
    ok = ok.assign(uncached=ok["prompt_tokens"] - ok["cached_tokens"].fillna(0))
    g = ok.groupby(["server", "workload", "transition"]).agg(
        requests=("request_id", "count"), mean_prompt_tokens=("prompt_tokens", "mean"),
        mean_cached_tokens=("cached_tokens", "mean"), mean_uncached_tokens=("uncached", "mean")).reset_index()
    g["hit_rate"] = g["mean_cached_tokens"] / g["mean_prompt_tokens"]
    return g


def reconciliation(res: ExperimentResults) -> pd.DataFrame:
    """Client vs server: predicted and reported hits request by request, and the /metrics counters; which
    model predicted (``predictor``) and, beside a scheduler-model prediction, the sequential simulator's share."""
    t = hit_table(res)
    compared = t["requests_compared"].where(t["requests_compared"] > 0)
    t["exact_share"] = t["requests_predicted_exactly"] / compared
    t["exact_share_sequential"] = t["requests_predicted_exactly_sequential"] / compared
    return t[["cell", "prefix_caching", "hit_server", "hit_metrics", "hit_predicted", "would_hit",
              "server_minus_metrics_pp", "predicted_minus_server_pp", "predictor", "requests_predicted_exactly",
              "requests_compared", "exact_share", "exact_share_sequential"]]


def _trace_policies(res: ExperimentResults, workload: str) -> tuple[list[HistoryPolicy], float]:
    """A workload trace's history policies and scale, from its validated trace.json (none for a trace that was
    imported rather than generated from a workload spec)."""
    tdir = res.trace_dir(workload)
    if tdir is None or not (tdir / "trace.json").exists():
        return [], 1.0
    meta = read_trace_file(tdir / "trace.json")
    try:
        spec = WorkloadSpec.model_validate(meta.spec) if meta.spec else None
    except ValidationError:  # an importer's description of its source, not a workload spec
        spec = None
    return (list(spec.sessions.policies) if spec is not None else []), float(meta.scale or 1.0)


def describe_habit(res: ExperimentResults, reference: str, habit: str) -> str:
    """What the habit adds to the reference's history, in words (from the traces' specs)."""
    ref_policies, _ = _trace_policies(res, reference)
    policies, scale = _trace_policies(res, habit)
    ref_kinds = {p.model_dump_json() for p in ref_policies}
    words = []
    for p in policies:
        if p.model_dump_json() in ref_kinds:
            continue
        if isinstance(p, VolatilePrefix):
            words.append(f"a timestamp at token {max(round(p.position * scale), 0)}")
        elif isinstance(p, Compaction):
            words.append(f"compaction at {int(p.threshold_tokens * scale):,} tokens")
        else:
            words.append(p.kind.replace("_", " "))
    return " and ".join(words) or f"the {habit.removeprefix(reference + '-')} habit"


def _cost_preset(res: ExperimentResults) -> str | None:
    """The spec's first preset with a cache-write premium (where a habit can make caching dearer), else its first."""
    names = list(res.spec.cost.pricing) if res.spec is not None else []
    for n in names:
        if load_preset(n).pricing.cache_write_multiplier > 1:
            return n
    return names[0] if names else None


@dataclass(frozen=True)
class HabitEffect:
    """One habit against its reference workload on the caching configuration, at the lowest load both ran:
    the measured hit rates, the verdict engine's rows (TTFT p50, hit rate) and each side's provider cost
    against its reference, both cached (`pages.cost.habit_cost_change`). The habit finding and the habit
    recommendation are both read from it."""

    what: str
    reference: str
    habit: str
    server: str
    load: str
    hit_a: float
    hit_b: float
    ttft: dict[str, Any]
    hit: dict[str, Any]
    preset: str | None
    cost: dict[str, float] | None


def habit_effects(res: ExperimentResults, resamples: int = RESAMPLES) -> list[HabitEffect]:
    """Every habit pair's effect (see :class:`HabitEffect`), computed once per results object."""
    return _derived(res, ("habit_effects", resamples), lambda: _habit_effects(res, resamples))


def _habit_effects(res: ExperimentResults, resamples: int) -> list[HabitEffect]:
    server = _caching_server(res)
    loads = _load_order(res)
    if server is None or not loads:
        return []
    hits = hit_by_workload_load(res)
    hits = hits[hits["server"] == server].set_index(["workload", "load"])
    preset = _cost_preset(res)
    out = []
    for reference, habit in habit_pairs(res):
        if not {reference, habit} <= set(hits.index.get_level_values("workload")):
            continue
        # the lowest load at which both workloads ran on this server (a sweep's levels may hold only one of them)
        load = next((lv for lv in loads if _runs(res, server, reference, lv) and _runs(res, server, habit, lv)),
                    loads[0])
        ra, rb = _runs(res, server, reference, load), _runs(res, server, habit, load)
        table = compare(ra, rb, resamples=resamples) if ra and rb else pd.DataFrame()
        ttft = _metric_row(table, "ttft_p50_s") or {}
        cost = habit_cost_change(res, reference, habit, preset) if preset else None
        # the hit rates at the level the TTFT verdict is at, never pooled over levels (hits depend on the load)
        hit_a = float(hits.loc[(reference, load), "measured"]) if (reference, load) in hits.index else math.nan
        hit_b = float(hits.loc[(habit, load), "measured"]) if (habit, load) in hits.index else math.nan
        out.append(HabitEffect(describe_habit(res, reference, habit), reference, habit, server, load,
                               hit_a, hit_b, ttft, _metric_row(table, "hit_rate") or {}, preset, cost))
    return out


def habit_findings(res: ExperimentResults, resamples: int = RESAMPLES) -> list[Finding]:
    """Per habit: hit rate, TTFT p50 (with the verdict engine's interval) and provider cost against its reference."""
    out = []
    for e in habit_effects(res, resamples):
        f = _habit_sentence(e.what, e.reference, e.habit, e.server, e.load, e.hit_a, e.hit_b, e.ttft, e.preset,
                            e.cost)
        statements = [Statement(metric="hit_rate", value=v, selection=one_selection(res, e.server, w, e.load))
                      for w, v in ((e.reference, e.hit_a), (e.habit, e.hit_b)) if math.isfinite(v)]
        out.append(f.model_copy(update={"statements": statements}))
    return out


def habit_recommendations(res: ExperimentResults, resamples: int = RESAMPLES) -> list[Finding]:
    """Per habit, what to do about it — only from decided verdicts (TTFT p50, hit rate): *avoid* where the habit
    is decided worse on one of them, else the comparison is said to be inconclusive, with its numbers."""
    out = []
    for e in habit_effects(res, resamples):
        decided: list[str] = []
        undecided: list[str] = []
        hit_v, ttft_v = e.hit.get("verdict"), e.ttft.get("verdict")
        pp = (e.hit_a - e.hit_b) * 100
        hit_words = f"hit rate {abs(pp):.0f} pp {'higher' if pp > 0 else 'lower'}" if round(pp) else "hit rate unchanged"
        (decided if hit_v in ("worse", "better") else undecided).append(hit_words)
        a, b = e.ttft.get("a"), e.ttft.get("b")
        if a is not None and b is not None:
            gain_ms = (a - b) * 1000
            ttft_words = (f"TTFT p50 {abs(gain_ms):.0f} ms {'higher' if gain_ms > 0 else 'lower'}" if round(gain_ms)
                          else "TTFT p50 unchanged")
            (decided if ttft_v in ("worse", "better") else undecided).append(ttft_words)
        cost = ""
        if e.preset and e.cost is not None and math.isfinite(e.cost["change"]) and e.cost["change"] > -1:
            cost = f", {_change_words(1 / (1 + e.cost['change']) - 1, e.preset + ' cost')} (priced)"
        worse = "worse" in (hit_v, ttft_v)
        better = "better" in (hit_v, ttft_v) and not worse
        what = e.what[0].upper() + e.what[1:]
        on = f"({e.habit} vs {e.reference}, on {e.server} at {e.load})"
        if worse:
            text = (f"Avoid {e.what} {on}: without it, {', '.join(decided)} (decided)"
                    + (f"; {', '.join(undecided)} (inconclusive)" if undecided else "") + f"{cost}.")
            value = "avoid"
        elif better:
            text = f"{what} helps {on}: {', '.join(decided)} (decided){cost}."
            value = "keep"
        else:
            text = (f"{what} {on}: inconclusive — without it {', '.join(undecided)}; no verdict is decided, so "
                    "this is no recommendation either way.")
            value = "inconclusive"
        out.append(Finding(question="recommendation", sentence=text, notebook="hit_rates", figure="hit_rate_by_workload",
                           numbers={"hit_rate_gain_pp": pp, "ttft_p50_gain_s": None if a is None or b is None
                                    else float(b - a)}, claim=f"habit:{e.habit}", claim_value=value,
                           statements=[Statement(metric="hit_rate_gain_pp", value=pp, reference_workload=e.reference,
                                                 selection=one_selection(res, e.server, e.habit, e.load))]
                           if math.isfinite(pp) else []))
    return out


def prefix_caching_recommendations(res: ExperimentResults, resamples: int = RESAMPLES) -> list[Finding]:
    """Prefix caching on against off (the caching configuration against each non-speculative one with caching
    off), from the verdicts on TTFT p50 and output throughput over every workload and load both ran."""
    on = _caching_server(res)
    c = _ok_cells(res)
    if on is None or "prefix_caching" not in c:
        return []
    offs = [s for s in dict.fromkeys(map(str, c["server"])) if s != on and not bool(
        c[c["server"] == s]["prefix_caching"].iloc[0]) and not bool(c[c["server"] == s]["speculative"].iloc[0])]
    out = []
    for off in offs:
        rows = []
        for (wl, load), _ in c[c["server"] == off].groupby(["workload", "load"], sort=False):
            ra, rb = _runs(res, off, wl, str(load)), _runs(res, on, wl, str(load))
            if ra and rb:
                t = ab_compare_runs(ra, rb, resamples=resamples)
                rows.append(t.assign(workload=wl, load=str(load)))
        if not rows:
            continue
        t = pd.concat(rows, ignore_index=True)
        parts, decided_better, decided_worse = [], 0, 0
        statements = []
        for metric, label in (("output_tokens_per_s", "output throughput"), ("ttft_p50_s", "TTFT p50")):
            m = t[t["metric"] == metric]
            if not len(m):
                continue
            counts = m["verdict"].value_counts()
            decided_better += int(counts.get("better", 0))
            decided_worse += int(counts.get("worse", 0))
            rel = (m["diff"] / m["a"].where(m["a"] != 0)).median()
            if metric == "output_tokens_per_s":
                statements += throughput_change_statement(on, off, m, rel)
            parts.append(f"{_change_words(rel, label)} with caching on (median of {len(m)}; "
                         f"{verdict_words(counts)})")
        n = t.groupby(["workload", "load"]).ngroups
        evidence = f"with caching on against {off} over {n} workload × load comparison(s): " + "; ".join(parts)
        if decided_better and not decided_worse:
            text, value = f"Keep prefix caching on ({on}): {evidence}.", "keep_on"
        elif decided_worse and not decided_better:
            text, value = f"Prefix caching cost more than it saved here ({on}): {evidence}.", "turn_off"
        else:
            text = (f"Prefix caching on or off ({on} vs {off}): inconclusive — {evidence}; the hit rate gain is "
                    "by construction, its latency and throughput effect is not decided.")
            value = "inconclusive"
        out.append(Finding(question="recommendation", sentence=text, notebook="hit_rates",
                           figure="hit_rate_by_workload", numbers={"comparisons": float(n)},
                           claim=f"prefix_caching:{on}", claim_value=value, statements=statements))
    return out


def _habit_sentence(what: str, reference: str, habit: str, server: str, load: str, hit_a: float, hit_b: float,
                    ttft: dict[str, Any], preset: str | None, cost: dict[str, float] | None) -> Finding:
    a, b = ttft.get("a"), ttft.get("b")
    lo, hi = ttft.get("ci_low"), ttft.get("ci_high")
    verdict = ttft.get("verdict")
    change = cost["change"] if cost is not None else None
    costs_nothing = abs(hit_b - hit_a) < 0.01 and verdict in (None, "equivalent", "inconclusive") and \
        (change is None or not math.isfinite(change) or abs(change) < 0.01)
    cost_words = ""
    if preset and cost is not None and change is not None and math.isfinite(change):
        # against the reference habit, both cached (pages.cost.habit_cost_change), never against no caching
        cost_words = (f", and costs ${cost['habit_usd_per_1000_sessions']:,.2f} vs "
                      f"${cost['reference_usd_per_1000_sessions']:,.2f} per 1,000 sessions on {preset} with "
                      f"caching ({change * 100:+.0f} % against {reference})")
    interval = f" (B − A {(b - a) * 1000:+.0f} ms, 95 % CI {lo * 1000:+.0f} to {hi * 1000:+.0f} ms; {verdict})" \
        if None not in (a, b, lo, hi) else ""
    if costs_nothing:
        sentence = (f"{what[0].upper() + what[1:]} ({habit} vs {reference}, on {server} at {load}) costs nothing "
                    "measurable: "
                    f"hit rate {_pct(hit_a)} vs {_pct(hit_b)}, TTFT p50 {_ms(a)} vs {_ms(b)} ms{interval}.")
    else:
        sentence = (f"{what[0].upper() + what[1:]} ({habit} vs {reference}, on {server} at {load}) takes the hit "
                    f"rate from {_pct(hit_a)} to {_pct(hit_b)} and TTFT p50 from {_ms(a)} to {_ms(b)} ms"
                    f"{interval}{cost_words}.")
    return Finding(question="habit", sentence=sentence, notebook="hit_rates", figure="hit_rate_by_workload",
                   numbers={"hit_rate_reference": hit_a, "hit_rate_habit": hit_b, "ttft_p50_reference_s": a,
                            "ttft_p50_habit_s": b, "cost_change_vs_reference": change},
                   interval=(lo, hi) if None not in (lo, hi) else None, interval_of="ttft_p50_s difference (s)")


def hit_rate_leader(res: ExperimentResults) -> Finding | None:
    """Which workload reuses the most and which the least on the caching configuration, each at its lowest load
    level, stated with the level: the one sentence behind the page's finding and its figure's title (a hit
    rate pooled over load levels once gave the finding one leader and the title another)."""
    server = _caching_server(res)
    if server is None:
        return None
    hits = hit_by_workload_load(res)
    levels = workload_levels(res, server)
    rows = []
    for workload, load in levels:
        h = hits[(hits["server"] == server) & (hits["workload"] == workload) & (hits["load"] == load)]
        if len(h) and pd.notna(h["measured"].iloc[0]):
            rows.append(Statement(metric="hit_rate", value=float(h["measured"].iloc[0]),
                                  selection=one_selection(res, server, workload, load)))
    if not rows:
        return None
    rows.sort(key=lambda st: st.value)
    lo, hi = rows[0], rows[-1]
    at = "its lowest load level" if len(rows) > 1 else "its load level"
    if len(rows) == 1:
        text = (f"On {server}, {hi.selection.workloads[0]} at {hi.selection.loads[0]} reuses {stated(hi)} of its "
                "prompt tokens from the cache.")
    else:
        text = (f"On {server}, each workload at {at}: {hi.selection.workloads[0]} ({hi.selection.loads[0]}) "
                f"reuses the most, {stated(hi)} of prompt tokens from the cache, and {lo.selection.workloads[0]} "
                f"({lo.selection.loads[0]}) the least, {stated(lo)}.")
    return Finding(question="hit_rate", notebook="hit_rates", figure="hit_rate_by_workload", sentence=text,
                   numbers={"hit_rate_max": hi.value, "hit_rate_min": lo.value}, statements=[hi, lo])


def hit_rate_findings(res: ExperimentResults) -> list[Finding]:
    out = []
    leader = hit_rate_leader(res)
    if leader is not None:
        out.append(leader)
    server = _caching_server(res)
    hits = hit_by_workload_load(res)
    if server is not None and len(hits):
        h = hits[hits["server"] == server]
        err = (h["predicted_by_simulator"] - h["measured"]).abs().max() if len(h) else math.nan
        if math.isfinite(err):
            out.append(Finding(question="hit_rate", notebook="hit_rates", figure="hit_rate_by_workload",
                               sentence=f"kvscope's simulator predicts the server's hit rate within "
                                        f"{err * 100:.1f} percentage points on every workload and load level.",
                               numbers={"max_abs_error_pp": float(err * 100)}))
    return out


def hit_rate_figure_table(res: ExperimentResults) -> pd.DataFrame:
    """The hit-rate figure's data: each workload at its lowest load level on each configuration (the levels
    the leader sentence and title state), the three hit rates long, with a ``label`` ``workload (load)``."""
    hits = hit_by_workload_load(res)
    if not len(hits):
        return pd.DataFrame(columns=["server", "workload", "load", "label", "source", "hit_rate"])
    keep = []
    for server in dict.fromkeys(hits["server"]):
        for workload, load in workload_levels(res, str(server)):
            keep.append(hits[(hits["server"] == server) & (hits["workload"] == workload) & (hits["load"] == load)])
    t = pd.concat(keep, ignore_index=True) if keep else hits.iloc[:0]
    long = t.melt(id_vars=["server", "workload", "load"],
                  value_vars=["measured", "predicted_by_simulator", "would_hit_with_caching"],
                  var_name="source", value_name="hit_rate")
    long["source"] = long["source"].map({"measured": "measured", "predicted_by_simulator": "predicted (simulator)",
                                         "would_hit_with_caching": "would hit with caching on"})
    long["label"] = long["workload"] + " (" + long["load"] + ")"
    return long[["server", "workload", "load", "label", "source", "hit_rate"]]


@caveat("block_size", "hit_rates")
def _caveat_block_size(res: ExperimentResults):
    sizes = sorted({int(b) for b in _ok_cells(res).get("block_size", pd.Series(dtype=float)).dropna()})
    big = [b for b in sizes if b > GPU_BLOCK_SIZE]
    if not big:
        return None
    return ((f"KV blocks are {big[0]} tokens here (vLLM on CPU) against {GPU_BLOCK_SIZE} on a GPU: a hit is floored "
            f"to whole blocks, so each prompt can lose up to {big[0] - 1} reusable tokens and hit rates on a GPU "
            "are higher."), {"block_size": float(big[0])})


@report_page("hit_rates", "Prefix-cache hit rates: predicted vs measured", order=20,
             questions=("habit", "hit_rate", "recommendation"),
             figures=("hit_rate_by_workload", "hit_rate_by_step", "hit_rate_by_session", "recomputed_by_transition"),
             key_figures=("hit_rate_by_workload", "hit_rate_by_step"))
def _hit_rates_page(ctx: PageContext) -> list[Finding]:
    return [*habit_recommendations(ctx.res, ctx.resamples), *prefix_caching_recommendations(ctx.res, ctx.resamples),
            *habit_findings(ctx.res, ctx.resamples), *hit_rate_findings(ctx.res)]


@caveat("cache_not_reset", "hit_rates")
def _caveat_cache_not_reset(res: ExperimentResults):
    """Cells replayed on a prefix cache that could not be emptied first (summary.json ``data_quality``
    ``cache_not_reset``: vLLM without VLLM_SERVER_DEV_MODE=1)."""
    bad = {cell: s.data_quality.cache_not_reset for cell, s in res.summaries.items()
           if s.data_quality.cache_not_reset}
    if not bad:
        return None
    cell, why = next(iter(bad.items()))
    return ((f"{len(bad)} of {len(res.summaries)} cell(s) started on a prefix cache that could not be emptied "
             f"(e.g. {cell}: {why}): they hit what earlier runs left, so measured hit rates exceed the "
             "predicted ones and TTFTs are those of a warm cache. Start vLLM with VLLM_SERVER_DEV_MODE=1."),
            {"cells_cache_not_reset": float(len(bad))})
