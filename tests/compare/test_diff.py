"""kvtrace diff: summary deltas, per-request changes, fail-if gates, renderings, the store path.

The bootstrap has its own file, test_bootstrap.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from kvtrace.compare import model as M
from kvtrace.compare.gates import check_fail_if
from kvtrace.compare.render import to_json, to_markdown, to_text
from kvtrace.compare.source import diff_runs
from kvtrace.errors import KVTraceError


def _summary(**kw):
    base = {
        "requests": 100,
        "prompt_tokens": 100_000,
        "prefix_cache_hits": 60_000,
        "prefix_cache_hit_rate": 0.60,
        "block_hit_rate": 0.55,
        "median_ttft_ms": 20.0,
        "p99_ttft_ms": 80.0,
        "median_itl_ms": 5.0,
        "p99_itl_ms": 9.0,
        "publishes": 900,
        "evictions": 300,
        "cow_copies": 4,
        "stale_hashes": 0,
        "divergent_outputs": 0,
        "preemptions": 0,
        "digest": "aa" * 32,
    }
    base.update(kw)
    return base


# ------------------------------------------------------------------ summary deltas


def test_metric_deltas_cover_every_numeric_field_in_summary_order():
    a = _summary(extra_metric=1.0)
    b = _summary(prefix_cache_hits=45_000, prefix_cache_hit_rate=0.45, p99_ttft_ms=120.0, extra_metric=3.0,
                 digest="bb" * 32)
    d = M.diff_summaries(a, b)
    names = [m.name for m in d.metrics]
    assert names[:4] == ["requests", "prompt_tokens", "prefix_cache_hits", "prefix_cache_hit_rate"]
    assert names[-1] == "extra_metric"
    assert "digest" not in names  # not numeric
    hr = d.metric("prefix_cache_hit_rate")
    assert hr.delta == pytest.approx(-0.15)
    assert hr.rel == pytest.approx(-0.25)
    assert hr.verdict == "worse"
    assert d.metric("p99_ttft_ms").verdict == "worse"
    assert d.metric("p99_ttft_ms").rel == pytest.approx(0.5)
    assert d.metric("requests").verdict == "same"
    assert d.metric("publishes").verdict == "same"
    assert d.metric("evictions").rel == 0.0
    # Zero baseline: relative change undefined, absolute still there.
    d2 = M.diff_summaries(_summary(), _summary(stale_hashes=3))
    st = d2.metric("stale_hashes")
    assert (st.delta, st.rel, st.verdict) == (3, None, "worse")
    j = to_json(d2)
    assert j["metrics"]["stale_hashes"] == {"a": 0, "b": 3, "delta": 3, "rel": None}
    assert j["correctness"]["stale_hashes"] == {"a": 0, "b": 3}
    assert j["run_a"]["digest"] == "aa" * 32
    assert json.loads(json.dumps(j)) == j  # serialisable as it is
    # Lookups: summary metrics with a delta, then the bootstrap percentiles.
    assert d2.metric_names()[:2] == ["requests", "prompt_tokens"] and "digest" not in d2.metric_names()
    with pytest.raises(KeyError):
        d2.metric("no_such_metric")


# ------------------------------------------------------------------ per request


def test_request_hit_diff_top_gained_and_lost_with_deterministic_ties():
    a = pl.DataFrame({"request_id": ["r1", "r2", "r3", "r4", "r5", "r6"],
                      "prompt_tokens": [100] * 6, "cached_tokens": [50, 50, 0, 90, 10, 10]})
    b = pl.DataFrame({"request_id": ["r1", "r2", "r3", "r4", "r5", "r7"],
                      "prompt_tokens": [100] * 6, "cached_tokens": [80, 20, 40, 0, 10, 5]})
    r = M.request_hit_diff(a, b, top=2)
    assert (r.requests, r.gained, r.lost, r.only_a, r.only_b) == (5, 2, 2, 1, 1)
    assert r.cached_tokens_delta == 30 - 30 + 40 - 90
    assert [(c.request_id, c.delta) for c in r.top_gained] == [("r3", 40), ("r1", 30)]
    assert [(c.request_id, c.delta) for c in r.top_lost] == [("r4", -90), ("r2", -30)]
    # ties: equal deltas ordered by request id
    a2 = pl.DataFrame({"request_id": ["b", "a", "c"], "cached_tokens": [0, 0, 0]})
    b2 = pl.DataFrame({"request_id": ["c", "b", "a"], "cached_tokens": [7, 7, 7]})
    assert [c.request_id for c in M.request_hit_diff(a2, b2, top=3).top_gained] == ["a", "b", "c"]


def test_request_hit_diff_rejects_frames_without_the_columns():
    with pytest.raises(KVTraceError, match="request_id, cached_tokens"):
        M.request_hit_diff(pl.DataFrame({"id": ["x"]}), pl.DataFrame({"id": ["x"]}))


def test_count_shifts_outer_join_sorted_by_size_of_change():
    a = pl.DataFrame({"reason": ["lru", "stale_hash"], "count": [10, 4]})
    b = pl.DataFrame({"reason": ["lru", "replaced"], "count": [30, 1]})
    shifts = M.count_shifts(a, b, "reason")
    assert [(s.key, s.a, s.b, s.delta) for s in shifts] == [
        ("lru", 10, 30, 20), ("stale_hash", 4, 0, -4), ("replaced", 0, 1, 1)
    ]


# ------------------------------------------------------------------ fail-if


def _diff_with_latency():
    a = _summary()
    b = _summary(prefix_cache_hits=58_500, prefix_cache_hit_rate=0.585, p99_ttft_ms=90.0, stale_hashes=2)
    d = M.diff_summaries(a, b)
    d.latency = [M.PercentileShift("ttft_ms", 90, 40.0, 46.0, 6.0, 4.0, 8.0)]
    return d


def test_fail_if_sign_convention():
    d = _diff_with_latency()
    # prefix_cache_hit_rate dropped by 0.015: a max allowed drop of 0.01 fails, 0.02 passes.
    (msg,) = check_fail_if(d, ["prefix_cache_hit_rate:-0.01"])
    assert msg == "prefix_cache_hit_rate dropped by 0.015 (A=0.6, B=0.585); allowed drop 0.01"
    assert check_fail_if(d, ["prefix_cache_hit_rate:-0.02"]) == []
    # A rise gate on a metric that dropped never fails.
    assert check_fail_if(d, ["prefix_cache_hit_rate:+0"]) == []
    # ttft p99 rose by 10 ms (+12.5%): unsigned and '+' thresholds are maximum rises.
    assert len(check_fail_if(d, ["p99_ttft_ms:5"])) == 1
    assert check_fail_if(d, ["p99_ttft_ms:+10"]) == []
    assert len(check_fail_if(d, ["p99_ttft_ms:+10%"])) == 1
    assert check_fail_if(d, ["p99_ttft_ms:+15%"]) == []
    # "-0" means no drop at all; "+0" no rise at all.
    assert len(check_fail_if(d, ["prefix_cache_hits:-0"])) == 1
    assert len(check_fail_if(d, ["stale_hashes:+0"])) == 1
    assert check_fail_if(d, ["divergent_outputs:+0"]) == []
    # Gates on bootstrap percentiles not in the summary.
    assert len(check_fail_if(d, ["p90_ttft_ms:+5"])) == 1
    # Several gates: one message per violation.
    assert len(check_fail_if(d, ["prefix_cache_hit_rate:-0.01", "p99_ttft_ms:+1", "requests:+0"])) == 2


def test_fail_if_relative_gate_on_zero_baseline_fails_any_change_in_its_direction():
    d = _diff_with_latency()
    assert d.metric("stale_hashes").a == 0 and d.metric("stale_hashes").b > 0
    (msg,) = check_fail_if(d, ["stale_hashes:+50%"])
    assert msg.startswith("stale_hashes rose from A=0 to B=")
    assert msg.endswith("beyond any relative rise (stale_hashes:+50%)")
    assert check_fail_if(d, ["stale_hashes:-5%"]) == []  # a rise is no drop


def test_fail_if_relative_gate_on_two_zeros_passes():
    # no change at all: `stale_hashes:+0%` failed two clean runs as "cannot evaluate"
    d = M.diff_summaries(_summary(), _summary())
    assert d.metric("stale_hashes").a == d.metric("stale_hashes").b == 0
    assert check_fail_if(d, ["stale_hashes:+0%", "stale_hashes:-0%", "evictions:+10%"]) == []


@pytest.mark.parametrize("gate, match", [
    ("prefix_cache_hit_rate", "METRIC:THRESHOLD"),
    ("prefix_cache_hit_rate:", "METRIC:THRESHOLD"),
    ("prefix_cache_hit_rate:abc", "not a number"),
    ("no_such_metric:-1", "unknown metric 'no_such_metric'"),
    # gates that can never fail
    ("prefix_cache_hit_rate:-1", "is a fraction from 0 to 1"),  # (meant one point: -0.01)
    ("prefix_cache_hit_rate:-5", r"write -0\.05, for a relative change -5%"),
    ("block_hit_rate:2", "never changes by more than 1"),
    ("p99_ttft_ms:-100%", "no metric drops by more than 100%"),
    ("p99_ttft_ms:-250%", "no metric drops by more than 100%"),
])
def test_fail_if_errors_are_one_line_user_errors(gate, match):
    with pytest.raises(KVTraceError, match=match) as e:
        check_fail_if(_diff_with_latency(), [gate])
    assert "\n" not in str(e.value)


def test_a_change_equal_to_the_threshold_passes_despite_float_rounding():
    """0.50 -> 0.49 is a drop of exactly 0.01, computed as 0.010000000000000009: the gate
    allowing a drop of 0.01 failed with "dropped by 0.01; allowed drop 0.01"."""
    from kvtrace.metrics import ratio

    a = _summary(prefix_cache_hits=50, prefix_cache_queries=100, prefix_cache_hit_rate=ratio(50, 100),
                 p99_ttft_ms=100.1, median_ttft_ms=0.3)
    b = _summary(prefix_cache_hits=49, prefix_cache_queries=100, prefix_cache_hit_rate=ratio(49, 100),
                 p99_ttft_ms=105.1, median_ttft_ms=0.33)
    d = M.diff_summaries(a, b)
    assert d.metric("prefix_cache_hit_rate").delta < -0.01  # (the float noise the gate must see through)
    for gate in ("prefix_cache_hit_rate:-0.01", "p99_ttft_ms:+5", "median_ttft_ms:+10%", "median_ttft_ms:+0.03",
                 "prefix_cache_hits:-1"):
        assert check_fail_if(d, [gate]) == [], gate
    # Just inside the threshold still fails, and says by how much with the digits that differ.
    (msg,) = check_fail_if(d, ["prefix_cache_hit_rate:-0.00999999999"])
    assert msg == "prefix_cache_hit_rate dropped by 0.01 (A=0.5, B=0.49); allowed drop 0.00999999999"
    assert len(check_fail_if(d, ["p99_ttft_ms:+4.9999999999"])) == 1
    assert len(check_fail_if(d, ["median_ttft_ms:+9.9999999%"])) == 1
    assert len(check_fail_if(d, ["prefix_cache_hits:-0.999999"])) == 1  # (a count's slack is far below 1)


def test_a_gate_on_a_metric_neither_run_measured_fails_and_is_no_unknown_name(tmp_path, capsys):
    """--no-content runs store stale_hashes as null: a gate on it was refused as an
    "unknown metric" (exit 2), as if misspelt; it cannot be checked, so it fails (exit 1)."""
    from kvtrace.store.writer import Store
    from tests.cli.support import run

    nulls = {"stale_hashes": None, "divergent_outputs": None, "table_disagreements": None}
    d = M.diff_summaries(_summary(**nulls), _summary(**nulls))
    assert "stale_hashes" not in d.metric_names()
    (msg,) = check_fail_if(d, ["stale_hashes:+0"])
    assert msg == "stale_hashes:+0: cannot evaluate: neither run measured stale_hashes (A=–, B=–)"
    assert len(check_fail_if(d, ["divergent_outputs:+0%", "table_disagreements:-0"])) == 2
    with pytest.raises(KVTraceError, match="unknown metric 'stale_hashez'"):
        check_fail_if(d, ["stale_hashez:+0"])
    db = str(tmp_path / "s.duckdb")
    with Store.open(db) as st:
        for name in ("a", "b"):
            rid = st.create_run(name, trace_source="gen:T", trace_digest="T", mode="engine")
            st.finish_run(rid, digest="d", summary=_summary(**nulls))
    code, _, err = run(["diff", "r1", "r2", "--db", db, "--json", "--fail-if", "stale_hashes:+0"], capsys)
    assert code == 1 and "gate failed: stale_hashes:+0: cannot evaluate: neither run measured" in err, err
    assert "Traceback" not in err


def test_gates_just_inside_the_possible_range_are_gates():
    """(the refusals of gates that can never fail are among the one-line errors above)"""
    for ok in ("prefix_cache_hit_rate:-0.99", "p99_ttft_ms:-99%", "prefix_cache_hit_rate:-5%", "p99_ttft_ms:+250%"):
        check_fail_if(_diff_with_latency(), [ok])


@pytest.mark.parametrize("gate", [
    "", ":", "::", ":1", " : ", "p99_ttft_ms:nan", "p99_ttft_ms:NaN%", "p99_ttft_ms:inf", "p99_ttft_ms:-infinity%",
    "p99_ttft_ms:1e309", "p99_ttft_ms:" + "9" * 400, "p99_ttft_ms:%", "p99_ttft_ms:10%%", "p99_ttft_ms:5ms",
    "p99_ttft_ms:0.005 s", "prefix_cache_hit_rate:-1pp", "p99_ttft_ms:\u22125", "p99_ttft_ms:--5", "p99_ttft_ms:+",
    "p99_ttft_ms:1:2", "p99_ttft_ms:(1)", "p99_ttft_ms:1; rm -rf /", "'; DROP TABLE runs; --:1", "\x1b[31mred:1",
    "p99\n_ttft_ms:1", "p99_ttft_ms:1\r\nX", "🙂:1", "p99_ttft_ms:🙂", "x" * 10_000 + ":1", "P99_TTFT_MS:+5",
])
def test_hostile_gates_are_one_line_user_errors(gate):
    with pytest.raises(KVTraceError, match=re.escape("--fail-if")) as e:
        check_fail_if(_diff_with_latency(), [gate])
    assert "\n" not in str(e.value) and "\r" not in str(e.value)


# ------------------------------------------------------------------ rendering


def _full_diff():
    d = _diff_with_latency()
    d.run_a = {"run_id": "r-a", "name": "off", "trace": "gen:mixed", "behaviours": []}
    d.run_b = {"run_id": "r-b", "name": "on", "trace": "gen:mixed",
               "behaviours": ["shared-prefix-pinning", "external-hit-running-cow"]}
    d.requests = M.request_hit_diff(
        pl.DataFrame({"request_id": ["x", "y"], "prompt_tokens": [10, 10], "cached_tokens": [0, 5]}),
        pl.DataFrame({"request_id": ["x", "y"], "prompt_tokens": [10, 10], "cached_tokens": [8, 1]}),
    )
    d.evictions_by_reason = M.count_shifts(
        pl.DataFrame({"reason": ["lru"], "count": [3]}), pl.DataFrame({"reason": ["lru"], "count": [9]}), "reason")
    d.bootstrap = {"seed": 0, "resamples": 1000, "paired": True}
    return d


def test_markdown_is_a_pasteable_table():
    md = to_markdown(_full_diff())
    lines = md.splitlines()
    assert lines[0] == "### kvtrace diff: `off` → `on`"
    header = lines.index("| metric | A | B | Δ | Δ% | |")
    assert lines[header + 1] == "|---|---:|---:|---:|---:|---|"
    rows = [line for line in lines[header + 2:] if line.startswith("| ")]
    hit_row = next(r for r in rows if r.startswith("| prefix_cache_hit_rate |"))
    assert hit_row == "| prefix_cache_hit_rate | 0.6000 | 0.5850 | -0.0150 | -2.5% | ❌ worse |"
    # every table row has the same number of cells as its header
    for block_start in [i for i, line in enumerate(lines) if line.startswith("|---")]:
        ncols = lines[block_start].count("|")
        j = block_start + 1
        while j < len(lines) and lines[j].startswith("|"):
            assert lines[j].count("|") == ncols, lines[j]
            j += 1
    assert "| p90_ttft_ms | 40.000 | 46.000 | +6.000 | [+4.000, +8.000] | ❌ worse |" in md
    assert "| reason | lru | 3 | 9 | +6 |" in md
    assert "1 gained, 1 lost, 0 unchanged of 2 common requests (net +4 tokens)" in md
    assert "| `x` | 10 | 0 | 8 | +8 |" in md


def test_json_and_text_renderings():
    d = _full_diff()
    j = to_json(d)
    assert j["latency"]["p90_ttft_ms"] == {"a": 40.0, "b": 46.0, "delta": 6.0, "ci": [4.0, 8.0]}
    top = {"request_id": "x", "prompt_tokens": 10, "hit_a": 0, "hit_b": 8, "delta": 8}
    assert j["requests"]["top_gained"][0] == top
    assert j["evictions"]["by_reason"]["lru"] == {"a": 3, "b": 9, "delta": 6}
    assert json.loads(json.dumps(j)) == j
    text = to_text(d)
    assert "off → on" in text and "prefix_cache_hit_rate" in text and "p90_ttft_ms" in text


# ------------------------------------------------------------------ through a real store


def _spans(run_id: str, hits: list[int], ttft_ms: list[float], itl_ms: list[list[float]],
           evictions: list[tuple[str, int, str | None]]):
    """Arrow spans: one request span per request; per eviction (reason, block, next
    publish kind) an evict span and, when a kind is given, the publish that retook it."""
    import pyarrow as pa

    n = len(hits)
    rows = []
    seq_t = 0
    for i in range(n):
        arrival = i * 1_000_000_000
        rows.append({
            "run_id": run_id, "name": "kvtrace.request", "span_id": i + 1, "trace_id_hi": 0, "trace_id_lo": 1,
            "request_id": f"req-{i:03d}", "start_ns": arrival, "end_ns": arrival + 10**9 // 2,
            "arrival_ns": arrival, "first_token_ns": arrival + int(ttft_ms[i] * 1e6),
            "ttft_ns": int(ttft_ms[i] * 1e6), "itl_ns": [int(g * 1e6) for g in itl_ms[i]],
            "num_prompt_tokens": 1000, "num_hit_tokens": hits[i], "num_external_hit_tokens": 0,
        })
    for j, (reason, block, kind) in enumerate(evictions):
        seq_t += 1
        rows.append({"run_id": run_id, "name": "kvtrace.cache.evict", "span_id": (0xE << 60) | j,
                     "trace_id_hi": 0, "trace_id_lo": 1,
                     "start_ns": seq_t, "end_ns": seq_t, "group_id": 0, "evict_reason": reason,
                     "block_ids": [block], "block_hashes": [f"{block:064x}"], "ages": [1], "idle": [1]})
        if kind is not None:
            seq_t += 1
            rows.append({"run_id": run_id, "name": "kvtrace.cache.publish", "span_id": (0xF << 60) | j,
                         "trace_id_hi": 0, "trace_id_lo": 1, "start_ns": seq_t, "end_ns": seq_t, "group_id": 0,
                         "publish_kind": kind, "block_ids": [block], "block_hashes": [f"{block + 10**6:064x}"]})
    return pa.Table.from_pylist(rows, schema=_arrow_schema(rows))


def _arrow_schema(rows):
    import pyarrow as pa

    from kvtrace.store.schema import SPAN_ARROW_SCHEMA

    names = sorted({k for r in rows for k in r})
    return pa.schema([SPAN_ARROW_SCHEMA.field(n) for n in names])


@pytest.fixture(scope="module")
def store_db(tmp_path_factory):
    from kvtrace.store.writer import Store

    db = tmp_path_factory.mktemp("diff") / "runs.duckdb"
    rng = np.random.default_rng(0)
    n = 60
    ttft_a = list(rng.gamma(2.0, 20.0, size=n))
    itl = [list(rng.gamma(3.0, 2.0, size=5)) for _ in range(n)]
    hits_a = [500] * n
    hits_b = [800 if i % 3 == 0 else (400 if i % 3 == 1 else 500) for i in range(n)]
    ttft_b = [t - 5.0 if i % 3 == 0 else t + 2.0 if i % 3 == 1 else t for i, t in enumerate(ttft_a)]
    summ = lambda hits, ttft: {
        "requests": n, "prompt_tokens": 1000 * n, "prefix_cache_hits": sum(hits),
        "prefix_cache_hit_rate": sum(hits) / (1000 * n),
        "p50_ttft_ms": float(np.quantile(ttft, 0.5)), "stale_hashes": 0, "divergent_outputs": 0, "digest": "d",
    }
    with Store.open(db) as st:
        ids = {}
        for name, trace_digest, hits, ttft, ev in (
            ("off", "T1", hits_a, ttft_a, [("lru", 1, "checkpoint"), ("lru", 2, "checkpoint"), ("lru", 3, "full")]),
            ("on", "T1", hits_b, ttft_b, [("lru", 1, "full"), ("stale_hash", 2, None)]),
            ("other", "T2", hits_b, ttft_b, []),
        ):
            rid = st.create_run(name, created="2026-01-01T00:00:00", trace_source=f"gen:{trace_digest}",
                                trace_digest=trace_digest, behaviours=[name], mode="engine")
            st.append_spans(_spans(rid, hits, ttft, itl, ev), run_id=rid)
            st.finish_run(rid, digest="d", summary=summ(hits, ttft))
            ids[name] = rid
    return db, ids


def test_diff_runs_through_the_store(store_db):
    db, ids = store_db
    d = diff_runs(db, ids["off"], ids["on"], seed=3, resamples=300)
    assert d.same_trace and not d.forced
    assert (d.run_a["name"], d.run_b["name"], d.run_a["trace"]) == ("off", "on", "gen:T1")
    assert d.run_b["behaviours"] == ["on"]
    assert d.metric("prefix_cache_hits").delta == 20 * 300 - 20 * 100
    r = d.requests
    assert (r.requests, r.gained, r.lost, r.cached_tokens_delta) == (60, 20, 20, 4000)
    assert [c.request_id for c in r.top_gained[:3]] == ["req-000", "req-003", "req-006"]
    assert r.top_lost[0].delta == -100 and r.top_lost[0].prompt_tokens == 1000
    reasons = {s.key: (s.a, s.b) for s in d.evictions_by_reason}
    assert reasons == {"lru": (3, 1), "stale_hash": (0, 1)}
    kinds = {s.key: (s.a, s.b) for s in d.evictions_by_publish_kind}
    assert kinds == {"checkpoint": (2, 0), "full": (1, 1), "none": (0, 1)}
    lat = {s.name: s for s in d.latency}
    assert set(lat) == {f"p{q}_{m}_ms" for m in ("ttft", "itl") for q in (50, 90, 99)}
    assert d.bootstrap["paired"] is True and d.bootstrap["requests_a"] == 60
    # ITL is identical in both runs: the paired CI collapses to exactly 0.
    assert (lat["p90_itl_ms"].delta, lat["p90_itl_ms"].ci_low, lat["p90_itl_ms"].ci_high) == (0.0, 0.0, 0.0)
    assert lat["p50_ttft_ms"].ci_low <= lat["p50_ttft_ms"].delta <= lat["p50_ttft_ms"].ci_high
    # The point estimates are the linear percentiles of the stored TTFTs (whole ns), as the
    # fixture's summaries, which numpy computed from the same values before rounding.
    for side in ("a", "b"):
        assert getattr(lat["p50_ttft_ms"], side) == pytest.approx(getattr(d.metric("p50_ttft_ms"), side), abs=1e-5)
    # Same seed, same CI; JSON round-trips.
    again = diff_runs(db, ids["off"], ids["on"], seed=3, resamples=300)
    np.testing.assert_array_equal([(s.ci_low, s.ci_high) for s in again.latency],
                                  [(s.ci_low, s.ci_high) for s in d.latency])
    # 60 TTFTs hold no 5 beyond their p99: no interval for it, and a note that says why.
    assert np.isnan(lat["p99_ttft_ms"].ci_low) and not lat["p99_ttft_ms"].significant
    assert "p99_ttft_ms" in d.bootstrap["no_ci"] and any("no 95% CI for p99_ttft_ms" in n for n in d.notes)
    by_kind = json.loads(json.dumps(to_json(d)))["evictions"]["by_publish_kind"]
    assert by_kind["checkpoint"] == {"a": 2, "b": 0, "delta": -2}


def test_diff_refuses_runs_of_different_traces_unless_forced(store_db):
    db, ids = store_db
    with pytest.raises(KVTraceError, match=r"different traces .*'gen:T1' vs 'gen:T2'.*--force") as e:
        diff_runs(db, ids["off"], ids["other"])
    assert "\n" not in str(e.value)
    d = diff_runs(db, ids["off"], ids["other"], force=True, resamples=100)
    assert d.forced and not d.same_trace
    assert "different traces, forced" in to_markdown(d)


def test_diff_unknown_run_is_a_user_error(store_db):
    db, ids = store_db
    with pytest.raises(KVTraceError, match="no run with id 'nope'"):
        diff_runs(db, ids["off"], "nope")


def test_markdown_folds_metrics_beyond_the_summary_fields():
    d = M.diff_summaries(_summary(steps=10), _summary(steps=12, prefix_cache_hit_rate=0.7))
    md = to_markdown(d)
    main, folded = md.split("<details><summary>1 more metrics</summary>")
    assert "| prefix_cache_hit_rate |" in main and "| steps |" not in main
    assert "| steps | 10 | 12 | +2 | +20.0% |  |" in folded and folded.rstrip().endswith("</details>")


def test_an_unfinished_run_is_flagged():
    d = _full_diff()
    d.run_b["status"] = "incomplete"
    assert "> ⚠️ run B is **incomplete**" in to_markdown(d)
    assert "run B (on) is incomplete" in to_text(d)


def test_runs_without_request_timing_have_no_latency_section():
    d = M.diff_summaries(_summary(), _summary())
    d.requests = M.request_hit_diff(pl.DataFrame(schema={"request_id": pl.Utf8, "cached_tokens": pl.Int64}),
                                    pl.DataFrame(schema={"request_id": pl.Utf8, "cached_tokens": pl.Int64}))
    md = to_markdown(d)
    assert "Latency percentiles" not in md and "Per-request hit tokens" not in md


# --- a store written by another tool: every value shown as it is, never a traceback ------------
def _tampered(src: str, dst: Path, *statements: tuple[str, list]) -> str:
    import shutil

    import duckdb

    shutil.copy(src, dst)
    con = duckdb.connect(str(dst))
    try:
        for sql, params in statements:
            con.execute(sql, params)
    finally:
        con.close()
    return str(dst)


def test_user_text_in_a_store_is_shown_literally_by_every_rendering(tmp_path, replayed_store, capsys):
    """A status or request id '[/]' crashed the terminal rendering (rich markup); a name with a
    backtick broke out of --markdown's code span (live HTML and emphasis). (A status kvtrace
    never writes is a damaged record now: its one-line error shows it literally.)"""
    from kvtrace.store import read
    from tests.cli.support import run
    from tests.support.markdown import shown

    on, off = replayed_store.run_on, replayed_store.run_off
    some = read.requests(replayed_store.path, off)["request_id"][0]
    db = _tampered(replayed_store.path, tmp_path / "t.duckdb",
                   ("UPDATE runs SET trace_source = '[/] **x** <b>y</b>', name = '[/] a` <img src=x> **B** `b' "
                    "WHERE run_id = ?", [off]),
                   ("UPDATE spans_request SET request_id = '[/]`|<i>q</i>' WHERE request_id = ?", [some]),
                   ("UPDATE spans_request SET num_hit_tokens = num_hit_tokens + 512 WHERE run_id = ? AND "
                    "request_id = '[/]`|<i>q</i>'", [off]))
    code, out, err = run(["diff", on, off, "--db", db], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert "[/]`|<i>q</i>" in out and "[/] a` <img src=x> **B** `b" in out
    code, md, err = run(["diff", on, off, "--db", db, "--markdown"], capsys)
    assert code == 0, err
    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark").enable("table").render(md)  # (raw HTML passes: a broken span would show)
    assert "<img" not in html and "<b>" not in html and "<i>" not in html and "<strong>B" not in html
    assert "a` <img src=x> **B** `b" in shown(md)
    table = [line for line in md.splitlines() if "<i>q</i>" in line and line.startswith("|")]  # the request's row
    assert table and all(line.count("|") - line.count("\\|") == 6 for line in table), table
    db = _tampered(db, tmp_path / "s.duckdb", ("UPDATE runs SET status = '[/] **x** <b>y</b>' WHERE run_id = ?", [off]))
    code, out, err = run(["diff", on, off, "--db", db], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"run {off}'s status '[/] **x** <b>y</b>' is not one of" in err


@pytest.mark.parametrize("sql, needle", [
    ("UPDATE spans_request SET arrival_ns = -9223372036854775808 WHERE run_id = ?", "cannot compute"),
    ("UPDATE spans_request SET first_token_ns = 9223372036854775807, end_ns = 9223372036854775807 "
     "WHERE run_id = ?", "cannot compute"),
    ("UPDATE runs SET summary = '{\"deep\": ' || repeat('[', 10000) || repeat(']', 10000) || '}' WHERE run_id = ?",
     "nested too deeply"),
])
def test_values_no_run_of_kvtraces_holds_are_one_line_for_diff_and_runs(tmp_path, replayed_store, capsys, sql,
                                                                       needle):
    from tests.cli.support import assert_one_line, run

    on, off = replayed_store.run_on, replayed_store.run_off
    db = _tampered(replayed_store.path, tmp_path / "t.duckdb", (sql, [off]))
    code, _, err = run(["diff", on, off, "--db", db], capsys)
    assert_one_line(code, err, "t.duckdb: damaged kvtrace store", needle)


def test_runs_with_nothing_to_compare_are_one_line_not_an_empty_table(tmp_path):
    """Two collected runs (no replay summary, no request spans): `kvtrace diff` printed an
    empty table with exit 0, and the notebook's verdict cell a bare KeyError."""
    from kvtrace.errors import KVTraceError
    from kvtrace.store import Store

    db = str(tmp_path / "s.duckdb")
    with Store.open(db) as store:
        for _ in range(2):
            store.finish_run(store.create_run("collected", mode="otlp"), status="complete")
    with pytest.raises(KVTraceError, match=r"runs r1 \(mode otlp\) and r2 \(mode otlp\): nothing to compare"):
        diff_runs(db, "r1", "r2")
    empty = M.diff_summaries({}, {}, run_a={"run_id": "r1", "mode": "otlp"}, run_b={"run_id": "r2", "mode": "otlp"})
    with pytest.raises(KeyError) as err:  # (a KeyError still, for callers that look a metric up)
        empty.metric("prefix_cache_hit_rate")
    assert isinstance(err.value, KVTraceError)
    assert str(err.value) == ("runs r1 (mode otlp) and r2 (mode otlp): no metric 'prefix_cache_hit_rate' to compare; "
                              "they have none (no replay summary, no request latencies)")


