"""Every dashboard page under Streamlit's AppTest, against a real store file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pytest
from apptest import app_test, render, traces
from streamlit.testing.v1 import AppTest

from kvtrace.dashboard import DB_ENV, queries, run_config, ui
from kvtrace.store import read
from kvtrace.store.schema import SUMMARY_FIELDS
from tests.support.markdown import shown

PAGES = ["overview", "hit_rate", "evictions", "stale", "latency", "capacity", "compare"]


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
        assert m["Prefix cache hit rate"] == ui.pct(s["prefix_cache_hit_rate"])
        assert m["External prefix cache hit rate"] == ui.pct(s["external_prefix_cache_hit_rate"])
        assert m["Block hit rate"] == ui.pct(s["block_hit_rate"])
        assert m["Prefix cache queries"] == f"{s['prefix_cache_queries']:,}"
        assert m["Prompt tokens from the local cache"] == f"{s['prompt_tokens_by_source.local_cache_hit']:,}"
        for label, key in (("TTFT median", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"),
                           ("ITL median", "median_itl_ms"), ("ITL p99", "p99_itl_ms")):
            assert m[f"{label} (modelled)"] == ui.ms(s[key]), label
        assert m["Requests"] == f"{int(s['requests']):,}"
        for label, key in (("Evictions", "evictions"), ("CoW copies", "cow_copies"), ("Stale hashes", "stale_hashes"),
                           ("Divergent outputs", "divergent_outputs")):
            assert m[label] == f"{int(s[key]):,}", label
        # Group hit rates: their own labelled metric, the store's, never called the request hit rate.
        for g, rate in read.group_hit_rates(dashboard_db, run_id).items():
            hits = [v for k, v in m.items() if k.startswith(f"group {g}: ") and k.endswith("group hit rate")]
            assert hits == [ui.pct(rate)]


def test_overview_runs_table_lists_every_run(dashboard_db, monkeypatch):
    at = render(dashboard_db, monkeypatch)
    table = at.dataframe[0].value
    assert sorted(table["run_id"]) == sorted(run_ids(dashboard_db))
    assert {"status", "behaviours_off"} <= set(table.columns)
    # every headline summary field, in the store's SUMMARY_FIELDS order (the digest is not a number)
    assert [c for c in table.columns if c in SUMMARY_FIELDS] == [k for k in SUMMARY_FIELDS if k != "digest"]


def test_hit_rate_page_charts_the_request_hit_rate_apart_from_the_group_rates(dashboard_db, monkeypatch):
    run_id, _ = on_off(dashboard_db)
    at = render(dashboard_db, monkeypatch, "hit_rate", run=run_id)
    n = names(at)
    assert {"prefix cache hit rate (per window)", "prefix cache hit rate (cumulative)"} <= n
    assert {"local cache hit", "external KV transfer", "local compute"} <= n
    assert {"group 0: attention group hit rate (per window)", "group 1: state group hit rate (cumulative)"} <= n
    assert {"group 0 (attention) mean", "group 1 (state) max"} <= n
    # the request hit rate and the group rates never share a chart
    for el in at.get("plotly_chart"):
        shown = {t.get("name") for t in json.loads(el.proto.spec)["data"]}
        assert not (any(x and x.startswith("prefix cache hit rate") for x in shown)
                    and any(x and "group hit rate" in x for x in shown))
    hot = at.dataframe[0].value
    assert list(hot["root_hash"]) == read.per_prefix_reuse(dashboard_db, run_id, top=20)["root_hash"].to_list()
    # The cumulative curve ends at the store's whole-run rate, which is the summary's.
    cum = next(t for t in traces(at) if t["name"] == "prefix cache hit rate (cumulative)")
    assert cum["y"][-1] == pytest.approx(read.hit_counters(dashboard_db, run_id)["prefix_cache_hit_rate"])
    assert cum["y"][-1] == pytest.approx(read.run(dashboard_db, run_id)["summary"]["prefix_cache_hit_rate"])
    # prompt tokens by source stack up to the prompt tokens: each request once, at its first schedule
    stacked = sum(sum(t["y"]) for t in traces(at) if t["name"] in ("local cache hit", "external KV transfer",
                                                                    "local compute"))
    assert stacked == read.run(dashboard_db, run_id)["summary"]["prompt_tokens"]
    # the y axis fits the data, not 0..100%
    specs = [json.loads(el.proto.spec) for el in at.get("plotly_chart")]
    chart = next(c for c in specs if any(t.get("name") == "prefix cache hit rate (cumulative)" for t in c["data"]))
    lo, hi = chart["layout"]["yaxis"]["range"]
    ys = [y for t in chart["data"] for y in t["y"] if y is not None]
    assert lo <= min(ys) and max(ys) <= hi and (lo > 0 or hi < 1)


def _belady_traces(at: AppTest) -> list[dict]:
    return [t for t in traces(at) if t["name"].startswith("Belady bound")]


def test_hit_rate_page_draws_the_belady_bound_only_at_the_runs_capacity(tmp_path, monkeypatch):
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "belady.duckdb")
    engine = run_replay(RunSpec("gen:mixed", limit=12, name="engine"), db=db)
    cap = run_config.capacity(read.run(db, engine.run_id)["config"])
    # kimi-hybrid: one pool of 10,240 blocks of 512 tokens that every group shares, one of
    # them vLLM's null block
    assert cap == run_config.Capacity(10_239, 512)

    def cache_only(policy: str, blocks: int, name: str):
        done = run_replay(RunSpec("gen:mixed", limit=12, mode="cache-only", policy=policy, capacity_blocks=blocks,
                                  block_size=cap.block_size, name=name), db=db)
        return done  # (no cache to clear: a page load reads a store that changed again)

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
    assert bound["y"] == [pytest.approx(same.summary["prefix_cache_hit_rate"])] * 2
    assert same.summary["prefix_cache_hit_rate"] != small.summary["prefix_cache_hit_rate"]
    assert not any(c.value.startswith("No Belady bound") for c in at.caption)
    # The cache-only run itself renders every page, with empty states where it has no data.
    for page in PAGES:
        at = render(db, monkeypatch, page, run=small.run_id)
        assert not at.error, (page, [e.value for e in at.error])


def test_a_cache_only_run_at_the_traces_own_block_size_finds_its_belady_bound(tmp_path, monkeypatch):
    """Without --block-size a cache-only run stores its block size in its summary only:
    the bound is matched on it, as the Capacity page matches it."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "own.duckdb")
    spec = {"limit": 12, "mode": "cache-only", "capacity_blocks": 40}
    lru = run_replay(RunSpec("gen:mixed", name="lru", **spec), db=db)
    belady = run_replay(RunSpec("gen:mixed", name="opt", policy="belady", **spec), db=db)
    assert read.run(db, lru.run_id)["config"].get("block_size") is None
    at = render(db, monkeypatch, "hit_rate", run=lru.run_id)
    (bound,) = _belady_traces(at)
    assert bound["y"] == [pytest.approx(belady.summary["prefix_cache_hit_rate"])] * 2


