"""Replay a trace's sessions through one or more vLLM endpoints with real agent/user timing.

Within a session, step n+1 is sent only after step n finished plus its think time / tool latency (scaled
by `time_scale`). Sessions start open-loop (trace start times, or Poisson/gamma at a rate) or closed-loop
(N sessions at a time). Every request becomes a record on disk the moment it completes; the server's
`/metrics` is watched throughout. A server that stops answering ends the run with a clear error, and the
records written so far are compacted to Parquet all the same.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import orjson

from kvscope.harness.common.version import kvscope_version
from kvscope.harness.serving.client import (
    AiohttpStreamClient,
    CompletionResult,
    FastStreamClient,
    StreamClient,
    chat_payload,
    completion_payload,
)
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.predict import OnlinePredictor
from kvscope.harness.replay.priority import client_priority
from kvscope.harness.results.records import (RecordWriter, RequestRecord, compact, read_records,
                                             write_records_parquet)
from kvscope.harness.results.schemas import CLIENT_STALL_S
from kvscope.harness.replay.routing import EndpointRouter
from kvscope.workloads.arrivals import arrival_offsets_s
from kvscope.harness.replay.watch import MetricsWatcher
from kvscope.harness.serving.tls import tls_context
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    from kvscope.harness.results.schemas import CalibrationFile
    from kvscope.harness.serving.backend import Backend


@dataclass
class ReplayOutcome:
    run_dir: Path
    summary: dict[str, Any]
    aborted: str | None = None


@dataclass
class _State:
    t0: float
    deadline: float | None
    max_requests: int | None
    sent: int = 0
    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    abort_reason: str | None = None
    stop: bool = False
    active_sessions: int = 0
    consecutive_conn_errors: int = 0
    length_mismatch: int = 0
    end_s: float | None = None
    last_done_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time during the run (all threads)
    event_loop: str = ""
    #: Client stalls (see _StallProbe): (start s from t0, length s), longest first after the run.
    stalls: list[tuple[float, float]] = field(default_factory=list)

    def may_send(self) -> bool:
        if self.stop:
            return False
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return False
        if self.max_requests is not None and self.sent >= self.max_requests:
            return False
        return True


_STALL_PROBE_S = 0.01
#: summary.json keeps the longest this many stall windows.
MAX_STALL_WINDOWS = 50


class _StallProbe:
    """A timer on the replay's event loop every 10 ms that records how late it fired, when later than
    :data:`CLIENT_STALL_S`.

    Why: on the 2-vCPU validation host (a Firecracker VM) the client sometimes slept 0.1-3.7 s with a 10 ms
    timer due and tokens waiting in its sockets: 1-4 ms of CPU in the window, no run-queue delay, and under
    strace an ``epoll_wait`` with a 4 ms timeout that returned after 149 ms.  Closed-loop sessions then started
    late (one concurrency-8 run averaged 7.0 sessions in flight, others 7.3-7.5) and the window's tokens were
    read in one burst.  The records only show it as event-free gaps, so the run measures it
    (``summary.json: client.stalls``, the data-quality flag ``client_stalls``; benchmarks/README.md has the
    figures: 22-28 s of a 60-70 s run at concurrency 1, 1.5 s at 32).  Cost: 100 timer callbacks a second.
    The cause was the guest's scheduler, not the client: a separate sleeper process was held up the same way,
    and not at all under ``SCHED_FIFO``, which the replay now runs under where permitted (replay/priority.py);
    the probe stays, because a host without the privilege (or with another cause) still shows it.
    """

    def __init__(self, st: _State) -> None:
        self.st = st
        self.handle: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.due = 0.0

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._arm()

    def _arm(self) -> None:
        self.due = time.perf_counter() + _STALL_PROBE_S
        self.handle = self.loop.call_later(_STALL_PROBE_S, self._fire)  # type: ignore[union-attr]

    def _fire(self) -> None:
        late = time.perf_counter() - self.due
        if late > CLIENT_STALL_S:
            self.st.stalls.append((self.due - self.st.t0, late))
        self._arm()

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.st.stalls.sort(key=lambda w: -w[1])


# Failures that may mean the server is gone: each is followed by a /health check of every endpoint.
_CONNECTION_FAILURES = frozenset({"connection_error", "connect_timeout", "stream_interrupted", "first_token_timeout",
                                  "idle_timeout", "timeout", "protocol_error"})


def trace_fingerprint(trace_dir: Path) -> str:
    """sha256 over the trace's three files, so a run names exactly the traffic it replayed."""
    h = hashlib.sha256()
    for name in ("trace.json", "segments.parquet", "requests.parquet"):
        p = Path(trace_dir) / name
        if p.exists():
            h.update(name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _sessions(trace) -> list[tuple[str, float, list[int]]]:
    """(session_id, planned start, request ids in step order), ordered by planned start."""
    df = trace.requests[["request_id", "session_id", "step", "session_start_s"]]
    out = []
    for sid, g in df.groupby("session_id", sort=False):
        g = g.sort_values("step")
        out.append((str(sid), float(g["session_start_s"].iloc[0]), g["request_id"].astype(int).tolist()))
    out.sort(key=lambda s: (s[1], s[2][0]))
    return out


def _session_starts(n: int, opts: ReplayOptions, planned: Sequence[float]) -> list[float]:
    """Start offsets (s) of each session for open-loop replays."""
    if opts.session_rate is None:
        base = min(planned) if planned else 0.0
        return [(p - base) * opts.time_scale for p in planned]
    rng = np.random.default_rng(opts.seed)
    return arrival_offsets_s(rng, n, opts.session_rate, opts.arrival_process, opts.arrival_cv).tolist()


class Replayer:
    def __init__(self, trace, endpoints: list[str], opts: ReplayOptions, run_dir: Path,
                 facts: list[dict[str, Any]], headers: dict[str, str] | None = None,
                 backends: "list[Backend] | None" = None, keep_requests: bool = False) -> None:
        self.trace = trace
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.opts = opts
        self.run_dir = Path(run_dir)
        self.facts = facts
        self.backends = backends
        # Endpoints are replicas of one deployment: one key (the first backend's) authenticates them all.
        self.headers = headers if headers is not None else (backends[0].auth_headers() if backends else {})
        self.model = opts.model or facts[0].get("model") or "default"
        self.router = EndpointRouter(len(self.endpoints), opts.routing,
                                     block_size=facts[0].get("block_size") or DEFAULT_BLOCK_SIZE)
        self.predictors: list[OnlinePredictor | None] = []
        for f in facts:
            if opts.predict and f.get("block_size"):
                self.predictors.append(OnlinePredictor(int(f["block_size"]), f.get("num_blocks"),
                                                       keep_requests=keep_requests))
            else:
                self.predictors.append(None)
        self.writer = RecordWriter(self.run_dir, flush_interval_s=opts.records_flush_s)
        self.progress = None
        self.priority = "normal"  # the event loop's scheduling during the run (replay/priority.py)
        self.watcher: MetricsWatcher | None = None
        # Per-request columns as plain lists: the hot path never touches the DataFrame.
        df = trace.requests
        n = len(df)
        self._step = df["step"].astype(int).tolist()
        out_tok = df["output_tokens"].fillna(0).astype(int).to_numpy()
        maxt = df["max_tokens"].fillna(0).astype(int).to_numpy()
        self._planned_out = out_tok.tolist()
        self._max_tokens = np.where(maxt > 0, maxt, np.where(out_tok > 0, out_tok, 1)).astype(int).tolist()
        self._salt = [x if isinstance(x, str) and x else None for x in df["cache_salt"].tolist()]
        self._transition = df["transition"].tolist()
        self._delay = (df["think_time_s"].fillna(0).to_numpy(float) +
                       df["tool_latency_s"].fillna(0).to_numpy(float)).tolist()
        self._messages = df["messages"].tolist() if opts.api == "chat" else [None] * n
        self._fast: FastStreamClient | None = None
        self._clients: list[StreamClient] = []  # per endpoint: the pooled fast client, or aiohttp
        self._alive_check: asyncio.Task | None = None
        self._url_path = "/v1/chat/completions" if opts.api == "chat" else "/v1/completions"
        self._urls = [e + self._url_path for e in self.endpoints]

    def _use_fast(self, url: str) -> bool:
        return self.opts.client == "fast" or (self.opts.client == "auto" and FastStreamClient.supports(url))

    # ---- one request -------------------------------------------------------------------------------
    def _body(self, rid: int, prompt: np.ndarray, max_tokens: int, ep: int = 0) -> bytes:
        salt = self._salt[rid]
        engine_fields = self.backends[ep].request_extras(salt) if self.backends else None
        if self.opts.api == "chat":
            raw = self._messages[rid]
            if not raw:
                raise KvscopeError(f"request {rid} has no messages: generate the trace in text mode for --api chat")
            msgs = [{"role": m["role"], "content": m["content"]} for m in json.loads(raw)]
            payload = chat_payload(self.model, msgs, max_tokens, salt, engine_fields=engine_fields)
        else:
            payload = completion_payload(self.model, prompt.tolist(), max_tokens, salt, engine_fields=engine_fields)
        return orjson.dumps(payload)

    async def _send(self, session, st: _State, rid: int, session_id: str, prompt: np.ndarray,
                    scheduled_s: float) -> CompletionResult:
        opts = self.opts
        salt = self._salt[rid]
        ep = self.router.pick(session_id, prompt) if self.router.n > 1 else 0
        predictor = self.predictors[ep]
        predicted = predictor.on_send(rid, session_id, prompt, salt) if predictor else None
        max_tokens = self._max_tokens[rid]
        body = self._body(rid, prompt, max_tokens, ep)
        url = self._urls[ep]
        client = self._clients[ep]
        result: CompletionResult | None = None
        for attempt in range(opts.retries + 1):
            if attempt:
                await asyncio.sleep(min(opts.retry_backoff_s * (2 ** (attempt - 1)), 30.0))
                if st.stop:
                    break
            st.sent += 1
            result = await client.post_stream(url, body, opts.timeouts)
            self._record(st, rid, session_id, attempt, ep, scheduled_s, len(prompt), predicted, max_tokens, result)
            if result.ok or attempt == opts.retries:
                break
        assert result is not None
        if result.ok and predictor is not None:
            predictor.on_finish(rid, session_id, prompt, result.token_ids, salt)
        return result

    def _record(self, st: _State, rid: int, session_id: str, attempt: int, ep: int, scheduled_s: float,
                n_prompt: int, predicted: int | None, max_tokens: int, res: CompletionResult) -> None:
        t0 = st.t0
        ct = res.chunk_times_s
        itl = [b - a for a, b in zip(ct, ct[1:])] if len(ct) > 1 else []
        n_out = res.output_tokens
        first = res.first_token_s
        done = res.done_s
        ttft = first - res.sent_s if first is not None else None
        e2e = done - res.sent_s if done is not None else None
        ok = res.error_class is None
        tpot = (e2e - ttft) / (n_out - 1) if (ok and ttft is not None and e2e is not None and n_out > 1) else None
        mismatch = False
        if ok:
            got = len(res.token_ids)
            if got:
                mismatch = got != max_tokens or (res.completion_tokens is not None and got != res.completion_tokens)
            elif res.completion_tokens is not None and res.completion_tokens != max_tokens:
                mismatch = True
        sent_rel = res.sent_s - t0
        cts = res.chunk_tokens
        rec = RequestRecord(
            request_id=rid, session_id=session_id, step=self._step[rid], attempt=attempt, endpoint_index=ep,
            mode=self.opts.mode, transition=self._transition[rid], scheduled_s=scheduled_s, sent_s=sent_rel,
            first_token_s=None if first is None else first - t0, done_s=None if done is None else done - t0,
            ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, itl_s=itl,
            chunk_tokens=cts if (len(cts) != n_out or any(c != 1 for c in cts)) and res.token_ids else [],
            prompt_tokens=n_prompt, server_prompt_tokens=res.prompt_tokens, cached_tokens=res.cached_tokens,
            predicted_cached_tokens=predicted, predictor=None if predicted is None else "sequential",
            predicted_cached_tokens_sequential=predicted, output_tokens=n_out,
            planned_output_tokens=self._planned_out[rid],
            finish_reason=res.finish_reason, http_status=res.http_status, error_class=res.error_class,
            error=res.error, in_window=sent_rel >= self.opts.warmup_s, length_mismatch=mismatch,
            output_text_head=res.text_head, output_token_ids=list(res.token_ids),
        )
        self.writer.write(rec)
        st.done += 1
        end = (done or res.sent_s) - t0
        if end > st.last_done_s:
            st.last_done_s = end
        if ok:
            st.consecutive_conn_errors = 0
            st.prompt_tokens += n_prompt
            st.cached_tokens += res.cached_tokens or 0
            if mismatch:
                st.length_mismatch += 1
        else:
            st.failed += 1
            if res.error_class in _CONNECTION_FAILURES:
                st.consecutive_conn_errors += 1
        if self.progress is not None:
            self.progress.update(1)

    # ---- sessions ----------------------------------------------------------------------------------
    async def _session(self, session, st: _State, session_id: str, rids: list[int], start_s: float) -> None:
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
            res = await self._send(session, st, rid, session_id, prompt, ready_at)
            if not res.ok:
                await self._check_alive(session, st, res)
                if opts.on_error == "end_session" or st.stop:
                    return
                continue
            if opts.mode == "live":
                out_seg = trace.output_segment_id(rid)
                if out_seg >= 0:
                    substitute[out_seg] = res.token_ids

    async def _check_alive(self, session, st: _State, res: CompletionResult) -> None:
        """After a connection-level failure, ask /health; a dead server ends the run. Concurrent failures
        share one check."""
        if res.error_class not in _CONNECTION_FAILURES or st.stop:
            return
        if self._alive_check is None or self._alive_check.done():
            self._alive_check = asyncio.ensure_future(self._health_all(session, st, res))
        await asyncio.shield(self._alive_check)

    async def _health_all(self, session, st: _State, res: CompletionResult) -> None:
        import aiohttp

        dead = []
        for ep in self.endpoints:
            try:
                async with session.get(ep + "/health", headers=self.headers,
                                       timeout=aiohttp.ClientTimeout(total=self.opts.health_timeout_s)) as r:
                    if r.status == 200:
                        continue
                    dead.append(f"{ep} (/health answered {r.status})")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                dead.append(f"{ep} ({exc.__class__.__name__})")
        if dead and len(dead) == len(self.endpoints):
            st.stop = True
            st.abort_reason = (f"server stopped answering: {', '.join(dead)}; last request error: "
                               f"{res.error_class}: {res.error}")

    async def _closed_loop(self, session, st: _State, sessions) -> None:
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

    async def _open_loop(self, session, st: _State, sessions) -> None:
        starts = _session_starts(len(sessions), self.opts, [s[1] for s in sessions])
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

    async def run(self) -> _State:
        """The run with the garbage collector's view frozen: the trace and set-up objects never need scanning
        again, so collections during the run are cheaper. Unfrozen afterwards, else every object alive now is
        never freed: across an experiment's cells that is each cell's trace, and at exit native extensions
        the process imported (triton, pulled in by torch when kvscope trains its tiny model) report their
        frozen objects as leaks (27 lines of ``nanobind: leaked …`` at the end of ``make demo``).

        Only the young generations are collected before the freeze: what the set-up just made is there, and a
        full collection costs in proportion to every object the process holds: 0.35 s in a process that has
        imported vLLM and papermill (a notebook kernel, the test suite), 0.07 s in a lean ``kvscope replay``,
        before every replay.  Older garbage stays frozen until the run ends, then is collected as usual."""
        import gc

        sessions = _sessions(self.trace)
        gc.collect(1)
        gc.freeze()
        try:
            return await self._run_frozen(sessions)
        finally:
            gc.unfreeze()

    async def _run_frozen(self, sessions: list[tuple[str, float, list[int]]]) -> _State:
        import aiohttp

        opts = self.opts
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        st = _State(t0=t0, deadline=t0 + opts.duration_s if opts.duration_s else None,
                    max_requests=opts.max_requests)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._fast = FastStreamClient(opts.timeouts, {"Authorization": self.headers["Authorization"]}
                                      if "Authorization" in self.headers else None)
        async with aiohttp.ClientSession(connector=connector) as session:
            self._clients = [self._fast if self._use_fast(url) else AiohttpStreamClient(session, opts.timeouts,
                                                                                         self.headers)
                             for url in self._urls]
            watcher = MetricsWatcher(self.endpoints, opts.scrape_interval_s, self.headers, t0=t0,
                                     spool_path=self.run_dir / "server_metrics.jsonl", backends=self.backends)
            self.watcher = watcher
            await watcher.scrape_once(session)  # the "before" snapshot
            watcher.start(session)
            probe = _StallProbe(st)
            probe.start()
            progress_task = None
            if opts.progress:
                progress_task = asyncio.create_task(self._progress_loop(st, watcher))
            try:
                if opts.concurrency is not None:
                    await self._closed_loop(session, st, sessions)
                else:
                    await self._open_loop(session, st, sessions)
            finally:
                st.end_s = time.perf_counter() - t0
                st.cpu_s = time.process_time() - cpu0
                probe.stop()
                loop = asyncio.get_running_loop()
                st.event_loop = f"{type(loop).__module__}.{type(loop).__name__}"
                self.writer.flush()
                if progress_task is not None:
                    progress_task.cancel()
                await self._fast.close()
                await watcher.stop(session)
        return st

    async def _progress_loop(self, st: _State, watcher: MetricsWatcher) -> None:
        while True:
            await asyncio.sleep(0.5)
            if self.progress is not None:
                latest = watcher.latest() or {}
                hit = st.cached_tokens / st.prompt_tokens if st.prompt_tokens else 0.0
                self.progress.set_postfix_str(
                    f"errors={st.failed} hit={hit:.1%} kv={latest.get('kv_cache_usage', 0):.0%} "
                    f"running={latest.get('num_requests_running', 0):.0f} sessions={st.active_sessions}",
                    refresh=False)


def replay(trace_dir: str | Path, run_dir: str | Path, opts: ReplayOptions, endpoints: Sequence[str] | None = None,
           server_config_path: str | Path | None = None, backends: "Sequence[Backend] | None" = None
           ) -> ReplayOutcome:
    """Run a replay end to end and write the run directory.

    The servers are `backends` (started by the caller), or launched from `server_config_path` for this run
    and stopped after it, or the `endpoints` as servers of the default backend that kvscope attaches to (key:
    `opts.api_key_env`).
    """
    from kvscope.workloads.trace import Trace

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("requests.jsonl", "requests.parquet", "summary.json"):
        if (run_dir / stale).exists():
            raise KvscopeError(f"{run_dir} already holds a run ({stale}); choose a new --out")
    trace = Trace.read(trace_dir)
    from kvscope.harness.replay.resources import fit_options_to_machine

    opts = fit_options_to_machine(opts)
    launched = backends is None and server_config_path is not None
    bks = list(backends) if backends is not None else _backends_for(opts, endpoints, server_config_path)
    started = time.time()
    try:
        if launched:
            bks[0].start(run_dir / "server.log")
        facts, reset, not_reset, choice = _prepare_servers(trace, bks, opts, fresh=launched, run_dir=run_dir)
        replayer = Replayer(trace, [b.endpoint for b in bks], opts, run_dir, facts, backends=bks,
                            keep_requests=choice.calibration is not None)
        st = _drive(replayer, trace, opts)
    finally:
        if launched:
            bks[0].stop()
    ended = time.time()
    from kvscope.harness.results.loaders import write_result_file
    from kvscope.harness.results.schemas import ManifestFile, SummaryFile

    summary = _summarize_run(run_dir, replayer, st, facts, opts, bks, not_reset, choice)
    summary = write_result_file(run_dir / "summary.json", SummaryFile, summary).model_dump(mode="json")
    manifest = {
        "kvscope_version": kvscope_version(),
        "vllm_version": facts[0].get("vllm_version"),
        "backend": bks[0].name,
        "engine_version": facts[0].get("engine_version"),
        "trace": {"path": str(Path(trace_dir).resolve()), "sha256": trace_fingerprint(Path(trace_dir)),
                  "name": trace.meta.get("name"), "seed": trace.meta.get("seed")},
        "options": opts.model_dump(mode="json"),
        "endpoints": [b.endpoint for b in bks],
        "server_config": bks[0].redacted_config() if launched else None,
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "started_at": started,
        "ended_at": ended,
        "aborted": st.abort_reason,
        "prefix_cache_reset": reset,
    }
    write_result_file(run_dir / "manifest.json", ManifestFile, manifest)
    return ReplayOutcome(run_dir=run_dir, summary=summary, aborted=st.abort_reason)


def _backends_for(opts: ReplayOptions, endpoints: Sequence[str] | None,
                  server_config_path: str | Path | None) -> "list[Backend]":
    """The backend of a server config file (launched by `replay`), or one default backend per given endpoint."""
    from kvscope.harness.serving.backend import DEFAULT_BACKEND, Backend, load_backend

    if server_config_path is not None:
        return [load_backend(server_config_path)]
    if not endpoints:
        raise KvscopeError("give --endpoint URL (repeatable) or --server CONFIG.yaml")
    backends = [Backend.create(DEFAULT_BACKEND, endpoint=ep, api_key_env=opts.api_key_env) for ep in endpoints]
    try:
        backends[0].auth_headers()  # a missing key fails here, before anything is sent
    except KvscopeError as exc:
        raise KvscopeError(str(exc).replace("api_key_env:", "--api-key-env:")) from None
    return backends


def _prepare_servers(trace, backends: "list[Backend]", opts: ReplayOptions, fresh: bool = False,
                     run_dir: Path | None = None
                     ) -> tuple[list[dict[str, Any]], dict[str, str] | None, str | None, PredictorChoice]:
    """Wait for each server, read its facts, check the vocabulary, choose the predictor (calibrating the
    server if asked), reset the prefix caches if asked: (facts, the reset's outcome per endpoint, why a reset
    that was asked for failed, the predictor). ``fresh``: the servers were launched for this run and have
    served nothing, so a failed reset leaves an empty cache all the same. A calibration taken here fills the
    cache, so the caches are then reset whatever ``reset_prefix_cache`` says, and none counts as fresh."""
    facts = []
    for b in backends:
        b.wait_ready(30.0)
        facts.append(b.facts().model_dump(mode="json"))
    headers = backends[0].auth_headers()
    _check_vocab(trace, facts, [b.endpoint for b in backends], headers)
    choice = choose_predictor(opts, facts, backends, run_dir)
    fresh = fresh and not choice.calibrated_here
    reset, not_reset = _reset_prefix_caches(backends, fresh) \
        if opts.reset_prefix_cache or choice.calibrated_here else (None, None)
    return facts, reset, not_reset, choice


@dataclass
class PredictorChoice:
    """Which model the run's ``predicted_cached_tokens`` come from (``records.PREDICTORS``), and why."""

    predictor: str | None
    #: The calibration the scheduler model runs on (None: the sequential simulator's predictions stay).
    calibration: "CalibrationFile | None" = None
    #: Where it came from: the file given, or RUN_DIR/calibration.json when taken for this run.
    calibration_path: str | None = None
    calibrated_here: bool = False
    #: One sentence for the summary when the choice is not the obvious one.
    note: str | None = None


def one_request_at_a_time(opts: ReplayOptions) -> bool:
    """Whether the run's requests cannot overlap on a server: the sequential simulator's case (exact there)."""
    return opts.concurrency == 1 or opts.max_active_sessions == 1


def choose_predictor(opts: ReplayOptions, facts: list[dict[str, Any]], backends: "Sequence[Backend]",
                     run_dir: Path | None = None) -> PredictorChoice:
    """The sequential simulator when requests run one at a time or there is no calibration; the scheduler
    model, replay-informed, when they may overlap and a calibration is given (``opts.calibration``, checked against
    the server's block size and count) or taken (``opts.calibrate``: measured now, written to
    RUN_DIR/calibration.json; a failed calibration leaves the sequential simulator, with a note)."""
    from kvscope.harness.common.errors import ConfigError

    if not opts.predict:
        return PredictorChoice(None)
    if one_request_at_a_time(opts):
        return PredictorChoice("sequential")
    block_size, num_blocks = facts[0].get("block_size"), facts[0].get("num_blocks")
    if opts.calibration:
        from kvscope.harness.results.loaders import load_calibration

        cal = load_calibration(opts.calibration)
        if cal.server.block_size != block_size or (num_blocks and cal.server.num_gpu_blocks != num_blocks):
            raise ConfigError(f"calibration {opts.calibration}: measured on a server with "
                              f"{cal.server.num_gpu_blocks} blocks of {cal.server.block_size} tokens, but "
                              f"{backends[0].endpoint} has {num_blocks} blocks of {block_size}: calibrate "
                              "this server (--calibrate)")
        return PredictorChoice("scheduler-replay-informed", cal, str(opts.calibration))
    if opts.calibrate and run_dir is not None:
        from kvscope.harness.replay.calibrate import calibrate_server

        path = Path(run_dir) / "calibration.json"
        cfg = getattr(backends[0], "config", None)
        print("kvscope: calibrating the server for the scheduler model (a few dozen requests) …",
              file=sys.stderr, flush=True)
        try:
            cal = calibrate_server(backends[0].endpoint, path, backend=backends[0].name,
                                   headers=backends[0].auth_headers(),
                                   client_priority_mode=opts.client_priority,
                                   max_num_seqs=getattr(cfg, "max_num_seqs", None),
                                   max_num_batched_tokens=getattr(cfg, "max_num_batched_tokens", None))
        except (KvscopeError, OSError, ValueError) as exc:
            reason = f"calibration failed ({exc.__class__.__name__}: {str(exc).splitlines()[0][:200]})"
            print(f"kvscope: warning: {reason}: the sequential simulator predicts", file=sys.stderr, flush=True)
            return PredictorChoice("sequential", note=f"{reason}; requests overlap, so the sequential "
                                                      "simulator's predictions are approximate", calibrated_here=True)
        return PredictorChoice("scheduler-replay-informed", cal, str(path), calibrated_here=True)
    return PredictorChoice("sequential", note="requests overlap and no calibration was given (--calibration FILE "
                                              "or --calibrate), so the sequential simulator predicts: it ignores "
                                              "admission order, pinning and preemption")


def _drive(replayer: Replayer, trace, opts: ReplayOptions) -> _State:
    """Run the replay's event loop (with a progress bar if asked); records are closed whatever happens."""
    total = min(opts.max_requests or trace.num_requests, trace.num_requests)
    if opts.progress:
        from tqdm import tqdm

        replayer.progress = tqdm(total=total, unit="req", desc="replay", dynamic_ncols=True)
    try:
        # Threads too: the /metrics parser's executor thread holds the GIL while it parses, and held up there
        # it holds up the loop (replay/priority.py).  Nothing in the run starts a process.
        with client_priority(opts.client_priority, threads_inherit=True) as replayer.priority:
            return run_event_loop(replayer.run(), opts.event_loop)
    finally:
        replayer.writer.close()
        if replayer.progress is not None:
            replayer.progress.close()


def _summarize_run(run_dir: Path, replayer: Replayer, st: _State, facts: list[dict[str, Any]],
                   opts: ReplayOptions, backends: "list[Backend]", not_reset: str | None = None,
                   choice: PredictorChoice | None = None) -> dict[str, Any]:
    """Compact the records, replace the predictions by the scheduler model's where chosen, write the metrics
    series and build summary.json's content."""
    from kvscope.harness.model.tinymodel import weights_are_random
    import pandas as pd

    from kvscope.harness.results.summary import CLIENT_SATURATED_CPU_SHARE, summarize

    compact(run_dir)
    records = read_records(run_dir)
    duration = st.end_s or 0.0
    changed = False
    if opts.cooldown_s and len(records):
        cutoff = duration - opts.cooldown_s
        records.loc[records["sent_s"] > cutoff, "in_window"] = False
        changed = True
    note = choice.note if choice is not None else None
    if choice is not None and choice.calibration is not None and len(records):
        note = _apply_scheduler_predictions(records, replayer, choice)
        changed = True
    if changed:
        write_records_parquet(run_dir, records)
    assert replayer.watcher is not None
    series = pd.read_parquet(replayer.watcher.write(run_dir))
    deltas = replayer.watcher.deltas()
    model_dir = backends[0].model_path()
    prefix_on = facts[0].get("prefix_caching")
    util = st.cpu_s / duration if duration else None
    summary = summarize(records, deltas, duration, prefix_on, opts.slo_ttft_ms, opts.slo_tpot_ms,
                        weights_random=weights_are_random(model_dir) if model_dir else None,
                        client_cpu_utilization=util, client_stalls=len(st.stalls), cache_not_reset=not_reset,
                        scrape_interval_s=opts.scrape_interval_s,
                        scrape_times_s=tuple(series["t_s"]) if "t_s" in series else (),
                        predictor_note=note,
                        calibration=choice.calibration_path if choice is not None else None)
    summary["aborted"] = st.abort_reason
    summary["client"] = {
        "cpu_s": st.cpu_s, "cpu_utilization": util,
        "cpu_us_per_request": st.cpu_s / len(records) * 1e6 if len(records) else None,
        "event_loop": st.event_loop, "stale_connection_resends": replayer._fast.stale_retries if replayer._fast else 0,
        "saturated": bool(util is not None and util > CLIENT_SATURATED_CPU_SHARE),
        "note": ("the replay client used > 90 % of a core: latencies may include client queuing; use fewer "
                 "sessions per process or several processes") if util is not None and util > CLIENT_SATURATED_CPU_SHARE else None,
        "stalls": len(st.stalls), "stall_max_s": st.stalls[0][1] if st.stalls else 0.0,
        "stalled_s": float(sum(w[1] for w in st.stalls)),
        "stall_windows_s": [[round(a, 4), round(b, 4)] for a, b in st.stalls[:MAX_STALL_WINDOWS]],
        "priority": replayer.priority,
    }
    summary["server_facts"] = facts
    return summary


def _apply_scheduler_predictions(records, replayer: Replayer, choice: PredictorChoice) -> str | None:
    """Replace ``predicted_cached_tokens`` of the successful records (in place) by the scheduler model's,
    replayed per server on the run's timeline (``predict.replay_informed_cached_tokens``); failed records get
    none. The sequential simulator's stay in ``predicted_cached_tokens_sequential``. If the model cannot run
    (a request it never saw, an error inside it) the sequential predictions stay and the returned note says
    why; None when it ran."""
    from kvscope.harness.replay.predict import replay_informed_cached_tokens

    assert choice.calibration is not None
    scheduled = {}
    try:
        for ep, group in records.groupby("endpoint_index", sort=False):
            predictor = replayer.predictors[int(ep)]
            if predictor is None:
                raise KvscopeError(f"endpoint {ep} has no prediction")
            facts = replayer.facts[int(ep)]
            scheduled[ep] = replay_informed_cached_tokens(group, predictor.finished, choice.calibration,
                                                          output_blocks_known=True,
                                                          num_gpu_blocks=facts.get("num_blocks"))
    except Exception as exc:  # noqa: BLE001 - the run's records must survive a failing model
        reason = f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        print(f"kvscope: warning: the scheduler model failed ({reason}): the sequential simulator's predictions "
              "are recorded", file=sys.stderr, flush=True)
        return f"the scheduler model failed ({reason}), so the sequential simulator's predictions are recorded"
    records["predicted_cached_tokens"] = None
    records["predictor"] = None
    for series in scheduled.values():
        records.loc[series.index, "predicted_cached_tokens"] = series
        records.loc[series.index, "predictor"] = choice.predictor
    return None


def _reset_prefix_caches(backends: "Sequence[Backend]", fresh: bool = False
                         ) -> tuple[dict[str, str], str | None]:
    """Empty each server's prefix cache through its backend; the outcome per endpoint goes into the manifest.

    A failed reset (vLLM without ``VLLM_SERVER_DEV_MODE=1`` answers 404) is said on stderr at once, one line:
    the run then starts on a warm cache, so the exact model's predictions miss on every request that hits
    what an earlier run left, and summary.json flags it (``data_quality.flags``: ``cache_not_reset``).
    Returns (outcome per endpoint, for the manifest; the failures in one line, or None)."""
    outcomes = {b.endpoint: b.reset_prefix_cache(timeout_s=30) for b in backends}
    if fresh:  # launched for this run: nothing was served yet, the cache is empty without a reset
        return {ep: o.detail + ("" if o.ok else "; a fresh server, empty anyway") for ep, o in outcomes.items()}, None
    failed = [f"{ep}: {o.detail}" for ep, o in outcomes.items() if not o.ok]
    if failed:
        print(f"kvscope: warning: prefix cache not reset ({'; '.join(failed)}): the run starts on whatever "
              "earlier requests left cached, so measured hit rates may exceed the predicted ones; summary.json "
              "is flagged cache_not_reset", file=sys.stderr, flush=True)
    return {ep: o.detail for ep, o in outcomes.items()}, "; ".join(failed) or None


def run_event_loop(coro, kind: str = "auto"):
    """Run `coro` on uvloop when it is installed (kind auto/uvloop), else on the default asyncio loop.

    A termination signal (SIGTERM, SIGHUP: ``common/signals.py``) received while it ran raises KeyboardInterrupt
    here even when the coroutine returned normally: the signal cancels the main task, and a task that absorbs
    the cancellation (a request's watchdog uncancels it) would otherwise make the run look finished, so the
    caller would go on to the next cell and exit 0 (seen in CI as SIGTERM giving exit code 0)."""
    from kvscope.harness.common import signals

    seen, seen_in_callbacks = len(signals.received), len(signals.callback_interrupts)
    try:
        result = _run_event_loop(coro, kind)
    except asyncio.CancelledError:  # an interrupt inside a callback cancelled the run (signals.quiet_interrupts)
        if len(signals.callback_interrupts) > seen_in_callbacks:
            raise KeyboardInterrupt from None
        raise
    if len(signals.received) > seen or len(signals.callback_interrupts) > seen_in_callbacks:
        raise KeyboardInterrupt
    return result


def _run_event_loop(coro, kind: str):
    from kvscope.harness.common import signals

    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise KvscopeError("--event-loop uvloop: uvloop is not installed") from None
        else:
            with asyncio.Runner(loop_factory=signals.quiet_interrupts(uvloop.new_event_loop)) as runner:
                return runner.run(coro)
    with asyncio.Runner(loop_factory=signals.quiet_interrupts(asyncio.new_event_loop)) as runner:
        return runner.run(coro)


def _vocab_limits(trace, facts: list[dict], endpoints: Sequence[str], headers: dict[str, str]) -> list[tuple[int, str]]:
    """Every known vocabulary size with where it came from: the trace's tokenizer, the config.json of a model
    directory kvscope launched, and a `vocab_size` field in `/v1/models` where an endpoint exposes one."""
    out: list[tuple[int, str]] = []
    meta_vocab = (trace.meta.get("tokenizer") or {}).get("vocab_size")
    if meta_vocab:
        out.append((int(meta_vocab), "the trace's tokenizer (trace.json tokenizer.vocab_size)"))
    eps = list(endpoints)
    for i, f in enumerate(facts):
        ep = eps[i] if i < len(eps) else None
        model = ((f.get("config") or {}).get("model")) if isinstance(f.get("config"), dict) else None
        if model and Path(model).is_dir() and (Path(model) / "config.json").exists():
            try:
                cfg = json.loads((Path(model) / "config.json").read_text())
                v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
                if v:
                    out.append((int(v), f"the served model's {Path(model) / 'config.json'}"))
            except (OSError, ValueError):
                pass
        if ep is None:
            continue
        try:
            import httpx

            r = httpx.get(ep.rstrip("/") + "/v1/models", headers=headers, timeout=10, verify=tls_context())
            if r.status_code == 200:
                for card in r.json().get("data") or []:
                    if isinstance(card, dict) and card.get("vocab_size"):
                        out.append((int(card["vocab_size"]), f"{ep}/v1/models vocab_size"))
                        break
        except Exception:  # noqa: BLE001 - optional information
            pass
    return out


def _check_vocab(trace, facts: list[dict], endpoints: Sequence[str] = (), headers: dict[str, str] | None = None
                 ) -> None:
    """Token ids outside the model's vocabulary would be rejected one by one; catch them before sending."""
    if not len(trace.seg_tokens):
        return
    toks = trace.seg_tokens
    lo, top = int(toks.min()), int(toks.max())
    limits = _vocab_limits(trace, facts, endpoints, headers or {})
    bad_vocab = [(v, src) for v, src in limits if top >= v]
    if lo >= 0 and not bad_vocab:
        return
    if bad_vocab:
        vocab, src = min(bad_vocab)
        bad = np.flatnonzero(toks >= vocab)
    else:
        vocab, src = 0, "token ids must be non-negative"
        bad = np.flatnonzero(toks < 0)
    seg = int(np.searchsorted(trace.seg_offsets, bad[0], side="right") - 1)
    users = [i for i in range(trace.num_requests) if seg in set(trace.prompt_segment_ids(i).tolist())][:3]
    where = f"segment {seg}" + (f", used by request(s) {users}" if users else "")
    what = f"vocabulary of {vocab} from {src}" if bad_vocab else src
    raise KvscopeError(f"trace has {len(bad)} token id(s) outside the model's vocabulary (first: id "
                       f"{int(toks[bad[0]])} in {where}); {what}. Nothing was sent.")


