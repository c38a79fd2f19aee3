"""Streaming OpenAI-compatible requests with per-chunk timing, behind one client interface.

One request = one `CompletionResult` (serving/request.py): when it was sent, when the first token arrived, when
every later token-carrying chunk arrived, the generated token ids, and the server's usage (with
`prompt_tokens_details.cached_tokens`). Server and network failures never raise: they are recorded with an
error class, because a profiler must count failures, not die of them.

Two transports implement :class:`StreamClient` -- `FastStreamClient` (serving/fast_http.py, the replay hot path
for plain http, about 3x `vllm bench serve`) and :class:`AiohttpStreamClient` (https, proxies, anything
aiohttp supports) -- and both decode the body with the one SSE parser in serving/sse.py, so they agree on
every token, timing and error class. :func:`open_stream_client` picks one for a URL.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal, Protocol

import orjson

from kvscope.harness.serving.fast_http import FastStreamClient, HttpProtocolError
from kvscope.harness.serving.request import (
    CompletionResult,
    Timeouts,
    Watchdog,
    chat_payload,
    completion_payload,
)
from kvscope.harness.serving.sse import (
    TEXT_HEAD_CHARS,
    SseDecoder,
    apply_chunk,
    check_sse_line,
    parse_sse_payload,
)
from kvscope.harness.common.limits import is_fd_exhaustion


__all__ = [
    "TEXT_HEAD_CHARS", "AiohttpStreamClient", "CompletionResult", "FastStreamClient", "HttpProtocolError",
    "StreamClient", "Timeouts", "apply_chunk", "chat_payload", "check_sse_line", "completion_payload",
    "open_stream_client", "parse_sse_payload", "stream_completion", "stream_request",
]


class StreamClient(Protocol):
    """What replay needs from a streaming client: POST a JSON body, get a timed result, never raise."""

    async def post_stream(self, url: str, body: bytes, timeouts: Timeouts | None = None,
                          headers: dict[str, str] | None = None) -> CompletionResult: ...

    async def close(self) -> None: ...


async def stream_request(session, url: str, payload: dict[str, Any] | bytes, headers: dict[str, str] | None = None,
                         timeouts: Timeouts = Timeouts()) -> CompletionResult:
    """POST a streaming request with aiohttp and time every chunk. Never raises for server or network faults.

    The general path (https, proxies, anything aiohttp supports). `FastStreamClient` is the replay hot path.
    """
    import aiohttp  # deferred: aiohttp is heavy, only talking to a server needs it

    result = CompletionResult(sent_s=time.perf_counter())
    body = payload if isinstance(payload, bytes) else orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    hdrs = {"Content-Type": "application/json"}
    if headers:
        hdrs.update(headers)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s,
                                    sock_read=max(timeouts.idle_s, timeouts.first_token_s) + 1.0)  # backstop
    decoder: SseDecoder | None = None
    resp_box: list = []

    def expire() -> None:
        if resp_box:
            resp_box[0].close()  # the pending read raises; the watchdog's reason names the limit
        elif task is not None:
            task.cancel()

    task = asyncio.current_task()
    dog = Watchdog(asyncio.get_running_loop(), timeouts, result.sent_s, expire)
    try:
        async with session.post(url, data=body, headers=hdrs, timeout=timeout) as resp:
            resp_box.append(resp)
            result.http_status = resp.status
            if resp.status != 200:
                text = (await resp.read())[:500].decode(errors="replace")
                return result.fail(f"http_{resp.status}", text or resp.reason or "")
            decoder = SseDecoder(result)
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                dog.last = now
                had_first = result.first_token_s is not None
                if not decoder.feed(data, now):
                    return result
                if not had_first and result.first_token_s is not None:
                    dog.first_token(now)
                if decoder.saw_done:
                    break
        result.done_s = time.perf_counter()
        if decoder is None or not decoder.saw_done:
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


class AiohttpStreamClient:
    """:class:`StreamClient` over an aiohttp session (one it is given, or its own)."""

    def __init__(self, session: Any = None, timeouts: Timeouts = Timeouts(),
                 headers: dict[str, str] | None = None) -> None:
        self.session = session
        self.timeouts = timeouts
        self.headers = dict(headers or {})
        self._owns_session = session is None

    async def post_stream(self, url: str, body: bytes, timeouts: Timeouts | None = None,
                          headers: dict[str, str] | None = None) -> CompletionResult:
        if self.session is None:
            import aiohttp  # deferred: aiohttp is heavy, only talking to a server needs it

            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        hdrs = {**self.headers, **headers} if headers else self.headers
        return await stream_request(self.session, url, body, hdrs, timeouts or self.timeouts)

    async def close(self) -> None:
        if self._owns_session and self.session is not None:
            await self.session.close()
            self.session = None

    async def __aenter__(self) -> "AiohttpStreamClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


ClientKind = Literal["auto", "fast", "aiohttp"]


def open_stream_client(kind: ClientKind, url: str, timeouts: Timeouts = Timeouts(),
                       headers: dict[str, str] | None = None, session: Any = None) -> StreamClient:
    """The client for ``url``: fast for ``fast``, and for ``auto`` on plain http; aiohttp otherwise."""
    if kind == "fast" or (kind == "auto" and FastStreamClient.supports(url)):
        return FastStreamClient(timeouts, headers)
    return AiohttpStreamClient(session, timeouts, headers)