def test_group_names_come_from_the_stored_spec_types_not_from_words(tmp_path, monkeypatch):
    import synthetic_run

    from kvtrace.store.writer import Store

    db = str(tmp_path / "names.duckdb")
    config = {"description": "mamba state, sliding window", "cache": {"groups": [
        {"type": "FullAttentionSpec", "block_size": 64, "note": "not mamba, no sliding window, no recurrent state"},
        {"type": "MambaSpec", "block_size": 64, "note": "full attention stand-in"}], "num_gpu_blocks": [161, 161]}}
    rows, summary = synthetic_run.simulate(True, n_requests=20)
    with Store.open(db) as store:
        run_id = store.create_run("sliding-window mamba state run", config=config, mode="engine", trace_digest="t")
        synthetic_run.write_steps(store, run_id, rows)
        store.finish_run(run_id, summary=summary)
    at = render(db, monkeypatch, "hit_rate", run=run_id)
    assert {x for x in names(at) if x.endswith("(per window)") and "group" in x} == {
        "group 0: attention group hit rate (per window)", "group 1: state group hit rate (per window)"}
    assert {"group 0 (attention) mean", "group 1 (state) mean"} <= names(at)


def test_windowed_charts_use_the_store_nice_window_with_the_dashboards_window_count(dashboard_db, monkeypatch):
    run_id, run = next(iter(run_ids(dashboard_db).items()))
    s = run["summary"]
    windows = queries.windows_for(s["requests"])
    w = read.nice_window(int(s["virtual_duration_s"] * 1e9), windows)
    at = render(dashboard_db, monkeypatch, "hit_rate", run=run_id)
    starts = {round(x * 1e9) for t in traces(at) if t["name"].endswith("(per window)") for x in t["x"]}
    assert starts and all(x % w == 0 for x in starts)
    assert 1 < len(starts) <= windows + 1


