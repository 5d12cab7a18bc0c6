"""A finish whose scratch files cannot be written is one line naming them (re-probe 30b).

39ff522 sends a finish's derived rows through Parquet files in a scratch folder beside the
store. A disk that fills while DuckDB writes one (or a file size limit) made DuckDB's async
writer's JSON the message: ``tiny/s.duckdb: cannot write: No space left on device","errno":"28"}``,
and a folder out of inodes said the store itself could not be written. The file size limit
(RLIMIT_FSIZE, a real one, in a child process) gives the same DuckDB error as a full tmpfs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import derived

CHILD = r"""
import resource, signal, sys
import duckdb
from kvtrace.errors import KVTraceError
from kvtrace.store import derived
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
con = duckdb.connect(sys.argv[1], read_only=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))
try:
    derived.compute(con, sys.argv[2])
except KVTraceError as err:
    print(type(err).__name__ + ": " + str(err))
    sys.exit(3)
print("computed")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_scratch_file_past_a_size_limit_is_one_line_naming_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "store dir"
    folder.mkdir()
    db = folder / "s.duckdb"
    result = run_replay(RunSpec("gen:mixed", limit=40, content=False, capacity_blocks=64), db=db)
    assert result.run_id is not None
    child = subprocess.run([sys.executable, "-c", CHILD, str(db), result.run_id],
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 3, (child.stdout, child.stderr)
    line = child.stdout.strip()
    assert "\n" not in line
    assert line == (f"StoreError: {db}: cannot write the finish's scratch files in {folder}: "
                    f"{os.strerror(27)} (what was committed before stays)")
    assert '"' not in line and "errno" not in line
    assert not [n for n in os.listdir(folder) if n.startswith(derived.SCRATCH_PREFIX)]
