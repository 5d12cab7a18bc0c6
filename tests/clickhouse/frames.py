"""Every read the dashboard and ``diff`` make, and the comparison of two stores' answers."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
from polars.testing import assert_frame_equal

from kvtrace.store import read


def read_calls(db: str, run_id: str) -> list[tuple[str, tuple]]:
    """(read function, arguments after (db, run_id)) for every read of the read API, with
    a request and a stale hash of the run where it has them."""
    rid = read.requests(db, run_id)["request_id"].sort()[0]
    calls: list[tuple[str, tuple]] = [
        ("span_counts", ()), ("hit_counters", ()), ("hit_counters_over_time", ()),
        ("hit_counters_over_time", (1_000_000,)), ("group_hit_rates", ()), ("group_hit_rate_over_time", ()),
        ("group_hit_rate_over_time", (1_000_000,)), ("usage_over_time", ()),
        ("per_prefix_reuse", ()), ("per_prefix_reuse", (2,)), ("evictions_over_time", (None, "reason")),
        ("evictions_over_time", (None, "publish_kind")), ("evictions_by_reason", ()),
        ("evictions_by_publish_kind", ()), ("eviction_attribution", ()), ("eviction_attribution", (5,)),
        ("eviction_attribution_flows", ()), ("eviction_attribution_flows", (2,)), ("block_histograms", ()),
        ("block_histograms", (7,)), ("stale_hashes_over_time", ()), ("stale_hashes", ()), ("divergent_outputs", ()),
        ("requests", ()), ("per_request_hits", ()), ("itl_gaps", ()), ("itl_gaps", (rid,)),
        *[("latency_cdf", (m,)) for m in ("ttft", "tpot", "itl", "e2el", "queue")],
        ("latency_samples", ("itl",)), ("latency_stats", ("tpot",)), ("latency_summary", ()),
        ("latency_percentiles", ()), ("latency_percentiles", ("itl",)), ("latency_histogram", ()),
        ("latency_histogram", ("itl", 20)), ("itl_over_time", ()), ("request_waterfall", (rid,)),
        ("request_span_count", (rid,)),
    ]
    stale = read.stale_hashes(db, run_id)
    for h, g in stale.select("block_hash", "group_id").unique().sort("block_hash").head(3).rows():
        calls += [("stale_hash_chain", (h,)), ("stale_hash_chain", (h, g))]
    return calls


def same_answer(name: str, a, b) -> None:
    """Equal frames (float columns to 1e-12 relative: the engines' sums may round in a
    different order) or equal dicts."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), name
        for k in a:
            if a[k] is None or b[k] is None:
                assert a[k] is b[k] is None, (name, k, a[k], b[k])
            else:
                assert math.isclose(a[k], b[k], rel_tol=1e-12), (name, k, a[k], b[k])
        return
    if isinstance(a, int):  # (a count)
        assert type(b) is int and a == b, (name, a, b)
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.shape == b.shape, name
        assert np.allclose(np.sort(a), np.sort(b), rtol=1e-12, atol=0.0), name
        return
    assert isinstance(a, pl.DataFrame) and isinstance(b, pl.DataFrame), name
    assert_frame_equal(a, b, check_exact=False, rel_tol=1e-12, abs_tol=0.0)


def assert_same_reads(db_a: str, db_b: str, run_id: str, only: set[str] | None = None,
                      run_id_b: str | None = None) -> int:
    """Every read of ``run_id`` (or those named in ``only``) answers alike from both
    stores (``run_id_b``: the run's id in ``db_b``, when it is another); returns the reads
    made."""
    calls = [c for c in read_calls(db_a, run_id) if only is None or c[0] in only]
    for name, args in calls:
        a = getattr(read, name)(db_a, run_id, *args)
        b = getattr(read, name)(db_b, run_id_b or run_id, *args)
        try:
            same_answer(name, a, b)
        except AssertionError as err:
            raise AssertionError(f"read.{name}{args}: {err}") from None
    return len(calls)
