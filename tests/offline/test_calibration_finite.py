"""A calibration with a non-finite number is refused at load, naming the field (issue 27's probe: a
calibration with ``Infinity`` was accepted and `kvscope capacity` printed "capacity below 1")."""

from __future__ import annotations

import pytest

from tests.offline.test_scheduler import _calibration_file, _sessions_trace


@pytest.mark.parametrize("field,value,named", [
    ('"base_s": 0.005', '"base_s": Infinity', "cost.base_s"),
    ('"per_seq_s": 0.0001', '"per_seq_s": -Infinity', "cost.per_seq_s"),
    ('"fit_r2": 1.0', '"fit_r2": NaN', "fit_r2"),
])
def test_capacity_refuses_a_non_finite_calibration(tmp_path, capsys, field, value, named):
    from kvscope.harness.cli.main import main

    cal = _calibration_file(tmp_path / "calibration.json", num_gpu_blocks=200)
    text = cal.read_text()
    assert field in text
    cal.write_text(text.replace(field, value))
    rc = main(["capacity", str(_sessions_trace(tmp_path)), "--calibration", str(cal), "--levels", "1,2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert f"{cal}: {named}: Input should be a finite number" in err


def test_a_finite_calibration_still_loads(tmp_path):
    from kvscope.harness.results.loaders import load_calibration

    cal = load_calibration(_calibration_file(tmp_path / "calibration.json", num_gpu_blocks=200))
    assert cal.cost_model().base_s == 0.005
