"""Tables for the primer notebook: the source documents' worked examples, computed by kvscope's own models."""

from __future__ import annotations

import pandas as pd

from kvscope.harness.cachemodel import kv_memory
from kvscope.harness.primer import batching, kv_demo, roofline, speculative
from kvscope.harness.pricing.cost import Pricing, agent_loop_tokens, no_cache_cost, request_cost
from kvscope.harness.cachemodel.kv_memory import GiB, KiB
from kvscope.harness.cachemodel.hashing import hash_token_blocks
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.pricing.cost import cost_breakdown
from kvscope.harness.pricing.provider_cache import ProviderCache, ProviderCacheConfig

#: The seed document's illustrative prices ($/MTok; writes 1.25x, reads 0.1x of input).
SEED_PRICING = Pricing(input_per_mtok=3.0, output_per_mtok=15.0, cache_write_multiplier=1.25, cache_read_multiplier=0.1)


def kv_size_table(shapes=("8b-gqa", "8b-mha", "70b-gqa", "70b-mha", "llama-2-7b", "llama-3.1-8b"),
                  contexts=(8192, 131072)) -> pd.DataFrame:
    rows = []
    for name in shapes:
        s = kv_memory.get_preset(name)
        row = {"shape": name, "layers": s.num_layers, "kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
               "kib_per_token_bf16": kv_memory.kv_bytes_per_token(s, "bf16") / KiB,
               "kib_per_token_fp8": kv_memory.kv_bytes_per_token(s, "fp8") / KiB}
        for c in contexts:
            row[f"gib_at_{c // 1024}k"] = kv_memory.kv_bytes_for_sequence(s, c, "bf16") / GiB
        rows.append(row)
    return pd.DataFrame(rows)


def capacity_example(memory_gib: float = 30, shape: str = "70b-gqa") -> pd.DataFrame:
    s = kv_memory.get_preset(shape)
    rows = []
    for ctx in (2048, 8192, 32768, 131072):
        per = kv_memory.kv_bytes_for_sequence(s, ctx)
        rows.append({"shape": shape, "memory_gib": memory_gib, "context": ctx, "gib_per_sequence": per / GiB,
                     "sequences_that_fit": kv_memory.max_concurrent_sequences(memory_gib * GiB, per)})
    return pd.DataFrame(rows)


def kv_growth(shapes=("8b-gqa", "70b-gqa", "70b-mha"), contexts=(1024, 4096, 8192, 16384, 32768, 65536, 131072)
              ) -> pd.DataFrame:
    return pd.DataFrame([{"shape": n, "context": c,
                          "gib": kv_memory.kv_bytes_for_sequence(kv_memory.get_preset(n), c) / GiB}
                         for n in shapes for c in contexts])


def passes_table() -> pd.DataFrame:
    rows = []
    for prompt, new in ((3, 5), (1, 1000)):
        without, with_cache = kv_demo.token_passes(prompt, new)
        rows.append({"prompt_tokens": prompt, "new_tokens": new, "token_passes_without_cache": without,
                     "token_passes_with_cache": with_cache, "ratio": without / with_cache})
    return pd.DataFrame(rows)


def invalidation_demo() -> pd.DataFrame:
    changed = kv_demo.edit_invalidation(n=6, d=8, n_layers=2, edit_pos=2, seed=0)
    return pd.DataFrame([{"layer": i, "positions_whose_kv_changed": v} for i, v in enumerate(changed)])


def provider_cost_example() -> pd.DataFrame:
    p = SEED_PRICING
    plain = no_cache_cost(p, 10_200, 500)
    first = request_cost(p, cache_write=10_000, uncached=200, output=500)
    later = request_cost(p, cache_read=10_000, uncached=200, output=500)
    return pd.DataFrame([
        {"case": "no caching, per request", "usd": plain},
        {"case": "first request (writes the 10k prefix)", "usd": first},
        {"case": "later requests (read the prefix)", "usd": later},
        {"case": "100 requests with caching", "usd": first + 99 * later},
        {"case": "100 requests without caching", "usd": 100 * plain},
    ])


def realistic_edit_table() -> pd.DataFrame:
    """A 3,330-token request after a 3,250-token one: append, edit at 2,010, edit at position 5."""
    rows = []
    for label, edit_at in (("append only", None), ("edit at token 2,010", 2010), ("edit at token 5", 5)):
        cache = ProviderCache(ProviderCacheConfig(name="seed", mode="automatic", ttl_s=None, min_prefix_tokens=0,
                                                  granularity_tokens=1, pricing=SEED_PRICING))
        prev, req = list(range(3250)), list(range(3330))
        if edit_at is not None:
            req[edit_at] = -1
        cache.request(SimRequest(0, len(prev), 0, hash_token_blocks(prev, 1), 1))
        s = cache.request(SimRequest(1, len(req), 0, hash_token_blocks(req, 1), 1, arrival_s=1.0))
        rows.append({"case": label, "cache_hit_tokens": s.cache_read,
                     "recomputed_tokens": s.cache_write + s.uncached_input, "hit_share": s.cache_read / len(req),
                     "input_usd": cost_breakdown(s, SEED_PRICING)["input_usd"],
                     "no_cache_usd": no_cache_cost(SEED_PRICING, len(req))})
    return pd.DataFrame(rows)


def agent_loop_example() -> pd.DataFrame:
    d = agent_loop_tokens(5000, 2000, 10)
    return pd.DataFrame([d])


def speculation_table(k: int = 4, rates=(0.5, 0.6, 0.7, 0.8, 0.9)) -> pd.DataFrame:
    return pd.DataFrame([{"acceptance_rate": a, "k": k,
                          "expected_tokens_per_target_pass": speculative.expected_tokens_per_pass(a, k)}
                         for a in rates])


def speculation_curves(ks=(1, 2, 4, 8), n: int = 41) -> pd.DataFrame:
    rows = []
    for k in ks:
        for i in range(n):
            a = i / (n - 1) * 0.99
            rows.append({"k": k, "acceptance_rate": a,
                         "expected_tokens_per_target_pass": speculative.expected_tokens_per_pass(a, k)})
    return pd.DataFrame(rows)


def rejection_sampling_check() -> pd.DataFrame:
    p, q = [0.6, 0.3, 0.1], [0.3, 0.5, 0.2]
    out = speculative.speculative_output_distribution(p, q)
    sampled = speculative.sample_speculative(p, q, 200_000, seed=0)
    return pd.DataFrame({"token": [0, 1, 2], "target_p": p, "draft_q": q, "output_exact": out,
                         "output_sampled": sampled, "exact": [speculative.is_exact(p, q)] * 3})


def batching_example() -> pd.DataFrame:
    lens = batching.seed_output_lengths(32, 5, 100, seed=1)
    return pd.DataFrame([batching.compare(lens, 8)])


def roofline_table(params: float = 8.03e9, bandwidth: float = 3.35e12, batches=(1, 8, 32, 64)) -> pd.DataFrame:
    w = params * 2
    return pd.DataFrame([{"batch": b, "weight_gb": w / 1e9, "bandwidth_tb_s": bandwidth / 1e12,
                          "decode_tok_per_s_upper_bound": roofline.decode_tokens_per_s_upper_bound(bandwidth, w, b)}
                         for b in batches])
