"""An export killed with -9 in its renames, between setting an earlier file aside and renaming the
new one in, leaves the earlier export's file under its hidden ``.old`` name and none at its own
(re-probe hints33 of b00f292): the next export's clean-up deleted it as a dead export's leftover,
so that export failing (a full disk, a Ctrl-C while it writes) lost the earlier export's file for
good, where nothing already written may be lost. The clean-up now puts such a file back where
none stands, and removes it only where the killed export's new file took its place. And a file
of the user's that merely looks like kvtrace's hidden names (another hex length, another
table) is never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvtrace.store import Store, export_parquet
from tests.store.scenario import scenario_rows, scenario_table

ROOT = str(Path(__file__).resolve().parents[2])


def killed_export(db, run, out, k: int) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.store.export_kill32_driver", str(db), run, str(out), str(k)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def two_runs(scenario_db):
    db, first = scenario_db
    with Store.open(db) as store:
        second = store.create_run("other")
        store.append_spans(scenario_table(scenario_rows()[:3]), run_id=second)
        store.finish_run(second)
    return db, first, second


def test_the_next_export_after_a_kill_is_whole_and_leaves_nothing_hidden(scenario_db, tmp_path):
    db, first, second = two_runs(scenario_db)
    out = tmp_path / "out"
    export_parquet(db, first, out)
    killed_export(db, second, out, 2)
    written = export_parquet(db, second, out)
    assert sorted(os.listdir(out)) == ["evicted_blocks.parquet", "runs.parquet", "spans.parquet"]
    assert pq.read_table(written["runs"]).column("run_id").to_pylist() == [second]


@pytest.mark.parametrize("name", [".spans.999999-abc.parquet.tmp", ".runs.999999-abcdef0123456.parquet.tmp.old",
                                  ".spans.999999-abc.parquet.tmp.older", ".spans.999999-ABC.parquet.tmp",
                                  ".spanz.999999-abcdef012345.parquet.tmp", "spans.999999-abcdef012345.parquet.tmp",
                                  ".spans.999999-abcdef012345.parquet.tmp~"])
def test_a_users_file_that_only_looks_like_a_hidden_one_stays(scenario_db, tmp_path, name):
    db, first = scenario_db
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_bytes(b"mine")
    export_parquet(db, first, out)
    assert (out / name).read_bytes() == b"mine"


def test_a_folder_or_link_named_like_a_dead_exports_file_stays(scenario_db, tmp_path):
    db, first = scenario_db
    out = tmp_path / "out"
    out.mkdir()
    folder = out / ".spans.999999-abcdef012345.parquet.tmp.old"
    folder.mkdir()
    (folder / "mine").write_bytes(b"mine")
    mine = tmp_path / "mine.txt"
    mine.write_bytes(b"mine")
    link = out / ".runs.999999-abcdef012345.parquet.tmp"
    link.symlink_to(mine)
    export_parquet(db, first, out)
    assert (folder / "mine").read_bytes() == b"mine" and link.is_symlink() and mine.read_bytes() == b"mine"
