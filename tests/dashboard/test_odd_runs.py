"""The dashboard on runs off the happy path: stopped early, cache-only, without content,
Belady runs themselves, a directory as the store."""

from __future__ import annotations

import polars as pl
import pytest
from apptest import render

from kvtrace.dashboard import ui
from kvtrace.store import read


def _stopped_run(db: str) -> str:
    """A run whose replay stopped before finishing (closed unfinished: ``incomplete``, no
    stored summary), with spans of 20 requests."""
    import synthetic_run

    from kvtrace.store.writer import Store

    store = Store.open(db)
    run = store.create_run("stopped", trace_source="gen:stopped", mode="engine")
    steps, _ = synthetic_run.simulate(True, n_requests=20)
    synthetic_run.write_steps(store, run, steps)
    store.close()
    return run


@pytest.fixture(scope="module")
def lru_and_belady(tmp_path_factory) -> tuple[str, str, str]:
    """A store, at a path with a space, of two cache-only runs of one trace at one capacity: LRU
    and Belady (read only by the tests that use it)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path_factory.mktemp("pair") / "my runs.duckdb")
    spec = {"limit": 12, "mode": "cache-only", "capacity_blocks": 40}
    a = run_replay(RunSpec("gen:mixed", name="lru", **spec), db=db)
    b = run_replay(RunSpec("gen:mixed", name="opt", policy="belady", **spec), db=db)
    return db, a.run_id, b.run_id


def test_a_run_without_a_stored_summary_shows_the_numbers_of_kvtrace_runs_and_diff(tmp_path, monkeypatch):
    db = str(tmp_path / "stopped.duckdb")
    run = _stopped_run(db)
    assert read.run(db, run)["summary"] is None
    want = read.run_summary(db, run)  # what `kvtrace runs` and `kvtrace diff` show for it
    assert want["requests"] == 20 and want["evictions"] > 0
    at = render(db, monkeypatch, run=run)
    shown = {m.label: m.value for m in at.metric}
    assert shown["Evictions"] == ui.count(want["evictions"])
    assert shown["CoW copies"] == ui.count(want["cow_copies"])
    (table,) = [t.value for t in at.dataframe]
    row = pl.from_pandas(table).row(0, named=True)
    assert row["requests"] == want["requests"]
    assert row["prefix_cache_hit_rate"] == want["prefix_cache_hit_rate"]


def _captions(at) -> list[str]:
    return [c.value for c in at.caption]


def test_a_belady_run_and_an_unbounded_run_are_not_told_to_add_a_belady_run(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "bounds.duckdb")
    spec = {"limit": 12, "mode": "cache-only"}
    belady = run_replay(RunSpec("gen:mixed", name="opt", policy="belady", capacity_blocks=40, **spec), db=db)
    unbounded = run_replay(RunSpec("gen:mixed", name="inf", **spec), db=db)
    at = render(db, monkeypatch, "hit_rate", run=belady.run_id)
    assert not any("Add one" in c or c.startswith("No Belady bound") for c in _captions(at)), _captions(at)
    assert any("is a Belady run" in c for c in _captions(at))
    at = render(db, monkeypatch, "hit_rate", run=unbounded.run_id)
    assert any("cache is unbounded" in c for c in _captions(at)), _captions(at)


def test_a_run_that_checked_no_content_is_never_called_correct(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "content.duckdb")
    checked = run_replay(RunSpec("gen:mixed", limit=8, name="content"), db=db)
    unchecked = [run_replay(RunSpec("gen:mixed", limit=8, name="no content", content=False), db=db),
                 run_replay(RunSpec("gen:mixed", limit=8, mode="cache-only", name="cache only"), db=db)]
    at = render(db, monkeypatch, "stale", run=checked.run_id)
    assert any("the cache stayed correct" in i.value for i in at.info)
    for done in unchecked:
        at = render(db, monkeypatch, "stale", run=done.run_id)
        assert not any("the cache stayed correct" in i.value for i in at.info), done.run_id
        assert any("checked no block content" in i.value for i in at.info), done.run_id


def test_a_directory_as_the_store_is_named_a_directory_not_missing(tmp_path, monkeypatch):
    folder = tmp_path / "runs.duckdb"
    folder.mkdir()
    at = render(str(folder), monkeypatch)
    assert len(at.error) == 1 and "is a directory" in at.error[0].value
    assert "no such database file" not in at.error[0].value


def test_compare_of_cache_only_runs_does_not_blame_request_ids(lru_and_belady, monkeypatch):
    db, a, b = lru_and_belady
    at = render(db, monkeypatch, "compare", run=a, b=b)
    infos = [i.value for i in at.info]
    assert not any("share no request ids" in i for i in infos), infos
    assert any("they record no request spans" in i for i in infos), infos


def test_latency_of_a_cache_only_run_is_one_line_not_empty_charts(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "clockless.duckdb")
    done = run_replay(RunSpec("gen:mixed", limit=8, mode="cache-only", name="cache only"), db=db)
    at = render(db, monkeypatch, "latency", run=done.run_id)
    assert [i.value for i in at.info] == [
        "This run is cache-only: it has no clock, so no latency. Fill it with `kvtrace replay TRACE --db PATH` in "
        "engine mode."]
    assert not at.dataframe and not at.get("plotly_chart")


def test_compare_with_a_itself_in_the_link_says_so(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "self.duckdb")
    for name in ("a", "b"):
        done = run_replay(RunSpec("gen:mixed", limit=8, mode="cache-only", name=name), db=db)
    at = render(db, monkeypatch, "compare", run=done.run_id, b=done.run_id)
    assert any("is A itself" in w.value for w in at.warning), [w.value for w in at.warning]


def _texts(at) -> list[str]:
    return [el.value for el in [*at.markdown, *at.caption, *at.error, *at.warning, *at.info]]


def test_a_server_urls_password_is_never_shown(monkeypatch):
    at = render("clickhouse://kv:s3cret@127.0.0.1:1/db", monkeypatch)  # (port 1: refused at once)
    assert len(at.error) == 1
    assert not any("s3cret" in t for t in _texts(at)), _texts(at)


def test_the_store_path_is_shown_as_typed_never_as_markdown(tmp_path, monkeypatch):
    from markdown_it import MarkdownIt

    from tests.support.markdown import shown

    db = tmp_path / "x` [l](mailto:e@e.invalid) **b** `.duckdb"
    _stopped_run(str(db))
    (caption,) = [c.value for c in render(str(db), monkeypatch).sidebar.caption if "database" in c.value]
    assert "<a " not in MarkdownIt().render(caption) and shown(caption) == f"database: {db}"


def test_a_linked_request_that_is_not_in_the_run_is_named_not_silently_replaced(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "requests.duckdb")
    done = run_replay(RunSpec("gen:mixed", limit=8, name="engine"), db=db)
    at = render(db, monkeypatch, "latency", run=done.run_id, request="no-such-request")
    assert any("no-such-request" in w.value and "not in this run" in w.value for w in at.warning), \
        [w.value for w in at.warning]


def test_a_belady_runs_evictions_page_does_not_say_the_cache_never_filled(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "belady.duckdb")
    done = run_replay(RunSpec("gen:mixed", limit=40, mode="cache-only", policy="belady", capacity_blocks=100,
                              name="opt"), db=db)
    assert done.summary["evictions"] > 0
    at = render(db, monkeypatch, "evictions", run=done.run_id)
    infos = [i.value for i in at.info]
    assert not any("never filled" in i for i in infos), infos
    assert any(f"counts {ui.count(done.summary['evictions'])} evicted blocks" in i for i in infos), infos


def test_commands_to_paste_quote_a_store_path_with_spaces(lru_and_belady, monkeypatch):
    import shlex

    from tests.support.markdown import shown

    db, a, b = lru_and_belady
    assert " " in db
    at = render(db, monkeypatch, "compare", run=a, b=b)
    (caption,) = [shown(c.value) for c in at.caption if "kvtrace diff" in c.value]
    argv = shlex.split(caption.removesuffix(" prints this text."))
    assert argv == ["kvtrace", "diff", "--db", db, "--markdown", "--", a, b]
    at = render(db, monkeypatch, run="gone")
    (warning,) = [shown(w.value) for w in at.warning]
    assert f"kvtrace runs --db {shlex.quote(db)}" in warning


def test_request_ids_reach_the_sankey_as_text_not_plotly_markup(tmp_path, monkeypatch, capsys):
    """A trace's request ids name the Sankey's prefixes ("first REQUEST"): plotly would
    draw an <a href> there as a live link."""
    import json

    from apptest import traces

    from kvtrace.replay.run import RunSpec, run_replay
    from tests.cli.support import run

    trace = tmp_path / "hostile.jsonl"
    code, _, err = run(["generate", "mixed", "-o", str(trace), "--format", "native", "--requests", "40"], capsys)
    assert code == 0, err
    head, *rows = trace.read_text().splitlines()
    link = '<a href="https://e.invalid/">{}</a>'
    trace.write_text("\n".join([head, *(json.dumps({**r, "request_id": link.format(r["request_id"])})
                                        for r in map(json.loads, rows))]) + "\n")
    db = str(tmp_path / "hostile.duckdb")
    done = run_replay(RunSpec(str(trace), mode="cache-only", capacity_blocks=100, name="h"), db=db)
    at = render(db, monkeypatch, "evictions", run=done.run_id)
    (sankey,) = [t for t in traces(at) if t.get("type") == "sankey"]
    labels = sankey["node"]["label"]
    assert any("first &lt;a href=" in label for label in labels), labels
    assert not any("<a " in label for label in labels), labels


def test_a_stale_hashs_request_id_is_shown_as_text(stale_db, tmp_path, monkeypatch):
    """A metric's value is markdown to Streamlit: the drill-down's request id (a trace's,
    or a sender's) must show as typed."""
    import shutil

    import duckdb
    from markdown_it import MarkdownIt

    from tests.support.markdown import shown

    db = str(tmp_path / "stale.duckdb")
    shutil.copy(stale_db, db)
    hostile = "[l](mailto:e@e.invalid) **b**"
    with duckdb.connect(db) as con:
        con.execute("UPDATE spans_verify SET request_id = ? WHERE request_id IS NOT NULL", [hostile])
    run = next(r for r in read.runs(db)["run_id"] if read.stale_hashes(db, r).height)
    at = render(db, monkeypatch, "stale", run=run)
    (value,) = [m.value for m in at.metric if m.label == "Request"]
    assert shown(value) == hostile and "<a " not in MarkdownIt().render(value)


def test_latency_table_shows_the_runs_own_percentiles(tmp_path, monkeypatch):
    """A run replayed with --percentiles 25,75,99.9 reports those; the Latency page's table
    showed p50, p90 and p99 whatever the run's summary held."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "pcts.duckdb")
    done = run_replay(RunSpec("gen:chat", limit=6, name="pcts", percentiles=(25, 75, 99.9)), db=db)
    at = render(db, monkeypatch, "latency", run=done.run_id)
    table = pl.from_pandas(at.dataframe[0].value)
    assert table.columns == ["metric", "mean", "median", "std", "p25", "p75", "p99.9"]
    ttft = table.row(0, named=True)
    assert ttft["metric"] == "TTFT"
    assert (ttft["p25"], ttft["p99.9"]) == (done.summary["p25_ttft_ms"], done.summary["p99.9_ttft_ms"])
    # the Overview's headline tiles are at fixed percentiles, whatever the run's (its p99 tiles said –)
    shown = {m.label: m.value for m in render(db, monkeypatch, run=done.run_id).metric}
    p99 = read.latency_summary(db, done.run_id, (99,))
    assert shown["TTFT p99 (modelled)"] == ui.ms(p99["p99_ttft_ms"]) != "–"
    assert shown["ITL p99 (modelled)"] == ui.ms(p99["p99_itl_ms"]) != "–"


def test_a_collected_runs_times_are_the_senders_not_no_clock(tmp_path, monkeypatch):
    """A collected run has request times but no config, hence no cost model: the Overview
    and Latency pages said 'this run has no clock' above its latency charts; they say what
    `kvtrace diff` says of it (metrics.times_source)."""
    import synthetic_run

    from kvtrace.metrics import times_source

    db = str(tmp_path / "collected.duckdb")
    run = synthetic_run.write_collected_run(db)
    want = f"Times: {times_source('otlp', None)}."
    for page in ("overview", "latency"):
        at = render(db, monkeypatch, page, run=run)
        assert any(c.startswith(want) for c in _captions(at)), (page, _captions(at))
        assert not any("no clock" in c for c in _captions(at)), (page, _captions(at))
        labels = [m.label for m in at.metric] + [c.replace("not modelled here", "") for c in _captions(at)]
        assert not any("modelled" in t for t in labels), (page, labels)


def test_the_backend_of_a_collected_and_a_captured_run_is_runs_in_every_view(tmp_path, capsys):
    """`runs` was mended to say vllm for a live capture and nothing for a collected run, while
    the dashboard's run list and Overview still said kvtrace for both (metrics.run_backend)."""
    import json

    from kvtrace.dashboard.queries import with_run_columns
    from kvtrace.store.writer import Store
    from tests.cli.support import run

    db = str(tmp_path / "mixed.duckdb")
    with Store.open(db) as store:
        store.create_run("collected", mode="otlp")
        store.create_run("captured", trace_source="tcp://h:1", mode="live", config={"endpoint": "tcp://h:1"})
        store.create_run("replayed", trace_source="gen:chat", mode="engine", config={"backend": "vllm"})
    code, out, err = run(["runs", "--db", db, "--json"], capsys)
    assert code == 0, err
    listed = {r["name"]: r["backend"] for r in json.loads(out)["runs"]}
    assert listed == {"collected": None, "captured": "vllm", "replayed": "vllm"}
    shown = dict(with_run_columns(read.runs(db)).select("name", "backend").iter_rows())
    assert shown == {"collected": "–", "captured": "vllm", "replayed": "vllm"}
    code, out, err = run(["runs", "--db", db], capsys)
    assert code == 0 and "kvtrace" not in out.replace("runs in", ""), out


def test_a_live_captures_hit_counters_are_not_measured_as_runs_and_diff_say(tmp_path, monkeypatch):
    """A live capture records no lookups: its summary has no hit counters, so `kvtrace runs`
    and `kvtrace diff` show –, where the Overview's tiles showed the spans' 0."""
    from kvtrace import metrics
    from kvtrace.store.writer import Store

    db = str(tmp_path / "live.duckdb")
    with Store.open(db) as store:
        run = store.create_run("captured", trace_source="tcp://h:1", mode="live", config={"endpoint": "tcp://h:1"})
        store.finish_run(run, summary={"requests": 0, "batches": 3})
    want = read.run_summary(db, run)
    keys = ("prefix_cache_queries", *metrics.SOURCE_KEYS)
    assert all(want.get(k) is None for k in keys)
    at = render(db, monkeypatch, run=run)
    shown = {m.label: m.value for m in at.metric}
    labels = {c.key: c.label for c in metrics.COUNTERS}
    assert [shown[labels[k]] for k in keys] == ["–"] * len(keys), shown
    assert shown["Requests"] == ui.count(want["requests"])
    assert not any("No request was preempted" in c for c in _captions(at)), _captions(at)


def test_a_stopped_run_is_never_called_correct(tmp_path, monkeypatch):
    """A replay stopped early never ran its last audit: Overview shows its stale hashes as –
    (`kvtrace runs`, `diff`), and the correctness page said the cache stayed correct."""
    db = str(tmp_path / "stopped.duckdb")
    run = _stopped_run(db)
    assert read.run_summary(db, run).get("stale_hashes") is None
    assert {m.label: m.value for m in render(db, monkeypatch, run=run).metric}["Stale hashes"] == "–"
    infos = [i.value for i in render(db, monkeypatch, "stale", run=run).info]
    assert not any("the cache stayed correct" in i for i in infos), infos
    assert any("not known correct" in i and "incomplete" in i for i in infos), infos


def test_only_an_engine_run_is_said_to_run_without_a_behaviour(tmp_path, monkeypatch):
    """kvtrace's behaviour switches are engine mode's: a cache-only replay (stored as []), a
    capture or a collected run was labelled "without" every behaviour of the store's engine
    runs, where `kvtrace runs` shows -."""
    from kvtrace.dashboard.queries import with_run_columns
    from kvtrace.store.writer import Store

    db = str(tmp_path / "modes.duckdb")
    with Store.open(db) as store:
        store.create_run("on", mode="engine", behaviours=["shared-prefix-pinning", "transient-checkpoint-retention"])
        store.create_run("off", mode="engine", behaviours=["transient-checkpoint-retention"])
        store.create_run("lru", mode="cache-only/lru", behaviours=[])
        store.create_run("captured", trace_source="tcp://h:1", mode="live")
        store.create_run("collected", mode="otlp")
    rows = {r["name"]: r for r in with_run_columns(read.runs(db)).iter_rows(named=True)}
    assert rows["off"]["behaviours_off"] == "shared-prefix-pinning" and rows["on"]["behaviours_off"] == ""
    assert " · without shared-prefix-pinning" in rows["off"]["label"], rows["off"]["label"]
    for name in ("lru", "captured", "collected"):
        assert rows[name]["behaviours_off"] == "" and "behaviours" not in rows[name]["label"], rows[name]
    at = render(db, monkeypatch, run=rows["lru"]["run_id"])
    header = at.markdown[0].value
    assert "off:" not in header and "behaviours: –" in header, header
    # a record that names behaviours shows them, whatever its mode
    with Store.open(db) as store:
        named = store.create_run("named", mode="otlp", behaviours=["shared-prefix-pinning"])
    row = with_run_columns(read.runs(db)).filter(pl.col("run_id") == named).row(0, named=True)
    assert row["behaviours_on"] == "shared-prefix-pinning" and row["behaviours_off"] == "transient-checkpoint-retention"


def test_a_summary_number_past_any_range_is_no_number_and_no_page_error(tmp_path, monkeypatch):
    """A damaged summary's 1e308 rate showed 'inf%', and its 1e300 s duration (past int64 ns)
    stopped every windowed page with an OverflowError box: the rate is –, the window is the spans'."""
    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "huge.duckdb")
    run = run_replay(RunSpec("gen:mixed", limit=8, name="huge"), db=db).run_id
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET summary = json_merge_patch(summary, '{\"block_hit_rate\": 1e308, "
                    "\"virtual_duration_s\": 1e300}') WHERE run_id = ?", [run])
    at = render(db, monkeypatch, run=run)
    assert {m.label: m.value for m in at.metric}["Block hit rate"] == "–"
    for page in ("hit_rate", "evictions", "stale", "latency"):
        at = render(db, monkeypatch, page, run=run)
        assert not at.error, (page, [e.value for e in at.error])
    assert ui.pct(1e308) == ui.pp(-1e308) == "–"


