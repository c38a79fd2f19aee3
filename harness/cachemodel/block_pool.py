"""A physical KV block pool with vLLM V1's free-queue semantics.

Mirrors ``vllm/v1/core/block_pool.py`` (``BlockPool``) and ``FreeKVCacheBlockQueue``
(``kv_cache_utils.py``), which is what makes finite-capacity hits differ from "LRU over distinct blocks":

* ``num_gpu_blocks`` blocks exist; block 0 is the reserved *null block* and is never handed out, so
  ``num_gpu_blocks - 1`` are usable.
* Free blocks sit in one queue.  A free block may still carry a hash (an evictable cached block); it is
  evicted only when it is popped from the *front* for a new allocation.
* A hit takes the block out of the queue (``touch``: ref_cnt 0 -> 1) wherever it is.
* When a request finishes its blocks are freed in *reverse* order (chain tail first).  vLLM 0.32/0.33
  put freed blocks *without* a hash at the front of the queue and hashed ones at the back; 0.11 appended
  everything (``free_order="append"``).
* Caching a block whose hash is already cached stores a second copy (no de-duplication); lookups return
  the oldest surviving copy (vLLM's ``BlockHashToBlockMap.get_one_block``).

The free queue is an ``OrderedDict`` of block ids: O(1) pop-front, remove, append and prepend, and bulk
operations run in C (``map``/``update``), which is what makes whole-trace simulation fast.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from typing import Literal, Sequence

from kvscope.workloads.prefix import leading_run

FreeOrder = Literal["split", "append"]

_consume = deque(maxlen=0).extend


class PoolExhausted(RuntimeError):
    """Not enough free blocks for an allocation (vLLM would queue or preempt)."""


class BlockPool:
    """Physical pool of ``num_gpu_blocks`` KV blocks (null block included)."""

    def __init__(self, num_gpu_blocks: int, free_order: FreeOrder = "split") -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (one is the reserved null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.free_order = free_order
        self.ref_cnt: list[int] = [0] * num_gpu_blocks
        self.block_hash: list[int | None] = [None] * num_gpu_blocks
        # block 0 is the null block: never in the free queue.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_gpu_blocks))
        self.cached: dict[int, int] = {}  # hash -> oldest surviving block with that hash
        self.extra_copies: dict[int, list[int]] = {}  # hash -> younger duplicate blocks
        self.evictions = 0

    # -- queries (no side effects) --------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def num_free(self) -> int:
        """Free blocks, evictable cached ones included (vLLM's ``get_num_free_blocks``)."""
        return len(self.free_queue)

    def usage(self) -> float:
        """``1 - free/(num_gpu_blocks-1)``, vLLM's ``kv_cache_usage_perc``."""
        return 1.0 - self.num_free / self.usable_blocks

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> int:
        """Length of the leading run of ``hashes[:max_blocks]`` present in the cache."""
        return leading_run(hashes[:max_blocks], self.cached) if max_blocks > 0 else 0

    # -- mutations -------------------------------------------------------------------------------
    def find_hits(self, hashes: Sequence[int], cap: int, session: object = None) -> tuple[int, list[int]]:
        """(k, hit blocks) for the leading run of ``hashes[:cap]`` present in the cache."""
        k = self.lookup(hashes, cap)
        return k, list(map(self.cached.__getitem__, hashes[:k]))

    def evictable(self, hits: Sequence[int]) -> int:
        """How many hit blocks are idle (in the free queue): taking them uses free blocks up."""
        return list(map(self.ref_cnt.__getitem__, hits)).count(0)

    def take(self, hits: Sequence[int]) -> list[int]:
        """Touch the hit blocks (removed from the free queue where idle, ref_cnt += 1)."""
        ref, fq = self.ref_cnt, self.free_queue
        for b in hits:
            if ref[b] == 0:
                del fq[b]
            ref[b] += 1
        return list(hits)

    def run_idle(self, hashes: Sequence[int], cap: int, total: int, full: int, session: object = None) -> int:
        """One request while nothing else runs: ref counts stay 0 (idle fast paths); returns the hit k."""
        hit, k = self.take_leading_hits_idle(hashes, cap)
        new = self.allocate(total - k, set_ref=False)
        self.cache_blocks(new, hashes[k:full])
        hit.extend(new)
        self.free_idle(hit, total - full)
        return k

    def take_leading_hits_idle(self, hashes: Sequence[int], cap: int) -> tuple[list[int], int]:
        """Lookup and idle touch in one pass: (hit blocks, k) for the leading run of ``hashes[:cap]``."""
        if cap <= 0:
            return [], 0
        got = list(map(self.cached.get, hashes[:cap]))
        try:
            k = got.index(None)
            del got[k:]
        except ValueError:
            k = len(got)
        _consume(map(self.free_queue.__delitem__, got))
        return got, k

    def allocate(self, n: int, *, set_ref: bool = True) -> list[int]:
        """Pop ``n`` blocks from the front of the free queue, evicting any hash they still hold."""
        if n <= 0:
            return []
        if n > len(self.free_queue):
            raise PoolExhausted(f"need {n} blocks, {len(self.free_queue)} free")
        pop = self.free_queue.popitem
        bh = self.block_hash
        out = []
        for _ in range(n):
            b = pop(last=False)[0]
            if bh[b] is not None:
                self._evict(b)
            out.append(b)
        if set_ref:
            ref = self.ref_cnt
            for b in out:
                ref[b] = 1
        return out

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        self.block_hash[b] = None
        self.evictions += 1
        if self.cached.get(h) == b:
            copies = self.extra_copies.get(h)
            if copies:
                self.cached[h] = copies.pop(0)
                if not copies:
                    del self.extra_copies[h]
            else:
                del self.cached[h]
        else:
            copies = self.extra_copies[h]
            copies.remove(b)
            if not copies:
                del self.extra_copies[h]

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Give full, freshly computed blocks their hashes (``cache_full_blocks``); duplicates are kept."""
        bh = self.block_hash
        cached = self.cached
        for b, h in zip(blocks, hashes):
            bh[b] = h
            if h in cached:
                self.extra_copies.setdefault(h, []).append(b)
            else:
                cached[h] = b

    def free(self, blocks: Sequence[int], n_hashed: int = 0) -> None:
        """Release a request's blocks (in request order); they re-enter the queue in reverse order (which of
        them carry a hash is read off ``block_hash``, so ``n_hashed`` is not needed)."""
        ref = self.ref_cnt
        released = []
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                released.append(b)
        self._enqueue(released)

    def free_idle(self, blocks: Sequence[int], unhashed_tail: int | None = None) -> None:
        """:meth:`free` for the sole running request of sequential mode (ref counts untouched).

        ``unhashed_tail``: the caller knows only the last ``unhashed_tail`` blocks lack a hash (the
        partial tail), which skips a per-block scan.
        """
        released = blocks[::-1]
        if unhashed_tail is None or self.free_order == "append":
            self._enqueue(released)
            return
        fq = self.free_queue
        fq.update(zip(released[unhashed_tail:], repeat(None)))
        for b in reversed(released[:unhashed_tail]):
            fq[b] = None
            fq.move_to_end(b, last=False)

    def _enqueue(self, released: Sequence[int]) -> None:
        fq = self.free_queue
        if self.free_order == "append":
            fq.update(zip(released, repeat(None)))
            return
        bh = self.block_hash
        # Fast path: only the last block of a request (its partial tail) is normally unhashed.
        if released and bh[released[0]] is None and None not in map(bh.__getitem__, released[1:]):
            fq.update(zip(released[1:], repeat(None)))
            fq[released[0]] = None
            fq.move_to_end(released[0], last=False)
            return
        unhashed = [b for b in released if bh[b] is None]
        fq.update((b, None) for b in released if bh[b] is not None)
        # vLLM prepends the unhashed blocks as a group, keeping their relative order at the front.
        for b in reversed(unhashed):
            fq[b] = None
            fq.move_to_end(b, last=False)

    def remember(self, session: object, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        """No session fast path here: every lookup goes through the hash map."""

    def reset(self) -> None:
        """Drop every cached hash (``reset_prefix_cache``); only valid when nothing is running."""
        self.__init__(self.num_gpu_blocks, self.free_order)  # type: ignore[misc]
