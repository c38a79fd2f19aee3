"""Experiments and reports on a small real experiment (vLLM CPU server, the tiny model).

One experiment is run for the whole session (conftest's `integration_experiment`): 2 server configurations
(prefix caching on/off) x 2 workloads (append-only agent, timestamped agent) x 1 load x 2 repeats, its `apc`
server killed once between cells and started again by the runner. Every notebook is then executed on it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.harness.common.errors import ConfigError
from kvscope.harness.report.notebooks import page_names
from kvscope.harness.report.render import notebook_has_error_cells

ALL_NOTEBOOKS = page_names()
from kvscope.harness.results.loaders import load_results
from tests.test_report_browser import assert_report_renders, require_chromium

pytestmark = pytest.mark.vllm

# Figures each notebook must produce on this experiment (no speculative server here: that one shows tables).
EXPECTED_FIGURES = {
    "primer": {"kv_growth", "speculation_curves"},
    "hit_rates": {"hit_rate_by_workload", "hit_rate_by_step", "recomputed_by_transition"},
    # one load level: the Pareto plot, not a one-point latency-against-load curve
    "concurrency": {"footprint", "kv_usage_over_time", "latency_throughput"},
    "latency": {"latency_ecdf", "ttft_vs_cache", "ttft_by_load"},
    "cost": {"provider_cost_per_session", "ttl_sensitivity"},
    "ab_compare": {"paired_differences", "forest_relative_changes"},
    "explain": {"recomputed_by_cause", "what_if_hit_rate"},
}


@pytest.fixture(scope="module")
def experiment(integration_experiment) -> Path:
    """conftest's session experiment (its servers require an API key: test_auth reads the same run)."""
    return integration_experiment.dir


@pytest.fixture(scope="module")
def report(integration_report) -> Path:
    return integration_report


def test_every_cell_ran_and_results_load_as_tidy_frames(experiment):
    manifest = json.loads((experiment / "experiment.json").read_text())
    assert manifest["failed_cells"] == []
    assert len(manifest["cells"]) == 8
    # experiment.json validates, and records the validated spec with its defaults (not the raw YAML)
    from kvscope.harness.experiment.spec import ExperimentSpec
    from kvscope.harness.results.loaders import load_experiment_file, load_summary

    recorded = load_experiment_file(experiment, ExperimentSpec).spec
    assert recorded.replay.time_scale == 0 and not recorded.replay.warmup_pass
    assert recorded.replay.total_timeout_s == manifest["spec"]["replay"][
        "total_timeout_s"] == 1800.0  # a default the YAML never named
    assert recorded.cost.gpu_hourly_usd == 1.0 and recorded.slo.ttft_ms == 500
    for entry in manifest["cells"].values():
        assert load_summary(experiment / entry["dir"]).requests.sent == entry["headline"]["requests"]
    res = load_results(experiment)
    assert set(res.requests["cell"]) == set(manifest["cells"])
    assert {"server", "workload", "load", "repeat", "ttft_s", "cached_tokens"} <= set(res.requests.columns)
    # traces are generated once and shared by every cell of the workload
    assert sorted(p.name for p in (experiment / "traces").iterdir()) == ["agent", "agent-ts"]


def test_hit_rates_timestamp_far_below_append_only_and_zero_without_cache(experiment):
    res = load_results(experiment)
    by = res.cells.set_index("cell")
    agent = by.loc["apc__agent__c1__r0", "hit_server"]
    stamped = by.loc["apc__agent-ts__c1__r0", "hit_server"]
    assert agent > 0.6 and stamped < agent / 2
    assert (by.loc[by["server"] == "no-apc", "hit_server"] == 0).all()
    assert (by.loc[by["server"] == "no-apc", "would_hit"] > 0.5).any()
    # sequential cells start from a reset cache: prediction is exact request by request
    apc = res.cells[res.cells["server"] == "apc"]
    assert (apc["requests_predicted_exactly"] == apc["requests_compared"]).all()


