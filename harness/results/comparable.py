"""Preconditions of an A/B comparison, kept apart from the comparison itself.

Paired differences only mean something on identical traffic, so two runs must have replayed the same trace
(the sha256 over the trace files that each replay writes into its manifest.json) and both must hold records.
Without these checks `compare` gave verdicts ("ttft_p50 worse", rc 0) for runs of different traces and a
traceback for a run of 0 records.
"""

from __future__ import annotations

from pathlib import Path

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.results.loaders import load_run_manifest


def trace_identity(run_dir: Path) -> tuple[str | None, str | None]:
    """(sha256, path) of the trace a replay run replayed, from its manifest.json (read by its loader: an
    unreadable or invalid one is a one-line KvscopeError naming it); (None, None) without one."""
    manifest = Path(run_dir) / "manifest.json"
    if not manifest.is_file():
        return None, None
    trace = load_run_manifest(manifest).trace
    return trace.sha256, trace.path


def check_same_trace(run_a: Path, run_b: Path, force: bool = False) -> None:
    """Raise unless both runs replayed the same trace (runs without a recorded sha256 are not refused)."""
    (sha_a, path_a), (sha_b, path_b) = trace_identity(run_a), trace_identity(run_b)
    if force or sha_a is None or sha_b is None or sha_a == sha_b:
        return
    raise KvscopeError(f"compare: {run_a} replayed trace {path_a} (sha256 {sha_a[:12]}…) but {run_b} replayed "
                       f"{path_b} (sha256 {sha_b[:12]}…); paired differences need the same trace "
                       "(--force compares anyway)")


def check_has_records(run_dir: Path, n_records: int) -> None:
    """Raise when a run to compare holds no request records."""
    if n_records == 0:
        raise KvscopeError(f"compare: {run_dir} holds 0 request records; a comparison needs a run with requests")
