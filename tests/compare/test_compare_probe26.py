"""kvtrace diff's numbers against what the store records, where a run kept no summary of its own
(a failed run): its blocks' size is the one its config records, as `kvtrace runs` lists it."""

from __future__ import annotations

import json
import math

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


@pytest.fixture(scope="module")
def chat_pairs(tmp_path_factory):
    """All behaviours on (r1), then without shared-prefix-pinning (r2, latency shifts its CIs
    find) and without transient-checkpoint-retention (r3, shifts its CIs do not find)."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("probe26v") / "v.duckdb"
    ids = [run_replay(RunSpec("gen:chat", preset="kimi-hybrid", capacity_blocks=40, limit=80, without=w), db=db).run_id
           for w in ((), ("shared-prefix-pinning",), ("transient-checkpoint-retention",))]
    return str(db), ids


def _marks(markdown: str) -> tuple[dict[str, str], dict[str, str]]:
    """The verdict cell of each summary row and each percentile row of a diff's markdown."""
    summary: dict[str, str] = {}
    latency: dict[str, str] = {}
    table = summary
    for line in markdown.splitlines():
        if line.startswith("| percentile |"):
            table = latency
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0].endswith("_ms"):
            table[cells[0]] = cells[5]
    return summary, latency


def test_a_latency_row_says_what_its_bootstrap_ci_says(chat_pairs, capsys):
    """The summary table called median_ttft_ms "✅ better" (-0.24 ms) beside the percentile table's
    p50_ttft_ms of the same number with a CI across zero and no verdict: one number, two readings."""
    from kvtrace.compare.source import diff_runs

    db, (on, no_pinning, no_retention) = chat_pairs
    for b in (no_pinning, no_retention):
        d = diff_runs(db, on, b)
        code, out, err = run(["diff", on, b, "--db", db, "--markdown"], capsys)
        assert code == 0, err
        summary, latency = _marks(out)
        checked = 0
        for s in d.latency:
            if math.isnan(s.ci_low):
                continue
            mark = latency[s.name]
            assert mark == ("" if not s.significant else "❌ worse" if s.delta > 0 else "✅ better")
            for name in (s.name, s.name.replace("p50_", "median_")):
                if name in summary:
                    assert summary[name] == mark, (name, s)
                    checked += 1
        assert checked >= 4
    # the pair without retention holds a change its CI does not find; the one without pinning, findings
    quiet = [s for s in diff_runs(db, on, no_retention).latency if s.delta != 0 and not s.significant
             and not math.isnan(s.ci_low)]
    assert quiet and any(s.significant for s in diff_runs(db, on, no_pinning).latency)


def test_runs_json_cut_by_limit_says_how_many_it_left_out(chat_pairs, capsys):
    db, ids = chat_pairs
    code, out, err = run(["runs", "--db", db, "--json", "--limit", "1"], capsys)
    assert code == 0 and [r["run_id"] for r in json.loads(out)["runs"]] == [ids[-1]]
    assert err.strip() == f"{len(ids) - 1} older runs not listed (--limit 0 lists all {len(ids)})"
    code, out, err = run(["runs", "--db", db, "--json", "--limit", str(len(ids))], capsys)
    assert code == 0 and len(json.loads(out)["runs"]) == len(ids) and err == ""


def test_a_belady_bounds_evictions_are_not_set_against_lru_ones_as_zero(tmp_path, capsys):
    """A Belady bound counts its evictions (457) but records no evicted block: the evictions
    table said "lru 457 -> 0, -457" beside the summary's "evictions 457 -> 457, +0"."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "b.duckdb"
    lru = run_replay(RunSpec("gen:chat", limit=40, mode="cache-only", capacity_blocks=50), db=db)
    bel = run_replay(RunSpec("gen:chat", limit=40, mode="cache-only", policy="belady", capacity_blocks=50), db=db)
    assert lru.summary["evictions"] > 0 and bel.summary["evictions"] > 0
    code, out, err = run(["diff", lru.run_id, bel.run_id, "--db", str(db), "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["metrics"]["evictions"]["b"] == bel.summary["evictions"]
    assert "evictions" not in d  # no split of B's evictions to set A's against
    assert any("run B (cache-only) counts evictions but records no evicted blocks" in n for n in d["notes"])
    # two LRU runs keep their split, and it adds up to the summary's evictions
    lru2 = run_replay(RunSpec("gen:chat", limit=40, mode="cache-only", capacity_blocks=60), db=db)
    code, out, err = run(["diff", lru.run_id, lru2.run_id, "--db", str(db), "--json"], capsys)
    d = json.loads(out)
    split = d["evictions"]["by_reason"]
    assert sum(v["a"] for v in split.values()) == d["metrics"]["evictions"]["a"]
    assert sum(v["b"] for v in split.values()) == d["metrics"]["evictions"]["b"]


def test_a_study_names_its_runs_behaviours_alike_with_and_without_a_store(tmp_path, capsys):
    code, out, err = run(["study", "shared-prefix-pinning", "--json", "--limit", "20"], capsys)
    assert code == 0, err
    alone = json.loads(out)["diff"]
    code, out, err = run(["study", "shared-prefix-pinning", "--json", "--limit", "20", "--db",
                          str(tmp_path / "s.duckdb")], capsys)
    assert code == 0, err
    stored = json.loads(out)["diff"]
    for side in ("run_a", "run_b"):
        assert alone[side]["behaviours"] == stored[side]["behaviours"]
    assert "shared-prefix-pinning" in stored["run_b"]["behaviours"]


def test_a_run_diffed_with_itself_while_it_is_written_is_read_once_from_one_state(chat_pairs, monkeypatch):
    """A running run diffed with itself said requests 1,226 (A) vs 1,301 (B): each side's
    summary and frames were read at another moment of the writer's progress. Here each read
    of a summary sees a later state, as a writer's commits make it; every frame is read
    inside one snapshot of the store."""
    from kvtrace.compare.source import diff_runs
    from kvtrace.store import read
    from kvtrace.store.read import _sql

    db, (run, *_) = chat_pairs
    grown = iter(range(1, 100))
    real_summary, real_requests = read.summary_with_spans, read.requests
    outside: list[str] = []

    def later_summary(db_, run_id, stored):
        s = dict(real_summary(db_, run_id, stored))
        s["requests"] += next(grown)  # (the writer's next commit)
        return s

    def requests_in_snapshot(db_, run_id, *args, **kwargs):
        if _sql._SNAPSHOT.get() is None:
            outside.append(run_id)
        return real_requests(db_, run_id, *args, **kwargs)

    monkeypatch.setattr(read, "summary_with_spans", later_summary)
    monkeypatch.setattr(read, "requests", requests_in_snapshot)
    d = diff_runs(db, run, run)
    assert d.metric("requests").delta == 0
    assert all(m.delta in (0, None) for m in d.metrics), [m for m in d.metrics if m.delta not in (0, None)]
    assert all(s.delta == 0 for s in d.latency)
    assert not outside
