"""Client-side routing over the endpoints of one deployment, with the cache model's :class:`Router`.

The policies and their names are the simulator's (:mod:`kvscope.harness.cachemodel.routing`), so a replay
and a ``kvscope simulate --replicas N --routing P`` of the same trace split the traffic the same way. A client
cannot see the servers' caches, so ``prefix-aware`` is not offered; the load a policy balances is what this
client has routed (requests are not tracked to completion here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscope.harness.cachemodel.hashing import hash_token_blocks
from kvscope.harness.cachemodel.routing import CACHE_BLIND_POLICIES, Router, policy_name
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE


@dataclass
class _EndpointLoad:
    in_flight: int = 0
    routed_tokens: int = 0

    def probe(self, req: SimRequest) -> int:  # pragma: no cover - prefix-aware is refused up front
        raise NotImplementedError("a client cannot probe a server's prefix cache")


class EndpointRouter:
    """Picks the endpoint for each request (see :mod:`kvscope.harness.cachemodel.routing`)."""

    def __init__(self, n: int, policy: str = "session-affinity", block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if n < 1:
            raise ValueError("at least one endpoint is needed")
        self.n = n
        self.policy = policy_name(policy, CACHE_BLIND_POLICIES)
        self.block_size = block_size
        self._router = Router(self.policy, n)
        self._loads = [_EndpointLoad() for _ in range(n)]
        self._requests = 0

    def pick(self, session_id: str, prompt: np.ndarray) -> int:
        if self.n == 1:
            return 0
        B = self.block_size
        first_block = hash_token_blocks(prompt[:B], B) if self.policy == "prefix-hash" else []
        req = SimRequest(self._requests, len(prompt), 0, first_block, B, session_id=session_id)
        self._requests += 1
        i = self._router.choose(req, self._loads)
        self._loads[i].routed_tokens += len(prompt)
        return i
