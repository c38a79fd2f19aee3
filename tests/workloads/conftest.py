"""Shared fixtures: a tiny model dir with tokenizer.json, and the real traces in ../shared/data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data"
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|pad|>"]


def _own_tokenizer(out: Path) -> Path:
    """Throwaway byte-level BPE (used when harness.tinymodel cannot build a model here)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from workloads.tokens import corpus_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [line for f in ("prose", "code", "json") for line in corpus_text(f, 99, 300_000)]
    tok.train_from_iterator(lines, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIALS[0], "eos_token": SPECIALS[4]}))
    (out / "chat_template.jinja").write_text(
        "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{%- endfor %}")
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tinymodel") / "model"
    try:
        from harness.tinymodel import build_tiny_model

        build_tiny_model(out, seed=0)
        if (out / "tokenizer.json").exists():
            return out
    except Exception:  # noqa: BLE001 - the builder may need torch or be unfinished; fall back
        pass
    return _own_tokenizer(tmp_path_factory.mktemp("owntok"))


@pytest.fixture(scope="session")
def source(model_dir):
    from workloads.tokens import TokenSource

    return TokenSource.from_tokenizer(model_dir)


def need_data(name: str) -> Path:
    p = DATA / name
    if not p.exists():
        pytest.skip(f"real trace {p} not found (expected ../shared/data next to the repo)")
    return p
