"""Trace-level "ideal" (infinite-cache) hit ratios of simulator requests, as published for the Mooncake and
coding-agent traces.

The definition and its one implementation are :func:`kvscope.workloads.ideal.ideal_block_hit` (each request
scored against *all* earlier requests; ``k`` = leading run of block ids already seen, the partial last block's
id included; hit = ``min(k*B, input_length)``; token-weighted). Here simulator requests are only mapped onto
it: their full-block hashes plus the ``tail_id`` of a partial last block.
"""

from __future__ import annotations

from typing import Iterable

from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.workloads.ideal import ideal_block_hit


def ideal_prefix_hit(requests: Iterable[SimRequest], *, capped: bool = False) -> dict:
    """Totals and ratio; with session ids also the mean of per-conversation ratios (root sessions)."""

    def rows():
        for r in requests:
            ids = r.hashes[: r.prompt_tokens // r.block_size]
            yield (ids + [r.tail_id] if r.tail_id is not None else ids), r.prompt_tokens, r.block_size, r.session_id

    acc = ideal_block_hit(rows(), capped=capped)
    out = {"requests_prompt_tokens": acc.prompt_tokens, "hit_tokens": acc.hit_tokens,
           "token_hit_ratio": acc.token_hit_ratio, "capped": capped}
    if acc.per_conversation:
        out["mean_per_conversation_hit_ratio"] = acc.mean_per_conversation_hit_ratio
        out["conversations"] = len([p for _, p in acc.per_conversation.values() if p])
    return out
