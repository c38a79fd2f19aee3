"""Experiment specs: server configurations × workloads × load levels × repeats, in one YAML file.

A spec names everything an experiment needs so that a run is reproducible from the file alone: the model
(built locally, a local directory, or a Hugging Face id), named server configurations (overrides of one
base config), workloads (presets or spec files with overrides), load levels, repeats, SLOs and pricing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_serializer, model_validator

from kvscope.harness.analysis.capacity import TtftSlo, parse_ttft_slo
from kvscope.harness.common.errors import ConfigError, format_validation_error, load_yaml_mapping
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.results.schemas import CostSpec, ExperimentSpecCore, SloSpec
from kvscope.harness.serving.backend import Backend, split_backend

if TYPE_CHECKING:
    from kvscope.harness.cachemodel.gpu_predict import ServerSettings

__all__ = ["PREDICTED_SLO_TPOT_P50_MS", "PREDICTED_SLO_TTFT_P90_MS", "SERVES_FIELD", "CostSpec", "ExecutorSpec", "ExperimentSpec",
           "LoadLevel", "ModelSpec", "PredictedConfig", "PredictedSpec", "RepeatsSpec", "ReplaySettings", "SloSpec",
           "SweepSpec", "WorkloadRef", "check_name", "client_resources", "load_experiment_spec", "server_resources",
           "sweep_level"]

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(v: str, what: str) -> str:
    """Names become directory names: no separators, no '..', nothing that escapes the results folder."""
    if not NAME_RE.match(v) or ".." in v:
        raise ValueError(f"{what} {v!r} must be 1-64 letters, digits, '_', '-' or '.', starting with a letter "
                         "or digit (it becomes a directory name)")
    return v


class ModelSpec(BaseModel):
    """``model:`` (every server's, unless it names another) or one of ``models:`` (a server's ``serves:``)."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["tiny", "path", "hf"] = Field("tiny", description="tiny: build kvscope's model; path: a "
                                                                       "local HF directory; hf: a hub id")
    path: str = Field("models/tiny", description="tiny: where to build it; path: the directory; hf: the id")
    served_model_name: str = "tiny"
    seed: int = 0
    train_steps: int = Field(0, ge=0, description="tiny only: brief training so speculation means something")
    size: Literal["small", "large"] = Field("small", description="tiny only: kvscope model build-tiny --size "
                                                                  "(large: 8 layers of width 512, same tokenizer)")
    tokenizer: str | None = Field(None, description="directory with tokenizer.json for workload generation "
                                                    "(default: the model directory)")
    pricing: str | None = Field(None, description="this model's provider price preset (kvscope cost presets) or "
                                                  "preset YAML, where models are priced apart (model routing)")
    gpu_hourly_usd: float | None = Field(None, gt=0, description="or: this model's self-hosted $/GPU-hour")

    @field_validator("pricing")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None:
            CostSpec(pricing=[v])  # one rule for known presets: the cost section's
        return v

    @model_validator(mode="after")
    def _one_price(self) -> "ModelSpec":
        if self.pricing is not None and self.gpu_hourly_usd is not None:
            raise ValueError("give a model pricing (a provider preset) or gpu_hourly_usd (self-hosted), not both")
        if self.size != "small" and self.source != "tiny":
            raise ValueError(f"size {self.size}: only for source tiny (kvscope builds that model)")
        return self


class WorkloadRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: str = Field(description="a preset name (kvscope workload presets) or a spec file path")
    scale: float | None = Field(None, gt=0)
    output_scale: float | None = Field(None, gt=0, description="multiplies output sizes instead of scale")
    sessions: int | None = Field(None, gt=0)
    seed: int | None = None
    max_context: int | None = Field(None, gt=0, description="end sessions before exceeding this many tokens")
    sweep_only: bool = Field(False, description="run this workload only in the sweep, not in the grid of loads "
                                                "x repeats (a sweep needs as many sessions as its top level)")


