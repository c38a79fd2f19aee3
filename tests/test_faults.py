"""Issue #7: every fault mode of the mock server, driven through the real replay path, is recorded with the right
error class; the run never crashes or hangs; records == requests sent; bad input is caught before sending."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvscope.harness.common.errors import KvscopeError
from kvscope.workloads.generate import synthetic_trace
from tests.doubles.faultserver import FaultConfig, FaultServer
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.results.records import read_records
from kvscope.harness.replay.runner import replay

REPO = Path(__file__).resolve().parents[1]

# fault mode -> (error_class recorded, http_status recorded)
EXPECTED = {
    "reset_before": ("connection_error", None),
    "reset_mid": ("stream_interrupted", 200),
    "http_429": ("http_429", 429),
    "http_500": ("http_500", 500),
    "http_503": ("http_503", 503),
    "http_429_empty": ("http_429", 429),
    "http_500_empty": ("http_500", 500),
    "http_503_empty": ("http_503", 503),
    "stall_headers": ("first_token_timeout", None),
    "stall_before": ("first_token_timeout", 200),
    "stall_mid": ("idle_timeout", 200),
    "malformed_sse": ("malformed_stream", 200),
    "invalid_json": ("malformed_stream", 200),
    "error_event": ("server_error", 200),
    "no_usage": ("missing_usage", 200),
    "no_done": ("truncated_stream", 200),
}
MARK = {mode: 10 + i for i, mode in enumerate([*EXPECTED, "extra_tokens", "fewer_tokens", "close_after"])}


def _opts(**kw) -> ReplayOptions:
    base = dict(concurrency=4, time_scale=0.0, progress=False, scrape_interval_s=0.2, on_error="continue",
                first_token_timeout_s=2.0, idle_timeout_s=1.0, total_timeout_s=10.0, connect_timeout_s=2.0)
    base.update(kw)
    return ReplayOptions(**base)


@pytest.fixture(params=["fast", "aiohttp"])
def client(request) -> str:
    return request.param


def test_every_fault_mode_is_recorded_with_its_class(tmp_path, client):
    # aiohttp does not resend a POST that met a keep-alive connection the server had just closed (close_after);
    # the built-in client does (clean FIN, nothing answered), so only it gets that mode.
    modes = [m for m in MARK if client == "fast" or m != "close_after"]
    per_mode = 2
    # session s, step k: every mode twice, interleaved with normal requests
    plan = {}
    for i, mode in enumerate(modes * per_mode):
        plan[(i, 1)] = MARK[mode]
    trace = synthetic_trace(len(modes) * per_mode, steps=3, last_tokens=lambda s, k: plan.get((s, k)))
    trace_dir = trace.write(tmp_path / "trace")
    cfg = FaultConfig(token_faults={v: k for k, v in MARK.items()})
    with FaultServer(cfg) as srv:
        t0 = time.time()
        out = replay(trace_dir, tmp_path / "run", _opts(client=client), endpoints=[srv.endpoint])
        elapsed = time.time() - t0
        received = srv.stats.completions
    df = read_records(tmp_path / "run")
    assert out.aborted is None
    assert len(df) == trace.num_requests == received == out.summary["requests"]["sent"]
    assert sorted(df["request_id"]) == list(range(trace.num_requests))
    marked = df[df["step"] == 1].copy()
    marked["mode"] = [modes[int(s[1:]) % len(modes)] for s in marked["session_id"]]
    for mode, (cls, status) in EXPECTED.items():
        rows = marked[marked["mode"] == mode]
        assert len(rows) == per_mode
        assert (rows["error_class"] == cls).all(), (mode, rows[["error_class", "error"]].to_dict("records"))
        if status is None:
            assert rows["http_status"].isna().all(), mode
        else:
            assert (rows["http_status"] == status).all(), mode
        assert rows["error"].notna().all() and rows["sent_s"].notna().all() and rows["done_s"].notna().all()
    for mode in ("extra_tokens", "fewer_tokens"):
        rows = marked[marked["mode"] == mode]
        assert rows["error_class"].isna().all() and rows["length_mismatch"].all(), mode
    fine = df[df["step"] != 1]
    assert fine["error_class"].isna().all() and not fine["length_mismatch"].any()
    close_rows = marked[marked["mode"] == "close_after"]
    assert close_rows["error_class"].isna().all() and not close_rows["length_mismatch"].any()
    # statistics come from successful requests; the error rate is reported beside them
    s = out.summary["requests"]
    n_failed = len(EXPECTED) * per_mode
    assert s["failed"] == n_failed and s["ok"] == len(df) - n_failed
    assert s["error_rate"] == pytest.approx(n_failed / len(df))
    assert s["length_mismatch"] == 2 * per_mode
    assert sum(s["errors_by_class"].values()) == n_failed
    assert out.summary["latency"]["ttft_s"]["count"] == s["ok"]
    # timeouts bound the stalls: 2x stall_headers/before (2 s) + 2x stall_mid (1 s) over 4 workers
    assert elapsed < 60


def test_random_faults_at_concurrency_never_lose_a_record(tmp_path):
    rates = {"reset_mid": 0.03, "reset_before": 0.03, "http_503": 0.03, "malformed_sse": 0.03, "no_usage": 0.03,
             "stall_mid": 0.01, "extra_tokens": 0.03}
    trace_dir = synthetic_trace(150, steps=4, seed=3).write(tmp_path / "trace")
    with FaultServer(FaultConfig(fault_rates=rates, seed=7)) as srv:
        out = replay(trace_dir, tmp_path / "run", _opts(concurrency=32), endpoints=[srv.endpoint])
        received = srv.stats.completions
        by_fault = dict(srv.stats.by_fault)
    df = read_records(tmp_path / "run")
    assert len(df) == received == 600
    failed = df[df["error_class"].notna()]
    n_fault = sum(v for k, v in by_fault.items() if k not in ("ok", "extra_tokens"))
    assert len(failed) == n_fault
    assert int(df["length_mismatch"].sum()) == by_fault.get("extra_tokens", 0)
    assert out.summary["requests"]["errors_by_class"].get("stream_interrupted") == by_fault.get("reset_mid")


def test_retries_are_separate_records(tmp_path):
    trace_dir = synthetic_trace(3, steps=2).write(tmp_path / "trace")
    # requests arrive one at a time: #0 fails twice, then succeeds on the second retry
    cfg = FaultConfig(schedule={0: "http_503", 1: "reset_before", 4: "http_429"})
    with FaultServer(cfg) as srv:
        out = replay(trace_dir, tmp_path / "run", _opts(concurrency=1, retries=2, retry_backoff_s=0.01),
                     endpoints=[srv.endpoint])
        received = srv.stats.completions
    df = read_records(tmp_path / "run").sort_values("sent_s")
    assert len(df) == received == 6 + 3
    first = df[df["request_id"] == 0]
    assert first["attempt"].tolist() == [0, 1, 2]
    assert first["error_class"].tolist()[:2] == ["http_503", "connection_error"]
    assert pd.isna(first["error_class"].tolist()[2])
    assert out.summary["requests"]["retries"] == 3
    assert df["error_class"].isna().sum() == 6  # every request finally succeeded


def test_server_dying_mid_run_ends_the_run_with_a_clear_message(tmp_path):
    trace_dir = synthetic_trace(40, steps=5).write(tmp_path / "trace")
    with FaultServer(FaultConfig(schedule={30: "die"})) as srv:
        out = replay(trace_dir, tmp_path / "run", _opts(concurrency=4), endpoints=[srv.endpoint])
    assert out.aborted and "server stopped answering" in out.aborted
    df = read_records(tmp_path / "run")
    assert (df["error_class"].isna()).sum() >= 26
    assert len(df) < 200 and df["error_class"].notna().any()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["aborted"] == out.aborted


def test_connection_refused_is_recorded_then_aborts(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trace_dir = synthetic_trace(4, steps=2).write(tmp_path / "trace")
    srv = FaultServer(FaultConfig(schedule={0: "die"})).start()
    try:
        out = replay(trace_dir, tmp_path / "run", _opts(concurrency=1), endpoints=[srv.endpoint])
    finally:
        srv.stop()
    df = read_records(tmp_path / "run")
    assert out.aborted and len(df) == 1 and df["error_class"].iloc[0] in ("connection_error", "stream_interrupted")
    assert port > 0


def test_token_ids_outside_the_vocabulary_are_caught_before_sending(tmp_path):
    trace = synthetic_trace(2, steps=1, vocab_size=9000)  # ids up to 8999, trace says vocab 9000
    trace_dir = trace.write(tmp_path / "trace")
    with FaultServer(FaultConfig(vocab_size=8192)) as srv:  # the endpoint exposes a smaller vocabulary
        with pytest.raises(KvscopeError, match=r"outside the model's vocabulary.*8192"):
            replay(trace_dir, tmp_path / "run", _opts(), endpoints=[srv.endpoint])
        assert srv.stats.completions == 0
    # the trace's own tokenizer vocabulary
    meta = json.loads((trace_dir / "trace.json").read_text())
    meta["tokenizer"]["vocab_size"] = 500
    (trace_dir / "trace.json").write_text(json.dumps(meta))
    with FaultServer(FaultConfig(vocab_size=None)) as srv:
        with pytest.raises(KvscopeError, match=r"vocabulary of 500 from the trace's tokenizer"):
            replay(trace_dir, tmp_path / "run2", _opts(), endpoints=[srv.endpoint])
        assert srv.stats.completions == 0


def test_vocab_from_a_launched_servers_config_json(tmp_path):
    from kvscope.harness.replay.servers import check_vocab
    from kvscope.harness.results.summary_parts import ServerFacts

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    trace = synthetic_trace(1, steps=1, vocab_size=2000)
    trace.meta["tokenizer"] = None
    with pytest.raises(KvscopeError, match="config.json"):
        check_vocab(trace, [ServerFacts(config={"model": str(model)})])
    check_vocab(synthetic_trace(1, steps=1, vocab_size=900), [ServerFacts(config={"model": str(model)})])


def _write_trace_dir(tmp_path: Path, n: int) -> Path:
    return synthetic_trace(n, steps=4).write(tmp_path / "trace")


def test_sigkill_of_kvscope_mid_replay_keeps_every_record_written(tmp_path):
    trace_dir = _write_trace_dir(tmp_path, 200)
    run_dir = tmp_path / "run"
    with FaultServer(FaultConfig(ttft_s=0.01, itl_s=0.002)) as srv:
        proc = subprocess.Popen([sys.executable, "-m", "kvscope.harness.cli.main", "replay", str(trace_dir), "--endpoint",
                                 srv.endpoint, "--out", str(run_dir), "--concurrency", "8", "--time-scale", "0",
                                 "--no-progress"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        jl = run_dir / "requests.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if jl.exists() and jl.read_bytes().count(b"\n") >= 40:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        sent = srv.stats.completions
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "requests.parquet").exists()
    raw = jl.read_bytes()
    assert raw.endswith(b"\n")  # whole lines only: no torn record
    lines = raw.splitlines()
    rows = [json.loads(x) for x in lines]
    assert len(rows) >= 40
    df = read_records(run_dir)  # the partial run reads from the JSONL
    assert len(df) == len(rows) and df["error_class"].isna().all()
    assert len(df) <= sent  # in-flight requests at the kill have no record; nothing else is missing
    assert sent - len(df) <= 8 + 256  # at most the in-flight requests and one unflushed batch
    assert df["itl_s"].map(len).eq(15).all()


def test_fault_server_command_line_and_die_exits(tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "tests.doubles.faultserver", "--port-file", str(port_file),
                             "--schedule", "1=die"], cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while not port_file.exists():
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
        port = int(port_file.read_text())
        import httpx

        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["vocab_size"] == 8192
        body = {"model": "mock", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
        assert r.status_code == 200 and r.text.count("data:") == 4 + 2
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
        assert proc.wait(10) == 3
    finally:
        if proc.poll() is None:
            proc.kill()


def test_fault_server_rejects_non_loopback():
    with pytest.raises(ValueError, match="loopback"):
        FaultServer(host="0.0.0.0")
    with pytest.raises(ValueError, match="unknown fault mode"):
        FaultConfig(schedule={0: "explode"})


def test_metrics_watcher_spools_rows_and_keeps_memory_bounded(tmp_path):
    import asyncio

    import aiohttp

    from kvscope.harness.replay.watch import MetricsWatcher

    async def go(endpoint: str) -> MetricsWatcher:
        w = MetricsWatcher([endpoint], interval_s=0.01, spool_path=tmp_path / "m.jsonl", keep_rows=5)
        async with aiohttp.ClientSession() as s:
            for _ in range(30):
                await w.scrape_once(s)
        return w

    with FaultServer() as srv:
        w = asyncio.run(go(srv.endpoint))
    assert w.row_count == 30 and len(w.rows) == 5
    out = w.write(tmp_path)
    assert len(pd.read_parquet(out)) == 30
    assert np.isfinite(w.latest()["t_s"])
