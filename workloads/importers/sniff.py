"""What kind of trace a file looks like, so an importer refuses a file of another kind instead of reading nothing.

Every format kvscope imports is JSON or JSONL whose records carry a few distinctive keys (a Codex rollout line
is ``{"timestamp", "type", "payload"}``, a Claude Code record has ``sessionId`` / ``parentUuid``, a SWE-agent
trajectory is one object with a ``trajectory`` list, …). Without this check an importer given the wrong file
skipped every record it did not know and wrote a trace of zero sessions, which ``replay`` and ``capacity``
then reported on. The check reads only the first records of a JSONL file (a whole-document JSON file is
parsed, as its importer does anyway), and it only refuses on evidence: a file it cannot place is left to the
importer, which still refuses a file that yields no request at all (:func:`refuse_empty`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvscope.workloads.errors import TraceFileError, WorkloadError, parse_json

# Format name (as `kvscope workload import FORMAT`) → what a file of that kind is, for messages.
DESCRIPTIONS = {
    "claude-code": "a Claude Code session",
    "codex": "a Codex CLI rollout",
    "openai-chat": "an OpenAI chat JSONL log",
    "swe-agent": "a SWE-agent trajectory",
    "openhands": "an OpenHands trajectory",
    "tracelab": "a TraceLab round trace",
    "mooncake": "a Mooncake trace",
    "jsonl": "a token-id JSONL trace",
    "kvcache-tester": "a kv-cache-tester trace",
}
# Kinds that no importer reads: what the file is and where it belongs.
_OTHER = {
    "kvscope-trace": "a kvscope trace directory (already imported; give it to replay, simulate or explain)",
    "kvscope-run": "a kvscope run directory (give it to explain or report)",
    "tracelab-expanded": "a TraceLab human-readable dump (import its .jsonl beside it)",
    "csv": "a CSV file",
    "json": "a JSON document of no known trace format",
    "text": "a text file that is not JSON",
}
_CODEX_TYPES = {"session_meta", "response_item", "event_msg", "turn_context", "compacted"}
_SNIFF_LINES = 20
_WHOLE_FILE_LIMIT_BYTES = 512 * 1024 * 1024


def describe(kind: str) -> str:
    return DESCRIPTIONS.get(kind) or _OTHER.get(kind, kind)


def _record_kind(rec: Any) -> str | None:
    """The format one JSONL record belongs to, or None if it says nothing decisive."""
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("trajectory"), list):
        return "swe-agent"
    if "payload" in rec and rec.get("type") in _CODEX_TYPES:
        return "codex"
    if "round_index" in rec and "input_tokens_total" in rec:
        return "tracelab"
    if "hash_ids" in rec:
        return "mooncake"
    if "prompt_token_ids" in rec:
        return "jsonl"
    inner = rec.get("request")
    req: dict = inner if isinstance(inner, dict) else rec
    if isinstance(req.get("messages"), list):
        return "openai-chat"
    if "sessionId" in rec or "parentUuid" in rec or (rec.get("type") in ("user", "assistant")
                                                     and isinstance(rec.get("message"), dict)):
        return "claude-code"
    return None


def _document_kind(doc: Any) -> str:
    if isinstance(doc, list) and doc and all(isinstance(e, dict) and "source" in e for e in doc[:20]):
        return "openhands"
    if isinstance(doc, list) and doc:
        kind = _record_kind(doc[0])  # a JSON array of JSONL-style records
        return kind or "json"
    return _record_kind(doc) or "json"


def sniff(path: str | Path) -> str | None:
    """The kind of ``path``: a format name of :data:`DESCRIPTIONS`, another kind (see :func:`describe`),
    ``"empty"``, or None when it cannot be told (unreadable, or JSON records without a known key)."""
    p = Path(path)
    if p.is_dir():
        if (p / "trace.json").is_file() and (p / "requests.parquet").exists():
            return "kvscope-trace"
        if (p / "run.json").is_file() or (p / "requests.parquet").exists():
            return "kvscope-run"
        return None
    if p.name.endswith((".tar.gz", ".tgz")):
        return "kvcache-tester"
    try:
        f = p.open("rb")
    except OSError:
        return None  # the importer names the read error
    with f:
        head = f.read(1 << 16)
        if not head.strip():
            return "empty" if not f.read(1) else None
        first = head.lstrip()[:1]
        if first not in (b"{", b"["):
            line = head.lstrip().split(b"\n", 1)[0]
            if line.startswith(b"#") and (b"\n===== record" in head or b"\n===== round" in head):
                return "tracelab-expanded"
            return "csv" if line.count(b",") >= 2 else "text"
        f.seek(0)
        kinds: list[str] = []
        jsonl = True
        for i, line in enumerate(f):
            if i >= _SNIFF_LINES * 5 or len(kinds) >= _SNIFF_LINES:
                break
            if not line.strip():
                continue
            try:
                rec = parse_json(line, str(p))
            except WorkloadError:
                jsonl = i > 0 and bool(kinds)  # a bad line later on is the importer's to name
                break
            kind = _record_kind(rec) if isinstance(rec, dict) else _document_kind(rec)
            if kind is not None:
                kinds.append(kind)
        if jsonl:
            return max(sorted(set(kinds)), key=kinds.count) if kinds else None
    if p.stat().st_size > _WHOLE_FILE_LIMIT_BYTES:
        return None
    try:
        return _document_kind(parse_json(p.read_bytes(), str(p)))
    except (WorkloadError, OSError):
        return "text" if first != b"{" and first != b"[" else None


def check_kind(path: str | Path, expected: str) -> None:
    """Refuse ``path`` in one line if it is empty or looks like another kind of file than ``expected``."""
    kind = sniff(path)
    if kind is None or kind == expected:
        return
    want = describe(expected)
    if kind == "empty":
        raise TraceFileError(f"{path}: empty file; expected {want}")
    hint = f"; use `kvscope workload import {kind}`" if kind in DESCRIPTIONS else ""
    raise TraceFileError(f"{path}: looks like {describe(kind)}, not {want}{hint}")


def read_json_document(path: str | Path, expected: str) -> Any:
    """A whole-document JSON trace (a trajectory) of kind ``expected``, parsed; one-line errors for a file of
    another kind (:func:`check_kind`), one that cannot be read, or one that is not JSON."""
    check_kind(path, expected)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TraceFileError(f"{path}: cannot read ({exc.strerror})") from None
    return parse_json(data, str(path))


def refuse_empty(path: str | Path, expected: str, what: str = "model calls") -> None:
    """The error for a file of the right kind from which nothing could be read."""
    raise TraceFileError(f"{path}: no {what} found; expected {describe(expected)}")


__all__ = ["DESCRIPTIONS", "describe", "sniff", "check_kind", "refuse_empty"]
