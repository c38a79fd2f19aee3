"""Run an experiment's cells across a Ray cluster: one actor per server configuration (`--executor ray`).

Why this shape:

* **One actor per configuration.** A configuration is the unit that owns resources (its server's GPUs) and
  state (the running server, its restarts). The actor requests what the configuration needs — the
  `servers.<name>.resources` the spec names, else tensor x pipeline x data parallel size GPUs for a vLLM
  configuration (none on a cluster without GPUs) — so Ray places it on a node that has them; the actor starts
  the server there and replays from the same process, the client beside the server, so the network between
  nodes never enters the latencies. Configurations run in parallel; Ray is the scheduler, kvscope builds none.
* **Unless the spec names a client node** (`servers.<name>.client_resources`): then a second actor, placed by
  those resources, replays the cells against the server's endpoint, reached over the network (the server binds
  its node's IP). The cell loop is the same — only `RunContext.replay` differs: it sends the trace name, the
  replay options and how to attach to the server to the client actor, which replays into a scratch directory
  and returns the cell directory as a tar. Warm-up requests and the prefix-cache reset still go from the
  server's actor (they are not measured).
* **The same cell loop as a local run.** The actor calls `runner.run_configurations` with that
  configuration's cells in plan order (repeats interleaved within it, then its sweeps), through a
  `RunContext` whose `save` and `cell_finished` send progress to the driver instead of writing files.
* **The driver alone writes experiment.json.** Actors stream events back (a Ray streaming generator): the
  configuration's cell records after every change, and — where the actor does not see the driver's run
  directory — each finished cell's directory as a tar blob through the object store. The driver merges them,
  so the experiment directory is exactly what a local run writes, and `--resume` works across executors (a
  cell is skipped when its record is ok, whoever ran it).
* **A lost actor or node fails its configuration's remaining cells** with the reason (the same failed-cell
  record a failing server produces); the other configurations go on and the run completes.

Files: `executor.files` (or `--ray-files`) is `shared` (actors write the cells in place: a filesystem every
node mounts at the same path), `ship` (actors write to a scratch directory and ship each cell back) or `auto`
(shared where the actor finds the driver's token file in the run directory, ship elsewhere).
"""

from __future__ import annotations

import io
import os
import queue
import shutil
import tarfile
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit
import socket
import time

from kvscope.harness.common.errors import KvscopeError, ServerError
from kvscope.harness.results.schemas import CapacityEntry, ExecutorEntry, ManifestFile
from kvscope.harness.experiment.runner import (
    Cell,
    RunContext,
    finish_run,
    prepare_run,
    run_configurations,
    safe_child,
)
from kvscope.harness.experiment.spec import (
    ExperimentSpec,
    ResourceMap,
    client_resources,
    server_backend,
    server_resources,
)
from kvscope.harness.experiment.sweep import plan_sweeps
from kvscope.harness.replay.runner import ReplayOutcome, replay
from kvscope.harness.results.loaders import load_run_manifest, write_result_file
from kvscope.harness.serving.backend import Backend

RAY_EXTRA_HINT = "--executor ray needs the ray extra: pip install 'kvscope[ray]'"
TOKEN_PREFIX = ".kvscope-executor-"

Event = dict[str, Any]


def import_ray() -> Any:
    """The `ray` module, or the one-line error that says how to install it."""
    try:
        import ray  # optional: ray may be absent, the ImportError is handled
    except ImportError as exc:
        raise KvscopeError(RAY_EXTRA_HINT) from exc
    return ray


# ------------------------------------------------------------------------------------------------ placement


def parallel_gpus(spec: ExperimentSpec, name: str) -> int:
    """GPUs one server of configuration `name` uses, as its backend counts them (vLLM: tensor x pipeline x
    data parallel size)."""
    return server_backend(spec, name, model_path="/placeholder").gpus_per_server()


def actor_options(spec: ExperimentSpec, name: str, cluster_has_gpus: bool) -> dict[str, Any]:
    """Ray actor options of configuration `name`: the resources it states, else the GPUs its server uses."""
    stated = server_resources(spec, name)
    if stated is None:
        managed = server_backend(spec, name, model_path="/placeholder").managed
        return {"num_cpus": spec.executor.actor_cpus, "resources": {},
                "num_gpus": parallel_gpus(spec, name) if managed and cluster_has_gpus else 0}
    return _ray_options(stated, spec.executor.actor_cpus)


