"""SIGTERM and SIGHUP are handled like SIGINT.

Every path that owns a server (``replay --server``, ``experiment run``, ``serve``, ``demo``) already stops it,
flushes records and marks the cell on KeyboardInterrupt, and ``asyncio.Runner`` turns SIGINT into a clean
cancellation of the running replay. Forwarding the other termination signals to the *current* SIGINT handler
reuses all of that instead of writing a second shutdown path: inside an event loop the handler is asyncio's
(cancel the main task), elsewhere it is Python's default (raise KeyboardInterrupt).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

received: list[int] = []  # termination signals seen, in order (the CLI's exit code is 128 + the first)


def _forward_to_sigint(signum: int, frame: FrameType | None) -> None:
    received.append(signum)
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # SIGINT ignored or default-at-C-level: still stop
        raise KeyboardInterrupt


def handle_termination_like_sigint() -> None:
    """Install the forwarding handler for SIGTERM and SIGHUP (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    # A parent may have left them blocked (Ray's process launcher blocks SIGINT in what it starts) or SIGINT
    # ignored (a background job of a non-interactive shell): the promise to stop cleanly needs them delivered.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, *FORWARDED_SIGNALS})
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, _forward_to_sigint)


def exit_code_for_interrupt() -> int:
    """130 for Ctrl-C, 128 + N for a forwarded signal N (143 for SIGTERM), as shells report them."""
    return 128 + received[0] if received else 130


#: KeyboardInterrupts (and SystemExits) that reached an event loop's exception handler: raised by a signal
#: handler inside a transport callback, they are logged there, not propagated (uvloop).
callback_interrupts: list[BaseException] = []


def _quiet_interrupt_handler(loop, context: dict) -> None:
    """A loop exception handler: an interrupt raised inside a callback (the second SIGTERM of a replay lands in
    a transport's ``data_received``) is not an error to log (uvloop printed "Fatal error on transport" and a
    KeyboardInterrupt traceback from ``_forward_to_sigint`` before "kvscope: interrupted"): it is noted in
    :data:`callback_interrupts` and every task is cancelled, so the run stops and its caller raises
    KeyboardInterrupt. Everything else goes to the default handler."""
    exc = context.get("exception")
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        import asyncio  # deferred: only an interrupt inside an event loop needs it, and every command loads this module

        callback_interrupts.append(exc)
        for task in asyncio.all_tasks(loop):
            task.cancel()
        return
    loop.default_exception_handler(context)


def quiet_interrupts(loop_factory):
    """``loop_factory`` whose loops handle an interrupt raised inside a callback quietly
    (:func:`_quiet_interrupt_handler`)."""

    def factory():
        loop = loop_factory()
        loop.set_exception_handler(_quiet_interrupt_handler)
        return loop

    return factory
