"""The serving-backend seam: what kvscope needs from an inference engine, and a registry of engines.

Everything above the serving layer (replay, experiments, the demo, `kvscope serve / server-info`) talks to a
`Backend`, never to vLLM directly, so another engine is one file plus one registration (docs/backends.md).
A backend answers for one endpoint (one server): it may launch and stop that server (`managed`), reports
what it knows about it (`facts`: a fact it cannot know is `None`, meaning unknown), empties its prefix cache
where the engine allows, gives the auth headers every kvscope request to it carries (warm-up, replay, scrape,
reset, facts), turns two `/metrics` scrapes into the counter delta kvscope reconciles, counts the engine's
preemptions, names the local model it serves, and adds the engine's own request-body fields.  Nothing above
this layer knows an engine's metric names, log lines or facts endpoints: `tests/test_architecture.py` keeps
vLLM's metric names inside the vLLM modules of this package (`server.py`, `metrics.py`, `vllm_backend.py`),
and an import contract keeps every other layer off those modules. An ABC with a name registry (GuideLLM's `Backend.register` / `Backend.create`) was
chosen over a bare Protocol because the shared behaviour (auth from `api_key_env`, the redacted config, the
attach-only lifecycle) is written once here and engines override only what differs.
"""

from __future__ import annotations

import base64
import importlib
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping
import pkgutil

from pydantic import BaseModel, ValidationError

from kvscope.harness.common.errors import ConfigError, ServerError, format_validation_error, load_yaml_mapping
from kvscope.harness.common.secrets import redact_config, split_url_credentials
from kvscope.harness.results.summary import ServerFacts  # noqa: F401 - defined with the result files that record it
from kvscope.harness.serving.metrics import MetricsDelta, MetricsSnapshot, metrics_delta, parse_metrics
from kvscope.harness.serving.tls import tls_context

#: A module of this package named ``<engine>_backend`` holds one engine's backend, registered with
#: ``@Backend.register(name)``; the registry imports every such module the first time it is asked (pkgutil
#: discovery), so a new engine is its one module and nothing lists it a second time.
BACKEND_MODULE_SUFFIX = "_backend"
DEFAULT_BACKEND = "vllm"


def resolve_api_key(env_name: str | None, option: str = "api_key_env") -> str | None:
    """The API key held by the environment variable ``env_name`` (None: no key configured).

    The one place a key is read from the environment: backends, the vLLM launcher and the recording proxy's
    CLI all call it; an unset or empty variable is a ConfigError naming ``option`` (the field or flag that
    named the variable), so the user sees which setting to fix.
    """
    if not env_name:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise ConfigError(f"{option}: environment variable {env_name} is not set")
    return key


def bearer_headers(key: str | None) -> dict[str, str]:
    """The auth headers carrying ``key`` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class SchedulerLimits:
    """The engine scheduler's batch limits as configured; None where the configuration does not set one (the
    engine's default applies, which kvscope does not guess)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None


@dataclass(frozen=True)
class ResetOutcome:
    """Result of asking a server to empty its prefix cache; `detail` goes into manifests as is."""

    ok: bool
    detail: str