def client_actor_options(spec: ExperimentSpec, name: str) -> dict[str, Any] | None:
    """Ray actor options of the client that replays configuration `name`'s cells from another node, or None:
    the client runs beside the server, in the configuration's actor."""
    stated = client_resources(spec, name)
    return None if stated is None else _ray_options(stated, spec.executor.actor_cpus)


def _ray_options(stated: ResourceMap, default_cpus: float) -> dict[str, Any]:
    """A resource map as Ray options: `CPU` and `GPU` are Ray's own, any other name a custom resource."""
    opts: dict[str, Any] = {"num_cpus": default_cpus, "num_gpus": 0, "resources": {}}
    for key, amount in stated.items():
        if key == "CPU":
            opts["num_cpus"] = amount
        elif key == "GPU":
            opts["num_gpus"] = amount
        else:
            opts["resources"][key] = amount
    return opts


def _fits_some_node(ray: Any, opts: dict[str, Any]) -> bool:
    wanted = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"], **opts["resources"]}
    for node in ray.nodes():
        have = node.get("Resources", {}) if node.get("Alive") else {}
        if all(amount <= 0 or have.get(key, 0) >= amount for key, amount in wanted.items()):
            return True
    return False


# ------------------------------------------------------------------------------------------------ file blobs


def pack_dir(path: Path) -> bytes:
    """A directory as an uncompressed tar (parquet is compressed already)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(path, arcname=".")
    return buf.getvalue()


def unpack_dir(blob: bytes, dest: Path) -> None:
    """Replace `dest` with the tar's contents; the `data` filter refuses links and paths outside it."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        tar.extractall(dest, filter="data")


# ------------------------------------------------------------------------------------------------ the actor


@dataclass
class WorkerPayload:
    """What a configuration's actor needs: the spec, the manifest as the driver holds it, and its cells."""

    spec: ExperimentSpec
    manifest: Any  # ExperimentFile[ExperimentSpec], as the driver holds it
    run_dir: str
    model_path: str
    server: str
    cells: list[Cell]
    with_sweeps: bool
    files: str  # auto | shared | ship
    token: str  # the file the driver wrote into run_dir: seen by the actor means a shared filesystem
    thread_env: dict[str, str | None] = field(default_factory=dict)  # the driver's THREAD_ENV values
    client: Any = None  # the ReplayClient actor where the spec names a client node; None: replay here


THREAD_ENV = ("OMP_NUM_THREADS",)
"""Ray sets OMP_NUM_THREADS to an actor's CPU reservation (1); the server the actor starts would inherit it and
measure differently from a local run, so the actor restores the driver's value (unset stays unset)."""


