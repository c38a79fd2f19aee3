"""The scheduler model (harness/cachemodel/scheduler.py) on hand-built scenarios whose outcome is known."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.harness.cachemodel.calibration import StepCostModel, batch_sample, fit_cost_model, prefill_sample
from kvscope.harness.cachemodel.scheduler import SchedulerConfig, SessionTiming, run_scheduler
from kvscope.harness.cachemodel.simulator import SimConfig, requests_from_token_pairs, simulate

B = 16
#: One second per step whatever its content: times count steps.
STEPS = StepCostModel(base_s=1.0, per_token_s=0.0, per_seq_s=0.0, per_context_token_s=0.0)


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def at_once(n: int) -> SessionTiming:
    return SessionTiming(arrivals_s=[0.0] * n)


def test_single_request_equals_the_sequential_simulator_and_takes_prefill_plus_decode_steps():
    reqs = requests_from_token_pairs([(toks(100, 1), toks(5, 2))], B)
    run = run_scheduler(reqs, SchedulerConfig(B, 20), STEPS, at_once(1))
    assert run.cached_tokens == simulate(reqs, SimConfig(B, 20)).cached_tokens == [0]
    r = run.results[0]
    assert (r.scheduled_s, r.first_token_s, r.done_s) == (0.0, 1.0, 5.0)  # 1 prefill step + 4 decode steps
    # the same prompt again hits floor(99/16)=6 blocks, as the sequential simulator says
    reqs = requests_from_token_pairs([(toks(100, 1), toks(5, 2)), (toks(100, 1), toks(3, 3))], B)
    run = run_scheduler(reqs, SchedulerConfig(B, 20), STEPS, SessionTiming(concurrency=1))
    assert run.cached_tokens == simulate(reqs, SimConfig(B, 20)).cached_tokens == [0, 96]


def test_two_requests_sharing_a_prefix_in_one_step_hit_the_blocks_hashed_at_schedule_time():
    shared = toks(64, 7)
    reqs = requests_from_token_pairs([(shared + toks(10, 8), toks(3, 9)), (shared + toks(20, 10), toks(3, 11))],
                                     B, session_ids=["a", "b"])
    run = run_scheduler(reqs, SchedulerConfig(B, 50), STEPS, at_once(2))
    a, b = run.results
    assert a.scheduled_s == b.scheduled_s == 0.0  # one step
    assert (a.cached_tokens, b.cached_tokens) == (0, 64)
    assert run.steps == 3  # one joint prefill step + 2 joint decode steps


def test_the_last_running_request_is_preempted_when_blocks_run_out_and_hits_its_blocks_on_resume():
    # 11 usable blocks; each request: 48-token prompt (3 blocks) + 60 output tokens -> 7 blocks at the end.
    reqs = requests_from_token_pairs([(toks(48, 20), toks(60, 21)), (toks(48, 22), toks(60, 23))], B,
                                     session_ids=["a", "b"])
    run = run_scheduler(reqs, SchedulerConfig(B, 12), STEPS, at_once(2), fast_forward=False)
    a, b = run.results
    assert run.preemptions >= 1
    assert a.preemptions == 0 and b.preemptions >= 1  # FCFS: the later request is the victim
    assert b.resume_hit_tokens > 0  # its freed blocks kept their hashes in the free queue
    assert b.cached_tokens == 0  # cached_tokens is fixed at the first scheduling
    assert a.done_s < b.done_s
    assert all(r.done_s == r.done_s for r in run.results)  # both finished (not NaN)


def test_chunked_prefill_respects_max_num_batched_tokens():
    reqs = requests_from_token_pairs([(toks(100, 30), toks(2, 31))], B)
    run = run_scheduler(reqs, SchedulerConfig(B, None, max_num_batched_tokens=32), STEPS, at_once(1))
    r = run.results[0]
    assert r.first_token_s == 4.0  # ceil(100/32) prefill chunks
    assert r.done_s == 5.0
    # a decode shares the budget: while A decodes, B's 64-token prefill gets 31 tokens a step
    reqs = requests_from_token_pairs([(toks(10, 32), toks(10, 33)), (toks(64, 34), toks(1, 35))], B,
                                     session_ids=["a", "b"])
    timing = SessionTiming(arrivals_s=[0.0, 1.0])
    run = run_scheduler(reqs, SchedulerConfig(B, None, max_num_batched_tokens=32), STEPS, timing)
    assert run.results[1].first_token_s - run.results[1].arrival_s == 3.0  # 31 + 31 + 2 tokens


def test_max_num_seqs_caps_the_running_queue():
    reqs = requests_from_token_pairs([(toks(20, 40 + i), toks(4, 50 + i)) for i in range(5)], B)
    run = run_scheduler(reqs, SchedulerConfig(B, None, max_num_seqs=2), STEPS, at_once(5))
    assert run.max_running == 2
    starts = [r.scheduled_s for r in run.results]
    assert starts[:2] == [0.0, 0.0] and starts[2] == starts[3] == run.results[0].done_s


def test_closed_loop_sessions_wait_think_time_after_the_predecessor():
    pairs = [(toks(20, 60), toks(2, 61)), (toks(40, 60), toks(2, 62))]
    reqs = requests_from_token_pairs(pairs, B, session_ids=["s", "s"])
    reqs[1].gap_s = 5.0
    run = run_scheduler(reqs, SchedulerConfig(B, None), STEPS, SessionTiming(concurrency=1, time_scale=2.0))
    assert run.results[1].arrival_s == run.results[0].done_s + 10.0


def _random_pairs(rng: random.Random, n: int, sessions: int) -> tuple[list, list[str]]:
    history = {i: toks(rng.randrange(1, 3 * B), rng.random()) for i in range(sessions)}
    pairs, sids = [], []
    for _ in range(n):
        s = rng.randrange(sessions)
        out = toks(rng.randrange(1, 2 * B), rng.random())
        pairs.append((list(history[s]), out))
        sids.append(f"s{s}")
        history[s] = history[s] + out + toks(rng.randrange(1, 2 * B), rng.random())
        if len(history[s]) > 10 * B:
            history[s] = toks(rng.randrange(1, 3 * B), rng.random())
    return pairs, sids


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(1, 25), sessions=st.integers(1, 4),
       blocks=st.sampled_from([None, None, 30, 60]))
def test_one_seat_equals_the_sequential_simulator(seed, n, sessions, blocks):
    pairs, sids = _random_pairs(random.Random(seed), n, sessions)
    reqs = requests_from_token_pairs(pairs, B, session_ids=sids)
    cfg = SchedulerConfig(B, blocks, max_num_seqs=1, max_num_batched_tokens=64)
    expected = simulate(reqs, SimConfig(B, blocks)).cached_tokens
    for reference in (False, True):
        run = run_scheduler(reqs, cfg, STEPS, at_once(n), reference_pool=reference)
        assert run.cached_tokens == expected
        assert run.preemptions == 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(2, 30), blocks=st.sampled_from([12, 20, 40, None]),
       conc=st.integers(1, 6))
def test_fast_forward_and_the_ring_pool_change_nothing(seed, n, blocks, conc):
    pairs, sids = _random_pairs(random.Random(seed), n, 6)
    reqs = requests_from_token_pairs(pairs, B, session_ids=sids)
    for r in reqs:
        r.gap_s = 0.5
    cfg = SchedulerConfig(B, blocks, max_num_seqs=4, max_num_batched_tokens=48)
    cost = StepCostModel(0.01, 1e-4, 1e-3, 1e-5)
    timing = SessionTiming(concurrency=conc)
    fast = run_scheduler(reqs, cfg, cost, timing)
    for slow in (run_scheduler(reqs, cfg, cost, timing, fast_forward=False),
                 run_scheduler(reqs, cfg, cost, timing, fast_forward=False, reference_pool=True)):
        assert [r.cached_tokens for r in fast.results] == [r.cached_tokens for r in slow.results]
        assert [r.preemptions for r in fast.results] == [r.preemptions for r in slow.results]
        assert [r.resume_hit_tokens for r in fast.results] == [r.resume_hit_tokens for r in slow.results]
        assert [r.done_s for r in fast.results] == pytest.approx([r.done_s for r in slow.results])
        assert fast.steps == slow.steps and fast.evictions == slow.evictions


@given(seed=st.integers(0, 10_000), n=st.integers(2, 30), blocks=st.sampled_from([12, 20, 40]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_pinning_the_departures_the_model_itself_predicts_changes_nothing(seed, n, blocks):
    rng = random.Random(seed)
    pairs, sids = _random_pairs(rng, n, 6)
    reqs = requests_from_token_pairs(pairs, B, session_ids=sids)
    cfg = SchedulerConfig(B, blocks, max_num_seqs=4, max_num_batched_tokens=48)
    cost = StepCostModel(0.01, 1e-4, 1e-3, 1e-5)
    arrivals = sorted(rng.uniform(0, 2) for _ in range(n))
    free = run_scheduler(reqs, cfg, cost, SessionTiming(arrivals_s=arrivals))
    pinned = run_scheduler(reqs, cfg, cost, SessionTiming(arrivals_s=arrivals,
                                                          done_s=[r.done_s for r in free.results]))
    assert pinned.cached_tokens == free.cached_tokens
    assert [r.done_s for r in pinned.results] == pytest.approx([r.done_s for r in free.results])
    assert pinned.preemptions == free.preemptions and pinned.evictions == free.evictions


def test_a_pinned_late_departure_holds_its_blocks_until_then():
    # 11 usable blocks. A (7 blocks: 96-token prompt + 10 output) is done after 10 steps by the model, but the
    # run saw it leave at t=30; B (6 blocks, another prefix) arrives at t=15 and cannot be admitted before.
    reqs = requests_from_token_pairs([(toks(96, 40), toks(10, 41)), (toks(90, 42), toks(2, 43))], B,
                                     session_ids=["a", "b"])
    cfg = SchedulerConfig(B, 12)
    free = run_scheduler(reqs, cfg, STEPS, SessionTiming(arrivals_s=[0.0, 15.0]))
    assert free.results[0].done_s == 10.0 and free.results[1].scheduled_s == 15.0
    pinned = run_scheduler(reqs, cfg, STEPS, SessionTiming(arrivals_s=[0.0, 15.0], done_s=[30.0, 99.0]))
    a, b = pinned.results
    assert a.done_s == 30.0 and b.scheduled_s == 30.0


def test_pacing_keeps_decode_blocks_to_the_tokens_the_run_had_seen():
    # 11 usable blocks.  A (32-token prompt, 40 output tokens: 5 blocks at the end) decodes one token a step in the
    # model, but the run saw its tokens 3 s apart and A leave at t=118.  B (120-token prompt: 8 blocks) arrives
    # at t=30.  Unpaced, A has all 5 blocks by then (generated, parked) and B waits for A to leave; paced, A
    # has generated only the ~10 tokens seen by t=30 (3 blocks), so 8 blocks are free and B is admitted at once.
    reqs = requests_from_token_pairs([(toks(32, 60), toks(40, 61)), (toks(120, 62), toks(2, 63))], B,
                                     session_ids=["a", "b"])
    cfg = SchedulerConfig(B, 12)
    timing = dict(arrivals_s=[0.0, 30.0], done_s=[1.0 + 3.0 * 39, 999.0])
    unpaced = run_scheduler(reqs, cfg, STEPS, SessionTiming(**timing))
    paced = run_scheduler(reqs, cfg, STEPS, SessionTiming(**timing, token_times_s=[[1.0 + 3.0 * j for j in range(40)],
                                                                                   [999.0, 999.0]]))
    assert unpaced.results[1].scheduled_s == 118.0
    assert paced.results[1].scheduled_s == 30.0
    assert paced.results[0].done_s == 118.0
    # tokens the run had seen long before the model generates them: pacing never holds anything back
    seen_at_once = run_scheduler(reqs, cfg, STEPS, SessionTiming(**timing, token_times_s=[[0.0] * 40, [0.0] * 2]))
    assert [(r.scheduled_s, r.first_token_s, r.done_s) for r in seen_at_once.results] == \
        [(r.scheduled_s, r.first_token_s, r.done_s) for r in unpaced.results]


def test_a_pinned_early_departure_still_takes_the_blocks_of_its_ungenerated_tokens():
    # P (3 prompt blocks) finishes first and its blocks wait in the free queue; A's 100 output tokens need
    # 7 more blocks than its prompt, which evicts P's.  Pinned to leave after 5 steps, A must still evict P
    # (the server generated all 100 tokens), so Q (P's prompt again) gets the same hit either way.
    p_prompt = toks(49, 50)
    reqs = requests_from_token_pairs([(p_prompt, toks(1, 51)), (toks(32, 52), toks(100, 53)),
                                      (p_prompt, toks(1, 54))], B, session_ids=["p", "a", "q"])
    cfg = SchedulerConfig(B, 12)
    arrivals = [0.0, 2.0, 200.0]
    free = run_scheduler(reqs, cfg, STEPS, SessionTiming(arrivals_s=arrivals))
    pinned = run_scheduler(reqs, cfg, STEPS, SessionTiming(arrivals_s=arrivals, done_s=[1.0, 8.0, 999.0]))
    assert pinned.results[1].done_s == 8.0
    assert pinned.cached_tokens == free.cached_tokens
    assert pinned.evictions == free.evictions > 0


def _modelled(truth: StepCostModel, s) -> float:
    """A sample's seconds under known costs: the coefficients in the order of ``TimingSample.features``."""
    coef = [truth.base_s, truth.per_token_s, truth.per_seq_s, truth.per_context_token_s, truth.request_overhead_s,
            truth.per_prefill_pair_s, truth.per_spec_step_s, truth.per_draft_token_s]
    assert len(coef) == len(s.features())
    return sum(c * f for c, f in zip(coef, s.features()))


