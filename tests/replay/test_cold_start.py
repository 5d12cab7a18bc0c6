"""Torch stays unloaded where it is not needed: trace readers, cache-only replay,
conversion, diff, the run list, export, the dashboard's pages and every user error.

Each case runs in a fresh interpreter (an import made by an earlier test would hide one)
and reports whether ``torch`` ended up in ``sys.modules``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"

PRELUDE = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from kvtrace.errors import KVTraceError
from kvtrace.replay.run import RunSpec, run_replay
TRACE = {str(MOONCAKE)!r}
"""

CASES = {
    "readers": """
        from kvtrace.replay.readers import open_trace
        assert len(list(open_trace(TRACE, limit=20))) == 20
    """,
    "cache-only replay, runs, diff, export": """
        db = sys.argv[1] + "/runs.duckdb"
        a = run_replay(RunSpec(TRACE, mode="cache-only", capacity_blocks=500, limit=60), db=db).run_id
        b = run_replay(RunSpec(TRACE, mode="cache-only", capacity_blocks=900, limit=60), db=db).run_id
        from kvtrace.store import export_parquet, read
        assert read.runs(db).height == 2
        from kvtrace.compare.source import diff_runs
        diff_runs(db, a, b, resamples=100)
        export_parquet(db, a, sys.argv[1] + "/export")
    """,
    "convert": """
        from kvtrace.replay.readers import open_trace
        from kvtrace.workload.native import write_native
        assert write_native(open_trace(TRACE, limit=10), sys.argv[1] + "/native.jsonl") == 10
    """,
    "dashboard pages": """
        import kvtrace.dashboard.app, kvtrace.dashboard.queries  # noqa: F401
        from kvtrace.dashboard import views  # noqa: F401
    """,
    "user errors": """
        for spec in (RunSpec("missing.jsonl"), RunSpec(TRACE, capacity_blocks=1 << 24, block_size=1 << 20),
                     RunSpec(TRACE, mode="cache-only", policy="fifo"), RunSpec(TRACE, limit=-1)):
            try:
                run_replay(spec)
            except KVTraceError:
                pass
            else:
                raise AssertionError(f"{spec} was accepted")
    """,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_is_not_imported(name, tmp_path):
    code = PRELUDE + textwrap.dedent(CASES[name]) + "\nprint('torch' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False", f"{name} imported torch"


# A mistyped command line is refused before anything heavy loads (issue 16: < 0.5 s): the
# choices come from kvtrace.names, a store to read is checked while parsing.
HEAVY = ("torch", "numpy", "duckdb", "polars", "pyarrow", "pydantic", "vllm")
CLI_ERRORS = {
    "a missing trace": ["replay", "missing.jsonl"],
    "a malformed trace": ["replay", "bad.jsonl", "--mode", "cache-only"],
    "an unknown preset": ["replay", "gen:mixed", "--preset", "nope"],
    "a malformed --config": ["replay", "gen:mixed", "--config", "bad.toml"],
    "runs on a missing store": ["runs", "--db", "missing.duckdb"],
    "diff on a missing store": ["diff", "a", "b", "--db", "missing.duckdb"],
    "export from a missing store": ["export", "--db", "missing.duckdb", "--run", "a", "--parquet", "out"],
    # a store to write, checked while parsing too
    "replay into a missing folder": ["replay", "gen:mixed", "--db", "nowhere/runs.duckdb"],
    "replay into a directory": ["replay", "gen:mixed", "--db", "."],
    "replay into a URL-like store": ["replay", "gen:mixed", "--db", "md:runs"],
    "sweep into a missing folder": ["sweep", "gen:mixed", "--param", "capacity_blocks=8,16",
                                    "--db", "nowhere/r.duckdb"],
    # the receivers' options, before the receivers load
    "collect on a port out of range": ["collect", "--db", "runs.duckdb", "--port", "70000"],
    "collect into a missing folder": ["collect", "--db", "nowhere/runs.duckdb"],
    "collect with one port for both": ["collect", "--db", "runs.duckdb", "--port", "4318", "--grpc-port", "4318"],
    "replay through a link into a missing folder": ["replay", "gen:mixed", "--db", "dangling.duckdb"],
    "capture from a malformed endpoint": ["capture", "vllm", "--db", "runs.duckdb", "--endpoint", "bogus"],
    "capture for a --dp-size of 0": ["capture", "vllm", "--db", "runs.duckdb", "--endpoint", "tcp://h:5557",
                                     "--dp-size", "0"],
    # and the others that load a replay engine, a server or the comparison
    "demo into a directory": ["demo", "--db", "."],
    "dashboard on port 70000": ["dashboard", "--db", "bad.toml", "--port", "70000"],
    "study with an unknown sweep": ["study", "shared-prefix-pinning", "--sweep", "bogus=1,2"],
    "study with a negative limit": ["study", "shared-prefix-pinning", "--limit", "-1"],
    # what vLLM cannot express, before vLLM's 20 s of imports
    "conformance with a hash vLLM lacks": ["conformance", "gen:mixed", "--limit", "3", "--config", "xxhash.toml"],
    "a vLLM-backend replay with a hash vLLM lacks": ["replay", "gen:mixed", "--limit", "3", "--backend", "vllm",
                                                     "--config", "xxhash.toml"],
}
# numpy (a tenth of a second) for a study of its built-in workload (defined in the generator),
# a generated workload, an engine preset
ALLOWED = {"study with a negative limit": ("numpy",), "conformance with a hash vLLM lacks": ("numpy",),
           "a vLLM-backend replay with a hash vLLM lacks": ("numpy",)}  # (an engine preset's arrays)


@pytest.mark.parametrize("name", sorted(CLI_ERRORS))
def test_a_cli_user_error_loads_nothing_heavy(name, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "input_length": "x"}\n')
    (tmp_path / "bad.toml").write_text("[cache\n")
    (tmp_path / "xxhash.toml").write_text('[cache]\nhash_fn = "xxhash"\n')
    (tmp_path / "dangling.duckdb").symlink_to(tmp_path / "nowhere" / "x.duckdb")
    code = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nsys.argv = ['kvtrace', *{CLI_ERRORS[name]!r}]\n"
            "from kvtrace.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            f"print(code, sorted(m for m in {HEAVY!r} if m in sys.modules and m not in {ALLOWED.get(name, ())!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          cwd=tmp_path, timeout=120)
    assert proc.stderr.startswith("kvtrace: error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stdout.strip() == "2 []", proc.stdout
