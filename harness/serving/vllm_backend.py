"""The vLLM backend: a server kvscope launches (`ServerConfig`) or an endpoint it attaches to.

It wraps what the serving layer knows about vLLM: the launcher and facts reader in `server.py`, the metric
names in `metrics.py` (the preemption counter included) and the request fields in `request.vllm_request_extras`.
These three modules and this one are the only places that name vLLM's metrics (tests/test_architecture.py). The one cache reset
(`POST /reset_prefix_cache`, vLLM dev mode) lives here; every caller goes through `reset_prefix_cache`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel

from kvscope.harness.cachemodel.spec_predict import speculative_spec_of_vllm
from kvscope.harness.common.errors import ServerError
from kvscope.harness.serving.backend import Backend, ResetOutcome, SchedulerLimits, ServerFacts
from kvscope.harness.serving.metrics import PREEMPTIONS_COUNTER
from kvscope.harness.serving.request import vllm_request_extras
from kvscope.harness.serving.server import ServerConfig, VllmServer, read_server_facts, wait_for_endpoint
from kvscope.harness.serving.tls import tls_context


@Backend.register("vllm")
class VllmBackend(Backend):
    config_model = ServerConfig
    managed = True

    def __init__(self, config: BaseModel | None = None, endpoint: str | None = None,
                 api_key_env: str | None = None, device: str | None = None) -> None:
        super().__init__(config, endpoint=endpoint, api_key_env=api_key_env)
        self.server: VllmServer | None = None
        self.device = device

    @property
    def server_config(self) -> ServerConfig | None:
        return self.config if isinstance(self.config, ServerConfig) else None

    @classmethod
    def experiment_base_fields(cls, model_path: str, served_model_name: str) -> dict[str, Any]:
        return {"model": model_path, "served_model_name": served_model_name}

    # ---- lifecycle --------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        if self.server is not None and self.server.port is not None:
            return self.server.endpoint
        return super().endpoint

    def start(self, log_path: str | Path | None = None) -> "VllmBackend":
        """Launch vLLM from the config (a fresh process on each call after `stop`), or attach."""
        cfg = self.server_config
        if cfg is None or self._endpoint is not None:
            self.wait_ready(30.0)
            return self
        if self.server is not None and self.server.is_running():
            raise ServerError("server already started")
        self.launch(log_path)
        self.finish_start()
        return self

    def launch(self, log_path: str | Path | None = None) -> None:
        cfg = self.server_config
        if cfg is None or self._endpoint is not None:
            self.start(log_path)
            return
        if self.server is not None and self.server.is_running():
            raise ServerError("server already started")
        self.server = VllmServer(cfg, log_path=log_path, device=self.device)
        self.server.launch()
        self.log_path = self.server.log_path

    def finish_start(self) -> None:
        if self.server is None or self.server.ready_after_s is not None:
            return
        self.server.finish_start()
        self.ready_after_s = self.server.ready_after_s

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def pause(self) -> bool:
        return self.server is not None and self.server.pause()

    def resume(self) -> None:
        if self.server is not None:
            self.server.resume()

    def is_running(self) -> bool:
        if self.server_config is not None and self._endpoint is None:
            return self.server is not None and self.server.is_running()
        return True

    def wait_ready(self, timeout_s: float) -> None:
        wait_for_endpoint(self.endpoint, timeout_s=timeout_s)

    def log_text(self) -> str:
        if self.server is not None:
            return self.server.log_text()
        if self.log_path is not None and self.log_path.exists():  # an attached server's log, if given
            return self.log_path.read_text(errors="replace")
        return ""

    # ---- the configuration's answers ----------------------------------------------------------------------
    def served_model_name(self) -> str | None:
        cfg = self.server_config
        return (cfg.served_model_name or cfg.model) if cfg is not None else None

    def scheduler_limits(self) -> SchedulerLimits:
        cfg = self.server_config
        if cfg is None:
            return SchedulerLimits()
        return SchedulerLimits(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens)

    def speculative_decoding(self) -> bool:
        cfg = self.server_config
        return bool(cfg is not None and cfg.speculative_config)

    def speculation(self) -> str | None:
        cfg = self.server_config
        spec = speculative_spec_of_vllm(cfg.speculative_config) if cfg is not None else None
        return spec.label if spec is not None else None

    def gpus_per_server(self) -> int:
        """Tensor x pipeline x data parallel size (pipeline parallelism is set through ``extra_args``)."""
        cfg = self.server_config
        if cfg is None:
            return 1
        pp = 1
        args = list(cfg.extra_args)
        for i, arg in enumerate(args):
            if arg in ("--pipeline-parallel-size", "-pp") and i + 1 < len(args):
                pp = int(args[i + 1])
            elif arg.startswith("--pipeline-parallel-size="):
                pp = int(arg.split("=", 1)[1])
        return (cfg.tensor_parallel_size or 1) * pp * (cfg.data_parallel_size or 1)

    # ---- auth, facts, cache, requests ---------------------------------------------------------------------
    def api_key(self) -> str | None:
        cfg = self.server_config
        if cfg is not None and not self._api_key_env_overrides(cfg):
            return cfg.api_key()
        return super().api_key()

    def _api_key_env_overrides(self, cfg: ServerConfig) -> bool:
        return bool(self._api_key_env) and self._api_key_env != cfg.api_key_env

    def facts(self, *, headers: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> ServerFacts:
        cfg = self.server_config if self.server is not None else None
        facts = read_server_facts(self.endpoint, log_text=self.log_text() or None, config=cfg, timeout_s=timeout_s,
                                  headers=dict(self.auth_headers() if headers is None else headers))
        facts.backend = self.name
        if facts.config is not None:
            facts.config = {"backend": self.name, **facts.config}
        return facts

    def model_path(self) -> str | None:
        cfg = self.server_config
        return cfg.model if cfg is not None else None

    def preemptions_total(self, timeout_s: float = 10.0) -> float | None:
        snap = self.scrape_metrics(timeout_s)
        return None if snap is None else snap.value(PREEMPTIONS_COUNTER)

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> ResetOutcome:
        import httpx  # deferred: a heavy import that only talking to a server needs

        try:
            r = httpx.post(self.endpoint + "/reset_prefix_cache", headers=self.auth_headers(),
                           timeout=timeout_s, verify=tls_context())
        except httpx.HTTPError as exc:
            return ResetOutcome(False, f"not reset ({exc.__class__.__name__})")
        if r.status_code == 200:
            return ResetOutcome(True, "reset")
        return ResetOutcome(False, f"not reset (HTTP {r.status_code}; start vLLM with "
                                   "VLLM_SERVER_DEV_MODE=1)")

    def request_extras(self, cache_salt: str | None) -> dict[str, Any]:
        return vllm_request_extras(cache_salt)

    def secret_values(self) -> list[str]:
        cfg = self.server_config
        values = cfg.secret_values() if cfg is not None else []
        key = self.api_key()
        return values + ([key] if key else [])
