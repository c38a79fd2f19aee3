"""Plain data passed between the trace readers, the simulator and the router."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

#: Hashes that can never hit (output blocks of unknown content): negative, where real hashes are unsigned.
_unique = itertools.count(-1, -1)


@dataclass(slots=True)
class SimRequest:
    """One request as the prefix-cache simulator sees it: lengths plus chained block hashes.

    ``hashes`` are the chained hashes of the full ``block_size`` blocks of the request's token sequence
    (prompt, then output).  At least the ``prompt_tokens // block_size`` prompt blocks must be present; if
    the output tokens are known, hashes go up to ``(prompt_tokens + output_tokens - 1) // block_size`` (the
    blocks a finished request leaves cached, vLLM-facts §9).  Missing output blocks get unique hashes that
    can never hit.
    """

    request_id: int
    prompt_tokens: int
    output_tokens: int
    hashes: list[int]
    block_size: int
    session_id: str | None = None
    arrival_s: float = 0.0
    #: Closed-loop delay after the session's previous request finishes (think + tool time); None = open loop.
    gap_s: float | None = None
    cache_salt: str | None = None
    #: Id of the partial last prompt block in block-id traces (only for the "ideal" trace metric).
    tail_id: int | None = None
    #: Explicit provider cache breakpoints (token positions), for the provider prompt-cache model.
    breakpoints: list[int] | None = None
    #: Speculative decoding (offline model, ``speculative.py``): draft tokens scheduled and accepted at each of
    #: the request's decode steps; None = no speculation (one token a decode step).
    spec_drafted: list[int] | None = None
    spec_accepted: list[int] | None = None

    def full_hashes(self, n_full: int) -> list[int]:
        """The hashes of the first ``n_full`` blocks, missing ones (unknown output) unique so they never hit."""
        h = self.hashes
        if len(h) >= n_full:
            return h if len(h) == n_full else h[:n_full]
        return h + [next(_unique) for _ in range(n_full - len(h))]


@dataclass(slots=True)
class RequestResult:
    """What the simulator predicts for one request."""

    request_id: int
    session_id: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    replica: int = 0
    start_s: float = 0.0
    finish_s: float = 0.0
    #: False when the request needs more KV blocks than the whole pool (vLLM would reject it).
    fits: bool = True

    def as_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "session_id": self.session_id,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "replica": self.replica,
            "start_s": round(self.start_s, 6),
            "finish_s": round(self.finish_s, 6),
            "fits": self.fits,
        }


@dataclass
class SimResult:
    """Per-request results in input order plus per-replica pool statistics."""

    results: list[RequestResult]
    block_size: int
    num_gpu_blocks: int | None
    replicas: int = 1
    routing: str = "none"
    mode: str = "sequential"
    evictions: list[int] = field(default_factory=list)

    @property
    def cached_tokens(self) -> list[int]:
        return [r.cached_tokens for r in self.results]

    def summary(self) -> dict:
        """JSON-able totals, overall and per replica."""

        def agg(rs: list[RequestResult]) -> dict:
            p = sum(r.prompt_tokens for r in rs)
            c = sum(r.cached_tokens for r in rs)
            return {
                "requests": len(rs),
                "prompt_tokens": p,
                "cached_tokens": c,
                "output_tokens": sum(r.output_tokens for r in rs),
                "token_hit_ratio": (c / p) if p else 0.0,
                "requests_with_hit": sum(1 for r in rs if r.cached_tokens),
                "rejected": sum(1 for r in rs if not r.fits),
            }

        out = agg(self.results)
        out.update(
            block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            capacity_tokens=None if self.num_gpu_blocks is None else self.num_gpu_blocks * self.block_size,
            mode=self.mode,
            replicas=self.replicas,
            routing=self.routing,
        )
        per = []
        for i in range(self.replicas):
            d = agg([r for r in self.results if r.replica == i])
            d["replica"] = i
            d["evictions"] = self.evictions[i] if i < len(self.evictions) else 0
            per.append(d)
        out["per_replica"] = per
        if self.mode == "timed" and self.results:
            out["makespan_s"] = max(r.finish_s for r in self.results)
        return out
