"""Probe 22 of the dashboard: what a sender may leave out of its spans, names with spaces
at their ends, and links naming a curve or a KV group the page has no figure for."""

from __future__ import annotations

import itertools

import duckdb
from apptest import render


def _collected(db: str) -> str:
    import synthetic_run

    return synthetic_run.write_collected_run(db)


def test_a_request_whose_sender_left_out_its_ttft_and_prompt_length_is_no_zero_in_the_picker(tmp_path, monkeypatch):
    """A collected run's request span without a first token or prompt length: the picker
    said 'TTFT 0.0 ms' (the fastest of all, for no measurement) and 'cached 0/None'."""
    db = str(tmp_path / "collected.duckdb")
    run = _collected(db)
    with duckdb.connect(db) as con:
        con.execute("UPDATE spans_request SET ttft_ns = NULL, first_token_ns = NULL, num_prompt_tokens = NULL "
                    "WHERE run_id = ?", [run])
    at = render(db, monkeypatch, "latency", run=run)
    (picker,) = [s for s in at.selectbox if s.label.startswith("Request")]
    assert picker.options
    for label in picker.options:
        assert "TTFT –" in label and "/– tokens" in label, label
        assert "0.0 ms" not in label and "None" not in label, label


def test_a_name_with_a_space_at_an_end_is_shown_bold_not_with_its_asterisks(tmp_path, monkeypatch):
    """CommonMark opens ``**`` only before a character that is no space: the Overview showed
    a sender's run named ' x ' (or '  ') as '** x **', asterisks and all."""
    from markdown_it import MarkdownIt

    from kvtrace.store.writer import Store

    db = str(tmp_path / "names.duckdb")
    names = ("  ", " padded ", "end ")
    with Store.open(db) as store:
        for name in names:
            store.finish_run(store.create_run(name, mode="otlp"), summary={})
    for run, name in zip(("r1", "r2", "r3"), names):
        at = render(db, monkeypatch, run=run)
        html = MarkdownIt("commonmark").render(at.markdown[0].value)
        assert "**" not in html, html
        bold = html.split("<strong>", 1)[1].split("</strong>", 1)[0]
        assert bold.replace("\u2060", "") == name, (bold, name)


def test_a_linked_curve_on_a_store_without_curves_is_named_once_and_dropped(tmp_path, monkeypatch):
    """The Capacity page of a store without curves ignored ?curve= silently and kept it in
    the URL (every other page names a link's value it cannot show, once)."""
    db = str(tmp_path / "nocurve.duckdb")
    run = _collected(db)
    at = render(db, monkeypatch, "capacity", run=run, curve="c7")
    assert [w.value for w in at.warning] == ["Curve `c7` from the link is not in this store: it holds none."]
    assert "curve" not in at.query_params
    assert any("holds no capacity curve" in i.value for i in at.info)


def test_a_linked_kv_group_of_a_vllm_backend_run_is_not_said_to_be_missing(tmp_path, monkeypatch, vllm_api):
    """A --backend vllm run an older kvtrace recorded has KV groups 0 and 1 but no per-group hits
    (vLLM's common hit, marked inferred): a link to its group 0 said 'KV group 0 from the link is
    not in this run'. A run of this kvtrace has each group's own hit: the link is taken."""
    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "vllm.duckdb")
    run = run_replay(RunSpec("gen:chat", limit=4, backend="vllm", capacity_blocks=100), db=db).run_id
    assert [w.value for w in render(db, monkeypatch, "hit_rate", run=run, group="0").warning] == []
    con = duckdb.connect(db)  # (as an older kvtrace wrote it)
    con.execute("""UPDATE spans_lookup SET extra_attributes = map_concat(extra_attributes,
                   MAP {'kvtrace.inferred': '["kvtrace.lookup.hit_tokens_per_group"]'}) WHERE run_id = ?""", [run])
    con.close()
    at = render(db, monkeypatch, "hit_rate", run=run, group="0")
    said = [w.value for w in at.warning]
    assert said == ["KV group `0` from the link has no per-group hits in this run (below): every group is shown "
                    "instead."], said
    at = render(db, monkeypatch, "hit_rate", run=run, group="7")  # (not a group of the run's: said so)
    assert [w.value for w in at.warning] == ["KV group `7` from the link is not in this run: every group is shown "
                                             "instead."]


