"""``--retention`` (and ``retention=`` of --param/--sweep, ``retention_interval`` of a config file)
bounded as every other token count is (reprobe33's report)."""

from __future__ import annotations

import pytest

from kvtrace.errors import ConfigError
from kvtrace.replay.config_file import parse_retention
from kvtrace.workload.lines import MAX_TOKENS


@pytest.mark.parametrize("value", ["604462909807314587353088", str(MAX_TOKENS + 1), "9" * 60, MAX_TOKENS + 1,
                                   1 << 80])
def test_a_token_count_past_what_any_count_holds_is_refused_as_one(value):
    """604462909807314587353088 was taken and replayed; 60 digits were refused as no token count."""
    key = None if isinstance(value, str) else "retention_interval"
    with pytest.raises(ConfigError, match=f"at most {MAX_TOKENS:,} tokens"):
        parse_retention(value, key=key)


def test_the_largest_count_and_the_words_stand():
    assert parse_retention(str(MAX_TOKENS)) == MAX_TOKENS
    assert parse_retention("none") is None and parse_retention("0") == 0
    with pytest.raises(ConfigError, match=r"expected none, 0 or a token count K$"):
        parse_retention("-5")
