"""A DuckDB store cut short (a copy or a download that stopped, a file truncated by hand)
given to a writer: the open failed at a block past the end only after DuckDB had
checkpointed into the file (142,386 bytes of a half-cut store rewritten, its header page
too), and a store short of its last byte took new runs ("run r3 recorded", exit 0) that no
reader could list. Both are now one line naming the file, exit 2, the file as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtrace.store.backend import truncation_problem
from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace
from tests.conftest import MOONCAKE

REPLAY = ["replay", str(MOONCAKE), "--limit", "5", "--mode", "cache-only", "--capacity-blocks", "64"]


def _whole(tmp_path: Path, capsys) -> Path:
    db = tmp_path / "s.duckdb"
    for _ in range(2):
        code, _, err = kvtrace([*REPLAY, "--db", str(db)], capsys)
        assert code == 0, err
    return db


@pytest.mark.parametrize("cut", ["last byte", "half"])
def test_a_store_cut_short_is_refused_untouched(tmp_path, capsys, cut):
    db = _whole(tmp_path, capsys)
    assert truncation_problem(str(db)) is None  # (whole: as every other test's store)
    size = db.stat().st_size
    os.truncate(db, size - 1 if cut == "last byte" else size // 2 + 1)
    before = db.read_bytes()
    for argv in ([*REPLAY, "--db", str(db)], ["runs", "--db", str(db)]):
        code, _, err = kvtrace(argv, capsys)
        assert_one_line(code, err, str(db), "corrupt or truncated", f"where its header counts {size:,}")
    assert db.read_bytes() == before and not Path(f"{db}.wal").exists()


def test_a_store_short_by_whole_blocks_is_left_to_duckdb(tmp_path, capsys):
    """DuckDB cuts free blocks off the end before it writes the header that stops counting
    them: a kill between leaves a file shorter than its header says, but whole (never read
    past its end). Only a cut within a block is surely damage."""
    db = _whole(tmp_path, capsys)
    with open(db, "rb") as f:
        f.seek(4096 + 8 + 8 * 4)
        block = int.from_bytes(f.read(8), "little")  # (block_alloc_size, the first header's)
    assert block & (block - 1) == 0 and block >= 4096
    os.truncate(db, db.stat().st_size - block)
    assert truncation_problem(str(db)) is None
