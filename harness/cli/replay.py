"""`kvscope replay` — a trace through a live vLLM endpoint (or one kvscope starts), measured per request."""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from typing import Any, Literal

from pydantic import ValidationError

from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.results.schemas import CLIENT_STALL_S
from kvscope.harness.cli.common import Formatter as _Formatter
from kvscope.harness.common.errors import ConfigError, format_validation_error
from kvscope.harness.common.runlock import lock_run_dir
from kvscope.harness.results.summary import summary_file_model
from kvscope.harness.serving.endpoints import normalize_endpoint

def _option(parser: Any, flag: str, field: str, **overrides: Any) -> None:
    """Add one flag whose default, type, choices and help come from the ReplayOptions field; a ``--no-…`` flag
    turns a boolean field off. Only the flag name (and a metavar or a longer help) is the CLI's own."""
    info = ReplayOptions.model_fields[field]
    ann = info.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)] if isinstance(ann, types.UnionType) else [ann]
    kind = args[0]
    kw: dict[str, Any] = {"dest": field, "default": info.default, "help": info.description}
    if kind is bool:
        if not flag.startswith("--no-") or info.default is not True:
            raise ValueError(f"{flag}: a boolean option is a --no-… flag over a field that defaults to True")
        kw["action"] = "store_false"
    elif typing.get_origin(kind) is Literal:
        kw["choices"] = list(typing.get_args(kind))
    else:
        kw["type"] = kind
    kw.update(overrides)
    if kw.get("help") and kw.get("action") != "store_false" and info.default is not None:
        kw["help"] += f" (default {info.default})"
    parser.add_argument(flag, **kw)


def options_from_args(args: argparse.Namespace) -> ReplayOptions:
    """The ReplayOptions that the parsed flags describe (raises pydantic's ValidationError)."""
    return ReplayOptions(**{field: getattr(args, field) for field in ReplayOptions.model_fields if hasattr(args, field)})


def add_subcommands(sub) -> None:
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
    _option(p, "--mode", "mode")
    _option(p, "--api", "api")
    load = p.add_mutually_exclusive_group()
    _option(load, "--concurrency", "concurrency", metavar="N")
    _option(load, "--session-rate", "session_rate", metavar="R",
            help="open loop: R new sessions per second (default: the trace's own start times)")
    _option(p, "--arrival-process", "arrival_process")
    _option(p, "--arrival-cv", "arrival_cv", metavar="CV")
    _option(p, "--time-scale", "time_scale", metavar="X",
            help="multiply think times, tool latencies and trace start times (0.1 = 10x faster, 0 = no waits)")
    _option(p, "--max-active-sessions", "max_active_sessions", metavar="N")
    _option(p, "--max-requests", "max_requests", metavar="N")
    _option(p, "--duration", "duration_s", metavar="S")
    _option(p, "--warmup-s", "warmup_s", metavar="S")
    _option(p, "--cooldown-s", "cooldown_s", metavar="S")
    _option(p, "--routing", "routing")
    _option(p, "--on-error", "on_error")
    _option(p, "--retries", "retries", metavar="N")
    _option(p, "--retry-backoff", "retry_backoff_s", metavar="S")
    _option(p, "--client", "client")
    _option(p, "--event-loop", "event_loop")
    _option(p, "--client-priority", "client_priority")
    _option(p, "--records-flush", "records_flush_s", metavar="S")
    _option(p, "--max-error-share", "max_error_share", metavar="X")
    _option(p, "--request-timeout", "total_timeout_s", metavar="S")
    _option(p, "--idle-timeout", "idle_timeout_s", metavar="S")
    _option(p, "--first-token-timeout", "first_token_timeout_s", metavar="S")
    _option(p, "--connect-timeout", "connect_timeout_s", metavar="S")
    _option(p, "--slo-ttft-ms", "slo_ttft_ms", metavar="MS")
    _option(p, "--slo-tpot-ms", "slo_tpot_ms", metavar="MS")
    _option(p, "--scrape-interval", "scrape_interval_s", metavar="S")
    _option(p, "--model", "model", metavar="NAME")
    _option(p, "--api-key-env", "api_key_env", metavar="VAR")
    _option(p, "--no-reset-prefix-cache", "reset_prefix_cache",
            help="keep the server's prefix cache as it is (default: reset it so predictions are exact)")
    _option(p, "--no-predict", "predict", help="do not predict cached tokens (default: predict them)")
    _option(p, "--calibration", "calibration", metavar="FILE")
    p.add_argument("--calibrate", action="store_true", dest="calibrate",
                   help=ReplayOptions.model_fields["calibrate"].description)
    _option(p, "--seed", "seed")
    _option(p, "--no-progress", "progress", help="no live progress bar")
    p.add_argument("--model-routing", metavar="SPEC", default=None,
                   help="route each request to one of several models by a policy (a routing spec: models cheapest "
                        "first, policy, stickiness; as kvscope route --spec, docs/model-routing.md): give one "
                        "--endpoint per model, in the spec's order; a cascade's mean-logprob check asks the small "
                        "model for logprobs and re-sends a failed answer's prompt to the large model. Writes "
                        "RUN_DIR/routing.json: the offline routing model's cached tokens beside the servers'")
    p.add_argument("--labels", metavar="FILE", default=None,
                   help="--model-routing: per-request signals (CSV / JSONL / Parquet with request_id and one "
                        "column per signal); its request ids must be exactly the trace's")
    p.set_defaults(func=_cmd_replay)


