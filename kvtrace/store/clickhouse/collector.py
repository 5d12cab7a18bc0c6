"""Spans an OpenTelemetry Collector wrote: its ClickHouse exporter's ``otel_traces``, read
into kvtrace's typed tables by materialised views.

The exporter stores every span attribute as a string in ``SpanAttributes`` (arrays as
JSON, like pdata's ``AsString``) and the resource in ``ResourceAttributes``. A materialised
view (an insert trigger on ``otel_traces``) parses each inserted block once into
``otel_checked`` (a Null table: typed values, and why `kvtrace collect` would refuse each
span), and one view per family table takes from there the typed columns the DuckDB store
has, so the read API, the dashboard and ``diff`` read collector-fed runs from the same
tables as directly written ones:

- the run is the resource's ``kvtrace.run.id``, else ``otlp:<ServiceName>`` (a vLLM or
  LMCache service's spans beside kvtrace's); names kvtrace does not know (vLLM's
  ``llm_request``, ...) go to ``spans_other`` with their attributes in
  ``extra_attributes``, as does a typed attribute whose column cannot take its value (a
  token count of ``12.5``) and a ``kvtrace.source`` kvtrace does not know (the span's
  source is then ``otlp``), as `kvtrace collect` keeps them;
- ``seq`` is the span's ``kvtrace.seq`` (kvtrace exports number their spans: the table
  sorts rows by service, name and time), else its start time in ns;
- times stay as stored, shifted by the resource's ``kvtrace.run.time_offset_ns`` (0 for
  other producers), which every row records: the views subtract it, as for direct
  writes;
- the ``kvtrace.run`` span (a kvtrace export's run record) goes to ``otel_run_records``
  (kept for earlier kvtraces: records are read from the exporter's table, see below);
- spans naming a run of the store that no collector made (a replay's) are left out.

``attach`` creates the views (and the exporter's table, if the collector has not yet:
the same columns, no TTL) and back-fills rows already there; ``register_collected_runs``
(run by every ``Store.open``) gives each collected run its ``runs`` row and, once a
record `kvtrace collect` takes has arrived (``run_rules.run_record``, the one rule both
paths read: a record collect refuses names no run and finishes none), builds its derived
tables and takes the record's status (``incomplete`` with SPANS_MISSING while spans its
sender numbered are missing, as collect). Until then a collected run reads as
``running``: its derived tables are computed on the fly. A finished run given spans since
has its derived tables rebuilt at the next open.
"""

from __future__ import annotations

import json
from typing import Any

from kvtrace.store.backend import ClickHouseTarget
from kvtrace.store.clickhouse.schema import CHECKED_TABLE, VIEW_PREFIX
from kvtrace.store.schema import (
    CACHE_READ_OF,
    FAMILIES,
    GENAI_CACHE_READ,
    MAX_RUN_ID_CHARS,
    MAX_SENT_SEQ,
    MAX_SPAN_COUNT,
    META_TABLE,
    NUM_BLOCKS_COLUMN,
    OTHER_TABLE,
    RUN_ID_RESOURCE_KEY,
    SEQ_ATTRIBUTE,
    SOURCE_OTLP,
    SOURCES,
    SPAN_COLUMN_DEFS,
    SPAN_NAMES,
    SPAN_REQUEST,
    SPAN_RUN,
    SPAN_TABLES,
    SUMMED_COUNTS,
    TIME_OFFSET_COLUMN,
    TIME_OFFSET_RESOURCE_KEY,
    Col,
    created_now,
    named_run_name,
)

COLLECTOR_HOST = "otel-collector"  # runs.writer_host of a collected run
RUN_RECORDS = "otel_run_records"
COLLECTED_RUNS = "otel_collected_runs"
REFUSED_SPANS = "otel_refused_spans"  # spans left out of the typed tables: they break a rule `kvtrace collect` holds

# The exporter's traces table (exporter/clickhouseexporter/internal/sqltemplates/
# traces_table.sql of opentelemetry-collector-contrib, the bloom-filter variant), with
# the TTL left out: the exporter adds ``TTL toDateTime(Timestamp) + toIntervalDay(N)``
# when configured with one.
def otel_traces_ddl(table: str) -> str:
    return f"""CREATE TABLE IF NOT EXISTS {table} (
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(T64, ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (Timestamp DateTime64(9), Name LowCardinality(String),
                   Attributes Map(LowCardinality(String), String)) CODEC(ZSTD(1)),
    Links Nested (TraceId String, SpanId String, TraceState String,
                  Attributes Map(LowCardinality(String), String)) CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1
) ENGINE = MergeTree()
PARTITION BY toDate(Timestamp)
PRIMARY KEY (ServiceName, SpanName, toDateTime(Timestamp))
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp), Timestamp)
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1"""


