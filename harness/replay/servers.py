"""The servers of a replay before anything is sent: their backends, their facts, the vocabulary check, the
predictor choice and the prefix-cache reset.

Everything here runs once per replay, before the event loop starts, and speaks to the servers only through
their :class:`~kvscope.harness.serving.backend.Backend` s; what it learns is typed (:class:`ServerFacts`, the
trace's :class:`TraceFile`), and the run reads it through attributes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.replay.options import ReplayOptions
from kvscope.harness.replay.predict import PredictorChoice, choose_predictor
from kvscope.harness.results.summary_parts import ServerFacts
from kvscope.harness.serving.backend import DEFAULT_BACKEND, Backend, load_backend
from kvscope.harness.serving.tls import tls_context
from kvscope.workloads.trace_schema import TraceFile

if TYPE_CHECKING:
    from kvscope.workloads.trace import Trace


@dataclass
class PreparedServers:
    """What :func:`prepare_servers` learned and did: one fact sheet per endpoint (endpoint order), the reset's
    outcome per endpoint (None: no reset asked), why an asked reset failed (None: it did or none was asked), and
    the predictor."""

    facts: list[ServerFacts]
    reset: dict[str, str] | None
    not_reset: str | None
    choice: PredictorChoice


def backends_for(opts: ReplayOptions, endpoints: Sequence[str] | None,
                 server_config_path: str | Path | None) -> list[Backend]:
    """The backend of a server config file (launched by `replay`), or one default backend per given endpoint."""
    if server_config_path is not None:
        return [load_backend(server_config_path)]
    if not endpoints:
        raise KvscopeError("give --endpoint URL (repeatable) or --server CONFIG.yaml")
    backends = [Backend.create(DEFAULT_BACKEND, endpoint=ep, api_key_env=opts.api_key_env) for ep in endpoints]
    try:
        backends[0].auth_headers()  # a missing key fails here, before anything is sent
    except KvscopeError as exc:
        raise KvscopeError(str(exc).replace("api_key_env:", "--api-key-env:")) from None
    return backends


def prepare_servers(trace: "Trace", backends: list[Backend], opts: ReplayOptions, fresh: bool = False,
                    run_dir: Path | None = None) -> PreparedServers:
    """Wait for each server, read its facts, check the vocabulary, choose the predictor (calibrating the
    server if asked), reset the prefix caches if asked. ``fresh``: the servers were launched for this run and
    have served nothing, so a failed reset leaves an empty cache all the same. A calibration taken here fills
    the cache, so the caches are then reset whatever ``reset_prefix_cache`` says, and none counts as fresh."""
    facts = []
    for b in backends:
        b.wait_ready(30.0)
        facts.append(b.facts())
    headers = backends[0].auth_headers()
    check_vocab(trace, facts, [b.endpoint for b in backends], headers)
    choice = choose_predictor(opts, facts, backends, run_dir)
    fresh = fresh and not choice.calibrated_here
    reset, not_reset = reset_prefix_caches(backends, fresh) \
        if opts.reset_prefix_cache or choice.calibrated_here else (None, None)
    return PreparedServers(facts, reset, not_reset, choice)


def reset_prefix_caches(backends: Sequence[Backend], fresh: bool = False) -> tuple[dict[str, str], str | None]:
    """Empty each server's prefix cache through its backend; the outcome per endpoint goes into the manifest.

    A failed reset (vLLM without ``VLLM_SERVER_DEV_MODE=1`` answers 404) is said on stderr at once, one line:
    the run then starts on a warm cache, so the exact model's predictions miss on every request that hits
    what an earlier run left, and summary.json flags it (``data_quality.flags``: ``cache_not_reset``).
    Returns (outcome per endpoint, for the manifest; the failures in one line, or None)."""
    outcomes = {b.endpoint: b.reset_prefix_cache(timeout_s=30) for b in backends}
    if fresh:  # launched for this run: nothing was served yet, the cache is empty without a reset
        return {ep: o.detail + ("" if o.ok else "; a fresh server, empty anyway") for ep, o in outcomes.items()}, None
    failed = [f"{ep}: {o.detail}" for ep, o in outcomes.items() if not o.ok]
    if failed:
        print(f"kvscope: warning: prefix cache not reset ({'; '.join(failed)}): the run starts on whatever "
              "earlier requests left cached, so measured hit rates may exceed the predicted ones; summary.json "
              "is flagged cache_not_reset", file=sys.stderr, flush=True)
    return {ep: o.detail for ep, o in outcomes.items()}, "; ".join(failed) or None


def trace_header(trace: "Trace") -> TraceFile:
    """The trace's ``trace.json`` as its model (``Trace.meta`` is the model's dump, kept a dict for the
    generators that build it incrementally)."""
    return TraceFile.model_validate(trace.meta)


def vocab_limits(header: TraceFile, facts: Sequence[ServerFacts], endpoints: Sequence[str],
                 headers: dict[str, str]) -> list[tuple[int, str]]:
    """Every known vocabulary size with where it came from: the trace's tokenizer, the config.json of a model
    directory kvscope launched, and a `vocab_size` field in `/v1/models` where an endpoint exposes one."""
    import httpx  # deferred: a heavy import that only this optional look-up needs

    out: list[tuple[int, str]] = []
    if header.tokenizer is not None and header.tokenizer.vocab_size:
        out.append((int(header.tokenizer.vocab_size), "the trace's tokenizer (trace.json tokenizer.vocab_size)"))
    eps = list(endpoints)
    for i, f in enumerate(facts):
        ep = eps[i] if i < len(eps) else None
        model = f.config.get("model") if f.config else None  # the launch config: the engine's own keys
        if model and Path(model).is_dir() and (Path(model) / "config.json").exists():
            try:
                cfg = json.loads((Path(model) / "config.json").read_text())  # Hugging Face's, open
                text_config = cfg.get("text_config")  # a multimodal model's language part
                v = cfg.get("vocab_size") or (text_config.get("vocab_size") if isinstance(text_config, dict)
                                              else None)
                if v:
                    out.append((int(v), f"the served model's {Path(model) / 'config.json'}"))
            except (OSError, ValueError):
                pass
        if ep is None:
            continue
        try:
            r = httpx.get(ep.rstrip("/") + "/v1/models", headers=headers, timeout=10, verify=tls_context())
            if r.status_code == 200:
                for card in r.json().get("data") or []:
                    if isinstance(card, dict) and card.get("vocab_size"):
                        out.append((int(card["vocab_size"]), f"{ep}/v1/models vocab_size"))
                        break
        except Exception:  # noqa: BLE001 - optional information
            pass
    return out


def check_vocab(trace: "Trace", facts: Sequence[ServerFacts], endpoints: Sequence[str] = (),
                headers: dict[str, str] | None = None) -> None:
    """Token ids outside the model's vocabulary would be rejected one by one; catch them before sending."""
    if not len(trace.seg_tokens):
        return
    toks = trace.seg_tokens
    lo, top = int(toks.min()), int(toks.max())
    limits = vocab_limits(trace_header(trace), facts, endpoints, headers or {})
    bad_vocab = [(v, src) for v, src in limits if top >= v]
    if lo >= 0 and not bad_vocab:
        return
    if bad_vocab:
        vocab, src = min(bad_vocab)
        bad = np.flatnonzero(toks >= vocab)
    else:
        vocab, src = 0, "token ids must be non-negative"
        bad = np.flatnonzero(toks < 0)
    seg = int(np.searchsorted(trace.seg_offsets, bad[0], side="right") - 1)
    users = [i for i in range(trace.num_requests) if seg in set(trace.prompt_segment_ids(i).tolist())][:3]
    where = f"segment {seg}" + (f", used by request(s) {users}" if users else "")
    what = f"vocabulary of {vocab} from {src}" if bad_vocab else src
    raise KvscopeError(f"trace has {len(bad)} token id(s) outside the model's vocabulary (first: id "
                       f"{int(toks[bad[0]])} in {where}); {what}. Nothing was sent.")
