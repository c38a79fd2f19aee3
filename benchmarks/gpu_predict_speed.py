"""Speed of `kvscope predict` on the full-size agent preset (agent-coding, 100 sessions: 6,237 requests,
621 M prompt tokens), process start to exit: H100 + Llama-3.1-8B and H200 + Llama-3.1-70B at TP 4.

Usage: .venv/bin/python benchmarks/gpu_predict_speed.py [--trace DIR] [--concurrency N] [--cases h100-8b,h200-70b-tp4]
Without --trace the preset is generated first (not timed) with models/tiny's tokenizer.
Target: under 60 s for one command (the trace read, the per-request run and the load curve of up to 8 levels).
Prints each command's own output (the prediction) and its wall and CPU seconds: on a shared host the wall time
says as much about the neighbours as about the command, so CPU seconds are printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, agent_preset, kvscope_exe, timed_command  # noqa: E402

CASES = {
    "h100-8b": ["--gpu", "h100-sxm", "--model", "llama-3.1-8b"],
    "h200-70b-tp4": ["--gpu", "h200-sxm", "--model", "llama-3.1-70b", "--tp", "4"],
    "h100-8b-fp8kv": ["--gpu", "h100-sxm", "--model", "llama-3.1-8b", "--kv-cache-dtype", "fp8"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--tokenizer", default=str(REPO / "models" / "tiny"))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--cases", default="h100-8b,h200-70b-tp4", help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--out-dir", default=None, help="where the prediction.json files go (default: a temp dir)")
    args = ap.parse_args()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="kvscope-predict-speed-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = args.trace or agent_preset(out_dir / "agent-coding-100", args.tokenizer)
    results = []
    for case in args.cases.split(","):
        cmd = [kvscope_exe(), "predict", trace, *CASES[case], "--concurrency", str(args.concurrency),
               "--no-progress", "--out", str(out_dir / f"{case}.json")]
        stdout, wall, cpu = timed_command(cmd)
        print(stdout.strip())
        print(f"==> {' '.join(cmd[1:])}: {wall:.1f} s process start to exit, {cpu:.1f} s CPU (target < 60 s)\n",
              flush=True)
        results.append({"case": case, "command": cmd[1:], "wall_s": wall, "cpu_s": cpu})
    out = REPO / "benchmarks" / "results" / "gpu_predict_speed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"load_average": os.getloadavg(), "runs": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
