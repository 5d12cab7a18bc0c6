"""Parquet export of one run: spans, the run row, and derived tables."""

from __future__ import annotations

from pathlib import Path

from kvtrace.store.backend import is_clickhouse
from kvtrace.store.connection import fetch_one, read_connection
from kvtrace.store.errors import StoreError, UnknownRunError

EXPORTED_TABLES = ("spans", "runs", "evicted_blocks")
_ORDER = {"spans": "ORDER BY seq", "evicted_blocks": "ORDER BY evict_seq"}


def export_parquet(db: str | Path, run_id: str, directory: str | Path) -> dict[str, Path]:
    """Write ``<dir>/{spans,runs,evicted_blocks}.parquet`` for ``run_id`` (zstd).

    Spans have the ``spans`` view's columns (run_id, seq, every typed column, ids as
    hex), so ``read_parquet`` gives back exactly what ``spans`` shows for the run, in
    ``seq`` order.
    Returns table name -> file written.
    """
    out_dir = Path(directory)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StoreError(str(out_dir), f"cannot create export directory: {err.strerror}") from None
    written: dict[str, Path] = {}
    if is_clickhouse(db):
        return _export_clickhouse(db, run_id, out_dir)
    with read_connection(db) as con:
        if fetch_one(con, "SELECT 1 FROM runs WHERE run_id = ?", [run_id]) is None:
            raise UnknownRunError(str(db), run_id)
        for table in EXPORTED_TABLES:
            order = _ORDER.get(table, "")
            target = out_dir / f"{table}.parquet"
            rel = con.sql(f"SELECT * FROM {table} WHERE run_id = $run_id {order}", params={"run_id": run_id})
            rel.to_parquet(str(target), compression="zstd")
            written[table] = target
    return written


def _export_clickhouse(db: str | Path, run_id: str, out_dir: Path) -> dict[str, Path]:
    """The same files from a ClickHouse store (its lists are never NULL: ``[]`` there)."""
    import pyarrow.parquet as pq

    from kvtrace.store.clickhouse.reader import read_connection as clickhouse_read

    written: dict[str, Path] = {}
    with clickhouse_read(db) as con:
        if con.query_arrow("SELECT 1 AS x FROM runs WHERE run_id = $run_id", {"run_id": run_id}).num_rows == 0:
            raise UnknownRunError(str(db), run_id)
        for table in EXPORTED_TABLES:
            order = _ORDER.get(table, "")
            target = out_dir / f"{table}.parquet"
            pq.write_table(con.query_arrow(f"SELECT * FROM {table} WHERE run_id = $run_id {order}",
                                           {"run_id": run_id}), target, compression="zstd")
            written[table] = target
    return written
