"""Probe 25 of ``--backend vllm`` and ``kvtrace conformance``: what the adapter infers of
vLLM's events, span by span against kvtrace's manager where both make the same decisions."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import duckdb
import pytest

from kvtrace.replay.run import RunSpec, run_replay

# running-tail copies (moved keys) and prefill checkpoints that land on a Mamba block's end
MOVES_AND_CHECKPOINTS = RunSpec("gen:mixed", limit=60, capacity_blocks=100, external_capacity_blocks=300,
                                content=False)


@pytest.fixture(scope="module")
def both_backends(vllm_api, tmp_path_factory):
    db = tmp_path_factory.mktemp("probe25") / "both.duckdb"
    ours = run_replay(MOVES_AND_CHECKPOINTS, db=db)
    theirs = run_replay(replace(MOVES_AND_CHECKPOINTS, backend="vllm"), db=db)
    return str(db), ours.run_id, theirs.run_id


def _rows(db: str, run_id: str, sql: str) -> Counter:
    with duckdb.connect(db, read_only=True) as con:
        return Counter(con.execute(sql, [run_id]).fetchall())


def test_an_evicted_blocks_age_counts_from_its_move_as_kvtraces_pool_does(both_backends):
    # A key moved to a running-tail copy is published there (the `moved` publish): kvtrace's
    # pool counts a later eviction's age from the move, and the `moved` eviction's own age
    # from the source's publish. The adapter gave every `moved` eviction age 0 and counted
    # later ones from the first publish (39 moved and several LRU ages off by one here).
    db, ours, theirs = both_backends
    sql = ("SELECT step, group_id, evict_reason, unnest(block_ids), unnest(ages) FROM spans "
           "WHERE run_id = ? AND name = 'kvtrace.cache.evict'")
    kv, vl = _rows(db, ours, sql), _rows(db, theirs, sql)
    moved = [row for row in kv.elements() if row[2] == "moved"]
    assert moved and all(row[4] > 0 for row in moved)  # (published a step or more before the copy)
    assert vl == kv


def test_a_checkpoint_at_a_block_end_is_published_as_kvtraces_pool_keys_it(both_backends):
    # A prefill checkpoint whose position is its Mamba block's end: kvtrace's pool keys the
    # full block there (`boundary`, which the adapter shows as `full`, as documented); the
    # adapter called it `checkpoint` (1 of 18 here, 6 on the whole gen:mixed at 200 blocks).
    db, ours, theirs = both_backends
    sql = ("SELECT step, group_id, publish_kind, unnest(block_ids), num_tokens % 512 = 0 FROM spans "
           "WHERE run_id = ? AND name = 'kvtrace.cache.publish'")
    kv: Counter = Counter()
    for (s, g, kind, b, end), n in _rows(db, ours, sql).items():
        kv[(s, g, "full" if kind == "boundary" else kind, b, end)] += n
    vl = _rows(db, theirs, sql)
    assert not [row for row in vl.elements() if row[2] == "checkpoint" and row[4]]
    assert any(row[2] == "checkpoint" for row in vl.elements())  # (off the block ends, still inferred)
    assert vl == kv


def test_a_vllm_folder_shadowing_the_install_is_named(tmp_path):
    """A ``vllm`` package earlier on the path than the install (a checkout's folder, a stray
    copy): the error named no file ("fix it there" pointing at nothing) and said vLLM 0.33.0,
    the install's version, with nothing to tell that another vllm was imported."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.cli.support import assert_one_line

    shadow = tmp_path / "shadow" / "vllm"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    module = tmp_path / "module"  # (a vllm.py: named as the file, not its folder)
    module.mkdir()
    (module / "vllm.py").write_text("")
    broken = tmp_path / "broken" / "vllm"  # (one that fails with a file and line: named as a shadow all the same)
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('No module named \\'vllm.v1\\'')\n")
    for path, imported in ((tmp_path / "shadow", shadow), (module, module / "vllm.py"), (broken.parent, broken)):
        env = {**os.environ, "PYTHONPATH": str(path)}
        done = subprocess.run([sys.executable, "-m", "kvtrace.cli", "conformance", "gen:chat", "--limit", "2"],
                              cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        # (reinstalling changes nothing here: the line says what shadows the install, re-probe B)
        line = assert_one_line(done.returncode, done.stderr, "No module named 'vllm.v1'",
                               f"the vllm imported is {imported}, not the installed one at", "shadows it")
        assert "fix it there" not in line and "make vllm" not in line and done.stdout == ""


def test_a_request_that_ran_until_it_preempted_itself_is_not_told_as_never_run(vllm_api, tmp_path):
    # 64 prompt tokens in 4 usable 16-token blocks: the prefill runs (its allocation and table
    # compared), the first decode token needs a fifth block and the request preempts itself.
    # The report said "no request ran" of it.
    import json

    from kvtrace.replay.conformance import ConformanceSpec, format_report, run_conformance

    trace = tmp_path / "fit.jsonl"
    rows = [{"kvtrace_trace": 1}, {"request_id": "a", "arrival_ns": 0, "input_length": 64, "output_length": 4,
                                   "token_ids": list(range(1, 65))}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_conformance(ConformanceSpec(str(trace), preset="dense-attention", capacity_blocks=(5, 4)),
                             api=vllm_api)
    ran, never = result.runs
    assert result.agree and (ran.requests, ran.unschedulable, ran.preemptions) == (0, 1, 1)
    assert ran.compared["block_table"] > 0 and never.compared["block_table"] == 0
    report = format_report(result)
    notes = [line.split(":")[0].strip() for line in report if line.startswith("  no request")]
    assert notes == ["no request finished", "no request ran"], report


@pytest.mark.parametrize("text", ["[]", '"x"', '{"vcs_info": "abc"}', '{"dir_info": "x", "url": "file:///tmp"}',
                                  '{"vcs_info": {"commit_id": 7}}'])
def test_a_damaged_direct_url_json_says_nothing_of_the_commit(monkeypatch, text):
    # PEP 610's direct_url.json holds objects; a list or string in it (hand-edited, damaged)
    # raised AttributeError out of vllm_commit, a traceback from `replay --backend vllm`
    import sys
    import types
    from importlib import metadata

    from kvtrace.engine.backends.vllm import _load

    class Distribution:
        def read_text(self, name: str) -> str | None:
            return text if name == "direct_url.json" else None

    monkeypatch.setattr(metadata, "distribution", lambda name: Distribution())
    # (and no build-recorded commit either)
    monkeypatch.setitem(sys.modules, "vllm._version", types.SimpleNamespace())
    assert _load.vllm_commit() is None
