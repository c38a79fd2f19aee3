"""Per-repeat statistics drawn from the noisy mock's latency model, without running it.

`tests.doubles.faultserver.LatencyNoise` gives each server start a run factor, each (start, session) a session
factor and each request a TTFT factor, all lognormal; `test_ab_calibration.py` replays 12 sessions x 3 requests
(4 output tokens each, all sessions at once) against TTFT 40 ms and token gaps 8 ms. This draws, for many
simulated experiments at once, what one such repeat's summary would say: its TTFT p50 and its output tokens/s
(output tokens over the span from the first send to the last completion, sessions running in parallel). The
sequential stopping rule's error rates need thousands of experiments with up to a dozen repeats each: too many
for real replays, cheap here; a few end-to-end runs against the mock itself check that the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MockNoise:
    """The mock's latency structure (the defaults: `test_ab_calibration.py`'s NOISE)."""

    ttft_s: float = 0.040
    itl_s: float = 0.008
    run_sigma: float = 0.04
    session_sigma: float = 0.06
    request_sigma: float = 0.12
    sessions: int = 12
    steps: int = 3
    output_tokens: int = 4


def draw_repeats(noise: MockNoise, experiments: int, repeats: int, rng: np.random.Generator,
                 ttft_effect: float = 1.0, throughput_effect: float = 1.0) -> dict[str, np.ndarray]:
    """{'ttft_p50_s', 'output_tokens_per_s'}: arrays (experiments, repeats), each repeat a fresh server start."""
    shape = (experiments, repeats)
    run = rng.normal(0.0, noise.run_sigma, size=shape)[..., None, None]
    session = rng.normal(0.0, noise.session_sigma, size=(*shape, noise.sessions))[..., None]
    request = rng.normal(0.0, noise.request_sigma, size=(*shape, noise.sessions, noise.steps))
    shared = np.exp(run + session)
    ttft = noise.ttft_s * shared * np.exp(request)
    itl = noise.itl_s * shared * np.ones_like(request)
    n = noise.output_tokens
    if throughput_effect != 1.0 and n > 1:  # as LatencyNoise.delays: the whole response stretched
        total = (ttft + (n - 1) * itl) / throughput_effect
        ttft = ttft * ttft_effect
        itl = np.maximum(0.0, total - ttft) / (n - 1)
    else:
        ttft = ttft * ttft_effect
    e2e = ttft + (n - 1) * itl
    span = e2e.sum(axis=3).max(axis=2)  # sessions in parallel, each one's requests back to back
    flat = ttft.reshape(*shape, -1)
    return {"ttft_p50_s": np.quantile(flat, 0.5, axis=2, method="inverted_cdf"),
            "output_tokens_per_s": noise.sessions * noise.steps * n / span}


@dataclass(frozen=True)
class RuleRates:
    """What a stopping rule did over many simulated experiments."""

    experiments: int
    called: dict[str, float]  # share called better or worse, per metric
    worse: dict[str, float]  # share called worse, per metric
    any_called: float  # share with any metric called better or worse
    mean_repeats: float
    stopped_early: float  # share that stopped before max


METRICS = ("ttft_p50_s", "output_tokens_per_s")


def simulate_rule(rule, experiments: int, seed: int = 0, noise: MockNoise = MockNoise(), ttft_effect: float = 1.0,
                  throughput_effect: float = 1.0, metrics: tuple[str, ...] = METRICS) -> RuleRates:
    """Run `rule` (a `SequentialRule`) over `experiments` simulated A/B experiments of up to `rule.max_repeats`
    interleaved repeats each: A without effect, B with the given effects (1.0 and 1.0: an A/A experiment)."""
    from kvscope.harness.analysis.sequential import run_sequence

    rng = np.random.default_rng(seed)
    a = draw_repeats(noise, experiments, rule.max_repeats, rng)
    b = draw_repeats(noise, experiments, rule.max_repeats, rng, ttft_effect, throughput_effect)
    called = {m: 0 for m in metrics}
    worse = {m: 0 for m in metrics}
    any_called = early = 0
    repeats = []
    for i in range(experiments):
        out = run_sequence(metrics, {m: a[m][i] for m in metrics}, {m: b[m][i] for m in metrics}, rule)
        words = {m: out.verdicts[m].word for m in metrics}
        for m, w in words.items():
            called[m] += w in ("better", "worse")
            worse[m] += w == "worse"
        any_called += any(w in ("better", "worse") for w in words.values())
        early += out.stopped_early
        repeats.append(out.repeats)
    n = experiments
    return RuleRates(n, {m: c / n for m, c in called.items()}, {m: c / n for m, c in worse.items()}, any_called / n,
                     float(np.mean(repeats)), early / n)
