"""Goodput: requests that meet the latency objectives, the one rule behind ``summary.json``'s ``goodput``
block (written by the replay) and the report's per-cell goodput table (recomputed for any SLO).

It lives with the result files because both its users read request records: the replay while summarising,
the analysis from files (which must not import replay internals). A request meets the SLO when its TTFT is
within ``slo_ttft_ms`` and its TPOT within ``slo_tpot_ms``; a request with one output token has no TPOT and
meets a TPOT objective by definition.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def meets_slo(ok: pd.DataFrame, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> np.ndarray:
    """Per successful request (columns ``ttft_s``, ``tpot_s``): does it meet every objective given?"""
    meets = np.ones(len(ok), dtype=bool)
    if slo_ttft_ms is not None:
        meets &= ok["ttft_s"].to_numpy(float) * 1000 <= slo_ttft_ms
    if slo_tpot_ms is not None:
        tpot = ok["tpot_s"].to_numpy(float)
        meets &= np.where(np.isnan(tpot), True, tpot * 1000 <= slo_tpot_ms)
    return meets


def goodput(ok: pd.DataFrame, duration_s: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None
            ) -> dict[str, Any] | None:
    """The ``goodput`` block: requests meeting the SLOs, their share and their rate (None without SLOs)."""
    if slo_ttft_ms is None and slo_tpot_ms is None:
        return None
    n = int(meets_slo(ok, slo_ttft_ms, slo_tpot_ms).sum())
    return {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "requests_meeting_slo": n,
            "fraction": n / len(ok) if len(ok) else None,
            "goodput_req_per_s": n / duration_s if duration_s else None}