@dataclass
class _WorkerRun(RunContext):
    """A RunContext inside an actor: progress goes to the driver as events, files too where not shared."""

    server: str = ""
    ship: bool = False
    events: queue.Queue[Event | None] = field(default_factory=queue.Queue)
    client: Any = None  # a ReplayClient actor: the replays run there, against the server's reachable endpoint
    node_ip: str = "127.0.0.1"  # this actor's node, where the servers it starts listen
    client_where: Event = field(default_factory=dict)  # the client actor's node and pid (for a failure's reason)

    def replay(self, trace_dir: Path, out_dir: Path, options: Any, backend: Any) -> Any:
        if self.client is None:
            return super().replay(trace_dir, out_dir, options, backend)
        # deferred: ray is heavy, an optional install (kvscope[ray]), only the ray executor needs it
        import ray

        endpoint = client_endpoint(backend.endpoint, self.node_ip) if backend.managed else backend.endpoint
        attach = (backend.name, backend.config, endpoint, backend.api_key_env, backend.url_credentials)
        trace = trace_dir.relative_to(self.run_dir).as_posix()
        # The calibration's path is this node's: the client node's replay keeps the sequential prediction.
        options = options.model_copy(update={"calibration": None})
        try:
            result = ray.get(self.client.replay.remote(trace, out_dir.name, options, attach))
        except ray.exceptions.RayActorError as exc:  # the client's node or process is gone: the cell fails
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raise KvscopeError(f"Ray client actor of configuration {self.server} lost (node "
                               f"{self.client_where.get('node')}, actor pid {self.client_where.get('pid')}): "
                               f"{exc.__class__.__name__}: {first_line}") from exc
        unpack_dir(result["blob"], out_dir)
        _relocate_trace_path(out_dir, result["scratch"], self.run_dir)
        return ReplayOutcome(out_dir, result["summary"], result["aborted"])

    def save(self) -> None:
        cells = {n: c.model_copy(deep=True) for n, c in self.manifest.cells.items() if c.server == self.server}
        recorded = self.manifest.capacity  # None until a sweep ran (a run without sweeps keeps null)
        capacity = None if recorded is None else [c.model_copy(deep=True) for c in recorded if c.server == self.server]
        server = self.manifest.servers.get(self.server)
        self.events.put({"kind": "manifest", "cells": cells, "server": None if server is None else
                         server.model_copy(deep=True), "capacity": capacity})

    def cell_finished(self, cell_name: str) -> None:
        if not self.ship:
            return
        cell_dir = safe_child(self.run_dir, "cells", cell_name)
        if cell_dir.is_dir():
            self.events.put({"kind": "cell", "name": cell_name, "blob": pack_dir(cell_dir)})
        self._ship_log()

    def _ship_log(self) -> None:
        log = safe_child(self.run_dir, "servers", f"{self.server}.log")
        if log.is_file():
            self.events.put({"kind": "log", "blob": log.read_bytes()})


class ConfigurationWorker:
    """The Ray actor of one server configuration (wrapped with `ray.remote` by the driver)."""

    def run(self, payload: WorkerPayload, traces: list[Any]) -> Iterator[Event]:
        """Stream events while this configuration's cells run: node, manifest patches, shipped files."""
        # deferred: ray is heavy, an optional install (kvscope[ray]), only the ray executor needs it
        import ray

        shared_seen = (Path(payload.run_dir) / payload.token).is_file()
        if payload.files == "shared" and not shared_seen:
            raise KvscopeError(f"executor.files shared: {payload.run_dir} is not visible on node "
                               f"{ray.util.get_node_ip_address()} (mount it at the same path, or use ship)")
        ship = payload.files == "ship" or (payload.files == "auto" and not shared_seen)
        for key, value in payload.thread_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        run_dir = Path(tempfile.mkdtemp(prefix=f"kvscope-{payload.server}-")) if ship else Path(payload.run_dir)
        node_ip = ray.util.get_node_ip_address()
        yield {"kind": "node", "node": node_ip, "pid": os.getpid(),
               "files": "ship" if ship else "shared", "run_dir": str(run_dir)}
        spec, client_where = payload.spec, {}
        if payload.client is not None:
            client_where = ray.get(payload.client.where.remote())  # waits until Ray placed the client
            yield {"kind": "client", **client_where}
            spec = reachable_spec(spec, payload.server, node_ip)
        try:
            if ship:
                unpack_dir(ray.get(traces[0]), run_dir / "traces")
            ctx = _WorkerRun(spec, run_dir, payload.manifest, run_dir / "experiment.json",
                             payload.model_path, server=payload.server, ship=ship, client=payload.client,
                             node_ip=node_ip, client_where=client_where)
            yield from self._run_in_thread(ctx, payload)
            if ship:
                ctx._ship_log()
                while not ctx.events.empty():
                    yield ctx.events.get()  # type: ignore[misc]
        finally:
            if ship:
                shutil.rmtree(run_dir, ignore_errors=True)

    @staticmethod
    def _run_in_thread(ctx: _WorkerRun, payload: WorkerPayload) -> Iterator[Event]:
        """The cell loop calls `save` synchronously; a thread runs it while this generator yields its events.
        The thread lives until the loop has stopped every server it started (vLLM dies with its parent
        thread)."""
        failure: list[BaseException] = []

        def work() -> None:
            try:
                run_configurations(ctx, payload.cells, [payload.server], payload.with_sweeps)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the generator below
                failure.append(exc)
            finally:
                ctx.events.put(None)

        thread = threading.Thread(target=work, name=f"kvscope-{payload.server}", daemon=True)
        thread.start()
        while (event := ctx.events.get()) is not None:
            yield event
        thread.join()
        if failure:
            raise failure[0]


