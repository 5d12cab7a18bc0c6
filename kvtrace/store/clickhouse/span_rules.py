"""The rules across a span's fields that every stored span holds: one home, read by both
collector paths.

- `kvtrace collect` (``instrument.convert.SpanRowsBuilder``) refuses a span that breaks one
  (``span_problem``, over the values it is about to store);
- the OpenTelemetry Collector's ClickHouse path (``store.clickhouse.collector``), whose
  exporter took the span already, leaves it out of kvtrace's typed tables
  (``span_problem_sql``, the same rules in SQL over the typed values its views derive); the
  span stays in the exporter's table, and the reason is kept in ``otel_refused_spans``.

A span that breaks one gave every reader negative latencies or counters, or a rate above 1
(``local_compute -260``: a damaged run), on the path that stored it.

The rules (``store/schema.py`` holds the request's data: REQUEST_TIME_ORDER, REQUEST_TTFT,
REQUEST_WITHIN): a request's times in order (arrival: the span's start where none is given);
its ttft_ns the first token less its arrival; its inter-token gaps within its first token (else
its start) and its end; its hit tokens within what it asked; its prefill chunks each ending no
earlier than they start; a lookup's hits, and each KV group's, within its query tokens. (This
module lives with the ClickHouse path because both layers may import it; it imports nothing but
``store.schema``.)
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import combinations, pairwise
from typing import Any

from kvtrace.store.schema import (
    MAX_SPAN_COUNT,
    REQUEST_TIME_ORDER,
    REQUEST_TTFT,
    REQUEST_WHOLE_NEEDED,
    REQUEST_WITHIN,
    SPAN_COLUMN_DEFS,
    SPAN_LOOKUP,
    SPAN_REQUEST,
)

# A lookup's hit tokens (local and external) within the tokens it looked up, as kvtrace's own
# lookups always are (REQUEST_WITHIN's rule for a lookup span): a run's lookups are its requests
# where it has no request span, and every reader called a sender's run damaged ("local_compute
# -260") whose lookup hit more than it asked, after the collector had stored it with a 200.
LOOKUP_WITHIN: tuple[tuple[tuple[str, ...], str], ...] = (
    (("num_hit_tokens", "num_external_hit_tokens"), "num_query_tokens"),
)
LOOKUP_WITHIN_NEEDED = frozenset({"num_query_tokens"})
# (parts, whole) and the wholes a part needs, per span name
WITHIN: dict[str, tuple[tuple[tuple[tuple[str, ...], str], ...], frozenset[str]]] = {
    SPAN_REQUEST: (REQUEST_WITHIN, REQUEST_WHOLE_NEEDED),
    SPAN_LOOKUP: (LOOKUP_WITHIN, LOOKUP_WITHIN_NEEDED),
}
RULED_SPANS = tuple(WITHIN)  # the span names a rule reads
ITL_COLUMN = "itl_ns"
CHUNKS_COLUMN = "prefill_chunks"
PER_GROUP_COLUMN = "hit_tokens_per_group"
ATTRIBUTE_OF = ({c.name: c.attr for c in SPAN_COLUMN_DEFS if c.attr}
                | {"end_ns": "the span's end", "start_ns": "its start"})


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _no_count(whole_column: str, text: str | None = None) -> str:
    given = "" if text is None else f" {text[:40]!r}{'...' if len(text) > 40 else ''}"  # (the sender's text)
    return (f"{ATTRIBUTE_OF[whole_column]}{given} is no token count the store holds (an integer from 0 to "
            f"{MAX_SPAN_COUNT:,})")


def span_problem(name: str, value: Callable[[str], Any], sent: Callable[[str], Any] | None = None) -> str | None:
    """Why a span of this name whose column values are ``value(column)`` (None: not given;
    ``start_ns``/``end_ns`` its times as stored) breaks a rule; None when it holds them all.
    ``sent(column)``: the text of the column's attribute where it was given as a value the column
    did not take (None otherwise), so a refusal names it rather than say it was not given."""
    if name not in WITHIN:
        return None
    if name == SPAN_REQUEST:
        times = [(c, v) for c in REQUEST_TIME_ORDER
                 if (v := value(c) if c != "arrival_ns" else _first(value(c), value("start_ns"))) is not None]
        for (a, earlier), (b, later) in pairwise(times):
            if later < earlier:
                return (f"{ATTRIBUTE_OF.get(b, b)} {later} is before {ATTRIBUTE_OF.get(a, a)} {earlier}; a request's "
                        "times run arrival <= first scheduled <= first token <= end")
        ttft, first, arrival = (value(c) for c in REQUEST_TTFT)
        if None not in (ttft, first, arrival) and ttft != first - arrival:
            return (f"{ATTRIBUTE_OF[REQUEST_TTFT[0]]} {ttft} is not {ATTRIBUTE_OF[REQUEST_TTFT[1]]} "
                    f"- {ATTRIBUTE_OF[REQUEST_TTFT[2]]} = {first - arrival}")
        # its inter-token gaps lie between its first token (else its start) and its end (gaps of
        # 2^62 ns in a request of 1 µs were stored, and diff showed a median ITL of 4.6e12 ms)
        gaps, end = value(ITL_COLUMN), value("end_ns")
        since = "first_token_ns" if first is not None else "start_ns"
        begin = first if first is not None else value("start_ns")
        if gaps and begin is not None and end is not None and sum(gaps) > end - begin:
            return (f"{ATTRIBUTE_OF[ITL_COLUMN]}: its gaps add up to {sum(gaps)} ns, more than "
                    f"{ATTRIBUTE_OF['end_ns']} - {ATTRIBUTE_OF[since]} = {end - begin} ns")
        # each prefill chunk ends no earlier than it starts (a chunk of 500 -> 100 ns was stored,
        # and the request's waterfall drew a negative bar)
        for chunk in value(CHUNKS_COLUMN) or ():
            if None not in (chunk["start_ns"], chunk["end_ns"]) and chunk["end_ns"] < chunk["start_ns"]:
                return (f"{ATTRIBUTE_OF[CHUNKS_COLUMN]}: a chunk ends at {chunk['end_ns']}, before its start "
                        f"{chunk['start_ns']}")
    if name == SPAN_LOOKUP:
        # each group's hits within the tokens looked up (a group's 1e9 of 40,160 was stored, and
        # its hit rate read 24,900%)
        per, query = value(PER_GROUP_COLUMN), value("num_query_tokens")
        if per and query is not None and max(per) > query:
            return (f"{ATTRIBUTE_OF[PER_GROUP_COLUMN]}: a group's {max(per)} hit tokens exceed "
                    f"{ATTRIBUTE_OF['num_query_tokens']} {query}; hits are counted within it")
    within, needed = WITHIN[name]
    for parts, whole_column in within:
        part = sum(v for c in parts if (v := value(c)) is not None)
        whole = value(whole_column)
        named = " + ".join(ATTRIBUTE_OF[c] for c in parts)
        if whole is None and part and whole_column in needed:
            if sent is not None and (text := sent(whole_column)) is not None:  # (1e21 prompt tokens: "1e+21")
                return f"{named} {part} given, but {_no_count(whole_column, text)}; hits are counted within it"
            return f"{named} {part} given without {ATTRIBUTE_OF[whole_column]}; hits are counted within it"
        if whole is not None and part > whole:
            return f"{named} {part} exceeds {ATTRIBUTE_OF[whole_column]} {whole}; hits are counted within it"
    return None


def _lit(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def span_problem_sql(name: str, column: Callable[[str], str], sent: Callable[[str], str] | None = None) -> str | None:
    """SQL (ClickHouse) of ``span_problem``'s rules for spans of this name: a String, '' where
    the span holds them all, else which rule it breaks (without the values). ``column(c)``:
    the SQL of column ``c``'s typed value (NULL where not given; ``start_ns``/``end_ns`` as
    stored, less any time offset); ``sent(c)``: SQL of whether the span gave column ``c``'s
    attribute at all (a value the column did not take). None for a name no rule reads. Sums are taken in Int128,
    as Python's are exact."""
    if name not in WITHIN:
        return None
    wide = lambda c: f"toInt128({column(c)})"
    cases: list[tuple[str, str]] = []
    if name == SPAN_REQUEST:
        time = lambda c: (f"toInt128(coalesce({column(c)}, {column('start_ns')}))" if c == "arrival_ns" else wide(c))
        for a, b in combinations(REQUEST_TIME_ORDER, 2):  # (every pair given in order: their given sequence is)
            cases.append((f"{time(b)} < {time(a)}",
                          f"{ATTRIBUTE_OF.get(b, b)} is before {ATTRIBUTE_OF.get(a, a)}; a request's times run "
                          "arrival <= first scheduled <= first token <= end"))
        ttft, first, arrival = REQUEST_TTFT
        cases.append((f"{wide(ttft)} != {wide(first)} - {wide(arrival)}",
                      f"{ATTRIBUTE_OF[ttft]} is not {ATTRIBUTE_OF[first]} - {ATTRIBUTE_OF[arrival]}"))
        gaps = f"arraySum(arrayMap(_g -> toInt128(_g), {column(ITL_COLUMN)}))"
        begin = f"toInt128(coalesce({column(first)}, {column('start_ns')}))"
        cases.append((f"{gaps} > {wide('end_ns')} - {begin}",
                      f"{ATTRIBUTE_OF[ITL_COLUMN]}: its gaps add up to more than the span's end less its first "
                      "token (else its start)"))
        cases.append((f"arrayExists(_c -> tupleElement(_c, 'end_ns') < tupleElement(_c, 'start_ns'), "
                      f"{column(CHUNKS_COLUMN)})", f"{ATTRIBUTE_OF[CHUNKS_COLUMN]}: a chunk ends before its start"))
    if name == SPAN_LOOKUP:
        cases.append((f"toInt128(arrayMax({column(PER_GROUP_COLUMN)})) > {wide('num_query_tokens')}",
                      f"{ATTRIBUTE_OF[PER_GROUP_COLUMN]}: a group's hit tokens exceed "
                      f"{ATTRIBUTE_OF['num_query_tokens']}; hits are counted within it"))
    within, needed = WITHIN[name]
    for parts, whole_column in within:
        part = " + ".join(f"coalesce({wide(c)}, 0)" for c in parts)
        named = " + ".join(ATTRIBUTE_OF[c] for c in parts)
        if whole_column in needed and sent is not None:
            cases.append((f"{column(whole_column)} IS NULL AND {sent(whole_column)} AND ({part}) != 0",
                          f"{named} given, but {_no_count(whole_column)}; hits are counted within it"))
        if whole_column in needed:
            cases.append((f"{column(whole_column)} IS NULL AND ({part}) != 0",
                          f"{named} given without {ATTRIBUTE_OF[whole_column]}; hits are counted within it"))
        cases.append((f"({part}) > {wide(whole_column)}",
                      f"{named} exceeds {ATTRIBUTE_OF[whole_column]}; hits are counted within it"))
    # (a comparison with a NULL is NULL: multiIf takes it as false, a rule with a value not given)
    return "multiIf(" + ", ".join(f"coalesce({cond}, 0), {_lit(why)}" for cond, why in cases) + ", '')"
