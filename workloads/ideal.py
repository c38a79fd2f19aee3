"""The ideal (infinite-cache) prefix hit of block-id requests: the one definition behind
``kvscope workload stats`` (raw block view) and ``kvscope simulate``'s ideal figures (simulator requests).

Chained ids make it cheap: an id stands for its whole prefix, so "seen before" is monotone along a request's
ids and one binary search finds the leading run (``prefix.leading_run``). Token traces with exact partial
tails are scored by ``stats.IdealCache``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kvscope.workloads.prefix import leading_run


@dataclass
class IdealHit:
    """Token totals of an ideal (infinite) block cache, overall and per conversation (root session)."""

    hit_tokens: int = 0
    prompt_tokens: int = 0
    per_conversation: dict[str, list[int]] = field(default_factory=dict)  # root session -> [hit, prompt]

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_per_conversation_hit_ratio(self) -> float | None:
        ratios = [h / p for h, p in self.per_conversation.values() if p]
        return sum(ratios) / len(ratios) if ratios else None


def ideal_block_hit(requests: Iterable[tuple[Sequence[int], int, int, str | None]], *, per_session: bool = False,
                    capped: bool = False) -> IdealHit:
    """The ideal hit of block-id requests ``(chained ids incl. a partial last block, prompt tokens, block size,
    session id)`` in the order given: ``k`` = leading run of ids seen before (by any request, or with
    ``per_session`` by the same session), hit = ``min(k*B, prompt)``. ``capped`` applies vLLM's
    ``(P-1)//B`` full-block cap (what vLLM would report)."""
    seen_global: set[int] = set()
    seen_sess: dict[str, set[int]] = defaultdict(set)
    acc = IdealHit()
    for ids, prompt, B, session in requests:
        seen = seen_sess[str(session)] if per_session else seen_global
        keys = list(ids[: max(prompt - 1, 0) // B]) if capped else list(ids)
        k = leading_run(keys, seen, chained=True)
        hit = min(k * B, prompt)
        seen.update(ids[k:])
        acc.hit_tokens += hit
        acc.prompt_tokens += prompt
        if session is not None:
            conv = acc.per_conversation.setdefault(str(session).split("/")[0], [0, 0])
            conv[0] += hit
            conv[1] += prompt
    return acc
