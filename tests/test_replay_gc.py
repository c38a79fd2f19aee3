"""A replay leaves the garbage collector as it found it: nothing stays frozen after the run.

The replayer freezes the collector's view for the run (cheaper collections). Left frozen, every object alive
at that moment was never freed: each cell's trace across an experiment, and at interpreter exit triton's
nanobind objects (triton is pulled in by torch when kvscope trains its tiny model), which nanobind reported
as 27 lines of ``nanobind: leaked …`` at the end of ``make demo``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

SCRIPT = """
import gc, sys
from pathlib import Path
if sys.argv[2] == "triton":
    import triton  # noqa: F401 - what torch's optimizer pulls into the kvscope process
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.runner import replay
from kvscope.workloads.generate import synthetic_trace
from tests.doubles.faultserver import FaultConfig, FaultServer

tmp = Path(sys.argv[1])
trace_dir = synthetic_trace(2, steps=2, prompt_tokens=32, output_tokens=4).write(tmp / "trace")
with FaultServer(FaultConfig(model="tiny")) as server:
    replay(trace_dir, tmp / "run", ReplayOptions(concurrency=2, progress=False, time_scale=0),
           endpoints=[server.endpoint])
print("frozen after replay:", gc.get_freeze_count())
"""


def test_replay_unfreezes_the_collector_and_exits_without_leak_reports(tmp_path):
    with_triton = "triton" if importlib.util.find_spec("triton") is not None else "-"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), with_triton], capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "frozen after replay: 0" in r.stdout
    assert "leaked" not in r.stderr, r.stderr[-2000:]
