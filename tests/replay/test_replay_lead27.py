"""The re-probe of the trace readers' and curve's fixes of the twenty-seventh session."""

from __future__ import annotations

import pytest

from kvtrace.errors import TraceFormatError
from kvtrace.replay.readers import open_trace

_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


@pytest.mark.parametrize(("row", "field"), [
    ("2023-11-16 18:15:46.68,374,44\x00", 3),   # (GeneratedTokens: said field 1)
    ("2023-11-16 18:15:46.68,3\x0074,44", 2),   # (ContextTokens: said field 1)
    ("2023-11-16 18:15:46.68\x00,374,44", 1),
])
def test_a_nul_in_an_azure_row_is_named_at_its_own_field(tmp_path, row, field):
    path = tmp_path / "n.csv"
    path.write_text(f"{_HEADER}\n{row}\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=rf"n\.csv:2: a NUL byte .* in field {field}:"):
        list(open_trace(str(path)))


def test_a_nul_in_an_azure_column_kvtrace_does_not_read_is_refused_too(tmp_path):
    """docs/trace-format.md: a NUL byte is refused naming its line; in an extra column it was read as text."""
    path = tmp_path / "n.csv"
    path.write_text(f"{_HEADER},Note\n2023-11-16 18:15:46.68,374,44,a\x00\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=r"n\.csv:2: a NUL byte .* in field 4:"):
        list(open_trace(str(path)))
