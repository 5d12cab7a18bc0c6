"""Replays exported over OTLP keep their own runs at a collector, which keys runs by the
``kvtrace.run.id`` its senders name: every replay without a store named ``unrecorded`` and
was merged into one run there (two 20-request replays read as one of 1,728 spans), as two
stores' ``r1``s would be."""

from __future__ import annotations

from kvtrace.instrument.otlp.collector import OTLPCollector
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.store import read


def test_each_replay_is_its_own_run_at_one_collector(tmp_path):
    collector = OTLPCollector(tmp_path / "collected.duckdb", port=0, grpc_port=None).start()
    try:
        spec = RunSpec("gen:chat", limit=6, mode="cache-only", capacity_blocks=30)
        bare = [run_replay(spec, otlp_endpoint=collector.url) for _ in range(2)]
        stored = [run_replay(spec, db=str(tmp_path / f"local{i}.duckdb"), otlp_endpoint=collector.url)
                  for i in range(2)]
    finally:
        collector.stop()
    sent = [r.otlp_run_id for r in (*bare, *stored)]
    assert len(set(sent)) == 4, sent
    assert [r.run_id for r in stored] == ["r1", "r1"] and all(s.startswith("r1-") for s in sent[2:])
    runs = read.runs(tmp_path / "collected.duckdb")
    assert sorted(runs["run_id"].to_list()) == sorted(sent)
    for res in (*bare, *stored):
        got = read.run(tmp_path / "collected.duckdb", res.otlp_run_id)
        assert got["status"] == "complete" and got["summary"]["requests"] == res.summary["requests"] == 6
        assert got["digest"] == res.summary["digest"]


def test_the_command_says_which_run_the_collector_holds(tmp_path, capsys):
    import json

    from tests.cli.support import run

    collector = OTLPCollector(tmp_path / "collected.duckdb", port=0, grpc_port=None).start()
    try:
        code, out, err = run(["replay", "gen:chat", "--limit", "4", "--mode", "cache-only", "--otlp-endpoint",
                              collector.url, "--json"], capsys)
    finally:
        collector.stop()
    assert code == 0, err
    sent = json.loads(out)["otlp_run_id"]
    assert err.strip().splitlines() == [f"kvtrace: spans sent over OTLP as run {sent}"]
    assert read.runs(tmp_path / "collected.duckdb")["run_id"].to_list() == [sent]


def test_collected_engine_runs_say_whose_times_and_backend_they_are(tmp_path, capsys):
    """diff said a collected run's times were "none (no clock: cache-only or foreign run)"
    above the latency shifts it then printed, and `runs` named kvtrace's manager as its
    backend, which the collector cannot know. A collected replay now keeps its record's trace
    and config: its times were modelled by the cost model that config names, and its backend
    is the one the sender's record states."""
    import json

    from tests.cli.support import run

    db = tmp_path / "collected.duckdb"
    collector = OTLPCollector(db, port=0, grpc_port=None).start()
    try:
        spec = RunSpec("gen:chat", limit=8)
        sent = [run_replay(spec, otlp_endpoint=collector.url).otlp_run_id for _ in range(2)]
    finally:
        collector.stop()
    assert all(sent)
    code, out, err = run(["diff", *sent, "--db", str(db), "--markdown"], capsys)
    assert code == 0, err
    assert "Times: modelled by cost model `h200-kimi-hybrid`" in out and "no clock" not in out
    assert "median_ttft_ms" in out and "Trace: `gen:chat`" in out and "recorded time" not in out
    code, out, err = run(["runs", "--db", str(db), "--json"], capsys)
    assert code == 0, err
    assert [r["backend"] for r in json.loads(out)["runs"]] == ["kvtrace", "kvtrace"]


def test_the_commands_of_many_runs_send_nothing_whatever_the_variables_say(tmp_path, monkeypatch, capsys):
    """sweep, study and demo record into their store only: with OTEL_EXPORTER_OTLP_ENDPOINT
    set (for a vLLM's traces, say) their runs went to that collector too, a spans-not-delivered
    count dropped unsaid and exit 0 (replay's --otlp-endpoint, and the variables, are replay's)."""
    from tests.cli.support import run

    collector = OTLPCollector(tmp_path / "collected.duckdb", port=0, grpc_port=None).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url.removesuffix("/v1/traces"))
        code, _, err = run(["study", "shared-prefix-pinning", "--limit", "4", "--db", str(tmp_path / "s.duckdb")],
                           capsys)
        assert code in (0, 1), err  # (1: the expected effect did not show on so few requests)
        code, _, err = run(["sweep", "gen:chat", "--limit", "4", "--mode", "cache-only", "--param",
                            "capacity_blocks=20,40", "--workers", "1", "--db", str(tmp_path / "w.duckdb")], capsys)
        assert code == 0, err
        replayed = run_replay(RunSpec("gen:chat", limit=3, mode="cache-only"))  # (replay still sends)
    finally:
        collector.stop()
    assert read.runs(tmp_path / "s.duckdb").height == 2 and read.runs(tmp_path / "w.duckdb").height == 2
    assert read.runs(tmp_path / "collected.duckdb")["run_id"].to_list() == [replayed.otlp_run_id]


def test_a_replay_that_fails_sends_its_collector_a_failed_record(tmp_path):
    """A replay failing midway (here at a bad line past the requests checked before the run)
    marked its store's run failed with the error, while its collected copy had no record and
    read `incomplete`, the error unsaid."""
    import json

    import pytest

    from kvtrace.errors import TraceFormatError

    trace = tmp_path / "t.jsonl"
    good = [json.dumps({"timestamp": i, "input_length": 600, "output_length": 2, "hash_ids": [i, 50 + i]})
            for i in range(1_100)]
    trace.write_text("\n".join([*good, '{"timestamp": 1100, "input_length": -1}']) + "\n")
    collector = OTLPCollector(tmp_path / "collected.duckdb", port=0, grpc_port=None).start()
    try:
        with pytest.raises(TraceFormatError):
            # (engine mode reads its trace as it replays; cache-only reads it whole before a run is created)
            run_replay(RunSpec(str(trace), preset="dense-attention", content=False),
                       db=str(tmp_path / "local.duckdb"), otlp_endpoint=collector.url)
    finally:
        collector.stop()
    local = read.run(tmp_path / "local.duckdb", "r1")
    (sent,) = read.runs(tmp_path / "collected.duckdb")["run_id"].to_list()
    collected = read.run(tmp_path / "collected.duckdb", sent)
    assert local["status"] == collected["status"] == "failed"
    assert collected["summary"]["error"] == local["summary"]["error"]
    assert collected["summary"]["error"].startswith("TraceFormatError: ")


def test_a_collected_replay_was_created_when_its_stored_twin_was(tmp_path):
    """The record a replay's OTLP export sends at its end named no `created`: the collector
    gave the run the time it first saw its spans, minutes after the replay began (collect probe)."""
    collector = OTLPCollector(tmp_path / "collected.duckdb", port=0, grpc_port=None).start()
    try:
        res = run_replay(RunSpec("gen:chat", limit=6, mode="cache-only", capacity_blocks=30),
                         db=str(tmp_path / "local.duckdb"), otlp_endpoint=collector.url)
    finally:
        collector.stop()
    stored = read.run(tmp_path / "local.duckdb", res.run_id)["created"]
    assert res.record["created"] == stored
    assert read.run(tmp_path / "collected.duckdb", res.otlp_run_id)["created"] == stored
