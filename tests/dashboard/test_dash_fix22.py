"""Fixes of probe 22's re-probe of the dashboard: a stopped B on Compare, tiles at diff's
resolution, a request still in flight, a damaged engine run's times, a nameless Belady
run, a vLLM-backend run's per-group chart, a run without spans' request count."""

from __future__ import annotations

import json
import shutil

import duckdb
import pytest
from apptest import render, traces
from streamlit.proto.Metric_pb2 import Metric

from kvtrace.errors import TraceFormatError

STOP_AT = 14  # the stopped run reads this many requests of the trace's 24, then fails


@pytest.fixture(scope="module")
def stopped_pair(tmp_path_factory) -> tuple[str, str, str]:
    """(store, A, B): A replays a trace to its end; B replays the same trace and settings and
    fails after reading STOP_AT requests (a bad line met mid-run: status failed, no summary,
    the requests in flight then without a request span)."""
    from kvtrace.replay.generate import write_generated
    from kvtrace.replay.readers import source
    from kvtrace.replay.run import RunSpec, run_replay

    folder = tmp_path_factory.mktemp("stopped")
    trace = folder / "t.jsonl"
    write_generated("chat", trace, seed=3, num_requests=24)
    # (arrivals 8x closer: requests overlap, so some are in flight when B stops)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    trace.write_text("".join(json.dumps({**r, "arrival_ns": r["arrival_ns"] // 8} if "arrival_ns" in r else r) + "\n"
                             for r in lines))
    db = str(folder / "s.duckdb")
    a = run_replay(RunSpec(str(trace), name="whole"), db=db).run_id
    real = source.TraceSource.__iter__

    def stopping(self):
        for i, request in enumerate(real(self)):
            if i == STOP_AT:
                raise TraceFormatError(str(trace), i + 1, "stopped here")
            yield request

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(source, "CHECKED_BEFORE_DIGEST", 5)  # (the digest's read stops before STOP_AT)
        mp.setattr(source.TraceSource, "__iter__", stopping)
        with pytest.raises(TraceFormatError):
            run_replay(RunSpec(str(trace), name="stopped"), db=db)
    with duckdb.connect(db) as con:
        ((b, status),) = con.execute("SELECT run_id, status FROM runs WHERE run_id != ?", [a]).fetchall()
    assert status == "failed" and a is not None
    return db, a, b


def test_compare_with_a_stopped_b_says_what_diff_says(stopped_pair, monkeypatch):
    """A stopped B on Compare: 'All N requests got the same cached tokens ...: this change does
    not move the prefix cache' beside a hit-rate tile that moved, where `kvtrace diff` says
    'Run B is failed: partial numbers' and 'only in A: N'."""
    from kvtrace.compare.source import diff_runs

    db, a, b = stopped_pair
    r = diff_runs(db, a, b).requests
    assert r is not None and r.only_a > 0 and r.requests and not (r.gained or r.lost)
    at = render(db, monkeypatch, "compare", run=a, b=b)
    said = [w.value for w in at.warning]
    assert "Run B (stopped) is **failed**: partial numbers (they cover only what was recorded)." in said, said
    infos = [i.value for i in at.info]
    assert not [i for i in infos if "does not move the prefix cache" in i], infos
    (line,) = [i for i in infos if i.startswith("All ")]
    assert f"All {r.requests:,} requests both runs hold" in line, line
    assert f"only in A: {r.only_a:,}, only in B: {r.only_b:,}" in line, line


def _tiles(at) -> dict:
    return {m.label: m for m in at.metric}


def test_a_compare_tile_below_diffs_resolution_shows_no_change(dashboard_db, tmp_path, monkeypatch):
    """An ITL median 3e-6 ms lower in B: `kvtrace diff` prints 0.0000, +0.0% and no verdict;
    the tile said '-0.00 ms' with a green 'better' arrow."""
    from kvtrace.compare.render import fmt
    from kvtrace.compare.source import diff_runs
    from kvtrace.store import read

    db = str(tmp_path / "tiny.duckdb")
    shutil.copy(dashboard_db, db)
    a, b = read.runs(db)["run_id"].to_list()[:2]
    sa, sb = read.run(db, a)["summary"], read.run(db, b)["summary"]
    sb["median_itl_ms"] = sa["median_itl_ms"] - 3e-6
    sb["p99_itl_ms"] = sa["p99_itl_ms"] - 2.5  # (a change diff shows: coloured, in diff's digits)
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET summary = ? WHERE run_id = ?", [json.dumps(sb), b])
    m = diff_runs(db, a, b).metric("median_itl_ms")
    assert fmt(m.delta, signed=True) == "0.0000" and m.verdict == "same"
    tiles = _tiles(render(db, monkeypatch, "compare", run=a, b=b))
    tiny = next(t for label, t in tiles.items() if label.startswith("ITL median"))
    assert tiny.proto.delta == "0.0000 ms", tiny.proto.delta
    assert tiny.proto.color == Metric.MetricColor.GRAY and tiny.proto.direction == Metric.MetricDirection.NONE
    moved = next(t for label, t in tiles.items() if label.startswith("ITL p99"))
    assert moved.proto.delta == f"{fmt(-2.5, signed=True)} ms", moved.proto.delta
    # (no bootstrap CI judged the hand-made p99: no verdict, gray, since c055005)
    assert moved.proto.color == Metric.MetricColor.GRAY


