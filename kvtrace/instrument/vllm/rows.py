"""vLLM KV event batches -> span rows in the store schema.

Each batch is a ``kvtrace.engine.step`` span (``step`` = the batch's seq) parenting one
span per event, all at the batch's timestamp, ``source = 'vllm'``:
``BlockStored`` -> ``kvtrace.cache.publish`` (``publish_kind = 'vllm_stored'``),
``BlockRemoved`` -> ``kvtrace.cache.evict`` (``evict_reason = 'vllm_removed'``),
``AllBlocksCleared`` -> ``kvtrace.cache.evict`` (``evict_reason = 'reset'``, no blocks).

Attributes are keyed by the store schema's own OTel keys (``ATTRIBUTE_COLUMNS``, looked
up by column name), so they land in the typed columns. The few vLLM facts without a
column are named here and kept in ``extra_attributes`` (the endpoint in the resource).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from kvtrace import __version__
from kvtrace.cache.events import EVICT_RESET
from kvtrace.instrument.convert import SpanRowsBuilder
from kvtrace.instrument.ids import SeededIdGenerator
from kvtrace.instrument.vllm.wire import BLOCK_REMOVED, BLOCK_STORED, KVEventBatch
from kvtrace.store.schema import ATTRIBUTE_COLUMNS, SOURCE_VLLM, SPAN_EVICT, SPAN_PUBLISH, SPAN_STEP

SCOPE_NAME = "kvtrace.instrument.vllm"
PUBLISH_KIND_VLLM = "vllm_stored"
EVICT_REASON_VLLM = "vllm_removed"
EVICT_REASON_RESET = EVICT_RESET

# vLLM facts without a typed column (stored in extra_attributes / resource_attributes).
DP_RANK_KEY = "kvtrace.vllm.dp_rank"  # the DP rank that published the batch
NUM_EVENTS_KEY = "kvtrace.vllm.num_events"  # on the step span: events in the batch
LORA_NAME_KEY = "kvtrace.vllm.lora_name"
ENDPOINT_KEY = "kvtrace.vllm.endpoint"  # resource: the PUB endpoint captured

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
    """

    def __init__(self, ids: SeededIdGenerator, resource: dict[str, str], dp_rank: int | None = None):
        self.ids = ids
        self.resource = resource
        self.dp_rank = dp_rank
        self.rows = SpanRowsBuilder()
        self.spans = 0
        self.depth: dict[str, int] = {}  # hash -> blocks from the root (for num_tokens)

    def _row(self, **kwargs: Any) -> None:
        self.rows.add(resource=self.resource, scope_name=SCOPE_NAME, scope_version=__version__, **kwargs)
        self.spans += 1

    def add(self, seq: int, batch: KVEventBatch) -> None:
        t = round(batch.ts * 1e9)
        trace_id, step_span = self.ids.generate_trace_id(), self.ids.generate_span_id()
        common: dict[str, Any] = {SOURCE: SOURCE_VLLM, STEP: seq}
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
                base = 0 if ev.parent_block_hash is None else self.depth.get(ev.parent_block_hash)
                if base is not None:
                    for i, h in enumerate(ev.block_hashes):
                        self.depth[h] = base + i + 1
                    if ev.block_size and ev.block_hashes:
                        attrs[NUM_TOKENS] = (base + len(ev.block_hashes)) * ev.block_size
            elif ev.kind == BLOCK_REMOVED:
                name = SPAN_EVICT
                attrs[EVICT_REASON] = EVICT_REASON_VLLM
                attrs[BLOCK_HASHES] = ev.block_hashes
                for h in ev.block_hashes:
                    self.depth.pop(h, None)
            else:
                name = SPAN_EVICT
                attrs[EVICT_REASON] = EVICT_REASON_RESET
                self.depth.clear()
            self._row(name=name, trace_id=trace_id, span_id=self.ids.generate_span_id(), parent_span_id=step_span,
                      start_ns=t, end_ns=t, attributes=attrs)

    def take(self) -> pa.Table | None:
        """The rows added since the last call, as one table (None when there are none)."""
        return self.rows.to_table() if self.rows.n else None
