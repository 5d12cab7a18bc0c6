"""Probe 26 of the dashboard (truth): what the pages say a run lacks is checked against the
store's own spans (raw SQL): a Belady run's lookups, a cache-only run's steps, and misses a
hybrid run's state group evicted."""

from __future__ import annotations

import duckdb
import pytest
from apptest import render, traces


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, str, str, str]:
    """(store, engine, lru, belady): gen:mixed replayed in engine mode (kimi-hybrid: an
    attention and a state group, 200 blocks) and cache-only with LRU and Belady at 50 blocks."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path_factory.mktemp("probe26") / "p.duckdb")
    engine = run_replay(RunSpec("gen:mixed", limit=60, capacity_blocks=200), db=db).run_id
    lru = run_replay(RunSpec("gen:mixed", limit=60, mode="cache-only", capacity_blocks=50), db=db).run_id
    belady = run_replay(RunSpec("gen:mixed", limit=60, mode="cache-only", policy="belady", capacity_blocks=50),
                        db=db).run_id
    assert engine and lru and belady
    return db, engine, lru, belady


def _count(db: str, sql: str, run_id: str) -> int:
    with duckdb.connect(db, read_only=True) as con:
        return con.execute(sql, [run_id]).fetchone()[0]


def test_a_belady_runs_hit_rate_page_shows_its_prefixes_as_its_lru_twin(runs, monkeypatch):
    """A Belady run's lookups name their prefix (root hash) as its LRU twin's do (30ad1b5): its
    Hit rate page said 'No lookup spans in this run' beside them, then that they named none.
    Its hottest prefixes are its twin's, lookup for lookup (their hits are the policies')."""
    db, _, lru, belady = runs
    sql = ("SELECT count(*), count(root_hash) FROM spans WHERE run_id = ? AND name = 'kvtrace.cache.lookup'")
    with duckdb.connect(db, read_only=True) as con:
        lookups, named = con.execute(sql, [belady]).fetchone()
        assert (lookups, named) == tuple(con.execute(sql, [lru]).fetchone()) and 0 < named <= lookups

    def prefixes(run: str) -> list[tuple]:
        at = render(db, monkeypatch, "hit_rate", run=run)
        infos = [i.value for i in at.info]
        assert not any("No lookup spans" in i or "name no prefix" in i for i in infos), infos
        (table,) = [d.value for d in at.dataframe if "root_hash" in d.value.columns]
        return sorted(zip(table["root_hash"], table["lookups"], strict=True))

    belady_rows = prefixes(belady)
    assert belady_rows and belady_rows == prefixes(lru)


def test_a_cache_only_runs_usage_chart_does_not_say_it_has_no_step_spans(runs, monkeypatch):
    """A cache-only replay writes a step span per lookup, with no pool usage: its Hit rate page
    said 'No engine step spans in this run (cache-only runs have none)'."""
    db, _, lru, _ = runs
    steps = _count(db, "SELECT count(*) FROM spans WHERE run_id = ? AND name = 'kvtrace.engine.step'", lru)
    usage = _count(db, "SELECT count(usage) FROM spans WHERE run_id = ? AND name = 'kvtrace.engine.step'", lru)
    assert steps > 0 and usage == 0
    infos = [i.value for i in render(db, monkeypatch, "hit_rate", run=lru).info]
    assert not any("No engine step spans" in i for i in infos), infos
    assert any(i.startswith("No pool usage in this run: its step spans carry none") for i in infos), infos


def test_attribution_of_a_hybrid_run_says_it_traces_group_0_alone(runs, monkeypatch):
    """The store traces misses to group 0's evictions alone. A hybrid run whose state group
    evicted (and whose lookups then missed on those states) was said to have no miss on an
    evicted block. (The fact checked is the run's evictions outside group 0, whatever a
    lookup's first miss names: how the cache picks it is the cache's.)"""
    db, engine, _, _ = runs
    other_group = _count(db, "SELECT count(*) FROM evicted_blocks WHERE run_id = ? AND group_id != 0", engine)
    assert other_group > 0  # (the case: evictions attribution does not trace)
    at = render(db, monkeypatch, "evictions", run=engine)
    said = [i.value for i in at.info] + [c.value for c in at.caption]
    attribution = [t for t in said if "that had been evicted" in t or "cached before, traced back" in t]
    assert attribution, said
    assert all("of group 0 (attention)" in t and "another KV group evicted is not counted" in t
               for t in attribution), attribution


def test_a_replay_of_a_trace_that_starts_late_shows_its_data_in_the_time_window(tmp_path, monkeypatch):
    """A finished replay's time window ran from 0 to its summary's virtual_duration_s, which
    runs from its first arrival: a trace whose first request arrives at 40 s (a slice of a
    longer trace) had every windowed chart 'outside the time window 0 to 0.x s' and a slider
    that could not reach its data."""
    import json

    from kvtrace.replay.run import RunSpec, run_replay

    trace = tmp_path / "late.jsonl"
    lines = [{"kvtrace_trace": 1, "hash_block_size": 16, "block_size": 16}]
    lines += [{"request_id": f"q{i}", "arrival_ns": 40_000_000_000 + i * 10_000_000, "input_length": 64,
               "output_length": 4, "hash_ids": [0, 1, 2, i + 3]} for i in range(6)]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    db = str(tmp_path / "late.duckdb")
    run = run_replay(RunSpec(str(trace), preset="dense-attention"), db=db).run_id
    with duckdb.connect(db, read_only=True) as con:
        first, last, n = con.execute("SELECT min(arrival_ns), max(end_ns), count(*) FROM spans WHERE run_id = ? "
                                     "AND name = 'kvtrace.request'", [run]).fetchone()
        duration = json.loads(con.execute("SELECT summary FROM runs WHERE run_id = ?", [run]).fetchone()[0])[
            "virtual_duration_s"]
    assert n == 6 and first >= 40e9 and duration * 1e9 < first  # (the case: data past the duration from 0)
    for page, what in (("hit_rate", "prefix cache hit rate (per window)"), ("latency", "mean ITL")):
        at = render(db, monkeypatch, page, run=run)
        assert not [i.value for i in at.info if "widen the window" in i.value], [i.value for i in at.info]
        xs = [x for t in traces(at) if t["name"] == what for x in t["x"]]
        assert xs and all(first / 1e9 - 1 <= x <= last / 1e9 for x in xs), xs
    hit = traces(render(db, monkeypatch, "hit_rate", run=run))
    scheduled = sum(y for t in hit if t["name"] == "local compute" for y in t["y"])
    scheduled += sum(y for t in hit if t["name"] == "local cache hit" for y in t["y"])
    assert scheduled == 6 * 64  # every prompt token of the run in the chart, none windowed away


def test_a_cache_only_runs_block_histograms_say_their_steps_are_requests(runs, monkeypatch):
    """A cache-only replay steps once a request (its lookup): its lifetime, idle and reuse-gap
    histograms were 'in scheduler steps', of a run that has no scheduler."""
    import json

    db, engine, lru, _ = runs
    steps = _count(db, "SELECT count(DISTINCT step) FROM spans WHERE run_id = ? AND name = 'kvtrace.cache.lookup'",
                   lru)
    lookups = _count(db, "SELECT count(*) FROM spans WHERE run_id = ? AND name = 'kvtrace.cache.lookup'", lru)
    assert steps == lookups == 60  # (the case: one step a request)

    def axes(run: str) -> tuple[set[str], list[str]]:
        at = render(db, monkeypatch, "evictions", run=run)
        titles = set()
        for el in at.get("plotly_chart"):
            layout = json.loads(el.proto.spec)["layout"]
            if any(a.get("text") == "lifetime at eviction" for a in layout.get("annotations", [])):
                titles |= {v["title"]["text"] for k, v in layout.items() if k.startswith("xaxis") and "title" in v}
        return titles, [c.value for c in at.caption if c.value.startswith("Exact distributions")]

    titles, captions = axes(lru)
    assert titles == {"requests (a cache-only run's steps: one lookup each)"}, titles
    assert captions and "in requests" in captions[0] and "scheduler steps" not in captions[0], captions
    titles, captions = axes(engine)  # (an engine run's are its scheduler's steps)
    assert titles == {"scheduler steps"} and "in scheduler steps" in captions[0], (titles, captions)


@pytest.mark.parametrize(("value", "on", "warned"), [("1", True, False), ("0", False, False), ("true", False, True),
                                                     ("maybe", False, True)])
def test_a_linked_log_scale_that_is_no_switch_is_named(runs, monkeypatch, value, on, warned):
    """?log=true turned the Latency page's log scale off and said nothing, where every other
    linked value that is not one is named and ignored."""
    db, engine, _, _ = runs
    at = render(db, monkeypatch, "latency", run=engine, log=value)
    assert at.checkbox(key="qp_log").value is on
    said = [w.value for w in at.warning if "from the link" in w.value]
    assert said == ([f"Log scale log=`{value}` from the link is not 1 (on) or 0 (off): ignored, it is off."]
                    if warned else []), said


def test_the_divergent_outputs_table_is_in_virtual_ms_as_the_stale_hashes_table(stale_db, monkeypatch):
    """The Stale page's stale hashes table shows time_ms and its divergent outputs table showed
    time_ns beside it: one page, two units, no word of which."""
    with duckdb.connect(stale_db, read_only=True) as con:
        run, first_ns = con.execute("SELECT run_id, min(start_ns) FROM spans WHERE name = "
                                    "'kvtrace.verify.divergent_output' GROUP BY run_id ORDER BY run_id").fetchone()
    at = render(stale_db, monkeypatch, "stale", run=run)
    tables = [d.value for d in at.dataframe if "expected_token" in d.value.columns]
    assert len(tables) == 1, [list(d.value.columns) for d in at.dataframe]
    (table,) = tables
    assert "time_ns" not in table.columns and table["time_ms"].min() == pytest.approx(first_ns / 1e6)
    assert any("when (virtual ms)" in c.value for c in at.caption)
