"""When a replay sends what: sessions started open-loop (trace start times, or Poisson/gamma at a rate) or
closed-loop (N sessions at a time), and within a session step n+1 sent only after step n finished plus its
think time / tool latency (scaled by ``time_scale``).  In ``live`` mode a session's later prompts carry the
tokens the server actually generated for its earlier outputs.

The request itself (body, retries, record) is the request loop's (``request_loop.py``); this module only
decides when, so a new arrival process or loop shape changes this file alone.
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

import numpy as np

from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.request_loop import RequestLoop
from kvscope.harness.replay.run_state import RunState
from kvscope.workloads.arrivals import arrival_offsets_s

#: (session id, planned start s, request ids in step order)
SessionPlan = tuple[str, float, list[int]]


def session_plan(trace) -> list[SessionPlan]:
    """(session_id, planned start, request ids in step order), ordered by planned start."""
    df = trace.requests[["request_id", "session_id", "step", "session_start_s"]]
    out = []
    for sid, g in df.groupby("session_id", sort=False):
        g = g.sort_values("step")
        out.append((str(sid), float(g["session_start_s"].iloc[0]), g["request_id"].astype(int).tolist()))
    out.sort(key=lambda s: (s[1], s[2][0]))
    return out


def session_starts(n: int, opts: ReplayOptions, planned: Sequence[float]) -> list[float]:
    """Start offsets (s) of each session for open-loop replays."""
    if opts.session_rate is None:
        base = min(planned) if planned else 0.0
        return [(p - base) * opts.time_scale for p in planned]
    rng = np.random.default_rng(opts.seed)
    return arrival_offsets_s(rng, n, opts.session_rate, opts.arrival_process, opts.arrival_cv).tolist()


class SessionDriver:
    """Runs the sessions of a trace through a :class:`RequestLoop`, closed- or open-loop per the options."""

    def __init__(self, trace, opts: ReplayOptions, requests: RequestLoop) -> None:
        self.trace = trace
        self.opts = opts
        self.requests = requests
        df = trace.requests
        self._delay = (df["think_time_s"].fillna(0).to_numpy(float) +
                       df["tool_latency_s"].fillna(0).to_numpy(float)).tolist()

    async def run(self, session, st: RunState, sessions: list[SessionPlan]) -> None:
        if self.opts.concurrency is not None:
            await self._closed_loop(session, st, sessions)
        else:
            await self._open_loop(session, st, sessions)

    async def _session(self, session, st: RunState, session_id: str, rids: list[int], start_s: float) -> None:
        trace, opts = self.trace, self.opts
        substitute: dict[int, list[int]] = {}
        ready_at = start_s
        scale = opts.time_scale
        for k, rid in enumerate(rids):
            if k > 0:
                delay = self._delay[rid] * scale
                ready_at = (time.perf_counter() - st.t0) + delay
                if delay > 0:
                    await asyncio.sleep(delay)  # a timer on the loop, not a thread
            if not st.may_send():
                return
            prompt = trace.prompt_token_ids(rid, substitute if (opts.mode == "live" and substitute) else None)
            res = await self.requests.send(st, rid, session_id, prompt, ready_at)
            if not res.ok:
                await self.requests.check_alive(session, st, res)
                if opts.on_error == "end_session" or st.stop:
                    return
                continue
            if opts.mode == "live":
                out_seg = trace.output_segment_id(rid)
                if out_seg >= 0:
                    substitute[out_seg] = res.token_ids

    async def _closed_loop(self, session, st: RunState, sessions: list[SessionPlan]) -> None:
        queue = list(reversed(sessions))

        async def worker() -> None:
            while queue and st.may_send():
                sid, _, rids = queue.pop()
                st.active_sessions += 1
                try:
                    await self._session(session, st, sid, rids, time.perf_counter() - st.t0)
                finally:
                    st.active_sessions -= 1

        n = self.opts.concurrency or 1
        await asyncio.gather(*(worker() for _ in range(min(n, len(sessions)))))

    async def _open_loop(self, session, st: RunState, sessions: list[SessionPlan]) -> None:
        starts = session_starts(len(sessions), self.opts, [s[1] for s in sessions])
        limit = asyncio.Semaphore(self.opts.max_active_sessions) if self.opts.max_active_sessions else None
        tasks: set[asyncio.Task] = set()

        async def run_one(sid: str, rids: list[int], start: float) -> None:
            if limit is not None:
                await limit.acquire()
            st.active_sessions += 1
            try:
                await self._session(session, st, sid, rids, start)
            finally:
                st.active_sessions -= 1
                if limit is not None:
                    limit.release()

        for (sid, _, rids), start in zip(sessions, starts):
            delay = start - (time.perf_counter() - st.t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if not st.may_send():
                break
            t = asyncio.create_task(run_one(sid, rids, start))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
