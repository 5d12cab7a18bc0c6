"""Store rows <-> OTel spans.

- ``table_to_readable_spans``: a ``SpanBatch`` table -> SDK ``ReadableSpan`` objects, for
  any ``SpanExporter`` (OTLP, console, in-memory).
- ``SpanRowsBuilder``: spans given as plain values (from ``ReadableSpan``s, or decoded
  OTLP) -> one Arrow table in the store schema. Attributes with a typed column
  (``ATTRIBUTE_COLUMNS``) land there; every other attribute goes to
  ``extra_attributes`` as a string (sequences as JSON).

OTel attribute values are scalars or flat arrays, so three columns are encoded:
``kvtrace.request.prefill_chunks`` as a flat int array of (start_ns, end_ns, num_tokens)
triples, and the uint64 fingerprints as the int64 with the same bits.
"""

from __future__ import annotations

import base64
import decimal
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, Status, StatusCode, TraceFlags, TraceState

from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.instrument.batch import BATCH_SCHEMA, conform
from kvtrace.names import shown_value
from kvtrace.store.clickhouse.span_rules import ATTRIBUTE_OF, span_problem
from kvtrace.store.schema import (
    ATTRIBUTE_COLUMNS,
    CACHE_READ_OF,
    GENAI_CACHE_READ,
    MAX_SPAN_COUNT,
    RUN_ID_RESOURCE_KEY,
    SEQ_ATTRIBUTE,
    SOURCES,
    SPAN_COLUMN_DEFS,
    SPAN_REQUEST,
    SUMMED_COUNTS,
    TIME_OFFSET_RESOURCE_KEY,
)

# Resource keys kvtrace's own spans do not store per row: the run id and service name have
# columns; the SDK's self-description repeats on every row (a third of the append cost)
# and service.instance.id is a random UUID per process, which would break determinism.
_UNSTORED_RESOURCE_PREFIXES = ("telemetry.sdk.", "service.instance.id", "service.name", RUN_ID_RESOURCE_KEY,
                               TIME_OFFSET_RESOURCE_KEY)


