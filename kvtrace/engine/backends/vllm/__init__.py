"""vLLM 0.33's scheduler-side KV cache manager as a kvtrace cache backend.

The only package of kvtrace that imports vllm, and only when called (nothing here is
imported by ``import kvtrace.engine``). Modules:

* ``_load``: the install and version check and the one import of vLLM
  (``load_vllm``; ``KVTraceError`` naming the version found and ``EXPECTED_VERSION``);
* ``config``: kvtrace's ``CacheConfig`` as vLLM's ``KVCacheConfig`` and specs
  (``vllm_cache_setup``; ``UnsupportedConfig`` for what vLLM 0.33 lacks);
* ``manager``: ``VllmKVCacheManager``, vLLM's manager behind kvtrace's manager
  interface, with vLLM's own block-aligned split, cached keys and KV events;
* ``events``: both managers' KV events as comparable (operation, group, hash) lists.

* ``engine_manager``: ``VllmEngineManager``, the same with what the engine reads of its
  cache (events, state writes, cached entries, the external tier): ``--backend vllm``.

``kvtrace conformance`` (``kvtrace.replay.conformance``) drives it beside kvtrace's
manager; ``Engine(backend="vllm")`` drives it from kvtrace's scheduler.
"""

from typing import Any

from kvtrace.cache.config import CacheConfig
from kvtrace.engine.backends.vllm._load import (
    EXPECTED_VERSION,
    INSTALL_HINT,
    VllmAPI,
    installed_version,
    load_vllm,
    vllm_commit,
)
from kvtrace.engine.backends.vllm.config import UnsupportedConfig, VllmCacheSetup, check_expressible, vllm_cache_setup
from kvtrace.engine.backends.vllm.events import kvtrace_event_keys, vllm_event_keys
from kvtrace.engine.backends.vllm.manager import VllmKVCacheManager

__all__ = [
    "EXPECTED_VERSION", "INSTALL_HINT", "UnsupportedConfig", "VllmAPI", "VllmCacheSetup", "VllmKVCacheManager",
    "check_engine_backend", "installed_version", "kvtrace_event_keys", "load_vllm", "vllm_cache_setup", "vllm_commit",
    "vllm_event_keys",
]


def check_engine_backend(cache_config: CacheConfig) -> dict[str, Any]:
    """Before a ``--backend vllm`` run is recorded: vLLM imports at the expected version
    and can express ``cache_config`` (``KVTraceError``, one line, otherwise). Returns what
    the run records of it: ``vllm_version`` and ``vllm_commit`` (None when unknown)."""
    check_expressible(cache_config, connector=cache_config.external is not None)  # (before vLLM's imports)
    api = load_vllm()
    vllm_cache_setup(api, cache_config, connector=cache_config.external is not None)
    return {"vllm_version": api.version, "vllm_commit": vllm_commit()}
