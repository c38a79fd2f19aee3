"""The findings registry: each report page registers the function that computes its findings, each caveat
registers with the page it is shown on.

Why a registry: a page's findings, its caveats and its questions used to be an if/elif dispatcher plus three
parallel tables in one module, so a new finding touched four places. Now ``@page_findings_of("cost", "cost")``
beside the page's own tables (`kvscope.harness.analysis.pages.<page>`) and ``@caveat("burst", "latency")``
beside the condition it checks are the one registration; `kvscope.harness.analysis.findings` imports the pages
and runs what is registered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
from kvscope.harness.analysis.claims import Claim
from kvscope.harness.analysis.common import RESAMPLES
from kvscope.harness.analysis.explain_experiment import WorkloadExplanation, explained_workloads
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults


def caveats(res: ExperimentResults, notebook: str | None = None) -> list[Finding]:
    """The conditions that limit what the numbers mean, each only where the data shows it; ``notebook``: only
    that page's caveats are checked (some read costly intermediates, such as the eviction claim)."""
    out: list[Finding] = []
    for (page, fn) in _CAVEATS.values():
        if notebook is not None and page != notebook:
            continue
        f = fn(res)
        if isinstance(f, Claim):
            out.append(f.finding("caveat", page))
        elif f is not None:
            out.append(Finding(question="caveat", sentence=f[0], numbers=f[1], notebook=page))
    return out


#: A caveat returns (sentence, numbers), or a :class:`~kvscope.harness.analysis.claims.Claim` where the caveat
#: states a quantity other pages state too (eviction), or None where the condition does not hold.
_CaveatFn = Callable[[ExperimentResults], "tuple[str, dict[str, float | None]] | Claim | None"]


_CAVEATS: dict[str, tuple[str, _CaveatFn]] = {}


def caveat(name: str, notebook: str) -> Callable[[_CaveatFn], _CaveatFn]:
    """Register a caveat under its name with the page it is shown on: the function returns (sentence, numbers)
    where the data shows the condition, else None. Caveats are listed in registration order."""
    def register(fn: _CaveatFn) -> _CaveatFn:
        if name in _CAVEATS:
            raise ValueError(f"caveat {name!r} is already registered")
        _CAVEATS[name] = (notebook, fn)
        return fn
    return register


@dataclass
class PageContext:
    """What a page's findings are computed from: the results, and what the page already computed (the A/B
    table: `pages.ab_compare.page_ab_table`; the per-workload attributions), else computed once when asked."""

    res: ExperimentResults
    resamples: int = RESAMPLES
    ab: pd.DataFrame | None = None
    explained: list[WorkloadExplanation] | None = None

    def explanations(self) -> list[WorkloadExplanation]:
        if self.explained is None:
            self.explained = explained_workloads(self.res)
        return self.explained


@dataclass(frozen=True)
class PageFindings:
    """One page's findings: the notebook they open, the questions they answer, and how they are computed."""

    notebook: str
    questions: tuple[str, ...]
    compute: Callable[[PageContext], list[Finding]]


#: notebook -> its findings, registered with ``@page_findings_of`` beside the page's finding functions.
PAGE_FINDINGS: dict[str, PageFindings] = {}


def page_findings_of(notebook: str, *questions: str
                     ) -> Callable[[Callable[[PageContext], list[Finding]]], Callable[[PageContext], list[Finding]]]:
    """Register the function that computes a page's findings (its caveats are added by `page_findings`)."""
    def register(fn: Callable[[PageContext], list[Finding]]) -> Callable[[PageContext], list[Finding]]:
        if notebook in PAGE_FINDINGS:
            raise ValueError(f"findings of notebook {notebook!r} are already registered")
        PAGE_FINDINGS[notebook] = PageFindings(notebook, questions, fn)
        return fn
    return register
