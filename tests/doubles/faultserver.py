"""A fault-injecting, zero-latency mock of vLLM's OpenAI streaming API, on loopback only.

Used by the fault tests (every way a server or network can misbehave, on demand) and by the client
benchmarks (a mock that is never the bottleneck). It is a raw `asyncio.Protocol` HTTP/1.1 server: keep-alive,
`Content-Length` request bodies, chunked SSE responses, no framework on the hot path.

Endpoints: `POST /v1/completions` (token-id or text prompts), `POST /v1/chat/completions`, `GET /v1/models`
(with a non-standard `vocab_size` field when configured), `GET /health`, `GET /metrics` (a few `vllm:`
counters and `vllm:cache_config_info`), `GET /version`, `POST /reset_prefix_cache`.

Which fault a completion request gets, first match wins:
  1. the request header `X-Fault: MODE`;
  2. `schedule`: {n: MODE} for the n-th completion request the server received (0-based);
  3. `token_faults`: {token id: MODE} matched against the last token of a token-id prompt;
  4. `fault_rates`: {MODE: probability}, drawn from a seeded generator;
  5. otherwise `ok`.

Fault modes (`FAULT_MODES`):
  ok              normal stream: `max_tokens` tokens (or `output_len`), usage chunk, `[DONE]`
  reset_before    the connection is reset (RST) before any response byte
  reset_mid       headers and half the tokens, then RST
  http_401 / http_429 / http_500 / http_503  that status with a vLLM-style JSON error body
  http_429_empty / http_500_empty / http_503_empty   that status with an empty body
  stall_headers   request read, nothing ever answered
  stall_before    200 headers sent, then nothing (no first token, ever)
  stall_mid       headers and half the tokens, then nothing (connection held open)
  malformed_sse   a line that is not SSE (`garbage without a field name`) mid-stream
  invalid_json    `data: {"choices": [` mid-stream
  error_event     `data: {"error": {...}}` mid-stream, as vLLM sends for errors after the headers
  no_usage        the usage chunk is left out
  no_done         the stream ends cleanly (chunked terminator) without `data: [DONE]`
  extra_tokens    3 more tokens than asked (usage agrees with what was streamed)
  fewer_tokens    half the tokens asked, `finish_reason: length` (usage agrees with what was streamed)
  close_after     a normal response, then the server closes the keep-alive connection
  die             the whole server stops: listener closed, every connection reset (the process exits when
                  run from the command line)

Latency noise (`LatencyNoise`, for calibrating A/B statistics): lognormal run, session-by-run and request factors
on the configured TTFT and token gap, and fixed TTFT / throughput effects (`--run-noise`, `--session-noise`,
`--request-noise`, `--ttft-effect`, `--throughput-effect`, `--noise-seed`). A run factor is drawn once per server
start, so every process start is a fresh "run".

Run: `python -m tests.doubles.faultserver --port 8100 --ttft-ms 0 --itl-ms 0 [--fault-rates reset_mid=0.01,...]`.
In tests: `with FaultServer(FaultConfig(...)) as srv: srv.endpoint`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE

import orjson

FAULT_MODES = (
    "ok", "reset_before", "reset_mid", "http_401", "http_429", "http_500", "http_503", "http_429_empty", "http_500_empty",
    "http_503_empty", "stall_headers", "stall_before", "stall_mid", "malformed_sse", "invalid_json", "error_event",
    "no_usage", "no_done", "extra_tokens", "fewer_tokens", "close_after", "die",
)

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class FaultConfig:
    ttft_s: float = 0.0  # delay before the first token
    itl_s: float = 0.0  # delay between tokens
    output_len: int | None = None  # tokens per response; default: the request's max_tokens
    model: str = "mock"
    vocab_size: int | None = 8192  # exposed as `vocab_size` in /v1/models (None: not exposed)
    max_model_len: int = 1 << 20
    block_size: int = DEFAULT_BLOCK_SIZE  # vllm:cache_config_info
    num_gpu_blocks: int = 1 << 16
    prefix_caching: bool = False
    schedule: dict[int, str] = field(default_factory=dict)
    token_faults: dict[int, str] = field(default_factory=dict)
    fault_rates: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    keepalive_timeout_s: float = 5.0  # idle keep-alive connections are closed after this (uvicorn's default)
    exit_on_die: bool = False  # `die` ends the process (command-line use)
    text: str | None = None  # generated text of the first token (e.g. markup, to test report escaping)
    noise: "LatencyNoise | None" = None  # random and fixed multipliers on ttft_s / itl_s (calibration tests)
    dev_mode: bool = True  # False: POST /reset_prefix_cache answers 404, as vLLM without VLLM_SERVER_DEV_MODE=1
    #: Every request but `/health` without exactly this `Authorization` header (or with a query string)
    #: answers 401, as a server behind an API key does; counted in `stats.unauthorized` (None: no auth).
    require_authorization: str | None = None
    keep_bodies: bool = False  # keep every completion request's JSON body in `FaultServer.bodies` (tests)

    def __post_init__(self) -> None:
        for mode in [*self.schedule.values(), *self.token_faults.values(), *self.fault_rates]:
            if mode not in FAULT_MODES:
                raise ValueError(f"unknown fault mode {mode!r}; known: {', '.join(FAULT_MODES)}")


@dataclass(frozen=True)
class LatencyNoise:
    """Known latency structure for calibrating A/B statistics: multipliers on `ttft_s` and `itl_s`.

    Random factors are lognormal, `exp(N(0, sigma))` (sigma ≈ the coefficient of variation when small): one run
    factor per server start (TTFT and token gaps), one factor per session and server start (the session is the
    request's `cache_salt`, else its first prompt token), one TTFT factor per request. The fixed effects are not
    random: TTFT times `ttft_effect`; token gaps stretched so that each response takes 1 / `throughput_effect`
    as long as without it (output tokens/s times `throughput_effect`). `seed` None draws a fresh seed."""

    run_sigma: float = 0.0
    session_sigma: float = 0.0
    request_sigma: float = 0.0
    ttft_effect: float = 1.0
    throughput_effect: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("run_sigma", "session_sigma", "request_sigma"):
            if not 0 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be within [0, 2], got {getattr(self, name)}")
        for name in ("ttft_effect", "throughput_effect"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class _NoiseState:
    """The draws of one server start: its run factor, and each session's factor drawn on first sight."""

    def __init__(self, noise: LatencyNoise) -> None:
        self.noise = noise
        self.seed = noise.seed if noise.seed is not None else random.SystemRandom().randrange(1 << 62)
        self.rng = random.Random(self.seed)
        self.run_factor = _lognormal(self.rng, noise.run_sigma)
        self.session_factors: dict[str, float] = {}

    def session_factor(self, key: str) -> float:
        if key not in self.session_factors:
            self.session_factors[key] = _lognormal(random.Random(f"{self.seed}:{key}"), self.noise.session_sigma)
        return self.session_factors[key]

    def delays(self, ttft_s: float, itl_s: float, n_out: int, session_key: str) -> tuple[float, float]:
        """(TTFT, token gap) for one request."""
        n = self.noise
        shared = self.run_factor * self.session_factor(session_key)
        ttft = ttft_s * shared * _lognormal(self.rng, n.request_sigma)
        itl = itl_s * shared
        if n.throughput_effect != 1.0 and n_out > 1:
            total = (ttft + (n_out - 1) * itl) / n.throughput_effect
            ttft *= n.ttft_effect
            return ttft, max(0.0, total - ttft) / (n_out - 1)
        return ttft * n.ttft_effect, itl


def _lognormal(rng: random.Random, sigma: float) -> float:
    return rng.lognormvariate(0.0, sigma) if sigma > 0 else 1.0


def _session_key(req: dict) -> str:
    """Which session a request belongs to, as far as a server can tell: `cache_salt`, else the first prompt token."""
    salt = req.get("cache_salt")
    if salt:
        return str(salt)
    prompt = req.get("prompt") if "prompt" in req else req.get("messages")
    if isinstance(prompt, list) and prompt:
        return str(prompt[0].get("content", "")[:64] if isinstance(prompt[0], dict) else prompt[0])
    return str(prompt)[:64]


class _Stats:
    def __init__(self) -> None:
        self.completions = 0  # completion requests received
        self.by_fault: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.running = 0
        self.connections = 0
        self.unauthorized = 0  # requests refused by `require_authorization`


_HDR_SSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n")
_DONE_CHUNK = b"e\r\ndata: [DONE]\n\n\r\n"
_END = b"0\r\n\r\n"



def _prompt_size(prompt: Any, chat: bool) -> tuple[int, int]:
    """(prompt tokens, the token that seeds the output): exact for token ids, ~4 characters a token for text."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt), prompt[-1]
    if chat and isinstance(prompt, list):
        n_prompt = sum(len(str(m.get("content", ""))) // 4 + 4 for m in prompt if isinstance(m, dict))
        return n_prompt, n_prompt
    n_prompt = max(1, len(str(prompt)) // 4)
    return n_prompt, n_prompt


_BAD_EVENTS = {"malformed_sse": b"garbage without a field name\n\n", "invalid_json": b'data: {"choices": [\n\n',
               "error_event": b'data: {"error": {"object": "error", "message": "mock mid-stream error", '
                              b'"type": "MockError", "code": 500}}\n\n'}


def _faulty_events(mode: str, events: list[bytes], half: int) -> list[bytes]:
    """The SSE events a fault mode sends instead of the full stream."""
    if mode in ("reset_mid", "stall_mid"):
        return events[:half]
    if mode in _BAD_EVENTS:
        return events[:half] + [_BAD_EVENTS[mode]] + events[half:]
    if mode == "no_done":
        return events[:-1]
    if mode == "stall_before":
        return []
    return events


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _simple_response(status: int, body: bytes, ctype: bytes = b"application/json", close: bool = False) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 429: b"Too Many Requests",
              500: b"Internal Server Error", 503: b"Service Unavailable"}.get(status, b"Error")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s"
            % (status, reason, ctype, len(body), b"connection: close\r\n" if close else b"", body))


class _Conn(asyncio.Protocol):
    __slots__ = ("srv", "transport", "buf", "busy", "closed", "last_active", "task", "delays")

    def __init__(self, srv: "FaultServer") -> None:
        self.srv = srv
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False
        self.closed = False
        self.last_active = time.monotonic()
        self.task: asyncio.Task | None = None
        self.delays: tuple[float, float] | None = None  # (TTFT, token gap) of the current request, when noisy

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.srv._conns.add(self)
        self.srv.stats.connections += 1

    def connection_lost(self, exc) -> None:  # type: ignore[override]
        self.closed = True
        self.srv._conns.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def data_received(self, data: bytes) -> None:  # type: ignore[override]
        if self.closed:  # lingering after close_after (or aborted): what the peer still sends is dropped
            return
        self.buf += data
        if not self.busy:
            self._process()

    def linger(self) -> None:
        """Close as a keep-alive server should: FIN first, then read and drop until the peer closes (at most
        2 s). A request the client wrote meanwhile then meets a clean end of stream, which it may resend; a
        plain close() would answer that request's bytes with a reset (the test saw it in 1 run of 6)."""
        t = self.transport
        self.closed = True
        if t is None:
            return
        if not t.can_write_eof():
            t.close()
            return
        t.write_eof()
        asyncio.get_running_loop().call_later(2.0, t.close)

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            try:  # RST rather than FIN: the client sees "connection reset"
                sock = self.transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            except OSError:
                pass
            self.transport.abort()
        self.closed = True

    def _process(self) -> None:
        while not self.busy and not self.closed:
            buf = self.buf
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                if len(buf) > 65536:
                    self.transport.write(_simple_response(400, b'{"error":"headers too large"}', close=True))
                    self.transport.close()
                    self.closed = True
                return
            head = buf[:i].split(b"\r\n")
            try:
                method, path, _ = head[0].split(b" ", 2)
            except ValueError:
                self.transport.write(_simple_response(400, b'{"error":"bad request line"}', close=True))
                self.transport.close()
                self.closed = True
                return
            length = 0
            fault = None
            close = False
            authorization = None
            for h in head[1:]:
                name, _, value = h.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"x-fault":
                    fault = value.strip().decode()
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
                elif name == b"authorization":
                    authorization = value.strip().decode()
            end = i + 4 + length
            if len(buf) < end:
                return
            body = buf[i + 4:end]
            self.buf = buf[end:]
            self.last_active = time.monotonic()
            required = self.srv.config.require_authorization
            if required is not None and path != b"/health" and (authorization != required or b"?" in path):
                self.srv.stats.unauthorized += 1
                self.transport.write(_simple_response(401, b'{"error":"unauthorized"}', close=close))
                continue
            self.srv._handle(self, method, path.partition(b"?")[0], body, fault, close)


class FaultServer:
    """The mock server. `start()` runs it on a background thread (tests); `serve_forever()` in the foreground."""

    def __init__(self, config: FaultConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        if host not in _LOOPBACK:
            raise ValueError(f"the fault server binds to loopback only, not {host!r}")
        self.config = config or FaultConfig()
        self.host = host
        self.port = port
        self.stats = _Stats()
        self.bodies: list[dict] = []  # completion request bodies, with `keep_bodies`
        self.dead = False
        self._rng = random.Random(self.config.seed)
        self._conns: set[_Conn] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._sweeper: asyncio.TimerHandle | None = None
        self._started = time.time()
        self.noise = _NoiseState(self.config.noise) if self.config.noise is not None else None

    # ---- lifecycle ----------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start_async(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(lambda: _Conn(self), self.host, self.port, backlog=4096,
                                                      reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = self._loop.call_later(1.0, self._sweep)

    async def serve_forever(self) -> None:
        await self.start_async()
        assert self._server is not None
        try:
            await self._server.serve_forever()
        except asyncio.CancelledError:
            pass

    def start(self) -> "FaultServer":
        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.start_async())
            self._ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="faultserver", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault server did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        def shutdown() -> None:
            self._close_all()
            loop.stop()

        if loop.is_running():
            loop.call_soon_threadsafe(shutdown)
        self._thread.join(10)
        self._thread = None

    def kill(self) -> None:
        """From another thread: the server dies as if `die` had been requested."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._die)

    def __enter__(self) -> "FaultServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for c in list(self._conns):
            c.abort()

    def _die(self) -> None:
        self.dead = True
        self._close_all()
        if self.config.exit_on_die:
            os._exit(3)

    def _sweep(self) -> None:
        now = time.monotonic()
        limit = self.config.keepalive_timeout_s
        for c in list(self._conns):
            if not c.busy and not c.buf and now - c.last_active > limit and c.transport is not None:
                c.transport.close()
        if self._loop is not None and not self.dead:
            self._sweeper = self._loop.call_later(1.0, self._sweep)

    # ---- routing ------------------------------------------------------------------------------------
    def _handle(self, conn: _Conn, method: bytes, path: bytes, body: bytes, fault: str | None, close: bool) -> None:
        t = conn.transport
        assert t is not None
        if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
            conn.delays = self._noisy_delays(body)
            self._completion(conn, path == b"/v1/chat/completions", body, fault, close)
            return
        if method == b"GET" and path == b"/health":
            out = _simple_response(200, b"", close=close)
        elif method == b"GET" and path == b"/v1/models":
            card: dict[str, Any] = {"id": self.config.model, "object": "model", "created": int(self._started),
                                    "owned_by": "kvscope-mock", "root": self.config.model,
                                    "max_model_len": self.config.max_model_len}
            if self.config.vocab_size:
                card["vocab_size"] = self.config.vocab_size
            out = _simple_response(200, orjson.dumps({"object": "list", "data": [card]}), close=close)
        elif method == b"GET" and path == b"/version":
            out = _simple_response(200, b'{"version":"0.0.0-kvscope-mock"}', close=close)
        elif method == b"GET" and path == b"/metrics":
            out = _simple_response(200, self._metrics(), b"text/plain; version=0.0.4; charset=utf-8", close=close)
        elif method == b"POST" and path == b"/reset_prefix_cache" and self.config.dev_mode:
            out = _simple_response(200, b"", close=close)
        else:
            out = _simple_response(404, b'{"detail":"Not Found"}', close=close)
        t.write(out)
        conn.last_active = time.monotonic()
        if close:
            t.close()
            conn.closed = True

    def _noisy_delays(self, body: bytes) -> tuple[float, float] | None:
        """(TTFT, token gap) for this request under the configured noise; None without noise (or a bad body)."""
        if self.noise is None:
            return None
        try:
            req = orjson.loads(body)
            n_out = int(self.config.output_len or req.get("max_tokens") or 16)
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
            return None
        return self.noise.delays(self.config.ttft_s, self.config.itl_s, n_out, _session_key(req))

    def _metrics(self) -> bytes:
        s, c = self.stats, self.config
        labels = f'model_name="{c.model}",engine="0"'
        lines = [
            "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{labels}}} {s.running}.0",
            "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{labels}}} 0.0",
            "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{labels}}} 0.0",
            "# TYPE vllm:prefix_cache_queries counter", f"vllm:prefix_cache_queries_total{{{labels}}} {s.prompt_tokens}.0",
            "# TYPE vllm:prefix_cache_hits counter", f"vllm:prefix_cache_hits_total{{{labels}}} 0.0",
            "# TYPE vllm:prompt_tokens counter", f"vllm:prompt_tokens_total{{{labels}}} {s.prompt_tokens}.0",
            "# TYPE vllm:generation_tokens counter", f"vllm:generation_tokens_total{{{labels}}} {s.generation_tokens}.0",
            "# TYPE vllm:request_success counter", f"vllm:request_success_total{{{labels}}} {s.completions}.0",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{c.block_size}",cache_dtype="auto",enable_prefix_caching='
            f'"{c.prefix_caching}",engine="0",num_gpu_blocks="{c.num_gpu_blocks}",num_gpu_blocks_override="None",'
            f'kv_cache_size_tokens="{c.num_gpu_blocks * c.block_size}",prefix_caching_hash_algo="sha256"}} 1.0',
        ]
        return ("\n".join(lines) + "\n").encode()

    def _pick_fault(self, n: int, fault: str | None, prompt: Any) -> str:
        c = self.config
        if fault:
            return fault if fault in FAULT_MODES else "ok"
        if n in c.schedule:
            return c.schedule[n]
        if c.token_faults and isinstance(prompt, list) and prompt and isinstance(prompt[-1], int):
            mode = c.token_faults.get(prompt[-1])
            if mode:
                return mode
        if c.fault_rates:
            x = self._rng.random()
            for mode, p in c.fault_rates.items():
                if x < p:
                    return mode
                x -= p
        return "ok"

    # ---- completions --------------------------------------------------------------------------------
    def _completion(self, conn: _Conn, chat: bool, body: bytes, fault: str | None, close: bool) -> None:
        t = conn.transport
        assert t is not None
        try:
            req = orjson.loads(body)
            max_tokens = int(req.get("max_tokens") or 16)
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
            t.write(_simple_response(400, b'{"object":"error","message":"invalid JSON body","code":400}', close=close))
            return
        prompt = req.get("messages") if chat else req.get("prompt")
        if self.config.keep_bodies:
            self.bodies.append(req)
        n = self.stats.completions
        self.stats.completions += 1
        mode = self._pick_fault(n, fault, prompt)
        self.stats.by_fault[mode] = self.stats.by_fault.get(mode, 0) + 1
        if self._fail_before_stream(conn, mode, close):
            return
        vocab = self.config.vocab_size or 32000
        n_prompt, seed_tok = _prompt_size(prompt, chat)
        n_out = self.config.output_len or max_tokens
        if mode == "extra_tokens":
            n_out += 3
        elif mode == "fewer_tokens":
            n_out = max(1, n_out // 2)
        include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        events = self._events(chat, n_prompt, n_out, seed_tok % vocab, vocab, include_usage and mode != "no_usage")
        events = _faulty_events(mode, events, max(1, n_out // 2))
        self.stats.prompt_tokens += n_prompt
        self.stats.generation_tokens += n_out
        head = _HDR_SSE + (b"connection: close\r\n\r\n" if close else b"\r\n")
        end_action = {"reset_mid": "reset", "stall_mid": "stall", "stall_before": "stall"}.get(mode, "end")
        if close or mode == "close_after":  # told to close: close; closing unannounced: linger
            end_action = ("close" if close else "linger") if end_action == "end" else end_action
        if self.config.ttft_s > 0 or self.config.itl_s > 0:
            conn.busy = True
            self.stats.running += 1
            conn.task = asyncio.get_running_loop().create_task(self._stream_slow(conn, head, events, end_action))
        else:
            self._stream_at_once(conn, head, events, end_action)

    def _fail_before_stream(self, conn: _Conn, mode: str, close: bool) -> bool:
        """The faults that strike before any SSE byte (die, reset, an HTTP error, stalled headers); True when
        ``mode`` was one of them and has been acted out."""
        t = conn.transport
        assert t is not None
        if mode == "die":
            self._die()
        elif mode == "reset_before":
            conn.abort()
        elif mode.startswith("http_"):
            parts = mode.split("_")
            status = int(parts[1])
            body_out = b"" if len(parts) > 2 else orjson.dumps(
                {"object": "error", "message": f"mock fault {mode}", "type": "MockError", "param": None,
                 "code": status})
            t.write(_simple_response(status, body_out, close=close))
            if close:
                t.close()
                conn.closed = True
        elif mode == "stall_headers":
            conn.busy = True
        else:
            return False
        return True

    def _stream_at_once(self, conn: _Conn, head: bytes, events: list[bytes], end_action: str) -> None:
        """Zero delays: the whole response (or the part before a reset or stall) in one write."""
        t = conn.transport
        assert t is not None
        if end_action in ("end", "close", "linger"):
            t.write(head + b"".join(_chunk(e) for e in events) + _END)
            if end_action == "close":
                t.close()
                conn.closed = True
            elif end_action == "linger":
                conn.linger()
            conn.last_active = time.monotonic()
            return
        t.write(head + b"".join(_chunk(e) for e in events))
        if end_action == "reset":
            conn.abort()
        else:
            conn.busy = True  # stalled for good

    async def _stream_slow(self, conn: _Conn, head: bytes, events: list[bytes], end_action: str) -> None:
        t = conn.transport
        assert t is not None
        ttft_s, itl_s = conn.delays or (self.config.ttft_s, self.config.itl_s)
        try:
            t.write(head)
            if ttft_s > 0:
                await asyncio.sleep(ttft_s)
            for k, e in enumerate(events):
                if k and itl_s > 0 and not e.startswith((b'data: {"id":"cmpl-u', b"data: [DONE]")):
                    await asyncio.sleep(itl_s)
                if conn.closed:
                    return
                t.write(_chunk(e))
            if end_action == "reset":
                conn.abort()
            elif end_action == "stall":
                await asyncio.Event().wait()
            else:
                t.write(_END)
                if end_action == "close":
                    t.close()
                    conn.closed = True
                elif end_action == "linger":
                    conn.linger()
                conn.busy = False
                conn.last_active = time.monotonic()
                if conn.buf:
                    conn._process()
        finally:
            self.stats.running -= 1

    def _events(self, chat: bool, n_prompt: int, n_out: int, tok0: int, vocab: int, usage: bool) -> list[bytes]:
        model = self.config.model.encode()
        out = []
        if chat:
            out.append(b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"%s",'
                       b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                       b'"finish_reason":null}]}\n\n' % model)
            tmpl = (b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"' + model +
                    b'","choices":[{"index":0,"delta":{"content":" t%d"},"logprobs":null,"finish_reason":%s,'
                    b'"token_ids":[%d]}]}\n\n')
        else:
            tmpl = (b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"' + model +
                    b'","choices":[{"index":0,"text":" t%d","logprobs":null,"finish_reason":%s,"stop_reason":null,'
                    b'"token_ids":[%d]}]}\n\n')
        for k in range(n_out):
            tok = (tok0 + 1 + k) % vocab
            ev = tmpl % (tok, b'"length"' if k == n_out - 1 else b"null", tok)
            if k == 0 and self.config.text is not None:
                ev = ev.replace(b'" t%d"' % tok, json.dumps(self.config.text).encode(), 1)
            out.append(ev)
        if usage:
            out.append(b'data: {"id":"cmpl-u","object":"%s","created":0,"model":"%s","choices":[],"usage":'
                       b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,"prompt_tokens_details":'
                       b'{"cached_tokens":0}}}\n\n'
                       % (b"chat.completion.chunk" if chat else b"text_completion", model, n_prompt, n_prompt + n_out,
                          n_out))
        out.append(b"data: [DONE]\n\n")
        return out


# ---- command line ---------------------------------------------------------------------------------------
def _pairs(text: str | None, key_type, value_type) -> dict:
    out = {}
    for part in (text or "").split(","):
        if part.strip():
            k, _, v = part.partition("=")
            out[key_type(k.strip())] = value_type(v.strip())
    return out


def _add_noise_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("latency noise (calibration)", "lognormal multipliers exp(N(0, SIGMA)) on --ttft-ms / "
                             "--itl-ms, and fixed effects")
    g.add_argument("--run-noise", type=float, default=0.0, metavar="SIGMA", help="one factor per server start")
    g.add_argument("--session-noise", type=float, default=0.0, metavar="SIGMA",
                   help="one factor per session (cache_salt, else first prompt token) and server start")
    g.add_argument("--request-noise", type=float, default=0.0, metavar="SIGMA", help="one TTFT factor per request")
    g.add_argument("--ttft-effect", type=float, default=1.0, metavar="X", help="fixed TTFT multiplier (1.3: +30 %%)")
    g.add_argument("--throughput-effect", type=float, default=1.0, metavar="X",
                   help="stretch token gaps so output tokens/s is multiplied by X (0.7: -30 %%)")
    g.add_argument("--noise-seed", type=int, metavar="SEED", help="seed of the noise draws (default: a fresh one)")


_NOISE_FLAGS = {"run_sigma": "--run-noise", "session_sigma": "--session-noise", "request_sigma": "--request-noise",
                "ttft_effect": "--ttft-effect", "throughput_effect": "--throughput-effect", "seed": "--noise-seed"}


def _noise_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> LatencyNoise | None:
    values = dict(run_sigma=args.run_noise, session_sigma=args.session_noise, request_sigma=args.request_noise,
                  ttft_effect=args.ttft_effect, throughput_effect=args.throughput_effect, seed=args.noise_seed)
    if values == {f.name: f.default for f in dataclasses.fields(LatencyNoise)}:
        return None
    try:
        return LatencyNoise(**values)
    except ValueError as exc:
        field_name = str(exc).split()[0]
        p.error(str(exc).replace(field_name, _NOISE_FLAGS.get(field_name, field_name), 1))
        raise  # unreachable: p.error exits


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.doubles.faultserver", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="loopback address to bind")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed, and written to --port-file)")
    p.add_argument("--port-file", help="write the bound port here once listening")
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--output-len", type=int, help="tokens per response (default: the request's max_tokens)")
    p.add_argument("--model", default="mock")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--fault-rates", metavar="MODE=P,…", help="random faults, e.g. reset_mid=0.01,http_503=0.02")
    p.add_argument("--schedule", metavar="N=MODE,…", help="fault for the N-th completion request (0-based)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--uvloop", action="store_true", help="run on uvloop (faster) when it is installed")
    _add_noise_arguments(p)
    return p


def config_from_args(argv: list[str], exit_on_die: bool = False) -> tuple[FaultConfig, argparse.Namespace]:
    """The server configuration the command line `argv` asks for (tests build in-process servers from the same
    flags as the command line, e.g. the A/B calibration's noise flags)."""
    p = _parser()
    args = p.parse_args(argv)
    cfg = FaultConfig(ttft_s=args.ttft_ms / 1000, itl_s=args.itl_ms / 1000, output_len=args.output_len,
                      model=args.model, vocab_size=args.vocab_size, block_size=args.block_size,
                      fault_rates=_pairs(args.fault_rates, str, float), schedule=_pairs(args.schedule, int, str),
                      seed=args.seed, exit_on_die=exit_on_die, noise=_noise_from_args(p, args))
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    cfg, args = config_from_args(sys.argv[1:] if argv is None else argv, exit_on_die=True)
    srv = FaultServer(cfg, args.host, args.port)

    async def run() -> None:
        await srv.start_async()
        print(f"fault server listening on {srv.endpoint}", flush=True)
        if args.port_file:
            tmp = args.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(srv.port))
            os.replace(tmp, args.port_file)
        await asyncio.Event().wait()

    try:
        if args.uvloop:
            try:
                import uvloop

                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    runner.run(run())
                return 0
            except ImportError:
                pass
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
