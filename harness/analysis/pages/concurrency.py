"""The concurrency page (notebooks/concurrency.ipynb): KV capacity, the load curves, the measured and predicted capacity under the SLO."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import PurePath

import numpy as np
import pandas as pd
from kvscope.harness.analysis.capacity import (SHORTFALL_TOLERANCE, LoadPoint, kv_ceiling, point_holds,
                                               point_meets_slo, predicted_point, under_driven, unloaded_point)
from kvscope.harness.analysis.claims import capacity_claims, eviction_claim, recorded_point, sweep_capacity
from kvscope.harness.analysis.common import GPU_BLOCK_SIZE, _load_order, _ms, _ok_cells, one_selection
from kvscope.harness.analysis.registry import PageContext, caveat, report_page
from kvscope.harness.cachemodel.gpus import load_gpus
from kvscope.harness.cachemodel.kv_memory import get_preset, kv_bytes_for_sequence, kv_bytes_per_token
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.selection import Statement, load_value


def capacity_table(res: ExperimentResults) -> pd.DataFrame:
    rows = []
    for server, entry in res.experiment.servers.items():
        f = entry.facts
        rows.append({"server": server, "block_size": f.block_size if f else None,
                     "num_blocks": f.num_blocks if f else None,
                     "kv_capacity_tokens": f.kv_capacity_tokens if f else None,
                     "max_model_len": f.max_model_len if f else None,
                     "max_concurrency_at_max_len": f.max_concurrency if f else None,
                     "prefix_caching": f.prefix_caching if f else None,
                     "kv_cache_dtype": f.kv_cache_dtype if f else None})
    return pd.DataFrame(rows)


def session_footprint(res: ExperimentResults) -> pd.DataFrame:
    """Per workload and step: median context (prompt + output) a live session holds, in tokens and blocks,
    and how many such sessions the smallest server's KV capacity can hold at once."""
    ok = res.ok_requests()
    if not len(ok):
        return pd.DataFrame()
    cap = capacity_table(res)
    capacity = float(cap["kv_capacity_tokens"].dropna().min()) if len(cap) and cap["kv_capacity_tokens"].notna().any() \
        else math.nan
    block = float(cap["block_size"].dropna().min()) if len(cap) and cap["block_size"].notna().any() else float(GPU_BLOCK_SIZE)
    ok = ok.assign(context=ok["prompt_tokens"] + ok["output_tokens"])
    g = ok.groupby(["workload", "step"])["context"].median().reset_index(name="median_context_tokens")
    g["blocks"] = np.ceil(g["median_context_tokens"] / block)
    g["sessions_that_fit"] = np.floor(capacity / (g["blocks"] * block)) if not math.isnan(capacity) else np.nan
    return g


def load_curve(res: ExperimentResults) -> pd.DataFrame:
    """Latency and server state against load, per (server, workload): where the knee is."""
    c = res.cells
    if not len(c) or "ttft_p50_s" not in c:
        return pd.DataFrame()
    m = res.metrics
    if len(m):
        mm = m.groupby("cell").agg(max_running=("num_requests_running", "max"),
                                   max_waiting=("num_requests_waiting", "max"),
                                   max_kv_usage=("kv_cache_usage", "max")).reset_index()
        pre = m.groupby("cell")["num_preemptions"].agg(lambda s: s.max() - s.min()).reset_index(name="preemptions")
        c = c.merge(mm, on="cell", how="left").merge(pre, on="cell", how="left")
    c = c.assign(load_value=c["load"].astype(str).str.extract(r"(\d+\.?\d*)")[0].astype(float))
    c = c[c["load_value"].notna()]  # a replay at the trace's own start times has no load level to plot
    heads = {name: e.headline for name, e in (res.experiment.cells.items() if res.experiment is not None else [])}
    c = c.assign(sessions_in_flight=[getattr(heads.get(n), "mean_sessions_in_flight", None) for n in c["cell"]],
                 under_driven=[bool(getattr(heads.get(n), "under_driven", None)) for n in c["cell"]])
    cols = ["server", "workload", "load", "load_value", "repeat", "req_per_s", "ttft_p50_s", "ttft_p90_s",
            "ttft_p99_s", "tpot_p50_s", "max_running", "max_waiting", "max_kv_usage", "preemptions",
            "sessions_in_flight", "under_driven"]
    return c.reindex(columns=cols).sort_values(["server", "workload", "load_value"])


