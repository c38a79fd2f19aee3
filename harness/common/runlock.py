"""One writer per run directory: an advisory lock file that a second kvscope process reports in one line.

Two processes writing one run (an experiment and its ``--resume`` started beside it, two ``kvscope record`` on
one ``--out``) interleave their records silently: cells end under-driven yet ``ok``, request ids repeat. So
every command that writes a run directory (``experiment run``, ``replay``, ``record`` and ``record --finalize``)
holds ``.kvscope.lock`` inside it while it writes.

Why ``fcntl.flock`` on a file, not "a pid file exists": the kernel drops the lock when the holder's last
descriptor closes, whatever ended it (``kill -9``, OOM), so a crash never leaves the directory stuck and no
liveness guess is needed. The holder writes its pid and command into the file, only for the message the next
process prints. The descriptor is close-on-exec, so a vLLM server or other child kvscope starts does not
inherit (and outlive the holder with) the lock. On release the file is unlinked while still locked; a process
that locked a file that was unlinked meanwhile sees that its descriptor no longer names the path and retries,
so two processes never both believe they hold it.

Nesting: the lock is per directory. An experiment holds its run directory; its cells' replays write
``cells/<name>/`` inside it through library calls (in this process or a Ray worker) that take no lock, so
nothing waits on its own parent.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import Self

from kvscope.harness.common.errors import KvscopeError

LOCK_FILE_NAME = ".kvscope.lock"

#: Locks this process holds, by resolved directory: taking a directory this process already holds moves the
#: lock to the new holder instead of refusing (a library caller retrying after an exception left the first
#: holder unreleased in a traceback) -- the rule is one writing *process* per directory. A lock never released
#: is held until the process exits.
_HELD: dict[str, RunDirLock] = {}


class RunDirBusyError(KvscopeError):
    """Another process holds the run directory's lock."""


class RunDirLock:
    """The held lock of one directory (a context manager; ``release`` is idempotent)."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE_NAME
        self._fd = fd
        self._key = str(directory.resolve())

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        if self._fd < 0:
            return
        if _HELD.get(self._key) is self:
            del _HELD[self._key]
        try:
            os.unlink(self.path)  # still locked: a waiter that opened this file retries on the new one
        except OSError:
            pass
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(path: Path) -> tuple[str, str | None]:
    """('pid N (command, since HH:MM:SS)', 'N') from the lock file, as far as it says."""
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        text = ""
    pid, _, rest = text.partition(" ")
    if not pid.isdigit():
        return "another process (its pid is not written yet)", None
    alive = True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        alive = False
    except PermissionError:
        pass
    what = f"pid {pid}" + (f" ({rest})" if rest else "")
    # The pid has exited, yet the lock is held: a process it forked still has the descriptor.
    return (what if alive else what + ", exited; a process it started still holds the lock"), pid


def lock_run_dir(directory: str | Path, command: str) -> RunDirLock:
    """Lock ``directory`` (created if missing) for this process, or raise :class:`RunDirBusyError` naming the
    holder's pid and how to proceed. ``command`` names what writes (e.g. ``kvscope replay``) for that message."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvscopeError(f"{directory}: cannot create the run directory: {exc.strerror}") from None
    path = directory / LOCK_FILE_NAME
    key = str(directory.resolve())
    mine = _HELD.get(key)
    if mine is not None and mine.held:
        moved = RunDirLock(directory, mine._fd)
        mine._fd = -1
        _HELD[key] = moved
        return moved
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise KvscopeError(f"{directory}: cannot write there: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder, pid = _holder(path)
                raise RunDirBusyError(
                    f"{directory} is in use by another kvscope writer, {holder}; one process writes a run "
                    f"directory at a time: wait for it to end, or stop it (kill {pid or '<pid>'}) and run "
                    "again") from None
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without locks
                print(f"kvscope: warning: {directory}: cannot lock ({exc.strerror}); make sure no other kvscope "
                      "writes it", file=sys.stderr)
                return RunDirLock(directory, -1)
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder released and unlinked it between our open and our lock: try the new file
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {command}, since {time.strftime('%H:%M:%S')}\n".encode())
    except OSError:
        pass  # a full disk: the lock holds all the same, the message just lacks the pid
    held = _HELD[key] = RunDirLock(directory, fd)
    return held
