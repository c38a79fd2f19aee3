"""One writer per run directory (issue #40, item 1): a second kvscope process on a run directory that another
one writes (an experiment and its `--resume` beside it, two `record --out`, a replay) is refused in one line
naming the holder's pid and how to proceed, exit 2; a holder killed with SIGKILL leaves nothing stuck.

The holder is a real second process: either a `kvscope record` proxy, or a small Python process that takes the
lock the way every command does (`lock_run_dir`) and waits to be killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvscope.harness.cli.main import main
from kvscope.harness.common.runlock import LOCK_FILE_NAME, RunDirBusyError, lock_run_dir


def _holder(directory: Path, command: str = "kvscope test-holder") -> subprocess.Popen:
    """A process holding `directory`'s lock until killed (it prints 'held' once it holds it)."""
    code = textwrap.dedent(f"""
        import sys, time
        from kvscope.harness.common.runlock import lock_run_dir
        lock = lock_run_dir({str(directory)!r}, {command!r})
        print("held", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holder_leaves_nothing_stuck(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run, "kvscope experiment run")
    try:
        with pytest.raises(RunDirBusyError) as err:
            lock_run_dir(run, "kvscope experiment run")
        msg = str(err.value)
        assert f"pid {holder.pid}" in msg and "kvscope experiment run" in msg
        assert f"kill {holder.pid}" in msg and "wait for it" in msg and "\n" not in msg
    finally:
        _kill(holder)  # SIGKILL: no cleanup ran, the lock file is still there
    assert (run / LOCK_FILE_NAME).exists()
    with lock_run_dir(run, "kvscope replay") as lock:
        assert lock.held
        assert (run / LOCK_FILE_NAME).read_text().startswith(f"{os.getpid()} kvscope replay")
    assert not (run / LOCK_FILE_NAME).exists()  # released: nothing left in the run directory


def test_a_child_process_does_not_inherit_the_lock(tmp_path):
    """A server kvscope starts (vLLM) must not keep the run locked after kvscope itself died."""
    run = tmp_path / "run"
    code = textwrap.dedent(f"""
        import subprocess, sys
        from kvscope.harness.common.runlock import lock_run_dir
        lock = lock_run_dir({str(run)!r}, "kvscope replay")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(child.pid, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    child = int(out.stdout.strip())
    try:
        lock_run_dir(run, "kvscope replay").release()  # the parent exited; its child holds nothing
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_same_process_may_take_its_own_run_again(tmp_path):
    """A library caller retrying after an exception (its first lock never released) is not refused by itself."""
    first = lock_run_dir(tmp_path, "kvscope experiment run")
    second = lock_run_dir(tmp_path, "kvscope experiment run")
    assert second.held and not first.held
    first.release()  # a no-op: the lock moved to `second`
    code = f"from kvscope.harness.common.runlock import lock_run_dir; lock_run_dir({str(tmp_path)!r}, 'x')"
    holder = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert holder.returncode != 0 and "RunDirBusyError" in holder.stderr
    second.release()


def test_replay_into_a_run_directory_being_written_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    holder = _holder(run, "kvscope replay")
    try:
        rc = main(["replay", str(tmp_path / "trace"), "--out", str(run), "--endpoint", "http://127.0.0.1:9"])
    finally:
        _kill(holder)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"pid {holder.pid}" in err and str(run) in err


def test_an_experiment_and_its_resume_beside_it_are_one_writer(tmp_path, tiny_model_dir, capsys):
    """Probe: `experiment run --run-id same` and 30 s later `--resume --run-id same` both wrote the cells."""
    from tests.doubles.faultserver import FaultConfig, FaultServer

    with FaultServer(FaultConfig(output_len=2)) as srv:
        spec = tmp_path / "one.yaml"
        spec.write_text(textwrap.dedent(f"""\
            name: one
            model: {{source: path, path: {tiny_model_dir}, served_model_name: tiny}}
            servers:
              good: {{backend: openai, endpoint: "{srv.endpoint}", block_size: 16}}
            workloads:
              agent: {{spec: agent-coding, scale: 0.01, sessions: 1, seed: 0, max_context: 400}}
            loads: [{{concurrency: 1}}]
            repeats: 1
            replay: {{time_scale: 0}}
            """))
        run = tmp_path / "results" / "one" / "same"
        holder = _holder(run, "kvscope experiment run")
        try:
            rc = main(["experiment", "run", str(spec), "--out", str(tmp_path / "results"), "--run-id", "same",
                       "--no-report"])
            err = capsys.readouterr().err.strip()
            assert rc == 2 and len(err.splitlines()) == 1, err
            assert f"pid {holder.pid}" in err and "kvscope experiment run" in err
            assert not (run / "experiment.json").exists() and not (run / "cells").exists()  # nothing written
        finally:
            _kill(holder)
        # the holder was killed: the run goes ahead, its cells replay (unlocked, inside the run) and it ends free
        assert main(["experiment", "run", str(spec), "--out", str(tmp_path / "results"), "--run-id", "same",
                     "--no-report"]) == 0
    assert (run / "cells").is_dir() and not (run / LOCK_FILE_NAME).exists()


def test_two_record_proxies_on_one_out_are_one_writer(tmp_path):
    """Probe: two `kvscope record` on one --out appended to one exchanges.jsonl, request_id 3 twice."""
    from tests.doubles.faultserver import FaultConfig, FaultServer

    out = tmp_path / "rec"
    cmd = [sys.executable, "-m", "kvscope.harness.cli.main", "record", "--listen", "127.0.0.1:0", "--out", str(out)]
    with FaultServer(FaultConfig()) as srv:
        first = subprocess.Popen([*cmd, "--upstream", srv.endpoint], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        try:
            assert first.stdout.readline().startswith("recording on")
            for extra in (["--upstream", srv.endpoint], ["--finalize", str(out)]):
                argv = cmd[:3] + ["record", *extra] if extra[0] == "--finalize" else [*cmd, *extra]
                second = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
                err = second.stderr.strip()
                assert second.returncode == 2 and len(err.splitlines()) == 1, err
                assert f"pid {first.pid}" in err and "kvscope record" in err and "Traceback" not in err
        finally:
            first.send_signal(signal.SIGINT)
            first.communicate(timeout=60)
    assert first.returncode == 0
