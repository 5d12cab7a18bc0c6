"""Probe 28 (views): the dashboard on a run stopped before any of its requests finished,
whose lookups are recorded and whose hit counters (one per finished request) are none yet."""

from __future__ import annotations

from apptest import render

from kvtrace.engine.events import RequestFinished
from kvtrace.store import read


def _stopped_before_any_finished(db: str) -> str:
    """A run closed unfinished (``incomplete``) whose spans hold the lookups, publishes and
    steps of requests in flight, and no request span: no request had finished."""
    import synthetic_run

    from kvtrace.store.writer import Store

    steps, _ = synthetic_run.simulate(True, n_requests=6)
    steps = [type(s)(s.step, s.cache_events, [e for e in s.engine_events if not isinstance(e, RequestFinished)])
             for s in steps]
    store = Store.open(db)
    run = store.create_run("stopped", trace_source="gen:stopped", mode="engine")
    synthetic_run.write_steps(store, run, steps)
    store.close()
    return run


def test_a_run_stopped_before_any_request_finished_is_not_said_to_have_scheduled_none(tmp_path, monkeypatch):
    """Its Hit rate page said "No request was scheduled in this run" and "no lookup span names a
    KV group's own hit", and Overview "No lookups recorded", beside the lookups of its
    requests in flight (the page's own Hottest prefixes table listed them); each now says none
    finished, and the fill is the same replay run to its end, not `kvtrace demo`."""
    db = str(tmp_path / "stopped.duckdb")
    run = _stopped_before_any_finished(db)
    assert read.run(db, run)["status"] == "incomplete"
    assert read.hit_counters(db, run)["requests"] == 0
    lookups = read.span_counts(db, run).filter(name="kvtrace.cache.lookup")["spans"].sum()
    assert lookups > 0
    infos = [i.value for i in render(db, monkeypatch, "hit_rate", run=run).info]
    said = [i for i in infos if "No request of this run finished before it stopped" in i]
    assert len(said) == 3, infos  # the hit rate, the prompt tokens by source and the group hit rates
    assert all(f"{lookups:,} lookup spans" in i and "the same replay run to its end" in i for i in said), said
    assert not any("No request was scheduled" in i or "no lookup span names" in i for i in infos), infos
    captions = [c.value for c in render(db, monkeypatch, run=run).caption]
    assert not any("No lookups recorded" in c for c in captions), captions
    assert any("No request of this run finished before it stopped" in c for c in captions), captions


def test_the_latency_page_of_a_run_stopped_before_any_request_finished_shows_no_blank_statistics(tmp_path,
                                                                                                  monkeypatch):
    """Its statistics table was five rows of blanks under "vllm bench serve's statistics", and
    every empty chart was to be filled with `kvtrace demo`: the run's own replay, run to its end,
    fills them."""
    db = str(tmp_path / "stopped.duckdb")
    run = _stopped_before_any_finished(db)
    at = render(db, monkeypatch, "latency", run=run)
    assert not at.dataframe, [d.value for d in at.dataframe]
    infos = [i.value for i in at.info]
    assert "No finished requests in this run, so no latency. Fill it with the same replay run to its end." in infos
    assert infos and all(i.endswith("Fill it with the same replay run to its end.") for i in infos), infos


def test_a_time_of_a_second_or_more_has_thousands_separators_as_the_counts_beside_it():
    """Overview's TTFT p99 tile read "3209.0 ms" beside "1,227" evictions (and diff's "1,180.5")."""
    from kvtrace.dashboard import ui

    assert ui.ms(3209.04) == "3,209.0 ms" and ui.ms(999.96) == "1,000.0 ms" and ui.ms(12.345) == "12.3 ms"
    assert ui.count(1227) == "1,227" and ui.ms(None) == "–"


def test_a_run_whose_stale_keys_showed_only_as_divergent_outputs_is_not_told_to_make_such_a_run(tmp_path,
                                                                                                   monkeypatch):
    """A replay with transient-checkpoint-retention off whose audits found no stale hash but whose
    outputs diverged (README: a stale key read and evicted between two audits shows as those)
    was told to fill the drill-down with a run with that very switch off."""
    import synthetic_run

    from kvtrace.engine.events import StaleHashFound
    from kvtrace.store.writer import Store

    db = str(tmp_path / "diverged.duckdb")
    steps, _ = synthetic_run.simulate(False, n_requests=20)
    steps = [type(s)(s.step, s.cache_events, [e for e in s.engine_events if not isinstance(e, StaleHashFound)])
             for s in steps]
    with Store.open(db) as store:
        run = store.create_run("diverged", trace_source="gen:diverged", mode="engine")
        synthetic_run.write_steps(store, run, steps)
    diverged = read.run_summary(db, run)["divergent_outputs"]
    assert diverged > 0 and read.stale_hashes(db, run).height == 0
    infos = [i.value for i in render(db, monkeypatch, "stale", run=run).info]
    said = [i for i in infos if i.startswith("No stale hash to drill into in this run")]
    assert len(said) == 1 and f"{diverged:,} output tokens diverged" in said[0], infos
    assert "--without transient-checkpoint-retention" not in said[0]
