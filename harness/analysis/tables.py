"""Analysis behind the notebooks: every table a report shows is computed here, from `ExperimentResults`.

Notebooks hold the narrative and the plots; anything non-trivial lives in this module so that it is tested
and reusable from a user's own analysis.

Several tables of one page need the same costly intermediate (the cost page and its findings price the same
trace with the same presets four times over: 10 trace reads and 46 provider simulations at 100k records). Those
intermediates are kept per loaded results object (:func:`_derived`, by identity, dropped with the object): the
results of a directory are read once and not changed afterwards, and each value is a pure function of them and
of its key.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from kvscope.harness.results.goodput import goodput as goodput_block
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import ServerEntry

_DERIVED: dict[int, tuple[weakref.ref, dict[tuple, Any]]] = {}


def _derived(res: ExperimentResults, key: tuple, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per results object and key (see the module docstring); callers must not mutate it."""
    entry = _DERIVED.get(id(res))
    if entry is None or entry[0]() is not res:
        ident = id(res)

        def drop(ref: weakref.ref) -> None:
            if _DERIVED.get(ident, (None,))[0] is ref:
                del _DERIVED[ident]

        entry = (weakref.ref(res, drop), {})
        _DERIVED[ident] = entry
    values = entry[1]
    if key not in values:
        values[key] = compute()
    return values[key]


def _simulated(res: ExperimentResults, workload: str, reqs: list, cfg: Any, block_size: int) -> dict:
    """The provider simulation's summary for one workload's cost trace under one preset configuration."""
    from kvscope.harness.pricing.provider_cache import simulate_provider

    return _derived(res, ("provider", workload, block_size, cfg.model_dump_json()),
                    lambda: simulate_provider(reqs, cfg)[1])


# ------------------------------------------------------------------------------------------- hit rates


def _ratio(num: pd.Series, den: pd.Series) -> pd.Series:
    return (num / den.where(den > 0)).astype(float)


def hit_table(res: ExperimentResults) -> pd.DataFrame:
    """Per cell: prompt tokens and hit rate three ways (server per request, /metrics counters, predicted)."""
    cols = ["cell", "server", "workload", "load", "repeat", "status", "prefix_caching", "speculative", "requests",
            "hit_server", "hit_metrics", "hit_predicted", "would_hit", "requests_predicted_exactly",
            "requests_compared"]
    df = res.cells.reindex(columns=cols).copy()
    df["predicted_minus_server_pp"] = (df["hit_predicted"] - df["hit_server"]) * 100
    df["server_minus_metrics_pp"] = (df["hit_server"] - df["hit_metrics"]) * 100
    return df


def hit_by_workload(res: ExperimentResults) -> pd.DataFrame:
    """Token-weighted hit rate per (server, workload), summed over loads and repeats, three ways with distinct names:

    * ``measured``: what the server reported (cached / prompt tokens);
    * ``predicted_by_simulator``: what kvscope's vLLM-exact simulator predicts *this* server reports (0 when its
      prefix caching is off);
    * ``would_hit_with_caching``: what the same traffic would hit with prefix caching on (the simulator's
      answer for a caching-off server; equal to the prediction where caching is on).

    ``requests`` counts the trace's distinct requests once, however many load levels and repeats replayed it
    (``replays`` says how many cells were pooled), so pooling loads does not double the count.
    """
    cols = ["server", "workload", "requests", "replays", "prompt_tokens", "measured", "predicted_by_simulator",
            "would_hit_with_caching"]
    ok = res.ok_requests()
    if not len(ok):
        return pd.DataFrame(columns=cols)
    g = ok.groupby(["server", "workload"], sort=False).agg(
        prompt_tokens=("prompt_tokens", "sum"), cached=("cached_tokens", "sum"),
        predicted=("predicted_cached_tokens", "sum"), requests=("request_id", "nunique"),
        replays=("cell", "nunique")).reset_index()
    g["measured"] = _ratio(g["cached"], g["prompt_tokens"])
    g["predicted_by_simulator"] = _ratio(g["predicted"], g["prompt_tokens"])
    c = res.cells
    if "would_hit" in c:  # a per-cell token-weighted ratio: weight it by the cell's prompt tokens
        tokens = ok.groupby("cell")["prompt_tokens"].sum()
        c = c.assign(_n=c["cell"].map(tokens).astype(float))
        w = c.assign(_w=c["would_hit"].astype(float) * c["_n"]).dropna(subset=["_w"]).groupby(
            ["server", "workload"], sort=False).agg(_w=("_w", "sum"), _n=("_n", "sum")).reset_index()
        w["would_hit_with_caching"] = _ratio(w["_w"], w["_n"])
        g = g.merge(w[["server", "workload", "would_hit_with_caching"]], on=["server", "workload"], how="left")
    else:
        g["would_hit_with_caching"] = math.nan
    on = g["would_hit_with_caching"].isna()
    g.loc[on, "would_hit_with_caching"] = g.loc[on, "predicted_by_simulator"]
    return g[cols]


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