def test_cost_fit_recovers_known_coefficients():
    from dataclasses import replace

    truth = StepCostModel(0.02, 3e-5, 1e-3, 2e-7, 0.03, 4e-8)
    samples = [replace(s, seconds=_modelled(truth, s)) for s in
               [prefill_sample(p, 0.0, 2048) for p in (50, 200, 500, 1000, 1800, 3000)]
               + [prefill_sample(p, 0.0, 2048, cached_tokens=p - 20) for p in (500, 1800)]
               + [batch_sample(b, p, c, 20, 0.0) for b in (1, 2, 4, 8) for p, c in ((64, 0), (1000, 896))]]
    fit = fit_cost_model(samples)
    for name in ("base_s", "per_token_s", "per_seq_s", "per_context_token_s", "request_overhead_s",
                 "per_prefill_pair_s"):
        assert getattr(fit.model, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert fit.r2 > 0.999
    with pytest.raises(ValueError, match="at least 6"):
        fit_cost_model(samples[:2])


def test_prefill_attention_is_quadratic_in_the_chunk_and_decode_attention_linear_in_the_context():
    """One 2,000-token prefill attends ~2 M pairs, seven 300-token ones ~0.3 M: with one context feature the
    two cost the same (what made a concurrency-32 burst of short prefills too slow in the model)."""
    from kvscope.harness.cachemodel.calibration import prefill_pairs

    assert prefill_pairs(1, 99) == 100  # a decode-sized chunk: the whole context
    assert prefill_pairs(4, 0) == 4 + 3 + 2 + 1
    assert prefill_pairs(3, 10) == 11 + 12 + 13
    one = prefill_sample(2100, 0.0, 4096)
    assert one.prefill_pairs == prefill_pairs(2100, 0) and one.context_tokens == 0
    assert one.prefill_pairs > 6 * 7 * prefill_pairs(300, 0)
    chunked = prefill_sample(3000, 0.0, 1024)  # three chunks, each attending what came before it
    assert chunked.steps == 3 and chunked.prefill_pairs == pytest.approx(prefill_pairs(3000, 0))
    cached = prefill_sample(1000, 0.0, 2048, cached_tokens=900)  # the new tail attends the cached prefix
    assert cached.tokens == 100 and cached.prefill_pairs == prefill_pairs(100, 900)
    decode = batch_sample(2, 100, 0, 5, 0.0)  # 4 decode steps reading 101..104 tokens, twice
    assert decode.context_tokens == 2 * (101 + 102 + 103 + 104)


def test_a_batch_sample_times_what_the_scheduler_model_takes_for_that_batch():
    """The calibration's batch sample (send to last token of B requests sent together) counts the steps, tokens,
    sequences and context the scheduler model itself runs for that batch, so a fit of such samples gives back
    the costs the model then uses; a decode batch at a long context is what pins the per-context-token cost."""
    truth = StepCostModel(0.004, 3e-5, 2e-4, 1.5e-7, 0.005, 3e-8)
    for batch, prompt, out in ((1, 64, 24), (4, 64, 24), (8, 1000, 24), (2, 300, 5)):
        reqs = requests_from_token_pairs([(toks(prompt, 100 + i), toks(out, 200 + i)) for i in range(batch)], B,
                                         session_ids=[f"s{i}" for i in range(batch)])
        run = run_scheduler(reqs, SchedulerConfig(B, 1000, max_num_batched_tokens=8192), truth, at_once(batch),
                            fast_forward=False)
        e2e = sorted(r.done_s - r.arrival_s for r in run.results)[batch // 2]
        modelled = _modelled(truth, batch_sample(batch, prompt, 0, out, 0.0))
        assert modelled == pytest.approx(e2e, rel=0.02), (batch, prompt, out, modelled, e2e)


def _speculative_batch(batch: int, prompt: int, out: int, seed: int):
    """``batch`` requests whose answers repeat a motif of their prompt (n-gram drafts, some rejected), each with
    the offline model's steps attached, and those steps."""
    from dataclasses import replace

    from kvscope.harness.cachemodel.speculative import NgramConfig, simulate_request

    rng = random.Random(seed)
    pairs, sims = [], []
    for i in range(batch):
        p = [rng.randrange(50, 90) for _ in range(prompt)]
        o = (p[10:10 + 6 + i] * out)[:out - 3] + [rng.randrange(50, 90) for _ in range(3)]
        pairs.append((p, o))
        sims.append(simulate_request(p, o, NgramConfig(4, 2, 4)))
    reqs = requests_from_token_pairs(pairs, B, session_ids=[f"s{i}" for i in range(batch)])
    reqs = [replace(r, spec_drafted=x.drafted.tolist(), spec_accepted=x.accepted.tolist()) for r, x in zip(reqs, sims)]
    return reqs, sims


def test_a_speculative_batch_sample_times_what_the_scheduler_model_takes_and_its_costs_are_fitted_back():
    """On an n-gram server the calibration's decode samples carry the offline model's drafts
    (`speculative_batch_sample`): its steps, tokens, verifying sequences and drafts are what the scheduler model
    runs for that batch (the batch timed to its last token), so a fit of such samples beside prefills gives back
    the cost of a verifying step too."""
    from dataclasses import replace

    from kvscope.harness.cachemodel.calibration import speculative_batch_sample

    truth = StepCostModel(0.004, 3e-5, 2e-4, 1.5e-7, 0.005, 3e-8, 3e-3, 4e-4)
    samples = [replace(s, seconds=_modelled(truth, s)) for s in
               [prefill_sample(p, 0.0, 2048) for p in (50, 200, 500, 1000, 1800)]
               + [prefill_sample(p, 0.0, 2048, cached_tokens=p - 20) for p in (500, 1800)]
               + [batch_sample(b, p, 0, 20, 0.0) for b in (1, 2, 4) for p in (64, 1000)]]
    for batch, prompt, out, seed in ((1, 64, 24, 1), (2, 64, 24, 2), (4, 300, 24, 3), (3, 100, 9, 4)):
        reqs, sims = _speculative_batch(batch, prompt, out, seed)
        assert sum(x.draft_tokens for x in sims) > sum(x.accepted_tokens for x in sims) > 0  # drafts, some rejected
        run = run_scheduler(reqs, SchedulerConfig(B, 1000, max_num_batched_tokens=8192), truth, at_once(batch),
                            fast_forward=False)
        sample = speculative_batch_sample(prompt, 0, [x.drafted for x in sims], [x.context_tokens for x in sims], 0.0)
        last = max(r.done_s - r.arrival_s for r in run.results)
        assert sample.steps == run.steps
        assert _modelled(truth, sample) == pytest.approx(last, rel=1e-6), (batch, prompt, out)
        samples.append(replace(sample, seconds=last))
    fit = fit_cost_model(samples)
    # a step's verification costs once however many of its sequences verify, its drafts each: batches of
    # several drafting requests are what tell the two apart (alone, n-gram drafts k tokens nearly every step)
    for name in ("base_s", "per_token_s", "per_seq_s", "per_context_token_s", "request_overhead_s",
                 "per_spec_step_s", "per_draft_token_s"):
        assert getattr(fit.model, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert fit.r2 > 0.999
    # a server without speculation: no sample has drafts, and both coefficients stay 0
    plain = fit_cost_model([s for s in samples if not s.draft_tokens])
    assert plain.model.per_spec_step_s == plain.model.per_draft_token_s == 0.0


def _calibration_file(path, num_gpu_blocks=None, fit_r2=1.0):
    import time as _time

    from kvscope.harness.results.schemas import CalibrationCost, CalibrationFile, CalibrationServer
    from kvscope.workloads.versioned_file import write_versioned

    cal = CalibrationFile(created_at=_time.time(), server=CalibrationServer(block_size=16, num_gpu_blocks=num_gpu_blocks,
                                                                           max_num_seqs=8, max_num_batched_tokens=256),
                          cost=CalibrationCost(base_s=0.005, per_token_s=2e-5, per_seq_s=1e-4,
                                               per_context_token_s=0.0, request_overhead_s=0.002,
                                               per_prefill_pair_s=0.0),
                          fit_r2=fit_r2, fit_median_rel_error=0.0)
    write_versioned(path, cal)
    return path


def _sessions_trace(tmp_path, sessions=6, turns=5):
    import json

    rng = random.Random(3)
    lines = []
    for s in range(sessions):
        prompt = toks(rng.randrange(40, 120), rng.random())
        for t in range(turns):
            lines.append({"prompt_token_ids": prompt, "output_tokens": 8, "session_id": f"s{s}"})
            prompt = prompt + toks(8 + rng.randrange(1, 40), rng.random())
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_capacity_cli_prints_the_curve_and_finds_the_cliff(tmp_path, capsys):
    import json

    from kvscope.harness.cli.main import main

    cal = _calibration_file(tmp_path / "calibration.json", num_gpu_blocks=40)
    trace = _sessions_trace(tmp_path)
    out = tmp_path / "capacity.json"
    assert main(["capacity", str(trace), "--calibration", str(cal), "--levels", "1,2,6", "--time-scale", "0",
                 "--mode", "live", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "eviction cliff" in text and "capacity" in text
    data = json.loads(out.read_text())
    hits = [r["token_hit_rate"] for r in data["levels"]]
    assert [r["concurrency"] for r in data["levels"]] == [1, 2, 6]
    assert hits[0] > 0.5 and hits[2] < hits[0] - 0.05  # 6 sessions do not fit in 39 blocks: the cliff
    assert data["cliff_concurrency"] in (2, 6)
    # an infinite pool has no cliff
    assert main(["capacity", str(trace), "--calibration", str(cal), "--levels", "1,6", "--time-scale", "0",
                 "--mode", "live", "--num-gpu-blocks", "100000", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["cliff_concurrency"] is None


@pytest.mark.parametrize("argv,needle", [
    (["--levels", "4,2"], "--levels"),
    (["--levels", "a"], "--levels"),
    (["--slo-ttft-ms", "-1"], "--slo-ttft-ms"),
])
def test_capacity_cli_rejects_bad_flags_in_one_line(tmp_path, capsys, argv, needle):
    from kvscope.harness.cli.main import main

    cal = _calibration_file(tmp_path / "calibration.json")
    trace = _sessions_trace(tmp_path)
    with pytest.raises(SystemExit) as exc:
        code = main(["capacity", str(trace), "--calibration", str(cal), *argv])
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1] and "Traceback" not in "\n".join(err)


def test_capacity_cli_names_a_calibration_file_of_another_kind(tmp_path, capsys):
    from kvscope.harness.cli.main import main

    bad = tmp_path / "calibration.json"
    bad.write_text('{"format": "kvscope-summary", "version": 1}')
    assert main(["capacity", str(_sessions_trace(tmp_path)), "--calibration", str(bad)]) == 2
    assert "calibration.json" in capsys.readouterr().err


def test_capacity_cli_refuses_a_poor_calibration_fit_in_one_line(tmp_path, capsys):
    from kvscope.harness.cli.main import main

    cal = _calibration_file(tmp_path / "calibration.json", fit_r2=-0.4)  # what a loaded host produced
    trace = _sessions_trace(tmp_path)
    assert main(["capacity", str(trace), "--calibration", str(cal), "--levels", "1,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "R² -0.40" in err and "--min-fit-r2" in err
    assert main(["capacity", str(trace), "--calibration", str(cal), "--levels", "1,2", "--min-fit-r2", "-1"]) == 0


def _agent_like(sessions: int = 8, turns: int = 6, seed: int = 11):
    """Growing append-only sessions (each turn adds 40-120 tokens and asks 4-40 output tokens)."""
    rng = random.Random(seed)
    pairs, sids = [], []
    for s in range(sessions):
        prompt = toks(rng.randrange(60, 140), 1000 + s)
        for t in range(turns):
            out = toks(rng.randrange(4, 40), 5000 + 100 * s + t)
            pairs.append((prompt, out))
            sids.append(f"s{s}")
            prompt = prompt + out + toks(rng.randrange(40, 120), 9000 + 100 * s + t)
    return requests_from_token_pairs(pairs, B, session_ids=sids)


def test_timing_noise_is_reproducible_and_zero_noise_is_the_noise_free_run():
    from kvscope.harness.cachemodel.scheduler import TimingNoise

    reqs = _agent_like()
    cfg, cost = SchedulerConfig(B, 40), StepCostModel(0.004, 3e-5, 2e-4, 1e-7, 0.006, 2e-8)
    timing = SessionTiming(concurrency=6, time_scale=0.0)
    plain = run_scheduler(reqs, cfg, cost, timing)
    silent = run_scheduler(reqs, cfg, cost, timing, noise=TimingNoise(0.0, 0.0, seed=3))
    assert [r.done_s for r in silent.results] == [r.done_s for r in plain.results]
    a = run_scheduler(reqs, cfg, cost, timing, noise=TimingNoise(0.3, 0.5, seed=3))
    b = run_scheduler(reqs, cfg, cost, timing, noise=TimingNoise(0.3, 0.5, seed=3))
    c = run_scheduler(reqs, cfg, cost, timing, noise=TimingNoise(0.3, 0.5, seed=4))
    assert [r.done_s for r in a.results] == [r.done_s for r in b.results]
    assert [r.done_s for r in a.results] != [r.done_s for r in c.results]
    assert a.makespan_s != plain.makespan_s
    # a request's arrival is when it was sent (its TTFT counts the lag), with or without lag noise
    for run in (plain, a):
        first = next(r for r in run.results if r.request_id == 0)
        assert first.arrival_s == 0.0 and first.ttft_s >= cost.request_overhead_s * 0.1


def test_timing_cv_reads_the_spread_of_repeated_shapes():
    import math
    from dataclasses import replace

    from kvscope.harness.cachemodel.calibration import median_of_repeats, timing_cv

    rng = random.Random(5)
    shapes = [prefill_sample(p, 0.01 * (1 + p / 500), 2048) for p in (50, 100, 200, 400, 800, 1600)]
    shapes += [batch_sample(b, 64, 0, 24, 0.05 * b) for b in (1, 2, 4, 8)]
    timings = [replace(s, seconds=s.seconds * math.exp(rng.gauss(0.0, 0.2))) for s in shapes for _ in range(5)]
    assert timing_cv(timings) == pytest.approx(0.2, rel=0.3)
    assert len(median_of_repeats(timings)) == len(shapes)
    assert timing_cv(shapes) is None  # nothing repeated: no estimate


def test_a_level_near_a_full_pool_is_an_ensemble_and_one_far_from_it_a_single_run():
    from dataclasses import replace

    from kvscope.harness.cachemodel.capacity_model import ENSEMBLE_RUNS, predict_levels

    reqs = _agent_like(sessions=10)
    cost = StepCostModel(0.004, 3e-5, 2e-4, 1e-7, 0.006, 2e-8)
    roomy, tight = predict_levels(reqs, SchedulerConfig(B, 100_000), cost, [8], time_scale=0.0, mode="live")[0], \
        predict_levels(reqs, SchedulerConfig(B, 60), cost, [8], time_scale=0.0, mode="live", timing_cv=0.3)[0]
    assert roomy.runs == 1 and roomy.preemptions == 0
    assert tight.runs == ENSEMBLE_RUNS and tight.preemptions > 0
    assert tight.preemptions_p10 <= tight.preemptions_p50 <= tight.preemptions_p90
    assert tight.preemptions_p10 <= tight.preemptions <= tight.preemptions_p90
    single = predict_levels(reqs, SchedulerConfig(B, 60), cost, [8], time_scale=0.0, mode="live",
                            ensemble_runs=1)[0]
    assert single.runs == 1 and single.preemptions == single.preemptions_p50 == int(single.preemptions)
    again = predict_levels(reqs, SchedulerConfig(B, 60), cost, [8], time_scale=0.0, mode="live", timing_cv=0.3)[0]
    assert again == replace(tight, simulate_s=again.simulate_s)  # seeded runs: the same prediction again


def test_a_calibration_of_the_one_context_cost_model_is_refused_in_one_line(tmp_path, capsys):
    import json

    from kvscope.harness.cli.main import main

    path = _calibration_file(tmp_path / "calibration.json")
    data = json.loads(path.read_text())
    data["version"] = 1
    del data["cost"]["per_prefill_pair_s"]
    path.write_text(json.dumps(data))
    assert main(["capacity", str(_sessions_trace(tmp_path)), "--calibration", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "version 1" in err and "version 2" in err


def test_repeats_of_a_speculative_shape_keep_the_repeat_of_median_time():
    """A speculative server's repeats of one batch shape draft differently (their features differ), so they are
    grouped by the shape and the repeat of median time is kept whole: one stalled repeat moves nothing."""
    from kvscope.harness.cachemodel.calibration import median_of_repeats, speculative_batch_sample

    reps = [speculative_batch_sample(64, 0, [[4] * n], [[65.0 + i for i in range(n)]], t, "motif-64x1")
            for n, t in ((10, 0.05), (12, 0.06), (9, 2.5))]  # the third: a stall of the host
    plain = [batch_sample(1, 64, 0, 24, t) for t in (0.1, 0.3, 0.2)]
    out = median_of_repeats(reps + plain)
    assert len(out) == 2
    spec = next(s for s in out if s.shape)
    assert spec == reps[1]  # features and seconds of one measured repeat
    assert next(s for s in out if not s.shape).seconds == 0.2