def stored_resource_items(attrs: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The resource attributes kvtrace stores per row for its own spans (often none)."""
    return [(k, attribute_text(v)) for k, v in attrs.items() if not k.startswith(_UNSTORED_RESOURCE_PREFIXES)]


_TYPES = {f.name: f.type for f in BATCH_SCHEMA}
_MASK64 = (1 << 64) - 1
_SIGN64 = 1 << 63
# what each integer column can hold: uint64 fingerprints also take their signed form
_INT_RANGE = {pa.int64(): (-_SIGN64, _SIGN64 - 1), pa.int32(): (-(1 << 31), (1 << 31) - 1),
              pa.uint64(): (-_SIGN64, _MASK64)}
_MIN_VALUE = {c.name: c.min_value for c in SPAN_COLUMN_DEFS if c.min_value is not None}
_MAX_VALUE = {c.name: c.max_value for c in SPAN_COLUMN_DEFS if c.max_value is not None}


class UnstorableValue(KVTraceError):
    """A span value its store column cannot hold: an integer beyond the column's range, a
    NaN or infinity in a number column, a time past 2^63 ns. Nothing of the span is kept."""

KIND_NAMES = {
    SpanKind.INTERNAL: None,  # NULL = Internal
    SpanKind.SERVER: "Server",
    SpanKind.CLIENT: "Client",
    SpanKind.PRODUCER: "Producer",
    SpanKind.CONSUMER: "Consumer",
}
_KIND_BY_NAME = {v: k for k, v in KIND_NAMES.items() if v}
STATUS_NAMES = {StatusCode.UNSET: "Unset", StatusCode.OK: "Ok", StatusCode.ERROR: "Error"}
_STATUS_BY_NAME = {v: k for k, v in STATUS_NAMES.items()}


# --- column value <-> attribute value ----------------------------------------------------------
def _to_signed(v: int) -> int:
    return v - (1 << 64) if v & _SIGN64 else v


def _chunks_to_flat(v: list[dict]) -> tuple[int, ...]:
    return tuple(x for c in v for x in (c["start_ns"], c["end_ns"], c["num_tokens"]))


def _attr_encoder(column: str):
    t = _TYPES[column]
    if column == "prefill_chunks":
        return _chunks_to_flat
    if t == pa.uint64():
        return _to_signed
    if pa.types.is_list(t):
        return tuple
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fits(key: str, column: str, values: Sequence[int]) -> None:
    t = _TYPES[column]
    if column == "prefill_chunks":  # a list of int64 structs, given flat
        t = pa.int64()
    lo, hi = _INT_RANGE[t.value_type if pa.types.is_list(t) else t]
    lo = max(lo, _MIN_VALUE.get(column, lo))  # (times, steps, durations: never negative)
    if values and not (lo <= min(values) and max(values) <= hi):
        bad = next(v for v in values if not lo <= v <= hi)
        raise UnstorableValue(f"{key}: {bad} does not fit the store's {column} column ({lo} to {hi})"[:300])
    if column in SUMMED_COUNTS:  # (2^62 input tokens or preemptions in three spans: every reader said damaged)
        counts = values[2::3] if column == "prefill_chunks" else values  # (a chunk's third value: its tokens)
        if counts and max(counts) > MAX_SPAN_COUNT:
            raise UnstorableValue(f"{key}: {max(counts)} is more than a span may count (at most "
                                  f"{MAX_SPAN_COUNT:,}, so the store's sums over a run fit int64)"[:300])


def _floats(key: str, values: Sequence[int | float], column: str | None = None) -> list[float]:
    try:
        out = [float(x) for x in values]
    except OverflowError:  # an int beyond any double
        out = [math.inf]
    if not all(map(math.isfinite, out)):
        raise UnstorableValue(f"{key}: NaN, infinity and numbers beyond a double cannot be stored as numbers")
    lo, hi = _MIN_VALUE.get(column or "", -math.inf), _MAX_VALUE.get(column or "", math.inf)
    if out and not (lo <= min(out) and max(out) <= hi):  # (an ITL percentile of -1 ns, a pool 150% used)
        bad = next(v for v in out if not lo <= v <= hi)
        raise UnstorableValue(f"{key}: {bad!r} does not fit the store's {column} column ({lo:g} to {hi:g})"[:300])
    return out


# The OpenTelemetry Collector's ClickHouse exporter keeps every attribute as the text pdata's
# ``AsString`` spells it: a value's type is lost there (the double 7.0 is "7", the int 7 and
# the string "7" alike), and its views take into a typed column what that text spells
# (``store/clickhouse/collector.py``, ``_value_ok``). `kvtrace collect` takes the same values
# the same way (``_column_value``), so a sender's spans read the same numbers whichever path
# stored them: an integral double or a decimal string in an integer column, a number's string in
# a number column, any scalar's text in a text column. A value of another kind that does not fit
# is kept as an extra attribute, as there.
_DECIMAL_TEXT = re.compile(r"-?[0-9]{1,40}")
_NUMBER_TEXT = re.compile(r"-?[0-9]+(?:[.][0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _go_float(f: float) -> str:
    """A finite double as Go's encoding/json and pdata's AsString spell it (ES6: "7" for 7.0,
    exponents below 1e-6 and from 1e21)."""
    if f == 0:
        return "0" if math.copysign(1.0, f) > 0 else "-0"
    text = repr(f)
    if 1e-6 <= abs(f) < 1e21:
        if "e" in text:
            text = format(decimal.Decimal(text), "f")
        return text.removesuffix(".0")
    mantissa, _, exp = text.partition("e")
    power = int(exp) if exp else 0
    if not exp:  # (repr spells 1e16 to 1e21 without one)
        digits = mantissa.removesuffix(".0").lstrip("-")
        power = len(digits) - 1
        mantissa = ("-" if f < 0 else "") + (digits[0] + "." + digits[1:].rstrip("0")).rstrip(".")
    return f"{mantissa.removesuffix('.0')}e{'+' if power >= 0 else '-'}{abs(power)}"


def exporter_text(v: Any) -> str | None:
    """A scalar attribute value as the ClickHouse exporter stores it (pdata's AsString); None
    for an array, a map or bytes (JSON and base64 there) and a NaN or infinity."""
    if isinstance(v, str):
        return v
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _go_float(v) if math.isfinite(v) else None
    return None


def unsupported_text(f: float) -> str:
    """A NaN or infinity as pdata's AsString spells it (Go's encoding/json error: the
    exporter stores "json: unsupported value: NaN" in the attribute's place)."""
    return f"json: unsupported value: {'NaN' if f != f else ('+Inf' if f > 0 else '-Inf')}"


_UNSUPPORTED_TEXTS = frozenset(map(unsupported_text, (math.nan, math.inf, -math.inf)))


def _int_of(v: Any) -> int | None:
    """The integer a non-int scalar's exporter text spells (7.0, "7"), else None."""
    text = exporter_text(v) if isinstance(v, (float, str)) else None
    return int(text) if text is not None and _DECIMAL_TEXT.fullmatch(text) else None


def _fit(column: str, values: Sequence[int]) -> bool:
    """Whether ``_fits`` takes these values (without raising)."""
    try:
        _fits("", column, values)
    except UnstorableValue:
        return False
    return True


def _column_value(column: str, v: Any, key: str = "") -> tuple[bool, Any]:
    """Coerce an attribute value to its column's type; (False, None) when it is not of
    that type (it is then kept as text); UnstorableValue when it is but cannot be held."""
    t = _TYPES[column]
    key = key or column
    if column == "prefill_chunks":
        if isinstance(v, (list, tuple)) and len(v) % 3 == 0 and (flat := _ints(column, v, key)) is not None:
            return True, [{"start_ns": flat[i], "end_ns": flat[i + 1], "num_tokens": flat[i + 2]}
                          for i in range(0, len(flat), 3)]
        return False, None
    if pa.types.is_list(t):
        if not isinstance(v, (list, tuple)):
            return False, None
        item = t.value_type
        if pa.types.is_integer(item):
            ints = _ints(column, v, key)
            return (False, None) if ints is None else (True, ints)
        if pa.types.is_floating(item):
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                return True, _floats(key, v, column)
            return False, None
        if pa.types.is_string(item):
            return (all(isinstance(x, str) for x in v), list(v))
        return False, None
    if pa.types.is_integer(t):
        if _is_int(v):
            _fits(key, column, (v,))
        elif (n := _int_of(v)) is not None and _fit(column, (n,)):  # (7.0, "7": the exporter's "7")
            v = n
        else:
            return False, None
        return True, (v & _MASK64 if t == pa.uint64() else v)
    if pa.types.is_floating(t):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return True, _floats(key, (v,), column)[0]
        if isinstance(v, str) and _NUMBER_TEXT.fullmatch(v) and math.isfinite(x := float(v)):
            return True, _floats(key, (x,), column)[0]
        if isinstance(v, str) and v in _UNSUPPORTED_TEXTS:  # (a NaN's text, as a Go forwarder sends it: the
            _floats(key, (math.nan,))  # ClickHouse path reads it as the NaN, and leaves the span out as this refuses)
        return False, None
    if pa.types.is_string(t):
        text = exporter_text(v)  # (any scalar: the exporter's text of it; a NaN's is Go's error text)
        if text is None and isinstance(v, float):
            text = unsupported_text(v)
        return (True, text) if text is not None else (False, None)
    return False, None


def _ints(column: str, values: Sequence[Any], key: str) -> list[int] | None:
    """An integer array column's values: ints (refused as UnstorableValue where they do not
    fit), or integral doubles Go's JSON spells as integers ([1.0] is "[1]" in the exporter's
    text) where they all fit; None otherwise (kept as text)."""
    if all(map(_is_int, values)):
        _fits(key, column, values)
        return list(values)
    ints = [v if _is_int(v) else _int_of(v) if isinstance(v, float) else None for v in values]
    if any(n is None for n in ints) or not _fit(column, ints):  # type: ignore[arg-type]
        return None
    return ints  # type: ignore[return-value]


def _check_ns(what: str, ns: Any) -> None:
    if not _is_int(ns) or not 0 <= ns < _SIGN64:
        raise UnstorableValue(f"{what} {ns!r} is not a time the store holds (integer ns from 0 to 2^63 - 1)"[:300])


def _check_ids(trace_id: Any, span_id: Any, parent: Any, what: str = "") -> None:
    if not (_is_int(trace_id) and 0 <= trace_id < 1 << 128 and _is_int(span_id) and 0 <= span_id <= _MASK64
            and (parent is None or (_is_int(parent) and 0 <= parent <= _MASK64))):
        raise UnstorableValue(f"{what}ids must be a 128-bit trace id and 64-bit span ids")


_GO_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                             "\u2029": "\\u2029"})


