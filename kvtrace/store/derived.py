"""Per-run derived tables, as SQL shared by finish_run (materialise) and readers (live runs).

``evicted_blocks``: one row per evicted block, with the publish that next took the same
block id (same group) before that block id was evicted again: "the publish that took its
place". ``miss_attribution``: for each lookup miss on a hash that was cached before, the
latest eviction of that hash (group 0) before the miss, joined to that eviction's row in
evicted_blocks. ``span_stats``: spans, blocks and the time extent per span name. ``latency_cdf``: the
percentiles 0, 0.1 ... 100 of TTFT, TPOT, ITL, E2EL and queue time, by kvtrace.numeric.
``block_values``: value counts of block lifetime, idle time before eviction and prefix
reuse gap. ``stale_chain``: the
seq of every span naming a hash the worker found stale. ``evict_counts``: evicted blocks
per (time, reason, next publish kind). Order within a run is virtual time (``start_ns``):
a step's cache spans are spread over its window in event order. ``seq`` is append order,
the events' order within one span kind only (a batch is stored family by family and kind
by kind), so it is compared within a kind, never across kinds.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import weakref

import duckdb
import numpy as np
import pyarrow as pa

from kvtrace.names import printable
from kvtrace.numeric import percentiles
from kvtrace.process import pid_after, remove_dead_leftovers
from kvtrace.store.errors import COMMITTED_STAYS, StoreError, write_failure_reason
from kvtrace.store.schema import (
    SPAN_EVICT,
    SPAN_LOOKUP,
    SPAN_PUBLISH,
    SPAN_REQUEST,
    SPAN_STALE_HASH,
    SPAN_STALE_LEFT,
)

# Per-request latency samples (ns) of $run_id, one SELECT per metric (kvtrace.metrics.
# LATENCIES, vllm bench serve's definitions), column ``v``.
_ARRIVAL = "coalesce(arrival_ns, start_ns)"
_TTFT = f"coalesce(ttft_ns, first_token_ns - {_ARRIVAL})"
_E2EL = f"end_ns - {_ARRIVAL}"
_REQ = f"FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'"
LATENCY_VALUES = {
    "ttft": f"SELECT {_TTFT} AS v {_REQ}",
    # (E2EL - TTFT) / (output tokens - 1), of the two samples above (the last token minus the
    # first for a kvtrace span; a sender's span that gives its TTFT and no first token time had
    # a TTFT and an E2EL and no TPOT, where vllm bench serve computes it from those two)
    "tpot": f"SELECT (({_E2EL}) - {_TTFT}) / (num_output_tokens - 1) AS v {_REQ} AND num_output_tokens > 1",
    "itl": f"SELECT unnest(itl_ns) AS v {_REQ}",
    "e2el": f"SELECT {_E2EL} AS v {_REQ}",
    "queue": f"SELECT first_scheduled_ns - {_ARRIVAL} AS v {_REQ}",
}
# The CDF every latency chart draws: percentiles 0, 0.1, ..., 100 of the samples, each
# computed by kvtrace.numeric (the one definition), not interpolated from anything coarser.
CDF_PERCENTILES = tuple(i / 10 for i in range(1001))


def latency_samples_sql(metric: str) -> str:
    """The SELECT of one latency's samples of $run_id: column ``v`` (DOUBLE, ns), sorted."""
    return f"SELECT CAST(v AS DOUBLE) AS v FROM ({LATENCY_VALUES[metric]}) WHERE v IS NOT NULL ORDER BY v"


# Every latency's samples of $run_id in one SELECT: column ``m``, the metric's place in
# LATENCY_VALUES, and ``v`` (DOUBLE, ns), sorted by both. A finish planned five queries
# over the request spans' view for them before (19 of its 140 ms on a small run).
ALL_LATENCY_SAMPLES_SQL = " UNION ALL ".join(
    f"SELECT {i} AS m, CAST(v AS DOUBLE) AS v FROM ({sql}) WHERE v IS NOT NULL"
    for i, sql in enumerate(LATENCY_VALUES.values())) + " ORDER BY m, v"


