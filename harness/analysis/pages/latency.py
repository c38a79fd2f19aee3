"""The latency page (notebooks/latency.ipynb): TTFT, TPOT, ITL and end-to-end percentiles, goodput, decode speed against the roofline, errors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from kvscope.harness.analysis.common import (
    _ok_cells,
    _pct,
    one_selection,
    selected_requests,
    stated,
    workload_levels,
)
from kvscope.harness.analysis.registry import PageContext, caveat, report_page
from kvscope.harness.primer.roofline import decode_tokens_per_s_upper_bound
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.goodput import goodput as goodput_block
from kvscope.harness.results.goodput import meets_slo
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import CLIENT_STALL_S, ExperimentSpecCore
from kvscope.harness.results.selection import Selection, Statement, sorted_loads


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


#: The columns that say which cell a row is (the cell's name repeats them).
CELL_KEY = ["server", "workload", "load", "repeat"]
#: The percentile table's rate columns; the latency percentiles are the rest (two tables on the page, each fits).
RATE_COLUMNS = [*CELL_KEY, "requests", "req_per_s", "output_tok_per_s", "goodput_fraction", "goodput_req_per_s",
                "error_rate"]


def percentile_table(res: ExperimentResults) -> pd.DataFrame:
    """Per cell: its rates and the TTFT, TPOT, ITL and end-to-end percentiles in ms."""
    cols = RATE_COLUMNS.copy()
    for m in ("ttft", "tpot", "itl", "e2e"):
        cols += [f"{m}_p50_s", f"{m}_p90_s", f"{m}_p99_s"]
    t = res.cells.reindex(columns=cols).copy()
    for c in t.columns:
        if c.endswith("_s") and c[:-2].split("_")[0] in ("ttft", "tpot", "itl", "e2e"):
            t[c.replace("_s", "_ms")] = t.pop(c) * 1000
    return t


def latency_percentile_columns(table: pd.DataFrame) -> list[str]:
    """The percentile table's latency columns, with the columns that say which cell a row is."""
    return [*CELL_KEY, *[c for c in table.columns if c.endswith("_ms")]]


def goodput(res: ExperimentResults, slo_ttft_ms: float, slo_tpot_ms: float | None = None) -> pd.DataFrame:
    """Share and rate of requests meeting the SLOs, per cell (recomputed here so any SLO can be tried)."""
    ok = res.ok_requests()
    # An interrupted cell has no summary, so no duration: its goodput rate is unknown (NaN), its share is not.
    durations = res.cells.set_index("cell")["duration_s"].to_dict() if "duration_s" in res.cells else {}
    rows = []
    for cell, g in ok.groupby("cell"):
        d = goodput_block(g, float(durations.get(cell, math.nan)), slo_ttft_ms, slo_tpot_ms) or {}
        rate = d.get("goodput_req_per_s")
        rows.append({"server": g["server"].iloc[0], "workload": g["workload"].iloc[0],
                     "load": g["load"].iloc[0], "repeat": g["repeat"].iloc[0] if "repeat" in g else None,
                     "meeting_slo": d["requests_meeting_slo"], "requests": len(g),
                     "fraction": d["fraction"], "goodput_req_per_s": math.nan if rate is None else rate})
    return pd.DataFrame(rows)


def decode_vs_roofline(res: ExperimentResults, bandwidth_gb_s: float, weight_bytes: float) -> pd.DataFrame:
    """Measured single-stream decode speed (1/TPOT p50) against the memory-bandwidth roofline at batch 1."""
    bound = decode_tokens_per_s_upper_bound(bandwidth_gb_s * 1e9, weight_bytes, 1)
    t = res.cells.reindex(columns=[*CELL_KEY, "tpot_p50_s", "output_tok_per_s"]).copy()
    t["decode_tok_per_s_single_stream"] = 1.0 / t["tpot_p50_s"].where(t["tpot_p50_s"] > 0)
    t["roofline_tok_per_s_b1"] = bound
    t["fraction_of_roofline"] = t["decode_tok_per_s_single_stream"] / bound
    return t


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


#: Cells whose replay client was held up for more than this share of their run get a caveat.
CLIENT_STALL_SHARE = 0.01


