"""Report pages as a reader sees them: loaded in the system Chromium (Selenium), checked through the DOM.

The check itself is tested here on a page broken in every way it looks for, and on a notebook rendered by
the report's own exporter. The report of a real vLLM experiment is checked in
tests/test_experiment_integration.py (it reuses that module's experiment, so no extra server time), and
the report of a replay whose server generated script payloads in tests/test_report_security.py.
"""

from __future__ import annotations

import re

from pathlib import Path

import pytest
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.report.browser import check_report_pages, chromium_paths

# A generated text that would set window.__pwned if it ever ran, through a script tag or an event handler.
PAYLOAD = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


def require_chromium() -> None:
    """Skip the calling test without Selenium or the system Chromium (`make install` brings both as root)."""
    pytest.importorskip("selenium", reason="selenium is in the dev extra: pip install -e '.[dev]'")
    try:
        chromium_paths()
    except KvscopeError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def chromium() -> None:
    require_chromium()


def assert_report_renders(report_dir: Path, expect_images: bool = True) -> list:
    """Every page of the report passes the browser check; each page with a figure decoded it. Returns the checks."""
    checks = check_report_pages(report_dir)
    problems = [p for c in checks for p in c.problems]
    assert not problems, "\n".join(problems)
    for c in checks:
        assert c.screenshot.stat().st_size > 0, c.page
    if expect_images:
        assert all(c.images > 0 for c in checks), [(c.page, c.images) for c in checks]
    return checks


def test_the_check_finds_each_kind_of_breakage(chromium, tmp_path):
    (tmp_path / "index.html").write_text(
        "<!doctype html><html><head><meta charset=utf-8></head><body>"
        "<p>&lt;h1 id=&quot;x&quot;&gt;Title&lt;/h1&gt; &lt;style scoped&gt;</p>"
        '<img src="data:image/png;base64,AAAA" alt=broken>'
        "<table><tr><td>1</td></tr></table><table><tr><th>h</th></tr></table>"
        '<div style="width:400px;overflow-x:auto"><table style="width:900px"><tr><th>wide</th></tr></table></div>'
        "<p>70 rows × 18 columns</p>"
        "<script>window.__pwned = 1; console.error('boom')</script></body></html>")
    (page,) = check_report_pages(tmp_path)
    assert page.escaped_markup[:2] == ['<h1 id="x">', "</h1>"] and "<style scoped>" in page.escaped_markup
    assert page.broken_images == ["data:image/png;base64,AAAA"]
    assert (page.tables, page.tables_without_headers) == (3, 1)
    assert page.overflowing_tables == ["table 3: 900 px in a 400 px box"]
    assert page.truncated_tables == ["70 rows × 18 columns"]
    assert any("boom" in e for e in page.console_errors)
    assert page.script_ran
    assert len(page.problems) == 7
    assert (tmp_path / "screenshots" / "index.png").stat().st_size > 0


def test_a_rendered_notebook_shows_markup_tables_and_figures_and_never_runs_data(chromium, tmp_path):
    """The report's own exporter on a notebook with a heading, a figure, a table and markdown built from data,
    the data being script payloads: the narrative renders, the data shows as text, nothing runs."""
    import nbformat
    from kvscope.harness.report.render import REPORT_CSP, run_notebook

    from tests.doubles.scratch_notebook import write_report_notebook

    nb_dir = tmp_path / "nbs"
    write_report_notebook(nb_dir, "page", [
        nbformat.v4.new_code_cell("from kvscope.harness.analysis.notebook import display, display_markdown, pd, "
                                  "plt, setup_notebook\nres, FIG, save = setup_notebook('page', experiment_dir, "
                                  "figures_dir)"),
        nbformat.v4.new_markdown_cell("# A heading\n\nSome **narrative** text."),
        nbformat.v4.new_code_cell(f"payload = {PAYLOAD!r}\n"
                                  "display(pd.DataFrame({'server': [payload], 'hit_rate': [0.5]}))\n"
                                  "display_markdown('The server **{name}** hit {hit:.0%}.', name=payload, hit=0.5)\n"
                                  "fig, ax = plt.subplots()\nax.plot([0, 1], [1, 0])\nsave(fig, 'line')\n"
                                  "print(payload)"),
    ])
    out = tmp_path / "report"
    r = run_notebook("page", out, {"experiment_dir": "", "figures_dir": str(out / "figures" / "page")},
                     notebooks_dir=nb_dir)
    assert r.ok, r.error
    html = r.html.read_text()
    assert "<script" not in html.lower() and REPORT_CSP in html
    assert (out / "figures" / "page" / "line.png").stat().st_size > 0
    (out / "index.html").write_text('<!doctype html><meta charset=utf-8><a href="page.html">page</a>'
                                    '<img src="figures/page/line.png">')
    checks = assert_report_renders(out)
    assert [c.page for c in checks] == ["index.html", "page.html"]
    page = checks[1]
    assert page.images == 1 and page.tables == 1
    assert "A heading" in page.visible_text and "# A heading" not in page.visible_text
    # the payload shows as text: in the table, in the markdown sentence and in the printed stream
    assert page.visible_text.count("<script>window.__pwned=1</script>") == 3, page.visible_text


