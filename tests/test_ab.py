"""A/B verdicts: the hierarchical bootstrap detects real shifts, stays quiet on run and session noise, and says
`inconclusive` where noise is not measured; `kvscope compare` in its three forms."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.harness.analysis.ab import (Run, RunNoise, compare, compare_runs,
                                        estimate_run_noise, noise_groups)
from kvscope.harness.results.percentiles import weighted_percentiles
from tests.cli import kvscope


def _records(rng, sessions=8, steps=3, ttft_s=0.02, run_sigma=0.04, session_sigma=0.06, request_sigma=0.12,
             cached_share=0.0, session_prefix="s") -> pd.DataFrame:
    run = rng.lognormal(0, run_sigma)
    rows = []
    for s in range(sessions):
        sess = rng.lognormal(0, session_sigma)
        for k in range(steps):
            t = ttft_s * run * sess * rng.lognormal(0, request_sigma)
            rows.append({"request_id": s * steps + k, "session_id": f"{session_prefix}{s}", "step": k, "attempt": 0,
                         "in_window": True, "error_class": None, "ttft_s": t, "tpot_s": 0.005 * run * sess,
                         "e2e_s": t + 0.015 * run * sess, "prompt_tokens": 1000,
                         "cached_tokens": int(1000 * cached_share), "output_tokens": 4, "sent_s": 0.0, "done_s": 1.0})
    return pd.DataFrame(rows)


def _side(seed: int, runs: int = 3, effect: float = 1.0, tput_effect: float = 1.0, prefix_caching=None, **kw):
    rng = np.random.default_rng(seed)
    out = []
    for r in range(runs):
        df = _records(rng, **kw)
        df["ttft_s"] *= effect
        tput = 100.0 * rng.lognormal(0, kw.get("run_sigma", 0.04)) * tput_effect
        out.append(Run(f"run{seed}-{r}", df, tput, prefix_caching, "sha"))
    return out


def _verdict(t: pd.DataFrame, metric: str) -> str:
    return t.set_index("metric").loc[metric, "verdict"]


def test_a_30_percent_slower_ttft_is_worse_and_the_reverse_is_better():
    a, b = _side(1), _side(2, effect=1.3, tput_effect=0.7)
    t = compare(a, b, resamples=1000).set_index("metric")
    assert t.loc["ttft_p50_s", "verdict"] == "worse" and t.loc["ttft_p50_s", "ci_low"] > t.loc["ttft_p50_s", "margin"]
    assert t.loc["output_tokens_per_s", "verdict"] == "worse"
    assert t["paired"].all() and (t["runs_a"] == 3).all()
    back = compare(b, a, resamples=1000)
    assert _verdict(back, "ttft_p50_s") == "better" and _verdict(back, "output_tokens_per_s") == "better"


def test_a_consistent_shift_inside_the_margin_is_equivalent_not_better_or_worse():
    a = _side(3, run_sigma=0.0, session_sigma=0.0, request_sigma=0.05)
    b = [Run(r.name + "b", r.records.assign(ttft_s=r.records["ttft_s"] * 1.02), r.output_tokens_per_s, None, "sha")
         for r in a]
    t = compare(a, b, resamples=1000).set_index("metric")
    assert t.loc["ttft_p50_s", "ci_low"] > 0  # the shift is real ...
    assert t.loc["ttft_p50_s", "verdict"] == "equivalent"  # ... and smaller than the 5 % margin


def test_run_and_session_noise_does_not_read_as_signal():
    # Few sessions and a strong session-by-run factor: resampling requests would call these A/A pairs different
    # most of the time (the requests of a session are not independent).
    called = 0
    for i in range(20):
        kw = dict(sessions=4, steps=12, run_sigma=0.05, session_sigma=0.3, request_sigma=0.02)
        t = compare(_side(100 + i, **kw), _side(200 + i, **kw), resamples=500, seed=i)
        called += _verdict(t, "ttft_p50_s") in ("better", "worse")
    assert called <= 2


def test_one_run_a_side_leaves_latency_and_throughput_inconclusive_unless_run_noise_is_known():
    a, b = _side(5, runs=1), _side(6, runs=1, effect=2.0, tput_effect=0.5)
    t = compare(a, b, resamples=500).set_index("metric")
    latency = [m for m in t.index if m.endswith("_s") and not m.endswith("_per_s")]
    assert (t.loc[latency, "verdict"] == "inconclusive").all()
    assert t.loc["output_tokens_per_s", "verdict"] == "inconclusive"
    assert t.loc[latency, "p_value"].isna().all()
    known = compare(a, b, resamples=500, run_noise={"ttft": 0.04, "throughput": 0.04}).set_index("metric")
    assert known.loc["ttft_p50_s", "verdict"] == "worse"
    assert known.loc["output_tokens_per_s", "verdict"] == "worse"
    assert known.loc["tpot_p50_s", "verdict"] == "inconclusive"  # no noise known for TPOT


def test_run_noise_is_pooled_within_repeats_of_one_cell_with_its_degrees_of_freedom():
    def run(name: str, ttft_s: float) -> Run:
        return Run(name, _records(np.random.default_rng(0), run_sigma=0, session_sigma=0, request_sigma=0,
                                  ttft_s=ttft_s), 100.0)

    runs = [run("a__w__c1__r0", 0.010), run("a__w__c1__r1", 0.020), run("b__w__c1__r0", 0.030),
            run("b__w__c1__r1", 0.030), run("b__w__c1__r2", 0.030)]
    assert [len(g) for g in noise_groups(runs)] == [2, 3]
    noise = estimate_run_noise(runs)["ttft"]
    # squares: a's two logs differ by log 2 (sum of squares log(2)^2 / 2), b's none; df = (2-1) + (3-1)
    assert noise.df == 3 and noise.sigma == pytest.approx(np.log(2) / np.sqrt(6), rel=1e-6)
    assert [len(g) for g in noise_groups([run("x", 0.01), run("y", 0.02)])] == [2]  # plain runs: one group


def test_a_noise_estimated_from_two_runs_does_not_make_an_aa_pair_significant():
    """One run a side, the run-to-run noise estimated from one pair of repeats elsewhere (df = 1): across A/A
    pairs whose run factor is drawn with sigma 0.15, the estimate is often far too small; taken as known it calls
    many pairs better or worse, with its degrees of freedom almost none."""
    called_df, called_known = 0, 0
    for i in range(20):
        rng = np.random.default_rng(1000 + i)
        pair = [Run(f"n{i}-{k}", _records(rng, run_sigma=0.15), 100.0 * rng.lognormal(0, 0.15)) for k in range(2)]
        est = estimate_run_noise(pair)["ttft"]
        a = [Run(f"a{i}", _records(rng, run_sigma=0.15), 100.0)]
        b = [Run(f"b{i}", _records(rng, run_sigma=0.15), 100.0)]
        t_df = compare(a, b, resamples=400, seed=i, run_noise={"ttft": est})
        t_known = compare(a, b, resamples=400, seed=i, run_noise={"ttft": RunNoise(est.sigma)})
        called_df += _verdict(t_df, "ttft_p50_s") in ("better", "worse")
        called_known += _verdict(t_known, "ttft_p50_s") in ("better", "worse")
    print(f"A/A called better/worse: {called_df}/20 with the estimate's df, {called_known}/20 taken as known")
    assert called_df <= 1
    assert called_known >= 2 * max(called_df, 1)  # the premise: ignoring the estimate's uncertainty is not calibrated


def test_hit_rate_with_prefix_caching_off_on_one_side_is_by_construction():
    on = _side(7, prefix_caching=True, cached_share=0.8)
    off = _side(8, prefix_caching=False)
    t = compare(on, off, resamples=300).set_index("metric")
    assert t.loc["hit_rate", "verdict"] == "by_construction"
    assert t.loc["cost_prefill_units_per_request", "verdict"] == "by_construction"
    assert t.loc["hit_rate", "a"] == pytest.approx(0.8) and t.loc["hit_rate", "b"] == 0
    both_on = compare(on, _side(9, prefix_caching=True, cached_share=0.4), resamples=300)
    assert _verdict(both_on, "hit_rate") == "worse"


def test_different_sessions_are_compared_unpaired():
    a, b = _side(10), _side(11, effect=1.5, session_prefix="other")
    t = compare(a, b, resamples=500).set_index("metric")
    assert not t["paired"].any()
    assert t.loc["ttft_p50_s", "verdict"] == "worse"


def test_benjamini_hochberg_adjusts_the_p_values_of_one_comparison():
    from scipy.stats import false_discovery_control

    t = compare(_side(12), _side(13, effect=1.3), resamples=500)
    tested = t["p_value"].notna()
    assert tested.sum() >= 8
    expected = false_discovery_control(t.loc[tested, "p_value"].to_numpy(float), method="bh")
    assert np.allclose(t.loc[tested, "p_adjusted"], expected)
    assert (t.loc[tested, "p_adjusted"] >= t.loc[tested, "p_value"] - 1e-12).all()


def test_records_of_several_cells_are_several_runs():
    rng = np.random.default_rng(14)
    a = pd.concat([_records(rng).assign(cell=f"c{k}") for k in range(3)], ignore_index=True)
    t = compare_runs(a, _records(rng), resamples=200)
    assert (t["runs_a"] == 3).all() and (t["runs_b"] == 1).all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=30),
       st.lists(st.integers(0, 4), min_size=30, max_size=30), st.sampled_from([1, 25, 50, 90, 99, 100]))
def test_weighted_percentile_equals_the_percentile_of_the_repeated_values(values, counts, q):
    """Bit for bit: summary.json's figure (np.percentile, linear) is the A/B engine's at unit weights."""
    x = np.sort(np.asarray(values))
    w = np.asarray(counts[: len(x)], int)
    if w.sum() == 0:
        w[0] = 1
    got = weighted_percentiles(x, np.column_stack([w, np.ones_like(w), np.zeros_like(w)]), [q])
    assert got[0, 0] == np.percentile(np.repeat(x, w), q)
    assert got[0, 1] == np.percentile(x, q)
    assert np.isnan(got[0, 2])  # a draw without any value has no percentile


def _one_level_percentiles(x: np.ndarray, weights: np.ndarray, qs: list[float]) -> np.ndarray:
    """The reference: numpy's percentile of the values repeated by each draw's weights."""
    out = np.empty((len(qs), weights.shape[1]))
    for d in range(weights.shape[1]):
        out[:, d] = np.percentile(np.repeat(x, weights[:, d]), qs)
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 6), st.floats(0.05, 3.0), st.integers(0, 2**32 - 1))
def test_block_percentile_search_equals_one_cumulative_sum_per_draw(n, draws, mean_weight, seed):
    # sizes straddle the block boundaries (PERCENTILE_BLOCK = 64); sparse weights leave whole blocks empty
    rng = np.random.default_rng(seed)
    x = np.sort(rng.random(n))
    w = rng.poisson(mean_weight, (n, draws)).astype(np.int32)
    w[0, w.sum(axis=0) == 0] = 1
    qs = [0, 1, 50, 90, 99, 100]
    assert np.array_equal(weighted_percentiles(x, w, qs), _one_level_percentiles(x, w, qs))


# ---- the command line, on mock-server runs -------------------------------------------------------------------
def _mock_runs(root: Path, n: int, ttft_s: float, name: str) -> list[Path]:
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.replay.runner import replay
    from kvscope.workloads.generate import synthetic_trace
    from tests.doubles.faultserver import FaultConfig, FaultServer

    trace_dir = root / "trace"
    if not trace_dir.exists():
        synthetic_trace(4, steps=2, prompt_tokens=16, output_tokens=4).write(trace_dir)
    dirs = []
    for k in range(n):
        with FaultServer(FaultConfig(ttft_s=ttft_s, itl_s=0.001)) as srv:
            out = root / f"{name}{k}"
            replay(trace_dir, out, ReplayOptions(concurrency=4, time_scale=0.0, progress=False, predict=False,
                                                 reset_prefix_cache=False, scrape_interval_s=0.5),
                   endpoints=[srv.endpoint])
        dirs.append(out)
    return dirs


def _kvscope(*args: str) -> subprocess.CompletedProcess:
    return kvscope("compare", *args)


@pytest.fixture(scope="module")
def mock_runs(tmp_path_factory) -> dict[str, list[Path]]:
    root = tmp_path_factory.mktemp("cmp")
    return {"a": _mock_runs(root, 3, 0.01, "a"), "b": _mock_runs(root, 3, 0.03, "b"), "root": [root]}


def test_compare_runs_vs_runs_writes_the_json_verdicts(mock_runs, tmp_path):
    out = tmp_path / "v.json"
    r = _kvscope(*map(str, mock_runs["a"]), "--vs", *map(str, mock_runs["b"]), "--json", str(out), "--no-html",
                 "--resamples", "500")
    assert r.returncode == 0, r.stderr
    rows = {m["metric"]: m for m in json.loads(out.read_text())["metrics"]}
    assert {"ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "tpot_p50_s", "output_tokens_per_s", "hit_rate"} <= set(rows)
    ttft = rows["ttft_p50_s"]
    assert {"a", "b", "diff", "ci_low", "ci_high", "verdict"} <= set(ttft)
    assert ttft["verdict"] == "worse" and ttft["ci_low"] <= ttft["diff"] <= ttft["ci_high"]
    assert ttft["b"] > 2 * ttft["a"]


def test_two_positionals_are_a_then_b_and_one_run_a_side_is_inconclusive(mock_runs, tmp_path):
    out = tmp_path / "v.json"
    r = _kvscope(str(mock_runs["b"][0]), str(mock_runs["a"][0]), "--json", str(out), "--no-html")
    assert r.returncode == 0, r.stderr
    ttft = next(m for m in json.loads(out.read_text())["metrics"] if m["metric"] == "ttft_p50_s")
    assert ttft["a"] > ttft["b"] and ttft["verdict"] == "inconclusive"
    assert "A = b0" in r.stdout


def test_compare_experiment_servers_takes_their_repeats(mock_runs, tmp_path):
    exp = tmp_path / "exp"
    cells = {}
    for server, dirs in (("fast", mock_runs["a"]), ("slow", mock_runs["b"])):
        for k, d in enumerate(dirs):
            name = f"{server}__w__c4__r{k}"
            (exp / "cells").mkdir(parents=True, exist_ok=True)
            (exp / "cells" / name).symlink_to(d, target_is_directory=True)
            cells[name] = {"server": server, "workload": "w", "load": "c4", "repeat": k, "status": "ok"}
    from kvscope.harness.results.loaders import write_result_file
    from kvscope.harness.results.schemas import ExperimentFile

    write_result_file(exp / "experiment.json", ExperimentFile, {
        "experiment": "x", "run_id": "r", "spec": {"name": "x"}, "spec_path": "x.yaml", "created_at": 0.0,
        "cells": {name: {**cell, "dir": f"cells/{name}"} for name, cell in cells.items()}})
    out = tmp_path / "v.json"
    r = _kvscope(str(exp), "--a", "fast", "--b", "slow", "--json", str(out), "--resamples", "500")
    assert r.returncode == 0, r.stderr
    ttft = next(m for m in json.loads(out.read_text())["metrics"] if m["metric"] == "ttft_p50_s")
    assert ttft["verdict"] == "worse" and ttft["runs_a"] == 3 and ttft["runs_b"] == 3
    bad = _kvscope(str(exp), "--a", "fast", "--b", "nope")
    assert bad.returncode == 2 and "'nope'" in bad.stderr and "fast, slow" in bad.stderr
    assert "Traceback" not in bad.stderr
    no_servers = _kvscope(str(exp), str(mock_runs["a"][0]))
    assert no_servers.returncode == 2 and "--a SERVER --b SERVER" in no_servers.stderr


def test_three_runs_without_vs_is_a_one_line_error(mock_runs):
    r = _kvscope(*map(str, mock_runs["a"]))
    assert r.returncode == 2 and "--vs" in r.stderr and "Traceback" not in r.stderr
