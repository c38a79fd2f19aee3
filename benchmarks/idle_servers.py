"""CPU of idle vLLM CPU servers kept up beside a busy one (``servers_up: all``), per process, per phase.

An experiment keeps every configuration's server up so that repeats interleave (A B A B …); while one
configuration is measured the others wait. This starts two servers the way the experiment does (launched
together, the tiny model, kvscope's default server environment), then samples the CPU of every process of
both trees (API server, EngineCore) with psutil in three phases:

1. ``idle``: both servers idle after their start;
2. ``neighbour busy``: server A answers a stream of requests, B waits (what an experiment's idle server sees);
3. ``after``: A's requests are done; both idle again;
4. ``B paused, A busy``: B SIGSTOPped as ``idle_servers: pause`` does, A loaded again; then B continued and
   sent a request (it must answer).

Usage (starts real vLLM servers: take the machine's lock)::

    flock /tmp/kvscope-vllm.lock .venv/bin/python benchmarks/idle_servers.py --model /work/models/tiny \
        [--seconds 30] [--env KEY=VALUE …]
    flock /tmp/kvscope-vllm.lock .venv/bin/python benchmarks/idle_servers.py --model /work/models/tiny \
        --experiment 2 [--pause]

``--env`` adds variables to both servers' environment (e.g. ``OMP_WAIT_POLICY=PASSIVE``) to try a cause.
``--experiment N`` instead runs a quickstart-like experiment (baseline and n-gram kept up, N repeats) and
samples each server while the other one's cell runs (``--pause``: with ``idle_servers: pause``). Prints cores
used per process and phase; writes JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO

sys.path.insert(0, str(REPO))


def _tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _label(proc) -> str:
    try:
        name = proc.name()
        cmd = " ".join(proc.cmdline()[:3])
    except Exception:  # noqa: BLE001 - gone meanwhile
        return "?"
    if "EngineCore" in name or "EngineCore" in cmd:
        return "EngineCore"
    if "api_server" in cmd:
        return "APIServer"
    return name


def _cpu_s(proc) -> float:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001 - gone meanwhile
        return 0.0


def sample(servers: dict, seconds: float) -> dict[str, dict[str, float]]:
    """Cores used per server and process label over `seconds` (CPU seconds / wall seconds)."""
    procs = {name: _tree(s.process.pid) for name, s in servers.items()}
    before = {name: [(_label(p), _cpu_s(p)) for p in ps] for name, ps in procs.items()}
    t0 = time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - t0
    out: dict[str, dict[str, float]] = {}
    for name, ps in procs.items():
        per: dict[str, float] = {}
        for p, (label, c0) in zip(ps, before[name]):
            per[label] = per.get(label, 0.0) + (_cpu_s(p) - c0) / wall
        per["total"] = sum(per.values())
        out[name] = per
    return out


def _load(endpoint: str, stop: threading.Event, sent: list[int]) -> None:
    import httpx

    import numpy as np

    rng = np.random.default_rng(0)
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            prompt = rng.integers(1000, 4000, size=400).tolist()
            client.post(endpoint + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 32})
            sent[0] += 1


EXPERIMENT = """\
name: idle-cpu
model: {{source: path, path: {model}, served_model_name: tiny}}
server_defaults: {{max_model_len: 4096, kv_cache_memory_bytes: 16M{env}}}
servers:
  baseline: {{}}
  ngram-k4:
    speculative_config: {{method: ngram, num_speculative_tokens: 4, prompt_lookup_min: 2, prompt_lookup_max: 4}}
workloads:
  agent-coding: {{spec: agent-coding, scale: 0.02, output_scale: 0.15, sessions: 4, seed: 1, max_context: 2000}}
