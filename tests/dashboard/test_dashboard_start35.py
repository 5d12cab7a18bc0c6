"""``kvtrace dashboard``'s start (probe 35): a store whose layout is whole but whose run
statistics are damaged, which `kvtrace runs` refuses, was served (every page an error);
and Streamlit's own banner ("You can now view your Streamlit app in your browser", its URL,
"Stopping...") was printed beside kvtrace's address and `stopped` lines."""

from __future__ import annotations

import signal
import subprocess
import sys

import duckdb

from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace
from tests.conftest import MOONCAKE
from tests.dashboard.support import free_port, serving
from tests.support.processes import reaped, wait_until

REPLAY = ["replay", str(MOONCAKE), "--limit", "5", "--mode", "cache-only", "--capacity-blocks", "64"]


def _store(tmp_path, capsys) -> str:
    db = str(tmp_path / "s.duckdb")
    code, _, err = kvtrace([*REPLAY, "--db", db], capsys)
    assert code == 0, err
    return db


def test_a_store_runs_refuses_is_not_served(tmp_path, capsys):
    db = _store(tmp_path, capsys)
    con = duckdb.connect(db, read_only=True)
    block = con.execute("SELECT min(block_id) FROM pragma_storage_info('span_stats') WHERE block_id >= 0").fetchone()[0]
    size = con.execute("SELECT block_size FROM pragma_database_size()").fetchone()[0]
    con.close()
    with open(db, "r+b") as f:  # one bit of the run statistics' block, past its checksum
        f.seek(3 * 4096 + block * size + 64)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    code, _, err = kvtrace(["runs", "--db", db], capsys)
    runs_line = assert_one_line(code, err, db, "corrupt")
    done = subprocess.run([sys.executable, "-m", "kvtrace.cli", "dashboard", "--db", db, "--port", "0"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, check=False)
    assert_one_line(done.returncode, done.stderr, db, "corrupt")
    assert done.stderr.strip() == runs_line and not done.stdout


def test_streamlit_s_banner_is_not_printed(tmp_path, capsys):
    db = _store(tmp_path, capsys)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "dashboard", "--db", db, "--port", str(port)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with reaped(proc):
        wait_until(proc, lambda: serving(port), "the dashboard never served")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert not out.strip(), out
    assert [line for line in err.splitlines() if line.strip()] == [
        f"kvtrace dashboard: open http://127.0.0.1:{port}/", "kvtrace dashboard: stopped"], err
