"""The recording reverse proxy: an aiohttp server that forwards everything to one upstream and logs exchanges.

Why this shape: the proxy must add almost nothing to time-to-first-token, so the hot path only copies bytes.
Response chunks are written to the client *before* they are parsed; the exchange (request body, response text,
tool calls, usage, wall-clock times) is appended to ``exchanges.jsonl`` as one whole line with one ``os.write``
after the response ended (the replay records' crash-safety, :class:`RecordWriter`). Tokenization, session
assignment and the trace are derived later from that log (:mod:`kvscope.harness.record.build`), at shutdown or
by ``kvscope record --finalize``, so a killed proxy loses at most the exchanges in flight. On start a torn last
line (a proxy killed mid-write) is cut off, so appending never glues a record onto half of another.

Only ``/v1/chat/completions`` and ``/v1/completions`` are recorded; every other path (``/v1/models``,
``/tokenize``, ``/metrics`` …) is forwarded untouched. Request bodies are forwarded byte for byte, except that a
streaming request without ``stream_options.include_usage`` gets it added (usage carries the cached tokens) and
the extra usage-only event this produces is dropped from the client's stream. SSE is split with the project's
one line splitter (:class:`~kvscope.harness.serving.sse.SseLineSplitter`: ``\\r\\n``, ``\\n`` and ``\\r``), so
every framing streams through event by event.

Secrets: headers (API keys included) are forwarded and never written; credentials in the upstream URL
(``http://user:pass@host``) become an ``Authorization: Basic`` header and never reach a log or the terminal;
credential-named fields of a request body (``api_key`` …) are redacted in the log
(:func:`~kvscope.harness.common.secrets.redact_credential_fields`). Only ``X-Session-ID`` is kept.

Shutdown (:meth:`RecordingProxy.shutdown`): the listener closes, exchanges in flight get ``drain_s`` to end,
then are cancelled and written with ``status: "interrupted"`` (what they had streamed so far). A client that
leaves mid-stream cancels its handler (aiohttp ``handler_cancellation``), which closes the upstream request and
writes the exchange with ``status: "client_disconnected"`` — unless the client already had the whole answer
(the ``[DONE]`` event, or the whole JSON body): the openai SDK closes its connection on ``[DONE]``, often before
the upstream's end of stream, and such an exchange (and one cut by shutdown at that point) is complete. Every
wait has a bound: reading a request body,
connecting upstream, each upstream read.

A log that cannot grow (a full disk, ``ulimit -f``) stops the recording loudly: one line on stderr naming the
file and the error, then a 503 for every request, so an agent never runs on unrecorded; the whole lines already
written stay readable (:class:`RecordWriter` cuts a torn write back).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web
from kvscope.harness.common.secrets import (
    CREDENTIAL_KEY_IN_JSON_RE,
    redact_credential_fields,
    split_url_credentials,
)
from kvscope.harness.results.records import DiskFullError, RecordWriter
from kvscope.harness.serving.sse import SseLineSplitter

EXCHANGES_LOG = "exchanges.jsonl"
RECORD_META = "record.json"
RECORDED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
SESSION_HEADER = "X-Session-ID"
_AUTH_HEADERS = {"authorization", "x-api-key", "api-key"}
INTERRUPTED = "interrupted"
CLIENT_DISCONNECTED = "client_disconnected"
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "content-encoding"}


@dataclass(frozen=True, slots=True)
class ProxyTimeouts:
    """Bounds on every wait of the proxy (seconds)."""

    connect_s: float = 30.0  # TCP connect to the upstream
    upstream_read_s: float = 600.0  # silence between two upstream reads (a long prefill before the first token)
    client_body_s: float = 60.0  # reading a client's request body
    drain_s: float = 5.0  # at shutdown, how long exchanges in flight get to end


def redact_url(url: str) -> str:
    """The URL without user:password@ (it is written to record.json and printed)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def repair_torn_log(path: Path) -> int:
    """Cut a torn last line (no newline: the writer was killed mid-write) off ``path``; the bytes removed."""
    if not path.is_file():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        pos, keep = size, 0
        while pos > 0:  # find the last newline, reading backwards in 64 KiB steps
            step = min(pos, 1 << 16)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = pos + i + 1
                break
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


