"""Seeded agent-like text: prose, code, tool calls and tool output, for the tiny model and for trace segments.

One generator serves two corpora, each in its own :class:`TextStyle`:

* :data:`TRAINING_STYLE` — :func:`generate_corpus`, the text the tiny model's tokenizer and weights are trained
  on (``harness.model.tinymodel``). Its vocabulary, ranges and random-draw order are frozen: the same seed must
  give byte-identical model files, and a changed model changes every figure measured on it.
* :data:`SEGMENT_STYLE` — :func:`corpus_text`, the per-flavour corpora that generated segments are cut from
  (``workloads.tokens``). Frozen too: a change here changes every generated trace's token ids.

Why one module with two styles rather than one style: the two corpora were tuned separately (the segment
style has a larger vocabulary, inline identifiers and numbers, more kinds of tool output) and both are pinned
by what was built from them, so they share the pieces that are the same — identifiers, sentences, function
definitions — with each style's numbers as data. A style whose probability of an inline identifier or number
is 0 draws no random number for it, which is what keeps the training corpus's random stream unchanged.
numpy's PCG64 drives every choice, so a seed gives the same text on every platform.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TextStyle:
    """The vocabulary and ranges of one corpus; integer ranges are numpy's ``integers(lo, hi)`` (hi excluded)."""

    words: tuple[str, ...]
    idents: tuple[str, ...]
    tools: tuple[str, ...]
    exts: tuple[str, ...]
    #: Words a sentence.
    sentence_words: tuple[int, int]
    #: Chance of an inline `identifier`, then of a number, inserted into a sentence (0: never, no draw).
    inline_ident_p: float
    inline_number_p: float
    #: A generated function's keyword argument and the range of its default ...
    def_kwarg: str
    def_kwarg_range: tuple[int, int]
    #: ... its assignment lines, and the range of the values they default to.
    def_lines: tuple[int, int]
    def_value_range: tuple[int, int]


TRAINING_STYLE = TextStyle(
    words=tuple((
        "the a to of and in for is on that with this it as be are from by at or an will can not use file "
        "function value return error test request cache token prefix block model server agent tool output "
        "result step user system prompt context history session memory latency throughput batch queue "
        "config path line read write update create delete list search find open close run build install "
        "check fix change add remove import export data table row column index key hash size time rate"
    ).split()),
    idents=tuple((
        "config request response handler client server cache block token prefix session step trace model "
        "record metric result output input buffer stream parser writer reader index state queue worker"
    ).split()),
    tools=("read_file", "write_file", "bash", "grep", "list_dir", "edit_file", "run_tests", "search_code"),
    exts=("py", "ts", "rs", "go", "md", "json", "yaml", "toml", "txt", "c"),
    sentence_words=(5, 18), inline_ident_p=0.0, inline_number_p=0.0,
    def_kwarg="timeout_s", def_kwarg_range=(1, 120), def_lines=(2, 7), def_value_range=(0, 4096),
)

SEGMENT_STYLE = TextStyle(
    words=tuple((
        "the a to of and in is for that on with as it be by this are from at or an was file function test value "
        "error return user agent tool call result output input request response cache prefix token block model "
        "server client session step history context summary please fix update check run build add remove change "
        "read write list search find open close config path line data table row column index key hash size time "
        "rate latency throughput memory queue batch worker thread process module class method type string number "
        "should would could will can must may need want make sure first then next finally because however also"
    ).split()),
    idents=tuple((
        "config request response handler client server cache block token prefix session step trace model record "
        "metric result output input buffer stream parser writer reader index state queue worker pool manager util "
        "helper loader store engine router scheduler allocator tensor layer kernel"
    ).split()),
    tools=("read_file", "write_file", "bash", "grep", "glob", "list_dir", "edit_file", "run_tests", "search_code",
           "web_fetch", "todo_write", "task"),
    exts=("py", "ts", "rs", "go", "md", "json", "yaml", "toml", "txt", "c", "cpp", "java"),
    sentence_words=(4, 20), inline_ident_p=0.3, inline_number_p=0.2,
    def_kwarg="limit", def_kwarg_range=(1, 4096), def_lines=(2, 8), def_value_range=(0, 99999),
)


# --------------------------------------------------------------------------------------- shared pieces

def ident(rng: np.random.Generator, style: TextStyle) -> str:
    """A snake_case identifier of one to three of the style's words."""
    return "_".join(str(p) for p in rng.choice(style.idents, size=int(rng.integers(1, 4))))


def sentence(rng: np.random.Generator, style: TextStyle) -> str:
    words = [str(w) for w in rng.choice(style.words, size=int(rng.integers(*style.sentence_words)))]
    if style.inline_ident_p and rng.random() < style.inline_ident_p:
        words.insert(int(rng.integers(0, len(words))), f"`{ident(rng, style)}`")
    if style.inline_number_p and rng.random() < style.inline_number_p:
        words.insert(int(rng.integers(0, len(words))), str(int(rng.integers(0, 100000))))
    words[0] = words[0].capitalize()
    return " ".join(words) + str(rng.choice([".", ".", ".", "?", "!", ":"]))


