"""Capacity from a load sweep: the highest measured load that meets the TTFT SLO, and where to measure next.

Why here (analysis layer) and pure: the live sweep (`kvscope.harness.experiment.sweep`) decides which load to
run next from these functions, and the report reads the same answer back from the cells' summaries, so the
search and the sentence a reader sees cannot disagree. Nothing here touches a server or a file.

A load *meets the SLO* when its TTFT p90 is at most the SLO and the server did not preempt (vLLM's
``num_preemptions`` counter delta over the cell: a preempting server is past its KV ceiling whatever the
latency says). The capacity is the highest *measured* passing load that was *driven*; the PCHIP interpolation
of the measured margin (SLO − TTFT p90, as vLLM's ``bench sweep serve_sla`` does) is reported beside it as an
estimate, never instead of it.

A closed-loop level is *driven* when its mean sessions in flight reach the level less a tolerance of 10 %
(:data:`SHORTFALL_TOLERANCE`: 4.5 of 5). Below that (the workload's sessions ran out before the level was
filled, so the tail ran at a lower load) the level is *under-driven*: its latency is that of a lower load, so a
pass there proves nothing about the level and does not count toward the capacity (it is named in the
sentence); a failure there still counts (a server that fails with fewer sessions in flight fails with more).
The planned search treats such a pass as not shown to hold and measures below it. 10 % rather than a fixed
half session: a closed loop over a finite trace always ends with a tail, and a share scales with the level
(the quickstart's 8-session trace keeps 97 % of 4 in flight and 82 % of 5).

Each level runs once; its run-to-run noise is carried by a 95 % bootstrap interval of the TTFT p90 over the
level's sessions (sessions, not requests, are the unit of independence within a run). The sentence states how
far under or over the SLO the deciding levels were, which criterion (latency or preemption) decided the first
failing one, and whether the SLO lies inside a deciding level's interval (the edge is then within noise: a
repeat may move the capacity by a level).

The SLO is absolute (``250`` ms) or relative to the server's own unloaded latency (``3x_unloaded``:
:class:`TtftSlo`). A fixed 250 ms says nothing on a machine where one session alone already takes longer; a
multiple of the lowest level's TTFT p90 finds the knee on any machine. It is resolved here, from the points
themselves (the lowest measured level is the unloaded figure: sweeps run their levels in ascending order), so
the live sweep, the prediction beside it and the report read one absolute value, which each answer records.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np
from kvscope.harness.common.numbers import nan_to_none

if TYPE_CHECKING:
    from kvscope.harness.cachemodel.capacity_model import LevelPrediction

__all__ = ["Capacity", "LevelPlan", "LoadPoint", "TtftSlo", "capacity_from_points", "full_climb_levels",
           "interpolated_crossing", "kv_ceiling", "mean_in_flight", "measured_bracket", "next_bisection_load",
           "next_planned_level", "parse_ttft_slo", "plan_from_prediction", "point_holds", "point_meets_slo",
           "predicted_point", "predicted_points", "resolve_slo", "under_driven", "unloaded_point"]

SweepKind = Literal["concurrency", "session_rate"]
SHORTFALL_TOLERANCE = 0.9
"""A concurrency level is under-driven (flagged, and not counted toward the capacity) when its mean sessions in
flight are below this share of the level."""


_RELATIVE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*x_unloaded\s*$")
_ABSOLUTE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:ms)?\s*$")


@dataclass(frozen=True)
class TtftSlo:
    """A TTFT p90 objective: ``ms`` (absolute) or ``unloaded_factor`` times the lowest level's TTFT p90.
    ``number`` is the figure as the user wrote it, so the objective prints as given (``1.0000001x_unloaded``,
    not ``%g``'s ``1x``, which is refused)."""

    ms: float | None = None
    unloaded_factor: float | None = None
    number: str | None = field(default=None, compare=False)

    @property
    def text(self) -> str:
        if self.unloaded_factor is not None:
            return f"{self.number or f'{self.unloaded_factor:g}'}x_unloaded"
        return f"{self.number or f'{self.ms:g}'}ms"


def parse_ttft_slo(value: str | float) -> TtftSlo:
    """``250``, ``"250ms"`` (absolute) or ``"3x_unloaded"`` (3 times the unloaded TTFT p90); ValueError, one
    line, on anything else (an infinite figure included: 400 nines resolved to ``inf ms``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"TTFT p90 SLO {value!r} must be a finite number of ms > 0")
        return TtftSlo(ms=float(value))
    text = str(value)
    if m := _RELATIVE_RE.match(text):
        factor = float(m.group(1))
        if not math.isfinite(factor):
            raise ValueError(f"TTFT p90 SLO {text[:40]!r}...: the factor is not a finite number")
        if not factor > 1:
            raise ValueError(f"TTFT p90 SLO {text!r}: the factor must be above 1 (at 1x the unloaded level itself "
                             "fails on noise)")
        return TtftSlo(unloaded_factor=factor, number=m.group(1))
    if (m := _ABSOLUTE_RE.match(text)) and float(m.group(1)) > 0:
        if not math.isfinite(float(m.group(1))):
            raise ValueError(f"TTFT p90 SLO {text[:40]!r}...: the figure is not a finite number of ms")
        return TtftSlo(ms=float(m.group(1)), number=m.group(1))
    raise ValueError(f"TTFT p90 SLO {text!r} is neither milliseconds (250, '250ms') nor a multiple of the "
                     "server's unloaded TTFT p90 ('3x_unloaded')")


@dataclass(frozen=True)
class LoadPoint:
    """One measured sweep level: the load asked for and what the cell measured."""

    load: float  # concurrent sessions (closed loop) or sessions per second (open loop)
    ttft_p90_s: float | None
    preemptions: float = 0.0
    mean_sessions_in_flight: float | None = None
    cell: str | None = None
    #: 95 % bootstrap interval of the TTFT p90 over the level's sessions (s): how far run-to-run noise moves the
    #: figure the SLO is judged on (None: not measured, e.g. a predicted level or fewer than two sessions).
    ttft_p90_interval_s: tuple[float, float] | None = None


def predicted_points(rows: Sequence[LevelPrediction]) -> list[LoadPoint]:
    """The scheduler model's levels (`cachemodel.capacity_model`) as load points for the live rule, so a
    predicted capacity is read exactly as a measured one.  A level's TTFT p90 is its runs' mean and its
    preemptions those of its *median* run: the prediction is what one live sweep most likely reports, not
    the worst of an ensemble (a level where 3 of 16 runs preempt once passes in most live sweeps)."""
    return [predicted_point(r.concurrency, nan_to_none(r.ttft_p90_s), r.preemptions_p50)
            for r in rows]


def predicted_point(load: float, ttft_p90_s: float | None, median_run_preemptions: float) -> LoadPoint:
    """One predicted level as the live rule reads it (see :func:`predicted_points`)."""
    return LoadPoint(float(load), None if ttft_p90_s is None else float(ttft_p90_s), float(median_run_preemptions))


def unloaded_point(points: Sequence[LoadPoint]) -> LoadPoint | None:
    """The lowest measured level that has a TTFT: the sweep's unloaded latency (None: nothing answered)."""
    usable = [p for p in points if p.ttft_p90_s is not None and not math.isnan(p.ttft_p90_s)]
    return min(usable, key=lambda p: p.load) if usable else None


def kv_ceiling(points: Sequence[LoadPoint]) -> float | None:
    """The lowest measured load at which the server preempted (past its KV pool), whatever the latency."""
    pre = [p.load for p in points if p.preemptions]
    return min(pre) if pre else None


def point_meets_slo(point: LoadPoint, slo_ttft_p90_ms: float | None) -> bool:
    """TTFT p90 within the SLO and no preemption; a cell without a TTFT (nothing answered) fails, and so does
    every level of a relative SLO that could not be resolved (None)."""
    if slo_ttft_p90_ms is None or point.ttft_p90_s is None or math.isnan(point.ttft_p90_s):
        return False
    return point.ttft_p90_s * 1000.0 <= slo_ttft_p90_ms and not point.preemptions


def under_driven(point: LoadPoint, kind: SweepKind = "concurrency") -> bool:
    """A closed-loop level that never had its concurrency's worth of sessions in flight (less the tolerance)."""
    if kind != "concurrency" or point.mean_sessions_in_flight is None:
        return False
    return point.mean_sessions_in_flight < SHORTFALL_TOLERANCE * point.load


def point_holds(point: LoadPoint, slo_ttft_p90_ms: float | None, kind: SweepKind = "concurrency") -> bool:
    """The level meets the SLO *at the load it asked for*: it meets it and was driven. Only such a level
    counts toward a capacity; an under-driven pass measured a lower load."""
    return point_meets_slo(point, slo_ttft_p90_ms) and not under_driven(point, kind)


def mean_in_flight(session_ids: Sequence[str], sent_s: Sequence[float], done_s: Sequence[float]) -> float | None:
    """Mean number of sessions in flight over the span from the first send to the last completion.

    A session is in flight from its first request's send to its last request's completion (think and tool time
    in between included: the session holds its slot of the closed loop)."""
    if not len(session_ids):
        return None
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

    df = pd.DataFrame({"session": list(session_ids), "sent": np.asarray(sent_s, float),
                       "done": np.asarray(done_s, float)}).dropna()
    if df.empty:
        return None
    spans = df.groupby("session").agg(start=("sent", "min"), end=("done", "max"))
    total_s = float(spans["end"].max() - spans["start"].min())
    if total_s <= 0:
        return None
    return float((spans["end"] - spans["start"]).clip(lower=0).sum() / total_s)


def next_bisection_load(points: Sequence[LoadPoint], slo_ttft_p90_ms: float, kind: SweepKind,
                        rate_resolution: float = 0.1) -> float | None:
    """The next load to measure between the highest passing load below the first failure and that failure, or
    None when the gap is closed (adjacent integers for concurrency, a relative gap ≤ `rate_resolution` for
    session rates) or there is no bracket (nothing passed, or nothing failed)."""
    ordered = sorted(points, key=lambda p: p.load)
    # an under-driven pass bounds the bracket from above like a failure: the level was not shown to hold
    failing = [p.load for p in ordered if not point_holds(p, slo_ttft_p90_ms, kind)]
    if not failing:
        return None
    passing = [p.load for p in ordered if point_holds(p, slo_ttft_p90_ms, kind) and p.load < failing[0]]
    if not passing:
        return None
    lo, hi = max(passing), failing[0]
    if kind == "concurrency":
        mid = float(math.floor((lo + hi) / 2))
        return mid if lo < mid < hi else None
    return (lo + hi) / 2 if (hi - lo) / hi > rate_resolution else None


def interpolated_crossing(points: Sequence[LoadPoint], slo_ttft_p90_ms: float) -> float | None:
    """The load where the PCHIP interpolation of the margin (SLO − TTFT p90, ms) crosses 0, between the highest
    passing load and the next measured one; None without such a bracket. An estimate between measurements."""
    # deferred: scipy is heavy, importing this module must not load it
    from scipy.interpolate import PchipInterpolator

    usable = sorted((p for p in points if p.ttft_p90_s is not None), key=lambda p: p.load)
    loads = np.array([p.load for p in usable], float)
    if len(np.unique(loads)) != len(loads) or len(loads) < 2:
        return None
    margin = np.array([slo_ttft_p90_ms - p.ttft_p90_s * 1000.0 for p in usable])  # type: ignore[operator]
    crossings = np.nonzero((margin[:-1] >= 0) & (margin[1:] < 0))[0]
    if not len(crossings):
        return None
    i = int(crossings[0])
    curve = PchipInterpolator(loads, margin)
    roots = [r for r in curve.roots(extrapolate=False) if loads[i] <= r <= loads[i + 1]]
    return float(roots[0]) if roots else None


@dataclass
class Capacity:
    """The answer of one sweep (one server configuration on one workload)."""

    server: str
    workload: str
    kind: SweepKind
    slo_ttft_p90_ms: float | None  # the absolute objective (a relative one resolved); None: nothing to resolve it
    capacity: float | None  # highest measured load meeting the SLO
    interpolated: float | None  # PCHIP estimate of the margin's zero crossing
    ceiling: Literal["slo", "preemption"] | None  # why the next level failed; None: no ceiling within the levels
    under_driven: list[float] = field(default_factory=list)  # levels with fewer sessions in flight than asked
    points: list[LoadPoint] = field(default_factory=list)
    #: A relative SLO as written (``3x_unloaded``; None: absolute), the unloaded TTFT p90 it was resolved
    #: against and where that figure came from (``measured at concurrency 1``).
    slo_ttft_p90: str | None = None
    slo_unloaded_ttft_p90_ms: float | None = None
    slo_unloaded_source: str | None = None

    def slo_text(self) -> str:
        """``TTFT p90 ≤ 250 ms`` or ``TTFT p90 ≤ 3x unloaded (49 ms, measured at concurrency 1) = 147 ms``."""
        if self.slo_ttft_p90 is None:
            return f"TTFT p90 ≤ {self.slo_ttft_p90_ms:g} ms"
        factor = self.slo_ttft_p90.removesuffix("_unloaded")
        if self.slo_ttft_p90_ms is None:
            return f"TTFT p90 ≤ {factor} unloaded (not resolved: no level answered)"
        return (f"TTFT p90 ≤ {factor} unloaded ({self.slo_unloaded_ttft_p90_ms:.0f} ms, {self.slo_unloaded_source})"
                f" = {self.slo_ttft_p90_ms:.0f} ms")

    def _level(self, load: float) -> str:
        return f"{int(load)}" if self.kind == "concurrency" else f"{load:g}/s"

    def sentence(self) -> str:
        """The answer with its evidence at the edge: the capacity level's margin inside the SLO, any
        under-driven pass above it (named, not counted) and the first failing level with the criterion that
        decided it (:meth:`level_verdict`)."""
        slo = self.slo_text()
        skipped = self._under_driven_passes()
        if self.capacity is None:
            text = f"{self.server} meets {slo} at none of the measured{' driven' if skipped else ''} loads on {self.workload}"
            met = [f"{self._level(p.load)}: {'preempts' if p.preemptions else f'{p.ttft_p90_s * 1e3:.0f} ms'}"
                   for p in self.points if p.ttft_p90_s is not None and not math.isnan(p.ttft_p90_s)]
            if met:
                text += "; the tightest TTFT p90 SLO each level meets: " + ", ".join(met)
            text += "".join(f"; {self._under_driven_words(p)}" for p in skipped)
            ceiling = kv_ceiling(self.points)
            return text + (f"; KV ceiling: it preempts from {self._level(ceiling)}" if ceiling is not None
                           else "; no preemption within the levels")
        held = f"{self.capacity:g}" if self.kind != "concurrency" else f"{int(self.capacity)}"
        what = (f"concurrent {self.workload} session{'s' if held != '1' else ''}" if self.kind == "concurrency"
                else f"{self.workload} sessions/s")
        text = f"{self.server} holds {held} {what} at {slo}"
        at, nxt = self._edge_points()
        text += f" (at {self._level(at.load)}: {self.level_verdict(at)})"
        text += "".join(f"; {self._under_driven_words(p)}" for p in skipped if p.load > self.capacity)
        if self.ceiling is None:
            return text + "; no ceiling within the levels: capacity is at least this" + self._edge_words()
        assert nxt is not None  # a ceiling is a failing level above the capacity
        why = "preempts" if self.ceiling == "preemption" else "breaks the SLO"
        single = " (one preemption decides this edge)" if nxt.preemptions == 1 and self._within(nxt) else ""
        return (text + f"; at {self._level(nxt.load)} it {why} ({self.level_verdict(nxt)}); each level ran once{single}"
                + self._edge_words())

    def _edge_points(self) -> tuple[LoadPoint, LoadPoint | None]:
        """The capacity level and the first failing level above it (None: no ceiling within the levels)."""
        at = next(p for p in self.points if p.load == self.capacity)
        above = [p for p in self.points if p.load > at.load and not point_meets_slo(p, self.slo_ttft_p90_ms)]
        return at, min(above, key=lambda p: p.load) if above else None

    def noisy_edge_levels(self) -> list[float] | None:
        """The deciding levels whose TTFT p90 could fall on the other side of the SLO in a repeat: the SLO lies
        inside the level's 95 % interval over sessions (the capacity level's, and the first failing level's
        where latency decided it; a preemption is a count, not a percentile). None: no interval is known."""
        if self.capacity is None or self.slo_ttft_p90_ms is None:
            return None
        shown = self._latency_deciding()
        if not shown:
            return None
        slo_s = self.slo_ttft_p90_ms / 1e3
        return [p.load for p in shown if p.ttft_p90_interval_s[0] <= slo_s < p.ttft_p90_interval_s[1]]  # type: ignore[index]

    def _latency_deciding(self) -> list[LoadPoint]:
        """The deciding levels whose latency decides and whose interval is known: the capacity level, and the
        first failing level unless a preemption failed it."""
        at, nxt = self._edge_points()
        return [p for p in (at, nxt) if p is not None and p.ttft_p90_interval_s is not None
                and not (p is nxt and p.preemptions)]

    def _edge_words(self) -> str:
        """Run-to-run noise at the edge, from the deciding levels' 95 % intervals over sessions."""
        noisy = self.noisy_edge_levels()
        if noisy is None:
            return ""

        def interval(p: LoadPoint) -> str:
            lo, hi = p.ttft_p90_interval_s  # type: ignore[misc]
            return f"{lo * 1e3:.0f}-{hi * 1e3:.0f} ms at {self._level(p.load)}"

        shown = self._latency_deciding()
        if noisy:
            return (f"; the edge is within run-to-run noise: the SLO lies inside the TTFT p90's 95 % interval over "
                    f"sessions ({', '.join(interval(p) for p in shown if p.load in noisy)}), so a repeat may move the "
                    "capacity by a level")
        return ("; the edge is clear of run-to-run noise: the TTFT p90's 95 % interval over sessions stays on its "
                f"side of the SLO ({', '.join(interval(p) for p in shown)})")

    def _within(self, p: LoadPoint) -> bool:
        return (self.slo_ttft_p90_ms is not None and p.ttft_p90_s is not None and not math.isnan(p.ttft_p90_s)
                and p.ttft_p90_s * 1e3 <= self.slo_ttft_p90_ms)

    def _under_driven_passes(self) -> list[LoadPoint]:
        return [p for p in self.points if point_meets_slo(p, self.slo_ttft_p90_ms) and under_driven(p, self.kind)]

    def _under_driven_words(self, p: LoadPoint) -> str:
        bar = SHORTFALL_TOLERANCE * p.load
        # Two decimals when one would round up to the bar itself ("1.8 ... below 1.8" reads as a contradiction).
        digits = 1 if round(p.mean_sessions_in_flight, 1) < bar else 2
        return (f"{self._level(p.load)} met the SLO with only {p.mean_sessions_in_flight:.{digits}f} sessions in "
                f"flight on average (under-driven: below {bar:g}, the level less "
                f"{(1 - SHORTFALL_TOLERANCE) * 100:.0f} %), so it does not count")

    def level_verdict(self, p: LoadPoint) -> str:
        """One level against the SLO in words: ``TTFT p90 34 ms, 51 % inside the SLO, 3.9 sessions in flight``;
        for a failing level also which criterion decided it (``the preemption criterion decided``: its latency
        was within the SLO) or that both did."""
        parts = []
        if p.preemptions:
            parts.append(f"{p.preemptions:g} preemption{'s' if p.preemptions != 1 else ''}")
        if p.ttft_p90_s is None or math.isnan(p.ttft_p90_s):
            parts.append("no request answered")
        elif self.slo_ttft_p90_ms:
            ms = p.ttft_p90_s * 1e3
            margin_ms = self.slo_ttft_p90_ms - ms
            parts.append(f"TTFT p90 {ms:.0f} ms, {abs(margin_ms):.0f} ms {'under' if margin_ms >= 0 else 'over'} "
                         "the SLO")
        if p.mean_sessions_in_flight is not None:
            parts.append(f"{p.mean_sessions_in_flight:.1f} sessions in flight"
                         + (" (under-driven)" if under_driven(p, self.kind) else ""))
        text = ", ".join(parts)
        if point_meets_slo(p, self.slo_ttft_p90_ms) or p.ttft_p90_s is None or math.isnan(p.ttft_p90_s):
            return text
        if p.preemptions:
            return text + (": the preemption criterion decided" if self._within(p) else ": both criteria fail")
        return text + ": the latency criterion decided"


def resolve_slo(slo: TtftSlo, points: Sequence[LoadPoint], kind: SweepKind = "concurrency",
                fallback: LoadPoint | None = None, fallback_source: str = "predicted",
                points_source: str = "measured") -> tuple[float | None, float | None, str | None]:
    """(absolute SLO ms, unloaded TTFT p90 ms, where it came from): a relative SLO times the lowest measured
    level's TTFT p90, or ``fallback``'s (e.g. the scheduler model's lowest level from a calibration) when no
    level answered; (None, None, None) when neither has one."""
    if slo.unloaded_factor is None:
        return slo.ms, None, None
    base, source = unloaded_point(points), points_source
    if base is None and fallback is not None and fallback.ttft_p90_s is not None:
        base, source = fallback, fallback_source
    if base is None:
        return None, None, None
    where = f"concurrency {int(base.load)}" if kind == "concurrency" else f"{base.load:g} sessions/s"
    unloaded_ms = base.ttft_p90_s * 1000.0  # type: ignore[operator]
    return slo.unloaded_factor * unloaded_ms, unloaded_ms, f"{source} at {where}"


def capacity_from_points(server: str, workload: str, kind: SweepKind, points: Sequence[LoadPoint],
                         slo_ttft_p90_ms: float | TtftSlo, *, unloaded_fallback: LoadPoint | None = None,
                         fallback_source: str = "predicted", points_source: str = "measured") -> Capacity:
    """Capacity = the highest measured load meeting the SLO; the ceiling is the failure just above it. A
    relative SLO (:class:`TtftSlo`) is resolved from the lowest point (:func:`resolve_slo`) first."""
    slo = slo_ttft_p90_ms if isinstance(slo_ttft_p90_ms, TtftSlo) else TtftSlo(ms=float(slo_ttft_p90_ms))
    slo_ms, unloaded_ms, source = resolve_slo(slo, points, kind, unloaded_fallback, fallback_source, points_source)
    extra = {"slo_ttft_p90": None if slo.unloaded_factor is None else slo.text,
             "slo_unloaded_ttft_p90_ms": unloaded_ms, "slo_unloaded_source": source}
    points = sorted(points, key=lambda p: p.load)
    if slo_ms is None:
        return Capacity(server, workload, kind, None, None, None, None,
                        [p.load for p in points if under_driven(p, kind)], list(points), **extra)
    passing = [p.load for p in points if point_holds(p, slo_ms, kind)]  # met and driven
    best = max(passing) if passing else None
    above = [p for p in points if not point_meets_slo(p, slo_ms) and (best is None or p.load > best)]
    ceiling: Literal["slo", "preemption"] | None = None
    if above:
        ceiling = "preemption" if above[0].preemptions else "slo"
    return Capacity(server, workload, kind, slo_ms, best, interpolated_crossing(points, slo_ms),
                    ceiling, [p.load for p in points if under_driven(p, kind)], list(points), **extra)


# ---- a sweep planned from the scheduler model's curve (sweep.plan: predicted) --------------------------------
# Why: a climb from the lowest level measures every level up to the edge, most of them far from it; the
# scheduler model's curve (cheap: 0.1 s for the quickstart's 8 levels) says where the edge is likely, so the
# sweep measures the unloaded level, the last predicted-passing level, the predicted edge and one above it, and
# only where the measurement disagrees searches (bisection over the curve's levels, bounded) toward the
# measured edge. Its evidence never ends at the first failure: the level past the measured edge is measured
# too, so the report shows the curve past the failure. Pure like the rest of this module: the live sweep
# asks `next_planned_level` after every cell; tests drive it with a stubbed curve.


@dataclass(frozen=True)
class LevelPlan:
    """What the predicted curve says to measure (all loads among ``candidates``)."""

    candidates: tuple[float, ...]  # the levels the plan may pick: the predicted curve's, ascending
    predicted_capacity: float | None  # highest predicted level meeting the SLO (the live rule on the curve)
    predicted_edge: float | None  # lowest predicted-failing level above it (None: every level passes)
    targets: tuple[float, ...]  # unloaded (relative SLO), last predicted passing, the edge, one above; ascending


def plan_from_prediction(predicted: Sequence[LoadPoint], slo_ttft_p90_ms: float, *,
                         unloaded: bool = True) -> LevelPlan:
    """The levels that decide the capacity on the predicted curve: its capacity by the live rule, the first
    failing level above it (the edge) and the level after the edge; plus the lowest level (``unloaded``: the
    measurement a relative SLO resolves against)."""
    points = sorted(predicted, key=lambda p: p.load)
    candidates = tuple(p.load for p in points)
    if not candidates:
        return LevelPlan((), None, None, ())
    passing = [p.load for p in points if point_meets_slo(p, slo_ttft_p90_ms)]
    best = max(passing) if passing else None
    above = [p.load for p in points if (best is None or p.load > best) and not point_meets_slo(p, slo_ttft_p90_ms)]
    edge = above[0] if above else None
    targets = {best, edge}
    if edge is not None and candidates.index(edge) + 1 < len(candidates):
        targets.add(candidates[candidates.index(edge) + 1])
    if unloaded:
        targets.add(candidates[0])
    return LevelPlan(candidates, best, edge, tuple(sorted(t for t in targets if t is not None)))


def measured_bracket(candidates: Sequence[float], measured: Sequence[LoadPoint], slo_ttft_p90_ms: float
                     ) -> tuple[int, int]:
    """(index of the highest measured passing level, index of the lowest measured failing level above it) in
    ``candidates``; -1 when nothing passed, ``len(candidates)`` when nothing above it failed. The edge is found
    when they are adjacent."""
    index = {load: i for i, load in enumerate(candidates)}
    passing = [index[p.load] for p in measured if p.load in index and point_holds(p, slo_ttft_p90_ms)]
    hi_pass = max(passing) if passing else -1
    failing = [index[p.load] for p in measured  # an under-driven pass included: not shown to hold
               if p.load in index and index[p.load] > hi_pass and not point_holds(p, slo_ttft_p90_ms)]
    return hi_pass, min(failing) if failing else len(candidates)


def next_planned_level(plan: LevelPlan, measured: Sequence[LoadPoint], slo_ttft_p90_ms: float | None,
                       max_extra: int) -> float | None:
    """The next level of a predicted plan, or None when its evidence is complete.

    1. the plan's targets, ascending, up to the first measured failure (a predicted level above a level that
       already failed would not decide anything: the edge is below it);
    2. while the measured highest pass and lowest failure above it are not adjacent among the candidates: first
       the level next to the planned level that disagreed with the prediction (the model's edge was within one
       level of the measured one on four of five real vLLM CPU sweeps, exact on one), then the candidate halfway between
       them (nothing passed: the bracket starts below the lowest; nothing failed: it ends above the highest), at
       most ``max_extra`` levels beyond the targets;
    3. the candidate just past the measured edge, so the evidence does not end at the first failure.

    A level that met the SLO under-driven (:func:`under_driven`) counts as not shown to hold: the search goes
    below it, so the capacity rests on a driven level.

    ``slo_ttft_p90_ms`` None (a relative SLO before its unloaded level answered) asks for the lowest level
    only."""
    done = {p.load for p in measured}
    if not plan.candidates:
        return None
    if slo_ttft_p90_ms is None:
        lowest = plan.candidates[0]
        return None if lowest in done else lowest
    failing = [p.load for p in measured if not point_holds(p, slo_ttft_p90_ms)]  # under-driven passes too
    first_fail = min(failing) if failing else None
    for target in plan.targets:
        if first_fail is not None and target > first_fail:
            break
        if target not in done:
            return target
    lo, hi = measured_bracket(plan.candidates, measured, slo_ttft_p90_ms)
    if hi - lo > 1:
        extra = len(done - set(plan.targets))
        if extra >= max_extra:
            return None
        near_edge = set(plan.targets) - ({plan.candidates[0]} - {plan.predicted_capacity, plan.predicted_edge})
        if hi < len(plan.candidates) and plan.candidates[hi] in near_edge:  # a level predicted to pass failed: the edge is most likely just below
            return plan.candidates[hi - 1]
        if lo >= 0 and plan.candidates[lo] in near_edge:  # the level above the predicted edge passed: just above
            return plan.candidates[lo + 1]
        return plan.candidates[(lo + hi) // 2]
    past = hi + 1
    if past < len(plan.candidates) and plan.candidates[past] not in done:
        return plan.candidates[past]
    return None


def full_climb_levels(candidates: Sequence[float], measured: Sequence[LoadPoint], slo_ttft_p90_ms: float) -> int:
    """How many levels a climb over ``candidates`` from the lowest to one past the measured edge (the lowest
    failing level above the highest passing one) measures: what a sweep without a prediction pays for the same
    evidence. Every candidate when nothing failed above the highest pass."""
    _, hi = measured_bracket(candidates, measured, slo_ttft_p90_ms)
    return min(hi + 2, len(candidates))
