"""The built-in HTTP/1.1 streaming client: chunked / Content-Length / read-until-close bodies split at every byte,
keep-alive reuse, error statuses, timeouts, resets -- against scripted raw responses and the fault server."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from kvscope.harness.serving.client import FastStreamClient, Timeouts, completion_payload, stream_request
from tests.doubles.faultserver import FaultConfig, FaultServer

TOKEN = b'data: {"choices":[{"index":0,"text":"x","token_ids":[%d],"finish_reason":null}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}}\n\n'
DONE = b"data: [DONE]\n\n"
SSE = TOKEN % 7 + TOKEN % 8 + USAGE + DONE


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nX-Trailer: 1\r\n\r\n"


CHUNKED_OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(
    TOKEN % 7, TOKEN % 8 + USAGE[:10], USAGE[10:], DONE)
LENGTH_OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (len(SSE), SSE)
CLOSE_OK = b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + SSE


class Scripted:
    """A raw TCP server answering each request with the next scripted response, written `step` bytes at a time."""

    def __init__(self, responses: list[bytes | None], step: int = 0, close_after: bool = False) -> None:
        self.responses = list(responses)
        self.step = step
        self.close_after = close_after
        self.requests: list[bytes] = []
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.responses:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
                body = await reader.readexactly(n)
                self.requests.append(body)
                resp = self.responses.pop(0)
                if resp is None:  # hang up without answering
                    writer.transport.abort()
                    return
                if self.step:
                    for i in range(0, len(resp), self.step):
                        writer.write(resp[i:i + self.step])
                        await writer.drain()
                        await asyncio.sleep(0)
                else:
                    writer.write(resp)
                if self.close_after or resp.startswith(b"HTTP/1.0") or b"Connection: close" in resp:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/completions"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


BODY = orjson.dumps(completion_payload("m", [1, 2, 3], 2))


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("response", [CHUNKED_OK, LENGTH_OK, CLOSE_OK], ids=["chunked", "length", "until-close"])
@pytest.mark.parametrize("step", [0, 1, 7])
def test_bodies_parse_at_any_split(response, step):
    async def go():
        async with Scripted([response], step=step) as url:
            async with FastStreamClient() as c:
                return await c.post_stream(url, BODY)

    r = run(go())
    assert r.ok, (r.error_class, r.error)
    assert r.token_ids == [7, 8] and r.prompt_tokens == 3 and r.cached_tokens == 1 and r.http_status == 200
    assert len(r.chunk_times_s) == 2 and r.first_token_s is not None and r.done_s >= r.first_token_s


def test_keep_alive_reuses_one_connection_and_http10_does_not():
    async def go(resp):
        srv = Scripted([resp] * 5)
        async with srv as url:
            async with FastStreamClient() as c:
                out = [await c.post_stream(url, BODY) for _ in range(5)]
                return out, srv.connections, c.connections_opened

    out, conns, opened = run(go(CHUNKED_OK))
    assert all(r.ok for r in out) and conns == 1 == opened
    out, conns, opened = run(go(CLOSE_OK))
    assert all(r.ok for r in out) and conns == 5 == opened


@pytest.mark.parametrize("resp,cls,status", [
    (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 9\r\n\r\noverload!", "http_503", 503),
    (b"HTTP/1.1 429 Too Many\r\nContent-Length: 0\r\n\r\n", "http_429", 429),
    (b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nerror\r\n0\r\n\r\n", "http_500", 500),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\ndata: {not json}\n\n  ", "malformed_stream", 200),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "protocol_error", 200),
    (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(TOKEN % 1 + DONE), TOKEN % 1 + DONE),
     "missing_usage", 200),
    (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(TOKEN % 1 + USAGE), TOKEN % 1 + USAGE),
     "truncated_stream", 200),
    (b"garbage\r\n\r\n", "protocol_error", None),
])
def test_errors_are_classified_and_the_connection_stays_usable(resp, cls, status):
    async def go():
        async with Scripted([resp, CHUNKED_OK]) as url:
            async with FastStreamClient() as c:
                return await c.post_stream(url, BODY), await c.post_stream(url, BODY)

    bad, good = run(go())
    assert bad.error_class == cls and bad.http_status == status and bad.done_s is not None
    if cls.startswith("http_"):
        assert bad.error is not None
    assert good.ok


def test_hang_up_before_answer_is_a_connection_error():
    async def go():
        async with Scripted([None]) as url:
            async with FastStreamClient() as c:
                return await c.post_stream(url, BODY)

    r = run(go())
    assert r.error_class == "connection_error" and r.http_status is None


def test_connect_refused_and_timeouts():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def refused():
        async with FastStreamClient() as c:
            return await c.post_stream(f"http://127.0.0.1:{port}/v1/completions", BODY)

    assert run(refused()).error_class == "connection_error"

    async def faulty(mode, t):
        with FaultServer(FaultConfig()) as srv:
            async with FastStreamClient(t) as c:
                return await c.post_stream(srv.endpoint + "/v1/completions", BODY, headers={"X-Fault": mode})

    t = Timeouts(connect_s=1, first_token_s=0.3, idle_s=0.2, total_s=5)
    assert run(faulty("stall_headers", t)).error_class == "first_token_timeout"
    assert run(faulty("stall_before", t)).error_class == "first_token_timeout"
    # a first-token limit no busy host reaches, so that the idle limit is the one that ends the stall
    r = run(faulty("stall_mid", Timeouts(connect_s=1, first_token_s=5, idle_s=0.2, total_s=10)))
    assert r.error_class == "idle_timeout" and r.token_ids
    r = run(faulty("stall_mid", Timeouts(connect_s=1, first_token_s=5, idle_s=5, total_s=0.3)))
    assert r.error_class == "timeout"


def test_idle_limit_applies_after_a_late_first_token():
    """first token after 0.4 s (first-token limit 3 s), then a stall: the idle limit (0.2 s) fires, not 3 s."""
    async def go():
        with FaultServer(FaultConfig(ttft_s=0.4)) as srv:
            async with FastStreamClient(Timeouts(connect_s=1, first_token_s=3.0, idle_s=0.2, total_s=10)) as c:
                return await c.post_stream(srv.endpoint + "/v1/completions", BODY, headers={"X-Fault": "stall_mid"})

    r = run(go())
    assert r.error_class == "idle_timeout"
    assert r.done_s - r.first_token_s < 1.5  # ~0.2 s; the first-token limit would have ended it 2.6 s later


@pytest.mark.parametrize("mode", ["ok", "stall_mid", "reset_mid", "http_503"])
def test_fast_and_aiohttp_clients_agree(mode):
    async def go():
        import aiohttp

        t = Timeouts(connect_s=2, first_token_s=2.0, idle_s=1.0, total_s=10)  # above a busy host's delays
        with FaultServer() as srv:
            url = srv.endpoint + "/v1/completions"
            async with FastStreamClient(t) as c:
                a = await c.post_stream(url, BODY, headers={"X-Fault": mode})
            async with aiohttp.ClientSession() as s:
                b = await stream_request(s, url, BODY, {"X-Fault": mode}, t)
        return a, b

    a, b = run(go())
    assert a.error_class == b.error_class and a.http_status == b.http_status
    assert a.token_ids == b.token_ids
