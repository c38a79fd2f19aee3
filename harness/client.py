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
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_token_ids if isinstance(prompt_token_ids, list) else [int(t) for t in prompt_token_ids],
        "max_tokens": int(max_tokens),
        "ignore_eos": ignore_eos,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    if extra:
        body.update(extra)
    return body


def chat_payload(model: str, messages: list[dict[str, str]], max_tokens: int, cache_salt: str | None = None,
                 ignore_eos: bool = True, temperature: float = 0.0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
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


def apply_chunk(result: CompletionResult, chunk: dict[str, Any], now_s: float) -> None:
    """Fold one SSE `data:` JSON object into the result (token ids, timings, usage)."""
    choices = chunk.get("choices")
    if choices:
        for choice in choices:
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


async def stream_request(session, url: str, payload: dict[str, Any], headers: dict[str, str] | None = None,
                         timeouts: Timeouts = Timeouts()) -> CompletionResult:
    """POST a streaming request with aiohttp and time every chunk. Never raises for server or network faults."""
    import aiohttp

    result = CompletionResult(sent_s=time.perf_counter())
    body = orjson.dumps(payload)
    hdrs = {"Content-Type": "application/json"}
    if headers:
        hdrs.update(headers)
    timeout = aiohttp.ClientTimeout(total=timeouts.total_s, sock_connect=timeouts.connect_s,
                                    sock_read=max(timeouts.idle_s, timeouts.first_token_s))
    saw_done = False
    try:
        async with session.post(url, data=body, headers=hdrs, timeout=timeout) as resp:
            result.http_status = resp.status
            if resp.status != 200:
                text = (await resp.read())[:500].decode(errors="replace")
                return result.fail(f"http_{resp.status}", text or resp.reason or "")
            content = resp.content
            deadline_first = result.sent_s + timeouts.first_token_s
            while True:
                wait = timeouts.idle_s if result.first_token_s is not None else max(
                    0.001, deadline_first - time.perf_counter())
                try:
                    line = await asyncio.wait_for(content.readline(), wait)
                except asyncio.TimeoutError:
                    if result.first_token_s is None:
                        return result.fail("first_token_timeout", f"no token within {timeouts.first_token_s} s")
                    return result.fail("idle_timeout", f"no data for {timeouts.idle_s} s mid-stream")
                if not line:
                    break
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    saw_done = True
                    break
                now = time.perf_counter()
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    return result.fail("malformed_stream", "invalid JSON in SSE data: " +
                                       data[:200].decode(errors="replace"))
                if not isinstance(chunk, dict):
                    return result.fail("malformed_stream", "SSE data is not a JSON object")
                if "error" in chunk and not chunk.get("choices"):
                    err = chunk["error"]
                    return result.fail("server_error", str(err.get("message", err) if isinstance(err, dict) else err))
                apply_chunk(result, chunk, now)
        result.done_s = time.perf_counter()
        if not saw_done:
            return result.fail("truncated_stream", "stream ended without [DONE]")
        if result.prompt_tokens is None:
            return result.fail("missing_usage", "stream had no usage chunk (stream_options.include_usage ignored?)")
    except aiohttp.ClientResponseError as exc:
        return result.fail("http_error", f"{exc.status} {exc.message}")
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
        return result.fail("connection_error", f"{exc.__class__.__name__}: {exc}")
    except asyncio.TimeoutError:
        return result.fail("timeout", f"request exceeded {timeouts.total_s} s in total")
    except aiohttp.ClientError as exc:
        return result.fail("client_error", f"{exc.__class__.__name__}: {exc}")
    return result


async def stream_completion(session, url: str, payload: dict[str, Any], headers: dict[str, str] | None = None,
                            timeout_s: float = 600.0) -> CompletionResult:
    """Back-compatible wrapper: one overall timeout."""
    return await stream_request(session, url, payload, headers,
                                Timeouts(total_s=timeout_s, first_token_s=timeout_s, idle_s=timeout_s))
