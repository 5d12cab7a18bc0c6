"""A real Ray cluster (``ray start --head``, as the README's sweep section starts one): its
token and its death mid-sweep (sweep33).

- A cluster started with token authentication (Ray's default where a token exists) refuses
  a client without the token: ``--ray HOST:PORT`` retried for 20 s, printing Ray's
  warnings, and ended 'cannot connect', no word of the token.
- A cluster that died mid-sweep held the sweep 60 s, then Ray ended the process from a thread
  of its own: exit 1 with Ray's lines and no kvtrace error line.

The cluster is this module's own, in a temporary folder and HOME of its own, and is ended
by its processes' ids (``ray stop --force`` would end every Ray cluster on the machine).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvtrace.store import read

pytest.importorskip("ray")

BIN = Path(sys.executable).parent
SWEEP = ["sweep", "gen:mixed", "--param", "capacity_blocks=40,50,60,70,80,90,100,110", "--workers", "1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_under(folder: str) -> list[int]:
    """The processes whose command line, environment or open files name ``folder`` (the
    cluster's own: its GCS, raylet, workers, and the agents that retitle themselves over
    their command line and environment, whose logs are open there)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                named = Path(f"/proc/{entry}/cmdline").read_bytes() + Path(f"/proc/{entry}/environ").read_bytes()
                fds = os.listdir(f"/proc/{entry}/fd")
            except OSError:
                continue
            for fd in fds:
                with contextlib.suppress(OSError):
                    named += os.readlink(f"/proc/{entry}/fd/{fd}").encode()
            if folder.encode() in named:
                found.append(int(entry))
    return found


def _kill_cluster(folder: str, spare: int | None = None) -> None:
    """SIGKILL to the cluster's processes (``spare``: a driver, whose HOME is there too)."""
    for pid in set(_processes_under(folder)) - {spare}:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def cluster():
    """A one-node cluster with token authentication: (its GCS address, the env of a client
    with its HOME, where the token is), ended by its processes' ids."""
    root = tempfile.mkdtemp(prefix="kvr33", dir="/tmp")  # (short: Ray's socket paths have a limit)
    home = Path(root) / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    port = _free_port()
    start = subprocess.run([str(BIN / "ray"), "start", "--head", "--port", str(port), "--num-cpus", "2",
                            "--include-dashboard", "false", "--temp-dir", f"{root}/t", "--disable-usage-stats"],
                           env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120,
                           check=False)
    try:
        if start.returncode != 0:
            pytest.skip(f"ray start failed here: {start.stderr[-500:]}")
        yield f"127.0.0.1:{port}", env
    finally:
        _kill_cluster(root)
        shutil.rmtree(root, ignore_errors=True)


def _kvtrace(args, env, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "kvtrace"), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_a_cluster_that_wants_a_token_is_told_at_once_and_a_wrong_token_too(cluster, tmp_path):
    address, env = cluster
    db = tmp_path / "s.duckdb"
    args = [*SWEEP[:3], "capacity_blocks=40,50", "--limit", "5", "--ray", address, "--db", str(db)]
    began = time.monotonic()
    out = _kvtrace(args, env)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtrace: error: --ray {address}: the Ray cluster there takes "
                                                   "only clients with its authentication token"), out.stderr
    assert "RAY_AUTH_MODE=token" in lines[0]
    out = _kvtrace(args, {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused this process's authentication token" in lines[0], out.stderr
    assert time.monotonic() - began < 15  # (each was 20 s of Ray's retries)
    assert not db.exists()
    out = _kvtrace([*args, "--json"], {**env, "RAY_AUTH_MODE": "token"})  # (its own token: the sweep runs)
    assert out.returncode == 0, out.stderr
    assert read.runs(db).height == 2


def test_a_cluster_that_dies_mid_sweep_ends_it_in_one_kvtrace_line_keeping_the_runs_stored(cluster, tmp_path):
    address, env = cluster
    root = str(Path(env["HOME"]).parent)
    db = tmp_path / "s.duckdb"
    err_path = tmp_path / "err"
    with err_path.open("w") as err:
        proc = subprocess.Popen([str(BIN / "kvtrace"), *SWEEP, "--ray", address, "--db", str(db)],
                                env={**env, "RAY_AUTH_MODE": "token"}, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 90
        while "run r1 recorded" not in err_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, err_path.read_text()
        _kill_cluster(root, spare=proc.pid)  # the head dies: its GCS, its raylet, its workers
        died = time.monotonic()
        code = proc.wait(timeout=90)
        took = time.monotonic() - died
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err_path.read_text()
    assert code == 1, text
    last = text.strip().splitlines()[-1]
    assert last.startswith(f"kvtrace: error: --ray {address}: the Ray cluster stopped answering"), text
    assert "the runs stored before it are kept" in last
    assert took < 45, took  # (Ray's own end came at 60 s)
    runs = read.runs(db)
    assert runs.height >= 1 and set(runs["status"]) == {"complete"}
