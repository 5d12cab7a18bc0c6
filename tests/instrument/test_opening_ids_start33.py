"""An opening record (``KVCacheInstrumentor.open_run``) leaves a run's spans as they were: its ids
are its own (taken far past the run's from the seeded counter, not from it), so a store written
directly and the spans of its OTLP export keep the ids and rows they had; it goes as its own
export request ahead of the first batch, and a run's record sent before any batch takes its place."""

from __future__ import annotations

import duckdb

from kvtrace.instrument import recording
from kvtrace.instrument.otlp import OTLPCollector
from kvtrace.store.writer import Store
from tests.support.synthetic_spans import synthetic_steps


def _recorded(tmp_path, name: str, opening: bool) -> tuple[list, list, int]:
    """(the direct store's span ids, the collected copy's, the collector's runs with an opening name)."""
    db, collected = tmp_path / f"{name}.duckdb", tmp_path / f"{name}.c.duckdb"
    collector = OTLPCollector(collected, port=0).start()
    try:
        with Store.open(db) as store:
            run_id = store.create_run(name, run_id="r")
            with recording(store=store, run_id=run_id, otlp_endpoint=collector.url, seed=3,
                           export_run_id="x") as inst:
                if opening:
                    inst.open_run({"name": "opened", "config": {"block_size": 16}, "digest": "no",
                                   "summary": {"requests": 1}, "status": "complete"})
                for batch in synthetic_steps(300, seed=2):
                    inst(batch)
            store.finish_run(run_id)
    finally:
        collector.stop()
    ids = []
    for path, run in ((db, "r"), (collected, "x")):
        with duckdb.connect(str(path), read_only=True) as con:
            ids.append(con.execute("SELECT seq, trace_id, span_id FROM spans WHERE run_id = ? ORDER BY seq",
                                   [run]).fetchall())
        with duckdb.connect(str(collected), read_only=True) as con:
            named = con.execute("SELECT name, status, digest FROM runs WHERE run_id = 'x'").fetchall()
    return ids[0], ids[1], named


def test_an_opening_record_changes_no_span_id_of_the_store_or_the_export(tmp_path):
    plain_direct, plain_export, plain_run = _recorded(tmp_path, "plain", opening=False)
    opened_direct, opened_export, opened_run = _recorded(tmp_path, "opened", opening=True)
    assert opened_direct == plain_direct and len(plain_direct) > 1000
    assert opened_export == plain_export == plain_direct
    # (its status, digest and summary are never sent: the opening names the run, finishes nothing)
    assert opened_run == [("opened", "incomplete", None)]
    assert plain_run[0][1:] == ("incomplete", None)
