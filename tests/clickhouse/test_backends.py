"""The same real replay in DuckDB and in ClickHouse (chdb: written directly, and through
the collector's otel_traces) answers every dashboard read and every diff field alike."""

from __future__ import annotations

import datetime as dt

import polars as pl
import pyarrow.parquet as pq
import pytest

from kvtrace.compare.render import to_json
from kvtrace.compare.source import diff_runs
from kvtrace.store import export_parquet, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from kvtrace.store.read._sql import connect, query
from tests.clickhouse.frames import assert_same_reads

READ_COUNT_AT_LEAST = 30


@pytest.mark.parametrize("path", ["direct", "collected"])
def test_every_read_of_the_replay_is_the_same_frame_on_both_backends(ch_stores, path):
    other = ch_stores.run_collected if path == "collected" else None  # (the id its export named)
    assert assert_same_reads(ch_stores.duck, getattr(ch_stores, path), ch_stores.run_on,
                             run_id_b=other) >= READ_COUNT_AT_LEAST


def test_every_diff_field_is_the_same_on_both_backends(story_stores):
    (duck, ch), (on, off, _) = story_stores
    a = to_json(diff_runs(duck, on, off, resamples=200))
    b = to_json(diff_runs(ch, on, off, resamples=200))
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key], key
    assert a["correctness"] and a["evictions"] and a["metrics"]  # there was something to compare


def _spans(db: str, run_id: str) -> pl.DataFrame:
    with connect(db) as con:
        frame = query(con, "SELECT * FROM spans WHERE run_id = $run_id ORDER BY seq", {"run_id": run_id})
    # ClickHouse has no NULL map: a link's empty attributes read {} there, NULL in DuckDB
    links = pl.col("links").list.eval(pl.element().struct.with_fields(pl.field("attributes").cast(
        pl.List(pl.Struct({"key": pl.String, "value": pl.String}))).list.len().fill_null(0).alias("attributes")))
    return frame.with_columns(links)


@pytest.mark.parametrize("path", ["direct", "collected"])
def test_the_spans_view_holds_the_same_rows(ch_stores, path):
    duck = _spans(ch_stores.duck, ch_stores.run_on)
    ch = _spans(getattr(ch_stores, path), ch_stores.run_collected if path == "collected" else ch_stores.run_on)
    if path == "collected":  # (the same rows under the id its export named)
        assert set(ch["run_id"]) == {ch_stores.run_collected}
        ch = ch.with_columns(pl.lit(ch_stores.run_on).alias("run_id"))
    assert duck.height == read.runs(ch_stores.duck).filter(pl.col("run_id") == ch_stores.run_on)["num_spans"][0]
    pl.testing.assert_frame_equal(duck, ch)


def test_the_collected_run_carries_the_record_its_export_sent(ch_stores):
    duck, ch = read.run(ch_stores.duck, ch_stores.run_on), read.run(ch_stores.collected, ch_stores.run_collected)
    assert ch_stores.run_collected.startswith(f"{ch_stores.run_on}-")
    for key in ("name", "trace_source", "trace_digest", "digest", "status", "config", "behaviours", "summary",
                "num_spans"):
        assert ch[key] == duck[key], key
    # its mode says how it reached the store, as `kvtrace collect`'s does; the mode it was replayed
    # in is read from its config (the two paths differed: this one took the record's)
    from kvtrace.metrics import replayed_mode

    assert ch["mode"] == "otlp" and replayed_mode(ch["mode"], ch["config"]) == duck["mode"]
    assert ch_stores.payloads >= 2  # the SDK exporter sent real OTLP requests


def test_times_are_stored_at_the_runs_offset_and_views_subtract_it(ch_stores):
    target = clickhouse_target(ch_stores.direct)
    with client.connect(target) as con:
        offset = con.ch_frame("SELECT time_offset_ns FROM runs WHERE run_id = {r:String}",
                              {"r": ch_stores.run_on})["time_offset_ns"][0]
        raw = con.ch_frame("SELECT seq, start_ns, end_ns, time_offset_ns FROM spans_lookup WHERE run_id = {r:String} "
                           "ORDER BY seq", {"r": ch_stores.run_on})
    view = _spans(ch_stores.duck, ch_stores.run_on).filter(pl.col("name") == "kvtrace.cache.lookup")
    # the run's wall-clock start: this century, far from the epoch a TTL drops
    assert dt.datetime.fromtimestamp(offset / 1e9, dt.UTC).year >= 2025
    assert raw["time_offset_ns"].unique().to_list() == [offset]
    assert (raw["start_ns"] - offset).to_list() == view["start_ns"].to_list()
    assert (raw["end_ns"] - offset).to_list() == view["end_ns"].to_list()


def test_the_collectors_ttl_keeps_offset_spans_and_drops_epoch_ones(ch_stores):
    """otel_traces here has the exporter's default 180-day TTL: every exported span is still
    there (their times are at the run's wall-clock start), while a row stamped with plain
    virtual time is dropped at insert, as was seen before the offset."""
    import pyarrow as pa

    target = clickhouse_target(ch_stores.collected)
    with client.connect(target) as con:
        kept = con.ch_frame("SELECT count() AS n FROM otel_traces WHERE SpanName != 'kvtrace.run'")["n"][0]
        con.insert_arrow("otel_traces", pa.table({"Timestamp": pa.array([5_000_000_000], pa.timestamp("ns")),
                                                  "SpanName": ["probe"]}))
        con.command("OPTIMIZE TABLE otel_traces FINAL")  # TTL applied now, not at the next merge
        probes = con.ch_frame("SELECT count() AS n FROM otel_traces WHERE SpanName = 'probe'")["n"][0]
    assert kept == read.run(ch_stores.duck, ch_stores.run_on)["num_spans"]
    assert probes == 0


def test_export_writes_the_same_parquet_from_both(ch_stores, tmp_path):
    a = export_parquet(ch_stores.duck, ch_stores.run_on, tmp_path / "duck")
    b = export_parquet(ch_stores.direct, ch_stores.run_on, tmp_path / "ch")
    for table in a:
        ta, tb = pq.read_table(a[table]), pq.read_table(b[table])
        # one schema whichever backend wrote it: JSON as strings (DuckDB's arrow.json), every
        # field nullable, an empty list or map NULL (ClickHouse's [] and {})
        assert ta.schema.equals(tb.schema) and ta.num_rows == tb.num_rows > 0, table
        if table != "runs":  # (the runs rows: two runs, each its own writer and creation time)
            pl.testing.assert_frame_equal(pl.from_arrow(ta), pl.from_arrow(tb))


# the reads whose finished-run answer comes from a derived table: on a running run,
# the same SQL runs on the fly
DERIVED_READS = {"span_counts", "evictions_over_time", "evictions_by_publish_kind", "eviction_attribution",
                 "eviction_attribution_flows", "block_histograms", "latency_cdf", "stale_hash_chain"}


def test_story_runs_finished_and_running_answer_alike(story_stores):
    (duck, ch), (_, off, running) = story_stores
    assert read.run(duck, running)["status"] == read.run(ch, running)["status"] == "running"
    assert read.stale_hashes(duck, off).height > 0
    assert read.eviction_attribution(duck, off).height > 0
    assert assert_same_reads(duck, ch, off) >= READ_COUNT_AT_LEAST
    assert assert_same_reads(duck, ch, running, only=DERIVED_READS) >= len(DERIVED_READS)
