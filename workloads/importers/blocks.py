"""Token traces from block-id traces: Mooncake (512-token chained ``hash_ids``) and kv-cache-tester (64-token
full blocks). The files are read by :mod:`kvscope.workloads.readers`, the readers ``kvscope simulate`` uses too.

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

from pathlib import Path

import numpy as np

from kvscope.workloads.prefix import transition_from
from kvscope.workloads.readers import BlockRequest, read_kvcache_tester, read_mooncake
from kvscope.workloads.tokens import TokenSource
from kvscope.workloads.trace import CREATED_BY, Trace, TraceBuilder
from kvscope.workloads.trace_schema import SegmentKind
from kvscope.workloads.importers.sniff import check_kind, refuse_empty

__all__ = ["BlockRequest", "block_transition", "blocks_to_trace", "import_kvcache_tester", "import_mooncake",
           "read_kvcache_tester", "read_mooncake"]


def block_transition(parent_ids: np.ndarray | None, ids: np.ndarray) -> str:
    """Transition from block ids, the rule that reproduces the published coding-agent shares: ``append``
    when the parent's blocks are a prefix except at most its last block (a re-rendered message end)."""
    return transition_from(parent_ids, ids, append_slack=1)


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
                    s = full_seg[x] = b.add_segment(pool[row_of[x]], SegmentKind.IMPORTED)
            else:
                key = (x, length)
                s = part_seg.get(key)
                if s is None:
                    s = part_seg[key] = b.add_segment(pool[row_of[x], :length], SegmentKind.IMPORTED)
            segs.append(s)
        tail = r.input_length - n_ids * bs
        if fill_tail and tail > 0:
            segs.append(b.add_segment(plain[rng.integers(0, len(plain), tail)], SegmentKind.IMPORTED))
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
    check_kind(path, "mooncake")
    reqs = read_mooncake(path)
    if not reqs:
        refuse_empty(path, "mooncake", "requests")
    return blocks_to_trace(reqs, source, seed, fill_tail=False,
                           meta={"name": Path(path).stem, "spec": {"importer": "mooncake", "source": str(path)}})


def import_kvcache_tester(src: str | Path, source: TokenSource | None = None, seed: int = 0,
                          limit: int | None = None, session_interval_s: float = 0.0) -> Trace:
    reqs = read_kvcache_tester(src, limit=limit, session_interval_s=session_interval_s)
    if not reqs:
        refuse_empty(src, "kvcache-tester", "requests")
    return blocks_to_trace(reqs, source, seed, fill_tail=True,
                           meta={"name": Path(src).name.split(".")[0],
                                 "spec": {"importer": "kvcache-tester", "source": str(src), "limit": limit}})
