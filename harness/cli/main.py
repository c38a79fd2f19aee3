"""`kvscope` — one command line for every stage. Imports are lazy so `--help` and quick commands start fast."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Callable, Sequence
import os
import signal
import time

from kvscope.harness.common.version import kvscope_version
from kvscope.harness.cli.common import Formatter as _Formatter
from kvscope.harness.common.errors import KvscopeError, ConfigError
from kvscope.harness.cli.common import LazyChoices
from kvscope.harness.cli.common import add_parser as _add
from kvscope.harness.common.signals import exit_code_for_interrupt, handle_termination_like_sigint
from kvscope.harness.serving.backend import Backend, backend_names, load_backend
from kvscope.harness.serving.endpoints import normalize_endpoint
from kvscope.workloads.errors import WorkloadError

DESCRIPTION = """\
kvscope: agent-loop workload profiler for LLM serving.

Generate token-exact chat and agent workloads, predict their prefix-cache behaviour offline,
replay them through a real vLLM server, and turn the measurements into notebook reports.
"""

EPILOG = """\
examples:
  kvscope model build-tiny --out models/tiny
  kvscope workload generate agent-coding --tokenizer models/tiny --scale 0.02 --out traces/agent
  kvscope simulate traces/agent --block-size 128 --json
  kvscope replay traces/agent --server server.yaml --out runs/agent --concurrency 4
  kvscope experiment run experiments/quickstart.yaml
  kvscope compare RUN_A RUN_B
  kvscope server-info --endpoint http://127.0.0.1:8000 --json

