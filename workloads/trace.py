"""The trace directory (format version 1): ``trace.json``, ``segments.parquet``, ``requests.parquet``.

Prompts are stored as lists of segment ids; a segment's tokens are stored once. An append-only agent session
whose prompts grow to 100k tokens therefore costs its distinct tokens once, not the sum of its prompts. See
``docs/architecture.md`` (Trace directory) for the column reference.

In memory the segments live in one flat int32 array plus offsets, so ``segment_tokens`` is a zero-copy view
and ``prompt_token_ids`` is a single ``np.concatenate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kvscope.workloads.prefix import Transition
from kvscope.workloads.trace_schema import FORMAT, VERSION, SegmentKind, read_trace_file, write_trace_file
from kvscope.workloads.errors import TraceFileError, WorkloadError
from kvscope.workloads.versioned_file import naming_write_errors

# The nullable observed_* columns (provider usage of imported transcripts) need no version bump: readers fill
# absent optional columns with nulls.

CREATED_BY = "kvscope workloads 0.1.0"

_SEGMENT_KINDS = frozenset(SegmentKind)
_TRANSITIONS = frozenset(Transition)

REQUEST_SCHEMA = pa.schema([
    ("request_id", pa.int64()),
    ("session_id", pa.string()),
    ("step", pa.int32()),
    ("parent_request_id", pa.int64()),
    ("arrival_s", pa.float64()),
    ("session_start_s", pa.float64()),
    ("think_time_s", pa.float64()),
    ("tool_latency_s", pa.float64()),
    ("prompt_segment_ids", pa.list_(pa.int64())),
    ("prompt_tokens", pa.int32()),
    ("output_segment_id", pa.int64()),
    ("output_tokens", pa.int32()),
    ("output_reasoning_tokens", pa.int32()),
    ("max_tokens", pa.int32()),
    ("cache_salt", pa.string()),
    ("tenant", pa.int32()),
    ("transition", pa.string()),
    ("input_kind", pa.string()),
    ("static_prefix_tokens", pa.int32()),
    ("messages", pa.string()),
    # Provider usage as the recorded agent saw it (importers of real transcripts); null when not recorded.
    ("observed_prompt_tokens", pa.int64()),
    ("observed_input_tokens", pa.int64()),
    ("observed_cache_read_input_tokens", pa.int64()),
    ("observed_cache_creation_input_tokens", pa.int64()),
    ("observed_cached_tokens", pa.int64()),
    ("observed_output_tokens", pa.int64()),
])
REQUEST_COLUMNS = [f.name for f in REQUEST_SCHEMA]


def _read_parquet(path: Path, required: list[str], dictionary: list[str] | None = None) -> pa.Table:
    """A trace table; a missing, truncated or foreign file is an error naming the file. ``dictionary``:
    string columns read dictionary-encoded."""
    if not path.is_file():
        raise TraceFileError(f"{path}: missing (a trace directory holds trace.json, segments.parquet, "
                             "requests.parquet)")
    try:
        table = pq.read_table(path, read_dictionary=dictionary)
    except (pa.ArrowException, OSError) as exc:
        raise TraceFileError(f"{path}: unreadable or truncated Parquet file ({exc})") from None
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise TraceFileError(f"{path}: missing column(s) {', '.join(missing)}")
    return table


@dataclass(frozen=True)
class TraceRequest:
    """One request row, with numpy arrays where the column is a list."""

    request_id: int
    session_id: str
    step: int
    parent_request_id: int
    arrival_s: float
    session_start_s: float
    think_time_s: float
    tool_latency_s: float
    prompt_segment_ids: np.ndarray
    prompt_tokens: int
    output_segment_id: int
    output_tokens: int
    output_reasoning_tokens: int
    max_tokens: int
    cache_salt: str | None
    tenant: int
    transition: str
    input_kind: str | None
    static_prefix_tokens: int
    messages: str | None
    observed_prompt_tokens: int | None = None
    observed_input_tokens: int | None = None
    observed_cache_read_input_tokens: int | None = None
    observed_cache_creation_input_tokens: int | None = None
    observed_cached_tokens: int | None = None
    observed_output_tokens: int | None = None


OBSERVED_COLUMNS = [f.name for f in REQUEST_SCHEMA if f.name.startswith("observed_")]


class Trace:
    """A token-exact workload: segments plus requests that reference them.

    Build one with :class:`TraceBuilder` (generators, importers) or :meth:`Trace.read`.
    """

    def __init__(self, meta: dict, seg_tokens: np.ndarray, seg_offsets: np.ndarray, seg_kinds: Sequence[str],
                 requests: pd.DataFrame) -> None:
        self.meta = meta
        self.seg_tokens = np.ascontiguousarray(seg_tokens, dtype=np.int32)
        self.seg_offsets = np.ascontiguousarray(seg_offsets, dtype=np.int64)
        self.seg_kinds = np.asarray(seg_kinds, dtype=object)
        self.requests = requests.reset_index(drop=True)
        for c in ("cache_salt", "messages", "input_kind", "transition", "session_id"):
            col = self.requests[c].astype(object)
            self.requests[c] = col.where(col.notna(), None)
        for c in OBSERVED_COLUMNS:  # nullable integers stay integers (pandas' Int64), not floats with NaN
            self.requests[c] = self.requests[c].astype("Int64")
        self._prompt_ids = _segment_id_views(self.requests["prompt_segment_ids"])
        self.requests["prompt_segment_ids"] = pd.Series(self._prompt_ids, index=self.requests.index,
                                                        dtype=object)
        self._out_ids = self.requests["output_segment_id"].to_numpy(np.int64)
        self._earlier: dict[int, tuple[list[int], int]] | None = None  # request id -> (its session, its place)

    # ------------------------------------------------------------------ sizes
    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_segments(self) -> int:
        return len(self.seg_kinds)

    @property
    def num_sessions(self) -> int:
        return int(self.requests["session_id"].nunique())

    def segment_lengths(self) -> np.ndarray:
        return np.diff(self.seg_offsets)

    # ------------------------------------------------------------------ tokens
    def segment_tokens(self, segment_id: int) -> np.ndarray:
        """Zero-copy int32 view of one segment's tokens."""
        return self.seg_tokens[self.seg_offsets[segment_id]:self.seg_offsets[segment_id + 1]]

    def prompt_segment_ids(self, request_id: int) -> np.ndarray:
        return self._prompt_ids[request_id]

    def prompt_token_ids(self, request_id: int, substitute: Mapping[int, Sequence[int] | np.ndarray] | None = None
                         ) -> np.ndarray:
        """The prompt as an int32 array. ``substitute`` maps segment ids to replacement tokens: live replay
        passes ``{trace.output_segment_id(parent): tokens_the_server_generated}``."""
        ids = self._prompt_ids[request_id]
        if not substitute:
            if len(ids) == 1:
                return self.segment_tokens(int(ids[0])).copy()
            if not len(ids):
                return np.zeros(0, np.int32)
            # one gather, not a slice per segment (generated prompts hold hundreds of segments)
            starts = self.seg_offsets[ids]
            lengths = self.seg_offsets[ids + 1] - starts
            before = np.cumsum(lengths) - lengths
            return self.seg_tokens[np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()))]
        parts = [np.asarray(substitute[int(s)], dtype=np.int32) if int(s) in substitute
                 else self.segment_tokens(int(s)) for s in ids]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def live_substitute(self, request_id: int, generated: Mapping[int, Sequence[int] | np.ndarray]
                        ) -> dict[int, Sequence[int] | np.ndarray]:
        """What a live replay put in place of the planned answers in this request's prompt: the output segment
        of each earlier request of its session that the server answered (``generated``: request id -> the
        token ids it generated) maps to those tokens. ``prompt_token_ids(rid, trace.live_substitute(rid, g))``
        is the prompt a live replay sent, so analyses read a live run on the tokens the server saw, not on the
        trace's plan."""
        if not generated:
            return {}
        if self._earlier is None:  # each session's requests in step order, and where each request stands in it
            order = self.requests.sort_values(["session_id", "step"], kind="stable")
            sessions = [g.astype(int).tolist() for _, g in order.groupby("session_id", sort=False)["request_id"]]
            self._earlier = {rid: (ids, k) for ids in sessions for k, rid in enumerate(ids)}
        ids, k = self._earlier.get(int(request_id), ((), 0))
        return {int(self._out_ids[q]): generated[q] for q in ids[:k] if q in generated and self._out_ids[q] >= 0}

    def output_segment_id(self, request_id: int) -> int:
        """Segment holding the planned output (-1 if only a length is known). Later prompts of the session
        reference this id where the history carries this answer."""
        return int(self._out_ids[request_id])

    def output_token_ids(self, request_id: int) -> np.ndarray | None:
        """Planned ("recorded") output tokens, or None when the trace only knows the output length."""
        sid = int(self._out_ids[request_id])
        return None if sid < 0 else self.segment_tokens(sid).copy()

    def segment_map(self, request_id: int) -> list[tuple[str, int, int, int]]:
        """``(kind, start, n_tokens, segment_id)`` for each segment of the prompt, in order."""
        ids = self._prompt_ids[request_id]
        lengths = self.seg_offsets[ids + 1] - self.seg_offsets[ids]
        starts = np.cumsum(lengths) - lengths
        kinds = map(str, self.seg_kinds[ids].tolist())
        return list(zip(kinds, starts.tolist(), lengths.tolist(), ids.tolist()))

    def request(self, request_id: int) -> TraceRequest:
        row = self.requests.iloc[request_id].to_dict()
        row["prompt_segment_ids"] = self._prompt_ids[request_id]
        return TraceRequest(**{k: _py(row[k]) if k != "prompt_segment_ids" else row[k] for k in REQUEST_COLUMNS})

    def iter_requests(self) -> Iterator[TraceRequest]:
        cols = {c: self.requests[c].tolist() for c in REQUEST_COLUMNS if c != "prompt_segment_ids"}
        for i in range(len(self.requests)):
            yield TraceRequest(prompt_segment_ids=self._prompt_ids[i], **{c: _py(v[i]) for c, v in cols.items()})

    # ------------------------------------------------------------------ io
    def write(self, path: str | Path) -> Path:
        """Write the trace directory; an OSError (a full disk included) names it."""

        out = Path(path)
        with naming_write_errors(out):
            return self._write(out)

    def _write(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        lengths = self.segment_lengths()
        offsets32 = self.seg_offsets.astype(np.int64)
        tok = pa.array(self.seg_tokens, type=pa.int32())
        if offsets32[-1] < 2**31:
            lists = pa.ListArray.from_arrays(pa.array(offsets32.astype(np.int32)), tok)
        else:
            lists = pa.LargeListArray.from_arrays(pa.array(offsets32), tok)
        seg = pa.table({"segment_id": pa.array(np.arange(len(lengths), dtype=np.int64)),
                        "kind": pa.array(self.seg_kinds.tolist(), type=pa.string()),
                        "token_ids": lists})
        pq.write_table(seg, out / "segments.parquet", compression="zstd")
        pq.write_table(self.requests_table(), out / "requests.parquet", compression="zstd")
        meta = {**self.meta, "format": FORMAT, "version": VERSION, "num_requests": self.num_requests,
                "num_sessions": self.num_sessions, "num_segments": self.num_segments,
                "num_segment_tokens": int(len(self.seg_tokens))}
        write_trace_file(out / "trace.json", meta)
        return out

    def requests_table(self) -> pa.Table:
        df = self.requests
        counts = np.fromiter((len(x) for x in self._prompt_ids), dtype=np.int64, count=len(self._prompt_ids))
        offs = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=offs[1:])
        flat = np.concatenate(self._prompt_ids) if self._prompt_ids else np.zeros(0, np.int64)
        arrays = []
        for f in REQUEST_SCHEMA:
            if f.name == "prompt_segment_ids":
                arrays.append(pa.ListArray.from_arrays(pa.array(offs), pa.array(flat, type=pa.int64())))
            else:
                arrays.append(pa.array(df[f.name].tolist(), type=f.type, from_pandas=True))
        return pa.Table.from_arrays(arrays, schema=REQUEST_SCHEMA)

    @classmethod
    def read(cls, path: str | Path) -> "Trace":
        p = Path(path)
        if not p.is_dir():
            raise TraceFileError(f"{p}: no such trace directory")
        meta = read_trace_file(p / "trace.json").model_dump(mode="json")
        seg = _read_parquet(p / "segments.parquet", ["segment_id", "kind", "token_ids"], dictionary=["kind"])
        ids = seg.column("segment_id").to_numpy()
        if not np.array_equal(ids, np.arange(len(ids))):
            raise ValueError(f"{p}: segment ids must be 0..N-1 in order")
        lists = seg.column("token_ids").combine_chunks()
        offsets = lists.offsets.to_numpy().astype(np.int64)
        tokens = lists.values.to_numpy().astype(np.int32)
        if offsets[0] != 0:
            tokens, offsets = tokens[offsets[0]:], offsets - offsets[0]
        kinds = _dictionary_strings(seg.column("kind"))
        del seg, lists
        req = _read_parquet(p / "requests.parquet", ["request_id", "session_id", "prompt_segment_ids"])
        prompt_ids = req.column("prompt_segment_ids").combine_chunks()
        if isinstance(prompt_ids, pa.ChunkedArray):  # no chunks at all
            prompt_ids = pa.array([], type=pa.list_(pa.int64()))
        bad = _rows_with_unknown_segments(prompt_ids, len(ids))
        if bad:
            raise TraceFileError(f"{p / 'requests.parquet'}: row {bad[0]}: prompt_segment_ids refer to segments that "
                                 f"do not exist ({len(bad)} row(s) affected)")
        for f in REQUEST_SCHEMA:  # tolerate traces written before optional columns existed
            if f.name not in req.column_names:
                req = req.append_column(f.name, pa.nulls(len(req), type=f.type))
        # The segment ids go to numpy once, as views into one flat array (see _segment_id_views), not through
        # pandas (a copy of all 42 M ids of 5,000 generated sessions, beside Arrow's)
        df = req.select([c for c in REQUEST_COLUMNS if c != "prompt_segment_ids"]).to_pandas()
        del req
        _check_vocabulary(p / "segments.parquet", "kind", kinds, SegmentKind)
        _check_vocabulary(p / "requests.parquet", "transition", df["transition"].to_numpy(object), Transition)
        df.insert(REQUEST_COLUMNS.index("prompt_segment_ids"), "prompt_segment_ids", _list_views(prompt_ids))
        del prompt_ids
        # Arrow's allocator keeps what the tables freed: hand it back (5,000 generated sessions: ~0.7 GB)
        pa.default_memory_pool().release_unused()
        return cls(meta, tokens, offsets, kinds, df)

    def equals(self, other: "Trace") -> bool:
        """Same segments and same request rows (metadata other than the spec may differ)."""
        return (np.array_equal(self.seg_offsets, other.seg_offsets) and np.array_equal(self.seg_tokens, other.seg_tokens)
                and list(self.seg_kinds) == list(other.seg_kinds)
                and self.requests_table().equals(other.requests_table()))


