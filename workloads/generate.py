"""Turn a :class:`~kvscope.workloads.spec.WorkloadSpec` into a token-exact :class:`~kvscope.workloads.trace.Trace`.

Sessions are generated one by one from independent random streams derived from ``(seed, session index)``, so
adding sessions or changing one session's parameters does not reshuffle the others. Each request's prompt is
built from the session's history after the history policies ran, as a list of segment references; tokens are
drawn once per segment. The cost is therefore proportional to the distinct tokens (not the sum of prompt
lengths), which keeps 100k-token agent sessions cheap.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from kvscope.workloads.arrivals import arrival_offsets_s
from kvscope.workloads.policies import Item, VolatilePrefix
from kvscope.workloads.prefix import Transition, classify_transition, common_prefix_len
from kvscope.workloads.spec import WorkloadSpec, spec_to_dict, load_spec
from kvscope.workloads.text import ROLE, TextMode
from kvscope.workloads.tokens import TokenSource
from kvscope.workloads.trace import CREATED_BY, Trace, TraceBuilder
from kvscope.workloads.trace_schema import SegmentKind


@dataclass
class _Tenant:
    system: int
    tools: list[int]
    split_cache: dict = field(default_factory=dict)


class _Context:
    """What all sessions share: the segment store, the token source, tenants, documents, counters."""

    def __init__(self, spec: WorkloadSpec, source: TokenSource, seed: int, scale: float,
                 text: TextMode | None = None) -> None:
        self.spec, self.source, self.seed, self.scale = spec, source, seed, scale
        self.text = text
        self.builder = TraceBuilder()
        self.tenants: dict[int, _Tenant] = {}
        self.documents: dict[int, int] = {}
        self.volatile_counter = 0
        self._template_segments: dict[str, int] = {}
        self._segment_text: dict[int, str] = {}
        # text mode: the system prompt is drawn in clean parts cut at the volatile positions
        self.text_cuts = {}
        if text is not None:
            for pol in spec.sessions.policies:
                if isinstance(pol, VolatilePrefix):
                    p = round(pol.position * scale)
                    self.text_cuts[p] = max(2, p) if p > 0 else 0

    def draw(self, kind: str, n: int, rng: np.random.Generator, closed: bool = False) -> np.ndarray:
        """Token-mode window, or stable text content (``closed``: safe to concatenate in one message)."""
        self.builder.check_fits(n)
        if self.text is None:
            return self.source.draw(kind, n, rng)
        return self.text.closed(kind, n, rng) if closed else self.text.draw(kind, n, rng)

    def _system_tokens(self, n: int, rng: np.random.Generator) -> np.ndarray:
        self.builder.check_fits(n)
        if self.text is None:
            return self.source.draw(SegmentKind.SYSTEM, n, rng)
        cuts = sorted({c for c in self.text_cuts.values() if 0 < c} | {0})
        parts, pos = [], 0
        for c in cuts[1:]:
            if c - pos >= 2 and n - c >= 2:
                parts.append(self.text.closed(SegmentKind.SYSTEM, c - pos, rng))
                pos = c
        parts.append(self.text.closed(SegmentKind.SYSTEM, n - pos, rng))
        return np.concatenate(parts)

    # ---------------------------------------------------------------- text mode rendering
    def template_segment(self, text: str) -> int | None:
        if not text:
            return None
        sid = self._template_segments.get(text)
        if sid is None:
            assert self.text is not None
            sid = self._template_segments[text] = self.builder.add_segment(self.text.template_ids(text),
                                                                           SegmentKind.TEMPLATE)
        return sid

    def segment_text(self, sid: int) -> str:
        t = self._segment_text.get(sid)
        if t is None:
            assert self.text is not None
            t = self._segment_text[sid] = self.text.decode(self.builder.segment(sid))
        return t

    def render(self, state: SessionState) -> tuple[list[int], str, int]:
        """Text mode: (prompt segments with template segments, messages JSON, static prefix tokens)."""
        assert self.text is not None
        msgs = [("system", state.prefix_segments())] + [(ROLE.get(it.kind, "user"), [it.segment_id])
                                                          for it in state.history]
        pieces = self.text.template.pieces([r for r, _ in msgs])
        segs: list[int] = []
        static = 0
        out = []
        for i, ((role, content), piece) in enumerate(zip(msgs, pieces)):
            t = self.template_segment(piece)
            if t is not None:
                segs.append(t)
            segs += content
            n = sum(self.builder.segment_len(x) for x in content)
            if i == 0:
                static = n + (self.builder.segment_len(t) if t is not None else 0)
            out.append({"role": role, "content": "".join(self.segment_text(x) for x in content), "n_tokens": n})
        t = self.template_segment(pieces[-1])
        if t is not None:
            segs.append(t)
        return segs, json.dumps(out, ensure_ascii=False), static

    def tenant(self, t: int) -> _Tenant:
        if t not in self.tenants:
            rng = np.random.default_rng([self.seed, 2, t])
            p = self.spec.prefix
            n_sys = int(p.system_tokens.sample_int(rng, 1, self.scale, low=1)[0])
            system = self.builder.add_segment(self._system_tokens(n_sys, rng), SegmentKind.SYSTEM)
            n_tools = int(p.tools_tokens.sample_int(rng, 1, self.scale, low=0)[0])
            tools = []
            if n_tools > 0:
                k = min(p.tool_count, n_tools)
                shares = rng.dirichlet(np.full(k, 4.0))
                sizes = np.maximum(1, np.floor(shares * n_tools).astype(np.int64))
                sizes[-1] += n_tools - sizes.sum()
                if sizes[-1] < 1:  # rounding pushed the last one below 1: rebalance evenly
                    sizes = np.full(k, n_tools // k)
                    sizes[: n_tools % k] += 1
                tools = [self.builder.add_segment(self.draw(SegmentKind.TOOLS, int(s), rng, closed=True),
                                                  SegmentKind.TOOLS)
                         for s in sizes]
            self.tenants[t] = _Tenant(system, tools)
        return self.tenants[t]

    def document(self, d: int) -> int:
        if d not in self.documents:
            rng = np.random.default_rng([self.seed, 4, d])
            doc = self.spec.prefix.documents
            assert doc is not None
            n = int(doc.tokens.sample_int(rng, 1, self.scale, low=1)[0])
            self.documents[d] = self.builder.add_segment(self.draw(SegmentKind.DOCUMENT, n, rng, closed=True),
                                                         SegmentKind.DOCUMENT)
        return self.documents[d]

    def split_system(self, tenant: _Tenant, position: int) -> tuple[int | None, int | None]:
        """System prompt cut at ``position`` into two shared segments (head, tail), cached per tenant."""
        if position not in tenant.split_cache:
            toks = self.builder.segment(tenant.system)
            p = min(self.text_cuts.get(position, position), len(toks))
            head = self.builder.add_segment(toks[:p], SegmentKind.SYSTEM) if p > 0 else None
            tail = self.builder.add_segment(toks[p:], SegmentKind.SYSTEM) if p < len(toks) else None
            tenant.split_cache[position] = (head, tail)
        return tenant.split_cache[position]


class SessionState:
    """Mutable view of one session that history policies edit before each prompt is built."""

    def __init__(self, ctx: _Context, tenant: _Tenant, document: int | None, rng: np.random.Generator) -> None:
        self.ctx, self.tenant, self.document, self.rng = ctx, tenant, document, rng
        self.scale = ctx.scale
        self.tools: list[int] = list(tenant.tools)
        self.history: list[Item] = []
        self.step = 0
        self.volatile: tuple[int, int] | None = None  # (segment id, position)

    # -------------------------------------------------------------- building blocks used by policies
    def _len(self, sid: int) -> int:
        return self.ctx.builder.segment_len(sid)

    def new_segment(self, kind: str, n: int) -> Item:
        toks = self.ctx.draw(kind, n, self.rng)
        sid = self.ctx.builder.add_segment(toks, kind)
        return Item(sid, kind, len(toks), self.step)

    def rewrite(self, item: Item, k: int, rng: np.random.Generator) -> Item:
        toks = self.ctx.builder.segment(item.segment_id).copy()
        off = int(rng.integers(0, len(toks) - k + 1))
        if self.ctx.text is not None:  # keep the clean prefix before the edit, redraw the rest of the item
            old, r = toks, item.reasoning_tokens
            toks = self.ctx.text.cut(old, len(old), rng, item.kind, edit_at=off)
            if r and not np.array_equal(toks[:r], old[:r]):
                r = 0  # the edit went into the reasoning part: it can no longer be stripped cleanly
            sid = self.ctx.builder.add_segment(toks, item.kind)
            return Item(sid, item.kind, len(toks), item.step, r, {**item.meta, "edited_at": off})
        new = self.ctx.source.draw(item.kind, k, rng)
        same = new == toks[off:off + k]
        if same.all():  # make sure the edit really changes a token
            new[0] = self.ctx.source.plain_ids[(np.searchsorted(self.ctx.source.plain_ids, toks[off]) + 1)
                                               % len(self.ctx.source.plain_ids)]
        toks[off:off + k] = new
        sid = self.ctx.builder.add_segment(toks, item.kind)
        return Item(sid, item.kind, len(toks), item.step, item.reasoning_tokens, {**item.meta, "edited_at": off})

    def truncate(self, item: Item, limit: int) -> Item:
        toks = self.ctx.builder.segment(item.segment_id)[:limit]
        if self.ctx.text is not None and limit < item.n_tokens:
            toks = self.ctx.text.cut(toks, limit, self.rng, item.kind)
        sid = self.ctx.builder.add_segment(toks, item.kind)
        return Item(sid, item.kind, len(toks), item.step, 0, {**item.meta, "truncated": True})

    def strip(self, item: Item) -> Item:
        if item.reasoning_tokens <= 0:
            return item
        toks = self.ctx.builder.segment(item.segment_id)[item.reasoning_tokens:]
        sid = self.ctx.builder.add_segment(toks, item.kind)
        return Item(sid, item.kind, len(toks), item.step, 0, {**item.meta, "stripped": True})

    def new_volatile(self, policy: VolatilePrefix) -> None:
        n = max(1, round(policy.tokens * self.scale))
        if self.ctx.text is not None:
            toks = self.ctx.text.volatile(n, self.ctx.volatile_counter)
        else:
            toks = self.ctx.source.volatile(n, self.ctx.volatile_counter, self.rng)
        self.ctx.volatile_counter += 1
        self.volatile = (self.ctx.builder.add_segment(toks, SegmentKind.VOLATILE), round(policy.position * self.scale))

    # -------------------------------------------------------------- prompt
    def prefix_segments(self) -> list[int]:
        if self.volatile is None:
            segs = [self.tenant.system]
        else:
            vol, pos = self.volatile
            head, tail = self.ctx.split_system(self.tenant, pos)
            segs = [s for s in (head, vol, tail) if s is not None]
        segs += self.tools
        if self.document is not None:
            segs.append(self.document)
        return segs

    def prompt_segments(self) -> list[int]:
        return self.prefix_segments() + [it.segment_id for it in self.history]

    def prompt_tokens(self) -> int:
        return sum(self._len(s) for s in self.prefix_segments()) + sum(it.n_tokens for it in self.history)


def common_prefix_tokens(builder: TraceBuilder, a: list[int], b: list[int]) -> int:
    """Token-exact longest common prefix of two prompts given as segment lists (shared segments are
    skipped by id, the rest compared token by token)."""
    n = 0
    i = 0
    while i < len(a) and i < len(b) and a[i] == b[i]:
        n += builder.segment_len(a[i])
        i += 1
    if i == len(a) or i == len(b):
        return n
    ra = np.concatenate([builder.segment(s) for s in a[i:]])
    rb = np.concatenate([builder.segment(s) for s in b[i:]])
    return n + common_prefix_len(ra, rb)


def _session_starts(spec: WorkloadSpec, durations: np.ndarray, seed: int) -> np.ndarray:
    a, n = spec.arrival, len(durations)
    rng = np.random.default_rng([seed, 3])
    if a.kind == "all_at_once":
        return np.zeros(n)
    if a.kind == "closed_loop":
        slots = [0.0] * min(a.concurrency, n)
        heapq.heapify(slots)
        starts = np.empty(n)
        for i in range(n):
            t = heapq.heappop(slots)
            starts[i] = t
            heapq.heappush(slots, t + float(durations[i]))
        return starts
    return arrival_offsets_s(rng, n, a.rate, a.kind, a.cv)


def _zipf_choice(rng: np.random.Generator, n: int, a: float) -> int:
    if n == 1:
        return 0
    p = np.arange(1, n + 1, dtype=np.float64) ** -a
    return int(rng.choice(n, p=p / p.sum()))


def _plan_session(spec: WorkloadSpec, rng: np.random.Generator, scale: float) -> list[dict]:
    """Per-request sizes and delays of one session, before any tokens exist."""
    s = spec.sessions
    out_scale = spec.output_scale if spec.output_scale is not None else scale
    steps = []
    if s.kind == "chat":
        c = s.chat
        n = max(1, int(c.turns.sample_int(rng, 1)[0]))
        user = c.user_tokens.sample_int(rng, n, scale, low=1)
        out = c.output_tokens.sample_int(rng, n, out_scale, low=1)
        reas = c.reasoning_tokens.sample_int(rng, n, out_scale, low=0)
        think = np.maximum(c.think_time_s.sample(rng, n), 0.0)
        for i in range(n):
            steps.append({"input_kind": SegmentKind.USER, "input_tokens": int(user[i]),
                          "output_kind": SegmentKind.ASSISTANT,
                          "output_tokens": int(out[i] + reas[i]), "reasoning": int(reas[i]),
                          "think": float(think[i]) if i else 0.0, "tool": 0.0})
        return steps
    a = s.agent
    n = max(1, int(a.calls.sample_int(rng, 1)[0]))
    is_user = rng.random(n) < a.user_turn_probability
    is_user[0] = True
    task = int(a.task_tokens.sample_int(rng, 1, scale, low=1)[0])
    user = a.user_tokens.sample_int(rng, n, scale, low=1)
    call = a.tool_call_tokens.sample_int(rng, n, out_scale, low=1)
    final = a.final_answer_tokens.sample_int(rng, n, out_scale, low=1)
    reas = a.reasoning_tokens.sample_int(rng, n, out_scale, low=0)
    tool_out = a.tool_output_tokens.sample_int(rng, n, scale, low=1)
    lat = np.maximum(a.tool_latency_s.sample(rng, n), 0.0)
    think = np.maximum(a.think_time_s.sample(rng, n), 0.0)
    for i in range(n):
        ends_turn = i == n - 1 or bool(is_user[i + 1])
        if i == 0:
            inp = (SegmentKind.TASK, task, 0.0, 0.0)
        elif is_user[i]:
            inp = (SegmentKind.USER, int(user[i]), float(think[i]), 0.0)
        else:
            inp = (SegmentKind.TOOL_OUTPUT, int(tool_out[i]), 0.0, float(lat[i]))
        o = int(final[i]) if ends_turn else int(call[i])
        steps.append({"input_kind": inp[0], "input_tokens": inp[1], "think": inp[2], "tool": inp[3],
                      "output_kind": SegmentKind.ASSISTANT if ends_turn else SegmentKind.TOOL_CALL,
                      "output_tokens": o + int(reas[i]), "reasoning": int(reas[i])})
    return steps


def generate(spec: WorkloadSpec, source: TokenSource, seed: int | None = None, scale: float | None = None,
             sessions: int | None = None, progress: bool = False, max_context: int | None = None,
             text: bool | None = None, output_scale: float | None = None, max_tokens: int | None = None,
             budget_hint: str = "") -> Trace:
    """Generate the trace of ``spec`` (at most ``max_tokens`` tokens: beyond, a WorkloadError naming
    ``budget_hint``). ``seed``, ``scale``, ``sessions``, ``max_context`` (the server's
    max_model_len) and ``text`` (text mode, see :mod:`kvscope.workloads.text`) override the spec's values. Text mode
    needs a ``source`` made by ``TokenSource.from_tokenizer(model_dir)`` on a model with a chat template."""
    spec = _with_overrides(spec, max_context, output_scale, sessions)
    seed = spec.seed if seed is None else seed
    scale = spec.scale if scale is None else scale
    text_mode = _text_mode(source, spec.text if text is None else text)
    ctx = _Context(spec, source, seed, scale, text_mode)
    b = ctx.builder
    b.max_tokens, b.budget_hint = max_tokens, budget_hint
    b.check_fits(spec.sessions.count)  # every session holds at least one token
    limit = _context_limit(spec, scale)
    n_sessions = spec.sessions.count
    width = len(str(n_sessions - 1))
    per_session: list[list[dict]] = []
    truncated = 0
    it: Iterable[int] = range(n_sessions)
    if progress:
        from tqdm import tqdm  # deferred: tqdm is heavy, only a progress bar needs it

        it = tqdm(it, desc=f"generating {spec.name}", unit="session")
    for si in it:
        rows, was_truncated = _generate_session(ctx, si, f"s{si:0{width}d}", limit)
        per_session.append(rows)
        truncated += was_truncated
    durations = np.array([r[-1]["offset"] if r else 0.0 for r in per_session])
    _add_requests(ctx.builder, per_session, _session_starts(spec, durations, seed))
    return ctx.builder.build(_trace_meta(ctx, seed, scale, truncated))


def _with_overrides(spec: WorkloadSpec, max_context: int | None, output_scale: float | None,
                    sessions: int | None) -> WorkloadSpec:
    if max_context is not None:
        spec = spec.model_copy(update={"limits": spec.limits.model_copy(update={"max_context_tokens": max_context})})
    if output_scale is not None:
        spec = spec.model_copy(update={"output_scale": output_scale})
    if sessions is not None:
        spec = spec.model_copy(update={"sessions": spec.sessions.model_copy(update={"count": sessions})})
    return spec


def _text_mode(source: TokenSource, text: bool) -> TextMode | None:
    if not text:
        return None
    if not source.info or not source.info.get("path"):
        raise ValueError("text mode needs a tokenizer: TokenSource.from_tokenizer(MODEL_DIR) / --tokenizer MODEL_DIR")
    return TextMode(source.info["path"])


def _context_limit(spec: WorkloadSpec, scale: float) -> int | None:
    """The tighter of the server's max_model_len and the agent's own (scaled) context window."""
    window = spec.limits.context_window_tokens
    limits = [x for x in (spec.limits.max_context_tokens, round(window * scale) if window else None) if x is not None]
    return min(limits) if limits else None


def _generate_session(ctx: _Context, si: int, sid: str, limit: int | None) -> tuple[list[dict], bool]:
    """One session's request rows (prompt segments, output segment, timing, transition); True when the
    context limit ended it early."""
    spec, scale, b = ctx.spec, ctx.scale, ctx.builder
    rng = np.random.default_rng([ctx.seed, 1, si])
    t = _zipf_choice(rng, spec.prefix.tenants, spec.prefix.tenant_popularity_a)
    doc = None
    d = spec.prefix.documents
    if d is not None and rng.random() < d.probability:
        doc = ctx.document(_zipf_choice(rng, d.count, d.popularity_a))
    plan = _plan_session(spec, rng, scale)
    state = SessionState(ctx, ctx.tenant(t), doc, rng)
    salt = {"none": None, "session": f"kvscope-{sid}", "tenant": f"kvscope-t{t}"}[spec.sessions.cache_salt]
    rows: list[dict] = []
    prev_segments: list[int] = []
    prev_len = 0
    offset = 0.0
    for step, p in enumerate(plan):
        hint = _advance_history(state, step, plan, rows, rng)
        segs, messages, n_prompt, static = _prompt(ctx, state)
        if limit is not None and n_prompt + p["output_tokens"] > limit:
            return rows, True
        out_seg = _draw_output(ctx, p, rng)
        transition = Transition.FIRST if step == 0 else classify_transition(
            common_prefix_tokens(b, prev_segments, segs), prev_len, hint=hint)
        offset += p["think"] + p["tool"]
        rows.append({"session_id": sid, "step": step, "offset": offset, "think_time_s": p["think"],
                     "tool_latency_s": p["tool"], "prompt_segment_ids": segs, "output_segment_id": out_seg,
                     "output_tokens": p["output_tokens"], "output_reasoning_tokens": p["reasoning"],
                     "max_tokens": p["output_tokens"], "cache_salt": salt, "tenant": t,
                     "transition": transition, "input_kind": p["input_kind"], "static_prefix_tokens": static,
                     "messages": messages})
        prev_segments, prev_len = segs, n_prompt
    return rows, False


def _advance_history(state: "SessionState", step: int, plan: list[dict], rows: list[dict],
                     rng: np.random.Generator) -> str | None:
    """Append the previous output and this step's input, then run the history policies; returns the
    transition hint (``compaction``) a policy gave, if any."""
    state.step = step
    if step > 0:
        last = rows[-1]
        state.history.append(Item(last["output_segment_id"], plan[step - 1]["output_kind"],
                                  last["output_tokens"], step - 1, plan[step - 1]["reasoning"]))
    p = plan[step]
    state.history.append(state.new_segment(p["input_kind"], p["input_tokens"]))
    hint = None
    for policy in state.ctx.spec.sessions.policies:
        h = policy.apply(state, rng)
        hint = h if h == Transition.COMPACTION else hint
    return hint


def _prompt(ctx: _Context, state: "SessionState") -> tuple[list[int], list | None, int, int]:
    """(prompt segments, chat messages in text mode, prompt tokens, static prefix tokens)."""
    b = ctx.builder
    if ctx.text is not None:
        segs, messages, static = ctx.render(state)
        return segs, messages, sum(b.segment_len(x) for x in segs), static
    static = sum(b.segment_len(x) for x in state.prefix_segments())
    return state.prompt_segments(), None, state.prompt_tokens(), static


def _draw_output(ctx: _Context, p: dict, rng: np.random.Generator) -> int:
    """The step's output segment; text mode may resize the output (``p`` is updated)."""
    if ctx.text is not None:
        out_toks, p["reasoning"] = ctx.text.output(p["output_kind"], p["output_tokens"], p["reasoning"], rng)
        p["output_tokens"] = len(out_toks)
    else:
        out_toks = ctx.source.draw(p["output_kind"], p["output_tokens"], rng)
    return ctx.builder.add_segment(out_toks, p["output_kind"])


