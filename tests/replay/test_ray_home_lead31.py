"""A local Ray cluster that cannot write its files under HOME is one line naming the path,
exit 2: Ray writes its auth token under ~/.ray as it starts, and HOME=/dev/null (or a
read-only home) was a NotADirectoryError traceback from inside ray.init."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_home_ray_cannot_write_in_is_one_line(tmp_path) -> None:
    env = {**os.environ, "HOME": "/dev/null"}
    cmd = [sys.executable, "-m", "kvtrace.cli", "sweep", "gen:chat", "--limit", "2", "--mode", "cache-only",
           "--param", "capacity_blocks=16,32", "--ray", "local"]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines[-1].startswith("kvtrace: error: --ray local: Ray cannot write /dev/null/.ray"), lines[-3:]
    assert "Traceback" not in done.stderr
