import json
import socket

import pytest

from kvscope.harness.common.errors import ConfigError, ServerError
from kvscope.harness.serving.server import ServerConfig, VllmServer, diagnose_log


def test_yaml_config_round_trips_into_vllm_flags(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(
        "model: /models/x\nserved_model_name: x\nmax_model_len: 4096\nenable_prefix_caching: false\n"
        "speculative_config: {method: ngram, num_speculative_tokens: 4}\nmax_num_seqs: 8\n"
        "kv_cache_memory_bytes: 1G\nkv_cache_dtype: fp8\nblock_size: 32\nnum_gpu_blocks_override: 12\n"
        "extra_args: [--disable-log-stats]\nenv: {FOO: bar}\n"
    )
    cfg = ServerConfig.from_yaml(p)
    args = cfg.vllm_args(port=1234, device="cpu")
    joined = " ".join(args)
    assert "--no-enable-prefix-caching" in args
    assert "--speculative-config " + json.dumps({"method": "ngram", "num_speculative_tokens": 4}, sort_keys=True) in joined
    for flag, value in [("--max-num-seqs", "8"), ("--kv-cache-memory-bytes", "1G"), ("--kv-cache-dtype", "fp8"),
                        ("--block-size", "32"), ("--num-gpu-blocks-override", "12"), ("--port", "1234"),
                        ("--host", "127.0.0.1"), ("--max-model-len", "4096")]:
        assert args[args.index(flag) + 1] == value
    assert args[-1] == "--disable-log-stats"
    assert "--enable-prompt-tokens-details" in args


def test_cpu_kv_cache_is_always_sized_explicitly():
    args = ServerConfig(model="/m").vllm_args(port=1, device="cpu")
    assert args[args.index("--kv-cache-memory-bytes") + 1] == "256M"
    assert "--kv-cache-memory-bytes" not in ServerConfig(model="/m").vllm_args(port=1, device="cuda")


def test_unknown_field_names_file_field_and_allowed(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: /m\nprefix_caching: true\n")
    with pytest.raises(ConfigError) as e:
        ServerConfig.from_yaml(p)
    msg = str(e.value)
    assert str(p) in msg and "prefix_caching" in msg and "unknown field" in msg
    assert "enable_prefix_caching" in msg  # the allowed names are listed


def test_wrong_type_and_bad_size_are_named(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: /m\nmax_num_seqs: many\nkv_cache_memory_bytes: lots\n")
    with pytest.raises(ConfigError) as e:
        ServerConfig.from_yaml(p)
    assert "max_num_seqs" in str(e.value) and "kv_cache_memory_bytes" in str(e.value) and "'lots'" in str(e.value)


def test_unreadable_and_non_mapping_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        ServerConfig.from_yaml(tmp_path / "missing.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        ServerConfig.from_yaml(p)


def test_missing_model_directory_fails_before_launch(tmp_path):
    with pytest.raises(ServerError, match="model directory not found: .*nope"):
        VllmServer(ServerConfig(model=str(tmp_path / "nope"))).start()


def test_port_in_use_is_reported_with_the_port(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} .*already in use"):
            VllmServer(ServerConfig(model=str(tiny_model_dir), port=port)).start()


def test_api_key_comes_from_the_environment_and_is_never_recorded(monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-secret-123")
    cfg = ServerConfig(model="/m", api_key_env="MY_KEY")
    server = VllmServer(cfg, device="cpu")
    assert server.environment()["VLLM_API_KEY"] == "sk-secret-123"
    assert "sk-secret-123" not in json.dumps(cfg.redacted())
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(ConfigError, match="MY_KEY is not set"):
        server.environment()


@pytest.mark.parametrize(
    "log,expected",
    [
        ("usage: api_server.py [-h]\napi_server.py: error: unrecognized arguments: --bogus-flag 3\n",
         "unknown vLLM flag(s): --bogus-flag 3"),
        ("api_server.py: error: argument --max-num-seqs: invalid int value: 'x'\n",
         "bad value for vLLM flag --max-num-seqs: invalid int value: 'x'"),
        ("OSError: [Errno 98] Address already in use\n", "port already in use ([Errno 98] Address already in use)"),
        ("Traceback…\nValueError: To serve at least one request with the model's max seq len (8192), (1.0 GiB KV "
         "cache is needed, …\n", "KV cache too small: To serve at least one request with the model's max seq len (8192), (1.0 GiB KV cache is needed, …"),
        ("INFO all fine\n", None),
        ("(APIServer pid=1) WARNING 11-29 [system_utils.py:255] Found ulimit of 20000 and failed to automatically "
         "increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: "
         "[Errno 24] Too many open files`. Consider increasing with ulimit -n\n", None),
    ],
)
def test_log_diagnosis_names_the_cause(log, expected):
    assert diagnose_log(log) == expected


# ---------------------------------------------------------------------------------- secrets and redaction

import threading  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvscope.harness.common.secrets import REDACTED, redact_argv, redact_config, secret_argv_values  # noqa: E402
from kvscope.harness.serving.backend import Backend  # noqa: E402

SECRET_VALUES = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", min_size=12, max_size=40)
SECRET_NAMES = st.sampled_from(["VLLM_API_KEY", "HF_TOKEN", "my_secret", "DB_PASSWORD", "Auth_Header",
                                "AWS_CREDENTIALS", "OPENAI_API_KEY", "private_thing"])


@settings(max_examples=60, deadline=None)
@given(secret=SECRET_VALUES, name=SECRET_NAMES, form=st.sampled_from(["split", "equals", "two"]))
def test_redacted_config_never_holds_a_secret_from_env_or_extra_args(secret, name, form):
    flag = {"split": ["--api-key", secret], "equals": [f"--api-key={secret}"],
            "two": ["--api-key", "other-key-0000", secret]}[form]
    cfg = ServerConfig(model="/m", env={name: secret, "FOO": "bar"}, api_key_env="MY_KEY",
                       extra_args=["--max-num-batched-tokens", "2048", *flag, "--disable-log-stats"])
    dumped = json.dumps(cfg.redacted())
    assert secret not in dumped and "other-key-0000" not in dumped
    red = cfg.redacted()
    assert red["env"] == {name: REDACTED, "FOO": "bar"}  # non-secret variables are kept
    assert red["api_key_env"] == "MY_KEY"  # the variable's name is recorded, never its value
    assert red["extra_args"][:2] == ["--max-num-batched-tokens", "2048"] and red["extra_args"][-1] == "--disable-log-stats"


def test_redact_argv_only_touches_secret_flags():
    argv = ["python", "-m", "x", "--enable-prompt-tokens-details", "--max-num-batched-tokens", "512",
            "--api-key", "k1", "k2", "--hf-token=t0ken", "--seed", "-1", "--tokenizer", "/tok"]
    assert redact_argv(argv) == ["python", "-m", "x", "--enable-prompt-tokens-details", "--max-num-batched-tokens",
                                 "512", "--api-key", REDACTED, REDACTED, f"--hf-token={REDACTED}", "--seed", "-1",
                                 "--tokenizer", "/tok"]
    assert secret_argv_values(argv) == ["k1", "k2", "t0ken"]


def test_redact_config_walks_raw_experiment_specs():
    raw = {"name": "e", "model": {"tokenizer": "/tok"}, "server_defaults": {"env": {"HF_TOKEN": "hf_abcdefgh"}},
           "servers": {"a": {"extra_args": ["--api-key=sk-zzzzzzzz"], "max_num_batched_tokens": 64}}}
    red = redact_config(raw)
    assert "hf_abcdefgh" not in json.dumps(red) and "sk-zzzzzzzz" not in json.dumps(red)
    assert red["model"] == {"tokenizer": "/tok"} and red["servers"]["a"]["max_num_batched_tokens"] == 64


def test_api_key_is_taken_where_vllm_takes_it(monkeypatch):
    monkeypatch.setenv("MY_KEY", "from-env-var")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert ServerConfig(model="/m", extra_args=["--api-key", "from-flag"], api_key_env="MY_KEY").api_key() == "from-flag"
    assert ServerConfig(model="/m", api_key_env="MY_KEY", env={"VLLM_API_KEY": "x"}).api_key() == "from-env-var"
    assert ServerConfig(model="/m", env={"VLLM_API_KEY": "from-env-block"}).api_key() == "from-env-block"
    assert ServerConfig(model="/m").api_key() is None
    backend = Backend.create("vllm", {"model": "/m", "env": {"VLLM_API_KEY": "from-env-block"}})
    assert backend.auth_headers() == {"Authorization": "Bearer from-env-block"}


def test_server_log_never_shows_the_key(tiny_model_dir, tmp_path):
    # /bin/echo as the "interpreter" prints the whole command line into the log, then exits before ready.
    cfg = ServerConfig(model=str(tiny_model_dir), python="/bin/echo", extra_args=["--api-key", "sk-log-secret-1"],
                       env={"HF_TOKEN": "hf-log-secret-2"}, startup_timeout_s=10)
    with pytest.raises(ServerError, match="exited") as failure:
        VllmServer(cfg, log_path=tmp_path / "server.log", device="cpu").start()
    assert "--api-key" in str(failure.value) and "sk-log-secret-1" not in str(failure.value)  # the log tail
    log = (tmp_path / "server.log").read_text()
    assert "--api-key" in log and "sk-log-secret-1" not in log and "hf-log-secret-2" not in log


# ------------------------------------------------------------------------------------------- backends

METRICS_TEXT = """\
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0"} 10.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0"} 4.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0"} 3.0
vllm:num_preemptions_total{engine="1"} 4.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100",enable_prefix_caching="True"} 1.0
"""


class _AuthServer:
    """A loopback server that answers only requests carrying the right Bearer key and logs every path."""

    def __init__(self, key: str) -> None:
        self.key, self.seen, outer = key, [], self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # noqa: ANN002
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                ok = self.headers.get("Authorization") == f"Bearer {outer.key}"
                outer.seen.append((self.command, self.path, ok, body))
                if not ok:
                    self.send_response(401)
                    self.end_headers()
                    return
                payload = {"/version": b'{"version": "9.9.9"}',
                           "/v1/models": b'{"data": [{"id": "tiny", "max_model_len": 2048}]}',
                           "/metrics": METRICS_TEXT.encode()}.get(self.path, b'{"choices": []}')
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def auth_server():
    srv = _AuthServer("sk-unit-key-777")
    yield srv
    srv.close()


def test_vllm_backend_authenticates_facts_reset_scrape_and_warm_up(auth_server, monkeypatch):
    import asyncio

    import aiohttp

    from kvscope.harness.experiment.runner import _warm_up
    from kvscope.harness.results.summary import ServerFacts
    from kvscope.harness.replay.watch import MetricsWatcher

    monkeypatch.setenv("UNIT_KEY", "sk-unit-key-777")
    backend = Backend.create("vllm", endpoint=auth_server.endpoint, api_key_env="UNIT_KEY")
    facts = backend.facts()
    assert (facts.backend, facts.engine_version, facts.block_size, facts.num_blocks) == ("vllm", "9.9.9", 16, 100)
    assert backend.reset_prefix_cache().ok
    assert _warm_up(backend, "tiny", ServerFacts(max_model_len=64), extra_requests=2, seed=0) == 2

    async def scrape() -> dict:
        w = MetricsWatcher([backend.endpoint], backends=[backend])
        async with aiohttp.ClientSession() as session:
            await w.scrape_once(session)
        return {"errors": w.watches[0].errors, "rows": len(w.rows)}

    assert asyncio.run(scrape()) == {"errors": 0, "rows": 1}
    paths = {(m, p) for m, p, ok, _ in auth_server.seen}
    assert {("GET", "/version"), ("GET", "/metrics"), ("POST", "/reset_prefix_cache"),
            ("POST", "/v1/completions")} <= paths
    assert all(ok for *_, ok, _ in auth_server.seen)
    warm = [json.loads(b) for m, p, _, b in auth_server.seen if p == "/v1/completions"]
    assert all(w["ignore_eos"] is True for w in warm)  # vLLM's request extras


def test_warm_up_fills_the_pool_only_when_asked(auth_server, monkeypatch):
    from kvscope.harness.experiment.runner import _warm_up
    from kvscope.harness.results.summary import ServerFacts

    monkeypatch.setenv("UNIT_KEY", "sk-unit-key-777")
    backend = Backend.create("vllm", endpoint=auth_server.endpoint, api_key_env="UNIT_KEY")
    facts = ServerFacts(max_model_len=64, kv_capacity_tokens=480)  # 48-token prompts: 10 write the pool
    assert _warm_up(backend, "tiny", facts, extra_requests=2, seed=0) == 12  # a fresh process's first cell
    assert _warm_up(backend, "tiny", facts, extra_requests=2, seed=0, fill_pool=False) == 2  # its later cells


def test_warm_up_without_the_key_fails_loudly(auth_server):
    from kvscope.harness.common.errors import KvscopeError
    from kvscope.harness.experiment.runner import _warm_up
    from kvscope.harness.results.summary import ServerFacts

    backend = Backend.create("vllm", endpoint=auth_server.endpoint)
    assert backend.auth_headers() == {}
    with pytest.raises(KvscopeError, match="HTTP 401"):
        _warm_up(backend, "tiny", ServerFacts(max_model_len=64), extra_requests=1, seed=0)


def test_openai_backend_knows_only_what_models_and_the_config_say(auth_server, monkeypatch):
    monkeypatch.setenv("UNIT_KEY", "sk-unit-key-777")
    backend = Backend.create("openai", {"endpoint": auth_server.endpoint, "block_size": 32, "api_key_env": "UNIT_KEY"})
    backend.start()
    facts = backend.facts()
    assert (facts.backend, facts.model, facts.max_model_len, facts.block_size) == ("openai", "tiny", 2048, 32)
    assert facts.engine_version is None and facts.vllm_version is None and facts.prefix_caching is None
    assert facts.num_blocks is None and facts.kv_capacity_tokens is None
    reset = backend.reset_prefix_cache()
    assert not reset.ok and "no cache-reset endpoint" in reset.detail
    assert backend.request_extras("salt") == {} and backend.metrics_path is None and not backend.managed
    assert [p for _, p, _, _ in auth_server.seen] == ["/v1/models", "/v1/models"]  # nothing vLLM-specific asked


def test_engine_specifics_come_through_the_backend(auth_server, monkeypatch):
    """Preemptions, facts for a caller holding its own credentials, and the launched model: each a Backend
    method, so no layer above serving reads vLLM's metric names or facts endpoints itself."""
    from kvscope.harness.serving.backend import endpoint_facts

    monkeypatch.setenv("UNIT_KEY", "sk-unit-key-777")
    vllm = Backend.create("vllm", endpoint=auth_server.endpoint, api_key_env="UNIT_KEY")
    assert vllm.preemptions_total() == 7.0  # summed over engines
    assert vllm.scrape_metrics().counter_columns()["num_preemptions"] == 7.0
    assert vllm.model_path() is None  # attached, not launched
    assert Backend.create("vllm", {"model": "/models/x"}).model_path() == "/models/x"
    facts = endpoint_facts(auth_server.endpoint, headers={"Authorization": "Bearer sk-unit-key-777"})
    assert (facts.backend, facts.block_size, facts.num_blocks, facts.launched_by_kvscope) == ("vllm", 16, 100, False)
    with pytest.raises(ServerError, match="cannot read server facts"):
        endpoint_facts(auth_server.endpoint)  # no key: the server answers 401
    openai = Backend.create("openai", {"endpoint": auth_server.endpoint, "api_key_env": "UNIT_KEY"})
    assert openai.preemptions_total() is None and openai.scrape_metrics() is None and openai.model_path() is None


def test_one_api_key_resolver_names_the_setting_that_named_the_variable(monkeypatch):
    from kvscope.harness.serving.backend import bearer_headers, resolve_api_key

    monkeypatch.delenv("KVSCOPE_UNSET_KEY", raising=False)
    monkeypatch.setenv("KVSCOPE_SET_KEY", "sk-1")
    assert resolve_api_key(None) is None and bearer_headers(None) == {}
    assert bearer_headers(resolve_api_key("KVSCOPE_SET_KEY")) == {"Authorization": "Bearer sk-1"}
    with pytest.raises(ConfigError, match="^--api-key-env: environment variable KVSCOPE_UNSET_KEY is not set$"):
        resolve_api_key("KVSCOPE_UNSET_KEY", "--api-key-env")
    with pytest.raises(ConfigError, match="^api_key_env: environment variable KVSCOPE_UNSET_KEY is not set$"):
        ServerConfig(model="/m", api_key_env="KVSCOPE_UNSET_KEY").api_key()
    with pytest.raises(ConfigError, match="^api_key_env: environment variable KVSCOPE_UNSET_KEY"):
        Backend.create("openai", {"endpoint": "http://127.0.0.1:1", "api_key_env": "KVSCOPE_UNSET_KEY"}).auth_headers()


def test_unknown_backend_and_bad_backend_config_are_named():
    with pytest.raises(ConfigError, match="unknown backend 'sglang'; allowed: openai, vllm"):
        Backend.create("sglang", {})
    with pytest.raises(ConfigError, match="block_size"):
        Backend.create("openai", {"endpoint": "http://127.0.0.1:1", "block_size": 0}, source="s.yaml")


def test_experiment_servers_select_a_backend_and_shipped_specs_stay_valid(tmp_path):
    from pathlib import Path

    from kvscope.harness.experiment.spec import load_experiment_spec, server_backend

    for shipped in sorted((Path(__file__).resolve().parents[1] / "experiments").glob("*.yaml")):
        spec, _ = load_experiment_spec(shipped)
        assert {server_backend(spec, n, "/m").name for n in spec.servers} == {"vllm"}
    p = tmp_path / "e.yaml"
    p.write_text("name: e\nserver_defaults: {max_model_len: 1024}\nworkloads: {w: {spec: chat}}\n"
                 "servers:\n  local: {}\n  remote: {backend: openai, endpoint: 'http://127.0.0.1:9', block_size: 16}\n")
    spec, _ = load_experiment_spec(p)
    remote = server_backend(spec, "remote", "/m")
    assert remote.name == "openai" and remote.config.block_size == 16 and remote.config.model == "tiny"
    local = server_backend(spec, "local", "/m")
    assert local.name == "vllm" and local.config.max_model_len == 1024
    p.write_text("name: e\nworkloads: {w: {spec: chat}}\nservers: {remote: {backend: openai, block_size: 16}}\n")
    with pytest.raises(ConfigError, match=r"servers\.remote.*endpoint"):
        load_experiment_spec(p)


def test_cli_serve_refuses_an_attach_only_backend_and_server_info_uses_the_backend(auth_server, tmp_path,
                                                                                     monkeypatch, capsys):
    from kvscope.harness.cli.main import main

    cfg = tmp_path / "remote.yaml"
    cfg.write_text(f"backend: openai\nendpoint: {auth_server.endpoint}\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "backend openai attaches to a running server" in capsys.readouterr().err
    assert main(["server-info", "--endpoint", auth_server.endpoint, "--api-key-env", "NOPE_UNSET", "--json"]) == 2
    assert "--api-key-env: environment variable NOPE_UNSET is not set" in capsys.readouterr().err
    monkeypatch.setenv("UNIT_KEY", "sk-unit-key-777")
    assert main(["server-info", "--endpoint", auth_server.endpoint, "--api-key-env", "UNIT_KEY", "--backend",
                 "openai", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["backend"] == "openai" and facts["model"] == "tiny" and facts["block_size"] is None


def test_control_plane_http_shares_one_verifying_tls_context():
    """kvscope's httpx calls share one context (httpx otherwise reads the CA bundle for every call, ~25 ms,
    even for http URLs), and sharing it must not switch verification off."""
    import ssl

    from kvscope.harness.serving.tls import tls_context

    ctx = tls_context()
    assert tls_context() is ctx
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


# A stand-in for vLLM's interpreter: from vLLM's command line it keeps the port and the served name and serves the
# loopback mock server there, so `kvscope replay --server` runs from launch to its last file without vLLM.
MOCK_VLLM = """#!/bin/sh
port=""; name="mock"
while [ $# -gt 0 ]; do
  case "$1" in --port) port=$2; shift ;; --served-model-name) name=$2; shift ;; esac
  shift
done
PYTHONPATH={repo} exec {python} -m tests.doubles.faultserver --port "$port" --model "$name"
"""


def test_a_launched_replay_runs_to_the_end_and_writes_the_config_redacted(tiny_model_dir, tmp_path):
    """test_auth's real-vLLM launch of `kvscope replay --server` is SIGTERMed mid-run, so the files a launched run
    writes only at its end (manifest.json with the server's configuration, summary.json) are checked here, with
    the mock server standing in for vLLM; the key given in `extra_args` is in none of them."""
    import subprocess
    import sys
    from pathlib import Path

    import psutil
    from kvscope.workloads.generate import generate_from_file

    repo = Path(__file__).resolve().parents[1]
    fake = tmp_path / "mock-vllm-python"
    fake.write_text(MOCK_VLLM.format(repo=repo, python=sys.executable))
    fake.chmod(0o755)
    key = "sk-standin-0123456789"
    trace = generate_from_file("agent-coding", tiny_model_dir, seed=3, scale=0.02, sessions=2,
                               max_context=1500).write(tmp_path / "trace")
    server_yaml = tmp_path / "server.yaml"
    server_yaml.write_text(f"model: {tiny_model_dir}\nserved_model_name: tiny\npython: {fake}\n"
                           f"startup_timeout_s: 60\nextra_args: ['--api-key={key}']\n")
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "replay", str(trace), "--server",
                          str(server_yaml), "--out", str(run_dir), "--concurrency", "2", "--time-scale", "0",
                          "--no-progress"], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert key not in out.stdout + out.stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["server_config"]["extra_args"] == ["--api-key=<redacted>"]
    assert manifest["server_config"]["python"] == str(fake)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["requests"]["sent"] > 0 and summary["requests"]["ok"] == summary["requests"]["sent"]
    assert summary["server_deltas"]["generation_tokens"] > 0  # /metrics was scraped before and after
    assert (run_dir / "server.log").stat().st_size > 0
    assert [p.name for p in sorted(run_dir.rglob("*")) if p.is_file() and key.encode() in p.read_bytes()] == []
    assert not [p for p in psutil.process_iter(["cmdline"])  # the launched stand-in was stopped with the run
                if p.info["cmdline"] and str(fake) in " ".join(p.info["cmdline"])]


def test_backends_answer_for_their_configuration():
    """The experiment layer asks the backend, never the engine's config keys: served model, scheduler limits,
    speculative decoding, GPUs per server, the key's variable."""
    from kvscope.harness.serving.backend import Backend, SchedulerLimits

    vllm = Backend.create("vllm", ServerConfig(model="/m", served_model_name="tiny", max_num_seqs=8,
                                               speculative_config={"method": "ngram"}, tensor_parallel_size=2,
                                               extra_args=["--pipeline-parallel-size", "3"], api_key_env="K"))
    assert (vllm.served_model_name(), vllm.speculative_decoding(), vllm.gpus_per_server()) == ("tiny", True, 6)
    assert vllm.scheduler_limits() == SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=None)
    assert vllm.api_key_env == "K"
    plain = Backend.create("vllm", ServerConfig(model="/m"))
    assert (plain.served_model_name(), plain.speculative_decoding(), plain.gpus_per_server()) == ("/m", False, 1)
    attached = Backend.create("vllm", endpoint="http://127.0.0.1:1")
    assert (attached.served_model_name(), attached.scheduler_limits()) == (None, SchedulerLimits())
    openai = Backend.create("openai", {"endpoint": "http://127.0.0.1:1", "model": "gpt"})
    assert (openai.served_model_name(), openai.speculative_decoding(), openai.gpus_per_server()) == ("gpt", False, 1)
