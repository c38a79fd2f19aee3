"""Per-request records: appended to disk as requests complete, compacted to Parquet at the end.

Crash safety: records are appended as whole JSON lines with `os.write` on an O_APPEND file descriptor (no
user-space buffer that a crash could lose half of). With `flush_interval_s=0` every record is written the
moment it completes; with the replay default (`flush_interval_s=0.05`) completed records are batched and written
together at most 50 ms later (or as soon as 256 are pending), in one `write` of complete lines. After a
`kill -9` of kvscope, therefore, every record that completed more than `flush_interval_s` before the kill is
on disk (the kernel holds it even though the process is gone) and no line is half-written; only a power loss or
a full disk can leave a torn final line. `read_records` drops a torn final line with a warning that names the
line, and rejects any other malformed line with its number. `compact` turns the JSONL into `requests.parquet`
once the run ends; the JSONL stays as the raw log.
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from kvscope.harness.common.errors import KvscopeError

JSONL_NAME = "requests.jsonl"
PARQUET_NAME = "requests.parquet"
#: Version of the records' columns, kept in the Parquet file's metadata (``kvscope_records_version``).
#: 2 added ``predictor`` and ``predicted_cached_tokens_sequential``; a file without them (version 1, no
#: metadata) is read as the sequential simulator's predictions, which is what every such run recorded.
#: 3 added model routing's columns (``model``, ``route_reason``, ``escalated``, ``mean_logprob`` and the
#: ``wasted_*`` facts of an escalated request's discarded small-model attempt); a version-2 file is read with
#: them empty (no model routing: ``escalated`` False, no wasted attempt), which is what such a run did.
RECORDS_VERSION = 3
RECORDS_VERSION_KEY = b"kvscope_records_version"
#: The models a run's ``predicted_cached_tokens`` may come from.  ``sequential``: the vLLM-exact simulator,
#: online, one request at a time (harness/replay/predict.py; exact when requests do not overlap).
#: ``scheduler-replay-informed``: the scheduler model (harness/cachemodel/scheduler.py) run after the replay
#: on the run's observed send, token and finish times with a calibration of the server's step costs.
PREDICTORS = ("sequential", "scheduler-replay-informed")


class RecordsError(ValueError):
    """A records file is unreadable; the message names the file and line."""


class DiskFullError(KvscopeError):
    """The disk filled up while records were written; the JSONL was cut back to its last whole line."""


#: write errors after which a log cannot grow: disk full, quota, the file size limit (``ulimit -f``)
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


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
    #: The run's prediction of ``cached_tokens``: from the model that ``predictor`` names.
    predicted_cached_tokens: int | None = None
    #: Which model produced ``predicted_cached_tokens`` (:data:`PREDICTORS`); None when nothing was predicted.
    predictor: str | None = None
    #: The sequential simulator's prediction, made online at send time; equal to ``predicted_cached_tokens``
    #: when ``predictor`` is ``sequential``, kept beside the scheduler model's when that one replaced it.
    predicted_cached_tokens_sequential: int | None = None
    output_tokens: int = 0  # tokens received
    planned_output_tokens: int = 0
    finish_reason: str | None = None
    http_status: int | None = None
    error_class: str | None = None
    error: str | None = None
    in_window: bool = True  # False inside the warm-up / cool-down windows
    length_mismatch: bool = False  # tokens received != max_tokens asked (ignore_eos) or != usage.completion_tokens
    output_text_head: str = ""  # first 200 characters of the generated text (untrusted: reports escape it)
    output_token_ids: list[int] = field(default_factory=list)  # the generated tokens (kvscope speculate RUN)
    # Model routing (replay with a routing spec, harness/replay/model_router.py); empty otherwise.  One record
    # per request as before: the model that served it, and an escalation's discarded first attempt folded in
    # as ``wasted_*`` fields, so every summary still counts one request once.
    model: str | None = None  # the routing spec's name of the model that served it
    route_reason: str | None = None  # why (the policy's reason; "escalated: ..." for an escalation)
    escalated: bool = False  # sent to the small model first, then re-sent to this one
    #: mean token log-probability of the first attempt's answer (the cascade's signal), where it was asked for
    mean_logprob: float | None = None
    wasted_model: str | None = None  # the escalated request's discarded attempt: its model ...
    wasted_cached_tokens: int | None = None  # ... that server's cached_tokens for it ...
    wasted_predicted_cached_tokens: int | None = None  # ... the prediction of them ...
    wasted_output_tokens: int = 0  # ... the answer it generated and threw away ...
    wasted_sent_s: float | None = None  # ... and its times (run clock); TTFT with the escalation: first_token_s
    wasted_first_token_s: float | None = None  # minus wasted_sent_s
    wasted_done_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error_class is None

    def to_json_line(self) -> bytes:
        return orjson.dumps(self, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)


RECORD_FIELDS = [f for f in RequestRecord.__dataclass_fields__]


class RecordWriter:
    """Append-only JSONL writer: whole lines, `os.write` on an O_APPEND descriptor, optionally batched.

    `flush_interval_s > 0` (inside a running event loop) batches records and writes them at most that long after
    the first of them completed, or once `max_pending` are waiting; 0 writes each record immediately.
    """

    def __init__(self, run_dir: Path, flush_interval_s: float = 0.0, max_pending: int = 256,
                 file_name: str = JSONL_NAME) -> None:
        self.path = Path(run_dir) / file_name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size  # bytes of whole lines on disk
        self.lines_on_disk = self.path.read_bytes().count(b"\n") if self._size else 0
        self._disk_full: DiskFullError | None = None
        self.count = 0
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self._pending: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None

    def write(self, record: RequestRecord) -> None:
        self.write_line(record.to_json_line())

    def write_line(self, line: bytes) -> None:
        if self._disk_full is not None:
            raise self._disk_full
        self.count += 1
        if self.flush_interval_s <= 0:
            self._write_all(line)
            return
        self._pending.append(line)
        if len(self._pending) >= self.max_pending:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(self.flush_interval_s, self._flush_from_timer)

    def _write_all(self, data: bytes) -> None:
        view, done = memoryview(data), 0
        try:
            while done < len(data):
                done += os.write(self._fd, view[done:])
        except OSError as exc:
            if exc.errno not in _FULL_ERRNOS:
                raise
            self._give_up_disk_full(data, done, exc.errno)
        self._size += len(data)
        self.lines_on_disk += data.count(b"\n")

    def _full_error(self, errnum: int | None) -> DiskFullError:
        what = "file size limit reached" if errnum == errno.EFBIG else "disk full"
        return DiskFullError(f"{what} writing {self.path}: {self.lines_on_disk} records kept in {self.path.name}")

    def _give_up_disk_full(self, data: bytes, written: int, errnum: int | None = None) -> None:
        """Cut a partly written batch back to its last whole line, so the JSONL stays readable, and raise."""
        whole = data.rfind(b"\n", 0, written) + 1
        self._size += whole
        self.lines_on_disk += data.count(b"\n", 0, whole)
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            pass
        self._pending.clear()
        self._disk_full = self._full_error(errnum)
        raise self._disk_full from None

    def _flush_from_timer(self) -> None:
        try:
            self.flush()
        except DiskFullError:
            pass  # raised again by the next write and by close(), where the caller sees it

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending and self._fd >= 0:
            data = b"".join(self._pending)
            self._pending.clear()
            self._write_all(data)

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            if self._disk_full is None:
                self.flush()
                os.fsync(self._fd)
        except OSError as exc:
            if exc.errno not in _FULL_ERRNOS:
                raise
            self._disk_full = self._full_error(exc.errno)
        finally:
            os.close(self._fd)
            self._fd = -1
        if self._disk_full is not None:
            raise self._disk_full

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TornRecordWarning(UserWarning):
    """The last line of a records file is incomplete (the writer died mid-write); it was dropped."""


def read_jsonl_records(path: Path) -> list[dict[str, Any]]:
    """Rows of a records JSONL. A torn final line (no newline, not JSON) is dropped with a warning naming it;
    any other malformed line -- or an unreadable file -- raises `RecordsError` with the file and line number."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecordsError(f"{path}: unreadable records file ({exc.__class__.__name__}: {exc})") from exc
    lines = raw.split(b"\n")
    rows: list[dict[str, Any]] = []
    last = len(lines) - 1  # the text after the final newline ("" when the file ends cleanly)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            if i == last:  # the writer died mid-line: everything before it is intact
                warnings.warn(f"{path}: line {i + 1}: incomplete final record dropped ({len(line)} bytes; "
                              "the writer was killed mid-write, or the disk was full)", TornRecordWarning, stacklevel=2)
                break
            raise RecordsError(f"{path}: line {i + 1}: not a JSON record ({exc})") from exc
        if not isinstance(row, dict) or "request_id" not in row:
            raise RecordsError(f"{path}: line {i + 1}: not a kvscope request record")
        rows.append(row)
    return rows


