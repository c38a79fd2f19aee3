"""Issue 12 acceptance: the A/B verdicts are calibrated on a mock server with a known latency structure.

Every run is a fresh fault server (so a fresh run factor: one is drawn per server start), replayed through the
real replay path: run
factor sigma 0.04, a session-by-run factor 0.06, request noise 0.12 on TTFT 40 ms (token gaps 8 ms). B's fixed
effect is TTFT x1.3 and output throughput x0.7 (both in the same runs). The A sides of the A/B comparisons are
those of the A/A comparisons; every comparison has its own runs otherwise. The arms run interleaved, as an
experiment's repeats do, and run slot k of A is paired with slot k of B. Rates are printed (run with -s).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvscope.harness.analysis.ab import compare, runs_from_dirs
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.priority import client_priority
from kvscope.harness.replay.runner import replay
from tests.doubles.faultserver import FaultServer, LatencyNoise, _NoiseState, config_from_args
from kvscope.workloads.trace import TraceBuilder

REPO = Path(__file__).resolve().parents[1]
COMPARISONS = 20
RUNS_A_SIDE = 3
NOISE = ["--ttft-ms", "40", "--itl-ms", "8", "--run-noise", "0.04", "--session-noise", "0.06",
         "--request-noise", "0.12"]
EFFECT = ["--ttft-effect", "1.3", "--throughput-effect", "0.7"]


def _trace(root: Path, sessions: int = 12, steps: int = 3) -> Path:
    """12 sessions x 3 requests; each session's `cache_salt` is its id, so the mock knows the session."""
    rng = np.random.default_rng(0)
    b = TraceBuilder()
    for s in range(sessions):
        parent = -1
        for k in range(steps):
            seg = b.add_segment(rng.integers(100, 8000, size=32, dtype=np.int32), "user")
            parent = b.add_request(session_id=f"s{s}", step=k, parent_request_id=parent, arrival_s=0.0,
                                   session_start_s=0.0, think_time_s=0.0, prompt_segment_ids=[seg], output_tokens=4,
                                   max_tokens=4, transition="first" if k == 0 else "reset", tenant=0,
                                   cache_salt=f"s{s}")
    meta = {"name": "calibration", "seed": 0, "tokenizer": {"path": None, "sha256": None, "vocab_size": 8192},
            "spec": {"synthetic": True}}
    return b.build(meta).write(root / "trace")


def _one_run(trace_dir: Path, run_dir: Path, seed: int, extra: list[str]) -> Path:
    """One run against a fresh fault server configured by the command line's own flags. The server runs on a
    thread of this process: a server process per run cost 180 interpreter starts (the file took 99 s, now 69 s,
    on the quiet 2-core host), and the run factor is drawn per server start either way."""
    config, _ = config_from_args([*NOISE, *extra, "--noise-seed", str(seed)])
    with FaultServer(config) as server:
        opts = ReplayOptions(concurrency=12, time_scale=0.0, progress=False, scrape_interval_s=0.5,
                             reset_prefix_cache=False, predict=False)
        replay(trace_dir, run_dir, opts, endpoints=[server.endpoint])
    return run_dir


@pytest.fixture(scope="module")
def pools(tmp_path_factory) -> dict[str, list]:
    """Runs per comparison i: A/A sides aa_a[i], aa_b[i]; A/B uses aa_a[i] against ab_b[i]."""
    root = tmp_path_factory.mktemp("calibration")
    trace_dir = _trace(root)
    seed = iter(range(10_000))
    out: dict[str, list] = {"aa_a": [], "aa_b": [], "ab_b": []}
    # Mock server and client run real-time where the process may (root, CAP_SYS_NICE: CI): the latency measured
    # is then the mock's known structure, not a neighbour's load (on the 2-core host at load 5, with normal
    # priority, A/A on tokens/s was called 3 times in 20). Elsewhere they run as before.
    with client_priority("auto", threads_inherit=True):
        for i in range(COMPARISONS):
            dirs: dict[str, list[Path]] = {pool: [] for pool in out}
            for k in range(RUNS_A_SIDE):  # arms interleaved (A B B' A B B' …): machine drift spreads over all
                for pool, extra in (("aa_a", []), ("aa_b", []), ("ab_b", EFFECT)):
                    dirs[pool].append(_one_run(trace_dir, root / f"{pool}{i}_r{k}", next(seed), extra))
            for pool in out:
                out[pool].append(runs_from_dirs(dirs[pool]))
    return out


def _verdicts(a_sides, b_sides, metric: str) -> list[str]:
    return [compare(a, b, resamples=1000, seed=i).set_index("metric").loc[metric, "verdict"]
            for i, (a, b) in enumerate(zip(a_sides, b_sides))]


