"""Decode/prefill rooflines and the latency arithmetic of the seed documents.

Decode reads every weight once per step for the whole batch, so its arithmetic intensity is about
``B`` FLOPs/byte in bf16 and tokens/s is bounded by ``B * bandwidth / bytes_read``.  Optionally the KV
cache read per step (``B * context * kv_bytes_per_token``) is added to the bytes.
"""

from __future__ import annotations


def decode_tokens_per_s_upper_bound(bandwidth_bytes_per_s: float, weight_bytes: float, batch: int = 1,
                                    kv_bytes_per_step: float = 0.0) -> float:
    """Aggregate tokens/s upper bound across ``batch`` sequences (weights + optional KV read)."""
    return batch * bandwidth_bytes_per_s / (weight_bytes + kv_bytes_per_step)


def decode_arithmetic_intensity(batch: int, bytes_per_param: float = 2.0) -> float:
    """FLOPs per byte in decode: ``2*N*B`` FLOPs over ``N*bytes_per_param`` bytes."""
    return 2.0 * batch / bytes_per_param


def prefill_flops(params: float, tokens: int) -> float:
    """About ``2 * params`` FLOPs per token."""
    return 2.0 * params * tokens


def request_latency_s(ttft_s: float, output_tokens: int, tpot_s: float) -> float:
    """Non-streamed latency ~ TTFT + output_tokens * TPOT."""
    return ttft_s + output_tokens * tpot_s
