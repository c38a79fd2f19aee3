"""Errors that kvscope reports to users: each names what is wrong, where, and what is allowed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class KvscopeError(Exception):
    """Base class: the CLI prints these as one clear message (no traceback) and exits 2."""


class ConfigError(KvscopeError):
    """A spec or config file is wrong: the message names the file, the field and what is allowed."""


class ServerError(KvscopeError):
    """A vLLM server failed to start, died, or cannot be reached."""

    def __init__(self, message: str, cause: str | None = None, log_path: Path | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.log_path = log_path


def load_yaml_mapping(path: Path | str, what: str) -> dict:
    """Read a YAML file that must hold a mapping; errors name the file and what was expected."""
    import yaml  # deferred: keeps `kvscope --help` fast

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: a {what} is a YAML text file; this is not UTF-8 text (byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a {what} is a mapping of fields, got {type(data).__name__}")
    return data


def _allowed_for(model_cls: Any, loc: tuple) -> str | None:
    """Field names allowed at ``loc`` in a pydantic model class (best effort, for 'extra field' errors)."""
    cls = model_cls
    for part in loc[:-1]:
        fields = getattr(cls, "model_fields", None)
        if not fields or not isinstance(part, str) or part not in fields:
            return None
        ann = fields[part].annotation
        cls = getattr(ann, "__args__", (ann,))[0] if not hasattr(ann, "model_fields") else ann
    fields = getattr(cls, "model_fields", None)
    return ", ".join(sorted(fields)) if fields else None


def format_validation_error(exc: Any, source: str, model_cls: Any = None) -> str:
    """One line per problem: ``source: field.path: message`` (+ allowed names for unknown fields)."""
    lines = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        path = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[") or "(top level)"
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            allowed = _allowed_for(model_cls, loc) if model_cls is not None else None
            msg = "unknown field" + (f"; allowed: {allowed}" if allowed else "")
        elif err.get("type") == "missing":
            msg = "required field is missing"
        elif "input" in err and err.get("type") not in ("missing",):
            shown = repr(err["input"])
            if len(shown) < 80:
                msg = f"{msg} (got {shown})"
        lines.append(f"{source}: {path}: {msg}")
    return "\n".join(lines)
