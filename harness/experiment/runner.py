"""Run an experiment: every cell (server configuration × workload × load × repeat), then the load sweeps.

Layout of one run (`results/<experiment>/<run-id>/`):
    experiment.json            manifest: spec, model, servers (config, facts, log, restarts), cells + status,
                               cell order, capacities (one per sweep, each with the predicted one)
    traces/<workload>/         the generated traces (one per workload, shared by every cell)
    servers/<server>.log       vLLM log of each configuration
    cells/<server>__<workload>__<load>__r<k>/   a replay run directory (requests.parquet, summary.json, …)
    cells/<server>__<workload>__sweep-c<n>__r0/ a sweep level's cell
    calibrations/<server>.json a swept configuration's step-cost calibration (sweep.predict)
    predictions/<config>/<workload>/prediction.json   a predicted GPU deployment (spec `predicted:`)

Each server configuration is a serving backend (kvscope.harness.serving.backend): vLLM, launched by kvscope,
or an OpenAI-compatible endpoint it only attaches to. Cells run repeat-major (see `plan_cells`); with
``servers_up: all`` every configuration's server stays up once started so the arms interleave without
restarts, with ``one`` a server is stopped before the next configuration's starts. Before every cell a few
warm-up requests, then the prefix cache is emptied through the backend (vLLM: `/reset_prefix_cache` in dev
mode; a restart if that fails), so every cell starts from the same state and predictions stay exact;
``between_repeats: restart`` also starts a fresh process for each new repeat. A cell that fails is recorded
with its reason and the experiment goes on; a server that died is restarted for the next cell. After the grid,
each sweep (kvscope.harness.experiment.sweep) runs level by level until its ceiling, and its capacity is
recorded, with the scheduler model's predicted curve from a calibration taken just before the sweep. `--resume` skips cells whose status is `ok`; `--cells` runs only the named grid cells (no sweep).

Executors: `prepare_run` (manifest, model, traces, the cells to do) and `finish_run` are shared, and
`run_configurations` is the one cell loop. The local executor (`run_experiment`) calls it once for every
configuration; the Ray executor (`ray_executor.py`) once per configuration inside that configuration's actor,
with a `RunContext` whose `save`/`cell_finished` stream progress and files to the driver, and whose `replay`
runs the replay on a client node where the spec names one.
"""

from __future__ import annotations

import shutil
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from kvscope.harness.analysis.capacity import SHORTFALL_TOLERANCE
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.common.runlock import RunDirLock, lock_run_dir
from kvscope.harness.common.secrets import redact_config
from kvscope.harness.common.version import kvscope_version
from kvscope.harness.experiment.predicted import predict_configurations
from kvscope.harness.experiment.spec import (
    SERVES_FIELD,
    ExperimentSpec,
    ModelSpec,
    check_name,
    load_experiment_spec,
    server_backend,
    sweep_level,
)
from kvscope.harness.experiment.sweep import (
    cell_load_figures,
    plan_sweeps,
    point_from_cell,
    predict_sweep,
    predicted_curve,
    prediction_skipped,
    sweep_speculation,
)
from kvscope.harness.experiment.workload_traces import write_workload_trace
from kvscope.harness.model.tinymodel import build_tiny_model, read_model_card
from kvscope.harness.replay.calibrate import calibrate_server
from kvscope.harness.replay.failure import replay_failure_reason
from kvscope.harness.replay.runner import replay
from kvscope.harness.results.loaders import load_calibration, load_experiment_file, write_result_file
from kvscope.harness.results.schemas import (
    CapacityEntry,
    CellEntry,
    CellHeadline,
    ExecutorEntry,
    ExperimentFile,
    ModelEntry,
    ServerEntry,
)
from kvscope.harness.results.summary import ServerFacts, summary_file_model
from kvscope.harness.serving.tls import tls_context

if TYPE_CHECKING:
    from kvscope.harness.serving.backend import Backend

MANIFEST = "experiment.json"


@dataclass(frozen=True)
class Cell:
    server: str
    workload: str
    load: str
    repeat: int

    @property
    def name(self) -> str:
        return f"{self.server}__{self.workload}__{self.load}__r{self.repeat}"


def plan_cells(spec: ExperimentSpec) -> list[Cell]:
    """The grid's cells in the order they run: repeat-major, so the arms interleave (A B A B …) and drift over
    the run spreads over every configuration and workload. With ``servers_up: one`` a configuration's cells
    stay together (one server up at a time): repeats interleave within it, configurations do not."""
    grid = [(s, w, lv.name or "") for s in spec.servers for w, ref in spec.workloads.items() if not ref.sweep_only
            for lv in spec.loads]
    if spec.servers_up == "one":
        return [Cell(s, w, lv, r) for server in spec.servers for r in range(spec.repeats.max)
                for (s, w, lv) in grid if s == server]
    return [Cell(s, w, lv, r) for r in range(spec.repeats.max) for (s, w, lv) in grid]


