"""Each vocabulary of the trace and the attribution is one enum, and the writers, the reader and the readers of
the values check against that enum: a trace naming a transition or segment kind outside it is refused with a
one-line error, and every table keyed by a vocabulary covers exactly its members."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvscope.harness.analysis.causes import Cause
from kvscope.workloads.errors import TraceFileError
from kvscope.workloads.prefix import Transition, classify_transition, transition_from
from kvscope.workloads.trace import Trace, TraceBuilder
from kvscope.workloads.trace_schema import SegmentKind


def _two_request_trace(tmp_path: Path) -> Path:
    b = TraceBuilder()
    s0 = b.add_segment(np.arange(8, dtype=np.int32), SegmentKind.SYSTEM)
    s1 = b.add_segment(np.arange(4, dtype=np.int32), SegmentKind.TOOL_OUTPUT)
    first = b.add_request(session_id="s", step=0, parent_request_id=-1, arrival_s=0.0, prompt_segment_ids=[s0],
                          output_tokens=1, transition=Transition.FIRST)
    b.add_request(session_id="s", step=1, parent_request_id=first, arrival_s=1.0, prompt_segment_ids=[s0, s1],
                  output_tokens=1, transition=Transition.APPEND, input_kind=SegmentKind.TOOL_OUTPUT)
    return b.build({"name": "vocab"}).write(tmp_path / "trace")


def _rewrite_column(path: Path, column: str, row: int, value: str) -> None:
    table = pq.read_table(path)
    values = table.column(column).to_pylist()
    values[row] = value
    i = table.column_names.index(column)
    pq.write_table(table.set_column(i, column, pa.array(values, type=pa.string())), path)


def test_the_enums_are_the_on_disk_strings(tmp_path):
    trace = Trace.read(_two_request_trace(tmp_path))
    assert list(trace.requests["transition"]) == ["first", "append"]
    assert list(trace.seg_kinds) == ["system", "tool_output"]
    assert trace.requests["input_kind"].tolist() == [None, "tool_output"]
    from kvscope.workloads.stats import trace_stats

    assert trace_stats(trace, hit=False)["transitions"] == {"append": 1.0, "edit": 0.0, "reset": 0.0,
                                                           "compaction": 0.0}


def test_a_trace_with_an_unknown_transition_is_refused_in_one_line(tmp_path):
    tdir = _two_request_trace(tmp_path)
    _rewrite_column(tdir / "requests.parquet", "transition", 1, "rewrite")
    with pytest.raises(TraceFileError) as err:
        Trace.read(tdir)
    message = str(err.value)
    assert "\n" not in message
    assert message.endswith("requests.parquet: row 1: unknown transition 'rewrite'; known: "
                            + ", ".join(t.value for t in Transition))
    r = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "workload", "stats", str(tdir)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "unknown transition 'rewrite'" in r.stderr and "Traceback" not in r.stderr


def test_a_trace_with_an_unknown_segment_kind_is_refused(tmp_path):
    tdir = _two_request_trace(tmp_path)
    _rewrite_column(tdir / "segments.parquet", "kind", 1, "tool_result")
    with pytest.raises(TraceFileError, match=r"segments.parquet: row 1: unknown kind 'tool_result'; known: system, "):
        Trace.read(tdir)


def test_nulls_still_read_as_absent(tmp_path):
    """Traces written before a column existed read it as nulls: they are not an unknown value."""
    tdir = _two_request_trace(tmp_path)
    table = pq.read_table(tdir / "requests.parquet")
    i = table.column_names.index("transition")
    pq.write_table(table.set_column(i, "transition", pa.nulls(len(table), pa.string())), tdir / "requests.parquet")
    assert Trace.read(tdir).requests["transition"].tolist() == [None, None]


def test_the_builder_refuses_values_outside_the_enums():
    b = TraceBuilder()
    with pytest.raises(ValueError, match="unknown segment kind 'tool_result'; known: system, tools, "):
        b.add_segment(np.zeros(2, np.int32), "tool_result")
    sid = b.add_segment(np.zeros(2, np.int32), "user")  # a plain string of the vocabulary is its member
    b.add_request(session_id="s", step=0, parent_request_id=-1, arrival_s=0.0, prompt_segment_ids=[sid],
                  output_tokens=1, transition="truncate")
    with pytest.raises(ValueError, match="unknown transition 'truncate'; known: first, append, edit, reset, compaction"):
        b.build({})


def test_the_transition_rule_speaks_the_enum():
    assert transition_from(None, [1, 2]) is Transition.FIRST
    assert classify_transition(4, 4) is Transition.APPEND
    assert classify_transition(3, 4) is Transition.EDIT
    assert classify_transition(1, 4) is Transition.RESET
    assert classify_transition(4, 4, hint="compaction") is Transition.COMPACTION


def test_tables_keyed_by_a_vocabulary_cover_it():
    from kvscope.harness.analysis import explain, explain_experiment
    from kvscope.workloads.text import ROLE
    from kvscope.workloads.tokens import FLAVOUR

    assert set(explain_experiment.CAUSE_WORDS) == set(Cause) == set(explain_experiment.CAUSE_COLOURS)
    assert set(explain._TRANSITION_CAUSE) <= set(Transition) and set(explain._SEGMENT_CAUSE) <= set(SegmentKind)
    # every kind but the chat template's own text is drawn from a corpus and rendered in some role
    assert set(FLAVOUR) == set(SegmentKind) - {SegmentKind.TEMPLATE}
    assert set(ROLE) <= set(SegmentKind)


def test_the_explain_help_lists_every_cause(capsys):
    from kvscope.harness.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["explain", "--help"])
    assert f"the cause ({', '.join(Cause)})" in " ".join(capsys.readouterr().out.split())


def test_the_attribution_names_its_causes_by_the_enum(tmp_path):
    """A volatile segment changed in place (the trace's SegmentKind) is attributed to Cause.VOLATILE_FIELD, and the
    JSON the CLI writes carries the enum's string."""
    import json

    from kvscope.harness.analysis.explain import explain_trace

    rng = np.random.default_rng(0)
    b = TraceBuilder()
    system = b.add_segment(rng.integers(0, 4000, 64).astype(np.int32), SegmentKind.SYSTEM)
    stamps = [b.add_segment(rng.integers(0, 4000, 16).astype(np.int32), SegmentKind.VOLATILE) for _ in range(2)]
    task = b.add_segment(rng.integers(0, 4000, 64).astype(np.int32), SegmentKind.TASK)
    first = b.add_request(session_id="s", step=0, parent_request_id=-1, arrival_s=0.0,
                          prompt_segment_ids=[system, stamps[0], task], output_tokens=1, transition=Transition.FIRST)
    b.add_request(session_id="s", step=1, parent_request_id=first, arrival_s=1.0,
                  prompt_segment_ids=[system, stamps[1], task], output_tokens=1, transition=Transition.EDIT)
    ex = explain_trace(b.build({"name": "stamped"}).write(tmp_path / "trace"), 16)
    broken = [a for a in ex.requests if a.cause is not None]
    assert [a.cause for a in broken] == [Cause.VOLATILE_FIELD] and isinstance(broken[0].cause, Cause)
    assert json.loads(json.dumps(ex.to_json()))["causes"][0]["cause"] == "volatile_field"
