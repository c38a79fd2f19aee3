"""Cache-break attribution across an experiment: the report's `explain` page as data.

Why per workload, not per cell. Every cell of a workload replays the same trace (generated once, in
``<experiment>/traces/<workload>``), so the attribution — best cached predecessor, diverging message, cause,
what-if re-simulation — is a property of the trace; only the observed cached tokens differ between cells. One
:func:`~kvscope.harness.analysis.explain.explain_trace` per workload keeps the page cheap however many loads and
repeats ran: it takes the observed cached tokens of one run, the least concurrent run of a configuration with
prefix caching on and no speculative decoding (there the server's cache behaves like the simulator's, so the
shortfall is eviction, not scheduling), at that server's block size. Without such a run the infinite-cache
simulation stands in, and the page says so.

The page shows tidy frames (:func:`cause_frame`, :func:`workload_frame`, :func:`provider_frame`) and opens with
:func:`explain_findings`; the costliest cause is a ``habit`` finding, so the index's executive summary links it
to its attribution beside the hit-rate page's habit finding.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from kvscope.harness.analysis.causes import Cause
from kvscope.harness.analysis.common import _derived, _ok_cells, _pct
from kvscope.harness.analysis.explain import (
    Explanation,
    ProviderAgreement,
    explain_trace,
    provider_comparison,
    run_eviction,
)
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.workloads.trace import Trace

NOTEBOOK = "explain"
SIMULATED = "simulation (infinite cache)"

CAUSE_WORDS = {
    Cause.VOLATILE_FIELD: "a volatile field (date, time or id)",
    Cause.SYSTEM_PROMPT_CHANGED: "a changed system prompt",
    Cause.TOOLS_CHANGED: "changed or reordered tool definitions",
    Cause.MESSAGE_EDITED: "an earlier message edited in place",
    Cause.HISTORY_TRUNCATED: "truncated history",
    Cause.COMPACTION: "compaction (history replaced by a summary)",
    Cause.MODEL_SWITCH: "a model switch (the previous step ran on another model, with its own cache)",
    Cause.EVICTED: "eviction (the prefix was cached earlier in this run, then evicted)",
    Cause.PREFIX_CHANGED: "a changed prefix",
    Cause.REPLAY_SUBSTITUTED_OUTPUT: ("the replay's substitution of answers (a recorded-mode replay sends the "
                                      "trace's answer, not the one the server generated and cached: a replay "
                                      "artefact)"),
    Cause.NOT_YET_CACHED: "a prefix still being computed by a concurrent request (never cached before: not eviction)",
}
#: Causes that are a shortfall of the run rather than a habit of the history: never the page's habit headline.
RUN_SHORTFALLS = {Cause.EVICTED, Cause.REPLAY_SUBSTITUTED_OUTPUT, Cause.NOT_YET_CACHED}
#: One colour per cause, the same on every figure of the page.
CAUSE_COLOURS = {Cause.VOLATILE_FIELD: "#d62728", Cause.SYSTEM_PROMPT_CHANGED: "#9467bd",
                 Cause.MODEL_SWITCH: "#2ca02c",
                 Cause.TOOLS_CHANGED: "#8c564b", Cause.MESSAGE_EDITED: "#e377c2", Cause.HISTORY_TRUNCATED: "#7f7f7f",
                 Cause.COMPACTION: "#bcbd22", Cause.EVICTED: "#17becf", Cause.PREFIX_CHANGED: "#ff7f0e",
                 Cause.REPLAY_SUBSTITUTED_OUTPUT: "#aec7e8", Cause.NOT_YET_CACHED: "#c5b0d5"}


@dataclass
class WorkloadExplanation:
    """One workload's attribution and where its observed cached tokens came from."""

    workload: str
    explanation: Explanation
    observed_from: str  # the cell whose run gave the cached tokens, or SIMULATED
    server: str | None  # that cell's server configuration
    num_gpu_blocks: int | None = None  # that cell's KV pool (the pool what-ifs' size), where the server said


def _column(frame: pd.DataFrame, name: str, default: object) -> pd.Series:
    return frame[name] if name in frame else pd.Series(default, index=frame.index)


