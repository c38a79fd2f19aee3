"""`kvscope model build-tiny --tokenizer tekken`: the local Llama on Mistral's production Tekken tokenizer from
mistral_common's data folder (installed with vLLM), so imported real traffic gets realistic token counts."""

from __future__ import annotations

import json

import pytest

from kvscope.harness.model.tinymodel import TinyModelShape, build_tiny_model

pytest.importorskip("mistral_common")


@pytest.fixture(scope="module")
def tekken_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tekken")
    a = build_tiny_model(root / "a", seed=5, tokenizer="tekken")
    build_tiny_model(root / "b", seed=5, tokenizer="tekken")
    return root, a


@pytest.mark.slow
def test_same_seed_gives_byte_identical_files(tekken_pair):
    root, info = tekken_pair
    files = lambda d: {p.name: p.read_bytes() for p in sorted(d.iterdir())}  # noqa: E731
    assert files(root / "a") == files(root / "b")
    assert info.tokenizer == "tekken" and json.loads((root / "a/kvscope_model.json").read_text())["tokenizer"] == "tekken"


@pytest.mark.slow
def test_ids_are_mistral_commons_own(tekken_pair):
    from pathlib import Path

    import mistral_common
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    from tokenizers import Tokenizer

    root, _ = tekken_pair
    ours = Tokenizer.from_file(str(root / "a/tokenizer.json"))
    theirs = Tekkenizer.from_file(str(Path(mistral_common.__file__).parent / "data/tekken_240911.json"))
    for text in ["def f(x):\n    return x  # ok", "Héllo, wörld! 2026-12-03T09:00:00Z", "  \n\n\tmixed   spaces"]:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, bos=False, eos=False)


@pytest.mark.slow
def test_only_the_embedding_grows_and_kv_bytes_stay(tekken_pair):
    root, info = tekken_pair
    cfg = json.loads((root / "a/config.json").read_text())
    default = TinyModelShape()
    assert cfg["vocab_size"] == 131072 and cfg["tie_word_embeddings"] is True
    for key in ("num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size"):
        assert cfg[key] == getattr(default, key)
    assert info.shape.kv_bytes_per_token(2) == default.kv_bytes_per_token(2) == 2048


@pytest.mark.slow
def test_chat_template_splits_into_template_and_content_tokens(tekken_pair):
    """Text mode needs each message's content rendered once, between template pieces that tokenize
    on their own (Tekken's control tokens), so imported transcripts keep message-level segments."""
    from tokenizers import Tokenizer

    from kvscope.workloads.text import ChatTemplate

    root, _ = tekken_pair
    tpl = ChatTemplate.from_model_dir(root / "a")
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List files."},
            {"role": "assistant", "content": '{"name": "bash", "arguments": {"cmd": "ls"}}'},
            {"role": "tool", "content": "a.py\nb.py"}]
    text = tpl.render(msgs)
    assert text == ('<s>[SYSTEM_PROMPT]You are terse.[/SYSTEM_PROMPT][INST]List files.[/INST]'
                    '{"name": "bash", "arguments": {"cmd": "ls"}}</s>[TOOL_RESULTS]a.py\nb.py[/TOOL_RESULTS]')
    tok = Tokenizer.from_file(str(root / "a/tokenizer.json"))
    pieces = tpl.pieces([m["role"] for m in msgs])
    joined = []
    for piece, m in zip(pieces, msgs):
        joined += tok.encode(piece, add_special_tokens=False).ids + tok.encode(m["content"], add_special_tokens=False).ids
    joined += tok.encode(pieces[-1], add_special_tokens=False).ids
    assert joined == tok.encode(text, add_special_tokens=False).ids
    assert tok.encode("<s>[INST]", add_special_tokens=False).ids == [1, 3]


def test_training_a_production_tokenizer_model_is_refused(tmp_path, capsys):
    from kvscope.harness.cli.main import main

    assert main(["model", "build-tiny", "--out", str(tmp_path / "m"), "--tokenizer", "tekken",
                 "--train-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--train-steps with --tokenizer tekken" in err
    assert not (tmp_path / "m").exists()
