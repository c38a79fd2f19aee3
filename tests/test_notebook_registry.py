"""The notebook registry is the one list of report notebooks: each entry matches its .ipynb (title, parameters
cell, the figures it saves), every notebook in notebooks/ is registered, and extra parameters are checked."""

from __future__ import annotations

import ast
import json
import re

import pytest

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.report.notebooks import ALL_NOTEBOOKS, COMMON_PARAMETERS, NOTEBOOKS
from kvscope.harness.report.render import _parameters, project_notebooks_dir

NB_DIR = project_notebooks_dir()


def _cells(name: str) -> list[dict]:
    return json.loads((NB_DIR / f"{name}.ipynb").read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def test_every_notebook_file_is_registered_once():
    assert sorted(p.stem for p in NB_DIR.glob("*.ipynb")) == sorted(ALL_NOTEBOOKS)
    assert len(set(ALL_NOTEBOOKS)) == len(ALL_NOTEBOOKS)


@pytest.mark.parametrize("entry", NOTEBOOKS, ids=lambda nb: nb.name)
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
    assert params["cost"] == {"pricing": ["openai-gpt-4.1"], "gpu_hourly_usd": 3.0}
    assert params["primer"] == {}
    with pytest.raises(KvscopeError, match=r"notebook latency: unknown parameter\(s\) slo_ttft; allowed: slo_ttft_ms"):
        _parameters(spec, {"latency": {"slo_ttft": 1}})
    assert _parameters(None, {"my_own": {"x": 1}})["my_own"] == {"x": 1}  # a notebook from --notebooks-dir
    assert _parameters(None, {})["cost"] == {}  # a single replay run has no spec
