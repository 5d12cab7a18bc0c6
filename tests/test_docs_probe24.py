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


def test_the_spans_table_says_the_final_audits_step_span(tmp_path):
    """A run whose final audit finds stale hashes has one step span more than its `steps`: a
    zero-length one in the last step's number, parenting them. The table said one span a step."""
    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "audit.duckdb"
    spec = RunSpec("gen:mixed", capacity_blocks=40, external_capacity_blocks=4096,
                   without=("external-hit-running-cow",), limit=30)
    summary = run_replay(spec, db=db).summary
    with duckdb.connect(str(db), read_only=True) as con:
        spans = con.execute("SELECT step, start_ns, end_ns FROM step_spans ORDER BY seq").fetchall()
        audit_parents = con.execute(
            "SELECT DISTINCT s.step, s.start_ns = s.end_ns FROM verify_spans v JOIN step_spans s "
            "ON v.parent_span_id = s.span_id WHERE v.name = 'kvtrace.verify.stale_hash'").fetchall()
    assert summary["stale_hashes"] and len(spans) == summary["steps"] + 1, (summary["stale_hashes"], len(spans))
    last, extra = spans[-2], spans[-1]
    assert extra[0] == last[0] == summary["steps"] - 1 and extra[1] == extra[2] == last[2]
    assert audit_parents == [(summary["steps"] - 1, True)]
    (row,) = [line for line in README.splitlines() if line.startswith("| `kvtrace.engine.step` |")]
    assert "zero-length at the run's end" in row and "`steps` + 1 step spans" in row


def test_the_readme_says_vllms_log_line_is_over_the_last_thousand_requests():
    """The summary's rate is the whole run's; the README called it "vLLM's logged 'Prefix cache
    hit rate'" alone, which vLLM computes over the most recent 1,000 requests (21.8% against
    49.3% on the Mooncake trace's engine replay)."""
    section = " ".join(README[README.index("## Metrics"):README.index("\n## An isolated A/B")].split())
    assert "over the most recent 1,000 requests only" in section and "whole run's ratio" in section
    stats = pytest.importorskip("vllm.v1.metrics.stats")
    assert stats.CachingMetrics().max_recent_requests == 1000

