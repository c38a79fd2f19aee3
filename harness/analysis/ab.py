"""A/B verdicts from a hierarchical bootstrap over repeats and sessions.

Why this structure. A request is not the unit of independence: one run (a repeat) carries a run factor (machine
state, the server's warm-up, what else the host was doing) shared by every request in it, and the requests of one
session share its context and its scheduling. Resampling requests treats both as signal, so two runs of one
configuration read as "different" most of the time. Here each bootstrap draw resamples the *runs* of each side
(R of R with replacement), then the *sessions* inside every drawn run (all requests of a session stay together),
and computes the statistic (a pooled percentile, the token-weighted hit rate, mean prefill cost, the mean per-run
output throughput) on the weighted draw. Where A and B replayed identical traffic (the same trace sha256, the
same sessions) the draws are paired: run slot j and the session draw of slot j are the same on both sides, so
what a prompt costs cancels in B − A and drift spreads over both arms of interleaved repeats.

A draw is a weight per (run, session) unit, so the whole thing is matrix work: weights (draws x units) come from
one `bincount`; each latency column is sorted once per side; a weighted percentile sums the draws' weights per
block of 64 sorted values and cumulates value by value only inside the block that holds it (numpy's cumulative
sum is not vectorised: a full one per draw was most of the A/B page's time). Draws are processed in chunks sized
to the number of records, so memory stays bounded at 100k records. The matrices are small, so a multi-threaded
BLAS only adds synchronisation (70x the CPU of one thread on a busy 2-core machine): the report runs its
kernels with one BLAS thread (:mod:`kvscope.harness.report.render`).

Words. With margin m (5 % of A, 0.5 percentage points for the hit rate): *better* / *worse* when the interval
of B − A lies beyond ±m on one side, *equivalent* when it lies inside ±m, *inconclusive* otherwise. The tests
behind the words are bootstrap p-values ("beyond the margin" and two one-sided "inside the margin"), adjusted
with Benjamini–Hochberg across the metrics of one comparison, so a reported 95 % interval can exclude the
margin while the verdict stays inconclusive. With one run on a side, run-to-run noise is not measured: latency
and throughput verdicts are *inconclusive* unless a relative run-to-run noise is given (`run_noise`, e.g. from
`estimate_run_noise` on repeats of one configuration). A hit-rate (and prefill-cost) difference between a side
with prefix caching off and one with it on is true by construction and marked `by_construction`.

Throughput is a per-run quantity (each run's output tokens/s, from its summary); its draws resample runs only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

#: Percentiles compared per latency family (p99 of TPOT and e2e adds little but a multiple-comparison cost).
QUANTILES = {"ttft": (50, 90, 99), "tpot": (50, 90), "e2e": (50, 90)}
LATENCY_METRICS = tuple(QUANTILES)
THROUGHPUT_METRIC = "output_tokens_per_s"
HIT_RATE_METRIC = "hit_rate"
COST_METRIC = "cost_prefill_units_per_request"
HIGHER_IS_BETTER = {THROUGHPUT_METRIC, HIT_RATE_METRIC}
#: Practical margin: differences inside it are not worth a verdict (relative to A; absolute for the hit rate).
MARGIN_RELATIVE = 0.05
MARGIN_HIT_RATE = 0.005
ALPHA = 0.05
TABLE_COLUMNS = ["metric", "a", "b", "diff", "ci_low", "ci_high", "relative", "margin", "p_value", "p_adjusted",
                 "verdict", "runs_a", "runs_b", "paired"]


@dataclass(frozen=True)
class Run:
    """One replay run (a repeat of a cell): its request records and its per-run facts."""

    name: str
    records: pd.DataFrame
    output_tokens_per_s: float | None = None  # from summary.json; None: computed from the records
    prefix_caching: bool | None = None
    trace_sha256: str | None = None


@dataclass
class _Side:
    """The records of one side as arrays: every request's (run, session) unit, and per-run throughput."""

    runs: int
    sessions_per_run: np.ndarray  # (R,)
    unit_offset: np.ndarray  # (R,) first unit index of each run
    unit_of_request: np.ndarray  # (n,)
    columns: dict[str, np.ndarray]
    throughput: np.ndarray  # (R,) output tokens/s per run
    prefix_caching: set = field(default_factory=set)
    #: per latency family with 2+ values: its values sorted (NaN left out) and the unit of each, sorted once
    sorted_latency: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for m in LATENCY_METRICS:
            x = self.columns[f"{m}_s"]
            keep = ~np.isnan(x)
            if keep.sum() >= 2:
                order = np.argsort(x[keep], kind="stable")
                self.sorted_latency[m] = (x[keep][order], self.unit_of_request[keep][order])

    @property
    def units(self) -> int:
        return int(self.sessions_per_run.sum())