def test_the_diffs_latency_percentiles_are_the_summarys_to_the_last_bit(replayed_store):
    """The same figure in `diff` and in the run summary (`runs`, `replay --json`): diff took
    its percentiles of ms values, the summary divides after (7.6867339999999995 vs 7.686734)."""
    from kvtrace.store import read

    db, a, b = replayed_store.path, replayed_store.run_off, replayed_store.run_on
    diff = diff_runs(db, a, b)
    summaries = {r: read.run(db, r)["summary"] for r in (a, b)}
    checked = 0
    for shift in diff.latency:
        key = f"p{shift.percentile:g}_{shift.metric}"
        if key in summaries[a]:
            assert (shift.a, shift.b) == (summaries[a][key], summaries[b][key]), key
            checked += 1
    assert checked >= 4


def test_a_run_without_a_summary_is_compared_on_its_spans(tmp_path, replayed_store):
    """A failed or interrupted run keeps no summary: its hit rate and latencies come from
    its spans, the numbers the dashboard's Overview shows for it (Compare said '–')."""
    from kvtrace.store import read

    on, off = replayed_store.run_on, replayed_store.run_off
    db = _tampered(replayed_store.path, tmp_path / "t.duckdb",
                   ("UPDATE runs SET summary = NULL, status = 'failed' WHERE run_id = ?", [off]))
    d = diff_runs(db, on, off)
    hits, lat = read.hit_counters(db, off), read.latency_summary(db, off)
    assert d.metric("prefix_cache_hit_rate").b == hits["prefix_cache_hit_rate"] is not None
    assert d.metric("p99_ttft_ms").b == lat["p99_ttft_ms"] is not None
    assert d.metric("prefix_cache_hit_rate").a == read.run(db, on)["summary"]["prefix_cache_hit_rate"]
    assert d.run_b["status"] == "failed"