def samples_by_metric(rows: pa.Table) -> dict[str, np.ndarray]:
    """``ALL_LATENCY_SAMPLES_SQL``'s rows as each metric's sorted samples."""
    m, v = rows.column("m").to_numpy(), rows.column("v").to_numpy()
    ends = np.searchsorted(m, np.arange(len(LATENCY_VALUES) + 1), side="left")
    return {metric: v[ends[i]:ends[i + 1]] for i, metric in enumerate(LATENCY_VALUES)}


def latency_cdf_table(run_id: str, samples: dict[str, np.ndarray]) -> pa.Table:
    """The ``latency_cdf`` rows of one run from its samples per metric: (run_id, metric,
    q, value_ns, n) for every metric with samples, q in CDF_PERCENTILES (percent)."""
    cols: dict[str, list] = {"run_id": [], "metric": [], "q": [], "value_ns": [], "n": []}
    for metric in LATENCY_VALUES:
        values = samples.get(metric)
        if values is None or values.size == 0:
            continue
        k = len(CDF_PERCENTILES)
        cols["value_ns"] += percentiles(values, CDF_PERCENTILES)
        cols["q"] += CDF_PERCENTILES
        cols["run_id"] += [run_id] * k
        cols["metric"] += [metric] * k
        cols["n"] += [int(values.size)] * k
    return pa.table({"run_id": pa.array(cols["run_id"], pa.string()), "metric": pa.array(cols["metric"], pa.string()),
                     "q": pa.array(cols["q"], pa.float64()), "value_ns": pa.array(cols["value_ns"], pa.float64()),
                     "n": pa.array(cols["n"], pa.int64())})


# $run_id is the only parameter.
EVICTED_BLOCKS_SELECT = f"""
WITH ev AS (
    -- (times not Nullable: ClickHouse's ASOF JOIN on a Nullable column matched wrong rows)
    SELECT run_id, seq AS evict_seq, span_id AS evict_span_id, coalesce(start_ns, 0) AS evict_ns, step,
           coalesce(group_id, 0) AS group_id,
           unnest(block_ids) AS block_id, unnest(block_hashes) AS block_hash,
           evict_reason AS reason, unnest(ages) AS age, unnest(idle) AS idle,
           request_id AS evict_request_id
    FROM cache_spans WHERE run_id = $run_id AND name = '{SPAN_EVICT}'
),
-- the block's next eviction by a later span: one span may evict a block's two keys (a full
-- and a partial one), and both rows then share the publish that follows (lead() gave one of
-- them its own span, which backend's row depending on the sort). Across span kinds, order is
-- time, never seq: seq numbers a batch's spans kind by kind (all its evictions before all its
-- publishes), and a step's cache spans are spread over its window in event order.
ev_next AS (
    SELECT *, min(evict_ns) OVER (PARTITION BY group_id, block_id ORDER BY evict_ns
                                  RANGE BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS next_evict_ns
    FROM ev
),
pub AS (
    SELECT seq AS publish_seq, span_id, coalesce(start_ns, 0) AS publish_ns, coalesce(group_id, 0) AS group_id,
           unnest(block_ids) AS block_id, publish_kind, request_id
    FROM cache_spans WHERE run_id = $run_id AND name = '{SPAN_PUBLISH}'
)
SELECT run_id, evict_seq, evict_span_id, evict_ns, step, group_id, block_id, block_hash,
       reason, age, idle, evict_request_id,
       CASE WHEN ok THEN publish_seq END AS next_publish_seq,
       CASE WHEN ok THEN pub_span_id END AS next_publish_span_id,
       CASE WHEN ok THEN pub_ns END AS next_publish_ns,
       CASE WHEN ok THEN publish_kind END AS next_publish_kind,
       CASE WHEN ok THEN pub_request_id END AS next_publish_request_id
FROM (
    SELECT e.*, p.publish_seq, p.span_id AS pub_span_id, p.publish_ns AS pub_ns, p.publish_kind,
           p.request_id AS pub_request_id,
           p.publish_seq IS NOT NULL
             AND (e.next_evict_ns IS NULL OR p.publish_ns < e.next_evict_ns) AS ok
    FROM ev_next e
    ASOF LEFT JOIN pub p
      ON e.group_id = p.group_id AND e.block_id = p.block_id AND p.publish_ns > e.evict_ns
)
"""


