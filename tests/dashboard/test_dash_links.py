"""A link's ?stale= or ?request= on a run that has none to pick from: named, as on a run
that has others (README, Dashboard: a link value naming nothing shows a warning quoting it)."""

from __future__ import annotations

from apptest import render

from kvtrace.store import read
from tests.support.markdown import shown


def _warnings(at) -> list[str]:
    return [shown(w.value) for w in at.warning]


def _named_once(at, param: str, said: str) -> None:
    """The link's value named in a warning, dropped from the URL, and not named again."""
    assert said in _warnings(at), _warnings(at)
    assert param not in at.query_params
    at.run()
    assert not _warnings(at)


def test_a_linked_stale_hash_on_a_run_without_stale_hashes_is_named_once(dashboard_db, monkeypatch):
    run = next(r for r in read.runs(dashboard_db)["run_id"] if read.stale_hashes(dashboard_db, r).height == 0)
    at = render(dashboard_db, monkeypatch, "stale", run=run, stale="deadbeef@g0#1")
    _named_once(at, "stale", "Stale hash deadbeef@g0#1 from the link is not in this run: it has none to drill into.")


def test_a_linked_request_on_a_run_without_finished_requests_is_named_once(tmp_path, monkeypatch):
    from kvtrace.store.writer import Store

    db = str(tmp_path / "live.duckdb")
    with Store.open(db) as store:
        run = store.create_run("captured", trace_source="tcp://h:1", mode="live", config={"endpoint": "tcp://h:1"})
        store.finish_run(run, summary={"requests": 0, "batches": 3})
    assert read.per_request_hits(db, run).height == 0
    at = render(db, monkeypatch, "latency", run=run, request="chat0-t0")
    _named_once(at, "request", "Request chat0-t0 from the link is not in this run: it has no finished request to show.")


def test_a_linked_request_on_a_cache_only_run_is_named_once(tmp_path, monkeypatch):
    # the page returned before the request picker's warning: the value stayed in the URL, unsaid
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "co.duckdb")
    run = run_replay(RunSpec("gen:chat", limit=5, mode="cache-only"), db=db).run_id
    at = render(db, monkeypatch, "latency", run=run, request="zz")
    _named_once(at, "request",
                "Request zz from the link is not in this run's latencies: a cache-only run has no clock.")
