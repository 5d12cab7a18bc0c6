"""reprobe33: an export killed with -9 in its renames, then a next export that fails (a full
disk): the clean-up put back the earlier file the killed export had set aside (30d180c), beside
the new files it had renamed in already: spans.parquet of one run, runs.parquet and
evicted_blocks.parquet of another, three files that looked whole. The killed export wrote every
new file before its first rename: its renames are finished instead, and the folder holds one run."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from kvtrace.errors import KVTraceError
from kvtrace.store import export, export_parquet
from tests.store.test_export_leftovers_hints33 import killed_export, two_runs


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_the_files_after_a_killed_export_and_a_failed_one_are_one_runs(scenario_db, tmp_path, monkeypatch, k):
    db, first, second = two_runs(scenario_db)
    out = tmp_path / "out"
    export_parquet(db, first, out)
    killed_export(db, second, out, k)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "_write_canonical", full_disk)
    with pytest.raises(KVTraceError, match="No space left on device"):
        export_parquet(db, first, out)
    assert sorted(os.listdir(out)) == ["evicted_blocks.parquet", "runs.parquet", "spans.parquet"]
    runs = {table: set(pq.read_table(out / f"{table}.parquet").column("run_id").to_pylist())
            for table in ("runs", "spans", "evicted_blocks")}
    assert runs["runs"] == runs["spans"] and len(runs["runs"]) == 1, runs
    assert runs["evicted_blocks"] <= runs["runs"], runs
