"""`kvscope workload …` subcommands. Registered by kvscope.harness.cli.main through ``add_subcommands``; every handler
imports what it needs lazily so that ``kvscope --help`` stays fast."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvscope.harness.cli.common import Formatter as _Fmt
from kvscope.harness.cli.common import add_parser as _p
from kvscope.harness.cli import argtypes
from kvscope.harness.common.errors import ConfigError
from kvscope.workloads import importers
from kvscope.workloads.errors import WorkloadError
from kvscope.workloads.importers import TRANSCRIPT_IMPORTERS, export_jsonl
from kvscope.workloads.presets import PRESET_DIR, list_presets
from kvscope.workloads.tokens import TokenSource
from kvscope.workloads.trace import Trace

WORKLOAD_HELP = """\
Generate, import, inspect and export token-exact workload traces.

A trace is a directory (trace.json, segments.parquet, requests.parquet; see docs/workloads.md) in which
every prompt is known token by token, so prefix-cache reuse can be predicted before anything is sent.
"""

# Agent-transcript formats (text mode; kvscope.workloads.importers.TRANSCRIPT_IMPORTERS holds the readers).
class _TranscriptFormats:
    """The registry's format names, read on first use (importing the importers at every `kvscope --help` would
    cost half a second): a new importer is one entry in TRANSCRIPT_IMPORTERS, not an edit here."""

    def _names(self) -> tuple[str, ...]:
        return tuple(TRANSCRIPT_IMPORTERS)

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())


TRANSCRIPT_FORMATS = _TranscriptFormats()


class _ImportFormats(_TranscriptFormats):
    def _names(self) -> tuple[str, ...]:
        return ("mooncake", "kvcache-tester", "jsonl", *super()._names(), "tracelab")

EXAMPLES = """\
examples:
  kvscope workload presets
  kvscope workload generate agent-coding --tokenizer models/tiny --out traces/agent --scale 0.05
  kvscope workload stats traces/agent --block-size 128
  kvscope workload import mooncake ../shared/data/mooncake_conversation_trace.jsonl --out traces/mooncake
  kvscope workload import claude-code ~/.claude/projects/P/SESSION.jsonl --tokenizer models/tiny --out traces/cc
  kvscope workload export traces/agent --format jsonl --out agent.jsonl
