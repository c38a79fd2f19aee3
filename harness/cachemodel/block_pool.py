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
from typing import Iterable, Literal, Sequence

from kvscope.workloads.prefix import common_prefix_len, leading_run

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
    def take_hits(self, hashes: Sequence[int], k: int) -> list[int]:
        """Blocks of the first ``k`` hit hashes, touched (removed from the free queue, ref_cnt += 1)."""
        blocks = list(map(self.cached.__getitem__, hashes[:k]))
        ref = self.ref_cnt
        fq = self.free_queue
        for b in blocks:
            if ref[b] == 0:
                del fq[b]
            ref[b] += 1
        return blocks

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

    def free(self, blocks: Sequence[int]) -> None:
        """Release a request's blocks (in request order); they re-enter the queue in reverse order."""
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

    def reset(self) -> None:
        """Drop every cached hash (``reset_prefix_cache``); only valid when nothing is running."""
        self.__init__(self.num_gpu_blocks, self.free_order)  # type: ignore[misc]


class SequentialBlockPool:
    """:class:`BlockPool` specialised for sequential runs (one request at a time, ``free_order="split"``).

    Between requests every block is free, and vLLM's free queue is then always
    ``[unhashed free blocks] + [hashed free blocks, oldest first]``: unhashed blocks only ever enter at the
    front and hashed ones at the back.  So the unhashed part is a stack, and the hashed part is an
    append-only ring of block ids with *lazy deletion*: ``pos[b]`` is the ring slot holding ``b``'s live
    entry (-1: not queued).  A hit just invalidates ``pos[b]`` (one numpy store per block instead of an
    ``OrderedDict`` delete + re-insert), freeing writes the request's hashed blocks, reversed, at the tail,
    and popping for an allocation skips stale slots with one vectorised compare.  Stale slots are compacted
    away when the ring fills.  Block ids, evictions and hits are identical to :class:`BlockPool`.
    """

    free_order = "split"

    def __init__(self, num_gpu_blocks: int) -> None:
        import numpy as np

        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (one is the reserved null block)")
        self._np = np
        self.num_gpu_blocks = num_gpu_blocks
        self.block_hash: list[int | None] = [None] * num_gpu_blocks
        self.cached: dict[int, int] = {}
        self.extra_copies: dict[int, list[int]] = {}
        self.evictions = 0
        self.unhashed: list[int] = list(range(num_gpu_blocks - 1, 0, -1))  # stack: the end is the queue front
        self.pos = np.full(num_gpu_blocks, -1, dtype=np.int64)
        self.ring = np.zeros(max(4 * num_gpu_blocks, 1 << 12), dtype=np.int64)
        self.head = 0
        self.tail = 0
        self.n_hashed_free = 0
        # session fast path: epoch[b] changes whenever b is popped for reuse; is_dup[b]: b is a younger copy
        self.epoch = np.zeros(num_gpu_blocks, dtype=np.int64)
        self.is_dup = np.zeros(num_gpu_blocks, dtype=bool)
        self._sessions: dict[object, tuple] = {}

    @property
    def usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.unhashed) + self.n_hashed_free

    def usage(self) -> float:
        return 1.0 - self.num_free / self.usable_blocks

    lookup = BlockPool.lookup
    _evict = BlockPool._evict

    def free_queue_order(self) -> list[int]:
        """The free queue, front first (for tests and debugging)."""
        np = self._np
        seg = self.ring[self.head:self.tail]
        live = seg[self.pos[seg] == np.arange(self.head, self.tail)]
        return self.unhashed[::-1] + live.tolist()

    def _session_shortcut(self, session: object, hashes: Sequence[int], cap: int):
        """(k0, the session's previous blocks): how many leading blocks the session's last prompt shares with
        this one and still holds (same epoch, not a duplicate), so only the rest is looked up by hash."""
        if session is None or (st := self._sessions.get(session)) is None:
            return 0, None
        prev_h, prev_blocks, prev_epochs = st
        shared = min(common_prefix_len(prev_h, hashes), cap, len(prev_blocks))
        if not shared:
            return 0, prev_blocks
        seg = prev_blocks[:shared]
        ok = (self.epoch[seg] == prev_epochs[:shared]) & ~self.is_dup[seg]
        return (shared if ok.all() else int(ok.argmin())), prev_blocks

    def run(self, hashes: Sequence[int], cap: int, total: int, full: int, session: object = None) -> int:
        """One request (caller checked ``total <= usable_blocks``): hit, allocate, cache, free; returns k.

        With a ``session`` key, the blocks of the session's previous request are remembered; the part of the
        prompt it shares with that request is validated with one vectorised check (block not evicted since,
        and the oldest copy of its hash) instead of a dict lookup per block.  Results are identical.
        """
        np = self._np
        pos = self.pos
        k0, prev_blocks = self._session_shortcut(session, hashes, cap)
        if cap > k0:
            got = list(map(self.cached.get, hashes[k0:cap]))
            try:
                k = got.index(None)
                del got[k:]
            except ValueError:
                k = len(got)
            k += k0
        else:
            got, k = [], k0
        hit_arr = None
        if k:
            if k0:
                hit_arr = prev_blocks[:k0] if k == k0 else np.concatenate(  # type: ignore[index]
                    (prev_blocks[:k0], np.array(got, dtype=np.int64)))  # type: ignore[index]
            else:
                hit_arr = np.array(got, dtype=np.int64)
            pos[hit_arr] = -1
            self.n_hashed_free -= k
        need = total - k
        stack = self.unhashed
        m = min(need, len(stack))
        if m:
            new = stack[-m:]
            new.reverse()
            del stack[-m:]
        else:
            new = []
        if need > m:
            popped = self._pop_hashed(need - m)
            self._evict_many(popped)
            new.extend(popped)
        if full > k:
            self._cache_many(new[: full - k], hashes[k:full])
        bh = self.block_hash
        for b in new[max(full - k, 0):]:  # the partial tail (usually one block) has no hash
            bh[b] = None
        # free: the unhashed tail is prepended (relative order kept), hashed blocks appended in reverse order
        if total > full:
            stack.extend(new[full - k:])
        if full:
            fresh = np.array(new[: full - k], dtype=np.int64) if full > k else None
            if hit_arr is not None and fresh is not None:
                chain = np.concatenate((hit_arr, fresh))
            elif hit_arr is not None:
                chain = hit_arr[:full]
            else:
                chain = fresh
            self._append_hashed(chain[::-1])  # type: ignore[index]
            if session is not None:
                self._sessions[session] = (hashes, chain, self.epoch[chain])
        elif session is not None:
            self._sessions.pop(session, None)
        return k

    def _evict_many(self, popped: list[int]) -> None:
        """Evict every popped block (all carry a hash); bulk C-level path for hashes without copies."""
        hs = list(map(self.block_hash.__getitem__, popped))  # the caller rewrites block_hash for them
        self.evictions += len(popped)
        extra = self.extra_copies
        if extra:
            dup = list(map(extra.__contains__, hs))
            if True in dup:
                cached = self.cached
                for b, h, d in zip(popped, hs, dup):
                    if not d:
                        del cached[h]
                    elif cached.get(h) == b:  # the oldest copy goes: promote the next one, if any is left
                        copies = extra.get(h)
                        if copies:
                            cached[h] = c = copies.pop(0)
                            self.is_dup[c] = False
                            if not copies:
                                del extra[h]
                        else:
                            del cached[h]
                    else:
                        copies = extra[h]
                        copies.remove(b)
                        if not copies:
                            del extra[h]
                return
        _consume(map(self.cached.__delitem__, hs))

    def _cache_many(self, blocks: list[int], hs: Sequence[int]) -> None:
        """Give fresh full blocks their hashes; a hash already cached makes a younger copy (no de-dup)."""
        bh = self.block_hash
        _consume(map(bh.__setitem__, blocks, hs))
        cached = self.cached
        if cached.keys().isdisjoint(hs):
            n0 = len(cached)
            cached.update(zip(hs, blocks))
            if len(cached) == n0 + len(hs):
                return
            _consume(map(cached.pop, hs, repeat(None)))  # a hash repeated within the request: undo, slow path
        extra = self.extra_copies
        for b, h in zip(blocks, hs):
            if h in cached:
                extra.setdefault(h, []).append(b)
                self.is_dup[b] = True
            else:
                cached[h] = b

    def _append_hashed(self, arr) -> None:
        n = len(arr)
        if self.tail + n > len(self.ring):
            self._compact(n)
        t = self.tail
        self.ring[t:t + n] = arr
        self.pos[arr] = self._np.arange(t, t + n)
        self.tail = t + n
        self.n_hashed_free += n

    def _compact(self, extra: int) -> None:
        np = self._np
        seg = self.ring[self.head:self.tail]
        live = seg[self.pos[seg] == np.arange(self.head, self.tail)]
        size = max(len(self.ring), 2 * (len(live) + extra))
        ring = np.zeros(size, dtype=np.int64) if size != len(self.ring) else self.ring
        ring[: len(live)] = live
        self.pos[live] = np.arange(len(live))
        self.ring, self.head, self.tail = ring, 0, len(live)

    def _pop_hashed(self, n: int) -> list[int]:
        np = self._np
        ring, pos = self.ring, self.pos
        out: list[int] = []
        need = n
        while need:
            h = self.head
            end = min(self.tail, h + max(2 * need, 256))
            if end <= h:
                raise PoolExhausted(f"need {need} more blocks, none free")
            chunk = ring[h:end]
            idx = np.flatnonzero(pos[chunk] == np.arange(h, end))
            if len(idx) >= need:
                idx = idx[:need]
                self.head = h + int(idx[-1]) + 1
            else:
                self.head = end
            blocks = chunk[idx]
            pos[blocks] = -1
            self.epoch[blocks] += 1
            self.is_dup[blocks] = False
            out.extend(blocks.tolist())
            need -= len(blocks)
        self.n_hashed_free -= n
        return out

    def reset(self) -> None:
        self.__init__(self.num_gpu_blocks)  # type: ignore[misc]


class InfinitePool:
    """Unbounded cache: every block ever computed stays cached.  Same interface as :class:`BlockPool`."""

    num_gpu_blocks = None
    evictions = 0

    def __init__(self) -> None:
        self.cached: set[int] = set()

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> int:
        return leading_run(hashes[:max_blocks], self.cached) if max_blocks > 0 else 0

    def add(self, hashes: Iterable[int]) -> None:
        self.cached.update(hashes)

    def usage(self) -> float:
        return 0.0
