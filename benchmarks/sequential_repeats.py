"""Early stopping of repeats: A/A false-positive rate, power and repeats used, against the fixed-N test and
naive peeking, on the noisy mock's latency model.

Each simulated experiment is up to ``--max`` interleaved repeats of A and B drawn from the mock server's noise
(tests/doubles/repeat_sim.py: run factor 0.04, session 0.06, request 0.12 on TTFT 40 ms, as
`test_ab_calibration.py`), decided on TTFT p50 and output tokens/s. Three rules on the same draws:

- ``fixed``: the paired t-test once, after all max repeats (the fixed-N design);
- ``naive``: the same test at alpha after every repeat from ``--min`` on, stopping at the first decision
  (peeking: what must not be done);
- ``sequential``: kvscope's rule (kvscope.harness.analysis.sequential, alpha spent over the looks).

The A/A rate is shown twice: with margin 0 (the plain test of no difference, where a single look rejects
exactly alpha, so peeking's inflation is visible) and with the verdicts' practical margin (5 %), which an A/A
pair almost never crosses. Power: TTFT x1.3 and tokens/s x0.7 (both called worse).

Usage::

    .venv/bin/python benchmarks/sequential_repeats.py [--experiments 2000] [--max 5] [--min 2] [--spending pocock]

Prints the table; writes JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import REPO

sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiments", type=int, default=2000, help="simulated A/A experiments per rule (A/B: half)")
    ap.add_argument("--max", type=int, default=5, help="repeats at most")
    ap.add_argument("--min", type=int, default=2, help="the first look")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--spending", default="pocock,obrien-fleming", help="comma-separated spending functions")
    args = ap.parse_args()

    from scipy import stats

    from kvscope.harness.analysis.sequential import SequentialRule
    from tests.doubles.repeat_sim import simulate_rule

    n = args.experiments
    ceiling = stats.binom.ppf(0.999, n, args.alpha) / n
    rows = []
    t0 = time.perf_counter()
    for spending in args.spending.split(","):
        rules = {"fixed": SequentialRule(args.max, args.max, args.alpha, spending),  # type: ignore[arg-type]
                 "naive": SequentialRule(args.min, args.max, args.alpha, spending, naive=True),  # type: ignore[arg-type]
                 "sequential": SequentialRule(args.min, args.max, args.alpha, spending)}  # type: ignore[arg-type]
        for name, rule in rules.items():
            if name == "fixed" and rows and rows[0]["rule"] == "fixed":
                continue  # the fixed test does not depend on the spending function
            aa0 = simulate_rule(SequentialRule(rule.min_repeats, rule.max_repeats, rule.alpha, rule.spending,
                                               rule.naive, margin=0.0), n, seed=1)
            aa = simulate_rule(rule, n, seed=2)
            ab = simulate_rule(rule, max(n // 2, 1), seed=3, ttft_effect=1.3, throughput_effect=0.7)
            rows.append({"rule": name, "spending": "-" if name == "fixed" else spending,
                         "aa_margin0_fpr": aa0.called, "aa_margin0_any": aa0.any_called,
                         "aa_margin_fpr_any": aa.any_called, "power": ab.worse, "mean_repeats_ab": ab.mean_repeats,
                         "mean_repeats_aa": aa.mean_repeats})
    print(f"{n} A/A and {max(n // 2, 1)} A/B simulated experiments per rule; up to {args.max} repeats, looks from "
          f"{args.min}; alpha {args.alpha} (binomial 99.9 % ceiling at n={n}: {ceiling:.3f}); "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"{'rule':11s} {'spending':15s} {'A/A FPR margin 0 (TTFT, tok/s, any)':38s} {'A/A any, 5 % margin':20s} "
          f"{'power (TTFT, tok/s)':20s} {'repeats A/B':>11s} {'repeats A/A':>11s}")
    for r in rows:
        f0 = r["aa_margin0_fpr"]
        print(f"{r['rule']:11s} {r['spending']:15s} "
              f"{f0['ttft_p50_s']:.3f}, {f0['output_tokens_per_s']:.3f}, {r['aa_margin0_any']:.3f}{'':19s} "
              f"{r['aa_margin_fpr_any']:.3f}{'':15s} {r['power']['ttft_p50_s']:.3f}, "
              f"{r['power']['output_tokens_per_s']:.3f}{'':7s} {r['mean_repeats_ab']:11.2f} {r['mean_repeats_aa']:11.2f}")
    out = REPO / "benchmarks" / "results" / "sequential_repeats.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "ceiling": ceiling, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
