"""The one common-prefix helper and transition rule: lists, arrays and mixed inputs agree with a plain scan."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvscope.workloads.arrivals import arrival_offsets_s
from kvscope.workloads.prefix import classify_transition, common_prefix_len, transition_from

ids = st.lists(st.integers(0, 3), max_size=40)


def _scan(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@given(ids, ids)
def test_common_prefix_len_matches_a_plain_scan_for_lists_and_arrays(a, b):
    want = _scan(a, b)
    assert common_prefix_len(a, b) == want
    assert common_prefix_len(np.asarray(a, np.int32), np.asarray(b, np.int32)) == want
    assert common_prefix_len(np.asarray(a, np.int64), b) == want


def test_transition_rule_for_tokens_and_blocks():
    parent = [1, 2, 3, 4]
    assert transition_from(None, parent) == "first"
    assert transition_from(parent, parent + [5]) == "append"
    assert transition_from(parent, [1, 2, 9, 9, 9]) == "edit"
    assert transition_from(parent, [1, 9, 9, 9, 9]) == "reset"
    # block ids: a re-rendered last block still counts as an append
    assert transition_from(np.array(parent), np.array([1, 2, 3, 7, 8]), append_slack=1) == "append"
    assert transition_from(np.array(parent), np.array([1, 2, 3, 7, 8])) == "edit"
    assert classify_transition(4, 4, hint="compaction") == "compaction"


def test_arrival_offsets_start_at_zero_and_keep_the_mean_rate():
    for process, cv in (("poisson", 1.0), ("gamma", 3.0)):
        t = arrival_offsets_s(np.random.default_rng(1), 20_000, 4.0, process, cv)
        assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
        assert abs(np.diff(t).mean() - 0.25) < 0.02
    bursty = np.diff(arrival_offsets_s(np.random.default_rng(1), 20_000, 4.0, "gamma", 3.0))
    assert bursty.std() / bursty.mean() > 2.0


@given(st.lists(st.integers(0, 50), unique=True, max_size=30), st.integers(0, 30), st.sets(st.integers(0, 50)))
def test_leading_run_scan_and_chained_search_agree_on_prefix_closed_sets(keys, k, extra):
    from kvscope.workloads.prefix import leading_run

    present = set(keys[:k])
    assert leading_run(keys, present) == leading_run(keys, present, chained=True) == min(k, len(keys))
    # a pool that evicted an inner block: the scan stops at the first miss
    holes = (present | extra) - ({keys[0]} if keys else set())
    assert leading_run(keys, holes) == 0
