"""An experiment's ``predicted:`` deployments: refused at spec load when unknown (before any server starts),
predicted on the run's own traces after the live cells, and shown on the report's index as "On your GPU"
beside what the CPU measured, read in Chromium.

The live configuration is an attached OpenAI-compatible endpoint on the in-process mock
(tests/doubles/faultserver.py), so no vLLM is needed.
"""

from __future__ import annotations

import pytest
from kvscope.harness.cli.main import main
from kvscope.harness.experiment.runner import run_experiment
from kvscope.harness.results.loaders import load_experiment_file, load_experiment_predictions, load_results

from tests.doubles.faultserver import FaultConfig, FaultServer

#: gpu_memory_utilization that leaves an H100 serving llama-3.1-8b a KV pool of a few thousand tokens
TIGHT = 0.223


def _spec(tmp_path, predicted: str, server: str = "good: {backend: openai, endpoint: 'http://127.0.0.1:9', "
                                                  "block_size: 16}", model: str = "{source: tiny}") -> str:
    p = tmp_path / "spec.yaml"
    p.write_text(f"""\
name: ongpu
model: {model}
servers:
  {server}
workloads:
  agent: {{spec: agent-coding, scale: 0.01, sessions: 3, seed: 0, max_context: 800}}
  habit: {{spec: agent-coding-timestamped, scale: 0.01, sessions: 3, seed: 0, max_context: 800}}
loads: [{{concurrency: 2}}]
repeats: 1
replay: {{time_scale: 0}}
predicted:
{predicted}""")
    return str(p)


@pytest.mark.parametrize("predicted,needle", [
    ("  configs: {h100: {gpu: h100-sxmm, model: llama-3.1-8b}}\n", "unknown GPU 'h100-sxmm'"),
    ("  configs: {h100: {gpu: h100-sxm, model: no-such-model}}\n", "unknown model 'no-such-model'"),
])
def test_an_unknown_gpu_or_model_stops_the_run_before_anything_starts(tmp_path, capsys, predicted, needle):
    spec = _spec(tmp_path, predicted)
    assert main(["experiment", "run", spec, "--out", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "predicted.configs.h100" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "results").exists()  # no run directory, no model, no server


def test_the_runner_predicts_each_deployment_on_each_workload_and_the_index_shows_them(
        tmp_path, tiny_model_dir, capsys):
    from kvscope.harness.report.render import write_index

    from tests.test_report_browser import require_chromium

    with FaultServer(FaultConfig(output_len=4)) as srv:
        # `tight`: an H100 left ~2,200 tokens of KV pool, so 8 sessions of up to 2,000 tokens (the prediction
        # traces: 5x the workload's scale) overflow it
        spec = _spec(tmp_path, "  configs:\n    h100-8b: {gpu: h100-sxm, model: llama-3.1-8b}\n"
                               "    h200-70b: {gpu: h200-sxm, model: llama-3.1-70b, tp: 4}\n"
                               f"    tight: {{gpu: h100-sxm, model: llama-3.1-8b, gpu_memory_utilization: {TIGHT}}}\n"
                               "  workloads: [agent]\n  slo_ttft_p90_ms: 1500\n  sessions: 8\n  scale: 0.05\n  max_context: 2000\n",
                     server=f"good: {{backend: openai, endpoint: '{srv.endpoint}', block_size: 16}}",
                     model=f"{{source: path, path: {tiny_model_dir}, served_model_name: tiny}}")
        phases: dict[str, float] = {}
        run_dir = run_experiment(spec, out=tmp_path / "results", run_id="x", phases_s=phases)
    out = capsys.readouterr().out
    assert "predict" in phases  # the runner's phase line names the predict phase
    manifest = load_experiment_file(run_dir / "experiment.json")
    assert manifest.cells["good__agent__c2__r0"].status == "ok" and manifest.completed_at is not None
    preds = load_experiment_predictions(run_dir)
    # only the workloads `predicted.workloads` names, every configuration, each a typed file
    assert [(p.config, p.workload) for p in preds] == [("h100-8b", "agent"), ("h200-70b", "agent"), ("tight", "agent")]
    # the prediction trace: the workload's spec with `sessions` sessions (the live cells drove 3)
    assert "predicted agent: a 8-session prediction trace" in out
    for p in preds:
        f = p.prediction
        assert f.predicted is True and f.load_kind == "concurrency"
        assert f.slo.ttft_ms == 1500 and f.slo.tpot_ms == 100
        assert len({r.session_id for r in f.requests}) == 8
        assert f.trace.endswith("predictions/traces/agent")
        assert f.step_model.kind == "roofline" and f.step_model.mfu is not None
        assert f.cost is not None and f.cost.usd_per_1000_sessions is not None
        assert f"predicted {p.config} x agent" in out
    for p in preds[:2]:  # a GPU's pool holds all 8: the curve climbs to them
        assert [pt.load for pt in p.prediction.load_curve] == [1.0, 2.0, 4.0, 8.0]
    tight = preds[2].prediction
    # the driven capacity: below the trace's sessions, the curve past it, the summary and cost at that load
    assert tight.slo_capacity_load is not None and tight.slo_capacity_load < 8
    assert tight.load_curve[-1].load > tight.slo_capacity_load and not tight.load_curve[-1].meets_slo
    assert tight.run.concurrency == tight.slo_capacity_load
    by = {p.config: p.prediction.deployment for p in preds}
    assert (by["h100-8b"].gpu, by["h100-8b"].tp, by["h200-70b"].gpu, by["h200-70b"].tp) == ("h100-sxm", 1, "h200-sxm", 4)

    require_chromium()
    from kvscope.harness.report.browser import check_report_pages

    report_dir = tmp_path / "report"
    report_dir.mkdir()
    write_index(load_results(run_dir), report_dir, [])
    (page,) = check_report_pages(report_dir)
    assert not page.problems, page.problems
    text = page.visible_text
    assert "On your GPU" in text
    section = text[text.index("On your GPU"):text.index("Reports")]
    assert "h100-8b: llama-3.1-8b on 1 × H100" in section and "h200-70b: llama-3.1-70b on 4 × H200" in section
    assert "Efficiency factors used: roofline step model with mfu" in section
    assert "TTFT p90 ≤ 1500 ms" in section
    h100 = preds[0].prediction
    ttft_ms = f"{next(pt for pt in h100.load_curve if pt.load == h100.slo_capacity_load).ttft_p90_s * 1e3:,.0f} ms"
    assert f"\t{ttft_ms} predicted\t" in section  # the figure, and its cell says predicted
    assert section.count(" predicted\t") == 3 * 9  # every predicted cell of the three tables is marked
    assert "prediction trace of 8 sessions" in section
    measured = manifest.cells["good__agent__c2__r0"].headline
    assert f"good at c2 (1 cell), TTFT p90 {measured.ttft_p90_s * 1e3:,.0f} ms" in section
