"""One goodput rule for summary.json and the report's table."""

from __future__ import annotations

import math

import pandas as pd

from kvscope.harness.results.goodput import goodput, meets_slo


def test_goodput_counts_requests_meeting_every_objective():
    ok = pd.DataFrame({"ttft_s": [0.1, 0.3, 0.1, 0.1], "tpot_s": [0.01, 0.01, 0.09, math.nan]})
    assert meets_slo(ok, 200, None).tolist() == [True, False, True, True]
    assert meets_slo(ok, 200, 50).tolist() == [True, False, False, True]  # no TPOT (one token) meets it
    g = goodput(ok, 2.0, 200, 50)
    assert g == {"slo_ttft_ms": 200, "slo_tpot_ms": 50, "requests_meeting_slo": 2, "fraction": 0.5,
                 "goodput_req_per_s": 1.0}
    assert goodput(ok, 2.0, None, None) is None
    assert goodput(ok.iloc[:0], 0.0, 200, None)["fraction"] is None
