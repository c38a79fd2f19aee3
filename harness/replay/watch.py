"""Server watch: scrape `/metrics` on an interval into a time series, plus first/last snapshots for deltas.

Scrapes run as their own asyncio task and parse in a worker thread, so a slow or large `/metrics` page never
delays request timing on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.metrics import MetricsSnapshot, metrics_delta, parse_metrics

SERIES_NAME = "server_metrics.parquet"


@dataclass
class EndpointWatch:
    endpoint: str
    first: MetricsSnapshot | None = None
    last: MetricsSnapshot | None = None
    errors: int = 0
    last_error: str | None = None


@dataclass
class MetricsWatcher:
    endpoints: list[str]
    interval_s: float = 1.0
    headers: dict[str, str] | None = None
    t0: float = field(default_factory=time.perf_counter)
    rows: list[dict] = field(default_factory=list)
    watches: list[EndpointWatch] = field(default_factory=list)
    _task: asyncio.Task | None = None
    _stop: asyncio.Event | None = None

    def __post_init__(self) -> None:
        self.watches = [EndpointWatch(e) for e in self.endpoints]

    async def scrape_once(self, session) -> None:
        import aiohttp

        loop = asyncio.get_running_loop()
        for i, w in enumerate(self.watches):
            try:
                async with session.get(w.endpoint.rstrip("/") + "/metrics", headers=self.headers,
                                       timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    resp.raise_for_status()
                    text = await resp.text()
            except Exception as exc:  # noqa: BLE001 - a failed scrape is recorded, never fatal
                w.errors += 1
                w.last_error = f"{exc.__class__.__name__}: {exc}"
                continue
            t = time.perf_counter() - self.t0
            snap = await loop.run_in_executor(None, parse_metrics, text, time.time())
            if w.first is None:
                w.first = snap
            w.last = snap
            row = {"t_s": t, "endpoint_index": i, **snap.gauges(),
                   **{k.removeprefix("vllm:").removesuffix("_total"): v for k, v in snap.counters().items()}}
            self.rows.append(row)

    async def _run(self, session) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            await self.scrape_once(session)
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass

    def start(self, session) -> None:
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run(session))

    async def stop(self, session) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._task is not None:
            await self._task
        await self.scrape_once(session)  # final snapshot after the last request

    def latest(self) -> dict | None:
        return self.rows[-1] if self.rows else None

    def deltas(self) -> dict:
        """Run-level counter deltas summed over endpoints (None where an endpoint was never scraped)."""
        per = []
        for w in self.watches:
            if w.first is not None and w.last is not None:
                per.append(metrics_delta(w.first, w.last))
        if not per:
            return {}
        total = per[0].to_dict()
        for d in per[1:]:
            for k, v in d.to_dict().items():
                if isinstance(v, (int, float)) and isinstance(total.get(k), (int, float)) and not isinstance(v, bool):
                    total[k] += v
        if len(per) > 1:
            q = sum(d.prefix_cache_queries for d in per)
            total["prefix_cache_hit_rate"] = (sum(d.prefix_cache_hits for d in per) / q) if q else None
            dr = sum(d.spec_drafts for d in per)
            dt = sum(d.spec_draft_tokens for d in per)
            acc = sum(d.spec_accepted_tokens for d in per)
            total["spec_acceptance_rate"] = acc / dt if dt else None
            total["spec_mean_acceptance_length"] = 1 + acc / dr if dr else None
        total["per_endpoint"] = [d.to_dict() for d in per]
        return total

    def write(self, run_dir: Path) -> Path:
        import pandas as pd

        out = Path(run_dir) / SERIES_NAME
        pd.DataFrame(self.rows).to_parquet(out, index=False)
        return out
