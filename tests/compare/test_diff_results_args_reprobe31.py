"""diff_results refuses an API caller's replays kept in memory that are not what RunResult
keeps, in one ConfigError line naming the argument (re-probe 31, beside 640e767's diff_runs:
a summary or run record that is no dict, per-request rows that are no list of dicts, an
engine run's rows without a key the comparison reads were TypeErrors, AttributeErrors,
KeyErrors or numpy truth ValueErrors from inside the comparison)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.compare.source import diff_results
from kvtrace.errors import ConfigError
from kvtrace.replay.run import RunSpec, run_replay


@pytest.fixture(scope="module")
def kept():
    a = run_replay(RunSpec("gen:chat", limit=12), export=False)
    b = run_replay(RunSpec("gen:chat", limit=12, seed=1), export=False)
    return {"summary_a": a.summary, "per_request_a": a.per_request, "summary_b": b.summary,
            "per_request_b": b.per_request, "run_a": a.record, "run_b": b.record}


def test_replays_as_run_replay_keeps_them_are_diffed(kept):
    assert diff_results(**kept).metric("requests").a == 12


@pytest.mark.parametrize(("name", "value"), [
    ("summary_a", None), ("summary_b", [{}]), ("summary_a", np.array([1.0, 2.0])),
    ("per_request_a", 5), ("per_request_b", np.array([1.0, 2.0])), ("per_request_a", [5]), ("per_request_b", "rows"),
    ("run_a", "r1"), ("run_b", [5]), ("run_a", np.array([1.0, 2.0])),
], ids=lambda v: type(v).__name__)
def test_a_kept_replay_of_another_kind_is_refused_naming_the_argument(kept, name, value):
    with pytest.raises(ConfigError, match=rf"^{name}: .*expected"):
        diff_results(**{**kept, name: value})


def test_an_engine_runs_row_without_a_key_the_comparison_reads_is_refused(kept):
    rows = [dict(r) for r in kept["per_request_b"]]
    del rows[3]["itl_ns"]
    with pytest.raises(ConfigError, match=r"^per_request_b: .*expected each row to hold 'itl_ns'$"):
        diff_results(**{**kept, "per_request_b": rows})


class _RunId(str):
    """A run id of a str subclass whose own repr and == raise (diff_runs raised them from the
    store's queries and its error lines)."""

    def __repr__(self):
        raise RuntimeError("no repr")

    def __eq__(self, other):
        raise RuntimeError("no eq")

    __hash__ = str.__hash__


def test_diff_runs_reads_run_ids_of_a_str_subclass_as_the_strings_they_are(tmp_path):
    db = str(tmp_path / "s.duckdb")
    run_replay(RunSpec("gen:chat", limit=6, mode="cache-only"), db=db, export=False)
    run_replay(RunSpec("gen:chat", limit=6, mode="cache-only", seed=1), db=db, export=False)
    from kvtrace.compare.source import diff_runs

    assert diff_runs(db, _RunId("r1"), _RunId("r2"), force=True).run_b["run_id"] == "r2"
