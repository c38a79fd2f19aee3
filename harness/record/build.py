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

Memory: :func:`finalize` streams the log (an index of where each completed exchange is, then one exchange at a
time in arrival order), so it needs the largest exchange's memory plus the trace it builds, whatever the log's
size; an exchange over :data:`MAX_EXCHANGE_MIB` (``--max-exchange-mib``) is refused in one line before any
tokenizing, and progress bars show both passes.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.record.exchange_log import Exchange, ProviderUsage
from kvscope.harness.record.proxy import EXCHANGES_LOG, RECORD_META
from kvscope.harness.record.tokenize import (
    LocalTokenize,
    MessageShapeError,
    RequestTokenizer,
    UpstreamTokenize,
)
from kvscope.harness.results.exchanges import ExchangeRow, write_exchanges
from kvscope.harness.serving.backend import endpoint_facts
from kvscope.workloads.prefix import common_prefix_len, transition_from
from kvscope.workloads.trace import TraceBuilder
from kvscope.workloads.trace_schema import SegmentKind, read_trace_file, write_trace_file
from pydantic import ValidationError

_KIND_OF_ROLE = {"system": SegmentKind.SYSTEM, "developer": SegmentKind.SYSTEM, "user": SegmentKind.USER,
                 "assistant": SegmentKind.ASSISTANT,
                 "tool": SegmentKind.TOOL_OUTPUT, "function": SegmentKind.TOOL_OUTPUT}
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


#: Largest exchange (one line of ``exchanges.jsonl``) finalize accepts, in MiB (``--max-exchange-mib``). Why a
#: cap: tokenizing holds about 200 bytes per byte of prompt text (the tokenizer's encoding keeps a string and
#: offsets per token, the rendering and the prefix renderings their copies), so one 100 MB request took a
#: finalize past 17 GB; 16 MiB is twice the text of a 2-million-token context, about 3 GB to tokenize.
MAX_EXCHANGE_MIB = 16


class ExchangeTooLargeError(KvscopeError):
    """An exchange over the finalize cap (:data:`MAX_EXCHANGE_MIB`)."""


@dataclass(frozen=True, slots=True)
class _LogLine:
    number: int  # 1-based line number in the log
    offset: int  # byte offset of the record (past a torn prefix glued to it)
    length: int


def _exchange_lines(path: Path, max_mib: float | None) -> Iterator[tuple[int, int, bytes, bool]]:
    """(line number, byte offset, line without its newline, whether it had one) of the log, one line in memory
    at a time; a line over ``max_mib`` raises :class:`ExchangeTooLargeError` naming it, before it is read."""
    max_bytes = None if max_mib is None or max_mib == float("inf") else int(max_mib * 2**20)  # inf: no cap
    with open(path, "rb") as f:
        number, offset = 0, 0
        while True:
            line = f.readline(max_bytes + 2) if max_bytes is not None else f.readline()
            if not line:
                return
            number += 1
            if max_bytes is not None and len(line.rstrip(b"\n")) > max_bytes:
                size, piece = len(line), line
                while not piece.endswith(b"\n"):  # measure the rest without holding it
                    piece = f.read(1 << 20)
                    cut = piece.find(b"\n")
                    size += cut + 1 if cut >= 0 else len(piece)
                    if not piece or cut >= 0:
                        break
                rid = re.match(rb'\{"request_id":(\d+)', line[:40])
                raise ExchangeTooLargeError(
                    f"{path}: line {number}{f' (exchange {int(rid.group(1))})' if rid else ''} is "
                    f"{size / 2**20:.1f} MiB, over the {max_mib:g} MiB finalize takes per exchange "
                    "(--max-exchange-mib): raise it where this machine has the memory (tokenizing holds about "
                    "200 bytes per byte of prompt), or move that line out of the log")
            whole = line.endswith(b"\n")
            yield number, offset, line[:-1] if whole else line, whole
            offset += len(line)


