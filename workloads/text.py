"""Text mode: prompts as chat messages rendered through the model's chat template, token-exact.

In text mode every request also carries ``messages`` (a JSON list of ``{"role", "content", "n_tokens"}``) and
its token-id prompt is exactly what the model's chat template plus tokenizer produce for those messages (with
``add_generation_prompt=True``, no extra special tokens: what vLLM's ``/v1/chat/completions`` does). The
prompt segments are the content segments interleaved with ``template`` segments (BOS, role headers, end-of-turn
markers, the generation prompt), so token-mode and text-mode replays see the same prefix structure.

Exactness rests on two properties, both checked:

* **Stable content.** A content segment's ids re-encode to themselves: ``encode(decode(ids)) == ids``. Content
  is cut from a pre-tokenized corpus at *piece* boundaries of the tokenizer's pre-tokenizer (never inside a
  word), starts with a non-whitespace character and, from 2 tokens on, ends with one newline token; the exact
  length is reached with single-token filler words (`` the``, `` of`` …). Each drawn segment is verified and
  redrawn if it is not stable.
* **Clean boundaries.** Content after a template piece, content after another content segment (the system
  message concatenates system, tools and documents) and a template piece after content tokenize
  independently: special tokens split the text before pre-tokenization, and a newline followed by a
  non-whitespace character always ends a pre-tokenizer piece. :meth:`TextMode.self_check` renders a sample
  conversation and compares ids when text mode starts.

Limits: a 1-token content segment is a single word (no trailing newline), allowed only where it is a whole
message; segments that are concatenated inside the system message (system prompt parts, tools, documents,
volatile values) and reasoning parts have at least 2 tokens in text mode (1-token sizes become 2, counted in
``trace.json`` as ``text.resized_segments``). Edits and truncations keep the longest clean prefix of the old
content and redraw the rest. Templates whose text around a message depends on its content, or tokenizers that
merge the template's trailing whitespace with following text, fail the self check with an error.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kvscope.workloads.tokens import FLAVOUR, corpus_text, _special_ids, file_sha256
from kvscope.workloads.trace_schema import SegmentKind

# Message role of each history item kind.
ROLE = {SegmentKind.TASK: "user", SegmentKind.USER: "user", SegmentKind.SUMMARY: "user",
        SegmentKind.ASSISTANT: "assistant", SegmentKind.TOOL_CALL: "assistant", SegmentKind.TOOL_OUTPUT: "tool",
        SegmentKind.REASONING: "assistant", SegmentKind.DOCUMENT: "user", SegmentKind.IMPORTED: "user"}
_MARK = "\ue000{}\ue001"


# ------------------------------------------------------------------------------------------ chat template


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


class ChatTemplate:
    """The model's chat template, rendered like transformers / vLLM do (jinja2 sandbox, trim_blocks,
    lstrip_blocks, ``bos_token`` / ``eos_token`` from ``tokenizer_config.json``)."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        # deferred: jinja2 is heavy, only rendering a chat template needs it
        from jinja2.ext import loopcontrols
        # deferred: jinja2 is heavy, only rendering a chat template needs it
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg: str) -> None:
            raise ValueError(f"chat template: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        self.source = source
        self.sha256 = hashlib.sha256(source.encode()).hexdigest()
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token
        self._pieces: dict[tuple, list[str]] = {}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        p = Path(model_dir)
        cfg = json.loads((p / "tokenizer_config.json").read_text()) if (p / "tokenizer_config.json").exists() else {}
        if (p / "chat_template.jinja").exists():
            src = (p / "chat_template.jinja").read_text()
        elif isinstance(cfg.get("chat_template"), str):
            src = cfg["chat_template"]
        else:
            raise FileNotFoundError(f"{model_dir}: no chat_template.jinja and no chat_template in tokenizer_config.json "
                                    "(text mode renders messages through the model's chat template)")
        return cls(src, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")))

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                    add_generation_prompt=add_generation_prompt)

    def pieces(self, roles: Sequence[str]) -> list[str]:
        """The template text around the contents of a conversation with these roles: ``len(roles) + 1``
        strings; ``pieces[0] + content_0 + pieces[1] + … + content_n-1 + pieces[n]`` is the rendering."""
        key = tuple(roles)
        got = self._pieces.get(key)
        if got is None:
            text = self.render([{"role": r, "content": _MARK.format(i)} for i, r in enumerate(roles)])
            got, pos = [], 0
            for i in range(len(roles)):
                m = _MARK.format(i)
                j = text.find(m, pos)
                if j < 0 or text.count(m) != 1:
                    raise ValueError("chat template does not render each message's content exactly once; text mode "
                                     "cannot split it into template and content segments")
                got.append(text[pos:j])
                pos = j + len(m)
            got.append(text[pos:])
            if len(self._pieces) < 4096:
                self._pieces[key] = got
        return got


# ------------------------------------------------------------------------------------------ stable content


@lru_cache(maxsize=4)
def _text_corpora(tokenizer_file: str, sha: str, chars: int) -> dict:
    from tokenizers import Tokenizer  # deferred: tokenizers is heavy, only tokenizing needs it

    tok = Tokenizer.from_file(tokenizer_file)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    strs = [tok.decode([i], skip_special_tokens=False) for i in range(vocab)]
    first_ws = np.array([bool(s) and s[0].isspace() for s in strs])
    last_ws = np.array([bool(s) and s[-1].isspace() for s in strs])
    out = {}
    for flavour in ("prose", "code", "json"):
        enc = tok.encode("".join(corpus_text(flavour, 0, chars)), add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        words = np.asarray([-1 if w is None else w for w in enc.word_ids], dtype=np.int64)
        piece_start = np.ones(len(ids), dtype=bool)
        piece_start[1:] = words[1:] != words[:-1]
        starts = np.nonzero(piece_start & ~first_ws[ids])[0]
        # exclusive ends: a piece starts at e (or e == len) and the token before ends with non-whitespace
        ends_mask = np.append(piece_start[1:], True) & ~last_ws[ids]
        ends = np.nonzero(ends_mask)[0] + 1
        out[flavour] = (ids, starts, ends)
    return {"corpora": out, "strs": strs, "first_ws": first_ws, "last_ws": last_ws}


class TextMode:
    """Draws stable content segments and renders requests as messages (see the module doc)."""

    def __init__(self, model_dir: str | Path, corpus_chars: int = 400_000) -> None:
        from tokenizers import Tokenizer  # deferred: tokenizers is heavy, only tokenizing needs it

        p = Path(model_dir)
        f = p / "tokenizer.json"
        if not f.exists():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self.model_dir = p
        self.tok = Tokenizer.from_file(str(f))
        self.template = ChatTemplate.from_model_dir(p)
        data = _text_corpora(str(f.resolve()), file_sha256(f), corpus_chars)
        self.corpora = data["corpora"]
        strs = data["strs"]
        special = _special_ids(f)
        nl = self.encode("\n")
        if len(nl) != 1:
            raise ValueError(f"{model_dir}: a newline is not a single token; text mode needs one")
        self.newline = int(nl[0])
        fill, start = [], []
        for i, s in enumerate(strs):
            if i in special or not s.isascii():
                continue
            if len(s) >= 3 and s[0] == " " and s[1:].isalpha() and list(self.encode(s)) == [i]:
                fill.append(i)
            elif len(s) >= 2 and s.isalpha() and list(self.encode(s)) == [i]:
                start.append(i)
        if len(fill) < 16 or len(start) < 16:
            raise ValueError(f"{model_dir}: too few single-token words for text mode ({len(fill)}, {len(start)})")
        self.fillers = np.asarray(fill, dtype=np.int32)
        self.starters = np.asarray(start, dtype=np.int32)
        self._last_ws = data["last_ws"]
        self.resized = 0
        self._tmpl_ids: dict[str, np.ndarray] = {}
        self.self_check()

    # ---------------------------------------------------------------- tokenizer
    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: np.ndarray | Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def stable(self, ids: np.ndarray) -> bool:
        return len(ids) == 0 or np.array_equal(self.encode(self.decode(ids)), ids)

    def template_ids(self, text: str) -> np.ndarray:
        got = self._tmpl_ids.get(text)
        if got is None:
            got = self._tmpl_ids[text] = self.encode(text)
        return got

    # ---------------------------------------------------------------- content
    def _filler(self, k: int, rng: np.random.Generator) -> np.ndarray:
        return self.fillers[rng.integers(0, len(self.fillers), k)] if k > 0 else np.zeros(0, np.int32)

    def _plain(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Closed content without corpus text: a word, filler words, a newline (n >= 2)."""
        lead = self.starters[rng.integers(0, len(self.starters), 1)]
        return np.concatenate([lead, self._filler(n - 2, rng), [self.newline]]).astype(np.int32)

    def _window(self, flavour: str, m: int, rng: np.random.Generator) -> np.ndarray:
        ids, starts, ends = self.corpora[flavour]
        for _ in range(4):
            hi = np.searchsorted(starts, len(ids) - (m - 1), side="right")
            if hi == 0:
                break
            a = int(starts[rng.integers(0, hi)])
            j = np.searchsorted(ends, a + m - 1, side="right") - 1
            e = int(ends[j]) if j >= 0 else 0
            if e <= a:
                continue
            out = np.concatenate([ids[a:e], self._filler(m - 1 - (e - a), rng), [self.newline]]).astype(np.int32)
            if self.stable(out):
                return out
        return self._plain(m, rng)

    def closed(self, kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
        """``max(n, 2)`` stable tokens that start with a non-space piece and end with a newline token: safe to
        concatenate with other closed segments."""
        if n < 2:
            self.resized += 1
            n = 2
        flavour = FLAVOUR.get(kind, "prose")
        half = max(2, len(self.corpora[flavour][0]) // 2)
        parts, left = [], n
        while left > 0:
            m = left if left <= half else (half if left - half >= 2 else half - 2)
            parts.append(self._window(flavour, m, rng))
            left -= m
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def draw(self, kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
        """Exactly ``n`` stable tokens for a content segment that is a whole message (0 and 1 allowed)."""
        if n <= 0:
            return np.zeros(0, np.int32)
        if n == 1:
            return self.starters[rng.integers(0, len(self.starters), 1)].astype(np.int32)
        return self.closed(kind, n, rng)

    def output(self, kind: str, n: int, reasoning: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        """An assistant output of ``n`` tokens whose first ``reasoning`` tokens are a closed part, so that
        stripping them leaves stable content. Returns (ids, reasoning tokens actually used)."""
        if reasoning <= 0:
            return self.draw(kind, n, rng), 0
        head = self.closed(SegmentKind.REASONING, reasoning, rng)
        return np.concatenate([head, self.draw(kind, max(0, n - reasoning), rng)]).astype(np.int32), len(head)

    def clean_prefix(self, ids: np.ndarray, limit: int) -> int:
        """Length of the longest prefix of stable ``ids``, at most ``limit`` tokens, that ends at a pre-tokenizer
        piece boundary on a non-whitespace character (0 if none)."""
        enc = self.tok.encode(self.decode(ids), add_special_tokens=False)
        words = [-1 if w is None else w for w in enc.word_ids]
        for e in range(min(limit, len(words)), 0, -1):
            if (e == len(words) or words[e] != words[e - 1]) and not self._last_ws[enc.ids[e - 1]]:
                return e
        return 0

    def cut(self, ids: np.ndarray, n: int, rng: np.random.Generator, kind: str = "prose",
            edit_at: int | None = None) -> np.ndarray:
        """``n`` stable tokens that keep the longest clean prefix of ``ids``. Truncation (``edit_at`` None): keep
        at most ``n - 1`` tokens, pad with filler words and a newline. Edit: keep at most ``edit_at`` tokens,
        then a newline and fresh content up to ``n`` tokens, different from ``ids``."""
        if n <= 1:
            return self.draw(kind, n, rng)
        keep = self.clean_prefix(ids, n - 1 if edit_at is None else min(edit_at, n - 1))
        if keep == 0:
            out = self._plain(n, rng) if edit_at is None else self.closed(kind, n, rng)
        elif edit_at is None or n - keep - 1 < 2:
            out = np.concatenate([ids[:keep], self._filler(n - 1 - keep, rng), [self.newline]])
        else:
            out = np.concatenate([ids[:keep], [self.newline], self.closed(kind, n - keep - 1, rng)])
        out = out.astype(np.int32)
        for _ in range(4):
            if self.stable(out) and (edit_at is None or not np.array_equal(out, ids)):
                return out
            out = self._plain(n, rng)
        return out

    def volatile(self, n: int, counter: int) -> np.ndarray:
        """A distinct value per ``counter``: a word (the counter modulo the number of single-token words),
        then filler words spelling the rest of the counter, then a newline. Distinct for
        ``len(starters) * len(fillers) ** (n - 2)`` counters; at least 2 tokens."""
        if n < 2:
            self.resized += 1
            n = 2
        c = counter
        out = [int(self.starters[c % len(self.starters)])]
        c //= len(self.starters)
        for _ in range(n - 2):
            out.append(int(self.fillers[c % len(self.fillers)]))
            c //= len(self.fillers)
        out.append(self.newline)
        return np.asarray(out, dtype=np.int32)

    # ---------------------------------------------------------------- checks
    def render_ids(self, messages: Sequence[dict]) -> np.ndarray:
        """Token ids of ``messages`` rendered with the chat template (generation prompt on), as vLLM does."""
        return self.encode(self.template.render(messages))

    def self_check(self) -> None:
        rng = np.random.default_rng(0)
        parts = [("system", [self.closed(SegmentKind.SYSTEM, 40, rng), self.closed(SegmentKind.TOOLS, 30, rng)]),
                 ("user", [self.draw(SegmentKind.TASK, 25, rng)]),
                 ("assistant", [self.draw(SegmentKind.TOOL_CALL, 1, rng)]),
                 ("tool", [self.draw(SegmentKind.TOOL_OUTPUT, 30, rng)]),
                 ("assistant", [self.draw(SegmentKind.ASSISTANT, 0, rng)])]
        pieces = self.template.pieces([r for r, _ in parts])
        ids: list[np.ndarray] = []
        for (_, segs), t in zip(parts, pieces):
            ids += [self.template_ids(t), *segs]
        ids.append(self.template_ids(pieces[-1]))
        msgs = [{"role": r, "content": "".join(self.decode(s) for s in segs)} for r, segs in parts]
        want = self.render_ids(msgs)
        if not np.array_equal(np.concatenate(ids), want):
            raise ValueError(f"{self.model_dir}: the chat template and tokenizer do not split into template and "
                             "content segments (text mode cannot keep prompts token-exact for this model)")
