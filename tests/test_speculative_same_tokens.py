"""The speculative page predicts acceptance on the tokens the server generated, the tokens its measured
acceptance is counted on, not on the trace's planned answers; a live run's prompts are rebuilt with every
earlier answer of the session as generated. Constructed runs (no server): the "server" answers by copying the
end of its prompt, which n-gram drafting accepts almost always, while the trace's planned answers are the
generator's text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvscope.harness.analysis import speculative as SP
from kvscope.harness.cachemodel.speculative import NgramConfig, simulate
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import ExperimentFile, ExperimentSpecCore
from kvscope.workloads.trace import Trace

NGRAM = NgramConfig(4, 2, 4)  # the quickstart's ngram-k4


@pytest.fixture(scope="module")
def root(tiny_model_dir, tmp_path_factory) -> Path:
    from kvscope.workloads.generate import generate_from_file

    out = tmp_path_factory.mktemp("spec-same-tokens")
    generate_from_file("agent-coding", tiny_model_dir, seed=3, scale=0.02, sessions=2, output_scale=0.15,
                       max_context=1500).write(out / "traces" / "agent")
    return out


def _live_records(trace: Trace) -> pd.DataFrame:
    """A live run: each answer copies the last tokens of the prompt the replay sent (its session's earlier
    answers substituted), at the planned length."""
    generated: dict[int, np.ndarray] = {}
    for _, g in trace.requests.sort_values("step").groupby("session_id", sort=False):
        for rid in g["request_id"].astype(int):
            sent = trace.prompt_token_ids(rid, trace.live_substitute(rid, generated))
            n = len(trace.output_token_ids(rid))
            generated[rid] = np.resize(sent[-40:], n).astype(np.int32)
    return pd.DataFrame({"request_id": sorted(generated), "error_class": None, "attempt": 0, "mode": "live",
                         "output_token_ids": [generated[r].tolist() for r in sorted(generated)]})


def test_a_live_runs_prompts_carry_every_earlier_answer_as_generated(root):
    trace = Trace.read(root / "traces" / "agent")
    recs = _live_records(trace)
    got = SP.generated_trace(trace, recs, live=True, name="run")
    answered = {int(r): np.asarray(t, np.int32) for r, t in zip(recs["request_id"], recs["output_token_ids"])}
    parent_only = 0
    for i, rid in enumerate(sorted(answered)):
        sent = trace.prompt_token_ids(rid, trace.live_substitute(rid, answered))
        assert np.array_equal(got.prompt_token_ids(i), sent)
        assert np.array_equal(got.output_token_ids(i), answered[rid])
        parent = int(trace.requests.loc[rid, "parent_request_id"])
        only = {trace.output_segment_id(parent): answered[parent]} if parent >= 0 else None
        parent_only += not np.array_equal(trace.prompt_token_ids(rid, only), sent)
    assert parent_only > 0  # substituting the parent's answer alone leaves earlier planned answers in the prompt
    # a recorded run sent the trace's prompts
    rec = SP.generated_trace(trace, recs.assign(mode="recorded"), live=False, name="run")
    assert all(np.array_equal(rec.prompt_token_ids(i), trace.prompt_token_ids(r))
               for i, r in enumerate(sorted(answered)))


def test_the_page_predicts_on_the_tokens_the_server_generated(root, monkeypatch):
    t = root / "traces" / "agent"
    trace = Trace.read(t)
    recs = _live_records(trace)
    cell = "ngram-k4__agent__c1__r0"
    monkeypatch.setattr(SP, "_run_as_trace", lambda d: SP.generated_trace(trace, recs, live=True, name=str(d)))
    spec = ExperimentSpecCore.model_validate({"name": "t"})
    experiment = ExperimentFile(experiment="t", run_id="r", spec=spec, spec_path="t.yaml", created_at=0.0,
                                traces={"agent": "traces/agent"})
    cells = pd.DataFrame([{"cell": cell, "server": "ngram-k4", "workload": "agent", "load": "c1", "repeat": 0,
                           "status": "ok", "prefix_caching": True, "speculative": True, "concurrency": 1}])
    res = ExperimentResults(root=root, experiment=experiment, cells=cells, requests=pd.DataFrame(),
                            metrics=pd.DataFrame(), cell_dirs={cell: root / "cells" / cell})
    pred, _, _ = SP.experiment_predictions(res)
    row = pred[pred["setting"] == NGRAM.label].iloc[0]
    assert row["tokens"] == f"{cell}: the tokens its server generated"
    on_generated = simulate(SP.generated_trace(trace, recs, True, "g"), NGRAM).summary()["acceptance_rate"]
    on_planned = simulate(trace, NGRAM).summary()["acceptance_rate"]
    assert row["acceptance_rate"] == pytest.approx(on_generated)
    assert on_generated > 0.8 and on_generated - on_planned > 0.3  # what the old page compared against
