"""Probe 24 (store): what the store's readers say of stores kvtrace itself wrote, older
schema versions and hard stops included, checked against the raw span tables."""

from __future__ import annotations

import duckdb
import pytest

from kvtrace.store import StoreError, read
from tests.cli.support import assert_one_line
from tests.cli.support import run as kvtrace


@pytest.fixture(scope="module")
def engine_store(tmp_path_factory) -> bytes:
    """The bytes of a store holding one engine run of 8 requests, r1."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("engine") / "e.duckdb"
    run_replay(RunSpec("gen:mixed", limit=8, content=False), db=db)
    return db.read_bytes()


def _as_version_2(tmp_path, data: bytes):
    """The store as kvtrace's schema version 2 left it where a read of today's differs: its
    version row says 2, and it has no latency_cdf (v2 kept latency_quantiles instead)."""
    db = tmp_path / "v2.duckdb"
    db.write_bytes(data)
    con = duckdb.connect(str(db))
    con.execute("UPDATE kvtrace_meta SET value = '2' WHERE key = 'schema_version'")
    con.execute("DROP TABLE latency_cdf")
    con.execute("CREATE TABLE latency_quantiles (run_id VARCHAR, metric VARCHAR, q DOUBLE, value_ns DOUBLE)")
    con.close()
    return db


def test_a_read_an_older_store_cannot_answer_names_its_version_not_damage(tmp_path, engine_store, capsys):
    """A version 2 store is readable (``runs`` lists it) and refused for appending; a read that
    needs a table or column version 3 added (the latency CDF of ``diff`` and ``export``, the
    external query column of the hit counters) called it a "damaged kvtrace store (Catalog
    Error: ...)", where nothing in it is damaged: it is older."""
    db = _as_version_2(tmp_path, engine_store)
    assert read.runs(db)["run_id"].to_list() == ["r1"]  # (what it can read, it reads)
    with pytest.raises(StoreError, match=r"schema version 2 predates this kvtrace's \(3\)") as err:
        read.latency_cdf(db, "r1")
    assert "damaged" not in str(err.value) and "latency_cdf" in str(err.value)
    code, _, stderr = kvtrace(["diff", "r1", "r1", "--db", str(db)], capsys)
    line = assert_one_line(code, stderr, str(db), "schema version 2 predates")
    assert "damaged" not in line
    # a store of today's version missing the same table is damaged, as before
    current = tmp_path / "v3.duckdb"
    current.write_bytes(engine_store)
    con = duckdb.connect(str(current))
    con.execute("DROP TABLE latency_cdf")
    con.close()
    with pytest.raises(StoreError, match="damaged kvtrace store"):
        read.latency_cdf(current, "r1")


def test_a_summary_from_spans_reads_one_committed_state_of_the_store(tmp_path, engine_store, monkeypatch):
    """A running run's summary (``runs``, ``diff`` and the dashboard's tiles) is several
    queries; each opened the store anew, so a writer's commit between them gave a summary of
    two states: polled during a replay, ``requests`` 93 and ``prefix_cache_queries`` 1,502,637
    beside ``prompt_tokens`` 5,745,269 (every engine run's prompt tokens are its queries)."""
    from kvtrace.store.read import summary as summary_module

    db = tmp_path / "e.duckdb"
    db.write_bytes(engine_store)
    real = summary_module.hit_counters
    wrote: list[bool] = []

    def then_a_writer_commits(*args, **kwargs):
        counters = real(*args, **kwargs)
        try:  # another request span committed right after the hit counters were read
            con = duckdb.connect(str(db))
        except duckdb.Error:  # the store is held for the summary's reads: the writer waits for them
            wrote.append(False)
            return counters
        con.execute("INSERT INTO spans_request BY NAME SELECT 'r1' AS run_id, 'kvtrace.request' AS name, "
                    "'late' AS request_id, 1000 AS num_prompt_tokens, 0 AS num_output_tokens, "
                    "(SELECT max(seq) + 1 FROM spans WHERE run_id = 'r1') AS seq")
        con.close()
        wrote.append(True)
        return counters

    monkeypatch.setattr(summary_module, "hit_counters", then_a_writer_commits)
    summary = read.summary_from_spans(db, "r1")
    assert summary["prompt_tokens"] == summary["prefix_cache_queries"]
    assert wrote == [False]


