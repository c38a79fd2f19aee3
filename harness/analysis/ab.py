"""A/B comparison of two configurations (or two runs) on identical traffic, with bootstrap intervals.

Requests are paired by trace request id (the same prompt was sent in both runs), so per-request noise that
comes from the prompt itself cancels. For each metric the statistic (p50/p90/p99 of a latency, token-
weighted hit rate, cost) is computed on B paired resamples; the 95 % interval of the difference B − A
decides the verdict: better, worse, or no significant difference. Throughput is a per-run quantity: its
interval comes from resampling fixed time windows of each run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

LOWER_IS_BETTER = {"ttft", "tpot", "e2e", "itl", "cost"}


@dataclass(frozen=True)
class Comparison:
    metric: str
    a: float
    b: float
    diff: float
    ci_low: float
    ci_high: float
    relative: float
    verdict: str

    def as_dict(self) -> dict:
        return self.__dict__.copy()


#: Differences smaller than this are reported as "no significant difference" even when the interval excludes
#: zero: relative to A for latency, throughput and cost (run-to-run noise of a shared machine), absolute for
#: the hit rate (a fraction).
MIN_EFFECT = {"relative": 0.05, "hit_rate": 0.005}


def _verdict(metric: str, lo: float, hi: float, diff: float = math.nan, a: float = math.nan) -> str:
    if math.isnan(lo) or math.isnan(hi) or (lo <= 0 <= hi):
        return "no significant difference"
    if not math.isnan(diff):
        floor = MIN_EFFECT["hit_rate"] if metric == "hit_rate" else MIN_EFFECT["relative"] * abs(a)
        if abs(diff) < floor:
            return "no significant difference"
    lower_better = metric.split("_")[0] in LOWER_IS_BETTER
    b_smaller = hi < 0
    return "better" if b_smaller == lower_better else "worse"


def pair_requests(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Successful requests present in both runs, joined on (request_id, attempt 0)."""
    keep = ["request_id", "ttft_s", "tpot_s", "e2e_s", "prompt_tokens", "cached_tokens", "output_tokens"]

    def prep(df: pd.DataFrame) -> pd.DataFrame:
        ok = df[df["error_class"].isna() & (df["attempt"] == 0)]
        if "in_window" in ok:
            ok = ok[ok["in_window"].astype(bool)]
        return ok[keep]

    return prep(a).merge(prep(b), on="request_id", suffixes=("_a", "_b"))


def _resample_indices(n: int, resamples: int, rng: np.random.Generator, chunk: int = 256):
    """Bootstrap index matrices in chunks (bounded memory for large runs), the same draws for every metric."""
    done = 0
    while done < resamples:
        k = min(chunk, resamples - done)
        yield rng.integers(0, n, size=(k, n))
        done += k


