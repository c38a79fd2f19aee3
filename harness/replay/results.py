"""A replay's result files once its event loop has ended: the records compacted (cool-down applied, the
scheduler model's predictions where chosen), the metrics series, ``summary.json`` (the registered metrics
and the run's typed parts: ``aborted``, ``client``, ``server_facts``) and ``manifest.json``.

Separate from the run itself because it changes with the result files, not with how requests are sent; it
reads the run only through :class:`RunState`, the request loop's client and the metrics watcher.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import pandas as pd

from kvscope.harness.common.version import kvscope_version
from kvscope.harness.model.tinymodel import weights_are_random
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.predict import OnlinePredictor, PredictorChoice, apply_scheduler_predictions
from kvscope.harness.replay.run_state import MAX_STALL_WINDOWS, RunState
from kvscope.harness.replay.watch import MetricsWatcher
from kvscope.harness.results.loaders import write_result_file
from kvscope.harness.results.records import compact, read_records, write_records_parquet
from kvscope.harness.results.schemas import ManifestFile
from kvscope.harness.results.summary import CLIENT_SATURATED_CPU_SHARE, summarize, summary_file_model
from kvscope.harness.results.summary_parts import ABORTED, CLIENT, SERVER_FACTS, ClientStats, ServerFacts
from kvscope.workloads.trace_schema import TraceFile

if TYPE_CHECKING:
    from kvscope.harness.serving.backend import Backend


def trace_fingerprint(trace_dir: Path) -> str:
    """sha256 over the trace's three files, so a run names exactly the traffic it replayed."""
    h = hashlib.sha256()
    for name in ("trace.json", "segments.parquet", "requests.parquet"):
        p = Path(trace_dir) / name
        if p.exists():
            h.update(name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def client_stats(st: RunState, n_records: int, stale_connection_resends: int, priority: str) -> ClientStats:
    """The replay client's own cost over the run (summary.json ``client``)."""
    duration = st.end_s or 0.0
    util = st.cpu_s / duration if duration else None
    saturated = bool(util is not None and util > CLIENT_SATURATED_CPU_SHARE)
    return ClientStats(
        cpu_s=st.cpu_s, cpu_utilization=util,
        cpu_us_per_request=st.cpu_s / n_records * 1e6 if n_records else None,
        event_loop=st.event_loop, stale_connection_resends=stale_connection_resends, saturated=saturated,
        note=("the replay client used > 90 % of a core: latencies may include client queuing; use fewer "
              "sessions per process or several processes") if saturated else None,
        stalls=len(st.stalls), stall_max_s=st.stalls[0][1] if st.stalls else 0.0,
        stalled_s=float(sum(w[1] for w in st.stalls)),
        stall_windows_s=[(round(a, 4), round(b, 4)) for a, b in st.stalls[:MAX_STALL_WINDOWS]],
        priority=priority,
    )


def summarize_run(run_dir: Path, st: RunState, facts: Sequence[ServerFacts], opts: ReplayOptions,
                  backends: "Sequence[Backend]", watcher: MetricsWatcher,
                  predictors: Sequence[OnlinePredictor | None], stale_connection_resends: int = 0,
                  priority: str = "normal", not_reset: str | None = None,
                  choice: PredictorChoice | None = None) -> dict[str, Any]:
    """Compact the records, replace the predictions by the scheduler model's where chosen, write the metrics
    series and build summary.json's content (metrics and parts)."""
    compact(run_dir)
    records = read_records(run_dir)
    duration = st.end_s or 0.0
    changed = False
    if opts.cooldown_s and len(records):
        cutoff = duration - opts.cooldown_s
        records.loc[records["sent_s"] > cutoff, "in_window"] = False
        changed = True
    note = choice.note if choice is not None else None
    if choice is not None and choice.calibration is not None and len(records):
        note = apply_scheduler_predictions(records, predictors, facts, choice)
        changed = True
    if changed:
        write_records_parquet(run_dir, records)
    series = pd.read_parquet(watcher.write(run_dir))
    model_dir = backends[0].model_path()
    client = client_stats(st, len(records), stale_connection_resends, priority)
    return summarize(records, watcher.deltas(), duration, facts[0].prefix_caching, opts.slo_ttft_ms,
                     opts.slo_tpot_ms, weights_random=weights_are_random(model_dir) if model_dir else None,
                     client_cpu_utilization=client.cpu_utilization, client_stalls=len(st.stalls),
                     cache_not_reset=not_reset, scrape_interval_s=opts.scrape_interval_s,
                     scrape_times_s=tuple(series["t_s"]) if "t_s" in series else (),
                     predictor_note=note, calibration=choice.calibration_path if choice is not None else None,
                     parts={ABORTED.name: st.abort_reason, CLIENT.name: client, SERVER_FACTS.name: list(facts)})


def write_run_files(run_dir: Path, summary: dict[str, Any], *, trace_dir: Path, header: TraceFile,
                    opts: ReplayOptions, facts: Sequence[ServerFacts], backends: "Sequence[Backend]",
                    launched: bool, started: float, ended: float, aborted: str | None,
                    reset: dict[str, str] | None) -> dict[str, Any]:
    """Write summary.json and manifest.json (each validated against its file model); summary.json's content as
    written."""
    # the file model of the metrics and parts registered now (a test may register one after import)
    summary = write_result_file(run_dir / "summary.json", summary_file_model(), summary).model_dump(mode="json")
    manifest = {
        "kvscope_version": kvscope_version(),
        "vllm_version": facts[0].vllm_version,
        "backend": backends[0].name,
        "engine_version": facts[0].engine_version,
        "trace": {"path": str(Path(trace_dir).resolve()), "sha256": trace_fingerprint(Path(trace_dir)),
                  "name": header.name, "seed": header.seed},
        "options": opts.model_dump(mode="json"),
        "endpoints": [b.endpoint for b in backends],
        "server_config": backends[0].redacted_config() if launched else None,
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "started_at": started,
        "ended_at": ended,
        "aborted": aborted,
        "prefix_cache_reset": reset,
    }
    write_result_file(run_dir / "manifest.json", ManifestFile, manifest)
    return summary
