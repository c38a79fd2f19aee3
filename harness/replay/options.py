"""Replay options: how sessions start, how time is scaled, when to stop, how requests are bounded."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvscope.harness.serving.client import Timeouts


class ReplayOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["live", "recorded"] = Field(
        "recorded", description="live: the next prompt carries the model's actual output ids; "
                                "recorded: the trace's own assistant tokens")
    api: Literal["completions", "chat"] = Field(
        "completions", description="completions: token-id prompts (exact); chat: the trace's rendered messages")
    concurrency: int | None = Field(None, gt=0, description="closed loop: this many sessions at once")
    session_rate: float | None = Field(None, gt=0, description="open loop: new sessions per second")
    arrival_process: Literal["poisson", "gamma"] = "poisson"
    arrival_cv: float = Field(1.0, gt=0, description="gamma arrivals: coefficient of variation (>1 is bursty)")
    time_scale: float = Field(1.0, ge=0, description="multiplies think times, tool latencies and trace start times")
    max_active_sessions: int | None = Field(None, gt=0)
    max_requests: int | None = Field(None, gt=0)
    duration_s: float | None = Field(None, gt=0)
    warmup_s: float = Field(0.0, ge=0, description="requests sent earlier are excluded from statistics")
    cooldown_s: float = Field(0.0, ge=0, description="requests sent in the last S seconds are excluded")
    routing: Literal["round_robin", "session_affinity", "prefix_hash"] = "session_affinity"
    on_error: Literal["end_session", "continue"] = "end_session"
    retries: int = Field(0, ge=0, le=10, description="retries of a failed request (each try is its own record, "
                                                     "with `attempt` 1, 2, ...; off by default)")
    retry_backoff_s: float = Field(0.5, ge=0, description="wait before retry k: backoff * 2**(k-1), at most 30 s")
    health_timeout_s: float = Field(5.0, gt=0, description="/health check after a connection-level failure")
    connect_timeout_s: float = Field(10.0, gt=0)
    first_token_timeout_s: float = Field(600.0, gt=0)
    idle_timeout_s: float = Field(120.0, gt=0)
    total_timeout_s: float = Field(1800.0, gt=0)
    slo_ttft_ms: float | None = Field(None, gt=0)
    slo_tpot_ms: float | None = Field(None, gt=0)
    scrape_interval_s: float = Field(1.0, gt=0)
    seed: int = 0
    model: str | None = Field(None, description="model name sent in requests; default: the server's first model")
    api_key_env: str | None = None
    predict: bool = True
    reset_prefix_cache: bool = Field(True, description="POST /reset_prefix_cache first (needs dev mode) so "
                                                         "predictions start from the same empty cache")
    progress: bool = True
    client: Literal["auto", "fast", "aiohttp"] = Field(
        "auto", description="streaming client: the built-in HTTP/1.1 keep-alive client for http:// endpoints "
                            "(auto, fast) or aiohttp (https, proxies)")
    event_loop: Literal["auto", "asyncio", "uvloop"] = Field("auto", description="uvloop when installed (auto)")
    max_error_share: float = Field(0.05, ge=0, le=1, description="the run counts as failed (exit 1, cell "
                                                               "'failed') when more of its requests fail")
    records_flush_s: float = Field(0.05, ge=0, description="records are written at most this long after they "
                                                            "complete (0: each one at once)")

    @model_validator(mode="after")
    def _one_loop(self) -> "ReplayOptions":
        if self.concurrency is not None and self.session_rate is not None:
            raise ValueError("give either concurrency (closed loop) or session_rate (open loop), not both")
        return self

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts(connect_s=self.connect_timeout_s, first_token_s=self.first_token_timeout_s,
                        idle_s=self.idle_timeout_s, total_s=self.total_timeout_s)
