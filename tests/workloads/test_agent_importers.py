"""Agent-transcript importers on the real samples in ../shared/data/agent-traces (never copied into the repo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.workloads import importers
from kvscope.workloads.errors import TraceFileError
from kvscope.workloads.text import ChatTemplate
from kvscope.workloads.trace import Trace

DEMO = "swe-agent/demo_function_calling_replace_from_source__marshmallow-1867.traj"
CLAUDE_CACHE_READ = [27217, 29380, 35738, 38590, 41129, 41587, 42874, 44770, 45277, 47506]


@pytest.fixture(scope="module")
def traces(request) -> Path:
    """../shared/data/agent-traces (tests/conftest.py `shared_data`), or $KVSCOPE_SHARED_DATA in a worktree."""
    env = os.environ.get("KVSCOPE_SHARED_DATA")
    root = Path(env) if env else request.getfixturevalue("shared_data")
    if not (root / "agent-traces").is_dir():
        pytest.skip(f"no agent-traces under {root}")
    return root / "agent-traces"


def _exact(trace: Trace, model_dir: Path) -> None:
    """Every request's token prompt is what the chat template + tokenizer give for its messages."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tmpl = ChatTemplate.from_model_dir(model_dir)
    for r in trace.iter_requests():
        want = tok.encode(tmpl.render(json.loads(r.messages)), add_special_tokens=False).ids
        assert trace.prompt_token_ids(r.request_id).tolist() == want, r.request_id


def test_claude_code_sample_all_ten_calls_with_usage(traces, model_dir, tmp_path):
    src = traces / "tracelab/example_sessions/claude/session.converted.jsonl"
    tr = importers.import_claude_code(src, model_dir)
    assert tr.num_requests == 10 and tr.num_sessions == 1
    assert tr.requests["observed_cache_read_input_tokens"].tolist() == CLAUDE_CACHE_READ
    assert tr.requests["observed_input_tokens"].tolist()[:2] == [2892, 2]
    assert tr.requests["observed_cache_creation_input_tokens"].tolist()[0] == 2163
    assert tr.requests["observed_output_tokens"].tolist()[0] == 931
    # append-only: each prompt extends its parent's, and history reuses the parent's segments
    for r in tr.iter_requests():
        if r.parent_request_id >= 0:
            parent = tr.prompt_segment_ids(r.parent_request_id)
            assert list(r.prompt_segment_ids[:len(parent) - 1]) == list(parent[:-1])
    assert (tr.requests["tool_latency_s"] > 0).sum() >= 8 and tr.requests["think_time_s"].max() > 0
    _exact(tr, model_dir)
    tr.write(tmp_path / "t")
    back = Trace.read(tmp_path / "t")
    assert back.equals(tr) and back.request(3).observed_cache_read_input_tokens == 38590


def test_codex_rollout(traces, model_dir):
    tr = importers.import_codex(traces / "tracelab/example_sessions/codex/rollout.converted.jsonl", model_dir)
    assert tr.num_requests == 9
    assert tr.requests["observed_cached_tokens"].tolist()[:3] == [6912, 9600, 9856]
    first = json.loads(tr.requests["messages"][0])
    assert first[0]["role"] == "system" and first[0]["content"].startswith("You are Codex")
    assert (tr.requests["input_kind"] == "user").sum() == 3  # three user turns
    _exact(tr, model_dir)


@pytest.mark.parametrize("name,calls", [("gpt4__pydicom__pydicom-1458.traj", 12),
                                        ("demo_function_calling_replace_from_source__marshmallow-1867.traj", 13)])
def test_swe_agent(traces, model_dir, name, calls):
    tr = importers.import_swe_agent(traces / "swe-agent" / name, model_dir)
    assert tr.num_requests == calls and tr.meta["observed_totals"]["api_calls"] == calls
    _exact(tr, model_dir)


def test_swe_agent_elision_breaks_the_prefix(traces, model_dir):
    """From step 5 on, old observations are elided: the prompt stops extending its parent's."""
    tr = importers.import_swe_agent(traces / DEMO, model_dir)
    assert set(tr.requests["transition"][1:5]) == {"append"}
    assert "append" not in set(tr.requests["transition"][5:])


def test_openhands(traces, model_dir):
    tr = importers.import_openhands(traces / "openhands/basic_gui_mode.json", model_dir)
    assert tr.num_requests == 5  # 4 tool-calling responses + the final text answer
    assert tr.requests["observed_cache_read_input_tokens"].tolist()[:4] == [0, 3435, 3595, 4763]
    assert tr.requests["observed_prompt_tokens"].tolist()[:4] == [3439, 3601, 4769, 5488]
    _exact(tr, model_dir)


