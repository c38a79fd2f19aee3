"""GPU prediction: hardware and model data, the roofline step cost, speculation in the scheduler model, and
`kvscope predict` (bad input: one line, exit 2)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from kvscope.harness.cachemodel import gpu_predict as gp
from kvscope.harness.cachemodel.calibration import StepCostModel
from kvscope.harness.cachemodel.gpus import Efficiency, get_gpu, load_gpus
from kvscope.harness.cachemodel.kv_memory import kv_bytes_per_token
from kvscope.harness.cachemodel.model_config import bundled_models, load_model_config
from kvscope.harness.cachemodel.roofline import decode_tokens_per_s_upper_bound, roofline_step_cost
from kvscope.harness.cachemodel.scheduler import SchedulerConfig, SessionTiming, run_scheduler
from kvscope.harness.cachemodel.spec_predict import draft_acceptance_pattern, parse_speculative
from kvscope.harness.cachemodel.step_cost import StepCost
from kvscope.harness.cli.main import main

IDEAL = Efficiency(mfu=1.0, bandwidth_efficiency=1.0, step_overhead_ms=0.0, allreduce_latency_us=0.0,
                   request_overhead_ms=0.0)

# Public parameter counts (model cards / safetensors index totals), in billions.
PUBLIC_PARAMS_B = {"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55, "llama-2-7b": 6.74, "llama-2-13b": 13.02,
                   "llama-2-70b": 68.98, "mistral-7b": 7.25, "qwen2.5-7b": 7.62, "qwen2.5-32b": 32.76,
                   "qwen2.5-72b": 72.71, "codellama-34b": 33.74, "mixtral-8x7b": 46.70}


# -- data ---------------------------------------------------------------------------------------------------

def test_every_gpu_the_issue_names_has_datasheet_figures_and_a_source():
    ids = {g.key for g in load_gpus()}
    assert {"h100-sxm", "h200-sxm", "a100-80gb-sxm", "l40s", "b200", "mi300x"} <= ids
    for g in load_gpus():
        assert g.bf16_tflops and g.bandwidth_gb_s and g.interconnect_gb_s and g.source, g.key
        assert g.fp8_tflops is None or g.fp8_tflops == pytest.approx(2 * g.bf16_tflops, rel=0.02), g.key
    # dense, not the datasheet's "with sparsity" headline
    assert get_gpu("h100").bf16_tflops == pytest.approx(989.5)
    assert get_gpu("A100 80GB").fp8_tflops is None


def test_bundled_models_match_their_public_parameter_counts():
    assert set(PUBLIC_PARAMS_B) <= set(bundled_models())
    for name, billions in PUBLIC_PARAMS_B.items():
        assert load_model_config(name).params_total / 1e9 == pytest.approx(billions, abs=0.01), name
    mixtral = load_model_config("mixtral-8x7b")
    assert mixtral.params_active / 1e9 == pytest.approx(12.88, abs=0.01)  # 2 of 8 experts a token
    assert load_model_config("llama-3.1-8b").params_active == load_model_config("llama-3.1-8b").params_total
    v01 = load_model_config("mistral-7b-v0.1")
    assert (v01.sliding_window, v01.num_sliding_layers) == (4096, 32)


def test_kv_bytes_per_token_reuse_the_kv_memory_formula():
    m = load_model_config("llama-3.1-70b")
    assert kv_bytes_per_token(m.shape(), None, 4) == 2 * 80 * 2 * 128 * 2
    dep = gp.plan_deployment("h200-sxm", m, tp=4, settings=gp.ServerSettings(kv_cache_dtype="fp8"))
    assert dep.kv_bytes_per_token_per_gpu == 2 * 80 * 2 * 128 * 1
    per_block = dep.settings.block_size * dep.kv_bytes_per_token_per_gpu
    assert dep.num_gpu_blocks == int(dep.available_kv_bytes_per_gpu // per_block)


def test_fp8_kv_doubles_the_pool_and_tp_splits_the_weights():
    bf16 = gp.plan_deployment("h100-sxm", "llama-3.1-8b")
    fp8 = gp.plan_deployment("h100-sxm", "llama-3.1-8b", settings=gp.ServerSettings(kv_cache_dtype="fp8"))
    assert fp8.num_gpu_blocks == pytest.approx(2 * bf16.num_gpu_blocks, abs=1)
    tp2 = gp.plan_deployment("h100-sxm", "llama-3.1-8b", tp=2)
    assert tp2.weight_bytes_per_gpu == pytest.approx(bf16.weight_bytes_per_gpu / 2)
    assert tp2.num_gpu_blocks > 2 * bf16.num_gpu_blocks  # half the weights and half the KV heads per GPU


def test_bad_deployments_name_the_problem():
    with pytest.raises(ValueError, match="unknown GPU 'h900'.*h100-sxm"):
        gp.plan_deployment("h900", "llama-3.1-8b")
    with pytest.raises(ValueError, match="does not divide .* 32 attention heads"):
        gp.plan_deployment("h100-sxm", "llama-3.1-8b", tp=3)
    with pytest.raises(gp.DoesNotFit, match="does not fit on h100-sxm with tp 1"):
        gp.plan_deployment("h100-sxm", "llama-3.1-70b")
    assert gp.plan_deployment("h100-sxm", "llama-3.1-70b", tp=2).num_gpu_blocks > 0


# -- the step model -----------------------------------------------------------------------------------------

def test_decode_step_at_batch_one_is_the_seed_roofline():
    """The seed's figure: an 8B bf16 model at 3.35 TB/s cannot exceed ~209 tokens/s at B=1 (16 GB of weights
    streamed a token).  The step model with ideal efficiency is that bound for the bytes it streams: every
    weight but the input embedding table (a lookup), 15.0 GB for Llama-3.1-8B, hence 223 tokens/s."""
    assert decode_tokens_per_s_upper_bound(3.35e12, 16e9) == pytest.approx(209.4, abs=0.1)
    m = load_model_config("llama-3.1-8b")
    cost = roofline_step_cost(get_gpu("h100-sxm"), m, efficiency=IDEAL)
    streamed = (m.params_total - m.vocab_size * m.hidden_size) * 2
    assert cost.decode_tokens_per_s(1) == pytest.approx(decode_tokens_per_s_upper_bound(3.35e12, streamed), rel=1e-3)
    assert 209 < cost.decode_tokens_per_s(1) < 209 * 1.08
    # batching: memory-bound, so 8 sequences decode ~8x the tokens for about the same step
    assert cost.decode_tokens_per_s(8) == pytest.approx(8 * cost.decode_tokens_per_s(1), rel=0.02)


def test_prefill_is_compute_bound_and_decode_memory_bound():
    cost = roofline_step_cost(get_gpu("h100-sxm"), load_model_config("llama-3.1-8b"))
    assert cost.compute_s(8192, 1, 0, 8192 * 4096) > cost.memory_s(8192, 0)
    assert cost.compute_s(8, 8, 8 * 1000) < cost.memory_s(8, 8 * 1000)
    h200 = roofline_step_cost(get_gpu("h200-sxm"), load_model_config("llama-3.1-8b"))
    assert h200.step_s(8, 8, 8000) < cost.step_s(8, 8, 8000)  # more bandwidth, same FLOPs


def test_tp_adds_two_allreduces_per_layer():
    m = load_model_config("llama-3.1-70b")
    g = get_gpu("h200-sxm")
    c4 = roofline_step_cost(g, m, tp=4)
    assert c4.allreduces_per_step == 160
    assert c4.comm_s(1) == pytest.approx(160 * (8e-6 + 2 * 3 / 4 * 8192 * 2 / 450e9))
    assert roofline_step_cost(g, m, tp=8).comm_s(1000) > c4.comm_s(1000)


def test_moe_reads_the_experts_its_tokens_touch():
    cost = roofline_step_cost(get_gpu("h100-sxm"), load_model_config("mixtral-8x7b"), tp=2)
    one, many = cost.memory_s(1, 0), cost.memory_s(256, 0)
    assert many > 2.5 * one  # 2 of 8 experts at one token, nearly all at 256
    assert cost.compute_s(1, 1, 0) < cost.compute_s(2, 1, 0)


@pytest.mark.parametrize("cost", [
    roofline_step_cost(get_gpu("h100-sxm"), load_model_config("llama-3.1-8b")),
    roofline_step_cost(get_gpu("l40s"), load_model_config("qwen2.5-7b")),
    StepCostModel(0.004, 1e-5, 2e-4, 3e-7, 0.01, 1e-9),
])
def test_decode_run_is_the_sum_of_its_steps(cost: StepCost):
    """The scheduler's fast-forward asks for a run of decode steps in closed form; it must equal stepping."""
    assert isinstance(cost, StepCost)
    rng = random.Random(0)
    for _ in range(300):
        m, ctx, n = rng.randint(1, 400), rng.uniform(0, 3e6), rng.randint(0, 60)
        stepped = sum(cost.step_s(m, m, ctx + m * j) for j in range(1, n + 1))
        assert cost.decode_run_s(m, ctx, n) == pytest.approx(stepped, rel=1e-9, abs=1e-12)


