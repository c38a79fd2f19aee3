"""Spec validation messages, trace round trips, JSONL import/export, CLI wiring."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from kvscope.workloads.generate import generate
from kvscope.workloads.spec import SpecError, load_spec, parse_spec
from kvscope.workloads.trace import Trace, TraceBuilder


def _write(tmp_path, text: str):
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    return p


def test_unknown_policy_names_file_field_and_allowed(tmp_path):
    p = _write(tmp_path, "sessions:\n  policies:\n    - kind: append_only\n    - kind: append\n")
    with pytest.raises(SpecError) as e:
        load_spec(p)
    msg = str(e.value)
    assert msg.startswith("spec.yaml: sessions.policies[1].kind: unknown policy 'append'; allowed: append_only, "
                          "volatile_prefix"), msg


def test_unknown_field_and_literal_and_distribution(tmp_path):
    with pytest.raises(SpecError, match=r"spec.yaml: sessions.agent.tool_outputs: unknown field; allowed: .*"
                                        r"tool_output_tokens"):
        load_spec(_write(tmp_path, "sessions:\n  agent:\n    tool_outputs: 3\n"))
    with pytest.raises(SpecError, match=r"spec.yaml: sessions.kind: invalid value 'agents'; allowed: 'chat', 'agent'"):
        load_spec(_write(tmp_path, "sessions:\n  kind: agents\n"))
    with pytest.raises(SpecError, match=r"prefix.system_tokens.kind: unknown distribution 'gauss'; allowed: "
                                        r"constant, uniform, normal, lognormal, zipf, empirical"):
        load_spec(_write(tmp_path, "prefix:\n  system_tokens: {kind: gauss, mean: 3}\n"))
    with pytest.raises(SpecError, match=r"sessions.policies\[0\].position: unknown field|sessions.policies\[0\]"
                                        r".tokens: Input should be greater"):
        load_spec(_write(tmp_path, "sessions:\n  policies:\n    - {kind: volatile_prefix, tokens: 0}\n"))


def test_extends_and_shorthand(tmp_path):
    p = _write(tmp_path, "extends: agent-coding\nsessions:\n  count: 3\n  agent:\n    calls: 5\n")
    spec = load_spec(p)
    assert spec.sessions.count == 3 and spec.sessions.kind == "agent"
    assert spec.sessions.agent.calls.kind == "constant"
    assert spec.prefix.tenants == 50  # inherited


def test_empirical_file_relative_to_spec(tmp_path, source):
    (tmp_path / "sizes.txt").write_text("10\n20\n30\n")
    spec = load_spec(_write(tmp_path, "sessions:\n  count: 5\n  chat:\n    user_tokens: {kind: empirical, file: sizes.txt}\n"))
    tr = generate(spec, source)
    assert tr.num_requests > 0


def _small(source, **over):
    data = {"sessions": {"kind": "agent", "count": 4, "agent": {"calls": 6, "reasoning_tokens": 5}},
            "prefix": {"system_tokens": 300, "tools_tokens": 200}}
    data.update(over)
    return generate(parse_spec(data), source)


def test_trace_roundtrip_and_api(tmp_path, source):
    tr = _small(source)
    tr.write(tmp_path / "t")
    back = Trace.read(tmp_path / "t")
    assert back.equals(tr)
    # in memory: segment ids are views of one flat int32 array, the frame's column the same views, and the
    # kinds what was written (decoded from a dictionary)
    ids = [back.prompt_segment_ids(i) for i in range(back.num_requests)]
    assert all(x.dtype == np.int32 and x.base is ids[0].base for x in ids)
    assert all(a is b for a, b in zip(ids, back.requests["prompt_segment_ids"]))
    assert [x.tolist() for x in ids] == [tr.prompt_segment_ids(i).tolist() for i in range(tr.num_requests)]
    assert back.seg_kinds.tolist() == tr.seg_kinds.tolist()
    empty = TraceBuilder().build({}).write(tmp_path / "empty")  # no requests: no views, not one empty one
    assert Trace.read(empty).num_requests == 0 and len(Trace.read(empty).requests["prompt_segment_ids"]) == 0
    meta = json.loads((tmp_path / "t" / "trace.json").read_text())
    assert meta["format"] == "kvscope-trace" and meta["version"] == 1 and meta["num_requests"] == tr.num_requests
    p = back.prompt_token_ids(3)
    assert p.dtype == np.int32 and len(p) == back.requests.prompt_tokens[3]
    assert sum(n for _, _, n, _ in back.segment_map(3)) == len(p)
    reqs = list(back.iter_requests())
    assert [r.request_id for r in reqs] == list(range(tr.num_requests))
    # live-mode substitution: replace the parent's planned output by "generated" tokens
    child = next(r for r in reqs if r.parent_request_id >= 0)
    out_seg = back.output_segment_id(child.parent_request_id)
    assert out_seg in child.prompt_segment_ids
    fake = np.arange(7, dtype=np.int32)
    sub = back.prompt_token_ids(child.request_id, {out_seg: fake})
    assert len(sub) == child.prompt_tokens - back.requests.output_tokens[child.parent_request_id] + 7
    # no special tokens inside content
    assert not np.isin(back.seg_tokens, np.asarray(source.special)).any()


def test_jsonl_export_import_roundtrip(tmp_path, source):
    from kvscope.workloads.importers import export_jsonl, import_jsonl

    tr = _small(source)
    export_jsonl(tr, tmp_path / "x.jsonl")
    back = import_jsonl(tmp_path / "x.jsonl")
    assert back.num_requests == tr.num_requests
    by_key = {(r.session_id, r.step): r.request_id for r in back.iter_requests()}
    for r in tr.iter_requests():
        j = by_key[(r.session_id, r.step)]
        assert np.array_equal(back.prompt_token_ids(j), tr.prompt_token_ids(r.request_id))
        assert np.array_equal(back.output_token_ids(j), tr.output_token_ids(r.request_id))
        assert back.requests.transition[j] == r.transition
    # compact: the import stores about the distinct tokens, not the sum of prompts
    assert len(back.seg_tokens) < 0.6 * back.requests.prompt_tokens.sum()


def test_cli_generate_stats_export(tmp_path, model_dir, capsys):
    from kvscope.harness.cli import workload as cli

    parser = argparse.ArgumentParser(prog="kvscope")
    cli.add_subcommands(parser.add_subparsers())
    out = tmp_path / "tr"
    args = parser.parse_args(["workload", "generate", "chat", "--tokenizer", str(model_dir), "--out", str(out),
                              "--scale", "0.05", "--sessions", "5", "--no-progress"])
    assert args.func(args) == 0
    args = parser.parse_args(["workload", "stats", str(out), "--json", "--block-size", "16"])
    assert args.func(args) == 0
    st = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert st["sessions"] == 5 and 0 < st["ideal_hit"]["global"] <= 1
    args = parser.parse_args(["workload", "export", str(out), "--format", "jsonl", "--out", str(tmp_path / "e.jsonl")])
    assert args.func(args) == 0
    assert len((tmp_path / "e.jsonl").read_text().splitlines()) == st["requests"]
    args = parser.parse_args(["workload", "presets"])
    args.func(args)
    listed = capsys.readouterr().out
    for name in ("chat", "agent-coding", "agent-coding-timestamped", "agent-coding-compaction", "rag-shared-doc"):
        assert name in listed
    bad = tmp_path / "bad.yaml"
    bad.write_text("sessions:\n  policies: [{kind: nope}]\n")
    args = parser.parse_args(["workload", "generate", str(bad), "--tokenizer", str(model_dir), "--out", str(out)])
    assert args.func(args) == 2
    assert "bad.yaml: sessions.policies[0].kind: unknown policy 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["chat", "agent-coding", "agent-coding-timestamped", "agent-coding-compaction",
                                  "rag-shared-doc"])
def test_presets_generate_small(name, source):
    tr = generate(load_spec(name), source, scale=0.05, sessions=4, max_context=8192)
    assert tr.num_requests >= 4
    assert int(tr.requests.prompt_tokens.max() + tr.requests.output_tokens.max()) <= 8192 + 1000
    assert ((tr.requests.prompt_tokens + tr.requests.output_tokens) <= 8192).all()
