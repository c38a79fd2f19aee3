"""The speculative page (notebooks/speculative.ipynb): speculative decoding: acceptance, its speed-up, the primer's prediction, sample outputs."""

from __future__ import annotations

import math

import pandas as pd
from kvscope.harness.analysis.claims import speculative_claims, speculative_recommendation
from kvscope.harness.analysis.common import _change_words
from kvscope.harness.analysis.pages.ab_compare import ab_table, page_ab_table
from kvscope.harness.analysis.registry import PageContext, caveat, report_page
from kvscope.harness.primer.speculative import expected_tokens_per_pass
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import ServerEntry
from kvscope.workloads.trace import Trace


def speculative_table(res: ExperimentResults) -> pd.DataFrame:
    """Acceptance per speculative cell and the TPOT / throughput change against the matching baseline.

    The baseline of a speculative cell is the non-speculative server with the same prefix-caching setting,
    same workload, load and repeat.
    """
    c = res.cells
    if not len(c) or "speculative" not in c:
        return pd.DataFrame()
    spec = c[c["speculative"] == True]
    base = c[c["speculative"] != True]
    rows = []
    for _, s in spec.iterrows():
        match = base[(base["workload"] == s["workload"]) & (base["load"] == s["load"]) &
                     (base["repeat"] == s["repeat"]) & (base["prefix_caching"] == s["prefix_caching"])]
        b = match.iloc[0] if len(match) else None
        row = {"cell": s["cell"], "server": s["server"], "workload": s["workload"], "load": s["load"],
               "acceptance_rate": s.get("spec_acceptance_rate"),
               "mean_acceptance_length": s.get("spec_mean_acceptance_length"),
               "tpot_p50_ms": s["tpot_p50_s"] * 1000 if s.get("tpot_p50_s") is not None else None,
               "baseline": None if b is None else b["server"],
               "baseline_tpot_p50_ms": None if b is None else b["tpot_p50_s"] * 1000,
               "e2e_p50_ms": s["e2e_p50_s"] * 1000 if s.get("e2e_p50_s") is not None else None,
               "baseline_e2e_p50_ms": None if b is None else b["e2e_p50_s"] * 1000,
               "output_tok_per_s": s["output_tok_per_s"],
               "baseline_output_tok_per_s": None if b is None else b["output_tok_per_s"]}
        if b is not None:
            row["tpot_change"] = s["tpot_p50_s"] / b["tpot_p50_s"] - 1 if b["tpot_p50_s"] else None
            row["e2e_change"] = s["e2e_p50_s"] / b["e2e_p50_s"] - 1 if b["e2e_p50_s"] else None
            row["throughput_change"] = s["output_tok_per_s"] / b["output_tok_per_s"] - 1 if b["output_tok_per_s"] else None
        rows.append(row)
    return pd.DataFrame(rows)


def acceptance_by_position(res: ExperimentResults) -> pd.DataFrame:
    rows = []
    for cell, s in res.summaries.items():
        positions = s.speculative.acceptance_by_position if s.speculative else None
        for i, a in enumerate(positions or []):
            meta = res.cells.set_index("cell").loc[cell]
            rows.append({"cell": cell, "server": meta["server"], "workload": meta["workload"], "position": i,
                         "acceptance": a})
    return pd.DataFrame(rows)


def workload_character(res: ExperimentResults) -> pd.DataFrame:
    """Share of each workload's prompt that is tool output (echo-friendly for n-gram drafts) vs free text."""
    rows = []
    for workload in sorted(set(res.cells["workload"].dropna())):
        tdir = res.trace_dir(workload)
        if tdir is None or not tdir.exists():
            continue
        tr = Trace.read(tdir)
        kinds = pd.Series(tr.seg_kinds)
        lengths = pd.Series(tr.segment_lengths())
        share = lengths.groupby(kinds).sum() / lengths.sum()
        rows.append({"workload": workload, **{f"share_{k}": float(v) for k, v in share.items()}})
    return pd.DataFrame(rows)