def test_group_and_window_filters_are_bound_to_the_url(dashboard_db, monkeypatch):
    run_id, _ = on_off(dashboard_db)
    at = render(dashboard_db, monkeypatch, "hit_rate", run=run_id, group="0")
    assert {x for x in names(at) if "group hit rate (per window)" in x} == {
        "group 0: attention group hit rate (per window)"}
    at.selectbox(key="qp_group").select(1).run()
    assert at.query_params["group"] == ["1"] or at.query_params["group"] == "1"
    assert {x for x in names(at) if "group hit rate (per window)" in x} == {
        "group 1: state group hit rate (per window)"}
    # A time window from the URL trims the x axis.
    at = render(dashboard_db, monkeypatch, "hit_rate", run=run_id, t0="1", t1="2")
    xs = [x for t in traces(at) if t["name"].endswith("(per window)") for x in t["x"]]
    assert xs and min(xs) >= 1 and max(xs) <= 2


@pytest.mark.parametrize("store", ["dashboard_db", "stale_db"])
def test_evictions_page_shows_reasons_publish_kinds_attribution_and_histograms(request, store, monkeypatch):
    from kvtrace.dashboard import charts

    db = request.getfixturevalue(store)
    for run_id in run_ids(db):
        at = render(db, monkeypatch, "evictions", run=run_id)
        n = names(at)
        reasons = {charts.REASON_NAMES.get(r, r) for r in read.evictions_by_reason(db, run_id)["reason"]}
        kinds = {charts.KIND_NAMES.get(k, k) for k in read.evictions_by_publish_kind(db, run_id)["publish_kind"]}
        assert reasons and reasons | kinds <= n
        flows = read.eviction_attribution_flows(db, run_id)
        sankeys = [t for t in traces(at) if t["type"] == "sankey"]
        assert len(sankeys) == (1 if flows.height else 0)
        if sankeys:
            assert sum(sankeys[0]["link"]["value"]) == 2 * int(flows["misses"].sum())
            # prefixes by short hash, first request and length, never as a 64-hex hash
            labels = sankeys[0]["node"]["label"]
            assert not any(len(x) >= 32 and all(c in "0123456789abcdef" for c in x) for x in labels)
            assert any(" · first " in x and "longest hit" in x for x in labels)
            # one colour per reason and publish kind, the same as in the stacked bar charts
            bars = {t["name"]: t["marker"]["color"] for t in traces(at) if t["type"] == "bar" and "marker" in t}
            for label, colour in zip(labels, sankeys[0]["node"]["color"]):
                if label in bars:
                    assert bars[label] == colour, label
        hist = set(read.block_histograms(db, run_id)["metric"])
        shown = {"lifetime": "lifetime at eviction", "idle_before_evict": "idle before eviction",
                 "reuse_gap": "prefix reuse gap"}
        subplot_titles = {a["text"] for el in at.get("plotly_chart")
                          for a in json.loads(el.proto.spec)["layout"].get("annotations", [])}
        assert {shown[m] for m in hist} <= n and {shown[m] for m in hist} <= subplot_titles


