"""Results are typed from file to table, and from the server and the trace to the file.

Guards: (1) a summary metric is one class: registered in this test module alone, it appears in
summary.json, in `load_results(...).cells` and in the report's cell-metrics table; (2) the analysis, report,
experiment and CLI layers read result data through the models' attributes, never by walking a dumped dict
(`x.get(...) or {}`, `x.get(...).get(...)`, `manifest[...]`): an AST count that must stay zero; (3) so do the
replay and record layers that produce the data, and they read server facts, trace metadata, summaries and
recorded exchanges by attribute, never by key; (4) summary.json's run entries (`aborted`, `client`,
`server_facts`) are registered parts: a part registered here is assembled, validated and required;
(5) no module of the replay passes 400 lines, so its parts stay apart."""

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


#: The replay and record layers: they produce the typed data (records, summaries, traces from recordings).
PRODUCERS = ("harness/replay", "harness/record")
#: Where the producers parse JSON kvscope does not own, by design as the sender wrote it: the upstream's
#: response stream (the recording proxy) and the client's request body (rendered by the chat template).
WIRE_EDGES = ("harness/record/proxy.py", "harness/record/tokenize.py")
#: Names of kvscope's own typed data in the producers, which must not be read by key.
TYPED_NAMES = {"meta", "facts", "fact", "summary", "exchange", "ex", "manifest"}


def _root_name(node: ast.AST) -> str:
    """The name an expression reads from: ``facts[0].config`` -> ``facts``, ``trace.meta`` -> ``meta``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return getattr(node, "id", "")


def untyped_reads(root: Path = ROOT, layers: tuple[str, ...] = LAYERS,
                  exempt: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Where result data is read as dicts: `.get(…) or {}`, chained `.get(…).get(…)`, and reads of a name
    `manifest` by key (`manifest.get(…)`, `manifest[…]`), as file:line per pattern."""
    found: dict[str, list[str]] = {"get_or_empty": [], "chained_get": [], "manifest_key": []}
    for layer in layers:
        for path in sorted((root / layer).rglob("*.py")):
            if str(path.relative_to(root)).startswith(exempt):
                continue
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


def typed_data_read_by_key(root: Path = ROOT, layers: tuple[str, ...] = PRODUCERS,
                           exempt: tuple[str, ...] = WIRE_EDGES) -> list[str]:
    """Reads by key (`x.get("k")`, `x["k"]`) of kvscope's own typed data (:data:`TYPED_NAMES`), as
    file:line."""
    found = []
    for layer in layers:
        for path in sorted((root / layer).rglob("*.py")):
            if str(path.relative_to(root)).startswith(exempt):
                continue
            for n in ast.walk(ast.parse(path.read_text())):
                target = None
                if _is_get(n):
                    target = n.func.value  # type: ignore[attr-defined]
                elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) \
                        and isinstance(n.slice.value, str):
                    target = n.value
                if target is not None and _root_name(target) in TYPED_NAMES:
                    found.append(f"{path.relative_to(root)}:{n.lineno}")
    return found


def test_the_replay_and_record_layers_read_their_own_data_through_attributes():
    found = untyped_reads(layers=PRODUCERS, exempt=WIRE_EDGES)
    assert found == {k: [] for k in found}, found
    assert typed_data_read_by_key() == []


def test_the_key_read_guard_finds_what_it_looks_for(tmp_path):
    """The AST guard catches the reads the replay used to make (a guard that finds nothing cannot fail)."""
    (tmp_path / "harness" / "replay").mkdir(parents=True)
    (tmp_path / "harness" / "replay" / "old.py").write_text(
        "def f(trace, facts, summary):\n"
        "    a = facts[0].get('block_size') or 16\n"
        "    b = (trace.meta.get('tokenizer') or {}).get('vocab_size')\n"
        "    return summary['requests'], a, b\n")
    assert sorted(typed_data_read_by_key(tmp_path)) == [f"harness/replay/old.py:{n}" for n in (2, 3, 4)]
    assert untyped_reads(tmp_path, layers=PRODUCERS)["chained_get"] == ["harness/replay/old.py:3"]


