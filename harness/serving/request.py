"""One streamed request: what kvscope sends, how long it may take, and what it records.

`CompletionResult` is the one record both streaming clients (aiohttp's `stream_request` and the built-in
`FastStreamClient`) fill in, `Timeouts` bounds every request, and `Watchdog` enforces those bounds for both with a
single timer per request. Token-id prompts on `/v1/completions` are the exact path: what the prefix cache sees
is exactly what kvscope planned.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence


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
    #: sum and count of the generated tokens' log-probabilities, where the request asked for ``logprobs``
    #: (a model-routing cascade's confidence signal); 0 tokens: none were returned
    logprob_sum: float = 0.0
    logprob_tokens: int = 0

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

    @property
    def mean_logprob(self) -> float | None:
        """Mean log-probability of the generated tokens, or None when the server returned none."""
        return self.logprob_sum / self.logprob_tokens if self.logprob_tokens else None

    def fail(self, error_class: str, message: str) -> "CompletionResult":
        self.error_class = error_class
        self.error = message[:500]
        self.done_s = time.perf_counter()
        return self


def vllm_request_extras(cache_salt: str | None = None, ignore_eos: bool = True) -> dict[str, Any]:
    """vLLM's engine-specific body fields: exact output length, token ids back, per-tenant cache salt.

    A generic OpenAI-compatible endpoint gets none of these (its backend's `request_extras` is empty).
    """
    fields: dict[str, Any] = {"ignore_eos": ignore_eos, "return_token_ids": True}
    if cache_salt:
        fields["cache_salt"] = cache_salt
    return fields


def completion_payload(
    model: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    cache_salt: str | None = None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    extra: dict[str, Any] | None = None,
    engine_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streaming `/v1/completions` body; `engine_fields` default to vLLM's (`vllm_request_extras`)."""
    prompt = prompt_token_ids if isinstance(prompt_token_ids, list) else (
        prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else [int(t) for t in prompt_token_ids])
    if engine_fields is None:
        engine_fields = vllm_request_extras(cache_salt, ignore_eos)
    body = _streaming_body(model, "prompt", prompt, max_tokens, temperature, engine_fields)
    if extra:
        body.update(extra)
    return body


def chat_payload(model: str, messages: list[dict[str, str]], max_tokens: int, cache_salt: str | None = None,
                 ignore_eos: bool = True, temperature: float = 0.0,
                 engine_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """A streaming `/v1/chat/completions` body; `engine_fields` as for `completion_payload`."""
    if engine_fields is None:
        engine_fields = vllm_request_extras(cache_salt, ignore_eos)
    return _streaming_body(model, "messages", messages, max_tokens, temperature, engine_fields)


def _streaming_body(model: str, key: str, value: Any, max_tokens: int, temperature: float,
                    engine_fields: dict[str, Any]) -> dict[str, Any]:
    """The standard OpenAI streaming fields kvscope always sends (usage back), plus the engine's own."""
    body: dict[str, Any] = {
        "model": model,
        key: value,
        "max_tokens": int(max_tokens),
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(engine_fields)
    return body


class Watchdog:
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
