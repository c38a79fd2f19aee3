"""The replay client runs its event loop under SCHED_FIFO when asked (replay/priority.py; default normal): the thread is
real-time inside and as before afterwards, threads it starts are not (unless asked), a process that may not
falls back (auto) or gets a one-line error (realtime), and a replay records what it ran under."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.replay import priority
from kvscope.harness.replay.priority import client_priority

needs_sched = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="no POSIX scheduling API here")


def _policy() -> int:
    return os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK


def _may_realtime() -> bool:
    try:
        with client_priority("realtime"):
            return True
    except KvscopeError:
        return False


def _policy_of_a_new_thread() -> int:
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(_policy()))
    t.start()
    t.join()
    return seen[0]


@needs_sched
def test_realtime_inside_normal_after_and_threads_started_inside_stay_normal():
    if not _may_realtime():
        pytest.skip("this process may not use SCHED_FIFO (not root, no CAP_SYS_NICE)")
    before = _policy()
    with client_priority("auto") as got:
        assert got == "realtime"
        assert _policy() == os.SCHED_FIFO
        assert os.sched_getparam(0).sched_priority == priority.REALTIME_PRIORITY
        assert _policy_of_a_new_thread() == os.SCHED_OTHER  # the /metrics parser's threads
        child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                               capture_output=True, text=True, check=True)
        assert int(child.stdout) == os.SCHED_OTHER  # a server launched from the run
    assert _policy() == before
    with client_priority("auto", threads_inherit=True):
        assert _policy_of_a_new_thread() == os.SCHED_FIFO  # the calibration's request threads
    assert _policy() == before


@needs_sched
def test_the_old_policy_comes_back_when_the_block_raises():
    before = (_policy(), os.sched_getparam(0).sched_priority)
    with pytest.raises(RuntimeError), client_priority("auto"):
        raise RuntimeError("boom")
    assert (_policy(), os.sched_getparam(0).sched_priority) == before


@needs_sched
def test_without_permission_auto_runs_normal_and_realtime_is_a_one_line_error(monkeypatch):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with client_priority("auto") as got:
        assert got == "normal"
    with pytest.raises(KvscopeError, match=r"may not use SCHED_FIFO .*root or CAP_SYS_NICE") as exc, \
            client_priority("realtime"):
        pass
    assert "\n" not in str(exc.value)
    with client_priority("normal") as got:
        assert got == "normal"


def test_a_replay_records_the_priority_it_ran_under(tmp_path):
    from kvscope.harness.replay import runner
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.results.schemas import SummaryFile
    from kvscope.workloads.generate import synthetic_trace
    from tests.doubles.faultserver import FaultConfig, FaultServer
    from kvscope.workloads.versioned_file import read_versioned

    trace_dir = synthetic_trace(1, steps=2, prompt_tokens=16, output_tokens=2).write(tmp_path / "trace")
    expected = "realtime" if hasattr(os, "sched_setscheduler") and _may_realtime() else "normal"
    with FaultServer(FaultConfig(model="tiny")) as server:
        for mode, want in (("auto", expected), ("normal", "normal"), (None, "normal")):
            # None: the default, normal: real-time is opt-in (it starved a busy neighbour on a shared core)
            extra = {} if mode is None else {"client_priority": mode}
            out = runner.replay(trace_dir, tmp_path / str(mode), ReplayOptions(concurrency=1, progress=False, **extra),
                                endpoints=[server.endpoint])
            assert out.summary["client"]["priority"] == want
            assert read_versioned(out.run_dir / "summary.json", SummaryFile).client.priority == want



def test_a_calibration_is_timed_under_the_priority_it_is_given(tmp_path, monkeypatch):
    """The calibration follows the replay's choice (default normal), so the two are timed by clients scheduled
    alike."""
    from contextlib import contextmanager

    from kvscope.harness.replay import calibrate
    from kvscope.harness.serving.backend import Backend
    from tests.doubles.faultserver import FaultConfig, FaultServer

    asked = []

    @contextmanager
    def recording(mode, *, threads_inherit=False):
        asked.append(mode)
        raise RuntimeError("stop before measuring")
        yield

    monkeypatch.setattr(calibrate, "client_priority", recording)
    with FaultServer(FaultConfig(model="tiny")) as server:
        for kwargs in ({}, {"client_priority_mode": "realtime"}):
            with pytest.raises(RuntimeError, match="stop before measuring"):
                calibrate.calibrate_server(Backend.create("vllm", endpoint=server.endpoint), tmp_path / "c.json",
                                           **kwargs)
    assert asked == ["normal", "realtime"]


def test_a_speculative_server_is_calibrated_on_longer_decodes(tmp_path):
    """A decode sample of a speculative server spans about as many steps as a plain server's: 64 tokens at
    2-3 a step against 24 at one (24 were 10-13 steps there, and the fit over-predicted its TPOT); both are
    featured from what was sent, so a wrong length would misprice every decode step."""
    from kvscope.harness.replay.calibrate import DECODE_TOKENS, SPECULATIVE_DECODE_TOKENS, measure_samples
    from kvscope.harness.results.schemas import CalibrationServer
    from tests.doubles.faultserver import FaultConfig, FaultServer

    lengths = {}
    for speculation in (None, "ngram:k=4,min=2,max=4"):
        with FaultServer(FaultConfig(model="tiny", keep_bodies=True, num_gpu_blocks=64)) as server:
            samples = measure_samples(server.endpoint, "tiny",
                                      CalibrationServer(block_size=16, num_gpu_blocks=64, max_num_seqs=4,
                                                        max_model_len=1024, speculation=speculation),
                                      prefill_lengths=[32], rounds=1)
            lengths[speculation] = {b["max_tokens"] for b in server.bodies} - {1, 2}  # prefills and warm-up
        decodes = [s for s in samples if s.kind == "decode"]
        assert decodes and all(s.steps > 1 for s in decodes)
    assert lengths == {None: {DECODE_TOKENS}, "ngram:k=4,min=2,max=4": {SPECULATIVE_DECODE_TOKENS}}
    assert SPECULATIVE_DECODE_TOKENS >= 2 * DECODE_TOKENS