HUGE = 2**63 - 1  # a count no kvtrace run holds: a sum of two overflows


def test_one_run_whose_spans_overflow_leaves_the_stores_other_runs_readable(dashboard_db, tmp_path, monkeypatch):
    """An unfinished run whose spans hold a count near 2^63 (written by hand, or sent to a
    collector): its summary read from spans raised, and every page of the store was that one
    error, where `kvtrace runs` lists the run damaged and the others as before."""
    import shutil

    from kvtrace.store import read

    db = str(tmp_path / "overflow.duckdb")
    shutil.copy(dashboard_db, db)
    good, bad = read.runs(db)["run_id"].to_list()[:2]
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET status = 'failed', summary = NULL WHERE run_id = ?", [bad])
        con.execute(f"UPDATE spans_request SET num_prompt_tokens = {HUGE} WHERE run_id = ?", [bad])
    at = render(db, monkeypatch, run=good)
    assert not at.error and at.metric
    picker = at.selectbox(key="qp_run")
    assert any(o.endswith("DAMAGED") for o in picker.options), picker.options
    at = render(db, monkeypatch, run=bad)
    assert not at.error
    assert [w.value for w in at.warning if "spans hold values no kvtrace run holds" in w.value]


def test_runs_without_spans_are_not_read_back_from_spans(tmp_path, monkeypatch):
    """A failed run without spans has nothing to read back: each cost a summary query at
    every page load after the store changed (300 of them: 20 s), where `kvtrace runs`
    skips them."""
    from kvtrace.store import read
    from kvtrace.store.writer import Store

    db = str(tmp_path / "failed.duckdb")
    with Store.open(db) as store:
        failed = [store.create_run(f"failed {i}", mode="engine") for i in range(3)]
        for r in failed:
            store.finish_run(r, status="failed")
    run = _collected(db)  # (closed unfinished, with spans: read back)
    calls = []
    real = read.summary_with_spans
    monkeypatch.setattr(read, "summary_with_spans", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    at = render(db, monkeypatch, run=run)
    assert len(at.selectbox(key="qp_run").options) == 4
    assert calls == [run], calls


def test_a_stale_hash_span_without_its_hash_or_group_is_still_one_choice_each(stale_db, tmp_path, monkeypatch):
    """A stale-hash span that leaves out its block hash or group (a sender's): the picker's
    keys were all None (91 stale hashes, one choice), the drill-down said 'hash None' and
    'g None', and the chain was a raw type error ('block_hash: expected str, got None')."""
    import shutil

    from kvtrace.store import read
    from kvtrace.store.schema import SPAN_STALE_HASH

    run = next(r for r in read.runs(stale_db)["run_id"] if read.stale_hashes(stale_db, r).height > 1)
    db = str(tmp_path / "stale.duckdb")
    shutil.copy(stale_db, db)
    with duckdb.connect(db) as con:
        con.execute("UPDATE spans_verify SET block_hashes = NULL, group_id = NULL, block_ids = NULL "
                    "WHERE run_id = ? AND name = ?", [run, SPAN_STALE_HASH])
    stale = read.stale_hashes(db, run)
    assert stale["block_hash"].null_count() == stale.height > 1
    at = render(db, monkeypatch, "stale", run=run)
    assert not at.error
    picker = at.selectbox(key="qp_stale")
    assert picker.value is not None and len(set(picker.options)) == len(picker.options) == stale.height
    shown = {m.label: m.value for m in at.metric}
    assert shown["Block id (group)"] == "– (g–)"
    assert not [m.value for m in at.markdown if "None" in m.value]
    assert [i.value for i in at.info if "records no block hash" in i.value]


def _gap_s(starts: list[int], w: int) -> tuple[float, float]:
    """A time window (s) between two of ``starts`` (window starts, ns, of width ``w``) that
    holds none of them."""
    gaps = [(a, b) for a, b in itertools.pairwise(starts) if b - a >= 2 * w]
    assert gaps, starts
    lo, hi = gaps[0]
    return (lo + w // 4) / 1e9, (hi - w // 4) / 1e9


def test_a_time_window_without_the_runs_evictions_does_not_say_the_run_has_none(tmp_path, monkeypatch):
    """A window narrowed to where nothing was evicted said 'No evictions in this run: the cache
    never filled' of a run that evicted (and 'No decoded tokens in this run' on Latency)."""
    from kvtrace.dashboard import queries
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    db = str(tmp_path / "gaps.duckdb")
    done = run_replay(RunSpec("gen:mixed", limit=30), db=db)
    s = done.summary
    assert s["evictions"] > 0
    w = read.nice_window(int(s["virtual_duration_s"] * 1e9), queries.windows_for(s["requests"]))
    starts = read.evictions_over_time(db, done.run_id, window_ns=w)["window_start_ns"].to_list()
    t0, t1 = _gap_s(starts, w)
    at = render(db, monkeypatch, "evictions", run=done.run_id, t0=f"{t0:g}", t1=f"{t1:g}")
    said = [i.value for i in at.info]
    assert not [x for x in said if "never filled" in x], said
    assert len([x for x in said if x.startswith(f"No evictions in the time window {t0:g} to {t1:g} s")]) == 2, said


def test_the_latency_tables_percentiles_are_in_numeric_order(tmp_path, monkeypatch):
    """--percentiles 5,10,99.9,100: the stored summary's keys come back sorted as text, and
    the table's columns read p10, p100, p5, p99.9."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "pct.duckdb")
    run = run_replay(RunSpec("gen:chat", limit=6, percentiles=(5, 10, 99.9, 100)), db=db).run_id
    at = render(db, monkeypatch, "latency", run=run)
    columns = list(at.dataframe[0].value.columns)
    assert columns == ["metric", "mean", "median", "std", "p5", "p10", "p99.9", "p100"], columns


def test_compare_legends_name_a_run_without_a_name_by_its_id(dashboard_db, tmp_path, monkeypatch):
    """A run record without a name: Compare's legends read 'B None' where the run picker,
    Overview and every other view show its id."""
    import shutil

    from apptest import traces

    from kvtrace.store import read

    db = str(tmp_path / "unnamed.duckdb")
    shutil.copy(dashboard_db, db)
    a, b = read.runs(db)["run_id"].to_list()[:2]
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET name = NULL WHERE run_id = ?", [b])
    at = render(db, monkeypatch, "compare", run=a, b=b)
    names = {t.get("name") for t in traces(at)}
    assert f"B {b}" in names and not [n for n in names if n and "None" in n], names


def test_the_attribution_sankey_counts_the_windows_misses_as_its_table_does(tmp_path, monkeypatch):
    """The Sankey drew the whole run's attributed misses under a time window that its table
    (the same section) filtered: two counts of one thing that did not add up."""
    import json

    import polars as pl

    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read

    db = str(tmp_path / "tight.duckdb")
    run = run_replay(RunSpec("gen:mixed", limit=40, capacity_blocks=40, external_capacity_blocks=4096), db=db).run_id
    misses = read.eviction_attribution(db, run)["miss_ns"].sort().to_list()
    assert len(misses) > 4
    t1 = misses[len(misses) // 2] / 1e9  # about half of them
    at = render(db, monkeypatch, "evictions", run=run, t0="0", t1=f"{t1:g}")
    (sankey,) = [t for el in at.get("plotly_chart") for t in json.loads(el.proto.spec)["data"] if t["type"] == "sankey"]
    table = pl.from_pandas(at.dataframe[0].value)
    in_window = sum(1 for m in misses if m <= float(f"{t1:g}") * 1e9)
    assert 0 < in_window < len(misses)
    assert table["later_misses"].sum() == in_window
    assert sum(sankey["link"]["value"]) == 2 * in_window  # (publish kind → reason → prefix: each miss twice)


def test_a_time_window_without_requests_on_the_hit_rate_page_names_no_command_to_fill_it(dashboard_db, monkeypatch):
    """A window after the last request was scheduled said 'No request was scheduled in this
    window ... Fill it with `kvtrace demo`': no replay fills a window of a run that has them."""
    from kvtrace.dashboard import queries
    from kvtrace.store import read

    run = read.runs(dashboard_db)["run_id"][0]
    s = read.run_summary(dashboard_db, run)
    end = int(s["virtual_duration_s"] * 1e9)
    w = read.nice_window(end, queries.windows_for(s["requests"]))
    last = read.hit_counters_over_time(dashboard_db, run, window_ns=w)["window_start_ns"].max()
    t0 = (last + w // 4) / 1e9
    assert t0 < end / 1e9
    at = render(dashboard_db, monkeypatch, "hit_rate", run=run, t0=f"{t0:g}", t1=f"{end / 1e9:g}")
    said = [i.value for i in at.info if "scheduled" in i.value]
    assert len(said) == 2 and all("widen the window" in x and "Fill it" not in x for x in said), said


def test_dashboard_compare_of_a_run_with_itself_or_another_trace_is_refused_before_serving(tmp_path, capsys,
                                                                                             monkeypatch):
    """--run r1 --compare r1, or --compare a run of another trace, started a server whose
    Compare page showed one warning; the page's own rule (pairing.same_trace) now refuses
    them first, one line, exit 2. A run of the same trace still opens."""
    import kvtrace.dashboard
    from kvtrace.replay.run import RunSpec, run_replay
    from tests.cli.support import assert_one_line, run

    launched = []
    monkeypatch.setattr(kvtrace.dashboard, "launch", lambda *a, **k: launched.append(k) or 0)
    db = str(tmp_path / "s.duckdb")
    for limit, cap in ((3, 30), (3, 60), (4, 30)):  # r1, r2 of one trace; r3 of another (--limit)
        run_replay(RunSpec("gen:chat", limit=limit, mode="cache-only", capacity_blocks=cap), db=db)
    code, _, err = run(["dashboard", "--db", db, "--run", "r1", "--compare", "r1"], capsys)
    assert_one_line(code, err, "--compare: r1: is --run too")
    code, _, err = run(["dashboard", "--db", db, "--run", "r1", "--compare", "r3"], capsys)
    assert_one_line(code, err, "--compare: r3: replays another trace than r1")
    assert "--force" in err and not launched
    code, _, err = run(["dashboard", "--db", db, "--run", "r1", "--compare", ""], capsys)
    assert_one_line(code, err, "--compare: (empty): no such run in")
    code, _, err = run(["dashboard", "--db", db, "--run", "r1", "--compare", "r2"], capsys)
    assert code == 0 and launched and launched[0]["compare"] == "r2", err


def test_dashboard_compare_of_runs_that_name_no_trace_is_refused_before_serving(tmp_path, capsys, monkeypatch):
    """Two collected runs name no trace: same_trace took None == None for one trace, and the
    server opened a Compare page that said 'No other run of the same trace'."""
    import kvtrace.dashboard
    from kvtrace.store.writer import Store
    from tests.cli.support import assert_one_line, run

    launched = []
    monkeypatch.setattr(kvtrace.dashboard, "launch", lambda *a, **k: launched.append(k) or 0)
    db = str(tmp_path / "c.duckdb")
    store = Store.open(db)
    for _ in range(2):
        store.create_run("collected", mode="otlp")
    store.close()
    code, _, err = run(["dashboard", "--db", db, "--run", "r1", "--compare", "r2"], capsys)
    assert_one_line(code, err, "--run: r1: names no trace")
    assert not launched
