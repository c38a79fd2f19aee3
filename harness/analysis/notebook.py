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
from IPython.display import HTML, Image, Markdown, display  # noqa: E402

from kvscope.harness.analysis.glossary import column_words, load_words  # noqa: E402
from kvscope.harness.results.loaders import ExperimentResults, load_results  # noqa: E402

__all__ = ["NotebookSetup", "Path", "annotate_points", "display", "display_markdown", "figure_layout_problems",
           "load_results", "pd", "plt", "setup_notebook", "sns", "table_html"]

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
        """Keep every figure as a PNG beside the report and show the same PNG on the notebook's page, with any
        layout problem (:func:`figure_layout_problems`) said under it, where the browser check finds it."""
        wrap_title(fig)
        problems = figure_layout_problems(fig)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=FIGURE_DPI, bbox_inches="tight")
        plt.close(fig)
        (fig_dir / f"{figure_name}.png").write_bytes(png.getvalue())
        display(Image(data=png.getvalue(), format="png", alt=figure_name.replace("_", " ")))
        if problems:
            display(HTML("".join(f'<p class="{LAYOUT_PROBLEM_CLASS}">Layout check, {html.escape(figure_name)}: '
                                 f"{html.escape(p)}</p>" for p in problems)))

    if res is not None:
        print(f"experiment {res.name}: {len(res.cells)} cells, {len(res.requests)} request records")
    return NotebookSetup(res, fig_dir, save)


#: Height of a table's box before it scrolls (every row is there: it scrolls, never "N rows × M columns").
TABLE_MAX_HEIGHT_PX = 520

_TABLE_CSS = (
    f".kvs-table{{max-height:{TABLE_MAX_HEIGHT_PX}px;overflow:auto;max-width:100%;margin:0.3em 0 1em}}"
    ".kvs-table table{border-collapse:collapse;font-size:12px;table-layout:auto;margin:0}"
    ".kvs-table thead th{position:sticky;top:0;z-index:1;background:#fff;box-shadow:inset 0 -1px #999;"
    "vertical-align:bottom;max-width:11em;overflow-wrap:normal;word-break:normal;hyphens:none}"
    ".kvs-table[data-wide] thead th{overflow-wrap:anywhere}"
    ".kvs-columns{font-size:11px;color:#555;margin:-0.6em 0 1em;max-width:60em}"
    ".kvs-table td,.kvs-table th{padding:2px 5px;text-align:right;white-space:normal}"
    ".kvs-table td{overflow-wrap:normal}"
    ".kvs-table td.kvs-prose{text-align:left;min-width:12em;max-width:32em}"
    ".kvs-table tbody tr:nth-child(odd){background:#f6f6f6}"
)


#: A float closer to zero than this is float noise (``-2.22e-16`` from a difference of equal ratios): shown as 0.
NEAR_ZERO = 1e-9


def _format_value(x: Any) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "–"
        return "0" if abs(x) < NEAR_ZERO else f"{x:,.4g}"
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
    # an unnamed integer index is row numbers (a filtered or sorted frame's leftover), never data
    plain_index = (not isinstance(df.index, pd.MultiIndex) and df.index.name is None
                   and pd.api.types.is_integer_dtype(df.index.dtype))
    body = df.to_html(escape=True, index=not plain_index, border=0, na_rep="–", float_format=_format_value,
                      max_rows=None, max_cols=None, show_dimensions=False)
    body = re.sub(r"<td>([^<]{%d,})</td>" % PROSE_CHARS, _prose_cell, body)
    body = re.sub(r">([A-Za-z0-9_.:+\-]*_[A-Za-z0-9_.:+\-]*)<", lambda m: ">" + m.group(1).replace("_", "_<wbr>") + "<",
                  body)
    wide = " data-wide" if _min_width_px(df, plain_index) > PAGE_TABLE_PX else ""
    return f'<div class="kvs-table"{wide}><style>{_TABLE_CSS}</style>{body}</div>{_columns_legend(df)}'


#: The width a report table has on the page (1280 px screen less margins), and a 12 px font's character width.
PAGE_TABLE_PX = 1150
_CHAR_PX = 7.0


