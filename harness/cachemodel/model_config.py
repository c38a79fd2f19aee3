"""A model's architecture as the step-cost model needs it, read from a Hugging Face ``config.json``.

Why config.json: it is the one description every model on the hub ships, and it holds every figure that
decides serving cost (layers, hidden and intermediate sizes, attention and KV heads, head dim, vocabulary,
experts, sliding windows); the parameter count follows from them, so no hub access and no weights are needed.
Bundled configs of popular models live in ``model_configs/`` (``--model llama-3.1-8b``); any local
``config.json`` (or a directory holding one) works the same (``--model path/to/config.json``).

The KV-cache side (bytes per token, sliding-window caps) stays in :mod:`.kv_memory` (:meth:`ModelConfig.shape`
hands it a :class:`~.kv_memory.ModelShape`): one formula, one place.

Parameter count (LLaMA-family decoder: Llama, Mistral, Mixtral, Qwen2, CodeLlama): embeddings ``V*h`` (and as
many for an untied ``lm_head``); per layer the q/k/v/o projections ``h*(H*d) + 2*h*(K*d) + (H*d)*h`` (plus
q/k/v biases for Qwen2), the gated MLP ``3*h*I`` per expert (``E`` experts and an ``h*E`` router for a MoE),
two RMSNorms; one final norm.  A MoE token runs ``experts_per_token`` of the ``E`` experts: *active*
parameters count those only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from kvscope.harness.cachemodel.kv_memory import ModelShape, dtype_bytes, shape_from_hf_config

MODEL_CONFIGS_DIR = Path(__file__).with_name("model_configs")

#: config.json fields the parameter count cannot do without.
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


class ModelConfig(BaseModel):
    """The serving-relevant architecture of one decoder-only model."""

    name: str
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool = False
    #: q/k/v projections carry biases (Qwen2).
    qkv_bias: bool = False
    #: Experts per MoE layer (1: a dense model) and experts each token runs.
    num_experts: int = Field(1, gt=0)
    experts_per_token: int = Field(1, gt=0)
    dtype: str = "bfloat16"
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    max_position_embeddings: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def embedding_params(self) -> int:
        """Input embedding table plus an untied ``lm_head``."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def attention_params_per_layer(self) -> int:
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)

    @property
    def expert_params(self) -> int:
        """One expert's gated MLP (the dense MLP for a dense model)."""
        return 3 * self.hidden_size * self.intermediate_size

    def _per_layer(self, experts: int) -> int:
        router = self.hidden_size * self.num_experts if self.is_moe else 0
        return self.attention_params_per_layer + experts * self.expert_params + router + 2 * self.hidden_size

    @property
    def params_total(self) -> int:
        return self.embedding_params + self.num_layers * self._per_layer(self.num_experts) + self.hidden_size

    @property
    def params_active(self) -> int:
        """Parameters one token runs through (MoE: ``experts_per_token`` experts; dense: all)."""
        return self.embedding_params + self.num_layers * self._per_layer(self.experts_per_token) + self.hidden_size

    @property
    def matmul_params_active(self) -> int:
        """Active parameters a token multiplies by: the layers' (the input embedding is a lookup and the
        ``lm_head`` runs only for sampled positions, so both are counted apart)."""
        return self.num_layers * self._per_layer(self.experts_per_token)

    def weight_bytes(self, weight_dtype: str | None = None) -> float:
        """Every parameter's bytes (what a GPU holds, over TP ranks)."""
        return self.params_total * dtype_bytes(weight_dtype or self.dtype)

    def shape(self) -> ModelShape:
        """The attention shape :mod:`.kv_memory` computes KV bytes from."""
        return ModelShape(name=self.name, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                          head_dim=self.head_dim, num_attention_heads=self.num_attention_heads,
                          params=float(self.params_total), dtype=self.dtype, sliding_window=self.sliding_window,
                          num_sliding_layers=self.num_sliding_layers)

    def check_tensor_parallel(self, tp: int) -> None:
        """vLLM's rule: attention heads split evenly over TP ranks; KV heads split evenly, or (TP above them)
        are replicated an integer number of times."""
        if tp < 1:
            raise ValueError(f"tensor parallel size {tp}: must be 1 or more")
        if self.num_attention_heads % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {self.name}'s "
                             f"{self.num_attention_heads} attention heads")
        kv = self.num_kv_heads
        if (kv % tp) if kv >= tp else (tp % kv):
            raise ValueError(f"tensor parallel size {tp} does not divide {self.name}'s {kv} KV heads "
                             f"(nor is a multiple of them)")

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "params_total": self.params_total, "params_active": self.params_active,
                "num_layers": self.num_layers, "num_attention_heads": self.num_attention_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
                "num_experts": self.num_experts, "experts_per_token": self.experts_per_token,
                "sliding_window": self.sliding_window, "num_sliding_layers": self.num_sliding_layers,
                "dtype": self.dtype}


def bundled_models() -> list[str]:
    """Names of the bundled configs (``--model NAME``)."""
    return sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.json"))


def model_config_from_hf(cfg: dict[str, Any], name: str, source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a parsed ``config.json``; ValueError naming the first missing field."""
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    missing = [f for f in REQUIRED_FIELDS if cfg.get(f) in (None, "")]
    if missing:
        raise ValueError(f"{source}: missing field {missing[0]!r} (needed for the parameter count; "
                         f"required: {', '.join(REQUIRED_FIELDS)})")
    try:
        shape = shape_from_hf_config(cfg, name=name)
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 1)
        return ModelConfig(
            name=name, hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
            num_layers=shape.num_layers, num_attention_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
            num_experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok") or 1) if experts > 1 else 1,
            dtype=shape.dtype, sliding_window=shape.sliding_window, num_sliding_layers=shape.num_sliding_layers,
            max_position_embeddings=cfg.get("max_position_embeddings"))
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"{source}: {exc}") from None


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """A bundled model by name (``llama-3.1-8b``), or a local ``config.json`` / directory holding one."""
    key = str(name_or_path)
    bundled = MODEL_CONFIGS_DIR / f"{key.lower()}.json"
    if bundled.exists() and not Path(key).exists():
        return model_config_from_hf(json.loads(bundled.read_text()), key.lower(), f"bundled {bundled.name}")
    path = Path(key)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(f"unknown model {key!r}: neither a bundled model ({', '.join(bundled_models())}) "
                         "nor a config.json file")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable config.json ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a config.json holds a JSON object, got {type(cfg).__name__}")
    name = path.parent.name if path.name == "config.json" else path.stem
    return model_config_from_hf(cfg, name or "model", str(path))


def moe_expert_share_read(cfg: ModelConfig, tokens: int) -> float:
    """Expected share of a MoE layer's experts that ``tokens`` tokens touch (each picks ``experts_per_token``
    of ``num_experts`` uniformly): ``1 - (1 - k/E)^tokens``; what a step reads of the expert weights."""
    if not cfg.is_moe:
        return 1.0
    return 1.0 - (1.0 - cfg.experts_per_token / cfg.num_experts) ** max(tokens, 1)


__all__ = ["ModelConfig", "MODEL_CONFIGS_DIR", "bundled_models", "load_model_config", "model_config_from_hf",
           "moe_expert_share_read"]
