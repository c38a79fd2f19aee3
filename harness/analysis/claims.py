"""The report's claims: each quantity two pages speak about, computed once, as a typed value with its evidence.

Why this structure. The index and the pages used to phrase eviction, speculative payoff and capacity each from
their own reading of the data, and they disagreed: the concurrency page said "no eviction pressure" from the
KV-usage gauge (which counts the blocks of *running* requests, not the cached free blocks eviction takes) while
the explain page attributed 97 % of a workload's recomputed tokens to eviction; the speculative page said
"pays off" from point estimates while the calibrated A/B verdicts were 1 better and 8 inconclusive. Here each
such quantity is one :class:`Claim` — a key (``eviction``, ``speculative:<server>``,
``capacity:<server>:<workload>``), a value word, the sentence and its numbers — computed once per results
object (`common._derived`), and every page that mentions the quantity renders that claim and tags its finding
with ``claim`` / ``claim_value``, so ``tests/test_claims.py`` can render a constructed experiment and check that
no two pages state different values for one key.

* **Eviction** is read from evictions, not from the gauge: per caching cell, the tokens an unbounded cache would
  have served from blocks cached earlier in that run (the exact simulator on the tokens its server held, in
  the run's order: `explain.run_eviction`) that the server did not. A recorded replay's planned answers, which
  the server never held, are not eviction.
* **Speculative payoff** follows the A/B verdicts on output throughput (hierarchical bootstrap, `ab.compare`):
  *pays* only where most comparisons are *better* and none *worse*; what got worse is named beside it (any
  metric with a *worse* verdict, and the like-for-like point estimates of TTFT p50, ITL p99 and goodput).
* **Capacity** is the sweep's answer re-read from its recorded levels by today's rule (:func:`sweep_capacity`:
  an under-driven level does not count, so a file whose recorded sentence says "holds 5" on a level that had
  4.1 sessions in flight is stated as what its points support), with what was measured (which levels, their
  TTFT p90, the under-driven ones marked) and what the scheduler model predicts (the first level it fails, its
  eviction cliff). A speculative configuration whose capacity is below its baseline's says so in what gets worse.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import pandas as pd
from kvscope.harness.analysis.capacity import (Capacity, LoadPoint, capacity_from_points, point_meets_slo,
                                               predicted_point, under_driven)
from kvscope.harness.analysis.common import (_change_words, _derived, _ok_cells, _pct, _signed_pct,
                                             throughput_change_statement, verdict_words)
from kvscope.harness.analysis.explain_experiment import cell_eviction
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.selection import Selection, Statement
from kvscope.harness.results.summary import compared_statistic

__all__ = ["Claim", "capacity_claims", "contradictions", "eviction_by_cell", "eviction_claim",
           "speculative_claims", "speculative_recommendation", "sweep_capacity", "tag"]


@dataclass(frozen=True)
class Claim:
    """One statement about one quantity: ``key`` names the quantity, ``value`` is what is stated about it."""

    key: str
    value: str
    sentence: str
    numbers: dict[str, float | None] = field(default_factory=dict)
    worse: str = ""  # what gets worse with it, in words (speculative claims)
    statements: list[Statement] = field(default_factory=list)  # the numbers the claims audit recomputes

    def finding(self, question: str, notebook: str, figure: str | None = None) -> Finding:
        return Finding(question=question, sentence=self.sentence, numbers=self.numbers,  # type: ignore[arg-type]
                       notebook=notebook, figure=figure, claim=self.key, claim_value=self.value,
                       statements=self.statements)


def contradictions(found: list[Finding]) -> dict[str, dict[str, str]]:
    """The claims stated with more than one value across ``found`` (every page's findings): claim key ->
    {notebook: value}. Empty when the report tells one story."""
    by: dict[str, dict[str, str]] = {}
    for f in found:
        if f.claim is not None:
            by.setdefault(f.claim, {})[f.notebook] = str(f.claim_value)
    return {k: v for k, v in by.items() if len(set(v.values())) > 1}


def tag(f: Finding, claim: Claim) -> Finding:
    """``f`` marked as stating ``claim`` (a sentence that mentions the quantity in its own words)."""
    return f.model_copy(update={"claim": claim.key, "claim_value": claim.value})


# ---- eviction ------------------------------------------------------------------------------------------------
def eviction_by_cell(res: ExperimentResults) -> pd.DataFrame:
    """Per caching cell: prompt tokens, cached tokens, the tokens an unbounded cache would have served in that
    run (blocks cached earlier in it, from the tokens its server held), and ``evicted_tokens``: the part of
    those the server did not serve (`explain_experiment.cell_eviction`). A shortfall there is eviction: the
    prefix was cached and the pool dropped it; a recorded replay's substituted answers never count."""
    return cell_eviction(res)


def eviction_claim(res: ExperimentResults) -> Claim | None:
    """Whether the server's KV pool evicted cached prefixes, with the evidence (None: no caching cell with a
    trace to compare against)."""
    return _derived(res, ("claim", "eviction"), lambda: _eviction_claim(res))


def _eviction_claim(res: ExperimentResults) -> Claim | None:
    ev = eviction_by_cell(res)
    if not len(ev):
        return None
    total = float(ev["evicted_tokens"].sum())
    gauge = ""
    m = res.metrics
    if len(m) and "kv_cache_usage" in m and m["kv_cache_usage"].notna().any():
        gauge = (f" (the KV-usage gauge, peak {_pct(float(m['kv_cache_usage'].max()))}, counts the blocks of running "
                 "requests, not the cached blocks eviction takes, so it does not show this)")
    numbers: dict[str, float | None] = {"evicted_tokens": total, "cells": float(len(ev))}
    if total <= 0:
        return Claim("eviction", "none",
                     f"No eviction: in all {len(ev)} caching cell(s) the server served every prefix an infinite "
                     "cache would have, so the hit rates are those of a cache that never had to evict.", numbers)
    per = ev.groupby("workload", sort=False).agg(evicted=("evicted_tokens", "sum"), prompt=("prompt_tokens", "sum"),
                                                 cells=("cell", "nunique"),
                                                 evicting=("evicted_tokens", lambda s: int((s > 0).sum())))
    worst = ev.loc[ev["evicted_tokens"].idxmax()]
    parts = [f"{w} {int(r.evicted):,} tokens in {int(r.evicting)} of {int(r.cells)} cell(s)"
             for w, r in per[per["evicted"] > 0].sort_values("evicted", ascending=False).iterrows()]
    numbers |= {"worst_cell_hit_rate": float(worst["hit_rate"]),
                "worst_cell_infinite_hit_rate": float(worst["infinite_hit_rate"])}
    return Claim("eviction", "evicted",
                 f"The KV pool evicted cached prefixes: {int(total):,} prompt tokens that an infinite cache would "
                 f"have served were recomputed ({'; '.join(parts)}); worst {worst['cell']}: hit rate "
                 f"{_pct(worst['hit_rate'])} against {_pct(worst['infinite_hit_rate'])} with an infinite cache"
                 f"{gauge}.", numbers)


# ---- speculative payoff --------------------------------------------------------------------------------------
def _metric_words(metric: str) -> str:
    """A verdict metric as the claims say it: its registered display name (``TTFT p50``), else its name."""
    stat = compared_statistic(metric)
    return metric if stat is None else stat.display


def speculative_claims(res: ExperimentResults, ab: pd.DataFrame) -> list[Claim]:
    """One claim per speculative configuration, from the A/B verdicts (``ab``: `pages.ab_compare.ab_table`)."""
    c = _ok_cells(res)
    if not len(c) or "speculative" not in c or not len(ab):
        return []
    out = []
    for server in dict.fromkeys(map(str, c[c["speculative"] == True]["server"])):
        t = ab[ab["B"] == server]
        thr = t[t["metric"] == "output_tokens_per_s"]
        if not len(thr):
            continue
        base = str(thr["A"].iloc[0])
        counts = thr["verdict"].value_counts()
        better, worse, n = int(counts.get("better", 0)), int(counts.get("worse", 0)), len(thr)
        if better and worse:
            value = "mixed"
        elif worse or counts.get("equivalent", 0) == n:
            value = "does_not_pay"
        elif better * 2 > n:
            value = "pays"
        else:
            value = "inconclusive"
        word = {"pays": "pays off", "does_not_pay": "does not pay off", "mixed": "pays off in some comparisons "
                "and costs in others", "inconclusive": "has no decided payoff"}[value]
        words = verdict_words(counts)
        median = float(thr["relative"].median()) if thr["relative"].notna().any() else math.nan
        decided = thr[thr["verdict"].isin(["better", "worse"])]
        where = "; ".join(f"{r.verdict} on {r.workload} at {r.load} ({_signed_pct(r.relative)})"
                          for r in decided.itertuples())
        once = thr[(thr["runs_a"] <= 1) | (thr["runs_b"] <= 1)]
        once_words = (f"; {len(once)} of them ran once per side (no run-to-run noise measured, so their "
                      "verdicts stay inconclusive)" if len(once) else "")
        sentence = (f"{server} {word} against {base}: output throughput verdicts over {n} workload × load "
                    f"comparisons: {words} (median {_change_words(median)}{'; ' + where if where else ''})"
                    f"{once_words}.")
        worse_words = _what_gets_worse(res, t, server, base)
        sentence += (f" What gets worse: {worse_words}." if worse_words else " Nothing measured got worse.")
        statements = throughput_change_statement(server, base, thr, median)
        out.append(Claim(f"speculative:{server}", value, sentence,
                         {"better": float(better), "worse": float(worse), "comparisons": float(n),
                          "median_throughput_change": nan_to_none(median)}, worse_words, statements))
    return out


def speculative_recommendation(claim: Claim) -> Finding:
    """What to do about a speculative configuration, from its claim alone (so the index's recommendation and
    the page's finding cannot disagree): use it only where the throughput verdicts are decided."""
    server = claim.key.split(":", 1)[1]
    n = claim.numbers
    counts = f"{int(n['better'] or 0)} of {int(n['comparisons'] or 0)} throughput comparisons decided better"
    median = _change_words(n.get("median_throughput_change"))
    cost = f"; it costs {claim.worse}" if claim.worse else ""
    text = {"pays": f"Use {server}: output throughput {median} (median; {counts}, none worse){cost}.",
            "does_not_pay": f"Leave {server} off: its output throughput is not better ({counts}, median "
                            f"{median}){cost}.",
            "mixed": f"{server}: mixed — better in some comparisons and worse in others ({counts}, median "
                     f"{median}){cost}; decide per workload.",
            "inconclusive": f"{server}: inconclusive — output throughput {median} (median) but only {counts}; "
                            f"turn it on only if throughput-bound{cost}."}[claim.value]
    return Finding(question="recommendation", sentence=text, numbers=claim.numbers, notebook="speculative",
                   figure="acceptance_and_tpot", claim=claim.key, claim_value=claim.value,
                   statements=claim.statements)


def _what_gets_worse(res: ExperimentResults, t: pd.DataFrame, server: str, base: str) -> str:
    """Metrics with a *worse* verdict, then the like-for-like point estimates (same workload, load, repeat) of
    TTFT p50, ITL p99 and goodput where they moved the wrong way beyond 5 %."""
    parts = []
    for metric, g in t[t["verdict"] == "worse"].groupby("metric", sort=False):
        parts.append(f"{_metric_words(str(metric))} worse (decided) in {len(g)} comparison(s), "
                     f"e.g. {_signed_pct(g['relative'].iloc[0])} on {g['workload'].iloc[0]} at {g['load'].iloc[0]}")
    pairs = _paired_cells(res, server, base)
    if len(pairs):
        for col, label, higher_better in (("ttft_p50_s", "TTFT p50", False), ("itl_p99_s", "ITL p99", False)):
            if f"{col}_b" not in pairs:
                continue
            by = pairs.groupby("workload", sort=False).apply(
                lambda g, col=col: g[f"{col}_s"].median() / g[f"{col}_b"].median() - 1
                if g[f"{col}_b"].median() else math.nan, include_groups=False).dropna()
            bad = by[by > 0.05]
            if len(bad) and not any(p.startswith(label + " worse") for p in parts):
                parts.append(f"{label} " + ", ".join(f"{_change_words(v)} on {w}" for w, v in bad.items())
                             + " (point estimates)")
        if "goodput_fraction_b" in pairs:
            gs, gb = pairs["goodput_fraction_s"].mean(), pairs["goodput_fraction_b"].mean()
            if pd.notna(gs) and pd.notna(gb) and gs < gb - 0.01:
                parts.append(f"goodput {_pct(gs)} against {_pct(gb)} (point estimates, same cells)")
    parts += _capacity_losses(res, server, base)
    return "; ".join(parts)


def _paired_cells(res: ExperimentResults, server: str, base: str) -> pd.DataFrame:
    """The speculative server's cells joined to its baseline's on workload, load and repeat (like for like)."""
    c = _ok_cells(res)
    cols = [k for k in ("ttft_p50_s", "itl_p99_s", "goodput_fraction") if k in c]
    keys = ["workload", "load", "repeat"]
    s = c[c["server"] == server][keys + cols]
    b = c[c["server"] == base][keys + cols]
    return s.merge(b, on=keys, suffixes=("_s", "_b"))


# ---- capacity ------------------------------------------------------------------------------------------------
def capacity_claims(res: ExperimentResults) -> list[Claim]:
    """One claim per sweep (configuration × workload), from experiment.json's recorded answers."""
    return _derived(res, ("claim", "capacity"), lambda: [_capacity_claim(e) for e in
                                                         (getattr(res.experiment, "capacity", None) or [])])


def _level(load: float) -> str:
    return f"c{load:g}"


def recorded_point(p) -> LoadPoint:
    """A recorded sweep level (an experiment.json ``SweepPoint``) as the capacity rule reads it."""
    return LoadPoint(p.load, p.ttft_p90_s, p.preemptions, p.mean_sessions_in_flight, p.cell, p.ttft_p90_interval_s)


def sweep_capacity(e) -> Capacity:
    """A sweep's answer (an experiment.json ``capacity`` entry) re-read from its recorded levels by the rule of
    :func:`~kvscope.harness.analysis.capacity.capacity_from_points`, against the SLO the sweep resolved: the
    report states what the points support, whatever rule wrote the file (an under-driven level counted toward
    the recorded capacity of files written before it stopped counting)."""
    points = [recorded_point(p) for p in e.points]
    words = {"slo_ttft_p90": e.slo_ttft_p90, "slo_unloaded_ttft_p90_ms": e.slo_unloaded_ttft_p90_ms,
             "slo_unloaded_source": e.slo_unloaded_source}
    if e.slo_ttft_p90_ms is None:
        return Capacity(e.server, e.workload, e.kind, None, None, None, None,
                        [p.load for p in points if under_driven(p, e.kind)], points, **words)
    cap = capacity_from_points(e.server, e.workload, e.kind, points, e.slo_ttft_p90_ms)
    return replace(cap, **words)


def _capacity_claim(e) -> Claim:
    slo = e.slo_ttft_p90_ms
    cap = sweep_capacity(e)
    points = sorted(cap.points, key=lambda p: p.load)

    def level_words(p: LoadPoint) -> str:
        if p.ttft_p90_s is None:
            return f"{_level(p.load)} (no answer)"
        short = (f", {p.mean_sessions_in_flight:.1f} sessions in flight: under-driven" if under_driven(p, e.kind)
                 else "")
        return f"{_level(p.load)} (TTFT p90 {p.ttft_p90_s * 1e3:.0f} ms{', preempted' if p.preemptions else ''}{short})"

    measured = ", ".join(level_words(p) for p in points)
    pred = e.predicted
    knee = cliff = predicted_capacity = None
    pred_words = ""
    if pred is not None and pred.levels:
        meets = {lv.load: point_meets_slo(predicted_point(lv.load, lv.ttft_p90_s, lv.preemptions if
                                                          lv.preemptions_p50 is None else lv.preemptions_p50), slo)
                 for lv in sorted(pred.levels, key=lambda lv: lv.load)}
        fails = [load for load, ok in meets.items() if not ok]
        knee = fails[0] if fails else None
        cliff = pred.cliff
        # the live rule on the recorded levels, against the SLO this sentence states
        predicted_capacity = max((load for load, ok in meets.items() if ok), default=None)
        held = "no level within the SLO" if predicted_capacity is None else f"a capacity of {_level(predicted_capacity)}"
        pred_words = (f"; the scheduler model predicts {held}"
                      + (f", the first failing level at {_level(knee)}" if knee is not None else
                         ", no failing level within its range")
                      + (f" and a KV eviction cliff at {_level(cliff)}" if cliff is not None else
                         " and no eviction cliff within its range"))
    elif pred is not None and pred.skipped:
        pred_words = f"; no prediction ({pred.skipped})"
    slo_text = _slo_text(e)
    numbers = {"capacity_load": cap.capacity, "slo_ttft_ms": slo, "levels_measured": float(len(points)),
               "under_driven_levels": float(len(cap.under_driven)),
               "predicted_capacity": predicted_capacity, "predicted_first_failure": knee,
               "predicted_cliff": cliff}
    if cap.capacity is None:
        only = "only " if len(points) == 1 else ""
        stop = (" (the sweep stops at the first failing level)" if len(points) == 1 else "")
        skipped = "".join(f"; {cap._under_driven_words(p)}" for p in cap._under_driven_passes())
        sentence = (f"{e.server} meets {slo_text} at none of the measured{' driven' if skipped else ''} loads on "
                    f"{e.workload}: {only}{measured} {'was' if len(points) == 1 else 'were'} measured{stop}"
                    f"{skipped}{pred_words}.")
        return Claim(f"capacity:{e.server}:{e.workload}", "none_measured", sentence, numbers,
                     statements=_level_statements(e, points, None))
    held = f"{cap.capacity:g}"
    sentence = f"{cap.sentence()}; measured: {measured}{pred_words}."
    return Claim(f"capacity:{e.server}:{e.workload}", f"holds_{held}", sentence, numbers,
                 statements=_level_statements(e, points, cap.capacity))


def _level_statements(e, points: list[LoadPoint], capacity: float | None) -> list[Statement]:
    """What the claims audit recomputes from a sweep's cells: every measured level's TTFT p90 and, at the
    capacity level, the mean sessions in flight (the driven rule's figure)."""
    out = []
    for p in points:
        label = re.search(r"__(sweep-[^_]+)__r\d+$", str(p.cell or ""))
        if p.ttft_p90_s is None or label is None:
            continue
        sel = Selection(servers=(e.server,), workloads=(e.workload,), loads=(label.group(1),), repeats=1)
        out.append(Statement(metric="ttft_p90_s", value=p.ttft_p90_s, selection=sel))
        if p.load == capacity and p.mean_sessions_in_flight is not None:
            out.append(Statement(metric="sessions_in_flight", value=p.mean_sessions_in_flight, selection=sel))
    return out


def _capacity_losses(res: ExperimentResults, server: str, base: str) -> list[str]:
    """Where ``server``'s sweep holds fewer sessions than ``base``'s on the same workload: both capacities and,
    at the level where ``server`` first fails, what failed and both TTFT p90s (one run per level)."""
    entries = {(e.server, e.workload): e for e in (getattr(res.experiment, "capacity", None) or [])}
    out = []
    for (srv, workload), e in entries.items():
        if srv != server or (base, workload) not in entries:
            continue
        mine, theirs = sweep_capacity(e), sweep_capacity(entries[(base, workload)])
        if mine.capacity is None or theirs.capacity is None or mine.capacity >= theirs.capacity:
            continue
        text = (f"capacity on {workload} {theirs.capacity:g} → {mine.capacity:g} concurrent sessions "
                f"({base} → {server})")
        edge = min((p for p in mine.points if p.load > mine.capacity and not point_meets_slo(p, mine.slo_ttft_p90_ms)),
                   key=lambda p: p.load, default=None)
        other = next((p for p in theirs.points if edge is not None and p.load == edge.load), None)
        if edge is not None:
            why = "preempts" if edge.preemptions else "breaks the SLO"
            text += f"; at {_level(edge.load)} it {why}"
            if other is not None and edge.ttft_p90_s is not None and other.ttft_p90_s:
                text += (f", TTFT p90 {other.ttft_p90_s * 1e3:.0f} → {edge.ttft_p90_s * 1e3:.0f} ms "
                         f"({_signed_pct(edge.ttft_p90_s / other.ttft_p90_s - 1)})")
        out.append(text + " (one run per level)")
    return out


def _slo_text(e) -> str:
    if e.slo_ttft_p90 is None:
        return f"TTFT p90 ≤ {e.slo_ttft_p90_ms:g} ms" if e.slo_ttft_p90_ms is not None else "no TTFT SLO"
    factor = e.slo_ttft_p90.removesuffix("_unloaded")
    if e.slo_ttft_p90_ms is None:
        return f"TTFT p90 ≤ {factor} unloaded (not resolved: no level answered)"
    return (f"TTFT p90 ≤ {factor} unloaded ({e.slo_unloaded_ttft_p90_ms:.0f} ms, {e.slo_unloaded_source}) "
            f"= {e.slo_ttft_p90_ms:.0f} ms")
