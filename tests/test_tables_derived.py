"""The per-results memo behind the cost tables: computed once per (results object, key), never shared between
two results objects (even when one is freed and the next gets its id)."""

from __future__ import annotations

import gc

from kvscope.harness.analysis import common


class _Results:  # stands in for ExperimentResults: any object that can be weakly referenced
    pass


def test_a_value_is_computed_once_per_results_object_and_key():
    calls: list[str] = []
    res = _Results()
    for _ in range(3):
        assert common._derived(res, ("a",), lambda: calls.append("a") or 1) == 1
    assert common._derived(res, ("b",), lambda: calls.append("b") or 2) == 2
    assert calls == ["a", "b"]


def test_a_new_results_object_never_sees_the_values_of_a_freed_one():
    seen_ids = set()
    reused = 0
    for i in range(50):  # CPython reuses freed ids quickly: some of these get a previous object's id
        res = _Results()
        reused += id(res) in seen_ids
        seen_ids.add(id(res))
        assert common._derived(res, ("value",), lambda: i) == i
        del res  # no reference cycle: freed here by reference counting (a gc.collect() per object cost 19 s
        # in a full test session, whose heap is large)
    assert reused > 0  # the case under test happened
    gc.collect()
    assert not any(ref() is None for ref, _ in common._DERIVED.values())  # freed objects' entries are dropped
