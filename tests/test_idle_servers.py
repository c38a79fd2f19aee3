"""Issue 26: idle servers of ``servers_up: all`` (``idle_servers: pause`` freezes them, interleaving kept).

The process-group signals are checked on a stand-in process tree (a shell and its child in their own session,
as vLLM's API server, engine core and worker are), the runner's use of them with recording backends; CPU
figures are `benchmarks/idle_servers.py`'s.
"""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from kvscope.harness.serving.server import ServerConfig, VllmServer


def _tree_statuses(pid: int) -> set[str]:
    root = psutil.Process(pid)
    return {p.status() for p in [root, *root.children(recursive=True)]}


def _wait_for(pid: int, want: str, timeout_s: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = _tree_statuses(pid)
        if (statuses == {want}) if want == psutil.STATUS_STOPPED else (psutil.STATUS_STOPPED not in statuses):
            return statuses
        if time.monotonic() > deadline:
            return statuses
        time.sleep(0.05)


@pytest.fixture
def fake_server(tmp_path):
    """A VllmServer whose 'process' is a python parent with a child, in their own process group."""
    server = VllmServer(ServerConfig(model=str(tmp_path)), log_path=tmp_path / "log")
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    server.process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 10
    while not psutil.Process(server.process.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    yield server
    server.stop(grace_s=2)


def test_pause_stops_the_whole_process_group_and_resume_continues_it(fake_server):
    pid = fake_server.process.pid
    assert len(psutil.Process(pid).children()) == 1
    assert fake_server.pause() and fake_server.paused
    assert _wait_for(pid, psutil.STATUS_STOPPED) == {psutil.STATUS_STOPPED}
    fake_server.resume()
    assert not fake_server.paused
    assert psutil.STATUS_STOPPED not in _wait_for(pid, "running")


def test_a_paused_server_still_stops(fake_server):
    proc = fake_server.process
    child = psutil.Process(proc.pid).children()[0]
    fake_server.pause()
    fake_server.stop(grace_s=5)
    assert proc.poll() == -15  # it took the SIGTERM (continued first), no SIGKILL needed
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_the_runner_pauses_every_other_configuration_and_resumes_the_measured_one():
    from kvscope.harness.experiment.runner import _Servers

    class Recording:
        def __init__(self, name: str, log: list) -> None:
            self.name, self.log = name, log

        def pause(self) -> bool:
            self.log.append(("pause", self.name))
            return True

        def resume(self) -> None:
            self.log.append(("resume", self.name))

        def is_running(self) -> bool:
            return True

    log: list = []
    for idle, expected in (("pause", [("pause", "b"), ("resume", "a")]), ("run", [])):
        log.clear()
        manifest = SimpleNamespace(servers={})
        run = SimpleNamespace(spec=SimpleNamespace(idle_servers=idle, between_repeats="reset"), manifest=manifest,
                              run_dir=__import__("pathlib").Path("/tmp"))
        servers = _Servers(run)  # type: ignore[arg-type]
        servers.backends = {"a": Recording("a", log), "b": Recording("b", log)}
        servers._record = lambda name: SimpleNamespace(restarts=0)  # type: ignore[method-assign]
        assert servers.get("a", 0).name == "a"
        assert log == expected
