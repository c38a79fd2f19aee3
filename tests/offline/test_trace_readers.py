"""One reader per trace format: ``kvscope simulate`` and ``kvscope workload import`` see the same requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.harness.cachemodel.ideal import ideal_prefix_hit
from kvscope.harness.cachemodel.trace_io import load_trace
from kvscope.harness.cli.main import main
from kvscope.workloads.importers import import_jsonl, read_kvcache_tester
from kvscope.workloads.stats import ideal_hit_ratio_blocks


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _agent_rows(session_ids: list) -> list[dict]:
    base = list(range(100, 164))
    rows = []
    for sid in session_ids:
        for step in range(3):
            tail = [sid if isinstance(sid, int) else 7] * (16 * (step + 1))
            rows.append({"session_id": sid, "step": step, "prompt_token_ids": base + tail, "output_tokens": 4})
    return rows


def test_simulate_accepts_integer_session_ids(tmp_path, capsys):
    ints = _write_jsonl(tmp_path / "int.jsonl", _agent_rows([1, 2]))
    assert main(["simulate", str(ints), "--json", "--replicas", "2", "--routing", "session-affinity"]) == 0
    by_int = json.loads(capsys.readouterr().out)
    assert by_int["requests"] == 6 and by_int["cached_tokens"] > 0
    # the same sessions named by strings: the same prediction
    named = [{**r, "session_id": str(r["session_id"])} for r in _agent_rows([1, 2])]
    strs = _write_jsonl(tmp_path / "str.jsonl", named)
    for r, s in zip(load_trace(ints).requests, load_trace(strs).requests):
        assert r.session_id == s.session_id and r.hashes == s.hashes
    d = ideal_prefix_hit(load_trace(ints).requests)
    assert d["conversations"] == 2
    # and workload import reads the file with the same session names
    tr = import_jsonl(ints)
    assert sorted(set(tr.requests["session_id"])) == ["1", "2"]
    assert list(tr.requests.sort_values(["session_id", "step"])["transition"]) == ["first", "append", "append"] * 2


def test_token_jsonl_bad_token_ids_are_named(tmp_path):
    from kvscope.workloads.errors import TraceFileError

    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": ["x"]}])
    for read in (load_trace, import_jsonl):
        with pytest.raises(TraceFileError, match=r"line 2: prompt_token_ids: expected a list of integer"):
            read(bad)


def _kvtester_dir(tmp_path: Path) -> Path:
    d = tmp_path / "kvt"
    d.mkdir()
    for name in ("a", "b"):  # both conversations use the same local ids 0..3: they must not share blocks
        doc = {"block_size": 64, "hash_id_scope": "local", "requests": [
            {"t": 0.0, "in": 200, "out": 10, "hash_ids": [0, 1, 2]},
            {"type": "subagent", "agent_id": "s1", "t": 1.0, "requests": [
                {"t": 0.5, "in": 130, "out": 5, "hash_ids": [0, 9]}]},
            {"t": 2.0, "in": 260, "out": 10, "think_time": 3.0, "hash_ids": [0, 1, 2, 3]}]}
        (d / f"{name}.json").write_text(json.dumps(doc))
    return d


def test_kvcache_tester_ids_are_per_conversation_in_both_views(tmp_path):
    d = _kvtester_dir(tmp_path)
    rows = read_kvcache_tester(d)
    assert [r.session_id for r in rows] == ["a", "a/s1", "a", "b", "b/s1", "b"]
    sim = load_trace(d, order="file").requests
    assert [r.session_id for r in sim] == ["a", "a/s1", "a", "b", "b/s1", "b"]
    assert [r.gap_s for r in sim[:3]] == [None, None, 3.0]
    assert not set(sim[0].hashes) & set(sim[3].hashes)
    # conversation b hits nothing of a: its hit equals a's, both in simulate's and in stats' ideal figure
    hits = 64 * (1 + 3)  # subagent reuses block 0; the next turn reuses blocks 0-2
    want = hits * 2 / (2 * (200 + 130 + 260))
    assert ideal_prefix_hit(load_trace(d).requests)["token_hit_ratio"] == pytest.approx(want)
    assert ideal_hit_ratio_blocks(rows) == pytest.approx(want)


def test_kvcache_tester_request_without_in_is_named(tmp_path):
    from kvscope.workloads.errors import TraceFileError

    d = tmp_path / "kvt"
    d.mkdir()
    (d / "c.json").write_text(json.dumps({"requests": [{"t": 0, "out": 1, "hash_ids": [1]}]}))
    with pytest.raises(TraceFileError, match=r"c\.json: session c request 0: missing field\(s\) in"):
        load_trace(d)
