"""Predicted cached tokens for the ids actually sent, from the vLLM-exact simulator (kvscope.harness.cachemodel).

Online: at send time the prompt's block hashes are looked up in a simulated pool of the server's size; when
the request finishes, its prompt and the tokens the server really generated are cached as vLLM does (full
blocks of the first P+O-1 tokens). Sent one at a time, this equals the server's `cached_tokens` exactly;
with overlapping requests it ignores pinning and admission order, so small differences are expected there.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvscope.harness.cachemodel.hashing import IncrementalHasher
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.cachemodel.simulator import Replica, SimConfig


class OnlinePredictor:
    def __init__(self, block_size: int, num_gpu_blocks: int | None) -> None:
        self.block_size = block_size
        self.replica = Replica(SimConfig(block_size, num_gpu_blocks))
        self.hasher = IncrementalHasher(block_size, max_sessions=1 << 16)

    def on_send(self, request_id: int, session_id: str, prompt: np.ndarray, cache_salt: str | None) -> int:
        B = self.block_size
        P = len(prompt)
        hashes = self.hasher.hashes(session_id, np.asarray(prompt, dtype=np.int32), P // B, cache_salt)
        return self.replica.probe(SimRequest(request_id, P, 1, hashes, B, session_id=session_id,
                                             cache_salt=cache_salt)) * B

    def on_finish(self, request_id: int, session_id: str, prompt: np.ndarray, output_ids: Sequence[int],
                  cache_salt: str | None) -> None:
        B = self.block_size
        P, O = len(prompt), max(len(output_ids), 1)
        tokens = np.concatenate([np.asarray(prompt, dtype=np.int32), np.asarray(output_ids, dtype=np.int32)])
        hashes = self.hasher.hashes(session_id, tokens, (P + O - 1) // B, cache_salt)
        self.replica.run_sequential(SimRequest(request_id, P, O, hashes, B, session_id=session_id,
                                               cache_salt=cache_salt))
