"""Self-hosted serving cost of a predicted (or measured) run: GPU-hours at a rental price, split into $ per
million input and output tokens and $ per 1,000 sessions.

Why a split rule at all: a GPU-hour buys prefill and decode together, and "$ per 1M input tokens" only means
something under a rule for sharing the hour.  The rule here: the hour is shared in proportion to the step
model's marginal time of the run's *uncached* prompt tokens (prefill) against the rest of its busy time
(decode); so a higher prefix-cache hit rate makes input tokens cheaper, as it does on the GPU.  Idle time
(waiting for the next request) is paid for and shared by the same proportion.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

GPU_PRICES_FILE = Path(__file__).with_name("gpu_prices.yaml")


class GpuHourPrice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu: str
    provider: str
    usd_per_gpu_hour: float = Field(gt=0)
    as_of: str
    source: str


def load_gpu_prices(path: str | Path = GPU_PRICES_FILE) -> list[GpuHourPrice]:
    return [GpuHourPrice.model_validate(x) for x in yaml.safe_load(Path(path).read_text()) or []]


def gpu_hour_price(gpu: str, provider: str | None = None) -> GpuHourPrice | None:
    """The first price for ``gpu`` (by provider if given); None when there is none."""
    for p in load_gpu_prices():
        if p.gpu == gpu and (provider is None or p.provider == provider):
            return p
    return None


class ServingCost(BaseModel):
    """What a run costs on rented GPUs (all figures for the whole TP group)."""

    usd_per_gpu_hour: float
    price_source: str
    num_gpus: int
    gpu_hours: float
    total_usd: float
    #: Share of the GPU time attributed to prefilling uncached prompt tokens.
    input_time_share: float
    usd_per_mtok_input: float | None
    usd_per_mtok_output: float | None
    usd_per_mtok_blended: float | None
    usd_per_1000_sessions: float | None


def serving_cost(*, usd_per_gpu_hour: float, price_source: str, num_gpus: int, makespan_s: float,
                 prefill_s: float, busy_s: float, input_tokens: int, output_tokens: int,
                 sessions: int) -> ServingCost:
    """The run's cost; ``prefill_s`` is the marginal prefill time of its uncached prompt tokens and ``busy_s``
    the time the engine was stepping (see the module docstring for the split)."""
    hours = num_gpus * makespan_s / 3600.0
    total = hours * usd_per_gpu_hour
    share = min(max(prefill_s / busy_s, 0.0), 1.0) if busy_s > 0 else 0.0

    def per(x: float, tokens: int) -> float | None:
        return x / tokens * 1e6 if tokens else None

    return ServingCost(usd_per_gpu_hour=usd_per_gpu_hour, price_source=price_source, num_gpus=num_gpus,
                       gpu_hours=hours, total_usd=total, input_time_share=share,
                       usd_per_mtok_input=per(total * share, input_tokens),
                       usd_per_mtok_output=per(total * (1 - share), output_tokens),
                       usd_per_mtok_blended=per(total, input_tokens + output_tokens),
                       usd_per_1000_sessions=total / sessions * 1000 if sessions else None)
