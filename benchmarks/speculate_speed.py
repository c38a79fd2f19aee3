"""Speed of `kvscope speculate` on the full-size agent preset (agent-coding, 100 sessions: 6,237 requests,
621 M prompt tokens, 12.1 M distinct segment tokens, 3.8 M output tokens), process start to exit.

Usage: .venv/bin/python benchmarks/speculate_speed.py [--trace DIR] [--runs default,suffix,ngram:2-4]
Without --trace the preset is generated first (a few seconds; not timed) with models/tiny's tokenizer.
Target: under 60 s for the default command (`kvscope speculate TRACE`: ngram 2-4 and 1-3, suffix, oracle).
Prints wall and CPU seconds per case (the suffix kernel is compiled once per installation, on the first run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, agent_preset, kvscope_exe, timed_command  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--tokenizer", default=str(REPO / "models" / "tiny"))
    ap.add_argument("--runs", default="default",
                    help="comma list of cases, each its own process: 'default' (the command without "
                         "options: every method, default settings) or METHOD:LOOKUP (--method METHOD --k 4 "
                         "--lookup LOOKUP)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvscope-spec-speed-"))
    trace = args.trace or agent_preset(work / "agent-coding-100", args.tokenizer)
    for case in args.runs.split(","):
        method, _, lookup = case.partition(":")
        cmd = [kvscope_exe(), "speculate", trace, "--no-progress"]
        if method != "default":
            cmd += ["--method", method, "--k", "4", "--lookup", lookup or "2-4"]
        stdout, wall, cpu = timed_command(cmd)
        print(stdout.strip())
        print(f"==> {' '.join(cmd[1:])}: {wall:.1f} s process start to exit, {cpu:.1f} s CPU (target < 60 s wall)\n",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
