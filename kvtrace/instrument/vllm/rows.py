"""vLLM KV event batches -> span rows in the store schema.

Each batch is a ``kvtrace.engine.step`` span (``step``: the batch's seq, offset past the
steps of earlier publisher lifetimes so it is unique in a run) parenting one span per
event, all at the batch's timestamp, ``source = 'vllm'``:
``BlockStored`` -> ``kvtrace.cache.publish`` (``publish_kind = 'vllm_stored'``),
``BlockRemoved`` -> ``kvtrace.cache.evict`` (``evict_reason = 'vllm_removed'``),
``AllBlocksCleared`` -> ``kvtrace.cache.evict`` (``evict_reason = 'reset'``, no blocks).

Attributes are keyed by the store schema's own OTel keys (``ATTRIBUTE_COLUMNS``, looked
up by column name), so they land in the typed columns. The few vLLM facts without a
column are named here and kept in ``extra_attributes`` (the endpoint in the resource).

A batch becomes its own table as it is added, so a batch with a value the store cannot
hold is refused alone (``UnstorableValue``) and can never fail a later flush holding
other batches.
"""

from __future__ import annotations

import itertools
from typing import Any

import pyarrow as pa

from kvtrace import __version__
from kvtrace.cache.events import EVICT_RESET
from kvtrace.instrument.batch import conform
from kvtrace.instrument.convert import SpanRowsBuilder
from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.vllm.wire import BLOCK_REMOVED, BLOCK_STORED, MEDIUM_KEY_CHARS, KVEventBatch
from kvtrace.store.schema import ATTRIBUTE_COLUMNS, MAX_SPAN_COUNT, SOURCE_VLLM, SPAN_EVICT, SPAN_PUBLISH, SPAN_STEP

SCOPE_NAME = "kvtrace.instrument.vllm"
PUBLISH_KIND_VLLM = "vllm_stored"
EVICT_REASON_VLLM = "vllm_removed"
EVICT_REASON_RESET = EVICT_RESET

# vLLM facts without a typed column (stored in extra_attributes / resource_attributes).
DP_RANK_KEY = "kvtrace.vllm.dp_rank"  # the DP rank that published the batch
NUM_EVENTS_KEY = "kvtrace.vllm.num_events"  # on the step span: events in the batch
LORA_NAME_KEY = "kvtrace.vllm.lora_name"
ENDPOINT_KEY = "kvtrace.vllm.endpoint"  # resource: the PUB endpoint captured
# Chain depths kept at most: a server's pool holds tens of thousands of blocks, and a
# BlockRemoved lost in a gap (or a publisher that never sends one) would grow the table
# for good (about 130 MB a million). Past the cap the oldest entries go first: a chain
# rooted there has no num_tokens, as one whose root this capture never saw.
MAX_TRACKED_BLOCKS = 1 << 21

_KEY_OF_COLUMN = {column: key for key, column in ATTRIBUTE_COLUMNS.items()}


def _key(column: str) -> str:
    """The OTel attribute key the store keeps in ``column``."""
    return _KEY_OF_COLUMN[column]


SOURCE, STEP, GROUP = _key("source"), _key("step"), _key("group_id")
MEDIUM, BLOCK_HASHES, NUM_TOKENS = _key("medium"), _key("block_hashes"), _key("num_tokens")
PUBLISH_KIND, EVICT_REASON = _key("publish_kind"), _key("evict_reason")
PARENT_BLOCK_HASH, TOKEN_IDS, BLOCK_SIZE = _key("parent_block_hash"), _key("token_ids"), _key("block_size")
LORA_ID, SPEC_KIND = _key("lora_id"), _key("kv_cache_spec_kind")


