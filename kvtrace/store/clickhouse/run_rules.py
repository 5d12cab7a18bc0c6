"""What a ``kvtrace.run`` record (a kvtrace export's run record) must hold to finish a run: one
home, read by both collector paths.

- `kvtrace collect` (``instrument.otlp.collector``) refuses the request that carries a record
  breaking a rule (a 400 naming the attribute: ``RecordRefused``'s message);
- the OpenTelemetry Collector's ClickHouse path (``store.clickhouse.collector``), whose
  exporter took the record already, lets such a record name no run and finish none, as the
  refused request does on `collect` (it listed a run of a lone record with status ``bogus``,
  or a summary whose rate was 2.0, and finished a run with it).

The rules: a status of FINISHED_STATUSES; a digest and trace digest of one word
(``run_id_problem``); a summary that is a JSON object holding no collector's own key
(SPANS_MISSING) and passing ``metrics``' checks of its counts, rates and latency statistics;
a name, created time (ISO 8601 with its UTC offset, kept in UTC), trace source, config (a
JSON object whose backend and vLLM fields are text) and behaviours (a JSON list of names) of
text, at most MAX_RECORD_FIELD_CHARS each, its JSON fields strict JSON (no NaN or Infinity, no
lone surrogate escape: what the store's JSON columns refuse, which left the run unfinished). The
ClickHouse exporter writes every attribute as text, so a value of another type (an int digest) is
taken there as its text: what the exporter's table holds, and what `kvtrace collect` reads of it
too (``as_exported``: the int 7 is digest "7" on both paths, an empty value "", which no field
takes). A record's summary ``spans`` (``sent_span_count``) is the count of
spans its sender numbered: a ``complete`` record of a run that lacks some of them finishes it
``incomplete``, SPANS_MISSING saying how many, on both paths.

An opening record (status OPENING_STATUS, ``running``: ``is_opening``), which a kvtrace export
sends with its first export, carries no digest and no summary (one that does is refused): its
name, created time, trace source, config and behaviours are set where no record set them, so a
run whose sender was killed keeps its settings; it finishes nothing, marks nothing in
recorded_runs and counts as no span, on both paths. A second one, or one after the finishing
record, changes nothing; the finishing record's fields win.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from kvtrace.metrics import SPANS_MISSING, summary_disagreement, summary_problem
from kvtrace.store.schema import CONFIG_TEXT_KEYS, FINISHED_STATUSES, OPENING_STATUS, RUN_RECORD_PREFIX, run_id_problem
from kvtrace.store.writer import DESCRIBED_FIELDS

MAX_RECORD_FIELD_CHARS = 1 << 20  # a run record's text field (a config is a few KB)


def is_opening(record: Mapping[str, Any]) -> bool:
    """Whether ``run_record``'s reading of a record is an opening one (status OPENING_STATUS):
    its descriptive fields set where no record set them; it finishes nothing, marks nothing and
    counts as no span."""
    return record.get("status") == OPENING_STATUS


class RecordRefused(ValueError):
    """A ``kvtrace.run`` record that finishes no run; the message names the attribute."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON value")


