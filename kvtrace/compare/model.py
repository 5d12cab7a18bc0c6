"""The records of a run comparison and the pure builders that fill them.

Conventions (every module of ``kvtrace.compare`` follows them):

- A is the baseline, B the candidate. Every delta is ``B - A`` and ``rel = (B - A) / |A|``
  (None when A is 0 or missing).
- A metric's *direction* says which way is better: +1 higher, -1 lower, 0 neither (a
  property of the workload, such as ``requests``). ``MetricDelta.verdict`` reads it.

The builders take plain summaries and polars frames, never a store, so that notebooks
and tests can diff anything; ``kvtrace.compare.source`` feeds them from the store.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import polars as pl

from kvtrace.errors import ConfigError, KVTraceError
from kvtrace.metrics import BLOCK_UNIT_KEYS, is_latency_key, percentile_word
from kvtrace.names import replay_mode, shown_value
from kvtrace.store.schema import SUMMARY_FIELDS

METRIC_DIRECTION: dict[str, int] = {
    "prefix_cache_hits": 1,
    "prefix_cache_hit_rate": 1,
    # Not the external tier's hits, their rate or the tokens it served: fewer of them is a loss
    # only where the prompt was computed instead, which local_compute says, and a gain where
    # the local cache kept them (a change that moved hits from the tier to the GPU, the same
    # prompts computed, read as worse on all three).
    "prompt_tokens_by_source.local_cache_hit": 1,
    "prompt_tokens_by_source.local_compute": -1,  # prefill work the cache did not save
    "block_hit_rate": 1,
    "output_tok_per_s": 1,
    "computed_prompt_tokens": -1,  # prefill work the cache did not save (recompute included)
    # Not "evictions": evicting a stale entry is a fix, not a loss; the hit rate and the
    # correctness counts below say whether a change in evictions hurt.
    "stale_hashes": -1,
    "stale_hashes_left": -1,
    "divergent_outputs": -1,
    "table_disagreements": -1,  # Core and Worker disagree on a block table
    "preemptions": -1,
}


# A latency change below a microsecond of modelled time is interpolation between integer-ns
# samples, not a finding: its verdict is "same" (the delta itself is kept exact).
LATENCY_RESOLUTION_MS = 1e-3


def below_latency_resolution(delta_ms: float) -> bool:
    """Whether a latency change (ms) is below LATENCY_RESOLUTION_MS, counted in whole
    nanoseconds: a change of exactly 1 µs, 60.280851 - 60.279851 = 0.000999999... ms in
    floats, was called "same". Not for a NaN or infinite change (no number to round)."""
    if not math.isfinite(delta_ms):
        return False
    return round(abs(delta_ms) * 1e6) < round(LATENCY_RESOLUTION_MS * 1e6)


def metric_direction(name: str) -> int:
    """+1 when a higher ``name`` is better, -1 when lower is (every latency statistic,
    ``kvtrace.metrics.is_latency_key``), 0 when neither."""
    if not isinstance(name, str):  # (None or 5: an AttributeError on endswith)
        raise ConfigError("name", shown_value(name), "expected a metric name, a string")
    name = str.__str__(name)  # (a str subclass's own __eq__ or __hash__ never runs)
    if name in METRIC_DIRECTION:
        return METRIC_DIRECTION[name]
    return -1 if is_latency_key(name) else 0


# ---------------------------------------------------------------------------- records


@dataclass(slots=True, frozen=True)
class MetricDelta:
    name: str
    a: float | None
    b: float | None
    delta: float | None
    rel: float | None  # None when A is 0 or missing
    # A latency percentile the diff's bootstrap gave a CI: whether that CI makes the change a
    # finding (``PercentileShift.significant``); None where there is no CI to read.
    significant: bool | None = None
    # A latency statistic of a diff (``diff_summaries(ci_verdicts=True)`` marks every one): its verdict is a
    # bootstrap CI's (``significant``), none where it has no CI. (A raw "better" of
    # median_ttft_ms came and went with --percentiles, mean/tpot/e2el rows kept raw ones
    # beside README's "no verdict where the CI finds no change".)
    needs_ci: bool = False

    @property
    def verdict(self) -> str:
        """'better' / 'worse' / 'same' / '' (no preferred direction, missing, or a latency
        percentile whose CI holds no change: the summary table called p99_itl_ms "better"
        beside the percentile table's interval [-0.56, +0.75] that finds nothing; or a
        latency statistic of a diff that has no CI at all, ``needs_ci``)."""
        if self.delta is None:
            return ""
        if self.delta == 0 or (is_latency_key(self.name) and below_latency_resolution(self.delta)):
            return "same"
        d = metric_direction(self.name)
        if d == 0 or self.significant is False or (self.needs_ci and self.significant is None):
            return ""
        return "better" if self.delta * d > 0 else "worse"


@dataclass(slots=True, frozen=True)
class PercentileShift:
    """One latency percentile in both runs, with the bootstrap CI of ``delta``."""

    metric: str  # ttft_ms | itl_ms
    percentile: float
    a: float
    b: float
    delta: float
    ci_low: float  # NaN when it could not be estimated
    ci_high: float

    @property
    def name(self) -> str:
        """vllm bench serve's key: p99_ttft_ms (the summary's name of the same percentile)."""
        return f"p{percentile_word(self.percentile)}_{self.metric.removesuffix('_ms')}_ms"

    @property
    def significant(self) -> bool:
        """The CI excludes zero on the side of the shift, and the shift is a change at all:
        one below LATENCY_RESOLUTION_MS is "same" in the summary table, so no finding here
        either. (A percentile bootstrap's interval can miss its point estimate, on discrete
        latencies: a rise whose interval lies below zero was marked "worse" beside an
        interval that says B is lower; the two disagree, so there is no finding.)"""
        return ((self.ci_low > 0 and self.delta > 0) or (self.ci_high < 0 and self.delta < 0)) \
            and not math.isnan(self.ci_low) and not below_latency_resolution(self.delta)


@dataclass(slots=True, frozen=True)
class CountShift:
    key: str
    a: int
    b: int
    comparable: bool = True  # False: the counts are of blocks of two sizes (no delta, as the summary's)

    @property
    def delta(self) -> int | None:
        return self.b - self.a if self.comparable else None


@dataclass(slots=True, frozen=True)
class RequestChange:
    request_id: str
    prompt_tokens: int
    hit_a: int
    hit_b: int

    @property
    def delta(self) -> int:
        return self.hit_b - self.hit_a


@dataclass(slots=True)
class RequestHitDiff:
    requests: int = 0  # requests present in both runs
    gained: int = 0  # requests with more cached tokens in B
    lost: int = 0
    only_a: int = 0
    only_b: int = 0
    cached_tokens_delta: int = 0  # over common requests
    top_gained: list[RequestChange] = field(default_factory=list)
    top_lost: list[RequestChange] = field(default_factory=list)


class UnknownMetric(KVTraceError, KeyError):
    """A metric neither run of a diff has (a collected run carries no replay summary)."""

    __str__ = Exception.__str__  # (KeyError's would quote the message)


@dataclass(slots=True)
class RunDiff:
    """Everything ``kvtrace diff`` reports. Render it with ``kvtrace.compare.render``."""

    run_a: dict[str, Any]
    run_b: dict[str, Any]
    metrics: list[MetricDelta]
    same_trace: bool = True
    forced: bool = False
    requests: RequestHitDiff | None = None
    evictions_by_reason: list[CountShift] = field(default_factory=list)
    evictions_by_publish_kind: list[CountShift] = field(default_factory=list)
    latency: list[PercentileShift] = field(default_factory=list)
    bootstrap: dict[str, Any] = field(default_factory=dict)  # seed, resamples, paired, requests_a/_b
    notes: list[str] = field(default_factory=list)  # what the reader must know to read the numbers
    # Per run ("a"/"b"), read from the store's verification spans: requests whose output
    # diverged from the no-cache reference, most divergent tokens first.
    divergent_requests: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    # Summary keys null (not measured) in both runs, e.g. stale_hashes of --no-content runs:
    # no delta and no row, but a gate on one cannot be checked, which is no unknown name.
    unmeasured: list[str] = field(default_factory=list)
    # Why the block-unit metrics (``BLOCK_UNIT_KEYS``) and eviction counts have no delta (blocks
    # of two sizes, or of a size unknown): what a gate on one says. None where they have one.
    block_units: str | None = None

    def metric(self, name: str) -> MetricDelta:
        """The summary metric ``name``, else the bootstrap percentile of that name (as a
        MetricDelta); UnknownMetric (a KeyError) when neither exists."""
        for m in self.metrics:
            if m.name == name:
                return m
        for s in self.latency:
            if s.name == name:  # (its CI's finding too: a gate's or a tile's verdict read the raw delta)
                return MetricDelta(name, s.a, s.b, s.delta, _rel(s.a, s.b), significant=shift_finding(s),
                                   needs_ci=True)
        runs = " and ".join(f"{r.get('run_id', '?')} (mode {r.get('mode') or '?'})" for r in (self.run_a, self.run_b))
        raise UnknownMetric(f"runs {runs}: no metric {name!r} to compare; they have "
                            f"{', '.join(self.metric_names()) or 'none (no replay summary, no request latencies)'}")

    def shift(self, name: str) -> PercentileShift | None:
        """The bootstrap shift with a CI that summary metric ``name`` is (``median_X`` is its
        ``p50_X``, of the same values); None where the latency table gives it none."""
        for s in self.latency:
            if not math.isnan(s.ci_low) and s.name in (name, _p50_name(name)):
                m = next((m for m in self.metrics if m.name == name), None)
                if m is None or (m.a, m.b) == (s.a, s.b):
                    return s
        return None

    def metric_names(self) -> list[str]:
        """Every name ``metric`` answers with a delta: summary metrics, then percentiles."""
        names = [m.name for m in self.metrics if m.delta is not None]
        return names + [s.name for s in self.latency if s.name not in names]


# ------------------------------------------------------------------------- builders


def check_argument(name: str, value: Any, kind: type | tuple[type, ...], expected: str) -> None:
    """ConfigError naming the argument ``name`` for an API caller's ``value`` that is no
    ``kind`` (each builder's arguments, before any work: a None, a list or an array was an
    AttributeError, TypeError or numpy truth ValueError inside it)."""
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple)
                                                                               else (kind,))):
        raise ConfigError(name, shown_value(value), f"expected {expected}")


def check_whole(name: str, value: Any, lo: int, hi: int) -> int:
    """An API caller's whole number in [lo, hi] as the int it is (a numpy int too), else a
    ConfigError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(name, shown_value(value), "expected a whole number")
    number = int(value)
    if not lo <= number <= hi:
        raise ConfigError(name, shown_value(value), f"expected a whole number from {lo:,} to {hi:,}")
    return number


