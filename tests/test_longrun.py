"""Long runs keep memory bounded: records and the /metrics series stream to disk, nothing per request is retained."""

from __future__ import annotations

import gc

import pandas as pd

from kvscope.workloads.generate import synthetic_trace
from tests.doubles.faultserver import FaultConfig, FaultServer
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.results.records import read_records
from kvscope.harness.replay.runner import Replayer, replay


def test_replay_retains_nothing_per_request(tmp_path, monkeypatch):
    """After 4,000 requests the Replayer holds no per-request results; memory figures are the benchmark's job
    (benchmarks/longrun_memory.py), here we count the objects that would grow."""
    from kvscope.harness.serving.request import CompletionResult

    seen: dict = {}
    orig_run = Replayer.run
    gc.collect()
    # Results kept alive by earlier tests in this process (fixtures, tracebacks) are not this replay's: hold them
    # so their ids stay unique, and count only the new ones.
    before = [o for o in gc.get_objects() if isinstance(o, CompletionResult)]
    before_ids = {id(o) for o in before}

    async def spy(self):
        st = await orig_run(self)
        gc.collect()
        seen["results_alive"] = sum(1 for o in gc.get_objects()
                                    if isinstance(o, CompletionResult) and id(o) not in before_ids)
        seen["watch_rows_in_memory"] = len(self.watcher.rows)
        seen["watch_rows"] = self.watcher.row_count
        seen["pending_records"] = len(self.writer._pending)
        return st

    monkeypatch.setattr(Replayer, "run", spy)
    trace_dir = synthetic_trace(100, steps=40).write(tmp_path / "trace")
    with FaultServer(FaultConfig()) as srv:
        out = replay(trace_dir, tmp_path / "run", ReplayOptions(concurrency=64, time_scale=0.0, progress=False,
                                                                scrape_interval_s=0.001),
                     endpoints=[srv.endpoint])
    assert out.summary["requests"]["ok"] == 4000 == len(read_records(tmp_path / "run"))
    assert seen["results_alive"] == 0 and seen["pending_records"] == 0
    assert seen["watch_rows_in_memory"] <= 120
    series = pd.read_parquet(tmp_path / "run" / "server_metrics.parquet")
    assert len(series) == seen["watch_rows"] >= 2
