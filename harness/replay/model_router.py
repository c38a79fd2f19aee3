"""Model routing live: a replay whose requests go to one of several *models* (each its own server) by a routing
policy, with cascades that re-send a request to the large model when the small one's answer fails its check.

The policies, their reasons and stickiness are the offline model's (:class:`~kvscope.harness.cachemodel.
model_routing.SessionRouter` over the same registry), so a live run and ``kvscope route`` decide alike; only the
signals differ: live, a cascade's mean token log-probability is the small model's own (``logprobs`` requested
on its attempt), where offline it is read from a column. The client, timing and records are a replay's
(:class:`RoutedRequestLoop` is a :class:`~.request_loop.RequestLoop` whose :meth:`send` picks the model's
endpoint and may send twice); each request is still one record, the served attempt's, with the model, the
decision, and an escalation's discarded small attempt folded in (``wasted_*``), so every summary counts each
request once and the servers' ``cached_tokens`` is always the serving model's.

After the run :func:`check_routed_run` runs the offline routing model (``simulate_routes``: one exact pool per
model, each with its server's block size and pool) on the ids actually sent and generated, with the decisions
the run took, and writes ``routing.json``: per request the servers' cached tokens beside the model's, the
history each model switch recomputed, and the exact-match share. Sequentially it must be exact; with
overlapping requests the sequential pools are an approximation (the scheduler model per model is another
step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from kvscope.harness.cachemodel.hashing import IncrementalHasher
from kvscope.harness.cachemodel.model_routing import (
    Attempt,
    CascadePolicy,
    ModelRoutingSpec,
    RequestFacts,
    SessionRouter,
    routing_facts,
    simulate_routes,
)
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.common.errors import ConfigError
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.request_loop import RequestLoop
from kvscope.harness.replay.run_state import RunState
from kvscope.harness.results.routing_file import (
    ROUTING_NAME,
    RoutedRequestCheck,
    RoutingCheckFile,
    write_routing_file,
)
from kvscope.harness.results.summary_parts import ServerFacts
from kvscope.harness.serving.request import CompletionResult

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class LiveRouting:
    """A routing spec bound to a trace and to one endpoint per model (the spec's order, cheapest first)."""

    spec: ModelRoutingSpec
    facts: list[RequestFacts]  # per trace request id
    #: the cascade's live signal: its small model's attempt asks for logprobs and their mean lands in this column
    logprob_column: str | None = None
    #: the cascade's small model (the one whose answers are checked)
    small_model: str | None = None
    #: per served request, its hashes as sent and generated, at each block size of the models (post-run check)
    as_run: dict[int, dict[int, SimRequest]] = field(default_factory=dict)

    @classmethod
    def create(cls, spec: ModelRoutingSpec, trace: Any, n_endpoints: int, labels: str | Path | None = None,
               opts: ReplayOptions | None = None) -> LiveRouting:
        """Check the spec against the trace (signal columns, labels' request ids) and the endpoints; every
        problem is one :class:`ConfigError` line, before anything is sent."""
        if n_endpoints != len(spec.models):
            raise ConfigError(f"model routing: {n_endpoints} endpoint(s) for {len(spec.models)} models "
                              f"({', '.join(spec.model_names)}); give one endpoint per model, in the spec's order")
        if opts is not None and (opts.calibration or opts.calibrate):
            raise ConfigError("model routing predicts with one sequential pool per model; --calibration / "
                              "--calibrate (the scheduler model of one server) do not apply to it")
        policy = spec.policy
        live = policy.logprob_column if isinstance(policy, CascadePolicy) and policy.min_mean_logprob is not None \
            else None
        facts, columns = routing_facts(trace, labels)
        for c in policy.columns_needed():
            if c != live and c not in columns:
                raise ConfigError(f"policy {policy.kind} reads column {c!r}, which neither the trace nor the labels "
                                  f"have; columns: {', '.join(columns) or 'none'}")
        if policy.kind == "recorded":  # every recorded model must be one of the spec's, before anything is sent
            for f in facts:
                policy.decide(f, spec.model_names)
        small = (policy.small or spec.model_names[0]) if isinstance(policy, CascadePolicy) else None
        return cls(spec, facts, live, small)

    def request_loop(self, trace: Any, endpoints: list[str], opts: ReplayOptions, facts: list[ServerFacts],
                     **loop_args: Any) -> RoutedRequestLoop:
        return RoutedRequestLoop(self, trace, endpoints, opts, facts, **loop_args)


class RoutedRequestLoop(RequestLoop):
    """The replay's request loop with a model router in front: the endpoint is the model's, and a cascade's
    failed small answer is re-sent to the large model before the record is written."""

    def __init__(self, routing: LiveRouting, trace: Any, endpoints: list[str], opts: ReplayOptions,
                 facts: list[ServerFacts], **loop_args: Any) -> None:
        super().__init__(trace, endpoints, opts, **loop_args)
        self.routing = routing
        self.session_router = SessionRouter(routing.spec)
        self.endpoint_of = {m: i for i, m in enumerate(routing.spec.model_names)}
        # each model's server answers to its own name (the served model name its facts report)
        self.model_names = [opts.model or f.model or m for f, m in zip(facts, routing.spec.model_names)]
        sizes = sorted({int(f.block_size) for f in facts if f.block_size})
        self._hashers = {bs: IncrementalHasher(bs, max_sessions=1 << 16) for bs in sizes} if opts.predict else {}

    async def send(self, st: RunState, rid: int, session_id: str, prompt: np.ndarray,
                   scheduled_s: float) -> CompletionResult:
        routing = self.routing
        facts = routing.facts[rid]
        first = self.session_router.first_model(facts)
        ep = self.endpoint_of[first]
        # only an answer that can be escalated is checked (not a sticky session's on the large model)
        asks = routing.logprob_column is not None and first == routing.small_model
        fields = {"model": first, "route_reason": "failed before the routing decision"}
        one = await self.post(st, rid, session_id, prompt, scheduled_s, ep, logprobs=asks, defer_success=True,
                              fields=fields)
        res = one.result
        if not res.ok:
            return res
        if first == routing.small_model:  # the checks see the small answer as it came: its signal, its length
            columns = dict(facts.columns)
            if asks and routing.logprob_column is not None:
                columns[routing.logprob_column] = res.mean_logprob
            facts = dataclasses.replace(facts, output_tokens=res.output_tokens, columns=columns)
        atts = self.session_router.attempts(rid, facts)
        if atts[0].model != first:  # a policy must not decide differently once the answer is in
            raise ConfigError(f"request {rid}: the policy sent it to {first}, then decided on {atts[0].model}")
        if len(atts) == 1:
            self._record(st, rid, session_id, one.attempt, ep, scheduled_s, len(prompt), one.predicted,
                         one.max_tokens, res, model=first, route_reason=atts[0].reason, mean_logprob=res.mean_logprob)
            self._keep(rid, session_id, prompt, res)
            return res
        served = atts[-1]
        ep2 = self.endpoint_of[served.model]
        t0 = st.t0
        wasted = {"model": served.model, "route_reason": served.reason, "escalated": True,
                  "mean_logprob": res.mean_logprob, "wasted_model": first, "wasted_cached_tokens": res.cached_tokens,
                  "wasted_predicted_cached_tokens": one.predicted, "wasted_output_tokens": res.output_tokens,
                  "wasted_sent_s": res.sent_s - t0,
                  "wasted_first_token_s": None if res.first_token_s is None else res.first_token_s - t0,
                  "wasted_done_s": None if res.done_s is None else res.done_s - t0}
        two = await self.post(st, rid, session_id, prompt, scheduled_s, ep2, defer_success=True, fields=wasted)
        if two.result.ok:
            self._record(st, rid, session_id, two.attempt, ep2, scheduled_s, len(prompt), two.predicted,
                         two.max_tokens, two.result, **wasted)
            self._keep(rid, session_id, prompt, two.result)
        return two.result

    def _keep(self, rid: int, session_id: str, prompt: np.ndarray, res: CompletionResult) -> None:
        """The served request's hashes as sent and generated, at each model's block size (vLLM caches full
        blocks of the first P+O-1 tokens), for :func:`check_routed_run`."""
        if not self._hashers:
            return
        salt = self._salt[rid]
        P, O = len(prompt), max(len(res.token_ids), 1)
        tokens = np.concatenate([np.asarray(prompt, dtype=np.int32), np.asarray(res.token_ids, dtype=np.int32)])
        self.routing.as_run[rid] = {
            bs: SimRequest(rid, P, O, h.hashes(session_id, tokens, (P + O - 1) // bs, salt), bs,
                           session_id=session_id, cache_salt=salt)
            for bs, h in self._hashers.items()}


def check_routed_run(routing: LiveRouting, records: pd.DataFrame, facts: list[ServerFacts],
                     endpoints: list[str], run_dir: Path) -> RoutingCheckFile | None:
    """The offline routing model on the run's own decisions and ids, beside the servers' ``cached_tokens``;
    written to RUN_DIR/routing.json. None when nothing was kept (predictions off, or a server that reports no
    block size)."""
    import pandas as pd  # deferred: pandas is heavy, importing this module must not load it

    if not routing.as_run or any(not f.block_size for f in facts):
        return None
    spec = routing.spec
    geometry = [m.model_copy(update={"block_size": int(f.block_size or m.block_size), "num_gpu_blocks": f.num_blocks})
                for m, f in zip(spec.models, facts)]
    geo_spec = spec.model_copy(update={"models": geometry})
    ok = records[records["error_class"].isna() & records["model"].notna()].copy()
    ok = ok[ok["request_id"].astype(int).isin(routing.as_run.keys())]
    first_sent = ok["wasted_sent_s"].where(ok["escalated"].astype(bool), ok["sent_s"]).astype(float)
    ok = ok.assign(_first=first_sent).sort_values(["_first", "request_id"], kind="stable")
    facts_run: list[RequestFacts] = []
    attempts: list[list[Attempt]] = []
    by_block: dict[int, list[SimRequest]] = {int(m.block_size): [] for m in geometry}
    for i, r in enumerate(ok.itertuples(index=False)):
        rid = int(r.request_id)
        facts_run.append(RequestFacts(rid, str(r.session_id), int(r.step), None, int(r.prompt_tokens),
                                      int(r.output_tokens)))
        atts = [Attempt(i, str(r.model), True, str(r.route_reason))]
        if bool(r.escalated):
            atts.insert(0, Attempt(i, str(r.wasted_model), False, "small attempt"))
        attempts.append(atts)
        for bs, column in by_block.items():
            column.append(routing.as_run[rid][bs])
    predicted = simulate_routes(attempts, facts_run, by_block, geo_spec)
    rows = []
    served_exact = all_exact = all_n = 0
    for r, p in zip(ok.itertuples(index=False), predicted):
        cached = 0 if pd.isna(r.cached_tokens) else int(r.cached_tokens)  # usage without details: none cached
        row = RoutedRequestCheck(
            request_id=int(r.request_id), session_id=str(r.session_id), step=int(r.step), model=str(r.model),
            reason=str(r.route_reason), escalated=bool(r.escalated), prompt_tokens=int(r.prompt_tokens),
            cached_tokens=cached, predicted_cached_tokens=p.cached_tokens,
            recomputed_tokens=int(r.prompt_tokens) - cached, model_switch_tokens=p.model_switch_tokens)
        served_exact += p.cached_tokens == cached
        all_exact += p.cached_tokens == cached
        all_n += 1
        if row.escalated:
            wc = r.wasted_cached_tokens
            row.wasted_model = str(r.wasted_model)
            row.wasted_cached_tokens = None if pd.isna(wc) else int(wc)
            row.wasted_predicted_cached_tokens = p.small_attempt_cached_tokens
            row.wasted_output_tokens = int(r.wasted_output_tokens)
            all_exact += p.small_attempt_cached_tokens == row.wasted_cached_tokens
            all_n += 1
        rows.append(row)
    n = len(rows)
    out = RoutingCheckFile(
        policy=spec.policy.model_dump(), stickiness=spec.stickiness,
        models=[{"name": m.name, "endpoint": ep, "block_size": m.block_size, "num_gpu_blocks": m.num_gpu_blocks,
                 "pricing": m.pricing} for m, ep in zip(geometry, endpoints)],
        requests=n, escalations=sum(r.escalated for r in rows),
        exact_share=served_exact / n if n else None, exact_share_all_attempts=all_exact / all_n if all_n else None,
        model_switch_tokens=sum(r.model_switch_tokens for r in rows), rows=rows)
    write_routing_file(Path(run_dir) / ROUTING_NAME, out)
    return out


__all__ = ["LiveRouting", "RoutedRequestLoop", "check_routed_run"]
