"""What every analysis page shares: the per-results memo of costly intermediates, the cell and run selectors,
the number formats of the finding sentences and the server colours.

Several tables of one page need the same costly intermediate (the cost page and its findings price the same
trace with the same presets four times over: 10 trace reads and 46 provider simulations at 100k records). Those
intermediates are kept per loaded results object (:func:`_derived`, by identity, dropped with the object): the
results of a directory are read once and not changed afterwards, and each value is a pure function of them and
of its key. The page modules (`kvscope.harness.analysis.pages`) import from here, never from each other's
internals, except where one page's answer is another's input (the A/B table)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from kvscope.harness.analysis.ab import Run
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.pricing.provider_cache import simulate_provider
from kvscope.harness.results.loaders import CELL_COLUMNS, ExperimentResults, load_run_manifest
from kvscope.harness.results.selection import Selection, Statement, sorted_loads
from kvscope.harness.results.summary import cell_columns
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE

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
    return _derived(res, ("provider", workload, block_size, cfg.model_dump_json()),
                    lambda: simulate_provider(reqs, cfg)[1])


def _ratio(num: pd.Series, den: pd.Series) -> pd.Series:
    return (num / den.where(den > 0)).astype(float)


def cell_metrics_table(res: ExperimentResults) -> pd.DataFrame:
    """One row per cell: the cell's coordinates and every registered summary metric's columns
    (``SummaryMetric.cell_columns``), so a metric added to the registry shows here with nothing else touched."""
    metric_cols = list(dict.fromkeys(k for s in res.summaries.values() for k in cell_columns(s)))
    c = res.cells
    return c[[k for k in CELL_COLUMNS + metric_cols if k in c]].reset_index(drop=True) if len(c) else c


GPU_BLOCK_SIZE = DEFAULT_BLOCK_SIZE  # vLLM's block size on a GPU (the CPU backend's is 128)


RESAMPLES = 1000


_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


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
    """The load levels that ran, in numeric order (``sweep-c12`` after ``sweep-c5``)."""
    c = _ok_cells(res)
    return sorted_loads(c["load"].astype(str)) if len(c) else []


def stated(st: Statement) -> str:
    """A statement's number as every sentence and title writes it (the claims audit looks for these words)."""
    v = st.value
    if st.metric in ("ttft_p50_s", "ttft_p90_s"):
        return _ms(v) + " ms"
    if st.metric in ("hit_rate", "slo_share"):
        return _pct(v)
    if st.metric == "sessions_in_flight":
        return f"{v:.1f} sessions in flight"
    if st.metric == "self_hosted_usd_per_1000_sessions":
        return f"${v:,.2f} per 1,000 sessions"
    if st.metric == "hit_rate_gain_pp":
        return f"hit rate {abs(v):.0f} pp {'higher' if v > 0 else 'lower'}" if round(v) else "hit rate unchanged"
    return _change_words(v)


def _change_words(rel: float | None, noun: str = "") -> str:
    """A relative change in words, never a bare sign: ``1 % lower``, ``60 % higher``, ``unchanged``."""
    if rel is None or not math.isfinite(rel):
        return "–"
    if round(abs(rel) * 100) == 0:
        return f"{noun + ' ' if noun else ''}unchanged"
    return f"{noun + ' ' if noun else ''}{abs(rel) * 100:.0f} % {'higher' if rel > 0 else 'lower'}"


def verdict_words(counts: Any) -> str:
    """Verdict counts as words, each direction named for what it means (``counts``: verdict -> count):
    ``verdicts: 1 better, 3 inconclusive`` — "better" is the verdict engine's, after the metric's direction
    (lower TTFT, higher throughput), so it never reads against the sign of a change."""
    words = [f"{int(counts[v])} {v.replace('_', ' ')}" for v in ("better", "worse", "equivalent", "inconclusive",
                                                                "by_construction") if counts.get(v)]
    return "verdicts: " + (", ".join(words) if words else "none")


def pooled_words(res: ExperimentResults, *over: str) -> str:
    """What a distribution figure pools, in its title's words: ``pooled over 4 workloads and 5 load levels (a
    distribution, not a comparison)``; empty where the experiment has one of each (``over``: ``workload``,
    ``load``: the dimensions the figure does not separate)."""
    c = _ok_cells(res)
    if not len(c):
        return ""
    sel = Selection(servers=("all",),
                    workloads=tuple(dict.fromkeys(map(str, c["workload"]))) if "workload" in over else ("one",),
                    loads=tuple(sorted_loads(c["load"].astype(str))) if "load" in over else ("one",),
                    distribution_over=tuple(over))  # type: ignore[arg-type]
    words = sel.words()
    return words[words.index("pooled over"):] if "pooled over" in words else ""


