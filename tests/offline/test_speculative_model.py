"""The offline speculative-decoding model: vLLM's n-gram proposer semantics, greedy acceptance, suffix
decoding's counts and adaptive length, and the oracle bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvscope.harness.cachemodel.calibration import StepCostModel
from kvscope.harness.cachemodel.speculative import (
    NgramConfig,
    OracleConfig,
    RequestSpeculation,
    SuffixConfig,
    matches_live,
    ngram_first_ends,
    predicted_tpot_s,
    simulate,
    simulate_request,
    summarize,
)
from kvscope.workloads.trace import TraceBuilder


def vllm_ngram(tokens: np.ndarray, min_n: int, max_n: int, max_model_len: int, k: int) -> np.ndarray:
    """vLLM 0.32's `_find_longest_matched_ngram_and_propose_tokens`, transcribed line by line (without numba):
    the reference the vectorised model must equal."""
    total = tokens.shape[0]
    if total < min_n:
        return tokens[:0]
    k = min(k, max_model_len - total)
    if k <= 0:
        return tokens[:0]
    rev = tokens[::-1]
    lps = np.zeros(max_n, dtype=np.int32)
    longest, position, prev, i = 0, 0, 0, 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return tokens[:0]
    start = total - 1 - position + longest
    k = min(k, total - start)
    return tokens[start:start + k]


def reference_steps(prompt: np.ndarray, output: np.ndarray, cfg: NgramConfig, max_model_len: int):
    """Decode steps as vLLM runs them: propose on the context, schedule at most max_model_len - T - 1 drafts,
    accept the longest prefix equal to the output, emit accepted + 1."""
    drafted, accepted = [], []
    p = 1
    while p < len(output):
        ctx = np.concatenate([prompt, output[:p]])
        d = vllm_ngram(ctx, cfg.prompt_lookup_min, cfg.prompt_lookup_max, max_model_len, cfg.num_speculative_tokens)
        d = d[:max(0, max_model_len - len(ctx) - 1)]
        a = 0
        while a < len(d) and p + a < len(output) and d[a] == output[p + a]:
            a += 1
        drafted.append(len(d))
        accepted.append(a)
        p += a + 1
    return drafted, accepted


tokens_st = st.lists(st.integers(0, 4), min_size=1, max_size=60)  # a small alphabet: many repeats


@settings(max_examples=300, deadline=None)
@given(prompt=tokens_st, output=st.lists(st.integers(0, 4), min_size=1, max_size=40),
       k=st.integers(1, 6), lo=st.integers(1, 3), extra=st.integers(0, 3), mml=st.integers(20, 120))
def test_ngram_model_equals_vllms_proposer_step_by_step(prompt, output, k, lo, extra, mml):
    cfg = NgramConfig(k, lo, lo + extra)
    p, o = np.array(prompt, np.int64), np.array(output, np.int64)
    got = simulate_request(p, o, cfg, max_model_len=mml)
    want_d, want_a = reference_steps(p, o, cfg, mml)
    assert got.drafted.tolist() == want_d
    assert got.accepted.tolist() == want_a
    # every step emits accepted + 1 tokens, and the steps cover the output after the prefill's token
    assert int((got.accepted + 1).sum()) >= len(output) - 1


def test_earliest_occurrence_of_the_longest_match_is_used():
    # suffix [1, 2] occurs at 0 (followed by 7) and at 3 (followed by 8): vLLM takes the earliest
    ctx = np.array([1, 2, 7, 1, 2, 8, 1, 2])
    assert vllm_ngram(ctx, 2, 2, 100, 1).tolist() == [7]
    res = simulate_request(ctx[:-1], np.array([2, 7, 9]), NgramConfig(1, 2, 2))
    assert res.drafted.tolist() == [1] and res.accepted.tolist() == [1]


def test_first_occurrence_ends_are_exact():
    s = np.array([5, 6, 5, 6, 5, 7])
    f = ngram_first_ends(s, 3)
    assert f[1].tolist() == [0, 1, 0, 1, 0, 5]
    assert f[2].tolist() == [-1, 1, 2, 1, 2, 5]
    assert f[3].tolist() == [-1, -1, 2, 3, 2, 5]


def _trace(sessions: list[list[tuple[list[int], list[int]]]]):
    """Append-only sessions: each request's prompt is the previous prompt + answer + the new tokens."""
    b = TraceBuilder()
    t = 0.0
    for si, reqs in enumerate(sessions):
        ids: list[int] = []
        for step, (new, out) in enumerate(reqs):
            ids = ids + [b.add_segment(np.array(new, np.int32), "user")]
            oid = b.add_segment(np.array(out, np.int32), "assistant")
            b.add_request(session_id=f"s{si}", step=step, parent_request_id=-1, arrival_s=t, session_start_s=0.0,
                          prompt_segment_ids=list(ids), output_segment_id=oid, output_tokens=len(out),
                          transition="first" if step == 0 else "append")
            ids = ids + [oid]
            t += 1.0
    return b.build({"name": "t"})


