"""Decode/prefill rooflines and the latency arithmetic of the seed documents.

The formulas live in :mod:`kvscope.harness.cachemodel.roofline` (the GPU step-cost model is built on them,
and the cache model is the lower layer); the primer keeps its names.
"""

from __future__ import annotations

from kvscope.harness.cachemodel.roofline import (decode_arithmetic_intensity, decode_tokens_per_s_upper_bound,
                                                 prefill_flops, request_latency_s)

__all__ = ["decode_tokens_per_s_upper_bound", "decode_arithmetic_intensity", "prefill_flops",
           "request_latency_s"]
