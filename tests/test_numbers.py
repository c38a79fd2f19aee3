"""The one rule for a missing number (`harness/common/numbers.py`): every NaN a result file or finding may meet
becomes None, numbers and non-numbers pass unchanged, and the cast gives plain Python numbers."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from kvscope.harness.common.numbers import nan_to_none


@pytest.mark.parametrize("missing", [None, math.nan, np.float32("nan"), np.float64("nan"), pd.NA, pd.NaT])
def test_every_kind_of_missing_number_becomes_none(missing):
    assert nan_to_none(missing) is None
    assert nan_to_none(missing, float) is None  # the cast is not applied to a missing value


@pytest.mark.parametrize("value", [0, 0.0, -1.5, math.inf, "text", np.int64(7)])
def test_a_present_value_is_returned_unchanged(value):
    assert nan_to_none(value) is value


def test_infinite_counts_as_missing_only_when_asked():
    assert nan_to_none(-math.inf, infinite=True) is None and nan_to_none(math.inf) == math.inf
    assert nan_to_none("x", infinite=True) == "x" and nan_to_none(3, infinite=True) == 3


def test_the_cast_gives_json_serialisable_python_numbers():
    got = [nan_to_none(np.int64(3), int), nan_to_none(np.float32(0.5), float), nan_to_none(pd.NA, int)]
    assert got == [3, 0.5, None] and type(got[0]) is int and type(got[1]) is float
    assert json.dumps(got) == "[3, 0.5, null]"
    col = pd.Series([1, None, 3], dtype="Int64")  # a nullable column yields pd.NA for its gap
    assert [nan_to_none(x, int) for x in col] == [1, None, 3]
