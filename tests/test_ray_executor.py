"""`kvscope experiment run --executor ray`: one Ray actor per server configuration, results as a local run.

A Ray head on loopback (2 CPUs, a custom `gpu_slot` resource standing in for GPUs, `client_slot` for a client
node) runs the experiments. The
configurations that need no vLLM attach to FaultServer mocks on loopback (`backend: openai`), so only one real
vLLM server runs at a time (the machine has 2 cores). Cells are shipped back through the object store
(`executor.files: ship`) so the ship-back path is what is tested, although driver and actor share a disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvscope.harness.common.errors import ConfigError
from kvscope.harness.experiment import ray_executor
from kvscope.harness.experiment.ray_executor import (
    LOCAL_RAY_START_ATTEMPTS,
    LOCAL_RAY_START_BUDGET_S,
    actor_options,
    client_actor_options,
    client_endpoint,
    init_ray,
    pack_dir,
    parallel_gpus,
    reachable_spec,
    unpack_dir,
)
from kvscope.harness.experiment.runner import run_experiment
from kvscope.harness.experiment.spec import load_experiment_spec, server_backend
from kvscope.harness.results.loaders import load_experiment_file, load_results
from tests.doubles.faultserver import FaultConfig, FaultServer

WORKLOAD = "{spec: agent-coding, scale: 0.02, sessions: 2, seed: 3, max_context: 1500}"


def _spec(path: Path, model: Path, servers: str, repeats: int = 1, files: str = "ship", extra: str = "",
          workload: str = WORKLOAD) -> Path:
    path.write_text(f"""\
name: raytest
model: {{source: path, path: {model}, served_model_name: tiny}}
server_defaults: {{max_model_len: 2048, kv_cache_memory_bytes: 32M}}
servers:
{servers}
workloads:
  agent: {workload}
repeats: {repeats}
replay: {{time_scale: 0}}
executor: {{files: {files}}}
{extra}""")
    return path


def _mock(name: str, srv: FaultServer) -> str:
    return f'  {name}: {{backend: openai, endpoint: "{srv.endpoint}", block_size: 16, resources: {{gpu_slot: 1}}}}'


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    init_ray(ray, "local", num_cpus=2, resources={"gpu_slot": 2, "client_slot": 1}, include_dashboard=False,
             log_to_driver=False)
    yield ray
    ray.shutdown()


def _cell_files(run_dir: Path) -> dict[str, set[str]]:
    return {d.name: {p.name for p in d.iterdir()} for d in sorted((run_dir / "cells").iterdir()) if d.is_dir()}


# ------------------------------------------------------------------------------------------ no cluster needed


class _FlakyRay:
    """A stand-in for the ray module whose first ``starts_failing`` inits time out as Ray's raylet does."""

    def __init__(self, starts_failing: int) -> None:
        self.failing, self.inits, self.shutdowns = starts_failing, [], 0

    def init(self, address=None, **kwargs):
        self.inits.append(address)
        if self.failing:
            self.failing -= 1
            raise Exception("The current node timed out during startup. This could happen because ...")

    def shutdown(self):
        self.shutdowns += 1


def test_a_local_cluster_whose_raylet_missed_registration_is_started_again_but_a_remote_one_is_not(monkeypatch):
    ray = _FlakyRay(starts_failing=1)
    init_ray(ray, "local", num_cpus=2)
    assert ray.inits == ["local", "local"] and ray.shutdowns == 1
    ray = _FlakyRay(starts_failing=99)
    with pytest.raises(Exception, match="timed out during startup"):
        init_ray(ray, None)
    assert len(ray.inits) == LOCAL_RAY_START_ATTEMPTS  # then the error is Ray's own
    ray = _FlakyRay(starts_failing=99)  # a host that stays busy: tries stop when the time budget is spent
    clock = iter(range(0, 10_000, 100))
    monkeypatch.setattr(ray_executor.time, "monotonic", lambda: float(next(clock)))
    with pytest.raises(Exception, match="timed out during startup"):
        init_ray(ray, None)
    assert 1 < len(ray.inits) < LOCAL_RAY_START_ATTEMPTS and len(ray.inits) == LOCAL_RAY_START_BUDGET_S // 100
    ray = _FlakyRay(starts_failing=1)
    with pytest.raises(Exception, match="timed out during startup"):
        init_ray(ray, "10.0.0.1:6379")  # joining a cluster: not ours to restart
    assert ray.inits == ["10.0.0.1:6379"] and ray.shutdowns == 0


