"""``kvscope record`` (the recording proxy) and ``kvscope explain`` (cache-break attribution).

Registered by ``kvscope.harness.cli.main`` through PLUGIN_MODULES; imports are lazy so ``--help`` starts fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvscope.harness.cli.common import add_parser


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    rec = add_parser(sub, "record", "record an agent's OpenAI-compatible traffic into a text-mode trace",
                     "Run a reverse proxy on --listen that forwards everything to --upstream (vLLM or any "
                     "OpenAI-compatible provider) and records /v1/chat/completions and /v1/completions "
                     "exchanges (streaming or not, tools, usage with cached tokens, timings). Ctrl-C stops it "
                     "and writes the trace into --out; `--finalize DIR` builds the trace from a directory a "
                     "killed proxy left. API keys are forwarded, never written. See docs/record.md.")
    rec.add_argument("--upstream", metavar="URL", help="the server to forward to, e.g. http://127.0.0.1:8000")
    rec.add_argument("--listen", default="127.0.0.1:8001", metavar="HOST:PORT",
                     help="where the proxy listens (default 127.0.0.1:8001; port 0 picks a free one)")
    rec.add_argument("--out", metavar="TRACE_DIR", help="output directory (exchanges.jsonl, then the trace)")
    rec.add_argument("--finalize", metavar="DIR", help="do not proxy: build the trace of a recording directory")
    rec.add_argument("--tokenizer", metavar="DIR",
                     help="model directory with tokenizer.json and a chat template, for upstreams without "
                          "/tokenize (default: the upstream's /tokenize)")
    rec.add_argument("--chat-template", metavar="FILE", help="with --tokenizer: the chat template the server uses")
    rec.add_argument("--api-key-env", metavar="VAR", help="with --finalize: env var holding the upstream's API key")
    rec.set_defaults(func=_cmd_record)

    ex = add_parser(sub, "explain", "attribute every prompt-cache miss of a trace or run to its cause",
                    "For each request: its best cached predecessor, where the prompt first diverges from it (in "
                    "message terms), the cause (volatile_field, system_prompt_changed, tools_changed, "
                    "message_edited, history_truncated, compaction, evicted) and the tokens recomputed because "
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
    ex.add_argument("--no-progress", action="store_true", help="do not show progress bars (stderr)")
    ex.set_defaults(func=_cmd_explain)


def _listen(text: str) -> tuple[str, int]:
    from kvscope.harness.common.errors import ConfigError

    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8001")
    return host, int(port)


def _cmd_record(args: argparse.Namespace) -> int:
    import os

    from kvscope.harness.common.errors import ConfigError
    from kvscope.harness.record.build import finalize

    if args.finalize:
        headers = {}
        if args.api_key_env:
            key = os.environ.get(args.api_key_env)
            if not key:
                raise ConfigError(f"--api-key-env: environment variable {args.api_key_env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        out = finalize(args.finalize, upstream=args.upstream, tokenizer_dir=args.tokenizer,
                       chat_template=args.chat_template, headers=headers)
        _print_trace(out)
        return 0
    if not args.upstream or not args.out:
        raise ConfigError("record: give --upstream URL and --out TRACE_DIR (or --finalize DIR)")
    if not args.upstream.startswith(("http://", "https://")):
        raise ConfigError(f"--upstream {args.upstream!r}: expected an http:// or https:// URL")
    host, port = _listen(args.listen)
    proxy = _run_proxy(args.upstream, args.out, host, port)
    if proxy.writer.count == 0:
        print(f"no exchanges recorded; {args.out} holds only record.json", file=sys.stderr)
        return 0
    out = finalize(args.out, upstream=args.upstream, tokenizer_dir=args.tokenizer, chat_template=args.chat_template,
                   headers=proxy.auth_headers)
    _print_trace(out)
    return 0


def _run_proxy(upstream: str, out: str, host: str, port: int):
    import asyncio
    import signal

    from kvscope.harness.record.proxy import RecordingProxy
    from kvscope.harness.replay.runner import run_event_loop  # uvloop where installed

    async def run() -> RecordingProxy:
        proxy = RecordingProxy(upstream, out)
        bound = await proxy.start(host, port)
        print(f"recording on http://{host}:{bound} -> {upstream}; writing {out}/exchanges.jsonl. "
              "Ctrl-C stops and writes the trace.", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await proxy.close()
        return proxy

    return run_event_loop(run())


def _print_trace(out: Path) -> None:
    meta = json.loads((Path(out) / "trace.json").read_text())
    print(f"wrote trace {out}: {meta['num_requests']} requests in {meta['num_sessions']} session(s), "
          f"{meta['num_segment_tokens']} distinct tokens (tokenized by {meta['record'].get('tokenized_by')})")


def _cmd_explain(args: argparse.Namespace) -> int:
    from kvscope.harness.analysis.explain import explain_path

    ex = explain_path(args.path, args.block_size, args.provider, progress=not args.no_progress)
    if args.json:
        text = json.dumps(ex.to_json(), indent=2)
        if args.json == "-":
            print(text)
            return 0
        Path(args.json).write_text(text + "\n")
    print(format_explanation(ex, every=args.all))
    return 0


def provider_comparison_lines(ex) -> list[str]:
    """Observed provider cache reads beside the provider cache model's, per request, and their agreement
    (:func:`kvscope.harness.analysis.explain.provider_comparison`)."""
    from kvscope.harness.analysis.explain import provider_comparison

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
    return "\n".join(lines)