def selected_requests(res: ExperimentResults, sel: Selection) -> pd.DataFrame:
    """The successful requests of a selection (its servers, workloads and load levels)."""
    ok = res.ok_requests()
    return ok[ok["server"].astype(str).isin(sel.servers) & ok["workload"].astype(str).isin(sel.workloads)
              & ok["load"].astype(str).isin(sel.loads)]


def throughput_change_statement(server: str, baseline: str, comparisons: pd.DataFrame, value: float
                                ) -> list[Statement]:
    """The statement of a sentence's "output throughput N % higher (median)": ``server`` against ``baseline`` over
    the workload × load ``comparisons`` (rows with ``workload`` and ``load``), a distribution over them; empty
    where the median is not a number (nothing to state)."""
    if not math.isfinite(value):
        return []
    return [Statement(metric="output_throughput_change", value=float(value), baseline=str(baseline),
                      selection=Selection(servers=(str(server),),
                                          workloads=tuple(dict.fromkeys(map(str, comparisons["workload"]))),
                                          loads=tuple(dict.fromkeys(map(str, comparisons["load"]))),
                                          distribution_over=("workload", "load")))]


def one_selection(res: ExperimentResults, server: str, workload: str, load: str) -> Selection:
    """One configuration × workload × load level, with the number of repeats that ran it."""
    c = _ok_cells(res)
    repeats = c[(c["server"].astype(str) == server) & (c["workload"].astype(str) == workload)
                & (c["load"].astype(str) == load)]
    n = int(repeats["repeat"].nunique()) if "repeat" in repeats and len(repeats) else None
    return Selection(servers=(server,), workloads=(workload,), loads=(load,), repeats=n)


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
            sha = load_run_manifest(manifest).trace.sha256
        tps = row.get("output_tok_per_s")
        runs.append(Run(str(row["cell"]), rec, nan_to_none(tps, float),
                        row.get("prefix_caching"), sha, res.summaries.get(row["cell"])))
    return runs


def _metric_row(table: pd.DataFrame, metric: str) -> dict[str, Any] | None:
    if not len(table):
        return None
    rows = table[table["metric"] == metric]
    return None if not len(rows) else rows.iloc[0].to_dict()

def habit_pairs(res: ExperimentResults) -> list[tuple[str, str]]:
    """(reference, habit) workloads: a workload named `<reference>-<suffix>` is a habit added to `<reference>`."""
    workloads = sorted(set(map(str, _ok_cells(res)["workload"])))
    pairs = []
    for w in workloads:
        refs = [r for r in workloads if r != w and w.startswith(r + "-")]
        if refs:
            pairs.append((max(refs, key=len), w))
    return pairs


def hit_by_workload(res: ExperimentResults) -> pd.DataFrame:
    """Token-weighted hit rate per (server, workload), summed over loads and repeats, three ways with distinct names:

    * ``measured``: what the server reported (cached / prompt tokens);
    * ``predicted_by_simulator``: what kvscope's vLLM-exact simulator predicts *this* server reports (0 when its
      prefix caching is off);
    * ``would_hit_with_caching``: what the same traffic would hit with prefix caching on (the simulator's
      answer for a caching-off server; equal to the prediction where caching is on).

    ``requests`` counts the trace's distinct requests once, however many load levels and repeats replayed it
    (``replays`` says how many cells were pooled), so pooling loads does not double the count. Pooled over load
    levels: a table of the whole run, never the source of a sentence comparing workloads (their levels differ;
    sentences read :func:`hit_by_workload_load`).
    """
    return _hit_rates(res, ["server", "workload"])


def hit_by_workload_load(res: ExperimentResults) -> pd.DataFrame:
    """:func:`hit_by_workload` per load level too (one row per server × workload × load, in numeric load order),
    the table every hit-rate sentence and title reads: a hit rate depends on the load (eviction), so two
    workloads are compared at stated levels."""
    t = _hit_rates(res, ["server", "workload", "load"])
    if not len(t):
        return t
    order = {lv: i for i, lv in enumerate(sorted_loads(t["load"]))}
    return t.assign(_o=t["load"].map(order)).sort_values(["server", "workload", "_o"], kind="stable") \
        .drop(columns="_o").reset_index(drop=True)


