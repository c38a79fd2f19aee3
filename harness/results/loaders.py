"""Results are data: tidy pandas DataFrames across every cell of an experiment (or a single replay run).

    from kvscope.harness.results.loaders import load_results
    res = load_results("results/quickstart/20261129-120000")
    res.requests      # one row per request, with cell columns (cell, server, workload, load, repeat)
    res.cells         # one row per cell: status, headline figures, server settings
    res.metrics       # /metrics time series of every cell
    res.experiment    # experiment.json as a validated ExperimentFile (spec, model, servers and their facts)
    res.spec          # its spec, defaults included (None for a single replay run)
    res.summaries     # cell -> validated SummaryFile

Every result file is read through one loader here (`load_summary`, `load_run_manifest`,
`load_experiment_file`, `load_report_file`), which checks format name and version and then validates every
field: a file of another version, another format or corrupt JSON is a one-line `KvscopeError` naming the file
(schemas: `kvscope.harness.results.schemas`). Writers use `write_result_file`.

A single `kvscope replay` run directory loads as an experiment of one cell (an `ExperimentFile` built from its
manifest.json and summary.json), so every notebook and `kvscope compare` work on either. Results stay typed
from file to table: analysis reads the models' attributes, never a dict dumped from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.results.prediction_file import PREDICTION_NAME, load_prediction_file
from kvscope.harness.results.records import JSONL_NAME, PARQUET_NAME, read_records
from kvscope.harness.results.schemas import (
    CalibrationFile,
    CellEntry,
    ExperimentFile,
    ExperimentSpecCore,
    ManifestFile,
    ModelEntry,
    ReportFile,
    ServerEntry,
)
from kvscope.harness.results.summary import cell_columns, summary_file_model
from kvscope.workloads.versioned_file import VersionedFile, read_versioned, validate_data, write_versioned

CELL_COLUMNS = ["cell", "server", "workload", "load", "repeat"]
SUMMARY_NAME = "summary.json"
MANIFEST_NAME = "manifest.json"
EXPERIMENT_NAME = "experiment.json"
REPORT_NAME = "report.json"
#: An experiment's predicted deployments: ``predictions/<config>/<workload>/prediction.json`` (spec ``predicted:``).
PREDICTIONS_DIR = "predictions"

FileT = TypeVar("FileT", bound=VersionedFile)
SpecT = TypeVar("SpecT", bound=ExperimentSpecCore)


# One loader per result file: each checks format and version, then every field (KvscopeError, one line).

def load_summary(path: str | Path) -> Any:
    """A run's `summary.json` (give the file or its run directory), as the `SummaryFile` model of the summary
    metrics registered now (`kvscope.harness.results.summary`)."""
    return read_versioned(_file(path, SUMMARY_NAME), summary_file_model(), KvscopeError)


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


@dataclass(frozen=True)
class ExperimentPrediction:
    """One predicted deployment on one workload's trace, found under an experiment's ``predictions/``."""

    config: str
    workload: str
    path: Path
    prediction: Any  # PredictionFile


def load_experiment_predictions(root: str | Path) -> list[ExperimentPrediction]:
    """Every ``predictions/<config>/<workload>/prediction.json`` of an experiment run directory, sorted by
    configuration then workload (none: an empty list). Found by layout, not listed in experiment.json, so
    experiment.json's format is unchanged and a run predicted again simply replaces the files."""

    base = Path(root) / PREDICTIONS_DIR
    out = []
    for f in sorted(base.glob(f"*/*/{PREDICTION_NAME}")):
        out.append(ExperimentPrediction(config=f.parent.parent.name, workload=f.parent.name, path=f,
                                        prediction=load_prediction_file(f)))
    return out


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
    experiment: ExperimentFile  # experiment.json (for a single replay run: one cell, built from its files)
    cells: pd.DataFrame
    requests: pd.DataFrame
    metrics: pd.DataFrame
    summaries: dict[str, Any] = field(default_factory=dict)  # cell -> SummaryFile (summary_file_model())
    cell_dirs: dict[str, Path] = field(default_factory=dict)
    run_manifest: ManifestFile | None = None  # the validated manifest.json of a single replay run
    single_run: bool = False  # a `kvscope replay` run directory, not an experiment

    @property
    def spec(self) -> ExperimentSpecCore | None:
        """The experiment's validated spec (defaults included); None for a single replay run."""
        return None if self.single_run else self.experiment.spec

    @property
    def name(self) -> str:
        return self.experiment.experiment or self.root.name

    @property
    def model(self) -> ModelEntry | None:
        return self.experiment.model

    @property
    def weights_random(self) -> bool:
        return bool(self.model is not None and self.model.weights_random)

    def ok_requests(self) -> pd.DataFrame:
        """Successful requests inside the measurement window: what statistics are computed on."""
        r = self.requests
        return r[r["error_class"].isna() & r["in_window"].astype(bool)]

    def trace_dir(self, workload: str) -> Path | None:
        rel = self.experiment.traces.get(workload)
        return self.root / rel if rel else None

    def server(self, server: str) -> ServerEntry | None:
        """A configuration's record in experiment.json (config, facts, restarts, log), None if unknown."""
        return self.experiment.servers.get(server)



