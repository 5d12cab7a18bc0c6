"""Fixes of the dashboard re-probe of session 26: a collected replay on its direct twin's time
axis (and its Stale tables on the chart's), lookups that name no prefix said why truly, a
one-lookup cache-only run's window of one step, a linked window past the run's end said."""

from __future__ import annotations

import json
import shutil

import duckdb
import pyarrow as pa
import pytest
from apptest import render, traces


def _trace(path, requests: list[dict]) -> str:
    lines = [{"kvtrace_trace": 1, "hash_block_size": 16, "block_size": 16}, *requests]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _collected_copy(db: str, dest: str, run_id: str) -> str:
    """``db`` copied to ``dest`` with ``run_id`` recorded as a collector records a kvtrace
    replay: mode otlp, the sender's config kept."""
    shutil.copy(db, dest)
    with duckdb.connect(dest) as con:
        con.execute("UPDATE runs SET mode = 'otlp' WHERE run_id = ?", [run_id])
    return dest


def _axis(at) -> tuple[float, dict[str, list[float]]]:
    """The page's slider end and its charts' x values by trace name."""
    xs: dict[str, list[float]] = {}
    for t in traces(at):
        if isinstance(t.get("x"), list):
            xs.setdefault(t["name"], []).extend(t["x"])
    return at.slider[0].max, xs


@pytest.mark.parametrize(("mode", "n"), [("engine", 6), ("cache-only", 120)])
def test_a_collected_replay_is_on_its_direct_twins_time_axis(tmp_path, monkeypatch, mode, n):
    """A collected replay (stored mode otlp) was put on its first time's axis, not its sender's
    virtual clock: a trace starting at 40 s had a slider of 0 to 0.x s beside its direct twin's
    0 to 41 s, and a collected cache-only run other windows than its twin's (20 where its twin's
    store picks 120, one a lookup)."""
    from kvtrace.replay.run import RunSpec, run_replay

    trace = _trace(tmp_path / "late.jsonl", [
        {"request_id": f"q{i}", "arrival_ns": 40_000_000_000 + i * 10_000_000, "input_length": 64,
         "output_length": 4, "hash_ids": [0, 1, 2, i % 9 + 3]} for i in range(n)])
    db = str(tmp_path / "direct.duckdb")
    spec = RunSpec(trace, preset="dense-attention") if mode == "engine" else RunSpec(
        trace, mode="cache-only", capacity_blocks=8)
    run = run_replay(spec, db=db).run_id
    collected = _collected_copy(db, str(tmp_path / "collected.duckdb"), run)
    direct_max, direct_x = _axis(render(db, monkeypatch, "hit_rate", run=run))
    at = render(collected, monkeypatch, "hit_rate", run=run)
    assert [w.value for w in at.warning if "window" in w.value] == []
    got_max, got_x = _axis(at)
    assert direct_x and (got_max, got_x) == (direct_max, direct_x)
    if mode == "engine":
        assert direct_max >= 40  # (the case: the sender's clock starts late)


def test_a_collected_runs_stale_tables_are_on_the_charts_axis(tmp_path, monkeypatch):
    """The Stale page's tables read their spans' raw times where its chart counts from the run's
    time origin: a run on its sender's clock (a collector's, from 300 s) listed its stale hashes
    and divergent outputs at 300,000 ms beside a chart and a window of 0 to 5 s."""
    import synthetic_run

    from kvtrace.store.writer import Store

    steps, _ = synthetic_run.simulate(False, n_requests=40)
    table = synthetic_run._table(steps)
    shift = 300_000_000_000
    for name in ("start_ns", "end_ns", "arrival_ns", "first_scheduled_ns", "first_token_ns"):
        i = table.schema.get_field_index(name)
        col = table.column(i)
        table = table.set_column(i, name, pa.compute.add(col, pa.scalar(shift, col.type)))
    db = str(tmp_path / "sender.duckdb")
    with Store.open(db) as store:
        run = store.create_run("collected", mode="otlp")
        store.append_spans(table, run_id=run)
        store.flush()
    with duckdb.connect(db, read_only=True) as con:
        first_div = con.execute("SELECT min(start_ns) FROM spans WHERE run_id = ? AND name = "
                                "'kvtrace.verify.divergent_output'", [run]).fetchone()[0]
    assert first_div > shift  # (the case: the sender's times start late)
    at = render(db, monkeypatch, "stale", run=run)
    end_ms = at.slider[0].max * 1e3
    tables = {tuple(d.value.columns): d.value for d in at.dataframe if "time_ms" in d.value.columns}
    assert len(tables) >= 2, list(tables)  # (the stale hashes' and the divergent outputs')
    for columns, frame in tables.items():
        assert frame["time_ms"].min() >= 0 and frame["time_ms"].max() <= end_ms, (columns, frame["time_ms"])
    (divergent,) = [f for c, f in tables.items() if "expected_token" in c]
    x = [v for t in traces(at) if t["name"] == "divergent output" for v in t["x"]]
    assert x and min(x) * 1e3 <= divergent["time_ms"].min() == pytest.approx((first_div - shift) / 1e6)


