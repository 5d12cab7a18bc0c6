"""The declarative span-kind table against the store schema and the event Structs."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvtrace.engine.backends import BACKENDS, DEFAULT_BACKEND
from kvtrace.instrument.span_kinds import (
    ALL_KINDS,
    CACHE_KINDS,
    STEP_EVENT,
    STEP_FILLS,
    STEP_INFERRED,
    TIMED_KINDS,
    Fill,
    Inferred,
)
from kvtrace.store.schema import SPAN_COLUMN_DEFS, SPAN_NAMES
from tests.instrument.helpers import one_of_each_step

COLUMN_TYPES = {c.name: c.arrow for c in SPAN_COLUMN_DEFS}


def _sample_events() -> dict[type, object]:
    """One real event of every kind (the helpers' hand-built step)."""
    batch = one_of_each_step()
    return {type(e): e for e in (*batch.cache_events, *batch.engine_events, batch.step)}


def _fills():
    for kind in ALL_KINDS:
        for f in kind.fills:
            yield kind.event, f
    for f in STEP_FILLS:
        yield STEP_EVENT, f


@pytest.mark.parametrize("event, fill", list(_fills()), ids=lambda x: x.__name__ if isinstance(x, type) else x.column)
def test_every_fill_names_a_column_and_fields_of_its_event(event, fill):
    assert fill.column in COLUMN_TYPES, fill
    assert fill.arrow == COLUMN_TYPES[fill.column]
    assert set(fill.fields) <= set(event.__struct_fields__), (fill, event.__struct_fields__)


@pytest.mark.parametrize("event, fill", list(_fills()), ids=lambda x: x.__name__ if isinstance(x, type) else x.column)
def test_every_encoder_produces_its_columns_arrow_type(event, fill):
    sample = _sample_events()[event]
    got = fill.column_of([sample, sample])
    assert isinstance(got, pa.Array) and len(got) == 2
    assert got.type == COLUMN_TYPES[fill.column], fill


def test_kinds_are_distinct_and_cover_every_event_kind_once():
    assert len({k.event for k in ALL_KINDS}) == len(ALL_KINDS)
    assert {k.name for k in ALL_KINDS} <= set(SPAN_NAMES)
    assert set(_sample_events()) == {k.event for k in ALL_KINDS} | {STEP_EVENT}
    for kind in ALL_KINDS:
        columns = [f.column for f in kind.fills]
        assert len(columns) == len(set(columns)), kind.name  # one fill per column
        if kind.link_request:
            assert "request_id" in kind.event.__struct_fields__
        for field in kind.time_fields or ():
            assert field in kind.event.__struct_fields__
    assert all(k.time_fields is None for k in CACHE_KINDS)  # placed in their step's window
    assert all(k.time_fields is not None and k.status == "Error" for k in TIMED_KINDS)


def test_a_fill_for_an_unknown_column_or_without_a_getter_is_refused():
    with pytest.raises(KeyError, match="no column 'nope'"):
        Fill("nope", "step")
    with pytest.raises(ValueError, match="give a getter"):
        Fill("ttft_ns", ("first_token_ns", "arrival_ns"))


def _inferred():
    for kind in ALL_KINDS:
        for rule in kind.inferred:
            yield kind.event, tuple(f.column for f in kind.fills), rule
    for rule in STEP_INFERRED:
        yield STEP_EVENT, tuple(f.column for f in STEP_FILLS), rule


@pytest.mark.parametrize("event, columns, rule", list(_inferred()), ids=lambda x: getattr(x, "__name__", None))
def test_every_inferred_entry_marks_columns_its_kind_fills(event, columns, rule):
    """An inferred column is one the span carries, of a known backend; its rule reads
    the event's own fields."""
    assert set(rule.columns) <= set(columns), (event, rule)
    assert rule.backend in BACKENDS and rule.backend != DEFAULT_BACKEND
    if rule.when is not None:
        assert rule.when(_sample_events()[event]) in (True, False)


def test_an_inferred_column_without_an_attribute_key_is_refused():
    with pytest.raises(KeyError, match="no column 'nope' with an attribute key"):
        Inferred("vllm", ("nope",))
