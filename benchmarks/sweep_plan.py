"""What a predicted sweep plan (``sweep.plan: predicted``) would have measured on recorded experiments.

For each sweep of each experiment directory given (experiment.json version 1 or 2) that recorded a predicted
curve, the plan (`analysis.capacity.next_planned_level`) is run offline on that curve, each level it asks for
answered from the sweep's recorded measurements: the levels it measures, the predicted and measured edges, the
levels a full climb to one past the measured edge measures, and the live cells saved. A level the plan asks for
that the recording does not hold ends the replay there (said in the table). No server, no GPU.

Usage:
  python benchmarks/sweep_plan.py RUN_DIR [RUN_DIR ...] [--max-extra 3] [--json benchmarks/results/sweep_plan.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def replay_plan(entry, max_extra: int) -> dict | None:
    """The plan on one recorded capacity entry, or None without a predicted curve."""
    from kvscope.harness.analysis.capacity import (LoadPoint, capacity_from_points, full_climb_levels,
                                                   measured_bracket, next_planned_level, plan_from_prediction,
                                                   predicted_point, TtftSlo)

    pred = entry.predicted
    if pred is None or not pred.levels or entry.slo_ttft_p90_ms is None:
        return None
    curve = [predicted_point(lv.load, lv.ttft_p90_s,
                             lv.preemptions_p50 if lv.preemptions_p50 is not None else lv.preemptions)
             for lv in pred.levels]
    recorded = {p.load: LoadPoint(p.load, p.ttft_p90_s, p.preemptions) for p in entry.points}
    relative = entry.slo_ttft_p90 is not None
    slo = TtftSlo(unloaded_factor=float(entry.slo_ttft_p90.removesuffix("x_unloaded"))) if relative \
        else TtftSlo(ms=entry.slo_ttft_p90_ms)
    measured: list[LoadPoint] = []
    missing = None
    while True:
        resolved = capacity_from_points(entry.server, entry.workload, "concurrency", measured, slo).slo_ttft_p90_ms
        plan = plan_from_prediction(curve, resolved if resolved is not None else entry.slo_ttft_p90_ms,
                                    unloaded=relative)
        level = next_planned_level(plan, measured, resolved, max_extra)
        if level is None:
            break
        if level not in recorded:
            missing = level
            break
        measured.append(recorded[level])
    slo_ms = capacity_from_points(entry.server, entry.workload, "concurrency", measured, slo).slo_ttft_p90_ms
    order = [p.load for p in measured]
    cands = list(plan.candidates)
    lo, hi = measured_bracket(cands, measured, slo_ms)
    cap = capacity_from_points(entry.server, entry.workload, "concurrency", measured, slo)
    full = full_climb_levels(cands, measured, slo_ms)
    return {"server": entry.server, "workload": entry.workload, "predicted_capacity": plan.predicted_capacity,
            "predicted_edge": plan.predicted_edge, "targets": list(plan.targets), "plan_measures": order,
            "missing_level": missing, "measured_edge": cands[hi] if hi < len(cands) else None,
            "plan_capacity": cap.capacity, "recorded_capacity": entry.capacity,
            "recorded_levels": [p.load for p in entry.points], "full_climb": full,
            "live_cells_saved": full - len(order), "saved_vs_recorded": len(entry.points) - len(order)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="experiment run directories")
    ap.add_argument("--max-extra", type=int, default=3, help="the plan's search bound (sweep.max_bisections)")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "sweep_plan.json")
    args = ap.parse_args()
    from kvscope.harness.common.errors import KvscopeError
    from kvscope.harness.results.loaders import load_experiment_file

    rows = []
    for run in args.runs:
        try:
            exp = load_experiment_file(run)
        except KvscopeError as exc:
            print(f"sweep_plan: {exc}", file=sys.stderr)
            return 2
        for entry in exp.capacity or []:
            row = replay_plan(entry, args.max_extra)
            if row is None:
                print(f"{run.name} {entry.server}: no predicted curve "
                      f"({entry.predicted.skipped if entry.predicted else 'not recorded'}); the ladder measured "
                      f"{len(entry.points)} levels")
                continue
            rows.append({"run": str(run), **row})
            fmt = ", ".join(f"{x:g}" for x in row["plan_measures"])
            print(f"{run.name} {row['server']}: predicted edge {row['predicted_edge']}, measured edge "
                  f"{row['measured_edge']}; the plan measures {fmt} ({len(row['plan_measures'])} levels; the "
                  f"recorded ladder {len(row['recorded_levels'])}, a full climb {row['full_climb']}: "
                  f"{row['live_cells_saved']} saved); capacity {row['plan_capacity']} (recorded "
                  f"{row['recorded_capacity']})" + (f"; stopped: level {row['missing_level']:g} not recorded"
                                                    if row["missing_level"] is not None else ""))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
