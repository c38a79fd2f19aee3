"""Workload statistics: sizes, appends, transitions and the ideal prefix-hit ratio of an infinite cache.

The same summary is computed for generated traces, imported token traces and the raw block view of real
traces (:func:`block_request_stats`), so a calibrated preset can be compared side by side with its source.

Ideal hit ratio (token-weighted): requests are scored in arrival order against everything seen before
(``global``) or only earlier requests of the same session (``per_session``). A request of ``n`` tokens is cut
into blocks of ``B`` tokens (the last may be partial); ``k`` is the leading run of blocks whose content,
together with everything before it, was seen before, and the hit is ``min(k*B, n)``. A partial last block
counts when its tokens are a prefix of a block seen at that position; this is the Mooncake definition, and it
is an upper bound on what vLLM reports (vLLM caches full blocks only and recomputes the last prompt token).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Iterable

import numpy as np
import pandas as pd

from kvscope.workloads.importers.blocks import BlockRequest, block_transition
from kvscope.workloads.ideal import ideal_block_hit
from kvscope.workloads.prefix import Transition, leading_run
from kvscope.workloads.trace_schema import SegmentKind
from kvscope.workloads.trace import Trace
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE

_W_SEED = 0x6B7673636F7065


def _dist(x: Iterable[float]) -> dict:
    a = np.asarray(list(x), dtype=np.float64)
    if len(a) == 0:
        return {"count": 0}
    return {"count": int(len(a)), "mean": float(a.mean()), "p10": float(np.percentile(a, 10)),
            "p50": float(np.median(a)), "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}


class IdealCache:
    """Infinite prefix cache at block granularity with exact partial-tail matching (see module doc)."""

    def __init__(self, block_size: int, exact_tails: bool = True) -> None:
        self.B = block_size
        self.exact_tails = exact_tails
        rng = np.random.default_rng(_W_SEED)
        self.w = rng.integers(1, 2**63, size=block_size, dtype=np.uint64) | np.uint64(1)
        self._r = rng.integers(1, 2**63, size=4096, dtype=np.uint64) | np.uint64(1)
        self.seen: set[int] = set()
        self.next_chunks: dict[int, list[bytes]] = defaultdict(list)

    def _mult(self, n: int) -> np.ndarray:
        while len(self._r) < n:
            rng = np.random.default_rng([_W_SEED, len(self._r)])
            self._r = np.concatenate([self._r, rng.integers(1, 2**63, size=len(self._r), dtype=np.uint64) | np.uint64(1)])
        return self._r[:n]

    def chain(self, tokens: np.ndarray) -> np.ndarray:
        """Prefix hash after each full block (position-dependent, so equal hashes mean equal prefixes)."""
        nb = len(tokens) // self.B
        if nb == 0:
            return np.zeros(0, dtype=np.uint64)
        blocks = tokens[: nb * self.B].reshape(nb, self.B).astype(np.uint64)
        with np.errstate(over="ignore"):
            h = (blocks * self.w).sum(axis=1, dtype=np.uint64)
            h ^= h >> np.uint64(29)
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(32)
            return np.cumsum(h * self._mult(nb), dtype=np.uint64)

    def lookup_and_insert(self, tokens: np.ndarray, chain: np.ndarray | None = None) -> int:
        """Hit tokens of this prompt, then remember it. Partial last blocks are matched exactly when
        ``exact_tails`` (default for block sizes >= 128, where they matter); otherwise they never hit."""
        n = len(tokens)
        keys = (self.chain(tokens) if chain is None else chain).tolist()
        seen = self.seen
        k = leading_run(keys, seen, chained=True)
        nb = len(keys)
        hit = k * self.B
        # Chained keys: once one is new, all later ones are new too.
        new_keys = keys[k:]
        seen.update(new_keys)
        if self.exact_tails:
            for j in range(k, nb):
                self.next_chunks[keys[j - 1] if j else 0].append(tokens[j * self.B:(j + 1) * self.B].tobytes())
            tail = tokens[nb * self.B:]
            if len(tail):
                prev_key = keys[nb - 1] if nb else 0
                lst = self.next_chunks[prev_key]
                tb = tail.tobytes()
                if any(c.startswith(tb) for c in lst):
                    if k == nb:
                        hit = n
                else:
                    lst.append(tb)
        return min(hit, n)


def ideal_hit_ratios(trace: Trace, block_size: int, exact_tails: bool | None = None) -> tuple[float, float]:
    """Token-weighted ideal prefix-hit ratio of ``trace``: (global, per_session). See the module doc."""
    exact = block_size >= 128 if exact_tails is None else exact_tails
    caches: dict[str, IdealCache] = {}
    glob = IdealCache(block_size, exact)
    hit_g = hit_s = total = 0
    order = np.argsort(trace.requests["arrival_s"].to_numpy(), kind="stable")
    sessions = trace.requests["session_id"].to_numpy()
    for rid in order:
        toks = trace.prompt_token_ids(int(rid))
        ch = glob.chain(toks)
        hit_g += glob.lookup_and_insert(toks, ch)
        cache = caches.get(sessions[rid])
        if cache is None:
            cache = caches[sessions[rid]] = IdealCache(block_size, exact)
        hit_s += cache.lookup_and_insert(toks, ch)
        total += len(toks)
    return (hit_g / total, hit_s / total) if total else (0.0, 0.0)


def ideal_hit_ratio(trace: Trace, block_size: int, per_session: bool = False,
                    exact_tails: bool | None = None) -> float:
    g, s = ideal_hit_ratios(trace, block_size, exact_tails)
    return s if per_session else g


def ideal_hit_ratio_blocks(reqs: list[BlockRequest], per_session: bool = False) -> float:
    """Ideal hit on the raw block view, requests in arrival order (see :func:`ideal_block_hit`)."""
    rows = ((r.block_ids.tolist(), r.input_length, r.block_size, r.session_id)
            for r in sorted(reqs, key=lambda r: r.arrival_s))
    return ideal_block_hit(rows, per_session=per_session).token_hit_ratio


# ------------------------------------------------------------------------------------------ summary


def _frame_from_trace(trace: Trace) -> pd.DataFrame:
    df = trace.requests
    return pd.DataFrame({"session_id": df["session_id"], "step": df["step"], "parent": df["parent_request_id"],
                         "prompt": df["prompt_tokens"].astype(np.int64), "output": df["output_tokens"].astype(np.int64),
                         "transition": df["transition"], "input_kind": df["input_kind"],
                         "static": df["static_prefix_tokens"], "think": df["think_time_s"],
                         "tool": df["tool_latency_s"]})


def _frame_from_blocks(reqs: list[BlockRequest]) -> pd.DataFrame:
    return pd.DataFrame({
        "session_id": [r.session_id for r in reqs], "step": [r.step for r in reqs],
        "parent": [r.parent for r in reqs], "prompt": [r.input_length for r in reqs],
        "output": [r.output_length for r in reqs],
        "transition": [block_transition(reqs[r.parent].block_ids if r.parent >= 0 else None, r.block_ids)
                       for r in reqs],
        "input_kind": [r.input_kind for r in reqs], "static": [r.static_prefix_tokens for r in reqs],
        "think": [r.think_time_s for r in reqs], "tool": [r.tool_latency_s for r in reqs]})


def summarize(frame: pd.DataFrame) -> dict:
    """Summary of a request frame (columns as built by the ``_frame_from_*`` helpers)."""
    out: dict = {"sessions": int(frame["session_id"].nunique()), "requests": int(len(frame))}
    out["calls_per_session"] = _dist(frame.groupby("session_id").size())
    out["prompt_tokens"] = _dist(frame["prompt"])
    out["output_tokens"] = _dist(frame["output"])
    firsts = frame[frame["parent"] < 0]
    static = firsts["static"][firsts["static"] >= 0]
    out["static_prefix_tokens"] = _dist(static)
    has_parent = frame["parent"].to_numpy() >= 0
    par = frame["parent"].to_numpy()[has_parent]
    prompt = frame["prompt"].to_numpy()
    output = frame["output"].to_numpy()
    appended = np.full(len(frame), np.nan)
    appended[has_parent] = prompt[has_parent] - prompt[par] - output[par]
    is_append = (frame["transition"] == Transition.APPEND).to_numpy()
    kinds = frame["input_kind"].to_numpy()
    out["appended_tokens"] = {
        "all": _dist(appended[is_append & has_parent]),
        SegmentKind.TOOL_OUTPUT.value: _dist(appended[is_append & has_parent & (kinds == SegmentKind.TOOL_OUTPUT)]),
        SegmentKind.USER.value: _dist(appended[is_append & has_parent & (kinds == SegmentKind.USER)]),
    }
    later = frame[has_parent]
    counts = later["transition"].value_counts()
    out["transitions"] = {t.value: float(counts.get(t, 0) / max(1, len(later)))
                          for t in Transition if t is not Transition.FIRST}
    out["think_time_s"] = _dist(frame["think"][(frame["think"] > 0)])
    out["tool_latency_s"] = _dist(frame["tool"][(frame["tool"] > 0)])
    return out


def trace_stats(trace: Trace, block_size: int | None = None, hit: bool = True) -> dict:
    """Summary of a trace, with ideal hit ratios at ``block_size`` (default: the trace's native block size
    for imports, else 16)."""
    out = summarize(_frame_from_trace(trace))
    out["name"] = trace.meta.get("name")
    if hit:
        bs = block_size or trace.meta.get("block_size_hint") or DEFAULT_BLOCK_SIZE
        g, ps = ideal_hit_ratios(trace, int(bs))
        out["ideal_hit"] = {"block_size": int(bs), "global": g, "per_session": ps}
    return out


def block_request_stats(reqs: list[BlockRequest], hit: bool = True) -> dict:
    """Summary of a raw block view (no tokens materialised)."""
    out = summarize(_frame_from_blocks(reqs))
    if hit and reqs:
        out["ideal_hit"] = {"block_size": reqs[0].block_size, "global": ideal_hit_ratio_blocks(reqs),
                            "per_session": ideal_hit_ratio_blocks(reqs, per_session=True)}
    return out


def format_stats(s: dict) -> str:
    """Human-readable table of :func:`trace_stats` output."""
    lines = [f"trace {s.get('name') or ''}: {s['sessions']} sessions, {s['requests']} requests"]

    def row(label: str, d: dict, fmt: str = "{:,.0f}") -> None:
        if not d.get("count"):
            lines.append(f"  {label:<28} -")
            return
        lines.append(f"  {label:<28} " + "  ".join(f"{k} {fmt.format(d[k])}" for k in ("p10", "p50", "p90", "mean", "max")))

    row("calls per session", s["calls_per_session"])
    row("prompt tokens", s["prompt_tokens"])
    row("output tokens", s["output_tokens"])
    row("static prefix (sys+tools)", s["static_prefix_tokens"])
    row("appended after tool call", s["appended_tokens"][SegmentKind.TOOL_OUTPUT])
    row("appended user message", s["appended_tokens"]["user"])
    row("think time s", s["think_time_s"], "{:,.1f}")
    row("tool latency s", s["tool_latency_s"], "{:,.1f}")
    t = s["transitions"]
    lines.append("  transitions                  " + "  ".join(f"{k} {100 * v:.1f}%" for k, v in t.items()))
    if "ideal_hit" in s:
        h = s["ideal_hit"]
        lines.append(f"  ideal prefix hit (B={h['block_size']})     global {100 * h['global']:.2f}%  "
                     f"per-session {100 * h['per_session']:.2f}%")
    return "\n".join(lines)


def to_json(s: dict) -> str:
    return json.dumps(s, indent=2, sort_keys=True)