def invalidation_cost(res: ExperimentResults) -> pd.DataFrame:
    """Tokens recomputed per request by the kind of history transition (append, edit, compaction, …).

    An edit at depth d or a volatile prefix at position p invalidates every block after it: the gap between
    the `append` row and the others is what that habit costs in prefill.
    """
    ok = res.ok_requests()
    if not len(ok) or "transition" not in ok:
        return pd.DataFrame()
    ok = ok.assign(uncached=ok["prompt_tokens"] - ok["cached_tokens"].fillna(0))
    g = ok.groupby(["server", "workload", "transition"]).agg(
        requests=("request_id", "count"), mean_prompt_tokens=("prompt_tokens", "mean"),
        mean_cached_tokens=("cached_tokens", "mean"), mean_recomputed_tokens=("uncached", "mean")).reset_index()
    g["hit_rate"] = g["mean_cached_tokens"] / g["mean_prompt_tokens"]
    return g


def reconciliation(res: ExperimentResults) -> pd.DataFrame:
    """Client vs server: predicted and reported hits request by request, and the /metrics counters."""
    t = hit_table(res)
    t["exact_share"] = t["requests_predicted_exactly"] / t["requests_compared"].where(t["requests_compared"] > 0)
    return t[["cell", "prefix_caching", "hit_server", "hit_metrics", "hit_predicted", "would_hit",
              "server_minus_metrics_pp", "predicted_minus_server_pp", "requests_predicted_exactly",
              "requests_compared", "exact_share"]]


# ----------------------------------------------------------------------------------------- concurrency


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
    block = float(cap["block_size"].dropna().min()) if len(cap) and cap["block_size"].notna().any() else 16.0
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
    cols = ["server", "workload", "load", "load_value", "repeat", "req_per_s", "ttft_p50_s", "ttft_p90_s",
            "ttft_p99_s", "tpot_p50_s", "max_running", "max_waiting", "max_kv_usage", "preemptions"]
    return c.reindex(columns=cols).sort_values(["server", "workload", "load_value"])


