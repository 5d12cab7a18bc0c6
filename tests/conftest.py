"""Fixtures shared across packages.

``source_modules`` (a marker): a test that patches or copies the cache's classes needs the
cache's Python sources, as a compiled (mypyc) class can be neither patched nor copied.
Under a compiled install such tests run together in one subprocess with
``KVTRACE_PURE_PYTHON=1``, and each passes or fails with its own result there.

``replayed_store``: a small REAL replay (generated workload, kimi-hybrid engine, spans
through the instrumentor into a DuckDB file) holding two runs of the same trace: all
behaviours on (run_on) and shared-prefix-pinning off (run_off). Session-scoped: it is
built once and read by the dashboard, diff and notebook tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvtrace import compiled

# Timings are never pass/fail: hypothesis's deadline (200 ms an example) and its too-slow
# health check failed property tests on a loaded box (a fresh clone's run beside others).
settings.register_profile("kvtrace", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvtrace")

# vLLM resolves its platform once per process, at the first import that asks for it (a test
# module importing vLLM's KV-event publisher at collection did, before any test loaded vLLM
# through kvtrace): without this, no device, and vLLM's own Scheduler cannot be configured.
# kvtrace's load_vllm sets the same before its imports.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# Public traces shipped in the repository (provenance and licences: tests/data/README.md).
TRACES = Path(__file__).resolve().parent / "data"
MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"

REPLAYED_TRACE = "gen:study-shared-prefix-pinning"
REPLAYED_LIMIT = 60  # requests over three system prompts; pinning off loses their reuse
REPLAYED_OFF = "shared-prefix-pinning"


def _source_module_results(session, tmp: Path) -> dict[str, str | None]:
    """Run every ``source_modules`` test of the session in one subprocess on the sources;
    nodeid -> None (passed) or its failure text."""
    items = [i for i in session.items if i.get_closest_marker("source_modules")]
    report = tmp / "source-modules.xml"
    env = {**os.environ, compiled.ENV: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
         *[_plain_nodeid(i.nodeid) for i in items]],
        cwd=session.config.rootpath, env=env, capture_output=True, text=True, timeout=1200, check=False)
    results: dict[str, str | None] = {}
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            results[name] = None if bad is None and case.find("skipped") is None else (
                (bad.text or bad.get("message", "")) if bad is not None else "skipped")
    missing = f"no result on the sources (exit {proc.returncode}):\n" + (proc.stdout + proc.stderr)[-4000:]
    by_node = {}
    for i in items:
        path, _, name = _plain_nodeid(i.nodeid).partition("::")  # junit names a case "<dotted module>::<test[params]>"
        by_node[i.nodeid] = results.get(f"{path.removesuffix('.py').replace('/', '.')}::{name}", missing)
    return by_node


SOURCE_GROUP = "source_modules"
# Session fixtures that replay into ClickHouse stores (15-30 s each): their tests go to one
# worker, which builds them once (each worker built its own).
SHARED_BUILDS = {"ch_stores": "clickhouse_replays", "story_stores": "clickhouse_replays"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Under ``pytest -n N --dist loadgroup`` (``make test``) the ``source_modules`` tests go to
    one worker, which runs them in its one subprocess (before xdist names the group), the
    tests of a ``SHARED_BUILDS`` fixture to one worker, and so do those of a module that builds
    a fixture once a module (or class): each worker given some of them built it again (a
    module's replays, a chdb store, a Streamlit server and a browser; 6 s and more each)."""
    for item in items:
        if item.get_closest_marker("source_modules") is not None:
            item.add_marker(pytest.mark.xdist_group(SOURCE_GROUP))
            continue
        group = next((SHARED_BUILDS[f] for f in getattr(item, "fixturenames", ()) if f in SHARED_BUILDS), None)
        if group is None and _builds_per_module(item):
            group = f"module:{item.nodeid.partition('::')[0]}"
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def _builds_per_module(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(
        defs and defs[-1].scope in ("module", "class") for defs in info.name2fixturedefs.values())


def _plain_nodeid(nodeid: str) -> str:
    """A node id without xdist's ``@group`` suffix (a subprocess pytest does not know it)."""
    return nodeid.removesuffix(f"@{SOURCE_GROUP}")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("source_modules") is None or not compiled.is_compiled():
        return None  # the ordinary call
    config = pyfuncitem.config
    results = getattr(config, "_kvtrace_source_results", None)
    if results is None:
        with tempfile.TemporaryDirectory() as tmp:
            results = config._kvtrace_source_results = _source_module_results(pyfuncitem.session, Path(tmp))
    failure = results[pyfuncitem.nodeid]
    if failure is not None:
        pytest.fail(f"on the cache's Python sources ({compiled.ENV}=1):\n{failure}", pytrace=False)
    return True


@dataclass(frozen=True)
class ReplayedStore:
    path: str
    run_on: str
    run_off: str
    summary_on: dict
    summary_off: dict


@pytest.fixture(scope="session")
def replayed_store(tmp_path_factory) -> ReplayedStore:
    from kvtrace.replay.run import RunSpec, run_replay

    db = tmp_path_factory.mktemp("replayed") / "runs.duckdb"
    on = run_replay(RunSpec(REPLAYED_TRACE, limit=REPLAYED_LIMIT, name="pinning on"), db=db)
    off = run_replay(
        RunSpec(REPLAYED_TRACE, limit=REPLAYED_LIMIT, without=(REPLAYED_OFF,), name=f"pinning without {REPLAYED_OFF}"),
        db=db,
    )
    assert on.run_id is not None and off.run_id is not None  # (a replay with a store always names its run)
    return ReplayedStore(str(db), on.run_id, off.run_id, on.summary, off.summary)


@pytest.fixture(scope="session")
def vllm_api():
    """vLLM 0.33's scheduler-side API, imported once for the whole session (10-25 s).

    The suite requires vLLM (``make test`` installs it with ``make vllm``): a missing or
    wrong install fails here with the one-line reason instead of skipping."""
    from kvtrace.engine.backends.vllm import load_vllm

    return load_vllm()
