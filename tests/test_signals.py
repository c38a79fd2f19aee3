"""Signals stop what kvscope started (issue 14).

Fast tests (no vLLM): the parent-death watchdog kills a process group when its owner is SIGKILLed and leaves
it alone after a normal release; SIGTERM of a replay is handled like Ctrl-C (records flushed, exit 143).
Real-server test (marker vllm): SIGTERM and SIGKILL of `kvscope experiment run` leave no vLLM process behind
after 15 s, and `--resume` then finishes the experiment with every cell exactly once. Processes are found two
ways: the tree recorded under kvscope before the kill, and any process whose command line names this test's own
copy of the model (other developers may serve the same tiny model).

SIGTERM of `kvscope replay --server` is tests/test_auth.py's: the one replay that launches its own vLLM there
is both the API-key check and the signal check, so the suite starts that server once instead of twice (each
start costs 35-40 s of CI); it uses the helpers here (`kvscope_popen`, `process_tree`, `assert_all_gone`,
`private_model_copy`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kvscope.workloads.generate import synthetic_trace
from tests.doubles.faultserver import FaultConfig, FaultServer

GONE_WITHIN_S = 15.0


def kvscope_popen(*args: str, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvscope.harness.cli.main", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _naming(fragment: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if fragment in " ".join(p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants now (empty once it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(tree: list[psutil.Process], fragment: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline and (_alive(tree) or _naming(fragment)):
        time.sleep(0.5)
    left = {p.pid: " ".join(p.cmdline())[:120] for p in _alive(tree) + _naming(fragment) if p.is_running()}
    assert not left, f"still running {GONE_WITHIN_S} s after the signal: {left}"


# ------------------------------------------------------------------------------------------ watchdog


OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from kvscope.harness.serving.lifecycle import ParentDeathWatchdog
    group = subprocess.Popen(["sleep", "600"], start_new_session=True)
    child = subprocess.Popen(["sleep", "600"], start_new_session=False)  # same session as the owner: not killed
    dog = ParentDeathWatchdog(group.pid, grace_s=2.0)
    if sys.argv[1] == "release":
        group.terminate(); group.wait(); dog.release()
    print(group.pid, dog.process.pid, child.pid, flush=True)
    time.sleep(600)
""")


def test_watchdog_kills_the_group_when_its_owner_is_sigkilled():
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "keep"], stdout=subprocess.PIPE, text=True)
    group_pid, dog_pid, other_pid = map(int, owner.stdout.readline().split())
    group, dog = psutil.Process(group_pid), psutil.Process(dog_pid)
    assert group.is_running() and dog.is_running()
    owner.kill()
    owner.wait()
    wait_for(lambda: not _alive([group]), GONE_WITHIN_S, "the watched process group to be killed")
    wait_for(lambda: not _alive([dog]), 5, "the watchdog to exit")
    other = psutil.Process(other_pid)
    assert _alive([other])  # only the watched group is killed
    other.kill()


def test_watchdog_ends_a_stopped_group_with_sigterm_not_its_late_sigkill():
    """Issue 40, item 7: a configuration paused by `idle_servers: pause` is SIGSTOPped; the watchdog's SIGTERM
    stays pending on a stopped process, so only its SIGKILL after the grace period ended the server (5-25 s of
    a 1.5 GB vLLM left). It continues the group after the SIGTERM: the stand-in ends by that SIGTERM (the
    grace period here is 10 minutes, so a SIGKILL cannot be what ends it within the wait)."""
    import os
    import signal

    from kvscope.harness.serving.lifecycle import ParentDeathWatchdog

    group = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        os.killpg(group.pid, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(group.pid).status() == psutil.STATUS_STOPPED, 10, "the stand-in to stop")
        dog = ParentDeathWatchdog(group.pid, grace_s=600.0)
        os.close(dog._write_fd)  # what the kernel does when kvscope dies without release()
        dog._write_fd = -1
        assert group.wait(timeout=GONE_WITHIN_S) == -signal.SIGTERM
        dog.process.wait(timeout=30)
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)
            group.wait()


INTERRUPTED_IN_A_CALLBACK = textwrap.dedent("""
    import asyncio, sys
    from kvscope.harness.replay.runner import run_event_loop

    class Protocol(asyncio.Protocol):
        def data_received(self, data):  # where a second SIGTERM's KeyboardInterrupt lands mid-replay
            raise KeyboardInterrupt

    async def main():
        server = await asyncio.start_server(lambda r, w: w.write(b"x"), "127.0.0.1", 0)
        await asyncio.get_running_loop().create_connection(Protocol, "127.0.0.1", server.sockets[0].getsockname()[1])
        await asyncio.sleep(30)
        print("ran to the end")

    try:
        run_event_loop(main(), sys.argv[1])
    except KeyboardInterrupt:
        print("kvscope: interrupted", file=sys.stderr)
""")


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_an_interrupt_inside_a_transport_callback_stops_the_run_without_a_traceback(loop):
    """Issue 40, item 8: SIGTERM during a resumed replay printed uvloop's "Fatal error on transport" and a
    KeyboardInterrupt traceback (raised by signals.py's forwarding handler inside a transport callback) before
    "kvscope: interrupted". The loop's exception handler takes it quietly and stops the run."""
    pytest.importorskip(loop)
    r = subprocess.run([sys.executable, "-c", INTERRUPTED_IN_A_CALLBACK, loop], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.stderr == "kvscope: interrupted\n" and r.stdout == "", r.stderr


def test_released_watchdog_exits_without_killing():
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "release"], stdout=subprocess.PIPE, text=True)
    _, dog_pid, other_pid = map(int, owner.stdout.readline().split())
    assert not psutil.pid_exists(dog_pid) or psutil.Process(dog_pid).status() == psutil.STATUS_ZOMBIE
    owner.kill()
    owner.wait()
    time.sleep(0.5)
    other = psutil.Process(other_pid)
    assert _alive([other])
    other.kill()