Run `kvscope COMMAND --help` for the options of each command.
"""

# Subcommand groups contributed by other packages: module with `add_subcommands(subparsers)`.
PLUGIN_MODULES = ("kvscope.harness.cli.workload", "kvscope.harness.cli.offline", "kvscope.harness.cli.replay", "kvscope.harness.cli.experiment",
                  "kvscope.harness.cli.record", "kvscope.harness.cli.capacity", "kvscope.harness.cli.speculate",
                  "kvscope.harness.cli.route",
                  "kvscope.harness.cli.predict")




# ----------------------------------------------------------------------------------------- handlers


def _cmd_build_tiny(args: argparse.Namespace) -> int:
    from kvscope.harness.model.tinymodel import build_tiny_model  # deferred: keeps `kvscope --help` fast

    info = build_tiny_model(args.out, seed=args.seed, train_steps=args.train_steps, tokenizer=args.tokenizer,
                            size=args.size)
    print(f"wrote {args.out}: {info.size} model, {info.num_parameters / 1e6:.2f} M parameters, "
          f"{info.shape.num_hidden_layers} layers of width {info.shape.hidden_size}, vocab {info.shape.vocab_size} "
          f"({info.tokenizer} tokenizer), "
          f"{info.shape.num_attention_heads} query / {info.shape.num_key_value_heads} KV heads, head_dim "
          f"{info.shape.head_dim}, weights {info.weights}"
          + (f" ({info.train_steps} training steps)" if info.train_steps else ""))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    backend = load_backend(args.config)
    if not backend.managed:
        raise ConfigError(f"--config {args.config}: backend {backend.name} attaches to a running server; "
                          "kvscope serve launches servers of a managed backend (vllm)")
    if args.port:
        backend.config = backend.config.model_copy(update={"port": args.port})
    log = Path(args.log) if args.log else None
    print(f"starting {backend.name} for {getattr(backend.config, 'model', '?')} …", flush=True)
    backend.start(log)
    facts = backend.facts()
    print(f"ready at {backend.endpoint} (log: {backend.log_path})\n{facts.as_json()}\nCtrl-C stops it.", flush=True)
    stop = {"now": False}

    def _handler(signum, frame):  # noqa: ARG001
        stop["now"] = True

    signal.signal(signal.SIGTERM, _handler)
    try:
        while not stop["now"] and backend.is_running():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    died = not backend.is_running() and not stop["now"]
    backend.stop()
    if died:
        print(f"{backend.name} exited on its own; see {backend.log_path}", file=sys.stderr)
        return 1
    print("server stopped")
    return 0


def _backend_names() -> list[str]:
    """The registered serving backends (imported only when ``--backend`` is checked or its help printed)."""
    return backend_names()


def _cmd_server_info(args: argparse.Namespace) -> int:
    backend = Backend.create(args.backend, endpoint=normalize_endpoint(args.endpoint), api_key_env=args.api_key_env)
    try:
        backend.auth_headers()
    except KvscopeError as exc:
        raise KvscopeError(str(exc).replace("api_key_env:", "--api-key-env:")) from None
    if args.log:
        backend.log_path = Path(args.log)  # facts only the log has (vllm: KV capacity, speculative config)
    facts = backend.facts()
    if args.json:
        print(facts.as_json())
    else:
        for k, v in facts.model_dump().items():
            if v is not None:
                print(f"{k:>24}: {v}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.experiment.demo import format_table, run_demo

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = run_demo(Path(args.model_dir), log_path=out / "server.log", turns=args.turns)
    table = format_table(rows)
    print("\nOne append-only conversation, token-id prompts, prefix caching on:\n")
    print(table)
    (out / "turns.json").write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    print(f"\nserver stopped; table saved to {out / 'turns.json'} (smoke check: {time.perf_counter() - t0:.0f} s)")
    grows = all(b.cached_tokens >= a.cached_tokens for a, b in zip(rows, rows[1:])) and rows[-1].cached_tokens > 0
    return 0 if grows else 1


# ------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvscope", description=DESCRIPTION, epilog=EPILOG, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"kvscope {kvscope_version()}")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    model = _add(sub, "model", "build the small local model that tests and the quickstart serve")
    msub = model.add_subparsers(dest="model_command", metavar="ACTION", title="actions")
    bt = _add(msub, "build-tiny", "write a tiny Llama-architecture model directory that vLLM serves",
              "Write a tiny Llama model (byte-level BPE tokenizer with 8,192 tokens trained offline, Llama-3 chat "
              "template, 4 layers, 4 query / 2 KV heads of head_dim 64, ≈7 M parameters, bf16 safetensors).\n"
              "The same --seed gives byte-identical files.")
    bt.add_argument("--out", required=True, metavar="DIR", help="output directory (replaced if it exists)")
    bt.add_argument("--seed", type=int, default=0, help="seed for corpus, tokenizer and weights (default 0)")
    bt.add_argument("--tokenizer", choices=("trained", "tekken", "tekken-240718"), default="trained",
                    help="trained: byte-level BPE (8,192 tokens) trained on generated text (default); tekken: "
                         "Mistral's production Tekken tokenizer (131,072 tokens, from mistral_common, installed "
                         "with vLLM), so real transcripts get realistic token counts; same KV bytes per token")
    bt.add_argument("--size", choices=("small", "large"), default="small",
                    help="small: the shape above (default); large: 8 layers of width 512, 8 query / 4 KV heads "
                         "(≈30 M parameters, 4x the KV bytes per token) on the same tokenizer as a small model "
                         "of the same --seed, for model routing (docs/model-routing.md)")
    bt.add_argument("--train-steps", type=int, default=0, metavar="N",
                    help="AdamW steps on generated agent-like text (~0.9 s each on one core); 0 keeps random "
                         "weights, which make n-gram speculation look ~100%% accepted (default 0)")
    bt.set_defaults(func=_cmd_build_tiny)

    serve = _add(sub, "serve", "run a vLLM server from a config file in the foreground until Ctrl-C")
    serve.add_argument("--config", required=True, metavar="FILE",
                       help="server config YAML (`backend: vllm`, the default; see docs/backends.md)")
    serve.add_argument("--port", type=int, help="override the config's port")
    serve.add_argument("--log", metavar="FILE", help="write the server log here (default: a temp file)")
    serve.set_defaults(func=_cmd_serve)

    info = _add(sub, "server-info", "print the facts of a running server (block size, KV capacity, …)",
                "vllm backend: read vLLM's version, block size, KV blocks and capacity, prefix caching and "
                "speculative decoding from /version, /v1/models and /metrics. openai backend: only what "
                "/v1/models says; every other fact is unknown (null).")
    info.add_argument("--endpoint", required=True, metavar="URL", help="base URL, e.g. http://127.0.0.1:8000")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--log", metavar="FILE", help="the server's log, for facts only the log has")
    info.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    info.add_argument("--backend", default="vllm", choices=LazyChoices(_backend_names),
                      help="serving backend of the endpoint (default vllm)")
    info.set_defaults(func=_cmd_server_info)

    demo = _add(sub, "demo", "smoke check: a 6-turn conversation through vLLM with prefix caching (~30 s)",
                "Build the tiny model if needed, start vLLM on CPU/GPU with prefix caching, send one 6-turn "
                "append-only conversation as token-id prompts and print prompt tokens, cached tokens and TTFT "
                "per turn; then stop the server.")
    demo.add_argument("--model-dir", default="models/tiny", metavar="DIR", help="model directory (default models/tiny)")
    demo.add_argument("--out", default="results/demo", metavar="DIR", help="where to keep the log and table")
    demo.add_argument("--turns", type=int, default=6, help="number of turns (default 6)")
    demo.set_defaults(func=_cmd_demo)

    for module_name in PLUGIN_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # that stage is not installed in this build
            raise
        module.add_subcommands(sub)
    return parser




def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        # A group without an action prints that group's help.
        target = parser
        if args.command:
            target = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
        target.print_help()
        return 2 if args.command else 0
    from kvscope.harness.results.records import RecordsError  # deferred: keeps `kvscope --help` fast

    handle_termination_like_sigint()
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("kvscope: interrupted", file=sys.stderr)
        return exit_code_for_interrupt()
    except BrokenPipeError:  # output piped into `head` and friends: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (KvscopeError, WorkloadError, RecordsError, OSError, ValueError, MemoryError) as exc:
        if getattr(args, "debug", False):
            raise
        own = isinstance(exc, (KvscopeError, WorkloadError, RecordsError))
        print(f"kvscope: error: {exc if own else describe_input_error(exc)}", file=sys.stderr)
        return 2


def describe_input_error(exc: BaseException) -> str:
    """One line for an error that reached the CLI edge. kvscope's own errors already name file, field and what
    is allowed; OSError, UnicodeDecodeError, ValueError and MemoryError reaching here mean bad input (a path
    that is a directory or an existing file, binary garbage, a size that does not fit), so they are worded
    from their attributes instead of shown as a traceback (``kvscope --debug`` shows it)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"input is not UTF-8 text (byte {exc.start}: {exc.reason}); expected a YAML/JSON text file"
    if isinstance(exc, MemoryError):
        return "out of memory: the input or a size option is too large for this machine"
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror}"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

if __name__ == "__main__":
    sys.exit(main())
