"""SWE-agent trajectories (``*.traj``, one JSON document) → model calls.

Two layouts exist. Since 2025 every ``trajectory[]`` step carries ``messages``: the history as it stood after
that step, OpenAI chat format, with the step's own assistant message (and its observation) at the end; the
prompt of step i is that list up to its last assistant message, which keeps SWE-agent's history processors
(older observations rewritten as "Old environment output: (N lines omitted)") exactly as sent. The 2024 layout
has no per-step messages; the calls are the assistant messages of the final ``history[]``, each sent with the
history before it (demonstrations, ``is_demo``, included: they were sent).

No timestamps: requests carry no arrival time, and a step's ``execution_time`` (the tool's run time, new
layout) becomes the next call's ``tool_latency_s``. Usage is aggregate only (``info.model_stats``:
``tokens_sent``, ``tokens_received``, ``api_calls``) and goes to trace.json, not to the per-call columns.
"""

from __future__ import annotations

from pathlib import Path

from kvscope.workloads.errors import TraceFileError
from kvscope.workloads.importers.agent import ModelCall, calls_to_trace
from kvscope.workloads.importers.openai_chat import chat_message
from kvscope.workloads.importers.sniff import read_json_document
from kvscope.workloads.trace import Trace
from kvscope.workloads.trace_schema import SegmentKind


def _load(p: Path) -> dict:
    data = read_json_document(p, "swe-agent")
    if not isinstance(data, dict) or not isinstance(data.get("trajectory"), list):
        raise TraceFileError(f"{p}: not a SWE-agent trajectory (expected an object with a `trajectory` list)")
    return data


def _split_at_last_assistant(msgs: list[dict]) -> tuple[list[dict], dict | None]:
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].get("role") == "assistant":
            return msgs[:i], msgs[i]
    return msgs, None


def read_swe_agent(path: str | Path) -> list[ModelCall]:
    p = Path(path)
    data = _load(p)
    steps = data["trajectory"]
    session = p.stem
    calls: list[ModelCall] = []
    if steps and all(isinstance(s, dict) and isinstance(s.get("messages"), list) for s in steps):
        prev_exec = None
        for i, step in enumerate(steps):
            prompt, answer = _split_at_last_assistant(step["messages"])
            if answer is None:
                raise TraceFileError(f"{p}: trajectory step {i}: `messages` holds no assistant message")
            # after the task every input is an observation
            kind = SegmentKind.USER if i == 0 else SegmentKind.TOOL_OUTPUT
            calls.append(ModelCall(session, [chat_message(m) for m in prompt], chat_message(answer).content,
                                   input_kind=kind, tool_latency_s=prev_exec))
            prev_exec = float(step["execution_time"]) if step.get("execution_time") not in (None, "") else None
        return calls
    history = data.get("history")
    if not isinstance(history, list):
        raise TraceFileError(f"{p}: trajectory steps carry no `messages` and there is no `history` list")
    for i, m in enumerate(history):
        if not isinstance(m, dict) or "role" not in m:
            raise TraceFileError(f"{p}: history[{i}]: expected a message object with a `role`")
        if m["role"] == "assistant":
            calls.append(ModelCall(session, [chat_message(x) for x in history[:i]], chat_message(m).content,
                                   input_kind=SegmentKind.USER if not calls else SegmentKind.TOOL_OUTPUT))
    return calls


def import_swe_agent(path: str | Path, tokenizer: str | Path) -> Trace:
    p = Path(path)
    stats = (_load(p).get("info") or {}).get("model_stats") or {}
    return calls_to_trace(read_swe_agent(p), tokenizer, name=p.stem, importer="swe-agent", source=p,
                          extra_meta={"observed_totals": {k: stats[k] for k in ("tokens_sent", "tokens_received",
                                                                                 "api_calls") if k in stats},
                                      "not_recorded": ["timestamps", "per-call usage"]})