class ContentDecodeError(ValueError):
    """A response body that its Content-Encoding does not decode (corrupt or cut short)."""


def _brotli_module():
    for name in ("brotli", "brotlicffi"):
        try:
            return __import__(name)
        except ImportError:
            continue
    return None


class _ZlibStep:
    """gzip (every member of a multi-member stream) or deflate (zlib-wrapped, or raw as some servers send it)."""

    def __init__(self, gzip: bool) -> None:
        self.gzip = gzip
        self.obj: Any = zlib.decompressobj(zlib.MAX_WBITS | 16) if gzip else None

    def decompress(self, data: bytes) -> bytes:
        if self.obj is None:  # deflate: zlib header (CM = 8) or raw deflate, decided by the first byte
            if not data:
                return b""
            self.obj = zlib.decompressobj(zlib.MAX_WBITS if data[0] & 0x0F == 8 else -zlib.MAX_WBITS)
        out = [self.obj.decompress(data)]
        while self.gzip and self.obj.eof and self.obj.unused_data:  # the next gzip member
            rest = self.obj.unused_data
            self.obj = zlib.decompressobj(zlib.MAX_WBITS | 16)
            out.append(self.obj.decompress(rest))
        return b"".join(out)

    def flush(self) -> bytes:
        if self.obj is None:
            return b""
        tail = self.obj.flush()
        if not self.obj.eof:
            raise ContentDecodeError(f"the {'gzip' if self.gzip else 'deflate'} stream ended before its end")
        return tail


class ContentDecoder:
    """Undoes a response's ``Content-Encoding`` chunk by chunk, so the proxy parses (and re-frames) the text the
    upstream meant. Why decode rather than pass the bytes through: the proxy drops the usage event it injected,
    which it can only find in decoded text, and it must record what was said; the client gets identity bytes
    (``Content-Encoding`` is not forwarded). gzip and deflate always, br where ``brotli`` is installed;
    :data:`ACCEPT` offers the upstream exactly these. An encoding not in the list gets no decoder: that response
    is forwarded as it came, header included, and recorded as a failure."""

    ACCEPT = "gzip, deflate" + (", br" if _brotli_module() is not None else "")

    def __init__(self, steps: list[Any]) -> None:
        self._steps = steps  # in decoding order: the header lists encodings in the order they were applied

    @classmethod
    def for_header(cls, header: str | None) -> ContentDecoder | None:
        steps: list[Any] = []
        for enc in reversed([e.strip().lower() for e in (header or "").split(",") if e.strip()]):
            if enc == "identity":
                continue
            if enc in ("gzip", "x-gzip", "deflate"):
                steps.append(_ZlibStep(gzip=enc != "deflate"))
            elif enc == "br" and _brotli_module() is not None:
                steps.append(_brotli_module().Decompressor())
            else:
                return None
        return cls(steps)

    @property
    def identity(self) -> bool:
        return not self._steps

    def decode(self, data: bytes) -> bytes:
        try:
            for step in self._steps:
                data = step.decompress(data) if hasattr(step, "decompress") else step.process(data)
        except ContentDecodeError:
            raise
        except Exception as exc:  # noqa: BLE001 -- zlib.error, brotli.error: the body is not what its header says
            raise ContentDecodeError(f"cannot decode the response body ({exc})") from None
        return data

    def flush(self) -> bytes:
        """The decoded tail; ContentDecodeError for a stream cut short."""
        tail = b""
        for step in self._steps:
            if tail:
                tail = step.decompress(tail) if hasattr(step, "decompress") else step.process(tail)
            if isinstance(step, _ZlibStep):
                tail += step.flush()
        return tail


