"""Predicted cached tokens for the ids actually sent: the sequential simulator online, the scheduler model
after the run.

Online (:class:`OnlinePredictor`): at send time the prompt's block hashes are looked up in a simulated pool
of the server's size; when the request finishes, its prompt and the tokens the server really generated are
cached as vLLM does (full blocks of the first P+O-1 tokens). Sent one at a time, this equals the server's
`cached_tokens` exactly; with overlapping requests it ignores pinning, admission order and preemption (66-72 %
of the requests exact at concurrency 8 on a 64-block vLLM CPU pool, where the scheduler model got 95-99 %).

After the run (:func:`replay_informed_cached_tokens`): the scheduler model (``cachemodel/scheduler.py``)
replays the same requests step by step, each arriving at its observed ``sent_s``, decoding no faster than its
tokens reached the client and leaving at its ``done_s``, with the step costs of a calibration of the server
(97-100 % exact at concurrency 1-16 on a 64-block pool, tests/test_scheduler_vs_vllm.py). It needs the whole
run's timeline, so it runs once the run has ended; why it is replay-informed rather than predictive (a
timing-free prediction of *which* request a full pool preempts is a draw from a chaotic process):
``cachemodel/capacity_model.py``. The requests it replays are the ones the online predictor hashed (the ids
sent, the ids generated), so both predictors see the same traffic, live mode included.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np
import pandas as pd

from kvscope.harness.cachemodel.capacity_model import replay_informed
from kvscope.harness.cachemodel.hashing import IncrementalHasher
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.cachemodel.simulator import Replica, SimConfig
from kvscope.harness.common.errors import ConfigError, KvscopeError
from kvscope.harness.replay.calibrate import calibrate_server
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.results.loaders import load_calibration
from kvscope.harness.results.summary_parts import ServerFacts

if TYPE_CHECKING:
    from kvscope.harness.results.schemas import CalibrationFile
    from kvscope.harness.serving.backend import Backend


class OnlinePredictor:
    """The sequential simulator on one endpoint's traffic. ``keep_requests``: remember each finished request
    (its hashes as sent and generated) for the scheduler model after the run (:attr:`finished`)."""

    def __init__(self, block_size: int, num_gpu_blocks: int | None, keep_requests: bool = False) -> None:
        self.block_size = block_size
        self.replica = Replica(SimConfig(block_size, num_gpu_blocks))
        self.hasher = IncrementalHasher(block_size, max_sessions=1 << 16)
        self.keep_requests = keep_requests
        #: request id -> the request as it ran (only with ``keep_requests``).
        self.finished: dict[int, SimRequest] = {}

    def on_send(self, request_id: int, session_id: str, prompt: np.ndarray, cache_salt: str | None) -> int:
        B = self.block_size
        P = len(prompt)
        hashes = self.hasher.hashes(session_id, np.asarray(prompt, dtype=np.int32), P // B, cache_salt)
        return self.replica.probe(SimRequest(request_id, P, 1, hashes, B, session_id=session_id,
                                             cache_salt=cache_salt)) * B

    def on_finish(self, request_id: int, session_id: str, prompt: np.ndarray, output_ids: Sequence[int],
                  cache_salt: str | None) -> None:
        B = self.block_size
        P, O = len(prompt), max(len(output_ids), 1)
        tokens = np.concatenate([np.asarray(prompt, dtype=np.int32), np.asarray(output_ids, dtype=np.int32)])
        hashes = self.hasher.hashes(session_id, tokens, (P + O - 1) // B, cache_salt)
        req = SimRequest(request_id, P, O, hashes, B, session_id=session_id, cache_salt=cache_salt)
        self.replica.run_sequential(req)
        if self.keep_requests:
            self.finished[request_id] = req


def replay_informed_cached_tokens(records: pd.DataFrame, requests: Mapping[int, SimRequest],
                                  cal: "CalibrationFile", *, pace: bool = True,
                                  output_blocks_known: bool = False,
                                  num_gpu_blocks: int | None = None) -> pd.Series:
    """The scheduler model's ``cached_tokens`` for each successful record of one server, from the run's
    timeline: each request arrives at its ``sent_s`` and leaves (frees its blocks) at its ``done_s``; with
    ``pace`` its decode steps also wait for the tokens the client had seen (``first_token_s`` + ``itl_s``);
    what happens in between (admission, hits, allocation, eviction, preemption) is the scheduler model's.
    ``requests``: request id -> the request's hashes (as sent; ``output_blocks_known``: and as generated).
    Returns a Series on the successful records' index (failed ones are not in it).

    Why pacing: unpaced, the model decoded a batch of ~1,000-token turns faster than the server, so finished
    requests sat on all their decode blocks while the server's were still decoding, and admissions the server
    made at once waited (found by comparing the model's evictions with vLLM's own KV-cache events:
    ``benchmarks/capacity_predict.py kv-events``).  Paced (and at half the step costs, see
    ``capacity_model.replay_informed``) the exact share at concurrency 8 went from 85-92 % to 92-96 % on four
    quiet-machine runs.  Also tried: admitting no earlier than the first token minus a prefill step (worse by
    1-3 points at 8); ordering sends that came within 3-30 ms of each other by their first tokens (no gain).

    Pinning the departures took the exact share on the 64-block validation runs (loaded 2-core host) from
    75 / 88 / 94 % to 84 / 99 / 98 % at concurrency 8 / 16 / 32 (100 % at 1-4 either way).
    Tried and dropped: rescaling the step costs so that the predicted total request time matches the run's
    (the calibration was measured at another load); on the 64-block validation runs it lowered the exact share
    at concurrency 8-32 by 10-15 points, so the run's send times are the only thing taken from it.
    """
    cfg = cal.scheduler_config(num_gpu_blocks)
    ok = records[records["error_class"].isna()] if "error_class" in records else records
    ok = ok.sort_values("sent_s", kind="stable")
    reqs = [requests[int(i)] for i in ok["request_id"]]
    done_s = ok["done_s"].astype(float).tolist() if "done_s" in ok else None
    token_times = None
    if pace and done_s is not None and "itl_s" in ok and "first_token_s" in ok:
        token_times = [np.concatenate(([ft], ft + np.cumsum(np.asarray(itl, dtype=float))))
                       if itl is not None and not math.isnan(ft) else np.array([])
                       for ft, itl in zip(ok["first_token_s"].astype(float), ok["itl_s"])]
    run = replay_informed(reqs, ok["sent_s"].astype(float).tolist(), ok["output_tokens"].astype(int).tolist(),
                          cfg, cal.cost_model(), done_s=done_s, token_times_s=token_times,
                          output_blocks_known=output_blocks_known)
    return pd.Series(run.cached_tokens, index=ok.index, dtype="int64")


def endpoint_predictors(opts: ReplayOptions, facts: Sequence[ServerFacts], keep_requests: bool = False
                        ) -> list[OnlinePredictor | None]:
    """One online predictor per endpoint, where predictions are asked for and the server's block size is
    known (None elsewhere: an engine that does not say predicts nothing)."""
    return [OnlinePredictor(int(f.block_size), f.num_blocks, keep_requests=keep_requests)
            if opts.predict and f.block_size else None for f in facts]


@dataclass
class PredictorChoice:
    """Which model the run's ``predicted_cached_tokens`` come from (``records.PREDICTORS``), and why."""

    predictor: str | None
    #: The calibration the scheduler model runs on (None: the sequential simulator's predictions stay).
    calibration: "CalibrationFile | None" = None
    #: Where it came from: the file given, or RUN_DIR/calibration.json when taken for this run.
    calibration_path: str | None = None
    calibrated_here: bool = False
    #: One sentence for the summary when the choice is not the obvious one.
    note: str | None = None