def reachable_spec(spec: ExperimentSpec, name: str, node_ip: str) -> ExperimentSpec:
    """The spec with configuration `name`'s server bound to this node's IP, so a client on another node
    reaches it — where kvscope starts the server, its config has a `host` and the spec leaves it unset (a
    `host` the spec gives, e.g. 0.0.0.0, is kept)."""
    backend = server_backend(spec, name, model_path="/placeholder")
    entry = spec.servers[name] or {}
    if not backend.managed or "host" not in backend.config_model.model_fields or "host" in entry \
            or "host" in spec.server_defaults:
        return spec
    spec = spec.model_copy(deep=True)
    spec.servers[name] = {**entry, "host": node_ip}
    return spec


def client_endpoint(endpoint: str, node_ip: str) -> str:
    """A started server's endpoint as another node reaches it: a loopback host (what a server bound to 0.0.0.0
    reports) becomes the server node's IP."""
    parts = urlsplit(endpoint)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        return endpoint
    return urlunsplit(parts._replace(netloc=f"{node_ip}:{parts.port}" if parts.port else node_ip))


class ReplayClient:
    """The Ray actor that replays one configuration's cells from the node `client_resources` selects (wrapped
    with `ray.remote` by the driver). It holds the traces in a scratch directory and returns each replayed cell
    directory as a tar; the configuration's actor unpacks it where a beside-the-server replay would write."""

    def __init__(self, traces: list[Any]) -> None:
        # deferred: ray is heavy, an optional install (kvscope[ray]), only the ray executor needs it
        import ray

        self.scratch = Path(tempfile.mkdtemp(prefix="kvscope-client-"))
        unpack_dir(ray.get(traces[0]), self.scratch / "traces")

    def where(self) -> Event:
        """The node and process replaying, and the resources Ray gave this actor."""
        # deferred: ray is heavy, an optional install (kvscope[ray]), only the ray executor needs it
        import ray

        assigned = ray.get_runtime_context().get_assigned_resources()
        return {"node": ray.util.get_node_ip_address(), "pid": os.getpid(), "resources": dict(assigned)}

    def replay(self, trace: str, cell: str, options: Any,
               attach: tuple[str, Any, str, str | None, dict[str, str]]) -> Event:
        """Replay `trace` (relative to the run directory) against the attached endpoint into a cell directory."""
        name, config, endpoint, api_key_env, url_credentials = attach
        backend = Backend.create(name, config, endpoint=endpoint, api_key_env=api_key_env)
        backend.url_credentials = url_credentials  # the endpoint's own credentials, taken out of its URL
        out = safe_child(self.scratch, "cells", cell)
        shutil.rmtree(out, ignore_errors=True)
        try:
            outcome = replay(safe_child(self.scratch, *trace.split("/")), out, options, backends=[backend])
            return {"blob": pack_dir(out), "summary": outcome.summary, "aborted": outcome.aborted,
                    "scratch": str(self.scratch)}
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ the driver


@dataclass
class _Tracked:
    """The driver's view of one configuration's actor."""

    server: str
    actor: Any
    stream: Any
    cells: list[str]
    node: str | None = None
    pid: int | None = None
    files: str | None = None  # shared | ship, as the actor chose
    scratch: str | None = None  # the run directory on the actor's node (its scratch one when shipping)
    client: Any = None  # the ReplayClient actor, where the spec names a client node
    client_node: str | None = None
    client_pid: int | None = None


#: Seconds to reach a Ray cluster before giving up (``KVSCOPE_RAY_CONNECT_TIMEOUT_S``). Ray's own retries of an
#: unreachable address (20 attempts of its GCS client, each waiting up to a minute) ran for over 5 minutes.
RAY_CONNECT_TIMEOUT_S = 30.0


