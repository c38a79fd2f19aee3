"""The offline prefix-cache simulator against a real vLLM CPU server, request by request.

Multi-turn sessions of every shape that matters for prefix caching (append-only, edited history, a volatile
token early in the prompt, compaction, repeated prompts, cache salts, a system prompt shared across sessions)
are interleaved and sent one at a time, with prompt lengths at and around block multiples.  Each next prompt
is built from the ids the server actually generated.  Afterwards ``predict_cached_tokens`` must reproduce the
server's ``usage.prompt_tokens_details.cached_tokens`` for every request: on the shared server (128 blocks)
and on the 64-block server of the scheduler validation (`num_gpu_blocks_override`), where eviction decides
many hits.  (Forced pools of 12 and 40 blocks, one server start each, gave the same exact match in every run
of earlier stops; the 64-block one needs no start of its own.)
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import pytest

from kvscope.harness.cachemodel.simulator import SimConfig, predict_cached_tokens, requests_from_token_pairs, simulate
from kvscope.harness.serving.backend import endpoint_facts

pytestmark = pytest.mark.vllm

OUTPUT_LENGTHS = [1, 1, 2, 3, 4, 5, 7, 9, 17]


@dataclass
class Req:
    kind: str
    prompt: list[int]
    max_tokens: int
    salt: str | None = None


@dataclass
class Sent:
    req: Req
    output: list[int]
    cached: int
    prompt_tokens: int


@dataclass
class Workload:
    B: int
    limit: int  # longest prompt + output allowed (max_model_len)
    rng: random.Random
    system: list[int] = field(default_factory=list)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 8000) for _ in range(max(n, 0))]

    def out_len(self) -> int:
        return self.rng.choice(OUTPUT_LENGTHS)

    def near_multiples(self, lo: int = 1) -> list[int]:
        B = self.B
        marks = [1, 2, 3] + [k * B + d for k in range(1, self.limit // B + 1) for d in (-1, 0, 1)]
        return [m for m in marks if m >= lo and m + max(OUTPUT_LENGTHS) <= self.limit]

    def grow_to(self, base: list[int]) -> int | None:
        """Next prompt length for a turn extending ``base``: often exactly a block multiple or one off."""
        if self.rng.random() < 0.65:
            nxt = [m for m in self.near_multiples(len(base) + 1) if m - len(base) <= 2 * self.B]
            if nxt:
                return nxt[0] if self.rng.random() < 0.7 else self.rng.choice(nxt[:3])
        n = len(base) + self.rng.randrange(1, self.B + self.B // 2)
        return n if n + max(OUTPUT_LENGTHS) <= self.limit else None

    # ---- sessions: generators yielding Req and receiving the generated ids --------------------------
    def append_only(self, shared_system: bool):
        prompt = (list(self.system) if shared_system else []) + self.ids(self.rng.randrange(1, 2 * self.B))
        while True:
            out = yield Req("append", prompt, self.out_len())
            base = prompt + out
            n = self.grow_to(base)
            if n is None:
                return
            prompt = base + self.ids(n - len(base))

    def edited(self):
        prompt = self.ids(self.rng.randrange(self.B // 2, 3 * self.B))
        while True:
            out = yield Req("edited", prompt, self.out_len())
            base = prompt + out
            r = self.rng.random()
            if r < 0.35:  # an edit somewhere in the history, sometimes exactly at a block boundary
                pos = self.rng.choice([self.rng.randrange(len(base)), (len(base) // self.B) * self.B - 1,
                                       min(self.B, len(base) - 1)])
                base = list(base)
                base[max(pos, 0)] = self.rng.randrange(10, 8000)
            elif r < 0.6:  # regenerate: drop the last answer and part of the turn, then re-ask differently
                base = base[: self.rng.randrange(max(1, len(base) // 2), len(base) + 1)]
            n = self.grow_to(base)
            if n is None:
                return
            prompt = base + self.ids(n - len(base))

    def volatile(self, at_block: int):
        """A token that changes every turn (a timestamp) at position ``at_block * B`` (0: the very start)."""
        pos = at_block * self.B
        prompt = self.ids(pos + 1 + self.rng.randrange(1, self.B))
        while True:
            out = yield Req(f"volatile@{at_block}B", prompt, self.out_len())
            base = list(prompt + out)
            base[pos] = self.rng.randrange(10, 8000)
            n = self.grow_to(base)
            if n is None:
                return
            prompt = base + self.ids(n - len(base))

    def compaction(self):
        prompt = list(self.system) + self.ids(self.rng.randrange(1, self.B))
        for turn in range(1, 10):
            out = yield Req("compaction", prompt, self.out_len())
            base = prompt + out
            if turn % 3 == 0 or len(base) > self.limit - 2 * self.B:  # summarise: system + summary + recent tail
                base = list(self.system) + self.ids(self.rng.randrange(self.B // 4, self.B + 3)) + base[-10:]
            n = self.grow_to(base)
            if n is None:
                return
            prompt = base + self.ids(n - len(base))

    def repeated(self, lengths: list[int]):
        for n in lengths:
            p = self.ids(n)
            out = yield Req(f"repeat{n}", p, self.out_len())
            yield Req(f"repeat{n}", p, self.out_len())
            if self.rng.random() < 0.5:  # its exact continuation, then the original once more
                if len(p) + len(out) + max(OUTPUT_LENGTHS) <= self.limit:
                    yield Req(f"repeat{n}+out", p + out, self.out_len())
                yield Req(f"repeat{n}", p, self.out_len())

    def salted(self, n: int):
        p = self.ids(n)
        for salt in ("a", "b", "a", None, "b"):
            yield Req(f"salt{n}", p, self.out_len(), salt)


def drive(endpoint: str, sessions: list, rng: random.Random, max_turns: int = 30) -> list[Sent]:
    """Interleave the sessions at random, one request in flight at a time (at most ``max_turns`` each)."""
    import httpx

    sent: list[Sent] = []
    pending = {i: (g, None) for i, g in enumerate(sessions)}  # session -> (generator, output to send)
    turns = dict.fromkeys(pending, 0)
    with httpx.Client(timeout=120.0) as client:
        while pending:
            i = rng.choice(list(pending))
            gen, last_out = pending[i]
            turns[i] += 1
            if turns[i] > max_turns:
                del pending[i]
                continue
            try:
                req = next(gen) if last_out is None else gen.send(last_out)
            except StopIteration:
                del pending[i]
                continue
            body = {"model": "tiny", "prompt": req.prompt, "max_tokens": req.max_tokens, "ignore_eos": True,
                    "temperature": 0.0, "return_token_ids": True}
            if req.salt:
                body["cache_salt"] = req.salt
            r = client.post(endpoint + "/v1/completions", json=body)
            assert r.status_code == 200, (req.kind, len(req.prompt), r.text[:300])
            data = r.json()
            out = list(data["choices"][0]["token_ids"])
            usage = data["usage"]
            assert len(out) == req.max_tokens
            sent.append(Sent(req, out, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                             int(usage["prompt_tokens"])))
            pending[i] = (gen, out)
    return sent


def reset_prefix_cache(endpoint: str) -> None:
    import httpx

    r = httpx.post(endpoint + "/reset_prefix_cache", timeout=30.0)
    assert r.status_code == 200, r.text


def compare(endpoint: str, sessions_for, seed: int, label: str) -> dict:
    facts = endpoint_facts(endpoint)
    B, N = facts.block_size, facts.num_blocks
    assert B and N, facts
    rng = random.Random(seed)
    w = Workload(B=B, limit=facts.max_model_len, rng=rng)
    w.system = w.ids(B + 7)
    reset_prefix_cache(endpoint)
    sent = drive(endpoint, sessions_for(w), rng)
    pairs = [(s.req.prompt, s.output) for s in sent]
    salts = [s.req.salt for s in sent]
    predicted = predict_cached_tokens(pairs, B, N, cache_salts=salts)
    infinite = predict_cached_tokens(pairs, B, None, cache_salts=salts)
    res = simulate(requests_from_token_pairs(pairs, B, cache_salts=salts), SimConfig(B, N))
    mismatches = [(i, s.req.kind, s.prompt_tokens, len(s.output), s.cached, p)
                  for i, (s, p) in enumerate(zip(sent, predicted)) if s.cached != p]
    kinds = sorted({re.match(r"[a-z]+", s.req.kind).group() for s in sent})
    summary = {"server": label, "block_size": B, "num_gpu_blocks": N, "requests": len(sent),
               "mismatches": len(mismatches), "hits": sum(1 for s in sent if s.cached),
               "cached_tokens": sum(s.cached for s in sent), "evictions": res.evictions[0],
               "eviction_changed": sum(1 for a, b in zip(predicted, infinite) if a != b), "kinds": kinds}
    print(f"\nsimulator vs vLLM [{label}]: {summary}")
    assert all(s.prompt_tokens == len(s.req.prompt) for s in sent)
    assert not mismatches, f"{len(mismatches)} of {len(sent)} differ (idx, kind, P, O, server, predicted): " \
                           f"{mismatches[:10]}"
    return summary


def main_sessions(w: Workload) -> list:
    B = w.B
    edge = [1, 2, 3, B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1, 3 * B, 4 * B + 1, 8 * B - 1, 8 * B,
            w.limit - max(OUTPUT_LENGTHS)]
    return ([w.append_only(shared_system=i % 2 == 0) for i in range(6)] + [w.edited() for _ in range(4)]
            + [w.volatile(0), w.volatile(1), w.volatile(2)] + [w.compaction() for _ in range(3)]
            + [w.repeated(edge[:7]), w.repeated(edge[7:])] + [w.salted(B + 1), w.salted(3 * B)])


def small_sessions(w: Workload) -> list:
    B = w.B
    edge = [1, 2, 3, B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1, 3 * B + 1, 5 * B]
    return ([w.append_only(shared_system=i % 2 == 0) for i in range(3)] + [w.edited() for _ in range(2)]
            + [w.volatile(0), w.volatile(1)] + [w.compaction() for _ in range(2)]
            + [w.repeated(edge)] + [w.salted(2 * B)])


def test_simulator_predicts_every_request_on_the_shared_server(vllm_server):
    s = compare(vllm_server.endpoint, main_sessions, seed=1, label="shared")
    assert s["requests"] >= 300
    assert s["eviction_changed"] > 0  # 128 blocks is small enough that eviction shows


def test_simulator_predicts_every_request_with_forced_small_kv_capacity(small_pool_server):
    """The 64-block server (`num_gpu_blocks_override`, shared with test_scheduler_vs_vllm): a pool a few
    sessions deep, so eviction decides many hits."""
    assert endpoint_facts(small_pool_server.endpoint).num_blocks == 64
    s = compare(small_pool_server.endpoint, small_sessions, seed=40, label="64 blocks")
    assert s["requests"] >= 100
    assert s["evictions"] > 0 and s["eviction_changed"] > 0
