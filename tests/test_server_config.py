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
