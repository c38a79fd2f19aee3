"""The notebook registry is the one list of report notebooks: each entry matches its .ipynb (title, parameters
cell, the figures it saves), every notebook in notebooks/ is registered, and extra parameters are checked."""

from __future__ import annotations

import ast
import json
import re

import pytest

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.analysis.registry import COMMON_PARAMETERS
from kvscope.harness.report.notebooks import page_names, report_pages
from kvscope.harness.report.render import _parameters, project_notebooks_dir

NB_DIR = project_notebooks_dir()


def _cells(name: str) -> list[dict]:
    return json.loads((NB_DIR / f"{name}.ipynb").read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def test_every_notebook_file_is_registered_once():
    assert sorted(p.stem for p in NB_DIR.glob("*.ipynb")) == sorted(page_names())
    assert len(set(page_names())) == len(page_names())


@pytest.mark.parametrize("entry", report_pages(), ids=lambda nb: nb.name)
def test_entry_matches_its_notebook(entry):
    cells = _cells(entry.name)
    first_md = next(_source(c) for c in cells if c["cell_type"] == "markdown")
    assert first_md.splitlines()[0] == f"# {entry.title}"
    params_cell = next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
    declared = {t.id for node in ast.parse(_source(params_cell)).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert declared == set(COMMON_PARAMETERS) | set(entry.parameters)
    code = "\n".join(_source(c) for c in cells if c["cell_type"] == "code")
    saved = set(re.findall(r"save\([^,()]+(?:\([^)]*\))?[^,()]*,\s*['\"](\w+)['\"]\)", code))
    assert saved <= set(entry.figures), saved - set(entry.figures)
    for fig in entry.figures:
        assert re.search(rf"['\"]{fig}['\"]", code), f"{entry.name} never names figure {fig}"
    assert set(entry.key_figures) <= set(entry.figures)


def test_spec_parameters_and_extra_parameters():
    from kvscope.harness.results.schemas import ExperimentSpecCore

    spec = ExperimentSpecCore.model_validate(
        {"name": "x", "slo": {"ttft_ms": 250, "tpot_ms": None},
         "cost": {"pricing": ["openai-gpt-4.1"], "gpu_hourly_usd": 3}})
    params = _parameters(spec, {"latency": {"bandwidth_gb_s": 900.0}})
    assert params["latency"] == {"slo_ttft_ms": 250.0, "bandwidth_gb_s": 900.0}
    assert params["cost"] == {"pricing": ["openai-gpt-4.1"], "hourly_usd": 3.0, "hardware": "the serving machine"}
    assert params["primer"] == {}
    with pytest.raises(KvscopeError, match=r"notebook latency: unknown parameter\(s\) slo_ttft; allowed: slo_ttft_ms"):
        _parameters(spec, {"latency": {"slo_ttft": 1}})
    assert _parameters(None, {"my_own": {"x": 1}})["my_own"] == {"x": 1}  # a notebook from --notebooks-dir
    assert _parameters(None, {})["cost"] == {}  # a single replay run has no spec


def test_pages_run_and_are_listed_in_their_declared_order():
    assert page_names() == ["primer", "hit_rates", "concurrency", "latency", "cost", "routing", "speculative",
                            "explain", "ab_compare"]


THROWAWAY_PAGE = '''
from kvscope.harness.analysis.registry import report_page
from kvscope.harness.results.findings_file import Finding


def _from_spec(spec):
    return {"budget_usd": float(spec.cost.gpu_hourly_usd)}


@report_page("throwaway", "Throwaway: a page declared in its module alone", order=1000, questions=("cost",),
             figures=("nothing",), parameters=("budget_usd", "depth"), key_figures=("nothing",),
             from_spec=_from_spec)
def _throwaway_page(ctx):
    return [Finding(question="cost", notebook="throwaway", sentence=f"depth {ctx.computed.get('depth')}")]
'''


def test_a_page_declared_in_one_module_is_found_by_the_report(tmp_path, monkeypatch):
    """A new page is its notebook plus its page module: a module in the pages package that declares itself is
    run, ordered and given its parameters by the report, and its findings are computed, with nothing else
    listing it."""
    import sys
    from types import SimpleNamespace

    import kvscope.harness.analysis.pages as pages_package
    from kvscope.harness.analysis import findings as F
    from kvscope.harness.analysis import registry
    from kvscope.harness.report.notebooks import page_by_name
    from kvscope.harness.results.schemas import ExperimentSpecCore

    report_pages()  # the project's pages are registered before the registry is swapped for a copy
    monkeypatch.setattr(registry, "PAGES", dict(registry.PAGES))
    (tmp_path / "throwaway.py").write_text(THROWAWAY_PAGE)
    monkeypatch.setattr(pages_package, "__path__", [*pages_package.__path__, str(tmp_path)])
    try:
        assert page_names()[-1] == "throwaway" and page_names()[:-1] == [
            "primer", "hit_rates", "concurrency", "latency", "cost", "routing", "speculative", "explain",
            "ab_compare"]
        assert page_by_name()["throwaway"].title == "Throwaway: a page declared in its module alone"
        spec = ExperimentSpecCore.model_validate({"name": "x", "cost": {"gpu_hourly_usd": 2}})
        assert _parameters(spec, {"throwaway": {"depth": 3}})["throwaway"] == {"budget_usd": 2.0, "depth": 3}
        with pytest.raises(KvscopeError,
                           match=r"notebook throwaway: unknown parameter\(s\) width; allowed: budget_usd"):
            _parameters(spec, {"throwaway": {"width": 1}})
        res = SimpleNamespace()  # the page reads nothing, and no caveat is registered on it
        assert [f.sentence for f in F.page_findings(res, "throwaway", depth=3)] == ["depth 3"]
    finally:
        monkeypatch.undo()
        sys.modules.pop("kvscope.harness.analysis.pages.throwaway", None)
    assert "throwaway" not in page_names()  # the project's registry is as it was