loads: [{{concurrency: 2}}]
repeats: {repeats}
"""


def _server_trees(root_pid: int) -> dict[str, list]:
    """vLLM API server trees under this process, by their --port."""
    import psutil

    out = {}
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "vllm.entrypoints.openai.api_server" in " ".join(cmd[:3]) and "--port" in cmd:
            out[cmd[cmd.index("--port") + 1]] = [p, *p.children(recursive=True)]
    return out


def during_experiment(model: str, repeats: int, env: dict[str, str], interval_s: float = 2.0,
                      pause: bool = False) -> dict:
    """Run a quickstart-like experiment (two configurations kept up, interleaved) and sample every server
    tree's CPU per interval; an interval where one server uses > 0.5 cores is that server's cell, and the
    other's CPU then is what an idle server costs."""
    import os
    import threading

    from kvscope.harness.experiment.runner import run_experiment

    tmp = Path(tempfile.mkdtemp(prefix="kvscope-idle-exp-"))
    env_yaml = (", env: {" + ", ".join(f"{k}: '{v}'" for k, v in env.items()) + "}") if env else ""
    spec = tmp / "spec.yaml"
    spec.write_text(EXPERIMENT.format(model=model, repeats=repeats, env=env_yaml)
                    + ("idle_servers: pause\n" if pause else ""))
    samples: list[dict[str, dict[str, float]]] = []
    stop = threading.Event()

    def sampler() -> None:
        last: dict[int, tuple[str, str, float]] = {}
        while not stop.wait(interval_s):
            row: dict[str, dict[str, float]] = {}
            for port, procs in _server_trees(os.getpid()).items():
                per: dict[str, float] = {}
                for p in procs:
                    c = _cpu_s(p)
                    if p.pid in last:
                        label = last[p.pid][1]
                        per[label] = per.get(label, 0.0) + max(0.0, c - last[p.pid][2]) / interval_s
                    last[p.pid] = (port, _label(p), c)
                per["total"] = sum(per.values())
                row[port] = per
            samples.append(row)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        run_experiment(spec, out=tmp / "results")
    finally:
        stop.set()
        thread.join()
    idle: dict[str, list[dict[str, float]]] = {}
    for row in samples:
        busy = [port for port, per in row.items() if per.get("total", 0) > 0.5]
        if len(row) == 2 and len(busy) == 1:
            for port, per in row.items():
                if port not in busy:
                    idle.setdefault(port, []).append(per)
    summary = {}
    for port, rows in idle.items():
        labels = sorted({k for r in rows for k in r})
        summary[port] = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in labels} | {"intervals": len(rows)}
    return {"idle_while_other_busy": summary, "samples": samples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("KVSCOPE_TEST_MODEL", str(REPO / "models/tiny")))
    ap.add_argument("--seconds", type=float, default=30.0, help="sampling window per phase")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra server environment")
    ap.add_argument("--pause", action="store_true", help="--experiment: with idle_servers: pause")
    ap.add_argument("--experiment", type=int, metavar="REPEATS", default=0,
                    help="instead: a quickstart-like experiment (baseline and n-gram kept up, REPEATS repeats), "
                         "each server's CPU sampled while the other one's cell runs")
    args = ap.parse_args()

    from kvscope.harness.serving.server import ServerConfig, VllmServer

    env = dict(kv.split("=", 1) for kv in args.env)
    if args.experiment:
        res = during_experiment(args.model, args.experiment, env, pause=args.pause)
        print("idle server while the other configuration's cell runs (cores, mean over intervals):")
        for port, per in res["idle_while_other_busy"].items():
            procs = ", ".join(f"{k} {v:.2f}" for k, v in per.items() if k not in ("total", "intervals"))
            print(f"  port {port}: total {per['total']:.2f} over {per['intervals']} intervals; {procs}")
        out = REPO / "benchmarks" / "results" / f"idle_servers_experiment{'_pause' if args.pause else ''}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2))
        print(f"wrote {out}")
        return 0
    logs = Path(tempfile.mkdtemp(prefix="kvscope-idle-"))
    servers = {n: VllmServer(ServerConfig(model=args.model, served_model_name="tiny", max_model_len=2048,
                                          kv_cache_memory_bytes="32M", startup_timeout_s=300, env=env),
                             log_path=logs / f"{n}.log") for n in ("A", "B")}
    result: dict = {"env": env, "seconds": args.seconds, "phases": {}}
    try:
        t0 = time.perf_counter()
        for s in servers.values():
            s.launch()
        for s in servers.values():
            s.finish_start()
        print(f"two servers up in {time.perf_counter() - t0:.0f} s; env {env or '{}'}", flush=True)
        time.sleep(5)
        phases = result["phases"]
        phases["idle"] = sample(servers, args.seconds)
        stop, sent = threading.Event(), [0]
        loader = threading.Thread(target=_load, args=(servers["A"].endpoint, stop, sent), daemon=True)
        loader.start()
        time.sleep(3)
        phases["neighbour busy"] = sample(servers, args.seconds)
        stop.set()
        loader.join(120)
        result["requests_to_A"] = sent[0]
        time.sleep(2)
        phases["after"] = sample(servers, args.seconds)
        # idle_servers: pause — B frozen while A is measured, then continued and asked again
        servers["B"].pause()
        stop, sent = threading.Event(), [0]
        loader = threading.Thread(target=_load, args=(servers["A"].endpoint, stop, sent), daemon=True)
        loader.start()
        time.sleep(3)
        phases["B paused, A busy"] = sample(servers, args.seconds)
        stop.set()
        loader.join(120)
        servers["B"].resume()
        import httpx

        t1 = time.perf_counter()
        r = httpx.post(servers["B"].endpoint + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": [1000, 1001, 1002], "max_tokens": 4})
        result["after_resume"] = {"status": r.status_code, "seconds": time.perf_counter() - t1}
        print(f"B after SIGCONT: HTTP {r.status_code} in {time.perf_counter() - t1:.2f} s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    print(f"{'phase':16s} {'server':6s} {'total':>6s}  per process (cores)")
    for phase, per_server in result["phases"].items():
        for name, per in per_server.items():
            procs = ", ".join(f"{k} {v:.2f}" for k, v in per.items() if k != "total")
            print(f"{phase:16s} {name:6s} {per['total']:6.2f}  {procs}")
    out = REPO / "benchmarks" / "results" / "idle_servers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