def strict_json(text: str) -> Any:
    """``text``'s JSON value as a record field may hold it: ValueError where it is no JSON (or one
    nested past Python's recursion limit), spells NaN or Infinity (Python's json takes them, as no
    other reader does) or escapes a lone surrogate ("\\ud800": the store's JSON columns refuse it,
    and the run was left unfinished)."""
    try:
        decoded = json.loads(text, parse_constant=_no_constant)
        json.dumps(decoded, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a lone surrogate is no Unicode text") from None
    except RecursionError:  # (arrays nested some thousand deep: a 500 on collect, a failed open on ClickHouse)
        raise ValueError("nested deeper than Python's JSON reader goes") from None
    return decoded


def _reason(err: ValueError) -> str:
    """Why ``strict_json`` refused a text, in one short line (json's own message names the place:
    "Expecting value: line 1 column 1 (char 0)")."""
    return str(err).splitlines()[0][:120] if str(err) else type(err).__name__


def summary_object(summary: object) -> dict | None:
    """A summary's JSON text as an object, None where it is none (a store's summary, read back
    at a restart, may be damaged)."""
    try:
        decoded = json.loads(summary) if isinstance(summary, str) else None
    except (ValueError, RecursionError):
        return None
    return decoded if isinstance(decoded, dict) else None


def sent_span_count(summary: object) -> int | None:
    """The spans a kvtrace sender numbered in its run (its summary's ``spans``, checked by
    ``run_record``), or None where the summary gives none."""
    decoded = summary_object(summary)
    count = decoded.get("spans") if decoded is not None else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _word_problem(word: object) -> str | None:
    """Why a digest or trace digest is none (None: it is one, or absent): one word, 1 to 128
    printable characters without spaces, and no JSON array or object, the exporter's text of an
    array or map a sender gave (a scalar's text, "7" of an int, is a word on both paths)."""
    if word is None:
        return None
    if not isinstance(word, str):
        return f"expected a string, got {type(word).__name__}"
    if run_id_problem(word) is not None:
        return f"expected 1 to 128 printable characters without spaces, got {word!r}"
    if word[0] in "[{":
        try:
            structured = isinstance(json.loads(word), (list, dict))
        except ValueError:
            structured = False
        if structured:
            return f"expected one word, got a JSON array or object (an OTLP array or map's text), {word!r}"
    return None


def run_record(attributes: Mapping[str, Any]) -> dict:
    """The status, digest, summary, trace digest and descriptive fields (``described``: name,
    created, trace source, config, behaviours) of a ``kvtrace.run`` span's attributes;
    RecordRefused (its message naming the attribute) where the record breaks a rule."""
    get = lambda key: attributes.get(f"{RUN_RECORD_PREFIX}{key}")
    status = get("status")
    digest, summary, trace_digest = get("digest"), get("summary"), get("trace_digest")
    # an opening record (OPENING_STATUS, sent with a run's first export): what is known at its start, no
    # digest and no summary; it finishes nothing (a record "running" of another shape is refused, as before)
    opening = status == OPENING_STATUS
    if opening and (digest is not None or summary is not None):
        raise RecordRefused(f"{RUN_RECORD_PREFIX}status: {OPENING_STATUS} is an opening record's, which carries no "
                            f"{'digest' if digest is not None else 'summary'} (a finishing record's status is "
                            f"{', '.join(FINISHED_STATUSES[:-1])} or {FINISHED_STATUSES[-1]})")
    # (another status, "bogus" or 2, finished the run as complete without a word: a failed run read as a good one)
    if status is not None and not opening and status not in FINISHED_STATUSES:
        raise RecordRefused(f"{RUN_RECORD_PREFIX}status: expected {', '.join(FINISHED_STATUSES[:-1])} or "
                            f"{FINISHED_STATUSES[-1]}, got {status!r}"[:300])
    for key, word in (("digest", digest), ("trace_digest", trace_digest)):  # (what diff compares and prints)
        problem = _word_problem(word)
        if problem is not None:
            raise RecordRefused(f"{RUN_RECORD_PREFIX}{key}: {problem}"[:300])
    if summary is not None:
        why = ""  # (strict_json's reason: "expected a JSON object" alone was said of one nested too deep)
        try:
            decoded = strict_json(summary) if isinstance(summary, str) else None
        except ValueError as err:
            decoded, why = None, f" ({_reason(err)})"
        if not isinstance(decoded, dict):
            raise RecordRefused(f"{RUN_RECORD_PREFIX}summary: expected a JSON object as a string{why}"[:300])
        # (a rate of 7.5 showed as 750%, a count of "many" as text; 9 hits of 5 queries, a rate its
        # counters do not give, evictions their reasons do not add up to, a p99 under its p50)
        if SPANS_MISSING in decoded:  # (a collector's own finding: sent, it made a sender's incomplete completable)
            raise RecordRefused(f"{RUN_RECORD_PREFIX}summary: {SPANS_MISSING}: a collector's own key (the "
                                "spans it has not received), not a sender's")
        problem = summary_problem(decoded) or summary_disagreement(decoded)
        if problem is not None:
            raise RecordRefused(f"{RUN_RECORD_PREFIX}summary: {problem}")
        text = lambda v: v if isinstance(v, str) else json.dumps(v)  # (an int 7 is the digest "7")
        for key, word in (("digest", digest), ("trace_digest", trace_digest)):
            # (a record's digest beside a summary saying another: diff printed both, the run complete)
            said = decoded.get(key)
            if word is not None and said is not None and text(said) != text(word):
                raise RecordRefused(f"{RUN_RECORD_PREFIX}{key}: {str(word)[:80]!r} is not the summary's {key} "
                                    f"{str(said)[:80]!r}")
    described: dict[str, str] = {}
    for key in DESCRIBED_FIELDS:  # what the run was: the producer's name, trace, config and behaviours
        value = get(key)
        if value is None:
            continue
        if not isinstance(value, str) or len(value) > MAX_RECORD_FIELD_CHARS:
            raise RecordRefused(f"{RUN_RECORD_PREFIX}{key}: expected a string of at most "
                                f"{MAX_RECORD_FIELD_CHARS:,} characters")
        if key == "created":  # (sorted as text by every listing: stored in UTC, as kvtrace writes its own)
            try:
                when = dt.datetime.fromisoformat(value)
                # (in UTC: a time within a day of year 1 or 9999 is none, an OverflowError that made
                # a 500 on collect and failed every open of a ClickHouse store holding it)
                in_utc = when.astimezone(dt.UTC).isoformat() if when.tzinfo is not None else None
            except (ValueError, OverflowError):
                in_utc = None
            if in_utc is None:
                raise RecordRefused(f"{RUN_RECORD_PREFIX}created: expected an ISO 8601 time with its UTC "
                                    f"offset, got {value[:80]!r}")
            value = in_utc
        if key in ("config", "behaviours"):
            why = ""
            try:
                decoded_field = strict_json(value)
            except ValueError as err:
                decoded_field, why = None, f" ({_reason(err)})"
            kind = dict if key == "config" else list
            if not isinstance(decoded_field, kind) or (
                    key == "behaviours" and not all(isinstance(b, str) for b in decoded_field)):
                what = "a JSON object" if key == "config" else "a JSON list of names"
                raise RecordRefused(f"{RUN_RECORD_PREFIX}{key}: expected {what} as a string{why}"[:300])
            if isinstance(decoded_field, dict):  # (what every listing names a backend by: `runs` showed "7 ['x'] @ 5")
                bad = next((k for k in CONFIG_TEXT_KEYS
                            if k in decoded_field and not isinstance(decoded_field[k], str)), None)
                if bad is not None:
                    raise RecordRefused(f"{RUN_RECORD_PREFIX}config: {bad}: expected a string, got "
                                        f"{type(decoded_field[bad]).__name__}")
        described[key] = value
    return {"status": status or "complete",
            "digest": digest, "summary": summary, "trace_digest": trace_digest, "described": described}


def short_summary(summary: dict, sent: int, held: int) -> str:
    """A sender's summary with the collector's finding beside its numbers: SPANS_MISSING, the
    spans of the ``sent`` it numbered (``kvtrace.seq`` 0 to sent - 1) of which ``held`` are
    stored (what tells the run it finished short from one its sender called incomplete)."""
    return json.dumps({**summary, SPANS_MISSING: sent - held}, sort_keys=True)
