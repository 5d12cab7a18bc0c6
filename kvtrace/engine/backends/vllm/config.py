"""kvtrace's ``CacheConfig`` as vLLM's ``KVCacheConfig`` (and what the manager is built with).

One KV cache group per kvtrace group, in the same order, one layer each:

| kvtrace | vLLM 0.33 |
|---|---|
| ``FullAttentionSpec(bs)`` | ``FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=float16)`` |
| ``SlidingWindowSpec(bs, w)`` | ``SlidingWindowSpec(..., sliding_window=w)`` |
| ``MambaSpec(bs, lanes)`` | ``MambaSpec(block_size=bs, mamba_cache_mode="align", shapes=((lanes,),), ...)`` with ``num_speculative_blocks``, ``num_prefill_checkpoint_blocks`` and ``prefill_checkpoint_alignment`` from the CacheConfig |
| ``num_gpu_blocks`` (int) | ``KVCacheConfig.num_blocks`` (one pool, null block included) |
| ``retention_interval`` | ``prefix_cache_retention_interval`` |
| ``hash_block_size`` | the manager's ``hash_block_size`` |
| lcm of the block sizes | the manager's ``scheduler_block_size`` |
| ``enable_partial_hits`` | fine-grained hits, which vLLM turns on by itself when it can; kvtrace off where vLLM would be on is ``allow_partial_hash_hits=False`` |
| ``hash_fn="sha256_cbor"`` | ``vllm.utils.hashing.sha256_cbor`` |

Tensor sizes play no part on the scheduler side (``kv_cache_tensors=[]``). Settings vLLM
0.33 has no counterpart for are refused, each with the reason (``UnsupportedConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm
from typing import Any

from kvtrace.cache.config import CacheConfig, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtrace.engine.backends.vllm._load import VllmAPI, reraise_from_vllm
from kvtrace.errors import KVTraceError


def manager_classes(api: VllmAPI, groups: list[Any]) -> list[type]:
    """vLLM's single-type manager class of each ``KVCacheGroupSpec``."""
    return [api.KVCacheSpecRegistry.get_manager_class(g.kv_cache_spec, g.role) for g in groups]


class UnsupportedConfig(KVTraceError):
    """A kvtrace configuration with no vLLM 0.33 counterpart (the message says why).

    ``keys``: the ``CacheConfig`` fields that make it so, the most direct first, so a caller
    can name the flag or file key the user set (``kvtrace.replay.run.unsupported_at_origin``)."""

    def __init__(self, message: str, keys: tuple[str, ...] = ()):
        super().__init__(message)
        self.keys = keys


@dataclass(frozen=True)
class VllmCacheSetup:
    """What vLLM's ``KVCacheManager`` is built from for one kvtrace ``CacheConfig``."""

    kv_cache_config: Any  # vllm.v1.kv_cache_interface.KVCacheConfig
    scheduler_block_size: int
    hash_block_size: int
    allow_partial_hash_hits: bool  # False: vLLM's coordinator is told not to turn fine-grained hits on
    hash_fn: Any