def test_actor_resources_come_from_the_spec_or_the_parallel_sizes(tmp_path, tiny_model_dir):
    spec, _ = load_experiment_spec(_spec(tmp_path / "s.yaml", tiny_model_dir, """\
  tp: {tensor_parallel_size: 2, extra_args: [--pipeline-parallel-size, "2"]}
  slot: {resources: {gpu_slot: 1, CPU: 2}}
  gpu: {resources: {GPU: 8}}
  remote: {backend: openai, endpoint: "http://127.0.0.1:9", block_size: 16}"""))
    assert parallel_gpus(spec, "tp") == 4
    assert actor_options(spec, "tp", cluster_has_gpus=True)["num_gpus"] == 4
    assert actor_options(spec, "tp", cluster_has_gpus=False)["num_gpus"] == 0  # a CPU-only cluster
    assert actor_options(spec, "slot", True) == {"num_cpus": 2, "num_gpus": 0, "resources": {"gpu_slot": 1}}
    assert actor_options(spec, "gpu", True)["num_gpus"] == 8
    assert actor_options(spec, "remote", True)["num_gpus"] == 0  # kvscope starts no server for it


def test_bad_resources_and_executor_fields_name_the_field(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"servers\.a\.resources"):
        load_experiment_spec(_spec(tmp_path / "a.yaml", tiny_model_dir, "  a: {resources: {gpu_slot: many}}"))
    with pytest.raises(ConfigError, match="files"):
        load_experiment_spec(_spec(tmp_path / "b.yaml", tiny_model_dir, "  a: {}", files="nfs"))


def test_a_named_client_node_gets_its_own_actor_and_a_reachable_server(tmp_path, tiny_model_dir):
    spec, _ = load_experiment_spec(_spec(tmp_path / "s.yaml", tiny_model_dir, """\
  apart: {client_resources: {client_slot: 1, CPU: 2}}
  exposed: {host: 0.0.0.0, client_resources: {client_slot: 1}}
  beside: {}"""))
    assert client_actor_options(spec, "apart") == {"num_cpus": 2, "num_gpus": 0, "resources": {"client_slot": 1}}
    assert client_actor_options(spec, "exposed")["num_cpus"] == 1  # executor.actor_cpus
    assert client_actor_options(spec, "beside") is None
    # not a server field: the configuration's server config is the same with or without it
    assert server_backend(spec, "apart", "/m").config == server_backend(spec, "beside", "/m").config
    # the server actor binds its node's IP where the spec leaves host unset, keeps a host it gives
    assert server_backend(reachable_spec(spec, "apart", "10.1.2.3"), "apart", "/m").config.host == "10.1.2.3"
    assert server_backend(reachable_spec(spec, "exposed", "10.1.2.3"), "exposed", "/m").config.host == "0.0.0.0"
    assert "host" not in spec.servers["apart"]  # the spec itself is not changed
    assert client_endpoint("http://127.0.0.1:8123", "10.1.2.3") == "http://10.1.2.3:8123"  # a 0.0.0.0 bind
    assert client_endpoint("http://10.1.2.3:8123", "10.9.9.9") == "http://10.1.2.3:8123"


