"""A one-page report notebook written into a scratch folder, for tests of the report's exporter and browser
checks: the kernelspec the report's runner expects and the papermill ``parameters`` cell every shipped notebook
starts with, then the test's own cells."""

from __future__ import annotations

from pathlib import Path

import nbformat


def write_report_notebook(nb_dir: Path, name: str, cells: list[nbformat.NotebookNode]) -> Path:
    """Write ``nb_dir/<name>.ipynb``: the parameters cell (``experiment_dir``, ``figures_dir``), then ``cells``."""
    nb_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    params = nbformat.v4.new_code_cell('experiment_dir = ""\nfigures_dir = ""')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, *cells]
    path = nb_dir / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path