def test_every_notebook_executes_without_error_cells_and_makes_its_figures(report):
    report_dir = report.parent
    status = json.loads((report_dir / "report.json").read_text())["notebooks"]
    assert [s["notebook"] for s in status] == ALL_NOTEBOOKS
    for s in status:
        assert s["ok"], s
        nb = report_dir / f"{s['notebook']}.ipynb"
        assert notebook_has_error_cells(nb) == []
        html = (report_dir / f"{s['notebook']}.html").read_text()
        if s["notebook"] != "primer":
            assert "<table" in html  # every analysis report shows tables
        produced = {Path(f).stem for f in s["figures"]}
        assert EXPECTED_FIGURES.get(s["notebook"], set()) <= produced, (s["notebook"], produced)
    index = report.read_text()
    for name in ALL_NOTEBOOKS:
        assert f'href="{name}.html"' in index
    assert "apc__agent__c1__r0" in index
    # the summary opens the index: the habit's finding links to its figure; one load level: no capacity claimed
    assert "<h2>Summary</h2>" in index and "A timestamp at token" in index
    assert 'href="figures/hit_rates/hit_rate_by_workload.png"' in index
    assert "Capacity is not measured" in index
    # the costliest cause links to its attribution on the explain page, with the timestamp named
    assert "agent-ts: a volatile field (date, time or id)" in index
    assert 'href="figures/explain/recomputed_by_cause.png"' in index


def test_every_report_page_renders_in_a_real_browser(report):
    """The report of this real experiment in headless Chromium: on every page the markup renders (no escaped
    tags in the visible text), every table has header cells, every figure decodes, the console is clean; a
    full-width screenshot of each page is kept in report/screenshots/."""
    require_chromium()
    checks = assert_report_renders(report.parent, expect_images=False)  # speculative: no figure without a spec server
    assert [c.page for c in checks] == ["index.html", *sorted(f"{n}.html" for n in ALL_NOTEBOOKS)]
    by_page = {c.page: c for c in checks}
    for name, figures in EXPECTED_FIGURES.items():
        assert by_page[f"{name}.html"].images >= len(figures), (name, by_page[f"{name}.html"].images)
    for name in ALL_NOTEBOOKS:
        if name != "primer":
            assert by_page[f"{name}.html"].tables > 0, name
    assert sorted(p.name for p in (report.parent / "screenshots").glob("*.png")) == sorted(
        f"{Path(c.page).stem}.png" for c in checks)
    # the index says, in words a reader sees, that the report's numbers were recomputed and none disagrees
    audit = re.search(r"Claims audit\s+(\d+) numbers stated by this report were recomputed from the request "
                      r"records[^:]*: (\d+) disagree", by_page["index.html"].visible_text)
    assert audit is not None and int(audit.group(1)) >= 5 and audit.group(2) == "0", \
        by_page["index.html"].visible_text[:3000]


def test_compare_same_configuration_twice_is_not_significant(experiment, tmp_path):
    # Two repeats of one configuration, neither of them the first cell after the server started (that one still
    # runs slower on vLLM CPU even after warm-up; see the closing notes).
    cells = experiment / "cells"
    same = [str(cells / "apc__agent-ts__c1__r0"), str(cells / "apc__agent-ts__c1__r1")]

    def compare(*extra: str) -> dict[str, dict]:
        out = tmp_path / f"v{len(list(tmp_path.glob('v*.json')))}.json"
        r = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "compare", *same, "--out",
                            str(tmp_path / "same"), "--resamples", "1000", "--json", str(out), *extra],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return {m["metric"]: m for m in json.loads(out.read_text())["metrics"]}

    # One run a side: run-to-run noise is not measured, so no latency verdict; the hit rate on identical traffic
    # from a reset cache is the same in both.
    one = compare()
    latency = [m for m in one if m.endswith("_s") and not m.endswith("_per_s")]
    assert latency and all(one[m]["verdict"] == "inconclusive" for m in latency)
    assert one["hit_rate"]["verdict"] not in ("better", "worse")
    assert (tmp_path / "same" / "ab_compare.html").exists()
    # With the run-to-run noise measured on the repeats of the other cells (pooled within each cell's repeats,
    # 3 degrees of freedom), the same configuration twice is still not called better or worse.
    noise = [str(cells / f"{c}__r{r}") for c in ("apc__agent__c1", "no-apc__agent__c1", "no-apc__agent-ts__c1")
             for r in (0, 1)]
    known = compare("--no-html", "--run-noise-from", *noise)
    assert known["ttft_p50_s"]["verdict"] not in ("better", "worse"), known["ttft_p50_s"]
    assert known["ttft_p50_s"]["ci_low"] <= known["ttft_p50_s"]["diff"] <= known["ttft_p50_s"]["ci_high"]


