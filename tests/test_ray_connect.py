"""`--ray-address` to a place with no Ray cluster fails within a bounded time in one line (issue 27's probe:
`--ray-address 127.0.0.1:1` retried for over 5 minutes), before a run directory is made."""

from __future__ import annotations

import socket

import pytest

from tests.test_ray_executor import _spec

pytest.importorskip("ray")


def _run(tmp_path, tiny_model_dir, address: str, capsys) -> tuple[int, str]:
    from kvscope.harness.cli.main import main

    spec = _spec(tmp_path / "s.yaml", tiny_model_dir, "  a: {}")
    rc = main(["experiment", "run", str(spec), "--executor", "ray", "--ray-address", address,
               "--out", str(tmp_path / "out")])
    return rc, capsys.readouterr().err


def test_a_refused_address_is_one_line_and_writes_nothing(tmp_path, tiny_model_dir, capsys):
    rc, err = _run(tmp_path, tiny_model_dir, "127.0.0.1:1", capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "--ray-address 127.0.0.1:1: cannot reach a Ray cluster there (connection refused; 30 s limit" in err
    assert not (tmp_path / "out").exists()


def test_a_port_that_is_not_ray_fails_at_the_configured_limit(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("KVSCOPE_RAY_CONNECT_TIMEOUT_S", "0.5")
    with socket.socket() as listener:  # accepts TCP, never speaks gRPC
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        address = f"ray://127.0.0.1:{listener.getsockname()[1]}"
        rc, err = _run(tmp_path, tiny_model_dir, address, capsys)
    assert rc == 2 and err.count("\n") == 1
    assert f"--ray-address {address}: something listens there but it is not a Ray cluster" in err
    assert "0.5 s limit" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["0", "soon", "-3"])
def test_a_bad_connect_timeout_names_the_variable(tmp_path, tiny_model_dir, capsys, monkeypatch, value):
    monkeypatch.setenv("KVSCOPE_RAY_CONNECT_TIMEOUT_S", value)
    rc, err = _run(tmp_path, tiny_model_dir, "127.0.0.1:1", capsys)
    assert rc == 2 and f"KVSCOPE_RAY_CONNECT_TIMEOUT_S={value!r}: a number of seconds > 0" in err
