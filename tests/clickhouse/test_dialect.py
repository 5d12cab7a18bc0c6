"""The dialect rules, each on the construct it exists for: DuckDB and ClickHouse (chdb)
run the same DuckDB-spelled SQL over the same rows and give the same frame; and the
``--db`` forms parse, or fail in one line naming the flag."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest
from polars.testing import assert_frame_equal

from kvtrace.errors import ConfigError
from kvtrace.store.backend import clickhouse_target, db_label, is_clickhouse
from kvtrace.store.clickhouse import client
from kvtrace.store.read._sql import query

ROWS = pa.table({
    "k": ["a", "a", "b", "b", "b", None],
    "t": pa.array([1_796_000_000_123_456_789, 7, -7, 20, 20, 3], pa.int64()),  # ns beyond float precision
    "v": pa.array([1.0, 2.0, 3.0, 4.0, 10.0, None]),
    "l": pa.array([[1, 2, 3], [4], [], [5, 6], [7, 8], [9]], pa.list_(pa.int64())),
    "h": pa.array([["x", "y", "z"], ["w"], [], ["p", "q"], ["r", "s"], ["u"]], pa.list_(pa.string())),
    "s": ["1.5", "x", "", "2", "3e2", None],
    # beside l: longer, shorter, NULL (ClickHouse stores []), as a capture's NULL block_ids beside its hashes
    "u": pa.array([[10], None, [11, 12], [13, 14, 15], None, [16]], pa.list_(pa.int64())),
})

CASES = {
    "integer division keeps nanoseconds": "SELECT t // $w * $w AS w0 FROM r ORDER BY t",
    "zipped unnest, counts as BIGINT": """
        SELECT k, unnest(l) AS x, unnest(h) AS y, unnest(range(len(l))) AS i FROM r ORDER BY k, x""",
    "zipped unnest pads the shorter list with NULL": """
        SELECT t, unnest(l) AS x, unnest(u) AS y, unnest(h) AS z FROM r ORDER BY t, x, y, z""",
    "count, FILTER, count DISTINCT": """
        SELECT k, count(*) AS n, count(*) FILTER (WHERE v > 2) AS big, count(DISTINCT t) AS d
        FROM r GROUP BY ALL ORDER BY k""",
    "exact median": "SELECT k, median(v) AS m FROM r GROUP BY k ORDER BY k",
    "lag and lead see NULL past the edge": """
        SELECT k, t, lag(t) OVER (PARTITION BY k ORDER BY t) AS prev, lead(t) OVER (PARTITION BY k ORDER BY t) AS nxt
        FROM r ORDER BY k, t""",
    "aggregates over no rows are NULL": "SELECT min(t) AS lo, sum(v) AS s FROM r WHERE t > 1e19",
    "LIMIT NULL is every row": "SELECT t FROM r ORDER BY t LIMIT $lim",
    "ORDER BY an output name that is also a column": """
        SELECT k, -sum(t) AS t FROM r GROUP BY k ORDER BY t, k""",
    "a column of the same name inside its alias": """
        SELECT coalesce(k, 'none') AS k, sum(v) / sum(sum(v)) OVER () AS v FROM r GROUP BY ALL ORDER BY k""",
    "TRY_CAST is NULL where it does not convert": "SELECT s, TRY_CAST(s AS DOUBLE) AS d FROM r ORDER BY t",
    "list functions and 1-based subscripts": """
        SELECT list_contains(h, 'y') AS c, l[1] AS first, list_position(['w', 'p', 'x'], h[1]) AS pos FROM r
        WHERE len(l) > 0 ORDER BY t""",
    "a bound NULL": "SELECT count(*) AS n FROM r WHERE $k IS NULL OR k = $k",
    "a bound list": "SELECT t FROM r WHERE t IN $ts ORDER BY t",
    "a bound empty list, and one with a NULL, beside strings": """
        SELECT t, list_contains($none, k) AS c, list_contains($some, k) AS d FROM r
        WHERE k IS NOT NULL ORDER BY t""",
}
PARAMS = {"w": 1000, "lim": None, "k": None, "ts": [7, 20], "none": [], "some": ["b", None]}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    duck = duckdb.connect()
    duck.register("r_arrow", ROWS)
    duck.execute("CREATE TABLE r AS SELECT * FROM r_arrow")
    target = clickhouse_target(f"chdb:{tmp_path_factory.mktemp('dialect')}")
    with client.connect(target) as ch:
        ch.command("CREATE TABLE r (k Nullable(String), t Int64, v Nullable(Float64), l Array(Int64), "
                   "h Array(String), s Nullable(String), u Array(Int64)) ENGINE = MergeTree ORDER BY t")
        ch.insert_arrow("r", ROWS)
    return duck, target  # opened per test: chdb holds one directory per process


@pytest.mark.parametrize("case", CASES)
def test_the_same_sql_gives_the_same_frame_on_both_engines(engines, case):
    duck, target = engines
    sql = CASES[case]
    params = {k: v for k, v in PARAMS.items() if f"${k}" in sql}
    expected = query(duck, sql, params)
    assert expected.height > 0
    with client.connect(target) as ch:
        assert_frame_equal(query(ch, sql, params), expected)


def test_nanoseconds_survive_the_division(engines):
    _, target = engines
    with client.connect(target) as ch:
        frame = query(ch, CASES["integer division keeps nanoseconds"], {"w": 1000})
    assert frame["w0"].to_list()[-1] == 1_796_000_000_123_456_000


@pytest.mark.parametrize(("db", "want"), [
    ("runs.duckdb", None),
    ("chdb:store", {"embedded": True}),
    ("clickhouse://kv:s3cret@ch.example:9123/otel?otel_table=traces",
     {"host": "ch.example", "port": 9123, "username": "kv", "password": "s3cret", "database": "otel",
      "otel_table": "traces", "secure": False}),
    ("clickhouses://ch.example/otel", {"port": 8443, "secure": True, "username": "default"}),
    # a scheme is case-insensitive (RFC 3986): these were refused as DuckDB paths that read as URLs
    ("CLICKHOUSE://kv:s3cret@ch.example:9123/otel", {"host": "ch.example", "port": 9123, "secure": False}),
    ("ClickHouses://ch.example/otel", {"port": 8443, "secure": True}),
    ("CHDB:store", {"embedded": True}),
])
def test_db_forms(db, want):
    assert is_clickhouse(db) == (want is not None)
    if want is None:
        assert db_label(db) == db
        return
    target = clickhouse_target(db)
    for key, value in want.items():
        assert getattr(target, key) == value, key
    assert "s3cret" not in target.label  # messages never show the password


@pytest.mark.parametrize(("db", "says"), [
    ("chdb:", "expected chdb:PATH"),
    ("clickhouse:///otel", "expected clickhouse://"),
    ("clickhouse://h:port/otel", "port must be a number"),
    ("clickhouse://h/a/b", "one database name"),
    ("clickhouse://h/otel?table=x", "unknown option"),
    ("clickhouse://kv:s3cret@[::1:8123/otel", "not a URL"),  # urlparse's ValueError, once a traceback
    ("clickhouse://kv:s3cret@h:99999/otel", "port must be a number"),
    ("clickhouse://kv:s3cret@h/a/b", "one database name"),
    ("clickhouse://kv:s3cret@h/otel?table=x", "unknown option"),
    ("CLICKHOUSE://kv:s3cret@h/a/b", "one database name"),
])
def test_bad_db_forms_fail_in_one_line(db, says):
    with pytest.raises(ConfigError) as err:
        clickhouse_target(db)
    assert says in str(err.value) and "--db" in str(err.value) and "\n" not in str(err.value)
    assert "s3cret" not in str(err.value)  # nor does a refused URL show its password