def test_a_session_stream_gives_the_same_steps_as_each_request_alone():
    rng = np.random.default_rng(0)
    sessions = [[(rng.integers(0, 6, 30).tolist(), rng.integers(0, 6, 12).tolist()) for _ in range(4)]
                for _ in range(2)]
    trace = _trace(sessions)
    cfg = NgramConfig(3, 1, 3)
    res = simulate(trace, cfg, max_model_len=4096)
    assert len(res.requests) == trace.num_requests
    for r in res.requests:
        alone = simulate_request(trace.prompt_token_ids(r.request_id), trace.output_token_ids(r.request_id), cfg,
                                 max_model_len=4096)
        assert r.drafted.tolist() == alone.drafted.tolist()
        assert r.accepted.tolist() == alone.accepted.tolist()


def test_oracle_bounds_every_method():
    rng = np.random.default_rng(1)
    trace = _trace([[(rng.integers(0, 5, 40).tolist(), rng.integers(0, 5, 25).tolist()) for _ in range(3)]])
    oracle = simulate(trace, OracleConfig(4)).summary()
    for cfg in (NgramConfig(4, 1, 3), SuffixConfig(num_speculative_tokens=4)):
        s = simulate(trace, cfg).summary()
        assert s["decode_steps"] >= oracle["decode_steps"]
        assert s["tokens_per_step"] <= oracle["tokens_per_step"] + 1e-9
    assert oracle["acceptance_rate"] == 1.0


def test_suffix_follows_the_most_frequent_continuation_and_adapts_its_length():
    # the prompt holds "1 2 3" twice and "1 2 4" once: after "... 1 2" the draft is 3 (count 2 of 3, p=0.67)
    prompt = np.array([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1])
    res = simulate_request(prompt, np.array([2, 3, 9, 5]), SuffixConfig(num_speculative_tokens=8))
    # step at context "... 1 2": match length 2 (pattern "1 2") allows 2 tokens: 3, then 9
    assert res.drafted[0] >= 1
    assert res.accepted[0] >= 1
    # min_token_prob 0.7 refuses 3 (0.67 < 0.7) when only the long match is considered
    strict = simulate_request(prompt, np.array([2, 3, 9, 5]), SuffixConfig(num_speculative_tokens=8, min_token_prob=0.7))
    assert strict.accepted_tokens <= res.accepted_tokens


def test_suffix_global_tree_carries_answers_across_requests():
    ans = [7, 8, 9, 10, 11, 12, 13, 14]
    # two sessions whose prompts share nothing with the answer; the second answer repeats the first
    trace = _trace([[([1, 2, 3], [0] + ans)], [([4, 5, 6], [0] + ans)]])
    res = simulate(trace, SuffixConfig(num_speculative_tokens=4))
    first, second = res.requests
    assert second.accepted_tokens > first.accepted_tokens
    no_global = simulate(trace, SuffixConfig(num_speculative_tokens=4, max_cached_requests=0))
    assert no_global.requests[1].accepted_tokens == no_global.requests[0].accepted_tokens


def test_open_ended_last_step_matches_when_vllm_accepted_more():
    r = RequestSpeculation(0, "s", 10, 4, np.array([3], np.int32), np.array([3], np.int32), np.array([11]),
                           open_ended=True)
    assert matches_live(r, [3], [3])
    r2 = RequestSpeculation(0, "s", 10, 6, np.array([3, 3], np.int32), np.array([1, 2], np.int32),
                            np.array([11, 13]), open_ended=True)
    assert matches_live(r2, [3, 3], [1, 3])
    assert not matches_live(r2, [3, 3], [0, 3])
    assert not matches_live(r2, [3, 2], [1, 2])


