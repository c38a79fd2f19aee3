"""The replay hot path: a minimal HTTP/1.1 keep-alive streaming client on asyncio protocols.

Why: aiohttp spends ~250 us of Python per streamed request (request/response objects, stream readers, a
coroutine resumption per line). Replay needs one thing only -- POST a JSON body, parse a chunked (or
Content-Length / read-until-close) SSE response, timestamp each token chunk -- and that can be done inside
`data_received` with no per-line coroutine or task. Everything else (https, /health, /metrics) stays on
aiohttp/httpx. The SSE body is decoded by `sse.SseDecoder`, the same decoder the aiohttp path uses.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from kvscope.harness.serving.request import CompletionResult, Timeouts, Watchdog
from kvscope.harness.serving.sse import SseDecoder
from kvscope.harness.common.limits import is_fd_exhaustion

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
        self.dog: Watchdog | None = None
        self.sse: SseDecoder | None = None
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
        had_first = res.first_token_s is not None  # type: ignore[union-attr]
        if not self.sse.feed(data, now):  # type: ignore[union-attr]
            self._fail(res.error_class, res.error or "")  # type: ignore[union-attr]
            return
        if not had_first and res.first_token_s is not None:  # type: ignore[union-attr]
            self.dog.first_token(now)  # type: ignore[union-attr]

    # ---- request lifecycle --------------------------------------------------------------------------
    def start(self, data: bytes, res: CompletionResult, fut: asyncio.Future, timeouts: Timeouts) -> None:
        self.res = res
        self.fut = fut
        self._reset_parser()
        self.sse = SseDecoder(res)
        self.dog = Watchdog(self.pool.loop, timeouts, res.sent_s, self._expire)
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
        self.sse = None
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
        elif not self.sse.saw_done:  # type: ignore[union-attr]
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
