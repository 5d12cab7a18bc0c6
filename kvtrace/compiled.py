"""The cache's hot modules, compiled with mypyc, the engine's Cython kernels, and their
fallbacks (the Python sources; the kernels' callers' numpy path).

``setup.py`` compiles the modules in ``COMPILED`` with mypyc when the install can (mypy
and a C compiler: the normal ``pip install -e .``), as one extension group beside the
sources. The ``.py`` sources stay the truth, and they are what runs instead when

* ``KVTRACE_PURE_PYTHON=1`` is set (also at install time: then nothing is compiled);
* the install built no extension (mypyc or the compiler was missing: setup.py says so);
* a source is newer than its extension (edited since the last ``make install``).

Compiled and source modules are never mixed: the compiled modules call each other
natively, so the fallback takes all of them or none. ``install`` (run by
``kvtrace/__init__.py``, before anything imports the cache) puts a finder in front of the
extension modules when the sources must run; ``mode`` says which run and why.

Standard library only: setup.py reads ``COMPILED`` before any dependency is installed.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from importlib.machinery import EXTENSION_SUFFIXES
from importlib.util import spec_from_file_location
from pathlib import Path

ENV = "KVTRACE_PURE_PYTHON"
GROUP = "kvtrace.cache._compiled"  # the group's shared library: kvtrace/cache/_compiled__mypyc.*.so
# The cache's per-block loops (allocation, eviction, hits, frees) and cache-only replay's
# loop over them: where cache-only replay spends its time (bench/cache_only.py). A module
# whose classes are patched outside the group stays out of it; a class subclassed outside
# it says so (``mypyc_attr(allow_interpreted_subclasses=True)``: the engine's request
# extends the cache's).
COMPILED = (
    "kvtrace.cache.blocks",
    "kvtrace.cache.block_pool",
    "kvtrace.cache.sink",
    "kvtrace.cache.managers.base",
    "kvtrace.cache.managers.full_attention",
    "kvtrace.cache.managers.mamba",
    "kvtrace.cache.managers.sliding_window",
    "kvtrace.cache.coordinator",
    "kvtrace.cache.request",
    "kvtrace.cache.manager",
    "kvtrace.replay.cache_only",
)

# Cython kernels: C loops over numpy buffers (the engine's decode step, trace-block token
# synthesis), compiled at install beside the mypyc group. Their callers keep a numpy path,
# which runs when ``kernels`` returns None (the same rules as above: the variable, nothing
# built, a changed source).
CYTHON = ("kvtrace.engine._decode", "kvtrace.workload._tokens")

_ROOT = Path(__file__).resolve().parent.parent  # the directory holding the kvtrace package


def source_path(module: str, root: Path = _ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def _extension(py: Path) -> Path | None:
    for suffix in EXTENSION_SUFFIXES:
        candidate = py.with_suffix(suffix)
        if candidate.exists():
            return candidate
    return None


def source_reason(root: Path = _ROOT, environ=os.environ) -> str | None:
    """Why the sources must run under ``root`` (None when the compiled modules can)."""
    if environ.get(ENV, "") not in ("", "0"):
        return f"{ENV}={environ[ENV]}"
    shared = _extension(source_path(GROUP + "__mypyc", root))
    if shared is None:
        return "not compiled (installed without mypyc)"
    for module in COMPILED:
        py = source_path(module, root)
        ext = _extension(py)
        if ext is None:
            return f"{module} was not compiled"
        if py.stat().st_mtime > min(ext.stat().st_mtime, shared.stat().st_mtime):
            return f"{py.relative_to(root)} changed since it was compiled (make install compiles it again)"
    return None


class _SourceFinder:
    """Finds the ``.py`` source of every module in ``COMPILED`` (ahead of its extension)."""

    reason = ""  # why the sources run

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in COMPILED:
            return None
        return spec_from_file_location(name, source_path(name))


def install() -> None:
    """Decide once per process, before the cache is imported, which modules run."""
    if _SourceFinder in sys.meta_path:
        return
    reason = source_reason()
    if reason is not None:
        _SourceFinder.reason = reason
        sys.meta_path.insert(0, _SourceFinder)


def pyx_path(module: str, root: Path = _ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".pyx")


def kernels_reason(module: str, root: Path = _ROOT, environ=os.environ) -> str | None:
    """Why the numpy path must run instead of the Cython module (None when it can run)."""
    if environ.get(ENV, "") not in ("", "0"):
        return f"{ENV}={environ[ENV]}"
    pyx = pyx_path(module, root)
    ext = _extension(pyx)
    if ext is None:
        return f"{module} was not compiled (installed without Cython)"
    if pyx.stat().st_mtime > ext.stat().st_mtime:
        return f"{pyx.relative_to(root)} changed since it was compiled (make install compiles it again)"
    return None


def kernels(module: str):
    """The compiled Cython ``module``, or None when its callers must take their numpy path."""
    if kernels_reason(module) is not None:
        return None
    return import_module(module)


def is_compiled() -> bool:
    """Whether the compiled modules are the ones running."""
    return _SourceFinder not in sys.meta_path


def mode() -> str:
    """``compiled (mypyc)``, or ``pure Python (<why>)``."""
    return "compiled (mypyc)" if is_compiled() else f"pure Python ({_SourceFinder.reason})"


def kernels_mode() -> str:
    """``compiled (Cython)``, or ``numpy (<why>)`` when the kernels' callers take their numpy path."""
    reasons = [r for r in map(kernels_reason, CYTHON) if r is not None]
    return f"numpy ({'; '.join(reasons)})" if reasons else "compiled (Cython)"
