"""Client-side routing over replicas of one deployment (several endpoints)."""

from __future__ import annotations

import zlib
from typing import Literal

import numpy as np

Policy = Literal["round_robin", "session_affinity", "prefix_hash"]


class EndpointRouter:
    """Picks the endpoint for each request.

    `session_affinity` keeps a session on one replica (its history stays in that replica's cache);
    `prefix_hash` routes by the first block of the prompt (requests sharing a system prompt meet on one
    replica); `round_robin` spreads requests evenly and shows what a cache-unaware balancer costs.
    """

    def __init__(self, n: int, policy: Policy = "session_affinity", block_size: int = 16) -> None:
        if n < 1:
            raise ValueError("at least one endpoint is needed")
        self.n = n
        self.policy = policy
        self.block_size = block_size
        self._next = 0

    def pick(self, session_id: str, prompt: np.ndarray) -> int:
        if self.n == 1:
            return 0
        if self.policy == "round_robin":
            i = self._next
            self._next = (i + 1) % self.n
            return i
        if self.policy == "session_affinity":
            return zlib.crc32(session_id.encode()) % self.n
        head = np.ascontiguousarray(prompt[: self.block_size], dtype=np.int32)
        return zlib.crc32(head.tobytes()) % self.n
