"""chdb's results are read as Arrow by kvtrace itself: chdb's own "ArrowTable" conversion
imports pandas (0.3 s of every command that reads a chdb store: `kvtrace runs` took 1.5 s,
1.0 s without it). Empty results and rows read as they did. (An insert still loads pandas:
chdb's ``Python()`` table function does, from C.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtrace.replay.run import RunSpec, run_replay

pytest.importorskip("chdb")
ROOT = Path(__file__).resolve().parents[2]


def test_a_chdb_store_is_read_without_pandas(tmp_path):
    db = f"chdb:{tmp_path / 's'}"
    run_replay(RunSpec("gen:chat", limit=4, mode="cache-only"), db=db)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from kvtrace.compare.source import diff_runs
        from kvtrace.store import read
        from kvtrace.store.backend import clickhouse_target
        from kvtrace.store.clickhouse import client
        assert read.runs({db!r})["status"].to_list() == ["complete"]
        assert diff_runs({db!r}, "r1", "r1").same_trace
        with client.connect(clickhouse_target({db!r})) as con:
            assert con.ch_frame("SELECT 1 AS a WHERE 0").height == 0
            assert con.ch_frame("SELECT number AS n FROM numbers(3)")["n"].to_list() == [0, 1, 2]
        print("pandas" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"
