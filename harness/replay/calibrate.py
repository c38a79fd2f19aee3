"""The short calibration measurement behind ``kvscope capacity --server``: a few dozen timed requests.

Prefills: single requests of spread-out prompt lengths (``max_tokens=1``), sent one at a time with fresh
random token ids (no prefix-cache hit), timed to the first streamed token, then each sent once more (every
full block but the last hits: the shape of an agent's next turn).  Decodes: batches of 1, 2, 4, ...
identical-shape requests sent together (24 tokens each; 64 on a speculative server), each timed from send to
its last streamed token (the batch's prefill step, its decode steps and the frontend's per-request time), at a
short context (64 tokens) and a long one (up to 1,024, as far as the pool holds the batch), so that the cost
of attending the context is measured rather than extrapolated.

Why send-to-last and not first-to-last token: on a busy CPU host vLLM's frontend sometimes delivers a whole
answer in one burst, and then the first-to-last time is ~0 for many decode steps, and two such samples,
weighted by 1/seconds, are enough to wreck the fit (figures: benchmarks/README.md, "Figures the design notes
cite").  The last token's arrival is late by at most the frontend's lag, whichever way the tokens came.  Both become
:class:`~kvscope.harness.cachemodel.calibration.TimingSample` s and one non-negative least-squares fit gives the
step-cost model the scheduler model runs on.  The result is a versioned ``calibration.json``
(:class:`~kvscope.harness.results.schemas.CalibrationFile`) with the samples and the machine's load average,
because on a shared host the timings are only as good as the load was quiet.
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

from kvscope.harness.cachemodel.calibration import (MIN_FIT_R2, TimingSample, batch_sample, fit_cost_model,
                                                     median_of_repeats, prefill_sample, speculative_batch_sample,
                                                     timing_cv)
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.replay.priority import DEFAULT_CLIENT_PRIORITY, ClientPriority, client_priority
from kvscope.harness.results.schemas import CalibrationCost, CalibrationFile, CalibrationSample, CalibrationServer
from kvscope.harness.serving.backend import Backend
from kvscope.harness.serving.tls import tls_context
from kvscope.workloads.versioned_file import write_versioned

DECODE_BATCHES = (1, 2, 4, 8, 16)
#: Decodes at a long context (about 1,000 tokens each): without them every decode sample attends ~80 tokens, the
#: per-context-token cost is not identified (the fit put it at 0) and a batch of agent turns at ~1,000 tokens
#: each decoded twice as slowly as the model said.
LONG_DECODE_BATCHES = (1, 2, 4, 8)
#: A speculative server's short-context batches again with prompts of a repeated motif (steps that draft).
SPECULATIVE_MOTIF_BATCHES = (1, 2, 4, 8)
#: Tokens each decode sample generates: about 24 decode steps on a plain server.
DECODE_TOKENS = 24
#: The same on a speculative server, which emits 2-3 tokens a step on agent traffic: 24 tokens were only 10-13
#: steps, so the request's own costs (frontend, prefill: ~15 ms) were a fifth to a quarter of each decode
#: sample, and the fits over-predicted decode: on the quickstart's n-gram server (k=4, lookup 2-4), two
#: calibrations against three concurrency-1 replays were +5 % to +23 % off the measured TPOT p50 with 24
#: tokens, and two calibrations with 64 (20-37 steps) -5 % to +10 %, at ~2 s more per calibration
#: (benchmarks/README.md).  How a verifying step's cost splits between the step and its drafts stays poorly
#: identified either way (0.3 to 3.8 ms for 4 drafts over four 64-token calibrations of one server).
SPECULATIVE_DECODE_TOKENS = 64
#: Each shape is timed this many times and its median kept (two calibrations of one server, one pass each,
#: gave TTFT predictions 30 % apart).
CALIBRATION_ROUNDS = 3
#: A fit below ``MIN_FIT_R2`` (a host busy with other work while it was timed) is measured again, up to this many
#: more passes of ``CALIBRATION_ROUNDS`` each, every pass's timings pooled into the medians: a clean-clone CI, its
#: other tests beside the server at load 11 on 2 cores, once fitted R² 0.02 from one pass, so its sweep could not
#: predict and climbed.  A host that stays that busy still ends with the poor fit, which the callers refuse.
POOR_FIT_EXTRA_PASSES = 2


def _timed_completion(client, url: str, model: str, prompt: list[int], max_tokens: int,
                      token_ids: list[int] | None = None) -> tuple[float, float]:
    """(TTFT s, send-to-last-token s) of one streamed completion; ``token_ids``, where given, receives the
    generated token ids (a speculative server's drafts are computed from them)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True}
    if token_ids is not None:
        body["return_token_ids"] = True
    t0 = time.perf_counter()
    first = last = None
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise KvscopeError(f"calibration request failed: {url} answered {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                if token_ids is not None:
                    for choice in json.loads(line[5:]).get("choices") or []:
                        token_ids.extend(choice.get("token_ids") or [])
    if first is None or last is None:
        raise KvscopeError(f"calibration request to {url} streamed no tokens")
    return first - t0, last - t0


def _motif_prompt(rng: random.Random, n: int) -> list[int]:
    """``n`` tokens of a short random motif repeated after a random head: on an n-gram server its suffix
    n-grams occur earlier, so decodes draft (how many are accepted is the model's business)."""
    head = [rng.randrange(10, 8000) for _ in range(n // 2)]
    motif = [rng.randrange(10, 8000) for _ in range(8)]
    return (head + motif * (n // 8 + 1))[:n]


def measure_samples(endpoint: str, model: str, server: CalibrationServer, *, seed: int = 0,
                    prefill_lengths: Sequence[int] | None = None, decode_tokens: int | None = None,
                    rounds: int = CALIBRATION_ROUNDS, headers: Mapping[str, str] | None = None
                    ) -> list[TimingSample]:
    """Every shape measured ``rounds`` times (interleaved, round by round): all the timings, unreduced
    (``median_of_repeats`` reduces them; ``timing_cv`` reads the host's noise off their spread). ``headers``:
    the server's auth headers, carried by every request.  ``decode_tokens``: what each decode sample generates
    (default: :data:`DECODE_TOKENS`, or :data:`SPECULATIVE_DECODE_TOKENS` on a speculative server).

    A speculative server (``server.speculation``): each decode sample's steps are the offline model's on the
    tokens the server generated (its drafts per step), the batch timed to its last request's last token; and
    the short-context batches are measured once more with prompts of a repeated motif, so that steps which
    verify drafts and steps which do not are both well represented (random prompts draft only where the
    model's own answer repeats)."""
    import httpx  # deferred: a heavy import that only a measurement needs

    rng = random.Random(seed)
    if decode_tokens is None:
        decode_tokens = SPECULATIVE_DECODE_TOKENS if server.speculation else DECODE_TOKENS
    url = endpoint.rstrip("/") + "/v1/completions"
    budget = server.max_num_batched_tokens
    limit = (server.max_model_len or 2048) - decode_tokens - 2
    if server.num_gpu_blocks:
        limit = min(limit, (server.num_gpu_blocks - 1) * server.block_size - decode_tokens - 2)
    lengths = list(prefill_lengths or sorted({max(16, int(limit * f)) for f in (0.03, 0.1, 0.25, 0.5, 0.75, 1.0)}))

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, 8000) for _ in range(n)]

    spec_cfg = None
    if server.speculation:
        from kvscope.harness.cachemodel.spec_predict import parse_speculative  # deferred: only a speculative server needs the offline model
        from kvscope.harness.cachemodel.speculative import simulate_request

        spec_cfg = parse_speculative(server.speculation).offline_config()

    samples: list[TimingSample] = []
    with httpx.Client(timeout=300.0, verify=tls_context(), headers=dict(headers or {})) as client:
        _timed_completion(client, url, model, ids(16), 2)  # warm-up, not recorded
        short_len = min(64, limit)
        long_len = max(short_len, min(limit, 1024))
        for _ in range(rounds):
            for n in lengths:
                prompt = ids(n)
                ttft, _ = _timed_completion(client, url, model, prompt, 1)
                samples.append(prefill_sample(n, ttft, budget))
                # The same prompt again: all its full blocks but the capped last one hit. An agent's turn is such
                # a request (a long cached history, a short new tail), and its TTFT has costs in the whole
                # prompt (the frontend's parsing, attention over the cached context) that fresh prompts fold
                # into the cost per new token; at concurrency 1 the model said 11 ms for a measured 23.
                cached = (n - 1) // server.block_size * server.block_size
                if cached:
                    ttft, _ = _timed_completion(client, url, model, prompt, 1)
                    samples.append(prefill_sample(n, ttft, budget, cached_tokens=cached))
            shapes = [(short_len, DECODE_BATCHES, False), (long_len, LONG_DECODE_BATCHES, False)]
            if spec_cfg is not None:
                shapes.append((short_len, SPECULATIVE_MOTIF_BATCHES, True))
            for prompt_len, batches, motif in shapes:
                per_req_blocks = -(-(prompt_len + decode_tokens) // server.block_size)
                for batch in batches:
                    if batch > server.max_num_seqs or (server.num_gpu_blocks and
                                                       batch * per_req_blocks > server.num_gpu_blocks - 1):
                        break
                    prompts = [_motif_prompt(rng, prompt_len) if motif else ids(prompt_len) for _ in range(batch)]
                    if prompt_len > short_len:
                        # Prefill them once first: sent again together, all but their last block hits the cache,
                        # so every prefill fits in the first step and no prefill chunk lands inside the decodes.
                        for p in prompts:
                            _timed_completion(client, url, model, p, 1)
                    outputs: list[list[int] | None] = [[] if spec_cfg is not None else None for _ in prompts]
                    with ThreadPoolExecutor(batch) as pool:
                        timed = list(pool.map(lambda po: _timed_completion(client, url, model, po[0], decode_tokens,
                                                                           po[1]), zip(prompts, outputs)))
                    cached = (prompt_len - 1) // server.block_size * server.block_size if prompt_len > short_len \
                        else 0
                    if spec_cfg is None:
                        e2e_s = sorted(t[1] for t in timed)[len(timed) // 2]
                        samples.append(batch_sample(batch, prompt_len, cached, decode_tokens, e2e_s))
                        continue
                    # requests of one batch draft differently and so finish at different steps: the batch is
                    # timed to its last token, the steps counted to its longest request
                    sims = [simulate_request(p, o or [], spec_cfg, server.max_model_len)
                            for p, o in zip(prompts, outputs)]
                    samples.append(speculative_batch_sample(prompt_len, cached, [x.drafted for x in sims],
                                                            [x.context_tokens for x in sims],
                                                            max(t[1] for t in timed),
                                                            f"{'motif' if motif else 'random'}-{prompt_len}x{batch}"))
    return samples


def calibrate_server(backend: Backend, out_path: str | Path, *, seed: int = 0,
                     client_priority_mode: ClientPriority = DEFAULT_CLIENT_PRIORITY) -> CalibrationFile:
    """Measure the server ``backend`` answers for and write the calibration file. Everything about the server
    comes from its backend, the configuration's own: its KV facts, its scheduler limits (vLLM's defaults where
    it does not say) and the auth headers every request carries.  ``client_priority_mode``: the replay's choice
    (``--client-priority``), so a calibration and the replays it predicts are timed by a client scheduled
    alike; recorded as ``client_priority``."""
    endpoint = backend.endpoint
    facts = backend.facts()
    if not facts.block_size:
        raise KvscopeError(f"{endpoint}: the server does not report its KV block size and block count")
    limits = backend.scheduler_limits()

    def whole(n: float | None) -> int | None:  # the file is strict: counts are integers, never 16.0
        return None if n is None else int(n)

    server = CalibrationServer(endpoint=endpoint, model=facts.model, block_size=whole(facts.block_size),
                               num_gpu_blocks=whole(facts.num_blocks), max_num_seqs=int(limits.max_num_seqs or 128),
                               max_num_batched_tokens=int(limits.max_num_batched_tokens or 2048),
                               max_model_len=whole(facts.max_model_len), speculation=backend.speculation())
    load = os.getloadavg()[0]
    # With realtime/auto the requests go out from real-time threads, so the times are the server's and not
    # this host's wake-up delays (replay/priority.py).
    with client_priority(client_priority_mode, threads_inherit=True) as priority:
        timings = measure_samples(endpoint, facts.model or "default", server, seed=seed,
                                  headers=backend.auth_headers())
        samples = median_of_repeats(timings)
        fit = fit_cost_model(samples)
        for extra in range(1, POOR_FIT_EXTRA_PASSES + 1):
            if fit.r2 >= MIN_FIT_R2:
                break
            print(f"calibration of {endpoint}: step-cost fit R² {fit.r2:.2f} < {MIN_FIT_R2} (load "
                  f"{os.getloadavg()[0]:.1f}); measuring again ({extra} of {POOR_FIT_EXTRA_PASSES})", flush=True)
            # New prompts (another seed): the same ones would hit the prefix cache the last pass filled.
            timings += measure_samples(endpoint, facts.model or "default", server, seed=seed + extra,
                                       headers=backend.auth_headers())
            samples = median_of_repeats(timings)
            fit = fit_cost_model(samples)
    cal = CalibrationFile(created_at=time.time(), server=server, cost=CalibrationCost(**fit.model.as_dict()),
                          fit_r2=fit.r2, fit_median_rel_error=fit.median_rel_error,
                          load_average_1m=max(load, os.getloadavg()[0]), client_priority=priority,
                          timing_cv=timing_cv(timings),
                          samples=[CalibrationSample(kind=s.kind, steps=s.steps, tokens=s.tokens,  # type: ignore[arg-type]
                                                     seq_steps=s.seq_steps, context_tokens=s.context_tokens,
                                                     prefill_pairs=s.prefill_pairs, spec_steps=s.spec_steps,
                                                     draft_tokens=s.draft_tokens,
                                                     seconds=s.seconds, requests=s.requests) for s in samples])
    write_versioned(out_path, cal)
    return cal
