"""The CLI as a user runs it, for tests that check what a user sees: ``kvscope …`` in a subprocess (its exit
code, stdout and stderr), and the bad-input contract (exit 2, one line naming the problem, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def kvscope(*args: str, cwd: Path | str | None = None, timeout: float = 600, preexec=None
            ) -> subprocess.CompletedProcess:
    """``kvscope ARGS`` with this interpreter (the venv's install), never raising on a non-zero exit."""
    return subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, preexec_fn=preexec, check=False)


def assert_bad_input(r: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit 2, no traceback, and the last stderr line names every fragment."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, (fragment, last)