def speculation_vs_primer(res: ExperimentResults) -> pd.DataFrame:
    """The primer's expected tokens per target pass against the server's measured mean acceptance length.

    vLLM's per-position rates ``p_i`` are the share of drafts whose first ``i + 1`` tokens were all accepted, so a
    pass yields ``1 + Σ p_i`` tokens: that is the expectation (``primer_tokens_per_pass``, ``primer_basis``
    ``per-position``), and it equals the measured length. The primer's closed form ``(1 − a^(k+1)) / (1 − a)``
    holds for one *conditional* acceptance rate ``a`` shared by every position; the aggregate acceptance rate is
    not that rate (it averages ``p_i``, which already include every earlier acceptance), so plugging it in
    (``independent_tokens_per_pass``) under-predicts even when positions are independent. Whether they are is
    read from the conditional rates ``p_i / p_(i−1)`` (``conditional_acceptance``): equal rates are independence.
    Without per-position rates the closed form on the aggregate rate is all there is (``aggregate``)."""
    c = res.cells
    if not len(c) or "speculative" not in c:
        return pd.DataFrame()
    rows = []
    for _, s in c[c["speculative"] == True].iterrows():
        k = _num_speculative_tokens(res.server(s["server"]))
        a = s.get("spec_acceptance_rate")
        measured = s.get("spec_mean_acceptance_length")
        summary = res.summaries.get(s["cell"])
        spec = summary.speculative if summary is not None else None
        positions = [p for p in (spec.acceptance_by_position if spec is not None else None) or []]
        independent = expected_tokens_per_pass(float(a), int(k)) if k and a is not None and pd.notna(a) \
            else math.nan
        if positions and all(p is not None for p in positions):
            predicted, basis = 1.0 + float(sum(positions)), "per-position"
            conditional = [p / prev if prev else math.nan for prev, p in zip([1.0, *positions[:-1]], positions)]
        else:
            predicted, basis, conditional = independent, "aggregate", []
        rows.append({"cell": s["cell"], "server": s["server"], "workload": s["workload"], "load": s["load"],
                     "num_speculative_tokens": k, "acceptance_rate": a,
                     "primer_tokens_per_pass": predicted, "primer_basis": basis,
                     "independent_tokens_per_pass": independent,
                     "conditional_acceptance": ", ".join(f"{x:.2f}" for x in conditional) or None,
                     "measured_acceptance_length": measured,
                     "measured_minus_primer": (measured - predicted) if measured is not None and pd.notna(measured)
                     else math.nan})
    return pd.DataFrame(rows)


def throughput_title(res: ExperimentResults, ab: pd.DataFrame | None) -> str:
    """The acceptance figure's title: what the bars are (one per workload, point estimates) and each
    configuration's claim in the same words as the page's finding (the median over its workload × load
    comparisons, with the verdicts), never a mean of its own over workloads."""
    claims = speculative_claims(res, ab) if ab is not None and len(ab) else []
    parts = [f"{c.key.split(':', 1)[1]}: output throughput {_change_words(c.numbers.get('median_throughput_change'))}"
             f" (median of {int(c.numbers['comparisons'] or 0)} workload × load comparisons; "
             f"{int(c.numbers['better'] or 0)} decided better)" for c in claims]
    return "Per workload (point estimates); " + ("; ".join(parts) if parts else "no A/B verdicts")


def _num_speculative_tokens(server: ServerEntry | None) -> int | None:
    """Tokens drafted per step, from the server's recorded config (``speculative_config`` is the vLLM config's
    own open mapping, so it is read as one)."""
    spec_config = server.config.get("speculative_config") if server is not None else None
    return spec_config.get("num_speculative_tokens") if isinstance(spec_config, dict) else None


def sample_outputs(res: ExperimentResults, per_cell: int = 2, max_cells: int = 8) -> pd.DataFrame:
    """A few generated texts per cell (first 200 characters): shows at a glance whether the model's output is
    degenerate (random weights repeat themselves, which inflates n-gram acceptance). Untrusted text: reports
    display it escaped."""
    r = res.ok_requests()
    if not len(r) or "output_text_head" not in r:
        return pd.DataFrame(columns=["cell", "request_id", "output_tokens", "output_text_head"])
    r = r[r["output_text_head"].astype(str).str.len() > 0]
    cells = list(dict.fromkeys(r["cell"]))[:max_cells]
    out = r[r["cell"].isin(cells)].groupby("cell", sort=False).head(per_cell)
    return out[["cell", "request_id", "output_tokens", "output_text_head"]].reset_index(drop=True)


def speculative_findings(res: ExperimentResults, table: pd.DataFrame | None = None) -> list[Finding]:
    """Whether speculative decoding pays, per speculative configuration: the claim the A/B verdicts support
    (`claims.speculative_claims`: *pays* only where most throughput comparisons are decided *better* and none
    *worse*), with what gets worse named beside it. ``table`` is the A/B table (`ab_compare.ab_table`),
    computed here when not given."""
    if table is None:
        table = ab_table(res)
    claims = speculative_claims(res, table)
    return [*map(speculative_recommendation, claims),
            *(c.finding("speculative", "speculative", "acceptance_and_tpot") for c in claims)]


@caveat("tiny_model", "speculative")
def _caveat_tiny_model(res: ExperimentResults):
    card = res.model.card if res.model is not None else None
    if not (res.weights_random or card):
        return None
    steps = card.get("train_steps") if card else None  # the tiny model's build card: the builder's own fields
    state = "random weights" if res.weights_random else \
        f"kvscope's tiny model trained for {steps} steps" if steps is not None else "kvscope's tiny model"
    return ((f"The model has {state}: its answers repeat themselves, so n-gram drafts are accepted far more often "
            "than a real model's would be — read acceptance and speed-ups as upper bounds."),
            {"train_steps": None if steps is None else float(steps)})


@report_page("speculative", "Speculative decoding: does it pay off for this traffic?", order=60,
             questions=("speculative", "recommendation"),
             figures=("acceptance_and_tpot", "acceptance_by_position", "predicted_by_method",
                      "predicted_acceptance_by_position"), key_figures=("acceptance_and_tpot",))
def _speculative_page(ctx: PageContext) -> list[Finding]:
    return speculative_findings(ctx.res, page_ab_table(ctx))
