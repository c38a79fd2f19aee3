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
