"""`routing.json`: a model-routing replay's requests as the offline routing model predicts them, beside what the
servers said.

Why a file of its own beside the records: the records hold what was measured (each request's model, decision,
escalation, the servers' ``cached_tokens``); this file holds the offline model's answer for the same decisions
(``cachemodel/model_routing.py``, one prefix-cache pool per model, run after the replay on the ids actually sent
and generated), the history each model switch recomputed, and how often the two agree. It is typed and
versioned like every kvscope result, so a reader of another version is refused with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from kvscope.harness.common.errors import KvscopeError
from kvscope.workloads.versioned_file import VersionedFile, read_versioned, write_versioned
from pydantic import BaseModel, ConfigDict

ROUTING_NAME = "routing.json"


class RoutedRequestCheck(BaseModel):
    """One request of the run: the decision, the servers' cached tokens and the offline model's."""

    model_config = ConfigDict(extra="forbid")

    request_id: int
    session_id: str
    step: int
    model: str
    reason: str
    escalated: bool
    prompt_tokens: int
    cached_tokens: int  # the serving model's server
    predicted_cached_tokens: int  # the offline routing model
    #: prompt tokens the serving model computed (prompt - cached): the history a switch or escalation recomputed
    recomputed_tokens: int
    #: offline: tokens the model of the session's previous request held of this prompt but this one recomputed
    model_switch_tokens: int
    wasted_model: str | None = None
    wasted_cached_tokens: int | None = None
    wasted_predicted_cached_tokens: int | None = None
    wasted_output_tokens: int = 0


class RoutingCheckFile(VersionedFile):
    FORMAT = "kvscope-routing"
    SUPPORTED_VERSIONS = (1,)

    format: Literal["kvscope-routing"] = "kvscope-routing"
    version: int = 1
    policy: dict
    stickiness: str
    #: per model: its endpoint, block size and pool (num_gpu_blocks; None: unbounded) as the servers reported
    models: list[dict]
    #: sequential: the offline model's pools take the attempts one at a time in the order they were sent
    predictor: Literal["sequential"] = "sequential"
    requests: int
    escalations: int
    #: share of the served attempts whose predicted cached tokens equal the server's, and of all attempts
    #: (the escalations' discarded small attempts included)
    exact_share: float | None
    exact_share_all_attempts: float | None
    model_switch_tokens: int
    rows: list[RoutedRequestCheck]


def write_routing_file(path: str | Path, data: RoutingCheckFile) -> Path:
    return write_versioned(Path(path), data)


def load_routing_file(path: str | Path) -> RoutingCheckFile:
    return read_versioned(Path(path), RoutingCheckFile, KvscopeError)
