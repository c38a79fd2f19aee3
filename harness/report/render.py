"""Reports: execute the analysis notebooks with papermill, render HTML with nbconvert, write index.html.

Notebooks run from the project's `notebooks/` folder unless the user names another folder explicitly, so a
results directory can never bring code of its own into a report. Which notebooks exist, their order, their
parameters and the figures the index shows come from the page registry (each page's module declares itself;
`report/notebooks.py` reads it).

Why the pages are rendered this way. nbconvert's ``sanitize_html`` (bleach) escaped the report's own
narrative: headings, pandas' ``<style scoped>`` and table headers showed as raw markup, 31-163 escaped tags a
page. Untrusted text (generated ``output_text_head``, names from specs and traces) is now escaped at its
source instead: pandas' ``to_html`` escapes every cell and label by default, ``print`` goes out as a stream
that nbconvert escapes, markdown built from data goes through
:func:`kvscope.harness.analysis.notebook.display_markdown` (``html.escape`` on every value), and every
string written into ``index.html`` goes through ``html.escape``. So the exporter runs with
``sanitize_html=False`` on a template (``lab`` with ``exclude_input``, :data:`PAGE_TEMPLATE`) that emits no
script at all — no require.js, MathJax, mermaid or widget loaders, and JavaScript outputs are dropped — and
every page carries :data:`REPORT_CSP`, which forbids script execution outright (inline styles and ``data:``
images allowed). A payload that slipped past the escaping would still be inert; the browser test
(``tests/test_report_browser.py``) checks both on a real experiment. Independent notebooks execute in
parallel (one papermill kernel per process of a small pool); the index keeps the registry's order.
"""

from __future__ import annotations

import html
import math
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from kvscope.harness.analysis.glossary import TERMS
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.report.notebooks import page_by_name, page_names
from kvscope.harness.report.on_gpu import on_gpu_html
from kvscope.harness.report.summary import audit_html, findings_html
from kvscope.harness.results.loaders import REPORT_NAME, load_report_file, load_results, write_result_file
from kvscope.harness.results.schemas import ExperimentSpecCore, NotebookEntry, ReportFile

__all__ = ["NotebookResult", "render_compare", "render_report", "run_notebook", "write_index"]


def project_notebooks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "notebooks"


@dataclass
class NotebookResult:
    name: str
    ok: bool
    html: Path | None
    ipynb: Path | None
    seconds: float
    error: str | None = None
    figures: list[Path] = field(default_factory=list)
    cpu_s: float | None = None  # user + system CPU of the kernel and of the execution/rendering around it


REPORT_CSP = ("default-src 'none'; script-src 'none'; object-src 'none'; base-uri 'none'; form-action 'none'; "
              "style-src 'unsafe-inline'; img-src 'self' data:")
"""Every report page's Content-Security-Policy: no script runs, no resource loads but its own images and styles."""

PAGE_TEMPLATE_NAME = "kvscope-page.html.j2"
PAGE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}
<meta http-equiv="Content-Security-Policy" content="__CSP__">
{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block data_javascript scoped -%}{%- endblock data_javascript -%}
{%- block data_widget_view scoped -%}{%- endblock data_widget_view -%}
""".replace("__CSP__", html.escape(REPORT_CSP))
"""nbconvert's ``lab`` page without any script: the CSP meta first, no JS loaders, JavaScript outputs dropped."""


def _html_exporter(show_input: bool):
    from jinja2 import DictLoader  # deferred: jinja2 is heavy, only rendering a chat template needs it
    from nbconvert import HTMLExporter  # deferred: nbconvert is heavy, importing this module must not load it

    exporter = HTMLExporter(template_name="lab", extra_loaders=[DictLoader({PAGE_TEMPLATE_NAME: PAGE_TEMPLATE})])
    exporter.template_file = PAGE_TEMPLATE_NAME
    exporter.exclude_input = not show_input
    exporter.exclude_input_prompt = True
    exporter.exclude_output_prompt = True
    exporter.sanitize_html = False  # data is escaped at its source; see the module docstring
    return exporter