def observation_cell(res: ExperimentResults, workload: str) -> tuple[str, str, int | None] | None:
    """(cell, server, block size) of the workload's least concurrent ok run with prefix caching on and no
    speculative decoding, that has request records; None where there is none."""
    c = res.cells
    if not len(c) or "workload" not in c or not len(res.requests):
        return None
    caching = _column(c, "prefix_caching", None).map(lambda v: v is True)
    speculative = _column(c, "speculative", False).fillna(False).astype(bool)
    ok = _column(c, "status", "ok") == "ok"
    sel = c[(c["workload"].astype(str) == workload) & ok & caching & ~speculative]
    sel = sel[sel["cell"].isin(set(res.requests["cell"]))]
    if not len(sel):
        return None
    concurrency = sel["concurrency"] if "concurrency" in sel else pd.Series(math.nan, index=sel.index)
    order = sel.assign(_c=pd.to_numeric(concurrency, errors="coerce"))
    row = order.sort_values(["_c", "repeat", "cell"], na_position="last").iloc[0]
    block = row.get("block_size")
    return str(row["cell"]), str(row["server"]), nan_to_none(block, int)


def _fallback_block_size(res: ExperimentResults) -> int | None:
    sizes = pd.to_numeric(res.cells.get("block_size", pd.Series(dtype=float)), errors="coerce").dropna()
    return int(sizes.iloc[0]) if len(sizes) else None


def explained_workloads(res: ExperimentResults) -> list[WorkloadExplanation]:
    """:func:`explain_workloads`, computed once per results object: the explain page, the eviction claim
    (`analysis.claims`) and the caveats read the same attribution."""
    return _derived(res, ("explain_workloads",), lambda: explain_workloads(res))


def _num_blocks(res: ExperimentResults, cell: str) -> int | None:
    c = res.cells
    if "num_blocks" not in c:
        return None
    v = pd.to_numeric(c.loc[c["cell"] == cell, "num_blocks"], errors="coerce").dropna()
    return int(v.iloc[0]) if len(v) else None


def explain_workloads(res: ExperimentResults) -> list[WorkloadExplanation]:
    """One attribution per workload whose trace is in the experiment (see the module doc); the what-ifs at the
    observed cell's KV pool too, where its server reported the pool's size."""
    workloads = list(dict.fromkeys(map(str, res.cells["workload"]))) if "workload" in res.cells else []
    out = []
    for w in workloads:
        tdir = res.trace_dir(w)
        if tdir is None or not (Path(tdir) / "trace.json").is_file():
            continue
        cell = observation_cell(res, w)
        if cell is not None:
            name, server, block = cell
            records = res.requests[res.requests["cell"] == name]
            blocks = _num_blocks(res, name)
            ex = explain_trace(tdir, block, observed_records=records, num_gpu_blocks=blocks)
            out.append(WorkloadExplanation(w, ex, name, server, blocks))
        else:
            out.append(WorkloadExplanation(w, explain_trace(tdir, _fallback_block_size(res)), SIMULATED, None))
    return out


def cell_eviction(res: ExperimentResults) -> pd.DataFrame:
    """Per caching cell with request records: prompt tokens, cached tokens, the tokens an unbounded cache would
    have served in that run (``infinite_cached_tokens``: blocks cached earlier in it, from the tokens its server
    held, :func:`~kvscope.harness.analysis.explain.run_eviction`; never below what the server served) and
    ``evicted_tokens``: what was cached and then lost. Computed once per results object."""
    return _derived(res, ("cell_eviction",), lambda: _cell_eviction(res))


_EVICTION_COLUMNS = ["cell", "server", "workload", "load", "prompt_tokens", "cached_tokens", "infinite_cached_tokens",
                     "evicted_tokens", "hit_rate", "infinite_hit_rate"]


