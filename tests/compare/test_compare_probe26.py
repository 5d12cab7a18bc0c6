"""kvtrace diff's numbers against what the store records, where a run kept no summary of its own
(a failed run): its blocks' size is the one its config records, as `kvtrace runs` lists it."""

from __future__ import annotations

import json

import pytest

from kvtrace.errors import KVTraceError
from tests.cli.support import run


@pytest.fixture(scope="module")
def failed_other_blocks(tmp_path_factory):
    """A complete run of 512-token blocks and a failed run of the same trace at 256-token blocks
    (its pool too small for a prompt: stored failed, with the spans of what it replayed)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("probe26") / "f.duckdb"
    a = run_replay(RunSpec("gen:mixed", preset="kimi-hybrid", capacity_blocks=40, limit=60), db=db)
    with pytest.raises(KVTraceError, match="cannot be scheduled"):
        run_replay(RunSpec("gen:mixed", preset="kimi-hybrid", capacity_blocks=24, block_size=256, limit=60), db=db)
    return str(db), a.run_id, "r2"


def test_a_failed_runs_evictions_of_other_sized_blocks_get_no_delta(failed_other_blocks, capsys):
    db, run_a, run_b = failed_other_blocks
    code, out, err = run(["runs", "--db", db, "--json"], capsys)
    assert code == 0, err
    listed = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert listed[run_b]["status"] == "failed" and listed[run_b]["block_size"] == 256
    assert listed[run_a]["block_size"] == 512
    code, out, err = run(["diff", run_a, run_b, "--db", db, "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["metrics"]["block_size"]["b"] == 256
    # evicted blocks of 256 tokens against blocks of 512: counts in two units, no delta (it said +N)
    assert d["metrics"]["evictions"]["delta"] is None
    assert d["evictions"]["by_reason"] and all(v["delta"] is None for v in d["evictions"]["by_reason"].values())
    assert any(n.startswith("block sizes differ (512 vs 256 tokens)") for n in d["notes"])
