"""``sweep --ray ADDRESS --workers N``: the most replays in flight on the cluster at once.
--workers beside --ray was ignored without a word (every replay submitted at once, on a
cluster others share)."""

from __future__ import annotations

import pytest

from kvtrace.errors import ConfigError
from kvtrace.replay import sweep
from kvtrace.replay.run import RunSpec, run_replay
from kvtrace.replay.sweep import run_sweep
from tests.conftest import MOONCAKE

BASE = RunSpec(str(MOONCAKE), mode="cache-only", limit=60)
CAPACITIES = [100, 200, 300, 400]


def test_workers_beside_ray_bound_the_tasks_in_flight(monkeypatch):
    ray = pytest.importorskip("ray")  # (the dev extra's: installed wherever the tests run)
    alone = [run_replay(RunSpec(BASE.trace, mode="cache-only", limit=60, capacity_blocks=c)).summary["digest"]
             for c in CAPACITIES]
    submitted, in_flight = [0], []
    real_remote, real_get = ray.remote, ray.get

    def remote(fn):  # the real remote function, its submissions counted
        task = real_remote(fn)

        class Counted:
            @staticmethod
            def remote(*args):
                submitted[0] += 1
                return task.remote(*args)
        return Counted

    def get(ref, *args, **kwargs):
        before = submitted[0] - len(in_flight)  # submitted, less those taken back before
        got = real_get(ref, *args, **kwargs)  # (a poll that timed out, a replay past 1 s under load, took none)
        in_flight.append(before)
        return got

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        monkeypatch.setattr(ray, "remote", remote)  # (after init: Ray's own set-up calls remote too)
        monkeypatch.setattr(ray, "get", get)
        seen = {}
        for workers in (1, 3, None):
            submitted[0], in_flight[:] = 0, []
            result = run_sweep(BASE, [("capacity_blocks", CAPACITIES)], workers=workers, ray_address="auto")
            assert [r.summary["digest"] for r in result.runs] == alone
            seen[workers] = list(in_flight)
    finally:
        monkeypatch.undo()
        ray.shutdown()
    assert seen[1] == [1, 1, 1, 1]
    assert seen[3] == [3, 3, 2, 1]
    assert seen[None] == [4, 3, 2, 1]  # (not given: every replay at once, as before)


@pytest.mark.parametrize("workers", [0, -1, True])
def test_workers_is_checked_with_ray_too(workers):
    with pytest.raises(ConfigError, match=r"--workers: .*: expected a number of replays in flight on the cluster"):
        run_sweep(BASE, [("capacity_blocks", CAPACITIES)], workers=workers, ray_address="auto")
    with pytest.raises(ConfigError, match=r"--workers: .*: expected a number of processes >= 1"):
        run_sweep(BASE, [("capacity_blocks", CAPACITIES)], workers=workers)
    assert sweep.DEFAULT_WORKERS == 2
