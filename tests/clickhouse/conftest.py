"""ClickHouse stores for the backend tests, each filled by a REAL replay (chdb, embedded).

``ch_stores``: the "pinning on" replay of the session's ``replayed_store``
(tests/conftest.py, the DuckDB copy), written
- directly into a chdb store (``kvtrace replay --db chdb:DIR`` does the same), and
  exported over real OTLP/HTTP (the SDK's exporter) to a local capture server;
- through the collector path: the captured payloads, decoded by kvtrace's decoder into
  the rows the OpenTelemetry Collector's ClickHouse exporter writes
  (tests/support/collector_rows.py), inserted into a second chdb store's ``otel_traces``
  created by the exporter's DDL with its default 180-day TTL.

chdb opens one directory per process at a time; kvtrace opens per use, so the stores
are used one after another.

``chdb_store``: an empty chdb store for a case, in one directory per module whose session
stays open through the module (see ``_held_chdb``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.conftest import REPLAYED_LIMIT, REPLAYED_TRACE

TTL_DAYS = 180


@dataclass(frozen=True)
class ClickHouseStores:
    duck: str  # the DuckDB store of the same replays (replayed_store)
    direct: str  # chdb: written by the replay
    collected: str  # chdb: filled from the collector's otel_traces
    run_on: str
    payloads: int  # OTLP requests captured
    run_collected: str  # run_on as its OTLP export named it (each export its own run id)


class _Capture(BaseHTTPRequestHandler):
    bodies: list[bytes]

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


def otlp_capture():
    """A local OTLP/HTTP endpoint keeping every request body: (server, url, bodies)."""
    bodies: list[bytes] = []
    handler = type("Capture", (_Capture,), {"bodies": bodies})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1/traces", bodies


_LAYOUT = ("SELECT name, engine, create_table_query FROM system.tables WHERE database = currentDatabase() "
           "ORDER BY name")


@pytest.fixture(scope="module")
def _held_chdb(tmp_path_factory) -> Iterator[tuple[str, tuple[list, list]]]:
    """One chdb directory for a module's cases, its session held open until the module ends,
    and its layout as a new store has it.

    chdb 4.4 leaves a closed session's MergeTree threads behind (five a session, with about a
    dozen open /proc files once they have run queries), however its directory was opened:
    a new store for each of a module's cases ran a test worker past 1,024 descriptors, where
    ``select`` refuses one. A store emptied between cases opens no new session."""
    from kvtrace.store import Store
    from kvtrace.store.backend import clickhouse_target
    from kvtrace.store.clickhouse import client

    db = f"chdb:{tmp_path_factory.mktemp('held') / 'ch'}"
    Store.open(db).close()
    with client.connect(clickhouse_target(db)) as con:
        yield db, new_store_state(con)


def new_store_state(con) -> tuple[list, list]:
    """What ``empty_chdb_store`` makes a store again: a new store's layout and meta rows."""
    from kvtrace.store.schema import META_TABLE

    return con.ch_frame(_LAYOUT).rows(), con.ch_frame(f"SELECT key, value FROM {META_TABLE} ORDER BY key").rows()


@pytest.fixture
def chdb_store(_held_chdb) -> str:
    """An empty chdb store (``chdb:DIR``), as a new one is made (``empty_chdb_store``)."""
    empty_chdb_store(*_held_chdb)
    return _held_chdb[0]


def empty_chdb_store(db: str, made: tuple[list, list]) -> None:
    """Make the chdb store ``db`` (its session held) as a new one is, ``made`` its new layout
    and meta rows (``new_store_state``).

    Where the layout is as made, its tables are emptied and its meta rows written back (a
    second a case less than making the 35 tables and views again); where a case changed it,
    every table and view is dropped and the store made again."""
    import pyarrow as pa

    from kvtrace.store import Store
    from kvtrace.store.backend import clickhouse_target
    from kvtrace.store.clickhouse import client
    from kvtrace.store.schema import META_TABLE

    layout, meta = made

    with client.connect(clickhouse_target(db)) as con:
        tables = con.ch_frame("SELECT name, engine LIKE '%View' OR engine = 'Null' FROM system.tables "
                              "WHERE database = currentDatabase() ORDER BY engine LIKE '%View' DESC").rows()
        if con.ch_frame(_LAYOUT).rows() == layout:
            for name, _ in (t for t in tables if not t[1]):  # (a view, or otel_checked, keeps no row)
                con.command(f"TRUNCATE TABLE `{name}` SYNC")
            con.insert_arrow(META_TABLE, pa.table({"key": [k for k, _ in meta], "value": [v for _, v in meta]}))
        else:
            for name, _ in tables:
                con.command(f"DROP TABLE IF EXISTS `{name}` SYNC")
            assert con.ch_frame("SELECT count() FROM system.tables WHERE database = currentDatabase()").rows() == [(0,)]
    Store.open(db).close()


@pytest.fixture(scope="session")
def ch_stores(tmp_path_factory, replayed_store) -> ClickHouseStores:
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import Store
    from kvtrace.store.backend import clickhouse_target
    from kvtrace.store.clickhouse import client, collector
    from tests.support.collector_rows import collector_rows

    root = tmp_path_factory.mktemp("clickhouse")
    direct, collected = f"chdb:{root / 'direct'}", f"chdb:{root / 'collected'}"
    server, url, bodies = otlp_capture()
    try:
        on = run_replay(RunSpec(REPLAYED_TRACE, limit=REPLAYED_LIMIT, name="pinning on"), db=direct,
                        otlp_endpoint=url)
    finally:
        server.shutdown()
        server.server_close()
    assert on.summary["digest"] == replayed_store.summary_on["digest"]  # the offset changes no digest
    # The collector came first: its table, with the exporter's default TTL.
    target = clickhouse_target(collected)
    (root / "collected").mkdir()
    with client.connect(target) as con:
        con.command(collector.otel_traces_ddl("otel_traces").replace(
            "SETTINGS", f"TTL toDateTime(Timestamp) + toIntervalDay({TTL_DAYS})\nSETTINGS"))
    Store.open(collected).close()  # kvtrace attaches: its tables, the views from otel_traces
    with client.connect(target) as con:
        con.insert_arrow("otel_traces", collector_rows(bodies))
    Store.open(collected).close()  # registers the collected run; its record finishes it
    return ClickHouseStores(replayed_store.path, direct, collected, on.run_id, len(bodies), on.otlp_run_id)


@pytest.fixture(scope="session")
def story_stores(tmp_path_factory) -> tuple[tuple[str, str], list[str]]:
    """The synthetic hybrid-cache story (stale hashes, divergent outputs, attributed
    misses), behaviour on and off, in a DuckDB and a chdb store, plus one run left
    running (its derived tables are computed on the fly): ((duck, chdb), run ids)."""
    from kvtrace.store import Store
    from tests.support.synthetic_spans import simulate, write_runs, write_steps

    root = tmp_path_factory.mktemp("story")
    stores = (str(root / "story.duckdb"), f"chdb:{root / 'story'}")
    for db in stores:
        runs = list(write_runs(db, n_requests=40))
        with Store.open(db) as store:
            running = store.create_run("still running", created="2026-11-29T00:00:00+00:00")
            write_steps(store, running, simulate(False, 40, 160, 7)[0], 7)
            store.flush()
            store._open_runs.discard(running)  # left running: this process is its live writer
    return stores, [*runs, running]
