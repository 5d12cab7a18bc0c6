"""Probe 24 of the dashboard (truth): a failed engine run is not called cache-only on Compare,
says why it failed on Overview and is not said to have a cache that never filled; a live
capture's Latency page is one line; a collected run's stale-hash page agrees with the
sender's summary that Overview shows."""

from __future__ import annotations

import json

import duckdb
import pytest
from apptest import render

from kvtrace.errors import KVTraceError


@pytest.fixture(scope="module")
def failed_pair(tmp_path_factory) -> tuple[str, str, str]:
    """(store, A, B): A replays gen:mixed to its end; B replays the same trace with a pool too
    small for its first request, so it fails before any request finishes (status failed, no
    spans, its error stored in its summary)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path_factory.mktemp("failed") / "f.duckdb")
    a = run_replay(RunSpec("gen:mixed", limit=8, name="whole"), db=db).run_id
    with pytest.raises(KVTraceError, match="cannot be scheduled"):
        run_replay(RunSpec("gen:mixed", limit=8, name="too small", preset="dense-attention", capacity_blocks=4),
                   db=db)
    with duckdb.connect(db) as con:
        ((b, status, summary),) = con.execute("SELECT run_id, status, summary FROM runs WHERE run_id != ?",
                                              [a]).fetchall()
    assert a is not None and status == "failed" and "cannot be scheduled" in json.loads(summary)["error"]
    return db, a, b


def test_compare_does_not_call_a_failed_engine_run_cache_only(failed_pair, monkeypatch):
    """Compare of an engine run with an engine run that failed before a request finished said
    'at least one run has no clock (cache-only)' and 'it records no request spans (cache-only
    runs have none)': both runs are engine replays, with a clock; B finished no request."""
    db, a, b = failed_pair
    at = render(db, monkeypatch, "compare", run=a, b=b)
    infos = [i.value for i in at.info]
    latency = [i for i in infos if i.startswith("No latency to compare")]
    assert latency and f"B `{b}` recorded no finished request (it is failed)" in latency[0], infos
    per_request = [i for i in infos if "per-request cached tokens" in i]
    assert per_request and f"`{b}` recorded no finished request" in per_request[0], infos
    assert not any("cache-only" in i for i in latency + per_request), infos


def test_a_failed_runs_overview_says_why_it_failed(failed_pair, monkeypatch):
    """A failed run's Overview said it 'stopped early' and never why, though its replay
    stored the error (the one line `kvtrace replay` printed)."""
    db, _, b = failed_pair
    at = render(db, monkeypatch, run=b)
    said = [w.value for w in at.warning if "stopped early" in w.value]
    assert said and "cannot be scheduled" in said[0], [w.value for w in at.warning]


def test_a_failed_runs_evictions_page_does_not_say_its_cache_never_filled(failed_pair, monkeypatch):
    """A run that failed before it recorded anything: 'No evictions in this run: the cache
    never filled', which nothing measured."""
    db, _, b = failed_pair
    at = render(db, monkeypatch, "evictions", run=b)
    infos = [i.value for i in at.info]
    assert not any("never filled" in i for i in infos), infos
    assert any("No evictions recorded so far: this run is **failed**" in i for i in infos), infos


def test_a_live_captures_latency_page_is_one_line_not_an_empty_table(tmp_path, monkeypatch):
    """A live capture has no request times: its Latency page showed a table of blanks headed
    '(modelled)' and six empty charts each saying 'Fill it with `kvtrace demo`'."""
    from kvtrace.store.writer import Store

    db = str(tmp_path / "live.duckdb")
    with Store.open(db) as store:
        run = store.create_run("captured", trace_source="tcp://h:1", mode="live", config={"endpoint": "tcp://h:1"})
        store.finish_run(run, summary={"batches": 0, "events": 0, "nothing_received": False})
    at = render(db, monkeypatch, "latency", run=run)
    assert not at.dataframe and not at.get("plotly_chart")
    infos = [i.value for i in at.info]
    assert len(infos) == 1 and "live capture" in infos[0], infos


