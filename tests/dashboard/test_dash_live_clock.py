"""A live capture's spans are on the vLLM server's wall clock (ns since 1970), not on a
replay's virtual clock from 0: the pages' time windows start at the run's first time."""

from __future__ import annotations

from apptest import render, traces

from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.vllm.rows import VllmSpanRows
from kvtrace.instrument.vllm.wire import BLOCK_REMOVED, BLOCK_STORED, KVEvent, KVEventBatch
from kvtrace.store import read
from kvtrace.store.writer import Store

WALL_CLOCK_S = 1_796_470_781.55  # a vLLM server's batch timestamp: seconds since 1970


def _live_capture(db: str, batches: int = 40) -> str:
    """A capture's run as `kvtrace capture vllm` records it (its row builder), without the
    sockets: batch k stores two blocks and, from k = 6, removes one stored earlier."""
    rows = VllmSpanRows(SeededIdGenerator(0), {"service.name": "vllm"})
    for k in range(batches):
        events = [KVEvent(BLOCK_STORED, [f"{10 * k + 1:016x}", f"{10 * k + 2:016x}"], None, list(range(32)), 16,
                          medium="GPU", group_idx=0)]
        if k > 5:
            events.append(KVEvent(BLOCK_REMOVED, [f"{10 * (k - 5) + 1:016x}"], medium="GPU", group_idx=0))
        rows.add(k, KVEventBatch(WALL_CLOCK_S + 0.05 * k, events))
    with Store.open(db) as store:
        run = store.create_run("captured", trace_source="tcp://h:1", mode="live", config={"endpoint": "tcp://h:1"})
        store.append_spans(rows.take(), run_id=run)
        store.finish_run(run, summary={"requests": 0, "batches": batches})
    return run


def test_a_live_captures_evictions_are_charted_on_its_own_clock(tmp_path, monkeypatch):
    db = str(tmp_path / "live.duckdb")
    run = _live_capture(db)
    evicted = int(read.evictions_over_time(db, run)["blocks"].sum())
    assert evicted == 34
    at = render(db, monkeypatch, "evictions", run=run)
    infos = [i.value for i in at.info]
    assert not any("the cache never filled" in i for i in infos), infos  # (its 34 evictions were windowed away)
    bars = [t for t in traces(at) if t.get("type") == "bar" and t.get("name") == "vLLM BlockRemoved"]
    assert bars and sum(bars[0]["y"]) == evicted
    assert 0 <= min(bars[0]["x"]) < 1  # seconds from the run's start, not since 1970
    lo, hi = at.slider[0].value
    assert lo == 0 and 1.65 <= hi < 10, (lo, hi)  # its evictions' 1.65 s, not 1.8e9 s nor the 1 s of none

    at.slider[0].set_range(0.5, 1.0).run()  # a window inside the run keeps the evictions in it
    bars = [t for t in traces(at) if t.get("type") == "bar" and t.get("name") == "vLLM BlockRemoved"]
    assert bars and 0 < sum(bars[0]["y"]) < evicted
    assert all(0.5 <= x <= 1.0 for x in bars[0]["x"])


def test_a_cache_only_replay_keeps_its_virtual_clock_from_zero(tmp_path, monkeypatch):
    # its stored mode is cache-only/lru, which was taken for a sender's clock: the window
    # began at its first eviction, and the Hit rate page dropped the requests before it
    from kvtrace.replay.run import RunSpec, run_replay

    db = str(tmp_path / "co.duckdb")
    res = run_replay(RunSpec("gen:mixed", limit=60, mode="cache-only", capacity_blocks=300), db=db)
    assert res.summary["evictions"] > 0
    first_eviction = int(read.evictions_over_time(db, res.run_id)["window_start_ns"].min())
    assert first_eviction > 0
    at = render(db, monkeypatch, "evictions", run=res.run_id)
    bars = [t for t in traces(at) if t.get("type") == "bar"]
    assert bars and min(min(b["x"]) for b in bars) >= first_eviction / 1e9 - 1e-9  # (not shifted to 0)
    lo, hi = at.slider[0].value
    last_eviction = int(read.evictions_over_time(db, res.run_id)["window_start_ns"].max())
    assert lo == 0 and hi >= last_eviction / 1e9 - 1e-9, (lo, hi)  # (it ran 0 to 0.059 s: cut at its end)
