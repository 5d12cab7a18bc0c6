"""kvtrace.store: the embedded DuckDB span store (schema, writer, read API, Parquet export).

Imports only duckdb, polars, pyarrow and the stdlib (plus kvtrace.errors): the schema is data.

Schema (``schema.py``)
    One span = one row. ``SPAN_COLUMN_DEFS`` lists every column with its Arrow type, DuckDB
    type and OTel attribute key: OTel envelope (ids as integers: trace_id_hi/trace_id_lo,
    span_id, parent_span_id UBIGINT; every view shows them as OTel's hex), name, start_ns/end_ns,
    status, resource/extra attribute maps, events, links) and typed ``kvtrace.*`` columns
    (step, group_id, request_id, block_ids BIGINT[], block_hashes VARCHAR[] hex,
    publish_kind, evict_reason, copy_reason, ages/idle, lookup counts and hashes, step
    counters and usage, request latency fields, verification fields, live-vLLM fields).
    Producers build Arrow tables in ``SPAN_ARROW_SCHEMA`` (any subset of columns);
    ``ATTRIBUTE_COLUMNS`` maps OTel attribute keys to columns (OTLP receiver). The writer
    adds ``run_id``, ``seq`` (per-run append order: the tie-break for spans sharing a step's
    virtual time) and ``num_blocks``.
    Physical layout: one table per span family (``spans_cache``: publish/evict/cow/free/
    stale_left, ``spans_lookup``, ``spans_step``, ``spans_request``, ``spans_verify``) with
    the shared columns plus the family's own, and ``spans_other`` (every column) for other
    names or rows setting a column their family lacks. DuckDB's append cost grows with the
    column count, so this roughly halves insert time and each query scans one family.
    Views: ``spans`` (``SPAN_VIEW_COLUMNS``: all columns, all families, ids as hex),
    ``cache_spans``/``lookup_spans``/... (one family, incl. its rows in spans_other) and
    ``otel_traces``: the OpenTelemetry
    Collector ClickHouse exporter's columns (Timestamp, TraceId, ..., SpanAttributes map
    built from the typed columns plus extra_attributes, Duration ns, Events.*, Links.*),
    then RunId. ``runs``: run_id, name, created, trace_source, trace_digest, config JSON,
    behaviours JSON, mode, digest, status (running|complete|failed|incomplete), summary JSON,
    writer pid/host/start token, time_offset_ns (``RUN_COLUMNS``; 0 in a DuckDB store).
    Versions: ``SCHEMA_VERSION`` in ``kvtrace_meta``; an older store is read where it holds
    what a read needs and never appended to, a newer one refused. Columns and tables added
    within a version (``layout.ADDED_COLUMNS``/``ADDED_TABLES``) are added by the next writer
    to open the store, in the transaction that checks it, and read as that gives them before.
    ``derived_version`` in ``kvtrace_meta``: the definitions the derived rows were built by
    (``derived.DERIVED_VERSION``), set when the store is made; an older store's are read from its spans.
    Live vLLM KV events reuse the cache span names with ``source = 'vllm'`` (BlockStored ->
    publish 'vllm_stored', BlockRemoved -> evict 'vllm_removed', AllBlocksCleared -> evict
    'reset').

Derived tables (``derived.py``), built per run by ``finish_run`` (and by crash recovery):
    evicted_blocks (each evicted block + the publish that next took its block id),
    miss_attribution (each lookup miss on a previously cached hash -> its eviction -> that
    publish), span_stats, latency_cdf (percentiles 0..100 of TTFT/TPOT/ITL/E2EL/queue, by kvtrace.numeric),
    block_values (lifetime/idle/reuse-gap value counts), stale_chain (the seqs of the spans
    naming each stale hash), evict_counts (evicted blocks per time, reason, next publish
    kind); ``derived.TABLES`` lists them. Readers use them for finished runs and run the
    same SQL on the fly for running ones (stale_chain: a search of the block lists), so
    answers agree.

Concurrency (``connection.py``)
    DuckDB allows one read-write process or many read-only ones. The writer (``Store``)
    buffers Arrow tables in memory and holds the file only while it commits a flush (open,
    one transaction of bulk Arrow inserts, close); readers open read-only per query. Both
    retry a lock conflict with backoff (default timeout 30 s). A writer kept waiting
    touches ``<db>.writer-waiting``; readers hold back (up to 2 s) while it is fresh, so a
    polling dashboard cannot starve a replay. A replay's store (``Store.open(p, hold=True)``)
    keeps its connection between its once-a-second flushes and lets go after the next
    commit once another process waits: a reader kept waiting touches ``<db>.reader-waiting``,
    a writer the marker above. Writers take turns under a POSIX lock on ``<db>.write-lock``
    held from each open to its close (DuckDB 2.0.1 now and then lost a commit when processes
    took turns writing one file). ``finish_run`` computes derived tables on a read-only
    connection and writes them in one short transaction. Every open attaches the file to
    a DuckDB instance kept for reuse (``instances.py``: a new instance's built-in catalog
    was most of an open's cost) and detaches it at close, which lets the file go as a
    connection's close did.

Crash safety
    Each flush is a committed DuckDB transaction: it survives kill -9 (WAL replay on the
    next open); spans still buffered in memory are lost. Readers report a ``running`` run
    whose writer process is gone as ``incomplete``; ``Store.open`` persists that (and builds
    its derived tables). ``with Store.open(p) as s:`` flushes and marks its unfinished
    runs ``failed`` on an exception, Ctrl-C included; ``close()`` marks them ``incomplete``.

Backends (``backend.py``): ``--db`` is a DuckDB file, ``chdb:DIR`` (embedded ClickHouse)
    or ``clickhouse://user:pass@host:8123/db``. ClickHouse stores (``clickhouse/``) have
    the same tables and views, DDL derived from ``schema.py``, span times stored shifted
    by the run's ``time_offset_ns`` (views subtract it), and materialised views from the
    OpenTelemetry Collector's ``otel_traces``; the shared DuckDB-spelled SQL is rewritten
    for them by ``dialect.py``.

Read API (``read/``): ``f(db_path, run_id, ...) -> polars.DataFrame``, values bound as
parameters; ``read/__init__.py`` lists the functions, ``read/_sql.py`` runs every query.
Errors: ``StoreError`` (a ``KVTraceError``) naming the file for a missing, corrupt, foreign
or busy database, or a damaged one (``layout.py``: a table, view or column not as declared,
checked when the store is opened; a run record's JSON fields and writer pid checked where
they are decoded); ``UnknownRunError`` for a bad run id.
"""