def test_summary_and_predicted_tpot():
    r = RequestSpeculation(0, "s", 100, 9, np.array([2, 2, 0], np.int32), np.array([2, 1, 0], np.int32),
                           np.array([101, 104, 106]))
    s = summarize([r], 2)
    assert s["num_drafts"] == 2 and s["num_draft_tokens"] == 4 and s["num_accepted_tokens"] == 3
    assert s["accepted_per_position"] == [2, 1]
    assert s["mean_acceptance_length"] == pytest.approx(2.5)
    cost = StepCostModel(base_s=0.01, per_token_s=0.001, per_seq_s=0.0, per_context_token_s=1e-5)
    want = (3 * 0.01 + 0.001 * (3 + 3 + 1) + 1e-5 * (101 + 104 + 106)) / 8
    assert predicted_tpot_s(r, cost) == pytest.approx(want)


@pytest.mark.parametrize("distinct", [3, 3000])
def test_first_occurrence_ends_match_brute_force_packed_and_renumbered(distinct):
    # 3000 distinct tokens x 8-grams do not fit one int64: the pairwise re-numbered keys are used
    rng = np.random.default_rng(distinct)
    motif = rng.integers(0, distinct, 12)
    s = np.concatenate([rng.integers(0, distinct, 200), motif, rng.integers(0, distinct, 50), motif, motif[:7]])
    first = ngram_first_ends(s, 8, 2)
    seen: dict = {}
    for n in range(2, 9):
        seen.clear()
        for e in range(len(s)):
            if e < n - 1:
                assert first[n][e] == -1
                continue
            key = tuple(s[e - n + 1:e + 1].tolist())
            seen.setdefault(key, e)
            assert first[n][e] == seen[key]


def arctic_speculate(seqs: list[list[int]], context: list[int], max_spec: int, cfg: SuffixConfig):
    """Arctic Inference's `SuffixTree::speculate` (path mode) on an uncompressed depth-limited trie of
    substring counts, float32 as in its C++: the reference for the occurrence-list implementation."""
    depth = cfg.max_tree_depth
    counts: dict[tuple, int] = {}
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                key = tuple(s[i:i + n])
                counts[key] = counts.get(key, 0) + 1
    vocab = sorted({t for s in seqs for t in s})
    best, best_score = [], np.float32(0.0)
    for m in range(1, len(context)):
        cur = tuple(context[-m:])
        if counts.get(cur, 0) == 0:
            continue
        max_tokens = max(0, min(max_spec, int(m * cfg.max_spec_factor + cfg.max_spec_offset + 1e-6)))
        prob, score, toks = np.float32(1.0), np.float32(0.0), []
        while len(toks) < max_tokens and prob >= cfg.min_token_prob and len(cur) < depth:
            kids = [(counts.get(cur + (t,), 0), t) for t in vocab]
            c, t = max(kids, key=lambda x: (x[0], -x[1]))
            if c == 0:
                break
            prob = np.float32(prob * (np.float32(c) / np.float32(counts[cur])))
            if prob < cfg.min_token_prob:
                break
            toks.append(t)
            score = np.float32(score + prob)
            cur = cur + (t,)
        if score > best_score:
            best, best_score = toks, score
    return best, float(best_score)


def suffix_reference_steps(prompt: list[int], output: list[int], cfg: SuffixConfig):
    drafted, accepted = [], []
    p = 1
    while p < len(output):
        ctx = prompt + output[:p]
        pattern = ctx[-cfg.max_tree_depth:]
        local = arctic_speculate([ctx], pattern, cfg.num_speculative_tokens, cfg)
        glob = arctic_speculate([output[:p]], pattern, cfg.num_speculative_tokens, cfg)
        d = local[0] if local[1] >= glob[1] else glob[0]
        a = 0
        while a < len(d) and p + a < len(output) and d[a] == output[p + a]:
            a += 1
        drafted.append(len(d))
        accepted.append(a)
        p += a + 1
    return drafted, accepted


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=40), output=st.lists(st.integers(0, 3), min_size=1,
       max_size=25), k=st.integers(1, 8), depth=st.integers(2, 10), min_prob=st.sampled_from([0.0, 0.1, 0.3, 0.6]))