def _cmd_replay(args: argparse.Namespace) -> int:
    from kvscope.harness.replay.runner import replay  # deferred: keeps `kvscope --help` fast

    try:
        opts = options_from_args(args)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "command line", ReplayOptions)) from exc

    endpoints = [normalize_endpoint(e) for e in args.endpoint] if args.endpoint else None
    routing = None
    if args.labels and not args.model_routing:
        raise ConfigError("--labels needs --model-routing")
    if args.model_routing:
        from kvscope.harness.cachemodel.model_routing import load_spec  # deferred: keeps `kvscope --help` fast

        routing = load_spec(args.model_routing)
        if endpoints is None:
            raise ConfigError("--model-routing needs one --endpoint per model of the spec, not --server")
    with lock_run_dir(args.out, "kvscope replay"):
        outcome = replay(args.trace, args.out, opts, endpoints=endpoints, server_config_path=args.server,
                         model_routing=routing, labels=args.labels)
    print(format_console_summary(outcome.summary))
    if routing is not None:
        print(format_routing_check(outcome.run_dir))
    print(f"\nrun directory: {outcome.run_dir}")
    if outcome.aborted:
        print(f"kvscope: error: replay stopped early: {outcome.aborted}", file=sys.stderr)
        return 1
    from kvscope.harness.replay.failure import replay_failure_reason  # deferred: keeps `kvscope --help` fast

    failure = replay_failure_reason(outcome.summary_file().requests, opts.max_error_share)
    if failure:
        print(f"kvscope: error: replay failed: {failure}", file=sys.stderr)
        return 1
    return 0


def format_routing_check(run_dir) -> str:
    """Model routing's console lines: requests per model, escalations, and the offline model's agreement."""
    from pathlib import Path

    from kvscope.harness.results.records import read_records  # deferred: keeps `kvscope --help` fast
    from kvscope.harness.results.routing_file import ROUTING_NAME, load_routing_file  # deferred: as above

    recs = read_records(run_dir)
    ok = recs[recs["error_class"].isna()]
    per_model = ", ".join(f"{m} {n}" for m, n in ok["model"].value_counts(sort=False).items())
    lines = [f"model routing: {per_model or 'no request served'}; {int(ok['escalated'].sum())} escalated "
             f"({int(ok['wasted_output_tokens'].sum())} output tokens of small attempts thrown away)"]
    path = Path(run_dir) / ROUTING_NAME
    if path.exists():
        check = load_routing_file(path)
        lines.append(f"  offline routing model: {_pct(check.exact_share)} of the served requests' cached tokens "
                     f"exact ({_pct(check.exact_share_all_attempts)} of all attempts), "
                     f"{check.model_switch_tokens:,} tokens recomputed after model switches ({ROUTING_NAME})")
    return "\n".join(lines)


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