def _cell_eviction(res: ExperimentResults) -> pd.DataFrame:
    ok = res.ok_requests()
    c = _ok_cells(res)
    if not len(ok) or not len(c) or "prefix_caching" not in c:
        return pd.DataFrame(columns=_EVICTION_COLUMNS)
    traces: dict[str, Trace | None] = {}
    records_of = dict(tuple(res.requests.groupby("cell", sort=False)))
    ok_of = dict(tuple(ok.groupby("cell", sort=False)))
    rows = []
    for _, cell in c[c["prefix_caching"].map(lambda v: v is True)].iterrows():
        w = str(cell["workload"])
        if w not in traces:
            tdir = res.trace_dir(w)
            traces[w] = Trace.read(tdir) if tdir is not None and (Path(tdir) / "trace.json").is_file() else None
        trace = traces[w]
        records = records_of.get(cell["cell"])
        r = ok_of.get(cell["cell"])
        if trace is None or records is None or r is None or not len(r):
            continue
        block = nan_to_none(cell.get("block_size"), int) or int(trace.meta.get("block_size_hint") or 16)
        ev = run_eviction(trace, records, block)
        r = r[r["request_id"].to_numpy(int) < trace.num_requests]
        prompt = float(r["prompt_tokens"].sum())
        got = float(r["cached_tokens"].fillna(0).sum())
        ideal = float(np.maximum(ev.reachable_cached_tokens, ev.cached_tokens).sum())
        rows.append({"cell": cell["cell"], "server": cell["server"], "workload": cell["workload"],
                     "load": str(cell["load"]), "prompt_tokens": prompt, "cached_tokens": got,
                     "infinite_cached_tokens": ideal, "evicted_tokens": float(ev.evicted_tokens.sum()),
                     "hit_rate": got / prompt if prompt else math.nan,
                     "infinite_hit_rate": ideal / prompt if prompt else math.nan})
    return pd.DataFrame(rows, columns=_EVICTION_COLUMNS)


# ---- tidy frames ---------------------------------------------------------------------------------------------
def cause_frame(explained: list[WorkloadExplanation]) -> pd.DataFrame:
    """One row per (workload, cause): recomputed tokens, share of the workload's recomputed tokens, the requests
    it broke, the hit rate as observed and with that cause removed (re-simulated)."""
    rows = []
    for wx in explained:
        broke = Counter(a.cause for a in wx.explanation.requests if a.cause)
        for c in wx.explanation.causes:
            rows.append({"workload": wx.workload, "cause": c.cause, "recomputed_tokens": c.recomputed_tokens,
                         "share": c.share, "requests": broke.get(c.cause, 0), "hit_rate": wx.explanation.hit_rate,
                         "what_if_hit_rate": c.what_if_hit_rate, "what_if_hit_rate_pool": c.what_if_hit_rate_pool})
    cols = ["workload", "cause", "recomputed_tokens", "share", "requests", "hit_rate", "what_if_hit_rate",
            "what_if_hit_rate_pool"]
    return pd.DataFrame(rows, columns=cols)


def what_if_frame(explained: list[WorkloadExplanation]) -> pd.DataFrame:
    """Per workload that recomputed anything: its hit rate as observed, then with each cause removed, with an
    infinite cache and (where the run's pool size is known) at that pool (long form: workload, scenario, cause,
    hit_rate; the observed row's cause is None)."""
    rows = []
    for wx in explained:
        if not wx.explanation.recomputed_tokens:
            continue
        rows.append({"workload": wx.workload, "scenario": "as observed", "cause": None,
                     "hit_rate": wx.explanation.hit_rate})
        rows += [{"workload": wx.workload, "scenario": _scenario(c.cause), "cause": c.cause,
                  "hit_rate": c.what_if_hit_rate} for c in wx.explanation.causes]
        rows += [{"workload": wx.workload, "scenario": f"{_scenario(c.cause)}, at the run's KV pool", "cause": c.cause,
                  "hit_rate": c.what_if_hit_rate_pool} for c in wx.explanation.causes
                 if c.what_if_hit_rate_pool is not None]
    return pd.DataFrame(rows, columns=["workload", "scenario", "cause", "hit_rate"])


def _scenario(cause: Cause) -> str:
    """A what-if's name: the cause removed; a recorded replay's substitution is removed by replaying live."""
    return "replayed live (no substituted answers)" if cause == Cause.REPLAY_SUBSTITUTED_OUTPUT else f"without {cause}"


