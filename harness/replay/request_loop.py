"""One request of a replay, from the trace row to the record on disk: pick the endpoint, predict its cached
tokens, build the body, stream it (with retries), turn the result into a :class:`RequestRecord` at once, and
after a connection-level failure ask every endpoint's ``/health`` (a dead server ends the run).

Separate from the session timing (``session_timing.py``) because the two change for different reasons: how a
request is sent, timed and recorded (clients, retries, record fields) against when a session sends its next
one (think times, arrivals, loops).  The per-request trace columns are plain lists, read once: the hot path
never touches the DataFrame.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import orjson

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.predict import OnlinePredictor
from kvscope.harness.replay.routing import EndpointRouter
from kvscope.harness.replay.run_state import CONNECTION_FAILURES, RunState
from kvscope.harness.results.records import RecordWriter, RequestRecord
from kvscope.harness.serving.client import (CompletionResult, FastStreamClient, StreamClient, chat_payload,
                                            completion_payload)

if TYPE_CHECKING:
    from kvscope.harness.serving.backend import Backend


@dataclass(frozen=True)
class Posted:
    """One request sent to one endpoint: its last try's result, the predicted cached tokens, which try it was,
    the endpoint and the output length asked."""

    result: CompletionResult
    predicted: int | None
    attempt: int
    ep: int
    max_tokens: int


class RequestLoop:
    """Sends the trace's requests to the endpoints and records each; ``clients`` and ``fast`` are set per run
    (the event loop's HTTP clients), ``on_recorded`` is called once per record (the progress bar)."""

    def __init__(self, trace, endpoints: list[str], opts: ReplayOptions, model: str, router: EndpointRouter,
                 predictors: list[OnlinePredictor | None], writer: RecordWriter, headers: dict[str, str],
                 backends: "list[Backend] | None" = None) -> None:
        self.endpoints = endpoints
        self.opts = opts
        self.model = model
        #: the model name each endpoint's requests carry (one deployment's replicas: the same name for all;
        #: model routing sets one per model's server)
        self.model_names = [model] * len(endpoints)
        self.router = router
        self.predictors = predictors
        self.writer = writer
        self.headers = headers
        self.backends = backends
        self.on_recorded: Callable[[], Any] | None = None
        df = trace.requests
        n = len(df)
        self._step = df["step"].astype(int).tolist()
        out_tok = df["output_tokens"].fillna(0).astype(int).to_numpy()
        maxt = df["max_tokens"].fillna(0).astype(int).to_numpy()
        self._planned_out = out_tok.tolist()
        self._max_tokens = np.where(maxt > 0, maxt, np.where(out_tok > 0, out_tok, 1)).astype(int).tolist()
        self._salt = [x if isinstance(x, str) and x else None for x in df["cache_salt"].tolist()]
        self._transition = df["transition"].tolist()
        self._messages = df["messages"].tolist() if opts.api == "chat" else [None] * n
        self.fast: FastStreamClient | None = None
        self.clients: list[StreamClient] = []  # per endpoint: the pooled fast client, or aiohttp
        self._alive_check: asyncio.Task | None = None
        url_path = "/v1/chat/completions" if opts.api == "chat" else "/v1/completions"
        self.urls = [e + url_path for e in endpoints]

    def use_fast(self, url: str) -> bool:
        return self.opts.client == "fast" or (self.opts.client == "auto" and FastStreamClient.supports(url))

    def _body(self, rid: int, prompt: np.ndarray, max_tokens: int, ep: int = 0, logprobs: bool = False) -> bytes:
        """``logprobs``: ask for each generated token's log-probability (a cascade's confidence signal)."""
        salt = self._salt[rid]
        engine_fields = self.backends[ep].request_extras(salt) if self.backends else None
        model = self.model_names[ep]
        if self.opts.api == "chat":
            raw = self._messages[rid]
            if not raw:
                raise KvscopeError(f"request {rid} has no messages: generate the trace in text mode for --api chat")
            msgs = [{"role": m["role"], "content": m["content"]} for m in json.loads(raw)]
            payload = chat_payload(model, msgs, max_tokens, salt, engine_fields=engine_fields)
            if logprobs:
                payload.update(logprobs=True, top_logprobs=1)
        else:
            payload = completion_payload(model, prompt.tolist(), max_tokens, salt, engine_fields=engine_fields,
                                         extra={"logprobs": 1} if logprobs else None)
        return orjson.dumps(payload)

    async def send(self, st: RunState, rid: int, session_id: str, prompt: np.ndarray,
                   scheduled_s: float) -> CompletionResult:
        ep = self.router.pick(session_id, prompt) if self.router.n > 1 else 0
        return (await self.post(st, rid, session_id, prompt, scheduled_s, ep)).result

    async def post(self, st: RunState, rid: int, session_id: str, prompt: np.ndarray, scheduled_s: float, ep: int,
                   *, logprobs: bool = False, defer_success: bool = False, fields: dict[str, Any] | None = None
                   ) -> "Posted":
        """Send one request to endpoint ``ep`` with the run's retries; every try is recorded as it ends (with
        ``fields``, model routing's), except a successful one with ``defer_success``: model routing records it
        once it knows whether the request is escalated."""
        opts = self.opts
        salt = self._salt[rid]
        predictor = self.predictors[ep]
        predicted = predictor.on_send(rid, session_id, prompt, salt) if predictor else None
        max_tokens = self._max_tokens[rid]
        body = self._body(rid, prompt, max_tokens, ep, logprobs)
        url = self.urls[ep]
        client = self.clients[ep]
        result: CompletionResult | None = None
        for attempt in range(opts.retries + 1):
            if attempt:
                await asyncio.sleep(min(opts.retry_backoff_s * (2 ** (attempt - 1)), 30.0))
                if st.stop:
                    break
            st.sent += 1
            result = await client.post_stream(url, body, opts.timeouts)
            if not (result.ok and defer_success):
                self._record(st, rid, session_id, attempt, ep, scheduled_s, len(prompt), predicted, max_tokens,
                             result, **(fields or {}))
            if result.ok or attempt == opts.retries:
                break
        assert result is not None
        if result.ok and predictor is not None:
            predictor.on_finish(rid, session_id, prompt, result.token_ids, salt)
        return Posted(result, predicted, attempt, ep, max_tokens)

    def _record(self, st: RunState, rid: int, session_id: str, attempt: int, ep: int, scheduled_s: float,
                n_prompt: int, predicted: int | None, max_tokens: int, res: CompletionResult,
                **routing: Any) -> None:
        """Write the record of one try; ``routing``: model routing's fields of the record."""
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
            output_text_head=res.text_head, output_token_ids=list(res.token_ids), **routing,
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
            if res.error_class in CONNECTION_FAILURES:
                st.consecutive_conn_errors += 1
        if self.on_recorded is not None:
            self.on_recorded()

    async def check_alive(self, session, st: RunState, res: CompletionResult) -> None:
        """After a connection-level failure, ask /health; a dead server ends the run. Concurrent failures
        share one check."""
        if res.error_class not in CONNECTION_FAILURES or st.stop:
            return
        if self._alive_check is None or self._alive_check.done():
            self._alive_check = asyncio.ensure_future(self._health_all(session, st, res))
        await asyncio.shield(self._alive_check)

    async def _health_all(self, session, st: RunState, res: CompletionResult) -> None:
        import aiohttp  # deferred: a heavy import that only a running replay needs

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
