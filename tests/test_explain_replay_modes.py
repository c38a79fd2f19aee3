"""Explain and the eviction claim on replay runs whose prompts did or did not carry what the server generated:
a recorded-mode replay's substituted answers are `replay_substituted_output`, never eviction; eviction is what
was cached earlier in the run and then lost, request by request against the exact simulator; a live run is
read on the prompts it sent. Runs are built on disk from generated traces, the "server" being kvscope's exact
simulator at a KV pool (no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvscope.harness.analysis import explain_experiment as X
from kvscope.harness.analysis.causes import Cause
from kvscope.harness.analysis.claims import eviction_by_cell, eviction_claim
from kvscope.harness.analysis.explain import explain_trace
from kvscope.harness.cachemodel.simulator import Replica, SimConfig, requests_from_token_pairs
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import ExperimentFile, ExperimentSpecCore
from kvscope.workloads.trace import Trace

B = 16


@pytest.fixture(scope="module")
def traces(tiny_model_dir, tmp_path_factory) -> Path:
    """<root>/traces/{agent,agent-ts}: the same three sessions append-only and with a timestamp, with answers of
    tens of tokens (the quickstart's output scale) so a substituted answer costs whole blocks."""
    from kvscope.workloads.generate import generate_from_file

    root = tmp_path_factory.mktemp("replay-modes")
    for name, spec in (("agent", "agent-coding"), ("agent-ts", "agent-coding-timestamped")):
        generate_from_file(spec, tiny_model_dir, seed=3, scale=0.02, sessions=3, output_scale=0.15,
                           max_context=1500).write(root / "traces" / name)
    return root


def _schedule(trace: Trace, concurrency: int) -> list[tuple[int, int]]:
    """Closed loop in lockstep: the ``concurrency`` sessions in flight each send their next request, then all
    of them finish; a finished session's slot goes to the next session. Events ``(0 send | 1 finish, rid)``."""
    df = trace.requests.sort_values(["session_id", "step"])
    queue = [g["request_id"].astype(int).tolist() for _, g in df.groupby("session_id", sort=False)]
    active: list[list[int]] = []
    events: list[tuple[int, int]] = []
    while queue or active:
        while queue and len(active) < concurrency:
            active.append(queue.pop(0))
        sent = [s.pop(0) for s in active]
        events += [(0, r) for r in sent] + [(1, r) for r in sent]
        active = [s for s in active if s]
    return events


def _serve(prompts, outputs, events, num_gpu_blocks: int | None) -> list[int]:
    """The server: kvscope's exact simulator, each request looked up at its send and cached at its finish."""
    reqs = requests_from_token_pairs(zip(prompts, outputs), B)
    rep = Replica(SimConfig(B, num_gpu_blocks))
    hit = [0] * len(reqs)
    for kind, rid in events:
        if kind == 0:
            hit[rid] = rep.probe(reqs[rid]) * B
        else:
            rep.run_sequential(reqs[rid])
    return hit


def _run(trace_dir: Path, workload: str, mode: str, concurrency: int, num_gpu_blocks: int | None, seed: int = 0
         ) -> tuple[dict, pd.DataFrame, list[np.ndarray]]:
    """One replay cell of ``trace_dir``: the server generates its own answers (random tokens of the planned
    length); in ``live`` mode later prompts carry them, in ``recorded`` mode the trace's planned ones."""
    trace = Trace.read(trace_dir)
    n = trace.num_requests
    rng = np.random.default_rng(seed)
    generated = {r: rng.integers(5, 900, len(trace.output_token_ids(r))).astype(np.int32) for r in range(n)}
    if mode == "live":
        prompts = [trace.prompt_token_ids(r, trace.live_substitute(r, generated)) for r in range(n)]
    else:
        prompts = [trace.prompt_token_ids(r) for r in range(n)]
    events = _schedule(trace, concurrency)
    cached = _serve(prompts, [generated[r] for r in range(n)], events, num_gpu_blocks)
    t = {rid: 2.0 * i for i, (kind, rid) in enumerate(events) if kind == 0}
    done = {rid: 2.0 * i + 1 for i, (kind, rid) in enumerate(events) if kind == 1}
    name = f"apc__{workload}__c{concurrency}__r0"
    rec = pd.DataFrame({"cell": name, "server": "apc", "workload": workload, "request_id": np.arange(n),
                        "cached_tokens": cached, "prompt_tokens": [len(p) for p in prompts],
                        "session_id": trace.requests["session_id"].astype(str), "error_class": None,
                        "in_window": True, "mode": mode, "sent_s": [t[r] for r in range(n)],
                        "done_s": [done[r] for r in range(n)],
                        "output_token_ids": [generated[r].tolist() for r in range(n)]})
    row = {"cell": name, "server": "apc", "workload": workload, "load": f"c{concurrency}", "repeat": 0,
           "status": "ok", "prefix_caching": True, "speculative": False, "block_size": B,
           "concurrency": concurrency, "num_blocks": num_gpu_blocks}
    return row, rec, prompts


def _results(root: Path, cells: list[tuple[dict, pd.DataFrame]]) -> ExperimentResults:
    spec = ExperimentSpecCore.model_validate({"name": "t"})
    experiment = ExperimentFile(experiment="t", run_id="r", spec=spec, spec_path="t.yaml", created_at=0.0,
                                traces={c["workload"]: f"traces/{c['workload']}" for c, _ in cells})
    return ExperimentResults(root=root, experiment=experiment, cells=pd.DataFrame([c for c, _ in cells]),
                             requests=pd.concat([r for _, r in cells], ignore_index=True), metrics=pd.DataFrame())


def _split(ex) -> dict[str, int]:
    return {c.cause: c.recomputed_tokens for c in ex.causes}


def test_a_recorded_replay_at_concurrency_1_on_a_pool_that_never_evicts_claims_no_eviction(traces):
    t = traces / "traces" / "agent"
    row, rec, _ = _run(t, "agent", "recorded", 1, num_gpu_blocks=100_000)
    ex = explain_trace(t, B, observed_records=rec, num_gpu_blocks=100_000)
    split = _split(ex)
    assert Cause.EVICTED not in split and all(a.evicted_tokens == 0 for a in ex.requests)
    # every block of the parent's answer the planned history would have hit is the replay's substitution
    simulated = explain_trace(t, B)
    planned = [a.predicted_cached_tokens for a in simulated.requests]
    lost = sum(max(0, p - o) for p, o in zip(planned, rec["cached_tokens"]))
    assert lost > 0 and split.pop(Cause.REPLAY_SUBSTITUTED_OUTPUT) == lost
    assert split == _split(simulated)  # the trace's own breaks (distinct sessions' system prompts) and no more
    assert Cause.NOT_YET_CACHED not in split
    # the page says so, and names no habit for a replay artefact
    res = _results(traces, [(row, rec)])
    [wx] = X.explain_workloads(res)
    sentence = X.cause_sentence(wx, [wx])
    assert sentence.startswith("agent: the replay's substitution of answers") and "eviction" not in sentence
    assert "in a live replay" in sentence
    assert all(f.question != "habit" for f in X.explain_findings([wx]))
    what_if = X.what_if_frame([wx])
    assert "replayed live (no substituted answers)" in set(what_if["scenario"])
    assert set(X.what_if_palette(what_if)) == set(what_if["scenario"])
    # and the report's eviction claim agrees: nothing was cached and then lost
    assert eviction_by_cell(res)["evicted_tokens"].sum() == 0
    assert eviction_claim(res).value == "none"


def test_blocks_cached_and_then_lost_are_eviction_request_by_request(traces):
    t = traces / "traces" / "agent"
    trace = Trace.read(t)
    pool = 120  # about one and a half of the longest requests: sessions evict each other's prefixes
    row, rec, prompts = _run(t, "agent", "live", 3, num_gpu_blocks=pool)
    # independently: an unbounded cache in the run's order on the tokens the server held
    generated = [np.asarray(g, np.int32) for g in rec["output_token_ids"]]
    reach = _serve(prompts, generated, _schedule(trace, 3), None)
    expected = [max(0, r - o) for r, o in zip(reach, rec["cached_tokens"])]
    assert sum(expected) > 0
    ex = explain_trace(t, B, observed_records=rec, num_gpu_blocks=pool)
    assert [a.evicted_tokens for a in ex.requests] == expected
    assert [a.reachable_cached_tokens for a in ex.requests] == [min(r, a.predicted_cached_tokens)
                                                               for r, a in zip(reach, ex.requests)]
    split = _split(ex)
    assert split[Cause.EVICTED] == sum(expected) and Cause.REPLAY_SUBSTITUTED_OUTPUT not in split
    # a live run is read on the prompts it sent: they are the ones attributed
    assert [a.prompt_tokens for a in ex.requests] == [len(p) for p in prompts]
    res = _results(traces, [(row, rec)])
    ev = eviction_by_cell(res)
    assert ev["evicted_tokens"].sum() == sum(expected)
    claim = eviction_claim(res)
    assert claim.value == "evicted" and f"{sum(expected):,} prompt tokens" in claim.sentence


def test_a_recorded_runs_what_ifs_never_exceed_what_the_replay_can_reach(traces):
    """Removing the timestamp from a recorded replay cannot give back the parent's answers, which the replay
    never sent again: its ceiling is the hit rate of the same sessions without the timestamp, replayed the same
    way (prompt blocks only), not that of the planned history."""
    t_ts, t_ref = traces / "traces" / "agent-ts", traces / "traces" / "agent"
    _, rec, _ = _run(t_ts, "agent-ts", "recorded", 1, num_gpu_blocks=100_000)
    ex = explain_trace(t_ts, B, observed_records=rec, num_gpu_blocks=100_000)
    _, ref_rec, _ = _run(t_ref, "agent", "recorded", 1, num_gpu_blocks=100_000)
    reachable = ref_rec["cached_tokens"].sum() / ref_rec["prompt_tokens"].sum()
    planned = explain_trace(t_ref, B).hit_rate  # what the planned history (a live replay) would reach
    assert planned > reachable + 0.03
    causes = {c.cause: c for c in ex.causes}
    volatile = causes[Cause.VOLATILE_FIELD]
    assert volatile.what_if_hit_rate <= reachable + 0.005
    assert volatile.what_if_hit_rate_pool <= reachable + 0.005
    assert volatile.what_if_hit_rate > ex.hit_rate + 0.3  # the timestamp is still what breaks the cache
    for c in ex.causes:
        if c.cause != Cause.REPLAY_SUBSTITUTED_OUTPUT:
            assert c.what_if_hit_rate <= reachable + 0.005, c


def test_live_substitute_gives_the_prompts_a_live_replay_sends(traces):
    """The replay's session loop substitutes each answer it received into its session's later prompts; the
    analyses rebuild those prompts from the records with `Trace.live_substitute`."""
    trace = Trace.read(traces / "traces" / "agent")
    rng = np.random.default_rng(1)
    generated = {r: rng.integers(5, 900, 7) for r in range(trace.num_requests) if r % 3}  # some failed
    for _, g in trace.requests.sort_values("step").groupby("session_id", sort=False):
        substitute: dict[int, np.ndarray] = {}
        for rid in g["request_id"].astype(int):
            sent = trace.prompt_token_ids(rid, substitute or None)
            assert np.array_equal(trace.prompt_token_ids(rid, trace.live_substitute(rid, generated)), sent)
            if rid in generated:
                substitute[trace.output_segment_id(rid)] = generated[rid]
    assert trace.live_substitute(0, {}) == {}
    assert json.loads((traces / "traces" / "agent" / "trace.json").read_text())["num_requests"] == trace.num_requests


def test_a_prefix_a_concurrent_request_was_still_computing_is_not_eviction():
    """Two sessions open with the same 64 tokens, sent together: the second cannot hit what the first has not
    finished computing. An unbounded cache in request order would have served it; in the run's order nothing
    was cached yet, so nothing was lost."""
    from kvscope.harness.analysis.explain import RequestView, explain

    shared = np.arange(100, 164, dtype=np.int32)
    later = np.concatenate([shared, np.arange(7, 40, dtype=np.int32)])
    views = [RequestView(0, "a", 0, -1, shared, None), RequestView(1, "b", 0, -1, shared.copy(), None),
             RequestView(2, "a", 1, 0, later, None)]
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)]
    ex = explain(views, B, observed=[0, 0, 64], order=order)
    assert [a.cause for a in ex.requests] == [None, Cause.NOT_YET_CACHED, None]
    assert _split(ex) == {Cause.NOT_YET_CACHED: 48} and ex.requests[1].evicted_tokens == 0
    # the same run with the second request sent after the first finished: then the server lost it
    ex = explain(views, B, observed=[0, 0, 64], order=[(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)])
    assert _split(ex) == {Cause.EVICTED: 48} and ex.requests[1].evicted_tokens == 48