def ray_connect_timeout_s() -> float:
    raw = os.environ.get("KVSCOPE_RAY_CONNECT_TIMEOUT_S")
    if raw is None:
        return RAY_CONNECT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise KvscopeError(f"KVSCOPE_RAY_CONNECT_TIMEOUT_S={raw!r}: a number of seconds > 0")
    return value


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a Ray address (``host:port`` or ``ray://host:port``); None if it names no port."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_ray_reachable(address: str, timeout_s: float) -> None:
    """The cluster's address accepts a TCP connection and speaks gRPC (Ray's GCS and client server both do)
    within ``timeout_s`` in all, else a one-line error. ``ray.init`` itself retries an address that does
    neither for minutes, and a deadline around it cannot stop it (its retry loop swallows the interruption)."""
    hp = _host_port(address)
    if hp is None:
        return  # Ray resolves other forms itself
    limit = f"{timeout_s:g} s limit; KVSCOPE_RAY_CONNECT_TIMEOUT_S sets it"
    start = time.monotonic()
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__).lower()
        raise ServerError(f"--ray-address {address}: cannot reach a Ray cluster there ({why}; {limit})") from None
    import grpc  # deferred: grpc is heavy, importing this module must not load it

    channel = grpc.insecure_channel(f"{hp[0]}:{hp[1]}")
    try:
        grpc.channel_ready_future(channel).result(timeout=max(0.1, timeout_s - (time.monotonic() - start)))
    except grpc.FutureTimeoutError:
        raise ServerError(f"--ray-address {address}: something listens there but it is not a Ray cluster (no gRPC "
                          f"answer; {limit})") from None
    finally:
        channel.close()


#: Starting a local Ray cluster: Ray gives a new raylet a fixed 30 s to register with its GCS
#: (``ray/_private/node.py``, not configurable), which a 2-core host busy starting vLLM servers can miss several
#: times in a row: a clean-clone CI at load 19-23 missed it three times running (three tries were the limit
#: then), another took 185 s to get a cluster.  So a local start is tried again while the time budget lasts
#: (each try costs Ray's 30 s window and its shutdown), up to a number of tries.
LOCAL_RAY_START_BUDGET_S = 300.0
LOCAL_RAY_START_ATTEMPTS = 10


def init_ray(ray: Any, address: str | None = None, **kwargs: Any) -> None:
    """``ray.init``; a new local cluster whose raylet missed Ray's registration window is shut down and
    started again, while :data:`LOCAL_RAY_START_BUDGET_S` lasts and at most :data:`LOCAL_RAY_START_ATTEMPTS`
    times in all (then Ray's own error). Joining an existing cluster is not retried."""
    local = address in (None, "", "local")
    start = time.monotonic()
    for attempt in range(1, LOCAL_RAY_START_ATTEMPTS + 1):
        try:
            ray.init(address=address, **kwargs)
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
            if (not local or "timed out during startup" not in str(exc) or attempt == LOCAL_RAY_START_ATTEMPTS
                    or time.monotonic() - start >= LOCAL_RAY_START_BUDGET_S):
                raise
            print(f"local Ray cluster: the raylet missed Ray's 30 s registration window (try {attempt}, load "
                  f"{os.getloadavg()[0]:.1f}); starting it again", flush=True)
            ray.shutdown()


def run_experiment_ray(spec_path: str | Path, out: str | Path = "results", run_id: str | None = None,
                       resume: bool = False, only_cells: list[str] | None = None, address: str | None = None,
                       files: str | None = None, on_event: Callable[[str, Event], None] | None = None) -> Path:
    """Run (or resume) an experiment with one Ray actor per server configuration; returns the run directory.

    Connects to `address` (else RAY_ADDRESS, else starts a local cluster) unless Ray is initialised already.
    `files` overrides `executor.files`. ``on_event(server, event)`` sees every event the driver handles (tests
    use it to kill an actor mid-run).
    """
    ray = import_ray()
    started_here = not ray.is_initialized()
    if started_here and address not in (None, "", "auto", "local"):
        check_ray_reachable(address, ray_connect_timeout_s())  # before a run directory is made
    prepared = prepare_run(spec_path, out, run_id, resume, only_cells)
    run = prepared.run
    files = files or run.spec.executor.files
    run.manifest.executor = ExecutorEntry(kind="ray", address=address, files=files)
    if started_here:
        init_ray(ray, address, include_dashboard=False, log_to_driver=True)
    token = f"{TOKEN_PREFIX}{uuid.uuid4().hex}"
    (run.run_dir / token).write_text("kvscope driver token: an actor that sees this file shares the run directory\n")
    try:
        _drive(ray, run, prepared.todo, with_sweeps=not only_cells, files=files, token=token, on_event=on_event)
    except KeyboardInterrupt:  # the actors are killed (their servers with them); --resume redoes these cells
        for entry in run.manifest.cells.values():
            if entry.status == "running":
                entry.status, entry.reason = "interrupted", "interrupted"
        raise
    finally:
        (run.run_dir / token).unlink(missing_ok=True)
        run.save()
        if started_here:
            ray.shutdown()
    finish_run(run)
    return run.run_dir


