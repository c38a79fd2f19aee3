"""The cost page on a constructed experiment (generated traces, typed cell tables, no server): the workload
scale its $ figures depend on, self-hosted $ per 1,000 sessions beside the provider's, and the serving machine
named as what it is.

The quickstart's cost page priced "$ per 1,000 sessions" and "prompts below the provider's minimum" on
sessions at 2 % of their preset's prompt lengths without saying so, gave self-hosted cost only per million
tokens (nothing to set against a provider's $ per 1,000 sessions), and priced its 2-core CPU VM at "$0.10 per
GPU-hour"."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvscope.harness.analysis import findings as F
from kvscope.harness.analysis.pages import cost
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import CostSpec, ExperimentFile, ExperimentSpecCore
from pydantic import ValidationError

SCALE, CAP = 0.02, 1500


@pytest.fixture(scope="module")
def traces(tiny_model_dir, tmp_path_factory) -> Path:
    from kvscope.workloads.generate import generate_from_file

    root = tmp_path_factory.mktemp("cost-exp")
    generate_from_file("agent-coding", tiny_model_dir, seed=3, scale=SCALE, sessions=3,
                       max_context=CAP).write(root / "traces" / "agent")
    return root


def spec(cost_block: dict) -> ExperimentSpecCore:
    return ExperimentSpecCore.model_validate({
        "name": "t", "slo": {"ttft_ms": 250}, "cost": cost_block,
        "workloads": {"agent": {"spec": "agent-coding", "scale": SCALE, "output_scale": 0.15, "sessions": 3,
                                "seed": 3, "max_context": CAP}}})


def results(root: Path, cost_block: dict, duration_s: float = 36.0) -> ExperimentResults:
    """One caching cell replaying the trace's sessions at concurrency 2 in ``duration_s`` seconds."""
    meta = json.loads((root / "traces" / "agent" / "trace.json").read_text())
    req = pd.read_parquet(root / "traces" / "agent" / "requests.parquet")
    n = meta["num_requests"]
    name = "baseline__agent__c2__r0"
    prompt = req["prompt_tokens"].to_numpy() if "prompt_tokens" in req else np.full(n, 400)
    rec = pd.DataFrame({"cell": name, "server": "baseline", "workload": "agent", "load": "c2", "repeat": 0,
                        "request_id": np.arange(n), "session_id": req["session_id"].astype(str).to_numpy(),
                        "step": np.arange(n), "prompt_tokens": prompt, "cached_tokens": prompt // 2,
                        "predicted_cached_tokens": prompt // 2, "output_tokens": 20,
                        "ttft_s": 0.05, "error_class": None, "in_window": True})
    cell = {"cell": name, "server": "baseline", "workload": "agent", "load": "c2", "repeat": 0, "status": "ok",
            "prefix_caching": True, "speculative": False, "concurrency": 2, "duration_s": duration_s,
            "output_tok_per_s": 50.0, "prompt_tok_per_s": 900.0, "requests": n, "would_hit": None}
    experiment = ExperimentFile(experiment="t", run_id="r", spec=spec(cost_block), spec_path="t.yaml",
                                created_at=0.0, traces={"agent": "traces/agent"})
    return ExperimentResults(root=root, experiment=experiment, cells=pd.DataFrame([cell]), requests=rec,
                             metrics=pd.DataFrame())


def test_the_machine_is_named_and_the_older_keys_still_read():
    new = CostSpec.model_validate({"self_hosted": {"hourly_usd": 0.1, "hardware": "a 2-core CPU VM"}})
    old = CostSpec.model_validate({"gpu_hourly_usd": 0.1, "gpu_name": "a 2-core CPU VM"})
    assert new == old and old.self_hosted.hardware == "a 2-core CPU VM" and old.gpu_hourly_usd == 0.1
    assert CostSpec.model_validate({"gpu_hourly_usd": 3.5}).self_hosted.hardware == "the serving machine"
    with pytest.raises(ValidationError, match="not both"):
        CostSpec.model_validate({"gpu_hourly_usd": 1, "self_hosted": {"hourly_usd": 1}})
    with pytest.raises(ValidationError, match="hourly_usd"):
        CostSpec.model_validate({"self_hosted": {"hourly_usd": 0}})
    with pytest.raises(ValidationError, match="hardwar"):
        CostSpec.model_validate({"self_hosted": {"hourly_usd": 1, "hardwar": "typo"}})


