"""The result files kvscope writes, as versioned pydantic models: `summary.json` and `manifest.json` (a replay
run directory), `experiment.json` (an experiment run directory) and `report.json` (its `report/` folder).

Why models: these files are read back by `load_results`, the report, `kvscope compare` and notebooks, maybe by
another kvscope release. Writers build the model (so a misspelt or missing field fails when the file is
written, not when a notebook reads it) and dump it; readers go through one loader per file
(`kvscope.harness.results.loaders`) that checks format name and version first and then every field. Field
names and meanings are the ones docs/architecture.md documents, so notebooks keep working.

Top levels are strict (`extra="forbid"`). Nested blocks are typed sub-models where they are stable; a block is
`dict[str, Any]` only where its content is open-ended or its model lives in a higher layer (the comment at each
says which). Versioning rule: see `kvscope.workloads.versioned_file` (a file without a version is refused).

The experiment spec recorded in `experiment.json` is the validated spec with its defaults. The part the report
reads (name, description, notebooks, SLOs, cost) is `ExperimentSpecCore`, defined here so that the report
layer can read it typed; `kvscope.harness.experiment.spec.ExperimentSpec` extends it with the fields that only
the runner needs, and `ExperimentFile` is generic in the spec model so the runner reads its own files back as
full `ExperimentSpec`s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from kvscope.harness.cachemodel.calibration import StepCostModel
from kvscope.harness.cachemodel.scheduler import SchedulerConfig
from kvscope.harness.results.summary import CLIENT_STALL_S, ServerFacts, summary_file_model  # noqa: F401
from kvscope.workloads.versioned_file import VersionedFile
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------------------ summary.json
# summary.json's model is derived from the summary-metric registry (`kvscope.harness.results.summary`): each
# metric declares its block. `SummaryFile` below is that model for the metrics registered when it is read.



def __getattr__(name: str) -> Any:
    if name == "SummaryFile":  # derived from the registry, so built when asked for
        return summary_file_model()
    raise AttributeError(name)


# ----------------------------------------------------------------------------------------- manifest.json


class TraceRef(_Block):
    path: str
    sha256: str
    name: str | None
    seed: int | None


class HostInfo(_Block):
    hostname: str
    platform: str
    cpus: int | None


class ManifestFile(VersionedFile):
    FORMAT = "kvscope-run-manifest"
    SUPPORTED_VERSIONS = (1,)

    format: Literal["kvscope-run-manifest"] = "kvscope-run-manifest"
    version: int = 1
    kvscope_version: str
    vllm_version: str | None
    backend: str = "vllm"  # the serving backend's registered name (kvscope.harness.serving.backend)
    engine_version: str | None = None  # the engine's own version, when the backend can read it
    trace: TraceRef
    # ReplayOptions.model_dump(): that model lives in the replay layer, above this one.
    options: dict[str, Any]
    endpoints: list[str]
    # ServerConfig.redacted() (serving layer) when kvscope launched the server, else null.
    server_config: dict[str, Any] | None
    host: HostInfo
    started_at: float  # Unix time
    ended_at: float
    aborted: str | None
    prefix_cache_reset: dict[str, str] | None  # endpoint -> outcome; null when the reset was switched off


# --------------------------------------------------------------------------------------- experiment.json


class SloSpec(_Block):
    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)


DEFAULT_PRICING = ["anthropic-sonnet-5m", "anthropic-sonnet-1h", "openai-gpt-4.1", "gemini-2.5-flash-implicit",
                   "deepseek-v3.2"]


class SelfHostedSpec(_Block):
    """The machine the configurations were served on, priced by the hour and named as what it is.

    Why a machine rather than a GPU: the quickstart serves on a 2-core CPU VM, and "$0.10 per GPU-hour" named
    hardware it never had. ``hourly_usd`` is the whole machine's (all its accelerators); self-hosted $ per
    million tokens and per 1,000 sessions follow from it and the throughput each cell measured."""

    hourly_usd: float = Field(2.0, gt=0, description="$ per hour of the serving machine, all its accelerators")
    hardware: str = Field("the serving machine", min_length=1,
                          description="what the machine is, as the report names it ('2-core CPU VM', '1x H100 80GB')")


class CostSpec(_Block):
    """Inputs of the cost report (notebooks/cost.ipynb). ``self_hosted`` replaced ``gpu_hourly_usd`` /
    ``gpu_name`` (read still, as the same machine's hourly price and name; giving both forms is an error)."""

    pricing: list[str] = Field(default_factory=lambda: list(DEFAULT_PRICING),
                               description="provider pricing presets (kvscope cost --help) or preset YAML files")
    self_hosted: SelfHostedSpec = Field(default_factory=SelfHostedSpec,
                                        description="the serving machine's hourly price and what it is")

    @model_validator(mode="before")
    @classmethod
    def _older_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not ({"gpu_hourly_usd", "gpu_name"} & data.keys()):
            return data
        if "self_hosted" in data:
            raise ValueError("cost: give self_hosted {hourly_usd, hardware} or the older gpu_hourly_usd / gpu_name, "
                             "not both")
        data = dict(data)
        machine = {}
        if "gpu_hourly_usd" in data:
            machine["hourly_usd"] = data.pop("gpu_hourly_usd")
        if "gpu_name" in data:
            machine["hardware"] = data.pop("gpu_name")
        return {**data, "self_hosted": machine}

    @property
    def gpu_hourly_usd(self) -> float:
        """The older name of ``self_hosted.hourly_usd``, for readers written against it."""
        return self.self_hosted.hourly_usd

    @field_validator("pricing")
    @classmethod
    def _known_presets(cls, v: list[str]) -> list[str]:
        # deferred: keeps `kvscope --help` fast
        from kvscope.harness.pricing.provider_cache import list_presets

        known = list_presets()
        unknown = [p for p in v if p not in known and not Path(p).is_file()]
        if unknown:
            raise ValueError(f"unknown pricing preset(s) {', '.join(unknown)}; known: {', '.join(known)} "
                             "(or a path to a preset YAML file)")
        return v


class ExperimentSpecCore(BaseModel):
    """The fields of an experiment spec that reports read. Extra fields (the rest of the spec) are kept."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str = ""
    notebooks: list[str] | None = Field(None, description="notebooks to render (default: all)")
    slo: SloSpec = Field(default_factory=SloSpec)
    cost: CostSpec = Field(default_factory=CostSpec)


SpecT = TypeVar("SpecT", bound=ExperimentSpecCore)

CellStatus = Literal["pending", "running", "ok", "failed", "interrupted", "skipped"]
"""`skipped`: a repeat that `repeats: {stop_early: true}` did not need (its group's verdicts were decided)."""


class CellHeadline(_Block):
    requests: int
    errors: int
    hit_rate: float | None
    ttft_p50_s: float | None
    req_per_s: float | None
    ttft_p90_s: float | None = None
    preemptions: float | None = None  # vllm:num_preemptions_total delta over the cell
    mean_sessions_in_flight: float | None = None  # achieved concurrency, from the records' send/done times
    under_driven: bool | None = None  # closed loop: fewer sessions in flight than the level's concurrency
    #: 95 % bootstrap interval of the TTFT p90 over the cell's sessions (s; null: under two sessions, or older files)
    ttft_p90_interval_s: tuple[float, float] | None = None


class CellEntry(_Block):
    server: str
    workload: str
    load: str
    repeat: int
    status: CellStatus
    reason: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    warmup_requests: int | None = None
    prefix_cache_reset: str | None = None  # how the cell started from an empty cache (the backend's word)
    dir: str | None = None  # the cell's run directory, relative to the experiment directory
    headline: CellHeadline | None = None
    traceback: str | None = None


class SequentialVerdictEntry(_Block):
    """One metric's verdict from the early-stopping rule (kvscope.harness.analysis.sequential)."""

    metric: str
    verdict: Literal["better", "worse", "equivalent", "inconclusive"]
    repeats: int  # paired repeats it was decided on (undecided: the repeats looked at last)
    effect: float | None  # mean paired difference: log(B / A), the hit rate B - A
    p_beyond: float | None  # BH-adjusted p-value that the effect lies beyond the margin
    p_inside: float | None  # … that it lies inside the margin (TOST)
    level: float  # the look's nominal significance level (alpha spent by then)


class SequentialEntry(_Block):
    """One comparison of a ``repeats: {stop_early: true}`` experiment: configuration `b` against the baseline
    `a` at one workload and load, how many repeats it used and why it stopped."""

    workload: str
    load: str
    a: str
    b: str
    repeats_used: int
    repeats_max: int
    stopped: Literal["decided", "max_repeats", "running"]
    reason: str  # the console's sentence: "stopped after 3 of 5 repeats: all 4 verdicts decided"
    verdicts: list[SequentialVerdictEntry]


class ServerEntry(_Block):
    # ServerConfig.redacted(): the serving layer's model (above this one), one class per backend.
    config: dict[str, Any]
    backend: str = "vllm"  # the serving backend's registered name (the runner records it)
    restarts: int = 0
    log: str
    facts: ServerFacts | None = None
    ready_after_s: float | None = None
    node: str | None = None  # Ray executor: the node (IP) the server ran on (its client too, unless client_node)
    files: Literal["shared", "ship"] | None = None  # Ray executor: cells written in place or shipped back
    # Ray executor with servers.<name>.client_resources: the node (IP) and process that replayed the cells
    # (absent: the client ran beside the server, on `node`)
    client_node: str | None = None
    client_pid: int | None = None


class ExecutorEntry(_Block):
    """Which executor ran the cells (the last run; --resume may switch executors, cells keep their records)."""

    kind: Literal["local", "ray"]
    address: str | None = None  # ray: the cluster address given (None: a new local cluster or RAY_ADDRESS)
    files: Literal["auto", "shared", "ship"] | None = None  # ray: the spec's executor.files (servers: what each got)


class SweepPoint(_Block):
    load: float
    ttft_p90_s: float | None
    preemptions: float
    mean_sessions_in_flight: float | None
    cell: str | None
    ttft_p90_interval_s: tuple[float, float] | None = None  # 95 % over the level's sessions (null: not known)


class PredictedLevel(_Block):
    """One level of the scheduler model's predicted curve (``kvscope.harness.cachemodel.capacity_model``)."""

    load: float
    hit_rate: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    e2e_p50_s: float | None
    preemptions: float  # mean over the level's runs
    kv_usage_max: float
    #: The level's runs (1, or an ensemble with timing noise) and the 10th / 50th / 90th percentile of their
    #: preemption counts (absent in files written before the ensemble; the capacity rule reads the median).
    runs: int = 1
    preemptions_p10: float | None = None
    preemptions_p50: float | None = None
    preemptions_p90: float | None = None


class PredictedCapacity(_Block):
    """What ``kvscope capacity`` predicts for a sweep's trace on its server, from a calibration of that server
    taken just before the sweep; ``skipped`` says why there is no prediction (then the rest is empty)."""

    calibration: str | None = None  # calibration.json, relative to the experiment directory
    fit_r2: float | None = None
    capacity: float | None = None  # highest predicted level meeting the SLO (the live rule)
    cliff: float | None = None  # first level whose hit rate is > 5 pp below the lowest level's
    levels: list[PredictedLevel] = Field(default_factory=list)
    skipped: str | None = None
    sentence: str = ""


class SweepPlanEntry(_Block):
    """How a sweep chose its levels (spec ``sweep.plan``, ``kvscope.harness.analysis.capacity.next_planned_level``):
    from the scheduler model's curve, or the ladder of ``levels`` (``reason``: why, where a plan was asked)."""

    plan: Literal["predicted", "ladder"]
    reason: str | None = None
    measured: list[float]  # the levels measured, in the order they ran
    measured_edge: float | None = None  # lowest measured failing level above the highest passing one
    #: predicted plans: the curve's levels (what the search may pick), its capacity and edge (the lowest
    #: predicted-failing level above it), the levels it chose first (unloaded, last passing, edge, one above),
    #: the levels a climb from the lowest to one past the measured edge measures, and the difference.
    candidates: list[float] = Field(default_factory=list)
    predicted_capacity: float | None = None
    predicted_edge: float | None = None
    targets: list[float] = Field(default_factory=list)
    full_climb: int | None = None
    live_cells_saved: int | None = None
    sentence: str = ""


class CapacityEntry(_Block):
    """One sweep's answer (kvscope.harness.analysis.capacity.Capacity): the highest measured load meeting the SLO."""

    server: str
    workload: str
    kind: Literal["concurrency", "session_rate"]
    slo_ttft_p90_ms: float | None  # absolute; a relative SLO resolved (null: no level answered to resolve it)
    capacity: float | None
    interpolated: float | None
    ceiling: Literal["slo", "preemption"] | None
    under_driven: list[float]
    points: list[SweepPoint]
    sentence: str
    #: The scheduler model's curve for the same trace and levels (spec ``sweep.predict``), null when not asked.
    predicted: PredictedCapacity | None = None
    #: A relative SLO as the spec wrote it (``3x_unloaded``; null: absolute), the unloaded TTFT p90 (ms) it was
    #: resolved against and where that came from (``measured at concurrency 1``).
    slo_ttft_p90: str | None = None
    slo_unloaded_ttft_p90_ms: float | None = None
    slo_unloaded_source: str | None = None
    #: How the levels were chosen (experiment.json version 2; null in version-1 files).
    plan: SweepPlanEntry | None = None


class ModelEntry(_Block):
    path: str
    tokenizer: str
    # The tiny model's build card (kvscope_model.json), null for other models: its fields are the builder's.
    card: dict[str, Any] | None
    weights_random: bool


class ExperimentFile(VersionedFile, Generic[SpecT]):
    """Version 2 adds ``capacity[].plan`` and ``spec.sweep.plan``; a version-1 file reads as version 2 with its
    sweep's plan ``ladder`` (what it ran) and no plan record."""

    FORMAT = "kvscope-experiment"
    SUPPORTED_VERSIONS = (1, 2)

    format: Literal["kvscope-experiment"] = "kvscope-experiment"
    version: int = 2
    experiment: str
    run_id: str
    spec: SpecT  # the validated spec, defaults included
    spec_path: str
    created_at: float
    kvscope_version: str = "unknown"
    model: ModelEntry | None = None
    cells: dict[str, CellEntry] = Field(default_factory=dict)
    servers: dict[str, ServerEntry] = Field(default_factory=dict)
    traces: dict[str, str] = Field(default_factory=dict)  # workload -> trace dir relative to the experiment dir
    completed_at: float | None = None
    failed_cells: list[str] | None = None
    cell_order: str | None = None  # how cells were ordered and servers kept (kvscope experiment cells says it)
    capacity: list[CapacityEntry] | None = None  # one per sweep (spec `sweep:`), null without one
    executor: ExecutorEntry | None = None
    #: ``repeats: {stop_early: true}``: one entry per comparison (null without early stopping)
    sequential: list[SequentialEntry] | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_version_1(cls, data: Any) -> Any:
        """Version 1 had no ``sweep.plan``: its sweeps climbed the ladder, so they read back as such."""
        if isinstance(data, dict) and data.get("version") == 1:
            data = {**data, "version": 2}
            spec = data.get("spec")
            if isinstance(spec, dict) and isinstance(spec.get("sweep"), dict) and "plan" not in spec["sweep"]:
                data["spec"] = {**spec, "sweep": {**spec["sweep"], "plan": "ladder"}}
        return data


# ------------------------------------------------------------------------------------------- report.json


class NotebookEntry(_Block):
    notebook: str
    ok: bool
    error: str | None
    seconds: float
    html: str | None  # file name inside report/
    figures: list[str]  # paths relative to report/


class ReportFile(VersionedFile):
    FORMAT = "kvscope-report"
    SUPPORTED_VERSIONS = (1,)

    format: Literal["kvscope-report"] = "kvscope-report"
    version: int = 1
    notebooks: list[NotebookEntry]


# -------------------------------------------------------------------------------------- calibration.json


class _FiniteBlock(_Block):
    """Calibration numbers are finite numbers, written as numbers: an ``Infinity`` step cost predicted "capacity
    below 1" without a word, and ``"base_s": "1"`` (a string) was read as one second (strict: no coercion)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


#: Bounds of a server a calibration can describe: far above any served configuration, low enough that the
#: scheduler model's per-sequence and per-block state fits in memory (a ``max_num_seqs`` of 1e12 was accepted).
MAX_BLOCK_SIZE = 4096
MAX_GPU_BLOCKS = 1 << 27
MAX_NUM_SEQS = 1 << 16
MAX_BATCHED_TOKENS = 1 << 24
MAX_MODEL_LEN = 1 << 27
#: A step cost above a minute (per step, token, sequence or request) is no server's: a corrupt calibration.
MAX_STEP_COST_S = 60.0
#: The least a one-token step of one sequence can cost: zero costs predicted "capacity 32 at 0 ms".
MIN_STEP_S = 1e-6


class CalibrationServer(_FiniteBlock):
    """The server settings the scheduler model needs, as measured (``kvscope capacity --server``)."""

    endpoint: str | None = None
    model: str | None = None
    block_size: int = Field(gt=0, le=MAX_BLOCK_SIZE)
    num_gpu_blocks: int | None = Field(None, gt=1, le=MAX_GPU_BLOCKS)  # null block included; None = unknown
    max_num_seqs: int = Field(128, gt=0, le=MAX_NUM_SEQS)
    max_num_batched_tokens: int = Field(2048, gt=0, le=MAX_BATCHED_TOKENS)
    max_model_len: int | None = Field(None, gt=0, le=MAX_MODEL_LEN)
    enable_chunked_prefill: bool = True
    #: The server's speculative decoding as a ``kvscope predict --speculative`` string (``ngram:k=4,min=2,max=4``;
    #: None: none): its decode samples were featured with the offline model's drafts, and a prediction from
    #: this calibration gives each request its drafts and acceptance.
    speculation: str | None = None


class CalibrationCost(_FiniteBlock):
    """``step_s = base_s + per_token_s*tokens + per_seq_s*seqs + per_context_token_s*context_tokens
    + per_prefill_pair_s*prefill_pairs`` (`cachemodel.calibration.StepCostModel`).  Each cost is bounded
    (`MAX_STEP_COST_S`) and a step of one token for one sequence must take time (`MIN_STEP_S`)."""

    base_s: float = Field(ge=0, le=MAX_STEP_COST_S)
    per_token_s: float = Field(ge=0, le=MAX_STEP_COST_S)
    per_seq_s: float = Field(ge=0, le=MAX_STEP_COST_S)
    per_context_token_s: float = Field(ge=0, le=MAX_STEP_COST_S)
    request_overhead_s: float = Field(0.0, ge=0, le=MAX_STEP_COST_S)
    per_prefill_pair_s: float = Field(ge=0, le=MAX_STEP_COST_S)
    #: Speculative decoding (0 without): per step in which some sequence verifies drafts, per draft token verified.
    per_spec_step_s: float = Field(0.0, ge=0, le=MAX_STEP_COST_S)
    per_draft_token_s: float = Field(0.0, ge=0, le=MAX_STEP_COST_S)

    @model_validator(mode="after")
    def _a_step_takes_time(self) -> CalibrationCost:
        one_step_s = (self.base_s + self.per_token_s + self.per_seq_s + self.per_context_token_s
                      + self.per_prefill_pair_s)
        if not one_step_s >= MIN_STEP_S:
            raise ValueError(f"a step of one token for one sequence costs {one_step_s:g} s by these coefficients; "
                             f"a server takes at least {MIN_STEP_S:g} s (calibrate again)")
        return self


class CalibrationSample(_FiniteBlock):
    """One measured shape (`cachemodel.calibration.TimingSample`): its summed step features and seconds."""

    kind: Literal["prefill", "decode"]
    steps: float
    tokens: float
    seq_steps: float
    context_tokens: float  # attended by decodes
    seconds: float
    requests: float = 0.0
    prefill_pairs: float = 0.0
    spec_steps: float = 0.0
    draft_tokens: float = 0.0


class CalibrationFile(VersionedFile):
    """A step-cost calibration of one server (`kvscope.harness.replay.calibrate`), read by `kvscope capacity`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    FORMAT = "kvscope-calibration"
    #: Version 2 split attention into decode context and prefill (query, key) pairs: a version-1 cost model
    #: has one context coefficient for both, so it cannot be read as a version-2 one (calibrate again).
    #: The speculative fields (``server.speculation``, ``cost.per_spec_step_s``/``per_draft_token_s``, the
    #: samples' ``spec_steps``/``draft_tokens``) are optional with a default of none/0, which is what a
    #: file written before them means, so they came without a version bump.
    SUPPORTED_VERSIONS = (2,)

    format: Literal["kvscope-calibration"] = "kvscope-calibration"
    version: int = 2
    created_at: float
    server: CalibrationServer
    cost: CalibrationCost
    fit_r2: float
    fit_median_rel_error: float
    load_average_1m: float | None = None  # machine load while measuring (timings on a shared host are noisy)
    #: The measuring client's CPU scheduling: "realtime" (SCHED_FIFO, see replay/priority.py) or "normal".
    client_priority: str | None = None
    #: Run-to-run timing noise of the repeated shapes (`calibration.timing_cv`): the scheduler model's
    #: ensemble noise; None when nothing was repeated.
    timing_cv: float | None = Field(None, ge=0)
    #: The measured shapes, one per shape (the median of its repeats).
    samples: list[CalibrationSample] = Field(default_factory=list)

    def cost_model(self) -> StepCostModel:
        """The fitted step costs as the scheduler model's cost model."""
        return StepCostModel(**self.cost.model_dump())

    def scheduler_config(self, num_gpu_blocks: int | None = None) -> SchedulerConfig:
        """The measured server as the scheduler model's config (``num_gpu_blocks``: a what-if KV capacity)."""
        s = self.server
        return SchedulerConfig(block_size=s.block_size, num_gpu_blocks=num_gpu_blocks or s.num_gpu_blocks,
                               max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                               enable_chunked_prefill=s.enable_chunked_prefill)