def test_a_writer_pid_reused_by_another_users_process_is_no_writer(monkeypatch):
    """A killed replay's pid taken by another user's process: signalling it is not permitted,
    and that alone counted as the writer alive, so the run read ``running`` for good (and no
    writer recovered it), where its start time, which /proc shows anyone, says it is another
    process."""
    import os

    from kvtrace.store import liveness

    def not_permitted(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(liveness.os, "kill", not_permitted)
    me, host = os.getpid(), liveness.host_name()
    mine = liveness.process_start_token(me)
    assert mine is not None
    assert not liveness.writer_alive(me, host, f"{mine}0", db="s.duckdb", run_id="r1")  # reused
    assert liveness.writer_alive(me, host, mine, db="s.duckdb", run_id="r1")  # its own writer
    assert liveness.writer_alive(me, host, None, db="s.duckdb", run_id="r1")  # no token kept: as before
    assert liveness.shown_status("running", me, host, f"{mine}0", db="s.duckdb", run_id="r1") == "incomplete"


def test_cow_copies_leave_out_the_external_tiers_loads_in_the_summary_and_from_the_spans(tmp_path):
    """An external-tier load into a local block is a copy event (``external``), not a
    copy-on-write: cow_copies said 975 where 123 were copies and 852 loads, and the README
    calls it copy-on-write block copies. The engine's summary and the one from the spans agree."""
    from kvtrace.cache.events import COPY_EXTERNAL
    from kvtrace.replay.run import RunSpec, run_replay
    from kvtrace.store.schema import COPY_REASON_EXTERNAL

    assert COPY_REASON_EXTERNAL == COPY_EXTERNAL
    db = tmp_path / "ext.duckdb"
    result = run_replay(RunSpec("gen:mixed", limit=120, capacity_blocks=40, external_capacity_blocks=4096,
                                content=False), db=str(db))
    with duckdb.connect(str(db), read_only=True) as con:
        reasons = dict(con.sql("SELECT copy_reason, count(*) FROM spans WHERE name = 'kvtrace.cache.cow' "
                               "GROUP BY ALL").fetchall())
    assert reasons.get(COPY_EXTERNAL, 0) > 0 and sum(reasons.values()) > reasons[COPY_EXTERNAL]  # both kinds
    copies = sum(n for why, n in reasons.items() if why != COPY_EXTERNAL)
    assert result.summary["cow_copies"] == copies
    assert read.summary_from_spans(db, result.run_id)["cow_copies"] == copies
    # the request waterfall marks a load as a load, not as a CoW copy
    with duckdb.connect(str(db), read_only=True) as con:
        rid, loads, cows = con.execute(
            "SELECT request_id, count(*) FILTER (WHERE copy_reason = 'external'), "
            "count(*) FILTER (WHERE copy_reason <> 'external') FROM spans WHERE name = 'kvtrace.cache.cow' "
            "GROUP BY request_id ORDER BY 2 DESC, 1 LIMIT 1").fetchall()[0]
    marks = read.request_waterfall(db, result.run_id, rid)["segment"].to_list()
    assert loads > 0 and (marks.count("load"), marks.count("cow")) == (loads, cows)


def test_steps_from_the_spans_count_each_step_once_with_a_final_audits_span(tmp_path):
    """A final audit that finds stale hashes adds a zero-length step span under the last step's
    number: the summary from spans (a stopped run's, the one `runs` and `diff` read) said 827
    steps where the run's own summary said 826."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "stale.duckdb"
    result = run_replay(RunSpec("gen:mixed", limit=30, capacity_blocks=40, external_capacity_blocks=4096,
                                without=("external-hit-running-cow",)), db=str(db))
    with duckdb.connect(str(db), read_only=True) as con:
        spans, numbers = con.execute("SELECT count(*), count(DISTINCT step) FROM spans "
                                     "WHERE name = 'kvtrace.engine.step'").fetchall()[0]
    assert spans == numbers + 1  # (the audit's span: the case at hand)
    assert read.summary_from_spans(db, result.run_id)["steps"] == result.summary["steps"] == numbers


def test_the_prefix_reuse_gap_is_between_requests_not_a_waiting_requests_own_lookups(tmp_path):
    """A request waiting for room looks its prompt up again every step: each retry counted as a
    reuse of the prefix one step after the last (51 of 79 gaps of one external-tier run). A gap
    is now between consecutive requests' first lookups of a root hash, at the requests that hit."""
    import collections

    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "wait.duckdb"
    result = run_replay(RunSpec("gen:mixed", limit=80, capacity_blocks=40, external_capacity_blocks=30,
                                content=False), db=str(db))
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT root_hash, request_id, step, num_hit_tokens + coalesce(num_external_hit_tokens, 0) "
                           "FROM spans WHERE run_id = ? AND "
                           "name = 'kvtrace.cache.lookup' AND root_hash IS NOT NULL ORDER BY seq",
                           [result.run_id]).fetchall()
        stored = dict(con.execute("SELECT x, n FROM block_values WHERE run_id = ? AND metric = 'reuse_gap'",
                                  [result.run_id]).fetchall())
    per_request = collections.Counter((root, rid) for root, rid, _, _ in rows)
    assert max(per_request.values()) > 1  # (requests looked a prefix up more than once: the case at hand)
    first: dict[tuple, list] = {}
    for root, rid, step, hit in rows:
        entry = first.setdefault((root, rid), [step, False])
        entry[1] = entry[1] or bool(hit)
    expected: collections.Counter = collections.Counter()
    last: dict = {}
    for (root, _), (step, hit) in first.items():  # (insertion order: first lookups in seq order)
        if root in last and hit:
            expected[step - last[root]] += 1
        last[root] = step
    assert stored == dict(expected) and sum(expected.values()) > 0
    with duckdb.connect(str(db), read_only=True) as con:  # (a tier hit alone is a reuse too: the case at hand)
        (tier_only,) = con.execute("SELECT count(*) FROM spans WHERE run_id = ? AND name = 'kvtrace.cache.lookup' "
                                   "AND num_hit_tokens = 0 AND num_external_hit_tokens > 0",
                                   [result.run_id]).fetchall()[0]
    assert tier_only > 0


def test_block_histograms_leave_out_an_unknown_idle(tmp_path, vllm_api):
    """vLLM's backend reports idle -1 (vLLM does not say when a block was last used): the
    idle-before-eviction histogram binned those as values, a bin [-1, 3) of 294 blocks."""
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path / "vllm.duckdb"
    run_id = run_replay(RunSpec("gen:mixed", limit=30, capacity_blocks=30, backend="vllm", content=False),
                        db=str(db)).run_id
    with duckdb.connect(str(db), read_only=True) as con:
        (unknown,) = con.execute("SELECT count(*) FROM evicted_blocks WHERE run_id = ? AND idle < 0",
                                 [run_id]).fetchall()[0]
    assert unknown > 0  # (the case at hand)
    hist = read.block_histograms(db, run_id)
    assert hist.filter(hist["bin_lo"] < 0).height == 0 and hist.height > 0
