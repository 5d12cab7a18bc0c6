"""Views of one metric probed by hand (session 22): a run's figures in the read API, `kvtrace
runs`, `kvtrace diff` and the dashboard's queries, on runs a user stops or a store a user edits."""

from __future__ import annotations

import json

import duckdb
import pytest

from kvtrace.store import read
from tests.cli.support import run as kvtrace

# engine mode with an external tier and the CoW fix off: divergent outputs and stale entries left
DIVERGING = dict(limit=35, capacity_blocks=40, external_capacity_blocks=4096, without=("external-hit-running-cow",))


@pytest.fixture(scope="module")
def diverging_store(tmp_path_factory):
    """A store of two engine runs of one trace: r1 checks content (and diverges), r2 does not.
    Returns (bytes of the store, r1's summary, r2's summary)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("diverging") / "d.duckdb"
    checked = run_replay(RunSpec("gen:mixed", **DIVERGING), db=db).summary  # type: ignore[arg-type]
    unchecked = run_replay(RunSpec("gen:mixed", content=False, **DIVERGING), db=db).summary  # type: ignore[arg-type]
    assert checked["divergent_outputs"] > 0 and checked["stale_hashes_left"] > 0  # what the test is about
    return db.read_bytes(), checked, unchecked


def _stopped(tmp_path, data: bytes, *run_ids: str):
    """The store with ``run_ids`` as SIGTERM leaves a run: failed, its summary the error alone."""
    db = tmp_path / "d.duckdb"
    db.write_bytes(data)
    with duckdb.connect(str(db)) as con:
        for run_id in run_ids:
            con.execute("UPDATE runs SET status = 'failed', summary = ? WHERE run_id = ?",
                        [json.dumps({"error": "Terminated: SIGTERM"}), run_id])
    return str(db)


def test_a_stopped_runs_divergent_outputs_are_its_spans_in_every_view(tmp_path, diverging_store, capsys):
    """Divergent outputs are counted as tokens are sampled: a stopped run's spans hold every
    one so far. Its summary from spans said null (not measured), so `diff` said null beside
    the divergent requests it listed, and the dashboard's Overview a dash beside its table of
    them. Stale entries left likewise (a cache event, as CoW copies are); stale hashes stay
    null (the audit of every key at a run's end never ran); a run without content checks
    measures no divergence: null."""
    data, checked, unchecked = diverging_store
    db = _stopped(tmp_path, data, "r1", "r2")
    summary = read.run_summary(db, "r1")
    assert summary["error"] == "Terminated: SIGTERM"
    assert summary["divergent_outputs"] == checked["divergent_outputs"] == read.divergent_outputs(db, "r1").height
    assert summary["stale_hashes_left"] == checked["stale_hashes_left"]
    assert summary.get("stale_hashes") is None
    assert read.run_summary(db, "r2")["divergent_outputs"] is None
    assert read.run_summary(db, "r2")["stale_hashes_left"] == unchecked["stale_hashes_left"]

    code, out, err = kvtrace(["diff", "r1", "r2", "--db", db, "--json"], capsys)
    assert code == 0, err
    diffed = json.loads(out)
    assert diffed["correctness"]["divergent_outputs"] == {"a": checked["divergent_outputs"], "b": None}
    listed = sum(r["divergent_tokens"] for r in diffed["correctness"]["divergent_requests"]["a"])
    assert listed == checked["divergent_outputs"]
    assert diffed["metrics"]["stale_hashes_left"]["a"] == checked["stale_hashes_left"]
