"""Request routing across N independent vLLM replicas: the one set of policies for ``kvscope simulate
--routing`` and replay's ``--routing`` (which drives real endpoints through this same :class:`Router`).

Policies (hyphenated; the underscore spelling ``round_robin`` … is accepted as an alias):

* ``round-robin``: spread requests evenly, what a cache-unaware balancer costs;
* ``least-loaded``: fewest requests in flight, then fewest prompt tokens routed;
* ``session-affinity``: a session's first request goes to the least-loaded replica, the rest follow it (its
  history stays in that replica's cache);
* ``prefix-hash``: the replica chosen by the first block's chained hash (requests sharing a system prompt
  meet on one replica, with no knowledge of the caches);
* ``prefix-aware``: the replica with the longest cached prefix for this request, ties to least-loaded; it
  probes each pool with a side-effect-free lookup (a KV-aware router with perfect knowledge), so only the
  simulator can run it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from kvscope.harness.cachemodel.sim_types import SimRequest

POLICIES = ("round-robin", "least-loaded", "session-affinity", "prefix-hash", "prefix-aware")
#: Policies that need no view into the replicas' caches (what a client-side router over endpoints can run).
CACHE_BLIND_POLICIES = ("round-robin", "least-loaded", "session-affinity", "prefix-hash")


def policy_name(name: str, allowed: Sequence[str] = POLICIES) -> str:
    """The canonical (hyphenated) name of a routing policy; ``round_robin`` and the like are accepted."""
    canonical = name.strip().replace("_", "-")
    if canonical not in allowed:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(allowed)}")
    return canonical


class ReplicaView(Protocol):
    in_flight: int
    routed_tokens: int

    def probe(self, req: SimRequest) -> int: ...


class Router:
    """Chooses a replica index for each request."""

    def __init__(self, policy: str, n: int) -> None:
        self.policy = policy_name(policy)
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
        if p == "prefix-hash":
            return req.hashes[0] % self.n if req.hashes else self._least_loaded(replicas)
        hits = [r.probe(req) for r in replicas]  # prefix-aware
        best = max(hits)
        return self._least_loaded(replicas, [i for i, h in enumerate(hits) if h == best])