# -- speculation in the scheduler ---------------------------------------------------------------------------

def _alone(prompt: int, out: int, drafted=None, accepted=None, cost=None):
    [r] = gp.synthetic_requests([prompt], [out], block_size=16)
    r.spec_drafted, r.spec_accepted = drafted, accepted
    cost = cost or StepCostModel(0.01, 0.0, 0.0, 0.0, 0.0, 0.0)
    run = run_scheduler([r], SchedulerConfig(block_size=16, num_gpu_blocks=1000), cost, SessionTiming(concurrency=1))
    return run, r


def test_a_speculative_step_emits_one_plus_accepted_tokens():
    base, _ = _alone(64, 41)
    assert base.steps == 1 + 40  # prefill (first token) + one decode step a token
    spec, r = _alone(64, 41, drafted=[4] * 40, accepted=[3] * 40)
    assert spec.steps == 1 + 10  # 4 tokens a step
    assert spec.results[0].done_s == pytest.approx(11 * 0.01)
    pred = gp._from_run([r], spec, 1).requests[0]
    assert pred.itl_s == pytest.approx(0.01) and pred.tpot_s == pytest.approx(0.0025)
    # steps without a draft emit one token and are not fast-forwarded past the drafting ones
    mixed, _ = _alone(64, 41, drafted=[0] * 5 + [4] * 40, accepted=[0] * 5 + [3] * 40)
    assert mixed.steps == 1 + 5 + 9


