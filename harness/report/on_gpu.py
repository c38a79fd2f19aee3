"""The index's "On your GPU" section: the spec's predicted deployments beside what this CPU measured.

Why on the index and not a notebook page: it answers the question a reader brings first (how many of these
agents fit on my GPU, at what latency and cost) from small typed files (``predictions/*/*/prediction.json``)
that need no plotting, and it must sit next to the measured figures it is read against.  Every predicted cell
says *predicted*, and each table states the efficiency factors and memory plan the figures came from.  Every
string from a file goes through ``html.escape`` (the index's CSP allows no scripts).
"""

from __future__ import annotations

import html
import statistics
from typing import Any

from kvscope.harness.analysis.claims import capacity_claims
from kvscope.harness.results.loaders import load_experiment_predictions

PRED = '<span class="pred">predicted</span>'
STYLE = "<style>.pred{font-size:10px;color:#8a4b00;margin-left:3px}</style>"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1e3:,.0f} ms"


def _usd(v: float | None) -> str:
    return "–" if v is None else f"${v:,.3f}"


def _fits(p: Any) -> str:
    cap = p.slo_capacity_load
    if cap is None:
        return "none (the lowest load misses the SLO)"
    top = p.load_curve[-1].load if p.load_curve else cap
    if cap == top:
        return f"≥ {cap:g} (all the prediction trace's sessions)"
    return f"{cap:g}"


def _measured(res: Any, workload: str) -> str:
    """This CPU's measurement of the same workload: the first configuration's grid cells (median over repeats)."""
    by_server: dict[str, list[Any]] = {}
    for c in res.experiment.cells.values():
        if c.workload == workload and c.status == "ok" and c.headline is not None and "sweep" not in c.load:
            by_server.setdefault(c.server, []).append(c)
    if not by_server:
        return "no measured cell of this workload"
    server, cells = next(iter(by_server.items()))
    p90 = [c.headline.ttft_p90_s for c in cells if c.headline.ttft_p90_s is not None]
    hit = [c.headline.hit_rate for c in cells if c.headline.hit_rate is not None]
    loads = sorted({c.load for c in cells})
    parts = [f"{server} at {', '.join(loads)} ({len(cells)} cell{'s' if len(cells) != 1 else ''})"]
    if p90:
        parts.append(f"TTFT p90 {_ms(statistics.median(p90))}")
    if hit:
        parts.append(f"hit rate {statistics.median(hit):.1%}")
    return ", ".join(parts)


def _sessions_text(preds: list[Any]) -> str:
    """"48 sessions" (or "24-48 sessions" where the workloads' prediction traces differ)."""
    counts = sorted({len({r.session_id for r in p.prediction.requests}) for p in preds})
    return f"{counts[0]} sessions" if len(counts) == 1 else f"{counts[0]}-{counts[-1]} sessions"


def _scale_text(res: Any) -> str:
    """The spec's overrides of the workloads' scale / max_context for the prediction traces, if any."""
    spec = getattr(res.experiment, "spec", None)
    pred = getattr(spec, "predicted", None)
    if pred is None:
        return ""
    if isinstance(pred, dict):  # the results layer reads the spec's core; `predicted:` stays a plain mapping
        scale, max_context = pred.get("scale"), pred.get("max_context")
    else:
        scale, max_context = getattr(pred, "scale", None), getattr(pred, "max_context", None)
    bits = []
    if scale:
        bits.append(f"prompt scale {scale:g}")
    if max_context:
        bits.append(f"sessions ending before {max_context:,} tokens")
    return f"; here {' and '.join(bits)}, a GPU-sized context instead of the CPU's" if bits else ""


