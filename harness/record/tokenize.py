"""Token ids of recorded requests: the upstream's own ``/tokenize`` where it has one, else a local tokenizer.

Both give the full prompt and, per message, where it ends in the prompt (the length of the rendering of
``messages[:i+1]`` without a generation prompt). The message ends let the trace store one segment per message
and let ``kvscope explain`` say *which* message a prompt diverges in. Prefix renderings are cached by a chained
digest of (tools, messages[:i+1]), so an append-only session costs one call per new message, not per prefix.
Where a prefix rendering is not a token prefix of the full prompt (a template that rewrites earlier turns),
the request keeps its full prompt and has no message ends.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.serving.tls import tls_context

# Request fields that change how vLLM renders a chat prompt (sent along to /tokenize).
_CHAT_RENDER_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                       "continue_final_message", "add_special_tokens", "documents")


@dataclass(slots=True)
class Tokenized:
    prompt_ids: list[int]
    message_ends: list[int] | None  # per message, the token position where it ends; None if unknown


class Backend(Protocol):
    def chat(self, model: str | None, messages: list[dict], fields: dict[str, Any], generation: bool) -> list[int]:
        ...

    def text(self, model: str | None, prompt: str, add_special_tokens: bool) -> list[int]:
        ...


class UpstreamTokenize:
    """POST {upstream}/tokenize (vLLM: ``messages`` or ``prompt``; answers ``tokens``)."""

    def __init__(self, upstream: str, headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> None:
        import httpx

        self.url = upstream.rstrip("/") + "/tokenize"
        self.client = httpx.Client(headers=headers or {}, timeout=timeout_s, verify=tls_context())

    def _post(self, payload: dict[str, Any]) -> list[int]:
        import httpx

        try:
            r = self.client.post(self.url, json=payload)
        except httpx.HTTPError as exc:
            raise KvscopeError(f"{self.url}: cannot tokenize ({exc.__class__.__name__}); is the upstream running? "
                               "Or give --tokenizer DIR") from None
        if r.status_code == 404:
            raise KvscopeError(f"{self.url}: the upstream has no /tokenize; give --tokenizer DIR")
        if r.status_code != 200:
            raise KvscopeError(f"{self.url}: HTTP {r.status_code}: {r.text[:200]}")
        return [int(t) for t in r.json()["tokens"]]

    def chat(self, model: str | None, messages: list[dict], fields: dict[str, Any], generation: bool) -> list[int]:
        payload = {**fields, "messages": messages, "add_generation_prompt": generation}
        if not generation:
            payload["continue_final_message"] = False
        if model:
            payload["model"] = model
        return self._post(payload)

    def text(self, model: str | None, prompt: str, add_special_tokens: bool) -> list[int]:
        payload: dict[str, Any] = {"prompt": prompt, "add_special_tokens": add_special_tokens}
        if model:
            payload["model"] = model
        return self._post(payload)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """The ``tojson`` filter as transformers defines it for chat templates (key order kept, no HTML escaping)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment():
    """The jinja2 environment transformers renders chat templates in (filters must be set before compiling)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise ValueError(f"chat template: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = _tojson
    return env


class LocalTokenize:
    """A model directory's ``tokenizer.json`` and chat template (or ``chat_template`` file), rendered as
    transformers does (jinja2 sandbox, trim/lstrip blocks, tools and tool calls passed through)."""

    def __init__(self, model_dir: str | Path, chat_template: str | Path | None = None) -> None:
        from kvscope.workloads.text import ChatTemplate
        from tokenizers import Tokenizer

        p = Path(model_dir)
        if not (p / "tokenizer.json").is_file():
            raise KvscopeError(f"--tokenizer {model_dir}: no tokenizer.json there")
        self.tok = Tokenizer.from_file(str(p / "tokenizer.json"))
        try:
            base = ChatTemplate.from_model_dir(p)
        except FileNotFoundError as exc:
            if chat_template is None:
                raise KvscopeError(f"--tokenizer {model_dir}: {exc}") from None
            base = ChatTemplate("", None, None)
        source = Path(chat_template).read_text() if chat_template else base.source
        self.template = _environment().from_string(source)
        self.bos, self.eos = base.bos_token or "", base.eos_token or ""

    def chat(self, model: str | None, messages: list[dict], fields: dict[str, Any], generation: bool) -> list[int]:
        kwargs = dict(fields.get("chat_template_kwargs") or {})
        text = self.template.render(messages=messages, tools=fields.get("tools"), documents=fields.get("documents"),
                                    bos_token=self.bos, eos_token=self.eos, add_generation_prompt=generation,
                                    **kwargs)
        special = bool(fields.get("add_special_tokens", False))
        return list(self.tok.encode(text, add_special_tokens=special).ids)

    def text(self, model: str | None, prompt: str, add_special_tokens: bool) -> list[int]:
        return list(self.tok.encode(prompt, add_special_tokens=add_special_tokens).ids)


class RequestTokenizer:
    """Prompt ids and message ends of recorded request bodies, with prefix renderings cached."""

    def __init__(self, backend: Backend, message_ends: bool = True) -> None:
        self.backend = backend
        self.want_ends = message_ends
        self._prefix_len: dict[str, list[int]] = {}

    def tokenize(self, api: str, body: dict[str, Any]) -> Tokenized:
        model = body.get("model")
        if api == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return Tokenized([int(t) for t in prompt], None)
            if isinstance(prompt, list):
                prompt = prompt[0] if prompt else ""
            return Tokenized(self.backend.text(model, str(prompt or ""), bool(body.get("add_special_tokens", True))),
                             None)
        messages = body.get("messages") or []
        fields = {k: body[k] for k in _CHAT_RENDER_FIELDS if k in body and k != "add_generation_prompt"}
        generation = bool(body.get("add_generation_prompt", True)) and not body.get("continue_final_message")
        full = self.backend.chat(model, messages, fields, generation)
        return Tokenized(full, self._message_ends(model, messages, fields, full) if self.want_ends else None)

    def _message_ends(self, model: str | None, messages: list[dict], fields: dict[str, Any],
                      full: list[int]) -> list[int] | None:
        digest = hashlib.sha256(json.dumps([model, fields], sort_keys=True).encode()).hexdigest()
        ends: list[int] = []
        for i, msg in enumerate(messages):
            digest = hashlib.sha256((digest + json.dumps(msg, sort_keys=True)).encode()).hexdigest()
            ids = self._prefix_len.get(digest)
            if ids is None:
                try:
                    got = self.backend.chat(model, messages[:i + 1], fields, False)
                except (KvscopeError, ValueError, TypeError):
                    return None
                if got != full[:len(got)]:
                    return None
                ids = self._prefix_len[digest] = [len(got)]
            ends.append(ids[0])
        if any(b < a for a, b in zip(ends, ends[1:])) or (ends and ends[-1] > len(full)):
            return None
        return ends