def test_the_requests_tile_of_a_run_without_spans_is_unknown_not_zero(tmp_path, monkeypatch):
    """A collected run without spans: the runs table and `kvtrace runs` show – requests, the
    Overview's tile said 0."""
    from kvtrace.store.writer import Store

    db = str(tmp_path / "empty.duckdb")
    with Store.open(db) as store:
        run = store.create_run("nothing sent", mode="otlp")
        store.finish_run(run, summary={})
    shown = {m.label: m.value for m in render(db, monkeypatch, run=run).metric}
    assert shown["Requests"] == "–", shown


def test_a_request_still_in_flight_is_not_called_missing_from_the_run(stopped_pair, monkeypatch):
    """A link to a request the stopped run had not finished: 'not in this run', though its
    lookups are in the run; it has no finished request span."""
    db, _, b = stopped_pair
    with duckdb.connect(db) as con:
        rows = con.execute("SELECT DISTINCT request_id FROM spans WHERE run_id = $r AND request_id NOT IN "
                           "(SELECT request_id FROM request_spans WHERE run_id = $r) ORDER BY 1", {"r": b}).fetchall()
    assert rows
    rid = rows[0][0]
    said = [w.value for w in render(db, monkeypatch, "latency", run=b, request=rid).warning]
    assert said == [f"Request `{rid}` from the link has spans in this run but no finished request span (it had not "
                    "finished when the run's spans end): the slowest one is shown instead."], said
    said = [w.value for w in render(db, monkeypatch, "latency", run=b, request="nowhere").warning]
    assert said == ["Request `nowhere` from the link is not in this run: the slowest one is shown instead."], said


def test_a_damaged_engine_runs_times_are_not_called_cache_only(dashboard_db, tmp_path, monkeypatch):
    """An engine run whose record is damaged (its settings not read): Latency said 'Times:
    none (no clock: cache-only)' beside its '(modelled)' tables."""
    from kvtrace.store import read

    db = str(tmp_path / "damaged.duckdb")
    shutil.copy(dashboard_db, db)
    run = read.runs(db)["run_id"].to_list()[0]
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET summary = '[1]' WHERE run_id = ?", [run])
    assert read.run(dashboard_db, run)["mode"] == "engine"
    at = render(db, monkeypatch, "latency", run=run)
    (times,) = [c.value for c in at.caption if c.value.startswith("Times:")]
    assert "cache-only" not in times and "no clock" not in times, times
    assert times == ("Times: modelled by a cost model not named here: this run's stored settings are damaged, so "
                     "not read (virtual time, not measured)."), times


def test_a_nameless_belady_run_is_named_by_its_id_in_the_legend(tmp_path, monkeypatch):
    """A Belady run without a name: the hit-rate legend read 'Belady bound (None, ...)'."""
    from kvtrace.dashboard import run_config
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    db = str(tmp_path / "belady.duckdb")
    engine = run_replay(RunSpec("gen:mixed", limit=12, name="engine"), db=db).run_id
    cap = run_config.capacity(read.run(db, engine)["config"])
    assert cap is not None
    bel = run_replay(RunSpec("gen:mixed", limit=12, mode="cache-only", policy="belady", capacity_blocks=cap.blocks,
                             block_size=cap.block_size), db=db).run_id
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET name = NULL WHERE run_id = ?", [bel])
    at = render(db, monkeypatch, "hit_rate", run=engine)
    names = [t["name"] for t in traces(at) if t["name"].startswith("Belady bound")]
    assert names == [f"Belady bound ({bel}, {cap})"], names


def test_a_vllm_backend_runs_empty_group_chart_says_why_and_names_no_command(tmp_path, monkeypatch, vllm_api):
    """A --backend vllm run recorded by an older kvtrace has no per-group hits (vLLM's common hit,
    marked inferred, is left out): its empty chart said 'Fill it with `kvtrace demo`...'. A run of
    this kvtrace has each group's own hit (vLLM's per-group lookup): its chart is drawn."""
    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "vllm.duckdb")
    run = run_replay(RunSpec("gen:chat", limit=4, backend="vllm", capacity_blocks=100), db=db).run_id
    infos = [i.value for i in render(db, monkeypatch, "hit_rate", run=run).info]
    assert not [i for i in infos if i.startswith("No per-group hits")], infos
    con = duckdb.connect(db)  # (as an older kvtrace wrote it)
    con.execute("""UPDATE spans_lookup SET extra_attributes = map_concat(extra_attributes,
                   MAP {'kvtrace.inferred': '["kvtrace.lookup.hit_tokens_per_group"]'}) WHERE run_id = ?""", [run])
    con.close()
    infos = [i.value for i in render(db, monkeypatch, "hit_rate", run=run).info]
    (said,) = [i for i in infos if i.startswith("No per-group hits")]
    assert "Fill it with" not in said and "a vLLM-backend run an older kvtrace recorded" in said, said