def _hit_rates(res: ExperimentResults, keys: list[str]) -> pd.DataFrame:
    cols = [*keys, "requests", "replays", "prompt_tokens", "measured", "predicted_by_simulator",
            "would_hit_with_caching"]
    ok = res.ok_requests()
    if not len(ok):
        return pd.DataFrame(columns=cols)
    ok = ok.assign(load=ok["load"].astype(str))
    g = ok.groupby(keys, sort=False).agg(
        prompt_tokens=("prompt_tokens", "sum"), cached=("cached_tokens", "sum"),
        predicted=("predicted_cached_tokens", "sum"), requests=("request_id", "nunique"),
        replays=("cell", "nunique")).reset_index()
    g["measured"] = _ratio(g["cached"], g["prompt_tokens"])
    g["predicted_by_simulator"] = _ratio(g["predicted"], g["prompt_tokens"])
    c = res.cells
    if "would_hit" in c:  # a per-cell token-weighted ratio: weight it by the cell's prompt tokens
        tokens = ok.groupby("cell")["prompt_tokens"].sum()
        c = c.assign(_n=c["cell"].map(tokens).astype(float), load=c["load"].astype(str))
        w = c.assign(_w=c["would_hit"].astype(float) * c["_n"]).dropna(subset=["_w"]).groupby(
            keys, sort=False).agg(_w=("_w", "sum"), _n=("_n", "sum")).reset_index()
        w["would_hit_with_caching"] = _ratio(w["_w"], w["_n"])
        g = g.merge(w[[*keys, "would_hit_with_caching"]], on=keys, how="left")
    else:
        g["would_hit_with_caching"] = math.nan
    on = g["would_hit_with_caching"].isna()
    g.loc[on, "would_hit_with_caching"] = g.loc[on, "predicted_by_simulator"]
    return g[cols]


def workload_levels(res: ExperimentResults, server: str | None = None, highest: bool = False
                    ) -> list[tuple[str, str]]:
    """(workload, load) for each workload at the lowest load level it ran (on ``server`` if given; ``highest``:
    the highest level): the level a per-workload sentence is stated at, and names. Per workload, because a
    sweep's levels hold only its own workload."""
    c = _ok_cells(res)
    if server is not None and len(c):
        c = c[c["server"].astype(str) == server]
    out = []
    for workload in dict.fromkeys(map(str, c["workload"])) if len(c) else []:
        levels = sorted_loads(c[c["workload"].astype(str) == workload]["load"].astype(str))
        if levels:
            out.append((workload, levels[-1] if highest else levels[0]))
    return out


LATENCY_THROUGHPUT_COLUMNS = ["server", "workload", "load", "load_value", "repeats", "output_tok_per_s",
                              "goodput_req_per_s", "goodput_fraction", "ttft_p90_ms"]


def latency_throughput(res: ExperimentResults) -> pd.DataFrame:
    """The latency-throughput view, like for like: one row per configuration × workload × load level with the
    output tokens/s and goodput (requests/s meeting the experiment's SLO, and their share) of its cells, each the
    mean over repeats, and TTFT p90 over its requests.

    Never summed or pooled across workloads: a sum over cells of different workloads is not a load level of
    anything (a timestamped workload at 0 % hit added to a sweep's cells reads as more throughput), and two
    load levels whose cells ran different workloads are not points of one curve."""
    ok = res.ok_requests()
    c = _ok_cells(res)
    if not len(ok) or not len(c) or "output_tok_per_s" not in c:
        return pd.DataFrame(columns=LATENCY_THROUGHPUT_COLUMNS)
    keys = ["server", "workload", "load"]
    c = c.assign(load=c["load"].astype(str))
    cols = {"output_tok_per_s": "mean", "repeat": "nunique"}
    for extra in ("goodput_req_per_s", "goodput_fraction"):
        if extra in c:
            cols[extra] = "mean"
    per = c.groupby(keys, sort=False).agg(cols).rename(columns={"repeat": "repeats"})
    p90 = ok.assign(load=ok["load"].astype(str)).groupby(keys, sort=False)["ttft_s"].quantile(0.9) * 1000
    out = per.join(p90.rename("ttft_p90_ms"), how="inner").reset_index()
    out["load_value"] = out["load"].str.extract(r"(\d+\.?\d*)")[0].astype(float)
    return out.reindex(columns=LATENCY_THROUGHPUT_COLUMNS).sort_values(["workload", "server", "load_value"]) \
        .reset_index(drop=True)
