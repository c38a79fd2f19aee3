"""Segment token sources: where the token ids of generated segments come from.

Segments should look like real text to the model (byte-level BPE merges, realistic token frequencies) while
their *lengths* are exact. We generate a seeded text corpus per segment flavour (prose, code and tool output,
JSON tool calls: :func:`.corpus.corpus_text`), tokenize it once with the model's ``tokenizer.json`` and cut
segments as windows of the tokenized corpus at random offsets, trimmed to the exact length. Special tokens (BOS, EOS, chat-template
markers) are removed from the corpus so they never appear inside content.

Windows at different offsets of a varied corpus almost never share a leading run of more than a few tokens,
so distinct segments do not create accidental prefix-cache hits at block granularity (16+ tokens). This is a
statistical property, not a guarantee; the volatile segments, whose uniqueness matters for the
``volatile_prefix`` policy, spell a per-trace counter, so they are distinct (see :meth:`TokenSource.volatile`).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvscope.workloads.corpus import SEGMENT_FLAVOURS, corpus_text
from kvscope.workloads.trace_schema import SegmentKind

# Which corpus each segment kind is drawn from.
FLAVOUR = {
    SegmentKind.SYSTEM: "prose", SegmentKind.TASK: "prose", SegmentKind.USER: "prose", SegmentKind.SUMMARY: "prose",
    SegmentKind.REASONING: "prose", SegmentKind.ASSISTANT: "prose", SegmentKind.DOCUMENT: "prose",
    SegmentKind.TOOLS: "json", SegmentKind.TOOL_CALL: "json", SegmentKind.TOOL_OUTPUT: "code",
    SegmentKind.VOLATILE: "prose", SegmentKind.IMPORTED: "prose",
}

def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@lru_cache(maxsize=8)
def _tokenized_corpora(tokenizer_file: str, sha: str, chars: int) -> tuple[dict[str, np.ndarray], int, tuple]:
    from tokenizers import Tokenizer  # deferred: tokenizers is heavy, only tokenizing needs it

    tok = Tokenizer.from_file(tokenizer_file)
    special = _special_ids(Path(tokenizer_file))
    corpora = {}
    for flavour in SEGMENT_FLAVOURS:
        enc = tok.encode_batch(corpus_text(flavour, 0, chars), add_special_tokens=False)
        ids = np.fromiter((i for e in enc for i in e.ids), dtype=np.int32)
        if special:
            ids = ids[~np.isin(ids, np.asarray(sorted(special), dtype=np.int32))]
        corpora[flavour] = ids
    return corpora, tok.get_vocab_size(with_added_tokens=True), tuple(sorted(special))


def _special_ids(tokenizer_file: Path) -> set[int]:
    data = json.loads(Path(tokenizer_file).read_text())
    return {int(t["id"]) for t in data.get("added_tokens", []) if t.get("special", True)}


class TokenSource:
    """Draws exact-length token windows for segments.

    ``TokenSource.from_tokenizer(model_dir)`` uses the model's tokenizer; ``TokenSource.uniform(vocab_size)``
    draws uniform ids (used for block-id imports when no tokenizer is given, and in quick tests).
    """

    def __init__(self, corpora: dict[str, np.ndarray] | None, vocab_size: int, special: tuple[int, ...] = (),
                 info: dict | None = None) -> None:
        self.corpora = corpora
        self.vocab_size = vocab_size
        self.special = special
        self.info = info
        # Ids safe to use for uniform draws and volatile lead tokens: everything that is not special.
        mask = np.ones(vocab_size, dtype=bool)
        if special:
            mask[np.asarray(special)] = False
        self.plain_ids = np.nonzero(mask)[0].astype(np.int32)

    @classmethod
    def from_tokenizer(cls, model_dir: str | Path, corpus_chars: int = 400_000) -> "TokenSource":
        p = Path(model_dir)
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.exists():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        sha = file_sha256(f)
        corpora, vocab, special = _tokenized_corpora(str(f.resolve()), sha, corpus_chars)
        return cls(corpora, vocab, special, info={"path": str(p), "sha256": sha, "vocab_size": vocab})

    @classmethod
    def uniform(cls, vocab_size: int = 4096, special: tuple[int, ...] = ()) -> "TokenSource":
        return cls(None, vocab_size, special, info=None)

    def draw(self, kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` token ids that read like a ``kind`` segment (a window of the tokenized corpus)."""
        if n <= 0:
            return np.zeros(0, dtype=np.int32)
        if self.corpora is None:
            return self.plain_ids[rng.integers(0, len(self.plain_ids), n)]
        corpus = self.corpora[FLAVOUR.get(kind, "prose")]
        if n < len(corpus):
            off = int(rng.integers(0, len(corpus) - n))
            return corpus[off:off + n].copy()
        parts, left = [], n
        while left > 0:
            m = min(left, len(corpus) // 2)
            off = int(rng.integers(0, len(corpus) - m))
            parts.append(corpus[off:off + m])
            left -= m
        return np.concatenate(parts)

    def volatile(self, n: int, counter: int, rng: np.random.Generator) -> np.ndarray:
        """A changing value (timestamp-like) of ``n`` tokens that spell ``counter`` in base ``len(plain_ids)``
        (least significant first): distinct for ``len(plain_ids) ** n`` requests, and its first token differs
        from the previous ``len(plain_ids) - 1`` values, so it never extends a shared prefix."""
        self.draw(SegmentKind.VOLATILE, n, rng)  # keeps the session's random stream where it was before this change
        v = len(self.plain_ids)
        digits = np.empty(n, dtype=np.int64)
        c = int(counter)
        for i in range(n):
            digits[i] = c % v
            c //= v
        return self.plain_ids[digits].astype(np.int32)
