"""Execute the notebooks with papermill on the current interpreter and read their RESULT line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
KERNEL_NAME = "kvtrace-pytest"


@pytest.fixture(scope="session")
def kernel_name(tmp_path_factory):
    """A kernelspec that runs *this* interpreter (the venv with kvtrace installed).

    It lives in a temporary JUPYTER_PATH entry, which jupyter_client searches before the
    user's and the system's kernel directories, under a name nothing else uses: a fresh CI
    machine needs no ``jupyter kernelspec install``, and a developer's own ``python3``
    kernel pointing at another interpreter cannot shadow it.
    """
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "kvtrace tests",
        "language": "python",
    }))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(root)] + ([old] if old else []))
    yield KERNEL_NAME
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


def result_of(nb) -> dict:
    """The JSON after ``RESULT `` in the executed notebook's stream outputs."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                for line in out.get("text", "").splitlines():
                    if line.startswith("RESULT "):
                        return json.loads(line[len("RESULT "):])
    raise AssertionError("the notebook printed no RESULT line")


@pytest.fixture
def run_notebook(tmp_path, kernel_name, monkeypatch):
    import papermill as pm

    # The kernel inherits TMPDIR: a notebook's own temporary store or trace goes with the test's folder.
    monkeypatch.setenv("TMPDIR", str(tmp_path))

    def run(name: str, **parameters):
        out = tmp_path / f"executed-{name}.ipynb"
        for attempt in range(2):
            try:
                nb = pm.execute_notebook(
                    str(NOTEBOOKS / f"{name}.ipynb"),
                    str(out),
                    parameters=parameters,
                    kernel_name=kernel_name,
                    cwd=str(tmp_path),
                    progress_bar=False,
                    log_output=False,
                    execution_timeout=300,
                )
                break
            except RuntimeError as err:
                # A kernel that never started: jupyter_client picks its five ports free, and another
                # test's socket took one before the kernel bound it ("Address already in use", then
                # "Kernel didn't respond in 60 seconds"). Started once more; nothing of the notebook ran.
                if attempt or "Kernel didn't respond" not in str(err):
                    raise
        return result_of(nb), nb

    return run
