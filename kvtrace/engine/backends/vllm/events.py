"""Both managers' KV events as comparable (operation, group, hash) entries.

vLLM's ``BlockStored`` lists the hashes it keyed (one entry each: ``("stored", group,
hash)``; an event over masked-out blocks lists none), ``BlockRemoved`` the hashes it
dropped (``("removed", group, hash)``), ``AllBlocksCleared`` is ``("cleared", -1, 0)``.
Hashes are as vLLM's events carry them (``maybe_convert_block_hash``: the low 64 bits
of the sha256 by default).

kvtrace's ``BlockPublished`` and ``BlockEvicted`` map the same way, except what vLLM
reports no event for: a key moved to a copy block (``moved``; vLLM's
``move_block_hashes`` is silent) and the external tier's own evictions (``connector``).
A ``reset`` maps to ``("cleared", -1, 0)`` once per reset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvtrace.cache.events import EVICT_CONNECTOR, EVICT_MOVED, EVICT_RESET, PUBLISH_MOVED, BlockEvicted, BlockPublished
from kvtrace.engine.backends.vllm._load import unknown_event

EventKey = tuple[str, int, Any]
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


def vllm_event_keys(events: Iterable[Any]) -> list[EventKey]:
    """vLLM KV events (from ``take_events``) as entries, in order."""
    out: list[EventKey] = []
    for ev in events:
        name = type(ev).__name__
        if name == "BlockStored":
            out.extend((STORED, ev.group_idx, h) for h in ev.block_hashes)
        elif name == "BlockRemoved":
            out.extend((REMOVED, ev.group_idx, h) for h in ev.block_hashes)
        elif name == "AllBlocksCleared":
            out.append((CLEARED, -1, 0))
        else:  # a patched vLLM's own event: nothing to compare it with
            raise unknown_event(None, ev)
    return out


def kvtrace_event_keys(events: Iterable[Any], convert: Callable[[Any], Any]) -> list[EventKey]:
    """kvtrace cache events as entries, in order; ``convert`` turns a kvtrace hash into
    vLLM's event form."""
    out: list[EventKey] = []
    reset = False
    for ev in events:
        if isinstance(ev, BlockPublished):
            if ev.kind != PUBLISH_MOVED:
                out.extend((STORED, ev.group_id, convert(h)) for h in ev.block_hashes)
        elif isinstance(ev, BlockEvicted):
            if ev.reason == EVICT_RESET:
                if not reset:
                    out.append((CLEARED, -1, 0))
                    reset = True
            elif ev.reason not in (EVICT_MOVED, EVICT_CONNECTOR):
                out.extend((REMOVED, ev.group_id, convert(h)) for h in ev.block_hashes)
    return out