def test_a_tool_output_cut_to_a_prefix_of_itself_is_the_edit_and_its_what_if_restores_it():
    """The compaction habit cuts an old tool output to a prefix of itself: the next request matches its
    predecessor up to the cut output's new end, so the first diverging token is the *next* segment's first.
    The edit is the cut segment's, and so is the what-if's patch (before, the next segment was named and
    "patched" back to itself: the quickstart's compaction what-if kept the hit rate at 65 % where undoing the
    cuts gives 72 %)."""
    import numpy as np

    from kvscope.harness.analysis.explain import RequestView, explain

    B = 4
    rng = np.random.default_rng(7)
    sysp, call1, out1, call2 = (rng.integers(10, 5000, n).astype(np.int32) for n in (16, 8, 24, 8))
    out2 = rng.integers(10, 5000, 12).astype(np.int32)

    def spans(*parts):
        out, at = [], 0
        for kind, toks in parts:
            out.append((kind, at, at + len(toks)))
            at += len(toks)
        return out

    p_parts = [("system", sysp), ("tool_call", call1), ("tool_output", out1), ("tool_call", call2)]
    r_parts = [("system", sysp), ("tool_call", call1), ("tool_output", out1[:1]), ("tool_call", call2),
               ("tool_output", out2)]
    p_prompt = np.concatenate([t for _, t in p_parts])
    r_prompt = np.concatenate([t for _, t in r_parts])
    views = [RequestView(0, "s", 0, -1, p_prompt, None, seg_spans=spans(*p_parts)),
             RequestView(1, "s", 1, 0, r_prompt, None, seg_spans=spans(*r_parts), transition="edit")]
    ex = explain(views, B)
    row = ex.requests[1]
    assert row.cause == "message_edited" and row.where.startswith("segment 2 (tool_output)"), row
    (total,) = ex.causes
    # undoing the cut gives the request its predecessor's prompt back (plus its own new tail), all cached
    assert total.what_if_hit_rate > ex.hit_rate + 0.2, (total, ex.hit_rate)