def test_a_percentile_one_run_did_not_record_is_taken_from_its_spans(tmp_path, replayed_store):
    """A run replayed with other ``--percentiles`` lacks p99 in its summary: diff's metrics
    said B = null where its latency section said 7.6, and a gate on p99 failed as 'cannot
    evaluate' on a number diff had just printed."""
    from kvtrace.store import read

    on, off = replayed_store.run_on, replayed_store.run_off
    summary = read.run(replayed_store.path, off)["summary"]
    for k in [k for k in summary if k.startswith(("p50_", "p90_", "p99_"))]:
        del summary[k]
    db = _tampered(replayed_store.path, tmp_path / "t.duckdb",
                   ("UPDATE runs SET summary = ? WHERE run_id = ?", [json.dumps(summary), off]))
    d = diff_runs(db, on, off)
    want = read.latency_summary(db, off)["p99_ttft_ms"]
    assert d.metric("p99_ttft_ms").b == want is not None
    assert next(s.b for s in d.latency if s.name == "p99_ttft_ms") == want  # one number in both sections
    assert check_fail_if(d, ["p99_ttft_ms:1e9"]) == []
    assert d.metric("p99_ttft_ms").a == read.run(db, on)["summary"]["p99_ttft_ms"]


def test_a_summary_from_spans_is_the_stored_summary_key_for_key(tmp_path, replayed_store, capsys):
    """``read.summary_from_spans`` of a run that keeps no summary: every key it gives equals the
    complete run's stored one; ``runs --json`` and ``diff --json`` then agree on it (runs
    said null where diff said 87%, and diff's evictions were null)."""
    from kvtrace.store import read
    from tests.cli.support import run

    on, off = replayed_store.run_on, replayed_store.run_off
    stored = read.run(replayed_store.path, off)["summary"]
    db = _tampered(replayed_store.path, tmp_path / "t.duckdb",
                   ("UPDATE runs SET summary = NULL, status = 'incomplete' WHERE run_id = ?", [off]))
    derived = read.summary_from_spans(db, off)
    assert read.run_summary(db, off) == derived  # (none stored: the spans')
    assert read.run_summary(db, on) == read.run(db, on)["summary"]  # (stored: as it is)
    assert {"requests", "prefix_cache_hit_rate", "p99_ttft_ms", "evictions", "publishes", "evictions_by_reason",
            "cow_copies", "spans"} <= set(derived)
    for key, value in derived.items():
        assert value == stored[key], key

    def cli(*argv):
        code, out, err = run([*argv], capsys)
        assert code == 0, err
        return json.loads(out)

    listed = {r["run_id"]: r for r in cli("runs", "--db", db, "--json")["runs"]}[off]
    diffed = cli("diff", on, off, "--db", db, "--json")["metrics"]
    for key in ("requests", "prefix_cache_hit_rate", "median_ttft_ms"):
        assert listed[key] == diffed[key]["b"] == stored[key], key
    assert diffed["evictions"]["b"] == stored["evictions"]


