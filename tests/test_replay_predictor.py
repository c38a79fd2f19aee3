"""Which model a replay's predictions come from, against the fault-injecting mock server (no vLLM): the
scheduler model with a calibration when requests overlap, the sequential simulator otherwise, a calibration of
another server refused before anything is sent, and a failing model leaving the sequential predictions."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvscope.harness.cli.main import main
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.runner import replay
from kvscope.harness.results.loaders import load_summary
from kvscope.harness.results.records import read_records
from kvscope.harness.results.schemas import CalibrationCost, CalibrationFile, CalibrationServer
from kvscope.workloads.versioned_file import write_versioned
from tests.doubles.faultserver import FaultConfig, FaultServer

BLOCK, BLOCKS = 16, 64


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    from kvscope.workloads.generate import synthetic_trace

    return synthetic_trace(4, steps=3, prompt_tokens=96, output_tokens=8).write(
        tmp_path_factory.mktemp("t") / "t"
    )


@pytest.fixture(scope="module")
def server():
    with FaultServer(FaultConfig(model="tiny", block_size=BLOCK, num_gpu_blocks=BLOCKS)) as s:
        yield s


def _calibration(path: Path, blocks: int = BLOCKS) -> Path:
    cal = CalibrationFile(
        created_at=time.time(),
        server=CalibrationServer(block_size=BLOCK, num_gpu_blocks=blocks),
        cost=CalibrationCost(
            base_s=0.001, per_token_s=1e-5, per_seq_s=1e-4, per_context_token_s=0.0, per_prefill_pair_s=0.0
        ),
        fit_r2=0.99,
        fit_median_rel_error=0.05,
    )
    write_versioned(path, cal)
    return path


def _opts(**kw) -> ReplayOptions:
    return ReplayOptions(**{"time_scale": 0, "progress": False, **kw})


def test_overlapping_replay_with_a_calibration_records_the_scheduler_models_predictions(
    server, trace_dir, tmp_path
):
    cal = _calibration(tmp_path / "cal.json")
    out = replay(
        trace_dir, tmp_path / "run", _opts(concurrency=3, calibration=str(cal)), endpoints=[server.endpoint]
    )
    df = read_records(tmp_path / "run")
    assert len(df) == 12 and (df["predictor"] == "scheduler-replay-informed").all()
    assert (
        df["predicted_cached_tokens"].notna().all() and df["predicted_cached_tokens_sequential"].notna().all()
    )
    hit = load_summary(tmp_path / "run").hit_rate
    assert (hit.predictor, hit.calibration, hit.predictor_note) == (
        "scheduler-replay-informed",
        str(cal),
        None,
    )
    seq_exact = int((df["cached_tokens"] == df["predicted_cached_tokens_sequential"]).sum())
    assert hit.sequential_requests_predicted_exactly == seq_exact
    assert out.summary["hit_rate"]["predictor"] == "scheduler-replay-informed"


def test_one_request_at_a_time_keeps_the_sequential_simulator_even_with_a_calibration(
    server, trace_dir, tmp_path
):
    replay(
        trace_dir,
        tmp_path / "run",
        _opts(concurrency=1, calibration=str(_calibration(tmp_path / "c.json"))),
        endpoints=[server.endpoint],
    )
    df = read_records(tmp_path / "run")
    assert (df["predictor"] == "sequential").all()
    hit = load_summary(tmp_path / "run").hit_rate
    assert hit.predictor == "sequential" and hit.predictor_note is None and hit.calibration is None


def test_a_calibration_of_another_server_is_refused_before_anything_is_sent(
    server, trace_dir, tmp_path, capsys
):
    cal = _calibration(tmp_path / "other.json", blocks=BLOCKS * 2)
    rc = main(
        [
            "replay",
            str(trace_dir),
            "--endpoint",
            server.endpoint,
            "--out",
            str(tmp_path / "run"),
            "--concurrency",
            "2",
            "--time-scale",
            "0",
            "--no-progress",
            "--calibration",
            str(cal),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err
    assert f"calibration {cal}: measured on a server with {BLOCKS * 2} blocks" in err and "--calibrate" in err
    assert not (tmp_path / "run" / "requests.jsonl").exists()


def test_a_failing_scheduler_model_leaves_the_sequential_predictions(
    server, trace_dir, tmp_path, monkeypatch, capsys
):
    import kvscope.harness.replay.predict as predict

    def broken(*a, **k):
        raise RuntimeError("model broke")

    monkeypatch.setattr(predict, "replay_informed_cached_tokens", broken)
    replay(
        trace_dir,
        tmp_path / "run",
        _opts(concurrency=3, calibration=str(_calibration(tmp_path / "c.json"))),
        endpoints=[server.endpoint],
    )
    df = read_records(tmp_path / "run")
    assert len(df) == 12 and (df["predictor"] == "sequential").all()
    hit = load_summary(tmp_path / "run").hit_rate
    assert hit.predictor == "sequential" and "model broke" in hit.predictor_note
    assert "the scheduler model failed (RuntimeError: model broke)" in capsys.readouterr().err


def test_a_calibration_measures_through_the_configurations_own_backend(server, tmp_path, monkeypatch):
    """``calibrate_server`` takes the backend: the configuration's scheduler limits and its API key reach the
    measurement (a fresh default backend built from the URL had neither)."""
    from kvscope.harness.replay import calibrate
    from kvscope.harness.serving.backend import Backend
    from kvscope.harness.serving.server import ServerConfig

    monkeypatch.setenv("CAL_KEY", "sk-cal-123")
    seen = {}

    def measure(endpoint, model, srv, **kw):
        seen.update(endpoint=endpoint, model=model, server=srv, headers=kw["headers"])
        raise RuntimeError("measured")

    monkeypatch.setattr(calibrate, "measure_samples", measure)
    backend = Backend.create("vllm", ServerConfig(model="/m", max_num_seqs=6, max_num_batched_tokens=512,
                                                  api_key_env="CAL_KEY"), endpoint=server.endpoint)
    with pytest.raises(RuntimeError, match="measured"):
        calibrate.calibrate_server(backend, tmp_path / "c.json")
    assert seen["endpoint"] == server.endpoint and seen["headers"] == {"Authorization": "Bearer sk-cal-123"}
    assert (seen["server"].max_num_seqs, seen["server"].max_num_batched_tokens) == (6, 512)
    assert (seen["server"].block_size, seen["server"].num_gpu_blocks) == (BLOCK, BLOCKS)


def _synthetic_pass(stalled: bool) -> list:
    """One calibration pass's timings from a known step cost: every shape three times; ``stalled``: every other
    shape is held up by 2 s in two of its three rounds (a host busy with other work)."""
    from kvscope.harness.cachemodel.calibration import StepCostModel, batch_sample, prefill_sample

    truth = StepCostModel(base_s=0.004, per_token_s=3e-5, per_seq_s=2e-4, per_context_token_s=1e-7,
                          request_overhead_s=0.003, per_prefill_pair_s=0.0)
    shapes = [prefill_sample(n, 0.0, 512) for n in (16, 64, 256, 512, 900)]
    shapes += [prefill_sample(n, 0.0, 512, cached_tokens=(n - 1) // 16 * 16) for n in (64, 256, 900)]
    shapes += [batch_sample(b, n, 0, 24, 0.0) for b in (1, 2, 4, 8) for n in (64, 900)]
    out = []
    for round_ in range(3):
        for i, s in enumerate(shapes):
            seconds = sum(c * f for c, f in zip(truth.as_dict().values(), s.features()))
            out.append(replace(s, seconds=seconds + (2.0 if stalled and i % 2 and round_ < 2 else 0.0)))
    return out


@pytest.mark.parametrize("passes, settles", [([True, False], True), ([True, True, True], False)])
def test_a_poor_calibration_fit_is_measured_again_with_new_prompts(server, tmp_path, monkeypatch, passes, settles):
    """A pass timed on a busy host (R² < 0.5) is followed by another, with new prompts (another seed: the same
    ones would hit the cache the first pass filled), the passes' timings pooled into the medians; at most two
    extra passes, after which the poor fit is written as it is (the callers refuse to predict from it)."""
    from kvscope.harness.cachemodel.calibration import MIN_FIT_R2
    from kvscope.harness.replay import calibrate
    from kvscope.harness.serving.backend import Backend

    seeds = []

    def measure(endpoint, model, srv, *, seed, **kw):
        seeds.append(seed)
        return _synthetic_pass(passes[len(seeds) - 1])

    monkeypatch.setattr(calibrate, "measure_samples", measure)
    cal = calibrate.calibrate_server(Backend.create("vllm", endpoint=server.endpoint), tmp_path / "c.json")
    assert seeds == list(range(len(passes)))
    assert (cal.fit_r2 >= MIN_FIT_R2) is settles
    if settles:  # the clean pass's timings outvote the stalled ones in every shape's median
        assert cal.fit_r2 > 0.99 and cal.cost.per_token_s == pytest.approx(3e-5, rel=0.05)
