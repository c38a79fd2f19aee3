"""Early stopping of repeats (``repeats: {max: 5, min: 2, stop_early: true}``): the runner's side.

The statistics (a group-sequential paired t-test whose error rate holds under repeated looks) are
:mod:`kvscope.harness.analysis.sequential`; this module only decides *when* to look and what to skip. Cells run
repeat-major (A B A B …), so after the last cell of repeat r of a workload x load group every configuration has
r + 1 repeats there; from `min` on, the group's comparisons (each configuration against the baseline, on each
requested metric) are looked at, and once every verdict of the group is decided its remaining repeats are
skipped (status ``skipped``) and the console says so: ``[agent-coding c2] stopped after 3 of 5 repeats: all 4
verdicts decided``. experiment.json records, per comparison, the repeats used, why it stopped and each verdict
(`sequential`). The state is recomputed from the finished cells' summaries at every look, so ``--resume`` gets
the same decisions without any state of its own. A group is one workload at one load: a configuration's cells
of other groups are other experiments as far as the verdicts go.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.harness.analysis.sequential import (DECIDED, SequentialOutcome, SequentialRule, run_sequence,
                                                 run_statistic)
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.results.schemas import SequentialEntry, SequentialVerdictEntry
from kvscope.harness.results.summary import summary_file_model

if TYPE_CHECKING:
    from kvscope.harness.experiment.runner import Cell, RunContext

FINISHED = ("ok", "failed")


class EarlyStop:
    """Looks after each completed round of a group and skips the repeats its decided verdicts do not need."""

    def __init__(self, run: "RunContext") -> None:
        spec = run.spec
        self.run = run
        self.repeats = spec.repeats
        self.rule = SequentialRule(spec.repeats.first_look, spec.repeats.max, spec.repeats.alpha,
                                   spec.repeats.spending)
        self.baseline = spec.repeats.baseline or next(iter(spec.servers))
        self.others = [s for s in spec.servers if s != self.baseline]
        self.metrics = list(spec.repeats.metrics)
        self.stopped: dict[tuple[str, str], int] = {}  # group -> repeats it used
        self._stats: dict[str, dict[str, float | None]] = {}  # cell -> metric -> value (summaries read once)

    # ---- reading -------------------------------------------------------------------------------------
    def _cell_stats(self, name: str) -> dict[str, float | None] | None:
        entry = self.run.manifest.cells.get(name)
        if entry is None or entry.status != "ok":
            return None
        if name not in self._stats:
            path = self.run.run_dir / (entry.dir or f"cells/{name}") / "summary.json"
            try:
                summary = summary_file_model().model_validate_json(path.read_text())
            except (OSError, ValueError):
                return None
            self._stats[name] = {m: run_statistic(summary, m) for m in self.metrics}
        return self._stats[name]

    def _cell_name(self, server: str, workload: str, load: str, repeat: int) -> str:
        return f"{server}__{workload}__{load}__r{repeat}"

    def _rounds_done(self, workload: str, load: str) -> int:
        """Repeats 0 … n-1 finished (ok or failed) for every configuration of the group."""
        cells = self.run.manifest.cells
        n = 0
        while n < self.repeats.max:
            names = [self._cell_name(s, workload, load, n) for s in self.run.spec.servers]
            if not all(nm in cells and cells[nm].status in FINISHED for nm in names):
                break
            n += 1
        return n

    def _paired(self, server: str, workload: str, load: str, rounds: int) -> tuple[dict, dict]:
        """Per metric, the baseline's and `server`'s statistics for the repeats both finished ok, slot-aligned."""
        a: dict[str, list[float]] = {m: [] for m in self.metrics}
        b: dict[str, list[float]] = {m: [] for m in self.metrics}
        for r in range(rounds):
            sa = self._cell_stats(self._cell_name(self.baseline, workload, load, r))
            sb = self._cell_stats(self._cell_name(server, workload, load, r))
            if sa is None or sb is None:
                continue
            for m in self.metrics:
                if sa.get(m) is not None and sb.get(m) is not None:
                    a[m].append(float(sa[m]))  # type: ignore[arg-type]
                    b[m].append(float(sb[m]))  # type: ignore[arg-type]
        return a, b

    # ---- deciding ------------------------------------------------------------------------------------
    def _look(self, workload: str, load: str) -> tuple[int, bool, dict[str, SequentialOutcome]]:
        rounds = self._rounds_done(workload, load)
        outcomes = {}
        for server in self.others:
            a, b = self._paired(server, workload, load, rounds)
            outcomes[server] = run_sequence(self.metrics, a, b, self.rule, rounds=rounds)
        decided = bool(outcomes) and rounds >= self.rule.min_repeats and all(
            o.verdicts and all(v.word in DECIDED for v in o.verdicts.values()) for o in outcomes.values())
        return rounds, decided, outcomes

    def after_cell(self, cell: "Cell") -> None:
        """Called after every grid cell: look at its group when this cell completed a round."""
        group = (cell.workload, cell.load)
        if group in self.stopped:
            return
        rounds, decided, outcomes = self._look(*group)
        if rounds != cell.repeat + 1 or rounds < self.rule.min_repeats:
            return
        used = max((o.repeats for o in outcomes.values()), default=rounds) if decided else rounds
        n_verdicts = len(self.others) * len(self.metrics)
        n_decided = sum(v.word in DECIDED for o in outcomes.values() for v in o.verdicts.values())
        if decided:
            reason = f"stopped after {used} of {self.repeats.max} repeats: all {n_verdicts} verdicts decided"
            stopped = "decided"
        elif rounds >= self.repeats.max:
            reason = (f"ran all {self.repeats.max} repeats: {n_decided} of {n_verdicts} verdicts decided, "
                      "the rest inconclusive")
            stopped = "max_repeats"
        else:
            reason = (f"{n_decided} of {n_verdicts} verdicts decided after {rounds} of {self.repeats.max} "
                      "repeats")
            stopped = "running"
        self._record(group, outcomes, used, stopped, reason)
        if stopped != "running":
            self.stopped[group] = used
            print(f"[{cell.workload} {cell.load}] {reason}", flush=True)

    def skip(self, cell: "Cell") -> bool:
        """True (and the cell marked ``skipped``) when its group stopped before this repeat."""
        group = (cell.workload, cell.load)
        if group not in self.stopped:  # a resumed run: decide from the cells already finished
            rounds, decided, outcomes = self._look(*group)
            if decided and rounds <= cell.repeat:
                self.stopped[group] = max(o.repeats for o in outcomes.values())
        used = self.stopped.get(group)
        if used is None or cell.repeat < used:
            return False
        entry = self.run.manifest.cells[cell.name]
        entry.status = "skipped"
        entry.reason = f"not needed: stopped early after {used} of {self.repeats.max} repeats (verdicts decided)"
        return True

    def _record(self, group: tuple[str, str], outcomes: dict[str, SequentialOutcome], used: int, stopped: str,
                reason: str) -> None:
        workload, load = group
        entries = [e for e in (self.run.manifest.sequential or []) if (e.workload, e.load) != group]
        for server, o in outcomes.items():
            verdicts = [SequentialVerdictEntry(metric=v.metric, verdict=v.word, repeats=v.repeats,  # type: ignore[arg-type]
                                               effect=_finite(v.effect), p_beyond=_finite(v.p_beyond),
                                               p_inside=_finite(v.p_inside), level=v.level)
                        for v in o.verdicts.values()]
            entries.append(SequentialEntry(workload=workload, load=load, a=self.baseline, b=server,
                                           repeats_used=used, repeats_max=self.repeats.max,
                                           stopped=stopped, reason=reason, verdicts=verdicts))  # type: ignore[arg-type]
        self.run.manifest.sequential = entries
        self.run.save()


def _finite(x: float) -> float | None:
    return nan_to_none(x, infinite=True)


def early_stop_for(run: "RunContext", server_names: list[str]) -> EarlyStop | None:
    """The run's early stop, when its spec asks for one and this loop runs every compared configuration (the
    Ray executor runs one configuration per actor: it runs every repeat, and says so)."""
    if not run.spec.repeats.stop_early:
        return None
    if not set(run.spec.servers) <= set(server_names):
        print("repeats.stop_early: this executor runs configurations apart, so every repeat runs "
              f"({run.spec.repeats.max}); early stopping needs the local executor", flush=True)
        return None
    return EarlyStop(run)


__all__ = ["EarlyStop", "early_stop_for"]