def predicted_vs_measured(res: ExperimentResults) -> pd.DataFrame:
    """Each sweep's curve twice, one row per level and ``source``: ``measured`` (the sweep's cells) and
    ``predicted`` (the scheduler model recorded beside it in experiment.json, from a calibration of the same
    server taken just before the sweep; ``sweep.predict``). ``meets_slo`` is the live rule for both
    (:func:`~kvscope.harness.analysis.capacity.point_meets_slo`); ``preempted`` is what it reads: the cell's
    count for a measured level, the median run's for a predicted one (``preemptions`` is the runs' mean, with
    their 10th-90th percentile beside it). Empty without a sweep or a prediction."""
    from pathlib import PurePath

    from kvscope.harness.analysis.capacity import LoadPoint, point_meets_slo, predicted_point

    entries = getattr(res.experiment, "capacity", None) or []
    cells = res.experiment.cells if res.experiment is not None else {}
    rows = []
    for e in entries:
        if e.predicted is None or not e.predicted.levels:
            continue
        key = {"server": e.server, "workload": e.workload}
        for p in e.points:
            cell = cells.get(PurePath(p.cell).name) if p.cell else None
            head = cell.headline if cell is not None else None
            rows.append({**key, "concurrency": p.load, "source": "measured",
                         "ttft_p50_ms": None if head is None or head.ttft_p50_s is None else head.ttft_p50_s * 1e3,
                         "ttft_p90_ms": None if p.ttft_p90_s is None else p.ttft_p90_s * 1e3,
                         "hit_rate": None if head is None else head.hit_rate, "preemptions": p.preemptions,
                         "preempted": bool(p.preemptions), "preemptions_p10": None, "preemptions_p90": None,
                         "meets_slo": point_meets_slo(LoadPoint(p.load, p.ttft_p90_s, p.preemptions),
                                                      e.slo_ttft_p90_ms)})
        for lv in e.predicted.levels:
            point = predicted_point(lv.load, lv.ttft_p90_s,
                                    lv.preemptions if lv.preemptions_p50 is None else lv.preemptions_p50)
            rows.append({**key, "concurrency": lv.load, "source": "predicted",
                         "ttft_p50_ms": None if lv.ttft_p50_s is None else lv.ttft_p50_s * 1e3,
                         "ttft_p90_ms": None if lv.ttft_p90_s is None else lv.ttft_p90_s * 1e3,
                         "hit_rate": lv.hit_rate, "preemptions": lv.preemptions, "preempted": bool(point.preemptions),
                         "preemptions_p10": lv.preemptions_p10, "preemptions_p90": lv.preemptions_p90,
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
        rows.append({"server": e.server, "workload": e.workload, "slo_ttft_p90_ms": e.slo_ttft_p90_ms,
                     "measured_capacity": e.capacity, "predicted_capacity": None if p is None else p.capacity,
                     "predicted_cliff": None if p is None else p.cliff,
                     "calibration_r2": None if p is None else p.fit_r2,
                     "note": "no prediction recorded" if p is None else (p.skipped or ""),
                     "headline": f"{e.server} on {e.workload}: capacity predicted {_level(p and p.capacity)}, "
                                 f"measured {_level(e.capacity)}",
                     "sentence": f"{e.server} on {e.workload}: " + (
                         "no prediction recorded" if p is None else p.sentence or f"no prediction ({p.skipped})")})
    return pd.DataFrame(rows)


def _level(x: float | None) -> str:
    return "none" if x is None else f"{x:g}"


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
    from kvscope.harness.cachemodel.kv_memory import get_preset, kv_bytes_for_sequence, kv_bytes_per_token

    from kvscope.harness.cachemodel.gpus import load_gpus

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


# --------------------------------------------------------------------------------------------- latency


def latency_long(res: ExperimentResults) -> pd.DataFrame:
    """One row per successful request with the latency metrics in ms and the cached fraction."""
    ok = res.ok_requests()
    if not len(ok):
        return pd.DataFrame()
    out = ok[["cell", "server", "workload", "load", "prompt_tokens", "cached_tokens", "output_tokens"]].copy()
    for m in ("ttft_s", "tpot_s", "e2e_s"):
        out[m.replace("_s", "_ms")] = ok[m].astype(float) * 1000
    out["cached_fraction"] = (ok["cached_tokens"].fillna(0) / ok["prompt_tokens"].where(ok["prompt_tokens"] > 0)).astype(float)
    out["uncached_tokens"] = ok["prompt_tokens"] - ok["cached_tokens"].fillna(0)
    return out


def itl_long(res: ExperimentResults, max_per_cell: int = 20000) -> pd.DataFrame:
    ok = res.ok_requests()
    frames = []
    for cell, g in ok.groupby("cell"):
        gaps = np.concatenate([np.asarray(x, float) for x in g["itl_s"]]) if len(g) else np.zeros(0)
        if len(gaps) > max_per_cell:
            gaps = np.random.default_rng(0).choice(gaps, max_per_cell, replace=False)
        frames.append(pd.DataFrame({"cell": cell, "server": g["server"].iloc[0], "workload": g["workload"].iloc[0],
                                    "itl_ms": gaps * 1000}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["cell", "itl_ms"])


def percentile_table(res: ExperimentResults) -> pd.DataFrame:
    cols = ["cell", "server", "workload", "load", "requests", "req_per_s", "output_tok_per_s"]
    for m in ("ttft", "tpot", "itl", "e2e"):
        cols += [f"{m}_p50_s", f"{m}_p90_s", f"{m}_p99_s"]
    cols += ["goodput_fraction", "goodput_req_per_s", "error_rate"]
    t = res.cells.reindex(columns=cols).copy()
    for c in t.columns:
        if c.endswith("_s") and c[:-2].split("_")[0] in ("ttft", "tpot", "itl", "e2e"):
            t[c.replace("_s", "_ms")] = t.pop(c) * 1000
    return t


def goodput(res: ExperimentResults, slo_ttft_ms: float, slo_tpot_ms: float | None = None) -> pd.DataFrame:
    """Share and rate of requests meeting the SLOs, per cell (recomputed here so any SLO can be tried)."""
    ok = res.ok_requests()
    # An interrupted cell has no summary, so no duration: its goodput rate is unknown (NaN), its share is not.
    durations = res.cells.set_index("cell")["duration_s"].to_dict() if "duration_s" in res.cells else {}
    rows = []
    for cell, g in ok.groupby("cell"):
        d = goodput_block(g, float(durations.get(cell, math.nan)), slo_ttft_ms, slo_tpot_ms) or {}
        rate = d.get("goodput_req_per_s")
        rows.append({"cell": cell, "server": g["server"].iloc[0], "workload": g["workload"].iloc[0],
                     "load": g["load"].iloc[0], "meeting_slo": d["requests_meeting_slo"], "requests": len(g),
                     "fraction": d["fraction"], "goodput_req_per_s": math.nan if rate is None else rate})
    return pd.DataFrame(rows)


def decode_vs_roofline(res: ExperimentResults, bandwidth_gb_s: float, weight_bytes: float) -> pd.DataFrame:
    """Measured single-stream decode speed (1/TPOT p50) against the memory-bandwidth roofline at batch 1."""
    from kvscope.harness.primer.roofline import decode_tokens_per_s_upper_bound

    bound = decode_tokens_per_s_upper_bound(bandwidth_gb_s * 1e9, weight_bytes, 1)
    t = res.cells.reindex(columns=["cell", "server", "workload", "load", "tpot_p50_s", "output_tok_per_s"]).copy()
    t["decode_tok_per_s_single_stream"] = 1.0 / t["tpot_p50_s"].where(t["tpot_p50_s"] > 0)
    t["roofline_tok_per_s_b1"] = bound
    t["fraction_of_roofline"] = t["decode_tok_per_s_single_stream"] / bound
    return t


# ------------------------------------------------------------------------------------------------ cost


def _trace_for_cost(res: ExperimentResults, workload: str, block_size: int):
    """The workload's trace requests restricted to the sessions every finished cell of the workload replayed,
    so caching and no caching, and every preset, are priced over the same sessions."""
    return _derived(res, ("cost_trace", workload, block_size), lambda: _read_trace_for_cost(res, workload, block_size))


def _read_trace_for_cost(res: ExperimentResults, workload: str, block_size: int):
    from kvscope.harness.cachemodel.trace_io import load_trace

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


def provider_costs(res: ExperimentResults, presets: Iterable[str], block_size: int = 16,
                   workloads: Iterable[str] | None = None) -> pd.DataFrame:
    """Per workload and provider preset: cost with prompt caching (TTL driven by the trace's think times)
    and without, over the same sessions (those every cell of the workload replayed): in total, per 1,000
    sessions and per million input tokens."""
    from kvscope.harness.pricing.cost import no_cache_cost
    from kvscope.harness.pricing.provider_cache import load_preset

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
                         "usd_per_mtok_input": s["total_usd"] / total_in * 1e6 if total_in else math.nan,
                         "saving": 1 - s["total_usd"] / base if base else math.nan})
    return pd.DataFrame(rows)


def provider_vs_vllm(res: ExperimentResults, presets: Iterable[str], block_size: int = 16) -> pd.DataFrame:
    """Why a provider's cache-read share differs from vLLM's measured hit rate on the same traffic: the share of
    prompts below the provider's minimum cacheable length, its granularity and its breakpoint mode, each named."""
    from kvscope.harness.pricing.provider_cache import load_preset

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
                    block_size: int = 16) -> pd.DataFrame:
    """How the cache-read share and cost move with the provider's TTL, given the trace's think times. Each TTL is
    priced at that TTL's own write rate where the provider has one (Anthropic: 1.25x for 5 minutes, 2x for an
    hour; `ProviderCacheConfig.for_ttl`)."""
    from kvscope.harness.pricing.provider_cache import load_preset

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


