"""`speculation.json` (`kvscope speculate --json`): predicted speculative-decoding acceptance per method.

Why a file: the offline model (``kvscope.harness.cachemodel.speculative``) runs in seconds to a minute on a
large trace, and the speculative page, the benchmarks and other tools read its answer as data; like every
kvscope result it is a typed, versioned pydantic model, so a field this kvscope does not know fails at write
time and a file of another version is refused with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from kvscope.harness.common.errors import KvscopeError
from kvscope.workloads.versioned_file import VersionedFile, read_versioned, write_versioned
from pydantic import BaseModel, ConfigDict

SPECULATION_NAME = "speculation.json"


class MethodPrediction(BaseModel):
    """One method and setting over one trace: vLLM's counters as the model predicts them, and rates."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "suffix", "oracle"]
    label: str
    params: dict[str, float | int]
    requests: int
    skipped_requests: int
    output_tokens: int
    decode_steps: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    accepted_per_position: list[int]
    acceptance_by_position: list[float | None]
    tokens_per_step: float | None
    draft_share_of_steps: float | None
    open_ended_requests: int
    #: from a calibration's step costs (requests alone on the server); None without --calibration
    predicted_tpot_ms_mean: float | None = None
    predicted_output_tokens_per_s: float | None = None
    seconds: float


class SpeculationFile(VersionedFile):
    FORMAT = "kvscope-speculation"
    SUPPORTED_VERSIONS = (1,)

    format: Literal["kvscope-speculation"] = "kvscope-speculation"
    version: int = 1
    trace: str
    trace_name: str | None = None
    max_model_len: int | None = None
    calibration: str | None = None
    #: the same calibration's TPOT without speculation, for the speed-up
    baseline_tpot_ms_mean: float | None = None
    methods: list[MethodPrediction]


def write_speculation_file(path: str | Path, data: SpeculationFile) -> Path:
    return write_versioned(Path(path), data)


def load_speculation_file(path: str | Path) -> SpeculationFile:
    return read_versioned(Path(path), SpeculationFile, KvscopeError)
