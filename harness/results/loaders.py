"""Results are data: tidy pandas DataFrames across every cell of an experiment (or a single replay run).

    from kvscope.harness.results.loaders import load_results
    res = load_results("results/quickstart/20261129-120000")
    res.requests      # one row per request, with cell columns (cell, server, workload, load, repeat)
    res.cells         # one row per cell: status, headline figures, server settings
    res.metrics       # /metrics time series of every cell
    res.manifest      # experiment.json as a dict (spec, model, servers and their facts)
    res.experiment    # the same file as a validated ExperimentFile (res.spec: its spec, defaults included)
    res.summaries     # cell -> validated SummaryFile

Every result file is read through one loader here (`load_summary`, `load_run_manifest`,
`load_experiment_file`, `load_report_file`), which checks format name and version and then validates every
field: a file of another version, another format or corrupt JSON is a one-line `KvscopeError` naming the file
(schemas: `kvscope.harness.results.schemas`). Writers use `write_result_file`.

A single `kvscope replay` run directory loads as an experiment of one cell, so every notebook and
`kvscope compare` work on either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.results.schemas import (CalibrationFile, ExperimentFile, ExperimentSpecCore, ManifestFile, ReportFile,
                                            SummaryFile)
from kvscope.workloads.versioned_file import VersionedFile, read_versioned, validate_data, write_versioned

CELL_COLUMNS = ["cell", "server", "workload", "load", "repeat"]
SUMMARY_NAME = "summary.json"
MANIFEST_NAME = "manifest.json"
EXPERIMENT_NAME = "experiment.json"
REPORT_NAME = "report.json"

FileT = TypeVar("FileT", bound=VersionedFile)
SpecT = TypeVar("SpecT", bound=ExperimentSpecCore)


# One loader per result file: each checks format and version, then every field (KvscopeError, one line).

def load_summary(path: str | Path) -> SummaryFile:
    """A run's `summary.json` (give the file or its run directory)."""
    return read_versioned(_file(path, SUMMARY_NAME), SummaryFile, KvscopeError)


def load_run_manifest(path: str | Path) -> ManifestFile:
    """A run's `manifest.json` (give the file or its run directory)."""
    return read_versioned(_file(path, MANIFEST_NAME), ManifestFile, KvscopeError)


def load_experiment_file(path: str | Path, spec_model: type[SpecT] = ExperimentSpecCore  # type: ignore[assignment]
                         ) -> ExperimentFile[SpecT]:
    """An experiment's `experiment.json`; `spec_model` is the model its spec validates as (the experiment
    runner passes the full ExperimentSpec, reports the core that they read)."""
    return read_versioned(_file(path, EXPERIMENT_NAME), ExperimentFile[spec_model], KvscopeError)  # type: ignore[valid-type]


def load_calibration(path: str | Path) -> CalibrationFile:
    """A server's step-cost `calibration.json` (`kvscope capacity --server`, an experiment's sweep)."""
    return read_versioned(Path(path), CalibrationFile, KvscopeError)


def load_report_file(path: str | Path) -> ReportFile:
    """A report's `report.json` (give the file or its report directory)."""
    return read_versioned(_file(path, REPORT_NAME), ReportFile, KvscopeError)


def write_result_file(path: str | Path, model: type[FileT], data: Any) -> FileT:
    """Validate `data` (a dict or a model instance) as `model` and write it atomically; returns the model."""
    path = Path(path)
    obj = data if isinstance(data, model) else validate_data(f"{path} (writing)", data, model, KvscopeError)
    write_versioned(path, obj)
    return obj


def _file(path: str | Path, name: str) -> Path:
    p = Path(path)
    return p / name if p.is_dir() else p


