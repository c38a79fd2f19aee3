"""Shared fixtures: the locally built tiny model and real vLLM servers on loopback.

vLLM integration tests are marked `vllm`; they start real servers (≈20–35 s each on 2 cores), so servers are
module- or session-scoped and shared by every test that can use the same configuration.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


def start_server(model_dir: Path, log_dir: Path, **overrides):
    from kvscope.harness.serving.server import ServerConfig, VllmServer

    fields = dict(model=str(model_dir), served_model_name="tiny", max_model_len=2048,
                  kv_cache_memory_bytes="32M", startup_timeout_s=240)
    fields.update(overrides)
    server = VllmServer(ServerConfig(**fields), log_path=log_dir / "server.log")
    server.start()
    return server


@pytest.fixture(scope="session")
def vllm_server(require_vllm, tiny_model_dir, tmp_path_factory):
    """A shared vLLM CPU server with prefix caching on (default flags, 32 MiB of KV cache)."""
    server = start_server(tiny_model_dir, tmp_path_factory.mktemp("vllm_apc"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _ngram_server_holder(require_vllm, tiny_model_dir, tmp_path_factory):
    holder: dict = {"log_dir": tmp_path_factory.mktemp("vllm_ngram")}
    yield holder
    if holder.get("server") is not None:
        holder["server"].stop()


@pytest.fixture()
def ngram_server(_ngram_server_holder, tiny_model_dir):
    """A shared server with prefix caching off and n-gram speculative decoding on (test_vllm_integration's
    speculation and no-cache tests, test_replay_integration's no-cache replay: one start instead of two).
    A test may stop it (test_stopping_the_manager_leaves_no_vllm_process); the next user gets a new one."""
    server = _ngram_server_holder.get("server")
    if server is None or not server.is_running():
        server = start_server(tiny_model_dir, _ngram_server_holder["log_dir"], enable_prefix_caching=False,
                              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4})
        _ngram_server_holder["server"] = server
    return server