def test_a_terminated_runs_error_summary_is_completed_from_its_spans_in_every_view(tmp_path, replayed_store, capsys):
    """A replay stopped by SIGTERM stores ``{"error": "Terminated: SIGTERM"}``: runs and diff
    showed no numbers for it while the dashboard's tiles showed its spans'. Every view now
    completes such a summary from the spans and keeps the error."""
    from kvtrace.store import read
    from tests.cli.support import run

    on, off = replayed_store.run_on, replayed_store.run_off
    stored = read.run(replayed_store.path, off)["summary"]
    error = {"error": "Terminated: SIGTERM"}
    db = _tampered(replayed_store.path, tmp_path / "t.duckdb",
                   ("UPDATE runs SET summary = ?, status = 'failed' WHERE run_id = ?", [json.dumps(error), off]))
    got = read.run_summary(db, off)
    assert got["error"] == error["error"]
    assert got["requests"] == stored["requests"] and got["prefix_cache_hit_rate"] == stored["prefix_cache_hit_rate"]
    code, out, err = run(["runs", "--db", db, "--json"], capsys)
    assert code == 0, err
    listed = {r["run_id"]: r for r in json.loads(out)["runs"]}[off]
    code, out, err = run(["diff", on, off, "--db", db, "--json"], capsys)
    assert code == 0, err
    diffed = json.loads(out)["metrics"]
    for key in ("requests", "prefix_cache_hit_rate", "median_ttft_ms"):
        assert listed[key] == diffed[key]["b"] == stored[key], key


