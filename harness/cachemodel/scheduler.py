"""A step-level model of vLLM V1's scheduler, for cache behaviour under concurrency.

The sequential simulator (:mod:`.simulator`) is exact when requests run one at a time.  Under load, *which*
blocks survive depends on what the scheduler does step by step, so this module replays
``vllm/v1/core/sched/scheduler.py: Scheduler.schedule`` at the level that decides the cache:

* one ``running`` list and one ``waiting`` deque; each step has a token budget (``max_num_batched_tokens``)
  and the running queue is capped at ``max_num_seqs``;
* RUNNING requests are scheduled first, in order, each for ``min(num_tokens - num_computed, budget)``
  tokens (chunked prefill); when ``allocate_slots`` fails, the *last* running request is preempted by
  recompute (its blocks are freed in reverse order and keep their hashes, so it may hit them when it is
  rescheduled; it goes to the front of ``waiting``), until the allocation fits or the request preempted
  itself;
* WAITING requests are admitted only in a step without preemption, FCFS, while budget and seats last: the
  prefix-cache hit is computed *at schedule time* exactly like the sequential simulator (leading run of
  chained hashes, capped at ``floor((n-1)/B)`` blocks, the free-queue eviction order of :class:`BlockPool`),
  and with ``scheduler_reserve_full_isl`` (vLLM's default) the request's whole current sequence must fit in
  the free blocks; the first failing request stops admission;
* blocks are allocated for the tokens scheduled in the step and full blocks are hashed right away, so a
  request admitted later in the same step can hit them; finished requests free their blocks in reverse order;
* ``cached_tokens`` is fixed the first time a request is scheduled (``num_cached_tokens``), as vLLM reports it.

Time advances by a per-step cost (a :class:`~.step_cost.StepCost`: the calibrated
:class:`~.calibration.StepCostModel` or a GPU's :class:`~.roofline.RooflineStepCost`; tokens, sequences, the
context read by decodes and the (query, key) pairs of prefill chunks), optionally jittered (:class:`TimingNoise`: one
member of an ensemble, ``capacity_model``).  Long runs of identical decode steps
(no arrival, no admission possible, no new block, no finish) are advanced in one go: that is what keeps a
620 M-token trace within seconds, and it is exact because nothing the cache sees changes in between.

With speculative decoding (a request's ``spec_drafted``/``spec_accepted`` from the offline model), a decoding
request is scheduled for ``1 + drafts`` tokens (they count against the token budget and get slots), and after
the step its computed tokens fall back by the rejected drafts: it emits ``1 + accepted`` tokens, as vLLM's
``update_from_output`` does.  Such steps are taken one at a time (no fast-forward), and the step cost is told
how many of its decodes verify drafts and how many drafts (a calibrated n-gram server prices verification
apart from tokens: :mod:`.calibration`).

Session timing follows ``kvscope replay``: closed loop (``concurrency`` sessions at a time, the next one starts
when one ends), open loop (sessions start at their trace times), each later request sent ``gap_s``
(think + tool time, times ``time_scale``) after its predecessor finished; or *pinned* arrivals (a real run's
``sent_s``), the replay-informed mode, optionally with pinned departures too (its ``done_s``) and token pacing
(no decode step before the run's previous token was seen): see :class:`_Pinned`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from kvscope.harness.cachemodel.block_pool import FreeOrder
from kvscope.harness.cachemodel.calibration import prefill_pairs
from kvscope.harness.cachemodel.pool import Pool
from kvscope.harness.cachemodel.pool import make_pool as _make_pool
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.cachemodel.step_cost import StepCost
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE



@dataclass(frozen=True)
class SchedulerConfig:
    """The server settings that decide scheduling, in vLLM's terms (CPU server defaults)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    #: vLLM's ``num_gpu_blocks`` (null block included); None = infinite cache.
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    #: ``scheduler_reserve_full_isl``: admit a waiting request only if its whole sequence fits.
    reserve_full_sequence: bool = True
    free_order: FreeOrder = "split"


