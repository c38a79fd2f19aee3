"""Fit preset distributions from real traces (kv-cache-tester coding agent, Mooncake conversation).

Run ``python -m kvscope.workloads.calibrate`` to print the fitted numbers; they are pasted (with their source) into
the comments and values of ``presets/agent-coding.yaml`` and ``presets/chat.yaml``. Distributions are stored
as empirical quantiles (41 points, every 2.5 %), which reproduces medians and tails better than a lognormal
fit; the lognormal fit (median, sigma) is printed too, for reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from kvscope.workloads.importers.blocks import BlockRequest, block_transition, read_kvcache_tester, read_mooncake
from kvscope.workloads.prefix import Transition
from kvscope.workloads.trace_schema import SegmentKind

QUANTILES = np.linspace(0, 1, 41)


def quantiles(x: np.ndarray, lo: float = 0.0) -> list[float]:
    q = np.quantile(np.asarray(x, dtype=np.float64), QUANTILES)
    return [round(float(max(v, lo)), 2) for v in q]


def lognormal_fit(x: np.ndarray) -> dict:
    x = np.asarray(x, dtype=np.float64)
    x = x[x > 0]
    lx = np.log(x)
    return {"median": round(float(np.exp(np.median(lx))), 1), "sigma": round(float(lx.std()), 3)}


def fit_kvcache_tester(reqs: list[BlockRequest]) -> dict:
    """Coding-agent shape from the raw block view (top-level conversations only, like the published
    figures)."""
    top = [r for r in reqs if "/" not in r.session_id]
    index = {id(r): i for i, r in enumerate(reqs)}
    by_sess: dict[str, list[BlockRequest]] = {}
    for r in top:
        by_sess.setdefault(r.session_id, []).append(r)
    calls = np.array([len(v) for v in by_sess.values()])
    static = np.array([v[0].static_prefix_tokens for v in by_sess.values()])
    tool_app, user_app, out_tool, out_final, think, lat = [], [], [], [], [], []
    n_user = n_later = 0
    for sess in by_sess.values():
        for p, r in zip(sess, sess[1:]):
            n_later += 1
            n_user += r.input_kind == SegmentKind.USER
            (out_final if r.input_kind == SegmentKind.USER else out_tool).append(p.output_length)
            if block_transition(p.block_ids, r.block_ids) == Transition.APPEND:
                a = r.input_length - p.input_length - p.output_length
                (user_app if r.input_kind == SegmentKind.USER else tool_app).append(a)
            if r.input_kind == SegmentKind.USER:
                think.append(r.think_time_s)
            else:
                lat.append(r.tool_latency_s)
        out_final.append(sess[-1].output_length)
    del index
    res = {
        "source": "kv-cache-tester weka_cc_traces (710 Claude Code conversations), top-level requests",
        "conversations": len(by_sess), "requests": int(calls.sum()),
        "calls_per_conversation": {"median": float(np.median(calls)), "quantiles": quantiles(calls, 1)},
        "static_prefix_tokens": {"median": float(np.median(static)), "quantiles": quantiles(static, 1)},
        "user_turn_probability": round(n_user / max(1, n_later), 4),
        "tool_output_append": {"median": float(np.median(tool_app)), "p90": float(np.percentile(tool_app, 90)),
                               "quantiles": quantiles(tool_app, 1), "lognormal": lognormal_fit(tool_app)},
        "user_append": {"median": float(np.median(user_app)), "quantiles": quantiles(user_app, 1),
                        "lognormal": lognormal_fit(user_app)},
        "tool_call_output": {"median": float(np.median(out_tool)), "quantiles": quantiles(out_tool, 1)},
        "final_answer_output": {"median": float(np.median(out_final)), "quantiles": quantiles(out_final, 1)},
        "think_time_s": {"median": float(np.median(think)), "quantiles": quantiles(think, 0)},
        "tool_latency_s": {"median": float(np.median(lat)), "quantiles": quantiles(lat, 0)},
    }
    return res


def fit_mooncake(reqs: list[BlockRequest]) -> dict:
    inp = np.array([r.input_length for r in reqs])
    out = np.array([r.output_length for r in reqs])
    ts = np.array([r.arrival_s for r in reqs])
    dur = ts.max() - ts.min()
    # The first block (id 0 in the conversation trace) is a shared system prompt on most requests.
    first_ids = np.array([r.block_ids[0] if len(r.block_ids) else -1 for r in reqs])
    shared0 = float(np.mean(first_ids == np.bincount(first_ids[first_ids >= 0]).argmax()))
    return {"source": "Mooncake FAST'25 conversation_trace.jsonl (12,031 requests, 1 h)",
            "requests": len(reqs), "rate_per_s": round(len(reqs) / dur, 3),
            "input_tokens": {"median": float(np.median(inp)), "mean": float(inp.mean()), "quantiles": quantiles(inp, 1)},
            "output_tokens": {"median": float(np.median(out)), "mean": float(out.mean()), "quantiles": quantiles(out, 1)},
            "share_with_common_first_block": round(shared0, 4)}


def main(argv: list[str] | None = None) -> int:
    data = Path(argv[0] if argv else Path(__file__).resolve().parents[2] / "shared" / "data")
    res = {"agent_coding": fit_kvcache_tester(read_kvcache_tester(data / "weka_cc_traces.tar.gz")),
           "chat": fit_mooncake(read_mooncake(data / "mooncake_conversation_trace.jsonl"))}
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