class LoadLevel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    concurrency: int | None = Field(None, gt=0)
    session_rate: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _exactly_one(self) -> "LoadLevel":
        if (self.concurrency is None) == (self.session_rate is None):
            raise ValueError("a load level sets exactly one of concurrency or session_rate")
        if self.name is None:
            self.name = f"c{self.concurrency}" if self.concurrency else f"r{self.session_rate:g}"
        check_name(self.name, "load level name")
        return self


class SweepSpec(BaseModel):
    """A load sweep to saturation, run after the grid: closed-loop concurrency or open-loop session rate.
    ``plan: predicted`` (the default) measures the levels the scheduler model's curve says decide the capacity
    (the unloaded level, the last predicted-passing level, the predicted edge and one above), then searches
    toward the measured edge where it differs; ``plan: ladder`` climbs ``levels`` in ascending order until the
    TTFT p90 SLO breaks or the server preempts, and `adaptive` skips the levels above the first failure and
    bisects between the last passing level and it. A sweep the model cannot predict (speculative decoding,
    session rates, ``predict: false``, a failed calibration) climbs the ladder."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["concurrency", "session_rate"] = "concurrency"
    levels: list[float] = Field(min_length=2, description="loads to try, e.g. [1, 2, 4, 8, 16]")
    slo_ttft_p90: str | None = Field(None, description="the TTFT p90 objective relative to the server's own "
                                                       "unloaded latency, e.g. 3x_unloaded: 3 times the lowest "
                                                       "level's TTFT p90 (or milliseconds, e.g. 250ms)")
    slo_ttft_p90_ms: float | None = Field(None, gt=0, description="an absolute TTFT p90 objective in ms; a level "
                                                                  "meets the SLO when its TTFT p90 is at most the "
                                                                  "objective and it caused no preemption")
    plan: Literal["predicted", "ladder"] = Field(
        "predicted", description="predicted: measure the levels the scheduler model's curve (every concurrency "
                                 "from the lowest to the highest level) says decide the capacity, then search "
                                 "toward the measured edge; ladder: climb `levels` in order")
    adaptive: bool = Field(True, description="ladder: stop at the first failing level, then bisect below it "
                                             "(false: measure every level)")
    max_bisections: int = Field(3, ge=0, le=20, description="extra levels between pass and fail: bisections of the "
                                                            "ladder, or the predicted plan's search")
    servers: list[str] | None = Field(None, description="configurations to sweep (default: all)")
    workloads: list[str] | None = Field(None, description="workloads to sweep (default: all)")
    predict: bool = Field(True, description="calibrate each swept vLLM configuration just before its sweep (a few "
                                            "dozen requests) and record the scheduler model's predicted curve "
                                            "and capacity beside the measured ones (concurrency sweeps)")

    @field_validator("levels")
    @classmethod
    def _levels(cls, v: list[float]) -> list[float]:
        if any(x <= 0 for x in v) or len(set(v)) != len(v):
            raise ValueError(f"levels must be distinct and > 0, got {v}")
        return sorted(v)

    @field_validator("slo_ttft_p90", mode="before")
    @classmethod
    def _slo_text(cls, v: Any) -> Any:
        return None if v is None else parse_ttft_slo(v).text

    @model_validator(mode="after")
    def _integer_concurrency(self) -> "SweepSpec":
        if self.kind == "concurrency" and any(x != int(x) for x in self.levels):
            raise ValueError(f"concurrency levels must be whole numbers, got {self.levels}")
        if not self.adaptive:  # every level measured: a fixed grid, not a plan
            if self.plan == "predicted" and "plan" in self.model_fields_set:
                raise ValueError("plan: predicted chooses its own levels; adaptive: false measures every level: "
                                 "drop one")
            self.plan = "ladder"
        if (self.slo_ttft_p90 is None) == (self.slo_ttft_p90_ms is None):
            raise ValueError("a sweep sets exactly one of slo_ttft_p90 (e.g. 3x_unloaded) or slo_ttft_p90_ms "
                             "(e.g. 250)")
        slo = parse_ttft_slo(self.slo_ttft_p90) if self.slo_ttft_p90 is not None else None
        if slo is not None and slo.ms is not None:  # '250ms': recorded as the absolute field
            self.slo_ttft_p90, self.slo_ttft_p90_ms = None, slo.ms
        return self

    @property
    def ttft_slo(self) -> TtftSlo:
        """The objective, absolute or relative to the unloaded TTFT p90 (resolved per sweep)."""
        if self.slo_ttft_p90 is not None:
            return parse_ttft_slo(self.slo_ttft_p90)
        return TtftSlo(ms=self.slo_ttft_p90_ms)


#: The "On your GPU" SLO where neither ``predicted:`` nor an absolute sweep SLO gives one: an interactive
#: agent's first token within 2 s at p90, and 10 tokens/s per stream (TPOT p50 <= 100 ms).
PREDICTED_SLO_TTFT_P90_MS = 2000.0
PREDICTED_SLO_TPOT_P50_MS = 100.0


class PredictedConfig(BaseModel):
    """One predicted deployment: a GPU preset x a model (bundled name or config.json) x vLLM's server settings
    (`kvscope predict`'s flags of the same names; unset: vLLM's GPU defaults)."""

    model_config = ConfigDict(extra="forbid")

    gpu: str = Field(description="GPU preset id or alias (kvscope predict --list), e.g. h100-sxm")
    model: str = Field(description="bundled model name (e.g. llama-3.1-8b) or a local config.json path")
    tp: int = Field(1, gt=0, description="tensor-parallel size")
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = Field(0.92, gt=0, le=1)
    gpu_hour_usd: float | None = Field(None, gt=0, description="price per GPU-hour (default: the GPU's first "
                                                               "preset in pricing/gpu_prices.yaml)")
    provider: str | None = Field(None, description="which provider's GPU-hour price preset to use")

    @model_validator(mode="after")
    def _known(self) -> "PredictedConfig":
        """Unknown GPU, model, dtype, price or a TP that does not divide the heads or fit: refused at spec
        load, before any server starts (the plan is the same arithmetic the prediction runs)."""
        from kvscope.harness.cachemodel.gpu_predict import plan_deployment  # deferred: the GPU prediction stack loads only for specs with predicted:
        from kvscope.harness.cachemodel.kv_memory import dtype_bytes  # deferred: the GPU prediction stack loads only for specs with predicted:
        from kvscope.harness.pricing.gpu_cost import gpu_hour_price  # deferred: the GPU prediction stack loads only for specs with predicted:

        if self.kv_cache_dtype != "auto":
            dtype_bytes(self.kv_cache_dtype)
        dep = plan_deployment(self.gpu, self.model, tp=self.tp, settings=self.settings())
        if self.provider and self.gpu_hour_usd is None and gpu_hour_price(dep.gpu.key, self.provider) is None:
            raise ValueError(f"provider {self.provider!r}: no GPU-hour price for {dep.gpu.key} in "
                             "pricing/gpu_prices.yaml")
        return self

    def settings(self) -> "ServerSettings":
        from kvscope.harness.cachemodel.gpu_predict import ServerSettings  # deferred: the GPU prediction stack loads only for specs with predicted:

        base = ServerSettings()
        return ServerSettings(max_num_seqs=self.max_num_seqs or base.max_num_seqs,
                              max_num_batched_tokens=self.max_num_batched_tokens or base.max_num_batched_tokens,
                              kv_cache_dtype=self.kv_cache_dtype, gpu_memory_utilization=self.gpu_memory_utilization)


#: Bounds of ``predicted.sessions``: a GPU's capacity is in the tens to hundreds of agent sessions, and each
#: load level simulates the whole prediction trace, so the phase's time grows with it.
PREDICTED_SESSIONS_DEFAULT = 128
PREDICTED_SESSIONS_MAX = 1024


class PredictedSpec(BaseModel):
    """Deployments predicted (not measured) after the live phases, for the report's "On your GPU" section beside
    the CPU measurements. Closed loop: the load curve runs over concurrency (the number of agent sessions at once).

    Why a prediction trace of its own (each workload's spec, seed and scales with ``sessions`` sessions) rather
    than the live cells' trace: a CPU run drives a handful of sessions, and a closed loop cannot load a GPU with
    more sessions than its trace has -- the capacity would read "at least all of them" and the eviction cliff
    would never be reached. The prediction runs on the CPU in seconds, so it can afford the sessions a GPU holds."""

    model_config = ConfigDict(extra="forbid")

    configs: dict[str, PredictedConfig] = Field(description="named deployments, e.g. {h100-8b: {gpu: h100-sxm, "
                                                            "model: llama-3.1-8b}}")
    workloads: list[str] | None = Field(None, description="workloads to predict (default: the grid's, i.e. every "
                                                          "workload that is not sweep_only)")
    sessions: int = Field(PREDICTED_SESSIONS_DEFAULT, ge=1, le=PREDICTED_SESSIONS_MAX,
                          description="sessions in each workload's prediction trace (its spec, seed and scales with "
                                      "this many sessions; the load curve cannot drive more)")
    scale: float | None = Field(None, gt=0, description="the prediction traces' prompt scale (default: each "
                                                        "workload's own; a CPU run's small scale gives contexts "
                                                        "a GPU's KV pool never fills)")
    max_context: int | None = Field(None, gt=0, description="end the prediction traces' sessions before this many "
                                                            "tokens (default: each workload's own max_context, "
                                                            "which a CPU run often sets for its small server)")
    levels: list[int] | None = Field(None, description="concurrency levels of the load curve (default 1, 2, 4, "
                                                       "... up to `sessions`, stopping once a level is past both "
                                                       "the SLO capacity and the eviction cliff)")
    slo_ttft_p90_ms: float | None = Field(None, gt=0, description="default: the sweep's absolute SLO, else "
                                                                  f"{PREDICTED_SLO_TTFT_P90_MS:g} ms")
    slo_tpot_p50_ms: float = Field(PREDICTED_SLO_TPOT_P50_MS, gt=0)

    @field_validator("configs")
    @classmethod
    def _configs(cls, v: dict[str, PredictedConfig]) -> dict[str, PredictedConfig]:
        if not v:
            raise ValueError("at least one predicted configuration is needed")
        for k in v:
            check_name(k, "predicted configuration name")
            if k == "traces":  # predictions/traces/ holds the prediction traces
                raise ValueError("predicted configuration name 'traces' is reserved (predictions/traces/ holds "
                                 "the prediction traces); choose another")
        return v

    @field_validator("levels")
    @classmethod
    def _levels(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(x <= 0 for x in v) or sorted(set(v)) != v):
            raise ValueError(f"levels: give increasing positive concurrencies, e.g. [1, 2, 4, 8]; got {v}")
        return v


class ExecutorSpec(BaseModel):
    """How a distributed executor (``kvscope experiment run --executor ray``) places and ships work; the local
    executor ignores it. Per-configuration resources are ``servers.<name>.resources``; the node that replays a
    configuration's cells, where not beside its server, ``servers.<name>.client_resources``."""

    model_config = ConfigDict(extra="forbid")

    files: Literal["auto", "shared", "ship"] = Field(
        "auto", description="shared: workers write cells straight into the experiment directory (a filesystem "
                            "every node mounts at the same path); ship: workers write to a local scratch "
                            "directory and send each finished cell back to the driver; auto: shared where the "
                            "worker sees the driver's run directory, ship elsewhere")
    actor_cpus: float = Field(1.0, ge=0, description="CPUs each configuration's actor reserves (its replay client "
                                                     "runs there, beside the server), and each client actor "
                                                     "whose client_resources name no CPU")


ResourceMap = dict[str, float]
_RESOURCES = TypeAdapter(ResourceMap)


PLACEMENT_FIELDS = ("resources", "client_resources")
"""Server-entry fields that say where a configuration runs (an executor's concern), not server config fields."""

SERVES_FIELD = "serves"
"""Server-entry field naming the ``models:`` entry the configuration serves (absent: ``model:``); the model's
path and served name then go into the server config, as ``model:``'s do for the others."""


def _check_resources(name: str, raw: Any, key: str = "resources") -> ResourceMap:
    """`servers.<name>.<key>`: Ray resource names (`GPU`, `CPU` or custom, e.g. `gpu_slot`) to amounts >= 0."""
    try:
        resources = _RESOURCES.validate_python(raw)
    except ValidationError as exc:
        raise ValueError(f"servers.{name}.{key}: expected a mapping of Ray resource names to amounts, "
                         f"e.g. {{GPU: 2}} or {{gpu_slot: 1}}; got {raw!r}") from exc
    bad = [k for k, v in resources.items() if v < 0]
    if bad:
        raise ValueError(f"servers.{name}.{key}: amounts must be >= 0, got {', '.join(bad)}")
    return resources


def server_resources(spec: "ExperimentSpec", name: str) -> ResourceMap | None:
    """The Ray resources configuration `name` states (`servers.<name>.resources`), or None: then the executor
    derives them from the server config (GPUs = tensor x pipeline x data parallel size)."""
    raw = (spec.servers[name] or {}).get("resources")
    return None if raw is None else _check_resources(name, raw)


def client_resources(spec: "ExperimentSpec", name: str) -> ResourceMap | None:
    """The Ray resources that select the node replaying configuration `name`'s cells
    (`servers.<name>.client_resources`), or None: the client runs beside the server, in its actor."""
    raw = (spec.servers[name] or {}).get("client_resources")
    return None if raw is None else _check_resources(name, raw, "client_resources")


def sweep_level(kind: str, load: float) -> LoadLevel:
    """The load level of one sweep cell: named `sweep-c4` or `sweep-r0.5` (apart from the grid's names)."""
    if kind == "concurrency":
        return LoadLevel(name=f"sweep-c{int(load)}", concurrency=int(load))
    return LoadLevel(name=f"sweep-r{load:g}", session_rate=load)


PER_CELL_OPTIONS = {"concurrency": "loads", "session_rate": "loads", "seed": "the repeat index",
                    "slo_ttft_ms": "slo.ttft_ms", "slo_tpot_ms": "slo.tpot_ms", "model": "the server configuration",
                    "progress": "the experiment",
                    "reset_prefix_cache": "the experiment (it resets before each cell)",
                    "calibration": "the experiment (calibrations/<server>.json, where a sweep calibrated the "
                                   "server)"}
"""ReplayOptions fields that the experiment sets per cell, and where the spec sets them instead."""


class ReplaySettings(ReplayOptions):
    """An experiment's ``replay:`` section: any :class:`ReplayOptions` field with the same default (one model,
    so library, CLI and experiments agree), minus those set per cell, plus the experiment's warm-up."""

    warmup_requests: int = Field(2, ge=0, description="unrelated requests sent before each cell, on a server "
                                                      "process's first cell on top of those that write every KV "
                                                      "block once; then the prefix cache is reset")
    warmup_pass: bool = Field(False, description="replay each cell's trace once, unrecorded, before measuring it: "
                                                 "CPU kernels specialise per shape, so a first pass is slower; "
                                                 "use it to compare repeats of one configuration")

    @model_validator(mode="before")
    @classmethod
    def _no_per_cell_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in data:
                if name in PER_CELL_OPTIONS:
                    raise ValueError(f"{name} is set per cell by {PER_CELL_OPTIONS[name]}, not in replay:")
        return data

    @model_serializer(mode="wrap")
    def _dump_without_per_cell_fields(self, handler: Any) -> Any:
        """experiment.json records what the section can hold: the per-cell fields are not among them."""
        data = handler(self)
        for name in PER_CELL_OPTIONS:
            data.pop(name, None)
        return data

    def cell_options(self, **per_cell: Any) -> ReplayOptions:
        """The ReplayOptions of one cell: these settings plus the per-cell fields."""
        unknown = set(per_cell) - set(PER_CELL_OPTIONS)
        if unknown:
            raise ValueError(f"not per-cell replay options: {sorted(unknown)}")
        shared = self.model_dump(exclude={"warmup_requests", "warmup_pass", *PER_CELL_OPTIONS})
        return ReplayOptions(**shared, **per_cell)


# Each cell is at least one replay; past these bounds a spec is a typo (repeats: 10**12 hung `experiment cells`).
MAX_REPEATS = 1000
MAX_CELLS = 10_000


class RepeatsSpec(BaseModel):
    """``repeats: N`` (N runs of every cell) or ``repeats: {max: 5, min: 2, stop_early: true}``: up to `max`
    repeats, and with `stop_early` the runner looks after each round from `min` on and stops a workload x load
    group once every verdict it asks for is decided (kvscope.harness.analysis.sequential: a group-sequential
    test whose error rate holds under the repeated looks). The verdicts asked for: every configuration against
    `baseline` on each of `metrics`."""

    model_config = ConfigDict(extra="forbid")

    max: int = Field(3, ge=1, le=MAX_REPEATS, description="runs of every configuration x workload x load "
                                                          "(at most, with stop_early)")
    min: int | None = Field(None, ge=2, description="stop_early: the first look, after this many repeats "
                                                   "(default 2)")
    stop_early: bool = Field(False, description="stop once every requested verdict is decided (needs "
                                                "servers_up: all and two or more configurations)")
    baseline: str | None = Field(None, description="stop_early: the configuration the others are compared with "
                                                   "(default: the first)")
    metrics: list[str] = Field(default_factory=lambda: ["ttft_p50_s", "output_tokens_per_s"],
                               description="stop_early: per-repeat metrics each comparison decides on")
    alpha: float = Field(0.05, gt=0, lt=0.5, description="stop_early: each verdict's error rate over all looks")
    spending: Literal["obrien-fleming", "pocock"] = Field(
        "obrien-fleming", description="stop_early: the alpha-spending function (obrien-fleming spends little at "
                                      "the first looks and keeps the last look's level close to alpha; pocock "
                                      "spends evenly)")

    @model_validator(mode="before")
    @classmethod
    def _from_int(cls, data: Any) -> Any:
        if isinstance(data, int) and not isinstance(data, bool):
            return {"max": data}
        return data

    @model_validator(mode="after")
    def _looks(self) -> "RepeatsSpec":
        # deferred: it loads scipy, which importing this module must not
        from kvscope.harness.analysis.sequential import MAX_LOOKS, sequential_metrics

        if self.stop_early:
            first = 2 if self.min is None else self.min
            if not 2 <= first <= self.max <= MAX_LOOKS:
                raise ValueError(f"stop_early needs 2 <= min <= max <= {MAX_LOOKS}, got min {first}, max {self.max}")
            known = sequential_metrics()
            unknown = [m for m in self.metrics if m not in known]
            if unknown or not self.metrics:
                raise ValueError(f"repeats.metrics: unknown {', '.join(unknown) or '(none given)'}; known: "
                                 f"{', '.join(known)}")
        return self

    @property
    def first_look(self) -> int:
        return 2 if self.min is None else self.min

    @model_serializer(mode="wrap")
    def _plain_count(self, handler: Any) -> Any:
        """A plain count is recorded as the number it was written as (experiment.json keeps its shape)."""
        data = handler(self)
        return self.max if not self.stop_early and not (self.model_fields_set - {"max"}) else data

    def __int__(self) -> int:
        return self.max


class ExperimentSpec(ExperimentSpecCore):
    """The whole spec. Name, description, notebooks, `slo` and `cost` come from `ExperimentSpecCore` (results
    layer), the part that experiment.json records for reports; the rest only the runner reads."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSpec = Field(default_factory=ModelSpec)
    models: dict[str, ModelSpec] = Field(default_factory=dict, description="more models by name, each served by "
                                         "the configurations whose `serves:` names it (an A/B of models, model "
                                         "routing); they must share model:'s tokenizer")
    server_defaults: dict[str, Any] = Field(default_factory=dict,
                                            description="server config fields shared by every configuration")
    servers: dict[str, dict[str, Any]] = Field(description="named configurations: overrides of server_defaults; "
                                                           "`backend:` picks the engine (vllm, the default, or "
                                                           "openai for an endpoint kvscope does not start)")
    workloads: dict[str, WorkloadRef]
    loads: list[LoadLevel] = Field(default_factory=lambda: [LoadLevel(concurrency=1)])
    repeats: RepeatsSpec = Field(default_factory=RepeatsSpec,
                                 description="runs of every configuration x workload x load: a count, or "
                                             "{max, min, stop_early, …} to stop once the verdicts are decided")
    between_repeats: Literal["reset", "restart"] = Field(
        "reset", description="reset: empty the prefix cache before every cell (always done); restart: also start "
                             "a fresh server process before each new repeat of a configuration")
    servers_up: Literal["all", "one"] = Field(
        "all", description="all: keep every configuration's server up once started, so cells run repeat-major "
                           "across configurations (A B A B); one: one server at a time, repeats interleaved only "
                           "within a configuration")
    idle_servers: Literal["run", "pause"] = Field(
        "run", description="servers_up: all: run leaves the configurations not being measured running (idle); "
                           "pause SIGSTOPs their process groups while another configuration's cell runs and "
                           "SIGCONTs them before their own (kvscope-launched servers only)")
    sweep: SweepSpec | None = None
    predicted: PredictedSpec | None = Field(None, description="GPU deployments predicted on the workloads' traces "
                                                               "after the live phases (the report's On your GPU)")
    replay: ReplaySettings = Field(default_factory=ReplaySettings)
    executor: ExecutorSpec = Field(default_factory=ExecutorSpec)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "experiment name")

    @field_validator("servers")
    @classmethod
    def _servers(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not v:
            raise ValueError("at least one server configuration is needed")
        for k, entry in v.items():
            check_name(k, "server configuration name")
            for key in PLACEMENT_FIELDS:
                if entry and key in entry:
                    _check_resources(k, entry[key], key)
        return v

    @field_validator("models")
    @classmethod
    def _models(cls, v: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
        for k in v:
            check_name(k, "model name")
        return v

    @model_validator(mode="after")
    def _served_models(self) -> "ExperimentSpec":
        for name, entry in self.servers.items():
            serves = (entry or {}).get(SERVES_FIELD)
            if serves is not None and serves not in self.models:
                raise ValueError(f"servers.{name}.serves: unknown model {serves!r}; models: "
                                 f"{', '.join(self.models) or 'none (add a models: section)'}")
        return self

    def served_model(self, server: str) -> ModelSpec:
        """The model configuration ``server`` serves: its ``serves:`` entry of ``models:``, else ``model:``."""
        serves = (self.servers[server] or {}).get(SERVES_FIELD)
        return self.model if serves is None else self.models[serves]

    @field_validator("workloads")
    @classmethod
    def _workloads(cls, v: dict[str, WorkloadRef]) -> dict[str, WorkloadRef]:
        if not v:
            raise ValueError("at least one workload is needed")
        for k in v:
            check_name(k, "workload name")
        return v

    @model_validator(mode="after")
    def _unique_loads(self) -> "ExperimentSpec":
        names = [lv.name for lv in self.loads]
        if len(set(names)) != len(names):
            raise ValueError(f"load level names must be unique, got {names}")
        n_cells = len(self.servers) * len(self.workloads) * len(self.loads) * self.repeats.max
        if n_cells > MAX_CELLS:
            raise ValueError(f"servers x workloads x loads x repeats = {n_cells:,} cells; allowed: at most "
                             f"{MAX_CELLS:,}")
        if self.sweep is not None:
            for what, names, known in (("servers", self.sweep.servers, self.servers),
                                       ("workloads", self.sweep.workloads, self.workloads)):
                unknown = [n for n in names or [] if n not in known]
                if unknown:
                    raise ValueError(f"sweep.{what}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        rep = self.repeats
        if rep.stop_early:
            if self.servers_up != "all":
                raise ValueError("repeats.stop_early needs servers_up: all (the arms must interleave round by round)")
            if len(self.servers) < 2:
                raise ValueError("repeats.stop_early needs two or more server configurations to compare")
            if rep.baseline is not None and rep.baseline not in self.servers:
                raise ValueError(f"repeats.baseline: unknown {rep.baseline}; known: {', '.join(self.servers)}")
        sweep_only = [n for n, ref in self.workloads.items() if ref.sweep_only]
        if sweep_only and (self.sweep is None or any(n not in (self.sweep.workloads or []) for n in sweep_only)):
            raise ValueError(f"workloads {', '.join(sweep_only)} are sweep_only: name them in sweep.workloads")
        if self.predicted is not None:
            unknown = [n for n in self.predicted.workloads or [] if n not in self.workloads]
            if unknown:
                raise ValueError(f"predicted.workloads: unknown {', '.join(unknown)}; known: {', '.join(self.workloads)}")
        return self

    def predicted_workloads(self) -> list[str]:
        """The workloads ``predicted:`` runs on: its own list, else the grid's."""
        if self.predicted is None:
            return []
        return list(self.predicted.workloads or [n for n, ref in self.workloads.items() if not ref.sweep_only])

    def predicted_slo_ttft_p90_ms(self) -> float:
        """``predicted.slo_ttft_p90_ms``, else the sweep's absolute SLO, else the stated default."""
        if self.predicted is not None and self.predicted.slo_ttft_p90_ms is not None:
            return self.predicted.slo_ttft_p90_ms
        if self.sweep is not None and self.sweep.slo_ttft_p90_ms is not None:
            return self.sweep.slo_ttft_p90_ms
        return PREDICTED_SLO_TTFT_P90_MS


def load_experiment_spec(path: str | Path) -> tuple[ExperimentSpec, dict]:
    """Parse and validate; server configurations are validated too, so typos fail before anything starts."""

    path = Path(path)
    raw = load_yaml_mapping(path, "experiment spec")
    try:
        spec = ExperimentSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(path), ExperimentSpec)) from exc
    for name in spec.servers:
        server_backend(spec, name, model_path="/placeholder", source=f"{path}: servers.{name}")
    return spec, raw


