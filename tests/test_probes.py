"""Hostile-user probes (issue 14): every bad input ends in one `kvscope: error:` line naming the file, field or
flag and what is allowed, exit code 2, no traceback; failed runs exit non-zero and say why in one line.

Each probe runs the CLI as a subprocess, the way a user meets it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvscope.workloads.generate import synthetic_trace
from tests.cli import assert_bad_input, kvscope
from tests.doubles.faultserver import FaultConfig, FaultServer




@pytest.fixture(scope="module")
def trace_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from kvscope.workloads.generate import generate_from_file

    out = tmp_path_factory.mktemp("probes") / "trace"
    return generate_from_file("agent-coding", tiny_model_dir, seed=0, scale=0.01, sessions=2,
                              max_context=2000).write(out)


@pytest.fixture()
def garbage(tmp_path) -> Path:
    p = tmp_path / "garbage.yaml"
    p.write_bytes(bytes([0x8B, 0xFF, 0x00, 0xC3]) + os.urandom(200))
    return p


EXPERIMENT = """\
name: probe
model: {{source: path, path: {model}, served_model_name: tiny}}
servers: {{apc: {{}}}}
workloads: {{agent: {{spec: agent-coding, scale: 0.01, sessions: 1}}}}
loads: [{{concurrency: 1}}]
repeats: {repeats}
replay: {{time_scale: 0}}
"""


def _experiment(tmp_path: Path, model: Path, repeats: str = "1") -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(EXPERIMENT.format(model=model, repeats=repeats))
    return p


# ------------------------------------------------------------------------------------- files and paths


def test_binary_garbage_as_workload_spec(garbage, tiny_model_dir, tmp_path):
    r = kvscope("workload", "generate", str(garbage), "--tokenizer", str(tiny_model_dir), "--out", str(tmp_path / "t"))
    assert_bad_input(r, str(garbage), "not UTF-8 text", "YAML")


def test_binary_garbage_as_server_config(garbage):
    assert_bad_input(kvscope("serve", "--config", str(garbage)), str(garbage), "server config", "not UTF-8")


def test_binary_garbage_as_experiment_spec(garbage):
    assert_bad_input(kvscope("experiment", "cells", str(garbage)), str(garbage), "not UTF-8")


def test_directory_as_workload_spec(tiny_model_dir, tmp_path):
    r = kvscope("workload", "generate", str(tmp_path), "--tokenizer", str(tiny_model_dir), "--out", str(tmp_path / "t"))
    assert_bad_input(r, str(tmp_path), "is a directory", "YAML file or a preset name")


def test_out_naming_an_existing_file(tiny_model_dir, tmp_path):
    existing = tmp_path / "file"
    existing.write_text("keep me")
    r = kvscope("workload", "generate", "chat", "--tokenizer", str(tiny_model_dir), "--out", str(existing))
    assert_bad_input(r, "--out", str(existing), "existing file")
    assert existing.read_text() == "keep me"


def test_simulate_trace_without_segments(trace_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(trace_dir, broken)
    (broken / "segments.parquet").unlink()
    assert_bad_input(kvscope("simulate", str(broken)), str(broken), "segments.parquet is missing")


# ----------------------------------------------------------------------------------- numbers on flags


@pytest.mark.parametrize("flag,value,allowed", [
    ("--block-size", "-16", ">= 1"), ("--block-size", "0", ">= 1"), ("--num-gpu-blocks", "0", ">= 2"),
    ("--num-gpu-blocks", "1", ">= 2"), ("--replicas", "0", "> 0")])
def test_simulate_bounded_flags(trace_dir, flag, value, allowed):
    assert_bad_input(kvscope("simulate", str(trace_dir), flag, value), f"argument {flag}", f"got {value}", allowed)


def test_stats_block_size_beyond_memory(trace_dir):
    assert_bad_input(kvscope("workload", "stats", str(trace_dir), "--block-size", str(10**12)),
                     "argument --block-size", "<= 1,048,576")


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_generate_scale_must_be_positive(tiny_model_dir, tmp_path, value):
    r = kvscope("workload", "generate", "chat", "--tokenizer", str(tiny_model_dir), f"--scale={value}",
                "--out", str(tmp_path / "t"))
    assert_bad_input(r, "argument --scale", "allowed: > 0")
    assert not (tmp_path / "t").exists()


def test_negative_system_tokens_in_spec(tiny_model_dir, tmp_path):
    spec = tmp_path / "neg.yaml"
    spec.write_text("extends: chat\nprefix:\n  system_tokens: -5\n")
    r = kvscope("workload", "generate", str(spec), "--tokenizer", str(tiny_model_dir), "--out", str(tmp_path / "t"))
    assert_bad_input(r, "neg.yaml", "prefix.system_tokens", "greater than or equal to 0", "-5")


# ------------------------------------------------------------------------------------------- size bounds


def test_huge_scale_stops_before_memory_runs_out(tiny_model_dir, tmp_path):
    r = kvscope("workload", "generate", "agent-coding", "--tokenizer", str(tiny_model_dir), "--scale", "1000000",
                "--sessions", "1", "--no-progress", "--out", str(tmp_path / "t"))
    assert_bad_input(r, "workload too large", "GiB available memory", "--allow-large")
    assert not (tmp_path / "t").exists()


def test_huge_session_count_in_spec(tiny_model_dir, tmp_path):
    spec = tmp_path / "many.yaml"
    spec.write_text(f"extends: chat\nsessions:\n  count: {10**12}\n")
    r = kvscope("workload", "generate", str(spec), "--tokenizer", str(tiny_model_dir), "--no-progress",
                "--out", str(tmp_path / "t"))
    assert_bad_input(r, "workload too large", "--allow-large")


def test_token_budget_counts_generated_tokens(tiny_model_dir):
    from kvscope.workloads.errors import WorkloadError
    from kvscope.workloads.generate import generate_from_file

    trace = generate_from_file("chat", tiny_model_dir, seed=0, scale=0.05, sessions=3)
    total = int(trace.segment_lengths().sum())
    # exactly enough passes (the budget is an upper bound on what is stored), one token less does not
    generate_from_file("chat", tiny_model_dir, seed=0, scale=0.05, sessions=3, max_tokens=total)
    with pytest.raises(WorkloadError, match="workload too large: more than"):
        generate_from_file("chat", tiny_model_dir, seed=0, scale=0.05, sessions=3, max_tokens=total - 1)


def test_experiment_repeats_are_bounded(tiny_model_dir, tmp_path):
    r = kvscope("experiment", "cells", str(_experiment(tmp_path, tiny_model_dir, repeats=str(10**12))))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "repeats" in r.stderr and "less than or equal to 1000" in r.stderr


def test_experiment_cells_are_bounded(tiny_model_dir, tmp_path):
    spec = tmp_path / "wide.yaml"
    loads = ", ".join(f"{{concurrency: {i}}}" for i in range(1, 21))
    spec.write_text(EXPERIMENT.format(model=tiny_model_dir, repeats="1000").replace(
        "[{concurrency: 1}]", f"[{loads}]"))
    r = kvscope("experiment", "cells", str(spec))
    assert_bad_input(r, "20,000 cells", "at most 10,000")


# ------------------------------------------------------------------------------------------ experiments


def test_unknown_cells_are_an_error(tiny_model_dir, tmp_path):
    r = kvscope("experiment", "run", str(_experiment(tmp_path, tiny_model_dir)), "--out", str(tmp_path / "res"),
                "--cells", "bogus", "--no-report")
    assert_bad_input(r, "--cells", "bogus", "known cells: apc__agent__c1__r0")
    assert not (tmp_path / "res").exists()


def test_resume_of_a_run_id_that_does_not_exist(tiny_model_dir, tmp_path):
    r = kvscope("experiment", "run", str(_experiment(tmp_path, tiny_model_dir)), "--out", str(tmp_path / "res"),
                "--resume", "--run-id", "typo", "--no-report")
    assert_bad_input(r, "--resume --run-id typo", "no such run", "known runs: none")
    assert not (tmp_path / "res" / "probe" / "typo").exists()


# -------------------------------------------------------------------------------------------- imports


def test_null_session_id_in_token_jsonl(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text('{"session_id": "a", "prompt_token_ids": [1, 2, 3]}\n'
                   '{"session_id": null, "prompt_token_ids": [4, 5, 6]}\n')
    r = kvscope("workload", "import", "jsonl", str(src), "--out", str(tmp_path / "t"))
    assert_bad_input(r, f"{src}: line 2", "session_id is null", "string or an integer")


def test_arrival_s_starts_each_session(tmp_path):
    """Sessions start at their first request's arrival_s (they all started at 0, so replay lost the timing)."""
    from kvscope.workloads.importers import import_jsonl

    src = tmp_path / "t.jsonl"
    src.write_text('{"session_id": "late", "step": 0, "arrival_s": 7.5, "prompt_token_ids": [1, 2, 3]}\n'
                   '{"session_id": "late", "step": 1, "arrival_s": 9.0, "prompt_token_ids": [1, 2, 3, 4]}\n'
                   '{"session_id": "early", "step": 0, "arrival_s": 0.5, "prompt_token_ids": [9, 8]}\n')
    req = import_jsonl(src).requests
    starts = req.groupby("session_id")["session_start_s"].agg(["min", "max"])
    assert starts.loc["late"].tolist() == [7.5, 7.5]
    assert starts.loc["early"].tolist() == [0.5, 0.5]


