"""vLLM's own ``KVCacheManager`` behind the calls kvtrace's scheduler makes.

``VllmKVCacheManager`` builds vLLM 0.33's scheduler-side manager for a kvtrace
``CacheConfig`` (``config.vllm_cache_setup``) and presents it through kvtrace's manager
interface: ``get_computed_blocks``, ``allocate_slots``, ``free``, ``new_step_starts``,
``take_block_copies``, ``take_state_writes``, ``get_block_ids``, ``usage``. It takes
kvtrace ``Request``s: each has a vLLM twin (a ``vllm.v1.request.Request``) made by
``new_request``, which also hands the kvtrace request the twin's block hashes, so both
managers key the same content with the same hashes (vLLM's ``init_none_hash`` and hash
function). Before each call the twin is brought in step with the kvtrace request
(computed tokens, shared-prefix boundary, output tokens).

It also calls vLLM's own ``Scheduler._mamba_block_aligned_split`` (unbound, with the
attributes it reads; building a ``Scheduler`` needs a whole ``VllmConfig``) and reads
vLLM's cached keys and KV events for comparisons.

What vLLM has no notion of comes back empty: ``take_state_writes`` (kvtrace's content
model), copy reasons and request ids (vLLM's copies are block pairs).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import numpy as np

from kvtrace.cache.config import CacheConfig, MambaSpec
from kvtrace.cache.plans import BlockCopy, StateWrite
from kvtrace.cache.request import Request
from kvtrace.engine.backends.vllm._load import VllmAPI, load_vllm, reraise_from_vllm, wrong_return
from kvtrace.engine.backends.vllm.config import VllmCacheSetup, vllm_cache_setup

COPY_VLLM = "vllm"  # the reason of a copy reported by vLLM (which gives none)

_F = TypeVar("_F", bound=Callable[..., Any])


def vllm_call(what: str) -> Callable[[_F], _F]:
    """A method that runs vLLM's code: an exception rising inside vLLM's package (a patched
    checkout's bug, or vLLM's own) becomes one line naming ``what`` was called, for which
    request, and the vLLM file and line (``vllm_failure``); kvtrace's own errors pass as they are."""

    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                reraise_from_vllm(getattr(self, "api", None), exc, what + _for_request(args))

        return cast("_F", call)

    return wrap


def _for_request(args: tuple[Any, ...]) -> str:
    """`` for request R`` when a call's first argument is a request (or its id)."""
    first = args[0] if args else None
    rid = first if isinstance(first, str) else getattr(first, "request_id", None)
    return f" for request {rid}" if rid is not None else ""


def init_none_hash(api: VllmAPI, hash_fn: Any) -> None:
    """vLLM's ``init_none_hash`` for ``hash_fn``, independent of ``PYTHONHASHSEED``.

    vLLM 0.33 seeds its root parent hash (``NONE_HASH``) with ``PYTHONHASHSEED`` when that
    is set (the string itself: "1", "random", ...), else with a fixed seed for a
    cryptographic hash function (sha256_cbor, the only one the backend takes). Every block
    hash, hence every span and the run's digest, follows from it, so a replay's digest would
    change with the shell's PYTHONHASHSEED. The seed is resolved as if it were unset: vLLM's
    fixed default, the same in every process.
    """
    saved = os.environ.pop("PYTHONHASHSEED", None)
    try:
        api.init_none_hash(hash_fn)
    finally:
        if saved is not None:
            os.environ["PYTHONHASHSEED"] = saved