def _add_requests(b: TraceBuilder, per_session: list[list[dict]], starts: np.ndarray) -> None:
    for si, rows in enumerate(per_session):
        parent = -1
        for r in rows:
            off = r.pop("offset")
            parent = b.add_request(**r, parent_request_id=parent, session_start_s=float(starts[si]),
                                   arrival_s=float(starts[si] + off))


def _trace_meta(ctx: _Context, seed: int, scale: float, truncated: int) -> dict:
    spec, text_mode = ctx.spec, ctx.text
    return {"name": spec.name, "spec": spec_to_dict(spec), "seed": seed, "scale": scale,
            "tokenizer": ctx.source.info, "block_size_hint": None, "created_by": CREATED_BY,
            "arrival": spec.arrival.model_dump(mode="json"), "truncated_sessions": truncated,
            "text": None if text_mode is None else {
                "chat_template_sha256": text_mode.template.sha256, "template_segments": len(ctx._template_segments),
                "resized_segments": text_mode.resized}}


def generate_from_file(spec_path: str | Path, tokenizer: str | Path | None, seed: int | None = None,
                       scale: float | None = None, sessions: int | None = None, progress: bool = False,
                       max_context: int | None = None, text: bool | None = None,
                       output_scale: float | None = None, max_tokens: int | None = None,
                       budget_hint: str = "") -> Trace:
    """Load a spec file (or preset name) and generate it with the tokenizer in ``tokenizer`` (a model dir)."""
    spec = load_spec(spec_path)
    source = TokenSource.from_tokenizer(tokenizer) if tokenizer else TokenSource.uniform()
    return generate(spec, source, seed=seed, scale=scale, sessions=sessions, progress=progress,
                    max_context=max_context, text=text, output_scale=output_scale, max_tokens=max_tokens,
                    budget_hint=budget_hint)