def one_request_at_a_time(opts: ReplayOptions) -> bool:
    """Whether the run's requests cannot overlap on a server: the sequential simulator's case (exact there)."""
    return opts.concurrency == 1 or opts.max_active_sessions == 1


def choose_predictor(opts: ReplayOptions, facts: Sequence[ServerFacts], backends: "Sequence[Backend]",
                     run_dir: Path | None = None) -> PredictorChoice:
    """The sequential simulator when requests run one at a time or there is no calibration; the scheduler
    model, replay-informed, when they may overlap and a calibration is given (``opts.calibration``, checked against
    the server's block size and count) or taken (``opts.calibrate``: measured now through the first server's
    backend, written to RUN_DIR/calibration.json; a failed calibration leaves the sequential simulator, with a
    note)."""
    if not opts.predict:
        return PredictorChoice(None)
    if one_request_at_a_time(opts):
        return PredictorChoice("sequential")
    block_size, num_blocks = facts[0].block_size, facts[0].num_blocks
    if opts.calibration:
        cal = load_calibration(opts.calibration)
        if cal.server.block_size != block_size or (num_blocks and cal.server.num_gpu_blocks != num_blocks):
            raise ConfigError(f"calibration {opts.calibration}: measured on a server with "
                              f"{cal.server.num_gpu_blocks} blocks of {cal.server.block_size} tokens, but "
                              f"{backends[0].endpoint} has {num_blocks} blocks of {block_size}: calibrate "
                              "this server (--calibrate)")
        return PredictorChoice("scheduler-replay-informed", cal, str(opts.calibration))
    if opts.calibrate and run_dir is not None:
        path = Path(run_dir) / "calibration.json"
        print("kvscope: calibrating the server for the scheduler model (a few dozen requests) …",
              file=sys.stderr, flush=True)
        try:
            cal = calibrate_server(backends[0], path, client_priority_mode=opts.client_priority)
        except (KvscopeError, OSError, ValueError) as exc:
            reason = f"calibration failed ({exc.__class__.__name__}: {str(exc).splitlines()[0][:200]})"
            print(f"kvscope: warning: {reason}: the sequential simulator predicts", file=sys.stderr, flush=True)
            return PredictorChoice("sequential", note=f"{reason}; requests overlap, so the sequential "
                                                      "simulator's predictions are approximate", calibrated_here=True)
        return PredictorChoice("scheduler-replay-informed", cal, str(path), calibrated_here=True)
    return PredictorChoice("sequential", note="requests overlap and no calibration was given (--calibration FILE "
                                              "or --calibrate), so the sequential simulator predicts: it ignores "
                                              "admission order, pinning and preemption")


