"""Cache-break attribution: why each request missed the prefix cache, and what removing each cause would buy.

For every request the *best cached predecessor* is the earlier request (prompt plus known output) with the
longest common token prefix, found through a chained-block-hash index (O(total blocks)) and refined by exact
comparison with the session parent and the previous request. The first diverging token ``k`` is located in a
message (message spans come from the trace's segments: one per message in recorded traces, template segments
between messages in generated text-mode traces), and the message-level difference names the cause:

``tools_changed``         the diverging message is unchanged but the tool list differs (changed or reordered)
``volatile_field``        a date, time, timestamp, uuid or long hex id spans the first differing character
``system_prompt_changed`` the system message differs otherwise
``message_edited``        an earlier message changed in place, the messages after it are the same
``history_truncated``     messages dropped or a message cut short, nothing new in their place
``compaction``            the history was replaced by new content (a summary) and the prompt got shorter

Three causes are shortfalls of the run, not of the history; each is checked per request against the exact
simulator (:mod:`kvscope.harness.cachemodel.simulator`) with an unbounded pool on the tokens the server really
held (the prompts as sent, the answers it generated):

``replay_substituted_output`` a recorded-mode replay sent the trace's planned answer where the server had
                          generated and cached another: the blocks after the parent's prompt can never match
                          (the simulation on the planned answers hits, the one on the generated answers not)
``not_yet_cached``        the unbounded simulation in request order hits, the one in the run's own send /
                          finish order does not: a concurrent request was still computing the prefix
``evicted``               the unbounded simulation in the run's order hits (the block was cached earlier in
                          this run) and the server did not: cached, then lost

A live-mode run is read on the prompts it sent (its session's earlier answers as generated) and the answers
the server generated, so its history is what the server saw and ``replay_substituted_output`` cannot occur.

In a routed run (``model_switch`` given) the part of the ``evicted`` shortfall the session's previous model
held is its own cause:

``model_switch``          the previous step ran on another model, with its own cache: the history is
                          recomputed on this one

*Recomputed tokens* are tokens the predecessor already had (the common prefix, the rest of the diverging
message where it was changed in place, and later messages the predecessor also had) that this request did not
get from the cache, floored to whole blocks and capped like vLLM's hit (``(P-1)//B`` blocks); new tokens are
never recomputed. Traces without message structure fall back to segment kinds and the trace's transitions;
there the tokens after the diverging segment count only where the predecessor had the same ones (an unrelated
prompt, diverging at token 0 from a predecessor it shares nothing with, recomputes nothing).

What-if: each break of a cause becomes a token *patch* (this request's diverging span replaced by the
predecessor's; for compaction and truncation the predecessor's full history put back), applied to the request
and to every later request that carries the same span, newest patch first; the patched trace goes through the
exact simulator (:mod:`kvscope.harness.cachemodel.simulator`, infinite cache) caching what the server could
cache (a recorded replay's generated answers, never its planned ones, so no what-if credits reuse the replay
cannot get), and the run's eviction and not-yet-cached losses are carried over. A shortfall cause's what-if
puts its lost tokens back: ``evicted``'s is an infinite cache, ``replay_substituted_output``'s a live replay.

Memory (5,000 generated timestamped sessions, every request breaking the cache: the heaviest case,
``benchmarks/explain_scale.py``): a pass over the trace keeps, per request, only its attribution row; prompts
are rebuilt from the trace as they are read (:class:`TraceViews`), the infinite-cache simulation and the
predecessor search share one compact index of block-hash chains (:mod:`~kvscope.harness.cachemodel.chain_index`,
12 bytes a chain: the largest holder, ~0.6 GB for ~48 M chains), the what-if patches of a cause are packed in
flat arrays (:class:`_PatchList`), and the provider cache model's comparison builds each request's block hashes
when it comes to it in arrival order, not a hash list per request up front. The trace itself holds its segment
ids as int32 views into one flat array (:class:`~kvscope.workloads.trace.Trace`).
"""

from __future__ import annotations

import bisect
import json
from array import array
import re
import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from pathlib import Path

import numpy as np
from kvscope.harness.analysis.causes import Cause
from kvscope.harness.cachemodel.chain_index import ChainIndex, InfiniteCacheStream, chain_hashes
from kvscope.harness.cachemodel.hashing import IncrementalHasher
from kvscope.harness.cachemodel.simulator import (SimConfig, iter_requests_from_token_pairs, predict_cached_tokens,
                                                  requests_from_token_pairs)
from kvscope.harness.common.numbers import nan_to_none
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE, Transition, common_prefix_len
from kvscope.workloads.trace_schema import SegmentKind
from kvscope.harness.cachemodel.simulator import Replica
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.pricing.provider_cache import ProviderCache, load_preset
from kvscope.harness.results.exchanges import read_exchanges
from kvscope.harness.results.records import read_records


#: Causes that change a span in place (the rest of the prompt was there before), against those that drop or
#: replace history.
_IN_PLACE = {Cause.VOLATILE_FIELD, Cause.SYSTEM_PROMPT_CHANGED, Cause.TOOLS_CHANGED, Cause.MESSAGE_EDITED,
             Cause.PREFIX_CHANGED}
VOLATILE_PATTERNS = {
    "timestamp": re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"),
    "time": re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\b"),
    "uuid": re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    "unix_time": re.compile(r"\b1\d{9}(?:\d{3})?(?:\.\d+)?\b"),
    "hex_id": re.compile(r"\b[0-9a-f]{24,}\b"),
}
_SEGMENT_CAUSE = {SegmentKind.VOLATILE: Cause.VOLATILE_FIELD, SegmentKind.SYSTEM: Cause.SYSTEM_PROMPT_CHANGED,
                  SegmentKind.TOOLS: Cause.TOOLS_CHANGED, SegmentKind.SUMMARY: Cause.COMPACTION}
_TRANSITION_CAUSE = {Transition.COMPACTION: Cause.COMPACTION, Transition.EDIT: Cause.MESSAGE_EDITED,
                     Transition.RESET: Cause.HISTORY_TRUNCATED}


@dataclass(slots=True)
class RequestView:
    """What the attribution needs of one request."""

    request_id: int
    session_id: str
    step: int
    parent: int
    prompt: np.ndarray  # int32
    output: np.ndarray | None
    messages: list[dict] | None = None
    tools_key: str | None = None
    ends: list[int] | None = None  # token position where each message ends
    seg_spans: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, start, end)
    transition: str = ""
    arrival_s: float = 0.0

    @property
    def had_tokens(self) -> np.ndarray:
        return self.prompt if self.output is None else np.concatenate([self.prompt, self.output])

    def message_keys(self) -> list[str]:
        return [_message_key(m) for m in self.messages or ()]

    def span(self, m: int) -> tuple[int, int]:
        assert self.ends is not None
        return (self.ends[m - 1] if m else 0), self.ends[m]


@dataclass(slots=True)
class Attribution:
    request_id: int
    session_id: str
    step: int
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    cause: Cause | None
    where: str
    predecessor: int | None = None
    diverge_token: int | None = None
    predicted_cached_tokens: int = 0  # infinite-cache simulation
    evicted_tokens: int = 0
    provider_cached_tokens: int | None = None  # observed provider usage, where the trace has it
    provider_predicted_cached_tokens: int | None = None  # the provider cache model's prediction
    # The provider's own prompt size for this call (imported transcripts: its tokenizer, with the system prompt
    # and tools the log does not hold), so observed and predicted reads compare as shares of their prompts.
    provider_prompt_tokens: int | None = None
    #: What an unbounded cache would have served from the tokens the server held, in this run's send / finish
    #: order: the blocks cached earlier in this run (eviction is only ever claimed below this).
    reachable_cached_tokens: int = 0
    substituted_tokens: int = 0  # lost to a recorded replay's planned answers (``replay_substituted_output``)