def self_hosted_costs(res: ExperimentResults, gpu_hourly_usd: float, num_gpus: int = 1) -> pd.DataFrame:
    """$ per million output (and total) tokens at the throughput each cell measured."""
    from kvscope.harness.pricing.cost import self_hosted_cost

    rows = []
    for _, c in res.cells.iterrows():
        out_tps = c.get("output_tok_per_s")
        all_tps = (c.get("output_tok_per_s") or 0) + (c.get("prompt_tok_per_s") or 0)
        if not out_tps or (isinstance(out_tps, float) and math.isnan(out_tps)):
            continue
        rows.append({"cell": c["cell"], "server": c["server"], "workload": c["workload"], "load": c["load"],
                     "output_tok_per_s": out_tps,
                     "usd_per_mtok_output": self_hosted_cost(gpu_hourly_usd, num_gpus, out_tps)["usd_per_mtok"],
                     "usd_per_mtok_all": self_hosted_cost(gpu_hourly_usd, num_gpus, all_tps)["usd_per_mtok"]})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------- speculative


def speculative_table(res: ExperimentResults) -> pd.DataFrame:
    """Acceptance per speculative cell and the TPOT / throughput change against the matching baseline.

    The baseline of a speculative cell is the non-speculative server with the same prefix-caching setting,
    same workload, load and repeat.
    """
    c = res.cells
    if not len(c) or "speculative" not in c:
        return pd.DataFrame()
    spec = c[c["speculative"] == True]  # noqa: E712 - pandas object column
    base = c[c["speculative"] != True]  # noqa: E712
    rows = []
    for _, s in spec.iterrows():
        match = base[(base["workload"] == s["workload"]) & (base["load"] == s["load"]) &
                     (base["repeat"] == s["repeat"]) & (base["prefix_caching"] == s["prefix_caching"])]
        b = match.iloc[0] if len(match) else None
        row = {"cell": s["cell"], "server": s["server"], "workload": s["workload"], "load": s["load"],
               "acceptance_rate": s.get("spec_acceptance_rate"),
               "mean_acceptance_length": s.get("spec_mean_acceptance_length"),
               "tpot_p50_ms": s["tpot_p50_s"] * 1000 if s.get("tpot_p50_s") is not None else None,
               "baseline": None if b is None else b["server"],
               "baseline_tpot_p50_ms": None if b is None else b["tpot_p50_s"] * 1000,
               "e2e_p50_ms": s["e2e_p50_s"] * 1000 if s.get("e2e_p50_s") is not None else None,
               "baseline_e2e_p50_ms": None if b is None else b["e2e_p50_s"] * 1000,
               "output_tok_per_s": s["output_tok_per_s"],
               "baseline_output_tok_per_s": None if b is None else b["output_tok_per_s"]}
        if b is not None:
            row["tpot_change"] = s["tpot_p50_s"] / b["tpot_p50_s"] - 1 if b["tpot_p50_s"] else None
            row["e2e_change"] = s["e2e_p50_s"] / b["e2e_p50_s"] - 1 if b["e2e_p50_s"] else None
            row["throughput_change"] = s["output_tok_per_s"] / b["output_tok_per_s"] - 1 if b["output_tok_per_s"] else None
        rows.append(row)
    return pd.DataFrame(rows)


