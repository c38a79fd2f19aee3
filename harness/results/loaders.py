"""Results are data: tidy pandas DataFrames across every cell of an experiment (or a single replay run).

    from kvscope.harness.results.loaders import load_results
    res = load_results("results/quickstart/20261129-120000")
    res.requests      # one row per request, with cell columns (cell, server, workload, load, repeat)
    res.cells         # one row per cell: status, headline figures, server settings
    res.metrics       # /metrics time series of every cell
    res.manifest      # experiment.json (spec, model, servers and their facts)

A single `kvscope replay` run directory loads as an experiment of one cell, so every notebook and
`kvscope compare` work on either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvscope.harness.common.errors import KvscopeError

CELL_COLUMNS = ["cell", "server", "workload", "load", "repeat"]


@dataclass
class ExperimentResults:
    root: Path
    manifest: dict[str, Any]
    cells: pd.DataFrame
    requests: pd.DataFrame
    metrics: pd.DataFrame
    summaries: dict[str, dict] = field(default_factory=dict)
    cell_dirs: dict[str, Path] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.manifest.get("experiment") or self.root.name)

    @property
    def weights_random(self) -> bool:
        return bool((self.manifest.get("model") or {}).get("weights_random"))

    def ok_requests(self) -> pd.DataFrame:
        """Successful requests inside the measurement window: what statistics are computed on."""
        r = self.requests
        return r[r["error_class"].isna() & r["in_window"].astype(bool)]

    def trace_dir(self, workload: str) -> Path | None:
        rel = (self.manifest.get("traces") or {}).get(workload)
        if rel:
            return self.root / rel
        single = (self.manifest.get("single_run_trace"))
        return Path(single) if single else None

    def server_facts(self, server: str) -> dict:
        return ((self.manifest.get("servers") or {}).get(server) or {}).get("facts") or {}


def _summary_row(name: str, meta: dict, s: dict) -> dict[str, Any]:
    lat, hit, thr = s["latency"], s["hit_rate"], s["throughput"]
    facts = (s.get("server_facts") or [{}])[0]
    spec = s.get("speculative") or {}
    opts_conc = meta.get("concurrency")
    row = {
        "cell": name, "server": meta.get("server", name), "workload": meta.get("workload", "trace"),
        "load": meta.get("load", "run"), "repeat": meta.get("repeat", 0), "status": meta.get("status", "ok"),
        "reason": meta.get("reason"),
        "requests": s["requests"]["sent"], "ok": s["requests"]["ok"], "failed": s["requests"]["failed"],
        "error_rate": s["requests"]["error_rate"], "duration_s": s["duration_s"],
        "req_per_s": thr["requests_per_s"], "output_tok_per_s": thr["output_tokens_per_s"],
        "prompt_tok_per_s": thr["prompt_tokens_per_s"],
        "hit_server": hit["server_per_request"], "hit_metrics": hit["metrics_counters"],
        "hit_predicted": hit["predicted"], "would_hit": hit.get("would_hit"),
        "requests_predicted_exactly": hit["requests_predicted_exactly"], "requests_compared": hit["requests_compared"],
        "prefix_caching": facts.get("prefix_caching"), "speculative": bool(facts.get("speculative_enabled")),
        "block_size": facts.get("block_size"), "num_blocks": facts.get("num_blocks"),
        "kv_capacity_tokens": facts.get("kv_capacity_tokens"),
        "spec_acceptance_rate": spec.get("acceptance_rate"), "spec_mean_acceptance_length": spec.get("mean_acceptance_length"),
        "concurrency": opts_conc, "aborted": s.get("aborted"),
    }
    for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        for q in ("p50", "p90", "p99", "mean"):
            row[f"{metric[:-2]}_{q}_s"] = lat[metric][q]
    if s.get("goodput"):
        row["goodput_fraction"] = s["goodput"]["fraction"]
        row["goodput_req_per_s"] = s["goodput"]["goodput_req_per_s"]
    return row


def _load_cell(cell_dir: Path, name: str, meta: dict) -> tuple[pd.DataFrame, pd.DataFrame, dict | None]:
    from kvscope.harness.results.records import read_records

    summary = None
    sp = cell_dir / "summary.json"
    if sp.exists():
        summary = json.loads(sp.read_text())
    try:
        req = read_records(cell_dir)
    except Exception:  # noqa: BLE001 - a failed cell may have no records
        req = pd.DataFrame()
    met = pd.read_parquet(cell_dir / "server_metrics.parquet") if (cell_dir / "server_metrics.parquet").exists() \
        else pd.DataFrame()
    for df in (req, met):
        if len(df) or len(df.columns):
            df["cell"] = name
            for k in ("server", "workload", "load", "repeat"):
                df[k] = meta.get(k, {"server": name, "workload": "trace", "load": "run", "repeat": 0}[k])
    return req, met, summary


def load_results(path: str | Path) -> ExperimentResults:
    """Load an experiment run directory (`experiment.json`) or a single replay run (`summary.json`)."""
    root = Path(path)
    if (root / "experiment.json").exists():
        manifest = json.loads((root / "experiment.json").read_text())
        entries = manifest.get("cells") or {}
    elif (root / "summary.json").exists() or (root / "requests.jsonl").exists():
        run_manifest = json.loads((root / "manifest.json").read_text()) if (root / "manifest.json").exists() else {}
        name = root.name
        server_conf = run_manifest.get("server_config") or {}
        manifest = {"experiment": name, "single_run": True, "cells": {name: {"status": "ok", "dir": "."}},
                    "model": {"path": server_conf.get("model"), "weights_random": None},
                    "single_run_trace": (run_manifest.get("trace") or {}).get("path"), "run_manifest": run_manifest}
        entries = manifest["cells"]
    else:
        raise KvscopeError(f"{root}: not an experiment run (experiment.json) or a replay run (summary.json)")
    req_frames, met_frames, rows = [], [], []
    summaries: dict[str, dict] = {}
    dirs: dict[str, Path] = {}
    for name, meta in entries.items():
        cdir = root / meta["dir"] if meta.get("dir") else root / "cells" / name
        dirs[name] = cdir
        if not cdir.exists():
            rows.append({"cell": name, **{k: meta.get(k) for k in ("server", "workload", "load", "repeat")},
                         "status": meta.get("status"), "reason": meta.get("reason")})
            continue
        req, met, summary = _load_cell(cdir, name, meta)
        if len(req):
            req_frames.append(req)
        if len(met):
            met_frames.append(met)
        if summary is not None:
            summaries[name] = summary
            rows.append(_summary_row(name, meta, summary))
        else:
            rows.append({"cell": name, **{k: meta.get(k) for k in ("server", "workload", "load", "repeat")},
                         "status": meta.get("status"), "reason": meta.get("reason")})
    if manifest.get("single_run") and summaries:
        s = next(iter(summaries.values()))
        manifest.setdefault("servers", {})[next(iter(entries))] = {"facts": (s.get("server_facts") or [{}])[0]}
    cells = pd.DataFrame(rows)
    requests = pd.concat(req_frames, ignore_index=True) if req_frames else pd.DataFrame()
    metrics = pd.concat(met_frames, ignore_index=True) if met_frames else pd.DataFrame()
    return ExperimentResults(root=root, manifest=manifest, cells=cells, requests=requests, metrics=metrics,
                             summaries=summaries, cell_dirs=dirs)