def _called(verdicts: list[str]) -> int:
    return sum(v in ("better", "worse") for v in verdicts)


def test_traffic_is_paired_and_every_run_has_its_own_run_factor(pools):
    runs = [r for side in pools["aa_a"][:2] for r in side]
    assert len({r.trace_sha256 for r in runs}) == 1 and runs[0].trace_sha256
    t = compare(pools["aa_a"][0], pools["aa_b"][0], resamples=200)
    assert t["paired"].all()
    per_run_tput = [r.output_tokens_per_s for r in runs]
    assert len(set(per_run_tput)) == len(per_run_tput)


@pytest.mark.parametrize("metric", ["ttft_p50_s", "output_tokens_per_s"])
def test_aa_with_three_runs_a_side_is_called_at_most_twice_in_twenty(pools, metric):
    verdicts = _verdicts(pools["aa_a"], pools["aa_b"], metric)
    print(f"\nA/A 3 runs a side, {metric}: called better/worse {_called(verdicts)}/{COMPARISONS}; {verdicts}")
    assert _called(verdicts) <= 2


@pytest.mark.parametrize("metric", ["ttft_p50_s", "output_tokens_per_s"])
def test_ab_with_a_30_percent_effect_is_called_worse_at_least_18_times_in_twenty(pools, metric):
    verdicts = _verdicts(pools["aa_a"], pools["ab_b"], metric)
    worse = verdicts.count("worse")
    print(f"\nA/B 3 runs a side, {metric} (TTFT x1.3, tokens/s x0.7): worse {worse}/{COMPARISONS}; {verdicts}")
    assert worse >= 18
    assert "better" not in verdicts


def test_aa_with_one_run_a_side_is_never_better_or_worse(pools):
    called = 0
    for i, (a, b) in enumerate(zip(pools["aa_a"], pools["aa_b"])):
        t = compare(a[:1], b[:1], resamples=500, seed=i).set_index("metric")
        called += int(t["verdict"].isin(["better", "worse"]).sum())
        latency = t.index.str.endswith("_s") & ~t.index.str.endswith("_per_s")
        assert (t.loc[latency, "verdict"] == "inconclusive").all()
        assert t.loc["output_tokens_per_s", "verdict"] == "inconclusive"
    print(f"\nA/A 1 run a side: better/worse on any metric {called} times in {COMPARISONS} comparisons")
    assert called == 0


def test_noise_draws_one_run_factor_per_start_and_one_factor_per_session():
    noise = LatencyNoise(run_sigma=0.1, session_sigma=0.2, request_sigma=0.0, seed=7)
    a, again, other = _NoiseState(noise), _NoiseState(noise), _NoiseState(LatencyNoise(run_sigma=0.1, seed=8))
    assert a.run_factor == again.run_factor != other.run_factor
    first = a.delays(0.02, 0.005, 4, "s1")
    assert a.delays(0.02, 0.005, 4, "s1") == first  # no request noise: one session, one factor
    assert a.delays(0.02, 0.005, 4, "s2") != first
    plain = _NoiseState(LatencyNoise(seed=1))
    slow = _NoiseState(LatencyNoise(ttft_effect=1.3, throughput_effect=0.7, seed=1))
    ttft, gap = plain.delays(0.02, 0.005, 4, "s")
    ttft_e, gap_e = slow.delays(0.02, 0.005, 4, "s")
    assert ttft_e == pytest.approx(1.3 * ttft)
    assert ttft_e + 3 * gap_e == pytest.approx((ttft + 3 * gap) / 0.7)


def test_the_noise_flags_configure_the_server_as_documented():
    """The calibration's servers are configured by the command line's flags (config_from_args, which `python -m
    tests.doubles.faultserver` runs too): each flag lands on its field."""
    config, _ = config_from_args([*NOISE, *EFFECT, "--noise-seed", "7"])
    assert (config.ttft_s, config.itl_s) == pytest.approx((0.040, 0.008))
    assert config.noise == LatencyNoise(run_sigma=0.04, session_sigma=0.06, request_sigma=0.12, ttft_effect=1.3,
                                        throughput_effect=0.7, seed=7)
    assert config_from_args(["--ttft-ms", "40"])[0].noise is None  # no noise flag: a plain mock


def test_bad_noise_option_is_a_one_line_error():
    r = subprocess.run([sys.executable, "-m", "tests.doubles.faultserver", "--run-noise", "-1"],
                       capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode == 2
    assert "--run-noise" in r.stderr and "Traceback" not in r.stderr
