"""Endpoint URLs as users type them. kvscope appends `/v1/completions`, `/metrics`, `/health` to a base URL;
a URL copied from an OpenAI client config ends in `/v1` and used to fail only after a 30 s health wait."""

from __future__ import annotations

import sys
from urllib.parse import urlsplit, urlunsplit

from kvscope.harness.common.errors import ConfigError
from kvscope.harness.common.secrets import redact_url


def normalize_endpoint(url: str, flag: str = "--endpoint") -> str:
    """The base URL: scheme and host checked, trailing `/` and `/v1` dropped (with a note on stderr).
    Credentials in it (userinfo, `?api_key=`) stay for the backend to take out as a header
    (`common.secrets.split_url_credentials`); messages here show the URL without them."""
    parts = urlsplit(url)
    shown = redact_url(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{flag} {shown}: not an http:// or https:// URL; give the server's base URL, "
                          "e.g. http://127.0.0.1:8000")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
        base = urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))
        print(f"kvscope: note: {flag} {shown}: using {redact_url(base)} (kvscope adds /v1/... itself)",
              file=sys.stderr)
        return base
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))
