"""The parts of summary.json that the run knows and the records do not: named, typed, registered.

A :class:`~kvscope.harness.results.summary.SummaryMetric` is computed from the request records, so anyone can
recompute it from a published run. Some entries cannot be: why the run stopped early (``aborted``), what the
replay client itself cost (``client``: CPU, event-loop stalls, scheduling priority) and what each server said
about itself (``server_facts``). Those are *parts*: each has a name (its key in the file, after the metrics)
and a typed model; the replay hands the values to :func:`~kvscope.harness.results.summary.summarize`, which
validates each against its model and assembles them, and :func:`part_fields` gives the summary file model
its fields. So the file's shape is declared once, here, and the replay never writes a block by hand after
summarising: a part it forgets, or one of the wrong shape, is an error at the run's end, not a file a
reader later refuses.

Why a registry and not three fields of the file model: the same reason metrics have one (a new part is one
registration, the file model and the writer follow), and the loader (results layer) can read the parts
without importing the replay that produces them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, TypeAdapter


class ClientStats(BaseModel):
    """The replay client's own cost: a saturated client inflates latencies."""

    model_config = ConfigDict(extra="forbid")

    cpu_s: float
    cpu_utilization: float | None
    cpu_us_per_request: float | None
    event_loop: str | None
    stale_connection_resends: int
    saturated: bool
    note: str | None
    #: Times the event loop woke > CLIENT_STALL_S late (the client was held up: sessions waited, tokens of the window
    #: were timestamped late), the longest, and their sum.  Absent in summaries written before it existed.
    stalls: int | None = None
    stall_max_s: float | None = None
    stalled_s: float | None = None
    #: The longest stalls (at most 50) as [start s from the run's start, length s]: windows whose send times,
    #: token times and done times are late by up to the length.
    stall_windows_s: list[tuple[float, float]] | None = None
    #: The event loop's CPU scheduling: "realtime" (SCHED_FIFO, see replay/priority.py) or "normal".
    priority: str | None = None


class ServerFacts(BaseModel):
    """What kvscope knows about a server: needed to predict hits (block size, capacity) and label results.
    The serving backends produce it (``kvscope.harness.serving.backend``); summary.json and experiment.json
    record it, so it is defined here, with the result files. Every fact a backend cannot know is None
    (unknown), never a guess."""

    endpoint: str | None = None  # always set by a backend; absent in hand-written files
    backend: str = "vllm"
    engine_version: str | None = None
    vllm_version: str | None = None  # kept for readers of older result files; None for other engines
    model: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    kv_capacity_tokens: int | None = None
    max_concurrency: float | None = None
    prefix_caching: bool | None = None
    kv_cache_dtype: str | None = None
    num_gpu_blocks_override: int | None = None
    prefix_caching_hash_algo: str | None = None
    speculative: dict[str, Any] | None = None
    speculative_enabled: bool | None = None
    launched_by_kvscope: bool = False
    #: The engine's own launch configuration as recorded (redacted), open: its keys are the engine's.
    config: dict[str, Any] | None = None

    def as_json(self) -> str:
        return self.model_dump_json(indent=2)


@dataclass(frozen=True)
class SummaryPart:
    """One registered part: its key in summary.json and the type of its value."""

    name: str
    output: Any

    def adapter(self) -> TypeAdapter:
        return TypeAdapter(self.output)


_PARTS: dict[str, SummaryPart] = {}


def summary_part(name: str, output: Any) -> SummaryPart:
    """Register a part; summary.json lists parts after the metrics, in registration order."""
    if name in _PARTS:
        raise ValueError(f"summary part {name!r} is already registered")
    part = SummaryPart(name, output)
    _PARTS[name] = part
    return part


def registered_parts() -> tuple[SummaryPart, ...]:
    return tuple(_PARTS.values())


def part_fields() -> dict[str, tuple[Any, Any]]:
    """The summary file model's fields of the parts: each required (a summary without one is not a run's)."""
    return {p.name: (p.output, ...) for p in _PARTS.values()}


def assemble_parts(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every registered part's value, validated against its type and dumped as JSON data, in registration
    order. A missing or unknown part is a ValueError naming it (a bug in the producer, not bad input)."""
    unknown = sorted(set(values) - set(_PARTS))
    if unknown:
        raise ValueError(f"summary parts {unknown} are not registered (registered: {', '.join(_PARTS)})")
    missing = [name for name in _PARTS if name not in values]
    if missing:
        raise ValueError(f"summary parts {missing} are missing")
    out: dict[str, Any] = {}
    for part in _PARTS.values():
        adapter = part.adapter()
        out[part.name] = adapter.dump_python(adapter.validate_python(values[part.name]), mode="json")
    return out


#: Why the run ended before its trace did (the server stopped answering, …); null when it ran to the end.
ABORTED = summary_part("aborted", str | None)
CLIENT = summary_part("client", ClientStats)
SERVER_FACTS = summary_part("server_facts", list[ServerFacts])  # one per endpoint, in endpoint order
