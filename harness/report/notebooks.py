"""The notebook registry: every report notebook, its title, the figures it writes, its parameters, its place.

Adding a notebook is ``notebooks/NAME.ipynb`` plus one :class:`Notebook` entry in :data:`NOTEBOOKS`. The report
runner (:mod:`kvscope.harness.report.render`) takes from here which notebooks exist and in what order they run
and are listed, which parameters each accepts (extra parameters are checked against them), the parameters an
experiment's spec gives each one (its SLOs, its pricing), and which figures the index shows.
``tests/test_notebook_registry.py`` checks every entry against its ``.ipynb`` (the parameters cell and the
figure names it saves), so the registry cannot drift from the notebooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvscope.harness.results.schemas import ExperimentSpecCore

SpecParameters = Callable[[ExperimentSpecCore], dict[str, Any]]
"""From an experiment's validated spec (as experiment.json records it, defaults included) to this notebook's
parameters."""

COMMON_PARAMETERS = ("experiment_dir", "figures_dir")
"""Every notebook accepts these; the runner sets them."""


def _no_spec_parameters(spec: ExperimentSpecCore) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Notebook:
    name: str  # notebooks/<name>.ipynb
    title: str
    figures: tuple[str, ...]  # <figures_dir>/<figure>.png it writes
    parameters: tuple[str, ...] = ()  # parameters besides COMMON_PARAMETERS
    key_figures: tuple[str, ...] = ()  # figures shown on the report's index page
    from_spec: SpecParameters = field(default=_no_spec_parameters, compare=False)
    relative_cost: float = 1.0  # execution time relative to a typical notebook: the report starts costly ones first

    def accepts(self, parameter: str) -> bool:
        return parameter in COMMON_PARAMETERS or parameter in self.parameters


def _latency_from_spec(spec: ExperimentSpecCore) -> dict[str, Any]:
    slo = {"slo_ttft_ms": spec.slo.ttft_ms, "slo_tpot_ms": spec.slo.tpot_ms}
    return {name: float(value) for name, value in slo.items() if value is not None}


def _cost_from_spec(spec: ExperimentSpecCore) -> dict[str, Any]:
    return {"pricing": list(spec.cost.pricing), "gpu_hourly_usd": float(spec.cost.gpu_hourly_usd)}


NOTEBOOKS: tuple[Notebook, ...] = (
    Notebook("primer", "Primer: KV caching, prompt caching and inference economics",
             figures=("kv_growth", "speculation_curves")),
    Notebook("hit_rates", "Prefix-cache hit rates: predicted vs measured",
             figures=("hit_rate_by_workload", "hit_rate_by_step", "hit_rate_by_session", "recomputed_by_transition"),
             key_figures=("hit_rate_by_workload", "hit_rate_by_step")),
    Notebook("concurrency", "Concurrency and KV-cache memory",
             figures=("latency_throughput", "ttft_vs_load", "sweep_ttft_vs_load", "predicted_vs_measured", "footprint",
                      "kv_usage_over_time",
                      "running_over_time"),
             parameters=("knee_factor",), key_figures=("latency_throughput", "predicted_vs_measured")),
    Notebook("latency", "Latency: TTFT, TPOT, ITL and end-to-end",
             figures=("latency_ecdf", "itl_ecdf", "ttft_vs_cache", "ttft_by_load"),
             parameters=("slo_ttft_ms", "slo_tpot_ms", "bandwidth_gb_s", "weight_bytes"),
             key_figures=("latency_ecdf",), from_spec=_latency_from_spec, relative_cost=2.0),
    Notebook("cost", "Cost: provider prompt caching and self-hosting",
             figures=("provider_cost_per_session", "habit_cost", "ttl_sensitivity"),
             parameters=("pricing", "gpu_hourly_usd"), key_figures=("provider_cost_per_session",),
             from_spec=_cost_from_spec),
    Notebook("speculative", "Speculative decoding: does it pay off for this traffic?",
             figures=("acceptance_and_tpot", "acceptance_by_position", "predicted_by_method",
                      "predicted_acceptance_by_position"), key_figures=("acceptance_and_tpot",)),
    # One attribution per workload trace, not per cell: cheap (a few simulator passes over each trace).
    Notebook("explain", "Explain: why each prompt missed the prefix cache",
             figures=("recomputed_by_cause", "what_if_hit_rate"), key_figures=("recomputed_by_cause",),
             relative_cost=0.5),
    Notebook("ab_compare", "A/B comparison on identical traffic",
             figures=("forest_relative_changes", "repeat_spread", "paired_differences"),
             key_figures=("forest_relative_changes",),
             parameters=("run_a", "run_b", "label_a", "label_b", "resamples"), relative_cost=5.0),
)
"""Every report notebook, in the order the report runs and lists them."""

BY_NAME: dict[str, Notebook] = {nb.name: nb for nb in NOTEBOOKS}
ALL_NOTEBOOKS: list[str] = [nb.name for nb in NOTEBOOKS]
