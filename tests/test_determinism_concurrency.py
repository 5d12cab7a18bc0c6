"""Determinism and concurrency promises checked end to end.

Determinism: equal inputs give equal digests whatever the process environment
(``PYTHONHASHSEED`` included) and whichever cache manager the engine drives.
Concurrency: commands opening one store at once wait for each other (chdb: one process
at a time) instead of failing.
"""

from __future__ import annotations

import subprocess
import sys

from kvtrace.replay.run import RunSpec, run_replay


def test_the_vllm_backends_digest_does_not_follow_pythonhashseed(vllm_api, monkeypatch):
    """vLLM 0.33 seeds its root block hash (NONE_HASH) with PYTHONHASHSEED when that is set,
    so every block hash, span and the digest of a ``--backend vllm`` replay changed with the
    shell's PYTHONHASHSEED (0, 1, 'random' each gave another digest)."""
    from vllm.v1.core import kv_cache_utils

    spec = RunSpec("gen:chat", limit=8, backend="vllm")
    digests, roots = {}, {}
    for seed in (None, "0", "1", "random"):
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        digests[seed] = run_replay(spec).summary["digest"]
        roots[seed] = kv_cache_utils.NONE_HASH
    assert len(set(digests.values())) == 1, digests
    assert len(set(roots.values())) == 1


# chdb, told another process holds the directory, writes its Code 76 line to stderr and
# fails; the holder may be gone when the opener looks at the lock (a command finishing).
_HELD_THEN_GONE = """
import os, sys
from chdb import session as chs
from kvtrace.store.backend import clickhouse_target
from kvtrace.store.clickhouse import client

real, calls = chs.Session, []

def session(path):
    calls.append(path)
    if len(calls) == 1:  # held at this moment; let go before the opener checks the lock
        os.write(2, b"Code: 76. DB::Exception: Cannot lock file " + path.encode() + b"/status. Another server "
                    b"instance in same directory is already running. (CANNOT_OPEN_FILE)\\n")
        raise RuntimeError("Failed to create connection: Code: 36. DB::Exception: Error initializing "
                           "EmbeddedServer: . (BAD_ARGUMENTS)")
    return real(path)

chs.Session = session
with client.connect(clickhouse_target("chdb:" + sys.argv[1]), timeout_s=20) as con:
    print(con.ch_frame("SELECT 1 AS one")["one"].to_list(), len(calls))
"""


def test_a_chdb_directory_held_when_tried_and_free_when_checked_is_waited_for(tmp_path):
    """Commands opening one chdb store at once: an opener whose start chdb refused because
    another process held the directory, which let go before the opener looked at its lock,
    ended 'cannot open as a chdb store: Code: 76 ... Another server instance in same
    directory is already running' (exit 2) instead of retrying (a sweep, curve or replay of
    five started together on a new store, about one round in three)."""
    store = tmp_path / "held"
    proc = subprocess.run([sys.executable, "-c", _HELD_THEN_GONE, str(store)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[1]", "2"]
    assert "Code: 76" not in proc.stderr  # a waiting opener's retries print nothing of chdb's
