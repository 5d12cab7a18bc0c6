"""The diff's own settings and their bounds (standard library only: the CLI checks them
before it imports the comparison's numpy and polars, so a mistake is told at once)."""

from __future__ import annotations

from kvtrace.errors import check_option, check_seed

DEFAULT_RESAMPLES = 1_000
MAX_RESAMPLES = 10_000  # the replicate draws are resamples x requests int64s in memory
MAX_TOP = 2**31


def check_diff_options(seed: int, top: int, resamples: int) -> None:
    """ConfigError naming the option (``--seed``, ``--top``, ``--resamples``) out of range."""
    check_seed(seed)
    check_option("--top", top, 0, MAX_TOP)
    check_option("--resamples", resamples, 1, MAX_RESAMPLES)
