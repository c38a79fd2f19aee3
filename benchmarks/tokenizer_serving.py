"""Serve the local model built on each tokenizer and time it: server start, the chat template through
/v1/chat/completions, and a short replay of the same conversation turns (token counts per turn).

    flock /tmp/kvscope-vllm.lock .venv/bin/python benchmarks/tokenizer_serving.py MODEL_DIR [MODEL_DIR ...]

Build the models first: ``kvscope model build-tiny --out models/tiny`` and
``kvscope model build-tiny --out models/tiny-tekken --tokenizer tekken``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvscope.harness.serving.server import ServerConfig, VllmServer

TURNS = [
    "List the files in the repository and tell me which one holds the HTTP client.",
    "Open harness/replay/client.py and explain how a request's time to first token is measured.",
    "Now add a retry with exponential backoff when the server answers 503, and show the diff.",
    "Run the tests in tests/test_client_fast.py and summarise the failures, if any.",
]


def measure(model_dir: str) -> dict:
    log = Path(tempfile.mkdtemp(prefix="tokserve-")) / "server.log"
    cfg = ServerConfig(model=model_dir, served_model_name="tiny", max_model_len=4096, kv_cache_memory_bytes="64M",
                       startup_timeout_s=300)
    t0 = time.perf_counter()
    server = VllmServer(cfg, log_path=log)
    server.start()
    start_s = time.perf_counter() - t0
    try:
        messages = [{"role": "system", "content": "You are a coding agent. Today is 2026-12-03."}]
        prompt_tokens, latencies = [], []
        with httpx.Client(timeout=120) as client:
            for turn in TURNS:
                messages.append({"role": "user", "content": turn})
                t = time.perf_counter()
                r = client.post(server.endpoint + "/v1/chat/completions",
                                json={"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t)
                body = r.json()
                prompt_tokens.append(body["usage"]["prompt_tokens"])
                messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""})
    finally:
        server.stop()
    return {"model": model_dir, "start_s": start_s, "prompt_tokens": prompt_tokens,
            "median_request_s": statistics.median(latencies)}


def main(argv: list[str]) -> int:
    rows = [measure(m) for m in argv]
    print(f"{'model':<28} {'server start s':>14} {'median request s':>17}  prompt tokens per turn")
    for r in rows:
        print(f"{r['model']:<28} {r['start_s']:>14.1f} {r['median_request_s']:>17.3f}  {r['prompt_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["models/tiny"]))