def _check_summaries(**given: Any) -> None:
    for name, value in given.items():
        check_argument(name, value, Mapping, "a run summary, a dict")
        key = next((k for k in value if not isinstance(k, str)), None)
        if key is not None:  # (sorted with the str keys: a TypeError)
            raise ConfigError(name, shown_value(key), "expected metric names as keys, strings")


def _frame(name: str, frame: Any, columns: tuple[str, ...]) -> pl.DataFrame:
    check_argument(name, frame, pl.DataFrame, "a polars DataFrame")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        wanted = ", ".join(map(shown_value, columns))
        raise ConfigError(name, shown_value(frame.columns), f"expected columns {wanted}")
    return frame


def events_mode(run: Mapping[str, Any]) -> Any:
    """The mode a compared run's events were made in (``StoreView.run_info``'s
    ``replayed_mode``: a collected replay's is its sender's), else its stored mode."""
    return run.get("replayed_mode") or run.get("mode")


def finite_number(v: Any) -> float | None:
    """A summary value as a metric, in every view: None for what is no finite number (JSON output said null of
    an Infinity that --markdown showed as '+inf ✅ better', and a gate on it passed)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return None


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return (b - a) / abs(a)


def metric_deltas(summary_a: dict[str, Any], summary_b: dict[str, Any]) -> list[MetricDelta]:
    """Deltas of every numeric summary metric: SUMMARY_FIELDS order first, then extras sorted."""
    _check_summaries(summary_a=summary_a, summary_b=summary_b)
    keys = [k for k in SUMMARY_FIELDS if k in summary_a or k in summary_b]
    keys += sorted((set(summary_a) | set(summary_b)) - set(keys))
    out = []
    for k in keys:
        a, b = finite_number(summary_a.get(k)), finite_number(summary_b.get(k))
        if a is None and b is None:
            continue  # non-numeric (digest, names): not a metric
        delta = None if a is None or b is None else b - a
        out.append(MetricDelta(k, a, b, delta, _rel(a, b)))
    return out


def diff_summaries(
    summary_a: dict[str, Any],
    summary_b: dict[str, Any],
    *,
    run_a: dict[str, Any] | None = None,
    run_b: dict[str, Any] | None = None,
    ci_verdicts: bool = False,
) -> RunDiff:
    """A RunDiff from two plain run summaries (no store needed): metric deltas only.
    ``ci_verdicts``: every latency statistic's verdict is a bootstrap CI's (``needs_ci``), none
    until ``with_latency_findings`` gives it one, as ``kvtrace diff`` and ``study`` judge them;
    else (two bare summaries, no bootstrap to come) each reads its raw delta."""
    _check_summaries(summary_a=summary_a, summary_b=summary_b)
    for name, run in (("run_a", run_a), ("run_b", run_b)):
        if run is not None:
            check_argument(name, run, Mapping, "a run's record, a dict, or None")
    check_argument("ci_verdicts", ci_verdicts, bool, "True or False")
    ra = dict(run_a or {})
    rb = dict(run_b or {})
    if "digest" in summary_a:
        ra.setdefault("digest", summary_a["digest"])
    if "digest" in summary_b:
        rb.setdefault("digest", summary_b["digest"])
    for run, summary in ((ra, summary_a), (rb, summary_b)):
        if summary.get("cost_model"):  # what modelled the run's times (none: no clock)
            run.setdefault("cost_model", summary["cost_model"])
    same = ra.get("trace") == rb.get("trace")
    # every latency statistic's verdict is a bootstrap CI's, none where it has none (``with_latency_findings``)
    metrics = [replace(m, needs_ci=True) if ci_verdicts and is_latency_key(m.name) else m
               for m in metric_deltas(summary_a, summary_b)]
    notes: list[str] = []
    unmeasured = [k for k in dict.fromkeys([*summary_a, *summary_b])
                  if summary_a.get(k) is None and summary_b.get(k) is None]
    # (a collected replay's: its sender's mode, ``metrics.replayed_mode``; "collected" hid a mode that differed)
    modes = [replay_mode(events_mode(r)) for r in (ra, rb)]
    if set(modes) == {"cache-only", "engine"}:  # (README, Metrics: the two modes' hit rules)
        # (the modes kvtrace names, not the stored text: a note is rendered as kvtrace's own markdown)
        notes.append(f"modes differ ({modes[0]} vs {modes[1]}): cache-only counts a prompt cached "
                     "whole as hit whole, engine mode recomputes its last token as vLLM does, so the hit counters' "
                     "deltas mix the rule with the cache")
    if block_sizes_differ(summary_a, summary_b):
        size_a, size_b = summary_a["block_size"], summary_b["block_size"]
        metrics = [replace(m, delta=None, rel=None) if m.name in BLOCK_UNIT_KEYS else m for m in metrics]
        notes.append(f"block sizes differ ({size_a:g} vs {size_b:g} tokens): "
                     f"{', '.join(BLOCK_UNIT_KEYS)} count other units, so they have no delta")
    return RunDiff(run_a=ra, run_b=rb, metrics=metrics, same_trace=same, notes=notes, unmeasured=unmeasured,
                   block_units="A and B count blocks of two sizes" if block_sizes_differ(summary_a, summary_b)
                   else None)


def without_block_deltas(diff: RunDiff, why: str, note: str) -> None:
    """Take the delta of every block-unit metric (``BLOCK_UNIT_KEYS``) away, saying ``why`` (a
    gate's words) and ``note`` (the diff's)."""
    diff.metrics = [replace(m, delta=None, rel=None) if m.name in BLOCK_UNIT_KEYS else m for m in diff.metrics]
    diff.block_units = why
    diff.notes.append(note)


def with_latency_findings(metrics: list[MetricDelta], latency: list[PercentileShift]) -> list[MetricDelta]:
    """``metrics`` with each latency percentile that ``latency`` gives a CI (``median_X`` is
    its ``p50_X``, of the same values) marked with that CI's finding, so that the summary
    row and the percentile row of one number say one thing."""
    shifts = {s.name: s for s in latency if not math.isnan(s.ci_low)}
    out = []
    for m in metrics:
        s = shifts.get(m.name) or shifts.get(_p50_name(m.name))
        if s is not None and m.delta is not None and (m.a, m.b) == (s.a, s.b):
            m = replace(m, significant=s.significant, needs_ci=True)
        out.append(m)
    return out


def _p50_name(name: str) -> str:
    """The percentile a summary statistic is: median_ttft_ms is p50_ttft_ms (else ``name``)."""
    return name.replace("median_", "p50_", 1) if name.startswith("median_") else name


def shift_finding(s: PercentileShift) -> bool | None:
    """Whether a shift's CI finds its change; None where it has no CI."""
    return None if math.isnan(s.ci_low) else s.significant


