"""Endpoint URLs as users type them. kvscope appends `/v1/completions`, `/metrics`, `/health` to a base URL;
a URL copied from an OpenAI client config ends in `/v1` and used to fail only after a 30 s health wait."""

from __future__ import annotations

import sys
from urllib.parse import urlsplit

from kvscope.harness.common.errors import ConfigError


def normalize_endpoint(url: str, flag: str = "--endpoint") -> str:
    """The base URL: scheme and host checked, trailing `/` and `/v1` dropped (with a note on stderr)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{flag} {url}: not an http:// or https:// URL; give the server's base URL, "
                          "e.g. http://127.0.0.1:8000")
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
        print(f"kvscope: note: {flag} {url}: using {base} (kvscope adds /v1/... itself)", file=sys.stderr)
    return base