# -------------------------------------------------------------------------------------- servers and URLs


class _NotVllm(BaseHTTPRequestHandler):
    """Answers like a web server that is not vLLM: /metrics is an HTML page."""

    def do_GET(self):  # noqa: N802
        body = b'{"version": "x"}' if self.path == "/version" else b"<html><body>hello</body></html>"
        if self.path == "/v1/models":
            body = b'{"data": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture()
def not_vllm():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _NotVllm)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_metrics_that_are_not_prometheus_text(not_vllm):
    assert_bad_input(kvscope("server-info", "--endpoint", not_vllm), f"{not_vllm}/metrics",
                     "not a Prometheus metrics text", "vLLM")


def test_endpoint_ending_in_v1_is_used_as_its_base():
    with FaultServer(FaultConfig()) as srv:
        r = kvscope("server-info", "--endpoint", srv.endpoint + "/v1/", "--json")
    assert r.returncode == 0, r.stderr
    assert f"using {srv.endpoint} (kvscope adds /v1/... itself)" in r.stderr
    assert json.loads(r.stdout)["endpoint"] == srv.endpoint


def test_endpoint_that_is_not_a_url():
    assert_bad_input(kvscope("server-info", "--endpoint", "127.0.0.1:8000"), "--endpoint 127.0.0.1:8000",
                     "http:// or https://")