# {evicted_blocks}: the relation holding the run's evicted_blocks rows.
MISS_ATTRIBUTION_TEMPLATE = f"""
WITH m AS (
    SELECT run_id, seq AS miss_seq, coalesce(start_ns, 0) AS miss_ns, request_id AS miss_request_id, root_hash,
           first_miss_hash AS missed_hash, first_miss_index AS missed_index
    FROM lookup_spans
    WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}' AND first_miss_hash IS NOT NULL
),
-- one span may evict two blocks of one hash (vLLM keeps duplicates): the ASOF match is then
-- the lower block id, on every backend (DuckDB and ClickHouse each picked its own)
-- (evict_at: the time not Nullable, as in ev: a ClickHouse derived table's column is)
eb AS (SELECT *, coalesce(evict_ns, 0) AS evict_at FROM {{evicted_blocks}} WHERE group_id = 0 AND block_hash IS NOT NULL
       QUALIFY row_number() OVER (PARTITION BY evict_seq, block_hash ORDER BY block_id) = 1)
SELECT m.*, eb.evict_seq, eb.evict_span_id, eb.evict_ns, eb.reason AS evict_reason, eb.block_id,
       eb.age, eb.idle, eb.evict_request_id, eb.next_publish_seq AS publish_seq,
       eb.next_publish_span_id AS publish_span_id, eb.next_publish_ns AS publish_ns,
       eb.next_publish_kind AS publish_kind, eb.next_publish_request_id AS publish_request_id
FROM m ASOF JOIN eb ON m.missed_hash = eb.block_hash AND m.miss_ns > eb.evict_at  -- (time: see ev_next)
"""

# {evicted_blocks}: as above. Values in scheduler steps; see read.block_histograms.
BLOCK_VALUES_TEMPLATE = f"""
WITH v AS (
    -- (-1: unknown, as vLLM's backend reports an entry it never saw used: no bin of its own)
    SELECT 'lifetime' AS metric, age AS x FROM {{evicted_blocks}} WHERE age >= 0
    UNION ALL
    SELECT 'idle_before_evict', idle FROM {{evicted_blocks}} WHERE idle >= 0
    UNION ALL
    -- one row a request and prefix, at its first lookup: a request waiting for room looks up
    -- again every step, which counted as reuse (51 of 79 gaps of one external-tier run)
    SELECT 'reuse_gap', gap FROM (
        SELECT step - lag(step) OVER (PARTITION BY root_hash ORDER BY seq) AS gap, hit
        -- (a hit of the external tier's is a reuse too: diff counts local + external cached tokens)
        FROM (SELECT root_hash, request_id, min(seq) AS seq, min(step) AS step,
                     max(coalesce(num_hit_tokens, 0) + coalesce(num_external_hit_tokens, 0)) > 0 AS hit
              FROM lookup_spans
              WHERE run_id = $run_id AND name = '{SPAN_LOOKUP}' AND root_hash IS NOT NULL
              GROUP BY root_hash, request_id) AS first_lookups
    ) WHERE hit AND gap IS NOT NULL
)
SELECT $run_id AS run_id, metric, x, count(*) AS n FROM v GROUP BY metric, x
"""

# For each hash the worker found stale: the seq of every cache/verify span naming it (the
# stale-hash drill-down reads these few rows instead of scanning every block list).
STALE_CHAIN_SELECT = f"""
WITH h AS (
    SELECT DISTINCT block_hashes[1] AS block_hash FROM verify_spans
    WHERE run_id = $run_id AND name = '{SPAN_STALE_HASH}' AND len(block_hashes) > 0
),
x AS (
    SELECT seq, unnest(block_hashes) AS block_hash FROM cache_spans
    WHERE run_id = $run_id AND name IN ('{SPAN_PUBLISH}', '{SPAN_EVICT}', '{SPAN_STALE_LEFT}')
    UNION ALL
    SELECT seq, unnest(block_hashes) AS block_hash FROM verify_spans WHERE run_id = $run_id
)
SELECT DISTINCT $run_id AS run_id, x.block_hash, x.seq FROM x SEMI JOIN h ON x.block_hash = h.block_hash
"""

