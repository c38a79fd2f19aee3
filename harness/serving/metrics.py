"""vLLM Prometheus metrics: parse a `/metrics` scrape, read the values kvscope needs, take deltas.

Parsing uses prometheus_client's own text parser, so label escaping, `_created` gauges and histogram series
are handled as the exporter writes them. Metric names changed across vLLM releases (`gpu_…` prefixes were
dropped in 0.9–0.11, `time_per_output_token` became `inter_token_latency`); every accessor here accepts the
current name and its older aliases, so one kvscope reads servers old and new.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from kvscope.harness.common.numbers import nan_to_none

Labels = tuple[tuple[str, str], ...]

# current name -> older names that carried the same value
ALIASES: dict[str, tuple[str, ...]] = {
    "vllm:kv_cache_usage_perc": ("vllm:gpu_cache_usage_perc",),
    "vllm:prefix_cache_queries_total": ("vllm:gpu_prefix_cache_queries_total",),
    "vllm:prefix_cache_hits_total": ("vllm:gpu_prefix_cache_hits_total",),
    "vllm:inter_token_latency_seconds": ("vllm:time_per_output_token_seconds",),
}

#: vLLM's cumulative count of preempted requests (a preempting server is past its KV ceiling).
PREEMPTIONS_COUNTER = "vllm:num_preemptions_total"

# The counters whose run-level deltas kvscope reports (sample names, `_total` included).
DELTA_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:generation_tokens_total",
    PREEMPTIONS_COUNTER,
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)


class MetricsParseError(ValueError):
    """The text is not the Prometheus exposition format."""


@dataclass
class MetricsSnapshot:
    """Every sample of one scrape, keyed by sample name and sorted label pairs."""

    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # family name -> counter/gauge/histogram/…
    scraped_at: float | None = None  # wall-clock seconds, set by the scraper

    # ---- lookups -----------------------------------------------------------------------------------
    def _series(self, name: str) -> dict[Labels, float]:
        for candidate in (name, *ALIASES.get(name, ())):
            series = self.samples.get(candidate)
            if series is not None:
                return series
        return {}

    def has(self, name: str) -> bool:
        return bool(self._series(name))

    def value(self, name: str, default: float = 0.0, **label_filter: str) -> float:
        """Sum of a metric over all series matching ``label_filter`` (engines and models summed)."""
        total, found = 0.0, False
        for labels, v in self._series(name).items():
            if _matches(labels, label_filter):
                total += v
                found = True
        return total if found else default

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """A metric split by one label, summed over the others (e.g. per `position`, per `source`)."""
        out: dict[str, float] = defaultdict(float)
        for labels, v in self._series(name).items():
            key = dict(labels).get(label)
            if key is not None:
                out[key] += v
        return dict(out)

    def info_labels(self, name: str) -> dict[str, str]:
        """Labels of an info-style gauge such as `vllm:cache_config_info` (first series)."""
        series = self._series(name)
        if not series:
            return {}
        labels = next(iter(series))
        return dict(labels)

    def histogram(self, name: str) -> "Histogram | None":
        """Cumulative buckets summed over series; None if the server does not export it."""
        buckets: dict[float, float] = defaultdict(float)
        for labels, v in self._series(name + "_bucket").items():
            le = dict(labels).get("le")
            if le is not None:
                buckets[float(le)] += v
        if not buckets:
            return None
        return Histogram(
            buckets=dict(sorted(buckets.items())),
            count=self.value(name + "_count"),
            sum=self.value(name + "_sum"),
        )

    # ---- the values kvscope watches ------------------------------------------------------------------
    def gauges(self) -> dict[str, float]:
        """The instantaneous server state recorded on every scrape."""
        return {
            "num_requests_running": self.value("vllm:num_requests_running"),
            "num_requests_waiting": self.value("vllm:num_requests_waiting"),
            "kv_cache_usage": self.value("vllm:kv_cache_usage_perc"),
        }

    def counters(self) -> dict[str, float]:
        return {name: self.value(name) for name in DELTA_COUNTERS}

    def counter_columns(self) -> dict[str, float]:
        """:meth:`counters` under engine-neutral column names (``num_preemptions``, ``prefix_cache_hits``, …):
        the columns of ``server_metrics.parquet``."""
        return {_column(k): v for k, v in self.counters().items()}


@dataclass(frozen=True)
class Histogram:
    buckets: dict[float, float]  # upper bound -> cumulative count
    count: float
    sum: float

    def plus(self, other: "Histogram") -> "Histogram":
        """The histogram of both servers' observations (buckets matched by upper bound)."""
        return Histogram(
            buckets={le: self.buckets.get(le, 0.0) + other.buckets.get(le, 0.0)
                     for le in sorted(set(self.buckets) | set(other.buckets))},
            count=self.count + other.count,
            sum=self.sum + other.sum,
        )

    def minus(self, earlier: "Histogram | None") -> "Histogram":
        if earlier is None:
            return self
        return Histogram(
            buckets={le: c - earlier.buckets.get(le, 0.0) for le, c in self.buckets.items()},
            count=self.count - earlier.count,
            sum=self.sum - earlier.sum,
        )

    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Prometheus-style linear interpolation inside the bucket holding the q-quantile."""
        if not self.count:
            return math.nan
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets.items():
            if c >= rank:
                if math.isinf(le):
                    return prev_le
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le


def _matches(labels: Labels, label_filter: Mapping[str, str]) -> bool:
    if not label_filter:
        return True
    d = dict(labels)
    return all(d.get(k) == v for k, v in label_filter.items())


def parse_metrics(text: str, scraped_at: float | None = None) -> MetricsSnapshot:
    """Parse Prometheus text exposition; raises MetricsParseError naming the offending line."""
    from prometheus_client.parser import text_string_to_metric_families  # deferred: heavy, only a scrape needs it

    snap = MetricsSnapshot(scraped_at=scraped_at)
    try:
        for family in text_string_to_metric_families(text):
            snap.types[family.name] = family.type
            for sample in family.samples:
                labels: Labels = tuple(sorted(sample.labels.items()))
                snap.samples.setdefault(sample.name, {})[labels] = float(sample.value)
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"not a Prometheus metrics text: {exc}") from exc
    return snap


@dataclass
class MetricsDelta:
    """What happened on the server between two scrapes (counters only move forward)."""

    counters: dict[str, float]
    prompt_tokens_by_source: dict[str, float]
    accepted_per_position: list[float]
    requests_by_finish_reason: dict[str, float]
    histograms: dict[str, Histogram]
    reset_detected: bool = False  # a counter went backwards: the server restarted in between

    @property
    def prefix_cache_queries(self) -> float:
        return self.counters["vllm:prefix_cache_queries_total"]

    @property
    def prefix_cache_hits(self) -> float:
        return self.counters["vllm:prefix_cache_hits_total"]

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else math.nan

    @property
    def spec_drafts(self) -> float:
        return self.counters["vllm:spec_decode_num_drafts_total"]

    @property
    def spec_draft_tokens(self) -> float:
        return self.counters["vllm:spec_decode_num_draft_tokens_total"]

    @property
    def spec_accepted_tokens(self) -> float:
        return self.counters["vllm:spec_decode_num_accepted_tokens_total"]

    @property
    def spec_acceptance_rate(self) -> float:
        d = self.spec_draft_tokens
        return self.spec_accepted_tokens / d if d else math.nan

    @property
    def spec_mean_acceptance_length(self) -> float:
        """1 + accepted/drafts: tokens produced per target-model pass while speculating."""
        n = self.spec_drafts
        return 1.0 + self.spec_accepted_tokens / n if n else math.nan

    @property
    def spec_acceptance_by_position(self) -> list[float]:
        n = self.spec_drafts
        return [a / n if n else math.nan for a in self.accepted_per_position]

    def to_dict(self) -> dict:
        short = {_column(k): v for k, v in self.counters.items()}
        return {
            **short,
            "prompt_tokens_by_source": self.prompt_tokens_by_source,
            "spec_accepted_per_position": self.accepted_per_position,
            "requests_by_finish_reason": self.requests_by_finish_reason,
            "prefix_cache_hit_rate": nan_to_none(self.prefix_cache_hit_rate),
            "spec_acceptance_rate": nan_to_none(self.spec_acceptance_rate),
            "spec_mean_acceptance_length": nan_to_none(self.spec_mean_acceptance_length),
            "spec_acceptance_by_position": [nan_to_none(x) for x in self.spec_acceptance_by_position],
            "reset_detected": self.reset_detected,
        }


def _sum_keyed(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out[k] + v if k in out else v
    return out


def combine_deltas(deltas: Sequence[MetricsDelta]) -> MetricsDelta:
    """The delta of several servers taken as one deployment: every counter, labelled breakdown, per-position
    count and histogram summed, so its rates (:attr:`MetricsDelta.prefix_cache_hit_rate`, the acceptance
    rates) are the pooled ones, computed by the same properties as one server's. A reset on any server is a
    reset of the whole."""
    if not deltas:
        raise ValueError("combine_deltas: no deltas")
    positions = max(len(d.accepted_per_position) for d in deltas)
    hists: dict[str, Histogram] = {}
    for d in deltas:
        for name, h in d.histograms.items():
            hists[name] = hists[name].plus(h) if name in hists else h
    return MetricsDelta(
        counters=_sum_keyed([d.counters for d in deltas]),
        prompt_tokens_by_source=_sum_keyed([d.prompt_tokens_by_source for d in deltas]),
        accepted_per_position=[sum(d.accepted_per_position[i] for d in deltas if i < len(d.accepted_per_position))
                               for i in range(positions)],
        requests_by_finish_reason=_sum_keyed([d.requests_by_finish_reason for d in deltas]),
        histograms=hists,
        reset_detected=any(d.reset_detected for d in deltas),
    )


def _column(name: str) -> str:
    """A vLLM sample name as a result column: ``vllm:num_preemptions_total`` -> ``num_preemptions``."""
    return name.removeprefix("vllm:").removesuffix("_total")


DELTA_HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
)


def _split_delta(after: Mapping[str, float], before: Mapping[str, float]) -> tuple[dict[str, float], bool]:
    out, reset = {}, False
    for k in set(after) | set(before):
        d = after.get(k, 0.0) - before.get(k, 0.0)
        if d < 0:
            reset = True
        out[k] = d
    return out, reset


def metrics_delta(before: MetricsSnapshot, after: MetricsSnapshot) -> MetricsDelta:
    counters, reset = _split_delta(after.counters(), before.counters())
    by_source, r1 = _split_delta(
        after.by_label("vllm:prompt_tokens_by_source_total", "source"),
        before.by_label("vllm:prompt_tokens_by_source_total", "source"),
    )
    per_pos, r2 = _split_delta(
        after.by_label("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position"),
        before.by_label("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position"),
    )
    finished, r3 = _split_delta(
        after.by_label("vllm:request_success_total", "finished_reason"),
        before.by_label("vllm:request_success_total", "finished_reason"),
    )
    hists = {}
    for name in DELTA_HISTOGRAMS:
        h = after.histogram(name)
        if h is not None:
            hists[name] = h.minus(before.histogram(name))
    return MetricsDelta(
        counters=counters,
        prompt_tokens_by_source=by_source,
        accepted_per_position=[per_pos[k] for k in sorted(per_pos, key=int)],
        requests_by_finish_reason=finished,
        histograms=hists,
        reset_detected=reset or r1 or r2 or r3,
    )