def test_capacity_and_block_size_are_one_number_in_every_view(tmp_path, capsys):
    """An engine run at --capacity-blocks 12 (vLLM's num_gpu_blocks, the null block in it):
    runs said 11, diff null, replay --json nothing; an unbounded cache-only run's block size
    was in replay and diff but null in runs."""
    from kvtrace.dashboard.run_config import capacity
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store import read
    from tests.cli.support import run

    db = tmp_path / "s.duckdb"
    engine = run_replay(RunSpec("gen:chat", limit=20, capacity_blocks=12), db=db)
    unbounded = run_replay(RunSpec("gen:chat", limit=20, mode="cache-only"), db=db)
    code, out, err = run(["runs", "--db", str(db), "--json"], capsys)
    listed = {r["run_id"]: r for r in json.loads(out)["runs"]}
    d = diff_runs(db, engine.run_id, unbounded.run_id, force=True)
    cap = capacity(read.run(db, engine.run_id)["config"])
    assert (engine.summary["capacity_blocks"], engine.summary["block_size"]) == (cap.blocks, cap.block_size) \
        == (11, 512)
    for res, side in ((engine, "a"), (unbounded, "b")):
        for key in ("capacity_blocks", "block_size"):
            assert listed[res.run_id][key] == res.summary[key] == getattr(d.metric(key), side), (key, side)
    assert unbounded.summary["capacity_blocks"] is None and unbounded.summary["block_size"] == 16


