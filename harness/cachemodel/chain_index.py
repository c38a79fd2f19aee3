"""Compact maps of chained block hashes, for passes over whole traces (``kvscope explain``).

Why not a Python ``set``/``dict``: a trace whose every request breaks the cache early (a timestamp in the
system prompt) has as many distinct block chains as blocks; 5,000 generated sessions hold ~23 M of them, and
a Python int in a dict costs ~100 bytes (8.1 GB peak for ``explain``, issue 27).  Here the keys are the same
64-bit ``xxh3_64`` chained hashes (:mod:`.hashing`, unchanged: the structure stores exactly the values the
simulator's sets store, so it adds no collision of its own) held in one sorted ``uint64`` numpy array with an
``int64`` value beside it where one is kept (8 or 16 bytes a chain), plus a bounded Python dict of recent insertions that is merged
into the arrays (``np.insert`` at ``searchsorted`` positions, linear) whenever it reaches ``pending_limit``.
Lookups are one ``searchsorted`` per request plus a C-level ``map`` over the recent dict.

:class:`ChainIndex` maps a chain to the latest value put (explain's "latest earlier request holding this
prefix").  :class:`InfiniteCacheStream` is the unbounded sequential prefix cache over it: exactly
:class:`~.pool.InfinitePool` driven by :func:`~.simulator.simulate` in sequential mode (hit = leading run of
``hashes[:cap]`` present, then every full block hashed in), one request at a time, so a caller streams a trace
through it without materialising a :class:`~.sim_types.SimRequest` per request.
"""

from __future__ import annotations

import numpy as np

_EMPTY_KEYS = np.zeros(0, np.uint64)


class ChainIndex:
    """uint64 chained hash -> int value (the latest put), compact; ``values=False``: a set (every value 0)."""

    def __init__(self, values: bool = True, pending_limit: int = 1 << 19) -> None:
        self.keys = _EMPTY_KEYS
        self.values: np.ndarray | None = np.zeros(0, np.int64) if values else None
        self.pending: dict[int, int] = {}
        self.pending_limit = pending_limit

    def __len__(self) -> int:
        return len(self.keys) + len(self.pending)

    def _locate(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position in ``keys``, found there) per hash."""
        pos = np.searchsorted(self.keys, hashes)
        if not len(self.keys):
            return pos, np.zeros(len(hashes), bool)
        found = self.keys[np.minimum(pos, len(self.keys) - 1)] == hashes
        return pos, found

    def leading_run(self, hashes: np.ndarray, cap: int | None = None) -> tuple[int, int | None]:
        """(length of the leading run of ``hashes[:cap]`` present, the value of its last hash or None)."""
        h = hashes if cap is None else hashes[:cap]
        if not len(h):
            return 0, None
        pos, found = self._locate(h)
        miss = np.flatnonzero(~found)
        pend = self.pending
        if not len(miss):
            k = len(h)
        elif not pend or int(h[miss[0]]) not in pend:  # the usual case: the first miss is a miss
            k = int(miss[0])
        else:
            in_pending = np.fromiter(map(pend.__contains__, h[miss].tolist()), bool, len(miss))
            absent = miss[~in_pending]
            k = int(absent[0]) if len(absent) else len(h)
        if k == 0:
            return 0, None
        last = k - 1
        if self.values is None:
            return k, 0
        return k, int(self.values[pos[last]]) if found[last] else self.pending[int(h[last])]

    def put(self, hashes: np.ndarray, value: int) -> None:
        """Every hash now maps to ``value`` (overwriting)."""
        if not len(hashes):
            return
        pos, found = self._locate(hashes)
        if self.values is not None and found.any():
            self.values[pos[found]] = value
        new = hashes[~found]
        if len(new):
            self.pending.update(dict.fromkeys(new.tolist(), value))
            if len(self.pending) >= self.pending_limit:
                self._merge()

    def _merge(self) -> None:
        keys = np.fromiter(self.pending.keys(), np.uint64, len(self.pending))
        order = np.argsort(keys)
        at = np.searchsorted(self.keys, keys[order])
        self.keys = np.insert(self.keys, at, keys[order])
        if self.values is not None:
            values = np.fromiter(self.pending.values(), np.int64, len(self.pending))
            self.values = np.insert(self.values, at, values[order])
        self.pending = {}


class InfiniteCacheStream:
    """The unbounded sequential prefix cache, one request at a time (see the module doc)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.cached = ChainIndex(values=False)

    def request(self, hashes: np.ndarray, prompt_tokens: int) -> int:
        """Cached tokens of a request whose full blocks (prompt, then known output) hash to ``hashes``
        (uint64; every block the finished request leaves cached); the blocks are cached afterwards."""
        B = self.block_size
        cap = (prompt_tokens - 1) // B if prompt_tokens > 0 else 0
        k, _ = self.cached.leading_run(hashes, cap)
        self.cached.put(hashes, 0)
        return k * B


def chain_hashes(tokens: np.ndarray, block_size: int, n_blocks: int, hasher: object = None, key: object = None
                 ) -> np.ndarray:
    """The chained hashes of ``tokens``' first ``n_blocks`` full blocks as a uint64 array (through an
    :class:`~.hashing.IncrementalHasher` under ``key`` where given, which reuses a shared prefix's hashes)."""
    from kvscope.harness.cachemodel.hashing import IncrementalHasher, as_token_array, extend_hashes, salt_seed

    arr = as_token_array(tokens)
    if isinstance(hasher, IncrementalHasher):
        got = hasher.hashes(key, arr, n_blocks)
    else:
        got = extend_hashes(arr, block_size, [], salt_seed(None), n_blocks)
    return np.array(got, dtype=np.uint64)
