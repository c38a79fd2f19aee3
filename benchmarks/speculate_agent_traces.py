"""Predicted speculative-decoding acceptance per method on the shared real agent traces (no GPU).

Imports SWE-agent, OpenHands, Claude Code and Codex samples from ../shared/data/agent-traces with
`kvscope workload import` (text mode, tokenised by the tiny model's tokenizer) and runs the offline model
(`kvscope.harness.analysis.speculative.predict_methods`): n-gram at k=4 with lookup 2-4 and 1-3, suffix
decoding with vLLM's defaults, and the oracle at k=4. Each request's recorded answer is the target output.

Usage: .venv/bin/python benchmarks/speculate_agent_traces.py [--tokenizer models/tiny]
Writes benchmarks/results/speculate_agent_traces.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = (REPO / ".." / "shared" / "data" / "agent-traces").resolve()

SOURCES = [
    ("SWE-agent (demonstration)", "swe-agent", "swe-agent/demo_function_calling_replace_from_source__marshmallow-1867.traj"),
    ("SWE-agent (GPT-4)", "swe-agent", "swe-agent/gpt4__pydicom__pydicom-1458.traj"),
    ("OpenHands (basic)", "openhands", "openhands/basic.json"),
    ("OpenHands (GUI mode)", "openhands", "openhands/basic_gui_mode.json"),
    ("Claude Code (TraceLab)", "claude-code", "tracelab/example_sessions/claude/session.converted.jsonl"),
    ("Codex CLI (TraceLab)", "codex", "tracelab/example_sessions/codex/rollout.converted.jsonl"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=str(REPO / "models" / "tiny"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "speculate_agent_traces.json"))
    args = ap.parse_args()

    from kvscope.harness.analysis.speculative import default_configs, predict_methods
    from kvscope.workloads.trace import Trace

    work = Path(tempfile.mkdtemp(prefix="kvscope-spec-agents-"))
    kvscope = str(Path(sys.executable).parent / "kvscope")
    results = []
    for label, fmt, rel in SOURCES:
        out = work / rel.replace("/", "_")
        subprocess.run([kvscope, "workload", "import", fmt, str(DATA / rel), "--tokenizer", args.tokenizer,
                        "--out", str(out)], check=True, capture_output=True)
        trace = Trace.read(out)
        pred = predict_methods(trace, default_configs(4), source=rel)
        results.append({"trace": label, "source": rel, "requests": trace.num_requests,
                        "output_tokens": int(trace.requests["output_tokens"].sum()),
                        "methods": [m.model_dump() for m in pred.methods]})
    labels = [m["label"] for m in results[0]["methods"]]
    print("| trace | requests | output tokens | " + " | ".join(labels) + " |")
    print("|---|---|---|" + "---|" * len(labels))
    for r in results:
        cells = []
        for m in r["methods"]:
            rate, mal = m["acceptance_rate"], m["mean_acceptance_length"]
            cells.append("-" if rate is None else f"{rate:.0%} / {mal:.2f} / {m['tokens_per_step']:.2f}")
        print(f"| {r['trace']} | {r['requests']} | {r['output_tokens']:,} | " + " | ".join(cells) + " |")
    print("cells: acceptance rate / mean acceptance length (1 + accepted per draft) / decode tokens per step")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"tokenizer": args.tokenizer, "traces": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