@dataclass(frozen=True)
class SessionTiming:
    """How requests reach the server: closed loop (``concurrency``), open loop, or pinned arrival times."""

    concurrency: int | None = None
    time_scale: float = 1.0
    #: Replay-informed: request i arrives at ``arrivals_s[i]`` (a real run's ``sent_s``); no session gating.
    arrivals_s: Sequence[float] | None = None
    #: Replay-informed, with ``arrivals_s``: request i leaves the server (frees its blocks) at the end of the
    #: first step at or after ``done_s[i]`` (the run's ``done_s``, same clock), whatever the cost model says.
    done_s: Sequence[float] | None = None
    #: Replay-informed, with ``done_s``: when each of request i's output tokens reached the client (same clock;
    #: token 1 is the first token).  A decode step for token j+1 is not taken before token j was seen.
    token_times_s: Sequence[Sequence[float]] | None = None


@dataclass(frozen=True)
class TimingNoise:
    """Random timing for one member of an ensemble of scheduler runs.

    Why: under a full KV pool, *which* request is running when the pool runs dry decides who is preempted,
    and that turns on step and arrival times a few milliseconds apart.  One deterministic run therefore
    gives one draw of a chaotic count (preemptions moved from 9 to 20 at concurrency 16 when one cost
    coefficient changed by 2x, with the hit rate unchanged); real runs of one configuration vary as much
    (2-13 at concurrency 8).  An ensemble of runs with the host's timing noise gives the expected count
    and its spread.

    Each step's cost is multiplied by a lognormal factor of mean 1 and coefficient of variation about
    ``step_cv`` (one factor for a fast-forwarded run of identical decode steps), and each request's lag
    from client to scheduler by one with ``lag_cv``.
    """

    step_cv: float = 0.0
    lag_cv: float = 0.0
    seed: int = 0


@dataclass(slots=True)
class ScheduledResult:
    """One request as the scheduler model saw it (times in seconds from the start of the run)."""

    request_id: int
    session_id: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    arrival_s: float = 0.0
    scheduled_s: float = math.nan
    first_token_s: float = math.nan
    done_s: float = math.nan
    preemptions: int = 0
    #: Prefix-cache hits (tokens) found when the request was rescheduled after a preemption.
    resume_hit_tokens: int = 0
    #: False when the request needs more blocks than the whole pool (vLLM rejects it).
    fits: bool = True

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.arrival_s


@dataclass(kw_only=True)
class StepStats:
    """One engine's step statistics over a run: what :func:`run_scheduler` reports beside its results and what
    the routed model (`model_routing_scheduler`) reports per model's server, counted the same way."""

    steps: int = 0
    preemptions: int = 0
    evictions: int = 0
    max_running: int = 0
    #: Seconds the engine was stepping (the makespan less the idle waits for arrivals).
    busy_s: float = 0.0

    def record_steps(self, steps: int, seconds: float, running: int) -> None:
        """``steps`` engine steps that took ``seconds`` with ``running`` sequences running after them."""
        self.steps += steps
        self.busy_s += seconds
        self.max_running = max(self.max_running, running)

    def record_end(self, model: SchedulerModel) -> None:
        """The engine's preemption and eviction counts at the end of the run."""
        self.preemptions = model.preemptions
        self.evictions = model.pool.evictions


@dataclass
class ScheduleRun(StepStats):
    """Per-request results (input order) plus the engine's step statistics."""

    results: list[ScheduledResult]
    config: SchedulerConfig
    makespan_s: float = 0.0
    #: Time-weighted mean and peak of vLLM's ``kv_cache_usage_perc`` (0-1).
    kv_usage_mean: float = 0.0
    kv_usage_max: float = 0.0

    @property
    def cached_tokens(self) -> list[int]:
        return [r.cached_tokens for r in self.results]


