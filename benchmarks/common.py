"""Shared helpers for the client benchmarks: CPU pinning, the mock server process, RSS sampling."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def cores() -> tuple[list[str], list[str]]:
    """taskset prefixes for (client, server): client on core 0, server on core 1 when there are two cores."""
    if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
        return ["taskset", "-c", "0"], ["taskset", "-c", "1"]
    return [], []


class MockServer:
    """`python -m tests.doubles.faultserver --uvloop` in its own process, pinned to the server core."""

    def __init__(self, *args: str, pin: list[str] | None = None) -> None:
        self.args = list(args)
        self.pin = cores()[1] if pin is None else pin
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def __enter__(self) -> "MockServer":
        d = tempfile.mkdtemp(prefix="kvscope-mock-")
        port_file = Path(d) / "port"
        self.proc = subprocess.Popen([*self.pin, PY, "-m", "tests.doubles.faultserver", "--uvloop", "--port-file",
                                      str(port_file), *self.args], cwd=REPO, stdout=subprocess.DEVNULL)
        deadline = time.time() + 30
        while not port_file.exists():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("mock server did not start")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class RssSampler:
    """Samples this process's RSS every `interval_s` on a thread; `peak_mb` / `samples` afterwards."""

    def __init__(self, interval_s: float = 0.1) -> None:
        import psutil

        self.proc = psutil.Process()
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss_mb(self) -> float:
        return self.proc.memory_info().rss / 2**20

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self._t0, self.rss_mb()))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter() - self._t0, self.rss_mb()))

    @property
    def peak_mb(self) -> float:
        return max(m for _, m in self.samples) if self.samples else self.rss_mb()


def machine() -> dict:
    import platform

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def kvscope_exe() -> str:
    """The venv's ``kvscope`` script beside this interpreter."""
    return str(Path(PY).parent / "kvscope")


def agent_preset(out: Path, tokenizer: str | Path, sessions: int = 100) -> str:
    """The full-size agent preset (agent-coding; 100 sessions: 6,237 requests, 621 M prompt tokens) generated
    into ``out`` unless it is there already; its directory.  Not timed by the speed benchmarks."""
    if not (out / "trace.json").is_file():
        subprocess.run([kvscope_exe(), "workload", "generate", "agent-coding", "--tokenizer", str(tokenizer),
                        "--sessions", str(sessions), "--out", str(out), "--no-progress"], check=True)
    return str(out)


def timed_command(cmd: list[str]) -> tuple[str, float, float]:
    """(stdout, wall s, CPU s) of one command, process start to exit.  CPU seconds too: on a shared host the
    wall time says as much about the neighbours as about the command."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out.stdout, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