def _log_records(path: Path, max_mib: float | None) -> Iterator[tuple[_LogLine, Exchange]]:
    """Each record of the log with where it is. A torn final line is dropped with a warning; a line that is not a
    record (a log an older proxy appended onto a torn line) is skipped with a warning, keeping the record glued
    to its end when there is one, so no whole record already on disk is lost."""
    for number, offset, line, whole in _exchange_lines(path, max_mib):
        if not line.strip():
            continue
        row, start = _record(line), 0
        if row is None:
            start = line.rfind(b'{"request_id":')
            row = _record(line[start:]) if start > 0 else None
            what = "incomplete final record dropped" if not whole else (
                "torn record dropped, the record after it kept" if row is not None else "not a record, skipped")
            warnings.warn(f"{path}: line {number}: {what} ({len(line)} bytes)", UserWarning, stacklevel=3)
        if row is not None:
            start = max(start, 0)
            yield _LogLine(number, offset + start, len(line) - start), row


def as_exchange(exchange: Exchange | Mapping[str, Any]) -> Exchange:
    """An exchange as its model (a mapping is one line of the log, already parsed)."""
    return exchange if isinstance(exchange, Exchange) else Exchange.model_validate(exchange)


def read_exchanges_log(record_dir: str | Path, max_exchange_mib: float | None = None) -> list[Exchange]:
    """Every exchange of the log, in memory (tests, small logs); :func:`finalize` streams it instead. Torn and
    glued lines as :func:`_log_records` says."""
    return [row for _, row in _log_records(_log_path(record_dir), max_exchange_mib)]


def _log_path(record_dir: str | Path) -> Path:
    path = Path(record_dir) / EXCHANGES_LOG
    if not path.is_file():
        raise KvscopeError(f"{record_dir}: no {EXCHANGES_LOG} (not a `kvscope record` output directory)")
    return path


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
        return [builder.shared_segment(ids, SegmentKind.IMPORTED)]
    out, start = [], 0
    for m, end in zip(messages, ends):
        kind = _KIND_OF_ROLE.get((m or {}).get("role", ""), SegmentKind.IMPORTED)
        if kind == SegmentKind.ASSISTANT and (m or {}).get("tool_calls"):
            kind = SegmentKind.TOOL_CALL
        out.append(builder.shared_segment(ids[start:end], kind))
        start = end
    out.append(builder.shared_segment(ids[start:], SegmentKind.TEMPLATE))
    return out


def build_trace(exchanges: Iterable[Exchange | Mapping[str, Any]], tokenizer: RequestTokenizer, out_dir: str | Path,
                meta: dict[str, Any] | None = None) -> Path:
    """Write the trace (``trace.json``, ``segments.parquet``, ``requests.parquet``) and ``exchanges.parquet``
    from exchanges in memory (:func:`finalize` streams them from the log instead)."""
    exchanges = [as_exchange(e) for e in exchanges]
    done = sorted((e for e in exchanges if e.completed), key=lambda e: (e.received_unix_s, e.request_id))
    return _build_trace(done, len(exchanges) - len(done), tokenizer, out_dir, meta)


class _LogExchanges:
    """The completed exchanges of a log in arrival order, each read from disk when the loop reaches it: the
    build holds one exchange's body at a time, never the log."""

    def __init__(self, path: Path, lines: list[_LogLine]) -> None:
        self.path, self.lines = path, lines

    def __len__(self) -> int:
        return len(self.lines)

    def __iter__(self) -> Iterator[Exchange]:
        with open(self.path, "rb") as f:
            for line in self.lines:
                f.seek(line.offset)
                row = _record(f.read(line.length))
                if row is None:  # the log changed under us (another writer): say so rather than build nonsense
                    raise KvscopeError(f"{self.path}: line {line.number} changed while the trace was built")
                yield row