def what_if_palette(frame: pd.DataFrame) -> dict[str, str]:
    """The what-if figure's colours: dark grey as observed, each cause's own colour without it (an infinite
    cache), the same colour lightened at the run's KV pool."""
    # deferred: matplotlib is heavy, importing this module must not load it
    from matplotlib.colors import to_hex, to_rgb

    def light(colour: str) -> str:
        r, g, b = to_rgb(colour)
        return to_hex((0.55 * r + 0.45, 0.55 * g + 0.45, 0.55 * b + 0.45))

    causes = list(dict.fromkeys(frame["cause"].dropna()))
    colours = {"as observed": "#444444", **{_scenario(c): CAUSE_COLOURS.get(c, "#999999") for c in causes},
               **{f"{_scenario(c)}, at the run's KV pool": light(CAUSE_COLOURS.get(c, "#999999")) for c in causes}}
    return {k: v for k, v in colours.items() if k in set(frame["scenario"])}


def workload_frame(explained: list[WorkloadExplanation]) -> pd.DataFrame:
    """One row per workload: where the observation came from, its totals and its costliest cause."""
    rows = []
    for wx in explained:
        ex = wx.explanation
        top = ex.causes[0].cause if ex.causes else None
        rows.append({"workload": wx.workload, "observed_from": wx.observed_from, "block_size": ex.block_size,
                     "requests": len(ex.requests), "prompt_tokens": ex.prompt_tokens, "cached_tokens": ex.cached_tokens,
                     "hit_rate": ex.hit_rate, "recomputed_tokens": ex.recomputed_tokens, "top_cause": top})
    return pd.DataFrame(rows, columns=["workload", "observed_from", "block_size", "requests", "prompt_tokens",
                                       "cached_tokens", "hit_rate", "recomputed_tokens", "top_cause"])


def costliest_requests(explained: list[WorkloadExplanation], per_workload: int = 5) -> pd.DataFrame:
    """The requests that recomputed the most, per workload, with their cause and where the prompt diverged."""
    rows = []
    for wx in explained:
        broken = sorted((a for a in wx.explanation.requests if a.recomputed_tokens),
                        key=lambda a: (-a.recomputed_tokens, a.request_id))[:per_workload]
        rows += [{"workload": wx.workload, "request_id": a.request_id, "session_id": a.session_id, "step": a.step,
                  "prompt_tokens": a.prompt_tokens, "cached_tokens": a.cached_tokens,
                  "recomputed_tokens": a.recomputed_tokens, "cause": a.cause, "where": a.where} for a in broken]
    return pd.DataFrame(rows, columns=["workload", "request_id", "session_id", "step", "prompt_tokens",
                                       "cached_tokens", "recomputed_tokens", "cause", "where"])


def provider_frame(explained: list[WorkloadExplanation]) -> tuple[pd.DataFrame, dict[str, ProviderAgreement]]:
    """Observed provider cache reads beside the provider cache model's, request by request, for the workloads
    whose trace carries provider usage; and each such workload's agreement (see :func:`agreement_frame`)."""
    frames, agreements = [], {}
    for wx in explained:
        rows, agreement = provider_comparison(wx.explanation)
        if agreement is None:
            continue
        agreements[wx.workload] = agreement
        frames.append(pd.DataFrame(rows).assign(workload=wx.workload, preset=agreement.preset))
    if not frames:
        return pd.DataFrame(), agreements
    df = pd.concat(frames, ignore_index=True)
    return df[["workload", "preset", *[c for c in df.columns if c not in ("workload", "preset")]]], agreements


def agreement_frame(agreements: dict[str, ProviderAgreement]) -> pd.DataFrame:
    """One row per workload with provider usage: the preset, requests observed, exact matches, mean share gap."""
    return pd.DataFrame([{"workload": w, **asdict(a)} for w, a in agreements.items()],
                        columns=["workload", *ProviderAgreement.__dataclass_fields__])


# ---- sentences -------------------------------------------------------------------------------------------------
def _typical_where(wx: WorkloadExplanation, cause: str) -> str:
    wheres = Counter(a.where for a in wx.explanation.requests if a.cause == cause and a.where)
    return wheres.most_common(1)[0][0] if wheres else ""


