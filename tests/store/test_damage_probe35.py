"""Stores edited by hand (probe 35): a run's ``runs`` row deleted with its spans left (the
next run took its id, and its spans: a summary of 304 spans, 1,754 stored and exported),
and request spans with more hits than prompt (`diff` counted them gained, exit 0)."""

from __future__ import annotations

import re

import duckdb
import pytest

from kvtrace.store import Store, StoreError, read
from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace
from tests.conftest import MOONCAKE

REPLAY = ["replay", str(MOONCAKE), "--limit", "5", "--mode", "cache-only", "--capacity-blocks", "64"]


def _two_runs(tmp_path, capsys, replay: list[str] = REPLAY) -> str:
    db = str(tmp_path / "s.duckdb")
    for _ in range(2):
        code, _, err = kvtrace([*replay, "--db", db], capsys)
        assert code == 0, err
    return db


def _spans(db: str) -> dict[str, int]:
    con = duckdb.connect(db, read_only=True)
    try:
        return dict(con.execute("SELECT run_id, count(*) FROM spans GROUP BY ALL").fetchall())
    finally:
        con.close()


def test_a_run_id_whose_spans_remain_is_not_given_again(tmp_path, capsys):
    db = _two_runs(tmp_path, capsys)
    before = _spans(db)
    con = duckdb.connect(db)
    con.execute("DELETE FROM runs WHERE run_id = 'r2'")
    con.close()
    code, _, err = kvtrace([*REPLAY, "--db", db], capsys)
    assert code == 0 and "run r3 recorded" in err, err
    after = _spans(db)
    assert after["r2"] == before["r2"] and after["r3"] == before["r1"]  # (the same replay: as many spans)
    assert read.runs(db)["run_id"].sort().to_list() == ["r1", "r3"]
    assert_leftover_id_refused(db, "r2")


def assert_leftover_id_refused(db: str, run_id: str) -> None:
    """A run given, by name, an id whose spans remain without its row is refused (any store)."""
    store = Store.open(db)
    try:
        refused = rf"run id '{re.escape(run_id)}': spans of a run of this id remain without its "
        with pytest.raises(StoreError, match=refused):
            store.create_run("again", run_id=run_id)
    finally:
        store.close()


def test_requests_with_more_hits_than_prompt_are_damage_to_diff(tmp_path, capsys):
    db = _two_runs(tmp_path, capsys, REPLAY[:4])  # (engine runs: request spans)
    con = duckdb.connect(db)
    con.execute("UPDATE spans_request SET num_hit_tokens = num_prompt_tokens + 100 WHERE run_id = 'r2'")
    con.close()
    code, _, err = kvtrace(["diff", "r1", "r2", "--db", db], capsys)
    assert_one_line(code, err, db, "damaged kvtrace store: run r2's request", "hit tokens of a", "(5 such requests)")
