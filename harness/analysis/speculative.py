"""Predicted speculative decoding for every method, from the traffic itself, and the tables the page shows.

Why here: the offline model (``kvscope.harness.cachemodel.speculative``) gives steps per request; what a reader
compares is one row per method and setting (vLLM's counters and rates, predicted TPOT and output throughput
from a calibration's step costs), beside what the server measured where that method ran live. This module
turns traces and run directories into those rows and into the typed ``speculation.json``
(``kvscope.harness.results.speculation_file``); ``kvscope speculate`` and the speculative page both call it,
so the command line and the report cannot disagree.

A *run* directory is predicted on the tokens its server generated (``output_token_ids`` in its records, kept
since that field exists): the prompt as sent (recorded mode: the trace's; live mode: with its session's
earlier answers as generated) and the generated answer. A *trace* is predicted on its recorded outputs (what
the agent's own model said), which is the question before deploying. An experiment's page predicts each
workload on the tokens one of its cells generated, so the prediction and the server's measured acceptance are
counted on the same tokens (a recorded replay's planned answers are not what the server drafted against).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from kvscope.harness.cachemodel.speculative import (
    NgramConfig,
    OracleConfig,
    SpecConfig,
    RequestSpeculation,
    SpeculationResult,
    SuffixConfig,
    plain_tpot_s,
    predicted_tpot_s,
    simulate,
    simulate_request,
    summarize,
)
from kvscope.harness.cachemodel.spec_predict import speculative_spec_of_vllm
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.results.loaders import load_calibration, load_run_manifest
from kvscope.harness.results.records import read_records
from kvscope.harness.results.speculation_file import MethodPrediction, SpeculationFile
from kvscope.workloads.prefix import Transition
from kvscope.workloads.trace import Trace, TraceBuilder
from kvscope.workloads.trace_schema import SegmentKind

if TYPE_CHECKING:
    from kvscope.harness.cachemodel.calibration import StepCostModel

__all__ = [
    "compare_tpot",
    "default_configs",
    "generated_speculation",
    "load_speculation_input",
    "measured_beside_predicted",
    "position_table",
    "predict_methods",
    "prediction_table",
    "result_row",
    "speculative_configs_of_servers",
]


def default_configs(k: int = 4, windows: Sequence[tuple[int, int]] = ((2, 4), (1, 3))) -> list[SpecConfig]:
    """n-gram at each lookup window, suffix decoding with vLLM's defaults, and the oracle at ``k``."""
    return [*(NgramConfig(k, lo, hi) for lo, hi in windows), SuffixConfig(), OracleConfig(k)]


def _params(cfg: SpecConfig) -> dict[str, float | int]:
    return {k: v for k, v in vars(cfg).items() if k != "method"}


def result_row(res: SpeculationResult, seconds: float, cost: StepCostModel | None = None) -> MethodPrediction:
    s = res.summary()
    tpot = tput = None
    if cost is not None:
        t = np.array([predicted_tpot_s(r, cost) for r in res.requests if r.output_tokens > 1])
        if t.size:
            tpot = float(np.mean(t) * 1e3)
            # decode throughput of one request alone: decode tokens over decode time
            total_tokens = sum(r.output_tokens - 1 for r in res.requests if r.output_tokens > 1)
            total_s = sum(predicted_tpot_s(r, cost) * (r.output_tokens - 1) for r in res.requests
                          if r.output_tokens > 1)
            tput = total_tokens / total_s if total_s > 0 else None
    return MethodPrediction(
        method=res.config.method, label=res.config.label, params=_params(res.config), requests=s["requests"],
        skipped_requests=res.skipped_requests, output_tokens=s["output_tokens"], decode_steps=s["decode_steps"],
        num_drafts=s["num_drafts"], num_draft_tokens=s["num_draft_tokens"],
        num_accepted_tokens=s["num_accepted_tokens"], acceptance_rate=nan_to_none(s["acceptance_rate"], float),
        mean_acceptance_length=nan_to_none(s["mean_acceptance_length"], float),
        accepted_per_position=s["accepted_per_position"],
        acceptance_by_position=[nan_to_none(x, float) for x in s["acceptance_by_position"]],
        tokens_per_step=nan_to_none(s["tokens_per_step"], float),
        draft_share_of_steps=nan_to_none(s["draft_share_of_steps"], float),
        open_ended_requests=s["open_ended_requests"], predicted_tpot_ms_mean=tpot,
        predicted_output_tokens_per_s=tput, seconds=seconds)


