"""A generic OpenAI-compatible endpoint: kvscope attaches to it and assumes nothing about the engine.

It cannot launch the server, cannot empty its prefix cache (there is no standard endpoint for that: runs
against it start from whatever the cache holds, and the manifest says so), exports no metrics kvscope knows,
and sends only standard OpenAI fields (no `ignore_eos`, so output lengths follow the model; no token ids
back, so `live` replays cannot substitute generated tokens). Facts are unknown except the model name and
context length `/v1/models` gives; predictions use the `block_size` (and `kv_capacity_tokens`) the user
states in the config, since the server will not tell.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field

from kvscope.harness.common.errors import ServerError
from kvscope.harness.serving.backend import Backend, ResetOutcome, ServerFacts
from kvscope.harness.serving.tls import tls_context


class OpenAIEndpointConfig(BaseModel):
    """An OpenAI-compatible endpoint kvscope did not start."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(description="base URL, e.g. http://127.0.0.1:8000 (without /v1)")
    model: str | None = Field(None, description="model name sent in requests; default: the first in /v1/models")
    block_size: int | None = Field(None, gt=0, description="the engine's KV block size in tokens, for predictions "
                                                           "(unknown unless given)")
    kv_capacity_tokens: int | None = Field(None, gt=0, description="KV cache capacity in tokens, if known")
    prefix_caching: bool | None = Field(None, description="whether the engine caches prefixes, if known")
    api_key_env: str | None = Field(None, description="environment variable holding the API key (Bearer)")
    ready_timeout_s: float = Field(30.0, gt=0, description="how long to wait for /v1/models to answer")


@Backend.register("openai")
class OpenAIBackend(Backend):
    config_model = OpenAIEndpointConfig
    managed = False
    metrics_path = None

    def __init__(self, config: BaseModel | None = None, endpoint: str | None = None,
                 api_key_env: str | None = None) -> None:
        if config is None:
            if endpoint is None:
                raise ServerError("openai backend: give an endpoint")
            config = OpenAIEndpointConfig(endpoint=endpoint, api_key_env=api_key_env)
        assert isinstance(config, OpenAIEndpointConfig)
        super().__init__(config, endpoint=endpoint or config.endpoint, api_key_env=api_key_env)

    @classmethod
    def experiment_base_fields(cls, model_path: str, served_model_name: str) -> dict[str, Any]:
        return {"model": served_model_name}

    @property
    def endpoint_config(self) -> OpenAIEndpointConfig:
        assert isinstance(self.config, OpenAIEndpointConfig)
        return self.config

    def served_model_name(self) -> str | None:
        return self.endpoint_config.model

    def start(self, log_path=None) -> "OpenAIBackend":  # noqa: ANN001 - attach only: nothing is launched
        self.wait_ready(self.endpoint_config.ready_timeout_s)
        return self

    def _models(self, timeout_s: float = 10.0, headers: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        import httpx  # deferred: a heavy import that only talking to a server needs

        r = httpx.get(self.endpoint + "/v1/models", headers=dict(self.auth_headers() if headers is None else headers),
                      timeout=timeout_s, verify=tls_context())
        r.raise_for_status()
        data = r.json().get("data") or []
        return [d for d in data if isinstance(d, dict)]

    def wait_ready(self, timeout_s: float) -> None:
        import httpx  # deferred: a heavy import that only talking to a server needs

        started = time.time()
        deadline, last = started + timeout_s, ""
        while time.time() < deadline:
            try:
                self._models(timeout_s=5.0)
                self.ready_after_s = time.time() - started
                return
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{exc.__class__.__name__}: {exc}"
            time.sleep(0.5)
        raise ServerError(f"no OpenAI-compatible server answering {self.endpoint}/v1/models within "
                          f"{timeout_s:.0f} s ({last})")

    def facts(self, *, headers: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> ServerFacts:
        import httpx  # deferred: a heavy import that only talking to a server needs

        cfg = self.endpoint_config
        try:
            models = self._models(timeout_s, headers)
        except (httpx.HTTPError, ValueError) as exc:
            raise ServerError(f"cannot read /v1/models from {self.endpoint}: "
                              f"{exc.__class__.__name__}: {exc}") from exc
        card = next((m for m in models if cfg.model in (None, m.get("id"))), models[0] if models else {})
        max_len = card.get("max_model_len")
        return ServerFacts(
            endpoint=self.endpoint, backend=self.name, model=cfg.model or card.get("id"),
            max_model_len=int(max_len) if isinstance(max_len, int) else None,
            block_size=cfg.block_size, kv_capacity_tokens=cfg.kv_capacity_tokens,
            num_blocks=(cfg.kv_capacity_tokens // cfg.block_size) if cfg.kv_capacity_tokens and cfg.block_size
            else None,
            prefix_caching=cfg.prefix_caching, launched_by_kvscope=False, config=self.redacted_config())

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> ResetOutcome:
        return ResetOutcome(False, "not reset (the openai backend has no cache-reset endpoint: the run starts "
                                   "from whatever the server's prefix cache holds)")