def test_stale_page_drills_down_to_the_span_chain(stale_db, monkeypatch):
    run_on, run_off = on_off(stale_db)
    at = render(stale_db, monkeypatch, "stale", run=run_off)
    assert {"stale hash found", "divergent output"} <= names(at)
    stale = read.stale_hashes(stale_db, run_off)
    first = stale.filter(pl.col("request_id").is_not_null()).row(0, named=True)  # the default: one with a request
    m = metrics(at)
    assert shown(m["Request"]) == first["request_id"]  # (markdown: the id escaped)
    assert m["Block id (group)"] == f"{first['block_id']} (g{first['group_id']})"
    assert m["Expected fingerprint"] == f"{first['expected_fingerprint']:#018x}"
    chain = at.dataframe[0].value
    assert {"publish", "overwrite", "stale_hit"} <= set(chain["role"])
    assert list(chain["time_ms"]) == sorted(chain["time_ms"])  # in time order, in ms
    fps = [v for v in chain["expected_fingerprint"] if isinstance(v, str)]  # (pandas shows NULL as NaN)
    assert fps and all(len(v) == 18 and v.startswith("0x") for v in fps)
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
    assert {"TTFT", "ITL", "TPOT", "queue", "mean ITL", "p99 ITL"} <= n
    assert {"prefill", "decode", "cache hit"} <= n
    ttft = next(t for t in traces(at) if t["name"] == "TTFT" and t["type"] == "scatter")
    assert ttft["x"][-1] == pytest.approx(reqs["ttft_ns"].max() / 1e6)
    # vllm bench serve's statistics, as the summary has them
    s = read.run(dashboard_db, run_id)["summary"]
    table = at.dataframe[0].value
    row = table[table["metric"] == "TTFT"].iloc[0]
    assert (row["median"], row["p99"], row["std"]) == (
        pytest.approx(s["median_ttft_ms"]), pytest.approx(s["p99_ttft_ms"]), pytest.approx(s["std_ttft_ms"]))
    assert any("modelled by cost model" in c.value for c in at.caption)
    prefill = next(t for t in traces(at) if t["name"] == "prefill")
    chunks = read.request_waterfall(dashboard_db, run_id, rid).filter(pl.col("segment") == "prefill")
    assert len(prefill["x"]) == chunks.height
    titles = [json.loads(el.proto.spec)["layout"]["title"]["text"] for el in at.get("plotly_chart")]
    assert f"Request {rid}" in titles
    assert at.query_params["request"] in (rid, [rid])
    # the time slider sits above the one chart it filters
    labels = [el.label for el in at.get("slider")]
    assert labels == ["Virtual time window (filters the chart below)"]


def test_latency_log_scale_is_bound_to_the_url(dashboard_db, monkeypatch):
    run_id, _ = on_off(dashboard_db)
    at = render(dashboard_db, monkeypatch, "latency", run=run_id, log="1")
    specs = [json.loads(el.proto.spec)["layout"] for el in at.get("plotly_chart")]
    cdfs = [lay for lay in specs if "CDF" in lay["title"]["text"]]
    assert cdfs and all(lay["xaxis"]["type"] == "log" for lay in cdfs)
    at.checkbox(key="qp_log").uncheck().run()
    assert "log" not in at.query_params
    assert all(json.loads(el.proto.spec)["layout"]["xaxis"].get("type") != "log" for el in at.get("plotly_chart")
               if "CDF" in json.loads(el.proto.spec)["layout"]["title"]["text"])


