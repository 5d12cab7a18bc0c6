"""``kvtrace sweep``: every combination an independent replay, wherever it runs."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest

from kvtrace.errors import ConfigError, KVTraceError, TraceFormatError
from kvtrace.replay import sweep
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.replay.sweep import combinations, parse_baseline, parse_param, run_sweep, sweep_table
from kvtrace.store import read
from kvtrace.store.read._sql import connect, query
from tests.cli.support import assert_one_line, run
from tests.conftest import MOONCAKE

BASE = RunSpec(str(MOONCAKE), mode="cache-only", limit=250)
PARAMS = [("capacity_blocks", [300, 900]), ("policy", ["lru", "belady"])]


@pytest.fixture(scope="module")
def alone():
    """Each combination replayed on its own, in this process: the reference digests."""
    return {(c["capacity_blocks"], c["policy"]): run_replay(replace(BASE, **c)).summary["digest"]
            for c in combinations(PARAMS)}


def _digests(result):
    return {(r.combo["capacity_blocks"], r.combo["policy"]): r.summary["digest"] for r in result.runs}


def _stored_spans(db, run_id):
    """A run's stored spans without what only says where it was stored."""
    with connect(db) as con:
        return query(con, "SELECT * EXCLUDE (run_id) FROM spans WHERE run_id = $r ORDER BY seq", {"r": run_id})


def test_local_workers_give_each_combination_its_own_digest_and_store_it(alone, tmp_path):
    db = tmp_path / "sweep.duckdb"
    result = run_sweep(BASE, PARAMS, db=db, workers=2)
    assert _digests(result) == alone
    assert len(set(alone.values())) == 4  # the settings matter, so equal digests mean something
    runs = read.runs(db)
    assert sorted(runs["run_id"].to_list()) == sorted(r.run_id for r in result.runs)
    assert set(runs["status"]) == {"complete"}
    for r in result.runs:
        stored = read.run(db, r.run_id)
        assert stored["digest"] == r.summary["digest"]
        assert stored["config"]["sweep"] == {"id": result.sweep_id, "params": r.combo}
    # the rows the one writer stored equal a run recorded directly by its own replay
    lru = next(r for r in result.runs if r.combo == {"capacity_blocks": 300, "policy": "lru"})
    direct = run_replay(replace(BASE, capacity_blocks=300, policy="lru"), db=tmp_path / "direct.duckdb")
    swept = _stored_spans(db, lru.run_id)
    assert swept.height > 0
    assert swept.equals(_stored_spans(tmp_path / "direct.duckdb", direct.run_id))


def test_a_sweep_on_a_local_ray_cluster_matches_the_sequential_one(alone, tmp_path):
    import ray  # the dev extra's; kvtrace itself needs it only for --ray

    lines = MOONCAKE.read_text().splitlines()[:3] + ['{"timestamp": 5, "input_length": "x"}']
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        result = run_sweep(BASE, PARAMS, db=tmp_path / "ray.duckdb", ray_address="auto")
        # a replay's own error in a task is that error, not Ray's remote traceback as its text
        with pytest.raises(TraceFormatError) as caught:
            run_sweep(replace(BASE, trace=str(bad)), [("capacity_blocks", [300, 900])], ray_address="auto")
        # the runs back before a failed one are stored, as on local workers (Ray's results
        # were taken all at once: its last replay failing, none was stored)
        with pytest.raises(KVTraceError, match="cannot be scheduled"):
            run_sweep(RunSpec("gen:chat", limit=3, content=False), [("capacity_blocks", [2000, 1000, 4])],
                      db=tmp_path / "midway.duckdb", ray_address="auto")
    finally:
        ray.shutdown()
    assert _digests(result) == alone
    assert read.runs(tmp_path / "ray.duckdb").height == 4
    assert str(caught.value).startswith(f"{bad}:4: ")
    midway = read.runs(tmp_path / "midway.duckdb")
    assert sorted(zip(midway["name"], midway["status"])) == [("sweep capacity_blocks=1000", "complete"),
                                                             ("sweep capacity_blocks=2000", "complete")]


