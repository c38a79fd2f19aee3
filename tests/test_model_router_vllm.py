"""Model routing on two real vLLM CPU servers: the small tiny model (the shared 64-block `small_pool_server`) and
the large one (``--size large``, the same tokenizer, 80 blocks of 64 tokens), each with a small explicit KV pool
of its own block size, replayed through a cascade.

Sequentially (one request at a time) the offline routing model, run on the replay's own ids and decisions with
one pool per model (``check_routed_run`` → routing.json), must equal both servers' ``cached_tokens`` on every
attempt, the escalations' discarded small attempts included; the records must show the escalated requests, the
wasted attempts and the history recomputed on the large model.  At concurrency 4 a logprob cascade (threshold:
the sequential run's median small-model mean logprob) must escalate exactly the requests whose live signal was
below it, and the same sequential pools, fed in send order, must still match >= 97 % of the requests (pools
sized so that four sessions fit: overlap, not preemption, is what the order approximates).  Two servers at once
on a loaded 2-core machine are slow, so the trace is small (six sessions, short outputs).
"""

from __future__ import annotations

import statistics

import pytest
import yaml
from kvscope.harness.cli.main import main
from kvscope.harness.results.records import read_records
from kvscope.harness.results.routing_file import load_routing_file

pytestmark = pytest.mark.vllm

#: The large model's KV geometry: another block size than the small one's (the shared `small_pool_server`: 64
#: blocks of 128 tokens), and a pool that holds four live sessions but not the whole trace's history.
LARGE_POOL = {"block_size": 64, "num_gpu_blocks_override": 80, "kv_cache_memory_bytes": "48M"}  # 40 MiB of KV


@pytest.fixture(scope="module")
def two_servers(request, require_vllm, tiny_model_dir, tmp_path_factory):
    """The small model is the suite's `small_pool_server` (the tiny model); the large one, built here with the
    same seed (so the same tokenizer), is this test's own start, launched before the shared one is waited for
    so that the two starts overlap."""
    from kvscope.harness.model.tinymodel import build_tiny_model, read_model_card

    from tests.conftest import _server

    root = tmp_path_factory.mktemp("routing")
    card = read_model_card(tiny_model_dir) or {}
    large_dir = root / "large-model"
    build_tiny_model(large_dir, seed=int(card.get("seed", 0)), size="large")
    assert (large_dir / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    large = _server(large_dir, root, served_model_name="tiny-large", startup_timeout_s=600, **LARGE_POOL)
    large.launch()
    try:
        small = request.getfixturevalue("small_pool_server")
        large.finish_start()
        yield {"small": small, "large": large}
    finally:
        large.stop()


def _route(tmp_path, servers, trace, name: str, policy: dict, stickiness: str, concurrency: int, *extra: str):
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({"models": [{"name": "small"}, {"name": "large"}], "policy": policy,
                                    "stickiness": stickiness}))
    out = tmp_path / name
    rc = main(["replay", str(trace), "--endpoint", servers["small"].endpoint, "--endpoint", servers["large"].endpoint,
               "--out", str(out), "--model-routing", str(spec), "--concurrency", str(concurrency),
               "--time-scale", "0", "--no-progress", *extra])
    assert rc == 0
    return read_records(out), load_routing_file(out / "routing.json")


def test_live_two_model_cascade_matches_the_offline_routing_model(two_servers, tiny_model_dir, tmp_path):
    from kvscope.workloads.generate import generate_from_file

    trace = generate_from_file("agent-coding", tiny_model_dir, seed=5, scale=0.02, sessions=6, max_context=1100,
                               output_scale=0.05).write(tmp_path / "trace")
    import pandas as pd

    reqs = pd.read_parquet(trace / "requests.parquet")
    hard = set(reqs.loc[reqs["step"] % 4 == 3, "request_id"].astype(int))
    (tmp_path / "labels.csv").write_text("request_id,verdict\n" + "".join(
        f"{int(i)},{'fail' if int(i) in hard else 'pass'}\n" for i in reqs["request_id"]))

    # 1. sequential: escalate the labelled steps; logprobs asked (a threshold nothing falls below) and recorded
    recs, check = _route(tmp_path, two_servers, trace, "sequential",
                         {"kind": "cascade", "label_column": "verdict", "min_mean_logprob": -1000.0}, "per-step", 1,
                         "--labels", str(tmp_path / "labels.csv"))
    print(f"\nsequential: {check.requests} requests, {check.escalations} escalated, exact {check.exact_share:.1%} "
          f"(all attempts {check.exact_share_all_attempts:.1%}), model_switch {check.model_switch_tokens} tokens")
    assert check.requests == len(reqs) and (recs["error_class"].isna()).all()
    assert set(recs.loc[recs["escalated"], "request_id"].astype(int)) == hard
    assert check.exact_share == 1.0 and check.exact_share_all_attempts == 1.0, [
        (r.request_id, r.model, r.cached_tokens, r.predicted_cached_tokens, r.wasted_cached_tokens,
         r.wasted_predicted_cached_tokens) for r in check.rows
        if r.cached_tokens != r.predicted_cached_tokens or r.wasted_cached_tokens != r.wasted_predicted_cached_tokens]
    assert (recs["predicted_cached_tokens"] == recs["cached_tokens"]).all()  # the online per-model predictors too
    esc = recs[recs["escalated"]]
    assert (esc["model"] == "large").all() and (esc["wasted_model"] == "small").all()
    assert (esc["wasted_output_tokens"] > 0).all() and (esc["wasted_done_s"] <= esc["sent_s"]).all()
    assert esc["wasted_cached_tokens"].notna().all()
    # the large model recomputes history the small one held: a switch costs real prefill there
    rows = {r.request_id: r for r in check.rows}
    assert sum(rows[i].model_switch_tokens for i in hard) > 0
    assert any(rows[i].recomputed_tokens > 256 and rows[i].wasted_cached_tokens for i in hard)
    lps = recs["mean_logprob"].dropna()
    assert len(lps) == len(recs) and (lps < 0).all()

    # 2. concurrency 4: a live logprob cascade, each step decided alone (sessions move back and forth)
    threshold = float(statistics.median(lps))
    recs4, check4 = _route(tmp_path, two_servers, trace, "c4", {"kind": "cascade", "min_mean_logprob": threshold},
                           "per-step", 4)
    print(f"concurrency 4 (threshold {threshold:.3f}): {check4.requests} requests, {check4.escalations} escalated, "
          f"exact {check4.exact_share:.1%} (all attempts {check4.exact_share_all_attempts:.1%}), online predictors "
          f"{(recs4['predicted_cached_tokens'] == recs4['cached_tokens']).mean():.1%}")
    assert recs4["mean_logprob"].notna().all()  # every request's small answer was checked, live
    assert ((recs4["mean_logprob"] < threshold) == recs4["escalated"]).all()
    assert recs4["route_reason"][recs4["escalated"]].str.startswith("escalated: failed mean_logprob").all()
    assert 0 < check4.escalations < check4.requests
    assert check4.exact_share >= 0.97
