"""Stopping repeats early: a group-sequential paired t-test with Lan–DeMets alpha spending.

The question after each round of repeats is "is every verdict the spec asks for decided?". Asking it after
every round and stopping at the first "yes" is *peeking*: a test run at level alpha at each of several looks
rejects a true null far more often than alpha (Armitage, McPherson & Rowe 1969). A group-sequential design
fixes that by spending the error rate over the looks: look k, at information fraction t_k = k / max, may
reject only at a nominal level alpha_k chosen so that the probability of *any* rejection under the null, over
all looks, is alpha(t_K) = alpha. The spending function alpha(t) is Lan & DeMets' (1983, "Discrete sequential
boundaries for clinical trials", Biometrika 70:659-663): O'Brien–Fleming-type
``2 - 2 Phi(z_{1-alpha/2} / sqrt(t))`` (O'Brien & Fleming 1979, Biometrics 35:549-556; the default: almost
nothing spent early, the last look close to alpha) or Pocock-type ``alpha ln(1 + (e - 1) t)`` (nearly equal
levels). With 2-5 repeats the early looks have 1-3 degrees of freedom and can use little of what Pocock spends
there, so on the mock O'Brien–Fleming finds a 30 % effect in 99 % of experiments and Pocock in 92-97 %, with
the same repeats used (benchmarks/sequential_repeats.py). The boundaries c_k solve ``P(no crossing before k, |Z_k| >= c_k) =
alpha(t_k) - alpha(t_{k-1})`` for the canonical joint distribution of the statistics (a Brownian motion
observed at t_1 < … < t_K, ``Corr(Z_i, Z_j) = sqrt(t_i / t_j)``); the probabilities are computed by the
recursive numerical integration of Armitage, McPherson & Rowe (Jennison & Turnbull 2000, *Group Sequential
Methods with Applications to Clinical Trials*, ch. 19), here on a fixed grid with numpy: deterministic, and
exact to about 1e-6.

Why a paired t-test on per-repeat statistics and not the A/B page's bootstrap (:mod:`.ab`). Repeats of an
interleaved experiment are the unit of independence (each carries its own run factor); slot j of A and slot j
of B ran side by side, so ``d_j = log stat(B_j) - log stat(A_j)`` (a difference for the hit rate) are
independent and identically distributed draws of the effect, and their mean has a t distribution with k - 1
degrees of freedom at any k >= 2. The hierarchical bootstrap resamples 2 or 3 runs, whose distribution is far
from its sampling distribution (two runs give three distinct run draws): fine for the verdict once the repeats
are done, not for a rule that must hold its error rate at two repeats. With the variance estimated at every
look, applying the normal-theory levels to the t p-values (Jennison & Turnbull's "significance level
approach") is close only with many degrees of freedom; here there are 1 to 4, and it let through ~1.3 alpha on
the mock. So the boundaries are computed for the t-statistics themselves (:func:`t_levels`): under the null
their joint distribution is free of the unknown variance, so one seeded simulation of normal paths gives exact
boundaries for the same spending (up to Monte Carlo error ~2e-4).

Verdicts per (comparison, metric) use the words and margins of :mod:`.ab`: *better*/*worse* when the test that
the effect lies beyond the practical margin rejects at look k's level, *equivalent* when the two one-sided tests
that it lies inside the margin both do (TOST), *inconclusive* otherwise (at the last look: final). A decided
verdict stays decided; p-values are Benjamini–Hochberg adjusted across the metrics of one comparison, as there.
Each verdict's error rate is alpha (across the metrics of one comparison BH bounds the false discoveries, not
the family-wise rate); the benchmark ``benchmarks/sequential_repeats.py`` shows it by simulation
(and shows naive peeking exceeding it), ``tests/test_sequential.py`` asserts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, Mapping, Sequence

import numpy as np
from scipy import stats
from scipy.optimize import brentq

from kvscope.harness.analysis.ab import ALPHA, MARGIN_RELATIVE
from kvscope.harness.results.summary import Statistic, Use, compared_statistics

Spending = Literal["pocock", "obrien-fleming"]
SPENDING_FUNCTIONS: tuple[str, ...] = ("pocock", "obrien-fleming")
DECIDED = ("better", "worse", "equivalent")


def sequential_metrics() -> tuple[str, ...]:
    """Per-run statistics a stopping rule can decide on (summary.json's figures of one repeat): the registered
    metrics' statistics marked `Use.SEQUENTIAL`."""
    return tuple(s.name for s in compared_statistics(Use.SEQUENTIAL))


def _statistic(metric: str) -> Statistic:
    for stat in compared_statistics(Use.SEQUENTIAL):
        if stat.name == metric:
            return stat
    raise ValueError(f"unknown sequential metric {metric!r}; known: {', '.join(sequential_metrics())}")


def spent_alpha(t: float, alpha: float, spending: Spending) -> float:
    """The error rate spent by information fraction t (0 < t <= 1): Lan–DeMets' spending functions."""
    t = min(max(t, 0.0), 1.0)
    if t == 0.0:
        return 0.0
    if spending == "pocock":
        return alpha * math.log(1.0 + (math.e - 1.0) * t)
    if spending == "obrien-fleming":
        return float(2.0 - 2.0 * stats.norm.cdf(stats.norm.ppf(1.0 - alpha / 2.0) / math.sqrt(t)))
    raise ValueError(f"unknown spending function {spending!r}; known: {', '.join(SPENDING_FUNCTIONS)}")


_GRID_POINTS = 2001


def _two_sided_boundaries(fractions: Sequence[float], spend: Sequence[float]) -> list[float]:
    """Boundaries c_k on |Z_k| for looks at `fractions`, each look spending `spend[k]` of the error rate.

    The sub-density of the score S_k = Z_k sqrt(t_k) on the continuation region is carried from look to look on
    a grid (Simpson weights), convolved with the normal increment of variance t_k - t_{k-1}."""
    bounds: list[float] = []
    grid = weights = density = None
    prev_t = 0.0
    for t, a in zip(fractions, spend):
        dt = t - prev_t
        if grid is None:  # first look: S_1 ~ N(0, t_1)
            c = float(stats.norm.isf(a / 2.0)) if a > 0 else math.inf
        else:
            sd = math.sqrt(dt)

            def exit_prob(c: float) -> float:
                edge = c * math.sqrt(t)
                tails = stats.norm.sf((edge - grid) / sd) + stats.norm.cdf((-edge - grid) / sd)
                return float(np.sum(weights * density * tails))

            if a <= 0 or exit_prob(40.0) >= a:
                c = math.inf if a <= 0 else 40.0
            else:
                hi = 40.0
                lo = 1e-6
                c = brentq(lambda x: exit_prob(x) - a, lo, hi, xtol=1e-9) if exit_prob(lo) > a else lo
        bounds.append(c)
        # the sub-density of S_k inside the continuation region (|S_k| < c sqrt(t_k))
        edge = min(c, 40.0) * math.sqrt(t)
        new_grid = np.linspace(-edge, edge, _GRID_POINTS)
        h = new_grid[1] - new_grid[0]
        simpson = np.ones(_GRID_POINTS)
        simpson[1:-1:2], simpson[2:-1:2] = 4.0, 2.0
        new_weights = simpson * h / 3.0
        if grid is None:
            new_density = stats.norm.pdf(new_grid / math.sqrt(t)) / math.sqrt(t)
        else:
            sd = math.sqrt(dt)
            kernel = stats.norm.pdf((new_grid[:, None] - grid[None, :]) / sd) / sd
            new_density = kernel @ (weights * density)
        grid, weights, density, prev_t = new_grid, new_weights, new_density, t
    return bounds


@lru_cache(maxsize=64)
def nominal_levels(min_repeats: int, max_repeats: int, alpha: float = ALPHA,
                   spending: Spending = "obrien-fleming") -> dict[int, float]:
    """Two-sided nominal significance level per look, ``{repeats k: alpha_k}`` for k = min … max: a test that
    rejects at look k when its p-value is at most alpha_k rejects a true null with probability alpha over all
    looks. Information fraction k / max (each repeat adds the same information)."""
    if not 2 <= min_repeats <= max_repeats:
        raise ValueError(f"looks need 2 <= min <= max repeats, got min {min_repeats}, max {max_repeats}")
    looks = list(range(min_repeats, max_repeats + 1))
    fractions = [k / max_repeats for k in looks]
    cumulative = [spent_alpha(t, alpha, spending) for t in fractions]
    spend = [cumulative[0], *np.diff(cumulative)]
    bounds = _two_sided_boundaries(fractions, spend)
    return {k: float(2.0 * stats.norm.sf(c)) for k, c in zip(looks, bounds)}


#: Simulated paths behind :func:`t_levels` (seeded: the same levels on every machine; Monte Carlo error of each
#: look's spend about 2e-4 at alpha 0.05).
T_PATHS = 200_000
#: The most looks :func:`t_levels` simulates (`repeats.max` with stop_early is limited to it).
MAX_LOOKS = 20


@lru_cache(maxsize=64)
def t_levels(min_repeats: int, max_repeats: int, alpha: float = ALPHA, spending: Spending = "obrien-fleming"
             ) -> dict[int, float]:
    """Two-sided nominal levels per look for the *paired t-statistic* ``T_k = mean(d_1..k) / (s_k / sqrt(k))``:
    the same spending as :func:`nominal_levels`, but the boundaries c_k are those of the t-statistics' own joint
    distribution under the null, which (normal d, unknown variance) does not depend on the variance: simulated
    once from standard normal paths, ``P(no crossing before k, |T_k| >= c_k) = alpha(t_k) - alpha(t_{k-1})``.
    With 1-4 degrees of freedom the normal-theory levels applied to t p-values let through ~1.3 alpha; these
    hold alpha. Returned as levels of the t p-value: ``alpha_k = 2 P(t_{k-1} >= c_k)``."""
    if not 2 <= min_repeats <= max_repeats <= MAX_LOOKS:
        raise ValueError(f"looks need 2 <= min <= max <= {MAX_LOOKS} repeats, got min {min_repeats}, "
                         f"max {max_repeats}")
    rng = np.random.default_rng(20_260_326)
    d = rng.standard_normal((T_PATHS, max_repeats))
    n = np.arange(1, max_repeats + 1)
    total, squares = np.cumsum(d, axis=1), np.cumsum(d * d, axis=1)
    looks = list(range(min_repeats, max_repeats + 1))
    cumulative = [spent_alpha(k / max_repeats, alpha, spending) for k in looks]
    spend = [cumulative[0], *np.diff(cumulative)]
    alive = np.ones(T_PATHS, bool)
    out = {}
    for k, a in zip(looks, spend):
        mean = total[:, k - 1] / n[k - 1]
        var = (squares[:, k - 1] - total[:, k - 1] ** 2 / k) / (k - 1)
        t_abs = np.abs(mean) / np.sqrt(np.maximum(var, 1e-300) / k)
        rejects = int(round(a * T_PATHS))
        candidates = np.sort(t_abs[alive])[::-1]
        c = float(candidates[rejects - 1]) if 0 < rejects <= len(candidates) else math.inf
        alive &= t_abs < c
        out[k] = float(2.0 * stats.t.sf(c, k - 1)) if math.isfinite(c) else 0.0
    return out


@dataclass(frozen=True)
class SequentialRule:
    """Looks after repeat min … max, each at its spent nominal level (``naive``: alpha at every look, the
    peeking a benchmark contrasts; never use it to stop)."""

    min_repeats: int
    max_repeats: int
    alpha: float = ALPHA
    spending: Spending = "obrien-fleming"
    naive: bool = False
    #: a margin for every metric instead of :func:`margin_of`'s (0: the plain test of no difference, whose error
    #: rate under A/A is exactly alpha at a single look: the benchmark's setting for showing what peeking does)
    margin: float | None = None

    def margin_for(self, metric: str) -> float:
        return margin_of(metric) if self.margin is None else self.margin

    def level(self, repeats: int) -> float:
        if self.naive:
            return self.alpha
        return t_levels(self.min_repeats, self.max_repeats, self.alpha, self.spending)[repeats]


def margin_of(metric: str) -> float:
    """The practical margin on the scale the rule tests: log(1 + 5 %) for ratios, a share's own absolute margin
    (its metric's ``absolute_margin``: 0.5 points for the hit rate) for differences."""
    absolute = _statistic(metric).metric.absolute_margin
    return math.log1p(MARGIN_RELATIVE) if absolute is None else absolute


def paired_differences(metric: str, a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    """d_j = log(b_j / a_j) (a share, such as the hit rate: b_j - a_j) for the repeat slots both sides
    finished."""
    n = min(len(a), len(b))
    av, bv = np.asarray(a[:n], float), np.asarray(b[:n], float)
    if _statistic(metric).metric.absolute_margin is not None:
        d = bv - av
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.log(bv / av)
    return d[np.isfinite(d)]


def p_values(d: np.ndarray, margin: float) -> tuple[float, float, float]:
    """(beyond the margin, inside the margin, mean): two-sided p-values of the paired t-tests, as :mod:`.ab`
    defines them (beyond: 2 min of the one-sided tests against +-margin; inside: 2 max, the TOST)."""
    k = len(d)
    mean = float(np.mean(d)) if k else math.nan
    if k < 2:
        return 1.0, 1.0, mean
    se = float(np.std(d, ddof=1)) / math.sqrt(k)
    if se == 0.0:  # every repeat gave the same difference: exact
        beyond = 0.0 if abs(mean) > margin else 1.0
        return beyond, 0.0 if abs(mean) < margin else 1.0, mean
    df = k - 1
    above = float(stats.t.sf((mean - margin) / se, df))  # evidence that the effect exceeds +margin
    below = float(stats.t.cdf((mean + margin) / se, df))  # … that it lies below -margin
    not_low = float(stats.t.sf((mean + margin) / se, df))  # TOST: above -margin
    not_high = float(stats.t.cdf((mean - margin) / se, df))  # TOST: below +margin
    return min(1.0, 2 * min(above, below)), min(1.0, 2 * max(not_low, not_high)), mean


def _bh(p: Sequence[float]) -> np.ndarray:
    return stats.false_discovery_control(np.asarray(p, float), method="bh") if len(p) else np.zeros(0)


@dataclass
class Verdict:
    """One metric of one comparison at one look."""

    metric: str
    word: str  # better / worse / equivalent / inconclusive
    repeats: int  # paired repeats it was decided on (or looked at last)
    effect: float  # mean paired difference (log ratio; the hit rate: difference)
    p_beyond: float
    p_inside: float
    level: float  # the look's nominal level


def look(metrics: Sequence[str], a_stats: Mapping[str, Sequence[float]],
         b_stats: Mapping[str, Sequence[float]], rule: SequentialRule,
         decided: Mapping[str, Verdict] | None = None) -> dict[str, Verdict]:
    """The verdicts of one comparison (B relative to A) after its current repeats: those already decided are
    kept; the rest are tested at this look's level (BH across this comparison's open metrics)."""
    decided = dict(decided or {})
    open_metrics, rows = [], []
    for m in metrics:
        if m in decided and decided[m].word in DECIDED:
            continue
        d = paired_differences(m, a_stats.get(m, ()), b_stats.get(m, ()))
        rows.append((m, len(d), *p_values(d, rule.margin_for(m))))
        open_metrics.append(m)
    if not rows:
        return decided
    k = min(r[1] for r in rows)
    level = rule.level(k) if rule.min_repeats <= k <= rule.max_repeats else 0.0
    beyond = _bh([r[2] for r in rows])
    inside = _bh([r[3] for r in rows])
    for (m, n, _, _, mean), pb, pi in zip(rows, beyond, inside):
        word = "inconclusive"
        if n >= rule.min_repeats and pb <= level:
            word = "better" if (mean > 0) == _statistic(m).metric.higher_is_better else "worse"
        elif n >= rule.min_repeats and pi <= level:
            word = "equivalent"
        decided[m] = Verdict(m, word, n, mean, float(pb), float(pi), level)
    return decided


@dataclass
class SequentialOutcome:
    """The verdicts of a whole simulated (or recorded) sequence of looks and the repeats it used."""

    verdicts: dict[str, Verdict] = field(default_factory=dict)
    repeats: int = 0
    stopped_early: bool = False


def run_sequence(metrics: Sequence[str], a_stats: Mapping[str, Sequence[float]],
                 b_stats: Mapping[str, Sequence[float]], rule: SequentialRule,
                 rounds: int | None = None) -> SequentialOutcome:
    """Look after each repeat from min to max (or to `rounds`, the repeats done so far) and stop when every
    metric is decided: what the experiment runner does round by round (it replays the looks from the finished
    cells each time); the simulations call this with all max repeats' statistics drawn up front."""
    verdicts: dict[str, Verdict] = {}
    last = rule.max_repeats if rounds is None else min(rounds, rule.max_repeats)
    for k in range(rule.min_repeats, last + 1):
        verdicts = look(metrics, {m: list(v)[:k] for m, v in a_stats.items()},
                        {m: list(v)[:k] for m, v in b_stats.items()}, rule, verdicts)
        if all(verdicts[m].word in DECIDED for m in metrics):
            return SequentialOutcome(verdicts, k, k < rule.max_repeats)
    return SequentialOutcome(verdicts, last, False)


def run_statistic(summary, metric: str) -> float | None:
    """One repeat's statistic from its summary.json model (`summary_file_model()`), or None when not measured:
    the registered statistic's per-run value (the A/B engine's point estimate of that run, too)."""
    return _statistic(metric).per_run(summary)