def test_local_workers_are_at_most_one_a_cpu_and_one_a_replay(alone, monkeypatch):
    """--workers 10**20 forked one process a combination (up to 10,000): a traceback at the
    open-file limit, and slower than two on two cores."""
    import os

    from kvtrace.replay import sweep

    cpus = len(os.sched_getaffinity(0))
    assert sweep.local_workers(10**20, 4) == min(4, cpus) and sweep.local_workers(3, 1) == 1
    asked = []
    real = sweep.ProcessPoolExecutor

    def pool(*args, max_workers, **kwargs):
        asked.append(max_workers)
        return real(*args, max_workers=max_workers, **kwargs)

    monkeypatch.setattr(sweep, "ProcessPoolExecutor", pool)
    result = run_sweep(BASE, PARAMS, workers=10**20)
    assert asked == [min(4, cpus)] and _digests(result) == alone


def test_a_local_ray_cluster_leaves_the_commands_own_signal_handlers():
    """ray.init installs a SIGTERM handler that exits (and a C one that prints a crash
    dump): `kill` of `sweep --ray local` ended with Ray's dump and exit 1, not the run's
    stop path, its one line and 143."""
    import signal

    from kvtrace.process import sigterm_as_interrupt

    with sigterm_as_interrupt():
        before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        result = run_sweep(replace(BASE, limit=20), [("capacity_blocks", [300, 900])], ray_address="local")
        assert {sig: signal.getsignal(sig) for sig in before} == before
    assert len(result.runs) == 2


@pytest.mark.parametrize(("address", "needle"), [
    ("127.0.0.1:1", "cannot reach a Ray cluster there"),  # nothing listens: refused at once
    ("nohost.invalid:6379", "cannot reach a Ray cluster there"),  # (ray.init would retry for a minute)
    ("nohost:port", "expected HOST:PORT"),
    ("[::1:6379", "expected HOST:PORT"),  # (urlsplit raises on the unclosed bracket)
])
def test_an_unreachable_ray_address_is_one_error_before_ray_starts(tmp_path, address, needle):
    pytest.importorskip("ray")  # (the dev extra's: installed wherever the tests run)
    with pytest.raises(KVTraceError, match=needle) as err:
        run_sweep(BASE, PARAMS, db=tmp_path / "s.duckdb", ray_address=address)
    assert str(err.value).startswith(f"--ray {address}:")


def test_the_sweep_id_is_a_content_id(tmp_path):
    one = run_sweep(BASE, [("capacity_blocks", [300])], workers=1)
    two = run_sweep(BASE, [("capacity_blocks", [300])], workers=1)
    other = run_sweep(BASE, [("capacity_blocks", [301])], workers=1)
    # every base setting counts, not only the trace, mode, preset, seed and limit (a run
    # with another behaviour set or policy had the same id)
    policy = run_sweep(replace(BASE, policy="belady"), [("capacity_blocks", [300])], workers=1)
    renamed = run_sweep(replace(BASE, name="mine"), [("capacity_blocks", [300])], workers=1)
    # and the trace's content, not its path
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(MOONCAKE.read_bytes())
    moved = run_sweep(replace(BASE, trace=str(copy)), [("capacity_blocks", [300])], workers=1)
    assert one.sweep_id == two.sweep_id == renamed.sweep_id == moved.sweep_id
    assert len({one.sweep_id, other.sweep_id, policy.sweep_id}) == 3


def test_one_sweep_in_any_order_of_its_values_and_params_has_one_id():
    """The same combinations, listed in another order: the same runs (equal digests), but
    each order had its own sweep id."""
    small = replace(BASE, limit=20)
    ids, digests = set(), []
    for params in ([("capacity_blocks", [300, 900]), ("policy", ["lru", "belady"])],
                   [("capacity_blocks", [900, 300]), ("policy", ["belady", "lru"])],
                   [("policy", ["lru", "belady"]), ("capacity_blocks", [300, 900])]):
        res = run_sweep(small, params, workers=1)
        ids.add(res.sweep_id)
        digests.append({(r.combo["capacity_blocks"], r.combo["policy"]): r.summary["digest"] for r in res.runs})
    assert len(ids) == 1 and digests[0] == digests[1] == digests[2]
    assert run_sweep(small, [("capacity_blocks", [300])], workers=1).sweep_id not in ids  # (a subset: another)
    # how latencies are summarised is no setting of the runs (each --percentiles had its own id)
    for percentiles in ((50.0, 90.0, 99.0), (25.0, 75.0)):
        again = run_sweep(replace(small, percentiles=percentiles), [("capacity_blocks", [300, 900]),
                                                                    ("policy", ["lru", "belady"])], workers=1)
        assert again.sweep_id in ids