def test_waterfall_marks_one_cache_hit_per_request_not_every_repeated_lookup(dashboard_db, monkeypatch):
    run_id, _ = on_off(dashboard_db)
    lookups = read.per_prefix_reuse(dashboard_db, run_id, top=1000)
    assert lookups.height
    # a request looked up more than once (it waited for blocks, or was preempted)
    import duckdb

    with duckdb.connect(dashboard_db, read_only=True) as con:
        rid, n = con.sql("SELECT request_id, count(*) AS n FROM lookup_spans WHERE run_id = $r GROUP BY 1 "
                         "ORDER BY n DESC, request_id LIMIT 1", params={"r": run_id}).fetchall()[0]
    wf = read.request_waterfall(dashboard_db, run_id, rid)
    assert wf.filter(pl.col("segment") == "cache_hit").height == 1
    at = render(dashboard_db, monkeypatch, "latency", run=run_id, request=rid)
    (marks,) = [t for t in traces(at) if t["name"] == "cache hit"]
    assert len(marks["x"]) == 1
    if n > 1:
        assert f"after {n - 1} lookups" in marks["hovertext"][0]


def test_compare_page_deltas_ci_cdfs_and_markdown_are_kvtrace_diffs(dashboard_db, monkeypatch, capsys):
    from kvtrace.compare.render import fmt
    from kvtrace.compare.source import diff_runs

    run_on, run_off = on_off(dashboard_db)
    at = render(dashboard_db, monkeypatch, "compare", run=run_on)  # no ?b=: the one-setting partner
    assert at.query_params["b"] in (run_off, [run_off])
    s_on, s_off = read.run(dashboard_db, run_on)["summary"], read.run(dashboard_db, run_off)["summary"]
    m = {x.label: x for x in at.metric}
    assert m["Evictions (B)"].value == f"{s_off['evictions']:,}"
    assert m["Evictions (B)"].proto.delta == f"{s_off['evictions'] - s_on['evictions']:+,}"
    d = s_off["prefix_cache_hit_rate"] - s_on["prefix_cache_hit_rate"]
    assert m["Prefix cache hit rate (B)"].proto.delta == ui.pp(d) and d < 0  # pinning off loses hits
    assert m["Prefix cache hit rate (B)"].value == ui.pct(s_off["prefix_cache_hit_rate"])
    # the CLI's bootstrap CI on a latency delta, where it gives one (the median's is its p50's)
    diff = diff_runs(dashboard_db, run_on, run_off)
    shifts = {x.name: x for x in diff.latency}
    with_ci = 0
    for tile, name in (("TTFT median", "p50_ttft_ms"), ("TTFT p99", "p99_ttft_ms"), ("ITL median", "p50_itl_ms"),
                       ("ITL p99", "p99_itl_ms")):
        helptext, ci = m[f"{tile} (modelled) (B)"].help, shifts[name]
        if math.isnan(ci.ci_low):
            assert "bootstrap CI" not in helptext, tile
        else:
            with_ci += 1
            assert f"95% bootstrap CI of B − A: [{fmt(ci.ci_low, signed=True)}, {fmt(ci.ci_high, signed=True)}] ms" \
                in helptext, tile
    assert with_ci >= 1
    assert {"A pinning on", f"B {read.run(dashboard_db, run_off)['name']}"} <= names(at)
    titles = {json.loads(el.proto.spec)["layout"]["title"]["text"] for el in at.get("plotly_chart")}
    assert {"TTFT CDF, A vs B", "ITL CDF, A vs B"} <= titles
    shifts = next(df.value for df in at.dataframe if "percentile" in df.value.columns)
    assert list(shifts["percentile"]) == [x.name for x in diff.latency]
    # the copy-as-Markdown block is kvtrace diff --markdown, byte for byte (the command run in this process)
    from tests.cli.support import run

    capsys.readouterr()  # (only the command's own output below)
    code, stdout, stderr = run(["diff", run_on, run_off, "--db", dashboard_db, "--markdown"], capsys)
    assert code == 0, stderr
    (block,) = [c for c in at.code if c.language == "markdown"]
    assert block.value.rstrip("\n") == stdout.rstrip("\n")  # (echo adds a newline)
    on, off = (set(read.run(dashboard_db, r)["behaviours"]) for r in (run_on, run_off))
    (differ,) = sorted(on ^ off)
    assert any(shown(c.value) == f"Settings that differ: behaviour {differ}: A on → B off" for c in at.caption)
    # one setting, same mode and capacity: an isolated measurement; warned of only what kvtrace diff notes
    assert [shown(w.value) for w in at.warning] == diff.notes
    a = read.per_request_hits(dashboard_db, run_on)
    b = read.per_request_hits(dashboard_db, run_off)
    joined = a.join(b, on="request_id", suffix="_b").sort("request_id")
    delta = (joined["num_cached_tokens_b"] - joined["num_cached_tokens"]).to_list()
    if any(delta):
        bars = next(t for t in traces(at) if t["name"] == "cached tokens B − A")
        assert bars["y"] == delta
    else:  # the switch moved no request: said in words, not as a flat chart
        assert any(f"All {len(delta)} requests got the same cached tokens" in i.value for i in at.info)


