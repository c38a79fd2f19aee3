"""Shared fixtures: the locally built tiny model, real vLLM servers on loopback and one real experiment.

vLLM integration tests are marked `vllm`; they start real servers (≈35–40 s each on 2 cores), so servers are
session-scoped and shared by every test that can use the same configuration: the default server
(`vllm_server`, which also serves test_record_explain's recorded agent and is SIGKILLed by the session's last
test), the n-gram server without prefix caching (`ngram_server`), the 64-block server of the scheduler and
simulator validations (`small_pool_server`), and the integration experiment, whose servers require an API key
so the authentication tests read the same run, and whose `apc` server is killed between two cells so the
runner's restart of a dead server is checked on it too (`integration_experiment`). The three shared servers are
launched together at the first request for any of them (`SharedServers`).
`make test` runs the tests without the `vllm` marker in a second pytest process beside these (docs/testing.md).
docs/testing.md lists every server start of the suite and why.
"""

from __future__ import annotations

import os
import secrets
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvscope.harness.serving.server import VllmServer

REPO = Path(__file__).resolve().parents[1]
# The public traces live beside the repository (../shared/data); KVSCOPE_SHARED_DATA points elsewhere.
SHARED_DATA = Path(os.environ.get("KVSCOPE_SHARED_DATA") or REPO / ".." / "shared" / "data").resolve()


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared traces not found at {SHARED_DATA} (they live beside the repository)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The project's own model, built once per test session (KVSCOPE_TEST_MODEL reuses a prebuilt one)."""
    prebuilt = os.environ.get("KVSCOPE_TEST_MODEL")
    if prebuilt:
        return Path(prebuilt)
    from kvscope.harness.model.tinymodel import build_tiny_model

    out = tmp_path_factory.mktemp("model") / "tiny"
    build_tiny_model(out, seed=0)
    return out


@pytest.fixture(scope="session")
def require_vllm() -> None:
    if not _vllm_importable():
        pytest.skip("vLLM is not installed in this environment (make test installs it)")


def _server(model_dir: Path, log_dir: Path, **overrides):
    """A VllmServer with the suite's defaults (the tiny model as `tiny`, 2048 tokens, 32 MiB of KV), not started."""
    from kvscope.harness.serving.server import ServerConfig, VllmServer

    fields = {"model": str(model_dir), "served_model_name": "tiny", "max_model_len": 2048,
              "kv_cache_memory_bytes": "32M", "startup_timeout_s": 240}
    fields.update(overrides)
    return VllmServer(ServerConfig(**fields), log_path=log_dir / "server.log")


def start_server(model_dir: Path, log_dir: Path, **overrides):
    """Start a server of a test's own (one that the test stops, kills or configures unlike the shared ones)."""
    server = _server(model_dir, log_dir, **overrides)
    server.start()
    return server


@pytest.fixture(scope="session")
def tools_template_file(tmp_path_factory) -> Path:
    """The scripted agent's tool-aware chat template (tests/doubles/scripted_agent.py) as a file. For a chat
    without tools or tool calls it renders byte for byte what the tiny model's own template renders."""
    from tests.doubles.scripted_agent import TOOLS_TEMPLATE

    p = tmp_path_factory.mktemp("tmpl") / "tools.jinja"
    p.write_text(TOOLS_TEMPLATE)
    return p


#: n-gram speculation of the `ngram_server` (prompt lookup: no draft model to load)
NGRAM_SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


class SharedServers:
    """The session's shared servers, keyed by fixture name. At the first request for any of them, every one that
    a collected test uses is launched at once, and each fixture then waits only for its own: a vLLM CPU start is
    a chain of single-threaded imports (API server, engine core, worker), so on 2 cores a start launched beside
    another mostly fills the idle core (`VllmServer.launch`; benchmarks/server_starts.py). Idle, a server costs
    ~0.02 cores. A server a test stopped or killed is started again on the next request for it."""

    #: all of them start at once, so the first one waited for shares the cores with the others
    STARTUP_TIMEOUT_S = 600

    def __init__(self, model_dir: Path, root: Path, overrides: dict[str, dict], used: set[str]) -> None:
        self.model_dir, self.root, self.overrides = model_dir, root, overrides
        self.used = [name for name in overrides if name in used]
        self.servers: dict[str, VllmServer] = {}
        self.ready: set[str] = set()
        self.launches = 0

    def get(self, name: str) -> VllmServer:
        if not self.launches:
            for other in self.used or [name]:
                self._launch(other)
        server = self.servers.get(name)
        if server is None or (name in self.ready and not server.is_running()):
            self.ready.discard(name)
            server = self._launch(name)
        if name not in self.ready:
            try:
                server.finish_start()  # raises (and stops it) if it never answers
            except Exception:
                del self.servers[name]  # the next request launches it again rather than waiting on a dead one
                raise
            self.ready.add(name)
        return server

    def _launch(self, name: str) -> VllmServer:
        log_dir = self.root / f"{name}-{self.launches}"
        log_dir.mkdir(parents=True)
        self.launches += 1
        server = _server(self.model_dir, log_dir, startup_timeout_s=self.STARTUP_TIMEOUT_S, **self.overrides[name])
        server.launch()
        self.servers[name] = server
        return server

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="session")
def shared_servers(request, require_vllm, tiny_model_dir, tools_template_file, tmp_path_factory):
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    pool = SharedServers(tiny_model_dir, tmp_path_factory.mktemp("vllm_shared"), {
        "vllm_server": {"extra_args": ["--chat-template", str(tools_template_file)]},
        "ngram_server": {"enable_prefix_caching": False, "speculative_config": NGRAM_SPECULATION},
        "small_pool_server": {"num_gpu_blocks_override": 64},
    }, used)
    yield pool
    pool.stop_all()


