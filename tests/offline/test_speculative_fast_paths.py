"""The fast paths of `kvscope speculate` against simple references on random token sequences, per method, over
whole traces (append-only sessions become one indexed stream per chain; suffix decoding runs in a compiled
kernel with a global tree across requests): n-gram against vLLM's proposer transcribed, suffix against a plain
trie of Arctic's algorithm with the kernel's thresholds forced each way, the oracle against its definition."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kvscope.harness.cachemodel.speculative import NgramConfig, OracleConfig, SuffixConfig, simulate

from tests.offline.test_speculative_model import (_trace, reference_steps, simulate_with_thresholds,
                                                  suffix_reference_trace)

_tokens = st.lists(st.integers(0, 3), min_size=1, max_size=16)  # a small alphabet: many repeats
_sessions = st.lists(st.lists(st.tuples(_tokens, _tokens), min_size=1, max_size=3), min_size=1, max_size=3)


def _requests_in_order(sessions: list[list[tuple[list[int], list[int]]]]) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) of every request of `_trace(sessions)`, in its request order."""
    out = []
    for reqs in sessions:
        prompt: list[int] = []
        for new, output in reqs:
            prompt = prompt + new
            out.append((prompt, output))
            prompt = prompt + output
    return out


@settings(max_examples=100, deadline=None)
@given(sessions=_sessions, k=st.integers(1, 6), lo=st.integers(1, 3), extra=st.integers(0, 2),
       mml=st.sampled_from([30, 60, 4096]))
def test_ngram_over_session_streams_equals_vllms_proposer_per_request(sessions, k, lo, extra, mml):
    cfg = NgramConfig(k, lo, lo + extra)
    res = simulate(_trace(sessions), cfg, max_model_len=mml)
    for got, (prompt, output) in zip(res.requests, _requests_in_order(sessions), strict=True):
        want_d, want_a = reference_steps(np.array(prompt, np.int64), np.array(output, np.int64), cfg, mml)
        assert got.drafted.tolist() == want_d
        assert got.accepted.tolist() == want_a


@settings(max_examples=100, deadline=None)
@given(sessions=_sessions, k=st.integers(1, 30), depth=st.integers(2, 24),
       min_prob=st.sampled_from([0.0, 0.1, 0.5]), cached=st.sampled_from([1, 3, 10000]),
       few=st.sampled_from([1, 2, 256]), split=st.sampled_from([0, 2, 1024]), timeline=st.sampled_from([0, 2, 1024]))
def test_suffix_kernel_equals_arctics_algorithm_with_every_threshold(sessions, k, depth, min_prob, cached, few,
                                                                     split, timeline):
    """The kernel's thresholds choose between direct tallies and tree nodes, per-token narrowing and grouped
    splits, tallies and continuation timelines: every combination gives Arctic's drafts."""
    cfg = SuffixConfig(num_speculative_tokens=k, max_tree_depth=depth, min_token_prob=min_prob,
                       max_cached_requests=cached)
    res = simulate_with_thresholds(_trace(sessions), cfg, few, split, timeline)
    want = suffix_reference_trace(sessions, cfg)
    assert [(r.drafted.tolist(), r.accepted.tolist()) for r in res.requests] == want


@settings(max_examples=100, deadline=None)
@given(sessions=_sessions, k=st.integers(1, 6), mml=st.sampled_from([None, 20, 40]))
def test_oracle_drafts_the_next_k_tokens_up_to_the_answers_end(sessions, k, mml):
    res = simulate(_trace(sessions), OracleConfig(k), max_model_len=mml)
    for got, (prompt, output) in zip(res.requests, _requests_in_order(sessions), strict=True):
        drafted, contexts = [], []
        p = 1
        while p < len(output):
            d = min(k, len(output) - p)
            if mml is not None:
                d = max(0, min(d, mml - (len(prompt) + p) - 1))
            drafted.append(d)
            contexts.append(len(prompt) + p)
            p += d + 1
        assert got.drafted.tolist() == drafted
        assert got.accepted.tolist() == drafted
        assert got.context_tokens.tolist() == contexts
