"""TraceLab normalised round traces (``round_trace.jsonl``) → a counts-only token trace.

A TraceLab row is one model call ("round") with counts and timing but no text: ``input_tokens_total``,
``prefix_tokens`` (the part served from the provider's prompt cache), ``newly_append_tokens`` (= total −
prefix), ``output_tokens``, Claude's ``claude_*`` usage split, ``timing_events`` and ``tools`` (timestamps,
tool wall latency). Without text there is nothing to tokenise, so the trace is built from counts
(token mode, ``messages`` null), keeping the recorded reuse structure:

* round 0 of a session: the first ``prefix_tokens`` tokens of a prefix shared by every session of the same
  provider and model (a system prompt and tools that were cached before the session started), then
  ``newly_append_tokens`` fresh tokens;
* round r: the first ``prefix_tokens`` tokens of round r-1's prompt (reusing its segments; a segment cut
  in the middle becomes a new segment holding its first tokens), then ``newly_append_tokens`` fresh tokens. If
  ``prefix_tokens`` exceeds round r-1's prompt, the whole prompt plus fresh tokens fill the rest.

So an ideal prefix cache hits exactly the recorded prefix (up to block rounding), and a prefix drop such as a
compaction (Codex round 3: 3,456 of 10,058) is a drop here too. What counts cannot say: reuse the provider
did not cache (tokens after its last cache breakpoint reappear as "new"), and what the tokens are. Outputs
are lengths only (``output_segment_id`` = -1). Tokens are drawn like block imports: from ``--tokenizer``'s
corpus, or uniform ids when none is given.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvscope.workloads.importers.agent import ObservedUsage, parse_time
from kvscope.workloads.prefix import Transition, classify_transition
from kvscope.workloads.tokens import TokenSource
from kvscope.workloads.trace import CREATED_BY, Trace, TraceBuilder
from kvscope.workloads.trace_schema import SegmentKind
from kvscope.workloads.errors import TraceFileError, iter_json_lines, require_fields
from kvscope.workloads.importers.sniff import check_kind, refuse_empty

REQUIRED = ("session_id", "round_index", "input_tokens_total", "prefix_tokens", "output_tokens")


def _usage(r: dict) -> ObservedUsage:
    if r.get("claude_cache_read_input_tokens") is not None or r.get("provider") == "claude":
        return ObservedUsage.anthropic({"input_tokens": r.get("claude_uncached_input_tokens"),
                                        "cache_read_input_tokens": r.get("claude_cache_read_input_tokens"),
                                        "cache_creation_input_tokens": r.get("claude_cache_creation_input_tokens"),
                                        "output_tokens": r.get("output_tokens")})
    return ObservedUsage(prompt_tokens=r.get("input_tokens_total"), cached_tokens=r.get("prefix_tokens"),
                         output_tokens=r.get("output_tokens"))


def _times(r: dict) -> tuple[float | None, float | None]:
    """(request time, response end) from ``timing_events``: the last input event before the first output
    event, and the last output event."""
    events = [(e.get("event_type"), parse_time(e.get("timestamp"))) for e in r.get("timing_events") or []]
    inputs = ("user_message", "tool_result")
    req = None
    for kind, t in events:
        if kind not in inputs:
            break
        req = t
    outs = [t for kind, t in events if kind not in inputs and t is not None]
    return req, (outs[-1] if outs else None)


class _Prefixes:
    """Per (provider, model): one growing shared prefix, stored as segments of fresh tokens."""

    def __init__(self, b: TraceBuilder, source: TokenSource, rng: np.random.Generator) -> None:
        self.b, self.source, self.rng = b, source, rng
        self.segs: dict[str, list[int]] = {}

    def take(self, key: str, n: int) -> list[int]:
        segs = self.segs.setdefault(key, [])
        have = sum(self.b.segment_len(s) for s in segs)
        if have < n:
            segs.append(self.b.add_segment(self.source.draw(SegmentKind.SYSTEM, n - have, self.rng),
                                           SegmentKind.SYSTEM))
        return _cut(self.b, segs, n)


def _cut(b: TraceBuilder, segs: list[int], n: int) -> list[int]:
    """The segments covering the first ``n`` tokens; a segment cut in the middle becomes a new, shorter one."""
    out, pos = [], 0
    for s in segs:
        if pos >= n:
            break
        k = b.segment_len(s)
        if pos + k <= n:
            out.append(s)
        else:
            out.append(b.add_segment(b.segment(s)[:n - pos], SegmentKind.IMPORTED))
        pos += k
    return out


def import_tracelab(path: str | Path, source: TokenSource | None = None, seed: int = 0) -> Trace:
    p = Path(path)
    check_kind(p, "tracelab")
    source = source or TokenSource.uniform()
    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    shared = _Prefixes(b, source, rng)
    rows = []
    for line_no, r in iter_json_lines(p):
        require_fields(r, REQUIRED, f"{p}: line {line_no}")
        total, prefix = int(r["input_tokens_total"]), int(r["prefix_tokens"])
        if not 0 <= prefix <= total:
            raise TraceFileError(f"{p}: line {line_no}: prefix_tokens {prefix} must be within 0..input_tokens_total "
                                 f"({total})")
        rows.append((line_no, r))
    if not rows:
        refuse_empty(p, "tracelab", "rounds")
    rows.sort(key=lambda x: (str(x[1]["session_id"]), int(x[1]["round_index"])))
    t0: dict[str, float] = {}  # each session starts at 0: TraceLab sessions come from different users and days
    for _, r in rows:
        req = _times(r)[0]
        if req is not None:
            t0.setdefault(str(r["session_id"]), req)
    prev: dict[str, tuple[int, list[int], int, float | None]] = {}  # session -> (row, segments, tokens, end)
    for _, r in rows:
        sid = str(r["session_id"])
        total, prefix = int(r["input_tokens_total"]), int(r["prefix_tokens"])
        req_s, end_s = _times(r)
        if sid in prev:
            parent, psegs, plen, pend = prev[sid]
            segs = _cut(b, psegs, min(prefix, plen))
            fresh = total - min(prefix, plen)
        else:
            parent, plen, pend = -1, 0, None
            segs = shared.take(f"{r.get('provider')}/{r.get('model')}", prefix)
            fresh = total - prefix
        if fresh > 0:
            segs.append(b.add_segment(source.draw(SegmentKind.IMPORTED, fresh, rng), SegmentKind.IMPORTED))
        gap = max(0.0, req_s - pend) if req_s is not None and pend is not None else 0.0
        tool_input = r.get("first_input_event_type") == "tool_result"
        out = max(1, int(r["output_tokens"] or 0))
        idx = b.add_request(session_id=sid, step=int(r["round_index"]), parent_request_id=parent,
                            arrival_s=(req_s - t0[sid]) if req_s is not None else 0.0,
                            think_time_s=0.0 if tool_input else gap, tool_latency_s=gap if tool_input else 0.0,
                            prompt_segment_ids=segs, output_tokens=out, max_tokens=out,
                            output_reasoning_tokens=int(r.get("reasoning_output_tokens") or 0),
                            transition=Transition.FIRST if parent < 0 else classify_transition(min(prefix, plen), plen),
                            input_kind=SegmentKind.TOOL_OUTPUT if tool_input else SegmentKind.USER,
                            **_usage(r).columns())
        prev[sid] = (idx, segs, total, end_s)
    return b.build({"name": p.stem, "spec": {"importer": "tracelab", "source": str(p), "seed": seed},
                    "created_by": CREATED_BY, "not_recorded": ["message text (counts only: the tokens are synthetic)"],
                    "tokenizer": source.info})
