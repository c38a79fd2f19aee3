"""``exchanges.parquet``: what a recorded or imported trace's requests carried beyond tokens and messages.

A text-mode trace stores prompts as token segments and ``messages`` as JSON; a *recorded* trace also knows the
request's tool definitions, its sampling parameters, the response and the provider's usage (prompt tokens and
cached tokens as the provider reported them). Those live beside the trace in one Parquet file keyed by
``request_id``, so the trace format itself stays unchanged and every reader of traces keeps working; the
``kvscope explain`` attribution reads the tools (for ``tools_changed``) and the observed cache reads from here.

It sits in ``results`` because both its writer (``harness.record``) and its reader (``harness.analysis``) need
it, and results is the lowest layer both may import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from kvscope.harness.results.records import RecordsError

EXCHANGES_NAME = "exchanges.parquet"


@dataclass(slots=True)
class ExchangeRow:
    """One request's extras. ``None`` where the source did not say."""

    request_id: int
    tools_json: str | None = None  # the request's `tools` list, as sent
    params_json: str | None = None  # other body fields (model, max_tokens, temperature, tool_choice, ...)
    response_json: str | None = None  # {"text", "tool_calls", "finish_reason"}
    provider_prompt_tokens: int | None = None  # usage.prompt_tokens
    provider_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (OpenAI / vLLM)
    cache_read_input_tokens: int | None = None  # Anthropic usage
    cache_creation_input_tokens: int | None = None  # Anthropic usage
    completion_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    session_source: str | None = None  # header | user | inferred


def write_exchanges(trace_dir: str | Path, rows: list[ExchangeRow]) -> Path:
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

    out = Path(trace_dir) / EXCHANGES_NAME
    df = pd.DataFrame([asdict(r) for r in rows], columns=list(ExchangeRow.__dataclass_fields__))
    for col in ("provider_prompt_tokens", "provider_cached_tokens", "cache_read_input_tokens",
                "cache_creation_input_tokens", "completion_tokens"):
        df[col] = df[col].astype("Int64")
    tmp = out.with_suffix(".parquet.tmp")
    df.to_parquet(tmp, index=False)
    tmp.replace(out)
    return out


def read_exchanges(trace_dir: str | Path):
    """The extras of a trace as a DataFrame indexed by request_id, or None when the trace has none."""
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

    path = Path(trace_dir) / EXCHANGES_NAME
    if not path.is_file():
        return None

    try:
        df = pd.read_parquet(path)
    except (OSError, ValueError) as exc:
        raise RecordsError(f"{path}: unreadable ({exc.__class__.__name__}: {exc})") from None
    if "request_id" not in df.columns:
        raise RecordsError(f"{path}: no request_id column")
    return df.set_index("request_id", drop=False)