# {evicted_blocks}: as above. Evicted blocks per (time, reason, kind of the next publish):
# spans of one step share a timestamp, so this is several times smaller than evicted_blocks.
EVICT_COUNTS_TEMPLATE = """
SELECT $run_id AS run_id, evict_ns, reason, next_publish_kind AS publish_kind, count(*) AS blocks
FROM {evicted_blocks} GROUP BY ALL
"""

SPAN_STATS_SELECT = """
SELECT run_id, name, count(*) AS spans, CAST(sum(num_blocks) AS BIGINT) AS blocks,
       min(start_ns) AS start_ns, max(end_ns) AS end_ns
FROM spans WHERE run_id = $run_id GROUP BY run_id, name
"""

# Every derived table's columns (name -> DuckDB type), in the order finish_run builds them:
# the table names (``TABLES``), the DDL the writer runs (``DDL``) and the layout a store is
# checked against (``kvtrace.store.layout``) all come from here.
COLUMNS: dict[str, dict[str, str]] = {
    "evicted_blocks": {
        "run_id": "VARCHAR", "evict_seq": "BIGINT", "evict_span_id": "VARCHAR", "evict_ns": "BIGINT",
        "step": "BIGINT", "group_id": "INTEGER", "block_id": "BIGINT", "block_hash": "VARCHAR", "reason": "VARCHAR",
        "age": "BIGINT", "idle": "BIGINT", "evict_request_id": "VARCHAR", "next_publish_seq": "BIGINT",
        "next_publish_span_id": "VARCHAR", "next_publish_ns": "BIGINT", "next_publish_kind": "VARCHAR",
        "next_publish_request_id": "VARCHAR",
    },
    "miss_attribution": {
        "run_id": "VARCHAR", "miss_seq": "BIGINT", "miss_ns": "BIGINT", "miss_request_id": "VARCHAR",
        "root_hash": "VARCHAR", "missed_hash": "VARCHAR", "missed_index": "BIGINT", "evict_seq": "BIGINT",
        "evict_span_id": "VARCHAR", "evict_ns": "BIGINT", "evict_reason": "VARCHAR", "block_id": "BIGINT",
        "age": "BIGINT", "idle": "BIGINT", "evict_request_id": "VARCHAR", "publish_seq": "BIGINT",
        "publish_span_id": "VARCHAR", "publish_ns": "BIGINT", "publish_kind": "VARCHAR",
        "publish_request_id": "VARCHAR",
    },
    # start_ns, end_ns: the time extent (the default window without a scan)
    "span_stats": {"run_id": "VARCHAR", "name": "VARCHAR", "spans": "BIGINT", "blocks": "BIGINT",
                   "start_ns": "BIGINT", "end_ns": "BIGINT"},
    "latency_cdf": {"run_id": "VARCHAR", "metric": "VARCHAR", "q": "DOUBLE", "value_ns": "DOUBLE", "n": "BIGINT"},
    "block_values": {"run_id": "VARCHAR", "metric": "VARCHAR", "x": "BIGINT", "n": "BIGINT"},
    "stale_chain": {"run_id": "VARCHAR", "block_hash": "VARCHAR", "seq": "BIGINT"},
    "evict_counts": {"run_id": "VARCHAR", "evict_ns": "BIGINT", "reason": "VARCHAR", "publish_kind": "VARCHAR",
                     "blocks": "BIGINT"},
}
# The definitions a store's derived rows were built by: ``kvtrace_meta.derived_version`` (a
# store without that row: 1), set when the store is made. Bump it when the same spans give other
# rows; readers compute an older store's rows from its spans, as a running run's (read._sql.derived_status).
# 2 (2026-12-05, 6efd6bc): evictions paired with the next publish, and misses with their
#   eviction, by virtual time, not seq (a batch's seq runs kind by kind).
DERIVED_VERSION = 2
DERIVED_VERSION_KEY = "derived_version"