def test_one_sweep_however_its_switches_and_retention_are_spelt_has_one_id():
    """--without's order and repeats, and retention's spellings (none/None, 0/00), read as
    one setting: equal runs, but each spelling had its own sweep id."""
    engine = RunSpec(str(MOONCAKE), limit=2, content=False)
    pinning, cow = "shared-prefix-pinning", "external-hit-running-cow"
    ids = set()
    for without, retention in (((pinning, cow), ["none", "0"]), ((cow, pinning, cow), ["None", "00"])):
        res = run_sweep(replace(engine, without=without), [("retention", retention)], workers=1)
        ids.add(res.sweep_id)
    assert len(ids) == 1


def test_a_sweep_at_retention_none_is_not_the_sweep_at_the_presets_retention():
    """No --retention (kimi-hybrid's 0) and --retention none (dense) are other runs, but
    both read as null and shared one sweep id; a --preset naming the default is no other."""
    engine = RunSpec(str(MOONCAKE), limit=2, content=False)
    swept = [("capacity_blocks", [300])]
    default, dense = (run_sweep(replace(engine, retention=r), swept, workers=1) for r in (None, "none"))
    assert default.runs[0].summary["digest"] != dense.runs[0].summary["digest"]
    assert default.sweep_id != dense.sweep_id
    assert run_sweep(replace(engine, retention="None"), swept, workers=1).sweep_id == dense.sweep_id
    assert run_sweep(replace(engine, preset="kimi-hybrid"), swept, workers=1).sweep_id == default.sweep_id


def test_too_many_combinations_are_refused_before_any_is_built():
    values = list(range(1, 1001))
    with pytest.raises(ConfigError, match="1,000,000,000 combinations"):
        combinations([("capacity_blocks", values), ("block_size", values), ("capacity_tokens", values)])


def test_a_bad_combination_is_refused_before_anything_runs(tmp_path):
    db = tmp_path / "refused.duckdb"
    # cache-only mode refuses a retention, named at the --param value that made it (it named
    # --retention, a flag the user never typed)
    with pytest.raises(ConfigError, match=r"^--param: retention=none: applies to engine mode only"):
        run_sweep(BASE, [("retention", ["none", "0"])], db=db)
    assert not db.exists() or read.runs(db).height == 0


def test_a_trace_error_in_a_worker_is_the_one_line_it_is(tmp_path):
    # Found in a worker process, a TraceFormatError came back through pickle, which called
    # its __init__ with the message alone: a TypeError that broke the pool (a traceback).
    lines = MOONCAKE.read_text().splitlines()[:3] + ['{"timestamp": 5, "input_length": "x"}']
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError) as caught:
        run_sweep(replace(BASE, trace=str(bad)), [("capacity_blocks", [300, 900])], workers=2)
    assert caught.value.path == str(bad) and caught.value.line == 4
    assert str(caught.value).startswith(f"{bad}:4: ")


@pytest.mark.parametrize("text, expected", [
    ("capacity_blocks=1,2", ("capacity_blocks", [1, 2])),
    ("capacity_blocks=64,inf", ("capacity_blocks", [64, math.inf])),  # (refused; replay and curve take inf)
    # the unbounded cache spelt as --capacity-blocks and curve's --capacities spell it (only inf was taken)
    ("capacity_blocks=Infinity,unbounded", ("capacity_blocks", [math.inf, math.inf])),
    ("retention=none,0", ("retention", ["none", "0"])),
    ("without=none,shared-prefix-pinning+external-hit-running-cow",
     ("without", [(), ("external-hit-running-cow", "shared-prefix-pinning")])),
])
def test_parse_param(text, expected):
    assert parse_param(text) == expected


@pytest.mark.parametrize("text, match", [
    ("capacity_blocks", "NAME=V1,V2"), ("colour=red", "unknown parameter"), ("block_size=x", "integers"),
    ("capacity_blocks=1_0,20", "integers"), ("capacity_blocks=\u0661\u0660,20", "integers"),
    ("block_size=inf", "block_size values must be integers$"), ("capacity_tokens=16,inf", "integers")])
