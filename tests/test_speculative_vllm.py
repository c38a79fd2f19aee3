"""The offline n-gram model against real vLLM CPU: each request's drafts, accepted tokens and accepted tokens
per position, from /metrics deltas with one request at a time (temperature 0), on the shared n-gram server
(k=3, prompt_lookup 2-4). The second setting (k=5, 1-3, per-request counters) and the trained model are in
benchmarks/speculative_live.py, which takes minutes."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from kvscope.harness.cachemodel.speculative import NgramConfig, simulate_request
from kvscope.harness.serving.backend import DEFAULT_BACKEND, Backend
from kvscope.harness.serving.metrics import metrics_delta

pytestmark = pytest.mark.vllm


def fetch_metrics(endpoint: str):
    return Backend.create(DEFAULT_BACKEND, endpoint=endpoint).scrape_metrics()


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    out = []
    for i in range(n):
        body = rng.integers(100, 8000, 40 + 13 * i).tolist()
        motif = rng.integers(100, 8000, 6).tolist()
        # repeated motifs and random text: some drafts accepted, some rejected, some steps without a draft
        out.append(body[: len(body) // 2] + motif * (1 + i % 4) + body[len(body) // 2:])
    return out


def test_offline_ngram_model_reproduces_vllm_counters_per_request(ngram_server):
    cfg = NgramConfig(3, 2, 4)  # the fixture's speculative_config
    matched, rows = 0, []
    with httpx.Client(timeout=120) as client:
        for prompt in _prompts(12):
            before = fetch_metrics(ngram_server.endpoint)
            r = client.post(ngram_server.endpoint + "/v1/completions",
                            json={"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0.0,
                                  "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            out = r.json()["choices"][0]["token_ids"]
            d = metrics_delta(before, fetch_metrics(ngram_server.endpoint))
            sim = simulate_request(prompt, out, cfg, max_model_len=2048)
            live = (int(d.spec_drafts), int(d.spec_draft_tokens), int(d.spec_accepted_tokens),
                    [int(x) for x in d.accepted_per_position])
            pred = (sim.num_drafts, sim.draft_tokens, sim.accepted_tokens, sim.accepted_per_position(3).tolist())
            if sim.open_ended:  # the last step's drafts matched every known token: vLLM may have accepted more
                ok = live[:2] == pred[:2] and live[2] >= pred[2] and all(a >= b for a, b in zip(live[3], pred[3]))
            else:
                ok = live == pred
            matched += ok
            rows.append((live, pred, sim.open_ended))
    assert matched / len(rows) >= 0.99, rows
    # not a degenerate sample: drafts were made and some were rejected
    assert sum(p[1] for _, p, _ in rows) > 0
