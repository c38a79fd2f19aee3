"""`findings.json`: what a report page found, as data — the sentences, their numbers and where the evidence is.

Why a file. The analysis layer computes findings (it reads results and runs the verdict engine); the report
layer writes `index.html`. The findings are computed in each notebook's own kernel, not in the report's
process, so they travel as a typed, versioned result file that each analysis notebook writes beside its figures
(`report/figures/<notebook>/findings.json`) and the index reads back. A sentence is plain text (escaped when
rendered); the numbers stay as numbers so a test, or another tool, can check them without parsing prose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.results.selection import Statement
from kvscope.workloads.versioned_file import VersionedFile, read_versioned, write_versioned
from pydantic import BaseModel, ConfigDict, Field

FINDINGS_NAME = "findings.json"

Question = Literal["habit", "capacity", "speculative", "ab", "hit_rate", "latency", "cost", "cache_break", "caveat",
                   "recommendation"]


class Finding(BaseModel):
    """One sentence a reader can act on, with its numbers, its interval and the figure that shows it."""

    model_config = ConfigDict(extra="forbid")

    question: Question
    sentence: str
    numbers: dict[str, float | None] = {}
    interval: tuple[float, float] | None = None  # 95 % interval of `interval_of`, in its own unit
    interval_of: str | None = None
    notebook: str  # the analysis page holding the evidence (<notebook>.html)
    figure: str | None = None  # the figure's name on that page (figures/<notebook>/<figure>.png)
    #: The quantity this sentence states something about (``eviction``, ``speculative:<server>``,
    #: ``capacity:<server>:<workload>``) and what it states (``evicted`` / ``none``, ``pays`` / …): one claim is
    #: computed once (`kvscope.harness.analysis.claims`) and every page that mentions it carries the same pair,
    #: so a test can check that no two pages contradict each other.
    claim: str | None = None
    claim_value: str | None = None
    #: The numbers of the sentence with the records each comes from (`results.selection`): what the claims
    #: audit (`kvscope.harness.analysis.audit`) recomputes from requests.parquet. Optional (older files lack it).
    statements: list[Statement] = Field(default_factory=list)

    @property
    def page(self) -> str:
        return f"{self.notebook}.html"

    @property
    def figure_path(self) -> str | None:
        return f"figures/{self.notebook}/{self.figure}.png" if self.figure else None


class VerdictCell(BaseModel):
    """One cell of the pivoted A/B table: a configuration pair (at one workload and load) x one metric."""

    model_config = ConfigDict(extra="forbid")

    pair: str
    metric: str
    verdict: str
    relative: float | None = None  # (B - A) / A; None where A is 0
    data_quality: str | None = None  # the outlier repeats the verdict rests on (pages.ab_compare), None: none


class FindingsFile(VersionedFile):
    FORMAT = "kvscope-findings"
    SUPPORTED_VERSIONS = (1,)

    format: Literal["kvscope-findings"] = "kvscope-findings"
    version: int = 1
    notebook: str
    findings: list[Finding]
    verdicts: list[VerdictCell] = Field(default_factory=list)
    verdicts_csv: str | None = None  # the full verdict table, relative to report/


def write_findings_file(path: str | Path, data: FindingsFile) -> Path:
    return write_versioned(Path(path), data)


def load_findings_file(path: str | Path) -> FindingsFile:
    return read_versioned(Path(path), FindingsFile, KvscopeError)