def test_parse_param_refuses(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_param(text)


@pytest.mark.parametrize(("text", "message"), [
    ("capacity_blocks=300,900,300", "capacity_blocks=300,900,300: 300 is given twice"),
    ("capacity_blocks=inf,unbounded", "capacity_blocks=inf,inf: inf is given twice"),
    ("retention=none,None", "retention=none,None: None is given twice (as none)"),
    ("retention=0,00", "retention=0,00: 00 is given twice (as 0)"),
    ("policy=lru,lru", "policy=lru,lru: lru is given twice"),
    ("without=none,none", "without=none,none: none is given twice"),
    ("without=shared-prefix-pinning+external-hit-running-cow,external-hit-running-cow+shared-prefix-pinning",
     "without=external-hit-running-cow+shared-prefix-pinning,external-hit-running-cow+shared-prefix-pinning: "
     "external-hit-running-cow+shared-prefix-pinning is given twice")])
def test_a_value_swept_twice_is_refused_before_anything_runs(text, message):
    """A value given twice, in any spelling, ran twice: two equal runs in the store, the
    second's deltas all zero."""
    with pytest.raises(ConfigError) as caught:
        combinations([parse_param(text)])
    assert str(caught.value) == f"--param: {message}"


@pytest.mark.parametrize(("text", "message"), [
    ("without=+", "without=+: an empty behaviour name"),
    ("without=none,shared-prefix-pinning+", "without=shared-prefix-pinning+: an empty behaviour name"),
    ("without=shared-prefix-pinning+pinning", "without=shared-prefix-pinning+pinning: unknown behaviour pinning;")])
def test_an_empty_or_unknown_switch_is_refused_at_its_value(text, message):
    """``without=+`` was read as the switch '': a cache-only sweep ran it as without=none
    (exit 0, a run labelled ``without=``), an engine one blamed a 'preset' no one gave."""
    with pytest.raises(ConfigError) as caught:
        parse_param(text)
    assert str(caught.value).startswith(f"--param: {message}")


@pytest.mark.parametrize("mode", ["cache-only", "engine"])
def test_a_sweep_of_an_empty_switch_is_one_line_at_param(mode, capsys):
    code, out, err = run(["sweep", str(MOONCAKE), "--mode", mode, "--limit", "5", "--param", "without=+"], capsys)
    assert_one_line(code, err, "--param: without=+: an empty behaviour name")
    assert out == ""


def test_a_switch_given_twice_in_one_value_is_one_switch():
    assert parse_param("without=shared-prefix-pinning+shared-prefix-pinning") == (
        "without", [("shared-prefix-pinning",)])


def test_the_unbounded_cache_is_stored_as_json_holds_it(tmp_path):
    """A swept inf went into the run's config as ``Infinity``: no JSON (a strict reader
    refuses it), and null in the run's own capacity_blocks beside it."""
    import json

    db = tmp_path / "s.duckdb"
    result = run_sweep(replace(BASE, limit=20), [("capacity_blocks", [300, math.inf])], db=db, workers=1)
    with connect(db) as con:
        configs = query(con, "SELECT run_id, CAST(config AS VARCHAR) AS config FROM runs ORDER BY run_id")

    def strict(token):
        raise AssertionError(f"{token} in a stored config")

    params = [json.loads(c, parse_constant=strict)["sweep"]["params"] for c in configs["config"]]
    assert params == [{"capacity_blocks": 300}, {"capacity_blocks": None}]
    assert [r["params"] for r in result.to_json()["runs"]] == params
    assert json.loads(configs["config"][1])["capacity_blocks"] is None  # (the run's own word for it)


def test_the_table_shows_deltas_against_the_named_baseline():
    result = run_sweep(BASE, PARAMS, workers=1)
    baseline = parse_baseline("capacity_blocks=900,policy=lru", PARAMS)
    rows = sweep_table(result, baseline)
    header, body = rows[0], rows[1:]
    assert header[:2] == ["capacity_blocks", "policy"] and "median_ttft_ms" not in header  # cache-only: no latency
    rate = header.index("prefix_cache_hit_rate")
    marked = [r for r in body if "(baseline)" in r[rate]]
    assert [r[:2] for r in marked] == [["900", "lru"]]
    small_lru = next(r for r in body if r[:2] == ["300", "lru"])
    assert "-" in small_lru[rate].split("(")[1]  # less capacity, lower hit rate than the baseline
    with pytest.raises(KVTraceError, match="not swept"):
        parse_baseline("block_size=16", PARAMS)
    assert pl.DataFrame(body, schema=header, orient="row").height == 4


def test_sigterm_stops_a_sweep_and_its_workers(tmp_path):
    """SIGTERM to `kvtrace sweep` (its workers are forked): the queued replays are cancelled
    and the running ones' workers end with it: exit 143 at once (what was started would take
    tens of seconds more), no process of its session left."""
    import signal
    import subprocess
    import sys
    import time

    capacities = ",".join(str(c) for c in range(3000, 11000, 1000))  # 8 whole-trace engine replays
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "sweep", str(MOONCAKE), "--param",
                             f"capacity_blocks={capacities}", "--db", str(tmp_path / "s.duckdb")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        time.sleep(4)  # (into the first replays; earlier, the same must hold)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)  # (left to run, the started and queued replays take far longer)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    # ("kept" once the store's file was made: a sweep stopped before its first stored result has none)
    kept = "; what was recorded is kept" if (tmp_path / "s.duckdb").exists() else ""
    assert err.strip().splitlines() == [f"kvtrace: error: terminated (SIGTERM){kept}"], err
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True, check=False).stdout.split()
    assert left == [], f"processes of the sweep still running: {left}"


