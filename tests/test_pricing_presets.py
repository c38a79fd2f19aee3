"""Provider presets are dated and sourced; a TTL is priced at that TTL's own write rate."""

from __future__ import annotations

import datetime as dt

import pytest
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.pricing.provider_cache import list_presets, load_preset, simulate_provider


@pytest.mark.parametrize("name", [n for n in list_presets() if n != "seed-illustrative"])
def test_every_provider_preset_says_when_and_where_it_was_read(name):
    cfg = load_preset(name)
    assert dt.date.fromisoformat(cfg.read_on) <= dt.date(2026, 12, 1)
    assert cfg.sources and all(s.startswith("https://") for s in cfg.sources)
    assert cfg.read_on in cfg.notes  # the notes say what was read that day
    assert cfg.usage_fields


def test_one_hour_on_the_five_minute_preset_is_priced_at_the_one_hour_write_rate():
    five = load_preset("anthropic-sonnet-5m")
    hour = load_preset("anthropic-sonnet-1h")
    assert five.for_ttl(3600).pricing == hour.pricing
    assert hour.for_ttl(300).pricing == five.pricing
    assert five.for_ttl(60).pricing.cache_write_multiplier == 1.25  # the smallest TTL sold that covers it
    assert load_preset("openai-gpt-4.1").for_ttl(3600).pricing == load_preset("openai-gpt-4.1").pricing


def test_ttl_sweep_cost_at_one_hour_matches_the_one_hour_preset():
    reqs = [SimRequest(request_id=i, arrival_s=600.0 * i, prompt_tokens=2048, output_tokens=10,
                       hashes=list(range(2048 // 16)), block_size=16, session_id="s") for i in range(4)]
    swept = simulate_provider(reqs, load_preset("anthropic-sonnet-5m").for_ttl(3600))[1]["total_usd"]
    direct = simulate_provider(reqs, load_preset("anthropic-sonnet-1h"))[1]["total_usd"]
    assert swept == pytest.approx(direct)


def test_newer_models_charge_for_cache_writes_and_have_larger_minimums():
    assert load_preset("openai-gpt-5.6").pricing.cache_write_multiplier == 1.25
    assert "input_tokens_details.cache_write_tokens" in load_preset("openai-gpt-5.6").usage_fields
    assert load_preset("gemini-2.5-flash-implicit").min_prefix_tokens == 2048
    assert load_preset("gemini-3.5-flash-implicit").min_prefix_tokens == 4096
