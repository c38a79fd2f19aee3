"""Readers that turn the four trace kinds into :class:`SimRequest` lists.

* kvscope trace dir (``trace.json`` + ``segments.parquet`` + ``requests.parquet``, docs/architecture.md):
  token ids, hashed per session with :class:`IncrementalHasher` (prompts of a session share prefixes).
* raw JSONL: ``prompt_token_ids`` [, ``output_token_ids`` | ``output_tokens``, ``session_id``,
  ``arrival_s``, ``cache_salt``].
* Mooncake JSONL: 512-token chained ``hash_ids``; read at block level (never expanded to tokens).
* kv-cache-tester folder or tarball: per-conversation JSON, 64-token chained ids with per-conversation
  scope (so ids are offset per conversation, the block-id analogue of a ``cache_salt``), nested subagents.

Block-id traces can be simulated at any multiple of their native block size (see ``regroup_block_ids``).
"""

from __future__ import annotations

import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

try:  # a project dependency; 2-3x faster than json on the 441 MB of coding-agent traces
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover
    _fast_loads = json.loads

from kvscope.harness.cachemodel.hashing import IncrementalHasher, as_token_array, common_prefix, regroup_block_ids, salt_seed
from kvscope.harness.cachemodel.sim_types import SimRequest

if TYPE_CHECKING:
    import numpy as np

MOONCAKE_BLOCK = 512
KVTESTER_BLOCK = 64


@dataclass
class LoadedTrace:
    """Requests in simulation order plus where they came from."""

    kind: str
    path: str
    block_size: int
    native_block_size: int | None
    requests: list[SimRequest]
    info: dict = field(default_factory=dict)


def detect_kind(path: str | os.PathLike) -> str:
    p = Path(path)
    if p.is_dir():
        if (p / "trace.json").exists() or (p / "requests.parquet").exists():
            if (p / "requests.parquet").exists() and (p / "segments.parquet").exists():
                return "kvscope"
            if (p / "requests.parquet").exists():
                return "run"
        return "kvtester"
    name = p.name
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        return "kvtester"
    if name.endswith(".parquet"):
        return "run"
    from kvscope.workloads.errors import TraceFileError, parse_json

    try:
        with open(p, "rb") as f:
            first = f.readline()
    except OSError as exc:
        raise TraceFileError(f"{p}: cannot read ({exc.strerror})") from None
    rec = parse_json(first, f"{p}: line 1")
    if "hash_ids" in rec and "input_length" in rec:
        return "mooncake"
    if "prompt_token_ids" in rec:
        return "jsonl"
    if "requests" in rec and "block_size" in rec:
        return "kvtester"
    raise ValueError(f"cannot tell what kind of trace {path} is")


def load_trace(path: str | os.PathLike, block_size: int | None = None, *, order: str = "time") -> LoadedTrace:
    """Read any supported trace.  ``block_size`` defaults to the native size (16 for token traces)."""
    kind = detect_kind(path)
    if kind == "mooncake":
        return read_mooncake(path, block_size or MOONCAKE_BLOCK)
    if kind == "kvtester":
        return read_kvtester(path, block_size or KVTESTER_BLOCK, order=order)
    if kind == "jsonl":
        return read_token_jsonl(path, block_size or 16)
    if kind == "kvscope":
        return read_kvscope_trace(path, block_size or 16)
    from kvscope.workloads.errors import TraceFileError

    if (Path(path) / "trace.json").exists():
        raise TraceFileError(f"{path}: segments.parquet is missing; a kvscope trace directory holds trace.json, "
                             "requests.parquet and segments.parquet")
    raise TraceFileError(f"{path} looks like a run directory, not a trace")


# -- Mooncake ---------------------------------------------------------------------------------------

