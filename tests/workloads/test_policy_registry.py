"""A history policy is one registration: a policy defined here, in the test module, is usable from a spec, shows
up in the allowed kinds and in 'unknown field' messages, and round-trips through the spec's dump."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import Field

from kvscope.workloads.generate import generate
from kvscope.workloads.policies import HistoryPolicy, history_policy, policy_kinds
from kvscope.workloads.spec import SpecError, parse_spec, spec_to_dict


@history_policy("test_forget_all")
class ForgetAll(HistoryPolicy):
    """Every ``every`` requests, drop all history but the newest item (a throwaway policy for this test)."""

    every: int = Field(default=2, ge=1)

    def apply(self, state, rng: np.random.Generator) -> str | None:
        if state.step == 0 or state.step % self.every or len(state.history) < 2:
            return None
        state.history = state.history[-1:]
        return "reset"


def _spec(policy: dict):
    return parse_spec({"sessions": {"kind": "agent", "count": 2, "policies": [policy],
                                    "agent": {"calls": 6, "tool_output_tokens": 50, "tool_call_tokens": 20}},
                       "prefix": {"system_tokens": 100}})


def test_registered_policy_is_used_from_a_spec(source):
    spec = _spec({"kind": "test_forget_all", "every": 3})
    assert isinstance(spec.sessions.policies[0], ForgetAll)
    assert spec.sessions.policies[0].every == 3
    tr = generate(spec, source, seed=1)
    steps = tr.requests.groupby("session_id").cumcount()
    assert set(tr.requests.transition[steps % 3 == 0].iloc[2:]) <= {"reset", "first"}
    assert "reset" in set(tr.requests.transition)
    assert spec_to_dict(spec)["sessions"]["policies"] == [{"kind": "test_forget_all", "every": 3}]
    assert parse_spec(spec_to_dict(spec)) == spec


def test_registered_policy_appears_in_errors():
    assert policy_kinds()[0] == "append_only" and "test_forget_all" in policy_kinds()
    with pytest.raises(SpecError, match=r"unknown policy 'nope'; allowed: .*test_forget_all"):
        _spec({"kind": "nope"})
    with pytest.raises(SpecError, match=r"sessions.policies\[0\].often: unknown field; allowed: kind, every$"):
        _spec({"kind": "test_forget_all", "often": 1})
    with pytest.raises(SpecError, match=r"sessions.policies\[0\].every: .*greater than or equal to 1"):
        _spec({"kind": "test_forget_all", "every": 0})


def test_a_kind_registers_once():
    with pytest.raises(ValueError, match="already registered"):
        history_policy("append_only")(type("Again", (HistoryPolicy,), {"__annotations__": {}}))
