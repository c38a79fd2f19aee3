"""What one replay run shares while it runs: the counters every session and request updates, and the stall
probe that measures the client itself.

One mutable :class:`RunState` per run, passed to the session driver and the request loop, rather than
attributes of either: both change it, the progress bar and the results read it, and a run's state then
starts fresh with the run, never with the object that drives it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvscope.harness.results.schemas import CLIENT_STALL_S

_STALL_PROBE_S = 0.01
#: summary.json keeps the longest this many stall windows.
MAX_STALL_WINDOWS = 50

#: Failures that may mean the server is gone: each is followed by a /health check of every endpoint.
CONNECTION_FAILURES = frozenset({"connection_error", "connect_timeout", "stream_interrupted", "first_token_timeout",
                                 "idle_timeout", "timeout", "protocol_error"})


@dataclass
class RunState:
    t0: float
    deadline: float | None
    max_requests: int | None
    sent: int = 0
    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    abort_reason: str | None = None
    stop: bool = False
    active_sessions: int = 0
    consecutive_conn_errors: int = 0
    length_mismatch: int = 0
    end_s: float | None = None
    last_done_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time during the run (all threads)
    event_loop: str = ""
    #: Client stalls (see StallProbe): (start s from t0, length s), longest first after the run.
    stalls: list[tuple[float, float]] = field(default_factory=list)

    def may_send(self) -> bool:
        if self.stop:
            return False
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return False
        if self.max_requests is not None and self.sent >= self.max_requests:
            return False
        return True


class StallProbe:
    """A timer on the replay's event loop every 10 ms that records how late it fired, when later than
    :data:`CLIENT_STALL_S`.

    Why: on the 2-vCPU validation host (a Firecracker VM) the client sometimes slept 0.1-3.7 s with a 10 ms
    timer due and tokens waiting in its sockets: 1-4 ms of CPU in the window, no run-queue delay, and under
    strace an ``epoll_wait`` with a 4 ms timeout that returned after 149 ms.  Closed-loop sessions then started
    late (one concurrency-8 run averaged 7.0 sessions in flight, others 7.3-7.5) and the window's tokens were
    read in one burst.  The records only show it as event-free gaps, so the run measures it
    (``summary.json: client.stalls``, the data-quality flag ``client_stalls``; benchmarks/README.md has the
    figures: 22-28 s of a 60-70 s run at concurrency 1, 1.5 s at 32).  Cost: 100 timer callbacks a second.
    The cause was the guest's scheduler, not the client: a separate sleeper process was held up the same way,
    and not at all under ``SCHED_FIFO``, which the replay now runs under where permitted (replay/priority.py);
    the probe stays, because a host without the privilege (or with another cause) still shows it.
    """

    def __init__(self, st: RunState) -> None:
        self.st = st
        self.handle: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.due = 0.0

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._arm()

    def _arm(self) -> None:
        self.due = time.perf_counter() + _STALL_PROBE_S
        self.handle = self.loop.call_later(_STALL_PROBE_S, self._fire)  # type: ignore[union-attr]

    def _fire(self) -> None:
        late = time.perf_counter() - self.due
        if late > CLIENT_STALL_S:
            self.st.stalls.append((self.due - self.st.t0, late))
        self._arm()

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.st.stalls.sort(key=lambda w: -w[1])
