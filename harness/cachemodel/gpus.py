"""Accelerator presets (memory, bandwidth) as data: `gpus.yaml` beside this module.

Why a file: the capacity-planning table used to carry a hard-coded dict of GPUs; which accelerators a reader
cares about changes faster than the code, and a datasheet figure belongs with its source, not in a function.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

GPUS_FILE = Path(__file__).with_name("gpus.yaml")


class GpuPreset(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    memory_gib: float = Field(gt=0)
    bandwidth_gb_s: float | None = Field(None, gt=0)


def load_gpus(path: str | Path = GPUS_FILE) -> list[GpuPreset]:
    """The accelerator presets, in file order."""
    return [GpuPreset.model_validate(item) for item in yaml.safe_load(Path(path).read_text()) or []]