def check_expressible(config: CacheConfig, connector: bool = False) -> None:
    """``UnsupportedConfig`` for what vLLM 0.33 cannot express, found without loading vLLM
    (a refused setting is told before its 20 s of imports); ``vllm_cache_setup`` asks
    the rest of vLLM's own API."""
    if not config.shared_pool:
        raise UnsupportedConfig("num_gpu_blocks per group (separate pools, SGLang's layout) has no vLLM "
                                "counterpart: vLLM 0.33 keeps one block pool for every group; give one total",
                                ("num_gpu_blocks",))
    if config.external is not None and not connector:
        raise UnsupportedConfig("the external tier is kvtrace's model of a connector; vLLM's manager has none "
                                "(drop external_capacity_blocks)", ("external",))
    if config.hash_fn != "sha256_cbor":
        raise UnsupportedConfig(f"hash_fn {config.hash_fn!r}: kvtrace's xxhash (xxh3-64) is not vLLM's xxhash_cbor "
                                "(xxh3-128); use sha256_cbor", ("hash_fn",))
    hbs = config.hash_block_size
    smallest = min(s.block_size for s in config.groups)
    wide = [s.block_size for s in config.groups if isinstance(s, MambaSpec) and s.block_size != smallest]
    if wide:
        raise UnsupportedConfig(
            f"a Mamba group of {wide[0]}-token blocks beside {smallest}-token ones: vLLM 0.33's align mode gives "
            "attention and Mamba one block size (its block-aligned split cuts at the smallest group block, which "
            "would leave Mamba states between its block ends); give the groups one block size", ("groups",))
    if len(config.groups) == 1 and config.groups[0].block_size != hbs:
        raise UnsupportedConfig(
            f"one group with {config.groups[0].block_size}-token blocks hashed in {hbs}-token units: vLLM 0.33 "
            "hashes a single group per block (its unitary coordinator asserts hash_block_size == block_size)",
            ("hash_block_size", "groups"))


def vllm_cache_setup(api: VllmAPI, config: CacheConfig, connector: bool = False) -> VllmCacheSetup:
    """Translate ``config`` (see the module table); ``UnsupportedConfig`` when vLLM 0.33
    cannot express it. ``connector``: the caller plays a KV connector for kvtrace's
    external tier (it passes the tier's hit tokens as ``num_external_computed_tokens``).
    An exception inside vLLM's spec classes (a patched checkout's) is one line naming where."""
    check_expressible(config, connector)
    try:
        return _setup(api, config)
    except Exception as exc:
        reraise_from_vllm(api, exc, "building the KV cache specs")


def _setup(api: VllmAPI, config: CacheConfig) -> VllmCacheSetup:
    import torch

    groups = []
    for g, spec in enumerate(config.groups):
        if isinstance(spec, FullAttentionSpec):
            vspec = api.FullAttentionSpec(block_size=spec.block_size, num_kv_heads=1, head_size=64,
                                          dtype=torch.float16)
        elif isinstance(spec, SlidingWindowSpec):
            vspec = api.SlidingWindowSpec(block_size=spec.block_size, num_kv_heads=1, head_size=64,
                                          dtype=torch.float16, sliding_window=spec.sliding_window)
        else:
            assert isinstance(spec, MambaSpec)
            vspec = api.MambaSpec(
                block_size=spec.block_size, shapes=((spec.num_lanes,),), dtypes=(torch.float16,),
                mamba_cache_mode="align", num_speculative_blocks=config.num_speculative_blocks,
                num_prefill_checkpoint_blocks=config.num_prefill_checkpoint_blocks,
                prefill_checkpoint_alignment=config.prefill_checkpoint_alignment
                if config.num_prefill_checkpoint_blocks else None,
            )
        groups.append(api.KVCacheGroupSpec(layer_names=[f"layer.{g}"], kv_cache_spec=vspec))
    hbs = config.hash_block_size
    sbs = lcm(*(s.block_size for s in config.groups))
    kv_cache_config = api.KVCacheConfig(num_blocks=config.num_gpu_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=groups,
                                        prefix_cache_retention_interval=config.retention_interval,
                                        hash_block_size=hbs)
    allow_partial = True
    if len(groups) > 1:
        vllm_partial = api.partial_hash_hits_enabled(groups, hbs, 1, manager_classes(api, groups))
        if config.enable_partial_hits and not vllm_partial:
            raise UnsupportedConfig(
                "enable_partial_hits: vLLM 0.33 has fine-grained hits only with a Mamba (align) group wider than "
                f"the {hbs}-token hash block and every other group able to look up hash units (no sliding window); "
                "set enable_partial_hits = false ([cache] of --config)",
                ("enable_partial_hits", "groups", "hash_block_size"))
        allow_partial = config.enable_partial_hits
    return VllmCacheSetup(kv_cache_config, sbs, hbs, allow_partial, api.sha256_cbor)
