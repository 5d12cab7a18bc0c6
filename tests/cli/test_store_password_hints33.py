"""A ClickHouse server URL's password is never shown on a status line, in ``runs``' title or
``--json``, or in ``study --json`` (re-probe hints33): error lines hid it, but ``kvtrace: run
r1 recorded in clickhouse://u:PASSWORD@...``, ``collect``'s and ``curve``'s status lines, and
``runs in clickhouse://u:PASSWORD@...`` printed it as given."""

from __future__ import annotations

from kvtrace.cli import output

URL = "clickhouse://alice:s3cr%40t@db.example:8123/kv"


def test_a_recorded_runs_line_and_any_status_line_hide_the_password(capsys):
    output.recorded("r1", URL)
    output.status(f"kvtrace collect: OTLP/HTTP on http://127.0.0.1:4318 -> {URL} (Ctrl-C to stop)")
    err = capsys.readouterr().err
    assert "s3cr" not in err and "kvtrace: run r1 recorded in clickhouse://alice@db.example:8123/kv" in err


def test_a_store_is_shown_as_given_but_a_server_urls_password():
    assert output.store_shown(URL) == "clickhouse://alice@db.example:8123/kv"
    for db in ("a b.duckdb", "chdb:/tmp/x y", "-x.duckdb", "a\nb.duckdb"):
        assert output.store_shown(db) == db


def test_study_json_names_the_store_without_its_password():
    from kvtrace.compare.study import run_study

    result = run_study("shared-prefix-pinning", seed=0, limit=4)
    result.db = URL  # (a study recorded into that server: its JSON names it)
    out = result.to_json()
    assert out["db"] == "clickhouse://alice@db.example:8123/kv"
    result.db = "chdb:/tmp/x y"
    assert result.to_json()["db"] == "chdb:/tmp/x y"
