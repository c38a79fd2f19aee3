"""``kvscope speculate``: predicted speculative decoding per method from a trace's or a run's tokens (no GPU),
registered by ``kvscope.harness.cli.main``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvscope.harness.cli import argtypes
from kvscope.harness.cli.common import add_parser
from kvscope.harness.common.errors import ConfigError, KvscopeError
from kvscope.harness.common.numbers import nan_to_none


def _windows(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: a lookup window is MIN-MAX (e.g. 2-4) or N") from None
        if not 1 <= a <= b:
            raise argparse.ArgumentTypeError(f"{part!r}: need 1 <= MIN <= MAX")
        out.append((a, b))
    return out


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of positive integers") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of positive integers")
    return vals


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = add_parser(
        subparsers, "speculate", "predict speculative-decoding acceptance per method from the tokens (no GPU)",
        "With greedy decoding a proposer's drafts and the accepted prefix are a function of the tokens, so\n"
        "acceptance is computed offline, per request and decode step, for methods that were not run live:\n"
        "  ngram   vLLM's n-gram proposer, exactly (prompt_lookup_min/max, num_speculative_tokens)\n"
        "  suffix  SuffixDecoding (arXiv 2411.04975) as vLLM runs it via Arctic Inference: a per-request tree\n"
        "          over the prompt and a global tree over earlier answers, adaptive draft length\n"
        "  oracle  the upper bound: k drafts, always right\n"
        "TRACE: a trace directory (its recorded outputs); RUN: a replay run directory (the tokens its server\n"
        "generated). With --calibration, TPOT and output throughput are predicted from the step costs.\n\n"
        "example:\n"
        "  kvscope speculate traces/agent --method ngram,suffix,oracle --k 4 --lookup 2-4,1-3")
    p.add_argument("path", metavar="TRACE|RUN")
    p.add_argument("--method", default="ngram,suffix,oracle",
                   help="comma list of ngram, suffix, oracle (default all three)")
    p.add_argument("--k", type=_ints, default=[_DEFAULT_K], metavar="K[,K...]",
                   help="num_speculative_tokens of ngram and oracle, a comma list (default 4)")
    p.add_argument("--lookup", type=_windows, default=[(2, 4), (1, 3)], metavar="MIN-MAX[,...]",
                   help="n-gram prompt_lookup_min-prompt_lookup_max windows (default 2-4,1-3)")
    p.add_argument("--suffix-depth", type=argtypes.positive_int, default=_DEFAULT_DEPTH,
                   help="suffix_decoding_max_tree_depth (default 24, vLLM's)")
    p.add_argument("--suffix-k", type=argtypes.positive_int, default=None,
                   help="suffix num_speculative_tokens (default: the tree depth, as vLLM)")
    p.add_argument("--suffix-min-prob", type=float, default=0.1,
                   help="suffix_decoding_min_token_prob (default 0.1)")
    p.add_argument("--suffix-spec-factor", type=argtypes.non_negative_float, default=1.0,
                   help="suffix_decoding_max_spec_factor: draft <= factor x match length (default 1.0)")
    p.add_argument("--max-model-len", type=argtypes.positive_int, default=None,
                   help="the server's max_model_len: drafts stop there (default: no limit)")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="a calibration.json (kvscope capacity --server …) for predicted TPOT and throughput")
    p.add_argument("--json", metavar="FILE", default=None, help="write the predictions (speculation.json format)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_speculate)


def _configs(a: argparse.Namespace) -> list:
    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.cachemodel.speculative import METHODS, NgramConfig, OracleConfig, SuffixConfig

    methods = [m.strip() for m in a.method.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ConfigError(f"--method: unknown {', '.join(bad) or '(none)'}; allowed: {', '.join(METHODS)}")
    if not 0.0 <= a.suffix_min_prob <= 1.0:
        raise ConfigError(f"--suffix-min-prob: {a.suffix_min_prob} is not in [0, 1]")
    out: list = []
    for m in methods:
        if m == "ngram":
            out += [NgramConfig(k, lo, hi) for k in a.k for lo, hi in a.lookup]
        elif m == "suffix":
            out.append(SuffixConfig(num_speculative_tokens=a.suffix_k or a.suffix_depth, max_tree_depth=a.suffix_depth,
                                    min_token_prob=a.suffix_min_prob, max_spec_factor=a.suffix_spec_factor))
        else:
            out += [OracleConfig(k) for k in a.k]
    return out


def _fmt(v, spec: str) -> str:
    if nan_to_none(v) is None:
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width) if width else 1)
    return format(v, spec)


#: The defaults of the size knobs: always accepted, however short the trace's outputs.
_DEFAULT_K, _DEFAULT_LOOKUP_MAX, _DEFAULT_DEPTH = 4, 4, 24


def _check_sizes(a: argparse.Namespace, trace) -> None:
    """Bound every size knob by what it can mean on this trace, before any work (``--suffix-depth
    1000000000`` on a 67-request trace grew to 20.6 GB: the model's per-request arrays are sized by the
    depth and the draft length). A draft longer than the longest recorded output is never checked in full,
    a match or an n-gram longer than the longest context never found; one line names the knob and its bound.
    A trace whose outputs have no decode step (one token or none) has nothing to predict."""
    from kvscope.harness.analysis.speculative import longest_sequence_tokens, recorded_output_lengths  # deferred: keeps kvscope --help fast
    from kvscope.harness.common.errors import ConfigError, KvscopeError  # deferred: keeps kvscope --help fast

    longest_output = int(recorded_output_lengths(trace).max(initial=0))
    if longest_output < 2:
        raise KvscopeError(f"{a.path}: nothing to predict: no request has a decode step to draft for (the longest "
                           f"recorded output is {longest_output} token(s)); give a trace or run with generated "
                           "outputs")
    longest_context = longest_sequence_tokens(trace)

    def bound(flag: str, value: int, default: int, limit: int, what: str) -> None:
        top = max(limit, default)
        if value > top:
            raise ConfigError(f"{flag} {value}: longer than {what} ({limit:,} tokens) in {a.path}, so it cannot "
                              f"change the prediction; give at most {top:,}")

    output_what = "the longest recorded output"
    for k in a.k:
        bound("--k", k, _DEFAULT_K, longest_output, output_what)
    if a.suffix_k is not None:
        bound("--suffix-k", a.suffix_k, _DEFAULT_DEPTH, longest_output, output_what)
    bound("--suffix-depth", a.suffix_depth, _DEFAULT_DEPTH, longest_context, "the longest request (prompt and output)")
    for _, hi in a.lookup:
        bound("--lookup", hi, _DEFAULT_LOOKUP_MAX, longest_context, "the longest request (prompt and output)")


def _cmd_speculate(a: argparse.Namespace) -> int:
    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.analysis.speculative import load_speculation_input, predict_methods

    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.results.speculation_file import write_speculation_file

    configs = _configs(a)
    if a.json and not Path(a.json).resolve().parent.is_dir():  # before the work, not after it
        raise KvscopeError(f"--json {a.json}: no such directory {Path(a.json).parent}")
    trace = load_speculation_input(a.path)
    if (trace.requests["output_segment_id"] < 0).all():
        raise KvscopeError(f"{a.path}: no request has recorded output tokens (the trace knows only output "
                           "lengths); replay it and give the run directory, whose records keep the generated tokens")
    _check_sizes(a, trace)
    res = predict_methods(trace, configs, source=a.path, max_model_len=a.max_model_len, calibration=a.calibration,
                          progress=not a.no_progress and sys.stderr.isatty())
    n_req = res.methods[0].requests if res.methods else 0
    skipped = res.methods[0].skipped_requests if res.methods else 0
    print(f"{a.path}: {n_req:,} requests with output tokens"
          + (f" ({skipped:,} without, skipped)" if skipped else ""))
    head = f"{'method':<28} {'accept':>7} {'mean len':>8} {'tok/step':>8} {'drafted':>8} {'by position':<28}"
    if a.calibration:
        head += f" {'TPOT ms':>8} {'speed-up':>8}"
    print(head + f" {'s':>6}")
    for m in res.methods:
        pos = " ".join(_fmt(x, ".2f") for x in m.acceptance_by_position[:6])
        line = (f"{m.label:<28} {_fmt(m.acceptance_rate, '7.1%')} {_fmt(m.mean_acceptance_length, '8.2f')} "
                f"{_fmt(m.tokens_per_step, '8.2f')} {_fmt(m.draft_share_of_steps, '8.0%')} {pos:<28}")
        if a.calibration:
            sp = (res.baseline_tpot_ms_mean / m.predicted_tpot_ms_mean
                  if res.baseline_tpot_ms_mean and m.predicted_tpot_ms_mean else None)
            line += f" {_fmt(m.predicted_tpot_ms_mean, '8.2f')} {_fmt(sp, '7.2f')}x"
        print(line + f" {m.seconds:6.1f}")
    if a.calibration and res.baseline_tpot_ms_mean:
        print(f"without speculation: TPOT {res.baseline_tpot_ms_mean:.2f} ms (the same calibration)")
    print("accept: accepted / drafted tokens; mean len: 1 + accepted per draft (vLLM's); tok/step: decode tokens "
          "per decode step; drafted: share of steps with a draft")
    if a.json:
        write_speculation_file(a.json, res)
        print(f"wrote {a.json}")
    return 0
