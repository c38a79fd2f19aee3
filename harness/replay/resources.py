"""Fit replay options to the client machine before a run starts (one call from the runner)."""

from __future__ import annotations

import sys

from kvscope.harness.common.limits import fit_concurrency_to_descriptors, raise_nofile_soft_limit
from kvscope.harness.replay.options import ReplayOptions


def fit_options_to_machine(opts: ReplayOptions) -> ReplayOptions:
    """Raise the descriptor limit; cap closed-loop concurrency (and max_active_sessions) to it with a warning,
    so client-side EMFILE does not masquerade as server connection errors."""
    raise_nofile_soft_limit()
    update = {}
    for field, flag in (("concurrency", "--concurrency"), ("max_active_sessions", "--max-active-sessions")):
        value = getattr(opts, field)
        if value is None:
            continue
        fit = fit_concurrency_to_descriptors(value, flag)
        if fit.warning:
            print(f"kvscope: warning: {fit.warning}", file=sys.stderr)
            update[field] = fit.concurrency
    return opts.model_copy(update=update) if update else opts
