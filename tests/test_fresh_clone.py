"""The repository tests itself: nothing it runs needs a file outside it.

A fresh clone has no reference folder beside it (the design notes and traces the
project started from). The repository's tracked files are copied into a temporary folder
that has no such sibling, and a smoke subset of the suite (the tests that read the
shipped traces in tests/data) runs there, against the copied package, with no test
skipped. The tracked files must not name the reference material either.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a fresh clone lacks: the reference material beside the checkout. The names are put
# together here, so that this file, which reads none of it, names it no more than any other
# tracked file does (and needs no exemption from its own check).
_SIBLING = "shared"
OUTSIDE = (f"../{_SIBLING}", f"/work/{_SIBLING}", f"{_SIBLING}/seeds", f"{_SIBLING}/design",
           "CACHE_" + "SEMANTICS.md")
SMOKE = ("tests/replay/test_readers.py", "tests/replay/test_cache_only.py", "tests/test_numeric.py")


def tracked_files() -> list[str]:
    """The files a clone gets: git's index (this checkout is a git work tree)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    return [p for p in out.stdout.decode().split("\0") if p]


def test_no_tracked_file_names_material_outside_the_repository():
    found = []
    for rel in tracked_files():
        path = ROOT / rel
        if not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (screenshots)
        found += [f"{rel}: {word}" for word in OUTSIDE if word in text]
    assert not found, found


def test_a_copy_without_shared_beside_it_passes_its_smoke_tests(tmp_path):
    clone = tmp_path / "kvtrace"
    for rel in tracked_files():
        src = ROOT / rel
        if src.is_file():
            dst = clone / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    assert not (clone.parent / "shared").exists()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(clone), "HOME": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    where = subprocess.run([sys.executable, "-c", "import kvtrace; print(kvtrace.__file__)"], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=120, check=True)
    assert where.stdout.strip() == str(clone / "kvtrace" / "__init__.py")  # the copy's package, not this one
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *SMOKE], cwd=clone,
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail and "SKIPPED" not in tail, tail
