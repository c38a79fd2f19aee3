"""Streaming OpenAI-compatible completion requests with per-token timing.

One request = one `CompletionResult`: when it was sent, when the first token arrived, every inter-token gap,
the generated token ids, and the server's usage (with `prompt_tokens_details.cached_tokens`). Token-id
prompts on `/v1/completions` are the exact path: what the prefix cache sees is exactly what kvscope planned.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class CompletionResult:
    sent_s: float  # time.perf_counter() at send
    first_token_s: float | None = None
    done_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)  # arrival of each streamed chunk with tokens
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    error_class: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_class is None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s if self.first_token_s is not None else math.nan

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.sent_s if self.done_s is not None else math.nan


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
        "prompt": [int(t) for t in prompt_token_ids],
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


def apply_chunk(result: CompletionResult, chunk: dict[str, Any], now_s: float) -> None:
    """Fold one SSE `data:` JSON object into the result (token ids, timings, usage)."""
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids")
        if ids:
            if result.first_token_s is None:
                result.first_token_s = now_s
            result.token_ids.extend(ids)
            result.token_times_s.append(now_s)
        elif choice.get("text") and result.first_token_s is None:
            result.first_token_s = now_s
            result.token_times_s.append(now_s)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        # vLLM 0.11 omits the details when nothing was cached: a missing value means 0.
        result.cached_tokens = int(details.get("cached_tokens") or 0)


async def stream_completion(session, url: str, payload: dict[str, Any], headers: dict[str, str] | None = None,
                            timeout_s: float = 600.0) -> CompletionResult:
    """POST a streaming completion with aiohttp and time every chunk. Never raises for server errors."""
    import aiohttp

    result = CompletionResult(sent_s=time.perf_counter())
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            result.http_status = resp.status
            if resp.status != 200:
                body = (await resp.text())[:500]
                result.error_class = f"http_{resp.status}"
                result.error = body
                result.done_s = time.perf_counter()
                return result
            buffer = b""
            async for raw in resp.content:
                now = time.perf_counter()
                buffer += raw
                if not buffer.endswith(b"\n"):
                    continue
                line, buffer = buffer.strip(), b""
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    apply_chunk(result, json.loads(data), now)
                except json.JSONDecodeError:
                    result.error_class = "malformed_stream"
                    result.error = data[:200].decode(errors="replace")
                    break
            result.done_s = time.perf_counter()
    except aiohttp.ClientError as exc:
        result.error_class = "connection_error"
        result.error = f"{exc.__class__.__name__}: {exc}"
        result.done_s = time.perf_counter()
    except TimeoutError:
        result.error_class = "timeout"
        result.error = f"no complete response within {timeout_s} s"
        result.done_s = time.perf_counter()
    return result
