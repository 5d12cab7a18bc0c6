"""Read-API fixes of session 28 (fixdash): a run's summary from its spans reads as the same
run's in every store it reached."""

from __future__ import annotations

import json

import duckdb
import pytest

from kvtrace.store import read

# engine mode with an external tier and the CoW fix off: divergent outputs and steps to count
DIVERGING = dict(limit=35, capacity_blocks=40, external_capacity_blocks=4096, without=("external-hit-running-cow",))


@pytest.fixture(scope="module")
def engine_store(tmp_path_factory):
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("fix28") / "d.duckdb"
    finished = run_replay(RunSpec("gen:mixed", **DIVERGING), db=db).summary  # type: ignore[arg-type]
    assert finished["divergent_outputs"] > 0 and finished["steps"] > 0  # what the test is about
    return db.read_bytes(), finished


def _stopped(tmp_path, data: bytes, name: str, mode: str | None) -> str:
    """The store with run r1 as SIGTERM leaves it (failed, its summary the error alone),
    stored under ``mode`` (``otlp``: as a collector stores a replay it received)."""
    db = tmp_path / name
    db.write_bytes(data)
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE runs SET status = 'failed', summary = ? WHERE run_id = 'r1'",
                    [json.dumps({"error": "Terminated: SIGTERM"})])
        if mode is not None:
            con.execute("UPDATE runs SET mode = ? WHERE run_id = 'r1'", [mode])
    return str(db)


def test_a_collected_stopped_replay_reads_as_its_direct_run(tmp_path, engine_store):
    """A collector stores a kvtrace replay as mode ``otlp`` (its sender's mode is in its config,
    ``metrics.replayed_mode``): the summary from its spans checked the raw mode for ``engine``, so a
    stopped run collected read divergent outputs null and no steps where its direct store read
    them from the same spans."""
    data, finished = engine_store
    direct = read.run_summary(_stopped(tmp_path, data, "direct.duckdb", None), "r1")
    collected = read.run_summary(_stopped(tmp_path, data, "collected.duckdb", "otlp"), "r1")
    assert collected["divergent_outputs"] == direct["divergent_outputs"] == finished["divergent_outputs"]
    assert collected["steps"] == direct["steps"] == finished["steps"]
    assert collected == direct


def test_a_stopped_sliding_window_only_run_states_the_block_size_its_finished_run_does(tmp_path):
    """A config of sliding-window groups alone has no full-attention group, whose block size
    and pool a summary's ``block_size`` and ``capacity_blocks`` are (``replay.run.engine_capacity``):
    its finished summary says null, and its summary from spans (a stopped run's) said 16."""
    from kvtrace.replay.run import RunSpec, run_replay

    config = tmp_path / "swa.toml"
    config.write_text('[cache]\nhash_block_size = 16\nnum_gpu_blocks = 4000\n'
                      'groups = [{ type = "sliding_window", block_size = 16, sliding_window = 1024 }]\n')
    db = tmp_path / "swa.duckdb"
    finished = run_replay(RunSpec("gen:mixed", preset="dense-attention", config_file=str(config), limit=12),
                          db=db).summary
    assert finished["total_blocks"] > 0  # block counts it has (in the first group's blocks)
    from_spans = read.summary_from_spans(db, "r1")
    for key in ("block_size", "capacity_blocks", "hit_blocks", "total_blocks", "block_hit_rate"):
        assert from_spans[key] == finished[key], key