def synthetic_trace(n_sessions: int, steps: int = 1, prompt_tokens: int = 128, output_tokens: int = 16,
                    think_time_s: float = 0.0, vocab_size: int = 8192, seed: int = 0, last_tokens=None,
                    session_gap_s: float = 0.0) -> Trace:
    """A trace of `n_sessions` x `steps` requests, each prompt its own `prompt_tokens` random ids: no two share
    a prefix, so no request hits the prefix cache and every one costs the same (the load shape of the client
    overhead, sessions and long-run benchmarks, and of tests that need traffic, not a workload).  Ids below 100
    are never drawn, so they can mark requests: `last_tokens(session, step)` may return an id to put last in
    that prompt (the test fault server's `token_faults` key)."""
    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    for s in range(n_sessions):
        parent = -1
        start = s * session_gap_s
        for k in range(steps):
            toks = rng.integers(100, vocab_size, size=prompt_tokens, dtype=np.int32)
            if last_tokens is not None:
                mark = last_tokens(s, k)
                if mark is not None:
                    toks[-1] = mark
            seg = b.add_segment(toks, SegmentKind.USER)
            parent = b.add_request(session_id=f"s{s:06d}", step=k, parent_request_id=parent,
                                   arrival_s=start + k * think_time_s, session_start_s=start,
                                   think_time_s=think_time_s if k else 0.0, prompt_segment_ids=[seg],
                                   output_tokens=output_tokens, max_tokens=output_tokens,
                                   transition=Transition.FIRST if k == 0 else Transition.RESET, tenant=0)
    return b.build({"name": f"synthetic-{n_sessions}x{steps}", "seed": seed,
                    "tokenizer": {"path": None, "sha256": None, "vocab_size": vocab_size}, "spec": {"synthetic": True}})
