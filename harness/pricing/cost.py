"""Token costs split into uncached input, cache writes, cache reads and output; self-hosted cost.

All prices are USD per million tokens.  A provider request is billed as
``uncached*input + write*input*write_mult + read*input*read_mult + output*output_price``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from pydantic import BaseModel


class Pricing(BaseModel):
    """Per-million-token prices with cache multipliers relative to the input price."""

    input_per_mtok: float
    output_per_mtok: float
    cache_write_multiplier: float = 1.0
    cache_read_multiplier: float = 1.0

    @property
    def cache_write_per_mtok(self) -> float:
        return self.input_per_mtok * self.cache_write_multiplier

    @property
    def cache_read_per_mtok(self) -> float:
        return self.input_per_mtok * self.cache_read_multiplier


@dataclass
class TokenSplit:
    """How one request's (or a sum of requests') tokens are billed."""

    uncached_input: int = 0
    cache_write: int = 0
    cache_read: int = 0
    output: int = 0

    @property
    def input_tokens(self) -> int:
        return self.uncached_input + self.cache_write + self.cache_read

    def __add__(self, o: "TokenSplit") -> "TokenSplit":
        return TokenSplit(self.uncached_input + o.uncached_input, self.cache_write + o.cache_write,
                          self.cache_read + o.cache_read, self.output + o.output)

    def as_dict(self) -> dict:
        return {"uncached_input_tokens": self.uncached_input, "cache_write_tokens": self.cache_write,
                "cache_read_tokens": self.cache_read, "output_tokens": self.output}


def cost_breakdown(split: TokenSplit, pricing: Pricing) -> dict:
    """USD per component and in total."""
    d = {
        "uncached_input_usd": split.uncached_input * pricing.input_per_mtok / 1e6,
        "cache_write_usd": split.cache_write * pricing.cache_write_per_mtok / 1e6,
        "cache_read_usd": split.cache_read * pricing.cache_read_per_mtok / 1e6,
        "output_usd": split.output * pricing.output_per_mtok / 1e6,
    }
    d["input_usd"] = d["uncached_input_usd"] + d["cache_write_usd"] + d["cache_read_usd"]
    d["total_usd"] = d["input_usd"] + d["output_usd"]
    return d


def request_cost(pricing: Pricing, *, uncached: int = 0, cache_write: int = 0, cache_read: int = 0,
                 output: int = 0) -> float:
    return cost_breakdown(TokenSplit(uncached, cache_write, cache_read, output), pricing)["total_usd"]


def no_cache_cost(pricing: Pricing, input_tokens: int, output_tokens: int = 0) -> float:
    return request_cost(pricing, uncached=input_tokens, output=output_tokens)


def agent_loop_tokens(initial_context: int, tokens_per_step: int, steps: int) -> dict:
    """Input tokens re-sent by an append-only agent loop vs its unique content.

    ``sent`` is what a cacheless server processes; ``final_context`` is the last request's size, which
    equals the unique content a perfect prefix cache computes once (``uncached_with_perfect_cache``).
    """
    ctx, sent = initial_context, 0
    for _ in range(steps):
        sent += ctx
        ctx += tokens_per_step
    final = ctx - tokens_per_step
    return {"sent": sent, "final_context": final, "uncached_with_perfect_cache": final,
            "cached_with_perfect_cache": sent - final}


def summarize_splits(splits: Iterable[TokenSplit], pricing: Pricing) -> dict:
    total = TokenSplit()
    n = 0
    for s in splits:
        total = total + s
        n += 1
    out = {"requests": n, **total.as_dict(), **cost_breakdown(total, pricing)}
    no_cache = no_cache_cost(pricing, total.input_tokens, total.output)
    out["no_cache_total_usd"] = no_cache
    out["saving_vs_no_cache_usd"] = no_cache - out["total_usd"]
    return out


def self_hosted_cost(gpu_hour_usd: float, num_gpus: int, tokens_per_s: float, tokens: float | None = None) -> dict:
    """Cost per million tokens from $/GPU-hour and measured throughput (and for ``tokens`` if given)."""
    usd_per_s = gpu_hour_usd * num_gpus / 3600.0
    per_mtok = usd_per_s / tokens_per_s * 1e6
    out = {"usd_per_hour": gpu_hour_usd * num_gpus, "tokens_per_s": tokens_per_s, "usd_per_mtok": per_mtok}
    if tokens is not None:
        out["tokens"] = tokens
        out["usd"] = per_mtok * tokens / 1e6
        out["hours"] = tokens / tokens_per_s / 3600.0
    return out


def self_hosted_usd_per_1000_sessions(hourly_usd: float, duration_s: float, sessions: int) -> float:
    """A machine at ``hourly_usd`` serving ``sessions`` sessions in ``duration_s`` seconds, per 1,000 sessions."""
    return hourly_usd * duration_s / 3600.0 / sessions * 1000.0


def run_cost(run: str, pricing: Pricing, *, charge_writes: bool = True) -> dict:
    """Cost of a replay run dir (``requests.parquet``: prompt_tokens, cached_tokens, output_tokens,
    session_id) as if billed by a provider with ``pricing``: hits are reads, the rest writes."""
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

    p = Path(run)
    df = pd.read_parquet(p / "requests.parquet" if p.is_dir() else p)
    cached = df["cached_tokens"].fillna(0).astype(int)
    miss = df["prompt_tokens"].astype(int) - cached
    splits = [TokenSplit(0 if charge_writes else int(m), int(m) if charge_writes else 0, int(c), int(o))
              for m, c, o in zip(miss, cached, df["output_tokens"].fillna(0).astype(int))]
    out = summarize_splits(splits, pricing)
    if "session_id" in df.columns:
        per = {}
        for sid, s in zip(df["session_id"], splits):
            per.setdefault(sid, []).append(s)
        out["sessions"] = len(per)
        out["per_session"] = {str(k): summarize_splits(v, pricing)["total_usd"] for k, v in per.items()}
    return out