def reference_of(wx: WorkloadExplanation, explained: list[WorkloadExplanation]) -> WorkloadExplanation | None:
    """The workload that is ``wx`` without its habit (``agent-coding`` for ``agent-coding-timestamped``: the
    longest other workload name it extends), observed the same way; None where there is none."""
    refs = [o for o in explained if o.workload != wx.workload and wx.workload.startswith(o.workload + "-")]
    return max(refs, key=lambda o: len(o.workload)) if refs else None


def cause_sentence(wx: WorkloadExplanation, explained: list[WorkloadExplanation] | None = None) -> str | None:
    """"<workload>: <cause> (<where>) causes N % of the K recomputed tokens; removing it would take the hit rate
    from X to Y with an infinite cache (Z at the run's pool); <reference>, the same sessions without it, measured
    W." for the workload's costliest cause; None when nothing was recomputed. The what-if says under which cache
    it holds: an infinite cache's gain overstates what a small pool keeps."""
    ex = wx.explanation
    if not ex.causes or not ex.recomputed_tokens:
        return None
    top = ex.causes[0]
    where = _typical_where(wx, top.cause) if top.cause not in RUN_SHORTFALLS else ""  # theirs is per request
    words = CAUSE_WORDS.get(top.cause, top.cause.replace("_", " "))
    if top.cause == Cause.EVICTED:
        cache = " with an infinite cache (no eviction)"
    elif top.cause == Cause.REPLAY_SUBSTITUTED_OUTPUT:
        cache = " in a live replay (the server's own answers in the history, as a real agent's)"
    elif top.cause == Cause.NOT_YET_CACHED:
        cache = " had each concurrent request finished before the next one needing its prefix was sent"
    else:
        cache = " with an infinite cache"
        if top.what_if_hit_rate_pool is not None:
            cache += (f", {_pct(top.what_if_hit_rate_pool)} at this run's KV pool of {wx.num_gpu_blocks} blocks "
                      "(in the run's order)")
    ref = reference_of(wx, explained or [])
    measured = ""
    if ref is not None and top.cause not in RUN_SHORTFALLS:
        measured = (f"; {ref.workload}, the same sessions without it, measured {_pct(ref.explanation.hit_rate)}"
                    + (f" on {ref.server}" if ref.server else " (simulated)"))
    rest = _rest_of_gap(wx, ref, top.what_if_hit_rate) if measured else ""
    return (f"{wx.workload}: {words}{f', {where},' if where else ''} causes {_pct(top.share)} of the "
            f"{ex.recomputed_tokens:,} recomputed tokens; removing it would take the hit rate from "
            f"{_pct(ex.hit_rate)} to {_pct(top.what_if_hit_rate)}{cache}{measured}{rest}.")


def new_token_share(ex: Explanation) -> float:
    """The share of prompt tokens no cache could serve (glossary: new tokens, with the partial last block a
    request had before): prompt − cached − recomputed, over prompt."""
    return 1.0 - (ex.cached_tokens + ex.recomputed_tokens) / ex.prompt_tokens if ex.prompt_tokens else math.nan


def _rest_of_gap(wx: WorkloadExplanation, ref: WorkloadExplanation | None, what_if: float | None) -> str:
    """Why undoing the cause does not reach the reference workload's hit rate, where it does not (more than a
    percentage point short): the habit leaves more new tokens, which no cache serves (compaction's rewritten
    history is new once, then repeated shorter). Empty where the what-if reaches the reference."""
    if ref is None or what_if is None or ref.explanation.hit_rate - what_if <= 0.01:
        return ""
    mine, theirs = new_token_share(wx.explanation), new_token_share(ref.explanation)
    if not (math.isfinite(mine) and math.isfinite(theirs)) or mine <= theirs:
        return ""
    return (f"; the rest of the gap to {_pct(ref.explanation.hit_rate)} is not recomputation: {_pct(mine)} of "
            f"{wx.workload}'s prompt tokens are new (no earlier request had them, so no cache serves them: text the "
            f"habit rewrites is new once) against {_pct(theirs)} of {ref.workload}'s")


