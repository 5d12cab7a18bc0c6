"""A number column's bounds (``schema.Col`` min_value/max_value), probe 35: an ITL percentile
of -1 ns and a pool 150% used were stored with a 200, and read back as such. `kvtrace collect`
refuses the span now, naming the attribute; the ClickHouse path, whose exporter took it, keeps
the value as an extra attribute's text (as it keeps an integer out of its column's range), so
no reader takes it for a number."""

from __future__ import annotations

import pytest

from tests.clickhouse.test_ch_probe28 import REQUEST, _ch, _collected, _doc, _exported

pytest.importorskip("chdb")

STEP = "kvtrace.engine.step"

_OUT_OF_BOUNDS = {
    "a negative ITL percentile": (REQUEST, "kvtrace.request.itl_p50_ns", -1.0, "itl_p50_ns", "spans_request"),
    "a pool more than full": (STEP, "kvtrace.step.usage", [1.5, 0.2], "usage", "spans_step"),
    "a negative pool usage": (STEP, "kvtrace.step.usage", [-0.5], "usage", "spans_step"),
}


@pytest.mark.parametrize("case", sorted(_OUT_OF_BOUNDS))
def test_a_number_beyond_its_columns_bounds(tmp_path, chdb_store, case):
    name, key, value, column, table = _OUT_OF_BOUNDS[case]
    db, status = _collected(tmp_path, _doc([(name, {key: value})]))
    assert status == 400
    ok, status = _collected(tmp_path, _doc([(name, {key: [0.5] if column == "usage" else 2.0})]), "ok")
    assert status == 200
    ch = _exported(chdb_store, _doc([(name, {key: value})]))
    typed, extra = _ch(ch, f"SELECT {column}, extra_attributes['{key}'] FROM {table}")[0]
    assert typed in (None, []) and extra not in (None, ""), (typed, extra)
