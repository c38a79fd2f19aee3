"""Server processes die with kvscope, however kvscope ends.

Two guards, because each alone has a hole:

* ``die_with_parent()`` is a ``preexec_fn`` that sets ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on the vLLM API
  server (Linux). It fires when the *thread* that spawned it ends, so it is only set when spawning from the
  main thread (a server started from a worker thread would otherwise die with that thread). It covers the
  API server only: vLLM's own children (EngineCore, workers) are not its children.
* ``ParentDeathWatchdog`` is a tiny ``python -c`` process in its own session that blocks reading a pipe whose
  write end only kvscope holds. When kvscope ends in any way (SIGKILL included) the kernel closes that end, the
  read returns EOF and the watchdog kills the server's whole process group (SIGTERM and SIGCONT, then SIGKILL
  after a grace period), which reaches EngineCore and the workers. The SIGCONT is for a group paused by
  ``idle_servers: pause``: a stopped process holds SIGTERM pending, so without it only the late SIGKILL
  ended a paused server. A normal ``stop()`` writes ``q`` first, so the
  watchdog exits without touching a process group whose id might be reused.

A watchdog pipe was chosen over a reaper thread inside kvscope because a thread dies with SIGKILL too.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from typing import Callable

PR_SET_PDEATHSIG = 1

WATCHDOG_SOURCE = r"""
import os, signal, sys, time
fd, pgid, grace_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
try:
    data = os.read(fd, 1)
except OSError:
    data = b""
if data == b"q":
    sys.exit(0)
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
if not alive():
    sys.exit(0)
os.killpg(pgid, signal.SIGTERM)
try:  # a paused (SIGSTOPped) group holds the SIGTERM pending until it runs again
    os.killpg(pgid, signal.SIGCONT)
except (ProcessLookupError, PermissionError):
    pass
deadline = time.monotonic() + grace_s
while time.monotonic() < deadline and alive():
    time.sleep(0.2)
if alive():
    os.killpg(pgid, signal.SIGKILL)
"""


def _set_pdeathsig() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # 9 = SIGKILL
    except OSError:
        pass


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for Popen that kills the child when kvscope's main thread ends (Linux, main thread
    only; None elsewhere)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    return _set_pdeathsig


class ParentDeathWatchdog:
    """Kills process group ``pgid`` when this process ends without calling :meth:`release`."""

    def __init__(self, pgid: int, grace_s: float = 10.0) -> None:
        read_fd, self._write_fd = os.pipe()  # both non-inheritable: only the watchdog gets the read end
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", WATCHDOG_SOURCE, str(read_fd), str(pgid), str(grace_s)],
                pass_fds=(read_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        finally:
            os.close(read_fd)

    def release(self, timeout_s: float = 5.0) -> None:
        """The server was stopped normally: tell the watchdog to exit without killing anything."""
        if self._write_fd < 0:
            return
        try:
            os.write(self._write_fd, b"q")
        except OSError:
            pass
        os.close(self._write_fd)
        self._write_fd = -1
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
