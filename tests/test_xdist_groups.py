"""``make test`` runs ``pytest -n 2 --dist loadgroup``: the tests of one ``xdist_group`` must
reach one worker, or each worker builds the group's fixtures again (tests/conftest.py groups
the ClickHouse replays, the cache's source-module run and every module that builds a fixture
once a module). pytest 9.2 names nodes by an id pytest-xdist 3.8 does not change, and every
group was silently split: held here, with the installed pytest and pytest-xdist."""

from __future__ import annotations

import subprocess
import sys

GROUPED = '''
import os
import pytest

@pytest.fixture(scope="module")
def built():
    return os.environ["PYTEST_XDIST_WORKER"]

@pytest.mark.parametrize("i", range(6))
def test_grouped(built, i):
    assert os.environ["PYTEST_XDIST_WORKER"] == built  # (one module fixture, one worker)
'''


def test_the_tests_of_one_xdist_group_run_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.hookimpl(tryfirst=True)\ndef pytest_collection_modifyitems(items):\n"
        "    for item in items:\n        item.add_marker(pytest.mark.xdist_group('one'))\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", "-v", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = {line.split()[0] for line in proc.stdout.splitlines() if " PASSED " in line}
    assert len(workers) == 1, proc.stdout[-3000:]
    assert "@one" in proc.stdout  # (the node ids xdist scheduled by)
