"""The explain page (notebooks/explain.ipynb): the cache-break attribution page's findings (its tables are `analysis.explain_experiment`)."""

from __future__ import annotations

from kvscope.harness.analysis.claims import eviction_claim, tag
from kvscope.harness.analysis.explain_experiment import explain_findings, explained_workloads
from kvscope.harness.analysis.registry import PageContext, report_page
from kvscope.harness.results.findings_file import Finding


# One attribution per workload trace, not per cell: cheap (a few simulator passes over each trace).
@report_page("explain", "Explain: why each prompt missed the prefix cache", order=70,
             questions=("habit", "cache_break"),
             figures=("recomputed_by_cause", "what_if_hit_rate"), key_figures=("recomputed_by_cause",),
             relative_cost=0.5)
def _explain_page(ctx: PageContext) -> list[Finding]:
    """The attribution's findings; a sentence naming eviction as a workload's costliest cause carries the
    eviction claim, and the claim itself is stated here as on the concurrency page (one computation)."""
    found = explain_findings(ctx.get("explained", lambda: explained_workloads(ctx.res)))
    claim = eviction_claim(ctx.res)
    if claim is None:
        return found
    found = [tag(f, claim) if "eviction" in f.sentence else f for f in found]
    return [*found, claim.finding("cache_break", "explain", "recomputed_by_cause")]