def describe_plan(spec: ExperimentSpec) -> str:
    """How cells are ordered and servers kept, and what it costs: `kvscope experiment cells` prints it and
    experiment.json records it."""
    n = len(spec.servers)
    if spec.servers_up == "all":
        order = (f"repeat-major: repeat r of every configuration x workload x load, then r+1 (A B A B …); all {n} "
                 f"server configuration(s) stay up once started (one process each, idle while another runs: "
                 "memory for all of them, no restarts)")
    else:
        order = (f"one server at a time ({n} start(s)): each configuration's cells repeat-major within it; "
                 "configurations are not interleaved, so drift between them reads as a difference")
    reset = ("prefix cache reset before every cell" if spec.between_repeats == "reset"
             else f"prefix cache reset before every cell, fresh server process before each repeat "
                  f"(~{n * max(spec.repeats.max - 1, 0)} extra start(s))")
    text = f"order: {order}; {reset}"
    rep = spec.repeats
    if rep.stop_early:
        text += (f"; up to {rep.max} repeats, looking from repeat {rep.first_look} on: a workload x load group "
                 f"stops once every configuration's verdicts against {rep.baseline or next(iter(spec.servers))} on "
                 f"{', '.join(rep.metrics)} are decided ({rep.spending} alpha spending, alpha {rep.alpha:g})")
    if spec.sweep is not None:
        sw = spec.sweep
        levels = ", ".join(f"{x:g}" for x in sw.levels)
        if sw.plan == "predicted":
            how = (f"; predicted: measures the unloaded level, the last level the scheduler model's curve passes, "
                   f"its edge and one above, then up to {sw.max_bisections} more toward the measured edge and "
                   "one past it (the ladder where the model cannot predict)")
        elif sw.adaptive:
            how = f"; adaptive: stops at the first failing level, then up to {sw.max_bisections} bisection(s)"
        else:
            how = "; every level"
        text += (f"; then a {sw.kind} sweep over [{levels}] per configuration x workload "
                 f"(TTFT p90 <= {_slo_plan_text(sw)}, no preemption{how})")
    return text


def safe_child(root: Path, *parts: str) -> Path:
    """A path under root built from names; refuses anything that would land outside it."""
    root = root.resolve()
    p = root.joinpath(*parts).resolve()
    if p != root and root not in p.parents:
        raise KvscopeError(f"refusing path {p}: outside {root}")
    return p


def _write_json(path: Path, manifest: ExperimentFile[ExperimentSpec]) -> None:
    """experiment.json: validated again as ExperimentFile (the full spec model; the cell loop changes the
    model's fields in place, which pydantic does not check) and written atomically."""
    write_result_file(path, ExperimentFile[ExperimentSpec], manifest.model_dump(mode="json"))


def _resolve_run_dir(spec: ExperimentSpec, out: Path, run_id: str | None, resume: bool) -> Path:
    exp_root = safe_child(out, spec.name)
    if run_id is None and resume:
        runs = sorted(p for p in exp_root.glob("*") if (p / MANIFEST).exists()) if exp_root.exists() else []
        if not runs:
            raise KvscopeError(f"--resume: no earlier run of {spec.name} under {exp_root}")
        return runs[-1]
    if run_id is not None and resume and not (exp_root / run_id / MANIFEST).exists():
        known = sorted(p.name for p in exp_root.glob("*") if (p / MANIFEST).exists()) if exp_root.exists() else []
        raise KvscopeError(f"--resume --run-id {run_id}: no such run of {spec.name} under {exp_root}; "
                           f"known runs: {', '.join(known) or 'none'}")
    if run_id is None:
        run_id = time.strftime("%Y%m%d-%H%M%S")

    try:
        check_name(run_id, "run id")
    except ValueError as exc:
        raise KvscopeError(str(exc)) from exc
    return safe_child(exp_root, run_id)


def prepare_model(spec: ExperimentSpec, base_dir: Path) -> tuple[str, str, dict | None]:
    """(model for vLLM, tokenizer dir for workloads, build card or None)."""
    return _prepare_one(spec.model, base_dir, "model")


def _prepare_one(m: ModelSpec, base_dir: Path, what: str) -> tuple[str, str, dict | None]:
    """One model configuration (``model:`` or an entry of ``models:``, named ``what`` in errors): built
    (tiny), checked (path) or taken as a hub id (hf)."""
    if m.source == "hf":
        if not m.tokenizer:
            raise KvscopeError(f"{what}.source hf needs {what}.tokenizer: a local directory with tokenizer.json "
                               "(e.g. the snapshot in your Hugging Face cache) to generate token-exact workloads")
        tok = Path(m.tokenizer).expanduser()
        if not (tok / "tokenizer.json").is_file():
            raise KvscopeError(f"{what}.tokenizer {tok}: no tokenizer.json there (point it at the model's snapshot "
                               "folder in your Hugging Face cache, or a local copy)")
        return m.path, str(tok), None
    path = Path(m.path)
    if not path.is_absolute():
        path = (base_dir / path).resolve()
    if m.source == "tiny":
        card = read_model_card(path)
        wanted = {"seed": m.seed, "train_steps": m.train_steps}
        if card is None or any(card.get(k) != v for k, v in wanted.items()) or (card.get("size") or "small") != m.size:
            print(f"building the tiny model in {path} ({m.size}, seed {m.seed}, {m.train_steps} training steps) …",
                  flush=True)
            build_tiny_model(path, seed=m.seed, train_steps=m.train_steps, size=m.size)
    elif not (path / "config.json").is_file():
        raise KvscopeError(f"{what}.path {path}: not a model directory (no config.json)")
    tokenizer = str(Path(m.tokenizer).expanduser()) if m.tokenizer else str(path)
    return str(path), tokenizer, read_model_card(path)


