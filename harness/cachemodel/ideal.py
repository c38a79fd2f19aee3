"""Trace-level "ideal" (infinite-cache) hit ratios, as published for the Mooncake and coding-agent traces.

README definition: each request is scored against *all* earlier requests; ``k`` = leading run of block
ids already seen (the partial last block's id included); hit = ``min(k*B, input_length)``; token-weighted.
``capped=True`` applies vLLM's ``(P-1)//B`` full-block cap instead (what vLLM would report).
"""

from __future__ import annotations

from typing import Iterable

from kvscope.harness.cachemodel.sim_types import SimRequest


def ideal_prefix_hit(requests: Iterable[SimRequest], *, capped: bool = False) -> dict:
    seen: set[int] = set()
    contains = seen.__contains__
    hit_total = p_total = 0
    per_session: dict[str, list[int]] = {}
    for r in requests:
        B, P = r.block_size, r.prompt_tokens
        ids = r.hashes[: P // B]
        if r.tail_id is not None:
            ids = ids + [r.tail_id]
        lim = (max(P - 1, 0) // B) if capped else len(ids)
        flags = list(map(contains, ids[:lim]))
        try:
            k = flags.index(False)
        except ValueError:
            k = len(flags)
        hit = min(k * B, P)
        seen.update(ids)
        hit_total += hit
        p_total += P
        if r.session_id is not None:
            root = r.session_id.split("/")[0]
            acc = per_session.setdefault(root, [0, 0])
            acc[0] += hit
            acc[1] += P
    out = {"requests_prompt_tokens": p_total, "hit_tokens": hit_total,
           "token_hit_ratio": hit_total / p_total if p_total else 0.0, "capped": capped}
    if per_session:
        ratios = [h / p for h, p in per_session.values() if p]
        out["mean_per_conversation_hit_ratio"] = sum(ratios) / len(ratios)
        out["conversations"] = len(ratios)
    return out
