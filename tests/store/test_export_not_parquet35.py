"""``kvtrace export`` into a folder where a file of the user's bears an export's name (probe
35): a text file named spans.parquet was replaced, exit 0. It is kept now, as calibrate keeps
a file that is no cost model; an earlier export's files are replaced as before."""

from __future__ import annotations

from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace
from tests.conftest import MOONCAKE

REPLAY = ["replay", str(MOONCAKE), "--limit", "3", "--mode", "cache-only", "--capacity-blocks", "64"]


def test_a_users_file_of_an_exports_name_is_kept(tmp_path, capsys):
    db = str(tmp_path / "s.duckdb")
    code, _, err = kvtrace([*REPLAY, "--db", db], capsys)
    assert code == 0, err
    out = tmp_path / "out"
    export = ["export", "--db", db, "--run", "r1", "--parquet", str(out)]
    code, _, err = kvtrace(export, capsys)
    assert code == 0, err
    code, _, err = kvtrace(export, capsys)  # (an earlier export's: replaced)
    assert code == 0, err
    notes = out / "spans.parquet"
    notes.write_text("my notes\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = kvtrace(export, capsys)
    assert_one_line(code, err, str(notes), "exists and is not a Parquet file", "not replaced")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