def prepare_served_models(spec: ExperimentSpec, base_dir: Path, tokenizer_dir: str) -> dict[str, str]:
    """The ``models:`` entries some configuration ``serves:``, prepared: name → path for vLLM. Each must share
    ``model:``'s tokenizer (the workloads' token ids are generated with it, and a model with another vocabulary
    would read them as other text)."""
    served = {(entry or {}).get(SERVES_FIELD) for entry in spec.servers.values()} - {None}
    want = Path(tokenizer_dir) / "tokenizer.json"
    out = {}
    for name in sorted(served):
        path, tok, _ = _prepare_one(spec.models[name], base_dir, f"models.{name}")
        if want.is_file() and (Path(tok) / "tokenizer.json").is_file() and \
                (Path(tok) / "tokenizer.json").read_bytes() != want.read_bytes():
            raise KvscopeError(f"models.{name}: its tokenizer ({tok}) differs from model:'s ({tokenizer_dir}); "
                               "served models must share the workloads' tokenizer (same tiny seed, or the same "
                               "model family)")
        out[name] = path
    return out


def _warm_up(backend: "Backend", model: str, facts: ServerFacts | None, extra_requests: int, seed: int,
             max_pool_tokens: int = 262_144, fill_pool: bool = True) -> int:
    """Unrelated requests before a cell, enough to write every KV block once (``fill_pool``), then a few more.

    The first use of each KV block (page faults on CPU, lazy allocations) and of each code path is slower;
    without this the first cell on a fresh server measures warm-up, and two runs of one configuration differ.
    Once a process has written its whole pool the pages stay resident (a paused server's too), so its later
    cells send only the ``extra_requests`` (the code paths, and a server just continued from SIGSTOP).
    Returns the number of requests sent; a refused request (HTTP 401 for a missing key, …) fails the cell.
    The prefix cache is reset afterwards by the caller.
    """
    import httpx  # deferred: httpx is heavy, only talking to a server needs it

    rng = np.random.default_rng(10_000 + seed)
    capacity = (facts.kv_capacity_tokens if facts is not None else None) or 0
    prompt_len = max(16, min(((facts.max_model_len if facts is not None else None) or 2048) - 16, 2048))
    n = (-(-min(capacity, max_pool_tokens) // prompt_len) if fill_pool else 0) + extra_requests
    sent = 0
    with httpx.Client(timeout=300, headers=backend.auth_headers(), verify=tls_context()) as client:
        for _ in range(n):
            prompt = rng.integers(1000, 4000, size=prompt_len).tolist()
            body = {"model": model, "prompt": prompt, "max_tokens": 4, **backend.request_extras(None)}
            try:
                r = client.post(backend.endpoint + "/v1/completions", json=body)
            except httpx.HTTPError:
                break
            if r.status_code != 200:
                raise KvscopeError(f"warm-up request to {backend.endpoint}/v1/completions answered HTTP "
                                   f"{r.status_code}: {r.text[:200]}")
            sent += 1
    return sent


def _cell_options(spec: ExperimentSpec, cell: Cell, loads: dict, model: str, run_dir: Path | None = None):
    """A cell's replay options; the server's calibration (a sweep's, ``calibrations/<server>.json``) where one
    was taken, so a cell whose requests overlap records the scheduler model's predictions."""
    lv = loads[cell.load]
    cal = safe_child(run_dir, "calibrations", f"{cell.server}.json") if run_dir is not None else None
    return spec.replay.cell_options(
        concurrency=lv.concurrency, session_rate=lv.session_rate, slo_ttft_ms=spec.slo.ttft_ms,
        slo_tpot_ms=spec.slo.tpot_ms, seed=cell.repeat, model=model, progress=False,
        reset_prefix_cache=False, calibration=str(cal) if cal is not None and cal.is_file() else None)


def _model_name(backend: "Backend", spec: ExperimentSpec) -> str:
    return backend.served_model_name() or spec.model.served_model_name


@dataclass
class RunContext:
    """What every cell of one experiment run shares, and where its progress goes.

    The local executor saves experiment.json itself; a remote executor's worker overrides `save` (send the
    manifest's changes to the driver, which alone writes experiment.json) and `cell_finished` (ship the cell's
    files back), so the cell loop below is the same code under both executors.
    """

    spec: ExperimentSpec
    run_dir: Path
    manifest: ExperimentFile[ExperimentSpec]  # experiment.json as the run builds it
    manifest_path: Path
    model_path: str
    #: Wall seconds per phase of this process's work (model, traces, servers, grid, sweep), printed at the
    #: end (`phase_report`): where a slow machine's hour goes. Not recorded: a resumed run times only its part.
    phases_s: dict[str, float] = field(default_factory=dict)
    #: the driver's hold on run_dir (None in a Ray worker, which writes under the driver's lock)
    run_lock: RunDirLock | None = None
    #: prepared paths of the ``models:`` that configurations serve (``serves:``), by name
    model_paths: dict[str, str] = field(default_factory=dict)

    def timed(self, phase: str, since: float) -> None:
        self.phases_s[phase] = self.phases_s.get(phase, 0.0) + time.perf_counter() - since

    def save(self) -> None:
        _write_json(self.manifest_path, self.manifest)

    def cell_finished(self, cell_name: str) -> None:
        """Called after a cell ended (ok or failed), before the manifest saying so is saved."""

    def replay(self, trace_dir: Path, out_dir: Path, options: Any, backend: "Backend") -> Any:
        """Replay one trace against the backend into `out_dir` (a ReplayOutcome): here, in this process. The
        Ray executor's worker replays from another node instead where the spec names a client node."""
        return replay(trace_dir, out_dir, options, backends=[backend])


@dataclass
class PreparedRun:
    """A run after the prologue both executors share: manifest opened (or resumed), model and traces ready."""

    run: RunContext
    cells: list[Cell]  # the planned grid cells (after --cells)
    todo: list[Cell]  # those not ok yet
    only_cells: list[str] | None


def prepare_run(spec_path: str | Path, out: str | Path = "results", run_id: str | None = None,
                resume: bool = False, only_cells: list[str] | None = None) -> PreparedRun:
    """Validate the spec, open (or resume) the run directory and its manifest, prepare the model, generate the
    traces, and list the cells still to run: everything before the first server starts."""
    spec_path = Path(spec_path)
    spec, _ = load_experiment_spec(spec_path)
    if only_cells:
        _check_cells_exist(spec, only_cells)
    run_dir = _resolve_run_dir(spec, Path(out), run_id, resume)
    run_lock = lock_run_dir(run_dir, "kvscope experiment run")  # one writer per run (common/runlock.py)
    manifest = _open_manifest(spec, spec_path, run_dir, resume)
    t0 = time.perf_counter()
    model_path, tokenizer_dir, card = prepare_model(spec, Path.cwd())
    model_paths = prepare_served_models(spec, Path.cwd(), tokenizer_dir)
    model_s = time.perf_counter() - t0
    manifest.model = ModelEntry(path=model_path, tokenizer=tokenizer_dir, card=card,
                                weights_random=bool(card and card.get("weights") == "random"))
    manifest.kvscope_version = kvscope_version()
    run = RunContext(spec, run_dir, manifest, run_dir / MANIFEST, model_path, run_lock=run_lock,
                     model_paths=model_paths)
    run.phases_s["model"] = model_s
    cells = plan_cells(spec)
    if only_cells:
        cells = [c for c in cells if c.name in only_cells]
    for c in cells:
        manifest.cells.setdefault(c.name, CellEntry(server=c.server, workload=c.workload, load=c.load,
                                                    repeat=c.repeat, status="pending"))
    run.save()
    t0 = time.perf_counter()
    _generate_traces(run, spec_path, tokenizer_dir)
    run.timed("traces", t0)
    todo = [c for c in cells if manifest.cells[c.name].status != "ok"]
    manifest.cell_order = describe_plan(spec)
    print(f"{len(cells)} cells, {len(todo)} to run", flush=True)
    return PreparedRun(run, cells, todo, only_cells)


def finish_run(run: RunContext) -> None:
    """Predict the spec's GPU deployments (``predicted:``) on the run's traces, then stamp completion and the
    failed cells (every cell not ok, whichever executor ran it)."""
    if run.spec.predicted is not None:
        t0 = time.perf_counter()
        for line in predict_configurations(run.spec, run.run_dir, Path(run.manifest.spec_path),
                                           run.manifest.model.tokenizer):
            print(line, flush=True)
        run.timed("predict", t0)
    run.manifest.completed_at = time.time()
    run.manifest.failed_cells = [n for n, c in run.manifest.cells.items() if c.status not in ("ok", "skipped")]
    run.save()
    if run.run_lock is not None:
        run.run_lock.release()


def run_experiment(spec_path: str | Path, out: str | Path = "results", run_id: str | None = None,
                   resume: bool = False, only_cells: list[str] | None = None, progress: bool = True,
                   after_cell: Callable[[Cell, Any], None] | None = None,
                   phases_s: dict[str, float] | None = None) -> Path:
    """Run (or resume) an experiment on this host; returns the run directory. ``phases_s``, where given, is
    filled with the wall seconds of each phase (:func:`phase_report` prints them).

    ``after_cell(cell, server)`` is called after each cell with the launched server (the backend where kvscope
    launched none); tests use it to inject faults between cells. `kvscope.harness.experiment.ray_executor`
    runs the same cells across a Ray cluster.
    """
    prepared = prepare_run(spec_path, out, run_id, resume, only_cells)
    run = prepared.run
    if phases_s is not None:
        phases_s.update(run.phases_s)
        run.phases_s = phases_s
    run.manifest.executor = ExecutorEntry(kind="local")
    run_configurations(run, prepared.todo, list(run.spec.servers), with_sweeps=not only_cells,
                       after_cell=after_cell)
    finish_run(run)
    return run.run_dir


def phase_report(phases_s: dict[str, float]) -> str:
    """``phases: model 41 s, traces 1 s, servers 84 s, grid 6.1 min, sweep 5.0 min (total 12.9 min)``."""
    def fmt(s: float) -> str:
        return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"

    return ("phases: " + ", ".join(f"{k} {fmt(v)}" for k, v in phases_s.items())
            + f" (total {fmt(sum(phases_s.values()))})")


def run_configurations(run: RunContext, cells: list[Cell], server_names: list[str], with_sweeps: bool,
                       after_cell: Callable[[Cell, Any], None] | None = None) -> None:
    """The cell loop: `cells` in the order given (plan order), then the sweeps of `server_names`.

    The one implementation of "run these configurations' cells": the local executor calls it once with every
    configuration (so the arms interleave A B A B on one host), the Ray executor once per configuration in
    that configuration's actor, with the same cells in the same order.
    """
    servers = _Servers(run)
    try:
        if run.spec.servers_up == "all":
            swept = [sw.server for sw in plan_sweeps(run.spec) if sw.server in server_names] if with_sweeps else []
            t0 = time.perf_counter()
            servers.start_together([c.server for c in cells] + swept)
            run.timed("servers", t0)
        # deferred: it loads scipy, which importing this module must not
        from kvscope.harness.experiment.stopping import early_stop_for

        stop = early_stop_for(run, server_names)
        t0 = time.perf_counter()
        for cell in cells:
            if stop is not None and stop.skip(cell):
                run.save()
                continue
            if run.spec.servers_up == "one":
                servers.stop_all_but(cell.server)
            _run_one(run, servers, cell, after_cell)
            if stop is not None:
                stop.after_cell(cell)
        run.timed("grid", t0)
        if with_sweeps:
            t0 = time.perf_counter()
            _run_sweeps(run, servers, after_cell, server_names)
            run.timed("sweep", t0)
    finally:
        servers.stop_all()
        run.save()


def _check_cells_exist(spec: ExperimentSpec, only_cells: list[str]) -> None:
    """`--cells` names only cells the spec plans (a typo would otherwise run nothing and exit 0)."""
    known = [c.name for c in plan_cells(spec)]
    unknown = [n for n in only_cells if n not in known]
    if unknown:
        shown = ", ".join(known[:20]) + (f", … ({len(known)} in all: kvscope experiment cells SPEC)"
                                         if len(known) > 20 else "")
        raise KvscopeError(f"--cells: unknown cell(s) {', '.join(unknown)}; known cells: {shown}")


def _open_manifest(spec: ExperimentSpec, spec_path: Path, run_dir: Path,
                   resume: bool) -> ExperimentFile[ExperimentSpec]:
    """The run's experiment.json (an earlier one on --resume, validated); the validated spec with its defaults is
    recorded, secrets redacted."""
    manifest_path = run_dir / MANIFEST
    if manifest_path.exists():
        if not resume:
            raise KvscopeError(f"{run_dir} already holds a run; use --resume to finish it or a new --run-id")

        return load_experiment_file(manifest_path, ExperimentSpec)
    return ExperimentFile[ExperimentSpec].model_validate(
        {"experiment": spec.name, "run_id": run_dir.name, "spec": redact_config(spec.model_dump(mode="json")),
         "spec_path": str(spec_path), "created_at": time.time()})


def _generate_traces(run: RunContext, spec_path: Path, tokenizer_dir: str) -> None:
    """One trace per workload, generated once (kept across --resume)."""
    spec = run.spec
    for wname in spec.workloads:
        tdir = safe_child(run.run_dir, "traces", wname)
        if not (tdir / "requests.parquet").exists():
            print(f"generating workload {wname} ({spec.workloads[wname].spec}) …", flush=True)

            write_workload_trace(spec, wname, spec_path, tokenizer_dir, tdir)
        run.manifest.traces[wname] = str(tdir.relative_to(run.run_dir))
    run.save()


class _Servers:
    """The experiment's backends by configuration name: started on first use, restarted when one died or a new
    repeat asks for a fresh process (``between_repeats: restart``), stopped at the end."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.backends: dict[str, "Backend"] = {}
        self.last_repeat: dict[str, int] = {}
        self.failed: dict[str, Exception] = {}  # a start_together failure, until the configuration's next get
        #: configurations whose current process has had its whole KV pool written by a warm-up (`_warm_up`)
        self.pool_written: set[str] = set()

    def _record(self, name: str) -> ServerEntry:
        log_path = safe_child(self.run.run_dir, "servers", f"{name}.log")
        return self.run.manifest.servers.setdefault(
            name, ServerEntry(config={}, log=str(log_path.relative_to(self.run.run_dir))))

    def log_path(self, name: str) -> Path:
        return safe_child(self.run.run_dir, "servers", f"{name}.log")

    def start_together(self, names: list[str]) -> None:
        """Launch every named configuration's server not yet up, then wait for them in turn: the starts
        overlap (most of a vLLM start is three processes importing torch and vLLM, one core each). A start
        that fails is raised by the first `get` of that configuration, so its first cell records why."""
        launched = []
        for name in dict.fromkeys(names):
            if name in self.backends:
                continue
            srec = self._record(name)
            try:
                backend = self._new_backend(name, srec)  # from here on stop_all stops it, interrupted or not
                _launch_server(backend, name, self.log_path(name), " (with the other configurations)")
            except Exception as exc:  # noqa: BLE001 - recorded by the configuration's first cell
                self.backends.pop(name, None)
                self.failed[name] = exc
                continue
            launched.append((name, backend, srec))
        for name, backend, srec in launched:
            try:
                _server_ready(backend, srec)
            except Exception as exc:  # noqa: BLE001 - recorded by the configuration's first cell
                self.backends.pop(name).stop()
                self.failed[name] = exc

    def _new_backend(self, name: str, srec: ServerEntry) -> "Backend":
        backend = self.backends[name] = server_backend(self.run.spec, name, self.run.model_path,
                                                       model_paths=self.run.model_paths)
        srec.backend, srec.config = backend.name, backend.redacted_config()
        return backend

    def get(self, name: str, repeat: int) -> "Backend":
        if name in self.failed:
            raise self.failed.pop(name)
        if self.run.spec.idle_servers == "pause":  # the others freeze; this one continues
            for other, backend in self.backends.items():
                if other != name:
                    backend.pause()
            if name in self.backends:
                self.backends[name].resume()
        srec = self._record(name)
        backend = self.backends.get(name)
        fresh = self.run.spec.between_repeats == "restart" and self.last_repeat.get(name, repeat) != repeat
        if backend is None:
            self.pool_written.discard(name)
            backend = self._new_backend(name, srec)
            _start_server(backend, name, self.log_path(name), srec)
        elif fresh or not backend.is_running():
            self.pool_written.discard(name)
            srec.restarts += 1
            backend.stop()
            _start_server(backend, name, self.log_path(name), srec)
        self.last_repeat[name] = repeat
        return backend

    def stop_all_but(self, keep: str) -> None:
        for name in [n for n in self.backends if n != keep]:
            self.backends.pop(name).stop()

    def stop_all(self) -> None:
        for name in list(self.backends):
            self.backends.pop(name).stop()


def _run_one(run: RunContext, servers: _Servers, cell: Cell, after_cell: Callable[[Cell, Any], None] | None,
             level: Any = None) -> None:
    """One cell against its configuration's server; a failure is recorded and the experiment goes on."""
    entry = run.manifest.cells[cell.name]
    entry.status, entry.started_at, entry.reason = "running", time.time(), None
    run.save()
    backend = None
    try:
        t0 = time.perf_counter()
        backend = servers.get(cell.server, cell.repeat)
        srec = run.manifest.servers[cell.server]
        restarts = srec.restarts
        _run_cell(run, cell, backend, srec, servers.log_path(cell.server), level,
                  switch_s=time.perf_counter() - t0, fill_pool=cell.server not in servers.pool_written)
        if srec.restarts == restarts:  # a reset that failed restarted the process: its pool is fresh again
            servers.pool_written.add(cell.server)
    except KeyboardInterrupt:
        entry.status, entry.reason = "interrupted", "interrupted"
        raise
    except Exception as exc:  # noqa: BLE001 - a failed cell is recorded and the experiment goes on
        entry.status, entry.reason = "failed", f"{exc.__class__.__name__}: {exc}".splitlines()[0][:500]
        entry.traceback = traceback.format_exc()[-2000:]
        print(f"[{cell.name}] FAILED: {entry.reason}", flush=True)
        if backend is None:  # it did not start: the next cell tries a fresh one
            servers.backends.pop(cell.server, None)
    finally:
        entry.ended_at = time.time()
        run.cell_finished(cell.name)
        run.save()
    if after_cell is not None and backend is not None:  # the launched process (VllmServer) where there is one
        after_cell(cell, getattr(backend, "server", None) or backend)


def _run_sweeps(run: RunContext, servers: _Servers, after_cell: Callable[[Cell, Any], None] | None,
                server_names: list[str]) -> None:
    """The sweeps of `server_names`, round-robin one level at a time, until each is done; then their
    capacities."""
    sweeps = [sw for sw in plan_sweeps(run.spec) if sw.server in server_names]
    if not sweeps:
        return
    calibrations = {name: _calibrate_for_sweep(run, servers, name, sweeps[0].spec)
                    for name in dict.fromkeys(sw.server for sw in sweeps)}
    for sw in sweeps:
        if sw.spec.plan == "predicted":
            _plan_sweep(run, sw, *calibrations[sw.server])
    cells = run.manifest.cells
    active = list(sweeps)
    while active:
        for sw in list(active):
            load = sw.next_load()
            if load is None:
                active.remove(sw)
                continue
            level = sweep_level(sw.spec.kind, load)
            cell = Cell(sw.server, sw.workload, level.name or "", 0)
            entry = cells.setdefault(cell.name, CellEntry(server=cell.server, workload=cell.workload,
                                                          load=cell.load, repeat=0, status="pending"))
            if entry.status != "ok":
                _run_one(run, servers, cell, after_cell, level)
            sw.record(point_from_cell(load, cells[cell.name]), cells[cell.name].reason)
            if sw.awaiting_speculation:
                _plan_speculative_sweep(run, sw, calibrations[sw.server], cells[cell.name])
    run.manifest.capacity = []
    for sw in sweeps:
        cap = sw.capacity()
        sentence = cap.sentence() + (f" (sweep stopped: {sw.stopped})" if sw.stopped else "")
        cal, cal_rel, skipped = calibrations[sw.server]
        predicted = _predict_sweep(run, sw, cal, cal_rel, skipped)
        entry = CapacityEntry.model_validate({**asdict(cap), "sentence": sentence, "predicted": predicted,
                                              "plan": sw.plan_record()})
        run.manifest.capacity.append(entry)
        print(f"capacity: {sentence}", flush=True)
        print(f"predicted: {entry.predicted.sentence or entry.predicted.skipped if entry.predicted else None}",
              flush=True)
        print(f"levels: {entry.plan.sentence}", flush=True)
    run.save()


def _slo_plan_text(sweep: Any) -> str:
    slo = sweep.ttft_slo
    if slo.unloaded_factor is None:
        return f"{slo.ms:g} ms"
    return f"{slo.text.removesuffix('_unloaded')} the lowest level's TTFT p90"


def _calibrate_for_sweep(run: RunContext, servers: _Servers, name: str, sweep: Any
                         ) -> tuple[Any, str | None, str | None]:
    """(calibration, its path relative to the run, why none) for one swept configuration: measured on its
    server, idle just before its first sweep level (each cell resets the prefix cache after), or read back on
    --resume. A failure is recorded as the reason and the sweep goes on without a prediction."""
    rel = f"calibrations/{name}.json"
    path = safe_child(run.run_dir, "calibrations", f"{name}.json")
    try:
        backend = servers.get(name, 0)
        why = prediction_skipped(sweep, speculative=backend.speculative_decoding(), speculation=backend.speculation())
        if why:
            return None, None, why
        if path.exists():
            return load_calibration(path), rel, None
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{name}] calibrating the scheduler model (a few dozen requests) …", flush=True)
        t0 = time.perf_counter()
        cal = calibrate_server(backend, path, client_priority_mode=run.spec.replay.client_priority)
        print(f"[{name}] calibrated in {time.perf_counter() - t0:.0f} s: {len(cal.samples)} samples, "
              f"R² {cal.fit_r2:.3f}", flush=True)
        return cal, rel, None
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - no prediction, the measured sweep goes on
        reason = f"calibration failed: {exc.__class__.__name__}: {exc}".splitlines()[0][:300]
        print(f"[{name}] {reason}", flush=True)
        return None, None, reason


def _plan_sweep(run: RunContext, sw: Any, cal: Any, cal_rel: str | None, skipped: str | None) -> None:
    """Give a ``plan: predicted`` sweep the scheduler model's curve, which chooses its levels; without one (no
    calibration, a poor fit, a model error) it climbs its ladder and records why."""
    if cal is None:
        sw.set_prediction(None, skipped or "no calibration")
    elif cal.server.speculation and sw.speculation is None:
        sw.awaiting_speculation = True  # the curve needs the answers the server generates: after the first level
        print(f"[{sw.server}] {sw.workload}: speculative decoding ({cal.server.speculation}): the curve is predicted "
              "from the drafts of the answers the first level generates", flush=True)
        return
    else:
        try:
            sw.set_prediction(predicted_curve(sw, run.run_dir / run.manifest.traces[sw.workload], cal,
                                              time_scale=run.spec.replay.time_scale, mode=run.spec.replay.mode))
        except Exception as exc:  # noqa: BLE001 - the ladder measures without a plan
            sw.set_prediction(None, f"prediction failed: {exc.__class__.__name__}: {exc}"[:300])
    if sw.planned:
        levels = ", ".join(f"{p.load:g}" for p in sw.predicted)
        print(f"[{sw.server}] {sw.workload}: predicted curve over concurrency {levels}; measuring the levels "
              "that decide the capacity", flush=True)
    else:
        print(f"[{sw.server}] {sw.workload}: no predicted curve ({sw.plan_note}); climbing the levels", flush=True)


def _plan_speculative_sweep(run: RunContext, sw: Any, calibration: tuple[Any, str | None, str | None],
                            entry: CellEntry) -> None:
    """A speculative sweep's first level is measured: its generated tokens give every request's drafts, and
    the curve planned from them chooses the rest; without them (a failed cell, records without token ids) the
    sweep climbs its ladder and records why."""
    sw.awaiting_speculation = False
    trace_dir = run.run_dir / run.manifest.traces[sw.workload]
    try:
        sw.speculation = (sweep_speculation(trace_dir, calibration[0], run.run_dir / entry.dir,
                                            mode=run.spec.replay.mode) if entry.status == "ok" and entry.dir else {})
    except Exception as exc:  # noqa: BLE001 - the ladder measures without a plan
        sw.speculation = {}
        print(f"[{sw.server}] drafts not computed: {exc.__class__.__name__}: {exc}"[:300], flush=True)
    if not sw.speculation:
        sw.set_prediction(None, "speculative decoding: the first level generated no tokens to compute the drafts from")
        print(f"[{sw.server}] {sw.workload}: no predicted curve ({sw.plan_note}); climbing the levels", flush=True)
        return
    _plan_sweep(run, sw, *calibration)


def _predict_sweep(run: RunContext, sw: Any, cal: Any, cal_rel: str | None, skipped: str | None) -> dict[str, Any]:
    if cal is None:
        return {"skipped": skipped or "no calibration"}
    try:
        if cal.server.speculation and sw.speculation is None and sw.order:  # a ladder: from its first level
            entry = run.manifest.cells.get(Cell(sw.server, sw.workload, sw.level_name(sw.order[0]), 0).name)
            if entry is not None and entry.status == "ok" and entry.dir:
                sw.speculation = sweep_speculation(run.run_dir / run.manifest.traces[sw.workload], cal,
                                                   run.run_dir / entry.dir, mode=run.spec.replay.mode)
        return predict_sweep(sw, run.run_dir / run.manifest.traces[sw.workload], cal, cal_rel or "",
                             time_scale=run.spec.replay.time_scale, mode=run.spec.replay.mode)
    except Exception as exc:  # noqa: BLE001 - the measured capacity stands without it
        return {"calibration": cal_rel, "skipped": f"prediction failed: {exc.__class__.__name__}: {exc}"[:300]}


def _start_server(backend: "Backend", server_name: str, log_path: Path, srec: ServerEntry) -> None:
    _launch_server(backend, server_name, log_path)
    _server_ready(backend, srec)


def _launch_server(backend: "Backend", server_name: str, log_path: Path, note: str = "") -> None:
    what = f"starting {backend.name}" if backend.managed else f"attaching to {backend.name} endpoint"
    print(f"[{server_name}] {what}{note} …", flush=True)
    backend.launch(log_path)


def _server_ready(backend: "Backend", srec: ServerEntry) -> None:
    """Wait for a launched server and record what it says about itself."""
    backend.finish_start()
    srec.facts = backend.facts()
    srec.ready_after_s = backend.ready_after_s


def _run_cell(run: RunContext, cell: Cell, backend: "Backend", srec: ServerEntry, log_path: Path,
              level: Any = None, switch_s: float = 0.0, fill_pool: bool = True) -> None:
    """Warm up (``fill_pool``: the process's first cell writes its whole KV pool), empty the prefix cache
    (restart if a managed server cannot), replay, record the headline.
    The console line ends with where the cell's time went (server switch, warm-up, reset, the replay's
    requests and its set-up and drain: compaction, summary, files)."""
    spec, entry = run.spec, run.manifest.cells[cell.name]
    loads = {lv.name: lv for lv in spec.loads}
    if level is not None:  # a sweep level, outside the grid's loads
        loads[level.name] = level
    model = _model_name(backend, spec)
    trace_dir = run.run_dir / run.manifest.traces[cell.workload]
    t0 = time.perf_counter()
    entry.warmup_requests = _warm_up(backend, model, srec.facts, spec.replay.warmup_requests,
                                        cell.repeat, fill_pool=fill_pool)
    if spec.replay.warmup_pass:
        scratch = safe_child(run.run_dir, "cells", f".warmup-{cell.name}")
        shutil.rmtree(scratch, ignore_errors=True)
        backend.reset_prefix_cache()
        run.replay(trace_dir, scratch, _cell_options(spec, cell, loads, model), backend)
        shutil.rmtree(scratch, ignore_errors=True)
    t1 = time.perf_counter()
    reset = backend.reset_prefix_cache()
    if not reset.ok and backend.managed:
        srec.restarts += 1
        backend.stop()
        backend.start(log_path)
        reset = type(reset)(True, "restarted (reset failed: " + reset.detail + ")")
    entry.prefix_cache_reset = reset.detail
    # an attached server that cannot reset: the replay asks again, so the warning and the summary's
    # cache_not_reset flag come from the one place that makes them (replay.servers.reset_prefix_caches)
    options = _cell_options(spec, cell, loads, model, run.run_dir).model_copy(
        update={"reset_prefix_cache": not reset.ok})
    cell_dir = safe_child(run.run_dir, "cells", cell.name)
    if cell_dir.exists():  # a half-written earlier attempt of this cell
        shutil.rmtree(cell_dir)
    print(f"[{cell.name}] replaying …", flush=True)
    t2 = time.perf_counter()
    outcome = run.replay(trace_dir, cell_dir, options, backend)
    replay_s = time.perf_counter() - t2
    s = summary_file_model().model_validate(outcome.summary)
    reason = outcome.aborted or replay_failure_reason(s.requests, spec.replay.max_error_share)
    head = _headline(s, cell_dir, loads[cell.load])
    entry.status, entry.reason, entry.headline = "failed" if reason else "ok", reason, head
    entry.dir = str(cell_dir.relative_to(run.run_dir))
    print(f"[{cell.name}] {entry.status}: {s.requests.ok} ok, hit "
          f"{_fmt(s.hit_rate.server_per_request)}, TTFT p50 {_ms(head.ttft_p50_s)} p90 "
          f"{_ms(head.ttft_p90_s)}, {_num(head.mean_sessions_in_flight)} sessions in flight"
          + (" (UNDER-DRIVEN)" if head.under_driven else "")
          + (f", {head.preemptions:g} preemptions" if head.preemptions else "")
          + f"; time: server {switch_s:.1f} s, warm-up {t1 - t0:.1f} s, reset {t2 - t1:.1f} s, requests "
            f"{s.duration_s:.1f} s, replay set-up and drain {replay_s - s.duration_s:.1f} s", flush=True)


def _headline(summary: Any, cell_dir: Path, level: Any) -> CellHeadline:
    """The cell's key figures in experiment.json, with the achieved concurrency and the preemptions."""
    in_flight, interval = cell_load_figures(cell_dir, interval=level.concurrency is not None)
    short = None
    if level.concurrency is not None and in_flight is not None:
        short = bool(in_flight < SHORTFALL_TOLERANCE * level.concurrency)
    deltas = summary.server_deltas  # the /metrics counters the watcher reconciled: an open block
    return CellHeadline(requests=summary.requests.sent, errors=summary.requests.failed,
                        hit_rate=summary.hit_rate.server_per_request, ttft_p50_s=summary.latency.ttft_s.p50,
                        ttft_p90_s=summary.latency.ttft_s.p90, req_per_s=summary.throughput.requests_per_s,
                        preemptions=float(deltas.get("num_preemptions") or 0) if deltas else 0.0,
                        mean_sessions_in_flight=in_flight, under_driven=short, ttft_p90_interval_s=interval)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