def _go_json(v: Any) -> str:
    """Go's ``json.Marshal`` of an attribute's raw value, as pdata's AsString writes an array or
    a map: doubles as ``_go_float`` ("7" for 7.0), a map's keys sorted, bytes in base64, <, >, &
    escaped (\\u003c ...); ValueError for a NaN or infinity (Marshal fails: the text is "")."""
    if v is None or isinstance(v, bool):
        return "null" if v is None else ("true" if v else "false")
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError("NaN or infinity")
        return _go_float(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).translate(_GO_ESCAPES)
    if isinstance(v, bytes):
        return json.dumps(base64.b64encode(v).decode())
    if isinstance(v, Mapping):
        return "{" + ",".join(f"{_go_json(str(k))}:{_go_json(v[k])}" for k in sorted(v)) + "}"
    return "[" + ",".join(_go_json(x) for x in v) + "]"


def attribute_text(v: Any) -> str:
    """How an attribute without a typed column is kept: a string, as the OTel Collector's
    ClickHouse exporter writes it (pdata's AsString), so both collector paths keep the same
    text: arrays and maps as Go's JSON ("" where it fails, on a NaN; bytes in them in base64),
    an empty OTLP AnyValue (None here) as "". (Bytes alone are kept in hex.)"""
    if isinstance(v, bytes):  # (the exporter's is base64: tests/instrument/test_receiver.py holds hex here)
        return v.hex()
    if isinstance(v, (list, tuple, Mapping)):
        try:
            return _go_json(v)
        except ValueError:
            return ""
    text = exporter_text(v)  # a scalar as the exporter spells it: "7", not "7.0"
    if text is not None:
        return text
    # ("json: unsupported value: NaN", not "nan")
    return unsupported_text(v) if isinstance(v, float) else str(v)


