"""The .py (jupytext percent) and .ipynb of each notebook hold the same cells."""

from __future__ import annotations

import jupytext
import pytest

from tests.notebooks.conftest import NOTEBOOKS

NAMES = ("regression_analysis", "trace_characterisation")


@pytest.mark.parametrize("name", NAMES)
def test_py_and_ipynb_are_in_sync(name):
    py = jupytext.read(NOTEBOOKS / f"{name}.py")
    ipynb = jupytext.read(NOTEBOOKS / f"{name}.ipynb")
    cells = lambda nb: [(c.cell_type, c.source.strip()) for c in nb.cells]
    assert cells(py) == cells(ipynb), f"run: .venv/bin/jupytext --sync notebooks/{name}.py"
    tags = [c.metadata.get("tags", []) for c in ipynb.cells]
    assert sum("parameters" in t for t in tags) == 1  # papermill's parameters cell
    # Committed notebooks carry no outputs (reviewable diffs).
    assert all(not c.get("outputs") for c in ipynb.cells if c.cell_type == "code")
