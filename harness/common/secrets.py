"""Redaction of secrets in everything kvscope writes: one function for configs, one for command lines.

kvscope records configurations in manifests, `experiment.json`, the server facts of `summary.json` and the
command line at the top of a server log, so that a run can be reproduced from its files. A server config can
carry an API key in three places: an environment variable named by `api_key_env` (only the name is recorded,
never the value), a variable in `env:` (`VLLM_API_KEY`, `HF_TOKEN`, …) and a flag in `extra_args`
(`--api-key sk-…` or `--api-key=sk-…`). Rather than trusting every writer to remember each place, writers
pass config-shaped data through `redact_config`, which walks any JSON-like structure and
- replaces the value of every entry of an `env` / `environment` mapping whose name looks secret
  (contains KEY, TOKEN, SECRET, PASSWORD, PASSWD, AUTH, CREDENTIAL or PRIVATE, case-insensitive);
- replaces the value(s) after every secret-looking flag in a list of strings (`--api-key`, `--hf-token`,
  `--token`, `--password`, …; vLLM's `--api-key` takes several values, all are replaced).
The name rule applies only inside environment mappings: elsewhere in a config `max_num_batched_tokens` or
`tokenizer` are not secrets. `redact_text` scrubs known secret values out of free text (logs).

Endpoint URLs carry credentials two ways: userinfo (`http://bob:PW@host`) and a query parameter
(`?api_key=sk-…`). `split_url_credentials` is the one function that takes them out: every place an endpoint
enters kvscope (a backend's endpoint, `record --upstream`) keeps the clean URL, which is all that is ever
stored or printed, and sends the credentials as an `Authorization` header; `redact_config` also cleans any
URL-looking string it walks, so a config that carries an endpoint is written clean.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

REDACTED = "<redacted>"

SECRET_NAME_RE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|AUTH|CREDENTIAL|PRIVATE", re.IGNORECASE)
# A flag whose last word names a secret: --api-key, --hf-token, --token, --admin-password, --credentials.
SECRET_FLAG_RE = re.compile(r"^--?(?:[A-Za-z0-9]+[-_])*(?:api[-_]?key|key|token|secret|password|passwd|"
                            r"credentials?)$", re.IGNORECASE)
ENV_MAPPING_KEYS = frozenset({"env", "environment"})


def looks_secret_name(name: str) -> bool:
    """True for environment variable names that hold secrets by convention (case-insensitive)."""
    return bool(SECRET_NAME_RE.search(name))


def redact_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an environment mapping with the value of every secret-looking name replaced."""
    return {k: (REDACTED if looks_secret_name(str(k)) and v not in (None, "") else v) for k, v in env.items()}


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def _split_secret_args(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """Each argument as (the text to keep, the secret it carries or None): `--api-key=a` keeps `--api-key=`
    and carries `a`; the words after a bare secret flag are carried whole, up to the next flag."""
    parts: list[tuple[str, str | None]] = []
    taking = False
    for arg in argv:
        if arg.startswith("-") and len(arg) > 1 and not _is_number(arg):
            taking = bool(SECRET_FLAG_RE.match(_flag_name(arg)))
            if taking and "=" in arg:
                taking = False
                parts.append((_flag_name(arg) + "=", arg.split("=", 1)[1]))
            else:
                parts.append((arg, None))
        else:
            parts.append(("", arg) if taking else (arg, None))
    return parts


def secret_argv_values(argv: Sequence[str]) -> list[str]:
    """The values given to secret-looking flags (`--api-key a b`, `--api-key=a`), in order."""
    return [secret for _, secret in _split_secret_args(argv) if secret]


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line with the value(s) of every secret-looking flag replaced (and URLs' credentials dropped)."""
    return [kept + REDACTED if secret is not None else redact_url(kept) for kept, secret in _split_secret_args(argv)]


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def redact_config(data: Any) -> Any:
    """A copy of any JSON-like structure with secrets in env mappings and argument lists replaced."""
    if isinstance(data, Mapping):
        out: dict[Any, Any] = {}
        for k, v in data.items():
            if isinstance(k, str) and k.lower() in ENV_MAPPING_KEYS and isinstance(v, Mapping):
                out[k] = redact_env(v)
            else:
                out[k] = redact_config(v)
        return out
    if isinstance(data, (list, tuple)):
        if data and all(isinstance(x, str) for x in data):
            return redact_argv(data)
        return [redact_config(x) for x in data]
    if isinstance(data, str):
        return redact_url(data)
    return data


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each known secret value replaced (longest first)."""
    for value in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


# A JSON key that holds a credential in a request body: `api_key`, `apiKey`, `x-api-key`, `access_token`,
# `client_secret`, `password`, `authorization`, `credentials`. Exact words, not substrings, so `max_tokens`,
# `prompt_tokens` and `logit_bias` stay.
_CREDENTIAL_NAME = (r"(?:(?:x[-_]?)?(?:(?:api|access|auth|bearer|secret|session|refresh|client|private)[-_]?)?"
                    r"(?:key|token|secret|password|passwd)|authorization|credentials?)")
CREDENTIAL_FIELD_RE = re.compile(f"^{_CREDENTIAL_NAME}$", re.IGNORECASE)
# The same names as JSON keys in serialized bytes: a cheap test before walking a large body.
CREDENTIAL_KEY_IN_JSON_RE = re.compile(f'"{_CREDENTIAL_NAME}"\\s*:'.encode(), re.IGNORECASE)


def redact_credential_fields(data: Any) -> Any:
    """A copy of a JSON-like request body with the value of every credential-named key replaced, at any depth
    (an `api_key` a client put in the body, `extra_body={"api_key": ...}`, a tool server's `auth_token`).
    Only string values are replaced (a tool schema's `"key": {"type": "string"}` property stays), and message
    text is left alone: only key names decide."""
    if isinstance(data, Mapping):
        return {k: (REDACTED if isinstance(k, str) and isinstance(v, str) and v and CREDENTIAL_FIELD_RE.match(k)
                    else redact_credential_fields(v)) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_credential_fields(x) for x in data]
    return data


# ------------------------------------------------------------------------------------------ endpoint URLs


def split_url_credentials(url: str) -> tuple[str, dict[str, str]]:
    """(the URL without its credentials, the ``Authorization`` header they stand for, or {}).

    ``user:password@`` is HTTP basic auth; a lone token in the userinfo (``http://sk-…@host`` or
    ``http://:sk-…@host``) and a credential-named query parameter (``api_key``, ``token``, ``access_token``,
    … by :data:`CREDENTIAL_FIELD_RE`) are a bearer token, as OpenAI-compatible servers expect. The rest of the
    URL is kept as written; userinfo wins over a query token when both are given."""
    if "://" not in url:
        return url, {}
    parts = urlsplit(url)
    headers: dict[str, str] = {}
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, colon, password = userinfo.partition(":")
        user, password = unquote(user), unquote(password)
        if user and colon:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        elif user or password:
            headers["Authorization"] = f"Bearer {user or password}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        kept = [(k, v) for k, v in pairs if not CREDENTIAL_FIELD_RE.match(k)]
        if len(kept) < len(pairs):
            token = next((v for k, v in pairs if CREDENTIAL_FIELD_RE.match(k) and v), None)
            if token and "Authorization" not in headers:
                headers["Authorization"] = f"Bearer {token}"
            query = urlencode(kept)
    if not headers and netloc == parts.netloc and query == parts.query:
        return url, {}
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment)), headers


def redact_url(text: str) -> str:
    """``text`` without URL credentials when it is an http(s) URL (:func:`split_url_credentials`); other text
    as is."""
    if not text.startswith(("http://", "https://")):
        return text
    try:
        return split_url_credentials(text)[0]
    except ValueError:  # not parseable as a URL (a bad port, a bracket): nothing a URL parser could send
        return text
