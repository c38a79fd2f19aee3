"""The generated text is frozen (workloads/corpus.py): the tiny model is trained on `generate_corpus` and every
generated trace's token ids are cut from `corpus_text`, so a change to either changes the model's bytes or every
trace. The digests below are those of the text as it was before the two generators were merged."""

from __future__ import annotations

import hashlib

import pytest
from kvscope.workloads.corpus import SEGMENT_FLAVOURS, corpus_text, generate_corpus


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_tiny_models_training_text_is_unchanged():
    assert _sha(generate_corpus(0, 20_000)) == "b5ed75245def2b8b8b34e08f12d42cd837587bda453f01042765e2e649df8c65"


@pytest.mark.parametrize("flavour, digest", [
    ("prose", "8929973ffa15c2e016a8fd216a60f727b2f93c6c4f98ce4db1dddab45c5e2c88"),
    ("code", "2a4e8a1f92ec5fa907af36b5390a49f4b89d84cb4b0c2f60df35ba02d5675793"),
    ("json", "82e7f53e5e89c1968e39a0f97394a271c3a18c74d6d60c433184c492ccf97815"),
])
def test_each_segment_corpus_is_unchanged(flavour, digest):
    pieces = corpus_text(flavour, 0, 20_000)
    assert _sha("".join(pieces)) == digest
    assert all(p.endswith("\n") for p in pieces) and sum(len(p) for p in pieces) >= 20_000


def test_the_corpora_differ_by_seed_and_flavour():
    assert generate_corpus(0, 2_000) != generate_corpus(1, 2_000)
    texts = {f: "".join(corpus_text(f, 0, 2_000)) for f in SEGMENT_FLAVOURS}
    assert len(set(texts.values())) == len(SEGMENT_FLAVOURS) == 3
