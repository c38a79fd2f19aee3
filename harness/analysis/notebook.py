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
           "sns"]

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


def escaped_markdown(template: str, /, **values: Any) -> str:
    """``template.format(**values)`` with every string value HTML-escaped (names from specs and traces,
    generated text): the narrative's own markup stays, the data's shows as text. Numbers format as usual."""
    safe = {k: html.escape(v) if isinstance(v, str) else v for k, v in values.items()}
    return template.format(**safe)


def display_markdown(template: str, /, **values: Any) -> None:
    """Show markdown built from data on the page: ``display_markdown("**{server}**: {hit:.0%}", server=s, hit=h)``."""
    display(Markdown(escaped_markdown(template, **values)))
