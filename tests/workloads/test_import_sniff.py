"""Importers refuse a file of another kind, an empty file and a file with no model call, in one line, exit 2.

Each importer is given every other importer's real sample (../shared/data/agent-traces via `shared_data`):
before, `workload import claude-code` on a Codex rollout wrote a trace of 0 sessions and exited 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.workloads.errors import TraceFileError
from kvscope.workloads.importers.sniff import DESCRIPTIONS, check_kind, sniff

SAMPLES = {
    "claude-code": "agent-traces/tracelab/example_sessions/claude/session.converted.jsonl",
    "codex": "agent-traces/tracelab/example_sessions/codex/rollout.converted.jsonl",
    "swe-agent": "agent-traces/swe-agent/gpt4__pydicom__pydicom-1458.traj",
    "openhands": "agent-traces/openhands/basic.json",
    "tracelab": "agent-traces/tracelab/example_sessions/sanitized/round_trace.jsonl",
    "mooncake": "mooncake_conversation_trace.jsonl",
}
IMPORTERS = ["claude-code", "codex", "openai-chat", "swe-agent", "openhands", "tracelab", "mooncake", "jsonl"]


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_each_real_sample_is_recognised(shared_data, kind):
    assert sniff(shared_data / SAMPLES[kind]) == kind


def _import(fmt: str, src: Path, model_dir: Path, out: Path, capsys) -> tuple[int, str]:
    from kvscope.harness.cli.main import main

    rc = main(["workload", "import", fmt, str(src), "--tokenizer", str(model_dir), "--out", str(out)])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("fmt,kind", [(f, k) for f in IMPORTERS for k in sorted(SAMPLES) if f != k])
def test_cli_refuses_another_kind_in_one_line(shared_data, model_dir, tmp_path, capsys, fmt, kind):
    rc, err = _import(fmt, shared_data / SAMPLES[kind], model_dir, tmp_path / "t", capsys)
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"looks like {DESCRIPTIONS[kind]}, not {DESCRIPTIONS[fmt]}" in err
    assert f"use `kvscope workload import {kind}`" in err
    assert not (tmp_path / "t").exists()  # nothing written for replay or capacity to report on


@pytest.mark.parametrize("fmt", IMPORTERS)
def test_cli_refuses_an_empty_file(model_dir, tmp_path, capsys, fmt):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    rc, err = _import(fmt, empty, model_dir, tmp_path / "t", capsys)
    assert rc == 2 and err.count("\n") == 1
    assert f"empty file; expected {DESCRIPTIONS[fmt]}" in err


@pytest.mark.parametrize("fmt,content", [
    # a Claude Code log of bookkeeping records only (no assistant message: no model call)
    ("claude-code", [{"type": "mode", "mode": "normal", "sessionId": "s"}]),
    # a Codex rollout that ends before the first model output
    ("codex", [{"timestamp": "2026-01-01T00:00:00Z", "type": "session_meta", "payload": {"id": "x"}}]),
    ("openhands", [{"id": 0, "source": "environment", "observation": "agent_state_changed"}]),
    ("swe-agent", {"trajectory": [], "history": []}),
])
def test_cli_refuses_a_file_of_the_right_kind_without_a_model_call(model_dir, tmp_path, capsys, fmt, content):
    src = tmp_path / "src.json"
    src.write_text("\n".join(json.dumps(r) for r in content) if fmt in ("claude-code", "codex")
                   else json.dumps(content))
    rc, err = _import(fmt, src, model_dir, tmp_path / "t", capsys)
    assert rc == 2 and err.count("\n") == 1
    assert f"no model calls found; expected {DESCRIPTIONS[fmt]}" in err


def test_unknown_records_are_left_to_the_importer(tmp_path):
    """No evidence, no refusal: a file the sniffer cannot place is not called another kind."""
    src = tmp_path / "x.jsonl"
    src.write_text('{"a": 1}\n{"b": 2}\n')
    assert sniff(src) is None
    check_kind(src, "claude-code")  # does not raise


def test_a_trace_directory_names_what_it_is(tmp_path, model_dir, shared_data):
    from kvscope.workloads import importers

    out = tmp_path / "tr"
    importers.import_openhands(shared_data / SAMPLES["openhands"], model_dir).write(out)
    assert sniff(out) == "kvscope-trace"
    with pytest.raises(TraceFileError, match="looks like a kvscope trace directory"):
        check_kind(out, "claude-code")