def _summary_row(name: str, entry: CellEntry, s: Any) -> dict[str, Any]:
    """A cell's row of `load_results(...).cells`: the cell, its server's facts, then every registered summary
    metric's columns (`SummaryMetric.cell_columns`)."""
    facts = s.server_facts[0] if s.server_facts else None
    return {
        "cell": name, "server": entry.server, "workload": entry.workload, "load": entry.load,
        "repeat": entry.repeat, "status": entry.status, "reason": entry.reason,
        "prefix_caching": facts.prefix_caching if facts else None,
        "speculative": bool(facts and facts.speculative_enabled),
        "block_size": facts.block_size if facts else None, "num_blocks": facts.num_blocks if facts else None,
        "kv_capacity_tokens": facts.kv_capacity_tokens if facts else None,
        "concurrency": None, "aborted": s.aborted,
        **cell_columns(s),
    }


def _read_metrics(path: Path) -> pd.DataFrame:
    if not path.exists():
        return pd.DataFrame()
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise KvscopeError(f"{path}: unreadable Parquet ({exc})") from None


def _load_cell(cell_dir: Path, name: str, entry: CellEntry) -> tuple[pd.DataFrame, pd.DataFrame, Any]:
    summary = load_summary(cell_dir / SUMMARY_NAME) if (cell_dir / SUMMARY_NAME).exists() else None
    # A cell that failed before sending anything has no records: that is empty. A records file that exists but
    # cannot be read is an error naming it (RecordsError), never an empty cell.
    has_records = (cell_dir / PARQUET_NAME).exists() or (cell_dir / JSONL_NAME).exists()
    req = read_records(cell_dir) if has_records else pd.DataFrame()
    met = _read_metrics(cell_dir / "server_metrics.parquet")
    for df in (req, met):
        if len(df) or len(df.columns):
            df["cell"] = name
            df["server"], df["workload"], df["load"], df["repeat"] = (entry.server, entry.workload, entry.load,
                                                                      entry.repeat)
    return req, met, summary


def _load_name(run_manifest: ManifestFile | None) -> str:
    """A single run's load level as an experiment names it (`c4`, `r0.5`), or `trace` (the trace's timing)."""
    options = run_manifest.options if run_manifest is not None else {}
    if options.get("concurrency"):
        return f"c{options['concurrency']}"
    if options.get("session_rate"):
        return f"r{options['session_rate']:g}"
    return "trace"


def _single_run_experiment(root: Path, run_manifest: ManifestFile | None) -> ExperimentFile:
    """A replay run directory described as an experiment of one cell, named after the directory, whose one
    workload is called `trace`; its server's facts are added from summary.json once it is read."""
    name = root.name
    server_conf = run_manifest.server_config if run_manifest is not None else None
    model_path = server_conf.get("model") if server_conf else None
    return ExperimentFile[ExperimentSpecCore](
        experiment=name, run_id=name, spec=ExperimentSpecCore(name=name), spec_path="",
        created_at=run_manifest.started_at if run_manifest is not None else 0.0,
        kvscope_version=run_manifest.kvscope_version if run_manifest is not None else "unknown",
        model=ModelEntry(path=str(model_path), tokenizer=str(model_path), card=None, weights_random=False)
        if model_path else None,
        cells={name: CellEntry(server=name, workload="trace", load=_load_name(run_manifest), repeat=0,
                               status="ok", dir=".")},
        traces={"trace": run_manifest.trace.path} if run_manifest is not None else {})


def load_results(path: str | Path) -> ExperimentResults:
    """Load an experiment run directory (`experiment.json`) or a single replay run (`summary.json`)."""
    root = Path(path)
    run_manifest: ManifestFile | None = None
    single_run = not (root / EXPERIMENT_NAME).exists()
    if not single_run:
        experiment = load_experiment_file(root / EXPERIMENT_NAME)
    elif (root / SUMMARY_NAME).exists() or (root / "requests.jsonl").exists():
        run_manifest = load_run_manifest(root / MANIFEST_NAME) if (root / MANIFEST_NAME).exists() else None
        experiment = _single_run_experiment(root, run_manifest)
    else:
        raise KvscopeError(f"{root}: not an experiment run (experiment.json) or a replay run (summary.json)")
    req_frames, met_frames, rows = [], [], []
    summaries: dict[str, Any] = {}
    dirs: dict[str, Path] = {}
    for name, entry in experiment.cells.items():
        cdir = root / entry.dir if entry.dir else root / "cells" / name
        dirs[name] = cdir
        summary = None
        if cdir.exists():
            req, met, summary = _load_cell(cdir, name, entry)
            if len(req):
                req_frames.append(req)
            if len(met):
                met_frames.append(met)
        if summary is not None:
            summaries[name] = summary
            rows.append(_summary_row(name, entry, summary))
        else:  # no summary (a failed or interrupted cell)
            rows.append({"cell": name, "server": entry.server, "workload": entry.workload, "load": entry.load,
                         "repeat": entry.repeat, "status": entry.status, "reason": entry.reason})
    if single_run:  # the run's one server, as the experiment's servers block records it
        config = run_manifest.server_config if run_manifest is not None else None
        for name, s in summaries.items():
            experiment.servers[name] = ServerEntry(config=config or {}, log="",
                                                   facts=s.server_facts[0] if s.server_facts else None)
    cells = pd.DataFrame(rows)
    requests = pd.concat(req_frames, ignore_index=True) if req_frames else pd.DataFrame()
    metrics = pd.concat(met_frames, ignore_index=True) if met_frames else pd.DataFrame()
    return ExperimentResults(root=root, experiment=experiment, cells=cells, requests=requests, metrics=metrics,
                             summaries=summaries, cell_dirs=dirs, run_manifest=run_manifest,
                             single_run=single_run)
