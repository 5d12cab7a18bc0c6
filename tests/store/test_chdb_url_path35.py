"""``--db chdb://`` and the like (probe 35): a URL's spelling after ``chdb:`` was taken as a
relative path, and a store made in a folder named ':' of the current directory, exit 0."""

from __future__ import annotations

import pytest

from kvtrace.errors import ConfigError
from kvtrace.store.backend import clickhouse_target


@pytest.mark.parametrize("db", ["chdb:://", "chdb::/x", "chdb:clickhouse://h:8123/db", "chdb:a://b"])
def test_a_url_after_chdb_is_refused(db):
    with pytest.raises(ConfigError, match="expected chdb:PATH, a directory's path"):
        clickhouse_target(db)


@pytest.mark.parametrize("db", ["chdb:///abs/dir", "chdb:rel/dir", "chdb:./:colon"])
def test_paths_are_taken(db, tmp_path):
    assert clickhouse_target(db).path.endswith(db.rsplit("/", 1)[-1])
