"""Run comparison from the store: ``diff_runs(db, run_a, run_b)`` -> ``RunDiff``.

Reads both runs only through ``kvtrace.store.read`` and hands plain summaries and polars
frames to the pure builders of ``model`` and ``bootstrap``. Runs of different traces
are refused unless forced: a diff is an isolated measurement only on the same trace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import duckdb
import polars as pl

from kvtrace.compare.bootstrap import ci_note, latency_shifts
from kvtrace.compare.model import (
    RequestHitDiff,
    RunDiff,
    block_sizes_differ,
    count_shifts,
    diff_summaries,
    events_mode,
    finite_number,
    request_hit_diff,
    with_latency_findings,
    without_block_deltas,
)
from kvtrace.compare.options import DEFAULT_RESAMPLES, check_diff_options, check_diff_runs
from kvtrace.compare.pairing import behaviours_on, same_trace
from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.metrics import (
    BLOCK_UNIT_KEYS,
    DEFAULT_PERCENTILES,
    NS_PER_MS,
    definitions_note,
    is_latency_key,
    recorded_definitions,
    replayed_mode,
    run_backend,
)
from kvtrace.names import printable, run_kind, shown_value
from kvtrace.store import read
from kvtrace.store.errors import StoreError


def diff_runs(
    db: Any,
    run_a: str,
    run_b: str,
    *,
    force: bool = False,
    seed: int = 0,
    top: int = 10,
    resamples: int = DEFAULT_RESAMPLES,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> RunDiff:
    """Compare runs ``run_a`` (baseline) and ``run_b`` (candidate) stored in ``db``.

    Raises KVTraceError (one line) for an unknown run, and for runs of different traces
    unless ``force`` (the diff is then marked ``forced``). ``seed`` and ``resamples`` drive
    the latency bootstrap, at ``percentiles`` (0..100, as vllm bench serve's
    --metric-percentiles); ``top`` bounds the per-request gained/lost lists. Each is
    checked first (ConfigError naming its option).
    """
    check_diff_options(seed, top, resamples)
    check_diff_runs(run_a, run_b, force)
    run_a, run_b = str.__str__(run_a), str.__str__(run_b)  # (a str subclass's own __eq__ or __repr__ never runs)
    percentiles = _checked_percentiles(percentiles)
    view = StoreView(db)
    # Everything both runs' comparison reads, from one committed state of the store (the
    # bootstrap computed after, the store let go): a running run diffed with itself read
    # requests 1,226 as A and 1,301 as B, its summary and its frames at other moments.
    try:
        with read.one_snapshot(db):  # (one committed state for the whole read, as summaries use it)
            info_a, info_b, same = _read(view, db, run_a, run_b, force)
        return _diff(view, run_a, run_b, info_a, info_b, same, seed, top, resamples, percentiles)
    except (duckdb.Error, pl.exceptions.PolarsError) as err:  # values no run of kvtrace's holds
        text = " ".join(str(err).split())[:200]
        raise StoreError(str(db), f"damaged kvtrace store: runs {run_a} and {run_b} hold values their "
                                  f"comparison cannot compute ({type(err).__name__}: {text})") from None


def _read(view: StoreView, db: Any, run_a: str, run_b: str, force: bool) -> tuple[dict[str, Any], dict[str, Any],
                                                                                  bool]:
    """Both runs' records, the same-trace check (its refusal), and every frame ``_diff`` reads
    (``StoreView.preload``): the runs' infos and whether they replay one trace."""
    info_a, info_b = view.run_info(run_a), view.run_info(run_b)
    same = same_trace(view.run_row(run_a), view.run_row(run_b))  # (pairing's rule: one rule of a same trace)
    if not same and not force:
        a, b = _trace_label(info_a), _trace_label(info_b)
        # one file read two ways (another --limit, --trace-block-size or --format) is different requests too
        if a != b:
            which = f"{a!r} vs {b!r}"
        elif str(a).startswith("gen:"):  # (a generated workload: another seed generates other requests)
            which = f"{a!r}, generated differently (another --limit or --seed)"
        else:  # (or the file itself changed between the runs: their configs keep no --limit or --format to tell)
            which = (f"{a!r}, read differently (another --limit, --trace-block-size or --format) or changed between "
                     "the runs")
        # (a live capture replays nothing: two captures of other servers "replayed different traces")
        live = "live" in (info_a.get("replayed_mode"), info_b.get("replayed_mode"))
        what = "come from different sources" if live else "replay different traces"
        raise KVTraceError(f"{db}: runs {run_a} and {run_b} {what} ({which}); pass --force to compare anyway")
    view.preload(run_a, run_b)
    return info_a, info_b, same


