"""The ab_compare page (notebooks/ab_compare.ipynb): the A/B verdict table and its pivot, the repeats behind each
verdict (an outlier repeat flags the verdicts resting on it) and the forest plot's rows.

Why a verdict carries a data-quality flag rather than being dropped: the bootstrap resamples repeats, so one repeat
far from the others (a run during which the host was busy) widens the interval but can still tip a verdict; the
reader needs to see both the verdict and that it rests on a repeat the others disagree with."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from kvscope.harness.analysis.ab import (
    OUTLIER_MADS,
    OUTLIER_RELATIVE,
    compare,
    outlier_repeats,
    run_statistics,
)
from kvscope.harness.analysis.common import (
    RESAMPLES,
    _change_words,
    _derived,
    _ok_cells,
    _runs,
    throughput_change_statement,
    verdict_words,
)
from kvscope.harness.analysis.registry import PageContext, caveat, report_page
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.results.findings_file import Finding, VerdictCell
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.summary import Use, compared_statistic, compared_statistics


def _names(use: Use) -> tuple[str, ...]:
    return tuple(s.name for s in compared_statistics(use))


def pivot_metrics() -> tuple[str, ...]:
    """Metrics the pivoted verdict table shows (the full table goes to CSV): those marked `Use.PIVOT`."""
    return _names(Use.PIVOT)


def spread_metrics() -> tuple[str, ...]:
    """Metrics the repeat-spread panel shows (every verdict metric is flagged, these are plotted)."""
    return _names(Use.SPREAD)


def forest_metrics() -> tuple[str, ...]:
    """Metrics of the forest plot."""
    return _names(Use.FOREST)

#: The verdict table's columns as the page shows them, to fit its width; `verdicts.csv` beside the figures keeps
#: every column (the margin, raw p-value, runs per side and pairing as well).
VERDICT_COLUMNS = ["A", "B", "workload", "load", "metric", "a", "b", "diff", "ci_low", "ci_high", "relative",
                   "p_adjusted", "verdict", "data_quality"]

SPREAD_COLUMNS = ["server", "workload", "load", "repeat", "cell", "metric", "value", "median", "relative_to_median",
                  "outlier"]


def repeat_spread(res: ExperimentResults) -> pd.DataFrame:
    """Per configuration × workload × load with two or more repeats, and per verdict metric: each repeat's
    own value (what the verdict engine computes from that run alone), the median of the repeats, the repeat's deviation from it, and whether it is an
    outlier (`ab.outlier_repeats`: beyond 3 scaled MADs and 25 % of the median, with 3+ repeats)."""
    return _derived(res, ("repeat_spread",), lambda: _repeat_spread(res))


def _repeat_spread(res: ExperimentResults) -> pd.DataFrame:
    c = _ok_cells(res)
    frames = []
    for (server, wl, load), g in c.groupby(["server", "workload", "load"], sort=False):
        runs = _runs(res, str(server), str(wl), str(load))
        if len(runs) < 2:  # one run has no spread to show
            continue
        stats = run_statistics(runs)
        repeat_of = dict(zip(g["cell"].astype(str), g["repeat"]))
        for metric, m in stats.groupby("metric", sort=False):
            values = m["value"].to_numpy(float)
            finite = values[np.isfinite(values)]
            med = float(np.median(finite)) if len(finite) else math.nan
            frames.append(pd.DataFrame({
                "server": server, "workload": wl, "load": str(load), "repeat": m["run"].map(repeat_of).to_numpy(),
                "cell": m["run"].to_numpy(), "metric": metric, "value": values, "median": med,
                "relative_to_median": (values - med) / med if med else math.nan,
                "outlier": outlier_repeats(values)}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=SPREAD_COLUMNS)


def _flag_words(flagged: pd.DataFrame, side: str) -> list[str]:
    return [f"{side} r{int(r.repeat) if pd.notna(r.repeat) else r.cell} "
            f"{r.relative_to_median * 100:+.0f} % vs median" for r in flagged.itertuples()]


def data_quality_flags(table: pd.DataFrame, spread: pd.DataFrame) -> pd.Series:
    """Per verdict row: which outlier repeats of side A or B it rests on ("" where none)."""
    if not len(table):
        return pd.Series(dtype=str)
    bad = spread[spread["outlier"].astype(bool)] if len(spread) else spread
    if not len(bad):
        return pd.Series("", index=table.index)
    keyed = {k: g for k, g in bad.groupby(["server", "workload", "load", "metric"], sort=False)}
    empty = bad.iloc[:0]
    words = []
    for r in table.itertuples():
        wl, load = str(r.workload), str(r.load)
        parts = _flag_words(keyed.get((r.A, wl, load, r.metric), empty), "A") + \
            _flag_words(keyed.get((r.B, wl, load, r.metric), empty), "B")
        words.append("outlier repeat: " + "; ".join(parts) if parts else "")
    return pd.Series(words, index=table.index)


def ab_table(res: ExperimentResults, resamples: int = RESAMPLES) -> pd.DataFrame:
    """The verdict table for the first configuration against every other, per workload and load (all repeats),
    each row with its ``data_quality`` flag (:func:`data_quality_flags`)."""
    c = _ok_cells(res)
    servers = list(dict.fromkeys(map(str, c["server"]))) if len(c) else []
    frames = []
    for other in servers[1:]:
        for (wl, load), _ in c.groupby(["workload", "load"], sort=False):
            ra, rb = _runs(res, servers[0], wl, str(load)), _runs(res, other, wl, str(load))
            if not ra or not rb:
                continue
            t = compare(ra, rb, resamples=resamples)
            frames.append(t.assign(A=servers[0], B=other, workload=wl, load=str(load)))
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True)
    # A relative change of a latency whose A value is under 1 ms (a burst delivery's TPOT) says nothing.
    tiny = out["metric"].str.endswith("_s") & (out["a"].abs() < 1e-3)
    out["relative"] = (out["diff"] / out["a"].where(out["a"] != 0)).where(~tiny)
    out["data_quality"] = data_quality_flags(out, repeat_spread(res))
    return out


def verdict_pivot(table: pd.DataFrame) -> pd.DataFrame:
    """Configuration pairs (at a workload and load) x metrics, each cell a verdict word."""
    if not len(table):
        return pd.DataFrame()
    pivot = pivot_metrics()
    t = table[table["metric"].isin(pivot)].assign(
        pair=lambda d: d["A"] + " → " + d["B"] + " · " + d["workload"] + " · " + d["load"])
    if "data_quality" in t:  # a verdict resting on an outlier repeat shows it where it is read
        t = t.assign(verdict=t["verdict"].where(t["data_quality"].fillna("") == "", t["verdict"] + " ⚑"))
    return t.pivot_table(index="pair", columns="metric", values="verdict", aggfunc="first", sort=False) \
        .reindex(columns=[m for m in pivot if m in set(t["metric"])])


#: The widest relative change the forest plot's axis shows (a larger one is drawn to the edge with its value
#: written there, so one +600 % row does not squash every other row to a dot).
FOREST_MAX_PCT = 100.0


def forest_rows(table: pd.DataFrame, max_pct: float = FOREST_MAX_PCT) -> tuple[pd.DataFrame, float]:
    """The forest plot's rows — (B − A) / A and its interval in %, clipped to the axis — and the axis half-width:
    the largest |point estimate| or interval end with 15 % room, at least 10 %, at most ``max_pct``. Rows with
    ``clipped_low`` / ``clipped_high`` run past the axis; their true ends are ``lo_pct`` / ``hi_pct``. What the
    plot draws is ``plot_pct`` (the estimate clipped to the axis) with ``err_low_pct`` / ``err_high_pct``, never
    negative: a bootstrap interval need not contain the point estimate (few repeats, a skewed statistic), and the
    bar then starts at the point."""
    if not len(table):
        return pd.DataFrame(), 10.0
    v = table[table["metric"].isin(forest_metrics()) & (table["a"].abs() > 1e-3)].copy()
    if not len(v):
        return v, 10.0
    v["label"] = v["A"] + " → " + v["B"] + " · " + v["workload"].astype(str) + " · " + v["load"].astype(str) \
        + ": " + v["metric"]
    v["rel_pct"] = v["diff"] / v["a"] * 100
    v["lo_pct"], v["hi_pct"] = v["ci_low"] / v["a"] * 100, v["ci_high"] / v["a"] * 100
    ends = pd.concat([v["rel_pct"], v["lo_pct"], v["hi_pct"]]).abs()
    limit = float(min(max(10.0, 1.15 * ends.max()), max_pct))
    v["clipped_low"], v["clipped_high"] = v["lo_pct"] < -limit, v["hi_pct"] > limit
    v["plot_pct"] = v["rel_pct"].clip(-limit, limit)
    v["err_low_pct"] = (v["plot_pct"] - v["lo_pct"].clip(-limit, limit)).clip(lower=0).fillna(0)
    v["err_high_pct"] = (v["hi_pct"].clip(-limit, limit) - v["plot_pct"]).clip(lower=0).fillna(0)
    v["flagged"] = v["data_quality"].fillna("") != "" if "data_quality" in v else False
    return v.reset_index(drop=True), limit


def ab_findings(table: pd.DataFrame) -> list[Finding]:
    """Per configuration pair: how many workload x load comparisons each headline metric was better / worse in."""
    if not len(table):
        return []
    # the run-level figure (output throughput) leads the sentence, then the table's order
    headline = [s.name for s in sorted(compared_statistics(Use.HEADLINE), key=lambda s: s.kind != "per_run")]
    out = []
    for (a, b), g in table.groupby(["A", "B"], sort=False):
        parts = []
        statements = []
        for metric in headline:
            m = g[g["metric"] == metric]
            if not len(m):
                continue
            counts = m["verdict"].value_counts()
            rel = m["relative"].median()
            if metric == "output_tokens_per_s":  # recomputable from summary.json
                statements += throughput_change_statement(b, a, m, rel)
            stat = compared_statistic(metric)
            # words, not keys or bare signs: "output throughput 5 % higher (median; verdicts: 1 better, …)"
            parts.append(f"{metric if stat is None else stat.display} {_change_words(rel)} (median; "
                         f"{verdict_words(counts)})")
        n = g.groupby(["workload", "load"]).ngroups
        out.append(Finding(question="ab", notebook="ab_compare", figure="forest_relative_changes", statements=statements,
                           sentence=f"{b} against {a} over {n} workload × load comparisons: " + "; ".join(parts) + ".",
                           numbers={"comparisons": float(n)}))
    return out


def page_ab_table(ctx: PageContext) -> pd.DataFrame:
    """The A/B table the page already computed (``ab=``), else computed once for its findings."""
    return ctx.get("ab", lambda: ab_table(ctx.res, ctx.resamples))


@caveat("outlier_repeats", "ab_compare")
def _caveat_outlier_repeats(res: ExperimentResults):
    """Repeats far from the other repeats of their cell: the verdicts resting on them carry a data-quality flag."""
    spread = repeat_spread(res) if len(_ok_cells(res)) else pd.DataFrame(columns=SPREAD_COLUMNS)
    bad = spread[spread["outlier"].astype(bool)] if len(spread) else spread
    if not len(bad):
        return None
    worst = bad.iloc[bad["relative_to_median"].abs().argmax()]
    unit, scale = ("ms", 1000.0) if str(worst["metric"]).endswith("_s") else ("", 1.0)
    example = (f"{worst['server']} · {worst['workload']} · {worst['load']} repeat {worst['repeat']}: "
               f"{worst['metric']} {worst['value'] * scale:,.1f}{' ' + unit if unit else ''} against a median of "
               f"{worst['median'] * scale:,.1f}{' ' + unit if unit else ''} over its repeats")
    cells = bad.groupby(["server", "workload", "load", "repeat"]).ngroups
    return ((f"{len(bad)} value(s) in {cells} repeat(s) lie far from the other repeats of their cell (beyond "
             f"{OUTLIER_MADS:g} scaled MADs and {OUTLIER_RELATIVE * 100:.0f} % of the median), e.g. {example}. "
             "A repeat that far off usually means the host was busy during that run, not that the configuration "
             "changed: the verdicts resting on it are flagged (⚑, the data_quality column) and are host noise until "
             "a rerun confirms them."),
            {"outlier_values": float(len(bad)), "outlier_repeats": float(cells)})


def _verdicts_in_findings_file(ctx: PageContext, figures_dir: Path) -> dict[str, Any]:
    """The full verdict table as CSV beside the figures, and its pivot metrics' verdicts in `findings.json` (the
    index's verdict table)."""
    ab = ctx.computed.get("ab")
    if ab is None or not len(ab):
        return {}
    ab.to_csv(figures_dir / "verdicts.csv", index=False)
    t = ab[ab["metric"].isin(pivot_metrics())]
    verdicts = [VerdictCell(pair=f"{r.A} → {r.B} · {r.workload} · {r.load}", metric=r.metric,
                            verdict=str(r.verdict), relative=nan_to_none(r.relative, float),
                            data_quality=str(getattr(r, "data_quality", "") or "") or None)
                for r in t.itertuples()]
    return {"verdicts": verdicts, "verdicts_csv": "figures/ab_compare/verdicts.csv"}


@report_page("ab_compare", "A/B comparison on identical traffic", order=80, questions=("ab",),
             figures=("forest_relative_changes", "repeat_spread", "paired_differences"),
             key_figures=("forest_relative_changes",),
             parameters=("run_a", "run_b", "label_a", "label_b", "resamples"), relative_cost=5.0,
             findings_extras=_verdicts_in_findings_file)
def _ab_page(ctx: PageContext) -> list[Finding]:
    return ab_findings(page_ab_table(ctx))