# ---- input ---------------------------------------------------------------------------------------------------
def _ok_records(df: pd.DataFrame) -> pd.DataFrame:
    if not len(df):
        return df
    ok = df[df["error_class"].isna() & (df["attempt"] == 0)] if "attempt" in df else df[df["error_class"].isna()]
    if "in_window" in ok:
        ok = ok[ok["in_window"].astype(bool)]
    return ok


def records_throughput(df: pd.DataFrame) -> float | None:
    """Output tokens/s of one run from its records: tokens over first send to last completion."""
    ok = _ok_records(df)
    if not len(ok) or ok["done_s"].isna().all():
        return None
    span = float(ok["done_s"].max()) - float(df["sent_s"].min())
    return float(ok["output_tokens"].sum()) / span if span > 0 else None


def split_runs(df: pd.DataFrame, name: str = "run") -> list[Run]:
    """Records of several cells (a `cell` column, as `load_results` gives) as one Run per cell."""
    if "cell" not in df or df["cell"].nunique() <= 1:
        return [Run(name, df)]
    return [Run(str(c), g) for c, g in df.groupby("cell", sort=False)]


def _session_ids(run: Run) -> list[str]:
    return sorted(map(str, pd.unique(_ok_records(run.records)["session_id"])))


def traffic_is_identical(a_runs: Sequence[Run], b_runs: Sequence[Run]) -> bool:
    """Paired when every run replayed the same trace (sha256, where known) with the same sessions."""
    runs = [*a_runs, *b_runs]
    shas = {r.trace_sha256 for r in runs}
    if len(shas) > 1:
        return False
    first = _session_ids(runs[0])
    return bool(first) and all(_session_ids(r) == first for r in runs[1:])


def _side(runs: Sequence[Run], paired_sessions: list[str] | None) -> _Side:
    frames, sessions_per_run, offsets, tput, off = [], [], [], [], 0
    for run in runs:
        ok = _ok_records(run.records)
        if not len(ok):
            from kvscope.harness.common.errors import KvscopeError

            raise KvscopeError(f"{run.name}: no successful requests inside the window to compare")
        sessions = paired_sessions or sorted(map(str, pd.unique(ok["session_id"])))
        local = pd.Categorical(ok["session_id"].astype(str), categories=sessions).codes
        frames.append(ok.assign(_unit=off + local))
        sessions_per_run.append(len(sessions))
        offsets.append(off)
        off += len(sessions)
        t = run.output_tokens_per_s if run.output_tokens_per_s is not None else records_throughput(run.records)
        tput.append(np.nan if t is None else float(t))
    allr = pd.concat(frames, ignore_index=True)
    cols = {f"{m}_s": allr[f"{m}_s"].to_numpy(float) for m in LATENCY_METRICS}
    cols["prompt_tokens"] = allr["prompt_tokens"].to_numpy(float)
    cols["cached_tokens"] = allr["cached_tokens"].fillna(0).to_numpy(float)
    return _Side(len(runs), np.asarray(sessions_per_run), np.asarray(offsets), allr["_unit"].to_numpy(np.int64),
                 cols, np.asarray(tput), {r.prefix_caching for r in runs})


# ---- resampling ----------------------------------------------------------------------------------------------
@dataclass
class _Draws:
    """One chunk of draws: chosen run per slot (k, R_max) and the uniform session draws (k, R_max, S_max)."""

    run_choice_a: np.ndarray
    run_choice_b: np.ndarray
    uniforms_a: np.ndarray
    uniforms_b: np.ndarray


