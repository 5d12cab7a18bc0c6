"""reprobe33: a password a store URL gives in its query string (``?password=``, as ClickHouse's
JDBC and other clients take one) is never shown either: ``--db`` refused it as an unknown
option, its error line quoting the URL, the password in it, whole (9621bb6 hid a userinfo's)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("url", [
    "clickhouse://127.0.0.1:1/kv?password=S3CRET",
    "clickhouse://alice@127.0.0.1:1/kv?otel_table=t&Password=S3CRET",
    "clickhouses://127.0.0.1:1/kv?token=S3CRET#x",
])
def test_a_query_strings_password_is_not_in_the_error_line(url):
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "runs", "--db", url],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "S3CRET" not in proc.stderr and "=***" in proc.stderr, proc.stderr
    assert proc.stderr.startswith("kvtrace: error: --db: ") and "unknown option" in proc.stderr


def test_a_status_line_hides_it_too_and_leaves_the_rest(capsys):
    from kvtrace.cli import output

    output.status("kvtrace: run r1 recorded in clickhouse://h:8123/kv?otel_table=t&pwd=S3CRET: done")
    assert capsys.readouterr().err == "kvtrace: run r1 recorded in clickhouse://h:8123/kv?otel_table=t&pwd=***: done\n"