def test_speculative_drafts_count_against_the_budget_and_cost_their_tokens():
    cost = StepCostModel(0.0, 1e-3, 0.0, 0.0, 0.0, 0.0)  # a step costs its tokens
    spec, _ = _alone(32, 9, drafted=[4, 4], accepted=[4, 3], cost=cost)
    # prefill 32 tokens, then 2 steps of 1 + 4 tokens emitting 5 and 4 (9 - 1 = 8 needed)
    assert spec.steps == 3
    assert spec.makespan_s == pytest.approx((32 + 5 + 5) * 1e-3)


def test_draft_acceptance_pattern_has_the_expected_mean():
    pat = draft_acceptance_pattern(4, 0.7, 1000)
    assert np.mean(pat) == pytest.approx(0.7 + 0.49 + 0.343 + 0.2401, abs=0.01)
    assert max(pat) <= 4


def test_speculative_spec_strings():
    assert parse_speculative("ngram:k=3,min=1,max=3").offline_config().prompt_lookup_max == 3
    assert parse_speculative("suffix").k == 24
    with pytest.raises(ValueError, match="unknown method 'eagle'"):
        parse_speculative("eagle")
    with pytest.raises(ValueError, match="acceptance"):
        parse_speculative("draft:k=4")


# -- predict ------------------------------------------------------------------------------------------------