def _per_workload_sentence(res: ExperimentResults, metric: str, levels: list[tuple[str, str]],
                           value, **extra: Any) -> tuple[str, list[Statement]]:
    """'<workload> at <load>: <server> <number>, …; …' and its statements, one per server × workload × level
    (``value(requests)`` computes the number from the selected requests)."""
    parts, statements = [], []
    for workload, load in levels:
        words = []
        for server in _servers(res):
            sel = one_selection(res, server, workload, load)
            if sel.repeats is None:
                continue
            r = selected_requests(res, sel)
            if not len(r):
                continue
            st = Statement(metric=metric, value=float(value(r)), selection=sel, **extra)
            statements.append(st)
            words.append(f"{server} {stated(st)}")
        if words:
            parts.append(f"{workload} at {load}: {', '.join(words)}")
    return "; ".join(parts), statements


def _number_key(prefix: str, st: Statement) -> str:
    """A finding's number name for one statement: ``ttft_p50_<server>_<workload>_<load>``."""
    sel = st.selection
    return "_".join((prefix, sel.servers[0], sel.workloads[0], sel.loads[0]))


def _servers(res: ExperimentResults) -> list[str]:
    c = _ok_cells(res)
    return list(dict.fromkeys(map(str, c["server"]))) if len(c) else []


def latency_findings(res: ExperimentResults) -> list[Finding]:
    """TTFT p50 per configuration, per workload at its lowest load level, and the share of requests meeting the
    SLO per workload at its highest: never a median or mean over workloads or load levels (`results.selection`)."""
    c = _ok_cells(res)
    if not len(c) or not len(res.ok_requests()):
        return []
    low = workload_levels(res)
    text, sts = _per_workload_sentence(res, "ttft_p50_s", low,
                                       lambda r: np.percentile(r["ttft_s"].astype(float), 50))
    out = [Finding(question="latency", notebook="latency", figure="ttft_by_load", statements=sts,
                   sentence=f"TTFT p50 at each workload's lowest load level: {text}.",
                   numbers={_number_key("ttft_p50", st) + "_s": st.value for st in sts})]
    slo = res.spec.slo if res.spec is not None else None
    if slo is not None and slo.ttft_ms:
        high = workload_levels(res, highest=True)
        text, sts = _per_workload_sentence(
            res, "slo_share", high, lambda r: meets_slo(r, slo.ttft_ms, slo.tpot_ms).mean(),
            slo_ttft_ms=float(slo.ttft_ms), slo_tpot_ms=None if slo.tpot_ms is None else float(slo.tpot_ms))
        out.append(Finding(question="latency", notebook="latency", figure="ttft_by_load", statements=sts,
                           sentence="Share of requests meeting the SLO (TTFT ≤ {:.0f} ms{}) at each workload's "
                                    "highest load level: {}.".format(
                               slo.ttft_ms, f", TPOT ≤ {slo.tpot_ms:.0f} ms" if slo.tpot_ms else "", text),
                           numbers={_number_key("slo_share", st): st.value for st in sts}))
    return out


def latency_ecdf_title(res: ExperimentResults) -> Finding:
    """The key figure's title: a distribution over every workload and load level, said as one (no "fastest"
    over a pool: the per-workload comparison is the TTFT-by-load figure and the finding beside it)."""
    c = _ok_cells(res)
    sel = Selection(servers=tuple(_servers(res)) or ("–",),
                    workloads=tuple(dict.fromkeys(map(str, c["workload"]))) or ("–",),
                    loads=tuple(sorted_loads(c["load"].astype(str))) or ("–",),
                    distribution_over=("server", "workload", "load"))
    return Finding(question="latency", notebook="latency", figure="latency_ecdf",
                   sentence=f"Latency per configuration, {sel.words().split('; ', 1)[-1]}; compare configurations "
                            "per workload and load in TTFT by load level. Dashed: the SLOs")


@caveat("burst", "latency")
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


@caveat("client_stalls", "latency")
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


def _latency_from_spec(spec: ExperimentSpecCore) -> dict[str, Any]:
    """The spec's SLOs, where it sets them."""
    slo = {"slo_ttft_ms": spec.slo.ttft_ms, "slo_tpot_ms": spec.slo.tpot_ms}
    return {name: float(value) for name, value in slo.items() if value is not None}


@report_page("latency", "Latency: TTFT, TPOT, ITL and end-to-end", order=40, questions=("latency",),
             figures=("latency_ecdf", "itl_ecdf", "ttft_vs_cache", "ttft_by_load"),
             parameters=("slo_ttft_ms", "slo_tpot_ms", "bandwidth_gb_s", "weight_bytes"),
             key_figures=("latency_ecdf",), from_spec=_latency_from_spec, relative_cost=2.0)
def _latency_page(ctx: PageContext) -> list[Finding]:
    return latency_findings(ctx.res)
