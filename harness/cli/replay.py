"""`kvscope replay` — a trace through a live vLLM endpoint (or one kvscope starts), measured per request."""

from __future__ import annotations

import argparse
import json
import sys


def add_subcommands(sub) -> None:
    from kvscope.harness.cli.common import Formatter as _Formatter

    p = sub.add_parser(
        "replay", help="replay a trace through vLLM and record every request",
        description="Replay a trace's sessions through vLLM with agent/user timing. Writes RUN_DIR/requests.parquet "
                    "(one row per request: timings, every inter-token gap, server and predicted cached tokens), "
                    "server_metrics.parquet (/metrics time series), summary.json and manifest.json.",
        formatter_class=_Formatter)
    p.add_argument("trace", metavar="TRACE", help="kvscope trace directory (kvscope workload generate/import)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", action="append", metavar="URL",
                       help="vLLM base URL; repeat for replicas of one deployment")
    where.add_argument("--server", metavar="CONFIG.yaml", help="start this server config for the run, then stop it")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory to create")
    p.add_argument("--mode", choices=["live", "recorded"], default="recorded",
                   help="live: history carries the model's real output; recorded: the trace's tokens (default)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions",
                   help="token-id prompts on /v1/completions (exact, default) or rendered messages on chat")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, metavar="N", help="closed loop: N sessions at a time")
    load.add_argument("--session-rate", type=float, metavar="R",
                      help="open loop: R new sessions per second (default: the trace's own start times)")
    p.add_argument("--arrival-process", choices=["poisson", "gamma"], default="poisson")
    p.add_argument("--arrival-cv", type=float, default=1.0, metavar="CV", help="gamma arrivals: burstiness")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="multiply think times, tool latencies and trace start times (0.1 = 10x faster)")
    p.add_argument("--max-active-sessions", type=int, metavar="N")
    p.add_argument("--max-requests", type=int, metavar="N", help="stop after sending N requests")
    p.add_argument("--duration", type=float, metavar="S", help="stop sending after S seconds")
    p.add_argument("--warmup-s", type=float, default=0.0, metavar="S", help="exclude requests sent in the first S s")
    p.add_argument("--cooldown-s", type=float, default=0.0, metavar="S", help="exclude requests sent in the last S s")
    p.add_argument("--routing", choices=["round_robin", "session_affinity", "prefix_hash"], default="session_affinity",
                   help="how requests are spread over several endpoints (default session_affinity)")
    p.add_argument("--on-error", choices=["end_session", "continue"], default="end_session",
                   help="what a session does after a failed step (default end_session)")
    p.add_argument("--retries", type=int, default=0, metavar="N",
                   help="retry failed requests N times (default 0); every try is its own record")
    p.add_argument("--retry-backoff", type=float, default=0.5, metavar="S",
                   help="wait S * 2**(k-1) before retry k (at most 30 s)")
    p.add_argument("--client", choices=["auto", "fast", "aiohttp"], default="auto",
                   help="streaming client: built-in keep-alive HTTP/1.1 (http://) or aiohttp")
    p.add_argument("--event-loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="asyncio event loop implementation (auto: uvloop when installed)")
    p.add_argument("--records-flush", type=float, default=0.05, metavar="S",
                   help="write records at most S seconds after they complete (0: each at once)")
    p.add_argument("--max-error-share", type=float, default=0.05, metavar="X",
                   help="exit 1 when more than this share of requests fail (default 0.05)")
    p.add_argument("--request-timeout", type=float, default=1800.0, metavar="S", help="total time per request")
    p.add_argument("--idle-timeout", type=float, default=120.0, metavar="S", help="max gap between chunks")
    p.add_argument("--first-token-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S")
    p.add_argument("--slo-ttft-ms", type=float, metavar="MS", help="goodput: TTFT objective")
    p.add_argument("--slo-tpot-ms", type=float, metavar="MS", help="goodput: TPOT objective")
    p.add_argument("--scrape-interval", type=float, default=1.0, metavar="S", help="/metrics scrape period")
    p.add_argument("--model", metavar="NAME", help="model name for requests (default: the server's)")
    p.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    p.add_argument("--no-reset-prefix-cache", action="store_true",
                   help="keep the server's prefix cache as it is (default: reset it so predictions are exact)")
    p.add_argument("--seed", type=int, default=0, help="seed for rate-driven arrivals")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.set_defaults(func=_cmd_replay)


def _cmd_replay(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from kvscope.harness.common.errors import ConfigError, format_validation_error
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.replay.runner import replay

    try:
        opts = ReplayOptions(
            mode=args.mode, api=args.api, concurrency=args.concurrency, session_rate=args.session_rate,
            arrival_process=args.arrival_process, arrival_cv=args.arrival_cv, time_scale=args.time_scale,
            max_active_sessions=args.max_active_sessions, max_requests=args.max_requests, duration_s=args.duration,
            warmup_s=args.warmup_s, cooldown_s=args.cooldown_s, routing=args.routing, on_error=args.on_error,
            retries=args.retries, retry_backoff_s=args.retry_backoff, client=args.client,
            records_flush_s=args.records_flush, max_error_share=args.max_error_share, event_loop=args.event_loop, total_timeout_s=args.request_timeout, idle_timeout_s=args.idle_timeout,
            first_token_timeout_s=args.first_token_timeout, connect_timeout_s=args.connect_timeout,
            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, scrape_interval_s=args.scrape_interval,
            model=args.model, api_key_env=args.api_key_env, seed=args.seed, progress=not args.no_progress,
            reset_prefix_cache=not args.no_reset_prefix_cache)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "command line", ReplayOptions)) from exc
    from kvscope.harness.serving.endpoints import normalize_endpoint

    endpoints = [normalize_endpoint(e) for e in args.endpoint] if args.endpoint else None
    outcome = replay(args.trace, args.out, opts, endpoints=endpoints, server_config_path=args.server)
    print(format_console_summary(outcome.summary))
    print(f"\nrun directory: {outcome.run_dir}")
    if outcome.aborted:
        print(f"kvscope: error: replay stopped early: {outcome.aborted}", file=sys.stderr)
        return 1
    from kvscope.harness.replay.failure import replay_failure_reason

    failure = replay_failure_reason(outcome.summary, opts.max_error_share)
    if failure:
        print(f"kvscope: error: replay failed: {failure}", file=sys.stderr)
        return 1
    return 0


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def format_console_summary(s: dict) -> str:
    r, lat, hit = s["requests"], s["latency"], s["hit_rate"]
    lines = [
        f"requests: {r['sent']} sent, {r['ok']} ok, {r['failed']} failed"
        + (f" ({json.dumps(r['errors_by_class'])})" if r["failed"] else "")
        + (f", error rate {r['error_rate']:.1%}" if r.get("error_rate") else "")
        + (f", {r['retries']} retries" if r.get("retries") else ""),
        f"duration: {s['duration_s']:.1f} s   throughput: {s['throughput']['requests_per_s'] or 0:.2f} req/s, "
        f"{s['throughput']['output_tokens_per_s'] or 0:.1f} output tok/s",
        f"{'':>6} {'p50':>9} {'p90':>9} {'p99':>9}  (ms)",
    ]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = lat[key]
        lines.append(f"{key[:-2].upper():>6} {_ms(d['p50']):>9} {_ms(d['p90']):>9} {_ms(d['p99']):>9}")
    if r.get("length_mismatch"):
        lines.append(f"warning: {r['length_mismatch']} successful request(s) streamed a different number of tokens "
                     "than asked (max_tokens with ignore_eos) or than usage reported: column length_mismatch")
    client = s.get("client") or {}
    if client.get("saturated"):
        lines.append(f"warning: {client['note']} (client CPU {client['cpu_utilization']:.0%})")
    lines.append(f"prefix-cache hit rate: server per-request {_pct(hit['server_per_request'])}, "
                 f"/metrics counters {_pct(hit['metrics_counters'])}, predicted {_pct(hit['predicted'])} "
                 f"({hit['requests_predicted_exactly']}/{hit['requests_compared']} requests predicted exactly)")
    if "would_hit" in hit:
        lines.append(f"prefix caching is off: the same traffic would hit {_pct(hit['would_hit'])} with it on")
    spec = s.get("speculative")
    if spec:
        lines.append(f"speculative decoding: acceptance {_pct(spec['acceptance_rate'])}, mean acceptance length "
                     f"{spec['mean_acceptance_length']:.2f}" + (f"  [{spec['note']}]" if spec.get("note") else ""))
    return "\n".join(lines)