def run_notebook(name: str, out_dir: Path, parameters: dict[str, Any], notebooks_dir: Path | None = None,
                 show_input: bool = False, timeout_s: int = 900) -> NotebookResult:
    """Execute one notebook into out_dir (ipynb + html). A failing notebook still gets its HTML, with the error."""
    import nbformat  # deferred: nbformat is heavy, importing this module must not load it
    import papermill as pm  # deferred: papermill is heavy, importing this module must not load it

    src_dir = notebooks_dir or project_notebooks_dir()
    src = (src_dir / f"{name}.ipynb").resolve()
    if src.parent != src_dir.resolve() or not src.is_file():
        raise KvscopeError(f"notebook {name!r} not found in {src_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_nb = out_dir / f"{name}.ipynb"
    t0, cpu0 = time.perf_counter(), _cpu_s()
    error = None
    try:
        with _kernel_environment(), _kernel_stderr_to(out_dir / "logs" / f"{name}.kernel.log"), \
                tempfile.TemporaryDirectory(prefix="kvscope-kernel-") as sockets:
            pm.execute_notebook(str(src), str(out_nb), parameters=parameters, kernel_name="python3",
                                progress_bar=False, cwd=str(src_dir), execution_timeout=timeout_s,
                                request_save_on_cell_execute=False, config=_kernel_config(Path(sockets)))
    except Exception as exc:  # noqa: BLE001 - papermill raises PapermillExecutionError and kernel errors
        error = f"{exc.__class__.__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    html_path = None
    if out_nb.exists():
        body, _ = _html_exporter(show_input).from_notebook_node(nbformat.read(out_nb, as_version=4))
        html_path = out_dir / f"{name}.html"
        html_path.write_text(body)
    fig_dir = Path(parameters.get("figures_dir") or out_dir / "figures" / name)
    figures = sorted(fig_dir.glob("*.png")) if fig_dir.exists() else []
    return NotebookResult(name, error is None, html_path, out_nb if out_nb.exists() else None,
                          time.perf_counter() - t0, error, figures, _cpu_s() - cpu0)


@contextmanager
def _kernel_stderr_to(log_path: Path) -> Iterator[None]:
    """A notebook's kernel writes its own messages to ``log_path`` instead of the user's terminal.

    The kernel inherits this process's stderr (file descriptor 2) when papermill starts it, and papermill has no
    way to pass it another. Its messages are not the user's business: jupyter_client interrupts every kernel at
    shutdown, ipykernel logs "KeyboardInterrupt caught in kernel" and, when the interrupt races the shutdown, a
    ZMQ traceback from a socket already closed (seen with several kernels at once). The notebook's own errors
    still come back through papermill. Descriptor 2 of this process points at the log while the kernel starts
    and runs (a pool process runs one notebook at a time; a serial report is single-threaded here)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (a notebook's kernel counts once it has exited).
    Notebooks run one after another in a process, so the difference around one is that notebook's CPU."""
    try:
        import resource  # optional: resource is Unix-only, the ImportError is handled
    except ImportError:  # not POSIX: wall time only
        return math.nan
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def notebook_has_error_cells(path: Path) -> list[int]:
    """Indices of cells whose outputs contain an error (papermill marks failures this way)."""
    import nbformat  # deferred: nbformat is heavy, importing this module must not load it

    nb = nbformat.read(path, as_version=4)
    return [i for i, c in enumerate(nb.cells) if c.get("cell_type") == "code"
            and any(o.get("output_type") == "error" for o in c.get("outputs", []))]


def render_report(run_dir: str | Path, notebooks: list[str] | None = None, notebooks_dir: str | Path | None = None,
                  show_input: bool = False, extra_parameters: dict[str, dict[str, Any]] | None = None,
                  progress: bool = True) -> Path:
    """Execute the notebooks on an experiment (or replay run) directory; returns the path of index.html."""
    run_dir = Path(run_dir).resolve()
    res = load_results(run_dir)  # validates the directory before any notebook runs
    all_notebooks = page_names()
    names = notebooks or (res.spec.notebooks if res.spec else None) or all_notebooks
    unknown = [n for n in names if n not in all_notebooks and notebooks_dir is None]
    if unknown:
        raise KvscopeError(f"unknown notebook(s) {', '.join(unknown)}; available: {', '.join(all_notebooks)}")
    report_dir = run_dir / "report"
    report_dir.mkdir(exist_ok=True)
    nb_dir = Path(notebooks_dir).resolve() if notebooks_dir else None
    params_by_nb = _parameters(res.spec, extra_parameters or {})
    jobs = {name: {"experiment_dir": str(run_dir), "figures_dir": str(report_dir / "figures" / name),
                   **params_by_nb.get(name, {})} for name in names}
    results = _execute_notebooks(jobs, report_dir, nb_dir, show_input, progress)
    results = _keep_earlier_results(report_dir, results)
    index = write_index(res, report_dir, results)
    write_result_file(report_dir / REPORT_NAME, ReportFile, ReportFile(notebooks=[
        NotebookEntry(notebook=r.name, ok=r.ok, error=r.error, seconds=round(r.seconds, 2),
                      html=r.html.name if r.html else None,
                      figures=[str(f.relative_to(report_dir)) for f in r.figures]) for r in results]))
    return index


KERNEL_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Set to 1 for every kernel (unless the user set them): see :func:`_kernel_environment`."""


@contextmanager
def _kernel_environment() -> Iterator[None]:
    """The environment a notebook's kernel starts with (it inherits this process's): one BLAS/OpenMP thread.

    The notebooks' matrices are small (the A/B bootstrap's draws x sessions products) and the report already runs
    one kernel per core, so a BLAS thread pool only synchronises, and on a busy machine its threads spin for
    nothing: far more CPU than one thread for the same matrix-vector product (figure: benchmarks/README.md,
    "Figures the design notes cite"). Restored afterwards (the serial report runs in
    the caller's process); a value the user set is kept."""
    added = [name for name in KERNEL_THREAD_VARIABLES if name not in os.environ]
    os.environ.update({name: "1" for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _kernel_config(sockets: Path) -> Any:
    """Kernel manager configuration: ZMQ over Unix sockets in ``sockets`` (a fresh directory per notebook) where
    the platform has them, TCP on loopback elsewhere (Windows).

    Why not TCP. jupyter_client picks a kernel's five TCP ports by binding port 0 and closing it; the kernel binds
    them a moment later. Another process (a second kernel of this report, anyone on the machine) can take a port
    in between, and the kernel dies (seen in the test suite on a heavily loaded host). Unix sockets named inside
    a private directory cannot be taken by anyone else, so kernels can start at the same moment."""
    # deferred: traitlets is heavy, importing this module must not load it
    from traitlets.config import Config

    config = Config()
    if os.name == "posix":
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = str(sockets / "k")  # sockets k-1 … k-5; short: Unix socket paths hold ~107 bytes
    return config


def report_workers(notebooks: int) -> int:
    """Processes that execute notebooks at once: one per CPU this process may use (``KVSCOPE_REPORT_WORKERS``
    overrides), at most one per notebook. Each notebook's kernel is its own process, so the pool's processes
    only wait on them; kernels talk over Unix sockets (:func:`_kernel_config`), so parallel start-ups cannot
    collide on ports. Where there are no Unix sockets (Windows) the default stays serial."""
    configured = os.environ.get("KVSCOPE_REPORT_WORKERS", "")
    if configured and not (configured.isdigit() and int(configured) >= 1):
        raise KvscopeError(f"KVSCOPE_REPORT_WORKERS={configured!r}: allowed is a whole number >= 1")
    workers = int(configured) if configured else _usable_cpus() if os.name == "posix" else 1
    return max(1, min(workers, notebooks))


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def _execute_notebooks(jobs: dict[str, dict[str, Any]], report_dir: Path, nb_dir: Path | None,
                       show_input: bool, progress: bool) -> list[NotebookResult]:
    """Execute the notebooks (independent of each other) in a process pool, the costliest first so the
    slowest one does not start last; results come back in the order of ``jobs``."""
    workers = report_workers(len(jobs))
    pages = page_by_name()
    order = sorted(jobs, key=lambda n: -(pages[n].relative_cost if n in pages else 1.0))
    if progress:
        print(f"report: executing {', '.join(order)} ({workers} at a time) …", flush=True)
    done: dict[str, NotebookResult] = {}

    def report(r: NotebookResult) -> None:
        done[r.name] = r
        if progress:
            cpu = f", {r.cpu_s:.1f} s CPU" if r.cpu_s is not None and not math.isnan(r.cpu_s) else ""
            print(f"report: {r.name} {'ok' if r.ok else 'FAILED: ' + str(r.error)} ({r.seconds:.1f} s{cpu})", flush=True)

    if workers == 1:
        for name in order:
            report(run_notebook(name, report_dir, jobs[name], nb_dir, show_input))
    else:
        # spawn: the parent may hold threads (server watchers, tqdm) that fork would copy in a locked state
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(run_notebook, name, report_dir, jobs[name], nb_dir, show_input) for name in order]
            for future in as_completed(futures):
                report(future.result())
    return [done[name] for name in jobs]


def _keep_earlier_results(report_dir: Path, results: list[NotebookResult]) -> list[NotebookResult]:
    """Notebooks rendered earlier and not re-run this time stay listed (a subset re-run keeps the index whole)."""
    if not (report_dir / REPORT_NAME).exists():
        return results
    done = {r.name for r in results}
    kept = []
    for entry in load_report_file(report_dir / REPORT_NAME).notebooks:
        html_file = report_dir / (entry.html or "")
        if entry.notebook not in done and entry.html and html_file.exists():
            kept.append(NotebookResult(entry.notebook, entry.ok, html_file, report_dir / f"{entry.notebook}.ipynb",
                                       entry.seconds, entry.error, [report_dir / f for f in entry.figures]))
    order = {n: i for i, n in enumerate(page_names())}
    return sorted(kept + results, key=lambda r: order.get(r.name, len(order)))


def _parameters(spec: ExperimentSpecCore | None, extra: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per notebook: what the experiment's validated spec (none for a single replay run) gives it (registry ``from_spec``), then ``extra`` over it;
    an extra parameter a registered notebook does not declare is an error naming the allowed ones."""
    pages = page_by_name()
    out = {nb.name: nb.from_spec(spec) if spec is not None else {} for nb in pages.values()}
    for name, params in extra.items():
        nb = pages.get(name)
        bad = [k for k in params if nb is not None and not nb.accepts(k)]
        if bad:
            raise KvscopeError(f"notebook {name}: unknown parameter(s) {', '.join(bad)}; allowed: "
                               f"{', '.join(nb.parameters) or 'none besides experiment_dir, figures_dir'}")
        out.setdefault(name, {}).update(params)
    return out


def _fmt(x: Any, kind: str) -> str:
    if nan_to_none(x) is None:
        return "–"
    if kind == "pct":
        return f"{x:.1%}"
    if kind == "ms":
        return f"{x * 1000:.1f}"
    if kind == "f":
        return f"{x:.2f}"
    return html.escape(str(x))


def glossary_html() -> str:
    """The report's words (`analysis.glossary`), one definition each, as every page uses them."""
    items = "".join(f"<dt><b>{html.escape(term)}</b></dt><dd>{html.escape(words)}</dd>" for term, words in TERMS.items())
    return f'<h2 id="glossary">Words used in this report</h2><dl class="glossary">{items}</dl>'


def write_index(res, report_dir: Path, results: list[NotebookResult]) -> Path:
    e = html.escape
    cells = res.cells
    rows = []
    for _, c in cells.iterrows():
        rows.append(
            "<tr>" + "".join(f"<td>{v}</td>" for v in [
                e(str(c.get("cell"))), e(str(c.get("status"))), _fmt(c.get("requests"), "s"),
                _fmt(c.get("failed"), "s"), _fmt(c.get("hit_server"), "pct"), _fmt(c.get("hit_predicted"), "pct"),
                _fmt(c.get("would_hit"), "pct"), _fmt(c.get("ttft_p50_s"), "ms"), _fmt(c.get("tpot_p50_s"), "ms"),
                _fmt(c.get("req_per_s"), "f"), _fmt(c.get("spec_acceptance_rate"), "pct"),
                e(str(c.get("reason") or ""))]) + "</tr>")
    pages = page_by_name()
    links = []
    for r in results:
        status = "ok" if r.ok else f"failed: {e(r.error or '')}"
        title = f": {e(pages[r.name].title)}" if r.name in pages else ""
        if r.html:
            links.append(f'<li><a href="{e(r.html.name)}">{e(r.name)}</a>{title} — {status} ({r.seconds:.0f} s)</li>')
        else:
            links.append(f"<li>{e(r.name)}{title} — {status}</li>")
    figs = []
    by_name = {r.name: r for r in results}
    for entry in pages.values():
        r = by_name.get(entry.name)
        if r is None:
            continue
        nb = entry.name
        for fig in entry.key_figures:
            for f in r.figures:
                if f.stem == fig:
                    rel = f.relative_to(report_dir)
                    figs.append(f'<figure><a href="{e(nb)}.html"><img src="{e(str(rel))}" alt="{e(fig)}"></a>'
                                f"<figcaption>{e(nb)}: {e(fig.replace('_', ' '))}</figcaption></figure>")
    failed = cells[~cells["status"].isin(["ok", "skipped"])] if "status" in cells else cells.iloc[0:0]
    failed_html = "".join(f"<li>{e(str(c['cell']))}: {e(str(c.get('reason') or c.get('status')))}</li>"
                          for _, c in failed.iterrows())
    warn = ""
    if res.weights_random:
        warn = ("<p class=warn>The model has <b>random weights</b>: greedy output repeats itself, so n-gram "
                "speculative decoding looks far better accepted than it would be with a real model.</p>")
    desc = e(res.spec.description if res.spec else "")
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvscope — {e(res.name)}</title>
<meta http-equiv="Content-Security-Policy" content="{e(REPORT_CSP)}">
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}td:first-child,th:first-child{{text-align:left}}
figure{{display:inline-block;margin:0.5em;width:45%}}img{{max-width:100%}}.warn{{background:#fff3cd;padding:0.5em}}</style>
</head><body>
<h1>kvscope report: {e(res.name)}</h1>
{findings_html(report_dir, list(pages))}
<p>{desc}</p>
<p>Run directory: <code>{e(str(res.root))}</code> — {len(cells)} cells, {len(res.requests)} request records.</p>
{warn}
{on_gpu_html(res)}
{audit_html(res, report_dir)}
{glossary_html()}
<h2>Reports</h2><ul>{''.join(links)}</ul>
<h2>Key figures</h2>{''.join(figs) or '<p>none</p>'}
<h2>Cells</h2>
<table><tr><th>cell</th><th>status</th><th>requests</th><th>failed</th><th>hit (server)</th><th>hit (predicted)</th>
<th>would hit</th><th>TTFT p50 ms</th><th>TPOT p50 ms</th><th>req/s</th><th>spec accept</th><th>reason</th></tr>
{''.join(rows)}</table>
<h2>Failed cells</h2><ul>{failed_html or '<li>none</li>'}</ul>
<p><small>generated by kvscope {e(res.experiment.kvscope_version)} at {e(time.strftime('%Y-%m-%d %H:%M:%S'))}</small></p>
</body></html>
"""
    index = report_dir / "index.html"
    index.write_text(doc)
    return index


def render_compare(run_a: str | Path, run_b: str | Path, out_dir: str | Path, label_a: str = "A", label_b: str = "B",
                   show_input: bool = False, resamples: int = 2000) -> Path:
    """Render the ab_compare notebook for any two runs (replay run or cell directories)."""
    out = Path(out_dir).resolve()
    params = {"experiment_dir": "", "run_a": str(Path(run_a).resolve()), "run_b": str(Path(run_b).resolve()),
              "label_a": label_a, "label_b": label_b, "resamples": resamples,
              "figures_dir": str(out / "figures" / "ab_compare")}
    r = run_notebook("ab_compare", out, params, show_input=show_input)
    if not r.ok:
        raise KvscopeError(f"ab_compare failed: {r.error} (see {r.html})")
    assert r.html is not None
    return r.html
