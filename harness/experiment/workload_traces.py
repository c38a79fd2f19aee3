"""An experiment workload's trace, written where the run keeps it.

Why its own module: the live cells' traces (the runner) and the ``predicted:`` phase's larger prediction traces
(:mod:`kvscope.harness.experiment.predicted`) are the same generation with different session counts, and both
modules import it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

from kvscope.harness.experiment.spec import ExperimentSpec
from kvscope.workloads.generate import generate_from_file


def write_workload_trace(spec: ExperimentSpec, wname: str, spec_path: Path, tokenizer_dir: str, out_dir: Path,
                         sessions: int | None = None, max_context: int | None = None,
                         scale: float | None = None) -> None:
    """Generate workload ``wname``'s trace into ``out_dir``: its spec, seed and scales, and ``sessions`` /
    ``max_context`` / ``scale`` where given instead of its own (the ``predicted:`` phase's larger traces)."""

    ref = spec.workloads[wname]
    max_ctx = max_context or ref.max_context
    if max_ctx is None:
        mml = spec.server_defaults.get("max_model_len")
        max_ctx = int(mml) - 256 if mml else None
    spec_ref = ref.spec
    if not Path(spec_ref).exists() and (spec_path.parent / spec_ref).exists():
        spec_ref = str(spec_path.parent / spec_ref)
    trace = generate_from_file(spec_ref, tokenizer_dir, seed=ref.seed, scale=scale or ref.scale,
                               sessions=sessions or ref.sessions, max_context=max_ctx, output_scale=ref.output_scale)
    trace.write(out_dir)
