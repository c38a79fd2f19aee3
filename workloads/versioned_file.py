"""Versioned JSON files: one pydantic model per file kind, carrying a `format` name and a `version`.

Every JSON file kvscope writes is read back by a later stage, by notebooks, or by a later kvscope release
(`trace.json` here; `summary.json`, `manifest.json`, `experiment.json` and `report.json` in
`kvscope.harness.results.schemas`). Writers dump the model, readers validate it, and the reader checks the
format name and version *before* any field, so a file of another kind or another release fails with one line
naming the file, the version found and the versions this kvscope reads, instead of a `KeyError` three stages
later. It lives in the lowest layer (workloads) because the trace is the lowest file that needs it; the
harness passes its own error class.

A file without a version is rejected with that same message (found: "none"). Only the trace has been
versioned from the start; the other files of the previous release had no typed fields, so reading them
would mean guessing what each missing field meant. Regenerate them (re-run the replay / experiment).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

FileT = TypeVar("FileT", bound="VersionedFile")


class VersionedFile(BaseModel):
    """Base of every file model. Subclasses set `FORMAT` and `SUPPORTED_VERSIONS` and declare
    `format: Literal[FORMAT] = FORMAT` and `version: int = <current version>` as their first fields."""

    model_config = ConfigDict(extra="forbid")

    FORMAT: ClassVar[str] = ""
    SUPPORTED_VERSIONS: ClassVar[tuple[int, ...]] = (1,)


class _Header(BaseModel):
    """The two fields checked before anything else; everything else in the file is ignored here."""

    model_config = ConfigDict(extra="ignore")

    format: Any = None
    version: Any = None


def one_line(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ())) or "(top level)"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{loc}: {first.get('msg', 'invalid')}{more}"


def _versions(model: type[VersionedFile]) -> str:
    return ", ".join(str(v) for v in model.SUPPORTED_VERSIONS)


def check_header(path: Path, data: str | bytes, model: type[VersionedFile], error: type[Exception]) -> None:
    """Raise `error` unless `data` is JSON of `model`'s format in a supported version."""
    try:
        header = _Header.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            raise error(f"{path}: not valid JSON ({first.get('ctx', {}).get('error', 'invalid')})") from None
        raise error(f"{path}: not a JSON object; this kvscope reads format {model.FORMAT!r} version "
                    f"{_versions(model)}") from None
    supported = _versions(model)
    version = header.version
    is_int = isinstance(version, int) and not isinstance(version, bool)
    if header.format != model.FORMAT or not is_int or version not in model.SUPPORTED_VERSIONS:
        found_version = "none" if version is None else (version if is_int else repr(version))
        raise error(f"{path}: found format {header.format!r} version {found_version}; this kvscope reads "
                    f"format {model.FORMAT!r} version {supported}")


def parse_versioned(path: str | Path, data: str | bytes, model: type[FileT],
                    error: type[Exception] = ValueError) -> FileT:
    """Validate the bytes of a versioned file; every problem is one line naming `path`."""
    path = Path(path)
    check_header(path, data, model, error)
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise error(f"{path}: {one_line(exc)}") from None


def validate_data(where: str | Path, data: Any, model: type[FileT], error: type[Exception] = ValueError) -> FileT:
    """Build the model from data assembled in memory (writers); a problem is one line naming `where`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{where}: {one_line(exc)}") from None


def read_versioned(path: str | Path, model: type[FileT], error: type[Exception] = ValueError) -> FileT:
    """Read and validate one versioned file (missing / unreadable / corrupt / other version: `error`)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc.__class__.__name__})") from None
    return parse_versioned(path, data, model, error)


def write_versioned(path: str | Path, model: VersionedFile, sort_keys: bool = False) -> Path:
    """Dump the model atomically (temporary file + rename): a reader never sees half a file."""
    path = Path(path)
    if sort_keys:
        text = json.dumps(model.model_dump(mode="json"), indent=2, sort_keys=True)
    else:
        text = model.model_dump_json(indent=2)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with naming_write_errors(path):
        try:
            tmp.write_text(text + "\n")
            tmp.replace(path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
    return path


@contextmanager
def naming_write_errors(path: str | Path) -> Iterator[None]:
    """Re-raise an OSError met while writing ``path`` (a file or a directory of files) with ``path`` as its
    file name: a full disk fails a ``write`` with no file name (pyarrow's and ``json.dump``'s errors read
    "No space left on device" alone), and a temporary file's name is not what the user gave. A missing
    parent directory is named as such."""
    try:
        yield
    except OSError as exc:
        p = Path(path)
        if isinstance(exc, FileNotFoundError) and not p.parent.is_dir():
            raise FileNotFoundError(errno.ENOENT, "no such directory to write into", str(p.parent)) from None
        own_temp = exc.filename is not None and Path(exc.filename).name.startswith(f".{p.name}.")
        if exc.filename is None or own_temp:
            detail = exc.strerror or str(exc) or type(exc).__name__
            raise OSError(exc.errno, detail, str(p)) from None
        raise
