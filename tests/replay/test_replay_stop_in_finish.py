"""A replay without an OTLP endpoint, stopped while its run is finished: the run is not
complete. It was stored ``complete`` with ``"otlp_export": "stopped"`` in its summary (the
path of a stop while a collector drains), though no collector was ever named."""

from __future__ import annotations

import pytest

from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import read
from kvtrace.store.writer import Store


def test_a_stop_in_the_finish_of_a_run_without_otlp_marks_it_failed_not_complete(tmp_path, monkeypatch):
    finish, calls = Store.finish_run, []

    def stopped_in_finish(self, run_id, status="complete", **kwargs):
        calls.append(status)
        if status == "complete" and len(calls) == 1:  # (Ctrl-C as the derived tables are computed)
            raise KeyboardInterrupt
        return finish(self, run_id, status=status, **kwargs)

    monkeypatch.setattr(Store, "finish_run", stopped_in_finish)
    db = str(tmp_path / "s.duckdb")
    with pytest.raises(KeyboardInterrupt):
        run_replay(RunSpec("gen:chat", limit=4, mode="cache-only", capacity_blocks=30), db=db)
    run = read.run(db, "r1")
    assert calls == ["complete", "failed"]
    assert run["status"] == "failed" and "otlp_export" not in (run["summary"] or {}), run
    assert run["summary"]["error"].startswith("KeyboardInterrupt")
