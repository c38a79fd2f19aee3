"""Results are typed from file to table.

Two guards: (1) a summary metric is one class: registered in this test module alone, it appears in
summary.json, in `load_results(...).cells` and in the report's cell-metrics table; (2) the analysis, report,
experiment and CLI layers read result data through the models' attributes, never by walking a dumped dict
(`x.get(...) or {}`, `x.get(...).get(...)`, `manifest[...]`): an AST count that must stay zero."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from kvscope.harness.analysis import common
from kvscope.harness.results import summary as S
from kvscope.harness.results.loaders import load_results, load_summary

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("harness/analysis", "harness/report", "harness/experiment", "harness/cli")


def _is_get(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"


def untyped_reads(root: Path = ROOT) -> dict[str, list[str]]:
    """Where result data is read as dicts: `.get(…) or {}`, chained `.get(…).get(…)`, and reads of a name
    `manifest` by key (`manifest.get(…)`, `manifest[…]`), as file:line per pattern."""
    found: dict[str, list[str]] = {"get_or_empty": [], "chained_get": [], "manifest_key": []}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            where = lambda n: f"{path.relative_to(root)}:{n.lineno}"  # noqa: E731
            for n in ast.walk(ast.parse(path.read_text())):
                if (isinstance(n, ast.BoolOp) and isinstance(n.op, ast.Or) and any(map(_is_get, n.values[:-1]))
                        and isinstance(n.values[-1], ast.Dict) and not n.values[-1].keys):
                    found["get_or_empty"].append(where(n))
                if _is_get(n):
                    inner = n.func.value  # type: ignore[attr-defined]
                    while isinstance(inner, ast.BoolOp):
                        inner = inner.values[0]
                    if _is_get(inner):
                        found["chained_get"].append(where(n))
                target = n.func.value if _is_get(n) else n.value if isinstance(n, ast.Subscript) else None  # type: ignore[attr-defined]
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name == "manifest":
                    found["manifest_key"].append(where(n))
    return found


#: analysis/explain.py reads a run's manifest.json raw to find its trace; it is being rewritten for streaming
#: separately and moves to `load_run_manifest` there.
EXEMPT: tuple[str, ...] = ()


def test_result_data_is_read_through_attributes_not_dicts():
    found = {k: [w for w in v if not w.startswith(EXEMPT)] for k, v in untyped_reads().items()}
    assert found == {k: [] for k in found}, found


def test_a_metric_registered_here_reaches_summary_json_the_cells_and_the_report_table(tmp_path, monkeypatch):
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.replay.runner import replay
    from kvscope.workloads.generate import synthetic_trace
    from tests.doubles.faultserver import FaultConfig, FaultServer

    monkeypatch.setattr(S, "_METRICS", dict(S._METRICS))

    @S.summary_metric
    class LongestPrompt(S.SummaryMetric):
        tag = "throughput.longest_prompt_tokens"
        output = int | None
        default = None

        def compute(self, run):
            return int(run.ok["prompt_tokens"].max()) if len(run.ok) else None

        def cell_columns(self, value):
            return {"longest_prompt_tokens": value}

    trace_dir = synthetic_trace(2, steps=2, prompt_tokens=64, output_tokens=4).write(tmp_path / "trace")
    with FaultServer(FaultConfig(model="tiny")) as server:
        replay(trace_dir, tmp_path / "run", ReplayOptions(concurrency=2, progress=False, time_scale=0),
               endpoints=[server.endpoint])
    res = load_results(tmp_path / "run")
    longest = int(res.ok_requests()["prompt_tokens"].max())
    assert load_summary(tmp_path / "run").throughput.longest_prompt_tokens == longest
    assert res.cells["longest_prompt_tokens"].tolist() == [longest]
    table = common.cell_metrics_table(res)
    assert table["longest_prompt_tokens"].tolist() == [longest]
    assert {"hit_server", "ttft_p50_s", "req_per_s"} <= set(table.columns)


def test_a_metric_must_declare_its_output_and_a_free_tag(monkeypatch):
    monkeypatch.setattr(S, "_METRICS", dict(S._METRICS))
    with pytest.raises(ValueError, match="already registered"):
        S.summary_metric(type("Again", (S.SummaryMetric,), {"tag": "hit_rate", "output": int}))
    with pytest.raises(ValueError, match="declares no output"):
        S.summary_metric(type("Shapeless", (S.SummaryMetric,), {"tag": "shapeless"}))
