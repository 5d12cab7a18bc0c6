"""The columnar span batch every processor receives, and the per-run envelope.

``BATCH_SCHEMA`` is the store's span schema without ``run_id`` (``Store.append_spans``
fills it): what the span builder, ``SpanRowsBuilder`` and the exporters produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from kvtrace import __version__
from kvtrace.store.schema import SOURCE_REPLAY, SPAN_ARROW_SCHEMA

# Columns a producer writes (the store adds run_id).
BATCH_SCHEMA = pa.schema([f for f in SPAN_ARROW_SCHEMA if f.name != "run_id"])
SCOPE_NAME = "kvtrace.instrument"


def conform(table: pa.Table) -> pa.Table:
    """Add the batch columns a table lacks (NULL) and put them in schema order: every
    batch has one shape, whichever span kinds it holds."""
    n, have = table.num_rows, set(table.column_names)
    fields = [table.schema.field(f.name) if f.name in have else f for f in BATCH_SCHEMA]
    columns = [table.column(f.name) if f.name in have else pa.nulls(n, f.type) for f in BATCH_SCHEMA]
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))  # one table, not one per added column


class SpanBatch:
    """A columnar batch of finished spans, in the store's span schema (no run_id).

    ``parts``: one Arrow table per store span family (``FAMILY_OF_NAME``), each holding
    only the columns its spans set, in a fixed order: the store appends them without
    re-splitting or NULL padding. ``table``: all parts as one table (rows in part order).
    """

    __slots__ = ("_table", "num_spans", "parts")

    def __init__(self, parts: Sequence[pa.Table]):
        self.parts = tuple(parts)
        self.num_spans = sum(p.num_rows for p in self.parts)
        self._table: pa.Table | None = None

    @property
    def table(self) -> pa.Table:
        if self._table is None:
            table = pa.concat_tables(self.parts, promote_options="default")
            have = set(table.column_names)
            self._table = table.select([n for n in BATCH_SCHEMA.names if n in have])
        return self._table

    def __len__(self) -> int:
        return self.num_spans


@dataclass(slots=True, frozen=True)
class Envelope:
    """Per-run constants written on every span."""

    service_name: str = "kvtrace"
    scope_name: str = SCOPE_NAME
    scope_version: str = __version__
    resource_attributes: tuple[tuple[str, str], ...] = ()  # stored per row (none: NULL)
    source: str = SOURCE_REPLAY
    backend: str | None = None  # the kvtrace.backend resource attribute (None: kvtrace's own cache)