def test_a_long_wide_table_shows_whole_and_fits_its_page(chromium, tmp_path):
    """A DataFrame displayed on a report page (200 rows, 16 snake_case number columns, cell ids, a prose column) shows
    every row, no "N rows × M columns", and is no wider than its box or the page; pandas' own HTML of the same
    frame, on the same page, is caught by the check (it cuts rows and runs past the page)."""
    import nbformat
    from kvscope.harness.report.render import run_notebook

    from tests.doubles.scratch_notebook import write_report_notebook

    nb_dir = tmp_path / "nbs"
    write_report_notebook(nb_dir, "page", [
        nbformat.v4.new_code_cell("from kvscope.harness.analysis.notebook import display, pd, setup_notebook\n"
                                  "res, FIG, save = setup_notebook('page', experiment_dir, figures_dir)"),
        nbformat.v4.new_code_cell(
            "df = pd.DataFrame({f'usd_per_1000_sessions_metric_{i}': [j * 1.2345 for j in range(200)] for i in range(16)})\n"
            "df.insert(0, 'cell', [f'no-prefix-cache__agent-coding-timestamped__c{j}__r0' for j in range(200)])\n"
            "df['why'] = '57 % of prompts are below its minimum of 1,024 tokens; it reads only up to a breakpoint'\n"
            "display(df)"),
    ])
    out = tmp_path / "report"
    r = run_notebook("page", out, {"experiment_dir": "", "figures_dir": str(out / "figures" / "page")},
                     notebooks_dir=nb_dir)
    assert r.ok, r.error
    (out / "index.html").write_text('<!doctype html><meta charset=utf-8><a href="page.html">page</a>')
    checks = assert_report_renders(out, expect_images=False)
    page = checks[1]
    assert page.tables == 1 and not page.overflowing_tables and not page.truncated_tables
    assert "no-prefix-cache" in page.visible_text and r.html.read_text().count("<tr") == 201

    import pandas as pd
    raw = pd.DataFrame({f"usd_per_1000_sessions_metric_{i}": range(200) for i in range(30)})
    (out / "raw.html").write_text("<!doctype html><meta charset=utf-8>" + raw.to_html(max_rows=60, show_dimensions=True))
    (bad,) = check_report_pages(out, pages=[out / "raw.html"])
    assert bad.truncated_tables == ["200 rows × 30 columns"] and bad.overflowing_tables


def test_missing_chromium_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSCOPE_CHROMIUM", str(tmp_path / "no-chromium"))
    with pytest.raises(KvscopeError, match="Chromium not found .*no-chromium.*make install"):
        chromium_paths()


def test_report_workers_one_per_cpu_by_default_at_most_one_per_notebook_and_the_override_is_checked(monkeypatch):

    from kvscope.harness.report import render
    from kvscope.harness.report.render import report_workers

    monkeypatch.delenv("KVSCOPE_REPORT_WORKERS", raising=False)
    monkeypatch.setattr(render, "_usable_cpus", lambda: 2)
    assert report_workers(100) == 2 and report_workers(1) == 1  # parallel by default: kernels use Unix sockets
    monkeypatch.setenv("KVSCOPE_REPORT_WORKERS", "3")
    assert report_workers(7) == 3 and report_workers(2) == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("KVSCOPE_REPORT_WORKERS", bad)
        with pytest.raises(KvscopeError, match=f"KVSCOPE_REPORT_WORKERS='{bad}': allowed is a whole number"):
            report_workers(7)


