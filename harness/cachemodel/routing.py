"""Request routing across N independent vLLM replicas (each with its own block pool).

Policies: ``round-robin``; ``least-loaded`` (fewest requests in flight, then fewest prompt tokens routed);
``session-affinity`` (a session's first request goes to the least-loaded replica, the rest follow it);
``prefix-aware`` (the replica with the longest cached prefix for this request, ties to least-loaded).
Prefix-aware probes each pool with a side-effect-free lookup, like a KV-aware router with perfect
knowledge of the replicas' caches.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from kvscope.harness.cachemodel.sim_types import SimRequest

POLICIES = ("round-robin", "least-loaded", "session-affinity", "prefix-aware")


class ReplicaView(Protocol):
    in_flight: int
    routed_tokens: int

    def probe(self, req: SimRequest) -> int: ...


class Router:
    """Chooses a replica index for each request."""

    def __init__(self, policy: str, n: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.policy = policy
        self.n = n
        self._rr = 0
        self._affinity: dict[str, int] = {}

    @staticmethod
    def _least_loaded(replicas: Sequence[ReplicaView], among: Sequence[int] | None = None) -> int:
        idx = range(len(replicas)) if among is None else among
        return min(idx, key=lambda i: (replicas[i].in_flight, replicas[i].routed_tokens, i))

    def choose(self, req: SimRequest, replicas: Sequence[ReplicaView]) -> int:
        if self.n == 1:
            return 0
        p = self.policy
        if p == "round-robin":
            i = self._rr % self.n
            self._rr += 1
            return i
        if p == "least-loaded":
            return self._least_loaded(replicas)
        if p == "session-affinity":
            key = req.session_id if req.session_id is not None else f"#req{req.request_id}"
            i = self._affinity.get(key)
            if i is None:
                i = self._least_loaded(replicas)
                self._affinity[key] = i
            return i
        # prefix-aware
        hits = [r.probe(req) for r in replicas]
        best = max(hits)
        return self._least_loaded(replicas, [i for i, h in enumerate(hits) if h == best])
