"""Plain JSONL traces: one request per line with explicit token ids.

Import fields (read by :func:`kvscope.workloads.readers.read_token_jsonl`, shared with ``kvscope simulate``):
``prompt_token_ids`` (required), optional ``output_token_ids``, ``session_id``, ``step``, ``max_tokens``,
``output_tokens``, ``arrival_s``, ``cache_salt``. Requests of one session (same ``session_id``, ordered by
``step`` then line) are chained as parent → child. A session starts at its first request's ``arrival_s`` (replay
keeps the trace's session timing; later requests follow their parent as in any trace, with think time 0). Prompts are stored compactly: a prompt that starts with its
parent's prompt (+ the parent's output) references the parent's segments and adds only the new tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvscope.workloads.prefix import Transition, classify_transition, common_prefix_len
from kvscope.workloads.readers import read_token_jsonl
from kvscope.workloads.trace import CREATED_BY, Trace, TraceBuilder
from kvscope.workloads.trace_schema import SegmentKind
from kvscope.workloads.importers.sniff import check_kind, refuse_empty


def _reused_segments(b: TraceBuilder, parent_segments: list[int], common: int) -> tuple[list[int], int]:
    """The parent's whole segments inside the first ``common`` tokens, and the tokens they cover."""
    segs: list[int] = []
    pos = 0
    for s in parent_segments:
        n = b.segment_len(s)
        if pos + n > common:
            break
        segs.append(s)
        pos += n
    return segs, pos


def import_jsonl(path: str | Path) -> Trace:
    check_kind(path, "jsonl")
    lines = read_token_jsonl(path)
    if not lines:
        refuse_empty(path, "jsonl", "requests")
    b = TraceBuilder()
    sessions = [r.session_id if r.session_id is not None else f"line{i:06d}" for i, r in enumerate(lines)]
    order = sorted(range(len(lines)), key=lambda i: (sessions[i], lines[i].step, i))
    last: dict[str, tuple[int, list[int], np.ndarray]] = {}  # session -> (row, segments, full prompt)
    session_start_s: dict[str, float] = {}  # a session starts at its first request's arrival_s
    for i in order:
        r, sess = lines[i], sessions[i]
        segs: list[int] = []
        parent = -1
        transition = Transition.FIRST
        if sess in last:
            parent, psegs, pfull = last[sess]
            k = common_prefix_len(pfull, r.prompt)
            transition = classify_transition(k, len(pfull))
            segs, pos = _reused_segments(b, psegs, k)
            if pos < len(r.prompt):
                segs.append(b.add_segment(r.prompt[pos:], SegmentKind.IMPORTED))
        elif len(r.prompt):
            segs.append(b.add_segment(r.prompt, SegmentKind.IMPORTED))
        out_seg = b.add_segment(r.output, SegmentKind.ASSISTANT) if r.output is not None else -1
        start_s = session_start_s.setdefault(sess, r.arrival_s)
        idx = b.add_request(session_id=sess, step=r.step, parent_request_id=parent, arrival_s=r.arrival_s,
                            session_start_s=start_s,
                            prompt_segment_ids=segs, output_segment_id=out_seg, output_tokens=r.output_tokens,
                            max_tokens=r.max_tokens, transition=transition, cache_salt=r.cache_salt)
        full = r.prompt if r.output is None else np.concatenate([r.prompt, r.output])
        last[sess] = (idx, segs + ([out_seg] if out_seg >= 0 else []), full)
    return b.build({"name": Path(path).stem, "spec": {"importer": "jsonl", "source": str(path)},
                    "created_by": CREATED_BY})


def export_jsonl(trace: Trace, out: str | Path) -> Path:
    """One line per request in request order: the jsonl import fields plus timing and transition."""
    p = Path(out)
    with p.open("w") as f:
        for r in trace.iter_requests():
            rec = {"request_id": r.request_id, "session_id": r.session_id, "step": r.step,
                   "arrival_s": r.arrival_s, "max_tokens": r.max_tokens,
                   "prompt_token_ids": trace.prompt_token_ids(r.request_id).tolist()}
            o = trace.output_token_ids(r.request_id)
            if o is not None:
                rec["output_token_ids"] = o.tolist()
            else:
                rec["output_tokens"] = r.output_tokens
            rec.update(think_time_s=r.think_time_s, tool_latency_s=r.tool_latency_s, transition=r.transition)
            if r.cache_salt:
                rec["cache_salt"] = r.cache_salt
            f.write(json.dumps(rec) + "\n")
    return p
