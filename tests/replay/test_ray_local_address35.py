"""``--ray local`` starts a cluster of its own whatever RAY_ADDRESS says (probe 35): ray.init
was given no address, so it followed RAY_ADDRESS, and one nothing answered on held the sweep
for good (Ray's GCS client retrying, its warnings every few seconds), deaf to Ctrl-C and
SIGTERM: only SIGKILL ended it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_local_ignores_a_dead_ray_address(tmp_path) -> None:
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
    cmd = [sys.executable, "-m", "kvtrace.cli", "sweep", "gen:chat", "--limit", "2", "--mode", "cache-only",
           "--param", "capacity_blocks=16,32", "--ray", "local", "--json"]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"capacity_blocks": 16' in done.stdout and '"capacity_blocks": 32' in done.stdout, done.stdout[-2000:]
    assert "Failed to connect to GCS" not in done.stderr