def server_backend(spec: ExperimentSpec, name: str, model_path: str, source: str | None = None,
                   model_paths: dict[str, str] | None = None):
    """The (not yet started) backend of server configuration `name`: its `backend:` (else server_defaults',
    else vllm), the prepared model, server_defaults, then the entry's own fields. Defaults that another
    engine's config does not know (vLLM flags) are not applied to it; the entry's own fields must all fit.
    `model_path` is ``model:``'s prepared path; a configuration that ``serves:`` another model gets that one's
    (``model_paths``, by name, as the runner prepared them; else the spec's path as written)."""
    default_backend, defaults = split_backend(spec.server_defaults)
    entry = dict(spec.servers[name] or {})
    for key in PLACEMENT_FIELDS:  # where the configuration runs (an executor's concern), not server fields
        entry.pop(key, None)
    serves = entry.pop(SERVES_FIELD, None)
    if serves is not None:
        model_path = (model_paths or {}).get(serves, spec.models[serves].path)
    backend_name, entry_fields = split_backend({"backend": default_backend, **entry})
    backend_cls = Backend.get(backend_name)
    fields = backend_cls.experiment_base_fields(model_path, spec.served_model(name).served_model_name)
    if backend_name == default_backend:
        fields.update(defaults)
    else:
        fields.update({k: v for k, v in defaults.items() if k in backend_cls.config_model.model_fields})
    fields.update(entry_fields)
    return Backend.create(backend_name, fields, source=source or f"servers.{name}")