def test_block_counts_of_two_block_sizes_get_no_delta_and_a_note(tmp_path, capsys):
    """A 512-token engine run against a 16-token cache-only run printed block_hit_rate +0.28
    and hit_blocks +4002.7%: counts in other units."""
    from kvtrace.metrics import BLOCK_UNIT_KEYS
    from kvtrace.replay.run import RunSpec, run_replay
    from tests.cli.support import run

    db = tmp_path / "s.duckdb"
    a = run_replay(RunSpec("gen:chat", limit=20), db=db)
    b = run_replay(RunSpec("gen:chat", limit=20, mode="cache-only"), db=db)
    c = run_replay(RunSpec("gen:chat", limit=20, mode="cache-only", capacity_blocks=200), db=db)
    d = diff_runs(db, a.run_id, b.run_id, force=True)
    assert [n for n in d.notes if n.startswith("block sizes differ (512 vs 16 tokens)")]
    for key in ("block_hit_rate", "hit_blocks", "total_blocks", "evictions", "publishes"):
        assert key in BLOCK_UNIT_KEYS and d.metric(key).delta is None and d.metric(key).a is not None, key
    assert d.metric("prefix_cache_hit_rate").delta is not None  # tokens: one unit
    assert check_fail_if(d, ["block_hit_rate:0.5"])  # (cannot be evaluated: the gate fails)
    code, out, _ = run(["diff", a.run_id, b.run_id, "--db", str(db), "--force", "--markdown"], capsys)
    assert code == 0 and "> ⚠️ block sizes differ (512 vs 16 tokens)" in out
    code, out, _ = run(["diff", a.run_id, b.run_id, "--db", str(db), "--force", "--json"], capsys)
    assert json.loads(out)["notes"] == d.notes
    same = diff_runs(db, b.run_id, c.run_id)
    assert same.notes == [] and same.metric("hit_blocks").delta is not None