def test_pdeathsig_only_from_the_main_thread():
    import threading

    from kvscope.harness.serving.lifecycle import die_with_parent

    assert die_with_parent() is not None
    seen = []
    t = threading.Thread(target=lambda: seen.append(die_with_parent()))
    t.start()
    t.join()
    assert seen == [None]


# ------------------------------------------------------------------------------- SIGTERM like Ctrl-C


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_of_a_replay_flushes_records_and_says_interrupted(tmp_path, signum, code):
    trace = synthetic_trace(40, steps=20).write(tmp_path / "trace")
    with FaultServer(FaultConfig(ttft_s=0.02, itl_s=0.005)) as srv:
        proc = kvscope_popen("replay", str(trace), "--endpoint", srv.endpoint, "--out", str(tmp_path / "run"),
                             "--concurrency", "2", "--time-scale", "0", "--no-progress", "--no-reset-prefix-cache")
        jsonl = tmp_path / "run" / "requests.jsonl"
        wait_for(lambda: jsonl.exists() and jsonl.stat().st_size > 0, 60, "the first records")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    assert "kvscope: interrupted" in err and "Traceback" not in err
    lines = jsonl.read_text().splitlines()
    assert lines and all(json.loads(x)["request_id"] >= 0 for x in lines)  # whole lines only


# --------------------------------------------------------------------------------- real vLLM server


def private_model_copy(model_dir: Path, where: Path) -> Path:
    """A copy of the model under `where` whose path names no one else's: every process of a server launched
    on it carries the path in its command line, so it identifies this test's servers among everyone's (other
    developers may serve the same tiny model)."""
    return Path(shutil.copytree(model_dir, where / f"model-{os.getpid()}-{time.monotonic_ns()}"))


@pytest.fixture()
def own_model(require_vllm, tiny_model_dir, tmp_path) -> Path:
    return private_model_copy(tiny_model_dir, tmp_path)


def _vllm_started(fragment: str):
    return lambda: any("vllm" in " ".join(p.cmdline()) for p in _naming(fragment))


EXPERIMENT = """\
name: sig
model: {{source: path, path: {model}, served_model_name: tiny}}
server_defaults: {{max_model_len: 2048, kv_cache_memory_bytes: 32M}}
servers: {{apc: {{}}}}
workloads:
  agent: {{spec: agent-coding, scale: 0.02, sessions: 2, seed: 3, max_context: 1500}}
loads: [{{concurrency: 1}}]
repeats: 2
replay: {{time_scale: 0.0, warmup_requests: 0}}
"""


@pytest.mark.vllm
def test_experiment_sigterm_then_sigkill_then_resume(own_model, tmp_path):
    """SIGTERM during cell 1 (cell 'interrupted', no vLLM left); resume and SIGKILL it (no vLLM left); a final
    --resume finishes with each cell exactly once. Three server starts in all."""
    spec = tmp_path / "exp.yaml"
    spec.write_text(EXPERIMENT.format(model=own_model))
    run_dir = tmp_path / "res" / "sig" / "r1"
    manifest = run_dir / "experiment.json"
    cells = ["apc__agent__c1__r0", "apc__agent__c1__r1"]

    def cell_recording(name: str):
        jl = run_dir / "cells" / name / "requests.jsonl"
        return lambda: jl.exists() and jl.stat().st_size > 0

    args = ["experiment", "run", str(spec), "--out", str(tmp_path / "res"), "--run-id", "r1", "--no-report"]
    proc = kvscope_popen(*args)
    wait_for(cell_recording(cells[0]), 300, "cell 1 to record requests")
    tree = process_tree(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=90)
    assert proc.returncode == 143
    assert_all_gone(tree, str(own_model))
    state = json.loads(manifest.read_text())["cells"]
    assert state[cells[0]]["status"] == "interrupted"

    proc = kvscope_popen(*args, "--resume")
    wait_for(_vllm_started(str(own_model)), 120, "the resumed run to start vLLM")
    wait_for(lambda: process_tree(proc.pid) and len(process_tree(proc.pid)) > 2, 60, "vLLM's children")
    tree = process_tree(proc.pid)
    proc.kill()
    proc.wait()
    assert_all_gone(tree, str(own_model))

    proc = kvscope_popen(*args, "--resume")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    final = json.loads(manifest.read_text())
    assert sorted(final["cells"]) == cells and final["failed_cells"] == []
    assert all(final["cells"][c]["status"] == "ok" for c in cells)
    for c in cells:  # each cell's records are one complete replay, not two attempts appended
        rows = [json.loads(x) for x in (run_dir / "cells" / c / "requests.jsonl").read_text().splitlines()]
        ids = [r["request_id"] for r in rows]
        assert len(ids) == len(set(ids)) and final["cells"][c]["headline"]["requests"] == len(ids)
    assert not _naming(str(own_model))
