"""vLLM V1 automatic-prefix-caching simulator (sequential and timed modes, N replicas).

Per request (vllm-facts §1, §9; ``KVCacheManager.get_computed_blocks`` / ``allocate_slots`` / ``free``):

1. hit = longest run of leading full prompt blocks present in the cache, capped at ``(P-1)//B`` blocks
   (the last prompt token is always recomputed); ``cached_tokens = hit * B``.
2. hit blocks are touched (taken out of the free queue); the other ``ceil((P+O-1)/B) - hit`` blocks are
   popped from the front of the free queue (evicting the hashes they held); full blocks get their hashes,
   duplicates included.  ``P+O-1`` because the last sampled token is never fed back, so it has no KV.
3. at finish the blocks are freed in reverse order (hashed to the back, unhashed to the front).

*Sequential* mode runs requests one at a time: the exact baseline that matched vLLM on 3,800 requests.
*Timed* mode overlaps requests by arrival time with a simple service model; running requests pin their
blocks, admission is FCFS and waits for free blocks (no preemption), and all of a request's blocks are
allocated and hashed at admission (vLLM hashes blocks when it schedules them; decode blocks arrive
later in reality, so timed mode is slightly pessimistic about free space).

Timed mode is the coarse, calibration-free overlap model behind ``kvscope simulate --mode timed``, the one
that spreads requests over N replicas by a routing policy. The step-level model of one vLLM instance —
token budget, chunked prefill, preemption, step costs from a calibration — is :mod:`.scheduler`, and every
prediction of latency, preemption or capacity comes from it. The two share what decides the cache: the pools
(:func:`~.pool.make_pool`), the lookup and admission check (``find_hits`` / ``evictable``) and a request's
block geometry (:meth:`SimRequest.hit_cap_blocks`, :meth:`SimRequest.finished_blocks`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from kvscope.harness.cachemodel.block_pool import FreeOrder
from kvscope.harness.cachemodel.pool import Pool, make_pool
from kvscope.harness.cachemodel.routing import Router
from kvscope.harness.cachemodel.sim_types import RequestResult, SimRequest, SimResult
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE
from kvscope.harness.cachemodel.hashing import IncrementalHasher, as_token_array


@dataclass(frozen=True)
class SimConfig:
    """Server-side cache configuration, in vLLM's own terms.

    ``num_gpu_blocks`` is vLLM's ``num_gpu_blocks`` (the null block included, so ``N-1`` usable); ``None``
    means an infinite cache.  ``capacity_tokens`` (vLLM's logged "KV cache size: T tokens") is ``N*B``.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int | None = None
    free_order: FreeOrder = "split"

    @classmethod
    def from_capacity_tokens(cls, block_size: int, capacity_tokens: float | None, **kw) -> "SimConfig":
        if capacity_tokens is None:
            return cls(block_size=block_size, num_gpu_blocks=None, **kw)
        return cls(block_size=block_size, num_gpu_blocks=max(2, int(capacity_tokens) // block_size), **kw)


@dataclass(frozen=True)
class ServiceModel:
    """Service time for timed mode: prefill of uncached tokens plus per-sequence decode."""

    prefill_tokens_per_s: float = 5000.0
    decode_tokens_per_s: float = 50.0
    max_num_seqs: int = 256

    def service_s(self, uncached_tokens: int, output_tokens: int) -> float:
        return uncached_tokens / self.prefill_tokens_per_s + output_tokens / self.decode_tokens_per_s


def _shape(req: SimRequest, B: int) -> tuple[int, int, int]:
    """(hit cap in blocks, blocks held at the end, full blocks cached at the end)."""
    return (req.hit_cap_blocks(B), *req.finished_blocks(B))


class Replica:
    """One vLLM instance: a pool plus load counters for the router."""

    def __init__(self, cfg: SimConfig, mode: str = "sequential") -> None:
        self.cfg = cfg
        # Sequential mode takes the ring pool's idle fast path (same results, no per-hit queue moves); timed
        # mode holds blocks of several running requests at once and runs on the reference pool.
        self.pool: Pool = make_pool(cfg.num_gpu_blocks, cfg.free_order, reference=mode != "sequential")
        self._run_idle = self.pool.run_idle  # bound once: sequential mode calls it per request
        self.in_flight = 0
        self.routed_tokens = 0
        self.running = 0
        self.waiting: deque[SimRequest] = deque()

    def probe(self, req: SimRequest) -> int:
        return self.pool.lookup(req.hashes, req.hit_cap_blocks(self.cfg.block_size))

    # Sequential mode: nothing else is running, so ref counts can be skipped (idle fast paths).
    def run_sequential(self, req: SimRequest) -> tuple[int, bool]:
        B = self.cfg.block_size
        cap, total, full = _shape(req, B)
        pool = self.pool
        if total > pool.usable_blocks:
            return 0, False
        h = req.hashes
        return self._run_idle(h if len(h) == full else req.full_hashes(full), cap, total, full,
                              req.session_id) * B, True

    # Timed mode: ref-counted admission; returns None if it must wait for free blocks.
    def try_admit(self, req: SimRequest) -> tuple[int, list[int] | None, bool]:
        B = self.cfg.block_size
        cap, total, full = _shape(req, B)
        pool = self.pool
        if total > pool.usable_blocks:
            return 0, None, False
        hashes = req.full_hashes(full)
        k, hits = pool.find_hits(hashes, cap)
        if (total - k) + (pool.evictable(hits) if k else 0) > pool.num_free:
            return k, None, True
        blocks = pool.take(hits) if k else []
        new = pool.allocate(total - k)
        pool.cache_blocks(new, hashes[k:full])
        blocks.extend(new)
        return k, blocks, True

    def release(self, blocks: list[int]) -> None:
        if blocks:
            self.pool.free(blocks)


def simulate(
    requests: Iterable[SimRequest],
    config: SimConfig,
    *,
    replicas: int = 1,
    routing: str = "round-robin",
    mode: str = "sequential",
    service: ServiceModel | None = None,
) -> SimResult:
    """Run the requests through ``replicas`` simulated vLLM instances; results are in input order."""
    reqs = requests if isinstance(requests, list) else list(requests)
    for r in reqs[:1]:
        if r.block_size != config.block_size:
            raise ValueError(f"requests were hashed with block size {r.block_size}, config has {config.block_size}")
    reps = [Replica(config, mode) for _ in range(replicas)]
    router = Router(routing, replicas)
    if mode == "sequential":
        results = _run_sequential(reqs, reps, router, config.block_size)
    elif mode == "timed":
        results = _run_timed(reqs, reps, router, config.block_size, service or ServiceModel())
    else:
        raise ValueError(f"unknown mode {mode!r} (sequential or timed)")
    return SimResult(
        results=results,
        block_size=config.block_size,
        num_gpu_blocks=config.num_gpu_blocks,
        replicas=replicas,
        routing=router.policy if replicas > 1 else "none",
        mode=mode,
        evictions=[r.pool.evictions for r in reps],
    )


def _run_sequential(reqs: list[SimRequest], reps: list[Replica], router: Router, B: int) -> list[RequestResult]:
    out = []
    single = len(reps) == 1
    rep0 = reps[0]
    for req in reqs:
        if single:
            i, rep = 0, rep0
        else:
            i = router.choose(req, reps)
            rep = reps[i]
            rep.routed_tokens += req.prompt_tokens
        cached, fits = rep.run_sequential(req)
        out.append(RequestResult(req.request_id, req.session_id, req.prompt_tokens, req.output_tokens, cached, i,
                                 fits=fits))
    return out


def _run_timed(reqs: list[SimRequest], reps: list[Replica], router: Router, B: int,
               svc: ServiceModel) -> list[RequestResult]:
    results: list[RequestResult | None] = [None] * len(reqs)
    # Closed-loop sessions: a request with gap_s is released when its session predecessor finishes.
    successor: dict[int, int] = {}
    last_of_session: dict[str, int] = {}
    initial = []
    for idx, r in enumerate(reqs):
        prev = last_of_session.get(r.session_id) if r.session_id is not None else None
        if prev is not None and r.gap_s is not None:
            successor[prev] = idx
        else:
            initial.append(idx)
        if r.session_id is not None:
            last_of_session[r.session_id] = idx
    seq = itertools.count()
    events: list[tuple[float, int, int, int, object]] = []  # (time, order, kind 0=finish 1=arrive, idx, data)
    for idx in initial:
        heapq.heappush(events, (reqs[idx].arrival_s, next(seq), 1, idx, None))
    assigned: dict[int, int] = {}

    def admit(rep_i: int, now: float) -> None:
        rep = reps[rep_i]
        while rep.waiting and rep.running < svc.max_num_seqs:
            req = rep.waiting[0]
            idx = index_of[id(req)]
            k, blocks, fits = rep.try_admit(req)
            if not fits:
                rep.waiting.popleft()
                rep.in_flight -= 1
                results[idx] = RequestResult(req.request_id, req.session_id, req.prompt_tokens,
                                             req.output_tokens, 0, rep_i, now, now, fits=False)
                _release_successor(idx, now)
                continue
            if blocks is None:
                break
            rep.waiting.popleft()
            rep.running += 1
            cached = k * B
            done = now + svc.service_s(req.prompt_tokens - cached, req.output_tokens)
            results[idx] = RequestResult(req.request_id, req.session_id, req.prompt_tokens, req.output_tokens,
                                         cached, rep_i, now, done)
            heapq.heappush(events, (done, next(seq), 0, idx, blocks))

    def _release_successor(idx: int, now: float) -> None:
        nxt = successor.get(idx)
        if nxt is not None:
            gap = reqs[nxt].gap_s or 0.0
            heapq.heappush(events, (max(now + gap, now), next(seq), 1, nxt, None))

    index_of = {id(r): i for i, r in enumerate(reqs)}
    while events:
        now, _, kind, idx, data = heapq.heappop(events)
        if kind == 1:
            req = reqs[idx]
            i = router.choose(req, reps)
            rep = reps[i]
            rep.routed_tokens += req.prompt_tokens
            rep.in_flight += 1
            assigned[idx] = i
            rep.waiting.append(req)
            admit(i, now)
        else:
            i = assigned[idx]
            rep = reps[i]
            rep.release(data)  # type: ignore[arg-type]
            rep.running -= 1
            rep.in_flight -= 1
            _release_successor(idx, now)
            admit(i, now)
    return [r for r in results if r is not None]


# ---------------------------------------------------------------------------------------------------
# Convenience entry points for the harness.

def requests_from_token_pairs(pairs: Iterable[tuple[Sequence[int], Sequence[int] | None]], block_size: int,
                              **names: Sequence[str | None] | None) -> list[SimRequest]:
    """Build :class:`SimRequest` s from ``(prompt_ids, output_ids)`` pairs (output ids may be None);
    ``cache_salts`` and ``session_ids`` as in :func:`iter_requests_from_token_pairs`."""
    return list(iter_requests_from_token_pairs(pairs, block_size, **names))


def iter_requests_from_token_pairs(
    pairs: Iterable[tuple[Sequence[int], Sequence[int] | None]],
    block_size: int,
    *,
    cache_salts: Sequence[str | None] | None = None,
    session_ids: Sequence[str | None] | None = None,
) -> Iterator[SimRequest]:
    """:func:`requests_from_token_pairs` one request at a time, for a caller that streams a whole trace (a
    request's Python hash list is ~40 bytes a block: kept for every request of a large trace, gigabytes)."""
    hasher = IncrementalHasher(block_size)
    for i, (prompt, output) in enumerate(pairs):
        salt = cache_salts[i] if cache_salts is not None else None
        sid = session_ids[i] if session_ids is not None else None
        P = len(prompt)
        O = len(output) if output is not None else 1
        if output is not None and len(output):
            toks = np.concatenate([as_token_array(prompt), as_token_array(output)])
            n_blocks = (P + O - 1) // block_size
        else:
            toks = as_token_array(prompt)
            n_blocks = P // block_size
        # Without a session id every request is compared against the previous one (cheap and exact).
        hashes = hasher.hashes(sid if sid is not None else "__all__", toks, n_blocks, salt)
        yield SimRequest(i, P, O, hashes, block_size, session_id=sid, cache_salt=salt)


def predict_cached_tokens(
    pairs: Iterable[tuple[Sequence[int], Sequence[int] | None]],
    block_size: int,
    num_gpu_blocks: int | None,
    *,
    cache_salts: Sequence[str | None] | None = None,
    free_order: FreeOrder = "split",
) -> list[int]:
    """Per-request ``cached_tokens`` vLLM should report when the pairs are sent one at a time.

    ``num_gpu_blocks`` is the server's ``num_gpu_blocks`` (null block included), ``None`` = infinite.
    The server must start with an empty prefix cache (fresh start or ``reset_prefix_cache``).
    """
    reqs = requests_from_token_pairs(pairs, block_size, cache_salts=cache_salts)
    res = simulate(reqs, SimConfig(block_size, num_gpu_blocks, free_order))
    return res.cached_tokens
