"""The workload spec: a YAML file, validated by pydantic, that describes the traffic of a chat or agent app.

Validation errors are turned into :class:`SpecError` messages that name the file, the field path and the
allowed values, because a spec is hand-written and the raw pydantic output is hard to read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from kvscope.workloads.distributions import DISTRIBUTION_KINDS, Distribution, Empirical, coerce_distribution
from kvscope.workloads.policies import Policy, policy_kinds, policy_models

Dist = Annotated[Distribution, BeforeValidator(coerce_distribution)]
_BASE = ConfigDict(extra="forbid", validate_default=True)


from kvscope.workloads.errors import WorkloadError
from kvscope.workloads.presets import list_presets, preset_path


class SpecError(WorkloadError):
    """A spec that cannot be used; the message names the file, the field and what is allowed."""


def _const(v: float) -> Any:
    return coerce_distribution(v)


class DocumentSpec(BaseModel):
    """Shared documents (RAG context, a repository map) placed after the system prompt and tools."""

    model_config = _BASE
    count: int = Field(default=1, ge=1, description="distinct documents in the pool")
    tokens: Dist = Field(description="document length")
    popularity_a: float = Field(default=1.0, ge=0, description="Zipf exponent of document popularity")
    probability: float = Field(default=1.0, ge=0, le=1, description="share of sessions that include one")


class PrefixSpec(BaseModel):
    """What sessions share: N tenants, each with its own system prompt and tool definitions."""

    model_config = _BASE
    tenants: int = Field(default=1, ge=1, description="distinct system prompts / tenants")
    tenant_popularity_a: float = Field(default=1.0, ge=0, description="Zipf exponent of tenant popularity")
    system_tokens: Dist = Field(default=_const(500), description="system prompt length, per tenant")
    tools_tokens: Dist = Field(default=_const(0), description="tool definitions length, per tenant")
    tool_count: int = Field(default=8, ge=1, description="the tool block is split into this many definitions")
    documents: DocumentSpec | None = None


class ChatSpec(BaseModel):
    """Chat sessions: user message → assistant answer, ``turns`` times."""

    model_config = _BASE
    turns: Dist = Field(default=_const(4), description="requests per session (>= 1)")
    user_tokens: Dist = Field(default=_const(200))
    output_tokens: Dist = Field(default=_const(300))
    reasoning_tokens: Dist = Field(default=_const(0), description="leading reasoning part of each output")
    think_time_s: Dist = Field(default=_const(10.0), description="user think time before each later turn")


class AgentSpec(BaseModel):
    """Agent loops: task → (assistant tool call → tool result)* → final answer; a session may continue with
    further user messages (each again followed by tool steps)."""

    model_config = _BASE
    calls: Dist = Field(default=_const(20), description="LLM calls (requests) per session (>= 1)")
    task_tokens: Dist = Field(default=_const(200), description="first user message")
    user_turn_probability: float = Field(
        default=0.0, ge=0, le=1,
        description="probability that a later call starts with a new user message (the previous call ended its "
                    "turn with a final answer) instead of a tool result")
    user_tokens: Dist = Field(default=_const(200), description="later user messages")
    tool_call_tokens: Dist = Field(default=_const(100), description="assistant output of a tool-calling step")
    reasoning_tokens: Dist = Field(default=_const(0), description="leading reasoning part of each output")
    final_answer_tokens: Dist = Field(default=_const(300), description="assistant output ending a turn")
    tool_output_tokens: Dist = Field(default=_const(500), description="tool result appended after a call")
    tool_latency_s: Dist = Field(default=_const(1.0), description="tool execution time before a tool result")
    think_time_s: Dist = Field(default=_const(10.0), description="user think time before a new user message")


class SessionsSpec(BaseModel):
    model_config = _BASE
    count: int = Field(default=10, ge=1, description="number of sessions")
    kind: Literal["chat", "agent"] = "chat"
    chat: ChatSpec = Field(default_factory=ChatSpec)
    agent: AgentSpec = Field(default_factory=AgentSpec)
    policies: list[Policy] = Field(default_factory=list, description="history policies, applied in order")
    cache_salt: Literal["none", "session", "tenant"] = Field(
        default="none", description="send a cache_salt per session or per tenant (isolates their caches)")


class ArrivalSpec(BaseModel):
    """When sessions start. Open loop: Poisson (cv = 1) or gamma inter-arrivals (cv > 1 is bursty) at
    ``rate`` sessions/s. Closed loop: ``concurrency`` sessions run at once and a new one starts when one
    ends (planned with zero service time; the replayer enforces the concurrency live)."""

    model_config = _BASE
    kind: Literal["poisson", "gamma", "closed_loop", "all_at_once"] = "poisson"
    rate: float = Field(default=1.0, gt=0, description="sessions per second (open loop)")
    cv: float = Field(default=1.0, gt=0, description="coefficient of variation of gaps (gamma)")
    concurrency: int = Field(default=4, ge=1, description="sessions in flight (closed loop)")


class LimitsSpec(BaseModel):
    """Where sessions stop. ``context_window_tokens`` is the agent's own window (scaled with ``scale``);
    ``max_context_tokens`` is the server's ``max_model_len`` (not scaled)."""

    model_config = _BASE
    context_window_tokens: int | None = Field(
        default=None, ge=1, description="end a session when prompt + output would exceed this (scaled)")
    max_context_tokens: int | None = Field(
        default=None, ge=1,
        description="end a session before a request whose prompt + output would exceed this (server max_model_len)")