def test_a_sweep_killed_9_takes_its_workers_with_it(tmp_path):
    """kill -9 leaves no handler to stop the workers: they die with their parent
    (PR_SET_PDEATHSIG), not blocked for good on the result pipe of a dead one."""
    import subprocess
    import sys
    import time

    capacities = ",".join(str(c) for c in range(3000, 11000, 1000))
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "sweep", str(MOONCAKE), "--param",
                             f"capacity_blocks={capacities}", "--db", str(tmp_path / "s.duckdb")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        workers: list[str] = []
        while len(workers) < 2 and time.monotonic() < deadline:  # (forked once the replays are queued)
            time.sleep(0.2)
            workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True,
                                     check=False).stdout.split()
        assert len(workers) >= 2, "the sweep never forked its workers"
        proc.kill()
        proc.wait(timeout=10)
        for _ in range(50):  # (the kernel delivers the parent-death signal at once; reaped by init)
            left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True,
                                  check=False).stdout.split()
            if not left:
                break
            time.sleep(0.1)
        assert left == [], f"workers of the killed sweep still running: {left}"
    finally:
        subprocess.run(["pkill", "-9", "-s", str(proc.pid)], check=False)


def _killed_at_300(spec: RunSpec, keep: bool):
    if spec.capacity_blocks == 300:  # as the OOM killer or a `kill -9` of the worker would
        os.kill(os.getpid(), 9)
    return _replay_one(spec, keep)


_replay_one = sweep._replay_one


def test_a_worker_killed_9_is_one_line_not_the_pools_traceback(tmp_path, monkeypatch, capsys):
    """One local worker killed (not the sweep): BrokenProcessPool's traceback, exit 1. It is
    one line, exit 1, no worker left, and the store as it was (the first combination's
    worker died: nothing before it to store)."""
    db = tmp_path / "s.duckdb"
    monkeypatch.setattr(sweep, "_replay_one", _killed_at_300)  # (the workers are forked: they see it)
    code, _, err = run(["sweep", str(MOONCAKE), "--mode", "cache-only", "--limit", "50", "--param",
                        "capacity_blocks=300,900", "--workers", "2", "--db", str(db)], capsys)
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: a worker process died"), err
    assert not db.exists() and not multiprocessing.active_children()


def _killed_at_300_once_two_are_stored(spec: RunSpec, keep: bool):
    if spec.capacity_blocks == 300:  # (waits for the parent to store two runs: no race with them)
        marker = Path(os.environ["KVTRACE_TEST_STORED"])
        for _ in range(600):
            if marker.exists() and marker.read_text() == "2":
                break
            time.sleep(0.1)
        os.kill(os.getpid(), 9)
    return _replay_one(spec, keep)