def test_compare_page_per_request_bars_where_requests_moved(stale_db, monkeypatch):
    run_on, run_off = on_off(stale_db)
    at = render(stale_db, monkeypatch, "compare", run=run_on, b=run_off)
    a = read.per_request_hits(stale_db, run_on)
    b = read.per_request_hits(stale_db, run_off)
    joined = a.join(b, on="request_id", suffix="_b").sort("request_id")
    delta = (joined["num_cached_tokens_b"] - joined["num_cached_tokens"]).to_list()
    assert any(delta)
    bars = next(t for t in traces(at) if t["name"] == "cached tokens B − A")
    assert bars["y"] == delta and bars["x"] == joined["request_id"].to_list()
    moved = next(df.value for df in at.dataframe if "cached_delta" in df.value.columns)
    assert (moved["cached_delta"] != 0).all() and len(moved) == min(50, sum(1 for d in delta if d))
    assert list(moved["cached_delta"].abs()) == sorted(moved["cached_delta"].abs(), reverse=True)


@pytest.fixture(scope="module")
def pairs_db(tmp_path_factory):
    """An engine run A, a run differing in two settings, and a cache-only run of one trace."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path_factory.mktemp("pairs") / "pairs.duckdb")
    a = run_replay(RunSpec("gen:mixed", limit=12, name="A"), db=db)
    two = run_replay(RunSpec("gen:mixed", limit=12, name="two changes", without=("shared-prefix-pinning",),
                             retention="1024"), db=db)
    co = run_replay(RunSpec("gen:mixed", limit=12, mode="cache-only", capacity_blocks=400, block_size=512,
                            name="cache-only"), db=db)
    return db, a.run_id, two.run_id, co.run_id


def test_compare_without_a_one_setting_partner_says_so_and_names_the_study_command(pairs_db, monkeypatch):
    db, a, two, _ = pairs_db
    at = render(db, monkeypatch, "compare", run=a)
    info = " ".join(i.value for i in at.info)
    assert "differs from A in exactly one setting" in info
    assert "kvtrace study" in info and "--trace gen:mixed" in info and f"--db {db}" in info
    assert "b" not in at.query_params and not at.metric  # nothing picked for the user
    # picking B anyway: a visible warning listing every difference
    at.selectbox(key="qp_b").select(two).run()
    (warning,) = [shown(w.value) for w in at.warning if "Not an isolated measurement" in w.value]  # (and diff's notes)
    assert "behaviour shared-prefix-pinning: A on → B off" in warning and "retention_interval" in warning


def test_compare_shows_a_missing_ci_as_kvtrace_diff_does(pairs_db, monkeypatch):
    """12 requests hold no p99 CI: the percentile table showed Streamlit's grey "None" in its
    "CI low"/"CI high" columns (no unit either); kvtrace diff prints [–, –]."""
    db, a, two, _ = pairs_db
    at = render(db, monkeypatch, "compare", run=a, b=two)
    (table,) = [d.value for d in at.dataframe if "95% CI of B − A (ms)" in d.value.columns]
    cis = dict(zip(table["percentile"], table["95% CI of B − A (ms)"]))
    assert cis["p99_ttft_ms"] == "[–, –]" and all(isinstance(c, str) and c.startswith("[") for c in cis.values())
    assert "CI low" not in table.columns


def test_compare_never_sets_an_engine_ttft_against_a_cache_only_run(pairs_db, monkeypatch):
    db, a, _, co = pairs_db
    at = render(db, monkeypatch, "compare", run=a, b=co)
    m = {x.label: x for x in at.metric}
    assert m["TTFT p99 (modelled) (B)"].value == "–" and not m["TTFT p99 (modelled) (B)"].proto.delta
    assert any("mode: A engine → B cache-only" in shown(w.value) for w in at.warning)
    assert any("No latency to compare" in i.value for i in at.info)
    assert read.run(db, co)["summary"]["p99_ttft_ms"] is None  # null, not 0


def test_an_unknown_run_in_the_link_is_named_never_replaced(pairs_db, monkeypatch):
    db, a, _, _ = pairs_db
    at = render(db, monkeypatch, run="r-from-another-store")
    (warning,) = [w.value for w in at.warning]
    assert "r-from-another-store" in warning and db in warning
    assert not at.metric and not at.dataframe  # no other run shown in its place
    assert at.query_params["run"] in ("r-from-another-store", ["r-from-another-store"])
    at = render(db, monkeypatch, "compare", run=a, b="gone")
    assert any("`gone` (B, from the link)" in w.value for w in at.warning)
    assert not at.metric


def test_missing_and_foreign_databases_give_one_error_line(tmp_path, monkeypatch):
    at = render(str(tmp_path / "nope.duckdb"), monkeypatch)
    assert len(at.error) == 1 and "no such database file" in at.error[0].value
    bad = tmp_path / "bad.duckdb"
    bad.write_text("not a database\n")
    at = render(str(bad), monkeypatch)
    assert len(at.error) == 1 and str(bad) in shown(at.error[0].value)
    monkeypatch.delenv(DB_ENV, raising=False)
    at = app_test(60).run()
    assert not at.exception and "No database given" in at.error[0].value


def test_empty_store_says_what_fills_it(tmp_path, monkeypatch):
    from kvtrace.store.writer import Store

    db = tmp_path / "empty.duckdb"
    Store.open(db).close()
    at = render(str(db), monkeypatch)
    assert not at.error and "kvtrace demo" in at.info[0].value


def test_a_running_run_is_shown_at_the_next_page_run_and_refresh_rereads_the_store(tmp_path, monkeypatch):
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
    # the store changed (a commit): the next page run reads it, no Refresh needed
    options = at.selectbox(key="qp_run").options
    assert len(options) == len(before) + 1 and any("RUNNING" in o for o in options)
    at.button[0].click().run()  # Refresh re-reads all the same
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


# A collected run's id is whatever its OTLP sender put in kvtrace.run_id, and a link's run
# is whatever the URL says: markdown, HTML, a Streamlit colour directive, math, backticks.
HOSTILE = "x** ![p](http://e.invalid/p.png) [l](http://e.invalid) <b>h</b> :red[r] $m$ `t` _u_"


def test_names_ids_and_links_are_shown_as_they_are_never_as_markdown(tmp_path, monkeypatch):
    """Each page's markdown, rendered by a CommonMark parser (markdown-it, as Streamlit's
    react-markdown parses it), shows the text literally: no image, link, emphasis or HTML
    made from it, and the text whole."""
    from markdown_it import MarkdownIt

    from kvtrace.store.writer import Store

    db = str(tmp_path / "hostile.duckdb")
    with Store.open(db) as store:
        for suffix in ("", " B"):
            run = store.create_run(f"otlp {HOSTILE}{suffix}", run_id=f"{HOSTILE}{suffix}", mode="otlp",
                                   trace_source=f"{HOSTILE} trace")
            store.finish_run(run)
    html = MarkdownIt().render
    pages = [render(db, monkeypatch, run=HOSTILE), render(db, monkeypatch, "compare", run=HOSTILE, b=f"{HOSTILE} B"),
             render(db, monkeypatch, run=f"{HOSTILE} gone")]
    whole = 0
    for at in pages:
        for el in [*at.markdown, *at.caption, *at.warning, *at.info, *at.error]:
            out = html(el.value)
            assert "<img" not in out and "<a " not in out and "<b>" not in out and "<em>" not in out, el.value
            whole += HOSTILE in shown(el.value)
    assert whole >= 3  # the overview's name, A on the Compare page, the unknown run's warning


def test_a_page_load_reads_a_store_changed_since_the_last_one(dashboard_db, stale_db, tmp_path, monkeypatch):
    """The cache is keyed on the store's state as well as the refresh token, which every
    new session starts at 0: a store replaced or damaged is read again by the next page
    load, never served from another session's answers."""
    import shutil

    live = str(tmp_path / "live.duckdb")
    shutil.copy(dashboard_db, live)
    first = next(iter(run_ids(dashboard_db)))
    at = render(live, monkeypatch, run=first)
    assert not at.error and metrics(at)

    with open(live, "r+b") as f:  # the same file, overwritten in place with garbage
        f.write(b"\0garbage" * 4096)
    at = render(live, monkeypatch, run=first)
    assert at.error and "live.duckdb: not a DuckDB database" in shown(at.error[0].value)
    assert not metrics(at)

    shutil.copy(stale_db, live)  # another store at the same path
    at = render(live, monkeypatch)
    options = {str(o) for o in at.sidebar.selectbox[0].options}
    labels = set(queries.with_run_columns(read.runs(stale_db))["label"])
    assert not at.error and options == labels


