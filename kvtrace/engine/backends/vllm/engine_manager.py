"""vLLM's ``KVCacheManager`` as the engine's cache (``--backend vllm``).

``VllmEngineManager`` extends ``VllmKVCacheManager`` with what kvtrace's engine reads of
its cache manager besides the allocation calls: the step's cache events (for spans, the
digest and the stale-hash audit), the worker's state writes, the cached entries the
audit checks, per-group usage and the external tier's lookup. vLLM says less than
kvtrace's manager does, so part of it is inferred from what the adapter can see; every
inferred value is listed here and in docs/cache_semantics.md ("The vllm backend"), and
marked on its span (``kvtrace.inferred``: the ``Inferred`` entries of the span table,
``kvtrace.instrument.span_kinds``):

Events (kvtrace's ``kvtrace.cache.events``, from vLLM's ``take_events`` after each call):

* ``BlockPublished``: one per vLLM ``BlockStored``, attributed to the request whose
  ``allocate_slots`` emitted it; hashes mapped back to the request's own block hashes
  (vLLM's events carry their low 64 bits), block ids read from vLLM's prefix-cache map.
  ``kind`` is inferred: ``full`` when it ends on a block boundary of its group (a
  checkpoint there too, as kvtrace's pool keys it), else ``checkpoint`` when the key names
  the block and position of this allocation's prefill checkpoint write, else
  ``partial_tail`` (kvtrace's ``boundary``, a full block kept for a reachable boundary
  under sparse retention, shows as ``full``).
* ``BlockEvicted``: the removed keys of vLLM's ``BlockRemoved`` events (one per block),
  one event per run of removals of one group and reason within a call (kvtrace's pool
  emits one per allocation and group). ``reason`` is inferred: ``lru`` when the
  allocation took the key's block off the free queue (it is among the blocks handed out,
  the copy targets or a connector load's blocks), else ``stale_hash`` when the block is
  the allocation's checkpoint block and no key of the call names that checkpoint (a
  transient one: the state written there overwrites what the key named), else
  ``replaced`` (the block stays where it is and loses the key: a promoted partial key,
  a checkpoint re-keyed), ``reset`` for
  ``AllBlocksCleared``. ``idle`` is -1 (vLLM does not say when a block was last used);
  ``ages`` count steps since the publish the adapter saw.
* ``BlockCopied``: one per copy-on-write pair; ``why`` is inferred: ``partial_hit`` when
  the copy block took the source's place in the request's table, else ``running_tail``
  (the key moved to the copy, which vLLM's ``move_block_hashes`` does silently; the
  adapter then emits the ``moved`` publish/evict pair kvtrace's manager emits).
* ``PrefixLookup``: per lookup; ``hit_tokens_per_group`` is each group's hit alone, as
  kvtrace's manager gives it (vLLM's own ``find_longest_cache_hit_per_group``, asked
  besides the fixed point vLLM's lookup returns: ``_group_hits``); the first miss is past
  group 0's own hit, as kvtrace's (``_group0_hit``: read from vLLM's prefix map, or vLLM's
  lookup of group 0 alone).
* ``BlocksFreed``: the request's non-null blocks per group, tail first, read before
  vLLM frees them. External-tier (connector) evictions: the tier's own events (the tier
  is kvtrace's, written through as kvtrace's pool writes it); loads emit nothing.

State writes (the worker's content model; vLLM's scheduler gives none):

* ``checkpoint``: from vLLM's own worker rule, ``compute_mamba_prefill_checkpoints``
  (the chunk's end and length), into the block at that column of vLLM's table: what
  vLLM's GPU worker writes;
* ``running`` and ``external``: the block of vLLM's table at the chunk's (load's) end,
  which the worker compares with its own table (``table_disagreements``), as with
  kvtrace's manager.

The external tier (``external_capacity_blocks``) is kvtrace's ``ExternalTier``, written
through by every publish the adapter sees and looked up by kvtrace's coordinator rule;
vLLM takes its hit tokens as a connector's ``num_external_computed_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, cast

from kvtrace.cache.config import CacheConfig, FullAttentionSpec, MambaSpec
from kvtrace.cache.events import (
    COPY_EXTERNAL,
    COPY_PARTIAL_HIT,
    COPY_RUNNING_TAIL,
    EVICT_LRU,
    EVICT_MOVED,
    EVICT_REPLACED,
    EVICT_RESET,
    EVICT_STALE_HASH,
    PUBLISH_CHECKPOINT,
    PUBLISH_FULL,
    PUBLISH_MOVED,
    PUBLISH_PARTIAL_TAIL,
    BlockCopied,
    BlockEvicted,
    BlockPublished,
    BlocksFreed,
    CacheListener,
    PrefixLookup,
    first_miss,
    note_external_hits,
)
from kvtrace.cache.external import connector_hit
from kvtrace.cache.plans import STATE_CHECKPOINT, STATE_EXTERNAL, STATE_RUNNING, BlockCopy, StateWrite
from kvtrace.cache.request import Request
from kvtrace.engine.backends.vllm._load import VllmAPI, unknown_event, vllm_location, wrong_return
from kvtrace.engine.backends.vllm.manager import VllmKVCacheManager, vllm_call
from kvtrace.errors import KVTraceError
from kvtrace.names import cut_middle
from kvtrace.numeric import cdiv

_COW_COPIES = attrgetter("_pending_cow_copies")  # a single-type manager's copy-on-write pairs of the step
IDLE_UNKNOWN = -1  # BlockEvicted.idle of the vllm backend: vLLM does not say when a block was last used


@dataclass
class VllmStats:
    """The cache counters the engine reads (kvtrace's behaviour switches do not exist in vLLM)."""

    stale_hash_left: int = 0


class VllmEngineManager(VllmKVCacheManager):
    """vLLM 0.33's manager with the engine-facing part of kvtrace's manager interface
    (see the module docstring for what is inferred)."""

    def __init__(self, cache_config: CacheConfig, *, max_model_len: int = 1 << 20,
                 max_num_batched_tokens: int = 8192, long_prefill_token_threshold: int = 0,
                 api: VllmAPI | None = None):
        connector = cache_config.external is not None
        super().__init__(cache_config, max_model_len=max_model_len, enable_events=True,
                         max_num_batched_tokens=max_num_batched_tokens,
                         long_prefill_token_threshold=long_prefill_token_threshold, connector=connector, api=api)
        self.scheduler_block_size = self.setup.scheduler_block_size
        self.hash_block_size = self.setup.hash_block_size
        self.empty_kv_cache_blocks = self.manager.empty_kv_cache_blocks
        self.stats = VllmStats()
        self.step = 0
        self._listeners: list[CacheListener] = []
        self._events: list[Any] = []
        self._lookup_at = -1  # _events index of the last PrefixLookup (its external hit filled in later)
        self._writes: list[StateWrite] = []
        self._copy_owner: dict[tuple[int, int, int], tuple[str, str]] = {}  # (group, src, dst) -> (request, why)
        self._managers = list(self.coordinator.single_type_managers)
        if self.num_groups > 1 and cache_config.enable_caching and not callable(
                getattr(self.coordinator, "find_longest_cache_hit_per_group", None)):
            # (without it, each group's hit is unknown: the request's written into every group read as the
            # groups' own, a group hit rate that was the request's)
            raise KVTraceError(f"vLLM {self.api.version}: its {type(self.coordinator).__name__} has no "
                               "find_longest_cache_hit_per_group (vLLM 0.33's per-group lookup), which kvtrace reads "
                               "each KV group's own hit from; a config of one KV group needs none")
        self._block_size = [s.block_size for s in cache_config.groups]
        self._mamba = [g for g, s in enumerate(cache_config.groups) if isinstance(s, MambaSpec)]
        # groups whose tables hold null blocks (Mamba, sliding window), which usage leaves out
        self._padded = [not isinstance(s, FullAttentionSpec) for s in cache_config.groups]
        self._mamba_managers = [(g, self._managers[g], self._block_size[g]) for g in self._mamba]
        self._suffix = [g.to_bytes(4, "big") for g in range(self.num_groups)]
        # (group, event hash) -> [[full hash, block id, step published], ...]: what an eviction
        # names; one record per block, as vLLM may key several blocks with one hash
        self._published: dict[tuple[int, Any], list[list[Any]]] = {}
        self._num_tokens: dict[tuple[int, bytes], int] = {}  # (group, hash) -> prefix tokens, for the audit
        self._index: dict[str, tuple[int, dict[Any, int]]] = {}  # request -> (hashes seen, event hash -> index)
        self._convert = event_hash_function(self.api)
        self._checkpoint_rule = api_checkpoint_rule(self.api) if self._mamba and \
            cache_config.num_prefill_checkpoint_blocks else None
        self._running = self.api.RequestStatus.RUNNING
        # kvtrace's external tier and its lookup rule (a shadow manager's coordinator, never allocated from)
        self._shadow = None
        if connector:
            from kvtrace.cache.manager import KVCacheManager

            self._shadow = KVCacheManager(cache_config)

    # -- events -----------------------------------------------------------------------
    def subscribe(self, listener: CacheListener) -> None:
        self._listeners.append(listener)
        if self._shadow is not None:  # the tier's own (connector) evictions, as kvtrace's manager emits them
            self._shadow.sink.enabled = True

    @vllm_call("KVCacheManager.new_step_starts")
    def new_step_starts(self) -> None:
        self._drain(None)
        batch, self._events = self._events, []
        for listener in self._listeners:
            listener(batch)
        self.step += 1
        if self._shadow is not None:
            self._shadow.sink.step = self.step  # (the tier's eviction events and ages)
        super().new_step_starts()

    def _hash_index(self, request: Request) -> dict[Any, int]:
        """Event hash -> index in the request's block hashes (grown as they grow)."""
        hashes = request.block_hashes
        seen = self._index.get(request.request_id)
        if seen is None or seen[0] != len(hashes):
            index = seen[1] if seen is not None else {}
            convert = self._convert
            for i in range(len(index), len(hashes)):
                index.setdefault(convert(hashes[i]), i)
            seen = (len(hashes), index)
            self._index[request.request_id] = seen
        return seen[1]

    def _drain(self, request: Request | None) -> None:
        """vLLM's pending KV events as kvtrace events (``request``: whose call made them)."""
        events = self.checked_events(self.manager.take_events())
        if events:
            self._map_events(events, request)

    def _map_events(self, events: list[Any], request: Request | None,
                    allocated: tuple[Any, list[list[int]] | None] | None = None,
                    checkpoints: set[tuple[int, int, int]] | frozenset = frozenset()) -> None:
        """vLLM KV events as kvtrace events; ``request``: whose call made them,
        ``allocated``: that call's (returned blocks, copy targets and connector-load blocks per
        group or None), the blocks it took off the free queue; ``checkpoints``: its (group, block, position)
        checkpoint writes."""
        step, hbs = self.step, self.hash_block_size
        out = self._events
        fresh: set[int] | None = None  # block ids the call took off the free queue, in any group
        stored: set[tuple[int, Any]] = set()  # keyed by these events: their removal is no LRU eviction
        run_key: tuple[int, str] | None = None  # (group, reason) of the evictions in ``run``
        run: list[tuple[int, Any, int]] = []  # (block id, hash, age) of consecutive removals
        # the call's checkpoint blocks whose checkpoint it does not key (a transient one): a key
        # such a block loses goes stale as the state written there overwrites it (kvtrace's stale_hash)
        transient = self._transient_checkpoints(events, request, checkpoints) if checkpoints else ()
        at_checkpoint = {(g, position): block for g, block, position in checkpoints}
        # per event, the (group, event hash) keys a later event of the call removes: a key stored
        # and dropped within the call names the request's own block, whoever else still holds it
        dropped_after: list[frozenset] = []
        later: frozenset = frozenset()
        for ev in reversed(events):
            dropped_after.append(later)
            if type(ev).__name__ == "BlockRemoved":
                g = ev.group_idx if ev.group_idx is not None else 0
                later = later | {(g, eh) for eh in ev.block_hashes}
        dropped_after.reverse()
        for e, ev in enumerate(events):
            name = type(ev).__name__
            if run_key is not None and name != "BlockRemoved":
                out.append(self._evicted(run_key, run, request))
                run_key = None
            if name == "BlockStored" and request is not None and ev.block_hashes:
                g = ev.group_idx if ev.group_idx is not None else 0
                index = self._hash_index(request)
                hashes = cast("list[bytes]", request.block_hashes)  # vLLM's: always bytes
                tier = self._shadow.external if self._shadow is not None else None
                table = self._managers[g].req_to_blocks.get(request.request_id, ())
                ids, full, ntok = [], [], 0
                stores: list[tuple[Any, int]] = []  # (hash, num_tokens) the tier stores
                for eh in ev.block_hashes:
                    i = index.get(eh)
                    if i is None:
                        continue
                    h = hashes[i]
                    ntok = (i + 1) * hbs
                    bid = self._keyed_block(g, h, table, -(-ntok // self._block_size[g]) - 1,
                                            at_checkpoint.get((g, ntok)), (g, eh) in dropped_after[e])
                    ids.append(bid)
                    full.append(h)
                    recs = self._published.setdefault((g, eh), [])
                    recs[:] = [r for r in recs if r[1] != bid or bid < 0]
                    recs.append([h, bid, step])
                    stored.add((g, eh))
                    self._num_tokens[(g, h)] = ntok
                    stores.append((h, ntok))
                if ids:
                    if ntok % self._block_size[g] == 0:  # (also a checkpoint at a block end: kvtrace's
                        kind = PUBLISH_FULL  # pool keys the full block there, as full or boundary)
                    elif (g, ids[-1], ntok) in checkpoints:
                        kind = PUBLISH_CHECKPOINT
                    else:
                        kind = PUBLISH_PARTIAL_TAIL
                    out.append(BlockPublished(step, request.request_id, g, kind, tuple(ids), tuple(full), ntok))
                # write-through, as kvtrace's pool does: what the store dropped for room (connector
                # evictions) after the publish
                if tier is not None:
                    tier.store_all(g, stores)
                    out.extend(tier.sink.events)
                    tier.sink.events.clear()
            elif name == "BlockRemoved":  # one per block: runs of one group and reason become one event
                g = ev.group_idx if ev.group_idx is not None else 0
                if fresh is None and allocated is not None:
                    # one pool for every group: a block keyed in one group is reused by any other
                    fresh = {b for ids in (*allocated[0].get_block_ids(), *(allocated[1] or ())) for b in ids}
                taken = fresh if fresh is not None else ()
                for eh in ev.block_hashes:
                    rec = self._removed_record(g, eh, taken, request)
                    h, bid, born = rec if rec is not None else (eh, -1, step)
                    reason = (EVICT_LRU if bid in taken and (g, eh) not in stored
                              else EVICT_STALE_HASH if (g, bid) in transient else EVICT_REPLACED)
                    if (g, reason) != run_key:
                        if run_key is not None:
                            out.append(self._evicted(run_key, run, request))
                        run_key, run = (g, reason), []
                    run.append((bid, h, step - born))
            elif name == "AllBlocksCleared":
                for (g, _), recs in self._published.items():
                    for h, bid, born in recs:
                        out.append(BlockEvicted(step, g, EVICT_RESET, (bid,), (h,), (step - born,), (IDLE_UNKNOWN,),
                                                None))
                self._published.clear()
                self._num_tokens.clear()
            elif name != "BlockStored":  # a patched vLLM's own event: dropping it would lose what it says
                raise unknown_event(self.api, ev)
        if run_key is not None:
            out.append(self._evicted(run_key, run, request))

    def _transient_checkpoints(self, events: list[Any], request: Request | None,
                               checkpoints: set[tuple[int, int, int]] | frozenset) -> set[tuple[int, int]]:
        """(group, block) of the call's checkpoint writes whose position no ``BlockStored`` of
        the call keys (the checkpoint is request-local, published nowhere)."""
        keyed: set[tuple[int, int]] = set()  # (group, prefix tokens) the call keyed
        if request is not None:
            index, hbs = self._hash_index(request), self.hash_block_size
            for ev in events:
                if type(ev).__name__ == "BlockStored":
                    g = ev.group_idx if ev.group_idx is not None else 0
                    keyed.update((g, (index[eh] + 1) * hbs) for eh in ev.block_hashes if eh in index)
        return {(g, block) for g, block, position in checkpoints if (g, position) not in keyed}

    def _held_ids(self, g: int, h: bytes) -> Any:
        """The ids of the blocks vLLM holds under key ``h`` of group ``g``."""
        held = self.block_pool.cached_block_hash_to_block._cache.get(h + self._suffix[g])
        return held.keys() if isinstance(held, dict) else () if held is None else (held.block_id,)

    def _keyed_block(self, g: int, h: bytes, table: Any, col: int, checkpoint: int | None = None,
                     dropped: bool = False) -> int:
        """The block a ``BlockStored`` of key ``h`` keyed (the event names none): the call's
        checkpoint block when the key is its position's (``checkpoint``) and vLLM holds it
        there or the call drops it again; else the request's own block at that position when
        vLLM holds the key there, or when the key was dropped again within the call
        (``dropped``: a Mamba boundary re-keyed as its checkpoint, another block keeping the
        key or none); else one vLLM holds under it (-1: none)."""
        held = self._held_ids(g, h)
        if checkpoint is not None and (checkpoint in held or dropped):
            return checkpoint
        mine = table[col].block_id if 0 <= col < len(table) and not table[col].is_null else -1
        if mine in held or not held or (dropped and mine >= 0):
            return mine
        return next(iter(held))

    def _removed_record(self, g: int, eh: Any, taken: Any = (), request: Request | None = None) -> list[Any] | None:
        """The record of the block vLLM dropped key ``eh`` of group ``g`` from (its event
        names no block): the only one, or of several blocks keyed alike, the first the call
        took off the free queue (``taken``: evicted, perhaps keyed alike again within the call),
        else the first that vLLM no longer holds under the key, else the first in the
        table of ``request``, whose call made the event (a key its own block lost and got
        back within the call: a partial key promoted, then re-stored)."""
        recs = self._published.get((g, eh))
        if not recs:
            return None
        i = 0
        if len(recs) > 1:
            # a block the call took off the free queue lost its key for certain; one vLLM no longer
            # holds the key on may have had it moved away (a running-tail copy onto the taken block)
            i = next((k for k, r in enumerate(recs) if r[1] in taken), -1)
            if i < 0:
                held = self._held_ids(g, recs[0][0])
                i = next((k for k, r in enumerate(recs) if r[1] not in held), -1)
            if i < 0 and request is not None:
                mine = {b.block_id for b in self._managers[g].req_to_blocks.get(request.request_id, ())}
                i = next((k for k, r in enumerate(recs) if r[1] in mine), -1)
            i = max(i, 0)
        rec = recs.pop(i)
        if not recs:
            del self._published[(g, eh)]
            self._num_tokens.pop((g, rec[0]), None)
        return rec

    def _evicted(self, key: tuple[int, str], run: list[tuple[int, Any, int]], request: Request | None) -> BlockEvicted:
        """One eviction event for removals of one group and reason (kvtrace's grain: its
        pool emits one per allocation and group)."""
        ids, hashes, ages = zip(*run)
        return BlockEvicted(self.step, key[0], key[1], ids, hashes, ages, (IDLE_UNKNOWN,) * len(run),
                            request.request_id if request is not None else None)

    # -- requests -----------------------------------------------------------------------
    @vllm_call("Request (with its block hasher)")
    def attach(self, request: Request) -> Any:
        """Give an engine request its vLLM twin (returned); the request takes the twin's
        block hashes."""
        twin = self._twins.get(request.request_id)
        if twin is not None:
            return twin
        params = self.api.SamplingParams(max_tokens=max(getattr(request, "max_tokens", 1), 1))
        twin = self.api.Request(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids.tolist(),
                                sampling_params=params, pooling_params=None, block_hasher=self._hasher,
                                cache_salt=request.cache_salt)
        self._twins[request.request_id] = twin
        request._block_hashes = twin.block_hashes  # one list: the twin extends it as outputs arrive
        return twin

    @vllm_call("KVCacheManager.get_computed_blocks")
    def get_computed_blocks(self, request: Request) -> tuple[Any, int, int]:
        self.attach(request)
        blocks, hit, boundary = super().get_computed_blocks(request)
        if self._listeners:
            bs0 = self._block_size[0]
            fine = request.block_hashes
            per = bs0 // self.hash_block_size
            coarse = fine[per - 1::per]
            miss, miss_idx = first_miss(coarse, self._group0_hit(request, coarse, hit), bs0, request.num_tokens)
            self._lookup_at = len(self._events)
            self._events.append(PrefixLookup(
                self.step, request.request_id, request.num_tokens, hit, self._group_hits(request, hit), boundary, 0,
                coarse[0] if coarse else None, miss, miss_idx))
        return blocks, hit, boundary

    def _group_hits(self, request: Request, hit: int) -> tuple[int, ...]:
        """Each group's hit alone (kvtrace's ``hit_tokens_per_group``, the group hit rate's:
        a group's own lookup up to the request's last token but one, at the coordinator's hit
        alignment, before the groups agree on one hit): vLLM's own per-group lookups
        (``find_longest_cache_hit_per_group``; a coordinator without them is refused at the
        start). One group, or caching off: the request's hit in every group."""
        if self.num_groups == 1 or not self.config.enable_caching:
            return (hit,) * self.num_groups
        per_group = self.coordinator.find_longest_cache_hit_per_group
        out = per_group(request.block_hashes, max(request.num_tokens - 1, 0))
        hits = out[1] if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple) else ()
        if len(hits) != self.num_groups or not all(type(h) is int and 0 <= h <= request.num_tokens for h in hits):
            raise wrong_return(self.api, "KVCacheCoordinator.find_longest_cache_hit_per_group", per_group, out,
                               f"(blocks per group, the hit tokens of each of the {self.num_groups} groups)")
        return hits

    def _group0_hit(self, request: Request, coarse: Sequence[Any], hit: int) -> int:
        """Group 0's own hit (its first miss lies past it, as kvtrace's manager reads it: a block
        group 0 holds past a request's hit that another group or the hit alignment cut short did
        not miss), before an alignment coarser than its blocks. Full attention, downward closed:
        the request's hit, then the full blocks vLLM holds for group 0 in a row past it (its prefix
        map, as its lookup reads it); another kind: vLLM's own lookup for group 0 alone."""
        bs0 = self._block_size[0]
        last = min(len(coarse), max(request.num_tokens - 1, 0) // bs0)  # the blocks a lookup reads
        if not self._padded[0]:
            i = hit // bs0
            while i < last and self._held_ids(0, coarse[i]):
                i += 1
            return max(hit, i * bs0)
        m = self._managers[0]
        align = min(getattr(self.coordinator, "_cache_hit_alignment_tokens", bs0), bs0)
        return int(type(m).find_longest_cache_hit(
            block_hashes=request.block_hashes, max_length=max(request.num_tokens - 1, 0), kv_cache_group_ids=[0],
            block_pool=m.block_pool, kv_cache_spec=m.kv_cache_spec, drop_eagle_block=False, alignment_tokens=align,
            dcp_world_size=m.dcp_world_size, pcp_world_size=m.pcp_world_size)[1])

    def get_num_external_hit_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        """Tokens beyond the local hit kvtrace's external tier holds (kvtrace's coordinator rule)."""
        if self._shadow is None or not self.config.enable_caching:
            return 0
        n = self._shadow.coordinator.external_hit_tokens(request.block_hashes, num_local_hit_tokens,
                                                         request.num_tokens - 1)
        note_external_hits(self._events, self._lookup_at, request.request_id, n)  # (its lookup, just made)
        return n

    @vllm_call("KVCacheManager.truncate_computed_blocks")
    def get_connector_hit(self, request: Request, blocks: Any, num_local_hit_tokens: int) -> tuple[Any, int, int]:
        """vLLM's connector rule (``external.connector_hit``) over kvtrace's tier, a lookup's
        blocks cut by vLLM's own ``truncate_computed_blocks`` (kvtrace's manager's twin)."""
        if self._shadow is None or not self.config.enable_caching:
            return blocks, num_local_hit_tokens, 0
        coordinator, hashes, last = self._shadow.coordinator, request.block_hashes, request.num_tokens - 1
        local, external = connector_hit(num_local_hit_tokens, self.scheduler_block_size,
                                        lambda start: coordinator.external_hit_tokens(hashes, start, last))
        if local < num_local_hit_tokens:
            blocks = self.manager.truncate_computed_blocks(blocks, local)
        note_external_hits(self._events, self._lookup_at, request.request_id, external, local)
        return blocks, local, external

    @vllm_call("KVCacheManager.allocate_slots")
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_external_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False) -> Any:
        """vLLM's ``allocate_slots`` on the request's twin, then what it did as kvtrace's
        copies, state writes and events. Once per request and step (most calls a decode
        token), so the twin is brought in step here rather than through ``twin()``, and
        the kvtrace side reads each thing once."""
        rid = request.request_id
        twin = self._twins.get(rid)
        if twin is None:
            twin = self.attach(request)
        # in step with the engine request, as vLLM's scheduler keeps its own: computed
        # tokens, and sampled tokens appended one by one (each extends the block hashes)
        twin.num_computed_tokens = request.num_computed_tokens
        outputs = request.output_token_ids
        for i in range(twin.num_output_tokens, len(outputs)):
            twin.append_output_token_ids(outputs[i])
        managers = self._managers
        pending = [*map(len, map(_COW_COPIES, managers))]
        # a connector load's blocks come off the free queue outside what allocate_slots
        # returns (vLLM's allocate_external_computed_blocks): the table's growth tells them
        held = [len(m.req_to_blocks.get(rid, ())) for m in managers] if num_external_computed_tokens else None
        try:
            if (new_computed_blocks is None and not num_new_computed_tokens and not num_external_computed_tokens
                    and not num_lookahead_tokens and not full_sequence_must_fit):
                out = self.manager.allocate_slots(twin, num_new_tokens)  # a running request's call, as vLLM's
            else:  # (full_sequence_must_fit: vLLM's admission gate, scheduler_reserve_full_isl)
                out = self.manager.allocate_slots(
                    twin, num_new_tokens, num_new_computed_tokens=num_new_computed_tokens,
                    new_computed_blocks=new_computed_blocks, num_lookahead_tokens=num_lookahead_tokens,
                    num_external_computed_tokens=num_external_computed_tokens,
                    full_sequence_must_fit=full_sequence_must_fit)
        except Exception as err:  # vLLM's own failure (or a patched checkout's): one line, not its traceback
            where = vllm_location(self.api, err)
            if where is None:
                raise
            known = ""
            if num_external_computed_tokens and "free blocks" in str(err) and self._mamba:
                known = ("; vLLM 0.33 allocates an external (connector) load's Mamba blocks without counting them "
                         "in its free-block check, and a larger --capacity-blocks gets through (README, Conformance)")
            raise KVTraceError(cut_middle(
                f"vLLM's KVCacheManager failed allocating for request {rid} at step {self.step}: "
                f"{type(err).__name__}: {err} (at {where}){known} (`kvtrace conformance` with these settings shows "
                "where it parts from kvtrace's)", 1000)) from None
        self.check_blocks(out)
        if out is None:
            self._drain(request)
            return None
        targets: list[list[int]] | None = None  # per group, this call's copy targets and connector-load blocks
        if [*map(len, map(_COW_COPIES, managers))] != pending:
            targets = [[] for _ in managers]
            for g, m in enumerate(managers):
                table = m.req_to_blocks.get(rid, ())
                for src, dst in m._pending_cow_copies[pending[g]:]:
                    why = COPY_PARTIAL_HIT if any(b is dst for b in table) else COPY_RUNNING_TAIL
                    self._copy_owner[(g, src.block_id, dst.block_id)] = (rid, why)
                    targets[g].append(dst.block_id)
        if held is not None:
            hit = new_computed_blocks.get_block_ids() if new_computed_blocks is not None else None
            targets = targets or [[] for _ in managers]
            for g, m in enumerate(managers):
                # a hit block in its hit slot keeps its key; one the load moved (a Mamba hit's state block,
                # freed as the table skips past it and taken back off the free queue) lost it to the pool
                kept = set(enumerate(hit[g])) if hit is not None else set()
                table = m.req_to_blocks.get(rid, ())
                targets[g].extend(b.block_id for i, b in enumerate(table[held[g]:], held[g])
                                  if not b.is_null and (i, b.block_id) not in kept)
        if twin.status is not self._running:
            twin.status = self._running
        checkpoints: set[tuple[int, int, int]] | frozenset = frozenset()
        if self._mamba or num_external_computed_tokens:
            start = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
            end = start + num_new_tokens
            if num_external_computed_tokens:
                hit_ids = new_computed_blocks.get_block_ids() if new_computed_blocks is not None else None
                hit_blocks = [h + (len(hit_ids[g]) if hit_ids is not None else 0) for g, h in enumerate(held or ())]
                self._external_loaded(request, start - num_external_computed_tokens, start, hit_blocks)
            for g, m, bs in self._mamba_managers:
                table = m.req_to_blocks.get(rid, ())
                last = -(-end // bs)  # the block of the chunk's last token, 1-based
                if end > 0 and last <= len(table):
                    self._writes.append(StateWrite(rid, g, table[last - 1].block_id, end, STATE_RUNNING))
                if num_new_tokens > 1 and self._checkpoint_rule is not None:
                    offsets, cols = self._checkpoint_rule(m, [end], [num_new_tokens])
                    col = cols[0]
                    if 0 <= col < len(table):
                        block_id, position = table[col].block_id, start + offsets[0]
                        self._writes.append(StateWrite(rid, g, block_id, position, STATE_CHECKPOINT))
                        checkpoints = {*checkpoints, (g, block_id, position)}
        events = self.checked_events(self.manager.take_events())
        if events:
            self._map_events(events, request, (out, targets), checkpoints)
        return out

    def _external_loaded(self, request: Request, local: int, total: int, hit_blocks: list[int]) -> None:
        """A connector load of tokens [local, total): touch the tier's entries, and, as
        kvtrace's manager does, one ``external`` state write and copy event per block the
        load added to vLLM's table (inferred: the blocks past the ``hit_blocks`` the table
        held per group, up to the load's end; a Mamba group's last one, none where the hit's
        blocks reach the load's end), and a write without a copy into an attention block the
        load continues past a hit that ends inside it."""
        rid = request.request_id
        if self._shadow is not None:
            self._shadow.coordinator._touch_external(request, local, total)
        for g, m in enumerate(self._managers):
            table = m.req_to_blocks.get(rid, ())
            bs = self._block_size[g]
            last = min(cdiv(total, bs), len(table))
            if g in self._mamba:
                first = last - 1 if cdiv(total, bs) > hit_blocks[g] else last
            else:
                first = min(hit_blocks[g], last)
                tail = local // bs
                if local % bs and total > local and tail < len(table) and not table[tail].is_null:
                    self._writes.append(StateWrite(rid, g, table[tail].block_id, min((tail + 1) * bs, total),
                                                   STATE_EXTERNAL))
            for i in range(max(first, 0), last):
                block = table[i]
                if block.is_null:  # a sliding window's skipped blocks: nothing loaded (kvtrace's allocates none)
                    continue
                self._writes.append(StateWrite(rid, g, block.block_id, min((i + 1) * bs, total), STATE_EXTERNAL))
                if self._listeners:
                    self._events.append(BlockCopied(self.step, rid, g, -1, block.block_id, COPY_EXTERNAL))

    @vllm_call("KVCacheManager.free")
    def free(self, request: Request | str, finished: bool | None = None) -> None:
        """Free the request's blocks; ``finished`` defaults to the engine request's status."""
        rid = request if isinstance(request, str) else request.request_id
        if finished is None:
            finished = getattr(request, "status", "finished") == "finished"
        if self._listeners:
            for g, m in enumerate(self._managers):
                ids = tuple([b.block_id for b in reversed(m.req_to_blocks.get(rid, ())) if not b.is_null])
                if ids:
                    self._events.append(BlocksFreed(self.step, rid, g, ids))
        super().free(request, finished=finished)
        self._drain(None)
        if finished:
            self.forget(rid)
            self._index.pop(rid, None)

    @vllm_call("taking the step's copy-on-write copies")
    def take_block_copies(self) -> list[BlockCopy]:
        copies = []
        for c in super().take_block_copies():
            rid, why = self._copy_owner.pop((c.group_id, c.src, c.dst), ("", COPY_RUNNING_TAIL))
            copies.append(BlockCopy(c.group_id, c.src, c.dst, rid, why))
            if self._listeners:
                self._events.append(BlockCopied(self.step, rid, c.group_id, c.src, c.dst, why))
            if why == COPY_RUNNING_TAIL:
                self._moved(c, rid)
        return copies

    def _moved(self, copy: BlockCopy, request_id: str) -> None:
        """The keys vLLM moved to the copy block (silently): re-point them, emit the pair."""
        dst = self.block_pool.blocks[copy.dst]
        keys = ([dst.block_hash] if dst.block_hash is not None else []) + sorted(
            self.block_pool.cached_block_hashes_by_block.get(copy.dst, ()))
        hashes = []
        step = self.step
        born = -1  # the latest publish on the source block (kvtrace's pool keeps one a block)
        for key in keys:
            h = bytes(self.api.get_block_hash(key))
            for rec in self._published.get((copy.group_id, self._convert(h)), ()):
                if rec[1] == copy.src:
                    # the entry is published on the copy now, as kvtrace's pool re-stamps it: a later
                    # eviction's age counts from the move (it counted from the first publish, one more)
                    rec[1], born, rec[2] = copy.dst, max(born, rec[2]), step
            hashes.append(h)
        if hashes and self._listeners:
            n = len(hashes)
            ntok = self._num_tokens.get((copy.group_id, hashes[-1]), 0)
            # ages: steps since the source's publish (0 where the adapter saw none), as kvtrace's pool
            self._events.append(BlockEvicted(step, copy.group_id, EVICT_MOVED, (copy.src,) * n, tuple(hashes),
                                             (step - born if born >= 0 else 0,) * n, (IDLE_UNKNOWN,) * n,
                                             request_id))
            self._events.append(BlockPublished(self.step, request_id, copy.group_id, PUBLISH_MOVED,
                                               (copy.dst,) * n, tuple(hashes), ntok))

    def take_state_writes(self) -> list[StateWrite]:
        out, self._writes = self._writes, []
        return out

    # -- what the audit and the step spans read -------------------------------------------
    def cached_entries(self) -> Iterator[tuple[int, bytes, int, int]]:
        """(group, block hash, block id, prefix tokens) of every key in vLLM's prefix cache
        whose publish the adapter saw."""
        get_group, get_hash = self.api.get_group_id, self.api.get_block_hash
        for key, value in list(self.block_pool.cached_block_hash_to_block._cache.items()):
            g, h = get_group(key), bytes(get_hash(key))
            ntok = self._num_tokens.get((g, h))
            if ntok is None:
                continue
            for block in ([value] if not isinstance(value, dict) else list(value.values())):
                yield g, h, block.block_id, ntok

    @property
    @vllm_call("KVCacheManager.usage")
    def usage(self) -> tuple[float, ...]:  # type: ignore[override]
        """vLLM's ``usage``, split over the groups (they sum to it): one group takes it all;
        several share it in proportion to the non-null blocks their requests' tables hold
        (inferred: vLLM's pool does not record a block's group, and a shared block counts
        once per table)."""
        total = self.manager.usage
        if self.num_groups == 1:
            return (total,)
        held = []
        for m, padded in zip(self._managers, self._padded):
            tables = m.req_to_blocks.values()
            if padded:
                held.append(sum(1 for t in tables for b in t if not b.is_null))
            else:
                held.append(sum(map(len, tables)))
        n = sum(held)
        return tuple(total * h / n if n else 0.0 for h in held)


_MASK64 = (1 << 64) - 1


def _low64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & _MASK64


def event_hash_function(api: VllmAPI):
    """A block hash as vLLM's KV events carry it: vLLM's ``maybe_convert_block_hash``
    reads an environment variable per call (a third of a replay's event cost), so its
    result is decided once and the conversion done here when it is the low 64 bits."""
    probe = bytes(range(32))
    vllm = api.maybe_convert_block_hash
    if vllm(probe) == _low64(probe):
        return _low64
    if vllm(probe) == probe:
        return lambda block_hash: block_hash
    return vllm


def api_checkpoint_rule(api: VllmAPI):
    """vLLM's worker-side prefill checkpoint rule for one Mamba manager:
    ``rule(manager, seq_lens, query_lens) -> (offsets, cols)``."""
    compute = api.compute_mamba_prefill_checkpoints

    def rule(m: Any, seq_lens: Sequence[int], query_lens: Sequence[int]) -> tuple[list[int], list[int]]:
        spec = m.kv_cache_spec
        return compute(list(seq_lens), list(query_lens), hash_block_size=m.block_pool.hash_block_size,
                       mamba_block_size=spec.block_size, checkpoint_alignment=spec.prefill_checkpoint_alignment,
                       drop_eagle_block=False, cache_hit_alignment_tokens=m.cache_hit_alignment_tokens,
                       num_hash_lookahead_tokens=m.block_pool.num_hash_lookahead_tokens)

    return rule
