"""`kvscope explain` says what a trace will take before it starts and shows progress as whole lines (issue 40,
item 9): a 142 k-request trace of 16 B prompt tokens ran > 7 minutes at 4.8 GB with no estimate and no progress
line. The estimate's time is the stated throughput (`EXPLAIN_PROMPT_TOKENS_PER_S`, checked by
benchmarks/explain_speculate_scale.py); a trace whose estimated peak does not fit the memory available is one
line naming --block-size, before any work."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def trace_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from kvscope.workloads.generate import generate_from_file

    return generate_from_file("agent-coding", tiny_model_dir, seed=0, scale=0.01, sessions=2,
                              max_context=2000).write(tmp_path_factory.mktemp("explain") / "trace")


def test_a_trace_too_large_for_the_memory_is_refused_naming_the_block_size(trace_dir, monkeypatch, capsys):
    import psutil
    from kvscope.harness.cli.main import main

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=100 * 2**20))
    rc = main(["explain", str(trace_dir), "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and out == "", err
    assert "--block-size 16" in err and "0.1 GB is available" in err and "requests of" in err


def test_the_estimate_and_progress_are_whole_lines_on_a_pipe(trace_dir, monkeypatch, capsys):
    from kvscope.harness.analysis import explain
    from kvscope.harness.cli.main import main

    monkeypatch.setattr(explain, "ESTIMATE_ABOVE_S", 0.0)  # the trace is small: print its estimate anyway
    rc = main(["explain", str(trace_dir)])
    err = capsys.readouterr().err
    assert rc == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("explain: ") and "requests" in lines[0] and "M prompt tokens: about" in lines[0]
    assert "\r" not in err  # a pipe or a log gets lines, not redraws
    assert any(line.startswith("explain: attribute") and "req" in line for line in lines), err


def test_the_estimate_grows_with_the_trace_and_shrinks_with_the_block_size():
    import numpy as np
    import pandas as pd
    from kvscope.harness.analysis.explain import (
        EXPLAIN_PROMPT_TOKENS_PER_S,
        EXPLAIN_STARTUP_S,
        explain_estimate,
    )

    def trace(n: int, prompt: int):
        return SimpleNamespace(num_requests=n, requests=pd.DataFrame({"prompt_tokens": [prompt] * n}),
                               seg_tokens=np.zeros(1000, np.int32))

    small, big = explain_estimate(trace(10, 1000), 16), explain_estimate(trace(142_000, 112_676), 16)
    assert big.seconds == pytest.approx(EXPLAIN_STARTUP_S + 142_000 * 112_676 / EXPLAIN_PROMPT_TOKENS_PER_S)
    assert big.peak_bytes > 12 * 142_000 * 112_676 / 16 > small.peak_bytes  # the chain index: 12 B a block
    assert explain_estimate(trace(142_000, 112_676), 64).peak_bytes < big.peak_bytes / 3