def compare_paired(paired: pd.DataFrame, resamples: int = 2000, seed: int = 0,
                   cost_per_uncached_token: float = 1.0, cost_per_cached_token: float = 0.1) -> list[Comparison]:
    """Paired bootstrap of B − A for latency percentiles, hit rate and prefill cost (vectorised over draws)."""
    rng = np.random.default_rng(seed)
    n = len(paired)
    out: list[Comparison] = []
    if n < 2:
        return out
    # Requests without a metric (e.g. TPOT of one-token answers) are left out of that metric's pairs.
    lat = {}
    for m in ("ttft", "tpot", "e2e"):
        xa, xb = paired[f"{m}_s_a"].to_numpy(float), paired[f"{m}_s_b"].to_numpy(float)
        keep = ~(np.isnan(xa) | np.isnan(xb))
        if keep.sum() >= 2:
            lat[m] = (xa[keep], xb[keep])
    pa, pb = paired["prompt_tokens_a"].to_numpy(float), paired["prompt_tokens_b"].to_numpy(float)
    ca, cb = paired["cached_tokens_a"].fillna(0).to_numpy(float), paired["cached_tokens_b"].fillna(0).to_numpy(float)
    cost_a = (pa - ca) * cost_per_uncached_token + ca * cost_per_cached_token
    cost_b = (pb - cb) * cost_per_uncached_token + cb * cost_per_cached_token
    qs = (50, 90, 99)
    boots: dict[str, list[np.ndarray]] = {f"{m}_p{q}_s": [] for m in lat for q in qs}
    boots["hit_rate"], boots["cost"] = [], []
    for idx in _resample_indices(n, resamples, rng):
        boots["hit_rate"].append(cb[idx].sum(1) / pb[idx].sum(1) - ca[idx].sum(1) / pa[idx].sum(1))
        boots["cost"].append(cost_b[idx].mean(1) - cost_a[idx].mean(1))
    for m, (xa, xb) in lat.items():
        for idx in _resample_indices(len(xa), resamples, rng):
            da = np.percentile(xa[idx], qs, axis=1)
            db = np.percentile(xb[idx], qs, axis=1)
            for j, q in enumerate(qs):
                boots[f"{m}_p{q}_s"].append(db[j] - da[j])
    for m, (xa_v, xb_v) in lat.items():
        for q in qs:
            name = f"{m}_p{q}_s"
            a_v, b_v = float(np.percentile(xa_v, q)), float(np.percentile(xb_v, q))
            lo, hi = np.percentile(np.concatenate(boots[name]), [2.5, 97.5])
            out.append(Comparison(name, a_v, b_v, b_v - a_v, float(lo), float(hi),
                                  (b_v - a_v) / a_v if a_v else math.nan, _verdict(name, lo, hi, b_v - a_v, a_v)))
    a_v, b_v = float(ca.sum() / pa.sum()), float(cb.sum() / pb.sum())
    lo, hi = np.percentile(np.concatenate(boots["hit_rate"]), [2.5, 97.5])
    out.append(Comparison("hit_rate", a_v, b_v, b_v - a_v, float(lo), float(hi),
                          (b_v - a_v) / a_v if a_v else math.nan, _verdict("hit_rate", lo, hi, b_v - a_v, a_v)))
    a_v, b_v = float(cost_a.mean()), float(cost_b.mean())
    lo, hi = np.percentile(np.concatenate(boots["cost"]), [2.5, 97.5])
    out.append(Comparison("cost_prefill_units_per_request", a_v, b_v, b_v - a_v, float(lo), float(hi),
                          (b_v - a_v) / a_v if a_v else math.nan, _verdict("cost", lo, hi, b_v - a_v, a_v)))
    return out


def throughput_comparison(a: pd.DataFrame, b: pd.DataFrame, windows: int = 10, resamples: int = 2000,
                          seed: int = 0) -> Comparison | None:
    """Output tokens/s, with an interval from resampling equal time windows of each run independently."""
    rng = np.random.default_rng(seed)

    def per_window(df: pd.DataFrame) -> np.ndarray | None:
        ok = df[df["error_class"].isna()]
        if len(ok) < windows or ok["done_s"].isna().all():
            return None
        t0, t1 = float(ok["sent_s"].min()), float(ok["done_s"].max())
        if t1 <= t0:
            return None
        edges = np.linspace(t0, t1, windows + 1)
        counts, _ = np.histogram(ok["done_s"].to_numpy(float), bins=edges, weights=ok["output_tokens"].to_numpy(float))
        return counts / np.diff(edges)

    wa, wb = per_window(a), per_window(b)
    if wa is None or wb is None:
        return None
    ia = rng.integers(0, windows, size=(resamples, windows))
    ib = rng.integers(0, windows, size=(resamples, windows))
    boots = wb[ib].mean(axis=1) - wa[ia].mean(axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    a_v, b_v = float(wa.mean()), float(wb.mean())
    return Comparison("throughput_output_tok_per_s", a_v, b_v, b_v - a_v, float(lo), float(hi),
                      (b_v - a_v) / a_v if a_v else math.nan, _verdict("throughput", lo, hi, b_v - a_v, a_v))


def compare_runs(a: pd.DataFrame, b: pd.DataFrame, resamples: int = 2000, seed: int = 0) -> pd.DataFrame:
    """The verdict table: one row per metric, B relative to A."""
    rows = [c.as_dict() for c in compare_paired(pair_requests(a, b), resamples, seed)]
    t = throughput_comparison(a, b, resamples=resamples, seed=seed)
    if t is not None:
        rows.append(t.as_dict())
    return pd.DataFrame(rows, columns=["metric", "a", "b", "diff", "ci_low", "ci_high", "relative", "verdict"])
