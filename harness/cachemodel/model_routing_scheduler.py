"""Model routing under concurrency: one scheduler model per model, sessions moving between them.

:func:`~.model_routing.simulate_routes` is exact when requests run one at a time.  Under concurrency each
model is its own vLLM server with its own scheduler and KV pool (:class:`~.scheduler.SchedulerModel`: chunked
prefill, preemption, eviction order), and which blocks survive on one depends on when the other finished the
session's previous step.  So the servers are coupled only through the sessions: a session's request is sent to
the model its route names, a cascade's escalation is sent to the large model the moment the small model's
answer is done, and the session's next request follows the last attempt after its gap.

Why one event loop rather than one :func:`~.scheduler.run_scheduler` per model: a model's arrivals depend on the
other model's finish times.  The loop keeps a clock per server and always advances the server whose next step
starts first; a step never sees an arrival later than its start (as on the server, a request arriving mid-step
waits for the next one), and a run of identical decode steps is fast-forwarded no further than the next step of
any other busy server, the earliest moment an arrival it causes could exist.  With every attempt on one model the
other servers stay idle and the loop is :func:`~.scheduler.run_scheduler`'s, step for step (a property test
checks the predictions are equal).

With pinned times (a recorded run's per-attempt send and finish times, the replay-informed mode) the servers are
independent: each runs :func:`~.scheduler.run_scheduler` on its own attempts (:func:`run_routed_pinned`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvscope.harness.cachemodel.model_routing import (
    Attempt,
    ModelRoutingSpec,
    RequestFacts,
    RoutedRequest,
    _attempt_request,
)
from kvscope.harness.cachemodel.scheduler import (
    ScheduledResult,
    SchedulerConfig,
    SchedulerModel,
    StepStats,
    SessionTiming,
    _advance,
    _after_step,
    _Clock,
    _Seq,
    _sessions_in_order,
    run_scheduler,
)
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.cachemodel.step_cost import StepCost


@dataclass
class RoutedScheduleRun:
    """Per request (trace order) the routed prediction, with each attempt's scheduler result beside it."""

    routed: list[RoutedRequest]
    attempts: list[list[ScheduledResult]]
    servers: dict[str, StepStats] = field(default_factory=dict)
    makespan_s: float = 0.0


@dataclass
class _Server:
    model: SchedulerModel
    cost: StepCost
    reqs: list[SimRequest] = field(default_factory=list)
    results: list[ScheduledResult] = field(default_factory=list)
    owner: list[tuple[int, int]] = field(default_factory=list)  # local index -> (request index, attempt)
    clock: _Clock = field(default_factory=_Clock)
    now: float = 0.0
    blocked: bool = False
    stats: StepStats = field(default_factory=StepStats)

    @property
    def busy(self) -> bool:
        return bool(self.model.running) or (bool(self.model.waiting) and not self.blocked)

    def next_start(self) -> float:
        """When this server's next step starts: now while it has work, else at its next arrival."""
        return self.now if self.busy else max(self.now, self.clock.next_time())


def _attempt_sim_requests(attempts: Sequence[Sequence[Attempt]], facts: Sequence[RequestFacts],
                          requests_by_block: dict[int, list[SimRequest]], spec: ModelRoutingSpec
                          ) -> list[list[SimRequest]]:
    """Each attempt as the scheduler sees it: a served attempt is the trace's request; a discarded one keeps only
    its prompt blocks (its answer is not the history's) and decodes the small model's answer length."""
    bs = {m.name: m.block_size for m in spec.models}
    col = getattr(spec.policy, "output_column", None)
    out = []
    for atts, r in zip(attempts, facts):
        row = []
        for a in atts:
            req = _attempt_request(requests_by_block[bs[a.model]][a.index], a.served)
            if not a.served:
                n = r.columns.get(col) if col else None
                if n is not None and int(n) != req.output_tokens:
                    req = SimRequest(req.request_id, req.prompt_tokens, int(n), req.hashes, req.block_size,
                                     session_id=req.session_id, arrival_s=req.arrival_s, gap_s=req.gap_s,
                                     cache_salt=req.cache_salt)
            row.append(req)
        out.append(row)
    return out