def block_sizes_differ(summary_a: dict[str, Any], summary_b: dict[str, Any]) -> bool:
    """Whether two runs count blocks of different sizes (``BLOCK_UNIT_KEYS`` and the eviction
    counts then have no delta)."""
    size_a, size_b = finite_number(summary_a.get("block_size")), finite_number(summary_b.get("block_size"))
    return size_a is not None and size_b is not None and size_a != size_b


def request_hit_diff(per_request_a: pl.DataFrame, per_request_b: pl.DataFrame, top: int = 10) -> RequestHitDiff:
    """Per-request changes of cached tokens (local + external hits at first schedule,
    vLLM's per-request num_cached_tokens) over the requests both runs hold; the ``top``
    most gained and lost, ties in request-id order. Frames need request_id and
    cached_tokens (prompt_tokens optional); KVTraceError otherwise."""
    top = check_whole("top", top, 0, 2**31)
    a = _per_request_frame(per_request_a, "per_request_a")
    b = _per_request_frame(per_request_b, "per_request_b")
    a = a.rename({"cached_tokens": "hit_a", "prompt_tokens": "prompt_a"})
    b = b.rename({"cached_tokens": "hit_b", "prompt_tokens": "prompt_b"})
    joined = a.join(b, on="request_id", how="full", coalesce=True)
    only_a = joined.filter(pl.col("hit_b").is_null()).height
    only_b = joined.filter(pl.col("hit_a").is_null()).height
    common = joined.drop_nulls(["hit_a", "hit_b"]).with_columns(
        delta=pl.col("hit_b") - pl.col("hit_a"),
        prompt_tokens=pl.coalesce("prompt_b", "prompt_a").fill_null(0),
    )
    gained = common.filter(pl.col("delta") > 0).sort(["delta", "request_id"], descending=[True, False])
    lost = common.filter(pl.col("delta") < 0).sort(["delta", "request_id"], descending=[False, False])

    def changes(frame: pl.DataFrame) -> list[RequestChange]:
        return [
            RequestChange(str(r["request_id"]), int(r["prompt_tokens"]), int(r["hit_a"]), int(r["hit_b"]))
            for r in frame.head(top).iter_rows(named=True)
        ]

    return RequestHitDiff(
        requests=common.height,
        gained=gained.height,
        lost=lost.height,
        only_a=only_a,
        only_b=only_b,
        cached_tokens_delta=int(common["delta"].sum()) if common.height else 0,
        top_gained=changes(gained),
        top_lost=changes(lost),
    )


