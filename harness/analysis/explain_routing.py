"""`kvscope explain` for routed traffic: which model served each request, and the history a switch recomputed.

A routed run keeps one prefix cache per model, so a session whose previous step ran on another model finds its
history there, not here; a single-cache attribution would call that shortfall an eviction.  This module routes
the trace with a model-routing spec (:mod:`kvscope.harness.cachemodel.model_routing`: decisions from a rule, a
labels file, or a recorded run's records) and hands :func:`~.explain.explain` two columns: the cached tokens
on the serving model's pool (the observed reads where no run gives them) and, per request, the tokens the
session's previous model held but the serving one did not (``model_switch``).  The policy's summary adds what
the other stickiness would change (tokens and $), since sticky routing is the remedy the cause points to.

It is a module of its own so the attribution stays a single-cache algorithm: routing enters it as two
per-request columns, and nothing here is loaded unless ``--routing`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.harness.cachemodel.model_routing import (
    ModelRoutingSpec,
    RecordedPolicy,
    RoutedRequest,
    load_routing_inputs,
    load_spec,
)
from kvscope.harness.common.errors import ConfigError
from kvscope.harness.pricing.model_routing import describe, evaluate_policy, stickiness_counterfactual


@dataclass
class RoutedExplain:
    """What the attribution reads of a routed trace (per request, in trace order) and the policy's summary."""

    cached_tokens: list[int]
    model_switch: list[tuple[int, str]]  # (tokens recomputed because of the switch, where)
    summary: dict[str, Any]
    routed: list[RoutedRequest]


def switch_columns(routed: list[RoutedRequest]) -> list[tuple[int, str]]:
    """Per request: its ``model_switch`` tokens and a where naming both models ("on large, previous step on
    small")."""
    last: dict[Any, str] = {}
    out = []
    for r in routed:
        key = r.session_id if r.session_id is not None else f"#{r.request_id}"
        prev = last.get(key)
        where = f"on {r.model}, previous step on {prev}" if prev is not None and prev != r.model else ""
        if r.escalated and r.small_attempt_model is not None and prev == r.model:
            where = f"on {r.model}, after a discarded attempt on {r.small_attempt_model}"
        out.append((r.model_switch_tokens, where))
        last[key] = r.model
    return out


def decisions_from_records(records: Any) -> Any:
    """A recorded run's per-request columns (its last successful attempt of each request), as a labels frame for
    the ``recorded`` policy: a routed replay writes each request's serving model there."""
    ok = records[records["error_class"].isna()] if "error_class" in records.columns else records
    frame = ok.drop_duplicates("request_id", keep="last").reset_index(drop=True)
    frame.attrs["source"] = "the run's records"
    return frame


def route_for_explain(trace_dir: str | Path, routing: Any, labels: Any = None,
                      records: Any = None) -> RoutedExplain:
    """Route ``trace_dir`` with ``routing`` (a spec dict or a YAML/JSON file) and the signals in ``labels`` (a
    file); a ``recorded`` policy without labels reads the run's ``records``.  Bad input (a spec naming an
    unknown model, a threshold out of range, labels not matching the trace's requests) is a one-line
    :class:`ConfigError`."""
    spec: ModelRoutingSpec = load_spec(routing) if isinstance(routing, dict) else load_spec(Path(routing))
    if labels is None and records is not None and isinstance(spec.policy, RecordedPolicy):
        labels = decisions_from_records(records)
    elif labels is None and isinstance(spec.policy, RecordedPolicy):
        raise ConfigError("a recorded routing policy needs --labels (the decisions) or a run directory (its records)")
    inputs = load_routing_inputs(trace_dir, [m.block_size for m in spec.models], labels)
    try:
        ev = evaluate_policy(spec, inputs)
    except ValueError as exc:  # an unknown price preset
        raise ConfigError(str(exc).splitlines()[0]) from None
    other, alt = stickiness_counterfactual(spec, inputs, ev)
    t = ev.totals
    summary = {
        "policy": describe(spec), "stickiness": spec.stickiness,
        "requests": t["requests"], "sessions": t["sessions"], "escalation_rate": t["escalation_rate"],
        "token_hit_ratio": t["token_hit_ratio"], "model_switch_tokens": t["model_switch_tokens"],
        "requests_after_switch": t["requests_after_switch"], "usd_per_1k_sessions": ev.cost["usd_per_1k_sessions"],
        "total_usd": ev.cost["total_usd"],
        "per_model": {m: {"requests": d["requests"], "attempts": d["attempts"], "token_hit_ratio": d["token_hit_ratio"],
                          "preset": ev.cost["per_model"][m]["preset"],
                          "total_usd": ev.cost["per_model"][m]["total_usd"]} for m, d in t["per_model"].items()},
        "other_stickiness": {**other, "saves_usd": ev.cost["total_usd"] - alt.cost["total_usd"]},
    }
    return RoutedExplain([r.cached_tokens for r in ev.routed], switch_columns(ev.routed), summary, ev.routed)


def routing_lines(summary: dict[str, Any]) -> list[str]:
    """``kvscope explain``'s routing block: the policy, each model's share and hit ratio, the switches, and what
    the other stickiness would save."""
    s, o = summary, summary["other_stickiness"]
    lines = [(f"routing: {s['policy']} [{s['stickiness']}], {s['requests']} requests, escalations "
              f"{s['escalation_rate']:.1%}, {s['usd_per_1k_sessions']:,.2f} $ per 1,000 sessions")]
    for m, d in s["per_model"].items():
        lines.append(f"  {m:<12} {d['requests']:>6} served, hit ratio {d['token_hit_ratio']:.1%}, "
                     f"{d['total_usd']:,.4f} $ ({d['preset']})")
    lines.append(f"  model_switch: {s['model_switch_tokens']:,} tokens recomputed on {s['requests_after_switch']} "
                 "requests whose previous step ran on another model")
    verb = "saves" if o["saves_usd"] >= 0 else "costs"
    lines.append(f"  {o['stickiness']} would recompute {o['model_switch_tokens']:,} ({-o['saves_model_switch_tokens']:+,}) "
                 f"and {verb} {abs(o['saves_usd']):,.4f} $ ({abs(o['saves_usd_per_1k_sessions']):,.2f} $ per 1,000 "
                 f"sessions; hit ratio {o['token_hit_ratio']:.1%})")
    return lines


__all__ = ["RoutedExplain", "decisions_from_records", "route_for_explain", "routing_lines", "switch_columns"]
