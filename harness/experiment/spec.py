"""Experiment specs: server configurations × workloads × load levels × repeats, in one YAML file.

A spec names everything an experiment needs so that a run is reproducible from the file alone: the model
(built locally, a local directory, or a Hugging Face id), named server configurations (overrides of one
base config), workloads (presets or spec files with overrides), load levels, repeats, SLOs and pricing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvscope.harness.common.errors import ConfigError, format_validation_error, load_yaml_mapping

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(v: str, what: str) -> str:
    """Names become directory names: no separators, no '..', nothing that escapes the results folder."""
    if not NAME_RE.match(v) or ".." in v:
        raise ValueError(f"{what} {v!r} must be 1-64 letters, digits, '_', '-' or '.', starting with a letter "
                         "or digit (it becomes a directory name)")
    return v


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: Literal["tiny", "path", "hf"] = Field("tiny", description="tiny: build kvscope's model; path: a "
                                                                       "local HF directory; hf: a hub id")
    path: str = Field("models/tiny", description="tiny: where to build it; path: the directory; hf: the id")
    served_model_name: str = "tiny"
    seed: int = 0
    train_steps: int = Field(0, ge=0, description="tiny only: brief training so speculation means something")
    tokenizer: str | None = Field(None, description="directory with tokenizer.json for workload generation "
                                                    "(default: the model directory)")


class WorkloadRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: str = Field(description="a preset name (kvscope workload presets) or a spec file path")
    scale: float | None = Field(None, gt=0)
    output_scale: float | None = Field(None, gt=0, description="multiplies output sizes instead of scale")
    sessions: int | None = Field(None, gt=0)
    seed: int | None = None
    max_context: int | None = Field(None, gt=0, description="end sessions before exceeding this many tokens")


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


class ReplaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["live", "recorded"] = "recorded"
    time_scale: float = Field(0.0, ge=0)
    max_requests: int | None = Field(None, gt=0)
    duration_s: float | None = Field(None, gt=0)
    warmup_s: float = Field(0.0, ge=0)
    cooldown_s: float = Field(0.0, ge=0)
    request_timeout_s: float = Field(600.0, gt=0)
    idle_timeout_s: float = Field(120.0, gt=0)
    scrape_interval_s: float = Field(0.5, gt=0)
    warmup_requests: int = Field(2, ge=0, description="unrelated requests sent before each cell on top of those "
                                                      "that write every KV block once; then the prefix cache is reset")
    warmup_pass: bool = Field(False, description="replay each cell's trace once, unrecorded, before measuring it: "
                                                 "CPU kernels specialise per shape, so a first pass is slower; "
                                                 "use it to compare repeats of one configuration")


class SloSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)


class CostSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pricing: list[str] = Field(default_factory=lambda: ["anthropic-5m", "openai"],
                               description="provider pricing presets (kvscope cost --help)")
    gpu_hourly_usd: float = Field(2.0, gt=0, description="self-hosted $/GPU-hour for cost per token")
    gpu_name: str = "the serving machine"


# Each cell is at least one replay; past these bounds a spec is a typo (repeats: 10**12 hung `experiment cells`).
MAX_REPEATS = 1000
MAX_CELLS = 10_000


class ExperimentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    model: ModelSpec = Field(default_factory=ModelSpec)
    server_defaults: dict[str, Any] = Field(default_factory=dict,
                                            description="ServerConfig fields shared by every configuration")
    servers: dict[str, dict[str, Any]] = Field(description="named configurations: ServerConfig overrides")
    workloads: dict[str, WorkloadRef]
    loads: list[LoadLevel] = Field(default_factory=lambda: [LoadLevel(concurrency=1)])
    repeats: int = Field(1, ge=1, le=MAX_REPEATS)
    replay: ReplaySettings = Field(default_factory=ReplaySettings)
    slo: SloSpec = Field(default_factory=SloSpec)
    cost: CostSpec = Field(default_factory=CostSpec)
    notebooks: list[str] | None = Field(None, description="notebooks to render (default: all)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "experiment name")

    @field_validator("servers")
    @classmethod
    def _servers(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not v:
            raise ValueError("at least one server configuration is needed")
        for k in v:
            check_name(k, "server configuration name")
        return v

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
        n_cells = len(self.servers) * len(self.workloads) * len(self.loads) * self.repeats
        if n_cells > MAX_CELLS:
            raise ValueError(f"servers x workloads x loads x repeats = {n_cells:,} cells; allowed: at most "
                             f"{MAX_CELLS:,}")
        return self


def load_experiment_spec(path: str | Path) -> tuple[ExperimentSpec, dict]:
    """Parse and validate; server configurations are validated too, so typos fail before anything starts."""

    path = Path(path)
    raw = load_yaml_mapping(path, "experiment spec")
    try:
        spec = ExperimentSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(path), ExperimentSpec)) from exc
    for name in spec.servers:
        server_config_dict(spec, name, model_path="/placeholder", source=f"{path}: servers.{name}")
    return spec, raw


def server_config_dict(spec: ExperimentSpec, name: str, model_path: str, source: str | None = None):
    from kvscope.harness.serving.server import ServerConfig

    fields = {"model": model_path, "served_model_name": spec.model.served_model_name}
    fields.update(spec.server_defaults)
    fields.update(spec.servers[name] or {})
    try:
        return ServerConfig.model_validate(fields)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source or f"servers.{name}", ServerConfig)) from exc