"""




def add_subcommands(subparsers) -> None:
    """Register the ``workload`` command group on the top-level ``kvscope`` parser."""
    wl = subparsers.add_parser("workload", help="generate, import, inspect and export workload traces",
                               description=WORKLOAD_HELP, epilog=EXAMPLES, formatter_class=_Fmt)
    sub = wl.add_subparsers(dest="workload_command", metavar="SUBCOMMAND")
    wl.set_defaults(func=lambda args: (wl.print_help(), 2)[1])

    g = _p(sub, "generate", "generate a trace from a YAML spec or a preset",
           "Generate a token-exact trace from SPEC (a YAML file or a preset name, see `workload presets`).")
    g.add_argument("spec", metavar="SPEC", help="spec file or preset name")
    g.add_argument("--tokenizer", metavar="MODEL_DIR", required=True,
                   help="model directory with tokenizer.json (token ids come from this tokenizer)")
    g.add_argument("--out", metavar="TRACE", required=True, help="trace directory to write")
    g.add_argument("--seed", type=int, default=None, help="random seed (default: the spec's seed)")
    g.add_argument("--scale", type=argtypes.positive_float, default=None,
                   help="multiply every token size, e.g. 0.05 for a CPU server (default: the spec's scale)")
    g.add_argument("--output-scale", type=argtypes.positive_float, default=None, metavar="X",
                   help="multiply output sizes (answers, tool calls) by X instead of --scale, so small CPU runs "
                        "keep outputs long enough for decode and speculation metrics")
    g.add_argument("--sessions", type=argtypes.positive_int, default=None, help="number of sessions (default: the spec's)")
    g.add_argument("--max-context", type=argtypes.positive_int, default=None, metavar="TOKENS",
                   help="end sessions before a request would exceed this many tokens (server max_model_len)")
    g.add_argument("--text", action="store_true", default=None,
                   help="text mode: also fill `messages` (rendered through MODEL_DIR's chat template) for "
                        "`kvscope replay --api chat`; token prompts then include the template tokens")
    g.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    g.add_argument("--allow-large", action="store_true",
                   help="skip the size check (by default generation stops before using half the free memory)")
    g.set_defaults(func=_cmd_generate)

    s = _p(sub, "stats", "summarise a trace: sizes, appends, transitions, ideal prefix-hit ratio")
    s.add_argument("trace", metavar="TRACE", help="trace directory")
    s.add_argument("--block-size", type=argtypes.block_size, default=None, metavar="B",
                   help="block size for the ideal hit ratio (default: native block size of imports, else 16)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--no-hit", action="store_true", help="skip the ideal hit ratio (faster on huge traces)")
    s.set_defaults(func=_cmd_stats)

    i = _p(sub, "import", "convert a real trace or agent transcript into a kvscope trace",
           "Convert a real trace. Block-id traces keep their reuse structure exactly: each distinct block id "
           "becomes one block of fresh tokens. Agent transcripts (claude-code, codex, openai-chat, swe-agent, "
           "openhands) become text-mode traces, one request per model call, tokenised with --tokenizer, with the "
           "provider's usage in the observed_* columns; tracelab round traces hold counts only and become token "
           "traces of synthetic tokens with the recorded prefix reuse.")
    i.add_argument("format", choices=_ImportFormats(),
                   help="source format")
    i.add_argument("src", metavar="SRC", help="source file (mooncake, jsonl, transcripts) or directory / .tar.gz "
                                              "(kvcache-tester)")
    i.add_argument("--out", metavar="TRACE", required=True, help="trace directory to write")
    i.add_argument("--tokenizer", metavar="MODEL_DIR", default=None,
                   help="transcripts: tokenise with this model's tokenizer and chat template (required); block "
                        "and tracelab imports: draw tokens from it (default: ids 0..4095)")
    i.add_argument("--limit", type=int, default=None, help="kvcache-tester: first N conversations only")
    i.add_argument("--session-interval", type=float, default=0.0, metavar="S",
                   help="kvcache-tester: start conversation i at i*S seconds (default 0)")
    i.add_argument("--seed", type=int, default=0, help="seed for the block tokens")
    i.set_defaults(func=_cmd_import)

    e = _p(sub, "export", "write a trace as JSONL (one request per line with token ids)")
    e.add_argument("trace", metavar="TRACE", help="trace directory")
    e.add_argument("--format", choices=["jsonl"], default="jsonl", help="output format")
    e.add_argument("--out", metavar="FILE", required=True, help="output file")
    e.set_defaults(func=_cmd_export)

    pr = _p(sub, "presets", "list the bundled workload presets")
    pr.set_defaults(func=_cmd_presets)


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvscope.workloads.generate import generate_from_file  # deferred: keeps `kvscope --help` fast

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out}: is an existing file; give a trace directory to create")
    from kvscope.harness.common.limits import generation_token_budget  # deferred: keeps `kvscope --help` fast

    from kvscope.workloads.spec import SpecError  # deferred: keeps `kvscope --help` fast

    max_tokens, hint = generation_token_budget(args.allow_large)
    try:
        trace = generate_from_file(args.spec, args.tokenizer, seed=args.seed, scale=args.scale,
                                   sessions=args.sessions, progress=not args.no_progress,
                                   max_context=args.max_context, text=args.text,
                                   output_scale=args.output_scale, max_tokens=max_tokens, budget_hint=hint)
    except SpecError as err:  # handled here too so that the handler itself returns 2 (tests call it directly)
        print(f"kvscope: error: {err}", file=sys.stderr)
        return 2
    trace.write(args.out)
    t = trace.meta.get("truncated_sessions", 0)
    print(f"wrote {args.out}: {trace.num_sessions} sessions, {trace.num_requests} requests, "
          f"{int(trace.requests['prompt_tokens'].sum()):,} prompt tokens in {trace.num_segments:,} segments"
          + (f" ({t} sessions ended early at the context limit)" if t else ""))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    # deferred: keeps `kvscope --help` fast
    from kvscope.workloads.stats import format_stats, to_json, trace_stats

    st = trace_stats(Trace.read(args.trace), block_size=args.block_size, hit=not args.no_hit)
    print(to_json(st) if args.json else format_stats(st))
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    if args.format in TRANSCRIPT_FORMATS:
        return _import_transcript(args)
    source = TokenSource.from_tokenizer(args.tokenizer) if args.tokenizer else None
    if args.format == "tracelab":
        trace = importers.import_tracelab(args.src, source, seed=args.seed)
    elif args.format == "mooncake":
        trace = importers.import_mooncake(args.src, source, seed=args.seed)
    elif args.format == "kvcache-tester":
        trace = importers.import_kvcache_tester(args.src, source, seed=args.seed, limit=args.limit,
                                                session_interval_s=args.session_interval)
    else:
        trace = importers.import_jsonl(args.src)
    trace.write(args.out)
    print(f"wrote {args.out}: {trace.num_sessions} sessions, {trace.num_requests} requests, "
          f"{trace.num_segments:,} segments")
    return 0


def _import_transcript(args: argparse.Namespace) -> int:
    if not args.tokenizer:
        raise WorkloadError(f"workload import {args.format}: --tokenizer MODEL_DIR is required (transcripts are "
                            "text; e.g. --tokenizer models/tiny)")
    trace = importers.TRANSCRIPT_IMPORTERS[args.format](args.src, args.tokenizer)
    trace.write(args.out)
    cached = trace.requests["observed_cache_read_input_tokens"].fillna(trace.requests["observed_cached_tokens"])
    usage = f", observed usage on {int(cached.notna().sum())} calls" if cached.notna().any() else ""
    print(f"wrote {args.out}: {trace.num_sessions} sessions, {trace.num_requests} model calls, "
          f"{int(trace.requests['prompt_tokens'].sum()):,} prompt tokens ({args.tokenizer}){usage}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    export_jsonl(Trace.read(args.trace), args.out)
    print(f"wrote {args.out}")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:  # noqa: ARG001
    import yaml  # deferred: keeps `kvscope --help` fast

    for name in list_presets():
        data = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())
        print(f"{name:<28} {data.get('description', '')}")
    return 0
