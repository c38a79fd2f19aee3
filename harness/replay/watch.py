"""Server watch: scrape `/metrics` on an interval into a time series, plus first/last snapshots for deltas.

Scrapes run as their own asyncio task and parse in a worker thread, so a slow or large `/metrics` page never
delays request timing on the event loop. With a `spool_path`, every row is appended to a JSONL file as it is
scraped and only the latest `keep_rows` stay in memory, so an hours-long run holds a bounded amount; `write`
turns the spool into `server_metrics.parquet`. With `backends` (one per endpoint), each endpoint is scraped
at its backend's metrics path with its auth headers and parsed and differenced by its backend; an engine
without Prometheus metrics (`metrics_path` None) is not scraped.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import pandas as pd

from kvscope.harness.serving.metrics import MetricsSnapshot, combine_deltas, metrics_delta, parse_metrics

if TYPE_CHECKING:
    from kvscope.harness.serving.backend import Backend

SERIES_NAME = "server_metrics.parquet"


@dataclass
class EndpointWatch:
    endpoint: str
    backend: "Backend | None" = None
    headers: dict[str, str] | None = None
    metrics_path: str | None = "/metrics"
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
    rows: list[dict] | collections.deque = field(default_factory=list)
    watches: list[EndpointWatch] = field(default_factory=list)
    spool_path: Path | None = None  # rows go to this JSONL as scraped; memory keeps the last `keep_rows`
    keep_rows: int = 120
    row_count: int = 0
    _task: asyncio.Task | None = None
    _stop: asyncio.Event | None = None
    _fd: int = -1
    backends: "list[Backend] | None" = None  # one per endpoint: metrics path, auth headers, parser, delta

    def __post_init__(self) -> None:
        if self.backends is not None:
            self.watches = [EndpointWatch(e, b, b.auth_headers(), b.metrics_path)
                            for e, b in zip(self.endpoints, self.backends)]
        else:
            self.watches = [EndpointWatch(e, headers=self.headers) for e in self.endpoints]
        if self.spool_path is not None:
            self.spool_path = Path(self.spool_path)
            self.spool_path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.spool_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self.rows = collections.deque(maxlen=self.keep_rows)

    def _add_row(self, row: dict) -> None:
        self.row_count += 1
        self.rows.append(row)
        if self._fd >= 0:
            os.write(self._fd, orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS))

    def close_spool(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    async def scrape_once(self, session) -> None:
        import aiohttp  # deferred: a heavy import that only a running replay needs

        loop = asyncio.get_running_loop()
        for i, w in enumerate(self.watches):
            if w.metrics_path is None:
                continue
            try:
                async with session.get(w.endpoint.rstrip("/") + w.metrics_path, headers=w.headers,
                                       timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    resp.raise_for_status()
                    text = await resp.text()
            except Exception as exc:  # noqa: BLE001 - a failed scrape is recorded, never fatal
                w.errors += 1
                w.last_error = f"{exc.__class__.__name__}: {exc}"
                continue
            t = time.perf_counter() - self.t0
            parse: Any = w.backend.parse_metrics if w.backend is not None else parse_metrics
            snap = await loop.run_in_executor(None, parse, text, time.time())
            if w.first is None:
                w.first = snap
            w.last = snap
            row = {"t_s": t, "endpoint_index": i, **snap.gauges(), **snap.counter_columns()}
            self._add_row(row)

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
        """Run-level counter deltas of all endpoints pooled (``metrics.combine_deltas``: one deployment's
        rates), with each endpoint's own under ``per_endpoint``; empty when no endpoint was scraped twice."""
        per = []
        for w in self.watches:
            if w.first is not None and w.last is not None:
                delta = w.backend.metrics_delta if w.backend is not None else metrics_delta
                per.append(delta(w.first, w.last))
        if not per:
            return {}
        total = combine_deltas(per).to_dict()
        total["per_endpoint"] = [d.to_dict() for d in per]
        return total

    def write(self, run_dir: Path) -> Path:
        out = Path(run_dir) / SERIES_NAME
        self.close_spool()
        if self.spool_path is not None and self.spool_path.exists():
            rows = [orjson.loads(line) for line in self.spool_path.read_bytes().splitlines() if line.strip()]
        else:
            rows = list(self.rows)
        pd.DataFrame(rows).to_parquet(out, index=False)
        return out