#: How the console names each predictor (records.PREDICTORS).
PREDICTOR_WORDS = {"sequential": "the sequential simulator",
                   "scheduler-replay-informed": "the scheduler model on this run's timeline"}


def _prediction_lines(hit: Any) -> list[str]:
    """Which model predicted, how many requests it got exactly, and the sequential simulator's figure beside
    a scheduler prediction."""
    if hit.predictor is None:
        return []
    who = PREDICTOR_WORDS.get(hit.predictor, hit.predictor)
    lines = [f"predicted by {who} [{hit.predictor}]: "
             f"{hit.requests_predicted_exactly}/{hit.requests_compared} requests exact ({_pct(hit.predicted_exact_share)})"]
    if hit.predictor != "sequential" and hit.sequential_requests_predicted_exactly is not None:
        lines.append(f"  the sequential simulator: hit rate {_pct(hit.sequential_predicted)}, "
                     f"{hit.sequential_requests_predicted_exactly}/{hit.requests_compared} requests exact "
                     f"({_pct(hit.sequential_exact_share)})")
    if hit.predictor_note:
        lines.append(f"  note: {hit.predictor_note}")
    return lines


def format_console_summary(summary: dict[str, Any]) -> str:
    """The console lines of a replay's summary.json body, read through its model."""
    s = summary_file_model().model_validate(summary)
    r, lat, hit, client = s.requests, s.latency, s.hit_rate, s.client
    lines = [
        f"requests: {r.sent} sent, {r.ok} ok, {r.failed} failed"
        + (f" ({json.dumps(r.errors_by_class)})" if r.failed else "")
        + (f", error rate {r.error_rate:.1%}" if r.error_rate else "")
        + (f", {r.retries} retries" if r.retries else ""),
        f"duration: {s.duration_s:.1f} s   throughput: {s.throughput.requests_per_s or 0:.2f} req/s, "
        f"{s.throughput.output_tokens_per_s or 0:.1f} output tok/s",
        f"{'':>6} {'p50':>9} {'p90':>9} {'p99':>9}  (ms)",
    ]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = getattr(lat, key)
        lines.append(f"{key[:-2].upper():>6} {_ms(d.p50):>9} {_ms(d.p90):>9} {_ms(d.p99):>9}")
    if r.length_mismatch:
        lines.append(f"warning: {r.length_mismatch} successful request(s) streamed a different number of tokens "
                     "than asked (max_tokens with ignore_eos) or than usage reported: column length_mismatch")
    if client.saturated:
        lines.append(f"warning: {client.note} (client CPU {client.cpu_utilization:.0%})")
    if client.stalls:
        lines.append(f"warning: the replay client was held up {client.stalls} time(s) for over "
                     f"{CLIENT_STALL_S:g} s (longest {client.stall_max_s:.2f} s, {client.stalled_s:.1f} s in all): sessions started late "
                     "and tokens of those windows arrived in bursts; a busy or paused host (summary.json: client)")
    lines.append(f"prefix-cache hit rate: server per-request {_pct(hit.server_per_request)}, "
                 f"/metrics counters {_pct(hit.metrics_counters)}, predicted {_pct(hit.predicted)}")
    lines.extend(_prediction_lines(hit))
    if "would_hit" in hit.model_fields_set:
        lines.append(f"prefix caching is off: the same traffic would hit {_pct(hit.would_hit)} with it on")
    spec = s.speculative
    if spec:
        lines.append(f"speculative decoding: acceptance {_pct(spec.acceptance_rate)}, mean acceptance length "
                     f"{spec.mean_acceptance_length:.2f}" + (f"  [{spec.note}]" if spec.note else ""))
    return "\n".join(lines)
