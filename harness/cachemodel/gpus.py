"""Accelerator presets as data: `gpus.yaml` beside this module.

Why a file: the capacity-planning table used to carry a hard-coded dict of GPUs; which accelerators a reader
cares about changes faster than the code, and a datasheet figure belongs with its source, not in a function.
The same file serves the capacity-planning table (``name``, ``memory_gib``) and the first-principles step-cost
model (``kvscope predict --gpu ID``: peak FLOPs, bandwidths, the efficiency defaults); one GPU is one entry, so
a figure corrected for one user is corrected for both.  Fields the step model needs are optional, so a
user-written file with only names and memory still loads for the table.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

GPUS_FILE = Path(__file__).with_name("gpus.yaml")


class Efficiency(BaseModel):
    """Achieved shares of the datasheet peaks and the engine's fixed time per step (defaults: see
    docs/gpu-prediction.md "Efficiency factors"; a user's calibration replaces them)."""

    model_config = ConfigDict(extra="forbid")

    #: Achieved share of the dense tensor-core peak in compute-bound work (GEMMs, prefill attention).
    mfu: float = Field(0.5, gt=0, le=1)
    #: Achieved share of the memory bandwidth when streaming weights and KV (memory-bound decode).
    bandwidth_efficiency: float = Field(0.8, gt=0, le=1)
    #: Engine time per step that no GPU work hides: scheduling, input preparation, sampling, detokenization.
    step_overhead_ms: float = Field(2.0, ge=0)
    #: Fixed latency of one tensor-parallel all-reduce (launch and synchronisation), on top of its bytes.
    allreduce_latency_us: float = Field(8.0, ge=0)
    #: Frontend time per request before the scheduler sees it (HTTP, tokenization); part of TTFT, not a step.
    request_overhead_ms: float = Field(3.0, ge=0)
    #: Where these figures come from.
    source: str = "kvscope defaults (docs/gpu-prediction.md)"


class GpuPreset(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    memory_gib: float = Field(gt=0)
    bandwidth_gb_s: float | None = Field(None, gt=0)
    #: Short key for ``--gpu`` (``h100-sxm``); defaults to the name.
    id: str | None = None
    aliases: list[str] = Field(default_factory=list)
    #: Memory a process sees (what vLLM multiplies by gpu_memory_utilization); None: ``memory_gib``.
    usable_memory_gib: float | None = Field(None, gt=0)
    #: Dense tensor-core peaks (TFLOPS); fp8 None where the GPU has no fp8 tensor cores.
    bf16_tflops: float | None = Field(None, gt=0)
    fp8_tflops: float | None = Field(None, gt=0)
    #: The datasheet's headline TFLOPS are "with sparsity" (twice the dense figures above).
    sparse_in_datasheet: bool = False
    #: GPU-to-GPU bandwidth per direction (GB/s), what one rank of a ring all-reduce sends at.
    interconnect_gb_s: float | None = Field(None, gt=0)
    interconnect: str | None = None
    source: str | None = None
    efficiency: Efficiency = Field(default_factory=Efficiency)

    @property
    def key(self) -> str:
        return self.id or self.name

    @property
    def visible_memory_bytes(self) -> float:
        return (self.usable_memory_gib or self.memory_gib) * 2**30

    def peak_flops(self, dtype: str = "bfloat16") -> float:
        """Dense peak FLOP/s for GEMMs in ``dtype`` (fp8 falls back to bf16 where there are no fp8 cores)."""
        if self.bf16_tflops is None:
            raise ValueError(f"GPU {self.key}: gpus.yaml gives no bf16_tflops, which the step model needs")
        fp8 = dtype.lower().startswith("fp8")
        return (self.fp8_tflops if fp8 and self.fp8_tflops else self.bf16_tflops) * 1e12


def load_gpus(path: str | Path = GPUS_FILE) -> list[GpuPreset]:
    """The accelerator presets, in file order."""
    return [GpuPreset.model_validate(item) for item in yaml.safe_load(Path(path).read_text()) or []]


def get_gpu(name: str, path: str | Path = GPUS_FILE) -> GpuPreset:
    """The preset whose id, alias or name is ``name`` (case-insensitive); ValueError naming the known ids."""
    gpus = load_gpus(path)
    want = name.strip().lower()
    for g in gpus:
        if want in {g.key.lower(), g.name.lower(), *(a.lower() for a in g.aliases)}:
            if g.bandwidth_gb_s is None or g.bf16_tflops is None:
                raise ValueError(f"GPU {name!r}: {Path(path).name} lacks bandwidth_gb_s or bf16_tflops, "
                                 "which the step model needs")
            return g
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(g.key for g in gpus)}")
