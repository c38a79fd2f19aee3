"""KV-cache memory per token and how many sequences fit (capacity planning).

``bytes/token = 2 (K,V) x layers x ceil-div(kv_heads, TP) x head_dim x bytes(kv_dtype)`` per GPU
(vLLM: ``AttentionSpec.page_size_bytes`` summed over layers; KV heads are replicated when TP exceeds
them).  Sliding-window layers hold at most ``window`` tokens, so for them the cost stops growing with
context (vLLM's ``SlidingWindowSpec``).  vLLM's own block count is
``available_bytes // (block_size * bytes_per_token)``; see :func:`num_gpu_blocks`.
"""

from __future__ import annotations

from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

GiB = 2**30
KiB = 2**10

DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1,
    "int4": 0.5, "fp4": 0.5,
}


def dtype_bytes(name: str) -> float:
    key = name.lower().replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


def kv_cache_bytes(n_layers: int, n_kv_heads: int, d_head: int, seq_len: int, bytes_per: float = 2) -> float:
    """The textbook formula: ``2 * n_layers * n_kv_heads * d_head * seq_len * bytes_per``."""
    return 2 * n_layers * n_kv_heads * d_head * seq_len * bytes_per


class ModelShape(BaseModel):
    """The attention shape that determines KV size (plus parameter count for weight memory)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int | None = None
    params: float | None = Field(None, description="parameter count, for weight bytes")
    dtype: str = "bfloat16"
    sliding_window: int | None = None
    num_sliding_layers: int = 0

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    def weight_bytes(self, dtype: str | None = None) -> float | None:
        return None if self.params is None else self.params * dtype_bytes(dtype or self.dtype)


PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in [
        ModelShape(name="llama-3.1-8b", num_layers=32, num_kv_heads=8, head_dim=128, num_attention_heads=32,
                   params=8.03e9),
        ModelShape(name="llama-3.1-70b", num_layers=80, num_kv_heads=8, head_dim=128, num_attention_heads=64,
                   params=70.55e9),
        ModelShape(name="llama-2-7b", num_layers=32, num_kv_heads=32, head_dim=128, num_attention_heads=32,
                   params=6.74e9),
        ModelShape(name="mistral-7b", num_layers=32, num_kv_heads=8, head_dim=128, num_attention_heads=32,
                   params=7.25e9),
        ModelShape(name="qwen2.5-7b", num_layers=28, num_kv_heads=4, head_dim=128, num_attention_heads=28,
                   params=7.62e9),
        ModelShape(name="gemma-2-9b", num_layers=42, num_kv_heads=8, head_dim=256, num_attention_heads=16,
                   params=9.24e9, sliding_window=4096, num_sliding_layers=21),
        # kvscope.harness.model.tinymodel.TinyModelShape defaults (tests/offline/test_models.py keeps them in step).
        ModelShape(name="kvscope-tiny", num_layers=4, num_kv_heads=2, head_dim=64, num_attention_heads=4,
                   params=7_342_336),
        # The illustrative shapes of the seed document's table.
        ModelShape(name="8b-gqa", num_layers=32, num_kv_heads=8, head_dim=128),
        ModelShape(name="8b-mha", num_layers=32, num_kv_heads=32, head_dim=128),
        ModelShape(name="70b-gqa", num_layers=80, num_kv_heads=8, head_dim=128),
        ModelShape(name="70b-mha", num_layers=80, num_kv_heads=64, head_dim=128),
    ]
}


def get_preset(name: str) -> ModelShape:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None


def shape_from_hf_config(cfg: dict[str, Any] | str | Path, name: str | None = None) -> ModelShape:
    """Read the attention shape from a Hugging Face ``config.json`` (dict or path).

    Handles ``head_dim`` absent (``hidden_size / num_attention_heads``), ``num_key_value_heads`` absent
    (MHA), nested ``text_config``, and sliding windows given by ``layer_types`` (``sliding_attention``),
    Qwen2's ``use_sliding_window``/``max_window_layers`` or Gemma-2's every-other-layer pattern.
    """
    if not isinstance(cfg, dict):
        path = Path(cfg)
        if path.is_dir():
            path = path / "config.json"
        cfg = json.loads(path.read_text())
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    L = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kvh = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    window = cfg.get("sliding_window")
    n_swa = 0
    if window:
        layer_types = cfg.get("layer_types")
        if layer_types:
            n_swa = sum(1 for t in layer_types if "sliding" in str(t))
        elif "use_sliding_window" in cfg:
            n_swa = L - int(cfg.get("max_window_layers", L)) if cfg["use_sliding_window"] else 0
        elif cfg.get("model_type") in ("gemma2",):
            n_swa = L // 2
        elif cfg.get("sliding_window_pattern"):
            p = int(cfg["sliding_window_pattern"])
            n_swa = L - L // p
        else:
            n_swa = L  # e.g. Mistral-7B-v0.1: every layer uses the window
    return ModelShape(name=name or cfg.get("_name_or_path") or cfg.get("model_type", "model"), num_layers=L,
                      num_kv_heads=kvh, head_dim=hd, num_attention_heads=heads, dtype=dtype,
                      sliding_window=int(window) if window and n_swa else None, num_sliding_layers=n_swa)


def kv_heads_per_gpu(num_kv_heads: int, tp: int) -> int:
    """vLLM splits KV heads over TP ranks, replicating them when ``tp > num_kv_heads``."""
    return max(1, math.ceil(num_kv_heads / tp))


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str | None = None, tp: int = 1) -> float:
    """Bytes per token per GPU if every layer kept every token (full attention)."""
    b = dtype_bytes(kv_dtype or shape.dtype) if kv_dtype not in (None, "auto") else dtype_bytes(shape.dtype)
    return kv_cache_bytes(shape.num_layers, kv_heads_per_gpu(shape.num_kv_heads, tp), shape.head_dim, 1, b)


def kv_bytes_for_sequence(shape: ModelShape, context: int, kv_dtype: str | None = None, tp: int = 1) -> float:
    """KV bytes one sequence of ``context`` tokens holds per GPU, sliding-window layers capped."""
    per_layer_token = kv_bytes_per_token(shape, kv_dtype, tp) / shape.num_layers
    swa_tokens = min(context, shape.sliding_window) if shape.sliding_window else context
    return per_layer_token * (shape.num_full_layers * context + shape.num_sliding_layers * swa_tokens)


def max_concurrent_sequences(memory_bytes: float, per_sequence_bytes: float) -> int:
    """How many sequences' caches fit in ``memory_bytes`` (0 if not even one)."""
    return int(memory_bytes // per_sequence_bytes) if per_sequence_bytes > 0 else 0


def num_gpu_blocks(available_bytes: float, shape: ModelShape, block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str | None = None,
                   tp: int = 1) -> int:
    """vLLM's block count for full-attention models: ``available // (block_size * bytes_per_token)``."""
    return int(available_bytes // (block_size * kv_bytes_per_token(shape, kv_dtype, tp)))


def kv_memory_report(*, config: str | dict | None = None, preset: str | None = None, context: int = 8192,
                     kv_dtype: str | None = None, tp: int = 1, memory_gib: float | None = None,
                     block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
    """JSON-able answer of ``kvscope kv-memory``."""
    if (config is None) == (preset is None):
        raise ValueError("give exactly one of config or preset")
    shape = shape_from_hf_config(config) if config is not None else get_preset(preset)  # type: ignore[arg-type]
    per_tok = kv_bytes_per_token(shape, kv_dtype, tp)
    per_seq = kv_bytes_for_sequence(shape, context, kv_dtype, tp)
    out: dict[str, Any] = {
        "model": shape.name,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "kv_heads_per_gpu": kv_heads_per_gpu(shape.num_kv_heads, tp),
        "head_dim": shape.head_dim,
        "sliding_window": shape.sliding_window,
        "num_sliding_layers": shape.num_sliding_layers,
        "kv_dtype": kv_dtype or shape.dtype,
        "tensor_parallel": tp,
        "context_tokens": context,
        "bytes_per_token": per_tok,
        "kib_per_token": per_tok / KiB,
        "bytes_per_sequence": per_seq,
        "gib_per_sequence": per_seq / GiB,
    }
    if shape.params:
        out["weight_gib_per_gpu"] = shape.weight_bytes() / GiB / tp  # type: ignore[operator]
    if memory_gib is not None:
        mem = memory_gib * GiB
        out["memory_gib"] = memory_gib
        out["max_concurrent_sequences"] = max_concurrent_sequences(mem, per_seq)
        if not shape.num_sliding_layers:
            nb = num_gpu_blocks(mem, shape, block_size, kv_dtype, tp)
            out["block_size"] = block_size
            out["num_gpu_blocks"] = nb
            out["kv_cache_size_tokens"] = nb * block_size
            out["max_concurrency_vllm"] = nb / math.ceil(context / block_size)
    return out