def run_id_text(v: Any) -> str:
    """A resource ``kvtrace.run.id`` as the ClickHouse exporter stores it (pdata's AsString), so
    both collector paths name the same run or refuse it alike: a string as sent; another value
    as its text ("7" for 7, bytes in base64, an array or map as Go's JSON, "" for an AnyValue
    with no value, which names no run)."""
    if isinstance(v, bytes):
        return base64.b64encode(v).decode("ascii")
    return attribute_text(v)


def _string_map(attrs: Mapping[str, Any] | None, drop: str | None = None) -> list[tuple[str, str]] | None:
    if not attrs:
        return None
    return [(k, attribute_text(v)) for k, v in attrs.items() if k != drop]


# --- plain values -> store rows -------------------------------------------------------------
class SpanRowsBuilder:
    """Accumulates spans column by column; only the columns a span sets cost anything."""

    __slots__ = ("_cols", "full_resource", "n")

    def __init__(self, full_resource: bool = True):
        """``full_resource=False``: store only ``stored_resource_items`` (kvtrace's own
        spans, as the columnar path does); True keeps every resource attribute but the
        run id (spans received from other producers)."""
        self._cols: dict[str, list] = {}
        self.n = 0
        self.full_resource = full_resource

    def _put(self, column: str, value: Any) -> None:
        lst = self._cols.get(column)
        if lst is None:
            lst = self._cols[column] = []
        if len(lst) < self.n:
            lst.extend([None] * (self.n - len(lst)))
        lst.append(value)

    def add(
        self,
        *,
        name: str,
        trace_id: int,
        span_id: int,
        parent_span_id: int | None = None,  # None or 0: a root span
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
        resource: Mapping[str, Any] | None = None,
        scope_name: str | None = None,
        scope_version: str | None = None,
        trace_state: str | None = None,
        span_kind: str | None = None,
        status_code: str | None = None,  # None (NULL) is Unset
        status_message: str | None = None,
        events: Sequence[tuple[int, str, Mapping[str, Any] | None]] = (),
        links: Sequence[tuple[int, int, str | None, Mapping[str, Any] | None]] = (),  # (trace id, span id, ...)
        default_source: str | None = None,
    ) -> None:
        """One span. UnstorableValue (nothing of the span kept) for a value the store
        cannot hold: the caller's other spans are unaffected."""
        n = self.n
        try:
            self._add(name, trace_id, span_id, parent_span_id, start_ns, end_ns, attributes, resource, scope_name,
                      scope_version, trace_state, span_kind, status_code, status_message, events, links,
                      default_source)
        except UnstorableValue:
            self.truncate(n)
            raise

    def _value(self, column: str) -> Any:
        """This span's value of ``column`` (None when it set none)."""
        values = self._cols.get(column)
        return values[self.n] if values is not None and len(values) > self.n else None

    def _check_rules(self, name: str, extras: Sequence[tuple[str, str]] = ()) -> None:
        """UnstorableValue for a span that breaks a rule across its fields (``span_rules``, the
        one home both collector paths read): a request's times out of order, a ttft_ns other
        than its times say, gaps beyond its time, more hit tokens than were asked."""
        given = dict(extras)  # (a rule's attribute given as a value its column did not take: named so)
        problem = span_problem(name, self._value, lambda c: given.get(ATTRIBUTE_OF.get(c, "")))
        if problem is not None:
            raise UnstorableValue(problem)

    def _derived_cache_read(self, name: str, value: Any) -> bool:
        """Whether a span's GENAI_CACHE_READ is what the store derives for it (README: a
        request's hit + external hit tokens), so not stored (the DuckDB and ClickHouse paths
        alike: ``store/clickhouse/collector.py``)."""
        hits = [v for c in CACHE_READ_OF if (v := self._value(c)) is not None]
        # (as its text: the exporter's "7" of 7.0 or "7" is the alias there, and so here)
        return name == SPAN_REQUEST and bool(hits) and exporter_text(value) == str(sum(hits))

    def truncate(self, n: int) -> None:
        """Drop every span after the first ``n`` (a batch whose later span was refused)."""
        for values in self._cols.values():
            del values[n:]
        self.n = min(self.n, n)

    def _add(self, name, trace_id, span_id, parent_span_id, start_ns, end_ns, attributes, resource, scope_name,
             scope_version, trace_state, span_kind, status_code, status_message, events, links,
             default_source) -> None:
        _check_ids(trace_id, span_id, parent_span_id)
        _check_ns("start time", start_ns)
        _check_ns("end time", end_ns)
        for t, _, _ in events:
            _check_ns("event time", t)
        for t, s, _, _ in links:
            _check_ids(t, s, None, "link ")
        put = self._put
        put("trace_id_hi", trace_id >> 64)
        put("trace_id_lo", trace_id & _MASK64)
        put("span_id", span_id)
        if parent_span_id:
            put("parent_span_id", parent_span_id)
        put("name", name)
        put("start_ns", start_ns)
        put("end_ns", end_ns)
        if status_code and status_code != "Unset":
            put("status_code", status_code)
        if trace_state:
            put("trace_state", trace_state)
        if span_kind:
            put("span_kind", span_kind)
        if status_message:
            put("status_message", status_message)
        resource = resource or {}
        service = resource.get("service.name")
        if service is not None:
            put("service_name", attribute_text(service))
        if scope_name:
            put("scope_name", scope_name)
        if scope_version:
            put("scope_version", scope_version)
        if self.full_resource:
            items = [(k, attribute_text(v)) for k, v in resource.items()
                     if k not in (RUN_ID_RESOURCE_KEY, TIME_OFFSET_RESOURCE_KEY)]
        else:
            items = stored_resource_items(resource)
        if items:
            put("resource_attributes", items)
        extras = []
        attributes = attributes or {}
        cache_read: tuple[int, Any] | None = None  # (its place among the extras, the value sent)
        source = default_source
        for key, value in attributes.items():
            column = ATTRIBUTE_COLUMNS.get(key)
            if column is not None:
                if column == "source":  # one of SOURCES, else the receiver's (an int once stored NULL: "replay")
                    if value in SOURCES:
                        source = value
                        continue
                    extras.append((key, attribute_text(value)))
                    continue
                ok, coerced = _column_value(column, value, key)
                if ok:
                    put(column, coerced)
                    continue
            elif key == SEQ_ATTRIBUTE:
                continue  # the store's own seq, not stored
            elif key == GENAI_CACHE_READ:
                cache_read = (len(extras), value)
                continue
            extras.append((key, attribute_text(value)))
        if cache_read is not None and not self._derived_cache_read(name, cache_read[1]):
            extras.insert(cache_read[0], (GENAI_CACHE_READ, attribute_text(cache_read[1])))
        if source is not None:
            put("source", source)
        if extras:
            put("extra_attributes", extras)
        self._check_rules(name, extras)
        if events:
            put("events", [{"time_ns": t, "name": n, "attributes": _string_map(a)} for t, n, a in events])
        if links:
            put("links", [{"trace_id_hi": t >> 64, "trace_id_lo": t & _MASK64, "span_id": s, "trace_state": st or None,
                           "attributes": _string_map(a)} for t, s, st, a in links])
        self.n += 1

    def add_readable(self, span: ReadableSpan, default_source: str | None = None) -> None:
        ctx = span.context
        parent = span.parent
        state = ctx.trace_state.to_header() if ctx.trace_state else None
        self.add(
            name=span.name,
            trace_id=ctx.trace_id,
            span_id=ctx.span_id,
            parent_span_id=parent.span_id if parent is not None else None,
            start_ns=span.start_time or 0,
            end_ns=span.end_time or span.start_time or 0,
            attributes=span.attributes,
            resource=span.resource.attributes if span.resource is not None else None,
            scope_name=span.instrumentation_scope.name if span.instrumentation_scope else None,
            scope_version=span.instrumentation_scope.version if span.instrumentation_scope else None,
            trace_state=state or None,
            span_kind=KIND_NAMES.get(span.kind),
            status_code=STATUS_NAMES[span.status.status_code],
            status_message=span.status.description,
            events=[(e.timestamp, e.name, e.attributes) for e in span.events],
            links=[(link.context.trace_id, link.context.span_id,
                    link.context.trace_state.to_header() if link.context.trace_state else None, link.attributes)
                   for link in span.links],
            default_source=default_source,
        )

    def to_table(self, full: bool = True) -> pa.Table:
        """The spans added since the last call (the builder is then empty); ``full``: in
        the whole batch schema, else only the columns some span set. UnstorableValue
        (and the builder emptied) when a value cannot become its column."""
        n = self.n
        cols, self._cols, self.n = self._cols, {}, 0
        arrays, fields = [], []
        for column, values in cols.items():
            if len(values) < n:
                values.extend([None] * (n - len(values)))
            fields.append(pa.field(column, _TYPES[column]))
            try:
                arrays.append(pa.array(values, _TYPES[column]))
            except (pa.ArrowException, ValueError, TypeError, OverflowError) as err:  # e.g. a lone surrogate
                raise UnstorableValue(f"{column}: cannot be stored ({type(err).__name__}: {err})"[:300]) from None
        table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
        return conform(table) if full else table