def load_speculation_input(path: str | Path) -> Trace:
    """A trace directory as is; a run directory as a trace of the prompts it sent and the tokens its server
    generated. Errors name the path and what is missing."""
    p = Path(path)
    if not p.exists():
        raise KvscopeError(f"{p}: no such trace or run directory")
    if (p / "trace.json").is_file():
        try:
            return Trace.read(p)
        except KvscopeError:
            raise
        except Exception as exc:  # noqa: BLE001 - a malformed trace is one line
            raise KvscopeError(f"{p}: cannot read the trace: {exc}") from None
    if (p / "requests.jsonl").is_file() or (p / "requests.parquet").is_file():
        return _run_as_trace(p)
    raise KvscopeError(f"{p}: neither a trace directory (trace.json) nor a run directory (requests.jsonl)")


def _run_as_trace(run_dir: Path) -> Trace:
    manifest = load_run_manifest(run_dir / "manifest.json")
    trace_path = Path(manifest.trace.path) if getattr(manifest, "trace", None) else None
    if trace_path is None or not (trace_path / "trace.json").is_file():
        raise KvscopeError(f"{run_dir}: the run's trace ({trace_path}) is not there; its prompts are needed")
    trace = Trace.read(trace_path)
    recs = read_records(run_dir)
    if "output_token_ids" not in recs.columns:
        raise KvscopeError(f"{run_dir}: the run's records keep no generated token ids (recorded before "
                           "kvscope kept output_token_ids); give the trace instead")
    live = manifest.options.get("mode") == "live" if isinstance(getattr(manifest, "options", None), dict) else False
    out = generated_trace(trace, recs, live, f"run {run_dir.name}")
    if out is None:
        raise KvscopeError(f"{run_dir}: no successful request with generated token ids")
    return out


def generated_trace(trace: Trace, records: pd.DataFrame, live: bool, name: str) -> Trace | None:
    """The prompts a run of ``trace`` sent and the tokens its server generated, as a trace (None: no successful
    request kept its generated ids). A live run's prompts carry its session's earlier answers as generated
    (:meth:`Trace.live_substitute`, as the replay built them); a recorded run's are the trace's own."""
    recs = records[records["error_class"].isna()] if "error_class" in records else records
    recs = recs.sort_values(["request_id", "attempt"] if "attempt" in recs else ["request_id"]).drop_duplicates(
        "request_id", keep="last")
    generated = {int(r): np.asarray(t if t is not None else [], np.int32)
                 for r, t in zip(recs["request_id"], recs["output_token_ids"])}
    answered = {r: g for r, g in generated.items() if g.size}
    b = TraceBuilder()
    for rid in sorted(answered):
        out = answered[rid]
        row = trace.requests.iloc[rid]
        prompt = trace.prompt_token_ids(rid, trace.live_substitute(rid, answered) if live else None)
        pid = b.shared_segment(prompt, SegmentKind.IMPORTED)
        oid = b.add_segment(out, SegmentKind.ASSISTANT)
        b.add_request(session_id=str(row["session_id"]), step=int(row["step"]), parent_request_id=-1,
                      arrival_s=float(rid), session_start_s=0.0, prompt_segment_ids=[pid], output_segment_id=oid,
                      output_tokens=int(out.size), transition=Transition(row["transition"]))
    if not b.rows:
        return None
    return b.build({"name": name})


def generated_speculation(trace: Trace, records: pd.DataFrame, cfg: SpecConfig, *, live: bool = False,
                          max_model_len: int | None = None) -> dict[int, RequestSpeculation]:
    """Each successful request's decode steps under ``cfg`` on the tokens its server generated (a run's
    records' ``output_token_ids``), by request id; the prompt as sent (recorded mode: the trace's; ``live``:
    the parent's generated answer substituted).  Why the generated tokens: an n-gram proposer drafts against
    the server's own answer, and in a recorded-mode replay that answer is not the trace's.  Each request is
    computed alone, which is exact for n-gram (its proposer sees only the request's own tokens).  Empty where
    the records keep no token ids."""
    if "output_token_ids" not in records.columns or not len(records):
        return {}
    recs = records[records["error_class"].isna()] if "error_class" in records.columns else records
    recs = recs.sort_values(["request_id", "attempt"] if "attempt" in recs.columns else ["request_id"])
    generated = {int(r): np.asarray(t if t is not None else [], np.int32)
                 for r, t in zip(recs["request_id"], recs["output_token_ids"])}
    out: dict[int, RequestSpeculation] = {}
    for rid, tokens in generated.items():
        if tokens.size == 0 or not 0 <= rid < trace.num_requests:
            continue
        sub = None
        if live:
            parent = int(trace.requests["parent_request_id"].iat[rid])
            if parent >= 0 and parent in generated:
                sub = {trace.output_segment_id(parent): generated[parent]}
        out[rid] = simulate_request(trace.prompt_token_ids(rid, sub), tokens, cfg, max_model_len, request_id=rid)
    return out


