"""Compact maps of chained block hashes, for passes over whole traces (``kvscope explain``).

Why not a Python ``set``/``dict``: a trace whose every request breaks the cache early (a timestamp in the
system prompt) has as many distinct block chains as blocks; 5,000 generated sessions hold ~50 M of them, and
a Python int in a dict costs ~100 bytes, against 8 or 12 bytes a chain here (the peak memory and time of
``explain`` on that trace, before and after: ``benchmarks/explain_scale.py``, benchmarks/README.md).  Here
the keys are the same 64-bit ``xxh3_64`` chained hashes (:mod:`.hashing`) in sorted ``uint64`` numpy arrays, with an ``int32``
value (a request id) beside them where one is kept: 8 or 12 bytes a chain.  New chains go to a small Python
dict, merged into a middle sorted array every ``pending_limit`` insertions, and that one into the main array
when it reaches an eighth of it; merges are in place (the arrays grow, the old entries move from the back),
linear and amortised, and never hold a second copy of the main array.

Lookups use what chaining guarantees: the stored chains are *prefix-closed* (whoever put a chain put all its
prefixes: a request caches, or holds, all its leading blocks) and a hash stands for its whole prefix, so
membership along a request's chain is monotone and the leading run is found by binary search, O(log n) probes
instead of one per block (a probe into a 50 M-entry array is a cache miss; a probe per block made the first
version slower than the dicts).  The answer equals the per-block scan of :class:`~.pool.InfinitePool` unless a
64-bit hash collides with a stored chain of another prefix, the same assumption every set of chained hashes in
the simulator already makes (probability ~ lookups x stored / 2^64: ~1e-4 for 5,000 sessions).

:class:`ChainIndex` maps a chain to the latest value put (explain's "latest earlier request holding this
prefix").  :class:`InfiniteCacheStream` is the unbounded sequential prefix cache over it: what
:class:`~.pool.InfinitePool` driven by :func:`~.simulator.simulate` in sequential mode gives (hit = leading
run of ``hashes[:cap]`` present, then every full block hashed in), one request at a time, so a caller streams
a trace through it without materialising a :class:`~.sim_types.SimRequest` per request.
"""

from __future__ import annotations

import numpy as np
from kvscope.harness.cachemodel.hashing import IncrementalHasher, as_token_array, extend_hashes, salt_seed


class _Sorted:
    """One sorted level: keys and (optionally) int32 values (request ids)."""

    __slots__ = ("keys", "values")
    chunk = 1 << 20  # entries moved at a time by a merge

    def __init__(self, values: bool) -> None:
        self.keys = np.zeros(0, np.uint64)
        self.values: np.ndarray | None = np.zeros(0, np.int32) if values else None

    def find(self, h: np.ndarray) -> int:
        """Position of the single hash ``h`` (a length-1 uint64 array), or -1."""
        keys = self.keys
        if not len(keys):
            return -1
        i = int(keys.searchsorted(h)[0])
        return i if i < len(keys) and keys[i] == h[0] else -1

    def merge(self, keys: np.ndarray, values: np.ndarray | None) -> None:
        """Insert new keys (none present here) in place: the arrays grow (``realloc``) and the old entries
        move right from the back, a chunk at a time, so a merge never holds a second copy of the level.
        Keys already sorted (a middle level merged into the main one) are not sorted again, and the new
        entries go in a chunk at a time too: beside the grown arrays a merge holds one ``int64`` position
        per new key (a whole-array sort and placement held five such arrays, ~0.25 GB at 5,000 sessions)."""
        if len(keys) > 1 and not bool(np.all(keys[:-1] <= keys[1:])):
            order = np.argsort(keys)
            keys = keys[order]
            values = values[order] if values is not None else None
        at = np.searchsorted(self.keys, keys)
        n, m = len(self.keys), len(keys)
        arrays = [(self.keys, keys)]
        if self.values is not None and values is not None:
            arrays.append((self.values, values))
        grown = []
        for old, new in arrays:
            if old.flags.owndata and old.base is None:
                old.resize(n + m, refcheck=False)
                arr = old
            else:
                arr = np.concatenate([old, np.zeros(m, old.dtype)])
            for hi in range(n, 0, -self.chunk):  # old entry i goes to i + #(new entries before it)
                lo = max(0, hi - self.chunk)
                idx = np.arange(lo, hi)
                arr[idx + np.searchsorted(at, idx, side="right")] = arr[lo:hi].copy()
            for lo in range(0, m, self.chunk):  # new entry j goes to at[j] + j
                hi = min(m, lo + self.chunk)
                arr[at[lo:hi] + np.arange(lo, hi)] = new[lo:hi]
            grown.append(arr)
        self.keys = grown[0]
        if len(grown) > 1:
            self.values = grown[1]


