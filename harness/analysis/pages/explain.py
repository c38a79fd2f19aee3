"""The explain page (notebooks/explain.ipynb): the cache-break attribution page's findings (its tables are `analysis.explain_experiment`)."""

from __future__ import annotations

from kvscope.harness.analysis.claims import eviction_claim, tag
from kvscope.harness.analysis.explain_experiment import explain_findings
from kvscope.harness.analysis.registry import PageContext, page_findings_of
from kvscope.harness.results.findings_file import Finding


@page_findings_of("explain", "habit", "cache_break")
def _explain_page(ctx: PageContext) -> list[Finding]:
    """The attribution's findings; a sentence naming eviction as a workload's costliest cause carries the
    eviction claim, and the claim itself is stated here as on the concurrency page (one computation)."""
    found = explain_findings(ctx.explanations())
    claim = eviction_claim(ctx.res)
    if claim is None:
        return found
    found = [tag(f, claim) if "eviction" in f.sentence else f for f in found]
    return [*found, claim.finding("cache_break", "explain", "recomputed_by_cause")]
