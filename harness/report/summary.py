"""The executive summary at the top of `index.html`, rendered from the pages' `findings.json` files.

Why from files: the findings are computed by the analysis layer while each notebook runs, in the notebook's own
kernel (it has the data and the verdict engine); the report process reads only the page registry (titles,
order), never recomputes a finding, so it reads the typed files back. Every sentence is data-derived text and is
escaped; each links to the page and the figure holding its evidence. The A/B verdicts are pivoted here (configuration
pairs x metrics, one class per verdict word for the colour), with the full table's CSV linked.
"""

from __future__ import annotations

import html
from pathlib import Path

from kvscope.harness.results.findings_file import FINDINGS_NAME, Finding, FindingsFile, load_findings_file
from kvscope.harness.results.summary import compared_statistic

HEADLINE_QUESTIONS = ("recommendation", "habit", "capacity", "cost", "speculative", "ab")
QUESTION_TITLES = {"recommendation": "Recommendations (from decided verdicts only)",
                   "habit": "What each history habit costs", "capacity": "Capacity under the SLO",
                   "cost": "$ per 1,000 sessions: providers and self-hosted (at this experiment's scale: see caveats)",
                   "speculative": "Does speculative decoding pay?", "ab": "A/B verdicts"}
VERDICT_STYLE = """<style>.v-better{background:#c8e6c9}.v-worse{background:#ffcdd2}.v-equivalent{background:#e3f2fd}
.v-inconclusive{background:#f5f5f5;color:#666}.v-by_construction{background:#eeeeee;color:#999}
.findings li{margin:0.3em 0}</style>"""


def read_findings(report_dir: Path, order: list[str]) -> list[FindingsFile]:
    """Every page's findings file under report/figures/<notebook>/, in the report's notebook order."""
    files = {p.parent.name: p for p in (report_dir / "figures").glob(f"*/{FINDINGS_NAME}")}
    ranked = sorted(files, key=lambda n: order.index(n) if n in order else len(order))
    return [load_findings_file(files[n]) for n in ranked]


def _finding_li(f: Finding) -> str:
    e = html.escape
    links = f'<a href="{e(f.page)}">{e(f.notebook)}</a>'
    if f.figure_path:
        links += f' · <a href="{e(f.figure_path)}">figure: {e(f.figure.replace("_", " "))}</a>'  # type: ignore[union-attr]
    return f"<li>{e(f.sentence)} <small>({links})</small></li>"


def _pivot_html(files: list[FindingsFile]) -> str:
    e = html.escape
    cells = [v for f in files for v in f.verdicts]
    if not cells:
        return ""
    metrics = list(dict.fromkeys(v.metric for v in cells))
    pairs = list(dict.fromkeys(v.pair for v in cells))
    by = {(v.pair, v.metric): v for v in cells}
    head = "<tr><th>pair (A → B · workload · load)</th>" + "".join(f"<th>{e(_metric_words(m))}</th>" for m in metrics) \
        + "</tr>"
    rows = []
    for p in pairs:
        tds = []
        for m in metrics:
            v = by.get((p, m))
            rel = "" if v is None or v.relative is None else f" ({_direction(v.relative)})"
            flag = "" if v is None or not v.data_quality else f' <span title="{e(v.data_quality)}">⚑</span>'
            tds.append("<td></td>" if v is None else
                       f'<td class="v-{e(v.verdict)}">{e(v.verdict.replace("_", " "))}{rel}{flag}</td>')
        rows.append(f"<tr><td>{e(p)}</td>{''.join(tds)}</tr>")
    csv = next((f.verdicts_csv for f in files if f.verdicts_csv), None)
    link = f' <a href="{e(csv)}">full verdict table (CSV)</a>' if csv else ""
    return f"<h3>A/B verdicts, pivoted</h3><table>{head}{''.join(rows)}</table><p>{link}</p>"


def _metric_words(metric: str) -> str:
    """A compared metric by its registered display name (``output throughput``), never its key."""
    stat = compared_statistic(metric)
    return metric if stat is None else stat.display


def _direction(relative: float) -> str:
    """B's change against A in words: ``10 % lower``, ``94 % higher``, ``unchanged`` (the verdict beside it says
    whether that is better, after the metric's direction)."""
    if round(abs(relative) * 100) == 0:
        return "unchanged"
    return f"{abs(relative) * 100:.0f} % {'higher' if relative > 0 else 'lower'}"


def findings_html(report_dir: Path, order: list[str]) -> str:
    """The summary section: headline findings by question, the verdict pivot, then the caveats."""
    files = read_findings(report_dir, order)
    found = [f for file in files for f in file.findings]
    if not found:
        return "<h2>Summary</h2><p>No findings were written (no analysis page ran on this data).</p>"
    parts = [VERDICT_STYLE, '<h2>Summary</h2><div class="findings">']
    for q in HEADLINE_QUESTIONS:
        items = [f for f in found if f.question == q]
        if items:
            parts.append(f"<h3>{html.escape(QUESTION_TITLES[q])}</h3><ul>{''.join(map(_finding_li, items))}</ul>")
    parts.append(_pivot_html(files))
    cav = [f for f in found if f.question == "caveat"]
    if cav:
        parts.append(f"<h3>Caveats</h3><ul>{''.join(map(_finding_li, cav))}</ul>")
    parts.append("</div>")
    return "".join(parts)


def audit_html(res, report_dir: Path) -> str:
    """The claims audit of the rendered report (`analysis.audit`): how many of the numbers its pages state were
    recomputed from the raw records and how many disagree, each disagreement listed. Empty where no page wrote a
    statement (a single replay's report). The audit needs only the records and the findings files."""
    from kvscope.harness.analysis.audit import audit_findings, report_findings  # deferred: loads every page

    if not list((report_dir / "figures").glob(f"*/{FINDINGS_NAME}")):
        return ""
    try:
        audit = audit_findings(res, report_findings(res))
    except Exception as exc:  # the index is still written, and says the audit did not run and why
        return (f'<h2 id="claims-audit">Claims audit</h2><p class="warn">The claims audit could not run: '
                f"{html.escape(type(exc).__name__ + ': ' + str(exc))}</p>")
    if not audit.lines:
        return ""
    e = html.escape
    wrong = "".join(f"<li>{e(str(line))}</li>" for line in audit.failures)
    head = (f"{len(audit.lines)} numbers stated by this report were recomputed from the request records with "
            f"nothing but the configuration, workload and load level each names: {len(audit.failures)} disagree.")
    rest = (f" {len(audit.unaudited)} findings state numbers that are not request measurements (the simulator's "
            "predictions, the provider cache simulation, eviction against an unbounded cache, routing what-ifs, "
            "the server's own KV facts); their own tests check them.") if audit.unaudited else ""
    return (f'<h2 id="claims-audit">Claims audit</h2><p class="{"warn" if wrong else "audit-ok"}">{e(head)}{e(rest)}'
            f"</p>" + (f"<ul>{wrong}</ul>" if wrong else ""))
