"""nums33: the read API's percentile lists, as a caller may pass them."""

from __future__ import annotations

import pytest

from kvtrace.store import read
from kvtrace.store.read._api import BadArgument


@pytest.mark.parametrize("value", ["50,90", b"50", "5"])
def test_a_percentile_list_given_as_text_is_named_whole(tmp_path, value):
    """The CLI's --percentiles is text ("50,90"); the read API takes numbers. Text was read
    character by character and refused as "got '5'", a value the caller never gave."""
    db = str(tmp_path / "none.duckdb")  # (the arguments are checked first: no store needed)
    for call in (lambda: read.latency_stats(db, "r1", "ttft", value),
                 lambda: read.latency_percentiles(db, "r1", "ttft", value),
                 lambda: read.itl_over_time(db, "r1", qs=value)):
        with pytest.raises(BadArgument, match=r"expected a list of percentiles, got ") as err:
            call()
        assert repr(value) in str(err.value) and "\n" not in str(err.value)