def _check_vocabulary(path: Path, column: str, values: np.ndarray, vocabulary: type[SegmentKind] | type[Transition]
                      ) -> None:
    """A trace whose ``column`` holds a value outside its vocabulary is refused, naming the first such row: every
    reader (statistics, attribution, the cache model's labels) assumes the enum's values. Nulls pass (columns
    absent from older traces read as nulls)."""
    known = frozenset(vocabulary)
    unknown = [v for v in pd.unique(values) if not pd.isna(v) and v not in known]
    if not unknown:
        return
    bad = unknown[0]
    row = int(np.flatnonzero(values == bad)[0])
    raise TraceFileError(f"{path}: row {row}: unknown {column} {bad!r}; known: {', '.join(vocabulary)}")


def _segment_id_views(cells: Sequence[Any]) -> list[np.ndarray]:
    """Each request's prompt segment ids as a view into one flat array, ``int32`` while the ids fit (a
    5,000-session generated trace holds 42 M of them: 170 MB, not 340 MB of ``int64`` and a header per row
    array). Cells that already are such views (:meth:`Trace.read`) are kept as they are."""
    if all(isinstance(x, np.ndarray) and x.dtype == np.int32 for x in cells):
        return list(cells)
    arrays = [np.asarray(x, dtype=np.int64).reshape(-1) for x in cells]
    flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    if not len(flat) or (int(flat.min()) >= 0 and int(flat.max()) < 2**31):
        flat = flat.astype(np.int32)
    return np.split(flat, np.cumsum([len(a) for a in arrays])[:-1]) if arrays else []


