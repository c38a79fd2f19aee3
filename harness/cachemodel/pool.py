"""The one interface every KV block pool implements, the one unbounded pool, and the one pool factory.

The simulator (sequential and timed modes) and the scheduler model ask a pool the same questions: how long is
the leading run of cached hashes, which blocks are they, how many of them sit idle in the free queue, take them,
allocate, hash, free; plus one fast path for a request that runs alone (``run_idle``).  Three pools answer:
:class:`~.block_pool.BlockPool` (the reference: vLLM's free queue as an ``OrderedDict``, every free order),
:class:`~.ring_pool.RingBlockPool` (the same blocks, evictions and hits from a ring with lazy deletion: the fast
path for vLLM 0.32/0.33's split free order) and :class:`InfinitePool` (nothing is ever evicted).  A structural
``Protocol`` rather than a base class, because the pools share no state and the ring pool's speed comes from
holding it differently; callers dispatch on the protocol's methods, never on a pool's class.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from kvscope.harness.cachemodel.block_pool import BlockPool, FreeOrder
from kvscope.harness.cachemodel.ring_pool import RingBlockPool
from kvscope.workloads.prefix import common_prefix_len, leading_run

#: ``num_free`` / ``usable_blocks`` of the unbounded pool: larger than any request.
UNBOUNDED_BLOCKS = 1 << 62


@runtime_checkable
class Pool(Protocol):
    """A pool of ``num_gpu_blocks`` KV blocks (null block included; None: unbounded) with vLLM's semantics.

    ``hits`` is whatever :meth:`find_hits` returned for the hit blocks (a list, an array, a count): only the
    same pool's :meth:`evictable` and :meth:`take` read it.
    """

    num_gpu_blocks: int | None
    evictions: int

    @property
    def usable_blocks(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def usage(self) -> float: ...

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> int:
        """Length of the leading run of ``hashes[:max_blocks]`` present in the cache (no side effect)."""
        ...

    def run_idle(self, hashes: Sequence[int], cap: int, total: int, full: int, session: object = None) -> int:
        """One request while nothing else runs (the caller checked ``total <= usable_blocks``): hit at most
        ``cap`` blocks, allocate the rest of ``total``, hash the first ``full``, free them all; returns the hit."""
        ...

    def find_hits(self, hashes: Sequence[int], cap: int, session: object = None) -> tuple[int, Any]:
        """(k, the hit blocks) for the leading run of ``hashes[:cap]`` (no side effect)."""
        ...

    def evictable(self, hits: Any) -> int:
        """How many of the hit blocks sit in the free queue (taking them uses free blocks up)."""
        ...

    def take(self, hits: Any) -> list[int]:
        """Touch the hit blocks (out of the free queue where idle, ref count + 1)."""
        ...

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front of the free queue, evicting the hashes they held."""
        ...

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Give full, freshly computed blocks their hashes (duplicates kept)."""
        ...

    def free(self, blocks: Sequence[int], n_hashed: int = 0) -> Any:
        """Release a request's blocks (request order; the first ``n_hashed`` carry hashes)."""
        ...

    def remember(self, session: object, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        """The hashed blocks a session's request leaves behind, for its next request's fast lookup."""
        ...

    def reset(self) -> None:
        """Drop every cached hash (``reset_prefix_cache``); only valid when nothing is running."""
        ...


class InfinitePool:
    """Unbounded cache: every block ever computed stays cached, nothing is evicted, nothing is ever full.

    Blocks have no identity here (every id is 0).  Agent prompts mostly extend the session's previous one,
    whose blocks are cached for good, so only the part of a prompt beyond the common prefix with the session's
    previous request is looked up (``session``).
    """

    num_gpu_blocks: int | None = None
    usable_blocks = UNBOUNDED_BLOCKS
    num_free = UNBOUNDED_BLOCKS

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.evictions = 0
        self._last: dict[object, Sequence[int]] = {}

    def usage(self) -> float:
        return 0.0

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> int:
        return leading_run(hashes[:max_blocks], self.cached) if max_blocks > 0 else 0

    def run_idle(self, hashes: Sequence[int], cap: int, total: int, full: int, session: object = None) -> int:
        prev = self._last.get(session) if session is not None else None
        k = shared = min(common_prefix_len(prev, hashes), cap) if prev else 0
        if k < cap:
            flags = list(map(self.cached.__contains__, hashes[k:cap]))
            try:
                k += flags.index(False)
            except ValueError:
                k += len(flags)
        self.cached.update(hashes[shared:full])
        if session is not None:
            self._last[session] = hashes
        return k

    def find_hits(self, hashes: Sequence[int], cap: int, session: object = None) -> tuple[int, int]:
        k = self.lookup(hashes, cap)
        return k, k

    def evictable(self, hits: int) -> int:
        return 0

    def take(self, hits: int) -> list[int]:
        return [0] * hits

    def allocate(self, n: int) -> list[int]:
        return [0] * n if n > 0 else []

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        self.cached.update(hashes)

    def free(self, blocks: Sequence[int], n_hashed: int = 0) -> None:
        pass

    def remember(self, session: object, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        pass

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


def make_pool(num_gpu_blocks: int | None, free_order: FreeOrder = "split", *, reference: bool = False) -> Pool:
    """The pool for a configuration: unbounded (``num_gpu_blocks`` None), the ring pool (split free order), or
    the reference :class:`BlockPool` (``reference``, or vLLM 0.11's append order, where the ring's two-part
    free queue does not hold).  Every choice gives the same block ids, evictions and hits."""
    if num_gpu_blocks is None:
        return InfinitePool()
    if reference or free_order != "split":
        return BlockPool(num_gpu_blocks, free_order)
    return RingBlockPool(num_gpu_blocks)
