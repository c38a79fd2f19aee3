"""Acceptance: against real vLLM started with an API key, kvscope authenticates every request it sends and
writes the key into none of its files.

The key reaches vLLM three ways, and each is run against real vLLM: `api_key_env` naming a variable of
kvscope's environment and `VLLM_API_KEY` in the config's `env:` are the two servers of the session's
integration experiment (conftest's `integration_experiment`: the experiment and its report are the ones
test_experiment_integration checks, so no extra server starts), and `--api-key=KEY` in `extra_args` is a
`kvscope replay --server` here.  That replay's launch is also the signal test of `kvscope replay --server`
(SIGTERM mid-run: exit 143, no vLLM left; the rest of the signal tests are tests/test_signals.py's), so the
suite starts one server for both instead of two: a run cut short writes no manifest or summary, so its
authentication is read from what it does write (the records, the /metrics spool, vLLM's access log), and the
summary's counter deltas from an authenticated scrape stay the experiment's test.  Where kvscope takes the key
from in each form, the two-word `--api-key KEY` included, and that a config's redaction replaces it, is
unit-tested in tests/test_server_config.py.  vLLM guards only `/v1/*` with the key (not `/metrics` or
`/reset_prefix_cache`); that every request also carries the header there is checked on a server that guards
everything (tests/test_server_config.py).
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pandas as pd
import pytest

from kvscope.workloads.generate import generate_from_file
from tests.test_signals import assert_all_gone, kvscope_popen, private_model_copy, process_tree, wait_for

pytestmark = pytest.mark.vllm


def _files_holding(root: Path, needle: str) -> list[str]:
    """Every file under root whose bytes, or (Parquet) whose decoded cells, contain the needle."""
    hits = []
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        if needle.encode() in p.read_bytes():
            hits.append(str(p))
        elif p.suffix == ".parquet" and needle in pd.read_parquet(p).to_csv():
            hits.append(f"{p} (decoded)")
    return hits


def _assert_authenticated_run(run_dir: Path) -> None:
    records = pd.read_parquet(run_dir / "requests.parquet")
    assert len(records) > 0 and set(records["http_status"]) == {200}, records["http_status"].value_counts()
    assert records["error_class"].isna().all()
    summary = json.loads((run_dir / "summary.json").read_text())
    # /metrics was scraped before and after (with prefix caching off there is no counter hit rate, but the
    # generation counter moved)
    assert summary["server_deltas"]["generation_tokens"] > 0
    assert len(pd.read_parquet(run_dir / "server_metrics.parquet")) >= 2


@pytest.fixture(scope="module")
def api_key(integration_experiment) -> str:
    return integration_experiment.api_key


@pytest.fixture(scope="module")
def experiment(integration_experiment) -> Path:
    # each server really requires the key: without it /v1 answers 401, with it 200 (probed after every cell)
    assert integration_experiment.refused == {"apc": (401, 200), "no-apc": (401, 200)}
    return integration_experiment.dir


def test_experiment_authenticates_warm_up_replay_scraping_and_reset(experiment):
    manifest = json.loads((experiment / "experiment.json").read_text())
    assert manifest["failed_cells"] == [], {n: c.get("reason") for n, c in manifest["cells"].items()}
    for name, cell in manifest["cells"].items():
        assert cell["warmup_requests"] >= 1, name  # a refused warm-up request fails the cell
        assert cell["prefix_cache_reset"] == "reset", name
        _assert_authenticated_run(experiment / cell["dir"])
    assert {s["config"]["backend"] for s in manifest["servers"].values()} == {"vllm"}


def test_replay_with_a_launched_server_authenticates_and_sigterm_leaves_no_vllm(experiment, tmp_path,
                                                                               tiny_model_dir, api_key):
    """One launch, two checks: `--api-key=KEY` in `extra_args` authenticates every request of `kvscope replay
    --server`, and SIGTERM mid-run exits 143 with the records so far whole and no vLLM process left.

    An interrupted replay writes no manifest.json, summary.json or Parquet files (replay/runner.py writes them
    after the run), so what it writes is checked: the records, the /metrics spool, and server.log, whose first
    line is kvscope's redacted command and whose access log shows the prefix-cache reset and every answer."""
    model = private_model_copy(tiny_model_dir, tmp_path)  # its path names this test's vLLM processes
    # 6 sessions: long enough that the SIGTERM after the first records lands mid-run
    trace = generate_from_file("agent-coding", model, seed=0, scale=0.02, sessions=6, max_context=1500)
    trace.write(tmp_path / "trace")
    server_yaml = tmp_path / "server.yaml"
    server_yaml.write_text(f"model: {model}\nserved_model_name: tiny\nmax_model_len: 2048\n"
                           f"kv_cache_memory_bytes: 32M\nstartup_timeout_s: 240\nextra_args: ['--api-key={api_key}']\n")
    run_dir = experiment / "replay-run"  # inside the experiment folder, so the grep below covers it
    proc = kvscope_popen("replay", str(tmp_path / "trace"), "--server", str(server_yaml), "--out", str(run_dir),
                         "--concurrency", "1", "--time-scale", "0", "--scrape-interval", "0.2", "--no-progress")
    records, spool = run_dir / "requests.jsonl", run_dir / "server_metrics.jsonl"

    def generated_tokens() -> list[float]:  # vLLM's generation counter at each authenticated /metrics scrape
        whole = spool.read_text().split("\n")[:-1] if spool.exists() else []  # a line being written is left out
        return [json.loads(x)["generation_tokens"] for x in whole]

    try:
        wait_for(lambda: records.exists() and records.stat().st_size > 0, 300, "the replay to record requests")
        wait_for(lambda: len(generated_tokens()) >= 2 and generated_tokens()[-1] > generated_tokens()[0], 30,
                 "a /metrics scrape after the first answers")
        tree = process_tree(proc.pid)
        assert any("vllm" in " ".join(p.cmdline()) for p in tree if p.is_running())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:  # a failed wait: kvscope's parent-death watchdog then stops its vLLM
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-2000:]
    assert "kvscope: interrupted" in err and "Traceback" not in err
    assert_all_gone(tree, str(model))
    assert api_key not in out + err

    rows = [json.loads(x) for x in records.read_text().splitlines()]  # whole lines only
    assert 0 < len(rows) < trace.num_requests  # interrupted mid-run
    assert {r["http_status"] for r in rows} == {200} and [r["error_class"] for r in rows] == [None] * len(rows)
    assert generated_tokens()[-1] > generated_tokens()[0]
    log = (run_dir / "server.log").read_text()
    command = log.splitlines()[0]
    assert command.startswith("$ ") and "--api-key=<redacted>" in command, command
    assert '"POST /reset_prefix_cache HTTP/1.1" 200' in log  # the fresh server's cache was reset (authenticated)
    answers = re.findall(r'"(?:GET|POST) (\S+) HTTP/1.1" (\d+)', log)  # vLLM's access log: path, status
    assert ("/v1/completions", "200") in answers and ("/metrics", "200") in answers, answers
    assert all(status == "200" for path, status in answers if path.startswith("/v1/")), answers  # never a 401


def test_no_file_of_the_experiment_the_replay_or_the_report_holds_the_key(experiment, integration_report, api_key):
    # Runs after the replay test (file order), so the replay run inside the experiment folder is covered; the
    # report is the whole one (every notebook), which test_experiment_integration checks too.
    written = [p for p in experiment.rglob("*") if p.is_file()]
    kinds = {p.name for p in written}
    assert {"experiment.json", "manifest.json", "summary.json", "apc.log", "no-apc.log", "index.html",
            "server.log"} <= kinds
    assert any(p.suffix == ".html" and p.name != "index.html" for p in written)
    assert _files_holding(experiment, api_key) == []
