"""What the experiment found, in sentences with numbers: the executive summary, each page's findings, caveats.

Why this structure. A report that only shows tables leaves the reader to find the answer; here every question
the quickstart asks (what each history habit costs, how much load each configuration holds under the SLO,
whether speculative decoding pays, what the A/B verdicts say) is answered by one function that returns
:class:`Finding` s: a sentence, the numbers in it, an interval where one exists, and the page and figure that
hold the evidence. Numbers come from the same tables the pages show and from the verdict engine
(`ab.compare`), never recomputed differently here. Caveats are findings too (`question="caveat"`), generated
from the data, so a caveat that does not apply is not printed.

The findings themselves live with their page (`kvscope.harness.analysis.pages.<notebook>`), registered with
``@page_findings_of`` and ``@caveat`` (`kvscope.harness.analysis.registry`); this module imports every page and
is the entry point: :func:`page_findings` and
:func:`write_page_findings`, which a notebook calls to show its findings and write them to `findings.json`
beside its figures; `index.html` reads those files (the report layer does not import this one).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import kvscope.harness.analysis.pages.ab_compare  # noqa: F401 - registers the page's findings
import kvscope.harness.analysis.pages.concurrency  # noqa: F401 - registers the page's findings
import kvscope.harness.analysis.pages.cost  # noqa: F401 - registers the page's findings
import kvscope.harness.analysis.pages.explain  # noqa: F401 - registers the page's findings
import kvscope.harness.analysis.pages.hit_rates  # noqa: F401 - registers the page's findings
import kvscope.harness.analysis.pages.latency  # noqa: F401 - registers the page's findings
import kvscope.harness.analysis.pages.speculative  # noqa: F401 - registers the page's findings
import pandas as pd
from kvscope.harness.analysis.common import RESAMPLES
from kvscope.harness.analysis.explain_experiment import WorkloadExplanation
from kvscope.harness.analysis.pages.ab_compare import PIVOT_METRICS
from kvscope.harness.analysis.registry import PAGE_FINDINGS, PageContext, caveats
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.results.findings_file import (
    FINDINGS_NAME,
    Finding,
    FindingsFile,
    VerdictCell,
    write_findings_file,
)
from kvscope.harness.results.loaders import ExperimentResults


def page_findings(res: ExperimentResults, notebook: str, resamples: int = RESAMPLES,
                  ab: pd.DataFrame | None = None, explained: list[WorkloadExplanation] | None = None
                  ) -> list[Finding]:
    """The findings one analysis page opens with (and its caveats). ``ab`` (the A/B table) and ``explained``
    (the per-workload attributions) are what the page already computed, where it did."""
    page = PAGE_FINDINGS.get(notebook)
    if page is None:
        raise ValueError(f"no findings for notebook {notebook!r}; known: {', '.join(PAGE_FINDINGS)}")
    found = page.compute(PageContext(res, resamples, ab, explained))
    return found + caveats(res, notebook)


def findings_markdown(findings: Iterable[Finding]) -> str:
    """The markdown a page opens with: one bullet per finding, caveats last."""
    found = list(findings)
    lines = [f"- {f.sentence}" for f in found if f.question != "caveat"] or ["- Nothing to report on this data."]
    cav = [f"- *Caveat:* {f.sentence}" for f in found if f.question == "caveat"]
    return "**Findings**\n\n" + "\n".join(lines + cav)


def write_page_findings(res: ExperimentResults | None, notebook: str, figures_dir: Path,
                        ab: pd.DataFrame | None = None, resamples: int = RESAMPLES,
                        explained: list[WorkloadExplanation] | None = None) -> list[Finding]:
    """Compute a page's findings, write `findings.json` beside its figures (for index.html) and return them.
    The A/B page also writes the full verdict table as CSV and the pivot into the file."""
    if res is None:
        return []
    found = page_findings(res, notebook, resamples, ab, explained)
    verdicts: list[VerdictCell] = []
    csv = None
    if notebook == "ab_compare" and ab is not None and len(ab):
        ab.to_csv(Path(figures_dir) / "verdicts.csv", index=False)
        csv = f"figures/{notebook}/verdicts.csv"
        t = ab[ab["metric"].isin(PIVOT_METRICS)]
        verdicts = [VerdictCell(pair=f"{r.A} → {r.B} · {r.workload} · {r.load}", metric=r.metric,
                                verdict=str(r.verdict), relative=nan_to_none(r.relative, float),
                                data_quality=str(getattr(r, "data_quality", "") or "") or None)
                    for r in t.itertuples()]
    write_findings_file(Path(figures_dir) / FINDINGS_NAME,
                        FindingsFile(notebook=notebook, findings=found, verdicts=verdicts, verdicts_csv=csv))
    return found
