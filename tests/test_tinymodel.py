import json

import numpy as np
import pytest

from kvscope.harness.model.tinymodel import CHAT_TEMPLATE, TinyModelShape, build_tiny_model, weights_are_random


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_gives_byte_identical_files(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    build_tiny_model(tmp_path / "b", seed=3)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert a.files["model.safetensors"]


def test_different_seed_gives_different_weights_and_tokenizer(tmp_path):
    build_tiny_model(tmp_path / "a", seed=1)
    build_tiny_model(tmp_path / "b", seed=2)
    fa, fb = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert fa["model.safetensors"] != fb["model.safetensors"]
    assert fa["tokenizer.json"] != fb["tokenizer.json"]


def test_config_is_small_gqa_llama_with_head_dim_64(tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["head_dim"] == 64
    assert cfg["num_attention_heads"] > cfg["num_key_value_heads"]  # GQA
    assert cfg["hidden_size"] == cfg["num_attention_heads"] * cfg["head_dim"]
    n = TinyModelShape().num_parameters()
    assert 1e6 <= n <= 10e6
    # parameter count in the file equals the analytical count
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        total = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    assert total == n


def test_tokenizer_is_byte_level_bpe_with_4000_plus_tokens(tiny_model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() >= 4000
    text = 'def read_file(path):\n    return {"name": "bash", "ü": 3}  # ✓'
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text  # byte-level: any text round-trips
    assert len(ids) < len(text.encode()) * 0.8  # merges were learned
    eos = tok.token_to_id("<|eot_id|>")
    assert eos is not None and eos not in ids


def test_chat_template_renders_llama3_layout(tiny_model_dir):
    import jinja2

    tpl = jinja2.Environment().from_string((tiny_model_dir / "chat_template.jinja").read_text())
    out = tpl.render(messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                     add_generation_prompt=True, bos_token="<|begin_of_text|>")
    assert out == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE


def test_random_weights_are_flagged(tiny_model_dir):
    assert weights_are_random(tiny_model_dir)


def test_training_is_deterministic_and_lowers_loss(tmp_path):
    pytest.importorskip("torch")
    a = build_tiny_model(tmp_path / "a", seed=0, train_steps=3)
    build_tiny_model(tmp_path / "b", seed=0, train_steps=3)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    card = json.loads((tmp_path / "a" / "kvscope_model.json").read_text())
    assert card["weights"] == "trained" and not weights_are_random(tmp_path / "a")
    assert card["final_train_loss"] < np.log(a.shape.vocab_size)  # below the uniform-guess loss


def test_sizes_share_the_tokenizer_and_the_large_one_is_larger(tmp_path):
    """Model routing serves a small and a large model on one trace: both sizes of one seed must tokenize alike."""
    small = build_tiny_model(tmp_path / "s", seed=1, size="small")
    large = build_tiny_model(tmp_path / "l", seed=1, size="large")
    assert (tmp_path / "s" / "tokenizer.json").read_bytes() == (tmp_path / "l" / "tokenizer.json").read_bytes()
    cfg = json.loads((tmp_path / "l" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (8, 512)
    assert large.num_parameters > 3 * small.num_parameters
    assert large.shape.kv_bytes_per_token() == 4 * small.shape.kv_bytes_per_token()
    assert json.loads((tmp_path / "l" / "kvscope_model.json").read_text())["size"] == "large"
    with pytest.raises(ValueError, match="size 'huge'"):
        build_tiny_model(tmp_path / "x", size="huge")
