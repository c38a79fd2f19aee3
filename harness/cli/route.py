"""``kvscope route``: model routing and cascades offline, registered by ``kvscope.harness.cli.main``.

Imports are lazy so that ``kvscope --help`` starts fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvscope.harness.cli import argtypes
from kvscope.harness.cli.common import add_parser
from kvscope.harness.common.errors import ConfigError, load_yaml_mapping

EXAMPLES = """\
examples:
  kvscope route traces/agent --policy all-large
  kvscope route traces/agent --policy rule --rule-input-kind tool_output --rule-min-prompt-tokens 50000 \\
      --stickiness sticky-after-escalation --json route.json
  kvscope route traces/agent --policy cascade --cascade-max-output-tokens 400 --small-model-blocks 20000
  kvscope route traces/agent --policy cascade --cascade-label passed --labels evals.csv
  kvscope route traces/agent --policy recorded --labels decisions.csv   (columns request_id, model[, escalated])
  kvscope route traces/agent --sweep --thresholds 0,20000,50000,100000
  kvscope route traces/agent --spec routing.yaml     (models, policy, stickiness; flags override it)
  kvscope route traces/agent --policy cascade --cascade-max-output-tokens 400 --concurrency 4 \
      --calibration calibration.json --large-time-factor 3 --small-gpu-hourly-usd 1 --large-gpu-hourly-usd 4