def acceptance_by_position(res: ExperimentResults) -> pd.DataFrame:
    rows = []
    for cell, s in res.summaries.items():
        positions = s.speculative.acceptance_by_position if s.speculative else None
        for i, a in enumerate(positions or []):
            meta = res.cells.set_index("cell").loc[cell]
            rows.append({"cell": cell, "server": meta["server"], "workload": meta["workload"], "position": i,
                         "acceptance": a})
    return pd.DataFrame(rows)


def workload_character(res: ExperimentResults) -> pd.DataFrame:
    """Share of each workload's prompt that is tool output (echo-friendly for n-gram drafts) vs free text."""
    from kvscope.workloads.trace import Trace

    rows = []
    for workload in sorted(set(res.cells["workload"].dropna())):
        tdir = res.trace_dir(workload)
        if tdir is None or not tdir.exists():
            continue
        tr = Trace.read(tdir)
        kinds = pd.Series(tr.seg_kinds)
        lengths = pd.Series(tr.segment_lengths())
        share = lengths.groupby(kinds).sum() / lengths.sum()
        rows.append({"workload": workload, **{f"share_{k}": float(v) for k, v in share.items()}})
    return pd.DataFrame(rows)


def speculation_vs_primer(res: ExperimentResults) -> pd.DataFrame:
    """The primer's prediction against the run: with acceptance rate a and k drafted tokens the primer expects
    (1 − a^(k+1)) / (1 − a) tokens per target pass; the server measured its mean acceptance length. A gap
    says acceptance is not independent per position (the primer's assumption): see acceptance by position."""
    from kvscope.harness.primer.speculative import expected_tokens_per_pass

    c = res.cells
    if not len(c) or "speculative" not in c:
        return pd.DataFrame()
    rows = []
    for _, s in c[c["speculative"] == True].iterrows():  # noqa: E712 - pandas object column
        k = _num_speculative_tokens(res.server(s["server"]))
        a = s.get("spec_acceptance_rate")
        measured = s.get("spec_mean_acceptance_length")
        predicted = expected_tokens_per_pass(float(a), int(k)) if k and a is not None and pd.notna(a) else math.nan
        rows.append({"cell": s["cell"], "server": s["server"], "workload": s["workload"], "load": s["load"],
                     "num_speculative_tokens": k, "acceptance_rate": a,
                     "primer_tokens_per_pass": predicted, "measured_acceptance_length": measured,
                     "measured_minus_primer": (measured - predicted) if measured is not None and pd.notna(measured)
                     else math.nan})
    return pd.DataFrame(rows)