def test_suffix_model_equals_arctics_algorithm_step_by_step(prompt, output, k, depth, min_prob):
    cfg = SuffixConfig(num_speculative_tokens=k, max_tree_depth=depth, min_token_prob=min_prob)
    got = simulate_request(np.array(prompt), np.array(output), cfg)
    want_d, want_a = suffix_reference_steps(prompt, output, cfg)
    assert got.drafted.tolist() == want_d
    assert got.accepted.tolist() == want_a


def simulate_with_thresholds(trace, cfg: SuffixConfig, few: int, split: int, timeline: int):
    """``simulate`` with the suffix kernel's speed thresholds forced (they never change a result)."""
    from kvscope.harness.cachemodel import speculative

    saved = speculative._LIST_AT_MOST, speculative._SPLIT_ABOVE, speculative._TIMELINE_AT
    speculative._LIST_AT_MOST, speculative._SPLIT_ABOVE, speculative._TIMELINE_AT = few, split, timeline
    try:
        return simulate(trace, cfg)
    finally:
        speculative._LIST_AT_MOST, speculative._SPLIT_ABOVE, speculative._TIMELINE_AT = saved


def suffix_reference_trace(sessions: list[list[tuple[list[int], list[int]]]], cfg: SuffixConfig):
    """Every request of an append-only trace (built by `_trace`, in arrival order) as vLLM + Arctic run them
    one at a time: the request's own tree over prompt + answer so far, the global tree over the answers of
    the last ``max_cached_requests - 1`` earlier requests plus this answer so far."""
    answers: list[list[int]] = []
    steps = []
    for reqs in sessions:
        prompt: list[int] = []
        for new, output in reqs:
            prompt = prompt + new
            drafted, accepted = [], []
            keep = cfg.max_cached_requests - 1
            earlier = answers[len(answers) - keep:] if keep > 0 else []
            p = 1
            while p < len(output):
                ctx = prompt + output[:p]
                pattern = ctx[-cfg.max_tree_depth:]
                local = arctic_speculate([ctx], pattern, cfg.num_speculative_tokens, cfg)
                glob = (arctic_speculate(earlier + [output[:p]], pattern, cfg.num_speculative_tokens, cfg)
                        if cfg.max_cached_requests != 0 else ([], 0.0))
                d = local[0] if local[1] >= glob[1] else glob[0]
                a = 0
                while a < len(d) and p + a < len(output) and d[a] == output[p + a]:
                    a += 1
                drafted.append(len(d))
                accepted.append(a)
                p += a + 1
            steps.append((drafted, accepted))
            answers.append(output)
            prompt = prompt + output
    return steps


_motif_tokens = st.lists(st.integers(0, 3), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(sessions=st.lists(st.lists(st.tuples(_motif_tokens, _motif_tokens), min_size=1, max_size=3),
                         min_size=1, max_size=3),
       k=st.integers(1, 8), depth=st.integers(2, 9), min_prob=st.sampled_from([0.0, 0.1, 0.4]),
       cached=st.sampled_from([0, 1, 2, 10000]), factor=st.sampled_from([1.0, 2.0]),
       few=st.sampled_from([1, 16]), split=st.sampled_from([0, 1024]), timeline=st.sampled_from([1, 8]))
def test_suffix_trace_equals_arctics_algorithm_across_requests_and_sessions(sessions, k, depth, min_prob,
                                                                            cached, factor, few, split, timeline):
    """Repeats within a request, across the requests of a session (the prompt holds earlier answers) and
    across sessions (the global tree, with FIFO eviction).  ``few`` 1 makes every match and path with two or
    more occurrences take the tree nodes (binary searches, continuation timelines) that the common tokens of a
    full-size trace take, ``split`` 0 makes every node split into all its children at once, and ``timeline`` 1
    makes every most-frequent-child query go through a continuation timeline."""
    cfg = SuffixConfig(num_speculative_tokens=k, max_tree_depth=depth, min_token_prob=min_prob,
                       max_cached_requests=cached, max_spec_factor=factor)
    res = simulate_with_thresholds(_trace(sessions), cfg, few, split, timeline)
    want = suffix_reference_trace(sessions, cfg)
    assert len(res.requests) == len(want)
    for got, (want_d, want_a) in zip(res.requests, want):
        assert got.drafted.tolist() == want_d
        assert got.accepted.tolist() == want_a