def test_a_worker_killed_midway_names_where_the_sweep_stopped(tmp_path, monkeypatch, capsys):
    """The one line said 'a worker process died' of a sweep of many: not which combination
    it stopped at, nor how many were stored before it; those are kept, the rest not run."""
    db, marker = tmp_path / "s.duckdb", tmp_path / "stored"
    monkeypatch.setenv("KVTRACE_TEST_STORED", str(marker))
    monkeypatch.setattr(sweep, "_replay_one", _killed_at_300_once_two_are_stored)
    record = sweep._record

    def counted(*args, **kwargs):
        run_id = record(*args, **kwargs)
        marker.write_text(run_id.removeprefix("r"))
        return run_id

    monkeypatch.setattr(sweep, "_record", counted)
    code, _, err = run(["sweep", str(MOONCAKE), "--mode", "cache-only", "--limit", "50", "--param",
                        "capacity_blocks=100,200,300,900", "--workers", "2", "--db", str(db)], capsys)
    assert code == 1, err
    lines = err.strip().splitlines()
    assert lines[-1] == ("kvtrace: error: a worker process died before its replay finished (killed, or out of "
                         "memory?); the sweep stopped at capacity_blocks=300, 2 of 4 combinations stored; the runs "
                         "stored before it are kept, the rest were not recorded"), err
    assert lines[:-1] == [f"kvtrace: run r{i} recorded in {db}" for i in (1, 2)]
    assert read.runs(db).sort("run_id")["name"].to_list() == ["sweep capacity_blocks=100", "sweep capacity_blocks=200"]


def test_a_ray_worker_death_names_the_combination_it_stopped_at():
    def died():
        yield "first"
        raise sweep.WorkerDied("--ray auto: a replay's worker died before it finished (WorkerCrashedError)")

    combos = [{"capacity_blocks": 10}, {"capacity_blocks": 20}, {"capacity_blocks": 30}]
    named = sweep._deaths_named(died(), combos, lambda: 1, True)
    assert next(named) == "first"
    with pytest.raises(sweep.WorkerDied) as caught:
        next(named)
    assert str(caught.value) == ("--ray auto: a replay's worker died before it finished (WorkerCrashedError); the "
                                 "sweep stopped at capacity_blocks=20, 1 of 3 combinations stored")


@pytest.mark.parametrize("crash", ["WorkerCrashedError", "OutOfMemoryError"])
def test_a_ray_worker_that_died_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys, crash):
    """A Ray task whose worker died (retries spent, the OOM killer) raised Ray's own error:
    a traceback, where a local worker's death is one line and exit 1."""
    ray = pytest.importorskip("ray")
    from types import SimpleNamespace

    error = getattr(ray.exceptions, crash)

    def died(ref):
        raise error() if crash == "WorkerCrashedError" else error("Task was killed: low memory.\nMemory: 99%")

    with pytest.raises(sweep.WorkerDied, match=rf"^--ray auto: a replay's worker died before it finished \({crash}"):
        sweep._ray_result(SimpleNamespace(get=died, exceptions=ray.exceptions), None, "auto")

    def sweep_died(*args, **kwargs):
        sweep._ray_result(SimpleNamespace(get=died, exceptions=ray.exceptions), None, "auto")

    monkeypatch.setattr(sweep, "run_sweep", sweep_died)
    code, _, err = run(["sweep", str(MOONCAKE), "--mode", "cache-only", "--param", "capacity_blocks=300,900",
                        "--ray", "auto", "--db", str(tmp_path / "s.duckdb")], capsys)
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"kvtrace: error: --ray auto: a replay's worker "
                                                                 f"died before it finished ({crash}"), err
    assert err.rstrip().endswith("the runs stored before it are kept, the rest were not recorded"), err


def test_a_ray_address_where_no_ray_listens_is_refused_in_seconds():
    pytest.importorskip("ray")  # (the dev extra's: installed wherever the tests run)
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))  # accepts and says nothing: no gRPC there
    port = listener.getsockname()[1]
    threading.Thread(target=lambda: [listener.accept() for _ in range(8)], daemon=True).start()
    try:
        with pytest.raises(KVTraceError, match=r"is no Ray cluster's GCS.*\(no gRPC within 5 s\)"):
            run_sweep(BASE, [("capacity_blocks", [300, 900])], ray_address=f"127.0.0.1:{port}")
    finally:
        listener.close()


