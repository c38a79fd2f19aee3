"""Text mode: messages rendered through the model's chat template are token-exact with the trace's prompts;
volatile values stay distinct for many requests."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvscope.workloads.generate import generate
from kvscope.workloads.spec import load_spec, parse_spec
from kvscope.workloads.stats import ideal_hit_ratio
from kvscope.workloads.text import TextMode


@pytest.fixture(scope="module")
def render(model_dir):
    """Independent reference: jinja2 + the model's chat_template.jinja + `tokenizers`, like vLLM's chat API."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tmpl = env.from_string((model_dir / "chat_template.jinja").read_text())

    def ids(messages: list[dict]) -> list[int]:
        text = tmpl.render(messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                           bos_token=cfg["bos_token"], eos_token=cfg["eos_token"], add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False).ids

    ids.tok = tok  # type: ignore[attr-defined]
    return ids


def _check_exact(tr, render) -> None:
    tok = render.tok
    for rid in range(tr.num_requests):
        msgs = json.loads(tr.requests.messages[rid])
        assert render(msgs) == tr.prompt_token_ids(rid).tolist(), rid
        for m in msgs:
            assert m["n_tokens"] == len(tok.encode(m["content"], add_special_tokens=False).ids)


@pytest.mark.parametrize("name", ["agent-coding", "agent-coding-timestamped", "agent-coding-compaction", "chat",
                                  "rag-shared-doc"])
def test_text_mode_prompts_equal_rendered_messages(name, source, render):
    tr = generate(load_spec(name), source, scale=0.05, sessions=4, max_context=8192, text=True)
    _check_exact(tr, render)
    assert tr.meta["text"]["template_segments"] >= 3
    kinds = [k for k, *_ in tr.segment_map(tr.num_requests - 1)]
    assert kinds[0] == "template" and kinds[-1] == "template"
    roles = {m["role"] for r in range(tr.num_requests) for m in json.loads(tr.requests.messages[r])}
    assert roles <= {"system", "user", "assistant", "tool"}


def test_text_mode_every_policy_and_reasoning_is_exact(source, render):
    for policies in ([{"kind": "edit_turn", "depth": 3, "tokens": 8, "probability": 0.7}],
                     [{"kind": "truncate_tool_outputs", "keep_last": 1, "max_tokens": 5}],
                     [{"kind": "strip_reasoning", "keep_last": 1}],
                     [{"kind": "reorder_tools", "probability": 0.5}],
                     [{"kind": "sliding_window", "budget_tokens": 1500}],
                     [{"kind": "compaction", "threshold_tokens": 1500, "summary_tokens": 100, "keep_last": 2}],
                     [{"kind": "volatile_prefix", "tokens": 3, "position": 30}]):
        spec = parse_spec({"sessions": {"kind": "agent", "count": 3, "policies": policies, "agent": {
            "calls": 10, "tool_output_tokens": {"kind": "lognormal", "median": 60, "sigma": 1.5},
            "tool_call_tokens": {"kind": "uniform", "low": 1, "high": 40}, "reasoning_tokens": 6,
            "user_turn_probability": 0.3}}, "prefix": {"system_tokens": 200, "tools_tokens": 300, "tool_count": 5}})
        tr = generate(spec, source, seed=1, text=True)
        _check_exact(tr, render)