def test_the_runs_table_shows_rates_latencies_and_counts_in_the_tiles_units(stale_db, monkeypatch):
    """The Overview's run list showed a hit rate as 0.6847 beside its tile's 68.5% (and
    `kvtrace runs`' 68.47%): rates are percentages, latencies ms, counts with separators;
    the values stay the summary's, so the columns still sort by number."""
    import json

    at = render(stale_db, monkeypatch)
    (frame,) = at.dataframe
    shown = json.loads(frame.proto.columns)
    formats = {k: shown[k]["type_config"]["format"] for k in ("prefix_cache_hit_rate", "block_hit_rate",
                                                              "median_ttft_ms", "p99_itl_ms", "evictions")}
    assert formats == {"prefix_cache_hit_rate": "percent", "block_hit_rate": "percent", "median_ttft_ms": "%.1f ms",
                       "p99_itl_ms": "%.1f ms", "evictions": "localized"}
    rates = [v for v in frame.value["prefix_cache_hit_rate"] if v == v]
    assert rates and all(0 <= v <= 1 for v in rates)  # fractions, as the summary stores them


def test_a_run_with_a_damaged_record_says_so_on_every_page(tmp_path, monkeypatch):
    """`kvtrace runs` prints a damaged record's problem; the dashboard listed the run as
    damaged in its picker and then showed its pages (Compare, Overview...) without a word."""
    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "damaged.duckdb")
    spec = {"limit": 12, "mode": "cache-only"}
    a = run_replay(RunSpec("gen:mixed", name="a", capacity_blocks=40, **spec), db=db).run_id
    run_replay(RunSpec("gen:mixed", name="b", capacity_blocks=60, **spec), db=db)
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET summary = '[1]' WHERE run_id = $r", {"r": a})
    (damage,) = read.runs(db).filter(pl.col("run_id") == a)["damage"].to_list()
    assert "summary is [1]" in damage
    for page in ("overview", "compare", "hit_rate", "evictions", "stale", "latency", "capacity"):
        at = render(db, monkeypatch, page, run=a)
        said = [w.value for w in at.warning if w.value.startswith(ui.literal(damage))]
        assert len(said) == 1, (page, [w.value for w in at.warning])
        assert not at.error, (page, [e.value for e in at.error])  # (a page that needs the record: said once)
    assert [m.label for m in render(db, monkeypatch, "overview", run=a).metric]  # (its spans are shown)