def _trace_label(info: dict[str, Any]) -> str | None:
    """How a refusal names a run's trace: its source, else (a run collected without its
    trace's name: "None, read differently (another --limit ...)") its trace digest."""
    digest = info.get("trace_id")
    return info.get("trace") or (f"trace digest {str(digest)[:16]}" if digest else None)


def _diff(view: StoreView, run_a: str, run_b: str, info_a: dict[str, Any], info_b: dict[str, Any], same: bool,
          seed: int, top: int, resamples: int, percentiles: Sequence[float]) -> RunDiff:
    summary_a, summary_b = view.summary(run_a), view.summary(run_b)
    view.fill_percentiles(run_a, summary_a, summary_b)
    view.fill_percentiles(run_b, summary_b, summary_a)
    unknown = _trace_block_sizes(view, (run_a, summary_a), (run_b, summary_b), same)
    diff = diff_summaries(summary_a, summary_b, run_a=info_a, run_b=info_b, ci_verdicts=True)
    diff.same_trace, diff.forced = same, not same
    if unknown:
        # (a failed cache-only run at the trace's block size: its evictions were set against another
        # run's 32-token blocks, +21.7%, and a gate on them failed)
        which = " and ".join(unknown)
        without_block_deltas(diff, f"the block size of {which} is unknown",
                             f"the block size of run {which} is unknown (it replayed at the trace's and kept no "
                             f"summary to say it): {', '.join(BLOCK_UNIT_KEYS)} and the evicted blocks may count "
                             "other units, so they have no delta")
    hits_a, hits_b = view.per_request_hits(run_a), view.per_request_hits(run_b)
    # (its mode as kvtrace names it, never the stored text: a note is rendered as kvtrace's own markdown)
    # (a collected replay's as its sender's mode: "A (collected)" hid why it holds none)
    silent = [f"{side} ({run_kind(events_mode(info))})" for side, info, hits, summary in
              (("A", info_a, hits_a, summary_a), ("B", info_b, hits_b, summary_b))
              if hits.height == 0 and (summary.get("requests") or 0) > 0]
    other = _pair_requests(diff, hits_a, hits_b, silent, top)
    # (evicted blocks: of two block sizes, no delta, as the summary's evictions; the table said +609)
    same_units = not block_sizes_differ(summary_a, summary_b) and not unknown
    by_reason = view.evictions_by_reason(run_a), view.evictions_by_reason(run_b)
    # a run that counts evictions but records no evicted block (a Belady bound): its split is
    # unknown, not zero (the table said "lru 457 -> 0, -457" beside the summary's 457 -> 457)
    unsplit = [f"{side} ({run_kind(events_mode(info))})" for side, info, frame, summary in
               (("A", info_a, by_reason[0], summary_a), ("B", info_b, by_reason[1], summary_b))
               if (finite_number(summary.get("evictions")) or 0) > 0 and int(frame["count"].sum() or 0) == 0]
    if unsplit:
        # (each run's policy named: "run A (cache-only) and B (cache-only) counts" said neither which was
        # the bound nor, in the plural, a sentence)
        policies = [f"{side} {p}" for side, run in (("A", run_a), ("B", run_b))
                    if (p := _policy(view.run_row(run).get("config")))]
        whose = f"; policies: {', '.join(policies)}" if policies else ""
        subject = (f"runs {unsplit[0]} and {unsplit[1]} count evictions but record" if len(unsplit) > 1
                   else f"run {unsplit[0]} counts evictions but records")
        diff.notes.append(f"{subject} no evicted blocks (a Belady bound records none{whose}): evictions are not "
                          "broken down by reason or publish kind")
    else:
        diff.evictions_by_reason = count_shifts(*by_reason, "reason", comparable=same_units)
        diff.evictions_by_publish_kind = count_shifts(
            view.evictions_by_publish_kind(run_a), view.evictions_by_publish_kind(run_b), "publish_kind",
            comparable=same_units,
        )
    _add_latency(diff, view.latency(run_a), view.latency(run_b), seed, resamples, percentiles, pair=not other)
    backends = {info_a.get("backend"), info_b.get("backend")}
    live = [side for side, info in (("A", info_a), ("B", info_b)) if events_mode(info) == "live"]
    if live and len(live) < 2 and diff.evictions_by_publish_kind:
        # (a capture infers nothing: "the vllm backend infers publish kinds" was said of one)
        diff.notes.append(f"{live[0]} is a live capture: vLLM's KV events name no publish kind or eviction reason "
                          "(stored as `vllm_stored` and `vllm_removed`), so a shift between those and the replay's "
                          "kinds and reasons is that labelling, not a change")
    elif backends == {"kvtrace", "vllm"} and diff.evictions_by_publish_kind:
        # (diff printed "boundary -15 / full +15" between backends as a change: it is the labelling)
        diff.notes.append("A and B ran on different backends (kvtrace's and vLLM's own manager): the vllm backend "
                          "infers publish kinds and eviction reasons, and shows kvtrace's `boundary` publishes as "
                          "`full`, so a shift between those kinds is that labelling, not a change "
                          "(docs/cache_semantics.md)")
    if note := definitions_note(info_a["definitions"], info_b["definitions"]):
        diff.notes.insert(0, note)  # (first: every number below may differ for it)
    diff.divergent_requests = {"a": view.divergent_requests(run_a), "b": view.divergent_requests(run_b)}
    if not diff.metrics and not diff.latency:  # (an empty table, exit 0, said nothing was compared)
        raise KVTraceError(f"{view.db}: runs {run_a} (mode {info_a.get('mode')}) and {run_b} (mode "
                           f"{info_b.get('mode')}): nothing to compare: neither a replay summary nor request "
                           "latencies in both")
    return diff