def on_gpu_html(res: Any) -> str:
    """The section's HTML ('' when the experiment predicted nothing)."""
    preds = load_experiment_predictions(res.root)
    if not preds:
        return ""
    e = html.escape
    parts = [STYLE, "<h2>On your GPU</h2>",
             ("<p>Every figure in these tables is <b>predicted</b> by kvscope's scheduler model (continuous batching, "
             "chunked prefill, preemption, prefix caching in the GPU's KV pool) with step times from the GPU's "
             "datasheet and the model's config.json; nothing here ran on a GPU. "
             f"Each workload is predicted on its own prediction trace of {_sessions_text(preds)}: the workload's "
             f"spec (preset, seed, scales{_scale_text(res)}) with more sessions than the few this CPU drove, so the "
             "loads climb until past the SLO capacity and the eviction cliff (or the trace's sessions run out). "
             "Beside each workload: what this CPU measured on its smaller trace.</p>")]
    for claim in capacity_claims(res):  # the recorded levels read by today's rule (under-driven levels not counted)
        parts.append(f"<p>Measured on this CPU: {e(claim.sentence)}</p>")
    by_config: dict[str, list[Any]] = {}
    for p in preds:
        by_config.setdefault(p.config, []).append(p)
    for config, rows in by_config.items():
        first = rows[0].prediction
        d, s = first.deployment, first.step_model
        parts.append(f"<h3>{e(config)}: {e(d.model)} on {d.tp} × {e(d.gpu_name)} (predicted)</h3>")
        if s.kind == "roofline":
            factors = (f"roofline step model with mfu {s.mfu:g}, bandwidth efficiency {s.bandwidth_efficiency:g}, "
                       f"step overhead {s.step_overhead_ms:g} ms, request overhead {s.request_overhead_ms:g} ms "
                       f"({e(s.source)})")
        else:
            factors = f"step costs from the calibration {e(s.source)}"
        parts.append(
            f"<p>Efficiency factors used: {factors}. Memory plan: weights {d.weight_gib_per_gpu:.1f} GiB/GPU, KV pool "
            f"{d.kv_cache_tokens:,} tokens ({e(d.kv_cache_dtype)}) in blocks of {d.block_size} (finer than a CPU server's, "
            f"so more of each shared prefix hits), max_num_seqs {d.max_num_seqs}, "
            f"max_num_batched_tokens {d.max_num_batched_tokens}. SLO: TTFT p90 ≤ {first.slo.ttft_ms:g} ms, TPOT p50 ≤ "
            f"{first.slo.tpot_ms:g} ms, no preemption; load = agent sessions at once (closed loop).</p>")
        parts.append("<table><tr><th>workload</th><th>sessions that fit under the SLO</th><th>hit rate at that load</th>"
                     "<th>TTFT p90 at that load</th><th>TPOT p50 at that load</th><th>eviction cliff</th><th>$/Mtok in</th><th>$/Mtok out</th>"
                     "<th>$/1,000 sessions</th><th>GPU busy</th><th>measured on this CPU</th></tr>")
        for ep in rows:
            p = ep.prediction
            at = next((pt for pt in p.load_curve if pt.load == p.slo_capacity_load), None)
            cliff = ("none within the loads" if p.eviction_cliff_load is None
                     else f"at {p.eviction_cliff_load:g} sessions")
            c = p.cost
            cells = [_fits(p), f"{at.token_hit_rate:.1%}" if at else "–", _ms(at.ttft_p90_s if at else None), _ms(at.tpot_p50_s if at else None), cliff,
                     _usd(c.usd_per_mtok_input if c else None), _usd(c.usd_per_mtok_output if c else None),
                     _usd(c.usd_per_1000_sessions if c else None), f"{c.utilization:.0%}" if c else "–"]
            parts.append("<tr><td>" + e(ep.workload) + "</td>" + "".join(f"<td>{e(x)} {PRED}</td>" for x in cells)
                         + f"<td>{e(_measured(res, ep.workload))}</td></tr>")
        parts.append("</table>")
        priced = next((r.prediction.cost for r in rows if r.prediction.cost is not None), None)
        if priced is not None:
            parts.append(f"<p><small>Cost at ${priced.usd_per_gpu_hour:g}/GPU-hour × {priced.num_gpus} "
                         f"({e(priced.price_source)}), at the load that fits the SLO, idle GPU time charged: where the "
                         "trace drives too few sessions to keep the GPU busy, the cost per token is that of an idle "
                         "GPU (GPU busy says how idle); prediction.json's cost also charges the busy time only."
                         "</small></p>")
    return "".join(parts)