def test_self_hosted_cost_per_1000_sessions_sits_beside_the_providers(traces, tmp_path):
    """3 sessions in 36 s on a $0.10/hour machine: $0.10 x 36/3600 / 3 x 1000 = $0.33 per 1,000 sessions,
    beside the cheapest provider's figure for the same sessions; the machine is named, never 'GPU-hour'."""
    res = results(traces, {"pricing": ["anthropic-sonnet-5m", "deepseek-v3.2"],
                           "self_hosted": {"hourly_usd": 0.10, "hardware": "a 2-core CPU VM"}})
    per = cost.self_hosted_per_session(res, 0.10, "a 2-core CPU VM")
    [row] = per.to_dict("records")
    assert row["usd_per_1000_sessions"] == pytest.approx(0.10 * 36 / 3600 / 3 * 1000)
    pc = cost.provider_costs(res, ["anthropic-sonnet-5m", "deepseek-v3.2"])
    assert row["usd_per_1000_sessions_provider"] == pytest.approx(pc["usd_per_1000_sessions"].min())
    assert row["hardware"] == "a 2-core CPU VM" and row["within_capacity"]
    found = F.page_findings(res, "cost")
    [agent] = [f for f in found if f.sentence.startswith("agent: cheapest provider")]
    assert "; self-hosted on a 2-core CPU VM at $0.10 an hour: $0.33 per 1,000 sessions (baseline at c2, 36 s for 3 " \
           "sessions)." in agent.sentence
    assert agent.numbers["self_hosted_usd_per_1000_sessions"] == pytest.approx(1 / 3)
    assert not any("GPU-hour" in f.sentence for f in found)
    assert cost._cost_from_spec(res.spec) == {"pricing": ["anthropic-sonnet-5m", "deepseek-v3.2"],
                                              "hourly_usd": 0.1, "hardware": "a 2-core CPU VM"}


def test_the_scale_and_its_consequences_are_stated(traces):
    res = results(traces, {"pricing": ["anthropic-sonnet-5m"]})
    [scale] = [f for f in F.page_findings(res, "cost") if f.question == "caveat" and f.sentence.startswith("Scale")]
    sc = cost.workload_scale(res).set_index("workload")
    assert sc.loc["agent", "scale"] == SCALE and sc.loc["agent", "max_context"] == CAP
    assert scale.sentence.startswith(f"Scale: agent ran at prompt scale 0.02, outputs 0.15, contexts capped at 1,500 "
                                     f"tokens ({sc.loc['agent', 'sessions_capped']} of 3 sessions ended early at the cap)")
    assert "a session at the presets' full length has ~50x the prompt tokens" in scale.sentence
    prompts = res.requests["prompt_tokens"]
    below, full = (prompts < 1024).mean(), (prompts / SCALE < 1024).mean()
    assert scale.numbers["share_below_minimum"] == pytest.approx(below)
    assert scale.numbers["share_below_minimum_full_scale"] == pytest.approx(full) and full < below
    assert "anthropic-sonnet-5m's 1,024-token minimum cacheable length, where at full scale" in scale.sentence
    # at full scale and without a cap there is nothing to say
    full_res = results(traces, {"pricing": ["anthropic-sonnet-5m"]})
    full_res.experiment.spec.model_extra["workloads"]["agent"].update(scale=1.0, max_context=None)
    assert cost.scale_caveat(full_res) is None