def _min_width_px(df: pd.DataFrame, plain_index: bool) -> float:
    """An estimate of the narrowest the table can be when words break only at spaces, hyphens and underscores:
    per column, its longest unbreakable piece (header or cell; a prose cell's 12 em). Headers break mid-word
    (``overflow-wrap:anywhere``) only in a table wider than the page even so."""
    def piece(text: str) -> int:
        return max((len(p) for p in re.split(r"[\s_\-]", text)), default=0)

    total = 0.0
    frame = df if plain_index else df.reset_index()
    for col in frame.columns:
        values = frame[col].head(200)
        cells = [_format_value(v) for v in values]
        longest = max([piece(str(col))] + [19 if len(c) >= PROSE_CHARS and " " in c else piece(c) for c in cells])
        total += longest * _CHAR_PX + 10
    return total


def _columns_legend(df: pd.DataFrame) -> str:
    """The table's raw keys in words (`analysis.glossary`): its columns that have an entry, and its load labels."""
    names = [*df.columns, *(n for n in df.index.names if n is not None)]
    words = column_words(names)
    loads = []
    for frame in (df.reset_index() if any(n == "load" for n in df.index.names) else df,):
        if "load" in frame.columns:
            loads = list(dict.fromkeys(map(str, frame["load"])))[:12]
    words |= {lv: load_words(lv) for lv in loads if load_words(lv) != lv}
    if not words:
        return ""
    items = "; ".join(f"<code>{html.escape(k)}</code>: {html.escape(v)}" for k, v in words.items())
    return f'<p class="kvs-columns">{items}</p>'


#: The class of the line a notebook shows under a figure with a layout problem (the browser check counts them).
LAYOUT_PROBLEM_CLASS = "kvs-layout-problem"

#: Axis labels of a quantity whose axis must start at zero (a share, a rate): a zoomed axis makes 0.08 pp a cliff.
_ZERO_BASED = re.compile(r"hit rate|share|acceptance|\(%\)|fraction", re.IGNORECASE)