@pytest.fixture(scope="session")
def vllm_server(shared_servers):
    """A shared vLLM CPU server with prefix caching on (default flags, 32 MiB of KV cache), rendering chats with
    the tool-aware template, so test_record_explain's recorded agent runs on it too (one start instead of two);
    the text-mode chat test sees the model's own rendering, as the template is the same without tools."""
    return shared_servers.get("vllm_server")


@pytest.fixture()
def ngram_server(shared_servers):
    """A shared server with prefix caching off and n-gram speculative decoding on (test_vllm_integration's
    speculation and no-cache tests, test_replay_integration's no-cache replay, test_speculative_vllm).
    A test may stop it (test_stopping_the_manager_leaves_no_vllm_process); the next user gets a new one."""
    return shared_servers.get("ngram_server")


@pytest.fixture(scope="session")
def small_pool_server(shared_servers):
    """64 blocks of 128 tokens at max_model_len 2048: a few agent sessions' worth, so concurrent replays evict
    and preempt (test_scheduler_vs_vllm) and a sequential workload evicts (test_simulator_vs_vllm)."""
    return shared_servers.get("small_pool_server")


#: The variable the integration experiment's `apc` server takes its API key from (`api_key_env`).
INTEGRATION_KEY_VAR = "KVSCOPE_ACCEPTANCE_API_KEY"

INTEGRATION_SPEC = """\
name: itest
description: small real experiment for the test suite
model: {{source: path, path: {model}, served_model_name: tiny}}
server_defaults: {{max_model_len: 2048, kv_cache_memory_bytes: 32M}}
servers:
  apc: {{api_key_env: {var}}}
  no-apc: {{enable_prefix_caching: false, env: {{VLLM_API_KEY: {key}}}}}
workloads:
  agent: {{spec: agent-coding, scale: 0.02, sessions: 2, seed: 3, max_context: 1500}}
  agent-ts: {{spec: agent-coding-timestamped, scale: 0.02, sessions: 2, seed: 3, max_context: 1500}}
loads: [{{concurrency: 1}}]
repeats: 2
replay: {{time_scale: 0}}
slo: {{ttft_ms: 500}}
cost: {{pricing: [anthropic-sonnet-5m, openai-gpt-4.1], gpu_hourly_usd: 1.0}}
"""


#: The integration experiment's cell after which its `apc` server is SIGKILLed, so the runner starts it again
#: for apc's next cell: apc's last cell of repeat 0, so the restarted process serves apc__agent__c1__r1 and both
#: repeats of apc__agent are a fresh process's first cell while neither of apc__agent-ts is (the pair that
#: test_compare_same_configuration_twice_is_not_significant compares).
INTEGRATION_KILLED_AFTER = "apc__agent-ts__c1__r0"


@dataclass
class IntegrationExperiment:
    """The integration experiment's directory, its API key, what each server answered without the key, and
    the server process killed between cells."""

    dir: Path
    api_key: str
    #: server -> (status of /v1/models without the key, with it), probed after each cell
    refused: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: cell -> pid of the server process that ran it
    server_pids: dict[str, int] = field(default_factory=dict)
    #: the cells after which their server was SIGKILLed (the probe ran first)
    killed: list[str] = field(default_factory=list)


@pytest.fixture(scope="session")
def integration_experiment(require_vllm, tiny_model_dir, tmp_path_factory):
    """2 server configurations (prefix caching on/off) x 2 workloads (append-only agent, timestamped agent) x
    1 load x 2 repeats on real vLLM, run once for the session (test_experiment_integration, test_auth).
    After `INTEGRATION_KILLED_AFTER` the `apc` server's process group is SIGKILLed, so its next cell checks
    that the runner starts a killed server again (test_experiment_integration); this costs one more start.

    Both servers require an API key, given the two ways a config can: `api_key_env` naming a variable of
    kvscope's environment (`apc`) and `VLLM_API_KEY` in the config's `env:` (`no-apc`); the third,
    `--api-key` in `extra_args`, is test_auth's `kvscope replay --server`.  The variable stays set for the
    session, so the `kvscope ... --resume` subprocesses of the tests find it."""
    import httpx

    from kvscope.harness.experiment.runner import run_experiment

    key = "sk-kvscope-" + secrets.token_hex(12)
    previous = os.environ.get(INTEGRATION_KEY_VAR)
    os.environ[INTEGRATION_KEY_VAR] = key
    root = tmp_path_factory.mktemp("exp")
    spec = root / "itest.yaml"
    spec.write_text(INTEGRATION_SPEC.format(model=tiny_model_dir, var=INTEGRATION_KEY_VAR, key=key))
    found = IntegrationExperiment(root, key)

    def probe(cell, server) -> None:  # the server really requires the key: without it /v1 answers 401
        url = server.endpoint + "/v1/models"
        found.refused[cell.server] = (httpx.get(url, timeout=10).status_code,
                                      httpx.get(url, timeout=10, headers={"Authorization": f"Bearer {key}"}).status_code)
        found.server_pids[cell.name] = server.process.pid
        if cell.name == INTEGRATION_KILLED_AFTER:
            found.killed.append(cell.name)
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=30)

    try:
        found.dir = run_experiment(spec, out=root / "results", run_id="r1", after_cell=probe)
        yield found
    finally:
        if previous is None:
            os.environ.pop(INTEGRATION_KEY_VAR, None)
        else:
            os.environ[INTEGRATION_KEY_VAR] = previous


@pytest.fixture(scope="session")
def integration_report(integration_experiment) -> Path:
    """The integration experiment's full report (every notebook): its index.html."""
    from kvscope.harness.report.render import render_report

    return render_report(integration_experiment.dir, progress=False)
