"""Acceptance: against real vLLM started with an API key, kvscope authenticates every request it sends and
writes the key into none of its files.

The key reaches vLLM three ways, one server configuration each, in one experiment (three server starts):
`api_key_env` naming a variable of kvscope's environment, `VLLM_API_KEY` in the config's `env:`, and
`--api-key` in `extra_args`. A fourth start is `kvscope replay --server` with `--api-key=KEY` in its config
file. vLLM guards only `/v1/*` with the key (not `/metrics` or `/reset_prefix_cache`); that every request
also carries the header there is checked on a server that guards everything (tests/test_server_config.py).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pandas as pd
import pytest

from kvscope.harness.experiment.runner import run_experiment
from kvscope.harness.report.render import render_report

pytestmark = pytest.mark.vllm

KEY_VAR = "KVSCOPE_ACCEPTANCE_API_KEY"

SPEC = """\
name: auth
model: {{source: path, path: {model}, served_model_name: tiny}}
server_defaults: {{max_model_len: 1024, kv_cache_memory_bytes: 16M, startup_timeout_s: 240}}
servers:
  key-env-var: {{api_key_env: {var}}}
  key-in-env: {{env: {{VLLM_API_KEY: {key}}}}}
  key-in-args: {{extra_args: [--api-key, {key}]}}
workloads:
  agent: {{spec: agent-coding, scale: 0.02, sessions: 1, seed: 3, max_context: 700}}
loads: [{{concurrency: 1}}]
repeats: 1
replay: {{warmup_requests: 1, scrape_interval_s: 0.2, time_scale: 0}}
"""


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
    assert summary["hit_rate"]["metrics_counters"] is not None  # /metrics was scraped before and after
    assert len(pd.read_parquet(run_dir / "server_metrics.parquet")) >= 2


@pytest.fixture(scope="module")
def api_key() -> str:
    return "sk-kvscope-" + secrets.token_hex(12)


@pytest.fixture(scope="module")
def experiment(require_vllm, tiny_model_dir, tmp_path_factory, api_key) -> Path:
    mp = pytest.MonkeyPatch()
    mp.setenv(KEY_VAR, api_key)
    root = tmp_path_factory.mktemp("auth")
    spec = root / "auth.yaml"
    spec.write_text(SPEC.format(model=tiny_model_dir, var=KEY_VAR, key=api_key))
    refused: dict[str, tuple[int, int]] = {}

    def probe(cell, server) -> None:  # the server really requires the key: without it /v1 answers 401
        url = server.endpoint + "/v1/models"
        refused[cell.server] = (httpx.get(url, timeout=10).status_code,
                                httpx.get(url, timeout=10, headers={"Authorization": f"Bearer {api_key}"}).status_code)

    try:
        run_dir = run_experiment(spec, out=root / "results", run_id="r1", after_cell=probe)
    finally:
        mp.undo()
    assert refused == {"key-env-var": (401, 200), "key-in-env": (401, 200), "key-in-args": (401, 200)}
    return run_dir


def test_experiment_authenticates_warm_up_replay_scraping_and_reset(experiment):
    manifest = json.loads((experiment / "experiment.json").read_text())
    assert manifest["failed_cells"] == [], {n: c.get("reason") for n, c in manifest["cells"].items()}
    for name, cell in manifest["cells"].items():
        assert cell["warmup_requests"] >= 1, name  # a refused warm-up request fails the cell
        assert cell["prefix_cache_reset"] == "reset", name
        _assert_authenticated_run(experiment / cell["dir"])
    assert {s["config"]["backend"] for s in manifest["servers"].values()} == {"vllm"}


def test_replay_with_a_launched_server_authenticates(experiment, tmp_path, tiny_model_dir, api_key):
    server_yaml = tmp_path / "server.yaml"
    server_yaml.write_text(f"model: {tiny_model_dir}\nserved_model_name: tiny\nmax_model_len: 1024\n"
                           f"kv_cache_memory_bytes: 16M\nstartup_timeout_s: 240\nextra_args: ['--api-key={api_key}']\n")
    run_dir = experiment / "replay-run"  # inside the experiment folder, so the grep below covers it
    out = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "replay", str(experiment / "traces" / "agent"),
                          "--server", str(server_yaml), "--out", str(run_dir), "--concurrency", "1",
                          "--time-scale", "0", "--scrape-interval", "0.2", "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert api_key not in out.stdout + out.stderr
    _assert_authenticated_run(run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert list(manifest["prefix_cache_reset"].values()) == ["reset"]
    assert manifest["server_config"]["extra_args"] == ["--api-key=<redacted>"]
    assert (run_dir / "server.log").stat().st_size > 0


def test_no_file_of_the_experiment_the_replay_or_the_report_holds_the_key(experiment, api_key):
    # Runs after the replay test (file order), so the replay run inside the experiment folder is covered.
    render_report(experiment, notebooks=["hit_rates"], progress=False)
    written = [p for p in experiment.rglob("*") if p.is_file()]
    kinds = {p.name for p in written}
    assert {"experiment.json", "manifest.json", "summary.json", "key-in-args.log", "index.html"} <= kinds
    assert any(p.suffix == ".html" and p.name != "index.html" for p in written)
    assert _files_holding(experiment, api_key) == []
