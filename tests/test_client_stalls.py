"""A replay measures its own client's stalls: an event loop held up for 0.35 s is in summary.json and on the
console, because nothing in the request records shows it (the sessions just start late, and the tokens of the
window arrive in one burst)."""

from __future__ import annotations

import time

from kvscope.harness.cli.replay import format_console_summary
from kvscope.harness.replay import runner
from kvscope.harness.replay.request_loop import RequestLoop
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.results.schemas import SummaryFile
from kvscope.workloads.generate import synthetic_trace
from tests.doubles.faultserver import FaultConfig, FaultServer
from kvscope.workloads.versioned_file import read_versioned

HOLD_S = 0.35


def test_a_held_up_event_loop_is_recorded_as_a_client_stall(tmp_path, monkeypatch):
    trace_dir = synthetic_trace(2, steps=4, prompt_tokens=32, output_tokens=4).write(tmp_path / "trace")
    record = RequestLoop._record
    calls = []

    def record_then_hold(self, st, *args, **kwargs):
        record(self, st, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            time.sleep(HOLD_S)  # synchronous work on the loop: what a paused host looks like from inside

    monkeypatch.setattr(RequestLoop, "_record", record_then_hold)
    with FaultServer(FaultConfig(model="tiny", itl_s=0.002)) as server:
        out = runner.replay(trace_dir, tmp_path / "run", ReplayOptions(concurrency=2, progress=False, time_scale=0),
                            endpoints=[server.endpoint])
    client = out.summary["client"]
    assert client["stalls"] >= 1
    assert HOLD_S - 0.05 <= client["stall_max_s"] <= HOLD_S + 0.5
    assert client["stalled_s"] >= client["stall_max_s"]
    start_s, length_s = client["stall_windows_s"][0]
    assert abs(length_s - client["stall_max_s"]) < 1e-3 and 0 < start_s < out.summary["duration_s"]
    assert "client_stalls" in out.summary["data_quality"]["flags"]
    on_disk = read_versioned(out.run_dir / "summary.json", SummaryFile)
    assert on_disk.client.stalls == client["stalls"]
    assert "replay client was held up" in format_console_summary(out.summary)
