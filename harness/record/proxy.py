"""The recording reverse proxy: an aiohttp server that forwards everything to one upstream and logs exchanges.

Why this shape: the proxy must add almost nothing to time-to-first-token, so the hot path only copies bytes.
Response chunks are written to the client *before* they are parsed; the exchange (request body, response text,
tool calls, usage, wall-clock times) is appended to ``exchanges.jsonl`` as one whole line with one ``os.write``
after the response ended (the replay records' crash-safety, :class:`RecordWriter`). Tokenization, session
assignment and the trace are derived later from that log (:mod:`kvscope.harness.record.build`), at shutdown or
by ``kvscope record --finalize``, so a killed proxy loses at most the exchanges in flight.

Only ``/v1/chat/completions`` and ``/v1/completions`` are recorded; every other path (``/v1/models``,
``/tokenize``, ``/metrics`` …) is forwarded untouched. Request bodies are forwarded byte for byte, except that a
streaming request without ``stream_options.include_usage`` gets it added (usage carries the cached tokens) and
the extra usage-only chunk this produces is dropped from the client's stream. Headers (API keys included) are
forwarded and never written; only ``X-Session-ID`` is kept.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web
from kvscope.harness.results.records import RecordWriter

EXCHANGES_LOG = "exchanges.jsonl"
RECORD_META = "record.json"
RECORDED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
SESSION_HEADER = "X-Session-ID"
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "content-encoding"}


def redact_url(url: str) -> str:
    """The upstream URL without user:password@ (it is written to record.json)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass(slots=True)
class ResponseCapture:
    """What a response said, assembled from SSE chunks or one JSON body."""

    text: list[str] = field(default_factory=list)
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
            if choice.get("index", 0) != 0:
                continue
            part = choice.get("delta") or choice.get("message")
            if part is None:  # completions
                if choice.get("text"):
                    self.text.append(choice["text"])
            else:
                if part.get("content"):
                    self.text.append(part["content"])
                for j, call in enumerate(part.get("tool_calls") or ()):
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
        got["function"]["arguments"] += fn.get("arguments") or ""

    def as_dict(self) -> dict[str, Any]:
        return {"text": "".join(self.text), "tool_calls": [self.tool_calls[i] for i in sorted(self.tool_calls)],
                "finish_reason": self.finish_reason, "usage": self.usage}


def _sse_data(line: bytes) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if not data or data == b"[DONE]":
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