def readable_spans_to_table(spans: Iterable[ReadableSpan], default_source: str | None = None,
                            full_resource: bool = False) -> pa.Table:
    rows = SpanRowsBuilder(full_resource)
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Iterable):
        raise ConfigError("readable_spans_to_table", "spans", f"expected ReadableSpans, got {shown_value(spans)}")
    for span in spans:
        if not isinstance(span, ReadableSpan):  # (an AttributeError deep in the row builder)
            raise ConfigError("readable_spans_to_table", "spans", f"expected ReadableSpans, got {shown_value(span)}")
        rows.add_readable(span, default_source)
    return rows.to_table()


# --- store rows -> ReadableSpan -------------------------------------------------------------
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def _context(hi: int, lo: int, span_id: int, state: str | None = None) -> trace_api.SpanContext:
    return trace_api.SpanContext(
        trace_id=(hi << 64) | lo, span_id=span_id, is_remote=False, trace_flags=_SAMPLED,
        trace_state=TraceState.from_header([state]) if state else None,
    )


_OFFSET_TEXT = re.compile(r"[0-9]{1,19}")  # (as the ClickHouse path's views take it: collector._ENVELOPE_PROBLEM)


def time_offset(resource: Mapping[str, Any]) -> int:
    """The offset a kvtrace OTLP export added to its span times (0 for other producers):
    an integer of ns as the exporter's text spells it (the int 500, and so the double 500.0
    and the string "500", all "500" in the ClickHouse exporter's table, whose views take it
    alike), anything else an UnstorableValue (a string " 1_000 ", a bool, 500.5 or "5e2":
    ``int()`` once read some of them, and shifted every time by it)."""
    value = resource.get(TIME_OFFSET_RESOURCE_KEY)
    if value is None:
        return 0
    text = exporter_text(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    if text is None or not _OFFSET_TEXT.fullmatch(text) or int(text) >= 1 << 63:
        raise UnstorableValue(f"resource {TIME_OFFSET_RESOURCE_KEY}: expected an integer of ns from 0 to 2^63, "
                              f"got {value!r}"[:200])
    return int(text)


def unshift(span: dict[str, Any], offset: int) -> dict[str, Any]:
    """Decoded span keyword arguments (``SpanRowsBuilder.add``) with the export's time
    offset taken off its start, end and event times: virtual times again."""
    if not offset:
        return span
    # a time before the offset, named as sent (it was "start time -3999 is not a time the store
    # holds": a time nobody sent, the offset unnamed)
    times = [("startTimeUnixNano", span["start_ns"]), ("endTimeUnixNano", span["end_ns"]),
             *((f"events[{i}].timeUnixNano", t) for i, (t, _, _) in enumerate(span.get("events") or ()))]
    early = next(((what, t) for what, t in times if _is_int(t) and t < offset), None)
    if early is not None:
        raise UnstorableValue(f"{early[0]}: {early[1]} is before the resource's {TIME_OFFSET_RESOURCE_KEY} {offset}, "
                              "the time the export shifted its spans by (stored less it, it would be negative)")
    out = dict(span, start_ns=span["start_ns"] - offset, end_ns=span["end_ns"] - offset)
    if span.get("events"):
        out["events"] = [(t - offset, n, a) for t, n, a in span["events"]]
    return out


def table_to_readable_spans(table: pa.Table, resource: Resource | None = None,
                            run_id: str | None = None, time_offset_ns: int = 0,
                            first_seq: int | None = None) -> list[ReadableSpan]:
    """One ``ReadableSpan`` per row. ``resource``: use it for every span (else per row).
    ``time_offset_ns`` is added to the start, end and event times (an OTLP export: see
    ``schema.TIME_OFFSET_RESOURCE_KEY``); ``first_seq``: number the spans from it in a
    ``kvtrace.seq`` attribute (their order in the run, which a collector may lose)."""
    if not isinstance(table, pa.Table):
        raise ConfigError("table_to_readable_spans", "table", f"expected a pyarrow Table of store rows, got "
                                                              f"{shown_value(table)}")
    n = table.num_rows
    cols = {c: table.column(c).to_pylist() for c in table.column_names if table.column(c).null_count < n}
    typed = [(key, cols[col], _attr_encoder(col)) for key, col in ATTRIBUTE_COLUMNS.items() if col in cols]
    none = [None] * n
    get = lambda c: cols.get(c, none)
    name_c, span_c, parent_c = get("name"), get("span_id"), get("parent_span_id")
    hi_c, lo_c = get("trace_id_hi"), get("trace_id_lo")
    state_c, kind_c, start_c, end_c = get("trace_state"), get("span_kind"), get("start_ns"), get("end_ns")
    status_c, msg_c, extra_c = get("status_code"), get("status_message"), get("extra_attributes")
    events_c, links_c = get("events"), get("links")
    res_c, service_c = get("resource_attributes"), get("service_name")
    scope_c, scope_v = get("scope_name"), get("scope_version")
    hit_c, ext_c = get("num_hit_tokens"), get("num_external_hit_tokens")
    resources: dict[tuple, Resource] = {}
    scopes: dict[tuple, InstrumentationScope] = {}
    out = []
    for i in range(n):
        attrs: dict[str, Any] = {}
        for key, values, enc in typed:
            v = values[i]
            if v is not None:
                attrs[key] = enc(v) if enc else v
        if extra_c[i]:
            for k, v in extra_c[i]:
                attrs.setdefault(k, v)
        if name_c[i] == SPAN_REQUEST and (hit_c[i] is not None or ext_c[i] is not None):
            attrs[GENAI_CACHE_READ] = (hit_c[i] or 0) + (ext_c[i] or 0)
        if first_seq is not None:
            attrs[SEQ_ATTRIBUTE] = first_seq + i
        res = resource
        if res is None:
            rkey = (tuple(res_c[i] or ()), service_c[i])
            res = resources.get(rkey)
            if res is None:
                items = dict(res_c[i] or ())
                if service_c[i] is not None:
                    items.setdefault("service.name", service_c[i])
                if run_id is not None:
                    items[RUN_ID_RESOURCE_KEY] = run_id
                res = resources[rkey] = Resource(items)
        skey = (scope_c[i], scope_v[i])
        scope = scopes.get(skey)
        if scope is None:
            scope = scopes[skey] = InstrumentationScope(scope_c[i] or "kvtrace.instrument", scope_v[i])
        parent = _context(hi_c[i], lo_c[i], parent_c[i]) if parent_c[i] else None
        status = _STATUS_BY_NAME.get(status_c[i] or "Unset", StatusCode.UNSET)
        out.append(ReadableSpan(
            name=name_c[i],
            context=_context(hi_c[i], lo_c[i], span_c[i], state_c[i]),
            parent=parent,
            resource=res,
            attributes=attrs,
            events=[Event(e["name"], dict(e["attributes"] or ()), e["time_ns"] + time_offset_ns) for e in events_c[i]]
            if events_c[i] else (),
            links=[trace_api.Link(_context(lk["trace_id_hi"], lk["trace_id_lo"], lk["span_id"], lk["trace_state"]),
                                  dict(lk["attributes"] or ()) or None)
                   for lk in links_c[i]] if links_c[i] else (),
            kind=_KIND_BY_NAME.get(kind_c[i], SpanKind.INTERNAL),
            status=Status(status, msg_c[i] if status is StatusCode.ERROR else None),
            start_time=start_c[i] + time_offset_ns,
            end_time=end_c[i] + time_offset_ns,
            instrumentation_scope=scope,
        ))
    return out
