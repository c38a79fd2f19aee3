"""`kvscope experiment …`, `kvscope report`, `kvscope compare`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import re
import time

from kvscope.harness.cli.common import Formatter as _Formatter
from kvscope.harness.common.errors import KvscopeError


def add_subcommands(sub) -> None:
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
    run.add_argument("--executor", choices=("local", "ray"), default="local",
                     help="local: one host, servers one after another (default); ray: one Ray actor per server "
                          "configuration, in parallel across a cluster (docs/cluster.md; needs kvscope[ray])")
    run.add_argument("--ray-address", metavar="ADDR",
                     help="--executor ray: the cluster to join, e.g. 10.0.0.1:6379 or ray://head:10001 "
                          "(default: RAY_ADDRESS, else a new single-node cluster)")
    run.add_argument("--ray-files", choices=("auto", "shared", "ship"),
                     help="--executor ray: write cells to the shared run directory or ship them back to this "
                          "host (default: the spec's executor.files, auto)")
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

    cmp_ = sub.add_parser(
        "compare", help="A/B verdicts: repeats of A against repeats of B (hierarchical bootstrap)",
        description="B relative to A, per metric of summary.json: a 95% interval of B - A from a bootstrap that "
                    "resamples runs, then sessions within a run (paired on identical traffic), and a verdict: "
                    "better / worse (beyond a 5% margin), equivalent (inside it), inconclusive, or by_construction. "
                    "Benjamini-Hochberg across the metrics. With one run a side latency and throughput stay "
                    "inconclusive (unless --run-noise-from gives repeats).\n\n"
                    "  kvscope compare RUN_A RUN_B\n"
                    "  kvscope compare A_RUN [A_RUN ...] --vs B_RUN [B_RUN ...] [--json FILE]\n"
                    "  kvscope compare EXPERIMENT_DIR --a SERVER --b SERVER [--workload W] [--load L]",
        formatter_class=_Formatter)
    cmp_.add_argument("runs", metavar="RUN", nargs="+",
                      help="replay run or cell directories of A (or RUN_A RUN_B, or one EXPERIMENT_DIR with --a/--b)")
    cmp_.add_argument("--vs", metavar="RUN", nargs="+", help="the runs (repeats) of B")
    cmp_.add_argument("--a", dest="server_a", metavar="SERVER", help="experiment mode: server configuration A")
    cmp_.add_argument("--b", dest="server_b", metavar="SERVER", help="experiment mode: server configuration B")
    cmp_.add_argument("--workload", metavar="W", help="experiment mode: the workload (needed when there are several)")
    cmp_.add_argument("--load", metavar="L", help="experiment mode: the load level, e.g. c1 (needed when several)")
    cmp_.add_argument("--json", metavar="FILE", help='write {"metrics": [{"metric", "a", "b", "diff", "ci_low", '
                                                    '"ci_high", "verdict", ...}, ...]} here')
    cmp_.add_argument("--run-noise-from", metavar="RUN", nargs="+",
                      help="repeats whose spread is the run-to-run noise, for one run a side (experiment cells are "
                           "grouped by configuration, workload and load and pooled; the estimate's degrees of "
                           "freedom widen the interval)")
    cmp_.add_argument("--out", metavar="DIR", help="where to write the report (default: results/compare/A_vs_B)")
    cmp_.add_argument("--label-a", default=None)
    cmp_.add_argument("--label-b", default=None)
    cmp_.add_argument("--resamples", type=int, default=2000)
    cmp_.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    cmp_.add_argument("--no-html", action="store_true", help="print the verdict table only")
    cmp_.add_argument("--force", action="store_true", help="compare runs even if they replayed different traces")
    cmp_.set_defaults(func=_cmd_compare)


def _cmd_cells(args: argparse.Namespace) -> int:
    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.experiment.runner import describe_plan, plan_cells
    from kvscope.harness.experiment.spec import load_experiment_spec  # deferred: keeps `kvscope --help` fast

    spec, _ = load_experiment_spec(args.spec)
    print(f"# {describe_plan(spec)}")
    for i, c in enumerate(plan_cells(spec), start=1):
        print(f"{i:4d}  {c.name}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from kvscope.harness.report.render import render_report  # deferred: keeps `kvscope --help` fast

    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.experiment.runner import phase_report, run_experiment
    from kvscope.harness.results.loaders import load_experiment_file  # deferred: keeps `kvscope --help` fast

    phases_s: dict[str, float] = {}
    if args.executor == "ray":
        # deferred: keeps `kvscope --help` fast
        from kvscope.harness.experiment.ray_executor import import_ray, run_experiment_ray

        import_ray()  # the one-line hint before anything is written
        run_dir = run_experiment_ray(args.spec, out=args.out, run_id=args.run_id, resume=args.resume,
                                     only_cells=args.cells, address=args.ray_address, files=args.ray_files)
    elif args.ray_address or args.ray_files:
        raise KvscopeError("--ray-address and --ray-files go with --executor ray")
    else:
        run_dir = run_experiment(args.spec, out=args.out, run_id=args.run_id, resume=args.resume,
                                 only_cells=args.cells, phases_s=phases_s)

    recorded = load_experiment_file(run_dir)
    failed = recorded.failed_cells or []
    print(f"\nexperiment directory: {run_dir}")
    if failed:
        print(f"{len(failed)} cell(s) failed:")
        for name in failed:
            cell = recorded.cells.get(name)
            status, reason = (cell.status, cell.reason) if cell is not None else ("missing", None)
            print(f"  {name}: {status}: {reason or 'not run'}")
    if not args.no_report:
        t0 = time.perf_counter()
        index = render_report(run_dir)
        phases_s["report"] = time.perf_counter() - t0
        print(f"report: {index}")
    if phases_s:  # where the wall time went (the local executor's phases; a slow machine's hour, explained)
        print(phase_report(phases_s))
    return 1 if failed else 0


def _cmd_report(args: argparse.Namespace) -> int:
    from kvscope.harness.report.render import render_report  # deferred: keeps `kvscope --help` fast
    from kvscope.harness.results.loaders import load_report_file  # deferred: keeps `kvscope --help` fast

    names = [n.strip() for n in args.notebooks.split(",")] if args.notebooks else None
    index = render_report(args.dir, names, args.notebooks_dir, args.show_input)
    report = load_report_file(index.parent)
    print(f"report: {index}")
    return 0 if all(r.ok for r in report.notebooks) else 1


def _compare_sides(args: argparse.Namespace) -> tuple[list, list, str, str]:
    """(A runs, B runs, label A, label B) from the three ways of naming them."""
    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.analysis.ab import runs_from_dirs, runs_from_experiment

    if args.server_a or args.server_b:
        if not (args.server_a and args.server_b) or len(args.runs) != 1 or args.vs:
            raise KvscopeError("compare: experiment mode is EXPERIMENT_DIR --a SERVER --b SERVER (one directory, "
                               "both --a and --b, no --vs)")
        root = Path(args.runs[0])
        a = runs_from_experiment(root, args.server_a, args.workload, args.load)
        b = runs_from_experiment(root, args.server_b, args.workload, args.load)
        return a, b, args.server_a, args.server_b
    if args.workload or args.load:
        raise KvscopeError("compare: --workload and --load select cells of an experiment; give --a and --b too")
    if args.vs:
        a_dirs, b_dirs = args.runs, args.vs
    elif len(args.runs) == 2:
        a_dirs, b_dirs = args.runs[:1], args.runs[1:]
    else:
        raise KvscopeError(f"compare: got {len(args.runs)} runs and no --vs; give RUN_A RUN_B, "
                           "A_RUN ... --vs B_RUN ..., or EXPERIMENT_DIR --a SERVER --b SERVER")
    for d in [*a_dirs, *b_dirs]:
        if (Path(d) / "experiment.json").exists():
            raise KvscopeError(f"compare: {d} is an experiment; choose its servers with --a SERVER --b SERVER")
    _check_comparable([Path(d) for d in [*a_dirs, *b_dirs]], force=args.force)

    def label(dirs: list[str]) -> str:
        first = Path(dirs[0]).name
        return first if len(dirs) == 1 else f"{first} (+{len(dirs) - 1} runs)"

    return runs_from_dirs(a_dirs), runs_from_dirs(b_dirs), label(a_dirs), label(b_dirs)


def _check_comparable(dirs: list[Path], force: bool) -> None:
    """Every run replayed the same trace (paired differences need it) and holds request records."""
    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.results.comparable import check_has_records, check_same_trace
    from kvscope.harness.results.records import read_records  # deferred: keeps `kvscope --help` fast

    for d in dirs:
        check_same_trace(dirs[0], d, force=force)
        check_has_records(d, len(read_records(d)))


def _cmd_compare(args: argparse.Namespace) -> int:
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.analysis.ab import compare, estimate_run_noise, runs_from_dirs, verdicts_json

    a_runs, b_runs, label_a, label_b = _compare_sides(args)
    label_a, label_b = args.label_a or label_a, args.label_b or label_b
    noise = estimate_run_noise(runs_from_dirs(args.run_noise_from)) if args.run_noise_from else None
    table = compare(a_runs, b_runs, resamples=args.resamples, seed=args.seed, run_noise=noise)
    shown = table[["metric", "a", "b", "diff", "ci_low", "ci_high", "relative", "p_adjusted", "verdict"]]
    with pd.option_context("display.width", 160, "display.max_columns", 20,
                           "display.float_format", lambda x: f"{x:.4g}"):
        print(f"A = {label_a} ({len(a_runs)} run(s))\nB = {label_b} ({len(b_runs)} run(s))"
              f"\npaired: {bool(table['paired'].all()) if len(table) else False}\n")
        print(shown.to_string(index=False))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(verdicts_json(table), indent=1) + "\n")
        print(f"\nverdicts: {args.json}")
    if not args.no_html:
        _compare_html(args, label_a, label_b)
    return 0


def _compare_html(args: argparse.Namespace, label_a: str, label_b: str) -> None:
    from kvscope.harness.report.render import render_compare  # deferred: keeps `kvscope --help` fast

    if args.server_a or args.vs:
        print("\n(no HTML report for several runs a side: `kvscope report` on the experiment shows them)")
        return
    out = Path(args.out) if args.out else Path("results") / "compare" / f"{_safe(label_a)}_vs_{_safe(label_b)}"
    html = render_compare(Path(args.runs[0]), Path(args.runs[1]), out, label_a, label_b, resamples=args.resamples)
    print(f"\nreport: {html}")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:60] or "run"