class _Seq:
    """A request inside the scheduler: vLLM's ``Request`` fields that matter here."""

    __slots__ = ("idx", "req", "hashes", "num_tokens", "num_computed", "blocks", "n_hashed", "generated",
                 "res", "first_scheduled", "spec_step", "spec_accept")

    def __init__(self, idx: int, req: SimRequest, res: ScheduledResult, B: int) -> None:
        self.idx = idx
        self.req = req
        self.hashes = req.full_hashes(req.finished_blocks(B)[1])
        self.num_tokens = req.prompt_tokens
        self.num_computed = 0
        self.blocks: list[int] = []
        self.n_hashed = 0
        self.generated = 0
        self.res = res
        self.first_scheduled = False
        #: Speculation: the request's next decode step (index into its drafts) and, for a step in flight, the
        #: drafts it will accept (-1: none in flight).
        self.spec_step = 0
        self.spec_accept = -1

    def spec_tokens(self, budget: int) -> int:
        """Draft tokens scheduled with this decode step (0 without speculation), capped by the budget; records
        how many of them will be accepted."""
        drafted = self.req.spec_drafted
        if drafted is None or self.spec_step >= len(drafted) or budget <= 1:
            return 0
        d = min(int(drafted[self.spec_step]), budget - 1)
        self.spec_accept = min(int(self.req.spec_accepted[self.spec_step]), d)  # type: ignore[index]
        self.spec_step += 1
        return d


def make_pool(config: "SchedulerConfig", reference: bool = False) -> Pool:
    """The pool for ``config`` (:func:`~.pool.make_pool`): unbounded, the ring pool, or the reference pool."""
    return _make_pool(config.num_gpu_blocks, config.free_order, reference=reference)


