"""kvtrace diff and runs on pairs of run kinds: what each view says of a run's behaviours, of
evicted blocks of two sizes, and of a run that keeps no per-request hits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import pytest

from kvtrace.compare.source import diff_runs


def _tampered(src: str, dst: Path, sql: str, params: list) -> str:
    shutil.copy(src, dst)
    con = duckdb.connect(str(dst))
    try:
        con.execute(sql, params)
    finally:
        con.close()
    return str(dst)


def test_a_behaviours_object_lists_only_the_switched_on_ones(tmp_path, replayed_store, capsys):
    """A run record's behaviours may be a {name: on} object (read.runs takes it): `runs` (table
    and JSON) and `diff` (every rendering) listed its keys, the switched-off ones as on."""
    from tests.cli.support import run

    on, off = replayed_store.run_on, replayed_store.run_off
    stored = {"shared-prefix-pinning": True, "external-hit-running-cow": False, "transient-checkpoint-retention": 0}
    db = _tampered(replayed_store.path, tmp_path / "t.duckdb", "UPDATE runs SET behaviours = ? WHERE run_id = ?",
                   [json.dumps(stored), off])
    code, out, err = run(["runs", "--db", db, "--json"], capsys)
    assert code == 0, err
    listed = {r["run_id"]: r["behaviours"] for r in json.loads(out)["runs"]}
    assert listed[off] == ["shared-prefix-pinning"]
    code, out, err = run(["runs", "--db", db], capsys)
    row = next(line for line in out.splitlines() if f" {off} " in line)
    assert code == 0 and "shared-prefix-pinning" in row and "external-hit" not in row and "transient" not in row, row
    d = diff_runs(db, on, off)
    assert d.run_b["behaviours"] == ["shared-prefix-pinning"]
    code, out, err = run(["diff", on, off, "--db", db, "--markdown"], capsys)
    line = next(x for x in out.splitlines() if x.startswith("Behaviours:"))
    assert code == 0 and line.endswith("· B `shared-prefix-pinning`"), line
    code, out, err = run(["diff", on, off, "--db", db, "--json"], capsys)
    assert code == 0 and json.loads(out)["run_b"]["behaviours"] == ["shared-prefix-pinning"]


@pytest.fixture(scope="module")
def engine_and_cache_only(tmp_path_factory):
    """An engine run (512-token blocks, request spans) and a cache-only run of the same
    requests (16-token blocks, no request spans)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("kinds") / "s.duckdb"
    a = run_replay(RunSpec("gen:chat", limit=20, capacity_blocks=40), db=db)
    b = run_replay(RunSpec("gen:chat", limit=20, mode="cache-only", capacity_blocks=60), db=db)
    return str(db), a.run_id, b.run_id


def test_evicted_blocks_of_two_block_sizes_have_no_delta_in_any_view(engine_and_cache_only, capsys):
    """The summary's evictions of two block sizes have no delta (its note says so), but the
    eviction table under it set 512-token blocks against 16-token ones: 'lru 74 683 +609'."""
    from tests.cli.support import run

    db, a, b = engine_and_cache_only
    d = diff_runs(db, a, b)
    assert d.metric("evictions").delta is None
    shifts = d.evictions_by_reason + d.evictions_by_publish_kind
    assert shifts and all(s.delta is None for s in shifts)
    assert any(s.a != s.b for s in shifts)  # (counts there are, each shown without a change)
    code, out, err = run(["diff", a, b, "--db", db, "--json"], capsys)
    by_reason = json.loads(out)["evictions"]["by_reason"]
    assert code == 0 and by_reason and all(v["delta"] is None for v in by_reason.values()), by_reason
    code, out, err = run(["diff", a, b, "--db", db, "--markdown"], capsys)
    rows = [line for line in out.splitlines() if line.startswith(("| reason |", "| publish kind |"))]
    assert code == 0 and rows and all(line.endswith("| – |") for line in rows), rows
    code, out, err = run(["diff", a, b, "--db", db], capsys)
    rows = [line for line in out.splitlines() if line.startswith(("│ reason ", "│ publish kind "))]
    assert code == 0 and rows and all(line.rstrip(" │").endswith("–") for line in rows), rows
    same = diff_runs(db, a, a)  # (one block size: the changes are there)
    assert all(s.delta == 0 for s in same.evictions_by_reason)


def test_a_run_without_per_request_hits_is_not_said_to_lack_the_requests(engine_and_cache_only, capsys):
    """A cache-only run keeps no request spans: the diff of an engine run against it said
    'Only in A: 20, only in B: 0' of requests both replayed. It says the run records none."""
    from tests.cli.support import run

    db, a, b = engine_and_cache_only
    for x, y, side in ((a, b, "B"), (b, a, "A")):
        d = diff_runs(db, x, y)
        assert d.requests is not None and (d.requests.only_a, d.requests.only_b, d.requests.requests) == (0, 0, 0)
        assert f"run {side} (cache-only) records no per-request hits: per-request cached tokens are not " \
               "compared" in d.notes
        code, out, err = run(["diff", x, y, "--db", db, "--markdown"], capsys)
        assert code == 0 and "Only in" not in out and "Per-request cached tokens" not in out
        assert f"> ⚠️ run {side} (cache-only) records no per-request hits" in out
    both = diff_runs(db, a, a)  # (an engine pair pairs its requests as before)
    assert both.requests is not None and both.requests.requests == 20
    assert not [n for n in both.notes if "per-request" in n]


