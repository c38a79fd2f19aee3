"""`kvscope record` in front of real vLLM, driven by agent frameworks nobody here wrote (issue #27's validation).

    python3.11 -m venv /tmp/agents-venv
    /tmp/agents-venv/bin/pip install openai-agents langchain-openai langgraph "pydantic-ai-slim[openai]" smolagents
    flock /tmp/kvscope-vllm.lock timeout 1500 .venv/bin/python benchmarks/record_agents.py \\
        [--agents-venv /tmp/agents-venv] [--frameworks openai-agents,langgraph,pydantic-ai,smolagents] [--turns 4]

The frameworks live in their own venv (they are not kvscope dependencies); each runs a short tool-calling loop
(benchmarks/agents/*_loop.py) against the proxy with no session header. vLLM serves the tiny model with a
tool-aware chat template (scripted_agent.TOOLS_TEMPLATE), `--enable-auto-tool-choice --tool-call-parser hermes`,
and the loops ask for `tool_choice="required"`, so the untrained model's answers are tool calls by construction
(structured outputs, whitespace-free JSON: `VLLM_ENFORCE_STRICT_TOOL_CALLING=0` makes `required` a JSON-schema
constraint instead of hermes' structural tag). Per framework, from a reset prefix cache:

* exchanges lost: vLLM's finished requests (`vllm:request_success_total` delta) minus exchanges recorded;
* token counts: the recorded trace's prompt (rendered locally from the recorded body: tokenizer + template) and
  the recorded usage, request by request, against vLLM's usage; totals against vLLM's token counters;
* replay: the trace replayed sequentially after a cache reset (`kvscope replay --concurrency 1 --time-scale 0`),
  `cached_tokens` request by request against the live ones;
* explain: the share of recomputed tokens `kvscope explain` names a cause for (any cause; and excluding the
  generic `prefix_changed`).

Writes benchmarks/results/record_agents.json and prints one line per framework.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
AGENTS = REPO / "benchmarks" / "agents"
SCRIPTS = {"openai-agents": "openai_agents_loop.py", "langgraph": "langgraph_loop.py",
           "pydantic-ai": "pydantic_ai_loop.py", "smolagents": "smolagents_loop.py"}


def _counter(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _scrape(endpoint: str) -> dict[str, float]:
    import httpx

    text = httpx.get(endpoint + "/metrics", timeout=30).text
    return {k: _counter(text, f"vllm:{k}") for k in ("request_success_total", "prompt_tokens_total",
                                                     "generation_tokens_total")}


class _ProxyThread:
    def __init__(self, upstream: str, out: Path) -> None:
        from kvscope.harness.record.proxy import RecordingProxy

        self.loop = asyncio.new_event_loop()
        self.proxy = RecordingProxy(upstream, out)
        self.port = self.loop.run_until_complete(self.proxy.start("127.0.0.1", 0))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> int:
        n = asyncio.run_coroutine_threadsafe(self.proxy.shutdown(drain_s=5.0), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        return n


def run_framework(name: str, endpoint: str, model_dir: Path, template: Path, venv: Path, work: Path,
                  turns: int) -> dict:
    import httpx
    from kvscope.harness.analysis.explain import explain_path
    from kvscope.harness.record.build import finalize, read_exchanges_log
    from kvscope.harness.results.records import read_records
    from kvscope.workloads.trace import Trace

    out = work / name
    httpx.post(endpoint + "/reset_prefix_cache", timeout=60).raise_for_status()
    before = _scrape(endpoint)
    px = _ProxyThread(endpoint, out)
    env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{px.port}/v1", "OPENAI_API_KEY": "sk-dummy",
           "AGENT_MODEL": "tiny", "AGENT_TURNS": str(turns), "AGENT_MAX_TOKENS": "160", "PYTHONPATH": str(AGENTS)}
    started = time.time()
    agent = subprocess.run([str(venv / "bin" / "python"), str(AGENTS / SCRIPTS[name])], env=env,
                           capture_output=True, text=True, timeout=600)
    agent_s = time.time() - started
    interrupted = px.stop()
    after = _scrape(endpoint)
    rows = read_exchanges_log(out)
    ok = [r for r in rows if r.status == 200 and not r.error]
    served = int(after["request_success_total"] - before["request_success_total"])
    res: dict = {"framework": name, "agent_rc": agent.returncode, "agent_tail": (agent.stdout + agent.stderr)[-600:],
                 "agent_s": round(agent_s, 1), "exchanges_recorded": len(rows), "exchanges_ok": len(ok),
                 "interrupted": interrupted, "vllm_requests": served, "exchanges_lost": served - len(ok),
                 "streamed": sum(bool(r.request.get("stream")) for r in rows),
                 "tool_call_answers": sum(bool(r.response.tool_calls) for r in ok),
                 "parallel_tool_call_answers": sum(len(r.response.tool_calls) > 1 for r in ok)}
    if not ok:
        return res
    trace_dir = finalize(out, upstream=endpoint, tokenizer_dir=str(model_dir), chat_template=str(template))
    trace = Trace.read(trace_dir)
    ordered = sorted(ok, key=lambda r: (r.received_unix_s, r.request_id))
    usage = [r.response.usage for r in ordered]
    recorded_prompt = [len(trace.prompt_token_ids(i)) for i in range(trace.num_requests)]
    res.update({
        "sessions": trace.num_sessions,
        "prompt_tokens_trace": sum(recorded_prompt), "prompt_tokens_usage": sum(u.prompt_tokens for u in usage),
        "prompt_tokens_vllm": int(after["prompt_tokens_total"] - before["prompt_tokens_total"]),
        "completion_tokens_usage": sum(u.completion_tokens for u in usage),
        "completion_tokens_vllm": int(after["generation_tokens_total"] - before["generation_tokens_total"]),
        "prompt_mismatch_requests": sum(a != u.prompt_tokens for a, u in zip(recorded_prompt, usage)),
    })
    live = [int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for u in usage]
    run_dir = work / f"{name}-replay"
    r = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "replay", str(trace_dir), "--endpoint",
                        endpoint, "--out", str(run_dir), "--concurrency", "1", "--time-scale", "0", "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        res["replay_error"] = r.stderr[-500:]
        return res
    replayed = read_records(run_dir).sort_values("request_id")["cached_tokens"].astype(int).tolist()
    res.update({"live_cached_tokens": live, "replay_cached_tokens": replayed,
                "replay_cached_equal_requests": sum(a == b for a, b in zip(live, replayed)),
                "replay_requests": len(replayed)})
    ex = explain_path(str(trace_dir))
    named = sum(a.recomputed_tokens for a in ex.requests if a.cause)
    specific = sum(a.recomputed_tokens for a in ex.requests if a.cause and a.cause != "prefix_changed")
    res.update({"recomputed_tokens": ex.recomputed_tokens, "hit_rate": round(ex.hit_rate, 4),
                "explained_share": round(named / ex.recomputed_tokens, 4) if ex.recomputed_tokens else 1.0,
                "explained_specific_share": round(specific / ex.recomputed_tokens, 4) if ex.recomputed_tokens else 1.0,
                "causes": {c.cause: c.recomputed_tokens for c in ex.causes}})
    return res


def start_tool_server(model: Path, work: Path):
    """vLLM on the tiny model with a tool-aware template, the hermes tool parser and whitespace-free JSON tool
    calls; returns (the started server, the template file)."""
    from kvscope.harness.serving.server import ServerConfig, VllmServer
    from tests.doubles.scripted_agent import TOOLS_TEMPLATE

    work.mkdir(parents=True, exist_ok=True)
    template = work / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    cfg = ServerConfig(model=str(model), served_model_name="tiny", max_model_len=8192,
                       kv_cache_memory_bytes="64M", startup_timeout_s=300,
                       # required/named tool choice as a JSON-schema constraint, not hermes' structural tag
                       # (under which the untrained model pads the arguments with whitespace until max_tokens)
                       env={"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}, extra_args=[
                           "--enable-prompt-tokens-details", "--chat-template", str(template),
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                           "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'])
    server = VllmServer(cfg, log_path=work / "server.log")
    server.start()
    return server, template


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents-venv", default="/tmp/agents-venv", type=Path)
    ap.add_argument("--frameworks", default="openai-agents,langgraph,pydantic-ai,smolagents")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--model", default=os.environ.get("KVSCOPE_TEST_MODEL", str(REPO / "models" / "tiny")), type=Path)
    ap.add_argument("--keep", type=Path, help="keep recordings and replays here (default: a temp dir)")
    args = ap.parse_args()
    if not (args.agents_venv / "bin" / "python").exists():
        print(f"no agents venv at {args.agents_venv} (see the module doc)", file=sys.stderr)
        return 2
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvscope-agents-"))
    server, template = start_tool_server(args.model, work)
    results = []
    try:
        for name in args.frameworks.split(","):
            res = run_framework(name, server.endpoint, args.model, template, args.agents_venv, work, args.turns)
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if not k.endswith("cached_tokens")}), flush=True)
    finally:
        server.stop()
    out = REPO / "benchmarks" / "results" / "record_agents.json"
    out.write_text(json.dumps({"frameworks": results, "work_dir": str(work)}, indent=1) + "\n")
    print(f"{'framework':<14} {'req':>4} {'lost':>4} {'prompt tr/usage/vllm':>22} {'compl usage/vllm':>17} "
          f"{'replay=live':>11} {'explained':>9}")
    for r in results:
        print(f"{r['framework']:<14} {r['exchanges_ok']:>4} {r['exchanges_lost']:>4} "
              f"{r.get('prompt_tokens_trace', '-')!s:>6}/{r.get('prompt_tokens_usage', '-')!s:>6}/"
              f"{r.get('prompt_tokens_vllm', '-')!s:>6}  {r.get('completion_tokens_usage', '-')!s:>7}/"
              f"{r.get('completion_tokens_vllm', '-')!s:>6}  {r.get('replay_cached_equal_requests', '-')!s:>4}/"
              f"{r.get('replay_requests', '-')!s:<4}  {r.get('explained_share', '-')!s:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
