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
import math
import os
import platform
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from harness.client import CompletionResult, chat_payload, completion_payload, stream_request
from harness.errors import KvscopeError
from harness.replay.options import ReplayOptions
from harness.replay.predict import OnlinePredictor
from harness.replay.records import RecordWriter, RequestRecord, compact, read_records
from harness.replay.routing import EndpointRouter
from harness.replay.watch import MetricsWatcher


class ReplayAborted(KvscopeError):
    """The run could not go on (server gone); records up to this point are saved."""


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
    end_s: float | None = None
    last_done_s: float = 0.0

    def may_send(self) -> bool:
        if self.stop:
            return False
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return False
        if self.max_requests is not None and self.sent >= self.max_requests:
            return False
        return True


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
    mean_gap = 1.0 / opts.session_rate
    if opts.arrival_process == "poisson":
        gaps = rng.exponential(mean_gap, size=n)
    else:
        shape = 1.0 / (opts.arrival_cv**2)
        gaps = rng.gamma(shape, mean_gap / shape, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


class Replayer:
    def __init__(self, trace, endpoints: list[str], opts: ReplayOptions, run_dir: Path,
                 facts: list[dict[str, Any]], headers: dict[str, str] | None = None) -> None:
        self.trace = trace
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.opts = opts
        self.run_dir = Path(run_dir)
        self.facts = facts
        self.headers = headers or {}
        self.model = opts.model or facts[0].get("model") or "default"
        self.router = EndpointRouter(len(self.endpoints), opts.routing,
                                     block_size=facts[0].get("block_size") or 16)
        self.predictors: list[OnlinePredictor | None] = []
        for f in facts:
            if opts.predict and f.get("block_size"):
                self.predictors.append(OnlinePredictor(int(f["block_size"]), f.get("num_blocks")))
            else:
                self.predictors.append(None)
        self.writer = RecordWriter(self.run_dir)
        self.progress = None

    # ---- one request -------------------------------------------------------------------------------
    async def _send(self, session, st: _State, rid: int, session_id: str, prompt: np.ndarray,
                    scheduled_s: float) -> CompletionResult:
        trace, opts = self.trace, self.opts
        req = trace.request(rid)
        ep = self.router.pick(session_id, prompt)
        predictor = self.predictors[ep]
        predicted = predictor.on_send(rid, session_id, prompt, req.cache_salt) if predictor else None
        max_tokens = int(req.max_tokens or req.output_tokens or 1)
        result: CompletionResult | None = None
        for attempt in range(opts.retries + 1):
            if opts.api == "chat":
                if not req.messages:
                    raise KvscopeError(f"request {rid} has no messages: generate the trace in text mode for --api chat")
                msgs = [{"role": m["role"], "content": m["content"]} for m in json.loads(req.messages)]
                payload = chat_payload(self.model, msgs, max_tokens, req.cache_salt)
                url = self.endpoints[ep] + "/v1/chat/completions"
            else:
                payload = completion_payload(self.model, prompt.tolist(), max_tokens, req.cache_salt)
                url = self.endpoints[ep] + "/v1/completions"
            st.sent += 1
            result = await stream_request(session, url, payload, self.headers, opts.timeouts)
            self._record(st, rid, session_id, req, attempt, ep, scheduled_s, len(prompt), predicted, result)
            if result.ok or attempt == opts.retries:
                break
        assert result is not None
        if result.ok and predictor is not None:
            predictor.on_finish(rid, session_id, prompt, result.token_ids, req.cache_salt)
        return result

    def _record(self, st: _State, rid: int, session_id: str, req, attempt: int, ep: int, scheduled_s: float,
                n_prompt: int, predicted: int | None, res: CompletionResult) -> None:
        t0 = st.t0
        chunk_times = res.chunk_times_s
        itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
        n_out = res.output_tokens
        ttft = res.ttft_s if res.first_token_s is not None else None
        e2e = res.e2e_s if res.done_s is not None else None
        tpot = (e2e - ttft) / (n_out - 1) if (res.ok and ttft is not None and e2e is not None and n_out > 1) else None
        sent_rel = res.sent_s - t0
        rec = RequestRecord(
            request_id=rid, session_id=session_id, step=int(req.step), attempt=attempt, endpoint_index=ep,
            mode=self.opts.mode, transition=req.transition, scheduled_s=scheduled_s, sent_s=sent_rel,
            first_token_s=None if res.first_token_s is None else res.first_token_s - t0,
            done_s=None if res.done_s is None else res.done_s - t0, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e,
            itl_s=itl, chunk_tokens=res.chunk_tokens if any(c != 1 for c in res.chunk_tokens) else [],
            prompt_tokens=n_prompt, server_prompt_tokens=res.prompt_tokens, cached_tokens=res.cached_tokens,
            predicted_cached_tokens=predicted, output_tokens=n_out, planned_output_tokens=int(req.output_tokens),
            finish_reason=res.finish_reason, http_status=res.http_status, error_class=res.error_class,
            error=res.error, in_window=sent_rel >= self.opts.warmup_s,
        )
        self.writer.write(rec)
        st.done += 1
        st.last_done_s = max(st.last_done_s, (res.done_s or res.sent_s) - t0)
        if res.ok:
            st.consecutive_conn_errors = 0
            st.prompt_tokens += n_prompt
            st.cached_tokens += res.cached_tokens or 0
        else:
            st.failed += 1
            if res.error_class in ("connection_error", "first_token_timeout", "idle_timeout", "timeout"):
                st.consecutive_conn_errors += 1
        if self.progress is not None:
            self.progress.update(1)

    # ---- sessions ----------------------------------------------------------------------------------
    async def _session(self, session, st: _State, session_id: str, rids: list[int], start_s: float) -> None:
        trace, opts = self.trace, self.opts
        substitute: dict[int, list[int]] = {}
        ready_at = start_s
        for k, rid in enumerate(rids):
            req = trace.request(rid)
            if k > 0:
                ready_at = (time.perf_counter() - st.t0) + (req.think_time_s + req.tool_latency_s) * opts.time_scale
                delay = ready_at - (time.perf_counter() - st.t0)
                if delay > 0:
                    await asyncio.sleep(delay)
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
        """After a connection-level failure, ask /health; a dead server ends the run."""
        import aiohttp

        if res.error_class not in ("connection_error", "first_token_timeout", "idle_timeout", "timeout") or st.stop:
            return
        dead = []
        for ep in self.endpoints:
            try:
                async with session.get(ep + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
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
        import aiohttp

        opts = self.opts
        sessions = _sessions(self.trace)
        t0 = time.perf_counter()
        st = _State(t0=t0, deadline=t0 + opts.duration_s if opts.duration_s else None,
                    max_requests=opts.max_requests)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(connector=connector) as session:
            watcher = MetricsWatcher(self.endpoints, opts.scrape_interval_s, self.headers, t0=t0)
            await watcher.scrape_once(session)  # the "before" snapshot
            watcher.start(session)
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
                if progress_task is not None:
                    progress_task.cancel()
                await watcher.stop(session)
                self.watcher = watcher
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
           server_config_path: str | Path | None = None) -> ReplayOutcome:
    """Run a replay end to end and write the run directory. Starts/stops a server if given a config."""
    from workloads.trace import Trace

    from harness.server import ServerConfig, VllmServer, read_server_facts, wait_for_endpoint
    from harness.tinymodel import weights_are_random

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("requests.jsonl", "requests.parquet", "summary.json"):
        if (run_dir / stale).exists():
            raise KvscopeError(f"{run_dir} already holds a run ({stale}); choose a new --out")
    trace = Trace.read(trace_dir)
    headers: dict[str, str] = {}
    if opts.api_key_env:
        key = os.environ.get(opts.api_key_env)
        if not key:
            raise KvscopeError(f"--api-key-env: environment variable {opts.api_key_env} is not set")
        headers["Authorization"] = f"Bearer {key}"
    server = None
    config = None
    if server_config_path is not None:
        config = ServerConfig.from_yaml(server_config_path)
        server = VllmServer(config, log_path=run_dir / "server.log")
        server.start()
        endpoints = [server.endpoint]
    if not endpoints:
        raise KvscopeError("give --endpoint URL (repeatable) or --server CONFIG.yaml")
    started = time.time()
    try:
        facts = []
        for ep in endpoints:
            wait_for_endpoint(ep, timeout_s=30)
            f = read_server_facts(ep, log_text=server.log_text() if server else None, config=config, headers=headers)
            facts.append(f.model_dump(mode="json"))
        _check_vocab(trace, facts)
        reset = _reset_prefix_caches(list(endpoints), headers) if opts.reset_prefix_cache else None
        replayer = Replayer(trace, list(endpoints), opts, run_dir, facts, headers)
        total = min(opts.max_requests or trace.num_requests, trace.num_requests)
        if opts.progress:
            from tqdm import tqdm

            replayer.progress = tqdm(total=total, unit="req", desc="replay", dynamic_ncols=True)
        try:
            st = asyncio.run(replayer.run())
        finally:
            replayer.writer.close()
            if replayer.progress is not None:
                replayer.progress.close()
    finally:
        if server is not None:
            server.stop()
    ended = time.time()
    compact(run_dir)
    records = read_records(run_dir)
    duration = st.end_s or 0.0
    if opts.cooldown_s and len(records):
        cutoff = duration - opts.cooldown_s
        records.loc[records["sent_s"] > cutoff, "in_window"] = False
        records.to_parquet(run_dir / "requests.parquet", index=False)
    replayer.watcher.write(run_dir)
    deltas = replayer.watcher.deltas()
    model_dir = config.model if config else None
    from harness.replay.summary import summarize

    prefix_on = facts[0].get("prefix_caching")
    summary = summarize(records, deltas, duration, prefix_on, opts.slo_ttft_ms, opts.slo_tpot_ms,
                        weights_random=weights_are_random(model_dir) if model_dir else None)
    summary["aborted"] = st.abort_reason
    summary["server_facts"] = facts
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    manifest = {
        "kvscope_version": _kvscope_version(),
        "vllm_version": facts[0].get("vllm_version"),
        "trace": {"path": str(Path(trace_dir).resolve()), "sha256": trace_fingerprint(Path(trace_dir)),
                  "name": trace.meta.get("name"), "seed": trace.meta.get("seed")},
        "options": opts.model_dump(mode="json"),
        "endpoints": list(endpoints),
        "server_config": config.redacted() if config else None,
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "started_at": started,
        "ended_at": ended,
        "aborted": st.abort_reason,
        "prefix_cache_reset": reset,
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return ReplayOutcome(run_dir=run_dir, summary=summary, aborted=st.abort_reason)


def _reset_prefix_caches(endpoints: list[str], headers: dict[str, str]) -> dict[str, str]:
    """Empty each server's prefix cache (vLLM dev mode); the outcome per endpoint goes into the manifest."""
    import httpx

    out = {}
    for ep in endpoints:
        try:
            r = httpx.post(ep.rstrip("/") + "/reset_prefix_cache", headers=headers, timeout=30)
            out[ep] = "reset" if r.status_code == 200 else f"not reset (HTTP {r.status_code}; start vLLM with " \
                                                          "VLLM_SERVER_DEV_MODE=1)"
        except httpx.HTTPError as exc:
            out[ep] = f"not reset ({exc.__class__.__name__})"
    return out


def _check_vocab(trace, facts: list[dict]) -> None:
    """Token ids beyond the model's vocabulary would be rejected one by one; catch them before sending."""
    if not len(trace.seg_tokens):
        return
    top = int(trace.seg_tokens.max())
    meta_vocab = (trace.meta.get("tokenizer") or {}).get("vocab_size")
    if meta_vocab and top >= int(meta_vocab):
        raise KvscopeError(f"trace has token id {top}, outside its tokenizer's vocabulary of {meta_vocab}")


def _kvscope_version() -> str:
    try:
        from importlib.metadata import version

        return version("kvscope")
    except Exception:  # noqa: BLE001
        return "unknown"
