"""A calibration must make physical sense, and a relative SLO must be finite (issue 40, item 5): all-zero step
costs predicted "capacity 32 at 0 ms", costs of 1e300, a ``max_num_seqs`` of 1e12 and a cost written as a
string were accepted, 400 nines ``x_unloaded`` resolved to ``inf ms``, and ``1.0000001x_unloaded`` printed as
"1x"."""

from __future__ import annotations

import pytest

from tests.offline.test_scheduler import _calibration_file, _sessions_trace


@pytest.mark.parametrize("edit,named", [
    # every step cost zero: a step takes no time
    ({"cost": {"base_s": 0.0, "per_token_s": 0.0, "per_seq_s": 0.0, "per_context_token_s": 0.0,
               "request_overhead_s": 0.0, "per_prefill_pair_s": 0.0}}, "cost: Value error, a step of one token for one sequence costs 0 s"),
    ({"cost": {"base_s": 1e300}}, "cost.base_s"),
    ({"cost": {"per_token_s": 1e300}}, "cost.per_token_s"),
    ({"server": {"max_num_seqs": 10**12}}, "server.max_num_seqs"),
    ({"server": {"block_size": 10**9}}, "server.block_size"),
    ({"server": {"max_num_batched_tokens": 1e12}}, "server.max_num_batched_tokens"),
    ({"cost": {"base_s": "1"}}, "cost.base_s: Input should be a valid number"),
    ({"server": {"max_num_seqs": "8"}}, "server.max_num_seqs: Input should be a valid integer"),
    ({"server": {"max_num_seqs": 8.5}}, "server.max_num_seqs"),
    ({"fit_r2": "1"}, "fit_r2: Input should be a valid number"),
])
def test_capacity_refuses_a_calibration_without_physical_sense(tmp_path, capsys, edit, named):
    import json

    from kvscope.harness.cli.main import main

    cal = _calibration_file(tmp_path / "calibration.json", num_gpu_blocks=200)
    data = json.loads(cal.read_text())
    for key, value in edit.items():
        if isinstance(value, dict):
            data[key].update(value)
        else:
            data[key] = value
    cal.write_text(json.dumps(data))
    rc = main(["capacity", str(_sessions_trace(tmp_path)), "--calibration", str(cal), "--levels", "1,2"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1, (out, err)
    assert named in err and str(cal) in err, err
    assert "capacity" not in out


def test_the_calibration_cost_model_is_what_the_file_says(tmp_path):
    from kvscope.harness.results.loaders import load_calibration

    m = load_calibration(_calibration_file(tmp_path / "calibration.json", num_gpu_blocks=200)).cost_model()
    assert (m.base_s, m.per_token_s, m.per_seq_s, m.request_overhead_s) == (0.005, 2e-5, 1e-4, 0.002)


@pytest.mark.parametrize("slo,needle", [
    ("9" * 400 + "x_unloaded", "is not a finite"),
    ("1" + "0" * 400 + "x_unloaded", "is not a finite"),
    ("1" + "0" * 400, "is not a finite"),
    ("1x_unloaded", "factor must be above 1"),
])
def test_an_infinite_or_unit_slo_is_refused(slo, needle):
    from kvscope.harness.analysis.capacity import parse_ttft_slo

    with pytest.raises(ValueError, match=needle):
        parse_ttft_slo(slo)


@pytest.mark.parametrize("slo,text", [
    ("1.0000001x_unloaded", "1.0000001x_unloaded"),
    ("3x_unloaded", "3x_unloaded"),
    ("2.50x_unloaded", "2.50x_unloaded"),
    ("250", "250ms"),
    ("250.125ms", "250.125ms"),
])
def test_the_slo_prints_its_factor_as_given(slo, text):
    from kvscope.harness.analysis.capacity import parse_ttft_slo

    assert parse_ttft_slo(slo).text == text


def test_capacity_prints_the_factor_as_given(tmp_path, capsys):
    from kvscope.harness.cli.main import main

    cal = _calibration_file(tmp_path / "calibration.json", num_gpu_blocks=200)
    rc = main(["capacity", str(_sessions_trace(tmp_path)), "--calibration", str(cal), "--levels", "1,2",
               "--slo-ttft-p90", "1.0000001x_unloaded", "--runs", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "1.0000001x" in out, out
