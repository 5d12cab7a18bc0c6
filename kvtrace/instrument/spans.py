"""Events -> spans, in bulk.

``SpanBatchBuilder`` collects whole steps (one list append per step, nothing per event)
and, on ``build()``, turns them into Arrow tables in the store's span schema: one row per
span, ids from the seeded generator, virtual timestamps from the step's window, one
table per store span family. That is the columnar ``SpanBatch`` every processor
receives; exporters that only speak the SDK get ``ReadableSpan`` objects made from it
(``kvtrace.instrument.convert``). Per event kind, columns are pulled out with
``attrgetter`` maps and hex-encoded with numpy, so the per-event Python cost is a few
C-level loop iterations.

Span layout:
- one trace per step: a ``kvtrace.engine.step`` root span, its cache and verification
  spans as children. Cache spans of a step are spread over the step's window in event
  order (start = step start + i * duration / n, zero length), so order survives;
- one trace per request: a root ``kvtrace.request`` span from arrival to finish, with
  ids keyed by the request id; lookup, CoW and divergent-output spans link to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Sequence

import numpy as np
import pyarrow as pa

from kvtrace.cache.events import (
    BlockCopied,
    BlockEvicted,
    BlockPublished,
    BlocksFreed,
    PrefixLookup,
    StaleHashLeft,
)
from kvtrace.engine.events import DivergentOutput, RequestFinished, StaleHashFound, StepExecuted
from kvtrace.instrument.arrow_columns import (
    constant,
    constant_map,
    hex_lists,
    hex_strings,
    int_lists,
    optional_hex,
    single_item_lists,
)
from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.store.schema import (
    FAMILY_OF_NAME,
    SOURCE_REPLAY,
    SPAN_ARROW_SCHEMA,
    SPAN_COW,
    SPAN_DIVERGENT,
    SPAN_EVICT,
    SPAN_FREE,
    SPAN_LOOKUP,
    SPAN_PUBLISH,
    SPAN_REQUEST,
    SPAN_STALE_HASH,
    SPAN_STALE_LEFT,
    SPAN_STEP,
)

_I64, _I32, _F64, _U64, _STR = pa.int64(), pa.int32(), pa.float64(), pa.uint64(), pa.string()
_MASK64 = (1 << 64) - 1
# Columns the builder writes (the store adds run_id).
BATCH_SCHEMA = pa.schema([f for f in SPAN_ARROW_SCHEMA if f.name != "run_id"])
_TYPES = {f.name: f.type for f in BATCH_SCHEMA}

STATUS_UNSET, STATUS_OK, STATUS_ERROR = "Unset", "Ok", "Error"


def conform(table: pa.Table) -> pa.Table:
    """Add the batch columns a table lacks (NULL) and put them in schema order: every
    batch has one shape, whichever span kinds it holds."""
    for f in BATCH_SCHEMA:
        if f.name not in table.column_names:
            table = table.append_column(f, pa.nulls(table.num_rows, f.type))
    return table.select(BATCH_SCHEMA.names)


class SpanBatch:
    """A columnar batch of finished spans, in the store's span schema (no run_id).

    ``parts``: one Arrow table per store span family (``FAMILY_OF_NAME``), each holding
    only the columns its spans set, in a fixed order: the store appends them without
    re-splitting or NULL padding. ``table``: all parts as one table (rows in part order).
    """

    __slots__ = ("parts", "num_spans", "_table")

    def __init__(self, parts: Sequence[pa.Table]):
        self.parts = tuple(parts)
        self.num_spans = sum(p.num_rows for p in self.parts)
        self._table: pa.Table | None = None

    @property
    def table(self) -> pa.Table:
        if self._table is None:
            table = pa.concat_tables(self.parts, promote_options="default")
            self._table = table.select([n for n in BATCH_SCHEMA.names if n in table.column_names])
        return self._table

    def __len__(self) -> int:
        return self.num_spans


@dataclass(slots=True, frozen=True)
class Envelope:
    """Per-run constants written on every span."""

    service_name: str = "kvtrace"
    scope_name: str = "kvtrace.instrument"
    scope_version: str = "0.1.0"
    resource_attributes: tuple[tuple[str, str], ...] = ()  # stored per row (none: NULL)
    source: str = SOURCE_REPLAY


def _col(values, name: str) -> pa.Array:
    return pa.array(values, _TYPES[name])


class SpanBatchBuilder:
    """Accumulates steps; ``build()`` returns them as one ``SpanBatch`` and resets."""

    __slots__ = (
        "ids", "envelope", "_step_no", "_start", "_end", "_step", "_events", "_lens",
        "_finished", "_stale", "_stale_slot", "_divergent", "_divergent_slot", "_pending",
        "_request_ids",
    )

    def __init__(self, ids: SeededIdGenerator, envelope: Envelope = Envelope()):
        self.ids = ids
        self.envelope = envelope
        self._request_ids: dict[str, tuple[int, int, int]] = {}
        self._reset()

    def _reset(self) -> None:
        self._step_no: list[int] = []
        self._start: list[int] = []
        self._end: list[int] = []
        self._step: list[StepExecuted | None] = []
        self._events: list = []
        self._lens: list[int] = []
        self._finished: list[RequestFinished] = []
        self._stale: list[StaleHashFound] = []
        self._stale_slot: list[int] = []
        self._divergent: list[DivergentOutput] = []
        self._divergent_slot: list[int] = []
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
            if cls is RequestFinished:
                self._finished.append(ev)
            elif cls is StaleHashFound:
                self._stale.append(ev)
                self._stale_slot.append(slot)
            elif cls is DivergentOutput:
                self._divergent.append(ev)
                self._divergent_slot.append(slot)
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
        if self._stale:
            segments.append(self._stale_hash_segment(step_trace, step_span))
        if self._divergent:
            segments.append(self._divergent_segment(step_trace, step_span))
        if self._finished:
            segments.append(self._request_segment())
        self._reset()
        return SpanBatch(_family_parts(segments))

    # -- segments ---------------------------------------------------------------------------
    def _envelope(self, name: str, n: int, ids: tuple, start: np.ndarray, end: np.ndarray,
                  status: str = STATUS_UNSET) -> dict[str, pa.Array]:
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
            "name": constant(name, n),
            "start_ns": pa.array(start, _I64),
            "end_ns": pa.array(end, _I64),
            "service_name": constant(env.service_name, n),
            "scope_name": constant(env.scope_name, n),
            "scope_version": constant(env.scope_version, n),
            "source": constant(env.source, n),
        }
        if status != STATUS_UNSET:  # NULL is Unset (schema): one string column less per row
            cols["status_code"] = constant(status, n)
        if env.resource_attributes:
            cols["resource_attributes"] = constant_map(env.resource_attributes, n, _TYPES["resource_attributes"])
        return cols

    def _table(self, cols: dict[str, pa.Array]) -> pa.Table:
        return pa.Table.from_arrays(list(cols.values()), schema=pa.schema([pa.field(k, _TYPES[k]) for k in cols]))

    def _child_ids(self, n: int, step_trace: tuple, step_span: np.ndarray, slots: np.ndarray) -> tuple:
        """Ids of n spans that are children of the step spans at ``slots``."""
        first = self.ids.reserve(n)
        own = self.ids.span_ids(np.arange(first, first + n, dtype=np.int64))
        return step_trace[0][slots], step_trace[1][slots], own, step_span[slots]

    def _steps_segment(self, step_trace, step_span, start, end) -> pa.Table:
        n = len(self._step_no)
        cols = self._envelope(SPAN_STEP, n, (*step_trace, step_span, None), start, end)
        cols["step"] = _col(self._step_no, "step")
        steps = self._step
        if any(s is not None for s in steps):
            def field(name):
                return [None if s is None else getattr(s, name) for s in steps]
            cols["num_prefill_tokens"] = _col(field("num_prefill_tokens"), "num_prefill_tokens")
            cols["num_decode_seqs"] = _col(field("num_decode_seqs"), "num_decode_seqs")
            cols["num_running"] = _col(field("num_running"), "num_running")
            cols["num_waiting"] = _col(field("num_waiting"), "num_waiting")
            cols["num_copies"] = _col(field("num_copies"), "num_copies")
            cols["num_preempted"] = _col(field("num_preempted"), "num_preempted")
            cols["usage"] = _col([None if s is None else list(s.usage) for s in steps], "usage")
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
        for code, (cls, make) in enumerate(_CACHE_KINDS):
            idx = np.flatnonzero(codes == code)
            if not len(idx):
                continue
            picked = [events[i] for i in idx.tolist()]
            t = ts[idx]
            cols = self._envelope(make.span_name, len(idx), self._child_ids(len(idx), step_trace, step_span, slot[idx]),
                                  t, t)
            cols["step"] = _col(list(map(_STEP, picked)), "step")
            make(self, picked, cols)
            out.append(self._table(cols))
        return out

    def _request_links(self, request_ids: Sequence[str]) -> pa.ListArray:
        """One link per span, to the request's span."""
        n = len(request_ids)
        ids = np.array([self.request_span_ids(r) for r in request_ids], dtype=np.uint64).reshape(n, 3)
        link_type = _TYPES["links"].value_type
        structs = pa.StructArray.from_arrays(
            [pa.array(ids[:, 0]), pa.array(ids[:, 1]), pa.array(ids[:, 2]),
             pa.nulls(n, _STR), pa.nulls(n, link_type.field("attributes").type)],
            fields=list(link_type),
        )
        return single_item_lists(structs)

    # per-kind column fillers ------------------------------------------------------------------
    def _publish(self, evs: list[BlockPublished], cols: dict) -> None:
        cols["request_id"] = _col(list(map(_REQUEST_ID, evs)), "request_id")
        cols["group_id"] = _col(list(map(_GROUP_ID, evs)), "group_id")
        cols["publish_kind"] = _col(list(map(_KIND, evs)), "publish_kind")
        cols["block_ids"] = int_lists(list(map(_BLOCK_IDS, evs)))
        cols["block_hashes"] = hex_lists(list(map(_BLOCK_HASHES, evs)))
        cols["num_tokens"] = _col(list(map(_NUM_TOKENS, evs)), "num_tokens")

    def _evict(self, evs: list[BlockEvicted], cols: dict) -> None:
        cols["request_id"] = _col(list(map(_REQUEST_ID, evs)), "request_id")
        cols["group_id"] = _col(list(map(_GROUP_ID, evs)), "group_id")
        cols["evict_reason"] = _col(list(map(_REASON, evs)), "evict_reason")
        cols["block_ids"] = int_lists(list(map(_BLOCK_IDS, evs)))
        cols["block_hashes"] = hex_lists(list(map(_BLOCK_HASHES, evs)))
        cols["ages"] = int_lists(list(map(_AGES, evs)))
        cols["idle"] = int_lists(list(map(_IDLE, evs)))

    def _cow(self, evs: list[BlockCopied], cols: dict) -> None:
        rids = list(map(_REQUEST_ID, evs))
        cols["request_id"] = _col(rids, "request_id")
        cols["group_id"] = _col(list(map(_GROUP_ID, evs)), "group_id")
        cols["copy_src"] = _col(list(map(_SRC, evs)), "copy_src")
        cols["copy_dst"] = _col(list(map(_DST, evs)), "copy_dst")
        cols["copy_reason"] = _col(list(map(_WHY, evs)), "copy_reason")
        cols["links"] = self._request_links(rids)

    def _lookup(self, evs: list[PrefixLookup], cols: dict) -> None:
        rids = list(map(_REQUEST_ID, evs))
        cols["request_id"] = _col(rids, "request_id")
        cols["num_query_tokens"] = _col(list(map(_QUERY_TOKENS, evs)), "num_query_tokens")
        cols["num_hit_tokens"] = _col(list(map(_HIT_TOKENS, evs)), "num_hit_tokens")
        cols["hit_tokens_per_group"] = int_lists(list(map(_HIT_PER_GROUP, evs)))
        cols["shared_prefix_boundary"] = _col(list(map(_SPB, evs)), "shared_prefix_boundary")
        cols["num_external_hit_tokens"] = _col(list(map(_EXT_HIT, evs)), "num_external_hit_tokens")
        cols["root_hash"] = optional_hex(list(map(_ROOT_HASH, evs)))
        cols["first_miss_hash"] = optional_hex(list(map(_MISS_HASH, evs)))
        cols["first_miss_index"] = _col(list(map(_MISS_INDEX, evs)), "first_miss_index")
        cols["links"] = self._request_links(rids)

    def _free(self, evs: list[BlocksFreed], cols: dict) -> None:
        cols["request_id"] = _col(list(map(_REQUEST_ID, evs)), "request_id")
        cols["group_id"] = _col(list(map(_GROUP_ID, evs)), "group_id")
        cols["block_ids"] = int_lists(list(map(_BLOCK_IDS, evs)))

    def _stale_left(self, evs: list[StaleHashLeft] | list[StaleHashFound], cols: dict) -> None:
        """One stale key per span (also the evidence columns of ``kvtrace.verify.stale_hash``)."""
        cols["request_id"] = _col(list(map(_REQUEST_ID, evs)), "request_id")
        cols["group_id"] = _col(list(map(_GROUP_ID, evs)), "group_id")
        cols["block_ids"] = single_item_lists(pa.array(list(map(_BLOCK_ID, evs)), _I64))
        cols["block_hashes"] = single_item_lists(hex_strings(list(map(_BLOCK_HASH, evs))))
        cols["num_tokens"] = _col(list(map(_NUM_TOKENS, evs)), "num_tokens")

    _publish.span_name = SPAN_PUBLISH
    _evict.span_name = SPAN_EVICT
    _cow.span_name = SPAN_COW
    _lookup.span_name = SPAN_LOOKUP
    _free.span_name = SPAN_FREE
    _stale_left.span_name = SPAN_STALE_LEFT

    # engine events ------------------------------------------------------------------------
    def _error_envelope(self, name: str, message: str, evs: list, slots: list[int], step_trace,
                        step_span) -> dict[str, pa.Array]:
        """Columns shared by the verification spans: instant children of their step, status Error."""
        n = len(evs)
        t = np.asarray([e.time_ns for e in evs], dtype=np.int64)
        cols = self._envelope(name, n, self._child_ids(n, step_trace, step_span, np.asarray(slots)), t, t,
                              STATUS_ERROR)
        cols["status_message"] = constant(message, n)
        cols["step"] = _col(list(map(_STEP, evs)), "step")
        return cols

    def _stale_hash_segment(self, step_trace, step_span) -> pa.Table:
        evs = self._stale
        cols = self._error_envelope(SPAN_STALE_HASH, "stale hash: block content does not match its key", evs,
                                    self._stale_slot, step_trace, step_span)
        self._stale_left(evs, cols)
        cols["expected_fingerprint"] = _col([e.expected_fingerprint & _MASK64 for e in evs], "expected_fingerprint")
        cols["actual_fingerprint"] = _col([e.actual_fingerprint & _MASK64 for e in evs], "actual_fingerprint")
        return self._table(cols)

    def _divergent_segment(self, step_trace, step_span) -> pa.Table:
        evs = self._divergent
        cols = self._error_envelope(SPAN_DIVERGENT, "divergent output token", evs, self._divergent_slot,
                                    step_trace, step_span)
        rids = list(map(_REQUEST_ID, evs))
        cols["request_id"] = _col(rids, "request_id")
        cols["position"] = _col([e.position for e in evs], "position")
        cols["expected_token"] = _col([e.expected_token for e in evs], "expected_token")
        cols["actual_token"] = _col([e.actual_token for e in evs], "actual_token")
        cols["links"] = self._request_links(rids)
        return self._table(cols)

    def _request_segment(self) -> pa.Table:
        evs = self._finished
        n = len(evs)
        ids = np.array([self.request_span_ids(e.request_id) for e in evs], dtype=np.uint64).reshape(n, 3)
        for e in evs:  # finished: later links to it are not expected
            self._request_ids.pop(e.request_id, None)
        start = np.asarray([e.arrival_ns for e in evs], dtype=np.int64)
        end = np.asarray([e.finish_ns for e in evs], dtype=np.int64)
        status = [STATUS_ERROR if e.num_divergent_tokens else None for e in evs]  # None: Unset
        cols = self._envelope(SPAN_REQUEST, n, (ids[:, 0], ids[:, 1], ids[:, 2], None), start, end)
        cols["status_code"] = pa.array(status, _STR)
        cols["status_message"] = pa.array(
            ["divergent output" if e.num_divergent_tokens else None for e in evs], _STR)
        cols["request_id"] = _col([e.request_id for e in evs], "request_id")
        cols["session_id"] = _col([e.session_id for e in evs], "session_id")
        cols["arrival_ns"] = pa.array(start, _I64)
        cols["first_scheduled_ns"] = _col([e.first_scheduled_ns for e in evs], "first_scheduled_ns")
        cols["first_token_ns"] = _col([e.first_token_ns for e in evs], "first_token_ns")
        cols["num_prompt_tokens"] = _col([e.num_prompt_tokens for e in evs], "num_prompt_tokens")
        cols["num_output_tokens"] = _col([e.num_output_tokens for e in evs], "num_output_tokens")
        cols["num_hit_tokens"] = _col([e.num_local_hit_tokens for e in evs], "num_hit_tokens")
        cols["num_external_hit_tokens"] = _col([e.num_external_hit_tokens for e in evs], "num_external_hit_tokens")
        cols["num_computed_tokens"] = _col([e.num_computed_prompt_tokens for e in evs], "num_computed_tokens")
        cols["num_preemptions"] = _col([e.num_preemptions for e in evs], "num_preemptions")
        cols["num_divergent_tokens"] = _col([e.num_divergent_tokens for e in evs], "num_divergent_tokens")
        cols["ttft_ns"] = _col([e.first_token_ns - e.arrival_ns for e in evs], "ttft_ns")
        itls = [e.itl_ns for e in evs]
        cols["itl_ns"] = int_lists(itls)
        stats = [_itl_stats(x) for x in itls]
        cols["itl_mean_ns"] = _col([s[0] for s in stats], "itl_mean_ns")
        cols["itl_p50_ns"] = _col([s[1] for s in stats], "itl_p50_ns")
        cols["itl_p99_ns"] = _col([s[2] for s in stats], "itl_p99_ns")
        cols["itl_max_ns"] = _col([s[3] for s in stats], "itl_max_ns")
        cols["prefill_chunks"] = _col(
            [[{"start_ns": c[0], "end_ns": c[1], "num_tokens": c[2]} for c in e.prefill_chunks] for e in evs],
            "prefill_chunks")
        return self._table(cols)


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
        parts.append(table.select([n for n in BATCH_SCHEMA.names if n in table.column_names]))
    return parts


