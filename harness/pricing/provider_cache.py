"""Provider prompt-cache model (Anthropic, OpenAI, Gemini implicit, DeepSeek style).

Unlike vLLM's block pool a provider cache is modelled as *entries* keyed by a prefix hash, each with an
expiry time: written entries live ``ttl_s``; a hit refreshes them if ``refresh_on_hit``.  Two modes:

* ``automatic`` (OpenAI, Gemini implicit, DeepSeek): every prefix of a cacheable prompt becomes an entry;
  a request reads the longest live cached prefix, floored to ``granularity_tokens``; the rest of the
  cacheable part is written (billed at ``cache_write_multiplier``, 1.0 for most automatic providers).
* ``breakpoints`` (Anthropic ``cache_control``): entries only at the request's breakpoints (default: the
  end of the prompt); a request reads the longest live entry that is a prefix of it, writes from there
  to its last breakpoint, and the tokens after the last breakpoint are plain input.  (Anthropic's
  20-block look-back limit is not modelled.)

Prompts shorter than ``min_prefix_tokens`` are neither read nor written.  Time comes from the trace
(``arrival_s``), so think times drive expiry.  Requests are :class:`SimRequest` s whose ``hashes`` are
chained hashes of ``block_size``-token units; hits are multiples of the unit, floored to the granularity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Literal

import yaml
from pydantic import BaseModel

from kvscope.harness.pricing.cost import Pricing, TokenSplit, summarize_splits
from kvscope.harness.cachemodel.sim_types import SimRequest

PRESET_DIR = Path(__file__).with_name("presets")


class ProviderCacheConfig(BaseModel):
    """One provider's caching rules and prices, as read from its pages on `read_on` (`sources`)."""

    name: str
    provider: str = ""
    model: str = ""
    as_of: str = ""
    read_on: str = ""  # ISO date the source pages were read
    source: str = ""
    sources: list[str] = []  # every page read for this preset
    notes: str = ""
    mode: Literal["automatic", "breakpoints"] = "automatic"
    ttl_s: float | None = 300.0  # None = never expires
    refresh_on_hit: bool = True
    min_prefix_tokens: int = 1024
    granularity_tokens: int = 1
    # Usage fields the provider's API reports (e.g. OpenAI gpt-5.6+: cached_tokens and cache_write_tokens).
    usage_fields: list[str] = []
    # Write price by TTL where the provider sells several (Anthropic: {300: 1.25, 3600: 2.0}); `for_ttl` uses it.
    write_multiplier_by_ttl_s: dict[float, float] = {}
    pricing: Pricing

    def for_ttl(self, ttl_s: float | None) -> "ProviderCacheConfig":
        """This preset with another TTL, priced at that TTL's write rate: the rate of the smallest sold TTL that
        covers it (so 1 h is never priced at the 5-minute rate); unchanged prices where none is listed."""
        update: dict = {"ttl_s": ttl_s}
        tiers = sorted(self.write_multiplier_by_ttl_s.items())
        if tiers:
            covering = [m for t, m in tiers if ttl_s is not None and t >= ttl_s]
            mult = covering[0] if covering else tiers[-1][1]
            update["pricing"] = self.pricing.model_copy(update={"cache_write_multiplier": mult})
        return self.model_copy(update=update)


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name_or_path: str) -> ProviderCacheConfig:
    """A preset by name (``presets/<name>.yaml``) or a YAML file path."""
    p = Path(name_or_path)
    if not p.exists():
        p = PRESET_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        raise ValueError(f"unknown pricing preset {name_or_path!r}; known: {', '.join(list_presets())}")
    return ProviderCacheConfig.model_validate(yaml.safe_load(p.read_text()))


class ProviderCache:
    """Entry store with expiry; one per provider account/org."""

    def __init__(self, cfg: ProviderCacheConfig) -> None:
        self.cfg = cfg
        self.expiry: dict[int, float] = {}

    def _live(self, h: int, t: float) -> bool:
        e = self.expiry.get(h)
        return e is not None and e >= t

    def request(self, req: SimRequest, t: float | None = None) -> TokenSplit:
        cfg = self.cfg
        t = req.arrival_s if t is None else t
        u, g, P = req.block_size, max(cfg.granularity_tokens, 1), req.prompt_tokens
        h = req.hashes[: P // u]
        ttl = float("inf") if cfg.ttl_s is None else cfg.ttl_s
        if P < cfg.min_prefix_tokens:
            return TokenSplit(uncached_input=P, output=req.output_tokens)
        if cfg.mode == "automatic":
            k = 0
            for x in h:
                if not self._live(x, t):
                    break
                k += 1
            hit = (k * u // g) * g
            if hit < cfg.min_prefix_tokens:
                hit = 0
            end = (P // g) * g  # cacheable part
            written_units = (end // u)
            for x in h[: min(hit // u, written_units)] if cfg.refresh_on_hit else ():
                self.expiry[x] = t + ttl
            for x in h[hit // u: written_units]:
                self.expiry[x] = t + ttl
            write = max(0, end - hit)
            return TokenSplit(P - hit - write, write, hit, req.output_tokens)
        # breakpoints
        bps = sorted(b for b in (req.breakpoints or [P]) if 0 < b <= P)
        bp_units = [b // u for b in bps if b // u > 0]
        k = 0
        for j in range(len(h), 0, -1):
            if self._live(h[j - 1], t):
                k = j
                break
        hit = (k * u // g) * g
        if hit < cfg.min_prefix_tokens:
            hit = 0
        if hit and cfg.refresh_on_hit:
            self.expiry[h[hit // u - 1]] = t + ttl
        last = 0
        for j in bp_units:
            if j * u >= cfg.min_prefix_tokens and j * u > hit:
                self.expiry[h[j - 1]] = t + ttl
                last = j * u
            elif j * u <= hit and cfg.refresh_on_hit:
                self.expiry[h[j - 1]] = max(self.expiry.get(h[j - 1], 0.0), t + ttl)
        write = max(0, last - hit)
        return TokenSplit(P - hit - write, write, hit, req.output_tokens)


def simulate_provider(requests: Iterable[SimRequest], cfg: ProviderCacheConfig) -> tuple[list[TokenSplit], dict]:
    """Run requests in order (times from ``arrival_s``); per-request splits and a cost summary."""
    cache = ProviderCache(cfg)
    reqs = list(requests)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    splits: list[TokenSplit] = [TokenSplit()] * len(reqs)
    for i in order:
        splits[i] = cache.request(reqs[i])
    summary = summarize_splits(splits, cfg.pricing)
    summary["preset"] = cfg.name
    total_in = summary["uncached_input_tokens"] + summary["cache_write_tokens"] + summary["cache_read_tokens"]
    summary["cache_read_ratio"] = summary["cache_read_tokens"] / total_in if total_in else 0.0
    per: dict[str, list[TokenSplit]] = {}
    for r, s in zip(reqs, splits):
        if r.session_id is not None:
            per.setdefault(r.session_id, []).append(s)
    if per:
        costs = [summarize_splits(v, cfg.pricing)["total_usd"] for v in per.values()]
        summary["sessions"] = len(per)
        summary["mean_session_usd"] = sum(costs) / len(costs)
    return splits, summary