def predicted_vs_measured(res: ExperimentResults) -> pd.DataFrame:
    """Each sweep's curve twice, one row per level and ``source``: ``measured`` (the sweep's cells) and
    ``predicted`` (the scheduler model recorded beside it in experiment.json, from a calibration of the same
    server taken just before the sweep; ``sweep.predict``). ``meets_slo`` is the live rule for both
    (:func:`~kvscope.harness.analysis.capacity.point_meets_slo`); ``preempted`` is what it reads: the cell's
    count for a measured level, the median run's for a predicted one (``preemptions`` is the runs' mean, with
    their 10th-90th percentile beside it). A sweep without a prediction has its measured rows alone. Empty
    without a sweep."""
    entries = getattr(res.experiment, "capacity", None) or []
    cells = res.experiment.cells if res.experiment is not None else {}
    rows = []
    for e in entries:
        key = {"server": e.server, "workload": e.workload}
        for p in e.points:
            cell = cells.get(PurePath(p.cell).name) if p.cell else None
            head = cell.headline if cell is not None else None
            rows.append({**key, "concurrency": p.load, "source": "measured",
                         "ttft_p50_ms": None if head is None or head.ttft_p50_s is None else head.ttft_p50_s * 1e3,
                         "ttft_p90_ms": None if p.ttft_p90_s is None else p.ttft_p90_s * 1e3,
                         "hit_rate": None if head is None else head.hit_rate, "preemptions": p.preemptions,
                         "preempted": bool(p.preemptions), "preemptions_p10": None, "preemptions_p90": None,
                         "sessions_in_flight": p.mean_sessions_in_flight,
                         "under_driven": under_driven(recorded_point(p), e.kind),
                         "meets_slo": point_meets_slo(recorded_point(p), e.slo_ttft_p90_ms)})
        for lv in (e.predicted.levels if e.predicted is not None else []):
            point = predicted_point(lv.load, lv.ttft_p90_s,
                                    lv.preemptions if lv.preemptions_p50 is None else lv.preemptions_p50)
            rows.append({**key, "concurrency": lv.load, "source": "predicted",
                         "ttft_p50_ms": None if lv.ttft_p50_s is None else lv.ttft_p50_s * 1e3,
                         "ttft_p90_ms": None if lv.ttft_p90_s is None else lv.ttft_p90_s * 1e3,
                         "hit_rate": lv.hit_rate, "preemptions": lv.preemptions, "preempted": bool(point.preemptions),
                         "preemptions_p10": lv.preemptions_p10, "preemptions_p90": lv.preemptions_p90,
                         "sessions_in_flight": None, "under_driven": False,
                         "meets_slo": point_meets_slo(point, e.slo_ttft_p90_ms)})
    if not rows:
        return pd.DataFrame()
    out = pd.DataFrame(rows)
    for col in ("ttft_p50_ms", "ttft_p90_ms", "hit_rate"):
        out[col] = out[col].astype(float)
    return out.sort_values(["server", "workload", "source", "concurrency"]).reset_index(drop=True)