def _num_speculative_tokens(server: ServerEntry | None) -> int | None:
    """Tokens drafted per step, from the server's recorded config (``speculative_config`` is the vLLM config's
    own open mapping, so it is read as one)."""
    spec_config = server.config.get("speculative_config") if server is not None else None
    return spec_config.get("num_speculative_tokens") if isinstance(spec_config, dict) else None


def latency_throughput(res: ExperimentResults) -> pd.DataFrame:
    """The Pareto view across loads: per server and load level, output tokens/s (summed over the workloads'
    cells, mean over repeats) against TTFT p90 over all its requests."""
    ok = res.ok_requests()
    c = res.cells
    if not len(ok) or "output_tok_per_s" not in c:
        return pd.DataFrame(columns=["server", "load", "load_value", "output_tok_per_s", "ttft_p90_ms"])
    thr = c.groupby(["server", "load", "repeat"], sort=False)["output_tok_per_s"].sum() \
        .groupby(["server", "load"], sort=False).mean()
    p90 = ok.groupby(["server", "load"], sort=False)["ttft_s"].quantile(0.9) * 1000
    out = pd.DataFrame({"output_tok_per_s": thr, "ttft_p90_ms": p90}).reset_index()
    out["load_value"] = out["load"].astype(str).str.extract(r"(\d+\.?\d*)")[0].astype(float)
    return out.sort_values(["server", "load_value"]).reset_index(drop=True)