def run_routed_scheduler(attempts: Sequence[Sequence[Attempt]], facts: Sequence[RequestFacts],
                         requests_by_block: dict[int, list[SimRequest]], spec: ModelRoutingSpec,
                         configs: dict[str, SchedulerConfig], costs: dict[str, StepCost],
                         timing: SessionTiming | None = None, *, fast_forward: bool = True) -> RoutedScheduleRun:
    """Every attempt through its model's scheduler model, sessions closed-loop (``timing.concurrency``) or
    open-loop (their trace arrival times), as ``kvscope replay`` sends them; see the module doc.  ``configs`` and
    ``costs``: each model's server settings (its block size must be the spec's) and step costs."""
    timing = timing if timing is not None else SessionTiming()
    if timing.arrivals_s is not None:
        raise ValueError("pinned arrivals: use run_routed_pinned (the servers are independent then)")
    names = spec.model_names
    for m in spec.models:
        if configs[m.name].block_size != m.block_size:
            raise ValueError(f"model {m.name}: scheduler block size {configs[m.name].block_size} is not the spec's "
                             f"{m.block_size}")
    servers = {n: _Server(SchedulerModel(configs[n], costs[n]), costs[n]) for n in names}
    sims = _attempt_sim_requests(attempts, facts, requests_by_block, spec)
    local: list[list[int]] = []
    for i, (atts, row) in enumerate(zip(attempts, sims)):
        ids = []
        for k, (a, req) in enumerate(zip(atts, row)):
            s = servers[a.model]
            ids.append(len(s.reqs))
            s.reqs.append(req)
            s.results.append(ScheduledResult(req.request_id, req.session_id, req.prompt_tokens,
                                             max(req.output_tokens, 1)))
            s.owner.append((i, k))
        local.append(ids)
    sent_s: dict[tuple[str, int], float] = {}
    first_bs = spec.models[0].block_size
    trace_reqs = requests_by_block[first_bs]
    bs = {m.name: m.block_size for m in spec.models}
    # what the session's previous model held of a request's prompt when its first attempt arrived
    had: list[int] = [0] * len(facts)
    prev_model: list[str | None] = [None] * len(facts)
    last_model: dict[Any, str] = {}

    def send(t: float, i: int, k: int) -> None:
        a = attempts[i][k]
        s = servers[a.model]
        idx = local[i][k]
        sent_s[(a.model, idx)] = t
        s.clock.push(t + s.cost.request_overhead_s, idx)

    groups = _sessions_in_order(trace_reqs)
    successor = {g[j]: g[j + 1] for g in groups for j in range(len(g) - 1)}
    session_last = {g[-1] for g in groups}
    queue: deque[list[int]] = deque()
    if timing.concurrency is not None:
        queue.extend(groups)
        for _ in range(min(timing.concurrency, len(groups))):
            send(0.0, queue.popleft()[0], 0)
    else:
        t0 = min((trace_reqs[g[0]].arrival_s for g in groups), default=0.0)
        for g in groups:
            send((trace_reqs[g[0]].arrival_s - t0) * timing.time_scale, g[0], 0)

    def on_done_of(model: str):
        def on_done(idx: int, t: float) -> None:
            i, k = servers[model].owner[idx]
            if k + 1 < len(attempts[i]):  # an escalation: the same prompt to the next model, at once
                send(t, i, k + 1)
                return
            nxt = successor.get(i)
            if nxt is not None:
                send(t + (trace_reqs[nxt].gap_s or 0.0) * timing.time_scale, nxt, 0)
            elif i in session_last and queue:
                send(t, queue.popleft()[0], 0)
        return on_done

    done_fns = {n: on_done_of(n) for n in names}
    while True:
        starts = {n: s.next_start() for n, s in servers.items()}
        name = min(names, key=lambda n: starts[n])
        if starts[name] == math.inf:
            if any(s.model.waiting or s.model.running for s in servers.values()):
                raise RuntimeError("routed scheduler model stalled with requests waiting")
            break
        s = servers[name]
        model, on_done = s.model, done_fns[name]
        s.now = starts[name]
        B = model.cfg.block_size
        usable = (model.cfg.num_gpu_blocks - 1) if model.cfg.num_gpu_blocks is not None else None
        while s.clock.heap and s.clock.heap[0][0] <= s.now:
            t, _, idx = heapq.heappop(s.clock.heap)
            r, res = s.reqs[idx], s.results[idx]
            res.arrival_s = sent_s[(name, idx)]
            s.blocked = False
            i, k = s.owner[idx]
            if k == 0:  # the request's first attempt: what the session's previous model holds of it now
                key = facts[i].session_id if facts[i].session_id is not None else f"#{facts[i].request_id}"
                prev = last_model.get(key)
                prev_model[i] = prev
                if prev is not None:
                    p = servers[prev]
                    preq = requests_by_block[bs[prev]][i]
                    had[i] = p.model.pool.find_hits(preq.hashes, preq.hit_cap_blocks(bs[prev]),
                                                    preq.session_id)[0] * bs[prev]
                last_model[key] = attempts[i][-1].model
            if usable is not None and r.finished_blocks(B)[0] > usable:
                res.fits = False
                res.scheduled_s = res.first_token_s = res.done_s = res.arrival_s
                on_done(idx, t)
                continue
            model.waiting.append(_Seq(idx, r, res, B))
        if not model.running and not model.waiting:
            continue
        others = min((starts[n] for n in names if n != name and servers[n].busy), default=math.inf)
        next_event_s = min(s.clock.next_time(), others)
        n_preempt, n_wait = model.preemptions, len(model.waiting)
        batch = model.schedule(s.now)
        if not batch:  # nothing fits until something arrives
            s.blocked = True
            continue
        steady = (model.preemptions == n_preempt and len(model.waiting) == n_wait
                  and len(batch) == len(model.running))
        k_steps, dt = _advance(model, batch, s.cost, s.now, next_event_s, steady and fast_forward)
        s.stats.record_steps(k_steps, dt, len(model.running))
        s.now += dt
        for seq, n in batch:
            _after_step(model, seq, n, k_steps, s.now, on_done)
    for s in servers.values():
        s.stats.record_end(s.model)
    return RoutedScheduleRun(_routed(attempts, facts, servers, local, had, prev_model, sims),
                             [[servers[a.model].results[local[i][k]] for k, a in enumerate(atts)]
                              for i, atts in enumerate(attempts)],
                             {n: s.stats for n, s in servers.items()}, max(s.now for s in servers.values()))


