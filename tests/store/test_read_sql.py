"""The read package's query layer (kvtrace/store/read/_sql.py): the one query runner,
window resolution, NO_WINDOW, the nice window, and values bound as parameters."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest

from kvtrace.store import read
from kvtrace.store.read import _sql
from kvtrace.store.read._api import BadArgument

READ_DIR = Path(_sql.__file__).parent


@pytest.fixture()
def queries_run(monkeypatch):
    """Every (sql, params) ``_sql.query`` runs, in order."""
    calls: list[tuple[str, dict]] = []
    real = _sql.query

    def spy(con, sql, params=None):
        calls.append((sql, dict(params or {})))
        return real(con, sql, params)

    monkeypatch.setattr(_sql, "query", spy)
    return calls


def test_no_window_resolves_no_window_and_binds_no_w(scenario_db, queries_run):
    db, run_id = scenario_db
    frame = _sql.with_run(db, run_id, "SELECT count(*) AS n FROM spans WHERE run_id = $run_id",
                          window_ns=_sql.NO_WINDOW)
    assert frame["n"].to_list() == [21]
    # the run lookup, then the query itself: no scan of the run's time extent
    assert len(queries_run) == 2
    assert not any("min(start_ns)" in sql for sql, _ in queries_run)
    assert queries_run[-1][1] == {"run_id": run_id}


def test_no_window_is_the_default_and_a_query_naming_w_then_fails(scenario_db):
    db, run_id = scenario_db
    with pytest.raises(duckdb.Error, match=r"not provided for the following parameters: w$"):
        _sql.with_run(db, run_id, "SELECT $w AS w, $run_id AS run_id")


def test_window_none_binds_the_nice_window_of_the_run_extent(scenario_db, queries_run):
    db, run_id = scenario_db
    frame = _sql.with_run(db, run_id, "SELECT $w AS w, $run_id AS run_id", window_ns=None)
    # the scenario's spans cover 0..5000 ns: 5000 // 200 = 25 rounds up to 50
    assert frame["w"].to_list() == [read.nice_window(5000)] == [50]
    assert len(queries_run) == 3 and "min(start_ns)" in queries_run[1][0]


def test_an_explicit_window_is_bound_as_given_and_must_be_positive(scenario_db, queries_run):
    db, run_id = scenario_db
    assert _sql.with_run(db, run_id, "SELECT $w AS w, $run_id AS run_id", window_ns=1234)["w"].to_list() == [1234]
    assert len(queries_run) == 2
    with pytest.raises(ValueError, match=r"^hit_counters_over_time: window_ns: expected 1 to"):
        read.hit_counters_over_time(db, run_id, window_ns=0)
    with pytest.raises(ValueError, match="window_ns: must be positive"):  # (the helper's own check beneath)
        _sql.with_run(db, run_id, "SELECT $w AS w", window_ns=0)


def test_the_read_functions_default_window_is_the_nice_window(scenario_db):
    frame = read.hit_counters_over_time(*scenario_db)
    starts = frame["window_start_ns"].to_list()
    assert starts and all(s % read.nice_window(5000) == 0 for s in starts)
    assert frame["prompt_tokens_by_source.local_cache_hit"].sum() == 32


@pytest.mark.parametrize(("span_ns", "windows", "expected"), [
    (0, 200, 1), (1, 200, 1), (5000, 200, 50), (5000, 100, 50), (5000, 20, 500),
    (10**9, 200, 5 * 10**6), (10**9, 20, 5 * 10**7), (1_234_567, 100, 20_000), (999, 1, 1000),
])
def test_nice_window_is_the_smallest_round_length_giving_at_most_about_windows(span_ns, windows, expected):
    assert read.nice_window(span_ns, windows) == expected


def test_nice_window_rounds_up_to_1_2_5_times_a_power_of_ten():
    for span in (7, 250, 4_999, 123_456, 10**7 + 3, 987_654_321_000):
        for windows in (1, 7, 20, 200):
            w, raw = read.nice_window(span, windows), max(1, span // windows)
            k = len(str(w)) - 1
            m = w // 10**k
            assert m in (1, 2, 5) and w == m * 10**k, w
            next_smaller = {1: 5 * 10**k // 10, 2: 10**k, 5: 2 * 10**k}[m]
            assert next_smaller < raw <= w, (span, windows, w)


def test_values_are_bound_not_spliced_into_sql(scenario_db):
    db, run_id = scenario_db
    quote = "h2' OR '1'='1"
    assert read.stale_hash_chain(db, run_id, quote).height == 0
    assert read.itl_gaps(db, run_id, "A' OR 'x'='x").height == 0
    assert read.request_waterfall(db, run_id, quote).height == 0
    assert read.per_prefix_reuse(db, run_id, top=1).height == 1
    assert read.eviction_attribution(db, run_id, limit=2).height == 2
    assert read.eviction_attribution(db, run_id).height == 3  # limit None: every row
    assert read.eviction_attribution_flows(db, run_id, top_prefixes=1)["prefix"].unique().sort().to_list() == [
        "h1", "other"]
    assert read.block_histograms(db, run_id, bins=1).group_by("metric").len()["len"].to_list() == [1, 1, 1]


def test_only_the_query_runner_opens_the_store_and_executes_sql():
    """The seam a second backend slots into: no module of read/ but _sql.py opens the
    database or runs SQL itself."""
    touches_db = re.compile(r"\.(sql|execute|fetchall|fetchone)\(|fetch_one|read_connection|kvtrace\.store\.connection")
    for path in sorted(READ_DIR.glob("*.py")):
        if path.name != "_sql.py":
            assert not touches_db.search(path.read_text()), path.name
    assert touches_db.search((READ_DIR / "_sql.py").read_text())


def test_the_package_keeps_the_public_names_of_the_old_module():
    for name in ("DB", "DEFAULT_WINDOWS", "nice_window", "runs", "run",
                 "span_counts", "hit_counters", "hit_counters_over_time", "group_hit_rates", "usage_over_time",
                 "per_prefix_reuse", "latency_samples", "latency_stats", "latency_summary",
                 "evictions_over_time", "evictions_by_reason", "evictions_by_publish_kind", "eviction_attribution",
                 "eviction_attribution_flows", "block_histograms", "stale_hashes_over_time", "stale_hashes",
                 "stale_hash_chain", "divergent_outputs", "requests", "per_request_hits", "itl_gaps", "latency_cdf",
                 "latency_percentiles", "latency_histogram", "itl_over_time", "request_waterfall"):
        assert name in read.__all__ and hasattr(read, name), name
    assert callable(read.runs)
    for path in READ_DIR.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 450, path.name


@pytest.mark.parametrize(("args", "says"), [
    ((float("nan"),), "span_ns: expected int"), (([1, 2],), "span_ns: expected int"),
    ((-5,), "span_ns: expected 0 to"), ((5000, 0), "windows: expected 1 to"),
])
def test_nice_window_refuses_what_is_no_span_in_one_line(args, says):
    # NaN was numpy's ValueError, a list a TypeError, a negative span a silent 1 ns window
    with pytest.raises(BadArgument, match=re.escape(f"nice_window: {says}")):
        read.nice_window(*args)