def test_a_grpc_server_that_is_no_ray_gcs_is_refused_in_seconds():
    # any gRPC server passed the first probe (kvtrace collect's, say): ray.init then retried for minutes
    pytest.importorskip("ray")
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=1))  # no service: every call UNIMPLEMENTED
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(KVTraceError, match=r"is no Ray cluster's GCS.*\(it has no Ray GCS service\)"):
            run_sweep(BASE, [("capacity_blocks", [300, 900])], ray_address=f"127.0.0.1:{port}")
    finally:
        server.stop(None)


def test_ray_auto_with_no_cluster_says_what_to_do_in_kvtraces_words(monkeypatch):
    """Ray's text told the user to set an `--address` flag, which kvtrace has not."""
    ray = pytest.importorskip("ray")

    def no_cluster(**kwargs):  # (what ray.init says with no cluster here; a real one may run beside the tests)
        assert kwargs.get("address") == "auto"
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                              "setting `--address` flag or `RAY_ADDRESS` environment variable.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(KVTraceError) as caught:
        run_sweep(BASE, [("capacity_blocks", [300, 900])], ray_address="auto")
    assert str(caught.value) == ("--ray auto: no running Ray cluster found on this machine; start one with `ray start "
                                 "--head`, name one (--ray HOST:PORT, or RAY_ADDRESS), or say --ray local")


def test_an_empty_ray_address_is_refused_not_a_local_cluster():
    pytest.importorskip("ray")
    with pytest.raises(KVTraceError, match="expected HOST:PORT, ray://HOST:PORT, auto or local"):
        run_sweep(BASE, [("capacity_blocks", [300, 900])], ray_address="")


def test_a_store_that_is_no_duckdb_file_is_refused_before_the_replays(tmp_path, monkeypatch, capsys):
    import kvtrace.replay.sweep as sweep

    text = tmp_path / "notes.txt"
    text.write_text("my notes\n")

    def refuse(*args, **kwargs):
        raise AssertionError("a replay ran before --db was checked")

    monkeypatch.setattr(sweep, "_replay_one", refuse)
    code, _, err = run(["sweep", str(MOONCAKE), "--mode", "cache-only", "--limit", "20",
                            "--param", "capacity_blocks=300,900", "--db", str(text)], capsys)
    assert code == 2 and "not a DuckDB database" in err and text.read_text() == "my notes\n"


def test_a_setting_both_swept_and_set_for_the_sweep_is_refused():
    with pytest.raises(ConfigError, match=r"--param: capacity_blocks: is also set for the whole sweep \(100\)"):
        run_sweep(replace(BASE, capacity_blocks=100), [("capacity_blocks", [300, 900])], workers=1)
    with pytest.raises(ConfigError, match="--param: without: is also set"):
        run_sweep(replace(BASE, without=("shared-prefix-pinning",)), [("without", [(), ("external-hit-running-cow",)])],
                  workers=1)


def test_a_config_files_switches_are_not_swept_over(tmp_path):
    """A file's cache.without adds to every run's: `--param without=none,X` over a file
    switching X off gave two equal runs, the first labelled without=none."""
    toml = tmp_path / "run.toml"
    toml.write_text('[cache]\nwithout = ["shared-prefix-pinning"]\n')
    base = RunSpec(str(MOONCAKE), limit=3, content=False, config_file=str(toml))
    with pytest.raises(ConfigError, match=r"run\.toml: cache\.without: is also swept"):
        run_sweep(base, [("without", [(), ("shared-prefix-pinning",)])], workers=1)
    assert len(run_sweep(base, [("capacity_blocks", [300])], workers=1).runs) == 1  # (another setting swept)


@pytest.mark.parametrize(("text", "match"), [
    ("capacity_blocks=300,capacity_blocks=900", "capacity_blocks is given twice"),
    ("", "expected NAME=V"), (",", "expected NAME=V")])
