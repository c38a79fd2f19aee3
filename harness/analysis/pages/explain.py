"""The explain page (notebooks/explain.ipynb): the cache-break attribution page's findings (its tables are `analysis.explain_experiment`)."""

from __future__ import annotations

from kvscope.harness.analysis.explain_experiment import explain_findings
from kvscope.harness.analysis.registry import PageContext, page_findings_of
from kvscope.harness.results.findings_file import Finding


@page_findings_of("explain", "habit", "cache_break")
def _explain_page(ctx: PageContext) -> list[Finding]:
    return explain_findings(ctx.explanations())