def test_the_index_states_the_driven_capacity_the_scale_and_self_hosted_cost(chromium, tiny_model_dir, tmp_path):
    """The index of a constructed experiment (issue 37, points 3 and 5) as a reader sees it in Chromium: the
    quickstart's recorded "holds 5" on a level with 4.1 sessions in flight is stated as what the points support,
    with the under-driven level named; the three session counts are reconciled; the workload scale is a caveat;
    self-hosted $ per 1,000 sessions stands beside the provider's, on the machine named as what it is."""
    from kvscope.harness.analysis import findings as F
    from kvscope.harness.report.render import write_index
    from kvscope.workloads.generate import generate_from_file

    from tests.test_capacity_report import quickstart
    from tests.test_cost_report import CAP, SCALE, results

    generate_from_file("agent-coding", tiny_model_dir, seed=3, scale=SCALE, sessions=3,
                       max_context=CAP).write(tmp_path / "traces" / "agent")
    res = results(tmp_path, {"pricing": ["anthropic-sonnet-5m"],
                             "self_hosted": {"hourly_usd": 0.10, "hardware": "a 2-core CPU VM"}})
    out = tmp_path / "report"
    for page, data in (("concurrency", quickstart()), ("cost", res)):
        fig = out / "figures" / page
        fig.mkdir(parents=True)
        F.write_page_findings(data, page, fig)
    write_index(res, out, [])
    (index,) = check_report_pages(out, pages=[out / "index.html"])
    assert not index.problems, index.problems
    text = index.visible_text
    assert "baseline holds 1 concurrent agent-sweep session at" in text and "holds 5" not in text
    assert ("5 met the SLO with only 4.1 sessions in flight on average (under-driven: below 4.5, the level less "
            "10 %), so it does not count") in text
    assert "Three session counts for one KV pool: vLLM's max_concurrency_at_max_len (2)" in text
    assert "Scale: agent ran at prompt scale 0.02, outputs 0.15, contexts capped at 1,500 tokens" in text
    assert "self-hosted on a 2-core CPU VM at $0.10 an hour: $0.33 per 1,000 sessions" in text
    assert "GPU-hour" not in text
    # the concurrency findings came from another experiment than this index's records: the audit says so
    audit = re.search(r"Claims audit\s+(\d+) numbers stated by this report were recomputed from the request "
                      r"records[^:]*: (\d+) disagree", text)
    assert audit is not None and int(audit.group(2)) > 0, text[:2000]


def test_figures_and_tables_are_checked_for_legibility_on_a_rendered_page(chromium, tmp_path):
    """Issue 37's presentation faults on one rendered page: x labels that overlap, a legend on the lines, a hit-rate
    axis zoomed to 82.78-82.86 %, a table with pandas' row numbers and -2.22e-16. The notebook's `save` says each
    figure fault under its figure and the browser check reports it; the report's own table (`table_html`) of the
    same filtered frame shows neither the row numbers nor the noise, and a clean figure passes."""
    import nbformat
    from kvscope.harness.report.render import run_notebook

    from tests.doubles.scratch_notebook import write_report_notebook

    bad_figure = (
        "fig, ax = plt.subplots(figsize=(3, 2))\n"
        "ax.plot(range(12), [0.8278 + 0.00007 * i for i in range(12)], label='measured')\n"
        "ax.set_xticks(range(12)); ax.set_xticklabels([f'sweep-c{i}-level' for i in range(12)])\n"
        "ax.set_ylabel('hit rate'); ax.legend(loc='center')\n"
        "save(fig, 'crowded')")
    clean_figure = (
        "fig, ax = plt.subplots(figsize=(6, 3))\n"
        "ax.plot([1, 2, 4], [0.5, 0.6, 0.9], label='measured'); ax.set_ylim(0, 1); ax.set_ylabel('hit rate')\n"
        "ax.legend(loc='upper left', bbox_to_anchor=(1.02, 1))\n"
        "save(fig, 'clean')")
    table = ("df = pd.DataFrame({'load': ['c2', 'sweep-c5', 'c4'], 'diff_pp': [-2.22e-16, 1.5, 0.25]})"
             ".sort_values('diff_pp')\n")
    nb_dir = tmp_path / "nbs"
    for name, cells in (("bad", [bad_figure, table + "from IPython.display import HTML\ndisplay(HTML(df.to_html()))"]),
                        ("good", [clean_figure, table + "display(df)"])):
        write_report_notebook(nb_dir, name, [
            nbformat.v4.new_code_cell("from kvscope.harness.analysis.notebook import display, pd, plt, setup_notebook\n"
                                      f"res, FIG, save = setup_notebook('{name}', experiment_dir, figures_dir)"),
            *map(nbformat.v4.new_code_cell, cells)])
    out = tmp_path / "report"
    for name in ("bad", "good"):
        r = run_notebook(name, out, {"experiment_dir": "", "figures_dir": str(out / "figures" / name)},
                         notebooks_dir=nb_dir)
        assert r.ok, r.error
    (out / "index.html").write_text('<!doctype html><meta charset=utf-8><a href="bad.html">b</a>')
    checks = {c.page: c for c in check_report_pages(out)}
    bad, good = checks["bad.html"], checks["good.html"]
    layout = " ".join(bad.figure_layout)
    assert "x labels overlap" in layout and "the legend covers data" in layout and "not at zero" in layout
    assert bad.index_columns == ["table 1"] and bad.float_noise == ["-2.22e-16"]
    assert any("figure layout problems" in p for p in bad.problems)
    assert good.problems == [] and good.images == 1
    assert "sweep-c5: capacity sweep, 5 sessions in flight" in good.visible_text  # raw keys explained
