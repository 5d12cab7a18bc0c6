"""A recording command loads only what recording needs: no pandas (pyarrow would import it
to check each array for a pandas object, 0.3 s) and no polars (0.2 s; the read API's).

Each case runs in a fresh interpreter and reports what ended up in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], check=False, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_replay_into_a_store_imports_neither_pandas_nor_polars(tmp_path):
    db = tmp_path / "runs.duckdb"
    proc = _run(f"""
        import atexit, json, sys
        atexit.register(lambda: print(json.dumps({{m: m in sys.modules for m in ("pandas", "polars", "pyarrow")}}),
                                      file=sys.stderr))
        sys.argv = ["kvtrace", "replay", {str(MOONCAKE)!r}, "--limit", "30", "--db", {str(db)!r}, "--json"]
        from kvtrace.cli import main
        main()
    """)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    assert loaded == {"pandas": False, "polars": False, "pyarrow": True}
    summary = json.loads(proc.stdout)
    from kvtrace.store import read

    runs = read.runs(db)
    assert runs.height == 1 and runs["status"][0] == "complete"
    assert summary["spans"] > 0 and read.span_counts(db, summary["run_id"]).height > 0


def test_pandas_hidden_from_pyarrow_only():
    """After the probe pyarrow converts without pandas, while pandas imports and pyarrow's
    own pandas conversions work as before once it is imported."""
    proc = _run("""
        import sys
        import numpy as np, pyarrow as pa
        from kvtrace.process import pyarrow_without_pandas
        pyarrow_without_pandas()
        pa.array(np.arange(3)); pa.scalar(1); pa.array(["a", None])
        assert "pandas" not in sys.modules, "pyarrow imported pandas"
        import pandas
        frame = pa.table({"a": [1, 2]}).to_pandas()
        assert isinstance(frame, pandas.DataFrame) and frame["a"].tolist() == [1, 2]
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
