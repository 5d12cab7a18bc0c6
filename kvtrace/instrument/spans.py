"""Events -> spans, in bulk.

``SpanBatchBuilder`` collects whole steps (one list append per step, nothing per event)
and, on ``build()``, turns them into Arrow tables in the store's span schema: one row per
span, ids from the seeded generator, virtual timestamps from the step's window, one
table per store span family. That is the columnar ``SpanBatch`` every processor
receives; exporters that only speak the SDK get ``ReadableSpan`` objects made from it
(``kvtrace.instrument.convert``). What each event kind becomes (span name, columns,
encoders) is the declarative table in ``kvtrace.instrument.span_kinds``; the builder
fills every kind's columns from it generically, one C-level ``map`` and one vectorised
encoder call per column, so the per-event Python cost is a few loop iterations in C.

Span layout:
- one trace per step: a ``kvtrace.engine.step`` root span, its cache and verification
  spans as children. Cache spans of a step are spread over the step's window in event
  order (start = step start + i * duration / n, zero length), so order survives;
- one trace per request: a root ``kvtrace.request`` span from arrival to finish, with
  ids keyed by the request id; lookup, CoW and divergent-output spans link to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import attrgetter

import numpy as np
import pyarrow as pa

from kvtrace.engine.events import StepExecuted
from kvtrace.errors import ConfigError
from kvtrace.instrument.arrow_columns import constant, constant_map, single_item_lists
from kvtrace.instrument.batch import BATCH_SCHEMA, Envelope, SpanBatch
from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.span_kinds import (
    ALL_KINDS,
    CACHE_KINDS,
    REQUEST_KIND,
    STATUS_UNSET,
    STEP_FILLS,
    STEP_INFERRED,
    TIMED_KINDS,
    SpanKind,
    inferred_by,
    inferred_column,
)
from kvtrace.names import shown_value
from kvtrace.store.schema import FAMILY_OF_NAME, SPAN_STEP

_I64, _U64, _STR = pa.int64(), pa.uint64(), pa.string()
_TYPES = {f.name: f.type for f in BATCH_SCHEMA}
_REQUEST_ID = attrgetter("request_id")
_SCHEMAS: dict[tuple[str, ...], pa.Schema] = {}


class SpanBatchBuilder:
    """Accumulates steps; ``build()`` returns them as one ``SpanBatch`` and resets."""

    __slots__ = ("_end", "_events", "_inferred", "_lens", "_pending", "_request_ids", "_requests", "_start",
                 "_step", "_step_inferred", "_step_no", "_timed", "envelope", "ids")

    def __init__(self, ids: SeededIdGenerator, envelope: Envelope | None = None):
        if not isinstance(ids, SeededIdGenerator):  # (its span ids are reserved in bulk: no other generator's)
            raise ConfigError("SpanBatchBuilder", "ids", f"expected a SeededIdGenerator, got {shown_value(ids)}")
        self.ids = ids
        self.envelope = envelope if envelope is not None else Envelope()
        backend = self.envelope.backend  # what its cache infers (span_kinds): kvtrace's, nothing
        self._inferred = {k.event: rules for k in ALL_KINDS if (rules := inferred_by(backend, k.inferred))}
        self._step_inferred = inferred_by(backend, STEP_INFERRED)
        self._request_ids: dict[str, tuple[int, int, int]] = {}
        self._reset()

    def _reset(self) -> None:
        self._step_no: list[int] = []
        self._start: list[int] = []
        self._end: list[int] = []
        self._step: list[StepExecuted | None] = []
        self._events: list = []
        self._lens: list[int] = []
        self._requests: list = []  # RequestFinished
        # per timed kind: (events, the slot of the step each came with)
        self._timed: dict[type, tuple[list, list[int]]] = {k.event: ([], []) for k in TIMED_KINDS}
        self._pending = 0

    @property
    def pending_spans(self) -> int:
        return self._pending

    # -- intake (hot: once per step) ------------------------------------------------------
    def add_step(
        self,
        step_no: int,
        start_ns: int,
        end_ns: int,
        cache_events: Sequence,
        engine_events: Sequence = (),
        step: StepExecuted | None = None,
    ) -> None:
        slot = len(self._step_no)
        self._step_no.append(step_no)
        self._start.append(start_ns)
        self._end.append(end_ns)
        self._step.append(step)
        self._events.extend(cache_events)
        self._lens.append(len(cache_events))
        self._pending += 1 + len(cache_events) + len(engine_events)
        for ev in engine_events:
            cls = ev.__class__
            if cls is REQUEST_KIND.event:
                self._requests.append(ev)
                continue
            timed = self._timed.get(cls)
            if timed is not None:
                timed[0].append(ev)
                timed[1].append(slot)
            else:
                self._pending -= 1  # StepExecuted (carried as ``step``) or unknown: no span

    def request_span_ids(self, request_id: str) -> tuple[int, int, int]:
        """(trace id high, low, span id) of a request's span."""
        got = self._request_ids.get(request_id)
        if got is None:
            got = self._request_ids[request_id] = self.ids.request_ids(request_id)
        return got

    # -- build (once per flush) -------------------------------------------------------------
    def build(self) -> SpanBatch | None:
        if not self._pending:
            self._reset()
            return None
        segments: list[pa.Table] = []
        num_steps = len(self._step_no)
        first = self.ids.reserve(num_steps)
        step_ord = np.arange(first, first + num_steps, dtype=np.int64)
        step_trace = self.ids.trace_ids(step_ord)
        step_span = self.ids.span_ids(step_ord)
        start = np.asarray(self._start, dtype=np.int64)
        end = np.asarray(self._end, dtype=np.int64)
        if num_steps:
            segments.append(self._steps_segment(step_trace, step_span, start, end))
        if self._events:
            segments.extend(self._cache_segments(step_trace, step_span, start, end))
        for kind in TIMED_KINDS:
            evs, slots = self._timed[kind.event]
            if evs:
                segments.append(self._timed_segment(kind, evs, slots, step_trace, step_span))
        if self._requests:
            segments.append(self._request_segment())
        self._reset()
        return SpanBatch(_family_parts(segments))

    # -- segments ---------------------------------------------------------------------------
    def _envelope(self, kind_name: str, n: int, ids: tuple, start: np.ndarray, end: np.ndarray,
                  kind: SpanKind | None = None) -> dict[str, pa.Array]:
        """Envelope columns; ``ids``: uint64 arrays (trace high, trace low, span, parent or
        None for root spans, whose parent_span_id is NULL)."""
        env = self.envelope
        trace_hi, trace_lo, span, parent = ids
        cols = {
            "trace_id_hi": pa.array(trace_hi, _U64),
            "trace_id_lo": pa.array(trace_lo, _U64),
            "span_id": pa.array(span, _U64),
        }
        if parent is not None:
            cols["parent_span_id"] = pa.array(parent, _U64)
        cols |= {
            "name": constant(kind_name, n),
            "start_ns": pa.array(start, _I64),
            "end_ns": pa.array(end, _I64),
            "service_name": constant(env.service_name, n),
            "scope_name": constant(env.scope_name, n),
            "scope_version": constant(env.scope_version, n),
            "source": constant(env.source, n),
        }
        if kind is not None and kind.status not in (None, STATUS_UNSET):  # NULL is Unset: one column less
            cols["status_code"] = constant(kind.status, n)
            if kind.status_message:
                cols["status_message"] = constant(kind.status_message, n)
        if env.resource_attributes:
            cols["resource_attributes"] = constant_map(env.resource_attributes, n, _TYPES["resource_attributes"])
        return cols

    def _fill(self, kind: SpanKind, evs: list, cols: dict[str, pa.Array]) -> pa.Table:
        """The kind's columns from its table entry, then the table of the segment."""
        read: dict = {}  # each field read once (the ITL columns share theirs)
        for f in kind.fills:
            cols[f.column] = f.column_from(evs, read)
        rules = self._inferred.get(kind.event)
        if rules and (marks := inferred_column(rules, evs)) is not None:
            cols["extra_attributes"] = marks
        if kind.link_request:
            cols["links"] = self._request_links(list(map(_REQUEST_ID, evs)))
        return self._table(cols)

    def _table(self, cols: dict[str, pa.Array]) -> pa.Table:
        names = tuple(cols)
        schema = _SCHEMAS.get(names)
        if schema is None:  # one per column set (a few per span kind)
            schema = _SCHEMAS[names] = pa.schema([pa.field(k, _TYPES[k]) for k in names])
        return pa.Table.from_arrays(list(cols.values()), schema=schema)

    def _child_ids(self, n: int, step_trace: tuple, step_span: np.ndarray, slots: np.ndarray) -> tuple:
        """Ids of n spans that are children of the step spans at ``slots``."""
        first = self.ids.reserve(n)
        own = self.ids.span_ids(np.arange(first, first + n, dtype=np.int64))
        return step_trace[0][slots], step_trace[1][slots], own, step_span[slots]

    def _steps_segment(self, step_trace, step_span, start, end) -> pa.Table:
        n = len(self._step_no)
        cols = self._envelope(SPAN_STEP, n, (*step_trace, step_span, None), start, end)
        cols["step"] = pa.array(self._step_no, _I64)
        steps = self._step
        if all(s is not None for s in steps):
            for f in STEP_FILLS:
                cols[f.column] = f.column_of(steps)
            if self._step_inferred and (marks := inferred_column(self._step_inferred, steps)) is not None:
                cols["extra_attributes"] = marks
        elif any(s is not None for s in steps):
            for f in STEP_FILLS:
                get = f.getter
                cols[f.column] = f.encode([None if s is None else get(s) for s in steps], f.arrow)
        return self._table(cols)

    def _cache_segments(self, step_trace, step_span, start, end) -> list[pa.Table]:
        events = self._events
        lens = np.asarray(self._lens, dtype=np.int64)
        total = len(events)
        slot = np.repeat(np.arange(len(lens)), lens)
        first = np.cumsum(lens) - lens
        pos = np.arange(total, dtype=np.int64) - first[slot]
        duration = end - start
        ts = start[slot] + (pos * duration[slot]) // lens[slot]
        codes = np.fromiter(map(_KIND_CODE.__getitem__, map(type, events)), dtype=np.int8, count=total)
        out = []
        for code, kind in enumerate(CACHE_KINDS):
            idx = np.flatnonzero(codes == code)
            if not len(idx):
                continue
            picked = [events[i] for i in idx.tolist()]
            t = ts[idx]
            ids = self._child_ids(len(idx), step_trace, step_span, slot[idx])
            out.append(self._fill(kind, picked, self._envelope(kind.name, len(idx), ids, t, t, kind)))
        return out

    def _timed_segment(self, kind: SpanKind, evs: list, slots: list[int], step_trace, step_span) -> pa.Table:
        """Children of the step they came with, placed at their own time fields."""
        n = len(evs)
        assert kind.time_fields is not None
        t0, t1 = (np.fromiter(map(attrgetter(f), evs), dtype=np.int64, count=n) for f in kind.time_fields)
        ids = self._child_ids(n, step_trace, step_span, np.asarray(slots, dtype=np.int64))
        return self._fill(kind, evs, self._envelope(kind.name, n, ids, t0, t1, kind))

    def _request_links(self, request_ids: Sequence[str]) -> pa.ListArray:
        """One link per span, to the request's span."""
        n = len(request_ids)
        ids = np.fromiter(chain.from_iterable(map(self.request_span_ids, request_ids)), np.uint64,
                          count=3 * n).reshape(n, 3)
        link_type = _TYPES["links"].value_type
        structs = pa.StructArray.from_arrays(
            [pa.array(ids[:, 0]), pa.array(ids[:, 1]), pa.array(ids[:, 2]),
             pa.nulls(n, _STR), pa.nulls(n, link_type.field("attributes").type)],
            fields=list(link_type),
        )
        return single_item_lists(structs)

    def _request_segment(self) -> pa.Table:
        """Root spans with ids keyed by request id (links made earlier point at them)."""
        evs, kind = self._requests, REQUEST_KIND
        n = len(evs)
        ids = np.array([self.request_span_ids(e.request_id) for e in evs], dtype=np.uint64).reshape(n, 3)
        for e in evs:  # finished: later links to it are not expected
            self._request_ids.pop(e.request_id, None)
        assert kind.time_fields is not None
        t0, t1 = (np.fromiter(map(attrgetter(f), evs), dtype=np.int64, count=n) for f in kind.time_fields)
        cols = self._envelope(kind.name, n, (ids[:, 0], ids[:, 1], ids[:, 2], None), t0, t1, kind)
        return self._fill(kind, evs, cols)


def _family_parts(segments: list[pa.Table]) -> list[pa.Table]:
    """Group per-kind segments into one table per store family (sorted by family name).

    Only the columns some span of the family set are kept: NULL padding costs DuckDB
    more than it saves.
    """
    by_family: dict[str, list[pa.Table]] = {}
    for seg in segments:
        name = seg.column("name")[0].as_py()
        by_family.setdefault(FAMILY_OF_NAME.get(name, "~other"), []).append(seg)
    parts = []
    for family in sorted(by_family):
        segs = by_family[family]
        table = segs[0] if len(segs) == 1 else pa.concat_tables(segs, promote_options="default")
        have = set(table.column_names)  # (a property that builds a new list on every call)
        parts.append(table.select([n for n in BATCH_SCHEMA.names if n in have]))
    return parts


class _KindCodes(dict):
    def __missing__(self, key):
        return -1  # an event kind this version does not know: no span


_KIND_CODE = _KindCodes({kind.event: code for code, kind in enumerate(CACHE_KINDS)})
