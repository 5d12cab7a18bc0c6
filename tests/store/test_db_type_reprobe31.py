"""backend.check_db_type refuses a path-like object whose str() is no path (re-probe 31:
every store reads str(db), so a caller's os.PathLike class made a DuckDB file named
'<Mine object at 0x...>' in the current directory, even where its __fspath__ raised or gave
bytes; a str subclass whose __str__ raised was that exception's traceback)."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest

from kvtrace.compare.demo import run_demo
from kvtrace.compare.source import diff_runs
from kvtrace.errors import ConfigError
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.replay.sweep import run_sweep
from kvtrace.store.backend import check_db_type

SPEC = RunSpec("gen:chat", limit=3, mode="cache-only")


class _Fspath(os.PathLike):
    def __init__(self, path):
        self.path = path

    def __fspath__(self):
        if isinstance(self.path, Exception):
            raise self.path
        return self.path


class _NoStr(str):
    def __str__(self):
        raise RuntimeError("no str")


HOSTILE = [_Fspath("mine.duckdb"), _Fspath(b"mine.duckdb"), _Fspath(RuntimeError("no path")), _Fspath(5),
           _NoStr("mine.duckdb")]
IDS = ["str-unlike-fspath", "bytes-fspath", "raising-fspath", "int-fspath", "raising-str"]


@pytest.mark.parametrize("db", HOSTILE, ids=IDS)
@pytest.mark.parametrize("call", [
    lambda db: run_replay(SPEC, db=db, export=False),
    lambda db: run_sweep(SPEC, [("seed", [1])], db=db, workers=1),
    run_demo,
    lambda db: diff_runs(db, "r1", "r2"),
], ids=["replay", "sweep", "demo", "diff"])
def test_a_path_like_whose_str_is_no_path_is_refused_and_names_no_file(tmp_path, monkeypatch, call, db):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^--db: .*expected a store's path or URL"):
        call(db)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("db", ["s.duckdb", Path("s.duckdb"), PurePosixPath("s.duckdb"), "chdb:/x",
                                "clickhouse://h:8123/db"], ids=repr)
def test_a_path_or_url_is_taken(db):
    check_db_type(db)