def test_a_summary_part_registered_here_is_assembled_validated_and_required(monkeypatch):
    from pydantic import BaseModel, ValidationError

    from kvscope.harness.results import summary_parts as P
    from tests.test_summary_metrics import _records

    monkeypatch.setattr(P, "_PARTS", dict(P._PARTS))

    class Note(BaseModel):
        words: int

    P.summary_part("test_note", Note)
    facts = [P.ServerFacts(endpoint="http://e", block_size=16)]
    client = P.ClientStats(cpu_s=1.0, cpu_utilization=0.5, cpu_us_per_request=10.0, event_loop="x",
                           stale_connection_resends=0, saturated=False, note=None)
    parts = {"aborted": None, "client": client, "server_facts": facts, "test_note": Note(words=3)}
    body = S.summarize(_records(), {}, 10.0, True, parts=parts)
    assert list(body)[-4:] == ["aborted", "client", "server_facts", "test_note"]  # after the metrics, in order
    assert body["test_note"] == {"words": 3} and body["server_facts"][0]["block_size"] == 16
    s = S.summary_file_model().model_validate(body)
    assert s.test_note.words == 3 and s.client.cpu_s == 1.0 and s.server_facts[0].block_size == 16
    with pytest.raises(ValueError, match=r"summary parts \['test_note'\] are missing"):
        S.summarize(_records(), {}, 10.0, True, parts={k: v for k, v in parts.items() if k != "test_note"})
    with pytest.raises(ValidationError, match="words"):
        S.summarize(_records(), {}, 10.0, True, parts={**parts, "test_note": {"words": "many"}})
    with pytest.raises(ValueError, match="already registered"):
        P.summary_part("client", Note)


def test_no_replay_module_passes_400_lines():
    lengths = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "harness" / "replay").glob("*.py")}
    assert max(lengths.values()) <= 400, lengths


def test_a_replay_passes_typed_facts_and_parts_and_a_recording_typed_exchanges(tmp_path, monkeypatch):
    """The replay hands summarize() its parts as models (facts as ServerFacts, the client as ClientStats), and
    the trace builder gets exchanges as models, not dicts."""
    from kvscope.harness.record import build
    from kvscope.harness.record.exchange_log import Exchange
    from kvscope.harness.replay import results
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.replay.runner import replay
    from kvscope.harness.results.summary_parts import ClientStats, ServerFacts
    from kvscope.workloads.generate import synthetic_trace
    from tests.doubles.faultserver import FaultConfig, FaultServer

    seen = {}
    summarize = results.summarize

    def spy(*args, parts=None, **kwargs):
        seen.update(parts)
        return summarize(*args, parts=parts, **kwargs)

    monkeypatch.setattr(results, "summarize", spy)
    trace_dir = synthetic_trace(1, steps=2, prompt_tokens=32, output_tokens=2).write(tmp_path / "trace")
    with FaultServer(FaultConfig(model="tiny")) as server:
        replay(trace_dir, tmp_path / "run", ReplayOptions(concurrency=1, progress=False, time_scale=0),
               endpoints=[server.endpoint])
    assert isinstance(seen["client"], ClientStats) and seen["aborted"] is None
    assert [type(f) for f in seen["server_facts"]] == [ServerFacts]
    assert load_summary(tmp_path / "run").server_facts[0].model == "tiny"

    log = tmp_path / "rec" / build.EXCHANGES_LOG
    log.parent.mkdir()
    good = {"request_id": 0, "api": "chat", "received_unix_s": 1.0, "done_unix_s": 2.0, "status": 200,
            "request": {"messages": []}, "response": {"text": "hi", "usage": {"prompt_tokens": 3, "x": 1}}}
    bad = {**good, "request_id": 1, "received_unix_s": "yesterday"}
    import json

    log.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.warns(UserWarning, match="line 2: not a record"):
        (got,) = build.read_exchanges_log(log.parent)
    assert isinstance(got, Exchange) and got.completed and got.response.usage.prompt_tokens == 3


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
