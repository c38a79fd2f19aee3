"""The one parser of OpenAI-style streaming responses (server-sent events), shared by both streaming clients.

Both clients hand raw body bytes to an :class:`SseDecoder` as they arrive, with the arrival time; the decoder
splits them into SSE lines, folds each ``data:`` JSON object into the request's :class:`CompletionResult`
(token ids, per-chunk timings, usage, finish reason) and records a malformed stream or a server error on the
result. One decoder means one set of rules for what counts as a token chunk, a truncated stream or a bad line,
whichever HTTP client carried the bytes. :func:`apply_chunk` starts with the shape vLLM streams for token-id
completions (one choice with ``token_ids``, no usage), because it is nearly every chunk of a replay.

Lines end in ``\r\n``, ``\n`` or a lone ``\r``, as the WHATWG SSE spec allows (sse-starlette, and so
llama-cpp-python's server, frames with ``\r\n``): :class:`SseLineSplitter` is the one splitter, used by the
decoder and by the recording proxy, and its fast path (no ``\r`` in the piece) is a plain ``split(b"\n")``.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from kvscope.harness.serving.request import CompletionResult

TEXT_HEAD_CHARS = 200
MAX_SSE_LINE_BYTES = 1 << 24
_SSE_FIELDS = (b"event:", b"id:", b"retry:", b":")


def _choice_text(choice: dict[str, Any]) -> str | None:
    delta = choice.get("delta")
    text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
    return text if isinstance(text, str) and text else None


def _keep_text(result: CompletionResult, choice: dict[str, Any]) -> None:
    if len(result.text_head) < TEXT_HEAD_CHARS:
        text = _choice_text(choice)
        if text:
            result.text_head = (result.text_head + text)[:TEXT_HEAD_CHARS]


def _add_logprobs(result: CompletionResult, logprobs: Any) -> None:
    """A completions chunk's ``logprobs.token_logprobs`` (one per generated token; the chat API's
    ``logprobs.content[].logprob`` likewise) added to the result's running sum."""
    if not isinstance(logprobs, dict):
        return
    values = logprobs.get("token_logprobs")
    if values is None and isinstance(logprobs.get("content"), list):
        values = [c.get("logprob") for c in logprobs["content"] if isinstance(c, dict)]
    for v in values or ():
        if isinstance(v, (int, float)) and math.isfinite(v):  # NaN / -inf: not a usable probability
            result.logprob_sum += float(v)
            result.logprob_tokens += 1


def _apply_choice(result: CompletionResult, choice: dict[str, Any], now_s: float) -> None:
    _keep_text(result, choice)
    logprobs = choice.get("logprobs")
    if logprobs:
        _add_logprobs(result, logprobs)
    ids = choice.get("token_ids")
    if ids:
        if result.first_token_s is None:
            result.first_token_s = now_s
        result.token_ids.extend(ids)
        result.chunk_times_s.append(now_s)
        result.chunk_tokens.append(len(ids))
    elif _choice_text(choice):
        if result.first_token_s is None:
            result.first_token_s = now_s
        result.chunk_times_s.append(now_s)
        result.chunk_tokens.append(1)
        result.text_chunks += 1
    reason = choice.get("finish_reason")
    if reason:
        result.finish_reason = reason


def apply_chunk(result: CompletionResult, chunk: dict[str, Any], now_s: float) -> None:
    """Fold one SSE `data:` JSON object into the result (token ids, timings, usage)."""
    choices = chunk.get("choices")
    usage = chunk.get("usage")
    if not usage and choices and len(choices) == 1:  # nearly every chunk: one choice carrying token ids
        choice = choices[0]
        ids = choice.get("token_ids")
        if ids and type(ids) is list:
            if len(result.text_head) < TEXT_HEAD_CHARS:
                _keep_text(result, choice)
            if result.first_token_s is None:
                result.first_token_s = now_s
            result.token_ids.extend(ids)
            result.chunk_times_s.append(now_s)
            result.chunk_tokens.append(len(ids))
            reason = choice.get("finish_reason")
            if reason:
                result.finish_reason = reason
            logprobs = choice.get("logprobs")
            if logprobs:
                _add_logprobs(result, logprobs)
            return
    if choices:
        for choice in choices:
            _apply_choice(result, choice, now_s)
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        # vLLM 0.11 omits the details when nothing was cached: a missing value means 0.
        result.cached_tokens = int(details.get("cached_tokens") or 0)


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


def check_sse_line(line: bytes) -> bool:
    """A non-data SSE line: empty (event boundary), a comment, or a field kvscope ignores."""
    return not line.strip() or line.startswith(_SSE_FIELDS)


class SseLineSplitter:
    """Incremental SSE line splitter: ``feed(piece)`` returns the lines the piece completed, terminators
    removed; a line cut across pieces waits in ``tail``. A ``\r`` ending one piece and a ``\n`` opening the
    next are one terminator."""

    __slots__ = ("tail", "_cr")

    def __init__(self) -> None:
        self.tail = b""
        self._cr = False

    def feed(self, data: bytes) -> list[bytes]:
        if self._cr:
            self._cr = False
            if data[:1] == b"\n":
                data = data[1:]
        if b"\r" in data:
            self._cr = data[-1:] == b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if self.tail:
            data = self.tail + data
        lines = data.split(b"\n")
        self.tail = lines.pop()
        return lines


class SseDecoder:
    """Incremental decoder of one streamed response body into its :class:`CompletionResult`.

    ``feed(data, now)`` takes body bytes in whatever pieces the transport delivered; a line cut across two
    pieces waits in ``tail``. It returns False once the stream has failed (the result records why); after
    ``[DONE]`` (``saw_done``) further data lines are ignored.
    """

    __slots__ = ("result", "lines", "saw_done")

    def __init__(self, result: CompletionResult) -> None:
        self.result = result
        self.lines = SseLineSplitter()
        self.saw_done = False

    @property
    def tail(self) -> bytes:
        return self.lines.tail

    def feed(self, data: bytes, now: float) -> bool:
        lines = self.lines.feed(data)
        if len(self.lines.tail) > MAX_SSE_LINE_BYTES:
            self.result.fail("malformed_stream", "SSE line over 16 MiB")
            return False
        for line in lines:
            if line[:5] != b"data:":
                if check_sse_line(line):
                    continue
                self.result.fail("malformed_stream", "not an SSE line: " + line[:200].decode(errors="replace"))
                return False
            if self.saw_done:
                continue
            payload = line[6:] if line[5:6] == b" " else line[5:]
            if payload[-1:] in (b"\r", b" "):
                payload = payload.strip()
            state = parse_sse_payload(self.result, payload, now)
            if state is None:
                return False
            if state:
                self.saw_done = True
        return True
