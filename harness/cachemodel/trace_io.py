"""Readers that turn the four trace kinds into :class:`SimRequest` lists.

* kvscope trace dir (``trace.json`` + ``segments.parquet`` + ``requests.parquet``, docs/architecture.md):
  token ids, hashed per session with :class:`IncrementalHasher` (prompts of a session share prefixes).
* raw JSONL: ``prompt_token_ids`` [, ``output_token_ids`` | ``output_tokens``, ``session_id``,
  ``arrival_s``, ``cache_salt``].
* Mooncake JSONL: 512-token chained ``hash_ids``; read at block level (never expanded to tokens).
* kv-cache-tester folder or tarball: per-conversation JSON, 64-token chained ids with per-conversation
  scope (so ids are offset per conversation, the block-id analogue of a ``cache_salt``), nested subagents.

The files themselves are parsed and validated by :mod:`kvscope.workloads.readers`, the same readers
``kvscope workload import`` uses; this module only turns their rows into chained hashes.

Block-id traces can be simulated at any multiple of their native block size (see ``regroup_block_ids``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvscope.harness.cachemodel.hashing import IncrementalHasher, as_token_array, regroup_block_ids, salt_seed
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.workloads.prefix import common_prefix_len
from kvscope.workloads.readers import KVCACHE_TESTER_BLOCK_SIZE as KVTESTER_BLOCK
from kvscope.workloads.readers import MOONCAKE_BLOCK_SIZE as MOONCAKE_BLOCK
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE
from kvscope.workloads import readers
from kvscope.workloads.errors import TraceFileError, parse_json


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
    """Read any supported trace.  ``block_size`` defaults to the native size (``DEFAULT_BLOCK_SIZE`` for token
    traces)."""
    kind = detect_kind(path)
    if kind == "mooncake":
        return read_mooncake(path, block_size or MOONCAKE_BLOCK)
    if kind == "kvtester":
        return read_kvtester(path, block_size or KVTESTER_BLOCK, order=order)
    if kind == "jsonl":
        return read_token_jsonl(path, block_size or DEFAULT_BLOCK_SIZE)
    if kind == "kvscope":
        return read_kvscope_trace(path, block_size or DEFAULT_BLOCK_SIZE)

    if (Path(path) / "trace.json").exists():
        raise TraceFileError(f"{path}: segments.parquet is missing; a kvscope trace directory holds trace.json, "
                             "requests.parquet and segments.parquet")
    raise TraceFileError(f"{path} looks like a run directory, not a trace")


# -- block-id traces ---------------------------------------------------------------------------------

def read_mooncake(path: str | os.PathLike, block_size: int = MOONCAKE_BLOCK) -> LoadedTrace:
    """Mooncake JSONL at ``block_size`` (a multiple of 512); the partial last block becomes ``tail_id``."""
    reqs = []
    for i, r in enumerate(readers.read_mooncake(path)):
        ids = r.block_ids.tolist()
        full = r.input_length // MOONCAKE_BLOCK
        tail = ids[full] if len(ids) > full else None
        hashes = ids[:full] if len(ids) > full else ids
        hashes = regroup_block_ids(hashes, MOONCAKE_BLOCK, block_size)
        reqs.append(SimRequest(i, r.input_length, r.output_length, hashes, block_size, arrival_s=r.arrival_s,
                               tail_id=tail))
    return LoadedTrace("mooncake", str(path), block_size, MOONCAKE_BLOCK, reqs)


def read_kvtester(path: str | os.PathLike, block_size: int = KVTESTER_BLOCK, *, order: str = "time",
                  limit: int | None = None) -> LoadedTrace:
    """All conversations, subagents included.  ``order``: ``time`` (all conversations start at t=0 and
    interleave) or ``file`` (one conversation after another)."""
    rows = readers.read_kvcache_tester(path, limit=limit)
    # Share the predecessor's hash objects for the common prefix: agent sessions resend their history, and
    # one list of Python ints per request would otherwise dominate memory on the 441 MB coding-agent traces.
    prev_ids: dict[str, tuple[np.ndarray, list[int]]] = {}
    reqs = []
    for r in rows:
        p_ids, p_hashes = prev_ids.get(r.session_id, (r.block_ids[:0], []))
        common = common_prefix_len(p_ids, r.block_ids)
        hashes = p_hashes[:common] + r.block_ids[common:].tolist()
        prev_ids[r.session_id] = (r.block_ids, hashes)
        gap = None if r.parent < 0 else r.think_time_s + r.tool_latency_s
        reqs.append(SimRequest(len(reqs), r.input_length, r.output_length,
                               regroup_block_ids(hashes, r.block_size, block_size), block_size,
                               session_id=r.session_id, arrival_s=r.arrival_s, gap_s=gap))
    if order == "time":
        reqs.sort(key=lambda q: q.arrival_s)
        for i, q in enumerate(reqs):
            q.request_id = i
    return LoadedTrace("kvtester", str(path), block_size, KVTESTER_BLOCK, reqs, {"order": order})


# -- token-level ------------------------------------------------------------------------------------

def _token_request(hasher: IncrementalHasher, i: int, prompt: np.ndarray, output: np.ndarray | None,
                   out_len: int, B: int, sid: str | None, salt: str | None, arrival: float,
                   gap: float | None) -> SimRequest:
    P = len(prompt)
    if output is not None and len(output):
        toks = np.concatenate([prompt, output])
        n_blocks = (P + len(output) - 1) // B
    else:
        toks = prompt
        n_blocks = P // B
    hashes = hasher.hashes(sid if sid is not None else "__all__", toks, n_blocks, salt)
    return SimRequest(i, P, out_len, hashes, B, session_id=sid, arrival_s=arrival, gap_s=gap, cache_salt=salt)


def read_token_jsonl(path: str | os.PathLike, block_size: int = DEFAULT_BLOCK_SIZE) -> LoadedTrace:
    """Token JSONL in file order, hashed per session (session ids of any JSON type are strings)."""
    hasher = IncrementalHasher(block_size)
    reqs = [_token_request(hasher, i, r.prompt, r.output, r.output_tokens, block_size, r.session_id,
                           r.cache_salt, r.arrival_s, r.gap_s)
            for i, r in enumerate(readers.read_token_jsonl(path))]
    return LoadedTrace("jsonl", str(path), block_size, None, reqs)


def read_kvscope_trace(path: str | os.PathLike, block_size: int = DEFAULT_BLOCK_SIZE, *, trace=None) -> LoadedTrace:
    """A kvscope trace dir, read with :class:`kvscope.workloads.trace.Trace` (or the one already read: ``trace``,
    so a caller hashing one trace at several block sizes reads it once)."""
    # deferred: it loads pandas, pyarrow, which importing this module must not
    from kvscope.workloads.trace import Trace

    trace = trace if trace is not None else Trace.read(path)
    hasher = IncrementalHasher(block_size)
    reqs: list[SimRequest] = []
    for r in trace.iter_requests():
        rid = int(r.request_id)
        out = trace.output_token_ids(rid)
        out = as_token_array(out) if out is not None and len(out) else None
        out_len = int(r.output_tokens or (len(out) if out is not None else 1))
        gap = None if r.parent_request_id < 0 else float(r.think_time_s or 0.0) + float(r.tool_latency_s or 0.0)
        reqs.append(_token_request(hasher, rid, as_token_array(trace.prompt_token_ids(rid)), out, out_len,
                                   block_size, r.session_id, r.cache_salt, float(r.arrival_s or 0.0), gap))
    return LoadedTrace("kvscope", str(path), block_size, None, reqs)


__all__ = ["LoadedTrace", "detect_kind", "load_trace", "read_mooncake", "read_kvtester", "read_token_jsonl",
           "read_kvscope_trace", "salt_seed"]