@pytest.mark.parametrize(("values", "says"), [
    ({"prefix_cache_hit_rate": float("inf")}, "prefix_cache_hit_rate: expected a rate from 0 to 1, got inf"),
    ({"mean_e2el_ms": 1e308}, "mean_e2el_ms: expected a time in ms"),
    ({"requests": "thirty"}, "requests: expected a count (an integer from 0 to 2^63-1), got 'thirty'"),
    ({"evictions": 10**400}, "evictions: expected a count"),
    # (diff showed these as they were: "-1 … +1337.6%", a capacity of -5 beside runs' 50×512)
    ({"steps": "lots"}, "steps: expected a count"),
    ({"table_disagreements": 2.5}, "table_disagreements: expected a count"),
    ({"virtual_duration_s": -1}, "virtual_duration_s: expected a finite number >= 0, got -1"),
    ({"capacity_blocks": -5}, "capacity_blocks: expected a size (an integer from 1 to 2^63-1), got -5"),
    ({"evictions_by_reason": {"lru": "x"}}, "evictions_by_reason: expected an object of counts by reason"),
])
def test_a_summary_value_kvtrace_never_writes_is_a_damaged_record_in_every_view(tmp_path, replayed_store, capsys,
                                                                                values, says):
    """A record's Infinity (JSON that Python reads, kvtrace never writes) was null in --json,
    '+inf ✅ better' in --markdown and 'inf%' in runs, a drop gate on it passed; a text count
    was a TypeError in diff, a 10**400 an OverflowError, a 1e308 309 digits in a cell. The
    summary is checked as a collector checks one it receives (metrics.summary_problem): the
    run is damaged, which runs, diff and the dashboard each say in one line."""
    from kvtrace.store import read
    from tests.cli.support import run

    on, off = replayed_store.run_on, replayed_store.run_off
    summary = dict(read.run(replayed_store.path, off)["summary"], **values)
    db = _tampered(replayed_store.path, tmp_path / "t.duckdb", "UPDATE runs SET summary = ? WHERE run_id = ?",
                   [json.dumps(summary), off])
    for argv in (["diff", on, off, "--db", db, "--markdown", "--fail-if", "prefix_cache_hit_rate:-0.5"],
                 ["diff", on, off, "--db", db, "--json"]):
        code, out, err = run(argv, capsys)
        assert code == 2 and out == "" and f"run {off}'s summary: {says}" in err and len(err.splitlines()) == 1, err
    code, out, err = run(["runs", "--db", db, "--json"], capsys)
    listed = next(r for r in json.loads(out)["runs"] if r["run_id"] == off)
    assert code == 0 and listed["status"] == "damaged" and says in listed["damage"], listed
    assert next(r for r in json.loads(out)["runs"] if r["run_id"] == on)["status"] == "complete"  # (the others)


def test_an_engine_run_against_a_cache_only_run_says_their_hit_rules_differ(engine_and_cache_only, capsys):
    """The two modes count hits by two rules (README, Metrics: a prompt cached whole hits whole
    in cache-only mode; the engine recomputes its last token): a diff of one against the other
    set their hit rates side by side without a word."""
    from tests.cli.support import run

    db, a, b = engine_and_cache_only
    for x, y, modes in ((a, b, "engine vs cache-only"), (b, a, "cache-only vs engine")):
        assert [n for n in diff_runs(db, x, y).notes if n.startswith(f"modes differ ({modes}): cache-only counts")]
        code, out, _ = run(["diff", x, y, "--db", db, "--markdown"], capsys)
        assert code == 0 and f"> ⚠️ modes differ ({modes})" in out
    for x in (a, b):
        assert not [n for n in diff_runs(db, x, x).notes if n.startswith("modes differ")]


def test_a_gate_that_cannot_be_evaluated_on_two_values_says_why(engine_and_cache_only):
    """'block_hit_rate:+0: cannot evaluate (A=0.1583, B=0.3615)' gave two numbers and no
    reason: blocks of two sizes, or a relative change from a zero baseline."""
    from kvtrace.compare.gates import check_fail_if
    from kvtrace.compare.model import diff_summaries

    db, a, b = engine_and_cache_only
    (msg,) = check_fail_if(diff_runs(db, a, b), ["block_hit_rate:+0"])
    assert msg.startswith("block_hit_rate:+0: cannot evaluate: A and B count blocks of two sizes (A=0."), msg
    d = diff_summaries({"stale_hashes": 0, "divergent_outputs": 0}, {"stale_hashes": 0, "divergent_outputs": None})
    assert check_fail_if(d, ["stale_hashes:+5%", "divergent_outputs:+5%"]) == [
        "divergent_outputs:+5%: cannot evaluate (A=0, B=–)"]  # (0 and 0: no change, which passes)


