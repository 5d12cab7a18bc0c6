"""A ClickHouse export reads a run a page at a time (the "Big" probe, scale).

A ClickHouse result is whole in memory: ``export --db chdb:...`` fetched a run's spans and
evicted blocks in one query each, 198,152 spans of a 40,000-request cache-only run as 195 MB
of Arrow and 805 MB of the process (a DuckDB export streams them). It now fetches about
``_BATCH_ROWS`` rows a query, in ranges of each table's ordering key, into the same files.
"""

from __future__ import annotations

import polars as pl
import polars.testing
import pyarrow.parquet as pq

from kvtrace.store import export as export_module
from kvtrace.store import export_parquet
from kvtrace.store.clickhouse import client

BATCH = 8
# pages of spans, of evicted blocks: in batches (a span page of one batch made 110 queries of the run's 1,771
# spans, half a minute)
PAGES = {"spans": 16, "evicted_blocks": 2}


def _fetched(monkeypatch) -> list[tuple[str, int]]:
    """Every query's SQL and the rows it brought into Python, from now on."""
    fetched: list[tuple[str, int]] = []
    query_arrow = client.ClickHouseConnection.query_arrow

    def counting(self, sql, params=None):
        rows = query_arrow(self, sql, params)
        fetched.append((sql, rows.num_rows))
        return rows

    monkeypatch.setattr(client.ClickHouseConnection, "query_arrow", counting)
    return fetched


def test_a_chdb_export_fetches_its_rows_a_page_at_a_time(ch_stores, tmp_path, monkeypatch):
    duck = export_parquet(ch_stores.duck, ch_stores.run_on, tmp_path / "duck")
    evicted = pl.from_arrow(pq.read_table(duck["evicted_blocks"]))
    spans = pq.read_table(duck["spans"]).num_rows
    span_page, evict_page = PAGES["spans"] * BATCH, PAGES["evicted_blocks"] * BATCH
    assert spans > 4 * span_page and evicted.height > 2 * evict_page  # (pages to cut)
    # one evict span's blocks stay on one page: a page holds at most BATCH rows, or one span's
    widest = int(evicted.group_by("evict_seq").len()["len"].max())

    monkeypatch.setattr(export_module, "_BATCH_ROWS", BATCH)
    monkeypatch.setattr(export_module, "_PAGE_BATCHES", PAGES)
    fetched = _fetched(monkeypatch)
    ch = export_parquet(ch_stores.direct, ch_stores.run_on, tmp_path / "ch")
    monkeypatch.undo()

    span_queries = [n for sql, n in fetched if "FROM spans" in sql and "BETWEEN $lo" in sql]
    evict_queries = [n for sql, n in fetched if "FROM evicted_blocks" in sql and "BETWEEN $lo" in sql]
    assert sum(span_queries) == spans and len(span_queries) >= spans // span_page
    assert sum(evict_queries) == evicted.height and len(evict_queries) >= evicted.height // evict_page
    bounds = [n for sql, n in fetched if "OVER (ORDER BY k" in sql]  # (one row a page)
    assert len(bounds) == 2 and bounds[0] <= spans // span_page + 1
    assert max(span_queries) <= span_page and max(evict_queries) <= max(evict_page, widest)
    assert max(n for sql, n in fetched if "OVER (ORDER BY k" not in sql) <= max(span_page, evict_page, widest)
    for table in ("spans", "evicted_blocks"):  # the same files as one query wrote, and as DuckDB's
        a, b = pq.read_table(duck[table]), pq.read_table(ch[table])
        assert a.schema.equals(b.schema)
        pl.testing.assert_frame_equal(pl.from_arrow(a), pl.from_arrow(b))


def test_a_chdb_run_without_spans_exports_empty_files(chdb_store, tmp_path):
    from kvtrace.store import Store

    with Store.open(chdb_store) as store:
        run_id = store.create_run("empty", trace_source="t", trace_digest="d", config={}, behaviours=[],
                                  mode="cache-only/lru")
        store.finish_run(run_id, status="complete", digest="x", summary={})
    files = export_parquet(chdb_store, run_id, tmp_path / "out")
    assert pq.read_table(files["spans"]).num_rows == 0
    assert pq.read_table(files["evicted_blocks"]).num_rows == 0
    assert pq.read_table(files["runs"]).num_rows == 1


def test_a_slice_of_nested_lists_is_made_canonical():
    """A batch cut from a bigger result chunk is a slice: its list of structs (a span's links)
    with a NULL among them was refused by Arrow ("Null bitmap with offsets slice not
    supported"). chdb's result chunks (65,409 rows) are below the export's 65,536-row batch,
    so only a smaller batch (this file's first test, before the paging) reached it."""
    import pyarrow as pa

    from kvtrace.store.export import _canonical_column, _canonical_type

    t = pa.list_(pa.struct([("a", pa.string()), ("m", pa.map_(pa.string(), pa.string()))]))
    whole = pa.array([[{"a": "x", "m": []}], None, [], [{"a": "y", "m": [("k", "v")]}]] * 3, type=t)
    part = whole.slice(5, 5)
    assert _canonical_column(part, _canonical_type(t)).to_pylist() == \
        _canonical_column(whole, _canonical_type(t)).to_pylist()[5:10] == \
        [None, None, [{"a": "y", "m": [("k", "v")]}], [{"a": "x", "m": None}], None]