def test_closed_loop_prediction_gives_every_request_its_times():
    dep = gp.plan_deployment("h100-sxm", "llama-3.1-8b")
    reqs = gp.synthetic_requests([2000] * 16, [100] * 16, shared_prefix_tokens=1024)
    out = gp.predict_workload(reqs, dep, concurrency=4)
    assert len(out.requests) == 16 and all(r.fits for r in out.requests)
    for r in out.requests:
        assert 0 < r.ttft_s < r.e2e_s and r.tpot_s > 0
    assert sum(r.cached_tokens == 1024 for r in out.requests) >= 12  # the shared prefix hits after the first
    assert out.output_tokens_per_s > 0
    faster = gp.predict_workload(reqs, gp.plan_deployment("h200-sxm", "llama-3.1-8b"), concurrency=4)
    assert faster.makespan_s < out.makespan_s


def _write_trace(path, sessions=3, steps=4, seed=0):
    from kvscope.workloads.trace import TraceBuilder

    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    for si in range(sessions):
        ids: list[int] = []
        for step in range(steps):
            ids = ids + [b.add_segment(rng.integers(0, 50, 300).astype(np.int32), "user")]
            out = np.tile(rng.integers(0, 50, 8), 6).astype(np.int32)  # repetitive: n-gram drafts hit
            oid = b.add_segment(out, "assistant")
            b.add_request(session_id=f"s{si}", step=step, parent_request_id=-1 if step == 0 else 0,
                          arrival_s=float(si), session_start_s=float(si), think_time_s=0.5,
                          prompt_segment_ids=list(ids), output_segment_id=oid, output_tokens=len(out),
                          transition="first" if step == 0 else "append")
            ids = ids + [oid]
    return b.build({"name": "t"}).write(path)


