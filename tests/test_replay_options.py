"""Replay options have one definition: the CLI's flags and an experiment's ``replay:`` section take their
defaults from ReplayOptions, so the three cannot drift apart again."""

from __future__ import annotations

import pytest

from kvscope.harness.cli.main import build_parser
from kvscope.harness.cli.replay import options_from_args
from kvscope.harness.common.errors import ConfigError
from kvscope.harness.experiment.spec import PER_CELL_OPTIONS, ReplaySettings, load_experiment_spec
from kvscope.harness.replay.options import ReplayOptions

BASE_ARGS = ["replay", "trace", "--endpoint", "http://127.0.0.1:1", "--out", "run"]


def _replay_parser():
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices["replay"]  # type: ignore[union-attr]


def test_cli_defaults_equal_the_model_defaults():
    args = build_parser().parse_args(BASE_ARGS)
    assert options_from_args(args) == ReplayOptions()
    flagged = {a.dest: a for a in _replay_parser()._actions if a.dest in ReplayOptions.model_fields}
    assert len(flagged) >= 30
    for dest, action in flagged.items():
        assert action.default == ReplayOptions.model_fields[dest].default, dest


def test_cli_flags_reach_the_model():
    args = build_parser().parse_args([*BASE_ARGS, "--request-timeout", "7", "--scrape-interval", "0.25",
                                      "--time-scale", "0", "--no-progress", "--routing", "prefix_hash",
                                      "--concurrency", "3"])
    opts = options_from_args(args)
    assert (opts.total_timeout_s, opts.scrape_interval_s, opts.time_scale) == (7.0, 0.25, 0.0)
    assert (opts.progress, opts.routing, opts.concurrency) == (False, "prefix-hash", 3)  # underscores: an alias
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="routing"):  # policy names are checked by the model, not argparse
        options_from_args(build_parser().parse_args([*BASE_ARGS, "--routing", "no-such-policy"]))


def test_experiment_replay_section_shares_the_defaults():
    shared = ReplaySettings().cell_options(concurrency=2)
    assert shared == ReplayOptions(concurrency=2)
    opts = ReplaySettings(time_scale=0, client="aiohttp", total_timeout_s=5).cell_options(seed=3)
    assert (opts.time_scale, opts.client, opts.total_timeout_s, opts.seed) == (0, "aiohttp", 5, 3)


@pytest.mark.parametrize("field", sorted(PER_CELL_OPTIONS))
def test_experiment_replay_section_rejects_per_cell_fields(tmp_path, field):
    p = tmp_path / "exp.yaml"
    p.write_text(f"name: x\nservers: {{a: {{}}}}\nworkloads: {{w: {{spec: chat}}}}\nreplay: {{{field}: 1}}\n")
    with pytest.raises(ConfigError, match=f"{p}: replay: .*{field} is set per cell by"):
        load_experiment_spec(p)


def test_experiment_replay_section_unknown_field_lists_allowed(tmp_path):
    p = tmp_path / "exp.yaml"
    p.write_text("name: x\nservers: {a: {}}\nworkloads: {w: {spec: chat}}\nreplay: {request_timeout_s: 9}\n")
    with pytest.raises(ConfigError, match=r"replay.request_timeout_s: unknown field; allowed: .*total_timeout_s"):
        load_experiment_spec(p)
