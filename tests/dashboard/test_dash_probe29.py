"""Probe 29 (dash): link values the dashboard dropped unsaid on a store without runs."""

from __future__ import annotations

import pytest
from apptest import render

from kvtrace.replay.curve import run_curve
from kvtrace.replay.run import RunSpec
from kvtrace.store.writer import Store
from tests.conftest import MOONCAKE
from tests.support.markdown import shown


def _warnings(at) -> list[str]:
    return [shown(w.value) for w in at.warning]


@pytest.fixture(scope="module")
def curves_db(tmp_path_factory) -> str:
    """A store of one capacity curve and no run (`kvtrace curve --db` in cache-only mode)."""
    db = tmp_path_factory.mktemp("curves") / "curves.duckdb"
    run_curve(RunSpec(str(MOONCAKE), mode="cache-only", limit=40), "50,inf", db=db)
    return str(db)


@pytest.mark.parametrize("page", ["overview", "capacity"])
def test_a_linked_run_a_store_of_curves_alone_lacks_is_named(curves_db, monkeypatch, page):
    """A link's run on a store of curves and no runs (a link from another store, or a run not
    written yet) was dropped unsaid: the Capacity page showed the store's curve as if the link's
    run were there, every sidebar link carrying it on."""
    at = render(curves_db, monkeypatch, page, run="r9")
    assert not at.error
    assert any(w.startswith("Run r9 from the link is not in") and "no runs yet" in w for w in _warnings(at)), \
        _warnings(at)
    assert not _warnings(render(curves_db, monkeypatch, page))  # (no link, nothing to say)


def test_a_linked_run_an_empty_store_lacks_is_named(tmp_path, monkeypatch):
    db = str(tmp_path / "empty.duckdb")
    Store.open(db).close()
    at = render(db, monkeypatch, run="<b>r9</b>")
    assert any(w.startswith("Run <b>r9</b> from the link is not in") for w in _warnings(at)), _warnings(at)
    assert any("no runs yet" in i.value for i in at.info)
    assert not _warnings(render(db, monkeypatch))


@pytest.mark.parametrize("status", ["running", "failed"])
def test_an_unfinished_run_that_scheduled_nothing_is_not_told_to_run_the_demo(tmp_path, monkeypatch, status):
    """A replay still starting (or one that failed before its first lookup) has no spans: its Hit
    rate page said "Fill it with `kvtrace demo`, or `kvtrace replay ...`" where the Evictions and
    Latency pages of the same run say what fills them: the same replay run to its end (or, failed,
    one it can finish)."""
    db = str(tmp_path / "unfinished.duckdb")
    store = Store.open(db)
    run = store.create_run("starting", trace_source="gen:mixed", mode="engine")
    if status == "failed":
        store.finish_run(run, status="failed", summary={"error": "the pool is too small"})
    try:
        infos = [i.value for i in render(db, monkeypatch, "hit_rate", run=run).info]
    finally:
        store.close()
    said = [i for i in infos if i.startswith("No request was scheduled in this run")]
    assert len(said) == 2, infos  # the hit rate and the prompt tokens by source
    assert not any("kvtrace demo" in i for i in said), said
    fills = {"running": "the same replay run to its end", "failed": "with settings it can finish"}
    assert all(fills[status] in i for i in said), said


def test_a_live_captures_time_window_is_not_called_virtual(tmp_path, monkeypatch):
    """A live capture's times are vLLM's event timestamps (its charts' axis says so), where its time
    window slider was labelled "Virtual time window" on every page, as a replay's modelled clock."""
    from test_dash_live_clock import _live_capture

    db = str(tmp_path / "live.duckdb")
    run = _live_capture(db)
    for page in ("hit_rate", "evictions", "stale"):
        at = render(db, monkeypatch, page, run=run)
        assert [s.label for s in at.slider] == ["Time window"], page
