"""Streaming OpenAI-compatible requests with per-chunk timing.

One request = one `CompletionResult`: when it was sent, when the first token arrived, when every later
token-carrying chunk arrived, the generated token ids, and the server's usage (with
`prompt_tokens_details.cached_tokens`). Token-id prompts on `/v1/completions` are the exact path: what the
prefix cache sees is exactly what kvscope planned. Server and network failures never raise: they are
recorded with an error class, because a profiler must count failures, not die of them.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import orjson

from kvscope.harness.common.limits import is_fd_exhaustion


@dataclass(frozen=True)
class Timeouts:
    """Every request is bounded: connecting, waiting for the first token, between chunks, and in total."""

    connect_s: float = 10.0
    first_token_s: float = 600.0
    idle_s: float = 120.0
    total_s: float = 1800.0


@dataclass(slots=True)
class CompletionResult:
    sent_s: float  # time.perf_counter() at send
    first_token_s: float | None = None
    done_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    error_class: str | None = None
    error: str | None = None
    text_chunks: int = 0  # chunks with text but no token ids (chat without return_token_ids)
    text_head: str = ""  # the first TEXT_HEAD_CHARS characters of generated text (shown, escaped, in reports)

    @property
    def ok(self) -> bool:
        return self.error_class is None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s if self.first_token_s is not None else math.nan

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.sent_s if self.done_s is not None else math.nan

    @property
    def output_tokens(self) -> int:
        if self.token_ids:
            return len(self.token_ids)
        return self.completion_tokens or 0

    def fail(self, error_class: str, message: str) -> "CompletionResult":
        self.error_class = error_class
        self.error = message[:500]
        self.done_s = time.perf_counter()
        return self


def completion_payload(
    model: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    cache_salt: str | None = None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    prompt = prompt_token_ids if isinstance(prompt_token_ids, list) else (
        prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else [int(t) for t in prompt_token_ids])
    body = _streaming_body(model, "prompt", prompt, max_tokens, cache_salt, ignore_eos, temperature)
    if extra:
        body.update(extra)
    return body


def chat_payload(model: str, messages: list[dict[str, str]], max_tokens: int, cache_salt: str | None = None,
                 ignore_eos: bool = True, temperature: float = 0.0) -> dict[str, Any]:
    return _streaming_body(model, "messages", messages, max_tokens, cache_salt, ignore_eos, temperature)


def _streaming_body(model: str, key: str, value: Any, max_tokens: int, cache_salt: str | None, ignore_eos: bool,
                    temperature: float) -> dict[str, Any]:
    """The streaming request fields kvscope always sends: exact output length, usage and token ids back."""
    body: dict[str, Any] = {
        "model": model,
        key: value,
        "max_tokens": int(max_tokens),
        "ignore_eos": ignore_eos,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


TEXT_HEAD_CHARS = 200


def _keep_text(result: CompletionResult, choice: dict[str, Any]) -> None:
    if len(result.text_head) < TEXT_HEAD_CHARS:
        delta = choice.get("delta")
        text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
        if isinstance(text, str) and text:
            result.text_head = (result.text_head + text)[:TEXT_HEAD_CHARS]


def apply_chunk(result: CompletionResult, chunk: dict[str, Any], now_s: float) -> None:
    """Fold one SSE `data:` JSON object into the result (token ids, timings, usage)."""
    choices = chunk.get("choices")
    if choices:
        for choice in choices:
            _keep_text(result, choice)
            ids = choice.get("token_ids")
            if ids:
                if result.first_token_s is None:
                    result.first_token_s = now_s
                result.token_ids.extend(ids)
                result.chunk_times_s.append(now_s)
                result.chunk_tokens.append(len(ids))
            else:
                delta = choice.get("delta")
                text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
                if text:
                    if result.first_token_s is None:
                        result.first_token_s = now_s
                    result.chunk_times_s.append(now_s)
                    result.chunk_tokens.append(1)
                    result.text_chunks += 1
            reason = choice.get("finish_reason")
            if reason:
                result.finish_reason = reason
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        # vLLM 0.11 omits the details when nothing was cached: a missing value means 0.
        result.cached_tokens = int(details.get("cached_tokens") or 0)


class _Watchdog:
    """One timer per request enforcing the first-token, idle and total limits without a task per read.

    The timer is armed for the nearest deadline; when it fires it re-checks against the latest activity
    (`touch()` is a plain attribute store, so per-chunk cost is nil) and either re-arms or fires `on_expire`.
    """

    __slots__ = ("loop", "timeouts", "sent", "last", "first_seen", "handle", "reason", "on_expire")

    def __init__(self, loop, timeouts: Timeouts, sent: float, on_expire) -> None:
        self.loop = loop
        self.timeouts = timeouts
        self.sent = sent
        self.last = sent
        self.first_seen = False
        self.reason: tuple[str, str] | None = None
        self.on_expire = on_expire
        # Armed for the nearest limit; the idle limit is never due before `idle_s` has passed, so a request that
        # completes sooner costs exactly one call_later and one cancel.
        self.handle = loop.call_later(min(timeouts.first_token_s, timeouts.total_s, timeouts.idle_s), self._fire)

    def first_token(self, now: float) -> None:
        """From now on the idle limit applies (a flag only: the timer re-checks when it fires)."""
        self.first_seen = True
        self.last = now

    def cancel(self) -> None:
        self.handle.cancel()

    def _fire(self) -> None:
        now = time.perf_counter()
        t = self.timeouts
        total_at = self.sent + t.total_s
        if now >= total_at - 1e-4:
            self.reason = ("timeout", f"request exceeded {t.total_s} s in total")
        elif not self.first_seen:
            first_at = self.sent + t.first_token_s
            if now >= first_at - 1e-4:
                self.reason = ("first_token_timeout", f"no token within {t.first_token_s} s")
            else:  # poll at the idle period so a late first token still gets its idle limit on time
                self.handle = self.loop.call_later(min(first_at - now, total_at - now, t.idle_s), self._fire)
                return
        else:
            idle_at = self.last + t.idle_s
            if now >= idle_at - 1e-4:
                self.reason = ("idle_timeout", f"no data for {t.idle_s} s mid-stream")
            else:
                self.handle = self.loop.call_later(min(idle_at, total_at) - now, self._fire)
                return
        self.on_expire()


def parse_sse_payload(result: CompletionResult, data: bytes, now: float) -> bool | None:
    """Fold one SSE `data:` payload into `result`. True: `[DONE]`; None: the request failed (recorded)."""
    if data == b"[DONE]":
        return True
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        result.fail("malformed_stream", "invalid JSON in SSE data: " + data[:200].decode(errors="replace"))
        return None
    if type(chunk) is not dict:
        result.fail("malformed_stream", "SSE data is not a JSON object")
        return None
    if "error" in chunk and not chunk.get("choices"):
        err = chunk["error"]
        result.fail("server_error", str(err.get("message", err) if isinstance(err, dict) else err))
        return None
    apply_chunk(result, chunk, now)
    return False


_SSE_FIELDS = (b"event:", b"id:", b"retry:", b":")


def check_sse_line(line: bytes) -> bool:
    """A non-data SSE line: empty (event boundary), a comment, or a field kvscope ignores."""
    return not line.strip() or line.startswith(_SSE_FIELDS)


async def stream_request(session, url: str, payload: dict[str, Any] | bytes, headers: dict[str, str] | None = None,
                         timeouts: Timeouts = Timeouts()) -> CompletionResult:
    """POST a streaming request with aiohttp and time every chunk. Never raises for server or network faults.

    The general path (https, proxies, anything aiohttp supports). `FastStreamClient` is the replay hot path.
    """
    import aiohttp

    result = CompletionResult(sent_s=time.perf_counter())
    body = payload if isinstance(payload, bytes) else orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    hdrs = {"Content-Type": "application/json"}
    if headers:
        hdrs.update(headers)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s,
                                    sock_read=max(timeouts.idle_s, timeouts.first_token_s) + 1.0)  # backstop
    saw_done = False
    resp_box: list = []

    def expire() -> None:
        if resp_box:
            resp_box[0].close()  # the pending read raises; the watchdog's reason names the limit
        elif task is not None:
            task.cancel()

    task = asyncio.current_task()
    dog = _Watchdog(asyncio.get_running_loop(), timeouts, result.sent_s, expire)
    try:
        async with session.post(url, data=body, headers=hdrs, timeout=timeout) as resp:
            resp_box.append(resp)
            result.http_status = resp.status
            if resp.status != 200:
                text = (await resp.read())[:500].decode(errors="replace")
                return result.fail(f"http_{resp.status}", text or resp.reason or "")
            content = resp.content
            while True:
                line = await content.readline()
                if not line:
                    break
                now = time.perf_counter()
                dog.last = now
                if not line.startswith(b"data:"):
                    if check_sse_line(line):
                        continue
                    return result.fail("malformed_stream", "not an SSE line: " + line[:200].decode(errors="replace"))
                had_first = result.first_token_s is not None
                r = parse_sse_payload(result, line[5:].strip(), now)
                if r is None:
                    return result
                if r:
                    saw_done = True
                    break
                if not had_first and result.first_token_s is not None:
                    dog.first_token(now)
        result.done_s = time.perf_counter()
        if not saw_done:
            return result.fail("truncated_stream", "stream ended without [DONE]")
        if result.prompt_tokens is None:
            return result.fail("missing_usage", "stream had no usage chunk (stream_options.include_usage ignored?)")
    except asyncio.CancelledError:
        if dog.reason is None:
            raise
        if task is not None:
            task.uncancel()
        return result.fail(*dog.reason)
    except asyncio.TimeoutError:  # before ClientConnectionError: aiohttp's socket timeouts are both
        if dog.reason is not None:
            return result.fail(*dog.reason)
        if result.first_token_s is None:
            return result.fail("first_token_timeout", f"no token within {timeouts.first_token_s} s")
        return result.fail("idle_timeout", f"no data for {timeouts.idle_s} s mid-stream")
    except aiohttp.ClientResponseError as exc:
        return result.fail("http_error", f"{exc.status} {exc.message}")
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
        if dog.reason is not None:
            return result.fail(*dog.reason)
        cls = "stream_interrupted" if result.http_status == 200 else "connection_error"
        cls = "client_fd_exhausted" if is_fd_exhaustion(exc) else cls
        return result.fail(cls, f"{exc.__class__.__name__}: {exc}")
    except aiohttp.ClientError as exc:
        return result.fail("client_error", f"{exc.__class__.__name__}: {exc}")
    finally:
        dog.cancel()
    return result


async def stream_completion(session, url: str, payload: dict[str, Any], headers: dict[str, str] | None = None,
                            timeout_s: float = 600.0) -> CompletionResult:
    """Back-compatible wrapper: one overall timeout."""
    return await stream_request(session, url, payload, headers,
                                Timeouts(total_s=timeout_s, first_token_s=timeout_s, idle_s=timeout_s))


# ==== the replay hot path: a minimal HTTP/1.1 keep-alive streaming client on asyncio protocols ============
#
# Why: aiohttp spends ~250 us of Python per streamed request (request/response objects, stream readers, a
# coroutine resumption per line). Replay needs one thing only -- POST a JSON body, parse a chunked (or
# Content-Length / read-until-close) SSE response, timestamp each token chunk -- and that can be done inside
# `data_received` with no per-line coroutine or task. Everything else (https, /health, /metrics) stays on
# aiohttp/httpx.

_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _LENGTH, _UNTIL_CLOSE, _IDLE, _DONE_PENDING = range(9)
_MAX_HEAD = 65536
_MAX_ERR_BODY = 2000


class HttpProtocolError(Exception):
    pass


class _Conn(asyncio.Protocol):
    """One keep-alive connection; runs at most one request at a time."""

    def __init__(self, pool: "FastStreamClient", key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.res: CompletionResult | None = None
        self.fut: asyncio.Future | None = None
        self.dog: _Watchdog | None = None
        self.served = 0  # responses completed on this connection
        self.stale = False  # closed cleanly by the server before answering a reused connection's request
        self._reset_parser()

    def _reset_parser(self) -> None:
        self.phase = _HEAD
        self.buf = b""
        self.remaining = 0
        self.status = 0
        self.keep_alive = True
        self.streaming = False
        self.sse_tail = b""
        self.saw_done = False
        self.err_body = bytearray()
        self.got_bytes = False

    # ---- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc) -> None:  # type: ignore[override]
        self.closed = True
        if self.res is not None:
            if self.phase == _UNTIL_CLOSE and exc is None:
                self._complete()
            elif self.status:
                detail = f": {exc}" if exc else ""
                self._fail("stream_interrupted" if self.status == 200 else "connection_error",
                           f"connection closed mid-response after {len(self.res.token_ids)} tokens{detail}")
            else:
                self.stale = exc is None and self.served > 0 and not self.got_bytes
                self._fail("connection_error", "connection closed before any response" +
                           (f" ({exc.__class__.__name__}: {exc})" if exc else "") +
                           (" (partial status line)" if self.got_bytes else ""))

    def eof_received(self) -> bool:  # type: ignore[override]
        return False  # close our side too; connection_lost follows

    def data_received(self, data: bytes) -> None:  # type: ignore[override]
        res = self.res
        if res is None:  # bytes on an idle connection: the server is confused; don't reuse it
            self.closed = True
            self.transport.abort()  # type: ignore[union-attr]
            return
        now = time.perf_counter()
        self.got_bytes = True
        dog = self.dog
        dog.last = now  # type: ignore[union-attr]
        try:
            self._parse(self.buf + data if self.buf else data, now)
        except (HttpProtocolError, ValueError) as exc:
            self._fail("protocol_error", f"invalid HTTP response: {exc}")

    # ---- parsing ------------------------------------------------------------------------------------
    def _parse(self, buf: bytes, now: float) -> None:
        pieces: list[bytes] = []  # body bytes of this read, fed to the SSE parser in one go
        try:
            self._parse_into(buf, pieces)
        finally:
            if pieces and self.res is not None:
                self._body(pieces[0] if len(pieces) == 1 else b"".join(pieces), now)
        if self.phase == _DONE_PENDING and self.res is not None:
            self._complete()

    def _parse_into(self, buf: bytes, pieces: list[bytes]) -> None:
        pos = 0
        self.buf = b""
        n = len(buf)
        body = pieces.append
        while self.res is not None:
            phase = self.phase
            if phase == _CHUNK_SIZE:
                j = buf.find(b"\r\n", pos)
                if j < 0:
                    if n - pos > 1024:
                        raise HttpProtocolError("chunk size line too long")
                    self.buf = buf[pos:]
                    return
                size = int(buf[pos:j].split(b";", 1)[0], 16)
                pos = j + 2
                if size == 0:
                    self.phase = _TRAILERS
                else:
                    self.remaining = size
                    self.phase = _CHUNK_DATA
            elif phase == _CHUNK_DATA:
                if pos >= n:
                    return
                r = self.remaining
                if n - pos >= r:
                    body(buf[pos:pos + r])
                    pos += r
                    self.phase = _CHUNK_CRLF
                else:
                    body(buf[pos:])
                    self.remaining = r - (n - pos)
                    return
            elif phase == _CHUNK_CRLF:
                if n - pos < 2:
                    self.buf = buf[pos:]
                    return
                if buf[pos:pos + 2] != b"\r\n":
                    raise HttpProtocolError("chunk not followed by CRLF")
                pos += 2
                self.phase = _CHUNK_SIZE
            elif phase == _HEAD:
                j = buf.find(b"\r\n\r\n", pos)
                if j < 0:
                    if n - pos > _MAX_HEAD:
                        raise HttpProtocolError("response headers too large")
                    self.buf = buf[pos:]
                    return
                self._headers(buf[pos:j])
                pos = j + 4
            elif phase == _TRAILERS:
                j = buf.find(b"\r\n", pos)
                if j < 0:
                    self.buf = buf[pos:]
                    return
                empty = j == pos
                pos = j + 2
                if empty:
                    if pos < n:  # pipelining is never used: extra bytes mean a confused server
                        self.keep_alive = False
                    self.phase = _DONE_PENDING
                    return
            elif phase == _LENGTH:
                take = min(self.remaining, n - pos)
                if take:
                    body(buf[pos:pos + take])
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    if pos < n:
                        self.keep_alive = False
                    self.phase = _DONE_PENDING
                return
            elif phase == _UNTIL_CLOSE:
                if pos < n:
                    body(buf[pos:])
                return
            else:  # _DONE_PENDING / _IDLE
                if pos < n:
                    self.keep_alive = False
                return

    def _headers(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status_line = lines[0]
        if not status_line.startswith(b"HTTP/1."):
            raise HttpProtocolError(f"bad status line {status_line[:80]!r}")
        self.status = status = int(status_line[9:12])
        if 100 <= status < 200:  # informational: another head follows
            return
        self.res.http_status = status  # type: ignore[union-attr]
        chunked = False
        length = -1
        keep = not status_line.startswith(b"HTTP/1.0")
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection":
                v = value.strip().lower()
                if v == b"close":
                    keep = False
                elif v == b"keep-alive":
                    keep = True
        self.keep_alive = keep
        self.streaming = status == 200
        if status in (204, 304):
            self.phase = _DONE_PENDING
        elif chunked:
            self.phase = _CHUNK_SIZE
        elif length >= 0:
            self.remaining = length
            self.phase = _LENGTH if length else _DONE_PENDING
        else:
            self.keep_alive = False
            self.phase = _UNTIL_CLOSE

    def _body(self, data: bytes, now: float) -> None:
        if not self.streaming:
            if len(self.err_body) < _MAX_ERR_BODY:
                self.err_body += data[:_MAX_ERR_BODY]
            return
        res = self.res
        if self.sse_tail:
            data = self.sse_tail + data
            self.sse_tail = b""
        lines = data.split(b"\n")
        last = lines.pop()
        if last:
            if len(last) > 1 << 24:
                raise HttpProtocolError("SSE line over 16 MiB")
            self.sse_tail = last
        had_first = res.first_token_s is not None  # type: ignore[union-attr]
        loads = orjson.loads
        for line in lines:
            if line[:5] != b"data:":
                if check_sse_line(line):
                    continue
                self._fail("malformed_stream", "not an SSE line: " + line[:200].decode(errors="replace"))
                return
            if self.saw_done:
                continue
            payload = line[6:] if line[5:6] == b" " else line[5:]
            if payload[-1:] in (b"\r", b" "):
                payload = payload.strip()
            if payload == b"[DONE]":
                self.saw_done = True
                continue
            # fast path: one choice carrying token ids (vLLM completions with return_token_ids)
            try:
                chunk = loads(payload)
            except orjson.JSONDecodeError:
                chunk = None
            if type(chunk) is dict and "error" not in chunk:
                choices = chunk.get("choices")
                if choices and len(choices) == 1 and chunk.get("usage") is None:
                    choice = choices[0]
                    ids = choice.get("token_ids")
                    if ids and type(ids) is list:
                        if len(res.text_head) < TEXT_HEAD_CHARS:  # type: ignore[union-attr]
                            _keep_text(res, choice)  # type: ignore[arg-type]
                        if res.first_token_s is None:  # type: ignore[union-attr]
                            res.first_token_s = now  # type: ignore[union-attr]
                        res.token_ids.extend(ids)  # type: ignore[union-attr]
                        res.chunk_times_s.append(now)  # type: ignore[union-attr]
                        res.chunk_tokens.append(len(ids))  # type: ignore[union-attr]
                        reason = choice.get("finish_reason")
                        if reason:
                            res.finish_reason = reason  # type: ignore[union-attr]
                        continue
                apply_chunk(res, chunk, now)  # type: ignore[arg-type]
                continue
            if parse_sse_payload(res, payload.strip(), now) is None:  # type: ignore[arg-type]
                self._fail(res.error_class, res.error or "")  # type: ignore[union-attr]
                return
        if not had_first and res.first_token_s is not None:  # type: ignore[union-attr]
            self.dog.first_token(now)  # type: ignore[union-attr]

    # ---- request lifecycle --------------------------------------------------------------------------
    def start(self, data: bytes, res: CompletionResult, fut: asyncio.Future, timeouts: Timeouts) -> None:
        self.res = res
        self.fut = fut
        self._reset_parser()
        self.dog = _Watchdog(self.pool.loop, timeouts, res.sent_s, self._expire)
        try:
            self.transport.write(data)  # type: ignore[union-attr]
        except (RuntimeError, OSError) as exc:  # uvloop: the transport closed under us before the write
            self.stale = self.served > 0
            self._fail("connection_error", f"connection closed before the request was sent ({exc})")

    def _expire(self) -> None:
        if self.res is not None and self.dog is not None and self.dog.reason is not None:
            self._fail(*self.dog.reason)

    def _release(self) -> CompletionResult | None:
        res, fut = self.res, self.fut
        self.res = self.fut = None
        if self.dog is not None:
            self.dog.cancel()
            self.dog = None
        if fut is not None and not fut.done():
            fut.set_result(res)
        return res

    def _complete(self) -> None:
        res = self.res
        assert res is not None
        res.done_s = time.perf_counter()
        if self.status != 200:
            res.fail(f"http_{self.status}", bytes(self.err_body[:500]).decode(errors="replace"))
        elif not self.saw_done:
            res.fail("truncated_stream", "stream ended without [DONE]")
        elif res.prompt_tokens is None:
            res.fail("missing_usage", "stream had no usage chunk (stream_options.include_usage ignored?)")
        reusable = self.keep_alive and not self.closed and self.phase != _UNTIL_CLOSE
        self.phase = _IDLE
        self.served += 1
        self._release()
        if reusable:
            self.pool._put(self)
        else:
            self.close()

    def _fail(self, error_class: str | None, message: str) -> None:
        res = self.res
        if res is None:
            return
        if res.error_class is None or res.error_class != error_class:
            res.fail(error_class or "client_error", message)
        self.close(abort=True)
        self._release()

    def close(self, abort: bool = False) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            if abort:
                self.transport.abort()
            else:
                self.transport.close()
        self.closed = True


class FastStreamClient:
    """Streaming POSTs over pooled HTTP/1.1 keep-alive connections (plain http only).

    `post_stream(url, body)` returns a `CompletionResult` with the same fields and error classes as
    `stream_request`; it never raises for server or network faults. Each request is bounded by
    `Timeouts`: connect (new connections), first token, idle gap after the first token, and total.
    Idle pooled connections older than `keepalive_s` are closed rather than reused, so a server's own
    keep-alive timeout (uvicorn: 5 s) never races a request onto a connection it is closing.
    """

    def __init__(self, timeouts: Timeouts = Timeouts(), headers: dict[str, str] | None = None,
                 keepalive_s: float = 4.0) -> None:
        self.timeouts = timeouts
        self.keepalive_s = keepalive_s
        self._extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}
        self._all: set[_Conn] = set()
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None  # type: ignore[assignment]
        self.connections_opened = 0
        self.stale_retries = 0

    @staticmethod
    def supports(url: str) -> bool:
        return url.startswith("http://")

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        t = self._targets.get(url)
        if t is None:
            from urllib.parse import urlsplit

            u = urlsplit(url)
            if u.scheme != "http":
                raise ValueError(f"FastStreamClient speaks plain http only, not {url}")
            host = u.hostname or "127.0.0.1"
            port = u.port or 80
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            hosthdr = u.netloc.rsplit("@", 1)[-1]
            prefix = (f"POST {path} HTTP/1.1\r\nHost: {hosthdr}\r\nContent-Type: application/json\r\n"
                      f"Accept: text/event-stream\r\nUser-Agent: kvscope\r\n").encode("latin-1") + self._extra
            t = ((host, port), prefix)
            self._targets[url] = t
        return t

    def _put(self, conn: _Conn) -> None:
        conn.idle_since = time.perf_counter()
        self._idle.setdefault(conn.key, []).append(conn)

    async def _acquire(self, key: tuple[str, int], connect_s: float) -> _Conn:
        idle = self._idle.get(key)
        if idle:
            now = time.perf_counter()
            while idle:
                conn = idle.pop()
                if not conn.closed and now - conn.idle_since < self.keepalive_s and \
                        not conn.transport.is_closing():  # type: ignore[union-attr]
                    return conn
                conn.close()
                self._all.discard(conn)
        self.loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            self.loop.create_connection(lambda: _Conn(self, key), key[0], key[1]), connect_s)
        self._all.add(conn)
        self.connections_opened += 1
        return conn

    async def post_stream(self, url: str, body: bytes, timeouts: Timeouts | None = None,
                          headers: dict[str, str] | None = None) -> CompletionResult:
        timeouts = timeouts or self.timeouts
        key, prefix = self._target(url)
        extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()) if headers else b""
        data = prefix + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body
        for _ in range(2):
            res = CompletionResult(sent_s=time.perf_counter())
            try:
                conn = await self._acquire(key, min(timeouts.connect_s, timeouts.total_s))
            except asyncio.TimeoutError:
                return res.fail("connect_timeout", f"no connection to {key[0]}:{key[1]} within {timeouts.connect_s} s")
            except OSError as exc:
                return res.fail("client_fd_exhausted" if is_fd_exhaustion(exc) else "connection_error",
                                f"connect to {key[0]}:{key[1]} failed: "
                                                    f"{exc.__class__.__name__}: {exc}")
            fut = self.loop.create_future()
            conn.start(data, res, fut, timeouts)
            try:
                await fut
            except asyncio.CancelledError:
                conn.close(abort=True)
                conn._release()
                raise
            if not conn.stale:
                return res
            # The server had closed this idle keep-alive connection (clean FIN, no byte answered) just as the
            # request went out: it never saw the request. Send it once more on a fresh connection -- the
            # keep-alive race every HTTP client handles; a reset (RST) or any answered byte is never retried.
            self.stale_retries += 1
        return res

    async def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()

    async def __aenter__(self) -> "FastStreamClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