def cell_metrics_table(res: ExperimentResults) -> pd.DataFrame:
    """One row per cell: the cell's coordinates and every registered summary metric's columns
    (``SummaryMetric.cell_columns``), so a metric added to the registry shows here with nothing else touched."""
    from kvscope.harness.results.loaders import CELL_COLUMNS
    from kvscope.harness.results.summary import cell_columns

    metric_cols = list(dict.fromkeys(k for s in res.summaries.values() for k in cell_columns(s)))
    c = res.cells
    return c[[k for k in CELL_COLUMNS + metric_cols if k in c]].reset_index(drop=True) if len(c) else c


def records_for_cells(res: ExperimentResults, cells: Iterable[str]) -> pd.DataFrame:
    r = res.requests
    return r[r["cell"].isin(list(cells))]


def default_pairs(res: ExperimentResults) -> list[tuple[str, str, str, str]]:
    """(cell A, cell B, workload, load): the first server configuration against every other one, on
    identical traffic (same workload, load level and repeat 0)."""
    c = res.cells
    if not len(c) or "server" not in c:
        return []
    c = c[c["status"] == "ok"]
    servers = list(dict.fromkeys(c["server"]))
    if len(servers) < 2:
        return []
    base = servers[0]
    out = []
    for other in servers[1:]:
        for (wl, load), g in c[c["repeat"] == 0].groupby(["workload", "load"], sort=False):
            a = g[g["server"] == base]
            b = g[g["server"] == other]
            if len(a) and len(b):
                out.append((a["cell"].iloc[0], b["cell"].iloc[0], wl, load))
    return out


def error_table(res: ExperimentResults, max_message_chars: int = 160) -> pd.DataFrame:
    """Failed requests per cell and error class, with one example message (shown escaped in reports)."""
    r = res.requests
    if not len(r) or "error_class" not in r:
        return pd.DataFrame(columns=["cell", "error_class", "requests", "example"])
    bad = r[r["error_class"].notna()]
    if not len(bad):
        return pd.DataFrame(columns=["cell", "error_class", "requests", "example"])
    g = bad.groupby(["cell", "error_class"]).agg(requests=("request_id", "count"),
                                                 example=("error", "first")).reset_index()
    g["example"] = g["example"].astype(str).str.slice(0, max_message_chars)
    return g


def sample_outputs(res: ExperimentResults, per_cell: int = 2, max_cells: int = 8) -> pd.DataFrame:
    """A few generated texts per cell (first 200 characters): shows at a glance whether the model's output is
    degenerate (random weights repeat themselves, which inflates n-gram acceptance). Untrusted text: reports
    display it escaped."""
    r = res.ok_requests()
    if not len(r) or "output_text_head" not in r:
        return pd.DataFrame(columns=["cell", "request_id", "output_tokens", "output_text_head"])
    r = r[r["output_text_head"].astype(str).str.len() > 0]
    cells = list(dict.fromkeys(r["cell"]))[:max_cells]
    out = r[r["cell"].isin(cells)].groupby("cell", sort=False).head(per_cell)
    return out[["cell", "request_id", "output_tokens", "output_text_head"]].reset_index(drop=True)