def recorded_output_lengths(trace: Trace) -> np.ndarray:
    """Recorded output tokens per request (0 where the trace knows only the output length)."""
    out_ids = trace.requests["output_segment_id"].to_numpy(np.int64)
    lengths = np.zeros(len(out_ids), np.int64)
    has = out_ids >= 0
    lengths[has] = trace.segment_lengths()[out_ids[has]]
    return lengths


def longest_sequence_tokens(trace: Trace) -> int:
    """The most tokens one request's context reaches (its prompt and its recorded output)."""
    if not trace.num_requests:
        return 0
    return int((trace.requests["prompt_tokens"].to_numpy(np.int64) + recorded_output_lengths(trace)).max())


def predict_methods(trace: Trace, configs: Sequence[SpecConfig], *, source: str, max_model_len: int | None = None,
                    calibration: str | Path | None = None, progress: bool = False) -> SpeculationFile:
    """Every config over ``trace``; with a calibration, predicted TPOT and throughput from its step costs."""
    cost = None
    baseline = None
    if calibration is not None:
        cost = load_calibration(calibration).cost_model()
        tp = [plain_tpot_s(int(P), int(n), cost) for P, n in
              zip(trace.requests["prompt_tokens"], trace.requests["output_tokens"]) if int(n) > 1]
        baseline = float(np.mean(tp) * 1e3) if tp else None
    rows = []
    for cfg in configs:
        t0 = time.perf_counter()
        res = simulate(trace, cfg, max_model_len, progress)
        rows.append(result_row(res, time.perf_counter() - t0, cost))
    return SpeculationFile(trace=str(source), trace_name=str(trace.meta.get("name") or "") or None,
                           max_model_len=max_model_len, calibration=str(calibration) if calibration else None,
                           baseline_tpot_ms_mean=baseline, methods=rows)


def prediction_table(data: SpeculationFile | Sequence[SpeculationFile]) -> pd.DataFrame:
    """One row per trace x method: acceptance rate, mean acceptance length, tokens per step, TPOT."""
    files = [data] if isinstance(data, SpeculationFile) else list(data)
    rows = []
    for f in files:
        for m in f.methods:
            rows.append({"trace": f.trace_name or f.trace, "tokens": f.trace, "method": m.method, "setting": m.label,
                         "requests": m.requests, "acceptance_rate": m.acceptance_rate,
                         "mean_acceptance_length": m.mean_acceptance_length, "tokens_per_step": m.tokens_per_step,
                         "draft_share_of_steps": m.draft_share_of_steps,
                         "predicted_tpot_ms": m.predicted_tpot_ms_mean,
                         "predicted_speedup": (f.baseline_tpot_ms_mean / m.predicted_tpot_ms_mean
                                               if f.baseline_tpot_ms_mean and m.predicted_tpot_ms_mean else None)})
    return pd.DataFrame(rows)


def position_table(data: SpeculationFile | Sequence[SpeculationFile]) -> pd.DataFrame:
    """Long table: acceptance at each draft position (accepted at i / steps that drafted), per method."""
    files = [data] if isinstance(data, SpeculationFile) else list(data)
    rows = []
    for f in files:
        for m in f.methods:
            for i, a in enumerate(m.acceptance_by_position):
                rows.append({"trace": f.trace_name or f.trace, "setting": m.label, "position": i, "acceptance": a})
    return pd.DataFrame(rows)


def speculative_configs_of_servers(servers: dict[str, dict | None]) -> dict[str, SpecConfig]:
    """The n-gram servers of an experiment (server name -> its ``speculative_config``) as model configs."""
    out: dict[str, SpecConfig] = {}
    for name, sc in servers.items():
        spec = speculative_spec_of_vllm(sc)
        if spec is not None:
            out[name] = spec.offline_config()
    return out


