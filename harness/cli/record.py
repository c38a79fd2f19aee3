"""``kvscope record`` (the recording proxy) and ``kvscope explain`` (cache-break attribution).

Registered by ``kvscope.harness.cli.main`` through PLUGIN_MODULES; imports are lazy so ``--help`` starts fast.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from kvscope.harness.analysis.causes import Cause
from kvscope.harness.cli.common import add_parser
from kvscope.harness.common.errors import ConfigError
from kvscope.harness.common.runlock import lock_run_dir
from kvscope.harness.common.signals import handle_termination_like_sigint
from kvscope.harness.serving.backend import bearer_headers, resolve_api_key
from kvscope.workloads.trace_schema import read_trace_file


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    rec = add_parser(sub, "record", "record an agent's OpenAI-compatible traffic into a text-mode trace",
                     "Run a reverse proxy on --listen that forwards everything to --upstream (vLLM or any "
                     "OpenAI-compatible provider) and records /v1/chat/completions and /v1/completions "
                     "exchanges (streaming or not, tools, usage with cached tokens, timings). Ctrl-C or "
                     "SIGTERM stops it (exchanges in flight get --drain-s seconds, then are recorded as "
                     "interrupted; a second Ctrl-C stops at once) and writes the trace into --out; "
                     "`--finalize DIR` builds the trace from a directory a stopped or killed proxy left. API keys "
                     "are forwarded, never written; credential fields of request bodies are redacted. "
                     "See docs/record.md.")
    rec.add_argument("--upstream", metavar="URL", help="the server to forward to, e.g. http://127.0.0.1:8000")
    rec.add_argument("--listen", default="127.0.0.1:8001", metavar="HOST:PORT",
                     help="where the proxy listens (default 127.0.0.1:8001; port 0 picks a free one)")
    rec.add_argument("--out", metavar="TRACE_DIR", help="output directory (exchanges.jsonl, then the trace)")
    rec.add_argument("--finalize", metavar="DIR", help="do not proxy: build the trace of a recording directory")
    rec.add_argument("--tokenizer", metavar="DIR",
                     help="model directory with tokenizer.json and a chat template, for upstreams without "
                          "/tokenize (default: the upstream's /tokenize)")
    rec.add_argument("--chat-template", metavar="FILE", help="with --tokenizer: the chat template the server uses")
    rec.add_argument("--api-key-env", metavar="VAR",
                     help="environment variable holding the upstream's API key: sent upstream instead of the "
                          "client's, and used to tokenize at finalize (credentials in the --upstream URL, "
                          "user:password@, are sent as Basic auth and never printed)")
    rec.add_argument("--drain-s", type=float, default=5.0, metavar="S",
                     help="at Ctrl-C/SIGTERM, how long exchanges in flight get to end before they are recorded as "
                          "interrupted (default 5; a second Ctrl-C stops at once)")
    rec.add_argument("--max-exchange-mib", type=float, default=None, metavar="MIB",
                     help="finalize refuses an exchange (one line of exchanges.jsonl) larger than this "
                          "(default 16: tokenizing holds about 200 bytes per byte of prompt)")
    rec.add_argument("--no-progress", action="store_true", help="no progress bars while finalizing (stderr)")
    rec.set_defaults(func=_cmd_record)

    ex = add_parser(sub, "explain", "attribute every prompt-cache miss of a trace or run to its cause",
                    "For each request: its best cached predecessor, where the prompt first diverges from it (in "
                    f"message terms), the cause ({', '.join(Cause)}) and the tokens recomputed because "
                    "of it; totals per cause with their share and the hit rate with that cause removed "
                    "(re-simulated). TRACE: a trace directory (a recorded one carries the observed cache reads); "
                    "RUN_DIR: a `kvscope replay` output (observed = the measured cached tokens).")
    ex.add_argument("path", metavar="TRACE|RUN_DIR")
    ex.add_argument("--json", metavar="FILE", help="write {requests: [...], causes: [...]} to FILE ('-': stdout)")
    ex.add_argument("--block-size", type=int, metavar="B", help="KV block size (default: the trace's hint, else 16)")
    ex.add_argument("--provider", metavar="PRESET", default=None,
                    help="provider cache model shown beside observed provider cache reads (default: "
                         "anthropic-sonnet-5m for Anthropic usage, else openai-gpt-4.1)")
    ex.add_argument("--all", action="store_true", help="list every request, not only those with recomputed tokens")
    ex.add_argument("--routing", metavar="SPEC", default=None,
                    help="a model-routing spec (YAML/JSON, as `kvscope route --spec`: models, policy, stickiness): "
                         "route the requests between models, each with its own cache; the history a step "
                         "recomputes because its session's previous step ran on another model is model_switch, "
                         "and the summary says what the other stickiness would save. A recorded policy reads a "
                         "RUN_DIR's records (or --labels)")
    ex.add_argument("--labels", metavar="FILE", default=None,
                    help="with --routing: per-request signals or decisions (CSV / JSONL / Parquet with request_id)")
    ex.add_argument("--no-progress", action="store_true", help="do not show progress bars (stderr)")
    ex.set_defaults(func=_cmd_explain)


def _listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8001")
    return host, int(port)


def _auth_headers(api_key_env: str | None) -> dict[str, str]:
    """The upstream's auth headers from --api-key-env, by the serving layer's one rule (resolve_api_key)."""
    return bearer_headers(resolve_api_key(api_key_env, "--api-key-env"))


def _cmd_record(args: argparse.Namespace) -> int:
    from kvscope.harness.record.build import finalize  # deferred: keeps `kvscope --help` fast
    from kvscope.harness.record.proxy import split_url_credentials  # deferred: keeps `kvscope --help` fast

    if args.finalize:
        upstream, url_auth = split_url_credentials(args.upstream) if args.upstream else (None, {})
        with lock_run_dir(args.finalize, "kvscope record --finalize"):
            out = finalize(args.finalize, upstream=upstream, tokenizer_dir=args.tokenizer,
                           chat_template=args.chat_template, headers={**url_auth, **_auth_headers(args.api_key_env)},
                           **_finalize_options(args))
        _print_trace(out)
        return 0
    if not args.upstream or not args.out:
        raise ConfigError("record: give --upstream URL and --out TRACE_DIR (or --finalize DIR)")
    if not args.upstream.startswith(("http://", "https://")):
        raise ConfigError("--upstream: expected an http:// or https:// URL")
    if args.drain_s < 0:
        raise ConfigError(f"--drain-s {args.drain_s}: expected seconds >= 0")
    host, port = _listen(args.listen)
    with lock_run_dir(args.out, "kvscope record"):  # one proxy (and its finalize) per --out
        return _record_and_finalize(args, host, port)


def _record_and_finalize(args: argparse.Namespace, host: str, port: int) -> int:
    from kvscope.harness.record.build import finalize  # deferred: keeps `kvscope --help` fast

    proxy, hard_stop = _run_proxy(args.upstream, args.out, host, port, _auth_headers(args.api_key_env),
                                  args.drain_s)

    handle_termination_like_sigint()  # the loop's handlers are gone: a signal while finalizing stops cleanly
    hint = (f"the exchanges are in {args.out}/exchanges.jsonl; build the trace with "
            f"`kvscope record --finalize {args.out}" + (f" --tokenizer {args.tokenizer}`" if args.tokenizer else "`"))
    if proxy.interrupted:
        print(f"{proxy.interrupted} exchange(s) in flight recorded as interrupted", file=sys.stderr)
    if hard_stop:
        print(f"stopped at once (second signal); {hint}", file=sys.stderr)
        return 130
    if proxy.writer.count == 0:
        print(f"no exchanges recorded; {args.out} holds only record.json", file=sys.stderr)
        return 0
    try:
        out = finalize(args.out, upstream=proxy.upstream, tokenizer_dir=args.tokenizer,
                       chat_template=args.chat_template, headers=proxy.auth_headers, **_finalize_options(args))
    except KeyboardInterrupt:
        print(f"finalize interrupted; {hint}", file=sys.stderr)
        raise
    except Exception:
        print(hint, file=sys.stderr)
        raise
    _print_trace(out)
    if proxy.record_failure:  # said once already, when it happened; the exit status says it too
        print(f"kvscope: error: the recording is incomplete: {proxy.record_failure}", file=sys.stderr)
        return 2
    return 0


def _finalize_options(args: argparse.Namespace) -> dict:
    from kvscope.harness.record.build import MAX_EXCHANGE_MIB  # deferred: keeps `kvscope --help` fast

    cap = MAX_EXCHANGE_MIB if args.max_exchange_mib is None else args.max_exchange_mib
    return {"max_exchange_mib": cap, "progress": not args.no_progress}


def _run_proxy(upstream: str, out: str, host: str, port: int, headers: dict[str, str], drain_s: float):
    """Proxy until a signal (SIGINT, SIGTERM, SIGHUP); drain for ``drain_s``; a second signal stops at once.
    Returns (the proxy, whether the second signal cut the drain short)."""
    # deferred, these three: keep `kvscope --help` fast
    import asyncio

    from kvscope.harness.record.proxy import ProxyTimeouts, RecordingProxy, redact_url  # deferred: keeps kvscope --help fast
    from kvscope.harness.replay.runner import run_event_loop  # uvloop where installed

    async def run() -> tuple[RecordingProxy, bool]:
        proxy = RecordingProxy(upstream, out, ProxyTimeouts(drain_s=drain_s), upstream_headers=headers)
        bound = await proxy.start(host, port)
        print(f"recording on http://{host}:{bound} -> {redact_url(upstream)}; writing {out}/exchanges.jsonl. "
              "Ctrl-C stops and writes the trace.", flush=True)
        first, second = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            (second if first.is_set() else first).set()

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, on_signal)
        try:
            await first.wait()

            def draining(n: int) -> None:
                print(f"stopping: waiting up to {drain_s:g} s for {n} exchange(s) in flight "
                      "(Ctrl-C again to stop now)", file=sys.stderr, flush=True)

            shutdown = asyncio.ensure_future(proxy.shutdown(on_drain=draining))
            hard = asyncio.ensure_future(second.wait())
            await asyncio.wait({shutdown, hard}, return_when=asyncio.FIRST_COMPLETED)
            cut = hard.done() and not shutdown.done()
            if cut:
                await proxy.cancel_inflight()
            hard.cancel()
            await shutdown
            return proxy, cut
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            await proxy.close()

    return run_event_loop(run())


def _print_trace(out: Path) -> None:
    meta = read_trace_file(Path(out) / "trace.json")
    rec = meta.record or {}  # the proxy's open facts block
    print(f"wrote trace {out}: {meta.num_requests} requests in {meta.num_sessions} session(s), "
          f"{meta.num_segment_tokens} distinct tokens (tokenized by {rec.get('tokenized_by')})")
    left_out = [f"{rec[k]} {what}" for k, what in (("incomplete_exchanges", "incomplete (errors, interrupted, "
                                                    "client gone)"), ("skipped_exchanges", "not renderable"))
                if rec.get(k)]
    if left_out:
        print(f"left out of the trace: {', '.join(left_out)}; all are kept in exchanges.jsonl")


def _cmd_explain(args: argparse.Namespace) -> int:
    from kvscope.harness.analysis.explain import explain_path  # deferred: keeps `kvscope --help` fast

    if args.labels and not args.routing:
        raise ConfigError("--labels needs --routing SPEC")
    ex = explain_path(args.path, args.block_size, args.provider, progress=not args.no_progress,
                      routing=args.routing, labels=args.labels)
    if args.json:
        # json.dump writes as it encodes; json.dumps(indent=...) first holds every fragment of the text in a
        # list (346 k requests: ~0.5 GB beside an 84 MB file)
        if args.json == "-":
            json.dump(ex.to_json(), sys.stdout, indent=2)
            print()
            return 0
        from kvscope.workloads.versioned_file import naming_write_errors  # deferred: keeps kvscope --help fast

        with naming_write_errors(args.json), open(args.json, "w") as f:  # a full disk names the file
            json.dump(ex.to_json(), f, indent=2)
            f.write("\n")
    print(format_explanation(ex, every=args.all))
    return 0


def provider_comparison_lines(ex) -> list[str]:
    """Observed provider cache reads beside the provider cache model's, per request, and their agreement
    (:func:`kvscope.harness.analysis.explain.provider_comparison`)."""
    from kvscope.harness.analysis.explain import provider_comparison  # deferred: keeps `kvscope --help` fast

    rows, agreement = provider_comparison(ex)
    lines = [f"observed provider cache reads vs the {ex.provider_preset} cache model:",
             f"{'req':>5} {'observed':>9} {'share':>6} {'model':>7} {'share':>6}"]
    for r in rows:
        lines.append(f"{r['request_id']:>5} {r['observed_cache_read_tokens']!s:>9} {_pct(r['observed_share']):>6} "
                     f"{r['predicted_cache_read_tokens']!s:>7} {_pct(r['predicted_share']):>6}")
    if agreement is not None and agreement.mean_abs_share_gap_pp is not None:
        lines.append(f"agreement: mean |observed share - model share| {agreement.mean_abs_share_gap_pp:.1f} pp over "
                     f"{agreement.shares_compared} requests (shares, since the provider's prompt is tokenised "
                     "differently)")
    elif agreement is not None:
        lines.append(f"agreement: {agreement.exact}/{len(rows)} requests exactly")
    return lines


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def format_explanation(ex, every: bool = False) -> str:
    lines = [f"{len(ex.requests)} requests, {ex.prompt_tokens} prompt tokens, {ex.cached_tokens} cached "
             f"(hit rate {ex.hit_rate:.1%}), {ex.recomputed_tokens} recomputed (block size {ex.block_size})", ""]
    lines.append(f"{'req':>5} {'session':<14} {'step':>4} {'prompt':>7} {'cached':>7} {'recomp':>7}  cause / where")
    for a in ex.requests:
        if not every and not a.recomputed_tokens:
            continue
        lines.append(f"{a.request_id:>5} {a.session_id[:14]:<14} {a.step:>4} {a.prompt_tokens:>7} "
                     f"{a.cached_tokens:>7} {a.recomputed_tokens:>7}  {a.cause or '-'}  {a.where}")
    lines += ["", f"{'cause':<22} {'recomputed':>10} {'share':>7} {'hit rate without it':>20}"]
    for c in ex.causes:
        lines.append(f"{c.cause:<22} {c.recomputed_tokens:>10} {c.share:>7.1%} {c.what_if_hit_rate:>20.1%}")
    if not ex.causes:
        lines.append("(no recomputed tokens)")
    if ex.provider_preset:
        lines += ["", *provider_comparison_lines(ex)]
    if ex.routing is not None:
        from kvscope.harness.analysis.explain_routing import routing_lines  # deferred: keeps `kvscope --help` fast

        lines += ["", *routing_lines(ex.routing)]
    return "\n".join(lines)