def _build_trace(done: Sequence[Exchange] | _LogExchanges, incomplete: int, tokenizer: RequestTokenizer,
                 out_dir: str | Path, meta: dict[str, Any] | None, progress: bool = False) -> Path:
    """One pass over the completed exchanges in arrival order: tokenize, assign the session, add the row. Only
    the trace being built and each session's last prompt stay in memory between exchanges."""
    from tqdm import tqdm  # deferred: tqdm is heavy, only a progress bar needs it

    builder = TraceBuilder()
    sessions = SessionAssigner()
    extras: list[ExchangeRow] = []
    last_prompt: dict[str, np.ndarray] = {}  # per session, the ids of its last request (for the transition)
    skipped: list[str] = []
    mismatched = 0
    t0: float | None = None
    row_index = 0
    for ex in tqdm(done, total=len(done), desc="finalize: tokenize", unit="exchange", disable=not progress,
                   leave=False):
        try:  # an exchange that cannot be rendered is left out, not fatal
            tok = tokenizer.tokenize(ex.api, ex.request)
        except (MessageShapeError, ValueError, TypeError) as exc:
            skipped.append(f"exchange {ex.request_id}: {exc}")
            continue
        if t0 is None:
            t0 = ex.received_unix_s
        body, resp = ex.request, ex.response
        sid, source = sessions.assign(ex)
        sess = sessions.sessions.get(sid)
        ids = np.asarray(tok.prompt_ids, dtype=np.int32)
        del tok.prompt_ids[:]  # the Python ints (28 bytes each) are not needed once copied
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
            "transition": transition_from(last_prompt[sid] if sess else None, ids),
            "input_kind": ex.api, "tenant": 0,
            "messages": json.dumps(messages) if messages is not None else None,
        })
        last_prompt[sid] = ids
        keys = [_message_key(m) for m in (messages or [body.get("prompt")])]
        first, done_s = ex.first_byte_unix_s, ex.done_unix_s
        assert done_s is not None  # a completed exchange
        sessions.sessions[sid] = _Session(sid, keys, done_s, (sess.steps if sess else 0) + 1, row_index,
                                          sess.start_s if sess else arrival)
        extras.append(ExchangeRow(
            request_id=row_index, tools_json=json.dumps(body["tools"]) if body.get("tools") is not None else None,
            params_json=json.dumps({k: v for k, v in body.items() if k not in _PARAM_SKIP}),
            response_json=json.dumps({"text": resp.text, "tool_calls": resp.tool_calls,
                                      "finish_reason": resp.finish_reason}),
            ttft_s=(first - ex.received_unix_s) if first else None, e2e_s=done_s - ex.received_unix_s,
            session_source=source, **usage))
        row_index += 1
    if skipped:
        warnings.warn(f"{out_dir}: {len(skipped)} exchange(s) left out of the trace, their body cannot be "
                      f"rendered (first: {skipped[0]})", UserWarning, stacklevel=3)
    if not row_index:
        raise KvscopeError(f"{out_dir}: no completed exchanges to build a trace from ({len(done) + incomplete} "
                           f"recorded, {incomplete} incomplete, {len(skipped)} not renderable)")
    info = {"recorded_by": "kvscope record", "exchanges": row_index, "text_mode": True,
            "incomplete_exchanges": incomplete, "skipped_exchanges": len(skipped),
            "prompt_tokens_mismatch_usage": mismatched, **(meta or {})}
    trace = builder.build({"source": "record", "record": info, "text": {"recorded": True}})
    out = trace.write(out_dir)
    write_exchanges(out, extras)  # request ids equal row order: rows were added in arrival order
    return out


def finalize(record_dir: str | Path, *, upstream: str | None = None, tokenizer_dir: str | None = None,
             chat_template: str | None = None, headers: dict[str, str] | None = None,
             max_exchange_mib: float = MAX_EXCHANGE_MIB, progress: bool = False) -> Path:
    """Build the trace in ``record_dir`` from its exchange log; tokens from ``tokenizer_dir`` if given, else the
    upstream's ``/tokenize`` (``upstream`` or the one in ``record.json``).

    Streamed: a first pass reads the log line by line, keeping only where each completed exchange is and when
    it arrived (refusing, before any tokenizing, an exchange over ``max_exchange_mib``); the build then reads
    them back one at a time in arrival order. Memory is the largest exchange's plus the trace being built."""
    from tqdm import tqdm  # deferred: only finalize shows a bar

    record_dir = Path(record_dir)
    if not max_exchange_mib > 0:
        raise KvscopeError(f"--max-exchange-mib {max_exchange_mib}: expected a size in MiB > 0")
    path = _log_path(record_dir)
    found: list[tuple[float, int, _LogLine]] = []
    recorded = 0
    with tqdm(total=path.stat().st_size, desc="finalize: read log", unit="B", unit_scale=True,
              disable=not progress, leave=False) as bar:
        for loc, row in _log_records(path, max_exchange_mib):
            recorded += 1
            if row.completed:
                found.append((row.received_unix_s, row.request_id, loc))
            bar.update(loc.offset + loc.length + 1 - bar.n)
            del row
    found.sort(key=lambda t: (t[0], t[1]))
    done = _LogExchanges(path, [loc for _, _, loc in found])
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
    out = _build_trace(done, recorded - len(done), RequestTokenizer(backend), record_dir, {"tokenized_by": source},
                       progress)
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
