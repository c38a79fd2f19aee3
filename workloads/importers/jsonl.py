"""Plain JSONL traces: one request per line with explicit token ids.

Import fields: ``prompt_token_ids`` (required), optional ``output_token_ids``, ``session_id``, ``step``,
``max_tokens``, ``arrival_s``. Requests of one session (same ``session_id``, ordered by ``step`` then line)
are chained as parent → child. A session starts at its first request's ``arrival_s`` (replay keeps the
trace's session timing; later requests follow their parent as in any trace, with think time 0). Prompts are stored compactly: a prompt that starts with its parent's prompt
(+ the parent's output) references the parent's segments and adds only the new tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvscope.workloads.trace import CREATED_BY, Trace, TraceBuilder


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    d = np.nonzero(a[:m] != b[:m])[0]
    return int(d[0]) if len(d) else m


def import_jsonl(path: str | Path) -> Trace:
    from kvscope.workloads.errors import iter_json_lines, require_fields

    numbered = list(iter_json_lines(path))
    for line_no, r in numbered:
        require_fields(r, ("prompt_token_ids",), f"{path}: line {line_no}")
        if "session_id" in r and r["session_id"] is None:
            from kvscope.workloads.errors import TraceFileError

            raise TraceFileError(f"{path}: line {line_no}: session_id is null; give a string or an integer, or "
                                 "leave the field out (the line is then a session of its own)")
    lines = [r for _, r in numbered]
    b = TraceBuilder()
    order = sorted(range(len(lines)), key=lambda i: (str(lines[i].get("session_id", f"line{i}")),
                                                     int(lines[i].get("step", 0)), i))
    last: dict[str, tuple[int, list[int], np.ndarray]] = {}  # session -> (row, segments, full prompt)
    rows: dict[int, dict] = {}
    session_start_s: dict[str, float] = {}  # a session starts at its first request's arrival_s
    for i in order:
        r = lines[i]
        sess = str(r.get("session_id", f"line{i:06d}"))
        prompt = np.asarray(r["prompt_token_ids"], dtype=np.int32)
        out = r.get("output_token_ids")
        segs: list[int] = []
        parent = -1
        transition = "first"
        if sess in last:
            parent, psegs, pfull = last[sess]
            k = _lcp(pfull, prompt)
            transition = "append" if k >= len(pfull) else ("edit" if 2 * k >= len(pfull) else "reset")
            # reuse whole parent segments that lie inside the common prefix
            pos = 0
            for s in psegs:
                n = b.segment_len(s)
                if pos + n > k:
                    break
                segs.append(s)
                pos += n
            if pos < len(prompt):
                segs.append(b.add_segment(prompt[pos:], "imported"))
        elif len(prompt):
            segs.append(b.add_segment(prompt, "imported"))
        out_seg = b.add_segment(np.asarray(out, dtype=np.int32), "assistant") if out is not None else -1
        n_out = len(out) if out is not None else int(r.get("max_tokens", r.get("output_tokens", 1)))
        arrival_s = float(r.get("arrival_s", 0.0))
        start_s = session_start_s.setdefault(sess, arrival_s)
        rows[i] = dict(session_id=sess, step=int(r.get("step", 0)), parent_request_id=parent,
                       arrival_s=arrival_s, session_start_s=start_s, prompt_segment_ids=segs, output_segment_id=out_seg,
                       output_tokens=n_out, max_tokens=int(r.get("max_tokens", n_out)), transition=transition)
        idx = b.add_request(**rows[i])
        full = prompt if out is None else np.concatenate([prompt, np.asarray(out, dtype=np.int32)])
        full_segs = segs + ([out_seg] if out_seg >= 0 else [])
        last[sess] = (idx, full_segs, full)
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
