"""Unreadable or truncated trace and import files are reported with the file and the line/row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvscope.workloads.errors import TraceFileError
from tests.cli import kvscope as _kvscope


@pytest.fixture()
def trace_dir(tiny_model_dir, tmp_path) -> Path:
    from kvscope.workloads.generate import generate_from_file

    return generate_from_file("agent-coding", tiny_model_dir, seed=0, scale=0.01, sessions=2,
                              max_context=2000).write(tmp_path / "trace")


def test_truncated_parquet_is_named(trace_dir):
    from kvscope.workloads.trace import Trace

    p = trace_dir / "requests.parquet"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with pytest.raises(TraceFileError, match="requests.parquet: unreadable or truncated Parquet"):
        Trace.read(trace_dir)
    r = _kvscope("workload", "stats", str(trace_dir))
    assert r.returncode == 2 and "requests.parquet: unreadable or truncated" in r.stderr and "Traceback" not in r.stderr


def test_missing_pieces_and_dangling_segments(trace_dir, tmp_path):
    import pyarrow.parquet as pq

    from kvscope.workloads.trace import Trace

    broken = tmp_path / "broken"
    shutil.copytree(trace_dir, broken)
    (broken / "segments.parquet").unlink()
    with pytest.raises(TraceFileError, match="segments.parquet: missing"):
        Trace.read(broken)
    with pytest.raises(TraceFileError, match="no such trace directory"):
        Trace.read(tmp_path / "nowhere")
    t = pq.read_table(trace_dir / "requests.parquet").to_pandas()
    t.loc[3, "prompt_segment_ids"] = [10**9]
    t.to_parquet(trace_dir / "requests.parquet", index=False)
    with pytest.raises(TraceFileError, match="row 3: prompt_segment_ids refer to segments that do not exist"):
        Trace.read(trace_dir)


def test_bad_jsonl_line_is_named_by_number(tmp_path, shared_data):
    lines = (shared_data / "mooncake_conversation_trace.jsonl").read_text().splitlines()[:6]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:3] + ['{"timestamp": 5, "input_le'] + lines[3:]) + "\n")
    for args in (["simulate", str(bad), "--json"], ["workload", "import", "mooncake", str(bad), "--out",
                                                    str(tmp_path / "imp")]):
        r = _kvscope(*args)
        assert r.returncode == 2, r.stderr
        assert f"{bad}: line 4: not valid JSON" in r.stderr and "Traceback" not in r.stderr
    missing = tmp_path / "missing_field.jsonl"
    missing.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}) + "\n")
    r = _kvscope("workload", "import", "mooncake", str(missing), "--out", str(tmp_path / "imp2"))
    assert r.returncode == 2 and "line 1: missing field(s) hash_ids" in r.stderr
    tok = tmp_path / "tok.jsonl"
    tok.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n" + json.dumps({"max_tokens": 4}) + "\n")
    r = _kvscope("workload", "import", "jsonl", str(tok), "--out", str(tmp_path / "imp3"))
    assert r.returncode == 2 and "line 2: missing field(s) prompt_token_ids" in r.stderr


def test_truncated_archive_is_reported(tmp_path, shared_data):
    src = shared_data / "weka_cc_traces.tar.gz"
    cut = tmp_path / "cut.tar.gz"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(200_000))
    r = _kvscope("simulate", str(cut), "--json")
    assert r.returncode == 2 and "unreadable or truncated archive" in r.stderr and "Traceback" not in r.stderr


def test_a_server_that_never_becomes_ready_times_out_with_its_log(tmp_path):
    from kvscope.harness.common.errors import ServerError
    from kvscope.harness.serving.server import ServerConfig, VllmServer

    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\necho 'loading weights forever'\nexec sleep 300\n")
    fake.chmod(0o755)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    server = VllmServer(ServerConfig(model=str(model), python=str(fake), startup_timeout_s=3), device="cpu")
    with pytest.raises(ServerError) as e:
        server.start()
    assert "did not become ready within 3 s" in str(e.value) and "loading weights forever" in str(e.value)
    assert server.process is None  # stopped and reaped


# ---- a full disk names the path (issue 40, item 8): /dev/full fails every write with ENOSPC, as a full disk does


def test_a_full_disk_under_workload_generate_names_the_trace_directory(tiny_model_dir, tmp_path):
    """Probe: "kvscope: error: Error writing bytes to file. Detail: [errno 28] No space left on device", no path."""
    out = tmp_path / "trace"
    out.mkdir()
    (out / "segments.parquet").symlink_to("/dev/full")
    r = _kvscope("workload", "generate", "chat", "--tokenizer", str(tiny_model_dir), "--out", str(out),
                 "--scale", "0.01", "--sessions", "1", "--no-progress")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"kvscope: error: {out}: " in r.stderr and "No space left on device" in r.stderr


def test_a_full_disk_under_explain_json_names_the_file(trace_dir):
    """Probe: "kvscope: error: No space left on device", no path."""
    r = _kvscope("explain", str(trace_dir), "--json", "/dev/full", "--no-progress")
    assert r.returncode == 2 and r.stderr.strip() == "kvscope: error: /dev/full: No space left on device", r.stderr
