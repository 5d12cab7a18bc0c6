"""The comparison commands' own settings and their checks (standard library only: the CLI
checks them before it imports the comparison's numpy, polars and replay engine, so a
mistake is told at once): the diff's bounds, and where the demo may write its store."""

from __future__ import annotations

import numbers
import os

from kvtrace.errors import MAX_SEED, ConfigError, KVTraceError, check_option
from kvtrace.names import shown_value
from kvtrace.store.backend import duckdb_path_problem

DEFAULT_RESAMPLES = 1_000
# a 95% interval's ends are the 2.5% and 97.5% quantiles of the replicates: from one or two
# (--resamples 1) the CI was one value, beside the point estimate, and marked significant
MIN_RESAMPLES = 100
MAX_RESAMPLES = 10_000  # the replicate draws are resamples x requests int64s in memory
MAX_TOP = 2**31


def check_diff_options(seed: int, top: int, resamples: int) -> None:
    """ConfigError naming the option (``--seed``, ``--top``, ``--resamples``) out of range."""
    for option, value, lo, hi in (("--seed", seed, 0, MAX_SEED), ("--top", top, 0, MAX_TOP),
                                  ("--resamples", resamples, MIN_RESAMPLES, MAX_RESAMPLES)):
        # (an API caller's 2.5 or numpy float reached numpy's SeedSequence or range(), a
        # TypeError; an int past 4,300 digits was check_option's str() ValueError)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(option, shown_value(value), "expected a whole number")
        check_option(option, int(value), lo, hi)  # (a numpy int as the int it is)


def check_diff_runs(run_a: object, run_b: object, force: object) -> None:
    """ConfigError for an API caller's run id that is no string (a list's unhashable TypeError)
    or ``force`` that is no bool (``force="no"`` forced the diff)."""
    for run in (run_a, run_b):
        if not isinstance(run, str):
            raise ConfigError("RUN", shown_value(run), "expected a run id, a string")
    if not isinstance(force, bool):
        raise ConfigError("--force", shown_value(force), "expected True or False")


def demo_target(db: str) -> tuple[str, bool]:
    """The file the demo's store is to replace, and whether one is there: ``db``, or what a
    symbolic link ``db`` points to (written through, so the link stays a link). Raises
    KVTraceError for what can never be the demo's store: a directory, a device, a FIFO, a
    socket, a missing folder. (What an existing file holds is the demo's own check.)"""
    target = db
    if os.path.islink(db):
        target = os.path.realpath(db)
        if not os.path.isdir(os.path.dirname(target)):
            raise KVTraceError(f"{db}: is a symbolic link to {target}, whose folder does not exist; "
                               "choose another --db")
    problem = duckdb_path_problem(target, missing=None)  # (md:NAME too: DuckDB would read it as a service)
    if problem is not None and os.path.isfile(target):  # (a file there that is no store)
        raise KVTraceError(f"{db}: exists and is not a kvtrace demo store ({problem}); choose another --db")
    if problem is not None:  # (what it says is expected names chdb:DIR and clickhouse:// too, as the demo takes)
        suffix = "; expected a kvtrace store file"
        raise KVTraceError(f"{db}: {problem.removesuffix(suffix)}; expected a DuckDB file path for the demo store"
                           if problem.endswith(suffix) else f"{db}: {problem}")
    if not os.path.exists(target):
        folder = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(folder):
            raise KVTraceError(f"{db}: folder {folder} does not exist; choose another --db")
        return target, False
    return target, True