def _draw_chunks(a: _Side, b: _Side, paired: bool, resamples: int, chunk: int, rng: np.random.Generator):
    s_max = int(max(a.sessions_per_run.max(), b.sessions_per_run.max()))
    r_max = max(a.runs, b.runs)
    done = 0
    while done < resamples:
        k = min(chunk, resamples - done)
        ia = rng.integers(0, a.runs, size=(k, a.runs))
        ua = rng.random((k, r_max, s_max))
        if paired:
            ib = ia if a.runs == b.runs else rng.integers(0, b.runs, size=(k, b.runs))
            ub = ua
        else:
            ib, ub = rng.integers(0, b.runs, size=(k, b.runs)), rng.random((k, r_max, s_max))
        yield _Draws(ia, ib, ua, ub)
        done += k


def _unit_weights(side: _Side, run_choice: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Weights (k, units): how often each (run, session) unit appears in each draw."""
    k, slots = run_choice.shape
    s_max = uniforms.shape[2]
    n_sess = side.sessions_per_run[run_choice]  # (k, slots)
    local = np.floor(uniforms[:, :slots, :] * n_sess[:, :, None]).astype(np.int64)
    keep = np.arange(s_max)[None, None, :] < n_sess[:, :, None]
    unit = side.unit_offset[run_choice][:, :, None] + local
    flat = (np.arange(k)[:, None, None] * side.units + unit)[keep]
    return np.bincount(flat, minlength=k * side.units).reshape(k, side.units).astype(np.int32)


#: Sorted values per block of the two-level percentile search: the draws' cumulative weights are summed per block
#: of this many values, and only inside the block that holds a percentile cumulated value by value.
PERCENTILE_BLOCK = 64


def _weighted_percentiles(sorted_values: np.ndarray, weights: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Inverted-CDF percentiles (the smallest value whose weighted CDF reaches q) per draw: (len(qs), k).

    ``weights`` is (n, k): the weight of each sorted value in each of k draws (value-major, so a block of values
    is contiguous). Two levels instead of one cumulative sum over all n values per draw: weights are summed per
    block of :data:`PERCENTILE_BLOCK` values (a vectorised reduction), the block holding each percentile is found
    on the block sums, and the values are cumulated only inside that block. Same answer as a full cumulative
    sum and a ``searchsorted`` (tests check it), a fraction of the work: numpy's cumulative sum is not vectorised.
    Integer weights (resample counts) keep the sums exact."""
    n, k = weights.shape
    block = PERCENTILE_BLOCK
    blocks = -(-n // block)
    padded = np.zeros((blocks * block, k), dtype=weights.dtype)
    padded[:n] = weights
    cum_blocks = np.cumsum(padded.reshape(blocks, block, k).sum(axis=1, dtype=np.int64 if padded.dtype.kind in 'iu' else None), axis=0)  # (blocks, k)
    total = cum_blocks[-1].astype(np.float64)
    # the smallest position whose cumulative weight reaches q * total (ceil: weights are integers)
    targets = np.ceil(np.asarray(qs, float)[:, None] / 100.0 * total[None, :] - 1e-9 * np.maximum(total, 1.0)[None, :])
    in_block = np.minimum((cum_blocks[None, :, :] < targets[:, None, :]).sum(axis=1), blocks - 1)  # (Q, k)
    draws = np.arange(k)
    before = np.where(in_block > 0, cum_blocks[np.maximum(in_block - 1, 0), draws[None, :]], 0)
    first = in_block * block  # (Q, k)
    inside = padded[first[:, :, None] + np.arange(block)[None, None, :], draws[None, :, None]]  # (Q, k, block)
    reached = before[:, :, None] + np.cumsum(inside, axis=2) < targets[:, :, None]
    pos = first + reached.sum(axis=2)
    return sorted_values[np.clip(pos, 0, n - 1)]


# ---- statistics per draw -------------------------------------------------------------------------------------
def _latency_draws(side: _Side, w_units: np.ndarray) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    by_unit = np.ascontiguousarray(w_units.T)  # (units, k): one row gather per sorted value below
    for m, (vals, units) in side.sorted_latency.items():
        per_q = _weighted_percentiles(vals, by_unit[units], QUANTILES[m])
        for j, q in enumerate(QUANTILES[m]):
            out[f"{m}_p{q}_s"] = per_q[j]
    return out


def _unit_sums(side: _Side, values: np.ndarray) -> np.ndarray:
    return np.bincount(side.unit_of_request, weights=values, minlength=side.units)


def _cache_draws(side: _Side, w_units: np.ndarray, cost_uncached: float, cost_cached: float) -> dict[str, np.ndarray]:
    prompt, cached = side.columns["prompt_tokens"], side.columns["cached_tokens"]
    p_u, c_u = _unit_sums(side, prompt), _unit_sums(side, cached)
    cost_u = _unit_sums(side, (prompt - cached) * cost_uncached + cached * cost_cached)
    n_u = _unit_sums(side, np.ones_like(prompt))
    w = w_units.astype(np.float64)  # once (matmul would convert the integer weights for every product)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {HIT_RATE_METRIC: (w @ c_u) / (w @ p_u), COST_METRIC: (w @ cost_u) / (w @ n_u)}


@dataclass(frozen=True)
class RunNoise:
    """The run-to-run noise of one metric family: the standard deviation of the log per-run statistic, and the
    degrees of freedom of its estimate (None: taken as known exactly).

    Why the degrees of freedom: a spread estimated from two repeats has one, and a noise drawn with that
    spread as if it were known makes intervals far too narrow (an A/A pair on a loaded host was called worse
    that way). Each bootstrap draw takes its own sigma from the estimate's scaled inverse chi-square, so the
    injected noise is Student-t like with those degrees of freedom.
    """

    sigma: float
    df: int | None = None

    def sigma_draws(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if not self.df:
            return np.full(n, self.sigma)
        return self.sigma * np.sqrt(self.df / rng.chisquare(self.df, size=n))


def _as_noise(value: "RunNoise | float") -> RunNoise:
    return value if isinstance(value, RunNoise) else RunNoise(float(value))


def _draw_statistics(side: _Side, run_choice: np.ndarray, uniforms: np.ndarray, costs: tuple[float, float],
                     sigmas: Mapping[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One chunk of draws of every statistic; ``sigmas`` are the chunk's run-noise spreads per metric family
    (the same for both sides: one unknown noise), applied only to a side with a single run."""
    w = _unit_weights(side, run_choice, uniforms)
    stats = {**_latency_draws(side, w), **_cache_draws(side, w, *costs)}
    stats[THROUGHPUT_METRIC] = side.throughput[run_choice].mean(axis=1)
    if side.runs == 1:  # no repeats on this side: add the run-to-run noise known from elsewhere, if any
        for name in stats:
            sigma = sigmas.get(_family(name))
            if sigma is not None:
                stats[name] = stats[name] * np.exp(rng.normal(0.0, 1.0, size=len(stats[name])) * sigma)
    return stats


def _point_estimates(side: _Side, costs: tuple[float, float]) -> dict[str, float]:
    ones = np.ones((1, side.units), dtype=np.int32)
    stats = {**_latency_draws(side, ones), **_cache_draws(side, ones, *costs)}
    out = {k: float(v[0]) for k, v in stats.items()}
    out[THROUGHPUT_METRIC] = float(np.mean(side.throughput))
    return out


def _family(metric: str) -> str:
    """ttft_p50_s -> ttft; output_tokens_per_s -> throughput; hit_rate / cost stay."""
    if metric == THROUGHPUT_METRIC:
        return "throughput"
    return metric.split("_p")[0] if metric.endswith("_s") else metric


# ---- verdicts ------------------------------------------------------------------------------------------------
def _p_values(d: np.ndarray, margin: float) -> tuple[float, float]:
    """(beyond the margin on one side, inside the margin): two-sided bootstrap p-values, (1 + count) / (1 + B)."""
    n = len(d)
    beyond = 2 * min(np.sum(d <= margin), np.sum(d >= -margin))
    inside = 2 * max(np.sum(d <= -margin), np.sum(d >= margin))
    return min(1.0, (1 + beyond) / (1 + n)), min(1.0, (1 + inside) / (1 + n))


def _bh(p: Sequence[float]) -> np.ndarray:
    from scipy.stats import false_discovery_control

    return false_discovery_control(np.asarray(p, float), method="bh") if len(p) else np.zeros(0)


def _margin(metric: str, a: float) -> float:
    return MARGIN_HIT_RATE if metric == HIT_RATE_METRIC else MARGIN_RELATIVE * abs(a)


def _by_construction(metric: str, a: _Side, b: _Side) -> bool:
    """Hit rate (and prefill cost) when one side has prefix caching off and the other on."""
    on, off = frozenset({True}), frozenset({False})
    return metric in (HIT_RATE_METRIC, COST_METRIC) and {frozenset(a.prefix_caching), frozenset(b.prefix_caching)} \
        == {on, off}


def _rows(a: _Side, b: _Side, boots: dict[str, list[np.ndarray]], points: tuple[dict, dict],
          run_noise: Mapping[str, RunNoise], paired: bool, alpha: float) -> pd.DataFrame:
    rows = []
    for name, chunks in boots.items():
        d = np.concatenate(chunks)
        d = d[~np.isnan(d)]
        a_v, b_v = points[0].get(name, math.nan), points[1].get(name, math.nan)
        if not len(d) or math.isnan(a_v) or math.isnan(b_v):
            continue
        margin = _margin(name, a_v)
        lo, hi = np.percentile(d, [100 * alpha / 2, 100 * (1 - alpha / 2)])
        p_out, p_in = _p_values(d, margin)
        unmeasured = min(a.runs, b.runs) < 2 and _family(name) in {*LATENCY_METRICS, "throughput"} and not (
            run_noise.get(_family(name)))
        rows.append({"metric": name, "a": a_v, "b": b_v, "diff": b_v - a_v, "ci_low": float(lo), "ci_high": float(hi),
                     "relative": (b_v - a_v) / a_v if a_v else math.nan, "margin": margin, "_p_out": p_out,
                     "_p_in": p_in, "_fixed": "by_construction" if _by_construction(name, a, b)
                     else "inconclusive" if unmeasured else None, "runs_a": a.runs, "runs_b": b.runs,
                     "paired": paired})
    t = pd.DataFrame(rows)
    if not len(t):
        return pd.DataFrame(columns=TABLE_COLUMNS)
    tested = t["_fixed"].isna()
    t["p_value"], t["p_adjusted"] = t["_p_out"].where(tested), np.nan
    t.loc[tested, "p_adjusted"] = _bh(t.loc[tested, "_p_out"].tolist())
    p_in_adj = pd.Series(np.nan, index=t.index)
    p_in_adj[tested] = _bh(t.loc[tested, "_p_in"].tolist())
    t["verdict"] = [_word(r, p_in_adj[i], alpha) for i, r in t.iterrows()]
    return t[TABLE_COLUMNS]


def _word(row: pd.Series, p_in_adjusted: float, alpha: float) -> str:
    if isinstance(row["_fixed"], str):  # (pandas may hold the missing ones as None or NaN)
        return row["_fixed"]
    if row["p_adjusted"] < alpha:
        b_larger = row["diff"] > 0
        return "better" if b_larger == (row["metric"] in HIGHER_IS_BETTER) else "worse"
    return "equivalent" if p_in_adjusted < alpha else "inconclusive"


# ---- entry points --------------------------------------------------------------------------------------------
def compare(a_runs: Sequence[Run], b_runs: Sequence[Run], resamples: int = 2000, seed: int = 0,
            run_noise: "Mapping[str, RunNoise | float] | None" = None, alpha: float = ALPHA,
            cost_per_uncached_token: float = 1.0, cost_per_cached_token: float = 0.1) -> pd.DataFrame:
    """The verdict table, B relative to A: one row per metric (`TABLE_COLUMNS`).

    `run_noise` maps a metric family (`ttft`, `tpot`, `e2e`, `throughput`) to its run-to-run noise (a
    :class:`RunNoise`, or a relative standard deviation taken as known), used only for a side with a single run
    (see `estimate_run_noise`)."""
    if not a_runs or not b_runs:
        raise ValueError("compare needs at least one run on each side")
    paired = traffic_is_identical(a_runs, b_runs)
    sessions = _session_ids(a_runs[0]) if paired else None
    a, b = _side(a_runs, sessions), _side(b_runs, sessions)
    if not len(a.unit_of_request) or not len(b.unit_of_request):
        return pd.DataFrame(columns=TABLE_COLUMNS)
    rng = np.random.default_rng(seed)
    noise = {fam: _as_noise(v) for fam, v in (run_noise or {}).items() if v and _as_noise(v).sigma > 0}
    costs = (cost_per_uncached_token, cost_per_cached_token)
    chunk = max(1, min(256, 4_000_000 // max(len(a.unit_of_request), len(b.unit_of_request))))
    boots: dict[str, list[np.ndarray]] = {}
    for draws in _draw_chunks(a, b, paired, resamples, chunk, rng):
        n_draws = len(draws.run_choice_a)
        sigmas = {fam: v.sigma_draws(n_draws, rng) for fam, v in noise.items()}
        sa = _draw_statistics(a, draws.run_choice_a, draws.uniforms_a, costs, sigmas, rng)
        sb = _draw_statistics(b, draws.run_choice_b, draws.uniforms_b, costs, sigmas, rng)
        for name in sa.keys() & sb.keys():
            boots.setdefault(name, []).append(sb[name] - sa[name])
    order = [f"{m}_p{q}_s" for m in LATENCY_METRICS for q in QUANTILES[m]] + [THROUGHPUT_METRIC, HIT_RATE_METRIC,
                                                                           COST_METRIC]
    boots = {k: boots[k] for k in order if k in boots}
    return _rows(a, b, boots, (_point_estimates(a, costs), _point_estimates(b, costs)), noise, paired, alpha)


def compare_runs(a: pd.DataFrame, b: pd.DataFrame, resamples: int = 2000, seed: int = 0,
                 run_noise: Mapping[str, float] | None = None) -> pd.DataFrame:
    """Records of A and B (one run each, or several cells told apart by the `cell` column)."""
    return compare(split_runs(a, "A"), split_runs(b, "B"), resamples=resamples, seed=seed, run_noise=run_noise)


def noise_groups(runs: Sequence[Run]) -> list[list[Run]]:
    """Runs grouped as repeats of one cell: experiment cells ``server__workload__load__rN`` by everything
    before the repeat suffix; runs not all named so are taken as repeats of one configuration."""
    import re

    keys = [re.fullmatch(r"(.+)__r\d+", r.name) for r in runs]
    if not all(keys):
        return [list(runs)]
    groups: dict[str, list[Run]] = {}
    for r, m in zip(runs, keys):
        groups.setdefault(m.group(1), []).append(r)  # type: ignore[union-attr]
    return list(groups.values())


def estimate_run_noise(runs: Sequence[Run]) -> dict[str, RunNoise]:
    """Run-to-run noise per metric family from repeats (the standard deviation of log per-run p50 latency and
    throughput), pooled within groups of repeats of one cell (:func:`noise_groups`), with its degrees of
    freedom (runs minus groups); a family needs two runs in one group."""
    groups = [g for g in noise_groups(runs) if len(g) >= 2]
    points = [[_point_estimates(_side([r], None), (1.0, 0.1)) for r in g] for g in groups]
    out = {}
    for fam, metric in [*((m, f"{m}_p50_s") for m in LATENCY_METRICS), ("throughput", THROUGHPUT_METRIC)]:
        squares, df = 0.0, 0
        for group in points:
            vals = np.array([p.get(metric, math.nan) for p in group], float)
            vals = np.log(vals[np.isfinite(vals) & (vals > 0)])
            if len(vals) >= 2:
                squares += float(np.sum((vals - vals.mean()) ** 2))
                df += len(vals) - 1
        if df:
            out[fam] = RunNoise(math.sqrt(squares / df), df)
    return out


# ---- repeats that stand apart --------------------------------------------------------------------------------
#: A repeat is an outlier among the repeats of one cell when it lies more than OUTLIER_MADS scaled median absolute
#: deviations from their median *and* more than OUTLIER_RELATIVE of the median away (the second keeps repeats that
#: agree to a fraction of a percent from flagging each other). Needs OUTLIER_MIN_REPEATS: with two, neither can be
#: told to be the odd one.
OUTLIER_MADS = 3.0
OUTLIER_RELATIVE = 0.25
OUTLIER_MIN_REPEATS = 3
MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation per median absolute deviation


def outlier_repeats(values: Sequence[float]) -> np.ndarray:
    """Which of one cell's repeat values are outliers by the robust rule above (NaN values never are)."""
    x = np.asarray(values, float)
    flags = np.zeros(len(x), dtype=bool)
    finite = np.isfinite(x)
    if finite.sum() < OUTLIER_MIN_REPEATS:
        return flags
    med = float(np.median(x[finite]))
    mad = MAD_TO_SIGMA * float(np.median(np.abs(x[finite] - med)))
    limit = max(OUTLIER_MADS * mad, OUTLIER_RELATIVE * abs(med))
    flags[finite] = np.abs(x[finite] - med) > limit
    return flags


def run_statistics(runs: Sequence[Run]) -> pd.DataFrame:
    """Each run's own value of every verdict metric (``run``, ``metric``, ``value``): the point estimate
    :func:`compare` would make from that run alone, so a flagged repeat is flagged on the number a verdict uses."""
    rows = []
    for r in runs:
        for metric, value in _point_estimates(_side([r], None), (1.0, 0.1)).items():
            rows.append({"run": r.name, "metric": metric, "value": value})
    return pd.DataFrame(rows, columns=["run", "metric", "value"])


# ---- runs from result directories ----------------------------------------------------------------------------
def runs_from_dirs(dirs: Iterable[str | Path]) -> list[Run]:
    """Every cell of every directory (a replay run, a cell directory, or an experiment run) as a Run."""
    from kvscope.harness.results.loaders import load_results

    runs: list[Run] = []
    for d in dirs:
        res = load_results(d)
        runs.extend(_runs_of(res, list(res.cell_dirs)))
    return runs


def runs_from_experiment(experiment, server: str, workload: str | None = None, load: str | None = None
                         ) -> list[Run]:
    """The repeats of one server configuration in an experiment (a directory or loaded `ExperimentResults`), at
    one workload and load level (either may be left out when the server ran only one)."""
    from kvscope.harness.common.errors import KvscopeError
    from kvscope.harness.results.loaders import ExperimentResults, load_results

    res = experiment if isinstance(experiment, ExperimentResults) else load_results(experiment)
    root = res.root
    c = res.cells
    if not len(c) or "server" not in c:
        raise KvscopeError(f"{root}: no cells")
    ok = c[c["status"] == "ok"] if "status" in c else c
    sel = ok[ok["server"] == server]
    if not len(sel):
        raise KvscopeError(f"{root}: no finished cell of server {server!r}; servers: "
                           f"{', '.join(sorted(map(str, ok['server'].unique())))}")
    for col, want, flag in (("workload", workload, "--workload"), ("load", load, "--load")):
        values = list(dict.fromkeys(map(str, sel[col])))
        if want is None and len(values) > 1:
            raise KvscopeError(f"{root}: server {server!r} ran several {col}s ({', '.join(values)}); choose with {flag}")
        if want is not None and want not in values:
            raise KvscopeError(f"{root}: {flag} {want!r} not among {', '.join(values)} for server {server!r}")
        sel = sel[sel[col].astype(str) == (want if want is not None else values[0])]
    return _runs_of(res, sel.sort_values("repeat")["cell"].tolist())


def _runs_of(res, cells: list[str]) -> list[Run]:
    from kvscope.harness.results.loaders import load_run_manifest

    runs = []
    for cell in cells:
        summary = res.summaries.get(cell)
        facts = summary.server_facts[0] if summary is not None and summary.server_facts else None
        manifest_path = res.cell_dirs[cell] / "manifest.json"
        trace_sha256 = load_run_manifest(manifest_path).trace.sha256 if manifest_path.exists() else None
        name = res.root.name if res.single_run else cell
        runs.append(Run(name, res.requests[res.requests["cell"] == cell] if len(res.requests) else res.requests,
                        summary.throughput.output_tokens_per_s if summary is not None else None,
                        facts.prefix_caching if facts is not None else None, trace_sha256))
    return runs


def verdicts_json(table: pd.DataFrame) -> dict:
    """The `--json` body: {"metrics": [{"metric", "a", "b", "diff", "ci_low", "ci_high", "verdict", …}, …]}."""
    rows = json.loads(table.to_json(orient="records"))
    return {"metrics": rows}
