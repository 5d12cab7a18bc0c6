"""What each event kind becomes: a declarative table, one ``SpanKind`` per span kind.

Each entry names the event class, the span name, how the span is placed in time, and
its columns as ``Fill(column, fields, encoder)`` rows: the store column (a
``SPAN_COLUMN_DEFS`` name), the event fields it reads, and the encoder that turns one
value per event into an Arrow array of that column's type. ``SpanBatchBuilder`` fills
columns from this table and nothing else: for every entry, one C-level ``map`` of the
field's ``attrgetter`` (or the entry's getter) over all events of the kind, then one
vectorised encoder call. ``tests/instrument/test_span_kinds.py`` holds the table against
the schema (every column exists, with the type its encoder produces) and the event
Structs (every field read exists).

Placement (the builder's part):
- cache kinds (``CACHE_KINDS``): children of their step's span, zero length, spread over
  the step's window in event order;
- ``TIMED_KINDS`` (verification): children of their step's span, instant at ``time_``
  fields, with a constant status;
- ``REQUEST_KIND``: a root span from arrival to finish, ids keyed by the request id;
- ``STEP_FILLS``: the ``StepExecuted`` columns of a step's own (root) span.

Inferred values: a backend that does not report a value the span carries (vLLM's
manager names no eviction reason, publish kind or copy reason) has the adapter infer it
(``kvtrace.engine.backends.vllm.engine_manager``). Each kind's ``inferred`` entries
(``Inferred(backend, columns, when)``, ``STEP_INFERRED`` for the step span) say which
columns that backend infers, and for which events; such a span carries the extra
attribute ``kvtrace.inferred`` (``INFERRED_ATTRIBUTE``): the JSON array of those
columns' attribute keys. The kvtrace backend infers nothing: no span of it carries one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import pyarrow as pa

from kvtrace.cache.events import (
    COPY_EXTERNAL,
    EVICT_CONNECTOR,
    EVICT_RESET,
    BlockCopied,
    BlockEvicted,
    BlockPublished,
    BlocksFreed,
    PrefixLookup,
    StaleHashLeft,
)
from kvtrace.engine.events import DivergentOutput, RequestFinished, StaleHashFound, StepExecuted
from kvtrace.instrument.arrow_columns import (
    Ragged,
    constant_map,
    hex_lists,
    hex_strings,
    int_lists,
    optional_hex,
    single_item_lists,
)
from kvtrace.instrument.batch import BATCH_SCHEMA
from kvtrace.instrument.convert import attribute_text
from kvtrace.store.schema import (
    INFERRED_ATTRIBUTE,
    SPAN_COLUMN_DEFS,
    SPAN_COW,
    SPAN_DIVERGENT,
    SPAN_EVICT,
    SPAN_FREE,
    SPAN_LOOKUP,
    SPAN_PUBLISH,
    SPAN_REQUEST,
    SPAN_STALE_HASH,
    SPAN_STALE_LEFT,
)

STATUS_UNSET, STATUS_ERROR = "Unset", "Error"  # OTel status names as stored
VLLM = "vllm"  # a backend, as the kvtrace.backend resource attribute names it (kvtrace.engine.backends)
_MASK64 = (1 << 64) - 1
_I64 = pa.int64()
_TYPES = {f.name: f.type for f in BATCH_SCHEMA}
_ATTRIBUTE_OF: dict[str, str] = {c.name: c.attr for c in SPAN_COLUMN_DEFS if c.attr}  # column -> OTel key

# --- encoders: one value per event -> one Arrow array of the column's type ---------------
Encoder = Callable[[list, pa.DataType], pa.Array]


def scalar(values: list, arrow: pa.DataType) -> pa.Array:
    """Values as they are (ints, strings, floats, lists of them, None)."""
    return pa.array(values, arrow)


def int_list(values: list, arrow: pa.DataType) -> pa.Array:
    """Tuples of ints -> list<int64>."""
    return int_lists(values)


def shared_int_list(values: list, arrow: pa.DataType) -> pa.Array:
    """``int_list`` whose flat array the other list encoders of the segment reuse."""
    return Ragged.of(values).list_array()


def list_mean(values: list, arrow: pa.DataType) -> pa.Array:
    """Tuples of ints -> the mean of each (NULL for an empty one)."""
    return Ragged.of(values).means()


def list_max(values: list, arrow: pa.DataType) -> pa.Array:
    """Tuples of ints -> the largest of each (NULL for an empty one)."""
    return Ragged.of(values).maxima()


def list_percentile(q: float) -> Encoder:
    """Tuples of ints -> their ``q``-th percentile, ``kvtrace.numeric.percentile``'s
    definition (NULL for an empty one)."""
    def encode(values: list, arrow: pa.DataType) -> pa.Array:
        return Ragged.of(values).percentiles(q)
    encode.__name__ = f"list_percentile({q:g})"
    return encode


def hash_list(values: list, arrow: pa.DataType) -> pa.Array:
    """Tuples of block hashes -> list<string> of hex (``hash_hex``)."""
    return hex_lists(values)


def hash_or_null(values: list, arrow: pa.DataType) -> pa.Array:
    """A block hash or None -> string hex or NULL."""
    return optional_hex(values)


def one_int(values: list, arrow: pa.DataType) -> pa.Array:
    """One int per event -> a one-element list<int64>."""
    return single_item_lists(pa.array(values, _I64))


def one_hash(values: list, arrow: pa.DataType) -> pa.Array:
    """One block hash per event -> a one-element list<string> of hex."""
    return single_item_lists(hex_strings(values))


_FIELD_GETTERS: dict[str, attrgetter] = {}


def field_getter(name: str) -> attrgetter:
    """One getter per field name: fills of one field share it, so the builder reads the
    field once per segment and their encoders see one value list (``Ragged.of``)."""
    got = _FIELD_GETTERS.get(name)
    if got is None:
        got = _FIELD_GETTERS[name] = attrgetter(name)
    return got


class Fill:
    """One column of a span kind: ``column`` from the event ``fields`` through ``encode``.

    ``get``: computes the value from the event (it reads ``fields``); without it the
    value is the one field itself.
    """

    __slots__ = ("arrow", "column", "encode", "fields", "getter")

    def __init__(self, column: str, fields: str | tuple[str, ...], encode: Encoder = scalar,
                 get: Callable[[Any], Any] | None = None):
        if column not in _TYPES:
            raise KeyError(f"span kinds: no column {column!r} in the store schema")
        self.column = column
        self.fields = (fields,) if isinstance(fields, str) else tuple(fields)
        self.encode = encode
        self.arrow: pa.DataType = _TYPES[column]
        if get is None and len(self.fields) != 1:
            raise ValueError(f"span kinds: column {column!r} reads several fields; give a getter")
        self.getter: Callable[[Any], Any] = get if get is not None else field_getter(self.fields[0])

    def column_of(self, events: Sequence) -> pa.Array:
        return self.column_from(events, {})

    def column_from(self, events: Sequence, read: dict) -> pa.Array:
        """The column of ``events``, reading each getter's values once per ``read`` (a dict
        the caller keeps for one list of events)."""
        values = read.get(self.getter)
        if values is None:
            values = read[self.getter] = list(map(self.getter, events))
        return self.encode(values, self.arrow)

    def __repr__(self) -> str:
        return f"Fill({self.column!r}, {self.fields!r}, {self.encode.__name__})"


@dataclass(frozen=True, slots=True)
class Inferred:
    """Columns of a span kind that ``backend`` fills by inference, not from its cache's
    own report: on every span of the kind, or where ``when(event)`` holds."""

    backend: str
    columns: tuple[str, ...]
    when: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        for column in self.columns:
            if column not in _ATTRIBUTE_OF:
                raise KeyError(f"span kinds: no column {column!r} with an attribute key in the store schema")


@dataclass(frozen=True, slots=True)
class SpanKind:
    """An event class and the span it becomes.

    ``link_request``: one link to the span of the event's ``request_id``.
    ``status``/``status_message``: constants for every span of the kind (None: Unset).
    ``time_fields``: (start, end) event fields of a timed kind; None: the step's window.
    ``inferred``: the columns a backend infers (see the module docstring).
    """

    event: type
    name: str
    fills: tuple[Fill, ...]
    link_request: bool = False
    status: str | None = None
    status_message: str | None = None
    time_fields: tuple[str, str] | None = None
    inferred: tuple[Inferred, ...] = ()


def _chunks(e: RequestFinished) -> list[dict[str, int]]:
    return [{"start_ns": c[0], "end_ns": c[1], "num_tokens": c[2]} for c in e.prefill_chunks]


def _divergent(value: str) -> Callable[[RequestFinished], str | None]:
    return lambda e: value if e.num_divergent_tokens else None  # None: Unset


_STEP = Fill("step", "step")
_REQUEST_ID = Fill("request_id", "request_id")
_GROUP = Fill("group_id", "group_id")
_BLOCK_IDS = Fill("block_ids", "block_ids", int_list)
_BLOCK_HASHES = Fill("block_hashes", "block_hashes", hash_list)
_NUM_TOKENS = Fill("num_tokens", "num_tokens")
# one stale key per span (also the evidence of kvtrace.verify.stale_hash)
_STALE_KEY = (_STEP, _REQUEST_ID, _GROUP, Fill("block_ids", "block_id", one_int),
              Fill("block_hashes", "block_hash", one_hash), _NUM_TOKENS)

# Order here is the row order of cache spans within a batch.
CACHE_KINDS: tuple[SpanKind, ...] = (
    SpanKind(PrefixLookup, SPAN_LOOKUP, (
        _STEP, _REQUEST_ID,
        Fill("num_query_tokens", "num_query_tokens"),
        Fill("num_hit_tokens", "num_hit_tokens"),
        Fill("hit_tokens_per_group", "hit_tokens_per_group", int_list),
        Fill("shared_prefix_boundary", "shared_prefix_boundary"),
        Fill("num_external_hit_tokens", "num_external_hit_tokens"),
        Fill("root_hash", "root_hash", hash_or_null),
        Fill("first_miss_hash", "first_miss_hash", hash_or_null),
        Fill("first_miss_index", "first_miss_index"),
    ), link_request=True),  # (the vllm backend's per-group hits are vLLM's own per-group lookups: none inferred)
    SpanKind(BlockEvicted, SPAN_EVICT, (
        _STEP, _REQUEST_ID, _GROUP,
        Fill("evict_reason", "reason"),
        _BLOCK_IDS, _BLOCK_HASHES,
        Fill("ages", "ages", int_list),
        Fill("idle", "idle", int_list),
    ), inferred=(  # reset: AllBlocksCleared; connector: the adapter's own tier (kvtrace's)
        Inferred(VLLM, ("evict_reason",), lambda e: e.reason not in (EVICT_RESET, EVICT_CONNECTOR)),)),
    SpanKind(BlockPublished, SPAN_PUBLISH, (
        _STEP, _REQUEST_ID, _GROUP,
        Fill("publish_kind", "kind"),
        _BLOCK_IDS, _BLOCK_HASHES, _NUM_TOKENS,
    ), inferred=(Inferred(VLLM, ("publish_kind",)),)),
    SpanKind(BlockCopied, SPAN_COW, (
        _STEP, _REQUEST_ID, _GROUP,
        Fill("copy_src", "src"),
        Fill("copy_dst", "dst"),
        Fill("copy_reason", "why"),
    ), link_request=True, inferred=(  # external: the adapter's own connector load
        Inferred(VLLM, ("copy_reason",), lambda e: e.why != COPY_EXTERNAL),)),
    SpanKind(BlocksFreed, SPAN_FREE, (_STEP, _REQUEST_ID, _GROUP, _BLOCK_IDS)),
    SpanKind(StaleHashLeft, SPAN_STALE_LEFT, _STALE_KEY),
)

TIMED_KINDS: tuple[SpanKind, ...] = (
    SpanKind(StaleHashFound, SPAN_STALE_HASH, (
        *_STALE_KEY,
        Fill("expected_fingerprint", "expected_fingerprint", get=lambda e: e.expected_fingerprint & _MASK64),
        Fill("actual_fingerprint", "actual_fingerprint", get=lambda e: e.actual_fingerprint & _MASK64),
    ), status=STATUS_ERROR, status_message="stale hash: block content does not match its key",
        time_fields=("time_ns", "time_ns")),
    SpanKind(DivergentOutput, SPAN_DIVERGENT, (
        _STEP, _REQUEST_ID,
        Fill("position", "position"),
        Fill("expected_token", "expected_token"),
        Fill("actual_token", "actual_token"),
    ), link_request=True, status=STATUS_ERROR, status_message="divergent output token",
        time_fields=("time_ns", "time_ns")),
)

REQUEST_KIND = SpanKind(RequestFinished, SPAN_REQUEST, (
    Fill("status_code", "num_divergent_tokens", get=_divergent(STATUS_ERROR)),
    Fill("status_message", "num_divergent_tokens", get=_divergent("divergent output")),
    _REQUEST_ID,
    Fill("session_id", "session_id"),
    Fill("arrival_ns", "arrival_ns"),
    Fill("first_scheduled_ns", "first_scheduled_ns"),
    Fill("first_token_ns", "first_token_ns"),
    Fill("num_prompt_tokens", "num_prompt_tokens"),
    Fill("num_output_tokens", "num_output_tokens"),
    Fill("num_hit_tokens", "num_local_hit_tokens"),
    Fill("num_external_hit_tokens", "num_external_hit_tokens"),
    Fill("num_computed_tokens", "num_computed_prompt_tokens"),
    Fill("num_preemptions", "num_preemptions"),
    Fill("num_divergent_tokens", "num_divergent_tokens"),
    Fill("num_external_query_tokens", "num_external_query_tokens"),
    Fill("num_preempted_query_tokens", "num_preempted_query_tokens"),
    Fill("num_preempted_hit_tokens", "num_preempted_hit_tokens"),
    Fill("ttft_ns", ("first_token_ns", "arrival_ns"), get=lambda e: e.first_token_ns - e.arrival_ns),
    Fill("itl_ns", "itl_ns", shared_int_list),  # the ITL fills share one flat array (Ragged)
    Fill("itl_mean_ns", "itl_ns", list_mean),
    Fill("itl_p50_ns", "itl_ns", list_percentile(50)),
    Fill("itl_p99_ns", "itl_ns", list_percentile(99)),
    Fill("itl_max_ns", "itl_ns", list_max),
    Fill("prefill_chunks", "prefill_chunks", get=_chunks),
), time_fields=("arrival_ns", "finish_ns"))

# A step span's columns from its StepExecuted (cache-only steps have none: NULL).
STEP_FILLS: tuple[Fill, ...] = (
    Fill("num_prefill_tokens", "num_prefill_tokens"),
    Fill("num_decode_seqs", "num_decode_seqs"),
    Fill("num_running", "num_running"),
    Fill("num_waiting", "num_waiting"),
    Fill("num_copies", "num_copies"),
    Fill("num_preempted", "num_preempted"),
    Fill("usage", "usage", get=lambda s: list(s.usage)),
)
STEP_EVENT = StepExecuted
# vLLM's pool usage split over several groups (its pool does not record a block's group)
STEP_INFERRED: tuple[Inferred, ...] = (Inferred(VLLM, ("usage",), lambda s: len(s.usage) > 1),)

ALL_KINDS: tuple[SpanKind, ...] = (*CACHE_KINDS, *TIMED_KINDS, REQUEST_KIND)


# --- inferred values ----------------------------------------------------------------------

def inferred_by(backend: str | None, rules: Sequence[Inferred]) -> tuple[Inferred, ...]:
    """The rules of ``backend`` among a kind's (None, the kvtrace backend: none)."""
    return tuple(r for r in rules if r.backend == backend)


def inferred_column(rules: Sequence[Inferred], events: Sequence) -> pa.Array | None:
    """``extra_attributes`` for the spans of ``events``: ``{INFERRED_ATTRIBUTE: JSON array
    of the attribute keys inferred}`` where a rule holds, NULL elsewhere; None when no
    span has any (the column is then left out)."""
    arrow = _TYPES["extra_attributes"]
    keys = [[_ATTRIBUTE_OF[c] for c in r.columns] for r in rules]
    if all(r.when is None for r in rules):  # every span the same
        item = (INFERRED_ATTRIBUTE, attribute_text([k for ks in keys for k in ks]))
        return constant_map([item], len(events), arrow) if events else None
    holds = [[True] * len(events) if r.when is None else list(map(r.when, events)) for r in rules]
    texts: dict[tuple[bool, ...], str] = {}
    rows: list[list[tuple[str, str]] | None] = []
    for marks in zip(*holds):
        if not any(marks):
            rows.append(None)
            continue
        value = texts.get(marks)
        if value is None:
            value = texts[marks] = attribute_text([k for ks, m in zip(keys, marks) if m for k in ks])
        rows.append([(INFERRED_ATTRIBUTE, value)])
    return pa.array(rows, arrow) if any(r is not None for r in rows) else None
