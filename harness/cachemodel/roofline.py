"""Rooflines: the seed documents' decode/prefill arithmetic, and a step-cost model of a GPU from first
principles (:class:`RooflineStepCost`).

Decode reads every weight once per step for the whole batch, so its arithmetic intensity is about ``B``
FLOPs/byte in bf16 and tokens/s is bounded by ``B * bandwidth / bytes_read``.  Optionally the KV cache read per
step (``B * context * kv_bytes_per_token``) is added to the bytes.  (These formulas used to live in
``primer.roofline``, which re-exports them: the step model below is built on the same arithmetic, so it lives
in the lowest layer that needs it.)

One engine step on one GPU of a tensor-parallel group (:class:`RooflineStepCost`):

* **compute** = ``2 x (active matmul params / TP)`` FLOPs per scheduled token, ``2 x vocab x hidden / TP``
  per sampled sequence (the ``lm_head`` runs only where a token is sampled), and ``4 x heads x head_dim x
  layers / TP`` per attended (query, key) pair: the prefill chunks' pairs and one per context token of each
  decode; at ``mfu`` of the dense peak for the weights' dtype;
* **memory** = the weights once per step (the input embedding is a lookup, not streamed; a MoE layer's
  experts by the share the step's tokens touch, ``1 - (1 - k/E)^tokens``), each decoding sequence's KV read,
  and the new tokens' KV written; at ``bandwidth_efficiency`` of the datasheet bandwidth;
* **communication** (TP > 1) = two all-reduces per layer (after attention, after the MLP) of the step's
  hidden states, ring all-reduce ``2 (TP-1)/TP x tokens x hidden x 2 bytes`` over the per-direction
  interconnect bandwidth, plus a fixed latency each; added, not overlapped (vLLM runs them in the stream);
* **step** = ``max(compute, memory) + step_overhead + communication``.

Why max and not a sum for a mixed (chunked-prefill) step: the GEMMs of the decodes and the prefill chunk are
one batched GEMM, which streams the weights once while computing; a step is bound by whichever is longer.
What it leaves out: attention kernels' own efficiency (same ``mfu``), sliding-window caps on the decode KV
read (a full read is charged: conservative), activation traffic, and CUDA-graph padding of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvscope.harness.cachemodel.gpus import Efficiency, GpuPreset
from kvscope.harness.cachemodel.kv_memory import dtype_bytes, kv_bytes_per_token
from kvscope.harness.cachemodel.model_config import ModelConfig, moe_expert_share_read

# -- the seed documents' arithmetic -------------------------------------------------------------------


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


# -- one engine step on a GPU ---------------------------------------------------------------------------

#: Activations (the all-reduced hidden states) travel in bf16.
ACTIVATION_BYTES = 2


@dataclass(frozen=True)
class RooflineStepCost:
    """Step cost of one GPU of a TP group, as constants derived once (:func:`roofline_step_cost`); implements
    :class:`~.step_cost.StepCost`.  All per-GPU figures."""

    #: Achieved FLOP/s (dense peak x mfu) and bytes/s (bandwidth x efficiency).
    flops_per_s: float
    bytes_per_s: float
    step_overhead_s: float
    flops_per_token: float
    flops_per_sampled_seq: float
    flops_per_attended_pair: float
    #: Weights streamed every step (dense part) and all experts' bytes (MoE; 0 for a dense model).
    dense_weight_bytes: float
    expert_weight_bytes: float
    num_experts: int
    experts_per_token: int
    kv_bytes_per_token: float
    #: TP all-reduces: count per step, bytes per token per all-reduce on the wire, interconnect bytes/s,
    #: fixed latency each.  ``allreduces_per_step`` 0 for TP 1.
    allreduces_per_step: int = 0
    allreduce_bytes_per_token: float = 0.0
    interconnect_bytes_per_s: float = math.inf
    allreduce_latency_s: float = 0.0
    request_overhead_s: float = 0.0
    #: Multiplies every step (an ensemble's noise draw, a what-if); 1 = as derived.
    factor: float = 1.0

    # -- the three parts ---------------------------------------------------------------------------------
    def compute_s(self, tokens: int, seqs: int, context_tokens: float, prefill_pairs: float = 0.0) -> float:
        return (tokens * self.flops_per_token + seqs * self.flops_per_sampled_seq
                + (prefill_pairs + context_tokens) * self.flops_per_attended_pair) / self.flops_per_s

    def memory_s(self, tokens: int, context_tokens: float) -> float:
        weights = self.dense_weight_bytes
        if self.expert_weight_bytes:
            share = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(tokens, 1)
            weights += self.expert_weight_bytes * share
        return (weights + (context_tokens + tokens) * self.kv_bytes_per_token) / self.bytes_per_s

    def comm_s(self, tokens: int) -> float:
        if not self.allreduces_per_step:
            return 0.0
        return self.allreduces_per_step * (self.allreduce_latency_s
                                           + tokens * self.allreduce_bytes_per_token / self.interconnect_bytes_per_s)

    # -- StepCost ----------------------------------------------------------------------------------------
    def step_s(self, tokens: int, seqs: int, context_tokens: float, prefill_pairs: float = 0.0,
               spec_seqs: int = 0, draft_tokens: int = 0) -> float:
        # drafts cost what any scheduled token costs here: on a GPU a verifying decode is one more query row
        return self.factor * (max(self.compute_s(tokens, seqs, context_tokens, prefill_pairs),
                                  self.memory_s(tokens, context_tokens))
                              + self.step_overhead_s + self.comm_s(tokens))

    def decode_run_s(self, seqs: int, context_tokens: float, steps: int) -> float:
        """Closed form of ``sum_{j=1..steps} step_s(seqs, seqs, context_tokens + seqs*j)``: compute and memory
        are both linear in ``j``, so their max changes side at most once."""
        if steps <= 0:
            return 0.0
        m = seqs
        A = self.compute_s(m, m, context_tokens)
        a = m * self.flops_per_attended_pair / self.flops_per_s
        B = self.memory_s(m, context_tokens)
        b = m * self.kv_bytes_per_token / self.bytes_per_s
        body = _sum_of_max(A, a, B, b, steps)
        return self.factor * (body + steps * (self.step_overhead_s + self.comm_s(m)))

    def scaled(self, factor: float) -> RooflineStepCost:
        return replace(self, factor=self.factor * factor)

    def decode_tokens_per_s(self, batch: int = 1, context_tokens: float = 0.0) -> float:
        """Aggregate tokens/s of a decode step of ``batch`` sequences at ``context_tokens`` each."""
        return batch / self.step_s(batch, batch, batch * context_tokens)


def _sum_linear(X: float, x: float, i0: int, i1: int) -> float:
    """``sum_{i=i0..i1} (X + x*i)`` (0 when empty)."""
    n = i1 - i0 + 1
    return 0.0 if n <= 0 else n * X + x * (i0 + i1) * n / 2


def _sum_of_max(A: float, a: float, B: float, b: float, n: int) -> float:
    """``sum_{i=1..n} max(A + a*i, B + b*i)``."""
    d0, dd = A - B, a - b  # compute - memory = d0 + dd*i
    if dd == 0:
        return _sum_linear(A, a, 1, n) if d0 >= 0 else _sum_linear(B, b, 1, n)
    root = -d0 / dd
    if dd > 0:  # compute wins from ceil(root) on
        k = min(max(math.ceil(root), 1), n + 1)
        return _sum_linear(B, b, 1, k - 1) + _sum_linear(A, a, k, n)
    k = min(max(math.floor(root), 0), n)  # compute wins up to floor(root)
    return _sum_linear(A, a, 1, k) + _sum_linear(B, b, k + 1, n)


def roofline_step_cost(gpu: GpuPreset, model: ModelConfig, *, tp: int = 1, weight_dtype: str | None = None,
                       kv_cache_dtype: str | None = None, efficiency: Efficiency | None = None,
                       request_overhead_s: float = 0.0) -> RooflineStepCost:
    """The step-cost constants of ``model`` on one ``gpu`` of a TP group of ``tp``; ``efficiency`` replaces the
    GPU's defaults (a user's calibration)."""
    model.check_tensor_parallel(tp)
    eff = efficiency or gpu.efficiency
    wdtype = weight_dtype or model.dtype
    wbytes = dtype_bytes(wdtype)
    h, L = model.hidden_size, model.num_layers
    expert_bytes = (L * model.num_experts * model.expert_params * wbytes / tp) if model.is_moe else 0.0
    input_embedding = model.vocab_size * h
    dense_bytes = (model.params_total - input_embedding) * wbytes / tp - expert_bytes
    if model.tie_word_embeddings:  # the tied table is also the lm_head: streamed every step
        dense_bytes += input_embedding * wbytes / tp
    interconnect = (gpu.interconnect_gb_s or 0) * 1e9
    return RooflineStepCost(
        flops_per_s=gpu.peak_flops(wdtype) * eff.mfu,
        bytes_per_s=(gpu.bandwidth_gb_s or 0) * 1e9 * eff.bandwidth_efficiency,
        step_overhead_s=eff.step_overhead_ms / 1e3,
        flops_per_token=2.0 * model.matmul_params_active / tp,
        flops_per_sampled_seq=2.0 * model.vocab_size * h / tp,
        flops_per_attended_pair=4.0 * model.num_attention_heads * model.head_dim * L / tp,
        dense_weight_bytes=dense_bytes,
        expert_weight_bytes=expert_bytes,
        num_experts=model.num_experts,
        experts_per_token=model.experts_per_token,
        kv_bytes_per_token=kv_bytes_per_token(model.shape(), kv_cache_dtype, tp),
        allreduces_per_step=2 * L if tp > 1 else 0,
        allreduce_bytes_per_token=2.0 * (tp - 1) / tp * h * ACTIVATION_BYTES,
        interconnect_bytes_per_s=interconnect if interconnect > 0 else math.inf,
        allreduce_latency_s=eff.allreduce_latency_us / 1e6,
        request_overhead_s=request_overhead_s,
    )


__all__ = [
    "RooflineStepCost",
    "decode_arithmetic_intensity",
    "decode_tokens_per_s_upper_bound",
    "moe_expert_share_read",
    "prefill_flops",
    "request_latency_s",
    "roofline_step_cost",
]