def built_version(meta: dict) -> int:
    """The derived version a store's ``kvtrace_meta`` rows (key -> value) declare: 1 without
    the row, and 1 for a value that is no version (rows then read as an old store's are:
    computed from the spans, never trusted)."""
    raw = meta.get(DERIVED_VERSION_KEY)
    return int(raw) if isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) < 10 else 1


# span_stats columns a store written before them lacks (the writer adds them when it opens one)
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {"span_stats": ("start_ns", "end_ns")}
TABLES = tuple(COLUMNS)
DDL = tuple(
    f"CREATE TABLE IF NOT EXISTS {table} (\n    "
    + ",\n    ".join(f"{c} {t}" for c, t in cols.items()) + "\n)"
    for table, cols in COLUMNS.items()
)


def live_sql(table: str) -> str:
    """The SELECT that computes ``table``'s rows of $run_id from the spans, for running runs.
    Every derived table but stale_chain (an index the stale-hash chain does without on a
    running run) and latency_cdf (computed in Python: ``latency_cdf_table``); KeyError for
    them and for unknown names."""
    if table == "evicted_blocks":
        return EVICTED_BLOCKS_SELECT
    if table == "miss_attribution":
        return MISS_ATTRIBUTION_TEMPLATE.format(evicted_blocks=f"({EVICTED_BLOCKS_SELECT})")
    if table == "span_stats":
        return SPAN_STATS_SELECT
    if table == "block_values":
        return BLOCK_VALUES_TEMPLATE.format(evicted_blocks=f"({EVICTED_BLOCKS_SELECT})")
    if table == "evict_counts":
        return EVICT_COUNTS_TEMPLATE.format(evicted_blocks=f"({EVICTED_BLOCKS_SELECT})")
    raise KeyError(table)


# A finish's rows go from its read-only connection to its write one as Parquet files in a
# scratch folder beside the store (+ the computing process's pid + "-" + mkdtemp's letters;
# one a kill left is removed by the next finish there), never through Python: a 160,000-request
# cache-only run's 3.4M evicted blocks were 2.8 GB of Arrow and DuckDB's in-memory sort.
SCRATCH_PREFIX = ".kvtrace-derived-"
# What DuckDB may hold while it computes a run's derived rows; past it, its sorts and joins spill
# to its temporary directory (``<store>.tmp``, DuckDB's own). 1 GB kept that run's finish at
# about the CPU it took in memory (512 MB: 1.3x, 256 MB: 1.9x).
FINISH_MEMORY_LIMIT = "1GB"


def _computed(eb: str) -> tuple[tuple[str, str], ...]:
    """The derived tables computed in SQL, each with the order its rows are written in, in the
    order they are computed (``eb``: the relation of the run's evicted_blocks, computed first)."""
    return (
        ("evicted_blocks", f"{EVICTED_BLOCKS_SELECT} ORDER BY evict_seq"),
        ("miss_attribution", f"{MISS_ATTRIBUTION_TEMPLATE.format(evicted_blocks=eb)} ORDER BY miss_seq"),
        ("block_values", BLOCK_VALUES_TEMPLATE.format(evicted_blocks=eb)),
        ("evict_counts", f"{EVICT_COUNTS_TEMPLATE.format(evicted_blocks=eb)} ORDER BY evict_ns"),
        ("span_stats", SPAN_STATS_SELECT),
        ("stale_chain", f"{STALE_CHAIN_SELECT} ORDER BY block_hash, seq"),
    )


