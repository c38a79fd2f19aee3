"""The claims audit: every number a report states, recomputed from the raw records and compared.

Why. A sentence such as "no-prefix-cache holds load c2 (p90 158 ms)" is only true of the records it names; the
report used to compute such numbers over pools it did not name (three workloads behind one "c2", five load levels
behind one "fastest"). Every number the pages state now travels as a :class:`~kvscope.harness.results.selection.
Statement` (metric, value, selection) in its finding; this module recomputes each one from requests.parquet
(and summary.json for throughput) with nothing but the selection — an independent filter and a percentile —
and checks that the sentence writes that number (:func:`~kvscope.harness.analysis.common.stated`). A finding
that states a number it cannot back, or computed it over other records than it names, fails here.

Use: ``audit_experiment("results/quickstart/<run>")`` on any finished experiment directory; it audits the
report's own `findings.json` files when the report was rendered, else the findings computed now.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from kvscope.harness.analysis.capacity import mean_in_flight
from kvscope.harness.analysis.common import _ok_cells, selected_requests, stated
from kvscope.harness.pricing.cost import self_hosted_usd_per_1000_sessions
from kvscope.harness.results.findings_file import FINDINGS_NAME, Finding, load_findings_file
from kvscope.harness.results.goodput import meets_slo
from kvscope.harness.results.loaders import ExperimentResults, load_results
from kvscope.harness.results.selection import Statement

__all__ = ["AuditLine", "ClaimsAudit", "audit_experiment", "audit_findings", "recompute"]

#: How far a recomputed number may sit from the stated one (rounding in transit, float sums).
TOLERANCE = {"ttft_p50_s": 1e-6, "ttft_p90_s": 1e-6, "hit_rate": 1e-6, "slo_share": 1e-9,
             "output_throughput_change": 1e-6, "sessions_in_flight": 1e-6,
             "self_hosted_usd_per_1000_sessions": 1e-6, "hit_rate_gain_pp": 1e-6}


@dataclass(frozen=True)
class AuditLine:
    """One statement checked: where it was said, what, over which records, and what the records give."""

    notebook: str
    sentence: str
    metric: str
    selection: str
    stated_value: float
    recomputed: float
    written: bool  # the sentence writes the number as `common.stated` formats it

    @property
    def ok(self) -> bool:
        close = (math.isfinite(self.recomputed) and
                 abs(self.recomputed - self.stated_value) <= TOLERANCE[self.metric] * max(1.0, abs(self.recomputed)))
        return close and self.written

    def __str__(self) -> str:
        return (f"{self.notebook}: {self.metric} over {self.selection}: stated {self.stated_value:.6g}, records give "
                f"{self.recomputed:.6g}{'' if self.written else ' (number not in the sentence)'} — {self.sentence}")


@dataclass
class ClaimsAudit:
    """Every statement checked, and the findings with numbers but no statement (not auditable yet)."""

    lines: list[AuditLine] = field(default_factory=list)
    unaudited: list[Finding] = field(default_factory=list)

    @property
    def failures(self) -> list[AuditLine]:
        return [line for line in self.lines if not line.ok]

    def summary(self) -> str:
        head = (f"{len(self.lines)} statement(s) recomputed from the records, {len(self.failures)} wrong; "
                f"{len(self.unaudited)} finding(s) with numbers carry no statement")
        return "\n".join([head, *map(str, self.failures)])


def recompute(res: ExperimentResults, st: Statement) -> float:
    """A statement's number from the raw records of its selection alone."""
    r = selected_requests(res, st.selection)
    if st.metric == "output_throughput_change":
        return _throughput_change(res, st)
    if st.metric == "sessions_in_flight":
        return _sessions_in_flight(res, st)
    if st.metric == "self_hosted_usd_per_1000_sessions":
        return _self_hosted(res, st)
    if st.metric == "hit_rate_gain_pp":
        ref = st.selection.model_copy(update={"workloads": (st.reference_workload or "",)})
        return (_hit_rate(selected_requests(res, ref)) - _hit_rate(selected_requests(res, st.selection))) * 100
    if not len(r):
        return math.nan
    if st.metric in ("ttft_p50_s", "ttft_p90_s"):
        return float(np.percentile(r["ttft_s"].to_numpy(float), 50 if st.metric == "ttft_p50_s" else 90))
    if st.metric == "hit_rate":
        return _hit_rate(r)
    if st.metric == "slo_share":
        return float(meets_slo(r, st.slo_ttft_ms, st.slo_tpot_ms).mean())
    raise ValueError(f"unknown metric {st.metric!r}")


