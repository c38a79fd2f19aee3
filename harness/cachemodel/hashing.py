"""Chained block hashes, the key of vLLM's prefix cache.

vLLM hashes every *full* block of ``B`` tokens as ``hash((parent_hash, tokens, extra_keys))``, with the
first block's parent a fixed seed and ``cache_salt`` folded into the first block's extra keys only
(``vllm/v1/core/kv_cache_utils.py: hash_block_tokens``, ``get_request_block_hasher``).  Because each hash
covers the whole prefix, two requests share block ``i`` iff their first ``(i+1)*B`` tokens (and salt) are
equal.  We reproduce that *equality structure*, not vLLM's byte values: ``xxh3_64`` of the block's int32
bytes, seeded with the parent hash.  Hash values only need to be equal exactly when vLLM's would be.

Block-id traces (Mooncake, kv-cache-tester) already carry chained ids, so they pass through unchanged
(optionally regrouped to a coarser block size or salted per conversation).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import xxhash
import numpy as np

from kvscope.workloads.prefix import common_prefix_len

_h64 = xxhash.xxh3_64_intdigest

#: Seed of the first block of an unsalted chain (vLLM: ``NONE_HASH``).
NONE_HASH: int = _h64(b"kvscope-none-hash")


def salt_seed(cache_salt: str | None) -> int:
    """Parent hash of block 0.  A salt changes block 0's hash and, through chaining, every later one."""
    if not cache_salt:
        return NONE_HASH
    return _h64(b"cache_salt\x00" + cache_salt.encode())


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a contiguous int32 array (the byte layout that is hashed)."""
    arr = np.asarray(tokens, dtype=np.int32)
    return np.ascontiguousarray(arr)


def hash_token_blocks(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    cache_salt: str | None = None,
    num_tokens: int | None = None,
) -> list[int]:
    """Hashes of the full blocks of ``tokens[:num_tokens]`` (partial tail dropped, as vLLM does)."""
    arr = as_token_array(tokens)
    n = len(arr) if num_tokens is None else min(num_tokens, len(arr))
    return extend_hashes(arr, block_size, [], salt_seed(cache_salt), n // block_size)


def extend_hashes(arr: np.ndarray, block_size: int, known: list[int], seed: int, n_blocks: int) -> list[int]:
    """Continue a chain: ``known`` are the hashes of ``arr``'s first blocks; hash up to ``n_blocks``."""
    out = list(known[:n_blocks])
    mv = memoryview(arr).cast("B")
    step = 4 * block_size
    parent = out[-1] if out else seed
    for i in range(len(out), n_blocks):
        parent = _h64(mv[i * step:(i + 1) * step], parent)
        out.append(parent)
    return out


class IncrementalHasher:
    """Hashes prompts that mostly extend an earlier prompt of the same session.

    Agent sessions resend an ever-growing history, so hashing every prompt from scratch is quadratic in
    session length.  We remember the last token array and hashes per session key; a new prompt reuses the
    hashes of every full block inside its common prefix with that array (found with one vectorised
    comparison) and hashes only the rest.  Results are identical to :func:`hash_token_blocks`.
    """

    def __init__(self, block_size: int, max_sessions: int = 4096) -> None:
        self.block_size = block_size
        self.max_sessions = max_sessions
        self._last: OrderedDict[object, tuple["np.ndarray", list[int], str | None]] = OrderedDict()

    def hashes(self, key: object, tokens: np.ndarray, n_blocks: int, cache_salt: str | None = None) -> list[int]:
        """Hashes of the first ``n_blocks`` full blocks of ``tokens``; remembers them under ``key``."""
        B = self.block_size
        known: list[int] = []
        prev = self._last.get(key)
        if prev is not None and prev[2] == cache_salt:
            p_arr, p_hashes, _ = prev
            m = min(len(p_hashes), n_blocks) * B
            if m:
                known = p_hashes[: common_prefix_len(p_arr[:m], tokens[:m]) // B]
        out = extend_hashes(tokens, B, known, salt_seed(cache_salt), n_blocks)
        self._last[key] = (tokens, out, cache_salt)
        self._last.move_to_end(key)
        if len(self._last) > self.max_sessions:
            self._last.popitem(last=False)
        return out


def regroup_block_ids(ids: Sequence[int], native_block_size: int, block_size: int) -> list[int]:
    """Chained ids of native blocks -> chained ids of ``block_size`` blocks (a multiple of native).

    A chained id identifies its whole prefix, so the id of the last native block inside a coarse block
    identifies the coarse block (and everything before it).
    """
    if block_size == native_block_size:
        return list(ids)
    if block_size % native_block_size:
        raise ValueError(
            f"block size {block_size} is not a multiple of the trace's native block size {native_block_size}; "
            "block-id traces cannot be split into finer blocks"
        )
    m = block_size // native_block_size
    return list(ids[m - 1::m])