def test_compare_prefix_caching_on_vs_off_reports_hit_and_ttft_differences(experiment):
    from kvscope.harness.analysis.ab import compare_runs

    res_on = load_results(experiment / "cells" / "apc__agent__c1__r0")
    res_off = load_results(experiment / "cells" / "no-apc__agent__c1__r0")
    t = compare_runs(res_on.requests, res_off.requests, resamples=1000).set_index("metric")
    hit = t.loc["hit_rate"]
    assert hit["a"] > 0.6 and hit["b"] == 0 and hit["ci_high"] < 0 and hit["verdict"] == "worse"
    ttft = t.loc["ttft_p50_s"]
    assert ttft["ci_low"] <= ttft["diff"] <= ttft["ci_high"]
    assert ttft["b"] > ttft["a"]  # recomputing the whole prompt takes longer


def test_resume_skips_finished_cells(experiment, tiny_model_dir):
    spec = experiment.parents[2] / "itest.yaml"
    r = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "experiment", "run", str(spec), "--out",
                        str(experiment.parents[1]), "--run-id", "r1", "--resume", "--no-report"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8 cells, 0 to run" in r.stdout
    assert "starting vLLM" not in r.stdout


def test_a_server_killed_between_cells_is_started_again_for_its_next_cell(integration_experiment):
    """conftest SIGKILLs the `apc` server's process group after one of its cells (its key probe ran first); the
    runner finds it dead at apc's next cell and starts it again, and every cell is ok. (A configuration whose
    server cannot start: tests/test_experiment_failures.py.)"""
    from tests.conftest import INTEGRATION_KILLED_AFTER

    found = integration_experiment
    assert found.killed == [INTEGRATION_KILLED_AFTER] == ["apc__agent-ts__c1__r0"]
    manifest = json.loads((found.dir / "experiment.json").read_text())
    cells = manifest["cells"]
    assert manifest["failed_cells"] == [] and {c["status"] for c in cells.values()} == {"ok"}
    assert manifest["servers"]["apc"]["restarts"] == 1 and manifest["servers"]["no-apc"]["restarts"] == 0
    # apc's cells in the order they ran: two on the first process, two on the one started after the kill
    pids = found.server_pids
    assert pids["apc__agent__c1__r0"] == pids["apc__agent-ts__c1__r0"] != pids["apc__agent__c1__r1"] \
        == pids["apc__agent-ts__c1__r1"]
    assert pids["no-apc__agent__c1__r0"] == pids["no-apc__agent-ts__c1__r1"]
    # the new process's first cell wrote its whole KV pool again before replaying (a later cell only warms up)
    assert cells["apc__agent__c1__r1"]["warmup_requests"] > cells["apc__agent-ts__c1__r1"]["warmup_requests"]
    # both launches are in the configuration's one log
    log = (found.dir / manifest["servers"]["apc"]["log"]).read_text()
    assert sum(line.startswith("$ ") for line in log.splitlines()) == 2


def test_names_cannot_escape_the_results_directory(tmp_path):
    from kvscope.harness.experiment.spec import load_experiment_spec

    for bad in ("../evil", "a/b", "..", ".hidden"):
        p = tmp_path / "s.yaml"
        p.write_text(f"name: '{bad}'\nservers: {{x: {{}}}}\nworkloads: {{w: {{spec: chat}}}}\n")
        with pytest.raises(ConfigError, match="name"):
            load_experiment_spec(p)
    p = tmp_path / "s.yaml"
    p.write_text("name: ok\nservers: {'../x': {}}\nworkloads: {w: {spec: chat}}\n")
    with pytest.raises(ConfigError, match="server configuration name"):
        load_experiment_spec(p)




def test_the_claims_audit_passes_on_the_integration_experiments_report(experiment, report):
    """The claims audit (analysis/audit.py) on a real vLLM experiment's rendered report, in CI: every number a
    page states with its selection is what that selection's request records give, and the sentence writes it.
    (The quickstart's own records are audited in CI by test_selection_audit, from a recorded run.)"""
    from kvscope.harness.analysis.audit import audit_experiment

    audit = audit_experiment(experiment)
    print(audit.summary())
    assert len(audit.lines) >= 5 and not audit.failures, audit.summary()
