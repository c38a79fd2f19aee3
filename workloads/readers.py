"""One reader per trace format, shared by ``kvscope workload import`` and ``kvscope simulate``.

Each reader turns a file into plain rows and validates it once (a bad line or a missing field names the file
and the line); what a consumer builds from the rows is its own business: the importers materialise a token
trace (:mod:`kvscope.workloads.importers`), the cache model hashes rows into simulator requests
(:mod:`kvscope.harness.cachemodel.trace_io`). Keeping the parsing here, in the lowest layer, is what keeps
the two from drifting (id offsets, required fields, session ids).

* Mooncake JSONL: ``input_length``, ``output_length``, ``hash_ids`` (512-token chained ids, the last block
  usually partial) are required; ``timestamp`` (ms) defaults to 0. No session ids: each request is its own
  session ``r000000`` …, cross-request reuse is carried by the ids.
* kv-cache-tester (folder or tarball of per-conversation JSON): ``requests`` with ``in``, ``out`` required,
  ``t``, ``think_time``, ``hash_ids`` (full 64-token blocks only) optional. Ids are local to a conversation
  (``hash_id_scope: local``), made global as ``conversation_index << 32 | local_id``. Subagents (items with
  their own ``requests``) are sessions ``<conversation>/<agent_id>`` starting at their parent's ``t``,
  nested to any depth, listed where they occur.
* Token JSONL: ``prompt_token_ids`` required; ``output_token_ids``, ``output_tokens``, ``max_tokens``,
  ``session_id`` (any JSON scalar, kept as a string), ``step``, ``arrival_s``, ``gap_s``, ``cache_salt``.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kvscope.workloads.errors import TraceFileError, iter_json_lines, parse_json, require_fields
from kvscope.workloads.trace_schema import SegmentKind

MOONCAKE_BLOCK_SIZE = 512
KVCACHE_TESTER_BLOCK_SIZE = 64


@dataclass
class BlockRequest:
    """One request of a block-id trace, in the raw block view."""

    session_id: str
    step: int
    arrival_s: float
    input_length: int
    output_length: int
    block_ids: np.ndarray  # int64, chained ids (global)
    block_size: int
    parent: int = -1  # index (in the returned list) of the previous request of the session
    session_start_s: float = 0.0
    think_time_s: float = 0.0
    tool_latency_s: float = 0.0
    input_kind: str | None = None
    static_prefix_tokens: int = -1
    extra: dict = field(default_factory=dict)


@dataclass
class TokenRequest:
    """One line of a token JSONL trace, validated."""

    line_no: int
    prompt: np.ndarray  # int32 token ids
    output: np.ndarray | None  # int32 output ids when the trace has them
    output_tokens: int
    max_tokens: int
    session_id: str | None
    step: int
    arrival_s: float
    gap_s: float | None
    cache_salt: str | None


# ------------------------------------------------------------------------------------------ Mooncake


def read_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> list[BlockRequest]:
    """Mooncake JSONL as block rows (see the module doc for the fields)."""
    out = []
    for line_no, r in iter_json_lines(path):
        require_fields(r, ("input_length", "output_length", "hash_ids"), f"{path}: line {line_no}")
        t = float(r.get("timestamp", 0)) / 1000.0
        out.append(BlockRequest(session_id=f"r{line_no - 1:06d}", step=0, arrival_s=t,
                                input_length=int(r["input_length"]), output_length=int(r["output_length"]),
                                block_ids=np.asarray(r["hash_ids"], dtype=np.int64), block_size=block_size,
                                session_start_s=t))
    return out


# ------------------------------------------------------------------------------------- kv-cache-tester


def iter_kvcache_tester_files(src: str | Path) -> Iterator[tuple[str, dict]]:
    """(conversation name, document) in file-name order, from a folder or a (compressed) tarball."""
    p = Path(src)
    if not p.exists():
        raise TraceFileError(f"{p}: no such file or directory")
    if p.is_dir():
        for f in sorted(p.rglob("*.json")):
            yield f.stem, parse_json(f.read_bytes(), str(f))
        return
    # Stream the archive once (random access into a .tar.gz re-decompresses from the start every time).
    found: list[tuple[str, str, bytes]] = []
    try:
        with tarfile.open(p, mode="r|*") as tar:
            for m in tar:
                if m.isfile() and m.name.endswith(".json"):
                    fh = tar.extractfile(m)
                    assert fh is not None
                    found.append((m.name, Path(m.name).stem, fh.read()))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise TraceFileError(f"{p}: unreadable or truncated archive after {len(found)} file(s) ({exc})") from None
    for name, stem, data in sorted(found, key=lambda f: (f[1], f[0])):
        yield stem, parse_json(data, f"{p}: {name}")


@dataclass
class _Conversation:
    """Where the rows of one kv-cache-tester conversation go and how its local ids become global."""

    out: list[BlockRequest]
    where: str
    block_size: int
    id_base: np.int64
    include_subagents: bool


def _static_tokens(doc: dict) -> int:
    return int(doc.get("tool_tokens", 0)) + int(doc.get("system_tokens", 0))


def _add_session(conv: _Conversation, session: str, items: list, t0: float, static: int) -> None:
    prev = -1
    step = 0
    for r in items:
        if r.get("type") == "subagent" or ("requests" in r and "hash_ids" not in r):
            if conv.include_subagents:  # its own session, started at its ``t``
                _add_session(conv, f"{session}/{r.get('agent_id', 'sub')}", r.get("requests") or [],
                             t0 + float(r.get("t", 0.0)), _static_tokens(r))
            continue
        require_fields(r, ("in", "out"), f"{conv.where}: session {session} request {step}")
        tool = "tool_result" in (r.get("input_types") or [])
        think = float(r.get("think_time") or 0.0)
        ids = np.asarray(r.get("hash_ids") or [], dtype=np.int64) + conv.id_base
        conv.out.append(BlockRequest(
            session_id=session, step=step, arrival_s=t0 + float(r.get("t", 0.0)), input_length=int(r["in"]),
            output_length=int(r["out"]), block_ids=ids,
            block_size=conv.block_size, parent=prev, session_start_s=t0,
            think_time_s=0.0 if tool else think, tool_latency_s=think if tool else 0.0,
            input_kind=(SegmentKind.TOOL_OUTPUT if tool else SegmentKind.USER) if step > 0 else SegmentKind.TASK,
            static_prefix_tokens=static,
            extra={"stop": r.get("stop"), "api_time": r.get("api_time"), "model": r.get("model"),
                   "type": r.get("type")}))
        prev = len(conv.out) - 1
        step += 1


def read_kvcache_tester(src: str | Path, limit: int | None = None, include_subagents: bool = True,
                        session_interval_s: float = 0.0) -> list[BlockRequest]:
    """kv-cache-tester conversations in file-name order, subagents where they occur. Conversation ``i``
    starts at ``i * session_interval_s`` (the source has no absolute start times)."""
    out: list[BlockRequest] = []
    for ci, (name, doc) in enumerate(iter_kvcache_tester_files(src)):
        if limit is not None and ci >= limit:
            break
        where = f"{src}: {name}.json"
        require_fields(doc, ("requests",), where)
        local = doc.get("hash_id_scope", "local") == "local"
        conv = _Conversation(out, where, int(doc.get("block_size", KVCACHE_TESTER_BLOCK_SIZE)),
                             np.int64(ci) << np.int64(32) if local else np.int64(0), include_subagents)
        _add_session(conv, name, doc["requests"], ci * session_interval_s, _static_tokens(doc))
    return out


# ---------------------------------------------------------------------------------------- token JSONL


def _token_ids(value: Any, where: str) -> np.ndarray:
    try:
        return np.ascontiguousarray(np.asarray(value, dtype=np.int32).reshape(-1))
    except (TypeError, ValueError):
        raise TraceFileError(f"{where}: expected a list of integer token ids") from None


def read_token_jsonl(path: str | Path) -> list[TokenRequest]:
    """Token JSONL lines in file order (see the module doc for the fields)."""
    out = []
    for line_no, r in iter_json_lines(path):
        where = f"{path}: line {line_no}"
        require_fields(r, ("prompt_token_ids",), where)
        prompt = _token_ids(r["prompt_token_ids"], f"{where}: prompt_token_ids")
        out_ids = r.get("output_token_ids")
        output = _token_ids(out_ids, f"{where}: output_token_ids") if out_ids is not None else None
        if output is not None and len(output):
            n_out = len(output)
        else:
            n_out = int(r.get("output_tokens", r.get("max_tokens", 1)))
        sid = r.get("session_id")
        if "session_id" in r and sid is None:
            raise TraceFileError(f"{where}: session_id is null; give a string or an integer, or leave the field "
                                 "out (the line is then a session of its own)")
        gap = r.get("gap_s")
        out.append(TokenRequest(line_no=line_no, prompt=prompt, output=output, output_tokens=n_out,
                                max_tokens=int(r.get("max_tokens", n_out)),
                                session_id=None if sid is None else str(sid), step=int(r.get("step", 0)),
                                arrival_s=float(r.get("arrival_s", 0.0)),
                                gap_s=None if gap is None else float(gap),
                                cache_salt=r.get("cache_salt") or None))
    return out
