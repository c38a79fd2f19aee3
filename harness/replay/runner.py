"""Replay a trace's sessions through one or more vLLM endpoints with real agent/user timing.

Within a session, step n+1 is sent only after step n finished plus its think time / tool latency (scaled
by `time_scale`). Sessions start open-loop (trace start times, or Poisson/gamma at a rate) or closed-loop
(N sessions at a time). Every request becomes a record on disk the moment it completes; the server's
`/metrics` is watched throughout. A server that stops answering ends the run with a clear error, and the
records written so far are compacted to Parquet all the same.

This module is the run's frame: :func:`replay` (servers, event loop, result files) and :class:`Replayer`
(one event loop's clients, watcher and probes). The parts change for their own reasons and live apart:
``servers.py`` (backends, facts, vocabulary, cache reset), ``session_timing.py`` (when sessions and their
steps are sent), ``request_loop.py`` (one request, from body to record), ``predict.py`` (the predictions and
the choice of predictor) and ``results.py`` (summary.json, manifest.json).
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from kvscope.harness.common import signals
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.predict import endpoint_predictors
from kvscope.harness.replay.priority import client_priority
from kvscope.harness.replay.request_loop import RequestLoop
from kvscope.harness.replay.resources import fit_options_to_machine
from kvscope.harness.replay.results import summarize_run, write_run_files
from kvscope.harness.replay.routing import EndpointRouter
from kvscope.harness.replay.run_state import RunState, StallProbe
from kvscope.harness.replay.servers import backends_for, prepare_servers, trace_header
from kvscope.harness.replay.session_timing import SessionDriver, SessionPlan, session_plan
from kvscope.harness.replay.watch import MetricsWatcher
from kvscope.harness.results.records import RecordWriter
from kvscope.harness.results.summary import summary_file_model
from kvscope.harness.results.summary_parts import ServerFacts
from kvscope.harness.serving.client import AiohttpStreamClient, FastStreamClient
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE
from kvscope.workloads.trace import Trace

if TYPE_CHECKING:
    from kvscope.harness.cachemodel.model_routing import ModelRoutingSpec
    from kvscope.harness.replay.model_router import LiveRouting
    from kvscope.harness.serving.backend import Backend


@dataclass
class ReplayOutcome:
    """A finished replay: its directory, summary.json's content as written (JSON data: it crosses processes
    under the Ray executor) and why it stopped early (None: it ran to the end)."""

    run_dir: Path
    summary: dict[str, Any]
    aborted: str | None = None

    def summary_file(self) -> Any:
        """The summary as its file model (``summary_file_model()``)."""
        return summary_file_model().model_validate(self.summary)


class Replayer:
    """One replay's event loop: the HTTP clients, the metrics watcher and the stall probe around the session
    driver (:class:`SessionDriver`), which sends through the request loop (:class:`RequestLoop`)."""

    def __init__(self, trace, endpoints: list[str], opts: ReplayOptions, run_dir: Path,
                 facts: list[ServerFacts], headers: dict[str, str] | None = None,
                 backends: "list[Backend] | None" = None, keep_requests: bool = False,
                 model_routing: "LiveRouting | None" = None) -> None:
        self.trace = trace
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.opts = opts
        self.run_dir = Path(run_dir)
        self.facts = facts
        self.backends = backends
        # Endpoints are replicas of one deployment: one key (the first backend's) authenticates them all.
        self.headers = headers if headers is not None else (backends[0].auth_headers() if backends else {})
        self.predictors = endpoint_predictors(opts, facts, keep_requests)
        self.writer = RecordWriter(self.run_dir, flush_interval_s=opts.records_flush_s)
        router = EndpointRouter(len(self.endpoints), opts.routing,
                                block_size=facts[0].block_size or DEFAULT_BLOCK_SIZE)
        loop_args = {"model": opts.model or facts[0].model or "default", "router": router,
                     "predictors": self.predictors, "writer": self.writer, "headers": self.headers,
                     "backends": backends}
        # model routing: one endpoint per model and a router in front (replay/model_router.py)
        self.requests = RequestLoop(trace, self.endpoints, opts, **loop_args) if model_routing is None else \
            model_routing.request_loop(trace, self.endpoints, opts, facts, **loop_args)
        self.sessions = SessionDriver(trace, opts, self.requests)
        self.progress = None
        self.priority = "normal"  # the event loop's scheduling during the run (replay/priority.py)
        self.watcher: MetricsWatcher | None = None

    async def run(self) -> RunState:
        """The run with the garbage collector's view frozen: the trace and set-up objects never need scanning
        again, so collections during the run are cheaper. Unfrozen afterwards, else every object alive now is
        never freed: across an experiment's cells that is each cell's trace, and at exit native extensions
        the process imported (triton, pulled in by torch when kvscope trains its tiny model) report their
        frozen objects as leaks (27 lines of ``nanobind: leaked …`` at the end of ``make demo``).

        Only the young generations are collected before the freeze: what the set-up just made is there, and a
        full collection costs in proportion to every object the process holds: 0.35 s in a process that has
        imported vLLM and papermill (a notebook kernel, the test suite), 0.07 s in a lean ``kvscope replay``,
        before every replay.  Older garbage stays frozen until the run ends, then is collected as usual."""
        sessions = session_plan(self.trace)
        gc.collect(1)
        gc.freeze()
        try:
            return await self._run_frozen(sessions)
        finally:
            gc.unfreeze()

    async def _run_frozen(self, sessions: list[SessionPlan]) -> RunState:
        import aiohttp  # deferred: a heavy import that only a running replay needs

        opts = self.opts
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        st = RunState(t0=t0, deadline=t0 + opts.duration_s if opts.duration_s else None,
                      max_requests=opts.max_requests)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        requests = self.requests
        fast = requests.fast = FastStreamClient(opts.timeouts, {"Authorization": self.headers["Authorization"]}
                                                if "Authorization" in self.headers else None)
        if self.progress is not None:
            requests.on_recorded = lambda: self.progress.update(1)  # type: ignore[union-attr]
        async with aiohttp.ClientSession(connector=connector) as session:
            requests.clients = [fast if requests.use_fast(url) else AiohttpStreamClient(session, opts.timeouts,
                                                                                        self.headers)
                                for url in requests.urls]
            watcher = MetricsWatcher(self.endpoints, opts.scrape_interval_s, self.headers, t0=t0,
                                     spool_path=self.run_dir / "server_metrics.jsonl", backends=self.backends)
            self.watcher = watcher
            await watcher.scrape_once(session)  # the "before" snapshot
            watcher.start(session)
            probe = StallProbe(st)
            probe.start()
            progress_task = None
            if opts.progress:
                progress_task = asyncio.create_task(self._progress_loop(st, watcher))
            try:
                await self.sessions.run(session, st, sessions)
            finally:
                st.end_s = time.perf_counter() - t0
                st.cpu_s = time.process_time() - cpu0
                probe.stop()
                loop = asyncio.get_running_loop()
                st.event_loop = f"{type(loop).__module__}.{type(loop).__name__}"
                self.writer.flush()
                if progress_task is not None:
                    progress_task.cancel()
                await fast.close()
                await watcher.stop(session)
        return st

    async def _progress_loop(self, st: RunState, watcher: MetricsWatcher) -> None:
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
           server_config_path: str | Path | None = None, backends: "Sequence[Backend] | None" = None,
           model_routing: "ModelRoutingSpec | None" = None, labels: str | Path | None = None) -> ReplayOutcome:
    """Run a replay end to end and write the run directory.

    The servers are `backends` (started by the caller), or launched from `server_config_path` for this run
    and stopped after it, or the `endpoints` as servers of the default backend that kvscope attaches to (key:
    `opts.api_key_env`).  With `model_routing` the endpoints are the spec's models in its order (cheapest
    first) and a router sends each request to one of them (replay/model_router.py; `labels`: the policy's
    per-request signals); RUN_DIR/routing.json then holds the offline routing model's check of the run.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("requests.jsonl", "requests.parquet", "summary.json"):
        if (run_dir / stale).exists():
            raise KvscopeError(f"{run_dir} already holds a run ({stale}); choose a new --out")
    trace = Trace.read(trace_dir)
    opts = fit_options_to_machine(opts)
    launched = backends is None and server_config_path is not None
    bks = list(backends) if backends is not None else backends_for(opts, endpoints, server_config_path)
    routing = None
    if model_routing is not None:
        from kvscope.harness.replay.model_router import LiveRouting  # deferred: only a routed replay needs it

        routing = LiveRouting.create(model_routing, trace, len(bks), labels, opts)
    started = time.time()
    try:
        if launched:
            bks[0].start(run_dir / "server.log")
        servers = prepare_servers(trace, bks, opts, fresh=launched, run_dir=run_dir)
        replayer = Replayer(trace, [b.endpoint for b in bks], opts, run_dir, servers.facts, backends=bks,
                            keep_requests=servers.choice.calibration is not None, model_routing=routing)
        st = _drive(replayer, trace, opts)
    finally:
        if launched:
            bks[0].stop()
    ended = time.time()
    assert replayer.watcher is not None
    fast = replayer.requests.fast
    summary = summarize_run(run_dir, st, servers.facts, opts, bks, replayer.watcher, replayer.predictors,
                            stale_connection_resends=fast.stale_retries if fast else 0,
                            priority=replayer.priority, not_reset=servers.not_reset, choice=servers.choice)
    summary = write_run_files(run_dir, summary, trace_dir=Path(trace_dir), header=trace_header(trace), opts=opts,
                              facts=servers.facts, backends=bks, launched=launched, started=started, ended=ended,
                              aborted=st.abort_reason, reset=servers.reset)
    if routing is not None:
        from kvscope.harness.replay.model_router import check_routed_run  # deferred: only a routed replay needs it
        from kvscope.harness.results.records import read_records  # deferred: pandas, only needed here

        check_routed_run(routing, read_records(run_dir), servers.facts, [b.endpoint for b in bks], run_dir)
    return ReplayOutcome(run_dir=run_dir, summary=summary, aborted=st.abort_reason)