# ----------------------------------------------------------------------------- runs that failed say so


@pytest.fixture()
def fault_trace(tmp_path) -> Path:
    return synthetic_trace(10, steps=4).write(tmp_path / "ftrace")


def test_replay_at_100_percent_401_exits_1(fault_trace, tmp_path):
    with FaultServer(FaultConfig(fault_rates={"http_401": 1.0})) as srv:
        r = kvscope("replay", str(fault_trace), "--endpoint", srv.endpoint, "--out", str(tmp_path / "run"),
                    "--concurrency", "4", "--time-scale", "0", "--on-error", "continue", "--no-progress",
                    "--no-reset-prefix-cache")
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "kvscope: error: replay failed: 100 % of 40 requests failed (http_401: 40)" in r.stderr
    assert (tmp_path / "run" / "summary.json").exists()  # the run is kept for inspection


def test_error_share_threshold_is_configurable(fault_trace, tmp_path):
    with FaultServer(FaultConfig(fault_rates={"http_500": 0.2}, seed=3)) as srv:
        common = [str(fault_trace), "--endpoint", srv.endpoint, "--concurrency", "4", "--time-scale", "0",
                  "--on-error", "continue", "--no-progress", "--no-reset-prefix-cache"]
        strict = kvscope("replay", *common, "--out", str(tmp_path / "strict"))
        lenient = kvscope("replay", *common, "--out", str(tmp_path / "lenient"), "--max-error-share", "0.9")
    failed = json.loads((tmp_path / "strict" / "summary.json").read_text())["requests"]["failed"]
    assert 0 < failed < 40
    assert strict.returncode == 1 and "replay failed:" in strict.stderr and "http_500" in strict.stderr
    assert lenient.returncode == 0, lenient.stderr[-2000:]


def test_failure_reason_rule():
    from kvscope.harness.replay.failure import replay_failure_reason

    from kvscope.harness.results.summary import RequestCounts

    def summary(sent: int, failed: int, classes: dict) -> RequestCounts:
        return RequestCounts(sent=sent, in_window=sent, ok=sent - failed, failed=failed, error_rate=None,
                             errors_by_class=classes, retries=0, length_mismatch=0, errors_by_status={})

    assert replay_failure_reason(summary(100, 5, {"http_500": 5})) is None  # exactly 5 %: allowed
    reason = replay_failure_reason(summary(100, 6, {"connection_error": 4, "http_500": 2}))
    assert reason.startswith("6 % of 100 requests failed (connection_error: 4, http_500: 2)")
    assert replay_failure_reason(summary(0, 0, {})) is None
    assert replay_failure_reason(summary(3, 3, {"x": 3}), max_error_share=1.0) is None


# ----------------------------------------------------------------------------------------------- compare


def _replay_run(trace: Path, out: Path) -> Path:
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.replay.runner import replay

    opts = ReplayOptions(concurrency=2, time_scale=0.0, progress=False, scrape_interval_s=0.2,
                         reset_prefix_cache=False)
    with FaultServer(FaultConfig()) as srv:
        replay(trace, out, opts, endpoints=[srv.endpoint])
    return out