def test_a_diff_names_each_runs_backend_where_one_is_not_kvtraces(tmp_path, vllm_api):
    """A diff of kvtrace's manager against vLLM's (study --backend vllm), or of two vLLM
    checkouts (the README's patch study), never said which manager or commit made each run."""
    from kvtrace.engine.backends.vllm import vllm_commit
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "b.duckdb"
    spec = RunSpec("gen:mixed", limit=10, content=False)
    ours = run_replay(spec, db=db)
    theirs = run_replay(RunSpec("gen:mixed", limit=10, content=False, backend="vllm"), db=db)
    label = f"vllm 0.33.0 @ {vllm_commit()[:12]}"
    diff = diff_runs(db, ours.run_id, theirs.run_id)
    assert f"Backend: A kvtrace · B {label}" in to_text(diff)
    assert f"Backend: A `kvtrace` · B `{label}`" in to_markdown(diff)
    out = to_json(diff)
    assert (out["run_a"]["backend"], out["run_b"]["backend"], out["run_b"]["vllm_commit"]) == (
        "kvtrace", "vllm", vllm_commit())
    alike = diff_runs(db, ours.run_id, run_replay(spec, db=db).run_id)
    assert "Backend:" not in to_text(alike) + to_markdown(alike)  # (kvtrace's own on both sides: nothing to say)


