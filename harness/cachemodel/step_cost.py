"""What the scheduler model asks of a step-cost model: one small protocol, two implementations.

* :class:`~.calibration.StepCostModel`: linear in a step's features, fitted on a real server (the CPU path,
  ``kvscope capacity --server``);
* :class:`~.roofline.RooflineStepCost`: from a GPU's datasheet and a model's ``config.json`` (``kvscope
  predict --gpu``).

Why a protocol and not a base class: the calibration is a frozen record that is written to and read from
files, the roofline a bundle of derived constants; they share only these three questions, and the scheduler
(:mod:`.scheduler`) needs nothing else.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class StepCost(Protocol):
    #: Frontend time per request (HTTP, tokenization) before it reaches the scheduler.
    request_overhead_s: float

    def step_s(self, tokens: int, seqs: int, context_tokens: float, prefill_pairs: float = 0.0,
               spec_seqs: int = 0, draft_tokens: int = 0) -> float:
        """Seconds of one engine step: ``tokens`` scheduled over ``seqs`` sequences, decodes attending
        ``context_tokens`` in all, prefill chunks attending ``prefill_pairs`` (query, key) pairs; of the
        decodes, ``spec_seqs`` verify ``draft_tokens`` drafts in all (speculative decoding; the drafts are
        also in ``tokens``; a step's verification overhead is paid once whatever ``spec_seqs`` is)."""
        ...

    def decode_run_s(self, seqs: int, context_tokens: float, steps: int) -> float:
        """Seconds of the ``steps`` pure decode steps that follow a decode step of ``seqs`` sequences at
        ``context_tokens``: step ``j`` (1-based) attends ``context_tokens + seqs * j``.  The scheduler's
        fast-forward asks this, so it must be cheap (closed form)."""
        ...

    def scaled(self, factor: float) -> StepCost:
        """Every per-step cost times ``factor`` (the per-request overhead unchanged)."""
        ...