def test_openai_chat_from_swe_agent_steps(traces, model_dir, tmp_path):
    """The SWE-agent steps' messages are OpenAI chat requests; written as chat JSONL without session ids they
    import as one inferred session with the same prompts."""
    data = json.loads((traces / DEMO).read_text())
    src = tmp_path / "chat.jsonl"
    with src.open("w") as f:
        for i, step in enumerate(data["trajectory"][:4]):
            msgs = step["messages"]
            k = max(j for j, m in enumerate(msgs) if m["role"] == "assistant")
            f.write(json.dumps({"messages": msgs[:k], "response": msgs[k], "timestamp": 1000.0 + i,
                                "usage": {"prompt_tokens": 100 + i, "prompt_tokens_details": {"cached_tokens": 64}}})
                    + "\n")
    tr = importers.import_openai_chat(src, model_dir)
    assert tr.num_requests == 4 and tr.num_sessions == 1
    assert tr.requests["observed_cached_tokens"].tolist() == [64] * 4
    assert tr.requests["arrival_s"].tolist() == [0.0, 1.0, 2.0, 3.0]
    _exact(tr, model_dir)


def test_tracelab_counts_keep_prefix_reuse(traces, source):
    tr = importers.import_tracelab(traces / "tracelab/example_sessions/sanitized/round_trace.jsonl", source)
    rows = [json.loads(x) for x in (traces / "tracelab/example_sessions/sanitized/round_trace.jsonl").open()]
    assert tr.num_requests == 19 and tr.num_sessions == 2
    by_key = {(r["session_id"], r["round_index"]): r for r in rows}
    for r in tr.iter_requests():
        row = by_key[(r.session_id, r.step)]
        assert r.prompt_tokens == row["input_tokens_total"]
        if r.parent_request_id >= 0:
            a, b = tr.prompt_token_ids(r.parent_request_id), tr.prompt_token_ids(r.request_id)
            m = min(len(a), len(b))
            lcp = int(np.argmax(a[:m] != b[:m])) if (a[:m] != b[:m]).any() else m
            assert lcp >= min(row["prefix_tokens"], len(a))
    assert tr.requests["messages"].isna().all()


def test_malformed_line_names_file_and_line(tmp_path, model_dir):
    bad = tmp_path / "session.jsonl"
    bad.write_text('{"type": "mode"}\n{"type": "user", "message": \n')
    with pytest.raises(TraceFileError, match=r"session\.jsonl: line 2"):
        importers.import_claude_code(bad, model_dir)
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": "hi"}\n')
    with pytest.raises(TraceFileError, match=r"chat\.jsonl: line 2: `messages`"):
        importers.import_openai_chat(chat, model_dir)


def test_cli_malformed_line_exits_2_with_one_line(tmp_path, model_dir):
    bad = tmp_path / "rollout.jsonl"
    bad.write_text('{"type": "session_meta", "payload": {"id": "s"}}\nnot json\n')
    p = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "workload", "import", "codex", str(bad),
                        "--tokenizer", str(model_dir), "--out", str(tmp_path / "t")], capture_output=True, text=True)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.jsonl: line 2" in lines[0] and lines[0].startswith("kvscope: error:")


def _cc(uuid, parent, kind, content, mid=None, t=0):
    msg = {"role": kind, "content": content}
    if mid:
        msg.update(id=mid, usage={"input_tokens": 1, "cache_read_input_tokens": t, "cache_creation_input_tokens": 0,
                                  "output_tokens": 1})
    return json.dumps({"type": kind, "uuid": uuid, "parentUuid": parent, "sessionId": "s", "message": msg,
                       "timestamp": f"2026-01-01T00:00:{t:02d}Z"})


def test_claude_code_follows_the_parent_chain_through_rewinds_and_compaction(tmp_path):
    """A rewind forks the chain and a compaction starts a new root: a call's request is its own chain, not
    the file's order."""
    from kvscope.workloads.importers.claude_code import read_claude_code

    lines = [_cc("u1", None, "user", "first task"),
             _cc("a1", "u1", "assistant", [{"type": "text", "text": "answer one"}], "m1", 1),
             _cc("u2", "a1", "user", "abandoned follow-up"),
             _cc("a2", "u2", "assistant", [{"type": "text", "text": "abandoned answer"}], "m2", 2),
             _cc("u3", "a1", "user", "rewound follow-up"),
             _cc("a3", "u3", "assistant", [{"type": "text", "text": "answer three"}], "m3", 3),
             _cc("u4", None, "user", "summary of the conversation so far"),
             _cc("a4", "u4", "assistant", [{"type": "text", "text": "after compaction"}], "m4", 4)]
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    calls = read_claude_code(tmp_path / "s.jsonl")
    sent = [[m.content for m in c.messages] for c in calls]
    assert sent[2] == ["first task", "answer one", "rewound follow-up"]
    assert sent[3] == ["summary of the conversation so far"]
    assert [c.usage.cache_read_input_tokens for c in calls] == [1, 2, 3, 4]


