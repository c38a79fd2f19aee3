"""The ab_compare page (notebooks/ab_compare.ipynb): the A/B verdict table and its pivot."""

from __future__ import annotations

import pandas as pd
from kvscope.harness.analysis.ab import compare
from kvscope.harness.analysis.common import RESAMPLES, _ok_cells, _runs, _signed_pct
from kvscope.harness.analysis.registry import PageContext, page_findings_of
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults

#: Metrics the pivoted verdict table shows (the full table goes to CSV).
PIVOT_METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "e2e_p50_s", "output_tokens_per_s", "hit_rate")


def ab_table(res: ExperimentResults, resamples: int = RESAMPLES) -> pd.DataFrame:
    """The verdict table for the first configuration against every other, per workload and load (all repeats)."""
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
    return out


def verdict_pivot(table: pd.DataFrame) -> pd.DataFrame:
    """Configuration pairs (at a workload and load) x metrics, each cell a verdict word."""
    if not len(table):
        return pd.DataFrame()
    t = table[table["metric"].isin(PIVOT_METRICS)].assign(
        pair=lambda d: d["A"] + " → " + d["B"] + " · " + d["workload"] + " · " + d["load"])
    return t.pivot_table(index="pair", columns="metric", values="verdict", aggfunc="first", sort=False) \
        .reindex(columns=[m for m in PIVOT_METRICS if m in set(t["metric"])])


def ab_findings(table: pd.DataFrame) -> list[Finding]:
    """Per configuration pair: how many workload x load comparisons each headline metric was better / worse in."""
    if not len(table):
        return []
    out = []
    for (a, b), g in table.groupby(["A", "B"], sort=False):
        parts = []
        for metric in ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_s", "hit_rate"):
            m = g[g["metric"] == metric]
            if not len(m):
                continue
            counts = m["verdict"].value_counts()
            words = ", ".join(f"{v} {counts[v]}" for v in ("better", "worse", "equivalent", "inconclusive",
                                                           "by_construction") if counts.get(v))
            rel = m["relative"].median()
            parts.append(f"{metric} {_signed_pct(rel)} median ({words})")
        n = g.groupby(["workload", "load"]).ngroups
        out.append(Finding(question="ab", notebook="ab_compare", figure="forest_relative_changes",
                           sentence=f"{b} against {a} over {n} workload × load comparisons: " + "; ".join(parts) + ".",
                           numbers={"comparisons": float(n)}))
    return out


def page_ab_table(ctx: PageContext) -> pd.DataFrame:
    """The A/B table the page already computed, else computed once for its findings."""
    if ctx.ab is None:
        ctx.ab = ab_table(ctx.res, ctx.resamples)
    return ctx.ab


@page_findings_of("ab_compare", "ab")
def _ab_page(ctx: PageContext) -> list[Finding]:
    return ab_findings(page_ab_table(ctx))