def test_names_reach_charts_as_text_not_plotly_markup(dashboard_db, tmp_path, monkeypatch):
    """Plotly draws a subset of HTML in legends, labels and titles (a link, a line break,
    a styled span): a run's name is shown as it was typed on every chart."""
    import shutil

    import duckdb

    from kvtrace.names import plotly_literal

    db = str(tmp_path / "named.duckdb")
    shutil.copy(dashboard_db, db)
    on, off = on_off(db)
    name = '<a href="https://example.com/">CLICK</a><br><span style="font-size:40px">BIG</span> & co'
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET name = ? WHERE run_id = ?", [name, off])
    at = render(db, monkeypatch, "compare", run=on, b=off)
    drawn = [t for t in traces(at) if "CLICK" in str(t.get("name"))]
    assert drawn and all(t["name"] == f"B {plotly_literal(name)}" for t in drawn)
    for t in traces(at):
        for field in ("name", "text", "hovertext", "x", "y"):
            assert "<a " not in json.dumps(t.get(field)), (field, t.get(field))


def test_a_damaged_run_record_leaves_the_stores_other_runs_readable(tmp_path, monkeypatch):
    """One run whose config is JSON null made every page of the store one error ("run r2's
    config is null"): the other runs are shown, the damaged one's pages name its damage."""
    import duckdb

    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "d.duckdb")
    run_replay(RunSpec("gen:chat", limit=4), db=db)
    run_replay(RunSpec("gen:chat", limit=4, mode="cache-only"), db=db)
    with duckdb.connect(db) as con:
        con.execute("UPDATE runs SET config = 'null' WHERE run_id = 'r2'")
    at = render(db, monkeypatch, run="r1")
    assert not at.error and not at.exception and at.metric
    at = render(db, monkeypatch, "hit_rate", run="r2")
    said = f"{db}: damaged kvtrace store: run r2's config is null, expected a JSON object"
    assert [shown(w.value) for w in at.warning if said in shown(w.value)]  # (above the page, once)
    assert not at.error and not at.exception
