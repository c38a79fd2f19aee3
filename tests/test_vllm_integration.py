"""Foundation checks against a real vLLM CPU server serving the locally built model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from kvscope.harness.serving.client import completion_payload, stream_completion
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.runner import replay
from kvscope.harness.results.records import read_records
from kvscope.harness.common.errors import ServerError
from kvscope.harness.serving.backend import DEFAULT_BACKEND, Backend
from kvscope.harness.serving.metrics import metrics_delta
from tests.conftest import start_server

pytestmark = pytest.mark.vllm


def _scrape(endpoint: str):
    return Backend.create(DEFAULT_BACKEND, endpoint=endpoint).scrape_metrics()


def _send_all(endpoint: str, prompts: list[list[int]], max_tokens: int = 1):
    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as session:
            out = []
            for p in prompts:  # sequential: each request finishes before the next starts
                out.append(await stream_completion(session, endpoint + "/v1/completions",
                                                   completion_payload("tiny", p, max_tokens)))
            return out

    results = asyncio.run(go())
    for r in results:
        assert r.ok, (r.error_class, r.error)
    return results


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(10, 8000, size=n).tolist()


def test_repeated_prompt_hits_exactly_the_block_cap(vllm_server):
    facts = vllm_server.facts()
    block = facts.block_size
    assert block and block % 32 == 0  # read from the server, not assumed
    rng = np.random.default_rng(7)
    lengths = [1, 2, block - 1, block, block + 1, 2 * block - 1, 2 * block, 2 * block + 1, 300, 5 * block + 17]
    for n in lengths:
        p = _prompt(rng, n)
        first, second = _send_all(vllm_server.endpoint, [p, p])
        assert first.cached_tokens == 0, n
        assert second.prompt_tokens == n
        assert second.cached_tokens == ((n - 1) // block) * block, n


def test_prefix_cache_counters_equal_the_sum_of_per_request_hits(vllm_server):
    rng = np.random.default_rng(11)
    base = _prompt(rng, 700)
    prompts = [base, base + _prompt(rng, 90), base[:400] + _prompt(rng, 300), base]
    before = _scrape(vllm_server.endpoint)
    results = _send_all(vllm_server.endpoint, prompts, max_tokens=4)
    after = _scrape(vllm_server.endpoint)
    d = metrics_delta(before, after)
    assert d.prefix_cache_hits == sum(r.cached_tokens for r in results)
    assert d.prefix_cache_queries == sum(r.prompt_tokens for r in results)
    assert d.counters["vllm:generation_tokens_total"] == 4 * len(prompts)


def test_server_info_cli_prints_the_facts_as_json(vllm_server):
    out = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "server-info", "--endpoint", vllm_server.endpoint,
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    for key in ("block_size", "num_blocks", "kv_capacity_tokens", "prefix_caching", "vllm_version"):
        assert facts[key] is not None, key
    assert facts["prefix_caching"] is True
    assert facts["kv_capacity_tokens"] == facts["num_blocks"] * facts["block_size"]
    # 32 MiB of KV cache at 2 KiB/token (4 layers x 2 KV heads x 64 x 2 (K,V) x 2 bytes)
    assert facts["kv_capacity_tokens"] == 32 * 2**20 // 2048


def test_dead_endpoint_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "server-info", "--endpoint", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "cannot read server facts from http://127.0.0.1:9" in out.stderr


# ---- a second server: prefix caching off, n-gram speculative decoding on ---------------------------------

# ngram_server: the shared session fixture in conftest.py.


def test_prefix_caching_off_reports_zero_and_facts_say_so(ngram_server):
    facts = ngram_server.facts()
    assert facts.prefix_caching is False
    p = _prompt(np.random.default_rng(3), 600)
    before = _scrape(ngram_server.endpoint)
    results = _send_all(ngram_server.endpoint, [p, p, p])
    after = _scrape(ngram_server.endpoint)
    assert [r.cached_tokens for r in results] == [0, 0, 0]
    assert metrics_delta(before, after).prefix_cache_hits == 0


def test_ngram_speculation_shows_drafts_and_accepted_tokens(ngram_server):
    facts = ngram_server.facts()
    assert facts.speculative_enabled and facts.speculative["num_speculative_tokens"] == 3
    pattern = _prompt(np.random.default_rng(5), 8)
    before = _scrape(ngram_server.endpoint)
    results = _send_all(ngram_server.endpoint, [pattern * 40], max_tokens=64)
    after = _scrape(ngram_server.endpoint)
    assert results[0].completion_tokens == 64  # ignore_eos + max_tokens: exact length even when speculating
    d = metrics_delta(before, after)
    assert d.spec_drafts > 0 and d.spec_draft_tokens > 0 and d.spec_accepted_tokens > 0
    assert len(d.accepted_per_position) == 3
    assert d.spec_drafts <= d.spec_draft_tokens <= 3 * d.spec_drafts  # fewer near max_tokens
    assert sum(d.accepted_per_position) == d.spec_accepted_tokens
    assert 1.0 < d.spec_mean_acceptance_length <= 4.0


def test_stopping_the_manager_leaves_no_vllm_process(ngram_server):
    pids = ngram_server.pids()
    assert len(pids) >= 2  # API server + engine core at least
    port = ngram_server.port
    ngram_server.stop()
    time.sleep(0.5)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if p.info["cmdline"] and "vllm.entrypoints" in " ".join(p.info["cmdline"])
                 and f"--port {port}" in " ".join(p.info["cmdline"])]
    assert leftovers == []


def test_unknown_vllm_flag_fails_fast_naming_the_flag(require_vllm, tiny_model_dir, tmp_path):
    t0 = time.time()
    with pytest.raises(ServerError) as e:
        start_server(tiny_model_dir, tmp_path, extra_args=["--definitely-not-a-flag"], startup_timeout_s=120)
    assert time.time() - t0 < 120
    assert e.value.cause == "unknown vLLM flag(s): --definitely-not-a-flag"
    assert "--definitely-not-a-flag" in str(e.value) and "last lines of" in str(e.value)


def test_demo_prints_growing_cached_tokens_and_leaves_nothing_running(require_vllm, tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "demo", "--model-dir", str(tiny_model_dir),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cached_tokens" in out.stdout
    rows = json.loads((tmp_path / "turns.json").read_text())
    assert len(rows) == 6
    cached = [r["cached_tokens"] for r in rows]
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:]))
    assert all(r["cached_tokens"] <= r["expected_cap"] for r in rows)
    assert not [p for p in psutil.process_iter(["cmdline"])
                if p.info["cmdline"] and str(tmp_path) in " ".join(p.info["cmdline"])]


def test_killing_the_server_mid_run_stops_the_replay_and_keeps_finished_records(vllm_server, tiny_model_dir, tmp_path):
    """Last of the session (file order): it SIGKILLs the shared `vllm_server`, whose other users all ran before
    it (a later request for it would start it again), so the kill costs no server start of its own."""
    from kvscope.workloads.generate import generate_from_file

    server = vllm_server
    trace = generate_from_file("agent-coding", tiny_model_dir, seed=1, scale=0.03, sessions=3,
                               max_context=1900).write(tmp_path / "trace")
    out_dir = tmp_path / "run"
    killed_at: list[float] = []

    def killer() -> None:
        jl = out_dir / "requests.jsonl"
        while not jl.exists() or jl.read_bytes().count(b"\n") < 5:
            time.sleep(0.05)
        killed_at.append(time.time())
        os.killpg(server.process.pid, signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    t0 = time.time()
    try:
        options = ReplayOptions(concurrency=1, time_scale=0.002, progress=False, scrape_interval_s=0.5,
                            total_timeout_s=20, idle_timeout_s=10, first_token_timeout_s=10)
        out = replay(trace, out_dir, options,
                     endpoints=[server.endpoint])
    finally:
        server.stop()
    assert out.aborted and "server stopped answering" in out.aborted
    assert time.time() - killed_at[0] < 20 + 5  # within the request timeout
    df = read_records(out_dir)  # requests.parquet exists and is readable
    ok = df[df["error_class"].isna()]
    assert len(ok) >= 5
    assert (out_dir / "requests.parquet").exists()
    assert json.loads((out_dir / "summary.json").read_text())["aborted"] == out.aborted
    assert t0 < killed_at[0]