def _routed(attempts, facts, servers, local, had, prev_model, sims) -> list[RoutedRequest]:
    out = []
    for i, (atts, r) in enumerate(zip(attempts, facts)):
        rr = RoutedRequest(r.request_id, r.session_id, r.step, atts[-1].model, atts[-1].reason, len(atts) > 1,
                           r.prompt_tokens, r.output_tokens, 0)
        prev = prev_model[i]
        for k, a in enumerate(atts):
            rr.add_attempt(a.model, a.served, servers[a.model].results[local[i][k]].cached_tokens, prev, had[i],
                           sims[i][k].output_tokens)
        out.append(rr)
    return out


def run_routed_pinned(attempts: Sequence[Sequence[Attempt]], facts: Sequence[RequestFacts],
                      requests_by_block: dict[int, list[SimRequest]], spec: ModelRoutingSpec,
                      configs: dict[str, SchedulerConfig], costs: dict[str, StepCost],
                      sent_s: Sequence[Sequence[float]], done_s: Sequence[Sequence[float]] | None = None
                      ) -> dict[str, list[tuple[int, int, ScheduledResult]]]:
    """Replay-informed: attempt ``k`` of request ``i`` arrives at ``sent_s[i][k]`` (and leaves at
    ``done_s[i][k]``), a recorded routed run's clock; the servers share nothing then, so each model's attempts
    go through :func:`~.scheduler.run_scheduler` alone.  Per model: (request index, attempt, result)."""
    sims = _attempt_sim_requests(attempts, facts, requests_by_block, spec)
    out: dict[str, list[tuple[int, int, ScheduledResult]]] = {}
    for m in spec.model_names:
        mine = [(i, k) for i, atts in enumerate(attempts) for k, a in enumerate(atts) if a.model == m]
        if not mine:
            out[m] = []
            continue
        timing = SessionTiming(arrivals_s=[sent_s[i][k] for i, k in mine],
                               done_s=[done_s[i][k] for i, k in mine] if done_s is not None else None)
        run = run_scheduler([sims[i][k] for i, k in mine], configs[m], costs[m], timing)
        out[m] = [(i, k, res) for (i, k), res in zip(mine, run.results)]
    return out


__all__ = ["RoutedScheduleRun", "run_routed_pinned", "run_routed_scheduler"]
