"""Acceptance: against real vLLM started with an API key, kvscope authenticates every request it sends and
writes the key into none of its files.

The key reaches vLLM three ways, and each is run against real vLLM: `api_key_env` naming a variable of
kvscope's environment and `VLLM_API_KEY` in the config's `env:` are the two servers of the session's
integration experiment (conftest's `integration_experiment`: the experiment and its report are the ones
test_experiment_integration checks, so no extra server starts), and `--api-key=KEY` in `extra_args` is a
`kvscope replay --server` here.  Where kvscope takes the key from in each form, the two-word `--api-key KEY`
included, is unit-tested in tests/test_server_config.py.  vLLM guards only `/v1/*` with the key (not
`/metrics` or `/reset_prefix_cache`); that every request also carries the header there is checked on a server
that guards everything (tests/test_server_config.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

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


def test_replay_with_a_launched_server_authenticates(experiment, tmp_path, tiny_model_dir, api_key):
    server_yaml = tmp_path / "server.yaml"
    server_yaml.write_text(f"model: {tiny_model_dir}\nserved_model_name: tiny\nmax_model_len: 2048\n"
                           f"kv_cache_memory_bytes: 32M\nstartup_timeout_s: 240\nextra_args: ['--api-key={api_key}']\n")
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


def test_no_file_of_the_experiment_the_replay_or_the_report_holds_the_key(experiment, integration_report, api_key):
    # Runs after the replay test (file order), so the replay run inside the experiment folder is covered; the
    # report is the whole one (every notebook), which test_experiment_integration checks too.
    written = [p for p in experiment.rglob("*") if p.is_file()]
    kinds = {p.name for p in written}
    assert {"experiment.json", "manifest.json", "summary.json", "apc.log", "no-apc.log", "index.html",
            "server.log"} <= kinds
    assert any(p.suffix == ".html" and p.name != "index.html" for p in written)
    assert _files_holding(experiment, api_key) == []