"""


def _ints(s: str) -> list[int]:
    try:
        return [int(float(x)) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma list of integers") from None


def _kinds(s: str) -> list[str]:
    from kvscope.harness.cachemodel.model_routing import INPUT_KINDS  # deferred: keeps `kvscope --help` fast

    kinds = [x.strip() for x in s.split(",") if x.strip()]
    bad = [k for k in kinds if k not in INPUT_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"got {s!r}; allowed: a comma list of {', '.join(INPUT_KINDS)}")
    return kinds


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = add_parser(
        subparsers, "route", "model routing offline: which model serves each request, and what it costs the caches",
        "Route a trace's requests between a small and a large model (or the N models of --spec) with a policy — "
        "all-small, all-large, rule, cascade — and predict per request the model, the reason, escalations (a "
        "cascade's small attempt is a real request on the small model's cache, then the prompt is re-sent to the "
        "large model), cached tokens with one exact prefix-cache pool per model, and history recomputed because "
        "the previous step ran on another model (model_switch); per policy: hit rate per model, escalation "
        "rate, $ per 1,000 sessions under each model's price preset, and what the other stickiness would "
        "change. --sweep ranks a grid of rule variants.\n\n" + EXAMPLES,
    )
    p.add_argument("trace", metavar="TRACE", help="a kvscope trace directory")
    p.add_argument("--spec", metavar="FILE", help="routing spec YAML/JSON: models, policy, stickiness")
    p.add_argument("--policy", choices=("all-small", "all-large", "rule", "cascade", "recorded"), default=None,
                   help="routing policy (default: the spec's, else all-small)")
    p.add_argument("--stickiness", choices=("per-step", "sticky-after-escalation"), default=None,
                   help="per-step: every step decided alone (default); sticky-after-escalation: a session "
                        "served once by the large model stays there")
    for which in ("small", "large"):
        p.add_argument(f"--{which}-model-blocks", type=argtypes.num_gpu_blocks, default=None, metavar="N",
                       help=f"the {which} model's num_gpu_blocks (default: unbounded)")
        p.add_argument(f"--{which}-block-size", type=argtypes.block_size, default=None, metavar="TOKENS",
                       help=f"the {which} model's KV block size (default 16)")
        p.add_argument(f"--{which}-pricing", default=None, metavar="PRESET",
                       help=f"the {which} model's price preset or YAML (default: "
                            + ("gemini-2.5-flash-implicit)" if which == "small" else "anthropic-sonnet-5m)"))
    p.add_argument("--rule-input-kind", type=_kinds, default=None, metavar="KINDS",
                   help="rule: send to the large model when the step adds one of these (task,user,tool_output)")
    p.add_argument("--rule-min-prompt-tokens", type=int, default=None, metavar="N",
                   help="rule: ... and the prompt has at least N tokens")
    p.add_argument("--rule-min-step", type=int, default=None, metavar="N", help="rule: ... and step >= N")
    p.add_argument("--cascade-max-output-tokens", type=int, default=None, metavar="N",
                   help="cascade: escalate when the small answer is longer than N tokens")
    p.add_argument("--cascade-label", default=None, metavar="COLUMN",
                   help="cascade: escalate when this per-request label (trace or --labels column) is false/fail")
    p.add_argument("--cascade-min-logprob", type=float, default=None, metavar="X",
                   help="cascade: escalate when the column mean_logprob (from a recorded run, via --labels) "
                        "is below X (<= 0)")
    p.add_argument("--recorded-model-column", default="model", metavar="COLUMN",
                   help="recorded: the column naming each request's serving model (default model)")
    p.add_argument("--recorded-escalated-column", default=None, metavar="COLUMN",
                   help="recorded: a true/false column marking escalations from the first model")
    p.add_argument("--labels", metavar="FILE", default=None,
                   help="per-request signals: CSV / JSONL / Parquet with request_id and one column per signal")
    p.add_argument("--exact", action="store_true",
                   help="always run the pool simulator (default: the pairwise-prefix fast path when every pool "
                        "is unbounded; the two agree exactly)")
    p.add_argument("--per-request", metavar="FILE", default=None, help="write one JSON line per request")
    p.add_argument("--json", metavar="FILE", default=None, help="write the summary (or the sweep's table) as JSON")
    p.add_argument("--sweep", action="store_true",
                   help="evaluate a grid of rule variants (thresholds x input-kind sets x stickiness) and print "
                        "them ranked by $ per 1,000 sessions")
    p.add_argument("--thresholds", type=_ints, default=None, metavar="N,N,...",
                   help="--sweep: prompt-length thresholds (default: 0 and the trace's prompt-length deciles)")
    p.add_argument("--top", type=argtypes.positive_int, default=20, metavar="K", help="--sweep: rows to print")
    p.add_argument("--pareto", action="store_true",
                   help="--sweep: print only the outcomes that send more to the large model than every cheaper one")
    p.add_argument("--concurrency", type=argtypes.positive_int, default=None, metavar="N",
                   help="predict under concurrency: N sessions at once (closed loop, no think time), each model a "
                        "scheduler model of its own (needs --calibration): cached tokens per model's scheduler, "
                        "TTFT / e2e percentiles with escalation round trips, each server's busy time")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="with --concurrency: a calibration.json of the small model's server (its step costs and "
                        "scheduler settings; `kvscope capacity --server` writes one)")
    p.add_argument("--large-time-factor", type=argtypes.positive_float, default=3.0, metavar="F",
                   help="with --concurrency: the other models' step costs are the calibration's times F (default 3)")
    for which in ("small", "large"):
        p.add_argument(f"--{which}-gpu-hourly-usd", type=argtypes.non_negative_float, default=None, metavar="USD",
                       help=f"with --concurrency: $ per GPU-hour of the {which} model's server, for the self-hosted "
                            "cost of each policy (its server's busy time)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_route)


def _spec_dict(a: argparse.Namespace) -> dict:
    base: dict = dict(load_yaml_mapping(a.spec, "routing spec")) if a.spec else {}
    models = [dict(m) if isinstance(m, dict) else m for m in base.get("models", [{"name": "small"}, {"name": "large"}])]
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
        raise ConfigError(f"{a.spec}: models: a list of model mappings")
    for which, m in (("small", models[0]), ("large", models[-1])):
        for flag, key in (("model_blocks", "num_gpu_blocks"), ("block_size", "block_size"), ("pricing", "pricing")):
            v = getattr(a, f"{which}_{flag}")
            if v is not None:
                m[key] = v
    base["models"] = models
    if a.stickiness:
        base["stickiness"] = a.stickiness
    kind = a.policy or (None if "policy" in base else "all-small")
    for prefix, flags in (("rule", ("rule_input_kind", "rule_min_prompt_tokens", "rule_min_step")),
                          ("cascade", ("cascade_max_output_tokens", "cascade_label", "cascade_min_logprob"))):
        given = [f for f in flags if getattr(a, f) is not None]
        if given and kind != prefix:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --policy {prefix}")
    if kind == "rule":
        rule: dict = {"model": models[-1].get("name", "large")}
        if a.rule_input_kind:
            rule["input_kind"] = a.rule_input_kind
        if a.rule_min_prompt_tokens is not None:
            rule["min_prompt_tokens"] = a.rule_min_prompt_tokens
        if a.rule_min_step is not None:
            rule["min_step"] = a.rule_min_step
        base["policy"] = {"kind": "rule", "rules": [rule]}
    elif kind == "cascade":
        pol: dict = {"kind": "cascade"}
        if a.cascade_max_output_tokens is not None:
            pol["max_output_tokens"] = a.cascade_max_output_tokens
        if a.cascade_label is not None:
            pol["label_column"] = a.cascade_label
        if a.cascade_min_logprob is not None:
            pol["min_mean_logprob"] = a.cascade_min_logprob
        base["policy"] = pol
    elif kind == "recorded":
        base["policy"] = {"kind": "recorded", "model_column": a.recorded_model_column,
                          "escalated_column": a.recorded_escalated_column}
    elif kind is not None:
        base["policy"] = {"kind": kind}
    return base


def _progress(enabled: bool, total: int, desc: str):
    from tqdm import tqdm  # deferred: tqdm is heavy, only a progress bar needs it

    return tqdm(total=total, desc=desc, unit="variant", disable=not enabled, file=sys.stderr, leave=False)


def _cmd_route(a: argparse.Namespace) -> int:
    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.cachemodel.model_routing import load_routing_inputs, load_spec

    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.pricing.model_routing import (
        evaluate_policy,
        model_prices,
        rule_grid,
        stickiness_counterfactual,
        sweep,
    )

    show = not a.no_progress and sys.stderr.isatty()
    _check_timed_flags(a)
    base = _spec_dict(a)
    spec = load_spec(base, a.spec or "route flags")
    try:
        model_prices(spec)  # a bad preset fails before the trace is read
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    t0 = time.perf_counter()
    note = (lambda msg: print(f"  {msg} …", file=sys.stderr, flush=True)) if show else None
    inputs = load_routing_inputs(a.trace, [m.block_size for m in spec.models], a.labels, progress=note)
    t_load = time.perf_counter() - t0
    if a.sweep:
        import numpy as np  # deferred: numpy is heavy, importing this module must not load it

        thresholds = a.thresholds
        if thresholds is None:
            lengths = np.array([f.prompt_tokens for f in inputs.facts])
            thresholds = sorted({0, *(int(x) for x in np.percentile(lengths, range(10, 100, 10)))})
        base_models = {"models": [m.model_dump() for m in spec.models]}
        variants = rule_grid(spec.model_names, thresholds)
        t1 = time.perf_counter()
        with _progress(show, len(variants), "rule variants") as bar:
            rows = sweep(base_models, variants, inputs, progress=bar.update)
        t_eval = time.perf_counter() - t1
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"trace": str(a.trace), "variants": len(variants), "outcomes": len(rows), "read_s": t_load, "evaluate_s": t_eval,
                           "rows": rows}, f, indent=2, default=str)
        print(f"{len(variants)} rule variants ({len(rows)} distinct outcomes) on {len(inputs.facts)} requests: read "
              f"{t_load:.1f} s, evaluated in {t_eval:.1f} s; ranked by $ per 1,000 sessions. Quality is not "
              "modelled: 'large' is the share of requests on the large model, * marks outcomes that send more to "
              "it than every cheaper one")
        shown = [r for r in rows if r["pareto"]] if a.pareto else rows
        print(f"{'#':>3} {'$/1k sessions':>13} {'hit':>6} {'large':>6} {'switch Mtok':>11}  variant")
        for i, r in enumerate(shown[:a.top], 1):
            same = f" (+{r['equivalent']} equivalent)" if r["equivalent"] else ""
            print(f"{i:>3} {r['usd_per_1k_sessions']:>13,.2f} {r['token_hit_ratio']:>6.3f} {r['large_share']:>6.2f} "
                  f"{r['model_switch_tokens'] / 1e6:>11.2f} {'*' if r['pareto'] else ' '}{r['variant']} "
                  f"[{r['stickiness']}]{same}")
        return 0
    fast = False if a.exact else None
    if a.concurrency is not None:
        timed = _timed(a, spec, inputs)
        ev = timed(spec)
        alt, alt_ev = stickiness_counterfactual(spec, inputs, ev, timed=timed)
    else:
        with _progress(show, 2 * len(inputs.facts), "requests") as bar:
            bar.unit = "request"
            ev = evaluate_policy(spec, inputs, fast=fast, progress=bar.update)
            alt, alt_ev = stickiness_counterfactual(spec, inputs, ev, fast=fast, progress=bar.update)
    out = {"trace": str(a.trace), **ev.summary(), "other_stickiness": alt, "read_s": t_load,
           "evaluate_s": time.perf_counter() - t0 - t_load}
    if a.per_request:
        with open(a.per_request, "w") as f:
            for r, o in zip(ev.routed, alt_ev.routed):  # + what the other stickiness would have done
                f.write(json.dumps({**r.as_dict(), "other_stickiness_model": o.model,
                                    "other_stickiness_cached_tokens": o.cached_tokens}) + "\n")
        out["per_request_file"] = a.per_request
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    _print_summary(out)
    return 0


def _check_timed_flags(a: argparse.Namespace) -> None:
    """The concurrency flags go together, and not with --sweep (one line, exit 2)."""
    if a.concurrency is not None and a.calibration is None:
        raise ConfigError("--concurrency needs --calibration FILE (the small model's server step costs)")
    if a.calibration is not None and a.concurrency is None:
        raise ConfigError("--calibration is read with --concurrency N only")
    if a.concurrency is not None and a.sweep:
        raise ConfigError("--sweep ranks variants with the sequential model; drop --concurrency (replay the best)")
    hourly = [f for f in ("small_gpu_hourly_usd", "large_gpu_hourly_usd") if getattr(a, f) is not None]
    if hourly and a.concurrency is None:
        raise ConfigError(f"--{hourly[0].replace('_', '-')} needs --concurrency and --calibration (the servers' busy "
                          "time)")
    if len(hourly) == 1:
        raise ConfigError("give both --small-gpu-hourly-usd and --large-gpu-hourly-usd")


def _timed(a: argparse.Namespace, spec, inputs):
    """The evaluation under concurrency for a spec (this one, or its other stickiness) on the trace read once."""
    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.pricing.model_routing import evaluate_policy_timed
    from kvscope.harness.results.loaders import load_calibration

    cal = load_calibration(a.calibration)
    hourly = None
    if a.small_gpu_hourly_usd is not None:
        names = spec.model_names
        hourly = {m: (a.small_gpu_hourly_usd if i == 0 else a.large_gpu_hourly_usd) for i, m in enumerate(names)}
    cost, config = cal.cost_model(), cal.scheduler_config()

    def run(s):
        return evaluate_policy_timed(s, inputs, cost, config, a.concurrency, large_time_factor=a.large_time_factor,
                                     gpu_hourly_usd=hourly)
    return run


def _print_summary(d: dict) -> None:
    from kvscope.harness.cachemodel.model_routing import load_spec  # deferred: keeps `kvscope --help` fast
    from kvscope.harness.pricing.model_routing import describe  # deferred: keeps `kvscope --help` fast

    spec = load_spec({"models": [{"name": m} for m in d["per_model"]], "policy": d["policy"]})
    print(f"policy {describe(spec)} [{d['stickiness']}] on {d['requests']} requests / {d['sessions']} sessions")
    print(f"  $ per 1,000 sessions     {d['usd_per_1k_sessions']:,.2f}  (wasted small attempts "
          f"{d['wasted_attempts_usd']:,.4f} $ in all)")
    print(f"  token hit ratio          {d['token_hit_ratio']:.4f}  over {d['prompt_tokens_sent']:,} prompt tokens sent")
    print(f"  escalations              {d['escalations']} ({d['escalation_rate']:.1%}); wasted prefill "
          f"{d['wasted_prefill_tokens']:,} + output {d['wasted_output_tokens']:,} tokens")
    print(f"  model_switch             {d['model_switch_tokens']:,} tokens recomputed on {d['requests_after_switch']} "
          "requests (previous step on another model)")
    for m, s in d["per_model"].items():
        print(f"  {m:<10} {s['requests']:>6} served, {s['attempts']:>6} attempts, hit ratio {s['token_hit_ratio']:.4f}, "
              f"{s['total_usd']:,.2f} $ ({s['preset']})")
    lat = d.get("latency")
    if lat is not None:
        esc = lat["escalated_ttft_p50_s"]
        print(f"  at concurrency {lat['concurrency']} (large model {lat['large_time_factor']:g}x the calibration's "
              f"step times): TTFT p50 {lat['ttft_p50_s'] * 1e3:,.0f} ms, p90 {lat['ttft_p90_s'] * 1e3:,.0f} ms; e2e "
              f"p50 {lat['e2e_p50_s']:,.2f} s, p90 {lat['e2e_p90_s']:,.2f} s"
              + (f"; escalated requests' TTFT p50 {esc * 1e3:,.0f} ms" if esc is not None else ""))
        for m, s in lat["servers"].items():
            print(f"  {m:<10} server: {s['busy_s']:,.1f} s busy, {s['steps']:,} steps, {s['preemptions']} preemptions")
    sh = d.get("self_hosted")
    if sh is not None:
        per = ", ".join(f"{m} {h:,.4f} GPU-h" for m, h in sh["gpu_hours"].items())
        print(f"  self-hosted              {sh['usd_per_1k_sessions']:,.2f} $ per 1,000 sessions ({per})")
    o = d["other_stickiness"]
    print(f"  with {o['stickiness']}: {o['usd_per_1k_sessions']:,.2f} $ per 1,000 sessions, hit ratio "
          f"{o['token_hit_ratio']:.4f}, escalations {o['escalation_rate']:.1%}, model_switch "
          f"{o['model_switch_tokens']:,} tokens ({-o['saves_model_switch_tokens']:+,})")