def test_requests_of_one_id_with_other_prompts_are_not_paired(tmp_path, capsys):
    """Two seeds of a generated workload name their requests alike (chat0-t0, ...): a forced
    diff set each against another request of its id ('9 gained, 5 lost of 25 common'); the
    refusal blamed --limit, --block-size or --format. One trace cut at two --limit is still
    paired request by request."""
    import numpy as np
    import polars as pl

    from kvtrace.compare.bootstrap import latency_shifts
    from kvtrace.replay.run import RunSpec, run_replay
    from tests.cli.support import assert_one_line, run

    db = str(tmp_path / "s.duckdb")
    one, two, longer = (run_replay(RunSpec("gen:chat", limit=n, seed=s), db=db).run_id
                        for s, n in ((1, 15), (2, 15), (1, 16)))
    code, _, err = run(["diff", one, two, "--db", db], capsys)
    assert_one_line(code, err, "replay different traces ('gen:chat', generated differently (another --limit or "
                               "--seed)); pass --force")
    d = diff_runs(db, one, two, force=True)
    assert d.requests is not None and (d.requests.requests, d.requests.gained, d.requests.lost) == (0, 0, 0)
    assert [n for n in d.notes if "request ids both runs hold have other prompt lengths in A and B" in n]
    assert d.bootstrap["paired"] is False
    code, out, _ = run(["diff", one, two, "--db", db, "--force", "--markdown"], capsys)
    assert code == 0 and "Per-request cached tokens" not in out and "they name other requests" in out
    cut = diff_runs(db, one, longer, force=True)  # (the first 15 of the same requests)
    assert cut.requests is not None and cut.requests.requests == 15
    assert not [n for n in cut.notes if "other prompt lengths" in n]
    # the bootstrap is told: one universe of ids, never paired when they name other requests
    frame = {"ttft_ms": pl.DataFrame({"request_id": [f"r{i}" for i in range(20)], "ttft_ms": np.arange(20.0)})}
    assert latency_shifts(frame, frame)[1]["paired"] is True
    assert latency_shifts(frame, frame, pair=False)[1]["paired"] is False


def test_a_stored_mode_never_reaches_a_note_as_markup(tmp_path, engine_and_cache_only, capsys):
    """Notes are kvtrace's own text, rendered as Markdown as they are: the modes note and the
    per-request note quoted the stored mode, so a record's 'cache-only/<img src=x>' was live
    HTML in --markdown."""
    from markdown_it import MarkdownIt

    from tests.cli.support import run

    src, a, b = engine_and_cache_only
    db = _tampered(src, tmp_path / "t.duckdb", "UPDATE runs SET mode = ? WHERE run_id = ?",
                   ["cache-only/<img src=x> **b**", b])
    code, md, err = run(["diff", a, b, "--db", db, "--markdown"], capsys)
    assert code == 0, err
    html = MarkdownIt("commonmark").enable("table").render(md)
    assert "<img" not in html and "<strong>b" not in html
    assert "> ⚠️ modes differ (engine vs cache-only)" in md and "> ⚠️ run B (cache-only) records no" in md
    # a mode that names no replay mode before its '/' (it was cut there and shown: live HTML)
    db = _tampered(src, tmp_path / "u.duckdb", "UPDATE runs SET mode = ? WHERE run_id = ?", ["<img src=x>", b])
    code, md, err = run(["diff", a, b, "--db", db, "--markdown"], capsys)
    html = MarkdownIt("commonmark").enable("table").render(md)
    assert code == 0 and "<img" not in html and "> ⚠️ run B (?) records no" in md, err


def test_a_stored_cost_models_coefficients_are_shown_literally(tmp_path, replayed_store, capsys):
    """The times line's coefficient changes set a record's keys and values into Markdown and
    the terminal as they were: a key '<img src=x>' was live HTML, an ESC a terminal code."""
    from markdown_it import MarkdownIt

    from kvtrace.store import read
    from tests.cli.support import run
    from tests.support.markdown import shown

    on, off = replayed_store.run_on, replayed_store.run_off
    config = read.run(replayed_store.path, off)["config"]
    config["cost_model"] = {**config["cost_model"], "<img src=x> **k**": "\x1b[31m<b>v</b>"}
    db = _tampered(replayed_store.path, tmp_path / "t.duckdb", "UPDATE runs SET config = ? WHERE run_id = ?",
                   [json.dumps(config), off])
    code, md, err = run(["diff", on, off, "--db", db, "--markdown"], capsys)
    assert code == 0, err
    html = MarkdownIt("commonmark").enable("table").render(md)
    assert "<img" not in html and "<b>" not in html and "<strong>k" not in html and "\x1b" not in md
    assert "its coefficients not the same: <img src=x> **k** A None → B \\x1b[31m<b>v</b>" in shown(md)
    code, out, err = run(["diff", on, off, "--db", db], capsys)
    assert code == 0 and "\x1b" not in out and "<img src=x> **k** A None → B \\x1b[31m<b>v</b>" in out