def test_a_baseline_is_one_value_per_swept_setting(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_baseline(text, PARAMS)


def test_a_sweep_stopped_while_storing_a_run_marks_it_failed(tmp_path, monkeypatch):
    """The README says a stopped sweep marks the run it was storing failed; a bare close()
    left it incomplete."""
    from kvtrace.store.writer import Store

    real = Store.finish_run

    def stopped(self, run_id, status="complete", *args, **kwargs):
        if status == "complete":  # Ctrl-C as the first run is being stored
            raise KeyboardInterrupt
        return real(self, run_id, status, *args, **kwargs)

    monkeypatch.setattr(Store, "finish_run", stopped)
    db = tmp_path / "s.duckdb"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(BASE, [("capacity_blocks", [300, 900])], db=db, workers=1)
    monkeypatch.undo()
    assert read.runs(db)["status"].to_list() == ["failed"]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sweep_that_fails_midway_keeps_the_runs_it_finished(tmp_path, workers):
    """Results were stored only once every replay was back: a sweep stopped or failed at its
    last replay kept none of the others. They are stored in spec order as they come back."""
    db = tmp_path / "s.duckdb"
    base = RunSpec("gen:chat", limit=3, content=False)
    # (4 blocks hold no chat prompt; the line names the swept value, which it did not, only the
    # pool's size and a --capacity-blocks the user never typed)
    with pytest.raises(KVTraceError, match=r"^--param capacity_blocks=4: engine: .* cannot be scheduled"):
        run_sweep(base, [("capacity_blocks", [2000, 1000, 4])], db=db, workers=workers)
    runs = read.runs(db)
    assert runs["status"].to_list() == ["complete", "complete"]
    assert sorted(runs["name"].to_list()) == ["sweep capacity_blocks=1000", "sweep capacity_blocks=2000"]


def test_an_open_file_limit_that_refuses_the_pools_pipes_is_one_line(tmp_path):
    """``ulimit -n 8``: the worker pool's own pipes were refused before the guarded submit,
    an OSError traceback."""
    import resource
    import subprocess
    import sys

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (8, 8))

    r = subprocess.run([sys.executable, "-m", "kvtrace.cli", "sweep", "gen:chat", "--limit", "5", "--mode",
                        "cache-only", "--param", "capacity_blocks=5,10", "--workers", "2"],
                       capture_output=True, text=True, timeout=120, preexec_fn=low_limit, cwd=tmp_path, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "kvtrace: error: --workers 2: cannot start the worker processes (Too many open files); try fewer"]


def test_a_trace_changed_while_the_sweep_ran_is_refused_not_mixed_in(tmp_path, monkeypatch):
    """Each replay reads the trace itself: one rewritten midway gave runs of two traces
    under one sweep id, their deltas side by side, exit 0."""
    trace = tmp_path / "t.jsonl"
    lines = MOONCAKE.read_text().splitlines()
    trace.write_text("\n".join(lines[:60]) + "\n")
    done = []

    def rewritten_after_the_first(spec, keep):
        res = _replay_one(spec, keep)
        if not done:  # as an editor saving it, or a job regenerating it, would
            trace.write_text("\n".join(lines[60:120]) + "\n")
        done.append(spec.capacity_blocks)
        return res

    monkeypatch.setattr(sweep, "_replay_one", rewritten_after_the_first)
    db = tmp_path / "s.duckdb"
    with pytest.raises(TraceFormatError) as caught:
        run_sweep(replace(BASE, trace=str(trace), limit=None), [("capacity_blocks", [300, 900, 1200])], db=db,
                  workers=1)
    assert str(caught.value) == (f"{trace}: changed while the sweep ran: its replay read other content than the "
                                 "first; the sweep stopped at capacity_blocks=900, 1 of 3 combinations stored")
    runs = read.runs(db)
    assert runs["name"].to_list() == ["sweep capacity_blocks=300"] and runs["status"].to_list() == ["complete"]


def test_local_workers_hold_a_few_replays_ahead_of_the_one_being_stored(monkeypatch):
    """Every replay was queued at once: one slow replay at the head held every later result,
    span tables and all, in the parent's memory until it came back."""
    submitted = []
    real = sweep.ProcessPoolExecutor

    class Counting(real):
        def submit(self, fn, *args, **kwargs):
            submitted.append(args[0].capacity_blocks)
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(sweep, "ProcessPoolExecutor", Counting)
    capacities = list(range(300, 1500, 100))  # 12 replays
    queued_when_stored = []
    result = run_sweep(replace(BASE, limit=20), [("capacity_blocks", capacities)], workers=2,
                       on_done=lambda run: queued_when_stored.append(len(submitted)))
    processes = sweep.local_workers(2, len(capacities))
    ahead = sweep.IN_FLIGHT_PER_WORKER * processes
    assert submitted == capacities  # each once, in order
    assert queued_when_stored == [min(i + ahead, len(capacities)) for i in range(1, len(capacities) + 1)]
    assert [r.combo["capacity_blocks"] for r in result.runs] == capacities