@pytest.mark.parametrize(("stale", "correct"), [(0, True), (None, False)])
def test_a_collected_runs_stale_page_agrees_with_its_senders_summary(tmp_path, monkeypatch, stale, correct):
    """A collected run whose sender (a kvtrace engine replay with content) counted 0 stale
    hashes: Overview shows that 0, and the Stale page said the run 'checked no block
    content'. A sender that checked none (null) is still not called correct."""
    import synthetic_run

    db = str(tmp_path / "collected.duckdb")
    run = synthetic_run.write_collected_run(db)
    sender = {"mode": "engine", "requests": 6, "stale_hashes": stale, "divergent_outputs": stale}
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET status = 'complete', summary = ? WHERE run_id = ?", [json.dumps(sender), run])
    overview = render(db, monkeypatch, run=run)
    tile = next(m.value for m in overview.metric if m.label == "Stale hashes")
    assert tile == ("0" if correct else "–")
    at = render(db, monkeypatch, "stale", run=run)
    assert not at.get("plotly_chart")  # (the collected story's spans hold no stale hash)
    first = at.info[0].value
    assert ("checked no block content" in first) is (not correct), first
    assert ("the cache stayed correct" in first) is correct, first


def test_a_collected_cache_only_runs_latency_page_does_not_say_it_finished_no_request(tmp_path, monkeypatch):
    """A collected run whose sender replayed cache-only (lookups, no request spans, its
    summary's mode cache-only): Overview counts its requests, and Latency said 'No finished
    requests in this run' over a table of blanks and six empty charts."""
    import synthetic_run

    db = str(tmp_path / "collected.duckdb")
    run = synthetic_run.write_collected_run(db)
    sender = {"mode": "cache-only", "policy": "lru", "requests": 6, "prefix_cache_queries": 100,
              "prefix_cache_hits": 10, "median_ttft_ms": None}
    with duckdb.connect(db) as con:
        con.execute("DELETE FROM spans_request WHERE run_id = ?", [run])  # (a cache-only sender sends none)
        con.execute("UPDATE runs SET status = 'complete', summary = ? WHERE run_id = ?", [json.dumps(sender), run])
    at = render(db, monkeypatch, "latency", run=run)
    infos = [i.value for i in at.info]
    assert not at.dataframe and not at.get("plotly_chart"), infos
    assert len(infos) == 1 and "cache-only" in infos[0] and "No finished requests" not in infos[0], infos


