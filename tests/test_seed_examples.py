"""Every numeric worked example of the two seed documents (shared/seeds), reproduced through
kvscope's own functions.  Seed 000 = "KV cache, prompt caching, and inference economics";
seed 002 = "Behind prompt caching: a friendly intro to KV caching"."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.harness.cachemodel import kv_memory
from kvscope.harness.primer import batching, kv_demo, roofline, speculative
from kvscope.harness.pricing.cost import Pricing, agent_loop_tokens, cost_breakdown, no_cache_cost, request_cost
from kvscope.harness.cachemodel.kv_memory import GiB, KiB
from kvscope.harness.pricing.provider_cache import ProviderCache, ProviderCacheConfig, load_preset
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.cachemodel.hashing import hash_token_blocks
from kvscope.workloads.prefix import common_prefix_len

SEED = Pricing(input_per_mtok=3.0, output_per_mtok=15.0, cache_write_multiplier=1.25, cache_read_multiplier=0.1)


def _req(tokens, output=0, t=0.0, breakpoints=None, unit=1):
    return SimRequest(0, len(tokens), output, hash_token_blocks(tokens, unit), unit, arrival_s=t,
                      breakpoints=breakpoints)


def _auto_cache(**kw) -> ProviderCache:
    cfg = ProviderCacheConfig(name="seed", mode="automatic", ttl_s=None, min_prefix_tokens=0, granularity_tokens=1,
                              pricing=SEED, **kw)
    return ProviderCache(cfg)


# ---- seed 000: KV cache work ------------------------------------------------------------------------
def test_000_kv_projection_work_1000_tokens():
    # "1+2+...+1000 = 500,500 token-positions; the cached approach computes 1,000"
    assert kv_demo.token_passes(1, 1000) == (500_500, 1000)


def test_000_cached_decoding_equals_full_recomputation():
    # "True" and "18 projections vs 63 without a cache"
    d = kv_demo.cached_decoding_check(n=6, d_model=8, d_k=4, seed=0)
    assert d == {"equal": True, "projections_cached": 18, "projections_uncached": 63}
    assert tuple(3 * x for x in kv_demo.token_passes(1, 6)) == (63, 18)


# ---- seed 000: KV memory table and capacity ---------------------------------------------------------
@pytest.mark.parametrize("preset,kib,gib8k,gib128k", [
    ("8b-gqa", 128, 1.0, 16.0), ("8b-mha", 512, 4.0, 64.0), ("70b-gqa", 320, 2.5, 40.0), ("70b-mha", 2560, 20.0, 320.0),
])
def test_000_kv_table(preset, kib, gib8k, gib128k):
    s = kv_memory.get_preset(preset)
    assert kv_memory.kv_bytes_per_token(s, "bf16") / KiB == kib
    assert round(kv_memory.kv_bytes_for_sequence(s, 8192, "bf16") / GiB, 1) == gib8k
    assert round(kv_memory.kv_bytes_for_sequence(s, 131072, "bf16") / GiB, 1) == gib128k
    # the seed's own calculator signature
    assert kv_memory.kv_cache_bytes(s.num_layers, s.num_kv_heads, 128, 1) / 1024 == kib


def test_000_70b_gqa_8k_is_2_7_GB_and_mha_8x():
    b = kv_memory.kv_cache_bytes(80, 8, 128, 8192, 2)  # "2 * 80 * 1024 * 8192 * 2 ≈ 2.7 GB"
    assert b == 2 * 80 * 1024 * 8192 * 2 and round(b / 1e9, 1) == 2.7
    assert kv_memory.kv_cache_bytes(80, 64, 128, 8192) / b == 8  # "Without GQA it would be ~8x"


def test_000_fp8_halves_and_weights():
    s = kv_memory.get_preset("70b-gqa")
    assert kv_memory.kv_bytes_for_sequence(s, 8192, "fp8") / GiB == 1.25  # "2.5 to 1.25 GiB"
    assert round(kv_memory.get_preset("llama-3.1-70b").weight_bytes() / GiB) == 131  # "~131 GiB of bf16 weights"


def test_000_capacity_12_sequences_at_8k_and_128k_does_not_fit():
    s = kv_memory.get_preset("70b-gqa")
    assert kv_memory.max_concurrent_sequences(30 * GiB, kv_memory.kv_bytes_for_sequence(s, 8192)) == 12
    assert kv_memory.max_concurrent_sequences(30 * GiB, kv_memory.kv_bytes_for_sequence(s, 131072)) == 0
    r = kv_memory.kv_memory_report(preset="70b-gqa", context=8192, memory_gib=30)
    assert r["max_concurrent_sequences"] == 12 and r["kib_per_token"] == 320


# ---- seed 000: decode roofline ----------------------------------------------------------------------
def test_000_decode_roofline_and_prefill_flops():
    w = 8.03e9 * 2
    got = [round(roofline.decode_tokens_per_s_upper_bound(3.35e12, w, b)) for b in (1, 8, 32, 64)]
    assert got == [209, 1669, 6675, 13350]
    assert roofline.prefill_flops(8.03e9, 2000) / 1e12 == pytest.approx(32.12)
    assert round(kv_memory.get_preset("llama-3.1-8b").weight_bytes() / 1e9) == 16  # "16 GB of weights"
    assert roofline.decode_arithmetic_intensity(1) == 1  # "intensity ~ B FLOPs per byte"
    assert roofline.decode_arithmetic_intensity(2000) == 2000  # prefill of 2,000 tokens


# ---- seed 000: provider prompt caching costs --------------------------------------------------------
def test_000_worked_cost_example():
    plain = no_cache_cost(SEED, 10_200, 500)
    first = request_cost(SEED, cache_write=10_000, uncached=200, output=500)
    later = request_cost(SEED, cache_read=10_000, uncached=200, output=500)
    assert (round(plain, 4), round(first, 4), round(later, 4)) == (0.0381, 0.0456, 0.0111)
    assert (round(first + 99 * later, 2), round(100 * plain, 2)) == (1.14, 3.81)


def test_000_worked_cost_example_through_provider_cache_model():
    """Same numbers from the breakpoint cache model: a breakpoint after the 10,000-token stable prefix."""
    cfg = ProviderCacheConfig(name="seed-bp", mode="breakpoints", ttl_s=300, min_prefix_tokens=0,
                              granularity_tokens=1, pricing=SEED)
    cache = ProviderCache(cfg)
    prefix = list(range(10_000))
    costs = []
    for i in range(100):
        toks = prefix + [100_000 + 200 * i + j for j in range(200)]
        r = SimRequest(i, len(toks), 500, hash_token_blocks(toks, 100), 100, arrival_s=float(i),
                       breakpoints=[10_000])
        split = cache.request(r)
        costs.append(cost_breakdown(split, SEED)["total_usd"])
    assert round(costs[0], 4) == 0.0456 and round(costs[1], 4) == 0.0111
    assert round(sum(costs), 2) == 1.14


def test_000_append_vs_edit():
    sys_prompt = "You are a support bot . Answer briefly .".split()
    turn1 = "User : my invoice total looks wrong".split()
    asst1 = "Assistant : which invoice number ?".split()
    turn2 = "User : INV-204".split()
    cached = sys_prompt + turn1 + asst1 + turn2
    appended = cached + "Assistant : found it".split() + "User : thanks".split()
    edited = (sys_prompt + "User : my invoice total looks incorrect".split() + asst1 + turn2
              + "Assistant : found it".split() + "User : thanks".split())
    vocab: dict[str, int] = {}
    ids = lambda words: [vocab.setdefault(w, len(vocab)) for w in words]  # noqa: E731
    rows = []
    for req in (appended, edited):
        cache = _auto_cache()
        cache.request(_req(ids(cached)))
        s = cache.request(_req(ids(req), t=1.0))
        rows.append((len(req), s.cache_read, s.cache_write + s.uncached_input,
                     f"{s.cache_read / len(req):.0%}", f"{cost_breakdown(s, SEED)['input_usd'] * 1e6:.1f}"))
    assert rows == [(32, 25, 7, "78%", "33.8"), (32, 15, 17, "47%", "68.2")]
    assert common_prefix_len(cached, edited) == 15


@pytest.mark.parametrize("edit_at,hit,pct,recomputed,usd", [
    (None, 3250, "97.6%", 80, "0.0013"),
    (2010, 2010, "60.4%", 1320, "0.0056"),
    (5, 5, "0.15%", 3325, "0.0125"),
])
def test_000_realistic_scale_table(edit_at, hit, pct, recomputed, usd):
    prev = list(range(3250))
    req = list(range(3330))
    if edit_at is not None:
        req[edit_at] = -1
    cache = _auto_cache()
    cache.request(_req(prev))
    s = cache.request(_req(req, t=1.0))
    assert (s.cache_read, s.cache_write + s.uncached_input) == (hit, recomputed)
    assert f"{s.cache_read / 3330:.{2 if edit_at == 5 else 1}%}" == pct
    input_usd = cost_breakdown(s, SEED)["input_usd"]
    assert f"{input_usd:.4f}" == usd
    no_cache = no_cache_cost(SEED, 3330)
    assert f"{no_cache:.4f}" == "0.0100"
    if edit_at == 5:
        assert input_usd > no_cache  # an invalidated cache costs more than no caching


def test_000_agent_loop_140000_vs_23000():
    d = agent_loop_tokens(5000, 2000, 10)
    assert (d["sent"], d["final_context"]) == (140_000, 23_000)
    # and through the cache model: a perfect prefix cache computes 23,000 tokens once
    cache = _auto_cache()
    ctx = list(range(5000))
    uncached = read = 0
    for step in range(10):
        s = cache.request(_req(ctx, t=float(step), unit=1000))
        uncached += s.cache_write + s.uncached_input
        read += s.cache_read
        ctx = ctx + list(range(10_000 + 2000 * step, 12_000 + 2000 * step))
    assert (uncached, read) == (23_000, 117_000)


# ---- seed 000: speculative decoding -----------------------------------------------------------------
def test_000_expected_tokens_per_pass():
    got = [round(speculative.expected_tokens_per_pass(a, 4), 2) for a in (0.5, 0.7, 0.8, 0.9)]
    assert got == [1.94, 2.77, 3.36, 4.10]


def test_000_rejection_sampling_exact():
    p, q = [0.6, 0.3, 0.1], [0.3, 0.5, 0.2]
    assert np.allclose(speculative.acceptance_probabilities(p, q), [1.0, 0.6, 0.5])
    assert np.allclose(speculative.residual_distribution(p, q), [1.0, 0.0, 0.0])
    assert np.allclose(speculative.speculative_output_distribution(p, q), [0.6, 0.3, 0.1])
    assert speculative.is_exact(p, q)


# ---- seed 000: batching -----------------------------------------------------------------------------
def test_000_static_vs_continuous_batching():
    lens = batching.seed_output_lengths(32, 5, 100, seed=1)
    d = batching.compare(lens, 8)
    assert (d["tokens"], d["static_steps"], d["continuous_steps"]) == (1489, 350, 233)
    assert round(d["lower_bound_steps"]) == 186


# ---- seed 000: latency worked estimate --------------------------------------------------------------
def test_000_latency_estimates():
    assert roofline.request_latency_s(0.8, 500, 0.025) == pytest.approx(13.3)
    assert roofline.request_latency_s(0.2, 500, 0.025) == pytest.approx(12.7)
    assert roofline.request_latency_s(0.8, 150, 0.025) == pytest.approx(4.55)


# ---- seed 000: edit invalidation demo ---------------------------------------------------------------
def test_000_edit_invalidates_later_positions():
    assert kv_demo.edit_invalidation(n=6, d=8, n_layers=2, edit_pos=2, seed=0) == [[2], [2, 3, 4, 5]]


# ---- seed 002 ---------------------------------------------------------------------------------------
def test_002_the_cat_sat_25_vs_7():
    assert kv_demo.token_passes(3, 5) == (25, 7)


def test_002_500x_and_attention_still_quadratic():
    without, with_cache = kv_demo.token_passes(1, 1000)
    assert round(without / with_cache) == 500
    cube, square = kv_demo.attention_score_work(1000)
    assert square == 500_500 and round(cube / 1e6) == 167


def test_002_llama2_7b_and_llama31_8b_memory():
    l2 = kv_memory.get_preset("llama-2-7b")
    assert kv_memory.kv_bytes_per_token(l2) / KiB == 512
    assert kv_memory.kv_bytes_for_sequence(l2, 8192) / GiB == 4
    assert round(l2.weight_bytes() / 1e9, 1) == 13.5
    total = l2.weight_bytes() + 16 * kv_memory.kv_bytes_for_sequence(l2, 8192)
    assert round(total / 1e9) == 82 and total > 80e9
    l3 = kv_memory.get_preset("llama-3.1-8b")
    assert kv_memory.kv_bytes_per_token(l3) / KiB == 128
    assert kv_memory.kv_bytes_per_token(l2) / kv_memory.kv_bytes_per_token(l3) == 4
    assert round(kv_memory.kv_bytes_for_sequence(l3, 8192) / 1e9) == 1  # "about 1 GB"


def test_002_only_new_question_costs_11_percent():
    cfg = ProviderCacheConfig(name="read-only", mode="automatic", ttl_s=None, min_prefix_tokens=0,
                              granularity_tokens=1, pricing=Pricing(input_per_mtok=3.0, output_per_mtok=15.0,
                                                                    cache_read_multiplier=0.1))
    system, tools, examples = list(range(2000)), list(range(2000, 3500)), list(range(3500, 4700))
    first = system + tools + examples + list(range(9000, 9030))
    cases = {
        "new question": system + tools + examples + list(range(9100, 9130)),
        "tools reordered": system + tools[750:] + tools[:750] + examples + list(range(9100, 9130)),
        "timestamp first": [-5] + system + tools + examples + list(range(9100, 9129)),
    }
    reads = {}
    for name, req in cases.items():
        cache = ProviderCache(cfg)
        cache.request(_req(first))
        s = cache.request(_req(req, t=1.0))
        reads[name] = s.cache_read
        if name == "new question":
            share = cost_breakdown(s, cfg.pricing)["input_usd"] / no_cache_cost(cfg.pricing, len(req))
            assert round(share * 100) == 11
    assert reads == {"new question": 4700, "tools reordered": 2000, "timestamp first": 0}


def test_002_provider_table_in_presets():
    a = load_preset("anthropic-sonnet-5m")
    assert (a.pricing.cache_read_multiplier, a.pricing.cache_write_multiplier) == (0.1, 1.25)
    assert a.min_prefix_tokens == 1024 and a.ttl_s == 300 and a.refresh_on_hit and a.mode == "breakpoints"
    o = load_preset("openai-gpt-4.1")
    assert o.mode == "automatic" and o.min_prefix_tokens == 1024
    assert 0.1 <= o.pricing.cache_read_multiplier <= 0.5  # "50% to 90% off input"
