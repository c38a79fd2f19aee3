"""One line of ``exchanges.jsonl`` as a model: what the recording proxy wrote about one exchange.

The proxy writes each exchange as it happened (:meth:`~kvscope.harness.record.proxy.RecordingProxy._log`);
the trace builder reads them back through these models, so a field is named once and a line of the wrong
shape is found where it is read (and left out with a warning, as a torn line is), not deep in the builder.

What stays open: the request body is the client's own OpenAI request (``messages``, ``tools``, sampling
fields, whatever else the client sent) and is passed on as sent; the provider's ``usage`` is typed in the
fields kvscope reads and keeps the rest (providers add their own).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class PromptTokensDetails(BaseModel):
    model_config = ConfigDict(extra="allow")

    cached_tokens: int | None = None  # OpenAI / vLLM: prompt tokens served from the prefix cache


class ProviderUsage(BaseModel):
    """The response's ``usage`` as the provider reported it (OpenAI and vLLM fields, Anthropic's cache reads)."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: PromptTokensDetails | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class CapturedResponse(BaseModel):
    """What the response said (:class:`~kvscope.harness.record.proxy.ResponseCapture`, assembled)."""

    model_config = ConfigDict(extra="allow")

    text: str = ""
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)  # OpenAI tool calls, as the client got them
    finish_reason: str | None = None
    usage: ProviderUsage | None = None
    reasoning: str | None = None


class Exchange(BaseModel):
    """One recorded exchange. ``status``: the upstream's HTTP status, or ``interrupted`` /
    ``client_disconnected`` (the proxy's shutdown, a client that left); times are wall-clock (Unix s)."""

    model_config = ConfigDict(extra="allow")

    request_id: int
    api: str  # chat | completions
    received_unix_s: float
    first_byte_unix_s: float | None = None
    done_unix_s: float | None = None
    status: int | str | None = None
    session_header: str | None = None
    injected_include_usage: bool = False
    request: dict[str, Any]  # the client's request body as sent (credential fields redacted)
    response: CapturedResponse = Field(default_factory=CapturedResponse)
    error: str | None = None

    @field_validator("response", mode="before")
    @classmethod
    def _no_response(cls, v: Any) -> Any:
        return {} if v is None else v

    @property
    def completed(self) -> bool:
        """Answered in full: HTTP 200, no error, an end time."""
        return self.status == 200 and not self.error and self.done_unix_s is not None and self.done_unix_s != 0
