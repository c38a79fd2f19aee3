"""Per-request records: appended to disk as requests complete, compacted to Parquet at the end.

Crash safety: each record is one JSON line written with a single `write` on an unbuffered file, so after a
`kill -9` of kvscope every finished record is on disk (the OS holds it) and at most the final line is torn.
`read_records` skips a torn final line and reports any other malformed line with its number.
`compact` turns the JSONL into `requests.parquet` once the run ends; the JSONL stays as the raw log.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import orjson

JSONL_NAME = "requests.jsonl"
PARQUET_NAME = "requests.parquet"


class RecordsError(ValueError):
    """A records file is unreadable; the message names the file and line."""


@dataclass(slots=True)
class RequestRecord:
    """One request as sent and as answered. Times are seconds from the run's start (monotonic clock)."""

    request_id: int  # trace request id
    session_id: str
    step: int
    attempt: int = 0  # 0 for the first try; retries are separate records
    endpoint_index: int = 0
    mode: str = "recorded"
    transition: str | None = None
    scheduled_s: float = math.nan  # when the schedule wanted it sent
    sent_s: float = math.nan
    first_token_s: float | None = None
    done_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None  # (e2e - ttft) / (output_tokens - 1)
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between successive token-carrying chunks
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk (>1 under speculative decoding)
    prompt_tokens: int = 0  # as sent
    server_prompt_tokens: int | None = None
    cached_tokens: int | None = None  # server's usage.prompt_tokens_details.cached_tokens
    predicted_cached_tokens: int | None = None  # simulator on the ids actually sent
    output_tokens: int = 0  # tokens received
    planned_output_tokens: int = 0
    finish_reason: str | None = None
    http_status: int | None = None
    error_class: str | None = None
    error: str | None = None
    in_window: bool = True  # False inside the warm-up / cool-down windows

    @property
    def ok(self) -> bool:
        return self.error_class is None

    def to_json_line(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"


RECORD_FIELDS = [f for f in RequestRecord.__dataclass_fields__]


class RecordWriter:
    """Append-only JSONL writer, one `os.write` per record (atomic for lines below the pipe buffer size)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / JSONL_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.count = 0

    def write(self, record: RequestRecord) -> None:
        os.write(self._fd, record.to_json_line())
        self.count += 1

    def write_many(self, records: Iterable[RequestRecord]) -> None:
        data = b"".join(r.to_json_line() for r in records)
        if data:
            os.write(self._fd, data)
            self.count += data.count(b"\n")

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl_records(path: Path) -> list[dict[str, Any]]:
    """Rows of a records JSONL; a torn last line (killed writer) is dropped, other bad lines are errors."""
    raw = Path(path).read_bytes()
    lines = raw.split(b"\n")
    rows: list[dict[str, Any]] = []
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(orjson.loads(line))
        except orjson.JSONDecodeError as exc:
            if i == last:  # the writer died mid-line: everything before it is intact
                break
            raise RecordsError(f"{path}: line {i + 1}: not a JSON record ({exc})") from exc
    return rows


def records_frame(rows: list[dict[str, Any]]):
    import pandas as pd

    df = pd.DataFrame(rows, columns=RECORD_FIELDS)
    return df


def compact(run_dir: Path) -> Path:
    """Write `requests.parquet` from the JSONL (sorted by send time)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run_dir = Path(run_dir)
    rows = read_jsonl_records(run_dir / JSONL_NAME) if (run_dir / JSONL_NAME).exists() else []
    df = records_frame(rows).sort_values(["sent_s", "request_id", "attempt"], kind="stable").reset_index(drop=True)
    for col in ("cached_tokens", "predicted_cached_tokens", "server_prompt_tokens", "http_status"):
        df[col] = df[col].astype("Int64")
    table = pa.Table.from_pandas(df, preserve_index=False)
    out = run_dir / PARQUET_NAME
    tmp = out.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    tmp.replace(out)
    return out


def read_records(run_dir: Path):
    """All records of a run as a DataFrame: the Parquet file if the run finished, else the JSONL log."""
    import pandas as pd

    run_dir = Path(run_dir)
    pq_path = run_dir / PARQUET_NAME
    if pq_path.exists():
        try:
            return pd.read_parquet(pq_path)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for corrupt files
            raise RecordsError(f"{pq_path}: unreadable Parquet ({exc})") from exc
    jl = run_dir / JSONL_NAME
    if not jl.exists():
        raise RecordsError(f"{run_dir}: no {PARQUET_NAME} or {JSONL_NAME} (not a kvscope run directory?)")
    return records_frame(read_jsonl_records(jl))
