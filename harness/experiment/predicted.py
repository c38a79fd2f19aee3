"""The experiment's ``predicted:`` phase: each predicted GPU deployment on each workload's prediction trace.

Why after the live phases and from the workloads' own specs: the report then sets "measured on this CPU" and
"predicted on an H100" side by side for the same kind of sessions (the prefix reuse is the workload's, the
hardware the deployment's). The prediction trace is the workload's spec, seed and scales with
``predicted.sessions`` sessions (``predictions/traces/<workload>/``), not the live cells' few: a closed loop
cannot load a GPU with more sessions than its trace has, and a capacity that was never driven answers nothing.
The prediction is the one ``kvscope predict`` makes
(:func:`kvscope.harness.results.gpu_prediction.predict_trace`), closed loop over concurrency with its default
levels (1, 2, 4, ... stopping once a level is past both the SLO capacity and the eviction cliff), the live
cells' replay mode and time scale, and its summary and cost at the SLO capacity; each lands as a typed
``prediction.json`` under ``predictions/<config>/<workload>/`` (found by
:func:`~kvscope.harness.results.loaders.load_experiment_predictions`). A deployment that cannot serve a trace
(e.g. a request longer than its KV pool) is reported in one line and skipped: the live results are never lost
to a prediction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.experiment.spec import ExperimentSpec
from kvscope.harness.experiment.workload_traces import write_workload_trace
from kvscope.harness.results.gpu_prediction import PredictOptions, predict_trace
from kvscope.harness.results.loaders import PREDICTIONS_DIR
from kvscope.harness.results.prediction_file import PREDICTION_NAME, write_prediction_file

#: Where the prediction traces go, under the run's ``predictions/`` (not a configuration name: those are
#: checked names, and the loader reads ``predictions/<config>/<workload>/prediction.json`` only).
PREDICTION_TRACES = "traces"
#: Load levels simulated at once (forked workers): the phase runs after the live cells, when the cores are free.
PREDICT_JOBS = 2


def predict_configurations(spec: ExperimentSpec, run_dir: Path, spec_path: Path, tokenizer_dir: str) -> list[str]:
    """Generate each predicted workload's prediction trace and write every predicted configuration x workload's
    ``prediction.json`` under ``run_dir``; returns one line per prediction (printed by the runner)."""

    if spec.predicted is None:
        return []
    lines = []
    slo_ttft_ms = spec.predicted_slo_ttft_p90_ms()
    levels = [float(x) for x in spec.predicted.levels] if spec.predicted.levels else None
    for wname in spec.predicted_workloads():
        trace_dir = prediction_trace_dir(run_dir, wname)
        try:
            if not (trace_dir / "requests.parquet").exists():  # kept across --resume
                write_workload_trace(spec, wname, spec_path, tokenizer_dir, trace_dir,
                                     sessions=spec.predicted.sessions, max_context=spec.predicted.max_context,
                                     scale=spec.predicted.scale)
        except (ValueError, KvscopeError, OSError) as exc:
            lines.append(f"predicted {wname}: no prediction trace: {exc}")
            continue
        lines.append(f"predicted {wname}: a {trace_sessions(trace_dir)}-session prediction trace "
                     f"(the workload's spec with more sessions)")
        for cname, cfg in spec.predicted.configs.items():
            opts = PredictOptions(
                trace=str(trace_dir), gpu=cfg.gpu, model=cfg.model, tp=cfg.tp, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens, kv_cache_dtype=cfg.kv_cache_dtype,
                gpu_memory_utilization=cfg.gpu_memory_utilization, gpu_hour_usd=cfg.gpu_hour_usd,
                provider=cfg.provider, concurrency=int(levels[0]) if levels else 1, levels=levels,
                mode=spec.replay.mode, time_scale=spec.replay.time_scale, slo_ttft_ms=slo_ttft_ms,
                slo_tpot_ms=spec.predicted.slo_tpot_p50_ms, summary_at_slo_capacity=True, jobs=PREDICT_JOBS,
                progress=False)
            try:
                done = predict_trace(opts)
            except (ValueError, KvscopeError) as exc:
                lines.append(f"predicted {cname} x {wname}: skipped: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 -- a prediction never costs the run its live results
                lines.append(f"predicted {cname} x {wname}: failed: {type(exc).__name__}: {exc}")
                continue
            out = run_dir / PREDICTIONS_DIR / cname / wname  # names checked by the spec (no separators)
            out.mkdir(parents=True, exist_ok=True)
            write_prediction_file(out / PREDICTION_NAME, done.prediction)
            lines.append(summary_line(cname, wname, done.prediction))
    return lines


def prediction_trace_dir(run_dir: Path, workload: str) -> Path:
    """``predictions/traces/<workload>/``: workload ``workload``'s prediction trace."""
    return run_dir / PREDICTIONS_DIR / PREDICTION_TRACES / workload


def trace_sessions(trace_dir: Path) -> int:
    """The trace's session count (trace.json's ``num_sessions``)."""
    return int(json.loads((trace_dir / "trace.json").read_text())["num_sessions"])


def summary_line(config: str, workload: str, p: Any) -> str:
    """``predicted h100-8b x agent-coding (H100 SXM, llama-3.1-8b tp 1): ≥4 sessions under TTFT p90 <= 2000 ms …``"""
    d = p.deployment
    top = p.load_curve[-1].load if p.load_curve else None
    cap = p.slo_capacity_load
    if cap is None:
        fits = "no load meets the SLO"
    else:
        fits = f"{'>=' if cap == top else ''}{cap:g} sessions fit"
    at = next((pt for pt in p.load_curve if pt.load == cap), None)
    lat = "" if at is None else (f" (TTFT p90 {_ms(at.ttft_p90_s)}, TPOT p50 {_ms(at.tpot_p50_s)})")
    cliff = "none" if p.eviction_cliff_load is None else f"at {p.eviction_cliff_load:g}"
    cost = ""
    if p.cost is not None:
        cost = (f"; ${_usd(p.cost.usd_per_mtok_input)}/Mtok in, ${_usd(p.cost.usd_per_mtok_output)}/Mtok out, "
                f"${_usd(p.cost.usd_per_1000_sessions)}/1,000 sessions")
    return (f"predicted {config} x {workload} ({d.gpu}, {d.model}, tp {d.tp}): {fits} under TTFT p90 <= "
            f"{p.slo.ttft_ms:g} ms{lat}; eviction cliff {cliff}{cost}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f} ms"


def _usd(v: float | None) -> str:
    return "-" if v is None else f"{v:,.3f}"
