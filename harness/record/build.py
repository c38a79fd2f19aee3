"""From ``exchanges.jsonl`` to a text-mode kvscope trace (``kvscope record`` at shutdown, or ``--finalize``).

Sessions: an ``X-Session-ID`` header, else the body's ``user`` field, else inferred: a request joins the open
session whose last request shares the longest run of leading messages with it (at least one message after a
shared system prompt, or the first message when there is no system prompt); otherwise it starts a session.
A changed system prompt therefore starts a new *inferred* session; agents that change it should send a header.

Segments: one per message span of the rendered prompt (``[end of message i-1, end of message i)``: the role
header, the content and the end-of-turn), kind by role, plus a final ``template`` segment (the generation
prompt). Identical spans share one segment, so an append-only session stores each message once. A request
whose message ends are unknown is one ``imported`` segment. Timing: ``arrival_s`` from the first exchange,
``think_time_s`` = this request's arrival minus the end of the session's previous response.

One bad exchange never costs the recording: an exchange whose body cannot be rendered (``messages`` not a list
of messages, a template error) is left out with a warning and counted in ``trace.json``
(``record.skipped_exchanges``), as are exchanges that did not complete (``record.incomplete_exchanges``:
upstream errors, interrupted at shutdown, clients that left). Server facts (the block size hint) come through
the serving :class:`~kvscope.harness.serving.backend.Backend` interface, transitions from the one rule of
:mod:`kvscope.workloads.prefix`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.record.exchange_log import Exchange, ProviderUsage
from kvscope.harness.record.proxy import EXCHANGES_LOG, RECORD_META
from kvscope.harness.record.tokenize import LocalTokenize, MessageShapeError, RequestTokenizer, UpstreamTokenize
from kvscope.harness.results.exchanges import ExchangeRow, write_exchanges
from kvscope.harness.serving.backend import endpoint_facts
from kvscope.workloads.prefix import common_prefix_len, transition_from
from kvscope.workloads.trace import TraceBuilder
from kvscope.workloads.trace_schema import read_trace_file, write_trace_file

_KIND_OF_ROLE = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool_output", "function": "tool_output"}
_PARAM_SKIP = {"messages", "prompt", "tools", "user"}


@dataclass(slots=True)
class _Session:
    session_id: str
    last_messages: list[Any]
    last_done_s: float
    steps: int
    last_row: int
    start_s: float


def _message_key(m: Any) -> str:
    return json.dumps(m, sort_keys=True)


class SessionAssigner:
    """Header, ``user`` field, or longest leading-message match (see the module doc)."""

    def __init__(self) -> None:
        self.sessions: dict[str, _Session] = {}
        self._n_inferred = 0

    def assign(self, exchange: Exchange | Mapping[str, Any]) -> tuple[str, str]:
        exchange = as_exchange(exchange)
        body = exchange.request
        if exchange.session_header:
            return f"{exchange.session_header}", "header"
        if isinstance(body.get("user"), str) and body["user"]:
            return f"user:{body['user']}", "user"
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            messages = None
        keys = [_message_key(m) for m in messages or [body.get("prompt")]]
        system_first = messages is not None and isinstance(messages[0], dict) and messages[0].get("role") in (
            "system", "developer")
        best, best_n = None, 0
        for s in self.sessions.values():
            n = common_prefix_len(keys, s.last_messages)
            need = 2 if system_first else 1
            if n >= need and n > best_n:
                best, best_n = s, n
        if best is not None:
            return best.session_id, "inferred"
        self._n_inferred += 1
        return f"inferred-{self._n_inferred}", "inferred"


def as_exchange(exchange: Exchange | Mapping[str, Any]) -> Exchange:
    """An exchange as its model (a mapping is one line of the log, already parsed)."""
    return exchange if isinstance(exchange, Exchange) else Exchange.model_validate(exchange)


def read_exchanges_log(record_dir: str | Path) -> list[Exchange]:
    """Every exchange of the log. A torn final line is dropped with a warning; a line that is not a record
    (a log an older proxy appended onto a torn line, or a record of the wrong shape) is skipped with a
    warning, keeping the record glued to its end when there is one, so no whole record already on disk is
    lost."""
    path = Path(record_dir) / EXCHANGES_LOG
    if not path.is_file():
        raise KvscopeError(f"{record_dir}: no {EXCHANGES_LOG} (not a `kvscope record` output directory)")
    lines = path.read_bytes().split(b"\n")
    rows: list[Exchange] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        row = _record(line)
        if row is None:
            start = line.rfind(b'{"request_id":')
            row = _record(line[start:]) if start > 0 else None
            what = "incomplete final record dropped" if i == len(lines) - 1 else (
                "torn record dropped, the record after it kept" if row is not None else "not a record, skipped")
            warnings.warn(f"{path}: line {i + 1}: {what} ({len(line)} bytes)", UserWarning, stacklevel=2)
        if row is not None:
            rows.append(row)
    return rows


def _record(line: bytes) -> Exchange | None:
    try:
        return Exchange.model_validate_json(line)
    except ValidationError:  # not JSON, or not a record
        return None


def _usage_fields(usage: ProviderUsage | None) -> dict[str, int | None]:
    usage = usage or ProviderUsage()
    details = usage.prompt_tokens_details
    return {"provider_prompt_tokens": usage.prompt_tokens,
            "provider_cached_tokens": details.cached_tokens if details is not None else None,
            "cache_read_input_tokens": usage.cache_read_input_tokens,
            "cache_creation_input_tokens": usage.cache_creation_input_tokens,
            "completion_tokens": usage.completion_tokens}


def _prompt_segments(builder: TraceBuilder, ids: np.ndarray, messages: list[dict] | None,
                     ends: list[int] | None) -> list[int]:
    if not messages or ends is None or len(ends) != len(messages):
        return [builder.shared_segment(ids, "imported")]
    out, start = [], 0
    for m, end in zip(messages, ends):
        kind = _KIND_OF_ROLE.get((m or {}).get("role", ""), "imported")
        if kind == "assistant" and (m or {}).get("tool_calls"):
            kind = "tool_call"
        out.append(builder.shared_segment(ids[start:end], kind))
        start = end
    out.append(builder.shared_segment(ids[start:], "template"))
    return out


def build_trace(exchanges: Iterable[Exchange | Mapping[str, Any]], tokenizer: RequestTokenizer,
                out_dir: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write the trace (``trace.json``, ``segments.parquet``, ``requests.parquet``) and ``exchanges.parquet``."""
    exchanges = [as_exchange(e) for e in exchanges]
    done = sorted((e for e in exchanges if e.completed), key=lambda e: (e.received_unix_s, e.request_id))
    incomplete = len(exchanges) - len(done)
    tokenized, skipped = [], []
    for ex in done:  # tokenize first: an exchange that cannot be rendered is left out, not fatal
        try:
            tokenized.append((ex, tokenizer.tokenize(ex.api, ex.request)))
        except (MessageShapeError, ValueError, TypeError) as exc:
            skipped.append(f"exchange {ex.request_id}: {exc}")
    if skipped:
        warnings.warn(f"{out_dir}: {len(skipped)} exchange(s) left out of the trace, their body cannot be "
                      f"rendered (first: {skipped[0]})", UserWarning, stacklevel=2)
    if not tokenized:
        raise KvscopeError(f"{out_dir}: no completed exchanges to build a trace from ({len(exchanges)} recorded, "
                           f"{incomplete} incomplete, {len(skipped)} not renderable)")
    builder = TraceBuilder()
    sessions = SessionAssigner()
    t0 = tokenized[0][0].received_unix_s
    extras: list[ExchangeRow] = []
    prompts: list[np.ndarray] = []
    mismatched = 0
    for row_index, (ex, tok) in enumerate(tokenized):
        body, resp = ex.request, ex.response
        sid, source = sessions.assign(ex)
        sess = sessions.sessions.get(sid)
        ids = np.asarray(tok.prompt_ids, dtype=np.int32)
        prompts.append(ids)
        messages = body.get("messages") if ex.api == "chat" else None
        usage = _usage_fields(resp.usage)
        if usage["provider_prompt_tokens"] is not None and usage["provider_prompt_tokens"] != len(ids):
            mismatched += 1
        arrival = ex.received_unix_s - t0
        n_out = usage["completion_tokens"] or 0
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or n_out
        builder.rows.append({
            "session_id": sid, "step": sess.steps if sess else 0,
            "parent_request_id": sess.last_row if sess else -1, "arrival_s": arrival,
            "session_start_s": arrival if sess is None else sess.start_s,
            "think_time_s": max(0.0, ex.received_unix_s - sess.last_done_s) if sess else 0.0,
            "prompt_segment_ids": _prompt_segments(builder, ids, messages, tok.message_ends),
            "output_tokens": int(n_out), "max_tokens": int(max_tokens),
            "transition": transition_from(prompts[sess.last_row] if sess else None, ids),
            "input_kind": ex.api, "tenant": 0,
            "messages": json.dumps(messages) if messages is not None else None,
        })
        keys = [_message_key(m) for m in (messages or [body.get("prompt")])]
        first, done = ex.first_byte_unix_s, ex.done_unix_s
        assert done is not None  # a completed exchange
        sessions.sessions[sid] = _Session(sid, keys, done, (sess.steps if sess else 0) + 1, row_index,
                                          sess.start_s if sess else arrival)
        extras.append(ExchangeRow(
            request_id=row_index, tools_json=json.dumps(body["tools"]) if body.get("tools") is not None else None,
            params_json=json.dumps({k: v for k, v in body.items() if k not in _PARAM_SKIP}),
            response_json=json.dumps({"text": resp.text, "tool_calls": resp.tool_calls,
                                      "finish_reason": resp.finish_reason}),
            ttft_s=(first - ex.received_unix_s) if first else None, e2e_s=done - ex.received_unix_s,
            session_source=source, **usage))
    info = {"recorded_by": "kvscope record", "exchanges": len(tokenized), "text_mode": True,
            "incomplete_exchanges": incomplete, "skipped_exchanges": len(skipped),
            "prompt_tokens_mismatch_usage": mismatched, **(meta or {})}
    trace = builder.build({"source": "record", "record": info, "text": {"recorded": True}})
    out = trace.write(out_dir)
    write_exchanges(out, extras)  # request ids equal row order: rows were added in arrival order
    return out