def records_frame(rows: list[dict[str, Any]]):
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

    df = pd.DataFrame(rows, columns=RECORD_FIELDS)
    if "length_mismatch" in df and len(df):  # records written before the column existed
        df["length_mismatch"] = [bool(x) if x is not None and x == x else False for x in df["length_mismatch"]]
    if rows and "predictor" not in rows[0]:  # a version-1 log
        df = upgrade_records(df.drop(columns=["predictor", "predicted_cached_tokens_sequential"]))
    if rows and "escalated" not in rows[0]:  # a version-2 log
        df = upgrade_records(df.drop(columns=ROUTING_FIELDS))
    return df


#: the columns version 3 added (model routing)
ROUTING_FIELDS = RECORD_FIELDS[RECORD_FIELDS.index("model"):]
_ROUTING_DEFAULTS = {"escalated": False, "wasted_output_tokens": 0}


def upgrade_records(df):
    """Older records as the current version.  Version 1 (no ``predictor`` column): their predictions were the
    sequential simulator's, so that is the predictor wherever there is a prediction, and the sequential column
    is a copy.  Version 2 (no model-routing columns): no routing, so no model name, no escalation, no wasted
    attempt."""
    if "predictor" in df.columns and "escalated" in df.columns:
        return df
    df = df.copy()
    if "predictor" not in df.columns:
        pred = df["predicted_cached_tokens"] if "predicted_cached_tokens" in df else None
        df["predictor"] = None if pred is None else pred.notna().map({True: "sequential", False: None})
        df["predicted_cached_tokens_sequential"] = pred
    for col in ROUTING_FIELDS:
        if col not in df.columns:
            df[col] = _ROUTING_DEFAULTS.get(col)
    return df


