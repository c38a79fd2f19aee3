"""Real traces from ../shared/data: importer fidelity and calibration of the agent-coding preset."""

from __future__ import annotations

import numpy as np
import pytest

from tests.workloads.conftest import need_data
from kvscope.workloads.generate import generate
from kvscope.workloads.importers import import_kvcache_tester, import_mooncake, read_kvcache_tester, read_mooncake
from kvscope.workloads.spec import load_spec
from kvscope.workloads.stats import block_request_stats, format_stats, ideal_hit_ratio, ideal_hit_ratio_blocks, trace_stats


@pytest.fixture(scope="module")
def cc_blocks():
    return read_kvcache_tester(need_data("weka_cc_traces.tar.gz"), include_subagents=False)


def test_mooncake_ideal_hit_ratio():
    path = need_data("mooncake_conversation_trace.jsonl")
    trace = import_mooncake(path)
    assert trace.num_requests == 12031
    distinct = len({x for r in read_mooncake(path) for x in r.block_ids.tolist()})
    assert distinct <= trace.num_segments < 2 * distinct  # one segment per id (+ partial-length variants)
    assert trace.meta["block_size_hint"] == 512
    assert abs(trace.requests.prompt_tokens.mean() - 12035) < 1
    token_level = ideal_hit_ratio(trace, 512)
    block_level = ideal_hit_ratio_blocks(read_mooncake(path))
    print(f"\nMooncake conversation ideal hit (B=512): tokens {100 * token_level:.3f} %, blocks {100 * block_level:.3f} %")
    assert abs(100 * token_level - 37.36) <= 0.05
    assert abs(token_level - block_level) < 1e-12


def test_kvcache_tester_import_keeps_block_structure(cc_blocks):
    src = need_data("weka_cc_traces.tar.gz")
    trace = import_kvcache_tester(src, limit=15)
    reqs = read_kvcache_tester(src, limit=15)
    assert trace.num_requests == len(reqs)
    assert (trace.requests.prompt_tokens.to_numpy() == np.array(sorted_inputs(trace, reqs))).all()
    # equal block ids <=> equal token blocks, at 64-token granularity, for every parent/child pair
    by_key = {(r.session_id, r.step): r for r in reqs}
    for row in trace.iter_requests():
        if row.parent_request_id < 0:
            continue
        r = by_key[(row.session_id, row.step)]
        p = by_key[(row.session_id, row.step - 1)]
        a, b = trace.prompt_token_ids(row.parent_request_id), trace.prompt_token_ids(row.request_id)
        n = min(len(p.block_ids), len(r.block_ids))
        same = (a[: n * 64].reshape(n, 64) == b[: n * 64].reshape(n, 64)).all(axis=1)
        assert np.array_equal(same, p.block_ids[:n] == r.block_ids[:n])
    # per-session ideal hit from tokens equals the block-level figure (tails are fresh tokens, never hit)
    tok = ideal_hit_ratio(trace, 64, per_session=True)
    blk = ideal_hit_ratio_blocks(reqs, per_session=True)
    assert abs(tok - blk) < 1e-9


def sorted_inputs(trace, reqs):
    by_key = {(r.session_id, r.step): r.input_length for r in reqs}
    return [by_key[(s, k)] for s, k in zip(trace.requests.session_id, trace.requests.step)]


def test_kvcache_tester_published_figures(cc_blocks):
    st = block_request_stats(cc_blocks)
    assert st["sessions"] == 710 and st["calls_per_session"]["p50"] == 45
    assert st["appended_tokens"]["tool_output"]["p50"] == pytest.approx(292, abs=3)
    assert st["appended_tokens"]["tool_output"]["p90"] == pytest.approx(2896, rel=0.01)
    assert st["appended_tokens"]["user"]["p50"] == pytest.approx(203, abs=3)
    t = st["transitions"]
    assert t["append"] == pytest.approx(0.972, abs=0.002) and t["edit"] == pytest.approx(0.010, abs=0.002)
    assert t["reset"] == pytest.approx(0.018, abs=0.002)
    assert st["ideal_hit"]["per_session"] == pytest.approx(0.964, abs=0.005)


def test_agent_coding_preset_matches_real_traces(cc_blocks, source):
    real = block_request_stats(cc_blocks, hit=False)
    trace = generate(load_spec("agent-coding"), source, sessions=400)  # full scale
    gen = trace_stats(trace, hit=False)
    rt, gt = real["transitions"], gen["transitions"]
    rows = [  # (figure, real, generated, allowed relative difference)
        ("median calls per conversation", real["calls_per_session"]["p50"], gen["calls_per_session"]["p50"], 0.15),
        ("median tools+system prefix", real["static_prefix_tokens"]["p50"], gen["static_prefix_tokens"]["p50"], 0.15),
        ("median tool-output append", real["appended_tokens"]["tool_output"]["p50"],
         gen["appended_tokens"]["tool_output"]["p50"], 0.15),
        ("p90 tool-output append", real["appended_tokens"]["tool_output"]["p90"],
         gen["appended_tokens"]["tool_output"]["p90"], 0.15),
        ("median prompt tokens", real["prompt_tokens"]["p50"], gen["prompt_tokens"]["p50"], 0.20),
        ("p90 prompt tokens", real["prompt_tokens"]["p90"], gen["prompt_tokens"]["p90"], 0.20),
        ("median user-message append", real["appended_tokens"]["user"]["p50"], gen["appended_tokens"]["user"]["p50"],
         None),
        ("append share %", 100 * rt["append"], 100 * gt["append"], 0.01),
        ("edit share %", 100 * rt["edit"], 100 * gt["edit"], 0.5),
        ("reset (+compaction) share %", 100 * rt["reset"], 100 * (gt["reset"] + gt["compaction"]), 0.5),
    ]
    print("\n" + f"{'figure':<32}{'real traces':>14}{'agent-coding':>14}{'diff':>8}")
    for name, r, g, _ in rows:
        fmt = "{:>14,.2f}" if "%" in name else "{:>14,.0f}"
        print(f"{name:<32}" + fmt.format(r) + fmt.format(g) + f"{100 * (g - r) / r:>7.1f}%")
    print(format_stats(gen))
    for name, r, g, tol in rows:
        if tol is not None:
            assert abs(g - r) <= tol * r, name


def test_chat_preset_ideal_hit_near_mooncake(source):
    """The chat preset's documented knobs put its ideal hit ratio (B=512) within 5 pp of Mooncake's 37.36 %."""
    trace = generate(load_spec("chat"), source, sessions=200)
    st = trace_stats(trace, block_size=512)
    print(f"\nchat preset ideal hit (B=512): {100 * st['ideal_hit']['global']:.2f} % (Mooncake 37.36 %)")
    assert abs(100 * st["ideal_hit"]["global"] - 37.36) <= 5
