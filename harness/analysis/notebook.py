"""What every report notebook does first, as one function instead of a cell copied into seven notebooks.

A notebook's first code cell is papermill's ``parameters`` cell; the cell after it is now two lines::

    from kvscope.harness.analysis.notebook import display, plt, setup_notebook, sns
    from kvscope.harness.analysis.pages import latency as P  # the page's own tables
    res, FIG, save = setup_notebook("latency", experiment_dir, figures_dir)

This module sets the headless matplotlib backend before pyplot is imported, so it is meant for notebooks
(and their tests), not for library code; it re-exports the names the notebooks plot and print with.

How output reaches the page. With the Agg backend ``plt.show()`` emits nothing, so ``save`` writes the PNG
beside the report and displays those same bytes as an ``image/png`` output, which nbconvert embeds in the page
as a ``data:`` URI (one file on disk for the index, one self-contained page). The report pages are not
sanitised by nbconvert (see :mod:`kvscope.harness.report.render`): data is escaped where it enters the page.
pandas tables escape every cell and label by themselves; markdown built from data goes through
:func:`display_markdown`, which ``html.escape``-s every value it fills in.
"""

from __future__ import annotations

import html
import io
import math
import re
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from IPython.display import Image, Markdown, display  # noqa: E402

from kvscope.harness.results.loaders import ExperimentResults, load_results  # noqa: E402

__all__ = ["NotebookSetup", "Path", "display", "display_markdown", "load_results", "pd", "plt", "setup_notebook",
           "sns", "table_html"]

FIGURE_DPI = 110


class NotebookSetup(NamedTuple):
    """The loaded results (None without an experiment), the figures folder and the figure saver."""

    res: ExperimentResults | None
    figures_dir: Path
    save: Callable[[Any, str], None]


def setup_notebook(name: str, experiment_dir: str = "", figures_dir: str = "") -> NotebookSetup:
    """Theme and display options, the results of ``experiment_dir`` and ``figures_dir`` (default
    ``<experiment>/report/figures/<name>``, else ``report/figures/<name>``), created."""
    warnings.filterwarnings("ignore")
    sns.set_theme(style="whitegrid", context="notebook")
    pd.set_option("display.float_format", lambda x: f"{x:,.4g}")
    pd.set_option("display.max_columns", 40)
    _show_tables_whole()
    res = load_results(experiment_dir) if experiment_dir else None
    report_dir = res.root / "report" if res is not None else Path("report")
    fig_dir = Path(figures_dir) if figures_dir else report_dir / "figures" / name
    fig_dir.mkdir(parents=True, exist_ok=True)

    def save(fig: Any, figure_name: str) -> None:
        """Keep every figure as a PNG beside the report and show the same PNG on the notebook's page."""
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=FIGURE_DPI, bbox_inches="tight")
        plt.close(fig)
        (fig_dir / f"{figure_name}.png").write_bytes(png.getvalue())
        display(Image(data=png.getvalue(), format="png", alt=figure_name.replace("_", " ")))

    if res is not None:
        print(f"experiment {res.name}: {len(res.cells)} cells, {len(res.requests)} request records")
    return NotebookSetup(res, fig_dir, save)


#: Height of a table's box before it scrolls (every row is there: it scrolls, never "N rows × M columns").
TABLE_MAX_HEIGHT_PX = 520

_TABLE_CSS = (
    f".kvs-table{{max-height:{TABLE_MAX_HEIGHT_PX}px;overflow:auto;max-width:100%;margin:0.3em 0 1em}}"
    ".kvs-table table{border-collapse:collapse;font-size:12px;table-layout:auto;margin:0}"
    ".kvs-table thead th{position:sticky;top:0;z-index:1;background:#fff;box-shadow:inset 0 -1px #999;"
    "vertical-align:bottom;max-width:11em;overflow-wrap:anywhere}"
    ".kvs-table td,.kvs-table th{padding:2px 5px;text-align:right;white-space:normal}"
    ".kvs-table td{overflow-wrap:normal}"
    ".kvs-table td.kvs-prose{text-align:left;min-width:12em;max-width:32em}"
    ".kvs-table tbody tr:nth-child(odd){background:#f6f6f6}"
)


def _format_value(x: Any) -> str:
    if isinstance(x, float):
        return "–" if math.isnan(x) else f"{x:,.4g}"
    return str(x)


#: A cell whose text is at least this long and has a space is prose: left-aligned, given room to wrap.
PROSE_CHARS = 30


def _prose_cell(m: re.Match[str]) -> str:
    return f'<td class="kvs-prose">{m.group(1)}</td>' if " " in m.group(1) else m.group(0)


def table_html(df: pd.DataFrame) -> str:
    """Every row and column of ``df`` as an HTML table in a box that scrolls vertically under a sticky header:
    the report's one way to show a table (:func:`setup_notebook` makes it how a DataFrame displays).

    Why: pandas' own HTML drops the middle rows past ``display.max_rows`` ("70 rows × 18 columns") and lets a
    wide table run past the page. Here nothing is dropped, a long table scrolls inside its box with its header
    in view, and a default 0..n-1 index is left out. A table fits the page: text may break at spaces, hyphens
    and after underscores (``_<wbr>``, only in a name: a cell or label of letters, digits and ``_.:+-`` alone,
    such as a snake_case column or a cell id), headers anywhere, which the browser uses only where the table would
    otherwise be too wide; numbers never break. Cells and labels are escaped by pandas (``escape=True``); any other
    text, untrusted text with markup characters included, is left exactly as pandas escaped it."""
    if not len(df.columns):  # a table of nothing (a page's table on data without that part): say so
        return '<p class="kvs-table-empty"><em>(no data for this table)</em></p>'
    plain_index = isinstance(df.index, pd.RangeIndex) and df.index.name is None
    body = df.to_html(escape=True, index=not plain_index, border=0, na_rep="–", float_format=_format_value,
                      max_rows=None, max_cols=None, show_dimensions=False)
    body = re.sub(r"<td>([^<]{%d,})</td>" % PROSE_CHARS, _prose_cell, body)
    body = re.sub(r">([A-Za-z0-9_.:+\-]*_[A-Za-z0-9_.:+\-]*)<", lambda m: ">" + m.group(1).replace("_", "_<wbr>") + "<",
                  body)
    return f'<div class="kvs-table"><style>{_TABLE_CSS}</style>{body}</div>'


def _show_tables_whole() -> None:
    """Display every DataFrame through :func:`table_html` in this kernel (outside IPython nothing changes)."""
    try:
        from IPython import get_ipython  # optional: IPython may be absent, the ImportError is handled
    except ImportError:  # pragma: no cover - IPython is a dependency of the notebooks
        return
    shell = get_ipython()
    if shell is not None:
        shell.display_formatter.formatters["text/html"].for_type(pd.DataFrame, table_html)


def escaped_markdown(template: str, /, **values: Any) -> str:
    """``template.format(**values)`` with every string value HTML-escaped (names from specs and traces,
    generated text): the narrative's own markup stays, the data's shows as text. Numbers format as usual."""
    safe = {k: html.escape(v) if isinstance(v, str) else v for k, v in values.items()}
    return template.format(**safe)


def display_markdown(template: str, /, **values: Any) -> None:
    """Show markdown built from data on the page: ``display_markdown("**{server}**: {hit:.0%}", server=s, hit=h)``."""
    display(Markdown(escaped_markdown(template, **values)))
