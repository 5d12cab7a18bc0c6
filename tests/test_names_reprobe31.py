"""names.shown_value quotes any API caller's value in an error's one line (re-probe 31: a
repr that raises, an int past Python's 4,300-digit str limit, a repr holding a newline or a
terminal escape: the first two raised their own exception in place of the error line, the
third wrote the raw escape into it)."""

from __future__ import annotations

import pytest

from kvtrace.errors import ConfigError
from kvtrace.names import shown_value


class _NoRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class _EscapingRepr:
    def __repr__(self) -> str:
        return "\x1b[31mred\nline"


class _ReprOfAStrSubclass:
    class _Text(str):
        def __str__(self) -> str:
            raise RuntimeError("no str")

    def __repr__(self) -> str:
        return self._Text("quoted")


@pytest.mark.parametrize(("value", "shown"), [
    (_NoRepr(), "<_NoRepr whose repr raised>"),
    (10**5000, "<int of about 5,001 digits>"),
    (-(10**5000), "<int of about 5,001 digits>"),
    (_EscapingRepr(), "\\x1b[31mred\\nline"),
], ids=["raising-repr", "huge-int", "huge-negative-int", "escape-and-newline"])
def test_a_value_is_quoted_as_one_printable_line_whatever_its_repr(value, shown):
    assert shown_value(value) == shown
    line = str(ConfigError("--db", shown_value(value), "expected a store's path or URL, a string"))
    assert "\n" not in line and "\x1b" not in line


def test_a_repr_of_a_str_subclass_is_quoted_without_its_own_str():
    assert shown_value(_ReprOfAStrSubclass()) == "quoted"


def test_a_long_escaping_repr_is_still_cut_to_the_limit():
    shown = shown_value([_EscapingRepr()] * 1_000)
    assert len(shown) <= 80 and "\x1b" not in shown
