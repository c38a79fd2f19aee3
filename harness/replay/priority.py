"""The replay client's CPU scheduling priority: a load generator that shares the server's host must not be the
process that waits for a CPU.

Why: on the 2-vCPU validation host the replay client slept 0.1-3.7 s with a 10 ms timer due (see
``run_state.StallProbe``), 15.6 s of a 56 s concurrency-8 run.  A second process that only slept 10 ms in a loop
beside that replay was held up the same way (20 times, 10.4 s in all), so it is not the client's code; pinned
to the CPU the vLLM CPU worker binds its OpenMP threads to, it once waited 14.6 s.  The same probe under
``SCHED_FIFO`` was never late by 50 ms, and the replay run with ``SCHED_FIFO`` recorded no stall at all.  A
closed loop whose client is held up sends less than it should: at concurrency 8 the measured hit rate was
53.8-57.2 % with the stalls and 50.5 % without, against 51.4 % predicted.

So the replay runs its event-loop thread under ``SCHED_FIFO`` at the lowest real-time priority when the
process may (root or ``CAP_SYS_NICE``): it then runs as soon as it wakes, which is what a load generator on
its own machine does.  It does not take more CPU than before: the client sleeps on its sockets between events
(its CPU share is printed in ``summary.json: client.cpu_utilization``, 5 % at concurrency 8), and the kernel's
real-time throttling (``sched_rt_runtime_us``) keeps 5 % of each second for other tasks whatever happens.
The replay and the calibration start their threads real-time too (``threads_inherit``): with only the loop
thread real-time, a concurrency-1 run was still held up for 30 s of 124 s, because a normal thread that holds
the GIL (the /metrics parser in the default executor) and is then held up by the host holds up the loop with
it.  Without ``threads_inherit``, threads and processes started inside keep the normal policy
(``SCHED_RESET_ON_FORK``).  The thread's old policy comes back afterwards, so an in-process caller (a test, a
notebook) is left as it was; the threads started inside end with the block (the loop's executor, the calibration's pool).

Real-time is opt-in (``--client-priority realtime`` or ``auto``; default ``normal``, the replay and the
calibration alike). A real-time client is a bad neighbour on a shared machine: it starved another process on
its core, and the kernel's bound (``sched_rt_runtime_us``, 95 % of each second) leaves that process 5 % of
the core while the client is busy. benchmarks/client_priority.py measures both sides — the client's stalls
and the CPU a busy neighbour on the same core still gets — and benchmarks/README.md has the table. Where the
host holds the client up (the validation host above) and the machine is the experiment's own, opt in.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from kvscope.harness.common.errors import KvscopeError

ClientPriority = Literal["auto", "realtime", "normal"]
#: What a replay and a calibration run under unless told otherwise: real-time is opt-in (see the module text).
DEFAULT_CLIENT_PRIORITY: ClientPriority = "normal"
#: The lowest real-time priority: above every normal task, below any real-time task of the system's.
REALTIME_PRIORITY = 1


@contextmanager
def client_priority(mode: ClientPriority = "auto", *, threads_inherit: bool = False) -> Iterator[str]:
    """Run the block with the calling thread under ``SCHED_FIFO`` (``mode`` realtime, or auto where
    permitted); yields what is in effect: ``"realtime"`` or ``"normal"``.

    ``threads_inherit``: threads started inside run real-time too (the replay's executor threads, the
    calibration's request threads); otherwise they start with the normal policy.  ``realtime`` where the process may not
    raises :class:`KvscopeError`; ``auto`` then runs the block as it is.
    """
    if mode == "normal" or not hasattr(os, "sched_setscheduler"):
        if mode == "realtime":
            raise KvscopeError("--client-priority realtime: this platform has no SCHED_FIFO")
        yield "normal"
        return
    old_policy, old_param = os.sched_getscheduler(0), os.sched_getparam(0)
    policy = os.SCHED_FIFO if threads_inherit else os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
    try:
        os.sched_setscheduler(0, policy, os.sched_param(REALTIME_PRIORITY))
    except PermissionError:
        if mode == "realtime":
            raise KvscopeError("--client-priority realtime: this process may not use SCHED_FIFO (it needs root or "
                               "CAP_SYS_NICE); use auto or normal") from None
        yield "normal"
        return
    try:
        yield "realtime"
    finally:
        os.sched_setscheduler(0, old_policy, old_param)