class ChainIndex:
    """Prefix-closed uint64 chained hashes -> int value (the latest put), compact; ``values=False``: a set.

    Callers put whole chain prefixes (every hash of a request's leading blocks), see the module doc."""

    def __init__(self, values: bool = True, pending_limit: int = 1 << 16) -> None:
        self.with_values = values
        self.levels = (_Sorted(values), _Sorted(values))  # middle, main
        self.pending: dict[int, int] = {}
        self.pending_limit = pending_limit

    def __len__(self) -> int:
        return len(self.levels[0].keys) + len(self.levels[1].keys) + len(self.pending)

    def _where(self, h: np.ndarray) -> tuple[int, int] | None:
        """(level, position) of a single hash (level -1: the pending dict), or None."""
        if int(h[0]) in self.pending:
            return -1, 0
        for lv, level in enumerate(self.levels):
            i = level.find(h)
            if i >= 0:
                return lv, i
        return None

    def _value(self, h: np.ndarray, at: tuple[int, int]) -> int:
        lv, i = at
        if lv < 0:
            return self.pending[int(h[0])]
        values = self.levels[lv].values
        return int(values[i]) if values is not None else 0

    def leading_run(self, hashes: np.ndarray, cap: int | None = None, min_value: int | None = None
                    ) -> tuple[int, int | None]:
        """(length of the leading run of ``hashes[:cap]`` present, the value of its last hash or None);
        ``min_value``: only entries holding at least that value count (they must be prefix-closed too)."""
        h = hashes if cap is None else hashes[:cap]
        lo, hi, last = 0, len(h), None  # h[:lo] present, h[hi:] absent
        while lo < hi:
            mid = (lo + hi) // 2
            at = self._where(h[mid:mid + 1])
            if at is None or (min_value is not None and self._value(h[mid:mid + 1], at) < min_value):
                hi = mid
            else:
                lo, last = mid + 1, (mid, at)
        if not lo:
            return 0, None
        if last is None or last[0] != lo - 1:
            at = self._where(h[lo - 1:lo])
            assert at is not None
            last = (lo - 1, at)
        return lo, self._value(h[lo - 1:lo], last[1])

    def put(self, hashes: np.ndarray, value: int, present: int | None = None, overwrite: bool = True) -> None:
        """Every hash of the chain now maps to ``value`` (``overwrite=False``: only the new ones).
        ``present``: the length of its leading run already stored, where the caller just asked
        :meth:`leading_run` (the rest are new)."""
        k = self.leading_run(hashes)[0] if present is None else present
        if k and overwrite and self.with_values:
            self._overwrite(hashes[:k], value)
        if k < len(hashes):
            self.pending.update(dict.fromkeys(hashes[k:].tolist(), value))
            if len(self.pending) >= self.pending_limit:
                self._merge()

    def _overwrite(self, h: np.ndarray, value: int) -> None:
        for level in self.levels:
            if len(level.keys) and level.values is not None:
                pos = np.minimum(np.searchsorted(level.keys, h), len(level.keys) - 1)
                level.values[pos[level.keys[pos] == h]] = value
        pend = self.pending
        if pend:
            for x in h.tolist():
                if x in pend:
                    pend[x] = value

    def _merge(self) -> None:
        pend = self.pending
        keys = np.fromiter(pend.keys(), np.uint64, len(pend))
        values = np.fromiter(pend.values(), np.int32, len(pend)) if self.with_values else None
        self.pending = {}
        middle, main = self.levels
        middle.merge(keys, values)
        if len(middle.keys) * 8 >= len(main.keys):
            main.merge(middle.keys, middle.values)
            self.levels = (_Sorted(self.with_values), main)


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
        k, _ = self.cached.leading_run(hashes)
        self.cached.put(hashes, 0, k)
        return min(k, cap) * B


def chain_hashes(tokens: np.ndarray, block_size: int, n_blocks: int, hasher: object = None, key: object = None
                 ) -> np.ndarray:
    """The chained hashes of ``tokens``' first ``n_blocks`` full blocks as a uint64 array (through an
    :class:`~.hashing.IncrementalHasher` under ``key`` where given, which reuses a shared prefix's hashes)."""
    arr = as_token_array(tokens)
    if isinstance(hasher, IncrementalHasher):
        got = hasher.hashes(key, arr, n_blocks)
    else:
        got = extend_hashes(arr, block_size, [], salt_seed(None), n_blocks)
    return np.array(got, dtype=np.uint64)