class DerivedRows(dict):
    """One run's derived rows from ``compute``: table name -> the path of a Parquet file of
    its rows (``latency_cdf``: an Arrow table). ``store`` inserts them and ``close``s it;
    the scratch folder is also removed when the object is collected (a finish that failed
    between the two)."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder
        self._remove = weakref.finalize(self, shutil.rmtree, folder, True)

    def close(self) -> None:
        """Remove the scratch folder (its files are read by then)."""
        self._remove()


def _literal(text: str) -> str:
    """``text`` as a SQL string literal (COPY ... TO takes no parameter for its file)."""
    return "'" + text.replace("'", "''") + "'"


def _scratch_folder(con) -> tuple[str, str]:
    """The database ``con`` reads (its path, or ``:memory:``) and a new scratch folder beside it
    (the system's temporary folder for one in memory), after removing those of finishes killed
    there. A folder that cannot be made is a StoreError naming where."""
    row = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchone()
    db = os.path.abspath(row[0]) if row and row[0] else ":memory:"
    parent = os.path.dirname(db) if row and row[0] else tempfile.gettempdir()
    remove_dead_leftovers(parent, lambda name: pid_after(SCRATCH_PREFIX, name, "-"),
                          lambda path: shutil.rmtree(path, ignore_errors=True))
    try:
        return db, tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=parent)
    except OSError as err:
        raise StoreError(db, f"cannot make the finish's scratch folder in {printable(parent)}: "
                             f"{err.strerror or err} {COMMITTED_STAYS}") from None


# DuckDB's words for a file it could not open (no inode left)
_CANNOT_OPEN_FILE = re.compile(r'(?:Cannot open|Could not write) file "[^"]*": (?P<reason>[^"]+)$')


def _scratch_failure(err: Exception, db: str, folder: str) -> StoreError | None:
    """A DuckDB error writing the scratch ``folder`` (a full disk or quota, a file size
    limit) as one line naming the store and the folder, its reason as the system says it
    (DuckDB's text wraps it in JSON); None for any other error (a damaged store, read)."""
    text = str(err).splitlines()[0] if str(err) else ""
    if os.path.basename(folder) not in text:
        return None
    opened = _CANNOT_OPEN_FILE.search(text) if '"errno":' not in text else None
    reason = opened["reason"] if opened is not None else write_failure_reason(text)
    return StoreError(db, f"cannot write the finish's scratch files in {printable(os.path.dirname(folder))}: "
                          f"{reason} {COMMITTED_STAYS}")


@contextlib.contextmanager
def _bounded_memory(con):
    """``FINISH_MEMORY_LIMIT`` on ``con`` for the block, DuckDB's default again after it
    (``materialise`` runs on a write connection that goes on)."""
    con.execute(f"SET memory_limit = '{FINISH_MEMORY_LIMIT}'")
    try:
        yield
    finally:
        con.execute("RESET memory_limit")


def compute(con, run_id: str) -> DerivedRows:
    """Every derived table's rows of one run (see ``DerivedRows``), computed and written
    inside DuckDB within ``FINISH_MEMORY_LIMIT``. Needs only read access, so ``finish_run``
    runs it on a read-only connection while dashboards keep reading."""
    params = {"run_id": run_id}
    db, folder = _scratch_folder(con)
    out = DerivedRows(folder)
    try:
        with _bounded_memory(con):
            eb = f"read_parquet({_literal(os.path.join(out.folder, 'evicted_blocks.parquet'))})"
            for name, sql in _computed(eb):
                path = out[name] = os.path.join(out.folder, f"{name}.parquet")
                try:
                    con.execute(f"COPY ({sql}) TO {_literal(path)} (FORMAT parquet)", params)
                except duckdb.Error as err:
                    failure = _scratch_failure(err, db, out.folder)
                    if failure is None:
                        raise
                    raise failure from None
            samples = samples_by_metric(con.sql(ALL_LATENCY_SAMPLES_SQL, params=params).to_arrow_table())
        out["latency_cdf"] = latency_cdf_table(run_id, samples)
    except BaseException:
        out.close()
        raise
    return out


def store(con, run_id: str, tables: dict) -> None:
    """Replace one run's derived rows with ``tables`` (inside the caller's transaction): a
    ``DerivedRows`` (closed after), or table name -> Arrow table."""
    try:
        for name in TABLES:
            con.execute(f"DELETE FROM {name} WHERE run_id = $run_id", {"run_id": run_id})
            rows = tables[name]
            if isinstance(rows, str):  # (a DerivedRows' file: DuckDB reads it, Python never does)
                con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM read_parquet({_literal(rows)})")
                continue
            view = f"kvtrace_derived_{name}"
            con.register(view, rows)
            try:
                con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM {view}")
            finally:
                con.unregister(view)
    finally:
        if isinstance(tables, DerivedRows):
            tables.close()


def materialise(con, run_id: str) -> None:
    """(Re)build the derived rows of one run on a read-write connection."""
    store(con, run_id, compute(con, run_id))
