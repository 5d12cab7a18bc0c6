"""A run's summary as every view reads it: the stored one, or, for a run that keeps none
(running, interrupted, failed), the same keys computed from its spans."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

from kvtrace import metrics
from kvtrace.names import shown_value
from kvtrace.store.errors import DAMAGED, StoreError
from kvtrace.store.read._api import BadArgument, checked
from kvtrace.store.read._sql import DB, one_snapshot, with_run
from kvtrace.store.read.evictions import evictions_by_reason
from kvtrace.store.read.hits import hit_counters
from kvtrace.store.read.latency import latency_summary
from kvtrace.store.read.runs import run, span_counts
from kvtrace.store.schema import (
    COPY_REASON_EXTERNAL,
    SPAN_COW,
    SPAN_DIVERGENT,
    SPAN_EVICT,
    SPAN_PUBLISH,
    SPAN_REQUEST,
    SPAN_STALE_LEFT,
    SPAN_STEP,
)


@checked
def run_summary(db: DB, run_id: str) -> dict[str, Any]:
    """The run's summary as ``summary_with_spans`` completes it. So ``runs``, ``diff`` and the
    dashboard give a run without one one number each (``runs`` said null where ``diff``
    said 87%)."""
    with one_snapshot(db):  # (the record and its spans as one commit left them)
        return summary_with_spans(db, run_id, run(db, run_id).get("summary"))


def finished_summary(stored: object) -> TypeGuard[Mapping[str, Any]]:
    """Whether a stored summary is a finished run's, not a failed or terminated one's
    ``{"error": ...}`` (a live capture's counts no requests and is finished all the same)."""
    return isinstance(stored, Mapping) and "error" not in stored


def summary_with_spans(db: DB, run_id: str, stored: Mapping[str, Any] | None) -> dict[str, Any]:
    """``stored`` (the run's summary, already read) when it is a finished run's; for any
    other run (none stored: running or killed; a failed or terminated run's error alone),
    ``summary_from_spans`` with what was stored on top (the error stays). The one rule every
    view follows (a SIGTERM'd run showed its spans' numbers on the dashboard's tiles and
    blanks in ``runs`` and ``diff``)."""
    if stored is not None and not isinstance(stored, Mapping):  # ('x' gave the spans' summary, unsaid)
        raise BadArgument("summary_with_spans", "stored", f"expected the run's stored summary (a mapping) or "
                                                          f"None, got {shown_value(stored)}")
    if finished_summary(stored):
        if "evictions" in stored:
            return dict(stored)
        # a live capture's summary counts messages and events, not blocks: its publishes and
        # evictions from its spans (Overview said evictions "–" beside an Evictions page of 30)
        return {**_cache_event_counts(db, run_id), **stored}
    return {**summary_from_spans(db, run_id), **(stored if isinstance(stored, Mapping) else {})}


def _cache_event_counts(db: DB, run_id: str, counts: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Blocks published and evicted, and evicted by reason, from the run's spans (``counts``:
    its ``span_counts`` rows by name, where read already)."""
    with one_snapshot(db):
        if counts is None:
            counts = _span_counts(db, run_id)
        by_reason = {r["reason"]: int(r["blocks"]) for r in evictions_by_reason(db, run_id).iter_rows(named=True)}
    blocks = {name: int(counts[name]["blocks"] or 0) if name in counts else 0 for name in (SPAN_PUBLISH, SPAN_EVICT)}
    return {"publishes": blocks[SPAN_PUBLISH], "evictions": blocks[SPAN_EVICT], "evictions_by_reason": by_reason}


def _span_counts(db: DB, run_id: str) -> dict[str, Any]:
    return {r["name"]: r for r in span_counts(db, run_id).iter_rows(named=True)}


@checked
def summary_from_spans(db: DB, run_id: str) -> dict[str, Any]:
    """A summary's keys from the run's spans, when it has request spans: vLLM's hit counters
    and rates, ``prompt_tokens``, ``output_tokens`` and ``preemptions`` (sums over the
    finished requests' spans), an engine run's block counts and block hit rate, its
    ``computed_prompt_tokens``, ``block_size`` and ``capacity_blocks`` (``_block_counts``),
    the latency statistics, ``publishes`` and ``evictions`` (blocks;
    null for a Belady bound, which records neither) and ``evictions_by_reason``,
    ``cow_copies`` (null in cache-only runs, which copy nothing), ``stale_hashes_left``
    (engine runs), ``divergent_outputs`` (null where the engine checked no content), ``steps``
    (engine runs) and ``spans``, each as a complete run's stored summary defines it (without a
    request counted, the blocks, steps and spans alone; without spans, a replay's configured sizes
    alone, else {}), all from one committed state of the store (``one_snapshot``)."""
    with one_snapshot(db):
        return _summary_from_spans(db, run_id)


def _summary_from_spans(db: DB, run_id: str) -> dict[str, Any]:
    hits = hit_counters(db, run_id)
    counts = _span_counts(db, run_id)
    stored_mode, config = _record(db, run_id)
    # the mode its events were made in: a collected replay's is stored as ``otlp``, its
    # sender's in its config (a stopped run collected read divergent outputs null and no
    # steps beside the same run's direct store)
    mode = metrics.replayed_mode(stored_mode, config)
    # A Belady bound has no cache manager: its spans are its lookups, and the publishes and
    # evictions its summary counts are in none (0 from them, where the finished run said 7,069).
    cached = config.get("policy") != "belady"
    events = _cache_event_counts(db, run_id, counts) if cached else {"publishes": None, "evictions": None}
    # an engine run's steps, one span each (numbered 0..n-1): a stopped run makes no final audit,
    # whose batch a finished run's summary does not count either
    steps = {"steps": _steps(db, run_id) if SPAN_STEP in counts else 0} if mode == "engine" else {}
    spans = {"spans": sum(int(r["spans"]) for r in counts.values())}
    if not hits.get("requests"):
        # No request counted (a live capture counts none; a replay stopped, or failed, before its first
        # request finished): no counter or latency, but the blocks its spans published and evicted, its
        # steps and its spans, as its finished summary counts them (a killed capture's summary read {}
        # beside 200 publishes; a replay failed after 5 steps, {"error"} alone beside the eviction its
        # Evictions page and diff's evictions table showed)
        # (spans of a sender unknown here, a vLLM server's llm_request spans alone: no cache measured, no 0)
        replayed = mode == "engine" or str(mode or "").startswith("cache-only")
        measured = mode == "live" or (counts and replayed) or SPAN_PUBLISH in counts or SPAN_EVICT in counts
        if not measured:  # (a replay stopped before any span: its cache's size all the same, from its
            return _configured_sizes(mode, config)  # config; diff said its block size beside capacity "–")
        summary = {**events, **_configured_sizes(mode, config), **steps, **spans}
    else:
        summary = _request_summary(db, run_id, hits, counts, mode, config, events)
        summary |= {**steps, **spans}
    # the check a stored summary gets (read.runs): a request span that ends before it arrived
    # (an edit by hand) gave a stopped run a median E2EL of -56,174 ms in runs and diff
    problem = metrics.summary_problem(summary)
    if problem is not None:
        raise StoreError(str(db), f"{DAMAGED}: run {run_id}'s spans hold values no kvtrace run holds, which its "
                                  f"summary from them shows: {problem}")
    return summary


def _request_summary(db: DB, run_id: str, hits: dict[str, Any], counts: Mapping[str, Any], mode: str | None,
                     config: Mapping[str, Any], events: dict[str, Any]) -> dict[str, Any]:
    """The summary's keys a run with finished requests has beyond its cache events, steps and spans."""
    totals = _request_totals(db, run_id)

    def spans_of(name: str) -> int:
        return int(counts[name]["spans"]) if name in counts else 0

    # copies and stale entries left are the engine's (cache-only replay makes none: its
    # summary says null, not 0); divergent outputs are counted as tokens are sampled, so a
    # stopped run's spans hold every one so far, where its replay checked content (diff said
    # null beside the requests it listed as divergent, the dashboard's Overview a dash beside
    # its table of them). Stale hashes stay unknown: the audit of every key at a run's end
    # never ran.
    checked = mode == "engine" and config.get("content") is not False
    return {
        **hits, **totals, **(_block_counts(db, run_id, config) if totals else {}),
        **({"prompt_tokens": hits.get(metrics.COUNTERS[0].key), **_configured_sizes(mode, config)}
           if str(mode or "").startswith("cache-only") else {}),
        **latency_summary(db, run_id, _recorded_percentiles(config)),
        **events,
        "cow_copies": _cow_copies(db, run_id) if totals and SPAN_COW in counts else 0 if totals else None,
        **({"stale_hashes_left": spans_of(SPAN_STALE_LEFT),
            "divergent_outputs": spans_of(SPAN_DIVERGENT) if checked else None} if totals else {}),
    }


def _configured_sizes(mode: str | None, config: Mapping[str, Any]) -> dict[str, Any]:
    """The cache's size a run's config states, as its finished summary does: an engine run's
    ``block_size`` and ``capacity_blocks`` (``_engine_blocks``); a cache-only run's
    ``capacity_blocks`` (null: unbounded) and the ``block_size`` it re-blocked the trace at (the
    trace's own, which no span or config records, stays unknown). A stopped cache-only run
    showed its capacity "–" in runs and diff (and prompt_tokens, which are its queries, beside
    them); a replay failed before its first request finished, its capacity "–" beside its
    block size."""
    def size(key: str) -> int | None:
        value = config.get(key)
        return value if _is_size(value) else None

    if mode == "engine":
        _, unit_size, usable = _engine_blocks(config)
        return {"block_size": unit_size, "capacity_blocks": usable} if "cache" in config else {}
    if not str(mode or "").startswith("cache-only"):
        return {}
    return {"capacity_blocks": size("capacity_blocks"), **({"block_size": size("block_size")}
                                                          if size("block_size") is not None else {})}

def _record(db: DB, run_id: str) -> tuple[str | None, Mapping[str, Any]]:
    """The run's mode and config ({} where it records none)."""
    try:
        record = run(db, run_id)
    except StoreError:  # (a damaged record: `runs` lists it as such, its spans read without it)
        return None, {}
    config = record.get("config")
    return record.get("mode"), config if isinstance(config, Mapping) else {}


def _recorded_percentiles(config: Mapping[str, Any]) -> tuple[float, ...]:
    """The run's own --percentiles (its config records any but the default), so a killed run
    summarises its latencies as its finished summary would have."""
    given = config.get(metrics.PERCENTILES_CONFIG_KEY)
    try:
        # (a bool is no percentile: float(True) would read it as p1)
        ok = isinstance(given, list) and not any(isinstance(p, bool) for p in given)
        return metrics.parse_percentiles(given if ok else None)
    except ValueError:  # (a store's own record, damaged or foreign: the default)
        return metrics.DEFAULT_PERCENTILES


# Sums over the request spans a finished engine run's summary also holds (a killed run's
# ``runs``/``diff``/dashboard showed its requests and hit rate, and "–" for these). A run
# without request spans (cache-only) has none: its prompt tokens are its queries.
_TOTALS = {"prompt_tokens": "num_prompt_tokens", "output_tokens": "num_output_tokens",
           "preemptions": "num_preemptions"}


def _steps(db: DB, run_id: str) -> int:
    """An engine run's steps: its step spans' numbers, each once (a final audit that finds
    stale hashes adds a zero-length step span under the last step's number: 827 said for 826)."""
    frame = with_run(db, run_id, f"SELECT count(DISTINCT step) AS n FROM spans WHERE run_id = $run_id "
                                 f"AND name = '{SPAN_STEP}'")
    return int(frame["n"][0])


def _cow_copies(db: DB, run_id: str) -> int:
    """Copy-on-write copies, as the engine's summary counts them: its copy spans but the
    external tier's loads into local blocks (a copy event each, no CoW: 852 of 975)."""
    frame = with_run(db, run_id, f"""
        SELECT count(*) AS n FROM spans WHERE run_id = $run_id AND name = '{SPAN_COW}'
        AND coalesce(copy_reason, '') <> '{COPY_REASON_EXTERNAL}'""")
    return int(frame["n"][0])


def _engine_blocks(config: Mapping[str, Any]) -> tuple[int | None, int | None, int | None]:
    """An engine config's (block size of its block counts, its ``block_size``, usable blocks):
    the first full-attention group's block size (else the first group's, as the engine's
    summary counts its block hits), the summary's ``block_size`` and ``capacity_blocks``
    (that group's block size and pool less vLLM's null block; None without a full-attention
    group, as ``replay.run.engine_capacity`` states them: a stopped sliding-window-only run
    said 16 where its finished summary says null); all None for a config that stores no groups."""
    cache = config.get("cache")
    groups = cache.get("groups") if isinstance(cache, Mapping) else None
    if not isinstance(groups, list) or not groups or not all(isinstance(g, Mapping) for g in groups):
        return None, None, None
    unit = next((g for g, spec in enumerate(groups) if spec.get("type") == "FullAttentionSpec"), None)
    size = groups[unit or 0].get("block_size")
    if not _is_size(size):
        return None, None, None
    if unit is None:
        return size, None, None
    pools = cache.get("num_gpu_blocks") if isinstance(cache, Mapping) else None
    pool = pools if isinstance(pools, int) else pools[unit] if (
        isinstance(pools, list) and unit < len(pools)) else None
    if not _is_size(pool) or pool < 2:
        return size, size, None
    return size, size, pool - 1


_MAX_SIZE = (1 << 63) - 1  # (metrics.summary_problem's bound on a size)


def _is_size(value: object) -> TypeGuard[int]:
    """Whether a config's value is a size a summary can state (an int from 1 to 2^63-1, as
    ``metrics.summary_problem`` checks one): anything else, a store's own record damaged or
    foreign, is an unknown size, as a wrong type is (a capacity of 10^30 in a stopped run's
    config was told as its spans holding values no kvtrace run holds, and the run refused by
    diff and export)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= _MAX_SIZE


def _block_counts(db: DB, run_id: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """An engine run's block counts over its finished requests, as its finished summary
    states them (``engine.request_metrics``, ``metrics.BLOCK_HIT_RATE_DOC``): ``block_size``,
    ``capacity_blocks``, ``hit_blocks`` (each request's cached tokens, local and external, in
    whole blocks), ``total_blocks`` (its prompt's blocks, the last one partial),
    ``block_hit_rate``, and ``computed_prompt_tokens`` (every chunk prefilled). A stopped
    run's dashboard showed its prefix cache hit rate and a block hit rate of –, from the same
    requests, and ``diff`` took a delta of its evictions against a run of another block size."""
    size, unit_size, usable = _engine_blocks(config)
    frame = with_run(db, run_id, f"""
        SELECT CAST(sum(num_computed_tokens) AS BIGINT) AS computed,
               CAST(sum((coalesce(num_hit_tokens, 0) + coalesce(num_external_hit_tokens, 0)) // $bs) AS BIGINT)
                   AS hit_blocks,
               CAST(sum((num_prompt_tokens + $bs - 1) // $bs) AS BIGINT) AS total_blocks
        FROM request_spans WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'""", params={"bs": size or 1})
    row = frame.row(0, named=True)
    out: dict[str, Any] = {"computed_prompt_tokens": None if row["computed"] is None else int(row["computed"])}
    if size is not None and row["total_blocks"] is not None:
        out |= {"block_size": unit_size, "capacity_blocks": usable,
                **metrics.block_hits(int(row["hit_blocks"] or 0), int(row["total_blocks"]))}
    return out


def _request_totals(db: DB, run_id: str) -> dict[str, int]:
    sums = ", ".join(f"CAST(sum({col}) AS BIGINT) AS {key}" for key, col in _TOTALS.items())
    frame = with_run(db, run_id, f"""
        SELECT count(*) AS n, {sums} FROM request_spans
        WHERE run_id = $run_id AND name = '{SPAN_REQUEST}'""")
    row = frame.row(0, named=True)
    if not row["n"]:
        return {}
    return {key: int(row[key] or 0) for key in _TOTALS}