def capacity_predictions(res: ExperimentResults) -> pd.DataFrame:
    """One row per sweep: the measured capacity, the scheduler model's (same rule), its eviction cliff, the
    calibration's fit, and why a sweep has no prediction (``note``)."""
    rows = []
    for e in getattr(res.experiment, "capacity", None) or []:
        p = e.predicted
        measured = sweep_capacity(e).capacity  # today's rule on the recorded levels (under-driven ones not counted)
        rows.append({"server": e.server, "workload": e.workload, "slo_ttft_p90_ms": e.slo_ttft_p90_ms,
                     "measured_capacity": measured, "predicted_capacity": None if p is None else p.capacity,
                     "predicted_cliff": None if p is None else p.cliff,
                     "measured_kv_ceiling": kv_ceiling([LoadPoint(q.load, q.ttft_p90_s, q.preemptions)
                                                        for q in e.points]),
                     "calibration_r2": None if p is None else p.fit_r2,
                     "note": "no prediction recorded" if p is None else (p.skipped or ""),
                     "headline": f"{e.server} on {e.workload}: capacity "
                                 + (f"predicted {_level(p.capacity)}, " if p is not None and not p.skipped else
                                    "not predicted, ") + f"measured {_level(measured)}",
                     "sentence": f"{e.server} on {e.workload}: " + (
                         "no prediction recorded" if p is None else p.sentence or f"no prediction ({p.skipped})")})
    return pd.DataFrame(rows)


def _level(x: float | None) -> str:
    return "none" if x is None else f"{x:g}"


def sweep_levels(res: ExperimentResults) -> pd.DataFrame:
    """One row per measured sweep level: its TTFT p90 (and its 95 % interval over the level's sessions),
    preemptions, mean sessions in flight and whether it was
    under-driven (fewer than 90 % of the level's sessions in flight: `analysis.capacity.under_driven`), whether
    it meets the SLO and whether it counts toward the capacity (met *and* driven), and the tightest TTFT p90 SLO
    it meets (none past the KV ceiling) as a multiple of the sweep's unloaded figure. Empty without a sweep."""
    rows = []
    for c in getattr(res.experiment, "capacity", None) or []:
        pts = [recorded_point(p) for p in c.points]
        ceiling = kv_ceiling(pts)
        low = unloaded_point(pts)
        base_ms = c.slo_unloaded_ttft_p90_ms or (low.ttft_p90_s * 1000 if low is not None and low.ttft_p90_s else None)
        for p in sorted(pts, key=lambda p: p.load):
            ms = None if p.ttft_p90_s is None else p.ttft_p90_s * 1000
            iv = p.ttft_p90_interval_s
            rows.append({"server": c.server, "workload": c.workload, "load": p.load, "ttft_p90_ms": ms,
                         "ttft_p90_ci_low_ms": None if iv is None else iv[0] * 1e3,
                         "ttft_p90_ci_high_ms": None if iv is None else iv[1] * 1e3,
                         "preemptions": p.preemptions, "sessions_in_flight": p.mean_sessions_in_flight,
                         "under_driven": under_driven(p, c.kind), "slo_ms": c.slo_ttft_p90_ms,
                         "tightest_slo_met_ms": None if p.preemptions else ms,
                         "x_unloaded": None if p.preemptions or ms is None or not base_ms else round(ms / base_ms, 2),
                         "past_kv_ceiling": ceiling is not None and p.load >= ceiling,
                         "meets_slo": point_meets_slo(p, c.slo_ttft_p90_ms),
                         "counts_toward_capacity": point_holds(p, c.slo_ttft_p90_ms, c.kind)})
    return pd.DataFrame(rows)