def apply_scheduler_predictions(records: pd.DataFrame, predictors: Sequence[OnlinePredictor | None],
                                facts: Sequence[ServerFacts], choice: PredictorChoice) -> str | None:
    """Replace ``predicted_cached_tokens`` of the successful records (in place) by the scheduler model's,
    replayed per server on the run's timeline (:func:`replay_informed_cached_tokens`); failed records get
    none. The sequential simulator's stay in ``predicted_cached_tokens_sequential``. If the model cannot run
    (a request it never saw, an error inside it) the sequential predictions stay and the returned note says
    why; None when it ran."""
    assert choice.calibration is not None
    scheduled = {}
    try:
        for ep, group in records.groupby("endpoint_index", sort=False):
            predictor = predictors[int(ep)]
            if predictor is None:
                raise KvscopeError(f"endpoint {ep} has no prediction")
            scheduled[ep] = replay_informed_cached_tokens(group, predictor.finished, choice.calibration,
                                                          output_blocks_known=True,
                                                          num_gpu_blocks=facts[int(ep)].num_blocks)
    except Exception as exc:  # noqa: BLE001 - the run's records must survive a failing model
        reason = f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        print(f"kvscope: warning: the scheduler model failed ({reason}): the sequential simulator's predictions "
              "are recorded", file=sys.stderr, flush=True)
        return f"the scheduler model failed ({reason}), so the sequential simulator's predictions are recorded"
    records["predicted_cached_tokens"] = None
    records["predictor"] = None
    for series in scheduled.values():
        records.loc[series.index, "predicted_cached_tokens"] = series
        records.loc[series.index, "predictor"] = choice.predictor
    return None