@dataclass
class ExperimentResults:
    root: Path
    manifest: dict[str, Any]  # experiment.json as a dict (or a synthesised one for a single run): for notebooks
    cells: pd.DataFrame
    requests: pd.DataFrame
    metrics: pd.DataFrame
    summaries: dict[str, SummaryFile] = field(default_factory=dict)
    cell_dirs: dict[str, Path] = field(default_factory=dict)
    experiment: ExperimentFile | None = None  # the validated experiment.json (None for a single replay run)
    run_manifest: ManifestFile | None = None  # the validated manifest.json of a single replay run

    @property
    def spec(self) -> ExperimentSpecCore | None:
        """The experiment's validated spec (defaults included); None for a single replay run."""
        return self.experiment.spec if self.experiment is not None else None

    @property
    def name(self) -> str:
        return str(self.manifest.get("experiment") or self.root.name)

    @property
    def weights_random(self) -> bool:
        return bool((self.manifest.get("model") or {}).get("weights_random"))

    def ok_requests(self) -> pd.DataFrame:
        """Successful requests inside the measurement window: what statistics are computed on."""
        r = self.requests
        return r[r["error_class"].isna() & r["in_window"].astype(bool)]

    def trace_dir(self, workload: str) -> Path | None:
        rel = (self.manifest.get("traces") or {}).get(workload)
        if rel:
            return self.root / rel
        single = (self.manifest.get("single_run_trace"))
        return Path(single) if single else None

    def server_facts(self, server: str) -> dict:
        return ((self.manifest.get("servers") or {}).get(server) or {}).get("facts") or {}


def _summary_row(name: str, meta: dict, s: SummaryFile) -> dict[str, Any]:
    lat, hit, thr, req = s.latency, s.hit_rate, s.throughput, s.requests
    facts = s.server_facts[0] if s.server_facts else {}
    spec = s.speculative
    row = {
        "cell": name, "server": meta.get("server", name), "workload": meta.get("workload", "trace"),
        "load": meta.get("load", "run"), "repeat": meta.get("repeat", 0), "status": meta.get("status", "ok"),
        "reason": meta.get("reason"),
        "requests": req.sent, "ok": req.ok, "failed": req.failed,
        "error_rate": req.error_rate, "duration_s": s.duration_s,
        "req_per_s": thr.requests_per_s, "output_tok_per_s": thr.output_tokens_per_s,
        "prompt_tok_per_s": thr.prompt_tokens_per_s,
        "hit_server": hit.server_per_request, "hit_metrics": hit.metrics_counters,
        "hit_predicted": hit.predicted, "would_hit": hit.would_hit,
        "requests_predicted_exactly": hit.requests_predicted_exactly, "requests_compared": hit.requests_compared,
        "prefix_caching": facts.get("prefix_caching"), "speculative": bool(facts.get("speculative_enabled")),
        "block_size": facts.get("block_size"), "num_blocks": facts.get("num_blocks"),
        "kv_capacity_tokens": facts.get("kv_capacity_tokens"),
        "spec_acceptance_rate": spec.acceptance_rate if spec else None,
        "spec_mean_acceptance_length": spec.mean_acceptance_length if spec else None,
        "concurrency": meta.get("concurrency"), "aborted": s.aborted,
    }
    for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        pcts = getattr(lat, metric)
        for q in ("p50", "p90", "p99", "mean"):
            row[f"{metric[:-2]}_{q}_s"] = getattr(pcts, q)
    if s.goodput is not None:
        row["goodput_fraction"] = s.goodput.fraction
        row["goodput_req_per_s"] = s.goodput.goodput_req_per_s
    return row


def _read_metrics(path: Path) -> pd.DataFrame:
    if not path.exists():
        return pd.DataFrame()
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise KvscopeError(f"{path}: unreadable Parquet ({exc})") from None


def _load_cell(cell_dir: Path, name: str, meta: dict) -> tuple[pd.DataFrame, pd.DataFrame, SummaryFile | None]:
    from kvscope.harness.results.records import JSONL_NAME, PARQUET_NAME, read_records

    summary = load_summary(cell_dir / SUMMARY_NAME) if (cell_dir / SUMMARY_NAME).exists() else None
    # A cell that failed before sending anything has no records: that is empty. A records file that exists but
    # cannot be read is an error naming it (RecordsError), never an empty cell.
    has_records = (cell_dir / PARQUET_NAME).exists() or (cell_dir / JSONL_NAME).exists()
    req = read_records(cell_dir) if has_records else pd.DataFrame()
    met = _read_metrics(cell_dir / "server_metrics.parquet")
    for df in (req, met):
        if len(df) or len(df.columns):
            df["cell"] = name
            for k in ("server", "workload", "load", "repeat"):
                df[k] = meta.get(k, {"server": name, "workload": "trace", "load": "run", "repeat": 0}[k])
    return req, met, summary