def _pair_requests(diff: RunDiff, hits_a: pl.DataFrame, hits_b: pl.DataFrame, silent: list[str], top: int) -> int:
    """``diff.requests``, the per-request changes of cached tokens, where both runs hold them
    and their ids name the same requests; how many shared ids name other prompts (then none
    is paired, in the latency bootstrap either)."""
    other, common = _other_prompts(hits_a, hits_b)
    if other:
        # one id, two prompts (two seeds of a generated workload, two files, forced): pairing them
        # counted "9 gained, 5 lost" between unrelated requests, and resampled them as one
        diff.requests = RequestHitDiff()
        diff.notes.append(f"{other:,} of the {common:,} request ids both runs hold have other prompt lengths in A "
                          "and B: they name other requests, so none is paired (no per-request changes; each run's "
                          "latencies resampled on its own)")
    elif silent and (hits_a.height or hits_b.height):
        # a cache-only run keeps no per-request hits: the other's requests were called "only in A"
        # (an empty record, not None: callers read its counts)
        diff.requests = RequestHitDiff()
        diff.notes.append(f"run {' and '.join(silent)} records no per-request hits: per-request cached tokens "
                          "are not compared")
    else:
        diff.requests = request_hit_diff(hits_a, hits_b, top=top)
    return other


def _add_latency(diff: RunDiff, latency_a: dict[str, pl.DataFrame], latency_b: dict[str, pl.DataFrame], seed: int,
                 resamples: int, percentiles: Sequence[float], *, pair: bool) -> None:
    """The TTFT/ITL percentile shifts and their bootstrap CIs, and the summary rows' verdicts from them."""
    diff.latency, diff.bootstrap = latency_shifts(
        latency_a, latency_b, seed=seed, resamples=resamples, percentiles=percentiles, per_unit=NS_PER_MS, pair=pair,
    )
    diff.metrics = with_latency_findings(diff.metrics, diff.latency)
    if note := ci_note(diff.bootstrap.get("no_ci", [])):
        diff.notes.append(note)


