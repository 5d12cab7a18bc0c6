"""kvtrace.store: the embedded DuckDB span store (schema, writer, read API, Parquet export).

Imports only duckdb, polars, pyarrow and the stdlib (plus kvtrace.errors): the schema is data.

Schema (``schema.py``)
    ``spans``: one row per span. OTel envelope columns (trace_id/span_id hex, name,
    start_ns/end_ns, status, resource/extra attribute maps, events, links) plus typed
    ``kvtrace.*`` columns (step, group_id, request_id, block_ids BIGINT[], block_hashes
    VARCHAR[] hex, publish_kind, evict_reason, ages/idle, lookup counts, request latency
    fields, verification fields, live-vLLM fields) and ``run_id``/``seq`` filled by the
    writer. ``SPAN_COLUMN_DEFS`` lists each column with its Arrow type, DuckDB type and
    OTel attribute key; ``SPAN_ARROW_SCHEMA`` is what producers build;
    ``ATTRIBUTE_COLUMNS`` maps attribute keys back to columns (OTLP receiver).
    ``otel_traces``: a VIEW with the OpenTelemetry Collector ClickHouse exporter's columns
    (Timestamp, TraceId, ..., SpanAttributes map assembled from the typed columns plus
    ``extra_attributes``, Duration ns, Events.*, Links.*) and a trailing RunId.
    ``runs``: run_id, name, created, trace_source, trace_digest, config JSON, behaviours
    JSON, mode, digest, status (running|complete|failed|incomplete), summary JSON, writer
    pid/host/start token. ``evicted_blocks``: per-run derived table (one row per evicted
    block with the publish that next took its block id), built by ``finish_run``.
    Live vLLM KV events reuse the cache span names with ``source = 'vllm'``
    (BlockStored -> publish 'vllm_stored', BlockRemoved -> evict 'vllm_removed',
    AllBlocksCleared -> evict 'reset').

Concurrency (``connection.py``)
    DuckDB allows one read-write process or many read-only ones. The writer (``Store``)
    buffers Arrow tables in memory and holds the file only while it commits a flush (open,
    one transaction of bulk Arrow inserts, close); readers open read-only for one query.
    Each side retries a lock conflict with backoff up to a timeout (default 30 s), so the
    dashboard reads a store while a replay writes, seeing every committed flush.

Crash safety
    Each flush is a committed DuckDB transaction: it survives kill -9 (the WAL is replayed
    on the next open). ``Store.open`` marks runs left ``running`` by a dead writer
    ``incomplete`` (and builds their derived tables); readers already report them as
    ``incomplete``. ``with Store.open(p) as s:`` marks its unfinished runs ``failed`` on
    an exception (Ctrl-C included) after flushing what it holds.

Read API (``read.py``): functions ``f(db_path, run_id, ...) -> polars.DataFrame``.
"""

from kvtrace.store.errors import StoreBusyError, StoreError, UnknownRunError  # noqa: F401
from kvtrace.store.export import export_parquet  # noqa: F401
from kvtrace.store.schema import (  # noqa: F401
    ATTRIBUTE_COLUMNS,
    SPAN_ARROW_SCHEMA,
    SPAN_COLUMN_DEFS,
    SPAN_COLUMNS,
    SPAN_NAMES,
)
from kvtrace.store.writer import Store  # noqa: F401
from kvtrace.store import read  # noqa: F401,E402
