"""Shared settings and checks of the fuzz suite (hypothesis).

``fuzz(n)`` is each test's budget: ``n`` examples, derandomized (every run tries the same
examples, seeded from the test's own source), no example database (nothing read from or
written to ``.hypothesis/``, so a run depends on the code alone) and no deadline (the
2-core CI box is noisy; the example count is the budget). ``KVTRACE_FUZZ=explore`` runs
a random search 30 times larger that keeps its failures in the database, for hunting
new bugs by hand; its finds become named regression tests.
"""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, settings

from kvtrace.errors import KVTraceError

EXPLORE = os.environ.get("KVTRACE_FUZZ") == "explore"
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]


def fuzz(examples: int) -> settings:
    """The settings of one fuzz test (not a global profile: other hypothesis tests keep theirs)."""
    if EXPLORE:
        return settings(max_examples=examples * 30, deadline=None, print_blob=True, suppress_health_check=_QUIET)
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=_QUIET)


def one_line_error(err: BaseException, *names: str) -> str:
    """``err``'s message, after checking the invariant: a KVTraceError (or its raise site's
    subclass), one line, naming each of ``names`` (a file, a line, a key)."""
    assert isinstance(err, KVTraceError), f"{type(err).__name__} escaped: {err!r}"
    text = str(err)
    assert "\n" not in text and "\r" not in text, f"multi-line message: {text!r}"
    assert text.strip(), "empty message"
    for name in names:
        assert name in text, f"{name!r} not named in {text!r}"
    return text


class Raw(str):
    """JSON text written as it is: tokens json.dumps cannot make (1e400, a 400-digit int)."""


def dump(v) -> str:
    """JSON of ``v`` with Raw tokens verbatim (NaN and Infinity as Python writes them)."""
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(dump(x) for x in v) + "]"
    return json.dumps(v)
