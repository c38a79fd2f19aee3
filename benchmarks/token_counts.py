"""Prompt token counts of the real agent-trace samples: the provider's own usage beside ours, with the local
model's generated-text tokenizer and with a production tokenizer (Tekken).

    .venv/bin/python benchmarks/token_counts.py --trained models/tiny --production models/tiny-tekken

The samples live in ../shared/data/agent-traces (KVSCOPE_SHARED_DATA elsewhere). Per source: the calls with
provider usage, the sums, the median per-call ratio ours / provider, and the median ratio of the per-call
growth (the tokens a call adds over the previous one of its session): the logs do not hold Claude Code's system
prompt and tool definitions, nor Codex's and OpenHands' tool definitions, so whole prompts undercount by a
fixed amount there, while the growth compares the same text. SWE-agent records one total (tokens_sent) for
the whole trajectory; its row compares that total.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from kvscope.workloads import importers

SOURCES = [
    ("Claude Code", "claude-code", "agent-traces/tracelab/example_sessions/claude/session.converted.jsonl"),
    ("Codex", "codex", "agent-traces/tracelab/example_sessions/codex/rollout.converted.jsonl"),
    ("SWE-agent", "swe-agent", "agent-traces/swe-agent/gpt4__pydicom__pydicom-1458.traj"),
    ("OpenHands", "openhands", "agent-traces/openhands/basic.json"),
    ("OpenHands (GUI)", "openhands", "agent-traces/openhands/basic_gui_mode.json"),
]


def _pairs(trace) -> tuple[list[int], list[int], list[str]]:
    df = trace.requests.sort_values("request_id")
    keep = df["observed_prompt_tokens"].notna()
    return (df.loc[keep, "observed_prompt_tokens"].astype(int).tolist(), df.loc[keep, "prompt_tokens"].astype(int).tolist(),
            df.loc[keep, "session_id"].astype(str).tolist())


def _growth_ratios(provider: list[int], ours: list[int], sessions: list[str]) -> list[float]:
    out = []
    for i in range(1, len(provider)):
        dp, do = provider[i] - provider[i - 1], ours[i] - ours[i - 1]
        if sessions[i] == sessions[i - 1] and dp > 0 and do > 0:
            out.append(do / dp)
    return out


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}" if xs else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trained", default="models/tiny", help="model dir with the generated-text tokenizer")
    ap.add_argument("--production", default="models/tiny-tekken", help="model dir built with --tokenizer tekken")
    ap.add_argument("--data", default=os.environ.get("KVSCOPE_SHARED_DATA") or "../shared/data")
    args = ap.parse_args()
    data = Path(args.data)
    head = ("| source | calls | provider prompt tokens | trained tokenizer | Tekken | median ratio trained | "
            "median ratio Tekken | growth ratio trained | growth ratio Tekken |")
    print(head)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, fmt, rel in SOURCES:
        src = data / rel
        if not src.exists():
            continue
        reader = importers.TRANSCRIPT_IMPORTERS[fmt]
        tr_a, tr_b = reader(src, args.trained), reader(src, args.production)
        if fmt == "swe-agent":
            total = int((tr_a.meta.get("observed_totals") or {}).get("tokens_sent", 0))
            if not total:
                continue
            a, b = int(tr_a.requests["prompt_tokens"].sum()), int(tr_b.requests["prompt_tokens"].sum())
            ra = f"{a / total:.2f}" if total else "-"
            rb = f"{b / total:.2f}" if total else "-"
            print(f"| {label} (total tokens_sent) | {tr_a.num_requests} | {total:,} | {a:,} | {b:,} | {ra} | {rb} | - | - |")
            continue
        prov, ours_a, sess = _pairs(tr_a)
        _, ours_b, _ = _pairs(tr_b)
        if not prov:
            continue
        ratio_a = [o / p for o, p in zip(ours_a, prov) if p]
        ratio_b = [o / p for o, p in zip(ours_b, prov) if p]
        print(f"| {label} | {len(prov)} | {sum(prov):,} | {sum(ours_a):,} | {sum(ours_b):,} | {_median(ratio_a)} | "
              f"{_median(ratio_b)} | {_median(_growth_ratios(prov, ours_a, sess))} | "
              f"{_median(_growth_ratios(prov, ours_b, sess))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