def _list_views(lists: pa.Array) -> list[np.ndarray]:
    """A list<int> column without nulls as int32 views into one flat array (as :func:`_segment_id_views`)."""
    if not len(lists):
        return []
    offsets = lists.offsets.to_numpy().astype(np.int64)
    flat = lists.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_numpy(zero_copy_only=False)
    flat = flat.astype(np.int32 if not len(flat) or int(flat.max()) < 2**31 else np.int64)
    return np.split(flat, offsets[1:-1] - offsets[0])


def _dictionary_strings(column: pa.ChunkedArray) -> np.ndarray:
    """A dictionary-encoded string column as an object array of its few distinct strings (one Python string
    per segment kind, not one per segment: a million segments took 60 MB of copies of 13 names)."""
    chunks = [c if isinstance(c, pa.DictionaryArray) else c.dictionary_encode() for c in column.chunks]
    out = np.empty(len(column), dtype=object)
    at = 0
    for c in chunks:
        names = np.array(c.dictionary.to_pylist() + [None], dtype=object)
        codes = c.indices.fill_null(len(c.dictionary)).to_numpy(zero_copy_only=False)
        out[at:at + len(c)] = names[codes]
        at += len(c)
    return out


def _rows_with_unknown_segments(lists: pa.Array, num_segments: int) -> list[int]:
    """Rows whose prompt_segment_ids are null or name a segment that does not exist, vectorised (a
    5,000-session trace holds 42 M segment references: as Python ints they took 1.5 GB)."""
    bad_rows = np.flatnonzero(lists.is_null().to_numpy(zero_copy_only=False)).tolist()
    offsets = lists.offsets.to_numpy().astype(np.int64)
    values = lists.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    flat = values.to_numpy(zero_copy_only=False) if values.null_count == 0 else \
        values.fill_null(-1).to_numpy(zero_copy_only=False)
    bad_at = np.flatnonzero((flat < 0) | (flat >= num_segments)) + offsets[0]
    bad_rows += (np.searchsorted(offsets, bad_at, side="right") - 1).tolist()
    return sorted(set(bad_rows))


