"""vLLM V1 prefix-cache rules (vllm-facts §1, §9) and properties of the simulator."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.harness.cachemodel.block_pool import BlockPool
from kvscope.harness.cachemodel.simulator import (ServiceModel, SimConfig, predict_cached_tokens, requests_from_token_pairs,
                                       simulate)
from kvscope.harness.cachemodel.sim_types import SimRequest

from .reference import RefPool


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---- hit cap ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("P,expected", [(300, 256), (260, 256), (256, 128), (257, 256), (129, 128), (128, 0),
                                        (1, 0), (2, 0)])
def test_repeat_hit_is_capped_at_p_minus_1_over_b(P, expected):
    p = seq(1000, P)
    assert predict_cached_tokens([(p, [7]), (p, [7])], 128, None) == [0, expected]
    assert predict_cached_tokens([(p, [7]), (p, [7])], 128, 40) == [0, expected]


# ---- P + O - 1 tokens cached ------------------------------------------------------------------------
@pytest.mark.parametrize("O,expected", [(56, 128), (57, 256), (100, 256)])
def test_finished_request_caches_p_plus_o_minus_1_tokens(O, expected):
    # P=200: P+O = 256 with O=56 -> only 255 tokens computed -> one full block cached.
    prompt, out = seq(0, 200), seq(5000, O)
    nxt = prompt + out + seq(9000, 100)
    assert predict_cached_tokens([(prompt, out), (nxt, [1])], 128, None)[1] == expected
    assert predict_cached_tokens([(prompt, out), (nxt, [1])], 128, 12)[1] == expected


# ---- reverse-order free ---------------------------------------------------------------------------
def test_blocks_are_freed_in_reverse_order_so_chain_tail_is_evicted_first():
    B = 4
    A, C = seq(0, 12), seq(100, 8)
    got = predict_cached_tokens([(A, [1]), (C, [1]), (A, [1])], B, 5)
    assert got == [0, 0, 8]  # C evicts A's *last* block; A's first two blocks survive


# ---- free-queue placement of unhashed blocks -------------------------------------------------------
def test_unhashed_blocks_go_to_front_hashed_to_back():
    B = 4
    X, A, C = seq(0, 8), seq(100, 6), seq(200, 4)
    X2 = X + seq(300, 4)
    pairs = [(X, [1]), (A, [1]), (C, [1]), (X2, [1])]
    assert predict_cached_tokens(pairs, B, 5, free_order="split") == [0, 0, 0, 8]
    assert predict_cached_tokens(pairs, B, 5, free_order="append") == [0, 0, 0, 4]  # vLLM 0.11


# ---- null block --------------------------------------------------------------------------------------
def test_null_block_leaves_num_gpu_blocks_minus_one_usable():
    pool = BlockPool(3)
    assert pool.usable_blocks == 2 and pool.num_free == 2 and 0 not in pool.free_queue
    B = 4
    A, Bq = seq(0, 8), seq(100, 8)
    A2 = A + seq(200, 4)
    # num_gpu_blocks=4 -> 3 usable: A frees [free, A1, A0]; Bq's 2 blocks pop the free one and A's tail.
    assert predict_cached_tokens([(A, [1]), (Bq, [1]), (A2, [1])], B, 4) == [0, 0, 4]
    # one more block and A survives whole; if all 4 were usable the first case would look like this.
    assert predict_cached_tokens([(A, [1]), (Bq, [1]), (A2, [1])], B, 5) == [0, 0, 8]


def test_request_larger_than_pool_is_rejected():
    reqs = requests_from_token_pairs([(seq(0, 9), [1]), (seq(0, 9), [1])], 4)
    res = simulate(reqs, SimConfig(4, 3))  # needs 3 blocks, 2 usable
    assert [r.fits for r in res.results] == [False, False]
    assert res.cached_tokens == [0, 0]


def test_usage_matches_vllm_formula():
    pool = BlockPool(11)
    pool.allocate(4)
    assert pool.usage() == pytest.approx(1 - 6 / 10)


# ---- duplicate copies of recomputed blocks -------------------------------------------------------------
def test_recomputed_capped_block_is_cached_twice():
    B = 4
    A = seq(0, 8)  # 2 full blocks; the repeat hits 1 (cap) and recomputes block 1
    reqs = requests_from_token_pairs([(A, [1]), (A, [1])], B)
    from kvscope.harness.cachemodel.simulator import Replica

    rep = Replica(SimConfig(B, 10))
    rep.run_sequential(reqs[0])
    rep.run_sequential(reqs[1])
    pool = rep.pool
    h1 = reqs[0].hashes[1]
    assert h1 in pool.extra_copies and len(pool.extra_copies[h1]) == 1
    hashed = [b for b in range(1, 10) if pool.block_hash[b] is not None]
    assert len(hashed) == 3  # two copies of block 1 + block 0


def test_duplicates_compete_for_space():
    # With 2 usable blocks, repeating an 8-token prompt: the copy of block 1 pushes out older content.
    B = 4
    A = seq(0, 8)
    assert predict_cached_tokens([(A, [1])] * 4, B, 3) == [0, 4, 4, 4]


def test_evicting_oldest_copy_promotes_younger():
    pool = BlockPool(6)
    b = pool.allocate(2)
    pool.cache_blocks(b, [42, 42])
    assert pool.cached[42] == b[0] and pool.extra_copies[42] == [b[1]]
    pool.free(b)  # reverse: b[1] then b[0] to the back
    pool.allocate(3)  # the three never-used blocks
    pool.allocate(1)  # pops b[1] (the younger copy)
    assert pool.cached[42] == b[0] and 42 not in pool.extra_copies
    pool.allocate(1)
    assert 42 not in pool.cached


# ---- salt isolation ----------------------------------------------------------------------------------
def test_cache_salt_isolates():
    p = seq(0, 300)
    salts = ["a", "b", "a", None, None]
    assert predict_cached_tokens([(p, [1])] * 5, 128, None, cache_salts=salts) == [0, 0, 256, 0, 256]


# ---- timed mode: running requests pin blocks ------------------------------------------------------------
def test_running_request_blocks_are_pinned_and_shared():
    B = 4
    svc = ServiceModel(prefill_tokens_per_s=1e9, decode_tokens_per_s=1.0)
    # R0: 8-token prompt, 5 output tokens -> 12 computed tokens -> 3 blocks, runs 5 s.
    r0 = SimRequest(0, 8, 5, [], B, arrival_s=0.0)
    r1 = SimRequest(1, 8, 1, [], B, arrival_s=1.0)  # unrelated, needs 2 blocks
    r2 = SimRequest(2, 12, 1, [], B, arrival_s=2.0)  # extends R0's prompt
    reqs = requests_from_token_pairs([(seq(0, 8), None), (seq(100, 8), None), (seq(0, 12), None)], B)
    for r, src in zip(reqs, (r0, r1, r2)):
        r.output_tokens, r.arrival_s = src.output_tokens, src.arrival_s
    res = simulate(reqs, SimConfig(B, 5), mode="timed", service=svc)  # 4 usable blocks
    by = {r.request_id: r for r in res.results}
    assert by[0].start_s == 0.0 and by[0].finish_s == pytest.approx(5.0)
    # R1 needs 2 blocks but only 1 is free while R0 runs: it waits (R0's blocks cannot be evicted).
    assert by[1].start_s == pytest.approx(5.0)
    # R2 queues behind R1 (FCFS) and then hits R0's two prompt blocks.
    assert by[2].cached_tokens == 8


def test_timed_mode_with_ample_capacity_equals_sequential_when_requests_do_not_overlap():
    rng = random.Random(3)
    pairs = []
    base = seq(0, 50)
    for i in range(30):
        pairs.append((base + seq(1000 * i, rng.randint(1, 40)), seq(50_000 + i * 100, rng.randint(1, 9))))
    reqs = requests_from_token_pairs(pairs, 8)
    for i, r in enumerate(reqs):
        r.arrival_s = 1000.0 * i
    seq_res = simulate(reqs, SimConfig(8, 2000)).cached_tokens
    timed = simulate(reqs, SimConfig(8, 2000), mode="timed").cached_tokens
    assert seq_res == timed


# ---- replicas ---------------------------------------------------------------------------------------------
def test_routing_policies():
    pairs = [(seq(0, 40) + seq(1000 * s + 100 * t, 10 * (t + 1)), [1]) for t in range(4) for s in range(3)]
    sids = [f"s{s}" for t in range(4) for s in range(3)]
    reqs = requests_from_token_pairs(pairs, 8, session_ids=sids)
    one = simulate(reqs, SimConfig(8, None)).summary()
    out = {}
    for pol in ("round-robin", "least-loaded", "session-affinity", "prefix-aware"):
        s = simulate(reqs, SimConfig(8, None), replicas=2, routing=pol).summary()
        assert len(s["per_replica"]) == 2 and sum(p["requests"] for p in s["per_replica"]) == len(reqs)
        out[pol] = s["cached_tokens"]
    assert out["session-affinity"] <= one["cached_tokens"]
    assert out["prefix-aware"] >= out["round-robin"]


# ---- properties (hypothesis) ---------------------------------------------------------------------------------
token = st.integers(0, 3)  # tiny vocabulary -> many shared prefixes


@st.composite
def workloads(draw):
    B = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(1, 12))
    pairs = []
    prev: list[int] = []
    for _ in range(n):
        kind = draw(st.sampled_from(["extend", "fresh", "repeat", "edit"]))
        if kind == "extend" and prev:
            p = prev + draw(st.lists(token, min_size=1, max_size=10))
        elif kind == "repeat" and prev:
            p = list(prev)
        elif kind == "edit" and prev:
            p = list(prev)
            p[draw(st.integers(0, len(p) - 1))] = draw(token)
        else:
            p = draw(st.lists(token, min_size=1, max_size=20))
        o = draw(st.lists(token, min_size=1, max_size=6))
        pairs.append((p, o))
        prev = p + o[:-1] if draw(st.booleans()) else p
    return B, pairs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.one_of(st.none(), st.integers(2, 20)))
def test_matches_reference_model(wl, nblocks):
    B, pairs = wl
    ref = RefPool(nblocks, B)
    expected = [ref.run(p, p + o) for p, o in pairs]
    assert predict_cached_tokens(pairs, B, nblocks) == expected


@settings(max_examples=200, deadline=None)
@given(workloads(), st.integers(2, 20))
def test_invariants(wl, nblocks):
    B, pairs = wl
    got = predict_cached_tokens(pairs, B, nblocks)
    for (p, _), c in zip(pairs, got):
        assert c % B == 0 and 0 <= c <= (len(p) - 1) // B * B


@settings(max_examples=200, deadline=None)
@given(workloads())
def test_immediate_repeat_gets_the_cap(wl):
    B, pairs = wl
    p, o = pairs[-1]
    need = -(-(len(p) + len(o) - 1) // B)
    got = predict_cached_tokens(pairs + [(p, o)], B, need + 1)
    assert got[-1] == (len(p) - 1) // B * B


@settings(max_examples=200, deadline=None)
@given(workloads())
def test_pool_that_never_evicts_equals_infinite(wl):
    B, pairs = wl
    total = sum(-(-(len(p) + len(o) - 1) // B) for p, o in pairs)
    assert predict_cached_tokens(pairs, B, total + 1) == predict_cached_tokens(pairs, B, None)


# ---- the sequential fast pool equals the general one, block for block --------------------------------
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.integers(2, 40), st.sampled_from([1, 2, 4]), st.booleans())
def test_sequential_pool_equals_general_pool_block_for_block(seed, nblocks, B, sessions):
    from kvscope.harness.cachemodel.ring_pool import RingBlockPool
    from kvscope.harness.cachemodel.simulator import Replica

    rng = random.Random(seed)
    pairs, prev = [], []
    for _ in range(400):  # long enough to fill the lazy-deletion ring and compact it
        r = rng.random()
        if r < 0.5 and prev:
            p = prev + [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        elif r < 0.65 and prev:
            p = list(prev)
        elif r < 0.8 and prev:
            p = list(prev)
            p[rng.randrange(len(p))] = rng.randrange(4)
        else:
            p = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        o = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        pairs.append((p, o))
        prev = p + o[:-1] if rng.random() < 0.5 else p
        if len(prev) > 120:
            prev = []
    # with session ids the fast pool also takes its session shortcut (validated reuse of the previous blocks)
    sids = [rng.choice("abc") for _ in pairs] if sessions else None
    reqs = requests_from_token_pairs(pairs, B, session_ids=sids)
    fast, general = Replica(SimConfig(B, nblocks)), Replica(SimConfig(B, nblocks), mode="timed")
    assert isinstance(fast.pool, RingBlockPool) and isinstance(general.pool, BlockPool)
    fast.pool.ring = fast.pool.ring[:8]  # force frequent compaction and growth
    for req in reqs:
        assert fast.run_sequential(req) == general.run_sequential(req)
        assert fast.pool.free_queue_order() == list(general.pool.free_queue)
    assert fast.pool.block_hash == general.pool.block_hash
    assert fast.pool.cached == general.pool.cached and fast.pool.extra_copies == general.pool.extra_copies
    assert fast.pool.evictions == general.pool.evictions and fast.pool.num_free == general.pool.num_free


# ---- one pool interface ----------------------------------------------------------------------------------
def test_every_pool_implements_the_pool_protocol_and_the_unbounded_pool_never_fills():
    from kvscope.harness.cachemodel.pool import InfinitePool, Pool, make_pool
    from kvscope.harness.cachemodel.ring_pool import RingBlockPool

    pools = [make_pool(None), make_pool(8), make_pool(8, "append"), make_pool(8, reference=True)]
    assert [type(p) for p in pools] == [InfinitePool, RingBlockPool, BlockPool, BlockPool]
    assert all(isinstance(p, Pool) for p in pools)
    inf = pools[0]
    assert inf.run_idle([1, 2, 3], 2, 4, 3, "s") == 0
    assert inf.run_idle([1, 2, 3, 4], 3, 5, 4, "s") == 3  # the session's previous blocks stay cached for good
    assert inf.run_idle([1, 9, 3, 4], 3, 5, 4, "t") == 1
    k, hits = inf.find_hits([1, 2, 3, 4, 5], 5)
    assert k == 4 and inf.evictable(hits) == 0 and len(inf.take(hits)) == 4 and inf.num_free > 10**9


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(4, 30))
def test_unbounded_pool_equals_a_pool_too_large_to_evict(seed, n_requests):
    """The unbounded pool's hits, in both simulator modes, are those of a finite pool that never evicts."""
    rng = random.Random(seed)
    pairs, sids, prev = [], [], {}
    for _ in range(n_requests):
        sid = rng.choice("abc")
        p = prev.get(sid, []) + [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
        o = [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
        pairs.append((p, o))
        sids.append(sid)
        prev[sid] = p + o[:-1] if rng.random() < 0.7 else p[: len(p) // 2]
    reqs = requests_from_token_pairs(pairs, 2, session_ids=sids)
    for mode in ("sequential", "timed"):
        unbounded = simulate(reqs, SimConfig(2, None), mode=mode, replicas=2, routing="session-affinity")
        huge = simulate(reqs, SimConfig(2, 100_000), mode=mode, replicas=2, routing="session-affinity")
        assert unbounded.cached_tokens == huge.cached_tokens