@dataclass(slots=True)
class ResponseCapture:
    """What a response said, assembled from SSE chunks or one JSON body."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None

    def feed(self, obj: dict[str, Any]) -> None:
        if obj.get("usage"):
            self.usage = obj["usage"]
        if "error" in obj and not obj.get("choices"):
            self.error = str(obj["error"])[:500]
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            part = choice.get("delta") or choice.get("message")
            if not isinstance(part, dict):  # completions
                if isinstance(choice.get("text"), str):
                    self.text.append(choice["text"])
            else:
                if isinstance(part.get("content"), str):
                    self.text.append(part["content"])
                for key in ("reasoning_content", "reasoning"):
                    if isinstance(part.get(key), str):
                        self.reasoning.append(part[key])
                        break
                for j, call in enumerate(part.get("tool_calls") or ()):
                    if isinstance(call, dict):
                        self._tool_call(call.get("index", j), call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _tool_call(self, index: int, delta: dict[str, Any]) -> None:
        got = self.tool_calls.setdefault(index, {"id": None, "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
        if delta.get("id"):
            got["id"] = delta["id"]
        fn = delta.get("function") or {}
        got["function"]["name"] += fn.get("name") or ""
        args = fn.get("arguments")
        got["function"]["arguments"] += args if isinstance(args, str) else (orjson.dumps(args).decode() if args
                                                                            else "")

    def as_dict(self) -> dict[str, Any]:
        out = {"text": "".join(self.text), "tool_calls": [self.tool_calls[i] for i in sorted(self.tool_calls)],
               "finish_reason": self.finish_reason, "usage": self.usage}
        if self.reasoning:
            out["reasoning"] = "".join(self.reasoning)
        return out


def _json_object(data: bytes) -> dict[str, Any] | None:
    if not data or data == b"[DONE]":
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


class SseEvents:
    """SSE events of a byte stream: ``feed(piece)`` -> the events it completed, each as (its ``data`` payload,
    its lines as received). Data lines of one event are joined with ``\\n`` (the SSE rule)."""

    __slots__ = ("lines", "_data", "_raw", "terminator")

    def __init__(self) -> None:
        self.lines = SseLineSplitter()
        self._data: list[bytes] = []
        self._raw: list[bytes] = []
        self.terminator: bytes | None = None  # the upstream's line end, reused when an event is re-emitted

    def feed(self, piece: bytes) -> list[tuple[bytes, list[bytes]]]:
        if self.terminator is None:
            self.terminator = b"\r\n" if b"\r\n" in piece else b"\r" if b"\r" in piece else (
                b"\n" if b"\n" in piece else None)
        events = []
        for line in self.lines.feed(piece):
            if not line:
                if self._raw:
                    events.append((b"\n".join(self._data), self._raw))
                self._data, self._raw = [], []
                continue
            self._raw.append(line)
            if line[:5] == b"data:":
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
        return events

    def close(self) -> list[tuple[bytes, list[bytes]]]:
        """The last event of a stream that ended without a blank line."""
        if self.lines.tail:
            self.feed(b"\n")
        if self._raw:
            ev = [(b"\n".join(self._data), self._raw)]
            self._data, self._raw = [], []
            return ev
        return []


@dataclass(slots=True)
class _Exchange:
    """One recorded exchange in flight."""

    api: str
    parsed: dict[str, Any]
    session_header: str | None
    received: float
    injected: bool
    capture: ResponseCapture = field(default_factory=ResponseCapture)
    first_byte: float | None = None
    done: float | None = None
    #: when the client had the whole answer (the ``[DONE]`` event or the whole JSON body written to it): a
    #: client that closes its connection then (the openai SDK does on ``[DONE]``) cancels the handler before
    #: the upstream's end of stream, yet the exchange is complete
    delivered: float | None = None
    status: int | str = 502
    logged: bool = False
    may_hold_credentials: bool = True  # a credential-named key somewhere in the body's bytes


class RecordingProxy:
    """Forward to ``upstream``; append one line per chat/completions exchange to ``out_dir/exchanges.jsonl``."""

    def __init__(self, upstream: str, out_dir: str | Path, timeouts: ProxyTimeouts | None = None,
                 upstream_headers: dict[str, str] | None = None) -> None:
        clean, url_auth = split_url_credentials(upstream)
        self.upstream = clean.rstrip("/")
        #: headers every upstream request carries (credentials from the URL); they replace the client's
        self.upstream_headers = {**url_auth, **(upstream_headers or {})}
        self.timeouts = timeouts or ProxyTimeouts()
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torn = repair_torn_log(self.out_dir / EXCHANGES_LOG)
        if torn:
            warnings.warn(f"{self.out_dir / EXCHANGES_LOG}: cut off a torn last line ({torn} bytes; the previous "
                          "proxy was killed mid-write)", stacklevel=2)
        self.writer = RecordWriter(self.out_dir, flush_interval_s=0.0, file_name=EXCHANGES_LOG)
        self._next_id = self.writer.lines_on_disk
        self._session: ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._inflight: dict[asyncio.Task, _Exchange | None] = {}
        self._stopping = False
        self.port: int | None = None
        self.interrupted = 0
        #: why the log cannot grow (a full disk …), once a write failed: every request from then on is answered
        #: 503 with it, so an agent never runs on through a proxy that records nothing
        self.record_failure: str | None = None
        #: auth headers last seen, kept in memory only, for the /tokenize calls of the finalize step
        self.auth_headers: dict[str, str] = dict(self.upstream_headers)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        t = self.timeouts
        self._session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=t.connect_s,
                                                            sock_read=t.upstream_read_s),
                                      connector=TCPConnector(limit=0, ttl_dns_cache=300), auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port, reuse_address=True, shutdown_timeout=1.0)
        await self._site.start()
        server = self._site._server
        self.port = server.sockets[0].getsockname()[1] if server is not None and server.sockets else port
        meta = {"format": "kvscope-record", "version": 1, "upstream": redact_url(self.upstream),
                "started_unix_s": time.time()}
        (self.out_dir / RECORD_META).write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2) + b"\n")
        return self.port

    @property
    def in_flight(self) -> int:
        return sum(1 for ex in self._inflight.values() if ex is not None)

    async def shutdown(self, drain_s: float | None = None, on_drain=None) -> int:
        """Stop accepting; give exchanges in flight ``drain_s`` to end (``on_drain(n)`` is called first when
        some are), then cancel them (written as interrupted) and close. Returns how many were interrupted."""
        self._stopping = True
        drain_s = self.timeouts.drain_s if drain_s is None else drain_s
        if self._site is not None:
            server = self._site._server
            if server is not None:
                server.close()  # no new connections; open ones finish their exchange
        pending = [t for t in self._inflight if not t.done()]
        if pending and self.in_flight and on_drain is not None:
            on_drain(self.in_flight)
        if pending and drain_s > 0:
            await asyncio.wait(pending, timeout=drain_s)
        before = self.interrupted
        await self.cancel_inflight()
        await self.close()
        return self.interrupted - before

    async def cancel_inflight(self) -> None:
        """Cancel every handler still running (each writes its exchange as interrupted) and wait for them."""
        self._stopping = True
        pending = [t for t in self._inflight if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=2.0)

    async def close(self) -> None:
        self._stopping = True
        if self._inflight:
            await self.cancel_inflight()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        try:
            self.writer.close()
        except DiskFullError:
            if self.record_failure is None:
                raise  # said already, when it happened

    # ------------------------------------------------------------------ handlers
    def _forward_headers(self, request: web.Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        if self.upstream_headers:
            override = {k.lower() for k in self.upstream_headers}
            headers = {k: v for k, v in headers.items() if k.lower() not in override}
            headers.update(self.upstream_headers)
        headers["Accept-Encoding"] = ContentDecoder.ACCEPT  # only what the proxy can decode (ContentDecoder)
        return headers

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._inflight[task] = None
        try:
            if self.record_failure is not None:
                return web.json_response({"error": {"message": f"kvscope record: {self.record_failure}",
                                                    "type": "ServiceUnavailable"}}, status=503)
            return await self._proxy(request, task)
        finally:
            self._inflight.pop(task, None)

    async def _proxy(self, request: web.Request, task: asyncio.Task) -> web.StreamResponse:
        received = time.time()
        try:
            async with asyncio.timeout(self.timeouts.client_body_s):
                body = await request.read()
        except TimeoutError:
            return web.json_response({"error": {"message": "kvscope record: request body not received within "
                                                f"{self.timeouts.client_body_s:.0f} s", "type": "Timeout"}},
                                     status=408)
        api = RECORDED_PATHS.get(request.path) if request.method == "POST" else None
        parsed: dict[str, Any] | None = None
        if api is not None:
            try:
                parsed = orjson.loads(body)
            except orjson.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict):
                api, parsed = None, None
        headers = self._forward_headers(request)
        injected = False
        if parsed is not None and parsed.get("stream") and not (
                isinstance(parsed.get("stream_options"), dict) and parsed["stream_options"].get("include_usage")):
            so = parsed.get("stream_options") if isinstance(parsed.get("stream_options"), dict) else {}
            body = orjson.dumps({**parsed, "stream_options": {**so, "include_usage": True}})
            injected = True
        if parsed is not None:
            for k, v in headers.items():
                if k.lower() in _AUTH_HEADERS:
                    self.auth_headers[k.title()] = v  # one entry per header, whatever its case
        url = self.upstream + request.path_qs
        ex = None
        if api is not None and parsed is not None:
            ex = _Exchange(api, parsed, request.headers.get(SESSION_HEADER), received, injected,
                           may_hold_credentials=CREDENTIAL_KEY_IN_JSON_RE.search(body) is not None)
            self._inflight[task] = ex
        resp: web.StreamResponse | None = None
        try:
            assert self._session is not None
            async with self._session.request(request.method, url, data=body, headers=headers,
                                             allow_redirects=False) as up:
                if ex is not None:
                    ex.status = up.status
                out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP_BY_HOP}
                decoder = ContentDecoder.for_header(up.headers.get("Content-Encoding"))
                if decoder is None:  # an encoding the proxy cannot undo: pass it through, say it is not recorded
                    out_headers["Content-Encoding"] = up.headers["Content-Encoding"]
                    if ex is not None:
                        ex.capture.error = (f"response Content-Encoding {up.headers['Content-Encoding']!r} cannot "
                                            f"be decoded (decodable: {ContentDecoder.ACCEPT}); forwarded as it "
                                            "came, not recorded")
                resp = web.StreamResponse(status=up.status, headers=out_headers)
                await resp.prepare(request)
                if decoder is None:
                    async for data in up.content.iter_any():
                        await resp.write(data)
                elif "text/event-stream" in up.headers.get("Content-Type", ""):
                    await self._pump_sse(up, resp, ex, decoder)
                else:
                    data = await up.read()
                    if ex is not None:
                        ex.first_byte = time.time()
                    if not decoder.identity:
                        data = decoder.decode(data) + decoder.flush()
                    await resp.write(data)
                    if ex is not None:
                        ex.delivered = time.time()
                        obj = _json_object(data)
                        if obj is not None:
                            ex.capture.feed(obj)
                        else:
                            ex.capture.error = "response body is not JSON"
                try:
                    await resp.write_eof()
                except ConnectionResetError:
                    # The whole body (the last SSE event included) was written; a client that closes its
                    # connection on `data: [DONE]` (the openai SDK may) only misses the chunked terminator.
                    pass
                if ex is not None:
                    ex.done = time.time()
        except asyncio.CancelledError:
            if ex is not None and ex.delivered is not None:
                ex.done = ex.done or ex.delivered  # complete: the client had every byte of the answer
            elif ex is not None:
                ex.status = INTERRUPTED if self._stopping else CLIENT_DISCONNECTED
                ex.capture.error = ex.capture.error or (
                    "interrupted: the proxy stopped before the response ended" if self._stopping
                    else "the client closed the connection before the response ended")
                if self._stopping:
                    self.interrupted += 1
                self._log(ex)
            raise
        except (TimeoutError, ClientError, OSError, ContentDecodeError) as exc:
            if ex is not None:
                ex.capture.error = f"{exc.__class__.__name__}: {exc}"[:500]
                self._log(ex)
            if resp is None or not resp.prepared:
                return web.json_response({"error": {"message": f"kvscope record: upstream {redact_url(url)} "
                                                    f"failed ({exc.__class__.__name__})", "type": "BadGateway"}},
                                         status=502 if not isinstance(exc, TimeoutError) else 504)
            # Mid-stream: the status line is out, so the client must see a broken stream, not a clean end.
            if request.transport is not None:
                request.transport.abort()
            return resp
        finally:
            if ex is not None:
                self._log(ex)
        assert resp is not None
        return resp

    async def _pump_sse(self, up, resp: web.StreamResponse, ex: _Exchange | None, decoder: ContentDecoder) -> None:
        events = SseEvents()
        capture = ex.capture if ex is not None else None
        async for data in self._decoded(up, decoder):
            if ex is not None and ex.first_byte is None:
                ex.first_byte = time.time()
            if ex is None or not ex.injected:
                await resp.write(data)  # bytes first, parsing after: the client never waits for the parser
                if capture is not None:
                    for payload, _ in events.feed(data):
                        if payload == b"[DONE]":
                            ex.delivered = time.time()
                        obj = _json_object(payload)
                        if obj is not None:
                            capture.feed(obj)
                continue
            fed = events.feed(data)
            out = self._filter_events(fed, events.terminator or b"\n", capture)
            if out:
                await resp.write(out)
            if any(payload == b"[DONE]" for payload, _ in fed):
                ex.delivered = time.time()
        if ex is None:
            return
        if not ex.injected:  # the bytes are out already; parse an event the stream did not close
            for payload, _ in events.close():
                obj = _json_object(payload)
                if obj is not None:
                    ex.capture.feed(obj)
            return
        out = self._filter_events(events.close(), events.terminator or b"\n", capture, last=True)
        if out:
            await resp.write(out)

    @staticmethod
    async def _decoded(up, decoder: ContentDecoder):
        """The upstream's body, decoded piece by piece (empty pieces of a compressed stream skipped)."""
        async for data in up.content.iter_any():
            if decoder.identity:
                yield data
                continue
            data = decoder.decode(data)
            if data:
                yield data
        if not decoder.identity:
            tail = decoder.flush()
            if tail:
                yield tail

    @staticmethod
    def _filter_events(events: list[tuple[bytes, list[bytes]]], eol: bytes, capture: ResponseCapture | None,
                       last: bool = False) -> bytes:
        """Events to forward, re-framed with the upstream's own line end; the usage-only event the proxy
        asked for (the client did not) is dropped."""
        out = []
        for payload, raw in events:
            obj = _json_object(payload)
            if obj is not None and capture is not None:
                capture.feed(obj)
                if obj.get("usage") and not obj.get("choices"):
                    continue
            out.append(eol.join(raw) + eol + (b"" if last else eol))
        return b"".join(out)

    def _log(self, ex: _Exchange) -> None:
        if ex.logged:
            return
        ex.logged = True
        rec = {"request_id": self._next_id, "api": ex.api, "received_unix_s": ex.received,
               "first_byte_unix_s": ex.first_byte, "done_unix_s": ex.done, "status": ex.status,
               "session_header": ex.session_header, "injected_include_usage": ex.injected,
               "request": redact_credential_fields(ex.parsed) if ex.may_hold_credentials else ex.parsed,
               "response": ex.capture.as_dict(),
               "error": ex.capture.error}
        self._next_id += 1
        try:
            self.writer.write_line(orjson.dumps(rec) + b"\n")
        except (DiskFullError, OSError) as exc:
            self._cannot_record(rec["request_id"], exc)

    def _cannot_record(self, request_id: int, exc: Exception) -> None:
        """Say at once, in one line, that the log cannot grow; from now on every request gets a 503."""
        if self.record_failure is not None:
            return
        reason = str(exc) if isinstance(exc, DiskFullError) else (
            f"cannot write {self.writer.path}: {getattr(exc, 'strerror', None) or exc}")
        self.record_failure = (f"{reason} (exchange {request_id} was answered but is not recorded); answering 503 "
                               "to every new request")
        print(f"kvscope record: {self.record_failure}; Ctrl-C stops the proxy", file=sys.stderr, flush=True)