class VllmSpanRows:
    """Batches -> store rows (one step span per batch, one child span per event).

    ``dp_rank``: the endpoint's rank, for payloads that do not carry one. ``num_tokens``
    of a publish is its chain depth (blocks from a root this capture saw) x block size;
    a chain whose root was never seen has none.

    A hybrid model's server publishes the same hash for a prefix in each KV cache group
    (``group_idx``), every group at its own block size, and removes it from one group
    while another still holds it. So a hash's depth is kept with the block size it is
    counted in (a prefix's tokens are the same in every group), and it is
    forgotten only when no group holds it any more. (Kept in blocks alone, a 32-token
    group's depth of 2 stood for 2 of a 16-token group's blocks: a 96-token prefix said
    64; and one group's BlockRemoved cost the other groups' children their num_tokens.)

    A server that offloads blocks to a second tier publishes that tier's stores and removals
    in the same stream, ``medium`` naming it ("CPU", "STORAGE"): a group in a tier is held
    apart from the same group on the GPU (the CPU dropping its copy cost the GPU's children
    their num_tokens), and a store with no parent and no tokens (the OffloadingConnector's
    placeholder for a block whose metadata it lacks) says nothing of its depth (taken as a
    root, it set the block's depth to one: a child's 64-token prefix said 32).
    """

    def __init__(self, ids: SeededIdGenerator, resource: dict[str, str], dp_rank: int | None = None):
        self.ids = ids
        self.resource = resource
        self.dp_rank = dp_rank
        self.rows = SpanRowsBuilder()
        self.spans = 0
        # hash -> (blocks from the root, the block size they count, the groups holding it as bits)
        self.depth: dict[str, tuple[int, int, int]] = {}
        self._group_bits: dict[tuple[str | None, int | None], int] = {}
        self._tables: list[pa.Table] = []

    def _row(self, **kwargs: Any) -> None:
        self.rows.add(resource=self.resource, scope_name=SCOPE_NAME, scope_version=__version__, **kwargs)

    def add(self, step: int, batch: KVEventBatch) -> None:
        """The batch's spans, as one table kept for ``take``. UnstorableValue (nothing of
        the batch kept, the chain depths unchanged) when a value cannot be stored."""
        depth = _Undoable(self.depth)
        try:
            self._add(step, batch, depth)
            table = self.rows.to_table(full=False)
        except BaseException:
            self.rows.truncate(0)
            depth.undo()
            raise
        self.spans += table.num_rows
        self._tables.append(table)
        excess = len(self.depth) - MAX_TRACKED_BLOCKS
        if excess > 0:
            for h in list(itertools.islice(self.depth, excess)):  # (insertion order: the oldest first)
                del self.depth[h]

    def _group_bit(self, medium: str | None, group_idx: int | None) -> int:
        """The bit standing for a KV cache group in one tier (``medium``) in ``depth`` (the
        64th and later share the last bit, unrecorded: a hash one of them removes may be
        forgotten early, never misstated, and a stream of distinct values grows nothing)."""
        key = (medium if medium is None else medium[:MEDIUM_KEY_CHARS], group_idx)  # (a 16 MiB medium kept 63 times)
        bit = self._group_bits.get(key)
        if bit is None:
            if len(self._group_bits) >= 63:
                return 1 << 63
            bit = self._group_bits[key] = 1 << len(self._group_bits)
        return bit

    def _add(self, step: int, batch: KVEventBatch, depth: _Undoable) -> None:
        t = round(batch.ts * 1e9)
        trace_id, step_span = self.ids.generate_trace_id(), self.ids.generate_span_id()
        common: dict[str, Any] = {SOURCE: SOURCE_VLLM, STEP: step}
        rank = batch.dp_rank if batch.dp_rank is not None else self.dp_rank
        if rank is not None:
            common[DP_RANK_KEY] = rank
        self._row(name=SPAN_STEP, trace_id=trace_id, span_id=step_span, start_ns=t, end_ns=t,
                  attributes={**common, NUM_EVENTS_KEY: len(batch.events)})
        for ev in batch.events:
            attrs = dict(common)
            if ev.group_idx is not None:
                attrs[GROUP] = ev.group_idx
            if ev.medium is not None:
                attrs[MEDIUM] = ev.medium
            if ev.kind == BLOCK_STORED:
                name = SPAN_PUBLISH
                attrs[PUBLISH_KIND] = PUBLISH_KIND_VLLM
                attrs[BLOCK_HASHES] = ev.block_hashes
                for key, value in ((PARENT_BLOCK_HASH, ev.parent_block_hash), (TOKEN_IDS, ev.token_ids),
                                   (BLOCK_SIZE, ev.block_size), (LORA_ID, ev.lora_id), (LORA_NAME_KEY, ev.lora_name),
                                   (SPEC_KIND, ev.kv_cache_spec_kind)):
                    if value is not None:
                        attrs[key] = value
                bs, bit = ev.block_size or 0, self._group_bit(ev.medium, ev.group_idx)
                parent = None if ev.parent_block_hash is None else depth.get(ev.parent_block_hash)
                root = ev.parent_block_hash is None and ev.token_ids != []  # (a placeholder's depth is unknown)
                base = 0 if root else None if parent is None else parent[0]
                if parent is not None and bs and parent[1] and parent[1] != bs:  # (counted in another group's blocks)
                    tokens = parent[0] * parent[1]
                    base = tokens // bs if tokens % bs == 0 else None
                if base is not None:
                    for i, h in enumerate(ev.block_hashes):
                        held = depth.get(h)
                        depth.set(h, (base + i + 1, bs, (0 if held is None else held[2]) | bit))
                    tokens = (base + len(ev.block_hashes)) * bs
                    # (kvtrace's own figure, no value vLLM sent: past what a span may count it is left
                    # out, where it refused the batch whole, a valid publish stored nowhere)
                    if bs and ev.block_hashes and tokens <= MAX_SPAN_COUNT:
                        attrs[NUM_TOKENS] = tokens
            elif ev.kind == BLOCK_REMOVED:
                name = SPAN_EVICT
                attrs[EVICT_REASON] = EVICT_REASON_VLLM
                attrs[BLOCK_HASHES] = ev.block_hashes
                bit = self._group_bit(ev.medium, ev.group_idx)
                for h in ev.block_hashes:
                    held = depth.get(h)
                    if held is not None and held[2] & ~bit:  # (another group still holds it)
                        depth.set(h, (held[0], held[1], held[2] & ~bit))
                    else:
                        depth.pop(h)
            else:
                name = SPAN_EVICT
                attrs[EVICT_REASON] = EVICT_REASON_RESET
                depth.clear()
            self._row(name=name, trace_id=trace_id, span_id=self.ids.generate_span_id(), parent_span_id=step_span,
                      start_ns=t, end_ns=t, attributes=attrs)

    def take(self) -> pa.Table | None:
        """The rows added since the last call, as one table (None when there are none; the
        store makes it one chunk, ``Store.append_spans``)."""
        if not self._tables:
            return None
        tables, self._tables = self._tables, []
        return conform(pa.concat_tables(tables, promote_options="default"))


_MISSING = object()


class _Undoable:
    """A dict's changes during one batch, logged so a refused batch leaves it as it was."""

    __slots__ = ("d", "log")

    def __init__(self, d: dict[str, Any]):
        self.d: dict[str, Any] = d
        self.log: list[tuple[Any, Any]] = []

    def get(self, key: str) -> Any:
        return self.d.get(key)

    def set(self, key: str, value: Any) -> None:
        self.log.append((key, self.d.get(key, _MISSING)))
        self.d[key] = value

    def pop(self, key: str) -> None:
        self.log.append((key, self.d.pop(key, _MISSING)))

    def clear(self) -> None:
        self.log.append((_MISSING, dict(self.d)))  # a reset: rare, so a copy is fine
        self.d.clear()

    def undo(self) -> None:
        for key, old in reversed(self.log):
            if key is _MISSING:
                self.d.clear()
                self.d.update(old)
            elif old is _MISSING:
                self.d.pop(key, None)
            else:
                self.d[key] = old
        self.log.clear()