def read_mooncake(path: str | os.PathLike, block_size: int = MOONCAKE_BLOCK) -> LoadedTrace:
    from kvscope.workloads.errors import iter_json_lines, require_fields

    reqs = []
    for line_no, r in iter_json_lines(path):
        require_fields(r, ("input_length", "output_length", "hash_ids"), f"{path}: line {line_no}")
        P = r["input_length"]
        ids = r["hash_ids"]
        full = P // MOONCAKE_BLOCK
        tail = ids[full] if len(ids) > full else None
        hashes = ids[:full] if len(ids) > full else ids
        if block_size != MOONCAKE_BLOCK:
            hashes = regroup_block_ids(hashes, MOONCAKE_BLOCK, block_size)
        reqs.append(SimRequest(line_no - 1, P, r["output_length"], hashes, block_size,
                               arrival_s=r.get("timestamp", 0) / 1000.0, tail_id=tail))
    return LoadedTrace("mooncake", str(path), block_size, MOONCAKE_BLOCK, reqs)


# -- kv-cache-tester --------------------------------------------------------------------------------

def _iter_kvtester_docs(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    from kvscope.workloads.errors import TraceFileError, parse_json

    p = Path(path)
    if p.is_dir():
        for fp in sorted(p.rglob("*.json")):
            with open(fp, "rb") as f:
                yield fp.stem, parse_json(f.read(), str(fp))
        return
    # Stream in archive order (seeking backwards in a gzip stream re-decompresses it), sort afterwards.
    docs = []
    try:
        with tarfile.open(p, "r|*") as tf:
            for m in tf:
                if m.isfile() and m.name.endswith(".json"):
                    fobj = tf.extractfile(m)
                    assert fobj is not None
                    docs.append((Path(m.name).stem, fobj.read()))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise TraceFileError(f"{p}: unreadable or truncated archive after {len(docs)} file(s) ({exc})") from None
    docs.sort(key=lambda d: d[0])
    for name, raw in docs:
        yield name, parse_json(raw, f"{p}: {name}.json")


def read_kvtester(path: str | os.PathLike, block_size: int = KVTESTER_BLOCK, *, order: str = "time",
                  limit: int | None = None) -> LoadedTrace:
    """All conversations; ids offset per conversation.  ``order``: ``time`` (all conversations start at
    t=0 and interleave) or ``file`` (one conversation after another)."""
    rows: list[tuple[float, int, SimRequest]] = []
    n = 0
    base = 0
    for conv_idx, (name, doc) in enumerate(_iter_kvtester_docs(path)):
        if limit is not None and conv_idx >= limit:
            break
        native = doc.get("block_size", KVTESTER_BLOCK)
        # Ids are local to a conversation: shift them into a disjoint global range.
        max_id = -1
        prev: dict[str, tuple[list, list]] = {}  # session -> (local ids, global hashes)

        def walk(items: list, sid: str, t0: float) -> None:
            nonlocal n, max_id
            first = True
            for it in items:
                if "requests" in it and "hash_ids" not in it:
                    walk(it["requests"], f"{sid}/{it.get('agent_id', n)}", t0 + it.get("t", 0.0))
                    continue
                ids = it.get("hash_ids") or []
                # Share the predecessor's hash objects for the common prefix (memory and speed).
                p_ids, p_hashes = prev.get(sid, ((), []))
                lcp = common_prefix(p_ids, ids)
                if len(ids) > lcp:  # the shared prefix was already counted
                    max_id = max(max_id, max(ids[lcp:]))
                hashes = p_hashes[:lcp] + [x + base for x in ids[lcp:]]
                prev[sid] = (ids, hashes)
                if block_size != native:
                    hashes = regroup_block_ids(hashes, native, block_size)
                gap = None if first else it.get("think_time", 0.0)
                req = SimRequest(n, it["in"], it["out"], hashes, block_size, session_id=sid,
                                 arrival_s=t0 + it.get("t", 0.0), gap_s=gap)
                rows.append((req.arrival_s, conv_idx, req))
                n += 1
                first = False

        walk(doc["requests"], name, 0.0)
        base += max_id + 1
    if order == "time":
        rows.sort(key=lambda x: x[0])
    reqs = [r for _, _, r in rows]
    for i, r in enumerate(reqs):
        r.request_id = i
    return LoadedTrace("kvtester", str(path), block_size, KVTESTER_BLOCK, reqs, {"order": order})


# -- token-level ------------------------------------------------------------------------------------

def _token_request(hasher: IncrementalHasher, i: int, prompt: np.ndarray, output: np.ndarray | None,
                   out_len: int, B: int, sid: str | None, salt: str | None, arrival: float,
                   gap: float | None) -> SimRequest:
    import numpy as np

    P = len(prompt)
    if output is not None and len(output):
        toks = np.concatenate([prompt, output])
        n_blocks = (P + len(output) - 1) // B
    else:
        toks = prompt
        n_blocks = P // B
    hashes = hasher.hashes(sid if sid is not None else "__all__", toks, n_blocks, salt)
    return SimRequest(i, P, out_len, hashes, B, session_id=sid, arrival_s=arrival, gap_s=gap, cache_salt=salt)


def read_token_jsonl(path: str | os.PathLike, block_size: int = 16) -> LoadedTrace:
    from kvscope.workloads.errors import iter_json_lines, require_fields

    hasher = IncrementalHasher(block_size)
    reqs = []
    for line_no, r in iter_json_lines(path):
        require_fields(r, ("prompt_token_ids",), f"{path}: line {line_no}")
        prompt = as_token_array(r["prompt_token_ids"])
        out_ids = r.get("output_token_ids")
        output = as_token_array(out_ids) if out_ids else None
        out_len = len(out_ids) if out_ids else int(r.get("output_tokens", 1))
        reqs.append(_token_request(hasher, len(reqs), prompt, output, out_len, block_size,
                                   r.get("session_id"), r.get("cache_salt"), float(r.get("arrival_s", 0.0)),
                                   r.get("gap_s")))
    return LoadedTrace("jsonl", str(path), block_size, None, reqs)


def read_kvscope_trace(path: str | os.PathLike, block_size: int = 16) -> LoadedTrace:
    """A kvscope trace dir, via ``kvscope.workloads.trace.Trace`` when available, else the parquet files."""
    import numpy as np

    hasher = IncrementalHasher(block_size)
    reqs: list[SimRequest] = []
    try:
        from kvscope.workloads.trace import Trace  # type: ignore

        trace = Trace.read(path)
        table = trace.requests if hasattr(trace, "requests") else None
        rows = table.to_dict("records") if hasattr(table, "to_dict") else None
        if rows is None:
            raise AttributeError("Trace.requests")
        get_prompt = lambda rid, row: as_token_array(trace.prompt_token_ids(rid))  # noqa: E731
        get_output = lambda rid, row: trace.output_token_ids(rid)  # noqa: E731
    except (ImportError, AttributeError, TypeError):
        import pyarrow.parquet as pq

        p = Path(path)
        seg = pq.read_table(p / "segments.parquet", columns=["segment_id", "token_ids"])
        seg_ids = seg.column("segment_id").to_pylist()
        seg_tok = seg.column("token_ids")
        segments = {sid: np.asarray(seg_tok[i].values.to_numpy(zero_copy_only=False), dtype=np.int32)
                    for i, sid in enumerate(seg_ids)}
        rows = pq.read_table(p / "requests.parquet").to_pylist()

        def get_prompt(rid: int, row: dict) -> np.ndarray:
            parts = [segments[s] for s in row["prompt_segment_ids"]]
            return np.concatenate(parts) if parts else np.zeros(0, np.int32)

        def get_output(rid: int, row: dict):
            o = row.get("output_segment_id", -1)
            return segments[o] if o is not None and o >= 0 else None

    rows = sorted(rows, key=lambda r: r["request_id"])
    for row in rows:
        rid = int(row["request_id"])
        prompt = get_prompt(rid, row)
        out = get_output(rid, row)
        out = as_token_array(out) if out is not None and len(out) else None
        out_len = int(row.get("output_tokens") or (len(out) if out is not None else 1))
        first = int(row.get("parent_request_id", -1) if row.get("parent_request_id") is not None else -1) < 0
        gap = None if first else float(row.get("think_time_s") or 0.0) + float(row.get("tool_latency_s") or 0.0)
        salt = row.get("cache_salt")
        reqs.append(_token_request(hasher, rid, prompt, out, out_len, block_size, row.get("session_id"),
                                   salt, float(row.get("arrival_s") or 0.0), gap))
    return LoadedTrace("kvscope", str(path), block_size, None, reqs)


__all__ = ["LoadedTrace", "detect_kind", "load_trace", "read_mooncake", "read_kvtester", "read_token_jsonl",
           "read_kvscope_trace", "salt_seed"]