class WorkloadSpec(BaseModel):
    """Top level of a workload YAML file."""

    model_config = _BASE
    name: str = "workload"
    description: str = ""
    seed: int = 0
    scale: float = Field(default=1.0, gt=0, description="multiplies every token size (not counts or times)")
    output_scale: float | None = Field(default=None, gt=0, description="multiplies output sizes (assistant "
                                       "answers, tool calls, reasoning) instead of `scale`: small CPU runs keep "
                                       "outputs long enough for decode and speculation metrics")
    text: bool = Field(default=False, description="text mode: also render each request as chat messages through "
                                                  "the model's chat template (prompts then include template tokens)")
    sessions: SessionsSpec = Field(default_factory=SessionsSpec)
    prefix: PrefixSpec = Field(default_factory=PrefixSpec)
    arrival: ArrivalSpec = Field(default_factory=ArrivalSpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)

    @model_validator(mode="after")
    def _check(self) -> "WorkloadSpec":
        return self


# ------------------------------------------------------------------------------------------ loading


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in policy_kinds() or part in DISTRIBUTION_KINDS or part.startswith("function-"):
            continue  # pydantic's union-member tag, not a field the user wrote
        else:
            out += ("." if out else "") + str(part)
    return out


def _fields_at(loc: tuple) -> list[str] | None:
    """Field names of the model that a location points into, for 'unknown field' messages."""
    distributions = get_args(get_args(Distribution)[0])
    tags = {**policy_models(), **{get_args(m.model_fields["kind"].annotation)[0]: m for m in distributions}}
    model: Any = WorkloadSpec
    for part in loc:
        if isinstance(part, int) or part.startswith("function-"):
            continue
        if part in tags:
            model = tags[part]
            continue
        f = getattr(model, "model_fields", {}).get(part)
        if f is None:
            return None
        ann = f.annotation
        for cand in (ann, *getattr(ann, "__args__", ())):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                model = cand
                break
            inner = getattr(cand, "__args__", ())
            sub = [c for c in inner if isinstance(c, type) and issubclass(c, BaseModel)]
            if sub:
                model = sub[0]
                break
        else:
            model = None
    if model is None or not hasattr(model, "model_fields"):
        return None
    return [f.alias or n for n, f in model.model_fields.items() if not f.exclude]


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = _loc(tuple(e["loc"]))
        typ, ctx = e["type"], e.get("ctx", {})
        if typ == "union_tag_invalid":
            what = "policy" if "policies" in loc else ("arrival" if "arrival" in loc else "distribution")
            allowed = ", ".join(policy_kinds() if what == "policy" else DISTRIBUTION_KINDS)
            msg = f"unknown {what} {ctx.get('tag')!r}; allowed: {allowed}"
            loc = f"{loc}.kind" if loc else "kind"
        elif typ == "union_tag_not_found":
            allowed = ", ".join(policy_kinds() if "policies" in loc else DISTRIBUTION_KINDS)
            msg = f"missing 'kind'; allowed: {allowed}"
        elif typ == "literal_error":
            msg = f"invalid value {e.get('input')!r}; allowed: {ctx.get('expected', '').replace(' or ', ', ')}"
        elif typ == "extra_forbidden":
            fields = _fields_at(tuple(e["loc"])[:-1])
            msg = "unknown field" + (f"; allowed: {', '.join(fields)}" if fields else "")
        elif typ == "missing":
            msg = "required field is missing"
        else:
            msg = f"{e['msg']} (got {e.get('input')!r})"
        lines.append(f"{source}: {loc or '<top>'}: {msg}")
    return "\n".join(lines)


def _set_base_dir(obj: Any, base: str) -> None:
    """Empirical distributions read files relative to the spec file."""
    if isinstance(obj, Empirical):
        object.__setattr__(obj, "base_dir", base)
    elif isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            _set_base_dir(getattr(obj, name), base)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _set_base_dir(x, base)


def parse_spec(data: Any, source: str = "<spec>", base_dir: str | Path | None = None) -> WorkloadSpec:
    """Validate a spec given as a dict; raise :class:`SpecError` with readable messages."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: <top>: expected a mapping, got {type(data).__name__}")
    try:
        spec = WorkloadSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, source)) from None
    if base_dir is not None:
        _set_base_dir(spec, str(base_dir))
    return spec


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _resolve(path: str | Path, seen: tuple = ()) -> tuple[Path, dict]:
    p = Path(path)
    if not p.exists():
        q = preset_path(str(path))
        if q is None:
            raise SpecError(f"{path}: no such file or preset; presets: {', '.join(list_presets())}")
        p = q
    if p.resolve() in seen:
        raise SpecError(f"{p.name}: extends: cycle through {p}")
    if p.is_dir():
        raise SpecError(f"{path}: is a directory; a workload spec is a YAML file or a preset name")
    try:
        data = yaml.safe_load(p.read_text())
    except UnicodeDecodeError as err:
        raise SpecError(f"{path}: a workload spec is a YAML text file; this is not UTF-8 text (byte {err.start})") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{p.name}: invalid YAML: {err}") from None
    if isinstance(data, dict) and "extends" in data:
        parent = str(data.pop("extends"))
        cand = p.parent / parent
        _, base = _resolve(cand if cand.exists() else parent, (*seen, p.resolve()))
        data = _deep_merge(base, data)
    return p, data


def load_spec(path: str | Path) -> WorkloadSpec:
    """Read and validate a YAML spec file or a preset name. ``extends: NAME_OR_PATH`` at the top of a spec
    deep-merges it over another spec (mappings merge, lists such as ``policies`` are replaced)."""
    p, data = _resolve(path)
    return parse_spec(data, source=p.name, base_dir=p.parent)


def spec_to_dict(spec: WorkloadSpec) -> dict:
    return spec.model_dump(mode="json", by_alias=True)