def capacity_reconciliation(res: ExperimentResults) -> Finding | None:
    """One sentence that sets the three session counts of this page against each other for the swept servers'
    KV pool: vLLM's ``max_concurrency_at_max_len`` (the pool over ``max_model_len``: every session at its full
    window), the footprint table's (the pool over a session's median context at its last step, nothing shared)
    and the sweep's measured capacity (sessions at every step at once, their common prefix cached once). None
    without a sweep or the server's KV facts."""
    entries = getattr(res.experiment, "capacity", None) or []
    servers = res.experiment.servers if res.experiment is not None else {}
    swept = [(e, servers[e.server].facts) for e in entries
             if e.server in servers and servers[e.server].facts is not None
             and servers[e.server].facts.kv_capacity_tokens]
    if not swept:
        return None
    e0, facts = swept[0]
    pool = int(facts.kv_capacity_tokens)
    parts = []
    if facts.max_concurrency is not None and facts.max_model_len:
        parts.append(f"vLLM's max_concurrency_at_max_len ({facts.max_concurrency:g}) divides the {pool:,}-token KV "
                     f"pool by max_model_len ({facts.max_model_len:,} tokens), as if every session filled its window")
    numbers: dict[str, float | None] = {"kv_capacity_tokens": float(pool), "max_concurrency_at_max_len":
                                        facts.max_concurrency}
    fp = session_footprint(res)
    mine = fp[fp["workload"] == e0.workload] if len(fp) else fp
    if len(mine):
        last = mine.sort_values("step").iloc[-1]
        parts.append(f"the footprint table ({last['sessions_that_fit']:.0f}) divides it by the median context of "
                     f"{e0.workload}'s sessions at their last step ({last['median_context_tokens']:,.0f} tokens, "
                     f"{last['blocks']:.0f} blocks), sharing nothing")
        numbers["footprint_sessions_that_fit"] = float(last["sessions_that_fit"])
    shared = _shared_prefix_tokens(res, e0.workload)
    held = []
    for e, _ in swept:
        cap = sweep_capacity(e)
        ceiling = kv_ceiling(cap.points)
        held.append(f"{'none' if cap.capacity is None else f'{cap.capacity:g}'} ({e.server}"
                    + (f", preempting from c{ceiling:g}" if ceiling is not None else "") + ")")
        numbers[f"measured_capacity_{e.server}"] = cap.capacity
    share_words = ("" if shared is None else
                   f", sharing a {shared:,.0f}-token common prefix held once in the cache" if shared else
                   ", sharing no prefix across sessions (no session's first request hit another's blocks)")
    parts.append(f"the sweep ran {e0.workload} sessions at every step at once{share_words}, and held "
                 f"{' and '.join(held)} driven sessions within the SLO (a level counts when at least "
                 f"{SHORTFALL_TOLERANCE * 100:.0f} % of its sessions were in flight)")
    return Finding(question="capacity", notebook="concurrency", figure="footprint", numbers=numbers,
                   sentence="Three session counts for one KV pool: " + "; ".join(parts) + ".")


def _shared_prefix_tokens(res: ExperimentResults, workload: str) -> float | None:
    """The median prefix a session's first request shares with the sessions before it (the infinite-cache
    prediction of its cached tokens: nothing of its own is cached yet), over the workload's sessions after the
    first; None where the records carry no prediction."""
    ok = res.ok_requests()
    if not len(ok) or "predicted_cached_tokens" not in ok:
        return None
    w = ok[ok["workload"] == workload]
    if not len(w):
        return None
    first = w.sort_values("step").groupby(["cell", "session_id"], sort=False).head(1)
    per_session = first.groupby("session_id")["predicted_cached_tokens"].max().dropna()
    return float(per_session.iloc[1:].median()) if len(per_session) > 1 else None


def find_knee(curve: pd.DataFrame, metric: str = "ttft_p90_s", factor: float = 2.0) -> pd.DataFrame:
    """First load level whose `metric` exceeds `factor` x its value at the lowest load (per server, workload)."""
    rows = []
    for (server, workload), g in curve.groupby(["server", "workload"]):
        g = g.sort_values("load_value")
        base = g[metric].iloc[0]
        knee = g[g[metric] > factor * base]
        rows.append({"server": server, "workload": workload, "baseline": base,
                     "knee_load": None if knee.empty else knee["load"].iloc[0],
                     "knee_value": None if knee.empty else knee[metric].iloc[0]})
    return pd.DataFrame(rows)