def measured_beside_predicted(measured: pd.DataFrame, predicted: pd.DataFrame) -> pd.DataFrame:
    """The speculative page's table: per workload, the server's measured acceptance (``speculative_table``
    rows: workload, server, acceptance_rate, mean_acceptance_length) and every predicted method's."""
    m = measured[["workload", "server", "acceptance_rate", "mean_acceptance_length"]].copy() \
        if len(measured) else pd.DataFrame(columns=["workload", "server", "acceptance_rate", "mean_acceptance_length"])
    m = m.groupby(["workload", "server"], as_index=False).mean(numeric_only=True)
    m.insert(2, "source", "measured")
    m = m.rename(columns={"server": "setting"})
    p = predicted.rename(columns={"trace": "workload"})[["workload", "setting", "acceptance_rate",
                                                         "mean_acceptance_length"]].copy()
    p.insert(2, "source", "predicted")
    return pd.concat([m, p], ignore_index=True).sort_values(["workload", "source", "setting"]).reset_index(drop=True)


def _server_spec_config(res, server: str) -> dict | None:
    """The speculative config a server ran with: its config as launched, else what its facts say."""
    entry = res.server(server)
    if entry is None:
        return None
    return entry.config.get("speculative_config") or (entry.facts.speculative if entry.facts else None)


def _server_max_model_len(res, server: str) -> int | None:
    entry = res.server(server)
    if entry is None:
        return None
    return entry.config.get("max_model_len") or (entry.facts.max_model_len if entry.facts else None)


def _cell_trace(res, cell: str, cache: dict[str, Trace | None]) -> Trace | None:
    """A cell's run as a trace of the tokens it sent and generated (:func:`_run_as_trace`), read once per page."""
    if cell not in cache:
        cell_dir = res.cell_dirs.get(cell)
        try:
            cache[cell] = None if cell_dir is None else _run_as_trace(Path(cell_dir))
        except KvscopeError:
            cache[cell] = None
    return cache[cell]


def _generated_tokens_of(res, workload: str, cache: dict[str, Trace | None]) -> tuple[str, Trace] | None:
    """(cell, its run as a trace of the tokens sent and generated) for the workload's first ok cell whose records
    keep the generated ids: a speculative cell first (lowest load, first repeat), so the predicted row of its
    configuration is on the very tokens its measured acceptance counts; None where no cell kept them."""
    c = res.cells
    if not len(c) or "workload" not in c:
        return None
    sel = c[c["workload"].astype(str) == workload]
    if "status" in sel:
        sel = sel[sel["status"] == "ok"]
    plain = ~sel["speculative"].fillna(False).astype(bool) if "speculative" in sel else True
    sel = sel.assign(_plain=plain, _c=pd.to_numeric(sel.get("concurrency", 0), errors="coerce"),
                     _r=pd.to_numeric(sel.get("repeat", 0), errors="coerce"))
    for _, row in sel.sort_values(["_plain", "_c", "_r", "cell"], na_position="last").iterrows():
        trace = _cell_trace(res, str(row["cell"]), cache)
        if trace is not None:
            return str(row["cell"]), trace
    return None


