"""The notebooks share one setup function; papermill's parameters cell stays tagged."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_setup_cell_is_the_shared_function(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].metadata.get("tags") == ["parameters"]
    setup = code[1].source.strip().splitlines()
    assert len(setup) <= 2
    assert f'setup_notebook("{path.stem}", experiment_dir, figures_dir)' in setup[-1]


def test_setup_notebook_makes_the_figure_folder_and_saves_pngs(tmp_path):
    from kvscope.harness.analysis.notebook import plt, setup_notebook

    res, fig_dir, save = setup_notebook("x", "", str(tmp_path / "figs"))
    assert res is None and fig_dir.is_dir()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save(fig, "line")
    assert (fig_dir / "line.png").stat().st_size > 0