def test_lookups_of_prompts_shorter_than_a_block_are_said_to_fill_none(tmp_path, monkeypatch):
    """An engine run whose prompts are shorter than a block names no prefix in its lookups: the
    Hit rate page said that was because 'a Belady run records none'."""
    from kvtrace.replay.run import RunSpec, run_replay

    trace = _trace(tmp_path / "short.jsonl", [
        {"request_id": f"q{i}", "arrival_ns": i * 1_000_000, "input_length": 10, "output_length": 2,
         "hash_ids": [1]} for i in range(4)])
    db = str(tmp_path / "short.duckdb")
    run = run_replay(RunSpec(trace, preset="dense-attention"), db=db).run_id
    with duckdb.connect(db, read_only=True) as con:
        lookups, named = con.execute("SELECT count(*), count(root_hash) FROM spans WHERE run_id = ? AND "
                                     "name = 'kvtrace.cache.lookup'", [run]).fetchone()
    assert lookups > 0 and named == 0
    infos = [i.value for i in render(db, monkeypatch, "hit_rate", run=run).info]
    said = [i for i in infos if "name no prefix" in i]
    assert said == [f"This run's {lookups:,} lookup spans name no prefix (no root hash: no prompt fills a block, "
                    "the prefix's first), so no prefix reuse."], infos


def test_a_one_lookup_cache_only_run_spans_one_step_and_a_clamped_link_is_said(tmp_path, monkeypatch):
    """A cache-only run of one request got a slider of 1 ns (its one window's end read as its
    start + 1), and ?t1=0.5 was clamped to it unsaid."""
    from kvtrace.replay.run import RunSpec, run_replay

    trace = _trace(tmp_path / "one.jsonl", [{"request_id": "q0", "arrival_ns": 0, "input_length": 64,
                                            "output_length": 1, "hash_ids": [0, 1, 2, 3]}])
    db = str(tmp_path / "one.duckdb")
    run = run_replay(RunSpec(trace, mode="cache-only", capacity_blocks=8), db=db).run_id
    at = render(db, monkeypatch, "hit_rate", run=run)
    assert at.slider[0].max == pytest.approx(1e-3) and not at.warning, [w.value for w in at.warning]
    at = render(db, monkeypatch, "hit_rate", run=run, t1="0.5")
    assert at.slider[0].value == pytest.approx((0, 1e-3))
    assert [w.value for w in at.warning] == [
        "Time window t1=`0.5` from the link is outside this run (0 to 0.001 s): 0 to 0.001 s is shown."]


def test_collected_cache_only_runs_are_told_as_cache_only_on_the_compare_page(tmp_path, monkeypatch):
    """The Compare page read "cache-only" from the stored mode: two collected cache-only replays
    (mode otlp) got the generic "records no request spans" wording and a fill-to-its-end hint,
    not the cache-only one their direct twins get (fix-dash probe)."""
    from kvtrace.replay.run import RunSpec, run_replay

    trace = _trace(tmp_path / "t.jsonl", [
        {"request_id": f"q{i}", "arrival_ns": i * 10_000_000, "input_length": 64, "output_length": 4,
         "hash_ids": [0, 1, 2, i % 9 + 3]} for i in range(20)])
    db = str(tmp_path / "direct.duckdb")
    a = run_replay(RunSpec(trace, mode="cache-only", capacity_blocks=8), db=db).run_id
    b = run_replay(RunSpec(trace, mode="cache-only", capacity_blocks=6), db=db).run_id
    collected = _collected_copy(db, str(tmp_path / "collected.duckdb"), a)
    with duckdb.connect(collected) as con:
        con.execute("UPDATE runs SET mode = 'otlp' WHERE run_id = ?", [b])

    def said(path: str) -> list[str]:
        at = render(path, monkeypatch, "compare", run=a, b=b)
        return [x.value for x in [*at.info, *at.caption, *at.markdown] if "cache-only runs have none" in x.value]

    assert said(db) and said(collected)
