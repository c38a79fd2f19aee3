"""``kvscope predict``: a trace's serving on a named GPU and model, from the hardware and the model's
config.json (no GPU needed): per-request TTFT/TPOT/ITL/E2E and cached tokens, the load curve, eviction cliff,
SLO capacity and cost; registered by ``kvscope.harness.cli.main``."""

from __future__ import annotations

import argparse

from kvscope.harness.cli import argtypes
from kvscope.harness.cli.common import add_parser


def _levels(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers (e.g. 1,2,4,8)") from None
    if not out or any(x <= 0 for x in out) or out != sorted(set(out)):
        raise argparse.ArgumentTypeError(f"{text!r}: give increasing positive numbers, e.g. 1,2,4,8")
    return out


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1]") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"got {text}; allowed: a share in (0, 1]")
    return v


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = add_parser(
        subparsers, "predict", "predict TTFT, TPOT, capacity and cost of a trace on a named GPU and model",
        "Run TRACE through the step-level model of vLLM's scheduler (continuous batching, max_num_seqs, chunked\n"
        "prefill, preemption, prefix caching in the GPU's KV pool) with step times from first principles: the\n"
        "GPU's datasheet (gpus.yaml) and the model's config.json (bundled or a local file), or from a CPU\n"
        "calibration (--calibration). Every figure is predicted; the factors used are in the output file.\n\n"
        "examples:\n"
        "  kvscope predict traces/agent --gpu h100-sxm --model llama-3.1-8b --concurrency 8\n"
        "  kvscope predict traces/agent --gpu h200-sxm --model llama-3.1-70b --tp 4 --kv-cache-dtype fp8\n"
        "  kvscope predict traces/agent --gpu h100 --model path/to/config.json --speculative ngram:k=4,min=2,max=4")
    p.add_argument("trace", metavar="TRACE", nargs="?", help="a kvscope trace directory (or any trace `simulate` reads)")
    p.add_argument("--gpu", default=None, help="GPU preset id (see --list); required unless --calibration")
    p.add_argument("--model", default=None,
                   help="bundled model name (see --list) or a config.json path; required unless --calibration")
    p.add_argument("--list", action="store_true", help="list the GPU presets and bundled models, then exit")
    p.add_argument("--tp", type=argtypes.positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--max-num-seqs", type=argtypes.positive_int, default=None, help="default 256")
    p.add_argument("--max-num-batched-tokens", type=argtypes.positive_int, default=None, help="default 8192")
    p.add_argument("--block-size", type=argtypes.block_size, default=None, help="default 16 (CUDA)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.92, help="default 0.92")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), fp8, bfloat16, ...")
    p.add_argument("--weight-dtype", default=None,
                   help="weights' dtype (default: the config's); fp8 for an fp8 checkpoint (fp8 tensor cores)")
    p.add_argument("--num-gpu-blocks", type=argtypes.num_gpu_blocks, default=None,
                   help="KV pool size in blocks instead of the memory arithmetic (vLLM's override)")
    p.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    eff = p.add_argument_group("step model (defaults: the GPU's in gpus.yaml)")
    eff.add_argument("--mfu", type=_fraction, default=None, help="achieved share of the dense peak FLOPs")
    eff.add_argument("--bandwidth-efficiency", type=_fraction, default=None,
                     help="achieved share of the memory bandwidth")
    eff.add_argument("--step-overhead-ms", type=argtypes.non_negative_float, default=None,
                     help="engine time per step no GPU work hides")
    eff.add_argument("--request-overhead-ms", type=argtypes.non_negative_float, default=None,
                     help="frontend time per request (HTTP, tokenization)")
    eff.add_argument("--calibration", metavar="FILE", default=None,
                     help="step costs from a calibration.json (kvscope capacity --server ...) instead of the "
                     "roofline: the CPU path; its server's block size and pool unless overridden")
    p.add_argument("--speculative", default=None, metavar="SPEC",
                   help="ngram[:k=4,min=2,max=4] | suffix[:depth=24] | oracle[:k=4] | "
                   "draft:k=4,acceptance=0.7[,draft_model=NAME] (acceptance from the tokens, except draft)")
    p.add_argument("--max-model-len", type=argtypes.positive_int, default=None,
                   help="drafts stop there (speculation), and longer requests are refused")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=argtypes.positive_int, default=None,
                      help="closed loop of N sessions for the per-request prediction; default: the trace's own "
                      "arrival times (open loop)")
    load.add_argument("--levels", type=_levels, default=None,
                      help="load curve: concurrency levels (closed loop, default 1,2,4,...,256 up to the "
                      "sessions) or, open loop, multiples of the trace's request rate (default 0.25,0.5,1,2,4); "
                      "the default levels stop past the SLO capacity and the eviction cliff")
    load.add_argument("--time-scale", type=argtypes.non_negative_float, default=1.0,
                      help="multiplies think times and tool latencies, as in replay (default 1)")
    load.add_argument("--mode", choices=["recorded", "live"], default="live",
                      help="live (default: prompts carry the model's own output, which the trace's output "
                      "tokens stand for) or recorded (output blocks never hit), as in replay")
    slo = p.add_argument_group("SLO and cost")
    slo.add_argument("--slo-ttft-ms", type=argtypes.positive_float, default=2000.0, help="default 2000")
    slo.add_argument("--slo-tpot-ms", type=argtypes.positive_float, default=100.0, help="default 100")
    slo.add_argument("--cliff-drop-pp", type=argtypes.positive_float, default=5.0,
                     help="hit-rate drop (points below the lowest load) that marks the eviction cliff")
    slo.add_argument("--gpu-hour-usd", type=argtypes.positive_float, default=None,
                     help="price per GPU-hour (default: the GPU's first preset in pricing/gpu_prices.yaml)")
    slo.add_argument("--provider", default=None, help="which provider's GPU-hour price preset to use")
    p.add_argument("--jobs", type=argtypes.positive_int, default=1,
                   help="load levels simulated in parallel processes (default 1)")
    p.add_argument("--out", metavar="FILE", default=None, help="write the prediction (prediction.json format)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_predict)


def _list() -> int:
    from kvscope.harness.cachemodel.gpus import load_gpus  # deferred: keeps kvscope --help fast
    from kvscope.harness.cachemodel.model_config import bundled_models, load_model_config  # deferred: keeps kvscope --help fast

    print(f"{'GPU':<15} {'memory':>7} {'HBM TB/s':>8} {'bf16 TF':>8} {'fp8 TF':>7} {'link GB/s':>9}  source")
    for g in load_gpus():
        print(f"{g.key:<15} {g.memory_gib:>5g}GB {(g.bandwidth_gb_s or 0) / 1e3:>8.2f} {g.bf16_tflops or 0:>8.0f} "
              f"{g.fp8_tflops or 0:>7.0f} {g.interconnect_gb_s or 0:>9.0f}  {g.source or ''}")
    print(f"\n{'model':<16} {'params':>8} {'active':>8} {'layers':>6} {'heads':>5} {'kv':>3} {'hd':>4} {'vocab':>7}")
    for name in bundled_models():
        m = load_model_config(name)
        print(f"{name:<16} {m.params_total / 1e9:>7.2f}B {m.params_active / 1e9:>7.2f}B {m.num_layers:>6} "
              f"{m.num_attention_heads:>5} {m.num_kv_heads:>3} {m.head_dim:>4} {m.vocab_size:>7}")
    return 0


def _cmd_predict(a: argparse.Namespace) -> int:
    from dataclasses import fields  # deferred: keeps kvscope --help fast

    from kvscope.harness.common.errors import ConfigError  # deferred: keeps kvscope --help fast
    from kvscope.harness.results.gpu_prediction import PredictOptions, predict_trace  # deferred: keeps kvscope --help fast
    from kvscope.harness.results.prediction_file import write_prediction_file  # deferred: keeps kvscope --help fast

    if a.list:
        return _list()
    if a.trace is None:
        raise ConfigError("predict: give a TRACE (or --list)")
    # Every option but the two the command sets itself is a flag of the same name.
    opts = PredictOptions(**{f.name: getattr(a, f.name) for f in fields(PredictOptions)
                             if f.name not in ("progress", "summary_at_slo_capacity")},
                          progress=not a.no_progress)
    try:
        done = predict_trace(opts)
    except ConfigError:
        raise
    except ValueError as exc:  # unknown GPU/model, bad config.json, TP, does not fit: one line, exit 2
        raise ConfigError(str(exc)) from None
    _print(done.prediction, done.spec_summary, done.load_s)
    if a.out:
        write_prediction_file(a.out, done.prediction)
        print(f"wrote {a.out}")
    return 0


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}ms"


