"""Block-id traces: Mooncake (512-token chained ``hash_ids``) and kv-cache-tester (64-token full blocks).

Chained block ids mean "equal id ⇒ equal prefix up to and including this block". We keep that exactly: each
distinct id gets one block of fresh random tokens (uniform over the non-special ids of the vocabulary), so
equal ids give equal token blocks and different ids give different blocks (up to a collision probability of
~vocab^-block_size, i.e. never in practice).

* Mooncake: ``len(hash_ids) == ceil(input_length/512)``; the last block is usually partial. A partial block is
  the prefix of that id's full block (in the Mooncake data an id never reappears longer than first seen).
* kv-cache-tester: ids cover FULL 64-token blocks only; the partial tail (``in - 64*len(hash_ids)`` tokens)
  was dropped, so we add fresh unique tail tokens per request to reach ``in``. Ids are local to a
  conversation (``hash_id_scope: local``); subagents share their conversation's id space. In the raw block view
  ids are made global as ``conversation_index << 32 | local_id``.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from kvscope.workloads.tokens import TokenSource
from kvscope.workloads.trace import CREATED_BY, Trace, TraceBuilder


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


def block_transition(parent_ids: np.ndarray | None, ids: np.ndarray) -> str:
    """Transition from block ids, the rule that reproduces the published coding-agent shares: ``append``
    when the parent's blocks are a prefix except at most its last block (a re-rendered message end),
    ``reset`` when less than half of the parent's blocks are shared, else ``edit``."""
    if parent_ids is None:
        return "first"
    m = min(len(parent_ids), len(ids))
    neq = np.nonzero(parent_ids[:m] != ids[:m])[0]
    k = int(neq[0]) if len(neq) else m
    if len(parent_ids) - k <= 1:
        return "append"
    return "reset" if k * 2 < len(parent_ids) else "edit"


# ------------------------------------------------------------------------------------------ Mooncake


def read_mooncake(path: str | Path, block_size: int = 512) -> list[BlockRequest]:
    """Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``). The trace has no
    session ids, so each request is its own session; cross-request reuse is carried by the ids."""
    from kvscope.workloads.errors import iter_json_lines, require_fields

    out = []
    for line_no, r in iter_json_lines(path):
        require_fields(r, ("timestamp", "input_length", "output_length", "hash_ids"), f"{path}: line {line_no}")
        out.append(BlockRequest(session_id=f"r{line_no - 1:06d}", step=0, arrival_s=float(r["timestamp"]) / 1000.0,
                                input_length=int(r["input_length"]), output_length=int(r["output_length"]),
                                block_ids=np.asarray(r["hash_ids"], dtype=np.int64), block_size=block_size,
                                session_start_s=float(r["timestamp"]) / 1000.0))
    return out


# ------------------------------------------------------------------------------------- kv-cache-tester


def _iter_kvcache_files(src: str | Path) -> Iterator[tuple[str, dict]]:
    from kvscope.workloads.errors import TraceFileError, parse_json

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
    for name, stem, data in sorted(found):
        yield stem, parse_json(data, f"{p}: {name}")


def read_kvcache_tester(src: str | Path, limit: int | None = None, include_subagents: bool = True,
                        session_interval_s: float = 0.0) -> list[BlockRequest]:
    """kv-cache-tester conversations from a directory or a tarball, in file-name order. Conversation ``i``
    starts at ``i * session_interval_s`` (the source has no absolute start times); subagents are sessions
    ``<conversation>/<agent_id>`` starting at their parent's ``t``."""
    out: list[BlockRequest] = []
    for ci, (name, conv) in enumerate(_iter_kvcache_files(src)):
        if limit is not None and ci >= limit:
            break
        bs = int(conv.get("block_size", 64))
        base = np.int64(ci) << np.int64(32) if conv.get("hash_id_scope", "local") == "local" else np.int64(0)
        start = ci * session_interval_s

        def add(session: str, reqs: list, t0: float, static: int) -> None:
            prev = -1
            step = 0
            for r in reqs:
                if r.get("type") == "subagent":
                    continue
                kinds = r.get("input_types") or []
                tool = "tool_result" in kinds
                think = float(r.get("think_time") or 0.0)
                out.append(BlockRequest(
                    session_id=session, step=step, arrival_s=t0 + float(r["t"]), input_length=int(r["in"]),
                    output_length=int(r["out"]), block_ids=np.asarray(r["hash_ids"], dtype=np.int64) + base,
                    block_size=bs, parent=prev, session_start_s=t0,
                    think_time_s=0.0 if tool else think, tool_latency_s=think if tool else 0.0,
                    input_kind=("tool_output" if tool else "user") if step > 0 else "task",
                    static_prefix_tokens=static,
                    extra={"stop": r.get("stop"), "api_time": r.get("api_time"), "model": r.get("model"),
                           "type": r.get("type")}))
                prev = len(out) - 1
                step += 1

        add(name, conv["requests"], start, int(conv.get("tool_tokens", 0)) + int(conv.get("system_tokens", 0)))
        if include_subagents:
            for r in conv["requests"]:
                if r.get("type") == "subagent":
                    add(f"{name}/{r.get('agent_id', 'sub')}", r.get("requests", []), start + float(r["t"]),
                        int(r.get("tool_tokens", 0)) + int(r.get("system_tokens", 0)))
    return out


