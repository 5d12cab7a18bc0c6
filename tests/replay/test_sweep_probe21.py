"""``kvtrace sweep`` / ``curve``: what a probe of their edges found (round 21)."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from kvtrace.replay import sweep
from kvtrace.replay.sweep import _replay_one as _real_replay_one
from tests.cli.support import run
from tests.conftest import MOONCAKE

DIED = "A worker died or was killed while executing a task by an unexpected system error."


def test_what_ray_tells_the_driver_does_not_break_the_json_on_stdout(monkeypatch, capsys):
    """A Ray worker killed mid-sweep (its task retried, the sweep whole) made the driver's
    error thread print the raylet's line on stdout: `sweep --ray ... --json` wrote it before
    the document, which no longer parsed."""
    ray = pytest.importorskip("ray")
    from ray._private import worker as ray_worker

    def told(ref):  # as Ray's listen_error_messages thread tells of a worker that died
        said = threading.Thread(target=ray_worker.print_to_stdstream, args=(
            {"lines": [f"{DIED} Worker ID: {id(ref)}"], "pid": "raylet", "is_err": False},), kwargs={
            "ignore_prefix": False})
        said.start()
        said.join()
        return ref

    class Task:  # each replay in this process, its result the "ref" ray.get gives back
        @staticmethod
        def remote(spec, keep):
            return sweep._replay_one(spec, keep)

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # (a cluster already joined: no ray.init)
    monkeypatch.setattr(ray, "remote", lambda fn: Task)
    monkeypatch.setattr(ray, "get", told)
    code, out, err = run(["sweep", str(MOONCAKE), "--mode", "cache-only", "--limit", "20", "--param",
                          "capacity_blocks=300,900", "--ray", "auto", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)  # the one document, nothing before or after it
    assert [r["params"] for r in doc["runs"]] == [{"capacity_blocks": 300}, {"capacity_blocks": 900}]
    assert DIED in err  # (Ray's word kept, where a user reads such lines)


_HALF_WRITTEN = r'''
import multiprocessing, os, struct, sys, time
from dataclasses import replace
from kvtrace.replay import sweep
from kvtrace.replay.sweep import _replay_one as _real_replay_one
from kvtrace.replay.run import RunSpec

pools = []
real = sweep.ProcessPoolExecutor

def pool(*args, **kwargs):
    pools.append(real(*args, **kwargs))
    return pools[-1]

written = multiprocessing.get_context("fork").Event()

def half_a_result(spec, keep):  # as a worker stopped while it sent its span tables back
    fd = pools[0]._result_queue._writer.fileno()
    os.write(fd, struct.pack("!i", 1 << 20) + b"x" * 1000)  # a 1 MiB message's header, 1,000 bytes of it
    written.set()
    time.sleep(600)

sweep.ProcessPoolExecutor = pool
sweep._replay_one = half_a_result
specs = [replace(RunSpec(sys.argv[1]), capacity_blocks=c) for c in (300, 900)]
try:
    with sweep._results_in_order(specs, True, 2, None):
        assert written.wait(60)
        raise KeyboardInterrupt  # Ctrl-C while the pool's thread reads that result
except KeyboardInterrupt:
    print("stopped")
'''


def _script(script: Path, source: str, hung: str):
    """Run ``source`` as a script on the Mooncake trace from the repository root; a test
    failure saying ``hung`` when it does not end within a minute."""
    import subprocess
    import sys

    script.write_text(source)
    try:
        return subprocess.run([sys.executable, str(script), str(MOONCAKE)], capture_output=True, text=True,
                              timeout=60, check=False, cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        pytest.fail(hung)


def test_a_stop_while_a_worker_sends_its_result_back_ends_the_sweep(tmp_path):
    """Ctrl-C (SIGTERM, a failed replay) while a worker wrote its result: the workers were
    ended, and the pool's thread read the rest of that result for good, shutdown() waiting on
    it: the sweep hung, its workers zombies, until kill -9."""
    done = _script(tmp_path / "half_written.py", _HALF_WRITTEN, "the sweep's stop hung on the half-written result")
    assert (done.returncode, done.stdout) == (0, "stopped\n"), done.stderr


def _killed_at_4000(spec, keep):
    if spec.capacity_blocks == 4000:
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_replay_one(spec, keep)


def test_a_curves_worker_death_is_told_in_the_curves_words(tmp_path, monkeypatch, capsys):
    """`kvtrace curve` (engine mode: a sweep of its capacities) whose worker died said 'the
    sweep stopped at capacity_blocks=..., 1 of 2 combinations stored' (a sweep and combinations
    it was never told of) and that the runs before it were kept, not that the curve was not."""
    monkeypatch.setattr(sweep, "_replay_one", _killed_at_4000)
    db = tmp_path / "c.duckdb"
    code, _, err = run(["curve", str(MOONCAKE), "--mode", "engine", "--limit", "20", "--capacities", "2000,4000",
                        "--workers", "2", "--db", str(db)], capsys)
    assert code == 1, err
    (line,) = err.strip().splitlines()[-1:]
    assert line.startswith("kvtrace: error: a worker process died before its replay finished (killed, or out of "
                           "memory?); the curve stopped at --capacities "), err
    assert line.endswith(" of 2 capacities stored; the runs stored before it are kept, the rest were not recorded, "
                         "nor the curve"), err
    # without a store nothing was stored, and the line does not say it was kept
    code, _, err = run(["sweep", str(MOONCAKE), "--limit", "20", "--param", "capacity_blocks=2000,4000",
                        "--workers", "2"], capsys)
    assert code == 1, err
    assert err.rstrip().endswith(" of 2 combinations done"), err
    assert "stored" not in err, err


@pytest.mark.parametrize(("flag", "value"), [("--repeat", "0"), ("--workers", "0"), ("--workers", "-1"),
                                             ("--repeat", "x")])
def test_the_sweep_curve_bench_refuses_a_count_below_one_in_one_line(flag, value, capsys):
    """bench/sweep_curve.py --repeat 0 ran the sweeps none times and ended in a StatisticsError
    traceback; --workers 0 in run_sweep's ConfigError traceback, after its sequential sweep."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "sweep_curve.py"
    spec = importlib.util.spec_from_file_location("bench_sweep_curve", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as stopped:
        bench.main([flag, value])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and "Traceback" not in err, err


_DIED_SENDING = r'''
import os, signal, struct, sys
from kvtrace.replay import sweep
from kvtrace.replay.run import RunSpec

pools = []
real, replay_one = sweep.ProcessPoolExecutor, sweep._replay_one

def pool(*args, **kwargs):
    pools.append(real(*args, **kwargs))
    return pools[-1]

def died_sending(spec, keep):  # as a worker killed (the OOM killer) while it sent its span tables back
    if spec.capacity_blocks == 300:
        os.write(pools[0]._result_queue._writer.fileno(), struct.pack("!i", 1 << 20) + b"x" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)
    return replay_one(spec, keep)

sweep.ProcessPoolExecutor, sweep._replay_one = pool, died_sending
try:
    sweep.run_sweep(RunSpec(sys.argv[1], mode="cache-only", limit=20), [("capacity_blocks", [300, 900, 1000])],
                    workers=2)
except sweep.WorkerDied as err:
    print(err)
'''


def test_a_worker_killed_while_it_sends_its_result_back_ends_the_sweep(tmp_path):
    """The pool's thread read the rest of the dead worker's result for good: it never saw
    the death, no future failed, and the sweep waited forever instead of its one line."""
    done = _script(tmp_path / "died_sending.py", _DIED_SENDING,
                   "the sweep waited for good on a worker that died while it sent its result")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("a worker process died before its replay finished"), done.stdout + done.stderr
    assert "the sweep stopped at capacity_blocks=300, 0 of 3 combinations done" in done.stdout, done.stdout