def _print(p, spec_summary: dict | None, load_s: float) -> None:
    d, r, s = p.deployment, p.run, p.step_model
    print(f"PREDICTED {d.model} on {d.tp} x {d.gpu} ({d.gpu_name}): weights {d.weight_gib_per_gpu:.1f} GiB/GPU, "
          f"KV {d.kv_bytes_per_token_per_gpu / 1024:.0f} KiB/token/GPU ({d.kv_cache_dtype}), pool "
          f"{d.num_gpu_blocks:,} blocks x {d.block_size} = {d.kv_cache_tokens:,} tokens; max_num_seqs "
          f"{d.max_num_seqs}, max_num_batched_tokens {d.max_num_batched_tokens}")
    if s.kind == "roofline":
        print(f"step model: roofline, mfu {s.mfu:g}, bandwidth efficiency {s.bandwidth_efficiency:g}, step overhead "
              f"{s.step_overhead_ms:g} ms, request overhead {s.request_overhead_ms:g} ms ({s.source})")
    else:
        print(f"step model: calibration {s.source}")
    if spec_summary:
        print("speculative: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in spec_summary.items()))
    load = f"concurrency {r.concurrency}" if r.concurrency else "the trace's arrival times"
    print(f"at {load}: {r.requests:,} requests, hit rate {r.token_hit_rate:.1%}, TTFT mean {_ms(r.ttft_mean_s)} "
          f"p90 {_ms(r.ttft_p90_s)}, TPOT mean {_ms(r.tpot_mean_s)}, ITL mean {_ms(r.itl_mean_s)}, E2E mean "
          f"{(r.e2e_mean_s or 0):.2f}s; {r.output_tokens_per_s:,.0f} output tok/s, goodput {r.goodput_share:.1%} "
          f"({r.goodput_requests_per_s:.3g} req/s), preemptions {r.preemptions}, KV max {r.kv_usage_max:.0%}")
    unit = "conc" if p.load_kind == "concurrency" else "rate x"
    print(f"{unit:>7} {'hit':>6} {'ttft p50':>9} {'ttft p90':>9} {'tpot p50':>9} {'out tok/s':>10} {'good':>5} "
          f"{'preempt':>7} {'kv max':>6} {'slo':>3} {'cpu s':>6}")
    for pt in p.load_curve:
        print(f"{pt.load:>7g} {pt.token_hit_rate:>6.1%} {_ms(pt.ttft_p50_s):>9} {_ms(pt.ttft_p90_s):>9} "
              f"{_ms(pt.tpot_p50_s):>9} {pt.output_tokens_per_s:>10,.0f} {pt.goodput_share:>5.0%} {pt.preemptions:>7} "
              f"{pt.kv_usage_max:>6.0%} {'yes' if pt.meets_slo else 'no':>3} {pt.simulate_s:>6.1f}")
    print(f"eviction cliff (hit rate > {p.cliff_drop_pp:g} pp below the lowest load): "
          + (f"at {p.eviction_cliff_load:g}" if p.eviction_cliff_load is not None else "none within the loads"))
    print(f"SLO capacity (TTFT p90 <= {p.slo.ttft_ms:g} ms, TPOT p50 <= {p.slo.tpot_ms:g} ms, no preemption): "
          + (f"{p.slo_capacity_load:g}" if p.slo_capacity_load is not None else "below the lowest load"))
    c = p.cost
    if c is not None:
        def usd(v):
            return "-" if v is None else f"${v:,.3f}"
        print(f"cost at ${c.usd_per_gpu_hour:g}/GPU-hour x {c.num_gpus} ({c.price_source}): {c.gpu_hours:,.1f} GPU-hours, "
              f"{usd(c.total_usd)}; per 1M input tokens {usd(c.usd_per_mtok_input)}, per 1M output tokens "
              f"{usd(c.usd_per_mtok_output)} (input share of GPU time {c.input_time_share:.0%}), per 1,000 sessions "
              f"{usd(c.usd_per_1000_sessions)}")
        print(f"  GPU busy {c.utilization:.1%} of the time; charging the busy time only (idle filled by other "
              f"traffic): per 1M input {usd(c.busy_usd_per_mtok_input)}, per 1M output "
              f"{usd(c.busy_usd_per_mtok_output)}, per 1,000 sessions {usd(c.busy_usd_per_1000_sessions)}")
    print(f"predicted in {p.predict_s:.1f} s (trace read in {load_s:.1f} s)")
