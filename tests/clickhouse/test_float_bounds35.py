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


def test_a_number_beyond_its_columns_bounds(tmp_path, chdb_store):
    for i, (name, key, value, column, _) in enumerate(_OUT_OF_BOUNDS.values()):
        assert _collected(tmp_path, _doc([(name, {key: value})]), f"refused{i}")[1] == 400, (key, value)
        within = [0.5] if column == "usage" else 2.0
        assert _collected(tmp_path, _doc([(name, {key: within})]), f"ok{i}")[1] == 200, (key, within)
    # (one chdb store for every case: its set-up is most of the cost)
    ch = _exported(chdb_store, _doc([(name, {key: value}) for name, key, value, _, _ in _OUT_OF_BOUNDS.values()]))
    for _, key, _, column, table in _OUT_OF_BOUNDS.values():
        rows = _ch(ch, f"SELECT {column}, extra_attributes['{key}'] FROM {table}")
        sent = sum(k == key for _, k, _, _, _ in _OUT_OF_BOUNDS.values())  # (two steps give usage)
        assert len(rows) == sent and all(typed in (None, []) and extra for typed, extra in rows), (key, rows)