def compact(run_dir: Path) -> Path:
    """Write `requests.parquet` from the JSONL (sorted by send time)."""
    run_dir = Path(run_dir)
    rows = read_jsonl_records(run_dir / JSONL_NAME) if (run_dir / JSONL_NAME).exists() else []
    df = records_frame(rows).sort_values(["sent_s", "request_id", "attempt"], kind="stable").reset_index(drop=True)
    return write_records_parquet(run_dir, df)


_INT_COLUMNS = ("cached_tokens", "predicted_cached_tokens", "predicted_cached_tokens_sequential",
                "server_prompt_tokens", "http_status", "wasted_cached_tokens", "wasted_predicted_cached_tokens")
_STRING_COLUMNS = ("predictor", "model", "route_reason", "wasted_model")


def write_records_parquet(run_dir: Path, df) -> Path:
    """Write ``requests.parquet`` atomically (temporary file + rename), nullable integer columns as Int64 and
    the columns' version in the file's metadata."""
    import pyarrow as pa  # deferred: pyarrow is heavy, importing this module must not load it
    import pyarrow.parquet as pq  # deferred: pyarrow is heavy, importing this module must not load it

    df = df.copy()
    for col in _INT_COLUMNS:
        if col in df:
            df[col] = df[col].astype("Int64")
    for col in _STRING_COLUMNS:
        if col in df:
            df[col] = df[col].astype("string")
    for col in ("mean_logprob", "wasted_sent_s", "wasted_first_token_s", "wasted_done_s"):
        if col in df:
            df[col] = df[col].astype("float64")
    if "escalated" in df:
        df["escalated"] = df["escalated"].astype(bool)
    table = pa.Table.from_pandas(df, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta[RECORDS_VERSION_KEY] = str(RECORDS_VERSION).encode()
    table = table.replace_schema_metadata(meta)
    out = Path(run_dir) / PARQUET_NAME
    tmp = out.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    tmp.replace(out)
    return out


def read_records(run_dir: Path):
    """All records of a run as a DataFrame: the Parquet file if the run finished, else the JSONL log."""
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

    run_dir = Path(run_dir)
    pq_path = run_dir / PARQUET_NAME
    if pq_path.exists():
        try:
            return upgrade_records(pd.read_parquet(pq_path))
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for corrupt files
            raise RecordsError(f"{pq_path}: unreadable Parquet ({exc})") from exc
    jl = run_dir / JSONL_NAME
    if not jl.exists():
        raise RecordsError(f"{run_dir}: no {PARQUET_NAME} or {JSONL_NAME} (not a kvscope run directory?)")
    return records_frame(read_jsonl_records(jl))
