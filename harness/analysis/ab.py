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
one `bincount`; each latency column is sorted once per side; a weighted percentile
(:func:`kvscope.harness.results.percentiles.weighted_percentiles`, summary.json's definition) sums the draws'
weights per block of 64 sorted values and cumulates value by value only inside the block that holds it (numpy's
cumulative sum is not vectorised: a full one per draw was most of the A/B page's time). Draws are processed in
chunks sized to the number of records, so memory stays bounded at 100k records. The matrices are small, so a multi-threaded
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

Which statistics, their directions and margins are not listed here: each is a registered summary metric's
(``results.summary.compared_statistics(Use.VERDICT)``), pooled as its kind says (a distribution's percentiles,
a ratio of sums, the mean of per-run values); the prefill cost is this engine's own, priced by its arguments.
A run's point estimate of a statistic is summary.json's figure: the same requests (successful, inside the
window, retries included), the same percentile definition (:mod:`kvscope.harness.results.percentiles`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.results.loaders import ExperimentResults, load_results, load_run_manifest
from kvscope.harness.results.percentiles import weighted_percentiles
from kvscope.harness.results.summary import OutputTokenThroughput, Statistic, Use, compared_statistics

#: The A/B engine's own statistic (mean prefill cost per request, priced by `compare`'s arguments): not a
#: summary.json figure, so not a registered metric; lower is better, decided by prefix caching like the hit rate.
COST_METRIC = "cost_prefill_units_per_request"
#: Practical margin: differences inside it are not worth a verdict (relative to A; a share's own absolute
#: margin, ``absolute_margin`` of its metric, for the hit rate).
MARGIN_RELATIVE = 0.05
ALPHA = 0.05
TABLE_COLUMNS = ["metric", "a", "b", "diff", "ci_low", "ci_high", "relative", "margin", "p_value", "p_adjusted",
                 "verdict", "runs_a", "runs_b", "paired"]


@dataclass(frozen=True)
class Run:
    """One replay run (a repeat of a cell): its request records and its per-run facts."""

    name: str
    records: pd.DataFrame
    output_tokens_per_s: float | None = None  # from summary.json; None: the summary's, else from the records
    prefix_caching: bool | None = None
    trace_sha256: str | None = None
    summary: Any = None  # its validated summary.json, where per-run statistics are read (None: records only)


def verdict_statistics() -> list[Statistic]:
    """The statistics of the verdict table, in its order (the registry's, `Use.VERDICT`), the cost aside."""
    return compared_statistics(Use.VERDICT)


@dataclass
class _Side:
    """The records of one side as arrays: every request's (run, session) unit, the record columns the
    statistics read, and the per-run statistics' values."""

    runs: int
    sessions_per_run: np.ndarray  # (R,)
    unit_offset: np.ndarray  # (R,) first unit index of each run
    unit_of_request: np.ndarray  # (n,)
    columns: dict[str, np.ndarray]
    per_run: dict[str, np.ndarray]  # statistic name -> (R,) value per run (NaN: not measured)
    statistics: list[Statistic]
    prefix_caching: set = field(default_factory=set)
    #: per distribution column with 2+ values: its values sorted (NaN left out) and the unit of each, sorted once
    sorted_values: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for column in dict.fromkeys(s.metric.column for s in self.statistics if s.kind == "percentile"):
            x = self.columns[column]
            keep = ~np.isnan(x)
            if keep.sum() >= 2:
                order = np.argsort(x[keep], kind="stable")
                self.sorted_values[column] = (x[keep][order], self.unit_of_request[keep][order])

    @property
    def units(self) -> int:
        return int(self.sessions_per_run.sum())


# ---- input ---------------------------------------------------------------------------------------------------
def _ok_records(df: pd.DataFrame) -> pd.DataFrame:
    """The requests a run's statistics are computed over, as summary.json's: successful, inside the window (a
    retry that succeeded is a successful request)."""
    if not len(df):
        return df
    ok = df[df["error_class"].isna()]
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


def _run_value(run: Run, stat: Statistic) -> float:
    """A per-run statistic of one run: from its summary; output throughput also as given (`Run`) or, for records
    without a summary, from the records."""
    if stat.metric is OutputTokenThroughput and run.output_tokens_per_s is not None:
        value: float | None = run.output_tokens_per_s
    elif run.summary is not None:
        value = stat.per_run(run.summary)
    else:
        value = records_throughput(run.records) if stat.metric is OutputTokenThroughput else None
    return np.nan if value is None else float(value)


def _side(runs: Sequence[Run], paired_sessions: list[str] | None, statistics: list[Statistic]) -> _Side:
    frames, sessions_per_run, offsets, off = [], [], [], 0
    for run in runs:
        ok = _ok_records(run.records)
        if not len(ok):
            raise KvscopeError(f"{run.name}: no successful requests inside the window to compare")
        sessions = paired_sessions or sorted(map(str, pd.unique(ok["session_id"])))
        local = pd.Categorical(ok["session_id"].astype(str), categories=sessions).codes
        frames.append(ok.assign(_unit=off + local))
        sessions_per_run.append(len(sessions))
        offsets.append(off)
        off += len(sessions)
    allr = pd.concat(frames, ignore_index=True)
    names = {"prompt_tokens", "cached_tokens"}  # the prefill cost's
    for stat in statistics:
        names |= {stat.metric.column} if stat.kind == "percentile" else set(stat.metric.ratio_of or ())
    cols = {c: allr[c].to_numpy(float) for c in sorted(names)}
    per_run = {s.name: np.array([_run_value(r, s) for r in runs]) for s in statistics if s.kind == "per_run"}
    return _Side(len(runs), np.asarray(sessions_per_run), np.asarray(offsets), allr["_unit"].to_numpy(np.int64),
                 cols, per_run, statistics, {r.prefix_caching for r in runs})


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


# ---- statistics per draw -------------------------------------------------------------------------------------
def _percentile_draws(side: _Side, w_units: np.ndarray) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    by_unit = np.ascontiguousarray(w_units.T)  # (units, k): one row gather per sorted value below
    by_column: dict[str, list[Statistic]] = {}
    for stat in side.statistics:
        if stat.kind == "percentile" and stat.metric.column in side.sorted_values:
            by_column.setdefault(stat.metric.column, []).append(stat)  # type: ignore[arg-type]
    for column, stats in by_column.items():
        vals, units = side.sorted_values[column]
        per_q = weighted_percentiles(vals, by_unit[units], [s.percentile for s in stats])  # type: ignore[misc]
        for j, stat in enumerate(stats):
            out[stat.name] = per_q[j]
    return out


def _unit_sums(side: _Side, values: np.ndarray) -> np.ndarray:
    return np.bincount(side.unit_of_request, weights=values, minlength=side.units)


def _ratio_and_cost_draws(side: _Side, w_units: np.ndarray, cost_uncached: float, cost_cached: float
                          ) -> dict[str, np.ndarray]:
    """Ratios of sums (over the records whose numerator is known, as summary.json's hit rate) and the mean
    prefill cost per request (a request without cached tokens reported counts as uncached)."""
    w = w_units.astype(np.float64)  # once (matmul would convert the integer weights for every product)
    out = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        for stat in side.statistics:
            if stat.kind == "ratio":
                num, den = (side.columns[c] for c in stat.metric.ratio_of)  # type: ignore[union-attr]
                known = ~np.isnan(num)
                out[stat.name] = (w @ _unit_sums(side, np.where(known, num, 0.0))) / (
                    w @ _unit_sums(side, np.where(known, den, 0.0)))
        prompt, cached = side.columns["prompt_tokens"], np.nan_to_num(side.columns["cached_tokens"])
        cost_u = _unit_sums(side, (prompt - cached) * cost_uncached + cached * cost_cached)
        n_u = _unit_sums(side, np.ones_like(prompt))
        out[COST_METRIC] = (w @ cost_u) / (w @ n_u)
    return out


def _per_run_draws(side: _Side, run_choice: np.ndarray) -> dict[str, np.ndarray]:
    return {name: values[run_choice].mean(axis=1) for name, values in side.per_run.items()}


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
    stats = {**_percentile_draws(side, w), **_ratio_and_cost_draws(side, w, *costs), **_per_run_draws(side, run_choice)}
    if side.runs == 1:  # no repeats on this side: add the run-to-run noise known from elsewhere, if any
        for name in stats:
            sigma = sigmas.get(_family(name))  # type: ignore[arg-type]
            if sigma is not None:
                stats[name] = stats[name] * np.exp(rng.normal(0.0, 1.0, size=len(stats[name])) * sigma)
    return stats


def _point_estimates(side: _Side, costs: tuple[float, float]) -> dict[str, float]:
    ones = np.ones((1, side.units), dtype=np.int32)
    stats = {**_percentile_draws(side, ones), **_ratio_and_cost_draws(side, ones, *costs)}
    out = {k: float(v[0]) for k, v in stats.items()}
    out.update({name: float(np.mean(values)) for name, values in side.per_run.items()})
    return out


def _statistic(name: str) -> Statistic | None:
    return next((s for s in verdict_statistics() if s.name == name), None)


def _family(metric: str) -> str | None:
    """The run-noise family of a statistic (ttft_p50_s -> ttft, output_tokens_per_s -> throughput); None for
    those without run-to-run noise (the hit rate, the cost)."""
    stat = _statistic(metric)
    return None if stat is None else stat.metric.noise_family


# ---- verdicts ------------------------------------------------------------------------------------------------
def _p_values(d: np.ndarray, margin: float) -> tuple[float, float]:
    """(beyond the margin on one side, inside the margin): two-sided bootstrap p-values, (1 + count) / (1 + B)."""
    n = len(d)
    beyond = 2 * min(np.sum(d <= margin), np.sum(d >= -margin))
    inside = 2 * max(np.sum(d <= -margin), np.sum(d >= margin))
    return min(1.0, (1 + beyond) / (1 + n)), min(1.0, (1 + inside) / (1 + n))


def _bh(p: Sequence[float]) -> np.ndarray:
    # deferred: scipy is heavy, importing this module must not load it
    from scipy.stats import false_discovery_control

    return false_discovery_control(np.asarray(p, float), method="bh") if len(p) else np.zeros(0)


def _margin(metric: str, a: float) -> float:
    stat = _statistic(metric)
    absolute = None if stat is None else stat.metric.absolute_margin
    return MARGIN_RELATIVE * abs(a) if absolute is None else absolute


def _by_construction(metric: str, a: _Side, b: _Side) -> bool:
    """A statistic prefix caching decides (the hit rate, the prefill cost) when one side has prefix caching off
    and the other on."""
    on, off = frozenset({True}), frozenset({False})
    stat = _statistic(metric)
    decided = metric == COST_METRIC or (stat is not None and stat.metric.caching_decides)
    return decided and {frozenset(a.prefix_caching), frozenset(b.prefix_caching)} == {on, off}


def _higher_is_better(metric: str) -> bool:
    stat = _statistic(metric)
    return stat is not None and stat.metric.higher_is_better


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
        family = _family(name)
        unmeasured = min(a.runs, b.runs) < 2 and family is not None and not run_noise.get(family)
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
        return "better" if b_larger == _higher_is_better(row["metric"]) else "worse"
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
    statistics = verdict_statistics()
    a, b = _side(a_runs, sessions, statistics), _side(b_runs, sessions, statistics)
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
    order = [s.name for s in statistics] + [COST_METRIC]
    boots = {k: boots[k] for k in order if k in boots}
    return _rows(a, b, boots, (_point_estimates(a, costs), _point_estimates(b, costs)), noise, paired, alpha)


def compare_runs(a: pd.DataFrame, b: pd.DataFrame, resamples: int = 2000, seed: int = 0,
                 run_noise: Mapping[str, float] | None = None) -> pd.DataFrame:
    """Records of A and B (one run each, or several cells told apart by the `cell` column)."""
    return compare(split_runs(a, "A"), split_runs(b, "B"), resamples=resamples, seed=seed, run_noise=run_noise)


def noise_groups(runs: Sequence[Run]) -> list[list[Run]]:
    """Runs grouped as repeats of one cell: experiment cells ``server__workload__load__rN`` by everything
    before the repeat suffix; runs not all named so are taken as repeats of one configuration."""
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
    statistics = verdict_statistics()
    points = [[_point_estimates(_side([r], None, statistics), (1.0, 0.1)) for r in g] for g in groups]
    out = {}
    families: dict[str, str] = {}  # family -> its first statistic (a distribution's lowest percentile)
    for stat in statistics:
        if stat.metric.noise_family is not None:
            families.setdefault(stat.metric.noise_family, stat.name)
    for fam, metric in families.items():
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
    statistics = verdict_statistics()
    for r in runs:
        for metric, value in _point_estimates(_side([r], None, statistics), (1.0, 0.1)).items():
            rows.append({"run": r.name, "metric": metric, "value": value})
    return pd.DataFrame(rows, columns=["run", "metric", "value"])


# ---- runs from result directories ----------------------------------------------------------------------------
def runs_from_dirs(dirs: Iterable[str | Path]) -> list[Run]:
    """Every cell of every directory (a replay run, a cell directory, or an experiment run) as a Run."""
    runs: list[Run] = []
    for d in dirs:
        res = load_results(d)
        runs.extend(_runs_of(res, list(res.cell_dirs)))
    return runs


def runs_from_experiment(experiment, server: str, workload: str | None = None, load: str | None = None
                         ) -> list[Run]:
    """The repeats of one server configuration in an experiment (a directory or loaded `ExperimentResults`), at
    one workload and load level (either may be left out when the server ran only one)."""
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
    runs = []
    for cell in cells:
        summary = res.summaries.get(cell)
        facts = summary.server_facts[0] if summary is not None and summary.server_facts else None
        manifest_path = res.cell_dirs[cell] / "manifest.json"
        trace_sha256 = load_run_manifest(manifest_path).trace.sha256 if manifest_path.exists() else None
        name = res.root.name if res.single_run else cell
        runs.append(Run(name, res.requests[res.requests["cell"] == cell] if len(res.requests) else res.requests,
                        summary.throughput.output_tokens_per_s if summary is not None else None,
                        facts.prefix_caching if facts is not None else None, trace_sha256, summary))
    return runs


def verdicts_json(table: pd.DataFrame) -> dict:
    """The `--json` body: {"metrics": [{"metric", "a", "b", "diff", "ci_low", "ci_high", "verdict", …}, …]}."""
    rows = json.loads(table.to_json(orient="records"))
    return {"metrics": rows}
