"""What the experiment found, in sentences with numbers: the executive summary, each page's findings, caveats.

Why this structure. A report that only shows tables leaves the reader to find the answer; here every question
the quickstart asks (what each history habit costs, how much load each configuration holds under the SLO,
whether speculative decoding pays, what the A/B verdicts say) is answered by one function that returns
:class:`Finding` s: a sentence, the numbers in it, an interval where one exists, and the page and figure that
hold the evidence. Numbers come from the same tables the pages show (`tables`) and from the verdict engine
(`ab.compare`), never recomputed differently here. Caveats are findings too (`question="caveat"`), generated
from the data, so a caveat that does not apply is not printed.

Each finding belongs to exactly one page (`PAGE_QUESTIONS`); the executive summary is the union of the
headline questions. A notebook calls :func:`write_page_findings`, which shows its findings and writes them to
`findings.json` beside its figures; `index.html` reads those files (the report layer does not import this one).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from kvscope.harness.analysis import tables as T
from kvscope.harness.analysis.ab import Run, compare
from kvscope.harness.analysis.capacity import LoadPoint, point_meets_slo
from kvscope.harness.analysis.explain_experiment import WorkloadExplanation, explain_findings, explain_workloads
from kvscope.harness.results.findings_file import (
    FINDINGS_NAME,
    Finding,
    FindingsFile,
    VerdictCell,
    write_findings_file,
)
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import CLIENT_STALL_S

__all__ = [
    "PAGE_QUESTIONS",
    "Finding",
    "ab_table",
    "capacity_findings",
    "caveats",
    "executive_summary",
    "findings_markdown",
    "habit_findings",
    "page_findings",
    "server_palette",
    "speculative_findings",
    "verdict_pivot",
    "write_page_findings",
]

#: The questions whose answers open index.html, and the page each finding lives on.
HEADLINE_QUESTIONS = ("habit", "capacity", "speculative", "ab")
PAGE_OF_CAVEAT = {"block_size": "hit_rates", "min_cacheable": "cost", "eviction": "concurrency",
                  "tiny_model": "speculative", "burst": "latency", "sessions_below_concurrency": "concurrency",
                  "client_stalls": "latency", "cache_not_reset": "hit_rates"}
#: Cells whose replay client was held up for more than this share of their run get a caveat.
CLIENT_STALL_SHARE = 0.01
PAGE_QUESTIONS = {"hit_rates": ("habit", "hit_rate"), "concurrency": ("capacity",), "latency": ("latency",),
                  "cost": ("cost",), "speculative": ("speculative",), "ab_compare": ("ab",),
                  "explain": ("habit", "cache_break")}
#: Metrics the pivoted verdict table shows (the full table goes to CSV).
PIVOT_METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "e2e_p50_s", "output_tokens_per_s", "hit_rate")
GPU_BLOCK_SIZE = 16
RESAMPLES = 1000
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


# ---- small helpers -----------------------------------------------------------------------------------------
def _pct(x: float | None, digits: int = 0) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * 100:.{digits}f} %"


def _ms(x_s: float | None) -> str:
    return "–" if x_s is None or not math.isfinite(x_s) else f"{x_s * 1000:.0f}"


def _signed_pct(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * 100:+.0f} %"


def server_palette(res: ExperimentResults) -> dict[str, str]:
    """One colour per server configuration, the same on every page (keyed by name, in the spec's order)."""
    servers = list(dict.fromkeys(map(str, res.cells["server"]))) if "server" in res.cells else []
    return {s: _PALETTE[i % len(_PALETTE)] for i, s in enumerate(servers)}


def _ok_cells(res: ExperimentResults) -> pd.DataFrame:
    c = res.cells
    return c[c["status"] == "ok"] if "status" in c else c


def _caching_server(res: ExperimentResults) -> str | None:
    """The configuration habits are measured on: prefix caching on, no speculative decoding."""
    c = _ok_cells(res)
    for _, row in c.iterrows():
        if row.get("prefix_caching") is True and not row.get("speculative"):
            return str(row["server"])
    return None


def _load_order(res: ExperimentResults) -> list[str]:
    c = _ok_cells(res)
    if not len(c):
        return []
    value = c["load"].astype(str).str.extract(r"(\d+\.?\d*)")[0].astype(float)
    return list(dict.fromkeys(c.assign(_v=value).sort_values("_v")["load"].astype(str)))


def _runs(res: ExperimentResults, server: str, workload: str, load: str) -> list[Run]:
    """The repeats of one (server, workload, load) as verdict-engine runs."""
    c = _ok_cells(res)
    sel = c[(c["server"] == server) & (c["workload"] == workload) & (c["load"].astype(str) == load)]
    runs = []
    for _, row in sel.sort_values("repeat").iterrows():
        rec = res.requests[res.requests["cell"] == row["cell"]] if len(res.requests) else res.requests
        manifest = res.cell_dirs.get(row["cell"], Path("/nonexistent")) / "manifest.json"
        sha = None
        if manifest.exists():
            from kvscope.harness.results.loaders import load_run_manifest
            sha = load_run_manifest(manifest).trace.sha256
        tps = row.get("output_tok_per_s")
        runs.append(Run(str(row["cell"]), rec, None if tps is None or pd.isna(tps) else float(tps),
                        row.get("prefix_caching"), sha))
    return runs


def _metric_row(table: pd.DataFrame, metric: str) -> dict[str, Any] | None:
    if not len(table):
        return None
    rows = table[table["metric"] == metric]
    return None if not len(rows) else rows.iloc[0].to_dict()


# ---- habits ------------------------------------------------------------------------------------------------
def habit_pairs(res: ExperimentResults) -> list[tuple[str, str]]:
    """(reference, habit) workloads: a workload named `<reference>-<suffix>` is a habit added to `<reference>`."""
    workloads = sorted(set(map(str, _ok_cells(res)["workload"])))
    pairs = []
    for w in workloads:
        refs = [r for r in workloads if r != w and w.startswith(r + "-")]
        if refs:
            pairs.append((max(refs, key=len), w))
    return pairs


def _trace_meta(res: ExperimentResults, workload: str) -> dict[str, Any]:
    import json

    tdir = res.trace_dir(workload)
    if tdir is None or not (tdir / "trace.json").exists():
        return {}
    return json.loads((tdir / "trace.json").read_text())


def _policies(meta: dict[str, Any]) -> list[dict[str, Any]]:
    return list(((meta.get("spec") or {}).get("sessions") or {}).get("policies") or [])


def describe_habit(res: ExperimentResults, reference: str, habit: str) -> str:
    """What the habit adds to the reference's history, in words (from the traces' specs)."""
    ref_meta, meta = _trace_meta(res, reference), _trace_meta(res, habit)
    scale = float(meta.get("scale") or 1.0)
    ref_kinds = {(p.get("kind"), str(sorted(p.items()))) for p in _policies(ref_meta)}
    added = [p for p in _policies(meta) if (p.get("kind"), str(sorted(p.items()))) not in ref_kinds]
    words = []
    for p in added:
        if p.get("kind") == "volatile_prefix":
            words.append(f"a timestamp at token {max(round(p.get('position', 0) * scale), 0)}")
        elif p.get("kind") == "compaction":
            words.append(f"compaction at {int(p.get('threshold_tokens', 0) * scale):,} tokens")
        else:
            words.append(str(p.get("kind", "a policy")).replace("_", " "))
    return " and ".join(words) or f"the {habit.removeprefix(reference + '-')} habit"


def _cost_change(res: ExperimentResults, workload: str, preset: str) -> float | None:
    pc = T.provider_costs(res, [preset], workloads=[workload])
    if not len(pc):
        return None
    row = pc.iloc[0]
    return float(row["cost_usd"] / row["no_cache_usd"] - 1) if row["no_cache_usd"] else None


def _cost_preset(res: ExperimentResults) -> str | None:
    """The spec's first preset with a cache-write premium (where a habit can make caching dearer), else its first."""
    from kvscope.harness.pricing.provider_cache import load_preset

    names = list(res.spec.cost.pricing) if res.spec is not None else []
    for n in names:
        if load_preset(n).pricing.cache_write_multiplier > 1:
            return n
    return names[0] if names else None


def habit_findings(res: ExperimentResults, resamples: int = RESAMPLES) -> list[Finding]:
    """Per habit: hit rate, TTFT p50 (with the verdict engine's interval) and provider cost against its reference."""
    server = _caching_server(res)
    loads = _load_order(res)
    if server is None or not loads:
        return []
    hits = T.hit_by_workload(res)
    hits = hits[hits["server"] == server].set_index("workload")
    preset = _cost_preset(res)
    out = []
    for reference, habit in habit_pairs(res):
        if reference not in hits.index or habit not in hits.index:
            continue
        # the lowest load at which both workloads ran on this server (a sweep's levels may hold only one of them)
        load = next((lv for lv in loads if _runs(res, server, reference, lv) and _runs(res, server, habit, lv)),
                    loads[0])
        ra, rb = _runs(res, server, reference, load), _runs(res, server, habit, load)
        table = compare(ra, rb, resamples=resamples) if ra and rb else pd.DataFrame()
        ttft = _metric_row(table, "ttft_p50_s") or {}
        hit_a, hit_b = float(hits.loc[reference, "measured"]), float(hits.loc[habit, "measured"])
        cost_a = _cost_change(res, reference, preset) if preset else None
        cost_b = _cost_change(res, habit, preset) if preset else None
        out.append(_habit_sentence(describe_habit(res, reference, habit), reference, habit, server, load,
                                   hit_a, hit_b, ttft, preset, cost_a, cost_b))
    return out


def _habit_sentence(what: str, reference: str, habit: str, server: str, load: str, hit_a: float, hit_b: float,
                    ttft: dict[str, Any], preset: str | None, cost_a: float | None, cost_b: float | None) -> Finding:
    a, b = ttft.get("a"), ttft.get("b")
    lo, hi = ttft.get("ci_low"), ttft.get("ci_high")
    verdict = ttft.get("verdict")
    costs_nothing = abs(hit_b - hit_a) < 0.01 and verdict in (None, "equivalent", "inconclusive") and \
        (cost_a is None or cost_b is None or abs(cost_b - cost_a) < 0.01)
    cost_words = ""
    if preset and cost_b is not None:
        cost_words = (f", and makes {preset} caching {abs(cost_b) * 100:.0f} % "
                      f"{'dearer' if cost_b > 0 else 'cheaper'} than no caching"
                      f" ({reference}: {abs(cost_a or 0) * 100:.0f} % {'dearer' if (cost_a or 0) > 0 else 'cheaper'})")
    interval = f" (B − A {(b - a) * 1000:+.0f} ms, 95 % CI {lo * 1000:+.0f} to {hi * 1000:+.0f} ms; {verdict})" \
        if None not in (a, b, lo, hi) else ""
    if costs_nothing:
        sentence = (f"{what[0].upper() + what[1:]} ({habit} vs {reference}, on {server}) costs nothing measurable: "
                    f"hit rate {_pct(hit_a)} vs {_pct(hit_b)}, TTFT p50 {_ms(a)} vs {_ms(b)} ms{interval}.")
    else:
        sentence = (f"{what[0].upper() + what[1:]} ({habit} vs {reference}, on {server} at {load}) takes the hit "
                    f"rate from {_pct(hit_a)} to {_pct(hit_b)} and TTFT p50 from {_ms(a)} to {_ms(b)} ms"
                    f"{interval}{cost_words}.")
    return Finding(question="habit", sentence=sentence, notebook="hit_rates", figure="hit_rate_by_workload",
                   numbers={"hit_rate_reference": hit_a, "hit_rate_habit": hit_b, "ttft_p50_reference_s": a,
                            "ttft_p50_habit_s": b, "cost_change_reference": cost_a, "cost_change_habit": cost_b},
                   interval=(lo, hi) if None not in (lo, hi) else None, interval_of="ttft_p50_s difference (s)")


# ---- capacity ----------------------------------------------------------------------------------------------
def capacity_by_level(res: ExperimentResults) -> pd.DataFrame:
    """Per server and load level: TTFT p90 over all its requests, preemptions, and whether the level meets the
    SLO by the sweeps' rule (:func:`~kvscope.harness.analysis.capacity.point_meets_slo`: TTFT p90 within the
    SLO and no preemption)."""
    ok = res.ok_requests()
    slo_ms = res.spec.slo.ttft_ms if res.spec is not None else None
    if not len(ok):
        return pd.DataFrame()
    curve = T.load_curve(res)
    rows = []
    for (server, load), g in ok.groupby(["server", "load"], sort=False):
        c = curve[(curve["server"] == server) & (curve["load"] == load)] if len(curve) else curve
        p90 = float(np.percentile(g["ttft_s"].astype(float), 90))
        preemptions = float(c["preemptions"].fillna(0).sum()) if len(c) and "preemptions" in c else 0.0
        point = LoadPoint(load=float(c["load_value"].iloc[0]) if len(c) else math.nan, ttft_p90_s=p90,
                          preemptions=preemptions)
        rows.append({"server": server, "load": str(load), "load_value": point.load, "ttft_p90_s": p90,
                     "requests": len(g), "preemptions": preemptions,
                     "meets_slo": point_meets_slo(point, math.inf if slo_ms is None else slo_ms)})
    return pd.DataFrame(rows).sort_values(["server", "load_value"]).reset_index(drop=True)


def capacity_findings(res: ExperimentResults) -> list[Finding]:
    """Each configuration's capacity: the highest measured load level that meets the TTFT p90 SLO. Where the
    experiment ran a sweep, its recorded answers are the capacity (`experiment.json` `capacity`, decided by
    :mod:`kvscope.harness.analysis.capacity`, preemptions included); the grid's levels fill in the rest."""
    entries = getattr(res.experiment, "capacity", None) or []  # the sweeps' recorded answers, if any
    swept = [_sweep_finding(e) for e in entries]
    levels = capacity_by_level(res)
    if swept:
        done = {e.server for e in entries}
        levels = levels[~levels["server"].isin(done)] if len(levels) else levels
        if not len(levels) or len(_load_order(res)) < 2:
            return swept
    slo_ms = res.spec.slo.ttft_ms if res.spec is not None else None
    loads = _load_order(res)
    if not len(levels):
        return []
    if len(loads) < 2:
        return [Finding(question="capacity", notebook="concurrency", figure="ttft_vs_load",
                        numbers={"load_levels": float(len(loads))},
                        sentence=f"Capacity is not measured: the experiment ran one load level ({', '.join(loads)}); "
                                 "a capacity needs a sweep of several levels up to where the SLO breaks.")]
    out = []
    for server, g in levels.groupby("server", sort=False):
        meeting = g[g["meets_slo"]]
        top = g.iloc[-1]
        slo = f"TTFT p90 ≤ {slo_ms:.0f} ms" if slo_ms else "no TTFT SLO set"
        if not len(meeting):
            s = (f"{server} misses {slo} even at the lowest load ({g.iloc[0]['load']}: "
                 f"{_ms(g.iloc[0]['ttft_p90_s'])} ms).")
            cap = None
        else:
            best = meeting.iloc[-1]
            cap = float(best["load_value"])
            above = g[(g["load_value"] > best["load_value"]) & ~g["meets_slo"]]
            tail = ("; the ceiling was not reached (the highest level measured still meets it)"
                    if best["load"] == top["load"] else
                    f"; at {above.iloc[0]['load']} it preempts ({above.iloc[0]['preemptions']:.0f} preemptions)"
                    if len(above) and above.iloc[0]["preemptions"] else
                    f"; at {top['load']} TTFT p90 is {_ms(top['ttft_p90_s'])} ms")
            s = f"{server} holds load {best['load']} at {slo} (p90 {_ms(best['ttft_p90_s'])} ms){tail}."
        out.append(Finding(question="capacity", sentence=s, notebook="concurrency", figure="latency_throughput",
                           numbers={"capacity_load": cap, "slo_ttft_ms": slo_ms,
                                    "ttft_p90_at_highest_s": float(top["ttft_p90_s"])}))
    return swept + out


def _sweep_finding(entry) -> Finding:
    """A sweep's recorded answer (an `experiment.json` `capacity` entry) as a finding."""
    return Finding(question="capacity", sentence=entry.sentence + ".",
                   notebook="concurrency", figure="latency_throughput",
                   numbers={"capacity_load": entry.capacity, "slo_ttft_ms": entry.slo_ttft_p90_ms})


# ---- A/B ---------------------------------------------------------------------------------------------------
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


# ---- speculative decoding ----------------------------------------------------------------------------------
def speculative_findings(res: ExperimentResults, table: pd.DataFrame | None = None) -> list[Finding]:
    """Whether speculative decoding pays (throughput change against its baseline) and at which load it stops."""
    st = T.speculative_table(res)
    if not len(st) or "throughput_change" not in st:
        return []
    loads = _load_order(res)
    out = []
    for server, g in st.groupby("server", sort=False):
        by_load = g.groupby("load")["throughput_change"].mean().reindex(loads).dropna()
        if not len(by_load):
            continue
        acc = g["acceptance_rate"].mean()
        stops = [ld for ld, v in by_load.items() if v <= 0]
        ci = ""
        interval = None
        if table is not None and len(table):
            m = table[(table["B"] == server) & (table["metric"] == "output_tokens_per_s")]
            if len(m):
                lo, hi = float((m["ci_low"] / m["a"]).min()), float((m["ci_high"] / m["a"]).max())
                interval, ci = (lo, hi), f" (per-workload 95 % intervals span {_signed_pct(lo)} to {_signed_pct(hi)})"
        per_load = ", ".join(f"{_signed_pct(v)} at {ld}" for ld, v in by_load.items())
        if len(by_load) < 2:
            where = "; where it stops paying is not measured (one load level)"
        elif stops:
            where = f"; it stops paying at {stops[0]}"
        else:
            where = "; it still pays at the highest load measured"
        verdict = "pays off" if by_load.iloc[0] > 0 else "does not pay off"
        out.append(Finding(question="speculative", notebook="speculative", figure="acceptance_and_tpot",
                           sentence=f"{server} {verdict}: output throughput {per_load} against "
                                    f"{g['baseline'].dropna().iloc[0] if g['baseline'].notna().any() else 'its baseline'}"
                                    f"{ci}, acceptance {_pct(acc)}{where}.",
                           numbers={"acceptance_rate": None if pd.isna(acc) else float(acc),
                                    **{f"throughput_change_{ld}": float(v) for ld, v in by_load.items()}},
                           interval=interval, interval_of="relative output throughput change"))
    return out


# ---- page findings (not headlines) ------------------------------------------------------------------------
def hit_rate_findings(res: ExperimentResults) -> list[Finding]:
    hits = T.hit_by_workload(res)
    server = _caching_server(res)
    out = []
    if server is not None and len(hits):
        h = hits[hits["server"] == server].sort_values("measured")
        if len(h):
            lo, hi = h.iloc[0], h.iloc[-1]
            out.append(Finding(question="hit_rate", notebook="hit_rates", figure="hit_rate_by_workload",
                               sentence=f"On {server}, {hi['workload']} reuses the most ({_pct(hi['measured'])} of "
                                        f"prompt tokens from the cache) and {lo['workload']} the least "
                                        f"({_pct(lo['measured'])}).",
                               numbers={"hit_rate_max": float(hi["measured"]), "hit_rate_min": float(lo["measured"])}))
        err = (h["predicted_by_simulator"] - h["measured"]).abs().max() if len(h) else math.nan
        if math.isfinite(err):
            out.append(Finding(question="hit_rate", notebook="hit_rates", figure="hit_rate_by_workload",
                               sentence=f"kvscope's simulator predicts the server's hit rate within "
                                        f"{err * 100:.1f} percentage points on every workload.",
                               numbers={"max_abs_error_pp": float(err * 100)}))
    return out


def latency_findings(res: ExperimentResults) -> list[Finding]:
    c = _ok_cells(res)
    loads = _load_order(res)
    if not len(c) or not loads or "ttft_p50_s" not in c:
        return []
    low = c[c["load"].astype(str) == loads[0]].groupby("server", sort=False)["ttft_p50_s"].median()
    parts = ", ".join(f"{s} {_ms(v)} ms" for s, v in low.items())
    out = [Finding(question="latency", notebook="latency", figure="latency_ecdf",
                   sentence=f"TTFT p50 at {loads[0]} (median over workloads): {parts}.",
                   numbers={f"ttft_p50_{s}_s": float(v) for s, v in low.items()})]
    slo = res.spec.slo if res.spec is not None else None
    if slo is not None and slo.ttft_ms and "goodput_fraction" in c:
        gp = c.groupby("server", sort=False)["goodput_fraction"].mean()
        out.append(Finding(question="latency", notebook="latency", figure="ttft_by_load",
                           sentence="Share of requests meeting the SLO (TTFT ≤ {:.0f} ms{}): {}.".format(
                               slo.ttft_ms, f", TPOT ≤ {slo.tpot_ms:.0f} ms" if slo.tpot_ms else "",
                               ", ".join(f"{s} {_pct(v)}" for s, v in gp.items())),
                           numbers={f"goodput_{s}": None if pd.isna(v) else float(v) for s, v in gp.items()}))
    return out


def cost_findings(res: ExperimentResults) -> list[Finding]:
    names = list(res.spec.cost.pricing) if res.spec is not None else []
    if not names:
        return []
    pc = T.provider_costs(res, names)
    if not len(pc):
        return []
    out = []
    for wl, g in pc.groupby("workload", sort=False):
        best = g.sort_values("usd_per_1000_sessions").iloc[0]
        out.append(Finding(question="cost", notebook="cost", figure="provider_cost_per_session",
                           sentence=f"{wl}: cheapest is {best['preset']} at ${best['usd_per_1000_sessions']:,.2f} per "
                                    f"1,000 sessions with caching (${best['usd_per_1000_sessions_no_cache']:,.2f} "
                                    f"without; same {int(best['sessions'])} sessions).",
                           numbers={"usd_per_1000_sessions": float(best["usd_per_1000_sessions"])}))
    gap = T.provider_vs_vllm(res, names)
    if len(gap):
        worst = gap.iloc[(gap["vllm_hit_rate"] - gap["cache_read_ratio"]).abs().argmax()]
        out.append(Finding(question="cost", notebook="cost", figure=None,
                           sentence=f"{worst['workload']} on {worst['preset']}: the provider reads "
                                    f"{_pct(worst['cache_read_ratio'])} of input from its cache where vLLM hit "
                                    f"{_pct(worst['vllm_hit_rate'])} — {worst['why']}.",
                           numbers={"cache_read_ratio": float(worst["cache_read_ratio"]),
                                    "vllm_hit_rate": float(worst["vllm_hit_rate"])}))
    return out[:4]


# ---- caveats -----------------------------------------------------------------------------------------------
def caveats(res: ExperimentResults) -> list[Finding]:
    """The conditions that limit what the numbers mean, each only where the data shows it."""
    out: list[Finding] = []
    for name, fn in _CAVEATS.items():
        f = fn(res)
        if f is not None:
            out.append(Finding(question="caveat", sentence=f[0], numbers=f[1], notebook=PAGE_OF_CAVEAT[name]))
    return out


def _caveat_block_size(res: ExperimentResults):
    sizes = sorted({int(b) for b in _ok_cells(res).get("block_size", pd.Series(dtype=float)).dropna()})
    big = [b for b in sizes if b > GPU_BLOCK_SIZE]
    if not big:
        return None
    return ((f"KV blocks are {big[0]} tokens here (vLLM on CPU) against {GPU_BLOCK_SIZE} on a GPU: a hit is floored "
            f"to whole blocks, so each prompt can lose up to {big[0] - 1} reusable tokens and hit rates on a GPU "
            "are higher."), {"block_size": float(big[0])})


def _caveat_min_cacheable(res: ExperimentResults):
    from kvscope.harness.pricing.provider_cache import load_preset

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


def _caveat_eviction(res: ExperimentResults):
    m = res.metrics
    if not len(m) or "kv_cache_usage" not in m:
        return None
    peak = float(m["kv_cache_usage"].max())
    pre = m.groupby("cell")["num_preemptions"].agg(lambda s: s.max() - s.min()).sum() \
        if "num_preemptions" in m else 0
    if peak >= 0.9 or pre > 0:
        return None
    return ((f"No eviction pressure: KV-cache usage peaked at {_pct(peak)} with {int(pre)} preemptions, so the "
            "hit rates are those of a cache that never had to evict."), {"peak_kv_usage": peak})


def _caveat_tiny_model(res: ExperimentResults):
    model = res.manifest.get("model") or {}
    card = model.get("card") or {}
    if not (model.get("weights_random") or card):
        return None
    steps = card.get("train_steps")
    state = "random weights" if model.get("weights_random") else \
        f"kvscope's tiny model trained for {steps} steps" if steps is not None else "kvscope's tiny model"
    return ((f"The model has {state}: its answers repeat themselves, so n-gram drafts are accepted far more often "
            "than a real model's would be — read acceptance and speed-ups as upper bounds."),
            {"train_steps": None if steps is None else float(steps)})


def _caveat_burst(res: ExperimentResults):
    ok = res.ok_requests()
    if not len(ok) or "e2e_s" not in ok:
        return None
    multi = ok[ok["output_tokens"].fillna(0) > 1]
    if not len(multi):
        return None
    burst = float(((multi["e2e_s"] - multi["ttft_s"]) <= 0.05 * multi["e2e_s"]).mean())
    if burst < 0.05:
        return None
    return ((f"{_pct(burst)} of answers arrived in one burst (TTFT ≈ end-to-end): for those, TPOT and ITL measure "
            "the delivery, not the decoding."), {"burst_share": burst})


def _caveat_sessions(res: ExperimentResults):
    c = _ok_cells(res)
    if "concurrency" not in c or not len(res.requests):
        return None
    sessions = res.requests.groupby("cell")["session_id"].nunique()
    rows = [(r["cell"], int(sessions.get(r["cell"], 0)), int(r["concurrency"])) for _, r in c.iterrows()
            if pd.notna(r.get("concurrency")) and sessions.get(r["cell"], 0) < r["concurrency"]]
    if not rows:
        return None
    example = rows[0]
    return ((f"{len(rows)} cell(s) had fewer sessions than their concurrency (e.g. {example[0]}: {example[1]} "
            f"sessions at concurrency {example[2]}): those ran below their nominal load."),
            {"cells_below_concurrency": float(len(rows))})


def _caveat_client_stalls(res: ExperimentResults):
    """The replay client's own stalls (summary.json ``client.stalled_s``): windows in which sessions started late
    and tokens were read late, so latencies there are the host's, not the server's."""
    rows = [(cell, s.client.stalled_s or 0.0, s.client.stall_max_s or 0.0, s.duration_s)
            for cell, s in res.summaries.items() if s.client.stalled_s is not None and s.duration_s]
    bad = [r for r in rows if r[1] > CLIENT_STALL_SHARE * r[3]]
    if not bad:
        return None
    stalled, duration = sum(r[1] for r in rows), sum(r[3] for r in rows)
    worst = max(bad, key=lambda r: r[1] / r[3])
    return ((f"The replay client was held up (its event loop woke over {CLIENT_STALL_S:g} s late) in {len(bad)} of {len(rows)} "
             f"cell(s): {stalled:.1f} s of {duration:.0f} s in all, up to {_pct(worst[1] / worst[3])} of "
             f"{worst[0]} (longest {worst[2]:.1f} s). In those windows sessions started late and tokens were read "
             "late, in bursts: latencies there measure the host, not the server."),
            {"client_stalled_s": stalled, "client_stalled_share": stalled / duration})


def _caveat_cache_not_reset(res: ExperimentResults):
    """Cells replayed on a prefix cache that could not be emptied first (summary.json ``data_quality``
    ``cache_not_reset``: vLLM without VLLM_SERVER_DEV_MODE=1)."""
    bad = {cell: s.data_quality.cache_not_reset for cell, s in res.summaries.items()
           if getattr(getattr(s, "data_quality", None), "cache_not_reset", None)}
    if not bad:
        return None
    cell, why = next(iter(bad.items()))
    return ((f"{len(bad)} of {len(res.summaries)} cell(s) started on a prefix cache that could not be emptied "
             f"(e.g. {cell}: {why}): they hit what earlier runs left, so measured hit rates exceed the "
             "predicted ones and TTFTs are those of a warm cache. Start vLLM with VLLM_SERVER_DEV_MODE=1."),
            {"cells_cache_not_reset": float(len(bad))})


_CAVEATS = {"block_size": _caveat_block_size, "min_cacheable": _caveat_min_cacheable, "eviction": _caveat_eviction,
            "tiny_model": _caveat_tiny_model, "burst": _caveat_burst, "sessions_below_concurrency": _caveat_sessions,
            "client_stalls": _caveat_client_stalls, "cache_not_reset": _caveat_cache_not_reset}


# ---- entry points ------------------------------------------------------------------------------------------
def executive_summary(res: ExperimentResults, resamples: int = RESAMPLES) -> list[Finding]:
    """The headline findings (habits, capacity, speculative decoding, A/B) followed by the caveats."""
    table = ab_table(res, resamples)
    return [*habit_findings(res, resamples), *capacity_findings(res), *speculative_findings(res, table),
            *ab_findings(table), *caveats(res)]


def page_findings(res: ExperimentResults, notebook: str, resamples: int = RESAMPLES,
                  ab: pd.DataFrame | None = None, explained: list[WorkloadExplanation] | None = None
                  ) -> list[Finding]:
    """The findings one analysis page opens with (and its caveats). ``ab`` (the A/B table) and ``explained``
    (the per-workload attributions) are what the page already computed, where it did."""
    if notebook == "hit_rates":
        found = [*habit_findings(res, resamples), *hit_rate_findings(res)]
    elif notebook == "concurrency":
        found = capacity_findings(res)
    elif notebook == "latency":
        found = latency_findings(res)
    elif notebook == "cost":
        found = cost_findings(res)
    elif notebook == "speculative":
        found = speculative_findings(res, ab if ab is not None else ab_table(res, resamples))
    elif notebook == "ab_compare":
        found = ab_findings(ab if ab is not None else ab_table(res, resamples))
    elif notebook == "explain":
        found = explain_findings(explained if explained is not None else explain_workloads(res))
    else:
        raise ValueError(f"no findings for notebook {notebook!r}; known: {', '.join(PAGE_QUESTIONS)}")
    return found + [c for c in caveats(res) if c.notebook == notebook]


def findings_markdown(findings: Iterable[Finding]) -> str:
    """The markdown a page opens with: one bullet per finding, caveats last."""
    found = list(findings)
    lines = [f"- {f.sentence}" for f in found if f.question != "caveat"] or ["- Nothing to report on this data."]
    cav = [f"- *Caveat:* {f.sentence}" for f in found if f.question == "caveat"]
    return "**Findings**\n\n" + "\n".join(lines + cav)


def write_page_findings(res: ExperimentResults | None, notebook: str, figures_dir: Path,
                        ab: pd.DataFrame | None = None, resamples: int = RESAMPLES,
                        explained: list[WorkloadExplanation] | None = None) -> list[Finding]:
    """Compute a page's findings, write `findings.json` beside its figures (for index.html) and return them.
    The A/B page also writes the full verdict table as CSV and the pivot into the file."""
    if res is None:
        return []
    found = page_findings(res, notebook, resamples, ab, explained)
    verdicts: list[VerdictCell] = []
    csv = None
    if notebook == "ab_compare" and ab is not None and len(ab):
        ab.to_csv(Path(figures_dir) / "verdicts.csv", index=False)
        csv = f"figures/{notebook}/verdicts.csv"
        t = ab[ab["metric"].isin(PIVOT_METRICS)]
        verdicts = [VerdictCell(pair=f"{r.A} → {r.B} · {r.workload} · {r.load}", metric=r.metric,
                                verdict=str(r.verdict), relative=None if pd.isna(r.relative) else float(r.relative))
                    for r in t.itertuples()]
    write_findings_file(Path(figures_dir) / FINDINGS_NAME,
                        FindingsFile(notebook=notebook, findings=found, verdicts=verdicts, verdicts_csv=csv))
    return found