def recomputed_title(explained: list[WorkloadExplanation]) -> str:
    """The recomputed-tokens figure's title: the costliest cause of the costliest workload, as a finding."""
    worst = max(explained, key=lambda wx: wx.explanation.recomputed_tokens, default=None)
    if worst is None or not worst.explanation.causes:
        return "Nothing was recomputed"
    top = worst.explanation.causes[0]
    return f"{worst.workload}: {top.cause.replace('_', ' ')} causes {_pct(top.share)} of the recomputed tokens"


def what_if_title(explained: list[WorkloadExplanation]) -> str:
    """The what-if figure's title: the largest gain from removing one cause."""
    best = max(((wx, c) for wx in explained for c in wx.explanation.causes),
               key=lambda t: t[1].what_if_hit_rate - t[0].explanation.hit_rate, default=None)
    if best is None:
        return "No cause to remove"
    wx, c = best
    pool = "" if c.what_if_hit_rate_pool is None else f", {_pct(c.what_if_hit_rate_pool)} at the run's KV pool"
    rates = f"from {_pct(wx.explanation.hit_rate)} to {_pct(c.what_if_hit_rate)}"
    if c.cause == Cause.REPLAY_SUBSTITUTED_OUTPUT:
        return f"Replaying {wx.workload} live (the server's own answers in the history) would take its hit rate {rates}"
    return (f"Removing {c.cause.replace('_', ' ')} from {wx.workload} would take its hit rate {rates} "
            f"with an infinite cache{pool}")


def explain_findings(explained: list[WorkloadExplanation], max_causes: int = 2) -> list[Finding]:
    """The page's two to four findings: the costliest causes (the first one a headline ``habit`` finding), the
    workloads with nothing recomputed, and provider cache reads against the provider model."""
    if not explained:
        return [Finding(question="cache_break", notebook=NOTEBOOK,
                        sentence="No workload trace is in this experiment: there is nothing to attribute.")]
    ranked = sorted(explained, key=lambda wx: -wx.explanation.recomputed_tokens)
    out: list[Finding] = []
    for wx in ranked[:max_causes]:
        sentence = cause_sentence(wx, explained)
        if sentence is None:
            continue
        top, ex = wx.explanation.causes[0], wx.explanation
        habit = top.cause not in RUN_SHORTFALLS and not any(f.question == "habit" for f in out)
        out.append(Finding(question="habit" if habit else "cache_break", sentence=sentence, notebook=NOTEBOOK,
                           figure="recomputed_by_cause",
                           numbers={"recomputed_tokens": float(ex.recomputed_tokens), "share": top.share,
                                    "hit_rate": ex.hit_rate, "what_if_hit_rate": top.what_if_hit_rate,
                                    "what_if_hit_rate_pool": top.what_if_hit_rate_pool}))
    clean = [wx for wx in explained if not wx.explanation.recomputed_tokens]
    if clean:
        names = ", ".join(f"{wx.workload} (hit rate {_pct(wx.explanation.hit_rate)})" for wx in clean)
        out.append(Finding(question="cache_break", notebook=NOTEBOOK,
                           sentence=f"Nothing recomputed in {names}: every token an earlier request already had "
                                    "came from the cache.",
                           numbers={f"hit_rate_{wx.workload}": wx.explanation.hit_rate for wx in clean}))
    out += _provider_findings(explained)
    return out[:4]


def _provider_findings(explained: list[WorkloadExplanation]) -> list[Finding]:
    _, agreements = provider_frame(explained)
    out = []
    for workload, ag in list(agreements.items())[:1]:
        if ag.mean_abs_share_gap_pp is not None:
            how = (f"differ from the {ag.preset} cache model's by {ag.mean_abs_share_gap_pp:.1f} percentage points "
                   f"on average over {ag.shares_compared} requests (as shares of each side's prompt)")
        else:
            how = f"match the {ag.preset} cache model's exactly on {ag.exact} of {ag.requests} requests"
        out.append(Finding(question="cache_break", notebook=NOTEBOOK, figure=None,
                           sentence=f"{workload}: the observed provider cache reads {how}.",
                           numbers={"mean_abs_share_gap_pp": ag.mean_abs_share_gap_pp, "exact": float(ag.exact),
                                    "requests": float(ag.requests)}))
    return out
