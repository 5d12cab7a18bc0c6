"""Read access to a ClickHouse kvtrace store, for ``kvtrace.store.read._sql.connect``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client
from kvtrace.store.clickhouse.tables import check_meta
from kvtrace.store.connection import DEFAULT_TIMEOUT_S
from kvtrace.store.errors import StoreError


@contextlib.contextmanager
def read_connection(db, timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[client.ClickHouseConnection]:
    """An open connection to a ClickHouse kvtrace store; StoreError for a missing chdb
    directory or a database without kvtrace's tables."""
    target = clickhouse_target(db)
    problem = target.directory_problem()
    if problem is not None:
        raise StoreError(target.label, problem)
    if target.path is not None and not os.path.isdir(target.path):
        raise StoreError(target.label, "no such chdb directory (run `kvtrace replay --db chdb:PATH` first)")
    if target.path is not None and not os.path.isdir(os.path.join(target.path, "metadata")):
        # refused unopened: chdb makes its folders in any directory it opens (a read left tmp/ behind)
        raise StoreError(target.label, "not a kvtrace store (a directory without chdb's metadata; "
                                       "`kvtrace replay --db chdb:PATH` creates one)")
    with client.connect(target, timeout_s) as con:
        if check_meta(con, target.label) is None:
            raise StoreError(target.label, "not a kvtrace store (no kvtrace_meta rows; "
                                           "`kvtrace replay --db URL` or `kvtrace collect --db URL` makes a store)")
        yield con