def diff_results(
    summary_a: dict[str, Any],
    per_request_a: Sequence[dict[str, Any]],
    summary_b: dict[str, Any],
    per_request_b: Sequence[dict[str, Any]],
    *,
    run_a: dict[str, Any],
    run_b: dict[str, Any],
    seed: int = 0,
    top: int = 10,
    resamples: int = DEFAULT_RESAMPLES,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> RunDiff:
    """Compare two replays kept in memory (``RunResult.summary`` and ``.per_request``: a study
    without a store) as ``diff_runs`` compares them stored, from what they keep: the summaries,
    and for engine runs the per-request cached tokens and the TTFT/ITL bootstrap, so a study's
    verdicts are the same with and without ``--db``. Evictions by reason and divergent requests
    come from spans: a store's alone."""
    check_diff_options(seed, top, resamples)
    percentiles = _checked_percentiles(percentiles)
    _check_kept(summary_a=summary_a, per_request_a=per_request_a, summary_b=summary_b, per_request_b=per_request_b,
                run_a=run_a, run_b=run_b)
    diff = diff_summaries(summary_a, summary_b, run_a=run_a, run_b=run_b, ci_verdicts=True)
    kept_a, kept_b = _kept_requests(per_request_a), _kept_requests(per_request_b)
    if kept_a is None or kept_b is None:  # (a cache-only run: no latencies, and none of its hits per request stored)
        return diff
    (hits_a, latency_a), (hits_b, latency_b) = kept_a, kept_b
    other = _pair_requests(diff, hits_a, hits_b, [], top)
    _add_latency(diff, latency_a, latency_b, seed, resamples, percentiles, pair=not other)
    return diff


_KEPT_REQUEST_KEYS = ("request_id", "prompt_tokens", "hit_tokens", "ttft_ns", "itl_ns")  # (what _kept_requests reads)


def _check_kept(**given: Any) -> None:
    """A ConfigError naming the argument for an API caller's replay kept in memory that is not
    what RunResult keeps: a summary or run record that is no dict, per-request rows that are
    no list of dicts, or an engine run's rows without a key the comparison reads (each was a
    TypeError, AttributeError, KeyError or numpy truth ValueError inside the comparison)."""
    for name, value in given.items():
        if name.startswith("per_request"):
            rows = value if isinstance(value, (list, tuple)) else None
            bad = None if value is None else shown_value(value) if rows is None else next(
                (shown_value(r) for r in rows if not isinstance(r, Mapping)), None)
            if bad is not None:
                raise ConfigError(name, bad, "expected a replay's per-request rows, a list of dicts "
                                             "(RunResult.per_request)")
            if rows and "ttft_ns" in rows[0]:  # (an engine run's: read below)
                for row in rows:
                    missing = next((k for k in _KEPT_REQUEST_KEYS if k not in row), None)
                    if missing is not None:
                        raise ConfigError(name, shown_value(row), f"expected each row to hold {missing!r}")
        elif not isinstance(value, Mapping) and not (name.startswith("run_") and value is None):
            what = "a run's record, a dict (RunResult.record)" if name.startswith("run_") else \
                "a replay's summary, a dict (RunResult.summary)"
            raise ConfigError(name, shown_value(value), f"expected {what}")


def _kept_requests(per_request: Sequence[dict[str, Any]]) -> tuple[pl.DataFrame, dict[str, pl.DataFrame]] | None:
    """An engine run's per-request hits and latency frames, as ``StoreView`` reads them stored
    (None: a run that keeps no latencies, cache-only)."""
    if not per_request or "ttft_ns" not in per_request[0]:
        return None
    ids = [str(r["request_id"]) for r in per_request]
    hits = pl.DataFrame({"request_id": ids, "prompt_tokens": [r["prompt_tokens"] for r in per_request],
                         "cached_tokens": [r["hit_tokens"] for r in per_request]},
                        schema={"request_id": pl.Utf8, "prompt_tokens": pl.Int64, "cached_tokens": pl.Int64})
    ttft = pl.DataFrame({"request_id": ids, "ttft_ms": [r["ttft_ns"] for r in per_request]},
                        schema={"request_id": pl.Utf8, "ttft_ms": pl.Int64}).drop_nulls("ttft_ms")
    gaps = pl.DataFrame({"request_id": ids, "itl_ms": [list(r["itl_ns"]) for r in per_request]},
                        schema={"request_id": pl.Utf8, "itl_ms": pl.List(pl.Int64)}).explode("itl_ms")
    return hits, {"ttft_ms": ttft, "itl_ms": gaps.drop_nulls("itl_ms")}


def _other_prompts(hits_a: pl.DataFrame, hits_b: pl.DataFrame) -> tuple[int, int]:
    """How many of the request ids both runs hold have another prompt length in each (so are
    other requests), and how many they both hold."""
    joined = hits_a.select("request_id", "prompt_tokens").join(
        hits_b.select("request_id", pl.col("prompt_tokens").alias("prompt_b")), on="request_id", how="inner")
    other = joined.filter(pl.col("prompt_tokens").ne_missing(pl.col("prompt_b"))).height
    return other, joined.height


class StoreView:
    """The few frames a diff needs, read through ``kvtrace.store.read`` and renamed to
    the columns the pure builders take. Each run's record is read once."""

    def __init__(self, db: Any):
        self.db = db
        self._runs: dict[str, dict[str, Any]] = {}
        self._read: dict[tuple[Any, ...], Any] = {}  # each frame of a run, read once (``_once``)

    def _once(self, key: tuple[Any, ...], read_it: Callable[[], Any]) -> Any:
        """``read_it()``, read the first time ``key`` is asked for: a run diffed with itself, or
        read again after ``preload``, is read from one state of the store."""
        if key not in self._read:
            self._read[key] = read_it()
        return self._read[key]

    def preload(self, run_a: str, run_b: str) -> None:
        """Read every frame a diff of the two runs reads (inside ``one_snapshot``: one state)."""
        summaries = {run: self.summary(run) for run in (run_a, run_b)}
        self.fill_percentiles(run_a, dict(summaries[run_a]), summaries[run_b])
        self.fill_percentiles(run_b, dict(summaries[run_b]), summaries[run_a])
        for run in (run_a, run_b):
            self.per_request_hits(run)
            self.evictions_by_reason(run)
            self.evictions_by_publish_kind(run)
            self.latency(run)
            self.divergent_requests(run)

    def run_row(self, run_id: str) -> dict[str, Any]:
        """The run's stored row (``read.run``), read once."""
        if run_id not in self._runs:
            self._runs[run_id] = read.run(self.db, run_id)  # UnknownRunError is a KVTraceError
        return self._runs[run_id]

    def run_info(self, run_id: str) -> dict[str, Any]:
        """run_id, name, trace (source), trace_id (digest), mode, behaviours, status, digest,
        cost_model (the name of the model that produced its times; None: no times), its
        cost_model_coefficients, backend, vllm_version, vllm_commit and the metric definitions
        it was recorded under."""
        r = self.run_row(run_id)
        stored = r.get("config")
        config: dict[str, Any] = stored if isinstance(stored, dict) else {}
        return {
            "run_id": run_id,
            "name": r.get("name"),
            "trace": r.get("trace_source"),
            "trace_id": r.get("trace_digest"),
            "mode": r.get("mode"),
            # the mode its events were made in (a collected replay's: its sender's; ``metrics.replayed_mode``)
            "replayed_mode": replayed_mode(r.get("mode"), config),
            "behaviours": behaviours_on(r.get("behaviours")),
            "status": r.get("status"),
            "digest": r.get("digest"),
            "cost_model": _cost_model(r.get("config")),
            "cost_model_coefficients": _cost_model_coefficients(r.get("config")),
            # whose cache manager made its events, and which vLLM (``metrics.backend_label``)
            "backend": run_backend(r.get("mode"), config),
            "vllm_version": config.get("vllm_version"),
            "vllm_commit": config.get("vllm_commit"),
            # the metric definitions its numbers follow (``metrics.recorded_definitions``)
            "definitions": recorded_definitions(r.get("mode"), config),
        }

    def summary(self, run_id: str) -> dict[str, Any]:
        """The run's summary; for a run that keeps none (it failed, was interrupted or is
        still running) but has request spans, vLLM's hit counters and the latency
        statistics of those spans, as every other view reads them (the dashboard's
        Overview showed a failed run's hit rate, its Compare tiles '–')."""
        return dict(self._once(("summary", run_id), lambda: self._summary(run_id)))

    def _summary(self, run_id: str) -> dict[str, Any]:
        row = self.run_row(run_id)
        summary = read.summary_with_spans(self.db, run_id, row.get("summary"))
        if summary and "block_size" not in summary:
            # a run that kept no summary (failed, killed) still recorded its blocks' size in its
            # config: without it, evictions of 256-token blocks were set against 512-token ones
            # (+18.4%), where `runs` listed the run at 39x256
            size = _recorded_block_size(row.get("config"))
            if size is not None:
                summary["block_size"] = size
        return summary

    def fill_percentiles(self, run_id: str, summary: dict[str, Any], other: dict[str, Any]) -> None:
        """The latency percentiles ``other`` holds and ``summary`` lacks (its run recorded
        other ``--percentiles``), from the run's request spans, as the latency section
        computes them: one run held p50 as a number and the other as null, and a gate on
        the number diff printed could not be evaluated."""
        wanted = [k for k, v in other.items() if v is not None and is_latency_key(k) and k.startswith("p")
                  and summary.get(k) is None]
        if not wanted or not summary:
            return
        try:
            qs = sorted({float(k.split("_", 1)[0][1:]) for k in wanted})
        except ValueError:
            return
        computed = self._once(("latency_summary", run_id, tuple(qs)),
                              lambda: read.latency_summary(self.db, run_id, percentiles=qs))
        for k in wanted:
            if computed.get(k) is not None:
                summary[k] = computed[k]

    def per_request_hits(self, run_id: str) -> pl.DataFrame:
        """request_id, prompt_tokens, cached_tokens (local + external: the prefill avoided)."""
        f = self._once(("per_request_hits", run_id), lambda: read.per_request_hits(self.db, run_id))
        return f.select(
            "request_id",
            pl.col("num_prompt_tokens").alias("prompt_tokens"),
            pl.col("num_cached_tokens").alias("cached_tokens"),
        )

    def evictions_by_reason(self, run_id: str) -> pl.DataFrame:
        f = self._once(("evictions_by_reason", run_id), lambda: read.evictions_by_reason(self.db, run_id))
        return f.select("reason", pl.col("blocks").alias("count"))

    def evictions_by_publish_kind(self, run_id: str) -> pl.DataFrame:
        f = self._once(("evictions_by_publish_kind", run_id), lambda: read.evictions_by_publish_kind(self.db, run_id))
        return f.select("publish_kind", pl.col("blocks").alias("count"))

    def divergent_requests(self, run_id: str) -> list[tuple[str, int]]:
        """(request_id, divergent tokens), most first, ties by request id."""
        f = self._once(("divergent_outputs", run_id), lambda: read.divergent_outputs(self.db, run_id))
        if f.height == 0:
            return []
        per = f.group_by("request_id").agg(pl.len().alias("n")).sort(["n", "request_id"], descending=[True, False])
        return [(str(r), int(n)) for r, n in per.iter_rows()]

    def latency(self, run_id: str) -> dict[str, pl.DataFrame]:
        """ttft_ms: one row per request that produced a token; itl_ms: one row per gap;
        both in ns (``NS_PER_MS`` to a reported ms, after the percentiles)."""
        req = self._once(("requests", run_id), lambda: read.requests(self.db, run_id)).drop_nulls("ttft_ns")
        gaps = self._once(("itl_gaps", run_id), lambda: read.itl_gaps(self.db, run_id)).drop_nulls("gap_ns")
        return {
            "ttft_ms": req.select("request_id", pl.col("ttft_ns").alias("ttft_ms")),
            "itl_ms": gaps.select("request_id", pl.col("gap_ns").alias("itl_ms")),
        }


def _cost_model_coefficients(config: Any) -> dict[str, Any] | None:
    """The coefficients of the cost model an engine run's stored config holds (its name
    and the file it came from apart): two models of one name may differ in them (a fitted
    copy, a hand edit)."""
    model = config.get("cost_model") if isinstance(config, dict) else None
    return {k: v for k, v in model.items() if k not in ("name", "source")} if isinstance(model, dict) else None


def _cost_model(config: Any) -> str | None:
    """The name of the cost model an engine run's stored config names (None otherwise)."""
    model = config.get("cost_model") if isinstance(config, dict) else None
    name = model.get("name") if isinstance(model, dict) else None
    return str(name) if name else None


def _policy(config: Any) -> str | None:
    """A cache-only run's eviction policy (lru, belady), as its config records it."""
    policy = config.get("policy") if isinstance(config, dict) and config.get("mode") == "cache-only" else None
    return printable(policy) if isinstance(policy, str) and policy else None


def _uses_trace_block_size(config: Any) -> bool:
    """Whether a run's config says it replayed at its trace's block size (cache-only, no
    ``block_size``: the trace's, which only a summary records)."""
    return isinstance(config, dict) and config.get("mode") == "cache-only" and config.get("block_size") is None


def _trace_block_sizes(view: StoreView, a: tuple[str, dict[str, Any]], b: tuple[str, dict[str, Any]],
                       same: bool) -> list[str]:
    """Fill the block size of a run that kept no summary and replayed at its trace's (a failed
    cache-only run's config says None) where it is sure: the other run replayed the same trace
    at the trace's block size too, and its summary says which. The sides ("A", "B") whose size
    stays unknown."""
    unknown = []
    for side, (run, summary), (other_run, other) in (("A", a, b), ("B", b, a)):
        if not summary or "block_size" in summary or not _uses_trace_block_size(view.run_row(run).get("config")):
            continue
        if same and _uses_trace_block_size(view.run_row(other_run).get("config")):
            size = finite_number(other.get("block_size"))
            if size is not None:
                summary["block_size"] = size
            continue  # (both at the one trace's block size: the same units, whatever it is)
        unknown.append(side)
    return unknown


def _recorded_block_size(config: Any) -> int | None:
    """The block size a run's stored config records, the summary's ``block_size`` (README,
    Metrics): a cache-only run's ``block_size`` (None: the trace's, which only its summary
    says), an engine run's first full-attention group's."""
    if not isinstance(config, dict):
        return None
    if config.get("mode") == "cache-only":
        size = config.get("block_size")
    else:
        cache = config.get("cache")
        groups = cache.get("groups") if isinstance(cache, dict) else None
        full = [g for g in groups or () if isinstance(g, dict) and g.get("type") == "FullAttentionSpec"] \
            if isinstance(groups, list) else []
        size = full[0].get("block_size") if full else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _checked_percentiles(percentiles: Any) -> tuple[float, ...]:
    """An API caller's percentiles as the CLI's --percentiles reads them (a string, a number or
    None was a TypeError in the bootstrap)."""
    from kvtrace.replay.run import check_percentiles

    return check_percentiles(percentiles)
