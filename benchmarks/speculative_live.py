"""The offline speculative-decoding model against real vLLM CPU, request by request, and predicted TPOT.

For each n-gram setting (k, prompt_lookup_min, prompt_lookup_max) a vLLM server with
``--per-request-spec-decode-metrics detailed`` answers the prompts of a small agent trace one at a time at
temperature 0 (streamed, ``ignore_eos``); the offline model (``kvscope.harness.cachemodel.speculative``) is
given each prompt and the tokens the server generated, and its drafts and accepted tokens are compared with
the server's per-step counters.  A baseline server (no speculation) of the same model is calibrated first
(``kvscope.harness.replay.calibrate``), and each request's TPOT is predicted from those step costs and the
model's steps (a step verifying 1 + d tokens costs what the calibration says) beside the measured TPOT.

Usage (starts three vLLM servers; wrap in flock on a shared machine):
    flock /tmp/kvscope-vllm.lock timeout 1500 .venv/bin/python benchmarks/speculative_live.py \
        --model models/tiny-trained [--settings 3:2:4,5:1:3] [--requests 40]
Writes benchmarks/results/speculative_live.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _stream(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    tokens: list[int] = []
    times: list[float] = []
    metrics = None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                ids = ch.get("token_ids") or []
                if ids:
                    tokens.extend(ids)
                    times.append(time.perf_counter() - t0)
            if chunk.get("metrics"):
                metrics = chunk["metrics"]
    ttft, e2e = times[0], times[-1]
    return {"token_ids": tokens, "ttft_s": ttft, "e2e_s": e2e,
            "tpot_s": (e2e - ttft) / (len(tokens) - 1) if len(tokens) > 1 else float("nan"),
            "spec": (metrics or {}).get("speculative_decoding")}


def _decode_s(snap) -> float:
    h = snap.histogram("vllm:request_decode_time_seconds")
    return h.sum if h is not None else float("nan")


def _measured(client, endpoint: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed request with the engine's own decode time for it (/metrics before and after)."""
    from kvscope.harness.serving.backend import DEFAULT_BACKEND, Backend

    def fetch_metrics(url: str):
        return Backend.create(DEFAULT_BACKEND, endpoint=url).scrape_metrics()

    before = _decode_s(fetch_metrics(endpoint))
    out = _stream(client, endpoint + "", prompt, max_tokens)
    out["server_decode_s"] = _decode_s(fetch_metrics(endpoint)) - before
    return out


def _server(model: str, log_dir: Path, name: str, **fields):
    from kvscope.harness.serving.server import ServerConfig, VllmServer

    cfg = dict(model=model, served_model_name="tiny", max_model_len=4096, kv_cache_memory_bytes="16M",
               startup_timeout_s=300)
    cfg.update(fields)
    return VllmServer(ServerConfig(**cfg), log_path=log_dir / f"{name}.log")


def _weighted_tpot_ms(rows: list[dict], seconds: list[float]) -> float:
    tokens = sum(max(r["output_tokens"] - 1, 0) for r in rows)
    return 1e3 * float(np.nansum(seconds)) / tokens if tokens else float("nan")


def _cost_seconds(rows: list[dict], cost) -> list[float]:
    return [r["steps"] * (cost.base_s + cost.per_seq_s) + cost.per_token_s * r["step_tokens"]
            + cost.per_context_token_s * r["step_context_tokens"] for r in rows]