def _configurations(run: RunContext, todo: list[Cell], with_sweeps: bool) -> dict[str, list[Cell]]:
    """Configuration -> its cells still to run, in plan order; a configuration with a sweep gets an actor even
    when its grid is done (the sweep resumes level by level)."""
    swept = {sw.server for sw in plan_sweeps(run.spec)} if with_sweeps else set()
    return {name: [c for c in todo if c.server == name] for name in run.spec.servers
            if name in swept or any(c.server == name for c in todo)}


def _drive(ray: Any, run: RunContext, todo: list[Cell], with_sweeps: bool, files: str, token: str,
           on_event: Callable[[str, Event], None] | None) -> None:
    """Start one actor per configuration, merge their events until every stream ended or its actor died."""
    groups = _configurations(run, todo, with_sweeps)
    cluster_has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    client_opts = {name: client_actor_options(run.spec, name) for name in groups}
    shipped = files != "shared" or any(opts is not None for opts in client_opts.values())
    traces_ref = [ray.put(pack_dir(run.run_dir / "traces"))] if shipped else [None]
    worker_cls = ray.remote(ConfigurationWorker)
    client_cls = ray.remote(ReplayClient)
    tracked: dict[Any, _Tracked] = {}
    for name, cells in groups.items():
        opts = actor_options(run.spec, name, cluster_has_gpus)
        _warn_unless_fits(ray, name, "actor", opts)
        actor = worker_cls.options(**opts, max_restarts=0, max_task_retries=0).remote()
        client = None
        if (copts := client_opts[name]) is not None:
            _warn_unless_fits(ray, name, "client", copts)
            client = client_cls.options(**copts, max_restarts=0, max_task_retries=0).remote(traces_ref)
            print(f"[{name}] client actor requested {_fmt_opts(copts)}", flush=True)
        payload = WorkerPayload(run.spec, run.manifest, str(run.run_dir), run.model_path, name, cells, with_sweeps,
                                files, token, {key: os.environ.get(key) for key in THREAD_ENV}, client)
        stream = actor.run.options(num_returns="streaming").remote(payload, traces_ref)
        tracked[stream] = _Tracked(name, actor, stream, [c.name for c in cells], client=client)
        print(f"[{name}] actor requested {_fmt_opts(opts)}: {len(cells)} cell(s)", flush=True)
    try:
        while tracked:
            ready, _ = ray.wait(list(tracked), num_returns=1, timeout=None)
            for stream in ready:
                _advance(ray, run, tracked, tracked[stream], on_event)
    finally:
        for t in tracked.values():
            _retire(ray, t)


def _warn_unless_fits(ray: Any, name: str, what: str, opts: dict[str, Any]) -> None:
    """Ray queues a request no node offers; say so (an autoscaling cluster may add the node)."""
    if not _fits_some_node(ray, opts):
        print(f"[{name}] no node offers the {what}'s {_fmt_opts(opts)} now; waiting for the cluster to provide it",
              flush=True)