def test_a_run_whose_status_is_damaged_leaves_the_other_runs_pages_readable(tmp_path, monkeypatch):
    """One run with a status kvtrace never writes made every page of every run one error
    (the run list filled its summary from its spans, which every reader refuses)."""
    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "s.duckdb")
    spec = RunSpec("gen:chat", limit=12, mode="cache-only")
    healthy = run_replay(spec, db=db).run_id
    bad = run_replay(spec, db=db).run_id
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET status = '' WHERE run_id = $r", {"r": bad})
    at = render(db, monkeypatch, run=healthy)
    assert not at.error and at.metric
    at = render(db, monkeypatch, run=bad)
    assert any("is not one of running" in w.value for w in at.warning), [w.value for w in at.warning]


def test_a_run_labelled_as_another_stays_picked(tmp_path, monkeypatch):
    """Streamlit keeps a picker's choice by its label: of two runs labelled alike (two --limit
    replays of one trace, a sweep's repeated names), the page switched to the other one on
    the next rerun, and the URL with it."""
    from kvtrace.dashboard import queries
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "s.duckdb")
    first = run_replay(RunSpec("gen:chat", limit=5, mode="cache-only"), db=db).run_id
    second = run_replay(RunSpec("gen:chat", limit=9, mode="cache-only"), db=db).run_id
    labels = queries.with_run_columns(read.runs(db))["label"].to_list()
    assert labels[0] == labels[1]  # (the names say neither --limit)
    for run in (first, second):
        at = render(db, monkeypatch, run=run)
        at.switch_page("views/hit_rate.py").run()  # (a rerun: the choice is read back from the picker)
        assert at.query_params["run"] == [run] or at.query_params["run"] == run
        (picker,) = [s for s in at.sidebar.selectbox if s.label == "Run"]
        assert picker.value == run


def test_a_damaged_runs_label_claims_no_behaviours(tmp_path):
    """A damaged record's behaviours are not read: its picker label said 'without' every one."""
    import duckdb

    from kvtrace.dashboard import queries
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "s.duckdb")
    run = run_replay(RunSpec("gen:chat", limit=4, content=False), db=db).run_id
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET config = '[1]' WHERE run_id = $r", {"r": run})
    (label,) = queries.with_run_columns(read.runs(db))["label"].to_list()
    assert label.endswith("DAMAGED") and "without" not in label and "behaviours" not in label, label
