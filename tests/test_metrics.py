import math
from pathlib import Path

import pytest

from kvscope.harness.serving.metrics import MetricsParseError, metrics_delta, parse_metrics

DATA = Path(__file__).parent / "data"


def _text(queries, hits, drafts=0, draft_tokens=0, accepted=0, per_pos=(), old_names=False, ttft_counts=(0, 0, 0)):
    q = "vllm:gpu_prefix_cache_queries" if old_names else "vllm:prefix_cache_queries"
    h = "vllm:gpu_prefix_cache_hits" if old_names else "vllm:prefix_cache_hits"
    lines = [
        f"# TYPE {q} counter", f'{q}_total{{engine="0",model_name="m"}} {queries}',
        f"# TYPE {h} counter", f'{h}_total{{engine="0",model_name="m"}} {hits}',
        "# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{engine="0",model_name="m"} 3',
        "# TYPE vllm:spec_decode_num_drafts counter", f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft_tokens}',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
    ]
    for i, v in enumerate(per_pos):
        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {v}')
    lines += ["# TYPE vllm:time_to_first_token_seconds histogram"]
    for le, c in zip(("0.1", "1.0", "+Inf"), ttft_counts):
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",model_name="m"}} {c}')
    lines += [f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {ttft_counts[-1]}',
              f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {0.5 * ttft_counts[-1]}']
    return "\n".join(lines) + "\n"


def test_real_vllm_032_scrape_parses_with_facts_and_spec_counters():
    snap = parse_metrics((DATA / "metrics_vllm032_ngram.txt").read_text())
    info = snap.info_labels("vllm:cache_config_info")
    assert info["block_size"] == "128" and info["num_gpu_blocks"] == "128"
    assert info["enable_prefix_caching"] == "False"
    assert snap.value("vllm:spec_decode_num_drafts_total") == 14
    assert snap.by_label("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position") == {"0": 14, "1": 12, "2": 12}
    assert snap.types["vllm:prefix_cache_queries"] == "counter"


def test_delta_derives_hit_rate_and_speculative_acceptance():
    a = parse_metrics(_text(100, 20, drafts=10, draft_tokens=30, accepted=12, per_pos=(6, 4, 2), ttft_counts=(1, 2, 2)))
    b = parse_metrics(_text(600, 420, drafts=30, draft_tokens=90, accepted=42, per_pos=(20, 14, 8), ttft_counts=(3, 6, 7)))
    d = metrics_delta(a, b)
    assert d.prefix_cache_queries == 500 and d.prefix_cache_hits == 400
    assert d.prefix_cache_hit_rate == pytest.approx(0.8)
    assert d.spec_acceptance_rate == pytest.approx(30 / 60)
    assert d.spec_mean_acceptance_length == pytest.approx(1 + 30 / 20)
    assert d.accepted_per_position == [14, 10, 6]
    assert d.spec_acceptance_by_position == pytest.approx([0.7, 0.5, 0.3])
    h = d.histograms["vllm:time_to_first_token_seconds"]
    assert h.count == 5 and h.buckets == {0.1: 2, 1.0: 4, math.inf: 5}
    assert not d.reset_detected


def test_old_gpu_prefixed_names_are_read_as_current_ones():
    a = parse_metrics(_text(10, 0, old_names=True))
    b = parse_metrics(_text(50, 32, old_names=True))
    d = metrics_delta(a, b)
    assert (d.prefix_cache_queries, d.prefix_cache_hits) == (40, 32)


def test_counter_going_backwards_is_flagged_as_a_restart():
    d = metrics_delta(parse_metrics(_text(500, 100)), parse_metrics(_text(20, 0)))
    assert d.reset_detected


def test_no_speculation_gives_nan_not_zero_division():
    d = metrics_delta(parse_metrics(_text(1, 0)), parse_metrics(_text(2, 0)))
    assert math.isnan(d.spec_acceptance_rate) and d.to_dict()["spec_acceptance_rate"] is None


def test_histogram_quantile_interpolates_within_bucket():
    snap = parse_metrics(_text(0, 0, ttft_counts=(50, 100, 100)))
    h = snap.histogram("vllm:time_to_first_token_seconds")
    assert h.quantile(0.5) == pytest.approx(0.1)
    assert h.quantile(0.75) == pytest.approx(0.1 + 0.9 * 0.5)


def test_garbage_is_a_clear_parse_error():
    with pytest.raises(MetricsParseError, match="not a Prometheus metrics text"):
        parse_metrics('vllm:x{engine="0" 1\n')


def test_endpoints_pool_into_one_deltas_rates_and_breakdowns():
    """Several endpoints' deltas pooled by ``combine_deltas`` (what a multi-endpoint replay's summary holds):
    counters, per-position acceptances and histograms summed, the rates those of the sums, not of one server."""
    from kvscope.harness.serving.metrics import combine_deltas

    a = metrics_delta(parse_metrics(_text(0, 0)), parse_metrics(_text(100, 80, 10, 30, 15, (8, 5, 2), ttft_counts=(1, 2, 2))))
    b = metrics_delta(parse_metrics(_text(0, 0)), parse_metrics(_text(300, 60, 30, 90, 15, (10, 4, 1), ttft_counts=(0, 3, 4))))
    both = combine_deltas([a, b])
    assert (both.prefix_cache_queries, both.prefix_cache_hits) == (400, 140)
    assert both.prefix_cache_hit_rate == pytest.approx(140 / 400)  # pooled, not the mean of 0.8 and 0.2
    assert both.spec_acceptance_rate == pytest.approx(30 / 120)
    assert both.spec_mean_acceptance_length == pytest.approx(1 + 30 / 40)
    assert both.accepted_per_position == [18, 9, 3]
    assert both.spec_acceptance_by_position == pytest.approx([18 / 40, 9 / 40, 3 / 40])
    ttft = both.histograms["vllm:time_to_first_token_seconds"]
    assert (ttft.count, list(ttft.buckets.values())) == (6, [1, 5, 6])
    assert combine_deltas([a]).to_dict() == a.to_dict()