class VllmKVCacheManager:
    """vLLM 0.33's ``KVCacheManager`` for ``cache_config``, with kvtrace's interface.

    Args:
        cache_config: the kvtrace configuration (translated; ``UnsupportedConfig`` when
            vLLM 0.33 has no counterpart).
        max_model_len: the scheduler's ``max_model_len``.
        enable_events: vLLM's ``enable_kv_cache_events`` (``take_events``).
        max_num_batched_tokens, long_prefill_token_threshold: what vLLM's block-aligned
            split reads of the scheduler config (the budget is also the tokens in flight: the
            admission gate's sliding-window cap).
        connector: the caller plays a KV connector for kvtrace's external tier (whose
            hit tokens it passes to ``allocate_slots``); else an external tier is refused.
    """

    @vllm_call("building KVCacheManager")
    def __init__(self, cache_config: CacheConfig, *, max_model_len: int = 1 << 20, enable_events: bool = True,
                 max_num_batched_tokens: int = 8192, long_prefill_token_threshold: int = 0,
                 connector: bool = False, api: VllmAPI | None = None):
        self.api = api = api or load_vllm()
        self.config = cache_config
        self.setup: VllmCacheSetup = vllm_cache_setup(api, cache_config, connector)
        setup = self.setup
        init_none_hash(api, setup.hash_fn)
        self._hasher = api.get_request_block_hasher(setup.hash_block_size, setup.hash_fn)
        module = api.kv_cache_manager_module
        factory = module.get_kv_cache_coordinator
        if not setup.allow_partial_hash_hits:
            module.get_kv_cache_coordinator = functools.partial(factory, allow_partial_hash_hits=False)
        try:
            # max_in_flight_tokens: one step's budget, as vLLM's synchronous scheduler (one batch in
            # flight) gives it; it caps a sliding window's admission count (else max_model_len: no cap)
            self.manager = api.KVCacheManager(
                kv_cache_config=setup.kv_cache_config, max_model_len=max_model_len,
                max_in_flight_tokens=max_num_batched_tokens,
                scheduler_block_size=setup.scheduler_block_size, hash_block_size=setup.hash_block_size,
                enable_caching=cache_config.enable_caching, enable_kv_cache_events=enable_events,
            )
        finally:
            module.get_kv_cache_coordinator = factory
        # vLLM's EngineCore, once its scheduler and this manager are built, caches vLLM's
        # environment variables for the process (enable_envs_cache); without it vLLM's own
        # code reads os.environ on every KV event (maybe_convert_block_hash), which vLLM as
        # served never does (a tenth of a dense-attention replay)
        api.enable_envs_cache()
        self._blocks_type = type(self.manager.empty_kv_cache_blocks)  # what get_computed_blocks, allocate_slots return
        self.coordinator = self.manager.coordinator
        self.block_pool = self.manager.block_pool
        self.num_groups = cache_config.num_groups
        self._twins: dict[str, Any] = {}
        groups = cache_config.groups
        mamba = [s for s in groups if isinstance(s, MambaSpec)]
        self.need_mamba_block_aligned_split = bool(mamba)
        partial = bool(mamba) and setup.hash_block_size < setup.scheduler_block_size and bool(
            getattr(self.coordinator, "enable_partial_hash_hits", False))
        # the Scheduler attributes _mamba_block_aligned_split reads (scheduler.py)
        self._split_self = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=min(s.block_size for s in groups)),
            block_size=setup.scheduler_block_size,
            hash_block_size=setup.hash_block_size,
            mamba_partial_cache_hit=partial,
            use_eagle_block_drop=False,
            num_hash_lookahead_tokens=0,
            mamba_has_prefill_checkpoint_blocks=bool(mamba) and cache_config.num_prefill_checkpoint_blocks > 0,
            mamba_prefill_checkpoint_alignment=(cache_config.prefill_checkpoint_alignment
                                                if mamba and cache_config.num_prefill_checkpoint_blocks else None),
            max_num_scheduled_tokens=max_num_batched_tokens,
            scheduler_config=SimpleNamespace(long_prefill_token_threshold=long_prefill_token_threshold),
            mamba_shared_prefix_checkpoint=partial and self.manager.mamba_shared_prefix_checkpoint,
        )

    # -- requests -----------------------------------------------------------------
    @vllm_call("Request (with its block hasher)")
    def new_request(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray,
                    max_tokens: int = 16, cache_salt: str | None = None) -> Request:
        """A kvtrace ``Request`` and its vLLM twin; the kvtrace request shares the twin's
        block hashes (one list, which the twin extends as output tokens arrive; the salt
        keys the first block)."""
        tokens = (prompt_token_ids.tolist() if isinstance(prompt_token_ids, np.ndarray)
                  else [int(t) for t in prompt_token_ids])
        twin = self.api.Request(request_id=request_id, prompt_token_ids=tokens,
                                sampling_params=self.api.SamplingParams(max_tokens=max(max_tokens, 1)),
                                pooling_params=None, block_hasher=self._hasher, cache_salt=cache_salt)
        self._twins[request_id] = twin
        return Request(request_id, np.asarray(tokens, dtype=np.int64), block_hashes=twin.block_hashes)

    def twin(self, request: Request | str) -> Any:
        """The vLLM ``Request`` of ``request``, brought in step with it."""
        rid = request if isinstance(request, str) else request.request_id
        twin = self._twins[rid]
        if not isinstance(request, str):
            twin.num_computed_tokens = request.num_computed_tokens
            outputs = request.output_token_ids
            if len(outputs) > len(twin.output_token_ids):
                twin.append_output_token_ids(outputs[len(twin.output_token_ids):])
        return twin

    @vllm_call("Request.append_output_token_ids (with its block hasher)")
    def append_output_token_ids(self, request: Request, token_ids: int | list[int]) -> None:
        """Append sampled tokens to both (the twin first: it extends the shared hashes)."""
        tokens = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self._twins[request.request_id].append_output_token_ids(tokens)
        request.append_output_token_ids(tokens)

    def set_running(self, request: Request) -> None:
        self.twin(request).status = self.api.RequestStatus.RUNNING

    # -- the manager interface ------------------------------------------------------
    @vllm_call("KVCacheManager.get_computed_blocks")
    def get_computed_blocks(self, request: Request) -> tuple[Any, int, int]:
        """vLLM's ``(KVCacheBlocks, num hit tokens, shared_prefix_boundary)``; the twin
        keeps the boundary, as vLLM's scheduler stores it on the request."""
        twin = self.twin(request)
        out = self.manager.get_computed_blocks(twin)
        try:
            blocks, hit, boundary = out
        except (TypeError, ValueError):
            blocks = hit = boundary = None
        if (type(blocks) is not self._blocks_type or type(hit) is not int or type(boundary) is not int
                or not 0 <= hit <= twin.num_tokens):
            raise wrong_return(self.api, "KVCacheManager.get_computed_blocks", self.manager.get_computed_blocks, out,
                               f"(KVCacheBlocks, hit tokens from 0 to the request's {twin.num_tokens:,}, boundary)")
        twin.shared_prefix_boundary = boundary
        return blocks, hit, boundary

    def check_blocks(self, out: Any, what: str = "allocate_slots") -> Any:
        """``out`` of vLLM's ``KVCacheManager.<what>``: None or its ``KVCacheBlocks``, else one
        line naming the function (a patched one that returns another type)."""
        if out is not None and type(out) is not self._blocks_type:
            raise wrong_return(self.api, f"KVCacheManager.{what}", getattr(self.manager, what, None), out,
                               "None or KVCacheBlocks")
        return out

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_external_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False) -> Any:
        """vLLM's ``allocate_slots`` (its ``KVCacheBlocks`` has ``get_block_ids``), or None.
        vLLM's exceptions pass as they are (``kvtrace conformance`` reports them)."""
        return self.check_blocks(self.manager.allocate_slots(
            self.twin(request), num_new_tokens, num_new_computed_tokens=num_new_computed_tokens,
            new_computed_blocks=new_computed_blocks, num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens, full_sequence_must_fit=full_sequence_must_fit,
        ))

    @vllm_call("KVCacheManager.free")
    def free(self, request: Request | str, finished: bool = True) -> None:
        """Free the request's blocks (finished, or preempted: ``finished=False``)."""
        twin = self.twin(request)
        self.manager.free(twin)
        twin.status = self.api.RequestStatus.FINISHED_STOPPED if finished else self.api.RequestStatus.PREEMPTED
        if not finished:
            twin.num_computed_tokens = 0

    def forget(self, request_id: str) -> None:
        """Drop a finished request's twin."""
        self._twins.pop(request_id, None)

    @vllm_call("KVCacheManager.new_step_starts")
    def new_step_starts(self) -> None:
        self.manager.new_step_starts()

    @vllm_call("taking the step's copy-on-write copies")
    def take_block_copies(self) -> list[BlockCopy]:
        """The step's copy-on-write copies per group, then the immediate free of their
        retained endpoints (what vLLM's scheduler does without a deferring connector)."""
        copies: list[BlockCopy] = []
        retained: list[Any] = []  # vLLM's KVCacheBlocks (loaded at run time)
        for g, mgr in enumerate(self.coordinator.single_type_managers):
            for src, dst in mgr.take_pending_cow_copies():
                copies.append(BlockCopy(g, src.block_id, dst.block_id, "", COPY_VLLM))
                retained.extend((src, dst))
        if retained:
            self.block_pool.free_blocks(retained)
        return copies

    def take_state_writes(self) -> list[StateWrite]:
        return []  # vLLM's scheduler side has no content model

    @vllm_call("KVCacheManager.take_events")
    def take_events(self) -> list[Any]:
        return self.checked_events(self.manager.take_events())

    def checked_events(self, events: Any) -> list[Any]:
        """``events`` of vLLM's ``take_events``: a list, else one line naming the function."""
        if type(events) is not list:
            raise wrong_return(self.api, "KVCacheManager.take_events", self.manager.take_events, events,
                               "a list of KV cache events")
        return events

    @vllm_call("KVCacheManager.get_block_ids")
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        ids = self.manager.get_block_ids(request_id)
        if not isinstance(ids, (tuple, list)) or not all(isinstance(g, list) for g in ids):
            raise wrong_return(self.api, "KVCacheManager.get_block_ids", self.manager.get_block_ids, ids,
                               "block ids per group")
        return tuple(ids)

    @property
    @vllm_call("KVCacheManager.usage")
    def usage(self) -> float:
        return self.manager.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # -- for comparisons -------------------------------------------------------------
    def cached_keys(self) -> set[tuple[int, bytes]]:
        """Every (group, block hash) in vLLM's prefix-cache map."""
        api = self.api
        keys = self.block_pool.cached_block_hash_to_block._cache
        return {(api.get_group_id(k), bytes(api.get_block_hash(k))) for k in keys}

    @vllm_call("Scheduler._mamba_block_aligned_split")
    def block_aligned_split(self, request: Request, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                            num_external_computed_tokens: int = 0) -> int:
        """vLLM's own ``Scheduler._mamba_block_aligned_split`` for this configuration."""
        if not self.need_mamba_block_aligned_split:
            return num_new_tokens
        return self.api.Scheduler._mamba_block_aligned_split(
            self._split_self, self.twin(request), num_new_tokens, num_new_local_computed_tokens,
            num_external_computed_tokens)

    def external_hash(self, block_hash: bytes) -> int | bytes:
        """``block_hash`` as vLLM's KV events carry it (``maybe_convert_block_hash``)."""
        return self.api.maybe_convert_block_hash(block_hash)
