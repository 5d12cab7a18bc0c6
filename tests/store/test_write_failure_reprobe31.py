"""store.errors.write_failure_reason reads DuckDB's errno where its JSON gives it, at the end
of the text, never in the file's path (re-probe 31: a store in a folder named q"errno":"2"
whose disk filled said 'cannot write: No such file or directory', the path's number read as
the system's reason)."""

from __future__ import annotations

import pytest

from kvtrace.store.errors import write_failure_reason

_PATH = '/data/q"errno":"2"/a.duckdb'


@pytest.mark.parametrize(("text", "reason"), [
    # a commit's text, as DuckDB 1.x writes it (no JSON): the path's "errno" is the user's
    (f'TransactionContext Error: Failed to commit: Could not write file "{_PATH}.wal": No space left on device',
     "No space left on device"),
    # the async writer's JSON (the path's quotes escaped in it), its errno at the end
    ('IO Error: {"exception_type":"IO","exception_message":"Could not write file \\"' + _PATH.replace('"', '\\"')
     + '.parquet\\": No space left on device","errno":"28"}', "No space left on device"),
    ('IO Error: {"exception_type":"IO","exception_message":"Could not write file \\"/a.parquet\\": '
     'File too large","errno":"27"}', "File too large"),
], ids=["commit-path-holds-errno", "json-path-holds-errno", "json-efbig"])
def test_the_reason_is_the_systems_not_a_number_in_the_path(text, reason):
    assert write_failure_reason(text) == reason


def test_an_errno_no_system_has_is_no_crash():
    assert "99999999999999999999" in write_failure_reason('x: y","errno":"99999999999999999999"}')
