"""Compare two recorded runs of the same trace: the isolated A/B measurement.

``diff_runs`` reads both runs only through ``kvtrace.store``'s read API and returns a
``RunDiff``: summary deltas, per-request hit-token changes, eviction shifts, correctness
counts and TTFT/ITL percentile shifts with seeded bootstrap confidence intervals.

Conventions
- A is the baseline, B the candidate; every delta is ``B - A`` and ``rel = (B - A) / A``.
- Bootstrap CIs resample *requests* (with replacement). When both runs hold the same
  request ids (same trace) the resampling is paired: one draw of requests is applied to
  both runs, so the interval reflects the change, not the spread of the workload.
- ``--fail-if METRIC:THRESHOLD`` gates: the threshold's sign names the bad direction.
  ``token_hit_rate:-0.01`` fails when the metric drops by more than 0.01 (negative =
  maximum allowed drop); ``ttft_ms_p99:+5`` (or ``:5``) fails when it rises by more than
  5. A trailing ``%`` makes the threshold relative: ``ttft_ms_p99:+10%``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import polars as pl

from kvtrace.errors import KVTraceError
from kvtrace.store.schema import SUMMARY_FIELDS

PERCENTILES = (50, 90, 99)  # nearest rank, as the engine's summary percentiles
LATENCY_METRICS = ("ttft_ms", "itl_ms")
DEFAULT_RESAMPLES = 1000
CI_LEVEL = 0.95

# +1: higher is better, -1: lower is better, 0: neither (a property of the workload/run).
METRIC_DIRECTION: dict[str, int] = {
    "hit_tokens": 1,
    "token_hit_rate": 1,
    "block_hit_rate": 1,
    "external_hit_tokens": 1,
    "output_tok_per_s": 1,
    "computed_prompt_tokens": -1,  # prefill work the cache did not save
    "evictions": -1,
    "stale_hashes": -1,
    "stale_hashes_left": -1,
    "divergent_outputs": -1,
    "table_disagreements": -1,  # Core and Worker disagree on a block table
    "preemptions": -1,
}
_LOWER_IS_BETTER_PREFIXES = ("ttft_", "itl_", "e2e_", "queue_", "latency_")


def metric_direction(name: str) -> int:
    if name in METRIC_DIRECTION:
        return METRIC_DIRECTION[name]
    return -1 if name.startswith(_LOWER_IS_BETTER_PREFIXES) else 0


# ---------------------------------------------------------------------------- records


@dataclass(slots=True, frozen=True)
class MetricDelta:
    name: str
    a: float | None
    b: float | None
    delta: float | None
    rel: float | None  # None when A is 0 or missing

    @property
    def verdict(self) -> str:
        """'better' / 'worse' / 'same' / '' (no preferred direction or missing)."""
        if self.delta is None:
            return ""
        if self.delta == 0:
            return "same"
        d = metric_direction(self.name)
        if d == 0:
            return ""
        return "better" if self.delta * d > 0 else "worse"


@dataclass(slots=True, frozen=True)
class PercentileShift:
    metric: str  # ttft_ms | itl_ms
    percentile: int
    a: float
    b: float
    delta: float
    ci_low: float
    ci_high: float

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.percentile}"

    @property
    def significant(self) -> bool:
        """The CI excludes zero."""
        return (self.ci_low > 0 or self.ci_high < 0) and not math.isnan(self.ci_low)


@dataclass(slots=True, frozen=True)
class CountShift:
    key: str
    a: int
    b: int

    @property
    def delta(self) -> int:
        return self.b - self.a


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
    gained: int = 0  # requests with more hit tokens in B
    lost: int = 0
    only_a: int = 0
    only_b: int = 0
    hit_tokens_delta: int = 0  # over common requests
    top_gained: list[RequestChange] = field(default_factory=list)
    top_lost: list[RequestChange] = field(default_factory=list)


@dataclass(slots=True)
class RunDiff:
    run_a: dict[str, Any]
    run_b: dict[str, Any]
    metrics: list[MetricDelta]
    same_trace: bool = True
    forced: bool = False
    requests: RequestHitDiff | None = None
    evictions_by_reason: list[CountShift] = field(default_factory=list)
    evictions_by_publish_kind: list[CountShift] = field(default_factory=list)
    latency: list[PercentileShift] = field(default_factory=list)
    bootstrap: dict[str, Any] = field(default_factory=dict)
    # Per run ("a"/"b"), read from the store's verification spans: requests whose output
    # diverged from the no-cache reference, most divergent tokens first.
    divergent_requests: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    # -- lookups
    def metric(self, name: str) -> MetricDelta:
        for m in self.metrics:
            if m.name == name:
                return m
        for s in self.latency:
            if s.name == name:
                return MetricDelta(name, s.a, s.b, s.delta, _rel(s.a, s.b))
        raise KeyError(name)

    def metric_names(self) -> list[str]:
        names = [m.name for m in self.metrics if m.delta is not None]
        return names + [s.name for s in self.latency if s.name not in names]

    # -- renderings
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run_a": self.run_a,
            "run_b": self.run_b,
            "same_trace": self.same_trace,
            "forced": self.forced,
            "metrics": {
                m.name: {"a": m.a, "b": m.b, "delta": m.delta, "rel": m.rel} for m in self.metrics
            },
        }
        if self.requests is not None:
            r = self.requests
            out["requests"] = {
                "common": r.requests,
                "gained": r.gained,
                "lost": r.lost,
                "only_a": r.only_a,
                "only_b": r.only_b,
                "hit_tokens_delta": r.hit_tokens_delta,
                "top_gained": [_change_json(c) for c in r.top_gained],
                "top_lost": [_change_json(c) for c in r.top_lost],
            }
        if self.evictions_by_reason or self.evictions_by_publish_kind:
            out["evictions"] = {
                "by_reason": {s.key: {"a": s.a, "b": s.b, "delta": s.delta} for s in self.evictions_by_reason},
                "by_publish_kind": {
                    s.key: {"a": s.a, "b": s.b, "delta": s.delta} for s in self.evictions_by_publish_kind
                },
            }
        out["correctness"] = {
            k: {"a": self._raw(k, "a"), "b": self._raw(k, "b")} for k in ("stale_hashes", "divergent_outputs")
        }
        if self.divergent_requests:
            out["correctness"]["divergent_requests"] = {
                side: [{"request_id": rid, "divergent_tokens": n} for rid, n in reqs]
                for side, reqs in self.divergent_requests.items()
            }
        if self.latency:
            out["latency"] = {
                s.name: {"a": s.a, "b": s.b, "delta": s.delta, "ci": [_nan_none(s.ci_low), _nan_none(s.ci_high)]}
                for s in self.latency
            }
            out["bootstrap"] = self.bootstrap
        return out

    def _correctness_markdown(self) -> list[str]:
        parts = []
        for name in ("stale_hashes", "divergent_outputs"):
            a, b = self._raw(name, "a"), self._raw(name, "b")
            if a or b:
                parts.append(f"{name.replace('_', ' ')} A {_fmt(a)} → B {_fmt(b)}")
        if not parts:
            return []
        out = ["", "**Correctness**: " + "; ".join(parts) + "."]
        for side in ("a", "b"):
            reqs = self.divergent_requests.get(side) or []
            if reqs:
                shown = ", ".join(f"`{rid}` ({n})" for rid, n in reqs[:5])
                out.append(f"Divergent requests in {side.upper()}: {len(reqs)}; most divergent tokens: {shown}.")
        return out

    def _raw(self, name: str, side: str) -> Any:
        for m in self.metrics:
            if m.name == name:
                return m.a if side == "a" else m.b
        return None

    def to_markdown(self) -> str:
        """A compact report ready to paste into a pull request."""
        a, b = self.run_a, self.run_b
        lines = [
            f"### kvtrace diff: `{_label(a)}` → `{_label(b)}`",
            "",
            f"Trace: `{a.get('trace', '?')}`"
            + ("" if self.same_trace else f" vs `{b.get('trace', '?')}` (**different traces, forced**)"),
        ]
        if a.get("behaviours") is not None or b.get("behaviours") is not None:
            lines.append(f"Behaviours: A `{_fmt_behaviours(a)}` · B `{_fmt_behaviours(b)}`")
        for side, run in (("A", a), ("B", b)):
            if run.get("status") not in (None, "complete"):
                lines += ["", f"> ⚠️ run {side} is **{run['status']}**: its numbers cover only what was recorded."]
        head = ["| metric | A | B | Δ | Δ% | |", "|---|---:|---:|---:|---:|---|"]

        def row(m: MetricDelta) -> str:
            return (f"| {m.name} | {_fmt(m.a)} | {_fmt(m.b)} | {_fmt(m.delta, signed=True)} | "
                    f"{_fmt_rel(m.rel)} | {_mark(m.verdict)} |")

        # The summary fields first; the run's further metrics folded away below them.
        main = [m for m in self.metrics if m.name in SUMMARY_FIELDS]
        extra = [m for m in self.metrics if m.name not in SUMMARY_FIELDS]
        lines += ["", *head, *map(row, main or extra)]
        if main and extra:
            lines += ["", f"<details><summary>{len(extra)} more metrics</summary>", "", *head, *map(row, extra),
                      "", "</details>"]
        if self.latency:
            bs = self.bootstrap
            lines += [
                "",
                f"**Latency percentiles** ({round(CI_LEVEL * 100)}% bootstrap CI over requests, "
                f"{bs.get('resamples')} resamples, seed {bs.get('seed')}{', paired' if bs.get('paired') else ''}; modelled time)",
                "",
                "| percentile | A | B | Δ | CI | |",
                "|---|---:|---:|---:|---|---|",
            ]
            for s in self.latency:
                verdict = "" if not s.significant else ("worse" if s.delta > 0 else "better")
                lines.append(
                    f"| {s.name} | {_fmt(s.a)} | {_fmt(s.b)} | {_fmt(s.delta, signed=True)} | "
                    f"[{_fmt(s.ci_low, signed=True)}, {_fmt(s.ci_high, signed=True)}] | {_mark(verdict)} |"
                )
        if self.evictions_by_reason or self.evictions_by_publish_kind:
            lines += ["", "**Evictions**", "", "| by | key | A | B | Δ |", "|---|---|---:|---:|---:|"]
            for dim, shifts in (("reason", self.evictions_by_reason), ("publish kind", self.evictions_by_publish_kind)):
                for s in shifts:
                    lines.append(f"| {dim} | {s.key} | {s.a} | {s.b} | {s.delta:+d} |")
        lines += self._correctness_markdown()
        if self.requests is not None and (self.requests.requests or self.requests.only_a or self.requests.only_b):
            r = self.requests
            lines += [
                "",
                f"**Per-request hit tokens**: {r.gained} gained, {r.lost} lost, "
                f"{r.requests - r.gained - r.lost} unchanged of {r.requests} common requests "
                f"(net {r.hit_tokens_delta:+d} tokens)."
                + (f" Only in A: {r.only_a}, only in B: {r.only_b}." if r.only_a or r.only_b else ""),
            ]
            if r.top_gained or r.top_lost:
                lines += ["", "| request | prompt | hit A | hit B | Δ |", "|---|---:|---:|---:|---:|"]
                for c in r.top_gained + r.top_lost:
                    lines.append(f"| `{c.request_id}` | {c.prompt_tokens} | {c.hit_a} | {c.hit_b} | {c.delta:+d} |")
        return "\n".join(lines) + "\n"

    def tables(self, metrics: Iterable[str] | None = None) -> list[Any]:
        """rich Tables (summary, latency, evictions, top requests) for a terminal;
        ``metrics`` limits the first table to those names."""
        from rich.table import Table

        out = []
        keep = None if metrics is None else set(metrics)
        t = Table(title=f"{_label(self.run_a)} → {_label(self.run_b)}", title_justify="left")
        for col in ("metric", "A", "B", "Δ", "Δ%"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        for m in self.metrics:
            if keep is not None and m.name not in keep:
                continue
            style = {"better": "green", "worse": "red"}.get(m.verdict)
            t.add_row(m.name, _fmt(m.a), _fmt(m.b), _fmt(m.delta, signed=True), _fmt_rel(m.rel), style=style)
        out.append(t)
        if self.latency:
            t = Table(title=f"latency percentiles ({round(CI_LEVEL * 100)}% bootstrap CI)", title_justify="left")
            for col in ("percentile", "A", "B", "Δ", "CI"):
                t.add_column(col, justify="left" if col == "percentile" else "right")
            for s in self.latency:
                style = None if not s.significant else ("red" if s.delta > 0 else "green")
                t.add_row(
                    s.name, _fmt(s.a), _fmt(s.b), _fmt(s.delta, signed=True),
                    f"[{_fmt(s.ci_low, signed=True)}, {_fmt(s.ci_high, signed=True)}]", style=style,
                )
            out.append(t)
        if self.evictions_by_reason or self.evictions_by_publish_kind:
            t = Table(title="evictions", title_justify="left")
            for col in ("by", "key", "A", "B", "Δ"):
                t.add_column(col, justify="left" if col in ("by", "key") else "right")
            for dim, shifts in (("reason", self.evictions_by_reason), ("publish kind", self.evictions_by_publish_kind)):
                for s in shifts:
                    t.add_row(dim, s.key, str(s.a), str(s.b), f"{s.delta:+d}")
            out.append(t)
        if self.requests is not None and (self.requests.top_gained or self.requests.top_lost):
            r = self.requests
            t = Table(
                title=f"hit tokens per request: {r.gained} gained, {r.lost} lost of {r.requests}", title_justify="left"
            )
            for col in ("request", "prompt", "hit A", "hit B", "Δ"):
                t.add_column(col, justify="left" if col == "request" else "right")
            for c in r.top_gained + r.top_lost:
                t.add_row(c.request_id, str(c.prompt_tokens), str(c.hit_a), str(c.hit_b), f"{c.delta:+d}",
                          style="green" if c.delta > 0 else "red")
            out.append(t)
        return out

    def print(self, console: Any = None) -> None:
        self.render(console)

    def render(self, console: Any = None) -> None:
        from rich.console import Console

        console = console or Console()
        for side, run in (("A", self.run_a), ("B", self.run_b)):
            if run.get("status") not in (None, "complete"):
                console.print(f"[yellow]run {side} ({_label(run)}) is {run['status']}: partial numbers[/yellow]")
        for t in self.tables():
            console.print(t)

    def to_text(self, width: int = 120) -> str:
        """Plain text (no colour) of the rich tables."""
        from rich.console import Console

        console = Console(width=width, record=True, color_system=None, force_terminal=False, file=_NullFile())
        self.render(console)
        return console.export_text()


class _NullFile:
    def write(self, _s: str) -> int:
        return 0

    def flush(self) -> None:
        pass


# ------------------------------------------------------------------- pure building blocks


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return None if isinstance(v, float) and math.isnan(v) else v
    return None


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return (b - a) / abs(a)


def metric_deltas(summary_a: dict[str, Any], summary_b: dict[str, Any]) -> list[MetricDelta]:
    """Deltas of every numeric summary metric: SUMMARY_FIELDS order first, then extras sorted."""
    keys = [k for k in SUMMARY_FIELDS if k in summary_a or k in summary_b]
    keys += sorted((set(summary_a) | set(summary_b)) - set(keys))
    out = []
    for k in keys:
        a, b = _num(summary_a.get(k)), _num(summary_b.get(k))
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
) -> RunDiff:
    """A RunDiff from two plain run summaries (no store needed): metric deltas only."""
    ra = dict(run_a or {})
    rb = dict(run_b or {})
    if "digest" in summary_a:
        ra.setdefault("digest", summary_a["digest"])
    if "digest" in summary_b:
        rb.setdefault("digest", summary_b["digest"])
    same = ra.get("trace") == rb.get("trace")
    return RunDiff(run_a=ra, run_b=rb, metrics=metric_deltas(summary_a, summary_b), same_trace=same)


def request_hit_diff(per_request_a: pl.DataFrame, per_request_b: pl.DataFrame, top: int = 10) -> RequestHitDiff:
    """Per-request hit-token changes. Frames need request_id, hit_tokens (prompt_tokens optional)."""
    a = _per_request_frame(per_request_a).rename({"hit_tokens": "hit_a", "prompt_tokens": "prompt_a"})
    b = _per_request_frame(per_request_b).rename({"hit_tokens": "hit_b", "prompt_tokens": "prompt_b"})
    joined = a.join(b, on="request_id", how="full", coalesce=True)
    only_a = joined.filter(pl.col("hit_b").is_null()).height
    only_b = joined.filter(pl.col("hit_a").is_null()).height
    common = (
        joined.drop_nulls(["hit_a", "hit_b"])
        .with_columns(
            delta=pl.col("hit_b") - pl.col("hit_a"),
            prompt_tokens=pl.coalesce("prompt_b", "prompt_a").fill_null(0),
        )
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
        hit_tokens_delta=int(common["delta"].sum()) if common.height else 0,
        top_gained=changes(gained),
        top_lost=changes(lost),
    )


def _per_request_frame(frame: pl.DataFrame) -> pl.DataFrame:
    if "request_id" not in frame.columns or "hit_tokens" not in frame.columns:
        raise KVTraceError(f"per-request frame: expected columns request_id, hit_tokens; got {frame.columns}")
    prompt = pl.col("prompt_tokens") if "prompt_tokens" in frame.columns else pl.lit(None, dtype=pl.Int64)
    return frame.select(
        pl.col("request_id").cast(pl.Utf8),
        pl.col("hit_tokens").cast(pl.Int64),
        prompt.cast(pl.Int64).alias("prompt_tokens"),
    )


def count_shifts(counts_a: pl.DataFrame, counts_b: pl.DataFrame, key: str, value: str = "count") -> list[CountShift]:
    """Outer-join two (key, count) frames; keys sorted by |delta| desc, then key."""
    a = counts_a.select(pl.col(key).cast(pl.Utf8), pl.col(value).cast(pl.Int64).alias("a"))
    b = counts_b.select(pl.col(key).cast(pl.Utf8), pl.col(value).cast(pl.Int64).alias("b"))
    a = a.group_by(key).agg(pl.col("a").sum())
    b = b.group_by(key).agg(pl.col("b").sum())
    j = a.join(b, on=key, how="full", coalesce=True).fill_null(0)
    j = j.with_columns(d=(pl.col("b") - pl.col("a")).abs()).sort(["d", key], descending=[True, False])
    return [CountShift(str(r[key]), int(r["a"]), int(r["b"])) for r in j.iter_rows(named=True)]


# ------------------------------------------------------------------------ bootstrap


def nearest_rank(total: np.ndarray | int, percentile: int) -> np.ndarray | int:
    """0-based rank of the nearest-rank percentile in a multiset of ``total`` items:
    ceil(p * N / 100) - 1, in integers (the engine's summary percentiles use the same)."""
    return np.maximum(0, -(-(percentile * np.asarray(total, dtype=np.int64)) // 100) - 1)


def weighted_percentiles(sorted_values: np.ndarray, weights: np.ndarray, percentiles: Sequence[int]) -> np.ndarray:
    """Nearest-rank percentiles of multisets given as integer weights (reference version).

    sorted_values: (m,) ascending. weights: (B, m) non-negative ints, one multiset per row.
    Returns (B, len(percentiles)); NaN for an empty multiset.
    """
    weights = np.asarray(weights, dtype=np.int64)
    B, m = weights.shape
    out = np.full((B, len(percentiles)), np.nan)
    if m == 0 or B == 0:
        return out
    cw = np.cumsum(weights, axis=1)
    total = cw[:, -1]
    for i, p in enumerate(percentiles):
        rank = nearest_rank(total, p)
        idx = np.minimum((cw > rank[:, None]).argmax(axis=1), m - 1)  # first cumulative weight > rank
        out[:, i] = np.where(total > 0, sorted_values[idx], np.nan)
    return out


def chunked_weighted_percentiles(
    sorted_values: np.ndarray,
    owner: np.ndarray,
    counts: np.ndarray,
    percentiles: Sequence[int],
    chunks: int | None = None,
) -> np.ndarray:
    """``weighted_percentiles(sorted_values, counts[:, owner], percentiles)`` without
    building the (B, m) weight matrix: exact, and fast when m (every ITL gap) is large.

    The sorted observations are cut into ``chunks`` runs of positions. One matrix product,
    counts (B, n) @ per-request chunk histogram (n, K), gives every replicate's weight per
    chunk; the chunk holding each wanted rank is found on those totals, and only inside
    that chunk are the individual weights expanded. About sqrt(m) chunks balances the two
    (measured: 4000 requests x 150 gaps, 1000 resamples, both runs, in about 1 s).
    """
    counts = np.asarray(counts)
    B, n = counts.shape
    m = sorted_values.size
    out = np.full((B, len(percentiles)), np.nan)
    if m == 0 or B == 0:
        return out
    if chunks is None:
        chunks = int(np.sqrt(m)) + 1
    size = -(-m // min(chunks, m))  # positions per chunk
    k = -(-m // size)
    hist = np.bincount(owner * k + np.arange(m) // size, minlength=n * k).reshape(n, k).astype(np.float64)
    cum = np.rint(np.cumsum(counts.astype(np.float64) @ hist, axis=1)).astype(np.int64)  # (B, K), exact
    total = cum[:, -1]
    rank = np.stack([nearest_rank(total, p) for p in percentiles], axis=1)  # (B, P)
    j = np.minimum((cum[:, None, :] > rank[:, :, None]).argmax(axis=2), k - 1)  # chunk holding the rank
    before = np.where(j > 0, np.take_along_axis(cum, np.maximum(j - 1, 0), axis=1), 0)
    pos = j[:, :, None] * size + np.arange(size)  # (B, P, size)
    w = np.where(pos < m, counts[np.arange(B)[:, None, None], owner[np.minimum(pos, m - 1)]], 0)
    within = (np.cumsum(w, axis=2) > (rank - before)[:, :, None]).argmax(axis=2)
    v = sorted_values[np.minimum(j * size + within, m - 1)]
    ok = total > 0
    out[ok] = v[ok]
    return out


def percentile_shifts(
    a_owner: np.ndarray,
    a_values: np.ndarray,
    b_owner: np.ndarray,
    b_values: np.ndarray,
    *,
    metric: str,
    counts: tuple[np.ndarray, np.ndarray],
    percentiles: Sequence[int] = PERCENTILES,
) -> list[PercentileShift]:
    """Percentile shifts B-A with bootstrap CIs, given per-request resample counts.

    x_values: one per observation (TTFT: one per request, ITL: one per gap); x_owner: the
    index of the owning request in that run's request universe. counts: (B, n_requests)
    resample counts for A and for B (the same array when paired).
    """
    counts_a, counts_b = counts
    point_a = _point_percentiles(a_values, percentiles)
    point_b = _point_percentiles(b_values, percentiles)
    lo = hi = np.full(len(percentiles), np.nan)
    if a_values.size and b_values.size:
        deltas = _boot_percentiles(b_owner, b_values, counts_b, percentiles) - _boot_percentiles(
            a_owner, a_values, counts_a, percentiles
        )
        alpha = (1 - CI_LEVEL) / 2
        if not np.all(np.isnan(deltas)):
            with np.errstate(all="ignore"):
                lo = np.nanquantile(deltas, alpha, axis=0)
                hi = np.nanquantile(deltas, 1 - alpha, axis=0)
    return [
        PercentileShift(metric, int(p), float(pa), float(pb), float(pb - pa), float(l), float(h))
        for p, pa, pb, l, h in zip(percentiles, point_a, point_b, lo, hi)
    ]


def _point_percentiles(values: np.ndarray, percentiles: Sequence[int]) -> np.ndarray:
    if values.size == 0:
        return np.full(len(percentiles), np.nan)
    v = np.sort(values.astype(np.float64))
    return np.array([v[nearest_rank(v.size, p)] for p in percentiles])


def _boot_percentiles(owner: np.ndarray, values: np.ndarray, counts: np.ndarray, percentiles: Sequence[int]) -> np.ndarray:
    """Exact bootstrap percentiles, (B, P), of observations owned by resampled requests."""
    order = np.argsort(values, kind="stable")
    return chunked_weighted_percentiles(values[order].astype(np.float64), owner[order], counts, percentiles)


def resample_counts(rng: np.random.Generator, n_requests: int, resamples: int) -> np.ndarray:
    """(resamples, n_requests) counts: how often each request is drawn in each replicate."""
    if n_requests == 0:
        return np.zeros((resamples, 0), dtype=np.int32)
    draws = rng.integers(0, n_requests, size=(resamples, n_requests), dtype=np.int64)
    draws += (np.arange(resamples, dtype=np.int64) * n_requests)[:, None]
    return np.bincount(draws.ravel(), minlength=resamples * n_requests).reshape(resamples, n_requests).astype(np.int32)


def _request_universe(frames: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """Sorted distinct request ids of a run, with their index: the bootstrap's unit."""
    ids = [f.select(pl.col("request_id").cast(pl.Utf8)) for f in frames.values()]
    if not ids:
        return pl.DataFrame(schema={"request_id": pl.Utf8, "owner": pl.UInt32})
    return pl.concat(ids).unique().sort("request_id").with_row_index("owner")


def _owned_values(frame: pl.DataFrame, metric: str, universe: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    f = frame.select(pl.col("request_id").cast(pl.Utf8), pl.col(metric).cast(pl.Float64)).drop_nulls()
    f = f.join(universe, on="request_id", how="left", maintain_order="left")
    return f["owner"].to_numpy().astype(np.int64), f[metric].to_numpy()


def latency_shifts(
    latency_a: dict[str, pl.DataFrame],
    latency_b: dict[str, pl.DataFrame],
    *,
    seed: int = 0,
    resamples: int = DEFAULT_RESAMPLES,
    percentiles: Sequence[int] = PERCENTILES,
) -> tuple[list[PercentileShift], dict[str, Any]]:
    """TTFT/ITL percentile shifts with a seeded request-level bootstrap.

    latency_x maps 'ttft_ms' / 'itl_ms' to frames with columns request_id and the metric
    (one row per request for TTFT, one per inter-token gap for ITL). The request universe
    of each run is the union of request ids over both metrics.
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    frames_a = {k: v for k, v in latency_a.items() if v is not None}
    frames_b = {k: v for k, v in latency_b.items() if v is not None}
    ua, ub = _request_universe(frames_a), _request_universe(frames_b)
    paired = ua.equals(ub)
    counts_a = resample_counts(rng, ua.height, resamples)
    counts_b = counts_a if paired else resample_counts(rng, ub.height, resamples)
    shifts: list[PercentileShift] = []
    for metric in LATENCY_METRICS:
        if metric not in frames_a or metric not in frames_b:
            continue
        oa, va = _owned_values(frames_a[metric], metric, ua)
        ob, vb = _owned_values(frames_b[metric], metric, ub)
        if va.size == 0 and vb.size == 0:
            continue  # e.g. cache-only runs: no request timing at all
        shifts += percentile_shifts(oa, va, ob, vb, metric=metric, counts=(counts_a, counts_b), percentiles=percentiles)
    info = {"seed": seed, "resamples": resamples, "paired": paired, "requests_a": ua.height, "requests_b": ub.height}
    return shifts, info


# ---------------------------------------------------------------------------- fail-if


@dataclass(slots=True, frozen=True)
class Gate:
    metric: str
    threshold: float  # signed; negative = max allowed drop, positive = max allowed rise
    relative: bool
    bad_direction: int  # -1: a drop is bad ("-..."), +1: a rise is bad ("+..." or unsigned)
    text: str


def parse_gate(text: str) -> Gate:
    """'token_hit_rate:-0.01' | 'ttft_ms_p99:+5' | 'ttft_ms_p99:10%'."""
    metric, sep, raw = text.partition(":")
    metric, raw = metric.strip(), raw.strip()
    if not sep or not metric or not raw:
        raise KVTraceError(f"--fail-if {text!r}: expected METRIC:THRESHOLD, e.g. token_hit_rate:-0.01")
    relative = raw.endswith("%")
    num = raw[:-1] if relative else raw
    try:
        value = float(num)
    except ValueError:
        raise KVTraceError(f"--fail-if {text!r}: threshold {raw!r} is not a number (e.g. -0.01, +5, +10%)") from None
    if math.isnan(value) or math.isinf(value):
        raise KVTraceError(f"--fail-if {text!r}: threshold must be finite")
    # The sign is read from the text so that "-0" (no drop at all) differs from "+0".
    bad = -1 if num.lstrip().startswith("-") else 1
    return Gate(metric, value / 100 if relative else value, relative, bad, f"{metric}:{raw}")


def check_fail_if(diff: RunDiff, gates: Iterable[str]) -> list[str]:
    """The gates that ``diff`` violates, one message each (empty list = pass).

    Sign convention: a negative threshold is the maximum allowed drop (fail when
    ``delta < threshold``); a positive or unsigned one is the maximum allowed rise (fail when
    ``delta > threshold``). With '%' the relative change is compared instead. A metric that
    is missing from either run fails its gate, since a gate that cannot be checked must not pass.
    """
    failures = []
    known = diff.metric_names()
    for text in gates:
        gate = parse_gate(text)
        try:
            m = diff.metric(gate.metric)
        except KeyError:
            raise KVTraceError(f"--fail-if {text!r}: unknown metric {gate.metric!r}; known: {', '.join(known)}") from None
        change = m.rel if gate.relative else m.delta
        unit = "%" if gate.relative else ""
        if change is None or (isinstance(change, float) and math.isnan(change)):
            failures.append(f"{gate.text}: cannot evaluate (A={_fmt(m.a)}, B={_fmt(m.b)})")
            continue
        shown = change * 100 if gate.relative else change
        limit = gate.threshold * 100 if gate.relative else gate.threshold
        if gate.bad_direction < 0 and change < gate.threshold:
            failures.append(
                f"{gate.metric} dropped by {-shown:.6g}{unit} (A={m.a:.6g}, B={m.b:.6g}); "
                f"allowed drop {abs(limit):.6g}{unit}"
            )
        elif gate.bad_direction > 0 and change > gate.threshold:
            failures.append(
                f"{gate.metric} rose by {shown:.6g}{unit} (A={m.a:.6g}, B={m.b:.6g}); "
                f"allowed rise {limit:.6g}{unit}"
            )
    return failures


# ------------------------------------------------------------------------ store access


def diff_runs(
    db: Any,
    run_a: str,
    run_b: str,
    *,
    force: bool = False,
    seed: int = 0,
    top: int = 10,
    resamples: int = DEFAULT_RESAMPLES,
) -> RunDiff:
    """Compare runs ``run_a`` (baseline) and ``run_b`` (candidate) stored in ``db``.

    Refuses runs of different traces (their trace digests differ) unless ``force``.
    """
    view = StoreView(db)
    info_a, info_b = view.run_info(run_a), view.run_info(run_b)
    same = _same_trace(info_a, info_b)
    if not same and not force:
        raise KVTraceError(
            f"{db}: runs {run_a} and {run_b} replay different traces "
            f"({info_a.get('trace')!r} vs {info_b.get('trace')!r}); pass --force to compare anyway"
        )
    diff = diff_summaries(view.summary(run_a), view.summary(run_b), run_a=info_a, run_b=info_b)
    diff.same_trace, diff.forced = same, not same
    diff.requests = request_hit_diff(view.per_request_hits(run_a), view.per_request_hits(run_b), top=top)
    diff.evictions_by_reason = count_shifts(view.evictions_by_reason(run_a), view.evictions_by_reason(run_b), "reason")
    diff.evictions_by_publish_kind = count_shifts(
        view.evictions_by_publish_kind(run_a), view.evictions_by_publish_kind(run_b), "publish_kind"
    )
    diff.latency, diff.bootstrap = latency_shifts(view.latency(run_a), view.latency(run_b), seed=seed, resamples=resamples)
    diff.divergent_requests = {"a": view.divergent_requests(run_a), "b": view.divergent_requests(run_b)}
    return diff


def _same_trace(a: dict[str, Any], b: dict[str, Any]) -> bool:
    # The trace digest (content) decides; the source text only when a digest is missing.
    if a.get("trace_id") and b.get("trace_id"):
        return a["trace_id"] == b["trace_id"]
    return a.get("trace") == b.get("trace")


class StoreView:
    """The few frames a diff needs, read through ``kvtrace.store.read`` and normalised to
    the column names the pure functions above take."""

    def __init__(self, db: Any):
        from kvtrace.store import read

        self.db = db
        self.read = read
        self._runs: dict[str, dict[str, Any]] = {}

    def _run(self, run_id: str) -> dict[str, Any]:
        if run_id not in self._runs:
            self._runs[run_id] = self.read.run(self.db, run_id)  # UnknownRunError is a KVTraceError
        return self._runs[run_id]

    def run_info(self, run_id: str) -> dict[str, Any]:
        r = self._run(run_id)
        return {
            "run_id": run_id,
            "name": r.get("name"),
            "trace": r.get("trace_source"),
            "trace_id": r.get("trace_digest"),
            "mode": r.get("mode"),
            "behaviours": r.get("behaviours"),
            "status": r.get("status"),
            "digest": r.get("digest"),
        }

    def summary(self, run_id: str) -> dict[str, Any]:
        return dict(self._run(run_id).get("summary") or {})

    def per_request_hits(self, run_id: str) -> pl.DataFrame:
        """request_id, prompt_tokens, hit_tokens (local + external: the prefill avoided)."""
        f = self.read.per_request_hits(self.db, run_id)
        return f.select("request_id", pl.col("num_prompt_tokens").alias("prompt_tokens"),
                        pl.col("num_hit_tokens").alias("hit_tokens"))

    def evictions_by_reason(self, run_id: str) -> pl.DataFrame:
        return self.read.evictions_by_reason(self.db, run_id).select("reason", pl.col("blocks").alias("count"))

    def evictions_by_publish_kind(self, run_id: str) -> pl.DataFrame:
        f = self.read.evictions_by_publish_kind(self.db, run_id)
        return f.select("publish_kind", pl.col("blocks").alias("count"))

    def divergent_requests(self, run_id: str) -> list[tuple[str, int]]:
        f = self.read.divergent_outputs(self.db, run_id)
        if f.height == 0:
            return []
        per = f.group_by("request_id").agg(pl.len().alias("n")).sort(["n", "request_id"], descending=[True, False])
        return [(str(r), int(n)) for r, n in per.iter_rows()]

    def latency(self, run_id: str) -> dict[str, pl.DataFrame]:
        """ttft_ms: one row per request that produced a token; itl_ms: one row per gap."""
        req = self.read.requests(self.db, run_id).drop_nulls("ttft_ns")
        gaps = self.read.itl_gaps(self.db, run_id).drop_nulls("gap_ns")
        return {
            "ttft_ms": req.select("request_id", (pl.col("ttft_ns") / 1e6).alias("ttft_ms")),
            "itl_ms": gaps.select("request_id", (pl.col("gap_ns") / 1e6).alias("itl_ms")),
        }


# --------------------------------------------------------------------------- formatting


def _label(run: dict[str, Any]) -> str:
    return str(run.get("name") or run.get("run_id") or "?")


def _fmt_behaviours(run: dict[str, Any]) -> str:
    b = run.get("behaviours")
    if b is None:
        return "?"
    if isinstance(b, str):
        return b or "none"
    return ", ".join(sorted(b)) or "none"


def _fmt(v: float | None, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float) and abs(v) < 1e-9:
        v = 0.0  # float noise from subtracting equal sums, not a change
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) >= 1000):
        return f"{int(v):+,d}" if signed else f"{int(v):,d}"
    if abs(v) >= 100:
        s = f"{v:,.1f}"
    elif abs(v) >= 1:
        s = f"{v:.3f}"
    else:
        s = f"{v:.4f}"
    return ("+" if signed and v > 0 else "") + s


def _fmt_rel(rel: float | None) -> str:
    return "–" if rel is None else f"{rel * 100:+.1f}%"


def _mark(verdict: str) -> str:
    return {"better": "✅ better", "worse": "❌ worse", "same": ""}.get(verdict, "")


def _nan_none(v: float) -> float | None:
    return None if math.isnan(v) else v


def _change_json(c: RequestChange) -> dict[str, Any]:
    return {"request_id": c.request_id, "prompt_tokens": c.prompt_tokens, "hit_a": c.hit_a, "hit_b": c.hit_b, "delta": c.delta}


def dumps(diff: RunDiff) -> str:
    return json.dumps(diff.to_json(), indent=2, sort_keys=False)
