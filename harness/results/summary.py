"""Run summary from the records: throughput, latency percentiles, goodput, errors, and the three hit rates.

Everything here is computed from `requests.parquet` alone (plus the metrics deltas), so anyone can recompute
the summary from the published records and get the same numbers.

Each entry of summary.json is one :class:`SummaryMetric` class, as in AIPerf: a dotted ``tag`` (its place in
the file: ``latency.ttft_s``, ``throughput.requests_per_s``, ``hit_rate``), the type of its value (``output``: a
pydantic block or a plain type), ``compute(run)`` and the columns it adds to ``load_results(...).cells``
(``cell_columns``); ``@summary_metric`` registers it. Everything else is derived from the registry:
:func:`summarize` fills the summary in registration order, :func:`summary_file_model` builds the
``kvscope-summary`` schema the writer and the loader validate against (``schemas.SummaryFile`` is that model),
the loader's cell rows take each metric's columns, and the report's ``cell_metrics_table`` shows them. So a
new metric is one class in one file. The entries that are computed together (the request counts, the three
hit rates, goodput) stay one metric each, because their parts share one computation.

A metric that runs are *compared* on declares its identity on the same class, as AIPerf's metric classes do:
``header`` (display name), ``unit``, ``higher_is_better``, ``compared`` (which percentiles, or the scalar, and
where each appears: :class:`Use`), the per-run statistic (``statistic``), and how the A/B engine pools it over
the records of several runs (a distribution's ``column``, a ratio's ``ratio_of``, else the per-run value).
:func:`compared_statistics` derives from the registry every list the analysis once kept by hand: the A/B
verdict rows and their directions and margins (``analysis.ab``), the metrics early stopping may decide on and
their per-run values (``analysis.sequential``, ``experiment.spec``), the A/B page's pivot, forest and spread
metrics, and the claims' words. Percentiles everywhere are :mod:`.percentiles`' one definition.

Why here, in the results layer: the loaders validate summary.json against the registry's schema, and the
loaders may not import the replay (a layer above); the computation reads only request records, like
``goodput.py`` beside it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import pandas as pd
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.results.goodput import goodput
from kvscope.harness.results.percentiles import percentiles
from kvscope.harness.results.summary_parts import (ClientStats, ServerFacts,  # noqa: F401 - re-exported
                                                   assemble_parts, part_fields, registered_parts)
from kvscope.workloads.versioned_file import VersionedFile
from pydantic import BaseModel, ConfigDict, Field, create_model, model_serializer, model_validator
from pydantic_core import PydanticUndefined


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")


#: The percentiles of every distribution in summary.json (:class:`Percentiles`' fields).
PERCENTILES = (50, 90, 95, 99)


def _pcts(values: np.ndarray) -> dict[str, float | None]:
    values = values[~np.isnan(values)] if len(values) else values
    if not len(values):
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}}
    out: dict[str, float | None] = {"count": int(len(values)), "mean": float(np.mean(values))}
    for p, v in zip(PERCENTILES, percentiles(values, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


def run_predictor(ok: pd.DataFrame) -> str | None:
    """The model behind the records' ``predicted_cached_tokens``: the one ``predictor`` value they carry,
    ``mixed`` if several, None if none (nothing predicted)."""
    if "predictor" not in ok:
        return None
    names = sorted({str(v) for v in ok["predictor"].dropna()})
    return names[0] if len(names) == 1 else ("mixed" if names else None)


def _exact(ok: pd.DataFrame, column: str, caching_off: bool) -> tuple[int, int]:
    """(requests whose ``column`` equals the server's cached tokens, requests with both): with caching off
    the expected value is 0 whatever was predicted."""
    both = ok.dropna(subset=["cached_tokens", column])
    expected = 0 if caching_off else both[column]
    return int((both["cached_tokens"] == expected).sum()), int(len(both))


def hit_rates(ok: pd.DataFrame, deltas: dict[str, Any], prefix_caching: bool | None,
              predictor_note: str | None = None, calibration: str | None = None) -> dict[str, Any]:
    """Hit rate three ways. With prefix caching off the server should report 0 for every request, so that is
    the prediction checked request by request; the simulator's figure becomes `would_hit`. The prediction is
    the model's that ``predictor`` names; the sequential simulator's figures stay beside it (``sequential_*``),
    equal to the main ones when it is the predictor."""
    prompt = float(ok["prompt_tokens"].sum())
    server = ok["cached_tokens"].dropna()
    simulated = ok["predicted_cached_tokens"].dropna()
    server_rate = _ratio(float(server.sum()), float(ok.loc[server.index, "prompt_tokens"].sum()))
    simulated_rate = _ratio(float(simulated.sum()), float(ok.loc[simulated.index, "prompt_tokens"].sum()))
    metrics_rate = deltas.get("prefix_cache_hit_rate") if deltas else None
    both = ok.dropna(subset=["cached_tokens", "predicted_cached_tokens"])
    caching_off = prefix_caching is False
    expected = 0 if caching_off else both["predicted_cached_tokens"]
    mismatches = int((both["cached_tokens"] != expected).sum())
    predicted_rate = (0.0 if simulated_rate is not None else None) if caching_off else simulated_rate
    out: dict[str, Any] = {
        "prompt_tokens": int(prompt),
        "server_cached_tokens": int(server.sum()),
        "predicted_cached_tokens": 0 if caching_off else int(simulated.sum()),
        "server_per_request": server_rate,
        "predicted": predicted_rate,
        "metrics_counters": metrics_rate,
        "metrics_hits": deltas.get("prefix_cache_hits") if deltas else None,
        "metrics_queries": deltas.get("prefix_cache_queries") if deltas else None,
        "predicted_minus_server": None if predicted_rate is None or server_rate is None else predicted_rate - server_rate,
        "server_minus_metrics": None if metrics_rate is None or server_rate is None else server_rate - metrics_rate,
        "requests_compared": int(len(both)),
        "requests_predicted_exactly": int(len(both) - mismatches),
    }
    seq_col = "predicted_cached_tokens_sequential" if "predicted_cached_tokens_sequential" in ok \
        else "predicted_cached_tokens"
    sequential = ok[seq_col].dropna()
    seq_rate = _ratio(float(sequential.sum()), float(ok.loc[sequential.index, "prompt_tokens"].sum()))
    seq_exact, seq_compared = _exact(ok, seq_col, caching_off)
    out.update({
        "predictor": run_predictor(ok), "predictor_note": predictor_note, "calibration": calibration,
        "predicted_exact_share": _ratio(out["requests_predicted_exactly"], out["requests_compared"]),
        "sequential_predicted": (0.0 if seq_rate is not None else None) if caching_off else seq_rate,
        "sequential_requests_predicted_exactly": seq_exact,
        "sequential_exact_share": _ratio(seq_exact, seq_compared),
    })
    if caching_off:
        out["would_hit"] = simulated_rate
        out["would_hit_cached_tokens"] = int(simulated.sum())
    return out


@dataclass(frozen=True)
class RunView:
    """What every summary metric reads: the records, their measured window and the run's settings."""

    records: pd.DataFrame
    window: pd.DataFrame  # records inside the warm-up/cool-down window
    ok: pd.DataFrame  # successful requests in the window
    failed: pd.DataFrame  # failed requests in the window
    deltas: dict[str, Any]  # /metrics counter deltas over the run
    duration_s: float
    prefix_caching: bool | None
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    weights_random: bool | None
    client_cpu_utilization: float | None = None  # the replay client's CPU seconds per wall second
    client_stalls: int | None = None  # times the client's event loop woke > CLIENT_STALL_S late (None: not probed)
    cache_not_reset: str | None = None  # why the prefix cache could not be emptied before the run (None: it was)
    scrape_times_s: tuple[float, ...] = ()  # when /metrics was scraped (s from the run's start, all endpoints)
    scrape_interval_s: float | None = None  # the scrape period asked for
    predictor_note: str | None = None  # why the predictor is not the obvious one (replay.predict.choose_predictor)
    calibration: str | None = None  # the calibration file the scheduler model's predictions ran on


CLIENT_SATURATED_CPU_SHARE = 0.9
"""Above this share of one core the replay client queues its own work, and latencies include that queueing."""
BURST_TOLERANCE = (0.001, 0.02)
"""An answer arrived in one burst when e2e − TTFT ≤ 1 ms + 2 % of e2e: its tokens came together, so TTFT is
the whole generation and TPOT/ITL say nothing about decoding."""
ZERO_GAP_ITL_S = 1e-4
"""Inter-token gaps below 0.1 ms: chunks read from one socket buffer, not separate decode steps."""


class Use(enum.Flag):
    """Where a compared statistic appears (AIPerf's metric flags): one flag per reader, so a metric says in one
    place every table and rule it takes part in."""

    VERDICT = enum.auto()  # a row of the A/B verdict table (analysis.ab.compare)
    SEQUENTIAL = enum.auto()  # early stopping may decide on it (repeats.metrics; analysis.sequential)
    PIVOT = enum.auto()  # a column of the A/B page's verdict pivot and of findings.json's verdicts
    FOREST = enum.auto()  # a row of the A/B page's forest plot
    SPREAD = enum.auto()  # a panel of the A/B page's repeat-spread figure
    HEADLINE = enum.auto()  # named in the A/B page's one-sentence finding per configuration pair


class SummaryMetric:
    """One entry of summary.json.

    ``tag``: its dotted path in the file. ``output``: the type of its value (a pydantic block, or a plain type
    such as ``float | None``), which the summary schema uses. ``default``: the value a file written before the
    metric existed reads as (unset: the entry is required). ``compute(run)``: its value, as the output model or
    its JSON-able dict. ``cell_columns(value)``: the columns it adds to ``load_results(...).cells``, from the
    validated value (none by default).

    A metric runs are compared on also says what it is (:func:`compared_statistics` reads this): ``compared``
    maps each of its statistics (a percentile of a distribution, or None for the scalar) to its :class:`Use`;
    ``name`` is the statistic's name (``{q}`` stands for the percentile: ``ttft_p{q}_s``); ``header`` and
    ``unit`` are how it is shown; ``higher_is_better`` its direction; ``absolute_margin`` the practical margin
    of a share compared by difference (None: compared by ratio, within 5 %); ``noise_family`` the run-to-run
    noise it shares with its family (``ab.RunNoise``; None: it carries none, e.g. a hit rate the trace fixes);
    ``caching_decides`` whether its difference between prefix caching off and on is true by construction;
    ``order`` its place among compared metrics in tables. :meth:`statistic` is the per-run value from the
    validated summary entry; the A/B engine pools a distribution over the records' ``column``, a ratio of
    sums over the records' ``ratio_of`` columns, and anything else as the mean of the drawn runs' values."""

    tag: ClassVar[str]
    output: ClassVar[Any]
    default: ClassVar[Any] = PydanticUndefined
    compared: ClassVar[Mapping[int | None, Use]] = {}
    name: ClassVar[str] = ""
    header: ClassVar[str] = ""
    unit: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = False
    absolute_margin: ClassVar[float | None] = None
    noise_family: ClassVar[str | None] = None
    caching_decides: ClassVar[bool] = False
    order: ClassVar[int] = 0
    column: ClassVar[str | None] = None  # a distribution over this record column
    ratio_of: ClassVar[tuple[str, str] | None] = None  # (numerator, denominator) record columns

    def compute(self, run: RunView) -> Any:
        raise NotImplementedError

    def cell_columns(self, value: Any) -> dict[str, Any]:
        return {}

    def statistic(self, value: Any, percentile: int | None) -> float | None:
        """The per-run statistic from this metric's validated summary entry: its percentile, or the scalar."""
        if percentile is not None:
            return None if value is None else getattr(value, f"p{percentile}")
        return value


_METRICS: dict[str, type[SummaryMetric]] = {}


def summary_metric(cls: type[SummaryMetric]) -> type[SummaryMetric]:
    """Register a metric under its ``tag``; summary.json lists metrics in registration order."""
    if cls.tag in _METRICS:
        raise ValueError(f"summary metric {cls.tag!r} is already registered by {_METRICS[cls.tag].__name__}")
    if not hasattr(cls, "output"):
        raise ValueError(f"summary metric {cls.__name__} ({cls.tag!r}) declares no output type")
    _METRICS[cls.tag] = cls
    return cls


@dataclass(frozen=True)
class Statistic:
    """One figure runs are compared on (a row of the A/B table, a metric of the stopping rule): one percentile
    of a distribution metric, or a scalar metric; everything but its name comes from its metric class."""

    name: str  # ttft_p50_s, output_tokens_per_s, hit_rate
    metric: type[SummaryMetric]
    percentile: int | None
    uses: Use

    @property
    def display(self) -> str:
        return self.metric.header if self.percentile is None else f"{self.metric.header} p{self.percentile}"

    @property
    def kind(self) -> Literal["percentile", "ratio", "per_run"]:
        """How the A/B engine pools it over several runs' records."""
        if self.percentile is not None:
            return "percentile"
        return "ratio" if self.metric.ratio_of is not None else "per_run"

    def per_run(self, summary: Any) -> float | None:
        """This statistic of one run, from its validated summary.json (``summary_file_model()``); None when the
        run did not measure it."""
        node = summary
        for part in self.metric.tag.split("."):
            node = getattr(node, part, None) if node is not None else None
        value = self.metric().statistic(node, self.percentile)
        return None if value is None else float(value)


_STATISTICS: dict[tuple[tuple[type[SummaryMetric], ...], Use | None], list[Statistic]] = {}


def compared_statistics(use: Use | None = None) -> list[Statistic]:
    """Every statistic of the registered metrics (those with ``use``, when given), in table order: by the
    metric's ``order``, then registration, then percentile. Derived from the registry as it is now (built once
    per registry state), so a metric registered later (or in a test) is in every list at once."""
    key = (tuple(_METRICS.values()), use)
    if key not in _STATISTICS:
        _STATISTICS[key] = _statistics(use)
    return list(_STATISTICS[key])


def _statistics(use: Use | None) -> list[Statistic]:
    stats = []
    ranked = sorted(enumerate(_METRICS.values()), key=lambda im: (im[1].order, im[0]))
    for _, metric in ranked:
        for q, uses in sorted(metric.compared.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            if q is not None and q not in PERCENTILES:
                raise ValueError(f"{metric.__name__}: p{q} is not among summary.json's percentiles {PERCENTILES}")
            if use is None or use in uses:
                stats.append(Statistic(metric.name.format(q=q), metric, q, uses))
    return stats


def compared_statistic(name: str) -> Statistic | None:
    """The registered statistic called ``name`` (None: no such statistic)."""
    return next((s for s in compared_statistics() if s.name == name), None)


# ---------------------------------------------------------------------------------------- request counts


class RequestCounts(_Block):
    sent: int
    in_window: int
    ok: int
    failed: int
    error_rate: float | None
    errors_by_class: dict[str, int]
    retries: int
    length_mismatch: int
    errors_by_status: dict[str, int]  # HTTP status (as a string: JSON keys) -> count


@summary_metric
class RequestCountsMetric(SummaryMetric):
    tag = "requests"
    output = RequestCounts

    def compute(self, run: RunView) -> dict[str, Any]:
        records, window, ok, failed = run.records, run.window, run.ok, run.failed
        return {
            "sent": int(len(records)),
            "in_window": int(len(window)),
            "ok": int(len(ok)),
            "failed": int(len(failed)),
            "error_rate": _ratio(len(failed), len(window)),
            "errors_by_class": {str(k): int(v) for k, v in failed["error_class"].value_counts().items()},
            "retries": int((records["attempt"] > 0).sum()) if len(records) else 0,
            "length_mismatch": int(ok["length_mismatch"].astype(bool).sum())
            if len(ok) and "length_mismatch" in ok else 0,
            "errors_by_status": {str(int(k)): int(v) for k, v in failed["http_status"].dropna().value_counts().items()},
        }

    def cell_columns(self, value: RequestCounts) -> dict[str, Any]:
        return {"requests": value.sent, "ok": value.ok, "failed": value.failed, "error_rate": value.error_rate}


@summary_metric
class DurationMetric(SummaryMetric):
    tag = "duration_s"
    output = float

    def compute(self, run: RunView) -> float:
        return run.duration_s

    def cell_columns(self, value: float) -> dict[str, Any]:
        return {"duration_s": value}


# -------------------------------------------------------------------------------------------- throughput


@summary_metric
class RequestThroughput(SummaryMetric):
    tag = "throughput.requests_per_s"
    output = float | None

    def compute(self, run: RunView) -> float | None:
        return _ratio(len(run.ok), run.duration_s)

    def cell_columns(self, value: float | None) -> dict[str, Any]:
        return {"req_per_s": value}


@summary_metric
class OutputTokenThroughput(SummaryMetric):
    tag = "throughput.output_tokens_per_s"
    output = float | None
    name, header, unit, higher_is_better = "output_tokens_per_s", "output throughput", "tokens/s", True
    noise_family, order = "throughput", 40
    compared = {None: Use.VERDICT | Use.SEQUENTIAL | Use.PIVOT | Use.FOREST | Use.SPREAD | Use.HEADLINE}

    def compute(self, run: RunView) -> float | None:
        return _ratio(float(run.ok["output_tokens"].sum()), run.duration_s)

    def cell_columns(self, value: float | None) -> dict[str, Any]:
        return {"output_tok_per_s": value}


@summary_metric
class PromptTokenThroughput(SummaryMetric):
    tag = "throughput.prompt_tokens_per_s"
    output = float | None

    def compute(self, run: RunView) -> float | None:
        return _ratio(float(run.ok["prompt_tokens"].sum()), run.duration_s)

    def cell_columns(self, value: float | None) -> dict[str, Any]:
        return {"prompt_tok_per_s": value}


# ----------------------------------------------------------------------------------------------- latency


class Percentiles(_Block):
    """Seconds; every figure is null when no successful request had the value."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None


class _LatencyMetric(SummaryMetric):
    """A latency distribution over successful requests (their ``column``, NaN left out): its percentiles, and
    four of them as cell columns (``ttft_p50_s`` … ``ttft_mean_s`` for ``latency.ttft_s``)."""

    output = Percentiles
    unit = "s"

    def compute(self, run: RunView) -> dict[str, float | None]:
        return _pcts(run.ok[self.column].to_numpy(float))

    def cell_columns(self, value: Percentiles) -> dict[str, Any]:
        name = self.tag.rsplit(".", 1)[-1][:-2]
        return {f"{name}_{q}_s": getattr(value, q) for q in ("p50", "p90", "p99", "mean")}


@summary_metric
class TimeToFirstToken(_LatencyMetric):
    tag, column = "latency.ttft_s", "ttft_s"
    name, header, noise_family, order = "ttft_p{q}_s", "TTFT", "ttft", 10
    compared = {50: Use.VERDICT | Use.SEQUENTIAL | Use.PIVOT | Use.FOREST | Use.SPREAD | Use.HEADLINE,
                90: Use.VERDICT | Use.SEQUENTIAL | Use.PIVOT | Use.FOREST,
                99: Use.VERDICT}


@summary_metric
class TimePerOutputToken(_LatencyMetric):
    tag, column = "latency.tpot_s", "tpot_s"
    name, header, noise_family, order = "tpot_p{q}_s", "TPOT", "tpot", 20
    compared = {50: Use.VERDICT | Use.SEQUENTIAL | Use.PIVOT | Use.FOREST | Use.SPREAD | Use.HEADLINE,
                90: Use.VERDICT | Use.SEQUENTIAL}


@summary_metric
class InterTokenLatency(_LatencyMetric):
    """Every gap between two streamed chunks (a list per request): not compared between runs, since the
    A/B engine's unit is the request."""

    tag = "latency.itl_s"
    header = "ITL"

    def compute(self, run: RunView) -> dict[str, float | None]:
        ok = run.ok
        return _pcts(np.concatenate([np.asarray(x, dtype=float) for x in ok["itl_s"]]) if len(ok) else np.zeros(0))


@summary_metric
class EndToEndLatency(_LatencyMetric):
    tag, column = "latency.e2e_s", "e2e_s"
    name, header, noise_family, order = "e2e_p{q}_s", "e2e", "e2e", 30
    compared = {50: Use.VERDICT | Use.SEQUENTIAL | Use.PIVOT | Use.FOREST | Use.SPREAD,
                90: Use.VERDICT | Use.SEQUENTIAL}


# ----------------------------------------------------------------------------------------------- goodput


class Goodput(_Block):
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    requests_meeting_slo: int
    fraction: float | None
    goodput_req_per_s: float | None


@summary_metric
class GoodputMetric(SummaryMetric):
    tag = "goodput"
    output = Goodput | None

    def compute(self, run: RunView) -> dict[str, Any] | None:
        return goodput(run.ok, run.duration_s, run.slo_ttft_ms, run.slo_tpot_ms)

    def cell_columns(self, value: Goodput | None) -> dict[str, Any]:
        if value is None:
            return {}
        return {"goodput_fraction": value.fraction, "goodput_req_per_s": value.goodput_req_per_s}


# --------------------------------------------------------------------------------------------- hit rates


class HitRates(_Block):
    """The hit rate three ways. `would_hit*` exist only when prefix caching is off (readers test for them)."""

    prompt_tokens: int
    server_cached_tokens: int
    predicted_cached_tokens: int
    server_per_request: float | None
    predicted: float | None
    metrics_counters: float | None
    metrics_hits: float | None
    metrics_queries: float | None
    predicted_minus_server: float | None
    server_minus_metrics: float | None
    requests_compared: int
    requests_predicted_exactly: int
    #: The model behind ``predicted*`` (``records.PREDICTORS``, ``mixed``, or None: nothing predicted) and
    #: why it, when that is not obvious; the calibration the scheduler model ran on.
    predictor: str | None = None
    predictor_note: str | None = None
    calibration: str | None = None
    predicted_exact_share: float | None = None
    #: The sequential simulator's figures (the online prediction), the same as the above when it predicts.
    sequential_predicted: float | None = None
    sequential_requests_predicted_exactly: int | None = None
    sequential_exact_share: float | None = None
    would_hit: float | None = None
    would_hit_cached_tokens: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _version_1(cls, data: Any) -> Any:
        """A summary of version 1 has no ``predictor``: every prediction then was the sequential simulator's."""
        if isinstance(data, dict) and "predictor" not in data:
            data = dict(data)
            compared, exact = data.get("requests_compared") or 0, data.get("requests_predicted_exactly")
            predicted = data.get("predicted") is not None or data.get("would_hit") is not None
            data.update(predictor="sequential" if predicted else None,
                        predicted_exact_share=exact / compared if compared and exact is not None else None,
                        sequential_predicted=data.get("predicted"), sequential_requests_predicted_exactly=exact,
                        sequential_exact_share=exact / compared if compared and exact is not None else None)
        return data

    @model_serializer(mode="wrap")
    def _drop_absent_would_hit(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if "would_hit" not in self.model_fields_set:
            out.pop("would_hit", None)
            out.pop("would_hit_cached_tokens", None)
        return out


@summary_metric
class HitRatesMetric(SummaryMetric):
    """Compared as the server's token-weighted hit rate (``server_per_request``): cached over prompt tokens of
    the requests whose cached tokens the server reported; a share, so compared by difference (0.5 points)."""

    tag = "hit_rate"
    output = HitRates
    name, header, unit, higher_is_better, order = "hit_rate", "hit rate", "share", True, 50
    absolute_margin, caching_decides, ratio_of = 0.005, True, ("cached_tokens", "prompt_tokens")
    compared = {None: Use.VERDICT | Use.SEQUENTIAL | Use.PIVOT | Use.HEADLINE}

    def compute(self, run: RunView) -> dict[str, Any]:
        return hit_rates(run.ok, run.deltas, run.prefix_caching, run.predictor_note, run.calibration)

    def cell_columns(self, value: HitRates) -> dict[str, Any]:
        return {"hit_server": value.server_per_request, "hit_metrics": value.metrics_counters,
                "hit_predicted": value.predicted, "would_hit": value.would_hit,
                "requests_predicted_exactly": value.requests_predicted_exactly,
                "requests_compared": value.requests_compared, "predictor": value.predictor,
                "hit_predicted_sequential": value.sequential_predicted,
                "requests_predicted_exactly_sequential": value.sequential_requests_predicted_exactly}

    def statistic(self, value: HitRates | None, percentile: int | None) -> float | None:
        return None if value is None else value.server_per_request


# ------------------------------------------------------------------------------------ speculative decoding


class Speculative(_Block):
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    acceptance_by_position: list[float | None] | None  # per draft position; null where not measured
    drafts: float | None
    weights_random: bool | None
    note: str | None


@summary_metric
class SpeculativeMetric(SummaryMetric):
    tag = "speculative"
    output = Speculative | None

    def compute(self, run: RunView) -> dict[str, Any] | None:
        deltas = run.deltas
        if not (deltas and deltas.get("spec_decode_num_drafts")):
            return None
        return {
            "acceptance_rate": deltas.get("spec_acceptance_rate"),
            "mean_acceptance_length": deltas.get("spec_mean_acceptance_length"),
            "acceptance_by_position": deltas.get("spec_acceptance_by_position"),
            "drafts": deltas.get("spec_decode_num_drafts"),
            "weights_random": run.weights_random,
            "note": ("random weights: greedy output repeats itself, so n-gram drafts are accepted far more often "
                     "than with a real model") if run.weights_random else None,
        }

    def cell_columns(self, value: Speculative | None) -> dict[str, Any]:
        return {"spec_acceptance_rate": value.acceptance_rate if value else None,
                "spec_mean_acceptance_length": value.mean_acceptance_length if value else None}


# ------------------------------------------------------------------------------------------ data quality


class DataQuality(_Block):
    """Whether a cell's latencies can be trusted (DataQualityMetric says how each is measured); `flags` names
    what is off."""

    burst_share: float | None  # answers of > 1 token whose tokens all arrived together (TTFT ≈ e2e)
    zero_gap_itl_share: float | None
    client_cpu_utilization: float | None
    client_saturated: bool
    scrape_interval_s: float | None  # asked for
    scrape_gap_s: float | None  # measured (median gap between scrapes)
    scrapes: int
    ttft_s_without_bursts: Percentiles
    tpot_s_without_bursts: Percentiles
    flags: list[str]
    #: Why the prefix cache was not emptied before the run (vLLM without VLLM_SERVER_DEV_MODE=1: HTTP 404),
    #: null when it was or no reset was asked; with it, flags holds "cache_not_reset".
    cache_not_reset: str | None = None


@summary_metric
class DataQualityMetric(SummaryMetric):
    """Can the cell's latencies be trusted? Burst deliveries (TTFT ≈ e2e), zero-gap ITLs, a saturated client,
    a /metrics series too coarse for the run, plus TTFT and TPOT percentiles without the burst answers.
    ``flags`` names what is off (empty: nothing seen)."""

    tag = "data_quality"
    output = DataQuality | None
    default = None  # absent in summaries written before it existed

    def compute(self, run: RunView) -> dict[str, Any]:
        ok = run.ok
        multi = ok[ok["output_tokens"] > 1] if len(ok) else ok
        abs_tol, rel_tol = BURST_TOLERANCE
        gap = (multi["e2e_s"] - multi["ttft_s"]).to_numpy(float) if len(multi) else np.zeros(0)
        burst = gap <= abs_tol + rel_tol * multi["e2e_s"].to_numpy(float) if len(multi) else np.zeros(0, bool)
        itl = np.concatenate([np.asarray(x, dtype=float) for x in ok["itl_s"]]) if len(ok) else np.zeros(0)
        steady = multi[~burst] if len(multi) else multi
        scrape_gaps = np.diff(np.unique(np.asarray(run.scrape_times_s, float)))
        scrape_gap_s = float(np.median(scrape_gaps)) if len(scrape_gaps) else None
        out: dict[str, Any] = {
            "burst_share": _ratio(int(burst.sum()), len(multi)),
            "zero_gap_itl_share": _ratio(int((itl < ZERO_GAP_ITL_S).sum()), len(itl)),
            "client_cpu_utilization": run.client_cpu_utilization,
            "client_saturated": bool(run.client_cpu_utilization is not None
                                     and run.client_cpu_utilization > CLIENT_SATURATED_CPU_SHARE),
            "scrape_interval_s": run.scrape_interval_s,
            "scrape_gap_s": scrape_gap_s,
            "scrapes": int(len(run.scrape_times_s)),
            "ttft_s_without_bursts": _pcts(steady["ttft_s"].to_numpy(float) if len(steady) else np.zeros(0)),
            "tpot_s_without_bursts": _pcts(steady["tpot_s"].dropna().to_numpy(float) if len(steady)
                                           else np.zeros(0)),
            "cache_not_reset": run.cache_not_reset,
        }
        flags = []
        if (out["burst_share"] or 0) > 0.2:
            flags.append("burst_deliveries")
        if (out["zero_gap_itl_share"] or 0) > 0.2:
            flags.append("zero_gap_itls")
        if out["client_saturated"]:
            flags.append("client_saturated")
        if run.client_stalls:
            flags.append("client_stalls")  # the client was held up: see summary.json client.stall_windows_s
        if run.cache_not_reset:
            flags.append("cache_not_reset")  # a warm cache: predicted != measured hits, TTFTs those of a warm cache
        if run.duration_s and (scrape_gap_s is None or run.duration_s / scrape_gap_s < 5):
            flags.append("coarse_metrics_scrapes")  # fewer than 5 scrapes over the run: no time series to read
        out["flags"] = flags
        return out


@summary_metric
class ServerDeltas(SummaryMetric):
    """Counter deltas from /metrics, one key per series the metrics watcher reconciles: which ones exist
    depends on the vLLM version and the features on, so the block is open."""

    tag = "server_deltas"
    output = dict[str, Any] | None

    def compute(self, run: RunView) -> dict[str, Any] | None:
        return run.deltas or None


# ----------------------------------------------------------------------------- the rest of summary.json


#: A client stall: the replay's event loop woke up this much later than asked (its own work, or a host that did
#: not run the process), so sessions waited and tokens that arrived meanwhile were timestamped late.  The replay
#: measures it (``harness/replay/run_state.StallProbe``), the console and the report caveat quote it.
CLIENT_STALL_S = 0.1


#: summary.json's version. 2 added the predictor to ``hit_rate`` (``predictor``, ``sequential_*``, …);
#: a version-1 file is read with the sequential simulator as its predictor (``HitRates._version_1``).
SUMMARY_VERSION = 2

_MODELS: dict[tuple[tuple[type[SummaryMetric], ...], tuple[str, ...]], type[VersionedFile]] = {}


def summary_file_model() -> type[VersionedFile]:
    """The ``kvscope-summary`` file model of the metrics registered now: one field per metric at its tag
    (dotted tags become nested blocks: ``throughput``, ``latency``), then the run's own entries. Built once
    per registry state; the run's own entries are the registered parts (``summary_parts``)."""
    key = (tuple(_METRICS.values()), tuple(p.name for p in registered_parts()))
    if key not in _MODELS:
        tree: dict[str, Any] = {}
        for tag, metric in _METRICS.items():
            *parents, leaf = tag.split(".")
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = (metric.output, metric.default)
        fields = {name: _field(name, v) for name, v in tree.items()}
        _MODELS[key] = create_model(  # type: ignore[call-overload]
            "SummaryFile", __base__=VersionedFile, __module__=__name__,
            FORMAT=(ClassVar[str], "kvscope-summary"), SUPPORTED_VERSIONS=(ClassVar[tuple[int, ...]], (1, 2)),
            format=(Literal["kvscope-summary"], "kvscope-summary"), version=(int, SUMMARY_VERSION), **fields,
            **part_fields())
    return _MODELS[key]


def _field(name: str, v: Any) -> tuple[Any, Any]:
    if isinstance(v, tuple):
        return v
    block = create_model(name.title().replace("_", ""), __base__=_Block, __module__=__name__,  # type: ignore[call-overload]
                         **{k: _field(k, sub) for k, sub in v.items()})
    return block, Field(...)


def cell_columns(summary: Any) -> dict[str, Any]:
    """The columns every registered metric adds to a cell's row in ``load_results(...).cells``, from a
    validated summary (a metric missing from it adds none)."""
    row: dict[str, Any] = {}
    for tag, metric in _METRICS.items():
        node = summary
        for part in tag.split("."):
            node = getattr(node, part, None) if node is not None else None
        row.update(metric().cell_columns(node))
    return row


def summarize(records: pd.DataFrame, deltas: dict[str, Any], duration_s: float, prefix_caching: bool | None,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              weights_random: bool | None = None, client_cpu_utilization: float | None = None,
              client_stalls: int | None = None, cache_not_reset: str | None = None,
              scrape_times_s: tuple[float, ...] = (), scrape_interval_s: float | None = None,
              predictor_note: str | None = None, calibration: str | None = None,
              parts: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The summary.json body: every registered metric at its tag, then (given ``parts``: the run's values of
    the registered summary parts, ``summary_parts``) every part, validated against its type. Latency and hit
    statistics use successful requests inside the window."""
    window = records[records["in_window"].astype(bool)] if len(records) else records
    run = RunView(records=records, window=window, ok=window[window["error_class"].isna()],
                  failed=window[window["error_class"].notna()], deltas=deltas, duration_s=duration_s,
                  prefix_caching=prefix_caching, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                  weights_random=weights_random, client_cpu_utilization=client_cpu_utilization,
                  client_stalls=client_stalls, cache_not_reset=cache_not_reset,
                  scrape_times_s=tuple(scrape_times_s), scrape_interval_s=scrape_interval_s,
                  predictor_note=predictor_note, calibration=calibration)
    summary: dict[str, Any] = {}
    for tag, metric in _METRICS.items():
        *parents, leaf = tag.split(".")
        node = summary
        for part in parents:
            node = node.setdefault(part, {})
        value = metric().compute(run)
        node[leaf] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    if parts is not None:
        summary.update(assemble_parts(parts))
    return _clean(summary)


def _clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return nan_to_none(x, infinite=True)
    if isinstance(x, np.generic):
        return _clean(x.item())
    return x
