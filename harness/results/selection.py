"""Which records a number of the report was computed from, as data: :class:`Selection` and :class:`Statement`.

Why this structure. A number in a sentence or a figure title is only as good as the records behind it, and the
report used to pool silently: a "fastest TTFT p50" over four workloads and five load levels, a concurrency
level's TTFT p90 over three workloads whose own p90s were 48, 170 and 113 ms, a hit rate over every load that
contradicted the same workload's hit rate on the next figure. Here a number is a :class:`Statement`: the metric,
the value and its :class:`Selection` (configuration, workload, load level, repeats). A selection over more than
one workload or load level cannot be built unless it declares that dimension in ``distribution_over`` — a
figure whose purpose *is* a distribution over workloads or loads says so in its text (:meth:`Selection.words`),
and a comparison cannot hide a pool. The sentence's words come from the same object, so text and number cannot
drift apart, and `kvscope.harness.analysis.audit` recomputes every statement from the raw records.

The statements travel in `findings.json` (``Finding.statements``, optional: files without it still read).
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

Dimension = Literal["server", "workload", "load"]

#: The metrics a statement may state, each recomputable from requests.parquet (``analysis.audit``):
#: TTFT percentiles over the selected requests (s); the token-weighted hit rate (cached / prompt tokens); the
#: share of requests meeting the SLO (`results.goodput.meets_slo`); the output throughput's relative change of a
#: configuration against its ``baseline`` (same workload, load and repeat, from summary.json; the median over
#: the selected repeats); the mean sessions in flight of one cell (its records' send and completion times).
#: And the self-hosted dollars per 1,000 sessions: ``hourly_usd`` times the cells' durations (summary.json) over
#: the sessions each completed, the median over the selected repeats.
#: And a habit's hit-rate cost in percentage points: the ``reference_workload``'s hit rate less the selected
#: (habit) workload's, same configuration and load level.
Metric = Literal["ttft_p50_s", "ttft_p90_s", "hit_rate", "slo_share", "output_throughput_change",
                 "sessions_in_flight", "self_hosted_usd_per_1000_sessions", "hit_rate_gain_pp"]


def load_value(load: str) -> float:
    """A load label's number (``c5`` -> 5, ``sweep-c12`` -> 12, ``r0.5`` -> 0.5; NaN for ``timestamps``): load
    levels sort by it, never by their text (``sweep-c12`` after ``sweep-c5``)."""
    m = re.search(r"(\d+\.?\d*)", str(load))
    return float(m.group(1)) if m else float("nan")


def sorted_loads(loads) -> list[str]:
    """Load labels in numeric order (unnumbered ones last, in their given order)."""
    labels = list(dict.fromkeys(map(str, loads)))

    def key(label: str) -> tuple[bool, float, int]:
        v = load_value(label)
        return (math.isnan(v), 0.0 if math.isnan(v) else v, labels.index(label))

    return sorted(labels, key=key)


class Selection(BaseModel):
    """The records a number was computed from: configurations, workloads, load levels and the repeats pooled.

    One workload and one load level unless ``distribution_over`` names the dimension: pooling is refused at
    construction, so no function can return a pooled number without saying it is a distribution."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    servers: tuple[str, ...]
    workloads: tuple[str, ...]
    loads: tuple[str, ...]
    repeats: int | None = None  # how many repeats (cells of one server × workload × load) are pooled
    distribution_over: tuple[Dimension, ...] = ()

    @model_validator(mode="after")
    def _no_hidden_pool(self) -> Selection:
        for dim, values in (("server", self.servers), ("workload", self.workloads), ("load", self.loads)):
            if not values:
                raise ValueError(f"a selection names at least one {dim}")
            if len(values) > 1 and dim not in self.distribution_over:
                raise ValueError(f"a selection over {len(values)} {dim}s ({', '.join(values)}) pools them: name "
                                 f"'{dim}' in distribution_over if the figure is a distribution over them")
        return self

    def words(self) -> str:
        """The selection as the report says it: ``agent-coding at c2, 3 repeats, on baseline`` or ``pooled over
        4 workloads and 5 load levels (a distribution, not a comparison)``."""
        parts = []
        one_wl, one_load = len(self.workloads) == 1, len(self.loads) == 1
        if one_wl:
            parts.append(self.workloads[0])
        if one_load:
            parts.append(("at " if parts else "at load ") + self.loads[0])
        text = " ".join(parts)
        if self.repeats is not None and self.repeats > 1:
            text += f" ({self.repeats} repeats pooled)"
        if len(self.servers) == 1:
            text += f" on {self.servers[0]}"
        pooled = [f"{len(v)} {name}" for name, v in (("workloads", self.workloads), ("load levels", self.loads))
                  if len(v) > 1]
        if pooled:
            text = (text + "; " if text else "") + "pooled over " + " and ".join(pooled) + \
                " (a distribution, not a comparison)"
        return text.strip()


class Statement(BaseModel):
    """One number the report states, with the records it comes from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: Metric
    value: float
    selection: Selection
    slo_ttft_ms: float | None = None  # slo_share: the objectives
    slo_tpot_ms: float | None = None
    baseline: str | None = None  # output_throughput_change: the configuration it is compared against
    hourly_usd: float | None = None  # self_hosted_usd_per_1000_sessions: the machine's price an hour
    reference_workload: str | None = None  # hit_rate_gain_pp: the workload without the habit