from typing import TYPE_CHECKING

from kvtrace.lazy import lazy_exports

# The public names and their modules, loaded on first use: a caller that needs only the
# schema (data) or the errors does not pay for DuckDB and Polars.
_EXPORTS = {
    "read": None, "StoreBusyError": "errors", "StoreError": "errors", "UnknownRunError": "errors",
    "export_parquet": "export", "ATTRIBUTE_COLUMNS": "schema", "SPAN_ARROW_SCHEMA": "schema",
    "SPAN_COLUMN_DEFS": "schema", "SPAN_COLUMNS": "schema", "SPAN_NAMES": "schema", "SPAN_VIEW_COLUMNS": "schema",
    "Store": "writer",
}
__all__ = [
    "ATTRIBUTE_COLUMNS", "SPAN_ARROW_SCHEMA", "SPAN_COLUMNS", "SPAN_COLUMN_DEFS", "SPAN_NAMES", "SPAN_VIEW_COLUMNS",
    "Store", "StoreBusyError", "StoreError", "UnknownRunError", "export_parquet", "read",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from kvtrace.store import read
    from kvtrace.store.errors import StoreBusyError, StoreError, UnknownRunError
    from kvtrace.store.export import export_parquet
    from kvtrace.store.schema import (
        ATTRIBUTE_COLUMNS,
        SPAN_ARROW_SCHEMA,
        SPAN_COLUMN_DEFS,
        SPAN_COLUMNS,
        SPAN_NAMES,
        SPAN_VIEW_COLUMNS,
    )
    from kvtrace.store.writer import Store
