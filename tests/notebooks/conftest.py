"""Execute the notebooks with papermill on the current interpreter and read their RESULT line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _kernel_name() -> str:
    """The native ``python3`` kernel of *this* interpreter.

    jupyter_client resolves ``python3`` to ipykernel's built-in spec, and replaces a bare
    ``python`` in a kernel's argv with ``sys.executable``, so the kernel always runs the
    interpreter (and the installed kvtrace) that runs the tests, on a fresh CI machine
    too: nothing needs ``jupyter kernelspec install`` first.
    """
    from jupyter_client.kernelspec import NATIVE_KERNEL_NAME, KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec(NATIVE_KERNEL_NAME)
    assert spec.argv[0] in ("python", "python3", sys.executable), spec.argv
    return NATIVE_KERNEL_NAME


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
def run_notebook(tmp_path):
    import papermill as pm

    def run(name: str, **parameters):
        out = tmp_path / f"executed-{name}.ipynb"
        nb = pm.execute_notebook(
            str(NOTEBOOKS / f"{name}.ipynb"),
            str(out),
            parameters=parameters,
            kernel_name=_kernel_name(),
            cwd=str(tmp_path),
            progress_bar=False,
            log_output=False,
            execution_timeout=300,
        )
        return result_of(nb), nb

    return run
