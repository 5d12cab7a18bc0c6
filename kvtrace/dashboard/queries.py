"""Cached reads for the pages, composed only from ``kvtrace.store.read`` (no SQL here),
and the run facts the pages need (Belady bound, group names, window length), read from
stored fields (``run_config``), never guessed from names.

Every cached call is keyed on (function, database path, key, arguments), the key being the
refresh token and the store's content state (``store.state.content_state``), taken once
per page run: a page load after the store changed (a replay's commit, the file replaced
or damaged) reads it again, every session alike; the Refresh button re-reads one that
cannot tell (a ClickHouse server).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import streamlit as st

from kvtrace import metrics
from kvtrace.compare import pairing
from kvtrace.compare.model import RunDiff
from kvtrace.compare.source import diff_runs
from kvtrace.dashboard import DB_ENV, charts, run_config, state, ui
from kvtrace.errors import KVTraceError
from kvtrace.names import replay_mode, shell_path
from kvtrace.store import read
from kvtrace.store.backend import is_clickhouse
from kvtrace.store.errors import DAMAGED, StoreError
from kvtrace.store.read.runs import DAMAGED_STATUS, JSON_FIELDS
from kvtrace.store.schema import SPAN_LOOKUP, SUMMARY_FIELDS, SUMMARY_NOTHING_RECEIVED
from kvtrace.store.state import content_state

CTX_KEY = "kvtrace_ctx"
SUMMARY_KEYS = tuple(k for k in SUMMARY_FIELDS if k != "digest")  # numeric headline fields

# The read functions the pages call through ``call`` (and only those); a typo fails loudly in tests.
_READS = {
    name: getattr(read, name)
    for name in (
        "hit_counters", "hit_counters_over_time", "group_hit_rates", "group_hit_rate_over_time", "usage_over_time",
        "per_prefix_reuse", "prefix_families", "evictions_over_time", "eviction_attribution", "block_histograms",
        "stale_hashes_over_time", "stale_hashes", "stale_hash_chain", "divergent_outputs", "per_request_hits",
        "latency_cdf", "latency_histogram", "latency_summary", "itl_over_time", "request_waterfall",
        "request_span_count", "curves",
        "capacity_marks", "span_counts",
    )
}

@st.cache_data(show_spinner=False, max_entries=512)
def _cached(name: str, db: str, key: tuple, args: tuple, kwargs: tuple) -> Any:
    return _READS[name](db, *args, **dict(kwargs))


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """``read.<name>(db, *args, **kwargs)``, cached per key (the module docstring)."""
    ctx = context()
    return _cached(name, ctx["db"], ctx["key"], args, tuple(sorted(kwargs.items())))


def _key(db: str) -> tuple:
    return state.refresh_token(), content_state(db)


@st.cache_data(show_spinner=False, max_entries=16)
def _runs(db: str, key: tuple) -> pl.DataFrame:
    frame = read.runs(db)
    # A run without a finished summary (running, killed, failed) gets the keys of its spans,
    # as `kvtrace runs` and `kvtrace diff` read it: one number per run, never a blank here.
    filled, hurt = {}, {}
    for run_id, text, damage, spans in zip(frame["run_id"].to_list(), frame["summary"].to_list(),
                                           frame["damage"].to_list(), frame["num_spans"].to_list()):
        stored = _json(text)
        # (a damaged record: its pages say why; no spans: nothing to read back, as `kvtrace
        # runs` skips it: 300 failed runs took 20 s to open)
        if damage or not spans or read.finished_summary(stored):
            continue
        try:
            filled[run_id] = json.dumps(read.summary_with_spans(db, run_id, stored))
        except StoreError as err:  # spans no run holds (a count near 2^63): that run damaged, as `runs` lists it
            if not err.what.startswith(DAMAGED):
                raise
            hurt[run_id] = str(err)
    if filled:
        frame = frame.with_columns(pl.col("run_id").replace_strict(filled, default=pl.col("summary")).alias("summary"))
    if hurt:  # (one such run made every run of the store unreadable here)
        bad = pl.col("run_id").is_in(list(hurt))
        frame = frame.with_columns(
            pl.when(bad).then(pl.lit(DAMAGED_STATUS)).otherwise(pl.col("status")).alias("status"),
            pl.col("run_id").replace_strict(hurt, default=pl.col("damage"), return_dtype=pl.String).alias("damage"),
            *(pl.when(bad).then(None).otherwise(pl.col(k)).alias(k) for k in JSON_FIELDS))
    return with_run_columns(frame)


def with_run_columns(frame: pl.DataFrame) -> pl.DataFrame:
    """Flatten the runs frame for display: behaviours on/off, summary fields as columns."""
    rows = frame.to_dicts()
    # kvtrace's behaviour switches are engine mode's: a cache-only replay (stored as []), a
    # capture or a collected run has none (`kvtrace runs` shows -), and is not "without" all of them.
    known: set[str] = set()
    for r in rows:
        if has_behaviours(r):
            known |= set(_behaviour_names(r.get("behaviours")))
    for r in rows:
        on = _behaviour_names(r.get("behaviours")) if has_behaviours(r) else []
        r["behaviours_on"] = ", ".join(on)
        r["behaviours_off"] = ", ".join(sorted(known - set(on))) if has_behaviours(r) else ""
        summary = _json(r.get("summary")) or {}
        for k in SUMMARY_KEYS:
            v = summary.get(k)
            r[k] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        r[SUMMARY_NOTHING_RECEIVED] = summary.get(SUMMARY_NOTHING_RECEIVED) is True
        r["backend"] = metrics.backend_label(r.get("mode"), _json(r.get("config"))) or "–"
        r["label"] = ui.run_label(r)
    schema: dict[str, Any] = dict(frame.schema) | {"behaviours_on": pl.String, "behaviours_off": pl.String,
                                                   SUMMARY_NOTHING_RECEIVED: pl.Boolean, "backend": pl.String,
                                                   "label": pl.String}
    schema |= {k: pl.Float64 for k in SUMMARY_KEYS}
    return pl.DataFrame(rows, schema=schema)


def has_behaviours(row: dict[str, Any]) -> bool:
    """Whether kvtrace's behaviour switches apply to the run: an engine replay's (either
    backend), or any run whose record names some."""
    return row.get("mode") == "engine" or bool(_behaviour_names(row.get("behaviours")))


def _json(text: Any) -> Any:
    if text is None or isinstance(text, (dict, list)):
        return text
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


def _behaviour_names(value: Any) -> list[str]:
    return pairing.behaviours_on(value) or []  # (diff's and runs' reading of the record)


def open_store(db: str | None) -> bool:
    """Check the database and load the runs; on failure show one st.error line and return False."""
    if not db:
        st.error(f"No database given: start with `kvtrace dashboard --db PATH` (or set {DB_ENV}).")
        return False
    if not is_clickhouse(db) and not Path(db).exists():  # (a directory: the store's own line says so)
        st.error(f"{ui.literal(db)}: no such database file. Create it with `kvtrace demo` or "
                 f"{ui.code(f'kvtrace replay TRACE --db {shell_path(db)}')}.")
        return False
    key = _key(db)
    try:
        frame = _runs(db, key)
    except KVTraceError as err:
        st.error(ui.literal(err))
        return False
    except Exception as err:  # a foreign or damaged file must not show a traceback
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        st.error(ui.literal(f"{state.shown_db(db)}: cannot read as a kvtrace store ({first})"))
        return False
    st.session_state[CTX_KEY] = {"db": db, "runs": frame, "key": key}
    if frame.height == 0:
        # a link's run (from another store, or not written yet): named, as a store with runs names
        # it (a store of curves alone showed its Capacity page as if the run were there)
        state.warn_unknown("run", [], "Run", "it holds no runs yet.", ui.code(state.shown_db(db)))
        if not curves_only():
            ui.empty("This store has no runs yet.")
        return False
    return True


def curves_only() -> bool:
    """Whether the opened store holds capacity curves and no run (`kvtrace curve --db` in
    cache-only mode records its points alone): the Capacity page still shows them."""
    ctx = st.session_state.get(CTX_KEY)
    return ctx is not None and ctx["runs"].height == 0 and call("curves").height > 0


def context() -> dict[str, Any]:
    return st.session_state[CTX_KEY]


def runs() -> pl.DataFrame:
    return context()["runs"]


def run_row(run_id: str) -> dict[str, Any]:
    frame = runs().filter(pl.col("run_id") == run_id)
    return frame.row(0, named=True) if frame.height else {}


def summary(run_id: str) -> dict[str, Any]:
    return _json(run_row(run_id).get("summary")) or {}


def config(run_id: str) -> dict[str, Any]:
    return _json(run_row(run_id).get("config")) or {}


def checks_content(run_id: str) -> bool:
    """Whether the run checked block content (an engine replay, without ``--no-content``):
    only such a run finds stale hashes and divergent outputs, so only its zero means a
    correct cache (cache-only, ``--no-content`` and live runs measure neither; a collected
    run did where its sender's summary counts its stale hashes)."""
    row = run_row(run_id)
    if row.get("mode") == "otlp":
        # a collected run's summary is its sender's: a kvtrace engine replay with content counts
        # its stale hashes (Overview showed that 0 while this said no content was checked); one
        # without content, or any other sender, says null or nothing
        counted = summary(run_id).get("stale_hashes")
        return isinstance(counted, int) and not isinstance(counted, bool)
    return row.get("mode") == "engine" and config(run_id).get("content") is not False


# --- compositions of the read API --------------------------------------------------------
def hit_counters(run_id: str) -> dict[str, Any]:
    """The run's vLLM hit counters and rates (``kvtrace.metrics``) from the store: the
    numbers of its summary, read from the one definition."""
    return call("hit_counters", run_id)


def percentiles(run_id: str) -> tuple[float, ...]:
    """The percentiles the run's summary reports (its replay's ``--percentiles``), lowest
    first: a stored summary's keys come back sorted as text (p10 before p5, p100 before
    p99.9), and the Latency table's columns were in that order."""
    return metrics.summary_percentiles(summary(run_id))


def latency(run_id: str) -> dict[str, Any]:
    """Every latency statistic of the run (modelled), from the store's samples, at the run's
    own percentiles (a run replayed with --percentiles 25,75 showed p50, p90, p99)."""
    return call("latency_summary", run_id, percentiles(run_id))


def no_requests_why(run_id: str) -> str:
    """Why a run has no per-request numbers (no latency, no per-request hits), in its own
    words: a cache-only replay has no clock and writes no request spans, a live capture
    receives cache events alone, and any other run (an engine replay that failed before a
    request finished, a sender's spans) finished none (Compare called such an engine run
    cache-only)."""
    mode = replay_mode(replayed_mode(run_id))  # (a collected replay's: its sender's)
    if mode == "cache-only":
        return "is cache-only (no clock, no request spans)"
    if run_row(run_id).get("mode") == "live":
        return "is a live capture (cache events, no request times)"
    status = run_row(run_id).get("status")
    return "recorded no finished request" + (f" (it is {status})" if status and status != "complete" else "")


def cost_model(run_id: str) -> str | None:
    """The cost model that modelled the run's times (None: no clock, e.g. cache-only)."""
    model = config(run_id).get("cost_model")
    return str(model["name"]) if isinstance(model, dict) and model.get("name") else None


def replayed_mode(run_id: str) -> str | None:
    """The mode the run's events were made in (``metrics.replayed_mode``: a collected replay's
    is its sender's)."""
    return metrics.replayed_mode(run_row(run_id).get("mode"), config(run_id))


def times_word(*run_ids: str) -> str:
    """'modelled', 'recorded' or 'no times' (``metrics.times_word``): how the runs' latencies are labelled."""
    return metrics.times_word(*((replayed_mode(r), cost_model(r)) for r in run_ids))


def time_axis(run_id: str) -> str:
    """The title of the run's time axes: the engine's modelled clock (a collected run's too,
    where its record names the cost model), else what its span times are."""
    mode = str(replayed_mode(run_id) or "")
    if cost_model(run_id) or mode == "engine":
        return charts.VIRTUAL_TIME
    if mode.startswith("cache-only"):
        return "request order (no clock: 1 ms a request)"
    if mode == "live":
        return "time (s, vLLM's event timestamps)"
    return "time (s, as the sender sent them)"


def window_label(run_id: str) -> str:
    """The time-window slider's label: a virtual time window on a replay's modelled clock
    (``time_axis``), else a time window (a live capture's times are vLLM's event timestamps, a
    sender's its own, a cache-only run's its request order: it was "Virtual time window" on all)."""
    return "Virtual time window" if time_axis(run_id) == charts.VIRTUAL_TIME else "Time window"


def times_caption(run_id: str) -> str:
    """Where the run's times come from, in diff's words (``metrics.times_source``): every
    latency view says so (issue 18)."""
    model, row = cost_model(run_id), run_row(run_id)
    if model is None and row.get("damage") and row.get("mode") == "engine":
        # (a damaged record's settings are not read: an engine run's cost model is unknown, not
        # "none (no clock: cache-only)" beside its "(modelled)" tables)
        return (f"{metrics.MODELLED} by a cost model not named here: this run's stored settings are damaged, so not "
                "read (virtual time, not measured)")
    source = metrics.times_source(replayed_mode(run_id), model, ui.code)
    return f"{source} (virtual time, not measured)" if model else source


@dataclass(frozen=True)
class BeladyBound:
    """The Belady (offline-optimal) bound for one run: ``run``, a cache-only Belady run of
    the same trace at the same ``capacity``, or None; ``others``: the capacities of the
    trace's Belady runs that do not match (None for one whose config stores none)."""

    capacity: run_config.Capacity | None
    run: dict[str, Any] | None
    others: tuple[run_config.Capacity | None, ...]


def belady_bound(run_id: str) -> BeladyBound:
    """Find the Belady run that bounds ``run_id``: same trace digest, stored policy
    ``belady`` (only cache-only configs store a policy), and the same capacity as
    ``run_id``'s stored config and summary (``run_config.capacity``: a run at the trace's
    own block size stores it in its summary); the newest one when several match."""
    row = run_row(run_id)
    want = run_config.capacity(config(run_id), summary(run_id))
    digest = row.get("trace_digest")
    if not digest:
        return BeladyBound(want, None, ())
    others: list[run_config.Capacity | None] = []
    same_trace = runs().filter((pl.col("trace_digest") == digest) & (pl.col("run_id") != run_id))
    for other in same_trace.iter_rows(named=True):  # newest first
        cfg = _json(other.get("config")) or {}
        if cfg.get("policy") != "belady":
            continue
        have = run_config.capacity(cfg, _json(other.get("summary")) or {})
        if want is not None and have == want:
            return BeladyBound(want, other, ())
        others.append(have)
    return BeladyBound(want, None, tuple(others))


def comparable_runs(run_id: str) -> pl.DataFrame:
    """Runs of the same trace, by ``pairing.same_trace`` (kvtrace diff's and
    ``kvtrace dashboard --compare``'s rule too)."""
    row = run_row(run_id)
    if not row.get("trace_digest") and row.get("trace_source") is None:
        return runs().clear()  # nothing names its trace: no run is known to share it
    frame = runs().filter(pl.col("run_id") != run_id)
    return frame.filter(pl.Series([pairing.same_trace(row, other) for other in frame.iter_rows(named=True)],
                                  dtype=pl.Boolean))


def default_partner(run_id: str) -> str | None:
    """Compare's default B: the newest run of the same trace, mode and capacity that
    differs from ``run_id`` in exactly one setting (``kvtrace.compare.pairing``)."""
    found = pairing.partner(run_row(run_id), comparable_runs(run_id).iter_rows(named=True))
    return None if found is None else str(found["run_id"])


@st.cache_data(show_spinner=False, max_entries=32)
def _diff(db: str, key: tuple, run_a: str, run_b: str) -> RunDiff:
    return diff_runs(db, run_a, run_b, force=True)


def run_diff(run_a: str, run_b: str) -> RunDiff:
    """``kvtrace diff A B`` (its defaults: seed 0, 1000 resamples, percentiles 50, 90, 99),
    so the page shows the CLI's numbers, bootstrap CIs and Markdown."""
    ctx = context()
    return _diff(ctx["db"], ctx["key"], run_a, run_b)


def request_diff(run_a: str, run_b: str) -> pl.DataFrame:
    """Per request in both runs: cached tokens (local + external at first schedule), the
    local cache's share of them, and TTFT in A and B, and B - A (request ids are unique in
    a replay; a repeated id in a foreign store is summed, not multiplied by the join)."""
    a = _per_request(run_a).select("request_id", "num_prompt_tokens", pl.col("num_cached_tokens").alias("cached_a"),
                                   pl.col("num_local_hit_tokens").alias("local_a"),
                                   pl.col("ttft_ns").alias("ttft_a_ns"))
    b = _per_request(run_b).select("request_id", pl.col("num_cached_tokens").alias("cached_b"),
                                   pl.col("num_local_hit_tokens").alias("local_b"),
                                   pl.col("ttft_ns").alias("ttft_b_ns"))
    return (
        a.join(b, on="request_id", how="inner")
        .with_columns(
            (pl.col("cached_b") - pl.col("cached_a")).alias("cached_delta"),
            ((pl.col("ttft_b_ns") - pl.col("ttft_a_ns")) / 1e6).alias("ttft_delta_ms"),
        )
        .sort("request_id")
    )


def _per_request(run_id: str) -> pl.DataFrame:
    hits = call("per_request_hits", run_id)
    if hits["request_id"].n_unique() == hits.height:
        return hits
    return hits.group_by("request_id").agg(
        pl.col("num_prompt_tokens", "num_cached_tokens", "num_local_hit_tokens").sum(), pl.col("ttft_ns").max())


@st.cache_data(show_spinner=False, max_entries=64)
def _extent(db: str, key: tuple, run_id: str) -> tuple[int, int, int, int]:
    """(time origin ns, first time ns, end ns, requests), read once from the spans and reduced
    to four numbers: the requests' arrivals and finishes, and for a run on its sender's clock
    also its evictions (a live capture has no requests). The origin is 0 on kvtrace's virtual
    clock (a replay's: its trace's own times), else the first time read: a live capture's
    windows start at its wall clock's ns since 1970, which a window from 0 s never reached.

    A finished replay's summary is not read for it: its ``virtual_duration_s`` runs from its
    first arrival, not from 0, and a replay of a trace whose first request arrives late (a
    slice of a Mooncake trace from 532 s) got a time window of 0 to 14 s, every windowed chart
    'outside it: widen the window', and a slider that could not reach it."""
    record = read.run(db, run_id)
    first, last, num_requests = read.request_extent(db, run_id)
    frames = [pl.DataFrame({"lo": [first], "hi": [last]}, schema={"lo": pl.Int64, "hi": pl.Int64})]
    # (the mode its events were made in: a collected replay, stored as "otlp", is on its sender's
    # virtual clock, where its first time was taken for its origin: 0-44 s beside its direct twin's 0-650 s)
    made = replay_mode(metrics.replayed_mode(record.get("mode"), record.get("config")))
    virtual = made is not None  # (cache-only's is cache-only/POLICY)
    if not virtual:  # (the windows' starts: within one window of the first and last eviction)
        evicted = read.evictions_over_time(db, run_id)
        frames.append(evicted.select(pl.col("window_start_ns").min().alias("lo"),
                                     pl.col("window_start_ns").max().alias("hi")))
    if num_requests == 0:
        # A cache-only replay writes no request spans: its lookups (a step each) are its time
        # axis. Read from nothing, its length was 0 and every window 0 to 1 s: the Hit rate
        # and Evictions pages of a run of 3,993 requests showed its first 1,000 alone; one
        # collected from its sender started at its first eviction, its lookups before it unshown.
        starts: list[int] = hit_counters_over_time_starts(db, run_id).to_list()
        if starts:
            gaps = [b - a for a, b in itertools.pairwise(starts) if b > a]
            # (the last window's end: its start and one window, the least gap between starts; of
            # one window, a cache-only step: a one-lookup run's slider spanned 1 ns)
            last = min(gaps) if gaps else metrics.CACHE_ONLY_STEP_NS if made == "cache-only" else 1
            frames.append(pl.DataFrame({"lo": [min(starts)], "hi": [max(starts) + last]}))
    lo, end = pl.concat([f.cast(pl.Int64) for f in frames]).select(
        pl.col("lo").min().fill_null(0), pl.col("hi").max().fill_null(0)).row(0)
    return (0 if virtual else lo), lo, end, num_requests


def hit_counters_over_time_starts(db: str, run_id: str) -> pl.Series:
    """The window starts (ns) of the run's admissions at the store's own window length: where
    its lookups lie in time when no request span says so (a cache-only replay's)."""
    return read.hit_counters_over_time(db, run_id)["window_start_ns"].cast(pl.Int64)


def extent(run_id: str) -> tuple[int, int]:
    """(length ns from the run's time origin, requests)."""
    ctx = context()
    _, _, end, n = _extent(ctx["db"], ctx["key"], run_id)
    return max(end - time_origin(run_id), 0), n


def time_origin(run_id: str) -> int:
    """Where the run's time axis starts, in its spans' ns: 0 for a replay, else its first
    time (``_extent``) floored to the run's window (``window_ns``), where the first
    window starts."""
    ctx = context()
    lo = _extent(ctx["db"], ctx["key"], run_id)[0]  # (0 for a replay)
    w = window_ns(run_id)
    return lo // w * w if w else lo


def time_extent_s(run_id: str) -> float:
    """The run's length in seconds from its time origin, for the time-window slider."""
    return extent(run_id)[0] / 1e9


@st.cache_data(show_spinner=False, max_entries=64)
def _slowest_requests(db: str, key: tuple, run_id: str, limit: int) -> pl.DataFrame:
    """The ``limit`` slowest requests by TTFT, from the narrow per-request frame (the full
    requests frame is ~2x slower on large runs); only these rows are cached."""
    reqs = read.per_request_hits(db, run_id)
    return reqs.sort(["ttft_ns", "request_id"], descending=[True, False], nulls_last=True).head(limit)


@st.cache_data(show_spinner=False, max_entries=64)
def _one_request(db: str, key: tuple, run_id: str, request_id: str) -> pl.DataFrame:
    return read.per_request_hits(db, run_id).filter(pl.col("request_id") == request_id).head(1)


REQUEST_CHOICES = 500  # the request picker offers this many slowest requests


def request_choices(run_id: str, wanted: str | None) -> pl.DataFrame:
    """The request picker's rows: the REQUEST_CHOICES slowest requests, plus ``wanted``
    (from the URL) if it exists."""
    ctx = context()
    db, key = ctx["db"], ctx["key"]
    top = _slowest_requests(db, key, run_id, REQUEST_CHOICES)
    if wanted is not None and wanted not in set(top["request_id"].to_list()):
        top = pl.concat([top, _one_request(db, key, run_id, wanted)])
    return top


def request_has_spans(run_id: str, request_id: str) -> bool:
    """Whether any span of ``run_id`` names ``request_id``: a request without a finished
    request span (still in flight when the run stopped) has its lookups and cache spans."""
    return call("request_span_count", run_id, request_id) > 0


def span_count(run_id: str, name: str) -> int:
    """How many spans named ``name`` the run holds (``read.span_counts``)."""
    counts = call("span_counts", run_id)
    return int(counts.filter(pl.col("name") == name)["spans"].sum()) if counts.height else 0


def none_finished(run_id: str) -> str | None:
    """Why a run that looked requests up has no hit counters, where none of its requests has
    finished (every request counted once, from the request span written as it finishes: a
    run killed before its first, or still replaying toward it); None otherwise. Its pages said
    "no request was scheduled" and "no lookups recorded" beside the lookups of the requests in
    flight."""
    lookups = span_count(run_id, SPAN_LOOKUP)
    if not lookups or call("hit_counters", run_id).get("requests"):
        return None
    status = run_row(run_id).get("status")
    when = "yet" if status == "running" else "before it stopped" if status != "complete" else ""
    return (f"No request of this run finished {when}".rstrip() + f" ({lookups:,} lookup spans of requests in "
            "flight): each request's hits are counted once, from the request span written when it finishes.")


def shared_pool(run_id: str) -> bool:
    """Whether the run's KV groups share one block pool (``run_config.shared_pool``)."""
    return run_config.shared_pool(config(run_id))


def group_names(run_id: str) -> dict[int, str]:
    """Display names of a run's KV groups (``run_config.group_labels`` of its stored config)."""
    return run_config.group_labels(config(run_id))


def group_rate_labels(run_id: str) -> dict[int, str]:
    """'group 0: attention group hit rate' per KV group: the per-group metric's own name."""
    kinds = {g: run_config.GROUP_KINDS.get(str(spec.get("type"))) for g, spec in
             enumerate(run_config.stored_groups(config(run_id)))}
    return {g: f"group {g}: {metrics.group_hit_rate_label(k)}" for g, k in kinds.items()}


REQUESTS_PER_WINDOW = 4
MIN_WINDOWS = 20


def windows_for(num_requests: int) -> int:
    """How many windows the dashboard splits a run into: one per REQUESTS_PER_WINDOW
    requests, within MIN_WINDOWS..read.DEFAULT_WINDOWS, so small runs get readable curves
    and large runs keep ~200 points."""
    return min(read.DEFAULT_WINDOWS, max(MIN_WINDOWS, num_requests // REQUESTS_PER_WINDOW))


def window_ns(run_id: str) -> int | None:
    """The window length of every windowed chart of ``run_id``: ``read.nice_window`` over
    its virtual duration with ``windows_for`` its requests; None (the store picks) when the
    duration is unknown."""
    ctx = context()
    _, lo, end, n = _extent(ctx["db"], ctx["key"], run_id)  # (lo: the first time, a late-starting replay's too)
    if not n and replay_mode(replayed_mode(run_id)) is not None:  # (a collected one's: its sender's)
        return None  # (a replay without request spans, cache-only: the store's window over its spans, as always)
    return read.nice_window(end - lo, windows_for(n)) if end > lo else None


HIST_BINS = 100  # bins of the latency histograms (exact counts from the samples)


TOP_PREFIXES = 10  # the Sankey names this many hot prefixes; the rest are 'other'


def attribution_flows(run_id: str, att: pl.DataFrame | None = None) -> pl.DataFrame:
    """read.eviction_attribution_flows(top_prefixes=TOP_PREFIXES), folded from the cached
    attribution frame so the page runs the (expensive) attribution join once:
    (publish_kind, evict_reason, prefix) -> misses; of ``att`` (those rows of that frame,
    a time window's) when given."""
    att = call("eviction_attribution", run_id) if att is None else att
    if att.height == 0:
        return pl.DataFrame(schema={"publish_kind": pl.String, "evict_reason": pl.String, "prefix": pl.String,
                                    "misses": pl.UInt32})
    top = (att.group_by("root_hash").len().sort(["len", "root_hash"], descending=[True, False])
           .head(TOP_PREFIXES)["root_hash"].to_list())
    return (
        att.with_columns(
            pl.col("publish_kind").fill_null("none"),
            pl.when(pl.col("root_hash").is_in(top)).then(pl.col("root_hash")).otherwise(pl.lit("other")).alias("prefix"),
        )
        .group_by("publish_kind", "evict_reason", "prefix").len(name="misses")
        .sort(["misses", "publish_kind", "evict_reason", "prefix"], descending=[True, False, False, False])
    )


def prefix_labels(run_id: str, root_hashes: list[str]) -> dict[str, str]:
    """A reader's name for each prefix family: a short hash, the request that first looked
    it up and its prompt length, and the longest hit it got ("d393a5d5 · first r7 (4,053
    tokens) · longest hit 2,688")."""
    roots = sorted({h for h in root_hashes if h and h != "other"})
    if not roots:
        return {}
    fam = call("prefix_families", run_id, roots)
    return {r["root_hash"]: (f"{ui.short_hash(r['root_hash'])} · first {r['first_request_id']} "
                             f"({r['first_prompt_tokens'] or 0:,} tokens) · longest hit {r['longest_hit_tokens']:,}")
            for r in fam.iter_rows(named=True)}


def capacity_marks(trace_digest: str, block_size: int, selected: str) -> list[tuple[str, float, float, bool]]:
    """The complete runs of a trace placed on its capacity curve: (label, capacity in the
    curve's ``block_size``-token blocks, prefix cache hit rate, is ``selected``). A run's capacity
    is its stored one (``run_config.capacity``: an engine run's full-attention group)."""
    marks = []
    for r in call("capacity_marks", trace_digest).iter_rows(named=True):
        cfg = _json(r["config"])
        cap = run_config.capacity(cfg, summary(r["run_id"])) if isinstance(cfg, dict) else None
        if cap is None or r["prefix_cache_hit_rate"] is None:
            continue
        marks.append((f"{r['run_id']} ({r['mode']})", cap.blocks * cap.block_size / block_size,
                      float(r["prefix_cache_hit_rate"]), r["run_id"] == selected))
    return marks