def _percentile(ordered: list[int], q: float) -> float:
    """numpy's default (linear) percentile of a sorted list, without numpy's per-call cost."""
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _itl_stats(itl: Sequence[int]) -> tuple[float | None, float | None, float | None, int | None]:
    if not itl:
        return None, None, None, None
    ordered = sorted(itl)
    return sum(itl) / len(itl), float(_percentile(ordered, 0.5)), float(_percentile(ordered, 0.99)), ordered[-1]


_STEP = attrgetter("step")
_REQUEST_ID = attrgetter("request_id")
_GROUP_ID = attrgetter("group_id")
_KIND = attrgetter("kind")
_REASON = attrgetter("reason")
_BLOCK_IDS = attrgetter("block_ids")
_BLOCK_HASHES = attrgetter("block_hashes")
_BLOCK_ID = attrgetter("block_id")
_BLOCK_HASH = attrgetter("block_hash")
_NUM_TOKENS = attrgetter("num_tokens")
_AGES = attrgetter("ages")
_IDLE = attrgetter("idle")
_SRC = attrgetter("src")
_DST = attrgetter("dst")
_WHY = attrgetter("why")
_QUERY_TOKENS = attrgetter("num_query_tokens")
_HIT_TOKENS = attrgetter("num_hit_tokens")
_HIT_PER_GROUP = attrgetter("hit_tokens_per_group")
_SPB = attrgetter("shared_prefix_boundary")
_EXT_HIT = attrgetter("num_external_hit_tokens")
_ROOT_HASH = attrgetter("root_hash")
_MISS_HASH = attrgetter("first_miss_hash")
_MISS_INDEX = attrgetter("first_miss_index")

# Order here is the row order of cache spans within a batch.
_CACHE_KINDS = (
    (PrefixLookup, SpanBatchBuilder._lookup),
    (BlockEvicted, SpanBatchBuilder._evict),
    (BlockPublished, SpanBatchBuilder._publish),
    (BlockCopied, SpanBatchBuilder._cow),
    (BlocksFreed, SpanBatchBuilder._free),
    (StaleHashLeft, SpanBatchBuilder._stale_left),
)


class _KindCodes(dict):
    def __missing__(self, key):
        return -1  # an event kind this version does not know: no span


_KIND_CODE = _KindCodes({cls: code for code, (cls, _) in enumerate(_CACHE_KINDS)})