def experiment_predictions(res, k: int = 4) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The speculative page's data for an experiment (or a single run):

    * every method predicted per workload (n-gram at the experiment's own settings and at k with lookup 2-4
      and 1-3, suffix decoding, oracle) on the tokens one of its cells sent and its server generated
      (:func:`_generated_tokens_of`): the tokens the measured acceptance is counted on, so predicted and
      measured compare; on the trace's recorded outputs only where no cell kept its generated ids (the
      ``tokens`` column says which);
    * acceptance by position for the same;
    * each speculative cell's measured acceptance beside the model's prediction of that same configuration on
      the tokens the server generated in that cell (``output_token_ids``), where the records keep them.
    """
    if res is None:
        return pd.DataFrame(), pd.DataFrame(), pd.DataFrame()
    cells = res.cells
    servers = sorted(set(cells["server"])) if len(cells) else []
    own = speculative_configs_of_servers({s: _server_spec_config(res, s) for s in servers})
    configs: list[SpecConfig] = list(dict.fromkeys([*own.values(), *default_configs(k)]))
    files = []
    workloads = sorted(set(cells["workload"])) if len(cells) else []
    generated: dict[str, Trace | None] = {}  # cell -> its run as a trace of the tokens sent and generated

    for w in workloads:
        td = res.trace_dir(w)
        if td is None or not (Path(td) / "trace.json").is_file():
            continue
        trace = Trace.read(td)
        if (trace.requests["output_segment_id"] < 0).all():
            continue
        tokens, source = _generated_tokens_of(res, w, generated), str(td)
        if tokens is not None:
            cell, trace = tokens
            source = f"{cell}: the tokens its server generated"
        f = predict_methods(trace, configs, source=source)
        f.trace_name = w
        files.append(f)
    rows = []
    if len(cells) and "speculative" in cells:
        for _, c in cells[cells["speculative"] == True].iterrows():
            cfg = own.get(c["server"])
            trace = _cell_trace(res, str(c["cell"]), generated) if cfg is not None else None
            if trace is None:
                continue
            s = simulate(trace, cfg, _server_max_model_len(res, c["server"])).summary()
            rows.append({"cell": c["cell"], "server": c["server"], "workload": c["workload"],
                         "measured_acceptance_rate": c.get("spec_acceptance_rate"),
                         "predicted_acceptance_rate": s["acceptance_rate"],
                         "measured_mean_acceptance_length": c.get("spec_mean_acceptance_length"),
                         "predicted_mean_acceptance_length": s["mean_acceptance_length"]})
    return (prediction_table(files) if files else pd.DataFrame(), position_table(files) if files else pd.DataFrame(),
            pd.DataFrame(rows))


def compare_tpot(trace_dir: str | Path, records: pd.DataFrame, cal, *, concurrency: int,
                 time_scale: float = 0.0, mode: str = "recorded") -> dict:
    """A closed-loop run of a speculative server (its records) beside the scheduler model's prediction of it:
    the calibration's step costs (``cal``, a ``CalibrationFile`` of that server, ``server.speculation`` set)
    and each request's drafts and accepted tokens from the offline model on the tokens the server generated.
    TPOT per request is ``(e2e - ttft) / (output_tokens - 1)`` on both sides, over the requests that emitted
    two tokens or more.  Also the same prediction with the speculative step costs left out (drafts costed as
    tokens only), which is what the calibration's two speculative coefficients add."""
    from dataclasses import replace

    from kvscope.harness.cachemodel.capacity_model import prompt_blocks_only
    from kvscope.harness.cachemodel.gpu_predict import attach_speculation
    from kvscope.harness.cachemodel.scheduler import SessionTiming, run_scheduler
    from kvscope.harness.cachemodel.spec_predict import parse_speculative
    from kvscope.harness.cachemodel.trace_io import load_trace

    if not cal.server.speculation:
        raise KvscopeError("the calibration is of a server without speculative decoding the offline model computes")
    cfg = parse_speculative(cal.server.speculation).offline_config()
    trace = Trace.read(trace_dir)
    spec = generated_speculation(trace, records, cfg, live=mode == "live", max_model_len=cal.server.max_model_len)
    sched = cal.scheduler_config()
    requests = load_trace(trace_dir, sched.block_size).requests
    if mode == "recorded":
        requests = prompt_blocks_only(requests, sched.block_size)
    requests = attach_speculation(requests, {rid: (s.drafted, s.accepted) for rid, s in spec.items()})
    timing = SessionTiming(concurrency=concurrency, time_scale=time_scale)
    cost = cal.cost_model()

    def tpots(step_cost) -> dict[int, float]:
        run = run_scheduler(requests, sched, step_cost, timing)
        return {r.request_id: (r.done_s - r.first_token_s) / (r.output_tokens - 1) for r in run.results
                if r.output_tokens > 1}

    predicted = tpots(cost)
    plain_cost = tpots(replace(cost, per_spec_step_s=0.0, per_draft_token_s=0.0))
    ok = records[records["error_class"].isna()] if "error_class" in records.columns else records
    measured = {int(r): float(t) for r, t in zip(ok["request_id"], ok["tpot_s"])
                if t is not None and np.isfinite(t) and int(r) in predicted}
    ids = sorted(measured)
    m = np.array([measured[i] for i in ids])
    p = np.array([predicted[i] for i in ids])
    q = np.array([plain_cost[i] for i in ids])
    summary = summarize([spec[i] for i in ids if i in spec], cfg.max_drafts)
    return {"concurrency": concurrency, "requests": len(ids),
            "measured_tpot_p50_ms": float(np.median(m) * 1e3), "predicted_tpot_p50_ms": float(np.median(p) * 1e3),
            "tpot_p50_error": float(np.median(p) / np.median(m) - 1.0),
            "measured_tpot_mean_ms": float(m.mean() * 1e3), "predicted_tpot_mean_ms": float(p.mean() * 1e3),
            "predicted_tpot_p50_no_spec_cost_ms": float(np.median(q) * 1e3),
            "acceptance_rate": nan_to_none(summary["acceptance_rate"], float),
            "tokens_per_step": nan_to_none(summary["tokens_per_step"], float)}
