"""One set of routing policies: the simulator's Router, also behind replay's endpoint router."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.harness.cachemodel.routing import POLICIES, policy_name
from kvscope.harness.cachemodel.simulator import SimConfig, requests_from_token_pairs, simulate
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.routing import EndpointRouter


def _requests():
    pairs = [(list(range(40)) + [1000 * s + t] * 16, [1]) for t in range(3) for s in range(4)]
    return requests_from_token_pairs(pairs, 8, session_ids=[f"s{s}" for t in range(3) for s in range(4)])


@pytest.mark.parametrize("policy", POLICIES)
def test_underscore_spelling_is_the_same_policy(policy):
    reqs = _requests()
    a = simulate(reqs, SimConfig(8, None), replicas=2, routing=policy).summary()
    b = simulate(reqs, SimConfig(8, None), replicas=2, routing=policy.replace("-", "_")).summary()
    assert a == b and a["routing"] == policy


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="choose from round-robin"):
        policy_name("random")
    with pytest.raises(ValueError, match="prefix-aware"):
        ReplayOptions(routing="prefix-aware")
    assert ReplayOptions(routing="session_affinity").routing == "session-affinity"


def test_endpoint_router_keeps_sessions_and_prefixes_together():
    rng = np.random.default_rng(0)
    sticky = EndpointRouter(3, "session-affinity", block_size=4)
    first = {s: sticky.pick(s, rng.integers(0, 100, 20)) for s in ("a", "b", "c")}
    assert sorted(first.values()) == [0, 1, 2]  # new sessions go to the least-loaded endpoint
    assert all(sticky.pick(s, rng.integers(0, 100, 20)) == i for s, i in first.items() for _ in range(3))
    by_prefix = EndpointRouter(3, "prefix-hash", block_size=4)
    heads = [rng.integers(0, 100, 4) for _ in range(12)]
    picks = [by_prefix.pick(f"s{i}", np.concatenate([h, rng.integers(0, 100, 8)])) for i, h in enumerate(heads)]
    again = [by_prefix.pick("other", np.concatenate([h, [7] * 8])) for h in heads]
    assert picks == again and len(set(picks)) > 1
    rr = EndpointRouter(2, "round_robin")
    assert [rr.pick("x", np.arange(4)) for _ in range(4)] == [0, 1, 0, 1]