class Backend(ABC):
    """One serving endpoint of one engine. Subclasses set `name`, `config_model` and register themselves."""

    name: ClassVar[str]
    config_model: ClassVar[type[BaseModel]]
    managed: ClassVar[bool] = False  # True: kvscope can launch and stop the server
    metrics_path: ClassVar[str | None] = "/metrics"  # None: the engine exports no Prometheus metrics

    _registry: ClassVar[dict[str, type["Backend"]]] = {}

    def __init__(self, config: BaseModel | None = None, endpoint: str | None = None,
                 api_key_env: str | None = None) -> None:
        # Credentials in an endpoint URL (userinfo, ?api_key=) leave it here, the one edge every endpoint
        # passes: the clean URL is all that is stored or printed, and they travel as this header.
        self._url_auth: dict[str, str] = {}
        if isinstance(getattr(config, "endpoint", None), str):
            clean, self._url_auth = split_url_credentials(config.endpoint)  # type: ignore[union-attr]
            if self._url_auth:
                config = config.model_copy(update={"endpoint": clean})  # type: ignore[union-attr]
        if endpoint:
            endpoint, url_auth = split_url_credentials(endpoint)
            self._url_auth = url_auth or self._url_auth
        self.config = config
        self._endpoint = endpoint.rstrip("/") if endpoint else None
        self._api_key_env = api_key_env or getattr(config, "api_key_env", None)
        self.ready_after_s: float | None = None
        self.log_path: Path | None = None

    # ---- registry ----------------------------------------------------------------------------------------
    @classmethod
    def register(cls, name: str) -> Callable[[type["Backend"]], type["Backend"]]:
        def deco(backend_cls: type[Backend]) -> type[Backend]:
            backend_cls.name = name
            Backend._registry[name] = backend_cls
            return backend_cls

        return deco

    @classmethod
    def get(cls, name: str) -> type["Backend"]:
        _load_builtin_backends()
        try:
            return Backend._registry[name]
        except KeyError:
            allowed = ", ".join(backend_names())
            raise ConfigError(f"backend: unknown backend {name!r}; allowed: {allowed}") from None

    @classmethod
    def create(cls, name: str, config: BaseModel | Mapping[str, Any] | None = None,
               endpoint: str | None = None, api_key_env: str | None = None,
               source: str = "server config") -> "Backend":
        """A backend by registered name, its config validated (a mapping) or taken as is (a model)."""
        backend_cls = cls.get(name)
        if isinstance(config, Mapping):
            config = backend_cls.parse_config(dict(config), source)
        return backend_cls(config, endpoint=endpoint, api_key_env=api_key_env)

    @classmethod
    def parse_config(cls, data: dict[str, Any], source: str = "server config") -> BaseModel:
        try:
            return cls.config_model.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source, cls.config_model)) from exc

    @classmethod
    def experiment_base_fields(cls, model_path: str, served_model_name: str) -> dict[str, Any]:
        """Config fields an experiment fills in before the spec's own (the model it prepared)."""
        return {}

    # ---- lifecycle (attach-only by default) -------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise ServerError(f"{self.name} backend: no endpoint (server not started)")
        return self._endpoint

    def start(self, log_path: str | Path | None = None) -> "Backend":
        """Launch the server (managed backends) or wait until the given endpoint answers."""
        self.wait_ready(30.0)
        return self

    def launch(self, log_path: str | Path | None = None) -> None:
        """Begin :meth:`start` without waiting for readiness, so that several servers start at once;
        :meth:`finish_start` completes it. Backends that cannot split the two start here in full."""
        self.start(log_path)

    def finish_start(self) -> None:
        """Wait until a :meth:`launch` ed server is ready (a failed start raises here, the server stopped)."""

    def stop(self) -> None:
        """Stop a server kvscope launched; nothing for an endpoint it only attached to."""

    def is_running(self) -> bool:
        return True

    def pause(self) -> bool:
        """Freeze a server kvscope launched while another configuration is measured (``idle_servers: pause``);
        False where there is nothing to freeze (an attached endpoint). :meth:`resume` continues it."""
        return False

    def resume(self) -> None:
        """Continue a :meth:`pause` d server (a no-op when it is not paused)."""

    def log_text(self) -> str:
        return ""

    # ---- what the layers above ask of a configuration (never its engine-specific keys) --------------------
    @property
    def api_key_env(self) -> str | None:
        """The environment variable holding the key requests carry (None: no key)."""
        return self._api_key_env

    def served_model_name(self) -> str | None:
        """The model name requests carry, as the configuration sets it (None: the configuration does not say)."""
        return None

    def scheduler_limits(self) -> SchedulerLimits:
        """The scheduler's batch limits the configuration sets (the scheduler model's calibration uses them)."""
        return SchedulerLimits()

    def speculative_decoding(self) -> bool:
        """Whether the configuration turns on speculative decoding."""
        return False

    def speculation(self) -> str | None:
        """The configuration's speculative decoding as a ``kvscope predict --speculative`` string where the
        offline model computes its drafts from the tokens (n-gram), else None: the scheduler model then cannot
        predict a speculative server (``speculative_decoding()`` says whether it is one)."""
        return None

    def gpus_per_server(self) -> int:
        """GPUs one server of this configuration uses when kvscope launches it (placement on a cluster)."""
        return 1

    @abstractmethod
    def wait_ready(self, timeout_s: float) -> None:
        """Block until the endpoint answers; ServerError naming the endpoint otherwise."""

    def __enter__(self) -> "Backend":
        return self  # start() first: it takes the log path

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- auth, facts, cache, metrics, requests ------------------------------------------------------------
    def api_key(self) -> str | None:
        """The key requests must carry, from the environment variable named by `api_key_env`."""
        return resolve_api_key(self._api_key_env)

    @property
    def url_credentials(self) -> dict[str, str]:
        """The header the endpoint URL's credentials became (none: it had none); a backend rebuilt elsewhere
        from the clean endpoint (a Ray worker) is given it back by assigning this."""
        return dict(self._url_auth)

    @url_credentials.setter
    def url_credentials(self, headers: Mapping[str, str]) -> None:
        self._url_auth = dict(headers)

    def auth_headers(self) -> dict[str, str]:
        """Headers for every request kvscope sends this server: warm-up, replay, scraping, reset, facts (the
        key of `api_key_env` wins over credentials that came in the endpoint URL)."""
        return {**self._url_auth, **bearer_headers(self.api_key())}


    @abstractmethod
    def facts(self, *, headers: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> ServerFacts:
        """What the server says about itself; unknown facts are None. ``headers`` replace the backend's own
        auth headers (a caller that holds a client's credentials, such as the recording proxy)."""

    def model_path(self) -> str | None:
        """The model directory (or hub id) this backend launches the server with; None when it did not."""
        return None

    @abstractmethod
    def reset_prefix_cache(self, timeout_s: float = 60.0) -> ResetOutcome:
        """Empty the server's prefix cache so a run starts cold; `ok=False` with the reason if it cannot."""

    def parse_metrics(self, text: str, scraped_at: float | None = None) -> MetricsSnapshot:
        return parse_metrics(text, scraped_at=scraped_at)

    def metrics_delta(self, before: MetricsSnapshot, after: MetricsSnapshot) -> MetricsDelta:
        """The run-level change of the counters kvscope reconciles between two scrapes."""
        return metrics_delta(before, after)

    def scrape_metrics(self, timeout_s: float = 10.0) -> MetricsSnapshot | None:
        """One synchronous scrape of the engine's metrics (None: the engine exports none)."""
        if self.metrics_path is None:
            return None
        import httpx  # deferred: a heavy import that only talking to a server needs

        r = httpx.get(self.endpoint + self.metrics_path, headers=self.auth_headers(), timeout=timeout_s,
                      verify=tls_context())
        r.raise_for_status()
        return self.parse_metrics(r.text, scraped_at=time.time())

    def preemptions_total(self, timeout_s: float = 10.0) -> float | None:
        """The engine's cumulative count of preempted requests (None: the engine does not say)."""
        return None

    def request_extras(self, cache_salt: str | None) -> dict[str, Any]:
        """Engine-specific request-body fields on top of the standard OpenAI streaming ones."""
        return {}

    def redacted_config(self) -> dict[str, Any] | None:
        """The config as written into result files: secrets replaced (kvscope.harness.common.secrets)."""
        if self.config is None:
            return None
        return {"backend": self.name, **redact_config(self.config.model_dump(mode="json"))}

    def secret_values(self) -> list[str]:
        """Every secret value this backend knows, for scrubbing free text (logs, error messages)."""
        key = self.api_key() if self._api_key_env else None
        url_secrets = [v.split(" ", 1)[-1] for v in self._url_auth.values()]
        if self._url_auth.get("Authorization", "").startswith("Basic "):

            url_secrets += base64.b64decode(url_secrets[0]).decode(errors="replace").split(":", 1)
        return ([key] if key else []) + url_secrets


def backend_names() -> list[str]:
    _load_builtin_backends()
    return sorted(Backend._registry)


def _load_builtin_backends() -> None:
    """Import every ``*_backend`` module of this package (each registers its engine); imported modules are
    cached, so later calls only list the package."""
    package = importlib.import_module(__package__ or "kvscope.harness.serving")
    for module in pkgutil.iter_modules(package.__path__):
        if module.name.endswith(BACKEND_MODULE_SUFFIX):
            importlib.import_module(f"{package.__name__}.{module.name}")


def endpoint_facts(endpoint: str, *, backend: str = DEFAULT_BACKEND, headers: Mapping[str, str] | None = None,
                   api_key_env: str | None = None, timeout_s: float = 10.0) -> ServerFacts:
    """What a server kvscope did not start says about itself, read by its backend (the default engine unless
    ``backend`` names another)."""
    return Backend.create(backend, endpoint=endpoint, api_key_env=api_key_env).facts(headers=headers,
                                                                                     timeout_s=timeout_s)


def split_backend(data: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(backend name, the rest of the config) from a server config mapping; `backend` defaults to vllm."""
    fields = dict(data)
    name = fields.pop("backend", None) or DEFAULT_BACKEND
    if not isinstance(name, str):
        raise ConfigError(f"backend: expected a name ({', '.join(backend_names())}), got {name!r}")
    return name, fields


def load_backend(path: str | Path) -> Backend:
    """A backend from a server config YAML (`backend:` selects the engine, vllm by default)."""
    data = load_yaml_mapping(path, "server config")
    if isinstance(data.get("server"), dict) and "model" not in data and "endpoint" not in data:
        data = data["server"]
    name, fields = split_backend(data)
    return Backend.create(name, fields, source=str(path))
