"""Machine limits checked before kvscope commits to work: file descriptors for the replay client and memory
for trace generation.

Both failures used to be silent or late: with ``ulimit -n 256`` at concurrency 512 the client's own EMFILE
was recorded as 87 % server ``connection_error``; ``--scale 1000000`` grew to 10 GB RSS before anything said
it was too large. The checks live here, below every package that needs them, and return numbers or messages
rather than printing, so callers decide how to report.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

import psutil

# Descriptors kvscope needs besides one connection per concurrent request: metrics scraper, records file,
# server log, Python's own files, the event loop's self-pipe.
RESERVED_FDS = 64
# Bytes per generated token while a trace is built and written: int32 in the builder, the concatenated
# segment array, the Arrow/Parquet copy, plus per-segment Python objects (measured 10.5 B in memory on
# agent-coding at scale 1 before writing; 16 leaves room for the write).
BYTES_PER_GENERATED_TOKEN = 16
# Share of the currently available memory a generation may use before it needs --allow-large.
MEMORY_SHARE = 0.5


def raise_nofile_soft_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit where allowed; returns (soft, hard) afterwards."""
    try:
        import resource  # optional: resource is Unix-only, the ImportError is handled
    except ImportError:  # not POSIX
        return (1 << 20, 1 << 20)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


@dataclass(frozen=True, slots=True)
class ConcurrencyFit:
    concurrency: int
    warning: str | None


def fit_concurrency_to_descriptors(concurrency: int, flag: str = "--concurrency") -> ConcurrencyFit:
    """Raise the descriptor limit, then cap ``concurrency`` to what it allows (one connection per request)."""
    soft, hard = raise_nofile_soft_limit()
    allowed = max(1, soft - RESERVED_FDS)
    if concurrency <= allowed:
        return ConcurrencyFit(concurrency, None)
    return ConcurrencyFit(allowed, f"{flag} {concurrency} needs about {concurrency + RESERVED_FDS} file "
                                   f"descriptors but the limit is {soft} (hard {hard}); running at {allowed} "
                                   "(raise it with `ulimit -n`)")


def is_fd_exhaustion(exc: BaseException) -> bool:
    """True for EMFILE/ENFILE, also when wrapped (aiohttp's ClientConnectorError keeps it in ``os_error``)."""
    for candidate in (exc, getattr(exc, "os_error", None), exc.__cause__):
        if isinstance(candidate, OSError) and candidate.errno in (errno.EMFILE, errno.ENFILE):
            return True
    return False


def generation_token_budget(allow_large: bool) -> tuple[int | None, str]:
    """Most tokens a trace generation may draw on this machine (None with ``allow_large``), and the hint
    that the error names."""
    if allow_large:
        return None, ""

    available = psutil.virtual_memory().available
    budget = int(available * MEMORY_SHARE / BYTES_PER_GENERATED_TOKEN)
    hint = (f"about {BYTES_PER_GENERATED_TOKEN} bytes per token against {available / 2**30:.1f} GiB available "
            f"memory allows {budget:,} tokens; lower --scale or --sessions, or pass --allow-large")
    return budget, hint
