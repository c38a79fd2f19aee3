"""The compact chain indexes `kvscope explain` streams traces through (issue 27) answer exactly what the
Python dict and set they replace answer, across merges of their recent-insertion buffer."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.harness.cachemodel.chain_index import ChainIndex, InfiniteCacheStream, _Sorted, chain_hashes
from kvscope.harness.cachemodel.hashing import IncrementalHasher, hash_token_blocks
from kvscope.harness.cachemodel.simulator import SimConfig, requests_from_token_pairs, simulate

# chains of a small alphabet with block size 1, so chains share prefixes, puts overwrite and runs stop midway
chains = st.lists(st.integers(0, 2), max_size=6)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), chains, st.integers(0, 50)), max_size=30),
       limit=st.integers(1, 4))
def test_chain_index_answers_like_a_dict(ops, limit):
    chunk, _Sorted.chunk = _Sorted.chunk, 2  # merges move entries in several chunks
    try:
        _check_against_dict(ops, limit)
    finally:
        _Sorted.chunk = chunk


def _check_against_dict(ops, limit):
    index, model = ChainIndex(pending_limit=limit), {}
    for is_put, tokens, value in ops:
        arr = chain_hashes(np.asarray(tokens, np.int32), 1, len(tokens))
        hs = arr.tolist()
        if is_put:
            index.put(arr, value)
            model.update(dict.fromkeys(hs, value))
        else:
            k = next((i for i, h in enumerate(hs) if h not in model), len(hs))
            assert index.leading_run(arr) == (k, model[hs[k - 1]] if k else None)
            cap = value % 4
            assert index.leading_run(arr, cap)[0] == min(k, cap)
    assert len(index) == len(model)


def test_chain_index_keeps_hashes_across_the_whole_uint64_range():
    index = ChainIndex(pending_limit=2)
    chain = np.array([2**64 - 1, 0, 2**63, 2**63 - 1, 5], dtype=np.uint64)
    for n in range(1, 6):
        index.put(chain[:n], n)  # merges into both sorted levels on the way
    assert index.leading_run(chain) == (5, 5)
    assert index.leading_run(np.array([2**64 - 1, 1], dtype=np.uint64)) == (1, 5)


prompts = st.lists(st.integers(0, 2), min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(prompts, st.one_of(st.none(), st.lists(st.integers(0, 2), max_size=6))),
                      min_size=1, max_size=12))
def test_infinite_cache_stream_is_the_sequential_infinite_simulation(pairs):
    B = 4
    expected = simulate(requests_from_token_pairs(pairs, B), SimConfig(B, None)).cached_tokens
    cache, hasher = InfiniteCacheStream(B), IncrementalHasher(B)
    cache.cached.pending_limit = 3  # merges between requests
    got = []
    for prompt, output in pairs:
        toks = np.asarray(prompt + (output or []), np.int32)
        n = (len(prompt) + len(output) - 1) // B if output else len(prompt) // B
        got.append(cache.request(chain_hashes(toks, B, n, hasher, "s"), len(prompt)))
    assert got == expected


def test_chain_hashes_are_the_block_hashes():
    toks = np.arange(50, dtype=np.int32)
    assert chain_hashes(toks, 16, 3).tolist() == hash_token_blocks(toks, 16)