@dataclass(slots=True)
class CauseTotal:
    cause: Cause
    recomputed_tokens: int
    share: float
    what_if_hit_rate: float  # an infinite cache (the observed evictions carried over)
    #: The same what-if at the run's KV pool (``num_gpu_blocks``), each request looked up when the run sent it
    #: and cached when it finished (the observed run's order, as the replay's own prediction does; one at a time
    #: without records); None where the pool size is not known. An infinite cache alone overstates what
    #: removing a cause buys on a small pool that evicts.
    what_if_hit_rate_pool: float | None = None


@dataclass
class Explanation:
    requests: list[Attribution]
    causes: list[CauseTotal]
    block_size: int
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    provider_preset: str | None = None
    #: Routed runs: the policy's summary and what the other stickiness would change (`analysis.explain_routing`).
    routing: dict[str, Any] | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        keys = ("request_id", "session_id", "step", "prompt_tokens", "cached_tokens", "recomputed_tokens", "cause",
                "where")
        out = {"requests": [{k: getattr(a, k) for k in keys} for a in self.requests],
               "causes": [asdict(c) for c in self.causes]}
        if self.routing is not None:
            out["routing"] = self.routing
        return out


@dataclass(slots=True)
class _Break:
    cause: Cause
    where: str
    had: int
    patch: tuple[int, np.ndarray, np.ndarray] | None  # (start, old tokens, new tokens)


# ------------------------------------------------------------------------------------------ helpers


def _message_key(m: Any) -> str:
    if not isinstance(m, dict):
        return json.dumps(m, sort_keys=True)
    return json.dumps({k: m.get(k) for k in ("role", "content", "tool_calls", "name", "tool_call_id")},
                      sort_keys=True)


def _content_text(m: dict) -> str:
    c = m.get("content")
    text = c if isinstance(c, str) else json.dumps(c) if c is not None else ""
    if m.get("tool_calls"):
        text += json.dumps(m["tool_calls"])
    return text


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    return common_prefix_len(a, b)


def volatile_at(old: str, new: str, c: int) -> str | None:
    """The kind of volatile value (a regex of VOLATILE_PATTERNS) covering character ``c`` of either text."""
    for text in (old, new):
        lo = max(0, c - 64)
        window = text[lo:c + 64]
        for name, pat in VOLATILE_PATTERNS.items():
            for m in pat.finditer(window):
                if m.start() + lo <= c <= m.end() + lo and (c < m.end() + lo or c == len(text)):
                    return name
    return None


