"""Eviction and miss attribution follow the events' order, across span kinds.

A store numbers spans (``seq``) as they are appended: a batch's spans family by family and
kind by kind, so a batch's evictions all come before its publishes, and its evictions
before its lookups. Attribution compared seqs across kinds: 291 of 656 evicted blocks of a
400-request Mooncake replay were paired with a publish made before the eviction, and a miss
could be blamed on an eviction after it. The events' order is their virtual time
(``start_ns``: a step's cache events are spread over its window in event order).

The expected rows are computed here from the raw spans, by hand, in event order.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from pathlib import Path

import pytest

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import read
from kvtrace.store.connection import read_connection

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


@pytest.fixture(scope="module", params=["engine", "cache-only"])
def replayed(request, tmp_path_factory):
    db = str(tmp_path_factory.mktemp("order") / "s.duckdb")
    if request.param == "engine":
        spec = RunSpec(str(TRACE), limit=400, content=False, capacity_blocks=1200)  # (misses on evicted prefixes)
    else:
        spec = RunSpec(str(TRACE), limit=300, mode="cache-only", capacity_blocks=500)
    return db, run_replay(spec, db=db).run_id


def _spans(db: str, run_id: str, table: str, columns: str, name: str) -> list[tuple]:
    with read_connection(db) as con:
        return con.execute(f"SELECT {columns} FROM {table} WHERE run_id = ? AND name = ? ORDER BY start_ns, seq",
                           [run_id, name]).fetchall()


def test_each_evicted_block_is_paired_with_the_next_publish_of_its_block_in_time(replayed):
    db, run_id = replayed
    evicts = _spans(db, run_id, "cache_spans", "start_ns, coalesce(group_id, 0), block_ids", "kvtrace.cache.evict")
    publishes = _spans(db, run_id, "cache_spans", "start_ns, coalesce(group_id, 0), block_ids",
                       "kvtrace.cache.publish")
    assert len({t for t, _, _ in evicts + publishes}) == len(evicts) + len(publishes)  # (no two at one time)
    published = defaultdict(list)  # (group, block) -> publish times, in order
    for t, g, ids in publishes:
        for b in ids:
            published[g, b].append(t)
    evicted = defaultdict(list)
    for t, g, ids in evicts:
        for b in ids:
            evicted[g, b].append(t)
    want = {}
    for (g, b), times in evicted.items():
        for i, t in enumerate(times):
            later = published[g, b][bisect.bisect_right(published[g, b], t):]
            nxt = later[0] if later else None
            if nxt is not None and i + 1 < len(times) and nxt >= times[i + 1]:
                nxt = None  # (evicted again before any publish: that eviction's, not this one's)
            want[t, g, b] = nxt
    with read_connection(db) as con:
        rows = con.execute("SELECT evict_ns, group_id, block_id, next_publish_ns FROM evicted_blocks WHERE run_id = ?",
                           [run_id]).fetchall()
    got = {(t, g, b): p for t, g, b, p in rows}
    assert got == want
    paired = [p for p in got.values() if p is not None]
    assert paired and all(p > t for (t, _, _), p in got.items() if p is not None)


def test_each_miss_is_blamed_on_the_latest_eviction_of_its_hash_before_it(replayed):
    db, run_id = replayed
    evicts = _spans(db, run_id, "cache_spans", "start_ns, coalesce(group_id, 0), block_hashes", "kvtrace.cache.evict")
    by_hash = defaultdict(list)
    for t, g, hashes in evicts:
        if g == 0:
            for h in hashes:
                by_hash[h].append(t)
    misses = _spans(db, run_id, "lookup_spans", "start_ns, first_miss_hash", "kvtrace.cache.lookup")
    want = {}
    for t, h in misses:
        if h is None:
            continue
        before = by_hash[h][:bisect.bisect_left(by_hash[h], t)]
        if before:
            want[t] = before[-1]
    got = {r["miss_ns"]: r["evict_ns"] for r in read.eviction_attribution(db, run_id).iter_rows(named=True)}
    assert want and got == want
