"""Replay harness against a real vLLM CPU server: three-way hit reconciliation, live mode, concurrency, faults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.results.records import read_records
from kvscope.harness.replay.runner import replay

pytestmark = pytest.mark.vllm

EDITED = """\
extends: agent-coding
name: agent-coding-edited
sessions:
  policies:
    - {kind: append_only}
    - {kind: edit_turn, depth: 2, tokens: 24, probability: 0.5}
    - {kind: truncate_tool_outputs, keep_last: 2, max_tokens: 16}
"""


@pytest.fixture(scope="module")
def traces(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    from kvscope.workloads.generate import generate_from_file

    root = tmp_path_factory.mktemp("traces")
    (root / "edited.yaml").write_text(EDITED)
    specs = {"append": "agent-coding", "edited": str(root / "edited.yaml"), "volatile": "agent-coding-timestamped"}
    out = {}
    for name, spec in specs.items():
        trace = generate_from_file(spec, tiny_model_dir, seed=1, scale=0.03, sessions=3, max_context=1900)
        out[name] = trace.write(root / name)
    return out


def _opts(**kw) -> ReplayOptions:
    base = dict(concurrency=1, time_scale=0.0, progress=False, scrape_interval_s=0.5)
    base.update(kw)
    return ReplayOptions(**base)


@pytest.mark.parametrize("workload", ["append", "edited", "volatile"])
def test_sequential_recorded_replay_predicts_every_request_exactly(vllm_server, traces, workload, tmp_path):
    out = replay(traces[workload], tmp_path / "run", _opts(), endpoints=[vllm_server.endpoint])
    df = read_records(tmp_path / "run")
    assert out.aborted is None and len(df) > 10 and df["error_class"].isna().all()
    assert (df["predicted_cached_tokens"] == df["cached_tokens"]).all(), \
        df.loc[df["predicted_cached_tokens"] != df["cached_tokens"], ["request_id", "prompt_tokens", "cached_tokens",
                                                                      "predicted_cached_tokens"]]
    hit = out.summary["hit_rate"]
    assert hit["metrics_hits"] == df["cached_tokens"].sum() == hit["server_cached_tokens"]
    assert hit["metrics_queries"] == df["prompt_tokens"].sum()
    assert hit["requests_predicted_exactly"] == len(df)
    if workload == "volatile":
        assert hit["server_per_request"] < 0.35  # the timestamp at position 200 caps reuse at one block
    else:
        assert hit["server_per_request"] > 0.5


def test_live_mode_carries_the_models_output_and_still_predicts_exactly(vllm_server, traces, tmp_path):
    out = replay(traces["append"], tmp_path / "run", _opts(mode="live"), endpoints=[vllm_server.endpoint])
    df = read_records(tmp_path / "run")
    assert (df["predicted_cached_tokens"] == df["cached_tokens"]).all()
    assert out.summary["hit_rate"]["metrics_hits"] == df["cached_tokens"].sum()
    # live histories contain the model's real answers, so later prompts reuse the generated blocks too:
    # live hit >= recorded hit for the same append-only trace
    rec = replay(traces["append"], tmp_path / "rec", _opts(), endpoints=[vllm_server.endpoint])
    assert out.summary["hit_rate"]["server_per_request"] >= rec.summary["hit_rate"]["server_per_request"]


def test_prefix_caching_off_measures_zero_and_reports_would_hit(ngram_server, traces, tmp_path):
    """On the shared no-cache server (n-gram speculation on too, which changes nothing the cache sees)."""
    out = replay(traces["append"], tmp_path / "run", _opts(), endpoints=[ngram_server.endpoint])
    df = read_records(tmp_path / "run")
    assert (df["cached_tokens"] == 0).all()
    hit = out.summary["hit_rate"]
    assert hit["server_per_request"] == 0 and hit["metrics_hits"] == 0
    assert hit["would_hit"] is not None and hit["would_hit"] > 0.5


def test_eight_concurrent_sessions_complete_with_consistent_summary(vllm_server, tiny_model_dir, tmp_path):
    from kvscope.workloads.generate import generate_from_file

    trace_dir = generate_from_file("agent-coding", tiny_model_dir, seed=2, scale=0.02, sessions=10,
                                   max_context=1500).write(tmp_path / "trace")
    out = replay(trace_dir, tmp_path / "run", _opts(concurrency=8), endpoints=[vllm_server.endpoint])
    df = read_records(tmp_path / "run")
    n_trace = len(pd.read_parquet(trace_dir / "requests.parquet"))
    assert len(df) == n_trace == out.summary["requests"]["sent"]  # one row per request sent
    assert sorted(df["request_id"]) == list(range(n_trace))
    lat = out.summary["latency"]
    for col in ("ttft_s", "e2e_s"):
        for p in (50, 90, 99):
            assert lat[col][f"p{p}"] == pytest.approx(np.percentile(df[col].to_numpy(float), p), rel=1e-12)
    itl = np.concatenate([np.asarray(x, float) for x in df["itl_s"]])
    assert lat["itl_s"]["p99"] == pytest.approx(np.percentile(itl, 99), rel=1e-12)
    metrics = pd.read_parquet(tmp_path / "run" / "server_metrics.parquet")
    assert len(metrics) >= 2 and {"num_requests_running", "kv_cache_usage", "prefix_cache_hits"} <= set(metrics)
    assert (tmp_path / "run" / "manifest.json").exists()


def test_replay_cli_prints_summary(vllm_server, traces, tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "replay", str(traces["append"]), "--endpoint",
                        vllm_server.endpoint, "--out", str(tmp_path / "run"), "--concurrency", "2", "--time-scale",
                        "0", "--no-progress", "--slo-ttft-ms", "5000"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "prefix-cache hit rate" in r.stdout and "TTFT" in r.stdout
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["goodput"]["slo_ttft_ms"] == 5000
