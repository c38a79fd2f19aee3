"""Token ids of recorded requests: the upstream's own ``/tokenize`` where it has one, else a local tokenizer.

Both give the full prompt and, per message, where it ends in the prompt (the length of the rendering of
``messages[:i+1]`` without a generation prompt). The message ends let the trace store one segment per message
and let ``kvscope explain`` say *which* message a prompt diverges in. Prefix renderings are cached by a chained
digest of (tools, messages[:i+1]), so an append-only session costs one call per new message, not per prefix.
Where a prefix rendering is not a token prefix of the full prompt (a template that rewrites earlier turns),
the request keeps its full prompt and has no message ends.

A local tokenizer renders what vLLM's chat endpoint renders (:func:`template_messages`, vLLM's "string"
content format, the one for templates that print ``message['content']``): content parts joined with ``\n``,
images (audio, video) as a placeholder each in front of the text, ``content: null`` as ``""``, assistant tool
call arguments parsed from their JSON string into objects, ``reasoning`` passed on (also as
``reasoning_content``), ``name`` and ``tool_call_id`` kept. A body whose ``messages`` is not a list of
messages raises :class:`MessageShapeError`; the trace builder skips that one exchange and counts it.
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


class MessageShapeError(KvscopeError):
    """A request body whose messages cannot be rendered (not a list of role-bearing objects)."""


_TEXT_PARTS = {"text", "input_text", "output_text"}
_MEDIA_PLACEHOLDER = {"image_url": "<image>", "input_image": "<image>", "image": "<image>",
                      "image_embeds": "<image>", "image_pil": "<image>", "audio_url": "<audio>",
                      "input_audio": "<audio>", "audio_embeds": "<audio>", "video_url": "<video>",
                      "video_embeds": "<video>"}


def _content_text(content: Any, where: str) -> str:
    """One message's content as the text a "string"-format chat template receives (vLLM's rule)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageShapeError(f"{where}: content is {type(content).__name__}, expected a string or a list of parts")
    texts: list[str] = []
    media: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise MessageShapeError(f"{where}: a content part is {type(part).__name__}, expected an object")
        kind = part.get("type")
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _MEDIA_PLACEHOLDER:
            media.append(_MEDIA_PLACEHOLDER[kind])
    text = "\n".join(texts)
    return "\n".join([*media, text]) if media and text else ("\n".join(media) if media else text)


def _template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]] | None:
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise MessageShapeError(f"{where}: tool_calls is {type(calls).__name__}, expected a list")
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise MessageShapeError(f"{where}: a tool call without a function object")
        fn = dict(call["function"])
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except json.JSONDecodeError:
                args = {}  # vLLM coerces malformed arguments to an empty object
        fn["arguments"] = args if isinstance(args, dict) else {}
        out.append({**call, "function": fn})
    return out or None


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as vLLM hands them to a chat template: its request model dumped (``type``, ``function`` with
    ``name``, ``description`` and ``parameters`` -- None when absent -- and ``strict`` only when set); other
    fields a client sent are dropped, as vLLM's model drops them."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise MessageShapeError(f"tools is {type(tools).__name__}, expected a list")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessageShapeError(f"tools[{i}]: expected {{type: function, function: {{name: ...}}}}")
        f: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"),
                             "parameters": fn.get("parameters")}
        for opt in ("strict", "defer_loading"):
            if fn.get(opt) is not None:
                f[opt] = fn[opt]
        out.append({"type": t.get("type", "function"), "function": f})
    return out


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to a chat template (see the module doc); MessageShapeError if malformed."""
    if not isinstance(messages, list):
        raise MessageShapeError(f"messages is {type(messages).__name__}, expected a list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise MessageShapeError(f"{where}: expected an object with a role")
        msg: dict[str, Any] = {"role": m["role"], "content": _content_text(m.get("content"), where)}
        if m["role"] == "assistant":
            calls = _template_tool_calls(m.get("tool_calls"), where)
            if calls:
                msg["tool_calls"] = calls
            reasoning = m.get("reasoning")
            if isinstance(reasoning, str):
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        if m["role"] == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if m["role"] == "developer":
            msg["tools"] = m.get("tools")
        out.append(msg)
    return out


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
        import httpx  # deferred: httpx is heavy, only talking to a server needs it

        self.url = upstream.rstrip("/") + "/tokenize"
        self.client = httpx.Client(headers=headers or {}, timeout=timeout_s, verify=tls_context())

    def _post(self, payload: dict[str, Any]) -> list[int]:
        import httpx  # deferred: httpx is heavy, only talking to a server needs it

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
    from jinja2.ext import loopcontrols  # deferred: jinja2 is heavy, only rendering a chat template needs it

    # deferred: jinja2 is heavy, only rendering a chat template needs it
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
        # deferred: it loads numpy, which importing this module must not
        from kvscope.workloads.text import ChatTemplate
        from tokenizers import Tokenizer  # deferred: tokenizers is heavy, only tokenizing needs it

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
        text = self.template.render(messages=template_messages(messages), tools=template_tools(fields.get("tools")),
                                    documents=fields.get("documents"), bos_token=self.bos, eos_token=self.eos, add_generation_prompt=generation,
                                    **kwargs)
        special = bool(fields.get("add_special_tokens", False))
        return self._encode(text, special)

    def text(self, model: str | None, prompt: str, add_special_tokens: bool) -> list[int]:
        return self._encode(prompt, add_special_tokens)

    def _encode(self, text: str, special: bool) -> list[int]:
        """Token ids; the tokenizer's Rust panic (its regex out of memory on a huge prompt: a ``PanicException``,
        which is not an ``Exception``) becomes one line naming the prompt's size."""
        try:
            return list(self.tok.encode(text, add_special_tokens=special).ids)
        except BaseException as exc:
            if type(exc).__name__ != "PanicException":
                raise
            raise KvscopeError(f"the tokenizer failed on a {len(text) / 2**20:.1f} MiB prompt "
                               f"({str(exc).splitlines()[0][:200] if str(exc) else 'panic'}); probably out of "
                               "memory: free memory or lower --max-exchange-mib") from None


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
        messages = body.get("messages")
        template_messages(messages)  # MessageShapeError before any backend call
        template_tools(body.get("tools"))
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
