"""A recording killed with -9 after its first export (``kvtrace replay --db S --otlp-endpoint URL``
killed: no ``kvtrace.run`` record at its end) keeps its settings in its collected copy, on both
collector paths: its opening record, sent with its first export, carries the name, trace, config,
behaviours and created time its direct store holds. Its copy had spans and no settings, its views
the defaults (percentiles 50/90/99 where the replay asked 25/99.9)."""

from __future__ import annotations

import gzip
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store import Store, read
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from tests.support.collector_rows import collector_rows

pytest.importorskip("chdb")

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "instrument" / "opening_kill_start33_driver.py"
SETTINGS = ["name", "created", "trace_source", "config", "behaviours"]


class _Capture(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP endpoint that keeps each request's protobuf body and answers 200: what the
    OpenTelemetry Collector's ClickHouse exporter is handed."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        capture = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                capture.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def _killed_after_first_export(db: Path, endpoint: str, arrived) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(db), endpoint, "killed-run"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not arrived() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert arrived(), proc.stderr.read().decode() if proc.poll() is not None else "no export in 120 s"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def _settings(db: str, run_id: str) -> dict:
    row = read.run(db, run_id)
    out = {k: row[k] for k in SETTINGS}
    for k in ("config", "behaviours"):  # (read.run gives them decoded)
        out[k] = json.loads(out[k]) if isinstance(out[k], str) else out[k]
    return out


def _direct(db: Path) -> tuple[str, dict]:
    (run_id,) = read.runs(str(db))["run_id"].to_list()
    return run_id, _settings(str(db), run_id)


def test_collect_keeps_a_killed_recordings_settings(tmp_path):
    collected = tmp_path / "c.duckdb"
    collector = OTLPCollector(collected, port=0).start()
    try:
        _killed_after_first_export(tmp_path / "o.duckdb", collector.url, lambda: collector.spans_received > 0)
        assert collector.runs_recorded == 0
    finally:
        collector.stop()
    run_id, direct = _direct(tmp_path / "o.duckdb")
    row = read.run(str(collected), f"{run_id}-export")
    assert row["status"] == "incomplete" and row["digest"] is None and row["summary"] is None
    assert _settings(str(collected), f"{run_id}-export") == direct
    assert direct["config"]["percentiles"] == [25.0, 99.9] and direct["name"] == "killed-run"


def test_the_clickhouse_path_keeps_a_killed_recordings_settings(tmp_path, chdb_store):
    capture = _Capture()
    threading.Thread(target=capture.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{capture.server_address[1]}"
        # (past the opening record's request: a span batch exported too)
        _killed_after_first_export(tmp_path / "o.duckdb", url, lambda: len(capture.bodies) >= 2)
    finally:
        capture.shutdown()
        capture.server_close()
    Store.open(chdb_store).close()
    with client.connect(clickhouse_target(chdb_store)) as con:
        con.insert_arrow("otel_traces", collector_rows(capture.bodies))
    Store.open(chdb_store).close()
    run_id, direct = _direct(tmp_path / "o.duckdb")
    row = read.run(chdb_store, f"{run_id}-export")
    assert row["status"] == "running" and row["digest"] is None and row["summary"] is None
    assert _settings(chdb_store, f"{run_id}-export") == direct