def test_compare_refuses_runs_of_different_traces(tmp_path):
    a = _replay_run(synthetic_trace(4, steps=2).write(tmp_path / "ta"), tmp_path / "a")
    b = _replay_run(synthetic_trace(4, steps=3).write(tmp_path / "tb"), tmp_path / "b")
    r = kvscope("compare", str(a), str(b), "--no-html", "--resamples", "50")
    assert_bad_input(r, f"{a} replayed trace {tmp_path / 'ta'}", f"{b} replayed {tmp_path / 'tb'}", "--force")
    forced = kvscope("compare", str(a), str(b), "--no-html", "--resamples", "50", "--force")
    assert "replayed trace" not in forced.stderr


def test_compare_with_a_run_of_zero_records(tmp_path):
    trace = synthetic_trace(3, steps=2).write(tmp_path / "t")
    a = _replay_run(trace, tmp_path / "a")
    empty = tmp_path / "empty"
    shutil.copytree(a, empty)
    (empty / "requests.parquet").unlink()
    (empty / "requests.jsonl").write_text("")
    assert_bad_input(kvscope("compare", str(a), str(empty), "--no-html"), str(empty), "0 request records")


# --------------------------------------------------------------------------------------------- disk full


def test_disk_full_keeps_whole_lines(tmp_path, monkeypatch):
    from kvscope.harness.results import records as rec_mod
    from kvscope.harness.results.records import DiskFullError, RecordWriter, RequestRecord, read_jsonl_records

    writer = RecordWriter(tmp_path, flush_interval_s=0.0)
    for i in range(3):
        writer.write(RequestRecord(request_id=i, session_id="s", step=i))
    real_write = os.write
    budget = {"bytes": 50}  # the disk takes 50 more bytes, then is full: the next line is torn

    def full_disk_write(fd, data):
        if fd != writer._fd:
            return real_write(fd, data)
        if budget["bytes"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_write(fd, bytes(data[: budget["bytes"]]))
        budget["bytes"] -= n
        return n

    monkeypatch.setattr(rec_mod.os, "write", full_disk_write)
    with pytest.raises(DiskFullError) as info:
        writer.write(RequestRecord(request_id=3, session_id="s", step=3))
    message = str(info.value)
    assert message == f"disk full writing {tmp_path / 'requests.jsonl'}: 3 records kept in requests.jsonl"
    with pytest.raises(DiskFullError):  # nothing is silently dropped after that
        writer.write(RequestRecord(request_id=4, session_id="s", step=4))
    with pytest.raises(DiskFullError):
        writer.close()
    monkeypatch.setattr(rec_mod.os, "write", real_write)
    rows = read_jsonl_records(tmp_path / "requests.jsonl")  # no torn line left behind, no warning needed
    assert [r["request_id"] for r in rows] == [0, 1, 2]


def test_disk_full_in_cli_is_one_line(tmp_path):
    """The CLI edge prints a DiskFullError as one line with exit 2 (the class is a KvscopeError)."""
    from kvscope.harness.cli.main import describe_input_error
    from kvscope.harness.common.errors import KvscopeError
    from kvscope.harness.results.records import DiskFullError

    assert issubclass(DiskFullError, KvscopeError)
    assert describe_input_error(OSError(errno.ENOSPC, "No space left on device", "/x/y")) == \
        "/x/y: No space left on device"


# ------------------------------------------------------------------------------------ client descriptors


def test_descriptor_exhaustion_is_named_and_concurrency_capped(fault_trace, tmp_path):
    import resource

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160))

    with FaultServer(FaultConfig()) as srv:
        r = kvscope("replay", str(fault_trace), "--endpoint", srv.endpoint, "--out", str(tmp_path / "run"),
                    "--concurrency", "512", "--time-scale", "0", "--no-progress", "--no-reset-prefix-cache",
                    preexec=low_limit)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "kvscope: warning: --concurrency 512 needs about 576 file descriptors but the limit is 160" in r.stderr
    assert "running at 96" in r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["requests"]["failed"] == 0


def test_emfile_is_a_client_error_class():
    import asyncio

    from kvscope.harness.common.limits import is_fd_exhaustion
    from kvscope.harness.serving.client import FastStreamClient, Timeouts

    assert is_fd_exhaustion(OSError(errno.EMFILE, "Too many open files"))
    assert not is_fd_exhaustion(OSError(errno.ECONNREFUSED, "refused"))

    async def go():
        client = FastStreamClient()

        async def no_fds(*args, **kwargs):
            raise OSError(errno.EMFILE, "Too many open files")

        client._acquire = no_fds
        try:
            return await client.post_stream("http://127.0.0.1:9/v1/completions", b"{}", Timeouts())
        finally:
            await client.close()

    res = asyncio.run(go())
    assert res.error_class == "client_fd_exhausted"


def test_debug_flag_shows_the_traceback(tmp_path):
    r = kvscope("--debug", "simulate", str(tmp_path / "nowhere.jsonl"))
    assert r.returncode == 1 and "Traceback" in r.stderr