def finalize(record_dir: str | Path, *, upstream: str | None = None, tokenizer_dir: str | None = None,
             chat_template: str | None = None, headers: dict[str, str] | None = None) -> Path:
    """Build the trace in ``record_dir`` from its exchange log; tokens from ``tokenizer_dir`` if given, else the
    upstream's ``/tokenize`` (``upstream`` or the one in ``record.json``)."""

    record_dir = Path(record_dir)
    exchanges = read_exchanges_log(record_dir)
    if tokenizer_dir:
        backend = LocalTokenize(tokenizer_dir, chat_template)
        source = f"tokenizer {Path(tokenizer_dir).name}"
    else:
        if upstream is None and (record_dir / RECORD_META).is_file():
            upstream = json.loads((record_dir / RECORD_META).read_text()).get("upstream")
        if not upstream:
            raise KvscopeError(f"{record_dir}: no upstream to tokenize with; give --upstream URL or --tokenizer DIR")
        backend = UpstreamTokenize(upstream, headers)
        source = "upstream /tokenize"
    out = build_trace(exchanges, RequestTokenizer(backend), record_dir, {"tokenized_by": source})
    block_size = _upstream_block_size(upstream, headers) if upstream else None
    if block_size:
        header = read_trace_file(out / "trace.json")
        write_trace_file(out / "trace.json", header.model_copy(update={"block_size_hint": block_size}).model_dump())
    return out


def _upstream_block_size(upstream: str, headers: dict[str, str] | None) -> int | None:
    """The upstream's KV block size where it says (the vLLM backend's facts: /metrics), so explain and simulate
    use it; None for an upstream that does not say."""
    try:
        return endpoint_facts(upstream, headers=headers or {}, timeout_s=5.0).block_size
    except (KvscopeError, ValueError, OSError):
        return None
