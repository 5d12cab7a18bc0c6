"""The metric definitions a run was recorded under (``kvtrace.metrics.DEFINITIONS``).

A stored run keeps the numbers of the kvtrace that recorded it: cow_copies counted the
external tier's loads before 2026-12-06, so a run from before then beside one from after
showed a drop no setting explained. Each replay records the version in its config, and a
comparison of runs recorded under different versions says so and is no isolated change.
"""

from __future__ import annotations

import json

import duckdb
import pytest

from kvtrace import metrics
from kvtrace.compare import pairing
from kvtrace.store import read

TRACE = "tests/data/mooncake_synthetic_trace.jsonl"


def _cli(argv, capsys):
    from tests.cli.support import run

    code, out, err = run(argv, capsys)
    assert code == 0, err
    return out


@pytest.fixture
def two_runs(tmp_path, capsys):
    """Two cache-only runs of one trace, one capacity apart, in a real DuckDB store."""
    db = str(tmp_path / "s.duckdb")
    for blocks in ("30", "400"):  # (their hit rates differ: 0.68% and 2.26%)
        _cli(["replay", TRACE, "--mode", "cache-only", "--capacity-blocks", blocks, "--limit", "150", "--db", db],
             capsys)
    ids = [r["run_id"] for r in read.runs(db).iter_rows(named=True)]
    return db, sorted(ids)


def _forget_definitions(db: str, run_id: str) -> None:
    """The run as a kvtrace before version 1 stored it: no definitions in its config."""
    con = duckdb.connect(db)
    try:
        (config,) = con.execute("SELECT config FROM runs WHERE run_id = ?", [run_id]).fetchone()
        config = json.loads(config)
        del config[metrics.DEFINITIONS_CONFIG_KEY]
        con.execute("UPDATE runs SET config = ? WHERE run_id = ?", [json.dumps(config), run_id])
    finally:
        con.close()


def test_a_replay_records_the_definitions_it_was_recorded_under(two_runs):
    db, ids = two_runs
    for run_id in ids:
        config = read.run(db, run_id)["config"]
        assert config[metrics.DEFINITIONS_CONFIG_KEY] == metrics.DEFINITIONS
        assert metrics.recorded_definitions("cache-only/lru", config) == metrics.DEFINITIONS


def test_diff_of_runs_recorded_under_other_definitions_says_which_numbers_changed(two_runs, capsys):
    db, (a, b) = two_runs
    out = _cli(["diff", a, b, "--db", db, "--json"], capsys)
    assert not any("definitions" in n for n in json.loads(out)["notes"])  # (both today's)
    _forget_definitions(db, a)
    notes = json.loads(_cli(["diff", a, b, "--db", db, "--json"], capsys))["notes"]
    assert notes[0].startswith("runs A and B were recorded under different metric definitions (A none recorded")
    assert "version 1 (2026-12-06): cow_copies counts copy-on-write copies only" in notes[0]
    assert notes[0].endswith("Replay run A with this kvtrace to compare like with like")
    # the terminal table prints it too, and B as the older side when the order is swapped
    assert "Replay run B with this kvtrace" in " ".join(_cli(["diff", b, a, "--db", db], capsys).split())


def test_runs_recorded_under_other_definitions_are_no_isolated_change(two_runs):
    db, (a, b) = two_runs
    _forget_definitions(db, a)
    ra, rb = read.run(db, a), read.run(db, b)
    diffs = pairing.differences(ra, rb)
    assert diffs[0].setting == "metric definitions"
    # (in the words diff's note uses)
    assert (diffs[0].a, diffs[0].b) == ("none recorded: before version 1", f"version {metrics.DEFINITIONS}")
    assert pairing.mismatches(ra, rb)  # (capacity differs too; alone it would still be one)
    # one setting apart, but under other definitions: never a Compare partner
    rc = {**rb, "config": {**rb["config"], "capacity_blocks": ra["config"]["capacity_blocks"]}}
    assert [d.kind for d in pairing.differences(ra, rc)] == ["definitions"]
    assert pairing.mismatches(ra, rc)
    assert pairing.partner(ra, [rc]) is None
    # the version is no setting: two runs of one version differ in nothing for it
    assert "definitions" not in pairing.settings(rb)


@pytest.mark.parametrize(("mode", "config", "expected"), [
    ("engine", {}, 0),  # a replay from before version 1
    ("cache-only/lru", {"definitions": 1}, 1),
    ("live", {}, None),  # a live capture records no summary of kvtrace's definitions
    ("otlp", {}, None),  # a sender that said nothing
    ("otlp", {"definitions": 1}, 1),  # a kvtrace sender's record
    ("otlp", {"mode": "cache-only"}, 0),  # a collected replay of a kvtrace that recorded none
    ("engine", {"definitions": "1"}, None),  # not a version: unknown, never a false note
    ("engine", {"definitions": True}, None),
    ("engine", {"definitions": -1}, None),
    ("engine", None, 0),
])
def test_recorded_definitions(mode, config, expected):
    assert metrics.recorded_definitions(mode, config) == expected


def test_the_note_names_a_newer_kvtraces_version_it_cannot_explain():
    note = metrics.definitions_note(metrics.DEFINITIONS + 1, metrics.DEFINITIONS)
    # (replayed here, the newer run is recorded under the older one's definitions)
    assert note is not None and note.endswith("Replay run A with this kvtrace to compare like with like")
    assert f"version {metrics.DEFINITIONS + 1}: unknown to this kvtrace (version {metrics.DEFINITIONS})" in note
    # one before this kvtrace's and one after it: replaying either alone leaves them apart
    both = metrics.definitions_note(metrics.DEFINITIONS - 1, metrics.DEFINITIONS + 1)
    assert both is not None and "Replay both runs with this kvtrace" in both
    # two after it: only the versions past the older of them are named, as unknown
    later = metrics.definitions_note(metrics.DEFINITIONS + 1, metrics.DEFINITIONS + 2)
    assert later is not None and f"Changed since run A's: version {metrics.DEFINITIONS + 2}: unknown" in later
    assert "Replay both runs" in later
    assert metrics.definitions_note(None, 0) is None
    assert metrics.definitions_note(1, 1) is None


def test_a_gate_that_fails_across_definitions_says_so(two_runs, capsys):
    """A --fail-if gate failed on a pair recorded under different definitions, its line silent
    on them (re-probe B)."""
    from tests.cli.support import run

    db, (a, b) = two_runs
    _forget_definitions(db, a)
    code, _, err = run(["diff", a, b, "--db", db, "--fail-if", "prefix_cache_hit_rate:+0.0"], capsys)
    assert code == 1 and "gate failed: prefix_cache_hit_rate rose" in err, err
    assert "recorded under different metric definitions" in err