def _per_request_frame(frame: pl.DataFrame, name: str = "per-request frame") -> pl.DataFrame:
    check_argument(name, frame, pl.DataFrame, "a polars DataFrame")
    if "request_id" not in frame.columns or "cached_tokens" not in frame.columns:
        raise KVTraceError(f"{name}: expected columns request_id, cached_tokens; got {shown_value(frame.columns)}")
    prompt = pl.col("prompt_tokens") if "prompt_tokens" in frame.columns else pl.lit(None, dtype=pl.Int64)
    try:
        return frame.select(
            pl.col("request_id").cast(pl.Utf8),
            pl.col("cached_tokens").cast(pl.Int64),
            prompt.cast(pl.Int64).alias("prompt_tokens"),
        )
    except pl.exceptions.PolarsError as err:  # (a column of text or lists: polars' own error)
        raise ConfigError(name, shown_value(frame.schema), f"expected whole-number token counts "
                                                            f"({type(err).__name__})") from None


def count_shifts(counts_a: pl.DataFrame, counts_b: pl.DataFrame, key: str, value: str = "count",
                 comparable: bool = True) -> list[CountShift]:
    """Outer-join two (key, count) frames, a missing key counting 0; sorted by |delta|
    descending, then key. ``comparable``: False for counts in other units (no delta)."""
    check_argument("key", key, str, "a column name, a string")
    check_argument("value", value, str, "a column name, a string")
    key, value = str.__str__(key), str.__str__(value)
    check_argument("comparable", comparable, bool, "True or False")
    _frame("counts_a", counts_a, (key, value))
    _frame("counts_b", counts_b, (key, value))
    try:
        return _count_shifts(counts_a, counts_b, key, value, comparable)
    except pl.exceptions.PolarsError as err:  # (counts that are text: polars' own error)
        raise ConfigError("counts_a/counts_b", f"{key}, {value}", f"expected whole-number counts by key "
                                                                  f"({type(err).__name__})") from None


def _count_shifts(counts_a: pl.DataFrame, counts_b: pl.DataFrame, key: str, value: str,
                  comparable: bool) -> list[CountShift]:
    a = counts_a.select(pl.col(key).cast(pl.Utf8), pl.col(value).cast(pl.Int64).alias("a"))
    b = counts_b.select(pl.col(key).cast(pl.Utf8), pl.col(value).cast(pl.Int64).alias("b"))
    a = a.group_by(key).agg(pl.col("a").sum())
    b = b.group_by(key).agg(pl.col("b").sum())
    j = a.join(b, on=key, how="full", coalesce=True).fill_null(0)
    j = j.with_columns(d=(pl.col("b") - pl.col("a")).abs()).sort(["d", key], descending=[True, False])
    return [CountShift(str(r[key]), int(r["a"]), int(r["b"]), comparable) for r in j.iter_rows(named=True)]
