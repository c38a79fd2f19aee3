"""A replay whose server cannot empty its prefix cache (vLLM without VLLM_SERVER_DEV_MODE=1 answers 404 on
/reset_prefix_cache) says so: one warning line on stderr, the data-quality flag ``cache_not_reset`` in
summary.json, and a caveat on the report's hit-rate page. Without them a warm cache made the measured hit
rate exceed the exact model's prediction on every request, silently."""

from __future__ import annotations

import json

from kvscope.harness.cli.main import main
from kvscope.workloads.generate import synthetic_trace
from tests.doubles.faultserver import FaultConfig, FaultServer


def _replay(tmp_path, capsys, dev_mode: bool, *extra: str):
    trace = synthetic_trace(2, steps=2, prompt_tokens=32, output_tokens=2).write(tmp_path / f"trace-{dev_mode}")
    out = tmp_path / f"run-{dev_mode}-{len(extra)}"
    with FaultServer(FaultConfig(model="tiny", dev_mode=dev_mode)) as server:
        rc = main(["replay", str(trace), "--endpoint", server.endpoint, "--out", str(out), "--concurrency", "2",
                   "--time-scale", "0", "--no-progress", *extra])
    captured = capsys.readouterr()
    return rc, captured.err, json.loads((out / "summary.json").read_text()), out


def test_a_cache_that_cannot_be_reset_is_one_warning_line_and_a_flag(tmp_path, capsys):
    rc, err, summary, out = _replay(tmp_path, capsys, dev_mode=False)
    assert rc == 0  # the run itself is fine: its numbers carry the flag
    warnings = [line for line in err.splitlines() if "prefix cache not reset" in line]
    assert len(warnings) == 1 and warnings[0].startswith("kvscope: warning:") and "HTTP 404" in warnings[0]
    assert "VLLM_SERVER_DEV_MODE=1" in warnings[0]
    dq = summary["data_quality"]
    assert "cache_not_reset" in dq["flags"] and "HTTP 404" in dq["cache_not_reset"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(v.startswith("not reset") for v in manifest["prefix_cache_reset"].values())

    from kvscope.harness.analysis.findings import caveats
    from kvscope.harness.results.loaders import load_results

    [caveat] = [c for c in caveats(load_results(out)) if "could not be emptied" in c.sentence]
    assert "VLLM_SERVER_DEV_MODE=1" in caveat.sentence


def test_a_reset_cache_or_one_kept_on_purpose_is_not_flagged(tmp_path, capsys):
    rc, err, summary, _ = _replay(tmp_path, capsys, dev_mode=True)
    assert rc == 0 and "not reset" not in err
    assert "cache_not_reset" not in summary["data_quality"]["flags"] and summary["data_quality"]["cache_not_reset"] is None
    rc, err, summary, _ = _replay(tmp_path, capsys, False, "--no-reset-prefix-cache")  # asked for a warm cache
    assert rc == 0 and "not reset" not in err and "cache_not_reset" not in summary["data_quality"]["flags"]


def test_a_server_launched_for_the_run_needs_no_reset_and_is_not_flagged():
    from kvscope.harness.replay.servers import reset_prefix_caches
    from kvscope.harness.serving.backend import Backend

    with FaultServer(FaultConfig(model="tiny", dev_mode=False)) as server:
        backend = Backend.create("vllm", endpoint=server.endpoint)
        details, why = reset_prefix_caches([backend], fresh=True)  # `kvscope replay --server`: nothing served yet
        assert why is None and "empty anyway" in details[server.endpoint]
        details, why = reset_prefix_caches([backend])
        assert why is not None and "HTTP 404" in why
