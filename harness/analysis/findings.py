"""What the experiment found, in sentences with numbers: the executive summary, each page's findings, caveats.

Why this structure. A report that only shows tables leaves the reader to find the answer; here every question
the quickstart asks (what each history habit costs, how much load each configuration holds under the SLO,
whether speculative decoding pays, what the A/B verdicts say) is answered by one function that returns
:class:`Finding` s: a sentence, the numbers in it, an interval where one exists, and the page and figure that
hold the evidence. Numbers come from the same tables the pages show and from the verdict engine
(`ab.compare`), never recomputed differently here. Caveats are findings too (`question="caveat"`), generated
from the data, so a caveat that does not apply is not printed.

The findings themselves live with their page (`kvscope.harness.analysis.pages.<notebook>`), declared with
``@report_page`` and ``@caveat`` (`kvscope.harness.analysis.registry`, which finds the pages); this module is the
notebooks' entry point: :func:`page_findings` and :func:`write_page_findings`, which a notebook calls to show its
findings and write them to `findings.json` beside its figures; `index.html` reads those files.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvscope.harness.analysis.common import RESAMPLES
from kvscope.harness.analysis.registry import PageContext, caveats, report_pages
from kvscope.harness.results.findings_file import FINDINGS_NAME, Finding, FindingsFile, write_findings_file
from kvscope.harness.results.loaders import ExperimentResults


def _page_findings(res: ExperimentResults, notebook: str, resamples: int, computed: dict[str, Any]
                   ) -> tuple[list[Finding], PageContext]:
    pages = {p.notebook: p for p in report_pages() if p.findings is not None}
    page = pages.get(notebook)
    if page is None or page.findings is None:
        raise ValueError(f"no findings for notebook {notebook!r}; known: {', '.join(pages)}")
    ctx = PageContext(res, resamples, computed)
    return page.findings(ctx) + caveats(res, notebook), ctx


def page_findings(res: ExperimentResults, notebook: str, resamples: int = RESAMPLES, **computed: Any
                  ) -> list[Finding]:
    """The findings one analysis page opens with (and its caveats). ``computed``: what the page already computed,
    by name (the A/B page's ``ab=`` table, the explain page's ``explained=`` attributions), else computed here."""
    return _page_findings(res, notebook, resamples, computed)[0]


def findings_markdown(findings: Iterable[Finding]) -> str:
    """The markdown a page opens with: one bullet per finding, caveats last."""
    found = list(findings)
    lines = [f"- {f.sentence}" for f in found if f.question != "caveat"] or ["- Nothing to report on this data."]
    cav = [f"- *Caveat:* {f.sentence}" for f in found if f.question == "caveat"]
    return "**Findings**\n\n" + "\n".join(lines + cav)


def write_page_findings(res: ExperimentResults | None, notebook: str, figures_dir: Path,
                        resamples: int = RESAMPLES, **computed: Any) -> list[Finding]:
    """Compute a page's findings, write `findings.json` beside its figures (for index.html) and return them,
    with what the page adds to the file itself (its ``findings_extras``: the A/B page's verdicts)."""
    if res is None:
        return []
    found, ctx = _page_findings(res, notebook, resamples, computed)
    page = next(p for p in report_pages() if p.notebook == notebook)
    extras = page.findings_extras(ctx, Path(figures_dir)) if page.findings_extras is not None else {}
    write_findings_file(Path(figures_dir) / FINDINGS_NAME, FindingsFile(notebook=notebook, findings=found, **extras))
    return found
