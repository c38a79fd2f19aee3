"""Which speculative methods beyond n-gram start on vLLM CPU, and what they accept (a few requests each).

Tries a draft model (``method: draft_model``: a second tiny model as the draft of the trained one; both
share the tokenizer) and suffix decoding (``method: suffix``, which needs the ``arctic-inference`` package),
each on its own server with ``--per-request-spec-decode-metrics detailed``; prints whether the server started
(else the reason from its log) and the acceptance on a few agent prompts at temperature 0.

Usage (starts up to two vLLM servers; wrap in flock on a shared machine):
    flock /tmp/kvscope-vllm.lock timeout 900 .venv/bin/python benchmarks/speculative_methods_cpu.py \
        --model models/tiny-trained --draft models/tiny
Writes benchmarks/results/speculative_methods_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True, help="the draft model directory (same tokenizer)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--methods", default="draft_model,suffix")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "speculative_methods_cpu.json"))
    args = ap.parse_args()

    import httpx
    from kvscope.harness.common.errors import KvscopeError
    from kvscope.harness.serving.server import ServerConfig, VllmServer
    from kvscope.workloads.trace import Trace

    work = Path(tempfile.mkdtemp(prefix="kvscope-specmethods-"))
    subprocess.run([str(Path(sys.executable).parent / "kvscope"), "workload", "generate", "agent-coding",
                    "--tokenizer", args.model, "--scale", "0.02", "--output-scale", "0.15", "--sessions", "1",
                    "--seed", "1", "--max-context", "2000", "--out", str(work / "trace"), "--no-progress"], check=True)
    trace = Trace.read(work / "trace")
    rids = list(range(min(args.requests, trace.num_requests)))
    # 32 MiB of KV: a draft model's KV cache comes out of the same budget (16 MiB was refused at max_model_len
    # 4096: "0.02 GiB KV cache is needed")
    cases = {
        "draft_model": {"method": "draft_model", "model": str(args.draft), "num_speculative_tokens": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    }
    results = {}
    for name, sc in cases.items():
        if name not in args.methods.split(","):
            continue
        log = work / f"{name}.log"
        server = VllmServer(ServerConfig(model=args.model, served_model_name="tiny", max_model_len=4096,
                                         kv_cache_memory_bytes="32M", startup_timeout_s=300, speculative_config=sc,
                                         extra_args=["--per-request-spec-decode-metrics", "detailed"]),
                            log_path=log)
        try:
            server.start()
        except KvscopeError as exc:
            tail = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln or "error" in ln][-3:] \
                if log.exists() else []
            results[name] = {"started": False, "error": str(exc).splitlines()[0], "log": tail}
            print(f"{name}: did not start: {results[name]['error']}\n  " + "\n  ".join(tail), flush=True)
            continue
        try:
            drafted = accepted = 0
            with httpx.Client(timeout=300) as client:
                for rid in rids:
                    r = client.post(server.endpoint + "/v1/completions", json={
                        "model": "tiny", "prompt": trace.prompt_token_ids(rid).tolist(),
                        "max_tokens": int(trace.requests["max_tokens"][rid]), "temperature": 0.0,
                        "ignore_eos": True})
                    r.raise_for_status()
                    sd = (r.json().get("metrics") or {}).get("speculative_decoding") or {}
                    drafted += sd.get("num_draft_tokens", 0)
                    accepted += sd.get("num_accepted_draft_tokens", 0)
            results[name] = {"started": True, "requests": len(rids), "draft_tokens": drafted, "accepted": accepted,
                             "acceptance_rate": accepted / drafted if drafted else None}
            print(f"{name}: started; {len(rids)} requests, {accepted}/{drafted} draft tokens accepted", flush=True)
        finally:
            server.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
