"""Published figures on the shared real traces (read from ../shared/data, never copied)."""

from __future__ import annotations

import pytest

from kvscope.harness.cachemodel import api
from kvscope.harness.cachemodel.ideal import ideal_prefix_hit
from kvscope.harness.cachemodel.simulator import SimConfig, simulate
from kvscope.harness.cachemodel.trace_io import load_trace


def test_mooncake_conversation_ideal_hit(shared_data):
    tr = load_trace(shared_data / "mooncake_conversation_trace.jsonl")
    assert len(tr.requests) == 12_031
    assert sum(r.prompt_tokens for r in tr.requests) / 12_031 == pytest.approx(12_035, abs=1)
    unc = ideal_prefix_hit(tr.requests)["token_hit_ratio"]
    cap = ideal_prefix_hit(tr.requests, capped=True)["token_hit_ratio"]
    print(f"mooncake conversation ideal hit: uncapped {unc:.4%}, vLLM-capped {cap:.4%}")
    assert unc == pytest.approx(0.3736, abs=0.0005)
    assert cap <= unc
    assert simulate(tr.requests, SimConfig(512, None)).summary()["token_hit_ratio"] == pytest.approx(cap)


def test_mooncake_synthetic_ideal_hit(shared_data):
    tr = load_trace(shared_data / "mooncake_synthetic_trace.jsonl")
    assert ideal_prefix_hit(tr.requests)["token_hit_ratio"] == pytest.approx(0.6512, abs=0.0005)


def test_mooncake_capacity_sweep_monotone_and_saturating(shared_data):
    d = api.capacity_sweep(str(shared_data / "mooncake_conversation_trace.jsonl"), [1e5, 1e6, 3e6, 1e7, 3e7, 1e8])
    ratios = [r["token_hit_ratio"] for r in d["sweep"]]
    print("sweep", [(r["capacity_tokens"], round(r["token_hit_ratio"], 4)) for r in d["sweep"]])
    assert all(a <= b + 1e-12 for a, b in zip(ratios, ratios[1:]))
    assert ratios[-2] == pytest.approx(ratios[-1], abs=1e-3)  # 1e8 tokens ~ infinite


@pytest.mark.slow
def test_coding_agent_ideal_hit(shared_data):
    tr = load_trace(shared_data / "weka_cc_traces.tar.gz")
    d = ideal_prefix_hit(tr.requests)
    print(f"coding-agent ideal per-conversation token-weighted hit: {d['token_hit_ratio']:.4%} "
          f"(mean of per-conversation ratios {d['mean_per_conversation_hit_ratio']:.4%}); README 96.4 %")
    assert d["conversations"] == 710
    assert d["token_hit_ratio"] == pytest.approx(0.964, abs=0.003)
