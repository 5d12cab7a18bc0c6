"""Writer: bulk Arrow round trip, run lifecycle, family routing, argument checks."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest

from kvtrace.errors import KVTraceError
from kvtrace.store import SPAN_ARROW_SCHEMA, Store, read
from tests.store.scenario import as_viewed, scenario_rows, scenario_table


def _spans(path, where="TRUE"):
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.sql(f"SELECT * FROM spans WHERE {where} ORDER BY run_id, seq").to_arrow_table()
    finally:
        con.close()


def test_bulk_round_trip_keeps_every_value(tmp_path):
    path = tmp_path / "rt.duckdb"
    store = Store.open(path)
    run_id = store.create_run("rt")
    table = scenario_table()
    assert store.append_spans(table, run_id=run_id) == table.num_rows
    store.finish_run(run_id)
    back = _spans(path)
    assert back.column("seq").to_pylist() == list(range(table.num_rows))
    assert set(back.column("run_id").to_pylist()) == {run_id}
    expected = as_viewed(table)
    assert back.column("span_id")[0].as_py() == "8000000000000000"  # the top bit survives
    for name in expected.column_names:
        assert back.column(name).to_pylist() == expected.column(name).to_pylist(), name


def test_appends_across_batches_and_flushes_keep_order(tmp_path):
    path = tmp_path / "order.duckdb"
    store = Store.open(path, flush_rows=4)  # several automatic flushes
    run_id = store.create_run("o")
    rows = scenario_rows()
    for i in range(0, len(rows), 3):
        store.append_spans(scenario_table(rows[i:i + 3]), run_id=run_id)
    store.finish_run(run_id)
    back = _spans(path)
    assert back.column("name").to_pylist() == [r["name"] for r in rows]
    assert back.column("seq").to_pylist() == list(range(len(rows)))


def test_narrow_types_are_cast_and_run_id_column_accepted(tmp_path):
    path = tmp_path / "cast.duckdb"
    store = Store.open(path)
    run_id = store.create_run("c")
    store.append_spans(pa.table({
        "run_id": [run_id, run_id],
        "name": ["kvtrace.engine.step"] * 2,
        "step": pa.array([1, 2], pa.int32()),
        "start_ns": pa.array([10, 20], pa.int32()),
        "usage": pa.array([[0.5], [0.75]], pa.list_(pa.float32())),
    }))
    store.finish_run(run_id)
    back = _spans(path)
    assert back.column("step").to_pylist() == [1, 2]
    assert back.column("usage").to_pylist() == [[0.5], [0.75]]


def test_append_argument_errors(tmp_path):
    store = Store.open(tmp_path / "e.duckdb")
    run_id = store.create_run("e")
    with pytest.raises(ValueError, match="not in SPAN_ARROW_SCHEMA"):
        store.append_spans(pa.table({"name": ["x"], "colour": ["red"]}), run_id=run_id)
    with pytest.raises(ValueError, match=r"\['trace_id'\] \(ids are uint64: trace_id_hi, trace_id_lo"):
        store.append_spans(pa.table({"name": ["x"], "trace_id": ["0" * 32]}), run_id=run_id)
    with pytest.raises(ValueError, match="one run per call"):
        store.append_spans(pa.table({"run_id": ["a", "b"], "name": ["x", "y"]}))
    with pytest.raises(ValueError, match="pass run_id"):
        store.append_spans(pa.table({"name": ["x"]}))
    with pytest.raises(KVTraceError, match="no run with id 'ghost'"):
        store.append_spans(pa.table({"name": ["x"]}), run_id="ghost")


def test_unknown_names_and_stray_columns_go_to_spans_other(tmp_path):
    path = tmp_path / "other.duckdb"
    store = Store.open(path)
    run_id = store.create_run("o")
    store.append_spans(pa.table({
        "name": ["http.request", "kvtrace.request", "kvtrace.request"],
        "start_ns": [1, 2, 3],
        "request_id": ["x", "a", "b"],
        # a request span carrying block ids (no column for it in spans_request)
        "block_ids": pa.array([None, None, [7]], pa.list_(pa.int64())),
    }), run_id=run_id)
    store.finish_run(run_id)
    con = duckdb.connect(str(path), read_only=True)
    other = con.execute("SELECT name, request_id, block_ids FROM spans_other ORDER BY seq").fetchall()
    assert other == [("http.request", "x", None), ("kvtrace.request", "b", [7])]
    assert con.execute("SELECT request_id FROM spans_request").fetchall() == [("a",)]
    con.close()
    # nothing lost: the spans view and the request family view see all of them
    assert _spans(path).column("name").to_pylist() == ["http.request", "kvtrace.request", "kvtrace.request"]
    assert read.requests(path, run_id)["request_id"].to_list() == ["a", "b"]


def test_run_lifecycle_and_ids(tmp_path):
    path = tmp_path / "life.duckdb"
    store = Store.open(path)
    first, second = store.create_run("a"), store.create_run("b", created="2030-01-01T00:00:00Z")
    assert (first, second) == ("r1", "r2")
    with pytest.raises(KVTraceError, match="already exists"):
        store.create_run("c", run_id="r1")
    assert read.run(path, first)["status"] == "running"
    store.finish_run(first, status="failed", summary={"error": "boom"})
    with pytest.raises(ValueError):
        store.finish_run(second, status="running")
    store.close()  # second was never finished
    statuses = dict(read.runs(path).select("run_id", "status").iter_rows())
    assert statuses == {"r1": "failed", "r2": "incomplete"}
    assert Store.open(path).create_run("d") == "r3"


def test_context_manager_marks_failed_and_keeps_spans(tmp_path):
    path = tmp_path / "cm.duckdb"
    with pytest.raises(RuntimeError), Store.open(path, flush_rows=1 << 20, flush_interval_s=1e9) as store:
        run_id = store.create_run("cm")
        store.append_spans(scenario_table(), run_id=run_id)  # still buffered
        raise RuntimeError("mid-run failure")
    info = read.run(path, run_id)
    assert info["status"] == "failed"
    assert "mid-run failure" in info["summary"]["error"]
    assert info["num_spans"] == len(scenario_rows())


@pytest.mark.parametrize("backend", ["duckdb", "chdb"])
def test_an_interrupt_while_a_run_is_created_or_finished_marks_it_failed(tmp_path, monkeypatch, backend):
    """Ctrl-C or SIGTERM landing just after a run's row was committed, or while its finish
    was being written, left it "running" and unmarked (incomplete at the next open, with the
    error lost), where the README says the run being stored is marked failed."""
    import contextlib

    path = str(tmp_path / "int.duckdb") if backend == "duckdb" else f"chdb:{tmp_path / 'ch'}"
    with Store.open(path) as probe:
        kind = type(probe)
    real_connect = kind._connect

    @contextlib.contextmanager
    def interrupted_after_commit(self):
        with real_connect(self) as con:
            yield con
        raise KeyboardInterrupt  # (the row is committed)

    with pytest.raises(KeyboardInterrupt), Store.open(path) as store:
        monkeypatch.setattr(kind, "_connect", interrupted_after_commit)
        try:
            store.create_run("created")
        finally:
            monkeypatch.setattr(kind, "_connect", real_connect)
    assert read.run(path, "r1")["status"] == "failed"

    def interrupted_finish(self, *args, **kwargs):
        monkeypatch.undo()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), Store.open(path) as store:
        run_id = store.create_run("finishing")
        monkeypatch.setattr(kind, "_finish", interrupted_finish)
        store.finish_run(run_id, digest="d")
    info = read.run(path, run_id)
    assert info["status"] == "failed" and "KeyboardInterrupt" in info["summary"]["error"]


def test_arrow_schema_is_what_producers_build():
    assert SPAN_ARROW_SCHEMA.field("block_ids").type == pa.list_(pa.int64())
    assert SPAN_ARROW_SCHEMA.field("block_hashes").type == pa.list_(pa.string())
    assert SPAN_ARROW_SCHEMA.field("start_ns").type == pa.int64()


def test_one_flush_of_interleaved_runs_and_column_sets_keeps_every_row(tmp_path):
    # A flush joins the buffered pieces of one family and run into one INSERT: pieces with
    # different column sets and runs interleaved in the buffer must store the same rows.
    path = tmp_path / "interleaved.duckdb"
    store = Store.open(path, flush_rows=1 << 20, flush_interval_s=1e9)
    runs = [store.create_run("a"), store.create_run("b")]
    rows = scenario_rows()
    sent = {r: [] for r in runs}
    for i in range(0, len(rows), 2):
        run_id = runs[(i // 2) % 2]
        chunk = scenario_table(rows[i:i + 2])
        chunk = chunk.select([c for c in chunk.column_names if chunk.column(c).null_count < chunk.num_rows])
        store.append_spans(chunk, run_id=run_id, flush_when_due=False)
        sent[run_id].extend(rows[i:i + 2])
    assert store.flush() == len(rows)
    for run_id in runs:
        back = _spans(path, f"run_id = '{run_id}'")
        assert back.column("seq").to_pylist() == list(range(len(sent[run_id])))
        expected = as_viewed(scenario_table(sent[run_id]))
        for name in expected.column_names:
            assert back.column(name).to_pylist() == expected.column(name).to_pylist(), name


def test_held_store_commits_to_the_wal_and_compresses_once(tmp_path):
    """A held store's commits stay in the WAL past DuckDB's 16 MB default (each checkpoint
    would compress the open row groups again); letting go checkpoints, and nothing is lost."""
    path = tmp_path / "held.duckdb"
    wal = tmp_path / "held.duckdb.wal"
    store = Store.open(path, hold=True)
    run_id = store.create_run("h")
    n = 20_000  # cache spans with long ids: about 4 MB of WAL a flush
    big = pa.table({"name": ["kvtrace.cache.block_evict"] * n, "step": pa.array(range(n), pa.int64()),
                    "request_id": [f"{i:0>200}" for i in range(n)]})
    written = store.append_spans(big, run_id=run_id)
    store.flush()
    db_size = path.stat().st_size
    for _ in range(5):
        written += store.append_spans(big, run_id=run_id)
        store.flush()
    assert wal.stat().st_size > 20 * 2**20  # no checkpoint yet: every commit is in the WAL
    assert path.stat().st_size == db_size
    store.finish_run(run_id)
    store.close()
    assert not wal.exists() or wal.stat().st_size == 0  # checkpointed when let go
    assert _spans(path).column("seq").to_pylist() == list(range(written))


@pytest.mark.parametrize("backend", ["duckdb", "chdb"])
def test_the_next_run_id_follows_the_largest_numbered_one_of_any_size(tmp_path, backend):
    """Counted on digit strings: a sender's ``r9223372036854775807`` overflowed BIGINT's + 1
    (DuckDB), ``r²`` passed ``str.isdigit`` and failed ``int`` (ClickHouse)."""
    db = str(tmp_path / "s.duckdb") if backend == "duckdb" else f"chdb:{tmp_path / 'ch'}"
    store = Store.open(db)
    for named in ("r²", "r0099", "r9" + "9" * 30, "rx"):
        store.create_run("named", run_id=named)
    assert store.create_run("next") == "r1" + "0" * 31
    assert store.create_run("after") == "r1" + "0" * 30 + "1"


def test_a_flush_inserts_one_chunk_per_family_however_many_appends_it_holds(tmp_path):
    """DuckDB's Arrow scan pays about 2 ms a chunk: a flush of 2,000 one-span appends (an
    OTLP collector's small requests) took seconds as 2,000 chunks. Rows and order are kept."""
    store = Store.open(tmp_path / "chunks.duckdb", flush_rows=10**9, flush_interval_s=1e9)
    run_id = store.create_run("c")
    rows = scenario_rows()
    for i in range(len(rows)):
        store.append_spans(scenario_table(rows[i:i + 1]), run_id=run_id)
    inserted = []
    commit = store._commit

    def seen(inserts):
        inserted.extend(inserts)
        commit(inserts)

    store._commit = seen
    store.finish_run(run_id)
    assert inserted and all(t.column(0).num_chunks == 1 for _, _, t in inserted), \
        [(f, t.column(0).num_chunks) for f, _, t in inserted]
    assert any(t.num_rows > 1 for _, _, t in inserted)
    back = _spans(tmp_path / "chunks.duckdb")
    assert back.column("name").to_pylist() == [r["name"] for r in rows]