def test_text_mode_keeps_sizes_and_prefix_structure(source):
    """Same spec in token and text mode: content sizes are equal, text prompts add only template tokens, and
    the parent's prompt stays a prefix (append) exactly where it does in token mode."""
    spec = parse_spec({"sessions": {"kind": "agent", "count": 5, "agent": {"calls": 8, "tool_output_tokens": 80}},
                       "prefix": {"system_tokens": 120, "tools_tokens": 90, "tool_count": 3}})
    tok, txt = generate(spec, source), generate(spec, source, text=True)
    assert tok.num_requests == txt.num_requests
    assert list(tok.requests.transition) == list(txt.requests.transition)
    for rid in range(txt.num_requests):
        a = [(k, n) for k, _, n, _ in tok.segment_map(rid)]
        b = [(k, n) for k, _, n, _ in txt.segment_map(rid) if k != "template"]
        assert a == b
        msgs = json.loads(txt.requests.messages[rid])
        assert len(msgs) == 1 + len([k for k, _ in a if k not in ("system", "tools", "document", "volatile")])
    assert abs(ideal_hit_ratio(tok, 16, per_session=True) - ideal_hit_ratio(txt, 16, per_session=True)) < 0.03


def test_text_content_is_stable(model_dir):
    tm = TextMode(model_dir)
    rng = np.random.default_rng(0)
    for kind in ("system", "tools", "tool_output", "tool_call", "user"):
        for n in (1, 2, 3, 7, 64, 500, 5000):
            ids = tm.draw(kind, n, rng)
            assert len(ids) == n and tm.stable(ids)
            if n >= 2:
                assert ids[-1] == tm.newline and not tm.decode(ids[:1]).isspace()
    # closed segments concatenate without changing tokenization
    parts = [tm.closed(k, n, rng) for k, n in (("system", 50), ("tools", 2), ("tools", 33), ("document", 9))]
    assert tm.stable(np.concatenate(parts))
    base = tm.draw("prose", 300, rng)
    for n in (1, 2, 10, 150):
        assert len(tm.cut(base, n, rng)) == n and tm.stable(tm.cut(base, n, rng))
    ed = tm.cut(base, 300, rng, edit_at=120)
    assert len(ed) == 300 and tm.stable(ed) and not np.array_equal(ed, base)
    assert np.array_equal(ed[:100], base[:100]) or (ed[:100] != base[:100]).argmax() > 80


def test_cli_generate_text(tmp_path, model_dir, render):
    from kvscope.harness.cli import workload as cli
    from kvscope.workloads.trace import Trace

    parser = argparse.ArgumentParser(prog="kvscope")
    cli.add_subcommands(parser.add_subparsers())
    out = tmp_path / "tr"
    args = parser.parse_args(["workload", "generate", "chat", "--tokenizer", str(model_dir), "--out", str(out),
                              "--scale", "0.05", "--sessions", "3", "--no-progress", "--text"])
    assert args.func(args) == 0
    tr = Trace.read(out)
    assert tr.requests.messages.notna().all()
    _check_exact(tr, render)


# ---------------------------------------------------------------------------------------- volatile values


def test_volatile_values_distinct_over_20000_requests(source, model_dir):
    spec = parse_spec({"sessions": {"kind": "chat", "count": 2500, "chat": {
        "turns": 8, "user_tokens": 2, "output_tokens": 1, "think_time_s": 0.0},
        "policies": [{"kind": "volatile_prefix", "tokens": 2, "position": 4}]},
        "prefix": {"system_tokens": 12}, "arrival": {"kind": "all_at_once"}})
    tr = generate(spec, source)
    assert tr.num_requests == 20_000 > len(source.plain_ids)
    vol = [tuple(tr.segment_tokens(s)) for s in range(tr.num_segments) if tr.seg_kinds[s] == "volatile"]
    assert len(vol) == 20_000 and len(set(vol)) == 20_000
    # the shared prefix of any two prompts ends inside the volatile value (position 4, 2 tokens)
    prompts = np.stack([tr.prompt_token_ids(r)[:6] for r in range(tr.num_requests)])
    assert len({p.tobytes() for p in prompts}) == 20_000
    # text mode: volatile values are words spelling the counter, distinct as well
    tm = TextMode(model_dir)
    vals = {tm.volatile(3, c).tobytes() for c in range(20_000)}
    assert len(vals) == 20_000 and len(tm.starters) < 20_000
    assert all(tm.stable(tm.volatile(3, c)) for c in range(0, 20_000, 997))