def _hit_rate(r) -> float:
    """Token-weighted: cached over prompt tokens of the requests ``r``."""
    prompt = float(r["prompt_tokens"].sum())
    return float(r["cached_tokens"].fillna(0).sum()) / prompt if prompt else math.nan


def _sessions_in_flight(res: ExperimentResults, st: Statement) -> float:
    """Mean sessions in flight (`capacity.mean_in_flight`) over every record of the selection, answered or not;
    one cell only (in-flight figures of several runs do not add up)."""
    sel = st.selection
    r = res.requests
    r = r[r["server"].astype(str).isin(sel.servers) & r["workload"].astype(str).isin(sel.workloads)
          & r["load"].astype(str).isin(sel.loads)]
    if not len(r) or r["cell"].nunique() != 1:
        return math.nan
    got = mean_in_flight(r["session_id"].tolist(), r["sent_s"].to_numpy(float), r["done_s"].to_numpy(float))
    return math.nan if got is None else got


def _self_hosted(res: ExperimentResults, st: Statement) -> float:
    """The machine's hourly price times each selected cell's duration (summary.json) over the sessions it
    completed (answered requests), per 1,000 sessions; the median over the cells (repeats)."""
    c = _ok_cells(res)
    sel = st.selection
    c = c[c["server"].astype(str).isin(sel.servers) & c["workload"].astype(str).isin(sel.workloads)
          & c["load"].astype(str).isin(sel.loads)]
    ok = res.ok_requests()
    per_cell = []
    for _, cell in c.iterrows():
        sessions = ok.loc[ok["cell"] == cell["cell"], "session_id"].nunique()
        if sessions and st.hourly_usd is not None and cell.get("duration_s"):
            per_cell.append(self_hosted_usd_per_1000_sessions(st.hourly_usd, float(cell["duration_s"]), sessions))
    return float(np.median(per_cell)) if per_cell else math.nan


def _throughput_change(res: ExperimentResults, st: Statement) -> float:
    """Median over the selection's (workload, load) of mean output tokens/s against the baseline's, less 1."""
    c = _ok_cells(res)
    sel = st.selection
    changes = []
    for workload in sel.workloads:
        for load in sel.loads:
            def mean(server: str, workload: str = workload, load: str = load) -> float:
                g = c[(c["server"].astype(str) == server) & (c["workload"].astype(str) == workload)
                      & (c["load"].astype(str) == load)]
                return float(g["output_tok_per_s"].mean()) if len(g) else math.nan
            b, a = mean(sel.servers[0]), mean(st.baseline or "")
            if math.isfinite(a) and math.isfinite(b) and a:
                changes.append(b / a - 1)
    return float(np.median(changes)) if changes else math.nan


def audit_findings(res: ExperimentResults, found: list[Finding]) -> ClaimsAudit:
    """Recompute every statement of ``found`` from ``res``'s records."""
    audit = ClaimsAudit()
    for f in found:
        if not f.statements:
            if f.question != "caveat" and any(v is not None for v in f.numbers.values()):
                audit.unaudited.append(f)
            continue
        for st in f.statements:
            try:
                value = recompute(res, st)
            except KeyError:  # the records lack a column the number needs: they cannot back it
                value = math.nan
            audit.lines.append(AuditLine(f.notebook, f.sentence, st.metric, st.selection.words(), st.value,
                                         value, stated(st) in f.sentence))
    return audit


def report_findings(res: ExperimentResults, resamples: int = 200) -> list[Finding]:
    """What the report states: its `findings.json` files where it was rendered, else every page's findings now,
    with the figure titles that state numbers."""
    files = sorted((res.root / "report" / "figures").glob(f"*/{FINDINGS_NAME}"))
    if files:
        found = [f for p in files for f in load_findings_file(p).findings]
    else:
        from kvscope.harness.analysis.findings import page_findings  # deferred: imports every page module
        from kvscope.harness.analysis.registry import report_pages

        found = [f for p in report_pages() if p.findings is not None
                 for f in page_findings(res, p.notebook, resamples)]
    return found + figure_titles(res)


def figure_titles(res: ExperimentResults) -> list[Finding]:
    """The figure titles that state a number, as findings (the notebooks draw these same texts)."""
    from kvscope.harness.analysis.pages.hit_rates import hit_rate_leader  # deferred: page modules are heavy
    from kvscope.harness.analysis.pages.latency import latency_ecdf_title

    return [f for f in (latency_ecdf_title(res), hit_rate_leader(res)) if f is not None]


def audit_experiment(experiment_dir: str | Path, resamples: int = 200) -> ClaimsAudit:
    """The claims audit of a finished experiment directory (see the module docstring)."""
    res = load_results(experiment_dir)
    return audit_findings(res, report_findings(res, resamples))
