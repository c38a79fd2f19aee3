"""The smoke check (first step of `make demo`): one 6-turn append-only conversation through a real vLLM
with prefix caching.

Each turn's prompt is the previous prompt + the model's actual answer (token ids) + a new user message, sent
as a token-id prompt, so every turn after the first should find the earlier turns in vLLM's prefix cache:
`cached_tokens` grows turn by turn, by whole blocks, up to `floor((n-1)/B)*B`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvscope.harness.serving.backend import DEFAULT_BACKEND, Backend
from kvscope.harness.serving.client import CompletionResult, completion_payload, stream_completion
from kvscope.harness.model.tinymodel import build_tiny_model
from kvscope.workloads.corpus import generate_corpus


@dataclass
class TurnRow:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    expected_cap: int
    ttft_ms: float
    output_tokens: int


def _text_ids(tokenizer, rng: np.random.Generator, n: int) -> list[int]:
    text = generate_corpus(int(rng.integers(0, 2**31)), num_chars=max(400, n * 6))
    ids = tokenizer.encode(text).ids
    start = int(rng.integers(0, max(1, len(ids) - n)))
    return ids[start : start + n]


async def _conversation(backend: Backend, model: str, tokenizer, turns: int, seed: int
                        ) -> list[tuple[int, CompletionResult]]:
    import aiohttp  # deferred: aiohttp is heavy, only talking to a server needs it

    rng = np.random.default_rng(seed)
    history: list[int] = _text_ids(tokenizer, rng, 200)  # system prompt
    out: list[tuple[int, CompletionResult]] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(turns):
            history = history + _text_ids(tokenizer, rng, int(rng.integers(40, 120)))  # user message
            payload = completion_payload(model, history, max_tokens=int(rng.integers(32, 96)),
                                         engine_fields=backend.request_extras(None))
            res = await stream_completion(session, backend.endpoint + "/v1/completions", payload,
                                          headers=backend.auth_headers())
            if not res.ok:
                raise RuntimeError(f"turn {len(out) + 1} failed: {res.error_class}: {res.error}")
            out.append((len(history), res))
            history = history + res.token_ids  # append-only: the answer becomes history
    return out


def run_demo(model_dir: Path, log_path: Path, turns: int = 6, seed: int = 0) -> list[TurnRow]:
    from tokenizers import Tokenizer  # deferred: tokenizers is heavy, only tokenizing needs it

    if not (model_dir / "config.json").is_file():
        print(f"building the tiny model in {model_dir} …", flush=True)
        build_tiny_model(model_dir, seed=0)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = {"model": str(model_dir), "served_model_name": "tiny", "max_model_len": 4096,
              "kv_cache_memory_bytes": "64M", "enable_prefix_caching": True}
    print(f"starting vLLM (log: {log_path}) …", flush=True)
    with Backend.create(DEFAULT_BACKEND, config, source="demo server").start(log_path) as server:
        facts = server.facts()
        print(f"vLLM {facts.engine_version} ready in {server.ready_after_s:.0f} s: block_size={facts.block_size}, "
              f"num_blocks={facts.num_blocks}, kv_capacity_tokens={facts.kv_capacity_tokens}, "
              f"prefix_caching={facts.prefix_caching}", flush=True)
        block = facts.block_size or 1
        results = asyncio.run(_conversation(server, "tiny", tokenizer, turns, seed))
    rows = []
    for i, (n, res) in enumerate(results, start=1):
        rows.append(TurnRow(turn=i, prompt_tokens=res.prompt_tokens or n, cached_tokens=res.cached_tokens or 0,
                            expected_cap=((n - 1) // block) * block, ttft_ms=res.ttft_s * 1000,
                            output_tokens=len(res.token_ids)))
    return rows


def format_table(rows: list[TurnRow]) -> str:
    head = f"{'turn':>4}  {'prompt_tokens':>13}  {'cached_tokens':>13}  {'max floor((n-1)/B)*B':>20}  {'ttft_ms':>8}  {'output':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.turn:>4}  {r.prompt_tokens:>13}  {r.cached_tokens:>13}  {r.expected_cap:>20}  "
                     f"{r.ttft_ms:>8.1f}  {r.output_tokens:>6}")
    return "\n".join(lines)