def _load_name(run_manifest: ManifestFile | None) -> str:
    """A single run's load level as an experiment names it (`c4`, `r0.5`), or `trace` (the trace's timing)."""
    options = run_manifest.options if run_manifest is not None else {}
    if options.get("concurrency"):
        return f"c{options['concurrency']}"
    if options.get("session_rate"):
        return f"r{options['session_rate']:g}"
    return "trace"


def _single_run_manifest(root: Path) -> tuple[dict[str, Any], ManifestFile | None]:
    """A replay run directory described as an experiment of one cell."""
    run_manifest = load_run_manifest(root / MANIFEST_NAME) if (root / MANIFEST_NAME).exists() else None
    name = root.name
    server_conf = (run_manifest.server_config if run_manifest else None) or {}
    manifest = {"experiment": name, "single_run": True,
                "cells": {name: {"status": "ok", "dir": ".", "load": _load_name(run_manifest)}},
                "model": {"path": server_conf.get("model"), "weights_random": None},
                "single_run_trace": run_manifest.trace.path if run_manifest else None,
                "run_manifest": run_manifest.model_dump(mode="json") if run_manifest else {}}
    return manifest, run_manifest


def load_results(path: str | Path) -> ExperimentResults:
    """Load an experiment run directory (`experiment.json`) or a single replay run (`summary.json`)."""
    root = Path(path)
    experiment: ExperimentFile | None = None
    run_manifest: ManifestFile | None = None
    if (root / EXPERIMENT_NAME).exists():
        experiment = load_experiment_file(root / EXPERIMENT_NAME)
        manifest = experiment.model_dump(mode="json")
    elif (root / SUMMARY_NAME).exists() or (root / "requests.jsonl").exists():
        manifest, run_manifest = _single_run_manifest(root)
    else:
        raise KvscopeError(f"{root}: not an experiment run (experiment.json) or a replay run (summary.json)")
    entries = manifest["cells"]
    req_frames, met_frames, rows = [], [], []
    summaries: dict[str, SummaryFile] = {}
    dirs: dict[str, Path] = {}
    for name, meta in entries.items():
        cdir = root / meta["dir"] if meta.get("dir") else root / "cells" / name
        dirs[name] = cdir
        summary = None
        if cdir.exists():
            req, met, summary = _load_cell(cdir, name, meta)
            if len(req):
                req_frames.append(req)
            if len(met):
                met_frames.append(met)
        if summary is not None:
            summaries[name] = summary
            rows.append(_summary_row(name, meta, summary))
        else:
            # no summary (a failed or interrupted cell): the same defaults the cell's request rows carry
            defaults = {"server": name, "workload": "trace", "load": "run", "repeat": 0}
            rows.append({"cell": name, **{k: meta.get(k, v) for k, v in defaults.items()},
                         "status": meta.get("status"), "reason": meta.get("reason")})
    if manifest.get("single_run") and summaries:
        s = next(iter(summaries.values()))
        manifest.setdefault("servers", {})[next(iter(entries))] = {"facts": s.server_facts[0] if s.server_facts
                                                                   else {}}
    cells = pd.DataFrame(rows)
    requests = pd.concat(req_frames, ignore_index=True) if req_frames else pd.DataFrame()
    metrics = pd.concat(met_frames, ignore_index=True) if met_frames else pd.DataFrame()
    return ExperimentResults(root=root, manifest=manifest, cells=cells, requests=requests, metrics=metrics,
                             summaries=summaries, cell_dirs=dirs, experiment=experiment, run_manifest=run_manifest)
