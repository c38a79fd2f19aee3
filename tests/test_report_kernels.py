"""How the report starts its notebook kernels: Unix-socket transport (no TCP port races when kernels start
together), one BLAS thread each, and the caller's environment left as it was."""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import nbformat
import pytest

from kvscope.harness.report.render import KERNEL_THREAD_VARIABLES, _kernel_environment, run_notebook

pytestmark = pytest.mark.skipif(os.name != "posix", reason="Unix-socket kernels are POSIX only")

PROBE = """import json, os
from ipykernel import get_connection_info
info = json.loads(get_connection_info())
print(json.dumps({"transport": info["transport"], "ip": info["ip"], "blas": os.environ.get("OPENBLAS_NUM_THREADS")}))
"""


def _probe_notebook(folder: Path) -> Path:
    params = nbformat.v4.new_code_cell('experiment_dir = ""\nfigures_dir = ""')
    params.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=[params, nbformat.v4.new_code_cell(PROBE)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / "probe.ipynb")
    return folder


def _run_probe(nb_dir: Path, out_dir: Path) -> dict:
    r = run_notebook("probe", out_dir, {"experiment_dir": "", "figures_dir": str(out_dir / "figures")}, nb_dir)
    assert r.ok, r.error
    cell = nbformat.read(r.ipynb, as_version=4).cells[-1]
    return json.loads("".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout"))


def test_kernels_started_together_each_get_their_own_unix_sockets_and_one_blas_thread(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    nb_dir = _probe_notebook(tmp_path / "nbs")
    with ProcessPoolExecutor(3, mp_context=get_context("spawn")) as pool:
        seen = list(pool.map(_run_probe, [nb_dir] * 3, [tmp_path / f"out{i}" for i in range(3)]))
    assert [s["transport"] for s in seen] == ["ipc"] * 3
    assert len({Path(s["ip"]).parent for s in seen}) == 3  # a private socket folder per kernel
    assert all(not Path(s["ip"]).parent.exists() for s in seen)  # removed after the notebook
    assert [s["blas"] for s in seen] == ["1"] * 3


def test_kernel_environment_is_restored_and_keeps_what_the_user_set(monkeypatch):
    for name in KERNEL_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    with _kernel_environment():
        assert os.environ["OPENBLAS_NUM_THREADS"] == "1" and os.environ["MKL_NUM_THREADS"] == "1"
        assert os.environ["OMP_NUM_THREADS"] == "4"
    assert "OPENBLAS_NUM_THREADS" not in os.environ and "MKL_NUM_THREADS" not in os.environ
    assert os.environ["OMP_NUM_THREADS"] == "4"
