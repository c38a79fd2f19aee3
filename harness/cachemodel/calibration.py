"""Per-step time of a vLLM engine as a linear cost model, fitted by least squares from timed requests.

Why linear: one engine step's wall time is, to first order, a fixed overhead (scheduling, sampling, Python),
plus a cost per scheduled token (the GEMMs), plus a cost per sequence in the batch, plus the attention.
Attention is two features, because it costs two different things:

* a *decoding* sequence reads its whole context once per token: memory-bound, linear in the context
  (``context_tokens``: the tokens attended by the step's decodes);
* a *prefill* chunk of ``n`` tokens after ``c`` computed ones attends ``n*(c + (n+1)/2)`` (query, key) pairs:
  compute-bound and quadratic in the chunk (``prefill_pairs``).

One feature for both (the context length, as before) cannot tell one 2,000-token prefill from seven
300-token ones: on the validation server (tiny model, vLLM CPU, 64 blocks) it gave both 83-85 ms, against
123 ms and about 62 ms measured, and a fit of R² 0.960 (median error 9.5 %); with the two, the same samples
fit with R² 0.994 (median error 2.6 %), and decode steps of 6 sequences at 1,000 tokens came out at 5.2 ms
against 5.7-6 ms seen in a concurrency-32 run.  Those features are what the scheduler model knows about a
step, so a model in them is all it can use; and a handful of timed requests (prefills of several lengths,
decodes at several batch sizes and two context lengths) determine the coefficients well.

One more coefficient, ``request_overhead_s``, is the frontend's time per request (HTTP, tokenization): it is
in every timed request once, whatever its number of steps, which is what separates it from the per-step
``base_s``.

A request's measured time is a *sum* of steps, and sums of linear steps are linear in summed features, so a
sample is ``(steps, tokens, sequence-steps, decode context, requests, prefill pairs) -> seconds`` and one fit
takes prefill (TTFT) and batch (send to last token of requests decoding together) samples alike.
A server that decodes speculatively (n-gram) adds two features: the steps in which some sequence verifies
drafts (``spec_steps``) and the draft tokens verified (``draft_tokens``).  Why not fold drafts into ``tokens``:
on vLLM CPU a decode step that verifies ``d`` drafts costs far more than ``d`` prefill tokens (the tiny model:
a plain step 4.3 ms, a verifying step 7.3-8.4 ms for 2-4 drafts, against 0.1-0.2 ms that the per-token cost
fitted on prefills adds), and most of that is per verifying *step* (rejection sampling, the proposer), not per
sequence: costed per verifying sequence, the tiny model's TPOT at concurrency 4 came out 33-57 % high where
concurrency 1 was within 12 % (benchmarks/README.md).
Both are fitted on the speculative server itself (``kvscope.harness.replay.calibrate``: its decode samples'
drafts come from the offline model on the tokens the server generated); a server without speculation has
both features 0 and both coefficients 0.

Coefficients are constrained non-negative (``scipy.optimize.nnls``): a negative per-token cost fitted from
noisy timings would make long prompts cheaper than short ones.

This module knows no HTTP: the measurement against a server is ``kvscope.harness.replay.calibrate``, which
writes the calibration file (``CalibrationFile`` in ``kvscope.harness.results.schemas``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Sequence
from statistics import median


#: A fit that explains less than this share of the timing variance is not predicted from (`kvscope capacity
#: --min-fit-r2`'s default, and an experiment sweep's prediction): a loaded host gives fits near or below 0.
MIN_FIT_R2 = 0.5


@dataclass(frozen=True)
class StepCostModel:
    """``step_s = base_s + per_token_s*tokens + per_seq_s*seqs + per_context_token_s*context_tokens
    + per_prefill_pair_s*prefill_pairs + per_spec_step_s*[spec_seqs > 0] + per_draft_token_s*draft_tokens``
    (context tokens: attended by the step's decodes; prefill pairs: the (query, key) pairs of its prefill
    chunks; spec seqs: its decodes that verify drafts, which cost once per step; draft tokens: the drafts they
    verify, also counted in ``tokens``)."""

    base_s: float = 0.01
    per_token_s: float = 2e-5
    per_seq_s: float = 5e-4
    #: Per token of context read by a decoding sequence.
    per_context_token_s: float = 0.0
    #: Frontend time per request (HTTP, tokenization) before it reaches the scheduler; not a step cost.
    request_overhead_s: float = 0.0
    #: Per (query, key) pair of a prefill chunk.
    per_prefill_pair_s: float = 0.0
    #: Per step in which some decoding sequence verifies drafts (speculative decoding), beyond its tokens.
    per_spec_step_s: float = 0.0
    #: Per draft token verified, beyond ``per_token_s``.
    per_draft_token_s: float = 0.0

    def step_s(self, tokens: int, seqs: int, context_tokens: float, prefill_pairs: float = 0.0,
               spec_seqs: int = 0, draft_tokens: int = 0) -> float:
        return (self.base_s + self.per_token_s * tokens + self.per_seq_s * seqs
                + self.per_context_token_s * context_tokens + self.per_prefill_pair_s * prefill_pairs
                + self.per_spec_step_s * (spec_seqs > 0) + self.per_draft_token_s * draft_tokens)

    def decode_run_s(self, seqs: int, context_tokens: float, steps: int) -> float:
        """``steps`` decode steps after one at ``context_tokens`` (:class:`~.step_cost.StepCost`): step j costs
        ``step_s(seqs, seqs, context_tokens) + per_context_token_s * seqs * j``."""
        return steps * self.step_s(seqs, seqs, context_tokens) + self.per_context_token_s * seqs * steps * (steps + 1) / 2

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def scaled(self, factor: float) -> StepCostModel:
        """Every per-step cost times ``factor`` (the frontend's per-request overhead unchanged)."""
        return StepCostModel(self.base_s * factor, self.per_token_s * factor, self.per_seq_s * factor,
                             self.per_context_token_s * factor, self.request_overhead_s,
                             self.per_prefill_pair_s * factor, self.per_spec_step_s * factor,
                             self.per_draft_token_s * factor)


@dataclass(frozen=True)
class TimingSample:
    """A measured duration that covers ``steps`` engine steps with these summed features."""

    steps: float
    tokens: float
    seq_steps: float
    #: Context tokens attended by decoding sequences, summed over the steps.
    context_tokens: float
    seconds: float
    kind: str = "prefill"
    #: Requests whose frontend overhead the duration includes (1 for a TTFT or a batch's send-to-last-token).
    requests: float = 0.0
    #: (query, key) pairs of the prefill chunks, summed over the steps.
    prefill_pairs: float = 0.0
    #: Steps in which some sequence verified drafts (speculative decoding).
    spec_steps: float = 0.0
    #: Draft tokens verified, summed over the steps (also in ``tokens``).
    draft_tokens: float = 0.0
    #: The measured shape when repeats of it differ in their features (a speculative server's decode batches:
    #: each answer drafts differently), so :func:`median_of_repeats` groups them by it; "" otherwise.
    shape: str = ""

    def features(self) -> list[float]:
        """In the order of :class:`StepCostModel`'s coefficients."""
        return [self.steps, self.tokens, self.seq_steps, self.context_tokens, self.requests, self.prefill_pairs,
                self.spec_steps, self.draft_tokens]


@dataclass(frozen=True)
class CostFit:
    model: StepCostModel
    r2: float
    #: Median of |predicted - measured| / measured over the samples.
    median_rel_error: float
    samples: int


def median_of_repeats(samples: Sequence[TimingSample]) -> list[TimingSample]:
    """One sample per measured shape (identical features), its time the median of the repeats: a single slow
    outlier (a stall of the host, a burst of the frontend) moves a median of three not at all.  Repeats of a
    named ``shape`` (whose features differ) keep the repeat of median time, features and all (the lower middle
    of an even count): a measured pair, as robust to one stall as the median."""
    groups: dict[tuple, list[TimingSample]] = {}
    for s in samples:
        groups.setdefault((s.kind, s.shape) if s.shape else (s.kind, *s.features()), []).append(s)
    out = []
    for g in groups.values():
        if g[0].shape:
            out.append(sorted(g, key=lambda x: x.seconds)[(len(g) - 1) // 2])
        else:
            out.append(replace(g[0], seconds=median(x.seconds for x in g)))
    return out


def timing_cv(samples: Sequence[TimingSample]) -> float | None:
    """The host's run-to-run timing noise, as a coefficient of variation: the robust spread (1.4826 x the
    median absolute log ratio) of each repeated shape's timings about the shape's median, pooled over the
    shapes, the median timing itself left out.  None when no shape was timed more than once.

    It sizes the scheduler model's ensemble noise (``scheduler.TimingNoise``).  On the validation server
    three rounds gave 0.11 for single prefills and 0.08 for decode batches; the ensemble's means moved
    little between 0.1 and 0.5 (benchmarks/README.md), so a rough figure is enough."""
    import numpy as np  # deferred: numpy is heavy, importing this module must not load it

    groups: dict[tuple, list[float]] = {}
    for s in samples:
        groups.setdefault((s.kind, *s.features()), []).append(s.seconds)
    devs: list[float] = []
    for times in groups.values():
        if len(times) < 2 or min(times) <= 0:
            continue
        t = np.asarray(times, float)
        ratio = np.abs(np.log(t / np.median(t)))
        if len(t) % 2:  # the median timing itself is 0 by construction
            ratio = np.delete(ratio, int(np.argmin(ratio)))
        devs.extend(ratio.tolist())
    return float(1.4826 * np.median(devs)) if devs else None


def fit_cost_model(samples: Sequence[TimingSample]) -> CostFit:
    """Non-negative least squares over the samples, each weighted by 1/seconds (relative error counts)."""
    import numpy as np  # deferred: numpy is heavy, importing this module must not load it
    from scipy.optimize import nnls  # deferred: scipy is heavy, importing this module must not load it

    if len(samples) < 6:
        raise ValueError(f"need at least 6 timing samples to fit the step costs, got {len(samples)}")
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


def prefill_pairs(chunk_tokens: int, computed_tokens: int) -> float:
    """(query, key) pairs a causal prefill chunk attends: each of its ``chunk_tokens`` queries sees the
    ``computed_tokens`` before the chunk and the chunk's tokens up to itself."""
    return chunk_tokens * (computed_tokens + (chunk_tokens + 1) / 2)


def prefill_sample(prompt_tokens: int, ttft_s: float, max_num_batched_tokens: int,
                   cached_tokens: int = 0) -> TimingSample:
    """A request sent alone: its TTFT is the prefill's chunks (each a step of at most the token budget)."""
    done = min(cached_tokens, prompt_tokens - 1)
    new = prompt_tokens - done
    steps = -(-new // max_num_batched_tokens)
    pairs = 0.0
    for _ in range(steps):
        chunk = min(max_num_batched_tokens, prompt_tokens - done)
        pairs += prefill_pairs(chunk, done)
        done += chunk
    return TimingSample(steps, new, steps, 0.0, ttft_s, "prefill", 1.0, pairs)


def batch_sample(batch: int, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                 seconds: float) -> TimingSample:
    """``batch`` identical-shape requests sent together, timed from send to the last token: one step prefills
    all their uncached tokens (and gives the first token), then ``output_tokens - 1`` decode steps; plus the
    frontend's time for one request."""
    cached = min(cached_tokens, prompt_tokens - 1)
    new = prompt_tokens - cached
    decode_steps = output_tokens - 1
    # decode step j (1..output_tokens-1) reads prompt_tokens + j tokens of context per sequence
    context = decode_steps * prompt_tokens + decode_steps * output_tokens / 2
    return TimingSample(1 + decode_steps, batch * (new + decode_steps), batch * (1 + decode_steps),
                        batch * context, seconds, "decode", 1.0, batch * prefill_pairs(new, cached))


def speculative_batch_sample(prompt_tokens: int, cached_tokens: int, drafted: Sequence[Sequence[int]],
                             context_tokens: Sequence[Sequence[float]], seconds: float, shape: str = "") -> TimingSample:
    """:func:`batch_sample` on a server that decodes speculatively: request i's decode steps verify
    ``drafted[i][j]`` drafts at ``context_tokens[i][j]`` tokens of context (the offline model's
    ``RequestSpeculation`` on the tokens the server generated), so requests of one batch take different
    numbers of steps; the batch takes as many as its longest request (all are prefilled in the first)."""
    batch = len(drafted)
    cached = min(cached_tokens, prompt_tokens - 1)
    new = prompt_tokens - cached
    n_steps = [len(d) for d in drafted]
    draft_tokens = float(sum(sum(int(x) for x in d) for d in drafted))
    # decode step j of the batch verifies if any of its requests drafted at its step j (all decode in lockstep)
    spec_steps = float(sum(1 for j in range(max(n_steps, default=0))
                           if any(j < len(d) and int(d[j]) > 0 for d in drafted)))
    context = float(sum(sum(float(c) for c in cs) for cs in context_tokens))
    return TimingSample(1 + max(n_steps, default=0), batch * new + sum(n_steps) + draft_tokens,
                        batch + sum(n_steps), context, seconds, "decode", 1.0,
                        batch * prefill_pairs(new, cached), spec_steps, draft_tokens, shape)
