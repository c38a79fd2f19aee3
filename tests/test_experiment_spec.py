from pathlib import Path

import pytest

from kvscope.harness.common.errors import ConfigError
from kvscope.harness.experiment.runner import plan_cells
from kvscope.harness.experiment.spec import load_experiment_spec

REPO = Path(__file__).resolve().parents[1]


def test_shipped_specs_validate_and_plan_in_stated_order():
    spec, _ = load_experiment_spec(REPO / "experiments" / "quickstart.yaml")
    cells = [c.name for c in plan_cells(spec)]
    assert len(cells) == 3 * 3 * 1 * 3  # servers x grid workloads x loads x repeats; agent-sweep is sweep-only
    assert cells[:2] == ["baseline__agent-coding__c2__r0", "baseline__agent-coding-timestamped__c2__r0"]
    assert cells[9] == "baseline__agent-coding__c2__r1"  # repeat-major: the arms interleave
    assert {c.split("__")[0] for c in cells} == {"baseline", "no-prefix-cache", "ngram-k4"}
    assert spec.sweep is not None and len(spec.sweep.levels) >= 5
    assert spec.sweep.ttft_slo.unloaded_factor == 3  # relative: a capacity on slow and fast machines alike
    gpu, _ = load_experiment_spec(REPO / "experiments" / "gpu-llama31-8b.yaml")
    assert gpu.model.source == "hf" and "eagle3" in gpu.servers


@pytest.mark.parametrize("body,needles", [
    ("name: x\nservers: {a: {}}\nworkloads: {w: {spec: chat}}\nrepeat: 2\n", ["repeat", "unknown field", "repeats"]),
    ("name: x\nservers: {a: {}}\nworkloads: {w: {spec: chat, scael: 2}}\n", ["workloads.w.scael", "unknown field"]),
    ("name: x\nservers: {a: {}}\nworkloads: {w: {spec: chat}}\nloads: [{concurrency: 1, session_rate: 2}]\n",
     ["loads[0]", "exactly one of concurrency or session_rate"]),
    ("name: x\nservers: {a: {max_num_seqs: lots}}\nworkloads: {w: {spec: chat}}\n", ["servers.a", "max_num_seqs"]),
    ("name: x\nservers: {a: {prefix_cache: false}}\nworkloads: {w: {spec: chat}}\n",
     ["servers.a", "prefix_cache", "enable_prefix_caching"]),
    ("name: x\nworkloads: {w: {spec: chat}}\n", ["servers", "required"]),
])
def test_spec_errors_name_file_field_and_allowed(tmp_path, body, needles):
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    with pytest.raises(ConfigError) as e:
        load_experiment_spec(p)
    msg = str(e.value)
    assert str(p) in msg
    for n in needles:
        assert n in msg, (n, msg)
