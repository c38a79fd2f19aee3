"""A minimal Llama forward pass in torch, used only to train the tiny model briefly before vLLM serves it.

It mirrors HF/vLLM Llama (RMSNorm, rotate-half RoPE, GQA, SwiGLU) so trained weights mean the same thing
when vLLM loads them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TinyLlama(nn.Module):
    def __init__(self, shape) -> None:  # shape: kvscope.harness.model.tinymodel.TinyModelShape
        super().__init__()
        self.shape = shape
        h, i = shape.hidden_size, shape.intermediate_size
        q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
        self.embed = nn.Embedding(shape.vocab_size, h)
        self.layers = nn.ModuleList()
        for _ in range(shape.num_hidden_layers):
            layer = nn.ModuleDict(
                {
                    "q": nn.Linear(h, q, bias=False),
                    "k": nn.Linear(h, kv, bias=False),
                    "v": nn.Linear(h, kv, bias=False),
                    "o": nn.Linear(q, h, bias=False),
                    "gate": nn.Linear(h, i, bias=False),
                    "up": nn.Linear(h, i, bias=False),
                    "down": nn.Linear(i, h, bias=False),
                    "ln1": _RMSNorm(h, shape.rms_norm_eps),
                    "ln2": _RMSNorm(h, shape.rms_norm_eps),
                }
            )
            self.layers.append(layer)
        self.norm = _RMSNorm(h, shape.rms_norm_eps)
        self.lm_head = nn.Linear(h, shape.vocab_size, bias=False)

    _NAMES = {
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
    }

    def _hf_items(self):
        yield "model.embed_tokens.weight", self.embed.weight
        for n, layer in enumerate(self.layers):
            for short, long in self._NAMES.items():
                yield f"model.layers.{n}.{long}.weight", layer[short].weight
        yield "model.norm.weight", self.norm.weight
        if self.shape.tie_word_embeddings:
            return
        yield "lm_head.weight", self.lm_head.weight

    def load_numpy(self, tensors: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for name, param in self._hf_items():
                param.copy_(torch.from_numpy(tensors[name]))

    def export_numpy(self) -> dict[str, np.ndarray]:
        return {name: param.detach().float().numpy().copy() for name, param in self._hf_items()}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = self.shape
        b, t = ids.shape
        d = s.head_dim
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.embed(ids)
        rep = s.num_attention_heads // s.num_key_value_heads
        for layer in self.layers:
            hdn = layer["ln1"](x)
            q = layer["q"](hdn).view(b, t, s.num_attention_heads, d).transpose(1, 2)
            k = layer["k"](hdn).view(b, t, s.num_key_value_heads, d).transpose(1, 2)
            v = layer["v"](hdn).view(b, t, s.num_key_value_heads, d).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + layer["o"](att.transpose(1, 2).reshape(b, t, -1))
            hdn = layer["ln2"](x)
            x = x + layer["down"](torch.nn.functional.silu(layer["gate"](hdn)) * layer["up"](hdn))
        logits = self.lm_head(self.norm(x)) if not s.tie_word_embeddings else self.norm(x) @ self.embed.weight.T
        return logits