def test_predict_cli_writes_a_typed_prediction(tmp_path, capsys):
    from kvscope.harness.results.prediction_file import load_prediction_file

    trace = _write_trace(tmp_path / "trace")
    out = tmp_path / "prediction.json"
    rc = main(["predict", str(trace), "--gpu", "h100-sxm", "--model", "llama-3.1-8b", "--concurrency", "2",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "PREDICTED llama-3.1-8b on 1 x h100-sxm" in text and "per 1,000 sessions" in text
    p = load_prediction_file(out)
    assert p.predicted and p.run.concurrency == 2 and len(p.requests) == 12
    assert [pt.load for pt in p.load_curve] == [1, 2, 3]
    assert p.cost is not None and p.cost.usd_per_1000_sessions > 0
    assert p.run.token_hit_rate > 0.5  # append-only sessions reuse their prefix
    assert json.loads(out.read_text())["format"] == "kvscope-prediction"
    # levels simulated in parallel processes give the same curve
    out2 = tmp_path / "parallel.json"
    assert main(["predict", str(trace), "--gpu", "h100-sxm", "--model", "llama-3.1-8b", "--concurrency", "2",
                 "--out", str(out2), "--no-progress", "--jobs", "2"]) == 0
    p2 = load_prediction_file(out2)
    drop = {"simulate_s"}
    assert [pt.model_dump(exclude=drop) for pt in p2.load_curve] == [pt.model_dump(exclude=drop) for pt in p.load_curve]
    assert p2.requests == p.requests


def test_predict_cli_speculative_ngram_lowers_tpot(tmp_path, capsys):
    from kvscope.harness.results.prediction_file import load_prediction_file

    trace = _write_trace(tmp_path / "trace")
    tpot = {}
    for name, extra in {"plain": [], "ngram": ["--speculative", "ngram:k=4,min=2,max=4"]}.items():
        out = tmp_path / f"{name}.json"
        assert main(["predict", str(trace), "--gpu", "h100-sxm", "--model", "llama-3.1-8b", "--concurrency", "1",
                     "--levels", "1", "--out", str(out), "--no-progress", *extra]) == 0
        tpot[name] = load_prediction_file(out).run.tpot_mean_s
    assert tpot["ngram"] < 0.6 * tpot["plain"]  # the repetitive outputs are drafted and accepted


@pytest.mark.parametrize("args, message", [
    (["--gpu", "h900", "--model", "llama-3.1-8b"], "unknown GPU 'h900'"),
    (["--gpu", "h100-sxm", "--model", "llama-3.1-8b", "--tp", "3"], "does not divide"),
    (["--gpu", "h100-sxm", "--model", "llama-3.1-70b"], "does not fit on h100-sxm"),
    (["--gpu", "h100-sxm", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--gpu", "h100-sxm", "--model", "BROKEN"], "missing field 'intermediate_size'"),
    (["--gpu", "h100-sxm", "--model", "llama-3.1-8b", "--speculative", "eagle"], "unknown method 'eagle'"),
    (["--gpu", "h100-sxm", "--model", "llama-3.1-8b", "--kv-cache-dtype", "fp7"], "unknown dtype 'fp7'"),
    (["--model", "llama-3.1-8b"], "give --gpu and --model"),
])
def test_predict_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    trace = _write_trace(tmp_path / "trace", sessions=1, steps=1)
    broken = tmp_path / "config.json"
    broken.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "vocab_size": 100}))
    args = [str(broken) if a == "BROKEN" else a for a in args]
    assert main(["predict", str(trace), *args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_predict_with_a_cpu_calibration_is_the_scheduler_model_of_that_server(tmp_path):
    """The CPU path: --calibration's step costs and server settings, run through the same scheduler model
    `kvscope capacity` uses; the per-request cached tokens are that model's."""
    import time

    from kvscope.harness.cachemodel.trace_io import load_trace
    from kvscope.harness.results.prediction_file import load_prediction_file
    from kvscope.harness.results.schemas import CalibrationCost, CalibrationFile, CalibrationServer
    from kvscope.workloads.versioned_file import write_versioned

    trace = _write_trace(tmp_path / "trace", sessions=4, steps=5)
    cal = CalibrationFile(created_at=time.time(), fit_r2=0.99, fit_median_rel_error=0.03,
                          server=CalibrationServer(block_size=32, num_gpu_blocks=40, max_num_seqs=8,
                                                   max_num_batched_tokens=512),
                          cost=CalibrationCost(base_s=0.004, per_token_s=2e-5, per_seq_s=3e-4,
                                               per_context_token_s=1e-7, request_overhead_s=0.01,
                                               per_prefill_pair_s=1e-9))
    write_versioned(tmp_path / "cal.json", cal)
    out = tmp_path / "p.json"
    assert main(["predict", str(trace), "--calibration", str(tmp_path / "cal.json"), "--concurrency", "3",
                 "--levels", "1,3", "--out", str(out), "--no-progress"]) == 0
    p = load_prediction_file(out)
    assert p.step_model.kind == "calibration" and p.deployment.block_size == 32 and p.cost is None
    reqs = load_trace(trace, 32).requests
    run = run_scheduler(reqs, cal.scheduler_config(), cal.cost_model(), SessionTiming(concurrency=3))
    assert [r.cached_tokens for r in p.requests] == run.cached_tokens
    assert p.run.preemptions == run.preemptions


def test_serving_cost_splits_the_hour_by_prefill_time_and_charges_idle_time():
    from kvscope.harness.pricing.gpu_cost import gpu_hour_price, serving_cost

    price = gpu_hour_price("h100-sxm")
    assert price is not None and price.source and price.as_of
    c = serving_cost(usd_per_gpu_hour=3.6, price_source="t", num_gpus=2, makespan_s=1000.0, prefill_s=100.0,
                     busy_s=400.0, input_tokens=1_000_000, output_tokens=100_000, sessions=10)
    assert c.total_usd == pytest.approx(2 * 3.6 * 1000 / 3600)  # $2 for 2 GPUs x 1000 s
    assert c.input_time_share == pytest.approx(0.25) and c.utilization == pytest.approx(0.4)
    assert c.usd_per_mtok_input == pytest.approx(2.0 * 0.25)
    assert c.usd_per_mtok_output == pytest.approx(2.0 * 0.75 / 0.1)
    assert c.usd_per_1000_sessions == pytest.approx(200.0)
    assert c.busy_usd_per_1000_sessions == pytest.approx(80.0)


@pytest.mark.parametrize("spec_costs", [(0.0, 0.0), (3e-3, 4e-4)])
def test_a_lone_speculative_request_has_the_offline_models_tpot(spec_costs):
    """One request alone: the scheduler model's speculative steps are the offline model's steps, so its TPOT is
    `speculative.predicted_tpot_s` (each step costs `step_s(1 + drafts, 1, context)`, plus a verifying
    sequence's and its draft tokens' own costs where the calibration has them)."""
    from kvscope.harness.cachemodel.speculative import NgramConfig, predicted_tpot_s, simulate_request

    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 40, 200).tolist()
    output = (prompt[50:70] * 4)[:61]
    sim = simulate_request(prompt, output, NgramConfig(4, 2, 4))
    assert sim.accepted_tokens > 10
    cost = StepCostModel(0.004, 1e-4, 3e-4, 2e-6, 0.0, 1e-8, *spec_costs)
    [r] = gp.synthetic_requests([len(prompt)], [len(output)], block_size=16)
    r.spec_drafted, r.spec_accepted = sim.drafted.tolist(), sim.accepted.tolist()
    run = run_scheduler([r], SchedulerConfig(block_size=16, num_gpu_blocks=None), cost, SessionTiming(concurrency=1))
    pred = gp._from_run([r], run, 1).requests[0]
    assert pred.tpot_s == pytest.approx(predicted_tpot_s(sim, cost), rel=1e-9)
    if spec_costs[0]:  # the verifying steps' own costs are in the TPOT: sim.num_drafts steps and their drafts
        plain = StepCostModel(0.004, 1e-4, 3e-4, 2e-6, 0.0, 1e-8)
        extra_s = spec_costs[0] * sim.num_drafts + spec_costs[1] * sim.draft_tokens
        assert pred.tpot_s - predicted_tpot_s(sim, plain) == pytest.approx(extra_s / (len(output) - 1), rel=1e-9)


def test_kv_memory_presets_agree_with_the_bundled_configs():
    """`kv_memory.PRESETS` (the capacity-planning table's shapes) and the bundled config.json files describe
    the same models: they must not drift apart."""
    from kvscope.harness.cachemodel.kv_memory import PRESETS

    shared = set(PRESETS) & set(bundled_models())
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "mistral-7b", "llama-2-7b"} <= shared
    for name in shared:
        preset, cfg = PRESETS[name], load_model_config(name)
        assert (preset.num_layers, preset.num_kv_heads, preset.head_dim) == \
            (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), name
        assert preset.params == pytest.approx(cfg.params_total, rel=0.002), name


def test_predict_open_loop_curve_and_a_draft_model(tmp_path, capsys):
    """Without --concurrency the trace's own arrivals are replayed and the curve is over rate multiples; a
    draft model with a given acceptance emits more tokens a step, and its own passes cost time."""
    from kvscope.harness.results.prediction_file import load_prediction_file

    trace = _write_trace(tmp_path / "trace")
    runs = {}
    for name, extra in {"plain": [], "draft": ["--speculative", "draft:k=3,acceptance=0.8"],
                        "draft-cost": ["--speculative", "draft:k=3,acceptance=0.8,draft_model=llama-2-7b"]}.items():
        out = tmp_path / f"{name}.json"
        assert main(["predict", str(trace), "--gpu", "h100-sxm", "--model", "llama-3.1-70b", "--tp", "2",
                     "--out", str(out), "--no-progress", *extra]) == 0
        runs[name] = load_prediction_file(out)
    plain = runs["plain"]
    assert plain.load_kind == "rate_multiplier" and plain.run.concurrency is None
    assert [pt.load for pt in plain.load_curve] == [0.25, 0.5, 1.0, 2.0, 4.0]
    assert runs["draft"].run.tpot_mean_s < 0.5 * plain.run.tpot_mean_s  # 1 + 0.8 + 0.64 + 0.51 tokens a step
    assert runs["draft"].run.tpot_mean_s < runs["draft-cost"].run.tpot_mean_s
    assert runs["draft"].speculative == "draft:k=3,acceptance=0.8"