def analyze_tpot(report: dict) -> dict:
    """TPOT (decode time over decode tokens, all requests together; the engine's own decode time) measured
    beside predicted: (a) from the baseline's calibration, every step costing what it says for 1 + d tokens;
    (b) plain decode steps fitted on the baseline run itself (base + per context token) plus a speculative
    step's extra cost per draft token verified, fitted on the *other* n-gram setting."""
    from kvscope.harness.cachemodel.calibration import StepCostModel

    cal = StepCostModel(**report["calibration"])
    out: dict = {"baseline": {}, "settings": []}
    rows = report["baseline"]["rows"]
    meas = _weighted_tpot_ms(rows, [r["server_decode_s"] for r in rows])
    pred = _weighted_tpot_ms(rows, _cost_seconds(rows, cal))
    out["baseline"] = {"measured_ms": meas, "calibration_ms": pred, "calibration_error": pred / meas - 1}
    brows = [r for r in rows if r["steps"] > 0 and np.isfinite(r["server_decode_s"])]
    X = np.array([[r["steps"], r["step_context_tokens"]] for r in brows], float)
    y = np.array([r["server_decode_s"] for r in brows])
    plain_coef = np.linalg.lstsq(X, y, rcond=None)[0]
    out["baseline"]["plain_step_fit_ms"] = {"base": plain_coef[0] * 1e3, "per_context_token": plain_coef[1] * 1e3}

    def plain_s(r: dict) -> float:
        return plain_coef[0] * r["steps"] + plain_coef[1] * r["step_context_tokens"]

    fits = {}
    for s in report["settings"]:
        srows = [r for r in s["rows"] if r["steps"] > 0 and np.isfinite(r["server_decode_s"])]
        # one coefficient: the drafts per step are nearly constant within a setting, so a per-step overhead
        # and a per-draft-token cost cannot be told apart there; the extra time per verified draft token is
        extra = sum(r["server_decode_s"] - plain_s(r) for r in srows)
        fits[s["setting"]] = extra / max(sum(sum(r["pred_steps"][0]) for r in srows), 1)
    for s in report["settings"]:
        rows = s["rows"]
        meas = _weighted_tpot_ms(rows, [r["server_decode_s"] for r in rows])
        pred = _weighted_tpot_ms(rows, _cost_seconds(rows, cal))
        steps = sum(r["steps"] for r in rows)
        entry = {"setting": s["setting"], "measured_ms": meas, "calibration_ms": pred,
                 "calibration_error": pred / meas - 1,
                 "measured_speedup_vs_baseline": out["baseline"]["measured_ms"] / meas,
                 "measured_ms_per_step": 1e3 * sum(r["server_decode_s"] for r in rows) / steps,
                 "extra_ms_per_draft_token": fits[s["setting"]] * 1e3}
        others = [k for k in fits if k != s["setting"]]
        if others:
            per_draft = fits[others[0]]
            p2 = [plain_s(r) + per_draft * sum(r["pred_steps"][0]) for r in rows]
            cross = _weighted_tpot_ms(rows, p2)
            entry.update({"spec_fit_from": others[0], "spec_fit_ms": cross, "spec_fit_error": cross / meas - 1})
        out["settings"].append(entry)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a trained tiny model (kvscope model build-tiny --train-steps 50)")
    ap.add_argument("--settings", default="3:2:4,5:1:3", help="k:prompt_lookup_min:prompt_lookup_max, comma list")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "speculative_live.json"))
    ap.add_argument("--reanalyze", metavar="FILE", help="recompute the TPOT comparison from a saved result")
    args = ap.parse_args()
    if args.reanalyze:
        print(json.dumps(analyze_tpot(json.loads(Path(args.reanalyze).read_text())), indent=2))
        return 0

    import httpx
    from kvscope.harness.cachemodel.speculative import (
        NgramConfig,
        matches_live,
        plain_tpot_s,
        predicted_tpot_s,
        simulate_request,
    )
    from kvscope.harness.replay.calibrate import calibrate_server
    from kvscope.harness.serving.backend import Backend
    from kvscope.workloads.trace import Trace

    work = Path(tempfile.mkdtemp(prefix="kvscope-speclive-"))
    # the quickstart's agent workload (experiments/quickstart.yaml)
    subprocess.run([str(Path(sys.executable).parent / "kvscope"), "workload", "generate", "agent-coding",
                    "--tokenizer", args.model, "--scale", "0.02", "--output-scale", "0.15", "--sessions", "4",
                    "--seed", "1", "--max-context", "2000", "--out", str(work / "trace"), "--no-progress"],
                   check=True)
    trace = Trace.read(work / "trace")
    rids = list(range(min(args.requests, trace.num_requests)))
    prompts = [trace.prompt_token_ids(r).tolist() for r in rids]
    max_tokens = [int(trace.requests["max_tokens"][r]) for r in rids]

    base = _server(args.model, work, "baseline")
    base.start()
    try:
        cal = calibrate_server(Backend.create("vllm", endpoint=base.endpoint), work / "calibration.json")
        with httpx.Client(timeout=120) as client:
            _stream(client, base.endpoint, prompts[0][:64], 4)  # warm-up
            plain = [_measured(client, base.endpoint, p, m) for p, m in zip(prompts, max_tokens)]
    finally:
        base.stop()
    cost = cal.cost_model()
    tp_plain = np.array([plain_tpot_s(len(p), len(r["token_ids"]), cost) for p, r in zip(prompts, plain)])
    tl_plain = np.array([r["tpot_s"] for r in plain])
    ok_plain = np.isfinite(tp_plain) & np.isfinite(tl_plain)
    plain_entry = {"tpot_pred_mean_ms": float(tp_plain[ok_plain].mean() * 1e3),
                   "tpot_live_mean_ms": float(tl_plain[ok_plain].mean() * 1e3)}
    plain_entry["tpot_rel_error"] = plain_entry["tpot_pred_mean_ms"] / plain_entry["tpot_live_mean_ms"] - 1.0
    print(f"calibrated the baseline: R² {cal.fit_r2:.3f}; without speculation TPOT predicted "
          f"{plain_entry['tpot_pred_mean_ms']:.2f} ms vs measured {plain_entry['tpot_live_mean_ms']:.2f} ms "
          f"({plain_entry['tpot_rel_error']:+.1%})", flush=True)

    plain_entry["rows"] = [
        {"output_tokens": len(r["token_ids"]), "server_decode_s": r["server_decode_s"],
         "client_decode_s": r["e2e_s"] - r["ttft_s"], "steps": max(len(r["token_ids"]) - 1, 0),
         "step_tokens": max(len(r["token_ids"]) - 1, 0),
         "step_context_tokens": int(sum(len(p) + j for j in range(1, len(r["token_ids"]))))}
        for p, r in zip(prompts, plain)]
    report: dict = {"model": args.model, "requests": len(rids), "calibration_r2": cal.fit_r2,
                    "calibration": cal.cost.model_dump(), "baseline": plain_entry, "settings": []}
    for s in args.settings.split(","):
        k, lo, hi = (int(x) for x in s.split(":"))
        cfg = NgramConfig(k, lo, hi)
        server = _server(args.model, work, f"ngram-{k}-{lo}-{hi}",
                         speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                             "prompt_lookup_min": lo, "prompt_lookup_max": hi},
                         extra_args=["--per-request-spec-decode-metrics", "detailed"])
        server.start()
        try:
            with httpx.Client(timeout=120) as client:
                _stream(client, server.endpoint, prompts[0][:64], 4)  # warm-up
                live = [_measured(client, server.endpoint, p, m) for p, m in zip(prompts, max_tokens)]
        finally:
            server.stop()
        rows = []
        for rid, p, lv in zip(rids, prompts, live):
            sim = simulate_request(p, lv["token_ids"], cfg, max_model_len=4096, request_id=rid)
            sd = lv["spec"] or {}
            ok = matches_live(sim, sd.get("per_step_drafted") or [], sd.get("per_step_accepted") or [])
            rows.append({"request_id": rid, "match": ok, "output_tokens": len(lv["token_ids"]),
                         "pred_drafts": sim.draft_tokens, "live_drafts": sd.get("num_draft_tokens"),
                         "pred_accepted": sim.accepted_tokens, "live_accepted": sd.get("num_accepted_draft_tokens"),
                         "open_ended": sim.open_ended, "same_output_as_baseline":
                         lv["token_ids"] == plain[rids.index(rid)]["token_ids"],
                         "pred_steps": [sim.per_step_drafted(), sim.per_step_accepted()],
                         "live_steps": [sd.get("per_step_drafted"), sd.get("per_step_accepted")],
                         "tpot_pred_s": predicted_tpot_s(sim, cost), "tpot_live_s": lv["tpot_s"],
                         "server_decode_s": lv["server_decode_s"], "client_decode_s": lv["e2e_s"] - lv["ttft_s"],
                         "steps": sim.decode_steps, "step_tokens": int((1 + sim.drafted).sum()),
                         "step_context_tokens": int(sim.context_tokens.sum())})
        matched = sum(r["match"] for r in rows)
        tp = np.array([r["tpot_pred_s"] for r in rows])
        tl = np.array([r["tpot_live_s"] for r in rows])
        ok = np.isfinite(tp) & np.isfinite(tl)
        entry = {"setting": cfg.label, "k": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi,
                 "match_share": matched / len(rows), "matched": matched,
                 "draft_tokens_pred": int(sum(r["pred_drafts"] for r in rows)),
                 "draft_tokens_live": int(sum(r["live_drafts"] or 0 for r in rows)),
                 "accepted_pred": int(sum(r["pred_accepted"] for r in rows)),
                 "accepted_live": int(sum(r["live_accepted"] or 0 for r in rows)),
                 "tpot_pred_mean_ms": float(tp[ok].mean() * 1e3), "tpot_live_mean_ms": float(tl[ok].mean() * 1e3),
                 "tpot_rel_error": float(tp[ok].mean() / tl[ok].mean() - 1.0), "rows": rows}
        report["settings"].append(entry)
        print(f"{cfg.label}: {matched}/{len(rows)} requests match vLLM's per-step counters "
              f"({entry['match_share']:.1%}); drafts {entry['draft_tokens_pred']} vs {entry['draft_tokens_live']}, "
              f"accepted {entry['accepted_pred']} vs {entry['accepted_live']}; TPOT predicted "
              f"{entry['tpot_pred_mean_ms']:.2f} ms vs measured {entry['tpot_live_mean_ms']:.2f} ms "
              f"({entry['tpot_rel_error']:+.1%})", flush=True)
    report["tpot"] = analyze_tpot(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    t = report["tpot"]
    print(f"TPOT, decode time over decode tokens (engine's timestamps): without speculation measured "
          f"{t['baseline']['measured_ms']:.2f} ms, calibration {t['baseline']['calibration_ms']:.2f} ms "
          f"({t['baseline']['calibration_error']:+.0%})")
    for e in t["settings"]:
        print(f"  {e['setting']}: measured {e['measured_ms']:.2f} ms; calibration {e['calibration_ms']:.2f} ms "
              f"({e['calibration_error']:+.0%}); plain steps + draft-token cost fitted on {e.get('spec_fit_from')}: "
              f"{e.get('spec_fit_ms', float('nan')):.2f} ms ({e.get('spec_fit_error', float('nan')):+.0%})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
