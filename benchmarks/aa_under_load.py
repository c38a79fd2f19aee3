"""The same-configuration comparison on real vLLM, N times in a row, while another process loads the machine.

Issue #12's acceptance: `tests/test_experiment_integration.py::test_compare_same_configuration_twice_is_not_significant`
(a fresh real-vLLM experiment each time: 2 configurations x 2 workloads x 2 repeats; two repeats of one
configuration compared with one run a side, then with the run-to-run noise of the other configuration's repeats)
must pass every time while a CPU burner (one busy process per ``--burn`` core) competes for the cores.

Usage::

    .venv/bin/python benchmarks/aa_under_load.py [--runs 10] [--burn 1]

Prints one line per run (pass/fail, wall seconds, load average) and the count; exit status 1 if any run failed.
It is not part of `make test` (about 3 minutes per run): it prints figures for the closing note.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

from common import REPO

TEST = "tests/test_experiment_integration.py::test_compare_same_configuration_twice_is_not_significant"


def _burn() -> None:
    while True:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--burn", type=int, default=1, help="busy processes that load the machine meanwhile")
    args = ap.parse_args()
    burners = [mp.Process(target=_burn, daemon=True) for _ in range(args.burn)]
    for b in burners:
        b.start()
    passed = 0
    try:
        for i in range(args.runs):
            t0 = time.time()
            with tempfile.TemporaryDirectory(prefix="kvscope-aa-") as base:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                                    base, TEST], cwd=REPO, capture_output=True, text=True)
            ok = r.returncode == 0
            passed += ok
            tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr.strip()[-200:]
            print(f"run {i + 1:2d}: {'pass' if ok else 'FAIL'}  {time.time() - t0:6.1f} s  "
                  f"load {os.getloadavg()[0]:.1f}  {tail}", flush=True)
            if not ok:
                print(r.stdout[-3000:], flush=True)
    finally:
        for b in burners:
            b.terminate()
    print(f"{passed}/{args.runs} same-configuration comparisons passed with {args.burn} busy process(es) beside")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
