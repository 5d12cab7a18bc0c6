"""Every dashboard page under Streamlit's AppTest, against a real store file."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import streamlit as st
from conftest import APP
from streamlit.testing.v1 import AppTest

from kvtrace.dashboard import DB_ENV, queries, run_config, ui
from kvtrace.store import read
from kvtrace.store.schema import SUMMARY_FIELDS

PAGES = ["overview", "hit_rate", "evictions", "stale", "latency", "capacity", "compare"]


def render(db: str, monkeypatch, page: str = "overview", **params: str) -> AppTest:
    monkeypatch.setenv(DB_ENV, db)
    at = AppTest.from_file(APP, default_timeout=60)
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    if page != "overview":
        at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def traces(at: AppTest) -> list[dict]:
    out = []
    for el in at.get("plotly_chart"):
        out += json.loads(el.proto.spec)["data"]
    return out


def names(at: AppTest) -> set[str]:
    return {t.get("name") for t in traces(at)}


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def run_ids(db: str) -> dict[str, dict]:
    """{run_id: run} with 'on' (no behaviour off) first."""
    runs = {r: read.run(db, r) for r in read.runs(db)["run_id"]}
    return dict(sorted(runs.items(), key=lambda kv: -len(kv[1]["behaviours"] or [])))


def on_off(db: str) -> tuple[str, str]:
    ids = list(run_ids(db))
    return ids[0], ids[-1]


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("store", ["dashboard_db", "stale_db"])
def test_every_page_renders_every_run_without_error(request, store, monkeypatch, page):
    db = request.getfixturevalue(store)
    for run_id in run_ids(db):
        at = render(db, monkeypatch, page, run=run_id)
        assert not at.error, [e.value for e in at.error]
        assert at.title[0].value  # the page ran to its title at least
        # Every chart carries its one-line caption right below it.
        assert len(at.caption) >= len(at.get("plotly_chart"))


def test_overview_headline_metrics_equal_the_run_summary(dashboard_db, monkeypatch):
    for run_id, run in run_ids(dashboard_db).items():
        s = run["summary"]
        m = metrics(render(dashboard_db, monkeypatch, run=run_id))
        assert m["Token hit rate"] == ui.pct(s["token_hit_rate"])
        assert m["Block hit rate"] == ui.pct(s["block_hit_rate"])
        for label, key in (("TTFT p50", "ttft_ms_p50"), ("TTFT p99", "ttft_ms_p99"), ("ITL p50", "itl_ms_p50"),
                           ("ITL p99", "itl_ms_p99")):
            assert m[label] == ui.ms(s[key]), label
        assert m["Requests"] == f"{int(s['requests']):,}"
        for label, key in (("Evictions", "evictions"), ("CoW copies", "cow_copies"), ("Stale hashes", "stale_hashes"),
                           ("Divergent outputs", "divergent_outputs")):
            assert m[label] == f"{int(s[key]):,}", label
        # Per-group hit rate: the store's cumulative rate at the end of the run.
        rates = read.hit_rate_over_time(dashboard_db, run_id).sort("window_start_ns").group_by("group_id").last()
        for g, rate in zip(rates["group_id"], rates["cum_hit_rate"]):
            if g >= 0:
                hits = [v for k, v in m.items() if k.startswith(f"Hit rate · group {g}")]
                assert hits == [ui.pct(rate)]


def test_overview_runs_table_lists_every_run(dashboard_db, monkeypatch):
    at = render(dashboard_db, monkeypatch)
    table = at.dataframe[0].value
    assert sorted(table["run_id"]) == sorted(run_ids(dashboard_db))
    assert {"status", "behaviours_off"} <= set(table.columns)
    # every headline summary field, in the store's SUMMARY_FIELDS order (the digest is not a number)
    assert [c for c in table.columns if c in SUMMARY_FIELDS] == [k for k in SUMMARY_FIELDS if k != "digest"]


def test_hit_rate_page_plots_each_group_windowed_and_cumulative(dashboard_db, monkeypatch):
    run_id, _ = on_off(dashboard_db)
    at = render(dashboard_db, monkeypatch, "hit_rate", run=run_id)
    n = names(at)
    groups = read.hit_rate_over_time(dashboard_db, run_id)["group_id"].unique().to_list()
    assert len([x for x in n if x.endswith("(windowed)")]) == len(groups)
    assert "all groups (cumulative)" in n and "group 1 (state) (windowed)" in n
    assert {"local hit", "external hit", "computed"} <= n
    assert {"group 0 (attention) mean", "group 1 (state) max"} <= n
    hot = at.dataframe[0].value
    assert list(hot["root_hash"]) == read.per_prefix_reuse(dashboard_db, run_id, top=20)["root_hash"].to_list()
    # The cumulative curve ends at the store's whole-run rate.
    cum = next(t for t in traces(at) if t["name"] == "all groups (cumulative)")
    rates = read.hit_rate_over_time(dashboard_db, run_id, group=-1).sort("window_start_ns")
    assert cum["y"][-1] == pytest.approx(rates["cum_hit_rate"][-1])


def _belady_traces(at: AppTest) -> list[dict]:
    return [t for t in traces(at) if t["name"].startswith("Belady bound")]


def test_hit_rate_page_draws_the_belady_bound_only_at_the_runs_capacity(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "belady.duckdb")
    engine = run_replay(RunSpec("gen:mixed", limit=12, name="engine"), db=db)
    cap = run_config.capacity(read.run(db, engine.run_id)["config"])
    # kimi-hybrid: 8192 attention blocks of 512 tokens, one of them vLLM's null block
    assert cap == run_config.Capacity(8191, 512)

    def cache_only(policy: str, blocks: int, name: str):
        done = run_replay(RunSpec("gen:mixed", limit=12, mode="cache-only", policy=policy, capacity_blocks=blocks,
                                  block_size=cap.block_size, name=name), db=db)
        st.cache_data.clear()  # the pages cache the runs list per database until Refresh
        return done

    small = cache_only("belady", 8, "belady small")
    at = render(db, monkeypatch, "hit_rate", run=engine.run_id)
    assert not _belady_traces(at)  # another capacity: not this run's bound
    hint = next(c.value for c in at.caption if c.value.startswith("No Belady bound"))
    assert "this trace's Belady runs have 8 blocks of 512 tokens" in hint
    assert f"--mode cache-only --policy belady --capacity-blocks {cap.blocks} --block-size {cap.block_size}" in hint
    # An LRU run at the same capacity whose name says Belady is not a Belady run.
    cache_only("lru", cap.blocks, "belady (by name only)")
    assert not _belady_traces(render(db, monkeypatch, "hit_rate", run=engine.run_id))

    same = cache_only("belady", cap.blocks, "belady same")
    at = render(db, monkeypatch, "hit_rate", run=engine.run_id)
    (bound,) = _belady_traces(at)
    assert bound["name"] == f"Belady bound (belady same, {cap})"
    assert bound["y"] == [pytest.approx(same.summary["token_hit_rate"])] * 2
    assert same.summary["token_hit_rate"] != small.summary["token_hit_rate"]
    assert not any(c.value.startswith("No Belady bound") for c in at.caption)
    # The cache-only run itself renders every page, with empty states where it has no data.
    for page in PAGES:
        at = render(db, monkeypatch, page, run=small.run_id)
        assert not at.error, (page, [e.value for e in at.error])


def test_group_names_come_from_the_stored_spec_types_not_from_words(tmp_path, monkeypatch):
    import synthetic_run

    from kvtrace.store.writer import Store

    db = str(tmp_path / "names.duckdb")
    config = synthetic_run.engine_config(160)
    config["description"] = "mamba state, sliding window"
    config["cache"]["groups"][0]["note"] = "not mamba, no sliding window, no recurrent state"
    config["cache"]["groups"][1]["note"] = "full attention stand-in"
    rows, summary = synthetic_run.simulate(True, n_requests=20)
    with Store.open(db) as store:
        run_id = store.create_run("sliding-window mamba state run", config=config, mode="engine", trace_digest="t")
        store.append_spans(synthetic_run._table(rows), run_id=run_id)
        store.finish_run(run_id, summary=summary)
    at = render(db, monkeypatch, "hit_rate", run=run_id)
    assert {x for x in names(at) if x.endswith("(windowed)")} == {
        "all groups (windowed)", "group 0 (attention) (windowed)", "group 1 (state) (windowed)"}
    assert {"group 0 (attention) mean", "group 1 (state) mean"} <= names(at)


def test_windowed_charts_use_the_store_nice_window_with_the_dashboards_window_count(dashboard_db, monkeypatch):
    run_id, run = next(iter(run_ids(dashboard_db).items()))
    s = run["summary"]
    windows = queries.windows_for(s["requests"])
    w = read.nice_window(int(s["virtual_duration_s"] * 1e9), windows)
    at = render(dashboard_db, monkeypatch, "hit_rate", run=run_id)
    starts = {round(x * 1e9) for t in traces(at) if t["name"].endswith("(windowed)") for x in t["x"]}
    assert starts and all(x % w == 0 for x in starts)
    assert 1 < len(starts) <= windows + 1


def test_group_and_window_filters_are_bound_to_the_url(dashboard_db, monkeypatch):
    run_id, _ = on_off(dashboard_db)
    at = render(dashboard_db, monkeypatch, "hit_rate", run=run_id, group="0")
    assert {x for x in names(at) if "windowed" in x} == {"group 0 (attention) (windowed)"}
    at.selectbox(key="qp_group").select(1).run()
    assert at.query_params["group"] == ["1"] or at.query_params["group"] == "1"
    assert {x for x in names(at) if "windowed" in x} == {"group 1 (state) (windowed)"}
    # A time window from the URL trims the x axis.
    at = render(dashboard_db, monkeypatch, "hit_rate", run=run_id, t0="1", t1="2")
    xs = [x for t in traces(at) if t["name"].endswith("(windowed)") for x in t["x"]]
    assert xs and min(xs) >= 1 and max(xs) <= 2


@pytest.mark.parametrize("store", ["dashboard_db", "stale_db"])
def test_evictions_page_shows_reasons_publish_kinds_attribution_and_histograms(request, store, monkeypatch):
    db = request.getfixturevalue(store)
    for run_id in run_ids(db):
        at = render(db, monkeypatch, "evictions", run=run_id)
        n = names(at)
        reasons = set(read.evictions_by_reason(db, run_id)["reason"])
        kinds = set(read.evictions_by_publish_kind(db, run_id)["publish_kind"])
        assert reasons and reasons | kinds <= n
        flows = read.eviction_attribution_flows(db, run_id)
        sankeys = [t for t in traces(at) if t["type"] == "sankey"]
        assert len(sankeys) == (1 if flows.height else 0)
        if sankeys:
            assert sum(sankeys[0]["link"]["value"]) == 2 * int(flows["misses"].sum())
        hist = set(read.block_histograms(db, run_id)["metric"])
        shown = {"lifetime": "lifetime at eviction", "idle_before_evict": "idle before eviction",
                 "reuse_gap": "prefix reuse gap"}
        assert {shown[m] for m in hist} <= n


def test_stale_page_drills_down_to_the_span_chain(stale_db, monkeypatch):
    run_on, run_off = on_off(stale_db)
    at = render(stale_db, monkeypatch, "stale", run=run_off)
    assert {"stale hash found", "divergent output"} <= names(at)
    first = read.stale_hashes(stale_db, run_off).row(0, named=True)
    m = metrics(at)
    assert m["Request"] == first["request_id"]
    assert m["Block id (group)"] == f"{first['block_id']} (g{first['group_id']})"
    assert m["Expected fingerprint"] == f"{first['expected_fingerprint']:#x}"
    chain = at.dataframe[0].value
    assert {"publish", "overwrite", "stale_hit"} <= set(chain["role"])
    # The behaviour-on run is clean: an empty state that says what to run.
    at = render(stale_db, monkeypatch, "stale", run=run_on)
    assert not at.get("plotly_chart")
    assert any("kvtrace replay" in i.value for i in at.info)


def test_latency_page_cdfs_and_waterfall_for_the_requested_request(dashboard_db, monkeypatch):
    run_id, _ = on_off(dashboard_db)
    reqs = read.requests(dashboard_db, run_id)
    rid = reqs["request_id"][3]
    at = render(dashboard_db, monkeypatch, "latency", run=run_id, request=rid)
    n = names(at)
    assert {"TTFT", "ITL", "queue", "mean ITL"} <= n
    assert {"prefill", "decode", "cache hit"} <= n
    ttft = next(t for t in traces(at) if t["name"] == "TTFT" and t["type"] == "scatter")
    assert ttft["x"][-1] == pytest.approx(reqs["ttft_ns"].max() / 1e6)
    prefill = next(t for t in traces(at) if t["name"] == "prefill")
    chunks = read.request_waterfall(dashboard_db, run_id, rid).filter(pl.col("segment") == "prefill")
    assert len(prefill["x"]) == chunks.height
    titles = [json.loads(el.proto.spec)["layout"]["title"]["text"] for el in at.get("plotly_chart")]
    assert f"Request {rid}" in titles
    assert at.query_params["request"] in (rid, [rid])


def test_compare_page_deltas_and_per_request_difference(dashboard_db, monkeypatch):
    run_on, run_off = on_off(dashboard_db)
    at = render(dashboard_db, monkeypatch, "compare", run=run_on, b=run_off)
    s_on, s_off = read.run(dashboard_db, run_on)["summary"], read.run(dashboard_db, run_off)["summary"]
    m = {x.label: x for x in at.metric}
    assert m["Evictions (B)"].value == f"{s_off['evictions']:,}"
    assert m["Evictions (B)"].proto.delta == f"{s_off['evictions'] - s_on['evictions']:+,}"
    assert m["Token hit rate (B)"].proto.delta == f"{100 * (s_off['token_hit_rate'] - s_on['token_hit_rate']):+.1f} pp"
    a = read.per_request_hits(dashboard_db, run_on)
    b = read.per_request_hits(dashboard_db, run_off)
    joined = a.join(b, on="request_id", suffix="_b").sort("request_id")
    delta = (joined["num_hit_tokens_b"] - joined["num_hit_tokens"]).to_list()
    if any(delta):
        bars = next(t for t in traces(at) if t["name"] == "hit tokens B − A")
        assert bars["y"] == delta
    else:  # the switch moved no request: said in words, not as a flat chart
        assert any(f"All {len(delta)} requests got the same hit tokens" in i.value for i in at.info)
    on, off = (set(read.run(dashboard_db, r)["behaviours"]) for r in (run_on, run_off))
    differ = sorted(on ^ off)
    assert any(f"Behaviours that differ: {', '.join(differ)}" == c.value for c in at.caption)


def test_compare_page_per_request_bars_where_requests_moved(stale_db, monkeypatch):
    run_on, run_off = on_off(stale_db)
    at = render(stale_db, monkeypatch, "compare", run=run_on, b=run_off)
    a = read.per_request_hits(stale_db, run_on)
    b = read.per_request_hits(stale_db, run_off)
    joined = a.join(b, on="request_id", suffix="_b").sort("request_id")
    delta = (joined["num_hit_tokens_b"] - joined["num_hit_tokens"]).to_list()
    assert any(delta)
    bars = next(t for t in traces(at) if t["name"] == "hit tokens B − A")
    assert bars["y"] == delta and bars["x"] == joined["request_id"].to_list()
    moved = at.dataframe[0].value
    assert (moved["hit_delta"] != 0).all() and len(moved) == min(50, sum(1 for d in delta if d))


def test_missing_and_foreign_databases_give_one_error_line(tmp_path, monkeypatch):
    at = render(str(tmp_path / "nope.duckdb"), monkeypatch)
    assert len(at.error) == 1 and "no such database file" in at.error[0].value
    bad = tmp_path / "bad.duckdb"
    bad.write_text("not a database\n")
    at = render(str(bad), monkeypatch)
    assert len(at.error) == 1 and str(bad) in at.error[0].value
    monkeypatch.delenv(DB_ENV, raising=False)
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception and "No database given" in at.error[0].value


def test_empty_store_says_what_fills_it(tmp_path, monkeypatch):
    from kvtrace.store.writer import Store

    db = tmp_path / "empty.duckdb"
    Store.open(db).close()
    at = render(str(db), monkeypatch)
    assert not at.error and "kvtrace demo" in at.info[0].value


def test_running_run_is_shown_and_refresh_rereads_the_store(tmp_path, monkeypatch):
    import synthetic_run

    from kvtrace.store.writer import Store

    db = str(tmp_path / "live.duckdb")
    synthetic_run.write_runs(db, n_requests=20)
    at = render(db, monkeypatch)
    before = at.selectbox(key="qp_run").options
    store = Store.open(db)
    live = store.create_run("live-replay", trace_source="gen:live", mode="engine")
    rows, _ = synthetic_run.simulate(True, n_requests=10)
    store.append_spans(synthetic_run._table(rows), run_id=live)
    store.flush()
    at.run()
    assert not at.exception and not at.error, ([e.value for e in at.exception], [e.value for e in at.error],
                                               [i.value for i in at.info])
    assert at.selectbox(key="qp_run").options == before  # served from the cache until Refresh
    at.button[0].click().run()
    options = at.selectbox(key="qp_run").options
    assert len(options) == len(before) + 1 and any("RUNNING" in o for o in options)
    at.selectbox(key="qp_run").select(live).run()
    assert any("still being written" in w.value for w in at.warning)
    for page in PAGES[1:]:
        at.switch_page(f"views/{page}.py").run()
        assert not at.exception and not at.error, page
        assert len(at.get("page_link")) == len(PAGES), page  # the sidebar links survive empty states
    assert any("No other run of the same trace" in i.value for i in at.info)
    store.close()


def test_launch_refuses_a_missing_database_and_binds_loopback(tmp_path):
    from kvtrace.dashboard import launch, server_command
    from kvtrace.errors import ConfigError

    with pytest.raises(ConfigError, match="no such database file"):
        launch(tmp_path / "missing.duckdb")
    cmd = server_command(tmp_path / "x.duckdb", port=8765)
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--server.port") + 1] == "8765"
    assert cmd[-2:] == ["--db", str((tmp_path / "x.duckdb").resolve())]
    assert Path(cmd[cmd.index("run") + 1]).name == "app.py"


def test_a_capture_that_received_nothing_says_so(tmp_path, monkeypatch):
    """A live run whose summary says nothing_received is marked in the run picker and on
    the overview (capture_vllm writes that summary; here the store gets it directly)."""
    from kvtrace.store.writer import Store

    db = tmp_path / "live.duckdb"
    with Store.open(db) as store:
        run = store.create_run("vllm tcp://10.0.0.1:5557", mode="live")
        store.finish_run(run, summary={"batches": 0, "events": 0, "nothing_received": True})
    at = render(str(db), monkeypatch)
    assert any("NOTHING RECEIVED" in o for o in at.selectbox(key="qp_run").options)
    assert any("Nothing received" in w.value for w in at.warning)