def test_a_cache_only_run_of_over_a_thousand_requests_is_charted_whole(tmp_path, monkeypatch):
    """A cache-only replay writes no request spans, and its lookups are a millisecond of
    virtual time apart: the dashboard read its length as 0, its time window as 0 to 1 s, and
    the Hit rate and Evictions pages of a run of 1,200 requests charted the first 1,000 alone
    (a cumulative hit rate that never reached the run's, evictions short of its count)."""
    from pathlib import Path

    from apptest import traces

    from kvtrace.replay.run import RunSpec, run_replay

    trace = str(Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl")
    db = str(tmp_path / "co.duckdb")
    done = run_replay(RunSpec(trace, mode="cache-only", capacity_blocks=300, limit=1200), db=db)
    summary = done.summary
    assert summary["requests"] == 1200 and summary["evictions"] > 0
    at = render(db, monkeypatch, "hit_rate", run=done.run_id)
    (cumulative,) = [t for t in traces(at) if t.get("name") == "prefix cache hit rate (cumulative)"]
    assert cumulative["y"][-1] == pytest.approx(summary["prefix_cache_hit_rate"])
    sources = [t for t in traces(at) if t.get("name") in ("local cache hit", "local compute")]
    assert sum(sum(t["y"]) for t in sources) == summary["prefix_cache_queries"]
    at = render(db, monkeypatch, "evictions", run=done.run_id)
    charted = [t for t in traces(at) if t.get("name") == "LRU eviction"]
    assert charted and sum(charted[0]["y"]) == summary["evictions"]


def test_a_collected_cache_only_runs_lookups_before_its_first_eviction_are_charted(tmp_path, monkeypatch):
    """A collected run on its sender's clock, of a cache-only replay (lookups, no request
    spans): its time axis started at its first eviction, and the Hit rate page's prompt
    tokens by source left out every lookup before it (1.3M of 17.5M tokens, unsaid)."""
    from pathlib import Path

    from apptest import traces

    from kvtrace.replay.run import RunSpec, run_replay

    trace = str(Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl")
    db = str(tmp_path / "co.duckdb")
    done = run_replay(RunSpec(trace, mode="cache-only", capacity_blocks=2000, limit=300), db=db)
    with duckdb.connect(db) as con:  # (as `kvtrace collect` records a sender's run: mode otlp, no config)
        con.execute("UPDATE runs SET mode = 'otlp', config = NULL WHERE run_id = ?", [done.run_id])
    at = render(db, monkeypatch, "hit_rate", run=done.run_id)
    sources = [t for t in traces(at) if t.get("name") in ("local cache hit", "local compute")]
    assert len(sources) == 2
    assert sum(sum(t["y"]) for t in sources) == done.summary["prefix_cache_queries"]


def test_a_live_captures_latency_tiles_do_not_say_modelled(tmp_path, monkeypatch):
    """A live capture has no request times (its caption says so), and its Overview tiles
    read "TTFT median (modelled)". Runs without times are labelled so in every view."""
    from kvtrace.metrics import NO_TIMES, times_word
    from kvtrace.store.writer import Store

    db = str(tmp_path / "live.duckdb")
    with Store.open(db) as store:
        run = store.create_run("captured", trace_source="tcp://h:1", mode="live", config={"endpoint": "tcp://h:1"})
        store.finish_run(run, summary={"batches": 0, "events": 0, "nothing_received": False})
    at = render(db, monkeypatch, "overview", run=run)
    labels = [m.label for m in at.metric if m.label.startswith(("TTFT", "TPOT", "ITL"))]
    assert len(labels) == 5 and all(label.endswith(f"({NO_TIMES})") for label in labels), labels
    assert times_word(("live", None)) == times_word(("cache-only/lru", None)) == NO_TIMES
    assert times_word(("engine", "h200"), ("live", None)) == "modelled" and times_word(("otlp", None)) == "recorded"


def test_a_failed_runs_pages_do_not_advise_the_replay_that_failed(failed_pair, monkeypatch):
    """A failed run's Evictions, Stale and Compare pages said "Fill it with the same replay run
    to its end" and suggested a study at its own settings: the failure is deterministic, so
    both fail again (a pool too small for the first request)."""
    db, a, b = failed_pair
    said = []
    for page, params in (("evictions", {"run": b}), ("stale", {"run": b}), ("compare", {"run": b})):
        at = render(db, monkeypatch, page, **params)
        texts = [x.value for x in (*at.info, *at.caption, *at.markdown, *at.warning)]
        said += texts
        assert not any("the same replay run to its end" in t for t in texts), (page, texts)
    assert any("settings it can finish" in t for t in said), said
    assert not any("--capacity-blocks 4" in t for t in said), said


def test_a_collected_run_of_lookups_whose_sender_sent_no_record_has_no_latency_page_of_blanks(tmp_path, monkeypatch):
    """The collected cache-only run above, its sender killed before its record: Overview
    counted 71 requests (from its lookups) and Latency said 'No finished requests' six times."""
    import synthetic_run

    db = str(tmp_path / "collected.duckdb")
    run = synthetic_run.write_collected_run(db)
    with duckdb.connect(db) as con:
        con.execute("DELETE FROM spans_request WHERE run_id = ?", [run])
        con.execute("DELETE FROM spans_step WHERE run_id = ?", [run])  # (a cache-only sender has no steps)
        con.execute("UPDATE runs SET status = 'incomplete', summary = NULL WHERE run_id = ?", [run])
    overview = render(db, monkeypatch, "overview", run=run)
    requests = next(m.value for m in overview.metric if m.label == "Requests")
    assert requests not in ("–", "0"), requests
    at = render(db, monkeypatch, "latency", run=run)
    infos = [i.value for i in at.info]
    assert not at.dataframe and not at.get("plotly_chart"), infos
    assert len(infos) == 1 and "no request times" in infos[0] and "No finished requests" not in infos[0], infos


def test_overview_shows_a_runs_table_disagreements(tmp_path, monkeypatch):
    """A run whose worker and cache disagreed on block tables (the external-hit-running-cow
    study's off run: 190) said so on no dashboard page."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "t.duckdb")
    res = run_replay(RunSpec("gen:study-external-hit-running-cow", limit=20, without=("external-hit-running-cow",),
                             preset="kimi-hybrid", capacity_blocks=20, external_capacity_blocks=4096), db=db)
    assert res.summary["table_disagreements"] > 0  # (the case at hand)
    at = render(db, monkeypatch, "overview", run=res.run_id)
    tile = next(m.value for m in at.metric if m.label == "Table disagreements")
    assert tile == f"{res.summary['table_disagreements']:,}"
