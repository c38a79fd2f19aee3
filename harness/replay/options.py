"""Replay options: how sessions start, how time is scaled, when to stop, how requests are bounded.

:class:`ReplayOptions` is the one definition of every replay option and its default. ``kvscope replay`` builds
its flags from these fields (default, choices, help text; only the flag names are its own), and an experiment's
``replay:`` section is a :class:`ReplayOptions` too (``experiment.spec.ReplaySettings``), so the library, the CLI
and experiments cannot drift apart. Chosen defaults: ``time_scale`` 1 (a replay keeps the trace's think times
and tool latencies, which decide how long cached prefixes must survive; CPU experiments set 0 explicitly),
``total_timeout_s`` 1800 s (the first-token and idle timeouts already catch stalls, so the total only bounds
very long generations), ``scrape_interval_s`` 1 s (enough resolution for the time-series figures at little
server CPU cost).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvscope.harness.cachemodel.routing import CACHE_BLIND_POLICIES, policy_name
from kvscope.harness.replay.priority import DEFAULT_CLIENT_PRIORITY, ClientPriority

from kvscope.harness.serving.request import Timeouts


class ReplayOptions(BaseModel):
    """Every replay option, with its default; the CLI and experiment specs take theirs from here."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["live", "recorded"] = Field(
        "recorded", description="live: the next prompt carries the model's actual output ids; "
                                "recorded: the trace's own assistant tokens")
    api: Literal["completions", "chat"] = Field(
        "completions", description="completions: token-id prompts (exact); chat: the trace's rendered messages")
    concurrency: int | None = Field(None, gt=0, description="closed loop: this many sessions at once")
    session_rate: float | None = Field(None, gt=0, description="open loop: new sessions per second")
    arrival_process: Literal["poisson", "gamma"] = Field("poisson", description="open loop: session arrivals")
    arrival_cv: float = Field(1.0, gt=0, description="gamma arrivals: coefficient of variation (>1 is bursty)")
    time_scale: float = Field(1.0, ge=0, description="multiplies think times, tool latencies and trace start times")
    max_active_sessions: int | None = Field(None, gt=0, description="at most this many sessions in flight")
    max_requests: int | None = Field(None, gt=0, description="stop after sending this many requests")
    duration_s: float | None = Field(None, gt=0, description="stop sending after this many seconds")
    warmup_s: float = Field(0.0, ge=0, description="requests sent earlier are excluded from statistics")
    cooldown_s: float = Field(0.0, ge=0, description="requests sent in the last S seconds are excluded")
    routing: str = Field("session-affinity", description="endpoint routing policy: "
                         + ", ".join(CACHE_BLIND_POLICIES) + " (underscores accepted)")
    on_error: Literal["end_session", "continue"] = Field(
        "end_session", description="what a session does after a failed step")
    retries: int = Field(0, ge=0, le=10, description="retries of a failed request (each try is its own record, "
                                                     "with `attempt` 1, 2, ...; off by default)")
    retry_backoff_s: float = Field(0.5, ge=0, description="wait before retry k: backoff * 2**(k-1), at most 30 s")
    health_timeout_s: float = Field(5.0, gt=0, description="/health check after a connection-level failure")
    connect_timeout_s: float = Field(10.0, gt=0, description="TCP connect, per request")
    first_token_timeout_s: float = Field(600.0, gt=0, description="from sending a request to its first token")
    idle_timeout_s: float = Field(120.0, gt=0, description="max gap between streamed chunks")
    total_timeout_s: float = Field(1800.0, gt=0, description="total time per request")
    slo_ttft_ms: float | None = Field(None, gt=0, description="goodput: TTFT objective")
    slo_tpot_ms: float | None = Field(None, gt=0, description="goodput: TPOT objective")
    scrape_interval_s: float = Field(1.0, gt=0, description="/metrics scrape period")
    seed: int = Field(0, description="seed for rate-driven arrivals")
    model: str | None = Field(None, description="model name sent in requests; default: the server's first model")
    api_key_env: str | None = Field(None, description="environment variable holding the API key")
    predict: bool = Field(True, description="predict each request's cached tokens with the simulator")
    calibration: str | None = Field(
        None, description="a step-cost calibration of the server (calibration.json, as kvscope capacity "
                          "--server or an experiment's sweep writes it): with overlapping requests the "
                          "recorded prediction is then the scheduler model's, replayed on the run's own "
                          "timeline, instead of the sequential simulator's")
    calibrate: bool = Field(
        False, description="calibrate the server before the run (a few dozen requests, "
                           "RUN_DIR/calibration.json) when the run's requests overlap and no calibration is given, so the recorded "
                           "prediction is the scheduler model's")
    reset_prefix_cache: bool = Field(True, description="POST /reset_prefix_cache first (needs dev mode) so "
                                                         "predictions start from the same empty cache")
    progress: bool = Field(True, description="live progress bar")
    client: Literal["auto", "fast", "aiohttp"] = Field(
        "auto", description="streaming client: the built-in HTTP/1.1 keep-alive client for http:// endpoints "
                            "(auto, fast) or aiohttp (https, proxies)")
    event_loop: Literal["auto", "asyncio", "uvloop"] = Field("auto", description="asyncio event loop implementation (auto: uvloop when installed)")
    client_priority: ClientPriority = Field(
        DEFAULT_CLIENT_PRIORITY, description="normal (default): the client's threads share the CPU like any "
                                             "process; realtime: SCHED_FIFO, so a busy host does not hold them "
                                             "up, at the cost of a busy neighbour on the same core (auto: "
                                             "realtime when permitted, i.e. root or CAP_SYS_NICE; see "
                                             "replay/priority.py and benchmarks/client_priority.py)")
    max_error_share: float = Field(0.05, ge=0, le=1, description="the run counts as failed (exit 1, cell "
                                                               "'failed') when more of its requests fail")
    records_flush_s: float = Field(0.05, ge=0, description="records are written at most this long after they "
                                                            "complete (0: each one at once)")

    @field_validator("routing")
    @classmethod
    def _routing_policy(cls, v: str) -> str:
        return policy_name(v, CACHE_BLIND_POLICIES)

    @model_validator(mode="after")
    def _one_loop(self) -> "ReplayOptions":
        if self.concurrency is not None and self.session_rate is not None:
            raise ValueError("give either concurrency (closed loop) or session_rate (open loop), not both")
        return self

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts(connect_s=self.connect_timeout_s, first_token_s=self.first_token_timeout_s,
                        idle_s=self.idle_timeout_s, total_s=self.total_timeout_s)