class SchedulerModel:
    """Runs requests through one modelled vLLM instance; see the module docstring for the semantics."""

    def __init__(self, config: SchedulerConfig, cost: StepCost, *, reference_pool: bool = False) -> None:
        self.cfg = config
        self.cost = cost
        self.pool: Pool = make_pool(config, reference_pool)
        self.running: list[_Seq] = []
        self.waiting: deque[_Seq] = deque()
        self.preemptions = 0

    # -- one step -------------------------------------------------------------------------------------
    def _grow(self, s: _Seq, n_tokens: int) -> bool:
        """``allocate_slots`` for a running request: blocks for ``num_computed + n_tokens``, hash full ones."""
        B = self.cfg.block_size
        need = -(-(s.num_computed + n_tokens) // B) - len(s.blocks)
        pool = self.pool
        if need > 0:
            if need > pool.num_free:
                return False
            s.blocks.extend(pool.allocate(need))
        self._hash_full(s, min(s.num_computed + n_tokens, s.num_tokens))
        return True

    def _hash_full(self, s: _Seq, n_tokens: int) -> None:
        full = min(n_tokens // self.cfg.block_size, len(s.hashes))
        if full > s.n_hashed:
            self.pool.cache_blocks(s.blocks[s.n_hashed:full], s.hashes[s.n_hashed:full])
            s.n_hashed = full

    def _preempt(self, s: _Seq) -> None:
        self.pool.free(s.blocks, s.n_hashed)
        s.blocks = []
        s.n_hashed = 0
        s.num_computed = 0
        if s.spec_accept >= 0:  # preempted before its verifying step ran: the drafts are proposed again
            s.spec_step -= 1
            s.spec_accept = -1
        s.res.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(s)

    def _admit(self, s: _Seq, budget: int) -> int:
        """Try to schedule waiting ``s`` with ``budget`` tokens; returns the tokens scheduled (0: stop)."""
        B = self.cfg.block_size
        pool = self.pool
        n = s.num_tokens
        k, hits = pool.find_hits(s.hashes, (n - 1) // B, s.req.session_id)
        new_tokens = n - k * B
        if not self.cfg.enable_chunked_prefill and new_tokens > budget:
            return 0
        new_tokens = min(new_tokens, budget)
        evictable = pool.evictable(hits) if k else 0
        total = -(-n // B) if self.cfg.reserve_full_sequence else -(-(k * B + new_tokens) // B)
        if total - k + evictable > pool.num_free:
            return 0
        s.blocks = pool.take(hits)
        s.n_hashed = k
        s.num_computed = k * B
        s.blocks.extend(pool.allocate(-(-(k * B + new_tokens) // B) - k))
        self._hash_full(s, min(s.num_computed + new_tokens, s.num_tokens))
        if not s.first_scheduled:
            s.first_scheduled = True
            s.res.cached_tokens = k * B
        else:
            s.res.resume_hit_tokens += k * B
        return new_tokens

    def schedule(self, now: float, not_due=None) -> list[tuple[_Seq, int]]:
        """One ``Scheduler.schedule()`` call: the (request, tokens) pairs of the step, in batch order.
        ``not_due(s, now)`` (replay-informed pacing) leaves a running request out of this step."""
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            s = running[i]
            if not_due is not None and not_due(s, now):
                i += 1
                continue
            n = min(s.num_tokens - s.num_computed, budget)
            if s.generated and n == 1 and s.req.spec_drafted is not None:
                n += s.spec_tokens(budget)
            ok = self._grow(s, n)
            while not ok:
                victim = running.pop()  # FCFS: the last running request (never one already scheduled)
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
                ok = self._grow(s, n)
            if not ok:
                break
            scheduled.append((s, n))
            budget -= n
            i += 1
        if not preempted:
            while self.waiting and budget > 0 and len(running) < self.cfg.max_num_seqs:
                s = self.waiting[0]
                n = self._admit(s, budget)
                if n == 0:
                    break
                self.waiting.popleft()
                running.append(s)
                if math.isnan(s.res.scheduled_s):
                    s.res.scheduled_s = now
                scheduled.append((s, n))
                budget -= n
        return scheduled

    def finish(self, s: _Seq, running: bool = True) -> None:
        arr = self.pool.free(s.blocks, s.n_hashed)
        n = s.n_hashed
        self.pool.remember(s.req.session_id, s.hashes[:n], s.blocks[:n] if arr is None else arr[:n])
        s.blocks = []
        if running:
            self.running.remove(s)


def _sessions_in_order(reqs: Sequence[SimRequest]) -> list[list[int]]:
    """Request indices per session (trace order within a session), sessions ordered by first arrival."""
    by: dict[object, list[int]] = {}
    for i, r in enumerate(reqs):
        by.setdefault(r.session_id if r.session_id is not None else ("__req", i), []).append(i)
    groups = list(by.values())
    groups.sort(key=lambda g: (reqs[g[0]].arrival_s, g[0]))
    return groups


@dataclass
class _Clock:
    """Arrivals not yet released to the scheduler: a heap of (time, order, request index)."""

    heap: list[tuple[float, int, int]] = field(default_factory=list)
    order: itertools.count = field(default_factory=itertools.count)

    def push(self, t: float, idx: int) -> None:
        heapq.heappush(self.heap, (t, next(self.order), idx))

    def next_time(self) -> float:
        return self.heap[0][0] if self.heap else math.inf


def _first_arrivals(reqs: list[SimRequest], timing: SessionTiming, send
                    ) -> tuple[dict[int, int], deque[list[int]], set[int]]:
    """Sends the arrivals known at the start (``send(t, idx)``) and returns what releases the rest: (session
    successor of each request, sessions not yet started (closed loop), last request of each session)."""
    successor: dict[int, int] = {}
    session_queue: deque[list[int]] = deque()
    session_last: set[int] = set()
    if timing.arrivals_s is not None:
        for i, t in enumerate(timing.arrivals_s):
            send(float(t), i)
        return successor, session_queue, session_last
    groups = _sessions_in_order(reqs)
    for g in groups:
        successor.update(zip(g, g[1:]))
        session_last.add(g[-1])
    if timing.concurrency is not None:
        session_queue.extend(groups)
        for _ in range(min(timing.concurrency, len(groups))):
            send(0.0, session_queue.popleft()[0])
    else:
        t0 = min((reqs[g[0]].arrival_s for g in groups), default=0.0)
        for g in groups:
            send((reqs[g[0]].arrival_s - t0) * timing.time_scale, g[0])
    return successor, session_queue, session_last


def run_scheduler(requests: Sequence[SimRequest], config: SchedulerConfig, cost: StepCost,
                  timing: SessionTiming = SessionTiming(), *, fast_forward: bool = True,
                  reference_pool: bool = False, noise: TimingNoise | None = None) -> ScheduleRun:
    """Simulate the requests through one vLLM instance step by step; results are in input order.

    ``fast_forward=False`` takes every decode step one at a time and ``reference_pool=True`` uses
    :class:`BlockPool` instead of the ring pool (for tests: the results must not change).  ``noise`` makes
    this run one member of an ensemble (:class:`TimingNoise`).
    """
    reqs = list(requests)
    if reqs and reqs[0].block_size != config.block_size:
        raise ValueError(f"requests were hashed with block size {reqs[0].block_size}, config has "
                         f"{config.block_size}")
    B = config.block_size
    model = SchedulerModel(config, cost, reference_pool=reference_pool)
    results = [ScheduledResult(r.request_id, r.session_id, r.prompt_tokens, max(r.output_tokens, 1))
               for r in reqs]
    lag = cost.request_overhead_s  # a request reaches the scheduler this long after it was sent
    rng = random.Random(noise.seed) if noise is not None else None
    sent_s = [0.0] * len(reqs)
    clock = _Clock()

    def send(t: float, idx: int) -> None:
        """Request idx leaves the client at t and reaches the scheduler ``lag`` later (jittered by noise)."""
        sent_s[idx] = t
        jitter = rng.lognormvariate(-noise.lag_cv ** 2 / 2, noise.lag_cv) if rng and noise.lag_cv else 1.0
        clock.push(t + lag * jitter, idx)

    successor, session_queue, session_last = _first_arrivals(reqs, timing, send)
    usable = (config.num_gpu_blocks - 1) if config.num_gpu_blocks is not None else None

    pinned = _Pinned(timing.done_s, model, timing.token_times_s) if timing.done_s is not None else None
    not_due = pinned.not_due if pinned is not None and pinned.token_times_s is not None else None

    def on_done(idx: int, t: float) -> None:
        nxt = successor.get(idx)
        if nxt is not None:
            send(t + (reqs[nxt].gap_s or 0.0) * timing.time_scale, nxt)
        elif idx in session_last and session_queue:
            send(t, session_queue.popleft()[0])

    run = ScheduleRun(results, config)
    now = 0.0
    usage_area = 0.0
    while True:
        if pinned is not None:
            pinned.release(now, on_done)
        while clock.heap and clock.heap[0][0] <= now:
            t, _, idx = heapq.heappop(clock.heap)
            r, res = reqs[idx], results[idx]
            res.arrival_s = sent_s[idx]
            if usable is not None and r.finished_blocks(B)[0] > usable:
                res.fits = False
                res.scheduled_s = res.first_token_s = res.done_s = res.arrival_s
                on_done(idx, t)
                continue
            model.waiting.append(_Seq(idx, r, res, B))
        next_event_s = clock.next_time() if pinned is None else min(clock.next_time(), pinned.next_time(now))
        if not model.running and not model.waiting:
            if next_event_s == math.inf:
                break
            now = next_event_s
            continue
        n_preempt, n_wait = model.preemptions, len(model.waiting)
        batch = model.schedule(now, not_due)
        if not batch:  # nothing fits until something arrives (cannot happen with an empty pool)
            if next_event_s == math.inf:
                raise RuntimeError("scheduler model stalled with requests waiting")
            now = next_event_s
            continue
        steady = (model.preemptions == n_preempt and len(model.waiting) == n_wait
                  and len(batch) == len(model.running) and not_due is None)
        scale = rng.lognormvariate(-noise.step_cv ** 2 / 2, noise.step_cv) if rng and noise.step_cv else 1.0
        k_steps, dt = _advance(model, batch, cost, now, next_event_s, steady and fast_forward, scale)
        usage_area += model.pool.usage() * dt
        run.kv_usage_max = max(run.kv_usage_max, model.pool.usage())
        run.record_steps(k_steps, dt, len(model.running))
        now += dt
        for s, n in batch:
            _after_step(model, s, n, k_steps, now, on_done, pinned)
        if pinned is not None:
            pinned.force_finish(now, on_done)
    run.record_end(model)
    run.makespan_s = now
    run.kv_usage_mean = usage_area / now if now > 0 else 0.0
    return run


def _advance(model: SchedulerModel, batch: list[tuple[_Seq, int]], cost: StepCost, now: float,
             next_arrival_s: float, steady: bool, scale: float = 1.0) -> tuple[int, float]:
    """(steps, seconds) to advance: 1 step, or a run of decode steps that ends at the first finish, at the
    step that sees the next arrival, or before the step whose new blocks would not fit.

    Inside the run nothing the scheduler decides can differ from step-by-step: every running request decodes
    one token a step, waiting requests stay blocked (free blocks only shrink, and hits only shrink with
    them), and the decode blocks are popped from the free queue in vLLM's order (step, then running order).
    ``scale`` multiplies every step's cost (a noise draw: one for the whole run of steps).
    """
    m = len(batch)
    tokens = ctx = spec_seqs = drafts = 0
    pairs = 0.0
    for s, n in batch:
        tokens += n
        if s.num_computed + 1 >= s.num_tokens:  # a decode (with any drafts): reads its whole context
            ctx += s.num_computed + 1
            if n > 1:  # it verifies n - 1 drafts
                spec_seqs += 1
                drafts += n - 1
        else:
            pairs += prefill_pairs(n, s.num_computed)
    dt = (cost.step_s(tokens, m, ctx, pairs, spec_seqs, drafts) if spec_seqs
          else cost.step_s(tokens, m, ctx, pairs)) * scale
    if not steady or tokens != m or now + dt >= next_arrival_s:
        return 1, dt
    k_max = 1 + min(s.res.output_tokens - s.generated - 1 for s, _ in batch)
    if k_max <= 1 or any(s.generated == 0 or s.req.spec_drafted is not None for s, _ in batch):
        return 1, dt  # (a speculative request emits 1 + accepted tokens a step: stepped one at a time)
    def elapsed(k: int) -> float:  # seconds of steps 0 .. k-1 (step j attends ctx + m*j)
        return dt + cost.decode_run_s(m, ctx, k - 1) * scale

    k = k_max
    if now + elapsed(k_max - 1) >= next_arrival_s:  # stop at the first step that ends at/after the arrival
        lo, hi = 1, k_max - 1  # now + elapsed(lo) < arrival <= now + elapsed(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if now + elapsed(mid) < next_arrival_s:
                lo = mid
            else:
                hi = mid
        k = hi
    total = elapsed(k)
    B = model.cfg.block_size
    events: list[tuple[int, int]] = []  # (step, batch position) of each decode block allocation
    for pos, (s, _) in enumerate(batch):
        c_0 = s.num_computed  # this step computes token c_0; step j computes c_0 + j
        first = (c_0 // B + 1) * B  # the next token index that opens a new block
        events.extend((p - c_0, pos) for p in range(first, c_0 + k, B))
    if events:
        events.sort()
        free = model.pool.num_free
        if len(events) > free:
            k = events[free][0]
            total = elapsed(k)
        events = [e for e in events if e[0] < k]
        # the blocks come off the free queue's front in event order: one pop for all of them
        for (_, pos), b in zip(events, model.pool.allocate(len(events))):
            batch[pos][0].blocks.append(b)
    return k, total


def _after_step(model: SchedulerModel, s: _Seq, n: int, k_steps: int, now: float, on_done,
                pinned: "_Pinned | None" = None) -> None:
    """``update_from_output`` for one scheduled request after ``k_steps`` steps of ``n`` tokens each."""
    s.num_computed += n * k_steps
    if s.num_computed < s.num_tokens:
        return  # a prefill chunk: no token sampled
    emitted = k_steps
    if s.spec_accept >= 0:  # a verifying step: the rejected drafts are computed again
        s.num_computed -= n - 1 - s.spec_accept
        emitted = 1 + s.spec_accept
        s.spec_accept = -1
    s.generated += emitted
    s.num_tokens += emitted
    if k_steps > 1:
        model._hash_full(s, s.num_computed)
    res = s.res
    if math.isnan(res.first_token_s):
        res.first_token_s = now
    if s.generated >= res.output_tokens:
        if pinned is not None and pinned.park(s, now):
            return
        _depart(model, s, now, on_done)


def _depart(model: SchedulerModel, s: _Seq, now: float, on_done, running: bool = True) -> None:
    """A request leaves the server at ``now``: its blocks are freed and its session's next request released."""
    s.res.done_s = now
    model.finish(s, running=running)
    on_done(s.idx, now)


class _Pinned:
    """Pinned departures (replay-informed): a request frees its blocks at the first step end at or after its
    observed ``done_s``.  One that has generated its tokens earlier stays resident, holding its blocks and
    taking no step (*parked*); one still running then is finished there.

    Why: at loads that preempt, which blocks survive depends on how many requests hold blocks at each lookup.
    The cost model's step times drift from the run's (a loaded host, calibration at another load), and with
    them every request's lifetime; pinning the observed departures keeps the blocks held as the server held
    them, while allocation, hits, eviction order and preemption stay the scheduler model's.
    """

    def __init__(self, done_s: Sequence[float], model: SchedulerModel,
                 token_times_s: Sequence[Sequence[float]] | None = None) -> None:
        self.done_s = [float(t) for t in done_s]
        self.model = model
        self.parked: list[tuple[float, int, _Seq]] = []
        self.token_times_s = token_times_s

    def _seen_s(self, s: _Seq) -> float:
        """When the client saw the request's last generated token (its newest), or -inf if not known."""
        times = self.token_times_s[s.idx]  # type: ignore[index]
        j = s.generated - 1
        if j < 0 or not len(times):
            return -math.inf
        return float(times[min(j, len(times) - 1)])

    def not_due(self, s: _Seq, now: float) -> bool:
        """Pacing: a decoding request whose newest token had not reached the client by ``now`` waits.
        On the server the step for token j+1 starts once token j is out; a model step that runs ahead of the
        run would otherwise allocate decode blocks (and finish) early and hold them against admissions."""
        return s.generated > 0 and self._seen_s(s) > now

    def park(self, s: _Seq, now: float) -> bool:
        t = self.done_s[s.idx]
        if not t > now:
            return False
        self.model.running.remove(s)
        heapq.heappush(self.parked, (t, s.idx, s))
        return True

    def next_time(self, now: float = -math.inf) -> float:
        """The next pinned departure of a parked or running request (or, pacing, the next token seen after
        ``now``)."""
        t = self.parked[0][0] if self.parked else math.inf
        running = self.model.running
        t = min([t, *(self.done_s[s.idx] for s in running)])
        if self.token_times_s is not None:
            t = min([t, *(x for x in map(self._seen_s, running) if x > now)])
        return t

    def release(self, now: float, on_done) -> None:
        while self.parked and self.parked[0][0] <= now:
            _, _, s = heapq.heappop(self.parked)
            _depart(self.model, s, now, on_done, running=False)

    def force_finish(self, now: float, on_done) -> None:
        """Finish the running requests whose departure has come.  The tokens the model has not generated yet
        still take their blocks first (as many as are free): on the server they were generated, and every
        block they took came off the free queue's front, evicting what was cached there."""
        model = self.model
        B = model.cfg.block_size
        for s in [s for s in model.running if self.done_s[s.idx] <= now]:
            if math.isnan(s.res.first_token_s):
                s.res.first_token_s = now
            final_tokens = s.req.prompt_tokens + s.res.output_tokens - 1
            need = min(-(-final_tokens // B) - len(s.blocks), model.pool.num_free)
            if need > 0:
                s.blocks.extend(model.pool.allocate(need))
            model._hash_full(s, min(final_tokens, len(s.blocks) * B))
            _depart(model, s, now, on_done)
