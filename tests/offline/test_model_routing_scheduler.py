"""Model routing under concurrency: one scheduler model per model, sessions moving between them. Routing every
request to one model is that model's scheduler prediction exactly; one session at a time is the sequential
routed simulator; an escalation's large attempt is sent when the small answer is done."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvscope.harness.cachemodel import model_routing as M
from kvscope.harness.cachemodel.calibration import StepCostModel
from kvscope.harness.cachemodel.model_routing_scheduler import run_routed_pinned, run_routed_scheduler
from kvscope.harness.cachemodel.scheduler import SchedulerConfig, SessionTiming, run_scheduler

from tests.offline.test_model_routing import write_trace

COST = StepCostModel(0.004, 3e-5, 2e-4, 1e-7, 0.006, 2e-8)
SLOW = StepCostModel(0.012, 9e-5, 6e-4, 3e-7, 0.018, 6e-8)


def _spec(policy: dict, stickiness: str = "per-step", small_bs: int = 16, large_bs: int = 16) -> M.ModelRoutingSpec:
    return M.load_spec({"models": [{"name": "small", "block_size": small_bs}, {"name": "large", "block_size": large_bs}],
                        "policy": policy, "stickiness": stickiness})


def _run(inputs: M.RoutingInputs, spec: M.ModelRoutingSpec, blocks: dict[str, int | None], concurrency: int | None,
         **kw):
    configs = {m.name: SchedulerConfig(m.block_size, blocks[m.name], max_num_batched_tokens=256) for m in spec.models}
    attempts = M.route_requests(inputs.facts, spec)
    return run_routed_scheduler(attempts, inputs.facts, inputs.requests_by_block, spec, configs,
                                {"small": COST, "large": SLOW}, SessionTiming(concurrency=concurrency), **kw), configs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sessions=st.integers(2, 5), steps=st.integers(2, 5), seed=st.integers(0, 10_000),
       concurrency=st.sampled_from([1, 2, 4, None]), blocks=st.sampled_from([None, 24, 40]),
       which=st.sampled_from(["all-small", "all-large"]), block_size=st.sampled_from([16, 32]))
def test_everything_on_one_model_is_that_models_scheduler_prediction_exactly(tmp_path_factory, sessions, steps, seed,
                                                                            concurrency, blocks, which, block_size):
    shape = [[(20 + (seed + 5 * s + 13 * k) % 60, 3 + (seed + s + k) % 11) for k in range(steps)]
             for s in range(sessions)]
    trace = write_trace(tmp_path_factory.mktemp("rs") / "t", shape, seed=seed)
    spec = _spec({"kind": which}, small_bs=block_size, large_bs=block_size)
    inputs = M.load_routing_inputs(trace, [block_size])
    one = "small" if which == "all-small" else "large"
    got, configs = _run(inputs, spec, {"small": blocks, "large": blocks}, concurrency)
    want = run_scheduler(inputs.requests_by_block[block_size], configs[one], COST if one == "small" else SLOW,
                         SessionTiming(concurrency=concurrency))
    assert [r.cached_tokens for r in got.routed] == want.cached_tokens
    mine = [a[0] for a in got.attempts]
    assert [(r.arrival_s, r.first_token_s, r.done_s, r.preemptions) for r in mine] == \
        [(r.arrival_s, r.first_token_s, r.done_s, r.preemptions) for r in want.results]
    assert got.servers[one].steps == want.steps and got.servers[one].preemptions == want.preemptions
    other = "large" if one == "small" else "small"
    assert got.servers[other].steps == 0


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    shape = [[(30 + 7 * s + 11 * k, 5 + (3 * s + k) % 17) for k in range(6)] for s in range(5)]
    return write_trace(tmp_path_factory.mktemp("rs-mixed") / "trace", shape)


@pytest.mark.parametrize("policy,stickiness", [
    ({"kind": "rule", "rules": [{"model": "large", "input_kind": ["tool_output"]}]}, "per-step"),
    ({"kind": "cascade", "max_output_tokens": 10}, "per-step"),
    ({"kind": "cascade", "max_output_tokens": 10}, "sticky-after-escalation"),
])
def test_one_session_at_a_time_is_the_sequential_routed_simulator(trace_dir, policy, stickiness):
    """Closed loop at concurrency 1: requests never overlap, so each pool sees its attempts in order, exactly as
    the sequential model (both unbounded and a pool that evicts)."""
    for blocks in (None, 30):
        spec = _spec(policy, stickiness).model_copy(update={"models": [
            M.ModelSpec(name="small", num_gpu_blocks=blocks), M.ModelSpec(name="large", num_gpu_blocks=blocks)]})
        inputs = M.load_routing_inputs(trace_dir, [16])
        got, _ = _run(inputs, spec, {"small": blocks, "large": blocks}, 1)
        want = M.simulate_routes(M.route_requests(inputs.facts, spec), inputs.facts, inputs.requests_by_block, spec)
        assert [r.as_dict() for r in got.routed] == [r.as_dict() for r in want]
        assert sum(r.model_switch_tokens for r in want) > 0


def test_an_escalation_goes_to_the_large_model_when_the_small_answer_is_done(trace_dir):
    spec = _spec({"kind": "cascade", "max_output_tokens": 10})
    inputs = M.load_routing_inputs(trace_dir, [16])
    got, _ = _run(inputs, spec, {"small": None, "large": None}, 3)
    escalated = [(r, a) for r, a in zip(got.routed, got.attempts) if r.escalated]
    assert escalated and all(len(a) == 2 for _, a in escalated)
    for r, (small, large) in escalated:
        assert large.arrival_s == small.done_s  # sent at once, no think time
        assert r.small_attempt_model == "small" and r.wasted_output_tokens == r.output_tokens
        assert r.wasted_prefill_tokens == r.prompt_tokens - small.cached_tokens
    # under concurrency the sessions overlap on each server
    assert got.servers["small"].max_running > 1
    assert got.makespan_s > 0


def test_pinned_attempts_run_each_model_alone(trace_dir):
    spec = _spec({"kind": "rule", "rules": [{"model": "large", "input_kind": ["tool_output"]}]})
    inputs = M.load_routing_inputs(trace_dir, [16])
    free, configs = _run(inputs, spec, {"small": 40, "large": 40}, 2)
    sent = [[r.arrival_s for r in a] for a in free.attempts]
    done = [[r.done_s for r in a] for a in free.attempts]
    pinned = run_routed_pinned(M.route_requests(inputs.facts, spec), inputs.facts, inputs.requests_by_block, spec,
                               configs, {"small": COST, "large": SLOW}, sent, done)
    assert sorted(i for rows in pinned.values() for i, _k, _r in rows) == list(range(len(inputs.facts)))
    for m, rows in pinned.items():
        assert all(spec.model_names and M.route_requests(inputs.facts, spec)[i][k].model == m for i, k, _ in rows)
    # pinned on the free-running model's own times, each request gets the cached tokens that run predicted
    got = {i: r.cached_tokens for rows in pinned.values() for i, _k, r in rows}
    assert [got[i] for i in range(len(inputs.facts))] == [r.cached_tokens for r in free.routed]


def test_a_scheduler_block_size_other_than_the_specs_is_refused(trace_dir):
    spec = _spec({"kind": "all-small"})
    inputs = M.load_routing_inputs(trace_dir, [16])
    with pytest.raises(ValueError, match="block size 32"):
        run_routed_scheduler(M.route_requests(inputs.facts, spec), inputs.facts, inputs.requests_by_block, spec,
                             {"small": SchedulerConfig(32), "large": SchedulerConfig(16)},
                             {"small": COST, "large": SLOW}, SessionTiming(concurrency=2))


# ------------------------------------------------------------------------------------------ kvscope route --concurrency

def _calibration(path):
    from kvscope.harness.results.loaders import write_result_file
    from kvscope.harness.results.schemas import CalibrationCost, CalibrationFile, CalibrationServer

    write_result_file(path, CalibrationFile, CalibrationFile(
        created_at=0.0, server=CalibrationServer(block_size=16, max_num_batched_tokens=256),
        cost=CalibrationCost(base_s=0.004, per_token_s=3e-5, per_seq_s=2e-4, per_context_token_s=1e-7,
                             request_overhead_s=0.006, per_prefill_pair_s=2e-8),
        fit_r2=0.95, fit_median_rel_error=0.05))
    return path


def test_route_under_concurrency_prices_latency_and_self_hosting(trace_dir, tmp_path, capsys):
    import json

    from kvscope.harness.cli.main import main
    from kvscope.harness.pricing.model_routing import evaluate_policy_timed
    from kvscope.harness.results.loaders import load_calibration

    cal = _calibration(tmp_path / "cal.json")
    out = tmp_path / "route.json"
    rc = main(["route", str(trace_dir), "--policy", "cascade", "--cascade-max-output-tokens", "10", "--concurrency",
               "3", "--calibration", str(cal), "--large-time-factor", "3", "--small-gpu-hourly-usd", "1",
               "--large-gpu-hourly-usd", "4", "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "at concurrency 3" in text and "self-hosted" in text
    d = json.loads(out.read_text())
    lat, sh = d["latency"], d["self_hosted"]
    # the JSON is the pricing layer's evaluation under concurrency, figure for figure
    spec = M.load_spec({"policy": {"kind": "cascade", "max_output_tokens": 10}})
    c = load_calibration(cal)
    ev = evaluate_policy_timed(spec, M.load_routing_inputs(trace_dir, [16]), c.cost_model(), c.scheduler_config(), 3,
                               large_time_factor=3, gpu_hourly_usd={"small": 1.0, "large": 4.0})
    assert lat["ttft_p50_s"] == pytest.approx(ev.latency["ttft_p50_s"]) and d["cached_tokens"] == ev.totals["cached_tokens"]
    # an escalated request waits for the small answer: its TTFT is above the median
    assert lat["escalated_ttft_p50_s"] > lat["ttft_p50_s"]
    busy = {m: s["busy_s"] for m, s in lat["servers"].items()}
    assert sh["total_usd"] == pytest.approx(busy["small"] / 3600 * 1 + busy["large"] / 3600 * 4)
    assert "ttft_p50_s" in d["other_stickiness"]


@pytest.mark.parametrize("extra,needle", [
    (["--concurrency", "2"], "--concurrency needs --calibration"),
    (["--calibration", "CAL"], "--calibration is read with --concurrency"),
    (["--concurrency", "2", "--calibration", "CAL", "--sweep"], "--sweep ranks variants"),
    (["--small-gpu-hourly-usd", "1", "--large-gpu-hourly-usd", "2"], "needs --concurrency"),
    (["--concurrency", "2", "--calibration", "CAL", "--small-gpu-hourly-usd", "1"], "give both"),
])
def test_route_concurrency_flags_bad_input_is_one_line_exit_2(trace_dir, tmp_path, capsys, extra, needle):
    from kvscope.harness.cli.main import main

    cal = str(_calibration(tmp_path / "cal.json"))
    rc = main(["route", str(trace_dir), "--no-progress", *[cal if x == "CAL" else x for x in extra]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_route_large_time_factor_must_be_positive(trace_dir, capsys):
    from kvscope.harness.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["route", str(trace_dir), "--large-time-factor", "0"])
    assert exc.value.code == 2 and "--large-time-factor" in capsys.readouterr().err
