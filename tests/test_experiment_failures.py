"""An experiment whose one configuration cannot start goes on with the others, and the warm-up pass replays
each cell's trace unrecorded before measuring it: both without a real vLLM server.

The configuration that cannot start is a managed vLLM one whose `python:` is a stand-in that answers its command
line as vLLM's argparse answers an unknown flag (usage on stderr, exit 2), so the runner's launch, its log
diagnosis and its failure bookkeeping are the real ones; real vLLM refusing an unknown flag is
test_vllm_integration's `test_unknown_vllm_flag_fails_fast_naming_the_flag`. The configuration that works is an
attached OpenAI-compatible endpoint on the in-process mock (tests/doubles/faultserver.py), which counts the
completion requests it receives. Killing a real server between cells and its restart are checked on the
session's integration experiment (test_experiment_integration).
"""

from __future__ import annotations

import pytest

from kvscope.harness.experiment.runner import run_experiment
from kvscope.harness.results.loaders import load_experiment_file, load_summary
from tests.doubles.faultserver import FaultConfig, FaultServer

#: what vLLM's argparse writes for a flag it does not know, naming the unknown arguments it was given
UNKNOWN_FLAG_STAND_IN = """\
#!/bin/sh
unknown=""
for arg in "$@"; do
  case "$arg" in --no-such-*) unknown="$unknown $arg" ;; esac
done
echo "usage: api_server.py [-h] [--host HOST] [--port PORT] [--model MODEL] ..." >&2
echo "api_server.py: error: unrecognized arguments:$unknown" >&2
exit 2
"""


@pytest.fixture()
def mock_server():
    with FaultServer(FaultConfig(output_len=4)) as srv:
        yield srv


def test_a_configuration_that_cannot_start_fails_its_cells_and_the_warm_up_pass_replays_each_cell_once(
        tmp_path, tiny_model_dir, mock_server, capsys):
    stand_in = tmp_path / "fake-python"
    stand_in.write_text(UNKNOWN_FLAG_STAND_IN)
    stand_in.chmod(0o755)
    spec = tmp_path / "failing.yaml"
    spec.write_text(f"""\
name: failing
model: {{source: path, path: {tiny_model_dir}, served_model_name: tiny}}
servers:
  broken: {{python: {stand_in}, extra_args: [--no-such-vllm-flag], startup_timeout_s: 30}}
  good: {{backend: openai, endpoint: "{mock_server.endpoint}", block_size: 16}}
workloads:
  agent: {{spec: agent-coding, scale: 0.01, sessions: 1, seed: 0, max_context: 800}}
loads: [{{concurrency: 1}}, {{concurrency: 2}}]
repeats: 1
replay: {{warmup_pass: true, time_scale: 0}}
""")
    completions_after: dict[str, int] = {}  # cell -> completion requests the mock had received once it ended

    def count(cell, backend) -> None:
        completions_after[cell.name] = mock_server.stats.completions

    run_dir = run_experiment(spec, out=tmp_path / "results", run_id="x", after_cell=count)
    manifest = load_experiment_file(run_dir / "experiment.json")
    cells = manifest.cells
    # the broken configuration: each of its cells tried a start and recorded why it failed, naming the flag
    for name in ("broken__agent__c1__r0", "broken__agent__c2__r0"):
        assert cells[name].status == "failed", name
        assert "--no-such-vllm-flag" in (cells[name].reason or ""), cells[name].reason
    assert manifest.failed_cells == ["broken__agent__c1__r0", "broken__agent__c2__r0"]
    # the experiment went on: the good configuration's cells ran after them
    assert list(completions_after) == ["good__agent__c1__r0", "good__agent__c2__r0"]
    before = 0
    for name, after in completions_after.items():
        entry = cells[name]
        assert entry.status == "ok", (name, entry.reason)
        summary = load_summary(run_dir / entry.dir)
        recorded = summary.requests.sent
        assert recorded == entry.headline.requests > 0
        # warm-up requests, then the trace twice: the unrecorded warm-up pass and the measured replay
        assert after - before == entry.warmup_requests + 2 * recorded, (name, after - before, recorded)
        before = after
        # an attached endpoint cannot empty its prefix cache: recorded on the cell and flagged in its summary
        assert (entry.prefix_cache_reset or "").startswith("not reset"), entry.prefix_cache_reset
        assert "cache_not_reset" in summary.data_quality.flags
    assert manifest.servers["good"].restarts == 0
    assert not list((run_dir / "cells").glob(".warmup-*"))  # the warm-up pass leaves no directory behind
    assert "kvscope: warning: prefix cache not reset" in capsys.readouterr().err