def _drive(replayer: Replayer, trace, opts: ReplayOptions) -> RunState:
    """Run the replay's event loop (with a progress bar if asked); records are closed whatever happens."""
    total = min(opts.max_requests or trace.num_requests, trace.num_requests)
    if opts.progress:
        from tqdm import tqdm  # deferred: only a run with a progress bar needs it

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


def run_event_loop(coro, kind: str = "auto"):
    """Run `coro` on uvloop when it is installed (kind auto/uvloop), else on the default asyncio loop.

    A termination signal (SIGTERM, SIGHUP: ``common/signals.py``) received while it ran raises KeyboardInterrupt
    here even when the coroutine returned normally: the signal cancels the main task, and a task that absorbs
    the cancellation (a request's watchdog uncancels it) would otherwise make the run look finished, so the
    caller would go on to the next cell and exit 0 (seen in CI as SIGTERM giving exit code 0)."""
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
    if kind in ("auto", "uvloop"):
        try:
            import uvloop  # deferred: optional (the [fast] extra); absent, the default loop runs
        except ImportError:
            if kind == "uvloop":
                raise KvscopeError("--event-loop uvloop: uvloop is not installed") from None
        else:
            with asyncio.Runner(loop_factory=signals.quiet_interrupts(uvloop.new_event_loop)) as runner:
                return runner.run(coro)
    with asyncio.Runner(loop_factory=signals.quiet_interrupts(asyncio.new_event_loop)) as runner:
        return runner.run(coro)