@pytest.mark.parametrize(("value", "signed", "shown"), [
    (-3e-6, True, "0.0000"), (3e-6, True, "0.0000"), (-0.00004, True, "0.0000"), (-0.0004, True, "-0.0004"),
    (0.0004, True, "+0.0004"), (-0.04, True, "-0.0400"), (1e-10, True, "0.0000"), (-0.0, True, "0.0000"),
    (-0.0004, False, "-0.0004"), (-0.00049, True, "-0.0005"), (12.5, True, "+12.500"), (-1234.0, True, "-1,234"),
])
def test_a_cell_that_rounds_to_zero_has_no_sign(value, signed, shown):
    """A bootstrap CI bound of -3e-6 ms was printed "-0.0000" (as if below zero at that precision).
    (A value, unsigned, that small keeps its digits: ``fmt``'s ``fine``.)"""
    from kvtrace.compare.render import fmt

    assert fmt(value, signed=signed) == shown


def test_two_cost_models_of_one_name_are_told_apart_in_the_times_line(tmp_path, capsys):
    """Two runs timed by a model named "simple", one with its token_ns doubled: diff said
    "Times: modelled by cost model simple" and the TTFT change looked like the cache's."""
    from kvtrace.compare.render import coefficient_changes
    from tests.cli.support import run

    db = tmp_path / "s.duckdb"
    ids = []
    for token_ns in (10_000, 20_000):
        cfg = tmp_path / f"cm{token_ns}.toml"
        cfg.write_text(f'[cost_model]\nname = "simple"\nstep_overhead_ns = 1000000\ntoken_ns = {token_ns}\n'
                       "attn_pair_ps = 1\nkv_read_ps = 1\ndecode_seq_ns = 1\n")
        code, _, err = run(["replay", "gen:chat", "--limit", "12", "--config", str(cfg), "--db", str(db)], capsys)
        assert code == 0, err
        ids.append(f"r{len(ids) + 1}")
    d = diff_runs(db, *ids)
    want = "Times: modelled by cost model `simple`, its coefficients not the same: token_ns A 10000 → B 20000"
    assert want in to_markdown(d)
    assert "token_ns A 10000 → B 20000" in to_text(d)
    copy = tmp_path / "copy.toml"  # the same model from another file: its source is no coefficient
    copy.write_text((tmp_path / "cm10000.toml").read_text())
    code, _, err = run(["replay", "gen:chat", "--limit", "12", "--config", str(copy), "--db", str(db)], capsys)
    assert code == 0, err
    same = to_markdown(diff_runs(db, ids[0], "r3"))
    assert "coefficients" not in same and "Times: modelled by cost model `simple`" in same
    assert coefficient_changes({"x": 1}, None) is None
    assert coefficient_changes({f"k{i}": i for i in range(5)}, {f"k{i}": -i for i in range(5)}) == (
        "k1 A 1 → B -1, k2 A 2 → B -2, k3 A 3 → B -3 and 1 more")
