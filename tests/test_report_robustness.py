"""`kvscope report` works on every run directory kvscope writes (issue 14): a single replay run, an interrupted
run, a run whose every inter-token gap is 0, a run with failed requests; a corrupted result file is named,
never read as empty.

Each case is a real replay against the loopback fault server, then the report CLI as a user runs it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvscope.workloads.generate import synthetic_trace
from tests.cli import kvscope
from tests.doubles.faultserver import FaultConfig, FaultServer


def replay_args(trace: Path, endpoint: str, out: Path, *extra: str) -> list[str]:
    return ["replay", str(trace), "--endpoint", endpoint, "--out", str(out), "--concurrency", "2",
            "--no-progress", "--no-reset-prefix-cache", *extra]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return synthetic_trace(4, steps=3).write(tmp_path_factory.mktemp("robust") / "trace")


def failed_notebooks(index: Path) -> list[dict]:
    report = json.loads((index.parent / "report.json").read_text())
    return [nb for nb in report["notebooks"] if not nb["ok"]]


def report_of(run: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    r = kvscope("report", str(run))
    index = run / "report" / "index.html"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert index.exists(), r.stderr[-3000:]
    return r, failed_notebooks(index)


def test_report_of_a_single_replay_run(trace, tmp_path):
    with FaultServer(FaultConfig(ttft_s=0.005, itl_s=0.001)) as srv:
        r = kvscope(*replay_args(trace, srv.endpoint, tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-2000:]
    r, failed = report_of(tmp_path / "run")
    assert failed == [], failed
    assert r.returncode == 0


def test_report_of_a_run_whose_token_gaps_are_all_zero(trace, tmp_path):
    with FaultServer(FaultConfig()) as srv:  # zero delays: one write per answer, every ITL 0
        r = kvscope(*replay_args(trace, srv.endpoint, tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-2000:]
    _, failed = report_of(tmp_path / "run")
    assert failed == [], failed


def test_report_of_a_run_with_failed_requests(trace, tmp_path):
    with FaultServer(FaultConfig(fault_rates={"http_500": 0.5}, seed=1)) as srv:
        r = kvscope(*replay_args(trace, srv.endpoint, tmp_path / "run", "--on-error", "continue"))
    assert r.returncode == 1  # over the error threshold: the run says it failed ...
    _, failed = report_of(tmp_path / "run")  # ... and its report still renders
    assert failed == [], failed


def test_report_of_an_interrupted_run(tmp_path):
    slow = synthetic_trace(6, steps=4)
    slow.write(tmp_path / "trace")
    with FaultServer(FaultConfig(ttft_s=0.05, itl_s=0.02)) as srv:
        proc = subprocess.Popen([sys.executable, "-m", "kvscope.harness.cli.main",
                                 *replay_args(tmp_path / "trace", srv.endpoint, tmp_path / "run")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        log = tmp_path / "run" / "requests.jsonl"
        while time.time() < deadline and (not log.exists() or log.stat().st_size == 0):
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]  # interrupted, not finished: no summary, the records kept
    assert not (tmp_path / "run" / "summary.json").exists() and log.stat().st_size > 0
    r, failed = report_of(tmp_path / "run")
    assert failed == [], failed


def test_a_corrupted_requests_file_is_named_not_read_as_empty(trace, tmp_path):
    with FaultServer(FaultConfig()) as srv:
        assert kvscope(*replay_args(trace, srv.endpoint, tmp_path / "run")).returncode == 0
    parquet = tmp_path / "run" / "requests.parquet"
    parquet.write_bytes(parquet.read_bytes()[: parquet.stat().st_size // 2])
    r = kvscope("report", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert str(parquet) in r.stderr.strip().splitlines()[-1]