class RecordingProxy:
    """Forward to ``upstream``; append one line per chat/completions exchange to ``out_dir/exchanges.jsonl``."""

    def __init__(self, upstream: str, out_dir: str | Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.writer = RecordWriter(self.out_dir, flush_interval_s=0.0, file_name=EXCHANGES_LOG)
        self._next_id = self._existing_count()
        self._session: ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        #: auth headers last seen, kept in memory only, for the /tokenize calls of the finalize step
        self.auth_headers: dict[str, str] = {}

    def _existing_count(self) -> int:
        path = self.out_dir / EXCHANGES_LOG
        return path.read_bytes().count(b"\n") if path.exists() else 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=30),
                                      connector=TCPConnector(limit=0, ttl_dns_cache=300))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        server = site._server
        self.port = server.sockets[0].getsockname()[1] if server is not None and server.sockets else port
        meta = {"format": "kvscope-record", "version": 1, "upstream": redact_url(self.upstream),
                "started_unix_s": time.time()}
        (self.out_dir / RECORD_META).write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2) + b"\n")
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.writer.close()

    # ------------------------------------------------------------------ handlers
    def _forward_headers(self, request: web.Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        body = await request.read()
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
        if parsed is not None and parsed.get("stream") and not (parsed.get("stream_options") or {}).get(
                "include_usage"):
            parsed_out = {**parsed, "stream_options": {**(parsed.get("stream_options") or {}), "include_usage": True}}
            body = orjson.dumps(parsed_out)
            injected = True
        if parsed is not None:
            for k in ("Authorization", "X-Api-Key", "Api-Key"):
                if k in request.headers:
                    self.auth_headers[k] = request.headers[k]
        url = self.upstream + request.path_qs
        capture = ResponseCapture() if parsed is not None else None
        times: dict[str, float | None] = {"first_byte": None, "done": None}
        status = 502
        try:
            assert self._session is not None
            async with self._session.request(request.method, url, data=body, headers=headers,
                                             allow_redirects=False) as up:
                status = up.status
                resp = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in _HOP_BY_HOP})
                await resp.prepare(request)
                if "text/event-stream" in up.headers.get("Content-Type", ""):
                    await self._pump_sse(up, resp, capture, injected, times)
                else:
                    data = await up.read()
                    times["first_byte"] = time.time()
                    await resp.write(data)
                    if capture is not None:
                        try:
                            obj = orjson.loads(data)
                            if isinstance(obj, dict):
                                capture.feed(obj)
                        except orjson.JSONDecodeError:
                            capture.error = "response body is not JSON"
                try:
                    await resp.write_eof()
                except ConnectionResetError:
                    # The whole body (the last SSE event included) was written; a client that closes its
                    # connection on `data: [DONE]` (the openai SDK may) only misses the chunked terminator.
                    pass
                times["done"] = time.time()
        except (TimeoutError, ClientError, OSError) as exc:
            if capture is not None:
                capture.error = f"{exc.__class__.__name__}: {exc}"[:500]
            if times["first_byte"] is None:
                self._log(api, parsed, request, received, times, status, injected, capture)
                return web.json_response({"error": {"message": f"kvscope record: upstream {redact_url(url)} "
                                                    f"failed ({exc.__class__.__name__})", "type": "BadGateway"}},
                                         status=502)
            raise
        finally:
            if times["first_byte"] is not None or capture is None:
                self._log(api, parsed, request, received, times, status, injected, capture)
        return resp

    async def _pump_sse(self, up, resp: web.StreamResponse, capture: ResponseCapture | None, injected: bool,
                        times: dict[str, float | None]) -> None:
        buf = b""
        async for data in up.content.iter_any():
            if times["first_byte"] is None:
                times["first_byte"] = time.time()
            if not injected:
                await resp.write(data)
                if capture is None:
                    continue
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    obj = _sse_data(line)
                    if obj is not None:
                        capture.feed(obj)
                continue
            buf += data
            *events, buf = buf.split(b"\n\n")
            out = []
            for ev in events:
                obj = _sse_data(ev)
                if obj is not None and capture is not None:
                    capture.feed(obj)
                    if obj.get("usage") and not obj.get("choices"):
                        continue  # the usage chunk the client did not ask for
                out.append(ev + b"\n\n")
            if out:
                await resp.write(b"".join(out))
        if buf:
            await resp.write(buf)
            if capture is not None:
                obj = _sse_data(buf)
                if obj is not None:
                    capture.feed(obj)

    def _log(self, api: str | None, parsed: dict[str, Any] | None, request: web.Request, received: float,
             times: dict[str, float | None], status: int, injected: bool, capture: ResponseCapture | None) -> None:
        if api is None or parsed is None or capture is None:
            return
        rec = {"request_id": self._next_id, "api": api, "received_unix_s": received,
               "first_byte_unix_s": times["first_byte"], "done_unix_s": times["done"], "status": status,
               "session_header": request.headers.get(SESSION_HEADER), "injected_include_usage": injected,
               "request": parsed, "response": capture.as_dict(), "error": capture.error}
        self._next_id += 1
        self.writer.write_line(orjson.dumps(rec) + b"\n")


async def serve(upstream: str, out_dir: str | Path, host: str, port: int, ready=None) -> RecordingProxy:
    """Start a proxy and wait until cancelled; the caller finalizes. ``ready(proxy)`` is called once bound."""
    proxy = RecordingProxy(upstream, out_dir)
    await proxy.start(host, port)
    if ready is not None:
        ready(proxy)
    try:
        await asyncio.Event().wait()
    finally:
        await proxy.close()
    return proxy
