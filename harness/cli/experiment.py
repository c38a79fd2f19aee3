"""`kvscope experiment …`, `kvscope report`, `kvscope compare`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_subcommands(sub) -> None:
    from kvscope.harness.cli.common import Formatter as _Formatter

    exp = sub.add_parser("experiment", help="run parameterised experiments (servers x workloads x loads x repeats)",
                         description="Run an experiment spec: every server configuration once, every cell against "
                                     "it, then the notebook report.", formatter_class=_Formatter)
    esub = exp.add_subparsers(dest="experiment_command", metavar="ACTION", title="actions")
    run = esub.add_parser("run", help="run (or resume) an experiment and render its report",
                          description="Run SPEC. Writes results/<experiment>/<run-id>/ (experiment.json, traces/, "
                                      "servers/, cells/<cell>/) and report/index.html.", formatter_class=_Formatter)
    run.add_argument("spec", metavar="SPEC", help="experiment spec YAML (see experiments/)")
    run.add_argument("--out", default="results", metavar="DIR", help="results root (default results/)")
    run.add_argument("--run-id", metavar="ID", help="name of the run directory (default: a timestamp)")
    run.add_argument("--resume", action="store_true", help="finish the latest (or --run-id) run: skip cells that are ok")
    run.add_argument("--cells", metavar="NAME", nargs="+", help="run only these cells")
    run.add_argument("--no-report", action="store_true", help="skip the notebook report")
    run.set_defaults(func=_cmd_run)
    cells = esub.add_parser("cells", help="list the cells of a spec in the order they run", formatter_class=_Formatter)
    cells.add_argument("spec", metavar="SPEC")
    cells.set_defaults(func=_cmd_cells)

    rep = sub.add_parser("report", help="execute the analysis notebooks on an experiment or run directory",
                         description="Execute the notebooks with papermill into DIR/report/ and render HTML (input "
                                     "cells hidden), plus index.html with every report and the key figures.",
                         formatter_class=_Formatter)
    rep.add_argument("dir", metavar="DIR", help="experiment run directory or a replay run directory")
    rep.add_argument("--notebooks", metavar="NAMES", help="comma-separated subset (default: all)")
    rep.add_argument("--notebooks-dir", metavar="DIR", help="execute notebooks from this folder instead of the "
                                                            "project's notebooks/ (only when you name it)")
    rep.add_argument("--show-input", action="store_true", help="keep code cells in the HTML")
    rep.set_defaults(func=_cmd_report)

    cmp_ = sub.add_parser("compare", help="A/B comparison of two runs on identical traffic (HTML + verdict table)",
                          description="Pair the requests of RUN_A and RUN_B by trace request id and report paired "
                                      "differences with 95% bootstrap intervals and a verdict per metric.",
                          formatter_class=_Formatter)
    cmp_.add_argument("run_a", metavar="RUN_A", help="replay run or experiment cell directory")
    cmp_.add_argument("run_b", metavar="RUN_B")
    cmp_.add_argument("--out", metavar="DIR", help="where to write the report (default: results/compare/A_vs_B)")
    cmp_.add_argument("--label-a", default=None)
    cmp_.add_argument("--label-b", default=None)
    cmp_.add_argument("--resamples", type=int, default=2000)
    cmp_.add_argument("--no-html", action="store_true", help="print the verdict table only")
    cmp_.add_argument("--force", action="store_true", help="compare runs even if they replayed different traces")
    cmp_.set_defaults(func=_cmd_compare)


def _cmd_cells(args: argparse.Namespace) -> int:
    from kvscope.harness.experiment.runner import plan_cells
    from kvscope.harness.experiment.spec import load_experiment_spec

    spec, _ = load_experiment_spec(args.spec)
    for i, c in enumerate(plan_cells(spec), start=1):
        print(f"{i:4d}  {c.name}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from kvscope.harness.report.render import render_report
    from kvscope.harness.experiment.runner import run_experiment

    run_dir = run_experiment(args.spec, out=args.out, run_id=args.run_id, resume=args.resume, only_cells=args.cells)

    manifest = json.loads((run_dir / "experiment.json").read_text())
    failed = manifest.get("failed_cells") or []
    print(f"\nexperiment directory: {run_dir}")
    if failed:
        print(f"{len(failed)} cell(s) failed:")
        for name in failed:
            cell = manifest["cells"].get(name) or {}
            print(f"  {name}: {cell.get('status')}: {cell.get('reason') or 'not run'}")
    if not args.no_report:
        index = render_report(run_dir)
        print(f"report: {index}")
    return 1 if failed else 0


def _cmd_report(args: argparse.Namespace) -> int:
    from kvscope.harness.report.render import render_report

    names = [n.strip() for n in args.notebooks.split(",")] if args.notebooks else None
    index = render_report(args.dir, names, args.notebooks_dir, args.show_input)
    report = json.loads((index.parent / "report.json").read_text())
    print(f"report: {index}")
    return 0 if all(r["ok"] for r in report) else 1


def _cmd_compare(args: argparse.Namespace) -> int:
    import pandas as pd

    from kvscope.harness.analysis.ab import compare_runs
    from kvscope.harness.report.render import render_compare
    from kvscope.harness.results.loaders import load_results

    a, b = Path(args.run_a), Path(args.run_b)
    label_a = args.label_a or a.name
    label_b = args.label_b or b.name
    from kvscope.harness.results.comparable import check_has_records, check_same_trace

    check_same_trace(a, b, force=args.force)
    req_a, req_b = load_results(a).requests, load_results(b).requests
    check_has_records(a, len(req_a)), check_has_records(b, len(req_b))
    table = compare_runs(req_a, req_b, resamples=args.resamples)
    with pd.option_context("display.width", 160, "display.max_columns", 20,
                           "display.float_format", lambda x: f"{x:.4g}"):
        print(f"A = {label_a}\nB = {label_b}\n")
        print(table.to_string(index=False))
    if not args.no_html:
        out = Path(args.out) if args.out else Path("results") / "compare" / f"{_safe(label_a)}_vs_{_safe(label_b)}"
        html = render_compare(a, b, out, label_a, label_b, resamples=args.resamples)
        print(f"\nreport: {html}")
    return 0


def _safe(name: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:60] or "run"

