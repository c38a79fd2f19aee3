"""Text mode end to end: messages rendered by vLLM's chat endpoint give exactly the trace's token prompts."""

from __future__ import annotations

import pytest

from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.results.records import read_records
from kvscope.harness.replay.runner import replay

pytestmark = pytest.mark.vllm


def test_chat_api_replay_of_a_text_mode_trace_matches_token_ids(vllm_server, tiny_model_dir, tmp_path):
    from kvscope.workloads.generate import generate_from_file

    trace = generate_from_file("agent-coding", tiny_model_dir, seed=5, scale=0.02, sessions=2, max_context=1500,
                               text=True)
    trace_dir = trace.write(tmp_path / "trace")
    out = replay(trace_dir, tmp_path / "run", ReplayOptions(api="chat", concurrency=1, time_scale=0, progress=False),
                 endpoints=[vllm_server.endpoint])
    df = read_records(tmp_path / "run").sort_values("request_id")
    assert out.aborted is None and df["error_class"].isna().all(), df["error"].dropna().head()
    # the server's own tokenisation of the rendered chat equals the trace's token ids, request by request
    assert (df["server_prompt_tokens"].to_numpy() == df["prompt_tokens"].to_numpy()).all()
    assert (df["predicted_cached_tokens"] == df["cached_tokens"]).all()
    assert out.summary["hit_rate"]["server_per_request"] > 0.5
