"""Validation of the scheduler model against live runs (tests/test_scheduler_vs_vllm.py,
benchmarks/capacity_predict.py): one closed-loop replay per level, and what the model predicts for it.

Apart from ``calibrate.py`` because it drives a whole replay (``runner.replay``), and the runner itself uses
the calibration (``--calibrate``): kept together, the two modules imported each other.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from kvscope.harness.replay.priority import DEFAULT_CLIENT_PRIORITY, ClientPriority
from kvscope.harness.results.schemas import CalibrationFile
from kvscope.harness.serving.backend import DEFAULT_BACKEND, Backend
from kvscope.harness.cachemodel.trace_io import load_trace
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.predict import replay_informed_cached_tokens
from kvscope.harness.replay.runner import replay



def measure_level(trace_dir: str | Path, endpoint: str, concurrency: int, run_dir: str | Path,
                  time_scale: float = 0.0, backend: str = DEFAULT_BACKEND,
                  client_priority_mode: ClientPriority = DEFAULT_CLIENT_PRIORITY):
    """Replay the trace closed-loop at ``concurrency`` (recorded mode, fresh prefix cache); returns
    (the run's requests.parquet as a DataFrame, preemptions during the run, load average after)."""
    server = Backend.create(backend, endpoint=endpoint)
    before = server.preemptions_total()
    opts = ReplayOptions(concurrency=concurrency, time_scale=time_scale, progress=False, predict=False,
                         reset_prefix_cache=True, client_priority=client_priority_mode)
    out = replay(trace_dir, run_dir, opts, backends=[server])
    df = pd.read_parquet(Path(out.run_dir) / "requests.parquet")
    after = server.preemptions_total()
    preempted = after - before if after is not None and before is not None else float("nan")
    return df, preempted, os.getloadavg()[0]


def replay_informed_match(trace_dir: str | Path, records, cal: CalibrationFile, *, pace: bool = True
                          ) -> tuple[int, int, list]:
    """(exactly predicted, requests, predicted per record) of a run's ``cached_tokens`` from its timestamps,
    by :func:`~kvscope.harness.replay.predict.replay_informed_cached_tokens` (its docstring says what it
    models and why) on the trace's prompts (a recorded-mode run's: the output blocks' content unknown).
    ``kvscope replay`` computes the same after a run from the ids it sent and received."""
    by_id = {r.request_id: r for r in load_trace(trace_dir, cal.server.block_size).requests}
    predicted = replay_informed_cached_tokens(records, by_id, cal, pace=pace)
    measured = records.loc[predicted.index, "cached_tokens"].fillna(0).astype(int)
    return int((predicted == measured).sum()), len(measured), predicted.tolist()
