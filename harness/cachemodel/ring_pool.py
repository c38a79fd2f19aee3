"""vLLM's free queue as a ring with lazy deletion: the fast pool of the simulator and the scheduler model.

Why another pool: agent prompts are ~100k tokens, so a request hits thousands of blocks, and
:class:`BlockPool` touches, frees and looks up each of them through an ``OrderedDict`` and a dict (about 5 s
per operation over the 620 M-token preset).  A structure holds between requests and under concurrency alike,
because in vLLM 0.32/0.33 (``free_order="split"``) unhashed blocks only ever enter the free
queue at the front and hashed ones at the back: the queue is ``[unhashed stack] + [hashed FIFO]``.  So the
hashed part stays an append-only ring with lazy deletion (a hit invalidates ``pos[b]``), and ref counts are a
numpy array; every per-request operation is a handful of vectorised calls.  Lookups take a session fast
path: the shared prefix with the session's previous request is validated in one
vectorised check (block not popped since, and the oldest copy of its hash).  Block ids, evictions and hits
equal :class:`BlockPool`'s (tests/offline/test_simulator.py and test_scheduler.py run both).  One class
serves both callers: ``run_idle`` for a request that runs alone (the sequential simulator: ref counts stay 0,
no per-hit queue moves), and the ref-counted ``find_hits`` / ``take`` / ``allocate`` / ``free`` of the
:class:`~.pool.Pool` protocol for the scheduler model.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import Sequence

import numpy as np
from kvscope.harness.cachemodel.block_pool import BlockPool, PoolExhausted
from kvscope.workloads.prefix import common_prefix_len

_consume = deque(maxlen=0).extend


class RingBlockPool:
    """Ref-counted pool of ``num_gpu_blocks`` KV blocks (null block included), ``free_order="split"`` only.

    In vLLM 0.32/0.33 the free queue is always
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
        self.ref = np.zeros(num_gpu_blocks, dtype=np.int32)  # ref counts (all 0 between requests of run_idle)

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

    def run_idle(self, hashes: Sequence[int], cap: int, total: int, full: int, session: object = None) -> int:
        """One request while nothing else runs (caller checked ``total <= usable_blocks``): hit, allocate,
        cache, free; returns k.  Ref counts are not touched: between requests they are all 0.

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

    def find_hits(self, hashes: Sequence[int], cap: int, session: object = None):
        """(k, hit blocks as an int64 array) for the leading run of ``hashes[:cap]`` present in the cache."""
        np = self._np
        if cap <= 0:
            return 0, None
        k0, prev_blocks = self._session_shortcut(session, hashes, cap)
        got: list[int] = []
        if cap > k0:
            got = list(map(self.cached.get, hashes[k0:cap]))
            try:
                del got[got.index(None):]
            except ValueError:
                pass
        k = k0 + len(got)
        if not k:
            return 0, None
        if not k0:
            return k, np.array(got, dtype=np.int64)
        head = prev_blocks[:k0]  # type: ignore[index]
        return k, head if not got else np.concatenate((head, np.array(got, dtype=np.int64)))

    def evictable(self, hits) -> int:
        return 0 if hits is None else int((self.ref[hits] == 0).sum())

    def take(self, hits) -> list[int]:
        """Touch the hit blocks (out of the free queue where ref_cnt was 0, ref_cnt += 1)."""
        if hits is None:
            return []
        ref = self.ref
        idle = hits[ref[hits] == 0]
        self.pos[idle] = -1
        self.n_hashed_free -= len(idle)
        ref[hits] += 1  # the blocks of one request are distinct
        return hits.tolist()

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front (the unhashed stack first), evicting the hashes they held."""
        if n <= 0:
            return []
        if n > self.num_free:
            raise PoolExhausted(f"need {n} blocks, {self.num_free} free")
        stack = self.unhashed
        m = min(n, len(stack))
        new = stack[-m:] if m else []
        new.reverse()
        if m:
            del stack[-m:]
        if n > m:
            popped = self._pop_hashed(n - m)
            self._evict_many(popped)
            bh = self.block_hash
            for b in popped:
                bh[b] = None
            new.extend(popped)
        self.ref[new] = 1
        return new

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        if len(blocks):
            self._cache_many(list(blocks), hashes)

    def free(self, blocks: Sequence[int], n_hashed: int = 0):
        """Release a request's blocks (request order; the first ``n_hashed`` carry hashes): reverse order,
        unhashed ones to the front as a group, hashed ones to the back."""
        if not blocks:
            return None
        np = self._np
        arr = np.asarray(blocks, dtype=np.int64)
        ref = self.ref
        ref[arr] -= 1
        hashed = arr[:n_hashed]
        rel = hashed[ref[hashed] == 0][::-1]
        tail = [b for b in blocks[n_hashed:] if ref[b] == 0]
        if tail:
            self.unhashed.extend(tail)  # stack end = queue front: released order r1, r2.. ends up r1 first
        if len(rel):
            self._append_hashed(rel)
        return arr  # the blocks as an array, for :meth:`remember`

    def remember(self, session: object, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        """The hashed blocks a session's request leaves behind, for its next request's fast lookup."""
        if session is None:
            return
        if not len(blocks):
            self._sessions.pop(session, None)
            return
        arr = self._np.asarray(blocks, dtype=self._np.int64)
        self._sessions[session] = (hashes, arr, self.epoch[arr])

    def reset(self) -> None:
        self.__init__(self.num_gpu_blocks)  # type: ignore[misc]