def figure_layout_problems(fig: Any) -> list[str]:
    """What makes a figure hard to read, as far as it can be checked from its artists: tick labels that overlap,
    a legend inside a plot covering its data (lines, points, bars), a title overlapping a panel, an axis of a
    share or rate that does not start at zero. Empty for a figure that reads cleanly."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out: list[str] = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        name = ax.get_title() or ax.get_ylabel() or "a panel"
        for which, labels in (("x", ax.get_xticklabels()), ("y", ax.get_yticklabels())):
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels if t.get_visible() and t.get_text()]
            boxes.sort(key=lambda b: (b[1].x0, b[1].y0))
            clash = [(a[0], b[0]) for i, a in enumerate(boxes) for b in boxes[i + 1:] if _overlap_px(a[1], b[1])]
            if clash:
                out.append(f"{name}: {which} labels overlap ({clash[0][0]!r} and {clash[0][1]!r})")
        notes = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts if t.get_visible() and t.get_text()]
        clash = [(a[0], b[0]) for i, a in enumerate(notes) for b in notes[i + 1:] if _overlap_px(a[1], b[1])]
        if clash:
            out.append(f"{name}: point labels overlap ({clash[0][0]!r} and {clash[0][1]!r})")
        others = [o for o in fig.axes if o is not ax and o.get_visible()]
        for label in (ax.yaxis.label, ax.xaxis.label):
            if label.get_text() and any(_overlap_px(label.get_window_extent(renderer), o.get_window_extent(renderer))
                                        for o in others):
                out.append(f"{name}: the axis label {label.get_text()!r} runs into another panel")
        legend = ax.get_legend()
        if legend is not None and legend.get_visible():
            lb = legend.get_window_extent(renderer)
            if lb.overlaps(ax.get_window_extent(renderer)) and _covers_data(ax, lb):
                out.append(f"{name}: the legend covers data")
        for axis, label, lim in (("y", ax.get_ylabel(), ax.get_ylim()), ("x", ax.get_xlabel(), ax.get_xlim())):
            scale = ax.get_yscale() if axis == "y" else ax.get_xscale()
            if _ZERO_BASED.search(label or "") and scale == "linear" and min(lim) > 0:
                out.append(f"{name}: the {axis} axis ({label}) starts at {min(lim):.3g}, not at zero")
    out += _missing_from_legend(fig)
    title = fig._suptitle  # matplotlib keeps the suptitle here, with no public getter
    if title is not None and title.get_text():
        tb = title.get_window_extent(renderer)
        for ax in fig.axes:
            if not ax.get_visible():
                continue
            for what, text in (("title", ax.title), ("y label", ax.yaxis.label), ("x label", ax.xaxis.label)):
                if text.get_text() and _overlap_px(tb, text.get_window_extent(renderer)):
                    out.append(f"the figure title overlaps the {what} {text.get_text()!r}")
                    break
        if tb.width > 1.1 * fig.bbox.width:
            out.append("the figure title is wider than the figure")
    return out


def wrap_title(fig: Any) -> None:
    """Break a figure title wider than its figure into lines that fit (a title generated from a finding can be a
    long sentence), so the saved canvas is not stretched by it, and put it above every panel."""
    import textwrap  # deferred: only titles that need it

    title = fig._suptitle  # matplotlib keeps the suptitle here, with no public getter
    if title is None or not title.get_text():
        return
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width = title.get_window_extent(renderer).width
    if width > fig.bbox.width:
        text = " ".join(title.get_text().split())
        title.set_text(textwrap.fill(text, max(30, int(len(text) * fig.bbox.width / width * 0.95))))
    # the title sits above every panel and panel title, growing upwards: more lines never cover a panel
    tops = [a.get_tightbbox(renderer).y1 for a in fig.axes if a.get_visible()]
    if tops:
        title.set_verticalalignment("bottom")
        title.set_y(max(tops) / fig.bbox.height + 0.01)


def annotate_points(ax: Any, points: list[tuple[float, float, str]], fontsize: float = 7) -> int:
    """Label points of ``ax`` (x, y, text) where a label fits: one that would overlap a label already placed or
    leave the panel is left out (the page's table holds every value). Returns how many were placed."""
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    placed: list[Any] = []
    for x, y, text in points:
        note = ax.annotate(text, (x, y), fontsize=fontsize, xytext=(3, 3), textcoords="offset points")
        box = note.get_window_extent(renderer)
        inside = box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0 and box.y1 <= frame.y1
        if not inside or any(_overlap_px(box, other) for other in placed):
            note.remove()
        else:
            placed.append(box)
    return len(placed)


def _missing_from_legend(fig: Any) -> list[str]:
    """Labelled series (a line, points or bars with a label of their own) that no legend of the figure names,
    where the figure has a legend: one panel's legend standing for all of them drops the series it lacks."""
    legends = [a.get_legend() for a in fig.axes if a.get_legend() is not None] + list(fig.legends)
    if not legends:
        return []
    named = {t.get_text() for lg in legends for t in lg.get_texts()}
    labels = []
    for ax in fig.axes:
        for artist in [*ax.get_lines(), *ax.collections, *ax.containers]:
            label = str(artist.get_label())
            if label and not label.startswith("_") and label not in named and label not in labels:
                labels.append(label)
    return [f"{', '.join(map(repr, labels[:3]))} not in the legend"] if labels else []


def _overlap_px(a: Any, b: Any, px: float = 1.0) -> bool:
    """Do two boxes share more than ``px`` pixels both ways (touching is not overlapping)?"""
    return min(a.x1, b.x1) - max(a.x0, b.x0) > px and min(a.y1, b.y1) - max(a.y0, b.y0) > px


def _covers_data(ax: Any, box: Any) -> bool:
    """Does any data point, line vertex or bar of ``ax`` fall inside ``box`` (display coordinates)?"""
    import numpy as np  # deferred: numpy is loaded by pandas already; kept local to this check

    transform = ax.transData
    for line in ax.get_lines():
        xy = np.column_stack([np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)]) \
            if len(line.get_xdata()) else np.zeros((0, 2))
        if line.get_transform() != transform or not len(xy):
            continue  # a reference line (axhline) spans the axes: not data
        pts = transform.transform(xy[np.isfinite(xy).all(axis=1)])
        if len(pts) and ((pts[:, 0] >= box.x0) & (pts[:, 0] <= box.x1) & (pts[:, 1] >= box.y0)
                         & (pts[:, 1] <= box.y1)).any():
            return True
    for coll in ax.collections:
        offsets = coll.get_offsets()
        if len(offsets):
            pts = coll.get_offset_transform().transform(offsets)
            if ((pts[:, 0] >= box.x0) & (pts[:, 0] <= box.x1) & (pts[:, 1] >= box.y0) & (pts[:, 1] <= box.y1)).any():
                return True
    return any(p.get_window_extent().overlaps(box) for p in ax.patches)


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