def capacity_planning(contexts: Iterable[int] = (8192, 32768, 131072),
                      gpus: dict[str, float] | None = None,
                      models: Iterable[str] = ("llama-3.1-8b", "qwen2.5-7b", "llama-3.1-70b"),
                      kv_dtypes: Iterable[str] = ("bfloat16", "fp8"), tp_for: dict[str, int] | None = None
                      ) -> pd.DataFrame:
    """Concurrent sequences that fit in the KV memory left after weights, for other shapes and GPUs (default: the
    accelerators of `cachemodel/gpus.yaml`, as GiB)."""
    gpus = gpus or {g.name: g.memory_gib for g in load_gpus()}
    tp_for = tp_for or {"llama-3.1-70b": 4}
    rows = []
    for model in models:
        shape = get_preset(model)
        tp = tp_for.get(model, 1)
        weights = (shape.weight_bytes() or 0) / tp
        for gpu, gib in gpus.items():
            free = gib * 2**30 * 0.92 - weights - 2 * 2**30  # utilisation, weights, ~2 GiB activations/graphs
            for dt in kv_dtypes:
                for ctx in contexts:
                    per_seq = kv_bytes_for_sequence(shape, ctx, dt, tp)
                    rows.append({"model": model, "tp": tp, "gpu": gpu, "kv_dtype": dt, "context": ctx,
                                 "kib_per_token": kv_bytes_per_token(shape, dt, tp) / 1024,
                                 "kv_gib_free": max(free, 0) / 2**30,
                                 "sequences": int(max(free, 0) // per_seq) if per_seq else 0})
    return pd.DataFrame(rows)


def capacity_planning_pivot(plan: pd.DataFrame) -> pd.DataFrame:
    """The capacity plan as shown: sequences per GPU, one row per model, tensor-parallel degree, KV dtype and
    context. The tensor-parallel degree stays in the index: a 70B model's row is per GPU of a tp=4 group, and
    without it the row reads as a single GPU holding the whole model."""
    if not len(plan):
        return plan
    return plan.pivot_table(index=["model", "tp", "kv_dtype", "context"], columns="gpu", values="sequences",
                            sort=False)


def capacity_by_level(res: ExperimentResults) -> pd.DataFrame:
    """Per server, workload and load level: TTFT p90 over its requests (repeats pooled, counted in
    ``repeats``), preemptions, and whether the level meets the SLO by the sweeps' rule
    (:func:`~kvscope.harness.analysis.capacity.point_meets_slo`: TTFT p90 within the SLO and no preemption).
    Never pooled over workloads: a level's p90 over three workloads is none of theirs."""
    ok = res.ok_requests()
    slo_ms = res.spec.slo.ttft_ms if res.spec is not None else None
    if not len(ok):
        return pd.DataFrame()
    curve = load_curve(res)
    rows = []
    for (server, workload, load), g in ok.groupby(["server", "workload", "load"], sort=False):
        c = curve[(curve["server"] == server) & (curve["workload"] == workload) & (curve["load"] == load)] \
            if len(curve) else curve
        p90 = float(np.percentile(g["ttft_s"].astype(float), 90))
        preemptions = float(c["preemptions"].fillna(0).sum()) if len(c) and "preemptions" in c else 0.0
        point = LoadPoint(load=float(c["load_value"].iloc[0]) if len(c) else load_value(str(load)),
                          ttft_p90_s=p90, preemptions=preemptions)
        rows.append({"server": server, "workload": workload, "load": str(load), "load_value": point.load,
                     "repeats": int(g["repeat"].nunique()) if "repeat" in g else None, "ttft_p90_s": p90,
                     "requests": len(g), "preemptions": preemptions,
                     "meets_slo": point_meets_slo(point, math.inf if slo_ms is None else slo_ms)})
    return pd.DataFrame(rows).sort_values(["server", "workload", "load_value"]).reset_index(drop=True)


def capacity_findings(res: ExperimentResults) -> list[Finding]:
    """Each configuration's capacity: the highest measured load level that meets the TTFT p90 SLO. Where the
    experiment ran a sweep, its recorded answers are the capacity (`experiment.json` `capacity`, decided by
    :mod:`kvscope.harness.analysis.capacity`, preemptions included); the grid's levels fill in the rest."""
    entries = getattr(res.experiment, "capacity", None) or []  # the sweeps' recorded answers, if any
    # typed entries (experiment.json): the capacity claims, with the levels measured and the prediction, and
    # the sentence that reconciles them with vLLM's and the footprint table's session counts
    typed = all(hasattr(e, "points") for e in entries)
    swept = [c.finding("capacity", "concurrency", "predicted_vs_measured") for c in capacity_claims(res)] \
        if typed else [_sweep_finding(e) for e in entries]
    if typed and swept and (why := capacity_reconciliation(res)) is not None:
        swept.append(why)
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
        if g.groupby("workload")["load"].nunique().max() < 2:  # levels only across workloads: no curve of any
            out.append(Finding(question="capacity", notebook="concurrency", figure="latency_throughput",
                               numbers={"load_levels": 1.0},
                               sentence=f"{server}'s capacity is not measured: it ran one load level per workload "
                                        f"({', '.join(f'{w} at {lv}' for w, lv in zip(g['workload'], g['load']))}); "
                                        "levels of different workloads are not one curve."))
    for (server, workload), g in levels.groupby(["server", "workload"], sort=False):
        if len(g) < 2:  # one level of this workload: no curve, no capacity (the other workloads' levels are not its)
            continue
        meeting = g[g["meets_slo"]]
        top = g.iloc[-1]
        slo = f"TTFT p90 ≤ {slo_ms:.0f} ms" if slo_ms else "no TTFT SLO set"
        fixed = ", the spec's fixed SLO" if slo_ms else ""
        if not len(meeting):
            s = (f"{server} misses {slo} even at the lowest load of {workload} ({g.iloc[0]['load']}: "
                 f"{_ms(g.iloc[0]['ttft_p90_s'])} ms{fixed}).")
            cap = None
            stated_row = g.iloc[0]
        else:
            best = meeting.iloc[-1]
            cap = float(best["load_value"])
            above = g[(g["load_value"] > best["load_value"]) & ~g["meets_slo"]]
            tail = ("; the ceiling was not reached (the highest level measured still meets it)"
                    if best["load"] == top["load"] else
                    f"; at {above.iloc[0]['load']} it preempts ({above.iloc[0]['preemptions']:.0f} preemptions)"
                    if len(above) and above.iloc[0]["preemptions"] else
                    f"; at {top['load']} TTFT p90 is {_ms(top['ttft_p90_s'])} ms")
            s = (f"{server} holds load {best['load']} at {slo} on {workload} (p90 {_ms(best['ttft_p90_s'])} ms"
                 f"{fixed}){tail}.")
            stated_row = best
        statement = Statement(metric="ttft_p90_s", value=float(stated_row["ttft_p90_s"]),
                              selection=one_selection(res, str(server), str(workload), str(stated_row["load"])))
        out.append(Finding(question="capacity", sentence=s, notebook="concurrency", figure="latency_throughput",
                           numbers={"capacity_load": cap, "slo_ttft_ms": slo_ms,
                                    "ttft_p90_at_highest_s": float(top["ttft_p90_s"])}, statements=[statement]))
    return swept + out


def _sweep_finding(entry) -> Finding:
    """A sweep's recorded answer (an `experiment.json` `capacity` entry) as a finding."""
    return Finding(question="capacity", sentence=entry.sentence + ".",
                   notebook="concurrency", figure="latency_throughput",
                   numbers={"capacity_load": entry.capacity, "slo_ttft_ms": entry.slo_ttft_p90_ms})


@caveat("eviction", "concurrency")
def _caveat_eviction(res: ExperimentResults):
    """Whether the pool evicted, from evictions (`claims.eviction_claim`), never from the KV-usage gauge: the
    gauge counts the blocks of running requests, not the cached free blocks that eviction takes."""
    return eviction_claim(res)


@caveat("sessions_below_concurrency", "concurrency")
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


@report_page("concurrency", "Concurrency and KV-cache memory", order=30, questions=("capacity",),
             figures=("latency_throughput", "ttft_vs_load", "sweep_ttft_vs_load", "predicted_vs_measured", "footprint",
                      "kv_usage_over_time", "running_over_time"),
             parameters=("knee_factor",), key_figures=("latency_throughput", "predicted_vs_measured"))
def _concurrency_page(ctx: PageContext) -> list[Finding]:
    return capacity_findings(ctx.res)
