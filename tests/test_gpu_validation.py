"""The published-measurement validation (benchmarks/gpu/validate_published.py) and the prepared GPU check's CPU
path (benchmarks/gpu/gpu_check.py, run by benchmarks/gpu/validate.sh --cpu).

The validation's figures (errors per point and per set) are benchmark output in benchmarks/results/, not
asserted here; these tests check that the data, the split and the workload builders are what the script and
its README claim, and that the GPU check's CPU path runs end to end on the suite's shared vLLM server.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import validate_published as vp

REPO = Path(__file__).resolve().parents[1]


def test_split_covers_every_point_once_and_calibration_is_llama3_8b_on_lambdalabs_only():
    points = vp.load_points()
    split = vp.load_split()
    ids = [p.id for p in points]
    assert len(ids) == len(set(ids)) >= 12
    assert set(split) == set(ids)  # every point in exactly one set (a dict: no id in both lists)
    calib = [p for p in points if split[p.id] == "calibration"]
    assert calib and all(p.source == "lambdalabs" and p.model == "llama-3.1-8b" and p.tp == 1 for p in calib)
    valid = [p for p in points if split[p.id] == "validation"]
    assert len({p.gpu for p in valid}) >= 2 and len({p.model for p in valid}) >= 3


def test_lambdalabs_workloads_are_the_published_per_request_lengths():
    doc = json.loads((vp.POINTS / "lambdalabs_vllm_benchmark.json").read_text())
    raw = {p["id"]: p for p in doc["points"]}
    for p in vp.load_points():
        if p.source != "lambdalabs":
            continue
        r = raw[p.id]
        assert sum(p.inputs) == r["published"]["total_input_tokens"]
        assert p.outputs == [max(o, 1) for o in r["output_lens"]]
        assert p.empty == [o == 0 for o in r["output_lens"]]
        assert set(p.send_s) == {0.0}


def test_sglang_workloads_have_the_stated_rate_count_and_mean_output():
    for p in vp.load_points():
        if p.source != "sglang":
            continue
        assert len(p.inputs) == len(p.send_s)
        assert abs(sum(p.outputs) / len(p.outputs) - vp.SHAREGPT_MEAN_OUTPUT) < 15
        rate = p.meta["request_rate"]
        if rate == "inf":
            assert set(p.send_s) == {0.0}
        else:  # Poisson: the mean gap within 10 % of 1/rate over 1,200+ arrivals
            assert abs(p.send_s[-1] / len(p.send_s) - 1 / float(rate)) < 0.1 / float(rate)


def test_frontend_release_queues_a_burst_and_passes_spaced_requests_after_one_service_time():
    burst = vp.frontend_release([0.0] * 5, 0.01)
    assert burst == pytest.approx([0.05] * 5)  # the engine waits for the whole busy period
    spaced = vp.frontend_release([0.0, 1.0, 2.0], 0.01)
    assert spaced == pytest.approx([0.01, 1.01, 2.01])
    # two overlapping requests share a busy period, a later one has its own
    assert vp.frontend_release([0.0, 0.005, 0.5], 0.01) == pytest.approx([0.02, 0.02, 0.51])
    assert vp.frontend_release([0.3, 0.1], 0.0) == [0.3, 0.1]


def test_decode_latency_point_is_prefill_plus_127_decode_steps_of_the_step_cost():
    p = next(x for x in vp.load_points() if x.id == "vl-h100-llama-8b-latency-bs8")
    f = vp.DEFAULT_FACTORS
    pred = vp.predict_point(p, f)
    cost = vp.deployment(p, f).cost
    prefill = cost.step_s(8 * 32, 8, 0.0, 8 * 32 * (32 + 1) / 2)
    decodes = sum(cost.step_s(8, 8, 8 * (32 + j)) for j in range(1, 128))
    assert pred["batch_latency_ms"] == pytest.approx(1e3 * (prefill + decodes), rel=0.02)
    assert math.isfinite(pred["batch_latency_ms"]) and pred["batch_latency_ms"] > 0


def test_gpu_check_bad_input_is_one_line_and_exit_2(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks/gpu/gpu_check.py"), "--out", str(tmp_path), "--device", "cpu"]
    r = subprocess.run(cmd + ["--endpoint", "http://127.0.0.1:9"], check=False, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --endpoint needs --model-dir")
    assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(cmd + ["--levels", "0,4"], check=False, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "levels" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.vllm
def test_gpu_check_cpu_path_compares_every_request_on_the_shared_server(vllm_server, tiny_model_dir, tmp_path):
    from benchmarks.gpu.gpu_check import run_check

    doc = run_check(tmp_path, "cpu", vllm_server.endpoint, tiny_model_dir, levels=[1, 2], sessions=2, scale=0.02,
                    factors=None, gpu=None, calibration_rounds=1, max_model_len=2048)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["levels"] == doc["levels"] and [lv["concurrency"] for lv in doc["levels"]] == [1, 2]
    assert doc["cost"]["kind"] == "cpu-calibration"
    from kvscope.harness.cachemodel.trace_io import load_trace

    n_trace = len(load_trace(tmp_path / "trace").requests)
    for level in doc["levels"]:
        assert level["requests"] == n_trace  # every replayed request was predicted and compared
        for row in level["per_request"]:
            assert row["ttft_s"][0] > 0 and row["e2e_s"][0] >= row["ttft_s"][0]
    # one request at a time the cache is the sequential simulator's case: exact
    assert doc["levels"][0]["cached_exact_share"] >= 0.97
