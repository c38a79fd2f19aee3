"""Errors about workload inputs. Each names the file and, where there is one, the line or row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

try:
    from orjson import JSONDecodeError as _OrjsonError
    from orjson import loads as _loads
except ImportError:  # pragma: no cover
    _loads = json.loads
    _OrjsonError = json.JSONDecodeError  # type: ignore[misc]


class WorkloadError(ValueError):
    """A workload input (spec, trace, imported file) that cannot be used."""


class TraceFileError(WorkloadError):
    """A trace or import file that is missing, unreadable or malformed."""


def parse_json(data: str | bytes, where: str) -> Any:
    """One JSON document; `where` (e.g. "trace.jsonl: line 7") leads the error message."""
    try:
        return _loads(data)
    except (_OrjsonError, json.JSONDecodeError, ValueError) as exc:
        raise TraceFileError(f"{where}: not valid JSON ({exc})") from None


def iter_json_lines(path: str | Path, lines: Iterable[str | bytes] | None = None) -> Iterator[tuple[int, Any]]:
    """(1-based line number, object) for each non-empty line; a bad line raises naming its number."""
    p = Path(path)
    if lines is None:
        try:
            f = open(p, "rb")
        except OSError as exc:
            raise TraceFileError(f"{p}: cannot read ({exc.strerror})") from None
        with f:
            yield from iter_json_lines(p, f)
        return
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        obj = parse_json(line, f"{p}: line {i}")
        if not isinstance(obj, dict):
            raise TraceFileError(f"{p}: line {i}: expected a JSON object, got {type(obj).__name__}")
        yield i, obj


def require_fields(obj: dict, fields: Iterable[str], where: str) -> None:
    missing = [f for f in fields if f not in obj]
    if missing:
        raise TraceFileError(f"{where}: missing field(s) {', '.join(missing)}")
