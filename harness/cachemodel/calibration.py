"""Per-step time of a vLLM engine as a linear cost model, fitted by least squares from timed requests.

Why linear: one engine step's wall time is, to first order, a fixed overhead (scheduling, sampling, Python),
plus a cost per scheduled token (the GEMMs), plus a cost per sequence in the batch, plus a cost per token of
context attended (attention reads every cached token of every scheduled sequence).  Those four features are
what the scheduler model knows about a step, so a model in them is all it can use; and a handful of timed
requests (prefills of several lengths, decodes at several batch sizes) determine four coefficients well.

A fifth coefficient, ``request_overhead_s``, is the frontend's time per request (HTTP, tokenization): it is
in every timed request once, whatever its number of steps, which is what separates it from the per-step
``base_s``.

A request's measured time is a *sum* of steps, and sums of linear steps are linear in summed features, so a
sample is ``(steps, tokens, sequence-steps, context tokens) -> seconds`` and one fit takes prefill (TTFT)
and batch (send to last token of requests decoding together) samples alike.  Coefficients are constrained non-negative (``scipy.optimize.nnls``):
a negative per-token cost fitted from noisy timings would make long prompts cheaper than short ones.

This module knows no HTTP: the measurement against a server is ``kvscope.harness.replay.calibrate``, which
writes the calibration file (``CalibrationFile`` in ``kvscope.harness.results.schemas``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence


#: A fit that explains less than this share of the timing variance is not predicted from (`kvscope capacity
#: --min-fit-r2`'s default, and an experiment sweep's prediction): a loaded host gives fits near or below 0.
MIN_FIT_R2 = 0.5


@dataclass(frozen=True)
class StepCostModel:
    """``step_s = base_s + per_token_s*tokens + per_seq_s*seqs + per_context_token_s*context_tokens``."""

    base_s: float = 0.01
    per_token_s: float = 2e-5
    per_seq_s: float = 5e-4
    per_context_token_s: float = 0.0
    #: Frontend time per request (HTTP, tokenization) before it reaches the scheduler; not a step cost.
    request_overhead_s: float = 0.0

    def step_s(self, tokens: int, seqs: int, context_tokens: int) -> float:
        return (self.base_s + self.per_token_s * tokens + self.per_seq_s * seqs
                + self.per_context_token_s * context_tokens)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def scaled(self, factor: float) -> StepCostModel:
        """Every per-step cost times ``factor`` (the frontend's per-request overhead unchanged)."""
        return StepCostModel(self.base_s * factor, self.per_token_s * factor, self.per_seq_s * factor,
                             self.per_context_token_s * factor, self.request_overhead_s)


@dataclass(frozen=True)
class TimingSample:
    """A measured duration that covers ``steps`` engine steps with these summed features."""

    steps: float
    tokens: float
    seq_steps: float
    context_tokens: float
    seconds: float
    kind: str = "prefill"
    #: Requests whose frontend overhead the duration includes (1 for a TTFT or a batch's send-to-last-token).
    requests: float = 0.0

    def features(self) -> list[float]:
        return [self.steps, self.tokens, self.seq_steps, self.context_tokens, self.requests]


@dataclass(frozen=True)
class CostFit:
    model: StepCostModel
    r2: float
    #: Median of |predicted - measured| / measured over the samples.
    median_rel_error: float
    samples: int


def fit_cost_model(samples: Sequence[TimingSample]) -> CostFit:
    """Non-negative least squares over the samples, each weighted by 1/seconds (relative error counts)."""
    import numpy as np
    from scipy.optimize import nnls

    if len(samples) < 5:
        raise ValueError(f"need at least 5 timing samples to fit 5 coefficients, got {len(samples)}")
    X = np.array([s.features() for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-6)
    scale = np.maximum(np.abs(X).max(axis=0), 1e-12)  # column scaling keeps nnls well conditioned
    coef, _ = nnls((X / scale) * w[:, None], y * w)
    coef = coef / scale
    pred = X @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    model = StepCostModel(*(float(c) for c in coef))
    return CostFit(model, 1.0 - ss_res / ss_tot, float(np.median(rel)), len(samples))


def prefill_sample(prompt_tokens: int, ttft_s: float, max_num_batched_tokens: int,
                   cached_tokens: int = 0) -> TimingSample:
    """A request sent alone: its TTFT is the prefill's chunks (each a step of at most the token budget)."""
    new = max(prompt_tokens - cached_tokens, 1)
    steps = -(-new // max_num_batched_tokens)
    ctx = 0.0
    done = cached_tokens
    for _ in range(steps):
        chunk = min(max_num_batched_tokens, prompt_tokens - done)
        done += chunk
        ctx += done
    return TimingSample(steps, new, steps, ctx, ttft_s, "prefill", 1.0)


def batch_sample(batch: int, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                 seconds: float) -> TimingSample:
    """``batch`` identical-shape requests sent together, timed from send to the last token: one step prefills
    all their uncached tokens (and gives the first token), then ``output_tokens - 1`` decode steps; plus the
    frontend's time for one request."""
    new = max(prompt_tokens - cached_tokens, 1)
    decode_steps = output_tokens - 1
    return TimingSample(1 + decode_steps, batch * (new + decode_steps), batch * (1 + decode_steps),
                        batch * (prompt_tokens + decode_steps * (prompt_tokens + output_tokens / 2)), seconds,
                        "decode", 1.0)
