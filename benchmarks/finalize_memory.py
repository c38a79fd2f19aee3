"""Peak memory of `kvscope record --finalize` as the log grows: bounded by the largest exchange, not the log.

Issue #40 item 3: after one 50 MB SSE response and one 100 MB request, finalize was OOM-killed at 17.3 GB. This
builds `exchanges.jsonl` logs of small agent exchanges plus K large requests of --large-mib MiB each (K = 0, 1,
--many), finalizes each in a fresh process with the project's tiny model's tokenizer, and prints the peak RSS
(the child's `ru_maxrss`) and wall time. Streaming shows as a peak that does not grow with K (only by the
trace's own tokens, 4 bytes each); the last line finalizes a log holding one exchange over the cap
(`MAX_EXCHANGE_MIB`) and prints its one-line refusal and exit status.

Usage::

    .venv/bin/python benchmarks/finalize_memory.py [--model DIR] [--large-mib 4] [--many 4] [--small 200]

Not part of `make test`; it prints figures for the closing note.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
from common import REPO

WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this",
         "are", "from", "at", "or", "an", "not", "have", "def", "return", "self"]


def _text(n_bytes: int, rng: random.Random) -> str:
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(WORDS) + (str(rng.randrange(1000)) if rng.random() < 0.2 else "")
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def _exchange(i: int, session: str, messages: list[dict]) -> bytes:
    return orjson.dumps({
        "request_id": i, "api": "chat", "received_unix_s": 1000.0 + i, "first_byte_unix_s": 1000.1 + i,
        "done_unix_s": 1000.2 + i, "status": 200, "session_header": session, "injected_include_usage": False,
        "request": {"model": "tiny", "messages": messages, "max_tokens": 8},
        "response": {"text": "ok", "tool_calls": [], "finish_reason": "stop", "usage": {"completion_tokens": 2}},
        "error": None}) + b"\n"


def write_log(out: Path, small: int, large: int, large_bytes: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    i = 0
    with open(out / "exchanges.jsonl", "wb") as f:
        history: list[dict] = [{"role": "system", "content": _text(2000, rng)}]
        for _ in range(small):  # one agent session appending turns
            history = history + [{"role": "user", "content": _text(300, rng)}]
            f.write(_exchange(i, "agent", history))
            history.append({"role": "assistant", "content": "ok"})
            history = history[-40:] if len(history) > 40 else history
            i += 1
        for k in range(large):
            f.write(_exchange(i, f"big-{k}", [{"role": "user", "content": _text(large_bytes, rng)}]))
            i += 1
    return (out / "exchanges.jsonl").stat().st_size


def finalize(record_dir: Path, model: Path) -> tuple[int, float, float, str]:
    """(exit status, peak RSS in MiB, wall seconds, last stderr line) of one finalize in a fresh process."""
    cli = [sys.executable, "-m", "kvscope.harness.cli.main", "record"]
    helped = subprocess.run([*cli, "--help"], capture_output=True, text=True, cwd=REPO, check=False).stdout
    quiet = ["--no-progress"] if "--no-progress" in helped else []  # an older kvscope has no such flag
    t0 = time.perf_counter()
    proc = subprocess.Popen([*cli, "--finalize", str(record_dir), "--tokenizer", str(model), *quiet],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    err = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in err.splitlines() if line.strip()]
    return proc.returncode, usage.ru_maxrss / 1024, time.perf_counter() - t0, lines[-1] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="tiny model directory (default: build one)")
    ap.add_argument("--large-mib", type=float, default=4.0)
    ap.add_argument("--many", type=int, default=4)
    ap.add_argument("--small", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kvscope.harness.model.tinymodel import build_tiny_model

            model = Path(tmp) / "tiny"
            build_tiny_model(model, seed=0)
        large_bytes = int(args.large_mib * 2**20)
        print(f"{'log':<46} {'log MiB':>8} {'rc':>3} {'peak RSS MiB':>13} {'wall s':>7}")
        for large in (0, 1, args.many):
            d = Path(tmp) / f"rec-{large}"
            size = write_log(d, args.small, large, large_bytes)
            rc, rss, wall, last = finalize(d, model)
            label = f"{args.small} small + {large} x {args.large_mib:g} MiB requests"
            print(f"{label:<46} {size / 2**20:>8.1f} {rc:>3} {rss:>13.0f} {wall:>7.1f}" + (f"  {last}" if rc else ""))
        d = Path(tmp) / "rec-over"
        size = write_log(d, 3, 1, 40 * 2**20)
        rc, rss, wall, last = finalize(d, model)
        print(f"{'3 small + 1 x 40 MiB request (over the cap)':<46} {size / 2**20:>8.1f} {rc:>3} {rss:>13.0f} "
              f"{wall:>7.1f}  {last}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
