"""What the docs probe (session 24) found: notebooks that left their temporary trace or study
store behind in the temp folder, untold (one 5 MB store per study), and a study notebook whose
unknown behaviour was an error naming `study`, not its parameter."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.notebooks.conftest import kernel_name, run_notebook  # noqa: F401  (the notebook fixtures)

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


@pytest.fixture
def temp_folder(tmp_path, monkeypatch):
    """The kernel's temp folder (it inherits TMPDIR), empty before the notebook runs."""
    folder = tmp_path / "kernel-tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("kvtrace-nb-"))


def test_a_study_notebooks_temporary_store_is_removed_when_its_kernel_stops(run_notebook, temp_folder):  # noqa: F811
    """regression_analysis without db_path ran its study into tempfile.mkdtemp() and kept it: a
    5 MB study.duckdb in the temp folder per run, which no output said would stay."""
    out, nb = run_notebook("regression_analysis", behaviour="shared-prefix-pinning", limit=2)
    assert out["db_path"].startswith(str(temp_folder)), out["db_path"]  # (the study did run in this folder)
    assert "a temporary store, removed when this kernel stops" in _printed(nb)
    assert _left(temp_folder) == []


def test_a_characterisations_generated_trace_is_removed_when_its_kernel_stops(run_notebook, temp_folder):  # noqa: F811
    out, nb = run_notebook("trace_characterisation", generator="chat", num_requests=6, capacities=[2, 8])
    assert out["trace"].startswith(str(temp_folder)) and out["requests"] == 6, out["trace"]
    assert "a temporary file, removed when this kernel stops" in _printed(nb)
    assert _left(temp_folder) == []


def test_an_unknown_generator_leaves_no_empty_folder(run_notebook, temp_folder):  # noqa: F811
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError, match=re.escape("trace_characterisation: generator: unknown 'nope'")):
        run_notebook("trace_characterisation", generator="nope")
    assert _left(temp_folder) == []


def test_an_unknown_behaviour_is_one_error_naming_the_parameter(run_notebook, temp_folder):  # noqa: F811
    """It said "study: unknown behaviour 'nope'" (the study's own words), and left an empty folder."""
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError) as raised:
        run_notebook("regression_analysis", behaviour="nope")
    assert raised.value.evalue.startswith("behaviour: unknown 'nope'; expected one of "), raised.value.evalue
    assert _left(temp_folder) == []


def test_the_readme_says_the_notebooks_temporary_files_go():
    paragraph = README[README.index("## Notebooks"):README.index("## Benchmarks")]
    assert "removed when the kernel stops" in " ".join(paragraph.split())
