"""A commit the store refuses is told on the collector's stderr, once per reason: each such
request was answered 503 (which an exporter retries for ever) and counted among the requests
rejected, and nothing said the store could not be written (a full disk: re-probe 31)."""

from __future__ import annotations

import logging

import duckdb

from kvtrace.instrument.otlp.collector import OTLPCollector
from tests.instrument.test_receiver import _json_body, _post


def test_a_refused_commit_is_told_once_per_reason(tmp_path, caplog) -> None:
    c = OTLPCollector(tmp_path / "rx.duckdb", port=0).start()
    try:
        c.store.lock_timeout_s = 0.2
        holder = duckdb.connect(str(tmp_path / "rx.duckdb"))  # a writer elsewhere holds the file
        try:
            with caplog.at_level(logging.WARNING, logger="kvtrace.instrument.otlp.collector"):
                statuses = [_post(c.url, _json_body(3))[0] for _ in range(3)]
        finally:
            holder.close()
    finally:
        c.stop()
    assert statuses == [503] * 3
    told = [r.getMessage() for r in caplog.records if "were not stored" in r.getMessage()]
    assert len(told) == 1 and "answered 503" in told[0] and "rx.duckdb" in told[0], told