def _retire(ray: Any, t: _Tracked) -> None:
    """Kill a configuration's actors (its server dies with its actor); the client first removes its scratch."""
    ray.kill(t.actor, no_restart=True)
    if t.client is not None:
        try:
            ray.get(t.client.close.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a lost or unplaced client has nothing to clean here
            pass
        ray.kill(t.client, no_restart=True)


def _advance(ray: Any, run: RunContext, tracked: dict[Any, _Tracked], t: _Tracked,
             on_event: Callable[[str, Event], None] | None) -> None:
    """Take one event from a configuration's stream; its end or its actor's death retires it."""
    try:
        event = ray.get(next(t.stream))
    except StopIteration:
        del tracked[t.stream]
        _retire(ray, t)
        return
    except Exception as exc:  # noqa: BLE001 - RayActorError, ActorDiedError, a task error: fail its cells
        del tracked[t.stream]
        _fail_remaining(run, t, exc)
        _retire(ray, t)
        return
    _merge(run, t, event)
    if on_event is not None:
        on_event(t.server, {"pid": t.pid, "node": t.node, **event})  # a client event keeps its own


def _merge(run: RunContext, t: _Tracked, event: Event) -> None:
    kind = event["kind"]
    if kind == "node":
        t.node, t.pid, t.files, t.scratch = event["node"], event["pid"], event["files"], event["run_dir"]
        print(f"[{t.server}] on node {t.node} (actor pid {t.pid}, files {t.files})", flush=True)
        return  # recorded with the configuration's server record, once it has one
    elif kind == "client":
        t.client_node, t.client_pid = event["node"], event["pid"]
        print(f"[{t.server}] replay client on node {t.client_node} (actor pid {t.client_pid})", flush=True)
        return
    elif kind == "manifest":
        run.manifest.cells.update(event["cells"])
        if event["server"] is not None:
            client = {"client_node": t.client_node, "client_pid": t.client_pid} if t.client_node else {}
            run.manifest.servers[t.server] = event["server"].model_copy(
                update={"node": t.node, "files": t.files, **client})
        if event["capacity"] is not None:
            _merge_capacity(run, t.server, event["capacity"])
    elif kind == "cell":
        cell_dir = safe_child(run.run_dir, "cells", event["name"])
        unpack_dir(event["blob"], cell_dir)
        _relocate_trace_path(cell_dir, t.scratch, run.run_dir)
        return  # the manifest event that follows says the cell ended
    elif kind == "log":
        log = safe_child(run.run_dir, "servers", f"{t.server}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_bytes(event["blob"])
        return
    run.save()


def _relocate_trace_path(cell_dir: Path, scratch: str | None, run_dir: Path) -> None:
    """A shipped cell's manifest.json names the trace it replayed in the actor's scratch directory: point it
    at the same trace in this run directory, as a local run records it."""
    path = cell_dir / "manifest.json"
    if scratch is None or not path.is_file():
        return
    manifest = load_run_manifest(path)
    if manifest.trace.path.startswith(scratch.rstrip("/") + "/"):
        manifest.trace.path = str(run_dir) + manifest.trace.path[len(scratch.rstrip("/")):]
        write_result_file(path, ManifestFile, manifest)


def _merge_capacity(run: RunContext, server: str, entries: list[CapacityEntry]) -> None:
    """Replace this configuration's capacities; keep the sweeps' plan order (as a local run records them)."""
    merged = [c for c in run.manifest.capacity or [] if c.server != server] + entries
    order = {(sw.server, sw.workload): i for i, sw in enumerate(plan_sweeps(run.spec))}
    run.manifest.capacity = sorted(merged, key=lambda c: order.get((c.server, c.workload), len(order)))


def _fail_remaining(run: RunContext, t: _Tracked, exc: BaseException) -> None:
    """The actor (or its node) is gone: every cell of its configuration not ended yet fails with the reason."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    where = f"node {t.node}, actor pid {t.pid}" if t.node else "before it reported a node"
    reason = (f"Ray actor of configuration {t.server} lost ({where}): {exc.__class__.__name__}: "
              f"{first_line}")[:500]
    print(f"[{t.server}] FAILED: {reason}", flush=True)
    for name, entry in run.manifest.cells.items():
        if entry.server == t.server and entry.status in ("pending", "running") and \
                (name in t.cells or entry.status == "running"):
            entry.status, entry.reason, entry.ended_at = "failed", reason, time.time()
    run.save()


def _fmt_opts(opts: dict[str, Any]) -> str:
    parts = [f"CPU {opts['num_cpus']:g}"] + ([f"GPU {opts['num_gpus']:g}"] if opts["num_gpus"] else [])
    return ", ".join(parts + [f"{k} {v:g}" for k, v in opts["resources"].items()])