def function_def(rng: np.random.Generator, style: TextStyle) -> str:
    """A Python function reading a dict: docstring, ``get`` lines, the odd ``raise``."""
    name, arg = ident(rng, style), ident(rng, style)
    body = [f"def {name}({arg}, {style.def_kwarg}={int(rng.integers(*style.def_kwarg_range))}):",
            f'    """{sentence(rng, style)}"""']
    for _ in range(int(rng.integers(*style.def_lines))):
        var = ident(rng, style)
        body.append(f"    {var} = {arg}.get('{ident(rng, style)}', {int(rng.integers(*style.def_value_range))})")
        if rng.random() < 0.4:
            body.append(f"    if {var} is None:\n        raise ValueError('{sentence(rng, style)}')")
    body.append(f"    return {ident(rng, style)}")
    return "\n".join(body)


# ------------------------------------------------------------------ the tiny model's training corpus

def _training_tool_call(rng: np.random.Generator) -> str:
    s = TRAINING_STYLE
    tool = str(rng.choice(s.tools))
    path = "/".join(ident(rng, s) for _ in range(int(rng.integers(1, 4)))) + "." + str(rng.choice(s.exts))
    return json.dumps({"name": tool, "arguments": {"path": path, "line": int(rng.integers(1, 900))}})


def _training_tool_output(rng: np.random.Generator) -> str:
    s = TRAINING_STYLE
    kind = rng.integers(0, 3)
    if kind == 0:
        return "\n".join(
            f"{ident(rng, s)}.{rng.choice(s.exts)}  {int(rng.integers(10, 99999))} bytes"
            for _ in range(int(rng.integers(3, 12)))
        )
    if kind == 1:
        return "\n".join(
            f"{i + 1:4d}  {function_def(rng, s).splitlines()[0]}" for i in range(int(rng.integers(3, 10)))
        )
    return f"{int(rng.integers(1, 300))} passed, {int(rng.integers(0, 5))} failed in {rng.random() * 30:.2f}s"


def generate_corpus(seed: int, num_chars: int = 1_500_000) -> str:
    """Agent-like text (prose, code, JSON tool calls, tool output) to train the tiny model's tokenizer and
    weights on (:data:`TRAINING_STYLE`)."""
    rng = np.random.default_rng(seed)
    makers = (lambda r: sentence(r, TRAINING_STYLE), lambda r: function_def(r, TRAINING_STYLE),
              _training_tool_call, _training_tool_output)
    pieces: list[str] = []
    total = 0
    while total < num_chars:
        piece = makers[int(rng.integers(0, len(makers)))](rng)
        pieces.append(piece)
        total += len(piece) + 1
    return "\n".join(pieces)


# ------------------------------------------------------------------------- segment corpora by flavour

def _segment_code(rng: np.random.Generator) -> str:
    s = SEGMENT_STYLE
    kind = int(rng.integers(0, 4))
    if kind == 0:
        return function_def(rng, s)
    if kind == 1:
        return "\n".join(f"{'/'.join(ident(rng, s) for _ in range(int(rng.integers(1, 4))))}.{rng.choice(s.exts)}"
                         f"  {int(rng.integers(10, 999999))} bytes" for _ in range(int(rng.integers(3, 15))))
    if kind == 2:
        return "\n".join(f"{int(rng.integers(1, 5000)):5d}\t{ident(rng, s)}({ident(rng, s)}={int(rng.integers(0, 999))})"
                         for _ in range(int(rng.integers(3, 12))))
    return (f"===== {int(rng.integers(1, 900))} passed, {int(rng.integers(0, 9))} failed in "
            f"{rng.random() * 60:.2f}s =====\nFAILED tests/{ident(rng, s)}.py::test_{ident(rng, s)} - "
            f"AssertionError: {sentence(rng, s)}")


def _segment_json(rng: np.random.Generator) -> str:
    s = SEGMENT_STYLE
    if rng.random() < 0.5:
        return json.dumps({"type": "tool_use", "id": f"toolu_{int(rng.integers(1 << 40)):x}",
                           "name": str(rng.choice(s.tools)),
                           "input": {"path": "/".join(ident(rng, s) for _ in range(int(rng.integers(1, 4))))
                                     + "." + str(rng.choice(s.exts)),
                                     "offset": int(rng.integers(0, 2000)), "pattern": ident(rng, s)}})
    return json.dumps({"name": str(rng.choice(s.tools)), "description": sentence(rng, s),
                       "input_schema": {"type": "object", "properties": {
                           ident(rng, s): {"type": str(rng.choice(["string", "integer", "boolean", "array"])),
                                           "description": sentence(rng, s)} for _ in range(int(rng.integers(1, 4)))},
                           "required": [ident(rng, s)]}})


_SEGMENT_MAKERS = {"prose": lambda r: " ".join(sentence(r, SEGMENT_STYLE) for _ in range(int(r.integers(1, 5)))),
                   "code": _segment_code, "json": _segment_json}
#: The segment corpora, in the order their seeds are derived (``[seed, index]``).
SEGMENT_FLAVOURS = tuple(_SEGMENT_MAKERS)


def corpus_text(flavour: str, seed: int, num_chars: int) -> list[str]:
    """The ``flavour`` corpus (:data:`SEGMENT_FLAVOURS`) in pieces of about a paragraph, each ending in a newline."""
    rng = np.random.default_rng([seed, SEGMENT_FLAVOURS.index(flavour)])
    out, total = [], 0
    while total < num_chars:
        piece = _SEGMENT_MAKERS[flavour](rng)
        out.append(piece + "\n")
        total += len(piece) + 1
    return out


__all__ = ["SEGMENT_FLAVOURS", "SEGMENT_STYLE", "TRAINING_STYLE", "TextStyle", "corpus_text", "function_def",
           "generate_corpus", "ident", "sentence"]