def test_bad_client_resources_name_the_field(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"servers\.a\.client_resources: expected a mapping") as err:
        load_experiment_spec(_spec(tmp_path / "a.yaml", tiny_model_dir, "  a: {client_resources: [client_slot]}"))
    assert "\n" not in str(err.value).strip()
    with pytest.raises(ConfigError, match=r"servers\.a\.client_resources: amounts must be >= 0"):
        load_experiment_spec(_spec(tmp_path / "b.yaml", tiny_model_dir, "  a: {client_resources: {client_slot: -1}}"))


def test_a_shipped_directory_unpacks_identically_and_refuses_escaping_members(tmp_path):
    import io
    import tarfile

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.parquet").write_bytes(os.urandom(1000))
    (src / "sub" / "b.json").write_text("{}")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "stale").write_text("from an earlier attempt")
    unpack_dir(pack_dir(src), dest)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == ["a.parquet", "sub", "sub/b.json"]
    assert (dest / "a.parquet").read_bytes() == (src / "a.parquet").read_bytes()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(tarfile.TarError):
        unpack_dir(buf.getvalue(), tmp_path / "evil")
    assert not (tmp_path / "escaped").exists()


def test_without_ray_the_executor_flag_gives_a_one_line_error(tmp_path, tiny_model_dir):
    spec = _spec(tmp_path / "s.yaml", tiny_model_dir, "  a: {}")
    code = ("import sys; sys.modules['ray'] = None\n"
            "from kvscope.harness.cli.main import main\n"
            f"sys.exit(main(['experiment', 'run', {str(spec)!r}, '--executor', 'ray', '--out', {str(tmp_path)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == "kvscope: error: --executor ray needs the ray extra: pip install 'kvscope[ray]'"
    assert not (tmp_path / "raytest").exists()  # nothing was written


def test_ray_flags_without_the_ray_executor_are_refused(tmp_path, tiny_model_dir):
    from kvscope.harness.cli.main import main

    spec = _spec(tmp_path / "s.yaml", tiny_model_dir, "  a: {}")
    assert main(["experiment", "run", str(spec), "--ray-files", "ship", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "raytest").exists()


# ------------------------------------------------------------------------------------------ on a Ray cluster


def test_a_lost_actor_fails_its_cells_and_the_rest_goes_on(ray_cluster, tiny_model_dir, tmp_path):
    """SIGKILL the actor of one configuration mid-cell: its cells fail naming the lost actor, the other
    configuration's cells are ok and the run completes; a local --resume then redoes only the failed ones."""
    from kvscope.harness.experiment.ray_executor import run_experiment_ray

    with FaultServer(FaultConfig(ttft_s=0.002)) as fast, FaultServer(FaultConfig(ttft_s=0.2, itl_s=0.01)) as slow:
        spec = _spec(tmp_path / "k.yaml", tiny_model_dir, _mock("steady", fast) + "\n" + _mock("doomed", slow),
                     repeats=2, files="auto")  # one machine: auto finds the run directory shared
        killed: list[int] = []

        def kill_doomed_mid_cell(server: str, event: dict) -> None:
            running = [c for c in (event.get("cells") or {}).values() if c.status == "running"]
            if server == "doomed" and running and not killed:
                killed.append(event["pid"])
                os.kill(event["pid"], signal.SIGKILL)

        run_dir = run_experiment_ray(spec, out=tmp_path / "results", run_id="k", on_event=kill_doomed_mid_cell)
        manifest = load_experiment_file(run_dir)
        doomed = {n: c for n, c in manifest.cells.items() if c.server == "doomed"}
        steady = {n: c for n, c in manifest.cells.items() if c.server == "steady"}
        assert killed
        assert {c.status for c in doomed.values()} == {"failed"} and len(doomed) == 2
        for c in doomed.values():
            assert "Ray actor of configuration doomed lost" in (c.reason or "")
            assert f"actor pid {killed[0]}" in (c.reason or "")
        assert {c.status for c in steady.values()} == {"ok"} and len(steady) == 2
        assert sorted(manifest.failed_cells or []) == sorted(doomed)
        assert manifest.completed_at is not None
        assert manifest.executor is not None and manifest.executor.kind == "ray"
        assert manifest.servers["steady"].files == "shared"
        assert not list(run_dir.glob(".kvscope-executor-*"))  # the driver's token file is gone
        steady_started = {n: c.started_at for n, c in steady.items()}

        slow.config.ttft_s, slow.config.itl_s = 0.002, 0.0
        run_experiment(spec, out=tmp_path / "results", run_id="k", resume=True)
        resumed = load_experiment_file(run_dir)
        assert resumed.failed_cells == []
        assert {n: resumed.cells[n].started_at for n in steady} == steady_started  # not redone locally
        assert set(_cell_files(run_dir)) == set(manifest.cells)


def test_sweeps_run_in_their_configurations_actor_and_capacities_merge_in_plan_order(ray_cluster, tiny_model_dir,
                                                                                     tmp_path):
    from kvscope.harness.experiment.ray_executor import run_experiment_ray

    # Sixteen sessions, not the module's two, and requests of 20 ms: a level counts toward capacity only when it
    # was driven (>= 90 % of its sessions in flight on average). With two or four sessions the closed loop's tail
    # (one session left) and with 2 ms requests the client's own work between a session's requests held level 2
    # at 1.79 in flight: it did not count and the capacity read 1 (a busy CI host; 1.9-1.95 with these figures).
    workload = WORKLOAD.replace("sessions: 2", "sessions: 16")
    with FaultServer(FaultConfig(ttft_s=0.02)) as a, FaultServer(FaultConfig(ttft_s=0.02)) as b:
        spec = _spec(tmp_path / "w.yaml", tiny_model_dir, _mock("zeta", a) + "\n" + _mock("alpha", b),
                     extra="sweep: {kind: concurrency, levels: [1, 2], slo_ttft_p90_ms: 5000, adaptive: false, "
                           "predict: false}\n", workload=workload)
        ray_m = load_experiment_file(run_experiment_ray(spec, out=tmp_path / "results", run_id="ray"))
        local_m = load_experiment_file(run_experiment(spec, out=tmp_path / "results", run_id="local"))
    assert set(ray_m.cells) == set(local_m.cells)
    assert {n for n in ray_m.cells if "sweep-c" in n} == {f"{s}__agent__sweep-c{c}__r0" for s in ("zeta", "alpha")
                                                         for c in (1, 2)}
    assert ray_m.failed_cells == [] == local_m.failed_cells
    assert [(c.server, c.capacity) for c in ray_m.capacity or []] == \
        [(c.server, c.capacity) for c in local_m.capacity or []] == [("zeta", 2), ("alpha", 2)]
    # each level carries its TTFT p90's interval over its 16 sessions, and the sentence reads the edge from it
    for cap in [*ray_m.capacity, *local_m.capacity]:
        for point in cap.points:
            lo, hi = point.ttft_p90_interval_s
            assert lo <= point.ttft_p90_s <= hi
        assert "run-to-run noise" in cap.sentence


def test_a_named_client_node_replays_from_its_own_actor(ray_cluster, tiny_model_dir, tmp_path, capsys):
    """`client_resources: {client_slot: 1}`: the cells of that configuration replay from a second actor, which
    holds the client_slot and is another process than the server's actor; its cells have the shape of the
    beside-the-server configuration's, and the manifest says where the client ran."""
    from kvscope.harness.experiment.ray_executor import _fits_some_node, run_experiment_ray

    seen: dict[str, dict] = {}

    def record(server: str, event: dict) -> None:
        if event["kind"] in ("node", "client"):
            seen[f"{server}:{event['kind']}"] = event

    with FaultServer(FaultConfig(ttft_s=0.002)) as a, FaultServer(FaultConfig(ttft_s=0.002)) as b:
        apart = _mock("apart", a).replace("resources: {gpu_slot: 1}",
                                          "resources: {gpu_slot: 1}, client_resources: {client_slot: 1, CPU: 0}")
        spec = _spec(tmp_path / "c.yaml", tiny_model_dir, apart + "\n" + _mock("beside", b))
        run_dir = run_experiment_ray(spec, out=tmp_path / "results", run_id="c", on_event=record)
    assert "client actor requested CPU 0, client_slot 1" in capsys.readouterr().out
    m = load_experiment_file(run_dir)
    assert m.failed_cells == []
    server_pid = seen["apart:node"]["pid"]
    assert m.servers["apart"].client_pid not in (None, server_pid, os.getpid())
    assert m.servers["apart"].client_node == m.servers["apart"].node  # one machine: the same IP
    assert seen["apart:client"]["resources"].get("client_slot") == 1
    assert seen["apart:client"]["pid"] == m.servers["apart"].client_pid
    assert "beside:client" not in seen
    assert m.servers["beside"].client_node is None and m.servers["beside"].client_pid is None
    files = _cell_files(run_dir)
    assert files["apart__agent__c1__r0"] == files["beside__agent__c1__r0"]
    assert m.cells["apart__agent__c1__r0"].headline.requests == m.cells["beside__agent__c1__r0"].headline.requests
    for name in m.cells:  # the client's and the server actor's scratch paths are both gone from it
        cell_manifest = json.loads((run_dir / "cells" / name / "manifest.json").read_text())
        assert cell_manifest["trace"]["path"] == str(run_dir / "traces" / "agent")
    frames = load_results(run_dir)
    counts = frames.requests.groupby("cell").size()
    assert counts["apart__agent__c1__r0"] == counts["beside__agent__c1__r0"] > 0
    # a client request no node offers would wait: the driver says so before Ray queues it
    assert not _fits_some_node(ray_cluster, {"num_cpus": 0, "num_gpus": 0, "resources": {"client_rack_7": 1}})
    assert _fits_some_node(ray_cluster, {"num_cpus": 0, "num_gpus": 0, "resources": {"client_slot": 1}})


def test_a_lost_client_actor_fails_its_cells_with_the_reason(ray_cluster, tiny_model_dir, tmp_path):
    from kvscope.harness.experiment.ray_executor import run_experiment_ray

    """SIGKILL the client actor once the first cell runs (in its warm-up or its replay: either way the replay
    finds the client gone): both cells fail naming the lost client, the server's actor goes on and the run
    completes."""
    client_pid: list[int] = []
    killed: list[int] = []

    def kill_client_mid_cell(server: str, event: dict) -> None:
        if event["kind"] == "client":
            client_pid.append(event["pid"])
        running = [c for c in (event.get("cells") or {}).values() if c.status == "running"]
        if running and client_pid and not killed:
            os.kill(client_pid[0], signal.SIGKILL)
            killed.append(client_pid[0])

    with FaultServer(FaultConfig(ttft_s=0.2, itl_s=0.01)) as slow:
        servers = _mock("far", slow).replace("resources: {gpu_slot: 1}",
                                             "resources: {gpu_slot: 1}, client_resources: {client_slot: 1}")
        spec = _spec(tmp_path / "l.yaml", tiny_model_dir, servers, repeats=2)
        m = load_experiment_file(run_experiment_ray(spec, out=tmp_path / "results", run_id="l",
                                                    on_event=kill_client_mid_cell))
    assert killed
    assert m.completed_at is not None and sorted(m.failed_cells or []) == ["far__agent__c1__r0", "far__agent__c1__r1"]
    for c in m.cells.values():
        assert f"Ray client actor of configuration far lost (node {m.servers['far'].client_node}, actor pid " \
               f"{killed[0]})" in (c.reason or "")


@pytest.mark.vllm
def test_two_configurations_in_parallel_give_the_results_of_a_local_run(ray_cluster, require_vllm,
                                                                        tiny_model_dir, tmp_path, capsys):
    """A real vLLM configuration and a mock one, each in its own actor, cells shipped back; the same spec run
    locally gives the same cells, the same files, loadable by load_results. The two runs go side by side (the
    local one on a thread): each starts its own vLLM server, and two starts at once take little longer than
    one. Prints both wall times (of runs that shared the machine)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvscope.harness.experiment.ray_executor import run_experiment_ray

    def timed(fn, **kwargs) -> tuple[Path, float]:
        t0 = time.perf_counter()
        return fn(spec, out=tmp_path / "results", **kwargs), time.perf_counter() - t0

    with FaultServer(FaultConfig(ttft_s=0.02, itl_s=0.002)) as mock:
        spec = _spec(tmp_path / "p.yaml", tiny_model_dir, "  vllm: {resources: {gpu_slot: 1}}\n" + _mock("mock", mock))
        with ThreadPoolExecutor(1) as pool:
            local = pool.submit(timed, run_experiment, run_id="local")
            ray_dir, ray_s = timed(run_experiment_ray, run_id="ray")
            local_dir, local_s = local.result()
    with capsys.disabled():
        print(f"\ntwo-configuration experiment wall time, run side by side: local {local_s:.1f} s, ray {ray_s:.1f} s")
    ray_m, local_m = load_experiment_file(ray_dir), load_experiment_file(local_dir)
    assert ray_m.failed_cells == [] and local_m.failed_cells == []
    assert set(ray_m.cells) == set(local_m.cells) == {"vllm__agent__c1__r0", "mock__agent__c1__r0"}
    assert _cell_files(ray_dir) == _cell_files(local_dir)
    assert (ray_dir / "servers" / "vllm.log").stat().st_size > 0  # the actor's server log came back
    assert ray_m.servers["vllm"].files == "ship" and ray_m.servers["vllm"].node
    ray_facts, local_facts = ray_m.servers["vllm"].facts, local_m.servers["vllm"].facts
    assert ray_facts is not None and local_facts is not None
    # the same facts were recorded (which are known), the endpoint aside: each run had its own server
    known = {k for k, v in ray_facts.model_dump().items() if v is not None}
    assert known == {k for k, v in local_facts.model_dump().items() if v is not None}
    assert ray_facts.kv_capacity_tokens == local_facts.kv_capacity_tokens > 0
    for name in ray_m.cells:
        cell_manifest = json.loads((ray_dir / "cells" / name / "manifest.json").read_text())
        assert cell_manifest["trace"]["path"] == str(ray_dir / "traces" / "agent")  # not the actor's scratch dir
        assert ray_m.cells[name].headline.requests == local_m.cells[name].headline.requests
    ray_frames, local_frames = load_results(ray_dir), load_results(local_dir)
    assert ray_frames.requests.shape == local_frames.requests.shape
    assert list(ray_frames.requests.columns) == list(local_frames.requests.columns)
    assert sorted(ray_frames.cells["cell"]) == sorted(local_frames.cells["cell"])


def test_a_server_started_by_an_actor_does_not_inherit_rays_thread_limit(ray_cluster, tiny_model_dir, tmp_path,
                                                                         monkeypatch):
    """Ray sets OMP_NUM_THREADS=1 in a 1-CPU actor; the server must see the driver's (here: unset) value, or
    it measures differently from a local run. A stand-in `python` records the server's environment and exits."""
    from kvscope.harness.experiment.ray_executor import run_experiment_ray

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env_file = tmp_path / "server.env"
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\nenv > {env_file}\nexit 3\n")
    fake.chmod(0o755)
    spec = _spec(tmp_path / "e.yaml", tiny_model_dir,
                 f"  fake: {{python: {fake}, startup_timeout_s: 30, resources: {{gpu_slot: 1}}}}")
    manifest = load_experiment_file(run_experiment_ray(spec, out=tmp_path / "results", run_id="e"))
    assert manifest.failed_cells == ["fake__agent__c1__r0"]  # the stand-in never serves
    server_env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    assert "PATH" in server_env  # the stand-in ran and wrote its environment
    assert "OMP_NUM_THREADS" not in server_env