def _block_floor(n: int, block_size: int) -> int:
    return (max(n, 0) // block_size) * block_size


# ------------------------------------------------------------------------------------------ predecessor


class PredecessorIndex:
    """Earlier requests by their chained full-block hashes; the latest holder of each chain prefix.

    One compact :class:`ChainIndex` serves both the infinite-cache simulation and this search (5,000 generated
    sessions: ~47 M distinct chains): a chain maps to the latest request whose *prompt* holds it, or -1 where
    only an earlier request's output blocks made it (cached, but nobody's prompt)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.chains = ChainIndex()

    def cached_blocks(self, hashes: np.ndarray) -> int:
        """The leading run of ``hashes`` (prompt and output blocks) any earlier request left cached."""
        return self.chains.leading_run(hashes)[0]

    def best(self, req: RequestView, views: Sequence[RequestView], hashes: np.ndarray
             ) -> tuple[int | None, int]:
        cands: list[int] = []
        _, hit = self.chains.leading_run(hashes, min_value=0)
        if hit is not None:
            cands.append(hit)
        if req.parent >= 0:
            cands.append(req.parent)
        if req.request_id > 0:
            cands.append(req.request_id - 1)
        best, best_k = None, -1
        for c in dict.fromkeys(cands):  # order: block index, session parent, previous request
            k = _lcp(req.prompt, views[c].had_tokens)
            if k > best_k or (k == best_k and c == req.parent):
                best, best_k = c, k
        return best, max(best_k, 0)

    def add(self, request_id: int, hashes: np.ndarray, prompt_blocks: int, cached_blocks: int) -> None:
        """The request's prompt blocks are now held by it, its output blocks cached (``cached_blocks``: what
        :meth:`cached_blocks` said before)."""
        self.chains.put(hashes[:prompt_blocks], request_id, min(cached_blocks, prompt_blocks))
        self.chains.put(hashes[prompt_blocks:], -1, max(0, cached_blocks - prompt_blocks), overwrite=False)


# ------------------------------------------------------------------------------------------ classification


def _classify_segments(r: RequestView, p: RequestView, k: int) -> _Break:
    """Traces without message structure: the kind of the segment holding token k, else the transition."""
    i = next((j for j, (_, s, e) in enumerate(r.seg_spans) if s <= k < e), len(r.seg_spans) - 1)
    if 0 < i <= len(p.seg_spans) and k == r.seg_spans[i][1] and _segment_differs(r, p, i - 1):
        # The divergence sits on a segment's first token because the segment before it changed and now ends
        # there: a tool output cut to a prefix of itself (the compaction habit's truncation) matches the old
        # one up to its new end. The edit is that segment's, and so is the patch that undoes it; the segment
        # at k is the same in both (patched back to itself, the what-if would credit nothing).
        i -= 1
    kind = r.seg_spans[i][0] if r.seg_spans else ""
    cause = _SEGMENT_CAUSE.get(kind) or _TRANSITION_CAUSE.get(r.transition) or Cause.PREFIX_CHANGED
    patch = None
    had = k
    if r.seg_spans and i < len(p.seg_spans):
        (_, s, e), (_, ps, pe) = r.seg_spans[i], p.seg_spans[i]
        patch = (s, r.prompt[s:e].copy(), p.prompt[ps:pe].copy())
        if cause in _IN_PLACE:
            if cause != Cause.PREFIX_CHANGED:  # a value changed in place: the rest of its segment was there before
                had += max(0, min(e, s + pe - ps) - k)
            # later tokens count only where the predecessor had them too (an unrelated prompt shares none)
            had += _lcp(r.prompt[e:], p.had_tokens[pe:])
    return _Break(cause, f"segment {i} ({kind}) at token {k}", had, patch)


def _segment_differs(r: RequestView, p: RequestView, i: int) -> bool:
    """Whether segment ``i`` of ``r`` holds other tokens than segment ``i`` of ``p``."""
    (_, s, e), (_, ps, pe) = r.seg_spans[i], p.seg_spans[i]
    return e - s != pe - ps or not np.array_equal(r.prompt[s:e], p.prompt[ps:pe])


def _structural(r: RequestView, p: RequestView, d: int, rk: list[str], pk: list[str]) -> Cause:
    old, new = _content_text(p.messages[d]), _content_text(r.messages[d])  # type: ignore[index]
    c = common_prefix_len(old, new)
    if volatile_at(old, new, c):
        return Cause.VOLATILE_FIELD
    role = (r.messages[d] or {}).get("role")  # type: ignore[index]
    if d == 0 and role in ("system", "developer"):
        return Cause.SYSTEM_PROMPT_CHANGED
    if rk[d] in pk[d + 1:]:
        return Cause.HISTORY_TRUNCATED  # messages between were dropped
    if role == (p.messages[d] or {}).get("role") and len(new) < 0.8 * len(old) and c >= len(new) - 64:  # type: ignore[index]
        return Cause.HISTORY_TRUNCATED  # the message was cut short
    if len(rk) >= len(pk) and rk[d + 1:len(pk)] == pk[d + 1:]:
        return Cause.MESSAGE_EDITED
    if (len(r.prompt) < len(p.prompt) or len(rk) < len(pk)) and rk[d] not in pk:
        return Cause.COMPACTION
    return Cause.MESSAGE_EDITED


def _classify_messages(r: RequestView, p: RequestView, k: int) -> _Break | None:
    rk, pk = r.message_keys(), p.message_keys()
    n = min(len(rk), len(pk))
    d = next((i for i in range(n) if rk[i] != pk[i]), n)
    have_ends = r.ends is not None and p.ends is not None
    m = bisect.bisect_right(r.ends, k) if have_ends else d  # type: ignore[arg-type]
    if have_ends and p.ends and k >= p.ends[-1]:
        return None  # only the predecessor's generation prompt differs: an append
    if m < n and rk[m] == pk[m] and r.tools_key != p.tools_key or (d >= n and r.tools_key != p.tools_key):
        cause, d = Cause.TOOLS_CHANGED, min(m, n - 1) if n else 0
    elif d >= len(rk):
        cause = Cause.HISTORY_TRUNCATED
    elif d >= len(pk):
        return None
    else:
        cause = _structural(r, p, d, rk, pk)
    role = (r.messages[d] or {}).get("role", "?") if r.messages and d < len(r.messages) else "?"
    where = (f"tools (the diverging span is message {d}) at token {k}" if cause == Cause.TOOLS_CHANGED
             else f"message {d} ({role}) at token {k}")
    if not have_ends:
        return _Break(cause, where, min(len(p.prompt), len(r.prompt)) if cause in _IN_PLACE else k, None)
    return _with_spans(r, p, k, d if cause != Cause.TOOLS_CHANGED else m, cause, where, rk, pk)


def _with_spans(r: RequestView, p: RequestView, k: int, m: int, cause: Cause, where: str, rk: list[str],
                pk: list[str]) -> _Break:
    """Tokens the predecessor had and the what-if patch, from message spans."""
    assert r.ends is not None and p.ends is not None
    m = min(m, len(rk) - 1)
    later = set(pk[m:])
    credit = 0
    if cause in _IN_PLACE and m < len(pk):
        credit += max(0, min(r.ends[m], p.ends[m] - p.span(m)[0] + r.span(m)[0]) - k)
    for j in range(m + 1, len(rk)):
        if rk[j] in later:
            s, e = r.span(j)
            credit += e - s
    rs, re_ = r.span(m)
    if cause in _IN_PLACE:
        ps, pe = p.span(m) if m < len(pk) else (len(p.prompt), len(p.prompt))
        patch = (rs, r.prompt[rs:re_].copy(), p.prompt[ps:pe].copy())
    else:
        q = m + 1
        while q < len(rk) and rk[q] in later:
            q += 1
        end = r.ends[q - 1]
        ps = p.span(m)[0] if m < len(pk) else p.ends[-1]
        patch = (rs, r.prompt[rs:end].copy(), p.prompt[ps:p.ends[-1]].copy())
    return _Break(cause, where, k + credit, patch)


def classify(r: RequestView, p: RequestView, k: int) -> _Break | None:
    """Why ``r`` diverges from its predecessor ``p`` at token ``k`` (None: it does not, it appends)."""
    if k >= len(p.had_tokens) or k >= len(r.prompt):
        return None
    if r.messages is not None and p.messages is not None and not _generated(r):
        return _classify_messages(r, p, k)
    return _classify_segments(r, p, k)


def _generated(r: RequestView) -> bool:
    return bool(r.messages) and isinstance(r.messages[0], dict) and "n_tokens" in r.messages[0]


# ------------------------------------------------------------------------------------------ simulation


def _hashes(prompt: np.ndarray, output: np.ndarray | None, B: int, hasher: IncrementalHasher, key: object
            ) -> np.ndarray:
    """The chained hashes of every full block the finished request leaves cached: its prompt's, then its known
    output's up to the last token that was fed back (``(P+O-1)//B``), as :func:`requests_from_token_pairs`."""
    P = len(prompt)
    if output is not None and len(output):
        return chain_hashes(np.concatenate([prompt, output]), B, (P + len(output) - 1) // B, hasher, key)
    return chain_hashes(prompt, B, P // B, hasher, key)


def _simulate(prompts: Iterable[np.ndarray], outputs: Iterable[np.ndarray | None], sessions: Iterable[str],
              block_size: int) -> list[int]:
    """Infinite-cache cached tokens per request, streamed (no request is kept once simulated)."""
    cache = InfiniteCacheStream(block_size)
    hasher = IncrementalHasher(block_size, max_sessions=1024)
    return [cache.request(_hashes(p, o, block_size, hasher, s), len(p))
            for p, o, s in zip(prompts, outputs, sessions)]


def _simulate_events(prompts: Iterable[np.ndarray], outputs: Iterable[np.ndarray | None], block_size: int,
                     num_gpu_blocks: int, order: Sequence[tuple[int, int]] | None) -> list[int]:
    """Cached tokens per request at a pool of ``num_gpu_blocks``, with each request looked up at its send and
    cached at its finish in ``order`` (events ``(0, rid)`` send, ``(1, rid)`` finish, in the run's time order;
    `harness.replay.predict`'s online rule). Requests the order leaves out run one at a time after it."""
    if order is None:
        return predict_cached_tokens(zip(prompts, outputs), block_size, num_gpu_blocks)
    reqs = requests_from_token_pairs(zip(prompts, outputs), block_size)
    replica = Replica(SimConfig(block_size, num_gpu_blocks))
    hits = [0] * len(reqs)
    seen: set[int] = set()
    for kind, rid in order:
        if not 0 <= rid < len(reqs):
            continue
        if kind == 0:
            hits[rid] = replica.probe(reqs[rid]) * block_size
            seen.add(rid)
        elif rid in seen:
            replica.run_sequential(reqs[rid])
    for rid, req in enumerate(reqs):
        if rid not in seen:
            hits[rid] = replica.probe(req) * block_size
            replica.run_sequential(req)
    return hits


def generated_outputs(records: Any, num_requests: int) -> list[np.ndarray | None] | None:
    """The tokens the server generated per trace request (successful attempts; None where a request has none),
    or None where the records do not carry them. The pool what-if caches these at a request's finish, as the
    server did: a planned answer the server did not generate takes no block."""
    if records is None or "output_token_ids" not in records.columns:
        return None
    out: list[np.ndarray | None] = [None] * num_requests
    ok = records[records["error_class"].isna()] if "error_class" in records else records
    for rid, ids in zip(ok["request_id"], ok["output_token_ids"]):
        if 0 <= int(rid) < num_requests and ids is not None and len(ids):
            out[int(rid)] = np.asarray(ids, dtype=np.int32)
    return out if any(o is not None for o in out) else None


def event_order(records: Any) -> list[tuple[int, int]] | None:
    """A replay run's send and finish events ``(0|1, request_id)`` in time order (successful attempts), or None
    where its records carry no send / finish times."""
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

    if records is None or not {"sent_s", "done_s", "request_id"} <= set(records.columns):
        return None
    cols = ["request_id", "sent_s", "done_s"]
    ok = records.loc[records["error_class"].isna(), cols] if "error_class" in records else records[cols]
    ok = ok.dropna(subset=["sent_s", "done_s"])
    if not len(ok):
        return None
    ev = pd.concat([pd.DataFrame({"t": ok["sent_s"], "k": 0, "rid": ok["request_id"]}),
                    pd.DataFrame({"t": ok["done_s"], "k": 1, "rid": ok["request_id"]})])
    ev = ev.sort_values(["t", "k"], kind="stable")
    return list(zip(ev["k"].astype(int), ev["rid"].astype(int)))


def _prompts(views: Sequence[RequestView]) -> Iterator[np.ndarray]:
    """Every request's prompt in order; a :class:`TraceViews` yields them from the trace without keeping them."""
    return views.prompts() if isinstance(views, TraceViews) else (v.prompt for v in views)


def _prompt(views: Sequence[RequestView], rid: int) -> np.ndarray:
    """One request's prompt (a :class:`TraceViews` reads it from the trace without building the view)."""
    return views.prompt(rid) if isinstance(views, TraceViews) else views[rid].prompt


def _outputs(views: Sequence[RequestView]) -> Iterator[np.ndarray | None]:
    return views.outputs() if isinstance(views, TraceViews) else (v.output for v in views)


def _sessions(views: Sequence[RequestView]) -> Iterator[str]:
    return iter(views._session) if isinstance(views, TraceViews) else (v.session_id for v in views)


def _arrivals(views: Sequence[RequestView]) -> list[float]:
    return list(views._arrival) if isinstance(views, TraceViews) else [v.arrival_s for v in views]


class _PatchList(Sequence[tuple[int, tuple[int, np.ndarray, np.ndarray]]]):
    """One cause's what-if patches ``(owner, (start, old tokens, new tokens))`` in request order, packed into
    flat arrays: a 5,000-session trace where every request breaks the cache holds a patch per request (232 k),
    and two small numpy arrays and two tuples apiece took ~0.1 GB through the attribution pass, this ~10 MB.
    Items are rebuilt on access (views into the flat tokens)."""

    def __init__(self) -> None:
        self._fields = array("q")  # owner, start, old end, new end per patch
        self._old, self._new = array("i"), array("i")
        self._frozen: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def append(self, item: tuple[int, tuple[int, np.ndarray, np.ndarray]]) -> None:
        owner, (start, old, new) = item
        self._old.frombytes(np.ascontiguousarray(old, dtype=np.int32).tobytes())
        self._new.frombytes(np.ascontiguousarray(new, dtype=np.int32).tobytes())
        self._fields.extend((owner, start, len(self._old), len(self._new)))
        self._frozen = None

    def __len__(self) -> int:
        return len(self._fields) // 4

    def __getitem__(self, j: int) -> tuple[int, tuple[int, np.ndarray, np.ndarray]]:  # type: ignore[override]
        if not -len(self) <= j < len(self):
            raise IndexError(j)
        j %= len(self)
        if self._frozen is None:
            self._frozen = (np.frombuffer(self._fields, np.int64).copy(), np.array(self._old, np.int32),
                            np.array(self._new, np.int32))
        fields, old, new = self._frozen
        owner, start, old_end, new_end = fields[4 * j:4 * j + 4].tolist()
        old_start = int(fields[4 * j - 2]) if j else 0
        new_start = int(fields[4 * j - 1]) if j else 0
        return owner, (start, old[old_start:old_end], new[new_start:new_end])


class _PatchIndex:
    """The patches of one cause by (start, length) and then by their old tokens, so a request finds the newest
    earlier patch whose span it still carries by one lookup per distinct (start, length), not by testing every
    earlier patch (that was quadratic in the trace: 405 s for 300 generated sessions).

    A chain of patches (a timestamp patched back to the previous one, and that one to the one before, up to
    the session's first) costs one step per earlier request, so a session's what-if is quadratic in its
    length.  Where every patch keeps its span's length (timestamps, ids, any same-length edit), a step reads
    and writes only the first ``reach`` tokens (the furthest span end), so the chain after a patch is a
    function of that patch and those tokens alone: it is memoised (bounded), and each request's chain joins
    the one its predecessor already followed (without the memo a 300-session what-if spent most of its time
    stepping chains; the what-if pass's share of a 5,000-session run: ``benchmarks/explain_scale.py``)."""

    def __init__(self, patches: Sequence[tuple[int, tuple[int, np.ndarray, np.ndarray]]],
                 memo_bytes: int = 64 << 20) -> None:
        self.owners = [owner for owner, _ in patches]
        self.new = [new.astype(np.int32, copy=False) for _, (_, _, new) in patches]
        self.spans = [(s, len(old)) for _, (s, old, _) in patches]
        self.by_span: dict[tuple[int, int], dict[bytes, list[int]]] = {}
        for j, (_, (s, old, _)) in enumerate(patches):
            self.by_span.setdefault((s, len(old)), {}).setdefault(old.astype(np.int32).tobytes(), []).append(j)
        self.keys = sorted(self.by_span)
        self.same_length = all(n == len(new) for (_, n), new in zip(self.spans, self.new))
        self.reach = max((s + n for s, n in self.keys), default=0)
        self.memo: OrderedDict[tuple[int, bytes], np.ndarray] = OrderedDict()  # O(1) oldest-first eviction
        self.memo_limit = max(1024, memo_bytes // (8 * self.reach + 400))

    def _newest(self, ids32: np.ndarray, cursor: int) -> int:
        """The newest patch before ``cursor`` whose span ``ids32`` carries (-1: none)."""
        best = -1
        for key in self.keys:
            s, n = key
            if s + n > len(ids32):
                continue
            held = self.by_span[key].get(ids32[s:s + n].tobytes())
            if held:
                j = bisect.bisect_left(held, cursor) - 1
                if j >= 0 and held[j] > best:
                    best = held[j]
        return best

    def apply(self, request_id: int, ids: np.ndarray) -> np.ndarray:
        """``ids`` with every patch of its own or an earlier request applied where its span still matches,
        newest first (so a chain of timestamps patches back to the first one)."""
        cursor = bisect.bisect_right(self.owners, request_id)  # patches [0, cursor) are eligible
        if cursor == 0:
            return ids
        if not self.same_length:
            return self._apply_steps(ids, cursor)
        head = ids[:self.reach].astype(np.int32)  # a copy: only these tokens are read or written
        best = self._newest(head, cursor)
        if best < 0:
            return ids
        trail: list[tuple[int, bytes]] = []
        while best >= 0:
            s, n = self.spans[best]
            head[s:s + n] = self.new[best]
            state = (best, head.tobytes())
            done = self.memo.get(state)
            if done is not None:
                head = done
                break
            trail.append(state)
            best = self._newest(head, best)
        for state in trail:
            if len(self.memo) >= self.memo_limit:
                self.memo.popitem(last=False)  # the oldest (``del d[next(iter(d))]`` is O(n) after deletions)
            self.memo[state] = head
        return np.concatenate([head, ids[self.reach:]]).astype(np.int32)

    def _apply_steps(self, ids: np.ndarray, cursor: int) -> np.ndarray:
        while cursor > 0:
            best = self._newest(ids.astype(np.int32, copy=False), cursor)
            if best < 0:
                break
            s, n = self.spans[best]
            ids = np.concatenate([ids[:s], self.new[best], ids[s + n:]]).astype(np.int32)
            cursor = best
        return ids


def _apply_patches(views: Sequence[RequestView],
                   patches: Sequence[tuple[int, tuple[int, np.ndarray, np.ndarray]]]) -> Iterator[np.ndarray]:
    """Each request with every patch of its own or an earlier request applied where its span still matches,
    newest first, in request order. Patches come in request order."""
    index = _PatchIndex(patches)
    return (index.apply(rid, prompt) for rid, prompt in enumerate(_prompts(views)))


# ------------------------------------------------------------------------------------------ progress

#: Seconds between two progress lines when stderr is not a terminal (a log, a pipe, CI).
PROGRESS_LINE_INTERVAL_S = 30.0


class _Lines:
    """A file for tqdm that turns its carriage-return redraws into whole lines on stderr: in a log file or a
    pipe, ``\r`` redraws are one endless line that no one sees until the run ends."""

    def write(self, text: str) -> None:

        line = text.replace("\r", "").strip()
        if line:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def flush(self) -> None:
        pass


def progress_bar(items: Iterable | None, *, total: int, desc: str, unit: str, enabled: bool) -> Any:
    """tqdm on stderr: redrawn in place on a terminal, a whole line every ``PROGRESS_LINE_INTERVAL_S`` (with
    the rate and time left) elsewhere; silent unless ``enabled``."""

    from tqdm import tqdm  # deferred: tqdm is heavy, only a progress bar needs it

    tty = sys.stderr.isatty()
    return tqdm(items, total=total, desc=desc, unit=unit, disable=not enabled, leave=False,
                file=None if tty else _Lines(), mininterval=0.1 if tty else PROGRESS_LINE_INTERVAL_S,
                ascii=None if tty else True)


# ------------------------------------------------------------------------------------------ main entry


def explain(views: Sequence[RequestView], block_size: int, observed: Sequence[int | None] | None = None,
            provider_observed: Sequence[int | None] | None = None, provider_preset: str | None = None,
            provider_prompt: Sequence[int | None] | None = None, progress: bool = False,
            num_gpu_blocks: int | None = None, order: Sequence[tuple[int, int]] | None = None,
            generated: Sequence[np.ndarray | None] | None = None, recorded_mode: bool = False,
            model_switch: Sequence[tuple[int, str]] | None = None) -> Explanation:
    """Attribute every request's recomputed tokens to a cause (see the module doc). ``observed`` are the
    server's cached tokens per request (None: the infinite-cache simulation stands in). ``order`` is the run's
    send / finish order (:func:`event_order`): eviction is then claimed only for blocks an unbounded cache in
    that order would have served, i.e. blocks cached earlier in this run and then lost. ``generated`` is what
    the server generated (:func:`generated_outputs`); ``recorded_mode``: the views' outputs are the trace's
    planned answers, which the replay sent in place of ``generated`` (the shortfall they cause is
    ``replay_substituted_output``, and the what-ifs cache ``generated``, never the planned answers).
    ``num_gpu_blocks`` (the run's KV pool, where known) adds each what-if at that pool size, in ``order``.
    ``model_switch`` (routed runs, :mod:`~kvscope.harness.analysis.explain_routing`): per request, the tokens
    its session's previous model held but its own did not, and where; that much of the ``evicted`` shortfall is
    ``model_switch``. ``progress``: a progress bar on stderr per pass over the trace (:func:`progress_bar`)."""
    B = block_size
    n = len(views)
    reach_seq, reach_run = _reach(views, B, observed is not None, order, generated, recorded_mode)
    # One pass: the infinite-cache simulation of each request (its hit needs only earlier requests) and its
    # attribution share the request's hashes; nothing of a request is kept once it is attributed but its row.
    hasher = IncrementalHasher(B, max_sessions=1024)
    index = PredecessorIndex(B)
    base: list[int] = []
    obs: list[int] = []
    rows: list[Attribution] = []
    patches: dict[str, _PatchList] = {}
    split: dict[str, int] = {}
    for v in progress_bar(views, total=n, desc="explain: attribute", unit="req", enabled=progress):
        rid = v.request_id
        P = len(v.prompt)
        all_hashes = _hashes(v.prompt, v.output, B, hasher, v.session_id)
        in_cache = index.cached_blocks(all_hashes)  # the infinite-cache simulation, as InfiniteCacheStream
        b = min(in_cache, (P - 1) // B if P else 0) * B
        base.append(b)
        seen = None if observed is None else observed[rid]
        o = b if seen is None else int(seen)
        obs.append(o)
        hashes = all_hashes[:P // B]
        pred, k = index.best(v, views, hashes) if rid > 0 else (None, 0)
        cap = ((P - 1) // B) * B if P else 0
        brk = classify(v, views[pred], k) if pred is not None else None
        had = 0 if pred is None else (brk.had if brk is not None else min(len(views[pred].had_tokens), P))
        expected = min(_block_floor(had, B), cap)
        # What the server could have served: in any cache, from the tokens it really held (rs), and from blocks
        # cached before this request was sent in this run (rr). Each shortfall has its own cause.
        rs = b if reach_seq is None else min(reach_seq[rid], b)
        rr = rs if reach_run is None else min(reach_run[rid], rs)
        evicted = max(0, min(rr, expected) - o)
        switched, switch_where = model_switch[rid] if model_switch is not None else (0, "")
        switched = min(evicted, switched)
        shares = {  # ties go to the first: a switch before eviction (the other model held it, not this one)
            Cause.REPLAY_SUBSTITUTED_OUTPUT: max(0, min(b, expected) - max(rs, o)),
            Cause.NOT_YET_CACHED: max(0, min(rs, expected) - max(rr, o)),
            Cause.MODEL_SWITCH: switched,
            Cause.EVICTED: evicted - switched,
        }
        diverged = max(0, expected - max(b, o)) if brk is not None else 0
        cause, where = None, ""
        top = max(shares, key=shares.__getitem__)  # ties: the order above
        if diverged and diverged >= shares[top] and brk is not None:
            cause, where = brk.cause, brk.where
        elif shares[top]:
            where = switch_where if top == Cause.MODEL_SWITCH else _share_where(top, o, b, rs, rr, pred)
            cause = top
        if diverged and brk is not None:
            split[brk.cause] = split.get(brk.cause, 0) + diverged
            if brk.patch is not None:
                patches.setdefault(brk.cause, _PatchList()).append((rid, brk.patch))
        for c, tokens in shares.items():
            if tokens:
                split[c] = split.get(c, 0) + tokens
        rows.append(Attribution(rid, v.session_id, v.step, P, o, diverged + sum(shares.values()), cause,
                                where, pred, k if pred is not None else None, b, shares[Cause.EVICTED],
                                reachable_cached_tokens=rr,
                                substituted_tokens=shares[Cause.REPLAY_SUBSTITUTED_OUTPUT]))
        index.add(rid, all_hashes, P // B, in_cache)
    del index, hasher  # one entry per distinct block chain: free them before the what-if simulations
    causes = _totals(views, B, split, patches, obs, sum(r.prompt_tokens for r in rows), progress,
                     num_gpu_blocks, order, generated, recorded_mode)
    preset = provider_preset or "openai-gpt-4.1"
    if provider_observed is not None:
        _provider_columns(views, rows, provider_observed, preset, provider_prompt)
    return Explanation(rows, causes, B, sum(r.prompt_tokens for r in rows), sum(obs),
                       sum(r.recomputed_tokens for r in rows), preset if provider_observed is not None else None)


def _share_where(cause: Cause, observed: int, planned: int, reach: int, reach_run: int, pred: int | None) -> str:
    if cause == Cause.REPLAY_SUBSTITUTED_OUTPUT:
        return (f"request {pred}'s answer: the replay sent the trace's, the server had cached its own "
                f"(cached {observed}, {planned} with the planned answers)")
    if cause == Cause.NOT_YET_CACHED:
        return f"cached {observed} of {reach}: the rest was still being computed by a concurrent request"
    return f"cached {observed} of {reach_run} cached earlier in this run"


def _served_outputs(views: Sequence[RequestView], generated: Sequence[np.ndarray | None] | None,
                    recorded_mode: bool) -> Iterator[np.ndarray | None]:
    """What each request left in the server's cache beyond its prompt: a recorded-mode replay's server cached
    what it generated (None where unknown: its prompt blocks alone then, as nothing of an answer the replay
    never sent again can match); otherwise the views' outputs (a live replay's are the generated ones)."""
    if not recorded_mode:
        return _outputs(views)
    return iter(generated) if generated is not None else iter([None] * len(views))


def _reach(views: Sequence[RequestView], B: int, observed: bool, order: Sequence[tuple[int, int]] | None,
           generated: Sequence[np.ndarray | None] | None, recorded_mode: bool
           ) -> tuple[list[int] | None, list[int] | None]:
    """Per request, what an unbounded cache could have served from the tokens the server really held, in
    request order (None: the views' own simulation, where outputs were not substituted) and in the run's
    send / finish order (None: no order known). Only with observed cached tokens: a simulation has no run."""
    if not observed:
        return None, None
    seq = _simulate(_prompts(views), _served_outputs(views, generated, recorded_mode), _sessions(views), B) \
        if recorded_mode else None
    run = _simulate_events(_prompts(views), _served_outputs(views, generated, recorded_mode), B, None, order) \
        if order is not None else None
    return seq, run


def _counted(items: Iterator[np.ndarray], bar: Any, lengths: list[int] | None = None) -> Iterator[np.ndarray]:
    """``items``, ticking ``bar`` and noting each length in ``lengths``."""
    for x in items:
        if lengths is not None:
            lengths.append(len(x))
        bar.update(1)
        yield x


def _totals(views: Sequence[RequestView], B: int, split: dict[str, int],
            patches: dict[str, _PatchList], obs: list[int], prompt_tokens: int, progress: bool = False,
            num_gpu_blocks: int | None = None, order: Sequence[tuple[int, int]] | None = None,
            generated: Sequence[np.ndarray | None] | None = None, recorded_mode: bool = False) -> list[CauseTotal]:
    """Each cause's tokens, share and what-if. A cause that is a shortfall of this run (eviction, a prefix not
    cached yet, a substituted answer) is put back as it was lost; a cause of the history is patched away and
    the trace simulated again on what the server could cache (a recorded replay's generated answers, never
    its planned ones: no what-if credits reuse the replay cannot get), with this run's eviction and
    concurrency losses carried over."""
    total = sum(split.values())
    lost = split.get(Cause.EVICTED, 0) + split.get(Cause.NOT_YET_CACHED, 0)
    out = []
    for cause, n in sorted(split.items(), key=lambda kv: -kv[1]):
        pool_rate = None
        if cause in _RUN_SHORTFALLS or cause == Cause.MODEL_SWITCH:  # switch: history kept where it moved
            rate = (sum(obs) + n) / max(1, prompt_tokens)
        else:
            lengths: list[int] = []
            bar = progress_bar(None, total=len(views), desc=f"explain: what-if {cause}", unit="req",
                               enabled=progress)
            cached = _simulate(_counted(_apply_patches(views, patches.get(cause, [])), bar, lengths),
                               _served_outputs(views, generated, recorded_mode), _sessions(views), B)
            bar.close()
            rate = (sum(cached) - lost) / max(1, sum(lengths))
            if num_gpu_blocks:
                outputs = _outputs(views) if generated is None else \
                    (g if g is not None else o for g, o in zip(generated, _outputs(views)))
                pool = _simulate_events(_apply_patches(views, patches.get(cause, [])), outputs, B,
                                        num_gpu_blocks, order)
                pool_rate = round(sum(pool) / max(1, sum(lengths)), 6)
        out.append(CauseTotal(cause, n, n / total if total else 0.0, round(rate, 6), pool_rate))
    return out


#: Causes that are a shortfall of the run against what its server could have served, not a change of the
#: history: their what-if puts the lost tokens back rather than patching the trace.
_RUN_SHORTFALLS = {Cause.EVICTED, Cause.NOT_YET_CACHED, Cause.REPLAY_SUBSTITUTED_OUTPUT}


def _provider_columns(views: Sequence[RequestView], rows: list[Attribution], provider_observed: Sequence[int | None],
                      preset: str, provider_prompt: Sequence[int | None] | None = None) -> None:
    cfg = load_preset(preset)
    unit = 16
    arrivals = _arrivals(views)
    order = sorted(range(len(rows)), key=arrivals.__getitem__)  # arrival order, ties in request order
    # one request at a time: a hash list per request of the whole trace is ~40 bytes a block
    reqs = iter_requests_from_token_pairs(((_prompt(views, rid), None) for rid in order), unit)
    cache = ProviderCache(cfg)
    for rid, req in zip(order, reqs):
        row = rows[rid]
        req.arrival_s = arrivals[rid]
        row.provider_cached_tokens = provider_observed[row.request_id]
        row.provider_predicted_cached_tokens = cache.request(req).cache_read
        row.provider_prompt_tokens = provider_prompt[row.request_id] if provider_prompt is not None else None


# ------------------------------------------------------------------------------------------ loading


class TraceViews(Sequence[RequestView]):
    """The requests of a trace as :class:`RequestView` s, built on demand and kept for a window of recent
    requests only. A trace stores each distinct segment once; views of every request hold every prompt in full
    (a 5,000-session generated trace: 365 M tokens, several GB), so attribution reads them as it goes: a
    request's predecessor is almost always recent (its session parent, the previous request), and an older
    one is rebuilt from the trace."""

    def __init__(self, trace: Any, extras: Any = None, window: int = 256,
                 live_generated: dict[int, np.ndarray] | None = None) -> None:
        self.trace = trace
        #: A live replay's generated answers (request id -> token ids): each prompt is then the one the replay
        #: sent (its session's earlier answers as generated, :meth:`Trace.live_substitute`) and each output the
        #: one the server generated, so the attribution reads the tokens the server saw.
        self.live_generated = live_generated or {}
        df = trace.requests
        self._msgs = df["messages"].tolist()
        self._session = [str(x) for x in df["session_id"].tolist()]
        self._step = [int(x) for x in df["step"].tolist()]
        self._parent = [int(x) for x in df["parent_request_id"].tolist()]
        self._transition = [x or "" for x in df["transition"].tolist()]
        self._arrival = [float(x) for x in df["arrival_s"].tolist()]
        self._tools: dict[int, str] = {}
        if extras is not None:
            for rid, t in extras["tools_json"].items():
                if isinstance(t, str):
                    self._tools[int(rid)] = t
        self._window = window
        self._recent: dict[int, RequestView] = {}

    def __len__(self) -> int:
        return self.trace.num_requests

    def __getitem__(self, rid: int) -> RequestView:  # type: ignore[override]
        if not 0 <= rid < len(self):
            raise IndexError(rid)
        got = self._recent.pop(rid, None)
        if got is None:
            got = self._build(rid)
            if len(self._recent) >= self._window:
                del self._recent[next(iter(self._recent))]  # the least recently used
        self._recent[rid] = got
        return got

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def prompt(self, rid: int) -> np.ndarray:
        """One request's prompt as sent (int32), without building its view."""
        sub = self.trace.live_substitute(rid, self.live_generated) if self.live_generated else None
        return self.trace.prompt_token_ids(rid, sub).astype(np.int32)

    def output(self, rid: int) -> np.ndarray | None:
        """One request's answer: the server's in a live replay (where it answered), else the trace's."""
        got = self.live_generated.get(rid)
        return got if got is not None else self.trace.output_token_ids(rid)

    def prompts(self):
        """Each request's prompt tokens, in order, without keeping them."""
        return (self.prompt(i) for i in range(len(self)))

    def outputs(self):
        return (self.output(i) for i in range(len(self)))

    def _spans(self, rid: int) -> list[tuple[str, int, int]]:
        """``(kind, start, end)`` of each prompt segment (:meth:`Trace.segment_map`, vectorised: generated
        prompts hold hundreds of segments); a live replay's substituted answers at their generated length."""
        trace = self.trace
        ids = trace.prompt_segment_ids(rid)
        lengths = trace.seg_offsets[ids + 1] - trace.seg_offsets[ids]
        if self.live_generated:
            sub = trace.live_substitute(rid, self.live_generated)
            if sub:
                lengths = np.array([len(sub[int(i)]) if int(i) in sub else n for i, n in zip(ids, lengths)],
                                   dtype=np.int64)
        ends = np.cumsum(lengths)
        return list(zip(trace.seg_kinds[ids].tolist(), (ends - lengths).tolist(), ends.tolist()))

    def _build(self, rid: int) -> RequestView:
        raw = self._msgs[rid]
        messages = json.loads(raw) if raw else None
        spans = self._spans(rid)
        return RequestView(rid, self._session[rid], self._step[rid], self._parent[rid], self.prompt(rid),
                           self.output(rid), messages, self._tools.get(rid), _message_ends(messages, spans), spans,
                           self._transition[rid], self._arrival[rid])


def views_from_trace(trace, extras=None, live_generated: dict[int, np.ndarray] | None = None) -> TraceViews:
    """The trace's requests as :class:`RequestView` s (built on demand, see :class:`TraceViews`); ``extras``
    is ``read_exchanges(trace_dir)`` (tools); ``live_generated``: a live replay's answers (the prompts it sent)."""
    return TraceViews(trace, extras, live_generated=live_generated)


def _message_ends(messages: list[dict] | None, spans: list[tuple[str, int, int]]) -> list[int] | None:
    """Recorded traces: one segment per message plus the generation prompt. Generated text-mode traces:
    a template segment before each message and one after the last."""
    if not messages:
        return None
    if len(spans) == len(messages) + 1 and spans[-1][0] == SegmentKind.TEMPLATE and not _generated_messages(messages):
        return [e for _, _, e in spans[:-1]]
    starts = [s for kind, s, _ in spans if kind == SegmentKind.TEMPLATE]
    if len(starts) == len(messages) + 1:
        return starts[1:]
    return None


def _generated_messages(messages: list[dict]) -> bool:
    return bool(messages) and isinstance(messages[0], dict) and "n_tokens" in messages[0]


# ------------------------------------------------------------------------------------------ size estimate

#: The throughput `kvscope explain` states and `benchmarks/explain_speculate_scale.py` checks: prompt tokens
#: per second (hashing each block and looking its chain up is the work; a 5,000-session timestamped trace,
#: 776 M prompt tokens, took 253 s on the shared 2-core host: 3.1 M/s) and, as a floor for traces of short
#: prompts, requests per second.
EXPLAIN_PROMPT_TOKENS_PER_S = 2.0e6
EXPLAIN_REQUESTS_PER_S = 1000.0
#: Process start, imports and reading the trace, before the first request is explained.
EXPLAIN_STARTUP_S = 5.0
#: What a run holds at its peak (module docstring): the chain index's 12 bytes a distinct block chain (at most
#: one a prompt block), an attribution row a request, the trace's tokens (int32) and ids, and the interpreter
#: with its libraries.
_BYTES_PER_CHAIN = 12
_BYTES_PER_ROW = 400
_BASE_BYTES = 250 * 2**20
#: Share of the available memory an explain may plan to use.
EXPLAIN_MEMORY_SHARE = 0.8
#: Below this many estimated seconds no estimate is printed.
ESTIMATE_ABOVE_S = 15.0


@dataclass(frozen=True)
class ExplainEstimate:
    """What explaining a trace will take, from its size alone, before any work (a 142 k-request trace of 16 B
    prompt tokens ran > 7 minutes at 4.8 GB with no word of how long it would go on)."""

    requests: int
    prompt_tokens: int
    block_size: int
    seconds: float
    peak_bytes: int

    def line(self) -> str:
        return (f"explain: {self.requests:,} requests, {self.prompt_tokens / 1e6:,.1f} M prompt tokens: about "
                f"{_duration(self.seconds)} and {self.peak_bytes / 1e9:.1f} GB at the stated "
                f"{EXPLAIN_PROMPT_TOKENS_PER_S / 1e6:g} M tokens/s")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def explain_estimate(trace: Any, block_size: int) -> ExplainEstimate:
    """:class:`ExplainEstimate` of ``trace`` at ``block_size`` (an upper bound on memory: every prompt block
    counted as a distinct chain, as in a trace where every request breaks the cache)."""
    n = int(trace.num_requests)
    prompt = int(trace.requests["prompt_tokens"].sum()) if n else 0
    chains = prompt // max(1, block_size) + n
    peak = _BASE_BYTES + 2 * int(trace.seg_tokens.nbytes) + _BYTES_PER_CHAIN * chains + _BYTES_PER_ROW * n
    seconds = EXPLAIN_STARTUP_S + max(prompt / EXPLAIN_PROMPT_TOKENS_PER_S, n / EXPLAIN_REQUESTS_PER_S)
    return ExplainEstimate(n, prompt, block_size, seconds, peak)


def check_explain_fits(est: ExplainEstimate, available_bytes: int) -> None:
    """KvscopeError, one line naming --block-size (the knob that sizes the chain index), when the estimate
    exceeds the share of ``available_bytes`` an explain may use."""

    budget = int(available_bytes * EXPLAIN_MEMORY_SHARE)
    if est.peak_bytes <= budget:
        return
    larger = next((b for b in (32, 64, 128, 256, 512, 1024) if b > est.block_size and est.peak_bytes
                   - _BYTES_PER_CHAIN * (est.prompt_tokens // est.block_size - est.prompt_tokens // b) <= budget),
                  None)
    hint = f"--block-size {larger} fits" if larger else "no --block-size fits; explain a part of the trace"
    raise KvscopeError(f"explain: {est.requests:,} requests of {est.prompt_tokens / 1e6:,.0f} M prompt tokens need "
                       f"about {est.peak_bytes / 1e9:.1f} GB at --block-size {est.block_size} (12 bytes a block "
                       f"chain) and {available_bytes / 1e9:.1f} GB is available; {hint}")


def explain_path(path: str, block_size: int | None = None, provider_preset: str | None = None,
                 progress: bool = False, available_bytes: int | None = None, routing: Any = None,
                 labels: Any = None) -> Explanation:
    """``kvscope explain TRACE|RUN_DIR``: a trace (observed cache reads from its exchanges, if recorded) or a
    replay run directory (observed = the run's measured cached tokens, trace from its manifest). ``routing``
    (a model-routing spec) and ``labels``: see :func:`explain_trace`."""
    # deferred: it loads pandas, pyarrow, which importing this module must not
    from kvscope.harness.results.loaders import load_run_manifest

    p = Path(path)
    if (p / "manifest.json").is_file() and not (p / "trace.json").is_file():
        trace_dir = Path(load_run_manifest(p).trace.path)
        if not (trace_dir / "trace.json").is_file():
            raise KvscopeError(f"{p / 'manifest.json'}: trace.path {str(trace_dir)!r} is not a trace directory")
        return explain_trace(trace_dir, block_size, provider_preset, observed_records=read_records(p),
                             progress=progress, estimate=True, available_bytes=available_bytes, routing=routing,
                             labels=labels)
    if not (p / "trace.json").is_file():
        raise KvscopeError(f"{p}: neither a trace directory (trace.json) nor a run directory (manifest.json)")
    return explain_trace(p, block_size, provider_preset, progress=progress, estimate=True,
                         available_bytes=available_bytes, routing=routing, labels=labels)


def explain_trace(trace_dir: Any, block_size: int | None = None, provider_preset: str | None = None,
                  observed_records: Any = None, progress: bool = False,
                  num_gpu_blocks: int | None = None, estimate: bool = False,
                  available_bytes: int | None = None, routing: Any = None, labels: Any = None) -> Explanation:
    """Explain one trace directory. ``observed_records`` (a replay run's records frame) gives the server's
    cached tokens per request; without it a recorded trace's own cache reads (its exchanges) stand in, else the
    infinite-cache simulation. Provider usage the trace carries (recorded exchanges or an imported transcript's
    ``observed_*`` columns) is put beside the provider cache model's prediction either way. ``estimate``
    (the CLI): before any work, refuse a trace whose estimated peak exceeds the memory available
    (``available_bytes``, default this machine's) and print the time and memory estimate of a long one.
    ``routing``: a model-routing spec (dict or YAML/JSON path, ``kvscope route``'s) routes the trace's requests
    between models (decisions from a rule, the ``labels`` file's columns, or the run's records); each model's
    pool then stands in for the observed cache reads unless the run's are given, and the shortfall the
    session's previous model held is attributed to ``model_switch`` (:mod:`.explain_routing`)."""
    # deferred: it loads pandas, pyarrow, which importing this module must not
    from kvscope.workloads.trace import Trace

    trace = Trace.read(trace_dir)
    extras = read_exchanges(trace_dir)
    provider: list[int | None] | None = None
    provider_prompt: list[int | None] | None = None
    if extras is not None:
        col = extras["provider_cached_tokens"]
        if col.notna().any():
            provider = [nan_to_none(col.get(i), int) for i in range(trace.num_requests)]
    else:
        provider, provider_prompt = imported_provider_usage(trace.requests)
    if observed_records is not None:
        observed = observed_from_records(observed_records, trace.num_requests)
    else:
        observed = provider if extras is not None else None
    if observed_records is not None and extras is not None:
        provider = None  # a recorded trace's reads were the upstream server's, not a provider's: the run replaces them
    B = int(block_size or trace.meta.get("block_size_hint") or DEFAULT_BLOCK_SIZE)
    if estimate:
        est = explain_estimate(trace, B)
        if available_bytes is None:
            import psutil  # deferred: only the memory estimate needs psutil

            available_bytes = int(psutil.virtual_memory().available)
        check_explain_fits(est, available_bytes)
        if est.seconds >= ESTIMATE_ABOVE_S:

            print(est.line(), file=sys.stderr, flush=True)
    mode = replay_mode(observed_records)
    order = event_order(observed_records) if observed_records is not None else None
    generated = generated_outputs(observed_records, trace.num_requests) if observed_records is not None else None
    live = None
    if mode == "live" and generated is not None:  # the prompts it sent carried these answers
        live = {rid: g for rid, g in enumerate(generated) if g is not None}
    views = views_from_trace(trace, extras, live)
    if provider_preset is None:  # the provider whose usage the trace carries
        provider_preset = "anthropic-sonnet-5m" if trace.meta.get("observed_usage") == "anthropic" else None
    routed = None
    if routing is not None:
        from kvscope.harness.analysis.explain_routing import route_for_explain  # deferred: only routed runs

        routed = route_for_explain(trace_dir, routing, labels, observed_records)
        observed = observed if observed_records is not None else routed.cached_tokens
    ex = explain(views, B, observed, provider, provider_preset, provider_prompt, progress=progress,
                 num_gpu_blocks=num_gpu_blocks, order=order, generated=generated, recorded_mode=mode == "recorded",
                 model_switch=routed.model_switch if routed is not None else None)
    ex.routing = routed.summary if routed is not None else None
    return ex


@dataclass(frozen=True)
class RunEviction:
    """One replay run against an unbounded cache, request by request (trace request ids; -1 / 0 where the run
    has no successful record): ``cached_tokens`` the server reported, ``reachable_cached_tokens`` what an
    unbounded cache would have served from the tokens the server held (the prompts as sent, the answers it
    generated) in the run's own send / finish order, i.e. the blocks cached earlier in this run, and
    ``evicted_tokens`` the part of those the server did not serve: cached, then lost."""

    request_ids: np.ndarray
    cached_tokens: np.ndarray
    reachable_cached_tokens: np.ndarray
    evicted_tokens: np.ndarray


def run_eviction(trace: Any, records: Any, block_size: int) -> RunEviction:
    """:class:`RunEviction` of a replay run (its records) of ``trace``: the eviction a report may claim. A
    recorded-mode replay's planned answers, which the server never held, and a prefix a concurrent request was
    still computing are not eviction (``explain`` names them)."""
    n = trace.num_requests
    mode = replay_mode(records)
    generated = generated_outputs(records, n)
    live = {r: g for r, g in enumerate(generated) if g is not None} if mode == "live" and generated else None
    views = views_from_trace(trace, None, live)
    order = event_order(records)
    if order is not None:  # the run's order alone (request order would only ever add a prefix still running)
        reach = np.asarray(_simulate_events(_prompts(views), _served_outputs(views, generated, mode == "recorded"),
                                            block_size, None, order), np.int64)
    else:
        reach = np.asarray(_simulate(_prompts(views), _served_outputs(views, generated, mode == "recorded"),
                                     _sessions(views), block_size), np.int64)
    observed = observed_from_records(records, n)
    ids = np.array([i for i, o in enumerate(observed) if o is not None], np.int64)
    got = np.array([observed[i] for i in ids], np.int64)
    reach = reach[ids] if len(ids) else np.zeros(0, np.int64)
    return RunEviction(ids, got, reach, np.clip(reach - got, 0, None))


def replay_mode(records: Any) -> str | None:
    """``live`` or ``recorded``: how a replay run's records say its prompts were built (the records' ``mode``;
    None where they do not say, and their cached tokens are read against the trace as it is)."""
    if records is None or "mode" not in getattr(records, "columns", ()):
        return None
    modes = set(records["mode"].dropna().astype(str))
    return modes.pop() if len(modes) == 1 and modes <= {"live", "recorded"} else None


def observed_from_records(records: Any, num_requests: int) -> list[int | None]:
    """The server's cached tokens per trace request from a replay run's records (successful attempts; None
    where the run has none for a request, or the server did not report them)."""
    ok = records[records["error_class"].isna()] if "error_class" in records else records
    ok = ok[ok["cached_tokens"].notna()]
    got = dict(zip(ok["request_id"].astype(int).tolist(), ok["cached_tokens"].astype(int).tolist()))
    return [got.get(i) for i in range(num_requests)]


@dataclass(slots=True)
class ProviderAgreement:
    """Observed provider cache reads against the provider cache model, over the requests that have both."""

    preset: str
    requests: int  # requests with an observed read
    exact: int  # requests where observed == predicted tokens
    mean_abs_share_gap_pp: float | None  # mean |observed share - model share| in percentage points
    shares_compared: int  # requests where both shares exist (imported transcripts: the provider's own prompt size)


def provider_comparison(ex: Explanation) -> tuple[list[dict[str, Any]], ProviderAgreement | None]:
    """Per request: observed provider cache reads beside the provider cache model's, in tokens and as shares of
    each side's prompt (an imported transcript's provider tokenised its prompt with its own tokenizer, system
    prompt and tools included, so tokens do not compare there; shares do). None without provider usage."""
    if ex.provider_preset is None:
        return [], None
    rows, exact, gaps, seen_n = [], 0, [], 0
    for a in ex.requests:
        seen, model = a.provider_cached_tokens, a.provider_predicted_cached_tokens
        seen_prompt = a.provider_prompt_tokens if a.provider_prompt_tokens else None
        seen_share = seen / seen_prompt if seen is not None and seen_prompt else None
        model_share = model / a.prompt_tokens if model is not None and a.prompt_tokens else None
        rows.append({"request_id": a.request_id, "observed_cache_read_tokens": seen,
                     "observed_share": seen_share, "predicted_cache_read_tokens": model,
                     "predicted_share": model_share})
        seen_n += seen is not None
        exact += seen is not None and seen == model
        if seen_share is not None and model_share is not None:
            gaps.append(abs(seen_share - model_share))
    gap = 100 * sum(gaps) / len(gaps) if gaps else None
    return rows, ProviderAgreement(ex.provider_preset, seen_n, exact, gap, len(gaps))


def imported_provider_usage(requests) -> tuple[list[int | None] | None, list[int | None] | None]:
    """Observed provider cache reads and prompt sizes of an imported transcript (the `observed_*` columns:
    Anthropic's `cache_read_input_tokens`, else OpenAI's `cached_tokens`), or (None, None)."""
    def column(name: str) -> list[int | None] | None:
        if name not in requests or not requests[name].notna().any():
            return None
        return [nan_to_none(x, int) for x in requests.sort_values("request_id")[name]]

    reads = column("observed_cache_read_input_tokens") or column("observed_cached_tokens")
    return reads, (column("observed_prompt_tokens") if reads is not None else None)

