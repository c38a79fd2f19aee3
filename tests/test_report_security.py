"""Reports never run text from traces, model output or results as code, and never leave their folders."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.report.render import run_notebook, write_index
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import ExperimentFile, ExperimentSpecCore
from kvscope.harness.experiment.runner import safe_child
from tests.test_report_browser import assert_report_renders, require_chromium

SCRIPT = "<script>alert(1)</script>"
PAYLOAD = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


def _results(tmp_path) -> ExperimentResults:
    cells = pd.DataFrame([{"cell": "a__w__c1__r0", "server": "a", "workload": "w", "load": "c1", "repeat": 0,
                           "status": "failed", "reason": f"server said {SCRIPT}", "requests": 3}])
    experiment = ExperimentFile(experiment="x", run_id="r", spec=ExperimentSpecCore(name="x", description=SCRIPT),
                                spec_path="x.yaml", created_at=0.0)
    return ExperimentResults(root=tmp_path, cells=cells,
                             requests=pd.DataFrame(), metrics=pd.DataFrame(), experiment=experiment)


def test_index_escapes_everything_it_shows(tmp_path):
    index = write_index(_results(tmp_path), tmp_path, [])
    html = index.read_text()
    assert SCRIPT not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>" in html  # the spec's description, read typed
    assert "Content-Security-Policy" in html


def test_notebook_output_with_script_is_escaped_in_html(tmp_path):
    import nbformat

    from tests.doubles.scratch_notebook import write_report_notebook

    nb_dir = tmp_path / "nbs"
    write_report_notebook(nb_dir, "xss", [nbformat.v4.new_code_cell(
        "import pandas as pd\nfrom IPython.display import display\n"
        f"display(pd.DataFrame({{'generated_text': ['{SCRIPT}']}}))\nprint('{SCRIPT}')")])
    r = run_notebook("xss", tmp_path / "out", {"experiment_dir": "", "figures_dir": str(tmp_path / "f")},
                     notebooks_dir=nb_dir)
    assert r.ok, r.error
    html = r.html.read_text()
    assert SCRIPT not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_notebooks_run_only_from_the_named_folder(tmp_path):
    with pytest.raises(KvscopeError, match="not found"):
        run_notebook("../../etc/passwd", tmp_path, {}, notebooks_dir=tmp_path)
    with pytest.raises(KvscopeError, match="not found"):
        run_notebook("no_such_notebook", tmp_path, {})


def test_safe_child_refuses_escapes(tmp_path):
    assert safe_child(tmp_path, "a", "b") == (tmp_path / "a" / "b").resolve()
    for bad in (("..", "x"), ("/etc",), ("a", "../../x")):
        with pytest.raises(KvscopeError, match="outside"):
            safe_child(tmp_path, *bad)


@pytest.fixture(scope="module")
def replay_report(tmp_path_factory):
    """A replay whose server generates script payloads (a script tag and an event handler that would set
    `window.__pwned`), and the HTML report of that run."""
    from kvscope.harness.report.render import render_report
    from kvscope.workloads.generate import synthetic_trace
    from tests.doubles.faultserver import FaultConfig, FaultServer
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.replay.runner import replay

    tmp_path = tmp_path_factory.mktemp("xss_replay")
    trace_dir = synthetic_trace(3, steps=2, prompt_tokens=64, output_tokens=8).write(tmp_path / "trace")
    with FaultServer(FaultConfig(text=PAYLOAD, model="tiny")) as server:
        replay(trace_dir, tmp_path / "run", ReplayOptions(concurrency=2, progress=False, time_scale=0),
               endpoints=[server.endpoint])
    return render_report(tmp_path / "run", notebooks=["speculative", "latency"], progress=False)


def test_generated_script_is_shown_escaped_in_the_replay_report(replay_report):
    """End to end: a server generates script payloads; the replay records them; the HTML report of that run
    shows them as text only."""
    from kvscope.harness.results.records import read_records

    df = read_records(replay_report.parent.parent)
    assert (df["output_text_head"].str.startswith(PAYLOAD)).all()
    for page in ("speculative.html", "latency.html", "index.html"):
        html = (replay_report.parent / page).read_text()
        # no element from the data: no script tag, no tag carrying an event handler (the payload's words may
        # show as escaped text: report tables show a cell's whole text, pandas' 50-character cut is gone)
        assert "<script" not in html.lower() and not re.search(r"<[a-z][^<>]*\sonerror\s*=", html, re.I), page
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in (replay_report.parent / "speculative.html").read_text()


def test_generated_script_never_runs_in_a_real_browser(replay_report):
    """The same report in Chromium: the payload is visible as text on the page that samples outputs, it never
    runs (`window.__pwned` stays undefined, no CSP violation in the console), and every page renders."""
    require_chromium()
    checks = {c.page: c for c in assert_report_renders(replay_report.parent, expect_images=False)}
    assert set(checks) == {"index.html", "latency.html", "speculative.html"}
    assert "<script>window.__pwned=1</script>" in checks["speculative.html"].visible_text
    assert not any(c.script_ran for c in checks.values())