_TEXT = st.lists(st.sampled_from(list("ab xyz\n\t{}\":,.é中🙂") + ["<|eot_id|>", "  ", "\n\n", " the"]),
                 max_size=30).map("".join)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(st.sampled_from(["user", "tool"]), _TEXT, _TEXT), min_size=1, max_size=5),
       system=_TEXT)
def test_any_text_imports_token_exact_and_append_only(model_dir, turns, system):
    """Whatever the text (whitespace at the edges, unicode, text that spells a special token), every prompt is
    exactly the chat template's rendering, and an append-only session's prompt starts with its parent's
    segments whenever the pieces tokenise independently."""
    from kvscope.workloads.importers.agent import Message, ModelCall, calls_to_trace

    history = [Message.text("system", system)] if system else []
    calls = []
    for i, (role, text, answer) in enumerate(turns):
        history.append(Message.text(role, text))
        calls.append(ModelCall("s", list(history), answer, request_s=float(i)))
        history.append(Message.text("assistant", answer))
    tr = calls_to_trace(calls, model_dir, name="prop", importer="test", source="-")
    _exact(tr, model_dir)
    if tr.meta["text"]["prompts_split_by_prefix"] == 0:
        for r in tr.iter_requests():
            if r.parent_request_id >= 0:
                parent = tr.prompt_segment_ids(r.parent_request_id)
                assert list(r.prompt_segment_ids[:len(parent)]) == list(parent)


def test_parts_that_merge_fall_back_to_a_prefix_split(model_dir):
    """A system message whose two parts merge into one word cannot be stored per part; the prompt stays exact
    and the session's second prompt still reuses the first one's segments for their common prefix."""
    from kvscope.workloads.importers.agent import Message, ModelCall, calls_to_trace

    system = Message("system", [("system", "You are a coding as"), ("tools", "sistant")])  # ≠ "assistant"
    first = [system, Message.text("user", "list the files")]
    second = [*first, Message.text("assistant", "ls"), Message.text("tool", "a.py b.py")]
    tr = calls_to_trace([ModelCall("s", first, "ls", request_s=0.0), ModelCall("s", second, "done", request_s=1.0)],
                        model_dir, name="merge", importer="test", source="-")
    assert tr.meta["text"]["prompts_split_by_prefix"] == 2
    _exact(tr, model_dir)
    a, b = tr.prompt_segment_ids(0), tr.prompt_segment_ids(1)
    assert len(a) == 1 and tr.seg_kinds[a[0]] == "imported"  # no parent: the whole rendering, one segment
    # the parent's whole prompt is a prefix of the child's: the child reuses that segment, then adds one
    pa, pb = tr.prompt_token_ids(0), tr.prompt_token_ids(1)
    assert tr.requests["transition"][1] == "append" and np.array_equal(pb[:len(pa)], pa)
    assert len(b) == 2 and b[0] == a[0]


@pytest.mark.parametrize("fmt,sample,calls", [
    ("claude-code", "tracelab/example_sessions/claude/session.converted.jsonl", 10),
    ("codex", "tracelab/example_sessions/codex/rollout.converted.jsonl", 9),
    ("swe-agent", "swe-agent/gpt4__pydicom__pydicom-1458.traj", 12),
    ("openhands", "openhands/basic.json", 2),
    ("tracelab", "tracelab/example_sessions/sanitized/round_trace.jsonl", 19),
])
def test_cli_import_registers_every_format(traces, model_dir, tmp_path, capsys, fmt, sample, calls):
    from kvscope.harness.cli.main import main

    out = tmp_path / "t"
    assert main(["workload", "import", fmt, str(traces / sample), "--tokenizer", str(model_dir),
                 "--out", str(out)]) == 0
    tr = Trace.read(out)
    assert tr.num_requests == calls and tr.meta["spec"]["importer"] == fmt
    assert f"{calls} " in capsys.readouterr().out
