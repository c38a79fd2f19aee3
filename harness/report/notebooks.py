"""The report's view of the page registry: which notebooks exist, in what order, with which parameters.

Each page declares itself once, in its page module ``analysis/pages/<notebook>.py`` (``@report_page``: title,
order, figures, key figures, parameters, what the experiment's spec gives it, relative cost), and the registry
finds those modules (`kvscope.harness.analysis.registry.report_pages`). So adding a page is
``notebooks/NAME.ipynb`` plus its page module: this module lists nothing. The report runner
(:mod:`kvscope.harness.report.render`) reads the registry through the functions here, when it needs it (not at
import, so the report's worker processes do not load the analysis).
``tests/test_notebook_registry.py`` checks every page against its ``.ipynb`` (the parameters cell and the figure
names it saves), so the declarations cannot drift from the notebooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvscope.harness.analysis.registry import ReportPage

def report_pages() -> tuple[ReportPage, ...]:
    """Every registered page, in report order."""
    # deferred: it loads numpy, pandas, pyarrow, which importing this module must not
    from kvscope.harness.analysis.registry import report_pages as discovered

    return discovered()


def page_names() -> list[str]:
    """The registered notebooks' names, in report order."""
    return [p.notebook for p in report_pages()]


def page_by_name() -> dict[str, ReportPage]:
    return {p.notebook: p for p in report_pages()}
