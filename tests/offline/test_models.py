"""Hashing, trace readers, provider cache, KV memory, cost and CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvscope.harness.cachemodel import api
from kvscope.harness.pricing.api import cost_report
from kvscope.harness.pricing.cost import Pricing, self_hosted_cost
from kvscope.harness.cachemodel.hashing import IncrementalHasher, hash_token_blocks, regroup_block_ids
from kvscope.workloads.prefix import common_prefix_len as common_prefix
from kvscope.harness.cachemodel.kv_memory import kv_bytes_for_sequence, kv_bytes_per_token, kv_memory_report, shape_from_hf_config
from kvscope.harness.pricing.provider_cache import ProviderCache, ProviderCacheConfig, list_presets, load_preset
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.cachemodel.trace_io import load_trace

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_incremental_hashing_equals_scratch():
    rng = np.random.default_rng(0)
    h = IncrementalHasher(16)
    base = rng.integers(0, 1000, 500).astype(np.int32)
    for n in (100, 300, 500):
        toks = base[:n]
        assert h.hashes("s", toks, n // 16) == hash_token_blocks(toks, 16)
    edited = base.copy()
    edited[200] += 1
    assert h.hashes("s", edited, 31) == hash_token_blocks(edited, 16)
    assert hash_token_blocks(base, 16)[:12] == hash_token_blocks(edited, 16)[:12]
    assert hash_token_blocks(base, 16)[12] != hash_token_blocks(edited, 16)[12]
    assert hash_token_blocks(base, 16, cache_salt="x")[0] != hash_token_blocks(base, 16)[0]


def test_common_prefix_and_regroup():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 9], [1, 2, 3, 4]) == 3
    assert common_prefix([5], [1]) == 0
    assert regroup_block_ids([1, 2, 3, 4, 5], 64, 128) == [2, 4]
    with pytest.raises(ValueError):
        regroup_block_ids([1, 2], 64, 32)


def test_token_jsonl_and_kvscope_trace_dir(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys_p = list(range(40))
    rows = [{"prompt_token_ids": sys_p + [100, 101], "output_token_ids": [7, 8], "session_id": "a"},
            {"prompt_token_ids": sys_p + [100, 101, 7, 8, 200], "output_token_ids": [9], "session_id": "a"},
            {"prompt_token_ids": sys_p + [300], "output_tokens": 3, "session_id": "b", "cache_salt": "z"}]
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    tr = load_trace(f, 16)
    assert tr.kind == "jsonl" and [r.prompt_tokens for r in tr.requests] == [42, 45, 41]
    out = api.simulate_trace(str(f), block_size=16)
    assert out["cached_tokens"] == 32 + 0 and out["requests"] == 3  # salt "z" isolates request 3

    d = tmp_path / "trace"
    d.mkdir()
    segs = {0: sys_p, 1: [100, 101], 2: [7, 8], 3: [200], 4: [9], 5: [300]}
    pq.write_table(pa.table({"segment_id": list(segs), "kind": ["system"] * 6,
                             "token_ids": pa.array(list(segs.values()), pa.list_(pa.int32()))}), d / "segments.parquet")
    pq.write_table(pa.table({
        "request_id": [0, 1, 2], "session_id": ["a", "a", "b"], "step": [0, 1, 0], "parent_request_id": [-1, 0, -1],
        "arrival_s": [0.0, 1.0, 2.0], "think_time_s": [0.0, 0.5, 0.0], "tool_latency_s": [0.0, 0.0, 0.0],
        "prompt_segment_ids": [[0, 1], [0, 1, 2, 3], [0, 5]], "prompt_tokens": [42, 45, 41],
        "output_segment_id": [2, 4, -1], "output_tokens": [2, 1, 3], "cache_salt": [None, None, "z"]}),
        d / "requests.parquet")
    (d / "trace.json").write_text(json.dumps({"format": "kvscope-trace", "version": 1}))
    tr2 = load_trace(d, 16)
    assert tr2.kind == "kvscope"
    assert [r.hashes for r in tr2.requests] == [r.hashes for r in tr.requests]
    assert tr2.requests[1].gap_s == 0.5


def test_provider_ttl_refresh_min_prefix_granularity():
    cfg = ProviderCacheConfig(name="t", mode="automatic", ttl_s=300, min_prefix_tokens=1024, granularity_tokens=128,
                              pricing=Pricing(input_per_mtok=1, output_per_mtok=1, cache_read_multiplier=0.1))
    toks = list(range(2000))

    def req(t, n=2000):
        return SimRequest(0, n, 1, hash_token_blocks(toks[:n], 64), 64, arrival_s=t)

    c = ProviderCache(cfg)
    assert c.request(req(0)).cache_read == 0
    assert c.request(req(200)).cache_read == 1920  # floor(2000/128)*128
    assert c.request(req(450)).cache_read == 1920  # refreshed at t=200
    assert c.request(req(800)).cache_read == 0  # expired (450 + 300 < 800)
    assert ProviderCache(cfg).request(req(0, 1000)).cache_write == 0  # below the minimum


def test_presets_load_with_dates_and_sources():
    names = list_presets()
    for n in ("anthropic-sonnet-5m", "anthropic-sonnet-1h", "openai-gpt-4.1", "gemini-2.5-flash-implicit",
              "deepseek-v3.2"):
        assert n in names
        p = load_preset(n)
        assert p.as_of and p.source.startswith("http")
    assert load_preset("anthropic-sonnet-1h").pricing.cache_write_multiplier == 2.0


def test_hf_config_sliding_window_tp_fp8(tmp_path):
    cfg = {"num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
           "hidden_size": 3584, "sliding_window": 4096, "model_type": "gemma2", "torch_dtype": "bfloat16"}
    s = shape_from_hf_config(cfg)
    assert s.num_sliding_layers == 21
    per_tok = kv_bytes_per_token(s)
    assert kv_bytes_for_sequence(s, 2048) == per_tok * 2048
    assert kv_bytes_for_sequence(s, 16384) == per_tok / 42 * (21 * 16384 + 21 * 4096)
    tiny = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    r = kv_memory_report(config=str(tmp_path), context=1024, memory_gib=1, block_size=128)
    assert r["bytes_per_token"] == 1024 and r["kv_cache_size_tokens"] == 1_048_576 and r["num_gpu_blocks"] == 8192
    r8 = kv_memory_report(config=str(tmp_path), context=1024, memory_gib=1, block_size=128, kv_dtype="fp8")
    assert r8["kv_cache_size_tokens"] == 2_097_152
    r_tp = kv_memory_report(preset="llama-3.1-70b", context=8192, tp=4)
    assert r_tp["kv_heads_per_gpu"] == 2 and r_tp["kib_per_token"] == 80
    assert kv_memory_report(preset="llama-3.1-8b", tp=16, context=1)["kv_heads_per_gpu"] == 1  # replicated


def test_self_hosted_cost():
    d = self_hosted_cost(2.0, 1, 1000.0, tokens=3.6e6)
    assert d["usd_per_mtok"] == pytest.approx(2.0 / 3.6) and d["usd"] == pytest.approx(2.0)


def test_run_dir_cost(tmp_path):
    import pandas as pd

    pd.DataFrame({"prompt_tokens": [10_200, 10_200], "cached_tokens": [0, 10_000], "output_tokens": [500, 500],
                  "session_id": ["s", "s"]}).to_parquet(tmp_path / "requests.parquet")
    d = cost_report(str(tmp_path), "anthropic-sonnet-5m")
    assert d["cache_read_tokens"] == 10_000 and d["cache_write_tokens"] == 10_400 and d["sessions"] == 1


def test_cli_json(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_token_ids": list(range(300)), "output_token_ids": [1]})
                           for _ in range(2)))
    per = tmp_path / "per.jsonl"
    cmd = [sys.executable, "-m", "kvscope.harness.cli.offline", "simulate", str(f), "--block-size", "128",
           "--num-gpu-blocks", "12", "--per-request", str(per), "--json"]
    out = json.loads(subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout)
    assert out["cached_tokens"] == 256 and out["token_hit_ratio"] == 256 / 600
    assert [json.loads(x)["cached_tokens"] for x in per.read_text().splitlines()] == [0, 256]
    km = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.offline", "kv-memory", "--preset", "llama-3.1-8b",
                         "--context", "8192", "--json"], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(km.stdout)["kib_per_token"] == 128
    import argparse

    from kvscope.harness.cli.offline import add_subcommands

    p = argparse.ArgumentParser()
    add_subcommands(p.add_subparsers())
    assert p.parse_args(["cost", "x", "--pricing", "openai-gpt-4.1"]).pricing == "openai-gpt-4.1"


def test_tiny_preset_matches_the_built_model_and_its_config(tmp_path):
    from kvscope.harness.cachemodel.kv_memory import get_preset
    from kvscope.harness.model.tinymodel import TinyModelShape, _config_json

    t = TinyModelShape()
    p = get_preset("kvscope-tiny")
    assert (p.num_layers, p.num_attention_heads, p.num_kv_heads, p.head_dim, p.params) == (
        t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.num_parameters())
    assert kv_bytes_per_token(p, "bf16") == t.kv_bytes_per_token(2) == 2048
    (tmp_path / "config.json").write_text(json.dumps(_config_json(t, 1, [2])))
    from_cfg = shape_from_hf_config(tmp_path)
    assert kv_bytes_per_token(from_cfg, "bf16") == kv_bytes_per_token(p, "bf16")
    out = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.offline", "kv-memory", "--config",
                          str(tmp_path / "config.json"), "--json"], capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    assert d["bytes_per_token"] == 2048 and d["num_layers"] == 4, d
