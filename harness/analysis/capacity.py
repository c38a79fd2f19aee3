"""Capacity from a load sweep: the highest measured load that meets the TTFT SLO, and where to measure next.

Why here (analysis layer) and pure: the live sweep (`kvscope.harness.experiment.sweep`) decides which load to
run next from these functions, and the report reads the same answer back from the cells' summaries, so the
search and the sentence a reader sees cannot disagree. Nothing here touches a server or a file.

A load *meets the SLO* when its TTFT p90 is at most the SLO and the server did not preempt (vLLM's
``num_preemptions`` counter delta over the cell: a preempting server is past its KV ceiling whatever the
latency says). The capacity is the highest *measured* passing load; the PCHIP interpolation of the measured
margin (SLO − TTFT p90, as vLLM's ``bench sweep serve_sla`` does) is reported beside it as an estimate, never
instead of it. A level whose mean sessions in flight fall short of its concurrency (the client, or the
workload's session count, could not keep that many going) is flagged: its latency is that of a lower load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np

if TYPE_CHECKING:
    from kvscope.harness.cachemodel.capacity_model import LevelPrediction

__all__ = ["Capacity", "LoadPoint", "capacity_from_points", "interpolated_crossing", "mean_in_flight",
           "next_bisection_load", "point_meets_slo", "predicted_point", "predicted_points"]

SweepKind = Literal["concurrency", "session_rate"]
SHORTFALL_TOLERANCE = 0.9
"""A concurrency level is flagged when its mean sessions in flight are below this share of the level."""


@dataclass(frozen=True)
class LoadPoint:
    """One measured sweep level: the load asked for and what the cell measured."""

    load: float  # concurrent sessions (closed loop) or sessions per second (open loop)
    ttft_p90_s: float | None
    preemptions: float = 0.0
    mean_sessions_in_flight: float | None = None
    cell: str | None = None


def predicted_points(rows: Sequence[LevelPrediction]) -> list[LoadPoint]:
    """The scheduler model's levels (`cachemodel.capacity_model`) as load points for the live rule, so a
    predicted capacity is read exactly as a measured one.  A level's TTFT p90 is its runs' mean and its
    preemptions those of its *median* run: the prediction is what one live sweep most likely reports, not
    the worst of an ensemble (a level where 3 of 16 runs preempt once passes in most live sweeps)."""
    return [predicted_point(r.concurrency, None if math.isnan(r.ttft_p90_s) else r.ttft_p90_s, r.preemptions_p50)
            for r in rows]


def predicted_point(load: float, ttft_p90_s: float | None, median_run_preemptions: float) -> LoadPoint:
    """One predicted level as the live rule reads it (see :func:`predicted_points`)."""
    return LoadPoint(float(load), None if ttft_p90_s is None else float(ttft_p90_s), float(median_run_preemptions))


def point_meets_slo(point: LoadPoint, slo_ttft_p90_ms: float) -> bool:
    """TTFT p90 within the SLO and no preemption; a cell without a TTFT (nothing answered) fails."""
    if point.ttft_p90_s is None or math.isnan(point.ttft_p90_s):
        return False
    return point.ttft_p90_s * 1000.0 <= slo_ttft_p90_ms and not point.preemptions


def under_driven(point: LoadPoint, kind: SweepKind) -> bool:
    """A closed-loop level that never had its concurrency's worth of sessions in flight."""
    if kind != "concurrency" or point.mean_sessions_in_flight is None:
        return False
    return point.mean_sessions_in_flight < SHORTFALL_TOLERANCE * point.load


def mean_in_flight(session_ids: Sequence[str], sent_s: Sequence[float], done_s: Sequence[float]) -> float | None:
    """Mean number of sessions in flight over the span from the first send to the last completion.

    A session is in flight from its first request's send to its last request's completion (think and tool time
    in between included: the session holds its slot of the closed loop)."""
    if not len(session_ids):
        return None
    import pandas as pd

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
    failing = [p.load for p in ordered if not point_meets_slo(p, slo_ttft_p90_ms)]
    if not failing:
        return None
    passing = [p.load for p in ordered if point_meets_slo(p, slo_ttft_p90_ms) and p.load < failing[0]]
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
    slo_ttft_p90_ms: float
    capacity: float | None  # highest measured load meeting the SLO
    interpolated: float | None  # PCHIP estimate of the margin's zero crossing
    ceiling: Literal["slo", "preemption"] | None  # why the next level failed; None: no ceiling within the levels
    under_driven: list[float] = field(default_factory=list)  # levels with fewer sessions in flight than asked
    points: list[LoadPoint] = field(default_factory=list)

    def sentence(self) -> str:
        slo = f"TTFT p90 ≤ {self.slo_ttft_p90_ms:g} ms"
        if self.capacity is None:
            return f"{self.server} meets {slo} at none of the measured loads on {self.workload}"
        held = f"{self.capacity:g}" if self.kind != "concurrency" else f"{int(self.capacity)}"
        what = f"concurrent {self.workload} sessions" if self.kind == "concurrency" else f"{self.workload} sessions/s"
        text = f"{self.server} holds {held} {what} at {slo}"
        if self.ceiling is None:
            return text + " (no ceiling within the levels: capacity is at least this)"
        why = "preempts" if self.ceiling == "preemption" else "breaks the SLO"
        nxt = min(p.load for p in self.points if p.load > self.capacity and
                  not point_meets_slo(p, self.slo_ttft_p90_ms))
        return text + f"; at {nxt:g} it {why}"


def capacity_from_points(server: str, workload: str, kind: SweepKind, points: Sequence[LoadPoint],
                         slo_ttft_p90_ms: float) -> Capacity:
    """Capacity = the highest measured load meeting the SLO; the ceiling is the failure just above it."""
    points = sorted(points, key=lambda p: p.load)
    passing = [p.load for p in points if point_meets_slo(p, slo_ttft_p90_ms)]
    best = max(passing) if passing else None
    above = [p for p in points if not point_meets_slo(p, slo_ttft_p90_ms) and (best is None or p.load > best)]
    ceiling: Literal["slo", "preemption"] | None = None
    if above:
        ceiling = "preemption" if above[0].preemptions else "slo"
    return Capacity(server, workload, kind, slo_ttft_p90_ms, best, interpolated_crossing(points, slo_ttft_p90_ms),
                    ceiling, [p.load for p in points if under_driven(p, kind)], list(points))