# ------------------------------------------------------------------------------------ to token trace


def blocks_to_trace(reqs: list[BlockRequest], source: TokenSource | None = None, seed: int = 0,
                    meta: dict | None = None, fill_tail: bool = True) -> Trace:
    """Expand block ids into a compact token trace: one segment per distinct full block id, one per
    (id, partial length) for partial last blocks (a prefix of the full block), and with ``fill_tail`` one
    fresh ``imported`` segment per request for tokens beyond the ids (kv-cache-tester's dropped tails)."""
    source = source or TokenSource.uniform()
    rng = np.random.default_rng([seed, 7])
    b = TraceBuilder()
    if not reqs:
        return b.build(meta or {})
    bs = reqs[0].block_size
    all_ids = np.concatenate([r.block_ids for r in reqs])
    uniq, first = np.unique(all_ids, return_index=True)
    order = uniq[np.argsort(first, kind="stable")]  # ids in order of first appearance: stable numbering
    plain = source.plain_ids
    pool = plain[rng.integers(0, len(plain), size=(len(order), bs))]
    row_of = {int(x): i for i, x in enumerate(order)}
    full_seg: dict[int, int] = {}
    part_seg: dict[tuple[int, int], int] = {}
    rows = []
    for r in reqs:
        segs = []
        n_ids = len(r.block_ids)
        for j, x in enumerate(r.block_ids.tolist()):
            covered = (j + 1) * bs
            length = bs if covered <= r.input_length or fill_tail else r.input_length - j * bs
            if length == bs:
                s = full_seg.get(x)
                if s is None:
                    s = full_seg[x] = b.add_segment(pool[row_of[x]], "imported")
            else:
                key = (x, length)
                s = part_seg.get(key)
                if s is None:
                    s = part_seg[key] = b.add_segment(pool[row_of[x], :length], "imported")
            segs.append(s)
        tail = r.input_length - n_ids * bs
        if fill_tail and tail > 0:
            segs.append(b.add_segment(plain[rng.integers(0, len(plain), tail)], "imported"))
        parent_ids = reqs[r.parent].block_ids if r.parent >= 0 else None
        rows.append(dict(session_id=r.session_id, step=r.step, parent_request_id=r.parent, arrival_s=r.arrival_s,
                         session_start_s=r.session_start_s, think_time_s=r.think_time_s,
                         tool_latency_s=r.tool_latency_s, prompt_segment_ids=segs, output_segment_id=-1,
                         output_tokens=r.output_length, max_tokens=max(1, r.output_length),
                         transition=block_transition(parent_ids, r.block_ids), input_kind=r.input_kind,
                         static_prefix_tokens=r.static_prefix_tokens))
    for row in rows:
        b.add_request(**row)
    m = {"name": "imported", "block_size_hint": bs, "tokenizer": source.info, "seed": seed,
         "created_by": CREATED_BY, **(meta or {})}
    return b.build(m)


def import_mooncake(path: str | Path, source: TokenSource | None = None, seed: int = 0) -> Trace:
    reqs = read_mooncake(path)
    return blocks_to_trace(reqs, source, seed, fill_tail=False,
                           meta={"name": Path(path).stem, "spec": {"importer": "mooncake", "source": str(path)}})


def import_kvcache_tester(src: str | Path, source: TokenSource | None = None, seed: int = 0,
                          limit: int | None = None, session_interval_s: float = 0.0) -> Trace:
    reqs = read_kvcache_tester(src, limit=limit, session_interval_s=session_interval_s)
    return blocks_to_trace(reqs, source, seed, fill_tail=True,
                           meta={"name": Path(src).name.split(".")[0],
                                 "spec": {"importer": "kvcache-tester", "source": str(src), "limit": limit}})
