"""``kvtrace sweep`` / ``curve``: what a probe of their edges found (round 21)."""

from __future__ import annotations

import json
import threading

import pytest

from kvtrace.replay import sweep
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