def _q(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


_RUN_ID = ("if(ResourceAttributes['kvtrace.run.id'] != '', ResourceAttributes['kvtrace.run.id'], "
           "concat('otlp:', ServiceName))")
_OFFSET = f"toInt64OrZero(ResourceAttributes[{_q(TIME_OFFSET_RESOURCE_KEY)}])"
_HEX64 = "reinterpretAsUInt64(reverse(unhex({0})))"
_STR_MAP = "Map(String, String)"
_ENVELOPE = {
    "run_id": _RUN_ID,
    "trace_id_hi": _HEX64.format("substring(TraceId, 1, 16)"),
    "trace_id_lo": _HEX64.format("substring(TraceId, 17, 16)"),
    "span_id": _HEX64.format("SpanId"),
    "parent_span_id": f"if(ParentSpanId IN ('', repeat('0', 16)), NULL, {_HEX64.format('ParentSpanId')})",
    "trace_state": "nullIf(TraceState, '')",
    "name": "SpanName",
    "span_kind": "if(SpanKind IN ('Internal', 'Unspecified', ''), NULL, SpanKind)",
    "start_ns": "toUnixTimestamp64Nano(Timestamp)",
    "end_ns": "toUnixTimestamp64Nano(Timestamp) + toInt64(Duration)",
    "status_code": "if(StatusCode IN ('Unset', ''), NULL, StatusCode)",
    "status_message": "nullIf(StatusMessage, '')",
    "service_name": "nullIf(ServiceName, '')",
    "scope_name": "nullIf(ScopeName, '')",
    "scope_version": "nullIf(ScopeVersion, '')",
    # kvtrace's own spans (a run id) keep what its columnar path keeps: not the SDK's
    # self-description nor the per-process instance id
    "resource_attributes": (f"CAST(mapFilter((k, v) -> k NOT IN ('service.name', 'kvtrace.run.id', "
                            f"{_q(TIME_OFFSET_RESOURCE_KEY)}) AND NOT (ResourceAttributes['kvtrace.run.id'] != '' "
                            "AND (startsWith(k, 'telemetry.sdk.') OR k = 'service.instance.id')), "
                            f"ResourceAttributes) AS {_STR_MAP})"),
    "events": ("arrayMap((t, n, a) -> CAST((toUnixTimestamp64Nano(t), n, a), 'Tuple(time_ns Nullable(Int64), "
               f"name Nullable(String), attributes {_STR_MAP})'), `Events.Timestamp`, `Events.Name`, "
               "`Events.Attributes`)"),
    "links": (f"arrayMap((t, s, st, a) -> CAST(({_HEX64.format('substring(t, 1, 16)')}, "
              f"{_HEX64.format('substring(t, 17, 16)')}, {_HEX64.format('s')}, nullIf(st, ''), a), "
              "'Tuple(trace_id_hi Nullable(UInt64), trace_id_lo Nullable(UInt64), span_id Nullable(UInt64), "
              f"trace_state Nullable(String), attributes {_STR_MAP})'), `Links.TraceId`, `Links.SpanId`, "
              "`Links.TraceState`, `Links.Attributes`)"),
    "seq": f"coalesce(toInt64OrNull(SpanAttributes[{_q(SEQ_ATTRIBUTE)}]), toUnixTimestamp64Nano(Timestamp))",
    TIME_OFFSET_COLUMN: _OFFSET,
}
# Why `kvtrace collect` would refuse the span whatever its attributes ('' where it would not:
# ``otlp/decode.py``, ``convert._check_ids``, ``time_offset``, ``unshift``): ids that are no
# ids (all zeros, or not hex: they were stored as span 0), an end before its start (a Duration
# the exporter wrapped past 2^63), a resource offset that is no integer of ns (" 1_000 " was read
# as 0) or one after the span's start (its times would be negative), a resource run id that cannot
# name a run (``schema.run_id_problem``: it was stored, and listed by ``runs`` as a line break or
# a blank no one could type back)
_HEX = "^[0-9a-fA-F]{{{0}}}$"
_RUN_ID_TEXT = f"ResourceAttributes[{_q(RUN_ID_RESOURCE_KEY)}]"
# ``run_id_problem``'s characters in re2's classes: Unicode's C (control, format, private use) and Z
# (separators) and \s are what str.isprintable and str.isspace refuse, but for code points Python's
# Unicode tables leave unassigned (Cn), which re2 has no class for: those are taken here
_RUN_ID_REFUSED_CHARS = r"[\\p{C}\\p{Z}\\s]"


def run_id_refused_sql(text: str) -> str:
    """SQL, true where the String ``text`` cannot name a run (``schema.run_id_problem``)."""
    return (f"(NOT isValidUTF8({text}) OR lengthUTF8({text}) NOT BETWEEN 1 AND {MAX_RUN_ID_CHARS} "
            f"OR match({text}, '{_RUN_ID_REFUSED_CHARS}'))")


_UNSUPPORTED = tuple(f"json: unsupported value: {v}" for v in ("NaN", "+Inf", "-Inf"))  # (convert.unsupported_text)
_OFFSET_TEXT = f"ResourceAttributes[{_q(TIME_OFFSET_RESOURCE_KEY)}]"
# Every string of a span is UTF-8 text: `kvtrace collect`'s protobuf decoder refuses another (a 400), and the
# exporter, which does not check, wrote its bytes, which no reader of the store could read: every open of
# the store failed (a Rust panic in polars) on a record's, and a span's failed each read of its run
_UTF8_MAPS = ("SpanAttributes", "ResourceAttributes")
_ALL_UTF8 = ("isValidUTF8(concat(SpanName, ServiceName, ScopeName, ScopeVersion, TraceState, StatusMessage, SpanKind, "
             "StatusCode))"
             + "".join(f" AND arrayAll(_s -> isValidUTF8(_s), arrayConcat(mapKeys({m}), mapValues({m})))"
                       for m in _UTF8_MAPS)
             + " AND arrayAll(_s -> isValidUTF8(_s), `Events.Name`)"
             + "".join(f" AND arrayAll(_a -> arrayAll(_s -> isValidUTF8(_s), arrayConcat(mapKeys(_a), mapValues(_a))), "
                       f"`{c}.Attributes`)" for c in ("Events", "Links"))
             + " AND arrayAll(_s -> isValidUTF8(_s), `Links.TraceState`)")


def _wire_sql(text: str) -> str:
    """SQL: a String quoted as collect's refusal quotes a string value (``decode._wire``, within
    some 40 characters)."""
    quoted = f"concat('''', {text}, '''')"
    return (f"if(lengthUTF8({quoted}) <= 40, {quoted}, concat(substringUTF8({quoted}, 1, 24), '... (', "
            f"toString(lengthUTF8({quoted})), ' characters)'))")


# A resource attribute key given twice with two values, which `kvtrace collect` refuses (its decoder's
# ``_put_unique``: a 400, nothing of the request stored) and the exporter's map keeps twice: its first
# such key ('' where none) and that key's values. Its spans were filed under the run its first
# ``kvtrace.run.id`` named (a resource naming runs a and b: collect refused it, this path filed it under
# a), shifted by its first offset; they and its record are left out, as collect's other refusals are
_RESOURCE_TWICE_KEY = ("arrayFirst(_k -> length(arrayDistinct(arrayFilter((_v, _kk) -> _kk = _k, "
                       "mapValues(ResourceAttributes), mapKeys(ResourceAttributes)))) > 1, "
                       "mapKeys(ResourceAttributes))")
_RESOURCE_TWICE_VALUES = (f"arrayDistinct(arrayFilter((_v, _kk) -> _kk = {_RESOURCE_TWICE_KEY}, "
                          "mapValues(ResourceAttributes), mapKeys(ResourceAttributes)))")
_RESOURCE_TWICE = (  # (its keys counted first: the search is quadratic in them, and runs on every row)
    f"length(arrayDistinct(mapKeys(ResourceAttributes))) != length(mapKeys(ResourceAttributes)) "
    f"AND {_RESOURCE_TWICE_KEY} != ''",
    f"substringUTF8(concat('resource: attribute ', {_wire_sql(_RESOURCE_TWICE_KEY)}, ' given twice, as ', "
    f"{_wire_sql(f'{_RESOURCE_TWICE_VALUES}[1]')}, ' and ', {_wire_sql(f'{_RESOURCE_TWICE_VALUES}[2]')}, "
    "' (an attribute key is unique)'), 1, 300)")
_NOT_UTF8_WHY = "a string that is no UTF-8 text: not an ExportTraceServiceRequest"
_IDS_PROBLEMS = (  # (condition, reason) of the envelope's ids and times, read by collect's decoder of every span
    f"NOT ({_ALL_UTF8})", _q(_NOT_UTF8_WHY),
    *_RESOURCE_TWICE,
    f"NOT match(TraceId, {_q(_HEX.format(32))}) OR TraceId = repeat('0', 32)",
    "'TraceId: not a trace id (32 hex digits, not all zeros)'",
    f"NOT match(SpanId, {_q(_HEX.format(16))}) OR SpanId = repeat('0', 16)",
    "'SpanId: not a span id (16 hex digits, not all zeros)'",
    f"ParentSpanId != '' AND NOT match(ParentSpanId, {_q(_HEX.format(16))})",
    "'ParentSpanId: not a span id (16 hex digits)'",
    "Duration >= 9223372036854775808", "'the span ends before it starts'")
_RUN_ID_PROBLEM = (
    f"mapContains(ResourceAttributes, {_q(RUN_ID_RESOURCE_KEY)}) AND {run_id_refused_sql(_RUN_ID_TEXT)}",
    f"'resource {RUN_ID_RESOURCE_KEY}: expected 1 to {MAX_RUN_ID_CHARS} printable characters without spaces'")
# A named run's span's kvtrace.seq (its place in its run) that `kvtrace collect` refuses (``_sent_seq``: a
# whole number from 0 to 2^62 - 1, read as the exporter's text; one value): -5 or 2^62 was stored at that
# seq here, 'x' or 1.5 at its start time, and of two values the first taken
_SEQ_TEXT = f"SpanAttributes[{_q(SEQ_ATTRIBUTE)}]"
_SEQ_PROBLEM = (
    f"{_RUN_ID_TEXT} != '' AND length(arrayDistinct(arrayFilter((_v, _k) -> _k = {_q(SEQ_ATTRIBUTE)}, "
    "mapValues(SpanAttributes), mapKeys(SpanAttributes)))) > 1",
    _q(f"attribute {SEQ_ATTRIBUTE!r} given twice with two values (an attribute key is unique)"),
    f"{_RUN_ID_TEXT} != '' AND mapContains(SpanAttributes, {_q(SEQ_ATTRIBUTE)}) AND NOT (match({_SEQ_TEXT}, "
    f"'^[0-9]{{1,19}}$') AND toInt128OrNull({_SEQ_TEXT}) <= {MAX_SENT_SEQ})",
    _q(f"{SEQ_ATTRIBUTE}: expected an integer from 0 to 2^62 - 1 (the span's place in its run)"))
_ENVELOPE_PROBLEM = (
    "multiIf(" + ", ".join(_IDS_PROBLEMS) + ", "
    f"mapContains(ResourceAttributes, {_q(TIME_OFFSET_RESOURCE_KEY)}) "
    f"AND NOT (match({_OFFSET_TEXT}, '^[0-9]{{1,19}}$') AND toInt128OrNull({_OFFSET_TEXT}) < 9223372036854775808), "
    f"'resource {TIME_OFFSET_RESOURCE_KEY}: not an integer of ns from 0 to 2^63', "
    f"toUnixTimestamp64Nano(Timestamp) < {_OFFSET}, 'the span starts before the resource''s "
    f"{TIME_OFFSET_RESOURCE_KEY}', "
    + ", ".join(_RUN_ID_PROBLEM) + ", " + ", ".join(_SEQ_PROBLEM) + ", "
    # a NaN or infinity in a number column (the exporter's text of it: Go's encoding/json error),
    # which collect refuses (``convert._floats``) whatever the span's name: it was kept as an extra
    + "".join(f"SpanAttributes[{_q(c.attr)}] IN ({', '.join(map(_q, _UNSUPPORTED))}), "
              f"{_q(f'{c.attr}: NaN, infinity and numbers beyond a double cannot be stored as numbers')}, "
              for c in SPAN_COLUMN_DEFS if c.attr and c.sql == "DOUBLE")
    + "'')")
# Why `kvtrace collect` would refuse a ``kvtrace.run`` record whatever its attributes: its ids, its
# times, its run id (the decoder's checks and ``_named_run``), not its times against the resource's
# offset nor its number columns, which collect reads of spans alone (a record is stored as no span)
_RECORD_ENVELOPE_PROBLEM = "multiIf(" + ", ".join((*_IDS_PROBLEMS, *_RUN_ID_PROBLEM)) + ", '')"
_CHUNK = "Tuple(start_ns Nullable(Int64), end_ns Nullable(Int64), num_tokens Nullable(Int64))"


_INT_RANGE = {"BIGINT": (-(1 << 63), (1 << 63) - 1), "UBIGINT": (-(1 << 63), (1 << 63) - 1),  # (its int64 form)
              "INTEGER": (-(1 << 31), (1 << 31) - 1)}
_DECIMAL = "^-?[0-9]{1,40}$"
_NUMBER = "^-?[0-9]+([.][0-9]+)?([eE][+-]?[0-9]+)?$"  # (a JSON number's spelling: not "inf", " 7")


_COLUMN = {c.name: c for c in SPAN_COLUMN_DEFS}


def _bounds(column: str, duck: str) -> tuple[int, int, int]:
    """(least, greatest, greatest count) an integer column takes, as `kvtrace collect` checks
    it (``instrument.convert._fits``): the type's range, no less than its min_value, and a
    summed count no more than MAX_SPAN_COUNT."""
    col = _COLUMN[column]
    lo, hi = _INT_RANGE["BIGINT" if column == "prefill_chunks" else duck.removesuffix("[]")]
    if col.min_value is not None:
        lo = max(lo, col.min_value)
    return lo, hi, (min(hi, MAX_SPAN_COUNT) if column in SUMMED_COUNTS else hi)


def _int_ok(x: str, lo: int, hi: int) -> str:
    return f"(match({x}, {_q(_DECIMAL)}) AND toInt128OrNull({x}) BETWEEN {lo} AND {hi})"


def _value_ok(column: str, duck: str, x: str) -> str | None:
    """SQL: whether the exporter's string ``x`` is a value `kvtrace collect` takes into this
    column: of its type (an int array of ints, not of 1.5 or true; a number column's number,
    not "12.5" nor " 7") and one it can hold (its range, min_value and MAX_SPAN_COUNT, where
    collect refuses the span). None: any string (a text column)."""
    if duck == "VARCHAR":
        return None
    col = _COLUMN[column]
    if duck == "DOUBLE":
        return f"(match({x}, {_q(_NUMBER)}) AND {_float_ok(col, x)})"
    lo, hi, most = _bounds(column, duck) if "INT" in duck or column == "prefill_chunks" else (0, 0, 0)
    if not (duck.endswith("[]") or column == "prefill_chunks"):
        return _int_ok(x, lo, most)
    raw = f"JSONExtractArrayRaw({x})"
    if duck == "VARCHAR[]":
        each = f"arrayAll(_r -> JSONType(_r) = 'String', {raw})"
    elif duck == "DOUBLE[]":
        each = f"arrayAll(_r -> JSONType(_r) IN ('Int64', 'UInt64', 'Double') AND {_float_ok(col, '_r')}, {raw})"
    elif column == "prefill_chunks":  # a flat (start, end, tokens) int array: every third value a count
        each = (f"length({raw}) % 3 = 0 AND arrayAll((_r, _i) -> {_int_ok('_r', lo, hi)} AND "
                f"(_i % 3 != 0 OR toInt128OrNull(_r) <= {most}), {raw}, arrayEnumerate({raw}))")
    else:
        each = f"arrayAll(_r -> {_int_ok('_r', lo, most)}, {raw})"
    return f"(isValidJSON({x}) AND JSONType({x}) = 'Array' AND {each})"


def _float_ok(col: Col, x: str) -> str:
    """SQL: whether the number ``x`` spells is finite and within the column's bounds (its
    ``min_value`` and ``max_value``), as `kvtrace collect` takes it (``convert._floats``)."""
    bounds = "".join(f" AND toFloat64OrNull({x}) {op} {v!r}" for op, v in ((">=", col.min_value),
                                                                              ("<=", col.max_value)) if v is not None)
    return f"isFinite(toFloat64OrNull({x})){bounds}"


def _single(key: str) -> str:
    """SQL: whether the span gives ``key`` one value (the exporter's map keeps a key given
    twice twice; `kvtrace collect` refuses two values, takes one value given twice)."""
    k = _q(key)
    return (f"(countEqual(mapKeys(SpanAttributes), {k}) <= 1 OR length(arrayDistinct(arrayFilter((_v, _k) -> "
            f"_k = {k}, mapValues(SpanAttributes), mapKeys(SpanAttributes)))) = 1)")


# --- the views ---------------------------------------------------------------------------------
# Every rule is read once per inserted block: a first view (the gate) takes the exporter's rows
# into ``otel_checked``, a Null table (it keeps nothing), with each typed attribute's value and
# whether its column takes it, and why `kvtrace collect` would refuse the span ('' where it
# would not); the views filling kvtrace's tables read those. Each view had read every rule of
# the exporter's strings itself: ClickHouse planned some 0.3 MB of SQL at every insert (0.8 s
# on chdb for a block of one span) and at each new store.
_RAW = ("Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState", "SpanName", "SpanKind", "ServiceName",
        "ResourceAttributes", "ScopeName", "ScopeVersion", "SpanAttributes", "Duration", "StatusCode",
        "StatusMessage", *(f"`{n}.{f}`" for n, fs in (("Events", ("Timestamp", "Name", "Attributes")),
                                                      ("Links", ("TraceId", "SpanId", "TraceState", "Attributes")))
                           for f in fs))
_TYPED = tuple(c for c in SPAN_COLUMN_DEFS if c.attr)  # the columns of typed attributes (spans_other has them all)


# The span's attribute keys given twice with two values (``_single`` fails for them), once per span
_TWICE = ("if(length(arrayDistinct(mapKeys(SpanAttributes))) = length(mapKeys(SpanAttributes)), "
          "CAST([] AS Array(String)), arrayFilter(_k -> length(arrayDistinct(arrayFilter((_v, _kk) -> _kk = _k, "
          "mapValues(SpanAttributes), mapKeys(SpanAttributes)))) > 1, arrayDistinct(mapKeys(SpanAttributes)))) "
          "AS _twice")


def _taken_flag(column: str) -> str:
    """``otel_checked``'s column: whether the span's attribute of ``column`` is one value the
    column takes (then it is no extra attribute)."""
    return f"`_taken_{column}`"


def _taken_sql(column: str, key: str, duck: str) -> str:
    """SQL: whether the span gives the attribute ``key`` once (or one value twice) as a value
    `kvtrace collect` takes into the column (``_value_ok``). A value it does not take is kept in
    ``extra_attributes``: ``12.5`` or ``true`` of a token count, ``[1.5]`` or ``zzz`` of block
    ids (`kvtrace collect` keeps a value of another type there), and ``-5`` tokens or a key
    given twice with two values (collect refuses the span; this path, whose exporter took it,
    keeps the value where it is read as the sender's, not as a count)."""
    ok = _value_ok(column, duck, f"SpanAttributes[{_q(key)}]")
    return f"mapContains(SpanAttributes, {_q(key)}) AND NOT has(_twice, {_q(key)})" + (f" AND {ok}" if ok else "")


def _typed_sql(column: str, key: str, duck: str) -> str:
    """SQL: the column's value of the exporter's attribute string where the column takes it
    (its ``_taken_flag``), else NULL (an array column: empty)."""
    v, taken = f"SpanAttributes[{_q(key)}]", _taken_flag(column)
    if column == "prefill_chunks":
        flat = f"if({taken}, JSONExtract({v}, 'Array(Int64)'), [])"
        return (f"arrayMap(i -> CAST(({flat}[3 * i + 1], {flat}[3 * i + 2], {flat}[3 * i + 3]), '{_CHUNK}'), "
                f"range(intDiv(length({flat}), 3)))")
    if duck.endswith("[]"):
        inner = {"BIGINT": "Int64", "VARCHAR": "String", "DOUBLE": "Float64"}[duck[:-2]]
        return f"if({taken}, JSONExtract({v}, 'Array({inner})'), [])"
    parsed = {"BIGINT": f"toInt64OrNull({v})", "INTEGER": f"toInt32OrNull({v})", "DOUBLE": f"toFloat64OrNull({v})",
              "UBIGINT": f"CAST(toInt64OrNull({v}) AS Nullable(UInt64))",  # sent as the int64 of the same bits
              "VARCHAR": v}[duck]
    return f"if({taken}, {parsed}, NULL)"


# A span naming a run of the store that no collector made (a replay's or a capture's: its mode is
# not otlp), which `kvtrace collect` refuses (a 400: nothing is added to it): its spans were added
# to the replay's here, and every view of the run counted them (11 requests of a replay of 10)
_NOT_COLLECTED = f"({_RUN_ID} IN (SELECT run_id FROM runs WHERE mode != 'otlp'))"
_NOT_COLLECTED_WHY = (f"'resource {RUN_ID_RESOURCE_KEY}: a run of this store that no collector made: nothing is "
                      "added to it'")


def _refusal_sql() -> str:
    """SQL over ``otel_checked``'s typed columns: why `kvtrace collect` would refuse the span, ''
    where it would not: the envelope's problems (``_envelope``), a run no collector made, and
    the rules across its fields (``span_rules``) of its span name, over the typed values and
    its times less the run's offset."""
    from kvtrace.store.clickhouse.span_rules import RULED_SPANS, span_problem_sql

    start = f"(toUnixTimestamp64Nano(Timestamp) - {_OFFSET})"
    times = {"start_ns": start, "end_ns": f"({start} + toInt64(Duration))"}
    attr = {c.name: c.attr or "" for c in _TYPED}
    column = lambda c: times.get(c) or f"`{c}`"
    sent = lambda c: f"mapContains(SpanAttributes, {_q(attr[c])})"
    ruled = [(n, sql) for n in RULED_SPANS if (sql := span_problem_sql(n, column, sent)) is not None]
    return (f"multiIf(_envelope != '', _envelope, {_NOT_COLLECTED}, {_NOT_COLLECTED_WHY}, "
            + "".join(f"SpanName = {_q(n)}, {p}, " for n, p in ruled) + "'')")


def checked_select(otel_table: str) -> str:
    """The gate's SELECT over the exporter's table: its rows, each typed attribute's
    ``_taken_`` flag and value, and ``_reason`` (``_refusal_sql``)."""
    raw = ", ".join(_RAW)
    flags = ", ".join(_taken_flag(c.name) for c in _TYPED)
    typed = ", ".join(f"`{c.name}`" for c in _TYPED)
    flagged = ", ".join(f"{_taken_sql(c.name, c.attr or '', c.sql)} AS {_taken_flag(c.name)}" for c in _TYPED)
    values = ", ".join(f"{_typed_sql(c.name, c.attr or '', c.sql)} AS `{c.name}`" for c in _TYPED)
    first = f"SELECT {raw}, {flagged}, {_ENVELOPE_PROBLEM} AS _envelope FROM (SELECT {raw}, {_TWICE} FROM {otel_table})"
    second = f"SELECT {raw}, {flags}, _envelope, {values} FROM ({first})"
    return f"SELECT {raw}, {flags}, {typed}, {_refusal_sql()} AS _reason FROM ({second})"


def _family_select(table: str, source: str) -> tuple[str, str]:
    """(column list, SELECT over ``otel_checked`` or ``source``, a subquery of its rows)
    filling one family table with the spans `kvtrace collect` would store."""
    from kvtrace.store.clickhouse.schema import stored_columns

    typed = {c.name: c for c in _TYPED}
    columns = stored_columns(table)
    exprs: list[str] = []
    taken = [f"k = {_q(SEQ_ATTRIBUTE)}"]  # (the attributes that are no extra: the store's own seq, and below)
    sources = f"({', '.join(map(_q, SOURCES))})"
    for col in columns:
        if col in _ENVELOPE:
            exprs.append(_ENVELOPE[col])
        elif col == "source":  # (a source kvtrace does not know is the receiver's, and kept as an extra)
            one = _single("kvtrace.source")
            exprs.append(f"if({one} AND SpanAttributes['kvtrace.source'] IN {sources}, "
                         f"SpanAttributes['kvtrace.source'], {_q(SOURCE_OTLP)})")
            taken.append(f"(k = 'kvtrace.source' AND {one} AND v IN {sources})")
        elif col == "extra_attributes":
            exprs.append("{extra}")
        elif col == NUM_BLOCKS_COLUMN:
            exprs.append("toInt32(if(length(block_ids) > 0, length(block_ids), length(block_hashes)))")
        else:
            exprs.append(f"`{col}`")
            taken.append(f"(k = {_q(typed[col].attr or '')} AND {_taken_flag(col)})")
    # a request's cache-read tokens equal to its hit + external hit tokens: the alias kvtrace's
    # export sends of the columns kept (README), derived again by every reader; another value,
    # or one on another span, is the sender's and kept (as `kvtrace collect`: CACHE_READ_OF)
    taken.append(f"(k = {_q(GENAI_CACHE_READ)} AND SpanName = {_q(SPAN_REQUEST)} AND {_single(GENAI_CACHE_READ)} "
                 f"AND ({' OR '.join(f'`{h}` IS NOT NULL' for h in CACHE_READ_OF)}) "
                 f"AND v = toString({' + '.join(f'coalesce(`{h}`, 0)' for h in CACHE_READ_OF)}))")
    extra = f"CAST(mapFilter((k, v) -> NOT ({' OR '.join(taken)}), SpanAttributes) AS {_STR_MAP})"
    exprs = [e.replace("{extra}", extra) for e in exprs]
    if table == OTHER_TABLE:
        known = ", ".join(_q(n) for n in (*SPAN_NAMES, SPAN_RUN))
        where = f"SpanName NOT IN ({known})"
    else:
        where = f"SpanName IN ({', '.join(_q(n) for n in FAMILIES[table][1])})"
    cols = ", ".join(f"`{c}`" for c in columns)
    select = ", ".join(e if e == f"`{c}`" else f"{e} AS `{c}`" for e, c in zip(exprs, columns))
    return cols, f"SELECT {select} FROM {source} WHERE {where} AND _reason = ''"


def _side_tables(otel_table: str, source: str) -> list[tuple[str, str, str, str]]:
    """(table, its DDL, column list, SELECT) of the run side tables: the records' over the
    exporter's table, the others' over ``otel_checked`` or ``source`` (as ``_family_select``)."""
    return [
        (RUN_RECORDS,
         f"CREATE TABLE IF NOT EXISTS {RUN_RECORDS} (run_id String, record {_STR_MAP}, "
         f"{TIME_OFFSET_COLUMN} Int64, service_name String) ENGINE = MergeTree ORDER BY run_id",
         f"run_id, record, {TIME_OFFSET_COLUMN}, service_name",
         f"SELECT {_RUN_ID} AS run_id, CAST(SpanAttributes AS {_STR_MAP}) AS record, {_OFFSET} AS "
         f"{TIME_OFFSET_COLUMN}, ServiceName AS service_name FROM {otel_table} "
         f"WHERE SpanName = {_q(SPAN_RUN)}"),
        (REFUSED_SPANS,
         f"CREATE TABLE IF NOT EXISTS {REFUSED_SPANS} (run_id String, name String, trace_id String, span_id String, "
         "start_ns Int64, reason String) ENGINE = MergeTree ORDER BY (run_id, start_ns)",
         "run_id, name, trace_id, span_id, start_ns, reason",
         f"SELECT toValidUTF8({_RUN_ID}) AS run_id, toValidUTF8(SpanName) AS name, toValidUTF8(TraceId) AS trace_id, "
         f"toValidUTF8(SpanId) AS span_id, toUnixTimestamp64Nano(Timestamp) - {_OFFSET} AS start_ns, "
         f"_reason AS reason FROM {source} WHERE SpanName != {_q(SPAN_RUN)} AND _reason != ''"),
        (COLLECTED_RUNS,
         f"CREATE TABLE IF NOT EXISTS {COLLECTED_RUNS} (run_id String, service_name String, "
         f"{TIME_OFFSET_COLUMN} Int64) ENGINE = ReplacingMergeTree ORDER BY run_id",
         f"run_id, service_name, {TIME_OFFSET_COLUMN}",
         # (a refused span names no run: `kvtrace collect` stores no run of a refused request, and a
         # run id that cannot name one was listed by `runs` as typed; a run of spans refused by a rule
         # across their fields, hits beyond the prompt, was listed 'running' with no span. A run's
         # record names it, as `kvtrace collect` makes the run of a record alone: a replay stopped
         # before its first span sends its 'failed' record alone, which collect listed and this path not)
         f"SELECT DISTINCT {_RUN_ID} AS run_id, ServiceName AS service_name, {_OFFSET} AS {TIME_OFFSET_COLUMN} "
         f"FROM {source} WHERE _reason = ''"),
    ]


VIEWS_VERSION_KEY = "collector_views"  # kvtrace_meta: a digest of the views' SQL the store was last given


def _views(src: str) -> list[tuple[str, str, str, str]]:
    """(view, the table it fills, column list, SELECT) of every view, the gate first."""
    gate = checked_select(src)
    views = [(f"{VIEW_PREFIX}{CHECKED_TABLE}", CHECKED_TABLE, "", gate)]
    views += [(f"{VIEW_PREFIX}{t}", t, *_family_select(t, CHECKED_TABLE)) for t in SPAN_TABLES]
    views += [(f"{VIEW_PREFIX}{t}", t, cols, select) for t, _, cols, select in _side_tables(src, CHECKED_TABLE)]
    return views


def attach(con, target: ClickHouseTarget) -> None:
    """The exporter's table (if missing), ``otel_checked`` and the views from them into
    kvtrace's tables; rows the exporter's table held before a view existed are copied once.
    A store whose views an earlier kvtrace made (its digest in ``kvtrace_meta`` not this
    one's) has each one's query replaced in place (``MODIFY QUERY``: no insert goes past it)."""
    import hashlib

    src = f"`{target.otel_table}`"  # (quoted: any name ?otel_table= takes, `ü` or `select`, is one table)
    con.command(otel_traces_ddl(src))
    views = _views(src)
    digest = hashlib.sha256("\n".join(v[3] for v in views).encode()).hexdigest()[:32]
    existing = con.table_names()
    given = con.ch_frame(f"SELECT value FROM {META_TABLE} WHERE key = {_q(VIEWS_VERSION_KEY)}")["value"].to_list()
    stale = given != [digest]
    if CHECKED_TABLE not in existing:
        con.command(f"CREATE TABLE IF NOT EXISTS {CHECKED_TABLE} ENGINE = Null EMPTY AS {views[0][3]}")
    elif stale:  # (a Null table keeps no row: its columns are replaced at once)
        con.command(f"CREATE OR REPLACE TABLE {CHECKED_TABLE} ENGINE = Null EMPTY AS {views[0][3]}")
    for _, ddl, _, _ in _side_tables(src, CHECKED_TABLE):
        con.command(ddl)
    made = []
    # the gate first: a view replaced in place reads otel_traces or otel_checked at each moment,
    # so each span passes it once (a view made new is filled below with what came before)
    for view, table, _, select in views:
        if view not in existing:
            con.command(f"CREATE MATERIALIZED VIEW IF NOT EXISTS {view} TO {table} AS {select}")
            made.append(table)
        elif stale:
            con.command(f"ALTER TABLE {view} MODIFY QUERY {select}")
    if stale and given:
        con.command(f"ALTER TABLE {META_TABLE} UPDATE value = {{v:String}} WHERE key = {_q(VIEWS_VERSION_KEY)} "
                    "SETTINGS mutations_sync = 2", {"v": digest})
    elif stale:
        con.command(f"INSERT INTO {META_TABLE} (key, value) VALUES ({_q(VIEWS_VERSION_KEY)}, {{v:String}})",
                    {"v": digest})
    # what the collector wrote before: rows from now on go through the views. None on an empty
    # table, which a new store's is (the gate's own table keeps none)
    made = [t for t in made if t != CHECKED_TABLE]
    if made and con.ch_frame(f"SELECT count() > 0 AS held FROM {src}")["held"][0]:
        rows = f"({views[0][3]})"
        fills = {t: _family_select(t, rows) for t in SPAN_TABLES}
        fills |= {t: (cols, select) for t, _, cols, select in _side_tables(src, rows)}
        for table in made:
            cols, select = fills[table]
            con.command(f"INSERT INTO {table} ({cols}) {select}")


# A record's attribute key given twice with two values (the exporter's map keeps both), which
# `kvtrace collect` refuses (``decode._put_unique``): its first such key ('' where none), and its values
_TWICE_KEY = ("arrayFirst(_k -> length(arrayDistinct(arrayFilter((_v, _kk) -> _kk = _k, mapValues(SpanAttributes), "
              "mapKeys(SpanAttributes)))) > 1, mapKeys(SpanAttributes))")
_TWICE_VALUES = f"arrayDistinct(arrayFilter((_v, _kk) -> _kk = {_TWICE_KEY}, mapValues(SpanAttributes), " \
    "mapKeys(SpanAttributes)))"


def _wire(text: str) -> str:
    """A value as collect's refusal quotes a string (``decode._wire``)."""
    shown = repr(text)
    return shown if len(shown) <= 40 else f"{shown[:24]}... ({len(shown):,} characters)"


def _first_records(con) -> tuple[dict[str, tuple[dict, int, str]], dict[str, tuple[dict, int, str]]]:
    """Each run's first ``kvtrace.run`` record that finishes it, and its first opening record
    (``run_rules.is_opening``: never the one that finishes it, though first by time), as
    `kvtrace collect` takes it (``run_rules.run_record``), with its resource's offset and service, of the runs no record
    has finished yet: the exporter's rows of records, oldest first, whose ids and times collect
    takes (``_RECORD_ENVELOPE_PROBLEM``) and whose resource names the run (collect refuses a
    record that names none: it finished the exporter's ``otlp:<service>`` run here). A record
    collect refuses (a 400) names no run and finishes none."""
    from kvtrace.store.clickhouse.run_rules import RecordRefused, is_opening, run_record

    otel = f"`{con.target.otel_table}`"
    unfinished = (f"run_id NOT IN (SELECT run_id FROM runs WHERE status != 'running' OR writer_host != "
                  f"{_q(COLLECTOR_HOST)})")
    # (a table of no record, as every store's no exporter writes to: the two reads of records below,
    # whose expressions ClickHouse takes some 30 ms to plan over no row, at every open of the store)
    any_record = con.ch_frame(f"SELECT count() AS n FROM {otel} WHERE SpanName = {_q(SPAN_RUN)}")["n"][0] > 0
    rows = con.ch_frame(
        f"SELECT {_RUN_ID} AS run_id, CAST(SpanAttributes AS {_STR_MAP}) AS record, {_OFFSET} AS o, "
        f"ServiceName AS service, TraceId AS trace_id, SpanId AS span_id, "
        f"toUnixTimestamp64Nano(Timestamp) - {_OFFSET} AS start_ns, "
        f"mapContains(ResourceAttributes, {_q(RUN_ID_RESOURCE_KEY)}) AS named, {_RECORD_ENVELOPE_PROBLEM} AS problem, "
        f"{_TWICE_KEY} AS twice, {_TWICE_VALUES} AS twice_values "
        f"FROM {otel} WHERE SpanName = {_q(SPAN_RUN)} AND {_ALL_UTF8} AND {unfinished} "
        "ORDER BY Timestamp, TraceId, SpanId") if any_record else None
    first: dict[str, tuple[dict, int, str]] = {}
    opening: dict[str, tuple[dict, int, str]] = {}
    refused: list[tuple[str, str, str, int, str]] = []
    for run_id, record, offset, service, trace_id, span_id, start_ns, named, problem, twice, values in (
            rows.rows() if rows is not None else ()):
        if not named:
            continue
        try:
            if problem:  # (its envelope: ids, its run id, a resource key given twice; it was left out unsaid)
                raise RecordRefused(problem)
            if twice:  # (the map keeps both; read as a dict, the last one was taken)
                raise RecordRefused(f"attribute {twice!r} given twice, as {_wire(values[0])} and {_wire(values[1])} "
                                    "(an attribute key is unique)"[:300])
            taken = run_record(_as_dict(record))
        except RecordRefused as err:  # (collect's 400 says why; here otel_refused_spans does, as of a span)
            refused.append((run_id, trace_id, span_id, start_ns, str(err)))
            continue
        (opening if is_opening(taken) else first).setdefault(run_id, (taken, offset, service))
    # records holding bytes that are no UTF-8, read as valid text (their own bytes panicked polars):
    # left out above, and said nowhere, where the README says their reason is in otel_refused_spans
    if any_record:
        garbled = con.ch_frame(
            f"SELECT toValidUTF8({_RUN_ID}) AS run_id, toValidUTF8(TraceId) AS trace_id, toValidUTF8(SpanId) AS "
            f"span_id, toUnixTimestamp64Nano(Timestamp) - {_OFFSET} AS start_ns FROM {otel} WHERE SpanName = "
            f"{_q(SPAN_RUN)} AND mapContains(ResourceAttributes, {_q(RUN_ID_RESOURCE_KEY)}) AND NOT ({_ALL_UTF8})")
        refused += [(*row, _NOT_UTF8_WHY) for row in garbled.rows()]
    _note_refused_records(con, refused)
    # a record the exporter's table holds no more (its TTL): the copy otel_run_records keeps, where
    # the exporter's table holds no record of the run (a run named by none, otlp:<service>, is left)
    present = set(rows["run_id"].to_list()) if rows is not None else set()
    kept = con.ch_frame(f"SELECT run_id, record, {TIME_OFFSET_COLUMN} AS o, service_name FROM {RUN_RECORDS} "
                        f"WHERE {unfinished} AND NOT startsWith(run_id, 'otlp:') AND isValidUTF8(run_id) AND "
                        "arrayAll(_s -> isValidUTF8(_s), arrayConcat(mapKeys(record), mapValues(record))) "
                        "ORDER BY run_id")
    for run_id, record, offset, service in kept.rows():
        if run_id in present or run_id in first:
            continue
        try:
            taken = run_record(_as_dict(record))
        except RecordRefused:
            continue
        (opening if is_opening(taken) else first).setdefault(run_id, (taken, offset, service))
    return first, opening


def _as_dict(record: Any) -> dict:
    """A Map column's value as a dict (polars' Map, or its list form; an empty map reads as None)."""
    return dict(record.items() if isinstance(record, dict) else record or ())


def _note_refused_records(con, refused: list[tuple[str, str, str, int, str]]) -> None:
    """Records `kvtrace collect` refuses, each with its reason in otel_refused_spans once (a
    refused span's reason is there; a refused record's was nowhere)."""
    import pyarrow as pa

    if not refused:
        return
    noted = set(con.ch_frame(f"SELECT trace_id, span_id FROM {REFUSED_SPANS} WHERE name = {_q(SPAN_RUN)}").rows())
    new = list({(r[1], r[2]): r for r in refused if (r[1], r[2]) not in noted}.values())  # (a retried export's too)
    if new:
        run_ids, trace_ids, span_ids, starts, reasons = (list(c) for c in zip(*new))
        con.insert_arrow(REFUSED_SPANS, pa.table({
            "run_id": run_ids, "name": [SPAN_RUN] * len(new), "trace_id": trace_ids, "span_id": span_ids,
            "start_ns": pa.array(starts, pa.int64()), "reason": reasons}))


def _held_below(con, run_id: str, sent: int) -> int:
    """How many of the seq numbers 0 to ``sent`` - 1 (``kvtrace.seq``, as its sender numbered
    its spans) the run's stored spans hold: what `kvtrace collect` counts (``_HeldSeqs``)."""
    union = " UNION ALL ".join(f"SELECT seq FROM {t} WHERE run_id = {{run_id:String}} AND seq >= 0 "
                               f"AND seq < {{sent:Int64}}" for t in SPAN_TABLES)
    return int(con.ch_frame(f"SELECT uniqExact(seq) AS n FROM ({union})", {"run_id": run_id, "sent": sent})["n"][0])


def _finish(con, run_id: str, status: str, fields: dict[str, Any]) -> None:
    """A collected run's derived tables built (again) and its status and record fields set."""
    from kvtrace.store.clickhouse.tables import materialise

    materialise(con, run_id)
    sets = ", ".join(f"{c} = {{{c}:String}}" for c in fields)
    con.command(f"ALTER TABLE runs UPDATE {sets}{', ' if sets else ''}status = {{status:String}} "
                "WHERE run_id = {run_id:String} SETTINGS mutations_sync = 2",
                {**fields, "status": status, "run_id": run_id})


def _describe_opened(con, described: dict[str, dict[str, str]]) -> None:
    """Collected runs still ``running`` (no record finished them) given the descriptive fields of
    their first opening record (``run_rules.is_opening``: name, created, trace, config, behaviours),
    as `kvtrace collect` sets them: a run whose sender was killed keeps its settings. A run that
    holds them already is not written again (a mutation per open of the store)."""
    from kvtrace.store.writer import DESCRIBED_FIELDS

    if not described:
        return
    rows = con.ch_frame(f"SELECT run_id, {', '.join(DESCRIBED_FIELDS)} FROM runs WHERE status = 'running' AND "
                        f"writer_host = {_q(COLLECTOR_HOST)} ORDER BY run_id")
    for run_id, *stored in rows.rows():
        fields = described.get(run_id)
        if not fields or all(fields.get(k, v) == v for k, v in zip(DESCRIBED_FIELDS, stored, strict=True)):
            continue
        sets = ", ".join(f"{c} = {{{c}:String}}" for c in fields)
        con.command(f"ALTER TABLE runs UPDATE {sets} WHERE run_id = {{run_id:String}} SETTINGS mutations_sync = 2",
                    {**fields, "run_id": run_id})


def _refresh_short(con) -> list[str]:
    """Collected runs a complete record finished short (SPANS_MISSING in their summary: some
    spans their sender numbered had not come), counted again: complete with their sender's
    summary once every one has come, else the count they lack kept true (their derived tables
    rebuilt with the spans that came), as `kvtrace collect` keeps them. Returns the runs changed."""
    from kvtrace.metrics import SPANS_MISSING
    from kvtrace.store.clickhouse.run_rules import sent_span_count, short_summary, summary_object

    short = con.ch_frame(
        f"SELECT run_id, summary FROM runs WHERE status = 'incomplete' AND writer_host = {_q(COLLECTOR_HOST)} "
        f"AND position(summary, {_q(SPANS_MISSING)}) > 0 ORDER BY run_id")
    changed = []
    for run_id, text in short.rows():
        stored, sent = summary_object(text), sent_span_count(text)
        if stored is None or sent is None or not isinstance(stored.get(SPANS_MISSING), int):
            continue
        sender = {k: v for k, v in stored.items() if k != SPANS_MISSING}
        held = _held_below(con, run_id, sent)
        if sent - held == stored[SPANS_MISSING]:
            continue
        if held >= sent:
            _finish(con, run_id, "complete", {"summary": json.dumps(sender, sort_keys=True)})
        else:
            _finish(con, run_id, "incomplete", {"summary": short_summary(sender, sent, held)})
        changed.append(run_id)
    return changed


def register_collected_runs(con) -> list[str]:
    """A ``runs`` row for every collected run that lacks one (a run of a stored span, or of a
    record `kvtrace collect` takes: ``_first_records``), and, for each collected run still
    ``running`` whose record has arrived, its derived tables and the record's status, digest
    and summary (``incomplete``, SPANS_MISSING in its summary, where the record says
    ``complete`` and some of the spans its sender numbered have not come). Returns the runs
    finished here, and those finished short whose count changed."""
    import polars as pl
    import pyarrow as pa

    from kvtrace.store.clickhouse.run_rules import sent_span_count, short_summary
    from kvtrace.store.schema import RUN_COLUMNS

    # (a store no collector wrote to, a replay's or a capture's: nothing to register, where the reads
    # below took some 40 ms at every open of a writer; otel_run_records holds every record that came)
    if not con.ch_frame(f"SELECT (SELECT count() FROM {COLLECTED_RUNS}) + (SELECT count() FROM {RUN_RECORDS}) + "
                        f"(SELECT count() FROM runs WHERE writer_host = {_q(COLLECTOR_HOST)}) AS n")["n"][0]:
        return []
    records, openings = _first_records(con)
    fresh = f"(SELECT run_id FROM {COLLECTED_RUNS} WHERE run_id NOT IN (SELECT run_id FROM runs))"
    spanned = " UNION ALL ".join(f"SELECT run_id FROM {t} WHERE run_id IN {fresh}" for t in SPAN_TABLES)
    new = con.ch_frame(
        f"SELECT c.run_id AS run_id, any(c.{TIME_OFFSET_COLUMN}) AS o, any(c.service_name) AS service, "
        f"c.run_id IN ({spanned}) AS spanned FROM {COLLECTED_RUNS} AS c WHERE c.run_id NOT IN "
        "(SELECT run_id FROM runs) GROUP BY c.run_id ORDER BY c.run_id")
    # (a run of records alone that `kvtrace collect` refuses is none: a record 'bogus' was listed;
    # one it takes is, though the collected-runs view left it out: its resource's offset after its
    # start, which collect reads of spans alone, or a view attached before records named runs)
    running_sql = (f"SELECT run_id FROM runs WHERE status = 'running' AND writer_host = {_q(COLLECTOR_HOST)} "
                   "ORDER BY run_id")
    running = set(con.ch_frame(running_sql)["run_id"].to_list())  # (records name these, or runs not yet in runs)
    named = {r: o for r, o, _, s in new.rows() if s or r in records or r in openings}
    for recorded in (records, openings):
        named.update((r, o) for r, (_, o, _) in recorded.items() if r not in named and r not in running)
    new = pl.DataFrame({"run_id": sorted(named), "o": [named[r] for r in sorted(named)]},
                       schema={"run_id": pl.String, "o": pl.Int64})
    if new.height:
        rows: dict[str, list[Any]] = {c: [None] * new.height for c, _, _ in RUN_COLUMNS}
        rows["run_id"] = new["run_id"].to_list()
        rows["name"] = [named_run_name(r) for r in rows["run_id"]]
        rows["mode"] = ["otlp"] * new.height
        rows["status"] = ["running"] * new.height
        rows["writer_host"] = [COLLECTOR_HOST] * new.height
        # (when kvtrace first met the run, as `kvtrace collect` gives its runs the time it made them,
        # until a record's created says otherwise: `runs` listed these without one)
        rows["created"] = [created_now()] * new.height
        rows[TIME_OFFSET_COLUMN] = new["o"].to_list()
        types = {"writer_pid": pa.int32(), TIME_OFFSET_COLUMN: pa.int64()}
        con.insert_arrow("runs", pa.table({c: pa.array(v, types.get(c, pa.string())) for c, v in rows.items()}))
    finished = _refresh_short(con)
    _describe_opened(con, {r: o[0]["described"] for r, o in openings.items() if r not in records})
    for run_id in con.ch_frame(running_sql)["run_id"].to_list():
        if run_id not in records:
            continue
        record = dict(records[run_id][0])
        # (its mode stays otlp, as `kvtrace collect` keeps it: a kvtrace replay's is read from its
        # config, ``metrics.replayed_mode``)
        fields = {c: v for c, v in (*record.pop("described").items(), *record.items()) if v is not None}
        status = fields.pop("status")
        sent = sent_span_count(fields.get("summary"))
        if status == "complete" and sent is not None:
            held = _held_below(con, run_id, sent)
            if held < sent:  # (an export request lost: `kvtrace collect` finishes it so, until the rest come)
                status, fields["summary"] = "incomplete", short_summary(json.loads(fields["summary"]), sent, held)
        _finish(con, run_id, status, fields)
        finished.append(run_id)
    return finished + _rebuild_late(con, set(finished))


def _rebuild_late(con, done: set[str]) -> list[str]:
    """The finished collected runs (but ``done``) whose derived tables count other than the spans
    they hold, rebuilt: spans that came after the run's record finished it (`kvtrace collect`
    rebuilds such a run's tables as they come, and at its next start: ``_queue_unrebuilt_runs``;
    here `runs` said 1 span of a complete run holding 3, for good)."""
    finished = f"SELECT run_id FROM runs WHERE status != 'running' AND writer_host = {_q(COLLECTOR_HOST)}"
    union = " UNION ALL ".join(f"SELECT run_id FROM {t} WHERE run_id IN ({finished})" for t in SPAN_TABLES)
    short = con.ch_frame(
        f"SELECT h.run_id AS run_id FROM (SELECT run_id, count() AS n FROM ({union}) GROUP BY run_id) AS h "
        "LEFT JOIN (SELECT run_id, toInt64(sum(spans)) AS n FROM span_stats GROUP BY run_id) AS d "
        "ON d.run_id = h.run_id WHERE h.n != d.n ORDER BY h.run_id")["run_id"].to_list()
    rebuilt = [r for r in short if r not in done]
    for run_id in rebuilt:
        from kvtrace.store.clickhouse.tables import materialise

        materialise(con, run_id)
    return rebuilt
