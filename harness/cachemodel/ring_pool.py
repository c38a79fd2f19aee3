"""vLLM's free queue with ref counts, for the scheduler model: the ring of :class:`SequentialBlockPool`.

Why another pool: agent prompts are ~100k tokens, so a request hits thousands of blocks, and
:class:`BlockPool` touches, frees and looks up each of them through an ``OrderedDict`` and a dict (about 5 s
per operation over the 620 M-token preset).  The structure :class:`SequentialBlockPool` exploits holds under
concurrency too, because in vLLM 0.32/0.33 (``free_order="split"``) unhashed blocks only ever enter the free
queue at the front and hashed ones at the back: the queue is ``[unhashed stack] + [hashed FIFO]``.  So the
hashed part stays an append-only ring with lazy deletion (a hit invalidates ``pos[b]``), and ref counts are a
numpy array; every per-request operation is a handful of vectorised calls.  Lookups take the session fast
path of the sequential pool: the shared prefix with the session's previous request is validated in one
vectorised check (block not popped since, and the oldest copy of its hash).  Block ids, evictions and hits
equal :class:`BlockPool`'s (tests/offline/test_scheduler.py runs both).
"""

from __future__ import annotations

from typing import Sequence

from kvscope.harness.cachemodel.block_pool import SequentialBlockPool


class RingBlockPool(SequentialBlockPool):
    """Ref-counted pool of ``num_gpu_blocks`` (null block included), ``free_order="split"`` only."""

    def __init__(self, num_gpu_blocks: int) -> None:
        super().__init__(num_gpu_blocks)
        self.ref = self._np.zeros(num_gpu_blocks, dtype=self._np.int32)

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
            from kvscope.harness.cachemodel.block_pool import PoolExhausted

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

    def free(self, blocks: Sequence[int], n_hashed: int):
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

    def usage(self) -> float:
        return 1.0 - self.num_free / self.usable_blocks
