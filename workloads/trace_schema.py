"""`trace.json`, the metadata file of a trace directory, as a versioned pydantic model.

The trace directory has carried `{"format": "kvscope-trace", "version": 1}` since the first release, so old
traces keep reading. `Trace.meta` stays a plain dict (the model's dump) because generators and importers build
it incrementally and notebooks read it as one; the model is the gate on the way out and on the way in.
The fields and their meaning are documented in docs/architecture.md (Trace directory).
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict

from kvscope.workloads.versioned_file import VersionedFile, read_versioned, validate_data, write_versioned
from kvscope.workloads.errors import TraceFileError

FORMAT: Final = "kvscope-trace"
VERSION: Final = 1


class SegmentKind(StrEnum):
    """What a segment of ``segments.parquet`` holds: the one vocabulary of its ``kind`` column, which the
    generator, the history policies, the importers and the recorder write, the trace reader checks, and the
    token drawer (its corpus), the text renderer (its message role), the statistics and the cache-break
    attribution read. A ``StrEnum`` so a member *is* its on-disk string."""

    SYSTEM = "system"
    TOOLS = "tools"  # tool definitions
    DOCUMENT = "document"
    TASK = "task"  # the session's opening request
    USER = "user"
    ASSISTANT = "assistant"
    TOOL_CALL = "tool_call"
    TOOL_OUTPUT = "tool_output"
    REASONING = "reasoning"
    SUMMARY = "summary"  # a compaction's summary of the history it replaced
    VOLATILE = "volatile"  # a value that changes every request (a timestamp)
    TEMPLATE = "template"  # chat-template text between messages (text mode, recorded traces)
    IMPORTED = "imported"  # tokens of an imported trace without message structure


class TokenizerInfo(BaseModel):
    """The tokenizer the token ids came from (null for imported traces without `--tokenizer`; synthetic traces
    know only a vocabulary size)."""

    model_config = ConfigDict(extra="forbid")

    path: str | None
    sha256: str | None
    vocab_size: int | None


class TextModeInfo(BaseModel):
    """Text mode (`generate --text`): how the chat template was applied."""

    model_config = ConfigDict(extra="forbid")

    chat_template_sha256: str | None = None  # null for recorded traces: the upstream applied its template
    template_segments: int = 0
    resized_segments: int = 0
    recorded: bool = False  # `kvscope record`: messages as the agent sent them, token ids from the upstream
    # Imported transcripts: prompts stored whole (split where they leave the parent's prompt) because their
    # message parts did not tokenise the same apart as joined.
    prompts_split_by_prefix: int = 0


class TraceFile(VersionedFile):
    FORMAT = FORMAT
    SUPPORTED_VERSIONS = (VERSION,)

    format: Literal["kvscope-trace"] = "kvscope-trace"
    version: int = VERSION
    name: str | None = None
    # The validated workload spec as a dict (its model, WorkloadSpec, is the schema of the YAML file) or an
    # importer's description of its source ({"importer", "source", ...}, different per importer): open here.
    spec: dict[str, Any] | None = None
    seed: int | None = None
    scale: float | None = None
    tokenizer: TokenizerInfo | None = None
    block_size_hint: int | None = None  # native block size of imported block-id traces
    # The spec's arrival block, already validated by workloads.spec (a union of arrival processes); the
    # replayer reads `closed_loop.concurrency` from it.
    arrival: dict[str, Any] | None = None
    truncated_sessions: int = 0
    text: TextModeInfo | None = None
    # Derived counts, always written; a hand-made trace.json may leave them out (the reader recounts).
    num_requests: int | None = None
    num_sessions: int | None = None
    num_segments: int | None = None
    num_segment_tokens: int | None = None
    created_by: str | None = None
    # Imported agent transcripts: whose usage the observed_* columns carry ("anthropic", "openai", …), totals a
    # format records only per trajectory, and what the source does not record (system prompt, tools, …).
    # `kvscope record`: where the trace came from and the recording's facts (upstream with credentials removed,
    # exchange counts, tokenizer source): open, it grows with the proxy.
    source: str | None = None
    record: dict[str, Any] | None = None
    observed_usage: str | None = None
    observed_totals: dict[str, Any] | None = None
    not_recorded: list[str] | None = None


def read_trace_file(path: str | Path) -> TraceFile:
    """The validated `trace.json` (missing, corrupt, of another format or version: `TraceFileError`)."""
    return read_versioned(path, TraceFile, TraceFileError)


def write_trace_file(path: str | Path, meta: dict[str, Any]) -> Path:
    """Validate the metadata and write it with sorted keys (same spec + seed: byte-identical files)."""
    model = validate_data(f"{path}: trace metadata", meta, TraceFile, TraceFileError)
    return write_versioned(path, model, sort_keys=True)