def _py(v: Any) -> Any:
    if v is pd.NA:
        return None
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return None if not isinstance(v, float) else v
    return v


class TraceBuilder:
    """Accumulates segments and request rows, then sorts requests by arrival and numbers them."""

    def __init__(self, max_tokens: int | None = None, budget_hint: str = "") -> None:
        self._tokens: list[np.ndarray] = []
        self._kinds: list[str] = []
        self.rows: list[dict] = []
        # size bound: generation stops with a clear error before the machine runs out of memory
        self.max_tokens, self.budget_hint, self.num_tokens = max_tokens, budget_hint, 0
        self._by_content: dict[tuple[str, bytes], int] = {}  # shared_segment's index

    def check_fits(self, n_tokens: int) -> None:
        """Raise before ``n_tokens`` more would exceed ``max_tokens`` (call it before allocating them)."""
        if self.max_tokens is not None and self.num_tokens + n_tokens > self.max_tokens:
            raise WorkloadError(f"workload too large: more than {self.max_tokens:,} tokens would be generated"
                                + (f" ({self.budget_hint})" if self.budget_hint else ""))

    def add_segment(self, tokens: np.ndarray, kind: SegmentKind | str) -> int:
        if kind not in _SEGMENT_KINDS:
            raise ValueError(f"unknown segment kind {kind!r}; known: {', '.join(SegmentKind)}")
        self.check_fits(len(tokens))
        self.num_tokens += len(tokens)
        self._tokens.append(np.asarray(tokens, dtype=np.int32))
        self._kinds.append(kind)
        return len(self._kinds) - 1

    def shared_segment(self, tokens: np.ndarray, kind: str) -> int:
        """The segment holding exactly these tokens of this kind, added once: recorded and imported histories
        repeat every earlier message in each later request, and a shared segment stores them once."""
        ids = np.asarray(tokens, dtype=np.int32)
        key = (kind, ids.tobytes())
        sid = self._by_content.get(key)
        if sid is None:
            sid = self._by_content[key] = self.add_segment(ids, kind)
        return sid

    def segment_len(self, sid: int) -> int:
        return len(self._tokens[sid])

    def segment(self, sid: int) -> np.ndarray:
        return self._tokens[sid]

    def add_request(self, **row: Any) -> int:
        """Add a row; ``parent_request_id`` refers to the index returned by an earlier ``add_request``."""
        self.rows.append(row)
        return len(self.rows) - 1

    def build(self, meta: dict) -> Trace:
        n = len(self.rows)
        defaults = {"think_time_s": 0.0, "tool_latency_s": 0.0, "output_segment_id": -1, "cache_salt": None,
                    "tenant": 0, "messages": None, "input_kind": None, "static_prefix_tokens": -1,
                    "output_reasoning_tokens": 0, "session_start_s": 0.0, **dict.fromkeys(OBSERVED_COLUMNS)}
        rows = [{**defaults, **r} for r in self.rows]
        bad = next((r["transition"] for r in rows if r.get("transition") not in _TRANSITIONS), None)
        if bad is not None or any("transition" not in r for r in rows):
            raise ValueError(f"unknown transition {bad!r}; known: {', '.join(Transition)}")
        order = sorted(range(n), key=lambda i: (rows[i]["arrival_s"], rows[i]["session_id"], rows[i]["step"]))
        new_id = np.empty(n, dtype=np.int64)
        new_id[order] = np.arange(n)
        out = []
        for rid, i in enumerate(order):
            r = dict(rows[i])
            r["request_id"] = rid
            p = r.get("parent_request_id", -1)
            r["parent_request_id"] = int(new_id[p]) if p is not None and p >= 0 else -1
            ids = np.asarray(r["prompt_segment_ids"], dtype=np.int64)
            r["prompt_segment_ids"] = ids
            r["prompt_tokens"] = int(sum(len(self._tokens[s]) for s in ids))
            r.setdefault("max_tokens", r["output_tokens"])
            out.append(r)
        df = pd.DataFrame(out, columns=REQUEST_COLUMNS) if out else pd.DataFrame(columns=REQUEST_COLUMNS)
        lengths = np.fromiter((len(t) for t in self._tokens), dtype=np.int64, count=len(self._tokens))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(self._tokens) if self._tokens else np.zeros(0, np.int32)
        meta = {"format": FORMAT, "version": VERSION, "created_by": CREATED_BY, "block_size_hint": None,
                "tokenizer": None, "seed": None, **meta}
        return Trace(meta, tokens, offsets, self._kinds, df)
