"""The page registry: each report page declares itself once, in its own module, and everything that needs the
page (the report runner, the findings, the caveats) reads that declaration.

Why a registry: a page used to be four entries keyed by the same name in two layers (the notebook, an entry in
the report's notebook list, the page module's findings, an import line in `analysis.findings`), plus special
cases for one page in the findings writer. Now the page module ``analysis/pages/<notebook>.py`` is the one
registration: ``@report_page(...)`` on the function that computes its findings (``register_page`` for a page
without findings) declares its notebook, title, order, figures, parameters and what it needs from the spec;
:func:`report_pages` finds every module of the package (``pkgutil``), so a new page is its notebook plus its page
module. ``@caveat("burst", "latency")`` beside the condition it checks adds a caveat to a page.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvscope.harness.analysis.claims import Claim
from kvscope.harness.analysis.common import RESAMPLES
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import ExperimentSpecCore

T = TypeVar("T")


def caveats(res: ExperimentResults, notebook: str | None = None) -> list[Finding]:
    """The conditions that limit what the numbers mean, each only where the data shows it; ``notebook``: only
    that page's caveats are checked (some read costly intermediates, such as the eviction claim). Every page
    module is imported first, so the caveats they register are all there whoever asks."""
    report_pages()
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
    """What a page's findings are computed from: the results, and what the page's notebook already computed
    (``computed``: the keyword arguments it passed to `findings.write_page_findings`, e.g. ``ab=`` the A/B table),
    else computed once when a finding asks (:meth:`get`)."""

    res: ExperimentResults
    resamples: int = RESAMPLES
    computed: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, compute: Callable[[], T]) -> T:
        """``computed[name]``, computed by ``compute()`` and kept the first time it is asked for (or was None)."""
        if self.computed.get(name) is None:
            self.computed[name] = compute()
        return self.computed[name]


SpecParameters = Callable[[ExperimentSpecCore], dict[str, Any]]
"""From an experiment's validated spec (as experiment.json records it, defaults included) to a notebook's
parameters."""

COMMON_PARAMETERS = ("experiment_dir", "figures_dir")
"""Every notebook accepts these; the report runner sets them."""

FindingsFn = Callable[[PageContext], list[Finding]]
#: Extra fields of the page's `findings.json` (besides its findings) and the files beside it, written into
#: ``figures_dir``: the A/B page's verdict table.
FindingsExtrasFn = Callable[[PageContext, Path], dict[str, Any]]


def _no_spec_parameters(spec: ExperimentSpecCore) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ReportPage:
    """One report page: ``notebooks/<notebook>.ipynb`` with its page module ``analysis/pages/<notebook>.py``.

    ``order`` places it in the report (pages run and are listed by it); ``figures`` are the ``<figures_dir>/
    <figure>.png`` its notebook writes, ``key_figures`` those the report's index shows; ``parameters`` the ones it
    accepts besides :data:`COMMON_PARAMETERS`, ``from_spec`` those an experiment's spec gives it (its SLOs, its
    pricing); ``relative_cost`` its execution time against a typical page's (the report starts costly ones
    first). ``questions`` are the questions its findings answer, ``findings`` computes them, and
    ``findings_extras`` adds to its `findings.json` what only this page writes.
    ``tests/test_notebook_registry.py`` checks every page against its ``.ipynb`` (title, parameters, figures)."""

    notebook: str
    title: str
    order: int
    figures: tuple[str, ...]
    parameters: tuple[str, ...] = ()
    key_figures: tuple[str, ...] = ()
    from_spec: SpecParameters = field(default=_no_spec_parameters, compare=False)
    relative_cost: float = 1.0
    questions: tuple[str, ...] = ()
    findings: FindingsFn | None = field(default=None, compare=False)
    findings_extras: FindingsExtrasFn | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.notebook

    def accepts(self, parameter: str) -> bool:
        return parameter in COMMON_PARAMETERS or parameter in self.parameters


#: notebook -> its page, registered by its module under `analysis/pages/` (:func:`report_pages` imports them).
PAGES: dict[str, ReportPage] = {}

PAGES_PACKAGE = "kvscope.harness.analysis.pages"


def register_page(page: ReportPage) -> ReportPage:
    """Register one page (a page module calls it once, directly or through :func:`report_page`)."""
    if page.notebook in PAGES:
        raise ValueError(f"report page {page.notebook!r} is already registered")
    PAGES[page.notebook] = page
    return page


def report_page(notebook: str, title: str, *, order: int, figures: tuple[str, ...], questions: tuple[str, ...],
                **declared: Any) -> Callable[[FindingsFn], FindingsFn]:
    """Declare a page on the function that computes its findings (its caveats are added by
    `findings.page_findings`); ``declared``: the other :class:`ReportPage` fields."""
    def register(fn: FindingsFn) -> FindingsFn:
        register_page(ReportPage(notebook, title, order, figures, questions=questions, findings=fn, **declared))
        return fn
    return register


def report_pages(package: str = PAGES_PACKAGE) -> tuple[ReportPage, ...]:
    """Every page, in report order: each module of ``package`` is imported (modules register themselves once;
    imported modules are cached, so later calls only list the package)."""
    pkg = importlib.import_module(package)
    for module in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{module.name}")
    return tuple(sorted(PAGES.values(), key=lambda p: (p.order, p.notebook)))
